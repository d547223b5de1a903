"""A private 3-master Redis Cluster on free ports, for the cluster suite (tests/test_cluster.py).

Three `redis-server --cluster-enabled yes` joined by `redis-cli --cluster create`; no
persistence, everything in a temporary directory, every process stopped at the end.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis

from .redis_server import redis_server_binaries


def free_cluster_port() -> int:
    """A free port p with p + 10000 free too (the cluster bus), at most 55535."""
    for _ in range(200):
        p = random.randint(20000, 45000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", p))
                b.bind(("127.0.0.1", p + 10000))
            return p
        except OSError:
            continue
    raise RuntimeError("no free port pair for a Redis Cluster node")


class ClusterFailed(RuntimeError):
    """The cluster did not start or never reached cluster_state:ok; the message has the logs."""


class RedisCluster:
    def __init__(self, directory: Path, masters: int = 3) -> None:
        self.dir = directory
        self.ports: list[int] = []
        while len(self.ports) < masters:
            p = free_cluster_port()
            if not {p, p + 10000} & {q + d for q in self.ports for d in (0, 10000)}:
                self.ports.append(p)
        self.procs: list[subprocess.Popen] = []
        binaries = redis_server_binaries()
        if not binaries or not shutil.which("redis-cli"):
            pytest.skip("redis-server and redis-cli are not on PATH (.ci/run installs them)")
        self.binary = binaries[0]

    @property
    def url(self) -> str:
        """The URL every costexporter part takes: all seeds, cluster scheme."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def _logs(self) -> str:
        return "\n".join(
            f"--- {p}: " + (self.dir / f"{p}.log").read_text(errors="replace")[-1500:]
            for p in self.ports
            if (self.dir / f"{p}.log").exists()
        )

    def _spawn(self, port: int) -> subprocess.Popen:
        d = self.dir / str(port)
        d.mkdir(parents=True, exist_ok=True)
        return subprocess.Popen(
            [
                self.binary,
                "--port", str(port),
                "--bind", "127.0.0.1",
                "--dir", str(d),
                "--cluster-enabled", "yes",
                "--cluster-config-file", f"nodes-{port}.conf",  # kept: a restarted node rejoins
                "--cluster-node-timeout", "2000",
                "--save", "",
                "--appendonly", "no",
                "--logfile", str(self.dir / f"{port}.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def kill(self, port: int) -> None:
        """SIGKILL one master: its slots go unserved (no replicas) until `restart`."""
        p = self.procs[self.ports.index(port)]
        p.kill()
        p.wait()

    def restart(self, port: int) -> None:
        """The killed master again, empty (no persistence), with its slots (nodes.conf kept)."""
        self.procs[self.ports.index(port)] = self._spawn(port)
        self._wait_ping(port)
        self._wait_ok()

    def start(self) -> RedisCluster:
        self.procs = [self._spawn(port) for port in self.ports]
        try:
            for port in self.ports:
                self._wait_ping(port)
            create = subprocess.run(
                [
                    "redis-cli",
                    "--cluster",
                    "create",
                    *(f"127.0.0.1:{p}" for p in self.ports),
                    "--cluster-replicas",
                    "0",
                    "--cluster-yes",
                ],
                capture_output=True,
                text=True,
                timeout=60,
            )
            if create.returncode != 0:
                raise ClusterFailed(f"redis-cli --cluster create: {create.stdout}{create.stderr}")
            self._wait_ok()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ping(self, port: int) -> None:
        c = redis.Redis(port=port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                c.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise ClusterFailed(f"redis-server on {port} never answered\n{self._logs()}") from None
                time.sleep(0.05)

    def _wait_ok(self) -> None:
        """Every node says cluster_state:ok and knows all slots (the gossip has converged)."""
        deadline = time.monotonic() + 30
        while True:
            states = [redis.Redis(port=p, decode_responses=True).cluster("info") for p in self.ports]
            if all(
                s.get("cluster_state") == "ok" and int(s.get("cluster_slots_ok", 0)) == 16384 for s in states
            ):
                return
            if time.monotonic() > deadline:
                raise ClusterFailed(f"cluster never reached cluster_state:ok: {states}\n{self._logs()}")
            time.sleep(0.1)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []
