"""The trainer's side of the contract: `StepReporter` posts events without slowing training.

    rep = StepReporter(job="qwen3-32b-ft")   # rank etc. from torchrun/SLURM env, Redis from env
    rep.step(step, tokens=n)                 # after each optimizer step
    with rep.phase("checkpoint", step=step):
        save()

The hot path only appends a tuple to a deque (a few hundred nanoseconds). A background thread
encodes batches and sends them with one pipelined round trip. When Redis is down or slow the
events wait in memory with their original timestamps and spill to a spool file on local disk
when memory fills; at exit the flush waits at most `exit_timeout_s` and spools whatever is left;
the next reporter (or agent) that starts on the host sends the spool. In a forked child
(DataLoader workers) the reporter goes quiet: the parent posts, the child never does.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import itertools
import json
import logging
import os
import re
import secrets
import socket
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

from . import protocol

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


def detect_gpu(local_rank: int) -> tuple[int | None, str | None]:
    """This rank's physical GPU index and UUID, via CUDA_VISIBLE_DEVICES and NVML when present."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    entry: str | None = str(local_rank)
    if visible:
        items = [x.strip() for x in visible.split(",") if x.strip()]
        entry = items[local_rank] if local_rank < len(items) else None
    if entry is None:
        return None, None
    if entry.startswith(("GPU-", "MIG-")):
        uuid, index = entry, None
    else:
        try:
            index, uuid = int(entry), None
        except ValueError:
            return None, None
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            if uuid is None:
                h = pynvml.nvmlDeviceGetHandleByIndex(index)
                uuid = pynvml.nvmlDeviceGetUUID(h)
            else:
                h = pynvml.nvmlDeviceGetHandleByUUID(uuid)
                index = pynvml.nvmlDeviceGetIndex(h)
            if isinstance(uuid, bytes):
                uuid = uuid.decode()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVML, no GPU, no permission: host + index will do
        pass
    return index, uuid


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


# A queued event: (type, ts, seq, fields). Built on the trainer's thread; encoded on the sender's.
_Event = tuple[str, float, int, dict | None]


class StepReporter:
    """Posts a rank's events to `<prefix>:{<job>}:events` (protocol v1, docs/protocol.md)."""

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
        meta: dict | None = None,
        heartbeat_s: float = 10.0,
        flush_interval_s: float = 0.05,
        batch_size: int = 2000,
        buffer_size: int = 100_000,
        exit_timeout_s: float = 2.0,
        spool_dir: str | Path | None = None,
        socket_timeout_s: float = 2.0,
        clock: Callable[[], float] = time.time,
        started_at: float | None = None,
    ) -> None:
        self.job = protocol.check_job(job)
        self.prefix = prefix or os.environ.get("COSTEXPORTER_PREFIX", protocol.DEFAULT_PREFIX)
        self.redis_url = redis_url or os.environ.get("COSTEXPORTER_REDIS_URL", protocol.DEFAULT_REDIS_URL)
        env_rank, env_local, env_world = detect_ranks()
        self.rank = env_rank if rank is None else rank
        self.local_rank = env_local if local_rank is None else local_rank
        self.world_size = env_world if world_size is None else world_size
        self.host = host or os.environ.get("COSTEXPORTER_HOST") or socket.gethostname()
        if gpu_uuid is None and gpu_index is None:
            gpu_index, gpu_uuid = detect_gpu(self.local_rank)
        self.gpu_index = self.local_rank if gpu_index is None else gpu_index
        self.gpu_uuid = gpu_uuid
        self.session = secrets.token_hex(8)
        self._clock = clock  # Unix seconds; a simulation passes its own
        self.heartbeat_s = heartbeat_s
        self.flush_interval_s = flush_interval_s
        self.batch_size = batch_size
        self.capacity = buffer_size
        self.exit_timeout_s = exit_timeout_s
        self.spool_dir = _writable_dir(Path(spool_dir) if spool_dir else default_spool_dir())
        self._spool_path = self.spool_dir / f"{_safe(self.prefix)}.{_safe(self.job)}.{self.session}.jsonl"

        self._queue: collections.deque[_Event] = collections.deque()
        self._seq = itertools.count()
        self._inflight: list[_Event] = []
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._inactive = False  # set in a forked child: the hot path returns at once
        self._closed = False
        self._stopping = False
        self._warned_overflow = False
        self.stats = collections.Counter()

        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # No client-side retries: the sender loop owns backoff, so a dead server costs one attempt.
        self._redis = redis.Redis.from_url(
            self.redis_url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=min(1.0, socket_timeout_s),
            retry=Retry(NoBackoff(), 0),
        )
        self._redis_errors = (redis.ConnectionError, redis.TimeoutError, OSError)
        self._response_error = redis.ResponseError

        self._post(
            "register",
            ts=started_at,
            host=self.host,
            gpu_uuid=self.gpu_uuid,
            gpu=self.gpu_index,
            local_rank=self.local_rank,
            world_size=self.world_size,
            pid=os.getpid(),
        )
        if resume_from is None:
            self._post("run", ts=started_at, state="start")
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

        `ts` (Unix seconds) when it finished, if not now."""
        if self._inactive:
            return
        q = self._queue
        if len(q) >= self.capacity:
            self._overflow()
            return
        q.append(
            ("step", self._clock() if ts is None else ts, next(self._seq), {"step": step, "tokens": tokens})
        )

    def phase_begin(self, name: str, step: int | None = None, ts: float | None = None) -> None:
        self._post("phase", ts=ts, name=name, state="begin", step=step)

    def phase_end(self, name: str, step: int | None = None, ts: float | None = None) -> None:
        self._post("phase", ts=ts, name=name, state="end", step=step)

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
        self._post("run", ts=ts, state="resume", step=int(step))

    def meta(self, ts: float | None = None, **fields: object) -> None:
        """Job metadata (gpu_model, team, cost_center, price_per_gpu_hour, budget); last write wins."""
        self._post("meta", ts=ts, **fields)

    def preflight(self, passed: bool, checks: object = None) -> None:
        """The pre-run invariant gate's result (REFERENCE R5)."""
        self._post("preflight", passed=bool(passed), checks=checks)

    def _post(self, type_: str, ts: float | None = None, **fields: object) -> None:
        if self._inactive:
            return
        if len(self._queue) >= self.capacity:
            self._overflow()
            return
        self._queue.append((type_, self._clock() if ts is None else ts, next(self._seq), fields))

    def _overflow(self) -> None:
        self.stats["overflow"] += 1
        if not self._warned_overflow:
            self._warned_overflow = True
            log.warning(
                "costexporter: event buffer full (%d): dropping events until it drains", self.capacity
            )

    # ---- lifecycle -------------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued event has reached Redis; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._queue or self._inflight:
            self._idle.clear()
            self._wake.set()
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            self._idle.wait(0.05 if remaining is None else min(0.05, remaining))
        return True

    def close(self, timeout: float | None = None, *, end_run: bool = True, ts: float | None = None) -> None:
        """Post `run end` (unless `end_run` is False: a crash is not a clean end), flush for at
        most `timeout` (default exit_timeout_s) and spool what is left."""
        if self._closed or os.getpid() != self._pid:
            return
        if end_run:
            self._post("run", ts=ts, state="end")
        self._closed = True
        timeout = self.exit_timeout_s if timeout is None else timeout
        self.flush(timeout)
        self._stopping = True
        self._wake.set()
        leftover = list(self._inflight) + list(self._queue)
        if leftover:
            self._spool(leftover)
        self._inactive = True

    def __enter__(self) -> StepReporter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(end_run=exc_type is None)

    # ---- the sender thread -----------------------------------------------------------------
    def _run(self) -> None:
        backoff = 0.0
        next_beat = time.monotonic() + self.heartbeat_s
        drained_others = False
        while not self._stopping:
            self._wake.wait(backoff or self.flush_interval_s)
            self._wake.clear()
            if self._stopping:
                break
            now = time.monotonic()
            if now >= next_beat and not self._closed:
                self._post("heartbeat")
                next_beat = now + self.heartbeat_s
            try:
                if not drained_others:
                    drain_spool(self._redis, self.spool_dir, self.prefix, skip=self._spool_path)
                    drained_others = True
                if self._spool_path.exists():
                    drain_spool(self._redis, self.spool_dir, self.prefix, only=self._spool_path)
                while self._queue and not self._stopping:
                    n = min(len(self._queue), self.batch_size)
                    self._inflight = [self._queue.popleft() for _ in range(n)]
                    self._send(self._inflight)
                    self.stats["sent"] += n
                    self._inflight = []
                backoff = 0.0
            except self._redis_errors as e:
                self._requeue()
                self.stats["send_errors"] += 1
                if backoff == 0.0:
                    log.warning("costexporter: Redis unreachable (%s); buffering events", e)
                backoff = min(max(backoff * 2, 0.1), 2.0)
                if len(self._queue) > self.capacity // 2:
                    self._spill()
            except self._response_error as e:  # e.g. NOPERM: retrying will not help; keep them on disk
                log.error("costexporter: Redis refused events (%s); spooled to %s", e, self._spool_path)
                self._spool(self._inflight)
                self._inflight = []
                backoff = 5.0
            except Exception:  # the sender must never die: log and keep going
                log.exception("costexporter: unexpected error in the reporter thread")
                self._requeue()
                backoff = 1.0
            if not self._queue and not self._inflight:
                self._idle.set()

    def _requeue(self) -> None:
        if self._inflight:
            self._queue.extendleft(reversed(self._inflight))
            self._inflight = []

    def _entry(self, ev: _Event) -> dict[str, str]:
        type_, ts, seq, fields = ev
        base = {
            "v": "1",
            "type": type_,
            "job": self.job,
            "ts": f"{ts:.6f}",
            "rank": self.rank,
            "session": self.session,
            "seq": seq,
        }
        return protocol.encode_fields({**base, **(fields or {})})

    def _send(self, batch: list[_Event]) -> None:
        send_entries(self._redis, self.prefix, self.job, [self._entry(ev) for ev in batch])

    def _spill(self) -> None:
        """Redis is down and memory is filling: move the oldest half to the spool file."""
        n = len(self._queue) // 2
        batch = [self._queue.popleft() for _ in range(n)]
        self._spool(batch)

    def _spool(self, batch: list[_Event]) -> None:
        try:
            with self._spool_path.open("a") as f:
                for ev in batch:
                    f.write(json.dumps(self._entry(ev), separators=(",", ":")) + "\n")
            self.stats["spooled"] += len(batch)
        except OSError as e:
            self.stats["lost"] += len(batch)
            log.error(
                "costexporter: cannot write spool %s (%s): %d events lost", self._spool_path, e, len(batch)
            )


def send_entries(client, prefix: str, job: str, entries: list[dict[str, str]]) -> None:
    """One pipelined round trip: XADD each entry, keep `:ranks`, `:meta` and the jobs index."""
    pipe = client.pipeline(transaction=False)
    stream = protocol.stream_key(prefix, job)
    last_ts = 0.0
    for e in entries:
        pipe.xadd(stream, e)
        if e.get("type") == "register":
            pipe.hset(protocol.ranks_key(prefix, job), e["rank"], json.dumps(e, separators=(",", ":")))
        elif e.get("type") == "meta":
            fields = {
                k: v for k, v in e.items() if k not in ("v", "type", "job", "ts", "rank", "session", "seq")
            }
            if fields:
                pipe.hset(protocol.meta_key(prefix, job), mapping=fields)
        last_ts = max(last_ts, float(e.get("ts", 0.0)))
    pipe.zadd(protocol.jobs_key(prefix), {job: last_ts}, gt=True)
    pipe.execute()


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)[:120]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def drain_spool(
    client, spool_dir: Path, prefix: str, *, skip: Path | None = None, only: Path | None = None
) -> int:
    """Send spooled events of this host to Redis; returns how many. Safe to run concurrently:
    a file is claimed by renaming it, and a claim whose process died is taken over."""
    sent = 0
    candidates = [only] if only else sorted(spool_dir.glob(f"{_safe(prefix)}.*.jsonl*"))
    for path in candidates:
        if path is None or (skip is not None and path == skip) or not path.exists():
            continue
        name = path.name
        if ".sending-" in name:
            pid = int(name.rsplit(".sending-", 1)[1].split("-")[0] or 0)
            if _pid_alive(pid):
                continue
            base = name.rsplit(".sending-", 1)[0]
        else:
            base = name
        claimed = path.with_name(f"{base}.sending-{os.getpid()}-{secrets.token_hex(3)}")
        try:
            os.rename(path, claimed)
        except OSError:
            continue  # another process claimed it first
        try:
            entries = []
            with claimed.open() as f:
                for line in f:
                    with contextlib.suppress(ValueError):
                        entries.append(json.loads(line))
            by_job: dict[str, list[dict[str, str]]] = {}
            for e in entries:
                if isinstance(e, dict) and e.get("job"):
                    by_job.setdefault(str(e["job"]), []).append({k: str(v) for k, v in e.items()})
            for job, es in by_job.items():
                for i in range(0, len(es), 2000):
                    send_entries(client, prefix, job, es[i : i + 2000])
            sent += len(entries)
            claimed.unlink()
        except Exception:
            # Give the file back for a later try (the reader de-duplicates what was sent twice).
            with contextlib.suppress(OSError):
                os.rename(claimed, path.with_name(base))
            raise
    return sent


def _close_at_exit(ref: weakref.ref) -> None:
    rep = ref()
    if rep is not None:
        try:
            rep.close()
        except Exception:  # never fail interpreter shutdown
            log.exception("costexporter: error while closing the reporter at exit")
