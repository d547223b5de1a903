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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from costexporter.core import bands as bands_mod
from costexporter.core import bandtable, jobfacts, live, livestate, profiles
from costexporter.core.attribution import Attribution, Facts
from costexporter.core.booking import POS_INF, Regime, Timeline, with_unread
from costexporter.core.figures import at_risk_ms
from costexporter.core.live import WindowResult, book_window
from costexporter.core.profiles import Profile
from costexporter.core.terms import JobTerms, ignored_meta_note, job_terms
from costexporter.core.timeutil import to_ms
from costexporter.services.agent_commit import RoundCommit, round_figures
from costexporter.services.agent_config import AgentConfig, samples_maxlen
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
from costexporter.store.keys import epoch_key, live_key, samples_key

__all__ = ["ROUND_BUCKETS", "Agent", "AgentConfig", "samples_maxlen"]

_Job = AgentJob  # the name the benchmarks know

log = logging.getLogger("costexporter.agent")

# Buckets (s) of `costexporter_agent_round_seconds`: a round is ~ms; seconds means trouble.
ROUND_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

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
        self._instance = uuid.uuid4().hex[:12]  # this process: its watermarks say it wrote them
        self._redis_errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self.sampler = Sampler(source, cfg.sample_interval_s, clock=clock)
        self.jobs: dict[str, AgentJob] = {}
        self.policy = cfg.policy()
        self.context_ms = int((cfg.context_s or 2 * self.policy.widest_checkpoint_allowance_s() + 60) * 1000)
        self.samples_maxlen = samples_maxlen(cfg)
        self._epoch: str | None = None
        self._layout = _Layout()
        self._final = False
        self.redis_up = False
        self.stats: collections.Counter[str] = collections.Counter()
        # Trainer-writable values refused (keys of the wrong type, ...), by job and reason.
        self.refusals = untrusted.Refusals(log)
        self.notes = JobNotes(self.redis, cfg.prefix, self._redis_errors)
        self._logged: set[tuple[Any, ...]] = set()
        learn = cfg.learn_idle if cfg.learn_idle is not None else bool(getattr(source, "wall_clock", False))
        self.idle = IdleLearner() if learn else None
        self._gpu_band: dict[int, int] = {}  # GPU index -> band of its newest reading alone
        self._gpu_prof: dict[int, tuple[str, str]] = {}  # GPU index -> (profile, source) in use
        self.live_seq = 0  # rounds that published live state: the exporter's cache key
        self.lock = threading.Lock()
        self._stop = threading.Event()
        # Round CPU time: per bucket of ROUND_BUCKETS (+Inf last), and the sum (s).
        self.round_counts = [0] * (len(ROUND_BUCKETS) + 1)
        self.round_sum = 0.0
        # The agent id's lease (agentid.py): renewed every round, outliving a few slow ones.
        self._id_ttl_s = max(30.0, 10 * cfg.book_interval_s)
        self.id_refused = False  # another host holds this agent id: nothing is booked
        # The round's parts, each with its own state.
        self.samples = LocalSamples(cfg.max_buffered_samples, self.stats)
        self.node = NodeGpus(source, cfg, self.host, self.idle, self.stats)
        self.folds = JobFolds(self.redis, cfg, self.context_ms, self.stats, self._log_once, self._wrong_type)
        self.peers = PeerExchange(
            self.redis,
            cfg.prefix,
            self.host,
            self.stats,
            self.samples_maxlen,
            cfg.peer_timeout_s or max(6 * cfg.book_interval_s, 30.0),
        )
        self.unassigned = UnassignedBooker(
            self.redis, cfg, self.host, self._instance, self._redis_errors, self._wrong_type, self._conflict
        )
        self.discovery = JobDiscovery(
            self.redis,
            cfg.prefix,
            source,
            self.jobs,
            self.folds,
            self._load,
            self.unassigned,
            self.refusals,
            self._log_once,
            self._wrong_type,
            self._redis_errors,
            self.notes,
        )
        self.committer = RoundCommit(
            self.redis, cfg.prefix, cfg.agent_id, self.host, self._instance, self.folds
        )
        self.registrations_rejected = self.discovery.rejected
        # (job, key): meta keys a job set that only the operator sets (ignored; said once per job)
        self.meta_ignored: dict[tuple[str, str], int] = {}
        # What the operator's side read of each job (the Kubernetes path sets it: `k8s.py`).
        self.facts: Mapping[str, Facts] = {}

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

    def _log_once(self, key: tuple[Any, ...], level: int, msg: str, *args: Any) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.log(level, msg, *args)

    # ---- one round -----------------------------------------------------------------------
    def tick(self) -> None:
        t0 = time.thread_time()  # this thread's: the sampler's reads are not the round's
        self._tick()
        self._observe_round(time.thread_time() - t0)

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
                self._discover()
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
            self._discover()
            # The jobs that took a GPU now book their round before the time of no job does: its
            # booker must see where their holds end (a claimant whose run is over holds nothing).
            for name, job in list(self.jobs.items()):
                if set(job.own) - held.get(name, set()):
                    self._book_isolated(job, local)
        try:
            self.unassigned.book(local, self.jobs.values(), self.node.lanes, self._no_more_samples)
        except ledger.WrongType as e:
            self._wrong_type(ledger.UNASSIGNED_JOB, e, e.keys)
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
            self._book(job, local)
        except ledger.Conflict as e:
            self._conflict(job.name, e)
            job.loaded, job.restore = False, True
        except ledger.WrongType as e:
            self._wrong_type(job.name, e, e.keys)
        except self._redis_errors as e:
            if not untrusted.is_wrong_type(e):
                raise
            self._wrong_type(job.name, e)
        except profiles.ProfileError as e:  # no model or limit: held, never another GPU's profile
            self.stats["job_errors"] += 1
            if ("profile", job.name, str(e)) not in self._logged:
                self._logged.add(("profile", job.name, str(e)))
                log.error("job %r: %s; its samples are held, not booked", job.name, e)
        except Exception as e:
            self.stats["job_errors"] += 1
            job.loaded = False
            if ("error", job.name, type(e).__name__) not in self._logged:
                self._logged.add(("error", job.name, type(e).__name__))
                log.exception("job %r: booking failed; skipped this round, the other jobs book on", job.name)

    def _conflict(self, job: str, e: ledger.Conflict) -> None:
        """Another process with this agent id wrote the job's watermark (a commit of this
        process whose reply was lost is told apart in `ledger.commit`, and is no conflict). The
        round is dropped and the ledger re-read, so nothing is booked twice; the log names the
        writer when its watermark says."""
        self.stats["conflicts"] += 1
        writer = ledger.conflict_writer(e.stored)
        who = (
            f"process {writer.get('instance') or '?'} on host {writer.get('host')!r} wrote it"
            if writer is not None
            else "it is gone or unreadable"
        )
        self._log_once(
            ("conflict", job),
            logging.WARNING,
            "job %r: its watermark changed under agent %r (%s): another process runs with the same "
            "agent id. The round is dropped and the ledger re-read, so nothing is booked twice; run "
            "one agent per --agent-id",
            job,
            self.cfg.agent_id,
            who,
        )

    def _wrong_type(self, name: str, e: BaseException, wrong: dict[str, str] | None = None) -> None:
        """A job's round met a key of the wrong type. Keys only the agents write are moved aside
        (someone else created them: they never held the ledger) and written afresh next round;
        a trainer's own key of the wrong type is refused, counted and logged, every round until
        it is fixed. The other jobs go on either way."""
        job = self.jobs.get(name)
        if wrong is None:
            expected = ledger.agent_keys(self.cfg.prefix, name, self.cfg.agent_id, self.host)
            for h in job.peers.hosts if job is not None else ():
                expected[samples_key(self.cfg.prefix, name, h)] = "stream"
            wrong = ledger.wrong_types(self.redis, expected)
        moved = ledger.set_aside(self.redis, wrong, self.cfg.prefix, name) if wrong else []
        if moved:
            self.refusals.refuse(
                name,
                "wrong_type",
                "%d key(s) only the agents write held another type (created by someone else): moved "
                "aside to <key>:wrongtype, booked afresh next round: %s",
                len(moved),
                ", ".join(untrusted.short(k) for k in moved[:3]),
            )
        else:
            self.refusals.refuse(
                name, "wrong_type", "a key of the job has the wrong type: not booked (%s)", e
            )
        if job is not None:
            job.loaded = False

    # ---- the parts, as the tests and subclasses reach them ------------------------------------
    def _discover(self) -> None:
        self.discovery.discover()

    def _load(self, job: AgentJob) -> None:
        self.folds.load(job)

    def _timeline(self, job: AgentJob, terms: JobTerms, now_ms: int, final: bool = False) -> Timeline:
        return self.folds.timeline(job, terms, now_ms, final)

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
            host=self.host,
        )
        name = untrusted.short(job.name, 200)
        new = [k for k in terms.ignored_meta if (name, k) not in self.meta_ignored]
        if new:
            for k in new:
                self.meta_ignored[(name, k)] = 1
            self._log_once(
                ("meta_ignored", job.name, *new), logging.WARNING, "%s", ignored_meta_note(job.name, new)
            )
        job.terms = terms
        return terms

    def _fetch_index(self, job: AgentJob, tl: Timeline) -> None:
        self.folds.fetch_index(job, tl)

    def _remote_samples(self, job: AgentJob, keep_from: int) -> None:
        self.peers.read(job, keep_from)

    def _local_arrays(self) -> Local:
        return self.samples.arrays()

    @property
    def _newest(self) -> dict[int, int]:
        return self.samples.newest

    def _gpu_profile(self, g: int) -> Profile:
        return self.node.profile(g)

    def _gpu_profile_source(self, g: int) -> tuple[Profile, str]:
        return self.node.profile_source(g)

    def _idle_level(self, gpus: list[int]) -> float | None:
        return self.node.idle_level(gpus)

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
        final = self._no_more_samples
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
                    self.refusals.refuse(
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
    def _book(self, job: AgentJob, local: Local) -> None:
        """Read, book the window (pure), commit the delta with the watermark compare-and-set."""
        if not job.loaded:
            self._load(job)
        unread = False
        try:
            self.folds.read_events(job, self.source.wall_clock)
        except self._redis_errors as e:
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
            tl = with_unread(self._timeline(job, w.terms, w.now_ms, final=w.played), spans)
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
        self._remote_samples(job, keep_from)
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
        with self.lock:
            job.latest_band = latest or job.latest_band
        own_rank, own_ts, own_p, own_u = w.own
        self._publish_live(job, own_rank, own_ts, own_p, own_u, w.profile)
        progress = self._progress(job, tl, w.now_ms)
        with self.lock:
            job.figures = {**job.figures, **progress}
        return progress

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
        self._fetch_index(job, tl)
        delta = live.ledger_delta(
            job.state,
            res,
            prices=w.terms.schedule or w.terms.prices,
            own_ranks=w.own_ranks,
            member_start_ms=w.member_start,
            member_end_ms=member_end,
            job_start_ms=w.job_start,
            last_progress_ms=last_ms,
            host=self.host,
            incident_tol_ms=2 * to_ms(w.terms.booking.grid_s) + 2 * to_ms(cfg.sample_interval_s),
        )
        if delta.unreachable_voids:
            self._unreachable_voids(job.name, delta.unreachable_voids)
        if delta.lost_voids:
            self._lost_voids(job.name, delta.lost_voids)
        figures = round_figures(delta, job.preflight, progress, w.profile, cfg.agent_id, tl, res.horizon_ms)
        self.committer.commit(
            job, delta, figures, w.terms.schedule or w.terms.prices, tl, w.now_ms, w.terms.attribution
        )
        delta.state.rb_index = {}  # written with the watermark: read back only when a void needs it
        with self.lock:
            job.state = delta.state
            job.figures = figures
            job.at_risk_ms = delta.at_risk_ms
            job.done = bool(
                (tl.end_ms is not None and res.horizon_ms >= tl.end_ms)
                or (member_end <= res.horizon_ms).all()
            )
            if job.done and job.done_at is None:
                job.done_at = time.monotonic()
            elif not job.done:
                job.done_at = None

    def _unread(self, job: str) -> None:
        """The job's events stream is a key of another type (its trainer, or someone with its
        rights, wrote it so): counted, said, and its GPUs' time booked `unobserved` until it is
        a stream again."""
        self.refusals.refuse(
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
        self._log_once(
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
        self._log_once(
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
        with self.lock:
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
        k = live_key(self.cfg.prefix, job.name, self.host)
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
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(k, mapping=mapping)
        pipe.expire(k, self.cfg.live_ttl_s)
        pipe.execute()

    # ---- for the exporter --------------------------------------------------------------------
    @staticmethod
    def _state_bytes(job: AgentJob) -> int:
        """About what the agent holds for a job's booking: its folded timeline, the events
        waiting to be folded and the rollback index entries in memory."""
        n = job.fold.state_bytes() if job.fold is not None else 0
        return n + 700 * len(job.fresh) + 400 * len(job.state.rb_index) + 16 * len(job.state.rb_applied)

    def snapshot(self) -> AgentSnapshot:
        now = time.monotonic()
        with self.lock:
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
                stats=dict(self.stats),
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
                        state_bytes=self._state_bytes(j),
                    )
                    for name, j in self.jobs.items()
                    if j.own and (j.done_at is None or now - j.done_at < self.cfg.series_ttl_s)
                },
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
