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

import base64
import collections
import contextlib
import dataclasses
import json
import logging
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from costexporter.core import bands as bands_mod
from costexporter.core import buckets, jobfacts, live, livestate, profiles, samplewin, shares
from costexporter.core.booking import (
    POS_INF,
    BookingConfig,
    Pieces,
    Regime,
    Timeline,
    _cut_per_gpu,
    build_timeline,
    dated_until,
    make_slices,
)
from costexporter.core.cost import Prices
from costexporter.core.figures import at_risk_field, at_risk_ms, encode_at_risk
from costexporter.core.fold import (
    FoldFormatError,
    TimelineFold,
    dump_fold,
    load_fold,
    walk_relevant,
)
from costexporter.core.idle import IdleLearner
from costexporter.core.live import JobState, book_window
from costexporter.core.model import BANDS, Category, Event, GpuIndex
from costexporter.core.profiles import Profile
from costexporter.core.samplewin import SampleWindow
from costexporter.core.terms import JobTerms, Policy, PolicyRule, ignored_meta_note, job_terms
from costexporter.sources.base import GpuSource
from costexporter.sources.sampler import ClockWatch, Sampler
from costexporter.store import agentid, ledger, migrate, protocol, untrusted
from costexporter.store.keys import (
    epoch_key,
    fold_key,
    gpu_idle_key,
    jobs_key,
    live_key,
    node_key,
    ranks_key,
    rbidx_key,
    readers_key,
    registrations_key,
    samples_key,
    watermark_key,
)
from costexporter.store.reader import EventReader

log = logging.getLogger("costexporter.agent")

# Buckets (s) of `costexporter_agent_round_seconds`: a round is ~ms; seconds means trouble.
ROUND_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class AgentConfig:
    redis_url: str = protocol.DEFAULT_REDIS_URL
    prefix: str = protocol.DEFAULT_PREFIX
    agent_id: str = field(default_factory=socket.gethostname)
    host: str | None = None  # defaults to the source's host
    booking: BookingConfig = field(default_factory=BookingConfig)
    prices: Prices = field(default_factory=Prices)
    book_interval_s: float = 5.0
    sample_interval_s: float = 1.0
    context_s: float | None = None  # history kept for bands: default 2 x checkpoint allowance
    # Discovery runs when the trainers' registrations counter moves (one GET a round) and, as a
    # safety net for writers that do not move it, every `job_refresh_s`: keep it below
    # `unassigned_hold_s` so such a job's GPU time still reaches it.
    job_refresh_s: float = 300.0
    live_ttl_s: int = 30
    max_buffered_samples: int = 2_000_000
    series_ttl_s: float = 3600.0  # an ended job's series disappear from /metrics this long after
    # How long another agent of a job may stay silent before its ranks stop holding the booking
    # horizon back (default: max(6 rounds, 30 s)). Too short books moments without its samples,
    # and booked time is never re-booked; too long only delays booking.
    peer_timeout_s: float | None = None
    profile: Profile | None = None
    profile_dir: Path | None = None  # fitted profiles, matched by GPU model (profiles.find)
    gpu_model: str | None = None
    power_limit_w: float | None = None
    # Time of GPUs no job holds is booked `unassigned` only this long after it was sampled: a
    # register that arrives later than this (a trainer cut off from Redis at its start) gets
    # its GPU's time from then on; the time before stays `unassigned` (booked once either way).
    unassigned_hold_s: float = 600.0
    clock_skew_warn_s: float = 10.0  # event timestamps this far off their arrival: a warning
    # Book no closer to the newest sample than this: events that arrive up to this late are
    # booked as if on time (a startup or phase allowance is decided at once otherwise).
    event_lag_s: float = 0.0
    # Learn each GPU's idle power from its readings at 0% (idle.py) and derive a derived
    # profile's low edges from it; None: for sources that read GPUs now (NVML, dcgm-exporter),
    # not for a replayed trace (its bill must equal the offline replay's).
    learn_idle: bool | None = None
    # Events are folded into a job's timeline for good this far behind the newest data time; one
    # that arrives later than that (older than the fold) makes the agent rebuild the job's
    # timeline from its stream once (counted in `timeline_rebuilds`).
    fold_lag_s: float = 120.0
    # The fold is stored with the watermark (same MULTI) at most this often, so a restarted agent
    # resumes from it and reads only the stream since (a restart's catch-up is linear in that
    # backlog); 0: every commit, None: never (a restart folds the whole stream again).
    fold_persist_s: float | None = 60.0
    # Trim each job's event stream below the oldest position of its readers (agents' stored
    # folds, watchers) after a committed round; a reader silent this long no longer pins it.
    trim_streams: bool = True
    reader_stale_s: float = 86400.0
    # Events up to this late (behind the newest) are still folded in exactly after trimming: a
    # second stored fold is kept 1-2 x this far behind, and the stream from its position on.
    # Keep it under half of `reader_stale_s`.
    late_keep_s: float = 3600.0
    # The operator's policy file's rules (`terms.parse_policy`): thresholds by job name or team.
    policy_rules: tuple[PolicyRule, ...] = ()

    def policy(self) -> Policy:
        """The operator's terms: the flags' thresholds and prices, the policy file's rules."""
        return Policy(self.booking, self.prices, self.policy_rules)


def samples_maxlen(cfg: AgentConfig) -> int:
    """Entries a host's sample stream keeps (one per round): the booking context, what an agent
    that starts on a running job reads to learn a signature run already under way (31 minutes
    by default)."""
    context_s = cfg.context_s or 2 * cfg.policy().widest_checkpoint_allowance_s() + 60
    return max(64, int(context_s / max(cfg.book_interval_s, 0.01)) + 8)


@dataclass
class _Job:
    name: str
    reader: EventReader
    # The job's timeline, folded event by event (bounded); the walk-relevant events read since
    # the last round wait in `fresh` until the round knows the job's start.
    fold: TimelineFold | None = None
    fresh: list[Event] = field(default_factory=list)
    newest_event_ms: int = 0  # the newest event time read (the fold stays behind it)
    meta: dict = field(default_factory=dict)  # the job's meta events folded, last write wins
    terms: JobTerms | None = None  # the terms of its last round (`terms.job_terms`)
    preflight: str = ""  # JSON of the latest pre-run gate result
    ranks: dict[int, protocol.Registration] = field(default_factory=dict)
    own: dict[int, int] = field(default_factory=dict)  # rank -> source GPU index
    floors: dict[int, int] = field(default_factory=dict)  # rank -> GPU time already booked elsewhere
    ends: dict[int, int] = field(default_factory=dict)  # rank -> a later job's claim of its GPU
    state: JobState = field(default_factory=JobState)
    wm_raw: str | None = None  # the watermark as this agent last read or wrote it (the CAS)
    fold_saved_at: float | None = None  # data time (s) of the last stored fold
    fold_old_at: float | None = None  # data time (s) of the stored older fold (`fold:old:`)
    # The job's start its restored fold was walked with: the ranks hash keeps only each rank's
    # newest registration, so a restarted agent would otherwise see a later start.
    fold_start: int | None = None
    # Stored folds that may become the older one: (data time, blob, stream position)
    fold_candidates: list = field(default_factory=list)
    loaded: bool = False
    ever_loaded: bool = False
    # Another agent with this agent's id committed the job (a compare-and-set conflict): its
    # stored fold and stream position go with the watermark reloaded, not this agent's fold
    # (that agent may have trimmed the stream past what this one read).
    restore: bool = False
    remote: SampleWindow = field(default_factory=SampleWindow)  # other hosts' samples, sorted
    remote_ids: dict[str, str] = field(default_factory=dict)
    remote_seen: dict[str, float] = field(default_factory=dict)  # host -> monotonic time of its last entry
    peer_hosts: dict[str, list[int]] = field(default_factory=dict)  # other ranks by host (discovery)
    published_ts: dict[int, int] = field(default_factory=dict)  # rank -> newest ts published
    figures: dict = field(default_factory=lambda: {"steps_completed": 0, "steps_voided": 0})
    latest_band: dict[int, int] = field(default_factory=dict)  # rank -> band
    at_risk_ms: int = 0
    live: dict = field(default_factory=dict)  # this round's live figures (livestate.py)
    end_ms: int | None = None  # the run's end while it is ended (a later run start reopens it)
    end_at: int | None = None  # ... as the timeline dates it (end_ms: no earlier than what was booked)
    # Stretches between a run's clean end and the job's next run start (a resume or a plain
    # start after `run end`): the GPUs were free then, and `_unassigned` books them.
    gaps: dict[int, tuple[int, int]] = field(default_factory=dict)  # gap start in the timeline -> [a, b)
    done: bool = False
    done_at: float | None = None  # monotonic time when the job was booked to its end
    skew_s: float | None = None

    @property
    def booked_until(self) -> int:
        return self.state.booked_until

    @property
    def start_settled(self) -> bool:
        """Whether every rank the job declares (`world_size`) has registered, as far as this
        agent has read. Until then a registration read late may date the job's start earlier,
        and the timeline is then walked again from the whole stream, so the stream must be
        there whole. Registrations that declare no size cannot tell: settled."""
        sizes = [r.world_size for r in self.ranks.values() if r.world_size]
        return not sizes or len(self.ranks) >= max(sizes)

    @property
    def oldest_unbooked(self) -> int:
        """Where the job's least-booked GPU is: the watermark, or a late rank catching up."""
        return min([self.state.booked_until, *self.state.behind.values()])

    @property
    def booked(self) -> np.ndarray:
        """All amounts this agent booked for the job, [category, (ms, mJ, micro-cost)]."""
        return self.state.booked

    @property
    def voided(self) -> np.ndarray:
        return self.state.voided

    def window_from(self, context_ms: int) -> int:
        """Where the job's band window starts: its state's window, else (before the first booked
        round, a rank registered late, a state stored without one) the whole booking context."""
        w, oldest = self.state.win, self.oldest_unbooked
        return w[0] if w is not None and w[1] <= oldest else oldest - context_ms

    def claim(self, rank: int) -> tuple[int, int]:
        """[start, end) of the job's hold on its rank's GPU, as far as known now."""
        start = self.state.starts.get(rank)
        if start is None:
            start = max(int(self.ranks[rank].ts * 1000), self.floors.get(rank, 0))
        end = min(self.ends.get(rank, POS_INF), self.end_ms if self.end_ms is not None else POS_INF)
        return start, max(start, end)

    def held(self, rank: int) -> list[tuple[int, int]]:
        """The job's hold on its rank's GPU as [start, end) stretches: its claim less the gaps
        between a clean end and the next run start."""
        start, end = self.claim(rank)
        out, cur = [], start
        for a, b in sorted(self.gaps.values()):
            if b <= cur or a >= end:
                continue
            if a > cur:
                out.append((cur, a))
            cur = max(cur, b)
        if end > cur:
            out.append((cur, end))
        return out

    def note_runs(self, tl: Timeline) -> None:
        """Follow the run's ends and restarts from this round's timeline. A run that starts again
        after a clean end (a resume, a requeue, a second `train()`) reopens the job's hold on its
        GPUs: the stretch between stays free. Time booked before a late `run end` arrived stays
        the job's."""
        b, r = tl.bounds, tl.regime
        if tl.end_ms is None and self.end_at is not None:
            i = int(np.searchsorted(b, self.end_at, "right")) - 1
            if r[i] == Regime.UNASSIGNED and b[i + 1] >= POS_INF:
                return  # a run start seen at the edge of the data: reopened when it has time
        for i in np.flatnonzero(r == Regime.UNASSIGNED).tolist():
            lo, hi = int(b[i]), int(b[i + 1])
            if lo > tl.start_ms and hi < POS_INF and lo not in self.gaps:
                held_to = self.end_ms if lo == self.end_at and self.end_ms is not None else lo
                self.gaps[lo] = (min(max(lo, held_to), hi), hi)
        if tl.end_ms is None:
            self.end_ms = self.end_at = None
        elif tl.end_ms != self.end_at:
            self.end_ms, self.end_at = max(tl.end_ms, self.booked_until), tl.end_ms


def _held(state: JobState, rank: int) -> int:
    """How far a job's state has booked its rank's GPU (states stored before `held` was kept:
    the watermark)."""
    return state.held.get(rank, state.booked_until)


class Agent:
    def __init__(self, source: GpuSource, cfg: AgentConfig, clock: ClockWatch | None = None) -> None:
        """`clock`: the wall and monotonic clocks a live source's samples are checked with (tests
        inject one)."""
        import redis

        self.source = source
        self.cfg = cfg
        self.host = cfg.host or source.host
        self.redis = protocol.connect(cfg.redis_url)
        self._instance = uuid.uuid4().hex[:12]  # this process: its watermarks say it wrote them
        self._redis_errors = (redis.RedisError, OSError)
        self.sampler = Sampler(source, cfg.sample_interval_s, clock=clock)
        self.jobs: dict[str, _Job] = {}
        self.policy = cfg.policy()
        self.context_ms = int((cfg.context_s or 2 * self.policy.widest_checkpoint_allowance_s() + 60) * 1000)
        self.samples_maxlen = samples_maxlen(cfg)
        self._local: list[tuple] = []  # chunks of (gpu, ts, p, u, e) read from this node
        self._first_seen: dict[int, int] = {}  # GPU -> this process's first sample of it (ms)
        self._newest: dict[int, int] = {}  # GPU -> newest sample (ms)
        self._last_refresh = 0.0
        self._reg_version: str | None = "?"  # the registrations counter at the last discovery
        self._reg_read: str | None = None  # ... and as this round read it
        self._reg_prev: str | None = "?"  # ... and as the discovery before read it
        self._gpus_seen: tuple = ()  # the node's GPUs at the last discovery
        self._unassigned_until: int | None = None
        self._unassigned_raw: str | None = None
        self._unassigned_loaded = False
        # True once the unassigned ledger is booked to the end of the newest sample (at shutdown,
        # or after a replay's last one): a bill read before then would miss its last stretch.
        self.unassigned_settled = False
        self._epoch: str | None = None
        self._layout = _Layout()
        self._final = False
        self._started_at = time.monotonic()
        self._redis_back_at = 0.0
        self.redis_up = False
        self.stats: collections.Counter[str] = collections.Counter()
        self.registrations_rejected: collections.Counter[tuple[str, str]] = collections.Counter()
        # (job, key): meta keys a job set that only the operator sets (ignored; said once per job)
        self.meta_ignored: dict[tuple[str, str], int] = {}
        self._rejected_seen: set[tuple[str, str, int]] = set()
        # Trainer-writable values refused (keys of the wrong type, ...), by job and reason.
        self.refusals = untrusted.Refusals(log)
        self._logged: set[tuple] = set()
        learn = cfg.learn_idle if cfg.learn_idle is not None else bool(getattr(source, "wall_clock", False))
        self.idle = IdleLearner() if learn else None
        self._idle_seeded = False
        self._idle_saved: dict[str, tuple[float, float]] = {}  # GPU key -> (level, monotonic time) stored
        self._gpu_band: dict[int, int] = {}  # GPU index -> band of its newest reading alone
        self.live_seq = 0  # rounds that published live state: the exporter's cache key
        self.lock = threading.Lock()
        self._stop = threading.Event()
        # Round CPU time: per bucket of ROUND_BUCKETS (+Inf last), and the sum (s).
        self.round_counts = [0] * (len(ROUND_BUCKETS) + 1)
        self.round_sum = 0.0
        # The agent id's lease (agentid.py): renewed every round, outliving a few slow ones.
        self._id_ttl_s = max(30.0, 10 * cfg.book_interval_s)
        self.id_refused = False  # another host holds this agent id: nothing is booked

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

    def run(self, until=None) -> None:
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

    def _log_once(self, key: tuple, level: int, msg: str, *args) -> None:
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
        readings = self.sampler.drain()
        if readings:
            chunk = (
                np.fromiter((r.gpu for r in readings), np.int64, len(readings)),
                np.fromiter((round(r.ts * 1000) for r in readings), np.int64, len(readings)),
                np.fromiter((r.power_w for r in readings), np.float64, len(readings)),
                np.fromiter((r.util_pct for r in readings), np.float64, len(readings)),
                np.fromiter((r.energy_mj for r in readings), np.float64, len(readings)),
            )
            self._local.append(chunk)
            for g in np.unique(chunk[0]).tolist():
                t = chunk[1][chunk[0] == g]
                self._first_seen.setdefault(g, int(t.min()))
                self._newest[g] = max(self._newest.get(g, 0), int(t.max()))
                if self.idle is not None:
                    sel = chunk[0] == g
                    self.idle.add(self._gpu_key(g), chunk[2][sel], chunk[3][sel])
        local = self._local_arrays()
        self._band_readings()
        try:
            self._layout.check(self.redis, self.cfg.prefix)  # before the epoch, which it may move
            self._check_epoch()
            # Also after an outage: the jobs are read again as after a start.
            stale = not self.redis_up or time.monotonic() - self._last_refresh > self.cfg.job_refresh_s
            if self._jobs_changed() or stale:
                self._discover()
            if not self.redis_up:
                self._redis_back_at = time.monotonic()
            self._sync_idle()
            if self._hold_id():
                for job in list(self.jobs.values()):
                    if job.own:
                        self._book_isolated(job, local)
                try:
                    self._book_unassigned(local)
                except ledger.WrongType as e:
                    self._wrong_type(ledger.UNASSIGNED_JOB, e, e.keys)
                    self._unassigned_loaded = False
            self._publish_node()
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
        self._unassigned_loaded = False
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
        if self._unassigned_until is not None:
            self._unassigned_loaded, self._unassigned_raw = True, None

    def _book_isolated(self, job: _Job, local: tuple[np.ndarray, ...]) -> None:
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

    # ---- live state every round (booked or not) ---------------------------------------------
    def _gpu_key(self, g: int) -> str:
        """A GPU's key for what is learned of it: its UUID, else host and index."""
        gpus = self.source.gpus()
        uuid_ = gpus[g].uuid if g < len(gpus) else None
        return uuid_ or f"{self.host}:{g}"

    def _gpu_profile(self, g: int) -> Profile:
        """The band profile of one GPU of this node, with its learned idle level."""
        if self.cfg.profile is not None:
            return self.cfg.profile
        gpus = self.source.gpus()
        cfg = self.cfg
        prof = profiles.choose(
            None, cfg.gpu_model, cfg.power_limit_w, gpus=gpus[g : g + 1], directory=cfg.profile_dir
        )
        return profiles.with_idle(self._sliced(prof, [g]), self._idle_level([g]))

    def _lanes(self, gpus: list[int]) -> np.ndarray | None:
        """Each GPU's lanes (lo, hi, den) where one of them is a slice of a shared GPU; None when
        all are whole GPUs (the common case: nothing to weigh)."""
        ids = self.source.gpus()
        lanes = [ids[g].lanes if g < len(ids) else shares.WHOLE for g in gpus]
        if all(x == shares.WHOLE for x in lanes):
            return None
        return np.asarray(lanes, np.int64).reshape(-1, 3)

    def _sliced(self, prof: Profile, gpus: list[int]) -> Profile:
        """A whole GPU's profile for a slice of it (a MIG instance): its power edges scaled by the
        slice's share, as the source scales the slice's power."""
        ids = self.source.gpus()
        fracs = {shares.fraction(ids[g].lanes) for g in gpus if g < len(ids)}
        if len(fracs) != 1 or fracs == {1.0}:
            return prof
        return profiles.scaled(prof, fracs.pop())

    def _idle_level(self, gpus: list[int]) -> float | None:
        """The highest learned idle level of these GPUs (so each one's idle is under the edge)."""
        ids = self.source.gpus()
        if self.idle is None:  # a played-back trace brings its own levels (replay learns them)
            given = [lv for g in gpus if g < len(ids) and (lv := ids[g].idle_w) is not None]
            return max(given) if given else None
        levels = [
            self.idle.level(self._gpu_key(g), ids[g].power_limit_w if g < len(ids) else None) for g in gpus
        ]
        known = [lv for lv in levels if lv is not None]
        return max(known) if known else None

    def _band_readings(self) -> None:
        """Each GPU's band from its newest reading alone: the band shown for a job's GPU whose
        job has no classified sample yet, so /metrics always has one."""
        out = {}
        for g, r in self.sampler.latest().items():
            try:
                prof = self._gpu_profile(g)
            except profiles.ProfileError:
                continue
            out[g] = int(bands_mod.reading_bands(np.asarray([r.power_w]), np.asarray([r.util_pct]), prof)[0])
        with self.lock:
            self._gpu_band = out

    def _sync_idle(self) -> None:
        """Learned idle levels in Redis by GPU UUID (`keys.gpu_idle_key`): read once at start
        (a restarted agent starts from them), written when they move or every 10 minutes."""
        if self.idle is None:
            return
        gpus = self.source.gpus()
        keys = {g.uuid: gpu_idle_key(self.cfg.prefix, g.uuid) for g in gpus if g.uuid}
        if not keys:
            return
        if not self._idle_seeded:
            from costexporter.store import redisconn  # MGET across slots: one per slot on a Redis Cluster

            for u, raw in zip(keys, redisconn.mget(self.redis, list(keys.values())), strict=True):
                try:
                    d = json.loads(raw) if raw else None
                    if d:
                        self.idle.seed(u, float(d["idle_w"]), int(d["n"]))
                except (ValueError, TypeError, KeyError):
                    self.stats["bad_idle_entries"] += 1
            self._idle_seeded = True
        now = time.monotonic()
        pipe, saved_now = None, {}
        for i, g in enumerate(gpus):
            if not g.uuid:
                continue
            lv = self.idle.level(g.uuid, g.power_limit_w)
            saved = self._idle_saved.get(g.uuid)
            if lv is None or (saved and abs(saved[0] - lv) < 0.5 and now - saved[1] < 600):
                continue
            pipe = pipe or self.redis.pipeline(transaction=False)
            entry = {"idle_w": round(lv, 2), "n": self.idle.count(g.uuid), "host": self.host, "gpu": i}
            pipe.set(keys[g.uuid], json.dumps({**entry, "updated": time.time()}), ex=30 * 86400)
            saved_now[g.uuid] = (lv, now)
        if pipe is not None:
            pipe.execute()
            self._idle_saved.update(saved_now)

    def _publish_node(self) -> None:
        """This node's GPUs and their newest readings, for `preflight`'s occupancy check."""
        latest = self.sampler.latest()
        gpus = self.source.gpus()
        if not gpus:
            return
        mapping = {}
        for i, g in enumerate(gpus):
            r = latest.get(i)
            mapping[str(i)] = json.dumps(
                {
                    "uuid": g.uuid,
                    "name": g.name,
                    "ts": r.ts if r else None,
                    "power_w": None if r is None or r.power_w != r.power_w else r.power_w,
                    "util_pct": None if r is None or r.util_pct != r.util_pct else r.util_pct,
                }
            )
        k = node_key(self.cfg.prefix, self.host)
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(k)
        pipe.hset(k, mapping=mapping)
        pipe.expire(k, self.cfg.live_ttl_s)
        pipe.execute()

    def _local_arrays(self) -> tuple[np.ndarray, ...]:
        if not self._local:
            return tuple(np.zeros(0, dt) for dt in (np.int64, np.int64, np.float64, np.float64, np.float64))
        if len(self._local) > 1:
            self._local = [tuple(np.concatenate(c) for c in zip(*self._local, strict=True))]
        return self._local[0]

    def _trim(self, local: tuple[np.ndarray, ...]) -> None:
        """Keep the local samples some job still needs; bounded, the overflow counted."""
        ts = local[1]
        if ts.size == 0:
            return
        keep_from = min(
            (j.window_from(self.context_ms) for j in self.jobs.values() if j.own and not j.done),
            default=int(ts.max()) - self.context_ms,
        )
        if self._unassigned_until is not None:  # GPUs of no job: kept until that ledger has them
            keep_from = min(keep_from, self._unassigned_until - 60_000)
        keep = ts >= keep_from
        if keep.sum() > self.cfg.max_buffered_samples:
            drop = int(keep.sum()) - self.cfg.max_buffered_samples
            idx = np.flatnonzero(keep)[np.argsort(ts[keep], kind="stable")[:drop]]
            keep[idx] = False
            self.stats["samples_dropped"] += drop
        if not keep.all():
            self._local = [tuple(a[keep] for a in local)]

    # ---- jobs ------------------------------------------------------------------------------
    def _reject_registration(self, job: str, rank_s: str, raw: str, reason: str, message: str) -> None:
        """Counted once per entry, logged once per job and reason; the job's other ranks go on."""
        seen = (job, rank_s[:100], hash(raw))  # not the entry itself: it may be a megabyte
        if seen in self._rejected_seen:
            return
        if len(self._rejected_seen) < 100_000:
            self._rejected_seen.add(seen)
        # (a job name is at most 200 characters: a longer one is cut for the metric's label too)
        self.registrations_rejected[(untrusted.short(job, 200), reason)] += 1
        self._log_once(
            ("registration", job, reason),
            logging.WARNING,
            "job %r: registration of rank %s rejected (%s): %s; counted in "
            "costexporter_registrations_rejected_total, the other ranks and jobs book on",
            untrusted.short(job),
            untrusted.short(rank_s),
            reason,
            message,
        )

    def _jobs_changed(self) -> bool:
        """Whether a register arrived since the last discovery (the trainers' counter moved; also
        when Redis lost it) or the node's GPUs changed (a source that finds them late): discovery
        then reads every job's registrations again."""
        try:
            raw = self.redis.get(registrations_key(self.cfg.prefix))
        except self._redis_errors as e:
            if not untrusted.is_wrong_type(e):
                raise
            self.refusals.refuse(
                "", "wrong_type", "the registrations counter is not a string: jobs are looked for every round"
            )
            return True
        self._reg_read = raw.decode() if isinstance(raw, bytes) else raw
        return self._reg_read != self._reg_version or self._gpu_ids() != self._gpus_seen

    def _gpu_ids(self) -> tuple:
        return tuple((g.uuid, g.host, g.index) for g in self.source.gpus())

    def _discover(self) -> None:
        """Jobs whose registered GPUs are this node's (by UUID, else host + index)."""
        self._last_refresh = time.monotonic()
        self._reg_version = "?"  # a discovery cut short by an error is run again next round
        self._gpus_seen = self._gpu_ids()
        if self._unassigned_until is None:
            self._load_unassigned()
        node_gpus = GpuIndex(self.source.gpus())
        names = []
        try:
            listed = self.redis.zrange(jobs_key(self.cfg.prefix), 0, -1)
        except self._redis_errors as e:
            if not untrusted.is_wrong_type(e):
                raise
            self.refusals.refuse("", "wrong_type", "the jobs index is not a sorted set: no new job is found")
            listed = []
        for name in listed:
            try:
                protocol.check_job(name)
            except ValueError as e:
                self._reject_registration(name, "*", "", "bad_job_name", str(e))
                continue
            names.append(name)
        # Every job's registrations in one round trip (512 jobs: one, not 512). A reply that is
        # an error (a ranks key of the wrong type) is that job's alone.
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(ranks_key(self.cfg.prefix, name))
        fresh, retry = [False], False
        for name, ranks in zip(names, pipe.execute(raise_on_error=False) if names else [], strict=True):
            if isinstance(ranks, Exception):
                if not untrusted.is_wrong_type(ranks):
                    raise ranks
                self.refusals.refuse(
                    name, "wrong_type", "its ranks key is not a hash: its registrations are not read"
                )
                continue
            try:
                self._discover_job(name, ranks, node_gpus, fresh)
            except self._redis_errors as e:
                if not untrusted.is_wrong_type(e):
                    raise
                self._wrong_type(name, e)
                retry = True  # its keys set aside: looked at again next round
        for job in self.jobs.values():
            hosts: dict[str, list[int]] = {}
            for r, peer in sorted(job.ranks.items()):
                if r not in job.own:
                    hosts.setdefault(str(peer.host), []).append(r)
            job.peer_hosts = hosts
        self._handover()
        # A counter that moved since a discovery is looked at once more next round: on a cluster
        # it and a job's `:ranks` sit on different nodes, and the trainer's INCR may land before
        # its HSET. (Not after the first: that one reads what was there before the agent.)
        settled = not retry and (self._reg_prev == "?" or self._reg_read == self._reg_prev)
        self._reg_version = self._reg_read if settled else "?"
        self._reg_prev = self._reg_read

    def _discover_job(self, name: str, ranks: dict, node_gpus: GpuIndex, fresh: list[bool]) -> None:
        """One job's registrations read: the ranks on this node's GPUs become the job's own."""
        job = self.jobs.get(name)
        regs = []
        for rank_s, raw in ranks.items():
            try:
                reg = protocol.parse_registration(rank_s, raw)
            except protocol.RegistrationError as e:
                self._reject_registration(name, rank_s, raw, e.reason, str(e))
                continue
            g = node_gpus.find(reg.gpu_uuid, reg.host, reg.gpu)
            regs.append((reg, g))
        if job is None and all(g is None for _reg, g in regs):
            return  # no GPU of this node: not this agent's job
        # Every rank of the job, the other hosts' too (whatever order the hash gives them):
        # their samples are read, and this agent's shared, only for ranks it knows of.
        for reg, g in regs:
            if job is None:
                job = self.jobs[name] = _Job(name, EventReader(self.redis, name, prefix=self.cfg.prefix))
                # its stored GPU starts and watermark before any claim or handover uses them (a
                # restarted agent would otherwise hand a crashed job time its successor booked)
                self._load(job)
            old = job.ranks.get(reg.rank)
            if old is not None:  # a restart registers again: the GPU is the job's from the
                # rank's first registration on (the hash keeps only the newest)
                reg = dataclasses.replace(reg, ts=min(old.ts, reg.ts))
            job.ranks[reg.rank] = reg
            if g is not None and reg.rank not in job.own:
                if self._claim_refused(job, reg, g):
                    continue
                if not fresh[0]:  # a twin agent may have booked `_unassigned` further
                    self._load_unassigned(ahead_only=True)
                    fresh[0] = True
                job.own[reg.rank] = g
                job.floors[reg.rank] = self._booked_elsewhere(g, job)

    def _claim_refused(self, job: _Job, reg: protocol.Registration, gpu: int) -> bool:
        """A registration that names this GPU by host and index only, while another job that has
        not ended holds it by its UUID: refused (counted, logged), the holder keeps it. A
        trainer could otherwise move another job's GPU time to itself by naming the GPU's index;
        a real successor reads the UUID (the reporter does) and takes over as usual."""
        uuids = self.source.gpus()
        uuid_ = uuids[gpu].uuid if gpu < len(uuids) else None
        if not uuid_ or reg.gpu_uuid == uuid_:
            return False
        for other in self.jobs.values():
            if other is job or other.end_ms is not None:
                continue
            for r, g in other.own.items():
                held = other.ranks.get(r)
                if g == gpu and held is not None and held.gpu_uuid == uuid_ and held.ts <= reg.ts:
                    self.refusals.refuse(
                        job.name,
                        "gpu_held",
                        "rank %d names GPU %s of %s by its index, which job %r holds by its UUID %s: "
                        "refused, the GPU stays that job's (register with gpu_uuid to take it over)",
                        reg.rank,
                        reg.gpu,
                        untrusted.short(reg.host),
                        untrusted.short(other.name),
                        uuid_,
                    )
                    return True
        return False

    def _wrong_type(self, name: str, e: BaseException, wrong: dict[str, str] | None = None) -> None:
        """A job's round met a key of the wrong type. Keys only the agents write are moved aside
        (someone else created them: they never held the ledger) and written afresh next round;
        a trainer's own key of the wrong type is refused, counted and logged, every round until
        it is fixed. The other jobs go on either way."""
        job = self.jobs.get(name)
        if wrong is None:
            expected = ledger.agent_keys(self.cfg.prefix, name, self.cfg.agent_id, self.host)
            for h in job.peer_hosts if job is not None else ():
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

    def _booked_elsewhere(self, gpu: int, new: _Job) -> int:
        """How far this GPU's time is booked already (unassigned, or by another job): a claim
        that arrives late starts there, so no GPU-second is booked twice."""
        until = self._unassigned_until or 0
        for j in self.jobs.values():
            if j is new:
                continue
            for r, g in j.own.items():
                if g == gpu:
                    # How far that job booked this GPU (not its watermark: its hold may have
                    # ended), in memory and as stored: a twin agent (the same agent id) may
                    # have booked it further than this agent's memory says.
                    until = max(until, _held(j.state, r), _held(self._stored_state(j), r))
        return until

    def _stored_state(self, job: _Job) -> JobState:
        """The job's watermark as stored (an unreadable one: this agent's memory of it)."""
        raw = self.redis.get(watermark_key(self.cfg.prefix, job.name, self.cfg.agent_id))
        try:
            return JobState.from_json(json.loads(raw) if raw else {}, {})
        except (ValueError, TypeError, KeyError, AttributeError):
            return job.state

    def _handover(self) -> None:
        """A GPU registered by a later job leaves the earlier job at the later one's start (the
        earlier one crashed without `run end`), as offline replay does."""
        claims: dict[int, list[tuple[int, str, int]]] = {}
        for j in self.jobs.values():
            for r, g in j.own.items():
                claims.setdefault(g, []).append((int(j.ranks[r].ts * 1000), j.name, r))
        for lst in claims.values():
            lst.sort()
            for i, (_t, name, r) in enumerate(lst):
                later = [(n2, r2) for _t2, n2, r2 in lst[i + 1 :] if n2 != name]
                if later:
                    n2, r2 = later[0]
                    self.jobs[name].ends[r] = self.jobs[n2].claim(r2)[0]
                else:
                    self.jobs[name].ends.pop(r, None)

    def _load(self, job: _Job) -> None:
        """The job's state as the ledger has it (at start, and after an uncertain write)."""
        raw = self.redis.get(watermark_key(self.cfg.prefix, job.name, self.cfg.agent_id))
        # The rollback index stays in Redis: a round reads the entries its voids need.
        job.state = JobState.from_json(json.loads(raw) if raw else {}, {})
        job.wm_raw = raw
        if job.restore or (not job.ever_loaded and job.fold is None and job.reader.cursor in ("0", "0-0")):
            job.restore = False
            self._restore_fold(job)
        job.loaded = job.ever_loaded = True

    def _restore_fold(self, job: _Job) -> None:
        """A (re)started agent resumes a job from the fold stored with its watermark: the reader
        goes on from where that fold had read. An unreadable one (an older format, corrupted,
        another booking configuration) is counted and logged once; the fold is then rebuilt from
        the stream."""
        cfg = self.cfg
        pos = self.redis.hget(readers_key(cfg.prefix, job.name), f"agent:{cfg.agent_id}")
        try:
            job.fold_old_at = float(json.loads(pos)["at"]) if pos else None
        except (ValueError, KeyError, TypeError):
            job.fold_old_at = None
        raw = self.redis.get(fold_key(cfg.prefix, job.name, cfg.agent_id))
        if raw is None:
            return
        try:
            fold, extra = self._load_fold(raw, job.name)
            job.reader.restore(extra["reader"])
            meta, preflight = dict(extra["meta"]), str(extra["preflight"])
            newest = int(extra["newest_event_ms"])
        except (FoldFormatError, ValueError, KeyError, TypeError) as e:
            job.reader = EventReader(self.redis, job.name, prefix=cfg.prefix)
            self.stats["fold_restore_failures"] += 1
            self._log_once(
                ("fold", job.name),
                logging.WARNING,
                "job %r: the stored fold is not usable (%s): folding the job's stream again",
                job.name,
                e,
            )
            return
        job.fold, job.meta, job.preflight, job.newest_event_ms = fold, meta, preflight, newest
        job.fold_start = fold.start_ms
        # What this agent read or folded before is the stored fold's now, or read again after it.
        job.fresh, job.fold_candidates = [], []
        self.stats["fold_restores"] += 1

    def _terms(self, job: _Job, member_start: np.ndarray, profile: Profile) -> JobTerms:
        """The job's terms this round (`terms.job_terms`, as the watcher and replay derive them):
        other hosts' ranks may have registered a little earlier, an ancient date is not trusted.
        What its meta set that only the operator sets is ignored, counted and said once."""
        terms = job_terms(
            job.name,
            job.meta,
            self.policy,
            (int(reg.ts * 1000) for reg in job.ranks.values()),
            own_start_ms=int(member_start.min()),
            stored_start_ms=job.fold_start,
            profile=profile,
        )
        if terms.price_note:
            self._log_once(("price", job.name), logging.INFO, "%s", terms.price_note)
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

    def _load_fold(self, raw: bytes | str, job: str) -> tuple[TimelineFold, dict]:
        """A stored fold of the job, folded with any of the booking configurations the
        operator's policy gives (the job's own is known once its meta is read: a fold of another
        is folded again then)."""
        data = base64.b64decode(raw, validate=True)
        error: FoldFormatError | None = None
        for booking in self.policy.bookings():
            try:
                return load_fold(data, booking, job)
            except FoldFormatError as e:
                error = e
        assert error is not None
        raise error

    def _fold_due(self, job: _Job, now: float) -> bool:
        every = self.cfg.fold_persist_s
        if every is None or job.fold is None or job.fold.late or job.fresh:
            return False
        if job.reader.last_read >= 10_000:  # still catching up: store once at the stream's end
            return False
        return job.fold_saved_at is None or not 0 <= now - job.fold_saved_at < every

    def _old_fold(self, job: _Job, blob: str, now: float) -> tuple[float, str, str] | None:
        """The stored fold to keep as the older one from this commit on, if it changes: one at
        least `late_keep_s` old once the stored one is twice that (none stored: this one)."""
        keep = self.cfg.late_keep_s
        cands = job.fold_candidates
        if not cands or now - cands[-1][0] >= keep / 4:
            cands.append((now, blob, job.reader.cursor))
        if job.fold_old_at is None:
            return cands[-1]
        if now - job.fold_old_at < 2 * keep:
            return None
        ripe = [c for c in cands if now - c[0] >= keep]
        return ripe[-1] if ripe else None

    def _queue_fold(self, pipe, job: _Job, blob: str, old: tuple[float, str, str] | None) -> None:
        """The fold (and the older one and this agent's stream position, when it changes), in the
        commit's MULTI: the stream is kept from the older fold's position on."""
        cfg = self.cfg
        pipe.set(fold_key(cfg.prefix, job.name, cfg.agent_id), blob)
        if old is not None:
            at, old_blob, cursor = old
            pipe.set(fold_key(cfg.prefix, job.name, cfg.agent_id, old=True), old_blob)
            ledger.queue_position(
                pipe,
                cfg.prefix,
                job.name,
                f"agent:{cfg.agent_id}",
                # While a rank may still register earlier than the start walked with, the whole
                # stream is kept: moving the start folds the job again from its first event.
                cursor if job.start_settled else "0-0",
                at=round(at, 3),
                ranks=sorted(job.own),  # the trimmer waits until every rank has its agent here
            )

    def _fold_stored(self, job: _Job, now: float, old: tuple[float, str, str] | None) -> None:
        job.fold_saved_at = now
        if old is not None:
            job.fold_old_at = old[0]
            job.fold_candidates = [c for c in job.fold_candidates if c[0] > old[0]]

    def _dump_fold(self, job: _Job) -> str:
        extra = {
            "reader": job.reader.position(),
            "meta": job.meta,
            "preflight": job.preflight,
            "newest_event_ms": job.newest_event_ms,
        }
        return base64.b64encode(dump_fold(job.fold, job.name, extra)).decode()  # type: ignore[arg-type]

    def _trim_stream(self, job: _Job) -> None:
        """Trim the job's stream below its readers' oldest position (idempotent; errors counted)."""
        import redis

        try:
            n = ledger.trim_stream(
                self.redis, self.cfg.prefix, job.name, time.time(), self.cfg.reader_stale_s, set(job.ranks)
            )
        except redis.RedisError as e:
            if untrusted.is_wrong_type(e):  # a readers hash created as something else
                self._wrong_type(job.name, e)
            self.stats["trim_errors"] += 1
            return
        if n < 0:  # another agent of the job has not stored its fold yet
            self.stats["trim_waiting"] += 1
            return
        self.stats["stream_entries_trimmed"] += n

    def _timeline(self, job: _Job, terms: JobTerms, now_ms: int, final: bool = False):
        """The job's timeline at `now_ms` from its fold (`final`: no later event or sample will
        come); the fold is (re)built from the job's stream, up to where its reader is, when there
        is none yet, the job's start or booking thresholds moved, or an event arrived older than
        what was folded."""
        job_start, booking = terms.start_ms, terms.booking
        same = job.fold is not None and job.fold.start_ms == job_start and job.fold.cfg == booking
        if job.fold is not None and same:
            job.fold.add(job.fresh)
            job.fresh = []
            tl = job.fold.timeline(now_ms, final=final, dated_until=True)
            if tl is not None:
                return tl
        if job.fold is not None:
            self.stats["timeline_rebuilds"] += 1
            if same:
                tl = self._refold_from_store(job, terms, now_ms, final)
                if tl is not None:
                    return tl
        job.fresh = []
        # Folded batch by batch, as far behind the newest event read as a live round folds.
        fold = job.fold = TimelineFold(booking, job_start)
        lag = int(self.cfg.fold_lag_s * 1000)
        keep_from = job.oldest_unbooked - self.context_ms - 60_000

        def fold_batch(batch: list[Event]) -> None:
            if batch and not fold.late:
                fold.add(batch)
                fold.advance(min(now_ms, int(max(e.ts for e in batch) * 1000)) - lag, keep_from)

        reader = EventReader(self.redis, job.name, prefix=self.cfg.prefix)
        reader.read_until(job.reader.cursor, count=10_000, keep=walk_relevant, on_batch=fold_batch)
        tl = fold.timeline(now_ms, final=final, dated_until=True)
        if tl is not None:
            return tl
        # An event of the stream older than what was folded before it: every event at once.
        reader = EventReader(self.redis, job.name, prefix=self.cfg.prefix)
        events = reader.read_until(job.reader.cursor, count=10_000, keep=walk_relevant)
        job.fold = TimelineFold(booking, job_start)
        job.fold.add(events)
        tl = job.fold.timeline(now_ms, final=final, dated_until=True)
        if tl is None:
            job.fold = None
            tl = build_timeline(dated_until(events, now_ms), booking, job_start, now_ms, final=final)
        return tl

    def _refold_from_store(self, job: _Job, terms: JobTerms, now_ms: int, final: bool = False):
        """An event arrived older than the fold: fold it again from the older stored fold and the
        stream since that fold's position (the stream may be trimmed below it), rather than from
        the whole stream. None when the stored fold is missing, unreadable, or itself newer than
        the late event: the caller folds the whole stream (what is left of it)."""
        cfg = self.cfg
        raw = self.redis.get(fold_key(cfg.prefix, job.name, cfg.agent_id, old=True))
        if raw is None:
            return None
        try:
            fold, extra = self._load_fold(raw, job.name)
            reader = EventReader(self.redis, job.name, prefix=cfg.prefix)
            reader.restore(extra["reader"])
        except (FoldFormatError, ValueError, KeyError, TypeError):
            return None
        if fold.start_ms != terms.start_ms or fold.cfg != terms.booking:
            return None
        lag = int(cfg.fold_lag_s * 1000)
        keep_from = job.oldest_unbooked - self.context_ms - 60_000

        def fold_batch(batch: list[Event]) -> None:
            if batch and not fold.late:
                fold.add(batch)
                fold.advance(min(now_ms, int(max(e.ts for e in batch) * 1000)) - lag, keep_from)

        reader.read_until(job.reader.cursor, count=10_000, keep=walk_relevant, on_batch=fold_batch)
        tl = fold.timeline(now_ms, final=final, dated_until=True)
        if tl is None:
            return None
        job.fold, job.fresh = fold, []
        self.stats["timeline_rebuilds_from_store"] += 1
        return tl

    def _fetch_index(self, job: _Job, tl) -> None:
        """The rollback index entries this round's voids read, from the agent's `rbidx` hash."""
        need = sorted(live.needed_index_entries(tl, job.state.rb_applied) - set(job.state.rb_index))
        if not need:
            return
        k = rbidx_key(self.cfg.prefix, job.name, self.cfg.agent_id)
        for i, v in zip(need, self.redis.hmget(k, [str(i) for i in need]), strict=True):
            if v is not None:
                job.state.rb_index[i] = json.loads(v)

    def _read_events(self, job: _Job) -> None:
        """New events of the job; meta and the gate's result folded; rejections and clock skew
        made visible."""
        new_events: list[Event] = []
        for _ in range(10):  # up to 100k entries a round, read 10k at a time (a backlog's memory)
            batch = job.reader.poll(count=10_000)
            new_events += batch
            job.fresh += [ev for ev in batch if walk_relevant(ev)]
            if batch:
                job.newest_event_ms = max(job.newest_event_ms, int(max(ev.ts for ev in batch) * 1000))
            if job.reader.last_read < 10_000:
                break
        for ev in new_events:  # fold meta and the gate's result as they arrive, not every round
            if ev.type == "meta":
                jobfacts.merge_meta(job.meta, ev)
            elif ev.type == "preflight":
                job.preflight = json.dumps(jobfacts.preflight_result(ev))
            elif ev.type == "register":
                self._earlier_register(job, ev)
        for entry_id, reason, message in list(job.reader.rejections):
            self._log_once(
                ("rejected", job.name, reason),
                logging.WARNING,
                "job %r: event %s rejected (%s): %s; counted in costexporter_events_rejected_total",
                job.name,
                entry_id,
                reason,
                message,
            )
        offsets = job.reader.clock_offset_s
        if self.source.wall_clock and offsets:
            rank, skew = max(offsets.items(), key=lambda kv: abs(kv[1]))
            job.skew_s = skew
            if abs(skew) > self.cfg.clock_skew_warn_s:
                self._log_once(
                    ("skew", job.name, rank),
                    logging.WARNING,
                    "job %r rank %d: event timestamps are %+.1f s off their arrival in Redis: the trainer's "
                    "clock is skewed (keep every host on NTP) or its events arrive late",
                    job.name,
                    rank,
                    skew,
                )

    @staticmethod
    def _earlier_register(job: _Job, ev: Event) -> None:
        """The ranks hash keeps a rank's newest register only: a process that ran and ended
        before this agent read the hash (then ran again) is seen here, in the stream. The same
        GPU registered earlier dates the rank's start, as replay dates it, while its start is
        not fixed yet."""
        reg = job.ranks.get(ev.rank)
        if reg is None or ev.ts >= reg.ts or ev.rank in job.state.starts:
            return
        uuid_ = ev.get("gpu_uuid")
        same = (
            uuid_ == reg.gpu_uuid
            if uuid_ and reg.gpu_uuid
            else (ev.get("host") == reg.host and ev.get("gpu") == reg.gpu)
        )
        if same:
            job.ranks[ev.rank] = dataclasses.replace(reg, ts=ev.ts)

    def _starts(self, job: _Job, own_ranks: np.ndarray) -> np.ndarray | None:
        """When each own rank's GPU time starts, fixed the first time it is booked and kept in the
        watermark: the register's time, but no earlier than this agent's first sample of the GPU
        or what is booked already elsewhere. A register dated more than `clock_skew_warn_s`
        past the GPU's newest sample (a clock ahead) starts at that sample; one just past it is
        only newer than the last sampling round: None, the job waits a round for a sample to
        reach it (starting at the older sample would bill time before the register)."""
        out, fixed = [], {}
        tol_ms = int(self.cfg.clock_skew_warn_s * 1000)
        final = self._no_more_samples
        for r in own_ranks.tolist():
            if r not in job.state.starts:
                g = job.own[r]
                reg = int(job.ranks[r].ts * 1000)
                observed = self._first_seen.get(g, min(self._first_seen.values(), default=reg))
                start, ahead = jobfacts.gpu_start_ms(reg, observed, self._newest.get(g), job.floors.get(r, 0))
                if 0 < ahead <= tol_ms and not final:
                    return None  # the next sampling round reaches the register: book then
                fixed[r] = start
                if 0 < fixed[r] < job.state.booked_until:
                    job.state.behind[r] = fixed[r]
            out.append(fixed.get(r, job.state.starts.get(r)))
        job.state.starts.update(fixed)
        return np.asarray(out, np.int64)

    def _remote_samples(self, job: _Job, keep_from: int) -> None:
        """The other hosts' new sample entries of the job: one XREAD for all of them, decoded as
        one array. A host read for the first time (a start, a restart) is read from its newest
        entry back to `keep_from` only, not its whole stream."""
        hosts = sorted(h for h in job.peer_hosts if h != self.host)
        if not hosts:
            return
        keys = {samples_key(self.cfg.prefix, job.name, h): h for h in hosts}
        raw: list[bytes] = []
        first = {k: h for k, h in keys.items() if h not in job.remote_ids}
        if first:
            self._remote_tails(job, first, keep_from, raw)
        resp = self.redis.xread({k: job.remote_ids[h] for k, h in keys.items()}, count=10_000)
        for k, entries in resp or []:
            self._take_entries(job, keys[k.decode() if isinstance(k, bytes) else k], entries, raw)
        if raw:
            job.remote.add(samplewin.decode_entries(b"".join(raw)))

    def _take_entries(self, job: _Job, host: str, entries: list, into: list[bytes]) -> None:
        """A host's entries read: their packed samples onto `into` (a damaged one is counted)."""
        if entries:
            job.remote_seen[host] = time.monotonic()
        for entry_id, f in entries:
            job.remote_ids[host] = entry_id
            try:
                into.append(samplewin.entry_bytes(f))
            except (KeyError, ValueError):
                self.stats["bad_sample_entries"] += 1

    def _remote_tails(
        self, job: _Job, keys: dict[str, str], keep_from: int, into: list[bytes], chunk: int = 16
    ) -> None:
        """Each stream's entries from the newest back to the first whose samples all lie before
        `keep_from`, pipelined, `chunk` entries a stream at a time (doubling)."""
        got: dict[str, list] = {k: [] for k in keys}
        todo = {k: "+" for k in keys}
        while todo:
            pipe = self.redis.pipeline(transaction=False)
            for k, hi in todo.items():
                pipe.xrevrange(k, max=hi, count=chunk)
            nxt = {}
            for k, entries in zip(todo, pipe.execute(), strict=True):
                for entry_id, f in entries:
                    got[k].append((entry_id, f))
                    try:
                        old = int(samplewin.decode_entry(f)[1].max(initial=-1)) < keep_from
                    except (KeyError, ValueError):  # counted when taken
                        old = False
                    if old:
                        break
                else:
                    if len(entries) == chunk:
                        nxt[k] = f"({entries[-1][0]}"
            todo, chunk = nxt, chunk * 2
        for k, entries in got.items():
            job.remote_ids[keys[k]] = "0-0"
            self._take_entries(job, keys[k], entries[::-1], into)

    def _window(self, job: _Job, local: tuple[np.ndarray, ...], keep_from: int):
        """Every rank's samples from `keep_from`, sorted by (rank, ts), and this agent's own
        (shared with the job's other agents as they come)."""
        gpu, ts, p, u, e = local
        lut = np.full(max([*job.own.values(), int(gpu.max(initial=-1))]) + 1, -1, np.int64)
        for r, g in job.own.items():
            lut[g] = r
        mine = lut[gpu] >= 0 if gpu.size else np.zeros(0, bool)
        own_rank, own_ts = lut[gpu[mine]], ts[mine]
        new = np.zeros(0, bool)
        if self._peers(job) and own_rank.size:
            ranks, at = np.unique(own_rank, return_inverse=True)
            new = own_ts > np.asarray([job.published_ts.get(r, -1) for r in ranks.tolist()], np.int64)[at]
        if new.any():
            self.redis.xadd(
                samples_key(self.cfg.prefix, job.name, self.host),
                samplewin.encode_entry(
                    (own_rank[new], own_ts[new], p[mine][new], u[mine][new], e[mine][new])
                ),
                maxlen=self.samples_maxlen,
                approximate=True,
            )
            for r in np.unique(own_rank[new]).tolist():
                job.published_ts[r] = int(own_ts[new][own_rank[new] == r].max())
        # Only what is new is sorted into the window kept from the last round (samplewin.py).
        own = (own_rank, own_ts, p[mine], u[mine], e[mine])
        window = job.remote.round(own, keep_from, set(job.own))
        return window, (own_rank, own_ts, p[mine], u[mine])

    def _peers(self, job: _Job) -> bool:
        """Whether another host holds ranks of the job: only then are its samples published (a
        job on this host alone needs no sample stream). A rank registered later on another host
        gets this host's samples then, from the whole context kept."""
        return any(h != self.host for h in job.peer_hosts)

    def _book(self, job: _Job, local: tuple[np.ndarray, ...]) -> None:
        """Read, book the window (pure), commit the delta with the watermark compare-and-set."""
        cfg = self.cfg
        if not job.loaded:
            self._load(job)
        self._read_events(job)
        own_ranks = np.asarray(sorted(job.own), np.int64)
        member_start = self._starts(job, own_ranks)  # a rank registered late is behind from here
        # The band window: seconds before what is left to book, the signature run carried in.
        _, carry = job.state.take_window(job.oldest_unbooked)
        keep_from = job.window_from(self.context_ms)
        self._remote_samples(job, keep_from)
        (R, T, P, U, E), (own_rank, own_ts, own_p, own_u) = self._window(job, local, keep_from)
        if T.size == 0 or member_start is None:
            return
        if job.state.booked_until == 0:
            job.state.booked_until = int(member_start.min())
        # A rank that joined after the job's watermark passed its start (its register was read a
        # round late) catches up from its start: that time is held from `_unassigned` as the job's.
        behind = job.state.behind
        booked_from = np.asarray([behind.get(int(r), job.booked_until) for r in own_ranks], np.int64)
        meta = job.meta
        profile = cfg.profile or profiles.with_idle(
            self._sliced(
                profiles.choose(
                    None,
                    cfg.gpu_model,
                    cfg.power_limit_w,
                    meta=meta,
                    gpus=self.source.gpus(),
                    directory=cfg.profile_dir,
                ),
                sorted(job.own.values()),
            ),
            self._idle_level(sorted(job.own.values())),
        )
        terms = self._terms(job, member_start, profile)
        job_start = terms.start_ms
        n_ranks = int(max(max(job.ranks), int(R.max()))) + 1
        hold, ignore, wait = self._remote_liveness(job)
        if wait:
            return
        now_ms = int(own_ts.max()) if own_ts.size else int(T.max())
        # A replay played to its end (and no other agent of the job still publishing): no later
        # sample will come, and the job is booked as offline replay books it, to its last sample's
        # slice, its pending tail decided (a job that crashed stays the job's until another takes
        # its GPUs: stalled by band, as replay has it).
        played = bool(getattr(self.source, "done", False)) and not hold.size
        if played:
            now_ms += bands_mod.sampling_interval_ms(R, T)
        else:  # events still on their way (a sim at --speed; trainers that deliver late)
            now_ms -= int(max(self.source.event_lag_s, cfg.event_lag_s) * 1000)
        tl = self._timeline(job, terms, now_ms, final=played)
        job.note_runs(tl)  # a run end frees the GPUs; a later run start takes them back
        member_end = np.maximum(np.asarray([job.claim(int(r))[1] for r in own_ranks], np.int64), member_start)
        res = book_window(
            events=[],
            timeline=tl,
            cfg=terms.booking,
            profile=profile,
            job_start_ms=job_start,
            rank=R,
            ts_ms=T,
            power_w=P,
            util_pct=U,
            energy_mj=E,
            n_ranks=n_ranks,
            own_ranks=own_ranks,
            member_start_ms=member_start,
            booked_until_ms=job.booked_until,
            # This agent's own data time: other agents may run ahead of it or behind.
            now_ms=now_ms,
            hold_ranks=hold,
            ignore_ranks=ignore,
            member_end_ms=member_end,
            booked_from_ms=booked_from,
            final=played,
            carry=carry,
            lanes=self._lanes([job.own[int(r)] for r in own_ranks]),
        )
        # Fold for good what lies far enough behind the data time and the events read.
        if job.fold is not None:
            job.fold.advance(
                min(now_ms, job.newest_event_ms) - int(cfg.fold_lag_s * 1000),
                job.oldest_unbooked - self.context_ms - 60_000,
            )
        tl = res.timeline
        # The newest band of every own GPU, every round: a round that books nothing (a hang, a
        # checkpoint, idle: the horizon held at the last step) classifies the window itself.
        latest = (
            {int(own_ranks[i]): b for i, b in res.latest_band.items()}
            if res.latest_band
            else livestate.newest_bands(terms.booking, tl, profile, R, T, P, U, n_ranks, own_ranks, carry)
        )
        with self.lock:
            job.latest_band = latest or job.latest_band
        self._publish_live(job, own_rank, own_ts, own_p, own_u, profile)
        progress = self._progress(job, tl, now_ms)
        with self.lock:
            job.figures = {**job.figures, **progress}
        last_ms = int(progress["last_progress_ts"] * 1000)
        live_args = (tl, now_ms, own_ranks, member_start, R, T, P, last_ms, terms.prices)
        if res.horizon_ms <= job.booked_until and not res.pieces.dur_ms.size:
            self._live_figures(job, *live_args)
            return
        self._fetch_index(job, tl)
        delta = live.ledger_delta(
            job.state,
            res,
            prices=terms.prices,
            own_ranks=own_ranks,
            member_start_ms=member_start,
            member_end_ms=member_end,
            job_start_ms=job_start,
            last_progress_ms=int(progress["last_progress_ts"] * 1000),
            host=self.host,
            incident_tol_ms=2 * int(terms.booking.grid_s * 1000) + int(cfg.sample_interval_s * 2000),
        )
        if delta.unreachable_voids:
            self.stats["unreachable_voids"] += delta.unreachable_voids
            self._log_once(
                ("unreachable", job.name),
                logging.WARNING,
                "job %r: a resume voided steps older than the oldest of the last %d checkpoints: the "
                "rollback index no longer holds them, so their valid time stays booked valid "
                "(raise --rollback-checkpoints to reach further back)",
                job.name,
                terms.booking.rollback_checkpoints,
            )
        figures = {
            **delta.figures,
            "preflight": job.preflight,
            **progress,
            "profile": profile.name,
            "profile_calibrated": int(profile.calibrated),
            # The profile's band edges, for the dashboard's power thresholds.
            "band_idle_max_w": profile.idle_max_w,
            "band_low_max_w": profile.low_max_w,
            "band_compute_min_w": profile.compute_min_w,
            # This agent's GPU time at risk since the last checkpoint, exact (the API sums the
            # agents' when the window holds it; the buckets would start at the checkpoint's 5 min).
            at_risk_field(cfg.agent_id): encode_at_risk(
                delta.at_risk_ms, tl.last_checkpoint_ms, res.horizon_ms
            ),
        }
        version = buckets.price_version(terms.prices)
        wm = {
            **delta.state.to_json(),
            "agent": cfg.agent_id,
            "host": self.host,
            "instance": self._instance,
            "updated": time.time(),
        }
        data_s = now_ms / 1000  # stored folds are dated by data time (what lateness is measured in)
        fold_blob = self._dump_fold(job) if self._fold_due(job, data_s) else None
        old_fold = self._old_fold(job, fold_blob, data_s) if fold_blob is not None else None

        def queue(pipe) -> None:
            ledger.queue_delta(
                pipe, cfg.prefix, job.name, cfg.agent_id, delta, version, tl.steps, job.booked_until, figures
            )
            if fold_blob is not None:
                self._queue_fold(pipe, job, fold_blob, old_fold)

        job.wm_raw = ledger.commit(self.redis, cfg.prefix, job.name, cfg.agent_id, job.wm_raw, wm, queue)
        if fold_blob is not None:
            self._fold_stored(job, data_s, old_fold)
            if cfg.trim_streams:
                self._trim_stream(job)
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
        self._live_figures(job, *live_args)
        self.stats["rounds"] += 1

    def _live_figures(
        self,
        job: _Job,
        tl,
        now_ms: int,
        own_ranks: np.ndarray,
        member_start: np.ndarray,
        R: np.ndarray,
        T: np.ndarray,
        P: np.ndarray,
        last_progress_ms: int,
        prices: Prices,
    ) -> None:
        """Cost since the last progress point and GPU time at risk up to the newest sample, not
        only to the booking horizon: the booked part plus the pending part, estimated."""
        st = job.state
        booked = st.since_cost if st.since_ref_ms == last_progress_ms else 0
        upto = max(now_ms, st.booked_until)
        if tl.end_ms is not None:  # the time after the run's end is not the job's
            upto = min(upto, tl.end_ms)
        start = np.maximum(np.maximum(member_start, st.booked_until), last_progress_ms)
        pending = livestate.unbooked_cost(prices, start, upto, R, T, P, own_ranks)
        at_risk = at_risk_ms(tl, upto, member_start) if tl.end_ms is None else job.at_risk_ms
        with self.lock:
            job.live = {"since_cost": booked + pending, "at_risk_ms": at_risk}

    # ---- time of no job ----------------------------------------------------------------------
    def _load_unassigned(self, ahead_only: bool = False) -> None:
        """The stored `_unassigned` watermark (at start, and after an uncertain write). With
        `ahead_only`, adopted only if it is ahead of ours (a twin agent booked further), so a late
        claim starts after it; never going back (after an empty Redis restart our in-memory
        watermark is the truth)."""
        k = watermark_key(self.cfg.prefix, ledger.UNASSIGNED_JOB, self.cfg.agent_id)
        try:
            raw = self.redis.get(k)
        except self._redis_errors as e:
            if not untrusted.is_wrong_type(e):
                raise
            self._wrong_type(ledger.UNASSIGNED_JOB, e, {k: "string"})
            raw = None
        stored = int(json.loads(raw).get("booked_until", 0)) if raw else 0
        if ahead_only and stored <= (self._unassigned_until or 0):
            return
        self._unassigned_until, self._unassigned_raw, self._unassigned_loaded = stored, raw, True

    def _book_unassigned(self, local: tuple[np.ndarray, ...]) -> None:
        """Observed time of this node's GPUs outside every job's hold, into the `_unassigned`
        ledger, `unassigned_hold_s` behind the newest sample (a late register still wins it)."""
        gpu, ts, p, _u, e = local
        if ts.size == 0:
            return
        if not self._unassigned_loaded:
            self._load_unassigned()
        order = np.lexsort((ts, gpu))
        g, t, pw, en = gpu[order], ts[order], p[order], e[order]
        interval = bands_mod.sampling_interval_ms(g, t)
        # Held back for late registers, except at shutdown and after a replay's last sample (a
        # register that comes later starts at this watermark: booked once either way). Then no
        # later sample comes: the newest sample's slice is one interval, as the offline replay
        # counts it, and the physical time ends there.
        final = self._no_more_samples
        if final:
            horizon = int(t.max()) + interval
        else:
            horizon = int(t.max()) - interval - int(self.cfg.unassigned_hold_s * 1000)
        lo = self._unassigned_until
        assert lo is not None  # _load_unassigned() set it
        if horizon <= lo:
            self.unassigned_settled = final
            return
        n_g = int(g.max()) + 1
        claims = [
            (gg, a, b)
            for j in self.jobs.values()
            for r, gg in j.own.items()
            if gg < n_g
            for a, b in j.held(r)
        ]
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
        lanes = self._lanes(list(range(n_g)))
        pieces = Pieces(
            s.gpu[keep],
            s.start_ms[keep],
            s.end_ms[keep],
            s.band[keep],
            np.full(int(keep.sum()), Category.UNASSIGNED, np.int8),
            s.energy_mj[keep],
            None if lanes is None else lanes[s.gpu[keep]],
        )
        by_bucket = buckets.amounts(pieces, self.cfg.prices)
        # the price table that costed it, as for a job's buckets (FOCUS reads its unit price there)
        version = buckets.price_version(self.cfg.prices)
        wm = {
            "booked_until": horizon,
            "agent": self.cfg.agent_id,
            "host": self.host,
            "instance": self._instance,
            "updated": time.time(),
        }
        try:
            self._unassigned_raw = ledger.commit(
                self.redis,
                self.cfg.prefix,
                ledger.UNASSIGNED_JOB,
                self.cfg.agent_id,
                self._unassigned_raw,
                wm,
                lambda pipe: ledger.queue_amounts(
                    pipe, self.cfg.prefix, ledger.UNASSIGNED_JOB, by_bucket, version
                ),
            )
        except ledger.Conflict as e:
            self._conflict(ledger.UNASSIGNED_JOB, e)
            self._unassigned_loaded = False
            return
        self._unassigned_until = horizon
        self.unassigned_settled = final

    def _remote_liveness(self, job: _Job) -> tuple[np.ndarray, np.ndarray, bool]:
        """(ranks that hold the horizon back, ranks to ignore, whether to wait this round).

        Another host's samples come once a round. Its ranks hold the horizon back while the host
        has published within `peer_timeout_s`, counted from its last entry or from when this
        agent's Redis came back (after an outage every host looks stale for a while). A host that
        has registered ranks but published nothing yet makes the round wait, within that time.
        """
        grace = self.cfg.peer_timeout_s or max(6 * self.cfg.book_interval_s, 30.0)
        now = time.monotonic()
        hold, ignore, wait = [], [], False
        for host, ranks in job.peer_hosts.items():
            since = max(job.remote_seen.get(host, 0.0), self._redis_back_at, self._started_at)
            if now - since <= grace:
                if host in job.remote_seen:
                    hold += ranks
                else:
                    wait = True
            else:
                ignore += ranks
        return np.asarray(hold, np.int64), np.asarray(ignore, np.int64), wait

    def _progress(self, job: _Job, tl, now_ms: int) -> dict:
        """What the alert rules need at the agent's data time: the last progress point (a
        timestamp that never moves back, unlike a step number after a resume), whether the job
        is inside a declared phase or its startup within the allowance, and its budget."""
        last = tl.steps[-1].ts_ms if tl.steps else tl.start_ms
        in_allowance = tl.regime_at(now_ms) == Regime.OVERHEAD
        budget = job.meta.get("budget")
        try:
            budget = float(budget) if budget not in (None, "") else None
        except (TypeError, ValueError):
            budget = None
        return {
            "last_progress_ts": last / 1000,
            "in_allowance": int(in_allowance and tl.end_ms is None),
            "budget": budget,
        }

    def _publish_live(
        self, job: _Job, rank: np.ndarray, ts: np.ndarray, p: np.ndarray, u: np.ndarray, profile: Profile
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
                return BANDS[job.latest_band[r]]
            return BANDS[int(bands_mod.reading_bands(np.asarray([pw]), np.asarray([ut]), profile)[0])]

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
    def _state_bytes(job: _Job) -> int:
        """About what the agent holds for a job's booking: its folded timeline, the events
        waiting to be folded and the rollback index entries in memory."""
        n = job.fold.state_bytes() if job.fold is not None else 0
        return n + 700 * len(job.fresh) + 400 * len(job.state.rb_index) + 16 * len(job.state.rb_applied)

    def snapshot(self) -> dict:
        now = time.monotonic()
        with self.lock:
            pending = int(self._local[0][0].size) if self._local else 0
            return {
                "pending": pending,
                "host": self.host,
                "agent": self.cfg.agent_id,
                "currency": self.cfg.prices.currency,
                "redis_up": self.redis_up,
                "id_refused": self.id_refused,
                "gpus": self.source.gpus(),
                "latest": self.sampler.latest(),
                "gpu_bands": dict(self._gpu_band),
                "live_seq": self.live_seq,
                "errors": dict(self.source.errors),
                "stats": dict(self.stats),
                "dropped": self.sampler.dropped,
                "clock_steps": dict(self.sampler.clock.steps) if self.sampler.clock else {},
                "clock_offset_s": self.sampler.clock.offset_s if self.sampler.clock else 0.0,
                "registrations_rejected": dict(self.registrations_rejected),
                "meta_ignored": dict(self.meta_ignored),
                "data_rejected": dict(self.refusals.counts),
                "round_counts": list(self.round_counts),
                "round_sum": self.round_sum,
                "jobs": {
                    name: {
                        "own": dict(j.own),
                        "booked": j.state.booked.copy(),
                        "voided": j.state.voided.copy(),
                        "figures": dict(j.figures),
                        "meta": dict(j.meta),
                        "latest_band": dict(j.latest_band),
                        "booked_until": j.booked_until,
                        "at_risk_ms": j.live.get("at_risk_ms", j.at_risk_ms),
                        "since_cost": j.live.get("since_cost", j.state.since_cost),
                        "done": j.done,
                        "rejected": {
                            k.split(":", 1)[1]: n
                            for k, n in j.reader.stats.items()
                            if k.startswith("rejected:")
                        },
                        "clock_skew_s": j.skew_s,
                        "state_bytes": self._state_bytes(j),
                    }
                    for name, j in self.jobs.items()
                    if j.own and (j.done_at is None or now - j.done_at < self.cfg.series_ttl_s)
                },
            }


class _Layout:
    """The keyspace's layout as this agent found it: legacy keys are moved before the first round
    books anything (`migrate.ensure`), retried every RETRY_S while agents of the old version
    still run; afterwards, every FORWARD_S, what trainers of the old version still write is
    forwarded (`migrate.forward`)."""

    RETRY_S = 5.0
    FORWARD_S = 5.0

    def __init__(self) -> None:
        self.ready = False
        self.forwarding = True
        self.next_at = 0.0

    def check(self, client, prefix: str) -> None:
        """Raises LayoutPending while the agent must not book; a Redis error as any round's."""
        now = time.monotonic()
        if not self.ready:
            if now < self.next_at:  # old agents ran at the last look
                raise migrate.LayoutPending
            if not migrate.ensure(client, prefix):
                self.next_at = now + self.RETRY_S
                raise migrate.LayoutPending
            self.ready = True
            self.next_at = now + self.FORWARD_S
        elif now >= self.next_at:
            self.next_at = now + self.FORWARD_S
            if self.forwarding:
                self.forwarding = migrate.forward_quietly(client, prefix)
