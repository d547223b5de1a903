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

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from costexporter.core import bands as bands_mod
from costexporter.core import causes, shares, straggler
from costexporter.core.booking import (
    NEG_INF,
    POS_INF,
    BookingConfig,
    Pieces,
    Slices,
    Timeline,
    _cut_per_gpu,
    book,
    build_timeline,
    dated_until,
    job_bands,
    make_slices,
)
from costexporter.core.buckets import BUCKET_S, amounts, cut_at
from costexporter.core.causes import HardwareEvent
from costexporter.core.cost import Prices
from costexporter.core.figures import Incident, at_risk_ms, extend_incidents, extend_rolled_back, job_figures
from costexporter.core.model import VALID_CODES, Category, Event
from costexporter.core.pricing import PriceSchedule, as_schedule
from costexporter.core.profiles import Profile


@dataclass(slots=True)
class WindowResult:
    pieces: Pieces  # own GPUs' pieces in [booked_until, horizon); gpu = index into own_ranks
    horizon_ms: int
    timeline: Timeline
    latest_band: dict[int, int]  # own GPU index -> band of its newest sample
    # Confirmed signature runs of the window (`bands.BandResult.signatures`): (start ms, end ms,
    # the ranks at ~0%), job-wide, so a deadlock incident names the rank that left the collective.
    signatures: list[tuple[int, int, list[int]]] = field(default_factory=list)
    # Where the next round's window may start: (start ms, the horizon, the signature run open
    # there: `bands.RunCarry` or None); None when this round booked nothing.
    next_window: tuple[int, int, bands_mod.RunCarry | None] | None = None
    bands: bands_mod.BandResult | None = None  # the window's bands (None: it booked nothing)


@dataclass(frozen=True, slots=True)
class TraceConstants:
    """What replay takes once of a whole trace it books in windows (`book_window`), so that
    every window cuts the same moments: the sampling interval and phase; where the windows
    before stopped counting the straggler's evidence (None: none before), and whether the last
    one counts the rest (else windows after it do)."""

    interval_ms: int
    phase_ms: float
    counted_until_ms: int | None = None
    counts_the_rest: bool = True  # the last window counts every moment it holds


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
    member_end_ms: np.ndarray | None = None,
    booked_from_ms: np.ndarray | None = None,
    timeline: Timeline | None = None,
    carry: bands_mod.RunCarry | None = None,
    lanes: np.ndarray | None = None,
    trace: TraceConstants | None = None,
) -> WindowResult:
    """Book the decided part of [booked_until, now) for the GPUs of `own_ranks`.

    Samples are those of every rank of the job in the context window (this agent's and the
    other agents'), sorted by (rank, ts). `member_start_ms` and `member_end_ms` (when another
    job registered the GPU later) are per own rank. `booked_from_ms` (per own rank, default
    `booked_until_ms`) lets a rank that joined after the job's watermark had passed its start
    (a rank discovered late; that time is nobody else's) catch up: the result's horizon may then
    lie before `booked_until_ms`. `timeline`: the job's timeline at `now_ms` when the caller
    folds it incrementally (`fold.TimelineFold`); else built from `events`. `lanes` (per own
    rank: lo, hi, den) where an own GPU is a shared slice (`core.shares`). `trace`: what replay
    takes once of a whole trace it books in windows (the sampling interval and phase, where an
    earlier window stopped counting the straggler's evidence); the live agent takes them from
    each window.
    """
    if timeline is None:
        timeline = build_timeline(
            events if final else dated_until(events, now_ms), cfg, job_start_ms, now_ms, final=final
        )
    tl = timeline
    interval = bands_mod.sampling_interval_ms(rank, ts_ms) if trace is None else trace.interval_ms
    horizon = min(tl.decided_until_ms, now_ms)
    if not final:
        ahead = bands_mod.lookahead_ms(interval, int(cfg.grid_s * 1000))
        horizon = min(
            horizon,
            data_horizon(rank, ts_ms, now_ms, interval, cfg.gap_intervals, hold_ranks, ignore_ranks, ahead),
        )
        if tl.steps:  # its steps are known up to now_ms; the spin signature looks past a moment
            horizon = min(horizon, now_ms - bands_mod.step_lookahead_ms(interval, int(cfg.grid_s * 1000)))
    empty = Pieces.empty()
    booked_from = (
        np.full(own_ranks.size, booked_until_ms, np.int64)
        if booked_from_ms is None
        else np.minimum(booked_from_ms.astype(np.int64), booked_until_ms)
    )
    if horizon <= booked_from.min(initial=booked_until_ms) or (ts_ms.size == 0 and not own_ranks.size):
        return WindowResult(empty, booked_until_ms, tl, {})

    # The next window starts `overlap` before this round's horizon, carrying the signature run
    # open there: a window holds seconds of every rank's samples, not a checkpoint's allowance.
    overlap = bands_mod.window_overlap_ms(interval, int(cfg.grid_s * 1000), cfg.gap_intervals)
    # The agent: each window's own phase, the moments from where the round before stopped
    # to the horizon counted; replay: the trace's phase and where its windows stand (`trace`).
    phase: float | None = None
    count: tuple[int | None, int | None] = (booked_until_ms, None if final else horizon)
    if trace is not None:
        phase = trace.phase_ms
        count = (trace.counted_until_ms, None if final and trace.counts_the_rest else horizon)
    br = job_bands(
        cfg, tl, rank, ts_ms, power_w, util_pct, n_ranks, profile, interval, carry, horizon, phase, count
    )
    # Own GPUs: local index = position in own_ranks.
    local_of_rank = np.full(max(n_ranks, int(own_ranks.max(initial=-1)) + 1), -1, np.int64)
    local_of_rank[own_ranks] = np.arange(own_ranks.size)
    local = local_of_rank[rank]
    own = local >= 0
    mine: slice | np.ndarray = slice(None) if own.all() else own  # (replay: every GPU its own)
    lg = local[mine]
    n_own = own_ranks.size
    job_end = tl.end_ms if tl.end_ms is not None else POS_INF
    cover_end = np.full(n_own, min(horizon, job_end), np.int64)
    if member_end_ms is not None:
        cover_end = np.minimum(cover_end, member_end_ms.astype(np.int64))
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
        np.concatenate([booked_from, np.full(n_own, horizon)]),
    )
    keep = (slices.start_ms >= booked_from[slices.gpu]) & (slices.end_ms <= horizon)
    if not keep.all():  # (a replay's last window keeps them all: no copy)
        slices = Slices(
            slices.gpu[keep],
            slices.start_ms[keep],
            slices.end_ms[keep],
            slices.band[keep],
            slices.energy_mj[keep],
            slices.span_start_ms,
            slices.span_end_ms,
        )
    pieces = book(slices, tl, own_ranks, member_start_ms.astype(np.int64), np.minimum(cover_end, job_end))
    inside = pieces.category != Category.UNASSIGNED
    if not inside.all():
        pieces = pieces.take(inside)
    if lanes is not None and pieces.gpu.size:
        pieces.lanes = np.asarray(lanes, np.int64)[pieces.gpu]

    latest: dict[int, int] = {}
    if lg.size:
        last = np.flatnonzero(np.append(lg[1:] != lg[:-1], True))
        own_band = br.band[mine]  # (once: not per GPU)
        latest = dict(zip(lg[last].tolist(), own_band[last].tolist(), strict=True))
    return WindowResult(
        pieces, horizon, tl, latest, list(br.signatures), (horizon - overlap, horizon, br.carry), br
    )


# ---- the ledger delta of one round (pure) -----------------------------------------------------
N_CAT = len(Category)
VALID = VALID_CODES


def zeros() -> np.ndarray:
    return np.zeros((N_CAT, 3), np.int64)


@dataclass
class JobState:
    """What one agent has booked of one job, as its watermark stores it (`ledger:wm:<agent>`)."""

    booked_until: int = 0
    cum: np.ndarray = field(default_factory=zeros)  # valid amounts booked so far
    booked: np.ndarray = field(default_factory=zeros)  # all amounts booked by this agent
    voided: np.ndarray = field(default_factory=zeros)  # valid amounts moved to rolled_back
    # step record -> cum (flattened); the agent keeps here only the entries a round needs (the
    # rest are in the `rbidx` hash, read when a resume voids their records)
    rb_index: dict[int, list[int]] = field(default_factory=dict)
    rb_applied: set[int] = field(default_factory=set)  # step records whose void is booked
    rb_floor: int = 0  # index entries of records below this are pruned (no resume reaches them)
    # Index entries of records at or before this time went with Redis (it restarted empty): a
    # resume reaching back there is not booked (counted), rather than computed from nothing.
    rb_lost_until: int = NEG_INF
    incidents: dict[str, Incident] = field(default_factory=dict)  # category -> the open incident
    starts: dict[int, int] = field(default_factory=dict)  # own rank -> when its GPU's time starts
    # own rank -> how far its GPU is booked, for a rank that joined after the watermark had passed
    # its start (its register was read late): it catches up to `booked_until`, then leaves this
    behind: dict[int, int] = field(default_factory=dict)
    # own rank -> how far this job has booked its GPU: the watermark, or less once the job's
    # hold on the GPU ended (another job took it). A later claim of the GPU starts there, and
    # only there: the watermark moves on past the end, the GPU's time is not this job's.
    held: dict[int, int] = field(default_factory=dict)
    # rank -> the node's GPU its first registration here named: the one its time is booked on
    # (fixed with its start), or one another rank holds (`jobfacts.one_rank_per_gpu`). A rank
    # that registers again naming another GPU stays there, also after a restart, when the ranks
    # hash holds only its newest registration.
    gpus: dict[int, int] = field(default_factory=dict)
    since_ref_ms: int = -1  # the last progress point ...
    since_cost: int = 0  # ... and the cost (micro-units) booked after it
    # The band window, (samples from, where its carry stands, the signature run open there:
    # `bands.RunCarry` or None); None: the whole context. `win_next`: where the next one may start.
    win: tuple[int, int, bands_mod.RunCarry | None] | None = None
    win_next: tuple[int, int, bands_mod.RunCarry | None] | None = None
    # Stretches [a, b) booked while the job's events could not be read (`booking.with_unread`;
    # the last one open, b = POS_INF, while they still cannot): every later timeline of the job
    # keeps them UNREAD, so no run rule hands that time to another ledger once it is read again.
    unread: list[tuple[int, int]] = field(default_factory=list)
    # kgCO2e of the energy booked, in micrograms (`carbon.GridIntensity.micrograms`): counted
    # with the watermark, so a round's carbon is counted exactly once.
    carbon_ug: int = 0
    # The slow rank's evidence of the minutes still open and, per slow rank, the GPU-seconds it
    # held this agent's GPUs longer (`straggler.Ledger`): counted with the watermark, once.
    slow: straggler.Ledger = field(default_factory=straggler.Ledger)

    def take_window(self, oldest_unbooked: int) -> tuple[int | None, bands_mod.RunCarry | None]:
        """This round's band window (samples from, carry), moving on to the next one once
        everything left to book lies at or after where its carry stands; (None, None), the whole
        context, while something left to book lies before (a rank registered late)."""
        if self.win_next is not None and self.win_next[1] <= oldest_unbooked:
            self.win, self.win_next = self.win_next, None
        if self.win is None or self.win[1] > oldest_unbooked:
            return None, None
        return self.win[0], self.win[2]

    def to_json(self) -> dict[str, object]:
        return {
            "booked_until": self.booked_until,
            "cum": self.cum.tolist(),
            "booked": self.booked.tolist(),
            "voided": self.voided.tolist(),
            "rb_applied": sorted(self.rb_applied),
            "rb_floor": self.rb_floor,
            **({"rb_lost_until": self.rb_lost_until} if self.rb_lost_until > NEG_INF else {}),
            "incidents_open": self.incidents,
            "starts": {str(k): v for k, v in self.starts.items()},
            "behind": {str(k): v for k, v in self.behind.items()},
            "held": {str(k): v for k, v in self.held.items()},
            "gpus": {str(k): v for k, v in self.gpus.items()},
            "since_ref_ms": self.since_ref_ms,
            "since_cost": self.since_cost,
            "win": [_window_json(self.win), _window_json(self.win_next)],
            **({"unread": [list(x) for x in self.unread]} if self.unread else {}),
            **({"carbon_ug": self.carbon_ug} if self.carbon_ug else {}),
            **({"slow": self.slow.to_json()} if self.slow else {}),
        }

    @classmethod
    def from_json(cls, wm: dict[str, Any], rb_index: dict[int, list[int]]) -> JobState:  # Any: JSON
        def arr(k: str) -> np.ndarray:
            return np.asarray(wm[k], np.int64).reshape(N_CAT, 3) if k in wm else zeros()

        return cls(
            booked_until=int(wm.get("booked_until", 0)),
            cum=arr("cum"),
            booked=arr("booked"),
            voided=arr("voided"),
            rb_index=rb_index,
            rb_applied=set(wm.get("rb_applied", [])),
            rb_floor=int(wm.get("rb_floor", 0)),
            rb_lost_until=int(wm.get("rb_lost_until", NEG_INF)),
            incidents=wm.get("incidents_open", {}),
            starts={int(k): int(v) for k, v in wm.get("starts", {}).items()},
            behind={int(k): int(v) for k, v in wm.get("behind", {}).items()},
            held={int(k): int(v) for k, v in wm.get("held", {}).items()},
            gpus={int(k): int(v) for k, v in wm.get("gpus", {}).items()},
            since_ref_ms=int(wm.get("since_ref_ms", -1)),
            since_cost=int(wm.get("since_cost", 0)),
            **_window_from_json(wm.get("win")),
            unread=[(int(a), int(b)) for a, b in wm.get("unread", [])],
            carbon_ug=int(wm.get("carbon_ug", 0)),
            slow=straggler.Ledger.from_json(wm.get("slow", {})),
        )


Window = tuple[int, int, bands_mod.RunCarry | None]  # `JobState.win`


def _window_json(w: Window | None) -> list[object] | None:
    return None if w is None else [w[0], w[1], w[2].to_json() if w[2] is not None else None]


def _window_from_json(x: Any) -> dict[str, Window | None]:
    """The stored band windows; older or damaged ones are none (the whole context)."""

    def one(w: Any) -> Window | None:
        return None if w is None else (int(w[0]), int(w[1]), bands_mod.RunCarry.from_json(w[2]))

    try:
        cur, nxt = x
        return {"win": one(cur), "win_next": one(nxt)}
    except (TypeError, ValueError, KeyError, IndexError, AttributeError):
        return {}


@dataclass
class LedgerDelta:
    """Everything one round writes for one job, with the state it leaves (`state`)."""

    by_bucket: dict[int, np.ndarray]  # bucket start (s) -> amounts booked this round
    moved: np.ndarray  # valid amounts voided this round (the `voided:` corrections) ...
    rolled: np.ndarray  # ... and the same amounts as rolled_back
    correction_bucket: int  # where the corrections are booked: the bucket of the horizon
    index_new: dict[int, list[int]]  # rollback index entries of the step records booked this round
    index_drops: set[int]  # ... and the stored entries no resume reads again (pruned)
    unreachable_voids: int  # voided records whose entries were pruned: not moved (counted)
    lost_voids: int  # voided records whose entries went with Redis's empty restart: not moved
    voids: set[int]  # step records voided this round
    incidents: dict[str, Incident]
    figures: dict[str, float]
    at_risk_ms: int
    state: JobState
    # ("steps", "voids") members as `ledger.queue_steps` writes them, when the timeline is folded
    # (it keeps only recent step records); None: `queue_steps` computes them from every record.
    step_members: tuple[dict[str, float], dict[str, float]] | None = None


def valid_amounts(prices: Prices, cat: np.ndarray, ms: np.ndarray, mj: np.ndarray) -> np.ndarray:
    """[category, (ms, mJ, micro-cost)] of the valid categories only."""
    a = zeros()
    ms_c = np.bincount(cat, weights=ms, minlength=N_CAT)
    mj_c = np.bincount(cat, weights=mj, minlength=N_CAT)
    cost = prices.cost(ms_c, mj_c, np.arange(N_CAT))
    a[:, 0] = np.round(ms_c)
    a[:, 1] = np.round(mj_c)
    a[:, 2] = np.round(cost * 1e6)
    a[[c for c in range(N_CAT) if c not in VALID]] = 0
    return a


def index_entry(cum: np.ndarray) -> list[int]:
    """A rollback index entry: the cumulative amounts of the valid categories only (the only ones
    a resume moves), [(ms, mJ, micro-cost)] per valid category."""
    return cum[VALID].ravel().tolist()


def index_amounts(entry: list[int]) -> np.ndarray:
    """An index entry back as [category, (ms, mJ, micro-cost)]; also the older full layout."""
    a = np.asarray(entry, np.int64)
    if a.size == N_CAT * 3:
        return a.reshape(N_CAT, 3)
    out = zeros()
    out[VALID] = a.reshape(len(VALID), 3)
    return out


def voided_part(
    i: int,
    index: dict[int, list[int]],
    cum_now: np.ndarray,
    booked_until: int,
    prev_ts: int,
    floor: int = 0,
    rec_ts: int | None = None,
    lost_until: int = NEG_INF,
) -> np.ndarray | None:
    """Valid amounts already booked inside step record i's interval, which began at `prev_ts`
    (the previous record's time, or the job's start) and ends at `rec_ts`. None: an entry it
    needs is gone, pruned (a resume further back than `BookingConfig.rollback_checkpoints`
    reaches) or lost with Redis (a record at or before `lost_until`): never read as zero."""
    if prev_ts >= booked_until:
        return zeros()  # nothing of it was booked yet: it books VOID later
    if i > 0 and i - 1 not in index and (i - 1 < floor or prev_ts <= lost_until):
        return None
    if i not in index and rec_ts is not None and rec_ts <= lost_until:
        return None
    prev = index_amounts(index[i - 1]) if i > 0 and i - 1 in index else 0
    cur = index_amounts(index[i]) if i in index else cum_now
    part: np.ndarray = np.clip(cur - prev, 0, None)  # (numpy's stubs give np.clip of an int as Any)
    return part


def index_drops(applied: set[int], new: set[int]) -> set[int]:
    """Entries no resume reads again, once the records in `new` are voided: entry j is read to
    void record j (`cur`) or record j + 1 (`prev`), so it goes when both are voided."""
    return {j for i in new for j in (i - 1, i) if j >= 0 and j in applied and j + 1 in applied}


def cost_after(pieces: Pieces, ref_ms: int, prices: Prices | PriceSchedule) -> int:
    """Cost (micro-units) of the part of `pieces` after `ref_ms`: money burned since the last
    progress point, for the "cost slope without steps" alert's annotation."""
    after = pieces.end_ms > ref_ms
    if not after.any():
        return 0
    start = np.maximum(pieces.start_ms[after], ref_ms)
    end = pieces.end_ms[after]
    full = np.maximum(end - pieces.start_ms[after], 1)
    mj = np.nan_to_num(pieces.energy_mj[after]) * (end - start) / full
    cat = pieces.category[after].astype(np.int64)
    ms = shares.gpu_ms(start, end, None if pieces.lanes is None else pieces.lanes[after])

    def cost(p: Prices, ms: np.ndarray, mj: np.ndarray, cat: np.ndarray) -> np.ndarray:
        return np.asarray(np.sum(p.cost(ms.astype(float), mj, cat)))

    return round(float(_scheduled(as_schedule(prices), start, cost, ms, mj, cat)) * 1e6)


def _index_entries(
    state: JobState, res: WindowResult, sched: PriceSchedule
) -> tuple[dict[int, list[int]], np.ndarray]:
    """The rollback index entries of the step records booked this round (cumulative valid amounts
    at each), and the cumulative valid amounts after the round."""
    tl, p = res.timeline, res.pieces
    index_new: dict[int, list[int]] = {}
    vp = np.isin(p.category, VALID)
    vp_start, vp_end, vp_cat, vp_mj = p.start_ms[vp], p.end_ms[vp], p.category[vp], p.energy_mj[vp]
    vp_lanes = None if p.lanes is None else p.lanes[vp]
    for i, rec in enumerate(tl.steps, tl.step_base):
        if state.booked_until < rec.ts_ms <= res.horizon_ms and i not in state.rb_index:
            cut = np.clip(np.minimum(vp_end, rec.ts_ms), vp_start, None)
            frac = np.divide(
                cut - vp_start, vp_end - vp_start, out=np.zeros(cut.size), where=vp_end > vp_start
            )
            upto = shares.gpu_ms(vp_start, cut, vp_lanes)
            index_new[i] = index_entry(
                state.cum + _scheduled(sched, vp_start, valid_amounts, vp_cat, upto, vp_mj * frac)
            )
    new_cum = state.cum + _scheduled(
        sched, vp_start, valid_amounts, vp_cat, shares.gpu_ms(vp_start, vp_end, vp_lanes), vp_mj
    )
    return index_new, new_cum


def _scheduled(
    sched: PriceSchedule,
    start_ms: np.ndarray,
    fn: Callable[..., np.ndarray],
    *arrays: np.ndarray,
) -> np.ndarray:
    """`fn(prices, *arrays)` at the price of each piece's start (pieces are cut at the
    schedule's changes first: `buckets.cut_at`): one call where one price covers them all, else
    one per price, summed."""
    if start_ms.size == 0 or not sched.cuts(int(start_ms.min()), int(start_ms.max()) + 1):
        return fn(sched.at(int(start_ms.min()) if start_ms.size else 0), *arrays)
    total: np.ndarray | None = None
    for a, b, prices in sched.spans(int(start_ms.min()), int(start_ms.max()) + 1):
        m = (start_ms >= a) & (start_ms < b)
        part = fn(prices, *(x[m] for x in arrays))
        total = part if total is None else total + part
    assert total is not None
    return total


def _new_voids(tl: Timeline, applied: set[int], job_start_ms: int) -> list[tuple[int, Any, int]]:
    """The voided step records not applied yet: (index, record, its predecessor's time)."""
    if tl.summary is not None:  # folded: every voided record, with its predecessor's time
        return [
            (i, rec, job_start_ms if prev is None else prev)
            for i, rec, prev in tl.summary.voided
            if i not in applied
        ]
    return [
        (i, rec, tl.steps[i - 1].ts_ms if i > 0 else job_start_ms)
        for i, rec in enumerate(tl.steps)
        if rec.voided and i not in applied
    ]


@dataclass
class _Voids:
    """What a round's resumes move: valid amounts to rolled_back, the spans they held."""

    moved: np.ndarray
    applied: set[int]
    spans: list[tuple[int, int]]  # the newly voided steps that held booked valid time
    unreachable: int  # voided records whose index entries were pruned: their move is left out
    lost: int  # ... or went with Redis's empty restart


def _apply_voids(
    state: JobState, tl: Timeline, index: dict[int, list[int]], new_cum: np.ndarray, job_start_ms: int
) -> _Voids:
    """Resumes: valid amounts already booked in steps that are now voided move to rolled_back."""
    out = _Voids(zeros(), set(state.rb_applied), [], 0, 0)
    lost_until = state.rb_lost_until
    for i, rec, prev_ts in _new_voids(tl, out.applied, job_start_ms):
        out.applied.add(i)
        part = voided_part(
            i, index, new_cum, state.booked_until, prev_ts, state.rb_floor, rec.ts_ms, lost_until
        )
        if part is None:
            if prev_ts <= lost_until:
                out.lost += 1
            else:
                out.unreachable += 1
            continue
        out.moved += part
        if part[VALID, 0].sum() > 0:
            out.spans.append((max(int(prev_ts), job_start_ms), min(rec.ts_ms, state.booked_until)))
    return out


def _pruned_index(
    state: JobState, tl: Timeline, index: dict[int, list[int]], applied: set[int]
) -> tuple[dict[int, list[int]], set[int], int]:
    """(the index kept, the entries dropped, the new floor): entries no resume can read again,
    both records around them voided, or below the oldest checkpoint a resume can reach."""
    drops = index_drops(applied, applied - state.rb_applied)
    floor = state.rb_floor
    if tl.rollback_floor is not None and tl.rollback_floor > floor:
        drops |= set(range(floor, tl.rollback_floor))
        floor = tl.rollback_floor
    return {k: v for k, v in index.items() if k not in drops and k >= floor}, drops, floor


def _held(
    state: JobState,
    horizon_ms: int,
    booked_until: int,
    own_ranks: np.ndarray,
    member_end_ms: np.ndarray | None,
) -> tuple[dict[int, int], dict[int, int]]:
    """(how far each rank's GPU is booked, where each behind rank caught up to)."""
    caught_up = {r: max(v, horizon_ms) for r, v in state.behind.items()}
    held = dict(state.held)
    ends = member_end_ms.tolist() if member_end_ms is not None else [POS_INF] * own_ranks.size
    for r, end in zip(own_ranks.tolist(), ends, strict=True):
        reach = min(caught_up.get(r, booked_until), int(end))  # a behind rank: where it caught up to
        if reach > held.get(r, NEG_INF):
            held[r] = reach
    return held, caught_up


def ledger_delta(
    state: JobState,
    res: WindowResult,
    *,
    prices: Prices | PriceSchedule,
    own_ranks: np.ndarray,
    member_start_ms: np.ndarray,
    job_start_ms: int,
    last_progress_ms: int,
    host: str,
    incident_tol_ms: int,
    bucket_s: int = BUCKET_S,
    member_end_ms: np.ndarray | None = None,
    hardware: Sequence[tuple[int, HardwareEvent]] = (),
) -> LedgerDelta:
    """From the agent's state of a job and one booked window to what the round writes: bucket
    amounts, rollback corrections and index entries, step/void records, incidents, figures and
    the next state. `hardware`: the own GPUs' hardware events as (job rank, event), which with
    the timeline's checkpoint overruns give each incident its cause (`causes.attach`). Pure: the
    agent commits it with its watermark in one compare-and-set."""
    sched = as_schedule(prices)
    tl, p = res.timeline, res.pieces
    changes = sched.cuts(int(p.start_ms.min()), int(p.end_ms.max())) if p.gpu.size else []
    if changes:  # a price change inside the round: each piece priced at its start's price
        p = cut_at(p, changes)
        res = dataclasses.replace(res, pieces=p)
    by_bucket = amounts(p, sched, bucket_s)
    booked = sum(by_bucket.values(), zeros())
    index_new, new_cum = _index_entries(state, res, sched)
    # Resumes: valid amounts already booked in steps that are now voided move to rolled_back.
    index = {**state.rb_index, **index_new}
    v = _apply_voids(state, tl, index, new_cum, job_start_ms)
    index, drops, floor = _pruned_index(state, tl, index, v.applied)
    rolled = zeros()
    rolled[Category.ROLLED_BACK] = v.moved[VALID].sum(0)

    since_cost = (state.since_cost if last_progress_ms == state.since_ref_ms else 0) + cost_after(
        p, last_progress_ms, sched
    )
    incidents = extend_incidents(
        state.incidents,
        p,
        own_ranks,
        host,
        incident_tol_ms,
        res.signatures,
        cost=lambda q: cost_after(q, NEG_INF, sched),
    )
    if v.spans:
        end = max(b for _, b in v.spans)
        ranks = [int(r) for r, t in zip(own_ranks.tolist(), member_start_ms.tolist(), strict=True) if t < end]
        gpu_ms, ucost = int(v.moved[VALID, 0].sum()), int(v.moved[VALID, 2].sum())
        incidents = extend_rolled_back(incidents, v.spans, gpu_ms, ranks, host, incident_tol_ms, ucost)
    incidents = causes.attach(incidents, hardware, tl.phases_overrun, tl.crashes)
    booked_until = max(state.booked_until, res.horizon_ms)
    held, caught_up = _held(state, res.horizon_ms, booked_until, own_ranks, member_end_ms)
    nxt = JobState(
        booked_until=booked_until,
        cum=new_cum,
        booked=state.booked + booked + rolled,
        voided=state.voided + v.moved,
        rb_index=index,
        rb_applied=v.applied,
        rb_floor=floor,
        rb_lost_until=state.rb_lost_until,
        incidents=incidents,
        starts=dict(state.starts),
        gpus=dict(state.gpus),
        behind={r: t for r, t in caught_up.items() if t < booked_until},
        held=held,
        since_ref_ms=last_progress_ms,
        since_cost=since_cost,
        win=state.win,
        win_next=res.next_window or state.win_next,
        unread=list(state.unread),
        carbon_ug=state.carbon_ug,  # the agent adds this round's (it knows the grid's intensity)
        slow=state.slow.copy(),  # the agent adds this round's (it knows the job's ranks and profile)
    )
    new_voids = v.applied - state.rb_applied
    return LedgerDelta(
        by_bucket=by_bucket,
        moved=v.moved,
        rolled=rolled,
        correction_bucket=res.horizon_ms // 1000 // bucket_s * bucket_s,
        index_new={k: e for k, e in index_new.items() if k not in drops and k >= floor},
        index_drops=drops,
        unreachable_voids=v.unreachable,
        lost_voids=v.lost,
        voids=new_voids,
        incidents=incidents,
        figures=job_figures(tl),
        at_risk_ms=at_risk_ms(tl, res.horizon_ms, member_start_ms),
        state=nxt,
        step_members=(
            folded_step_members(tl, state.booked_until, res.horizon_ms, new_voids)
            if tl.summary is not None
            else None
        ),
    )


def needed_index_entries(tl: Timeline, applied: set[int]) -> set[int]:
    """The rollback index entries a round's voids read: each new voided record's and the one
    before it (an agent fetches these instead of holding the whole index)."""
    if tl.summary is not None:
        new = [i for i, _r, _p in tl.summary.voided if i not in applied]
    else:
        new = [i for i, r in enumerate(tl.steps) if r.voided and i not in applied]
    return {j for i in new for j in (i, i - 1) if j >= 0}


def folded_step_members(
    tl: Timeline, after_ms: int, upto_ms: int, voids: set[int]
) -> tuple[dict[str, float], dict[str, float]]:
    """`ledger.queue_steps`'s members from a folded timeline: the same names and scores."""
    s = tl.summary
    assert s is not None, "members of a folded timeline only"
    done: dict[str, float] = {}
    cum = s.tokens_before
    for i, rec in enumerate(tl.steps, tl.step_base):
        cum += rec.tokens
        if after_ms < rec.ts_ms <= upto_ms:
            done[f"{i}:{cum}"] = rec.ts_ms / 1000
    voided: dict[str, float] = {}
    if voids:
        cum_v = 0
        for i, rec, _p in sorted(s.voided, key=lambda v: (v[1].voided_ms or 0, v[0])):
            cum_v += rec.tokens
            if i in voids:
                voided[f"{i}:{cum_v}"] = (rec.voided_ms or rec.ts_ms) / 1000
    return done, voided
