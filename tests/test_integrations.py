"""The Hugging Face and Lightning callbacks in tiny real training runs on CPU (nothing downloaded)."""

from __future__ import annotations

import pytest
import redis

from costexporter.store.reader import EventReader

from .conftest import SHARED_URL


def timeline(prefix: str, job: str) -> list[tuple]:
    events = EventReader(
        redis.Redis.from_url(SHARED_URL, decode_responses=True), job, prefix=prefix
    ).read_all()
    out = []
    for e in events:
        if e.type == "step":
            out.append(("step", int(e.get("step"))))
        elif e.type == "phase":
            out.append((e.get("name"), e.get("state"), e.get("step")))
        elif e.type == "run":
            out.append(("run", e.get("state")))
    return out


def test_hugging_face_trainer_posts_steps_evals_and_checkpoints(prefix, tmp_path):
    torch = pytest.importorskip("torch", reason="torch is an optional extra")
    transformers = pytest.importorskip("transformers", reason="transformers is the [hf] extra")
    from costexporter.integrations.hf import CostExporterCallback

    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg)

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, i):
            ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=6,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        eval_strategy="steps",
        eval_steps=3,
        save_strategy="steps",
        save_steps=3,
        logging_steps=100,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        include_num_input_tokens_seen=True,
    )
    cb = CostExporterCallback(job="hf-tiny", prefix=prefix, spool_dir=tmp_path / "spool", heartbeat_s=3600)
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Tokens(), eval_dataset=Tokens(), callbacks=[cb]
    )
    trainer.train()
    assert timeline(prefix, "hf-tiny") == [
        ("run", "start"),
        ("step", 1),
        ("step", 2),
        ("step", 3),
        ("eval", "begin", None),
        ("eval", "end", None),
        ("checkpoint", "begin", None),
        ("checkpoint", "end", 3),
        ("step", 4),
        ("step", 5),
        ("step", 6),
        ("eval", "begin", None),
        ("eval", "end", None),
        ("checkpoint", "begin", None),
        ("checkpoint", "end", 6),
        ("run", "end"),
    ]
    steps = [
        e
        for e in EventReader(
            redis.Redis.from_url(SHARED_URL, decode_responses=True), "hf-tiny", prefix=prefix
        ).read_all()
        if e.type == "step"
    ]
    assert all(int(e.get("tokens")) == 4 * 16 for e in steps)  # the batch's tokens, per step


def test_lightning_trainer_posts_steps_evals_and_checkpoints(prefix, tmp_path):
    torch = pytest.importorskip("torch", reason="torch is an optional extra")
    L = pytest.importorskip("lightning.pytorch", reason="lightning is the [lightning] extra")
    from costexporter.integrations.lightning import CostExporterLightningCallback

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def validation_step(self, batch, _):
            x, y = batch
            self.log("val", torch.nn.functional.mse_loss(self.layer(x), y))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    cb = CostExporterLightningCallback(
        job="pl-tiny",
        prefix=prefix,
        spool_dir=tmp_path / "spool",
        heartbeat_s=3600,
        tokens_per_batch=lambda b: len(b[0]),
    )
    ckpt = L.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    trainer = L.Trainer(
        max_steps=6,
        val_check_interval=3,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        callbacks=[ckpt, cb],
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(Tiny(), loader, loader)
    got = timeline(prefix, "pl-tiny")
    assert [x for x in got if x[0] == "step"] == [("step", s) for s in range(1, 7)]
    assert got[0] == ("run", "start") and got[-1] == ("run", "end")
    assert got.count(("eval", "begin", None)) == got.count(("eval", "end", None)) == 2
    assert [x for x in got if x[0] == "checkpoint" and x[1] == "end"] == [
        ("checkpoint", "end", 3),
        ("checkpoint", "end", 6),
    ]
    # Each checkpoint comes after the step it saved.
    assert got.index(("checkpoint", "end", 3)) > got.index(("step", 3))


def test_a_hugging_face_run_that_crashes_posts_no_run_end(shared, prefix, tmp_path):
    """The data loader fails at step 3: the process dies of the exception, so no `run end`."""
    pytest.importorskip("torch", reason="torch is an optional extra")
    pytest.importorskip("transformers", reason="transformers is the [hf] extra")
    import subprocess
    import sys
    from pathlib import Path

    helper = Path(__file__).parent / "helpers" / "hf_crash.py"
    out = subprocess.run(
        [sys.executable, str(helper), "hf-crash", prefix, SHARED_URL, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and "shard 3 is unreadable" in out.stderr, out.stderr[-2000:]
    got = timeline(prefix, "hf-crash")  # the loader reads a batch ahead: the steps before that one
    assert got[0] == ("run", "start") and got[1] == ("step", 1)
    assert ("run", "end") not in got


def test_a_lightning_fit_that_raises_posts_no_run_end(prefix, tmp_path):
    torch = pytest.importorskip("torch", reason="torch is an optional extra")
    L = pytest.importorskip("lightning.pytorch", reason="lightning is the [lightning] extra")
    from costexporter.integrations.lightning import CostExporterLightningCallback

    class Diverges(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, i):
            if i == 3:
                raise FloatingPointError("loss is NaN")
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 4)), batch_size=8)
    cb = CostExporterLightningCallback(job="pl-crash", prefix=prefix, spool_dir=tmp_path, heartbeat_s=3600)
    trainer = L.Trainer(
        max_steps=6,
        callbacks=[cb],
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    with pytest.raises(FloatingPointError):
        trainer.fit(Diverges(), loader)
    assert timeline(prefix, "pl-crash") == [("run", "start"), ("step", 1), ("step", 2), ("step", 3)]
