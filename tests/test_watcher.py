"""The watcher: states decided from events and live GPU state, written to Redis, served as
metrics, notified to a webhook; end to end with a real 4-rank gloo job that deadlocks (R4)."""

from __future__ import annotations

import dataclasses
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
import typing
import urllib.request
from pathlib import Path

import pytest
import redis
from hypothesis import example, given
from hypothesis import strategies as st
from prometheus_client.exposition import generate_latest

from costexporter.core.booking import BookingConfig
from costexporter.core.model import Event
from costexporter.core.terms import PolicyRule
from costexporter.core.timeutil import to_ms
from costexporter.services.exporter import watch_registry
from costexporter.services.watcher import (
    JobView,
    Status,
    WatchConfig,
    Watcher,
    decide,
    notification,
)
from costexporter.store import keys
from costexporter.store.ledger_read import LedgerStore
from costexporter.store.protocol import LiveEntry
from costexporter.trainer.reporter import StepReporter

from .alertmanager import ALERTMANAGER, running_alertmanager
from .conftest import SHARED_URL
from .redis_server import RedisServer, free_port

HERE = Path(__file__).resolve().parent
T0 = 1_760_000_000.0
# The live samples below are a B300's (compute ~1000 W, the deadlock signature at ~192 W): the
# watcher is told so, as `watch --gpu-model` does (without a model it judges no power band).
CFG = WatchConfig(
    booking=BookingConfig(stall_floor_s=60.0), heartbeat_timeout_s=60.0, gpu_model="NVIDIA B300"
)


def ev(type_: str, ts: float, rank: int = 0, **fields) -> Event:
    return Event(type_, "j", to_ms(T0 + ts), rank, f"s{rank}", int(ts * 1000), fields)


def registered(n: int = 4) -> list[Event]:
    return [
        ev("register", 0, r, host=f"h{r // 2}", gpu=r % 2, world_size=n, local_rank=r % 2) for r in range(n)
    ] + [ev("run", 0, r, state="start") for r in range(n)]


def steps(first: int, last: int, every: float = 5.0, ranks=(0, 1, 2, 3), t0: float = 0.0) -> list[Event]:
    return [
        ev("step", t0 + (s - first + 1) * every, r, step=s) for s in range(first, last + 1) for r in ranks
    ]


def beats(until: float, ranks=(0, 1, 2, 3), every: float = 10.0) -> list[Event]:
    return [ev("heartbeat", t, r) for t in range(0, int(until) + 1, int(every)) for r in ranks]


def view(events: list[Event]) -> JobView:
    v = JobView("j")
    v.fold(sorted(events, key=lambda e: e.ts))
    return v


# ---- decide(): the rules, one by one -----------------------------------------------------------
def test_no_events_is_unknown_not_healthy():
    assert decide(JobView("j"), T0, CFG).state == "unknown"


def test_running_while_steps_advance():
    v = view(registered() + steps(1, 20) + beats(100))
    st = decide(v, T0 + 102, CFG)
    assert st.state == "running" and st.last_step == 20 and st.seconds_since_last_step == pytest.approx(2)


def test_done_after_run_end():
    v = view([*registered(), *steps(1, 20), *beats(100), ev("run", 101, 0, state="end")])
    assert decide(v, T0 + 500, CFG).state == "done"


def test_crashed_when_heartbeats_are_gone_and_names_the_rank():
    # Rank 2's process died at 60 s; the rest are alive (stuck in a collective, heartbeating).
    evs = [*registered(), *steps(1, 12), *beats(200, ranks=(0, 1, 3)), *beats(60, ranks=(2,))]
    st = decide(view(evs), T0 + 200, CFG)
    assert st.state == "crashed" and st.suspect["rank"] == 2 and st.suspect["host"] == "h1"
    # Every process gone: crashed too.
    st = decide(view([*registered(), *steps(1, 12), *beats(60)]), T0 + 200, CFG)
    assert st.state == "crashed" and "every rank" in st.reason


def test_a_rank_registered_but_not_yet_heard_from_is_not_crashed():
    """The ranks hash is read after the poll's events: it can hold a rank whose register event
    the poll did not bring. Its silence counts from its registration, not from 1970."""
    v = view([*registered(3), *steps(1, 20, ranks=(0, 1, 2)), *beats(200, ranks=(0, 1, 2))])
    v.registrations[3], v.registrations_read[3] = {"ts": T0 + 95, "host": "h1", "gpu": 1}, T0 + 101
    assert decide(v, T0 + 102, CFG).state == "running"
    st = decide(v, T0 + 158, CFG)  # still nothing from it 63 s after it registered: crashed
    assert st.state == "crashed" and "1 of 4 ranks for 63s" in st.reason
    # A registration dated an hour ahead (a skewed clock) counts from when it was read: it does
    # not hide the rank's silence.
    v.registrations[3]["ts"] = T0 + 3600
    assert decide(v, T0 + 150, CFG).state == "running"
    st = decide(v, T0 + 165, CFG)
    assert st.state == "crashed" and "1 of 4 ranks for 64s" in st.reason


def test_hung_past_the_stall_threshold_names_the_diverging_rank():
    # 5 s steps: threshold max(5 x 5 s, 60 s) = 60 s. Rank 3 alone entered the checkpoint.
    evs = [*registered(), *steps(1, 20), *beats(400), ev("phase", 101, 3, name="checkpoint", state="begin")]
    v = view(evs)
    assert decide(v, T0 + 150, CFG).state == "running"  # 50 s without a step: not yet
    st = decide(v, T0 + 170, CFG)
    assert st.state == "hung" and st.suspect["rank"] == 3 and "checkpoint" in st.suspect["why"]
    assert st.stall_threshold_s == 60


def test_a_checkpoint_within_its_allowance_is_not_hung_but_one_past_it_is():
    evs = [*registered(), *steps(1, 20), *beats(2000), ev("phase", 101, 0, name="checkpoint", state="begin")]
    v = view(evs)
    assert decide(v, T0 + 101 + 14 * 60, CFG).state == "running"  # 14 min into a 15 min allowance
    st = decide(v, T0 + 101 + 16 * 60, CFG)
    assert st.state == "hung"
    assert "past its" in st.reason or "no step" in st.reason


def test_a_resume_is_not_progress_stopped():
    # Steps 1-20, a crash, a resume from step 10 and steps 11.. again (the step number drops).
    evs = [*registered(), *steps(1, 20), ev("run", 110, 0, state="resume", step=10), *steps(11, 30, t0=120)]
    evs += beats(230)
    st = decide(view(evs), T0 + 225, CFG)
    assert st.state == "running" and st.last_step == 30


def live(v: JobView, ts: float, util: dict[int, float], power: float) -> None:
    v.live.append(tuple((r, int((T0 + ts) * 1000), power, u) for r, u in util.items()))


def test_deadlock_signature_needs_two_consecutive_live_samples():
    v = view([*registered(), *steps(1, 20), *beats(200)])
    busy = {0: 100.0, 1: 100.0, 2: 100.0, 3: 100.0}
    live(v, 100, busy, 1000.0)
    live(v, 105, {**busy, 3: 0.0}, 192.0)
    assert decide(v, T0 + 106, CFG).state == "running"  # one sample of the signature
    live(v, 110, {**busy, 3: 0.0}, 192.0)
    st = decide(v, T0 + 111, CFG)
    assert st.state == "hung" and st.suspect == {
        "rank": 3,
        "host": "h1",
        "gpu": 1,
        "why": "0% utilization in the deadlock signature",
    }


def test_starving_names_the_straggler():
    v = view([*registered(), *steps(1, 20), *beats(200)])
    for t in (100, 105, 110):
        live(v, t, {0: 97.0, 1: 95.0, 2: 58.0, 3: 96.0}, 575.0)
    st = decide(v, T0 + 111, CFG)
    assert st.state == "starving" and st.suspect["rank"] == 2


def agent_band(v: JobView, ts: float, rank: int, band: str, util: float, power: float = 124.1) -> None:
    """What an agent's live hash says of a rank (its newest sample and the band it gave it)."""
    v.agent_live[rank] = (
        f"h{rank // 2}",
        LiveEntry(int((T0 + ts) * 1000), power, util, band, gpu=rank % 2, uuid=f"GPU-{rank}"),
    )


def test_the_agents_spin_band_is_hung_at_once_naming_the_gpu_and_rank():
    # R9 on one GPU: steps to 100 s, then rank 0 spins at 100% at 124 W. The agent bands it
    # deadlock (two samples); the watcher says hung at its next poll, not 60 s later.
    v = view([*registered(1), *steps(1, 20, ranks=(0,)), *beats(200, ranks=(0,))])
    agent_band(v, 99, 0, "compute", 100.0, 692.0)
    assert decide(v, T0 + 101, CFG).state == "running"
    agent_band(v, 103, 0, "deadlock", 100.0)
    st = decide(v, T0 + 103.5, CFG)
    assert st.state == "hung" and "spin signature" in st.reason and "h0 GPU 0" in st.reason
    assert st.suspect["rank"] == 0 and st.suspect["gpu"] == 0 and st.suspect["host"] == "h0"
    assert st.suspect["uuid"] == "GPU-0" and "spinning" in st.suspect["why"]
    # Past the stall threshold the agent's band still names the GPU (the events cannot: one rank).
    agent_band(v, 170, 0, "deadlock", 100.0)
    st = decide(v, T0 + 170.5, CFG)
    assert st.state == "hung" and st.suspect["rank"] == 0 and "no step for 70s" in st.reason


def test_an_agent_band_older_than_the_last_step_or_stale_is_not_a_hang():
    cfg = dataclasses.replace(CFG, booking=BookingConfig(stall_floor_s=600.0))
    v = view([*registered(1), *steps(1, 20, ranks=(0,)), *beats(400, ranks=(0,))])
    agent_band(v, 99, 0, "deadlock", 100.0)  # before step 20 at 100 s: progress came after it
    assert decide(v, T0 + 101, cfg).state == "running"
    agent_band(v, 101, 0, "deadlock", 100.0)
    assert decide(v, T0 + 102, cfg).state == "hung"
    # An agent gone quiet: its hash outlived it; a band older than the heartbeat timeout is stale.
    assert decide(v, T0 + 101 + cfg.heartbeat_timeout_s + 1, cfg).state == "running"


def test_inside_a_declared_phase_within_its_allowance_the_agent_band_does_not_decide():
    evs = [*registered(1), *steps(1, 20, ranks=(0,)), *beats(400, ranks=(0,))]
    v = view([*evs, ev("phase", 101, 0, name="checkpoint", state="begin")])
    agent_band(v, 103, 0, "deadlock", 100.0)
    assert decide(v, T0 + 104, CFG).state == "running"


def test_the_agents_deadlock_band_names_the_rank_at_zero():
    v = view([*registered(), *steps(1, 20), *beats(200)])
    for r in range(4):
        agent_band(v, 104, r, "deadlock", 0.0 if r == 3 else 100.0, 192.0)
    st = decide(v, T0 + 105, CFG)
    assert st.state == "hung" and "deadlock signature" in st.reason
    assert (st.suspect["rank"], st.suspect["host"], st.suspect["gpu"]) == (3, "h1", 1)


def test_the_agents_live_hash_with_junk_is_read_entry_by_entry(shared, prefix):
    w = Watcher(WatchConfig(redis_url=SHARED_URL, prefix=prefix))
    v = view([*registered(), *steps(1, 20), *beats(200)])
    good = {"ts": T0 + 101, "power_w": 124.1, "util_pct": 100.0, "band": "deadlock"}
    good |= {"gpu": 0, "uuid": "GPU-0"}
    entries = {
        "0": good,
        "1": {**good, "band": None, "gpu": None, "uuid": None},  # an older agent: no band
        "2": "not json",
        "3": [1, 2],
        "4": {**good, "ts": "soon"},
        "5": {**good, "gpu": "zero", "uuid": 7},  # a rank beyond the job, odd index and UUID types
    }
    raw = {r: e if isinstance(e, str) else json.dumps(e) for r, e in entries.items()}
    shared.hset(keys.live_key(prefix, "j", "h0"), mapping=raw)
    assert w.read_live([v]) == {}  # the junk is refused entry by entry, not the job
    assert sorted(v.agent_live) == [0, 5] and w.stats["bad_live"] == 3
    assert v.agent_live[5][1].gpu is None and v.agent_live[5][1].uuid is None
    st = decide(v, T0 + 102, CFG)
    assert st.state == "hung" and st.suspect["rank"] == 0 and st.suspect["uuid"] == "GPU-0"


def test_notification_is_an_alertmanager_payload():
    v = view(
        [*registered(), *steps(1, 20), *beats(400), ev("phase", 101, 3, name="checkpoint", state="begin")]
    )
    old = decide(v, T0 + 120, CFG)
    new = decide(v, T0 + 170, CFG)
    p = notification("j", old, new, T0 + 170, "pfx")
    assert p["version"] == "4" and p["status"] == "firing" and p["commonLabels"] == {"training_job": "j"}
    (a,) = p["alerts"]
    assert a["labels"]["alertname"] == "JobHung" and a["labels"]["suspect_rank"] == "3"
    assert a["startsAt"].endswith("Z") and a["endsAt"] == "0001-01-01T00:00:00Z"
    back = notification("j", new, Status("running", "ok", T0 + 200, T0 + 200), T0 + 200, "p")
    assert [x["status"] for x in back["alerts"]] == ["resolved", "firing"]


# ---- against Redis: status keys, the API, metrics, the webhook, an outage ----------------------
class _Receiver(http.server.BaseHTTPRequestHandler):
    fail_first = 2
    received: typing.ClassVar[list] = []
    calls = 0

    def do_POST(self):
        type(self).calls += 1
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if type(self).calls <= type(self).fail_first:
            self.send_response(503)
            self.end_headers()
            return
        type(self).received.append(json.loads(body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *a):
        pass


def _one_rank(job: str, prefix: str, spool: Path, clock: list[float], **kw) -> StepReporter:
    """A one-rank job's reporter on the shared Redis, timed by `clock[0]`."""
    return StepReporter(
        job,
        SHARED_URL,
        prefix=prefix,
        rank=0,
        world_size=1,
        host="h0",
        spool_dir=str(spool),
        clock=lambda: clock[0],
        **kw,
    )


def test_watcher_writes_status_serves_metrics_and_notifies_with_retries(prefix, tmp_path):
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    _Receiver.received, _Receiver.calls = [], 0
    job = f"{prefix}-job"
    clock = [time.time()]
    rep = _one_rank(job, prefix, tmp_path, clock, heartbeat_s=0.2)
    cfg = WatchConfig(
        redis_url=SHARED_URL,
        prefix=prefix,
        booking=BookingConfig(stall_floor_s=5.0),
        poll_s=0.2,
        heartbeat_timeout_s=30.0,
        webhook_url=f"http://127.0.0.1:{srv.server_address[1]}/hook",
        webhook_backoff_s=0.05,
        clock=lambda: clock[0],
    )
    w = Watcher(cfg)
    try:
        for s in range(1, 6):
            clock[0] += 1
            rep.step(s)
        assert rep.flush(5)
        assert w.poll()[job].state == "running"
        clock[0] += 30  # no step for 30 s > the 5 s threshold; heartbeats go on
        time.sleep(0.6)
        assert rep.flush(5)
        st = w.poll()[job]
        assert st.state == "hung" and st.seconds_since_last_step == pytest.approx(30, abs=0.5)
        r = redis.Redis.from_url(SHARED_URL, decode_responses=True)
        stored = json.loads(r.get(keys.status_key(prefix, job)))
        assert stored["state"] == "hung" and 0 < r.ttl(keys.status_key(prefix, job)) <= w.ttl
        # The finance API reads the same key.
        assert LedgerStore(r, prefix).info_many([job])[job]["status"] == "hung"
        text = generate_latest(watch_registry(w)).decode()
        assert f'costexporter_job_state{{costexporter_job_state="hung",training_job="{job}"}} 1.0' in text
        assert f'costexporter_job_state{{costexporter_job_state="running",training_job="{job}"}} 0.0' in text
        assert f'costexporter_job_seconds_since_last_step{{training_job="{job}"}} 30.0' in text
        w.webhook.drain()
        # Two transitions (new -> running, running -> hung); the first POST failed twice.
        assert [p["alerts"][-1]["labels"]["state"] for p in _Receiver.received] == ["running", "hung"]
        assert w.webhook.stats["retries"] == 2 and w.webhook.stats["sent"] == 2
        rep.close()
        assert w.poll()[job].state == "done"
    finally:
        w.stop()
        srv.shutdown()


def test_a_receiver_that_stays_down_is_given_up_and_counted(prefix):
    cfg = WatchConfig(
        redis_url=SHARED_URL,
        prefix=prefix,
        webhook_url=f"http://127.0.0.1:{free_port()}/nobody",
        webhook_retries=2,
        webhook_backoff_s=0.01,
        jobs=(f"{prefix}-j",),
    )
    w = Watcher(cfg)
    try:
        w.poll()  # the job has no events: unknown, a transition
        w.webhook.drain()
        assert w.webhook.stats["failed"] == 1 and w.webhook.stats["retries"] == 2
    finally:
        w.stop()


def test_an_alertmanager_that_stays_down_never_delays_a_poll_and_is_counted(prefix):
    cfg = WatchConfig(
        redis_url=SHARED_URL,
        prefix=prefix,
        alertmanager_url=f"http://127.0.0.1:{free_port()}",
        webhook_retries=2,
        webhook_backoff_s=1.0,
        jobs=(f"{prefix}-j",),
    )
    w = Watcher(cfg)
    try:
        assert w.poll()[f"{prefix}-j"].state == "unknown"  # an alerting state: posted, off the poll
        # The delivery takes 3 s of backoff before it gives up: still under way when the poll returns.
        assert w.alertmanager.stats["failed"] == 0
        w.alertmanager.drain()
        assert w.alertmanager.stats["failed"] == 1 and w.alertmanager.stats["retries"] == 2
    finally:
        w.stop()


def test_redis_outage_makes_every_job_unknown(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    job = "outage-job"
    rep = StepReporter(
        job, server.url, rank=0, world_size=1, host="h0", spool_dir=str(tmp_path), heartbeat_s=0.2
    )
    w = Watcher(WatchConfig(redis_url=server.url, poll_s=0.2))
    try:
        rep.step(1)
        rep.step(2)
        assert rep.flush(5)
        assert w.poll()[job].state == "running"
        server.kill()
        st = w.poll()[job]
        assert st.state == "unknown" and "cannot read Redis" in st.reason
        assert w.snapshot().redis_up is False
        text = generate_latest(watch_registry(w)).decode()
        assert f'costexporter_job_state{{costexporter_job_state="unknown",training_job="{job}"}} 1.0' in text
        assert "costexporter_watch_redis_up 0.0" in text
    finally:
        rep.close(timeout=0.2)
        w.stop()
        server.stop()


def test_watch_cli_once_prints_statuses(prefix, tmp_path, cli):
    job = f"{prefix}-cli"
    rep = StepReporter(
        job, SHARED_URL, prefix=prefix, rank=0, world_size=1, host="h0", spool_dir=str(tmp_path)
    )
    rep.step(1)
    rep.close()
    r = cli("watch", "--prefix", prefix, "--once", "--port", "0")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)[job]["state"] == "done"


# ---- end to end: a real 4-rank gloo job (R4) ------------------------------------------
def _launch(job: str, prefix: str, url: str, spool: Path, mode: str) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(4):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": str(rank)}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=str(HERE.parent))
        procs.append(
            subprocess.Popen(
                [sys.executable, str(HERE / "helpers" / "gloo_train.py"), job, prefix, url, str(spool), mode],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    return procs


def _wait_state(w: Watcher, job: str, states: set[str], timeout: float) -> tuple:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        st = w.poll().get(job)
        if st is not None and st.state in states:
            return st, time.time()
        time.sleep(w.cfg.poll_s)
    raise AssertionError(f"{job}: not {states} within {timeout}s; last {w.status.get(job)}")


def test_real_gloo_job_hangs_is_named_then_crashes_and_the_fixed_job_finishes(tmp_path):
    pytest.importorskip("torch", reason="torch is an optional extra")
    server = RedisServer(tmp_path / "redis").start()
    booking = BookingConfig(stall_floor_s=2.0)  # the ledger's rule, with a test-sized floor
    w = Watcher(WatchConfig(redis_url=server.url, booking=booking, poll_s=0.25, heartbeat_timeout_s=3.0))
    procs: list[subprocess.Popen] = []
    try:
        # Uneven batches: rank 3 leaves the loop for the save barrier; the rest wait in all-reduce.
        procs = _launch("r4-uneven", "costexporter", server.url, tmp_path / "spool", "uneven")
        st, seen = _wait_state(w, "r4-uneven", {"hung", "done", "crashed"}, timeout=120)
        assert st.state == "hung", st
        assert st.suspect is not None and st.suspect["rank"] == 3, st.suspect
        latency = seen - st.last_step_ts
        print(
            f"\nR4 deadlock: hung reported {latency:.2f}s after the last step "
            f"(stall threshold {st.stall_threshold_s:.1f}s, poll {w.cfg.poll_s}s); suspect {st.suspect}"
        )
        assert latency <= st.stall_threshold_s + 2.0
        assert all(p.poll() is None for p in procs)  # really stuck, not exited

        # Kill the job's processes: heartbeats stop, no run end.
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)
        st, _ = _wait_state(w, "r4-uneven", {"crashed"}, timeout=30)
        assert "no run end" in st.reason

        # The same job with the R4 fix (all-reduce MIN of the batch count) finishes: done.
        procs = _launch("r4-fixed", "costexporter", server.url, tmp_path / "spool", "fixed")
        st, _ = _wait_state(w, "r4-fixed", {"done", "hung", "crashed"}, timeout=120)
        outs = [p.communicate(timeout=60)[0] for p in procs]
        assert st.state == "done", (st, outs)
        assert all(p.returncode == 0 for p in procs), outs
        assert st.last_step == 28

        # Redis gone: the watcher cannot see, so nothing is healthy.
        server.kill()
        decided = w.poll()
        assert {j: s.state for j, s in decided.items()} == {"r4-uneven": "unknown", "r4-fixed": "unknown"}
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        w.stop()
        server.stop()


def test_sim_clock_is_published_for_watchers_of_a_time_compressed_job(prefix):
    """`watch --sim-clock` judges a simulated job at --speed by the clock it publishes."""
    from costexporter.sources.sim import WATCH_LAG_WALL_S, SimSource, published_clock

    src = SimSource("mini", speed=100.0, redis_url=SHARED_URL, prefix=prefix, host="sim")
    # The watcher judges behind the story by its events' flush lag, not the agent's longer one.
    lag = min(src.event_lag_s, WATCH_LAG_WALL_S * 100.0)
    try:
        clock = published_clock(SHARED_URL, prefix)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            # Until the simulation publishes, the wall clock; then the simulation's, which runs 100x.
            if abs(clock() - (src.sim_time() - lag)) < 5.0:
                break
            time.sleep(0.2)
        # 5 s of sim time = 50 ms of wall time; the clock stays behind by the events' lag.
        assert abs(clock() - (src.sim_time() - lag)) < 5.0
        assert 0 < lag < src.event_lag_s
        c1 = clock()
        time.sleep(0.5)
        assert clock() - c1 > 20  # 0.5 s of wall time is ~50 s of the story's
    finally:
        src.close()


# ---- phases closed by restarts, the right suspect, per-job thresholds -----------------------------
def sess(type_: str, ts: float, rank: int, session: str, **fields) -> Event:
    return Event(type_, "j", to_ms(T0 + ts), rank, session, int(ts * 1000), fields)


def test_a_new_session_of_a_rank_closes_its_old_sessions_phases():
    # R1: rank 3 entered the checkpoint and hung; the watchdog killed the job; every rank restarts
    # with a new session (torchrun) and the job trains again, without a run event: not hung.
    evs = [*registered(), *steps(1, 20), ev("phase", 101, 3, name="checkpoint", state="begin")]
    evs += beats(2000, ranks=(0, 1, 2, 3))
    assert decide(view(evs), T0 + 101 + 16 * 60, CFG).state == "hung"
    t = 101 + 20 * 60
    evs += [sess("register", t, r, f"new{r}", host=f"h{r // 2}", gpu=r % 2) for r in range(4)]
    evs += [sess("step", t + 5 * k, r, f"new{r}", step=20 + k) for k in range(1, 10) for r in range(4)]
    evs += [sess("heartbeat", t + 10 * k, r, f"new{r}") for k in range(6) for r in range(4)]
    st = decide(view(evs), T0 + t + 50, CFG)
    assert st.state == "running", st


def test_rank_0_run_start_or_resume_closes_every_ranks_older_phases():
    # Only rank 0 posts the resume (a launcher that does not restart the other processes).
    for state in ("start", "resume"):
        evs = [*registered(), *steps(1, 20), ev("phase", 101, 3, name="checkpoint", state="begin")]
        evs += beats(3000)
        t = 101 + 20 * 60
        evs += [ev("run", t, 0, state=state, step=10), *steps(11, 30, t0=t)]
        st = decide(view(evs), T0 + t + 101, CFG)
        assert st.state == "running", (state, st)
        # A phase rank 3 begins after the resume stays open.
        v = view([*evs, ev("phase", t + 102, 3, name="checkpoint", state="begin")])
        assert v.ranks[3].open_phases == {"checkpoint": T0 + t + 102}


@given(
    offsets=st.lists(st.floats(0, 100), min_size=2, max_size=8),
    interval=st.sampled_from([0.5, 10.0]),
)
@example(offsets=[1.0, 2.00001], interval=0.5)  # two intervals apart once rounded to ms: no blame
def test_a_rank_is_blamed_only_when_its_silence_started_measurably_first(offsets, interval):
    """Every rank stops at 100 s + offset; the watcher names the first only when it stopped more
    than two heartbeat intervals before every other rank, else says they stopped together."""
    n = len(offsets)
    evs = [ev("register", 0, r, host="h", gpu=r, world_size=n) for r in range(n)]
    evs += [ev("heartbeat", 100 + off, r) for r, off in enumerate(offsets)]
    cfg = dataclasses.replace(CFG, heartbeat_interval_s=interval)
    st = decide(view(evs), T0 + 1000, cfg)
    assert st.state == "crashed" and "every rank" in st.reason
    # The times as the watcher has them: integer ms (an offset 1.0 and one 2.00001 s later are
    # 1,000 ms apart there, not more).
    stopped = [to_ms(T0 + 100 + off) for off in offsets]
    order = sorted(range(n), key=lambda r: stopped[r])
    first, second = order[0], order[1]
    if stopped[second] - stopped[first] > 2 * interval * 1000:
        assert st.suspect["rank"] == first and "first" in st.suspect["why"]
    else:
        assert st.suspect["rank"] is None and st.suspect["why"] == "all ranks stopped together"


def test_kill_9_with_torchrun_sigterming_the_rest_within_20_ms_names_no_rank():
    evs = [*registered(), *steps(1, 12), *beats(60)]
    evs += [ev("heartbeat", 61.0 + 0.005 * r, r) for r in range(4)]  # the last beats, 5 ms apart
    st = decide(view(evs), T0 + 300, CFG)
    assert st.state == "crashed" and st.suspect["rank"] is None
    assert st.suspect["why"] == "all ranks stopped together"


def test_a_ddp_hang_in_lockstep_is_named_from_the_agents_live_state_or_not_at_all():
    # Every rank stepped to 20 and heartbeats on (the reporter thread lives): events cannot tell.
    v = view([*registered(), *steps(1, 20), *beats(400)])
    st = decide(v, T0 + 200, CFG)
    assert st.state == "hung" and st.suspect == {
        "rank": None,
        "host": None,
        "gpu": None,
        "why": "no agent data: cannot name a rank",
    }
    # With the agents' live state (not yet two samples of a deadlock signature: mid power), the
    # rank at 0% while the others spin is named.
    live(v, 199, {0: 100.0, 1: 0.0, 2: 100.0, 3: 100.0}, 640.0)
    st = decide(v, T0 + 200, CFG)
    assert st.state == "hung" and st.suspect["rank"] == 1 and st.suspect["host"] == "h0"
    assert "0% utilization" in st.suspect["why"]


def test_a_jobs_meta_sets_its_heartbeat_cadence_but_never_its_stall_threshold():
    """The stall threshold moves GPU time between valid and wasted: the operator's (flags or
    policy), never a trainer's meta. The heartbeat cadence may come from meta."""
    slow = [*registered(), *steps(1, 4, every=300.0), *beats(1500)]
    assert decide(view(slow), T0 + 1200 + 200, CFG).state == "hung"  # the default 60 s floor
    meta = ev("meta", 0, 0, stall_floor_s=1800, heartbeat_timeout_s=900)
    v = view([meta, *slow])
    st = decide(v, T0 + 1200 + 200, CFG)
    assert st.state == "hung" and st.stall_threshold_s == 60  # the meta's floor is ignored
    assert v.judged_terms is not None and v.judged_terms.ignored_meta == ("stall_floor_s",)
    # The operator's policy gives the job its floor, by its name.
    rule = PolicyRule((("stall_floor_s", 1800.0),), job="j*")
    st = decide(view([meta, *slow]), T0 + 1200 + 200, dataclasses.replace(CFG, policy_rules=(rule,)))
    assert st.state == "running" and st.stall_threshold_s == 1800
    # Its heartbeat timeout is the job's own: silent for 300 s is not crashed with a 900 s timeout.
    quiet = [meta, *registered(), *steps(1, 4, every=300.0), *beats(1200)]
    assert decide(view(quiet), T0 + 1500, CFG).state != "crashed"
    assert decide(view(quiet[1:]), T0 + 1500, CFG).state == "crashed"
    # A meta that arrives after the job was judged applies from the next decision on (the
    # judged terms are kept between polls until one of their inputs changes).
    later = view(quiet[1:])
    assert decide(later, T0 + 1500, CFG).state == "crashed"
    later.fold([dataclasses.replace(meta, ts_ms=meta.ts_ms + 1_400_000, seq=99)])
    assert decide(later, T0 + 1500, CFG).state != "crashed"
    # The operator's policy given anew (a watcher's config) is judged by at once too.
    st = decide(later, T0 + 1500, dataclasses.replace(CFG, policy_rules=(rule,)))
    assert st.stall_threshold_s == 1800
    # Unusable values are ignored, not fatal.
    bad = ev("meta", 0, 0, stall_floor_s="soon", heartbeat_timeout_s=-1)
    assert decide(view([bad, *slow]), T0 + 1400, CFG).stall_threshold_s == 60


# ---- Alertmanager's own API, against Debian's prometheus-alertmanager ---------------------------


class _AMReceiver(http.server.BaseHTTPRequestHandler):
    received: typing.ClassVar[list] = []

    def do_POST(self):
        type(self).received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *a):
        pass


@pytest.fixture
def alertmanager(tmp_path):
    """A real Alertmanager on free ports, routing everything to a local webhook receiver."""
    if ALERTMANAGER is None:
        pytest.skip("prometheus-alertmanager not installed (.ci/run installs it)")
    recv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _AMReceiver)
    threading.Thread(target=recv.serve_forever, daemon=True).start()
    _AMReceiver.received = []
    cfg = tmp_path / "alertmanager.yml"
    cfg.write_text(
        json.dumps(
            {
                "route": {
                    "receiver": "hook",
                    "group_by": ["training_job", "alertname"],
                    "group_wait": "0s",
                    "group_interval": "1s",
                    "repeat_interval": "1h",
                },
                "receivers": [
                    {
                        "name": "hook",
                        "webhook_configs": [
                            {"url": f"http://127.0.0.1:{recv.server_address[1]}/", "send_resolved": True}
                        ],
                    }
                ],
            }
        )
    )
    with running_alertmanager(cfg, tmp_path / "am") as base:
        yield base
    recv.shutdown()


def _am_alerts(base: str) -> list[dict]:
    with urllib.request.urlopen(f"{base}/api/v2/alerts", timeout=5) as r:
        return json.loads(r.read())


def test_watch_posts_to_a_real_alertmanager_and_resolves(prefix, tmp_path, alertmanager):
    job = f"{prefix}-am"
    clock = [time.time()]
    rep = _one_rank(job, prefix, tmp_path, clock, heartbeat_s=0.2)
    w = Watcher(
        WatchConfig(
            redis_url=SHARED_URL,
            prefix=prefix,
            booking=BookingConfig(stall_floor_s=5.0),
            heartbeat_timeout_s=30.0,
            alertmanager_url=alertmanager,
            alertmanager_resend_s=0.5,
            clock=lambda: clock[0],
        )
    )
    try:
        for s in range(1, 6):
            clock[0] += 1
            rep.step(s)
        assert rep.flush(5)
        assert w.poll()[job].state == "running"
        w.alertmanager.drain()
        assert w.alertmanager.stats["sent"] == 0  # running is a state, not an alert
        clock[0] += 30
        time.sleep(0.5)
        assert rep.flush(5)
        assert w.poll()[job].state == "hung"
        w.alertmanager.drain()
        (a,) = [x for x in _am_alerts(alertmanager) if x["labels"].get("training_job") == job]
        assert a["labels"]["alertname"] == "JobHung" and a["labels"]["severity"] == "critical"
        assert a["status"]["state"] == "active" and "no step for" in a["annotations"]["description"]
        # Still hung a while later: re-posted, the same alert (same labels), still active.
        time.sleep(0.6)
        w.poll()
        w.alertmanager.drain()
        assert w.alertmanager.stats["sent"] >= 2
        assert [
            x["labels"]["alertname"] for x in _am_alerts(alertmanager) if x["labels"]["training_job"] == job
        ] == ["JobHung"]
        deadline = time.monotonic() + 15
        while not any(p["status"] == "firing" for p in _AMReceiver.received) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert any(p["status"] == "firing" for p in _AMReceiver.received), _AMReceiver.received
        rep.close()
        assert w.poll()[job].state == "done"
        w.alertmanager.drain()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            active = [x for x in _am_alerts(alertmanager) if x["labels"]["training_job"] == job]
            resolved = [p for p in _AMReceiver.received if p["status"] == "resolved"]
            if not active and resolved:
                break
            time.sleep(0.2)
        assert not active, active
        assert resolved[0]["alerts"][0]["labels"]["alertname"] == "JobHung"
    finally:
        w.stop()


def test_per_job_thresholds_come_from_the_operators_policy_not_the_reporters_meta(prefix, tmp_path):
    """meta(stall_floor_s=...) posted by a StepReporter is ignored, counted once and said; the
    operator's policy rule for the job's name gives it its floor."""
    clock = [time.time()]
    jobs = {}
    for name in ("slow", "fast"):
        job = f"{prefix}-{name}"
        rep = _one_rank(job, prefix, tmp_path, clock, meta={"stall_floor_s": 1800.0})
        for s in range(1, 4):
            rep.step(s, ts=clock[0] + s * 300)
        assert rep.flush(5)
        jobs[name] = (job, rep)
    clock[0] += 3 * 300 + 400  # 400 s since the last step: hung by the default rule, not by 1800 s
    for _, rep in jobs.values():
        rep._post("heartbeat", ts=clock[0])  # alive
        assert rep.flush(5)
    rule = PolicyRule((("stall_floor_s", 1800.0),), job="*-slow")
    w = Watcher(
        WatchConfig(
            redis_url=SHARED_URL,
            prefix=prefix,
            heartbeat_timeout_s=10_000,
            clock=lambda: clock[0],
            policy_rules=(rule,),
        )
    )
    try:
        decided = w.poll()
        assert (
            decided[jobs["slow"][0]].state == "running" and decided[jobs["slow"][0]].stall_threshold_s == 1800
        )
        assert decided[jobs["fast"][0]].state == "hung"
        w.poll()
        fast = jobs["fast"][0]
        assert w.meta_ignored == {(jobs["slow"][0], "stall_floor_s"): 1, (fast, "stall_floor_s"): 1}
        text = generate_latest(watch_registry(w)).decode()
        assert f'costexporter_meta_ignored_total{{key="stall_floor_s",training_job="{fast}"}} 1.0' in text
    finally:
        w.stop()
        for _, rep in jobs.values():
            rep.close(timeout=0.5)


def test_a_crash_record_names_the_failing_rank_at_once_even_when_every_rank_stops_together():
    """torch's teardown silences every rank within the same seconds, so heartbeats cannot tell
    which failed; the rank whose process could still write posted a crash record as it died
    (an exception, `sys.exit(1)`): the watcher names it at once, before any heartbeat timeout."""
    evs = [*registered(), *steps(1, 12), *beats(60)]
    evs.append(ev("run", 61.0, 2, state="crash", exit="uncaught RuntimeError", error="RuntimeError"))
    evs += [ev("heartbeat", 61.0 + 0.005 * r, r) for r in range(4)]
    st = decide(view(evs), T0 + 65, CFG)  # 4 s after: no heartbeat timeout yet
    assert st.state == "crashed" and st.suspect["rank"] == 2, st
    assert "rank 2 crashed (uncaught RuntimeError)" in st.reason and "RuntimeError" in st.suspect["why"]
    # A restart of the rank (a new process) forgets its crash record.
    evs.append(Event("run", "j", to_ms(T0 + 80), 2, "s2-restart", 0, {"state": "start"}))
    assert decide(view(evs), T0 + 85, CFG).state != "crashed"


def test_one_rank_silent_while_the_others_stopped_within_seconds_is_said_as_such():
    """1 of 4 ranks past the timeout, the other three's heartbeats stopped seconds after its:
    which stopped first cannot be told, and the words say one rank, not 'ranks [2] ... together'."""
    evs = [*registered(), *steps(1, 12), *beats(60)]
    evs += [ev("heartbeat", 62.0, r) for r in (0, 1, 3)]
    st = decide(view(evs), T0 + 60 + 60.5, CFG)
    assert st.state == "crashed" and "1 of 4 ranks" in st.reason and st.suspect["rank"] is None
    assert (
        st.suspect["why"].startswith("rank 2 is silent past the timeout")
        and "together" not in st.suspect["why"]
    )
