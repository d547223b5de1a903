"""Heartbeats in a stream of their own (`<p>:t:{job}:beats`): the watcher judges liveness from
it, the agents never read it, an older trainer's heartbeats in the events stream still count,
and the stream stays within its bound. Real Redis (the shared one, a prefix per test)."""

from __future__ import annotations

import logging
import time

import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from costexporter.core.booking import BookingConfig
from costexporter.services.watcher import WatchConfig, Watcher
from costexporter.store import keys, protocol
from costexporter.store.reader import EventReader
from costexporter.trainer.reporter import StepReporter
from costexporter.trainer.transport import send_entries

from .conftest import SHARED_URL

T0 = 1_760_000_000.0
JOB = "beats-job"


def entry(type_: str, t: float, rank: int, seq: int, **fields) -> dict[str, str]:
    base = {"v": "1", "type": type_, "job": JOB, "ts": f"{T0 + t:.3f}", "rank": rank, "session": f"s{rank}"}
    return protocol.encode_fields({**base, "seq": seq, **fields})


class Job:
    """Two ranks on two hosts, posted as the reporter posts them: events to the events stream,
    heartbeats (their own seqs) to the heartbeat stream, or, `old=True`, as a trainer of an
    older release does: heartbeats in the events stream, on the events' seqs."""

    def __init__(self, client: redis.Redis, prefix: str, old: bool = False) -> None:
        self.c, self.prefix, self.old = client, prefix, old
        self.seq = {0: 0, 1: 0}
        self.beat_seq = {0: 0, 1: 0}
        first = []
        for r in (0, 1):
            first.append(self._ev("register", 0, r, host=f"h{r}", gpu=0, world_size=2, local_rank=0))
            first.append(self._ev("run", 0, r, state="start"))
        self.send(first)

    def _ev(self, type_: str, t: float, rank: int, **fields) -> dict[str, str]:
        seq, self.seq[rank] = self.seq[rank], self.seq[rank] + 1
        return entry(type_, t, rank, seq, **fields)

    def send(self, entries: list[dict[str, str]]) -> None:
        cap = None if self.old else protocol.beats_cap(2)
        send_entries(self.c, self.prefix, JOB, entries, beats_cap=cap)

    def step(self, t: float, step: int) -> None:
        self.send([self._ev("step", t, 0, step=step, tokens=1)])

    def beat(self, t: float, rank: int) -> None:
        if self.old:
            self.send([self._ev("heartbeat", t, rank)])
            return
        seq, self.beat_seq[rank] = self.beat_seq[rank], self.beat_seq[rank] + 1
        self.send([entry("heartbeat", t, rank, seq)])


def watcher(prefix: str, now: list[float]) -> Watcher:
    cfg = WatchConfig(
        redis_url=SHARED_URL,
        prefix=prefix,
        booking=BookingConfig(stall_floor_s=60.0),
        heartbeat_timeout_s=60.0,
        clock=lambda: now[0],
        register_position_s=None,
    )
    return Watcher(cfg)


def _judge(shared: redis.Redis, prefix: str, old: bool) -> list[tuple[str, object]]:
    """Steps for 100 s with every rank beating every 10 s; then no step while both still beat
    (hung, not crashed: their beats say they live); then rank 1 stops beating (crashed, rank 1
    named: its silence started first)."""
    job, now = Job(shared, prefix, old), [T0]
    w = watcher(prefix, now)
    out = []
    try:
        step = 0
        for t in range(10, 401, 10):
            if t <= 100:
                step += 1
                job.step(t, step)
            job.beat(t, 0)
            if t <= 250:
                job.beat(t, 1)
            now[0] = T0 + t + 1
            st_ = w.poll()[JOB]
            out.append((t, st_.state, (st_.suspect or {}).get("rank")))
    finally:
        w.stop()
    return out


def _states(seen: list[tuple[int, str, object]]) -> dict[int, tuple[str, object]]:
    return {t: (s, r) for t, s, r in seen}


def test_the_watcher_judges_running_hung_and_crashed_from_the_heartbeat_stream(shared, prefix):
    seen = _states(_judge(shared, prefix, old=False))
    assert seen[100][0] == "running", seen
    # No step since 100 s: hung past the stall threshold, never crashed while both ranks beat.
    assert seen[250][0] == "hung", seen
    assert all(seen[t][0] != "crashed" for t in range(10, 301, 10)), seen
    # Rank 1's last beat at 250 s; 60 s of silence later: crashed, rank 1 named.
    assert seen[320] == ("crashed", 1), seen
    # The heartbeats are in their stream; the events stream holds none.
    events = shared.xrange(keys.stream_key(prefix, JOB))
    beats = shared.xrange(keys.beats_key(prefix, JOB))
    assert not [f for _, f in events if f["type"] == "heartbeat"], events
    assert len(beats) == 40 + 25 and {f["type"] for _, f in beats} == {"heartbeat"}


def test_an_older_trainers_heartbeats_in_the_events_stream_still_count(shared, prefix):
    seen = _states(_judge(shared, prefix, old=True))
    assert seen[100][0] == "running" and seen[250][0] == "hung", seen
    assert all(seen[t][0] != "crashed" for t in range(10, 301, 10)), seen
    assert seen[320] == ("crashed", 1), seen
    assert not shared.exists(keys.beats_key(prefix, JOB))


def test_a_rank_beating_only_in_the_heartbeat_stream_is_alive(shared, prefix):
    """Without its beats stream read, rank 1 (no event since its register) would be crashed."""
    job, now = Job(shared, prefix), [T0]
    w = watcher(prefix, now)
    try:
        for t in range(10, 201, 10):
            job.step(t, t // 10)
            job.beat(t, 0)
            job.beat(t, 1)
            now[0] = T0 + t + 1
            st_ = w.poll()[JOB]
            assert st_.state == "running", (t, st_)
        assert w.beats[JOB].stats["accepted"] == 40
    finally:
        w.stop()


def test_a_ranks_heartbeats_never_reach_the_events_stream_nor_an_agents_read_but_rank_0s_do(
    shared, prefix, tmp_path
):
    """Rank 1's heartbeats go to the heartbeat stream alone, on seqs of their own. Rank 0's go
    to the events stream on the events' seqs (no gap a reader must remember): the agents date a
    run that stopped without `run end` by them."""
    reps = [
        StepReporter(
            JOB, SHARED_URL, rank=r, world_size=4, prefix=prefix, spool_dir=tmp_path, heartbeat_s=0.02
        )
        for r in (1, 0)
    ]
    beats_key = keys.beats_key(prefix, JOB)
    try:
        deadline = time.monotonic() + 10
        step = 0
        while shared.xlen(beats_key) < 10 and time.monotonic() < deadline:
            step += 1
            for rep in reps:
                rep.step(step)
            time.sleep(0.01)
    finally:
        for rep in reps:
            rep.close()
    beats = shared.xrange(beats_key)
    assert len(beats) >= 10 and {f["type"] for _, f in beats} == {"heartbeat"}
    assert {f["rank"] for _, f in beats} == {"1"}
    # Their seqs are their own: 0, 1, 2, ... (the events' stay without gaps).
    assert [int(f["seq"]) for _, f in beats] == list(range(len(beats)))
    events = shared.xrange(keys.stream_key(prefix, JOB))
    assert events and {f["rank"] for _, f in events if f["type"] == "heartbeat"} == {"0"}
    # What an agent reads: the events stream, rank 1's events without a heartbeat, no seq gap.
    agent = EventReader(shared, JOB, prefix)
    got = agent.read_all()
    assert got and not [e for e in got if e.type == "heartbeat" and e.rank != 0]
    assert [e for e in got if e.type == "heartbeat" and e.rank == 0]
    assert sum(e.rank == 1 for e in got) == step + 3  # register, run start, the steps, run end
    assert all(not x.gaps for x in agent._seen.values())


def test_a_non_heartbeat_in_the_heartbeat_stream_is_refused_not_booked(shared, prefix):
    job, now = Job(shared, prefix), [T0 + 20]
    shared.xadd(keys.beats_key(prefix, JOB), entry("step", 10, 0, 99, step=7, tokens=1))
    shared.xadd(keys.beats_key(prefix, JOB), {"type": "heartbeat", "junk": "x"})
    job.beat(10, 0)
    w = watcher(prefix, now)
    try:
        w.poll()
        stats = w.beats[JOB].stats
        assert stats["rejected:not_heartbeat"] == 1 and stats["accepted"] == 1, stats
        assert sum(v for k, v in stats.items() if k.startswith("rejected:")) == 2, stats
        assert w.views[JOB].ranks[0].last_step is None  # the step there counts for nothing
    finally:
        w.stop()


def test_a_heartbeat_key_of_the_wrong_type_sets_its_job_aside_and_the_others_go_on(shared, prefix):
    Job(shared, prefix)
    shared.set(keys.beats_key(prefix, "other"), "x")
    send_entries(shared, prefix, "other", [{**entry("register", 0, 0, 0), "job": "other"}])
    now = [T0 + 5]
    w = watcher(prefix, now)
    try:
        got = w.poll()
        assert "other" in w.bad_jobs and "heartbeat" in w.bad_jobs["other"]
        assert JOB in got and got[JOB].state == "running"
    finally:
        w.stop()


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(world=st.integers(1, 200), rounds=st.integers(1, 30))
def test_the_heartbeat_stream_stays_within_its_bound(shared, prefix, world, rounds):
    """However long a job beats, its heartbeat stream holds about `beats_cap` entries at most
    (Redis trims whole nodes of 100 entries), and every rank's newest beat is in it."""
    key = keys.beats_key(prefix, f"{JOB}-{world}")
    shared.delete(key)
    cap = protocol.beats_cap(world)
    for k in range(rounds):
        batch = [{**entry("heartbeat", k, r, k), "job": f"{JOB}-{world}"} for r in range(world)]
        send_entries(shared, prefix, f"{JOB}-{world}", batch * 8, beats_cap=cap)
    n = shared.xlen(key)
    assert n <= cap + 100, (n, cap)
    assert n >= min(rounds * world * 8, cap)
    newest = {f["rank"] for _, f in shared.xrevrange(key, count=world)}
    assert newest == {str(r) for r in range(world)}


def test_a_scanned_job_that_only_beats_is_still_recent(shared, prefix):
    """With the jobs index refused, a scanned job is judged by its own streams' newest entries:
    a job whose events are old but whose heartbeats are fresh (hung, still beating) is kept."""
    from costexporter.store import untrusted
    from costexporter.store.jobindex import JobIndex

    for job in ("beating", "silent"):
        shared.xadd(keys.stream_key(prefix, job), entry("register", 0, 0, 0), id="1000-0")
    shared.xadd(keys.beats_key(prefix, "beating"), entry("heartbeat", 0, 0, 0))
    index = JobIndex(shared, prefix, untrusted.Refusals(logging.getLogger("test")), (redis.RedisError,))
    assert index.recent(["beating", "silent"], time.time() - 60) == ["beating"]
    shared.set(keys.beats_key(prefix, "silent"), "x")  # the watcher's own read refuses it
    assert index.recent(["beating", "silent"], time.time() - 60) == ["beating", "silent"]


def test_an_older_reporters_spooled_heartbeat_goes_to_the_events_stream_on_its_seqs(shared, prefix, tmp_path):
    """A spool left by a reporter of an earlier release holds heartbeats on its events' seqs: a
    new reporter that drains it sends them where that one would have (the events stream), so
    the events' seqs stay without gaps for the agents."""
    from costexporter.trainer import spool

    old = spool.SpoolFile(
        tmp_path / f"{prefix}.old-job.0123456789abcdef.jsonl", spool.destination(SHARED_URL), prefix
    )
    kinds = [("register", {"host": "h0", "gpu": 0, "world_size": 1, "local_rank": 0}), ("heartbeat", {})]
    kinds += [("step", {"step": 1, "tokens": 1}), ("heartbeat", {}), ("step", {"step": 2, "tokens": 1})]
    old.append([{**entry(t, 1 + i, 0, i, **f), "job": "old-job"} for i, (t, f) in enumerate(kinds)])
    old.close()
    rep = StepReporter(JOB, SHARED_URL, rank=0, world_size=1, prefix=prefix, spool_dir=tmp_path)
    try:
        deadline = time.monotonic() + 10
        while list(tmp_path.glob(f"{prefix}.old-job.*")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not list(tmp_path.glob(f"{prefix}.old-job.*"))
    finally:
        rep.close()
    assert rep.stats["drained"] == 5, rep.stats
    reader = EventReader(shared, "old-job", prefix)
    got = reader.read_all()
    assert [e.type for e in got] == [t for t, _ in kinds]
    assert all(not x.gaps for x in reader._seen.values())
    assert not shared.exists(keys.beats_key(prefix, "old-job"))
