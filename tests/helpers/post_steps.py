"""A trainer process for the tests: python post_steps.py JOB PREFIX URL SPOOL N [--no-close]

Rank and world size come from the environment, as under torchrun.
"""

import sys
import time

from costexporter.trainer.reporter import StepReporter

job, prefix, url, spool, n = sys.argv[1:6]
rep = StepReporter(job, url, prefix=prefix, spool_dir=spool, heartbeat_s=0.5)
for s in range(1, int(n) + 1):
    rep.step(s, tokens=100)
    if s % 100 == 0:
        with rep.phase("checkpoint", step=s):
            time.sleep(0.001)
print(f"posted {time.time():.6f}", flush=True)
if "--no-close" not in sys.argv:
    rep.close()
