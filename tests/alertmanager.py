"""Shared by the Alertmanager tests: Debian's prometheus-alertmanager (or upstream's binary) run
on a free port with a given config, ready before the test talks to it."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from .redis_server import free_port

ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")


@contextlib.contextmanager
def running_alertmanager(config: Path, storage: Path) -> Iterator[str]:
    """A real Alertmanager serving `config` (no cluster peers); yields its base URL once
    /-/ready answers, and stops it afterwards."""
    assert ALERTMANAGER is not None, "no prometheus-alertmanager on PATH"
    port = free_port()
    proc = subprocess.Popen(
        [ALERTMANAGER, f"--config.file={config}", f"--storage.path={storage}",
         f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{base}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    out = proc.communicate()[0] or ""
                    raise AssertionError("alertmanager did not start: " + out) from None
                time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
