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

from costexporter.core.booking import build_timeline, dated_until
from costexporter.core.fold import walk_relevant
from costexporter.services.agent import Agent, AgentConfig
from costexporter.services.exporter import registry_for
from costexporter.sources.playback import ReplaySource
from costexporter.sources.synth import TraceBuilder
from costexporter.store import keys, ledger
from costexporter.store.reader import EventReader
from costexporter.trainer.transport import send_entries

from .conftest import SHARED_URL, drop_prefix
from .test_agent import event_entry


def RebuildingAgent(source, cfg) -> Agent:
    """The agent before the fold: every round builds the timeline from every event and holds the
    whole rollback index (its folds part given those two ways)."""
    agent = Agent(source, cfg)

    def fetch_index(job, tl):
        rb = agent.redis.hgetall(keys.rbidx_key(cfg.prefix, job.name, cfg.agent_id))
        job.state.rb_index = {int(k): json.loads(v) for k, v in rb.items()}

    def timeline(job, terms, now_ms, final=False):
        reader = EventReader(agent.redis, job.name, prefix=cfg.prefix)
        events = [e for e in reader.read_until(job.reader.cursor) if walk_relevant(e)]
        job.fresh = []
        return build_timeline(dated_until(events, now_ms), terms.booking, terms.start_ms, now_ms, final=final)

    agent.folds.fetch_index = fetch_index  # type: ignore[method-assign]
    agent.folds.timeline = timeline  # type: ignore[method-assign]
    return agent


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
        if ":fold:" in name or name.endswith(":readers"):  # the agent's own resume state
            continue
        if ":agentid:" in name:  # the agent id's lease: which process holds it, and when
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


def run_agent(
    cls,
    prefix: str,
    b: TraceBuilder,
    late_event,
    restart_at: tuple[int, ...] = (),
    late_s: float = 100,
    on_round=None,
    **kw,
) -> Agent:
    """Drive an agent round by round; `restart_at`: rounds after which it is killed (its memory
    gone) and a new one started on the same Redis; `kw`, AgentConfig fields."""
    client = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    events = sorted(b.events, key=lambda e: e.ts)
    t0 = min(e.ts for e in events)
    now = [0.0]

    def start() -> Agent:
        started = [False]

        def clock() -> float:  # 0 at creation: a (re)started source plays the trace from its start
            if not started[0]:
                started[0] = True
                return 0.0
            return now[0]

        return cls(
            ReplaySource(b.samples(), speed=1.0, clock=clock),
            AgentConfig(prefix=prefix, agent_id="a", job_refresh_s=0, fold_lag_s=20.0, context_s=120.0, **kw),
        )

    agent = start()
    agent.restarted = []
    posted = 0
    held = True
    rounds = 0
    while now[0] < 1200:
        rounds += 1
        if rounds in restart_at:
            restarted = [*agent.restarted, agent]
            agent = start()  # killed: its memory is gone
            agent.restarted = restarted
        now[0] += 7
        upto = t0 + now[0] + 3  # events run a little ahead of the samples
        batch = []
        while posted < len(events) and events[posted].ts <= upto:
            if events[posted] is not late_event:
                batch.append(event_entry(events[posted]))
            posted += 1
        if held and now[0] > late_event.ts - t0 + late_s:  # 100 s late: older than the fold
            batch.append(event_entry(late_event))
            held = False
        if batch:
            send_entries(client, prefix, b.job, batch)
        for r in agent.source.read():
            agent.sampler._buf.append(r)
        if on_round is not None:
            on_round(rounds, t0 + now[0])
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
        assert folded.folds.stats["timeline_rebuilds"] == 1  # the late phase begin, once
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
        drop_prefix(client, f"{prefix}-ref")


def _stream_len(client, prefix: str, job: str) -> int:
    return client.xlen(keys.stream_key(prefix, job))


def test_a_restarted_agent_resumes_from_its_stored_fold_and_books_as_one_that_never_stopped(prefix):
    """Killed three times (once right after the late event, which it folds again from its stored
    fold: the stream below that was trimmed), every ledger key is the reference's; each restart
    read only the stream since its stored fold, and the stream was trimmed as it went."""
    b = trace()
    late = next(e for e in b.events if e.type == "phase" and e.rank == 1 and e.get("state") == "begin")
    restarts = (40, 55, 120)
    agent = run_agent(Agent, prefix, b, late, restart_at=restarts, fold_persist_s=0, late_keep_s=150)
    run_agent(RebuildingAgent, prefix + "-ref", b, late, fold_persist_s=None, trim_streams=False)
    client = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    try:
        assert ledger_keys(client, prefix) == ledger_keys(client, prefix + "-ref")
        every = [*agent.restarted, agent]
        assert [a.folds.stats["fold_restores"] for a in every] == [0, 1, 1, 1]
        assert sum(a.folds.stats["fold_restore_failures"] for a in every) == 0
        total = _stream_len(client, prefix + "-ref", b.job)
        for a in every[1:]:  # each restart read the backlog, not the job's history
            assert a.jobs[b.job].reader.stats["accepted"] < total / 2
        assert sum(a.folds.stats["timeline_rebuilds_from_store"] for a in every) == 1
        assert sum(a.folds.stats["stream_entries_trimmed"] for a in every) > total / 2
        assert _stream_len(client, prefix, b.job) < total / 2  # 1-2 x late_keep_s kept
    finally:
        drop_prefix(client, f"{prefix}-ref")


def test_after_trimming_a_restarted_agent_and_a_lagging_watcher_book_and_judge_as_without(prefix):
    """Real agent and watchers on a real Redis: one run trims the stream as it goes (the agent
    killed twice), the other never trims. Every ledger key is the same, and so is every status
    of a watcher that polls every round and of one that lags (polls every 12th round): its
    registered position keeps what it has not read yet. (Both registered before the first
    trim: a watcher started later reads only what is left.)"""
    from costexporter.services.watcher import WatchConfig, Watcher

    b = trace()
    late = next(e for e in b.events if e.type == "phase" and e.rank == 1 and e.get("state") == "begin")
    client = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    seen: dict[str, list] = {}
    lowest: dict[str, list] = {}

    def watch(p: str):
        clock = [0.0]
        cfg = dict(prefix=p, clock=lambda: clock[0], heartbeat_timeout_s=1e9, register_position_s=0)
        every = Watcher(WatchConfig(watcher_id="every", **cfg))
        lagging = Watcher(WatchConfig(watcher_id="lagging", **cfg))
        seen[p], lowest[p] = [], []

        def on_round(rounds: int, t: float) -> None:
            clock[0] = t
            for w in (every, lagging) if rounds % 12 == 1 else (every,):
                st = w.poll().get(b.job)
                if st is not None:
                    d = st.to_dict()
                    d.pop("since")
                    seen[p].append((w.cfg.watcher_id, rounds, d))
            first = client.xrange(keys.stream_key(p, b.job), count=1)
            lowest[p].append((first[0][0] if first else None, lagging.readers.get(b.job)))

        return on_round

    kw = dict(fold_persist_s=0, late_keep_s=150)
    run_agent(Agent, prefix, b, late, restart_at=(50, 100), on_round=watch(prefix), **kw)
    ref = prefix + "-ref"
    run_agent(Agent, ref, b, late, on_round=watch(ref), fold_persist_s=None, trim_streams=False)
    try:
        assert ledger_keys(client, prefix) == ledger_keys(client, ref)
        assert seen[prefix] == seen[ref]
        assert {d["state"] for _, _, d in seen[prefix]} >= {"running", "done"}
        assert _stream_len(client, prefix, b.job) < _stream_len(client, ref, b.job) / 2
        for first, reader in lowest[prefix]:  # never trimmed past what the lagging one had read
            if first is not None and reader is not None and reader.cursor != "0-0":
                a, c = (tuple(int(x) for x in i.split("-")) for i in (first, reader.cursor))
                assert a <= c
        readers = client.hgetall(keys.readers_key(prefix, b.job))
        assert set(readers) == {"agent:a", "watcher:every", "watcher:lagging"}
    finally:
        drop_prefix(client, ref)


def test_a_restart_after_the_trainer_registered_again_keeps_the_jobs_start(prefix):
    """Both ranks register again 12 minutes in (a trainer restarted); the agent restarted after
    that sees only the newer registrations in the ranks hash, but keeps the job's start of its
    stored fold: the same ledger as an agent that never stopped, on a stream trimmed below it."""
    b = TraceBuilder(n_gpus=2, per_host=2, job="reregistered", seed=12)
    b.run("start")
    b.stretch("compute", 720, step_s=4, tokens=10)
    b.stretch("idle", 30)  # the trainer crashed (no run end) and comes back
    for r in range(2):
        h, g = b.host_of(r)
        b.event(
            "register", rank=r, host=h, gpu=g, gpu_uuid=b.uuid(r), local_rank=g, world_size=2, pid=2000 + r
        )
    b.run("resume", step=150)
    b.stretch("compute", 300, step_s=4, tokens=10)
    b.run("end")
    b.stretch("idle", 20)
    late = next(e for e in b.events if e.type == "step")
    kw = dict(late_s=10_000)  # never posted late: the run ends first
    agent = run_agent(Agent, prefix, b, late, restart_at=(118,), fold_persist_s=0, late_keep_s=150, **kw)
    run_agent(RebuildingAgent, prefix + "-ref", b, late, fold_persist_s=None, trim_streams=False, **kw)
    client = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    try:
        assert agent.folds.stats["fold_restores"] == 1 and agent.folds.stats["timeline_rebuilds"] == 0
        assert ledger_keys(client, prefix) == ledger_keys(client, prefix + "-ref")
    finally:
        drop_prefix(client, f"{prefix}-ref")


def test_a_reader_silent_too_long_no_longer_pins_the_stream(prefix):
    """`trim_stream` trims below the oldest fresh reader; a stale or malformed entry is ignored
    and forgotten; a registered rank no agent covers yet holds every trim back."""
    client = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    key = keys.stream_key(prefix, "j")
    ids = [client.xadd(key, {"n": str(i)}, id=f"{1000 + i}-0") for i in range(10)]
    rk = keys.readers_key(prefix, "j")
    pipe = client.pipeline()
    ledger.queue_position(pipe, prefix, "j", "agent:a", ids[6], now=100.0, ranks=[0, 1])
    ledger.queue_position(pipe, prefix, "j", "watcher:w", ids[2], now=50.0)
    pipe.hset(rk, "junk", "{not json")
    pipe.execute()
    assert ledger.trim_stream(client, prefix, "j", 120.0, 1000.0, {0, 1, 2}) == -1  # rank 2: no agent yet
    assert client.xlen(key) == 10
    assert ledger.trim_stream(client, prefix, "j", 120.0, 1000.0, {0, 1}) == 2  # the watcher's
    assert client.xrange(key, count=1)[0][0] == ids[2]
    assert "junk" not in client.hgetall(rk)
    assert ledger.trim_stream(client, prefix, "j", 120.0, 1000.0, {0, 1}) == 0  # idempotent
    assert ledger.trim_stream(client, prefix, "j", 1060.0, 1000.0, {0, 1}) == 4  # the watcher is stale
    assert set(client.hgetall(rk)) == {"agent:a"}
    assert client.xrange(key, count=1)[0][0] == ids[6]


def test_a_stored_fold_of_another_format_or_corrupted_is_rebuilt_from_the_stream(prefix):
    """A restart that finds an unreadable fold (an older format, garbage, a foreign job's) folds
    the whole stream again: counted, logged once, the same ledger, no crash."""
    import base64

    from costexporter.core.fold import _MAGIC

    b = trace()
    late = next(e for e in b.events if e.type == "phase" and e.rank == 1 and e.get("state") == "begin")
    client = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    run_agent(RebuildingAgent, prefix + "-ref", b, late, fold_persist_s=None, trim_streams=False)
    bad = [
        "not base64 at all!",
        base64.b64encode(b"garbage").decode(),
        base64.b64encode(_MAGIC + b"\x00\x01zz").decode(),
    ]
    try:
        assert ledger_keys(client, prefix + "-ref"), "the reference run booked nothing"
        for i, junk in enumerate(bad):
            p = f"{prefix}-{i}"

            def Corrupting(source, cfg, junk=junk) -> Agent:
                agent = Agent(source, cfg)
                load = agent.folds.load

                def damaged(job):  # the stored fold is damaged before a restart reads it
                    k = keys.fold_key(cfg.prefix, job.name, cfg.agent_id)
                    if client.exists(k):
                        client.set(k, junk)
                    load(job)

                agent.folds.load = damaged  # type: ignore[method-assign]
                return agent

            agent = run_agent(Corrupting, p, b, late, restart_at=(30,), fold_persist_s=0, trim_streams=False)
            assert agent.folds.stats["fold_restore_failures"] == 1 and agent.folds.stats["fold_restores"] == 0
            assert ledger_keys(client, p) == ledger_keys(client, prefix + "-ref")
            found = list(client.scan_iter(f"{p}:*"))
            client.delete(*found)
    finally:
        drop_prefix(client, f"{prefix}-ref")


def test_a_watcher_refolds_a_late_event_from_the_stream_and_judges_as_a_fresh_one(prefix):
    """The watcher keeps no events: an event older than its fold is read again from the stream,
    and every poll's status is a fresh watcher's (one that reads the whole stream at once)."""
    from costexporter.services.watcher import WatchConfig, Watcher

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


def checkpointed(resume_to: int) -> TraceBuilder:
    """Eight checkpoints (steps 10, 20, ..., 80), then a resume to step `resume_to`."""
    b = TraceBuilder(n_gpus=2, per_host=2, job="ckpts", seed=12)
    b.run("start")
    for _ in range(8):
        b.stretch("compute", 40, step_s=4, tokens=100)
        b.phase("checkpoint", "begin")
        b.stretch("checkpoint", 8)
        b.phase("checkpoint", "end", step=b.step)
    b.stretch("compute", 40, step_s=4, tokens=100)  # steps 81..90
    b.run("resume", step=resume_to)
    b.step = resume_to
    b.stretch("compute", 60, step_s=4, tokens=100)
    b.run("end")
    b.stretch("idle", 10)
    return b


def _rbidx(client, prefix: str, job: str) -> dict[int, list]:
    raw = client.hgetall(keys.rbidx_key(prefix, job, "a"))
    return {int(k): json.loads(v) for k, v in raw.items()}


def test_the_rollback_index_keeps_only_what_a_resume_can_reach_and_books_as_the_full_one(prefix):
    """With 3 checkpoints reachable, the index holds the records from the oldest of them on (not
    the job's whole history) and in the valid categories only; a resume to that checkpoint moves
    exactly what an agent keeping every entry moves."""
    from costexporter.core.booking import BookingConfig

    b = checkpointed(resume_to=60)
    never = b.events[0]  # nothing arrives late
    pruned = run_agent(Agent, prefix, b, never, late_s=1e9, booking=BookingConfig(rollback_checkpoints=3))
    run_agent(Agent, prefix + "-all", b, never, late_s=1e9, booking=BookingConfig(rollback_checkpoints=1000))
    client = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    try:
        got = ledger.read_amounts(client, prefix, b.job)
        assert got == ledger.read_amounts(client, prefix + "-all", b.job)
        assert got.get("rolled_back:ms", 0) > 0 and pruned.booker.stats["unreachable_voids"] == 0
        small, full = _rbidx(client, prefix, b.job), _rbidx(client, prefix + "-all", b.job)
        # The reachable checkpoints when step 90 was booked: 60, 70, 80 (records 59, 69, 79).
        assert min(small) == 59 and min(full) == 0 and len(small) < len(full) / 2
        assert {len(v) for v in small.values()} == {9}  # 3 valid categories x (ms, mJ, cost)
    finally:
        drop_prefix(client, f"{prefix}-all")


def test_a_resume_further_back_than_the_index_reaches_is_counted_and_moves_nothing_twice(prefix, caplog):
    """A resume to step 30 when only the last 3 checkpoints (60, 70, 80) are kept: the voided
    records below the index's floor are not moved (their time stays valid: never more than the
    full index moves), the agent counts them and says so once."""
    from costexporter.core.booking import BookingConfig

    b = checkpointed(resume_to=30)
    never = b.events[0]
    with caplog.at_level("WARNING", logger="costexporter.agent"):
        pruned = run_agent(Agent, prefix, b, never, late_s=1e9, booking=BookingConfig(rollback_checkpoints=3))
    run_agent(Agent, prefix + "-all", b, never, late_s=1e9, booking=BookingConfig(rollback_checkpoints=1000))
    client = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    try:
        got = ledger.read_amounts(client, prefix, b.job)
        full = ledger.read_amounts(client, prefix + "-all", b.job)
        assert pruned.booker.stats["unreachable_voids"] > 0
        assert 0 < got.get("rolled_back:ms", 0) < full["rolled_back:ms"]
        assert sum(ledger.net_ms(got).values()) == sum(ledger.net_ms(full).values())  # each GPU-second once
        assert (
            sum("older than the oldest of the last 3 checkpoints" in r.message for r in caplog.records) == 1
        )
    finally:
        drop_prefix(client, f"{prefix}-all")
