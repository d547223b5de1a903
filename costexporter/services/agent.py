"""The per-node agent behind `costexporter serve`: sample, book exactly once, expose metrics.

Each round (`book_interval_s`) the agent
  1. drains its sampler (the node's GPUs, read on a background thread);
  2. checks Redis's epoch marker (an empty restart is noticed, not booked as new history) and
     finds the jobs its GPUs belong to (`<p>:jobs`, each job's validated `:ranks` entries);
  3. shares its samples with the job's other agents (`:samples:<host>` streams) and reads
     theirs, so cross-rank signatures see every rank;
  4. per job, books the decided part of its own GPUs' time (`live.book_window`), turns it into
     a ledger delta (`live.ledger_delta`, pure) and commits the delta with its watermark in one
     compare-and-set (`ledger.commit`): a second agent with the same id loses, re-reads and
     books nothing twice. A job that fails is skipped; the others book.
  5. books the time of GPUs no job holds into `_unassigned`, held back `unassigned_hold_s` so
     a register that arrives late still gets its GPU's time.
While Redis is unreachable nothing is booked: samples wait (bounded, counted) and are booked
when it is back; the events the trainers buffered meanwhile arrive too, so an outage never
looks like a stall. A transaction whose reply was lost is resolved by re-reading the watermark.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable

from costexporter.core import profiles
from costexporter.core.attribution import Attribution
from costexporter.core.causes import HardwareEvent
from costexporter.services.agent_book import BookingParts, JobBooker, Local
from costexporter.services.agent_commit import RoundCommit
from costexporter.services.agent_config import AgentConfig, samples_maxlen
from costexporter.services.agent_context import HARDWARE_KEEP_MS, AgentContext, KeyGuard
from costexporter.services.agent_discovery import JobDiscovery
from costexporter.services.agent_fold import JobFolds
from costexporter.services.agent_job import AgentJob
from costexporter.services.agent_node import LocalSamples, NodeGpus
from costexporter.services.agent_notes import JobNotes
from costexporter.services.agent_peers import PeerExchange
from costexporter.services.agent_unassigned import UnassignedBooker
from costexporter.services.snapshots import AgentSnapshot, JobView
from costexporter.sources.base import GpuSource
from costexporter.sources.sampler import ClockWatch, Sampler
from costexporter.store import agentid, keyspace, ledger, migrate, protocol, untrusted
from costexporter.store.client import RedisClient
from costexporter.store.keys import epoch_key

__all__ = ["ROUND_BUCKETS", "Agent", "AgentConfig", "samples_maxlen"]

_Job = AgentJob  # the name the benchmarks know

log = logging.getLogger("costexporter.agent")

# Buckets (s) of `costexporter_agent_round_seconds`: a round is ~ms; seconds means trouble.
ROUND_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Agent:
    """The orchestrator of a round: it drains the samples, finds the jobs (`JobDiscovery`),
    exchanges samples with the jobs' other agents (`PeerExchange`), reads and folds each job's
    events (`JobFolds`), books each job's window (`core/live.py`, pure) and commits it
    (`RoundCommit`), and books the time of no job (`UnassignedBooker`)."""

    def __init__(self, source: GpuSource, cfg: AgentConfig, clock: ClockWatch | None = None) -> None:
        """`clock`: the wall and monotonic clocks a live source's samples are checked with (tests
        inject one)."""
        import redis

        from costexporter.core.idle import IdleLearner

        self.source = source
        self.cfg = cfg
        self.host = cfg.host or source.host
        self.redis = protocol.connect(cfg.redis_url)
        self._redis_errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        # Trainer-writable values refused (keys of the wrong type, ...), by job and reason.
        self.refusals = untrusted.Refusals(log)
        # What every part shares; this process's instance id: its watermarks say it wrote them.
        self.ctx = AgentContext(
            self.redis, cfg, self.host, uuid.uuid4().hex[:12], self._redis_errors, self.refusals
        )
        self.sampler = Sampler(source, cfg.sample_interval_s, clock=clock)
        self.policy = cfg.policy()
        self.context_ms = int((cfg.context_s or 2 * self.policy.widest_checkpoint_allowance_s() + 60) * 1000)
        self.samples_maxlen = samples_maxlen(cfg)
        self._epoch: str | None = None
        self._layout = _Layout()
        self._final = False
        self.redis_up = False
        self.stats: collections.Counter[str] = collections.Counter()  # the round's own counts
        # (GPU index, kind, code) -> the hardware events read (Xids, clock slowdowns)
        self.hardware_counts: collections.Counter[tuple[int, str, int]] = collections.Counter()
        self.notes = JobNotes(self.ctx)
        learn = cfg.learn_idle if cfg.learn_idle is not None else bool(getattr(source, "wall_clock", False))
        self.idle = IdleLearner() if learn else None
        self._gpu_band: dict[int, int] = {}  # GPU index -> band of its newest reading alone
        self._gpu_prof: dict[int, tuple[str, str]] = {}  # GPU index -> (profile, source) in use
        self.live_seq = 0  # rounds that published live state: the exporter's cache key
        self.lock = self.ctx.lock
        self._stop = threading.Event()
        # Round CPU time: per bucket of ROUND_BUCKETS (+Inf last), and the sum (s).
        self.round_counts = [0] * (len(ROUND_BUCKETS) + 1)
        self.round_sum = 0.0
        # The agent id's lease (agentid.py): renewed every round, outliving a few slow ones.
        self._id_ttl_s = max(30.0, 10 * cfg.book_interval_s)
        self.id_refused = False  # another host holds this agent id: nothing is booked
        # The round's parts, each with its own state and its own stats.
        self.guard = KeyGuard(self.ctx)
        self.samples = LocalSamples(cfg.max_buffered_samples)
        self.node = NodeGpus(source, cfg, self.host, self.idle)
        self.folds = JobFolds(self.ctx, self.context_ms, self.guard)
        grace_s = cfg.peer_timeout_s or max(6 * cfg.book_interval_s, 30.0)
        self.peers = PeerExchange(self.ctx, self.samples_maxlen, grace_s)
        self.unassigned = UnassignedBooker(self.ctx, self.guard)
        self.discovery = JobDiscovery(self.ctx, source, self.folds, self.unassigned, self.notes)
        self.committer = RoundCommit(self.ctx, self.folds)
        parts = BookingParts(self.samples, self.node, self.peers, self.folds, self.committer, self.notes)
        self.booker = JobBooker(
            self.ctx, source, parts, self.policy, self.context_ms, lambda: self._no_more_samples
        )
        self.registrations_rejected = self.discovery.rejected
        # (job, key): meta keys a job set that only the operator sets (ignored; said once per job)
        self.meta_ignored = self.booker.meta_ignored

    @property
    def unassigned_settled(self) -> bool:
        """Whether the unassigned ledger is booked to the end of the newest sample (at shutdown,
        or after a replay's last one): a bill read before then would miss its last stretch."""
        return self.unassigned.settled

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> Agent:
        """Claim the agent id (AgentIdInUse when another host holds it), then sample."""
        try:
            holder = agentid.claim(self.redis, self.cfg.prefix, self.cfg.agent_id, self.host, self._id_ttl_s)
        except self._redis_errors as e:
            log.info("cannot check agent id %r now (%s): it is checked every round", self.cfg.agent_id, e)
            holder = None
        if holder is not None:
            raise agentid.AgentIdInUse(self.cfg.agent_id, self.host, holder)
        self.sampler.start()
        self.warn_if_not_persistent()
        return self

    def run(self, until: Callable[[], bool] | None = None) -> None:
        """Round after round until stop() (or `until()` says so)."""
        while not self._stop.is_set():
            self.tick()
            if until is not None and until():
                break
            self._stop.wait(self.cfg.book_interval_s)

    def stop(self) -> None:
        """Book and write what can be booked, then stop (SIGTERM)."""
        self._stop.set()

    @property
    def stopping(self) -> threading.Event:
        """Set by stop(): a thread run beside the agent (k8s registrations) waits on it to end with it."""
        return self._stop

    def shutdown(self) -> None:
        self.sampler.stop()
        self._final = True  # no later sample will come: the unassigned time is booked to the end
        self.tick()
        if not self.id_refused:
            with contextlib.suppress(*self._redis_errors):  # else the lease runs out by itself
                agentid.release(self.redis, self.cfg.prefix, self.cfg.agent_id, self.host)
        self.source.close()

    def warn_if_not_persistent(self) -> None:
        """The ledger is the finance record: say so when Redis keeps nothing on disk."""
        try:
            aof = self.redis.config_get("appendonly").get("appendonly")
            save = self.redis.config_get("save").get("save")
        except self._redis_errors as e:
            log.info("cannot check Redis persistence: %s", e)
            return
        if aof != "yes" and not save:
            self.stats["redis_not_persistent"] = 1
            log.warning(
                "Redis keeps nothing on disk (no AOF, no RDB): the ledger is lost on restart; "
                "enable appendonly yes"
            )

    @property
    def _no_more_samples(self) -> bool:
        """At shutdown, and after a replay's last sample: no later sample will come."""
        return self._final or getattr(self.source, "done", False)

    # ---- one round -----------------------------------------------------------------------
    def tick(self) -> None:
        t0 = time.thread_time()  # this thread's: the sampler's reads are not the round's
        self._tick()
        self._observe_round(time.thread_time() - t0)

    def _take_hardware(self, events: list[HardwareEvent]) -> None:
        """The sampler's hardware events into the context's, those older than HARDWARE_KEEP_MS
        dropped; each counted by kind and code (`costexporter_gpu_hardware_events_total`)."""
        hw = self.ctx.hardware
        hw.extend(events)
        if events:
            with self.lock:  # a scrape's snapshot copies the counts on its own thread
                for e in events:
                    self.hardware_counts[(e.gpu, e.kind, e.code)] += 1
        if hw:
            floor = hw[-1].ts_ms - HARDWARE_KEEP_MS
            while hw and hw[0].ts_ms < floor:
                hw.popleft()

    def _observe_round(self, seconds: float) -> None:
        """Into the round histogram: the CPU a round took, which must not grow with history."""
        i = next((k for k, b in enumerate(ROUND_BUCKETS) if seconds <= b), len(ROUND_BUCKETS))
        with self.lock:
            self.round_counts[i] += 1
            self.round_sum += seconds

    def _tick(self) -> None:
        chunk = self.samples.add(self.sampler.drain())
        if chunk is not None:
            self.node.learn(chunk)
        self._take_hardware(self.sampler.drain_hardware())
        local = self.samples.arrays()
        self._band_readings()
        try:
            self._layout.check(
                self.redis, self.cfg.prefix, self.cfg.agent_id
            )  # before the epoch: it may move it
            self._check_epoch()
            # Also after an outage: the jobs are read again as after a start.
            stale = (
                not self.redis_up or time.monotonic() - self.discovery.last_refresh > self.cfg.job_refresh_s
            )
            if self.discovery.changed() or stale:
                self.discover()
            if not self.redis_up:
                self.peers.redis_back_at = time.monotonic()
            self.node.sync_idle(self.redis)
            if self._hold_id():
                self._book_all(local)
            self.node.publish(self.redis, self.sampler.latest(), self.cfg.live_ttl_s)
            self.redis_up = True
        except migrate.LayoutPending:
            self.stats["layout_waits"] += 1  # samples are held; nothing is booked from legacy keys
        except self._redis_errors as e:
            if self.redis_up or not self.stats["redis_errors"]:
                log.warning("Redis unreachable (%s): holding samples until it is back", e)
            self.redis_up = False
            self.stats["redis_errors"] += 1
            self._forget_watermarks()
        except Exception:  # a bug or an input nobody foresaw: log it, count it, keep the daemon up
            log.exception("booking round failed; nothing of it was written")
            self.stats["round_errors"] += 1
            self._forget_watermarks()
        with self.lock:
            self.live_seq += 1  # the live state changed every round, booked or not
        self._trim(local)

    def _book_all(self, local: Local) -> None:
        """Each job of this node's GPUs, then the time of no job."""
        for job in list(self.jobs.values()):
            if job.own:
                self._book_isolated(job, local)
        if self.discovery.deferred_due():  # a run a claim waits for ended: it takes the GPU there
            held = {name: set(job.own) for name, job in self.jobs.items()}
            self.discover()
            # The jobs that took a GPU now book their round before the time of no job does: its
            # booker must see where their holds end (a claimant whose run is over holds nothing).
            for name, job in list(self.jobs.items()):
                if set(job.own) - held.get(name, set()):
                    self._book_isolated(job, local)
        try:
            self.unassigned.book(local, self.jobs.values(), self.node.lanes, self._no_more_samples)
        except ledger.WrongType as e:
            self.guard.wrong_type(ledger.UNASSIGNED_JOB, e, e.keys)
            self.unassigned.loaded = False

    def _hold_id(self) -> bool:
        """Renew this agent id's lease; False (nothing booked this round, counted, said once per
        spell) while another host holds it. When it is this host's again, the watermarks are
        read again: the other host may have written them meanwhile."""
        holder = agentid.claim(self.redis, self.cfg.prefix, self.cfg.agent_id, self.host, self._id_ttl_s)
        if holder is None:
            if self.id_refused:
                log.warning("agent id %r is this host's again: booking resumes", self.cfg.agent_id)
                self.id_refused = False
                self._forget_watermarks()
            return True
        self.stats["agent_id_refused"] += 1
        if not self.id_refused:
            log.error(
                "%s. This agent books nothing while that host holds the id (counted in "
                "costexporter_agent_id_refused_rounds_total)",
                agentid.AgentIdInUse(self.cfg.agent_id, self.host, holder),
            )
        self.id_refused = True
        return False

    def _forget_watermarks(self) -> None:
        """The last write may or may not have landed: re-read the watermarks before booking."""
        self.unassigned.loaded = False
        for job in self.jobs.values():
            job.loaded = False

    def _check_epoch(self) -> None:
        """Redis restarted empty (or was flushed): its epoch marker is gone. Say so loudly and go
        on from this agent's own watermarks instead of re-reading empty ones, which would book
        every job's history again from its registration."""
        if self._epoch is None:
            self._epoch = ledger.ensure_epoch(self.redis, self.cfg.prefix, uuid.uuid4().hex)
            return
        if self.redis.get(epoch_key(self.cfg.prefix)) == self._epoch:
            return
        self.stats["epoch_resets"] += 1
        log.error(
            "Redis restarted empty: its epoch marker %s is gone, and with it the ledger written "
            "before now (enable appendonly yes). Booking goes on from this agent's watermarks; "
            "history is not booked again",
            self._epoch,
        )
        self._epoch = ledger.ensure_epoch(self.redis, self.cfg.prefix, uuid.uuid4().hex)
        for job in self.jobs.values():
            if job.ever_loaded:
                job.loaded, job.wm_raw = True, None
            # The rollback index of what was booked so far went too: a later resume reaching
            # back there is counted, not computed from entries that read as nothing.
            job.state.rb_lost_until = max(job.state.rb_lost_until, job.state.booked_until)
        self.unassigned.epoch_reset()

    def _book_isolated(self, job: AgentJob, local: Local) -> None:
        """One job's round; its failure (bad stored data, a bug) skips it, not the others."""
        try:
            self.booker.book(job, local)
        except ledger.Conflict as e:
            self.guard.conflict(job.name, e)
            job.loaded, job.restore = False, True
        except ledger.WrongType as e:
            self.guard.wrong_type(job.name, e, e.keys, job=job)
        except self._redis_errors as e:
            if not untrusted.is_wrong_type(e):
                raise
            self.guard.wrong_type(job.name, e, job=job)
        except profiles.ProfileError as e:  # no model or limit: held, never another GPU's profile
            self.stats["job_errors"] += 1
            if self.ctx.said.first(("profile", job.name, str(e))):
                log.error("job %r: %s; its samples are held, not booked", job.name, e)
        except Exception as e:
            self.stats["job_errors"] += 1
            job.loaded = False
            if self.ctx.said.first(("error", job.name, type(e).__name__)):
                log.exception("job %r: booking failed; skipped this round, the other jobs book on", job.name)

    # ---- the jobs ---------------------------------------------------------------------------
    @property
    def jobs(self) -> dict[str, AgentJob]:
        """The jobs of this node's GPUs, as discovery found them."""
        return self.discovery.jobs

    def discover(self) -> None:
        """Read the trainers' registrations now (`JobDiscovery`); a job whose keys held the wrong
        type is set aside here (`KeyGuard`), its claims looked at again next round."""
        found = self.discovery.discover()
        for name, e in found.wrong_type.items():
            self.guard.wrong_type(name, e, job=self.jobs.get(name))

    # ---- live state every round (booked or not) ---------------------------------------------
    def _band_readings(self) -> None:
        """Each GPU's band from its newest reading alone (/metrics always has one)."""
        out, in_use = self.node.reading_bands(self.sampler.latest())
        with self.lock:
            self._gpu_band = out
            self._gpu_prof = in_use

    def _trim(self, local: Local) -> None:
        """Keep the local samples some job (or the unassigned ledger) still needs."""
        ts = local[1]
        if ts.size == 0:
            return
        keep_from = min(
            (j.window_from(self.context_ms) for j in self.jobs.values() if j.own and not j.done),
            default=int(ts.max()) - self.context_ms,
        )
        if self.unassigned.until is not None:  # GPUs of no job: kept until that ledger has them
            keep_from = min(keep_from, self.unassigned.until - 60_000)
        self.samples.trim(local, keep_from)

    # ---- for the exporter --------------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        """Every part's stats and the round's own, summed: what /metrics shows."""
        total = collections.Counter(self.stats)
        for part in (self.samples, self.node, self.folds, self.peers, self.guard, self.booker):
            total.update(part.stats)
        return dict(total)

    def snapshot(self, with_jobs: bool = True) -> AgentSnapshot:
        """The agent between rounds; `with_jobs` False: without each job's view (a scrape's
        per-GPU families need only who holds each GPU; the job families are built once a round)."""
        now = time.monotonic()
        with self.lock:
            shown = [
                (name, j)
                for name, j in self.jobs.items()
                if j.own and (j.done_at is None or now - j.done_at < self.cfg.series_ttl_s)
            ]
            stats = self.counts()
            return AgentSnapshot(
                pending=self.samples.pending(),
                host=self.host,
                agent=self.cfg.agent_id,
                currency=self.cfg.prices.currency,
                redis_up=self.redis_up,
                id_refused=self.id_refused,
                gpus=self.source.gpus(),
                latest=self.sampler.latest(),
                gpu_bands=dict(self._gpu_band),
                gpu_profiles=dict(self._gpu_prof),
                live_seq=self.live_seq,
                errors=dict(self.source.errors),
                hardware=dict(self.hardware_counts),
                stats=stats,
                dropped=self.sampler.dropped,
                clock_steps=dict(self.sampler.clock.steps) if self.sampler.clock else {},
                clock_offset_s=self.sampler.clock.offset_s if self.sampler.clock else 0.0,
                registrations_rejected=dict(self.registrations_rejected),
                meta_ignored=dict(self.meta_ignored),
                data_rejected=dict(self.refusals.counts),
                round_counts=list(self.round_counts),
                round_sum=self.round_sum,
                jobs={
                    name: JobView(
                        own=dict(j.own),
                        booked=j.state.booked.copy(),
                        carbon_kg=None if self.cfg.carbon is None else j.state.carbon_ug / 1e9,
                        slow_gpu_s=dict(j.state.slow.gpu_s),
                        slow_now=j.state.slow.now,
                        voided=j.state.voided.copy(),
                        figures=dict(j.figures),
                        # its data keys, its owner and place the operator's (`attribution`)
                        meta=(j.terms.attribution if j.terms else Attribution()).overlay(j.meta),
                        latest_band=dict(j.latest_band),
                        booked_until=j.booked_until,
                        at_risk_ms=j.live.get("at_risk_ms", j.at_risk_ms),
                        since_cost=j.live.get("since_cost", j.state.since_cost),
                        done=j.done,
                        rejected={
                            k.split(":", 1)[1]: n
                            for k, n in j.reader.stats.items()
                            if k.startswith("rejected:")
                        },
                        clock_skew_s=j.skew_s,
                        state_bytes=j.state_bytes(),
                        ranks=len(j.ranks),
                    )
                    for name, j in (shown if with_jobs else ())
                },
                held={g: (name, r, j.latest_band.get(r)) for name, j in shown for r, g in j.own.items()},
                jobs_key=(self.live_seq, stats.get("rounds", 0), tuple(sorted(name for name, _ in shown))),
            )


class _Layout:
    """The keyspace as this agent found it: brought to this release's version before the first
    round books anything (`keyspace.ensure`: the legacy keys moved, the ordered migrations run),
    retried every RETRY_S while agents of an older version still run or the keyspace is newer
    than this release; afterwards, every FORWARD_S, what trainers of the legacy layout still
    write is forwarded (`migrate.forward`)."""

    RETRY_S = 5.0
    FORWARD_S = 5.0

    def __init__(self) -> None:
        self.ready = False
        self.forwarding = True
        self.next_at = 0.0

    def check(self, client: RedisClient, prefix: str, by: str = "") -> None:
        """Raises LayoutPending while the agent must not book; a Redis error as any round's."""
        now = time.monotonic()
        if not self.ready:
            if now < self.next_at:  # old agents ran at the last look
                raise migrate.LayoutPending
            if not keyspace.ensure(client, prefix, by):
                self.next_at = now + self.RETRY_S
                raise migrate.LayoutPending
            self.ready = True
            self.next_at = now + self.FORWARD_S
        elif now >= self.next_at:
            self.next_at = now + self.FORWARD_S
            if self.forwarding:
                self.forwarding = migrate.forward_quietly(client, prefix)
