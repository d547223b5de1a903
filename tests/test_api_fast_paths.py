"""The finance API's fast paths give the bytes of the paths they replace (random data)."""

from __future__ import annotations

from decimal import Decimal

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from costexporter.api.format import per, per_micro
from costexporter.store import keys

from .api_helpers import served
from .conftest import drop_prefix
from .test_api_rollup import BASE, amounts, write

MICRO = st.one_of(st.integers(-(10**16), 10**16), st.integers(-50, 50), st.integers(-(10**7), 10**7))
COUNT = st.one_of(st.integers(-2, 50), st.integers(1, 10**10), st.sampled_from([2, 4, 8, 10**9 - 1, 10**9]))


@settings(max_examples=2000, deadline=None)
@given(MICRO, COUNT)
@example(1, 2)  # ties: half-even
@example(3, 2)
@example(-1, 2)
@example(-1, 3)  # rounds to zero: Decimal says "-0.000000"
@example(0, 7)
@example(10**15 - 1, 2)
@example(-(10**15) + 1, 2)
def test_cost_per_step_by_integers_is_decimals(u, n):
    assert per_micro(u, n) == per(Decimal(u).scaleb(-6), n)


@settings(max_examples=500, deadline=None)
@given(st.integers(-(10**8), 10**8), st.integers(1, 10**6).map(lambda n: 2 * n))
def test_exact_ties_round_half_even_as_decimal(k, n):
    u = k * n + n // 2  # exactly halfway between two micro-units
    assert per_micro(u, n) == per(Decimal(u).scaleb(-6), n)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    jobs=st.lists(
        st.tuples(
            st.sampled_from([None, "llm", "vision"]),
            st.lists(st.integers(0, 3 * 288 - 1), max_size=3, unique=True),
            st.integers(0, 12),  # steps
            st.sampled_from(["ok", "ok", "ok", "meta", "steps", "exact", "bad-bucket"]),
        ),
        min_size=1,
        max_size=9,
    ),
    chunk=st.integers(1, 4),
    seed=st.integers(0, 2**32 - 1),
)
def test_allocation_read_in_chunks_is_byte_identical(shared, monkeypatch, jobs, chunk, seed):
    """/allocation with the jobs read a few at a time (Redis reading the next chunk while the
    rows of this one are made) answers the bytes of one read of every job: rows, order and
    warnings (meta that is not a hash, step sets of the wrong type, rollups read exactly, bad
    bucket amounts), per job and per team, whole or per day, JSON and CSV."""
    import uuid

    import httpx
    import numpy as np

    from costexporter.core.buckets import RESOLUTIONS, bucket_start
    from costexporter.store import ledger_read as store_mod
    from costexporter.store.ledger_read import LedgerStore

    prefix = f"test-chunks-{uuid.uuid4().hex[:10]}"
    rng = np.random.default_rng(seed)
    try:
        for n, (team, buckets, steps, spoil) in enumerate(jobs):
            name = f"job-{(n * 7) % 10}-{n}"  # the jobs set's order is not the names' order
            shared.zadd(keys.jobs_key(prefix), {name: BASE + 86400 - n})
            if team:
                shared.hset(keys.meta_key(prefix, name), mapping={"team": team, "cost_center": "cc"})
            if buckets:
                write(shared, prefix, name, "a", {BASE + 300 * b: amounts(rng) for b in buckets}, "v1")
            if steps:
                shared.zadd(
                    keys.steps_key(prefix, name),
                    {f"{i}:{i * 10}": BASE + int(rng.integers(0, 3 * 86400)) for i in range(steps)},
                )
            if spoil == "meta":
                shared.delete(keys.meta_key(prefix, name))
                shared.set(keys.meta_key(prefix, name), "x")
            elif spoil == "steps":
                shared.delete(keys.steps_key(prefix, name))
                shared.set(keys.steps_key(prefix, name), "x")
            elif spoil in ("exact", "bad-bucket"):
                shared.delete(keys.rollup_state_key(prefix, name))
                if spoil == "bad-bucket":
                    for res in RESOLUTIONS:
                        b = bucket_start(BASE, res)
                        shared.hset(keys.bucket_key(prefix, name, res, str(b)), "productive:ms", "5k")
        window = f"{BASE},{BASE + 3 * 86400}"
        queries = [
            {"window": window},
            {"window": window, "aggregate": "team"},
            {"window": window, "accumulate": "false", "step": "1d"},
            {"window": window, "format": "csv"},
        ]

        def answers() -> list[tuple[int, bytes, str | None]]:
            with served(LedgerStore(shared, prefix)) as (base, _app), httpx.Client(base_url=base) as c:
                out = []
                for q in queries:
                    r = c.get("/api/v1/allocation", params=q)
                    out.append((r.status_code, r.content, r.headers.get("x-costexporter-warnings")))
                return out

        whole = answers()
        monkeypatch.setattr(store_mod, "CHUNK", chunk)
        assert answers() == whole
        assert all(code == 200 for code, _, _ in whole)
    finally:
        drop_prefix(shared, prefix)


AMOUNT = st.one_of(st.integers(-(10**12), 10**12), st.integers(-3, 3))


@settings(max_examples=300, deadline=None)
@given(
    jobs=st.lists(
        st.tuples(
            st.lists(AMOUNT, min_size=30, max_size=30),  # a row of the table (ledger.PACKED)
            st.integers(0, 60),  # steps completed
            st.integers(0, 8),  # of them voided
            st.sampled_from([None, "llm", "vision"]),
            st.sampled_from([None, "cc-1", "cc-2"]),
        ),
        min_size=1,
        max_size=8,
    ),
    fields=st.sampled_from([["job"], ["team"], ["cost_center"], ["team", "cost_center"]]),
)
def test_table_rows_equal_the_rows_of_any_amounts(jobs, fields):
    """`aggregate.table_rows` (column sums, money made in place) gives the dicts of
    `aggregate.rows` (per-job `Amounts`, `micro` and `per_micro`) for any amounts, negative
    ones (rollbacks past the window's charges) and jobs with more voided than valid steps
    included."""
    import numpy as np

    from costexporter.api import aggregate as agg
    from costexporter.store import ledger
    from costexporter.store.ledger_read import Steps, WindowTable

    assert len(ledger.PACKED) == 30
    names = [f"job-{(n * 5) % 8}-{n}" for n in range(len(jobs))]
    net = np.array([j[0] for j in jobs], np.int64)
    versions = [{"v1"} if n % 2 else {"v2", "v1"} for n in range(len(jobs))]
    steps = {name: Steps(c, v) for name, (_, c, v, _, _) in zip(names, jobs, strict=True)}
    metas = {
        name: {k: x for k, x in (("team", t), ("cost_center", cc)) if x}
        for name, (_, _, _, t, cc) in zip(names, jobs, strict=True)
    }
    table = WindowTable(names, net, versions, steps)
    s, e = BASE, BASE + 3600
    got = agg.table_rows(table, metas, list(range(len(names))), fields, s, e)
    parts = [agg.JobPart(j, metas[j], table.amounts(j), steps[j]) for j in names]
    assert got == [r.model_dump() for r in agg.rows(parts, fields, s, e)]


@settings(max_examples=300, deadline=None)
@given(prefix=st.text(min_size=1, max_size=12), job=st.text(max_size=20))
def test_key_templates_make_the_builders_keys(prefix, job):
    """The reader's keys made by concatenation are the key builders' keys, for any job name."""
    from costexporter.store.ledger_read import key_templates

    builders = [keys.rollup_state_key, keys.rollup_key, keys.steps_key, keys.voids_key, keys.meta_key]
    if "\x00job\x00" in prefix:
        return
    made = [h + job + t for h, t in key_templates(prefix, builders)]
    assert made == [k(prefix, job) for k in builders]


RECORD = st.one_of(
    st.just(""),  # no bucket before the bound
    st.none(),  # the rollup could not be read
    st.lists(st.integers(-(10**15), 10**15), min_size=30, max_size=30).flatmap(
        lambda a: st.integers(0, 10**9).map(lambda b: "[" + ",".join(map(str, [b, *a])) + "]")
    ),
    st.sampled_from(  # damaged: text, not a list, too short, floats, past int64, past 2^53
        [
            "[1,2,x]",
            '{"a": 1}',
            "[5,1,2]",
            "[5" + ",1.5" * 30 + "]",
            "[1" + ",1" * 29 + "," + "9" * 20 + "]",
            "[1" + ",1" * 29 + f",{2**53 + 1}]",
        ]
    ),
)


@settings(max_examples=300, deadline=None)
@given(
    jobs=st.lists(
        st.tuples(
            st.sampled_from(["1", "1", "1", "", None]), st.sampled_from(["v1", "", "v2"]), RECORD, RECORD
        ),
        max_size=12,
    )
)
def test_rollup_columns_equal_the_per_job_reading(jobs):
    """A window's amounts from the columns of every job's rollup records (parsed in one go, a
    record-less bound without parsing) equal each job's records read one by one: the net amounts,
    the price versions, and which jobs go to the exact path, in the same order."""
    import numpy as np

    from costexporter.store.ledger_read import WIDTH, ZEROS, _record, _rollup_net

    usable, pvs, ends, starts = (list(c) for c in zip(*jobs, strict=True)) if jobs else ([], [], [], [])
    net, versions, exact = _rollup_net(usable, pvs, ends, starts)
    want_exact, damaged = [], []
    want_net = np.zeros((len(jobs), WIDTH - 1), np.int64)
    want_versions: list[set[str] | None] = [None] * len(jobs)
    for i, (u, pv, re, rs) in enumerate(jobs):
        if u != "1" or re is None or rs is None:
            want_exact.append(i)
            continue
        e, s = _record(re or ZEROS), _record(rs or ZEROS)
        if e is None or s is None:
            damaged.append(i)
            continue
        want_net[i] = np.array(e[1:]) - np.array(s[1:])
        want_versions[i] = {pv} if e[0] != s[0] and pv else set()
    assert exact == want_exact + damaged
    good = [i for i in range(len(jobs)) if i not in exact]
    assert (net[good] == want_net[good]).all()
    assert [versions[i] for i in good] == [want_versions[i] for i in good]


ATTR_VALUE = st.one_of(st.sampled_from(["team-a", "cc-1", "ns", "pool"]), st.text(min_size=1, max_size=8))
NUMBER_TEXT = st.one_of(st.sampled_from(["2.5", "0", "-1", "nan", "1e13", "x"]), ATTR_VALUE)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    jobs=st.lists(
        st.tuples(
            st.dictionaries(
                st.sampled_from(
                    [
                        "team",
                        "cost_center",
                        "namespace",
                        "cluster",
                        "node_pool",
                        "controller",
                        "controller_kind",
                    ]
                ),
                ATTR_VALUE,
                max_size=4,
            ),
            st.dictionaries(st.sampled_from(["budget", "price_per_gpu_hour"]), NUMBER_TEXT, max_size=2),
            st.dictionaries(
                st.sampled_from(["team", "namespace", "budget", "gpu_model"]), st.just("x"), max_size=2
            ),  # sources
            st.dictionaries(
                st.sampled_from(["team", "gpu_model", "price_per_gpu_hour", "owner"]), ATTR_VALUE, max_size=3
            ),  # the trainer's meta
        ),
        min_size=1,
        max_size=6,
    )
)
def test_the_readers_of_a_jobs_attribution_agree(shared, prefix, jobs):
    """The three readers of a job's owner and place give the same `JobMeta` (keys, attribution,
    ignored meta keys): the allocation script's (fields set, by position), `meta_many`'s
    (an HMGET of every field) and one job's (its figures hash whole)."""
    from costexporter.api import aggregate as agg
    from costexporter.store import ledger
    from costexporter.store.ledger_read import LedgerStore, Warnings, job_meta

    names = [f"attr-{i}" for i in range(len(jobs))]
    for n, (text, numbers, sources, meta) in zip(names, jobs, strict=True):
        fields = {**text, **numbers, **{f"{k}:source": v for k, v in sources.items()}}
        shared.delete(keys.figures_key(prefix, n), keys.meta_key(prefix, n))
        if fields:
            shared.hset(keys.figures_key(prefix, n), mapping={ledger.ATTR + k: v for k, v in fields.items()})
        if meta:
            shared.hset(keys.meta_key(prefix, n), mapping=meta)
    store = LedgerStore(shared, prefix)
    by_script, _ = store.tables(names, agg.periods(BASE, BASE + 86400, None), Warnings(), meta=True)
    by_hmget = store.meta_many(names)
    assert set(by_script) == set(by_hmget) == set(names)
    for n in names:
        whole = job_meta(
            shared.hgetall(keys.meta_key(prefix, n)), shared.hgetall(keys.figures_key(prefix, n))
        )
        for got in (by_script[n], by_hmget[n]):
            assert dict(got) == dict(whole)
            assert (got.attribution, got.ignored) == (whole.attribution, whole.ignored)
