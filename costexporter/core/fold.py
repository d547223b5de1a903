"""A job's timeline folded incrementally (pure: no Redis): each event is walked once.

`booking.build_timeline` walks a job's whole event history; a live agent that called it every
round did work (and held memory) that grew with the job's age. `TimelineFold` runs the same
walk, event by event, and keeps only what the booking rules still need:

* the step-duration window of the stall threshold, the open phases and run, the learned
  allowances (a few numbers per phase occurrence);
* regime segments and step records back to `keep_from` (the booking context), older ones
  dropped;
* the valid steps as a compact stack (a resume can void any of them: 40 bytes a valid step),
  and the voided ones (rare);
* counts and sums for the job figures.

Events are folded for good only once they are `lag_ms` behind the newest data time (the
*frontier*); the newer ones are walked each round on a copy, so the view a round sees is the one
`build_timeline` gives over every event. A walk-relevant event at or before the frontier that
arrives late would change the past: the fold says so (`late`) and its owner rebuilds it from the
whole stream (rare, counted). Heartbeats, other ranks' steps, registrations and the like never
enter it.
"""

from __future__ import annotations

import bisect
from array import array
from collections import deque
from dataclasses import replace
from typing import Any

import numpy as np

from costexporter.core.booking import (
    ENDED,
    LAPSED,
    NEG_INF,
    POS_INF,
    RUN_STARTUP,
    SHORT_WALK,
    STEPLESS_META,
    Allowances,
    BookingConfig,
    Regime,
    RunWalk,
    StepRecord,
    StepSummary,
    Timeline,
    _merge,
    band_timeline,
    decided_until_ms,
    is_point,
    stall_threshold_ms,
)
from costexporter.core.model import Event
from costexporter.core.timeutil import to_ms


def walk_relevant(ev: Event) -> bool:
    """Whether an event can change the booking timeline (everything else never enters it)."""
    if ev.type == "phase" or is_point(ev):
        return True
    return ev.type == "meta" and ev.get(STEPLESS_META[0]) == STEPLESS_META[1]


class _Phases:
    """One rank's declared phases, folded in time order (`booking._intervals_of_phases`)."""

    __slots__ = ("allow", "closed", "last_ckpt", "open", "overrun", "starts")

    def __init__(self, allowances: Allowances) -> None:
        self.allow = allowances
        self.open: dict[str, int] = {}
        self.closed: list[tuple[int, int]] = []  # merged, sorted
        self.starts: list[int] = []
        self.overrun: list[tuple[str, int, int]] = []
        self.last_ckpt: tuple[int, int] | None = None

    def clone(self, allowances: Allowances) -> _Phases:
        c = _Phases(allowances)
        c.open, c.closed, c.starts = dict(self.open), list(self.closed), list(self.starts)
        c.overrun, c.last_ckpt = list(self.overrun), self.last_ckpt
        return c

    def add(self, ev: Event) -> None:
        name = ev.str_field("name")
        t = ev.ts_ms
        if ev.get("state") == "begin":
            if name in self.open:
                self._close(name, self.open.pop(name), t)
            self.open[name] = t
        elif name in self.open:
            self._close(name, self.open.pop(name), t)
            if name == "checkpoint" and (step := ev.opt_int_field("step")) is not None:
                self.last_ckpt = (step, t)

    def close_open(self, end_ms: int) -> None:
        for name, begin in self.open.items():
            self._close(name, begin, max(end_ms, begin))
        self.open = {}

    def _close(self, name: str, begin: int, end: int) -> None:
        allow = self.allow.current(name)
        self._insert(begin, min(end, begin + allow))
        if end - begin > allow:
            self.overrun.append((name, begin, end))
        self.allow.observe(name, end, end - begin)

    def _insert(self, a: int, b: int) -> None:
        """Into the merged list, as `_merge(sorted(all))` would have it."""
        if b <= a:
            return
        i = bisect.bisect_left(self.starts, a)
        lo = i
        if lo > 0 and self.closed[lo - 1][1] >= a:
            lo -= 1
        hi = i
        while hi < len(self.closed) and self.closed[hi][0] <= b:
            hi += 1
        if lo < hi:
            a = min(a, self.closed[lo][0])
            b = max(b, max(y for _, y in self.closed[lo:hi]))
        self.closed[lo:hi] = [(a, b)]
        self.starts[lo:hi] = [a]

    def around(self, a: int, b: int, *, with_open: bool) -> list[tuple[int, int]]:
        """Intervals meeting [a, b) (merged), the open phases as if they ran on (the walk folds a
        point only once every phase before it is in, and looks no later than that point)."""
        i = max(bisect.bisect_right(self.starts, a) - 1, 0)
        out = []
        while i < len(self.closed) and self.closed[i][0] < b:
            if self.closed[i][1] > a:
                out.append(self.closed[i])
            i += 1
        if with_open and self.open:
            out += [(begin, begin + self.allow.current(n)) for n, begin in self.open.items()]
            out = _merge(sorted(out))
        return out

    def trim(self, keep_from: int) -> None:
        # Called for every rank each poll, and nearly always with nothing to drop: no list built
        # for that (the intervals are merged, so their ends increase too).
        closed, n = self.closed, 0
        while n < len(closed) and closed[n][1] < keep_from:
            n += 1
        if n:
            del closed[:n], self.starts[:n]
        if self.overrun:
            self.overrun = [o for o in self.overrun if o[2] >= keep_from]


class _Walk(RunWalk):
    """`build_timeline`'s walk over rank 0's points (`booking.RunWalk`), its valid records kept
    as a compact stack."""

    def __init__(self, cfg: BookingConfig, start_ms: int) -> None:
        self._start_run(cfg, start_ms)
        self.start_ms = start_ms
        self.allow = Allowances(cfg)
        self.p0 = _Phases(self.allow)
        self.pr: dict[int, _Phases] = {}
        self.seg_start: list[int] = [NEG_INF]
        self.seg_regime: list[int] = [Regime.UNASSIGNED]
        self.seg_step: list[int] = [-1]
        self.steps: list[StepRecord] = []  # records from step_base on
        self.step_base = 0
        self.tokens_before = 0
        self.n_steps = 0
        self.valid_tokens = 0
        self.last_step: StepRecord | None = None
        self.last_ts: int | None = None  # the newest record's ts (the next one's prev)
        # The valid records, a stack (a resume pops its top), increasing in step number within a
        # run; the current run's are those from `run_floor` on.
        self.v_rec, self.v_step, self.v_ts = array("q"), array("q"), array("q")
        self.v_tok, self.v_prev = array("q"), array("q")
        self.run_floor = self.prev_floor = 0
        self.voided: list[tuple[int, StepRecord, int | None]] = []
        # The last checkpoints that saved a valid step: (step, its record), oldest first.
        self.ckpts: deque[tuple[int, int]] = deque(maxlen=max(cfg.rollback_checkpoints, 1))
        self.final_phases = False  # the open phases were closed (a view's copy, never the fold)
        # A view's copy shares the valid stack with the fold (copying it would cost a round time
        # that grows with the job's age): how much of it is the fold's, and what the view popped
        # of that, put back by `release`.
        self._shared: int | None = None
        self._popped: list[tuple[int, int, int, int, int]] = []
        self._own_pr: set[int] | None = None  # a view's copy: the ranks' phases it copied

    def clone(self) -> _Walk:
        c = _Walk.__new__(_Walk)  # copy.copy's shallow copy, without its generic protocol
        c.__dict__.update(self.__dict__)
        c.allow = self.allow.copy()
        c.run_allow = self.run_allow.copy()
        c.p0 = self.p0.clone(c.allow)
        # Other ranks' phases are shared until the copy changes them (`_rank_phases`): a view
        # closes the open phases of a few ranks, not of every rank of a wide job.
        c.pr = dict(self.pr)
        c._own_pr = set()
        c.seg_start, c.seg_regime = list(self.seg_start), list(self.seg_regime)
        c.seg_step = list(self.seg_step)
        c.steps = list(self.steps)
        c._shared, c._popped = len(self.v_rec), []
        c.voided = list(self.voided)
        c.resumes = list(self.resumes)
        c.crashes = list(self.crashes)
        c.ckpts = deque(self.ckpts, maxlen=self.ckpts.maxlen)
        c.durations = deque(self.durations, maxlen=self.cfg.stall_window)
        return c

    def _stack(self) -> tuple[array[int], ...]:
        return self.v_rec, self.v_step, self.v_ts, self.v_tok, self.v_prev

    def _pop(self) -> tuple[int, int, int, int, int]:
        # The five arrays of `_stack`, in its order.
        vals = (self.v_rec.pop(), self.v_step.pop(), self.v_ts.pop(), self.v_tok.pop(), self.v_prev.pop())
        if self._shared is not None and len(self.v_rec) < self._shared:
            self._shared = len(self.v_rec)
            self._popped.append(vals)
        return vals

    def release(self) -> None:
        """A view's copy is done: the shared valid stack is the fold's again, as it was."""
        if self._shared is None:
            return
        for a in self._stack():
            del a[self._shared :]
        for vals in reversed(self._popped):
            for a, v in zip(self._stack(), vals, strict=True):
                a.append(v)
        self._shared, self._popped = None, []

    # ---- phases -----------------------------------------------------------------------------
    def phase(self, ev: Event) -> None:
        if ev.rank == 0:
            saved = self.p0.last_ckpt
            self.p0.add(ev)
            if self.p0.last_ckpt is not None and self.p0.last_ckpt != saved:
                self._checkpoint(self.p0.last_ckpt[0])
        else:
            self._rank_phases(ev.rank).add(ev)

    def _rank_phases(self, rank: int) -> _Phases:
        """Rank `rank`'s phases, to change: a view's copy copies them first."""
        p = self.pr.get(rank)
        if p is None:
            p = self.pr[rank] = _Phases(Allowances(self.cfg))
        elif self._own_pr is not None and rank not in self._own_pr:
            p = self.pr[rank] = p.clone(p.allow.copy())
            self._own_pr.add(rank)
        return p

    def close_open(self, end_ms: int) -> None:
        """Close every open phase at `end_ms` (a view's end), as if each ended there."""
        self.p0.close_open(end_ms)
        for r in [r for r, p in self.pr.items() if p.open]:
            self._rank_phases(r).close_open(end_ms)

    # ---- the walk (as in build_timeline) ----------------------------------------------------
    def split(self, a: int, b: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        p0 = self.p0
        if not self.in_startup and not p0.open and (not p0.closed or p0.closed[-1][1] <= a):
            return [], [(a, b)]  # most steps: no phase meets them (the closed ones end in order)
        overhead = p0.around(a, b, with_open=not self.final_phases)
        if not self.in_startup and not overhead:
            return [], [(a, b)]
        ov: list[tuple[int, int]] = []
        for x0, y0 in overhead:
            x, y = max(x0, a), min(y0, b)
            if y > x:
                ov.append((x, y))
        return self.with_startup(ov, a, b)

    def _checkpoint(self, step: int) -> None:
        """A checkpoint saved `step`: a resume can come back to that valid record."""
        j = bisect.bisect_left(self.v_step, step, self.run_floor)  # (sorted within the run)
        if j < len(self.v_step) and self.v_step[j] == step:
            rec = self.v_rec[j]
            if not self.ckpts or self.ckpts[-1][1] < rec:
                self.ckpts.append((step, rec))

    def rollback_floor(self) -> int | None:
        """The oldest record a resume can reach: that of the oldest checkpoint kept, once
        `rollback_checkpoints` of them are declared (before that, any record)."""
        full = len(self.ckpts) == self.ckpts.maxlen
        return self.ckpts[0][1] if full and self.ckpts else None

    def void_above(self, k: int, at_ms: int) -> int:
        n = 0
        while len(self.v_step) > self.run_floor and self.v_step[-1] > k:
            n += 1
            rec, step, ts, tok, prev = self._pop()
            self.valid_tokens -= tok
            j = rec - self.step_base
            if 0 <= j < len(self.steps):
                voided = replace(self.steps[j], voided=True, voided_ms=at_ms)
                self.steps[j] = voided
            else:
                voided = StepRecord(step, ts, tok, True, at_ms)
            if self.last_step is not None and rec == self.n_steps - 1:
                self.last_step = voided
            self.voided.append((rec, voided, None if prev == NEG_INF else prev))
        if n:  # popped top first: keep the list in record order within one resume
            self.voided[-n:] = sorted(self.voided[-n:], key=lambda v: v[0])
        top = self.v_rec[-1] if self.v_rec else -1
        while self.ckpts and self.ckpts[-1][1] > top:  # checkpoints of voided steps are gone
            self.ckpts.pop()
        return n

    def record(self, step: int, ts_ms: int, tokens: int) -> int:
        rec = StepRecord(step, ts_ms, tokens)
        i = self.n_steps
        self.steps.append(rec)
        self.v_rec.append(i)
        self.v_step.append(step)
        self.v_ts.append(ts_ms)
        self.v_tok.append(tokens)
        self.v_prev.append(NEG_INF if self.last_ts is None else self.last_ts)
        self.n_steps += 1
        self.valid_tokens += tokens
        self.last_step, self.last_ts = rec, ts_ms
        return i

    def run_top(self) -> int | None:
        return self.v_step[-1] if len(self.v_step) > self.run_floor else None

    def new_run(self) -> None:
        self.prev_floor, self.run_floor = self.run_floor, len(self.v_rec)

    def merge_run(self) -> None:
        self.run_floor = self.prev_floor

    def trim(self, keep_from: int, *, others_from: int | None = None) -> None:
        """Drop segments and step records wholly before `keep_from` (the last ones stay); never
        past the last progress point, where the next interval starts. Other ranks' overhead
        intervals stay from the earlier of that and `others_from` (their own frontier) on."""
        keep_from = min(keep_from, self.anchor)
        ss = self.seg_start
        n = bisect.bisect_right(ss, keep_from) - 1  # the segment holding keep_from stays
        n = min(n, len(ss) - 2)
        if n > 0:
            del ss[:n], self.seg_regime[:n], self.seg_step[:n]
        k = 0
        while k < len(self.steps) - 1 and self.steps[k].ts_ms < keep_from:
            k += 1
        if k:
            self.tokens_before += sum(s.tokens for s in self.steps[:k])
            del self.steps[:k]
            self.step_base += k
        self.p0.trim(keep_from)
        for p in self.pr.values():
            p.trim(keep_from if others_from is None else min(keep_from, others_from))


def _segments(w: _Walk) -> tuple[np.ndarray, np.ndarray]:
    """The walk's segments as a timeline's `bounds` and `regime`: steps a resume voided marked
    VOID, neighbours of one regime merged."""
    steps, base = w.steps, w.step_base
    if len(w.seg_regime) < SHORT_WALK:  # a watcher's trimmed walk: a few segments
        starts: list[int] = []
        regimes: list[int] = []
        for a, r, s in zip(w.seg_start, w.seg_regime, w.seg_step, strict=True):
            if r == Regime.STEP and s >= 0 and 0 <= s - base < len(steps) and steps[s - base].voided:
                r = Regime.VOID
            if not regimes or regimes[-1] != r:
                starts.append(a)
                regimes.append(r)
        starts[0] = NEG_INF
        starts.append(POS_INF)
        return np.asarray(starts, np.int64), np.asarray(regimes, np.int8)
    seg_start = [*w.seg_start, POS_INF]
    seg_start[0] = NEG_INF
    bounds = np.asarray(seg_start, np.int64)
    regime = np.asarray(w.seg_regime, np.int8)
    step_idx = np.asarray(w.seg_step, np.int64)
    is_step = (step_idx >= 0) & (regime == Regime.STEP)
    if is_step.any():
        j = step_idx[is_step] - base
        ok = (j >= 0) & (j < len(steps))
        flags = np.zeros(j.size, bool)
        flags[ok] = [steps[int(x)].voided for x in j[ok]]
        is_void = np.zeros(regime.size, bool)
        is_void[is_step] = flags
        regime[is_void] = Regime.VOID
    keep = np.ones(regime.size, bool)
    keep[1:] = regime[1:] != regime[:-1]
    return np.append(bounds[:-1][keep], bounds[-1]), regime[keep]


class TimelineFold:
    """A job's events folded as they arrive; `timeline(end_ms)` is `build_timeline` over all of
    them, for what a live round reads of it (segments and steps from `keep_from` on)."""

    def __init__(self, cfg: BookingConfig, start_ms: int) -> None:
        self.cfg = cfg
        self.start_ms = start_ms
        self.frontier = NEG_INF
        # Other ranks' phases change only their own overhead intervals, never rank 0's walk: they
        # are walked for good up to a frontier of their own (the watcher's: where those ranks are
        # settled), so a rank that reports rarely does not hold rank 0's walk back.
        self.others_frontier = NEG_INF
        self.pending: list[Event] = []
        self.late = False  # an event at or before the frontier arrived: rebuild from the stream
        self.stepless_declared = False
        self.rank0_step = False
        self.run0: list[Event] = []  # rank 0's run events (a stepless job's timeline)
        self.w = _Walk(cfg, start_ms)
        self.folded = 0  # events walked for good (a measure of the work done)

    def add(self, events: list[Event]) -> None:
        for ev in events:
            if not walk_relevant(ev):
                continue
            if ev.type == "meta":
                self.stepless_declared = True
                continue
            if ev.ts_ms <= (self.frontier if ev.rank == 0 else self.others_frontier):
                self.late = True
            if ev.type == "step":
                self.rank0_step = True
            elif ev.type == "run" and ev.rank == 0:
                self.run0.append(ev)
            self.pending.append(ev)

    def advance(self, frontier_ms: int, keep_from_ms: int, *, others_ms: int | None = None) -> None:
        """Walk for good rank 0's events up to `frontier_ms` and the other ranks' phases up to
        `others_ms` (default: the same; neither later than any round's end to come), and forget
        what lies wholly before `keep_from_ms`."""
        others_ms = frontier_ms if others_ms is None else others_ms
        if frontier_ms <= self.frontier and others_ms <= self.others_frontier:
            return
        frontier_ms, others_ms = max(frontier_ms, self.frontier), max(others_ms, self.others_frontier)
        self.pending.sort(key=lambda e: (e.ts_ms, e.seq))
        w = self.w
        keep: list[Event] = []
        for ev in self.pending:
            if ev.ts_ms > (frontier_ms if ev.rank == 0 else others_ms):
                keep.append(ev)
            elif ev.type == "phase":
                w.phase(ev)
            else:
                w.point(ev)
        self.folded += len(self.pending) - len(keep)
        self.pending = keep
        self.frontier, self.others_frontier = frontier_ms, others_ms
        w.trim(keep_from_ms, others_from=others_ms)

    def timeline(self, end_ms: int, *, final: bool = False, dated_until: bool = False) -> Timeline | None:
        """The view of `build_timeline(all events, end_ms)`; None when the fold cannot give it
        (a late event, or an end before the frontier): rebuild from the stream."""
        if self.late or end_ms < max(self.frontier, self.others_frontier):
            return None
        self.pending.sort(key=lambda e: (e.ts_ms, e.seq))
        # `dated_until`: as build_timeline over `booking.dated_until(events, end_ms)`, what live
        # booking decides with (an event dated after end_ms is not used yet).
        pending = [e for e in self.pending if e.ts_ms <= end_ms] if dated_until else self.pending
        rank0_step = self.rank0_step
        if dated_until:
            rank0_step = self.w.n_steps > 0 or any(e.type == "step" for e in pending)
        if self.stepless_declared and not rank0_step:
            run0 = sorted(self.run0, key=lambda e: (e.ts_ms, e.seq))
            if dated_until:
                run0 = [e for e in run0 if e.ts_ms <= end_ms]
            return band_timeline(run0, self.cfg, self.start_ms, end_ms)
        w = self.w.clone()
        try:
            return self._view(w, end_ms, final, pending)
        finally:
            w.release()

    def _view(self, w: _Walk, end_ms: int, final: bool, pending: list[Event]) -> Timeline:
        for ev in pending:
            if ev.type == "phase":
                w.phase(ev)
        w.close_open(end_ms)
        w.final_phases = True
        for ev in pending:
            if ev.type != "phase":
                w.point(ev)
        job_end = w.finish(end_ms, final)
        bounds, regime = _segments(w)
        decided_until = decided_until_ms(bounds, regime, job_end, end_ms)
        last_ckpt = w.p0.last_ckpt
        return Timeline(
            bounds=bounds,
            regime=regime,
            steps=w.steps,
            resumes=w.resumes,
            start_ms=self.start_ms,
            end_ms=job_end,
            rank_overhead={r: list(p.closed) for r, p in w.pr.items()},
            allowances=w.allow,
            last_checkpoint_step=last_ckpt[0] if last_ckpt else None,
            last_checkpoint_ms=last_ckpt[1] if last_ckpt else None,
            phases_overrun=w.p0.overrun,
            crashes=list(w.crashes),
            stall_threshold_ms=stall_threshold_ms(w.durations, self.cfg),
            decided_until_ms=decided_until,
            lapsed=w.ended == LAPSED,
            step_base=w.step_base,
            rollback_floor=w.rollback_floor(),
            summary=StepSummary(
                n_steps=w.n_steps,
                n_voided=len(w.voided),
                valid_tokens=w.valid_tokens,
                tokens_before=w.tokens_before,
                last_step=w.last_step,
                voided=w.voided,
            ),
        )

    def state_bytes(self) -> int:
        """About how many bytes the fold holds (for `costexporter_agent_state_bytes`)."""
        w = self.w
        return (
            40 * len(w.v_rec)
            + 120 * (len(w.steps) + len(w.voided))
            + 90 * len(w.seg_start)
            + 60 * (len(w.p0.closed) + sum(len(p.closed) for p in w.pr.values()))
            + 700 * (len(self.pending) + len(self.run0))
            + 16 * sum(len(v) for a in (w.allow, w.run_allow) for v in a._durations.values())
        )


# ---- persisting a fold (the agent stores it with its watermark; pure: bytes in, bytes out) ----
# The `_*_in` readers take what `json.loads` gave (Any): they convert and check each value.

FOLD_FORMAT = 3  # bump when the layout below changes: an older stored fold is rebuilt, not read
_MAGIC = b"CEFOLD"


class FoldFormatError(ValueError):
    """A stored fold that is not one this version can read (older format, corrupted, another
    booking configuration): its owner rebuilds the fold from the stream."""


def cfg_fingerprint(cfg: BookingConfig) -> str:
    """A short name of the booking configuration a fold was walked with."""
    import dataclasses
    import hashlib
    import json

    raw = json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str)
    return hashlib.sha1(raw.encode()).hexdigest()[:16]


def _ev_out(e: Event) -> list[object]:
    return [e.type, e.ts_ms, e.rank, e.session, e.seq, e.fields]


def _ev_in(x: list[Any], job: str) -> Event:
    t, ts, rank, session, seq, fields = x
    return Event(
        type=str(t),
        job=job,
        # integer milliseconds; a fold stored before times were milliseconds holds float seconds
        ts_ms=to_ms(ts) if isinstance(ts, float) else int(ts),
        rank=int(rank),
        session=str(session),
        seq=int(seq),
        fields=dict(fields),
    )


def _rec_out(r: StepRecord | None) -> list[object] | None:
    return None if r is None else [r.step, r.ts_ms, r.tokens, r.voided, r.voided_ms]


def _rec_in(x: list[Any] | None) -> StepRecord | None:
    if x is None:
        return None
    s, ts, tok, v, vm = x
    return StepRecord(int(s), int(ts), int(tok), bool(v), None if vm is None else int(vm))


def _allow_out(a: Allowances) -> list[object]:
    return [a._durations, {k: [list(x), list(y)] for k, (x, y) in a._history.items()}]


def _allow_in(x: list[Any], cfg: BookingConfig) -> Allowances:
    a = Allowances(cfg)
    a._durations = {str(k): [int(v) for v in vs] for k, vs in x[0].items()}
    a._history = {str(k): ([int(v) for v in s], [int(v) for v in w]) for k, (s, w) in x[1].items()}
    return a


def _phases_out(p: _Phases) -> list[object]:
    return [p.open, p.closed, p.overrun, p.last_ckpt]


def _phases_in(x: list[Any], allow: Allowances) -> _Phases:
    p = _Phases(allow)
    p.open = {str(k): int(v) for k, v in x[0].items()}
    p.closed = [(int(a), int(b)) for a, b in x[1]]
    p.starts = [a for a, _ in p.closed]
    p.overrun = [(str(n), int(a), int(b)) for n, a, b in x[2]]
    p.last_ckpt = None if x[3] is None else (int(x[3][0]), int(x[3][1]))
    return p


def dump_fold(fold: TimelineFold, job: str, extra: dict[str, Any] | None = None) -> bytes:
    """The fold as compact bytes: a JSON header (the walk's bounded state, `extra`) and the valid
    step stack delta-encoded, all zlib-compressed (a few bytes a valid step). Only a fold that can
    give its view (not `late`) is worth storing."""
    import json
    import zlib

    w = fold.w
    if w._shared is not None:
        raise ValueError("a view's copy is not a fold")
    head = {
        "v": FOLD_FORMAT,
        "job": job,
        "cfg": cfg_fingerprint(fold.cfg),
        "start_ms": fold.start_ms,
        "frontier": fold.frontier,
        "others_frontier": fold.others_frontier,
        "stepless": fold.stepless_declared,
        "rank0_step": fold.rank0_step,
        "folded": fold.folded,
        "pending": [_ev_out(e) for e in sorted(fold.pending, key=lambda e: (e.ts_ms, e.seq))],
        "run0": [_ev_out(e) for e in fold.run0],
        "allow": _allow_out(w.allow),
        "run_allow": _allow_out(w.run_allow),
        "p0": _phases_out(w.p0),
        "pr": {str(r): [_allow_out(p.allow), _phases_out(p)] for r, p in w.pr.items()},
        "seg": [w.seg_start, w.seg_regime, w.seg_step],
        "steps": [_rec_out(s) for s in w.steps],
        "scalars": [
            w.step_base,
            w.tokens_before,
            w.n_steps,
            w.valid_tokens,
            w.last_ts,
            w.startup_allow,
            w.anchor,
            w.in_startup,
            w.startup_from,
            w.ended,
            w.run_floor,
            w.prev_floor,
            w.run_fresh,
            w.last_alive,
            w.beats,
        ],
        "last_step": _rec_out(w.last_step),
        "voided": [[i, _rec_out(r), p] for i, r, p in w.voided],
        "resumes": w.resumes,
        "ckpts": [list(c) for c in w.ckpts],
        "durations": list(w.durations),
        "n_valid": len(w.v_rec),
        "extra": extra or {},
    }
    body = json.dumps(head, separators=(",", ":")).encode()
    stack = b"".join(
        np.diff(np.frombuffer(a, np.int64), prepend=0).astype("<i8").tobytes() for a in w._stack()
    )
    return _MAGIC + zlib.compress(len(body).to_bytes(8, "little") + body + stack, 1)


def _read_head(data: bytes, cfg: BookingConfig, job: str) -> tuple[dict[str, Any], bytes]:
    """A stored fold's JSON header, checked to be this version's for this job and booking
    configuration, and the step stack's bytes after it."""
    import json
    import zlib

    if not isinstance(data, bytes | bytearray) or not data.startswith(_MAGIC):
        raise FoldFormatError("not a stored fold")
    try:
        raw = zlib.decompress(data[len(_MAGIC) :])
        n = int.from_bytes(raw[:8], "little")
        head = json.loads(raw[8 : 8 + n])
    except (zlib.error, ValueError, UnicodeDecodeError) as e:
        raise FoldFormatError(f"corrupted: {e}") from None
    if not isinstance(head, dict) or head.get("v") != FOLD_FORMAT:
        raise FoldFormatError(f"format {head.get('v') if isinstance(head, dict) else '?'}, not {FOLD_FORMAT}")
    if head.get("job") != job or head.get("cfg") != cfg_fingerprint(cfg):
        raise FoldFormatError("another job or booking configuration")
    return head, raw[8 + n :]


def _run_allow_in(head: dict[str, Any], allow: Allowances, cfg: BookingConfig) -> Allowances:
    """The run's own allowances; a fold stored before the run's startup was learned apart kept
    it in the job's `startup`: moved over."""
    if "run_allow" in head:
        return _allow_in(head["run_allow"], cfg)
    run_allow = Allowances(cfg)
    if RUN_STARTUP in allow._durations:
        run_allow._durations[RUN_STARTUP] = allow._durations.pop(RUN_STARTUP)
    if RUN_STARTUP in allow._history:
        run_allow._history[RUN_STARTUP] = allow._history.pop(RUN_STARTUP)
    return run_allow


def _scalars_in(w: _Walk, sc: list[Any]) -> None:
    if len(sc) != 15 or sc[9] not in (None, ENDED, LAPSED):
        raise FoldFormatError("corrupted: scalars")
    w.step_base, w.tokens_before, w.n_steps, w.valid_tokens = (int(x) for x in sc[:4])
    w.startup_allow, w.anchor, w.startup_from = int(sc[5]), int(sc[6]), int(sc[8])
    last_ts, in_startup = sc[4], sc[7]
    w.last_ts = None if last_ts is None else int(last_ts)
    w.in_startup, w.ended = bool(in_startup), sc[9]
    w.run_floor, w.prev_floor, w.run_fresh = int(sc[10]), int(sc[11]), bool(sc[12])
    w.last_alive, w.beats = int(sc[13]), bool(sc[14])


def _walk_in(w: _Walk, head: dict[str, Any], stack: bytes, k: int, cfg: BookingConfig) -> None:
    """The walk's bounded state and its valid step stack (`k` records), from a stored fold."""
    w.allow = _allow_in(head["allow"], cfg)
    w.run_allow = _run_allow_in(head, w.allow, cfg)
    w.p0 = _phases_in(head["p0"], w.allow)
    w.pr = {int(r): _phases_in(ph, _allow_in(al, cfg)) for r, (al, ph) in head["pr"].items()}
    w.seg_start, w.seg_regime, w.seg_step = ([int(v) for v in s] for s in head["seg"])
    w.steps = [_rec_in(s) for s in head["steps"]]  # type: ignore[misc]
    _scalars_in(w, head["scalars"])
    w.last_step = _rec_in(head["last_step"])
    w.voided = [(int(i), _rec_in(r), None if p is None else int(p)) for i, r, p in head["voided"]]  # type: ignore[misc]
    w.resumes = [(int(a), int(b), int(c)) for a, b, c in head["resumes"]]
    w.ckpts.extend((int(st), int(rec)) for st, rec in head["ckpts"])
    w.durations = deque((int(d) for d in head["durations"]), maxlen=cfg.stall_window)
    for j, a in enumerate(w._stack() if k else ()):
        vals = np.cumsum(np.frombuffer(stack, "<i8", count=k, offset=j * 8 * k))
        a.frombytes(vals.astype(np.int64).tobytes())


def load_fold(data: bytes, cfg: BookingConfig, job: str) -> tuple[TimelineFold, dict[str, Any]]:
    """A fold stored by `dump_fold` and its `extra`; FoldFormatError if it is not one this version
    wrote for this job and booking configuration (its owner rebuilds from the stream)."""
    head, stack = _read_head(data, cfg, job)
    try:
        k = int(head["n_valid"])
        if len(stack) != 5 * 8 * k:
            raise FoldFormatError("truncated step stack")
        f = TimelineFold(cfg, int(head["start_ms"]))
        f.frontier = int(head["frontier"])
        f.others_frontier = int(head.get("others_frontier", f.frontier))
        f.stepless_declared, f.rank0_step = bool(head["stepless"]), bool(head["rank0_step"])
        f.folded = int(head["folded"])
        f.pending = [_ev_in(e, job) for e in head["pending"]]
        f.run0 = [_ev_in(e, job) for e in head["run0"]]
        _walk_in(f.w, head, stack, k, cfg)
    except FoldFormatError:
        raise
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise FoldFormatError(f"corrupted: {e!r}") from None
    extra = head.get("extra")
    return f, extra if isinstance(extra, dict) else {}
