from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis
from hypothesis import HealthCheck, settings

from costexporter.core.replay import ReplayConfig, replay
from costexporter.sources.synth import TraceBuilder
from costexporter.trainer import exitstatus

settings.register_profile(
    "default", max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "deep", max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

ROOT = Path(__file__).resolve().parent.parent
PROMTOOL = shutil.which("promtool")


def promtool_check_metrics(text: str) -> bool:
    """`promtool check metrics` on an exposition: asserts it is clean and returns True, or returns
    False when promtool is absent; the caller then skips, after its other checks, with
    `skip_unchecked_exposition()`."""
    if PROMTOOL is None:
        return False
    check = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    return True


def skip_unchecked_exposition() -> None:
    pytest.skip("promtool not installed (.ci/run installs it): the exposition was not checked")


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: two workers a core. Most tests wait on real processes, sockets and Redis rather
    than on the CPU: with one worker a core the run keeps the cores about a quarter busy."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return 2 * cores


@pytest.fixture(autouse=True)
def _process_still_clean():
    """The reporter remembers, per process, whether the process is failing (a non-zero
    `sys.exit`, an uncaught exception in a thread) and then posts no `run end`. A test that makes
    click exit 2 in-process (CliRunner) or lets a thread raise would otherwise make every later
    reporter of this pytest process skip its `run end`."""
    yield
    exitstatus.reset()


def book(b: TraceBuilder, cfg: ReplayConfig | None = None, **samples_kw) -> dict:
    """Replay a synthetic trace through the pure core; return its only job's report."""
    rep = replay(b.samples(**samples_kw), b.events, cfg or ReplayConfig())
    assert len(rep["jobs"]) == 1, rep["jobs"].keys()
    return next(iter(rep["jobs"].values()))


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The real `costexporter` command, in a child process."""
    return subprocess.run(
        [sys.executable, "-m", "costexporter.cli", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd or ROOT,
        timeout=120,
    )


def spawn_cli(*args: object, **popen_kw) -> subprocess.Popen:
    """The real `costexporter` command as a long-running child process (serve, api, watch);
    its output is dropped unless the test asks for a pipe (stdout=/stderr=subprocess.PIPE)."""
    kw: dict = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    return subprocess.Popen([sys.executable, "-m", "costexporter.cli", *map(str, args)], **{**kw, **popen_kw})


@pytest.fixture
def cli():
    return run_cli


# The shared Redis the tests use (each under its own key prefix, never flushed);
# COSTEXPORTER_TEST_REDIS_URL points them at another one (a port of your own, a database other
# than 0) when 127.0.0.1:6379 is someone else's.
SHARED_URL = os.environ.get("COSTEXPORTER_TEST_REDIS_URL") or "redis://127.0.0.1:6379/0"
if os.environ.get("COSTEXPORTER_TEST_REDIS_URL"):  # the commands the tests run default to it too
    os.environ["COSTEXPORTER_REDIS_URL"] = SHARED_URL


def drop_prefix(r, prefix: str) -> None:
    """Remove every key under `prefix:` (a test's own prefix on the shared Redis)."""
    found = list(r.scan_iter(f"{prefix}:*"))
    if found:
        r.delete(*found)


@pytest.fixture
def prefix():
    """A key prefix of this test's own on the shared Redis; its keys are removed afterwards."""
    p = f"test-{uuid.uuid4().hex[:12]}"
    yield p
    r = redis.Redis.from_url(SHARED_URL)
    drop_prefix(r, p)


@pytest.fixture
def shared():
    """The shared Redis at SHARED_URL (never flushed: tests use their own prefixes)."""
    r = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    try:
        r.ping()
    except redis.ConnectionError:
        pytest.fail(f"the shared Redis at {SHARED_URL} is not running (COSTEXPORTER_TEST_REDIS_URL)")
    return r


@pytest.fixture
def s3(tmp_path):
    """moto's S3 server (a real HTTP server speaking the S3 API) on a free port, one bucket."""
    from .redis_server import free_port

    if shutil.which("moto_server") is None:
        pytest.skip("moto[server] is not installed (the dev extra)")
    port = free_port()
    proc = subprocess.Popen(
        ["moto_server", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        import boto3

        client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + 20
        while True:
            try:
                client.create_bucket(Bucket="ledger")
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        yield (
            f"s3://ledger/costexporter?endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1",
            client,
        )
    finally:
        proc.terminate()
        proc.wait(10)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
