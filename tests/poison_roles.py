"""Every reader goes on past a poisoned job under its least-privilege user: a trainer (its own
`--job` ACL rule, nothing more) writes a key it may reach as another type, and the agent, the
watcher and the API, each under its generated rule on a real Redis, still book, judge and serve
another job exactly. Shared by the CI test (a few poisons per role) and the bench command that
runs the whole matrix (`python bench/bench_poison.py`)."""

from __future__ import annotations

import shlex
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import redis

from costexporter.core.model import CATEGORIES
from costexporter.core.replay import ReplayConfig, book_trace
from costexporter.services.watcher import WatchConfig, Watcher
from costexporter.sources.synth import TraceBuilder
from costexporter.store import acl, keys, ledger
from costexporter.store.ledger_read import LedgerStore

from .api_helpers import served
from .test_ledger_faults_property import HOLD_S, ROUND_S, Run

POISONED, HEALTHY = "poisoned", "healthy"

# The keys a trainer may write, each written as another type by the poisoned job's own trainer
# user (its rule lets it reach them, with the commands it has).
POISONS: dict[str, Callable[[redis.Redis, str], Any]] = {
    "events": lambda c, p: c.hset(keys.stream_key(p, POISONED), "x", "1"),
    "beats": lambda c, p: c.hset(keys.beats_key(p, POISONED), "x", "1"),
    "ranks": lambda c, p: c.xadd(keys.ranks_key(p, POISONED), {"x": "1"}),
    "meta": lambda c, p: c.xadd(keys.meta_key(p, POISONED), {"x": "1"}),
    "jobs_index": lambda c, p: c.hset(keys.jobs_key(p), POISONED, "1"),
    "registrations": lambda c, p: c.hset(keys.registrations_key(p), POISONED, "1"),
}
ROLES = ("agent", "watcher", "api")


def setuser(admin: redis.Redis, prefix: str, role: str, **kw: Any) -> str:
    """The rule `costexporter acl` prints, run as printed; returns the user's password."""
    pw = uuid.uuid4().hex
    args = acl.setuser_args(role, prefix, password=pw, **kw)
    admin.execute_command(*shlex.split(acl.setuser_line(args)))
    return f"{args[0]}:{pw}"


def client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, decode_responses=True)


def healthy_job() -> TraceBuilder:
    b = TraceBuilder(n_gpus=2, per_host=2, job=HEALTHY, seed=4)
    b.run("start")
    b.stretch("compute", 90, step_s=4, tokens=100)
    b.run("end")
    b.stretch("idle", HOLD_S + 3 * ROUND_S)
    return b


class _AsAgent(Run):
    """The faults property's rounds, the agents under the agent user, the trainer's refused side
    writes (a poisoned jobs index) going on as a reporter's do."""

    raise_on_error = False

    def __init__(self, url: str, *args: Any, **kw: Any) -> None:
        self.redis_url = url
        super().__init__(*args, **kw)


def check(port: int, admin: redis.Redis, role: str, poison: str) -> None:
    """Poison, then the role's reader under its rule: the healthy job booked (the agent), judged
    `done` (the watcher) or served with its whole ledger (the API), exactly."""
    prefix = f"poison-{uuid.uuid4().hex[:8]}"
    url = lambda who: f"redis://{who}@127.0.0.1:{port}/0"  # noqa: E731
    as_poisoner = redis.Redis.from_url(
        url(setuser(admin, prefix, "trainer", job=POISONED)), decode_responses=True
    )
    as_trainer = redis.Redis.from_url(
        url(setuser(admin, prefix, "trainer", job=HEALTHY)), decode_responses=True
    )
    POISONS[poison](as_poisoner, prefix)
    b = healthy_job()
    results, _ = book_trace(b.samples(), b.events, ReplayConfig())
    want = dict(
        zip(
            CATEGORIES,
            np.bincount(
                results[0].pieces.category, weights=results[0].pieces.dur_ms, minlength=len(CATEGORIES)
            )
            .astype(np.int64)
            .tolist(),
            strict=True,
        )
    )
    agent_url = url(setuser(admin, prefix, "agent"))
    run = _AsAgent(agent_url, as_trainer, prefix, b, [b], None)  # (the trainer posts its events)
    run.run()
    assert ledger.net_ms(ledger.read_amounts(admin, prefix, HEALTHY)) == want, (role, poison)
    if role == "watcher":
        w = Watcher(
            WatchConfig(redis_url=url(setuser(admin, prefix, "watcher")), prefix=prefix, forget_after_s=1e12)
        )
        try:
            got = w.poll()
        finally:
            w.stop()
        assert got[HEALTHY].state == "done", (poison, got)
    elif role == "api":
        reader = client(url(setuser(admin, prefix, "api")))
        window = "2025-07-26T00:00:00Z,2025-07-28T00:00:00Z"
        with served(LedgerStore(reader, prefix), cache_s=0) as (base, _app):
            one = httpx.get(f"{base}/api/v1/jobs/{HEALTHY}", params={"window": window}, timeout=20)
            listed = httpx.get(f"{base}/api/v1/jobs", timeout=20)
            alloc = httpx.get(
                f"{base}/api/v1/allocation", params={"window": window, "aggregate": "job"}, timeout=20
            )
        assert one.status_code == 200, (poison, one.text[:300])
        assert one.json()["gpu_hours"] * 3_600_000 == sum(want.values()), (poison, one.json())
        assert listed.status_code == 200 and HEALTHY in [j["job"] for j in listed.json()["jobs"]], listed.text
        assert alloc.status_code == 200, alloc.text[:300]
