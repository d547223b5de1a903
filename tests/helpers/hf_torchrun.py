"""A Hugging Face Trainer run by torchrun on 2 CPU ranks (gloo), reporting with our callback.

    python -m torch.distributed.run --standalone --nproc_per_node 2 hf_torchrun.py PREFIX URL OUT SPOOL

A tiny GPT-2 built from a config (nothing downloaded), eval and save strategies "epoch", two
epochs, no job name (each run is named after the output directory and its start time, the same
on every rank), and `train()` called twice on the same callback: two runs, two jobs.
"""

import sys

import torch
import transformers

from costexporter.integrations.hf import CostExporterCallback

prefix, url, out, spool = sys.argv[1:5]
cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


args = transformers.TrainingArguments(
    output_dir=out,
    per_device_train_batch_size=4,
    per_device_eval_batch_size=4,
    num_train_epochs=2,
    eval_strategy="epoch",
    save_strategy="epoch",
    logging_steps=100,
    report_to=[],
    use_cpu=True,
    disable_tqdm=True,
    include_num_input_tokens_seen=True,
    ddp_backend="gloo",
)
cb = CostExporterCallback(redis_url=url, prefix=prefix, spool_dir=spool, heartbeat_s=3600)
trainer = transformers.Trainer(
    model=transformers.GPT2LMHeadModel(cfg),
    args=args,
    train_dataset=Tokens(),
    eval_dataset=Tokens(),
    callbacks=[cb],
)
trainer.train()
trainer.train()  # the same callback: a second run
print("trained twice", flush=True)
