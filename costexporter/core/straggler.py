"""A slow rank priced: how much longer every GPU of a synchronous job was held because one rank
computed longer than the others (docs/accounting.md, "Stragglers").

In a data-parallel step every rank computes, then waits in the collective for the slowest one:
the slow rank reads compute power while its peers read the collective's low spinning power. So
the straggler is the rank with the largest share of time at compute power, and what it costs is
the what-if: had it been as fast as each step's next slowest rank, each step, and so each
GPU's time, would be that much shorter. Over a block of `BLOCK_MS`:

    extra_s = the seconds the slow rank alone was at compute, every other rank waiting
    gpu_s   = ranks x extra_s   (the straggler's own extra compute and each peer's extra wait)

A reading's busy share is where its power sits between the job's spinning level and the rank's
own compute level (a GPU drawing 5% more than its neighbours is not slower). Who is slow is
judged on the block's mean shares (its lead must stand out of what noise gives); what it cost
is counted moment by moment, as the lead of the most busy rank over the next most busy one.
That is each step's lead over that step's own next slowest, whatever the others' step-to-step
jitter (a lead over their average reads high by it); and a power reading that averages a second
(NVML's, nvidia-smi's) keeps it exact at 1 Hz too, since the second in which one rank stops and
the next in which another does differ by just what the one ran longer. The evidence
of a block adds up over windows, each moment once, as the agent's rounds and replay's windows
count them; a block is judged once it is complete. The steps were valid: this is a split of
valid time, never a category of its own.
"""

from __future__ import annotations

import bisect
import functools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from costexporter.core.profiles import Profile

BLOCK_MS = 60_000  # a block: long enough that the ranks' reading noise averages out
# A slow rank is named only when its lead over the next slowest is at least this share of the
# block and this many standard deviations of the other ranks' shares (what noise alone gives).
MIN_SHARE = 0.01
MIN_SPREAD_RATIO = 3.0
MIN_RANKS = 3  # the spread of the others needs two of them
MIN_SEEN = 0.8  # a rank observed for less of the block than this share is not compared
# ... and it led every other rank for at least this share of the time some rank did (a rank last
# now and then by the others' jitter shares that time with all of them; a slow one holds it).
MIN_SOLO_SHARE = 0.5
# A watermark carries the open minutes' evidence of jobs this wide at most (4 numbers a rank).
PERSIST_MAX_RANKS = 512


@dataclass(frozen=True, slots=True)
class Busy:
    """What one block's moments counted so far say, as sums (so windows add up to the whole, each
    moment once, whatever their lengths): per rank, the energy read and the seconds observed while
    some rank worked, the sum and count of its compute readings (its own compute level); the
    lowest reading of a rank spinning in a collective and how many; the steps completed; per rank,
    the seconds it led every other rank (`solo_s`, over the `full_s` seconds every rank was read;
    NaN: evidence stored before these were counted)."""

    energy_j: np.ndarray  # float64 per rank: power x seconds
    seen_s: np.ndarray  # float64 per rank
    hi_sum_w: np.ndarray  # float64 per rank
    hi_n: np.ndarray  # int64 per rank
    spin_w: float = np.inf
    spin_n: int = 0
    steps: int = 0
    solo_s: np.ndarray | None = None  # float64 per rank (None: zeros)
    full_s: float = 0.0

    def add(self, other: Busy | None) -> Busy:
        if other is None:
            return self
        n = max(self.seen_s.size, other.seen_s.size)
        e, seen, hi_sum, hi_n = np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n, np.int64)
        solo = np.zeros(n)
        for x in (self, other):
            for acc, part in ((e, x.energy_j), (seen, x.seen_s), (hi_sum, x.hi_sum_w), (hi_n, x.hi_n)):
                acc[: part.size] += part
            if x.solo_s is not None:
                solo[: x.solo_s.size] += x.solo_s
        return Busy(
            e,
            seen,
            hi_sum,
            hi_n,
            spin_w=min(self.spin_w, other.spin_w),
            spin_n=self.spin_n + other.spin_n,
            steps=self.steps + other.steps,
            solo_s=solo,
            full_s=self.full_s + other.full_s,
        )

    @staticmethod
    def total(parts: list[Busy]) -> Busy:
        """The sum of several blocks' evidence of one window: `add`'s, in one pass over each figure
        where they have the same ranks (`add` itself stays a pair's: a round's hot path, 3x
        faster so)."""
        n = {x.seen_s.size for x in parts}
        if len(parts) < 3 or len(n) > 1:
            return functools.reduce(Busy.add, parts)
        solo = [x.solo_s if x.solo_s is not None else np.zeros(x.seen_s.size) for x in parts]
        return Busy(
            np.stack([x.energy_j for x in parts]).sum(0),
            np.stack([x.seen_s for x in parts]).sum(0),
            np.stack([x.hi_sum_w for x in parts]).sum(0),
            np.stack([x.hi_n for x in parts]).sum(0),
            min(x.spin_w for x in parts),
            sum(x.spin_n for x in parts),
            sum(x.steps for x in parts),
            np.stack(solo).sum(0),
            sum(x.full_s for x in parts),
        )

    def to_json(self) -> list[Any]:
        arrays = [a.round(4).tolist() for a in (self.energy_j, self.seen_s, self.hi_sum_w)]
        return [
            *arrays,
            self.hi_n.tolist(),
            None if np.isinf(self.spin_w) else self.spin_w,
            self.spin_n,
            self.steps,
            None if self.solo_s is None else self.solo_s.round(4).tolist(),
            None if np.isnan(self.full_s) else round(self.full_s, 4),
        ]

    @classmethod
    def from_json(cls, x: list[Any]) -> Busy:  # Any: as json.loads gave it
        e, seen, hi_sum, hi_n, spin_w, spin_n, steps, *lead = x
        # Evidence a release before the moment-by-moment lead stored: NaN, priced as it was.
        solo, full = lead if len(lead) == 2 else (None, None)
        return cls(
            np.asarray(e, np.float64),
            np.asarray(seen, np.float64),
            np.asarray(hi_sum, np.float64),
            np.asarray(hi_n, np.int64),
            np.inf if spin_w is None else float(spin_w),
            int(spin_n),
            int(steps),
            np.asarray(solo, np.float64) if solo is not None else None,
            np.nan if full is None else float(full),
        )


@dataclass(frozen=True, slots=True)
class SlowRank:
    """A block's verdict: `rank` held every GPU `extra_s` longer than the next slowest would."""

    block_ms: int  # the block's start (Unix ms, a multiple of BLOCK_MS)
    rank: int
    extra_s: float  # per GPU
    gpu_s: float  # ranks x extra_s
    lead: float  # its busy share minus the next slowest's


def evidence(
    P: np.ndarray,
    U: np.ndarray,
    counted: np.ndarray,
    moment_ms: np.ndarray,
    cell_ms: int,
    profile: Profile,
    step_ms: np.ndarray | None,
    count_ms: tuple[int | None, int | None] = (None, None),
) -> dict[int, Busy]:
    """Each block's evidence from a window's ranks x moments matrices of power as read (`P`, NaN:
    no reading) and utilization (`U`), `counted`: the moments this window counts, `moment_ms`:
    their times, `step_ms`: the job's step completions (a job that posts none has no step to be
    late for), `count_ms`: the time this window counts (its steps: each counted by one window,
    whether or not a moment of its block is). Moments where every rank waits or idles (a
    checkpoint, a hang) say nothing."""
    n = P.shape[0]
    if n < MIN_RANKS or step_ms is None or step_ms.size == 0:
        return {}
    from_ms, to_ms = count_ms
    keep = np.ones(step_ms.size, bool)
    if from_ms is not None:
        keep &= step_ms >= from_ms
    if to_ms is not None:
        keep &= step_ms < to_ms
    done = (step_ms[keep] // BLOCK_MS) * BLOCK_MS
    # (a round's few steps counted in Python; a trace's many by numpy)
    per_block = (
        Counter(done.tolist())
        if done.size < 256
        else dict(zip(*(a.tolist() for a in np.unique(done, return_counts=True)), strict=True))
    )
    out = {
        b: Busy(np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n, np.int64), steps=k)
        for b, k in per_block.items()
    }
    with np.errstate(invalid="ignore"):
        working = profile.low_max_w <= P  # NaN (no reading) compares False
        # Every moment some rank works counts (a reading that averages a second can straddle
        # compute and the collective); the moments the ranks share add alike to every rank.
        use = counted & working.any(0)
        if not use.any():
            return out
        ou = use & ~np.isnan(P)
        high = ou & (profile.compute_min_w <= P)
        spinning = ou & ~working & (profile.busy_util_pct <= U)
    sec = cell_ms / 1000
    # Moments are in time order: a block is one run of columns, summed at once (those of a block
    # no moment of which counts sum to nothing and are left out).
    block = (moment_ms // BLOCK_MS) * BLOCK_MS
    first = np.flatnonzero(np.concatenate(([True], block[1:] != block[:-1])))
    energy = np.add.reduceat(np.where(ou, P, np.float32(0)), first, axis=1, dtype=np.float64) * sec
    seen = np.add.reduceat(ou, first, axis=1, dtype=np.int64) * sec
    hi_sum = np.add.reduceat(np.where(high, P, np.float32(0)), first, axis=1, dtype=np.float64)
    hi_n = np.add.reduceat(high, first, axis=1, dtype=np.int64)
    sw = np.where(spinning, P, np.float32(np.inf)).min(0)
    spin_w = np.minimum.reduceat(sw, first)
    spin_n = np.add.reduceat(spinning.sum(0), first)
    # The window's compute level of each rank and spinning level, for the moment-by-moment lead.
    # (a rank without a compute reading: the job's mean level)
    n_hi = hi_n.sum(1)
    mean_hi = float(hi_sum.sum() / n_hi.sum()) if n_hi.any() else profile.compute_min_w
    hi = np.where(n_hi > 0, hi_sum.sum(1) / np.maximum(n_hi, 1), mean_hi)
    full = ou.all(0)
    lead_s, leader = _leads(P, full, hi, _spin_of(float(spin_w.min()), int(spin_n.sum()), profile))
    nb = first.size
    if nb > 1:
        leader += np.repeat(np.arange(nb) * n, np.diff(np.append(first, block.size)))
    solo = np.bincount(leader, lead_s, minlength=nb * n).reshape(nb, n) * sec
    full_s = np.add.reduceat(full, first, dtype=np.int64) * sec
    used = np.add.reduceat(use, first, dtype=np.int64)
    for i, a in enumerate(first.tolist()):
        if not used[i]:
            continue
        b = int(block[a])
        out[b] = Busy(
            energy[:, i],
            seen[:, i],
            hi_sum[:, i],
            hi_n[:, i],
            float(spin_w[i]),
            int(spin_n[i]),
            out[b].steps if b in out else 0,
            solo[i],
            float(full_s[i]),
        )
    return out


# Two ranks both within this share of the range of their compute level (or of the spinning
# level) are at the same state: the noise between their readings is no lead.
DEAD_BAND = 0.1


def _leads(P: np.ndarray, full: np.ndarray, hi: np.ndarray, spin: float) -> tuple[np.ndarray, np.ndarray]:
    """Per moment: how far the busiest rank led the next busiest (a share of the moment) and which
    rank that was, over the moments `full` (every rank read: a missing reading may be the one
    still at compute, so such a moment says nothing of who was last; elsewhere 0). A rank's busy
    share is linear in its power between the spinning level and its own compute level `hi`, so two
    ranks' difference in a second averaged over compute, the wait and the collective after it is
    just the time one computed while the other waited. (Moments where every rank is within the
    dead band of its compute level, or of the spinning level, lead nothing: they are told apart
    in watts first, and the shares worked out for the others only.)"""
    m = P.shape[1]
    lead, leader = np.zeros(m, np.float32), np.zeros(m, np.intp)
    span = np.maximum(hi - spin, 1.0)
    busy_w = (spin + (1 - DEAD_BAND) * span).astype(np.float32)[:, None]
    spin_w = (spin + DEAD_BAND * span).astype(np.float32)[:, None]
    with np.errstate(invalid="ignore"):  # (NaN: not a full moment)
        at_compute = (busy_w <= P).all(0)
        spinning = (spin_w >= P).all(0)
    pick = full & ~at_compute & ~spinning
    if not pick.any():
        return lead, leader
    share = P[:, pick] - np.float32(spin)
    share /= span.astype(np.float32)[:, None]
    first, second, top = _top_two(share)
    gap = first - second
    gap[(second >= 1 - DEAD_BAND) | (first <= DEAD_BAND)] = 0
    lead[pick], leader[pick] = gap, top
    return lead, leader


def _top_two(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per column: the largest value, the second largest, and the row of the largest. A few rows of
    many columns: row by row (twice as fast as the reductions down them); else reduced."""
    n, m = x.shape
    if n <= 16 and m >= 1000:
        first, second, top = x[0].copy(), np.full(m, -np.inf, x.dtype), np.zeros(m, np.intp)
        for r in range(1, n):
            row = x[r]
            np.maximum(second, np.minimum(first, row), out=second)
            np.copyto(top, r, where=row > first)
            np.maximum(first, row, out=first)
        return first, second, top
    top = x.argmax(0)
    at = (top, np.arange(m))
    first = x[at]
    x[at] = -np.inf  # (x is the caller's scratch)
    return first, x.max(0), top


# A GPU spinning in a collective draws about this share of its power limit: 157 W of an H100's
# 700 (R8), 124 W of an H200's 700 (R9), ~192 W of a B300's 1,100 (R2).
SPIN_SHARE = 0.2
MIN_SPIN_READINGS = 20


def spin_level(busy: Busy, profile: Profile) -> float:
    """The power of a rank waiting in the collective: the lowest reading of a rank spinning (low
    power, ~100%) where the block has enough of them, else the share of the power limit the field
    measured (readings that average a second hold no pure wait when the waits are short)."""
    return _spin_of(busy.spin_w, busy.spin_n, profile)


def _spin_of(spin_w: float, spin_n: int, profile: Profile) -> float:
    if spin_n >= MIN_SPIN_READINGS or (spin_n and profile.power_limit_w is None):
        return spin_w
    if profile.power_limit_w is not None:
        return max(SPIN_SHARE * profile.power_limit_w, profile.idle_max_w)
    return profile.idle_max_w


# Fewer readings a step than this and a rank's lead cannot be told from where the readings fell
# (measured: at 1 Hz, 2-s steps read 10-45% high): the block is "cannot tell", never guessed.
MIN_READINGS_PER_STEP = 4


def coarse(busy: Busy, interval_ms: int) -> bool:
    """Whether the block's steps are too short for its sampling to tell a slow rank."""
    return _too_short(float(busy.seen_s.max()) if busy.seen_s.size else 0.0, busy.steps, interval_ms)


def _too_short(seen_s: float, steps: int, interval_ms: int) -> bool:
    """Whether `steps` over `seen_s` (the most seconds a rank was read) hold fewer than
    MIN_READINGS_PER_STEP readings each (no steps, nothing read: nothing to tell it by)."""
    return steps > 0 and seen_s > 0 and seen_s * 1000 / steps < MIN_READINGS_PER_STEP * interval_ms


def judge(
    block_ms: int, busy: Busy, n_ranks: int, profile: Profile, min_solo: float = MIN_SOLO_SHARE
) -> SlowRank | None:
    """The block's slow rank, where one rank leads the others by more than noise gives and leads
    them all for at least `min_solo` of the time any rank does (a block without a completed step
    has no step to be late for). A rank's busy share is where its mean power sits between the
    spinning level and its own compute level."""
    seen = busy.seen_s
    if busy.steps == 0 or seen.size < MIN_RANKS or not seen.any() or not busy.hi_n.any():
        return None
    ok = seen >= MIN_SEEN * seen.max()
    if ok.sum() < MIN_RANKS:
        return None
    spin = spin_level(busy, profile)
    hi = np.where(busy.hi_n > 0, busy.hi_sum_w / np.maximum(busy.hi_n, 1), np.nan)
    if not busy.hi_n.all():  # (a rank without a compute reading: the others' median level)
        hi = np.where(np.isnan(hi), np.nanmedian(hi), hi)
    mean_w = busy.energy_j / np.maximum(seen, 1e-9)
    share = np.where(ok, (mean_w - spin) / np.maximum(hi - spin, 1.0), np.nan)
    order = np.argsort(np.where(ok, -share, np.inf))
    s, nxt = int(order[0]), int(order[1])
    lead = float(share[s] - share[nxt])
    others = share[order[1 : int(ok.sum())]]
    spread = float(others.std(ddof=1)) if others.size > 1 else 0.0
    if lead < MIN_SHARE or lead < MIN_SPREAD_RATIO * spread:
        return None
    if busy.solo_s is not None and busy.full_s > 0 and np.isfinite(busy.solo_s).all():
        if busy.solo_s[s] < min_solo * busy.solo_s.sum():
            return None
        # its moments of leading every other rank, over the block's seconds some rank worked
        extra = float(busy.solo_s[s]) / busy.full_s * float(seen.max())
    else:  # evidence stored by a release that did not count them: the lead over the average
        extra = lead * float(seen.max())
    if extra <= 0:
        return None
    return SlowRank(block_ms, s, extra, n_ranks * extra, lead)


# A slow rank is named (not yet priced: a block is) once the evidence of the latest windows that
# hold this many steps says so, whichever block they fall in; evidence older than RECENT_MS is
# not kept for it.
NAME_STEPS = 5
RECENT_MS = 5 * BLOCK_MS
# Those few steps' jitter alone makes some rank last in most of them now and then: to be named
# early it must have led every other rank for this share of the time any rank did, and for
# this many sampling intervals (a lead shorter than an interval shows in a moment now and then)
# or this long, whichever is less (seconds of lead are more than a few steps' jitter gives).
NAME_SOLO_SHARE = 0.8
NAME_SOLO_INTERVALS = 3
NAME_SOLO_MS = 1500


@dataclass(frozen=True, slots=True)
class Named:
    """A rank slowing the job now: the share of the job's time every other rank waited on it over
    its latest steps (at least NAME_STEPS)."""

    rank: int
    wait_ratio: float


@dataclass(slots=True)
class Recent:
    """The latest windows' evidence as running sums, so the evidence of any latest run of them is
    one subtraction (a round judges a few runs, however many windows it looks back over). Per
    window: its end, the running sums of its per-rank figures (energy, seen, compute sum and
    count, lead: the rows of one array), of its steps and of its full seconds, and its spinning
    floor and readings; `base`: the running sums before the first window kept."""

    until_ms: list[int] = field(default_factory=list)
    sums: list[np.ndarray] = field(default_factory=list)  # (5, ranks) float64, running
    steps: list[int] = field(default_factory=list)  # running
    full_s: list[float] = field(default_factory=list)  # running
    spin: list[tuple[float, int]] = field(default_factory=list)
    base: tuple[np.ndarray | None, int, float] = (None, 0, 0.0)

    def add(self, until_ms: int, busy: Busy) -> None:
        old = next((i for i, t in enumerate(self.until_ms) if t > until_ms - RECENT_MS), len(self.until_ms))
        if old:
            self.base = (self.sums[old - 1], self.steps[old - 1], self.full_s[old - 1])
            for xs in (self.until_ms, self.sums, self.steps, self.full_s, self.spin):
                del xs[:old]
        solo = busy.solo_s if busy.solo_s is not None else np.zeros(busy.seen_s.size)
        row = np.stack([busy.energy_j, busy.seen_s, busy.hi_sum_w, busy.hi_n.astype(np.float64), solo])
        last = self.sums[-1] if self.sums else self.base[0]
        if last is not None:
            n = max(row.shape[1], last.shape[1])
            if last.shape[1] < n:  # a job wider than before: the sums so far widened with zeros
                self.sums = [_wide(x, n) for x in self.sums]
                if self.base[0] is not None:
                    self.base = (_wide(self.base[0], n), *self.base[1:])
            row = _wide(row, n) + _wide(last, n)
        self.until_ms.append(until_ms)
        self.sums.append(row)
        self.steps.append((self.steps[-1] if self.steps else self.base[1]) + busy.steps)
        self.full_s.append((self.full_s[-1] if self.full_s else self.base[2]) + busy.full_s)
        self.spin.append((busy.spin_w, busy.spin_n))

    def latest(self, want: int) -> tuple[int, np.ndarray, int, float]:
        """The latest windows that hold at least `want` steps (every window, where fewer): the
        index of the first, their per-rank sums (the rows of `sums`), steps and full seconds."""
        i = bisect.bisect_right(self.steps, self.steps[-1] - want)
        before = (self.sums[i - 1], self.steps[i - 1], self.full_s[i - 1]) if i > 0 else self.base
        s = self.sums[-1] - before[0] if before[0] is not None else self.sums[-1]
        return i, s, self.steps[-1] - before[1], self.full_s[-1] - before[2]

    def busy(self, i: int, s: np.ndarray, steps: int, full_s: float) -> Busy:
        """`latest`'s figures as evidence to judge."""
        spin = self.spin[i:]
        return Busy(
            s[0],
            s[1],
            s[2],
            np.rint(s[3]).astype(np.int64),
            min(w for w, _ in spin),
            sum(k for _, k in spin),
            steps,
            s[4],
            full_s,
        )

    def copy(self) -> Recent:
        return Recent(
            list(self.until_ms),
            list(self.sums),
            list(self.steps),
            list(self.full_s),
            list(self.spin),
            self.base,
        )


def _wide(a: np.ndarray, n: int) -> np.ndarray:
    """Rows of per-rank sums, widened with zeros to `n` ranks."""
    return a if a.shape[1] == n else np.pad(a, ((0, 0), (0, n - a.shape[1])))


@dataclass(slots=True)
class Ledger:
    """The blocks still open (evidence so far) and the slow ranks judged: per rank, the GPU-seconds
    and blocks. The agent carries it from round to round; replay from window to window. The
    latest windows' evidence (`recent`, in memory only) names a slow rank before its block ends:
    `now` (the latest window's verdict), `named` (when each rank was first named)."""

    open: dict[int, Busy] = field(default_factory=dict)
    gpu_s: dict[int, float] = field(default_factory=dict)
    blocks: dict[int, int] = field(default_factory=dict)
    coarse: int = 0  # blocks whose steps were too short for the sampling: cannot tell
    recent: Recent = field(default_factory=Recent)
    now: Named | None = None
    named: dict[int, int] = field(default_factory=dict)  # rank -> first named (Unix ms)

    def add(self, found: dict[int, Busy]) -> None:
        for b, busy in found.items():
            self.open[b] = busy.add(self.open.get(b))

    def name(
        self, found: dict[int, Busy], until_ms: int, n_ranks: int, interval_ms: int, profile: Profile
    ) -> Named | None:
        """The rank slowing the job now (`now`), after a window's evidence `found` (counted up to
        `until_ms`): judged as a block is, on the latest windows' evidence back to NAME_STEPS
        steps, then twice, four times as many... up to RECENT_MS (a small lead needs more steps to
        stand out; a large one is named at once). None: no rank named, or too short to tell."""
        r = self.recent
        if found:
            r.add(until_ms, Busy.total(list(found.values())))
        self.now = None
        want = NAME_STEPS
        least = min(NAME_SOLO_INTERVALS * interval_ms, NAME_SOLO_MS) / 1000
        while r.steps:
            i, s, steps, full_s = r.latest(want)
            seen = float(s[1].max())
            if steps < NAME_STEPS or _too_short(seen, steps, interval_ms):
                return None  # too few steps yet, or too short for the sampling
            # (no rank leads enough of the time to be named: no need to judge; NaN: unknown)
            top = float(s[4].max())
            if top >= NAME_SOLO_SHARE * float(s[4].sum()) and top >= least:
                v = judge(0, r.busy(i, s, steps, full_s), n_ranks, profile, NAME_SOLO_SHARE)
                if v is not None and s[4][v.rank] >= least:
                    self.now = Named(v.rank, v.extra_s / seen)
                    self.named.setdefault(v.rank, r.until_ms[-1])
                    return self.now
            if i == 0:
                break
            want = 2 * steps
        return None

    def copy(self) -> Ledger:
        return Ledger(
            dict(self.open),
            dict(self.gpu_s),
            dict(self.blocks),
            self.coarse,
            self.recent.copy(),
            self.now,
            dict(self.named),
        )

    def __bool__(self) -> bool:
        return bool(self.open or self.gpu_s or self.coarse)

    def to_json(self) -> dict[str, Any]:
        """The ledger to store with a watermark: the open minutes' evidence only for jobs of up to
        PERSIST_MAX_RANKS ranks (a wider job's agent keeps it in memory; a restart loses the
        minute it was in, which is then not judged)."""
        narrow = all(busy.seen_s.size <= PERSIST_MAX_RANKS for busy in self.open.values())
        return {
            "open": {str(b): busy.to_json() for b, busy in self.open.items()} if narrow else {},
            "gpu_s": {str(r): round(x, 3) for r, x in self.gpu_s.items()},
            "blocks": {str(r): n for r, n in self.blocks.items()},
            "coarse": self.coarse,
        }

    @classmethod
    def from_json(cls, x: Any) -> Ledger:  # Any: as json.loads gave it
        """The stored ledger; a damaged one is empty (its open minutes are lost, nothing else)."""
        try:
            return cls(
                {int(b): Busy.from_json(v) for b, v in x.get("open", {}).items()},
                {int(r): float(v) for r, v in x.get("gpu_s", {}).items()},
                {int(r): int(v) for r, v in x.get("blocks", {}).items()},
                int(x.get("coarse", 0)),
            )
        except (AttributeError, TypeError, ValueError):
            return cls()

    def close(
        self, until_ms: int | None, n_ranks: int, interval_ms: int, profile: Profile, gpus: int | None = None
    ) -> list[SlowRank]:
        """Judge the blocks that end at or before `until_ms` (None: every block), booking each slow
        rank's GPU-seconds on `gpus` GPUs (an agent: its own; None: every rank's, `gpu_s`)."""
        done = sorted(b for b in self.open if until_ms is None or b + BLOCK_MS <= until_ms)
        out = []
        for b in done:
            busy = self.open.pop(b)
            if coarse(busy, interval_ms):
                self.coarse += 1
                continue
            v = judge(b, busy, n_ranks, profile)
            if v is not None:
                out.append(v)
                booked = v.gpu_s if gpus is None else gpus * v.extra_s
                self.gpu_s[v.rank] = self.gpu_s.get(v.rank, 0.0) + booked
                self.blocks[v.rank] = self.blocks.get(v.rank, 0) + 1
        return out
