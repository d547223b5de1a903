"""The command line's first hour: --config refuses what it does not know, environment variables
follow one naming rule (older names still read, with a line), action flags are not read from the
environment, bad choices exit 2 with the choices, and a fresh Redis gets no false start-up line."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import click
import pytest
import redis

from costexporter.cli.main import main
from costexporter.cli.options import DEPRECATED_ENV, config_defaults, env_name
from costexporter.store import keys, ledger

from .conftest import ROOT, SHARED_URL, drop_prefix, spawn_cli
from .redis_server import free_port

EXAMPLE = ROOT / "examples" / "r1-mini"


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "costexporter.cli", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def replay_args(*extra: str) -> list[str]:
    return [
        "replay",
        "--samples",
        str(EXAMPLE / "node0.csv"),
        "--samples",
        str(EXAMPLE / "node1.csv"),
        "--events",
        str(EXAMPLE / "events.jsonl"),
        "--format",
        "json",
        *extra,
    ]


def total_cost(out: str) -> float:
    import json

    return float(json.loads(out)["jobs"]["qwen3-mini"]["cost_total"])


@pytest.mark.parametrize(
    "text,named",
    [
        ("replay: {price_per_gpu_hr: 4}\n", "replay.price_per_gpu_hr"),
        ("replayy: {price_per_gpu_hour: 4}\n", "replayy"),
        ("replay: {price_per_gpu_hour: 4, bogus: 1, other_typo: 2}\n", "replay.bogus, replay.other_typo"),
        ("events: {export: {nope: 1}}\n", "events.export.nope"),
    ],
)
def test_config_refuses_unknown_commands_and_options_naming_them(tmp_path, text, named):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    for args in (["--config", cfg, *replay_args()], [*replay_args(), "--config", cfg]):
        r = run(*args)
        assert r.returncode == 2, r.stderr
        assert named in r.stderr and "known" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and r.stdout == ""


def test_config_keys_are_option_names_as_on_the_command_line(tmp_path):
    """`price-per-gpu-hour`, `price_per_gpu_hour` and the flag's own name (`format` for the
    parameter `fmt`) are all the same key; each changes the output it should."""
    import json

    assert json.loads(run(*replay_args()).stdout)["currency"] == "USD"
    for text in ("replay: {currency: EUR}\n", "replay: {currency: EUR, price-per-kwh: 0.2}\n"):
        cfg = tmp_path / "c.yaml"
        cfg.write_text(text)
        r = run("--config", cfg, *replay_args())
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["currency"] == "EUR"
    cfg = tmp_path / "f.yaml"
    cfg.write_text("replay: {format: csv}\n")
    r = run(
        "replay", "--samples", EXAMPLE / "node0.csv", "--events", EXAMPLE / "events.jsonl", "--config", cfg
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("job,category,kind,gpu_hours")


def test_config_defaults_walks_every_command_of_the_group():
    """Every option of every command is a key its section accepts (nothing the CLI takes is
    refused), and the keys map to the parameter names click looks up."""
    checked = 0

    def walk(cmd: click.Command, path: list[str]) -> None:
        nonlocal checked
        if isinstance(cmd, click.Group):
            for name, sub in cmd.commands.items():
                walk(sub, [*path, name])
            return
        section = {}
        for p in cmd.params:
            if isinstance(p, click.Option) and p.expose_value and p.name != "help":
                flag = next(o for o in p.opts if o.startswith("--"))
                section[flag[2:]] = p.default
        data: dict = section
        for name in reversed(path):
            data = {name: data}
        got = config_defaults(main, data, "test")
        for name in path:
            got = got[name]
        assert set(got) == {p.name for p in cmd.params if isinstance(p, click.Option) and p.name in got}
        assert len(got) == len(section)
        checked += 1

    walk(main, [])
    assert checked >= 10


def test_environment_variables_follow_the_flag_and_old_names_still_work_with_a_line(tmp_path):
    # The rule, for every option of every command.
    assert env_name(["replay"], next(p for p in main.commands["replay"].params if p.name == "fmt")) == (
        "COSTEXPORTER_REPLAY_FORMAT"
    )
    assert DEPRECATED_ENV["COSTEXPORTER_REPLAY_FMT"] == "COSTEXPORTER_REPLAY_FORMAT"
    assert DEPRECATED_ENV["COSTEXPORTER_DEMO_AS_JSON"] == "COSTEXPORTER_DEMO_JSON"
    assert DEPRECATED_ENV["COSTEXPORTER_REPLAY_PROFILE_PATH"] == "COSTEXPORTER_PROFILE"
    args = ["replay", "--samples", EXAMPLE / "node0.csv", "--events", EXAMPLE / "events.jsonl"]
    new = run(*args, env={"COSTEXPORTER_REPLAY_FORMAT": "json"})
    assert new.returncode == 0 and new.stdout.lstrip().startswith("{"), new.stderr
    assert "deprecated" not in new.stderr
    old = run(*args, env={"COSTEXPORTER_REPLAY_FMT": "json"})
    assert old.returncode == 0 and old.stdout == new.stdout
    assert "$COSTEXPORTER_REPLAY_FMT is deprecated: use $COSTEXPORTER_REPLAY_FORMAT" in old.stderr
    both = run(*args, env={"COSTEXPORTER_REPLAY_FMT": "csv", "COSTEXPORTER_REPLAY_FORMAT": "json"})
    assert both.stdout == new.stdout and "COSTEXPORTER_REPLAY_FMT is ignored" in both.stderr
    help_text = " ".join(run("replay", "--help").stdout.split())
    assert "COSTEXPORTER_REPLAY_FORMAT" in help_text and "COSTEXPORTER_PROFILE" in help_text


def test_the_old_profile_directory_variable_is_read_with_a_deprecation_line(tmp_path):
    missing = tmp_path / "none"
    r = run(
        "replay",
        "--samples",
        EXAMPLE / "node0.csv",
        "--events",
        EXAMPLE / "events.jsonl",
        env={"COSTEXPORTER_PROFILE_DIR": str(missing)},
    )
    assert r.returncode == 2 and "COSTEXPORTER_PROFILE_DIR" in r.stderr
    assert "deprecated: use $COSTEXPORTER_PROFILE" in r.stderr


def test_a_hash_token_variable_in_the_environment_does_not_stop_the_api_serving(prefix):
    """`--hash-token` is an action: left in the environment it must not turn `api` into a
    one-shot hash printer that exits; the API serves."""
    import time
    import urllib.request

    port = free_port()
    proc = spawn_cli(
        "api",
        "--redis-url",
        SHARED_URL,
        "--port",
        str(port),
        "--listen",
        "127.0.0.1",
        "--prefix",
        prefix,  # the fixture's: what the API writes at its start (rollups) is removed after
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "COSTEXPORTER_API_HASH_TOKEN": "secret"},
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/jobs", timeout=2) as r:
                    assert r.status == 200
                    break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert not any(len(line.strip()) == 64 for line in out.splitlines())
    printed = run("api", "--hash-token", "secret")
    assert printed.returncode == 0 and len(printed.stdout.strip()) == 64


def test_a_bad_scenario_is_exit_2_with_the_choices():
    r = run("demo", "--scenario", "foo", "--port", "0", "--api-port", "0")
    assert r.returncode == 2
    assert "'r1'" in r.stderr and "'mini'" in r.stderr and "internal error" not in r.stderr


def test_the_demo_listens_on_loopback_unless_told():
    listen = next(p for p in main.commands["demo"].params if p.name == "listen")
    assert listen.default == "127.0.0.1"
    serve_listen = next(p for p in main.commands["serve"].params if p.name == "listen")
    assert serve_listen.default == "0.0.0.0"  # an agent is scraped from other hosts


def test_a_fresh_ledger_is_not_reported_as_older_ledgers_rolled_up():
    """A job with nothing booked gets its (empty) rollup at the API's start, uncounted: the
    start-up line names only ledgers that held amounts."""
    client = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    prefix = f"test-{uuid.uuid4().hex[:10]}"
    try:
        client.zadd(keys.jobs_key(prefix), {"fresh": 1})
        assert ledger.build_rollups(client, prefix) == 0
        assert client.hget(keys.rollup_state_key(prefix, "fresh"), "v") == "1"
    finally:
        drop_prefix(client, prefix)
