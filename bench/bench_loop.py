"""The reporter's cost in a fast training loop: python bench/bench_loop.py [--steps N] [--rounds R]

A loop of about 170 us of pure-Python CPU work per step (calibrated first), N steps (20,000), run
bare and with each way of reporting it, interleaved round by round (bare, StepReporter, the
Hugging Face callback, the Lightning callback; the order rotates each round) against the local
Redis (127.0.0.1:6379, or COSTEXPORTER_REDIS_URL) under a private prefix. A reporter's run
includes its sender thread's work until every step is in the stream (flush), and the stream is
then read back: every step must be there exactly once.

Prints, per variant, the median over rounds of its overhead against the bare loop of the same
round, by process CPU time (every thread) and by wall clock; beside them the sender thread's own
CPU time (its thread clock) as a share of the bare loop's; the hot path's cost (each call timed
in a separate run, the mean of the fastest 99%: its CPU without the machine's preemptions);
their sum, "attributed"; and `step()`'s latency p50/p99 from that run (target p99 <= 10 us).

Whole runs a few seconds apart differ by +-10% of process CPU on a shared machine (a bare loop
against itself: the "bare again" row), five times the target. So the target (<= 2% process CPU)
is judged on the paired measure: one reporter per variant, its loop cut into chunks of ~300
steps run alternately bare and reporting (the order alternating), each timed by process CPU
(every thread); every tenth reporting chunk ends with the sender's send of what those ten
queued, waited for inside the chunk, so each send's CPU is counted, once per 0.5 s of reporting
work (the sender's interval at this step time) whatever the machine's load. The overhead is the
median over blocks of ten pairs of (reporting CPU / bare CPU - 1); "paired, bare" is the same
procedure with nothing reported, its error; "an empty call" the loop with a call that does
nothing in the reporter's place, the floor a Python call sets.

The callbacks are driven as their frameworks drive them, one call per optimizer step with the
frameworks' own state objects where they are cheap to build (transformers' TrainerState and
TrainerControl); Lightning's Trainer is stood in for by an object with the attributes the
callback reads (global_step, global_rank, ...), since a real one cannot run a 170 us step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import types
import uuid

import redis

from costexporter.store import protocol
from costexporter.store.reader import EventReader
from costexporter.trainer.reporter import StepReporter

TARGET_CPU = 0.02  # process CPU overhead
TARGET_P99_US = 10.0
NOISE_OK = 0.01  # the paired measure's error past which its verdicts are called unresolved
TOKENS = 4096


def make_work(us: float):
    """A pure-Python function taking about `us` microseconds of CPU (it holds the GIL, as a
    trainer's Python between kernels does)."""

    def work(n: int) -> int:
        x = 0
        for i in range(n):
            x += i * i
        return x

    n = 1000
    while True:
        t = time.process_time()
        for _ in range(50):
            work(n)
        per = (time.process_time() - t) / 50
        if per > 0.002:
            break
        n *= 2
    n = max(1, int(n * us / 1e6 / per))
    return lambda: work(n)


class Run:
    def __init__(self, url: str, prefix: str, spool: str) -> None:
        self.url, self.prefix, self.spool = url, prefix, spool
        self.client = redis.Redis.from_url(url, decode_responses=True)
        self.jobs: list[str] = []

    def kwargs(self, **kw: object) -> dict:
        return {
            "redis_url": self.url,
            "prefix": self.prefix,
            "spool_dir": self.spool,
            "heartbeat_s": 3600,
            **kw,
        }

    def job(self, name: str) -> str:
        j = f"{name}-{len(self.jobs)}"
        self.jobs.append(j)
        return j

    def check(self, job: str, steps: int) -> None:
        """Every step posted is in the stream, once."""
        got = [e for e in EventReader(self.client, job, self.prefix).read_all() if e.type == "step"]
        nums = [e.int_field("step") for e in got]
        if nums != list(range(1, steps + 1)):
            raise SystemExit(f"{job}: {len(nums)} steps read back, {steps} posted: events were lost")

    def bare(self, work, steps: int) -> None:
        for _ in range(1, steps + 1):
            work()

    def reporter(self, work, steps: int, **kw: object) -> tuple[StepReporter, str]:
        job = self.job("loop-rep")
        rep = StepReporter(job, rank=0, **self.kwargs(**kw))
        return rep, job

    def hf(self, steps: int, **kw: object):
        from transformers import TrainerControl, TrainerState, TrainingArguments

        from costexporter.integrations.hf import CostExporterCallback

        job = self.job("loop-hf")
        args = TrainingArguments(output_dir=self.spool, run_name=job, report_to=[], use_cpu=True)
        cb = CostExporterCallback(job=job, **self.kwargs(**kw))
        state, control = TrainerState(), TrainerControl()
        cb.on_train_begin(args, state, control)
        return cb, args, state, control, job

    def lightning(self, **kw: object):
        from costexporter.integrations.lightning import CostExporterLightningCallback

        job = self.job("loop-pl")
        trainer = types.SimpleNamespace(
            global_step=0,
            global_rank=0,
            local_rank=0,
            world_size=1,
            sanity_checking=False,
            default_root_dir=self.spool,
            save_checkpoint=lambda *a, **k: None,
        )
        cb = CostExporterLightningCallback(job=job, tokens_per_batch=lambda b: TOKENS, **self.kwargs(**kw))
        cb.on_fit_start(trainer, None)
        cb.on_train_start(trainer, None)
        return cb, trainer, job


def timed(fn, rep: StepReporter | None = None) -> tuple[float, float, float]:
    """(process CPU, wall, the sender thread's own CPU) of fn() in seconds."""
    clock = time.pthread_getcpuclockid(rep._thread.ident) if rep is not None and rep._thread.ident else None
    s = time.clock_gettime(clock) if clock is not None else 0.0
    c, w = time.process_time(), time.perf_counter()
    fn()
    c, w = time.process_time() - c, time.perf_counter() - w
    return c, w, (time.clock_gettime(clock) - s) if clock is not None else 0.0


def one(run: Run, variant: str, work, steps: int) -> tuple[float, float, float]:
    if variant == "bare":
        return timed(lambda: run.bare(work, steps))
    if variant == "StepReporter":
        rep, job = run.reporter(work, steps)

        def loop() -> None:
            step = rep.step
            for s in range(1, steps + 1):
                work()
                step(s, tokens=TOKENS)
            rep.flush(60)

        out = timed(loop, rep)
        rep.close(end_run=False)
    elif variant == "HF callback":
        cb, args, state, control, job = run.hf(steps)

        def loop() -> None:
            on_step_end = cb.on_step_end
            for s in range(1, steps + 1):
                work()
                state.global_step = s
                state.num_input_tokens_seen = s * TOKENS
                on_step_end(args, state, control)
            cb.reporter.flush(60)

        out = timed(loop, cb.reporter)
        cb.reporter.close(end_run=False)
    else:
        cb, trainer, job = run.lightning()

        def loop() -> None:
            on_batch_end = cb.on_train_batch_end
            for s in range(1, steps + 1):
                work()
                trainer.global_step = s
                on_batch_end(trainer, None, None, None, s - 1)
            cb.reporter.flush(60)

        out = timed(loop, cb.reporter)
        cb.reporter.close(end_run=False)
    run.check(job, steps)
    return out


def _empty(step: int, tokens: int | None = None) -> None:
    """A call that does nothing, in the reporter's place: the paired measure's floor."""


def paired(run: Run, variant: str, work, blocks: int, per_send: int, pairs: int = 10) -> float:
    """The median over blocks of (reporting CPU / bare CPU - 1), chunks alternating (module doc).
    The reporter's sender sends only when asked: at the end of each block's last reporting chunk,
    waited for there, so its CPU falls in that chunk."""
    n = max(1, per_send // pairs)
    hold = {"flush_interval_s": 3600.0}  # no send of its own: the bench asks for each one
    state = trainer = None
    if variant == "StepReporter":
        rep, job = run.reporter(work, 0, **hold)
    elif variant == "HF callback":
        cb, args, state, control, job = run.hf(0, **hold)
        rep = cb.reporter
    elif variant == "Lightning callback":
        cb, trainer, job = run.lightning(**hold)
        rep = cb.reporter
    else:
        rep, job = None, ""
    if rep is not None:
        rep.flush(60)  # register and run start: not the loop's
    step = rep.step if rep is not None else None
    s = 0

    def reporting(send: bool) -> float:
        nonlocal s
        c = time.process_time()
        if variant == "StepReporter":
            for k in range(s + 1, s + n + 1):
                work()
                step(k, tokens=TOKENS)
        elif variant == "HF callback":
            on_step_end = cb.on_step_end
            for k in range(s + 1, s + n + 1):
                work()
                state.global_step = k
                state.num_input_tokens_seen = k * TOKENS
                on_step_end(args, state, control)
        elif variant == "Lightning callback":
            on_batch_end = cb.on_train_batch_end
            for k in range(s + 1, s + n + 1):
                work()
                trainer.global_step = k
                on_batch_end(trainer, None, None, None, k - 1)
        elif variant == "paired, empty call":
            for k in range(s + 1, s + n + 1):
                work()
                _empty(k, tokens=TOKENS)
        else:
            for _ in range(n):
                work()
        if send and rep is not None:
            rep.flush(60)
        s += n
        return time.process_time() - c

    def bare() -> float:
        c = time.process_time()
        for _ in range(n):
            work()
        return time.process_time() - c

    ratios = []
    for b in range(blocks):
        rt = bt = 0.0
        for p in range(pairs):
            if (b + p) % 2:
                bt += bare()
                rt += reporting(p == pairs - 1)
            else:
                rt += reporting(p == pairs - 1)
                bt += bare()
        ratios.append(rt / bt - 1)
    if rep is not None:
        rep.close(end_run=False)
        run.check(job, s)
    return statistics.median(ratios)


def _nothing(step: int, tokens: int | None = None) -> None:
    """A call that does nothing, timed as `step()` is: the machine's own floor for a p99."""


EMPTY_P99: list[float] = []  # the empty call's p99 of each StepReporter latency run


def latency(run: Run, variant: str, work, steps: int) -> tuple[float, float, float]:
    """The hot path's call, timed one by one in a loop with its work between: p50, p99 and the
    mean of the fastest 99% (its CPU cost, without the machine's preemptions), microseconds.
    For `step()` an empty call is timed the same way right after it, each step (`EMPTY_P99`):
    a loaded machine's preemptions and page faults reach both alike."""
    lat = []
    if variant == "StepReporter":
        rep, _job = run.reporter(work, steps)
        empty = []
        for s in range(1, steps + 1):
            work()
            t = time.perf_counter_ns()
            rep.step(s, tokens=TOKENS)
            t1 = time.perf_counter_ns()
            _nothing(s, tokens=TOKENS)
            t2 = time.perf_counter_ns()
            lat.append(t1 - t)
            empty.append(t2 - t1)
        empty.sort()
        EMPTY_P99.append(empty[int(0.99 * len(empty))] / 1000)
    elif variant == "HF callback":
        cb, args, state, control, _job = run.hf(steps)
        rep = cb.reporter
        for s in range(1, steps + 1):
            work()
            state.global_step = s
            state.num_input_tokens_seen = s * TOKENS
            t = time.perf_counter_ns()
            cb.on_step_end(args, state, control)
            lat.append(time.perf_counter_ns() - t)
    else:
        cb, trainer, _job = run.lightning()
        rep = cb.reporter
        for s in range(1, steps + 1):
            work()
            trainer.global_step = s
            t = time.perf_counter_ns()
            cb.on_train_batch_end(trainer, None, None, None, s - 1)
            lat.append(time.perf_counter_ns() - t)
    rep.close(end_run=False)
    lat.sort()
    fast = lat[: int(0.99 * len(lat))]
    return lat[len(lat) // 2] / 1000, lat[int(0.99 * len(lat))] / 1000, sum(fast) / len(fast) / 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20_000, help="steps per run")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (the median is printed)")
    ap.add_argument("--work-us", type=float, default=170.0, help="CPU work per step, microseconds")
    ap.add_argument("--only", default="", help="comma-separated variants to run besides bare")
    ap.add_argument(
        "--blocks", type=int, default=20, help="blocks of the paired measure (each ~1 s of CPU per variant)"
    )
    a = ap.parse_args()
    url = os.environ.get("COSTEXPORTER_REDIS_URL", protocol.DEFAULT_REDIS_URL)
    run = Run(url, f"bench-loop-{uuid.uuid4().hex[:8]}", tempfile.mkdtemp())
    variants = ["StepReporter", "HF callback", "Lightning callback"]
    if a.only:
        variants = [v for v in variants if v.split()[0].lower() in a.only.lower().split(",")]
    work = make_work(a.work_us)
    t = time.process_time()
    for _ in range(200):
        work()
    per_us = (time.process_time() - t) / 200 * 1e6
    print(f"work per step: {per_us:.0f} us CPU; {a.steps} steps; {a.rounds} rounds; Redis {url}")
    ratios: dict[str, list[tuple[float, float, float]]] = {v: [] for v in variants}
    bares: list[tuple[float, float, float]] = []
    again: list[float] = []  # a second bare run against the first: the whole-run measure's noise
    try:
        for r in range(a.rounds):
            order = ["bare", *variants, "bare again"]
            order = order[r % len(order) :] + order[: r % len(order)]
            got = {v: one(run, "bare" if v == "bare again" else v, work, a.steps) for v in order}
            b = got["bare"]
            bares.append(b)
            again.append(got["bare again"][0] / b[0] - 1)
            for v in variants:
                ratios[v].append((got[v][0] / b[0] - 1, got[v][1] / b[1] - 1, got[v][2] / b[0]))
            print(
                f"  round {r + 1}: bare {b[0]:.2f} s CPU; "
                + ", ".join(
                    f"{v} {100 * ratios[v][-1][0]:+.1f}% (sender {100 * ratios[v][-1][2]:.1f}%)"
                    for v in variants
                )
            )
        hot = {v: latency(run, v, work, a.steps) for v in variants}
        per_send = max(1, round(0.5 / (per_us * 1e-6)))  # steps a 0.5-s send interval holds
        pair: dict[str, float] = {}
        for v in ["paired, bare", "paired, empty call", *variants]:
            pair[v] = paired(run, v, work, a.blocks, per_send)
        print()
        print(
            f"{'variant':<20} {'paired CPU':>11} {'whole-run CPU':>14} {'wall':>8} {'sender':>8}"
            f" {'hot path':>9} {'attributed':>11}   target (paired process CPU)"
        )
        b_cpu = statistics.median(x[0] for x in bares) if bares else per_us * 1e-6 * a.steps
        b_wall = statistics.median(x[1] for x in bares) if bares else 0.0
        print(f"{'bare loop':<20} {'':>11} {b_cpu:>12.2f} s {b_wall:>6.2f} s")
        print(
            f"{'bare again':<20} {100 * pair['paired, bare']:>+10.1f}%"
            f" {100 * statistics.median(again) if again else float('nan'):>+13.1f}%"
            "   (each measure's error: nothing reported)"
        )
        empty = pair["paired, empty call"]
        print(f"{'an empty call':<20} {100 * empty:>+10.1f}%   (a call that does nothing)")
        for v in variants:
            cpu = statistics.median(x[0] for x in ratios[v]) if ratios[v] else float("nan")
            wall = statistics.median(x[1] for x in ratios[v]) if ratios[v] else float("nan")
            sender = statistics.median(x[2] for x in ratios[v]) if ratios[v] else float("nan")
            hot_share = hot[v][2] * 1e-6 * a.steps / b_cpu
            att = sender + hot_share
            ok = "MET" if pair[v] <= TARGET_CPU else "MISSED"
            print(
                f"{v:<20} {100 * pair[v]:>+10.1f}% {100 * cpu:>+13.1f}% {100 * wall:>+7.1f}%"
                f" {100 * sender:>7.1f}% {100 * hot_share:>8.1f}% {100 * att:>10.1f}%"
                f"   <= +{100 * TARGET_CPU:.0f}%  {ok}"
            )
        noise = max(abs(pair["paired, bare"]), abs(empty))  # (an empty call's true cost: ~0.05%)
        if noise > NOISE_OK:
            print(
                f"the paired measure's own error this run reached {100 * noise:.1f}% (bare again, an empty"
                " call): verdicts within that of the target are not resolved here; loop_instructions.py"
                " counts what no load moves"
            )
        p50, p99, _mean = (
            hot["StepReporter"] if "StepReporter" in hot else latency(run, "StepReporter", work, a.steps)
        )
        ok = "MET" if p99 <= TARGET_P99_US else "MISSED"
        floor = EMPTY_P99[-1]
        print(
            f"step() latency      p50 {p50:.2f} us, p99 {p99:.2f} us   p99 <= {TARGET_P99_US:.0f} us  {ok}"
            f"   (an empty call timed alike: p99 {floor:.2f} us)"
        )
        if ok == "MISSED" and floor > TARGET_P99_US / 2:
            print(
                "  the empty call's p99 says the machine's preemptions reach the target here:"
                " run it again on a quieter machine"
            )
        print(
            "paired CPU: process CPU (every thread, sends included) of reporting chunks against bare"
            " ones run alternately, median over blocks of ten pairs; whole-run CPU: runs of --steps,"
            " median over rounds; attributed: the sender thread's CPU plus the hot path's calls"
            " (mean of the fastest 99%) as a share of the bare loop's CPU"
        )
    finally:
        keys = list(run.client.scan_iter(match=f"{run.prefix}:*", count=1000))
        for i in range(0, len(keys), 500):
            run.client.delete(*keys[i : i + 500])


if __name__ == "__main__":
    main()
