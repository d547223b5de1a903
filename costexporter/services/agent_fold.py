"""A job's events as one agent reads and folds them, and its fold kept in the store.

The agent reads each job's new events a round, folds the walk-relevant ones into the job's
timeline (`core/fold.py`) and stores the fold with its watermark (same MULTI) now and then, so
a restarted agent resumes from it and reads only the stream since. An event older than the fold
refolds the job once, from an older stored fold when one covers it, else from the stream. After
a commit, the stream is trimmed below its readers' oldest position.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from costexporter.core import jobfacts, live
from costexporter.core.booking import Timeline, build_timeline, dated_until
from costexporter.core.fold import FoldFormatError, TimelineFold, dump_fold, load_fold, walk_relevant
from costexporter.core.live import JobState
from costexporter.core.model import Event
from costexporter.core.terms import JobTerms
from costexporter.core.timeutil import to_ms
from costexporter.services.agent_context import AgentContext, KeyGuard
from costexporter.services.agent_job import AgentJob
from costexporter.store import ledger, untrusted
from costexporter.store.client import Pipeline
from costexporter.store.keys import fold_key, rbidx_key, readers_key, watermark_key
from costexporter.store.reader import EventReader


@dataclass(frozen=True)
class FoldWrite:
    """A fold to store with this round's commit, and the older one when it changes."""

    at: float  # data time (s)
    blob: str
    old: tuple[float, str, str] | None  # (data time, blob, stream position)


class JobFolds:
    """Reads a job's events, keeps its fold, and loads and stores both with its watermark."""

    def __init__(self, ctx: AgentContext, context_ms: int, guard: KeyGuard) -> None:
        self.redis = ctx.redis
        self.cfg = ctx.cfg
        self.context_ms = context_ms
        self.stats: collections.Counter[str] = collections.Counter()
        self._log_once = ctx.said
        self._guard = guard

    def _wm_key(self, job: AgentJob) -> str:
        return watermark_key(self.cfg.prefix, job.name, self.cfg.agent_id)

    # ---- the watermark and the stored fold, read ------------------------------------------
    def load(self, job: AgentJob) -> None:
        """The job's state as the ledger has it (at start, and after an uncertain write)."""
        raw = self.redis.get(self._wm_key(job))
        # The rollback index stays in Redis: a round reads the entries its voids need.
        job.state = JobState.from_json(json.loads(raw) if raw else {}, {})
        job.wm_raw = raw
        if job.restore or (not job.ever_loaded and job.fold is None and job.reader.cursor in ("0", "0-0")):
            job.restore = False
            self.restore(job)
        job.loaded = job.ever_loaded = True

    def stored_state(self, job: AgentJob) -> JobState:
        """The job's watermark as stored (an unreadable one: this agent's memory of it)."""
        raw = self.redis.get(self._wm_key(job))
        try:
            return JobState.from_json(json.loads(raw) if raw else {}, {})
        except (ValueError, TypeError, KeyError, AttributeError):
            return job.state

    def restore(self, job: AgentJob) -> None:
        """A (re)started agent resumes a job from the fold stored with its watermark: the reader
        goes on from where that fold had read. An unreadable one (an older format, corrupted,
        another booking configuration) is counted and logged once; the fold is then rebuilt from
        the stream."""
        cfg = self.cfg
        pos = self.redis.hget(readers_key(cfg.prefix, job.name), f"agent:{cfg.agent_id}")
        try:
            job.saved.old_at = float(json.loads(pos)["at"]) if pos else None
        except (ValueError, KeyError, TypeError):
            job.saved.old_at = None
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
        job.fresh, job.saved.candidates = [], []
        self.stats["fold_restores"] += 1

    def fetch_index(self, job: AgentJob, tl: Timeline) -> None:
        """The rollback index entries this round's voids read, from the agent's `rbidx` hash."""
        need = sorted(live.needed_index_entries(tl, job.state.rb_applied) - set(job.state.rb_index))
        if not need:
            return
        k = rbidx_key(self.cfg.prefix, job.name, self.cfg.agent_id)
        for i, v in zip(need, self.redis.hmget(k, [str(i) for i in need]), strict=True):
            if v is not None:
                job.state.rb_index[i] = json.loads(v)

    # ---- the job's events ---------------------------------------------------------------------
    def read_events(self, job: AgentJob, wall_clock: bool) -> None:
        """New events of the job; meta and the gate's result folded; rejections and clock skew
        made visible (`wall_clock`: the samples are read now, so arrival times mean something)."""
        new_events: list[Event] = []
        for _ in range(10):  # up to 100k entries a round, read 10k at a time (a backlog's memory)
            batch = job.reader.poll(count=10_000)
            new_events += batch
            job.fresh += [ev for ev in batch if walk_relevant(ev)]
            if batch:
                job.newest_event_ms = max(job.newest_event_ms, max(ev.ts_ms for ev in batch))
            if job.reader.last_read < 10_000:
                break
        for ev in new_events:  # fold meta and the gate's result as they arrive, not every round
            if ev.type == "meta":
                jobfacts.merge_meta(job.meta, ev)
            elif ev.type == "preflight":
                job.preflight = json.dumps(jobfacts.preflight_result(ev))
            elif ev.type == "register":
                earlier_register(job, ev)
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
        if wall_clock and offsets:
            self._note_skew(job, offsets)

    def _note_skew(self, job: AgentJob, offsets: dict[int, float]) -> None:
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

    # ---- the timeline -------------------------------------------------------------------------
    def _fold_batch(self, fold: TimelineFold, job: AgentJob, now_ms: int) -> Callable[[list[Event]], None]:
        """Folds a batch read from the stream, as far behind the newest event as a round folds."""
        lag = to_ms(self.cfg.fold_lag_s)
        keep_from = job.oldest_unbooked - self.context_ms - 60_000

        def fold_batch(batch: list[Event]) -> None:
            if batch and not fold.late:
                fold.add(batch)
                fold.advance(min(now_ms, max(e.ts_ms for e in batch)) - lag, keep_from)

        return fold_batch

    def _load_fold(self, raw: bytes | str, job: str) -> tuple[TimelineFold, dict[str, Any]]:
        """A stored fold of the job, folded with any of the booking configurations the
        operator's policy gives (the job's own is known once its meta is read: a fold of another
        is folded again then)."""
        data = base64.b64decode(raw, validate=True)
        error = FoldFormatError("no booking configuration")
        for booking in self.cfg.policy().bookings():
            try:
                return load_fold(data, booking, job)
            except FoldFormatError as e:
                error = e
        raise error

    def timeline(self, job: AgentJob, terms: JobTerms, now_ms: int, final: bool = False) -> Timeline:
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
        reader = EventReader(self.redis, job.name, prefix=self.cfg.prefix)
        reader.read_until(
            job.reader.cursor, count=10_000, keep=walk_relevant, on_batch=self._fold_batch(fold, job, now_ms)
        )
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

    def last_timeline(self, job: AgentJob, terms: JobTerms, now_ms: int) -> Timeline:
        """The timeline of what was read of the job so far, without reading its stream (it
        cannot be read): its fold's view, else an empty one from its start."""
        fold = job.fold
        if fold is None or fold.late or fold.start_ms != terms.start_ms or fold.cfg != terms.booking:
            fold = TimelineFold(terms.booking, terms.start_ms)
        tl = fold.timeline(now_ms, dated_until=True)
        return (
            tl if tl is not None else build_timeline([], terms.booking, terms.start_ms, now_ms, final=False)
        )

    def _refold_from_store(self, job: AgentJob, terms: JobTerms, now_ms: int, final: bool) -> Timeline | None:
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
        reader.read_until(
            job.reader.cursor, count=10_000, keep=walk_relevant, on_batch=self._fold_batch(fold, job, now_ms)
        )
        tl = fold.timeline(now_ms, final=final, dated_until=True)
        if tl is None:
            return None
        job.fold, job.fresh = fold, []
        self.stats["timeline_rebuilds_from_store"] += 1
        return tl

    def advance(self, job: AgentJob, now_ms: int) -> None:
        """Fold for good what lies far enough behind the data time and the events read."""
        if job.fold is not None:
            job.fold.advance(
                min(now_ms, job.newest_event_ms) - to_ms(self.cfg.fold_lag_s),
                job.oldest_unbooked - self.context_ms - 60_000,
            )

    # ---- the fold, stored with the commit ----------------------------------------------------
    def write_due(self, job: AgentJob, now_ms: int) -> FoldWrite | None:
        """The fold to store with this round's commit, if one is due (stored folds are dated by
        data time, what lateness is measured in)."""
        now = now_ms / 1000
        if not self._due(job, now):
            return None
        blob = self._dump(job)
        return FoldWrite(now, blob, self._old_fold(job, blob, now))

    def _due(self, job: AgentJob, now: float) -> bool:
        every = self.cfg.fold_persist_s
        if every is None or job.fold is None or job.fold.late or job.fresh:
            return False
        if job.reader.last_read >= 10_000:  # still catching up: store once at the stream's end
            return False
        saved_at = job.saved.saved_at
        return saved_at is None or not 0 <= now - saved_at < every

    def _old_fold(self, job: AgentJob, blob: str, now: float) -> tuple[float, str, str] | None:
        """The stored fold to keep as the older one from this commit on, if it changes: one at
        least `late_keep_s` old once none is stored or the stored one is twice that. Until then
        this agent registers no position, so the job's stream is kept whole: an export of a job
        in its first hour holds every step, as one of a longer job holds its last hour or two."""
        keep = self.cfg.late_keep_s
        cands = job.saved.candidates
        if not cands or now - cands[-1][0] >= keep / 4:
            cands.append((now, blob, job.reader.cursor))
        if job.saved.old_at is not None and now - job.saved.old_at < 2 * keep:
            return None
        ripe = [c for c in cands if now - c[0] >= keep]
        return ripe[-1] if ripe else None

    def _dump(self, job: AgentJob) -> str:
        extra = {
            "reader": job.reader.position(),
            "meta": job.meta,
            "preflight": job.preflight,
            "newest_event_ms": job.newest_event_ms,
        }
        assert job.fold is not None  # _due() checked
        return base64.b64encode(dump_fold(job.fold, job.name, extra)).decode()

    def queue(self, pipe: Pipeline, job: AgentJob, w: FoldWrite) -> None:
        """The fold (and the older one and this agent's stream position, when it changes), in the
        commit's MULTI: the stream is kept from the older fold's position on."""
        cfg = self.cfg
        pipe.set(fold_key(cfg.prefix, job.name, cfg.agent_id), w.blob)
        if w.old is not None:
            at, old_blob, cursor = w.old
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

    def stored(self, job: AgentJob, w: FoldWrite) -> None:
        """The commit that carried `w` landed: note it, then trim the job's stream."""
        job.saved.saved_at = w.at
        if w.old is not None:
            job.saved.old_at = w.old[0]
            job.saved.candidates = [c for c in job.saved.candidates if c[0] > w.old[0]]
        if self.cfg.trim_streams:
            self._trim_stream(job)

    def _trim_stream(self, job: AgentJob) -> None:
        """Trim the job's stream below its readers' oldest position (idempotent; errors counted)."""
        import redis

        try:
            n = ledger.trim_stream(
                self.redis, self.cfg.prefix, job.name, time.time(), self.cfg.reader_stale_s, set(job.ranks)
            )
        except redis.RedisError as e:
            if untrusted.is_wrong_type(e):  # a readers hash created as something else
                self._guard.wrong_type(job.name, e, job=job)
            self.stats["trim_errors"] += 1
            return
        if n < 0:  # another agent of the job has not stored its fold yet
            self.stats["trim_waiting"] += 1
            return
        self.stats["stream_entries_trimmed"] += n


def earlier_register(job: AgentJob, ev: Event) -> None:
    """The ranks hash keeps a rank's newest register only: a process that ran and ended
    before this agent read the hash (then ran again) is seen here, in the stream. The same
    GPU registered earlier dates the rank's start, as replay dates it, while its start is
    not fixed yet."""
    reg = job.ranks.get(ev.rank)
    if reg is None or ev.ts_ms >= reg.ts_ms or ev.rank in job.state.starts:
        return
    uuid_ = ev.get("gpu_uuid")
    same = (
        uuid_ == reg.gpu_uuid
        if uuid_ and reg.gpu_uuid
        else (ev.get("host") == reg.host and ev.get("gpu") == reg.gpu)
    )
    if same:
        job.ranks[ev.rank] = dataclasses.replace(reg, ts_ms=ev.ts_ms)
