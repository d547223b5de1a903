"""Classify every sample of a job into a band (DESIGN section 3), vectorized.

A job's samples are laid on a shared time grid, a matrix of ranks x moments: samples of
different GPUs and hosts within half a grid step are the same moment. A rank without a sample
at a moment holds its last value for up to `hold` (the unobserved-gap limit). Per-GPU bands come
from the profile's power and utilization thresholds; the job-level signatures (deadlock,
checkpoint, starvation) are column reductions over that matrix. Nothing here loops over samples.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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
) -> BandResult:
    """Band of each sample. Samples must be sorted by (rank, ts).

    `checkpoint_allowance_ms` is either a constant or a function mapping the start times of
    signature runs (ms) to the allowance in force then (learned from the job's checkpoints).
    """
    n = ts_ms.size
    if interval_ms is None:
        interval_ms = sampling_interval_ms(rank, ts_ms)
    if n == 0:
        return BandResult(np.zeros(0, np.int8), grid_ms, interval_ms, None, 0)
    grid = max(int(grid_ms), int(interval_ms))
    hold = int(gap_intervals * interval_ms)

    t0 = int(ts_ms.min())
    tick = (ts_ms - t0 + grid // 2) // grid
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
        obs = seen & ((cols[None, :] - cols[lastc]) * grid <= hold)
        rows = np.arange(n_ranks)[:, None]
        P = np.where(obs, P[rows, lastc], np.nan)
        U = np.where(obs, U[rows, lastc], np.nan)

    with np.errstate(invalid="ignore"):
        high = profile.compute_min_w <= P
        low = profile.low_max_w > P
        at_idle = profile.idle_max_w >= P
        busy = profile.busy_util_pct <= U
        not_busy = profile.busy_util_pct > U
        zero = profile.zero_util_pct >= U
    mid = obs & ~high & ~low & ~np.isnan(P)
    low &= obs

    n_obs = obs.sum(0)

    # Deadlock / checkpoint signature: everyone low, >= 1 rank at ~0%, the majority at ~100%,
    # on two consecutive moments (REFERENCE R2, R3).
    n_lowbusy = (low & busy).sum(0)
    cand = (n_obs >= 2) & (low.sum(0) == n_obs) & ((low & zero).sum(0) >= 1) & (n_lowbusy * 2 >= n_obs)
    starts = cand.copy()
    starts[1:] &= ~(cand[:-1] & (np.diff(cols) == 1))
    run_id = np.cumsum(starts) - 1
    start_cols = np.flatnonzero(starts)
    run_len = np.bincount(run_id[cand], minlength=start_cols.size)
    confirmed = cand.copy()
    confirmed[cand] = run_len[run_id[cand]] >= 2
    dead = np.zeros(n_cols, bool)
    ckpt = np.zeros(n_cols, bool)
    if confirmed.any():
        run_start_ms = t0 + cols[start_cols] * grid
        if callable(checkpoint_allowance_ms):
            allowance = np.asarray(checkpoint_allowance_ms(run_start_ms), np.int64)
        else:
            allowance = np.full(start_cols.size, int(checkpoint_allowance_ms), np.int64)
        rid = run_id[confirmed]
        elapsed = (cols[confirmed] - cols[start_cols[rid]]) * grid
        rank0_zero = (low[0] & zero[0])[confirmed]
        is_ckpt = rank0_zero & (elapsed < allowance[rid])
        idx = np.flatnonzero(confirmed)
        ckpt[idx[is_ckpt]] = True
        dead[idx[~is_ckpt]] = True

    # Starvation: most ranks at mid power and at least one well below ~100% utilization.
    starv = (n_obs >= 2) & ((mid.sum(0) * 2) >= n_obs) & ((mid & not_busy).sum(0) >= 1)

    B = np.full((n_ranks, n_cols), Band.UNKNOWN, np.int8)
    B[high] = Band.COMPUTE
    B[mid & busy] = Band.COMMUNICATION
    B[mid & not_busy] = Band.STARVATION
    B[mid & starv[None, :]] = Band.STARVATION
    B[low & (zero | (at_idle & ~busy))] = Band.IDLE
    B[obs & dead[None, :]] = Band.DEADLOCK
    B[obs & ckpt[None, :]] = Band.CHECKPOINT

    straggler = None
    if starv.any():
        u = np.where(mid[:, starv], U[:, starv], np.nan)
        counts = (~np.isnan(u)).sum(1)
        if counts.any():
            mean = np.where(counts > 0, np.nansum(u, 1) / np.maximum(counts, 1), np.inf)
            straggler = int(np.argmin(mean))

    return BandResult(
        band=B.ravel()[flat],
        grid_ms=grid,
        interval_ms=int(interval_ms),
        straggler_rank=straggler,
        signature_moments=int(confirmed.sum()),
    )
