"""The reporter's parts on their own: the wire (`transport.Encoder`, `send_entries`), the spool
(`spooler.Spooler`) and the queue (`sender.Sender`), each against a real Redis where it writes
one. The reporter's own tests (test_client.py, test_steps_batch.py, test_spool_disk_full.py,
faults/test_client_faults.py) drive the same parts through `StepReporter`."""

from __future__ import annotations

import collections
import itertools
import time

import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from costexporter.store.reader import EventReader
from costexporter.trainer.sender import Pacing, Sender
from costexporter.trainer.spooler import Spooler
from costexporter.trainer.transport import Encoder, Event, Wire, send_entries, weight

T0 = 1_700_000_000.0

# One queued event of each shape the reporter queues: a step (5-tuple), a phase, a heartbeat.
_event = st.one_of(
    st.tuples(st.just("step"), st.integers(0, 10**6), st.integers(0, 10**9)),
    st.tuples(st.just("phase"), st.sampled_from(["checkpoint", "eval"]), st.sampled_from(["begin", "end"])),
    st.tuples(st.just("heartbeat")),
)


def _queue(shapes: list[tuple[object, ...]]) -> list[Event]:
    """The tuples the reporter's hot path queues, seqs in order (rank != 0's heartbeats on their own)."""
    seq, beat_seq, out = itertools.count(), itertools.count(), []
    for i, s in enumerate(shapes):
        ts = T0 + i * 0.01
        if s[0] == "step":
            out.append(("step", ts, next(seq), s[1], s[2]))
        elif s[0] == "phase":
            out.append(("phase", ts, next(seq), {"name": s[1], "state": s[2]}))
        else:
            out.append(("heartbeat", ts, next(beat_seq), {}))
    return out


@given(shapes=st.lists(_event, max_size=60), batch=st.booleans())
@settings(max_examples=150, deadline=None)
def test_the_encoder_carries_every_event_once_and_a_heartbeat_after_the_events(shapes, batch):
    bad: list[object] = []
    enc = Encoder(Wire("p", "j", 3, "s"), batch_steps=batch, beats_are_events=False, on_bad=bad.append)
    queued = _queue(shapes)
    entries, groups, newest = enc.encode(queued)
    assert not bad
    assert sorted(map(id, (ev for g in groups for ev in g))) == sorted(map(id, queued))  # each once
    assert sum(map(weight, entries)) == len(queued)
    types = [e["type"] for e in entries]
    assert "heartbeat" not in types[: len(types) - types.count("heartbeat")]
    if not batch:
        assert "steps" not in types
    assert newest == max((ev[1] for ev in queued), default=0.0)


def test_an_event_that_cannot_be_encoded_is_handed_to_on_bad_and_the_rest_go(prefix, shared):
    bad: list[tuple[list[Event], Exception]] = []
    enc = Encoder(
        Wire(prefix, "j", 0, "s"),
        batch_steps=True,
        beats_are_events=True,
        on_bad=lambda e, x: bad.append((e, x)),
    )
    queued: list[Event] = [
        ("register", T0, 0, {"host": "h", "gpu": 0, "world_size": 1}),
        (
            "meta",
            T0,
            1,
            {"x": object()},
        ),  # not JSON-plain: the reporter checks at the call, this is the guard
        ("step", T0 + 1, 2, 1, -1),
        ("step", T0 + 2, 3, 2, 100),
    ]
    entries, _, _ = enc.encode(queued)
    assert [ev[0][0] for ev, _ in bad] == ["meta"] and isinstance(bad[0][1], TypeError | ValueError)
    send_entries(shared, prefix, "j", entries)
    got = EventReader(shared, "j", prefix).read_all()
    assert [(e.type, e.int_field("step")) for e in got if e.type == "step"] == [("step", 1), ("step", 2)]


def _spooler(tmp_path, wire: Wire, logged: list[str]) -> tuple[Spooler, collections.Counter[str]]:
    stats: collections.Counter[str] = collections.Counter()
    enc = Encoder(wire, batch_steps=False, beats_are_events=True, on_bad=lambda e, x: None)
    spooler = Spooler(
        wire,
        tmp_path,
        "redis://x/0",
        enc,
        stats,
        lambda key, msg, *a: logged.append(msg % a),
        batch_size=4,
        retry_errors=(ConnectionError,),
    )
    return spooler, stats


def test_the_spool_sends_what_it_holds_once_across_refusals_and_keeps_the_rest(tmp_path):
    """A deliver that refuses some entries for now: they stay in the file, in order, and the next
    drain sends them; nothing is sent twice, nothing is lost."""
    wire = Wire("p", "j", 0, "s")
    spooler, stats = _spooler(tmp_path, wire, [])
    queued = [("step", T0 + i, i, i, -1) for i in range(10)]
    spooler.put(queued)
    assert stats["spooled"] == 10 and spooler.spool.lines
    sent: list[int] = []
    refuse = {3, 7}  # step numbers refused on the first try

    def deliver(entries: list[dict[str, str]], key: str, spooled: bool) -> tuple[int, list[int]]:
        assert spooled
        retry = [i for i, e in enumerate(entries) if int(e["step"]) in refuse]
        sent.extend(int(e["step"]) for i, e in enumerate(entries) if i not in retry)
        return len(entries) - len(retry), retry

    try:
        spooler.drain_own(deliver, lambda: True, lambda: False)
    except Exception as e:  # noqa: BLE001 - NotNow: some were refused for now
        assert type(e).__name__ == "NotNow"
    assert sent == [0, 1, 2]  # the first chunk's refusal stops the drain; the rest wait in order
    assert [int(e["step"]) for e in spooler.spool.read()] == [3, 4, 5, 6, 7, 8, 9]
    refuse.clear()
    spooler.drain_own(deliver, lambda: True, lambda: False)
    assert sorted(sent) == list(range(10)) and len(sent) == 10
    assert stats["unspooled"] == 10 and stats["sent"] == 10  # each counted once, when it arrived
    assert spooler.spool.read() == []


def test_another_reporters_file_is_drained_and_removed_a_foreign_one_left(tmp_path):
    left, _ = _spooler(tmp_path, Wire("p", "j", 1, "crashed"), [])
    left.put([("step", T0 + i, i, i, -1) for i in range(5)])
    left.close(left.spool)
    foreign, _ = _spooler(tmp_path, Wire("q", "j", 1, "other"), [])  # another prefix: not ours to send
    foreign.put([("step", T0, 0, 0, -1)])
    foreign.close(foreign.spool)
    me, _ = _spooler(tmp_path, Wire("p", "j", 0, "me"), [])
    got: list[dict[str, str]] = []

    def deliver(entries: list[dict[str, str]], key: str, spooled: bool) -> tuple[int, list[int]]:
        got.extend(entries)
        return len(entries), []

    me.drain_others(deliver, lambda: True, lambda: False)
    assert [(e["session"], int(e["step"])) for e in got] == [("crashed", i) for i in range(5)]
    assert not left.spool_path.exists() and foreign.spool_path.exists()


def test_a_sender_whose_redis_is_down_spools_everything_at_shutdown_and_counts_it(tmp_path):
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    # As the reporter makes its client: no retries inside redis-py (the sender's loop backs off).
    dead = redis.Redis(port=1, socket_connect_timeout=0.2, socket_timeout=0.2, retry=Retry(NoBackoff(), 0))
    wire = Wire("p", "j", 0, "s")
    pacing = Pacing(
        heartbeat_s=3600, flush_interval_s=0.05, batch_size=100, capacity=1000, batch_steps=True, io_wait_s=2
    )
    sender = Sender(
        wire,
        dead,
        (redis.ConnectionError, redis.TimeoutError, OSError),
        pacing,
        spool_dir=tmp_path,
        destination="redis://127.0.0.1:1/0",
        beats_cap=None,
        on_job_lost=lambda: None,
        on_first_send=lambda: None,
        clock=time.time,
    )
    sender.start("test-sender")
    for i in range(50):
        sender.post("phase", T0 + i, {"name": "eval", "state": "begin" if i % 2 == 0 else "end"})
    assert not sender.flush(0.5)  # nothing can arrive
    sender.shutdown()
    assert sender.stats["spooled"] == 50 and sender.stats["sent"] == 0 and sender.stats["send_errors"] >= 1
    lines = sender.spooler.spool_path.read_text().splitlines()
    assert len(lines) == 51  # the header and every event
