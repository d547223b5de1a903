"""A trace without a trainer's events is booked by band alone: never billed as waste for lack of
steps; `--progress` chooses, and the report says which way a job was booked."""

from __future__ import annotations

import json

import numpy as np
import pytest

from costexporter.core.replay import ReplayConfig, book_trace, job_report
from costexporter.sources.synth import TraceBuilder, write_nvidia_smi_csv

WASTE = ("stalled", "idle", "no_progress", "rolled_back")


def bare(minutes: float = 40.0) -> TraceBuilder:
    b = TraceBuilder(n_gpus=4, per_host=4, job="bare", seed=5, register=False)
    b.stretch("compute", minutes * 60)
    b.stretch("idle", 120)
    return b


def report(b: TraceBuilder, progress: str, events=None) -> dict:
    cfg = ReplayConfig(progress=progress)
    [job], _ = book_trace(b.samples(), events if events is not None else [], cfg)
    return job_report(job, cfg)


def test_a_bare_trace_past_the_startup_allowance_is_booked_by_band_not_as_waste():
    b = bare(40)  # past the 30 min startup allowance
    rep = report(b, "auto")
    assert rep["booked_by"] == "band"
    total = rep["gpu_hours_total"]
    assert total == pytest.approx(4 * 42 / 60, rel=0.01)
    assert rep["gpu_hours"]["no_progress"] == 0
    # Compute is valid time; the idle tail is idle (a band says so, not missing events).
    assert rep["gpu_hours"]["productive"] == pytest.approx(4 * 40 / 60, rel=0.01)
    assert rep["gpu_hours"]["idle"] == pytest.approx(4 * 2 / 60, rel=0.05)
    assert report(b, "none") == rep
    # Asked for, the step rules book it as they always did: startup, then no progress.
    steps = report(b, "events")
    assert steps["booked_by"] == "steps"
    assert steps["gpu_hours"]["overhead"] == pytest.approx(4 * 30 / 60, rel=0.01)
    assert steps["gpu_hours"]["no_progress"] > 0.5


def test_a_job_with_steps_is_booked_by_them_unless_told_otherwise():
    b = TraceBuilder(n_gpus=2, per_host=2, job="t", seed=1)
    b.run("start")
    b.stretch("compute", 300, step_s=5)
    b.stretch("compute", 300)  # no step completes: progress stopped
    rep = report(b, "auto", b.events)
    assert rep["booked_by"] == "steps" and rep["gpu_hours"]["no_progress"] > 0
    rep = report(b, "none", b.events)
    assert rep["booked_by"] == "band" and all(rep["gpu_hours"][c] == 0 for c in WASTE)


def test_the_cli_says_a_bare_trace_is_booked_by_band(cli, tmp_path):
    [p] = write_nvidia_smi_csv(bare(35).samples(), tmp_path)
    r = cli("replay", "--samples", p, "--format", "json", "--gpu-model", "B300")
    assert r.returncode == 0, r.stderr
    job = json.loads(r.stdout)["jobs"]["trace"]
    assert job["booked_by"] == "band" and job["wasted_gpu_hours"] == pytest.approx(4 * 2 / 60, rel=0.05)
    assert "booked by band alone" in r.stderr and "--events" in r.stderr
    r = cli("replay", "--samples", p, "--format", "json", "--gpu-model", "B300", "--progress", "events")
    job = json.loads(r.stdout)["jobs"]["trace"]
    assert job["booked_by"] == "steps" and job["gpu_hours"]["no_progress"] > 0
    assert "booked by band alone" not in r.stderr


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_energy_across_logger_hiccups_is_within_half_a_percent_without_a_counter(seed):
    """Hiccups of 0.3-0.5 s every ~10 s of a 100 ms trace without an energy counter: the booked
    energy of each GPU over a long phase is within 0.5% of what it used."""
    from tests.realtrace import Scenario

    tr = Scenario(seed=seed, gap_s=(0.3, 0.5), gap_every_s=10.0, compute_s=120.0, checkpoints=1).build()
    assert tr.gap_ms >= 3000
    tr.samples.energy_mj[:] = np.nan
    cfg = ReplayConfig()
    [job], _ = book_trace(tr.samples, tr.events, cfg)
    per_gpu = np.bincount(job.pieces.gpu, weights=job.pieces.energy_mj, minlength=8)
    np.testing.assert_allclose(per_gpu, tr.true_energy_mj, rtol=0.005)
    # The hiccups' time stays unobserved; only their energy is carried.
    assert job_report(job, cfg)["gpu_hours"]["unobserved"] * 3.6e6 >= 0.5 * tr.gap_ms * 8


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_energy_across_logger_hiccups_holds_on_each_long_phase_of_each_gpu(seed):
    """Per long phase (each 120 s compute stretch, hiccups inside it), per GPU: the booked energy
    is within 0.5% of what the GPU used in that phase (pieces cut at a phase edge count pro rata)."""
    from tests.realtrace import Scenario

    tr = Scenario(seed=seed, gap_s=(0.3, 0.5), gap_every_s=10.0, compute_s=120.0, checkpoints=1).build()
    tr.samples.energy_mj[:] = np.nan
    [job], _ = book_trace(tr.samples, tr.events, ReplayConfig())
    p = job.pieces
    dur = np.maximum(p.end_ms - p.start_ms, 1)
    long_phases = [(k, a, b) for k, (_, a, b) in enumerate(tr.phases) if b - a >= 60_000]
    assert len(long_phases) == 2
    for k, a, b in long_phases:
        inside = np.clip(np.minimum(p.end_ms, b) - np.maximum(p.start_ms, a), 0, None) / dur
        booked = np.bincount(p.gpu, weights=p.energy_mj * inside, minlength=8)
        np.testing.assert_allclose(booked, tr.phase_energy_mj[k], rtol=0.005, err_msg=f"phase {k}")
