"""A slow rank priced: named, and its GPU-hours near the what-if (the same job without its extra
compute), on synchronous steps read at 10 Hz and at 1 Hz (averaged, as NVML reads); never on
real-like traces without one; 'cannot tell' where the steps are too short for the sampling."""

from __future__ import annotations

import functools
import json
import time
import uuid

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from costexporter.core import profiles, straggler
from costexporter.core.model import VALID_NAMES
from costexporter.core.replay import ReplayConfig, book_trace, job_report
from costexporter.sources.synth import TraceBuilder
from tests.realtrace import Scenario
from tests.test_live import book_seen

H100 = profiles.select("NVIDIA H100 80GB HBM3")


def stepped(x: float, interval_s: float, step_s: float, seed: int = 0, n: int = 8, minutes: float = 10):
    """A job of synchronous steps, rank 3 computing `1 + x` times longer: its report and what-if."""
    b = TraceBuilder(n_gpus=n, per_host=4, interval_s=interval_s, job="sync", seed=seed)
    b.run("start")
    saved = b.synchronous(
        int(minutes * 60 / step_s),
        0.8 * step_s,
        0.2 * step_s,
        slow={3: x} if x else None,
        average=interval_s >= 1,
        tokens=1000,
    )
    b.run("end")
    [job], _ = book_trace(b.samples(), b.events, ReplayConfig())
    return job_report(job, ReplayConfig()), saved


@pytest.mark.parametrize(
    "interval_s, step_s, x",
    [
        (0.1, 2.0, 0.05),
        (0.1, 2.0, 0.1),
        (0.1, 10.0, 0.05),
        (0.1, 10.0, 0.5),
        (1.0, 10.0, 0.05),
        (1.0, 10.0, 0.1),
        (1.0, 10.0, 0.5),
    ],
)
def test_a_slow_rank_is_named_and_priced_near_the_what_if(interval_s, step_s, x):
    rep, saved = stepped(x, interval_s, step_s)
    (slow,) = rep["slow_ranks"]
    assert (slow["rank"], slow["host"], slow["gpu"]) == (3, "node0", 3)
    # The what-if per step is the slow rank's lead over each step's own next slowest: counted
    # moment by moment, whatever the others' jitter (a lead over their average read +9-32% high).
    assert slow["gpu_hours"] == pytest.approx(saved / 3600, rel=0.10)
    # Priced at the job's own cost of a valid GPU-hour: a split of valid time, not a category.
    valid_h = sum(rep["gpu_hours"][c] for c in VALID_NAMES)
    valid_cost = sum(rep["cost"][c] for c in VALID_NAMES)
    assert slow["cost"] == pytest.approx(slow["gpu_hours"] * valid_cost / valid_h, abs=0.01)
    assert slow["gpu_hours"] < valid_h
    assert rep["slow_ranks_untold_minutes"] == 0


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    x=st.floats(0.05, 0.5),
    sampling=st.sampled_from([(0.1, 2.0), (0.1, 10.0), (1.0, 10.0)]),
    jitter=st.floats(0.0, 0.03),
    seed=st.integers(0, 1000),
)
def test_the_price_holds_the_what_if_at_any_slowdown_and_jitter(x, sampling, jitter, seed):
    """Any slowdown of 5-50%, any step-to-step jitter up to 3%: within 10% of the what-if."""
    interval_s, step_s = sampling
    b = TraceBuilder(n_gpus=8, per_host=8, interval_s=interval_s, job="j", seed=seed)
    b.run("start")
    saved = b.synchronous(
        int(300 / step_s), 0.8 * step_s, 0.2 * step_s, slow={6: x}, jitter=jitter, average=interval_s >= 1
    )
    b.run("end")
    [job], _ = book_trace(b.samples(), b.events, ReplayConfig())
    (slow,) = job_report(job, ReplayConfig())["slow_ranks"]
    assert slow["rank"] == 6
    assert slow["gpu_hours"] == pytest.approx(saved / 3600, rel=0.10)


def slowed_midway(x: float, interval_s: float, step_s: float, seed: int = 0, slow_s: float = 180):
    """Steps at one pace for 2.5 minutes (ending mid-minute), then rank 3 `1 + x` times slower for
    `slow_s`; the builder and when the slowdown began (bench/bench_straggler.py uses it too)."""
    b = TraceBuilder(n_gpus=8, per_host=8, interval_s=interval_s, job="mid", seed=seed)
    b.run("start")
    b.synchronous(int(157 / step_s), 0.8 * step_s, 0.2 * step_s, average=interval_s >= 1)
    t0 = b.t
    b.synchronous(int(slow_s / step_s), 0.8 * step_s, 0.2 * step_s, slow={3: x}, average=interval_s >= 1)
    b.run("end")
    return b, t0


@pytest.mark.parametrize("interval_s, step_s", [(0.1, 2.0), (0.1, 10.0), (1.0, 10.0)])
@pytest.mark.parametrize("x", [0.1, 0.5])
def test_a_slow_rank_is_named_within_five_slow_steps(interval_s, step_s, x):
    """Judged window by window as an agent's rounds do (5 s), on the latest steps, not at the end
    of a minute: named by its fifth slow step (a small slowdown needs more)."""
    b, t0 = slowed_midway(x, interval_s, step_s)
    [job], _ = book_trace(b.samples(), b.events, ReplayConfig(window_ms=5000))
    (slow,) = job_report(job, ReplayConfig())["slow_ranks"]
    assert slow["rank"] == 3 and slow["named_at"] is not None
    slow_steps = [e for e in b.events if e.type == "step" and t0 < e.ts <= slow["named_at"]]
    assert 1 <= len(slow_steps) <= 5


def test_no_rank_is_named_early_where_none_is_slow():
    """The early naming judges a few steps at a time, every window: none named on real-like
    traces (GPUs that draw more included) nor on synchronous jobs that keep pace."""
    named = {}
    scenarios = [Scenario.h100(seed=s) for s in range(3)] + [Scenario.field(seed=s) for s in range(2)]
    scenarios += [Scenario.h100(seed=7, offsets_w=(0, 25, -20, 10, 0, -15, 30, 5))]
    traces = [(sc.build().samples, sc.build().events) for sc in scenarios]
    for seed in range(4):
        for interval_s, step_s in ((0.1, 2.0), (1.0, 10.0)):
            b = TraceBuilder(n_gpus=8, per_host=8, interval_s=interval_s, job="even", seed=seed)
            b.run("start")
            b.synchronous(int(300 / step_s), 0.8 * step_s, 0.2 * step_s, average=interval_s >= 1)
            b.run("end")
            traces.append((b.samples(), b.events))
    for i, (samples, events) in enumerate(traces):
        [job], _ = book_trace(samples, events, ReplayConfig(window_ms=5000))
        if job.band_result.named:
            named[i] = job.band_result.named
    assert named == {}


@pytest.mark.parametrize("interval_s", [0.1, 1.0])
def test_no_slow_rank_where_every_rank_keeps_pace(interval_s):
    named = []
    for seed in range(4):
        rep, saved = stepped(0.0, interval_s, 10.0, seed=seed)
        assert saved == 0
        named += rep["slow_ranks"]
    assert named == []


def test_no_slow_rank_on_real_like_traces_gpus_that_draw_more_included():
    named = []
    scenarios = [Scenario.h100(seed=s) for s in range(3)] + [Scenario.field(seed=s) for s in range(3)]
    scenarios += [Scenario.b300(seed=1), Scenario.h100(seed=7, offsets_w=(0, 25, -20, 10, 0, -15, 30, 5))]
    for sc in scenarios:
        tr = sc.build()
        [job], _ = book_trace(tr.samples, tr.events, ReplayConfig())
        assert job.band_result.busy  # judged: these traces post steps
        named += job_report(job, ReplayConfig())["slow_ranks"]
    assert named == []


def test_steps_too_short_for_the_sampling_are_said_not_guessed():
    rep, saved = stepped(0.5, 1.0, 2.0)
    assert saved > 0
    assert rep["slow_ranks"] == []
    assert rep["slow_ranks_untold_minutes"] >= 9


def test_a_job_without_steps_has_no_slow_rank_and_nothing_untold():
    b = TraceBuilder(n_gpus=8, per_host=8, interval_s=0.1, job="nosteps", seed=2)
    b.synchronous(60, 1.6, 0.4, slow={2: 0.5})
    b.events = [e for e in b.events if e.type != "step"]
    [job], _ = book_trace(b.samples(), b.events, ReplayConfig())
    rep = job_report(job, ReplayConfig())
    assert (rep["slow_ranks"], rep["slow_ranks_untold_minutes"]) == ([], 0)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(window_s=st.integers(7, 400), x=st.sampled_from([0.2, 0.5]), seed=st.integers(0, 50))
def test_the_price_does_not_depend_on_the_windows_it_was_counted_in(window_s, x, seed):
    """Replay counts each moment once over windows of any length (the agent's rounds do the same):
    the block totals, and so the slow rank and its GPU-hours, come out alike."""
    b = TraceBuilder(n_gpus=8, per_host=8, interval_s=0.1, job="w", seed=seed)
    b.run("start")
    b.synchronous(150, 1.6, 0.4, slow={5: x})
    b.run("end")
    samples = b.samples()
    [one], _ = book_trace(samples, b.events, ReplayConfig())
    [many], _ = book_trace(samples, b.events, ReplayConfig(window_ms=window_s * 1000))
    a, c = (job_report(j, ReplayConfig())["slow_ranks"] for j in (one, many))
    assert [s["rank"] for s in a] == [s["rank"] for s in c] == [5]
    assert c[0]["gpu_hours"] == pytest.approx(a[0]["gpu_hours"], rel=0.03)
    seen = [sum(float(v.seen_s.sum()) for v in j.band_result.busy.values()) for j in (one, many)]
    assert seen[1] == pytest.approx(seen[0], rel=1e-9)  # every moment counted once


def busy(energy, seen, steps=2, spin=(150.0, 30)):
    n = len(energy)
    return straggler.Busy(
        np.asarray(energy, float),
        np.full(n, float(seen)),
        np.full(n, 550.0 * 10),
        np.full(n, 10),
        *spin,
        steps,
    )


def test_evidence_adds_up_and_survives_a_restart():
    a = busy([400 * 60.0, 400 * 60.0, 500 * 60.0], 60)
    b = busy([300.0, 300.0], 1, steps=1, spin=(140.0, 5))
    s = a.add(b)
    assert (s.energy_j.tolist(), s.seen_s.tolist(), s.hi_n.tolist()) == (
        [24300.0, 24300.0, 30000.0],
        [61.0, 61.0, 60.0],
        [20, 20, 10],
    )
    assert (s.spin_w, s.spin_n, s.steps) == (140.0, 35, 3)
    back = straggler.Busy.from_json(s.to_json())
    assert back.to_json() == s.to_json()
    assert np.isinf(straggler.Busy.from_json(busy([1.0] * 3, 1, spin=(np.inf, 0)).to_json()).spin_w)
    led = straggler.Ledger()
    led.add({0: a, straggler.BLOCK_MS: a})
    (v,) = led.close(straggler.BLOCK_MS, 3, 100, H100)
    assert list(led.open) == [straggler.BLOCK_MS] and led.blocks == {2: 1}
    # (500 - 150) / (550 - 150) - (400 - 150) / 400 of the minute, on each of the 3 GPUs
    assert v.gpu_s == pytest.approx(3 * 60 * 0.25)


def test_evidence_stored_by_the_previous_release_is_priced_as_it_was():
    """An agent's watermark from before the moment-by-moment lead holds 7 fields: read back, a
    minute partly counted by each release is priced by the lead over the average (never by a
    lead counted over only part of it)."""
    old = busy([400 * 60.0, 400 * 60.0, 500 * 60.0], 60).to_json()[:7]
    back = straggler.Busy.from_json(json.loads(json.dumps(old)))
    assert back.solo_s is None and np.isnan(back.full_s)
    new = straggler.Busy(
        *(np.zeros(3) for _ in range(3)), np.zeros(3, np.int64), solo_s=np.array([0, 0, 9.0]), full_s=60.0
    )
    both = back.add(new)
    assert np.isnan(both.full_s)
    json.dumps(both.to_json(), allow_nan=False)  # stored again as valid JSON
    (v,) = [straggler.judge(0, x, 3, H100) for x in (both,)]
    assert v is not None and v.rank == 2
    assert v.extra_s == pytest.approx(0.25 * 60)  # the lead over the average, not 9 s of lead
    # evidence of this release alone prices by the moments it led: 9 s of 60
    (w,) = [straggler.judge(0, busy([400 * 60.0, 400 * 60.0, 500 * 60.0], 60).add(new), 3, H100)]
    assert w is not None and w.extra_s == pytest.approx(9.0)


def test_a_block_judges_nothing_without_a_step_or_three_ranks_or_with_peers_apart():
    assert straggler.judge(0, busy([400 * 60.0, 400 * 60.0, 500 * 60.0], 60, steps=0), 3, H100) is None
    assert straggler.judge(0, busy([400 * 60.0, 500 * 60.0], 60), 2, H100) is None
    # the others themselves 10% of the range apart (sd 5%): a lead of 12.5% is within 3 sd
    assert straggler.judge(0, busy([400 * 60.0, 440 * 60.0, 420 * 60.0, 490 * 60.0], 60), 4, H100) is None


def test_two_agents_price_the_slow_rank_as_replay_does_through_a_crash(tmp_path):
    """Two real agents (one per host) book a job whose rank 5 computes 30% longer: each prices
    the slow rank on its own GPUs with its watermark; the API's figure (their sum, priced at the
    job's cost of a valid GPU-hour) is replay's of the same trace, also when one agent is killed
    halfway and started again (nothing counted twice); the counters are the API's."""
    import redis
    from fastapi.testclient import TestClient

    from costexporter.api.app import create_app
    from costexporter.sources.synth import write_nvidia_smi_csv
    from costexporter.store.ledger_read import LedgerStore

    from .conftest import SHARED_URL, drop_prefix
    from .redis_server import free_port
    from .test_agent import post_events, scrape, serve, stop_all, wait_booked

    b = TraceBuilder(n_gpus=8, per_host=4, interval_s=0.1, job="sync-live", seed=4)
    b.run("start")
    saved = b.synchronous(200, 1.6, 0.4, slow={5: 0.3}, tokens=1000)
    b.run("end")
    b.gap(2)
    samples = b.samples()
    csvs = {p.stem: p for p in write_nvidia_smi_csv(samples, tmp_path / "trace")}
    [job], _ = book_trace(samples, b.events, ReplayConfig())
    rep = job_report(job, ReplayConfig())
    (want,) = rep["slow_ranks"]
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    client = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    post_events(client, prefix, b)
    procs = []
    try:
        ports = {h: free_port() for h in csvs}
        procs = [serve(csvs[h], h, SHARED_URL, prefix, ports[h], speed=40) for h in sorted(csvs)]
        halfway = (job.timeline.start_ms + job.timeline.end_ms) // 2
        wait_booked(client, prefix, b.job, ["node1"], halfway, timeout=120)
        # named while it runs, on both hosts: each agent judges every rank's latest steps
        hosts = sorted(csvs)
        assert hosts == ["node0", "node1"]
        for h in hosts:
            named = [
                (lab["rank"], v)
                for lab, v in scrape(ports[h])[0].get("costexporter_straggler_wait_ratio", [])
                if lab["training_job"] == b.job
            ]
            # the others wait ~0.3 x 1.6 s of each ~2.5-s step on rank 5
            assert [r for r, _ in named] == ["5"] and 0.1 < named[0][1] < 0.25, (h, named)
        procs[1].kill()  # no goodbye: its next round's writes never happen
        procs[1].communicate()
        procs[1] = serve(csvs["node1"], "node1", SHARED_URL, prefix, ports["node1"], speed=40)
        wait_booked(client, prefix, b.job, sorted(csvs), job.timeline.end_ms, timeout=120)
        time.sleep(0.5)
        counters = sum(
            v
            for h in csvs
            for lab, v in scrape(ports[h])[0].get("costexporter_straggler_gpu_seconds_total", [])
            if lab["training_job"] == b.job and lab["rank"] == "5"
        )
    finally:
        stop_all(procs)
    try:
        api = TestClient(
            create_app(LedgerStore(redis.Redis.from_url(SHARED_URL, decode_responses=True), prefix))
        )
        body = api.get(
            f"/api/v1/jobs/{b.job}", params={"window": "2025-07-26T00:00:00Z,2025-07-28T00:00:00Z"}
        )
        assert body.status_code == 200, body.text
        (got,) = body.json()["slow_ranks"]
    finally:
        drop_prefix(client, prefix)
    assert got["rank"] == 5 and got["minutes"] == want["blocks"]
    assert got["gpu_hours"] == pytest.approx(want["gpu_hours"], rel=0.03)
    assert got["gpu_hours"] == pytest.approx(saved / 3600, rel=0.08)
    assert counters == pytest.approx(got["gpu_hours"] * 3600, rel=1e-3)
    assert float(got["cost"]) == pytest.approx(want["cost"], rel=0.05)


def test_the_ledger_round_trips_and_a_damaged_one_is_empty():
    a = busy([400 * 60.0, 400 * 60.0, 500 * 60.0], 60)
    led = straggler.Ledger({0: a}, {2: 12.5}, {2: 1}, 3)
    back = straggler.Ledger.from_json(json.loads(json.dumps(led.to_json())))
    assert back.to_json() == led.to_json() and back.open[0].to_json() == a.to_json()
    for damaged in (None, [], {"open": {"x": []}}, {"gpu_s": {"1": "many"}}, {"open": {"0": [1, 2]}}):
        assert not straggler.Ledger.from_json(damaged)
    # a job wider than PERSIST_MAX_RANKS keeps its open minute in memory only
    wide = busy([1.0] * (straggler.PERSIST_MAX_RANKS + 1), 60)
    stored = straggler.Ledger({0: wide}, {2: 1.0}, {2: 1}).to_json()
    assert stored["open"] == {} and stored["gpu_s"] == {"2": 1.0}


SYNC, SYNC_SAVED = None, None


def _sync():
    global SYNC, SYNC_SAVED
    if SYNC is None:
        b = TraceBuilder(n_gpus=8, per_host=8, interval_s=0.1, job="rounds", seed=9)
        b.run("start")
        SYNC_SAVED = b.synchronous(150, 1.6, 0.4, slow={6: 0.25})
        b.run("end")
        SYNC = b
    return SYNC, SYNC_SAVED


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(0, 300_000), min_size=1, max_size=8))
def test_agent_rounds_anywhere_count_each_moment_once_and_price_as_replay(cuts):
    """The agent's rounds (`book_window` from its watermark, the evidence judged as each minute
    is booked past) count every moment once wherever they fall, and price the slow rank as
    replay does."""
    b, saved = _sync()
    s = b.samples()
    [job], _ = book_trace(s, b.events, ReplayConfig())
    want = job_report(job, ReplayConfig())["slow_ranks"]
    start, end = int(s.ts_ms.min()), job.timeline.end_ms
    own = np.arange(8)
    led, booked, seen = straggler.Ledger(), start, 0.0
    profile = profiles.select("NVIDIA B300")
    rounds = [*sorted(start + c for c in cuts), end + 60_000]
    for now in rounds:
        res = book_seen(s, b.events, now, start, own, booked, n_ranks=8, profile=profile)
        if res.bands is not None:
            led.add(res.bands.busy)
            seen += sum(float(v.seen_s.sum()) for v in res.bands.busy.values())
            ended = res.horizon_ms >= end
            led.close(None if ended else res.horizon_ms, 8, res.bands.interval_ms, profile, gpus=8)
        booked = max(booked, res.horizon_ms)
    assert booked >= end and not led.open
    # every moment once: at most a moment a rank apart at each round's edge (each round its own
    # sampling phase)
    offline = sum(float(v.seen_s.sum()) for v in job.band_result.busy.values())
    assert abs(seen - offline) <= len(rounds) * 8 * 0.1 + 1e-6
    assert list(led.gpu_s) == [w["rank"] for w in want] == [6]
    assert sum(led.blocks.values()) == want[0]["blocks"]
    assert led.gpu_s[6] / 3600 == pytest.approx(want[0]["gpu_hours"], rel=0.02)
    assert led.gpu_s[6] == pytest.approx(saved, rel=0.08)


@settings(max_examples=40, deadline=None)
@given(
    windows=st.lists(
        st.tuples(
            st.integers(1_000, 60_000),  # ms since the window before (5 minutes kept)
            st.integers(3, 6),  # ranks (a job that grows)
            st.integers(0, 4),  # steps
            st.integers(0, 2**32 - 1),  # its figures' seed
        ),
        min_size=1,
        max_size=40,
    ),
    wants=st.lists(st.integers(1, 200), min_size=1, max_size=4),
)
@example(windows=[(40_000, 3 + k // 10, 2, k) for k in range(20)], wants=[1000, 3])  # trimmed, widened
def test_the_latest_windows_running_sums_equal_their_evidence_added(windows, wants):
    """`Recent` keeps the latest windows as running sums (dropping those RECENT_MS old): the
    evidence of any latest run of them is that of the same windows added one by one, whatever
    the gaps, the steps and a job that grows wider."""
    r, kept, t = straggler.Recent(), [], 0
    for gap, n, steps, seed in windows:
        t += gap
        rng = np.random.default_rng(seed)
        b = straggler.Busy(
            rng.uniform(0, 1e5, n), rng.uniform(0, 10, n), rng.uniform(0, 1e5, n),
            rng.integers(0, 100, n), float(rng.uniform(100, 200)), int(rng.integers(0, 50)), steps,
            rng.uniform(0, 5, n), float(rng.uniform(0, 10)),
        )  # fmt: skip
        r.add(t, b)
        kept = [(u, x) for u, x in kept if u > t - straggler.RECENT_MS] + [(t, b)]
    assert r.until_ms == [u for u, _ in kept]
    for want in wants:
        i, s, steps, full = r.latest(want)
        got = r.busy(i, s, steps, full)
        assert i == 0 or sum(x.steps for _, x in kept[i:]) >= want > sum(x.steps for _, x in kept[i + 1 :])
        expect = functools.reduce(straggler.Busy.add, [x for _, x in kept[i:]])
        n = got.seen_s.size
        for a, e in (
            (got.energy_j, expect.energy_j), (got.seen_s, expect.seen_s), (got.hi_sum_w, expect.hi_sum_w),
            (got.solo_s, expect.solo_s),
        ):  # fmt: skip
            assert np.allclose(a, np.pad(e, (0, n - e.size)), rtol=1e-9, atol=1e-6)
        assert got.hi_n.tolist() == np.pad(expect.hi_n, (0, n - expect.hi_n.size)).tolist()
        assert (got.steps, got.spin_n, got.spin_w) == (expect.steps, expect.spin_n, expect.spin_w)
        assert got.full_s == pytest.approx(expect.full_s)
