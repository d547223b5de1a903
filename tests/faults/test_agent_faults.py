"""The agent's ledger stays exact under real faults.

Real Redis (the shared one, or a private `redis-server` where it is restarted), real
`costexporter serve` processes (replay source, or NVML through tests/fake_nvml.py where the
wall clock matters), the real `costexporter replay` command.
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from costexporter.api.export import gpu_hour_price
from costexporter.core.booking import BookingConfig
from costexporter.core.model import CATEGORIES, Event
from costexporter.core.replay import ReplayConfig, book_trace
from costexporter.sources.synth import TraceBuilder, write_nvidia_smi_csv
from costexporter.store import keys, ledger, protocol, untrusted
from costexporter.store.ledger_read import LedgerStore
from costexporter.trainer.transport import send_entries

from ..api_helpers import served
from ..redis_server import RedisServer, free_port
from ..test_agent import agent_process, offline_ms, post_events, scrape, serve, stop_all, wait_booked

URL = "redis://127.0.0.1:6379/0"
HELPER = Path(__file__).resolve().parents[1] / "helpers" / "nvml_serve.py"


def metric(scraped: dict, name: str, **labels) -> list[float]:
    return [v for lab, v in scraped.get(name, []) if all(lab.get(k) == w for k, w in labels.items())]


def simple_job(job: str, seed: int, n_gpus: int = 2, seconds: int = 240) -> TraceBuilder:
    b = TraceBuilder(n_gpus=n_gpus, per_host=n_gpus, job=job, seed=seed)
    b.run("start")
    b.stretch("compute", seconds, step_s=4, tokens=100)
    b.stretch("deadlock", 60, zero_ranks=(1,))
    b.stretch("compute", 60, step_s=4, tokens=100)
    b.run("end")
    b.stretch("idle", 5)
    return b


# ---- 4. two agents with the same --agent-id ----------------------------------------------------
def test_4_two_agents_with_one_id_book_everything_once_and_say_so(shared, prefix, tmp_path):
    b = simple_job("twins", 4)
    [csv] = write_nvidia_smi_csv(b.samples(), tmp_path / "t")
    post_events(shared, prefix, b)
    expected, offline = offline_ms(b)
    ports = [free_port(), free_port()]
    procs = [serve(csv, "node0", URL, prefix, port, speed=50, book_s=0.1) for port in ports]  # both "node0"
    try:
        wait_booked(shared, prefix, b.job, ["node0"], offline.timeline.end_ms)
        time.sleep(1.0)  # a round or more of the other one after the end: it must book nothing
        total = ledger.read_amounts(shared, prefix, b.job)
        scraped = [scrape(p)[0] for p in ports]
    finally:
        errs = stop_all(procs)
    assert ledger.net_ms(total) == expected  # not twice
    conflicts = [sum(metric(m, "costexporter_agent_conflicts_total")) for m in scraped]
    assert max(conflicts) > 0, conflicts
    assert any("same agent id" in e for e in errs), [e[-500:] for e in errs]


# ---- 5. late events: register after the GPU's time was booked unassigned ----------------------
def test_5_a_late_register_moves_no_time_twice(shared, prefix, tmp_path):
    b = TraceBuilder(n_gpus=2, per_host=2, job="late", seed=5)
    b.run("start")
    b.stretch("compute", 300, step_s=5, tokens=100)
    b.run("end")
    b.stretch("idle", 5)
    [csv] = write_nvidia_smi_csv(b.samples(), tmp_path / "t")
    expected, offline = offline_ms(b)
    p = serve(csv, "node0", URL, prefix, 0, speed=20, book_s=0.1)
    try:
        # The trainers' events are held up (Redis unreachable from the trainer at start) until
        # the agent has sampled the GPUs for more than a minute of trace time.
        deadline = time.monotonic() + 30
        while True:
            node = shared.hgetall(keys.node_key(prefix, "node0"))
            if node and json.loads(node["0"])["ts"] and json.loads(node["0"])["ts"] > b.t0 + 90:
                break
            assert time.monotonic() < deadline, "the agent did not sample"
            time.sleep(0.05)
        post_events(shared, prefix, b)  # with their original timestamps
        wait_booked(shared, prefix, b.job, ["node0"], offline.timeline.end_ms)
    finally:
        stop_all([p])
    job = ledger.net_ms(ledger.read_amounts(shared, prefix, b.job))
    unassigned = ledger.read_amounts(shared, prefix, ledger.UNASSIGNED_JOB).get("unassigned:ms", 0)
    u = ledger.load_watermark(shared, prefix, ledger.UNASSIGNED_JOB, "node0")["booked_until"]
    physical = 2 * (max(u, offline.timeline.end_ms) - int(b.t0 * 1000))
    # The trace's GPUs belong to the job from its first sample to its end, and are unassigned
    # after it: job + unassigned + unobserved is the physical time, the job's own time the
    # offline replay's, and nothing before the job's end went to unassigned as well.
    assert sum(job.values()) + unassigned == physical
    assert job == expected
    assert unassigned == 2 * max(0, u - offline.timeline.end_ms)
    # unassigned time names the price table that costed it, as the job's time does (a FOCUS
    # export reads its exact unit price there, not an average of rounded hours)
    versions = {}
    for j in (b.job, ledger.UNASSIGNED_JOB):
        starts = shared.zrange(keys.index_key(prefix, j, "5m"), 0, 0)
        assert starts, j
        versions[j] = shared.hget(keys.bucket_key(prefix, j, "5m", int(starts[0])), "price_version")
    assert versions[ledger.UNASSIGNED_JOB] == versions[b.job]
    assert gpu_hour_price([versions[ledger.UNASSIGNED_JOB]]) is not None


# ---- 6. a GPU reused by a new job after the old one crashed -----------------------------------
@pytest.mark.parametrize("gap_s", [50, 20], ids=["after the lapse", "before the lapse"])
def test_6_a_gpu_reused_by_a_new_job_leaves_the_old_one(shared, prefix, tmp_path, gap_s):
    """The crashed job's claim ends at its liveness timeout (30 s here, after its last step):
    a new job that registers its GPUs later takes them at once, one that registers sooner waits
    until then (its first seconds are the crashed job's tail)."""
    a = TraceBuilder(n_gpus=2, per_host=2, job="crashed", seed=6)
    a.run("start")
    a.stretch("compute", 100, step_s=5, tokens=100)
    a.stretch("idle", gap_s)  # crashed: no run end
    b = TraceBuilder(n_gpus=2, per_host=2, job="next", seed=6, t0=a.t)  # same GPUs (same UUIDs)
    a.stretch("compute", 150)  # the samples of job "next"
    a.stretch("idle", 5)
    b.run("start")
    b.stretch("compute", 150, step_s=5, tokens=100)
    b.run("end")
    events = a.events + b.events
    results, _ = book_trace(
        a.samples(), events, ReplayConfig(booking=BookingConfig(liveness_timeout_max_s=30))
    )
    expected = {}
    for r in results:
        ms = [0] * len(CATEGORIES)
        for c, d in zip(r.pieces.category.tolist(), r.pieces.dur_ms.tolist(), strict=True):
            ms[c] += int(d)
        expected[r.name] = dict(zip(CATEGORIES, ms, strict=True))
    [csv] = write_nvidia_smi_csv(a.samples(), tmp_path / "t")
    post_events(shared, prefix, a)
    post_events(shared, prefix, b)
    p = serve(csv, "node0", URL, prefix, 0, "--liveness-timeout-max", "30", speed=50, book_s=0.1)
    end_b = max(e.ts_ms for e in b.events)
    try:
        wait_booked(shared, prefix, "next", ["node0"], end_b)
        wait_booked(shared, prefix, "crashed", ["node0"], int(a.t0 * 1000) + 130_000)
        time.sleep(0.5)
    finally:
        stop_all([p])
    got = {j: ledger.net_ms(ledger.read_amounts(shared, prefix, j)) for j in ("crashed", "next")}
    lapse = int(a.t0 * 1000) + 130_000  # its last step, plus the liveness timeout
    assert sum(got["crashed"].values()) == 2 * (lapse - int(a.t0 * 1000))
    assert sum(got["next"].values()) == 2 * (end_b - max(lapse, int(b.t0 * 1000)))
    assert got == expected


# ---- 7. register timestamps and clocks are bounded by what the agent observed ------------------
def nvml_agent(prefix: str, port: int, *extra: str) -> subprocess.Popen:
    return agent_process([str(HELPER), "2"], "gpu-host", URL, prefix, port, *extra)


def live_entry(job: str, rank: int, seq: int, type_: str, ts: float | None = None, **f) -> dict:
    return protocol.encode_fields(
        {
            "v": "1",
            "type": type_,
            "job": job,
            "ts": f"{time.time() if ts is None else ts:.3f}",
            "rank": rank,
            "session": f"s{rank}",
            "seq": seq,
            **f,
        }
    )


# Played on a clock: the booked time is bounded by wall-clock times.
@pytest.mark.serial
def test_7_an_ancient_register_and_a_skewed_clock_are_bounded_and_shown(shared, prefix):
    from tests.helpers.nvml_serve import uuid

    job, port = "skewed", free_port()
    t_launch = time.time()
    p = nvml_agent(prefix, port)
    try:
        time.sleep(1.5)  # the agent samples its GPUs
        t_reg = time.time()
        ahead = 120.0  # rank 1's clock runs two minutes ahead
        send_entries(
            shared,
            prefix,
            job,
            [
                live_entry(job, 0, 0, "register", ts=946_684_800.0, host="gpu-host", gpu=0, gpu_uuid=uuid(0)),
                live_entry(job, 1, 0, "register", ts=t_reg + ahead, host="gpu-host", gpu=1, gpu_uuid=uuid(1)),
                live_entry(job, 0, 1, "run", state="start"),
            ],
        )
        seq = [2, 1]
        for step in range(1, 16):
            time.sleep(0.2)
            send_entries(shared, prefix, job, [live_entry(job, 0, seq[0], "step", step=step)])
            send_entries(
                shared, prefix, job, [live_entry(job, 1, seq[1], "heartbeat", ts=time.time() + ahead)]
            )
            seq = [seq[0] + 1, seq[1] + 1]
        send_entries(shared, prefix, job, [live_entry(job, 0, seq[0], "run", state="end")])
        t_end = time.time()
        wait_booked(shared, prefix, job, ["gpu-host"], int(t_end * 1000) - 100, timeout=30)
        scraped, _ = scrape(port)
    finally:
        [err] = stop_all([p])
    total_s = sum(ledger.net_ms(ledger.read_amounts(shared, prefix, job)).values()) / 1000
    # Rank 0's GPU is billed from the agent's first sample of it (not from 2000-01-01), rank 1's
    # from its register's arrival (not two minutes later, where its clock put it).
    assert 2 * (t_end - t_reg) - 1.0 <= total_s <= (t_end - t_launch) + (t_end - t_reg) + 1.0
    skew = metric(scraped, "costexporter_event_clock_skew_seconds", training_job=job)
    assert skew and skew[0] == pytest.approx(ahead, abs=5), skew
    assert "clock" in err and "NTP" in err


# ---- 8. Redis restarted empty ------------------------------------------------------------------
def test_8_redis_restarted_empty_is_noticed_and_history_is_not_booked_again(tmp_path):
    b = simple_job("amnesia", 8, seconds=300)
    [csv] = write_nvidia_smi_csv(b.samples(), tmp_path / "t")
    expected, offline = offline_ms(b)
    server = RedisServer(tmp_path / "redis").start()
    client = server.client()
    post_events(client, "ce", b)
    port = free_port()
    p = serve(csv, "node0", server.url, "ce", port, speed=20, book_s=0.2)
    try:
        deadline = time.monotonic() + 30
        while True:
            wm = ledger.load_watermark(client, "ce", b.job, "node0")
            if wm and wm["booked_until"] > offline.timeline.start_ms + 120_000:
                break
            assert time.monotonic() < deadline
            time.sleep(0.05)
        client.client_pause(10_000, all=False)  # freeze writes, read what the ledger holds, then die
        before = ledger.net_ms(ledger.read_amounts(client, "ce", b.job))
        server.kill()
        shutil.rmtree(tmp_path / "redis" / "appendonlydir", ignore_errors=True)
        server.start()  # empty
        client = server.client()
        wait_booked(client, "ce", b.job, ["node0"], offline.timeline.end_ms, timeout=60)
        after = ledger.net_ms(ledger.read_amounts(client, "ce", b.job))
        scraped, _ = scrape(port)
        # The API answers from what the ledger holds and says from when it is whole: the agent
        # noted where it had booked when it found Redis empty. (The job's reporter, had it still
        # run, would have added the job to the emptied jobs index with its next batch.)
        client.zadd(keys.jobs_key("ce"), {b.job: b.t})
        with served(LedgerStore(client, "ce")) as (base, _app):
            window = "2025-07-26T00:00:00Z,2025-07-28T00:00:00Z"
            got = httpx.get(f"{base}/api/v1/jobs/{b.job}", params={"window": window}, timeout=10).json()
    finally:
        [err] = stop_all([p])
        server.stop()
    # Nothing booked twice across the two Redis lives, nothing lost.
    assert {c: before[c] + after[c] for c in CATEGORIES} == expected
    assert "restarted empty" in err
    assert sum(metric(scraped, "costexporter_redis_epoch_resets_total")) >= 1
    lost_ms = round(dt.datetime.fromisoformat(got["unknown_before"]).timestamp() * 1000)
    assert int(b.t0 * 1000) + 120_000 < lost_ms < offline.timeline.end_ms
    assert got["gpu_hours"] == pytest.approx(sum(after.values()) / 3_600_000, abs=1e-6)
    assert any("Redis restarted empty" in w for w in got["warnings"]), got["warnings"]


# ---- 9. one poisoned job stops nothing ---------------------------------------------------------
def test_9_poisoned_registrations_are_skipped_counted_and_the_healthy_job_books(shared, prefix, tmp_path):
    b = TraceBuilder(n_gpus=4, per_host=4, job="healthy", seed=9)
    b.events = [e for e in b.events if e.rank < 2]  # the healthy job holds GPUs 0 and 1
    b.run("start")
    b.stretch("compute", 200, step_s=4, tokens=100)
    b.run("end")
    b.stretch("idle", 5)
    [csv] = write_nvidia_smi_csv(b.samples(), tmp_path / "t")
    results, _ = book_trace(b.samples(), b.events, ReplayConfig())
    [healthy] = [r for r in results if r.name == "healthy"]
    expected = dict.fromkeys(CATEGORIES, 0)
    for c, d in zip(healthy.pieces.category.tolist(), healthy.pieces.dur_ms.tolist(), strict=True):
        expected[CATEGORIES[c]] += int(d)
    post_events(shared, prefix, b)
    reg = {"host": "node0", "ts": b.t0, "world_size": 2}
    poisoned = {
        "bad-gpu": {"0": json.dumps({**reg, "gpu": "abc"})},
        "bad-list": {"0": json.dumps([1, 2])},
        "bad-ts": {"0": json.dumps({**reg, "ts": None, "gpu": 2, "gpu_uuid": b.uuid(2)})},
        "bad-rank": {"99999999999": json.dumps({**reg, "gpu": 3, "gpu_uuid": b.uuid(3)})},
        "bad-world": {"0": json.dumps({**reg, "gpu": 3, "world_size": 10**12})},
        "bad job": {"0": json.dumps({**reg, "gpu": 2})},
        "bad{job}": {"0": json.dumps({**reg, "gpu": 3})},
        "bad-ts-huge": {"0": json.dumps({**reg, "ts": 1e300, "gpu": 2})},  # overflowed every round
        "bad-host": {"0": json.dumps({**reg, "host": ["node0"], "gpu": 2})},
        "bad-uuid": {"0": json.dumps({**reg, "gpu_uuid": 5, "gpu": 3})},
        "j" * 1_000_000: {"0": json.dumps({**reg, "gpu": 2})},  # never logged whole
    }
    for name, ranks in poisoned.items():
        shared.hset(keys.ranks_key(prefix, name), mapping=ranks)
        shared.zadd(keys.jobs_key(prefix), {name: b.t0})
    port = free_port()
    p = serve(csv, "node0", URL, prefix, port, speed=20, book_s=0.1)
    try:
        wait_booked(shared, prefix, b.job, ["node0"], healthy.timeline.end_ms)
        scraped, _ = scrape(port)
        status = Path(f"/proc/{p.pid}/status").read_text().splitlines()
        rss_kb = int(next(x for x in status if x.startswith("VmRSS")).split()[1])
        t_term = time.monotonic()
    finally:
        [err] = stop_all([p])
    assert time.monotonic() - t_term < 10  # SIGTERM still works
    assert rss_kb < 600_000
    got = ledger.net_ms(ledger.read_amounts(shared, prefix, b.job))
    assert got == expected
    rejected = scraped.get("costexporter_registrations_rejected_total", [])
    labels = {untrusted.short(n, 200) for n in poisoned}
    assert {lab["training_job"] for lab, v in rejected if v >= 1} == labels, rejected
    for name in poisoned:  # each logged, once per job and reason
        shown = repr(untrusted.short(name))
        lines = [x for x in err.splitlines() if "registration" in x and shown in x]
        assert len(lines) == 1, (name[:100], lines)
        assert len(lines[0]) < 1000  # a 1 MB name is cut
    assert "booking round failed" not in err


# ---- 10. rejected events are visible -------------------------------------------------------------
def test_10_rejected_events_are_exported_and_logged_once_per_reason(shared, prefix, tmp_path):
    b = simple_job("noisy", 10, seconds=60)
    [csv] = write_nvidia_smi_csv(b.samples(), tmp_path / "t")
    expected, offline = offline_ms(b)
    post_events(shared, prefix, b)
    bad = {"v": "1", "type": "step", "job": b.job, "ts": f"{b.t0 + 10:.3f}", "rank": "0", "session": "x"}
    send_entries(
        shared,
        prefix,
        b.job,
        [
            *({**bad, "seq": str(i), "step": "abc"} for i in range(3)),  # a step that is no number, 3 times
            {k: v for k, v in {**bad, "seq": "9", "step": "5"}.items() if k != "ts"},  # no timestamp
        ],
    )
    port = free_port()
    p = serve(csv, "node0", URL, prefix, port, speed=50, book_s=0.1)
    try:
        wait_booked(shared, prefix, b.job, ["node0"], offline.timeline.end_ms)
        scraped, _ = scrape(port)
    finally:
        [err] = stop_all([p])
    assert ledger.net_ms(ledger.read_amounts(shared, prefix, b.job)) == expected  # the bad ones stop nothing
    rejected = {
        lab["reason"]: v
        for lab, v in scraped["costexporter_events_rejected_total"]
        if lab["training_job"] == b.job
    }
    assert sum(rejected.values()) == 4 and len(rejected) == 2, rejected
    for reason in rejected:
        lines = [x for x in err.splitlines() if "rejected" in x and reason in x and "'noisy'" in x]
        assert len(lines) == 1, (reason, lines)


# ---- 11. replay: two ranks claim one host + GPU index --------------------------------------------
def test_11_replay_books_a_gpu_claimed_by_two_ranks_once_and_names_them(cli, tmp_path):
    b = TraceBuilder(n_gpus=2, per_host=2, job="dup", seed=11)
    regs = [e for e in b.events if e.type == "register"]
    b.events = [
        Event("register", b.job, e.ts_ms, e.rank, e.session, e.seq, {**e.fields, "gpu": 0}) for e in regs
    ]  # both launchers said host node0, GPU 0 (no NVML to tell the UUID)
    for e in b.events:
        del e.fields["gpu_uuid"]
    b.run("start")
    b.stretch("compute", 120, step_s=4, tokens=100)
    b.run("end")
    [csv] = write_nvidia_smi_csv(b.samples(), tmp_path / "t")
    ev = b.write_events(tmp_path / "events.jsonl")
    r = cli("replay", "--samples", f"node0={csv}", "--events", ev, "--format", "json")
    assert r.returncode == 0, r.stderr
    assert "internal error" not in r.stderr
    assert "ranks 0 and 1" in r.stderr and "node0" in r.stderr
    rep = json.loads(r.stdout)
    job = rep["jobs"]["dup"]
    assert job["gpu_hours_total"] == pytest.approx(120 / 3600, abs=2 / 3600)  # GPU 0 once, not twice
    assert len(job["gpus"]) == 1
