"""What the agent shows of a job every round, booked or not (pure: no Redis, no NVML).

Booking stops at the horizon: after the last step, time stays pending until a step closes it or
the stall threshold decides it. A round that books nothing must still show the present: each
GPU's band, what the time since the last step has cost, the GPU time at risk. These functions
compute that from the newest samples and the job's timeline, for `/metrics` and the live hash
the watcher reads. Nothing here is booked: the ledger stays the record.
"""

from __future__ import annotations

import numpy as np

from costexporter.core import bands as bands_mod
from costexporter.core.booking import BookingConfig, Timeline, job_bands
from costexporter.core.cost import Prices
from costexporter.core.model import Category
from costexporter.core.profiles import Profile


def newest_bands(
    cfg: BookingConfig,
    tl: Timeline,
    profile: Profile,
    rank: np.ndarray,
    ts_ms: np.ndarray,
    power_w: np.ndarray,
    util_pct: np.ndarray,
    n_ranks: int,
    own_ranks: np.ndarray,
    carry: bands_mod.RunCarry | None = None,
) -> dict[int, int]:
    """Own rank -> band of its newest sample, classified over the job's samples (sorted by
    rank, ts) exactly as a booking round classifies them (signatures, spin, checkpoint; `carry`,
    the signature run carried into the window)."""
    if ts_ms.size == 0 or own_ranks.size == 0:
        return {}
    interval = bands_mod.sampling_interval_ms(rank, ts_ms)
    br = job_bands(cfg, tl, rank, ts_ms, power_w, util_pct, n_ranks, profile, interval, carry)
    mine = np.isin(rank, own_ranks)
    r, b = rank[mine], br.band[mine]
    if r.size == 0:
        return {}
    last = np.flatnonzero(np.append(r[1:] != r[:-1], True))
    return {int(r[i]): int(b[i]) for i in last}


def unbooked_cost(
    prices: Prices,
    from_ms: np.ndarray,
    now_ms: int,
    rank: np.ndarray,
    ts_ms: np.ndarray,
    power_w: np.ndarray,
    own_ranks: np.ndarray,
) -> int:
    """Cost (micro-units) of own GPUs' time in [from_ms (per own rank), now_ms), not booked yet:
    GPU-hours at the job's prices, energy from the mean power of the samples in it."""
    if own_ranks.size == 0:
        return 0
    ms = np.clip(now_ms - from_ms.astype(np.int64), 0, None).astype(np.float64)
    watts = np.zeros(own_ranks.size)
    for i, r in enumerate(own_ranks.tolist()):
        sel = (rank == r) & (ts_ms >= from_ms[i]) & np.isfinite(power_w)
        if sel.any():
            watts[i] = float(power_w[sel].mean())
    cat = np.full(own_ranks.size, int(Category.PRODUCTIVE))
    cost = prices.cost(ms, ms * watts, cat)
    return round(float(np.sum(cost)) * 1e6)
