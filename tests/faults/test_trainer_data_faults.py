"""A trainer's data is data: whatever a trainer writes under its own job (a phase name, a key of
the wrong type, deep or huge JSON, absurd numbers, the jobs index's order, a GPU another job
holds), booking stays exact for every other job and for its own exact where it can be.

Real Redis (the shared one, each test its own prefix); agents run in-process on a replayed
trace driven round by round (the conservation property's harness), the watcher and the API for
real (the FastAPI app over HTTP through its test client).
"""

from __future__ import annotations

import json
import shutil
import time
import uuid

import httpx
import pytest
import redis
from prometheus_client import generate_latest

from costexporter.services.exporter import registry_for
from costexporter.sources.synth import TraceBuilder
from costexporter.store import keys, ledger, protocol
from costexporter.trainer.transport import send_entries

from ..conftest import SHARED_URL, drop_prefix
from ..test_agent import offline_ms
from ..test_ledger_faults_property import HOLD_S, ROUND_S, Run


def startup_phase_job(name: str) -> TraceBuilder:
    """A job that trains, checkpoints step 20, runs 300 s more, then restarts: its rank 0
    declares a phase called `name` while it starts again and resumes from step 20 (60 steps,
    600 GPU-s, rolled back)."""
    b = TraceBuilder(n_gpus=2, per_host=2, job="st", seed=3)
    b.run("start")
    b.stretch("compute", 100, step_s=5, tokens=10)
    b.phase("checkpoint", "begin")
    b.stretch("checkpoint", 10)
    b.phase("checkpoint", "end", step=20)
    b.stretch("compute", 300, step_s=5, tokens=10)
    b.phase(name, "begin")
    b.stretch("idle", 20)
    b.phase(name, "end")
    b.run("resume", step=20)
    b.stretch("compute", 100, step_s=5, tokens=10)
    b.run("end")
    b.stretch("idle", 100)
    return b


def _booked(client, prefix: str, b: TraceBuilder) -> tuple[dict, Run]:
    run = Run(client, prefix, b, [b], None)
    run.run()
    return ledger.net_ms(ledger.read_amounts(client, prefix, b.job)), run


def test_a_phase_named_startup_keeps_rollbacks_exact_after_the_stream_is_trimmed(shared, prefix):
    # A declared phase named like the run's own startup allowance made the agent's fold give up:
    # every round walked the (trimmed) stream again, and the rollback's 600 GPU-s stayed productive.
    for name in ("startup", "warmup"):
        b = startup_phase_job(name)
        expected, _ = offline_ms(b)
        got, run = _booked(shared, f"{prefix}:{name}", b)
        trimmed = sum(ag.folds.stats["stream_entries_trimmed"] for ag in run.agents)
        assert trimmed > 0, (name, "the stream was never trimmed: the case is not exercised")
        assert got == expected, (name, got, expected)
        assert expected["rolled_back"] >= 2 * 290_000, expected  # the resume voided ~300 s on 2 GPUs
        assert not any(ag.folds.stats["timeline_rebuilds"] for ag in run.agents), name


def _run_restarting_empty(
    server, tmp_path, client, prefix: str, b: TraceBuilder, at_round: int, before: dict
):
    """Book `b` with one agent on the private `server`, which is killed with its AOF removed and
    started empty after round `at_round` (the ledger then is kept in `before`); the reporters
    find their job gone from the index and register again."""
    from ..test_agent import event_entry

    def restart(run: Run, rounds: int) -> None:
        if rounds != at_round:
            return
        before.update(ledger.net_ms(ledger.read_amounts(run.client, prefix, b.job)))
        server.kill()
        shutil.rmtree(tmp_path / "redis" / "appendonlydir", ignore_errors=True)
        server.start()  # empty
        send_entries(run.client, prefix, b.job, [event_entry(e) for e in b.events if e.type == "register"])

    run = Run(client, prefix, b, [b], {"after_round": restart})
    run.redis_url = server.url
    run.agents = [run._agent()]
    run.run()
    return run


def test_a_phase_named_startup_keeps_the_ledger_exact_across_redis_restarted_empty(tmp_path):
    # A private redis-server, killed with its AOF removed while job st runs (after the agent read
    # its phase and its resume): the ledger before plus the ledger after is the job's, whatever
    # the phase's name.
    from ..redis_server import RedisServer

    server = RedisServer(tmp_path / "redis").start()
    got = {}
    try:
        for name in ("startup", "warmup"):
            b = startup_phase_job(name)
            client, prefix = server.client(), f"ce-{name}"
            before: dict = {}

            # trace second 480: the phase (410-430 s) and the resume are read
            run = _run_restarting_empty(server, tmp_path, client, prefix, b, 32, before)
            after = ledger.net_ms(ledger.read_amounts(client, prefix, b.job))
            assert before and any(after.values()), (name, before, after)  # both lives booked
            got[name] = {c: before.get(c, 0) + after.get(c, 0) for c in after}
            assert sum(ag.stats["epoch_resets"] for ag in run.agents) >= 1, name
    finally:
        server.stop()
    expected, _ = offline_ms(startup_phase_job("startup"))
    assert got["startup"] == got["warmup"] == expected, got


def test_a_resume_read_after_redis_restarted_empty_never_books_from_a_lost_index(tmp_path):
    # Redis restarts empty after the steps to be voided were booked but before the resume is
    # read: their rollback index went with it. The agent cannot know what to move, so it moves
    # nothing and says so; it used to read the lost entries as zero and roll back the whole
    # history (tens of thousands of GPU-s, productive below zero).
    from ..redis_server import RedisServer

    server = RedisServer(tmp_path / "redis").start()
    try:
        b = startup_phase_job("warmup")
        client, prefix = server.client(), "ce-lost"
        before: dict = {}

        # trace second 300: steps past the checkpoint booked, no resume yet
        run = _run_restarting_empty(server, tmp_path, client, prefix, b, 20, before)
        after = ledger.net_ms(ledger.read_amounts(client, prefix, b.job))
        stats = run.agents[0].counts()
    finally:
        server.stop()
    assert before and any(after.values()), (before, after)
    got = {c: before.get(c, 0) + after.get(c, 0) for c in after}
    expected, _ = offline_ms(b)
    assert all(v >= 0 for v in after.values()), after  # nothing below zero
    assert sum(got.values()) == sum(expected.values())  # every GPU-ms booked once
    valid = ("productive", "overhead", "rolled_back")
    assert sum(got[c] for c in valid) == sum(expected[c] for c in valid)  # valid time conserved
    assert got["rolled_back"] < expected["rolled_back"]  # the lost part stays productive ...
    assert stats["epoch_resets"] >= 1 and stats["unreachable_voids"] > 0  # ... and is counted


# ---- one trainer's data never stops booking for the others --------------------------------------
def victim_job() -> TraceBuilder:
    """Job `a` on GPUs 0 and 1 of node0; GPU 2 of the node belongs to no job (a rogue trainer's
    job `bad` claims it in some cases)."""
    a = TraceBuilder(n_gpus=3, per_host=3, job="a", seed=7)
    a.events = [e for e in a.events if not (e.type == "register" and e.rank == 2)]
    a.run("start")
    a.stretch("compute", 120, step_s=5, tokens=10)
    a.phase("checkpoint", "begin")
    a.stretch("checkpoint", 10)
    a.phase("checkpoint", "end", step=24)
    a.stretch("compute", 60, step_s=5, tokens=10)
    a.run("end")
    a.stretch("idle", HOLD_S + 3 * ROUND_S)
    return a


def rogue_job(a: TraceBuilder) -> TraceBuilder:
    """The rogue trainer's job `bad`: its events (its register is written by each case)."""
    b = TraceBuilder(n_gpus=1, per_host=1, job="bad", seed=8, register=False, t0=a.t0 + 10)
    b.run("start")
    b.stretch("compute", 60, step_s=5, tokens=10)
    b.phase("checkpoint", "begin")
    b.stretch("checkpoint", 10)
    b.phase("checkpoint", "end", step=12)
    b.stretch("compute", 60, step_s=5, tokens=10)
    b.run("end")
    return b


def bad_registration(a: TraceBuilder, **over) -> str:
    reg = {"ts": a.t0 + 10, "host": "node0", "gpu": 2, "gpu_uuid": a.uuid(2), "world_size": 1, **over}
    return json.dumps(reg)


def _ranks(p: str) -> str:
    return keys.ranks_key(p, "bad")


# name -> what the rogue trainer (or anyone with its ACL) writes before the agents start; every
# case also sorts its job first in the jobs index (`ZADD jobs 0`).
HOSTILE = {
    "ranks_is_a_stream": lambda r, p, a: r.xadd(_ranks(p), {"x": "1"}),
    "deep_json": lambda r, p, a: r.hset(_ranks(p), "0", "[" * 200_000 + "]" * 200_000),
    "huge_json": lambda r, p, a: r.hset(_ranks(p), "0", bad_registration(a, pad="x" * 1_000_000)),
    "ts_1e300": lambda r, p, a: r.hset(_ranks(p), "0", bad_registration(a, ts=1e300)),
    "list_host": lambda r, p, a: r.hset(_ranks(p), "0", bad_registration(a, host=["node0"], gpu_uuid=None)),
    # keys only the agents write, created first with another type; the job is `bad`'s own
    "wm_is_a_hash": lambda r, p, a: (
        r.hset(_ranks(p), "0", bad_registration(a)),
        r.hset(keys.watermark_key(p, "bad", "node0"), "x", "1"),
    ),
    "fold_is_a_hash": lambda r, p, a: (
        r.hset(_ranks(p), "0", bad_registration(a)),
        r.hset(keys.fold_key(p, "bad", "node0"), "x", "1"),
    ),
    "readers_is_a_stream": lambda r, p, a: (
        r.hset(_ranks(p), "0", bad_registration(a)),
        r.xadd(keys.readers_key(p, "bad"), {"x": "1"}),
    ),
    "rbidx_is_a_string": lambda r, p, a: (
        r.hset(_ranks(p), "0", bad_registration(a)),
        r.set(keys.rbidx_key(p, "bad", "node0"), "x"),
    ),
    "bucket_is_a_string": lambda r, p, a: (
        r.hset(_ranks(p), "0", bad_registration(a)),
        r.set(keys.bucket_key(p, "bad", "1h", int(a.t0) // 3600 * 3600), "x"),
    ),
    # GPU 0 of node0 by host + index only, which job a holds by its UUID (registered earlier):
    # refused, the victim keeps it (sorted first, the rogue's claim is read before a's)
    "claims_a_held_gpu": lambda r, p, a: r.hset(
        _ranks(p), "0", json.dumps({"ts": a.t0 + 10, "host": "node0", "gpu": 0, "world_size": 1})
    ),
}
# Cases where the rogue job's registration is usable: GPU 2 is its own, booked exactly too.
CLAIMS = {"wm_is_a_hash", "fold_is_a_hash", "readers_is_a_stream", "rbidx_is_a_string", "bucket_is_a_string"}


@pytest.fixture(scope="module")
def clean_victim():
    """Job a's ledger, and the unassigned time, with no rogue trainer."""
    client = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    p = f"test-{uuid.uuid4().hex[:12]}"
    a = victim_job()
    try:
        run = Run(client, p, a, [a], None)
        run.run()
        return run.ledger(["a"])
    finally:
        drop_prefix(client, p)


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_rogue_trainers_data_never_stops_or_skews_booking_for_another_job(
    shared, prefix, clean_victim, case
):
    a = victim_job()
    run = Run(shared, prefix, a, [a, rogue_job(a)], None)
    HOSTILE[case](shared, prefix, a)
    shared.zadd(keys.jobs_key(prefix), {"bad": 0})  # sorts first: looked at before `a`
    run.run()
    got = run.ledger(["a", "bad"])
    agent = run.agents[0]
    assert got["a"] == clean_victim["a"], (case, got["a"], clean_victim["a"])  # not a millisecond moved
    u = ledger.load_watermark(shared, prefix, ledger.UNASSIGNED_JOB, "node0")["booked_until"]
    booked = sum(got["a"].values()) + sum(got["bad"].values()) + got["_unassigned"]
    assert booked == 3 * (u - int(a.t0 * 1000)), case  # every GPU-ms of the node once
    if case in CLAIMS:  # the rogue job's own GPU time did not vanish either
        assert sum(got["bad"].values()) > 0 and got["_unassigned"] < clean_victim["_unassigned"], got
    else:  # refused: GPU 2 stayed unassigned, as with no rogue job
        assert got["_unassigned"] == clean_victim["_unassigned"] and not any(got["bad"].values())
    refusals = getattr(agent, "refusals", None)
    refused = {**agent.registrations_rejected, **(refusals.counts if refusals else {})}
    assert any(job == "bad" for job, _reason in refused), (case, refused)  # counted, per job
    if case == "claims_a_held_gpu":
        assert refused.get(("bad", "gpu_held"), 0) >= 1, refused
        text = generate_latest(registry_for(agent)).decode()
        assert 'costexporter_data_rejected_total{reason="gpu_held",training_job="bad"}' in text
    assert not agent.stats["round_errors"] and not agent.stats["redis_errors"], (case, agent.stats)


def test_a_gpu_claimed_by_index_stays_its_uuid_holders_whichever_job_is_read_first(
    shared, prefix, clean_victim
):
    # The rogue posts nothing but its claim, sorted first in the jobs index: discovery reads it
    # before the victim's registration (in the same round), and the order must not decide.
    a = victim_job()
    run = Run(shared, prefix, a, [a], None)
    HOSTILE["claims_a_held_gpu"](shared, prefix, a)
    shared.zadd(keys.jobs_key(prefix), {"bad": 0})
    run.run()
    got = run.ledger(["a", "bad"])
    assert got["a"] == clean_victim["a"], (got["a"], clean_victim["a"])
    u = ledger.load_watermark(shared, prefix, ledger.UNASSIGNED_JOB, "node0")["booked_until"]
    booked = sum(got["a"].values()) + sum(got["bad"].values()) + got["_unassigned"]
    assert booked == 3 * (u - int(a.t0 * 1000)), got  # every GPU-ms of the node once
    # refused for good: dated inside a's run, the claim is not honoured once a has ended either
    assert not any(got["bad"].values()) and got["_unassigned"] == clean_victim["_unassigned"], got
    assert run.agents[0].refusals.counts[("bad", "gpu_held")] >= 1, run.agents[0].refusals.counts


# ---- the jobs index: a trainer's writes to it hide no job -----------------------------------------
INDEX_HOSTILE = {
    # created first with another type (a fresh deployment, Redis restarted empty)
    "index_is_a_stream": (lambda r, p: r.xadd(keys.jobs_key(p), {"x": "1"}), "wrong_type"),
    "index_is_a_hash": (lambda r, p: r.hset(keys.jobs_key(p), "x", "1"), "wrong_type"),
    # flooded with names that are no job's, dated ahead (the agents and the watcher take at most
    # 20 names here)
    "index_flooded": (
        lambda r, p: r.zadd(keys.jobs_key(p), {f"fake{i:03d}": 4e9 for i in range(50)}),
        "index_cut",
    ),
}


@pytest.mark.parametrize("case", sorted(INDEX_HOSTILE))
def test_a_jobs_index_a_trainer_broke_or_flooded_hides_no_job_from_the_agents(
    shared, prefix, clean_victim, monkeypatch, case
):
    from .. import test_ledger_faults_property as harness

    # the trainers go on when their ZADD is refused, as the reporter does (events went through)
    monkeypatch.setattr(harness.Run, "raise_on_error", False)
    write, reason = INDEX_HOSTILE[case]
    write(shared, prefix)
    a = victim_job()
    run = Run(shared, prefix, a, [a], None)
    for agent in run.agents:
        agent.discovery.index.max_names = 20
    run.run()
    got = run.ledger(["a"])
    assert got["a"] == clean_victim["a"], (case, got["a"], clean_victim["a"])
    assert got["_unassigned"] == clean_victim["_unassigned"], case
    agent = run.agents[0]
    assert agent.refusals.counts[("", reason)] >= 1, agent.refusals.counts
    assert agent.discovery.index.scans >= 1
    assert not agent.stats["round_errors"] and not agent.stats["redis_errors"], (case, agent.stats)
    text = generate_latest(registry_for(agent)).decode()
    assert f'costexporter_data_rejected_total{{reason="{reason}",training_job=""}}' in text


# ---- the watcher: the agent's registration rules, one bad entry never sets a job aside ----------
def _event(job: str, rank: int, seq: int, type_: str, ts: float, **f) -> dict:
    return protocol.encode_fields(
        {
            "v": "1",
            "type": type_,
            "job": job,
            "ts": f"{ts:.3f}",
            "rank": rank,
            "session": f"s{rank}",
            "seq": seq,
            **f,
        }
    )


def test_the_watcher_refuses_registrations_as_the_agent_does_and_judges_every_job(shared, prefix):
    from costexporter.services.exporter import watch_registry
    from costexporter.services.watcher import WatchConfig, Watcher

    now = time.time()
    for job in ("odd", "good", "streamed"):
        send_entries(
            shared,
            prefix,
            job,
            [_event(job, 0, 0, "run", now - 20, state="start")]
            + [_event(job, 0, k, "step", now - 20 + 2 * k, step=k) for k in range(1, 10)],
        )
    reg = {"ts": now - 20, "host": "h0", "gpu": 0, "world_size": 2}
    shared.hset(
        keys.ranks_key(prefix, "odd"),
        mapping={
            "0": json.dumps(reg),
            "70000": json.dumps(reg),  # beyond any world size
            "5": json.dumps(reg),  # not below its world_size
            "1": json.dumps({**reg, "ts": "nan"}),
            "2": json.dumps({**reg, "ts": -5}),
            "3": json.dumps({k: v for k, v in reg.items() if k != "ts"}),
            "4": "[" * 20_000 + "]" * 20_000,  # under the size bound, far over the depth one
        },
    )
    shared.delete(keys.ranks_key(prefix, "streamed"))
    shared.xadd(keys.ranks_key(prefix, "streamed"), {"x": "1"})  # a ranks key of the wrong type
    w = Watcher(WatchConfig(redis_url=SHARED_URL, prefix=prefix, clock=lambda: now))
    try:
        decided = w.poll()
        assert w.redis_up
        assert set(decided) >= {"odd", "good", "streamed"}, (decided, w.bad_jobs)
        assert not w.bad_jobs, w.bad_jobs  # none set aside
        for job in ("odd", "good", "streamed"):
            assert decided[job].state == "running", (job, decided[job])
        assert decided["odd"].last_step == 9
        rejected = getattr(w, "registrations_rejected", {})
        reasons = {r for (j, r), n in rejected.items() if j == "odd" and n}
        assert reasons == {"rank_out_of_range", "bad_ts", "too_deep"}, rejected
        assert sum(n for (j, _r), n in rejected.items() if j == "odd") == 6
        assert w.refusals.counts[("streamed", "wrong_type")] == 1
        text = generate_latest(watch_registry(w)).decode()
        assert 'costexporter_registrations_rejected_total{reason="bad_ts",training_job="odd"} 3.0' in text
        assert 'costexporter_data_rejected_total{reason="wrong_type",training_job="streamed"} 1.0' in text
    finally:
        w.stop()


def _watched(prefix: str, now: float, job: str = "good") -> None:
    r = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    events = [_event(job, 0, 0, "run", now - 30, state="start")]
    events += [_event(job, 0, k, "step", now - 30 + 2 * k, step=k) for k in range(1, 10)]
    send_entries(r, prefix, job, events, raise_on_error=False)
    r.hset(keys.ranks_key(prefix, job), "0", json.dumps({"ts": now - 30, "host": "h0", "gpu": 0}))


@pytest.mark.parametrize("case", sorted(INDEX_HOSTILE))
def test_a_watcher_finds_every_job_whatever_a_trainer_wrote_to_the_jobs_index(shared, prefix, case):
    from costexporter.services.exporter import watch_registry
    from costexporter.services.watcher import WatchConfig, Watcher

    now = time.time()
    write, reason = INDEX_HOSTILE[case]
    write(shared, prefix)  # before any job: the trainers' ZADDs are refused from then on
    _watched(prefix, now)
    w = Watcher(WatchConfig(redis_url=SHARED_URL, prefix=prefix, clock=lambda: now))
    w.index.max_names = 20
    try:
        decided = w.poll()
        assert w.redis_up and "good" in decided and decided["good"].state == "running", decided
        assert not any(j.startswith("fake") for j in decided), sorted(decided)  # no ranks key: no job
        assert w.refusals.counts[("", reason)] >= 1, w.refusals.counts
        text = generate_latest(watch_registry(w)).decode()
        assert f'costexporter_data_rejected_total{{reason="{reason}",training_job=""}}' in text
    finally:
        w.stop()


def test_a_score_a_trainer_set_in_the_jobs_index_drops_no_watched_job(shared, prefix):
    from costexporter.services.watcher import WatchConfig, Watcher

    now = time.time()
    _watched(prefix, now, "quiet")  # quiet since its last step, 12 s ago: a hang to be told
    clock = [now]
    w = Watcher(WatchConfig(redis_url=SHARED_URL, prefix=prefix, clock=lambda: clock[0]))
    try:
        assert "quiet" in w.poll()
        shared.zadd(keys.jobs_key(prefix), {"quiet": 0})  # a rogue trainer's ZADD (no GT)
        clock[0] = now + 600
        decided = w.poll()
        assert "quiet" in decided, decided  # judged from its own events, not the score
        assert decided["quiet"].state != "unknown", decided["quiet"]
    finally:
        w.stop()


def test_a_watcher_goes_on_when_a_jobs_events_key_is_not_a_stream(shared, prefix):
    from costexporter.services.watcher import WatchConfig, Watcher

    now = time.time()
    send_entries(shared, prefix, "good", [_event("good", 0, 0, "run", now - 5, state="start")])
    shared.hset(keys.stream_key(prefix, "hashed"), "x", "1")
    shared.zadd(keys.jobs_key(prefix), {"hashed": now})
    w = Watcher(WatchConfig(redis_url=SHARED_URL, prefix=prefix, clock=lambda: now))
    try:
        decided = w.poll()
        assert w.redis_up and decided["good"].state == "running", (w.redis_up, decided)
        assert "hashed" not in decided and "hashed" in w.bad_jobs
    finally:
        w.stop()


# ---- the API: GET /api/v1/jobs never answers 500 for a bad job -------------------------------------
def test_the_jobs_list_answers_with_warnings_whatever_a_trainer_wrote(shared, prefix):
    from costexporter.store.ledger_read import LedgerStore

    from ..api_helpers import WINDOW, served, write_job

    for j in ("good", "deep", "huge", "streamed", "metastring"):
        write_job(shared, prefix, j, "team")
    shared.hset(keys.ranks_key(prefix, "deep"), "1", "[" * 200_000 + "]" * 200_000)
    shared.hset(keys.ranks_key(prefix, "huge"), "1", json.dumps({"ts": 1e9, "pad": "x" * 1_000_000}))
    shared.delete(keys.ranks_key(prefix, "streamed"), keys.meta_key(prefix, "metastring"))
    shared.xadd(keys.ranks_key(prefix, "streamed"), {"x": "1"})
    shared.set(keys.meta_key(prefix, "metastring"), "x")
    with served(LedgerStore(shared, prefix)) as (base, _):
        for params in ({}, {"window": WINDOW}):
            got = httpx.get(f"{base}/api/v1/jobs", params=params, timeout=30)
            assert got.status_code == 200, got.text[:500]
            listed = {j["job"] for j in got.json()["jobs"]}
            assert listed >= {"good", "deep", "huge", "streamed", "metastring"}, listed


# ---- one agent id, one host ----------------------------------------------------------------------
def test_a_second_host_with_the_same_agent_id_is_refused_at_start(shared, prefix, tmp_path):
    from costexporter.sources.synth import write_nvidia_smi_csv

    from ..redis_server import free_port
    from ..test_agent import serve, stop_all

    b = TraceBuilder(n_gpus=4, per_host=2, job="twohosts", seed=9)
    b.run("start")
    b.stretch("compute", 600, step_s=5, tokens=10)
    csvs = {p.stem: p for p in write_nvidia_smi_csv(b.samples(), tmp_path / "t")}
    first = serve(csvs["node0"], "node0", SHARED_URL, prefix, free_port(), "--agent-id", "shared", speed=5)
    try:
        deadline = time.monotonic() + 30
        while not shared.get(keys.agent_id_key(prefix, "shared")):
            assert first.poll() is None and time.monotonic() < deadline, "the first agent did not start"
            time.sleep(0.1)
        second = serve(
            csvs["node1"], "node1", SHARED_URL, prefix, free_port(), "--agent-id", "shared", speed=5
        )
        _out, err = second.communicate(timeout=60)
        assert second.returncode == 2, err[-2000:]
        assert "agent id 'shared' is held by host 'node0'" in err and "--agent-id" in err, err[-2000:]
        assert "Traceback" not in err
        assert first.poll() is None  # the holder books on
    finally:
        stop_all([first])
    # The holder gave the id up at its exit: a host that takes over need not wait for the lease.
    assert shared.get(keys.agent_id_key(prefix, "shared")) is None


def test_a_second_host_with_the_same_agent_id_books_nothing_and_the_ledger_stays_exact(shared, prefix):
    # In-process, a round at a time: the twin host is started after the first (no start-up check
    # there) and must neither book its own GPUs under the shared id nor disturb the first one's.
    a = victim_job()
    clean = Run(shared, f"{prefix}:clean", a, [a], None)
    clean.run()
    run = Run(shared, f"{prefix}:twin", a, [a], {"twin_host": True})
    run.run()
    assert run.ledger(["a"]) == clean.ledger(["a"])
    twin = run.agents[-1]
    assert twin.host == "twin0" and twin.stats["agent_id_refused"] > 0 and twin.id_refused
    assert not any(j.booked_until for j in twin.jobs.values())
