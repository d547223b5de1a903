"""What the agent's parts share, handed to each at construction instead of a dozen arguments and
callbacks into the Agent: the Redis client and the errors that mean it failed, where this agent
is (its configuration, host, process), the refusals of trainer-written data, the one-line
logger, and the guard that handles a key of the wrong type or a lost compare-and-set
(`KeyGuard`). Each part keeps its own state and its own `stats`; the Agent only sums them for
/metrics."""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from costexporter.core.causes import HardwareEvent
from costexporter.store import ledger, untrusted
from costexporter.store.client import RedisClient
from costexporter.store.keys import samples_key

if TYPE_CHECKING:
    from costexporter.services.agent_config import AgentConfig
    from costexporter.services.agent_job import AgentJob

log = logging.getLogger("costexporter.agent")


class Said:
    """Log a line once per key (a job's repeated trouble is said once, counted every time)."""

    def __init__(self) -> None:
        self.keys: set[tuple[Any, ...]] = set()

    def __call__(self, key: tuple[Any, ...], level: int, msg: str, *args: Any) -> None:
        if key not in self.keys:
            self.keys.add(key)
            log.log(level, msg, *args)

    def first(self, key: tuple[Any, ...]) -> bool:
        """True the first time `key` is asked about (the caller then says it its own way)."""
        if key in self.keys:
            return False
        self.keys.add(key)
        return True


HARDWARE_KEEP = 10_000  # hardware events kept (a storm of Xids keeps its newest)
HARDWARE_KEEP_MS = 6 * 3_600_000  # and for this long: a stretch's cause is read while it is open


@dataclass
class AgentContext:
    redis: RedisClient
    cfg: AgentConfig
    host: str
    instance: str  # this process: its watermarks say it wrote them
    redis_errors: tuple[type[BaseException], ...]
    refusals: untrusted.Refusals
    said: Said = field(default_factory=Said)
    lock: threading.Lock = field(default_factory=threading.Lock)  # what /metrics reads is swapped under it
    # The node's GPUs' hardware events of the last hours (the sampler's), for the wasted
    # stretches' causes: each job's round takes those of its own GPUs.
    hardware: collections.deque[HardwareEvent] = field(
        default_factory=lambda: collections.deque(maxlen=HARDWARE_KEEP)
    )


class KeyGuard:
    """A job's round met a key of the wrong type, or lost its watermark's compare-and-set. Keys
    only the agents write are moved aside (someone else created them: they never held the
    ledger) and written afresh next round; a trainer's own key of the wrong type is refused,
    counted and logged, every round until it is fixed. The other jobs go on either way."""

    def __init__(self, ctx: AgentContext) -> None:
        self.ctx = ctx
        self.stats: collections.Counter[str] = collections.Counter()

    def wrong_type(
        self,
        name: str,
        e: BaseException,
        wrong: dict[str, str] | None = None,
        *,
        job: AgentJob | None = None,
    ) -> None:
        """`wrong`: the keys found of the wrong type and the type each must have (None: looked
        up among the job's keys, its peers' sample streams too); `job`: the job as the agent
        holds it, read again next round."""
        ctx, cfg = self.ctx, self.ctx.cfg
        if wrong is None:
            expected = ledger.agent_keys(cfg.prefix, name, cfg.agent_id, ctx.host)
            for h in job.peers.hosts if job is not None else ():
                expected[samples_key(cfg.prefix, name, h)] = "stream"
            wrong = ledger.wrong_types(ctx.redis, expected)
        moved = ledger.set_aside(ctx.redis, wrong, cfg.prefix, name) if wrong else []
        if moved:
            ctx.refusals.refuse(
                name,
                "wrong_type",
                "%d key(s) only the agents write held another type (created by someone else): moved "
                "aside to <key>:wrongtype, booked afresh next round: %s",
                len(moved),
                ", ".join(untrusted.short(k) for k in moved[:3]),
            )
        else:
            ctx.refusals.refuse(name, "wrong_type", "a key of the job has the wrong type: not booked (%s)", e)
        if job is not None:
            job.loaded = False

    def conflict(self, job: str, e: ledger.Conflict) -> None:
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
        self.ctx.said(
            ("conflict", job),
            logging.WARNING,
            "job %r: its watermark changed under agent %r (%s): another process runs with the same "
            "agent id. The round is dropped and the ledger re-read, so nothing is booked twice; run "
            "one agent per --agent-id",
            job,
            self.ctx.cfg.agent_id,
            who,
        )
