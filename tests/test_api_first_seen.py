"""A job's `first_seen` is its first start, not its last resume: each resume overwrites the ranks
hash, and the agents trim the registrations out of the event stream into the kept stream."""

from __future__ import annotations

import json
import uuid

import httpx
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from costexporter.store import keys, ledger
from costexporter.store.ledger_read import LedgerStore
from costexporter.trainer.transport import send_entries

from .api_helpers import T0, served
from .conftest import SHARED_URL


def _register(rank: int, ts: float, session: str) -> dict[str, str]:
    return {
        "type": "register",
        "rank": str(rank),
        "ts": f"{ts:.3f}",
        "host": "h",
        "gpu": str(rank),
        "session": session,
        "world_size": "2",
    }


def _steps(rank: int, ts: float, n: int) -> list[dict[str, str]]:
    return [{"type": "step", "rank": str(rank), "ts": f"{ts + i:.3f}", "step": str(i)} for i in range(n)]


def _trim_all(r: redis.Redis, prefix: str, job: str) -> None:
    """What an agent's trim does once every reader is past the whole stream."""
    top = r.xrevrange(keys.stream_key(prefix, job), count=1)
    sid = top[0][0]
    ms, seq = sid.split("-")
    ledger.trim_keeping(r, prefix, job, f"{ms}-{int(seq) + 1}")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    runs=st.lists(st.tuples(st.integers(1, 5000), st.integers(0, 40), st.booleans()), min_size=1, max_size=5),
    ranks=st.integers(1, 3),
)
def test_first_seen_is_the_first_start_through_resumes_and_trims(runs, ranks):
    """Runs of a job: each (gap after the previous run, steps, trimmed after) registers every
    rank again later. `first_seen` stays the first run's register whatever the trims did."""
    r = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    prefix, job = f"test-{uuid.uuid4().hex[:12]}", "resumed"
    store = LedgerStore(r, prefix)
    try:
        t = float(T0)
        for k, (gap, steps, trimmed) in enumerate(runs):
            t += gap
            for rank in range(ranks):
                send_entries(
                    r, prefix, job, [_register(rank, t + rank, f"s{k}"), *_steps(rank, t + 10, steps)]
                )
            if trimmed:
                _trim_all(r, prefix, job)
            first = store.first_seen_many([job], store.info_many([job]))[job]
            assert first == T0 + runs[0][0]  # rank 0's first register
        # the ranks hash alone says the last resume: what `first_seen` used to be
        assert min(float(x["ts"]) for x in _ranks(r, prefix, job)) == t
    finally:
        for key in r.scan_iter(f"{prefix}:*"):
            r.delete(key)


def _ranks(r: redis.Redis, prefix: str, job: str) -> list[dict]:
    return [json.loads(v) for v in r.hvals(keys.ranks_key(prefix, job))]


def test_jobs_endpoint_keeps_first_seen_after_a_restart(prefix):
    """Over HTTP: a job started at T0, trimmed, restarted an hour later."""
    r = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    send_entries(r, prefix, "llm", [_register(0, T0, "a"), *_steps(0, T0 + 5, 3)])
    _trim_all(r, prefix, "llm")
    send_entries(r, prefix, "llm", [_register(0, T0 + 3600, "b"), *_steps(0, T0 + 3605, 3)])
    send_entries(r, prefix, "fresh", [_register(0, T0 + 7200, "c")])
    with served(LedgerStore(r, prefix), cache_s=0) as (base, _app):
        jobs = httpx.get(f"{base}/api/v1/jobs").json()["jobs"]
        page = httpx.get(f"{base}/api/v1/jobs", params={"limit": 1}).json()
        nxt = httpx.get(f"{base}/api/v1/jobs", params={"limit": 1, "cursor": page["next_cursor"]}).json()
    seen = {j["job"]: j["first_seen"] for j in jobs}
    assert seen == {"llm": "2025-07-26T12:00:00Z", "fresh": "2025-07-26T14:00:00Z"}
    assert [(j["job"], j["first_seen"]) for j in page["jobs"] + nxt["jobs"]] == sorted(seen.items())
    assert nxt["next_cursor"] is None


def test_first_seen_survives_junk_in_the_streams(prefix):
    """A kept stream of the wrong type or a register without a time is skipped, never a 500:
    `first_seen` falls back to what still parses."""
    r = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    r.xadd(keys.stream_key(prefix, "j"), {"type": "register", "rank": "0", "ts": "soon"})
    send_entries(r, prefix, "j", [_register(0, T0 + 60, "a")])
    r.set(keys.kept_key(prefix, "j"), "not a stream")
    store = LedgerStore(r, prefix)
    assert store.first_seen_many(["j"], store.info_many(["j"]))["j"] == T0 + 60
