"""Fewer round trips: discovery only when registrations change, and sample streams
only for jobs that span more than one host."""

from __future__ import annotations

import json
import logging

import numpy as np
import redis

from costexporter.core import samplewin
from costexporter.core.model import Samples
from costexporter.services.agent import Agent, AgentConfig
from costexporter.services.agent_context import AgentContext
from costexporter.sources.playback import ReplaySource
from costexporter.sources.synth import TraceBuilder
from costexporter.store import keys, ledger, untrusted
from costexporter.trainer.transport import send_entries

from .agent_rounds import replay_agent, tick
from .test_agent import event_entry, post_events


def _agent(b: TraceBuilder, prefix: str, **kw) -> tuple[Agent, list[float]]:
    return replay_agent(b, prefix=prefix, agent_id="wide", **kw)


def _counting(agent: Agent) -> list[int]:
    calls = []
    real = agent.discover

    def discover() -> None:
        calls.append(1)
        real()

    agent.discover = discover  # type: ignore[method-assign]
    return calls


def test_discovery_runs_when_a_register_arrives_not_every_round(shared, prefix):
    b = TraceBuilder(n_gpus=2, per_host=2, job="late-reg", seed=3, register=False)
    b.stretch("compute", 400)
    agent, now = _agent(b, prefix, job_refresh_s=3600)
    calls = _counting(agent)
    tick(agent, now, 30)
    assert len(calls) == 1 and not agent.jobs  # the first round looks
    for _ in range(4):
        tick(agent, now, 10)
    settled = len(calls)
    assert settled == 1  # nothing registered: no discovery, whatever `job_refresh_s`
    reg = TraceBuilder(n_gpus=2, per_host=2, job="late-reg", seed=3)
    post_events(shared, prefix, reg)  # the trainer's batch moves the registrations counter
    tick(agent, now, 10)
    assert len(calls) == settled + 1 and set(agent.jobs["late-reg"].own) == {0, 1}
    for _ in range(3):
        tick(agent, now, 10)
    # Once more the round after (on a cluster the counter may land before the `:ranks` write).
    assert len(calls) == settled + 2
    # Redis lost the counter (a restart, a flush): discovery runs again rather than trusting it.
    shared.delete(keys.registrations_key(prefix))
    tick(agent, now, 10)
    assert len(calls) == settled + 3


def test_a_register_written_without_the_counter_is_found_by_the_periodic_refresh(shared, prefix):
    """A writer that does not move the counter (an older client) is found by the slow refresh."""
    b = TraceBuilder(n_gpus=2, per_host=2, job="old-client", seed=4, register=False)
    b.stretch("compute", 400)
    agent, now = _agent(b, prefix, job_refresh_s=3600)
    calls = _counting(agent)
    for _ in range(3):
        tick(agent, now, 10)
    assert len(calls) == 1  # settled
    reg = TraceBuilder(n_gpus=2, per_host=2, job="old-client", seed=4)
    for e in reg.events:
        shared.hset(keys.ranks_key(prefix, e.job), str(e.rank), json.dumps(event_entry(e)))
    shared.zadd(keys.jobs_key(prefix), {"old-client": reg.events[0].ts})
    for _ in range(3):
        tick(agent, now, 10)
    assert len(calls) == 1 and not agent.jobs
    agent.cfg.job_refresh_s = 0.0  # the safety net's period has passed
    tick(agent, now, 10)
    assert set(agent.jobs["old-client"].own) == {0, 1}


def test_a_job_on_one_host_publishes_no_samples_until_a_rank_registers_elsewhere(shared, prefix):
    b = TraceBuilder(n_gpus=2, per_host=2, job="one-host", seed=5)
    b.run("start")
    b.stretch("compute", 300, step_s=5)
    post_events(shared, prefix, b)
    agent, now = _agent(b, prefix, job_refresh_s=3600)
    for _ in range(4):
        tick(agent, now, 60)
    host = agent.host
    stream = keys.samples_key(prefix, b.job, host)
    assert agent.booker.stats["rounds"] > 0 and not shared.exists(stream)
    assert ledger.net_ms(ledger.read_amounts(shared, prefix, b.job))["productive"] > 0
    # A rank of the job registers on another host: its agent needs this host's samples, the
    # whole context this agent still holds, not only those from now on.
    other = {
        **event_entry(b.events[0]),
        "rank": "2",
        "host": "elsewhere",
        "gpu": "0",
        "seq": "9",
        "world_size": "3",
    }
    other.pop("gpu_uuid", None)
    send_entries(shared, prefix, b.job, [other])
    tick(agent, now, 10)
    entries = shared.xrange(stream)
    assert len(entries) == 1
    ts = samplewin.decode_entry(entries[0][1])[1].tolist()
    assert min(ts) <= (b.t0 + 60) * 1000 and max(ts) >= (b.t0 + 250) * 1000


def test_a_counter_the_acl_refuses_does_not_fail_the_trainer(tmp_path):
    """A trainer's ACL written before the counter existed: its events and registration still land."""
    from .redis_server import RedisServer

    srv = RedisServer(tmp_path / "redis").start()
    try:
        admin = redis.Redis(port=srv.port, decode_responses=True)
        # A rule from before the registrations counter: no access to it.
        old_rule = [f"~{keys.job_key('p', keys.TRAINER, 'j', '*')}", f"~{keys.jobs_key('p')}"]
        admin.execute_command("ACL", "SETUSER", "trainer", "on", ">pw", *old_rule, "+@all")
        trainer = redis.Redis(port=srv.port, username="trainer", password="pw", decode_responses=True)
        reg = TraceBuilder(n_gpus=1, per_host=1, job="j", seed=6)
        out = send_entries(trainer, "p", "j", [event_entry(e) for e in reg.events])
        assert not out.failed and not out.side_failed and out.counter_failed is not None
        assert admin.hlen(keys.ranks_key("p", "j")) == 1 and admin.xlen(keys.stream_key("p", "j")) == 1
    finally:
        srv.kill()


def test_gpus_the_source_finds_late_run_discovery_again(shared, prefix):
    """A source that lists its GPUs only after a while: the jobs on them are found then."""
    b = TraceBuilder(n_gpus=2, per_host=2, job="late-gpus", seed=7)
    b.stretch("compute", 300)
    post_events(shared, prefix, b)
    agent, now = _agent(b, prefix, job_refresh_s=3600)
    real = agent.source.gpus
    agent.source.gpus = lambda: []  # type: ignore[method-assign]
    tick(agent, now, 30)
    tick(agent, now, 10)
    assert not agent.jobs
    agent.source.gpus = real  # type: ignore[method-assign]
    tick(agent, now, 10)
    assert set(agent.jobs["late-gpus"].own) == {0, 1}


def _host_samples(b: TraceBuilder, host: str) -> Samples:
    """The samples one host's agent reads: that host's GPUs, numbered from 0 as its source does."""
    s = b.samples()
    mine = [i for i, g in enumerate(s.gpus) if g.host == host]
    keep = np.isin(s.gpu, mine)
    renum = np.full(len(s.gpus), -1, np.int32)
    renum[mine] = np.arange(len(mine), dtype=np.int32)
    return Samples(
        [s.gpus[i] for i in mine],
        renum[s.gpu[keep]],
        s.ts_ms[keep],
        s.power_w[keep],
        s.util_pct[keep],
        s.energy_mj[keep],
    )


def test_one_discovery_knows_every_rank_of_a_job_whatever_order_the_ranks_hash_gives(shared, prefix):
    """The ranks hash lists the other host's ranks first: the one discovery (no counter moves
    after it) must still know them, or this agent never shares its samples and never reads the
    peers', and trims the stream under the other agent (its ranks look covered)."""
    b = TraceBuilder(n_gpus=4, per_host=2, job="order", seed=8)
    b.run("start")
    b.stretch("compute", 120, step_s=5)
    post_events(shared, prefix, b)
    # Redis gives a hash's fields in its own order: the agent runs on the host whose ranks do
    # not come first, so discovery meets the other host's rank before any of its own.
    first = int(shared.hkeys(keys.ranks_key(prefix, b.job))[0])
    host = "node1" if b.host_of(first)[0] == "node0" else "node0"
    now = [0.0]
    agent = Agent(
        ReplaySource(_host_samples(b, host), speed=1.0, clock=lambda: now[0]),
        AgentConfig(prefix=prefix, agent_id=host, job_refresh_s=3600, peer_timeout_s=3600),
    )
    calls = _counting(agent)
    for _ in range(3):
        tick(agent, now, 20)
    job = agent.jobs["order"]
    assert len(calls) == 1  # no second look: the first one had to see it all
    assert set(job.ranks) == {0, 1, 2, 3} and set(job.own) == ({0, 1} if host == "node0" else {2, 3})
    assert shared.exists(keys.samples_key(prefix, b.job, host))  # shared with the other agent


def test_a_first_read_takes_a_peer_stream_back_to_the_window_only(shared, prefix):
    """A (re)started agent whose stored window starts a minute ago reads the peer's stream from
    its newest entry back to that window, not the hours the stream keeps."""
    b = TraceBuilder(n_gpus=4, per_host=2, job="tail", seed=9)
    b.run("start")
    b.stretch("compute", 900, step_s=5)
    post_events(shared, prefix, b)
    peer = keys.samples_key(prefix, b.job, "node1")
    s = b.samples()
    for t in range(int(b.t0), int(b.t), 5):  # node1's 180 rounds, as its agent publishes them
        sel = (s.gpu >= 2) & (s.ts_ms >= t * 1000) & (s.ts_ms < (t + 5) * 1000)
        shared.xadd(
            peer,
            samplewin.encode_entry(
                (
                    s.gpu[sel].astype(np.int64),
                    s.ts_ms[sel],
                    s.power_w[sel],
                    s.util_pct[sel],
                    s.energy_mj[sel],
                ),
                "node1",
            ),
        )
    agent = Agent(
        ReplaySource(_host_samples(b, "node0"), speed=1.0, clock=lambda: 0.0),
        AgentConfig(prefix=prefix, agent_id="node0", job_refresh_s=3600),
    )
    agent.discover()
    job = agent.jobs[b.job]
    reads = []
    real = agent.redis.pipeline

    def pipeline(*a, **kw):
        p = real(*a, **kw)
        orig = p.xrevrange
        p.xrevrange = lambda *x, **y: reads.append(y.get("count")) or orig(*x, **y)  # type: ignore[method-assign]
        return p

    agent.redis.pipeline = pipeline  # type: ignore[method-assign]
    agent.peers.read(job, int((b.t - 60) * 1000))
    held = job.remote.pending
    ts = np.concatenate([c[1] for c in held])
    assert ts.min() <= (b.t - 60) * 1000 and ts.min() >= (b.t - 120) * 1000  # a minute, and a round
    assert sum(reads) < 180 and job.remote_ids[peer] == shared.xrevrange(peer, count=1)[0][0]


def _sharing_hosts(n: int) -> list[str]:
    """`n` host names that hash to the same sample stream."""
    first: dict[int, list[str]] = {}
    for i in range(10_000):
        h = f"host{i}"
        got = first.setdefault(keys.sample_stream(h), [])
        got.append(h)
        if len(got) == n:
            return got
    raise AssertionError("no hosts share a stream")


def test_hosts_sharing_a_sample_stream_are_told_apart_and_each_entry_is_taken_once(shared, prefix):
    """Hosts share a job's few sample streams: an agent takes only its peers' entries (not its
    own, not a host it does not know yet), reads a host that joins later back to the window,
    and one that leaves and comes back from where it stopped: every sample exactly once."""

    from costexporter.services.agent_job import AgentJob
    from costexporter.services.agent_peers import PeerExchange

    me, a, b, c = _sharing_hosts(4)
    other = next(f"x{i}" for i in range(1000) if keys.sample_stream(f"x{i}") != keys.sample_stream(me))
    ranks = {me: 0, a: 1, b: 2, c: 3, other: 4}
    sent: dict[str, list[int]] = {h: [] for h in ranks}

    def publish(t0: int) -> None:
        for h, r in ranks.items():
            ts = np.arange(t0, t0 + 5) * 1000
            p = np.full(5, 300.0)
            cols = (np.full(5, r, np.int64), ts, p, p, p)
            shared.xadd(keys.samples_key(prefix, "j", h), samplewin.encode_entry(cols, h))
            sent[h] += ts.tolist()

    def taken(job: AgentJob) -> dict[int, list[int]]:
        r = np.concatenate([x[0] for x in job.remote.pending])
        t = np.concatenate([x[1] for x in job.remote.pending])
        job.remote.pending = []
        return {int(k): sorted(t[r == k].tolist()) for k in np.unique(r)}

    ctx = AgentContext(
        shared, AgentConfig(prefix=prefix), me, "test", (OSError,), untrusted.Refusals(logging.getLogger())
    )
    ex = PeerExchange(ctx, maxlen=1000, grace_s=60)
    job = AgentJob(name="j", reader=None)  # type: ignore[arg-type]
    job.peers.hosts = {a: [1], b: [2], other: [4]}
    for t in range(0, 100, 5):
        publish(t)
    ex.read(job, keep_from=50_000)
    got = taken(job)
    assert set(got) == {1, 2, 4}  # not this host's own, not c's (not known yet)
    assert all(v[0] <= 50_000 and v[-1] == 99_000 and len(set(v)) == len(v) for v in got.values())
    publish(100)
    job.peers.hosts = {a: [1], c: [3], other: [4]}  # c joins, b leaves
    ex.read(job, keep_from=60_000)
    got = taken(job)
    assert got[1] == got[4] == list(range(100_000, 105_000, 1000))
    assert got[3][0] <= 60_000 and got[3][-1] == 104_000 and 2 not in got  # c read back
    publish(105)
    job.peers.hosts = {a: [1], b: [2], c: [3], other: [4]}  # b back: from where it stopped
    ex.read(job, keep_from=60_000)
    got = taken(job)
    assert got[2] == list(range(100_000, 110_000, 1000))
    assert got[1] == got[3] == got[4] == list(range(105_000, 110_000, 1000))
    assert not ex.stats["bad_sample_entries"]
