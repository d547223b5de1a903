"""The reporter's wire: queued events encoded as stream entries (`Encoder`; a run of steps
becomes one batched `steps` entry, docs/protocol.md) and one pipelined round trip that writes
them with the job's side keys (`send_entries`). No thread and no state beyond the rank's
identity: the sender (`trainer/sender.py`) calls both, and so do the tools that post events."""

from __future__ import annotations

import contextlib
import json
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from costexporter.core.events import BASE_FIELDS, MAX_BATCH_STEPS, STEPS_TYPE, unpack_steps
from costexporter.store import keys, protocol
from costexporter.store.client import RedisClient

# A queued event: (type, ts, seq, fields), a step (type, ts, seq, step, tokens; -1: no tokens): no
# dict built on the trainer's thread. Encoded on the sender's.
Event = tuple[Any, ...]


_TS, _STEP, _TOKENS = operator.itemgetter(1), operator.itemgetter(3), operator.itemgetter(4)


def step_columns(run: list[Event]) -> np.ndarray | None:
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


def weight(entry: dict[str, str]) -> int:
    """How many events an entry carries (a batched `steps` entry: its `n`)."""
    return int(entry["n"]) if entry.get("type") == STEPS_TYPE else 1


class NotNow(Exception):
    """Some events are back in line for a later try (the server said: not now)."""


@dataclass(frozen=True, slots=True)
class Wire:
    """Who this reporter posts as: every entry carries the job, the rank and the session."""

    prefix: str
    job: str
    rank: int
    session: str


class Encoder:
    """Queued events to stream entries. `on_bad(events, error)`: an event that cannot be
    encoded (values are checked at the call: a last guard) is dropped and said there."""

    def __init__(
        self,
        wire: Wire,
        *,
        batch_steps: bool,
        beats_are_events: bool,
        on_bad: Callable[[list[Event], Exception], None],
    ) -> None:
        self.wire = wire
        self.batch_steps = batch_steps
        self.beats_are_events = beats_are_events
        self.on_bad = on_bad

    def encode(self, batch: list[Event]) -> tuple[list[dict[str, str]], list[list[Event]], float]:
        """The entries of queued events, the events each entry carries and the newest time among
        them: a run of steps with consecutive seqs becomes one batched `steps` entry (at most
        MAX_BATCH_STEPS)."""
        entries: list[dict[str, str]] = []
        groups: list[list[Event]] = []
        n = len(batch)
        cols = None
        if self.batch_steps and n > 1 and batch[-1][2] - batch[0][2] == n - 1:
            cols = step_columns(batch)
        if cols is not None:  # nothing but steps, one run of seqs (steps come from one thread, in order)
            for i in range(0, n, MAX_BATCH_STEPS):
                self._add(entries, groups, batch[i : i + MAX_BATCH_STEPS], cols[:, i : i + MAX_BATCH_STEPS])
            return entries, groups, int(cols[1].max()) / 1e6
        run: list[Event] = []
        beats: list[Event] = []
        for ev in batch:
            if ev[0] == "heartbeat" and not self.beats_are_events:  # its own stream and seqs
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
        groups: list[list[Event]],
        evs: list[Event],
        cols: np.ndarray | None = None,
    ) -> None:
        try:
            entries.append(self._entry(evs[0]) if len(evs) == 1 else self._steps_entry(evs, cols))
            groups.append(evs)
        except (TypeError, ValueError) as e:  # values are checked at the call; a last guard
            self.on_bad(evs, e)

    def _steps_entry(self, run: list[Event], cols: np.ndarray | None = None) -> dict[str, str]:
        """One batched `steps` entry (format 1, docs/protocol.md), built with array operations:
        per step a few hundred nanoseconds on the sender thread, not an XADD's tens of
        microseconds. `cols`: the run's `_step_columns`, when already taken."""
        if cols is None:
            cols = step_columns(run)
            if cols is None:
                raise TypeError("a batched entry holds only steps")
        w = self.wire
        return protocol.steps_entry(w.job, w.rank, w.session, run[0][2], cols[0], cols[1], cols[2])

    def _entry(self, ev: Event) -> dict[str, str]:
        if len(ev) == 5:
            type_, ts, seq, step, tokens = ev
            fields = {"step": step, "tokens": None if tokens < 0 else tokens}
        else:
            type_, ts, seq, fields = ev
        base = {
            "v": "1",
            "type": type_,
            "job": self.wire.job,
            "ts": protocol.ts_text(round(ts * 1_000_000)),
            "rank": self.wire.rank,
            "session": self.wire.session,
            "seq": seq,
        }
        return protocol.encode_fields({**base, **(fields or {})})


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
    client: RedisClient,
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
