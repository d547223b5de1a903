"""A trainer that ends in a chosen way: python trainer_exit.py JOB PREFIX URL SPOOL HOW

HOW: clean, exit0, with (a `with StepReporter(...)` block), raise, exit1, exitmsg,
thread (an uncaught exception in another thread), finally (close() in a finally while an exception
propagates), interrupt (KeyboardInterrupt), caught_exit1 (sys.exit(1) caught, then a clean exit).
"""

import contextlib
import sys
import threading

from costexporter.trainer.reporter import StepReporter

job, prefix, url, spool, how = sys.argv[1:6]


def train(rep: StepReporter) -> None:
    for s in range(1, 6):
        rep.step(s, tokens=10)
    rep.flush(5)


if how == "with":
    with StepReporter(job, url, prefix=prefix, spool_dir=spool, heartbeat_s=3600) as rep:
        train(rep)
    sys.exit(0)

rep = StepReporter(job, url, prefix=prefix, spool_dir=spool, heartbeat_s=3600)
train(rep)
if how == "exit0":
    sys.exit(0)
elif how == "raise":
    raise RuntimeError("NCCL error: unhandled system error")
elif how == "exit1":
    sys.exit(1)
elif how == "exitmsg":
    sys.exit("training diverged")
elif how == "thread":
    t = threading.Thread(target=lambda: 1 / 0, name="loader")
    t.start()
    t.join()
elif how == "finally":
    try:
        raise ValueError("loss is NaN")
    finally:
        rep.close()
elif how == "interrupt":
    raise KeyboardInterrupt
elif how == "caught_exit1":
    with contextlib.suppress(SystemExit):
        sys.exit(1)
    sys.exit(0)
