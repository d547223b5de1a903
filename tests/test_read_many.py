"""`read_all_many` (one XREAD for many jobs, its entries left flat by `redisconn.xread_flat`)
gives every job the events its entries read by XRANGE (redis-py's own reply) give, on RESP2 and
RESP3 connections, decoding or not; one reader's `read_all` too. Real Redis (the shared one, a
prefix per test)."""

from __future__ import annotations

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from costexporter.store import keys, protocol
from costexporter.store.reader import EventReader, read_ahead, read_all_many

from .conftest import SHARED_URL

T0 = 1_760_000_000.0

# One entry: (job index, kind, rank, extra field?, valid?, posted twice?)
ENTRY = st.tuples(
    st.integers(0, 3),
    st.sampled_from(["step", "heartbeat", "phase"]),
    st.integers(0, 2),
    st.booleans(),
    st.booleans(),
    st.booleans(),
)


def _fields(job: str, kind: str, rank: int, seq: int, extra: bool, valid: bool) -> dict[str, str]:
    f: dict[str, object] = {"v": "1", "type": kind, "job": job, "ts": f"{T0 + seq:.3f}", "rank": rank}
    f |= {"session": f"s{rank}", "seq": seq}
    if kind == "step":
        f["step"] = seq
    elif kind == "phase":
        f |= {"name": "eval", "state": "begin" if seq % 2 else "end"}
    if extra:
        f["note"] = "ünïcode"  # an unknown field: counted, the event kept
    if not valid:
        f["ts"] = "yesterday"  # refused, counted
    return protocol.encode_fields(f)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    entries=st.lists(ENTRY, max_size=60),
    resp=st.sampled_from([2, 3]),
    decode=st.booleans(),
    ahead=st.booleans(),
)
def test_one_xread_for_many_jobs_reads_what_each_jobs_own_reader_reads(
    shared, prefix, entries, resp, decode, ahead
):
    jobs = [f"j{i}" for i in range(4)]
    for job in jobs:
        shared.delete(keys.stream_key(prefix, job), keys.beats_key(prefix, job))
    for seq, (i, kind, rank, extra, valid, twice) in enumerate(entries, 1):
        key = (keys.beats_key if kind == "heartbeat" else keys.stream_key)(prefix, jobs[i])
        for _ in range(1 + twice):  # a resent batch: an event is taken once, a heartbeat says it again
            shared.xadd(key, _fields(jobs[i], kind, rank, seq, extra, valid))
    client = redis.Redis.from_url(SHARED_URL, decode_responses=decode, protocol=resp)

    def readers() -> list[EventReader]:
        out = []
        for job in jobs:
            out += [EventReader(client, job, prefix, beats=True), EventReader(client, job, prefix)]
        return out

    many = readers()
    # Several round trips (cursors advance); `ahead`: the first one sent before the call.
    first = read_ahead(client, many, count=7) if ahead else None
    got = read_all_many(client, many, count=7, first=first)
    ranged, alone = readers(), readers()
    for k, job in enumerate(jobs):
        beats, events = ranged[2 * k], ranged[2 * k + 1]
        want = beats.consume(client.xrange(beats.key)) + events.consume(client.xrange(events.key))
        assert got[job] == want
        assert alone[2 * k].read_all(count=7) + alone[2 * k + 1].read_all(count=7) == want
    assert len(many) == 2 * len(jobs)
    for a, b, c in zip(many, ranged, alone, strict=True):
        assert (a.cursor, dict(a.stats)) == (b.cursor, dict(b.stats)) == (c.cursor, dict(c.stats))
    twice_beats = sum(1 for e in entries if e[4] and e[5] and e[1] == "heartbeat")
    assert sum(len(v) for v in got.values()) == sum(1 for e in entries if e[4]) + twice_beats


def test_an_xread_sent_ahead_answers_later_and_a_cancelled_one_leaves_the_pool_sound(shared, prefix):
    # Two jobs, one with an events key that is not a stream (its trainer's doing): the XREAD
    # sent ahead is refused WRONGTYPE, that job is left out and the other read in full.
    shared.set(keys.stream_key(prefix, "bad"), "oops")
    for seq in range(3):
        shared.xadd(keys.stream_key(prefix, "ok"), _fields("ok", "step", 0, seq + 1, False, True))
    client = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    pool = client.connection_pool
    many = [EventReader(client, job, prefix) for job in ("bad", "ok")]
    sent = read_ahead(client, many)
    assert sent is not None and len(pool._in_use_connections) == 1  # its own connection, held
    shared.xadd(keys.stream_key(prefix, "ok"), _fields("ok", "step", 0, 9, False, True))  # after it
    wrong: list[str] = []
    got = read_all_many(client, many, on_wrong_type=wrong.append, first=sent)
    assert wrong == ["bad"] and [e.seq for e in got["ok"]] == [1, 2, 3, 9]  # read again: all of it
    assert not pool._in_use_connections
    with pytest.raises(RuntimeError):
        sent.reply()  # taken once

    # Cancelled unread: the connection is closed, so no later command reads the XREAD's reply
    # as its own, and the readers' cursors did not move: nothing is lost.
    again = [EventReader(client, "ok", prefix)]
    read_ahead(client, again).cancel()
    assert not pool._in_use_connections
    assert client.get(keys.stream_key(prefix, "bad")) == "oops"
    assert [e.seq for e in read_all_many(client, again)["ok"]] == [1, 2, 3, 9]


def test_an_xread_sent_ahead_to_a_redis_that_dies_raises_and_reads_all_once_it_is_back(tmp_path):
    # The server takes the XREAD but dies before answering it (paused, then killed): the reply
    # raises a connection error, the connection is closed and given back, and the cursor has not
    # moved, so the server restarted empty then written again is read whole.
    from .redis_server import RedisServer

    server = RedisServer(tmp_path / "redis").start()
    try:
        client = protocol.connect(server.url)
        admin = server.client()
        admin.xadd(keys.stream_key("p", "job"), _fields("job", "step", 0, 1, False, True))
        reader = EventReader(client, "job", "p")
        client.ping()  # a connection in the pool, set up before the pause
        admin.execute_command("CLIENT", "PAUSE", 60_000, "ALL")
        sent = read_ahead(client, [reader])
        assert sent is not None
        server.kill()
        with pytest.raises(redis.ConnectionError):
            read_all_many(client, [reader], first=sent)
        assert not client.connection_pool._in_use_connections and reader.cursor == "0-0"
        server.start()
        for seq in (1, 2):
            server.client().xadd(keys.stream_key("p", "job"), _fields("job", "step", 0, seq, False, True))
        got = read_all_many(client, [reader], first=read_ahead(client, [reader]))
        assert [e.seq for e in got["job"]] == [1, 2] and reader.stats["accepted"] == 2
    finally:
        server.stop()
