"""One poisoned job must not stop the watcher. A job name with a space in the
jobs set (the trainer ACL allows that ZADD) or a ranks entry that is a JSON list is skipped and
counted; the healthy jobs next to it are still judged, by the real `costexporter watch`."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Iterator

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from costexporter.services.watcher import WatchConfig, Watcher
from costexporter.store import keys, protocol
from costexporter.trainer.reporter import StepReporter

from ..conftest import SHARED_URL, drop_prefix

POISON_RANKS = ["[1, 2]", "3", '"gpu"', "null", '{"ts": null}', '{"host": ["a"], "ts": "x"}', "{", ""]


def _healthy(prefix: str, job: str, spool) -> None:
    rep = StepReporter(job, SHARED_URL, prefix=prefix, rank=0, world_size=1, host="h0", spool_dir=str(spool))
    rep.step(1)
    rep.step(2)
    rep.close()


def _poison(r: redis.Redis, prefix: str) -> None:
    now = time.time()
    r.zadd(keys.jobs_key(prefix), {"bad name": now, "br{ace": now, "listed": now, "": now})
    # A job whose ranks hash holds a JSON list and other non-objects, next to its real events.
    r.hset(keys.ranks_key(prefix, "listed"), mapping={"0": "[1, 2]", "1": "7", "x": "{}"})
    r.xadd(
        keys.stream_key(prefix, "listed"),
        {
            "v": "1",
            "type": "heartbeat",
            "job": "listed",
            "ts": str(now),
            "rank": "0",
            "session": "s",
            "seq": "0",
        },
    )


def test_watch_once_skips_and_counts_poisoned_jobs_and_judges_the_healthy_one(prefix, tmp_path, cli, shared):
    _healthy(prefix, f"{prefix}-ok", tmp_path)
    _poison(shared, prefix)
    r = cli("watch", "--prefix", prefix, "--once", "--port", "0")
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out[f"{prefix}-ok"]["state"] == "done"
    assert "bad name" not in out and "br{ace" not in out
    assert "Traceback" not in r.stderr
    # Visible: each skipped job is logged once with the reason.
    assert "'bad name'" in r.stderr and "skipped" in r.stderr


def test_a_poisoned_job_is_skipped_every_poll_and_counted_once(prefix, tmp_path, shared):
    _healthy(prefix, f"{prefix}-ok", tmp_path)
    _poison(shared, prefix)
    w = Watcher(WatchConfig(redis_url=SHARED_URL, prefix=prefix))
    try:
        for _ in range(3):
            decided = w.poll()
            assert decided[f"{prefix}-ok"].state == "done"
            assert w.redis_up
        assert "bad name" not in decided
        # The list-valued ranks entries are dropped; the job itself is still judged from its events.
        assert decided["listed"].state in {"running", "unknown", "crashed", "hung"}
        assert w.stats["bad_jobs"] == 3  # "bad name", "br{ace", "" (counted once per job, not per poll)
        assert w.stats["bad_registrations"] >= 2
    finally:
        w.stop()


@contextlib.contextmanager
def _own_prefix() -> Iterator[tuple[str, redis.Redis]]:
    """A key prefix for one hypothesis example (a fixture's would be shared by all of them) and
    a client of raw bytes; its keys are deleted after."""
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    r = redis.Redis.from_url(SHARED_URL)
    try:
        yield prefix, r
    finally:
        drop_prefix(r, prefix)


def _poll_once(prefix: str) -> dict:
    w = Watcher(WatchConfig(redis_url=SHARED_URL, prefix=prefix))
    try:
        decided = w.poll()
        assert w.redis_up
        return decided
    finally:
        w.stop()


@settings(max_examples=30, deadline=None)
@given(raw=st.one_of(st.sampled_from(POISON_RANKS), st.text(max_size=20)), rank=st.text(max_size=5))
def test_any_ranks_entry_never_stops_the_watcher(raw, rank):
    with _own_prefix() as (prefix, r):
        now = time.time()
        r.zadd(keys.jobs_key(prefix), {"j": now})
        r.hset(keys.ranks_key(prefix, "j"), mapping={rank or "0": raw})
        r.xadd(keys.stream_key(prefix, "j"), _heartbeat("j", now, 0))
        assert "j" in _poll_once(prefix)


def test_watch_once_exits_2_when_redis_is_unreachable(cli):
    from ..redis_server import free_port

    r = cli("watch", "--redis-url", f"redis://127.0.0.1:{free_port()}/0", "--once", "--port", "0")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "Redis" in r.stderr


pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _heartbeat(job: str, ts: float, seq: int) -> dict:
    return {
        "v": "1",
        "type": "heartbeat",
        "job": job,
        "ts": str(ts),
        "rank": "0",
        "session": "s",
        "seq": str(seq),
    }


@settings(max_examples=25, deadline=None)
@given(
    junk=st.binary(min_size=1, max_size=12).filter(lambda b: not _utf8(b)),
    field=st.sampled_from(["type", "session", "ts", "x"]),
)
def test_bytes_that_are_not_utf8_are_refused_and_counted_not_fatal(junk, field):
    """Any client with the trainer's ACL can XADD raw bytes. An entry that is not UTF-8 (in a
    value or a field name), a ranks entry and a jobs-set member of such bytes: the reader counts
    the entry refused and reads the good events on both sides of it; the watcher judges the
    job and the job next to it."""
    from costexporter.store.reader import EventReader

    with _own_prefix() as (prefix, r):
        now = time.time()
        r.zadd(keys.jobs_key(prefix), {"j": now, "k": now, junk: now})
        bad = _heartbeat("j", now, 1)
        if field == "x":
            bad = {**bad, junk: "1"}
        else:
            bad = {**bad, field: b"a" + junk}
        for job in ("j", "k"):
            key = keys.stream_key(prefix, job)
            r.xadd(key, _heartbeat(job, now - 1, 0))
            if job == "j":
                r.xadd(key, bad)
            r.xadd(key, _heartbeat(job, now, 2))
        r.hset(keys.ranks_key(prefix, "j"), mapping={junk: junk, "1": b"{" + junk})
        reader = EventReader(protocol.connect(SHARED_URL), "j", prefix)
        got = reader.read_all()
        # A type or ts that is not UTF-8 is refused; in a session or an unknown field's name the
        # bytes read as U+FFFD and the event stands (a session of its own, an unknown field).
        assert [e.seq for e in got] == ([0, 1, 2] if field in ("session", "x") else [0, 2])
        refused = {"type": "unknown_type", "ts": "rejected:bad_type", "x": "unknown_field"}
        assert field == "session" or reader.stats[refused[field]] == 1
        decided = _poll_once(prefix)
        assert {"j", "k"} <= set(decided)
        assert decided["k"].state == "running"


def _utf8(b: bytes) -> bool:
    try:
        b.decode()
    except UnicodeDecodeError:
        return False
    return True


# A trainer-writable ranks entry the agent refuses (`protocol.parse_registration`): the watcher
# refuses it too, counts it by reason, and still judges the job from its other ranks and events.
MALFORMED_RANKS = {
    "rank 70000": ("70000", {"rank": "70000", "ts": "{now}"}, "rank_out_of_range"),
    "ts nan": ("1", {"rank": "1", "ts": "nan"}, "bad_ts"),
    "rank >= world_size": ("2", {"rank": "2", "ts": "{now}"}, "rank_out_of_range"),
    "ts -5": ("1", {"rank": "1", "ts": -5}, "bad_ts"),
    "no ts": ("1", {"rank": "1"}, "bad_ts"),
}


def _malformed_job(shared: redis.Redis, prefix: str, job: str, case: str, spool) -> None:
    """Rank 0 of a two-rank job steps (its reporter registers it); the ranks hash also holds the
    malformed entry of `case`."""
    rep = StepReporter(job, SHARED_URL, prefix=prefix, rank=0, world_size=2, host="h0", spool_dir=str(spool))
    for s in (1, 2, 3):
        rep.step(s)
    key, fields, _ = MALFORMED_RANKS[case]
    entry = {"v": "1", "type": "register", "job": job, "world_size": "2", "host": "h1", "gpu": "1", **fields}
    if entry.get("ts") == "{now}":
        entry["ts"] = str(time.time())
    shared.hset(keys.ranks_key(prefix, job), key, json.dumps(entry))
    rep.close(5, end_run=False)  # the job stays running: no run end


@pytest.mark.parametrize("case", list(MALFORMED_RANKS))
def test_a_malformed_ranks_entry_is_refused_counted_and_the_job_still_judged(case, prefix, shared, tmp_path):
    from prometheus_client.exposition import generate_latest

    from costexporter.services.exporter import watch_registry

    job = f"{prefix}-j"
    _malformed_job(shared, prefix, job, case, tmp_path)
    reason = MALFORMED_RANKS[case][2]
    w = Watcher(WatchConfig(redis_url=SHARED_URL, prefix=prefix))
    try:
        st = w.poll()[job]
        assert job not in w.bad_jobs
        assert st.state == "running" and st.last_step == 3
        # Only rank 0's registration counts: the refused entry names no member and no start.
        view = w.views[job]
        assert set(view.registrations) == {0}
        assert all(r.get("ts", 1) > 0 for r in view.registrations.values())
        assert w.registrations_rejected == {(job, reason): 1}
        stored = json.loads(shared.get(keys.status_key(prefix, job)))
        assert stored["state"] == "running"
        text = generate_latest(watch_registry(w)).decode()
        assert (
            f'costexporter_registrations_rejected_total{{reason="{reason}",training_job="{job}"}} 1.0' in text
        )
    finally:
        w.stop()


def test_watch_once_judges_every_job_with_a_malformed_ranks_entry(prefix, shared, tmp_path, cli):
    """The issue's report, by the real command: each malformed entry is refused with one line,
    and every job is judged (none skipped)."""
    jobs = {}
    for i, case in enumerate(MALFORMED_RANKS):
        jobs[case] = f"{prefix}-{i}"
        _malformed_job(shared, prefix, jobs[case], case, tmp_path / str(i))
    r = cli("watch", "--prefix", prefix, "--once", "--port", "0")
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert {out[j]["state"] for j in jobs.values()} == {"running"}
    assert "skipped" not in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.count("refused") >= len(jobs)
