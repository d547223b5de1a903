"""Each booking rule of DESIGN section 4, on small synthetic traces (4 B300 GPUs, 1 s samples)."""

from __future__ import annotations

import pytest

from costexporter.core.cost import Prices
from costexporter.core.replay import ReplayConfig
from costexporter.sources.synth import TraceBuilder

from .conftest import book

N = 4
H = 1 / 3600  # one GPU-second in GPU-hours


def job(**kw) -> TraceBuilder:
    b = TraceBuilder(n_gpus=N, per_host=2, job="t", **kw)
    b.run("start")
    return b


def hours(rep: dict, cat: str) -> float:
    return rep["gpu_hours"][cat]


def test_steps_book_by_band_and_name_the_straggler():
    b = job()
    b.stretch("compute", 600, step_s=5)
    b.stretch("communication", 300, step_s=5)
    b.stretch("starvation", 300, step_s=5, straggler=2)
    b.run("end")
    r = book(b)
    # The first step's interval is startup overhead (rule 3): 5 s per GPU.
    assert hours(r, "overhead") == pytest.approx(N * 5 * H)
    assert hours(r, "productive") == pytest.approx(N * 595 * H)
    assert hours(r, "communication") == pytest.approx(N * 300 * H)
    assert hours(r, "starved") == pytest.approx(N * 300 * H)
    assert r["wasted_gpu_hours"] == 0
    assert r["straggler"]["rank"] == 2
    assert r["valid_steps"] == 240


def test_short_deadlock_inside_a_completed_step_books_stalled():
    b = job()
    b.stretch("compute", 300, step_s=5)
    b.stretch("deadlock", 20, zero_ranks=(1,))  # shorter than the 60 s stall floor
    b.stretch("compute", 300, step_s=5)
    r = book(b)
    assert hours(r, "stalled") == pytest.approx(N * 20 * H)
    assert r["steps_completed"] == r["valid_steps"] == 120


def test_one_sample_blip_is_not_a_deadlock():
    b = job()
    b.stretch("compute", 120, step_s=2)
    b.stretch("deadlock", 1, zero_ranks=(1,))
    b.stretch("compute", 120, step_s=2)
    r = book(b)
    assert r["band_gpu_hours"]["deadlock"] == 0
    assert hours(r, "stalled") == 0


def test_checkpoint_within_allowance_is_overhead():
    b = job()
    b.stretch("compute", 300, step_s=5)
    b.phase("checkpoint", "begin")
    b.stretch("checkpoint", 300, zero_ranks=(0,))  # rank 0 saves, the others spin
    b.phase("checkpoint", "end", step=b.step)
    b.stretch("compute", 300, step_s=5)
    r = book(b)
    assert hours(r, "overhead") == pytest.approx(N * (300 + 5) * H)
    assert r["band_gpu_hours"]["checkpoint"] == pytest.approx(N * 300 * H)
    assert r["wasted_gpu_hours"] == 0
    assert r["last_checkpoint_step"] == 60


def test_hung_checkpoint_past_its_allowance_is_stalled():
    b = job()
    b.stretch("compute", 300, step_s=5)
    b.phase("checkpoint", "begin")
    b.stretch("checkpoint", 3600, zero_ranks=(0,))  # R7: the 3 a.m. NFS write
    r = book(b)
    # 15 min of overhead, then the rest of the hour is stalled.
    assert hours(r, "overhead") == pytest.approx(N * (900 + 5) * H)
    assert hours(r, "stalled") == pytest.approx(N * 2700 * H)
    assert r["band_gpu_hours"]["checkpoint"] == pytest.approx(N * 900 * H)
    assert r["band_gpu_hours"]["deadlock"] == pytest.approx(N * 2700 * H)


def test_checkpoint_allowance_is_learned_from_the_jobs_own_checkpoints():
    b = job()
    for _ in range(3):
        b.stretch("compute", 120, step_s=5)
        b.phase("checkpoint", "begin")
        b.stretch("checkpoint", 60, zero_ranks=(0,))
        b.phase("checkpoint", "end", step=b.step)
    b.stretch("compute", 120, step_s=5)
    b.phase("checkpoint", "begin")
    b.stretch("checkpoint", 600, zero_ranks=(0,))
    b.phase("checkpoint", "end", step=b.step)
    b.stretch("compute", 120, step_s=5)
    r = book(b)
    # allowance = 3 x median(60 s) = 180 s: the fourth checkpoint overruns by 420 s.
    assert hours(r, "overhead") == pytest.approx(N * (3 * 60 + 180 + 5) * H)
    assert hours(r, "stalled") == pytest.approx(N * 420 * H)


def test_startup_within_allowance_is_overhead_and_beyond_is_no_progress():
    b = job()
    b.stretch("communication", 600)  # loading, busy, no steps yet
    b.stretch("compute", 300, step_s=5)
    r = book(b)
    assert hours(r, "overhead") == pytest.approx(N * 605 * H)
    assert r["wasted_gpu_hours"] == 0

    b = job()
    b.stretch("communication", 2400)  # 40 min: 10 min past the 30 min allowance
    b.stretch("compute", 300, step_s=5)
    r = book(b)
    assert hours(r, "overhead") == pytest.approx(N * 1800 * H)
    assert hours(r, "no_progress") == pytest.approx(N * 605 * H)


def test_crash_loop_from_launch_books_no_progress_after_the_startup_allowance():
    b = job()
    for _ in range(20):  # R7: an OOM loop restarted by the kubelet, no step completes
        b.run("start")
        b.stretch("crashloop", 180)
    r = book(b)
    # Restarts do not reset the allowance: 30 min overhead, then every restart is waste.
    assert hours(r, "overhead") == pytest.approx(N * 1800 * H, rel=1e-3)
    assert hours(r, "no_progress") + hours(r, "idle") == pytest.approx(N * 1800 * H, rel=1e-3)
    assert hours(r, "no_progress") > hours(r, "idle") > 0
    assert r["valid_steps"] == 0 and r["cost_per_valid_step"] is None


def test_crash_loop_after_training_uses_the_learned_startup_allowance():
    b = job()
    b.stretch("compute", 300, step_s=5)  # the job's own startup took 5 s
    for _ in range(20):
        b.run("start")
        b.stretch("crashloop", 180)
    r = book(b)
    # Learned allowance: max(3 x 5 s, the 60 s stall floor) = 60 s, once, not per restart.
    assert hours(r, "overhead") == pytest.approx(N * (5 + 60) * H, rel=1e-3)
    assert hours(r, "no_progress") + hours(r, "idle") == pytest.approx(N * (3600 - 60) * H, rel=1e-3)
    assert r["steps_completed"] == 60


def test_idle_gap_between_steps_books_idle():
    b = job()
    b.stretch("compute", 300, step_s=5)
    b.stretch("idle", 600)
    b.stretch("compute", 300, step_s=5)
    r = book(b)
    assert hours(r, "idle") == pytest.approx(N * 600 * H)
    # The first step after the gap is wasted too: booked from the last completed step on.
    assert hours(r, "no_progress") == pytest.approx(N * 5 * H)


def test_resume_voids_steps_and_moves_their_time_to_rolled_back():
    b = job()
    b.stretch("compute", 500, step_s=5)  # steps 1..100
    b.stretch("idle", 30)  # crash
    b.run("resume", step=60)  # back to the checkpoint after step 60
    b.stretch("compute", 200, step_s=5)  # steps 61..100 again
    b.run("end")
    r = book(b)
    assert r["steps_completed"] == 140
    assert r["steps_voided"] == 40
    assert r["valid_steps"] == 100
    assert hours(r, "rolled_back") == pytest.approx(N * 200 * H)
    # The first step of each run is startup overhead (rule 3).
    assert hours(r, "productive") == pytest.approx(N * (300 - 5 + 200 - 5) * H)
    assert hours(r, "idle") == pytest.approx(N * 30 * H)
    rb = [i for i in r["incidents"] if i["category"] == "rolled_back"]
    assert len(rb) == 1 and rb[0]["gpu_hours"] == pytest.approx(N * 200 * H)


def test_step_number_going_back_without_resume_is_an_implicit_resume():
    b = job()
    b.stretch("compute", 500, step_s=5)  # steps 1..100
    b.step = 80  # the trainer restarted from step 80 without saying so
    b.stretch("compute", 100, step_s=5)  # 81..100
    r = book(b)
    assert r["steps_voided"] == 20
    assert r["valid_steps"] == 100
    assert hours(r, "rolled_back") == pytest.approx(N * 100 * H)


def test_lost_gpu_keeps_the_others_booked_and_books_unobserved():
    b = job()
    b.stretch("compute", 600, step_s=5)
    b.stretch("compute", 600, step_s=5, gpus=(0, 1, 3))  # GPU 2 is lost
    b.run("end")
    r = book(b)
    lost = next(g for g in r["gpus"] if g["rank"] == 2)
    assert lost["gpu_hours"]["unobserved"] == pytest.approx(600 * H, abs=2 * H)
    assert hours(r, "productive") == pytest.approx((N * 595 + 3 * 600) * H, abs=2 * H)


def test_sample_gap_longer_than_three_intervals_is_unobserved():
    b = job()
    b.stretch("compute", 300, step_s=5)
    b.gap(30)
    b.stretch("compute", 300, step_s=5)
    r = book(b)
    assert hours(r, "unobserved") == pytest.approx(N * 30 * H)


def test_unregistered_gpu_is_unassigned_not_billed_to_the_job():
    from costexporter.core.replay import replay

    b = TraceBuilder(n_gpus=3, per_host=3, job="t")
    b.events = [e for e in b.events if not (e.type == "register" and e.rank == 2)]
    b.run("start")
    b.stretch("compute", 600, step_s=5)
    rep = replay(b.samples(), b.events)
    j = rep["jobs"]["t"]
    assert len(j["gpus"]) == 2
    assert rep["unassigned"]["gpu_hours"] == pytest.approx(600 * H)
    assert j["gpu_hours"]["unassigned"] == 0


def test_two_ranks_registering_one_gpu_book_it_once(caplog):
    """Exactly once: a second launcher that posts the same host + GPU (and uuid) as rank 0 does
    not book that GPU's time twice; the GPU nobody else registered stays unassigned."""
    from costexporter.core.replay import replay

    b = TraceBuilder(n_gpus=2, per_host=2, job="t")
    first = next(e for e in b.events if e.type == "register" and e.rank == 0)
    for e in b.events:
        if e.type == "register" and e.rank == 1:
            e.fields.update(gpu=first.fields["gpu"], gpu_uuid=first.fields["gpu_uuid"])
    b.run("start")
    b.stretch("compute", 600, step_s=5)
    with caplog.at_level("WARNING", logger="costexporter.replay"):
        rep = replay(b.samples(), b.events)
    j = rep["jobs"]["t"]
    assert [g["rank"] for g in j["gpus"]] == [0]
    assert sum(j["gpu_hours"].values()) == pytest.approx(600 * H, abs=2 * H)
    assert rep["unassigned"]["gpu_hours"] == pytest.approx(600 * H, abs=2 * H)
    assert "ranks 0 and 1 both registered node0 GPU 0" in caplog.text


def test_wasted_price_and_energy_price():
    b = job()
    b.stretch("compute", 600, step_s=5)
    b.stretch("idle", 600)
    prices = Prices(price_per_gpu_hour=4.0, wasted_price_per_gpu_hour=1.0, price_per_kwh=0.2, pue=1.5)
    r = book(b, ReplayConfig(prices=prices), energy_counter=True)
    for cat, rate in (("productive", 4.0), ("idle", 1.0)):
        expect = r["gpu_hours"][cat] * rate + r["energy_kwh"][cat] * 0.2 * 1.5
        assert r["cost"][cat] == pytest.approx(expect, abs=1e-6)
    assert r["cost_total"] == pytest.approx(sum(r["cost"].values()), abs=1e-5)
    assert r["cost_per_valid_step"] == pytest.approx(r["cost_total"] / r["valid_steps"], abs=1e-6)
    # Energy came from the counter: compute power ~990 W for 595 s on 4 GPUs.
    assert r["energy_kwh"]["productive"] == pytest.approx(N * 595 * 990 / 3.6e6, rel=0.03)


def test_a_jobs_meta_price_is_ignored_and_the_configured_price_books_it():
    b = job()
    b.meta(price_per_gpu_hour=1e-9)
    b.stretch("compute", 600, step_s=5)
    r = book(b, ReplayConfig(prices=Prices(price_per_gpu_hour=3.5)))
    assert r["price_per_gpu_hour"] == 3.5 and r["meta_ignored"] == ["price_per_gpu_hour"]
    assert r["cost_total"] == pytest.approx(N * 600 * H * 3.5, abs=1e-6)


def test_a_ranks_own_phase_covers_only_its_gpu():
    b = job()
    b.stretch("compute", 300, step_s=5)
    b.phase("eval", "begin", rank=2)
    b.stretch("idle", 120)
    r = book(b)
    by_rank = {g["rank"]: g["gpu_hours"] for g in r["gpus"]}
    assert by_rank[2]["overhead"] == pytest.approx((5 + 120) * H)
    assert by_rank[0]["overhead"] == pytest.approx(5 * H)
    assert by_rank[0]["idle"] == pytest.approx(120 * H)
