"""One job's round, as the agent books it: its window read (its ranks' starts, every rank's
samples, its terms), booked (`core/live.py`, pure), its live state published and the delta
committed with the watermark (`RoundCommit`). The Agent runs it for each job of this node's
GPUs and decides what a failure costs (`Agent._book_isolated`)."""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from costexporter.core import bands as bands_mod
from costexporter.core import bandtable, jobfacts, live, livestate
from costexporter.core.attribution import Facts
from costexporter.core.booking import POS_INF, Regime, Timeline, with_unread
from costexporter.core.causes import HardwareEvent
from costexporter.core.figures import at_risk_ms
from costexporter.core.live import WindowResult, book_window
from costexporter.core.model import JOB_CODES
from costexporter.core.profiles import Profile
from costexporter.core.terms import JobTerms, Policy, ignored_meta_note, job_terms
from costexporter.core.timeutil import to_ms
from costexporter.services.agent_commit import RoundCommit, round_figures
from costexporter.services.agent_context import AgentContext
from costexporter.services.agent_fold import JobFolds
from costexporter.services.agent_job import AgentJob
from costexporter.services.agent_node import LocalSamples, NodeGpus
from costexporter.services.agent_notes import JobNotes
from costexporter.services.agent_peers import PeerExchange
from costexporter.sources.base import GpuSource
from costexporter.store import protocol, untrusted
from costexporter.store.keys import live_key

log = logging.getLogger("costexporter.agent")

Local = tuple[np.ndarray, ...]  # this node's samples: (gpu, ts ms, W, %, mJ)


@dataclass
class _Window:
    """A job's round, read: its own ranks, their starts, every rank's samples of the band window
    and this agent's own, the job's start, and the data time booked to."""

    own_ranks: np.ndarray
    member_start: np.ndarray
    carry: Any  # the signature run carried into the window (JobState.take_window)
    samples: Local  # every rank's (rank, ts, W, %, mJ), sorted by (rank, ts)
    own: Local  # this agent's (rank, ts, W, %)
    job_start: int
    terms: JobTerms  # the job's terms this round (`terms.job_terms`)
    booked_from: np.ndarray
    profile: Profile
    n_ranks: int
    hold: np.ndarray
    ignore: np.ndarray
    now_ms: int
    played: bool  # no later sample will come: the job is booked to its last sample's slice


def last_progress_ms(tl: Timeline) -> int:
    """The job's last progress point: its newest step, else its start (a time that never moves
    back, unlike a step number after a resume)."""
    return tl.steps[-1].ts_ms if tl.steps else tl.start_ms


@dataclass(frozen=True)
class BookingParts:
    """The agent's parts a job's round uses."""

    samples: LocalSamples
    node: NodeGpus
    peers: PeerExchange
    folds: JobFolds
    committer: RoundCommit
    notes: JobNotes


class JobBooker:
    """Books one job's round. `stats`: rounds booked, steps a resume voided that the rollback
    index no longer reaches; `meta_ignored`: (job, key) a job's meta set that only the
    operator sets; `facts`: what the operator's side read of each job (the Kubernetes path
    sets it)."""

    def __init__(
        self,
        ctx: AgentContext,
        source: GpuSource,
        parts: BookingParts,
        policy: Policy,
        context_ms: int,
        final: Callable[[], bool],
    ) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.source = source
        self.samples, self.node, self.peers = parts.samples, parts.node, parts.peers
        self.folds, self.committer, self.notes = parts.folds, parts.committer, parts.notes
        self.policy = policy
        self.context_ms = context_ms
        self.final = final  # no later sample will come (a replay played out, a shutdown)
        self.stats: collections.Counter[str] = collections.Counter()
        self.meta_ignored: dict[tuple[str, str], int] = {}
        self.facts: Mapping[str, Facts] = {}

    def _terms(self, job: AgentJob, member_start: np.ndarray, profile: Profile) -> JobTerms:
        """The job's terms this round (`terms.job_terms`, as the watcher and replay derive them):
        other hosts' ranks may have registered a little earlier, an ancient date is not trusted.
        What its meta set that only the operator sets is ignored, counted and said once."""
        terms = job_terms(
            job.name,
            job.meta,
            self.policy,
            (reg.ts_ms for reg in job.ranks.values()),
            own_start_ms=int(member_start.min()),
            stored_start_ms=job.fold_start,
            profile=profile,
            facts=self.facts.get(job.name),
            gpu_model=self.node.gpu_model(sorted(job.own.values())),
            host=self.ctx.host,
        )
        name = untrusted.short(job.name, 200)
        new = [k for k in terms.ignored_meta if (name, k) not in self.meta_ignored]
        if new:
            for k in new:
                self.meta_ignored[(name, k)] = 1
            self.ctx.said(
                ("meta_ignored", job.name, *new), logging.WARNING, "%s", ignored_meta_note(job.name, new)
            )
        job.terms = terms
        return terms

    def _starts(self, job: AgentJob, own_ranks: np.ndarray) -> np.ndarray | None:
        """When each own rank's GPU time starts, fixed the first time it is booked and kept in the
        watermark: the register's time, but no earlier than this agent's first sample of the GPU
        or what is booked already elsewhere. A register dated more than `clock_skew_warn_s`
        past the GPU's newest sample (a clock ahead) starts at that sample; one just past it is
        only newer than the last sampling round: None, the job waits a round for a sample to
        reach it (starting at the older sample would bill time before the register)."""
        out: list[int | None] = []
        fixed: dict[int, int] = {}
        tol_ms = to_ms(self.cfg.clock_skew_warn_s)
        final = self.final()
        for r in own_ranks.tolist():
            if r not in job.state.starts:
                g = job.own[r]
                reg = job.ranks[r].ts_ms
                first_seen = self.samples.first_seen
                observed = first_seen.get(g, min(first_seen.values(), default=reg))
                newest = self.samples.newest.get(g)
                start, ahead = jobfacts.gpu_start_ms(reg, observed, newest, job.floors.get(r, 0))
                if 0 < ahead <= tol_ms and not final:
                    return None  # the next sampling round reaches the register: book then
                if jobfacts.register_far_ahead(reg, newest):  # as replay says it
                    self.ctx.refusals.refuse(
                        job.name,
                        "register_after_samples",
                        "rank %d registered %.1f h after GPU %d's newest sample (a clock ahead?): its "
                        "date is not used, its time starts at that sample",
                        r,
                        (reg - (newest or reg)) / 3_600_000,
                        g,
                    )
                fixed[r] = start
                if 0 < fixed[r] < job.state.booked_until:
                    job.state.behind[r] = fixed[r]
            out.append(fixed.get(r, job.state.starts.get(r)))
        job.state.starts.update(fixed)
        # each rank's GPU, fixed with its start: whatever it registers later, its time stays there
        job.state.gpus.update((r, job.own[r]) for r in fixed)
        return np.asarray(out, np.int64)

    # ---- a job's round ---------------------------------------------------------------------
    def book(self, job: AgentJob, local: Local) -> None:
        """Read, book the window (pure), commit the delta with the watermark compare-and-set."""
        if not job.loaded:
            self.folds.load(job)
        unread = False
        try:
            self.folds.read_events(job, self.source.wall_clock)
        except self.ctx.redis_errors as e:
            if not untrusted.is_wrong_type(e):
                raise
            unread = True
            self._unread(job.name)
        w = self._read_window(job, local)
        if w is None:
            return
        spans = job.state.unread
        if unread:  # its GPUs' time from here is unobserved: held, and nothing says what it did
            if not spans or spans[-1][1] < POS_INF:
                spans.append((job.oldest_unbooked, POS_INF))
            tl = with_unread(self.folds.last_timeline(job, w.terms, min(w.now_ms, spans[-1][0])), spans)
        else:
            if spans and spans[-1][1] >= POS_INF:  # readable again: from what is left to book
                spans[-1] = (spans[-1][0], max(spans[-1][0], job.oldest_unbooked))
            tl = with_unread(self.folds.timeline(job, w.terms, w.now_ms, final=w.played), spans)
            job.note_runs(tl)  # a run end frees the GPUs; a later run start takes them back
        ends = np.asarray([job.claim(int(r))[1] for r in w.own_ranks], np.int64)
        member_end = np.maximum(ends, w.member_start)
        res = self._book_window(job, w, tl, member_end)
        self.folds.advance(job, w.now_ms)  # what lies far enough behind, folded for good
        progress = self._publish_round(job, w, res)
        last_ms = last_progress_ms(res.timeline)
        if res.horizon_ms <= job.booked_until and not res.pieces.dur_ms.size:
            self._live_figures(job, res.timeline, w, last_ms)
            return
        self._commit(job, w, res, member_end, last_ms, progress)
        self._live_figures(job, res.timeline, w, last_ms)
        self.stats["rounds"] += 1

    def _read_window(self, job: AgentJob, local: Local) -> _Window | None:
        """The job's round as read: None when there is nothing to book yet (no sample, a start
        not reached by a sample, another host of the job not heard from yet)."""
        cfg = self.cfg
        own_ranks = np.asarray(sorted(job.own), np.int64)
        member_start = self._starts(job, own_ranks)  # a rank registered late is behind from here
        # The band window: seconds before what is left to book, the signature run carried in.
        _, carry = job.state.take_window(job.oldest_unbooked)
        keep_from = job.window_from(self.context_ms)
        self.peers.read(job, keep_from)
        samples, own = self.peers.window(job, local, keep_from)
        R, T = samples[0], samples[1]
        if T.size == 0 or member_start is None:
            return None
        if job.state.booked_until == 0:
            job.state.booked_until = int(member_start.min())
        # A rank that joined after the job's watermark passed its start (its register was read a
        # round late) catches up from its start: that time is held from `_unassigned` as the job's.
        behind = job.state.behind
        booked_from = np.asarray([behind.get(int(r), job.booked_until) for r in own_ranks], np.int64)
        profile = self.node.job_profile(job.meta, sorted(job.own.values()))
        terms = self._terms(job, member_start, profile)
        n_ranks = int(max(max(job.ranks), int(R.max()))) + 1
        hold, ignore, wait = self.peers.liveness(job)
        if wait:
            return None
        now_ms = int(own[1].max()) if own[1].size else int(T.max())
        # A replay played to its end (and no other agent of the job still publishing): no later
        # sample will come, and the job is booked as offline replay books it, to its last sample's
        # slice, its pending tail decided (a job that crashed stays the job's until another takes
        # its GPUs: stalled by band, as replay has it).
        played = bool(getattr(self.source, "done", False)) and not hold.size
        if played:
            now_ms += bands_mod.sampling_interval_ms(R, T)
        else:  # events still on their way (a sim at --speed; trainers that deliver late)
            now_ms -= to_ms(max(self.source.event_lag_s, cfg.event_lag_s))
        return _Window(
            own_ranks=own_ranks,
            member_start=member_start,
            carry=carry,
            samples=samples,
            own=own,
            job_start=terms.start_ms,
            terms=terms,
            booked_from=booked_from,
            profile=profile,
            n_ranks=n_ranks,
            hold=hold,
            ignore=ignore,
            now_ms=now_ms,
            played=played,
        )

    def _book_window(self, job: AgentJob, w: _Window, tl: Timeline, member_end: np.ndarray) -> WindowResult:
        """The window booked, pure (`live.book_window`)."""
        R, T, P, U, E = w.samples
        return book_window(
            events=[],
            timeline=tl,
            cfg=w.terms.booking,
            profile=w.profile,
            job_start_ms=w.job_start,
            rank=R,
            ts_ms=T,
            power_w=P,
            util_pct=U,
            energy_mj=E,
            n_ranks=w.n_ranks,
            own_ranks=w.own_ranks,
            member_start_ms=w.member_start,
            booked_until_ms=job.booked_until,
            # This agent's own data time: other agents may run ahead of it or behind.
            now_ms=w.now_ms,
            hold_ranks=w.hold,
            ignore_ranks=w.ignore,
            member_end_ms=member_end,
            booked_from_ms=w.booked_from,
            final=w.played,
            carry=w.carry,
            lanes=self.node.lanes([job.own[int(r)] for r in w.own_ranks]),
        )

    def _publish_round(self, job: AgentJob, w: _Window, res: WindowResult) -> dict[str, Any]:
        """The newest band of every own GPU and the job's progress, every round (booked or not);
        returns the progress figures."""
        tl = res.timeline
        R, T, P, U, _E = w.samples
        # A round that books nothing (a hang, a checkpoint, idle: the horizon held at the last
        # step) classifies the window itself.
        latest = (
            {int(w.own_ranks[i]): b for i, b in res.latest_band.items()}
            if res.latest_band
            else livestate.newest_bands(
                w.terms.booking, tl, w.profile, R, T, P, U, w.n_ranks, w.own_ranks, w.carry
            )
        )
        with self.ctx.lock:
            job.latest_band = latest or job.latest_band
        own_rank, own_ts, own_p, own_u = w.own
        self._publish_live(job, own_rank, own_ts, own_p, own_u, w.profile)
        progress = self._progress(job, tl, w.now_ms)
        with self.ctx.lock:
            job.figures = {**job.figures, **progress}
        return progress

    def _hardware_of(self, job: AgentJob) -> list[tuple[int, HardwareEvent]]:
        """The node's hardware events on the job's own GPUs, as (the job's rank, event)."""
        rank_of = {gpu: rank for rank, gpu in job.own.items()}
        return [(rank_of[e.gpu], e) for e in self.ctx.hardware if e.gpu in rank_of]

    def _commit(
        self,
        job: AgentJob,
        w: _Window,
        res: WindowResult,
        member_end: np.ndarray,
        last_ms: int,
        progress: dict[str, Any],
    ) -> None:
        """The round's ledger delta (pure), committed with the watermark; the job's state then."""
        cfg = self.cfg
        tl = res.timeline
        self.folds.fetch_index(job, tl)
        delta = live.ledger_delta(
            job.state,
            res,
            prices=w.terms.schedule or w.terms.prices,
            own_ranks=w.own_ranks,
            member_start_ms=w.member_start,
            member_end_ms=member_end,
            job_start_ms=w.job_start,
            last_progress_ms=last_ms,
            host=self.ctx.host,
            incident_tol_ms=2 * to_ms(w.terms.booking.grid_s) + 2 * to_ms(cfg.sample_interval_s),
            hardware=self._hardware_of(job),
        )
        if delta.unreachable_voids:
            self._unreachable_voids(job.name, delta.unreachable_voids)
        if delta.lost_voids:
            self._lost_voids(job.name, delta.lost_voids)
        if cfg.carbon is not None and delta.by_bucket:
            ug, uncovered = cfg.carbon.micrograms(
                (t * 1000, float(a[JOB_CODES, 1].sum())) for t, a in delta.by_bucket.items()
            )
            delta.state.carbon_ug += ug
            if uncovered:
                self.stats["carbon_uncovered_rounds"] += 1
        ended = bool(
            (tl.end_ms is not None and res.horizon_ms >= tl.end_ms) or (member_end <= res.horizon_ms).all()
        )
        if res.bands is not None:  # the slow rank's evidence, its finished minutes judged
            slow = delta.state.slow
            slow.add(res.bands.busy)
            slow.name(res.bands.busy, res.horizon_ms, w.n_ranks, res.bands.interval_ms, w.profile)
            until = None if ended else res.horizon_ms  # the job's last minute at its end
            slow.close(until, w.n_ranks, res.bands.interval_ms, w.profile, gpus=w.own_ranks.size)
        figures = round_figures(delta, job.preflight, progress, w.profile, cfg.agent_id, tl, res.horizon_ms)
        gpu_name = self.node.gpu_model(sorted(job.own.values()))
        if gpu_name:  # what the job's GPUs are, as this node reads them (MFU's peak)
            figures["gpu_name"] = gpu_name
        self.committer.commit(
            job, delta, figures, w.terms.schedule or w.terms.prices, tl, w.now_ms, w.terms.attribution
        )
        delta.state.rb_index = {}  # written with the watermark: read back only when a void needs it
        with self.ctx.lock:
            job.state = delta.state
            job.figures = figures
            job.at_risk_ms = delta.at_risk_ms
            job.done = ended
            if job.done and job.done_at is None:
                job.done_at = time.monotonic()
            elif not job.done:
                job.done_at = None

    def _unread(self, job: str) -> None:
        """The job's events stream is a key of another type (its trainer, or someone with its
        rights, wrote it so): counted, said, and its GPUs' time booked `unobserved` until it is
        a stream again."""
        self.ctx.refusals.refuse(
            job,
            "events_unreadable",
            "its events key is not a stream: its GPUs' time is booked unobserved until it is one again",
        )
        self.notes.note(
            job,
            "events_unreadable",
            "its events key is not a stream, so its GPUs' time is booked unobserved (delete or fix the key)",
        )

    def _unreachable_voids(self, job: str, n: int) -> None:
        self.stats["unreachable_voids"] += n
        self.ctx.said(
            ("unreachable", job),
            logging.WARNING,
            "job %r: a resume voided steps older than the oldest of the last %d checkpoints: the "
            "rollback index no longer holds them, so their valid time stays booked valid "
            "(raise --rollback-checkpoints to reach further back)",
            job,
            self.cfg.booking.rollback_checkpoints,
        )

    def _lost_voids(self, job: str, n: int) -> None:
        self.stats["unreachable_voids"] += n
        self.ctx.said(
            ("lost-voids", job),
            logging.WARNING,
            "job %r: a resume voided steps booked before Redis restarted empty: their rollback "
            "index went with it, so their valid time stays booked valid (enable appendonly yes)",
            job,
        )

    def _live_figures(self, job: AgentJob, tl: Timeline, w: _Window, last_progress_ms: int) -> None:
        """Cost since the last progress point and GPU time at risk up to the newest sample, not
        only to the booking horizon: the booked part plus the pending part, estimated."""
        st = job.state
        booked = st.since_cost if st.since_ref_ms == last_progress_ms else 0
        upto = max(w.now_ms, st.booked_until)
        if tl.end_ms is not None:  # the time after the run's end is not the job's
            upto = min(upto, tl.end_ms)
        start = np.maximum(np.maximum(w.member_start, st.booked_until), last_progress_ms)
        R, T, P = w.samples[0], w.samples[1], w.samples[2]
        pending = livestate.unbooked_cost(w.terms.prices, start, upto, R, T, P, w.own_ranks)
        at_risk = at_risk_ms(tl, upto, w.member_start) if tl.end_ms is None else job.at_risk_ms
        with self.ctx.lock:
            job.live = {"since_cost": booked + pending, "at_risk_ms": at_risk}

    def _progress(self, job: AgentJob, tl: Timeline, now_ms: int) -> dict[str, Any]:
        """What the alert rules need at the agent's data time: the last progress point (a
        timestamp that never moves back, unlike a step number after a resume), whether the job
        is inside a declared phase or its startup within the allowance, and its budget."""
        last = last_progress_ms(tl)
        in_allowance = tl.regime_at(now_ms) == Regime.OVERHEAD
        budget = job.terms.attribution.get("budget") if job.terms is not None else None
        return {
            "last_progress_ts": last / 1000,
            "in_allowance": int(in_allowance and tl.end_ms is None),
            "budget": budget,
        }

    def _publish_live(
        self, job: AgentJob, rank: np.ndarray, ts: np.ndarray, p: np.ndarray, u: np.ndarray, profile: Profile
    ) -> None:
        """Each GPU's newest band, power and utilization, for the watcher and the cross-rank view.
        The band is always a band: the job's classification of the newest sample, else that
        sample's own (never None: the watcher decides a hang from it)."""
        if rank.size == 0:
            return
        last: dict[int, tuple[int, float, float]] = {}  # rank -> its newest (ms, W, %)
        for r, t, pw, ut in zip(rank.tolist(), ts.tolist(), p.tolist(), u.tolist(), strict=True):
            if r not in last or t >= last[r][0]:
                last[r] = (t, pw, ut)
        k = live_key(self.cfg.prefix, job.name, self.ctx.host)
        gpus = self.source.gpus()

        def band(r: int, pw: float, ut: float) -> str:
            if r in job.latest_band:
                return bandtable.current().names[job.latest_band[r]]
            return bandtable.current().names[
                int(bands_mod.reading_bands(np.asarray([pw]), np.asarray([ut]), profile)[0])
            ]

        mapping = {
            str(r): protocol.encode_live(
                protocol.LiveEntry(
                    t,
                    pw,
                    ut,
                    band(r, pw, ut),
                    job.own.get(r),
                    gpus[job.own[r]].uuid if job.own.get(r, len(gpus)) < len(gpus) else None,
                )
            )
            for r, (t, pw, ut) in last.items()
        }
        pipe = self.ctx.redis.pipeline(transaction=False)
        pipe.hset(k, mapping=mapping)
        pipe.expire(k, self.cfg.live_ttl_s)
        pipe.execute()
