"""`serve`'s late-data options reach the agent, and bad values are a one-line usage error."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from costexporter.cli.main import main
from costexporter.services import agent as agent_mod
from costexporter.sources.synth import TraceBuilder, write_nvidia_smi_csv


class _Captured(Exception):
    pass


@pytest.fixture
def trace(tmp_path):
    b = TraceBuilder(n_gpus=1, per_host=1, job="-", register=False, seed=3, host_prefix="n")
    b.stretch("idle", 5)
    return write_nvidia_smi_csv(b.samples(), tmp_path)[0]


def _config_of(monkeypatch, trace, *flags) -> agent_mod.AgentConfig:
    seen = {}

    class Recorder:
        def __init__(self, source, cfg):
            seen["cfg"] = cfg
            raise _Captured

    monkeypatch.setattr(agent_mod, "Agent", Recorder)
    args = ["serve", "--source", "replay", "--samples", f"n0={trace}", "--port", "0", *flags]
    result = CliRunner().invoke(main, args)
    assert isinstance(result.exception, _Captured), result.output
    return seen["cfg"]


def test_late_data_options_reach_the_agent(monkeypatch, trace):
    default = _config_of(monkeypatch, trace)
    assert (default.event_lag_s, default.unassigned_hold_s) == (0.0, 600.0)
    cfg = _config_of(monkeypatch, trace, "--event-lag", "45", "--unassigned-hold", "1800")
    assert (cfg.event_lag_s, cfg.unassigned_hold_s) == (45.0, 1800.0)


def test_trimming_options_reach_the_agent(monkeypatch, trace):
    default = _config_of(monkeypatch, trace)
    assert (default.trim_streams, default.late_keep_s) == (True, 3600.0)
    cfg = _config_of(monkeypatch, trace, "--no-trim", "--late-keep", "7200")
    assert (cfg.trim_streams, cfg.late_keep_s) == (False, 7200.0)


@pytest.mark.parametrize("flag", ["--event-lag", "--unassigned-hold", "--late-keep"])
def test_a_negative_wait_is_a_usage_error(trace, flag):
    result = CliRunner().invoke(main, ["serve", "--source", "replay", "--samples", str(trace), flag, "-5"])
    assert result.exit_code == 2 and flag in result.output and "Traceback" not in result.output


@pytest.mark.parametrize(
    "args",
    [["serve", "--source", "sim"], ["watch", "--once"], ["api"], ["keys", "status"], ["preflight"]],
    ids=lambda a: a[0] if a[0] != "keys" else "keys-status",
)
def test_a_url_that_is_not_a_redis_one_is_a_usage_error_without_its_password(args):
    """`--redis-url http://...` was an "internal error" with a traceback: now one line (exit 2)
    naming the schemes, the password left out."""
    r = CliRunner().invoke(main, [*args, "--redis-url", "http://user:s3cret@cache:6379/0"])
    assert r.exit_code == 2, r.output
    assert len(r.output.strip().splitlines()) == 1, r.output
    assert "--redis-url 'http://cache:6379/0' is not a Redis URL (redis://, rediss://, unix://" in r.output
    assert "s3cret" not in r.output and "Traceback" not in r.output and "internal error" not in r.output


def test_the_api_port_is_held_from_the_check_until_the_api_serves_on_it(shared, prefix):
    """`--api-port` is bound when the flags are checked: while the agent starts, nothing else can
    take it (an outgoing connection's ephemeral port did, and the API thread died unseen), and
    the API thread answers on that same socket."""
    import socket
    import time

    import httpx

    from costexporter.cli.options import bind_port
    from costexporter.cli.servers import api_app, serve_in_thread

    from .conftest import SHARED_URL
    from .redis_server import free_port

    assert bind_port("127.0.0.1", 0, "--api-port") is None  # 0: no API
    port = free_port()
    sock = bind_port("127.0.0.1", port, "--api-port")
    assert sock is not None
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", port))
    serve_in_thread(api_app(SHARED_URL, prefix, None, "USD", "UTC"), sock)
    deadline = time.monotonic() + 20
    while True:
        try:
            r = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
            break
        except httpx.TransportError:
            assert time.monotonic() < deadline, "the API thread never answered on the held port"
            time.sleep(0.05)
    assert r.status_code == 200
