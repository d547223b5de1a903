"""The booking rules (docs/background.md, the booking rules; docs/accounting.md).

Two halves:

* `build_timeline` walks a job's events (few: thousands, not millions) in order and cuts time
  into segments with a *regime*: overhead (a declared phase or the startup within its
  allowance), a step that completes (rule 2), progress stopped (rule 4), or outside the job.
  Steps later voided by a resume turn their segments' regime to VOID (rule 5).
* `book` splits every slice of every GPU at those segment bounds, vectorized, and maps
  (regime, band) to a category with one lookup table.

Time is int64 milliseconds throughout, so every GPU-millisecond lands in exactly one category
and the sums are exact.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np
import numpy.typing as npt

from costexporter.core import bands as bands_mod
from costexporter.core import bandtable, shares
from costexporter.core.model import NO_BAND, VALID_CATEGORIES, Category, Event
from costexporter.core.profiles import Profile

NEG_INF = np.iinfo(np.int64).min // 4
POS_INF = np.iinfo(np.int64).max // 4


class Regime(IntEnum):
    OVERHEAD = 0  # rules 1 and 3, and the tail of a cleanly ended run
    STEP = 1  # rule 2: inside a step that completes
    STALL = 2  # rule 4: progress stopped
    VOID = 3  # rule 5: inside a step that a resume voided
    UNASSIGNED = 4  # outside the job (before registration, after the run's end)
    PENDING = 5  # live only: after the last progress point, not decided yet (never booked)
    BAND = 6  # a job without steps (a Kubernetes pod's GPUs): booked by band alone
    UNREAD = 7  # the job holds its GPUs but its events cannot be read (a key of the wrong type)


@functools.lru_cache(maxsize=8)
def category_table(bands: bandtable.BandTable) -> np.ndarray:
    """CATEGORY[regime, band + 1] from the band table's rows (column 0 is NO_BAND: no sample,
    unobserved). Inside a step a resume voided, a valid category books as rolled_back."""
    table = np.zeros((len(Regime), len(bands) + 1), np.int8)
    table[:, 0] = Category.UNOBSERVED
    table[Regime.OVERHEAD, 1:] = Category.OVERHEAD
    for r in bands.rows:
        c = r.code + 1
        table[Regime.STEP, c] = r.step
        table[Regime.STALL, c] = r.stall
        table[Regime.VOID, c] = Category.ROLLED_BACK if r.step in VALID_CATEGORIES else r.step
        table[Regime.BAND, c] = r.stepless  # a job without steps (a Kubernetes pod's GPUs)
    table[Regime.UNASSIGNED, :] = Category.UNASSIGNED
    table[Regime.UNREAD, :] = Category.UNOBSERVED  # held, but nothing says what it was doing
    table[Regime.PENDING, 1:] = Category.OVERHEAD  # placeholder: pending time is never booked
    table.setflags(write=False)
    return table


@dataclass(frozen=True, slots=True)
class BookingConfig:
    """Thresholds and allowances of the booking rules (seconds): the stall threshold
    `max(stall_k x p95 of recent step durations, stall_floor_s)` and the phase allowances."""

    stall_k: float = 5.0
    stall_floor_s: float = 60.0
    stall_window: int = 100
    stall_percentile: float = 95.0
    checkpoint_allowance_s: float = 15 * 60.0
    eval_allowance_s: float = 15 * 60.0
    startup_allowance_s: float = 30 * 60.0
    phase_allowance_s: float = 15 * 60.0  # any other declared phase
    allowance_k: float = 3.0  # learned allowance: k x median of the job's own durations
    # A run that stops without `run end` is over once rank 0 shows no sign of life (a step, a run
    # event, a heartbeat in its events stream) for this long: its claim on its GPUs ends there.
    liveness_timeout_s: float = 600.0
    # ... and the longest it can be: a job's meta may lengthen the timeout up to here, and a job
    # whose rank 0 posts no heartbeat where the agents read (an older reporter) gets this one.
    liveness_timeout_max_s: float = 6 * 3600.0

    def liveness_ms(self, beats: bool) -> int:
        """How long rank 0 may be silent before its run is taken to be over."""
        return int((self.liveness_timeout_s if beats else self.liveness_timeout_max_s) * 1000)

    gap_intervals: float = 3.0  # a sample gap longer than this many intervals is unobserved
    grid_s: float = 1.0
    # A resume reaches back at most this many declared checkpoints (a trainer keeps its last few):
    # the live agent's rollback index keeps entries back to the oldest of them only.
    rollback_checkpoints: int = 5

    def default_allowance_ms(self, phase: str) -> int:
        s = {
            "checkpoint": self.checkpoint_allowance_s,
            "eval": self.eval_allowance_s,
            "startup": self.startup_allowance_s,
        }.get(phase, self.phase_allowance_s)
        return int(s * 1000)


# The name the walk's own startup allowance learns under, in an `Allowances` of its own (never
# the declared phases' one, so no phase name can share or skew it).
RUN_STARTUP = "startup"


class Allowances:
    """Per-phase allowances, learned as k x the median of the job's own completed durations
    (at least the stall floor).

    Only occurrences that finished within the allowance in force teach it, so a hung
    checkpoint cannot stretch the allowance of the next one.
    """

    def __init__(self, cfg: BookingConfig) -> None:
        self.cfg = cfg
        self._durations: dict[str, list[int]] = {}
        self._history: dict[str, tuple[list[int], list[int]]] = {}  # name -> (since_ms, allowance)
        self._current: dict[str, int] = {}  # `current` until the next `observe` of the name
        self._shared = False  # the lists are shared with a `copy`: copied before a write

    def copy(self) -> Allowances:
        """An independent copy that shares the learned durations until either side observes one
        (a fold's view copies its walk every poll; the lists grow with the job's phases)."""
        c = Allowances(self.cfg)
        c._durations, c._history, c._current = self._durations, self._history, dict(self._current)
        c._shared = self._shared = True
        return c

    def _own(self) -> None:
        if self._shared:
            self._durations = {k: list(v) for k, v in self._durations.items()}
            self._history = {k: (list(a), list(b)) for k, (a, b) in self._history.items()}
            self._shared = False

    def current(self, name: str) -> int:
        got = self._current.get(name)
        if got is not None:
            return got
        d = self._durations.get(name)
        if not d:
            got = self.cfg.default_allowance_ms(name)
        else:
            # Never below the stall floor: a 5-second first startup must not make every restart waste.
            learned = int(self.cfg.allowance_k * float(np.median(d)))
            got = max(learned, int(self.cfg.stall_floor_s * 1000))
        self._current[name] = got  # a watcher asks for it on every job's view, every poll
        return got

    def observe(self, name: str, at_ms: int, duration_ms: int) -> None:
        if duration_ms <= self.current(name):
            self._own()
            self._current.pop(name, None)
            self._durations.setdefault(name, []).append(duration_ms)
            since, values = self._history.setdefault(name, ([NEG_INF], [self.cfg.default_allowance_ms(name)]))
            since.append(at_ms)
            values.append(self.current(name))

    def at(self, name: str, t_ms: np.ndarray) -> np.ndarray:
        """The allowance that was in force at each time (for the checkpoint band)."""
        since, values = self._history.get(name, ([NEG_INF], [self.cfg.default_allowance_ms(name)]))
        idx = np.searchsorted(np.asarray(since), np.asarray(t_ms), "right") - 1
        return np.asarray(values, np.int64)[idx]


@dataclass(slots=True)
class StepRecord:
    step: int
    ts_ms: int
    tokens: int
    voided: bool = False
    voided_ms: int | None = None  # when the resume that voided it was seen


@dataclass(slots=True)
class StepSummary:
    """What a folded timeline (`fold.py`) says about steps beyond its recent `steps`
    (`Timeline.summary`)."""

    n_steps: int  # every step record so far
    n_voided: int
    valid_tokens: int
    tokens_before: int  # tokens of the records before `Timeline.step_base` (voided ones too)
    last_step: StepRecord | None
    # Every voided record: (record index, record, the previous record's ts or None for the first)
    voided: list[tuple[int, StepRecord, int | None]] = field(default_factory=list)


@dataclass(slots=True)
class Timeline:
    """A job's regime segments: segment i covers [bounds[i], bounds[i+1])."""

    bounds: np.ndarray  # int64, starts with NEG_INF, ends with POS_INF
    regime: np.ndarray  # int8 per segment (adjacent segments differ)
    steps: list[StepRecord]
    resumes: list[tuple[int, int, int]]  # (ts_ms, resumed-from step K, steps voided)
    start_ms: int  # the job's first registration (or first event)
    end_ms: int | None  # the last run end, when the job ended cleanly
    rank_overhead: dict[int, list[tuple[int, int]]]  # rank > 0: its own phases within allowance
    allowances: Allowances
    last_checkpoint_step: int | None = None
    last_checkpoint_ms: int | None = None  # when the last checkpoint that saved a step ended
    phases_overrun: list[tuple[str, int, int]] = field(default_factory=list)
    crashes: list[tuple[int, str]] = field(default_factory=list)  # rank 0's crash records (ms, exit)
    stall_threshold_ms: int = 60_000  # in force at the end of the job's events
    # `end_ms` is a lapse (rank 0 silent for the liveness timeout, no `run end`), not a clean end
    lapsed: bool = False
    decided_until_ms: int = POS_INF  # live: where the first PENDING segment starts
    # A folded timeline (`fold.TimelineFold`) keeps only recent step records: `steps[0]` is record
    # `step_base`, and `summary` (a `StepSummary`) counts the rest.
    step_base: int = 0
    summary: StepSummary | None = None
    # The oldest step record a resume can still reach back to (the record of the oldest of the
    # last `rollback_checkpoints` checkpoints on the valid steps); None: any of them.
    rollback_floor: int | None = None

    def regime_at(self, t_ms: int) -> int | None:
        """The regime of the time just before `t_ms` (the millisecond that ends there): what the
        job was doing at `t_ms` as a live reader asks it. None outside the segments."""
        i = int(np.searchsorted(self.bounds, t_ms - 1, "right")) - 1
        return int(self.regime[i]) if 0 <= i < self.regime.size else None


_PENDING = int(Regime.PENDING)  # numpy compares an array with an int, not an IntEnum, at once
SHORT_WALK = 64  # segments: below this, Python's list operations beat numpy's per-call cost


def decided_until_ms(bounds: np.ndarray, regime: np.ndarray, job_end: int | None, end_ms: int) -> int:
    """A timeline's `decided_until_ms`: where its first PENDING segment starts, else the job's
    end, else `end_ms`. A watcher's timeline has a few segments: looked up in Python."""
    if regime.size < SHORT_WALK:
        r = regime.tolist()
        i = r.index(_PENDING) if _PENDING in r else None
    else:
        found = np.flatnonzero(regime == _PENDING)
        i = int(found[0]) if found.size else None
    if i is not None:
        return int(bounds[i])
    return job_end if job_end is not None else end_ms


def with_unread(tl: Timeline, spans: list[tuple[int, int]]) -> Timeline:
    """`tl` with the stretches `spans` ([a, b), b up to POS_INF) UNREAD: the job's events could
    not be read then (its stream was a key of another type), so its GPUs' time there is
    `unobserved`, decided (never pending), and whatever its events say of that time later moves
    none of it. Its steps and figures stay what was read."""
    if not spans:
        return tl
    cuts = sorted({*tl.bounds.tolist(), *(x for a, b in spans for x in (a, b))})
    starts: list[int] = []
    regimes: list[int] = []
    for a, b in itertools.pairwise(cuts):
        inside = any(x <= a and b <= y for x, y in spans)
        r = Regime.UNREAD if inside else tl.regime_at(a + 1)
        if r is None:
            r = Regime.UNASSIGNED
        if not regimes or regimes[-1] != r:
            starts.append(a)
            regimes.append(int(r))
    open_ = any(b >= POS_INF for _, b in spans)
    return dataclasses.replace(
        tl,
        bounds=np.asarray([*starts, POS_INF], np.int64),
        regime=np.asarray(regimes, np.int8),
        end_ms=None if open_ else tl.end_ms,
        lapsed=False if open_ else tl.lapsed,
        decided_until_ms=POS_INF if open_ else tl.decided_until_ms,
    )


def active_intervals(tl: Timeline) -> tuple[np.ndarray, np.ndarray]:
    """Maximal stretches where the job runs (regime other than UNASSIGNED): between a
    registration or run start and the run's end."""
    active = tl.regime != Regime.UNASSIGNED
    edges = np.diff(np.concatenate([[0], active.astype(np.int8), [0]]))
    first = np.flatnonzero(edges == 1)
    last = np.flatnonzero(edges == -1)
    return tl.bounds[first], tl.bounds[last]


def intersect(a: int, b: int, starts: np.ndarray, ends: np.ndarray) -> list[tuple[int, int]]:
    """[a, b) ∩ the union of sorted disjoint [starts, ends)."""
    lo = np.maximum(starts, a)
    hi = np.minimum(ends, b)
    keep = hi > lo
    return list(zip(lo[keep].tolist(), hi[keep].tolist(), strict=True))


def percentile(values: list[int] | deque[int], q: float) -> float:
    """`np.percentile(values, q)` (its default, linear method) to the last bit, in plain Python:
    for the few hundred values of a step window, numpy's call overhead costs several times the
    work (a watcher asks once per job per poll)."""
    a = sorted(values)  # as floats, the same order: only the values read are converted
    n = len(a)
    vi = (n - 1) * (q / 100)
    if vi >= n - 1:
        return float(a[-1])
    if vi < 0:
        return float(a[0])
    lo = int(vi // 1)
    t = vi - lo
    x, y = float(a[lo]), float(a[lo + 1])
    d = y - x
    return y - d * (1 - t) if t >= 0.5 else x + d * t


def stall_threshold_ms(durations_ms: list[int] | deque[int], cfg: BookingConfig) -> int:
    """max(k x p95 of the last step durations, floor)."""
    floor = int(cfg.stall_floor_s * 1000)
    if not durations_ms:
        return floor
    p = percentile(durations_ms, cfg.stall_percentile)
    return max(int(cfg.stall_k * p), floor)


def _intervals_of_phases(
    events: list[Event], allowances: Allowances, end_ms: int
) -> tuple[list[tuple[int, int]], list[tuple[str, int, int]], tuple[int, int] | None]:
    """Overhead intervals [begin, begin + allowance) ∩ [begin, end) of one rank's phases.

    Returns the intervals (sorted, merged), the phases that overran (name, begin, end) and
    the (step, end ms) of the last checkpoint that declared the step it saved.
    """
    open_: dict[str, int] = {}
    out: list[tuple[int, int]] = []
    overrun: list[tuple[str, int, int]] = []
    last_ckpt: tuple[int, int] | None = None

    def close(name: str, begin: int, end: int) -> None:
        allow = allowances.current(name)
        out.append((begin, min(end, begin + allow)))
        if end - begin > allow:
            overrun.append((name, begin, end))
        allowances.observe(name, end, end - begin)

    for ev in events:
        name = ev.str_field("name")
        t = ev.ts_ms
        if ev.get("state") == "begin":
            if name in open_:  # a begin without its end: the first one ends here
                close(name, open_.pop(name), t)
            open_[name] = t
        elif name in open_:
            close(name, open_.pop(name), t)
            if name == "checkpoint" and (step := ev.opt_int_field("step")) is not None:
                last_ckpt = (step, t)
    for name, begin in open_.items():
        close(name, begin, max(end_ms, begin))
    return _merge(sorted(out)), overrun, last_ckpt


def _merge(ivals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for a, b in ivals:
        if b <= a:
            continue
        if merged and a <= merged[-1][1]:
            if b > merged[-1][1]:
                merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    return merged


def dated_until(events: list[Event], end_ms: int) -> list[Event]:
    """The events live booking decides with at `end_ms`: those dated up to it (meta always). One
    dated later may still have earlier events on their way (within the agent's `event_lag_s`);
    deciding with it (a `run end` closing an interval a late step would have split) would book
    differently from an uninterrupted run."""
    return [e for e in events if e.type == "meta" or e.ts_ms <= end_ms]


class Segments:
    """Regime segments as three parallel lists (start, regime, step record), what a walk
    writes: `build_timeline`'s and, incrementally, `fold._Walk`."""

    seg_start: list[int]
    seg_regime: list[int]
    seg_step: list[int]

    def emit(self, a: int, b: int, regime: int, step: int = -1) -> None:
        """Label [a, b): a placeholder segment from b on follows, for the next label."""
        if b <= a:
            return
        ss, sr, sp = self.seg_start, self.seg_regime, self.seg_step
        if ss[-1] == a:  # replace an empty placeholder at the same start
            sr[-1], sp[-1] = regime, step
        elif sr[-1] == regime and sp[-1] == step:
            pass  # contiguous with the same label: extend
        else:
            ss.append(a)
            sr.append(regime)
            sp.append(step)
        ss.append(b)
        sr.append(Regime.UNASSIGNED)
        sp.append(-1)


# How a walk's run stands (`RunWalk.ended`): running (None), ended cleanly, or lapsed.
ENDED = "end"  # rank 0 posted `run end`: a `run start` opens a new run, which voids nothing before it
LAPSED = "lapse"  # rank 0 silent past the liveness timeout: its next sign of life goes on with the run


# The note the readers put on a heartbeat read from a job's heartbeat stream (only the watchers
# read it): the agents never see those, so no walk may count them.
FROM_BEATS = "_beats"


def is_point(ev: Event) -> bool:
    """Whether an event is one of the walk's points: rank 0's steps, run events and heartbeats
    in its events stream (the signs of life that bound a run that stopped without `run end`)."""
    if ev.rank != 0:
        return False
    return ev.type in ("step", "run") or (ev.type == "heartbeat" and FROM_BEATS not in ev.fields)


MAX_CRASHES = 64  # the crash records a timeline keeps (a crash loop's newest)


class RunWalk(Segments):
    """The run rules, one point at a time, shared by `build_timeline`'s walk and the incremental
    `fold._Walk` (which keep their step records apart: a list, a compact stack).

    A run is what a job does between a `run start` and its `run end`. A step at or below one
    completed *in the same run* is an implicit resume (it voids the steps above it); a new
    `run start` after a clean end opens a new run and voids nothing; a declared `run resume K`
    voids the run's valid steps above K. A resume before the run's first step (a trainer
    resuming from a checkpoint posts `run start`, then `run resume K`; or `run resume K` after
    the end) continues the run before it. A run that stops without `run end` lapses once rank 0 has shown
    no sign of life for the liveness timeout: what lies between its last progress and then is
    its crash tail (booked by band, as progress stopped), what follows is outside the job until
    its next sign of life, which carries the same run on."""

    cfg: BookingConfig
    floor_ms: int
    durations: deque[int]
    steps: list[StepRecord]
    resumes: list[tuple[int, int, int]]
    crashes: list[tuple[int, str]]
    run_allow: Allowances
    startup_allow: int
    anchor: int
    in_startup: bool
    startup_from: int
    ended: str | None
    last_alive: int
    beats: bool

    def _start_run(self, cfg: BookingConfig, start_ms: int) -> None:
        self.cfg = cfg
        self.floor_ms = int(cfg.stall_floor_s * 1000)
        self.durations = deque(maxlen=cfg.stall_window)
        self.resumes = []
        self.crashes = []  # rank 0's crash records: (ms, how it ended), the newest MAX_CRASHES
        # The run's own startup (registration or restart to the first step) learns apart from the
        # declared phases: a phase a trainer names `startup` is data, not this allowance.
        self.run_allow = Allowances(cfg)
        self.startup_allow = self.run_allow.current(RUN_STARTUP)
        self.anchor = start_ms
        self.in_startup = True
        self.startup_from = start_ms
        self.ended = None
        self.last_alive = start_ms  # the registration is the first sign of life
        self.beats = False  # rank 0 posted a heartbeat to its events stream
        self.run_fresh = True  # no step since the run's start: a resume continues the run before

    # ---- what each walk keeps its own way -----------------------------------------------------
    def split(self, a: int, b: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """[a, b) into overhead pieces and the rest."""
        raise NotImplementedError

    def record(self, step: int, ts_ms: int, tokens: int) -> int:
        """A completed step, as a valid record; returns its record index."""
        raise NotImplementedError

    def void_above(self, k: int, at_ms: int) -> int:
        """Void the current run's newest valid records while their step is above `k`; returns
        how many."""
        raise NotImplementedError

    def run_top(self) -> int | None:
        """The newest valid step of the current run."""
        raise NotImplementedError

    def new_run(self) -> None:
        """A `run start` after a clean end: the records so far are an earlier run's."""
        raise NotImplementedError

    def merge_run(self) -> None:
        """The current run (no step yet) is the one before it, resumed."""
        raise NotImplementedError

    def with_startup(
        self, ov: list[tuple[int, int]], a: int, b: int
    ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """`split`'s end: the phases' overhead pieces `ov` of [a, b) and the run's startup within
        its allowance, merged; and what they leave of [a, b)."""
        if self.in_startup:
            x, y = max(self.startup_from, a), min(self.startup_from + self.startup_allow, b)
            if y > x:
                ov.append((x, y))
        ov = _merge(sorted(ov))
        rest: list[tuple[int, int]] = []
        cur = a
        for x, y in ov:
            if x > cur:
                rest.append((cur, x))
            cur = max(cur, y)
        if b > cur:
            rest.append((cur, b))
        return ov, rest

    # ---- the rules ------------------------------------------------------------------------------
    def alive_until(self) -> int:
        """Where the run lapses unless rank 0 shows life before."""
        return self.last_alive + self.cfg.liveness_ms(self.beats)

    def close_interval(self, b: int, outcome: str, step_index: int = -1, final: bool = True) -> bool:
        """Book [anchor, b); outcome: 'step', 'orphan' (a restart, a lapse), 'end' or 'tail'
        (`final`: the input has ended, else the tail stays PENDING).

        Returns whether progress had stopped (rule 4) within the interval.
        """
        anchor = self.anchor
        ov, rest = self.split(anchor, b)
        # One piece (most steps: no phase nor startup around them) needs no generator.
        eff = rest[0][1] - rest[0][0] if len(rest) == 1 else sum(y - x for x, y in rest)
        # The threshold is never below the floor: only a longer interval needs the percentile.
        stalled = eff > self.floor_ms and eff > stall_threshold_ms(self.durations, self.cfg)
        if not ov and outcome == "step" and not stalled:  # fast path: one step segment
            self.emit(anchor, b, Regime.STEP, step_index)
            if not self.in_startup:
                self.durations.append(eff)
            return False
        pieces = [(x, y, Regime.OVERHEAD, -1) for x, y in ov]
        if outcome == "step" and not stalled:
            pieces += [(x, y, Regime.STEP, step_index) for x, y in rest]
        elif outcome in ("end", "tail") and not stalled:
            regime = Regime.PENDING if outcome == "tail" and not final else Regime.OVERHEAD
            pieces += [(x, y, regime, -1) for x, y in rest]
        else:
            pieces += [(x, y, Regime.STALL, -1) for x, y in rest]
        for x, y, r, st in sorted(pieces):
            self.emit(x, y, r, st)
        if outcome == "step" and not stalled and not self.in_startup:
            self.durations.append(eff)
        return stalled

    def lapse(self) -> None:
        """The run stopped without `run end`: its crash tail is booked as progress stopped, up to
        where the liveness timeout ran out."""
        at = self.alive_until()
        if self.anchor < at:
            self.close_interval(at, "orphan")
        self.anchor, self.ended = max(self.anchor, at), LAPSED

    def point(self, ev: Event) -> None:
        """One of rank 0's steps, run events or heartbeats, in time order."""
        t = max(ev.ts_ms, self.anchor)
        if self.ended is None and t > self.alive_until():
            self.lapse()
            t = max(t, self.anchor)
        state = ev.get("state") if ev.type == "run" else None
        starts = state in ("start", "resume")
        if self.ended is not None:
            if self.ended == ENDED and not starts:
                return  # nothing books between a run's end and the next start
            new_run = self.ended == ENDED and state == "start"
            self.emit(self.anchor, t, Regime.UNASSIGNED)
            self.anchor, self.ended = t, None
            if starts:
                self.in_startup, self.startup_from = True, t
                self.startup_allow = self.run_allow.current(RUN_STARTUP)
            if new_run:
                self.new_run()
                self.run_fresh = True
        self.last_alive = max(self.last_alive, t)
        if ev.type == "heartbeat" or state == "crash":  # a sign of life, not a progress point
            self.beats = self.beats or ev.type == "heartbeat"
            if state == "crash":  # the trainer's own word that it failed: a stretch's cause
                self.crashes = [*self.crashes[-(MAX_CRASHES - 1) :], (t, str(ev.get("exit") or ""))]
            return
        if ev.type == "step":
            n = ev.int_field("step")
            top = self.run_top()
            if top is not None and n <= top:  # at or below a step of this run: an implicit resume
                self.resumes.append((t, n - 1, self.void_above(n - 1, t)))
            i = self.record(n, t, ev.opt_int_field("tokens") or 0)
            self.run_fresh = False
            self.close_interval(t, "step", i)
            if self.in_startup:
                self.run_allow.observe(RUN_STARTUP, t, t - self.startup_from)
            self.in_startup = False
        elif starts:
            if self.anchor < t:
                self.close_interval(t, "orphan")
            if state == "resume":
                if self.run_fresh:
                    self.merge_run()
                    self.run_fresh = False
                if (k := ev.opt_int_field("step")) is not None:
                    self.resumes.append((t, k, self.void_above(k, t)))
            if not self.in_startup:
                self.in_startup, self.startup_from = True, t
                self.startup_allow = self.run_allow.current(RUN_STARTUP)
        elif state == "end":
            self.close_interval(t, "end")
            self.ended = ENDED
        self.anchor = t

    def finish(self, end_ms: int, final: bool) -> int | None:
        """Close the walk at `end_ms` (the end of the input, or a live round's now); returns the
        job's end (a clean end, or the lapse of a run that stopped), None while it runs."""
        if self.ended is None and end_ms > self.alive_until():
            self.lapse()
        if self.ended is not None:
            return self.anchor
        if end_ms > self.anchor:
            self.close_interval(end_ms, "tail", final=final)
        return None


class _ReferenceWalk(RunWalk):
    """`build_timeline`'s walk over rank 0's points: the reference the incremental `fold._Walk`
    is tested equal to (kept simple rather than fast: a resume scans the records)."""

    def __init__(
        self,
        cfg: BookingConfig,
        allowances: Allowances,
        overhead: list[tuple[int, int]],
        start_ms: int,
    ) -> None:
        self._start_run(cfg, start_ms)
        self.allowances = allowances
        self.overhead, self.ov_starts = overhead, [a for a, _ in overhead]
        self.seg_start: list[int] = [NEG_INF]
        self.seg_regime: list[int] = [Regime.UNASSIGNED]
        self.seg_step: list[int] = [-1]
        self.steps: list[StepRecord] = []
        self.run_from = self.prev_run_from = 0  # the first record of the current run, the one before
        self._top: int | None = None  # the current run's newest valid step

    def split(self, a: int, b: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        overhead = self.overhead
        i = max(bisect.bisect_right(self.ov_starts, a) - 1, 0)
        if (
            not self.in_startup
            and (i >= len(overhead) or overhead[i][1] <= a)
            and (i + 1 >= len(overhead) or overhead[i + 1][0] >= b)
        ):
            return [], [(a, b)]  # the common case: a plain interval between two steps
        ov: list[tuple[int, int]] = []
        while i < len(overhead) and overhead[i][0] < b:
            x, y = max(overhead[i][0], a), min(overhead[i][1], b)
            if y > x:
                ov.append((x, y))
            i += 1
        return self.with_startup(ov, a, b)

    def record(self, step: int, ts_ms: int, tokens: int) -> int:
        self.steps.append(StepRecord(step, ts_ms, tokens))
        self._top = step  # (the newest record is valid, and above the run's others)
        return len(self.steps) - 1

    def _run_newest_first(self) -> Iterator[StepRecord]:
        """The current run's records, newest first (no copy of the list: a step asks every time)."""
        steps = self.steps
        for i in range(len(steps) - 1, self.run_from - 1, -1):
            yield steps[i]

    def void_above(self, k: int, at_ms: int) -> int:
        n = 0
        for s in self._run_newest_first():
            if s.voided:
                continue
            if s.step <= k:
                break
            s.voided, s.voided_ms = True, at_ms
            n += 1
        self._top = self._find_top()
        return n

    def _find_top(self) -> int | None:
        return next((s.step for s in self._run_newest_first() if not s.voided), None)

    def run_top(self) -> int | None:
        return self._top

    def new_run(self) -> None:
        self.prev_run_from, self.run_from = self.run_from, len(self.steps)
        self._top = None

    def merge_run(self) -> None:
        self.run_from = self.prev_run_from
        self._top = self._find_top()


def build_timeline(
    events: list[Event], cfg: BookingConfig, start_ms: int, end_ms: int, *, final: bool = True
) -> Timeline:
    """Walk a job's events (any ranks, any order) into regime segments over [start_ms, end_ms).

    Progress is rank 0's: its steps and run events cut time into intervals; phases posted by
    rank 0 are job-wide, other ranks' phases cover only their own GPU. `final`: the input has
    ended (replay), so the tail after the last progress point is booked; live (`final=False`)
    that tail stays PENDING until a step closes it or progress is seen to have stopped, and
    `decided_until_ms` says where the decided part ends. (Live booking passes only the events
    dated up to `end_ms`: see `dated_until`.)
    """
    events = sorted(events, key=lambda e: (e.ts_ms, e.seq))
    if is_stepless(events):
        return band_timeline(events, cfg, start_ms, end_ms)
    allowances = Allowances(cfg)
    rank0_phases = [e for e in events if e.type == "phase" and e.rank == 0]
    overhead, overrun, last_ckpt = _intervals_of_phases(rank0_phases, allowances, end_ms)
    rank_overhead: dict[int, list[tuple[int, int]]] = {}
    by_rank: dict[int, list[Event]] = {}
    for e in events:
        if e.type == "phase" and e.rank != 0:
            by_rank.setdefault(e.rank, []).append(e)
    for rank, evs in by_rank.items():
        rank_overhead[rank], _, _ = _intervals_of_phases(evs, Allowances(cfg), end_ms)

    walk = _ReferenceWalk(cfg, allowances, overhead, start_ms)
    for ev in events:
        if is_point(ev):
            walk.point(ev)
    job_end = walk.finish(end_ms, final)
    # The last placeholder segment runs to +inf, outside the job.
    seg_start, seg_regime, seg_step = [*walk.seg_start, POS_INF], walk.seg_regime, walk.seg_step
    steps, resumes, durations = walk.steps, walk.resumes, walk.durations

    bounds = np.asarray(seg_start, np.int64)
    regime = np.asarray(seg_regime, np.int8)
    step_idx = np.asarray(seg_step, np.int32)
    voided = np.fromiter((s.voided for s in steps), bool, len(steps))
    is_void = (step_idx >= 0) & (regime == Regime.STEP)
    if is_void.any():
        is_void[is_void] = voided[step_idx[is_void]]
        regime[is_void] = Regime.VOID
    # Adjacent segments of one regime book alike: merge them, so slices are cut only where the
    # category can change (not at every step boundary).
    keep = np.ones(regime.size, bool)
    keep[1:] = regime[1:] != regime[:-1]
    bounds = np.append(bounds[:-1][keep], bounds[-1])
    regime = regime[keep]
    decided_until = decided_until_ms(bounds, regime, job_end, end_ms)

    return Timeline(
        bounds=bounds,
        regime=regime,
        steps=steps,
        resumes=resumes,
        start_ms=start_ms,
        end_ms=job_end,
        rank_overhead=rank_overhead,
        allowances=allowances,
        last_checkpoint_step=last_ckpt[0] if last_ckpt else None,
        last_checkpoint_ms=last_ckpt[1] if last_ckpt else None,
        phases_overrun=overrun,
        crashes=walk.crashes,
        stall_threshold_ms=stall_threshold_ms(durations, cfg),
        decided_until_ms=decided_until,
        lapsed=walk.ended == LAPSED,
    )


STEPLESS_META = ("progress", "none")  # meta field/value of a job that posts no steps


def is_stepless(events: list[Event]) -> bool:
    """A job registered without a trainer (a Kubernetes pod seen through dcgm-exporter) says so
    in its meta; once rank 0 posts a step, the trainer's events win and the step rules apply."""
    field_, value = STEPLESS_META
    declared = any(e.type == "meta" and e.get(field_) == value for e in events)
    return declared and not any(e.type == "step" and e.rank == 0 for e in events)


def band_timeline(events: list[Event], cfg: BookingConfig, start_ms: int, end_ms: int) -> Timeline:
    """Regime BAND from the job's start to rank 0's run end (a later start reopens it): every
    slice is decided by its band alone, so nothing is ever pending."""
    bounds, regime = [NEG_INF, start_ms], [Regime.UNASSIGNED, Regime.BAND]
    job_end: int | None = None
    for e in events:  # sorted by ts
        if e.type != "run" or e.rank != 0:
            continue
        t = max(e.ts_ms, start_ms)
        state = e.get("state")
        if state == "end" and regime[-1] == Regime.BAND:
            bounds.append(t)
            regime.append(Regime.UNASSIGNED)
            job_end = t
        elif state in ("start", "resume") and regime[-1] == Regime.UNASSIGNED:
            bounds.append(t)
            regime.append(Regime.BAND)
            job_end = None
    b = np.asarray([*bounds, POS_INF], np.int64)
    r = np.asarray(regime, np.int8)
    keep = np.append(np.diff(b[:-1]) > 0, True)  # drop empty segments (an end at the start)
    b, r = b[:-1][keep], r[keep]
    same = np.append(False, r[1:] == r[:-1])  # neighbours left alike by the drop: one segment
    b, r = np.append(b[~same], POS_INF), r[~same]
    return Timeline(
        bounds=b,
        regime=r,
        steps=[],
        resumes=[],
        start_ms=start_ms,
        end_ms=job_end,
        rank_overhead={},
        allowances=Allowances(cfg),
        stall_threshold_ms=stall_threshold_ms([], cfg),
        decided_until_ms=job_end if job_end is not None else end_ms,
    )


@dataclass(slots=True)
class Slices:
    """Slices of many GPUs (a slice, one GPU's stretch of time in one band, is the unit of
    booking), in no particular order."""

    gpu: np.ndarray  # int32, index into the job's GPU list
    start_ms: np.ndarray  # int64
    end_ms: np.ndarray  # int64
    band: np.ndarray  # int8, NO_BAND where unobserved
    energy_mj: np.ndarray  # float64
    span_start_ms: np.ndarray | None = None  # per GPU: earliest slice start (POS_INF: none)
    span_end_ms: np.ndarray | None = None  # per GPU: latest slice end


@dataclass(slots=True)
class Pieces:
    """Slices cut at segment bounds, each with its category: what the ledger sums."""

    gpu: npt.NDArray[np.int32]
    start_ms: npt.NDArray[np.int64]
    end_ms: npt.NDArray[np.int64]
    band: npt.NDArray[np.int8]
    category: npt.NDArray[np.int8]
    energy_mj: npt.NDArray[np.float64]
    # Per piece (lo, hi, den): the lanes of its GPU a shared slice holds (`core.shares`); None:
    # whole GPUs.
    lanes: npt.NDArray[np.int64] | None = None

    @property
    def dur_ms(self) -> npt.NDArray[np.int64]:
        return self.end_ms - self.start_ms

    @property
    def gpu_ms(self) -> npt.NDArray[np.int64]:
        """GPU-milliseconds: the wall time, or a shared slice's part of it."""
        return shares.gpu_ms(self.start_ms, self.end_ms, self.lanes)

    @classmethod
    def empty(cls) -> Pieces:
        return cls(
            np.zeros(0, np.int32),
            np.zeros(0, np.int64),
            np.zeros(0, np.int64),
            np.zeros(0, np.int8),
            np.zeros(0, np.int8),
            np.zeros(0, np.float64),
        )

    @classmethod
    def concat(cls, parts: list[Pieces]) -> Pieces:
        """The pieces of `parts`, one after the other (none shared: whole GPUs)."""
        if len(parts) == 1:
            return parts[0]
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in _PIECE_COLUMNS))

    def merged(self) -> Pieces:
        """Each run of pieces that follow one another on one GPU in one category and band as one
        piece, its energy summed: what a report sums, in far fewer rows (a window of a replay
        keeps these). Unobserved pieces stay apart (whether their energy is known is each one's)."""
        n = self.gpu.size
        if n < 2 or self.lanes is not None:
            return self
        cat = self.category
        join = np.zeros(n, bool)
        join[1:] = (
            (self.gpu[1:] == self.gpu[:-1])
            & (cat[1:] == cat[:-1])
            & (self.band[1:] == self.band[:-1])
            & (self.start_ms[1:] == self.end_ms[:-1])
            & (cat[1:] != Category.UNOBSERVED)
        )
        if not join.any():
            return self
        heads = np.flatnonzero(~join)
        last = np.append(heads[1:], n) - 1
        return Pieces(
            self.gpu[heads],
            self.start_ms[heads],
            self.end_ms[last],
            self.band[heads],
            cat[heads],
            np.add.reduceat(self.energy_mj, heads),
        )

    def take(self, mask: npt.NDArray[np.bool_] | npt.NDArray[np.intp]) -> Pieces:
        """The pieces `mask` selects (a boolean mask or indices)."""
        return Pieces(
            self.gpu[mask],
            self.start_ms[mask],
            self.end_ms[mask],
            self.band[mask],
            self.category[mask],
            self.energy_mj[mask],
            None if self.lanes is None else self.lanes[mask],
        )


_PIECE_COLUMNS = ("gpu", "start_ms", "end_ms", "band", "category", "energy_mj")


# An unobserved gap of at most this long, give or take half a sampling interval of stamp jitter
# (a logger's hiccup: 0.3-1 s in real 100 ms recordings, ~4 s in 1 s ones), keeps its energy
# without an energy counter: the power interpolated across it. Its time stays unobserved. The
# bridge scales with the logger's own period: HICCUP_INTERVALS of its intervals, at least
# HICCUP_MS.
HICCUP_MS = 1000
HICCUP_INTERVALS = 10


def hiccup_ms(interval_ms: int) -> int:
    """The longest gap bridged by interpolated power at this sampling interval."""
    return max(HICCUP_MS, HICCUP_INTERVALS * int(interval_ms))


def make_slices(
    gpu: np.ndarray,
    ts_ms: np.ndarray,
    power_w: np.ndarray,
    energy_mj: np.ndarray,
    band: np.ndarray,
    n_gpus: int,
    interval_ms: int,
    cover_start_ms: np.ndarray,
    cover_end_ms: np.ndarray,
    gap_intervals: float,
) -> Slices:
    """Samples (grouped by GPU, in time order) to slices, plus `unobserved` slices for gaps and
    for the parts of each GPU's coverage [cover_start, cover_end) that have no samples at all.

    A sample's slice runs to the next sample of its GPU (the last one: one interval); a gap
    longer than `gap_intervals` intervals keeps one interval and the rest is unobserved; the
    unobserved part carries the energy counter's delta, or without one, across a gap of at most
    `hiccup_ms(interval)`, the power interpolated between the samples either side.
    `cover_*` are per GPU; a coverage start of POS_INF means "not a job GPU".
    """
    n = ts_ms.size
    iv = int(interval_ms)
    last = np.ones(n, bool)
    nxt = np.empty(n, np.int64)
    if n > 1:
        np.not_equal(gpu[1:], gpu[:-1], out=last[:-1])
        nxt[:-1] = ts_ms[1:]
    nxt[last] = ts_ms[last] + iv
    dur = nxt - ts_ms
    gap = dur > gap_intervals * iv
    any_gap = bool(gap.any())
    if any_gap:
        dur[gap] = iv
        end = ts_ms + dur
    else:
        end = nxt

    # Energy: the counter's delta where the source has one, else integrated power (W x ms = mJ).
    energy = power_w * dur
    energy[np.isnan(energy)] = 0.0
    gap_energy = np.zeros(int(gap.sum()))
    if n > 1 and not np.isnan(energy_mj).all():
        de = np.full(n, np.nan)
        de[:-1] = energy_mj[1:] - energy_mj[:-1]
        use_counter = np.isfinite(de) & (de >= 0) & ~last
        # Across a gap the counter still says what was used: the time stays unobserved, the
        # energy is shared between the slice before the gap and the gap, in proportion to time.
        share = np.where(gap, dur / np.maximum(nxt - ts_ms, 1), 1.0)
        energy[use_counter] = de[use_counter] * share[use_counter]
        if any_gap:
            bridged = use_counter[gap]
            gap_energy[bridged] = de[gap][bridged] * (1.0 - share[gap][bridged])

    # A logger's hiccup (a gap of at most hiccup_ms) without a counter: the time stays
    # unobserved, its energy is the power interpolated between the samples either side of it.
    if any_gap and n > 1:
        short = np.isnan(gap_energy) | (gap_energy == 0)
        gi = np.flatnonzero(gap)
        span = nxt[gi] - ts_ms[gi]
        short &= (nxt[gi] - end[gi] <= hiccup_ms(iv) + iv // 2) & ~last[gi]  # stamps jitter
        if short.any():
            i = gi[short]
            p0, p1 = power_w[i], power_w[i + 1]
            at_start = p0 + (p1 - p0) * (dur[i] / span[short])
            e = (at_start + p1) / 2 * (nxt[i] - end[i])
            gap_energy[short] = np.where(np.isfinite(e), e, 0.0)

    # Unobserved pieces: interior gaps, coverage before the first and after the last sample.
    gap_start = end[gap] if any_gap else np.zeros(0, np.int64)
    gap_end = nxt[gap] if any_gap else np.zeros(0, np.int64)
    gap_gpu = gpu[gap] if any_gap else np.zeros(0, np.int32)
    first_ts = np.full(n_gpus, POS_INF, np.int64)
    last_end = np.full(n_gpus, NEG_INF, np.int64)
    if n:
        starts = np.flatnonzero(np.concatenate([[True], last[:-1]]))
        first_ts[gpu[starts]] = ts_ms[starts]
        last_end[gpu[last]] = end[last]
    has = first_ts < POS_INF
    member = cover_start_ms < POS_INF
    head = member & (cover_start_ms < np.minimum(first_ts, cover_end_ms))
    tail = member & has & (cover_end_ms > last_end)
    g_all = np.arange(n_gpus, dtype=np.int32)
    uo_gpu = np.concatenate([gap_gpu, g_all[head], g_all[tail]])
    uo_start = np.concatenate(
        [gap_start, cover_start_ms[head], np.maximum(last_end[tail], cover_start_ms[tail])]
    )
    uo_end = np.concatenate([gap_end, np.minimum(first_ts, cover_end_ms)[head], cover_end_ms[tail]])
    uo_energy = np.concatenate([gap_energy, np.zeros(int(head.sum()) + int(tail.sum()))])
    keep = uo_end > uo_start
    span_start = np.where(head, cover_start_ms, first_ts)
    span_end = np.where(tail, cover_end_ms, last_end)
    if not keep.any():
        return Slices(gpu, ts_ms, end, band.astype(np.int8, copy=False), energy, span_start, span_end)
    k = int(keep.sum())
    return Slices(
        np.concatenate([gpu, uo_gpu[keep].astype(gpu.dtype)]),
        np.concatenate([ts_ms, uo_start[keep]]),
        np.concatenate([end, uo_end[keep]]),
        np.concatenate([band.astype(np.int8, copy=False), np.full(k, NO_BAND, np.int8)]),
        np.concatenate([energy, uo_energy[keep]]),
        span_start,
        span_end,
    )


def _cut(s: Slices, bounds: np.ndarray, of: np.ndarray | None = None) -> tuple[Slices, np.ndarray]:
    """Cut slices at shared sorted bounds; return the pieces and each piece's segment index, or
    with `of` (a value per segment) each piece's segment's value.

    A straddling slice keeps its first piece in place; its other pieces are appended.
    """
    nxt = np.searchsorted(bounds, s.start_ms, "right")  # the first bound after each start
    multi = np.flatnonzero(s.end_ms > bounds[nxt])  # slices that cross their segment's end
    lo = nxt
    lo -= 1  # in place: the bound before each start (nxt is not needed again)
    if multi.size == 0:
        return s, lo if of is None else of[lo]
    hi = np.searchsorted(bounds, s.end_ms[multi] - 1, "right") - 1
    n = hi - lo[multi]  # extra pieces per straddling slice
    idx = np.repeat(multi, n)
    seg = lo[idx] + (np.arange(idx.size) - np.repeat(np.cumsum(n) - n, n)) + 1
    full = (s.end_ms - s.start_ms)[multi]
    start = bounds[seg]
    end = np.minimum(s.end_ms[idx], bounds[seg + 1])
    energy = s.energy_mj[idx] * ((end - start) / np.repeat(full, n))
    out = Slices(
        np.concatenate([s.gpu, s.gpu[idx]]),
        np.concatenate([s.start_ms, start]),
        np.concatenate([s.end_ms, end]),
        np.concatenate([s.band, s.band[idx]]),
        np.concatenate([s.energy_mj, energy]),
        s.span_start_ms,
        s.span_end_ms,
    )
    first_end = bounds[lo[multi] + 1]
    out.end_ms[multi] = first_end
    out.energy_mj[multi] = s.energy_mj[multi] * ((first_end - s.start_ms[multi]) / full)
    if of is not None:  # the values gathered, then joined: narrower than the indices
        return out, np.concatenate([of[lo], of[seg]])
    return out, np.concatenate([lo, seg])


def _cut_per_gpu(s: Slices, cut_gpu: np.ndarray, cut_ms: np.ndarray) -> Slices:
    """Cut slices at per-GPU times (few: membership bounds, a rank's own phases).

    Pieces keep the slices' order (a cut slice's pieces in place, in time order). Only the few
    slices a cut falls strictly inside are looked at one piece at a time; every other slice is
    found uncut by one search of its start among the (few) cuts.
    """
    if cut_ms.size and s.span_start_ms is not None and s.span_end_ms is not None:
        # Only cuts strictly inside their GPU's span of slices can split anything.
        inside = (cut_ms > s.span_start_ms[cut_gpu]) & (cut_ms < s.span_end_ms[cut_gpu])
        cut_gpu, cut_ms = cut_gpu[inside], cut_ms[inside]
    if cut_ms.size == 0 or s.start_ms.size == 0:
        return s
    # A slice can be cut only where a cut time of some GPU falls strictly inside it: one search
    # of each start among the (few) times; the GPUs are matched for those slices alone.
    times = np.unique(cut_ms)
    cand = np.flatnonzero(np.append(times, POS_INF)[np.searchsorted(times, s.start_ms, "right")] < s.end_ms)
    if cand.size == 0:
        return s
    span = np.int64(1) << 42  # > any trace's span in ms after rebasing
    start_c = s.start_ms[cand]
    base = int(min(start_c.min(), cut_ms.min()))
    cuts = np.unique(cut_gpu.astype(np.int64) * span + (np.clip(cut_ms, base, base + span - 1) - base))
    # The first cut after each slice's start; the slice is cut when that cut is on its GPU and
    # before its end.
    g_c = s.gpu[cand].astype(np.int64)
    lo_c = np.searchsorted(cuts, g_c * span + (start_c - base), "right")
    pad_g = np.append(cuts // span, -1)  # past the last cut: no GPU
    pad_t = np.append(cuts % span + base, 0)
    ok = (pad_g[lo_c] == g_c) & (pad_t[lo_c] < s.end_ms[cand])
    multi, lo_m = cand[ok], lo_c[ok]
    if multi.size == 0:
        return s
    key_e = s.gpu[multi].astype(np.int64) * span + (s.end_ms[multi] - base)
    n_m = np.searchsorted(cuts, key_e, "left") - lo_m + 1  # pieces of each cut slice
    # Positions of the cut slices' pieces in the output, and each piece's cut bounds.
    extra = n_m - 1
    first = multi + np.cumsum(extra) - extra
    rep = np.repeat(np.arange(multi.size), n_m)
    k = np.arange(rep.size) - np.repeat(np.cumsum(n_m) - n_m, n_m)
    pos = first[rep] + k
    ci = lo_m[rep] + k  # the cut that ends the piece (when it is not the slice's last)
    m = multi[rep]
    start_m = np.where(k > 0, pad_t[np.maximum(ci - 1, 0)], s.start_ms[m])
    end_m = np.where(k < n_m[rep] - 1, pad_t[np.minimum(ci, cuts.size - 1)], s.end_ms[m])
    full = (s.end_ms - s.start_ms)[m]
    total = s.start_ms.size + int(extra.sum())

    def spread(a: np.ndarray, at_pieces: np.ndarray) -> np.ndarray:
        """`a` per slice to per piece: uncut slices copied in runs, the pieces set at `pos`."""
        if multi.size > 256:
            n = np.ones(a.size, np.int64)
            n[multi] = n_m
            out = np.repeat(a, n)
        else:
            out = np.empty(total, a.dtype)
            prev = off = 0
            for j, e in zip(multi.tolist(), extra.tolist(), strict=True):
                out[prev + off : j + 1 + off] = a[prev : j + 1]
                off += e
                prev = j + 1
            out[prev + off :] = a[prev:]
        out[pos] = at_pieces
        return out

    return Slices(
        spread(s.gpu, s.gpu[m]),
        spread(s.start_ms, start_m),
        spread(s.end_ms, end_m),
        spread(s.band, s.band[m]),
        spread(s.energy_mj, s.energy_mj[m] * ((end_m - start_m) / full)),
        s.span_start_ms,
        s.span_end_ms,
    )


def book(
    slices: Slices,
    timeline: Timeline,
    gpu_rank: np.ndarray,
    member_start_ms: np.ndarray,
    member_end_ms: np.ndarray,
) -> Pieces:
    """Every slice of the job's GPUs to categories (rules 1-5 and membership)."""
    cut_g: list[np.ndarray] = [np.arange(gpu_rank.size), np.arange(gpu_rank.size)]
    cut_t: list[np.ndarray] = [member_start_ms, member_end_ms]
    rank_to_gpu = {int(r): g for g, r in enumerate(gpu_rank) if r >= 0}
    overlays: list[tuple[int, np.ndarray, np.ndarray]] = []
    for rank, ivals in timeline.rank_overhead.items():
        g = rank_to_gpu.get(rank)
        if g is None or not ivals:
            continue
        a = np.asarray([x for x, _ in ivals], np.int64)
        b = np.asarray([y for _, y in ivals], np.int64)
        overlays.append((g, a, b))
        cut_g += [np.full(a.size, g), np.full(b.size, g)]
        cut_t += [a, b]
    s = _cut_per_gpu(
        slices,
        np.concatenate(cut_g),
        np.clip(np.concatenate(cut_t), NEG_INF // 2, POS_INF // 2),
    )
    s, regime = _cut(s, timeline.bounds, timeline.regime)  # a gather: already a copy of its own
    for g, a, b in overlays:
        mine = s.gpu == g
        j = np.searchsorted(a, s.start_ms[mine], "right") - 1
        inside = (j >= 0) & (s.start_ms[mine] < b[np.maximum(j, 0)])
        r = regime[mine]
        r[inside & (r != Regime.UNASSIGNED)] = Regime.OVERHEAD
        regime[mine] = r
    if (
        s.span_start_ms is None
        or not ((s.span_start_ms >= member_start_ms) & (s.span_end_ms <= member_end_ms)).all()
    ):
        outside = (s.start_ms < member_start_ms[s.gpu]) | (s.start_ms >= member_end_ms[s.gpu])
        regime[outside] = Regime.UNASSIGNED
    # category_table[regime, band + 1] as one flat take.
    table = category_table(bandtable.current())
    at = regime.astype(np.intp)  # built in place: one array, not one per operation
    at *= table.shape[1]
    at += s.band
    at += 1
    category = np.take(table.ravel(), at)
    return Pieces(s.gpu, s.start_ms, s.end_ms, s.band, category, s.energy_mj)


def job_bands(
    cfg: BookingConfig,
    timeline: Timeline,
    rank: np.ndarray,
    ts_ms: np.ndarray,
    power_w: np.ndarray,
    util_pct: np.ndarray,
    n_ranks: int,
    profile: Profile,
    interval_ms: int,
    carry: bands_mod.RunCarry | None = None,
    carry_at_ms: int | None = None,
    phase_ms: float | None = None,
    count_ms: tuple[int | None, int | None] = (None, None),
) -> bands_mod.BandResult:
    """A job's bands on its grid, with the checkpoint allowance its own checkpoints taught
    (`carry`, `carry_at_ms`: a window's signature run carried in and out; `phase_ms`, `count_ms`:
    the trace's sampling phase and the moments this window counts, `bands.classify`)."""
    return bands_mod.classify(
        rank,
        ts_ms,
        power_w,
        util_pct,
        n_ranks,
        profile,
        grid_ms=int(cfg.grid_s * 1000),
        gap_intervals=cfg.gap_intervals,
        checkpoint_allowance_ms=lambda t: timeline.allowances.at("checkpoint", t),
        interval_ms=interval_ms,
        # Only a job that posts steps can show "no step": a stepless job (a pod without a
        # trainer) or a bare trace never gets the spin signature.
        step_ms=np.asarray([s.ts_ms for s in timeline.steps], np.int64) if timeline.steps else None,
        carry=carry,
        carry_at_ms=carry_at_ms,
        phase_ms=phase_ms,
        count_from_ms=count_ms[0],
        count_to_ms=count_ms[1],
    )
