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
import collections
import contextlib
import itertools
import json
import logging
import operator
import os
import secrets
import socket
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from costexporter.core.events import (
    BASE_FIELDS,
    MAX_BATCH_STEPS,
    MAX_GPU_INDEX,
    MAX_RANK,
    MAX_STEP,
    MAX_TOKENS,
    MAX_WORLD_SIZE,
    META_NUMBERS,
    META_TEXT,
    STEPS_TYPE,
    unpack_steps,
)
from costexporter.store import keys, protocol, redisconn
from costexporter.trainer import coerce, exitstatus, spool

log = logging.getLogger("costexporter.client")

_REPORTERS: weakref.WeakSet[StepReporter] = weakref.WeakSet()


def _quiet_in_child() -> None:
    for rep in list(_REPORTERS):
        rep._inactive = True
        rep._closed = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_quiet_in_child)


def _env_int(*names: str, default: int) -> int:
    for n in names:
        v = os.environ.get(n)
        if v not in (None, ""):
            try:
                return int(v)
            except ValueError:
                continue
    return default


def detect_ranks() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun, SLURM or Open MPI variables."""
    rank = _env_int("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", default=0)
    local = _env_int("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", default=0)
    world = _env_int("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", default=1)
    return rank, local, world


@dataclass(frozen=True)
class GpuGuess:
    """Which physical GPU a rank trains on, and how that was found out (for its log line)."""

    index: int | None
    uuid: str | None
    source: str  # where the answer came from, in words
    problem: str | None = None  # why NVML could not say more (None: it did, or was not needed)


def detect_gpu(local_rank: int) -> tuple[int | None, str | None]:
    """This rank's physical GPU index and UUID, via CUDA_VISIBLE_DEVICES and NVML when present."""
    g = locate_gpu(local_rank)
    return g.index, g.uuid


def _visible_entry(local_rank: int) -> tuple[str | None, str]:
    """This rank's entry of CUDA_VISIBLE_DEVICES (None: not one), and where it came from. A
    process that sees one GPU uses it whatever its local rank (SLURM's per-task binding:
    `CUDA_VISIBLE_DEVICES=5` with `SLURM_LOCALID=1`); with several, the local rank picks one."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return str(local_rank), f"local rank {local_rank} (CUDA_VISIBLE_DEVICES unset)"
    items = [x.strip() for x in visible.split(",") if x.strip()]
    if len(items) == 1:
        return items[0], f"CUDA_VISIBLE_DEVICES={visible!r}, the one GPU this process sees"
    if local_rank < len(items):
        return items[local_rank], f"CUDA_VISIBLE_DEVICES={visible!r}, entry {local_rank} (the local rank)"
    return None, f"CUDA_VISIBLE_DEVICES={visible!r} has no entry {local_rank} (the local rank)"


def locate_gpu(local_rank: int) -> GpuGuess:
    """The physical GPU behind this rank's CUDA_VISIBLE_DEVICES entry: an index, a GPU UUID (or
    a unique prefix of one, as CUDA takes it) or a MIG device UUID, mapped through NVML to the
    physical index and UUID (a MIG device to the GPU that holds it: the agent samples that)."""
    entry, source = _visible_entry(local_rank)
    if entry is None:
        return GpuGuess(None, None, source)
    try:
        import pynvml
    except ImportError:
        return _without_nvml(entry, source, "nvidia-ml-py is not installed")
    try:
        pynvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - NVMLError (no driver, no GPU), or a library that fails to load
        return _without_nvml(entry, source, f"NVML did not start: {e}")
    try:
        h = _nvml_handle(pynvml, entry)
        if h is None:
            return GpuGuess(None, None, source, f"NVML knows no GPU {entry!r}")
        is_mig = getattr(pynvml, "nvmlDeviceIsMigDeviceHandle", None)
        if is_mig is not None and entry.startswith("MIG-") and is_mig(h):
            h = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(h)
        uuid = pynvml.nvmlDeviceGetUUID(h)
        index = int(pynvml.nvmlDeviceGetIndex(h))
        return GpuGuess(index, uuid.decode() if isinstance(uuid, bytes) else str(uuid), source)
    except Exception as e:  # noqa: BLE001 - an NVMLError on a lost or hidden GPU
        return _without_nvml(entry, source, f"NVML could not read GPU {entry!r}: {e}")
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _nvml_handle(pynvml: Any, entry: str) -> Any:
    """NVML's handle of an index, a UUID (full or a unique prefix) or a MIG device UUID."""
    if entry.isdigit():
        return pynvml.nvmlDeviceGetHandleByIndex(int(entry))
    try:
        return pynvml.nvmlDeviceGetHandleByUUID(entry)
    except pynvml.NVMLError:
        if entry.startswith("MIG-"):
            return None
    found = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        u = pynvml.nvmlDeviceGetUUID(h)
        if (u.decode() if isinstance(u, bytes) else str(u)).startswith(entry):
            found.append(h)
    return found[0] if len(found) == 1 else None


def _without_nvml(entry: str, source: str, problem: str) -> GpuGuess:
    """What the entry alone says: an index is the GPU's index (CUDA's order: set
    CUDA_DEVICE_ORDER=PCI_BUS_ID to be sure it is NVML's), a full GPU UUID is the GPU's UUID; a
    MIG device or a UUID prefix cannot be placed."""
    if entry.isdigit():
        return GpuGuess(int(entry), None, source, problem)
    if entry.startswith("GPU-") and len(entry) == 40:
        return GpuGuess(None, entry, source, problem)
    return GpuGuess(None, None, source, problem)


def default_spool_dir() -> Path:
    env = os.environ.get("COSTEXPORTER_SPOOL_DIR")
    if env:
        return Path(env)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "costexporter" / "spool"


def _writable_dir(path: Path) -> Path:
    for p in (path, Path(tempfile.gettempdir()) / f"costexporter-spool-{os.getuid()}"):
        try:
            p.mkdir(parents=True, exist_ok=True)
            if os.access(p, os.W_OK):
                return p
        except OSError:
            continue
    raise OSError(f"no writable spool directory ({path})")


_told_gpu = False


def _tell_gpu(rank: int, host: str, index: int, guess: GpuGuess) -> None:
    """Without a UUID the agent can only match this rank by host + index: say what was found,
    from what, why no more, and how to do better (once a process)."""
    global _told_gpu
    if _told_gpu:
        return
    _told_gpu = True
    log.info(
        "costexporter: no GPU UUID for rank %d (%s); registering host %s GPU index %d (from %s). If "
        "that is not this rank's GPU, pass StepReporter(gpu_uuid=... or gpu_index=...) or set "
        "CUDA_VISIBLE_DEVICES; set COSTEXPORTER_HOST when hosts share a name",
        rank,
        guess.problem or "none found",
        host,
        index,
        guess.source,
    )


# A queued event: (type, ts, seq, fields), a step (type, ts, seq, step, tokens; -1: no tokens): no
# dict built on the trainer's thread. Encoded on the sender's.
_Event = tuple[Any, ...]


_TS, _STEP, _TOKENS = operator.itemgetter(1), operator.itemgetter(3), operator.itemgetter(4)


def _step_columns(run: list[_Event]) -> np.ndarray | None:
    """The (3, n) int64 array [steps, Unix microseconds, tokens] of queued steps, each column
    taken in one pass in C; None when the run holds another event (a 4-tuple: no tokens).
    Times go to the microsecond as a single entry's `ts` text says them."""
    n = len(run)
    out = np.empty((3, n), dtype=np.int64)
    try:
        out[2] = np.fromiter(map(_TOKENS, run), np.int64, n)
    except IndexError:
        return None
    out[1] = np.rint(np.fromiter(map(_TS, run), np.float64, n) * 1e6)
    out[0] = np.fromiter(map(_STEP, run), np.int64, n)
    return out


def _weight(entry: dict[str, str]) -> int:
    """How many events an entry carries (a batched `steps` entry: its `n`)."""
    return int(entry["n"]) if entry.get("type") == STEPS_TYPE else 1


class _Retry(Exception):
    """Some events are back in line for a later try (the server said: not now)."""


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
        env_rank, env_local, env_world = detect_ranks()
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
            guess = locate_gpu(self.local_rank)
            gpu_index, gpu_uuid = guess.index, guess.uuid
            if gpu_uuid is None:
                _tell_gpu(self.rank, self.host, self.local_rank if gpu_index is None else gpu_index, guess)
        self.gpu_index = coerce.count(
            self.local_rank if gpu_index is None else gpu_index, "gpu_index", MAX_GPU_INDEX
        )
        self.gpu_uuid = None if gpu_uuid is None else coerce.text(gpu_uuid, "gpu_uuid")
        self.session = secrets.token_hex(8)
        self._clock = clock  # Unix seconds; a simulation passes its own
        self.heartbeat_s = heartbeat_s
        self.flush_interval_s = flush_interval_s
        self.batch_size = batch_size
        # Runs of steps go out as one batched `steps` entry; False: one `step` entry each (for
        # readers older than the batched entry).
        self.batch_steps = batch_steps
        self.capacity = buffer_size
        self.exit_timeout_s = exit_timeout_s
        self.spool_dir = _writable_dir(Path(spool_dir) if spool_dir else default_spool_dir())
        self._spool_path = (
            self.spool_dir
            / f"{spool.safe_name(self.prefix)}.{spool.safe_name(self.job)}.{self.session}.jsonl"
        )
        self.destination = spool.destination(self.redis_url)
        self._spool = spool.SpoolFile(self._spool_path, self.destination, self.prefix)
        # Bounds how long close() waits for a send in progress (a connect plus a reply).
        self._io_wait_s = socket_timeout_s + min(1.0, socket_timeout_s) + 0.5

        self._queue: collections.deque[_Event] = collections.deque()
        self._seq = itertools.count()
        self._beat_seq = itertools.count()
        # Rank 0's heartbeats are events: in the events stream, on its seqs, spooled (`_beat`)
        self._beats_are_events = self.rank == 0
        self._beats_cap = protocol.beats_cap(self.world_size)
        self._inflight: list[_Event] = []
        self._io_lock = threading.Lock()  # held by whoever moves events out of memory (sender, close)
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._inactive = False  # set in a forked child: the hot path returns at once
        self._closed = False
        self._gpu_checked = False  # whether another rank of this host names this GPU was looked at
        self._exit_reason: str | None = None
        self._stopping = False
        self._warned_overflow = False
        self._logged: set[str] = set()
        self._bad_files: set[Path] = set()
        self.stats: collections.Counter[str] = collections.Counter()

        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # No client-side retries: the sender loop owns backoff, so a dead server costs one attempt.
        self._redis = redisconn.from_url(
            self.redis_url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=min(1.0, socket_timeout_s),
            retry=Retry(NoBackoff(), 0),
        )
        self._redis_errors = (redis.ConnectionError, redis.TimeoutError, OSError)

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
        self._thread = threading.Thread(
            target=self._run, name=f"costexporter-reporter-{self.rank}", daemon=True
        )
        self._thread.start()
        atexit.register(_close_at_exit, weakref.ref(self))

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
        if len(self._queue) >= self.capacity:
            self._overflow()
            return
        self._queue.append((type_, self._clock() if ts is None else ts, next(self._seq), fields))

    def _beat(self) -> None:
        """Queue a heartbeat. Rank 0's go to the events stream on the events' seqs: they are the
        signs of life the agents end a crashed run's claim on its GPUs by, and are spooled like
        any event. The other ranks' seq counts the session's heartbeats, apart from the events'
        seqs: they go to a stream of their own (`keys.beats_key`) that only the watchers read,
        and the event stream's seqs stay without gaps (a reader remembers each gap)."""
        if len(self._queue) >= self.capacity:
            self._overflow()
            return
        seq = self._seq if self._beats_are_events else self._beat_seq
        self._queue.append(("heartbeat", self._clock(), next(seq), {}))

    def _overflow(self) -> None:
        self.stats["overflow"] += 1
        if not self._warned_overflow:
            self._warned_overflow = True
            log.warning(
                "costexporter: event buffer full (%d): dropping events until it drains", self.capacity
            )

    # ---- lifecycle -------------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued and spooled event has reached Redis (or been refused by it);
        False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._queue or self._inflight or self._spool.lines:
            self._idle.clear()
            self._wake.set()
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            self._idle.wait(0.05 if remaining is None else min(0.05, remaining))
        return True

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
        timeout = self.exit_timeout_s if timeout is None else timeout
        self.flush(timeout)
        self._stopping = True
        self._wake.set()
        if self._io_lock.acquire(timeout=self._io_wait_s):
            try:
                self._spool_events(self._inflight + list(self._queue))
                self._inflight = []
                self._queue.clear()
                self._close_spool(self._spool)
            finally:
                self._io_lock.release()
        else:  # the sender is stuck past its socket timeout: keep out of its files
            self._close_stuck()
        self._inactive = True

    def _close_stuck(self) -> None:
        late = spool.SpoolFile(self._spool_path.with_suffix(".late.jsonl"), self.destination, self.prefix)
        events = list(self._queue)
        self._queue.clear()
        try:
            self._spool_events(events, late)
        finally:
            self._close_spool(late)
        if self._inflight:
            self._count_lost(len(self._inflight), "a send did not return in time")

    def _close_spool(self, f: spool.SpoolFile) -> None:
        """Close a spool file; its writes went to the OS unbuffered, so there is nothing left to
        lose here, and a disk error on closing is only logged (close() never raises for it)."""
        try:
            f.close()
        except OSError as e:
            self._log_once(f"close:{e.errno}", "costexporter: cannot close spool %s (%s)", f.path, e)

    def __enter__(self) -> StepReporter:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self._exit_reason = exitstatus.exception_reason(exc) or exitstatus.crash_reason()
        self.close(end_run=self._exit_reason is None)

    # ---- the sender thread -----------------------------------------------------------------
    def _run(self) -> None:
        backoff = 0.0
        next_beat = time.monotonic() + self.heartbeat_s
        drained_others = False
        while not self._stopping:
            # Sends coalesce over flush_interval_s; a heartbeat due sooner still goes on time.
            self._wake.wait(backoff or min(self.flush_interval_s, max(0.0, next_beat - time.monotonic())))
            self._wake.clear()
            if self._stopping:
                break
            now = time.monotonic()
            if now >= next_beat and not self._closed:
                self._beat()
                next_beat = now + self.heartbeat_s
            with self._io_lock:
                if self._stopping:
                    break
                try:
                    if not drained_others:
                        self._drain_others()
                        drained_others = True
                    self._drain_own()
                    self._send_queue()
                    if not self._gpu_checked and self.stats["sent"]:
                        self._gpu_checked = True
                        self._check_shared_gpu()
                    backoff = 0.0
                except (_Retry, *self._redis_errors) as e:
                    self.stats["send_errors"] += 1
                    if backoff == 0.0:
                        log.warning("costexporter: Redis unreachable or busy (%s); buffering events", e)
                    backoff = min(max(backoff * 2, 0.1), 2.0)
                    if len(self._queue) > self.capacity // 2:
                        self._spill()
                except Exception:  # the sender must never die, nor retry a poison batch forever
                    log.exception("costexporter: unexpected error in the reporter thread")
                    self.stats["rejected"] += len(self._inflight)
                    self._inflight = []
                    backoff = 1.0
            if not self._queue and not self._inflight and not self._spool.lines:
                self._idle.set()

    def _check_shared_gpu(self) -> None:
        """Once registered: another rank of the job on this host naming the same GPU (ranks
        without a local rank in their environment all take GPU 0) is said once, with the fix: the
        agents book such a GPU for one rank only. A read the ACL or Redis refuses says nothing."""
        try:
            ranks = self._redis.hgetall(keys.ranks_key(self.prefix, self.job))
        except Exception:  # noqa: BLE001 - a check, never the reporter's failure
            return
        for rank_s, raw in ranks.items():
            try:
                other = protocol.parse_registration(rank_s, raw)
            except protocol.RegistrationError:
                continue
            same_gpu = (
                (other.gpu_uuid == self.gpu_uuid)
                if other.gpu_uuid and self.gpu_uuid
                else other.gpu == self.gpu_index
            )
            if other.rank != self.rank and other.host == self.host and same_gpu:
                self.stats["gpu_shared"] += 1
                log.warning(
                    "costexporter: ranks %d and %d of %s both name GPU %s of %s: its time is booked for one "
                    "of them. Give each process its GPU (torchrun and srun set LOCAL_RANK / "
                    "SLURM_LOCALID; or pass local_rank= or gpu_index= to StepReporter)",
                    other.rank,
                    self.rank,
                    self.job,
                    self.gpu_uuid or self.gpu_index,
                    self.host,
                )
                return

    def _send_queue(self) -> None:
        """Send what is queued now; what arrives meanwhile waits for the next round (coalesced:
        one round trip per interval, not one for each handful of new steps)."""
        todo = len(self._queue)
        per_trip = max(self.batch_size, MAX_BATCH_STEPS) if self.batch_steps else self.batch_size
        while todo > 0 and self._queue and not self._stopping:
            n = min(len(self._queue), todo, per_trip)
            todo -= n
            # In flight before it leaves the queue: flush() (another thread) must never see both
            # empty while a batch is on its way.
            # (extend() moves them in C, under the GIL: no other thread runs in between)
            moving: list[_Event] = []
            self._inflight = moving
            moving.extend(itertools.starmap(self._queue.popleft, itertools.repeat((), n)))
            entries, groups, last_ts = self._encode(moving)
            try:
                ok, retry = self._deliver(entries, last_ts=last_ts)
            except self._redis_errors:
                self._requeue()
                raise
            self.stats["sent"] += ok
            self._inflight = [ev for i in retry for ev in groups[i]]
            self._requeue()
            if retry:
                raise _Retry(f"{len(retry)} events refused for now")

    def _drain_own(self) -> None:
        """Send this reporter's own spool (older than anything in memory) once Redis is back."""
        if not self._spool.lines:
            return
        self._redis.ping()  # while Redis is down, do not re-read a big spool every round
        entries = self._spool.read()
        remaining = entries
        try:
            while remaining and not self._stopping:
                chunk, rest = remaining[: self.batch_size], remaining[self.batch_size :]
                ok, retry = self._deliver(chunk, spooled=True)
                self.stats["sent"] += ok
                self.stats["unspooled"] += sum(map(_weight, chunk)) - sum(_weight(chunk[i]) for i in retry)
                remaining = [chunk[i] for i in retry] + rest
                if retry:
                    raise _Retry(f"{len(retry)} spooled events refused for now")
        finally:
            if remaining is not entries:
                self._spool.replace(remaining)

    def _drain_others(self) -> None:
        """Send the spool files that crashed or exited reporters left for this Redis and prefix."""
        pinged = False
        for path in spool.others(self.spool_dir, self.prefix, skip=self._spool_path):
            if self._stopping:
                return
            if path in self._bad_files:
                continue
            if not pinged:
                self._redis.ping()  # while Redis is down, do not re-read the files every round
                pinged = True
            with spool.claim(path) as f:
                if f is None:
                    continue
                head = spool.read_header(f)
                if spool.mismatch(path, head, self.destination, self.prefix) or head is None:
                    continue  # (mismatch() refuses a file without a header: head is a dict here)
                try:
                    if self._send_file(f, head):
                        path.unlink()
                except (_Retry, *self._redis_errors):
                    raise
                except Exception:  # an unreadable file must not stop this reporter's own events
                    self._bad_files.add(path)
                    log.exception("costexporter: cannot send spool %s; leaving it", path)

    def _send_file(self, f: TextIO, head: dict[str, Any]) -> bool:
        """Send a claimed file's events; on any stop, keep what is unsent in it. True: all sent."""
        remaining, skipped = spool.entries_of(f)
        total = len(remaining)
        if skipped:  # torn or corrupted lines: nothing of them can be sent
            self.stats["spool_corrupt_lines"] += skipped
            log.warning("costexporter: spool %s: %d corrupted lines skipped", f.name, skipped)
        try:
            while remaining and not self._stopping:
                chunk, rest = remaining[: self.batch_size], remaining[self.batch_size :]
                ok, retry = self._deliver(chunk, "drain_rejected", spooled=True)
                self.stats["drained"] += ok
                remaining = [chunk[i] for i in retry] + rest
                if retry:
                    raise _Retry(f"{len(retry)} spooled events refused for now")
        finally:
            if remaining and len(remaining) != total:
                spool.rewrite(f, head, remaining)
        return not remaining

    def _deliver(
        self,
        entries: list[dict[str, str]],
        refused_key: str = "rejected",
        *,
        spooled: bool = False,
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
        total = sum(map(_weight, entries))
        by_job: dict[str, list[int]] = {}
        for i, e in enumerate(entries):
            by_job.setdefault(e.get("job", self.job), []).append(i)
        for job, idx in by_job.items():
            res = send_entries(
                self._redis,
                self.prefix,
                job,
                [entries[i] for i in idx],
                raise_on_error=False,
                beats_cap=None if spooled or self._beats_are_events else self._beats_cap,
                last_ts=last_ts if job == self.job else None,
            )
            for j, exc in res.failed.items():
                if redisconn.retryable(exc):
                    retry.append(idx[j])
                else:
                    w = _weight(entries[idx[j]])
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
                and job == self.job
                and refused_key == "rejected"
                and not self._registers_in(entries)
            ):
                self._register_again()
            if res.counter_failed is not None:
                self.stats["counter_rejected"] += 1
                if f"counter:{res.counter_failed}" not in self._logged:
                    self._logged.add(f"counter:{res.counter_failed}")
                    log.warning(
                        "costexporter: Redis refused the registrations counter (%s; an ACL without "
                        "%s:registrations?): agents find %s's registration by their slower refresh",
                        res.counter_failed,
                        self.prefix,
                        job,
                    )
        retry = sorted(set(retry))
        # (events: a batched entry counts its steps; a retried entry counts when it succeeds)
        return total - refused - sum(_weight(entries[i]) for i in retry), retry

    def _registers_in(self, entries: list[dict[str, str]]) -> bool:
        """Whether a batch holds this reporter's own register."""
        rank = str(self.rank)
        return any(
            e.get("type") == "register" and e.get("rank") == rank and e.get("session") == self.session
            for e in entries
        )

    def _register_again(self) -> None:
        """The jobs index lost the job: Redis restarted empty (or the key was deleted). The ranks
        and meta hashes went with it, and an agent that starts now would find no registration:
        post the register (its first time) and the meta again."""
        self.stats["registered_again"] += 1
        log.info(
            "costexporter: Redis no longer knew job %s (restarted empty?): registering rank %d again",
            self.job,
            self.rank,
        )
        ts, fields = self._registration
        self._post("register", ts=ts, **fields)
        if self._meta:
            self._post("meta", None, **self._meta)

    def _encode(self, batch: list[_Event]) -> tuple[list[dict[str, str]], list[list[_Event]], float]:
        """The entries of queued events, the events each entry carries and the newest time among
        them: a run of steps with consecutive seqs becomes one batched `steps` entry (at most
        MAX_BATCH_STEPS)."""
        entries: list[dict[str, str]] = []
        groups: list[list[_Event]] = []
        n = len(batch)
        cols = None
        if self.batch_steps and n > 1 and batch[-1][2] - batch[0][2] == n - 1:
            cols = _step_columns(batch)
        if cols is not None:  # nothing but steps, one run of seqs (steps come from one thread, in order)
            for i in range(0, n, MAX_BATCH_STEPS):
                self._add(entries, groups, batch[i : i + MAX_BATCH_STEPS], cols[:, i : i + MAX_BATCH_STEPS])
            return entries, groups, int(cols[1].max()) / 1e6
        run: list[_Event] = []
        beats: list[_Event] = []
        for ev in batch:
            if ev[0] == "heartbeat" and not self._beats_are_events:  # its own stream and seqs
                beats.append(ev)
                continue
            if self.batch_steps and len(ev) == 5:
                if run and (ev[2] != run[-1][2] + 1 or len(run) >= MAX_BATCH_STEPS):
                    self._add(entries, groups, run)
                    run = []
                run.append(ev)
                continue
            if run:
                self._add(entries, groups, run)
                run = []
            self._add(entries, groups, [ev])
        if run:
            self._add(entries, groups, run)
        for ev in beats:  # after the events: a reader that sees a heartbeat sees what came before
            self._add(entries, groups, [ev])
        return entries, groups, max(map(_TS, batch), default=0.0)

    def _add(
        self,
        entries: list[dict[str, str]],
        groups: list[list[_Event]],
        evs: list[_Event],
        cols: np.ndarray | None = None,
    ) -> None:
        try:
            entries.append(self._entry(evs[0]) if len(evs) == 1 else self._steps_entry(evs, cols))
            groups.append(evs)
        except (TypeError, ValueError) as e:  # values are checked at the call; a last guard
            self.stats["rejected"] += len(evs)
            self._log_once(
                f"encode:{type(e).__name__}",
                "costexporter: cannot encode a %s event (%s): dropped",
                evs[0][0],
                e,
            )

    def _steps_entry(self, run: list[_Event], cols: np.ndarray | None = None) -> dict[str, str]:
        """One batched `steps` entry (format 1, docs/protocol.md), built with array operations:
        per step a few hundred nanoseconds on the sender thread, not an XADD's tens of
        microseconds. `cols`: the run's `_step_columns`, when already taken."""
        if cols is None:
            cols = _step_columns(run)
            if cols is None:
                raise TypeError("a batched entry holds only steps")
        return protocol.steps_entry(self.job, self.rank, self.session, run[0][2], cols[0], cols[1], cols[2])

    def _log_once(self, key: str, msg: str, *args: object) -> None:
        if key not in self._logged and len(self._logged) < 100:
            self._logged.add(key)
            log.error(msg, *args)

    def _requeue(self) -> None:
        if self._inflight:
            self._queue.extendleft(reversed(self._inflight))
            self._inflight = []

    def _entry(self, ev: _Event) -> dict[str, str]:
        if len(ev) == 5:
            type_, ts, seq, step, tokens = ev
            fields = {"step": step, "tokens": None if tokens < 0 else tokens}
        else:
            type_, ts, seq, fields = ev
        base = {
            "v": "1",
            "type": type_,
            "job": self.job,
            "ts": protocol.ts_text(round(ts * 1_000_000)),
            "rank": self.rank,
            "session": self.session,
            "seq": seq,
        }
        return protocol.encode_fields({**base, **(fields or {})})

    def _spill(self) -> None:
        """Redis is down and memory is filling: move the oldest half to the spool file."""
        n = len(self._queue) // 2
        self._spool_events(list(itertools.islice(self._queue, n)))  # on disk before it leaves the queue
        for _ in range(n):
            self._queue.popleft()

    def _spool_events(self, batch: list[_Event], into: spool.SpoolFile | None = None) -> None:
        """Encode and append to this reporter's spool (or `into`); counted spooled, or lost.
        The heartbeats of ranks other than 0 are not spooled: sent late they say nothing (only
        the watcher reads them), and a reporter of an older release that drained the file would
        post them to the events stream, where their seqs (the heartbeats' own) could pass for
        events' (counted `heartbeats_unsent`). Rank 0's are on the events' seqs and date its
        run's signs of life: spooled with the events."""
        if not self._beats_are_events and any(ev[0] == "heartbeat" for ev in batch):
            kept = [ev for ev in batch if ev[0] != "heartbeat"]
            self.stats["heartbeats_unsent"] += len(batch) - len(kept)
            batch = kept
        if not batch:
            return
        entries, _, _ = self._encode(batch)
        n = sum(map(_weight, entries))
        try:
            (into or self._spool).append(entries)
            self.stats["spooled"] += n
        except OSError as e:
            self._count_lost(n, e)

    def _count_lost(self, n: int, why: object) -> None:
        """Events that could not even be spooled (a full, read-only or forbidden disk): counted
        in stats['lost'], logged once per reason (a disk stays full for every later try)."""
        self.stats["lost"] += n
        key = f"lost:{getattr(why, 'errno', None) or why}"
        if key not in self._logged and len(self._logged) < 100:
            self._logged.add(key)
            log.error(
                "costexporter: cannot spool to %s (%s): %d events lost (counted in stats['lost'])",
                self._spool_path,
                why,
                n,
            )


def _name(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise TypeError(f"a phase name must be a non-empty string, got {name!r}")
    return coerce.text(name, "a phase name")


def _opt_count(x: object, name: str) -> int | None:
    return None if x is None else coerce.count(x, name, MAX_STEP)


@dataclass
class Delivery:
    """What the server refused in one batch: XADDs by entry index, and the side writes (ranks,
    meta: by entry index; the jobs index: None)."""

    failed: dict[int, Exception] = field(default_factory=dict)
    side_failed: list[tuple[int | None, Exception]] = field(default_factory=list)
    counter_failed: Exception | None = None  # the registrations counter's INCR (never retried)
    # The jobs index did not hold the job before this batch (its ZADD added it): a new job, or a
    # Redis that restarted empty (then the job's registrations and meta are gone too).
    job_new: bool = False


def send_entries(
    client: Any,
    prefix: str,
    job: str,
    entries: list[dict[str, str]],
    *,
    raise_on_error: bool = True,
    beats_cap: int | None = None,
    last_ts: float | None = None,
) -> Delivery:
    """One pipelined round trip: XADD each entry, keep `:ranks`, `:meta`, the jobs index and, with
    a register, the registrations counter.

    `beats_cap` (`protocol.beats_cap` of the job's width): heartbeats go to the job's heartbeat
    stream (`keys.beats_key`, `XADD MAXLEN ~ beats_cap`), the other entries to its events, so
    the agents never read a heartbeat; a heartbeat's `seq` is then the rank's count of
    heartbeats, apart from its events' (a gap in the events' seqs costs every reader memory).
    None: every entry to the events stream, as a file exported from it holds them.

    `last_ts`: the newest time among the entries (the jobs index's score), when the caller knows
    it; else read from them (a batched entry unpacked for its last step's time).

    A dead connection raises. The server's refusals raise the first one, or with
    `raise_on_error=False` come back per entry (a non-transactional pipeline applies the rest)."""
    pipe = client.pipeline(transaction=False)
    stream = keys.stream_key(prefix, job)
    beats = keys.beats_key(prefix, job)
    owners: list[tuple[int | None, bool]] = []  # per command: (entry index, is the XADD)
    newest = 0.0
    for i, e in enumerate(entries):
        if beats_cap is not None and e.get("type") == "heartbeat":
            pipe.xadd(beats, e, maxlen=beats_cap, approximate=True)
        else:
            pipe.xadd(stream, e)
        owners.append((i, True))
        if e.get("type") == "register":
            pipe.hset(keys.ranks_key(prefix, job), e["rank"], json.dumps(e, separators=(",", ":")))
            owners.append((i, False))
        elif e.get("type") == "meta":
            fields = {k: v for k, v in e.items() if k not in BASE_FIELDS}
            if fields:
                pipe.hset(keys.meta_key(prefix, job), mapping=fields)
                owners.append((i, False))
        if last_ts is None:
            with contextlib.suppress(TypeError, ValueError):  # (EventError is a ValueError)
                t = float(e.get("ts", 0.0))
                if e.get("type") == STEPS_TYPE:  # its last step's time: ts + the time deltas
                    t += int(unpack_steps(e["b"], int(e["n"]))[1].sum()) / 1e6
                newest = max(newest, t)
    # The jobs index is another slot than the job's keys: on a Redis Cluster this pipeline goes to
    # two nodes in no set order. Either order is safe: a reader that finds the job before its
    # stream or ranks reads nothing new yet, and a stream whose index write failed is listed by
    # the next batch (every batch repeats the ZADD; GT keeps the newest time).
    pipe.zadd(keys.jobs_key(prefix), {job: newest if last_ts is None else last_ts}, gt=True)
    zadd_at = len(owners)
    owners.append((None, False))
    version_at = None
    if any(e.get("type") == "register" for e in entries):
        # Agents run discovery when this counter moves, not every few seconds for every job. A
        # refusal (an ACL written before this key) costs only that: agents also re-read slowly.
        pipe.execute_command("INCR", keys.registrations_key(prefix))  # incr() sends INCRBY
        version_at = len(owners)
        owners.append((None, False))
    results = pipe.execute(raise_on_error=False)
    if raise_on_error:
        first = next((r for k, r in enumerate(results) if isinstance(r, Exception) and k != version_at), None)
        if first is not None:
            raise first
    out = Delivery()
    for k, ((at, is_xadd), r) in enumerate(zip(owners, results, strict=True)):
        if k == zadd_at:
            out.job_new = r == 1
        if k == version_at:
            out.counter_failed = r if isinstance(r, Exception) else None
        elif isinstance(r, Exception):
            if is_xadd and at is not None:  # (an XADD always has its entry's index)
                out.failed[at] = r
            else:
                out.side_failed.append((at, r))
    return out


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
