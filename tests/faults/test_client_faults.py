"""The trainer's reporter under faults (Redis down, slow, refusing its ACL): real Redis servers, real trainer
processes, real ACLs; each test failed on the reporter before the fix."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import redis
from hypothesis import example, given, settings
from hypothesis import strategies as st

from costexporter.core.events import (
    MAX_GPU_INDEX,
    MAX_RANK,
    MAX_STEP,
    MAX_TOKENS,
    MAX_WORLD_SIZE,
    EventError,
    parse_event,
)
from costexporter.store import keys
from costexporter.store.reader import EventReader
from costexporter.trainer.reporter import StepReporter

from ..conftest import SHARED_URL, drop_prefix
from ..redis_server import RedisServer, free_port

HELPERS = Path(__file__).resolve().parent.parent / "helpers"


def runs(client, job: str, prefix: str) -> list[str | None]:
    return [e.get("state") for e in EventReader(client, job, prefix=prefix).read_all() if e.type == "run"]


# ---- case 1: `run end` only on a clean exit ---------------------------------------------------


def _trainer(how: str, prefix: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            str(HELPERS / "trainer_exit.py"),
            f"exit-{how}",
            prefix,
            SHARED_URL,
            str(tmp_path),
            how,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "RANK": "0"},
    )


@pytest.mark.parametrize("how", ["raise", "exit1", "exitmsg", "thread", "finally", "interrupt"])
def test_a_crashing_trainer_posts_no_run_end(how, shared, prefix, tmp_path):
    out = _trainer(how, prefix, tmp_path)
    if how != "thread":  # an uncaught exception in a thread does not change the exit code
        assert out.returncode != 0, out.stderr
    # no `run end`; a crash record (the process could still write) names the failing rank
    assert runs(shared, f"exit-{how}", prefix) == ["start", "crash"], out.stderr
    steps = [e for e in EventReader(shared, f"exit-{how}", prefix=prefix).read_all() if e.type == "step"]
    assert len(steps) == 5  # the events before the crash arrived


@pytest.mark.parametrize("how", ["clean", "exit0", "with", "caught_exit1"])
def test_a_clean_exit_posts_run_end(how, shared, prefix, tmp_path):
    out = _trainer(how, prefix, tmp_path)
    assert out.returncode == 0, out.stderr
    assert runs(shared, f"exit-{how}", prefix) == ["start", "end"], out.stderr


def test_a_rank_whose_peer_is_killed_posts_no_run_end(shared, prefix, tmp_path):
    pytest.importorskip("torch", reason="torch is an optional extra")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(HELPERS / "gloo_peer.py"), "peer-kill", prefix, SHARED_URL, str(tmp_path)],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    try:
        assert procs[0].stdout.readline().strip() == "stepping"
        procs[1].send_signal(signal.SIGKILL)
        _, err = procs[0].communicate(timeout=90)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[0].returncode not in (0, None), err  # the survivor raised from the all-reduce
    events = EventReader(shared, "peer-kill", prefix=prefix).read_all()
    survivor = [e.get("state") for e in events if e.type == "run" and e.rank == 0]
    assert survivor == ["start", "crash"], err[-2000:]  # its all-reduce raised: it says so
    [record] = [e for e in events if e.type == "run" and e.get("state") == "crash"]
    assert record.rank == 0 and record.get("error"), record
    assert sum(e.type == "step" and e.rank == 0 for e in events) >= 20


# ---- case 2: values are checked at the call; a refused batch never wedges the queue ----------


def test_numpy_and_decimal_values_are_converted_and_arrive(shared, prefix, tmp_path):
    rep = StepReporter(
        "numbers", SHARED_URL, prefix=prefix, rank=np.int64(0), spool_dir=tmp_path, heartbeat_s=3600
    )
    now = time.time()
    rep.step(np.int64(1), tokens=np.int64(4096), ts=np.float64(now))
    rep.step(Decimal("2"), tokens=Decimal("4096"))
    rep.step(np.uint32(3), tokens=np.float64(4096.0), ts=Decimal(str(now + 1)))
    rep.step(Fraction(4, 1))
    rep.meta(budget=Decimal("5000.50"), price_per_gpu_hour=np.float32(3.5), team="llm", seed=np.int64(7))
    with rep.phase("checkpoint", step=np.int32(4)):
        pass
    rep.resume(np.int64(2))
    rep.preflight(np.bool_(True), checks={"tokens": np.int64(10), "ratio": Decimal("0.5")})
    assert rep.flush(timeout=10), rep.stats
    rep.close()
    reader = EventReader(shared, "numbers", prefix=prefix)
    events = reader.read_all()
    assert [int(e.get("step")) for e in events if e.type == "step"] == [1, 2, 3, 4]
    assert [e.get("tokens") for e in events if e.type == "step"] == [4096, 4096, 4096, None]
    assert abs(next(e for e in events if e.type == "step").ts - now) < 1e-3
    meta = next(e for e in events if e.type == "meta")
    assert (meta.get("budget"), meta.get("price_per_gpu_hour"), meta.get("team")) == (5000.5, 3.5, "llm")
    assert [e.type for e in events][:2] == ["register", "run"]
    assert json.loads(next(e for e in events if e.type == "preflight").get("checks")) == {
        "ratio": 0.5,
        "tokens": 10,
    }
    assert not [k for k in reader.stats if k.startswith("rejected")], reader.stats
    assert shared.hget(keys.meta_key(prefix, "numbers"), "budget") == "5000.5"


def test_a_meta_the_reader_would_refuse_is_refused_at_the_call(shared, prefix, tmp_path):
    """A negative or non-numeric threshold used to pass the call, and then the reader refused the
    whole meta event (team and price with it). Every number and text field the reader checks
    (events.META_NUMBERS, META_TEXT) is checked at the call the same way."""
    rep = StepReporter("meta-bounds", SHARED_URL, prefix=prefix, rank=0, spool_dir=tmp_path, heartbeat_s=3600)
    for bad, exc in (
        ({"stall_k": -1}, ValueError),
        ({"heartbeat_timeout_s": float("inf")}, ValueError),
        ({"stall_floor_s": "slow"}, TypeError),
        ({"namespace": 3}, TypeError),
    ):
        with pytest.raises(exc):
            rep.meta(team="llm", **bad)
    rep.meta(team="llm", stall_floor_s=np.float64(1800), stall_k=Decimal("3"), namespace="ml")
    assert rep.flush(timeout=10), rep.stats
    rep.close()
    reader = EventReader(shared, "meta-bounds", prefix=prefix)
    metas = [e for e in reader.read_all() if e.type == "meta"]
    assert [(m.get("stall_floor_s"), m.get("stall_k"), m.get("namespace")) for m in metas] == [
        (1800.0, 3.0, "ml")
    ]
    assert not [k for k in reader.stats if k.startswith("rejected")], reader.stats


HOSTILE = st.one_of(
    st.text(max_size=5),
    st.binary(max_size=3),
    st.booleans(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.decimals(allow_nan=True, allow_infinity=True),
    st.fractions(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
    st.builds(object),
    st.integers(min_value=-(2**63), max_value=2**63 - 1).map(np.int64),
    st.floats(allow_nan=True, allow_infinity=True).map(np.float64),
    st.booleans().map(np.bool_),
)


def _storable(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def test_text_redis_cannot_store_is_refused_at_the_call_and_good_events_still_arrive(
    shared, prefix, tmp_path
):
    """A lone surrogate (a path or an environment value decoded with `surrogateescape`) used to
    pass the call and then fail its whole batch in the sender: the register, the steps and the
    meta of that batch were lost, with a traceback. Every text the reporter posts is checked at
    the call: meta values and field names, nested meta values, phase names, preflight checks."""
    rep = StepReporter("texts", SHARED_URL, prefix=prefix, rank=0, spool_dir=tmp_path, heartbeat_s=3600)
    sent: list[str] = []

    @settings(max_examples=200)
    @example(t="\udcff")
    @example(t="caf\u00e9 \U0001f600")
    @given(t=st.text(max_size=6) | st.sampled_from(["\ud800", "a\udfffb", "\udc80\udc81"]))
    def call(t):
        calls = [
            lambda: rep.meta(team=t),
            lambda: rep.meta(notes={"k": [t]}),
            lambda: rep.meta(**{f"x{t}": 1}),
            lambda: rep.phase_begin(f"p{t}"),
            lambda: rep.preflight(True, {"check": t}),
        ]
        for c in calls:
            if _storable(t):
                c()
            else:
                with pytest.raises(ValueError, match="lone surrogate"):
                    c()
        if _storable(t):
            sent.append(t)
        rep.step(len(sent))

    call()
    assert rep.flush(timeout=20), rep.stats
    rep.close()
    assert rep.stats["rejected"] == 0, rep.stats
    reader = EventReader(shared, "texts", prefix=prefix)
    events = reader.read_all()
    # An empty team is no team (the reader reads '' as absent): the rest of its meta stands.
    assert [e.get("team") for e in events if e.type == "meta" and "team" in e.fields] == [
        t for t in sent if t
    ]
    assert not [k for k in reader.stats if k.startswith("rejected")], reader.stats
    assert sum(e.type == "step" for e in events) > 0 and any(e.type == "register" for e in events)
    with pytest.raises(ValueError, match="host"):
        StepReporter("texts", SHARED_URL, prefix=prefix, rank=1, spool_dir=tmp_path, host="h\udcff")


def _whole(x, hi: int) -> int | None:
    """What a correct reporter makes of x: the whole number in [0, hi], or None (refuse it).
    `hi` is the reader's bound for the field (steps MAX_STEP, tokens MAX_TOKENS): the reporter
    accepts exactly what the reader accepts."""
    if isinstance(x, (bool, np.bool_, str, bytes, list, dict)) or type(x) is object:
        return None
    try:
        f = Fraction(x) if not isinstance(x, (float, np.floating)) else Fraction(float(x))
    except (ValueError, OverflowError, TypeError):
        return None
    if f.denominator != 1 or not 0 <= f.numerator <= hi:
        return None
    return f.numerator


def test_hostile_step_values_are_refused_at_the_call_and_good_ones_still_arrive(shared, prefix, tmp_path):
    rep = StepReporter("hostile", SHARED_URL, prefix=prefix, rank=0, spool_dir=tmp_path, heartbeat_s=3600)
    expected: list[tuple[int, int | None]] = []

    @settings(max_examples=300)
    @example(step=0.0, tokens=MAX_STEP + 1)  # tokens between the step and token bounds: accepted
    @example(step=MAX_STEP, tokens=MAX_TOKENS)
    @example(step=MAX_STEP + 1, tokens=None)
    @example(step=0, tokens=MAX_TOKENS + 1)
    @given(step=HOSTILE, tokens=st.one_of(st.none(), HOSTILE))
    def call(step, tokens):
        want, want_tokens = _whole(step, MAX_STEP), (None if tokens is None else _whole(tokens, MAX_TOKENS))
        if want is not None and (tokens is None or want_tokens is not None):
            rep.step(step, tokens=tokens)
            expected.append((want, want_tokens))
        else:
            with pytest.raises((TypeError, ValueError)):
                rep.step(step, tokens=tokens)

    call()
    rep.step(123)  # and the reporter still works
    expected.append((123, None))
    assert rep.flush(timeout=20), rep.stats
    rep.close()
    reader = EventReader(shared, "hostile", prefix=prefix)
    events = reader.read_all()
    assert [(int(e.get("step")), e.get("tokens")) for e in events if e.type == "step"] == expected
    assert not [k for k in reader.stats if k.startswith("rejected")], reader.stats
    assert rep.stats["rejected"] == 0 and rep.stats["sent"] == len(expected) + 3


def _bound(lo: int, hi: int):
    """Whole numbers around a bound: both edges and a step past each."""
    return st.one_of(st.sampled_from([lo - 1, lo, hi, hi + 1]), st.integers(lo - 2, hi + 2))


def test_a_register_the_reader_would_refuse_is_refused_at_the_constructor(shared, prefix, tmp_path):
    """rank, local_rank, world_size and gpu_index outside the reader's bounds used to be accepted,
    and then the reader refused every event of that rank. The constructor accepts exactly what
    the reader accepts: a register it lets through arrives and is valid, one it refuses the
    reader refuses too."""
    n = [0]

    @settings(max_examples=40, deadline=None)
    @example(rank=MAX_RANK, local=MAX_GPU_INDEX, world=1, gpu=0)
    @example(rank=MAX_RANK + 1, local=0, world=1, gpu=0)
    @example(rank=0, local=0, world=0, gpu=0)
    @example(rank=0, local=0, world=MAX_WORLD_SIZE + 1, gpu=0)
    @example(rank=0, local=0, world=1, gpu=MAX_GPU_INDEX + 1)
    @example(rank=0, local=MAX_GPU_INDEX + 1, world=1, gpu=None)
    @given(
        rank=_bound(0, MAX_RANK),
        local=_bound(0, MAX_GPU_INDEX),
        world=_bound(1, MAX_WORLD_SIZE),
        gpu=st.none() | _bound(0, MAX_GPU_INDEX),
    )
    def make(rank, local, world, gpu):
        n[0] += 1
        job = f"bounds{n[0]}"
        entry = {"v": "1", "type": "register", "job": job, "ts": str(time.time()), "rank": str(rank)}
        entry |= {"session": "s", "seq": "0", "host": "h", "local_rank": str(local), "world_size": str(world)}
        entry["gpu"] = str(local if gpu is None else gpu)
        try:
            parse_event(entry, job=job, strict_ids=True)
            reader_ok = True
        except EventError:
            reader_ok = False
        kw = dict(rank=rank, local_rank=local, world_size=world, gpu_index=gpu, gpu_uuid="GPU-x")
        if not reader_ok:
            with pytest.raises(ValueError):
                StepReporter(job, SHARED_URL, prefix=prefix, spool_dir=tmp_path, heartbeat_s=3600, **kw)
            return
        rep = StepReporter(job, SHARED_URL, prefix=prefix, spool_dir=tmp_path, heartbeat_s=3600, **kw)
        assert rep.flush(timeout=10), rep.stats
        rep.close()
        reader = EventReader(shared, job, prefix=prefix)
        events = reader.read_all()
        assert [e.type for e in events] == ["register", "run", "run"], reader.stats
        assert (events[0].rank, events[0].get("world_size")) == (rank, world)

    make()


def test_a_batch_the_server_refuses_is_dropped_counted_and_later_batches_go_through(tmp_path, caplog):
    """A trainer whose ACL loses XADD for a while (a real refusal, NOPERM), and a ranks hash of the
    wrong type (WRONGTYPE on the register's HSET): neither wedges the queue."""
    server = RedisServer(tmp_path / "redis").start()
    try:
        admin = server.client()
        acl = [
            f"~{keys.job_key('costexporter', keys.TRAINER, 'refused', '*')}",
            f"~{keys.jobs_key('costexporter')}",
            "-@all",
            "+hset",
            "+zadd",
            "+ping",
            "+hello",
        ]
        admin.execute_command("ACL", "SETUSER", "t", "on", ">pw", *acl, "+xadd")
        admin.set(keys.ranks_key("costexporter", "refused"), "not a hash")
        url = f"redis://t:pw@127.0.0.1:{server.port}/0"
        rep = StepReporter("refused", url, rank=0, spool_dir=tmp_path / "spool", heartbeat_s=3600)
        with caplog.at_level(logging.ERROR, logger="costexporter.client"):
            for s in range(1, 11):
                rep.step(s)
            assert rep.flush(timeout=10), rep.stats
            admin.execute_command("ACL", "SETUSER", "t", "-xadd")
            for s in range(11, 21):
                rep.step(s)
            assert rep.flush(timeout=10), rep.stats  # refused: dropped, not retried forever
            admin.execute_command("ACL", "SETUSER", "t", "+xadd")
            for s in range(21, 31):
                rep.step(s)
            assert rep.flush(timeout=10), rep.stats
            rep.close()
        events = EventReader(admin, "refused").read_all()
    finally:
        server.stop()
    assert [int(e.get("step")) for e in events if e.type == "step"] == [*range(1, 11), *range(21, 31)]
    assert [e.type for e in events][:2] == ["register", "run"]  # the register arrived in the stream
    assert rep.stats["rejected"] == 10 and rep.stats["side_rejected"] == 1
    assert rep.stats["sent"] == 2 + 20 + 1 and rep.stats["spooled"] == 0
    refusals = [r.message for r in caplog.records if "refused" in r.message]
    assert len(refusals) == 2, refusals  # once for the XADDs, once for the HSET
    assert not list((tmp_path / "spool").glob("*.jsonl"))


def test_a_full_redis_refuses_for_now_and_nothing_is_dropped(tmp_path):
    """OOM (maxmemory reached, noeviction) passes: those events wait and go out afterwards."""
    server = RedisServer(tmp_path / "redis").start()
    try:
        admin = server.client()
        rep = StepReporter("full", server.url, rank=0, spool_dir=tmp_path / "spool", heartbeat_s=3600)
        assert rep.flush(timeout=10)
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", "1")
        for s in range(1, 201):
            rep.step(s)
        assert not rep.flush(timeout=1.0)  # refused for now
        assert rep.stats["send_errors"] > 0 and rep.stats["rejected"] == 0
        admin.config_set("maxmemory", "0")
        assert rep.flush(timeout=15), rep.stats
        rep.close()
        events = EventReader(admin, "full").read_all()
    finally:
        server.stop()
    # Every event once. Not always in order: Redis can lift the limit in the middle of one batch
    # (the admin's CONFIG SET runs between its XADDs), and the refused head goes out after the
    # accepted tail; readers order events by their timestamps, not by stream position.
    assert sorted(int(e.get("step")) for e in events if e.type == "step") == list(range(1, 201))
    assert rep.stats["rejected"] == 0 and rep.stats["sent"] == 203


# ---- case 3: the spool counts what it holds, holds what it counts, and goes only where it belongs ---


def per_event(d: dict) -> list[dict]:
    """An entry as one dict per event it carries (a batched `steps` entry: one per step, with
    its own seq)."""
    if d.get("type") != "steps":
        return [d]
    return [{**d, "type": "step", "seq": str(int(d["seq"]) + i)} for i in range(int(d["n"]))]


def spool_lines(spool_dir: Path) -> list[dict]:
    """The spooled events, one dict each."""
    out = []
    for p in spool_dir.glob("*.jsonl"):
        for line in p.read_text().splitlines():
            d = json.loads(line)
            if "costexporter_spool" not in d:  # the header line: destination and prefix
                out += per_event(d)
    return out


def test_close_with_redis_down_and_a_spool_file_loses_nothing(tmp_path):
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    spool_dir = tmp_path / "spool"
    rep = StepReporter("down60k", url, rank=0, spool_dir=spool_dir, heartbeat_s=3600, socket_timeout_s=0.5)
    for s in range(1, 60_001):
        rep.step(s)
    deadline = time.monotonic() + 20
    while not rep.stats["spooled"] and time.monotonic() < deadline:  # the sender spilled half to disk
        time.sleep(0.05)
    assert rep.stats["spooled"] > 0
    rep.close()
    on_disk = spool_lines(spool_dir)
    assert len(on_disk) == rep.stats["spooled"] == 60_003, rep.stats
    assert sorted(int(d["seq"]) for d in on_disk) == list(range(60_003))
    assert rep.stats["lost"] == 0 and rep.stats["overflow"] == 0

    server = RedisServer(tmp_path / "redis", port=port).start()
    try:
        nxt = StepReporter("down60k", url, rank=0, spool_dir=spool_dir, heartbeat_s=3600)
        assert nxt.flush(timeout=30)
        nxt.close()
        events = EventReader(server.client(), "down60k").read_all()
    finally:
        server.stop()
    assert nxt.stats["drained"] == 60_003
    assert [int(e.get("step")) for e in events if e.type == "step" and e.session == rep.session] == list(
        range(1, 60_001)
    )
    assert not list(spool_dir.glob("*.jsonl"))


def test_a_spool_is_sent_only_to_the_redis_and_prefix_it_was_written_for(tmp_path, caplog, prefix):
    pa, pb = prefix, f"{prefix}-b"  # the shared Redis's keys under the fixture's prefix: removed after
    server = RedisServer(tmp_path / "redis").start()
    spool_dir = tmp_path / "spool"
    url = f"redis://:s3cret@127.0.0.1:{server.port}/0"
    try:
        server.client().config_set("requirepass", "s3cret")
        server.stop()  # down: the first reporter spools
        first = StepReporter("dest", url, prefix=pa, rank=0, spool_dir=spool_dir, heartbeat_s=3600)
        first.step(1)
        first.close(timeout=0.3)
        text = next(spool_dir.glob("*.jsonl")).read_text()
        head = json.loads(text.splitlines()[0])
        assert head["destination"] == f"redis://127.0.0.1:{server.port}/0" and head["prefix"] == pa
        assert "s3cret" not in text
        # Another Redis with the same prefix (the shared one): it leaves the file alone, and says so once.
        with caplog.at_level(logging.WARNING, logger="costexporter.client"):
            for _ in range(2):
                other = StepReporter(
                    "dest", SHARED_URL, prefix=pa, rank=0, spool_dir=spool_dir, heartbeat_s=3600
                )
                assert other.flush(timeout=10)
                other.close()
        assert sum("leaving spool" in r.message for r in caplog.records) == 1
        assert len(spool_lines(spool_dir)) == 4
        assert redis.Redis.from_url(SHARED_URL).xlen(keys.stream_key(pa, "dest")) == 2 * 3
        server.start()
        server.client().config_set("requirepass", "s3cret")
        # The same server under another prefix leaves it too; the right one sends it.
        wrong = StepReporter("dest", url, prefix=pb, rank=0, spool_dir=spool_dir, heartbeat_s=3600)
        assert wrong.flush(timeout=10)
        wrong.close()
        assert len(spool_lines(spool_dir)) == 4
        right = StepReporter("dest", url, prefix=pa, rank=0, spool_dir=spool_dir, heartbeat_s=3600)
        assert right.flush(timeout=10)
        right.close()
        admin = redis.Redis.from_url(url, decode_responses=True)
        sessions = {e.session for e in EventReader(admin, "dest", prefix=pa).read_all()}
    finally:
        server.stop()
    assert first.session in sessions and right.stats["drained"] == 4
    assert not list(spool_dir.glob("*.jsonl"))


def test_a_live_reporters_spool_is_not_taken_from_under_it(tmp_path):
    """Another reporter starting on the host (same Redis, same prefix) while the first still
    writes its spool leaves that file to its writer: every event arrives once, none twice."""
    server = RedisServer(tmp_path / "redis")
    url, spool_dir = server.url, tmp_path / "spool"
    kw = dict(rank=0, spool_dir=spool_dir, heartbeat_s=3600, socket_timeout_s=0.3, buffer_size=100)
    first = StepReporter("live", url, **kw)
    for s in range(1, 81):
        first.step(s)
    deadline = time.monotonic() + 10
    while not first.stats["spooled"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert first.stats["spooled"] > 0
    server.start()
    try:
        second = StepReporter("live", url, **kw)
        assert second.flush(timeout=10)
        assert second.stats["drained"] == 0  # the file is still first's
        for s in range(81, 121):
            first.step(s)
        assert first.flush(timeout=10), first.stats
        first.close()
        second.close()
        client = server.client()
        events = EventReader(client, "live").read_all()
        raw = sum(
            len(per_event(f)) for _id, f in client.xrange(keys.stream_key("costexporter", "live"))
        )  # events in the stream, duplicates included
    finally:
        server.stop()
    assert [int(e.get("step")) for e in events if e.type == "step"] == list(range(1, 121))
    assert raw == len(events)  # nothing was sent twice
    assert first.stats["unspooled"] == first.stats["spooled"] and not list(spool_dir.glob("*.jsonl"))


def test_close_while_the_sender_is_stuck_spools_to_a_late_file_a_later_reporter_sends(
    shared, prefix, tmp_path
):
    """close() cannot take the sender's lock (a send stuck past its socket timeout): the queue goes
    to a separate `.late` spool, out of the stuck sender's file, and the next reporter sends it."""
    kw = dict(rank=0, spool_dir=tmp_path, heartbeat_s=3600, socket_timeout_s=0.1)
    first = StepReporter("stuck", SHARED_URL, prefix=prefix, flush_interval_s=3600, **kw)
    first._sender.io_lock.acquire()  # the sender is "stuck" in a send
    try:
        for s in range(1, 4):
            first.step(s)
        t = time.monotonic()
        first.close(timeout=0.1)
        closing_s = time.monotonic() - t
    finally:
        first._sender.io_lock.release()
    assert closing_s < 3.0  # the flush timeout plus the bounded wait for the lock (0.1 + 0.7 s)
    late = list(tmp_path.glob("*.late.jsonl"))
    assert len(late) == 1 and first.stats["spooled"] == 6 and not first.stats["lost"], first.stats
    second = StepReporter("stuck", SHARED_URL, prefix=prefix, **kw)
    assert second.flush(timeout=10), second.stats
    second.close()
    events = [e for e in EventReader(shared, "stuck", prefix=prefix).read_all() if e.session == first.session]
    assert [e.type for e in events] == ["register", "run", "step", "step", "step", "run"]
    assert second.stats["drained"] == 6 and not late[0].exists()


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("steps"), st.integers(0, 400)),
        st.tuples(st.just("stop")),
        st.tuples(st.just("start")),
        st.tuples(st.just("restart_trainer")),
        st.tuples(st.just("flush")),
    ),
    max_size=7,
)


def test_every_event_arrives_once_or_waits_on_disk_through_any_outage_schedule(tmp_path):
    """Hypothesis: random sequences of steps, Redis stops and starts, trainer restarts (close and a
    new reporter) and flushes. After each: every posted event is in Redis (de-duplicated) or in a
    spool file, nothing else is in Redis, and each reporter's stats say exactly where its events are."""
    server = RedisServer(tmp_path / "redis").start()
    url = server.url
    case = [0]

    @settings(max_examples=int(os.environ.get("CLIENT_FAULT_EXAMPLES", "15")))
    @example(ops=[("stop",), ("restart_trainer",), ("start",)])  # the second reporter drains the first
    @example(ops=[("stop",), ("steps", 5), ("restart_trainer",), ("steps", 5), ("restart_trainer",)])
    @given(ops=OPS)
    def schedule(ops):
        case[0] += 1
        job, spool_dir = f"sched{case[0]}", tmp_path / f"spool{case[0]}"
        if server.proc is None:
            server.start()
        kw = dict(rank=0, spool_dir=spool_dir, heartbeat_s=3600, socket_timeout_s=0.3, exit_timeout_s=0.5)
        kw |= dict(buffer_size=400, flush_interval_s=0.01)
        reporters = [StepReporter(job, url, **kw)]
        steps = [0]  # steps posted through each reporter
        step = 0

        def close_current() -> None:
            rep = reporters[-1]
            rep.close()
            mine = [d for d in spool_lines(spool_dir) if d["session"] == rep.session]
            assert len(mine) == rep.stats["spooled"] - rep.stats["unspooled"], rep.stats

        for op in ops:
            if op[0] == "steps":
                for _ in range(op[1]):
                    step += 1
                    steps[-1] += 1
                    reporters[-1].step(step)
                    if step % 50 == 0:
                        time.sleep(0.005)
            elif op[0] == "stop" and server.proc is not None:
                server.stop()
            elif op[0] == "start" and server.proc is None:
                server.start()
            elif op[0] == "restart_trainer":
                close_current()
                reporters.append(StepReporter(job, url, **kw))
                steps.append(0)
            elif op[0] == "flush":
                assert reporters[-1].flush(timeout=10) or server.proc is None
        close_current()

        # Where every reporter's events are, before a last one sends the spool.
        stream = EventReader(server.client(), job).read_all() if server.proc is not None else None
        on_disk = spool_lines(spool_dir)  # no reporter is alive now: nothing moves
        disk = {(d["session"], int(d["seq"])) for d in on_disk}
        assert len(disk) == len(on_disk)  # no event is on disk twice
        if server.proc is None:
            server.start()
            stream = EventReader(server.client(), job).read_all()
        arrived = {(e.session, e.seq) for e in stream}
        for rep, n in zip(reporters, steps, strict=True):
            # register, run start, the steps the buffer took, run end: numbered 0, 1, 2...
            posted = {(rep.session, s) for s in range(3 + n - rep.stats["overflow"])}
            s = rep.stats
            assert s["lost"] == 0 and s["rejected"] == 0, s
            assert len(posted) == s["sent"] + s["spooled"] - s["unspooled"], s
            mine_arrived = {x for x in arrived if x[0] == rep.session}
            assert mine_arrived <= posted
            assert posted <= mine_arrived | disk, (posted - mine_arrived - disk, s)

        # What waits on disk is what the reporters spooled, less what each sent of its own
        # (unspooled) and what a later one sent for it (drained: a reporter that starts while a
        # closed one's spool waits sends it, so it is not always the last one below).
        assert all(r.stats["drain_rejected"] == 0 for r in reporters)
        waiting = sum(r.stats["spooled"] - r.stats["unspooled"] - r.stats["drained"] for r in reporters)
        assert len(on_disk) == waiting, [dict(r.stats) for r in reporters]

        # A last reporter sends what waits on disk: then everything is in Redis, once.
        last = StepReporter(job, url, **kw)
        assert last.flush(timeout=20), last.stats
        last.close()
        assert last.stats["drained"] == waiting, last.stats
        reader = EventReader(server.client(), job)
        arrived = {(e.session, e.seq) for e in reader.read_all()}
        for rep, n in zip(reporters, steps, strict=True):
            assert {(rep.session, s) for s in range(3 + n - rep.stats["overflow"])} <= arrived
        assert not spool_lines(spool_dir)

    try:
        schedule()
    finally:
        server.stop()


def _not_an_event(b: bytes) -> bool:
    try:
        d = json.loads(b.decode("utf-8"))
    except ValueError:
        return True
    return not (isinstance(d, dict) and d.get("job"))


@settings(max_examples=25, deadline=None)
@given(
    junk=st.lists(
        st.binary(min_size=1, max_size=40)
        .map(lambda b: b.replace(b"\n", b"").replace(b"\r", b"") or b" ")  # one line each
        .filter(_not_an_event),
        min_size=1,
        max_size=4,
    ),
    torn=st.booleans(),
    at=st.integers(0, 3),
)
@example(junk=[b"\t"], torn=False, at=0)  # a blank line (CI found it)
@example(junk=[b'{"costexporter_spool": "1"}'], torn=True, at=2)  # a header inside the file
def test_a_corrupted_spool_sends_its_good_lines_and_counts_the_rest(junk, torn, at):
    """A spool a crashed trainer left, with bytes a torn write or a disk error put in it (not
    UTF-8, not JSON, a last line cut short): every reporter of the host used to fail on the file
    each round (a UnicodeDecodeError traceback a round, its good events never sent). Now the good
    lines are sent once, the rest counted and logged, and the file is gone."""
    import tempfile
    import uuid

    from costexporter.trainer import spool

    prefix = f"test-{uuid.uuid4().hex[:12]}"
    with tempfile.TemporaryDirectory() as d:
        spool_dir = Path(d)
        good = [
            {"v": "1", "type": "step", "job": "torn", "ts": f"{time.time():.3f}", "rank": "3",
             "session": "old", "seq": str(i), "step": str(i + 1)}
            for i in range(4)
        ]  # fmt: skip
        lines = [json.dumps(e).encode() for e in good]
        for j, b in enumerate(junk):
            lines.insert(min(at + j, len(lines)), b)
        body = b"\n".join(lines) + (b'\n{"v": "1", "ty' if torn else b"\n")
        head = json.dumps(spool.header(spool.destination(SHARED_URL), prefix)).encode() + b"\n"
        (spool_dir / f"{spool.safe_name(prefix)}.torn.old.jsonl").write_bytes(head + body)
        rep = StepReporter("torn", SHARED_URL, prefix=prefix, rank=0, spool_dir=spool_dir, heartbeat_s=3600)
        try:
            assert rep.flush(timeout=10), rep.stats
            deadline = time.monotonic() + 10
            while rep.stats["drained"] < len(good) and time.monotonic() < deadline:
                time.sleep(0.02)
        finally:
            rep.close()
        left = list(spool_dir.glob("*.jsonl"))
    r = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    try:
        got = [e for e in EventReader(r, "torn", prefix=prefix).read_all() if e.rank == 3]
    finally:
        drop_prefix(r, prefix)  # every key the reporter wrote, its registrations counter too
    assert sorted(e.get("step") for e in got) == [1, 2, 3, 4]
    assert rep.stats["drained"] == len(good)
    assert rep.stats["spool_corrupt_lines"] == len(junk) + torn
    assert not left
