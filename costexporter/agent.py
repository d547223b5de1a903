"""The per-node agent behind `costexporter serve`: sample, book exactly once, expose metrics.

Each round (`book_interval_s`) the agent
  1. drains its sampler (the node's GPUs, read on a background thread);
  2. finds the jobs its GPUs belong to (`<p>:jobs`, each job's `:ranks` registrations);
  3. shares its samples with the job's other agents (`:samples:<host>` streams) and reads
     theirs, so cross-rank signatures see every rank;
  4. books the decided part of each job's time for its own GPUs (`live.book_window`) and
     writes the amounts, the rollback corrections, the job-level figures, the incidents and
     its watermark in one MULTI/EXEC per job.
While Redis is unreachable nothing is booked: samples wait (bounded, counted) and are booked
when it is back; the events the trainers buffered meanwhile arrive too, so an outage never
looks like a stall. A transaction whose reply was lost is resolved by re-reading the watermark.
"""

from __future__ import annotations

import collections
import json
import logging
import socket
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from . import bands as bands_mod
from . import ledger, profiles, protocol
from .booking import POS_INF, BookingConfig, Pieces, Regime, StepRecord, _cut_per_gpu, make_slices
from .cost import Prices
from .live import book_window
from .model import BANDS, CATEGORIES, VALID_CATEGORIES, WASTED_CATEGORIES, Category, Event
from .profiles import Profile
from .reader import EventReader
from .sources.base import GpuSource
from .sources.sampler import Sampler

log = logging.getLogger("costexporter.agent")

VALID = sorted(int(c) for c in VALID_CATEGORIES)
N_CAT = len(Category)
SAMPLES_MAXLEN = 5000  # entries per host sample stream (one entry per round)


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
    job_refresh_s: float = 10.0
    live_ttl_s: int = 30
    max_buffered_samples: int = 2_000_000
    series_ttl_s: float = 3600.0  # an ended job's series disappear from /metrics this long after
    # How long another agent of a job may stay silent before its ranks stop holding the booking
    # horizon back (default: max(6 rounds, 30 s)). Too short books moments without its samples,
    # and booked time is never re-booked; too long only delays booking.
    peer_timeout_s: float | None = None
    profile: Profile | None = None
    gpu_model: str | None = None
    power_limit_w: float | None = None


@dataclass
class _Job:
    name: str
    reader: EventReader
    events: list[Event] = field(default_factory=list)
    meta: dict = field(default_factory=dict)  # the job's meta events folded, last write wins
    preflight: str = ""  # JSON of the latest pre-run gate result
    ranks: dict[int, dict] = field(default_factory=dict)  # rank -> register entry
    own: dict[int, int] = field(default_factory=dict)  # rank -> source GPU index
    booked_until: int = 0
    cum: np.ndarray = field(default_factory=lambda: np.zeros((N_CAT, 3), np.int64))  # valid, booked so far
    booked: np.ndarray = field(default_factory=lambda: np.zeros((N_CAT, 3), np.int64))  # all, by this agent
    voided: np.ndarray = field(default_factory=lambda: np.zeros((N_CAT, 3), np.int64))
    rb_index: dict[int, list] = field(default_factory=dict)  # step record -> cum (flattened)
    rb_applied: set[int] = field(default_factory=set)
    incidents: dict[str, dict] = field(default_factory=dict)  # category -> the open incident
    remote: list = field(default_factory=list)  # chunks of (rank, ts, p, u, e) from other hosts
    remote_ids: dict[str, str] = field(default_factory=dict)
    remote_seen: dict[str, float] = field(default_factory=dict)  # host -> monotonic time of its last entry
    published_ts: dict[int, int] = field(default_factory=dict)  # rank -> newest ts published
    loaded: bool = False
    figures: dict = field(default_factory=dict)
    latest_band: dict[int, int] = field(default_factory=dict)  # rank -> band
    at_risk_ms: int = 0
    done: bool = False
    done_at: float | None = None  # monotonic time when the job was booked to its end
    since_ref_ms: int = -1  # the last progress point ...
    since_cost: int = 0  # ... and this agent's cost (micro-units) booked after it


class Agent:
    def __init__(self, source: GpuSource, cfg: AgentConfig) -> None:
        import redis

        self.source = source
        self.cfg = cfg
        self.host = cfg.host or source.host
        self.redis = protocol.connect(cfg.redis_url)
        self._redis_errors = (redis.RedisError, OSError)
        self.sampler = Sampler(source, cfg.sample_interval_s)
        self.jobs: dict[str, _Job] = {}
        self.context_ms = int((cfg.context_s or 2 * cfg.booking.checkpoint_allowance_s + 60) * 1000)
        self._local: list[tuple] = []  # chunks of (gpu, ts, p, u, e) read from this node
        self._last_refresh = 0.0
        self._unassigned_until: int | None = None
        self._started_at = time.monotonic()
        self._redis_back_at = 0.0
        self.redis_up = False
        self.stats: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()
        self._stop = threading.Event()

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> Agent:
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

    def shutdown(self) -> None:
        self.sampler.stop()
        self.tick()
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

    # ---- one round -----------------------------------------------------------------------
    def tick(self) -> None:
        readings = self.sampler.drain()
        if readings:
            self._local.append(
                (
                    np.fromiter((r.gpu for r in readings), np.int64, len(readings)),
                    np.fromiter((round(r.ts * 1000) for r in readings), np.int64, len(readings)),
                    np.fromiter((r.power_w for r in readings), np.float64, len(readings)),
                    np.fromiter((r.util_pct for r in readings), np.float64, len(readings)),
                    np.fromiter((r.energy_mj for r in readings), np.float64, len(readings)),
                )
            )
        local = self._local_arrays()
        try:
            if time.monotonic() - self._last_refresh > self.cfg.job_refresh_s or not self.jobs:
                self._discover()
            if not self.redis_up:
                self._redis_back_at = time.monotonic()
            for job in list(self.jobs.values()):
                if job.own:
                    self._book(job, local)
            self._book_unassigned(local)
            self._publish_node()
            self.redis_up = True
        except self._redis_errors as e:
            if self.redis_up or not self.stats["redis_errors"]:
                log.warning("Redis unreachable (%s): holding samples until it is back", e)
            self.redis_up = False
            self.stats["redis_errors"] += 1
            self._unassigned_until = None
            for job in self.jobs.values():
                job.loaded = False  # the last write may or may not have landed: re-read the watermark
        except Exception:  # a bug or an input nobody foresaw: log it, count it, keep the daemon up
            log.exception("booking round failed; nothing of it was written")
            self.stats["round_errors"] += 1
            for job in self.jobs.values():
                job.loaded = False
        self._trim(local)

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
        k = ledger.node_key(self.cfg.prefix, self.host)
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
            (j.booked_until - self.context_ms for j in self.jobs.values() if j.own and not j.done),
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
    def _discover(self) -> None:
        """Jobs whose registered GPUs are this node's (by UUID, else host + index)."""
        self._last_refresh = time.monotonic()
        gpus = self.source.gpus()
        by_uuid = {g.uuid: i for i, g in enumerate(gpus) if g.uuid}
        by_index = {(g.host, g.index): i for i, g in enumerate(gpus)}
        for name in self.redis.zrange(protocol.jobs_key(self.cfg.prefix), 0, -1):
            ranks = self.redis.hgetall(protocol.ranks_key(self.cfg.prefix, name))
            job = self.jobs.get(name)
            for rank_s, raw in ranks.items():
                try:
                    entry = json.loads(raw)
                    rank = int(rank_s)
                except ValueError:
                    continue
                g = by_uuid.get(entry.get("gpu_uuid")) if entry.get("gpu_uuid") else None
                if g is None and entry.get("gpu") not in (None, ""):
                    g = by_index.get((entry.get("host"), int(entry["gpu"])))
                if g is None and not job:
                    continue
                if job is None:
                    job = self.jobs[name] = _Job(name, EventReader(self.redis, name, prefix=self.cfg.prefix))
                old = job.ranks.get(rank)
                if old is not None and "ts" in old:  # a restart registers again: the GPU is the job's
                    # from the rank's first registration on (the hash keeps only the newest)
                    entry = {**entry, "ts": min(float(old["ts"]), float(entry.get("ts", old["ts"])))}
                job.ranks[rank] = entry
                if g is not None:
                    job.own[rank] = g

    def _load(self, job: _Job) -> None:
        """The job's state as the ledger has it (at start, and after an uncertain write)."""
        wm = ledger.load_watermark(self.redis, self.cfg.prefix, job.name, self.cfg.agent_id) or {}
        job.booked_until = int(wm.get("booked_until", 0))
        for k in ("cum", "booked", "voided"):
            setattr(job, k, np.asarray(wm.get(k, np.zeros((N_CAT, 3), np.int64).tolist()), np.int64))
        job.rb_applied = set(wm.get("rb_applied", []))
        job.incidents = wm.get("incidents_open", {})
        raw = self.redis.hgetall(ledger.key(self.cfg.prefix, job.name, "ledger", "rbidx", self.cfg.agent_id))
        job.rb_index = {int(k): json.loads(v) for k, v in raw.items()}
        job.loaded = True

    def _remote_samples(self, job: _Job) -> None:
        for host in {str(e.get("host")) for r, e in job.ranks.items() if r not in job.own}:
            if host == self.host:
                continue
            k = ledger.key(self.cfg.prefix, job.name, "samples", host)
            last = job.remote_ids.get(host, "-")
            entries = self.redis.xrange(k, min=f"({last}" if last != "-" else "-", count=10_000)
            if entries:
                job.remote_seen[host] = time.monotonic()
            for entry_id, f in entries:
                job.remote_ids[host] = entry_id
                try:
                    job.remote.append(
                        tuple(
                            np.asarray(json.loads(f[c]), dt)
                            for c, dt in (
                                ("r", np.int64),
                                ("t", np.int64),
                                ("p", np.float64),
                                ("u", np.float64),
                                ("e", np.float64),
                            )
                        )
                    )
                except (KeyError, ValueError):
                    self.stats["bad_sample_entries"] += 1

    def _book(self, job: _Job, local: tuple[np.ndarray, ...]) -> None:
        cfg = self.cfg
        if not job.loaded:
            self._load(job)
        new_events = job.reader.poll(count=100_000)
        job.events += new_events
        for ev in new_events:  # fold meta and the gate's result as they arrive, not every round
            if ev.type == "meta":
                job.meta.update({k: v for k, v in ev.fields.items() if not k.startswith("_")})
            elif ev.type == "preflight":
                job.preflight = json.dumps(
                    {"passed": ev.get("passed"), "checks": ev.get("checks"), "ts": ev.ts}
                )
        self._remote_samples(job)

        # This agent's samples of the job's GPUs, as ranks.
        gpu, ts, p, u, e = local
        rank_of_gpu = {g: r for r, g in job.own.items()}
        lut = np.full(max([*job.own.values(), int(gpu.max(initial=-1))]) + 1, -1, np.int64)
        for g, r in rank_of_gpu.items():
            lut[g] = r
        mine = lut[gpu] >= 0 if gpu.size else np.zeros(0, bool)
        own_rank, own_ts = lut[gpu[mine]], ts[mine]
        # Share the new ones with the job's other agents.
        new = own_ts > np.asarray([job.published_ts.get(int(r), -1) for r in own_rank], np.int64)
        if new.any():
            entry = {
                "r": own_rank[new].tolist(),
                "t": own_ts[new].tolist(),
                "p": p[mine][new].tolist(),
                "u": u[mine][new].tolist(),
                "e": e[mine][new].tolist(),
            }
            self.redis.xadd(
                ledger.key(cfg.prefix, job.name, "samples", self.host),
                {k: json.dumps(v).replace("NaN", "null") for k, v in entry.items()},
                maxlen=SAMPLES_MAXLEN,
                approximate=True,
            )
            for r in np.unique(own_rank[new]).tolist():
                job.published_ts[r] = int(own_ts[new][own_rank[new] == r].max())

        chunks = [(own_rank, own_ts, p[mine], u[mine], e[mine]), *job.remote]
        R, T, P, U, E = (np.concatenate(c) for c in zip(*chunks, strict=True))
        P = np.where(np.isfinite(P), P, np.nan)
        E = np.where(np.isfinite(E), E, np.nan)
        window = job.booked_until - self.context_ms <= T
        R, T, P, U, E = (a[window] for a in (R, T, P, U, E))
        # Other hosts' samples stay only as long as the window needs them.
        remote = ~np.isin(R, list(job.own))
        job.remote = [tuple(a[remote] for a in (R, T, P, U, E))]
        order = np.lexsort((T, R))
        R, T, P, U, E = (a[order] for a in (R, T, P, U, E))
        if T.size == 0:
            return
        own_ranks = np.asarray(sorted(job.own), np.int64)
        reg_ts = {r: int(float(job.ranks[r].get("ts", 0)) * 1000) for r in job.ranks}
        job_start = min(reg_ts.values())
        if job.booked_until == 0:
            job.booked_until = job_start
        member_start = np.asarray([reg_ts[r] for r in own_ranks], np.int64)
        meta = job.meta
        profile = cfg.profile or profiles.select(
            cfg.gpu_model
            or meta.get("gpu_model")
            or next((g.name for g in self.source.gpus() if g.name), None),
            cfg.power_limit_w or next((g.power_limit_w for g in self.source.gpus() if g.power_limit_w), None),
        )
        n_ranks = int(max(max(job.ranks), int(R.max()))) + 1
        hold, ignore, wait = self._remote_liveness(job)
        if wait:
            return
        now_ms = int(own_ts.max()) if own_ts.size else int(T.max())
        now_ms -= int(self.source.event_lag_s * 1000)  # events still on their way (a sim at --speed)
        res = book_window(
            events=job.events,
            cfg=cfg.booking,
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
        )
        job.latest_band = {int(own_ranks[i]): b for i, b in res.latest_band.items()}
        self._publish_live(job, own_rank, own_ts, p[mine], u[mine])
        tl = res.timeline
        progress = self._progress(job, tl, now_ms)
        with self.lock:
            job.figures = {**job.figures, **progress}
        if res.horizon_ms <= job.booked_until:
            return
        price = float(meta.get("price_per_gpu_hour") or cfg.prices.price_per_gpu_hour)
        version = ledger.price_version(cfg.prices, price)
        by_bucket = ledger.amounts(res.pieces, cfg.prices, price)
        booked = sum(by_bucket.values(), np.zeros((N_CAT, 3), np.int64))

        # Rollback index: cumulative valid amounts at each step record booked this round.
        cum = job.cum.copy()
        index_new: dict[int, list] = {}
        valid_pieces = np.isin(res.pieces.category, VALID)
        vp_start, vp_end = res.pieces.start_ms[valid_pieces], res.pieces.end_ms[valid_pieces]
        vp_cat, vp_mj = res.pieces.category[valid_pieces], res.pieces.energy_mj[valid_pieces]
        for i, rec in enumerate(tl.steps):
            if job.booked_until < rec.ts_ms <= res.horizon_ms and i not in job.rb_index:
                upto = np.clip(np.minimum(vp_end, rec.ts_ms) - vp_start, 0, None)
                frac = np.divide(upto, vp_end - vp_start, out=np.zeros(upto.size), where=vp_end > vp_start)
                part = self._valid_amounts(vp_cat, upto, vp_mj * frac, price)
                index_new[i] = (cum + part).ravel().tolist()
        valid_now = self._valid_amounts(vp_cat, vp_end - vp_start, vp_mj, price)
        new_cum = cum + valid_now

        # Resumes: valid amounts already booked in steps that are now voided move to rolled_back.
        index = {**job.rb_index, **index_new}
        corrections = np.zeros((N_CAT, 3), np.int64)
        applied = set(job.rb_applied)
        for i, rec in enumerate(tl.steps):
            if not rec.voided or i in applied:
                continue
            applied.add(i)
            corrections += self._voided_part(i, tl.steps, index, new_cum, job.booked_until, job_start)
        moved = corrections.copy()
        rolled = np.zeros((N_CAT, 3), np.int64)
        rolled[Category.ROLLED_BACK] = moved[VALID].sum(0)

        incidents = self._incidents(job, res)
        figures = {
            **self._figures(job, tl, res.horizon_ms, own_ranks, member_start),
            **progress,
            "profile": profile.name,
            "profile_calibrated": int(profile.calibrated),
            # The profile's band edges, for the dashboard's power thresholds.
            "band_idle_max_w": profile.idle_max_w,
            "band_low_max_w": profile.low_max_w,
            "band_compute_min_w": profile.compute_min_w,
        }
        since_ref = int(progress["last_progress_ts"] * 1000)
        since_cost = (job.since_cost if since_ref == job.since_ref_ms else 0) + self._cost_after(
            res.pieces, since_ref, price
        )
        wm = {
            "booked_until": res.horizon_ms,
            "cum": new_cum.tolist(),
            "booked": (job.booked + booked + rolled).tolist(),
            "voided": (job.voided + moved).tolist(),
            "rb_applied": sorted(applied),
            "incidents_open": incidents,
            "agent": cfg.agent_id,
            "host": self.host,
            "updated": time.time(),
        }

        pipe = self.redis.pipeline(transaction=True)
        ledger.queue_amounts(pipe, cfg.prefix, job.name, by_bucket, version)
        if moved.any():
            bucket = res.horizon_ms // 1000 // 300 * 300  # booked in the bucket where the resume is seen
            ledger.queue_amounts(pipe, cfg.prefix, job.name, {bucket: moved}, version, field_prefix="voided:")
            ledger.queue_amounts(pipe, cfg.prefix, job.name, {bucket: rolled}, version)
        if index_new:
            pipe.hset(
                ledger.key(cfg.prefix, job.name, "ledger", "rbidx", cfg.agent_id),
                mapping={str(k): json.dumps(v) for k, v in index_new.items()},
            )
        ledger.queue_incidents(pipe, cfg.prefix, job.name, cfg.agent_id, incidents.values())
        pipe.hset(
            ledger.key(cfg.prefix, job.name, "ledger", "job"),
            mapping={k: v for k, v in figures.items() if v is not None},
        )
        ledger.queue_steps(
            pipe, cfg.prefix, job.name, tl.steps, job.booked_until, res.horizon_ms, applied - job.rb_applied
        )
        pipe.set(ledger.key(cfg.prefix, job.name, "wm", cfg.agent_id), json.dumps(wm))
        pipe.execute()

        with self.lock:
            job.booked_until = res.horizon_ms
            job.cum = new_cum
            job.booked = job.booked + booked + rolled
            job.voided = job.voided + moved
            job.rb_index = index
            job.rb_applied = applied
            job.incidents = incidents
            job.figures = figures
            job.since_ref_ms, job.since_cost = since_ref, since_cost
            job.done = tl.end_ms is not None and res.horizon_ms >= tl.end_ms
            if job.done and job.done_at is None:
                job.done_at = time.monotonic()
        self.stats["rounds"] += 1

    def _book_unassigned(self, local: tuple[np.ndarray, ...]) -> None:
        """Observed time of this node's GPUs that no job holds, into the `_unassigned` ledger."""
        gpu, ts, p, _u, e = local
        if ts.size == 0:
            return
        held = {g for j in self.jobs.values() for g in j.own.values()}
        free = ~np.isin(gpu, list(held)) if held else np.ones(gpu.size, bool)
        if not free.any():
            return
        job = ledger.UNASSIGNED_JOB
        k_wm = ledger.key(self.cfg.prefix, job, "wm", self.cfg.agent_id)
        if self._unassigned_until is None:
            wm = ledger.load_watermark(self.redis, self.cfg.prefix, job, self.cfg.agent_id) or {}
            self._unassigned_until = int(wm.get("booked_until", 0))
        order = np.lexsort((ts[free], gpu[free]))
        g, t, pw, en = gpu[free][order], ts[free][order], p[free][order], e[free][order]
        interval = bands_mod.sampling_interval_ms(g, t)
        horizon = int(t.max()) - interval
        lo = self._unassigned_until
        if horizon <= lo:
            return
        n_g = int(g.max()) + 1
        none = np.full(n_g, POS_INF, np.int64)
        s = make_slices(
            g, t, pw, en, np.zeros(t.size, np.int8), n_g, interval, none, none, self.cfg.booking.gap_intervals
        )
        s = _cut_per_gpu(s, np.repeat(np.arange(n_g), 2), np.tile([lo, horizon], n_g))
        keep = (s.start_ms >= lo) & (s.end_ms <= horizon)
        pieces = Pieces(
            s.gpu[keep],
            s.start_ms[keep],
            s.end_ms[keep],
            s.band[keep],
            np.full(int(keep.sum()), Category.UNASSIGNED, np.int8),
            s.energy_mj[keep],
        )
        by_bucket = ledger.amounts(pieces, self.cfg.prices, self.cfg.prices.price_per_gpu_hour)
        pipe = self.redis.pipeline(transaction=True)
        ledger.queue_amounts(pipe, self.cfg.prefix, job, by_bucket, "unassigned")
        pipe.set(k_wm, json.dumps({"booked_until": horizon, "agent": self.cfg.agent_id, "host": self.host}))
        pipe.execute()
        self._unassigned_until = horizon

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
        hosts: dict[str, list[int]] = {}
        for r, e in job.ranks.items():
            if r not in job.own:
                hosts.setdefault(str(e.get("host")), []).append(r)
        for host, ranks in hosts.items():
            since = max(job.remote_seen.get(host, 0.0), self._redis_back_at, self._started_at)
            if now - since <= grace:
                if host in job.remote_seen:
                    hold += ranks
                else:
                    wait = True
            else:
                ignore += ranks
        return np.asarray(hold, np.int64), np.asarray(ignore, np.int64), wait

    def _valid_amounts(self, cat: np.ndarray, ms: np.ndarray, mj: np.ndarray, price: float) -> np.ndarray:
        a = np.zeros((N_CAT, 3), np.int64)
        ms_c = np.bincount(cat, weights=ms, minlength=N_CAT)
        mj_c = np.bincount(cat, weights=mj, minlength=N_CAT)
        cost = self.cfg.prices.cost(ms_c, mj_c, np.arange(N_CAT), price_per_gpu_hour=price)
        a[:, 0] = np.round(ms_c)
        a[:, 1] = np.round(mj_c)
        a[:, 2] = np.round(cost * 1e6)
        a[[c for c in range(N_CAT) if c not in VALID]] = 0
        return a

    @staticmethod
    def _voided_part(
        i: int, steps: list[StepRecord], index: dict, cum_now: np.ndarray, booked_until: int, job_start: int
    ) -> np.ndarray:
        """Valid amounts this agent already booked inside step record i's interval."""
        prev_ts = steps[i - 1].ts_ms if i > 0 else job_start
        if prev_ts >= booked_until:
            return np.zeros((N_CAT, 3), np.int64)  # nothing of it was booked yet: it books VOID later
        prev = np.asarray(index[i - 1], np.int64).reshape(N_CAT, 3) if i > 0 and i - 1 in index else 0
        cur = np.asarray(index[i], np.int64).reshape(N_CAT, 3) if i in index else cum_now
        return np.clip(cur - prev, 0, None)

    def _incidents(self, job: _Job, res) -> dict[str, dict]:
        """Extend or open this agent's incidents with this round's wasted stretches."""
        open_ = {k: dict(v) for k, v in job.incidents.items()}
        p = res.pieces
        tol = 2 * int(self.cfg.booking.grid_s * 1000) + int(self.cfg.sample_interval_s * 2000)
        for c in sorted(WASTED_CATEGORIES):
            sel = p.category == c
            if not sel.any():
                continue
            name = CATEGORIES[c]
            s, e = int(p.start_ms[sel].min()), int(p.end_ms[sel].max())
            ranks = sorted({sorted(job.own)[g] for g in np.unique(p.gpu[sel]).tolist()})
            ms = int((p.end_ms[sel] - p.start_ms[sel]).sum())
            cur = open_.get(name)
            if cur is not None and s <= cur["end"] + tol:
                cur["end"] = max(cur["end"], e)
                cur["gpu_ms"] += ms
                cur["ranks"] = sorted(set(cur["ranks"]) | set(ranks))
            else:
                open_[name] = {
                    "category": name,
                    "start": s,
                    "end": e,
                    "gpu_ms": ms,
                    "ranks": ranks,
                    "host": self.host,
                }
        return open_

    def _cost_after(self, pieces, ref_ms: int, price: float) -> int:
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
        cost = self.cfg.prices.cost((end - start).astype(float), mj, cat, price_per_gpu_hour=price)
        return round(float(np.sum(cost)) * 1e6)

    def _progress(self, job: _Job, tl, now_ms: int) -> dict:
        """What the alert rules need at the agent's data time: the last progress point (a
        timestamp that never moves back, unlike a step number after a resume), whether the job
        is inside a declared phase or its startup within the allowance, and its budget."""
        last = tl.steps[-1].ts_ms if tl.steps else tl.start_ms
        i = int(np.searchsorted(tl.bounds, now_ms - 1, "right")) - 1
        in_allowance = 0 <= i < tl.regime.size and int(tl.regime[i]) == Regime.OVERHEAD
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

    def _figures(self, job: _Job, tl, horizon: int, own_ranks: np.ndarray, member_start: np.ndarray) -> dict:
        """Job-level figures: the same for every agent that reads the job's events (SET, not added)."""
        steps = tl.steps
        valid = [s for s in steps if not s.voided]
        last = steps[-1] if steps else None
        since = tl.last_checkpoint_ms if tl.last_checkpoint_ms is not None else None
        job.at_risk_ms = int(sum(max(0, horizon - max(int(ms), since or int(ms))) for ms in member_start))
        return {
            "steps_completed": len(steps),
            "steps_voided": len(steps) - len(valid),
            "valid_steps": len(valid),
            "tokens": sum(s.tokens for s in valid),
            "last_step": last.step if last else -1,
            "last_step_ts": last.ts_ms / 1000 if last else 0,
            "last_checkpoint_step": tl.last_checkpoint_step if tl.last_checkpoint_step is not None else -1,
            "last_checkpoint_ts": (tl.last_checkpoint_ms or 0) / 1000,
            "stall_threshold_s": tl.stall_threshold_ms / 1000,
            "ended": int(tl.end_ms is not None),
            "preflight": job.preflight,
        }

    def _publish_live(
        self, job: _Job, rank: np.ndarray, ts: np.ndarray, p: np.ndarray, u: np.ndarray
    ) -> None:
        """Each GPU's newest band, power and utilization, for the watcher and the cross-rank view."""
        if rank.size == 0:
            return
        last = {}
        for r, t, pw, ut in zip(rank.tolist(), ts.tolist(), p.tolist(), u.tolist(), strict=True):
            if r not in last or t >= last[r][0]:
                last[r] = (t, pw, ut)
        k = ledger.key(self.cfg.prefix, job.name, "live", self.host)
        mapping = {
            str(r): json.dumps(
                {
                    "ts": t / 1000,
                    "power_w": pw,
                    "util_pct": ut,
                    "band": BANDS[job.latest_band[r]] if r in job.latest_band else None,
                }
            )
            for r, (t, pw, ut) in last.items()
        }
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(k, mapping=mapping)
        pipe.expire(k, self.cfg.live_ttl_s)
        pipe.execute()

    # ---- for the exporter --------------------------------------------------------------------
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
                "gpus": self.source.gpus(),
                "latest": self.sampler.latest(),
                "errors": dict(self.source.errors),
                "stats": dict(self.stats),
                "dropped": self.sampler.dropped,
                "jobs": {
                    name: {
                        "own": dict(j.own),
                        "booked": j.booked.copy(),
                        "voided": j.voided.copy(),
                        "figures": dict(j.figures),
                        "meta": dict(j.meta),
                        "latest_band": dict(j.latest_band),
                        "booked_until": j.booked_until,
                        "at_risk_ms": j.at_risk_ms,
                        "since_cost": j.since_cost,
                        "done": j.done,
                    }
                    for name, j in self.jobs.items()
                    if j.own and (j.done_at is None or now - j.done_at < self.cfg.series_ttl_s)
                },
            }
