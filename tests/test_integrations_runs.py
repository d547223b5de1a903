"""The Hugging Face and Lightning callbacks in tiny real runs (CPU, models built from configs,
nothing downloaded): epoch strategies, a Lightning resume from a checkpoint, a second
train()/fit() on one callback, unique default job names."""

from __future__ import annotations

import pytest
import redis

from costexporter.store import keys
from costexporter.store.reader import EventReader

from .conftest import SHARED_URL
from .test_integrations import timeline

torch = pytest.importorskip("torch", reason="torch is an optional extra")


def _events(prefix: str, job: str):
    return EventReader(redis.Redis.from_url(SHARED_URL, decode_responses=True), job, prefix=prefix).read_all()


def _jobs(prefix: str) -> list[str]:
    return redis.Redis.from_url(SHARED_URL, decode_responses=True).zrange(keys.jobs_key(prefix), 0, -1)


# ---- Hugging Face ------------------------------------------------------------------------------
def _hf(tmp_path, prefix, job=None, **args_kw):
    transformers = pytest.importorskip("transformers", reason="transformers is the [hf] extra")
    from costexporter.integrations.hf import CostExporterCallback

    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2)

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 16

        def __getitem__(self, i):
            ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    kw = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        logging_steps=100,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        include_num_input_tokens_seen=True,
    )
    args = transformers.TrainingArguments(**{**kw, **args_kw})
    cb = CostExporterCallback(job=job, prefix=prefix, spool_dir=tmp_path / "spool", heartbeat_s=3600)
    trainer = transformers.Trainer(
        model=transformers.GPT2LMHeadModel(cfg),
        args=args,
        train_dataset=Tokens(),
        eval_dataset=Tokens(),
        callbacks=[cb],
    )
    return trainer, cb


def test_hf_epoch_strategies_post_eval_around_the_eval_and_checkpoint_around_the_save(prefix, tmp_path):
    trainer, _ = _hf(
        tmp_path, prefix, "hf-epoch", num_train_epochs=2, eval_strategy="epoch", save_strategy="epoch"
    )
    trainer.train()
    epoch = [("step", s) for s in range(1, 5)], [("step", s) for s in range(5, 9)]
    phases = lambda k: [  # noqa: E731
        ("eval", "begin", None),
        ("eval", "end", None),
        ("checkpoint", "begin", None),
        ("checkpoint", "end", k),
    ]
    assert timeline(prefix, "hf-epoch") == [
        ("run", "start"),
        *epoch[0],
        *phases(4),
        *epoch[1],
        *phases(8),
        ("run", "end"),
    ]
    evs = _events(prefix, "hf-epoch")
    ckpt = [e.ts for e in evs if e.type == "phase" and e.get("name") == "checkpoint"]
    assert ckpt[1] > ckpt[0] and ckpt[3] > ckpt[2]  # the save lies between: not one instant
    assert (tmp_path / "out" / "checkpoint-4").is_dir()


def test_hf_unnamed_runs_get_their_own_jobs_and_a_second_train_reopens(prefix, tmp_path):
    trainer, _ = _hf(tmp_path, prefix, max_steps=2, save_strategy="no")
    trainer.train()
    trainer.train()  # the same callback, a second run
    jobs = _jobs(prefix)
    assert len(jobs) == 2 and all(j.startswith("out-") for j in jobs)
    for j in jobs:
        assert timeline(prefix, j) == [("run", "start"), ("step", 1), ("step", 2), ("run", "end")]
    named, _ = _hf(tmp_path, prefix, max_steps=1, save_strategy="no", run_name="my run #1")
    named.train()
    assert "my-run-1" in _jobs(prefix)


# ---- Lightning ---------------------------------------------------------------------------------
def _pl_module():
    L = pytest.importorskip("lightning.pytorch", reason="lightning is the [lightning] extra")

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return L, Tiny


def _pl_trainer(L, tmp_path, cb, max_steps, ckpt=None):
    return L.Trainer(
        max_steps=max_steps,
        accumulate_grad_batches=2,
        num_sanity_val_steps=0,
        callbacks=[cb, *([ckpt] if ckpt else [])],
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path / "root",
    )


def test_lightning_resume_from_a_checkpoint_posts_run_resume_and_no_bogus_step(prefix, tmp_path):
    L, Tiny = _pl_module()
    from costexporter.integrations.lightning import CostExporterLightningCallback

    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=8)

    def cb():
        return CostExporterLightningCallback(
            job="pl-resume",
            prefix=prefix,
            spool_dir=tmp_path / "spool",
            heartbeat_s=3600,
            tokens_per_batch=lambda b: len(b[0]),
        )

    ckpt = L.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    _pl_trainer(L, tmp_path, cb(), 4, ckpt).fit(Tiny(), loader)
    saved = sorted((tmp_path / "ckpt").glob("*step=2*.ckpt"))
    assert saved, list((tmp_path / "ckpt").iterdir())
    _pl_trainer(L, tmp_path, cb(), 4).fit(Tiny(), loader, ckpt_path=str(saved[0]))
    got = timeline(prefix, "pl-resume")
    second = got[got.index(("run", "end")) + 1 :]
    assert [x for x in second if x[0] in ("run", "step")] == [
        ("run", "start"),
        ("run", "resume"),
        ("step", 3),
        ("step", 4),
        ("run", "end"),
    ]
    evs = _events(prefix, "pl-resume")
    resume = [e for e in evs if e.type == "run" and e.get("state") == "resume"]
    assert [e.get("step") for e in resume] == [2]
    steps = [e for e in evs if e.type == "step"]
    assert [e.get("step") for e in steps] == [1, 2, 3, 4, 3, 4]
    assert all(e.get("tokens") == 16 for e in steps)  # two micro-batches of 8, never half a step


def test_lightning_second_fit_reopens_and_unnamed_fits_get_their_own_jobs(prefix, tmp_path):
    L, Tiny = _pl_module()
    from costexporter.integrations.lightning import CostExporterLightningCallback

    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    cb = CostExporterLightningCallback(prefix=prefix, spool_dir=tmp_path / "spool", heartbeat_s=3600)
    _pl_trainer(L, tmp_path, cb, 2).fit(Tiny(), loader)
    _pl_trainer(L, tmp_path, cb, 2).fit(Tiny(), loader)
    jobs = _jobs(prefix)
    assert len(jobs) == 2 and all(j.startswith("root-") for j in jobs)
    for j in jobs:
        got = [x for x in timeline(prefix, j) if x[0] in ("run", "step")]
        assert got == [("run", "start"), ("step", 1), ("step", 2), ("run", "end")]
