"""Batched `steps` entries: one stream entry carrying a run of steps.

Every reader expands one into the step events the single entries would have been: exactly, in
order, once (de-duplicated on each step's own seq), through the reporter, a lost reply, a Redis
outage and the spool; a bad one is refused whole and counted, and the rest of the stream reads
on; a real agent books a job that posts batched steps as one that posts single steps.
"""

from __future__ import annotations

import base64
import json
import tempfile
import uuid
import zlib
from pathlib import Path

import numpy as np
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from costexporter.core.diagnostics import Diagnostics
from costexporter.core.events import MAX_BATCH_STEPS, MAX_STEP, EventError, parse_event, parse_events
from costexporter.core.timeutil import to_ms
from costexporter.core.tracefiles import read_events_jsonl
from costexporter.services.agent import Agent, AgentConfig
from costexporter.sources.playback import ReplaySource
from costexporter.sources.synth import TraceBuilder
from costexporter.store import protocol
from costexporter.store.reader import EventReader
from costexporter.tools.eventfile import export_lines
from costexporter.trainer.reporter import StepReporter
from costexporter.trainer.transport import send_entries

from .conftest import SHARED_URL
from .redis_server import RedisServer
from .test_agent import event_entry
from .test_incremental_agent import ledger_keys

T0_US = 1_753_570_000_000_000  # 2025-07-26, in microseconds


def single(job: str, rank: int, session: str, seq: int, step: int, us: int, tokens: int | None) -> dict:
    e = {"v": "1", "type": "step", "job": job, "ts": protocol.ts_text(us), "rank": str(rank)}
    e.update(session=session, seq=str(seq), step=str(step))
    if tokens is not None:
        e["tokens"] = str(tokens)
    return e


def batched(job: str, rank: int, session: str, seq: int, rows: list[tuple[int, int, int | None]]) -> dict:
    a = np.array([(s, us, -1 if k is None else k) for s, us, k in rows], dtype=np.int64)
    return protocol.steps_entry(job, rank, session, seq, a[:, 0], a[:, 1], a[:, 2])


rows_st = st.lists(
    st.tuples(
        st.integers(0, MAX_STEP),
        st.integers(T0_US - 10**12, T0_US + 10**12),  # times in any order, ~11 days either side
        st.none() | st.integers(0, 10**15),
    ),
    min_size=1,
    max_size=300,
)


@given(rows=rows_st, seq=st.integers(0, 1 << 40))
@settings(max_examples=200, deadline=None)
def test_a_batch_parses_to_exactly_the_events_of_its_single_entries(rows, seq):
    got = parse_events(batched("j", 3, "s1", seq, rows), job="j", now=2e9, strict_ids=True)
    want = [
        parse_event(single("j", 3, "s1", seq + i, s, us, k), job="j", now=2e9, strict_ids=True)
        for i, (s, us, k) in enumerate(rows)
    ]
    assert got == want  # type, job, ts (the same float), rank, session, seq and fields


def _good() -> dict:
    return batched("j", 0, "s", 10, [(5, T0_US, 7), (6, T0_US + 170, None), (7, T0_US + 340, 7)])


def _pack(values: list[int]) -> str:
    return base64.b64encode(zlib.compress(np.array(values, dtype="<i8").tobytes())).decode()


HOSTILE = {
    "bad base64": ({"b": "***"}, "bad_steps"),
    "not zlib": ({"b": base64.b64encode(b"x" * 72).decode()}, "bad_steps"),
    "too short": ({"b": _pack([5, 1, 1, 0, 170, 170, 7, -1])}, "bad_steps"),
    "too long": ({"b": _pack([5, 1, 1, 0, 170, 170, 7, -1, 7, 0])}, "bad_steps"),
    "zlib bomb": ({"b": base64.b64encode(zlib.compress(bytes(50_000_000), 9)).decode()}, "bad_steps"),
    "trailing bytes": ({"b": base64.b64encode(zlib.compress(bytes(72)) + b"zz").decode()}, "bad_steps"),
    "n huge": ({"n": str(10**12)}, "too_many_steps"),
    "n zero": ({"n": "0"}, "too_many_steps"),
    "n not a number": ({"n": "three"}, "bad_type"),
    "n missing": ({"n": ""}, "missing_field"),
    "b missing": ({"b": ""}, "missing_field"),
    "b too large": ({"b": "A" * 400_000}, "too_many_steps"),
    "unknown format": ({"fmt": "2"}, "bad_steps"),
    "nan time": ({"ts": "nan"}, "bad_type"),
    "time before 2000": (
        {"ts": "978307200.000000", "b": _pack([5, 1, 1, -(10**14), 0, 0, 7, -1, 7])},  # 2001 - 3 years
        "bad_timestamp",
    ),
    "time far ahead": ({"b": _pack([5, 1, 1, 10**14, 0, 0, 7, -1, 7])}, "bad_timestamp"),
    "int64 overflow": ({"b": _pack([5, 1, 1, -(2**63), -(2**63), 0, 7, -1, 7])}, "bad_steps"),
    "negative step": ({"b": _pack([5, -6, 1, 0, 170, 170, 7, -1, 7])}, "out_of_range"),
    "step past the bound": ({"b": _pack([MAX_STEP, 1, 1, 0, 170, 170, 7, -1, 7])}, "out_of_range"),
    "tokens below -1": ({"b": _pack([5, 1, 1, 0, 170, 170, 7, -2, 7])}, "out_of_range"),
    "seq overflow": ({"seq": str(1 << 62)}, "out_of_range"),
    "another job": ({"job": "k"}, "foreign_job"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_bad_batch_is_refused_whole_and_counted_and_the_stream_reads_on(case, prefix, shared):
    change, reason = HOSTILE[case]
    bad = {**_good(), **change}
    after = single("j", 0, "s", 13, 8, T0_US + 510, None)
    send_entries(shared, prefix, "j", [_good(), bad, after])
    reader = EventReader(shared, "j", prefix)
    evs = reader.read_all()
    assert [e.int_field("step") for e in evs] == [5, 6, 7, 8]
    assert reader.stats[f"rejected:{reason}"] == 1, reader.stats
    assert reader.stats["accepted"] == 4
    with pytest.raises(EventError):
        parse_events(bad, job="j", strict_ids=True)


@given(
    junk=st.dictionaries(
        st.sampled_from(["n", "b", "ts", "seq", "fmt", "rank", "session"]),
        st.text(max_size=40) | st.integers(-(2**70), 2**70).map(str) | st.sampled_from(["nan", "inf", "-1"]),
    ),
    raw=st.binary(max_size=200),
)
@settings(max_examples=300, deadline=None)
def test_any_mangled_batch_is_a_counted_rejection_never_a_crash(junk, raw):
    e = {**_good(), **junk}
    if "b" not in junk and raw:
        e["b"] = base64.b64encode(raw).decode()
    try:
        evs = parse_events(e, job="j", now=2e9, strict_ids=True)
    except EventError:
        return
    # What it accepts is within the protocol's bounds, numbered from its seq.
    assert 1 <= len(evs) <= MAX_BATCH_STEPS
    for i, ev in enumerate(evs):
        assert ev.type == "step" and 0 <= ev.int_field("step") <= MAX_STEP and ev.seq == evs[0].seq + i


def test_a_batch_resent_whole_or_cut_otherwise_gives_each_step_once(prefix, shared):
    rows = [(i, T0_US + 170 * i, None) for i in range(1, 101)]
    whole = batched("j", 1, "s", 0, rows)
    first = batched("j", 1, "s", 0, rows[:40])
    overlap = batched("j", 1, "s", 30, rows[30:])
    send_entries(shared, prefix, "j", [first, whole, overlap, whole])  # (a lost reply, a resend)
    reader = EventReader(shared, "j", prefix)
    evs = reader.read_all()
    assert [e.int_field("step") for e in evs] == list(range(1, 101))
    assert reader.stats["duplicate"] == 40 + 70 + 100 and reader.stats["accepted"] == 100


# ---- through the reporter ----------------------------------------------------------------------

# A trainer's calls: steps (step, seconds after t0, tokens?) and now and then a phase or a meta.
calls_st = st.lists(
    st.one_of(
        st.tuples(
            st.just("step"),
            st.integers(0, 10**9),
            st.integers(0, 10**9),  # microseconds after t0: any order (a clock stepping back)
            st.none() | st.integers(0, 10**6),
        ),
        st.tuples(
            st.just("phase"), st.sampled_from(["eval", "checkpoint"]), st.integers(0, 10**9), st.none()
        ),
    ),
    min_size=1,
    max_size=400,
)


def _post(rep: StepReporter, calls: list) -> list[tuple]:
    """Post the calls; what the reader must give back, as (type, ts_ms, step or name, tokens)."""
    want = []
    for kind, a, dt, tok in calls:
        ts = protocol.ts_text(T0_US + dt)
        if kind == "step":
            rep.step(a, tokens=tok, ts=float(ts))
            want.append(("step", to_ms(float(ts)), a, tok))
        else:
            rep.phase_begin(a, ts=float(ts))
            want.append(("phase", to_ms(float(ts)), a, None))
    return want


def _got(evs) -> list[tuple]:
    return [
        (e.type, e.ts_ms, e.get("step") if e.type == "step" else e.get("name"), e.get("tokens"))
        for e in evs
        if e.type in ("step", "phase")
    ]


@given(calls=calls_st, flush_every=st.integers(1, 400))
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_whatever_a_reporter_posts_arrives_as_the_same_events_in_order_once(
    calls, flush_every, prefix, shared
):
    job = f"r-{uuid.uuid4().hex[:10]}"
    rep = StepReporter(job, SHARED_URL, prefix=prefix, rank=0, spool_dir=tempfile.mkdtemp(), heartbeat_s=3600)
    want: list[tuple] = []
    for i in range(0, len(calls), flush_every):  # sent in rounds of any size
        want += _post(rep, calls[i : i + flush_every])
        assert rep.flush(10)
    rep.close(end_run=False)
    reader = EventReader(shared, job, prefix)
    assert _got(reader.read_all()) == want
    assert reader.stats["duplicate"] == 0 and not any(k.startswith("rejected") for k in reader.stats)
    assert rep.stats["sent"] == len(calls) + 2  # and register, run start: counted by event, not entry


@pytest.fixture(scope="module")
def private_redis():
    with tempfile.TemporaryDirectory() as d:
        srv = RedisServer(Path(d)).start()
        try:
            yield srv
        finally:
            srv.stop()


@given(
    calls=calls_st,
    down_at=st.integers(0, 400),
    up_at=st.integers(0, 400),
    buffer=st.sampled_from([600, 100_000]),  # 600: more than 300 queued spill to the spool
)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_steps_posted_across_an_outage_and_the_spool_arrive_once_in_order(
    calls, down_at, up_at, buffer, private_redis, tmp_path_factory
):
    """Redis goes away after `down_at` calls (a small buffer spills to the spool); it comes back
    after `up_at` more, or only after the reporter exited (its spool sent by the next one)."""
    spool = tmp_path_factory.mktemp("spool")
    client = redis.Redis.from_url(private_redis.url, decode_responses=True)
    job = f"o-{uuid.uuid4().hex[:10]}"
    kw = dict(prefix="p", rank=0, spool_dir=spool, heartbeat_s=3600, buffer_size=buffer, exit_timeout_s=0.5)
    rep = StepReporter(job, private_redis.url, socket_timeout_s=0.3, **kw)
    down_at = min(down_at, len(calls))
    want = _post(rep, calls[:down_at])
    rep.flush(10)
    private_redis.stop()
    came_back = down_at + up_at < len(calls)
    try:
        want += _post(rep, calls[down_at : down_at + up_at if came_back else len(calls)])
        rep.flush(0.5)  # the sender meets the dead server (and spills when the buffer is small)
        if came_back:
            private_redis.start()
            want += _post(rep, calls[down_at + up_at :])
        rep.close(end_run=False)
    finally:
        if not came_back:
            private_redis.start()
    assert rep.stats["lost"] == 0 and rep.stats["overflow"] == 0
    # What it could not send before its exit, its spool, the next reporter on this host sends.
    nxt = StepReporter(job, private_redis.url, **kw)
    assert nxt.flush(20)
    nxt.close(end_run=False)
    reader = EventReader(client, job, "p")
    assert _got(reader.read_all()) == want
    assert not any(k.startswith("rejected") for k in reader.stats)


# ---- the readers beside the agent: export and import ---------------------------------------------


def test_export_writes_a_batch_as_its_steps_and_a_file_with_a_batch_line_reads_as_them(
    prefix, shared, tmp_path
):
    rows = [(i, T0_US + 170 * i, 4096) for i in range(1, 51)]
    send_entries(shared, prefix, "j", [single("j", 0, "s", 0, 0, T0_US, None), batched("j", 0, "s", 1, rows)])
    lines, stats = export_lines(shared, "j", prefix)
    out = [json.loads(x) for x in lines]
    assert [d["type"] for d in out] == ["step"] * 51 and stats["accepted"] == 51
    f = tmp_path / "events.jsonl"
    f.write_text(
        json.dumps(batched("j", 0, "s", 1, rows)) + "\n" + json.dumps({**_good(), "fmt": "9"}) + "\n"
    )
    diag = Diagnostics()
    evs = read_events_jsonl(f, diag)
    assert [e.int_field("step") for e in evs] == list(range(1, 51))
    assert [e.ts_ms for e in evs] == [to_ms(float(d["ts"])) for d in out[1:]]
    assert diag.counts["bad_steps"] == 1


# ---- a real agent -------------------------------------------------------------------------------------


def _trace() -> TraceBuilder:
    b = TraceBuilder(n_gpus=2, per_host=2, job="batched", seed=5)
    b.run("start")
    b.stretch("compute", 150, step_s=0.5, tokens=64)  # 300 steps
    b.phase("checkpoint", "begin")
    b.stretch("checkpoint", 30)
    b.phase("checkpoint", "end", step=b.step)
    b.stretch("compute", 100, step_s=0.5, tokens=64)
    b.stretch("idle", 90)  # a stall
    b.run("resume", step=200)
    b.stretch("compute", 120, step_s=0.5, tokens=64)
    b.run("end")
    b.stretch("idle", 20)
    return b


def _pack_round(entries: list[dict]) -> list[dict]:
    """Each run of one session's steps with consecutive seqs as one batched entry."""
    out: list[dict] = []
    run: list[dict] = []

    def close() -> None:
        if len(run) == 1:
            out.append(run[0])
        elif run:
            r = run[0]
            rows = [
                (int(e["step"]), round(float(e["ts"]) * 1000) * 1000, int(e.get("tokens", -1))) for e in run
            ]
            out.append(batched(r["job"], int(r["rank"]), r["session"], int(r["seq"]), rows))
        run.clear()

    for e in entries:
        if e["type"] == "step" and (
            not run
            or (
                (e["rank"], e["session"]) == (run[-1]["rank"], run[-1]["session"])
                and int(e["seq"]) == int(run[-1]["seq"]) + 1
            )
        ):
            run.append(e)
            continue
        close()
        if e["type"] == "step":
            run.append(e)
        else:
            out.append(e)
    close()
    return out


def _book(prefix: str, b: TraceBuilder, pack: bool) -> int:
    """Drive a real agent round by round; the trainer's events are posted as they happen, single
    or batched. Returns how many stream entries carried them."""
    client = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    by_rank: dict[int, list] = {}
    for e in sorted(b.events, key=lambda e: e.ts):
        by_rank.setdefault(e.rank, []).append(e)
    t0 = min(e.ts for e in b.events)
    now = [0.0]
    started = [False]

    def clock() -> float:
        if not started[0]:
            started[0] = True
            return 0.0
        return now[0]

    agent = Agent(
        ReplaySource(b.samples(), speed=1.0, clock=clock),
        AgentConfig(prefix=prefix, agent_id="a", job_refresh_s=0, fold_lag_s=20.0, context_s=120.0),
    )
    sent = 0
    while now[0] < 700:
        now[0] += 7
        for evs in by_rank.values():
            entries = []
            while evs and evs[0].ts <= t0 + now[0] + 3:
                entries.append(event_entry(evs.pop(0)))
            if entries:
                entries = _pack_round(entries) if pack else entries
                send_entries(client, prefix, b.job, entries)
                sent += len(entries)
        for r in agent.source.read():
            agent.sampler._buf.append(r)
        agent.tick()
    agent._final = True
    agent.tick()
    return sent


def test_a_real_agent_books_a_job_posting_batched_steps_as_one_posting_single_steps(prefix):
    b = _trace()
    singles = _book(prefix + "-single", b, pack=False)
    batches = _book(prefix, b, pack=True)
    client = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    try:
        got, want = ledger_keys(client, prefix), ledger_keys(client, prefix + "-single")
        assert got == want
        assert len(got) > 5
        assert batches * 5 < singles  # the batched job really posted batches
    finally:
        keys = list(client.scan_iter(f"{prefix}-single:*"))
        if keys:
            client.delete(*keys)
