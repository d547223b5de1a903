"""Agent benchmark: python bench/bench_agent.py [--seconds S] [--redis-url URL]

* CPU of `costexporter serve`'s agent (in a process of its own) sampling 8 GPUs at 10 Hz through
  the fake NVML of the tests, booking a job whose trainer posts a step a second to the Redis of
  --redis-url ($COSTEXPORTER_REDIS_URL, else the local one): target <= 1% of one core. Measured
  in the steady state: the window opens after the agent's first two rounds (the first discovers
  the job and reads its registrations).
* /metrics right after a booking round for 8 GPUs and 10, 64 and 1,000 jobs (target p99 <= 5 ms
  at 64 jobs, <= 20 ms at 1,000): served as the agent's thread wrote its job families after the
  round, beside the scrape building and writing them itself (as before), and the agent thread's
  cost per round; the series count per job; with the long-lived state frozen out of the garbage
  collector's walks as `serve` does (services/gcstate.py), the collector left on.
"""

from __future__ import annotations

import argparse
import gzip
import multiprocessing
import os
import resource
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import redis  # noqa: E402

from costexporter.core.model import Category  # noqa: E402
from costexporter.services.agent import Agent, AgentConfig, _Job  # noqa: E402
from costexporter.trainer.reporter import StepReporter  # noqa: E402

UUIDS = [f"GPU-{i:08x}-aaaa-bbbb-cccc-{i:012x}" for i in range(8)]


def _fake_source():
    import pynvml

    from costexporter.sources.nvml import NvmlSource
    from tests.fake_nvml import FakeGpu, FakeNvml

    class _Patch:  # the minimum of pytest's monkeypatch that FakeNvml.install needs
        def setattr(self, obj, name, value):
            setattr(obj, name, value)

    FakeNvml([FakeGpu(u) for u in UUIDS]).install(_Patch())
    assert pynvml.nvmlDeviceGetCount() == 8
    return NvmlSource(host="bench-node")


WARM_ROUNDS = 2  # the first discovers the job and reads its registrations: not the steady state


def _agent_process(prefix: str, seconds: float, url: str, out) -> None:
    from costexporter.services.gcstate import FrozenState

    agent = Agent(
        _fake_source(),
        AgentConfig(
            redis_url=url, prefix=prefix, agent_id="bench-node", book_interval_s=5.0, sample_interval_s=0.1
        ),
    ).start()
    frozen = FrozenState()  # as `serve` runs it
    rounds = [0]

    def warm() -> bool:
        frozen.after_round()
        rounds[0] += 1
        return rounds[0] >= WARM_ROUNDS

    agent.run(until=warm)
    r0, reads0 = agent.booker.stats["rounds"], agent.sampler.reads
    t0, c0 = time.monotonic(), time.process_time()

    def steady() -> bool:
        frozen.after_round()
        return time.monotonic() - t0 > seconds

    agent.run(until=steady)
    wall, cpu = time.monotonic() - t0, time.process_time() - c0
    out.put(
        {
            "wall_s": wall,
            "cpu_s": cpu,
            "rounds": agent.booker.stats["rounds"] - r0,
            "reads": agent.sampler.reads - reads0,
        }
    )
    agent.shutdown()


def cpu(seconds: float, url: str) -> dict:
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    reps = [
        StepReporter(
            "bench-job",
            url,
            prefix=prefix,
            rank=r,
            local_rank=r,
            world_size=8,
            host="bench-node",
            gpu_uuid=UUIDS[r],
            gpu_index=r,
            spool_dir=tempfile.mkdtemp(),
        )
        for r in range(8)
    ]
    for rep in reps:
        rep.flush(5)
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_agent_process, args=(prefix, seconds, url, q))
    proc.start()
    step = 0
    t0 = time.monotonic()
    while proc.is_alive() and time.monotonic() - t0 < seconds + 60:
        step += 1
        reps[0].step(step, tokens=4096)
        time.sleep(1.0)
        if not q.empty():
            break
    res = q.get(timeout=60)
    proc.join(30)
    for rep in reps:
        rep.close()
    r = redis.Redis.from_url(url)
    keys = list(r.scan_iter(f"{prefix}:*"))
    if keys:
        r.delete(*keys)
    return res


# /metrics as served: the job families built and written once a round in the agent's thread
# (`AgentCollector.prepare`, what `serve` calls after each round), the scrape joining them to the
# per-GPU gauges it renders fresh; beside it the scrape as it was, building and writing every
# family itself after each round (still what a scrape does when no round has prepared them).
SCRAPES = {
    "OpenMetrics scrape (served as written)": "prepared",
    "OpenMetrics scrape, families built in it": "built",
    "OpenMetrics + gzip (Prometheus' scrape)": "gzip",
    "the same, built and gzip.compress'd in it": "gzip built",
    "text 0.0.4 scrape (first of the round)": "text",
}


def render(url: str, n_jobs: int = 10, iterations: int = 300) -> dict[str, list[float]]:
    """Milliseconds per /metrics body by way of serving it, the ways interleaved, each right
    after a booking round; and the agent thread's `prepare` per round."""
    from costexporter.services.exporter import agent_registry
    from costexporter.services.exposition import GZIPPED, generate_openmetrics, generate_text
    from costexporter.services.gcstate import FrozenState
    from costexporter.store.reader import EventReader

    agent = Agent(_fake_source(), AgentConfig(redis_url=url, agent_id="bench-node"))
    agent.sampler.source.read()
    for r in agent.sampler.source.read():
        agent.sampler._latest[r.gpu] = r
    rng = np.random.default_rng(0)
    for j in range(n_jobs):
        job = _Job(f"job-{j}", EventReader(agent.redis, f"job-{j}"))
        job.own = {r: (j + r) % 8 for r in range(8)}
        job.state.booked = rng.integers(0, 10**9, (len(Category), 3))
        job.figures = {
            "steps_completed": 1000,
            "steps_voided": 10,
            "valid_steps": 990,
            "tokens": 10**9,
            "last_step": 1000,
            "last_step_ts": time.time(),
            "last_checkpoint_ts": time.time(),
            "stall_threshold_s": 60.0,
            "ended": 0,
        }
        job.latest_band = {r: 0 for r in range(8)}
        agent.jobs[job.name] = job
    reg, collector = agent_registry(agent)
    generate_openmetrics(reg)  # the first scrape builds the families
    FrozenState().after_round()  # what `serve` does after its first round
    times: dict[str, list[float]] = {k: [] for k in [*SCRAPES, "prepare"]}
    for _ in range(iterations):
        for k, way in SCRAPES.items():
            agent.booker.stats["rounds"] += 1  # a round has just booked: the job families change
            if "built" not in way:
                t = time.perf_counter()
                collector.prepare()
                if way == "prepared":
                    times["prepare"].append((time.perf_counter() - t) * 1000)
            t = time.perf_counter()
            if way == "gzip":
                GZIPPED[generate_openmetrics](reg)
            elif way == "gzip built":  # as the library serves it: the body, then gzip.compress
                gzip.compress(generate_openmetrics(reg))
            else:
                (generate_text if way == "text" else generate_openmetrics)(reg)
            times[k].append((time.perf_counter() - t) * 1000)
    samples = sum(len(m.samples) for m in reg.collect())
    times["samples"] = [float(samples)]
    return times


def verdict(ok: bool) -> str:
    return "MET" if ok else "MISSED"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument(
        "--redis-url", default=os.environ.get("COSTEXPORTER_REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    a = ap.parse_args()
    c = cpu(a.seconds, a.redis_url)
    sizes = {10: 300, 64: 200, 1000: 20}
    runs = {n: render(a.redis_url, n, it) for n, it in sizes.items()}
    share = 100 * c["cpu_s"] / c["wall_s"]
    print(
        f"agent benchmark: 8 GPUs x 10 Hz (fake NVML), {c['wall_s']:.0f} s steady state, "
        f"{c['rounds']} booking rounds, {c['reads']} reads"
    )
    print(
        f"  agent CPU          {share:6.2f}% of one core ({c['cpu_s']:.2f} s CPU)   "
        f"target <= 1%: {verdict(share <= 1)}"
    )
    print("  /metrics right after a booking round (8 GPUs; the ways interleaved), ms:")
    targets = {64: 5.0, 1000: 20.0}
    for n, t in runs.items():
        print(f"    {n:,} jobs ({t['samples'][0]:,.0f} samples a body):")
        for k in [*SCRAPES, "prepare"]:
            xs = sorted(t[k])
            p50, p99 = statistics.median(xs), xs[min(len(xs) - 1, int(0.99 * len(xs)))]
            goal = ""
            if SCRAPES.get(k) in ("prepared", "gzip") and n in targets:
                goal = f"   target p99 <= {targets[n]:g} ms: {verdict(p99 <= targets[n])}"
            what = "prepare, the agent's thread, per round" if k == "prepare" else k
            print(f"      {what:42s} p50 {p50:7.2f}  p99 {p99:7.2f}{goal}")
    per_job = (runs[1000]["samples"][0] - runs[10]["samples"][0]) / 990
    print(
        f"  series per job on an agent: {per_job:.0f} (any history); an agent holding 1k / 10k / 100k "
        f"jobs: {1000 * per_job:,.0f} / {10_000 * per_job:,.0f} / {100_000 * per_job:,.0f} series"
    )
    print(f"  peak RSS of this process {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
    main()
