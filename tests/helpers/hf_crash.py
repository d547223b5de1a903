"""A tiny Hugging Face Trainer run whose data fails at step 3: python hf_crash.py JOB PREFIX URL SPOOL"""

import sys

import torch
import transformers

from costexporter.integrations.hf import CostExporterCallback

job, prefix, url, spool = sys.argv[1:5]


class Tokens(torch.utils.data.Dataset):
    served = 0

    def __len__(self):
        return 64

    def __getitem__(self, i):
        Tokens.served += 1
        if Tokens.served > 8:  # two batches of 4, then the failure
            raise OSError("shard 3 is unreadable")
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
args = transformers.TrainingArguments(
    output_dir=spool + "/out",
    max_steps=10,
    per_device_train_batch_size=4,
    save_strategy="no",
    report_to=[],
    use_cpu=True,
    disable_tqdm=True,
    dataloader_num_workers=0,
)
cb = CostExporterCallback(job=job, redis_url=url, prefix=prefix, spool_dir=spool, heartbeat_s=3600)
trainer = transformers.Trainer(
    model=transformers.GPT2LMHeadModel(cfg), args=args, train_dataset=Tokens(), callbacks=[cb]
)
trainer.train()
