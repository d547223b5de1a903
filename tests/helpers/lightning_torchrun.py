"""A Lightning fit run by torchrun on 2 CPU ranks (DDP, gloo), reporting with our callback.

    python -m torch.distributed.run --standalone --nproc_per_node 2 lightning_torchrun.py \
        JOB PREFIX URL ROOT SPOOL

Two fits with one callback: four optimizer steps of two micro-batches of 8 samples on each
rank, a checkpoint every 2 steps into ROOT/ckpt; then a second fit that resumes from the
checkpoint of step 2 (`fit(ckpt_path=...)`). A micro-batch's tokens across the ranks: its
samples x the world size.
"""

import sys

import lightning.pytorch as L
import torch

from costexporter.integrations.lightning import CostExporterLightningCallback

job, prefix, url, root, spool = sys.argv[1:6]


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


cb = CostExporterLightningCallback(
    job=job,
    redis_url=url,
    prefix=prefix,
    spool_dir=spool,
    heartbeat_s=3600,
    tokens_per_batch=lambda b: len(b[0]) * 2,
)
data = torch.utils.data.TensorDataset(torch.randn(128, 4), torch.randn(128, 1))


def fit(ckpt_path=None):
    trainer = L.Trainer(
        max_steps=4,
        accumulate_grad_batches=2,
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=[
            cb,
            L.callbacks.ModelCheckpoint(dirpath=f"{root}/ckpt", every_n_train_steps=2, save_top_k=-1),
        ],
    )
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=8), ckpt_path=ckpt_path)
    return trainer


fit()
trainer = fit(f"{root}/ckpt/epoch=0-step=2.ckpt")
print(f"rank {trainer.global_rank} fitted to step {trainer.global_step}", flush=True)
