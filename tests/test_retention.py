"""Retention (services/retention.py) and reading across it (store/coldledger.py, the API's
LedgerStore): a ledger sealed and then dropped from Redis before its start answers every window
(amounts, price versions, steps and tokens, series) exactly as it did before, to the micro-unit,
by the rollups and by the buckets; nothing is dropped that the archive does not hold as Redis
does; a crash between moving the start and dropping leaves readers exact; the API over HTTP
gives the same bill; without the archive a reader says what it cannot count."""

from __future__ import annotations

import csv
import io
import json
import pathlib
import shutil
import uuid

import httpx
import numpy as np
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from costexporter.core.archive import DAY_S
from costexporter.core.buckets import RESOLUTIONS
from costexporter.core.carbon import GridIntensity
from costexporter.services.retention import Retention
from costexporter.services.sealer import Sealer
from costexporter.store import keys, ledger
from costexporter.store.archive import Archive
from costexporter.store.coldledger import ColdLedger
from costexporter.store.ledger_read import LedgerStore, Warnings, hot_from

from .api_helpers import served
from .conftest import SHARED_URL, drop_prefix
from .test_archive import DAY0, N_CAT, amounts, set_watermark, write_ledger

DAYS = 6


def _client() -> redis.Redis:
    return redis.Redis.from_url(SHARED_URL, decode_responses=True)


def write_steps(
    r: redis.Redis,
    prefix: str,
    job: str,
    done: list[tuple[int, int]],
    voided: list[int],
    within: tuple[float, float] = (0, float("inf")),
) -> None:
    """Steps as the agents write them (`ledger.queue_steps`): member `<record>:<cumulative
    tokens>`, scored by completion time (s); voids by when the resume was seen. `within`: only
    the members scored in it (s), as an agent booking that stretch again writes them."""
    cum, members = 0, {}
    for i, (t_ms, tokens) in enumerate(sorted(done)):
        cum += tokens
        members[f"{i}:{cum}"] = t_ms / 1000
    members = {m: t for m, t in members.items() if within[0] <= t < within[1]}
    if members:
        r.zadd(keys.steps_key(prefix, job), members)
    cum_v, vm = 0, {}
    for n, i in enumerate(sorted(set(voided))):
        if i < len(done):
            cum_v += sorted(done)[i][1]
            vm[f"{i}:{cum_v}"] = sorted(done)[i][0] / 1000 + 60 + n
    vm = {m: t for m, t in vm.items() if within[0] <= t < within[1]}
    if vm:
        r.zadd(keys.voids_key(prefix, job), vm)


def snapshot(store: LedgerStore, jobs: list[str], spans: list[tuple[int, int]]) -> list[object]:
    """Everything a reader says of the windows: amounts, price versions, steps; and each job's
    hourly and daily series."""
    warn = Warnings()
    _, tables = store.tables(jobs, spans, warn, tokens=True)
    out: list[object] = []
    for t in tables:
        out.append(t.net.tolist())
        out.append([sorted(v or ()) for v in t.versions])
        out.append({j: (s.completed, s.voided, s.tokens, s.net_tokens) for j, s in sorted(t.steps.items())})
    for j in jobs:
        for res in ("1h", "1d"):
            starts, m = store.series_matrix(j, DAY0, DAY0 + DAYS * DAY_S, res, warn)
            out.append((res, starts, m.tolist()))
    assert not warn, warn
    return out


bucket_amounts = st.dictionaries(
    st.integers(0, DAYS * 288 - 1).map(lambda k: DAY0 + 300 * k), amounts, max_size=10
)
step_lists = st.lists(
    st.tuples(st.integers(0, DAYS * DAY_S * 1000 - 1).map(lambda t: DAY0 * 1000 + t), st.integers(0, 10**9)),
    max_size=12,
)
ledgers = st.dictionaries(
    st.sampled_from(["a", "team/b", "c-3"]),
    st.tuples(
        bucket_amounts,
        st.dictionaries(st.integers(0, DAYS * 288 - 1).map(lambda k: DAY0 + 300 * k), amounts, max_size=2),
        step_lists,
        st.lists(st.integers(0, 11), max_size=3),
    ),
    min_size=1,
    max_size=3,
)


@given(
    led=ledgers,
    cut_day=st.integers(1, DAYS),
    windows=st.lists(
        st.tuples(st.integers(-12, DAYS * 288), st.integers(1, DAYS * 288 + 24)), min_size=1, max_size=4
    ),
)
@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
def test_every_window_reads_the_same_after_the_days_before_it_leave_redis(
    tmp_path_factory, led, cut_day, windows
):
    r, prefix = _client(), f"ret-{uuid.uuid4().hex[:10]}"
    root = tmp_path_factory.mktemp("archive")
    try:
        for job, (b, v, done, voided) in led.items():
            write_ledger(r, prefix, job, b, v)
            write_steps(r, prefix, job, done, voided)
            set_watermark(r, prefix, job, "n0", DAY0 + (DAYS + 1) * DAY_S)
        jobs = sorted(led)
        spans = [(DAY0 + 300 * a, DAY0 + 300 * (a + n)) for a, n in windows]
        before = snapshot(LedgerStore(r, prefix), jobs, spans)
        exact_before = snapshot(LedgerStore(r, prefix, use_rollups=False), jobs, spans)
        assert exact_before == before

        archive = Archive.open(str(root))
        sealer = Sealer(r, prefix, archive, "east", shards=2, delay_s=0)
        sealer.seal(DAY0 + 20 * DAY_S)
        cut = DAY0 + cut_day * DAY_S
        report = Retention(sealer, hot_days=3).expire(cut + 3 * DAY_S + 7)
        assert report.hot_from == cut and not report.held, report
        assert hot_from(r, prefix) == cut
        for job in jobs:  # nothing before the start is left but the base records
            for res in RESOLUTIONS:
                assert not r.zrangebyscore(keys.index_key(prefix, job, res), "-inf", f"({cut}")
            for k in (keys.rollup_key(prefix, job), keys.steps_key(prefix, job), keys.voids_key(prefix, job)):
                left = r.zrangebyscore(k, "-inf", f"({cut}", withscores=True)
                assert len({score for _, score in left}) <= 1  # the base (and any of its score)

        cold = ColdLedger(archive, "east")
        assert snapshot(LedgerStore(r, prefix, cold=cold), jobs, spans) == before
        assert snapshot(LedgerStore(r, prefix, use_rollups=False, cold=cold), jobs, spans) == before
        # Sealing and expiring again change nothing.
        assert not sealer.seal(DAY0 + 20 * DAY_S).written
        again = Retention(sealer, hot_days=3).expire(cut + 3 * DAY_S + 7)
        assert (again.keys, again.members) == (0, 0)
        assert snapshot(LedgerStore(r, prefix, cold=ColdLedger(archive, "east")), jobs, spans) == before
    finally:
        drop_prefix(r, prefix)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def ledger_of_six_days(tmp_path):
    """Two jobs booked every hour of six days, with steps; every agent past the sixth."""
    r, prefix = _client(), f"ret-{uuid.uuid4().hex[:10]}"
    rng = np.random.default_rng(7)
    for job in ("j1", "team/j2"):
        b = {DAY0 + 3600 * h: rng.integers(0, 10**9, (N_CAT, 3)) for h in range(DAYS * 24)}
        write_ledger(r, prefix, job, b, {})
        write_steps(r, prefix, job, [(DAY0 * 1000 + 600_000 * k, 5) for k in range(DAYS * 144)], [3, 9])
        set_watermark(r, prefix, job, "n0", DAY0 + (DAYS + 1) * DAY_S)
    archive = Archive.open(str(tmp_path / "archive"))
    yield r, prefix, archive
    drop_prefix(r, prefix)


def test_a_day_not_sealed_or_booked_into_since_holds_the_start_back_and_nothing_is_dropped(
    ledger_of_six_days,
):
    r, prefix, archive = ledger_of_six_days
    # j1's agent stopped after day 1: its later days are sealed after the longest wait (here
    # none), not for good, and a late booking into one is sealed again.
    set_watermark(r, prefix, "j1", "n0", DAY0 + DAY_S)
    sealer = Sealer(r, prefix, archive, "east", shards=2, delay_s=0, max_wait_s=0)
    now = DAY0 + 10 * DAY_S
    nothing = Retention(sealer, hot_days=6).expire(now)  # never sealed
    assert nothing.hot_from == 0 and "run `archive seal` first" in nothing.held[0]
    assert r.zcount(keys.index_key(prefix, "j1", "5m"), "-inf", "+inf") == DAYS * 24
    waiting = Sealer(r, prefix, archive, "east", shards=2, delay_s=0, max_wait_s=30 * DAY_S)
    waiting.seal(now)  # j1's days after its agent stopped are not sealed yet
    partly = Retention(waiting, hot_days=6).expire(now)
    assert partly.hot_from == DAY0 + DAY_S and partly.held == ["j1 2026-01-02: not sealed"], partly
    assert r.zcount(keys.index_key(prefix, "j1", "5m"), DAY0 + DAY_S, "+inf") == (DAYS - 1) * 24
    sealer.seal(now)
    # A late booking into day 2 after the seal: Redis holds it otherwise than the archive.
    write_ledger(r, prefix, "j1", {DAY0 + 2 * DAY_S + 600: np.ones((N_CAT, 3), np.int64)}, {})
    span = [(DAY0 + 2 * DAY_S, DAY0 + 2 * DAY_S + 900)]
    (want,) = LedgerStore(r, prefix).tables(["j1"], span)[1]
    held = Retention(sealer, hot_days=6).expire(now)
    assert held.hot_from == DAY0 + 2 * DAY_S
    assert any("j1 2026-01-03: booked into since it was sealed" in h for h in held.held), held.held
    assert r.zcount(keys.index_key(prefix, "j1", "5m"), DAY0 + 2 * DAY_S, f"({DAY0 + 3 * DAY_S}") > 0
    assert sealer.seal(now).written  # sealed again as a new version: the start moves on
    moved = Retention(sealer, hot_days=6).expire(now)
    assert moved.hot_from == DAY0 + 4 * DAY_S and not moved.held, moved
    cold = ColdLedger(archive, "east")
    (got,) = LedgerStore(r, prefix, cold=cold).tables(["j1"], span)[1]
    assert got.net.tolist() == want.net.tolist()  # the late booking is in the bill


def test_a_crash_between_moving_the_start_and_dropping_leaves_readers_exact(ledger_of_six_days):
    r, prefix, archive = ledger_of_six_days
    sealer = Sealer(r, prefix, archive, "east", shards=2, delay_s=0)
    sealer.seal(DAY0 + 10 * DAY_S)
    jobs, spans = ["j1", "team/j2"], [(DAY0, DAY0 + DAYS * DAY_S), (DAY0 + 7 * 3600, DAY0 + 3 * DAY_S + 300)]
    before = snapshot(LedgerStore(r, prefix), jobs, spans)
    ret = Retention(sealer, hot_days=3)
    ret._move_start(DAY0 + 3 * DAY_S)  # the expirer dies here
    cold = ColdLedger(archive, "east")
    assert snapshot(LedgerStore(r, prefix, cold=cold), jobs, spans) == before
    ret._move_start(DAY0 + 2 * DAY_S)  # never moves back
    assert hot_from(r, prefix) == DAY0 + 3 * DAY_S
    rep = ret.expire(DAY0 + 6 * DAY_S)  # run again: it drops what the first did not
    assert rep.hot_from == DAY0 + 3 * DAY_S and rep.keys > 0 and rep.members > 0
    assert snapshot(LedgerStore(r, prefix, cold=cold), jobs, spans) == before
    # A booking below the start now (an agent weeks late) is not sealed over the day.
    write_ledger(r, prefix, "j1", {DAY0 + 600: np.ones((N_CAT, 3), np.int64)}, {})
    assert not sealer.seal(DAY0 + 10 * DAY_S).written


def test_without_the_archive_a_reader_says_what_it_does_not_count(ledger_of_six_days):
    r, prefix, archive = ledger_of_six_days
    sealer = Sealer(r, prefix, archive, "east", shards=2, delay_s=0)
    sealer.seal(DAY0 + 10 * DAY_S)
    Retention(sealer, hot_days=3).expire(DAY0 + 6 * DAY_S)
    warn = Warnings()
    LedgerStore(r, prefix).tables(["j1"], [(DAY0, DAY0 + DAYS * DAY_S)], warn)
    assert any("2026-01-04 are in the archive" in w for w in warn), warn


def test_the_api_over_http_bills_the_same_after_expiry(ledger_of_six_days):
    r, prefix, archive = ledger_of_six_days
    window = "2026-01-01T00:00:00Z,2026-01-07T00:00:00Z"
    paths = [
        f"/api/v1/allocation?window={window}&aggregate=job",
        f"/api/v1/allocation?window={window}&aggregate=job&step=1d",
        f"/api/v1/allocation?window={window}&format=focus",
        f"/api/v1/jobs/j1?window={window}",
        f"/api/v1/jobs/team/j2/series?window={window}&step=1h",
        "/allocation?window=2026-01-01T00:00:00Z,2026-01-07T00:00:00Z&aggregate=namespace",
    ]

    def bill(store: LedgerStore) -> list[object]:
        with served(store) as (url, _):
            got = [httpx.get(url + p, timeout=30) for p in paths]
        assert all(g.status_code == 200 for g in got), [g.text for g in got]
        return [json.loads(g.text) if g.text.startswith("{") else g.text for g in got]

    before = bill(LedgerStore(r, prefix))
    sealer = Sealer(r, prefix, archive, "east", shards=2, delay_s=0)
    sealer.seal(DAY0 + 10 * DAY_S)
    Retention(sealer, hot_days=2).expire(DAY0 + 6 * DAY_S + 5)
    assert hot_from(r, prefix) == DAY0 + 4 * DAY_S
    assert bill(LedgerStore(r, prefix, cold=ColdLedger(archive, "east"))) == before
    # A damaged file: 503 with a line, never a short bill.
    victim = sorted(pathlib.Path(archive.root).rglob("*.parquet"))[0]
    victim.write_bytes(victim.read_bytes()[:-9] + b"xxxxxxxxx")
    with served(LedgerStore(r, prefix, cold=ColdLedger(archive, "east"))) as (url, _):
        got = httpx.get(url + paths[0], timeout=30)
    assert got.status_code == 503 and "damaged" in got.json()["detail"], got.text


def test_the_expire_command_from_a_clean_checkout(ledger_of_six_days, tmp_path, cli):
    """`archive seal` then `archive expire` as the README's CronJobs run them: today's date is
    now, so every day of 2026-01 is past a hot window of 1 day."""
    r, prefix, archive = ledger_of_six_days
    common = ["--redis-url", SHARED_URL, "--prefix", prefix, "--archive", archive.url, "--cluster", "east"]
    early = cli("archive", "expire", *common, "--hot-days", "1")
    assert early.returncode == 0 and "run `archive seal` first" in early.stderr, early.stderr
    assert cli("archive", "seal", *common, "--delay", "0").returncode == 0
    done = cli("archive", "expire", *common, "--hot-days", "1", "--shards", "16")
    assert done.returncode == 0, done.stderr
    assert "the ledger in Redis starts at" in done.stderr and "2 job(s) trimmed" in done.stderr, done.stderr
    assert hot_from(r, prefix) > DAY0 + DAYS * DAY_S
    assert not r.zrangebyscore(keys.index_key(prefix, "j1", "5m"), "-inf", "+inf")
    bad = cli("archive", "expire", *common[:-2], "--cluster", "east", "--hot-days", "0")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--archive", "{tmp}"], "--archive needs --cluster"),
        (["--archive", "{tmp}/nowhere", "--cluster", "east"], "no archive at"),
        (["--archive", "s3://", "--cluster", "east"], "archive s3://"),
    ],
)
def test_an_api_archive_given_but_unusable_stops_with_one_line(tmp_path, cli, extra, message):
    args = [a.replace("{tmp}", str(tmp_path)) for a in extra]
    r = cli("api", "--redis-url", SHARED_URL, "--port", "0", *args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_an_archive_on_object_storage_serves_the_days_that_left_redis(s3, ledger_of_six_days):
    """moto's S3 server (real HTTP, the S3 API) as the archive: sealed, expired, read back."""
    url, client = s3
    r, prefix, _ = ledger_of_six_days
    jobs, spans = ["j1", "team/j2"], [(DAY0, DAY0 + DAYS * DAY_S), (DAY0 + 3600, DAY0 + 4 * DAY_S + 600)]
    before = snapshot(LedgerStore(r, prefix), jobs, spans)
    archive = Archive.open(url)
    sealer = Sealer(r, prefix, archive, "east", shards=2, delay_s=0)
    sealer.seal(DAY0 + 10 * DAY_S)
    rep = Retention(sealer, hot_days=2).expire(DAY0 + 6 * DAY_S)
    assert rep.hot_from == DAY0 + 4 * DAY_S and not rep.held
    names = [o["Key"] for o in client.list_objects_v2(Bucket="ledger")["Contents"]]
    assert len([n for n in names if n.endswith(".parquet")]) == len(archive.manifest("east").entries) >= DAYS
    assert snapshot(LedgerStore(r, prefix, cold=ColdLedger(Archive.open(url), "east")), jobs, spans) == before


def test_one_api_bills_several_clusters_from_their_partitions(tmp_path, cli):
    """East's API (its Redis and its partition) bills west too, from west's sealed days alone
    (west's Redis is gone): /allocation by cluster, by cluster and team, by job (west's jobs
    `west:<job>`) and OpenCost's /allocation by cluster each give every cluster the bill its
    own ledger gave, to the micro-unit; GPU time no job registered adds up over both."""
    from .api_helpers import T0, write_job

    r = _client()
    archive = Archive.open(str(tmp_path / "archive"))
    p = {c: f"mc-{c}-{uuid.uuid4().hex[:8]}" for c in ("east", "west")}
    window = "2025-07-25T00:00:00Z,2025-07-28T00:00:00Z"
    own: dict[str, dict] = {}
    try:
        for c, jobs in (
            ("east", [("llm/a", "llm"), ("v/b", "vision")]),
            ("west", [("llm/a", "llm"), ("w/c", "wx")]),
        ):
            for j, team in jobs:
                write_job(r, p[c], j, team)
                set_watermark(r, p[c], j, "n0", T0 + 2 * DAY_S)
            unassigned = np.zeros((N_CAT, 3), np.int64)
            unassigned[-2] = [60_000, 1, 5_000]  # the `unassigned` category
            pipe = r.pipeline(transaction=True)  # as the agents book it: no trainer's jobs index
            ledger.queue_amounts(pipe, p[c], "_unassigned", {T0: unassigned}, "pv1")
            pipe.execute()
            set_watermark(r, p[c], "_unassigned", "n0", T0 + 2 * DAY_S)
            with served(LedgerStore(r, p[c]), cluster=c) as (url, _):
                own[c] = {
                    agg: httpx.get(
                        f"{url}/api/v1/allocation", params={"window": window, "aggregate": agg}, timeout=30
                    ).json()
                    for agg in ("job", "team")
                }
            # a GPU off the bus on each cluster's llm/a, the policy crediting hardware
            fault = {
                "category": "stalled", "start": (T0 + 120) * 1000, "end": (T0 + 180) * 1000,
                "gpu_ms": 60_000, "ranks": [0], "zero_util_ranks": [], "host": "h", "cause": "hardware",
                "cause_why": "Xid 79", "cost_micro": 41_000 if c == "west" else 17_000,
            }  # fmt: skip
            ledger.queue_incidents(pipe := r.pipeline(transaction=True), p[c], "llm/a", "agent-2", [fault])
            pipe.execute()
            Sealer(r, p[c], archive, c, shards=2, delay_s=0).seal(T0 + 3 * DAY_S)
        drop_prefix(r, p["west"])  # west's Redis is not this API's
        store = LedgerStore(
            r, p["east"], cold=ColdLedger(archive, "east"), others={"west": ColdLedger(archive, "west")}
        )
        credit = ("hardware",)
        with served(store, cluster="east", carbon=GridIntensity(400.0), credit_causes=credit) as (url, _):
            get = lambda path, **q: httpx.get(url + path, params={"window": window, **q}, timeout=30)  # noqa: E731
            answer = get("/api/v1/allocation", aggregate="cluster").json()
            by_cluster = {row["key"]: row for row in answer["rows"]}
            by_job = {row["key"]: row for row in get("/api/v1/allocation", aggregate="job").json()["rows"]}
            by_ct = {
                row["key"]: row for row in get("/api/v1/allocation", aggregate="cluster,team").json()["rows"]
            }
            oc = get("/allocation", aggregate="cluster").json()
            # west's incidents too, from its sealed days: its credit beside its usage
            focus = get("/api/v1/allocation", aggregate="job", format="focus").text
        credits = {
            row["x_AllocationKey"]: row["BilledCost"]
            for row in csv.DictReader(io.StringIO(focus))
            if row["ChargeCategory"] == "Credit"
        }
        assert credits == {"llm/a": "-0.017000", "west:llm/a": "-0.041000"}
        for c in ("east", "west"):
            jobs_of = [
                row for row in own[c]["job"]["rows"] if row["key"] != "__unassigned__" and row["jobs"] == 1
            ]
            total = sum(int(row["cost"].replace(".", "")) for row in jobs_of)
            assert int(by_cluster[c]["cost"].replace(".", "")) == total > 0, (c, by_cluster)
            assert by_cluster[c]["valid_steps"] == sum(row["valid_steps"] for row in jobs_of)
            for row in jobs_of:
                key = row["key"] if c == "east" else f"west:{row['key']}"
                assert by_job[key]["cost"] == row["cost"] and by_job[key]["team"] == row["team"], key
            for row in own[c]["team"]["rows"]:
                if row["jobs"]:
                    assert by_ct[f"{c}/{row['key']}"]["cost"] == row["cost"]
        [oc_set] = oc["data"]
        assert {k for k in oc_set} == {"east", "west"}
        assert oc_set["west"]["totalCost"] == pytest.approx(
            int(by_cluster["west"]["cost"].replace(".", "")) / 1e6
        )
        # east's grid intensity is east's: west's jobs (and a group holding them) get no carbon
        assert by_cluster["east"]["carbon_kg"] == pytest.approx(by_cluster["east"]["energy_kwh"] * 0.4)
        assert by_cluster["west"]["carbon_kg"] is None and by_cluster["west"]["energy_kwh"] > 0
        assert by_job["west:llm/a"]["carbon_kg"] is None and by_job["llm/a"]["carbon_kg"] > 0
        assert any("other clusters' jobs" in w for w in answer["warnings"])
        assert [r["carbon_kg"] for r in answer["rows"] if r["jobs"] == 0] == [None]  # both clusters' pool
        unassigned_rows = [row for row in by_job.values() if row["jobs"] == 0]
        assert unassigned_rows and unassigned_rows[0]["cost"] == "0.010000"  # 5,000 micro-units each
        bad = cli("api", "--redis-url", SHARED_URL, "--port", "0", "--archive-cluster", "west")
        assert bad.returncode == 2 and "--archive-cluster needs --archive" in bad.stderr
        none = cli("api", "--redis-url", SHARED_URL, "--port", "0", "--archive", archive.root,
                   "--cluster", "east", "--archive-cluster", "north")  # fmt: skip
        assert none.returncode == 2 and "no partition of cluster 'north'" in none.stderr, none.stderr
    finally:
        for prefix in p.values():
            drop_prefix(r, prefix)


def test_the_api_reads_every_sealed_day_ahead_once(ledger_of_six_days):
    """`warm` (the API's start, on a thread) reads each sealed day once and keeps its sums: a
    later window of whole days reads no file (here: the files gone, the same answer)."""
    r, prefix, archive = ledger_of_six_days
    Sealer(r, prefix, archive, "east", shards=2, delay_s=0).seal(DAY0 + 10 * DAY_S)
    cold = ColdLedger(archive, "east")
    want = cold.window(["j1", "team/j2"], DAY0, DAY0 + DAYS * DAY_S).sums.tolist()
    fresh = ColdLedger(archive, "east")
    assert fresh.warm() == len(archive.manifest("east").entries)
    for f in pathlib.Path(archive.root).rglob("*.parquet"):
        f.unlink()
    assert fresh.window(["j1", "team/j2"], DAY0, DAY0 + DAYS * DAY_S).sums.tolist() == want


def test_a_damaged_sealed_file_holds_the_start_back_and_its_day_stays_in_redis(ledger_of_six_days):
    r, prefix, archive = ledger_of_six_days
    sealer = Sealer(r, prefix, archive, "east", shards=1, delay_s=0)
    sealer.seal(DAY0 + 10 * DAY_S)
    [day2] = sorted(pathlib.Path(archive.root).rglob("date=2026-01-03/*.parquet"))
    data = bytearray(day2.read_bytes())
    data[len(data) // 2] ^= 0xFF
    day2.write_bytes(bytes(data))
    rep = Retention(sealer, hot_days=1).expire(DAY0 + 10 * DAY_S)
    assert rep.hot_from == DAY0 + 2 * DAY_S, rep
    assert any("its file is damaged" in h for h in rep.held), rep.held
    for job in ("j1", "team/j2"):
        assert r.zcount(keys.index_key(prefix, job, "5m"), DAY0 + 2 * DAY_S, f"({DAY0 + 3 * DAY_S}") > 0
        assert not r.zrangebyscore(keys.index_key(prefix, job, "5m"), "-inf", f"({DAY0 + 2 * DAY_S}")
