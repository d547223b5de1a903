"""A Lightning fit run by torchrun on 2 CPU ranks (DDP, gloo), reporting with our callback.

    python -m torch.distributed.run --standalone --nproc_per_node 2 lightning_torchrun.py JOB PREFIX TMP

Two fits of tests/tiny_runs.py's module with one callback: four optimizer steps of two
micro-batches of 8 samples on each rank, a checkpoint every 2 steps into TMP/ckpt; then a second
fit that resumes from the checkpoint of step 2 (`fit(ckpt_path=...)`). A micro-batch's tokens
across the ranks: its samples x the world size.
"""

import sys
from pathlib import Path

from tests.tiny_runs import pl_callback, pl_loader, pl_module, pl_trainer

job, prefix, tmp = sys.argv[1], sys.argv[2], Path(sys.argv[3])
L, Tiny = pl_module()
cb = pl_callback(prefix, tmp, job, tokens_per_batch=lambda b: len(b[0]) * 2)
loader = pl_loader(128)


def fit(ckpt_path=None):
    ckpt = L.callbacks.ModelCheckpoint(dirpath=tmp / "ckpt", every_n_train_steps=2, save_top_k=-1)
    trainer = pl_trainer(L, tmp, [cb, ckpt], 4, accumulate_grad_batches=2, devices=2, strategy="ddp")
    trainer.fit(Tiny(), loader, ckpt_path=ckpt_path)
    return trainer


fit()
trainer = fit(str(tmp / "ckpt" / "epoch=0-step=2.ckpt"))
print(f"rank {trainer.global_rank} fitted to step {trainer.global_step}", flush=True)
