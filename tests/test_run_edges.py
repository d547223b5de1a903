"""The edges of a run, live and offline: a crashed job's claim ends at its liveness timeout, a
live job's GPU is not taken over (a squatter, a successor that comes too soon), a run after a
clean end voids nothing, a job whose own events key is of the wrong type books `unobserved`.

The live agents run in-process (real `Agent` objects, a real Redis) over the trace the way
tests/test_ledger_faults_property.py drives them; each scenario is checked against offline replay
of the same samples and events, and every GPU-millisecond is booked exactly once."""

from __future__ import annotations

import dataclasses
import json
import secrets

import pytest
import redis
from hypothesis import HealthCheck, example, given, note, settings
from hypothesis import strategies as st

from costexporter.core.booking import BookingConfig
from costexporter.core.diagnostics import Diagnostics
from costexporter.core.events import parse_event
from costexporter.core.model import CATEGORIES
from costexporter.core.replay import ReplayConfig, book_trace
from costexporter.core.timeutil import to_ms
from costexporter.sources.synth import TraceBuilder
from costexporter.store import keys, ledger

from .conftest import SHARED_URL, drop_prefix
from .test_ledger_faults_property import HOLD_S, ROUND_S, Run, offline

# Short enough that the scenarios below lapse, come back and hand GPUs over within minutes.
BOOKING = BookingConfig(liveness_timeout_s=20.0, liveness_timeout_max_s=45.0)
BEAT_S = 10.0


def live(b: TraceBuilder, state: str, duration_s: float, step_s: float | None, beats: bool) -> None:
    """A stretch of the job alive: its steps, and rank 0's heartbeats where its reporter beats."""
    t = b.t
    b.stretch(state, duration_s, step_s=step_s, tokens=10)
    while beats and t + BEAT_S < b.t:
        t += BEAT_S
        b.event("heartbeat", ts=t)


def build_edges(n: int, seed: int, beats: bool, d1: int, squat: bool, how: str, then: str, gap: int, d: int):
    """Job a (n GPUs, rank 0 beating or not) trains for d1 s, ends (`how` = "end") or crashes;
    `squat`: another job names a's GPU 0 by its UUID inside a's run, runs and ends; `gap` s later
    `then`: another job registers a's GPUs and trains (`successor`), a program that reports
    nothing runs (`program`), or a runs again under its name, steps from 1 (`again`)."""
    a = TraceBuilder(n_gpus=n, per_host=n, job="a", seed=seed)
    a.run("start")
    live(a, "compute", d1, 4, beats)
    jobs = [a]
    if squat:
        sq = TraceBuilder(n_gpus=1, per_host=n, job="sq", seed=seed, t0=a.t0 + 10, register=False)
        sq.event("register", host="node0", gpu=0, gpu_uuid=a.uuid(0), local_rank=0, world_size=1, pid=9)
        sq.run("start")
        for k in range(1, 4):
            sq.event("step", ts=sq.t + 2 * k, step=k)
        sq.t += 8
        sq.run("end")
        jobs.append(sq)
    if how == "end":
        a.run("end")
    a.stretch("idle", gap)  # a's processes gone (or ended): nothing posts
    if then == "successor":
        b = TraceBuilder(n_gpus=n, per_host=n, job="b", seed=seed, t0=a.t)
        b.run("start")
        live(b, "compute", d, 4, beats)
        a.stretch("compute", d)  # b's samples
        b.run("end")
        jobs.append(b)
    elif then == "program":
        a.stretch("compute", d)
    else:
        a.new_processes()
        a.step = 0
        a.run("start")
        live(a, "compute", d, 4, beats)
        a.run("end")
    a.stretch("idle", HOLD_S + 3 * ROUND_S)
    return a, jobs, {"beats": beats, "squat": squat, "how": how, "then": then, "gap": gap}


@st.composite
def edges(draw):
    squat = draw(st.booleans())
    # (Not drawn: the squatter, which takes a's GPU where a's run ends, then a running again
    # there. A job's claim of a GPU dates from its first registration, so a's second run on a
    # GPU another job took in between is not a's: a known limit, docs/accounting.md.)
    then = draw(st.sampled_from(["successor", "program"] if squat else ["successor", "program", "again"]))
    return build_edges(
        n=draw(st.integers(1, 2)),
        seed=draw(st.integers(0, 1000)),
        beats=draw(st.booleans()),
        d1=draw(st.integers(20, 90)),
        squat=squat,
        how=draw(st.sampled_from(["end", "crash"])),
        then=then,
        gap=draw(st.integers(2, 90)),
        d=draw(st.integers(20, 80)),
    )


# Job a's keys its trainer writes, each as another type while it is broken.
BREAK = {
    "events": (keys.stream_key, lambda r, k: r.hset(k, "x", "1")),
    "ranks": (keys.ranks_key, lambda r, k: r.set(k, "x")),
    "meta": (keys.meta_key, lambda r, k: r.set(k, "x")),
    "beats": (keys.beats_key, lambda r, k: r.hset(k, "x", "1")),
}


class _BrokenFor(Run):
    """Job a's trainer-written key `key` is of another type from round `bad[0]` to `bad[1]`
    (its trainer wrote it so): Redis refuses a's writes to it meanwhile, as a trainer's would be
    refused (the others go through); then it is deleted (mended). The faults property's rounds,
    the key switched between two rounds (`after_round`)."""

    raise_on_error = False

    def __init__(self, *args, bad: tuple[int, int], key: str = "events", **kw) -> None:
        super().__init__(*args, **kw)
        self.bad, (self.build, self.breaks) = bad, BREAK[key]
        self.faults["after_round"] = lambda run, rounds: run.switch(rounds + 1)

    def switch(self, next_round: int) -> None:
        """The key as round `next_round` finds it."""
        key = self.build(self.prefix, "a")
        if next_round == self.bad[0]:
            self.client.delete(key)
            self.breaks(self.client, key)
        elif next_round == self.bad[1]:
            self.client.delete(key)

    def prepare(self) -> None:
        super().prepare()
        self.switch(1)


def booked(a: TraceBuilder, jobs: list[TraceBuilder], prefix: str, broken=None) -> tuple[dict, int]:
    """The live ledger of the scenario and the physical GPU time up to the unassigned ledger's
    watermark; `broken`: (a's key, from round, to round) of another type meanwhile."""
    client = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    if broken is None:
        run = Run(client, prefix, a, jobs, None, booking=BOOKING)
    else:
        key, lo, hi = broken
        run = _BrokenFor(client, prefix, a, jobs, None, booking=BOOKING, bad=(lo, hi), key=key)
    run.run()
    got = run.ledger([b.job for b in jobs])
    until = ledger.load_watermark(client, prefix, ledger.UNASSIGNED_JOB, "node0")["booked_until"]
    return got, a.n_gpus * (until - int(a.t0 * 1000))


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
# A successor registered while the squatter's claim waited for a's crash to lapse: it waits for
# the squatter's hold (whose run was over), not for a alone; replay judged it against the
# squatter's hold, which had not begun at its date, and booked it inside a's crash tail.
# a's events key unreadable until after b's claim waited for a and b's run ended: b's claim,
# taken where a's hold ended, was an open hold when the time of no job was booked that round
# (42 s lost); the jobs that take a GPU now book their round first.
@example(build_edges(1, 0, False, 20, False, "end", "successor", 2, 80), ("events", 1, 14))
@example(build_edges(1, 0, False, 20, True, "crash", "successor", 2, 20), None)
@example(build_edges(2, 1, True, 30, False, "crash", "again", 40, 30), None)  # a lapse, then a's restart
@example(build_edges(1, 2, True, 30, False, "end", "again", 5, 30), None)  # a rerun: a new run, no voids
@given(
    edges(),
    st.one_of(
        st.none(),
        st.tuples(st.sampled_from(sorted(BREAK)), st.integers(1, 8), st.integers(1, 30)).map(
            lambda t: (t[0], t[1], t[1] + t[2])
        ),
    ),
)
def test_the_edges_of_runs_book_live_as_offline_and_every_gpu_millisecond_once(scenario, broken) -> None:
    """Any edge of `edges`, live as offline; and with a key of job a's own (its events, ranks,
    meta or heartbeat stream) of another type for a while, every GPU-millisecond still once."""
    a, jobs, how = scenario
    note(f"{how} broken={broken}")
    prefix = f"edges-{secrets.token_hex(5)}"
    client = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    try:
        got, physical = booked(a, jobs, prefix, broken)
    finally:
        drop_prefix(client, prefix)
    names = [b.job for b in jobs]
    note(f"live={got}")
    assert sum(sum(got[j].values()) for j in names) + got["_unassigned"] == physical
    if broken is not None:
        return  # (its trainer's refused writes are in no replay: conserved is what holds)
    want = offline(a, jobs, BOOKING)
    for j in names:
        assert got[j] == want.get(j, dict.fromkeys(CATEGORIES, 0)), (j, got[j], want.get(j))


def test_a_job_run_again_then_crashed_keeps_its_gpu_from_a_claim_read_before_its_new_run_is_booked(
    prefix,
) -> None:
    """a ends cleanly, its process starts again (a new register, a new run) and crashes 10 s
    later; b registers the GPU 37 s after a's new run began. The agent books a lag behind, so it
    reads b's claim before its timeline of a shows the new run: a's newer register says a runs
    again, and b waits for a's run as replay has it (found by the faults property: b took the
    GPU at once, 140 s of a's booked to b and `unassigned`)."""
    from .test_ledger_faults_property import build

    a, jobs, _faults = build(
        1,
        216,
        [("compute", 29, 10), ("communication", 156, 4), ("idle", 138, 10)],
        (27, 165),
        {},
        (41, None, 10),
    )
    run = Run(redis.Redis.from_url(SHARED_URL, decode_responses=True), prefix, a, jobs, None)
    run.run()
    got = run.ledger([b.job for b in jobs])
    want = offline(a, jobs)
    assert got["a"] == want["a"] and got["b"] == want["b"]
    assert sum(got["b"].values()) == 0  # b's claim waits for a's run, past the trace's end
    assert got["a"]["no_progress"] == 165_000  # b's program on a's GPU, inside a's live run


def test_a_crashed_jobs_claim_ends_at_its_liveness_timeout_and_a_program_after_is_unassigned(prefix) -> None:
    """A job that beats crashes (no run end): its GPUs are its crash tail's waste for the
    liveness timeout after its last heartbeat, then `unassigned`; a program that reports
    nothing, run on them afterwards, is never the crashed job's."""
    a = TraceBuilder(n_gpus=2, per_host=2, job="a", seed=3)
    a.run("start")
    live(a, "compute", 60, 4, beats=True)
    last_sign = max(e.ts for e in a.events)
    a.stretch("idle", 30)  # crashed: nothing posts
    a.stretch("compute", 60)  # somebody's program, no events
    a.stretch("idle", HOLD_S + 3 * ROUND_S)
    got, physical = booked(a, [a], prefix)
    lapse_ms = round((last_sign + BOOKING.liveness_timeout_s - a.t0) * 1000)
    assert sum(got["a"].values()) == 2 * lapse_ms  # the job's claim ends at the lapse, on each GPU
    assert got["a"]["no_progress"] == 0  # the program is not the crashed job's
    assert got["a"]["idle"] > 0  # its crash tail is
    assert got["_unassigned"] == physical - 2 * lapse_ms
    assert got["a"] == offline(a, [a], BOOKING)["a"]


def test_a_squatter_is_refused_counted_and_noted_for_both_jobs_and_the_holder_keeps_its_gpu(prefix) -> None:
    """A trainer registers a live job's GPU by its UUID (its own job's keys only): refused,
    counted (`gpu_in_use`), and said in both jobs' figures, where the API lists it among their
    warnings. The holder books every second of its run; when the squatter posts `run end`,
    nothing moves to `unassigned`."""
    a = TraceBuilder(n_gpus=1, per_host=1, job="a", seed=4)
    a.run("start")
    live(a, "compute", 120, 4, beats=True)
    a.run("end")
    a.stretch("idle", HOLD_S + 3 * ROUND_S)
    sq = TraceBuilder(n_gpus=1, per_host=1, job="sq", seed=4, t0=a.t0 + 20)  # a's GPU, by UUID
    sq.run("start")
    sq.t += 30
    sq.run("end")
    client = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    run = Run(client, prefix, a, [a, sq], None, booking=BOOKING)
    run.run()
    got = run.ledger(["a", "sq"])
    assert sum(got["sq"].values()) == 0
    assert sum(got["a"].values()) == 120_000 and got["a"]["productive"] > 100_000
    agent = run.agents[0]
    assert agent.discovery.rejected[("sq", "gpu_in_use")] == 1  # once, not every discovery
    figures = {j: client.hgetall(keys.figures_key(prefix, j)) for j in ("a", "sq")}
    notes = {j: ledger.notes_of(f) for j, f in figures.items()}
    assert any("while job 'a'" in t for t in notes["sq"]), notes
    assert any("job 'sq' registered" in t for t in notes["a"]), notes
    want = offline(a, [a, sq], BOOKING)
    assert (got["a"], got["sq"]) == (want["a"], want["sq"])


def test_a_job_whose_events_key_is_not_a_stream_books_its_gpus_unobserved(prefix) -> None:
    """Its trainer wrote the job's events key as a hash and registered through the ranks hash:
    every second of its GPUs from its registration is `unobserved` (counted, noted), none is
    lost; once the key is a stream again, what follows books by its events."""
    a = TraceBuilder(n_gpus=2, per_host=2, job="a", seed=5)
    a.run("start")
    live(a, "compute", 100, 4, beats=True)
    a.run("end")
    a.stretch("idle", HOLD_S + 3 * ROUND_S)
    client = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    client.hset(keys.stream_key(prefix, "a"), "x", "1")
    regs = [e for e in a.events if e.type == "register"]
    for e in regs:  # registered through the ranks hash alone (its XADDs refused)
        client.hset(keys.ranks_key(prefix, "a"), str(e.rank), json.dumps({"ts": e.ts, **e.fields}))
    client.zadd(keys.jobs_key(prefix), {"a": a.t0})
    client.incr(keys.registrations_key(prefix))
    silent = TraceBuilder(n_gpus=2, per_host=2, job="a", seed=5, register=False)
    run = Run(client, prefix, a, [silent], None, booking=BOOKING)
    run.run()
    got = run.ledger(["a"])
    until = ledger.load_watermark(client, prefix, ledger.UNASSIGNED_JOB, "node0")["booked_until"]
    physical = 2 * (until - int(a.t0 * 1000))
    assert sum(got["a"].values()) + got["_unassigned"] == physical
    assert got["a"]["unobserved"] > 0 and got["a"]["unobserved"] == sum(got["a"].values())
    agent = run.agents[0]
    assert agent.refusals.counts[("a", "events_unreadable")] > 0
    assert any(
        "events key is not a stream" in t
        for t in ledger.notes_of(client.hgetall(keys.figures_key(prefix, "a")))
    )


def test_replay_refuses_a_claim_of_a_live_jobs_gpu_and_says_so() -> None:
    """The same rule offline (`jobfacts.takeover_at`): said once (`gpu_in_use`), the squatter
    books nothing while the holder's run lives."""
    a = TraceBuilder(n_gpus=1, per_host=1, job="a", seed=6)
    a.run("start")
    live(a, "compute", 100, 4, beats=True)
    sq = TraceBuilder(n_gpus=1, per_host=1, job="sq", seed=6, t0=a.t0 + 20)
    sq.run("start")
    diag = Diagnostics(stream=None)
    results, _ = book_trace(a.samples(), a.events + sq.events, ReplayConfig(booking=BOOKING), diag)
    assert diag.counts["gpu_in_use"] == 1
    by_job = {r.name: int(r.pieces.dur_ms.sum()) for r in results}
    assert by_job["sq"] == 0 and by_job["a"] == 100_000


def test_a_job_whose_events_key_breaks_mid_run_books_that_stretch_unobserved_and_the_rest_by_its_events(
    prefix,
) -> None:
    """The key is a hash for a minute mid-run: that minute (from where the agent had booked) is
    `unobserved`; before and after, the job books by its events; every GPU-millisecond once,
    and once the key is a stream again, no run rule gives the broken stretch to another ledger
    (the job's silence there would read as a lapse)."""
    a = TraceBuilder(n_gpus=2, per_host=2, job="a", seed=8)
    a.run("start")
    live(a, "compute", 200, 4, beats=True)
    a.run("end")
    a.stretch("idle", HOLD_S + 3 * ROUND_S)
    client = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    run = _BrokenFor(client, prefix, a, [a], None, booking=BOOKING, bad=(5, 10))
    run.run()
    got = run.ledger(["a"])
    until = ledger.load_watermark(client, prefix, ledger.UNASSIGNED_JOB, "node0")["booked_until"]
    assert sum(got["a"].values()) + got["_unassigned"] == 2 * (until - int(a.t0 * 1000))
    assert 60_000 <= got["a"]["unobserved"] <= 2 * 6 * ROUND_S * 1000  # the broken stretch, both GPUs
    # before and after it, by the events (the seconds after it until the first event that came
    # through are outside the job: no sign of life is known there)
    assert got["a"]["productive"] > 2 * 70_000
    assert run.agents[0].refusals.counts[("a", "events_unreadable")] > 0


def test_an_operator_closes_a_run_by_hand_and_its_claim_ends_there(prefix, cli) -> None:
    """`costexporter claims close` (a real process) posts the job's run end at `--at`: the
    agents end its claim on its GPUs there (the rest is `unassigned`), replay of the job's
    exported events books it alike, and the close is noted for the API with its reason."""
    a = TraceBuilder(n_gpus=1, per_host=1, job="a", seed=9)
    a.run("start")
    live(a, "compute", 120, 4, beats=True)  # a hung job's process would beat on: it never ends
    a.stretch("idle", HOLD_S + 3 * ROUND_S)
    client = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    client.zadd(keys.jobs_key(prefix), {"a": a.t0})  # known to the ledger
    got = cli("claims", "close", "a", "--at", str(a.t0 + 50), "--reason", "node drained", "--prefix", prefix)
    assert got.returncode == 0, got.stderr
    assert cli("claims", "close", "nope", "--reason", "x", "--prefix", prefix).returncode == 2
    closed = [e for e in client.xrange(keys.stream_key(prefix, "a")) if e[1].get("by") == "operator"]
    assert len(closed) == 1
    close_ev = parse_event(closed[0][1])
    run = Run(client, prefix, a, [a], None, booking=BOOKING)
    run.run()
    booked_ms = run.ledger(["a"])
    assert sum(booked_ms["a"].values()) == 50_000  # its claim ended at the close
    assert booked_ms["a"] == offline(a, [a, _Events([close_ev])], BOOKING)["a"]
    notes = ledger.notes_of(client.hgetall(keys.figures_key(prefix, "a")))
    assert any("closed by hand" in t and "node drained" in t for t in notes), notes


class _Events:
    """Events of a job to book with a trace (`offline` takes builders)."""

    def __init__(self, events) -> None:
        self.events = events
        self.job = events[0].job


@pytest.mark.parametrize(
    "case",
    ["torchrun --max-restarts", "slurm --requeue"],
)
def test_an_elastic_restart_and_a_requeue_book_as_the_run_table_says(prefix, case) -> None:
    """torchrun restarts the crashed ranks within seconds (new processes register again and post
    `run start`, their steps again from the last checkpoint, undeclared): the same run, the gap
    its waste, the redone steps voided. SLURM requeues the job minutes later (`run resume` from
    its checkpoint): the crashed run lapsed meanwhile, the time between is outside the job, the
    resume voids the steps it redoes. Live as offline, every GPU-millisecond once."""
    a = TraceBuilder(n_gpus=2, per_host=2, job="a", seed=11)
    a.run("start")
    live(a, "compute", 60, 4, beats=True)  # steps 1..15
    a.stretch("idle", 8 if case.startswith("torchrun") else 120)  # crashed: nothing posts
    a.new_processes()
    if case.startswith("torchrun"):
        a.run("start")
        a.step = 10  # back to the checkpoint after step 10, not said
    else:
        a.run("resume", step=10)
    live(a, "compute", 40, 4, beats=True)  # steps 11..20
    a.run("end")
    a.stretch("idle", HOLD_S + 3 * ROUND_S)
    got, physical = booked(a, [a], prefix)
    assert sum(got["a"].values()) + got["_unassigned"] == physical
    assert got["a"] == offline(a, [a], BOOKING)["a"]
    assert got["a"]["rolled_back"] == 2 * 5 * 4000  # steps 11..15 redone, 4 s each, on both GPUs
    gap_outside = got["_unassigned"] - 2 * (HOLD_S + 3 * ROUND_S) * 1000
    if case.startswith("torchrun"):
        assert gap_outside == 0 and got["a"]["idle"] > 0  # the restart's gap is the run's waste
    else:
        assert gap_outside > 0  # from the lapse to the requeue: nobody's


def test_a_register_dated_hours_after_its_gpus_samples_is_bounded_and_said_live_as_offline(prefix) -> None:
    """Rank 1's clock runs two hours ahead: live and offline its GPU's time starts with its
    samples, not two hours later nor never, and both say it (`register_after_samples`)."""
    a = TraceBuilder(n_gpus=2, per_host=2, job="a", seed=12)
    a.run("start")
    live(a, "compute", 100, 4, beats=True)
    a.run("end")
    a.stretch("idle", HOLD_S + 3 * ROUND_S)
    late = to_ms(a.t0 + 7200)
    a.events = [
        dataclasses.replace(e, ts_ms=late) if e.type == "register" and e.rank == 1 else e for e in a.events
    ]
    client = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    [reg] = [e for e in a.events if e.type == "register" and e.rank == 1]
    client.hset(keys.ranks_key(prefix, "a"), "1", json.dumps({"ts": reg.ts, **reg.fields}))  # read at once
    run = Run(client, prefix, a, [a], None, booking=BOOKING)
    run.run()
    got = run.ledger(["a"])
    assert run.agents[0].refusals.counts[("a", "register_after_samples")] >= 1
    diag = Diagnostics(stream=None)
    results, _ = book_trace(a.samples(), a.events, ReplayConfig(booking=BOOKING), diag)
    assert diag.counts["register_after_samples"] == 1
    # Replay starts it with its job; live, at the newest sample when the agent read it (a round
    # after the start here): the rule of docs/protocol.md's table, the GPU kept either way.
    assert int(results[0].pieces.dur_ms.sum()) == 2 * 100_000
    assert 2 * 100_000 - ROUND_S * 1000 <= sum(got["a"].values()) <= 2 * 100_000


def test_a_replaced_node_books_as_the_run_table_says(prefix) -> None:
    """Node 1 of a 2-node job dies; its ranks come back on a replacement node (node 2: other GPUs,
    other UUIDs) and the run resumes. A rank's GPU is the one its first registration named
    (accounting choice 15): the crashed node's GPUs keep ranks 2-3 to the end of the run (their
    crash tail, then idle), the replacement's GPUs are outside the job; said (`register_other_gpu`),
    live as offline, every GPU-millisecond once."""
    a = TraceBuilder(n_gpus=6, per_host=2, job="a", seed=13, register=False)
    for r in range(4):
        a.register_rank(r, r, 1000 + r, world_size=4)
    a.run("start")
    live(a, "compute", 60, 4, beats=True)
    a.stretch("idle", 10)  # node 1 is lost, the job stops
    a.new_processes(register=False)
    for r, slot in ((0, 0), (1, 1), (2, 4), (3, 5)):  # ranks 2 and 3 on node 2
        a.register_rank(r, slot, 2000 + r, world_size=4)
    a.run("resume", step=10)
    live(a, "compute", 60, 4, beats=True)
    a.run("end")
    a.stretch("idle", HOLD_S + 3 * ROUND_S)
    got, physical = booked(a, [a], prefix)
    assert sum(got["a"].values()) + got["_unassigned"] == physical
    assert got["a"] == offline(a, [a], BOOKING)["a"]
    diag = Diagnostics(stream=None)
    book_trace(a.samples(), a.events, ReplayConfig(booking=BOOKING), diag)
    assert diag.counts["register_other_gpu"] == 2
