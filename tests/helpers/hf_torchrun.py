"""A Hugging Face Trainer run by torchrun on 2 CPU ranks (gloo), reporting with our callback.

    python -m torch.distributed.run --standalone --nproc_per_node 2 hf_torchrun.py PREFIX TMP

The tiny GPT-2 of tests/tiny_runs.py on 16 sequences, eval and save strategies "epoch", two
epochs, no job name (the job is named after the output directory and the user, the same on every
rank), and `train()` called twice on the same callback: two runs of one job. Events go to the
Redis of COSTEXPORTER_REDIS_URL (default: the shared one).
"""

import sys
from pathlib import Path

from tests.tiny_runs import hf_trainer

prefix, tmp = sys.argv[1], Path(sys.argv[2])
trainer, _ = hf_trainer(
    tmp,
    prefix,
    samples=16,
    num_train_epochs=2,
    eval_strategy="epoch",
    save_strategy="epoch",
    ddp_backend="gloo",
)
trainer.train()
trainer.train()  # the same callback: a second run
print("trained twice", flush=True)
