"""Two real torch.distributed (gloo, CPU) ranks all-reducing forever: python gloo_peer.py JOB PREFIX URL SPOOL

Kill one with SIGKILL and the other raises from the collective, as a multi-node job's survivors do.
"""

import datetime
import sys

import torch
import torch.distributed as dist

from costexporter.trainer.reporter import StepReporter

job, prefix, url, spool = sys.argv[1:5]
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rep = StepReporter(job, url, prefix=prefix, spool_dir=spool, heartbeat_s=3600)
t = torch.ones(4)
step = 0
while True:
    dist.all_reduce(t)
    step += 1
    rep.step(step)
    if step == 20:
        rep.flush(5)
        print("stepping", flush=True)
