"""Real-like 100 ms traces (tests/realtrace.py: skewed stamps, ramps, logger gaps): every sample
counts, live equals offline."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from costexporter.core import bandtable, goodput, jobfacts, profiles
from costexporter.core.figures import job_figures
from costexporter.core.model import CATEGORIES, JOB_CODES, VALID_CODES, Band
from costexporter.core.replay import ReplayConfig, book_trace, job_report
from costexporter.sources.synth import TraceBuilder
from tests.realtrace import Scenario, agreement
from tests.test_live import book_seen

BAND_NAMES = bandtable.current().names

H100 = profiles.select("NVIDIA H100 80GB HBM3")


def bands_of(trace, profile=None):
    [job], _ = book_trace(trace.samples, trace.events, ReplayConfig(profile=profile))
    return job


def test_every_sample_counts_agreement_with_the_derived_h100_profile():
    worst = 1.0
    for seed in range(3):
        tr = Scenario.h100(seed=seed).build()
        job = bands_of(tr)
        assert not job.profile.calibrated  # the derived profile, from the power limit
        worst = min(worst, agreement(job.band_result.band, tr))
    assert worst >= 0.99


def test_checkpoint_rows_are_checkpoint_at_every_sample_not_only_the_cell_s_last():
    # 15.1: the textbook checkpoint rows are checkpoint whatever instant a grid step ends on.
    tr = Scenario.h100(seed=5, jitter_p=0.0, tail_p=0.0).build()
    job = bands_of(tr)
    lab = tr.label_bands()
    ck = lab == Band.CHECKPOINT
    # The first moments of a wait are banded by the signature that persists after them.
    assert np.mean(job.band_result.band[ck] == Band.CHECKPOINT) >= 0.98  # ramps in: 1-3 samples
    # A 1 s grid step holds two bands where a checkpoint begins mid-step.
    t = tr.samples.ts_ms
    begin = t[ck].min()
    cell = (t >= begin - begin % 1000) & (t < begin - begin % 1000 + 1000)
    assert {Band.CHECKPOINT, Band.COMPUTE} <= set(job.band_result.band[cell].tolist())


def _by_category_and_band(pieces) -> np.ndarray:
    key = pieces.category.astype(np.int64) * (len(BAND_NAMES) + 1) + (pieces.band + 1)
    return np.bincount(key, weights=pieces.dur_ms, minlength=len(CATEGORIES) * (len(BAND_NAMES) + 1)).astype(
        np.int64
    )


SMALL = Scenario.h100(seed=3, compute_s=12.0, checkpoint_s=3.0, checkpoints=2, idle_s=3.0, gap_every_s=10.0)
SMALL_TRACE = SMALL.build()
_START = min(e.ts_ms for e in SMALL_TRACE.events)
# Each GPU's time starts as the agent starts it: at its register, within its samples.
_MEMBER_START = np.asarray(
    [
        jobfacts.gpu_start_ms(
            _START,
            int(SMALL_TRACE.samples.ts_ms[SMALL_TRACE.samples.gpu == g].min()),
            int(SMALL_TRACE.samples.ts_ms[SMALL_TRACE.samples.gpu == g].max()),
        )[0]
        for g in range(len(SMALL_TRACE.samples.gpus))
    ],
    np.int64,
)
_END = max(e.ts_ms for e in SMALL_TRACE.events)
# Where the state changes: rounds just around these are the ones that can go wrong.
_CHANGES = sorted({e.ts_ms for e in SMALL_TRACE.events if e.type in ("phase", "run")})
_round = st.one_of(
    st.integers(_START, _END),
    st.tuples(st.sampled_from(_CHANGES), st.integers(-500, 2500)).map(sum),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_round, min_size=1, max_size=8))
def test_live_rounds_at_random_boundaries_equal_the_offline_booking(cuts):
    """The live agent's result does not depend on where its rounds fall."""
    tr = SMALL_TRACE
    s = tr.samples
    events = sorted(tr.events, key=lambda e: e.ts)
    start, end = _START, _END
    job = bands_of(tr, H100)
    offline = _by_category_and_band(job.pieces)

    own = np.arange(len(s.gpus))
    rounds = [*sorted(min(max(c, start), end) for c in cuts), end + 60000]
    booked = start
    live = np.zeros_like(offline)
    for now in rounds:
        res = book_seen(
            s, events, now, start, own, booked, n_ranks=own.size, profile=H100, member_start=_MEMBER_START
        )
        live += _by_category_and_band(res.pieces)
        booked = max(booked, res.horizon_ms)
    assert booked == end
    assert live.tolist() == offline.tolist()
    # and so its goodput: the one function over the live amounts and the figures' span
    ms = live.reshape(len(CATEGORIES), -1).sum(1)
    figs = job_figures(res.timeline)
    span = goodput.JobSpan(round(figs["start_ts"] * 1000), round(figs["end_ts"] * 1000), own.size)
    on = goodput.job_goodput(
        float(ms[VALID_CODES].sum()), float(ms[JOB_CODES].sum()), span, (span.start_ms, span.end_ms)
    )
    want = job_report(job, ReplayConfig(profile=H100))["goodput"]
    assert on.runtime == pytest.approx(want["runtime"], rel=1e-12) and want["runtime"] is not None
    assert on.ettr == pytest.approx(want["ettr"], rel=1e-12)


def test_energy_across_gaps_comes_from_the_counter_and_coverage_is_reported():
    # 15.3: the logger's 0.3-1 s gaps stay unobserved time, but the counter's energy is booked.
    tr = Scenario.h100(seed=2, gap_every_s=20.0).build()
    assert tr.gap_ms > 0
    [job], _ = book_trace(tr.samples, tr.events, ReplayConfig())
    rep = job_report(job, ReplayConfig())
    booked_mj = job.pieces.energy_mj.sum()
    assert booked_mj == pytest.approx(tr.true_energy_mj.sum(), rel=1e-4)
    assert rep["gpu_hours"]["unobserved"] > 0 and rep["energy_kwh"]["unobserved"] > 0
    assert rep["energy_coverage"] >= 0.9999

    # Without a counter, a hiccup of at most a second keeps its energy: the power interpolated
    # across it (its time stays unobserved). Booked energy is within 0.5% of what was used.
    tr.samples.energy_mj[:] = np.nan
    [job], _ = book_trace(tr.samples, tr.events, ReplayConfig())
    rep = job_report(job, ReplayConfig())
    assert rep["gpu_hours"]["unobserved"] > 0 and rep["energy_coverage"] >= 0.9999
    assert job.pieces.energy_mj.sum() == pytest.approx(tr.true_energy_mj.sum(), rel=0.005)

    # A longer gap's energy is unknown, and the coverage says how much.
    s = tr.samples
    t_mid = int(np.median(s.ts_ms))
    cut = (s.ts_ms > t_mid) & (s.ts_ms < t_mid + 5000)
    s2 = type(s)(s.gpus, s.gpu[~cut], s.ts_ms[~cut], s.power_w[~cut], s.util_pct[~cut], s.energy_mj[~cut])
    [job], _ = book_trace(s2, tr.events, ReplayConfig())
    rep = job_report(job, ReplayConfig())
    assert rep["energy_coverage"] < 0.9995
    assert job.pieces.energy_mj.sum() < 0.995 * tr.true_energy_mj.sum()


def test_deadlock_incident_names_the_rank_at_zero():
    # 15.8: R2's signature is exactly that rank; R1's was rank 3.
    b = TraceBuilder(n_gpus=8, per_host=8, job="d", seed=4)
    b.run("start")
    b.stretch("compute", 120, step_s=5)
    b.stretch("deadlock", 300, zero_ranks=(3,))
    [job], _ = book_trace(b.samples(), b.events, ReplayConfig())
    [inc] = [i for i in job_report(job, ReplayConfig())["incidents"] if i["band"] == "deadlock"]
    assert inc["category"] == "stalled" and inc["zero_util_ranks"] == [3]
    assert inc["ranks"] == list(range(8))


@pytest.mark.parametrize(
    ("shift_h", "overlap"),
    [(0, None), (8, 8), (-5, -5)],
)
def test_clock_offset_is_reported_when_samples_and_events_do_not_overlap(shift_h, overlap):
    # 15.5: a wrong --tz moves the samples by whole hours.
    tr = Scenario.h100(seed=1, checkpoints=1).build()
    tr.samples.ts_ms -= shift_h * 3_600_000
    [job], _ = book_trace(tr.samples, tr.events, ReplayConfig())
    rep = job_report(job, ReplayConfig())
    assert rep["clock_offset_hours"] == overlap
    s0, s1 = rep["time_range"]["samples"]
    assert s0 * 1000 == tr.samples.ts_ms.min() and s1 * 1000 == tr.samples.ts_ms.max()
    e0, e1 = rep["time_range"]["events"]
    assert e0 == pytest.approx(min(e.ts for e in tr.events), abs=1e-3)
    assert e1 == pytest.approx(max(e.ts for e in tr.events), abs=1e-3)


def test_a_single_gpu_spinning_at_idle_power_without_steps_is_a_deadlock():
    # 100% utilization at idle-level power, no step: a hang on one GPU.
    b = TraceBuilder(n_gpus=1, per_host=1, job="one", seed=2)
    b.run("start")
    b.stretch("compute", 120, step_s=5)
    b.stretch("deadlock", 600)  # ~192 W at 100%, no step
    [job], _ = book_trace(b.samples(), b.events, ReplayConfig())
    rep = job_report(job, ReplayConfig())
    assert rep["band_gpu_hours"]["deadlock"] == pytest.approx(600 / 3600, abs=5 / 3600)
    assert rep["gpu_hours"]["stalled"] == pytest.approx(600 / 3600, abs=5 / 3600)
    [inc] = [i for i in rep["incidents"] if i["category"] == "stalled"]
    assert inc["band"] == "deadlock" and inc["ranks"] == [0] and inc["end"] - inc["start"] >= 595

    # The same readings while steps keep completing are not a hang.
    b = TraceBuilder(n_gpus=1, per_host=1, job="one", seed=2)
    b.run("start")
    b.stretch("compute", 120, step_s=5)
    b.stretch("deadlock", 600, step_s=2)
    [job], _ = book_trace(b.samples(), b.events, ReplayConfig())
    assert job_report(job, ReplayConfig())["band_gpu_hours"]["deadlock"] == 0


def test_a_job_that_only_registered_is_not_a_clock_problem():
    from costexporter.core.replay import clock_offset_hours

    assert clock_offset_hours((1_000_000, 5_000_000), (1_000_000, 1_000_000)) is None
    assert clock_offset_hours((1_000_000, 2_000_000), (4_600_000, 4_600_000)) == 1
    # Both long: a 30 % overlap is not enough, and no whole hour explains a 20-minute shift.
    assert clock_offset_hours((0, 3_600_000), (2_520_000, 6_120_000)) == 0
