"""The run model: runs, resumes, clean ends and crash tails, against a truth computed from the
story a trainer lives (not from the walk's rules).

A story is a job's runs; a run is its attempts; an attempt starts fresh, restarts after a crash
(steps again from a checkpoint, said or not) or declares `run resume K`, posts steps and heartbeats,
and ends cleanly or goes silent. The truth:

* the valid steps of a run are its trajectory: attempt j's steps (k_j, e_j] stay valid up to the
  lowest checkpoint a later attempt of the same run came back to; a new run after a clean end
  is a trajectory of its own;
* the job holds its GPUs from its start to each clean end, and to `last sign of life + the
  liveness timeout` of an attempt that went silent for longer; what lies between is outside it.

Replay (`build_timeline` over every event) and the live fold (folded in arbitrary rounds) must
both say exactly that.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from costexporter.core.booking import (
    NEG_INF,
    POS_INF,
    BookingConfig,
    Regime,
    build_timeline,
)
from costexporter.core.fold import TimelineFold
from costexporter.core.model import Event
from costexporter.core.timeutil import to_ms

CFG = BookingConfig(stall_floor_s=5.0, stall_window=8, liveness_timeout_s=60.0, liveness_timeout_max_s=150.0)
HEARTBEAT_S = 10.0
START = 1_000.0


@dataclasses.dataclass
class Story:
    events: list[Event]
    valid: list[int]  # the valid step numbers, in posting order
    completed: int
    outside: list[tuple[int, int]]  # [a, b) outside the job after its start (ms)
    end_ms: int  # where the input ends
    job_end: int | None  # the job's end: its clean end or its lapse (None: it runs)
    lapsed: bool


class _Poster:
    def __init__(self, beats: bool) -> None:
        self.events: list[Event] = []
        self.beats = beats
        self.t = START
        self.last_sign = START  # the registration is the first sign of life
        self.beaten = False  # a heartbeat was posted: the job's timeout is the shorter one

    def post(self, kind: str, **fields: object) -> None:
        self.events.append(Event(kind, "j", to_ms(self.t), 0, "s", len(self.events), dict(fields)))
        self.last_sign = self.t
        self.beaten = self.beaten or kind == "heartbeat"

    def timeout_s(self) -> float:
        return CFG.liveness_timeout_s if self.beaten else CFG.liveness_timeout_max_s

    def wait(self, seconds: float) -> None:
        """Time passes, the process alive: heartbeats every HEARTBEAT_S where it beats."""
        end = self.t + seconds
        nxt = self.t + HEARTBEAT_S
        while self.beats and nxt < end:
            self.t = nxt
            self.post("heartbeat")
            nxt += HEARTBEAT_S
        self.t = end


@st.composite
def stories(draw) -> Story:
    p = _Poster(draw(st.booleans()))
    outside: list[tuple[float, float]] = []
    completed = 0
    # Each run's attempts as (the checkpoint it came back to, the steps it posted).
    runs: list[list[tuple[int, list[int]]]] = [[]]
    fresh = True  # no step in the current run since its start

    ended, end_at = False, START  # the last attempt ended cleanly, then
    silent_since: float | None = None  # the last attempt went silent (its last sign of life)
    for i in range(draw(st.integers(1, 6))):
        if i == 0:
            how = "fresh"
        else:
            choices = ["fresh", "resume", "resume_after_start"] if ended else ["restart", "resume"]
            how = draw(st.sampled_from(choices))
        p.t += 1.0
        if silent_since is not None and p.t - silent_since > p.timeout_s():
            outside.append((silent_since + p.timeout_s(), p.t))  # the crash tail ended at the lapse
        elif ended:
            outside.append((end_at, p.t))
        if how in ("fresh", "resume_after_start"):
            p.post("run", state="start")
            if ended:  # a start after a clean end: a new run
                runs.append([])
                fresh = True
        elif how == "restart":  # after a crash: steps again from a checkpoint it does not declare
            p.post("run", state="start")
        if how.startswith("resume") and fresh and len(runs) > 1:
            runs.pop()  # a resume before its run's first step: the run before goes on
            fresh = False
        top = max((s for _k, steps in runs[-1] for s in steps), default=0)
        k = 0 if how == "fresh" else draw(st.integers(0, top))
        if how.startswith("resume"):
            p.post("run", state="resume", step=k)
            fresh = False
        steps = []
        for n in range(k + 1, k + 1 + draw(st.integers(0, 6))):
            p.wait(draw(st.sampled_from([1.0, 2.0, 4.0])))
            p.post("step", step=n, tokens=1)
            steps.append(n)
            fresh = False
        completed += len(steps)
        if how == "restart" and not steps:
            k = top  # a restart that posted no step redid nothing anyone can tell
        runs[-1].append((k, steps))
        ending = draw(st.sampled_from(["end", "crash", "crash"]))
        p.wait(draw(st.sampled_from([0.5, 3.0, 30.0])))
        if ending == "end":
            p.post("run", state="end")
            ended, silent_since, end_at = True, None, p.t
        else:
            ended, silent_since = False, p.last_sign
        p.t += draw(
            st.sampled_from([2.0, 40.0, 90.0, 200.0, 400.0])
        )  # until the next attempt, or the input's end
    # A run's valid steps are its trajectory: each attempt's steps up to the lowest checkpoint a
    # later attempt of the run came back to.
    valid = []
    for attempts in runs:
        for j, (_k, steps) in enumerate(attempts):
            keep = min((k for k, _ in attempts[j + 1 :]), default=None)
            valid.extend(s for s in steps if keep is None or s <= keep)
    end_ms = to_ms(p.t)
    job_end: int | None = None
    lapsed = False
    if ended:
        job_end = to_ms(end_at)
        outside.append((end_at, p.t))
    elif silent_since is not None and p.t - silent_since > p.timeout_s():
        job_end, lapsed = to_ms(silent_since + p.timeout_s()), True
        outside.append((silent_since + p.timeout_s(), p.t))
    return Story(
        p.events,
        valid,
        completed,
        [(to_ms(a), to_ms(b)) for a, b in outside if b > a],
        end_ms,
        job_end,
        lapsed,
    )


def _outside(bounds: np.ndarray, regime: np.ndarray, start: int, end: int) -> list[tuple[int, int]]:
    out = []
    for i in np.flatnonzero(regime == Regime.UNASSIGNED).tolist():
        a, b = max(int(bounds[i]), start), min(int(bounds[i + 1]), end)
        if b > a:
            out.append((a, b))
    return out


def _check(tl, story: Story) -> None:
    start = to_ms(START)
    steps = tl.steps
    assert len(steps) == story.completed
    assert [s.step for s in steps if not s.voided] == story.valid
    assert sum(s.voided for s in steps) == story.completed - len(story.valid)
    assert tl.end_ms == story.job_end
    assert tl.lapsed == story.lapsed
    assert _outside(tl.bounds, tl.regime, start, story.end_ms) == story.outside


@given(stories())
@settings(max_examples=300, deadline=None)
def test_replay_books_runs_resumes_and_crash_tails_as_the_trainer_lived_them(story: Story) -> None:
    tl = build_timeline(story.events, CFG, to_ms(START), story.end_ms, final=True)
    _check(tl, story)


@given(stories(), st.lists(st.floats(0.0, 1.0), max_size=6))
@settings(max_examples=300, deadline=None)
def test_the_live_fold_books_them_alike_in_any_rounds(story: Story, cuts: list[float]) -> None:
    start = to_ms(START)
    fold = TimelineFold(CFG, start)
    added = 0
    kept_from = start
    for c in sorted(cuts):
        upto = start + int(c * (story.end_ms - start))
        n = sum(e.ts_ms <= upto for e in story.events)
        fold.add(story.events[added:n])
        added = max(added, n)
        kept_from = max(kept_from, upto - 30_000)
        fold.advance(kept_from, kept_from)
    fold.add(story.events[added:])
    tl = fold.timeline(story.end_ms, final=True)
    assert tl is not None
    # The fold keeps the recent step records only: the rest is in its summary.
    assert tl.summary is not None and tl.summary.n_steps == story.completed
    assert tl.summary.n_steps - tl.summary.n_voided == len(story.valid)
    assert tl.end_ms == story.job_end and tl.lapsed == story.lapsed
    clipped = [(max(a, kept_from), b) for a, b in story.outside if b > kept_from]
    assert _outside(tl.bounds, tl.regime, kept_from, story.end_ms) == clipped


def test_a_rerun_after_a_clean_end_voids_nothing_and_a_step_back_inside_a_run_does() -> None:
    """torchrun twice under one name: 30 steps, `run end`, `run start`, 30 steps again: 60
    completed, none voided. Inside one run (a crash, a restart that posts steps again from 1
    without saying so) the steps come back: the first 30 are voided."""

    def story(between: list[tuple[str, dict]]) -> list[Event]:
        evs, t = [], START
        for k in range(1, 31):
            evs.append(Event("step", "j", to_ms(t + k), 0, "s", k, {"step": k}))
        t += 31
        for kind, f in between:
            t += 1
            evs.append(Event(kind, "j", to_ms(t), 0, "s2", len(evs), f))
        for k in range(1, 31):
            evs.append(Event("step", "j", to_ms(t + k), 0, "s2", 100 + k, {"step": k}))
        return [Event("run", "j", to_ms(START), 0, "s", 0, {"state": "start"}), *evs]

    rerun = build_timeline(
        story([("run", {"state": "end"}), ("run", {"state": "start"})]), CFG, to_ms(START), to_ms(START + 100)
    )
    assert (len(rerun.steps), sum(s.voided for s in rerun.steps)) == (60, 0)
    restart = build_timeline(story([("run", {"state": "start"})]), CFG, to_ms(START), to_ms(START + 100))
    assert (len(restart.steps), sum(s.voided for s in restart.steps)) == (60, 30)
    # A declared resume after a clean end goes on with the run it resumes: HF's
    # `resume_from_checkpoint` (`run start`, then `run resume 10`) voids the 20 steps it redoes.
    hf = build_timeline(
        story(
            [("run", {"state": "end"}), ("run", {"state": "start"}), ("run", {"state": "resume", "step": 0})]
        ),
        CFG,
        to_ms(START),
        to_ms(START + 100),
    )
    assert (len(hf.steps), sum(s.voided for s in hf.steps)) == (60, 30)


def test_a_crash_tail_ends_at_the_liveness_timeout_and_the_time_after_is_outside_the_job() -> None:
    """A job that beats, then crashes at t=100 s (its last heartbeat): its tail is booked as
    progress stopped up to 100 + 60 s, then the GPU is no longer the job's; without heartbeats
    (an older reporter) the longest timeout applies."""
    for beats, timeout in ((True, CFG.liveness_timeout_s), (False, CFG.liveness_timeout_max_s)):
        evs = [Event("run", "j", to_ms(START), 0, "s", 0, {"state": "start"})]
        for k in range(1, 11):
            evs.append(Event("step", "j", to_ms(START + 5 * k), 0, "s", k, {"step": k}))
        if beats:
            evs += [Event("heartbeat", "j", to_ms(START + 10 * k), 0, "s", 20 + k, {}) for k in range(1, 11)]
        end = to_ms(START + 1000)
        tl = build_timeline(evs, CFG, to_ms(START), end)
        last_sign = START + 100 if beats else START + 50
        assert tl.lapsed and tl.end_ms == to_ms(last_sign + timeout)
        assert tl.regime_at(to_ms(START + 50) + 1) == Regime.STALL  # the crash tail: waste
        assert tl.regime_at(tl.end_ms) == Regime.STALL
        assert tl.regime_at(tl.end_ms + 1) == Regime.UNASSIGNED
        assert tl.bounds[-1] == POS_INF and tl.bounds[0] == NEG_INF
