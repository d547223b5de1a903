"""A reporter registers again when Redis restarted empty: an agent started after the restart
finds the rank's registration and meta (a real redis-server killed and started empty)."""

from __future__ import annotations

import json
import time

from costexporter.store import keys
from costexporter.store.reader import EventReader
from costexporter.trainer.reporter import StepReporter

from .redis_server import RedisServer, free_port


def _wait(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_redis_restarted_empty_gets_the_register_and_meta_again(tmp_path):
    port = free_port()
    server = RedisServer(tmp_path / "a", port=port).start()
    rep = StepReporter(
        "rereg",
        server.url,
        prefix="p",
        rank=1,
        world_size=2,
        gpu_index=3,
        spool_dir=tmp_path / "spool",
        heartbeat_s=3600,
        flush_interval_s=0.02,
    )
    try:
        rep.meta(team="llm", price_per_gpu_hour=2.5)
        rep.step(1, tokens=10)
        assert rep.flush(10)
        first = json.loads(server.client().hget(keys.ranks_key("p", "rereg"), "1"))
        assert rep.stats["registered_again"] == 0  # its first batch held the register
        server.kill()
        server = RedisServer(tmp_path / "b", port=port).start()  # same port, nothing kept
        r = server.client()
        rep.step(2, tokens=10)
        _wait(lambda: r.hget(keys.ranks_key("p", "rereg"), "1") is not None)
        again = json.loads(r.hget(keys.ranks_key("p", "rereg"), "1"))
        assert {k: again[k] for k in ("ts", "gpu", "session", "rank")} == {
            k: first[k] for k in ("ts", "gpu", "session", "rank")
        }  # the first register's time: the rank's GPU time still starts there
        assert int(again["seq"]) > int(first["seq"])  # a new entry, read as one
        _wait(lambda: r.hget(keys.meta_key("p", "rereg"), "team") == "llm")
        assert float(r.hget(keys.meta_key("p", "rereg"), "price_per_gpu_hour")) == 2.5
        assert rep.flush(10) and rep.stats["registered_again"] == 1
        types = [e.type for e in EventReader(r, "rereg", prefix="p").read_all()]
        assert types.count("register") == 1 and "meta" in types and "step" in types
        rep.step(3)
        assert rep.flush(10) and rep.stats["registered_again"] == 1  # once, not every batch
    finally:
        rep.close(end_run=False)
        server.stop()
