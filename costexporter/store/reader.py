"""Reading a job's events from Redis incrementally: validate, de-duplicate, count rejections.

Used by the agent and the watcher. The reporter may send an event twice (a batch resent after a
lost reply, a spool sent again after a crash), so the reader de-duplicates on
(rank, session, seq); it tolerates events of one session arriving out of order (a spool sent
after newer events) by remembering the gaps below each session's highest sequence number.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from costexporter.core.booking import FROM_BEATS
from costexporter.core.events import (
    STEPS_TYPE,
    EventError,
    UnknownEventType,
    parse_event,
    parse_events,
    parse_heartbeat,
)
from costexporter.core.model import Event
from costexporter.store import keys, protocol, redisconn, untrusted
from costexporter.store.client import RedisClient

MAX_GAP = 100_000  # a jump larger than this is not remembered seq by seq


@dataclass
class _Seen:
    high: int = -1
    gaps: set[int] = field(default_factory=set)

    def first_time(self, seq: int) -> bool:
        if seq == self.high + 1:  # the next one, as nearly always: no gap to remember
            self.high = seq
            return True
        if seq > self.high:
            if seq - self.high - 1 <= MAX_GAP:
                self.gaps.update(range(self.high + 1, seq))
            self.high = seq
            return True
        if seq in self.gaps:
            self.gaps.discard(seq)
            return True
        return False


def _text(x: object) -> str:
    return x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x)


def _ts_of(ev: Event) -> int:
    return ev.ts_ms


def _fields(raw: dict[Any, Any] | list[Any]) -> dict[str, str]:
    """An entry's fields as text: a client that decodes replies (the protocol's) gives them so
    already, plain UTF-8 bytes are decoded at once (this counts at 10,000 events a poll), and
    anything else goes through `_text`. A flat [field, value, ...] list (`redisconn.xread_flat`)
    is paired first."""
    if isinstance(raw, list):
        it = iter(raw)
        raw = dict(zip(it, it, strict=False))
    if type(next(iter(raw), None)) is str:  # a decoding client decodes every key and value
        return raw
    try:
        return {k.decode(): v.decode() for k, v in raw.items()}
    except (AttributeError, UnicodeDecodeError):
        return {_text(k): _text(v) for k, v in raw.items()}


class EventReader:
    """Consumes `<prefix>:t:{<job>}:events` from `cursor` (a stream id) on.

    `stats` counts what was read: `accepted`, `duplicate`, `unknown_type`, `unknown_field` and
    one `rejected:<reason>` per kind of bad entry (missing_field, bad_type, foreign_job, ...);
    `rejections` keeps the newest (entry id, reason, message).

    `clock_offset_s[rank]`: the largest (event ts - arrival) among the rank's events of the
    newest poll that had any, arrival being the stream entry id (Redis's clock). An event
    cannot arrive before it happens, so this is a lower bound of how far the rank's clock runs
    ahead; with events every few seconds (rank 0's steps; heartbeats, in the events stream of an
    older trainer) it is close to the skew itself, a rank that posts seldom keeps its last
    measure (a negative value: the clock is behind, or every event of the poll was delivered
    late).
    """

    def __init__(
        self,
        client: RedisClient,
        job: str,
        prefix: str = protocol.DEFAULT_PREFIX,
        cursor: str = "0-0",
        *,
        beats: bool = False,
    ) -> None:
        self.client = client
        self.job = protocol.check_job(job)
        # beats: the job's heartbeat stream (`keys.beats_key`) instead. Only heartbeats count
        # there (anything else is `rejected:not_heartbeat`: what the agents book is read from
        # the events alone), and none is de-duplicated: a heartbeat read twice says the same,
        # and the heartbeats' seqs are their own.
        self.beats = beats
        self.key = keys.beats_key(prefix, job) if beats else keys.stream_key(prefix, job)
        self.cursor = cursor
        self.stats: collections.Counter[str] = collections.Counter()
        self.rejections: collections.deque[tuple[str, str, str]] = collections.deque(maxlen=100)
        self.clock_offset_s: dict[int, float] = {}
        self._seen: dict[tuple[int, str], _Seen] = {}
        self.last_read = 0  # entries the last poll read (valid or not): fewer than asked is the end

    def poll(self, count: int = 10_000, block_ms: int | None = None) -> list[Event]:
        """The next valid, new events (at most `count` entries read); advances the cursor."""
        resp = redisconn.xread_flat(self.client, {self.key: self.cursor}, count, block_ms)
        return self._consume([e for _key, entries in resp for e in entries])

    def consume(self, entries: list[Any]) -> list[Event]:
        """The valid, new events of (id, fields) entries read by the caller (a merge of the
        stream and the kept stream, in id order); the cursor moves to the last one."""
        return self._consume(entries)

    def _consume(self, entries: list[Any]) -> list[Event]:
        """The valid, new events of entries read after the cursor; advances it."""
        self.last_read = len(entries)
        now = time.time()  # the clock the timestamps are checked against, read once a batch
        if self.beats:
            return self._consume_beats(entries, now)
        out: list[Event] = []
        offsets: dict[int, float] = {}
        for entry_id, raw in entries:
            self.cursor = eid = entry_id if type(entry_id) is str else _text(entry_id)
            fields = _fields(raw)
            if fields.get("type") == STEPS_TYPE:
                evs = self._accept_batch(fields, eid, now)
                if not evs:
                    continue
                out += evs
                ev = max(evs, key=_ts_of)  # the latest step is the nearest to its arrival
            else:
                one = self._accept(fields, eid, now)
                if one is None:
                    continue
                out.append(one)
                ev = one
            d = (ev.ts_ms - int(eid.partition("-")[0])) / 1000  # the stream id is ms too
            if d > offsets.get(ev.rank, -math.inf):
                offsets[ev.rank] = d
        self.clock_offset_s.update(offsets)
        return out

    def read_all(self, count: int = 10_000) -> list[Event]:
        """Everything from the cursor to the end of the stream now."""
        out: list[Event] = []
        while True:
            batch_cursor = self.cursor
            got = self.poll(count)
            out += got
            if self.cursor == batch_cursor:
                return out

    def read_until(
        self,
        last_id: str,
        count: int = 10_000,
        keep: Callable[[Event], bool] | None = None,
        on_batch: Callable[[list[Event]], None] | None = None,
    ) -> list[Event]:
        """Every valid event from the cursor up to and including entry `last_id` (a second
        reader catching up with a first one, to rebuild what the first one folded); `keep`, a
        predicate, drops the others as they are read; `on_batch` takes each batch instead of
        the list growing (a long stream is never held whole)."""
        out: list[Event] = []
        if last_id in ("0", "0-0"):
            return out
        while True:
            lo = "-" if self.cursor in ("0", "0-0") else f"({self.cursor}"
            entries = self.client.xrange(self.key, min=lo, max=last_id, count=count)
            for entry_id, raw in entries:
                self.cursor = _text(entry_id)
                fields = _fields(raw)
                if fields.get("type") == STEPS_TYPE:
                    out += [ev for ev in self._accept_batch(fields, self.cursor) if keep is None or keep(ev)]
                    continue
                ev = self._accept(fields, self.cursor)
                if ev is not None and (keep is None or keep(ev)):
                    out.append(ev)
            if on_batch is not None:
                on_batch(out)
                out = []
            if len(entries) < count:
                return out

    def position(self) -> dict[str, Any]:
        """What a reader resuming at `cursor` needs to de-duplicate as this one would (stored
        with a persisted fold): per (rank, session) the highest seq and the gaps below it."""
        return {
            "cursor": self.cursor,
            "seen": [[r, s, x.high, sorted(x.gaps)] for (r, s), x in self._seen.items()],
        }

    def restore(self, pos: dict[str, Any]) -> None:
        """Resume at a stored `position()` (ValueError/KeyError/TypeError if it is not one)."""
        seen = {}
        for r, s, high, gaps in pos["seen"]:
            seen[(int(r), str(s))] = _Seen(int(high), {int(g) for g in gaps})
        cursor = str(pos["cursor"])
        a, _, b = cursor.partition("-")
        int(a), int(b or 0)
        self.cursor, self._seen = cursor, seen

    def _accept_batch(self, fields: dict[str, str], entry_id: str, now: float | None = None) -> list[Event]:
        """The new steps of a batched `steps` entry (each de-duplicated on its own seq, so a
        batch resent whole, or cut otherwise, still gives each step once); a bad entry is
        counted as rejected whole."""
        try:
            evs = parse_events(fields, job=self.job, now=now, strict_ids=True)
        except EventError as e:
            self.stats[f"rejected:{e.reason}"] += 1
            self.rejections.append((entry_id, e.reason, str(e)))
            return []
        if evs[0].get("_unknown_fields"):
            self.stats["unknown_field"] += 1
        seen = self._seen.get((evs[0].rank, evs[0].session))
        if seen is None:
            seen = self._seen[(evs[0].rank, evs[0].session)] = _Seen()
        out = [ev for ev in evs if seen.first_time(ev.seq)]
        if len(out) < len(evs):
            self.stats["duplicate"] += len(evs) - len(out)
        self.stats["accepted"] += len(out)
        return out

    def _consume_beats(self, entries: list[Any], now: float) -> list[Event]:
        """The heartbeats of the heartbeat stream's entries, each checked as any event (not
        de-duplicated: a heartbeat twice says the same); anything else refused, counted."""
        out: list[Event] = []
        job = self.job
        for entry_id, raw in entries:
            self.cursor = eid = entry_id if type(entry_id) is str else _text(entry_id)
            fields = _fields(raw)
            if fields.get("type") != "heartbeat":
                self.stats["rejected:not_heartbeat"] += 1
                msg = f"a {untrusted.short(str(fields.get('type')))} entry in the heartbeat stream"
                self.rejections.append((eid, "not_heartbeat", msg))
                continue
            try:
                ev = parse_heartbeat(fields, job=job, now=now)
            except EventError as e:
                self.stats[f"rejected:{e.reason}"] += 1
                self.rejections.append((eid, e.reason, str(e)))
                continue
            ev.fields[FROM_BEATS] = True  # no walk counts it: the agents never read it
            out.append(ev)
        if out:
            self.stats["accepted"] += len(out)
        return out

    def _accept(self, fields: dict[str, str], entry_id: str, now: float | None = None) -> Event | None:
        try:
            ev = parse_event(fields, job=self.job, now=now, strict_ids=True)
        except UnknownEventType:
            self.stats["unknown_type"] += 1
            return None
        except EventError as e:
            self.stats[f"rejected:{e.reason}"] += 1
            self.rejections.append((entry_id, e.reason, str(e)))
            return None
        seen = self._seen.get((ev.rank, ev.session))
        if seen is None:
            seen = self._seen[(ev.rank, ev.session)] = _Seen()
        if not seen.first_time(ev.seq):
            self.stats["duplicate"] += 1
            return None
        if ev.get("_unknown_fields"):
            self.stats["unknown_field"] += 1
        self.stats["accepted"] += 1
        return ev


def _per_round(readers: int, count: int) -> int:
    """Entries a round's XREAD asks of each stream: a reply of at most ~50k entries."""
    return max(100, min(count, 50_000 // readers))


def read_ahead(
    client: RedisClient, readers: list[EventReader], count: int = 10_000
) -> redisconn.SentXread | None:
    """The first XREAD of `read_all_many(client, readers, count)` sent now, for `read_all_many`'s
    `first`; None where it cannot be (a cluster, no reader). A reader's cursor moves only when
    its entries are consumed: a reply cancelled unread loses nothing."""
    if not readers or redisconn.is_cluster(client):
        return None
    streams = {r.key: r.cursor for r in readers}
    return redisconn.SentXread(client, streams, _per_round(len(readers), count))


def read_all_many(
    client: RedisClient,
    readers: list[EventReader],
    count: int = 10_000,
    on_wrong_type: Callable[[str], None] | None = None,
    first: redisconn.SentXread | None = None,
) -> dict[str, list[Event]]:
    """`read_all` of many jobs' streams with one XREAD per round trip for all of them (a watcher
    of 1,000 jobs: one round trip a poll, not two per job). Readers of one job (its heartbeat
    stream's and its events') give one list, in the readers' order: one XREAD reads them at one
    moment. A job with a key that is not a stream (its trainer's doing) is left out and handed
    to `on_wrong_type(job)`: one such key must not fail the XREAD of every other job. `first`:
    the first round's XREAD, sent ahead (`read_ahead` of the same readers and count)."""
    import redis

    out: dict[str, list[Event]] = {r.job: [] for r in readers}
    todo = list(readers)
    while todo:
        by_key = {r.key: r for r in todo}
        per = _per_round(len(todo), count)
        if redisconn.is_cluster(client):  # one XREAD a stream (a cluster refuses keys of many
            # slots in one command); the pipeline sends them to their nodes in one go each
            pipe = client.pipeline(transaction=False)
            for r in todo:
                pipe.xread({r.key: r.cursor}, count=per)
            got_all = pipe.execute(raise_on_error=False)
            bad = [(r, got) for r, got in zip(todo, got_all, strict=True) if isinstance(got, Exception)]
            _wrong_streams([r for r, _ in bad], [got for _, got in bad], out, on_wrong_type)
            todo = [r for r in todo if r.job in out]
            ok = [got for got in got_all if not isinstance(got, Exception)]
            resp = [kv for got in ok for kv in redisconn.stream_replies(got)]
        else:
            sent, first = first, None
            try:
                if sent is not None:
                    resp = sent.reply()
                else:
                    resp = redisconn.xread_flat(client, {r.key: r.cursor for r in todo}, count=per)
            except redis.ResponseError as e:
                if "WRONGTYPE" not in str(e):
                    raise
                types = _types(client, [r.key for r in todo])
                wrong = [r for r, t in zip(todo, types, strict=True) if t not in ("stream", "none")]
                if not wrong:
                    raise
                _wrong_streams(wrong, [e] * len(wrong), out, on_wrong_type)
                todo = [r for r in todo if r not in wrong and r.job in out]
                continue
        again = []
        for key, entries in resp:
            r = by_key[_text(key)]
            if r.job not in out:  # another of its keys is not a stream: the job is left out
                continue
            out[r.job] += r._consume(entries)
            if len(entries) >= per:
                again.append(r)
        todo = again
    return out


def _types(client: RedisClient, keys: list[str]) -> list[str]:
    """Each key's type (one pipeline)."""
    pipe = client.pipeline(transaction=False)
    for k in keys:
        pipe.type(k)
    return [_text(t) for t in pipe.execute()]


def _wrong_streams(
    wrong: list[EventReader],
    replies: list[Any],
    out: dict[str, list[Event]],
    on_wrong_type: Callable[[str], None] | None,
) -> None:
    """Readers whose XREAD failed on their key's type: out of the result, handed on."""
    import redis

    for r, e in zip(wrong, replies, strict=True):
        if isinstance(e, Exception) and not (isinstance(e, redis.ResponseError) and "WRONGTYPE" in str(e)):
            raise e
        if out.pop(r.job, None) is not None and on_wrong_type is not None:
            on_wrong_type(r.job)  # once a job
