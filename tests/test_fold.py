"""The incremental timeline (`fold.TimelineFold`) against `build_timeline` over every event.

The fold walks each event once and forgets what lies before the booking context; whatever a
round reads of its view (segments and step records from the kept part on, the stall threshold,
the decided horizon, allowances, rank overheads, step counts, voids) must be what a from-scratch
rebuild says, on random streams with resumes, phases, stalls, restarts and events arriving a
little out of order.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from costexporter.core.booking import NEG_INF, BookingConfig, Regime, build_timeline
from costexporter.core.fold import (
    FOLD_FORMAT,
    FoldFormatError,
    TimelineFold,
    dump_fold,
    load_fold,
    walk_relevant,
)
from costexporter.core.model import Event
from costexporter.core.timeutil import to_ms

CFG = BookingConfig(
    stall_floor_s=5.0,
    checkpoint_allowance_s=20.0,
    eval_allowance_s=10.0,
    startup_allowance_s=15.0,
    stall_window=8,
    # short enough that the streams below lapse (a 40-s silence) and come back to life
    liveness_timeout_s=30.0,
    liveness_timeout_max_s=60.0,
)
LAG_MS = 30_000


def ev(kind: str, ts: float, rank: int = 0, seq: int = 0, **fields) -> Event:
    return Event(kind, "j", to_ms(ts), rank, "s", seq, fields)


@st.composite
def streams(draw):
    """A job's events in arrival order (a little shuffled), and the arrival batches."""
    t = 1000.0
    step = 0
    out: list[Event] = [ev("run", t, state="start")]
    open_phase: dict[tuple[int, str], bool] = {}
    n = draw(st.integers(5, 120))
    for _ in range(n):
        t += draw(st.sampled_from([0.5, 1.0, 1.0, 2.0, 3.0, 9.0, 40.0]))
        kind = draw(st.sampled_from(["step"] * 8 + ["phase", "phase", "run", "hb", "other", "back"]))
        if kind == "step":
            step += 1
            out.append(ev("step", t, step=step, tokens=draw(st.integers(0, 5))))
        elif kind == "back":  # an implicit resume: a step at or below one already done
            step = max(1, step - draw(st.integers(0, 4)))
            out.append(ev("step", t, step=step, tokens=1))
        elif kind == "phase":
            rank = draw(st.sampled_from([0, 0, 1]))
            name = draw(st.sampled_from(["checkpoint", "eval"]))
            state = "end" if open_phase.get((rank, name)) else "begin"
            if draw(st.booleans()) and state == "begin":
                state = "begin"
            open_phase[(rank, name)] = state == "begin"
            f = {"name": name, "state": state}
            if name == "checkpoint" and state == "end":
                f["step"] = step
            out.append(ev("phase", t, rank=rank, **f))
        elif kind == "run":
            state = draw(st.sampled_from(["resume", "end", "start"]))
            f = {"state": state}
            if state == "resume":
                step = max(0, step - draw(st.integers(0, 3)))
                f["step"] = step
            out.append(ev("run", t, **f))
        elif kind == "hb":
            out.append(ev("heartbeat", t, rank=draw(st.integers(0, 2))))
        else:
            out.append(ev("step", t, rank=1, step=step))
    for i, e in enumerate(out):
        e.seq = i
    # Arrival: a few neighbours swapped (late within the fold's lag).
    arrival = list(out)
    for _ in range(draw(st.integers(0, 5))):
        i = draw(st.integers(0, len(arrival) - 2))
        arrival[i], arrival[i + 1] = arrival[i + 1], arrival[i]
    cuts = sorted(set(draw(st.lists(st.integers(1, len(arrival)), min_size=1, max_size=12))))
    return arrival, cuts


def _restrict(b: np.ndarray, r: np.ndarray, lo: int) -> list[tuple[int, int]]:
    """(start, regime) of the segments from `lo` on, the first one starting at lo."""
    i = int(np.searchsorted(b, lo, "right")) - 1
    out = [(lo, int(r[i]))]
    for j in range(i + 1, r.size):
        out.append((int(b[j]), int(r[j])))
    return out


def _clip(ivals, lo):
    return [(max(a, lo), b) for a, b in ivals if b > lo]


def check_view(fold: TimelineFold, seen: list[Event], end_ms: int, lo: int) -> None:
    tl = fold.timeline(end_ms)
    ref = build_timeline(seen, CFG, fold.start_ms, end_ms, final=False)
    assert tl is not None
    assert _restrict(tl.bounds, tl.regime, lo) == _restrict(ref.bounds, ref.regime, lo)
    assert tl.decided_until_ms == ref.decided_until_ms
    assert tl.stall_threshold_ms == ref.stall_threshold_ms
    assert tl.end_ms == ref.end_ms
    assert tl.lapsed == ref.lapsed
    assert tl.last_checkpoint_step == ref.last_checkpoint_step
    assert tl.last_checkpoint_ms == ref.last_checkpoint_ms
    assert tl.resumes == ref.resumes
    assert {r: _clip(v, lo) for r, v in tl.rank_overhead.items() if _clip(v, lo)} == {
        r: _clip(v, lo) for r, v in ref.rank_overhead.items() if _clip(v, lo)
    }
    assert [o for o in tl.phases_overrun if o[2] >= lo] == [o for o in ref.phases_overrun if o[2] >= lo]
    probe = np.arange(max(lo, fold.start_ms - 10_000), end_ms + 60_000, 7_000, dtype=np.int64)
    for name in ("checkpoint", "eval", "startup"):
        assert (tl.allowances.at(name, probe) == ref.allowances.at(name, probe)).all()
        assert tl.allowances.current(name) == ref.allowances.current(name)
    # Step records: the kept ones are the rebuild's from step_base on; the summary counts all.
    assert tl.steps == ref.steps[tl.step_base :]
    s = tl.summary
    assert s.n_steps == len(ref.steps)
    assert s.n_voided == sum(r.voided for r in ref.steps)
    assert s.valid_tokens == sum(r.tokens for r in ref.steps if not r.voided)
    assert s.tokens_before == sum(r.tokens for r in ref.steps[: tl.step_base])
    assert s.last_step == (ref.steps[-1] if ref.steps else None)
    assert sorted((i, rec) for i, rec, _ in s.voided) == [(i, r) for i, r in enumerate(ref.steps) if r.voided]
    for i, _rec, prev in s.voided:
        assert prev == (ref.steps[i - 1].ts_ms if i > 0 else None)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams(), st.integers(0, 20_000), st.integers(0, 120_000), st.integers(-60_000, 30_000))
def test_fold_equals_rebuild(stream, ahead_ms, context_ms, others_ms):
    """`others_ms`: the other ranks' phases walked for good up to a frontier of their own, behind
    or ahead of rank 0's (the watcher's, where a rank reports rarely)."""
    arrival, cuts = stream
    fold = TimelineFold(CFG, 1_000_000)
    seen: list[Event] = []
    lo = -(2**62)
    prev = 0
    for cut in cuts:
        batch = arrival[prev:cut]
        prev = cut
        seen += batch
        fold.add(batch)
        end_ms = max(e.ts_ms for e in seen) + ahead_ms
        if fold.late:  # an event the fold had walked past: its owner rebuilds from the stream
            fold = TimelineFold(CFG, 1_000_000)
            fold.add(seen)
            lo = -(2**62)
        check_view(fold, seen, end_ms, lo)
        frontier = end_ms - LAG_MS
        keep_from = frontier - context_ms
        fold.advance(frontier, keep_from, others_ms=min(frontier + others_ms, end_ms))
        lo = max(lo, min(keep_from, fold.w.anchor))
        check_view(fold, seen, end_ms, lo)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams(), st.integers(0, 20_000), st.integers(0, 120_000))
def test_a_stored_fold_resumes_as_the_one_that_never_stopped(stream, ahead_ms, context_ms):
    """Stored and loaded at every batch (a restart each time), the fold gives the rebuild's view,
    and its stored bytes stay those of the fold that was never stored."""
    arrival, cuts = stream
    fold = TimelineFold(CFG, 1_000_000)
    kept = TimelineFold(CFG, 1_000_000)  # never stored
    seen: list[Event] = []
    lo = -(2**62)
    prev = 0
    checked = 0
    for cut in cuts:
        batch = arrival[prev:cut]
        prev = cut
        seen += batch
        fold.add(batch)
        kept.add(batch)
        end_ms = max(e.ts_ms for e in seen) + ahead_ms
        if fold.late:
            break  # the owner rebuilds from a stream (agent tests); nothing stored to compare
        checked += 1
        check_view(fold, seen, end_ms, lo)
        frontier = end_ms - LAG_MS
        keep_from = frontier - context_ms
        fold.advance(frontier, keep_from)
        kept.advance(frontier, keep_from)
        lo = max(lo, min(keep_from, fold.w.anchor))
        blob = dump_fold(fold, "j", {"x": cut})
        fold, extra = load_fold(blob, CFG, "j")
        assert extra == {"x": cut}
        assert dump_fold(fold, "j", {"x": cut}) == blob == dump_fold(kept, "j", {"x": cut})
        check_view(fold, seen, end_ms, lo)
    assert checked >= 1  # the first batch is never late: nothing was settled before it


def test_a_stored_fold_of_another_version_config_or_job_is_refused():
    fold = TimelineFold(CFG, 1_000_000)
    fold.add([ev("run", 1000.0, state="start"), ev("step", 1001.0, seq=1, step=1, tokens=2)])
    fold.advance(2_000_000, 0)
    blob = dump_fold(fold, "j")
    assert load_fold(blob, CFG, "j")[0].w.n_steps == 1
    import json
    import zlib

    raw = zlib.decompress(blob[6:])
    n = int.from_bytes(raw[:8], "little")
    head = json.loads(raw[8 : 8 + n])
    head["v"] = FOLD_FORMAT - 1
    body = json.dumps(head).encode()
    older = blob[:6] + zlib.compress(len(body).to_bytes(8, "little") + body + raw[8 + n :])
    bad = [
        older,
        b"garbage",
        blob[:-3],
        blob[:6] + zlib.compress(b"\x05\x00\x00\x00\x00\x00\x00\x00[1,2]"),
    ]
    head["v"] = FOLD_FORMAT
    head["scalars"][0] = "x"  # a field of the wrong type
    body = json.dumps(head).encode()
    bad.append(blob[:6] + zlib.compress(len(body).to_bytes(8, "little") + body + raw[8 + n :]))
    for data in bad:
        try:
            load_fold(data, CFG, "j")
        except FoldFormatError:
            pass
        else:
            raise AssertionError(data[:40])
    for other_cfg, job in ((BookingConfig(stall_window=9), "j"), (CFG, "k")):
        try:
            load_fold(blob, other_cfg, job)
        except FoldFormatError:
            pass
        else:
            raise AssertionError((other_cfg, job))


def test_late_event_is_flagged_and_noise_never_enters():
    fold = TimelineFold(CFG, 0)
    fold.add([ev("step", 10.0, step=1), ev("step", 20.0, step=2)])
    fold.add([ev("heartbeat", 1.0, rank=1), ev("step", 1.0, rank=3, step=1), ev("register", 1.0, rank=2)])
    assert len(fold.pending) == 2  # other ranks' heartbeats and steps, registrations: not folded
    fold.advance(15_000, 0)
    assert fold.folded == 1 and not fold.late
    fold.add([ev("heartbeat", 5.0, rank=1)])
    assert not fold.late
    fold.add([ev("heartbeat", 5.0)])  # rank 0's: a sign of life its run's lapse is dated by
    assert fold.late
    fold = TimelineFold(CFG, 0)
    fold.add([ev("step", 10.0, step=1), ev("step", 20.0, step=2)])
    fold.advance(15_000, 0)
    fold.add([ev("step", 14.0, step=2)])
    assert fold.late and fold.timeline(30_000) is None


def test_walk_relevant():
    assert walk_relevant(ev("step", 1.0))
    assert not walk_relevant(ev("step", 1.0, rank=1))
    assert walk_relevant(ev("heartbeat", 1.0))
    assert not walk_relevant(ev("heartbeat", 1.0, rank=1))
    assert walk_relevant(ev("phase", 1.0, rank=5, name="x", state="begin"))
    assert not walk_relevant(ev("meta", 1.0, team="a"))
    assert walk_relevant(ev("meta", 1.0, progress="none"))


def test_memory_stays_bounded_by_the_context():
    """A long job: the fold keeps the recent segments and records, not the history."""
    fold = TimelineFold(CFG, 0)
    for k in range(20):
        fold.add([ev("step", 1.0 + k * 100 + i, step=k * 100 + i + 1, tokens=1) for i in range(100)])
        end = int((k + 1) * 100 * 1000)
        fold.advance(end - 5_000, end - 20_000)
    assert len(fold.w.steps) < 40 and len(fold.w.seg_start) < 80
    tl = fold.timeline(2_000_000)
    assert tl.summary.n_steps == 2000 and tl.summary.valid_tokens == 2000


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams(), st.integers(0, 200_000))
def test_watcher_folded_poll_by_poll_judges_as_a_fresh_view(stream, ahead_ms):
    """A watcher's view fed poll by poll (its timeline folded, late events refolded) decides as
    a view given every event at once, at every poll."""
    from costexporter.services.watcher import JobView, WatchConfig, decide

    cfg = WatchConfig(booking=CFG, heartbeat_timeout_s=60.0)
    arrival, cuts = stream
    view = JobView("j")
    prev = 0
    for cut in cuts:
        view.fold(arrival[prev:cut])
        fresh = JobView("j")
        fresh.fold(arrival[:cut])
        prev = cut
        now = max(e.ts for e in arrival[:cut]) + ahead_ms / 1000
        assert decide(view, now, cfg).to_dict() == decide(fresh, now, cfg).to_dict()
    assert len(view.walk) == sum(walk_relevant(e) for e in arrival[:prev])  # no heartbeats kept


def test_a_silent_rank_does_not_hold_rank_0s_walk_back():
    """Rank 1 went quiet (hung, or heartbeats far apart) while rank 0 steps on: the watcher's
    fold walks rank 0's steps for good as they settle, so each poll re-walks about a second of
    them, not the whole two minutes of lag; rank 1's phases still wait for rank 1."""
    from costexporter.services.watcher import JobView, WatchConfig, decide

    cfg = WatchConfig(booking=CFG, heartbeat_timeout_s=600.0)
    view = JobView("j")
    seen = [ev("run", 1000.0, seq=0, state="start"), ev("heartbeat", 1000.0, rank=1, seq=1)]
    seen.append(ev("phase", 1000.5, rank=1, seq=2, name="eval", state="begin"))
    view.fold(seen)
    for k in range(1, 300):
        batch = [ev("step", 1000.0 + k, seq=2 + k, step=k, tokens=1)]
        view.fold(batch)
        seen += batch
        fresh = JobView("j")
        fresh.fold(seen)
        now = 1000.0 + k + 0.5
        assert decide(view, now, cfg).to_dict() == decide(fresh, now, cfg).to_dict()
        f = view.timeline_fold
        assert sum(e.rank == 0 for e in f.pending) <= 2  # rank 0's last second or so
        if k < 25:  # rank 1's open phase waits for rank 1 (at most the watcher's 30 s of lag)
            assert [e.rank for e in f.pending if e.rank != 0] == [1]
    assert view.rebuilds == 0


def test_the_rollback_floor_is_the_oldest_reachable_checkpoints_record():
    """With `rollback_checkpoints` = 2: no floor until two checkpoints saved valid steps; then the
    record of the older one; a resume drops the checkpoints of the steps it voids (the floor
    stays where it was reached: its entries are gone), and a checkpoint of a step no longer
    valid never counts. Stored and loaded, the fold keeps them."""
    cfg = dataclasses.replace(CFG, rollback_checkpoints=2)
    fold = TimelineFold(cfg, 1_000_000)
    events, t, seq = [ev("run", 1000.0, state="start")], 1000.0, 1

    def steps(first: int, last: int) -> None:
        nonlocal t, seq
        for n in range(first, last + 1):
            t += 1
            seq += 1
            events.append(ev("step", t, seq=seq, step=n))

    def checkpoint(step: int) -> None:
        nonlocal t, seq
        events.append(ev("phase", t + 0.2, seq=seq + 1, name="checkpoint", state="begin"))
        events.append(ev("phase", t + 0.5, seq=seq + 2, name="checkpoint", state="end", step=step))
        t, seq = t + 0.5, seq + 2

    def floor() -> int | None:
        fold.add(events)
        events.clear()
        fold.advance(int(t * 1000) + 1, 0)
        return fold.timeline(int(t * 1000) + 2).rollback_floor

    steps(1, 10)
    checkpoint(10)
    assert floor() is None  # one checkpoint: a resume may still go back to the start
    steps(11, 20)
    checkpoint(20)
    assert floor() == 9  # record of step 10
    steps(21, 30)
    checkpoint(99)  # saves no valid step: not a checkpoint a resume can come back to
    checkpoint(30)
    assert floor() == 19
    events.append(ev("run", t + 1, seq=seq + 5, state="resume", step=20))
    seq += 5
    t += 1
    assert floor() is None  # the checkpoint of step 30 is voided: only 20 is left
    steps(21, 25)
    checkpoint(25)
    blob = dump_fold(fold, "j")
    fold, _ = load_fold(blob, cfg, "j")
    assert floor() == 19  # step 20's record again (the resumed run's step 25 is record 34)


OBSERVATIONS = st.lists(
    st.tuples(st.booleans(), st.sampled_from(["checkpoint", "eval", "startup"]), st.integers(0, 400_000)),
    max_size=30,
)


@settings(max_examples=200, deadline=None)
@given(before=OBSERVATIONS, after=OBSERVATIONS)
def test_an_allowances_copy_is_independent_of_its_original_both_ways(before, after):
    """A view's copy shares the learned durations until either side learns one more: each side
    then answers as an Allowances fed only its own observations (the fold's view must never move
    the fold's allowances, nor the fold a timeline already handed out)."""
    from costexporter.core.booking import Allowances

    cfg = BookingConfig()

    def fed(obs):
        a = Allowances(cfg)
        for _, name, d in obs:
            a.observe(name, 0, d)
        return a

    original = fed([(True, n, d) for _, n, d in before])
    copy = original.copy()
    for to_copy, name, d in after:
        (copy if to_copy else original).observe(name, 0, d)
    mine = fed(before + [x for x in after if not x[0]])
    theirs = fed(before + [x for x in after if x[0]])
    for name in ("checkpoint", "eval", "startup"):
        assert original.current(name) == mine.current(name)
        assert copy.current(name) == theirs.current(name)
        assert original._durations.get(name) == mine._durations.get(name)
        assert copy._durations.get(name) == theirs._durations.get(name)


@settings(max_examples=300, deadline=None)
@given(
    segs=st.lists(
        st.tuples(st.integers(1, 5_000), st.sampled_from(list(Regime)), st.integers(-1, 12)), max_size=90
    ),
    voided=st.sets(st.integers(0, 9)),
    base=st.integers(0, 3),
)
def test_a_short_walks_segments_in_python_are_numpys(segs, voided, base):
    """`_segments` has a plain-Python path for the short walks a watcher views every poll and a
    numpy one for long walks: both mark the same voided steps and merge the same neighbours."""
    from costexporter.core import fold
    from costexporter.core.booking import StepRecord
    from costexporter.core.fold import _segments, _Walk

    w = _Walk(BookingConfig(), 0)
    t = 0
    w.seg_start, w.seg_regime, w.seg_step = [NEG_INF], [Regime.UNASSIGNED], [-1]
    for d, r, s in segs:
        t += d
        w.seg_start.append(t)
        w.seg_regime.append(int(r))
        w.seg_step.append(s)
    w.steps = [StepRecord(i, i, 0, voided=i in voided) for i in range(10)]
    w.step_base = base
    saved = fold.SHORT_WALK
    try:
        fold.SHORT_WALK = 10**9
        py = _segments(w)
        fold.SHORT_WALK = 0
        vec = _segments(w)
    finally:
        fold.SHORT_WALK = saved
    assert py[0].tolist() == vec[0].tolist() and py[1].tolist() == vec[1].tolist()
    assert py[0].dtype == vec[0].dtype and py[1].dtype == vec[1].dtype
    # ... and where the timeline is decided until: the first PENDING segment's start, both ways.
    from costexporter.core import booking

    saved = booking.SHORT_WALK
    try:
        booking.SHORT_WALK = 10**9
        d_py = booking.decided_until_ms(py[0], py[1], None, 123)
        booking.SHORT_WALK = 0
        d_vec = booking.decided_until_ms(py[0], py[1], None, 123)
    finally:
        booking.SHORT_WALK = saved
    starts, regimes = py[0].tolist()[:-1], py[1].tolist()
    pending = [b for b, r in zip(starts, regimes, strict=True) if r == Regime.PENDING]
    assert d_py == d_vec == (pending[0] if pending else 123)


def test_the_regime_at_a_time_is_that_of_the_millisecond_ending_there():
    """`Timeline.regime_at`, what the agent and the watcher ask of a live timeline: at a step's
    time, the interval the step closed; outside the segments, None."""
    events = [ev("run", 1000.0, seq=0, state="start")]
    events += [ev("step", 1000.0 + k, seq=k, step=k, tokens=1) for k in range(1, 40)]
    tl = build_timeline(
        events, dataclasses.replace(CFG, liveness_timeout_max_s=600.0), 1_000_000, 1_200_000, final=False
    )
    assert tl.regime_at(1_001_000) == Regime.OVERHEAD  # the startup the first step closed
    assert tl.regime_at(1_030_000) == Regime.STEP
    assert tl.regime_at(1_030_001) == Regime.STEP
    assert tl.regime_at(1_200_000) == Regime.STALL  # 161 s without a step, past the threshold
    assert tl.regime_at(NEG_INF) is None
