"""Classify every sample of a job into a band (docs/background.md, the power bands), vectorized.

A job's samples are laid on a shared time grid, a matrix of ranks x moments: samples of
different GPUs and hosts within half a grid step are the same moment. A rank without a sample
at a moment holds its last value for up to `hold` (the unobserved-gap limit). Per-GPU bands come
from the profile's power and utilization thresholds; the job-level signatures (deadlock,
checkpoint, starvation) are column reductions over that matrix. Nothing here loops over samples.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from costexporter.core import bandtable
from costexporter.core import straggler as straggler_mod
from costexporter.core.model import Band
from costexporter.core.profiles import Profile, profile_edges


@dataclass(slots=True)
class BandResult:
    band: np.ndarray  # int8 per input sample, in input order
    grid_ms: int  # the grid actually used (never finer than the sampling interval)
    interval_ms: int  # the job's typical sampling interval
    straggler_rank: int | None  # the rank lowest on average during starvation
    signature_moments: int  # moments in a confirmed deadlock/checkpoint signature
    # Confirmed signature runs: (start ms, end ms, the ranks at ~0% through most of it). R2: the
    # 0% rank is the one that left the collective (rank 0 writing a checkpoint, or R4's rank 3).
    signatures: list[tuple[int, int, list[int]]] = field(default_factory=list)
    carry: RunCarry | None = None  # the run open at `carry_at_ms` (None: none open there)
    starved: Starved | None = None  # the straggler's evidence (None: no starvation counted)
    # Per block (its start, Unix ms): each rank's time at compute power over the moments counted
    # (core/straggler.py: the slow rank's lead, priced).
    busy: dict[int, straggler_mod.Busy] = field(default_factory=dict)
    # When each slow rank was first named (`straggler.Ledger.name`, window by window; replay's)
    named: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Starved:
    """Per rank, its utilization summed over the starvation moments where it read mid power, and
    how many: sums of windows add up to the whole trace's (`add`), the straggler is the rank
    lowest on average (`straggler`)."""

    util_sum: np.ndarray  # float64 per rank
    moments: np.ndarray  # int per rank

    def add(self, other: Starved | None) -> Starved:
        if other is None:
            return self
        n = max(self.util_sum.size, other.util_sum.size)
        s, m = np.zeros(n), np.zeros(n, np.int64)
        for x in (self, other):
            s[: x.util_sum.size] += x.util_sum
            m[: x.moments.size] += x.moments
        return Starved(s, m)


def straggler(starved: Starved | None) -> int | None:
    """The rank lowest on average during starvation (None: no rank read mid power then)."""
    if starved is None or not starved.moments.any():
        return None
    c = starved.moments
    mean = np.where(c > 0, starved.util_sum / np.maximum(c, 1), np.inf)
    return int(np.argmin(mean))


@dataclass(frozen=True, slots=True)
class RunCarry:
    """A signature run open at `at_ms`, as classified from the samples before: where it started,
    its candidate and confirmed moments before `at_ms` and, per rank, how many of the confirmed
    ones it was at ~0%. A window that starts later carries it instead of holding the samples
    (a checkpoint signature becomes a deadlock only after its allowance, up to hours)."""

    at_ms: int
    start_ms: int
    moments: int
    confirmed: int
    zero: dict[int, int]

    def to_json(self) -> list[object]:
        return [
            self.at_ms,
            self.start_ms,
            self.moments,
            self.confirmed,
            {str(k): v for k, v in self.zero.items()},
        ]

    @classmethod
    def from_json(cls, x: list[Any] | None) -> RunCarry | None:  # Any: as json.loads gave it
        if not x:
            return None
        at, start, moments, confirmed, zero = x
        return cls(
            int(at), int(start), int(moments), int(confirmed), {int(k): int(v) for k, v in zero.items()}
        )


def sampling_interval_ms(rank: np.ndarray, ts_ms: np.ndarray) -> int:
    """The typical sampling interval: median spacing of consecutive samples of one rank."""
    if ts_ms.size < 2:
        return 1000
    # A bounded prefix is plenty for a median and keeps this O(1) in the trace's size.
    rank, ts_ms = rank[:200_001], ts_ms[:200_001]
    same = rank[1:] == rank[:-1]
    d = (ts_ms[1:] - ts_ms[:-1])[same]
    d = d[d > 0]
    return int(np.median(d)) if d.size else 1000


def classify(
    rank: np.ndarray,
    ts_ms: np.ndarray,
    power_w: np.ndarray,
    util_pct: np.ndarray,
    n_ranks: int,
    profile: Profile,
    *,
    grid_ms: int = 1000,
    gap_intervals: float = 3.0,
    checkpoint_allowance_ms: Callable[[np.ndarray], np.ndarray] | int = 15 * 60 * 1000,
    interval_ms: int | None = None,
    step_ms: np.ndarray | None = None,
    carry: RunCarry | None = None,
    carry_at_ms: int | None = None,
    phase_ms: float | None = None,
    count_from_ms: int | None = None,
    count_to_ms: int | None = None,
) -> BandResult:
    """Band of each sample. Samples must be sorted by (rank, ts).

    `phase_ms`: the trace's sampling phase (`sampling_phase`), where the caller classifies it in
    windows; the straggler's evidence (`BandResult.starved`) counts the moments in
    [`count_from_ms`, `count_to_ms`) only: each moment once over windows that overlap.

    `carry`: the signature run open at `carry.at_ms` in the samples before this window (the
    window then needs to hold only a few moments before that time); `carry_at_ms`: where to
    describe the run open for the next window (`BandResult.carry`).

    `step_ms`: the job's step completion times, where known. Then a moment where every observed
    rank (one GPU is enough) spins at ~100% utilization at low power with no step around it is
    a deadlock candidate too: a hang looks like that on a single GPU (measured on an H200: a
    thread spinning on a device flag draws idle power at 100% utilization).

    `checkpoint_allowance_ms` is either a constant or a function mapping the start times of
    signature runs (ms) to the allowance in force then (learned from the job's checkpoints).
    """
    n = ts_ms.size
    if interval_ms is None:
        interval_ms = sampling_interval_ms(rank, ts_ms)
    if n == 0:
        return BandResult(np.zeros(0, np.int8), grid_ms, interval_ms, None, 0)
    # Moments are one sampling interval wide; the grid is how long a signature must persist.
    grid = max(int(grid_ms), int(interval_ms))
    cell = max(int(interval_ms), 1)
    hold = int(gap_intervals * interval_ms)

    read_w = power_w  # as read: the slow rank's evidence weighs every reading, ramps included
    power_w = deramp(rank, power_w, profile, int(interval_ms))
    climbed = None
    k_ramp, _ = ramp_samples(int(interval_ms))
    if k_ramp and n >= 3:
        climbing = _climbs(rank, power_w, util_pct, profile, k_ramp)
        if climbing is not power_w:
            climbed = climbing != power_w
            power_w = climbing
    tick, t0 = moments(rank, ts_ms, cell, phase_ms)
    n_ticks = int(tick.max()) + 1
    if n_ticks <= 4 * n + 1024:  # dense numbering in O(n); sparse traces fall back to unique
        used = np.bincount(tick, minlength=n_ticks) > 0
        cols = np.flatnonzero(used)
        col = (np.cumsum(used) - 1)[tick]
    else:
        cols, col = np.unique(tick, return_inverse=True)
    n_cols = cols.size
    shape = (n_ranks, n_cols)
    C = None  # climbing readings (`_climbs`), per moment
    block_rank = _dense_blocks(rank, col, n_ranks, n_cols)
    if block_rank is not None:  # the samples are the matrix already: rows copied, nothing held
        P = np.empty(shape, np.float32)
        U = np.empty(shape, np.float32)
        P[block_rank] = power_w.reshape(shape)
        U[block_rank] = util_pct.reshape(shape)
        if climbed is not None:
            C = np.empty(shape, bool)
            C[block_rank] = climbed.reshape(shape)
        present = None
    else:
        # One flat index for every scatter and gather (much faster than 2-D fancy indexing).
        flat = np.asarray(rank, np.intp) * n_cols + col
        # -1 W marks "no sample at this moment" (ingest rejects negative power; NaN stays NaN).
        P = np.full(shape, -1.0, np.float32)
        U = np.full(shape, np.nan, np.float32)
        P.ravel()[flat] = power_w
        U.ravel()[flat] = util_pct
        present = P != -1.0
        if climbed is not None:
            C = np.zeros(shape, bool)
            C.ravel()[flat] = climbed

    if present is None or present.all():  # every rank sampled at every moment: nothing to hold
        obs = np.ones(shape, bool)
    else:
        obs = _hold_last(P, U, C, present, cols, cell, hold)

    _, mid, low, _, busy, zero = _levels(P, U, profile)
    mid &= obs
    low &= obs
    n_obs = _ranks_per_moment(obs)
    # The cross-rank signature holds a little above the low edge: at the onset of a checkpoint
    # wait (0.5-1 s) the writer reads ~1.1x and the waiters ~1.2x the waiters' settled level.
    with np.errstate(invalid="ignore"):
        sig_low = obs & (onset_edge_w(profile) > P)
    if C is not None:
        # A rank whose climb into compute begins in a wait's last moment does not end the wait.
        sig_low |= C

    dead, ckpt, n_confirmed, signatures, carry_out = _signature(
        sig_low,
        busy,
        zero,
        n_obs,
        cols,
        cell,
        grid,
        t0,
        step_ms,
        checkpoint_allowance_ms,
        carry,
        carry_at_ms,
        spin_low=low,
    )

    # Starvation: most ranks at mid power and at least one well below ~100% utilization.
    starv = (n_obs >= 2) & ((_ranks_per_moment(mid) * 2) >= n_obs) & (mid & ~busy & ~np.isnan(U)).any(0)

    # Every sample is classified from its own reading; the job-level signatures of its moment
    # are laid over it (so a grid step can hold two bands, by duration).
    band, s_mid = _reading_bands(power_w, util_pct, profile, lone=n_ranks == 1)
    # The moment's signature, one gather for all three (a checkpoint over a deadlock over
    # starvation, as they are laid in that order).
    sig = np.zeros(n_cols, np.int8)
    sig[starv] = 1
    sig[dead] = 2
    sig[ckpt] = 3
    if sig.any():
        at = sig[col]
        band[s_mid & (at == 1)] = Band.STARVATION
        band[at == 2] = Band.DEADLOCK
        band[at == 3] = Band.CHECKPOINT

    starved = None
    at_ms = t0 + cols * cell
    counted = np.ones(n_cols, bool)
    if count_from_ms is not None:  # a window: the moments an earlier one counted are not again
        counted &= at_ms >= count_from_ms
    if count_to_ms is not None:  # nor those the next one will
        counted &= at_ms < count_to_ms
    starv = starv & counted
    evidence = {}
    if n_ranks >= straggler_mod.MIN_RANKS and step_ms is not None and step_ms.size:
        # The power as read (ramps weigh as they were read), NaN where a reading is missing: P
        # itself where nothing was de-ramped or held, else P with those cells put back.
        R = P
        if present is not None:
            R = P.copy()
            R[~present] = np.nan
        changed = np.flatnonzero(power_w != read_w) if power_w is not read_w else None
        if changed is not None and changed.size:
            R = R.copy() if R is P else R
            at = (
                block_rank[changed // n_cols] * n_cols + changed % n_cols
                if block_rank is not None
                else flat[changed]
            )
            R.ravel()[at] = read_w[changed]
        evidence = straggler_mod.evidence(
            R, U, counted & ~dead & ~ckpt, at_ms, cell, profile, step_ms, (count_from_ms, count_to_ms)
        )
    if starv.any():
        u = np.where(mid[:, starv], U[:, starv], np.nan)
        starved = Starved(np.asarray(np.nansum(u, 1, dtype=np.float64)), (~np.isnan(u)).sum(1))

    return BandResult(
        band=band,
        grid_ms=grid,
        interval_ms=int(interval_ms),
        straggler_rank=straggler(starved),
        signature_moments=n_confirmed,
        starved=starved,
        signatures=signatures,
        carry=carry_out,
        busy=evidence,
    )


def _hold_last(
    P: np.ndarray,
    U: np.ndarray,
    C: np.ndarray | None,
    present: np.ndarray,
    cols: np.ndarray,
    cell: int,
    hold: int,
) -> npt.NDArray[np.bool_]:
    """Each rank's moments without a sample take its last sample of at most `hold` ms before
    (power, utilization and climbing, in place); the others read NaN. Returns the moments
    observed. Only the missing moments are visited: a run of them takes the sample just
    before it in its row (a logger's gaps are few, the samples many)."""
    n_cols = present.shape[1]
    obs = present.copy()
    miss = np.flatnonzero(~present.ravel())
    if miss.size == 0:
        return obs
    col = miss % n_cols
    head = np.ones(miss.size, bool)
    head[1:] = miss[1:] != miss[:-1] + 1
    head |= col == 0  # a row's first moment has nothing before it in its row
    starts = np.flatnonzero(head)
    lens = np.diff(np.append(starts, miss.size))
    src = np.repeat(miss[starts] - 1, lens)  # the sample before the run, where the row has one
    ok = np.repeat(col[starts] > 0, lens)
    ok[ok] = (cols[col[ok]] - cols[src[ok] % n_cols]) * cell <= hold
    dst, src = miss[ok], src[ok]
    p, u = P.reshape(-1), U.reshape(-1)
    p[dst], u[dst] = p[src], u[src]
    p[miss[~ok]] = np.nan
    if C is not None:
        c = C.reshape(-1)
        c[dst] = c[src]
    obs.reshape(-1)[dst] = True
    return obs


def _dense_blocks(rank: np.ndarray, col: np.ndarray, n_ranks: int, n_cols: int) -> np.ndarray | None:
    """Each block's rank when the samples are every rank's reading at every moment, one each,
    a rank's in one block of `n_cols` (a steady logger's trace, GPUs in any rank order): the
    moments x ranks matrix already, its rows in another order. None otherwise."""
    if rank.size != n_ranks * n_cols or rank.size == 0:
        return None
    r = rank.reshape(n_ranks, n_cols)
    block_rank = r[:, 0]
    if block_rank.min() < 0 or not (np.bincount(block_rank, minlength=n_ranks) == 1).all():
        return None
    if not ((r == block_rank[:, None]).all() and (col.reshape(n_ranks, n_cols) == np.arange(n_cols)).all()):
        return None
    return block_rank


def reading_bands(power_w: np.ndarray, util_pct: np.ndarray, profile: Profile) -> np.ndarray:
    """Each reading's band from itself alone (no job signature: those need a job's moments):
    the band of a GPU no job holds, or one whose job has no moment classified yet."""
    return _reading_bands(np.asarray(power_w, np.float64), np.asarray(util_pct, np.float64), profile)[0]


def _reading_bands(
    power_w: np.ndarray, util_pct: np.ndarray, profile: Profile, lone: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """(band per reading from its own power and utilization, the mid-power mask). `lone`: the
    job has one GPU, which has no peer to wait on: busy at mid power is compute (a memory-bound
    kernel), never communication."""
    table = bandtable.current()
    band = table.classify_readings(power_w, util_pct, profile_edges(profile), lone)
    with np.errstate(invalid="ignore"):
        s_mid = (profile.low_max_w <= power_w) & (profile.compute_min_w > power_w)
    return band, s_mid


def _signature(
    low: np.ndarray,
    busy: np.ndarray,
    zero: np.ndarray,
    n_obs: np.ndarray,
    cols: np.ndarray,
    cell: int,
    grid: int,
    t0: int,
    step_ms: np.ndarray | None,
    checkpoint_allowance_ms: Callable[[np.ndarray], np.ndarray] | int,
    carry: RunCarry | None = None,
    carry_at_ms: int | None = None,
    spin_low: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, int, list[tuple[int, int, list[int]]], RunCarry | None]:
    """The deadlock and checkpoint moments (column masks), how many moments confirmed, the
    confirmed runs with their ranks at ~0%, and the run open at `carry_at_ms` (`RunCarry`).

    `carry`: the run open at `carry.at_ms` as a classification of the samples before saw it; the
    window's run through that time is that run (its start, length and ~0% counts before then
    are the carry's), so a window need not hold a long signature's start."""
    # Deadlock / checkpoint signature: everyone low, >= 1 rank at ~0%, the majority at ~100%,
    # persisting for two consecutive moments and at least one grid step (R2, R3 in docs/background.md).
    n_lowbusy = _ranks_per_moment(low & busy)
    cand = (n_obs >= 2) & (_ranks_per_moment(low) == n_obs) & (low & zero).any(0) & (n_lowbusy * 2 >= n_obs)
    if step_ms is not None:
        cand |= _spinning(low if spin_low is None else spin_low, busy, n_obs, cols, t0, cell, step_ms)
    cand = _bridge(cand, cols)
    times = t0 + cols * cell
    # Consecutive samples: a moment where the logger wrote nothing at all does not end a run,
    # nor does one where most ranks wrote nothing (after a logger hiccup, an early-stamped GPU 0
    # line alone in its moment): runs are cut on the other moments alone.
    starts = cand.copy()
    counted = np.flatnonzero(cand | (n_obs * 2 >= zero.shape[0]))
    if counted.size > 1:
        c = cand[counted]
        starts[counted[1:]] &= ~(c[:-1] & (np.diff(cols[counted]) * cell <= grid))
    run_id = np.cumsum(starts) - 1
    start_cols = np.flatnonzero(starts)
    run_start_ms = times[start_cols]
    # The carried run: the window's run through the carry's time, its part before it the carry's.
    cont, before = -1, np.zeros(cols.size, bool)
    if carry is not None:
        i = int(np.searchsorted(times, carry.at_ms)) - 1
        if i < 0 and cand.size and cand[0] and times[0] - carry.at_ms <= grid:
            i = 0  # no moment before it in the window (samples since a restart): the first goes on
        if i >= 0 and cand[i]:
            cont = int(run_id[i])
            run_start_ms[cont] = carry.start_ms
            before = (run_id == cont) & (times < carry.at_ms) & cand
    confirmed = cand.copy()
    run_len = np.zeros(start_cols.size, np.int64)
    if cand.any():
        in_run = np.flatnonzero(cand & ~before)
        run_len = np.bincount(run_id[in_run], minlength=start_cols.size)
        if cont >= 0:
            run_len[cont] += carry.moments  # type: ignore[union-attr]
        last = np.flatnonzero(cand)
        run_last = last[np.flatnonzero(np.append(run_id[last][1:] != run_id[last][:-1], True))]
        span = times[run_last] + cell - run_start_ms
        confirmed[cand] = ((run_len >= 2) & (span >= grid))[run_id[cand]]
    dead = np.zeros(cols.size, bool)
    ckpt = np.zeros(cols.size, bool)
    signatures: list[tuple[int, int, list[int]]] = []
    counts = np.zeros((zero.shape[0], start_cols.size), np.int64)
    n_conf = np.zeros(start_cols.size, np.int64)
    if confirmed.any():
        if callable(checkpoint_allowance_ms):
            allowance = np.asarray(checkpoint_allowance_ms(run_start_ms), np.int64)
        else:
            allowance = np.full(start_cols.size, int(checkpoint_allowance_ms), np.int64)
        rid = run_id[confirmed]
        elapsed = times[confirmed] - run_start_ms[rid]
        # Rank 0 writes the checkpoint: at ~0% (one noisy moment does not make it a hang).
        rank0_zero = _bridge(low[0] & zero[0], cols)[confirmed]
        is_ckpt = rank0_zero & (elapsed < allowance[rid])
        idx = np.flatnonzero(confirmed)
        ckpt[idx[is_ckpt]] = True
        dead[idx[~is_ckpt]] = True
        ckpt |= _wait_head(ckpt, cand, zero, cols)
        cidx = np.flatnonzero(confirmed & ~before)
        n_conf = np.bincount(run_id[cidx], minlength=start_cols.size)
        if cidx.size:
            rid_c = run_id[cidx]
            first = np.flatnonzero(np.concatenate([[True], rid_c[1:] != rid_c[:-1]]))
            counts[:, rid_c[first]] = np.add.reduceat((low & zero)[:, cidx].astype(np.int64), first, axis=1)
        if cont >= 0:
            for r, n in carry.zero.items():  # type: ignore[union-attr]
                if r < counts.shape[0]:
                    counts[r, cont] += n
            n_conf[cont] += carry.confirmed  # type: ignore[union-attr]
        signatures = _signature_runs(counts, n_conf, confirmed, run_id, run_start_ms, times, cell)
    out = None
    if carry_at_ms is not None:
        out = _carry_at(
            carry_at_ms, times, cand, confirmed, run_id, run_start_ms, counts, low & zero, cont, carry
        )
    return dead, ckpt, int(confirmed.sum()), signatures, out


def _carry_at(
    at_ms: int,
    times: np.ndarray,
    cand: np.ndarray,
    confirmed: np.ndarray,
    run_id: np.ndarray,
    run_start_ms: np.ndarray,
    counts: np.ndarray,
    lz: np.ndarray,
    cont: int,
    carry: RunCarry | None,
) -> RunCarry | None:
    """The run open at `at_ms` (through the last moment before it), as the next window's carry."""
    j = int(np.searchsorted(times, at_ms)) - 1
    if j < 0:
        return None if carry is None else replace(carry, at_ms=at_ms)
    if not cand[j]:
        return None
    r = int(run_id[j])
    part = (run_id == r) & (times < at_ms)
    if r == cont:
        part &= times >= carry.at_ms  # type: ignore[union-attr]
    moments = int((part & cand).sum())
    conf = part & confirmed
    zero = {
        int(k): int(v)
        for k, v in zip(*np.unique(np.nonzero(lz[:, conf])[0], return_counts=True), strict=True)
    }
    n_conf = int(conf.sum())
    if r == cont:
        moments += carry.moments  # type: ignore[union-attr]
        n_conf += carry.confirmed  # type: ignore[union-attr]
        for k, v in carry.zero.items():  # type: ignore[union-attr]
            zero[k] = zero.get(k, 0) + v
    return RunCarry(at_ms, int(run_start_ms[r]), moments, n_conf, zero)


def _ranks_per_moment(mask: np.ndarray) -> np.ndarray:
    """How many ranks (rows) each moment (column) holds True: summed in a narrow integer, wide
    enough for twice the rank count (several times faster than the default 64-bit sum)."""
    counts: np.ndarray = mask.sum(0, dtype=np.int16 if mask.shape[0] < 2**14 else np.int64)
    return counts


def _levels(
    P: np.ndarray, U: np.ndarray, profile: Profile
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per reading: high / mid / low power, at idle power, busy, at ~0% (NaN is none of them)."""
    with np.errstate(invalid="ignore"):
        high = profile.compute_min_w <= P
        low = profile.low_max_w > P
        at_idle = profile.idle_max_w >= P
        busy = profile.busy_util_pct <= U
        zero = profile.zero_util_pct >= U
    mid = ~high & ~low & ~np.isnan(P)
    return high, mid, low, at_idle, busy, zero


# How far above the low edge, as a share of the way to the compute edge, the cross-rank
# signature (one rank at ~0%, the majority at ~100%) still holds: a checkpoint wait's onset on an
# H100 reads 218-230 W over a low edge of ~200 W and a compute edge of 455 W. R2's starvation
# (575 W of a B300, its straggler at 55-65%, never ~0%) stays far above it.
ONSET_SHARE = 0.25


def onset_edge_w(profile: Profile) -> float:
    """Below this power the cross-rank deadlock/checkpoint signature holds."""
    return profile.low_max_w + ONSET_SHARE * (profile.compute_min_w - profile.low_max_w)


# Power ramps between levels over 1-3 samples of a 100 ms trace (nvidia-smi averages power over
# a window): a stretch of mid-power readings no longer than this is a transition, not a state.
RAMP_MS = 400
# A stretch of mid-power readings between a compute reading and a low one (either way round) is a
# transition up to this long: the onset of a checkpoint wait (a ramp down, then 0.5-1 s with the
# writer at ~218 W / 0% and the waiters at ~230 W / 100% on an H100), or compute's ramp up through
# 400-500 W after a wait. A state held between compute and the low band (communication before a
# checkpoint, starvation) lasts far longer.
TRANSITION_MS = 2000


def ramp_samples(interval_ms: int) -> tuple[int, int]:
    """(the longest ramp, the longest transition) in samples; (0, 0): the trace is sampled too
    slowly for either (there a mid reading is a state)."""
    k = RAMP_MS // max(int(interval_ms), 1)
    return (k, max(k, TRANSITION_MS // max(int(interval_ms), 1))) if k >= 1 else (0, 0)


def persist_moments(cell_ms: int, grid_ms: int) -> int:
    """How many moments confirm a signature: two, spanning at least one grid step."""
    return max(2, -(-int(grid_ms) // max(int(cell_ms), 1)))


def lookahead_ms(interval_ms: int, grid_ms: int) -> int:
    """How far past a moment the classifier looks to band it: the rest of a signature's
    confirming moments (across a logger gap), one moment to bridge a noisy reading, one for a
    wait's head, and a transition's length. Live booking stays this far behind its newest
    samples, so its result does not depend on where booking rounds fall."""
    cell = max(int(interval_ms), 1)
    grid = max(int(grid_ms), cell)
    _, k = ramp_samples(cell)
    return cell * (persist_moments(cell, grid) + 1 + (k + 1 if k else 0)) + (grid - cell)


SPIN_STEP_CELLS = 2  # a spin moment is one with no step completing within this many moments


def step_lookahead_ms(interval_ms: int, grid_ms: int) -> int:
    """How far past a moment the steps must be known to band it: the spin signature holds only
    where no step completes within `SPIN_STEP_CELLS` moments of each confirming moment. Live
    booking stays this far behind the newest time its events are dated to, so a step posted
    just after a moment changes its band live as it does in a replay."""
    cell = max(int(interval_ms), 1)
    return lookahead_ms(cell, grid_ms) + SPIN_STEP_CELLS * cell


def window_overlap_ms(interval_ms: int, grid_ms: int, gap_intervals: float) -> int:
    """How far before the first moment it must band exactly a window's samples start: a gap held
    (`gap_intervals`), a ramp and a signature's confirming moments, a bridged hole."""
    cell = max(int(interval_ms), 1)
    return lookahead_ms(cell, grid_ms) + int(gap_intervals * cell) + 3 * cell


def deramp(rank: np.ndarray, power_w: np.ndarray, profile: Profile, interval_ms: int) -> np.ndarray:
    """Power for classification: a brief run of mid-power readings of one rank (a ramp, or a
    noise tail) takes the power of the reading after it, the level the GPU was moving to. Brief
    is up to RAMP_MS between two readings of one side of the mid band, up to TRANSITION_MS
    between a compute reading and a low one. Longer runs, and traces sampled slower than
    RAMP_MS, are left alone: there a mid reading is a state."""
    n = power_w.size
    k, kt = ramp_samples(interval_ms)
    if k < 1 or n < 3:
        return power_w
    with np.errstate(invalid="ignore"):
        mid = (power_w >= profile.low_max_w) & (power_w < profile.compute_min_w)
    if not mid.any():
        return power_w
    a = np.flatnonzero(np.concatenate([mid[:1], mid[1:] > mid[:-1]]))  # a run's first reading
    b = np.flatnonzero(np.concatenate([mid[:-1] > mid[1:], mid[-1:]])) + 1  # one past the run
    ok = (b - a <= kt) & (a > 0) & (b < n)
    a, b = a[ok], b[ok]
    ok = (rank[a - 1] == rank[a]) & (rank[b] == rank[a]) & ~np.isnan(power_w[b]) & ~np.isnan(power_w[a - 1])
    a, b = a[ok], b[ok]
    # Between readings on opposite sides of the mid band (one high, one low): a transition.
    across = (power_w[a - 1] >= profile.compute_min_w) != (power_w[b] >= profile.compute_min_w)
    ok = (b - a <= k) | across
    a, b = a[ok], b[ok]
    if a.size == 0:
        return power_w
    out = power_w.copy()
    lens = b - a
    idx = np.repeat(a, lens) + (np.arange(lens.sum()) - np.repeat(np.cumsum(lens) - lens, lens))
    out[idx] = np.repeat(power_w[b], lens)
    return out


# A climb into compute starts this far (a share of the compute edge) above the reading before it.
CLIMB_SHARE = 0.04


def _climbs(
    rank: np.ndarray, power_w: np.ndarray, util_pct: np.ndarray, profile: Profile, k: int
) -> np.ndarray:
    """Readings of a climb into compute take the power of the compute reading they climb to
    (the same object back when there is none): up to k readings of one rank right before its
    compute reading, each at busy utilization and none below the one before by more than half
    CLIMB_SHARE of the compute edge, from the first of them CLIMB_SHARE above the reading before
    them (any of them after a compute reading: a dip between two). Where the mid band is narrow
    (a TITAN X: 154-162 W), a ramp from a checkpoint wait (118 W) into compute (215 W) reads in
    the low band and banded as a wait's end or a hang."""
    n = power_w.size
    with np.errstate(invalid="ignore"):
        high = power_w >= profile.compute_min_w
    # A climb's noise may dip a little (half the first step's rise) between readings.
    slack = CLIMB_SHARE / 2 * profile.compute_min_w
    # Compute entries: a compute reading after a reading of the same rank below compute (mid
    # runs already `deramp`ed: a climb through the mid band enters where they begin). The rest
    # looks only at the few readings before an entry.
    entry = np.flatnonzero(high[1:] > high[:-1]) + 1
    entry = entry[rank[entry] == rank[entry - 1]]
    if entry.size == 0:
        return power_w
    # Walk back from each entry: j = entry - d is in the climb while every reading from it to
    # the entry is below compute, busy, and each rises (within the slack) over the one before.
    inside = np.ones(entry.size, bool)
    start = entry.copy()
    for d in range(1, k + 1):
        j = np.maximum(entry - d, 0)
        x = j + 1  # the reading that must rise over the one before it, j
        with np.errstate(invalid="ignore"):
            cond = ~high[j] & (util_pct[j] >= profile.busy_util_pct)
            rises = (power_w[x] >= power_w[x - 1] - slack) & (rank[x] == rank[x - 1])
        ok = inside & (entry - d >= 1) & cond & rises
        start = np.where(ok, j, start)
        inside = ok
    # The climb begins at its first reading clearly above the reading before the walk (a
    # waiter's noise rises too, by less).
    s, e = start[start < entry], entry[start < entry]
    ok = rank[np.maximum(s - 1, 0)] == rank[s]
    s, e = s[ok], e[ok]
    with np.errstate(invalid="ignore"):
        # After a compute reading the walk is a dip (a noise tail), whole.
        floor = np.where(high[s - 1], -np.inf, power_w[s - 1] + CLIMB_SHARE * profile.compute_min_w)
        first = e.copy()
        for d in range(k - 1, -1, -1):  # the earliest qualifying reading wins
            x = s + d
            hit = (x < e) & (power_w[np.minimum(x, n - 1)] >= floor)
            first = np.where(hit, x, first)
    s, e = first[first < e], e[first < e]
    if s.size == 0:
        return power_w
    out = power_w.copy()
    lens = e - s
    idx = np.repeat(s, lens) + (np.arange(lens.sum()) - np.repeat(np.cumsum(lens) - lens, lens))
    out[idx] = np.repeat(power_w[e], lens)
    return out


def sampling_phase(ts_ms: np.ndarray, cell: int) -> float:
    """The stamps' typical phase within a cell (ms): their circular mean, over a bounded prefix
    (samples sorted by rank, ts). A trace read in windows takes it once, from its own prefix, so
    that every window cuts the same cells."""
    pre = ts_ms[:200_001] % cell
    if pre.size == 0:
        return 0.0
    if cell <= pre.size:  # the stamps' phases counted, each angle's sine and cosine taken once
        k = np.bincount(pre, minlength=cell)
        at = np.flatnonzero(k)
        ang = at * (2 * np.pi / cell)
        w = k[at] / pre.size
        phase = float(np.arctan2((np.sin(ang) * w).sum(), (np.cos(ang) * w).sum())) * cell / (2 * np.pi)
    else:
        ang = pre * (2 * np.pi / cell)
        phase = float(np.arctan2(np.sin(ang).mean(), np.cos(ang).mean())) * cell / (2 * np.pi)
    return phase


def moments(
    rank: np.ndarray, ts_ms: np.ndarray, cell: int, phase_ms: float | None = None
) -> tuple[np.ndarray, int]:
    """The moment (a cell of one sampling interval) of each sample, numbered from 0, and the
    time of moment 0 (ms); samples sorted by (rank, ts).

    Cells are centred on the trace's typical sampling phase (`sampling_phase`, or `phase_ms`
    where the caller took it once), so the lines of one instant, stamped a few ms apart, share a
    cell. A line stamped early (nvidia-smi sometimes stamps the GPU 0 line of an instant 50-80 ms
    before the others) falls into its predecessor's cell; it moves on to the next cell when that
    one is free for its rank, where the rest of its instant is.
    """
    phase = sampling_phase(ts_ms, cell) if phase_ms is None else phase_ms
    off = round(phase) - cell // 2
    tick = (ts_ms - off) // cell
    first = int(tick.min())
    tick -= first
    if tick.size > 1:
        same = rank[1:] == rank[:-1]
        clash = np.flatnonzero(same & (tick[1:] <= tick[:-1])) + 1
        if clash.size:
            target = tick[clash - 1] + 1
            nxt = np.minimum(clash + 1, tick.size - 1)
            free = (clash + 1 >= tick.size) | (rank[nxt] != rank[clash]) | (tick[nxt] > target)
            tick[clash[free]] = target[free]
    return tick, first * cell + off + cell // 2


def _bridge(cand: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Close one-moment holes in a signature: one noisy reading does not end a hang."""
    if cand.size < 3:
        return cand
    hole = ~cand[1:-1] & cand[:-2] & cand[2:] & (cols[2:] - cols[:-2] == 2)
    out = cand.copy()
    out[1:-1] |= hole
    return out


def _wait_head(
    ckpt: np.ndarray, cand: np.ndarray, zero: np.ndarray, cols: np.ndarray
) -> npt.NDArray[np.bool_]:
    """The moment just before a checkpoint run where the writer (rank 0) already reads ~0%: the
    first sample of the ramp down from compute, at any power (nvidia-smi averages power over a
    window, utilization drops at once), is the wait's."""
    head = np.zeros(ckpt.size, bool)
    i = np.flatnonzero(ckpt[1:] & ~ckpt[:-1]) + 1
    p = i - 1
    p = p[(cols[i] - cols[p] == 1) & ~cand[p] & zero[0, p]]
    head[p] = True
    return head


def _signature_runs(
    counts: np.ndarray,
    n_conf: np.ndarray,
    confirmed: np.ndarray,
    run_id: np.ndarray,
    run_start_ms: np.ndarray,
    times: np.ndarray,
    cell: int,
) -> list[tuple[int, int, list[int]]]:
    """Each confirmed signature run's time span and the ranks at ~0% through most of it (`counts`:
    ranks x runs, moments at ~0% among the run's `n_conf` confirmed ones)."""
    idx = np.flatnonzero(confirmed)
    rid = run_id[idx]
    last = idx[np.flatnonzero(np.append(rid[1:] != rid[:-1], True))]  # each run's last moment
    out = []
    for k, e in zip(run_id[last].tolist(), last.tolist(), strict=True):
        ranks = np.flatnonzero(counts[:, k] * 2 >= n_conf[k]).tolist()
        out.append((int(run_start_ms[k]), int(times[e]) + cell, ranks))
    return out


def _spinning(
    low: np.ndarray,
    busy: np.ndarray,
    n_obs: np.ndarray,
    cols: np.ndarray,
    t0: int,
    cell: int,
    step_ms: np.ndarray,
) -> npt.NDArray[np.bool_]:
    """Moments where every observed rank is at ~100% at low power and no step completes within a
    moment of it: a thread spinning on a flag or in a collective, any number of ranks."""
    spin: npt.NDArray[np.bool_] = (
        (n_obs >= 1) & (_ranks_per_moment(low) == n_obs) & (_ranks_per_moment(low & busy) == n_obs)
    )
    if not spin.any() or step_ms.size == 0:
        return spin
    t = t0 + cols * cell
    steps = np.sort(np.asarray(step_ms, np.int64))
    span = SPIN_STEP_CELLS * cell
    near = np.searchsorted(steps, t + span, "right") - np.searchsorted(steps, t - span, "left")
    spin_alone: npt.NDArray[np.bool_] = spin & (near == 0)  # numpy's stubs type `&` here as Any
    return spin_alone
