"""A job's round committed: the ledger delta, the figures and the watermark (and the fold, when
one is due) in one compare-and-set MULTI/EXEC (`ledger.commit`). A second agent with the same id
loses, re-reads and books nothing twice."""

from __future__ import annotations

import time
from typing import Any

from costexporter.core.attribution import Attribution
from costexporter.core.booking import NEG_INF, Timeline
from costexporter.core.cost import Prices
from costexporter.core.figures import at_risk_field, encode_at_risk
from costexporter.core.live import LedgerDelta
from costexporter.core.pricing import PriceSchedule, as_schedule
from costexporter.core.profiles import Profile
from costexporter.services.agent_context import AgentContext
from costexporter.services.agent_fold import FoldWrite, JobFolds
from costexporter.services.agent_job import AgentJob
from costexporter.store import ledger
from costexporter.store.client import Pipeline


def round_figures(
    delta: LedgerDelta,
    preflight: str,
    progress: dict[str, Any],
    profile: Profile,
    agent_id: str,
    tl: Timeline,
    horizon_ms: int,
) -> dict[str, Any]:
    """The job's figures written with the round (the API's and the exporter's)."""
    return {
        **delta.figures,
        "preflight": preflight,
        **progress,
        "profile": profile.name,
        "profile_calibrated": int(profile.calibrated),
        # The profile's band edges, for the dashboard's power thresholds.
        "band_idle_max_w": profile.idle_max_w,
        "band_low_max_w": profile.low_max_w,
        "band_compute_min_w": profile.compute_min_w,
        # This agent's GPU time at risk since the last checkpoint, exact (the API sums the
        # agents' when the window holds it; the buckets would start at the checkpoint's 5 min).
        at_risk_field(agent_id): encode_at_risk(delta.at_risk_ms, tl.last_checkpoint_ms, horizon_ms),
        # Redis restarted empty while this agent booked the job: its ledger before here went
        # with it (the API says so: `unknown_before`).
        **(
            {ledger.unknown_field(agent_id): delta.state.rb_lost_until}
            if delta.state.rb_lost_until > NEG_INF
            else {}
        ),
        **(
            {ledger.slow_field(agent_id): ledger.encode_slow(delta.state.slow.gpu_s, delta.state.slow.blocks)}
            if delta.state.slow.gpu_s
            else {}
        ),
    }


class RoundCommit:
    """Commits a job's round: delta, figures, watermark and fold in one transaction."""

    def __init__(self, ctx: AgentContext, folds: JobFolds) -> None:
        self.redis = ctx.redis
        self.prefix = ctx.cfg.prefix
        self.agent_id = ctx.cfg.agent_id
        self.host = ctx.host
        self.instance = ctx.instance  # this process: its watermarks say it wrote them
        self.folds = folds

    def commit(
        self,
        job: AgentJob,
        delta: LedgerDelta,
        figures: dict[str, Any],
        prices: Prices | PriceSchedule,
        tl: Timeline,
        now_ms: int,
        attribution: Attribution | None = None,
    ) -> None:
        """Commit the round (ledger.Conflict when another writer moved the watermark); the job's
        compare-and-set value, and the stored fold's notes, follow it."""
        sched = as_schedule(prices)
        version = sched.changes[0][2] if len(sched.changes) == 1 else (lambda b: sched.version_at(b * 1000))
        wm = {
            **delta.state.to_json(),
            "agent": self.agent_id,
            "host": self.host,
            "instance": self.instance,
            "updated": time.time(),
        }
        fold: FoldWrite | None = self.folds.write_due(job, now_ms)
        booked_until = job.booked_until

        def queue(pipe: Pipeline) -> None:
            ledger.queue_delta(
                pipe, self.prefix, job.name, self.agent_id, delta, version, tl.steps, booked_until, figures
            )
            if attribution is not None:
                ledger.queue_attribution(pipe, self.prefix, job.name, attribution)
            if fold is not None:
                self.folds.queue(pipe, job, fold)

        job.wm_raw = ledger.commit(self.redis, self.prefix, job.name, self.agent_id, job.wm_raw, wm, queue)
        if fold is not None:
            self.folds.stored(job, fold)
