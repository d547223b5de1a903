"""The time of this node's GPUs that no job holds, booked into the `_unassigned` ledger.

Held back `unassigned_hold_s` behind the newest sample, so a register that arrives late still
gets its GPU's time; booked to the end at shutdown and after a replay's last sample.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable

import numpy as np

from costexporter.core import bands as bands_mod
from costexporter.core import buckets
from costexporter.core.booking import POS_INF, Pieces, _cut_per_gpu, make_slices
from costexporter.core.model import Category
from costexporter.core.timeutil import to_ms
from costexporter.services.agent_context import AgentContext, KeyGuard
from costexporter.services.agent_job import AgentJob
from costexporter.store import ledger, untrusted
from costexporter.store.keys import watermark_key

Claim = tuple[int, int, int]  # (GPU, start ms, end ms) of a job's hold


class UnassignedBooker:
    """Books the `_unassigned` ledger from this node's samples and the jobs' holds; its own
    watermark, loaded and committed like a job's."""

    def __init__(self, ctx: AgentContext, guard: KeyGuard) -> None:
        self.redis = ctx.redis
        self.cfg = ctx.cfg
        self.host = ctx.host
        self.instance = ctx.instance
        self._redis_errors = ctx.redis_errors
        self._guard = guard
        self.until: int | None = None  # the watermark: booked up to here (None: not read yet)
        # Per GPU, where its last unassigned piece ends (None: a watermark stored before this was
        # kept): a GPU whose time a claim held back is booked only that far, whatever the
        # watermark says, so a claim read later (by a twin agent too) starts there.
        self.gpu_until: dict[int, int] | None = None
        self.raw: str | None = None  # ... as last read or written (the compare-and-set)
        self.loaded = False
        # True once the ledger is booked to the end of the newest sample (at shutdown, or after
        # a replay's last one): a bill read before then would miss its last stretch.
        self.settled = False

    def load(self, ahead_only: bool = False) -> None:
        """The stored watermark (at start, and after an uncertain write). With `ahead_only`,
        adopted only if it is ahead of ours (a twin agent booked further), so a late claim starts
        after it; never going back (after an empty Redis restart our in-memory watermark is the
        truth)."""
        k = watermark_key(self.cfg.prefix, ledger.UNASSIGNED_JOB, self.cfg.agent_id)
        try:
            raw = self.redis.get(k)
        except self._redis_errors as e:
            if not untrusted.is_wrong_type(e):
                raise
            self._guard.wrong_type(ledger.UNASSIGNED_JOB, e, {k: "string"})
            raw = None
        wm = json.loads(raw) if raw else {}
        stored = int(wm.get("booked_until", 0))
        if ahead_only and stored <= (self.until or 0):
            return
        self.until, self.raw, self.loaded = stored, raw, True
        gpus = wm.get("gpus") if raw else {}
        self.gpu_until = {int(g): int(t) for g, t in gpus.items()} if isinstance(gpus, dict) else None

    def booked_until(self, gpu: int) -> int:
        """How far this GPU's time is booked as unassigned (a claim of it starts no earlier)."""
        until = self.until or 0
        if self.gpu_until is None:
            return until
        return min(until, self.gpu_until.get(gpu, 0))

    def epoch_reset(self) -> None:
        """Redis restarted empty: book on from this agent's watermark, written afresh."""
        if self.until is not None:
            self.loaded, self.raw = True, None

    def book(
        self,
        local: tuple[np.ndarray, ...],
        jobs: Iterable[AgentJob],
        lanes: Callable[[list[int]], np.ndarray | None],
        final: bool,
    ) -> None:
        """Observed time of this node's GPUs outside every job's hold, into the
        ledger, `unassigned_hold_s` behind the newest sample (a late register still wins it)."""
        gpu, ts, p, _u, e = local
        if ts.size == 0:
            return
        if not self.loaded:
            self.load()
        order = np.lexsort((ts, gpu))
        g, t, pw, en = gpu[order], ts[order], p[order], e[order]
        interval = bands_mod.sampling_interval_ms(g, t)
        # Held back for late registers, except at shutdown and after a replay's last sample (a
        # register that comes later starts at this watermark: booked once either way). Then no
        # later sample comes: the newest sample's slice is one interval, as the offline replay
        # counts it, and the physical time ends there.
        if final:
            horizon = int(t.max()) + interval
        else:
            horizon = int(t.max()) - interval - to_ms(self.cfg.unassigned_hold_s)
        lo = self.until
        assert lo is not None  # load() set it
        if horizon <= lo:
            self.settled = final
            return
        n_g = int(g.max()) + 1
        jobs = list(jobs)
        held = [(gg, a, b) for j in jobs for r, gg in j.own.items() if gg < n_g for a, b in j.held(r)]
        held += [c for j in jobs for c in j.booked_unheld() if c[0] < n_g]
        pieces = self._pieces(g, t, pw, en, n_g, interval, lo, horizon, held, lanes(list(range(n_g))))
        # (A watermark stored before per-GPU ends were kept: every GPU booked to it.)
        gpu_until = dict(self.gpu_until) if self.gpu_until is not None else dict.fromkeys(range(n_g), lo)
        if pieces.gpu.size:
            ends = np.full(n_g, np.iinfo(np.int64).min, np.int64)
            np.maximum.at(ends, pieces.gpu.astype(np.int64), pieces.end_ms)
            for gg in np.flatnonzero(ends > np.iinfo(np.int64).min).tolist():
                gpu_until[gg] = max(gpu_until.get(gg, 0), int(ends[gg]))
        if not self._commit(pieces, horizon, gpu_until):
            return
        self.until, self.gpu_until = horizon, gpu_until
        self.settled = final

    def _pieces(
        self,
        g: np.ndarray,
        t: np.ndarray,
        pw: np.ndarray,
        en: np.ndarray,
        n_g: int,
        interval: int,
        lo: int,
        horizon: int,
        claims: list[Claim],
        lanes: np.ndarray | None,
    ) -> Pieces:
        """The slices of [lo, horizon) outside every claim, as `unassigned` pieces."""
        none = np.full(n_g, POS_INF, np.int64)
        s = make_slices(
            g, t, pw, en, np.zeros(t.size, np.int8), n_g, interval, none, none, self.cfg.booking.gap_intervals
        )
        cut_g = [*range(n_g), *range(n_g), *(c[0] for c in claims), *(c[0] for c in claims)]
        cut_t = [
            *[lo] * n_g,
            *[horizon] * n_g,
            *(c[1] for c in claims),
            *(min(c[2], POS_INF) for c in claims),
        ]
        s = _cut_per_gpu(s, np.asarray(cut_g, np.int64), np.asarray(cut_t, np.int64))
        keep = (s.start_ms >= lo) & (s.end_ms <= horizon)
        for cg, a, b in claims:
            keep &= ~((s.gpu == cg) & (s.start_ms >= a) & (s.end_ms <= b))
        return Pieces(
            s.gpu[keep],
            s.start_ms[keep],
            s.end_ms[keep],
            s.band[keep],
            np.full(int(keep.sum()), Category.UNASSIGNED, np.int8),
            s.energy_mj[keep],
            None if lanes is None else lanes[s.gpu[keep]],
        )

    def _commit(self, pieces: Pieces, horizon: int, gpu_until: dict[int, int]) -> bool:
        """The pieces' amounts with the watermark, compare-and-set; False on a conflict."""
        cfg = self.cfg
        by_bucket = buckets.amounts(pieces, cfg.prices)
        # the price table that costed it, as for a job's buckets (FOCUS reads its unit price there)
        version = buckets.price_version(cfg.prices)
        wm = {
            "booked_until": horizon,
            "gpus": {str(g): t for g, t in sorted(gpu_until.items())},
            "agent": cfg.agent_id,
            "host": self.host,
            "instance": self.instance,
            "updated": time.time(),
        }
        try:
            self.raw = ledger.commit(
                self.redis,
                cfg.prefix,
                ledger.UNASSIGNED_JOB,
                cfg.agent_id,
                self.raw,
                wm,
                lambda pipe: ledger.queue_amounts(
                    pipe, cfg.prefix, ledger.UNASSIGNED_JOB, by_bucket, version
                ),
            )
        except ledger.Conflict as e:
            self._guard.conflict(ledger.UNASSIGNED_JOB, e)
            self.loaded = False
            return False
        return True
