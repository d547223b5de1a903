"""Regenerate the example trace: python examples/make_example.py

An hour of a job on 8 B300 GPUs over two hosts, sampled every 5 s like
`nvidia-smi --query-gpu=timestamp,index,uuid,power.draw,utilization.gpu --format=csv -lms 5000`:
healthy compute, a communication-bound stretch, a data-starved stretch with a straggler,
a checkpoint, more compute, then the R1 deadlock (rank 3 at 0%) until the watchdog kills it.
"""

from pathlib import Path

from costexporter.sources.synth import TraceBuilder, write_nvidia_smi_csv

here = Path(__file__).parent / "r1-mini"
b = TraceBuilder(n_gpus=8, per_host=4, interval_s=5.0, job="qwen3-mini", seed=7)
b.meta(gpu_model="NVIDIA B300")  # data; the price and the owner are the operator's (--policy)
b.run("start")
b.stretch("compute", 20 * 60, step_s=5.0, tokens=262_144)
b.stretch("communication", 5 * 60, step_s=10.0, tokens=262_144)
b.stretch("starvation", 5 * 60, step_s=10.0, tokens=262_144, straggler=5)
b.phase("checkpoint", "begin")
b.stretch("checkpoint", 2 * 60, zero_ranks=(0,))
b.phase("checkpoint", "end", step=b.step)
b.stretch("compute", 10 * 60, step_s=5.0, tokens=262_144)
b.phase("checkpoint", "begin", rank=3, step=b.step)
b.stretch("deadlock", 18 * 60, zero_ranks=(3,))
write_nvidia_smi_csv(b.samples(), here)
b.write_events(here / "events.jsonl")
print(f"wrote {here}")
