"""Classify every sample of a job into a band (DESIGN section 3), vectorized.

A job's samples are laid on a shared time grid, a matrix of ranks x moments: samples of
different GPUs and hosts within half a grid step are the same moment. A rank without a sample
at a moment holds its last value for up to `hold` (the unobserved-gap limit). Per-GPU bands come
from the profile's power and utilization thresholds; the job-level signatures (deadlock,
checkpoint, starvation) are column reductions over that matrix. Nothing here loops over samples.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .model import Band
from .profiles import Profile


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
) -> BandResult:
    """Band of each sample. Samples must be sorted by (rank, ts).

    `step_ms`: the job's step completion times, where known. Then a moment where every observed
    rank (one GPU is enough) spins at ~100% utilization at low power with no step around it is
    a deadlock candidate too: a hang looks like that on a single GPU (REFERENCE R9).

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

    power_w = deramp(rank, power_w, profile, int(interval_ms))
    tick = moments(rank, ts_ms, cell)
    n_ticks = int(tick.max()) + 1
    if n_ticks <= 4 * n + 1024:  # dense numbering in O(n); sparse traces fall back to unique
        used = np.bincount(tick, minlength=n_ticks) > 0
        cols = np.flatnonzero(used)
        col = (np.cumsum(used) - 1)[tick]
    else:
        cols, col = np.unique(tick, return_inverse=True)
    n_cols = cols.size
    # One flat index for every scatter and gather (much faster than 2-D fancy indexing).
    flat = np.asarray(rank, np.intp) * n_cols + col
    # -1 W marks "no sample at this moment" (ingest rejects negative power; NaN stays NaN).
    P = np.full((n_ranks, n_cols), -1.0, np.float32)
    U = np.full((n_ranks, n_cols), np.nan, np.float32)
    P.ravel()[flat] = power_w
    U.ravel()[flat] = util_pct
    present = P != -1.0

    if present.all():  # every rank sampled at every moment: nothing to hold
        obs = present
    else:  # forward-fill each rank's last sample for up to `hold`
        last = np.where(present, np.arange(n_cols), -1)
        np.maximum.accumulate(last, axis=1, out=last)
        seen = last >= 0
        lastc = np.where(seen, last, 0)
        obs = seen & ((cols[None, :] - cols[lastc]) * cell <= hold)
        rows = np.arange(n_ranks)[:, None]
        P = np.where(obs, P[rows, lastc], np.nan)
        U = np.where(obs, U[rows, lastc], np.nan)

    _, mid, low, _, busy, zero = _levels(P, U, profile)
    mid &= obs
    low &= obs
    n_obs = obs.sum(0)

    dead, ckpt, n_confirmed, signatures = _signature(
        low, busy, zero, n_obs, cols, cell, grid, int(ts_ms.min()), step_ms, checkpoint_allowance_ms
    )

    # Starvation: most ranks at mid power and at least one well below ~100% utilization.
    starv = (n_obs >= 2) & ((mid.sum(0) * 2) >= n_obs) & ((mid & ~busy & ~np.isnan(U)).sum(0) >= 1)

    # Every sample is classified from its own reading; the job-level signatures of its moment
    # are laid over it (so a grid step can hold two bands, by duration).
    band, s_mid = _reading_bands(power_w, util_pct, profile)
    band[s_mid & starv[col]] = Band.STARVATION
    band[dead[col]] = Band.DEADLOCK
    band[ckpt[col]] = Band.CHECKPOINT

    straggler = None
    if starv.any():
        u = np.where(mid[:, starv], U[:, starv], np.nan)
        counts = (~np.isnan(u)).sum(1)
        if counts.any():
            mean = np.where(counts > 0, np.nansum(u, 1) / np.maximum(counts, 1), np.inf)
            straggler = int(np.argmin(mean))

    return BandResult(
        band=band,
        grid_ms=grid,
        interval_ms=int(interval_ms),
        straggler_rank=straggler,
        signature_moments=n_confirmed,
        signatures=signatures,
    )


def reading_bands(power_w: np.ndarray, util_pct: np.ndarray, profile: Profile) -> np.ndarray:
    """Each reading's band from itself alone (no job signature: those need a job's moments):
    the band of a GPU no job holds, or one whose job has no moment classified yet."""
    return _reading_bands(np.asarray(power_w, np.float64), np.asarray(util_pct, np.float64), profile)[0]


def _reading_bands(
    power_w: np.ndarray, util_pct: np.ndarray, profile: Profile
) -> tuple[np.ndarray, np.ndarray]:
    """(band per reading from its own power and utilization, the mid-power mask)."""
    s_high, s_mid, s_low, s_idle, s_busy, s_zero = _levels(power_w, util_pct, profile)
    band = np.full(power_w.size, Band.UNKNOWN, np.int8)
    band[s_high] = Band.COMPUTE
    band[s_mid & s_busy] = Band.COMMUNICATION
    band[s_mid & ~s_busy & ~np.isnan(util_pct)] = Band.STARVATION
    band[s_low & (s_zero | (s_idle & ~s_busy))] = Band.IDLE
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
) -> tuple[np.ndarray, np.ndarray, int, list[tuple[int, int, list[int]]]]:
    """The deadlock and checkpoint moments (column masks), how many moments confirmed, and the
    confirmed runs with their ranks at ~0%."""
    # Deadlock / checkpoint signature: everyone low, >= 1 rank at ~0%, the majority at ~100%,
    # persisting for two consecutive moments and at least one grid step (REFERENCE R2, R3).
    n_lowbusy = (low & busy).sum(0)
    cand = (n_obs >= 2) & (low.sum(0) == n_obs) & ((low & zero).sum(0) >= 1) & (n_lowbusy * 2 >= n_obs)
    if step_ms is not None:
        cand |= _spinning(low, busy, n_obs, cols, t0, cell, step_ms)
    cand = _bridge(cand, cols)
    # Consecutive samples: a moment where the logger wrote nothing at all does not end a run.
    starts = cand.copy()
    starts[1:] &= ~(cand[:-1] & (np.diff(cols) * cell <= grid))
    run_id = np.cumsum(starts) - 1
    start_cols = np.flatnonzero(starts)
    confirmed = cand.copy()
    if cand.any():
        in_run = np.flatnonzero(cand)
        run_len = np.bincount(run_id[in_run], minlength=start_cols.size)
        run_last = in_run[np.flatnonzero(np.append(run_id[in_run][1:] != run_id[in_run][:-1], True))]
        span = (cols[run_last] - cols[start_cols] + 1) * cell
        confirmed[cand] = ((run_len >= 2) & (span >= grid))[run_id[cand]]
    dead = np.zeros(cols.size, bool)
    ckpt = np.zeros(cols.size, bool)
    signatures: list[tuple[int, int, list[int]]] = []
    if confirmed.any():
        run_start_ms = t0 + cols[start_cols] * cell
        if callable(checkpoint_allowance_ms):
            allowance = np.asarray(checkpoint_allowance_ms(run_start_ms), np.int64)
        else:
            allowance = np.full(start_cols.size, int(checkpoint_allowance_ms), np.int64)
        rid = run_id[confirmed]
        elapsed = (cols[confirmed] - cols[start_cols[rid]]) * cell
        # Rank 0 writes the checkpoint: at ~0% (one noisy moment does not make it a hang).
        rank0_zero = _bridge(low[0] & zero[0], cols)[confirmed]
        is_ckpt = rank0_zero & (elapsed < allowance[rid])
        idx = np.flatnonzero(confirmed)
        ckpt[idx[is_ckpt]] = True
        dead[idx[~is_ckpt]] = True
        signatures = _signature_runs(low & zero, confirmed, run_id, cols, t0, cell)
    return dead, ckpt, int(confirmed.sum()), signatures


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


# Power ramps between levels over 1-3 samples of a 100 ms trace (nvidia-smi averages power over
# a window): a stretch of mid-power readings no longer than this is a transition, not a state.
RAMP_MS = 400


def persist_moments(cell_ms: int, grid_ms: int) -> int:
    """How many moments confirm a signature: two, spanning at least one grid step."""
    return max(2, -(-int(grid_ms) // max(int(cell_ms), 1)))


def lookahead_ms(interval_ms: int, grid_ms: int) -> int:
    """How far past a moment the classifier looks to band it: the rest of a signature's
    confirming moments (across a logger gap), one moment to bridge a noisy reading, and a ramp's
    length. Live booking stays this far behind its newest samples, so its result does not depend
    on where booking rounds fall."""
    cell = max(int(interval_ms), 1)
    grid = max(int(grid_ms), cell)
    k = RAMP_MS // cell
    return cell * (persist_moments(cell, grid) + (k + 1 if k else 0)) + (grid - cell)


def deramp(rank: np.ndarray, power_w: np.ndarray, profile: Profile, interval_ms: int) -> np.ndarray:
    """Power for classification: a brief run of mid-power readings of one rank (a ramp, or a
    noise tail) between readings outside the mid band takes the power of the reading after it,
    the level the GPU was moving to. Runs of more than RAMP_MS, and traces sampled slower than
    that, are left alone: there a mid reading is a state."""
    n = power_w.size
    k = RAMP_MS // max(interval_ms, 1)
    if k < 1 or n < 3:
        return power_w
    with np.errstate(invalid="ignore"):
        mid = (power_w >= profile.low_max_w) & (power_w < profile.compute_min_w)
    if not mid.any():
        return power_w
    edge = np.diff(np.concatenate([[0], mid.astype(np.int8), [0]]))
    a = np.flatnonzero(edge == 1)
    b = np.flatnonzero(edge == -1)  # one past the run
    ok = (b - a <= k) & (a > 0) & (b < n)
    a, b = a[ok], b[ok]
    ok = (rank[a - 1] == rank[a]) & (rank[b] == rank[a]) & ~np.isnan(power_w[b]) & ~np.isnan(power_w[a - 1])
    a, b = a[ok], b[ok]
    if a.size == 0:
        return power_w
    out = power_w.copy()
    lens = b - a
    idx = np.repeat(a, lens) + (np.arange(lens.sum()) - np.repeat(np.cumsum(lens) - lens, lens))
    out[idx] = np.repeat(power_w[b], lens)
    return out


def moments(rank: np.ndarray, ts_ms: np.ndarray, cell: int) -> np.ndarray:
    """The moment (a cell of one sampling interval) of each sample; samples sorted by (rank, ts).

    Cells are centred on the trace's typical sampling phase, so the lines of one instant, stamped
    a few ms apart, share a cell. A line stamped early (nvidia-smi sometimes stamps the GPU 0 line
    of an instant 50-80 ms before the others) falls into its predecessor's cell; it moves on to
    the next cell when that one is free for its rank, where the rest of its instant is.
    """
    pre = ts_ms[:200_001] % cell
    ang = pre * (2 * np.pi / cell)
    phase = float(np.arctan2(np.sin(ang).mean(), np.cos(ang).mean())) * cell / (2 * np.pi)
    off = round(phase) - cell // 2
    tick = (ts_ms - off) // cell
    tick -= tick.min()
    if tick.size > 1:
        same = rank[1:] == rank[:-1]
        clash = np.flatnonzero(same & (tick[1:] <= tick[:-1])) + 1
        if clash.size:
            target = tick[clash - 1] + 1
            nxt = np.minimum(clash + 1, tick.size - 1)
            free = (clash + 1 >= tick.size) | (rank[nxt] != rank[clash]) | (tick[nxt] > target)
            tick[clash[free]] = target[free]
    return tick


def _bridge(cand: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Close one-moment holes in a signature: one noisy reading does not end a hang."""
    if cand.size < 3:
        return cand
    hole = ~cand[1:-1] & cand[:-2] & cand[2:] & (cols[2:] - cols[:-2] == 2)
    out = cand.copy()
    out[1:-1] |= hole
    return out


def _signature_runs(
    zero: np.ndarray, confirmed: np.ndarray, run_id: np.ndarray, cols: np.ndarray, t0: int, cell: int
) -> list[tuple[int, int, list[int]]]:
    """Each confirmed signature run's time span and the ranks at ~0% through most of it."""
    idx = np.flatnonzero(confirmed)
    rid = run_id[idx]
    first = np.flatnonzero(np.concatenate([[True], rid[1:] != rid[:-1]]))
    counts = np.add.reduceat(zero[:, idx].astype(np.int64), first, axis=1)  # ranks x runs
    length = np.diff(np.append(first, idx.size))
    out = []
    for k, (a, n_moments) in enumerate(zip(first.tolist(), length.tolist(), strict=True)):
        ranks = np.flatnonzero(counts[:, k] * 2 >= n_moments).tolist()
        start = t0 + int(cols[idx[a]]) * cell
        end = t0 + (int(cols[idx[a + n_moments - 1]]) + 1) * cell
        out.append((start, end, ranks))
    return out


def _spinning(
    low: np.ndarray,
    busy: np.ndarray,
    n_obs: np.ndarray,
    cols: np.ndarray,
    t0: int,
    cell: int,
    step_ms: np.ndarray,
) -> np.ndarray:
    """Moments where every observed rank is at ~100% at low power and no step completes within a
    moment of it: a thread spinning on a flag or in a collective, any number of ranks."""
    spin = (n_obs >= 1) & (low.sum(0) == n_obs) & ((low & busy).sum(0) == n_obs)
    if not spin.any() or step_ms.size == 0:
        return spin
    t = t0 + cols * cell
    steps = np.sort(np.asarray(step_ms, np.int64))
    near = np.searchsorted(steps, t + 2 * cell, "right") - np.searchsorted(steps, t - 2 * cell, "left")
    return spin & (near == 0)
