"""One run of a 2-rank gloo (CPU) data-parallel job under torchrun, reporting its steps.

    python -m torch.distributed.run --standalone --nproc_per_node 2 gloo_runs.py \
        JOB PREFIX URL SPOOL FIRST LAST [RESUMED_FROM]

Each rank trains steps FIRST..LAST (a gradient all-reduce each) and exits cleanly, so its
reporter posts `run end`. With RESUMED_FROM the run restarts from the checkpoint after that step
(`run resume`); without it, a plain start.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

from costexporter.trainer.reporter import StepReporter

job, prefix, url, spool, first, last = sys.argv[1:7]
resumed = int(sys.argv[7]) if len(sys.argv) > 7 else None
dist.init_process_group("gloo")
rep = StepReporter(job, url, prefix=prefix, spool_dir=spool, heartbeat_s=0.5, resume_from=resumed)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(int(first), int(last) + 1):
    loss = model(torch.randn(16, 8)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
    rep.step(step, tokens=128 if int(os.environ["RANK"]) == 0 else None)
    time.sleep(0.1)
dist.barrier()
dist.destroy_process_group()
print(f"rank {os.environ['RANK']} trained {first}..{last}", flush=True)
