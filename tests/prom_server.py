"""A real Prometheus for the tests and the benches: started on a config (and a TSDB directory, by
default beside it) on a loopback port, and waited for until it answers `/-/ready`."""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")


def start(config: Path, port: int, tsdb: Path | None = None, *extra: str) -> subprocess.Popen:
    """`prometheus` of `config` on 127.0.0.1:`port`; `extra`: more flags (a retention)."""
    assert PROMETHEUS is not None, "prometheus is not installed (.ci/run installs it)"
    return subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={tsdb or config.parent / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            *extra,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def wait_ready(url: str, timeout_s: float = 60.0) -> bool:
    """Whether the Prometheus at `url` answered `/-/ready` within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as resp:
                if resp.status == 200:
                    return True
        except OSError:
            time.sleep(0.3)
    return False
