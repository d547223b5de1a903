"""The watcher's fast poll (1,000 jobs in 200 ms): many jobs read and decided in batches, their live hashes
in one round trip, each timeline folded up to where every rank's events are in. Whatever it
saves, each poll must decide what a fresh watcher decides reading every event at once."""

from __future__ import annotations

import collections
import json
import uuid

import redis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from costexporter.core.model import Event
from costexporter.services import watcher as watcher_mod
from costexporter.services.watcher import LIVE_HISTORY, WatchConfig, Watcher
from costexporter.store import keys, protocol
from costexporter.trainer.transport import send_entries

from .conftest import SHARED_URL
from .test_fold import CFG, streams

SHIFT = 1_750_000_000.0  # the strategy's times are small: make them plausible Unix times


def entry(e, job: str) -> dict[str, str]:
    return protocol.encode_fields(
        {
            "v": "1",
            "type": e.type,
            "job": job,
            "ts": f"{e.ts + SHIFT:.3f}",
            "rank": e.rank,
            "session": e.session,
            "seq": e.seq,
            **e.fields,
        }
    )


lives = st.lists(
    st.tuples(
        st.integers(0, 2),  # rank
        st.floats(0, 100),  # utilization
        st.sampled_from(["compute", "deadlock", "idle", "starvation"]),
        st.integers(-30, 5),  # seconds from the newest event
    ),
    max_size=3,
)


def _e(kind: str, ts_ms: int, rank: int, seq: int, **fields) -> Event:
    return Event(type=kind, job="j", ts_ms=ts_ms, rank=rank, session="s", seq=seq, fields=fields)


# A step 9 s after the one before (stall threshold 5 s), polled at the step's own time: the
# stall ended with that step, so not `hung` (tests/test_watcher_hang_holds.py pins the rule).
STEP_AT_NOW = [
    _e("run", 1_000_000, 0, 0, state="start"),
    _e("step", 1_000_500, 0, 1, step=1, tokens=0),
    _e("step", 1_001_000, 1, 2, step=1),
    _e("step", 1_001_500, 0, 3, step=2, tokens=0),
    _e("step", 1_002_000, 0, 4, step=3, tokens=0),
    _e("step", 1_002_500, 1, 5, step=3),
    _e("step", 1_011_500, 0, 6, step=4, tokens=0),
    _e("heartbeat", 1_012_000, 0, 7),
]


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    jobs=st.lists(st.tuples(streams(), st.lists(lives, max_size=12)), min_size=1, max_size=3),
    ahead_ms=st.integers(0, 120_000),
)
@example(jobs=[((STEP_AT_NOW, [7, 8]), [])], ahead_ms=0)
def test_a_watcher_poll_by_poll_decides_as_a_fresh_watcher(prefix, shared, monkeypatch, jobs, ahead_ms):
    # Each example on keys of its own (the fixture's prefix is one for every example: the streams
    # of an earlier example would be read again, and the same example could decide otherwise).
    prefix = f"{prefix}:{uuid.uuid4().hex[:8]}"  # under the fixture's prefix: removed with it
    monkeypatch.setattr(watcher_mod, "JOBS_PER_READ", 2)  # batches of two jobs: 3 jobs span two
    names = [f"j{i}" for i in range(len(jobs))]
    for n in names:
        for rank in range(3):
            reg = {"ts": SHIFT + 1000.0, "host": f"h{rank % 2}", "gpu": rank}
            shared.hset(keys.ranks_key(prefix, n), str(rank), json.dumps(reg))
    clock = [0.0]
    cfg = WatchConfig(
        redis_url=SHARED_URL, prefix=prefix, booking=CFG, jobs=tuple(names), clock=lambda: clock[0]
    )
    main = Watcher(cfg)

    class Fresh(Watcher):
        """Reads every event at once; the live snapshots the main watcher has seen so far (the
        two-sample signatures need history a fresh watcher cannot have)."""

        def read_live(self, views):
            for view in views:  # one job at a time, as the watcher read them before batching
                regs = view.registrations.values()
                hosts = sorted({str(r.get("host")) for r in regs if r.get("host")})
                got = [(h, self.redis.hgetall(keys.live_key(prefix, view.name, h))) for h in hosts]
                if got:
                    self._apply_live(view, got)
                view.live = collections.deque(main.views[view.name].live, maxlen=LIVE_HISTORY)
            return {}

    posted = dict.fromkeys(names, 0)
    newest = SHIFT
    for p in range(max(len(cuts) for (_, cuts), _ in jobs)):
        for n, ((arrival, cuts), live) in zip(names, jobs, strict=True):
            if p < len(cuts):
                batch = arrival[posted[n] : cuts[p]]
                posted[n] = cuts[p]
                if batch:
                    send_entries(shared, prefix, n, [entry(e, n) for e in batch])
                    newest = max(newest, SHIFT + max(e.ts for e in batch))
            if p < len(live):
                for rank, util, band, dt in live[p]:
                    sample = {
                        "ts": newest + dt,
                        "power_w": 300.0,
                        "util_pct": util,
                        "band": band,
                        "gpu": rank,
                    }
                    shared.hset(keys.live_key(prefix, n, f"h{rank % 2}"), str(rank), json.dumps(sample))
        clock[0] = newest + ahead_ms / 1000
        # The fresh watcher decides with the statuses the main one had before this poll: a hang
        # holds until a step (docs/agent.md), also through a restart or a cleared signature, and
        # only a watcher that saw the hang can hold it (as with the live history above).
        fresh = Fresh(cfg)
        fresh.status = dict(main.status)
        got = {j: s.to_dict() for j, s in main.poll().items()}
        want = {j: s.to_dict() for j, s in fresh.poll().items()}
        for d in (*got.values(), *want.values()):
            d.pop("since")  # a fresh watcher sees every state begin now
        assert got == want, p
    assert main.redis_up and not main.bad_jobs


def test_an_ended_job_without_new_events_is_not_judged_again_yet_answers_as_judged(
    prefix, shared, monkeypatch
):
    """A job that ended is `done` until an event comes: later polls reuse that answer (only the
    time since the last step moves), equal to a fresh watcher's; a new run makes it judged again."""
    job = "ended"
    t0 = SHIFT + 5000.0
    events = [("run", 0, t0, {"state": "start"})]
    events += [("step", 0, t0 + k, {"step": k, "tokens": 1}) for k in range(1, 30)]
    events += [("heartbeat", 1, t0 + 10 * k, {}) for k in range(3)]
    events += [("run", 0, t0 + 31, {"state": "end"})]
    seq = collections.Counter()

    def post(batch):
        entries = []
        for kind, rank, ts, fields in batch:
            base = {"v": "1", "type": kind, "job": job, "ts": f"{ts:.3f}", "rank": rank, "session": "s"}
            entries.append(protocol.encode_fields({**base, "seq": seq[rank], **fields}))
            seq[rank] += 1
        send_entries(shared, prefix, job, entries)

    post(events)
    clock = [t0 + 40]
    cfg = WatchConfig(redis_url=SHARED_URL, prefix=prefix, jobs=(job,), clock=lambda: clock[0])
    w = Watcher(cfg)
    calls = collections.Counter()
    real = watcher_mod.decide

    def counting(view, now, c, previous=None):
        calls[view.name] += 1
        return real(view, now, c, previous)

    monkeypatch.setattr(watcher_mod, "decide", counting)
    first = w.poll()[job]
    assert first.state == "done" and calls[job] == 1
    for k in range(1, 6):
        clock[0] = t0 + 40 + 3600 * k  # hours later: past every heartbeat timeout and stall threshold
        got = w.poll()[job].to_dict()
        want = Watcher(cfg).poll()[job].to_dict()
        assert got.pop("since") == first.since
        want.pop("since")
        assert got == want
    assert calls[job] == 1 + 5  # the fresh watchers only: the first one judged it once
    post([("run", 0, clock[0] + 1, {"state": "start"}), ("step", 0, clock[0] + 2, {"step": 30, "tokens": 1})])
    clock[0] += 3
    got = w.poll()[job].to_dict()
    assert calls[job] == 7 and got["state"] != "done"  # judged again (rank 1 went silent long ago)
    want = Watcher(cfg).poll()[job].to_dict()
    got.pop("since"), want.pop("since")
    assert got == want


def test_a_poll_cut_short_after_sending_the_next_jobs_read_loses_nothing(prefix, shared, monkeypatch):
    """A poll sends the next jobs' XREAD before it decides the jobs it read. Redis failing while
    those are decided: the read sent ahead is dropped with its connection (none left held, no
    reply left to answer another command), and the next poll reads and decides every job as a
    fresh watcher does."""
    monkeypatch.setattr(watcher_mod, "JOBS_PER_READ", 1)
    names = ["a", "b", "c"]
    t0 = SHIFT + 9000.0
    for n in names:
        steps = [
            protocol.encode_fields(
                {"v": "1", "type": "step", "job": n, "ts": f"{t0 + k:.3f}", "rank": 0, "session": "s"}
                | {"seq": k, "step": k, "tokens": 1}
            )
            for k in range(20)
        ]
        send_entries(shared, prefix, n, steps)
    clock = [t0 + 21]
    cfg = WatchConfig(redis_url=SHARED_URL, prefix=prefix, jobs=tuple(names), clock=lambda: clock[0])
    w = Watcher(cfg)
    real = Watcher.read_live
    cut = {"left": 1}

    def failing(self, views):
        if cut["left"]:  # the first job's live hashes: Redis is gone (the next job's XREAD is out)
            cut["left"] -= 1
            raise redis.ConnectionError("connection lost")
        return real(self, views)

    monkeypatch.setattr(Watcher, "read_live", failing)
    pool = w.redis.connection_pool
    w.poll()
    assert not w.redis_up and not pool._in_use_connections
    got = {j: s.to_dict() for j, s in w.poll().items()}
    want = {j: s.to_dict() for j, s in Watcher(cfg).poll().items()}
    for d in (*got.values(), *want.values()):
        d.pop("since")
    assert w.redis_up and got == want and set(got) == set(names)
    assert all(w.readers[n].stats["accepted"] == 20 for n in names)  # each event read once
