"""The trainer's side of the contract: `StepReporter` posts events without slowing training.

    rep = StepReporter(job="qwen3-32b-ft")   # rank etc. from torchrun/SLURM env, Redis from env
    rep.step(step, tokens=n)                 # after each optimizer step
    with rep.phase("checkpoint", step=step):
        save()

The hot path only appends a tuple to a deque (a few hundred nanoseconds). A background thread
sends what is queued every `flush_interval_s` with one pipelined round trip, each run of steps
packed into one batched `steps` entry (array operations, no XADD per step: the calls and the
sender together execute about 0.2% of a 170 us-a-step loop's instructions,
bench/loop_instructions.py). When Redis is down or slow the
events wait in memory with their original timestamps and spill to a spool file on local disk
when memory fills; at exit the flush waits at most `exit_timeout_s` and spools whatever is left;
the next reporter that starts on the host for the same Redis and prefix sends the spool. Values
are checked at the call (a bad one raises there), a batch the server refuses is dropped and
counted, so nothing can wedge the queue. `run end` is posted only when the process ends cleanly
(`costexporter.exitstatus`). In a forked child (DataLoader workers) the reporter goes quiet: the
parent posts, the child never does.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import secrets
import socket
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from costexporter.core.events import (
    MAX_GPU_INDEX,
    MAX_RANK,
    MAX_STEP,
    MAX_TOKENS,
    MAX_WORLD_SIZE,
    META_NUMBERS,
    META_TEXT,
)
from costexporter.store import protocol, redisconn
from costexporter.trainer import coerce, detect, exitstatus, spool
from costexporter.trainer.sender import Pacing, Sender
from costexporter.trainer.transport import Wire

log = logging.getLogger("costexporter.client")

_REPORTERS: weakref.WeakSet[StepReporter] = weakref.WeakSet()


def _quiet_in_child() -> None:
    for rep in list(_REPORTERS):
        rep._inactive = True
        rep._closed = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_quiet_in_child)


class StepReporter:
    """Posts a rank's events to `<prefix>:t:{<job>}:events` and its heartbeats to
    `<prefix>:t:{<job>}:beats` (rank 0's to its events: protocol v1, docs/protocol.md).

    `stats` counts where every event went (a batched `steps` entry counts its steps): `sent`
    (written to Redis), `spooled` (written to the spool file) and `unspooled` (left it again:
    sent or rejected), `rejected` (refused by the server, dropped), `lost` (could not even be
    spooled), `overflow` (refused by a full buffer, never queued), `heartbeats_unsent` (due
    while Redis could not take them: never spooled); `drained` counts other
    reporters' spooled events this one sent for them. Events in the spool now = spooled -
    unspooled.
    """

    def __init__(
        self,
        job: str,
        redis_url: str | None = None,
        *,
        rank: int | None = None,
        local_rank: int | None = None,
        world_size: int | None = None,
        host: str | None = None,
        gpu_uuid: str | None = None,
        gpu_index: int | None = None,
        prefix: str | None = None,
        resume_from: int | None = None,
        meta: dict[str, Any] | None = None,
        heartbeat_s: float = 10.0,
        flush_interval_s: float = 0.5,
        batch_size: int = 2000,
        buffer_size: int = 100_000,
        exit_timeout_s: float = 2.0,
        spool_dir: str | Path | None = None,
        socket_timeout_s: float = 2.0,
        clock: Callable[[], float] = time.time,
        started_at: float | None = None,
        batch_steps: bool = True,
    ) -> None:
        self.job = protocol.check_job(job)
        self.prefix = prefix or os.environ.get("COSTEXPORTER_PREFIX", protocol.DEFAULT_PREFIX)
        self.redis_url = redis_url or os.environ.get("COSTEXPORTER_REDIS_URL", protocol.DEFAULT_REDIS_URL)
        self._identify(rank, local_rank, world_size, host, gpu_uuid, gpu_index)
        self.session = secrets.token_hex(8)
        self._clock = clock  # Unix seconds; a simulation passes its own
        self.exit_timeout_s = exit_timeout_s
        self.capacity = buffer_size
        self._inactive = False  # set in a forked child: the hot path returns at once
        self._closed = False
        self._exit_reason: str | None = None

        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # No client-side retries: the sender loop owns backoff, so a dead server costs one attempt.
        client = redisconn.from_url(
            self.redis_url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=min(1.0, socket_timeout_s),
            retry=Retry(NoBackoff(), 0),
        )
        # Runs of steps go out as one batched `steps` entry; batch_steps=False: one `step` entry
        # each (for readers older than the batched entry).
        pacing = Pacing(
            heartbeat_s=heartbeat_s,
            flush_interval_s=flush_interval_s,
            batch_size=batch_size,
            capacity=buffer_size,
            batch_steps=batch_steps,
            # Bounds how long close() waits for a send in progress (a connect plus a reply).
            io_wait_s=socket_timeout_s + min(1.0, socket_timeout_s) + 0.5,
        )
        self._sender = Sender(
            Wire(self.prefix, self.job, self.rank, self.session),
            client,
            (redis.ConnectionError, redis.TimeoutError, OSError),
            pacing,
            spool_dir=detect.writable_dir(Path(spool_dir) if spool_dir else detect.default_spool_dir()),
            destination=spool.destination(self.redis_url),
            beats_cap=None if self.rank == 0 else protocol.beats_cap(self.world_size),
            on_job_lost=self._register_again,
            on_first_send=self._check_shared_gpu,
            clock=clock,
        )
        self.stats = self._sender.stats
        self.spool_dir = self._sender.spooler.spool_dir
        self._queue = self._sender.queue  # the hot path appends here
        self._seq = self._sender.seq

        exitstatus.install()
        exitstatus.on_hard_exit(_close_all)
        # The register, and the meta as merged so far: posted again if Redis loses them.
        self._registration: tuple[float, dict[str, Any]] = (
            self._ts(started_at),
            {
                "host": self.host,
                "gpu_uuid": self.gpu_uuid,
                "gpu": self.gpu_index,
                "local_rank": self.local_rank,
                "world_size": self.world_size,
                "pid": os.getpid(),
            },
        )
        self._meta: dict[str, object] = {}
        self._post("register", ts=self._registration[0], **self._registration[1])
        if resume_from is None:
            self._post("run", ts=self._ts(started_at), state="start")
        else:
            self.resume(resume_from, ts=started_at)
        if meta:
            self.meta(**meta)
        _REPORTERS.add(self)
        self._pid = os.getpid()
        self._sender.start(f"costexporter-reporter-{self.rank}")
        atexit.register(_close_at_exit, weakref.ref(self))

    def _identify(
        self,
        rank: int | None,
        local_rank: int | None,
        world_size: int | None,
        host: str | None,
        gpu_uuid: str | None,
        gpu_index: int | None,
    ) -> None:
        """Rank, world and GPU: as given, else from the launcher's environment and NVML."""
        env_rank, env_local, env_world = detect.detect_ranks()
        # The reader's bounds (events.parse_event): a register outside them would make the reader
        # refuse every event of this rank, so the constructor refuses it instead.
        env = " (from the launcher's environment)"
        self.rank = coerce.count(
            env_rank if rank is None else rank, "rank" + (env if rank is None else ""), MAX_RANK
        )
        self.local_rank = coerce.count(
            env_local if local_rank is None else local_rank,
            "local_rank" + (env if local_rank is None else ""),
            MAX_GPU_INDEX,
        )
        self.world_size = coerce.count(
            env_world if world_size is None else world_size,
            "world_size" + (env if world_size is None else ""),
            MAX_WORLD_SIZE,
            lo=1,
        )
        self.host = coerce.text(host or os.environ.get("COSTEXPORTER_HOST") or socket.gethostname(), "host")
        if gpu_uuid is None and gpu_index is None:
            guess = detect.locate_gpu(self.local_rank)
            gpu_index, gpu_uuid = guess.index, guess.uuid
            if gpu_uuid is None:
                index = self.local_rank if gpu_index is None else gpu_index
                detect.tell_gpu(self.rank, self.host, index, guess)
        self.gpu_index = coerce.count(
            self.local_rank if gpu_index is None else gpu_index, "gpu_index", MAX_GPU_INDEX
        )
        self.gpu_uuid = None if gpu_uuid is None else coerce.text(gpu_uuid, "gpu_uuid")

    # ---- the trainer's API (hot path: no I/O, no locks) -------------------------------------
    def step(self, step: int, tokens: int | None = None, ts: float | None = None) -> None:
        """Optimizer step `step` just finished (tokens: the global batch's, on rank 0).

        `ts` (Unix seconds) when it finished, if not now. Numbers of other types (numpy,
        Decimal) are converted; what is not a whole number raises TypeError/ValueError here."""
        if self._inactive:
            return
        if type(step) is not int or step < 0 or step > MAX_STEP:
            step = coerce.count(step, "step", MAX_STEP)
        if tokens is None:
            tokens = -1  # (none: the batched entry's own word for it, no None to map on the sender)
        elif type(tokens) is not int or tokens < 0 or tokens > MAX_TOKENS:
            tokens = coerce.count(tokens, "tokens", MAX_TOKENS)
        if ts is None:
            ts = self._clock()
        elif type(ts) is not float or not 0.0 <= ts < 1e11:
            ts = coerce.timestamp(ts)
        q = self._queue
        if len(q) >= self.capacity:
            self._overflow()
            return
        q.append(("step", ts, next(self._seq), step, tokens))

    def phase_begin(self, name: str, step: int | None = None, ts: float | None = None) -> None:
        self._post("phase", ts=self._ts(ts), name=_name(name), state="begin", step=_opt_count(step, "step"))

    def phase_end(self, name: str, step: int | None = None, ts: float | None = None) -> None:
        self._post("phase", ts=self._ts(ts), name=_name(name), state="end", step=_opt_count(step, "step"))

    @contextlib.contextmanager
    def phase(self, name: str, step: int | None = None) -> Iterator[None]:
        """Declared non-step work: `with rep.phase("checkpoint", step=s): save()`."""
        self.phase_begin(name)
        try:
            yield
        finally:
            self.phase_end(name, step=step)

    def resume(self, step: int, ts: float | None = None) -> None:
        """This run restarted from the checkpoint saved after `step` (voids later steps)."""
        self._post("run", ts=self._ts(ts), state="resume", step=coerce.count(step, "step", MAX_STEP))

    def meta(self, ts: float | None = None, **fields: object) -> None:
        """Job metadata (gpu_model, the heartbeat cadence, any data field: events.META_TEXT and
        META_NUMBERS); last write wins. It is data, never money: the price, the owner (team,
        cost_center, budget) and booking thresholds are the operator's policy; sent here they
        are ignored and said, unless the operator's policy grants the key (docs/terms.md).

        Prices, budgets and thresholds must be finite numbers >= 0 and the text fields strings,
        as the reader requires; other values must be JSON-plain."""
        clean: dict[str, object] = {}
        for k, v in fields.items():
            if k in META_NUMBERS and v is not None:
                x = coerce.number(v, k)
                if x < 0:
                    raise ValueError(f"{k} must be >= 0, got {v!r}")
                clean[k] = x
            elif k in META_TEXT and v is not None:
                clean[k] = coerce.text(v, k)
            else:
                clean[coerce.text(k, "a meta field name")] = coerce.plain(v, k)
        self._post("meta", ts=self._ts(ts), **clean)
        self._meta.update(clean)

    def preflight(self, passed: bool, checks: object = None) -> None:
        """The pre-run invariant gate's result."""
        self._post("preflight", passed=bool(passed), checks=coerce.plain(checks, "checks"))

    def _ts(self, ts: object) -> float:
        return self._clock() if ts is None else coerce.timestamp(ts)

    def _post(self, type_: str, ts: float | None = None, **fields: object) -> None:
        if self._inactive:
            return
        self._sender.post(type_, self._clock() if ts is None else ts, fields)

    def _overflow(self) -> None:
        self._sender.overflow()

    # ---- lifecycle -------------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued and spooled event has reached Redis (or been refused by it);
        False on timeout."""
        return self._sender.flush(timeout)

    def close(
        self, timeout: float | None = None, *, end_run: bool | None = None, ts: float | None = None
    ) -> None:
        """Post `run end` if the run ended cleanly, flush for at most `timeout` (default
        exit_timeout_s) and spool what is left.

        `end_run=None` decides (`exitstatus`): no `run end` after an uncaught exception or an exit
        with a failing status, or when called while an exception other than a clean `SystemExit`
        is propagating (a `finally:` block). Never raises for a full or unwritable spool: what
        cannot be spooled is counted `lost` and logged once."""
        if self._closed or os.getpid() != self._pid:
            return
        why = self._exit_reason  # the `with` block's, when it ended the reporter
        if end_run is None:
            why = exitstatus.crash_reason() or exitstatus.exception_reason(sys.exc_info()[1])
            end_run = why is None
            if why:
                log.info("costexporter: not posting run end for %s rank %d: %s", self.job, self.rank, why)
        if end_run:
            self._post("run", ts=None if ts is None else self._ts(ts), state="end")
        elif why:  # the process can still write: say which rank failed, and how (the watcher names it)
            fields: dict[str, object] = {"state": "crash", "exit": why[:200]}
            error = exitstatus.error_type(why)
            if error:
                fields["error"] = error
            self._post("run", None, **fields)
        self._closed = True
        self._sender.closing = True
        timeout = self.exit_timeout_s if timeout is None else timeout
        self.flush(timeout)
        self._sender.shutdown()
        self._inactive = True

    def __enter__(self) -> StepReporter:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self._exit_reason = exitstatus.exception_reason(exc) or exitstatus.crash_reason()
        self.close(end_run=self._exit_reason is None)

    # ---- called by the sender thread --------------------------------------------------------
    def _check_shared_gpu(self) -> None:
        """Once registered: another rank of the job on this host naming the same GPU is said
        once, with the fix: the agents book such a GPU for one rank only."""
        c, gpu = self._sender.client, (self.gpu_uuid, self.gpu_index)
        if detect.say_shared_gpu(c, self.prefix, self.job, self.rank, self.host, *gpu):
            self.stats["gpu_shared"] += 1

    def _register_again(self) -> None:
        """The jobs index lost the job: Redis restarted empty (or the key was deleted). The ranks
        and meta hashes went with it, and an agent that starts now would find no registration:
        post the register (its first time) and the meta again."""
        log.info(
            "costexporter: Redis no longer knew job %s (restarted empty?): registering rank %d again",
            self.job,
            self.rank,
        )
        ts, fields = self._registration
        self._post("register", ts=ts, **fields)
        if self._meta:
            self._post("meta", None, **self._meta)


def _name(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise TypeError(f"a phase name must be a non-empty string, got {name!r}")
    return coerce.text(name, "a phase name")


def _opt_count(x: object, name: str) -> int | None:
    return None if x is None else coerce.count(x, name, MAX_STEP)


def _close_all() -> None:
    """The process ends without its exit handlers (os._exit, a fatal signal): close every
    reporter now (exitstatus decides about `run end`)."""
    for rep in list(_REPORTERS):
        _close_at_exit(weakref.ref(rep))


def _close_at_exit(ref: weakref.ref[StepReporter]) -> None:
    rep = ref()
    if rep is not None:
        try:
            rep.close()
        except Exception:  # never fail interpreter shutdown
            log.exception("costexporter: error while closing the reporter at exit")
