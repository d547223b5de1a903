"""The agent's folded timeline books exactly what a from-scratch rebuild books, in a real agent
on a real Redis: a job with phases, a stall, an explicit and an implicit resume, events posted
round by round, one of them later than the fold (the agent rebuilds once from the stream). The
agent that folds is run beside one that rebuilds every round (the old way), each on its own key
prefix: every ledger key they write must be equal. The round's cost and state are exported.
"""

from __future__ import annotations

import json

import redis
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from costexporter import ledger
from costexporter.agent import Agent, AgentConfig
from costexporter.booking import build_timeline, dated_until
from costexporter.client import send_entries
from costexporter.exporter import registry_for
from costexporter.fold import walk_relevant
from costexporter.reader import EventReader
from costexporter.sources.replay import ReplaySource
from costexporter.synth import TraceBuilder

from .conftest import SHARED_URL
from .test_agent import event_entry


class RebuildingAgent(Agent):
    """The agent before the fold: every round builds the timeline from every event and holds the
    whole rollback index."""

    def _fetch_index(self, job, tl):
        rb = self.redis.hgetall(ledger.key(self.cfg.prefix, job.name, "ledger", "rbidx", self.cfg.agent_id))
        job.state.rb_index = {int(k): json.loads(v) for k, v in rb.items()}

    def _timeline(self, job, job_start, now_ms):
        reader = EventReader(self.redis, job.name, prefix=self.cfg.prefix)
        events = [e for e in reader.read_until(job.reader.cursor) if walk_relevant(e)]
        job.fresh = []
        return build_timeline(dated_until(events, now_ms), self.cfg.booking, job_start, now_ms, final=False)


def trace() -> TraceBuilder:
    b = TraceBuilder(n_gpus=2, per_host=2, job="folded", seed=11)
    b.run("start")
    b.stretch("compute", 200, step_s=4, tokens=100)  # steps 1..50
    b.phase("checkpoint", "begin")
    b.stretch("checkpoint", 40)
    b.phase("checkpoint", "end", step=b.step)
    b.stretch("compute", 120, step_s=4, tokens=100)  # 51..80
    b.phase("eval", "begin", rank=1)
    b.stretch("compute", 40, step_s=4, tokens=100)
    b.phase("eval", "end", rank=1)
    b.stretch("idle", 200)  # progress stops: a stall
    b.run("resume", step=50)  # steps 51.. voided
    b.stretch("compute", 200, step_s=4, tokens=100)
    b.step = 60  # an implicit resume: step 61 again
    b.stretch("compute", 100, step_s=4, tokens=100)
    b.run("end")
    b.stretch("idle", 20)
    return b


def ledger_keys(client, prefix: str) -> dict:
    out = {}
    for k in sorted(client.scan_iter(f"{prefix}:*")):
        name = k[len(prefix) :]
        if ":wm:" in name or name.endswith(":epoch") or ":node:" in name or ":live:" in name:
            continue
        t = client.type(k)
        if t == "hash":
            v = client.hgetall(k)
        elif t == "zset":
            v = client.zrange(k, 0, -1, withscores=True)
        elif t == "stream":
            continue
        else:
            v = client.get(k) if t == "string" else t
        out[name] = v
    return out


def run_agent(cls, prefix: str, b: TraceBuilder, late_event) -> Agent:
    client = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    events = sorted(b.events, key=lambda e: e.ts)
    t0 = min(e.ts for e in events)
    now = [0.0]
    agent = cls(
        ReplaySource(b.samples(), speed=1.0, clock=lambda: now[0]),
        AgentConfig(prefix=prefix, agent_id="a", job_refresh_s=0, fold_lag_s=20.0, context_s=120.0),
    )
    posted = 0
    held = True
    while now[0] < 1200:
        now[0] += 7
        upto = t0 + now[0] + 3  # events run a little ahead of the samples
        batch = []
        while posted < len(events) and events[posted].ts <= upto:
            if events[posted] is not late_event:
                batch.append(event_entry(events[posted]))
            posted += 1
        if held and now[0] > late_event.ts - t0 + 100:  # 100 s late: older than the fold
            batch.append(event_entry(late_event))
            held = False
        if batch:
            send_entries(client, prefix, b.job, batch)
        for r in agent.source.read():
            agent.sampler._buf.append(r)
        agent.tick()
    agent._final = True
    agent.tick()
    return agent


def test_folding_agent_books_every_key_as_the_rebuilding_one(prefix):
    b = trace()
    late = next(e for e in b.events if e.type == "phase" and e.rank == 1 and e.get("state") == "begin")
    folded = run_agent(Agent, prefix, b, late)
    run_agent(RebuildingAgent, prefix + "-ref", b, late)
    client = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    try:
        got, want = ledger_keys(client, prefix), ledger_keys(client, prefix + "-ref")
        assert got == want
        total = ledger.read_amounts(client, prefix, b.job)
        assert total.get("rolled_back:ms", 0) > 0 and total.get("stalled:ms", 0) + total.get("idle:ms", 0) > 0
        assert folded.stats["timeline_rebuilds"] == 1  # the late phase begin, once
        job = folded.jobs[b.job]
        assert job.fold is not None and job.fold.folded > 0
        assert len(job.fold.w.steps) < 60  # the recent records only, not the 150 steps of history
        fams = {
            f.name: f for f in text_string_to_metric_families(generate_latest(registry_for(folded)).decode())
        }
        h = {s.name: s.value for s in fams["costexporter_agent_round_seconds"].samples}
        assert h["costexporter_agent_round_seconds_count"] == sum(folded.round_counts) >= 170
        state = {s.labels["training_job"]: s.value for s in fams["costexporter_agent_state_bytes"].samples}
        assert 0 < state[b.job] < 1_000_000
    finally:
        keys = list(client.scan_iter(f"{prefix}-ref:*"))
        if keys:
            client.delete(*keys)


def test_a_watcher_refolds_a_late_event_from_the_stream_and_judges_as_a_fresh_one(prefix):
    """The watcher keeps no events: an event older than its fold is read again from the stream,
    and every poll's status is a fresh watcher's (one that reads the whole stream at once)."""
    from costexporter.watcher import WatchConfig, Watcher

    b = TraceBuilder(n_gpus=2, per_host=2, job="watched", seed=4)
    b.run("start")
    b.stretch("compute", 120, step_s=4, tokens=10)
    b.phase("checkpoint", "begin")
    b.stretch("checkpoint", 30)
    b.phase("checkpoint", "end", step=b.step)
    b.stretch("compute", 200, step_s=4, tokens=10)
    b.stretch("idle", 400)  # no step: hung past the stall threshold
    events = sorted(b.events, key=lambda e: e.ts)
    late = next(e for e in events if e.type == "phase" and e.get("state") == "begin")
    client = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    t0 = events[0].ts
    clock = [t0]
    cfg = WatchConfig(prefix=prefix, clock=lambda: clock[0], heartbeat_timeout_s=1e9)
    w = Watcher(cfg)
    posted, states = 0, set()
    while clock[0] < t0 + 760:
        clock[0] += 20
        batch = []
        while posted < len(events) and events[posted].ts <= clock[0]:
            if events[posted] is not late:
                batch.append(event_entry(events[posted]))
            posted += 1
        if late.ts + 120 < clock[0] <= late.ts + 140:
            batch.append(event_entry(late))  # 2 minutes late: older than the fold
        if batch:
            send_entries(client, prefix, b.job, batch)
        got = w.poll()[b.job].to_dict()
        want = Watcher(cfg).poll()[b.job].to_dict()
        got.pop("since"), want.pop("since")  # a fresh watcher sees every state begin now
        assert got == want
        states.add(got["state"])
    assert w.stats["timeline_rebuilds"] == 1
    assert w.views[b.job].walk == []  # nothing kept: the stream is read again when needed
    assert {"running", "hung"} <= states
