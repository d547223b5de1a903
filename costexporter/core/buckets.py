"""The ledger's buckets (pure): GPU time, energy and cost summed per 5-minute bucket per category.

The bucket is fixed at 5 minutes: every stored key, rollup and API window is laid out on it
(changing it means a new ledger, not a setting). The coarser resolutions are sums of it.
"""

from __future__ import annotations

import numpy as np

from costexporter.core import pricing, shares
from costexporter.core.booking import Pieces, Slices, _cut
from costexporter.core.cost import Prices
from costexporter.core.model import Category
from costexporter.core.pricing import PriceSchedule, as_schedule

BUCKET_S = 300  # the finest bucket, in seconds
RESOLUTIONS = {"5m": BUCKET_S, "1h": 3600, "1d": 86400, "1w": 7 * 86400}
MONDAY = 4 * 86400  # 1970-01-05, a Monday: weeks start on Monday 00:00 UTC
UNITS = ("ms", "mj", "ucost")  # a bucket's amounts per category: ms, mJ, micro-currency


def bucket_start(t: int, res: str) -> int:
    """The start (Unix s) of the bucket of resolution `res` holding time t."""
    secs = RESOLUTIONS[res]
    off = MONDAY if res == "1w" else 0
    return (t - off) // secs * secs + off


def decompose(start: int, end: int) -> list[tuple[str, int]]:
    """[start, end) as the fewest ledger buckets: whole weeks (Monday, UTC), days, hours, then
    5 minutes."""
    out: list[tuple[str, int]] = []
    t = start
    while t < end:
        for res in ("1w", "1d", "1h", "5m"):
            secs = RESOLUTIONS[res]
            if bucket_start(t, res) == t and t + secs <= end:
                out.append((res, t))
                t += secs
                break
        else:  # not on a 5-minute boundary: cannot happen for aligned windows
            raise ValueError(f"[{start}, {end}) is not aligned to the ledger's buckets")
    return out


def price_version(prices: Prices) -> str:
    """A short name of the flags' price, stored with every bucket it costed (`pricing.version`)."""
    return pricing.version(prices)


def amounts(
    pieces: Pieces, prices: Prices | PriceSchedule, bucket_s: int = BUCKET_S
) -> dict[int, np.ndarray]:
    """Bucket start (s) -> int64 array [category, unit] of ms, mJ and micro-cost.

    Pieces crossing a bucket boundary are split there (time and energy in proportion). Each
    bucket is costed at the price of its start (a price changes only on a bucket boundary).
    """
    if pieces.gpu.size == 0:
        return {}
    lo = int(pieces.start_ms.min()) // (bucket_s * 1000) * bucket_s * 1000
    hi = int(pieces.end_ms.max())
    bounds = np.arange(lo, hi + bucket_s * 1000 + 1, bucket_s * 1000, dtype=np.int64)
    # _cut carries the category in the band column, and here each piece's number in the gpu one
    # (a shared slice's lanes are looked up by it).
    ids = np.arange(pieces.gpu.size, dtype=np.int64)
    s = Slices(ids, pieces.start_ms, pieces.end_ms, pieces.category, pieces.energy_mj)
    cut, seg = _cut(s, bounds)
    cat = cut.band.astype(np.int64)
    lanes = None if pieces.lanes is None else pieces.lanes[cut.gpu]
    dur = shares.gpu_ms(cut.start_ms, cut.end_ms, lanes)
    n_cat = len(Category)
    n_b = bounds.size
    k = seg.astype(np.int64) * n_cat + cat
    ms = np.bincount(k, weights=dur, minlength=n_b * n_cat).reshape(n_b, n_cat)
    mj = np.bincount(k, weights=cut.energy_mj, minlength=n_b * n_cat).reshape(n_b, n_cat)
    sched = as_schedule(prices)
    cats = np.arange(n_cat)[None, :]
    cuts = sched.cuts(int(bounds[0]), int(bounds[-1]))
    if not cuts:
        cost = sched.at(int(bounds[0])).cost(ms, mj, cats)
    else:  # rows of one price at a time, each as if alone
        cost = np.zeros_like(ms)
        for lo_ms, hi_ms, prices_then in sched.spans(int(bounds[0]), int(bounds[-1]) + 1):
            rows = (bounds >= lo_ms) & (bounds < hi_ms)
            cost[rows] = prices_then.cost(ms[rows], mj[rows], cats)
    out = {}
    for b in np.flatnonzero(ms.sum(1) > 0):
        a = np.stack([ms[b], np.round(mj[b]), np.round(cost[b] * 1e6)], axis=1).astype(np.int64)
        out[int(bounds[b] // 1000)] = a
    return out


def cut_at(pieces: Pieces, times: list[int]) -> Pieces:
    """The pieces cut at `times` (sorted; a price change): energy in proportion, lanes kept."""
    if not times or pieces.gpu.size == 0:
        return pieces
    lo, hi = int(pieces.start_ms.min()), int(pieces.end_ms.max())
    inside = [t for t in times if lo < t < hi]
    if not inside:
        return pieces
    bounds = np.asarray([lo, *inside, hi + 1], np.int64)
    ids = np.arange(pieces.gpu.size, dtype=np.int64)
    s = Slices(ids, pieces.start_ms, pieces.end_ms, pieces.category, pieces.energy_mj)
    cut, _ = _cut(s, bounds)
    of = cut.gpu
    return Pieces(
        pieces.gpu[of],
        cut.start_ms,
        cut.end_ms,
        pieces.band[of],
        pieces.category[of],
        cut.energy_mj,
        None if pieces.lanes is None else pieces.lanes[of],
    )


def cost_by_category(pieces: Pieces, schedules: list[PriceSchedule]) -> np.ndarray:
    """Cost per category of pieces whose GPU `g` is priced by `schedules[g]`: each piece at the
    price of its start once cut at every price change, as the ledger's buckets cost it."""
    n_cat = len(Category)
    out = np.zeros(n_cat)
    if pieces.gpu.size == 0:
        return out
    times = sorted({t for s in schedules for t, _, _ in s.changes[1:]})
    p = cut_at(pieces, times)
    ms = p.gpu_ms.astype(np.float64)
    for g in np.unique(p.gpu).tolist():
        on = p.gpu == g
        for a, b, prices in schedules[g].spans(int(p.start_ms[on].min()), int(p.start_ms[on].max()) + 1):
            m = on & (p.start_ms >= a) & (p.start_ms < b)
            cat = p.category[m].astype(np.int64)
            out += np.bincount(cat, weights=prices.cost(ms[m], p.energy_mj[m], cat), minlength=n_cat)
    return out
