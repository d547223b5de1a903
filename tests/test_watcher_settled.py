"""A poll costs what changed: a job judged `done` with nothing new is skipped (not read, not
judged, its status rewritten only before it would expire) while the jobs index says nothing new,
and read again by its recheck whatever the index says. Skipping must never change a verdict
beyond that bound: a rerun that moves the index is judged at the next poll, as a fresh watcher
judges it; one whose events do not move it (its clock behind the run before) within `recheck_s`."""

from __future__ import annotations

import collections
import json
import uuid

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from costexporter.services.watcher import WatchConfig, Watcher
from costexporter.store import keys, protocol
from costexporter.trainer.transport import send_entries

from .conftest import SHARED_URL

T0 = 1_750_000_000.0


class Trainer:
    """Posts a job's events as the reporter does (`send_entries`: the jobs index takes the
    newest time of each batch, kept only if newer)."""

    def __init__(self, client, prefix: str, job: str) -> None:
        self.client, self.prefix, self.job = client, prefix, job
        self.seq: collections.Counter[tuple[int, str]] = collections.Counter()
        self.session = 0
        self.newest = 0.0  # the newest time posted: the job's index score
        self.ended_at: float | None = None  # when its last run ended (None: it goes on)

    def post(self, batch: list[tuple[str, int, float, dict]]) -> None:
        entries = []
        for kind, rank, ts, fields in batch:
            s = f"s{self.session}"
            base = {"v": "1", "type": kind, "job": self.job, "ts": f"{ts:.3f}", "rank": rank, "session": s}
            entries.append(protocol.encode_fields({**base, "seq": self.seq[(rank, s)], **fields}))
            self.seq[(rank, s)] += 1
            self.newest = max(self.newest, ts)
        send_entries(self.client, self.prefix, self.job, entries)

    def run(self, t: float, steps: int = 5, end: bool = True, linger: bool = True) -> None:
        """A run of `steps` steps from `t` on (a new session), ended or still going. An ended
        run's rank 1 sends one more heartbeat 30 s after the end (its process lingers) unless
        not `linger`."""
        self.session += 1
        batch = [("run", 0, t, {"state": "start"})]
        batch += [("step", 0, t + k, {"step": k, "tokens": 1}) for k in range(1, steps + 1)]
        batch += [("heartbeat", 1, t + k, {}) for k in range(0, steps + 1, 2)]
        self.ended_at = None
        if end:
            self.ended_at = t + steps + 0.5
            batch += [("run", r, self.ended_at, {"state": "end"}) for r in (0, 1)]
            batch += [("heartbeat", 1, self.ended_at + 30, {})] * linger
        self.post(batch)


def _reads(monkeypatch) -> list[set[str]]:
    """The jobs each poll reads (its `_read_batches` calls), one set per poll."""
    polls: list[set[str]] = []
    real = Watcher._read_batches

    def counting(self, jobs):
        polls[-1].update(jobs)
        return real(self, jobs)

    real_poll = Watcher._poll

    def poll(self, now):
        polls.append(set())
        return real_poll(self, now)

    monkeypatch.setattr(Watcher, "_read_batches", counting)
    monkeypatch.setattr(Watcher, "_poll", poll)
    return polls


def _judged(status) -> dict:
    d = status.to_dict()
    d.pop("since")  # a fresh watcher sees every state begin now
    return d


def test_a_settled_job_is_not_read_until_its_index_score_moves(prefix, shared, monkeypatch):
    polls = _reads(monkeypatch)
    jobs = [f"j{i}" for i in range(4)]
    trainers = {j: Trainer(shared, prefix, j) for j in jobs}
    for j in jobs:
        trainers[j].run(T0)
    clock = [T0 + 30]
    cfg = WatchConfig(redis_url=SHARED_URL, prefix=prefix, clock=lambda: clock[0], forget_after_s=1e9)
    w = Watcher(cfg)
    assert {s.state for s in w.poll().values()} == {"done"}
    assert polls[-1] == set(jobs)  # the first poll reads every job: done, settled
    assert not set(w.views) & set(jobs)  # nothing held of them but their status
    for _ in range(3):
        clock[0] += 5
        assert {s.state for s in w.poll().values()} == {"done"}
        assert polls[-1] == set()  # nothing read, every job answered
    trainers["j2"].run(clock[0] - 1, end=False)  # a rerun: its newest time moves the index
    clock[0] += 5
    got = w.poll()
    assert polls[-1] == {"j2"}
    assert _judged(got["j2"]) == _judged(Watcher(cfg).poll()["j2"])
    assert got["j2"].state != "done"


def test_without_index_scores_every_job_is_read(prefix, shared, monkeypatch):
    """A watcher given its jobs, or one whose index is of the wrong type (scanned around), has
    no scores to trust: it reads every job every poll, as before."""
    polls = _reads(monkeypatch)
    jobs = ["a", "b"]
    for j in jobs:
        Trainer(shared, prefix, j).run(T0)
    clock = [T0 + 30]
    given = Watcher(
        WatchConfig(redis_url=SHARED_URL, prefix=prefix, jobs=tuple(jobs), clock=lambda: clock[0])
    )
    for _ in range(4):
        clock[0] += 5
        given.poll()
        assert polls[-1] == set(jobs)
    for j in jobs:  # what a scan finds a job by: its ranks key
        shared.hset(keys.ranks_key(prefix, j), "0", json.dumps({"ts": T0, "host": "h0", "gpu": 0}))
    shared.delete(keys.jobs_key(prefix))
    shared.set(keys.jobs_key(prefix), "not a sorted set")
    cfg = WatchConfig(redis_url=SHARED_URL, prefix=prefix, clock=lambda: clock[0], forget_after_s=1e9)
    scanned = Watcher(cfg)
    for _ in range(4):
        clock[0] += 5
        assert {s.state for s in scanned.poll().values()} == {"done"}
        assert polls[-1] == set(jobs)


def test_a_skipped_jobs_status_never_expires(prefix, shared):
    """Skipped jobs' statuses are rewritten before their TTL runs out (each at its own point of
    the TTL's middle third), with the time of the poll that wrote them."""
    jobs = [f"j{i}" for i in range(20)]
    for j in jobs:
        Trainer(shared, prefix, j).run(T0)
    clock = [T0 + 30]
    cfg = WatchConfig(
        redis_url=SHARED_URL, prefix=prefix, clock=lambda: clock[0], forget_after_s=1e9, recheck_s=1e6
    )
    w = Watcher(cfg)
    written: dict[str, list[float]] = collections.defaultdict(list)
    for _ in range(40):  # 200 s: past three TTLs of 60 s
        clock[0] += 5
        w.poll()
        for j in jobs:
            raw = shared.get(keys.status_key(prefix, j))
            assert raw is not None, j
            updated = json.loads(raw)["updated"]
            assert clock[0] - updated < w.ttl, j  # written within its TTL: it could not have expired
            if not written[j] or written[j][-1] != updated:
                written[j].append(updated)
    assert all(len(v) >= 4 for v in written.values())  # rewritten, not once and left
    assert sum(len(v) for v in written.values()) < 20 * 40 / 3  # ... yet not every poll


class Recording(Watcher):
    """A watcher that says which jobs each poll read."""

    def _read_batches(self, jobs):
        self.read.update(jobs)
        return super()._read_batches(jobs)

    def poll(self):
        self.read: set[str] = set()
        return super().poll()


actions = st.lists(
    st.lists(
        st.tuples(
            st.integers(0, 2),  # the job
            st.sampled_from(["rerun", "rerun_behind", "rerun_behind_ended"]),
        ),
        max_size=2,
        unique_by=lambda a: a[0],
    ),
    min_size=1,
    max_size=14,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions=actions, step_s=st.sampled_from([5.0, 13.0, 29.0]))
def test_skipping_changes_no_verdict_beyond_the_recheck(prefix, shared, actions, step_s):
    """Jobs ended, then at each poll some rerun: with a clock ahead (the index moves) or behind
    the newest time of the run before (its lingering heartbeat: it does not). Every poll, a job
    read is judged as a fresh watcher judges it, and so is a skipped one with nothing unseen; a
    skipped job whose unseen events did not move the index is skipped for less than
    `recheck_s` after the first of them came."""
    prefix = f"{prefix}:{uuid.uuid4().hex[:8]}"
    jobs = ["a", "b", "c"]
    trainers = {j: Trainer(shared, prefix, j) for j in jobs}
    for j in jobs:
        trainers[j].run(T0)
    clock = [T0 + 60]  # past the runs' lingering heartbeats
    cfg = WatchConfig(
        redis_url=SHARED_URL, prefix=prefix, clock=lambda: clock[0], forget_after_s=1e9, recheck_s=60.0
    )
    w = Recording(cfg)
    assert {st.state for st in w.poll().values()} == {"done"} and w.read == set(jobs)
    hidden: dict[str, float] = {}  # job -> when the first events came that did not move its score
    for step in actions:
        for i, what in step:
            j = jobs[i]
            tr = trainers[j]
            if what == "rerun":
                was = tr.newest
                tr.run(clock[0] - 3, steps=2, end=False)  # its newest before the next poll's
                assert tr.newest > was  # the index moves
            elif tr.ended_at is not None and tr.ended_at + 4 < tr.newest:
                # after the last run's end, before its newest time: the index does not move
                was = tr.newest
                tr.run(tr.ended_at + 1, steps=2, end=what == "rerun_behind_ended", linger=False)
                assert tr.newest == was
                hidden.setdefault(j, clock[0])
        clock[0] += step_s
        got = w.poll()
        want = Watcher(cfg).poll()
        for j in jobs:
            if j in w.read:
                hidden.pop(j, None)
            elif j in hidden:
                assert clock[0] - hidden[j] < cfg.recheck_s, j  # the bound
                continue
            assert _judged(got[j]) == _judged(want[j]), (j, clock[0])


def test_settled_jobs_are_done_again_after_redis_was_unreachable(prefix, shared, monkeypatch):
    """A poll that cannot read Redis says every job `unknown`; the next one that can says the
    settled jobs are done again (as a fresh watcher does), not the outage's word carried on."""
    import redis

    jobs = ["a", "b"]
    for j in jobs:
        Trainer(shared, prefix, j).run(T0)
    clock = [T0 + 60]
    cfg = WatchConfig(redis_url=SHARED_URL, prefix=prefix, clock=lambda: clock[0], forget_after_s=1e9)
    w = Watcher(cfg)
    assert {s.state for s in w.poll().values()} == {"done"}
    real = w.index.names

    def down(*a, **kw):
        raise redis.ConnectionError("down")

    monkeypatch.setattr(w.index, "names", down)
    clock[0] += 5
    assert {s.state for s in w.poll().values()} == {"unknown"}
    monkeypatch.setattr(w.index, "names", real)
    for _ in range(3):
        clock[0] += 5
        got = w.poll()
        want = Watcher(cfg).poll()
        assert set(got) == set(want) == set(jobs)
        assert {j: _judged(s) for j, s in got.items()} == {j: _judged(s) for j, s in want.items()}
        assert {s.since for s in got.values()} == {T0 + 70}  # done again since the outage ended
