"""The live agent's incremental booking equals an offline replay of the same data."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from costexporter.core import profiles
from costexporter.core.booking import BookingConfig
from costexporter.core.cost import Prices
from costexporter.core.live import JobState, book_window, ledger_delta
from costexporter.core.model import CATEGORIES
from costexporter.core.replay import ReplayConfig, book_trace
from costexporter.core.samplewin import keep_from
from costexporter.sources.synth import TraceBuilder


def scenario(kind: str) -> TraceBuilder:
    b = TraceBuilder(n_gpus=4, per_host=2, job="live", seed=11)
    b.run("start")
    b.stretch("compute", 300, step_s=5)
    if kind == "checkpoint":
        b.phase("checkpoint", "begin")
        b.stretch("checkpoint", 120, zero_ranks=(0,))
        b.phase("checkpoint", "end", step=b.step)
        b.stretch("compute", 100, step_s=5)
    elif kind == "deadlock":
        b.stretch("deadlock", 30, zero_ranks=(1,))
        b.stretch("compute", 100, step_s=5)
        b.stretch("idle", 200)
        b.stretch("compute", 100, step_s=5)
    elif kind == "resume":
        b.stretch("idle", 20)
        b.run("resume", step=40)
        b.stretch("compute", 150, step_s=5)
    elif kind == "hung":
        b.phase("checkpoint", "begin")
        b.stretch("checkpoint", 1500, zero_ranks=(0,))
    b.stretch("compute", 50, step_s=5)
    b.run("end")
    b.stretch("idle", 5)
    return b


def book_seen(
    s,
    events,
    now,
    start,
    own,
    booked_until,
    *,
    n_ranks,
    now_ms=None,
    profile=profiles.B300,
    cfg=None,
    since=None,
    carry=None,
    member_start=None,
):
    """`book_window` as the live agent runs it at `now` (ms): the samples (rank r is GPU r) and
    events seen by then (samples from `since`: a band window, with its `carry`), every own
    rank's GPU time from `start` (or from its `member_start`)."""
    seen = s.ts_ms <= now
    if since is not None:  # the band window, as the agent's SampleWindow keeps it
        seen &= keep_from(s.gpu, s.ts_ms, since)
    return book_window(
        events=[e for e in events if e.ts_ms <= now],
        cfg=cfg or BookingConfig(),
        profile=profile,
        job_start_ms=start,
        rank=s.gpu.astype(np.int64)[seen],
        ts_ms=s.ts_ms[seen],
        power_w=s.power_w[seen],
        util_pct=s.util_pct[seen],
        energy_mj=s.energy_mj[seen],
        n_ranks=n_ranks,
        own_ranks=own,
        member_start_ms=np.full(own.size, start) if member_start is None else member_start,
        booked_until_ms=booked_until,
        now_ms=now if now_ms is None else now_ms,
        carry=carry,
    )


def delta_of(state, res, own, start, tol_ms, prices=None):
    """`ledger_delta` of one round of `book_seen` (one agent, the job's price)."""
    return ledger_delta(
        state,
        res,
        prices=Prices(price_per_gpu_hour=3.5) if prices is None else prices,
        own_ranks=own,
        member_start_ms=np.full(own.size, start),
        job_start_ms=start,
        last_progress_ms=start,
        host="h",
        incident_tol_ms=tol_ms,
    )


def live_totals(b: TraceBuilder, rounds_s: float, own: list[int]) -> tuple[np.ndarray, int]:
    """Book in rounds as data arrives; return category ms of the `own` ranks, and the horizon."""
    s = b.samples()
    events = sorted(b.events, key=lambda e: e.ts)
    start = int(b.t0 * 1000)
    own_ranks = np.asarray(own)
    booked_until = start
    totals = np.zeros(len(CATEGORIES), np.int64)
    now = start
    end = int(b.t * 1000)
    while booked_until < end and now < end + 600_000:
        now += int(rounds_s * 1000)
        res = book_seen(
            s, events, now, start, own_ranks, booked_until, n_ranks=b.n_gpus, now_ms=min(now, end)
        )
        p = res.pieces
        assert (p.start_ms >= booked_until).all() and (p.end_ms <= res.horizon_ms).all()
        totals += np.bincount(p.category, weights=p.end_ms - p.start_ms, minlength=len(CATEGORIES)).astype(
            np.int64
        )
        booked_until = max(booked_until, res.horizon_ms)
    return totals, booked_until


@pytest.mark.parametrize("kind", ["steps", "checkpoint", "deadlock", "resume", "hung"])
@pytest.mark.parametrize("rounds_s", [1.0, 7.0])
def test_booking_in_rounds_equals_the_offline_replay(kind, rounds_s):
    b = scenario(kind)
    results, _ = book_trace(b.samples(), b.events, ReplayConfig())
    [r] = results
    offline = np.bincount(r.pieces.category, weights=r.pieces.dur_ms, minlength=len(CATEGORIES)).astype(
        np.int64
    )
    live, horizon = live_totals(b, rounds_s, own=[0, 1, 2, 3])
    assert horizon == r.timeline.end_ms  # the run ended: everything got decided
    if kind == "resume":
        # Live books the voided steps as valid when they complete; the agent moves them to
        # rolled_back with the rollback index when the resume arrives (tested with the ledger).
        valid = [CATEGORIES.index(c) for c in ("productive", "communication", "starved")]
        rb = CATEGORIES.index("rolled_back")
        assert live[valid].sum() == offline[valid].sum() + offline[rb] and live[rb] == 0
        live[valid], offline[valid] = 0, 0
        live[rb] = offline[rb] = 0
    assert dict(zip(CATEGORIES, live.tolist(), strict=True)) == dict(
        zip(CATEGORIES, offline.tolist(), strict=True)
    )


def test_two_agents_each_book_their_own_gpus_and_together_the_whole_job():
    b = scenario("deadlock")
    results, _ = book_trace(b.samples(), b.events, ReplayConfig())
    [r] = results
    offline = np.bincount(r.pieces.category, weights=r.pieces.dur_ms, minlength=len(CATEGORIES)).astype(
        np.int64
    )
    host0, _ = live_totals(b, 3.0, own=[0, 1])
    host1, _ = live_totals(b, 3.0, own=[2, 3])
    assert (host0 + host1).tolist() == offline.tolist()
    assert host0[CATEGORIES.index("stalled")] > 0 and host1[CATEGORIES.index("stalled")] > 0


@pytest.mark.parametrize("kind", ["resume", "deadlock", "checkpoint"])
@pytest.mark.parametrize("rounds_s", [2.0, 9.0])
def test_the_pure_ledger_delta_chained_over_rounds_nets_to_the_offline_replay(kind, rounds_s):
    """No Redis: book_window + ledger_delta round after round, the resume's correction included,
    give the offline replay's amounts net of the `voided:` corrections, and every delta is
    self-consistent (its state adds exactly what it writes)."""
    from costexporter.core.cost import Prices
    from costexporter.core.live import JobState

    b = scenario(kind)
    [r], _ = book_trace(b.samples(), b.events, ReplayConfig())
    offline = np.bincount(r.pieces.category, weights=r.pieces.dur_ms, minlength=len(CATEGORIES)).astype(
        np.int64
    )
    s = b.samples()
    events = sorted(b.events, key=lambda e: e.ts)
    start, end = int(b.t0 * 1000), int(b.t * 1000)
    own = np.arange(b.n_gpus)
    state, now, prices = JobState(booked_until=start), start, Prices()
    written = np.zeros((len(CATEGORIES), 3), np.int64)
    while state.booked_until < end and now < end + 600_000:
        now += int(rounds_s * 1000)
        res = book_seen(
            s, events, now, start, own, state.booked_until, n_ranks=b.n_gpus, now_ms=min(now, end)
        )
        if res.horizon_ms <= state.booked_until:
            continue
        d = delta_of(state, res, own, start, 5000, prices)
        round_amounts = sum(d.by_bucket.values(), np.zeros_like(written))
        assert (d.state.booked == state.booked + round_amounts + d.rolled).all()
        assert (d.state.voided == state.voided + d.moved).all()
        assert d.rolled[CATEGORIES.index("rolled_back")].tolist() == d.moved.sum(0).tolist()
        assert d.state.booked_until == res.horizon_ms
        written += round_amounts + d.rolled - d.moved
        state = d.state
    assert dict(zip(CATEGORIES, written[:, 0].tolist(), strict=True)) == dict(
        zip(CATEGORIES, offline.tolist(), strict=True)
    )


def deadlock_scenario(zero_rank: int) -> TraceBuilder:
    b = TraceBuilder(n_gpus=4, per_host=2, job="live", seed=5 + zero_rank)
    b.run("start")
    b.stretch("compute", 120, step_s=5)
    b.stretch("deadlock", 60, zero_ranks=(zero_rank,))
    b.stretch("compute", 60, step_s=5)
    b.run("end")
    b.stretch("idle", 5)
    return b


def chained_incidents(b: TraceBuilder, own: list[int], rounds_s: float) -> dict[str, dict]:
    """The open incidents an agent owning `own` leaves after booking `b` round by round."""
    from costexporter.core.live import JobState

    s = b.samples()
    events = sorted(b.events, key=lambda e: e.ts)
    start, end = int(b.t0 * 1000), int(b.t * 1000)
    own_ranks = np.asarray(own)
    state, now = JobState(booked_until=start), start
    while state.booked_until < end and now < end + 600_000:
        now += int(rounds_s * 1000)
        res = book_seen(
            s, events, now, start, own_ranks, state.booked_until, n_ranks=b.n_gpus, now_ms=min(now, end)
        )
        if res.horizon_ms > state.booked_until:
            state = delta_of(state, res, own_ranks, start, 5000).state
    return state.incidents


@pytest.mark.parametrize("zero_rank", [1, 3])
@pytest.mark.parametrize("rounds_s", [2.0, 9.0])
def test_the_live_deadlock_incident_names_the_zero_util_rank_as_replay_does(zero_rank, rounds_s):
    """R2: the deadlock's ~0% rank is the one that left the collective. Every agent's incident
    names it (also the agent that does not own that rank), as the offline replay's does."""
    b = deadlock_scenario(zero_rank)
    [r], _ = book_trace(b.samples(), b.events, ReplayConfig())
    from costexporter.core.replay import incidents as replay_incidents

    offline = [i for i in replay_incidents(r, Prices(price_per_gpu_hour=3.5)) if i["zero_util_ranks"]]
    assert [i["zero_util_ranks"] for i in offline] == [[zero_rank]]
    for own in ([0, 1], [2, 3], [0, 1, 2, 3]):
        incs = chained_incidents(b, own, rounds_s)
        stalled = incs[offline[0]["category"]]
        assert stalled["zero_util_ranks"] == [zero_rank], (own, stalled)
        assert stalled["ranks"] == own
        # Other wasted stretches (none in the deadlock band) name no one.
        assert all(not i["zero_util_ranks"] for k, i in incs.items() if k != offline[0]["category"])


def test_a_hung_checkpoint_names_the_writing_rank_once_it_turns_into_a_deadlock():
    """A checkpoint signature (rank 0 at ~0% while writing) that runs far past its usual length
    books as a deadlock: the live incident names rank 0 as replay does; the other wasted stretch
    (no progress, compute band) names no one."""
    b = scenario("hung")
    [r], _ = book_trace(b.samples(), b.events, ReplayConfig())
    from costexporter.core.replay import incidents as replay_incidents

    offline = {i["category"]: i["zero_util_ranks"] for i in replay_incidents(r, Prices())}
    assert offline["stalled"] == [0] and [] in offline.values()
    incs = chained_incidents(b, [0, 1, 2, 3], 9.0)
    assert {k: i["zero_util_ranks"] for k, i in incs.items()} == offline


# ---- band windows: seconds of samples and the signature run carried, not the whole context -----


WINDOW_CFG = BookingConfig(checkpoint_allowance_s=40.0, stall_floor_s=30.0)


@st.composite
def signature_jobs(draw):
    """Jobs of 1-4 ranks: checkpoints (rank 0 at 0%) and deadlocks that outlast the window,
    some past the checkpoint allowance, the 0% rank changing inside one, gaps in the samples."""
    n = draw(st.integers(1, 4))
    b = TraceBuilder(n_gpus=n, per_host=2, job="win", seed=draw(st.integers(0, 999)))
    b.run("start")
    b.stretch("compute", draw(st.integers(5, 40)), step_s=5)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["checkpoint", "deadlock", "split", "compute", "idle", "gap"]))
        d = draw(st.integers(3, 90))
        if kind == "checkpoint":
            b.phase("checkpoint", "begin")
            b.stretch("checkpoint", d, zero_ranks=(0,))
            b.phase("checkpoint", "end", step=b.step)
        elif kind in ("deadlock", "split"):
            z = draw(st.integers(0, n - 1))
            b.stretch("deadlock", d, zero_ranks=(z,))
            if kind == "split":  # the same signature run, another rank at 0% now
                b.stretch("deadlock", draw(st.integers(3, 60)), zero_ranks=((z + 1) % n,))
        elif kind == "gap":
            b.t += draw(st.integers(1, 6))  # the logger wrote nothing for a while
        else:
            b.stretch(kind, d, step_s=5 if kind == "compute" else None)
    b.stretch("compute", draw(st.integers(5, 30)), step_s=5)
    b.run("end")
    b.stretch("idle", 5)
    return b, draw(st.sampled_from([1.0, 3.0, 7.0]))


def windowed_rounds(b: TraceBuilder, rounds_s: float, windowed: bool) -> dict:
    """Book `b` in rounds as the agent does (book_window, ledger_delta); `windowed`: each round
    gets only the samples of its band window (`JobState.take_window`) and the carried run."""
    s = b.samples()
    events = sorted(b.events, key=lambda e: e.ts)
    start, end = int(b.t0 * 1000), int(b.t * 1000)
    own = np.arange(b.n_gpus)
    state, now = JobState(booked_until=start), start
    totals = np.zeros((b.n_gpus, len(CATEGORIES)), np.int64)
    incidents: dict[str, dict] = {}
    held = 0
    while state.booked_until < end and now < end + 600_000:
        now += int(rounds_s * 1000)
        win_start, carry = state.take_window(state.booked_until) if windowed else (None, None)
        held = max(held, int(((s.ts_ms <= now) & (s.ts_ms >= (win_start or -(2**62)))).sum()))
        res = book_seen(
            s,
            events,
            now,
            start,
            own,
            state.booked_until,
            n_ranks=b.n_gpus,
            now_ms=min(now, end),
            cfg=WINDOW_CFG,
            since=win_start,
            carry=carry,
        )
        if res.horizon_ms <= state.booked_until:
            continue
        p = res.pieces
        np.add.at(totals, (p.gpu, p.category), p.end_ms - p.start_ms)
        d = delta_of(state, res, own, start, 2000)
        for inc in d.incidents.values():
            incidents[f"{inc['category']}:{inc['start']}"] = inc
        state = d.state
    return {"totals": totals.tolist(), "incidents": incidents, "until": state.booked_until, "held": held}


@settings(
    max_examples=int(os.environ.get("BAND_WINDOW_EXAMPLES", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(signature_jobs())
def test_rounds_on_band_windows_book_as_rounds_on_the_whole_context(job):
    """Each round holding only its band window (seconds before what is left to book) and the
    signature run carried into it books every GPU-millisecond in the category, and opens the
    incidents (spans, ~0% ranks), that rounds holding every sample do: a checkpoint signature
    still turns into a deadlock at its allowance, however long ago it began."""
    b, rounds_s = job
    whole = windowed_rounds(b, rounds_s, windowed=False)
    win = windowed_rounds(b, rounds_s, windowed=True)
    assert win["totals"] == whole["totals"]
    assert win["incidents"] == whole["incidents"]
    assert win["until"] == whole["until"]


def test_a_band_window_holds_seconds_not_the_whole_signature():
    """A 10-minute hung checkpoint (allowance 40 s): rounds on band windows hold a few rounds of
    samples, and book it overhead for its allowance, then stalled, as rounds on everything do."""
    b = TraceBuilder(n_gpus=4, per_host=2, job="win", seed=1)
    b.run("start")
    b.stretch("compute", 30, step_s=5)
    b.phase("checkpoint", "begin")
    b.stretch("checkpoint", 600, zero_ranks=(0,))
    b.phase("checkpoint", "end", step=b.step)
    b.stretch("compute", 30, step_s=5)
    b.run("end")
    whole = windowed_rounds(b, 5.0, windowed=False)
    win = windowed_rounds(b, 5.0, windowed=True)
    assert win["totals"] == whole["totals"]
    stalled = CATEGORIES.index("stalled")
    assert all(row[stalled] > 500_000 for row in win["totals"])  # past the allowance: waste
    # Under a minute of samples (the overlap, a round, and what waits on the stall decision past
    # the allowance), not the ten minutes of the hang.
    assert win["held"] < 4 * 60 and whole["held"] > 4 * 600
