"""A real torch.distributed (gloo, CPU) trainer for the watcher's end-to-end test (R4).

    python gloo_train.py JOB PREFIX URL SPOOL uneven|fixed

Rank, world size and the rendezvous come from the environment, as under torchrun. Every rank
posts its own steps and phases. Rank 3 gets two batches fewer than the others: `uneven` lets it
leave the loop for the checkpoint barrier while the rest wait in the gradient all-reduce (a real
deadlock); `fixed` applies the R4 fix (all-reduce MIN of the batch count) and finishes.
"""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

from costexporter.integrations.torch_dist import even_batches
from costexporter.trainer.reporter import StepReporter

job, prefix, url, spool, mode = sys.argv[1:6]
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=900))
rep = StepReporter(job, url, prefix=prefix, spool_dir=spool, heartbeat_s=0.5)
batches = 30 - (2 if rank == 3 else 0)
if mode == "fixed":
    batches = even_batches(batches)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(1, batches + 1):
    x = torch.randn(16, 8)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():  # the gradient all-reduce of data parallelism
        dist.all_reduce(p.grad)
    opt.step()
    rep.step(step, tokens=16 * 8 if rank == 0 else None)
    time.sleep(0.1)
print(f"rank {rank} left the loop after {batches} batches", flush=True)
rep.phase_begin("checkpoint", step=batches)
dist.barrier()  # the save barrier
rep.phase_end("checkpoint", step=batches)
rep.close()
dist.destroy_process_group()
print(f"rank {rank} done", flush=True)
