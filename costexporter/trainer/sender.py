"""The reporter's queue and its sender thread: what the trainer's calls append to, and the
one thread that moves it out, to Redis (`transport.send_entries`) or, while Redis cannot take
it, to the spool on local disk (`spool.SpoolFile`), sending the spool once Redis is back, its
own and the ones other reporters of this host left.

The hot path is the reporter's: it appends a tuple to `queue` (no lock). Everything else here
runs on the sender thread, or in `shutdown` once that thread has let go of `io_lock`."""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from costexporter.core.events import MAX_BATCH_STEPS
from costexporter.store import redisconn
from costexporter.store.client import RedisClient
from costexporter.trainer.spooler import Spooler
from costexporter.trainer.transport import Encoder, Event, NotNow, Wire, send_entries, weight

log = logging.getLogger("costexporter.client")


@dataclass(frozen=True, slots=True)
class Pacing:
    """How the sender paces itself: how often it sends and beats, how much one trip takes,
    how many events wait in memory, and how long a send may hold `shutdown` up."""

    heartbeat_s: float
    flush_interval_s: float
    batch_size: int
    capacity: int
    batch_steps: bool
    io_wait_s: float


class Sender:
    """The queue and the thread that empties it. `stats` counts where every event went (the
    reporter's `stats`). `on_job_lost`: Redis no longer knew the job (restarted empty): the
    reporter posts its register and meta again. `on_first_send`: called once, after the first
    events arrived (the reporter's shared-GPU check)."""

    def __init__(
        self,
        wire: Wire,
        client: RedisClient,
        redis_errors: tuple[type[Exception], ...],
        pacing: Pacing,
        *,
        spool_dir: Path,
        destination: str,
        beats_cap: int | None,
        on_job_lost: Callable[[], None],
        on_first_send: Callable[[], None],
        clock: Callable[[], float],
    ) -> None:
        self.wire = wire
        self.client = client
        self.redis_errors = redis_errors
        self.retry_errors: tuple[type[Exception], ...] = (NotNow, *redis_errors)
        self.pacing = pacing
        self.stats: collections.Counter[str] = collections.Counter()
        self.queue: collections.deque[Event] = collections.deque()
        self.seq = itertools.count()
        self.beat_seq = itertools.count()
        # Rank 0's heartbeats are events: in the events stream, on its seqs, spooled; the other
        # ranks' go to the job's heartbeat stream (`beats_cap`: None for rank 0).
        self.beats_are_events = beats_cap is None
        self.beats_cap = beats_cap
        self.encoder = Encoder(
            wire, batch_steps=pacing.batch_steps, beats_are_events=self.beats_are_events, on_bad=self._bad
        )
        self.spooler = Spooler(
            wire,
            spool_dir,
            destination,
            self.encoder,
            self.stats,
            self._log_once,
            batch_size=pacing.batch_size,
            retry_errors=self.retry_errors,
        )
        self.inflight: list[Event] = []
        self.io_lock = threading.Lock()  # held by whoever moves events out of memory (sender, shutdown)
        self.wake = threading.Event()
        self.idle = threading.Event()
        self.closing = False  # the reporter is closing: no more heartbeats
        self.stopping = False
        self.clock = clock  # Unix seconds: the heartbeats' times
        self._on_job_lost = on_job_lost
        self._on_first_send = on_first_send
        self.first_sent = False  # the first events arrived, and on_first_send ran
        self._warned_overflow = False
        self._logged: set[str] = set()
        self._bad_files: set[Path] = set()
        self._thread: threading.Thread | None = None

    def start(self, name: str) -> None:
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- the queue (the reporter's thread) ------------------------------------------------------
    def post(self, type_: str, ts: float, fields: dict[str, object]) -> None:
        if len(self.queue) >= self.pacing.capacity:
            self.overflow()
            return
        self.queue.append((type_, ts, next(self.seq), fields))

    def beat(self) -> None:
        """Queue a heartbeat. Rank 0's go to the events stream on the events' seqs: they are the
        signs of life the agents end a crashed run's claim on its GPUs by, and are spooled like
        any event. The other ranks' seq counts the session's heartbeats, apart from the events'
        seqs: they go to a stream of their own (`keys.beats_key`) that only the watchers read,
        and the event stream's seqs stay without gaps (a reader remembers each gap)."""
        if len(self.queue) >= self.pacing.capacity:
            self.overflow()
            return
        seq = self.seq if self.beats_are_events else self.beat_seq
        self.queue.append(("heartbeat", self.clock(), next(seq), {}))

    def overflow(self) -> None:
        self.stats["overflow"] += 1
        if not self._warned_overflow:
            self._warned_overflow = True
            log.warning(
                "costexporter: event buffer full (%d): dropping events until it drains", self.pacing.capacity
            )

    # ---- lifecycle (the reporter's close) ---------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued and spooled event has reached Redis (or been refused by it);
        False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.queue or self.inflight or self.spooler.spool.lines:
            self.idle.clear()
            self.wake.set()
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            self.idle.wait(0.05 if remaining is None else min(0.05, remaining))
        return True

    def shutdown(self) -> None:
        """Stop the thread and spool whatever is still in memory; a sender stuck past its socket
        timeout keeps its files, and what is left goes to a spool file of its own."""
        self.stopping = True
        self.wake.set()
        if self.io_lock.acquire(timeout=self.pacing.io_wait_s):
            try:
                self.spooler.put(self.inflight + list(self.queue))
                self.inflight = []
                self.queue.clear()
                self.spooler.close(self.spooler.spool)
            finally:
                self.io_lock.release()
        else:  # the sender is stuck past its socket timeout: keep out of its files
            events = list(self.queue)
            self.queue.clear()
            self.spooler.put_late(events, len(self.inflight))

    # ---- the sender thread -----------------------------------------------------------------
    def _run(self) -> None:
        backoff = 0.0
        next_beat = time.monotonic() + self.pacing.heartbeat_s
        drained_others = False
        while not self.stopping:
            # Sends coalesce over flush_interval_s; a heartbeat due sooner still goes on time.
            beat_in = max(0.0, next_beat - time.monotonic())
            self.wake.wait(backoff or min(self.pacing.flush_interval_s, beat_in))
            self.wake.clear()
            if self.stopping:
                break
            now = time.monotonic()
            if now >= next_beat and not self.closing:
                self.beat()
                next_beat = now + self.pacing.heartbeat_s
            with self.io_lock:
                if self.stopping:
                    break
                try:
                    if not drained_others:
                        self.spooler.drain_others(self._deliver, self.client.ping, self._stopping)
                        drained_others = True
                    self.spooler.drain_own(self._deliver, self.client.ping, self._stopping)
                    self._send_queue()
                    if not self.first_sent and self.stats["sent"]:
                        try:
                            self._on_first_send()
                        finally:
                            self.first_sent = True
                    backoff = 0.0
                except self.retry_errors as e:
                    self.stats["send_errors"] += 1
                    if backoff == 0.0:
                        log.warning("costexporter: Redis unreachable or busy (%s); buffering events", e)
                    backoff = min(max(backoff * 2, 0.1), 2.0)
                    if len(self.queue) > self.pacing.capacity // 2:
                        self._spill()
                except Exception:  # the sender must never die, nor retry a poison batch forever
                    log.exception("costexporter: unexpected error in the reporter thread")
                    self.stats["rejected"] += len(self.inflight)
                    self.inflight = []
                    backoff = 1.0
            if not self.queue and not self.inflight and not self.spooler.spool.lines:
                self.idle.set()

    def _send_queue(self) -> None:
        """Send what is queued now; what arrives meanwhile waits for the next round (coalesced:
        one round trip per interval, not one for each handful of new steps)."""
        todo = len(self.queue)
        size = self.pacing.batch_size
        per_trip = max(size, MAX_BATCH_STEPS) if self.pacing.batch_steps else size
        while todo > 0 and self.queue and not self.stopping:
            n = min(len(self.queue), todo, per_trip)
            todo -= n
            # In flight before it leaves the queue: flush() (another thread) must never see both
            # empty while a batch is on its way.
            # (extend() moves them in C, under the GIL: no other thread runs in between)
            moving: list[Event] = []
            self.inflight = moving
            moving.extend(itertools.starmap(self.queue.popleft, itertools.repeat((), n)))
            entries, groups, last_ts = self.encoder.encode(moving)
            try:
                ok, retry = self._deliver(entries, last_ts=last_ts)
            except self.redis_errors:
                self._requeue()
                raise
            self.stats["sent"] += ok
            self.inflight = [ev for i in retry for ev in groups[i]]
            self._requeue()
            if retry:
                raise NotNow(f"{len(retry)} events refused for now")

    def _stopping(self) -> bool:
        return self.stopping

    def _deliver_spooled(
        self, entries: list[dict[str, str]], refused_key: str, spooled: bool
    ) -> tuple[int, list[int]]:
        return self._deliver(entries, refused_key, spooled=spooled)

    def _deliver(
        self,
        entries: list[dict[str, str]],
        refused_key: str = "rejected",
        spooled: bool = False,
        *,
        last_ts: float | None = None,
    ) -> tuple[int, list[int]]:
        """Send; count what the server refused for good (dropped, logged once per reason).
        Heartbeats go to the job's heartbeat stream, except rank 0's (to its events stream, on
        the events' seqs) and those from a spool: this reporter spools only rank 0's, and a
        heartbeat there is on its events' seqs (a reporter's of an earlier release too) and goes
        to the events stream.
        `last_ts`: the newest time among this reporter's own entries, when known (send_entries).
        Returns how many arrived and the indices of what it refused for now (to retry).
        Raises on a dead connection."""
        retry: list[int] = []
        refused = 0
        total = sum(map(weight, entries))
        by_job: dict[str, list[int]] = {}
        for i, e in enumerate(entries):
            by_job.setdefault(e.get("job", self.wire.job), []).append(i)
        for job, idx in by_job.items():
            res = send_entries(
                self.client,
                self.wire.prefix,
                job,
                [entries[i] for i in idx],
                raise_on_error=False,
                beats_cap=None if spooled or self.beats_are_events else self.beats_cap,
                last_ts=last_ts if job == self.wire.job else None,
            )
            for j, exc in res.failed.items():
                if redisconn.retryable(exc):
                    retry.append(idx[j])
                else:
                    w = weight(entries[idx[j]])
                    refused += w
                    self.stats[refused_key] += w
                    self._log_once(
                        f"rejected:{exc}",
                        "costexporter: Redis refused events of %s (%s): dropped (stats['rejected'])",
                        job,
                        exc,
                    )
            for side, exc in res.side_failed:
                if side is not None and side not in res.failed and redisconn.retryable(exc):
                    retry.append(idx[side])  # resent whole; the reader drops the duplicate entry
                elif not redisconn.retryable(exc):
                    self.stats["side_rejected"] += 1
                    self._log_once(
                        f"side:{exc}",
                        "costexporter: Redis refused a ranks/meta/jobs write of %s (%s); events went through",
                        job,
                        exc,
                    )
            if (
                res.job_new
                and job == self.wire.job
                and refused_key == "rejected"
                and not self._registers_in(entries)
            ):
                self._job_lost()
            if res.counter_failed is not None:
                self.stats["counter_rejected"] += 1
                if f"counter:{res.counter_failed}" not in self._logged:
                    self._logged.add(f"counter:{res.counter_failed}")
                    log.warning(
                        "costexporter: Redis refused the registrations counter (%s; an ACL without "
                        "%s:registrations?): agents find %s's registration by their slower refresh",
                        res.counter_failed,
                        self.wire.prefix,
                        job,
                    )
        retry = sorted(set(retry))
        # (events: a batched entry counts its steps; a retried entry counts when it succeeds)
        return total - refused - sum(weight(entries[i]) for i in retry), retry

    def _registers_in(self, entries: list[dict[str, str]]) -> bool:
        """Whether a batch holds this reporter's own register."""
        rank = str(self.wire.rank)
        return any(
            e.get("type") == "register" and e.get("rank") == rank and e.get("session") == self.wire.session
            for e in entries
        )

    def _job_lost(self) -> None:
        self.stats["registered_again"] += 1
        self._on_job_lost()

    def _bad(self, evs: list[Event], e: Exception) -> None:
        self.stats["rejected"] += len(evs)
        msg = "costexporter: cannot encode a %s event (%s): dropped"
        self._log_once(f"encode:{type(e).__name__}", msg, evs[0][0], e)

    def _log_once(self, key: str, msg: str, *args: object) -> None:
        if key not in self._logged and len(self._logged) < 100:
            self._logged.add(key)
            log.error(msg, *args)

    def _requeue(self) -> None:
        if self.inflight:
            self.queue.extendleft(reversed(self.inflight))
            self.inflight = []

    def _spill(self) -> None:
        """Redis is down and memory is filling: move the oldest half to the spool file."""
        n = len(self.queue) // 2
        self.spooler.put(list(itertools.islice(self.queue, n)))  # on disk before it leaves the queue
        for _ in range(n):
            self.queue.popleft()
