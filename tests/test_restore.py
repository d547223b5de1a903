"""Restore (services/restore.py, `costexporter archive restore`): a Redis that lost the ledger gets
its hot window back from the archive, and every window reads as before the loss (amounts, price
versions, steps and tokens, series, all-time totals, teams), to the micro-unit; running it again,
or after the agents booked a day again, never counts a bucket twice; the finance API over HTTP
gives the same bill by team."""

from __future__ import annotations

import shutil
import time
import uuid

import httpx
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from costexporter.core.archive import DAY_S
from costexporter.core.attribution import Attribution
from costexporter.services.restore import Restore
from costexporter.services.sealer import Sealer
from costexporter.store import keys, ledger
from costexporter.store.archive import Archive
from costexporter.store.coldledger import ColdLedger
from costexporter.store.ledger_read import LedgerStore, hot_from

from .api_helpers import served
from .conftest import SHARED_URL, drop_prefix
from .test_archive import DAY0, N_CAT, set_watermark, write_ledger
from .test_retention import DAYS, _client, ledgers, snapshot, write_steps


def totals(store: LedgerStore, jobs: list[str]) -> dict[str, object]:
    got = store.totals_many(jobs)
    return {j: (a.ms, a.mj, a.ucost) for j, a in got.items()}


def teams(store: LedgerStore, jobs: list[str]) -> dict[str, object]:
    metas, _ = store.tables(jobs, [(DAY0, DAY0 + 300)], meta=True)
    return {j: (m.get("team"), m.get("model")) for j, m in metas.items()}


def attribute(r, prefix: str, job: str, team: str, model: str) -> None:
    pipe = r.pipeline(transaction=True)
    ledger.queue_attribution(pipe, prefix, job, Attribution((("team", team),), (("team", "policy rule 1"),)))
    pipe.hset(keys.meta_key(prefix, job), mapping={"model": model})
    pipe.execute()


# Incidents as agents store them: (agent, which booked bucket, seconds into it, minutes long,
# category, cause, cost or none kept)
incident_lists = st.lists(
    st.tuples(
        st.sampled_from(["n0", "n1"]),
        st.integers(0, 50),
        st.integers(0, 299),
        st.integers(1, 90),
        st.sampled_from(["stalled", "crashed", "idle"]),
        st.sampled_from(["hardware", "network", "storage", "job", "unknown"]),
        st.one_of(st.none(), st.integers(0, 10**9)),
    ),
    max_size=4,
)


def write_incidents(r, prefix: str, job: str, starts: list[int], drawn: list[tuple]) -> None:
    """Each drawn incident in one of the job's booked buckets (a sealed day holds it)."""
    if not starts:
        return
    pipe = r.pipeline(transaction=True)
    for agent, at, into, minutes, category, cause, cost in drawn:
        start = (starts[at % len(starts)] + into) * 1000
        inc = {
            "category": category, "start": start, "end": start + 60_000 * minutes, "gpu_ms": 60_000 * minutes,
            "ranks": [0, 1], "zero_util_ranks": [], "host": agent, "cause": cause,
            "cause_why": f"{cause} said so" if cause != "unknown" else "", "cost_micro": cost,
        }  # fmt: skip
        ledger.queue_incidents(pipe, prefix, job, agent, [inc])
    pipe.execute()


@given(
    led=ledgers,
    drawn=st.dictionaries(st.sampled_from(["a", "team/b", "c-3"]), incident_lists, max_size=3),
    from_day=st.integers(0, DAYS),
    windows=st.lists(
        st.tuples(st.integers(-12, DAYS * 288), st.integers(1, DAYS * 288 + 24)), min_size=1, max_size=3
    ),
)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_a_redis_that_lost_the_ledger_reads_every_window_as_before_once_restored(
    tmp_path_factory, led, drawn, from_day, windows
):
    r, prefix = _client(), f"rst-{uuid.uuid4().hex[:10]}"
    root = tmp_path_factory.mktemp("archive")
    try:
        for job, (b, v, done, voided) in led.items():
            write_ledger(r, prefix, job, b, v)
            write_steps(r, prefix, job, done, voided)
            attribute(r, prefix, job, f"team-{job[0]}", f"m-{job}")
            set_watermark(r, prefix, job, "n0", DAY0 + (DAYS + 1) * DAY_S)
        # (a job that never booked anything is not in the archive: nothing of it to restore)
        jobs = sorted(j for j, (b, v, done, _) in led.items() if b or v or done)
        for job in jobs:
            write_incidents(r, prefix, job, sorted(led[job][0]), drawn.get(job, []))
        spans = [(DAY0 + 300 * a, DAY0 + 300 * (a + n)) for a, n in windows]
        store = LedgerStore(r, prefix)
        every = (DAY0, DAY0 + (DAYS + 1) * DAY_S)
        before = (snapshot(store, jobs, spans), totals(store, jobs), teams(store, jobs))
        causes_before = store.incidents_many(jobs, *every)
        archive = Archive.open(str(root))
        Sealer(r, prefix, archive, "east", shards=2, delay_s=0).seal(DAY0 + 20 * DAY_S)
        drop_prefix(r, prefix)  # Redis restarted empty
        start = DAY0 + from_day * DAY_S
        rep = Restore(r, prefix, archive, "east").restore(start)
        assert not rep.kept
        after = LedgerStore(r, prefix, cold=ColdLedger(archive, "east"))
        assert (snapshot(after, jobs, spans), totals(after, jobs), teams(after, jobs)) == before
        # every incident back, whatever the window restored: causes, costs, hosts as they were
        assert after.incidents_many(jobs, *every) == causes_before
        stored = sum(r.hlen(keys.incidents_key(prefix, j, a)) for j in jobs for a in ("n0", "n1"))
        assert rep.incidents == stored
        again = Restore(r, prefix, archive, "east").restore(start)  # a second run: nothing new
        assert again.restored == 0 and len(again.kept) == rep.restored
        assert (snapshot(after, jobs, spans), totals(after, jobs)) == before[:2]
    finally:
        drop_prefix(r, prefix)
        shutil.rmtree(root, ignore_errors=True)


STEPS = [(DAY0 * 1000 + 600_000 * k, 7) for k in range(DAYS * 144)]


def _week(r, prefix: str) -> dict[str, dict[int, np.ndarray]]:
    """Two jobs booked every hour of six days, with steps, a void, a team and meta each."""
    rng = np.random.default_rng(3)
    out = {}
    for job, team in (("llm/a", "llm"), ("v/b", "vision")):
        b = {DAY0 + 3600 * h: rng.integers(0, 10**9, (N_CAT, 3)) for h in range(DAYS * 24)}
        write_ledger(r, prefix, job, b, {})
        write_steps(r, prefix, job, STEPS, [4])
        attribute(r, prefix, job, team, f"m-{team}")
        set_watermark(r, prefix, job, "n0", DAY0 + (DAYS + 1) * DAY_S)
        out[job] = b
    return out


def test_a_day_the_agents_booked_again_is_kept_and_the_bill_by_team_is_the_same_over_http(tmp_path):
    r, prefix = _client(), f"rst-{uuid.uuid4().hex[:10]}"
    try:
        booked = _week(r, prefix)
        window = "2026-01-01T00:00:00Z,2026-01-07T00:00:00Z"

        def bill(store: LedgerStore) -> object:
            with served(store) as (url, _):
                q = {"window": window, "aggregate": "team"}
                got = httpx.get(f"{url}/api/v1/allocation", params=q, timeout=30)
            assert got.status_code == 200, got.text
            return got.json()["rows"]

        want = bill(LedgerStore(r, prefix))
        archive = Archive.open(str(tmp_path))
        Sealer(r, prefix, archive, "east", shards=2, delay_s=0).seal(DAY0 + 20 * DAY_S)
        drop_prefix(r, prefix)
        # The agents were back before the restore and booked llm/a's day 5 again.
        day5 = (DAY0 + 5 * DAY_S, DAY0 + 6 * DAY_S)
        again = {b: a for b, a in booked["llm/a"].items() if day5[0] <= b < day5[1]}
        write_ledger(r, prefix, "llm/a", again, {})
        write_steps(r, prefix, "llm/a", STEPS, [4], within=day5)
        rep = Restore(r, prefix, archive, "east").restore(DAY0 + 2 * DAY_S)
        assert rep.kept == ["llm/a 2026-01-06"] and rep.restored == 2 * 4 - 1, rep
        assert hot_from(r, prefix) == DAY0 + 2 * DAY_S  # nothing before the window: the archive's
        got = bill(LedgerStore(r, prefix, cold=ColdLedger(archive, "east")))
        # the same bill (day 5 once), each team said to come from the archive
        assert [row.pop("attribution") for row in got] == [
            *({"team": {"value": t, "source": "restored from the archive"}} for t in ("llm", "vision")),
            None,  # (the unassigned row's)
        ]
        assert got == [{k: v for k, v in row.items() if k != "attribution"} for row in want]
    finally:
        drop_prefix(r, prefix)


def test_the_restore_command_from_a_clean_checkout(tmp_path, cli):
    r, prefix = _client(), f"rst-{uuid.uuid4().hex[:10]}"
    try:
        _week(r, prefix)
        archive = Archive.open(str(tmp_path))
        Sealer(r, prefix, archive, "east", shards=2, delay_s=0).seal(DAY0 + 20 * DAY_S)
        (t,) = LedgerStore(r, prefix).tables(["v/b"], [(DAY0, DAY0 + DAYS * DAY_S)])[1]
        drop_prefix(r, prefix)
        days = (int(time.time()) - DAY0) // DAY_S + 1  # every sealed day is inside the window
        common = [
            "--redis-url",
            SHARED_URL,
            "--prefix",
            prefix,
            "--archive",
            str(tmp_path),
            "--cluster",
            "east",
        ]
        done = cli("archive", "restore", *common, "--hot-days", str(days))
        assert done.returncode == 0 and "restored 12 job-day(s)" in done.stderr, done.stderr
        (back,) = LedgerStore(r, prefix).tables(["v/b"], [(DAY0, DAY0 + DAYS * DAY_S)])[1]
        assert back.net.tolist() == t.net.tolist() and int(t.net.sum()) > 0
        twice = cli("archive", "restore", *common, "--hot-days", str(days))
        assert (
            twice.returncode == 0 and "restored 0 job-day(s)" in twice.stderr and "kept: v/b" in twice.stderr
        )
        nowhere = cli("archive", "restore", *common[:-2], "--cluster", "west")
        assert nowhere.returncode == 2 and "no manifest of cluster 'west'" in nowhere.stderr, nowhere.stderr
    finally:
        drop_prefix(r, prefix)
