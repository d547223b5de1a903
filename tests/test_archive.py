"""The sealed archive (core/archive.py, store/archive.py, services/sealer.py): a ledger written by
the ledger's own writer, sealed to Parquet, gives the same totals for any window as the ledger
does, to the micro-unit; sealing again, twice at once or after more days never counts a bucket
twice; a day an agent has not booked past waits; a damaged file is found; an S3-API server
(moto's, a real HTTP server) holds the same archive as a directory."""

from __future__ import annotations

import json
import shutil
import threading
import uuid

import numpy as np
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from costexporter.core.archive import DAY_S, INCIDENTS_TOTAL, Manifest, Totals, sealable_before
from costexporter.core.model import CATEGORIES
from costexporter.services.sealer import Sealer, verify, window_totals
from costexporter.store import keys, ledger
from costexporter.store.archive import Archive

from .conftest import SHARED_URL, drop_prefix

DAY0 = 1_767_225_600  # 2026-01-01T00:00:00Z
N_CAT = len(CATEGORIES)


def _client() -> redis.Redis:
    return redis.Redis.from_url(SHARED_URL, decode_responses=True)


def write_ledger(
    r: redis.Redis, prefix: str, job: str, buckets: dict[int, np.ndarray], voided: dict[int, np.ndarray]
) -> None:
    """Amounts written as an agent's round writes them (`ledger.queue_amounts`, in a MULTI)."""
    pipe = r.pipeline(transaction=True)
    if buckets:
        ledger.queue_amounts(pipe, prefix, job, buckets, "pv1")
    if voided:
        ledger.queue_amounts(pipe, prefix, job, voided, "pv1", voided=True)
    pipe.zadd(keys.jobs_key(prefix), {job: DAY0})
    pipe.execute()


def set_watermark(r: redis.Redis, prefix: str, job: str, agent: str, booked_until_s: int) -> None:
    r.set(keys.watermark_key(prefix, job, agent), json.dumps({"booked_until": booked_until_s * 1000}))


def ledger_window(r: redis.Redis, prefix: str, job: str, start_s: int, end_s: int) -> dict[str, list[int]]:
    """The ledger's own net amounts over the 5-minute buckets starting in [start_s, end_s)."""
    t = Totals()
    for s in r.zrangebyscore(keys.index_key(prefix, job, "5m"), start_s, f"({end_s}"):
        a = ledger.read_amounts(r, prefix, job, "5m", int(float(s)))
        for c in CATEGORIES:
            v = t.by_category.setdefault(c, [0, 0, 0])
            for i, u in enumerate(("ms", "mj", "ucost")):
                v[i] += a.get(f"{c}:{u}", 0) - a.get(f"voided:{c}:{u}", 0)
    return t.to_json()


amounts = st.lists(st.integers(0, 10**12), min_size=N_CAT * 3, max_size=N_CAT * 3).map(
    lambda xs: np.asarray(xs, np.int64).reshape(N_CAT, 3)
)
ledgers = st.dictionaries(
    st.sampled_from(["a", "team/b", "c-3", "d.4"]),
    st.tuples(
        st.dictionaries(st.integers(0, 3 * 288 - 1).map(lambda k: DAY0 + 300 * k), amounts, max_size=8),
        st.dictionaries(st.integers(0, 3 * 288 - 1).map(lambda k: DAY0 + 300 * k), amounts, max_size=2),
    ),
    min_size=1,
    max_size=4,
)


@given(
    led=ledgers,
    windows=st.lists(st.tuples(st.integers(-10, 900), st.integers(1, 900)), min_size=1, max_size=5),
)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_sealed_totals_equal_the_ledgers_for_any_window_and_sealing_again_changes_nothing(
    tmp_path_factory, led, windows
):
    r, prefix = _client(), f"arch-{uuid.uuid4().hex[:10]}"
    root = tmp_path_factory.mktemp("archive")
    try:
        for job, (b, v) in led.items():
            write_ledger(r, prefix, job, b, v)
            set_watermark(r, prefix, job, "n0", DAY0 + 5 * DAY_S)
        archive = Archive.open(str(root))
        sealer = Sealer(r, prefix, archive, "east", shards=3, delay_s=0)
        first = sealer.seal(DAY0 + 10 * DAY_S)
        manifest = (root / "cluster=east" / "manifest.json").read_bytes() if first.written else b""
        files = sorted(p.name for p in root.rglob("*.parquet"))
        again = sealer.seal(DAY0 + 10 * DAY_S)
        assert not again.written  # the same content: nothing new
        assert sorted(p.name for p in root.rglob("*.parquet")) == files
        if first.written:
            assert (root / "cluster=east" / "manifest.json").read_bytes() == manifest
        assert not verify(archive).problems
        for a, n in windows:
            start, end = DAY0 + 300 * a, DAY0 + 300 * (a + n)
            got = window_totals(archive, start, end)
            for job in led:
                want = ledger_window(r, prefix, job, start, end)
                have = got.get(("east", job), Totals()).to_json()
                assert have == want, (job, start, end)
    finally:
        drop_prefix(r, prefix)
        shutil.rmtree(root, ignore_errors=True)


def _one_day(r: redis.Redis, prefix: str, job: str, day: int, gpu_ms: int) -> None:
    a = np.zeros((N_CAT, 3), np.int64)
    a[0] = [gpu_ms, 1000, 7]
    write_ledger(r, prefix, job, {DAY0 + day * DAY_S + 600: a}, {})


def test_a_day_waits_for_every_agent_and_a_late_job_is_a_new_version_never_a_second_count(tmp_path, prefix):
    r = _client()
    for job in ("x", "y"):
        _one_day(r, prefix, job, 0, 5_000)
    set_watermark(r, prefix, "x", "n0", DAY0 + 2 * DAY_S)
    set_watermark(r, prefix, "y", "n0", DAY0 + 2 * DAY_S)
    set_watermark(r, prefix, "y", "n1", DAY0 + 3600)  # y's second agent is behind: day 0 not sealable
    archive = Archive.open(str(tmp_path))
    sealer = Sealer(r, prefix, archive, "east", shards=1, delay_s=0, max_wait_s=30 * DAY_S)
    rep = sealer.seal(DAY0 + 3 * DAY_S)
    assert len(rep.written) == 1
    m = archive.manifest("east")
    [entry] = m.entries.values()
    assert entry.jobs == ("x",) and entry.version == 1 and entry.final == ("x",)
    # the seal delay holds too: a day ended less than the delay ago waits
    assert sealable_before([(DAY0 + 2 * DAY_S) * 1000], DAY0 + DAY_S + 10, 3600, 2 * DAY_S) == DAY0
    # ... and a job whose agents stopped short of a day (it ended) is sealed after the longest wait
    assert sealable_before([(DAY0 + 3600) * 1000], DAY0 + DAY_S + 10, 0, 2 * DAY_S) == DAY0
    assert sealable_before([(DAY0 + 3600) * 1000], DAY0 + 3 * DAY_S, 0, 2 * DAY_S) == DAY0 + DAY_S
    set_watermark(r, prefix, "y", "n1", DAY0 + DAY_S)  # caught up
    rep = sealer.seal(DAY0 + 3 * DAY_S)
    [entry] = archive.manifest("east").entries.values()
    assert entry.jobs == ("x", "y") and entry.version == 2 and len(entry.superseded) == 1
    assert entry.final == ("x", "y")  # both past every watermark now: not read from Redis again
    # the superseded file is gone: a glob over the archive reads the day once too
    assert [p.name for p in tmp_path.rglob("*.parquet")] == [entry.path.split("/")[-1]]
    got = window_totals(archive, DAY0, DAY0 + DAY_S)
    assert got[("east", "x")].to_json()["productive"] == [5_000, 1000, 7]
    assert got[("east", "y")].to_json()["productive"] == [5_000, 1000, 7]  # once, not twice
    assert sum(t.to_json()["productive"][0] for t in got.values()) == 10_000


def test_a_day_sealed_after_the_longest_wait_is_read_again_and_a_late_booking_is_a_new_version(
    tmp_path, prefix
):
    """A job whose agent stopped short of the day (it ended, or the agent is gone) is sealed after
    --max-wait; a booking into that day later (the agent back, catching up) is sealed again as a
    new version, never added twice; once every watermark is past the day it is final."""
    r = _client()
    _one_day(r, prefix, "w", 0, 1_000)
    set_watermark(r, prefix, "w", "n0", DAY0 + 3600)  # stopped an hour into day 0
    archive = Archive.open(str(tmp_path))
    sealer = Sealer(r, prefix, archive, "east", shards=1, delay_s=0, max_wait_s=2 * DAY_S)
    assert not sealer.seal(DAY0 + DAY_S + 60).written  # the longest wait is not over
    assert len(sealer.seal(DAY0 + 3 * DAY_S).written) == 1
    [e] = archive.manifest("east").entries.values()
    assert e.final == () and e.version == 1
    _one_day(r, prefix, "w", 0, 500)  # the agent came back and booked into the sealed day
    set_watermark(r, prefix, "w", "n0", DAY0 + 2 * DAY_S)
    rep = sealer.seal(DAY0 + 4 * DAY_S)
    [e] = archive.manifest("east").entries.values()
    assert len(rep.written) == 1 and e.version == 2 and e.final == ("w",)
    assert window_totals(archive, DAY0, DAY0 + DAY_S)[("east", "w")].to_json()["productive"][0] == 1_500
    assert not sealer.seal(DAY0 + 5 * DAY_S).written and not verify(archive).problems


class Crash(Exception):
    pass


def _crash_once(monkeypatch, archive: Archive, method: str) -> None:
    real = getattr(archive, method)
    calls = {"n": 0}

    def crashing(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 1:
            raise Crash(method)
        return real(*a, **kw)

    monkeypatch.setattr(archive, method, crashing)


def test_a_sealer_that_dies_at_any_step_leaves_each_day_once_after_the_next_seal(
    tmp_path, prefix, monkeypatch
):
    """Killed after writing its files but before the manifest names them, or after the manifest
    names a new version but before the old file is removed: the next seal names each day's one
    file, removes what no manifest names (once it is old enough not to be another sealer's in
    flight), and a glob over the archive counts every day once. A file lost by hand is written
    again the next time its day is read."""
    r = _client()
    for d in range(2):
        _one_day(r, prefix, "k", d, 1_000 * (d + 1))
    set_watermark(r, prefix, "k", "n0", DAY0 + 3600)  # stopped early: days sealed after the wait
    archive = Archive.open(str(tmp_path))
    sealer = Sealer(r, prefix, archive, "east", shards=1, delay_s=0, max_wait_s=0, orphan_age_s=0)
    _crash_once(monkeypatch, archive, "save_manifest")
    with pytest.raises(Crash):
        sealer.seal(DAY0 + 3 * DAY_S)
    assert (
        len(list(tmp_path.rglob("*.parquet"))) == 2
        and not (tmp_path / "cluster=east" / "manifest.json").exists()
    )
    sealer.seal(DAY0 + 3 * DAY_S)
    assert len(list(tmp_path.rglob("*.parquet"))) == 2 and not verify(archive).problems
    # A late booking into day 1, sealed again; killed before the superseded file is removed.
    _one_day(r, prefix, "k", 1, 500)
    _crash_once(monkeypatch, archive, "delete")
    with pytest.raises(Crash):
        sealer.seal(DAY0 + 3 * DAY_S)
    assert len(list(tmp_path.rglob("*.parquet"))) == 3  # the old version is still there
    assert verify(archive).orphans == [
        "date=2026-01-02/" + archive.manifest("east").entries["2026-01-02/000"].superseded[0].split("/")[1]
    ]
    rep = sealer.seal(DAY0 + 3 * DAY_S)
    assert len(rep.swept) == 1 and "no manifest named removed" in rep.line()
    files = sorted(tmp_path.rglob("*.parquet"))
    assert len(files) == 2 and not verify(archive).orphans
    import pyarrow.dataset as ds

    glob = ds.dataset([str(f) for f in files], format="parquet").to_table()
    assert sum(glob.column("gpu_ms").to_pylist()) == 1_000 + 2_000 + 500  # each day once
    # Younger than the age a sealer in flight may have: not swept.
    young = Sealer(r, prefix, archive, "east", shards=1, delay_s=0, max_wait_s=0)
    (tmp_path / "cluster=east" / "date=2026-01-01" / "part-000-stray.parquet").write_bytes(b"x")
    assert not young.seal(DAY0 + 3 * DAY_S).swept
    (tmp_path / "cluster=east" / "date=2026-01-01" / "part-000-stray.parquet").unlink()
    # A file lost by hand: the next seal that reads its day writes it again.
    [lost] = [f for f in files if "2026-01-02" in str(f)]
    lost.unlink()
    assert verify(archive).problems
    sealer.seal(DAY0 + 3 * DAY_S)
    assert lost.exists() and not verify(archive).problems


def test_two_sealers_at_once_leave_one_file_per_day_and_the_same_totals(tmp_path, prefix):
    r = _client()
    for d in range(4):
        for job in ("p", "q", "s"):
            _one_day(r, prefix, job, d, 1_000 * (d + 1))
    for job in ("p", "q", "s"):
        set_watermark(r, prefix, job, "n0", DAY0 + 5 * DAY_S)
    archive = Archive.open(str(tmp_path))
    errors: list[BaseException] = []

    def run() -> None:
        try:
            Sealer(_client(), prefix, Archive.open(str(tmp_path)), "east", shards=2, delay_s=0).seal(
                DAY0 + 9 * DAY_S
            )
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    m = archive.manifest("east")
    assert {k.split("/")[0] for k in m.entries} == {"2026-01-01", "2026-01-02", "2026-01-03", "2026-01-04"}
    assert not verify(archive).problems
    got = window_totals(archive, DAY0, DAY0 + 4 * DAY_S)
    assert {j: t.to_json()["productive"][0] for (_c, j), t in got.items()} == {
        "p": 10_000,
        "q": 10_000,
        "s": 10_000,
    }


def test_a_damaged_or_missing_file_is_found_and_read_fails_closed(tmp_path, prefix, cli):
    r = _client()
    _one_day(r, prefix, "z", 0, 3_000)
    _one_day(r, prefix, "z", 1, 3_000)
    set_watermark(r, prefix, "z", "n0", DAY0 + 3 * DAY_S)
    archive = Archive.open(str(tmp_path))
    Sealer(r, prefix, archive, "east", shards=1, delay_s=0).seal(DAY0 + 4 * DAY_S)
    files = sorted(tmp_path.rglob("*.parquet"))
    assert len(files) == 2
    data = bytearray(files[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    files[0].write_bytes(bytes(data))
    files[1].unlink()
    done = cli("archive", "verify", "--archive", str(tmp_path))
    assert done.returncode == 1 and "damaged" in done.stdout and "missing" in done.stdout, (
        done.stdout + done.stderr
    )
    bad = cli(
        "archive", "totals", "--archive", str(tmp_path), "--start", str(DAY0), "--end", str(DAY0 + DAY_S)
    )
    assert bad.returncode == 2 and "damaged" in bad.stderr and "Traceback" not in bad.stderr


def test_the_commands_seal_verify_and_read_totals_from_a_clean_checkout(tmp_path, prefix, cli):
    r = _client()
    _one_day(r, prefix, "team/run-1", 0, 7_200_000)  # 2 GPU-hours
    set_watermark(r, prefix, "team/run-1", "n0", DAY0 + 2 * DAY_S)
    seal = cli("archive", "seal", "--redis-url", SHARED_URL, "--prefix", prefix, "--archive", str(tmp_path),
               "--cluster", "west", "--delay", "0")  # fmt: skip
    assert seal.returncode == 0, seal.stderr
    assert "date=2026-01-01/part-" in seal.stdout and "sealed 1 file(s)" in seal.stderr
    again = cli("archive", "seal", "--redis-url", SHARED_URL, "--prefix", prefix, "--archive", str(tmp_path),
                "--cluster", "west", "--delay", "0")  # fmt: skip
    assert again.returncode == 0 and "sealed 0 file(s)" in again.stderr and "1 already sealed" in again.stderr
    ok = cli("archive", "verify", "--archive", str(tmp_path))
    assert ok.returncode == 0 and "1 file(s)" in ok.stderr
    tot = cli(
        "archive",
        "totals",
        "--archive",
        str(tmp_path),
        "--start",
        "2026-01-01T00:00:00Z",
        "--end",
        "2026-01-02T00:00:00Z",
    )
    assert tot.returncode == 0, tot.stderr
    [line] = [json.loads(x) for x in tot.stdout.splitlines()]
    assert line["cluster"] == "west" and line["job"] == "team/run-1"
    assert line["gpu_hours"]["productive"] == pytest.approx(2.0) and line["cost_micro"]["productive"] == 7
    assert "_steps" not in line["gpu_hours"] and line["steps"] == {"completed": 0, "voided": 0, "valid": 0}
    nope = cli("archive", "verify", "--archive", "s3://")
    assert nope.returncode == 2 and "Traceback" not in nope.stderr


def test_object_storage_holds_the_same_archive_as_a_directory(s3, tmp_path, prefix):
    url, client = s3
    r = _client()
    for d in range(3):
        _one_day(r, prefix, "obj", d, 60_000 * (d + 1))
    set_watermark(r, prefix, "obj", "n0", DAY0 + 4 * DAY_S)
    local, remote = Archive.open(str(tmp_path)), Archive.open(url)
    for a in (local, remote):
        rep = Sealer(r, prefix, a, "east", shards=1, delay_s=0).seal(DAY0 + 5 * DAY_S)
        assert len(rep.written) == 3
    names = sorted(o["Key"] for o in client.list_objects_v2(Bucket="ledger")["Contents"])
    assert names[-1] == "costexporter/cluster=east/manifest.json" and len(names) == 4
    assert all(n.startswith("costexporter/cluster=east/date=2026-01-0") for n in names[:3])
    assert remote.manifest("east").to_json() == local.manifest("east").to_json()  # the same bytes' hashes
    assert not verify(remote).problems
    assert (
        window_totals(remote, DAY0, DAY0 + 3 * DAY_S)[("east", "obj")].to_json()["productive"][0] == 360_000
    )
    assert not Sealer(r, prefix, remote, "east", shards=1, delay_s=0).seal(DAY0 + 5 * DAY_S).written


def test_one_archive_answers_for_several_clusters(tmp_path, prefix):
    r = _client()
    archive = Archive.open(str(tmp_path))
    for i, cluster in enumerate(("east", "west")):
        p = f"{prefix}-{cluster}"
        _one_day(r, p, "j", 0, 1_000 * (i + 1))
        set_watermark(r, p, "j", "n0", DAY0 + 2 * DAY_S)
        Sealer(r, p, archive, cluster, shards=1, delay_s=0).seal(DAY0 + 3 * DAY_S)
        drop_prefix(r, p)
    assert archive.clusters() == ["east", "west"]
    got = window_totals(archive, DAY0, DAY0 + DAY_S)
    assert {c: t.to_json()["productive"][0] for (c, _j), t in got.items()} == {"east": 1_000, "west": 2_000}
    assert set(window_totals(archive, DAY0, DAY0 + DAY_S, ["west"])) == {("west", "j")}


def test_a_job_whose_trainer_broke_the_jobs_index_is_sealed_all_the_same(tmp_path, prefix):
    """The sealer finds jobs by their ledgers, not by the index a trainer can write."""
    r = _client()
    _one_day(r, prefix, "hidden", 0, 4_000)
    set_watermark(r, prefix, "hidden", "n0", DAY0 + 2 * DAY_S)
    r.delete(keys.jobs_key(prefix))
    r.set(keys.jobs_key(prefix), "not a sorted set")
    archive = Archive.open(str(tmp_path))
    assert len(Sealer(r, prefix, archive, "east", shards=1, delay_s=0).seal(DAY0 + 3 * DAY_S).written) == 1
    assert window_totals(archive, DAY0, DAY0 + DAY_S)[("east", "hidden")].to_json()["productive"][0] == 4_000


def test_a_manifest_of_a_newer_schema_is_refused_not_misread():
    with pytest.raises(ValueError, match="newer than this release"):
        Manifest.from_json({"schema": 99, "cluster": "c", "entries": {}})


@pytest.mark.parametrize(
    "text",
    ["not json", "[]", '{"cluster": "east", "entries": [1]}',
     '{"cluster": "east", "entries": {"d/0": {"path": 1}}}',
     '{"cluster": "east", "entries": {"d/0": {"path": "p", "sha256": "x", "rows": 1, "totals": [1]}}}'],
)  # fmt: skip
def test_an_unreadable_manifest_is_one_line_never_a_traceback(tmp_path, cli, text):
    (tmp_path / "cluster=east").mkdir()
    (tmp_path / "cluster=east" / "manifest.json").write_text(text)
    done = cli("archive", "verify", "--archive", str(tmp_path))
    assert (
        done.returncode == 2
        and "manifest of cluster 'east'" in done.stderr
        and "Traceback" not in done.stderr
    )


def test_each_row_says_whose_it_is_so_the_parquet_alone_bills_by_team(tmp_path, prefix):
    """Each sealed row carries its job's team and attributes as the API shows them (the agents'
    attribution over the trainer's meta): a query over the files by team equals the ledger's
    bill by team. Meta that changes after a day was sealed for good does not hold its expiry."""
    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    from costexporter.services.retention import Retention
    from costexporter.store.ledger_read import LedgerStore

    from .api_helpers import T0, write_job

    r = _client()
    write_job(r, prefix, "llm/a", "llm", model="qwen3", cost_center="cc-1")
    write_job(r, prefix, "llm/b", "llm")
    write_job(r, prefix, "v/c", "vision")
    write_job(r, prefix, "orphan", None)
    for j in ("llm/a", "llm/b", "v/c", "orphan"):
        set_watermark(r, prefix, j, "n0", T0 + 3 * DAY_S)
    archive = Archive.open(str(tmp_path))
    sealer = Sealer(r, prefix, archive, "east", shards=2, delay_s=0)
    sealer.seal(T0 + 4 * DAY_S)
    t = ds.dataset([str(f) for f in tmp_path.rglob("*.parquet")], format="parquet").to_table()
    t = t.append_column("net", pc.subtract(t.column("cost_micro"), t.column("voided_cost_micro")))
    by_team = {
        row["team"]: row["net_sum"] for row in t.group_by("team").aggregate([("net", "sum")]).to_pylist()
    }
    store = LedgerStore(r, prefix)
    want: dict[str, int] = {}
    for j, team in (("llm/a", "llm"), ("llm/b", "llm"), ("v/c", "vision"), ("orphan", "")):
        a = store.amounts_many([j], T0 - DAY_S, T0 + 2 * DAY_S)[j]
        want[team] = want.get(team, 0) + sum(a.ucost.values())
    assert by_team == want and want["llm"] > 0
    metas = store.meta_many(["llm/a"])
    [attrs] = {
        x
        for x, j in zip(t.column("attributes").to_pylist(), t.column("job").to_pylist(), strict=True)
        if j == "llm/a"
    }
    assert json.loads(attrs) == dict(metas["llm/a"]) and json.loads(attrs)["model"] == "qwen3"
    r.hset(keys.meta_key(prefix, "llm/a"), "model", "qwen3-next")  # after the day was sealed for good
    rep = Retention(sealer, hot_days=1).expire(T0 + 4 * DAY_S)
    assert not rep.held and rep.keys > 0, rep


def test_a_file_of_the_first_schema_reads_with_no_steps_and_no_owner():
    """An archive sealed by a release of schema 1 (no step columns, no team or attributes) is
    read by this one: its amounts as they were, its steps 0, whose it is unknown ("")."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    from costexporter.core.archive import V1_COLUMNS
    from costexporter.store.archive import rows_of

    row = (1, "east", "2026-01-01", "j", DAY0, "productive", 5, 6, 7, 1, 0, 0, "pv1")
    table = pa.Table.from_arrays(
        [pa.array([v], type=getattr(pa, t)()) for v, (_, t) in zip(row, V1_COLUMNS, strict=True)],
        names=[n for n, _ in V1_COLUMNS],
    )
    buf = io.BytesIO()
    pq.write_table(table, buf)
    [got] = rows_of(buf.getvalue())
    assert got == (*row, 0, 0, 0, 0, "", "", "", "", 0, 0)  # nor incidents
    assert Totals.of([got]).to_json() == {"productive": [4, 6, 7]}


def test_a_trainer_that_wrote_its_meta_as_another_type_does_not_stop_the_seal(tmp_path, prefix):
    """The sealer reads the jobs' meta (the trainers' keys): one written as a stream is read as
    no meta, the day sealed all the same, and the other job's attributes are its own."""
    r = _client()
    for job in ("ok", "bad"):
        _one_day(r, prefix, job, 0, 1_000)
        set_watermark(r, prefix, job, "n0", DAY0 + 2 * DAY_S)
    r.hset(keys.meta_key(prefix, "ok"), "model", "m1")
    r.xadd(keys.meta_key(prefix, "bad"), {"model": "x"})
    archive = Archive.open(str(tmp_path))
    assert Sealer(r, prefix, archive, "east", shards=1, delay_s=0).seal(DAY0 + 3 * DAY_S).written
    [e] = archive.manifest("east").entries.values()
    rows = archive.read("east", e)
    assert {r_[3]: json.loads(r_[18]) for r_ in rows} == {"bad": {}, "ok": {"model": "m1"}}


def test_reading_a_sealed_file_starts_no_arrow_thread_that_could_abort_the_exit():
    """A command that read the archive exited with SIGABRT ~1 time in 400: Arrow's I/O pool read
    the Python bytes and its worker dropped the last reference to them while the interpreter
    exited ("terminate called without an active exception"). A sealed file is read in the
    caller's thread from a buffer Arrow owns: no thread is started (counted in a fresh process,
    where the old read started two), and the process exits 0."""
    import subprocess
    import sys

    code = """
import os
from costexporter.store.archive import _table, parquet_bytes
row = (3, "east", "2026-01-01", "j", 1767225600, "productive", 5, 6, 7, 1, 0, 0, "pv1",
       1, 2, 0, 0, "t", "", "", "", 0, 0)
data = parquet_bytes([row])
before = len(os.listdir("/proc/self/task"))
for _ in range(3):
    assert _table(data).num_rows == 1
print(before, len(os.listdir("/proc/self/task")))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    before, after = map(int, out.stdout.split())
    assert before >= 1 and after == before


def test_incidents_are_sealed_with_their_cause_and_sum_by_cause_as_the_api_adds_them(tmp_path):
    """A job's incidents, two agents', sealed as rows of their own (every amount 0: the day's
    sums unchanged), each with its cause, GPU time and cost in columns, so a group-by over the
    file gives the API's waste by cause; the manifest's totals count them. A day holding a
    stretch its agent is still extending is sealed as it stands, sealed again as it grows (the
    retention holds the day until it is), and final only once every agent booked well past it."""
    import pyarrow.compute as pc

    from costexporter.services.retention import Retention
    from costexporter.services.sealer import CLOSED_MS
    from costexporter.store.ledger_read import LedgerStore

    r, prefix = _client(), f"arc-{uuid.uuid4().hex[:10]}"
    a = np.zeros((N_CAT, 3), np.int64)
    a[0] = [3_600_000, 10**9, 3_500_000]
    write_ledger(r, prefix, "j", {DAY0 + 300 * k: a for k in range(12)}, {})
    end_of_day = DAY0 + DAY_S - 400  # the last stretch runs to the day's end and on

    def inc(start_s: int, cause: str, cost: int | None, host: str, end_s: int) -> dict:
        return {
            "category": "stalled", "start": start_s * 1000, "end": end_s * 1000,
            "gpu_ms": 2 * (end_s - start_s) * 1000, "ranks": [0, 1], "zero_util_ranks": [], "host": host,
            "cause": cause, "cause_why": f"{cause} said so", "cost_micro": cost,
        }  # fmt: skip

    def write(agent: str, *incs: dict) -> None:
        pipe = r.pipeline(transaction=True)
        ledger.queue_incidents(pipe, prefix, "j", agent, list(incs))
        pipe.execute()

    write(
        "n0",
        inc(DAY0 + 100, "hardware", 7_000, "n0", DAY0 + 220),
        inc(DAY0 + 1900, "job", 3_000, "n0", DAY0 + 2020),
    )
    write("n1", inc(DAY0 + 3000, "network", None, "n1", DAY0 + 3120))
    write("n1", inc(end_of_day, "storage", 1_000, "n1", DAY0 + DAY_S))  # still open
    set_watermark(r, prefix, "j", "n0", DAY0 + DAY_S + 60)
    set_watermark(r, prefix, "j", "n1", DAY0 + DAY_S + 60)
    try:
        archive = Archive.open(str(tmp_path))
        sealer = Sealer(r, prefix, archive, "east", shards=1, delay_s=0)
        assert sealer.seal(DAY0 + 3 * DAY_S).written
        [e] = archive.manifest("east").entries.values()
        assert e.totals[INCIDENTS_TOTAL] == [4, 720_000 + 800_000, 11_000]
        assert e.totals["productive"] == [12 * 3_600_000, 12 * 10**9, 12 * 3_500_000]  # sums as before
        assert e.final == ()  # the storage stretch is not closed: the day is read again
        t = archive.table("east", e)
        by = (
            t.filter(pc.not_equal(t.column("cause"), ""))
            .group_by("cause")
            .aggregate([("incident_cost_micro", "sum"), ("incident_gpu_ms", "sum")])
            .to_pydict()
        )
        sql = dict(
            zip(
                by["cause"],
                zip(by["incident_cost_micro_sum"], by["incident_gpu_ms_sum"], strict=True),
                strict=True,
            )
        )
        api: dict[str, tuple[int, float]] = {}
        for x in LedgerStore(r, prefix).incidents("j", DAY0, DAY0 + DAY_S):
            u, g = api.get(x["cause"], (0, 0))
            api[x["cause"]] = (u + (x["cost_micro"] or 0), g + x["gpu_ms"])
        assert sql == api and set(api) == {"hardware", "job", "network", "storage"}
        # the open stretch grows in the agent's next rounds: the day waits for its new seal
        write("n1", inc(end_of_day, "storage", 4_000, "n1", DAY0 + DAY_S + 300))
        set_watermark(r, prefix, "j", "n1", DAY0 + DAY_S + 360)
        held = Retention(sealer, hot_days=1).expire(DAY0 + 3 * DAY_S)
        assert held.hot_from == DAY0 and "seal again" in held.held[0], held.line()  # the day stays
        assert sealer.seal(DAY0 + 3 * DAY_S).written
        [e2] = archive.manifest("east").entries.values()
        assert e2.version == 2 and e2.totals[INCIDENTS_TOTAL] == [4, 720_000 + 1_400_000, 14_000]
        # every agent booked far past it: closed, the day final, and it may leave Redis
        for agent in ("n0", "n1"):
            set_watermark(r, prefix, "j", agent, DAY0 + DAY_S + 300 + CLOSED_MS // 1000 + 1)
        sealer.seal(DAY0 + 3 * DAY_S)
        [e3] = archive.manifest("east").entries.values()
        assert e3.sha256 == e2.sha256 and e3.final == ("j",)
        assert Retention(sealer, hot_days=1).expire(DAY0 + 3 * DAY_S).hot_from == DAY0 + 2 * DAY_S
        assert len(LedgerStore(r, prefix).incidents("j", DAY0, DAY0 + DAY_S)) == 4  # Redis keeps them
    finally:
        drop_prefix(r, prefix)


def test_a_day_sealed_before_incidents_were_still_leaves_redis(tmp_path, monkeypatch):
    """A day the previous release sealed for good (schema 2: no incident rows) while Redis holds
    incidents of it: the retention compares it without them (they stay in Redis) and moves the
    start; the sealer never reads it again."""
    import costexporter.core.archive as core_archive
    from costexporter.services.retention import Retention

    r, prefix = _client(), f"arc-{uuid.uuid4().hex[:10]}"
    a = np.zeros((N_CAT, 3), np.int64)
    a[0] = [3_600_000, 10**9, 3_500_000]
    write_ledger(r, prefix, "j", {DAY0 + 300 * k: a for k in range(3)}, {})
    set_watermark(r, prefix, "j", "n0", DAY0 + 2 * DAY_S)
    inc = {"category": "stalled", "start": (DAY0 + 60) * 1000, "end": (DAY0 + 120) * 1000, "gpu_ms": 60_000,
           "ranks": [0], "zero_util_ranks": [], "host": "n0", "cause": "job", "cause_why": "exit 1",
           "cost_micro": 10}  # fmt: skip
    pipe = r.pipeline(transaction=True)
    ledger.queue_incidents(pipe, prefix, "j", "n0", [inc])
    pipe.execute()
    try:
        archive = Archive.open(str(tmp_path))
        sealer = Sealer(r, prefix, archive, "east", shards=1, delay_s=0)
        with monkeypatch.context() as m:  # the previous release's sealer
            m.setattr(core_archive, "SCHEMA_VERSION", 2)
            m.setattr(Sealer, "_incidents", lambda *a, **k: {})
            assert sealer.seal(DAY0 + 3 * DAY_S).written
        [e] = archive.manifest("east").entries.values()
        assert e.final == ("j",) and INCIDENTS_TOTAL not in e.totals
        assert {row[0] for row in archive.read("east", e)} == {2}
        assert not sealer.seal(DAY0 + 3 * DAY_S).written  # final: not read again
        rep = Retention(sealer, hot_days=1).expire(DAY0 + 3 * DAY_S)
        assert rep.hot_from == DAY0 + 2 * DAY_S and not rep.held, rep.line()
        assert len(ledger_read_incidents(r, prefix)) == 1  # still in Redis
    finally:
        drop_prefix(r, prefix)


def ledger_read_incidents(r, prefix: str) -> list:
    from costexporter.store.ledger_read import LedgerStore

    return LedgerStore(r, prefix).incidents("j", DAY0, DAY0 + DAY_S)


def test_a_rows_named_places_are_its_columns():
    """The row's places the code reads by name (literals, for mypy) are the columns they say."""
    from costexporter.core import archive as a

    names = [n for n, _ in a.COLUMNS]
    assert names[a.BOOKED : a.INCIDENT] == ["team", "attributes"]
    assert [names[i] for i in (a.INCIDENT, a.INCIDENT_GPU_MS, a.INCIDENT_COST_MICRO)] == [
        "incident",
        "incident_gpu_ms",
        "incident_cost_micro",
    ]


def test_a_files_incidents_are_read_once(tmp_path):
    """Other clusters' incidents (their FOCUS credits) come from the sealed files: each file is
    read once and kept by its hash, so a bill asked again reads no file (here: the files gone,
    the same answer)."""
    import pathlib

    from costexporter.store.coldledger import ColdLedger

    r, prefix = _client(), f"arc-{uuid.uuid4().hex[:10]}"
    a = np.zeros((N_CAT, 3), np.int64)
    a[0] = [3_600_000, 10**9, 3_500_000]
    write_ledger(r, prefix, "j", {DAY0 + 300 * k: a for k in range(3)}, {})
    set_watermark(r, prefix, "j", "n0", DAY0 + 2 * DAY_S)
    inc = {"category": "stalled", "start": (DAY0 + 60) * 1000, "end": (DAY0 + 120) * 1000, "gpu_ms": 60_000,
           "ranks": [0], "zero_util_ranks": [], "host": "n0", "cause": "hardware", "cause_why": "Xid 79",
           "cost_micro": 10}  # fmt: skip
    pipe = r.pipeline(transaction=True)
    ledger.queue_incidents(pipe, prefix, "j", "n0", [inc])
    pipe.execute()
    try:
        archive = Archive.open(str(tmp_path))
        assert Sealer(r, prefix, archive, "east", shards=1, delay_s=0).seal(DAY0 + 3 * DAY_S).written
        cold = ColdLedger(archive, "east")
        first = cold.incidents(["j", "k"], DAY0, DAY0 + DAY_S)
        assert first == {"j": [inc], "k": []}
        for f in pathlib.Path(archive.root).rglob("*.parquet"):
            f.unlink()
        assert cold.incidents(["j", "k"], DAY0, DAY0 + DAY_S) == first
    finally:
        drop_prefix(r, prefix)
