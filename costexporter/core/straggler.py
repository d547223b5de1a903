"""A slow rank priced: how much longer every GPU of a synchronous job was held because one rank
computed longer than the others (docs/accounting.md, "Stragglers").

In a data-parallel step every rank computes, then waits in the collective for the slowest one:
the slow rank reads compute power while its peers read the collective's low spinning power. So
the straggler is the rank with the largest share of time at compute power, and what it costs is
the what-if: had it been as fast as the next slowest rank, each step, and so each GPU's time,
would be that much shorter. Over a block of `BLOCK_MS`:

    extra_s = (busy share of the slowest - busy share of the next slowest) x the block's seconds
    gpu_s   = ranks x extra_s   (the straggler's own extra compute and each peer's extra wait)

A reading's busy share is where its power sits between the job's spinning level and the rank's
own compute level (a GPU drawing 5% more than its neighbours is not slower); a power reading
that averages a second (NVML's, nvidia-smi's) keeps the share exact at 1 Hz too. The evidence
of a block adds up over windows, each moment once, as the agent's rounds and replay's windows
count them; a block is judged once it is complete. The steps were valid: this is a split of
valid time, never a category of its own.
"""

from __future__ import annotations

import itertools
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
# A watermark carries the open minutes' evidence of jobs this wide at most (4 numbers a rank).
PERSIST_MAX_RANKS = 512


@dataclass(frozen=True, slots=True)
class Busy:
    """What one block's moments counted so far say, as sums (so windows add up to the whole, each
    moment once, whatever their lengths): per rank, the energy read and the seconds observed while
    some rank worked, the sum and count of its compute readings (its own compute level); the
    lowest reading of a rank spinning in a collective and how many; the steps completed."""

    energy_j: np.ndarray  # float64 per rank: power x seconds
    seen_s: np.ndarray  # float64 per rank
    hi_sum_w: np.ndarray  # float64 per rank
    hi_n: np.ndarray  # int64 per rank
    spin_w: float = np.inf
    spin_n: int = 0
    steps: int = 0

    def add(self, other: Busy | None) -> Busy:
        if other is None:
            return self
        n = max(self.seen_s.size, other.seen_s.size)
        e, seen, hi_sum, hi_n = np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n, np.int64)
        for x in (self, other):
            for acc, part in ((e, x.energy_j), (seen, x.seen_s), (hi_sum, x.hi_sum_w), (hi_n, x.hi_n)):
                acc[: part.size] += part
        return Busy(
            e,
            seen,
            hi_sum,
            hi_n,
            spin_w=min(self.spin_w, other.spin_w),
            spin_n=self.spin_n + other.spin_n,
            steps=self.steps + other.steps,
        )

    def to_json(self) -> list[Any]:
        arrays = [a.round(4).tolist() for a in (self.energy_j, self.seen_s, self.hi_sum_w)]
        return [
            *arrays,
            self.hi_n.tolist(),
            None if np.isinf(self.spin_w) else self.spin_w,
            self.spin_n,
            self.steps,
        ]

    @classmethod
    def from_json(cls, x: list[Any]) -> Busy:  # Any: as json.loads gave it
        e, seen, hi_sum, hi_n, spin_w, spin_n, steps = x
        return cls(
            np.asarray(e, np.float64),
            np.asarray(seen, np.float64),
            np.asarray(hi_sum, np.float64),
            np.asarray(hi_n, np.int64),
            np.inf if spin_w is None else float(spin_w),
            int(spin_n),
            int(steps),
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
    lo, hi = count_ms
    keep = np.ones(step_ms.size, bool)
    if lo is not None:
        keep &= step_ms >= lo
    if hi is not None:
        keep &= step_ms < hi
    done = step_ms[keep]
    starts, counts = np.unique((done // BLOCK_MS) * BLOCK_MS, return_counts=True)
    out = {
        b: Busy(np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n, np.int64), steps=k)
        for b, k in zip(starts.tolist(), counts.tolist(), strict=True)
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
    w = np.where(ou, P, np.float32(0))
    hw = np.where(high, P, np.float32(0))
    sw = np.where(spinning, P, np.float32(np.inf)).min(0)
    n_spin = spinning.sum(0)
    # Moments are in time order: a block is one run of columns, each summed as a slice.
    block = (moment_ms // BLOCK_MS) * BLOCK_MS
    edges = np.flatnonzero(np.concatenate(([True], block[1:] != block[:-1], [True])))
    sec = cell_ms / 1000
    for a, z in itertools.pairwise(edges.tolist()):
        if not use[a:z].any():
            continue
        b = int(block[a])
        out[b] = Busy(
            w[:, a:z].sum(1, dtype=np.float64) * sec,
            ou[:, a:z].sum(1) * sec,
            hw[:, a:z].sum(1, dtype=np.float64),
            high[:, a:z].sum(1).astype(np.int64),
            float(sw[a:z].min()),
            int(n_spin[a:z].sum()),
            out[b].steps if b in out else 0,
        )
    return out


# A GPU spinning in a collective draws about this share of its power limit: 157 W of an H100's
# 700 (R8), 124 W of an H200's 700 (R9), ~192 W of a B300's 1,100 (R2).
SPIN_SHARE = 0.2
MIN_SPIN_READINGS = 20


def spin_level(busy: Busy, profile: Profile) -> float:
    """The power of a rank waiting in the collective: the lowest reading of a rank spinning (low
    power, ~100%) where the block has enough of them, else the share of the power limit the field
    measured (readings that average a second hold no pure wait when the waits are short)."""
    if busy.spin_n >= MIN_SPIN_READINGS or (busy.spin_n and profile.power_limit_w is None):
        return busy.spin_w
    if profile.power_limit_w is not None:
        return max(SPIN_SHARE * profile.power_limit_w, profile.idle_max_w)
    return profile.idle_max_w


# Fewer readings a step than this and a rank's lead cannot be told from where the readings fell
# (measured: at 1 Hz, 2-s steps read 10-45% high): the block is "cannot tell", never guessed.
MIN_READINGS_PER_STEP = 4


def coarse(busy: Busy, interval_ms: int) -> bool:
    """Whether the block's steps are too short for its sampling to tell a slow rank."""
    if busy.steps == 0 or not busy.seen_s.any():
        return False
    return float(busy.seen_s.max()) * 1000 / busy.steps < MIN_READINGS_PER_STEP * interval_ms


def judge(block_ms: int, busy: Busy, n_ranks: int, profile: Profile) -> SlowRank | None:
    """The block's slow rank, where one rank leads the others by more than noise gives (a block
    without a completed step has no step to be late for). A rank's busy share is where its mean
    power sits between the spinning level and its own compute level."""
    seen = busy.seen_s
    if busy.steps == 0 or seen.size < MIN_RANKS or not seen.any() or not busy.hi_n.any():
        return None
    ok = seen >= MIN_SEEN * seen.max()
    if ok.sum() < MIN_RANKS:
        return None
    spin = spin_level(busy, profile)
    hi = np.where(busy.hi_n > 0, busy.hi_sum_w / np.maximum(busy.hi_n, 1), np.nan)
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
    extra = lead * float(seen.max())
    return SlowRank(block_ms, s, extra, n_ranks * extra, lead)


@dataclass(slots=True)
class Ledger:
    """The blocks still open (evidence so far) and the slow ranks judged: per rank, the GPU-seconds
    and blocks. The agent carries it from round to round; replay from window to window."""

    open: dict[int, Busy] = field(default_factory=dict)
    gpu_s: dict[int, float] = field(default_factory=dict)
    blocks: dict[int, int] = field(default_factory=dict)
    coarse: int = 0  # blocks whose steps were too short for the sampling: cannot tell

    def add(self, found: dict[int, Busy]) -> None:
        for b, busy in found.items():
            self.open[b] = busy.add(self.open.get(b))

    def copy(self) -> Ledger:
        return Ledger(dict(self.open), dict(self.gpu_s), dict(self.blocks), self.coarse)

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
