"""The API survives slow clients: a real `costexporter api` process under a low descriptor
limit, real sockets that never finish their request heads (slowloris), and a normal client."""

from __future__ import annotations

import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from .api_helpers import WINDOW, write_job
from .conftest import ROOT
from .redis_server import free_port

pytestmark = pytest.mark.serial  # timeouts measured on the wall clock

NOFILE = 256  # the server keeps its connections under this (FD_RESERVE below it)


def _limit_fds() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


def _start(prefix: str, port: int, log: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "costexporter.cli", "api", "--prefix", prefix, "--port", str(port)]
    proc = subprocess.Popen(
        [*cmd, "--listen", "127.0.0.1", "--header-timeout", "2", *extra],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
        preexec_fn=_limit_fds,
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.2)


def _half_open(port: int, n: int) -> list[socket.socket]:
    """Connections that send part of a request head, then nothing."""
    out = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"GET /api/v1/jobs HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        out.append(s)
    return out


def _closed_by_server(s: socket.socket) -> bool:
    """Whether the server closed it (what it answered before, if anything, read and dropped)."""
    s.settimeout(0.05)
    try:
        while s.recv(65536):
            pass
        return True
    except TimeoutError:
        return False
    except OSError:  # reset: closed too
        return True


def _open_fds(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def test_slow_clients_are_closed_and_a_normal_request_still_answers(shared, prefix, tmp_path):
    write_job(shared, prefix, "j1", "a")
    port = free_port()
    log = tmp_path / "api.log"
    proc = _start(prefix, port, log)
    slow: list[socket.socket] = []
    try:
        slow = _half_open(port, 400)  # more than the descriptor limit allows
        # A normal request answers while they hang on (the oldest slow ones make room for it).
        got = httpx.get(f"http://127.0.0.1:{port}/api/v1/jobs", params={"window": WINDOW}, timeout=10)
        assert got.status_code == 200 and [j["job"] for j in got.json()["jobs"]] == ["j1"]
        assert _open_fds(proc.pid) < NOFILE  # never at the limit: no accept fails
        # After the header timeout every slow one is closed by the server.
        time.sleep(3.0)
        closed = [_closed_by_server(s) for s in slow]
        assert closed and all(closed), f"{closed.count(False)} of {len(closed)} still open"
        got = httpx.get(f"http://127.0.0.1:{port}/api/v1/jobs", params={"window": WINDOW}, timeout=10)
        assert got.status_code == 200
        assert proc.poll() is None
    finally:
        for s in slow:
            s.close()
        proc.terminate()
        proc.wait(10)
    text = log.read_text()
    assert len(text.splitlines()) < 60, text[-3000:]  # bounded: no line per refused connection
    assert "Too many open files" not in text, text[-3000:]


def test_a_slow_body_is_closed_after_the_body_timeout(shared, prefix, tmp_path):
    port = free_port()
    proc = _start(prefix, port, tmp_path / "api.log", "--body-timeout", "1", "--header-timeout", "30")
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nab")
        time.sleep(0.5)
        assert not _closed_by_server(s)  # it answered; the rest of the body is still owed
        time.sleep(1.5)
        assert _closed_by_server(s)  # the body's 1 s, not the head's 30 s
        # a client that keeps its connection alive between requests is not cut mid-request
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as c:
            for _ in range(3):
                assert c.get("/healthz").status_code == 200
                time.sleep(1.0)
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_same_log_line_is_written_at_most_once_a_window():
    import logging

    from costexporter.api.server import FloodFilter

    f = FloodFilter()

    def rec() -> logging.LogRecord:
        return logging.LogRecord(
            "asyncio", logging.ERROR, __file__, 1, "socket.accept() out of system resource", None, None
        )

    passed = [f.filter(r) for r in (rec() for _ in range(10_000))]
    assert passed.count(True) == 1
    other = logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "another message", None, None)
    assert f.filter(other)
    f.window_s = 0.0
    again = rec()
    assert f.filter(again) and "9999 more like this" in again.getMessage()
