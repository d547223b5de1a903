"""`costexporter serve` end to end: real agent processes, a real Redis ledger, real /metrics."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from costexporter.core.model import CATEGORIES
from costexporter.core.replay import ReplayConfig, book_trace
from costexporter.sources.synth import TraceBuilder, write_nvidia_smi_csv
from costexporter.store import keys, ledger, protocol
from costexporter.trainer.transport import send_entries

from .agent_helpers import entry_maker, running, wait_booked
from .conftest import SHARED_URL, promtool_check_metrics, skip_unchecked_exposition, spawn_cli
from .redis_server import RedisServer, free_port


def two_host_job() -> TraceBuilder:
    """4 ranks on 2 hosts; the deadlock's 0% rank is on node0, so node1's agent needs node0's samples."""
    b = TraceBuilder(n_gpus=4, per_host=2, job="agent-job", seed=5, interval_s=1.0)
    b.meta(gpu_model="NVIDIA B300", team="llm")
    b.run("start")
    b.stretch("compute", 240, step_s=4, tokens=1000)
    b.phase("checkpoint", "begin")
    b.stretch("checkpoint", 60, zero_ranks=(0,))
    b.phase("checkpoint", "end", step=b.step)
    b.stretch("communication", 60, step_s=6, tokens=1000)
    b.stretch("deadlock", 180, zero_ranks=(1,))
    b.stretch("compute", 60, step_s=4, tokens=1000)
    b.run("end")
    b.stretch("idle", 10)
    return b


def event_entry(e) -> dict[str, str]:
    """A synthetic trace's event as a trainer sends it (ts to the millisecond)."""
    return protocol.encode_fields(
        {
            "v": "1",
            "type": e.type,
            "job": e.job,
            "ts": f"{e.ts:.3f}",
            "rank": e.rank,
            "session": e.session,
            "seq": e.seq,
            **e.fields,
        }
    )


def post_events(client, prefix: str, b: TraceBuilder) -> None:
    send_entries(client, prefix, b.job, [event_entry(e) for e in sorted(b.events, key=lambda e: e.ts)])


def offline_ms(b: TraceBuilder) -> dict[str, int]:
    [r], _ = book_trace(b.samples(), b.events, ReplayConfig())
    ms = np.bincount(r.pieces.category, weights=r.pieces.dur_ms, minlength=len(CATEGORIES)).astype(np.int64)
    return dict(zip(CATEGORIES, ms.tolist(), strict=True)), r


def agent_process(
    source: list[str], host: str, url: str, prefix: str, port: int, *extra: str, book_s=0.2, sample_s=0.1
) -> subprocess.Popen:
    """A real `costexporter serve` process, agent `host`: `source` is the command line after the
    interpreter up to the source options (the CLI's, or tests/helpers/nvml_serve.py's)."""
    return subprocess.Popen(
        [
            sys.executable,
            *source,
            "--host",
            host,
            "--agent-id",
            host,
            "--redis-url",
            url,
            "--prefix",
            prefix,
            "--port",
            str(port),
            "--listen",
            "127.0.0.1",
            "--book-interval",
            str(book_s),
            "--sample-interval",
            str(sample_s),
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def serve(
    csv: Path,
    host: str,
    url: str,
    prefix: str,
    port: int,
    *extra: str,
    speed: float = 100,
    book_s: float = 0.2,
    sample_s: float = 0.1,
) -> subprocess.Popen:
    """A real `costexporter serve` replaying one host's trace."""
    source = ["-m", "costexporter.cli", "serve", "--source", "replay", "--samples", f"{host}={csv}"]
    return agent_process(
        source, host, url, prefix, port, "--speed", str(speed), *extra, book_s=book_s, sample_s=sample_s
    )


def stop_all(procs: list[subprocess.Popen]) -> list[str]:
    """SIGTERM each agent; it must exit 0 within 30 s without a traceback. Returns their stderr."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    errs = []
    for p in procs:
        try:
            _out, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()  # never leave an agent behind, even one that ignores SIGTERM
            p.communicate()
            raise
        errs.append(err)
        assert p.returncode == 0, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
    return errs


def scrape(port: int) -> dict[str, list]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out, text


@pytest.fixture
def trace(tmp_path):
    b = two_host_job()
    csvs = write_nvidia_smi_csv(b.samples(), tmp_path / "trace")
    return b, {p.stem: p for p in csvs}


def test_read_amounts_of_a_bucket_needs_its_start(shared, prefix):
    # It read the key `...:5m:None`, which never exists: an empty bucket instead of an error.
    with pytest.raises(ValueError, match="needs its start"):
        ledger.read_amounts(shared, prefix, "some-job", "5m")


def test_two_agents_book_one_job_and_their_metrics_agree(shared, prefix, trace):
    b, csvs = trace
    post_events(shared, prefix, b)
    expected, offline = offline_ms(b)
    ports = [free_port(), free_port()]
    procs = [
        serve(csvs["node0"], "node0", SHARED_URL, prefix, ports[0]),
        serve(csvs["node1"], "node1", SHARED_URL, prefix, ports[1]),
    ]
    try:
        wait_booked(shared, prefix, b.job, ["node0", "node1"], offline.timeline.end_ms)
        total = ledger.read_amounts(shared, prefix, b.job)
        assert ledger.net_ms(total) == expected  # both agents together = the offline replay, to the ms
        assert total["stalled:ms"] > 0  # node1's agent saw node0's rank at 0%
        figures = shared.hgetall(keys.figures_key(prefix, b.job))
        assert int(figures["steps_completed"]) == len(offline.timeline.steps)
        # The rollups hold the same amounts as the 5-minute buckets.
        for res in ("5m", "1h", "1d"):
            starts = [int(x) for x in shared.zrange(keys.index_key(prefix, b.job, res), 0, -1)]
            got = {}
            for s in starts:
                for f, v in ledger.read_amounts(shared, prefix, b.job, res, s).items():
                    got[f] = got.get(f, 0) + v
            assert got == total, res

        scraped = [scrape(p) for p in ports]
        # Per-GPU amounts: summed across agents they give the ledger.
        for cat in CATEGORIES:
            agents_sum = sum(
                v
                for m, _ in scraped
                for lab, v in m["costexporter_gpu_time_seconds_total"]
                if lab["category"] == cat and lab["training_job"] == b.job
            )
            assert agents_sum == pytest.approx(total.get(f"{cat}:ms", 0) / 1000, abs=1e-6), cat
        # Job-level series: identical on both agents; max is the job's figure.
        steps = [v for m, _ in scraped for lab, v in m["costexporter_job_steps_completed_total"]]
        assert steps == [len(offline.timeline.steps)] * 2
        # promtool agrees the exposition is clean (the other checks above run without it).
        checked = [promtool_check_metrics(text) for _, text in scraped]
    finally:
        stop_all(procs)
    assert len(checked) == 2
    if not all(checked):
        skip_unchecked_exposition()


def test_agent_killed_and_restarted_ends_with_the_same_ledger(shared, prefix, trace, tmp_path):
    b, csvs = trace
    post_events(shared, prefix, b)
    expected, offline = offline_ms(b)
    # One agent per host, node0's killed with SIGKILL half way and started again.
    other = serve(csvs["node1"], "node1", SHARED_URL, prefix, 0)
    first = serve(csvs["node0"], "node0", SHARED_URL, prefix, 0)
    try:
        deadline = time.monotonic() + 30
        while True:
            wm = ledger.load_watermark(shared, prefix, b.job, "node0")
            if wm and wm["booked_until"] > offline.timeline.start_ms + 200_000:
                break
            assert time.monotonic() < deadline
            time.sleep(0.05)
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        second = serve(csvs["node0"], "node0", SHARED_URL, prefix, 0)
        wait_booked(shared, prefix, b.job, ["node0", "node1"], offline.timeline.end_ms)
        second.send_signal(signal.SIGTERM)
        assert second.wait(30) == 0
    finally:
        for p in (other, first):
            if p.poll() is None:
                p.kill()
    assert ledger.net_ms(ledger.read_amounts(shared, prefix, b.job)) == expected


def test_redis_down_mid_replay_loses_nothing_and_books_no_stall(tmp_path, trace):
    b, csvs = trace
    server = RedisServer(tmp_path / "redis").start()
    client = server.client()
    post_events(client, "ce", b)
    expected, offline = offline_ms(b)
    # A slower replay (20x), so the trace is still playing while Redis is down.
    procs = [
        serve(csvs[h], h, server.url, "ce", 0, speed=20, book_s=0.5, sample_s=0.2) for h in ("node0", "node1")
    ]
    try:
        time.sleep(4)
        server.stop()  # 6 s without Redis: two minutes of the trace at 20x
        time.sleep(6)
        server.start()
        client = server.client()
        wait_booked(client, "ce", b.job, ["node0", "node1"], offline.timeline.end_ms, timeout=90)
        total = ledger.read_amounts(client, "ce", b.job)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        errs = [p.communicate(timeout=30)[1] for p in procs]
        server.stop()
    got = ledger.net_ms(total)
    diff = {
        k: (got.get(k), expected.get(k)) for k in set(got) | set(expected) if got.get(k) != expected.get(k)
    }
    assert not diff, f"nothing lost, nothing twice: (live, offline) differ in {diff}"
    assert total.get("stalled:ms", 0) == expected["stalled"]  # the outage is not a stall
    assert any("Redis unreachable" in e for e in errs)
    assert all("Traceback" not in e for e in errs)


# Played on a clock: the booked time is compared with the wall-clock time the GPU was lost.
@pytest.mark.serial
def test_a_lost_gpu_keeps_the_others_booked_and_books_unobserved(shared, prefix, monkeypatch):

    from prometheus_client import generate_latest

    from costexporter.core.booking import BookingConfig
    from costexporter.services.agent import Agent, AgentConfig
    from costexporter.services.exporter import registry_for
    from costexporter.sources.nvml import NvmlSource

    from .fake_nvml import FakeGpu, FakeNvml

    uuids = [f"GPU-{i:08x}-aaaa-bbbb-cccc-{i:012x}" for i in range(4)]
    fake = FakeNvml([FakeGpu(u) for u in uuids]).install(monkeypatch)
    agent = Agent(
        NvmlSource(host="gpu-host"),
        AgentConfig(
            redis_url=SHARED_URL,
            prefix=prefix,
            agent_id="gpu-host",
            book_interval_s=0.1,
            sample_interval_s=0.05,
            job_refresh_s=0.2,
            # A loaded machine stalls the sampler thread for longer than the default 3 intervals:
            # those stalls would book every GPU unobserved. Here only the lost GPU's time may.
            booking=BookingConfig(gap_intervals=100),
        ),
    ).start()
    job = "lost-gpu"
    t0 = time.time()
    entry = entry_maker(job)
    send_entries(
        shared,
        prefix,
        job,
        [entry(r, 0, "register", host="gpu-host", gpu=r, gpu_uuid=uuids[r]) for r in range(4)]
        + [entry(0, 1, "run", state="start")],
    )
    with running(agent):
        seq = 2
        for step in range(1, 25):
            time.sleep(0.125)
            if step == 12:
                fake.gpus[2].lost = True
            send_entries(shared, prefix, job, [entry(0, seq, "step", step=step)])
            seq += 1
        send_entries(shared, prefix, job, [entry(0, seq, "run", state="end")])
        end = time.time()
        wait_booked(shared, prefix, job, ["gpu-host"], int(end * 1000))
        metrics = generate_latest(registry_for(agent)).decode()
    total = ledger.net_ms(ledger.read_amounts(shared, prefix, job))
    # The lost GPU's last sample is its last answered call (a stalled sampler may have read it
    # well before the test set it lost); its slice runs one interval past that.
    lost_s = end - (fake.gpus[2].read_at + 0.05)
    assert total["unobserved"] / 1000 == pytest.approx(lost_s, abs=0.4)  # one GPU's time since it fell off
    busy = total["productive"] + total["overhead"]
    assert busy / 1000 == pytest.approx(4 * (end - t0) - lost_s, rel=0.1)  # the other three went on
    assert 'costexporter_gpu_errors_total{gpu="2",host="gpu-host",kind="gpu_lost"}' in metrics
    assert re.search(r'costexporter_gpu_band\{[^}]*band="compute"[^}]*,gpu="0"', metrics)


def test_a_resume_moves_the_voided_steps_to_rolled_back(shared, prefix, tmp_path):
    b = TraceBuilder(n_gpus=2, per_host=2, job="resumed", seed=9)
    b.run("start")
    b.stretch("compute", 300, step_s=5)  # steps 1..60
    b.stretch("idle", 30)  # the crash
    b.run("resume", step=40)  # back to the checkpoint after step 40
    b.stretch("compute", 150, step_s=5)  # 41..70
    b.run("end")
    b.stretch("idle", 5)
    [csv] = write_nvidia_smi_csv(b.samples(), tmp_path / "t")
    expected, offline = offline_ms(b)
    # The resume arrives only after steps 41..60 were booked as valid: the agent must correct.
    resume_ts = next(e.ts for e in b.events if e.type == "run" and e.get("state") == "resume")
    everything = b.events
    b.events = [e for e in everything if e.ts < resume_ts]
    post_events(shared, prefix, b)
    step60 = max(e.ts for e in b.events if e.type == "step")
    p = serve(csv, "node0", SHARED_URL, prefix, 0)
    try:
        wait_booked(shared, prefix, b.job, ["node0"], int(step60 * 1000))
        b.events = [e for e in everything if e.ts >= resume_ts]
        post_events(shared, prefix, b)
        wait_booked(shared, prefix, b.job, ["node0"], offline.timeline.end_ms)
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(30)
    total = ledger.read_amounts(shared, prefix, b.job)
    assert ledger.net_ms(total) == expected
    assert total["rolled_back:ms"] == expected["rolled_back"] == 2 * 100_000  # steps 41..60: 100 s x 2 GPUs
    assert total["voided:productive:ms"] == expected["rolled_back"]
    figures = shared.hgetall(keys.figures_key(prefix, b.job))
    assert (int(figures["steps_voided"]), int(figures["valid_steps"])) == (20, 70)


def test_sim_source_trainer_posts_through_the_reporter_and_the_agent_books_it(shared, prefix):
    from costexporter.sources.synth import scenario_mini

    b = scenario_mini()
    expected, offline = offline_ms(b)
    p = spawn_cli(
        "serve",
        "--source",
        "sim",
        "--scenario",
        "mini",
        "--redis-url",
        SHARED_URL,
        "--prefix",
        prefix,
        "--port",
        "0",
        "--speed",
        "200",
        "--book-interval",
        "0.2",
        "--sample-interval",
        "0.1",
        "--agent-id",
        "sim",
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            f = shared.hgetall(keys.figures_key(prefix, b.job))
            if f.get("ended") == "1":
                wm = ledger.load_watermark(shared, prefix, b.job, "sim")
                if wm and wm["booked_until"] >= int(float(f["last_step_ts"]) * 1000):
                    break
            time.sleep(0.2)
        else:
            raise AssertionError("the simulated job was not booked to its end")
    finally:
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
    assert p.returncode == 0, err[-2000:]
    got = ledger.net_ms(ledger.read_amounts(shared, prefix, b.job))
    for cat, ms in expected.items():
        assert got[cat] == pytest.approx(ms, abs=50), cat  # float timestamps: a few ms of rounding
    assert got["stalled"] > 0 and got["no_progress"] > 0 and got["rolled_back"] > 0 and got["starved"] > 0
    assert int(f["steps_completed"]) == len(offline.timeline.steps)
    # The story lies in the past, as the demo's: ended before now, never dated ahead of the
    # clock (a window ending now would miss the future part, and two windows would disagree).
    assert float(f["last_step_ts"]) <= time.time()
    assert wm["booked_until"] <= time.time() * 1000


def test_an_unexpected_error_in_a_round_is_counted_and_the_agent_goes_on(shared, prefix, monkeypatch, caplog):
    import costexporter.services.agent_book as agent_mod

    from .agent_rounds import replay_agent, tick

    b = TraceBuilder(n_gpus=2, per_host=2, job="bumpy", seed=2)
    b.run("start")
    b.stretch("compute", 120, step_s=5)
    b.run("end")
    b.stretch("idle", 5)
    post_events(shared, prefix, b)
    real = agent_mod.book_window
    calls = []

    def flaky(**kw):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug nobody foresaw")
        return real(**kw)

    monkeypatch.setattr(agent_mod, "book_window", flaky)
    agent, now = replay_agent(b, prefix=prefix, agent_id="bumpy", job_refresh_s=0)
    for _ in range(4):
        tick(agent, now, 100)
    assert agent.stats["job_errors"] == 1  # the job's round failed alone, and was booked later
    assert "'bumpy': booking failed; skipped this round" in caplog.text
    total = ledger.net_ms(ledger.read_amounts(shared, prefix, b.job))
    assert total["productive"] > 0


@pytest.mark.parametrize(
    ("meta_price", "granted", "says"),
    [(5.0, False, True), (None, False, False), (5.0, True, False)],
    ids=["meta-ignored", "no-meta-price", "granted"],
)
def test_serve_ignores_a_meta_price_once_per_job_unless_a_rule_grants_it(
    shared, prefix, caplog, meta_price, granted, says
):
    """A trainer's meta price is not the job's: the agent books the operator's price, and says
    once per job (however many rounds book it) which policy key would trust it; a rule that
    grants the key makes it the job's price, said by nothing."""
    import logging

    from costexporter.core.cost import Prices
    from costexporter.core.terms import PolicyRule

    from .agent_rounds import replay_agent, tick

    caplog.set_level(logging.INFO, logger="costexporter.agent")
    job = f"priced-{uuid.uuid4().hex[:6]}"
    b = TraceBuilder(n_gpus=2, per_host=2, job=job, seed=4)
    if meta_price is not None:
        b.meta(price_per_gpu_hour=meta_price)
    b.run("start")
    b.stretch("compute", 240, step_s=5)
    b.run("end")
    b.stretch("idle", 5)
    post_events(shared, prefix, b)
    rules = (PolicyRule(job="priced-*", grants=("price_per_gpu_hour",)),) if granted else ()
    agent, now = replay_agent(
        b,
        prefix=prefix,
        agent_id="priced",
        job_refresh_s=0,
        prices=Prices(price_per_gpu_hour=2.0),
        policy_rules=rules,
    )
    for _ in range(6):
        tick(agent, now, 50)
    assert agent.booker.stats["rounds"] >= 3  # several rounds booked the job: the note is still said once
    note = f"job {job}: its meta sets price_per_gpu_hour, which only the operator sets"
    assert caplog.text.count("grant_meta: [price_per_gpu_hour]") == (1 if says else 0), caplog.text
    assert (note in caplog.text) == says
    assert ((job, "price_per_gpu_hour") in agent.meta_ignored) == says
    total = ledger.read_amounts(shared, prefix, job)
    ms = sum(total.get(f"{c}:ms", 0) for c in CATEGORIES)
    cost = sum(total.get(f"{c}:ucost", 0) for c in CATEGORIES) / 1e6
    assert ms > 0 and cost == pytest.approx(ms / 3.6e6 * (meta_price if granted else 2.0), rel=1e-3)


def test_every_counter_of_a_job_is_exported_at_zero_from_its_first_round(shared, prefix):
    """rate()/increase() see the first rollback only if the series existed at 0 before it."""
    from prometheus_client import generate_latest

    from costexporter.services.exporter import registry_for

    from .agent_rounds import replay_agent, tick

    b = TraceBuilder(n_gpus=2, per_host=2, job="fresh", seed=3)
    b.run("start")
    b.stretch("compute", 300, step_s=5)
    post_events(shared, prefix, b)
    agent, now = replay_agent(b, prefix=prefix, agent_id="fresh", job_refresh_s=0)
    tick(agent, now, 30)
    assert agent.booker.stats["rounds"] == 1
    families = {
        f.name: {tuple(sorted(s.labels.items())): s.value for s in f.samples}
        for f in text_string_to_metric_families(generate_latest(registry_for(agent)).decode())
    }
    for fam in ("costexporter_voided_gpu_time_seconds", "costexporter_voided_cost"):
        cats = {
            dict(k)["category"]: v for k, v in families[fam].items() if dict(k)["training_job"] == "fresh"
        }
        assert cats and set(cats) == set(CATEGORIES) - {"unassigned"}, fam
        assert set(cats.values()) == {0.0}, fam
    for fam in ("costexporter_job_steps_voided", "costexporter_job_steps_completed"):
        assert families[fam][(("training_job", "fresh"),)] >= 0, fam
    assert families["costexporter_job_steps_voided"][(("training_job", "fresh"),)] == 0
    assert families["costexporter_agent_conflicts"][()] == 0
    assert families["costexporter_redis_epoch_resets"][()] == 0


@pytest.mark.parametrize(("just_after_ms", "far_ahead_s"), [(1, 100), (258, 150), (4_000, 120), (9_999, 200)])
def test_a_register_newer_than_the_last_sample_bills_from_its_own_time_not_before(
    shared, prefix, just_after_ms, far_ahead_s
):
    """A register stamped a few ms after the agent's newest sample (it came between two sampling
    rounds, as a Kubernetes pod's does) starts the GPU's time at the register, never earlier:
    the time before it is nobody's job. Only a register dated past `clock_skew_warn_s` (a clock
    ahead) starts at the newest sample."""
    from .agent_rounds import replay_agent, tick

    job = f"between-{uuid.uuid4().hex[:6]}"
    b = TraceBuilder(n_gpus=2, per_host=2, job=job, seed=9, register=False)
    b.stretch("idle", 200)
    agent, now = replay_agent(b, prefix=prefix, agent_id=job, job_refresh_s=0, clock_skew_warn_s=10.0)

    def play(seconds: float) -> None:
        tick(agent, now, seconds)

    play(60)
    regs = {0: agent.samples.newest[0] + just_after_ms, 1: agent.samples.newest[1] + far_ahead_s * 1000}
    send_entries(
        shared,
        prefix,
        job,
        [
            protocol.encode_fields(
                {
                    "v": "1",
                    "type": "register",
                    "job": job,
                    "ts": f"{regs[r] / 1000:.3f}",
                    "rank": r,
                    "session": f"s{r}",
                    "seq": 0,
                    "host": "node0",
                    "gpu": r,
                    "gpu_uuid": b.uuid(r),
                    "pid": 1,
                }
            )
            for r in (0, 1)
        ],
    )
    play(1)  # one more sample, still before both registers: the agent books the job now
    assert agent.samples.newest[1] < regs[1] - 10_000
    for _ in range(4):
        play(20)
    starts = agent.jobs[job].state.starts
    assert starts[0] == regs[0]  # not the sample before it
    assert starts[1] < regs[1] and starts[1] <= agent.samples.newest[1]  # the clock ahead is bounded
    wm = ledger.load_watermark(shared, prefix, job, agent.cfg.agent_id)["booked_until"]
    total = sum(ledger.net_ms(ledger.read_amounts(shared, prefix, job)).values())
    assert total == sum(wm - s for s in starts.values())


def test_samples_held_while_redis_is_unreachable_are_bounded_and_the_overflow_counted():
    """Redis down for long: the agent holds at most `max_buffered_samples` (the newest), counts
    what it dropped, and each round fails as a Redis error, never blocking or raising."""
    from .agent_rounds import replay_agent

    b = TraceBuilder(n_gpus=2, per_host=2, job="held", seed=3)
    b.run("start")
    b.stretch("compute", 120, step_s=5)
    agent, now = replay_agent(b, redis_url=f"redis://127.0.0.1:{free_port()}/0", max_buffered_samples=50)
    fed = []
    for _ in range(10):
        now[0] += 10
        readings = agent.source.read()
        fed += [round(r.ts * 1000) for r in readings]
        agent.sampler._buf.extend(readings)
        agent.tick()
    held = np.sort(agent.samples.arrays()[1])
    assert len(fed) > 50 and agent.sampler.dropped == 0
    assert held.tolist() == sorted(fed)[-50:]  # the newest 50
    assert agent.samples.stats["samples_dropped"] == len(fed) - 50
    assert agent.stats["redis_errors"] == 10 and not agent.redis_up
