"""The ledger's per-job rollup (ledger.ROLLUP_ADD) against the exact path (summing buckets).

Writes go through the real writer (`ledger.commit` with `ledger.queue_amounts`, as the agent's
rounds do) into the shared Redis under a prefix of the test's own; every window the rollup
answers must equal what summing the buckets answers, whatever the order of the writes, the
corrections, the agents and the price versions."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from costexporter.core.model import Category
from costexporter.store import keys, ledger
from costexporter.store.ledger_read import LedgerStore

from .api_helpers import T0
from .conftest import SHARED_URL, drop_prefix, spawn_cli
from .redis_server import free_port

ROOT = Path(__file__).resolve().parent.parent
BASE = T0 // 86400 * 86400  # a midnight: windows cross hours, days and a week's edge
N_BUCKETS = 3 * 288  # writes fall in three days of 5-minute buckets


def amounts(rng: np.random.Generator) -> np.ndarray:
    a = np.zeros((len(Category), 3), np.int64)
    for c in rng.choice(len(Category), size=3, replace=False):
        a[c] = rng.integers(0, 10**9, 3)
    return a


def write(r, prefix: str, job: str, agent: str, by_bucket: dict, version: str, voided: bool = False):
    """One round of one agent: its amounts (or a rollback's correction: the `voided:` amounts and
    the same as rolled_back) and its watermark, compare-and-set as the agent commits."""
    wm_raw = r.get(keys.watermark_key(prefix, job, agent))
    n = json.loads(wm_raw)["n"] + 1 if wm_raw else 1

    def queue(pipe) -> None:
        if voided:
            ledger.queue_amounts(pipe, prefix, job, by_bucket, version, voided=True)
            rolled = {b: np.zeros_like(a) for b, a in by_bucket.items()}
            for b, a in by_bucket.items():
                rolled[b][Category.ROLLED_BACK] = a.sum(axis=0)
            ledger.queue_amounts(pipe, prefix, job, rolled, version)
        else:
            ledger.queue_amounts(pipe, prefix, job, by_bucket, version)

    try:
        ledger.commit(r, prefix, job, agent, wm_raw, {"n": n}, queue)
    except ledger.WrongType as e:  # as the agent does: set the keys aside, then the round again
        ledger.set_aside(r, e.keys, prefix, job)
        ledger.commit(r, prefix, job, agent, wm_raw, {"n": n}, queue)


def same(a, b) -> bool:
    return (a.ms, a.mj, a.ucost, a.price_versions) == (b.ms, b.mj, b.ucost, b.price_versions)


def assert_windows_equal(r, prefix: str, job: str, windows) -> None:
    fast, exact = LedgerStore(r, prefix), LedgerStore(r, prefix, use_rollups=False)
    for s, e in windows:
        got, want = fast.window_many([job], s, e), exact.window_many([job], s, e)
        assert same(got[0][job], want[0][job]), (s, e, got[0][job], want[0][job])
        assert got[1][job] == want[1][job]


writes = st.lists(
    st.tuples(
        st.sampled_from(["agent-a", "agent-b"]),
        st.lists(st.integers(0, N_BUCKETS - 1), min_size=1, max_size=4, unique=True),
        st.booleans(),  # a rollback correction
        st.sampled_from(["v1", "v1", "v1", "v2"]),
    ),
    min_size=1,
    max_size=8,
)
windows = st.lists(
    st.tuples(st.integers(-12, N_BUCKETS + 12), st.integers(1, N_BUCKETS + 24)).map(
        lambda x: (BASE + 300 * x[0], BASE + 300 * (x[0] + x[1]))
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(writes=writes, windows=windows, seed=st.integers(0, 2**32 - 1), rebuild=st.booleans())
def test_rollup_windows_equal_the_bucket_sums(shared, writes, windows, seed, rebuild):
    """Random rounds of two agents (out of time order, corrections, a second price version) and
    random 5-minute-aligned windows: the rollup's answer is the buckets' sum, and so is the answer
    of a rollup rebuilt from the buckets."""
    prefix = f"test-rollup-{uuid.uuid4().hex[:10]}"
    rng = np.random.default_rng(seed)
    try:
        for agent, buckets, voided, version in writes:
            by_bucket = {BASE + 300 * b + int(rng.integers(0, 300)): amounts(rng) for b in buckets}
            write(shared, prefix, "job", agent, by_bucket, version, voided)
        state = shared.hget(keys.rollup_state_key(prefix, "job"), "v")
        assert state == "1"
        assert_windows_equal(shared, prefix, "job", windows)
        if rebuild:
            ledger.drop_rollup(shared, prefix, "job")
            assert ledger.build_rollup(shared, prefix, "job")
            assert_windows_equal(shared, prefix, "job", windows)
    finally:
        drop_prefix(shared, prefix)


def test_a_single_version_ledger_is_answered_from_the_rollup(shared, prefix):
    """The fast path is taken (not only equal by falling back): the buckets' sum is spoiled after
    the writes, and the rollup still answers what the writes booked."""
    rng = np.random.default_rng(1)
    by_bucket = {BASE + 300 * i: amounts(rng) for i in range(0, 570, 7)}
    write(shared, prefix, "job", "a", by_bucket, "v1")
    shared.delete(keys.bucket_key(prefix, "job", "1d", str(BASE)))
    got = LedgerStore(shared, prefix).amounts_many(["job"], BASE, BASE + 2 * 86400)["job"]
    want = sum(by_bucket.values())
    assert [got.ms[c] for c in ledger.CATEGORIES] == list(want[:, 0])
    assert got.price_versions == {"v1"}


def test_a_twin_agent_that_loses_the_watermark_writes_no_rollup(shared, prefix):
    rng = np.random.default_rng(2)
    write(shared, prefix, "job", "a", {BASE: amounts(rng)}, "v1")
    stale = shared.get(keys.watermark_key(prefix, "job", "a"))
    write(shared, prefix, "job", "a", {BASE + 300: amounts(rng)}, "v1")

    def rollup():
        return shared.hgetall(keys.rollup_state_key(prefix, "job")), shared.zrange(
            keys.rollup_key(prefix, "job"), 0, -1, withscores=True
        )

    before = rollup()
    with pytest.raises(ledger.Conflict):
        ledger.commit(
            shared,
            prefix,
            "job",
            "a",
            stale,
            {"n": 2},
            lambda pipe: ledger.queue_amounts(pipe, prefix, "job", {BASE + 600: amounts(rng)}, "v1"),
        )
    assert rollup() == before
    assert_windows_equal(shared, prefix, "job", [(BASE, BASE + 86400)])


def test_a_ledger_older_than_its_rollup_is_read_exactly_until_rebuilt(shared, prefix):
    """Without a rollup, later writes leave it absent (they cannot know the past) and reads sum
    the buckets; the rebuild makes it, and later writes keep it up to date."""
    rng = np.random.default_rng(3)
    write(shared, prefix, "job", "a", {BASE + 300 * i: amounts(rng) for i in range(5)}, "v1")
    ledger.drop_rollup(shared, prefix, "job")  # as written before rollups existed
    shared.zadd(keys.jobs_key(prefix), {"job": BASE})
    write(shared, prefix, "job", "a", {BASE + 3000: amounts(rng)}, "v1")
    assert not shared.exists(keys.rollup_key(prefix, "job"), keys.rollup_state_key(prefix, "job"))
    assert_windows_equal(shared, prefix, "job", [(BASE, BASE + 3600), (BASE + 600, BASE + 1200)])
    # The job's ledger held amounts: counted. `_unassigned` holds none here: its empty rollup is
    # made all the same, uncounted (nothing older was there to roll up).
    assert ledger.build_rollups(shared, prefix) == 1
    assert shared.hget(keys.rollup_state_key(prefix, "job"), "v") == "1"
    assert shared.hget(keys.rollup_state_key(prefix, ledger.UNASSIGNED_JOB), "v") == "1"
    assert ledger.build_rollups(shared, prefix) == 0  # once
    write(shared, prefix, "job", "a", {BASE + 900: amounts(rng)}, "v1", voided=True)
    assert_windows_equal(shared, prefix, "job", [(BASE, BASE + 3600), (BASE + 600, BASE + 1200)])


LAST = BASE + 1000  # after the four buckets: the record a window to BASE + 3600 ends on
STATE, RECORDS = keys.rollup_state_key, keys.rollup_key


@pytest.mark.parametrize(
    ("case", "spoil"),
    [
        ("record text", lambda r, p: r.zadd(RECORDS(p, "bad"), {"[1,2,x]": LAST})),
        ("record not a list", lambda r, p: r.zadd(RECORDS(p, "bad"), {'{"a": 1}': LAST})),
        ("record too short", lambda r, p: r.zadd(RECORDS(p, "bad"), {f"[{LAST},1,2]": LAST})),
        ("record a float", lambda r, p: r.zadd(RECORDS(p, "bad"), {f"[{LAST}" + ",1.5" * 30 + "]": LAST})),
        (
            "record past int64",
            lambda r, p: r.zadd(RECORDS(p, "bad"), {f"[{LAST}{',1' * 29},{'9' * 20}]": LAST}),
        ),
        ("records wrong type", lambda r, p: (r.delete(RECORDS(p, "bad")), r.set(RECORDS(p, "bad"), "x"))),
        ("state wrong type", lambda r, p: (r.delete(STATE(p, "bad")), r.set(STATE(p, "bad"), "x"))),
        ("sum past 2^53", lambda r, p: r.hset(STATE(p, "bad"), "v", "big")),
        ("two price versions", lambda r, p: r.hset(STATE(p, "bad"), "pv", "\n")),
    ],
)
def test_an_unusable_rollup_is_never_believed(shared, prefix, case, spoil):
    """A rollup the reader cannot use sends that job to the exact path; the other jobs keep theirs."""
    rng = np.random.default_rng(4)
    for job in ("bad", "good"):
        write(shared, prefix, job, "a", {BASE + 300 * i: amounts(rng) for i in range(4)}, "v1")
    spoil(shared, prefix)
    fast, exact = LedgerStore(shared, prefix), LedgerStore(shared, prefix, use_rollups=False)
    got = fast.window_many(["bad", "good"], BASE, BASE + 3600)
    want = exact.window_many(["bad", "good"], BASE, BASE + 3600)
    for job in ("bad", "good"):
        assert same(got[0][job], want[0][job]), job
    # a write after the damage keeps the ledger whole (the rollup's script never fails a round)
    write(shared, prefix, "bad", "a", {BASE + 300: amounts(rng)}, "v1")
    assert_windows_equal(shared, prefix, "bad", [(BASE, BASE + 3600)])


def test_the_api_builds_missing_rollups_at_start(shared, prefix):
    """`costexporter api` rolls up ledgers written before rollups existed, by itself, at start."""
    rng = np.random.default_rng(5)
    write(shared, prefix, "legacy", "a", {BASE + 300 * i: amounts(rng) for i in range(3)}, "v1")
    shared.zadd(keys.jobs_key(prefix), {"legacy": BASE})
    ledger.drop_rollup(shared, prefix, "legacy")
    port = free_port()
    proc = spawn_cli(
        "api",
        "--redis-url",
        SHARED_URL,
        "--prefix",
        prefix,
        "--port",
        str(port),
        "--listen",
        "127.0.0.1",
    )
    try:
        deadline = time.monotonic() + 30
        while shared.hget(keys.rollup_state_key(prefix, "legacy"), "v") != "1":
            assert time.monotonic() < deadline and proc.poll() is None, "the rollup was not built"
            time.sleep(0.1)
        assert shared.hget(keys.rollup_state_key(prefix, "legacy"), "v") == "1"
    finally:
        proc.terminate()
        proc.wait(10)
    assert_windows_equal(shared, prefix, "legacy", [(BASE, BASE + 3600)])


def test_bad_amounts_in_an_old_ledger_leave_its_rollup_unusable(shared, prefix):
    """The rebuild meets an amount that is not a number: the rollup says so and readers sum the
    buckets (which skip it and warn), never a rollup that silently differs."""
    rng = np.random.default_rng(6)
    write(shared, prefix, "job", "a", {BASE + 300 * i: amounts(rng) for i in range(3)}, "v1")
    ledger.drop_rollup(shared, prefix, "job")
    shared.hset(keys.bucket_key(prefix, "job", "5m", str(BASE)), "productive:ms", "abc")
    assert ledger.build_rollup(shared, prefix, "job")
    assert shared.hget(keys.rollup_state_key(prefix, "job"), "v") == "bad"
    assert_windows_equal(shared, prefix, "job", [(BASE, BASE + 3600)])


def test_rollups_survive_a_redis_that_lost_its_scripts(shared, prefix):
    """The booking script travels as EVAL, so a SCRIPT FLUSH (or a restarted Redis) between two
    rounds never leaves amounts without their rollup."""
    rng = np.random.default_rng(7)
    write(shared, prefix, "job", "a", {BASE: amounts(rng)}, "v1")
    r2 = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    r2.script_flush()
    write(shared, prefix, "job", "a", {BASE + 300: amounts(rng)}, "v1")
    assert_windows_equal(shared, prefix, "job", [(BASE, BASE + 3600)])


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    jobs=st.lists(
        st.tuples(
            st.sampled_from([None, "llm", "vision"]),
            st.sampled_from([None, "cc-1", "cc-2"]),
            st.sampled_from([None, "ns-a", "ns-b"]),
            st.lists(st.integers(0, N_BUCKETS - 1), min_size=0, max_size=3, unique=True),
            st.integers(0, 40),  # steps
        ),
        min_size=1,
        max_size=6,
    ),
    fields=st.sampled_from([["job"], ["team"], ["cost_center"], ["team", "label:ns"], ["namespace"]]),
    window=windows.map(lambda w: w[0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_allocation_rows_equal_the_per_job_sums(shared, jobs, fields, window, seed):
    """The column sums of `aggregate.table_rows` over the rollups equal the per-job rows of
    `aggregate.rows` (Decimal money, Python sums) over the buckets, for any aggregate."""
    from costexporter.api import aggregate as agg
    from costexporter.store.ledger_read import Warnings

    prefix = f"test-rollup-{uuid.uuid4().hex[:10]}"
    rng = np.random.default_rng(seed)
    try:
        names = []
        for n, (team, cc, ns, buckets, steps) in enumerate(jobs):
            name = f"job-{n}"
            names.append(name)
            meta = {k: v for k, v in (("team", team), ("cost_center", cc), ("ns", ns)) if v}
            if meta:
                shared.hset(keys.meta_key(prefix, name), mapping=meta)
            if buckets:
                write(shared, prefix, name, "a", {BASE + 300 * b: amounts(rng) for b in buckets}, "v1")
            if steps:
                shared.zadd(
                    keys.steps_key(prefix, name),
                    {f"{i}:{i * 10}": BASE + int(rng.integers(0, N_BUCKETS * 300)) for i in range(steps)},
                )
        s, e = window
        metas, (table,) = LedgerStore(shared, prefix).tables(names, [(s, e)], Warnings(), meta=True)
        got = agg.table_rows(table, metas, list(range(len(names))), fields, s, e)
        by_job, steps_ = LedgerStore(shared, prefix, use_rollups=False).window_many(names, s, e)
        parts = [agg.JobPart(j, metas[j], by_job[j], steps_[j]) for j in names]
        assert got == [r.model_dump() for r in agg.rows(parts, fields, s, e)]
    finally:
        drop_prefix(shared, prefix)


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(writes=writes, window=windows.map(lambda w: w[0]), step=st.sampled_from(["5m", "1h", "1d"]))
def test_series_from_the_rollup_equal_the_buckets(shared, writes, window, step):
    """A series' points are rollup differences; they equal the buckets of the step, point by point
    (two price versions: the buckets are read, the same points)."""
    from costexporter.api.routers.jobs import series_body
    from costexporter.api.windows import Window

    prefix = f"test-rollup-{uuid.uuid4().hex[:10]}"
    rng = np.random.default_rng(len(writes))
    try:
        for agent, buckets, voided, version in writes:
            by_bucket = {BASE + 300 * b: amounts(rng) for b in buckets}
            write(shared, prefix, "job", agent, by_bucket, version, voided)
        w = Window(window[0], window[1], "w")
        fast = series_body("job", w, step, LedgerStore(shared, prefix), "USD").body
        exact = series_body("job", w, step, LedgerStore(shared, prefix, use_rollups=False), "USD").body
        assert json.loads(fast) == json.loads(exact)
        from costexporter.api.format import by_category, micro
        from costexporter.store.ledger_read import JOB_CATS, WASTED

        old = [  # the points as they were built from `Amounts` before the matrix
            {
                "gpu_hours": round(a.hours(JOB_CATS), 6),
                "cost": micro(sum(a.ucost[c] for c in JOB_CATS)),
                "wasted_gpu_hours": round(a.hours(WASTED), 6),
                "by_category": by_category(a),
            }
            for _, a in LedgerStore(shared, prefix).series("job", w.start, w.end, step)
        ]
        assert [{k: p[k] for k in old[0]} for p in json.loads(fast)["points"]] == old
        starts, m = LedgerStore(shared, prefix).series_matrix("job", w.start, w.end, step)
        for b, row in zip(starts, m, strict=True):
            h = shared.hgetall(keys.bucket_key(prefix, "job", step, str(b)))
            want = [int(h.get(f, 0)) - int(h.get("voided:" + f, 0)) for f in ledger.PACKED]
            assert row.tolist() == want
    finally:
        drop_prefix(shared, prefix)
