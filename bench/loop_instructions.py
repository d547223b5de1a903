"""The reporter's cost in a fast training loop, in instructions: python bench/loop_instructions.py

Process CPU on a shared machine moves by several percent from one run to the next; the count of
instructions a run executes does not (valgrind's callgrind counts them, every thread's, however
loaded the machine is). This runs the loop of bench_loop.py under callgrind: bare, and with
`StepReporter.step()`, the Hugging Face callback's `on_step_end` and the Lightning callback's
`on_train_batch_end` (their frameworks stood in for by plain objects with the attributes the
callbacks read: importing transformers under valgrind takes minutes), each for one and for three
send intervals' worth of steps (`--per-send`, 2,941: the sender's 0.5 s at 170 us a step), one
send waited for after each interval's steps, against the local Redis (127.0.0.1:6379, or
COSTEXPORTER_REDIS_URL) under a private prefix. The difference between the two lengths is the
cost of the added steps and sends, start-up and imports cancelled out; the work between steps
is a single loop turn there, and its instructions a step at `--work-us` are counted apart (two
short bare runs with the real work).

Prints per variant the instructions a step over the bare loop's, as a share of a step's work,
next to the target (<= 2%, the process-CPU target read as instructions: a machine's cache and
frequency make a cycle count differ from the instruction count, bench_loop.py measures CPU
time). Needs valgrind; takes a few minutes.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import types
import uuid

TARGET = 0.02
TOKENS = 4096
VARIANTS = ["StepReporter", "HF callback", "Lightning callback"]


def turns_for(us: float) -> int:
    """Loop turns of the work function that take about `us` microseconds of CPU here (the
    fastest of 30 tries: the machine's speed without its neighbours' load)."""
    n = 20_000
    per = float("inf")
    for _ in range(30):
        t = time.process_time()
        _work(n)
        per = min(per, (time.process_time() - t) / n)
    return max(1, round(us * 1e-6 / per))


def _work(n: int) -> int:
    x = 0
    for i in range(n):
        x += i * i
    return x


def child(variant: str, steps: int, per_send: int, turns: int, prefix: str) -> None:
    """One run under valgrind: `steps` steps, a send waited for after every `per_send`."""
    # Stand-ins for the frameworks' base classes (the callbacks subclass them, nothing more).
    for name, attr in (("transformers", "TrainerCallback"), ("lightning.pytorch", "Callback")):
        mod = types.ModuleType(name)
        setattr(mod, attr, object)
        sys.modules[name] = mod
    top = sys.modules["lightning"] = types.ModuleType("lightning")
    top.pytorch = sys.modules["lightning.pytorch"]  # type: ignore[attr-defined]
    from costexporter.trainer.reporter import StepReporter

    kw = {"prefix": prefix, "spool_dir": tempfile.mkdtemp(), "heartbeat_s": 3600, "flush_interval_s": 3600}
    rep = None
    if variant == "bare":
        for s in range(1, steps + 1):
            _work(turns)
            if s % per_send == 0:
                pass
        return
    if variant == "StepReporter":
        rep = StepReporter("loop-instr", rank=0, **kw)
        rep.flush(60)
        step = rep.step
        for s in range(1, steps + 1):
            _work(turns)
            step(s, tokens=TOKENS)
            if s % per_send == 0:
                rep.flush(60)
    elif variant == "HF callback":
        from costexporter.integrations.hf import CostExporterCallback

        args = types.SimpleNamespace(
            run_name="loop-instr-hf", process_index=0, local_process_index=0, world_size=1
        )
        state = types.SimpleNamespace(global_step=0, num_input_tokens_seen=0, is_world_process_zero=True)
        control = types.SimpleNamespace(should_evaluate=False, should_save=False)
        cb = CostExporterCallback(job="loop-instr-hf", **kw)
        cb.on_train_begin(args, state, control)
        rep = cb.reporter
        rep.flush(60)
        on_step_end = cb.on_step_end
        for s in range(1, steps + 1):
            _work(turns)
            state.global_step = s
            state.num_input_tokens_seen = s * TOKENS
            on_step_end(args, state, control)
            if s % per_send == 0:
                rep.flush(60)
    else:
        from costexporter.integrations.lightning import CostExporterLightningCallback

        trainer = types.SimpleNamespace(
            global_step=0, global_rank=0, local_rank=0, world_size=1, sanity_checking=False,
            default_root_dir="/tmp", save_checkpoint=lambda *a, **k: None,
        )  # fmt: skip
        lcb = CostExporterLightningCallback(job="loop-instr-pl", tokens_per_batch=lambda b: TOKENS, **kw)
        lcb.on_fit_start(trainer, None)
        lcb.on_train_start(trainer, None)
        rep = lcb.reporter
        rep.flush(60)
        on_batch_end = lcb.on_train_batch_end
        for s in range(1, steps + 1):
            _work(turns)
            trainer.global_step = s
            on_batch_end(trainer, None, None, None, s - 1)
            if s % per_send == 0:
                rep.flush(60)
    assert rep is not None
    rep.close(end_run=False)
    if rep.stats["sent"] != steps + 2:  # the steps, the register and the run start
        raise SystemExit(f"{variant}: {rep.stats['sent']} events sent, {steps + 2} posted")


def counted(args: list[str]) -> int:
    """Instructions of one child run under callgrind, every thread."""
    cmd = [
        "valgrind",
        "--tool=callgrind",
        "--callgrind-out-file=/dev/null",
        sys.executable,
        __file__,
        "--child",
        *args,
    ]
    # No BLAS worker threads (their spin-waits count instructions by the wall clock) and one hash
    # seed: the same code counts the same instructions from run to run.
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    m = re.search(r"Collected : (\d+)", out.stderr)
    if m is None:
        raise SystemExit(f"no instruction count from callgrind:\n{out.stderr[-2000:]}")
    return int(m.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-send", type=int, default=2941, help="steps a send carries (0.5 s at 170 us)")
    ap.add_argument("--work-us", type=float, default=170.0, help="CPU work per step, microseconds")
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        v, steps, per_send, turns, prefix = a.child
        child(v, int(steps), int(per_send), int(turns), prefix)
        return
    import redis

    from costexporter.store import protocol

    url = os.environ.get("COSTEXPORTER_REDIS_URL", protocol.DEFAULT_REDIS_URL)
    prefix = f"bench-instr-{uuid.uuid4().hex[:8]}"
    turns = turns_for(a.work_us)
    k = a.per_send
    try:
        # A step's work, in instructions: two short bare runs with the real work.
        w1, w2 = (counted(["bare", str(n), str(k), str(turns), prefix]) for n in (100, 300))
        work = (w2 - w1) / 200
        base = {}
        for v in ["bare", *VARIANTS]:
            i1, i3 = (counted([v, str(n), str(k), "1", prefix]) for n in (k, 3 * k))
            base[v] = (i3 - i1) / (2 * k)
        print(
            f"work per step: {work:,.0f} instructions ({turns} turns, ~{a.work_us:.0f} us); {k} steps a send"
        )
        print(f"{'variant':<20} {'instructions a step over bare':>30} {'share of a step':>16}   target")
        for v in VARIANTS:
            extra = base[v] - base["bare"]
            ok = "MET" if extra / work <= TARGET else "MISSED"
            print(f"{v:<20} {extra:>30,.0f} {100 * extra / work:>15.2f}%   <= {100 * TARGET:.0f}%  {ok}")
    finally:
        client = redis.Redis.from_url(url)
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            client.delete(*keys)


if __name__ == "__main__":
    main()
