"""Incremental booking for the live agent (pure: no Redis, no NVML).

Each round the agent books its own GPUs' time in [booked_until, horizon): the horizon is where
everything before it is decided. It is the earliest of
  * the timeline's `decided_until` (after the last step, time stays pending until the next step
    closes it or the stall threshold says progress stopped), and
  * the newest sample of every rank still reporting (a signature needs every rank's sample at
    a moment, and the moment after it); a rank silent for longer than the gap limit no longer
    holds the horizon back: its time books `unobserved`.
Time in [booked_until, horizon) is never booked again: the agent's watermark moves past it in
the same transaction as the amounts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import bands as bands_mod
from .booking import (
    POS_INF,
    BookingConfig,
    Pieces,
    Slices,
    Timeline,
    _cut_per_gpu,
    book,
    build_timeline,
    job_bands,
    make_slices,
)
from .model import Category, Event
from .profiles import Profile


@dataclass(slots=True)
class WindowResult:
    pieces: Pieces  # own GPUs' pieces in [booked_until, horizon); gpu = index into own_ranks
    horizon_ms: int
    timeline: Timeline
    latest_band: dict[int, int]  # own GPU index -> band of its newest sample


def data_horizon(
    rank: np.ndarray,
    ts_ms: np.ndarray,
    now_ms: int,
    interval_ms: int,
    gap_intervals: float,
    hold_ranks: np.ndarray | None = None,
    ignore_ranks: np.ndarray | None = None,
    lookahead_ms: int | None = None,
) -> int:
    """The newest moment every still-reporting rank has reached, `lookahead_ms` back (default
    one interval; see `bands.lookahead_ms`: a moment is banded only once the samples after it
    that can change its band are in). `hold_ranks` (other agents' ranks
    whose agent is alive) always hold the horizon back, however far behind; `ignore_ranks`
    (ranks of an agent that went silent) never do; the rest count as silent after the gap."""
    if ts_ms.size == 0:
        return now_ms
    order = np.argsort(rank, kind="stable")
    r, t = rank[order], ts_ms[order]
    last = np.flatnonzero(np.append(r[1:] != r[:-1], True))
    latest = t[last]
    alive = latest >= now_ms - gap_intervals * interval_ms
    if hold_ranks is not None and hold_ranks.size:
        alive |= np.isin(r[last], hold_ranks)
    if ignore_ranks is not None and ignore_ranks.size:
        alive &= ~np.isin(r[last], ignore_ranks)
    if not alive.any():
        return now_ms
    return int(latest[alive].min()) - (interval_ms if lookahead_ms is None else lookahead_ms)


def book_window(
    *,
    events: list[Event],
    cfg: BookingConfig,
    profile: Profile,
    job_start_ms: int,
    rank: np.ndarray,
    ts_ms: np.ndarray,
    power_w: np.ndarray,
    util_pct: np.ndarray,
    energy_mj: np.ndarray,
    n_ranks: int,
    own_ranks: np.ndarray,
    member_start_ms: np.ndarray,
    booked_until_ms: int,
    now_ms: int,
    final: bool = False,
    hold_ranks: np.ndarray | None = None,
    ignore_ranks: np.ndarray | None = None,
) -> WindowResult:
    """Book the decided part of [booked_until, now) for the GPUs of `own_ranks`.

    Samples are those of every rank of the job in the context window (this agent's and the
    other agents'), sorted by (rank, ts). `member_start_ms` is per own rank.
    """
    tl = build_timeline(events, cfg, job_start_ms, now_ms, final=final)
    interval = bands_mod.sampling_interval_ms(rank, ts_ms)
    horizon = min(tl.decided_until_ms, now_ms)
    if not final:
        ahead = bands_mod.lookahead_ms(interval, int(cfg.grid_s * 1000))
        horizon = min(
            horizon,
            data_horizon(rank, ts_ms, now_ms, interval, cfg.gap_intervals, hold_ranks, ignore_ranks, ahead),
        )
    empty = Pieces(*(np.zeros(0, dt) for dt in (np.int32, np.int64, np.int64, np.int8, np.int8, np.float64)))
    if horizon <= booked_until_ms or (ts_ms.size == 0 and not own_ranks.size):
        return WindowResult(empty, booked_until_ms, tl, {})

    br = job_bands(cfg, tl, rank, ts_ms, power_w, util_pct, n_ranks, profile, interval)
    # Own GPUs: local index = position in own_ranks.
    local_of_rank = np.full(max(n_ranks, int(own_ranks.max(initial=-1)) + 1), -1, np.int64)
    local_of_rank[own_ranks] = np.arange(own_ranks.size)
    mine = local_of_rank[rank] >= 0 if rank.size else np.zeros(0, bool)
    lg = local_of_rank[rank[mine]]
    n_own = own_ranks.size
    job_end = tl.end_ms if tl.end_ms is not None else POS_INF
    cover_end = np.full(n_own, min(horizon, job_end), np.int64)
    slices = make_slices(
        lg,
        ts_ms[mine],
        power_w[mine],
        energy_mj[mine],
        br.band[mine],
        n_own,
        br.interval_ms,
        member_start_ms.astype(np.int64),
        cover_end,
        cfg.gap_intervals,
    )
    # Cut every own GPU's time at the watermark and the horizon; keep what lies between.
    g = np.arange(n_own)
    slices = _cut_per_gpu(
        slices,
        np.concatenate([g, g]),
        np.concatenate([np.full(n_own, booked_until_ms), np.full(n_own, horizon)]),
    )
    keep = (slices.start_ms >= booked_until_ms) & (slices.end_ms <= horizon)
    slices = Slices(
        *(getattr(slices, f)[keep] for f in ("gpu", "start_ms", "end_ms", "band", "energy_mj")),
        slices.span_start_ms,
        slices.span_end_ms,
    )
    pieces = book(slices, tl, own_ranks, member_start_ms.astype(np.int64), np.minimum(cover_end, job_end))
    inside = pieces.category != Category.UNASSIGNED
    if not inside.all():
        pieces = Pieces(*(getattr(pieces, f)[inside] for f in Pieces.__slots__))

    latest: dict[int, int] = {}
    if lg.size:
        last = np.flatnonzero(np.append(lg[1:] != lg[:-1], True))
        latest = {int(lg[i]): int(br.band[mine][i]) for i in last}
    return WindowResult(pieces, horizon, tl, latest)
