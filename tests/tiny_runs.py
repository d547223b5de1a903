"""Shared by the integration tests: tiny real Hugging Face and Lightning runs on CPU (models built
from configs, nothing downloaded) with our callbacks, and the events they posted, read back from
the shared Redis."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis

from costexporter.store import keys
from costexporter.store.reader import EventReader

from .conftest import SHARED_URL


def _redis() -> redis.Redis:
    return redis.Redis.from_url(SHARED_URL, decode_responses=True)


def events(prefix: str, job: str) -> list:
    """Every event the job posted, in stream order."""
    return EventReader(_redis(), job, prefix=prefix).read_all()


def timeline(prefix: str, job: str) -> list[tuple]:
    """The job's steps, phases and run states as short tuples, in order."""
    out: list[tuple] = []
    for e in events(prefix, job):
        if e.type == "step":
            out.append(("step", int(e.get("step"))))
        elif e.type == "phase":
            out.append((e.get("name"), e.get("state"), e.get("step")))
        elif e.type == "run":
            out.append(("run", e.get("state")))
    return out


def booked_steps(prefix: str, job: str) -> tuple[int, int]:
    """(steps completed, steps voided) as the agents and replay book the job's events (its
    timeline from its first event to a minute past its last)."""
    from costexporter.core.booking import BookingConfig, build_timeline

    evs = events(prefix, job)
    start, end = min(e.ts_ms for e in evs), max(e.ts_ms for e in evs) + 60_000
    tl = build_timeline(evs, BookingConfig(), start, end)
    return len(tl.steps), sum(s.voided for s in tl.steps)


def job_names(prefix: str) -> list[str]:
    """The jobs registered under the prefix."""
    return _redis().zrange(keys.jobs_key(prefix), 0, -1)


# ---- Hugging Face ------------------------------------------------------------------------------
def hf_trainer(
    tmp_path: Path,
    prefix: str,
    job: str | None = None,
    *,
    n_layer: int = 1,
    samples: int = 32,
    **args_kw: Any,
):
    """A Trainer of a tiny GPT-2 on `samples` fixed random sequences of 16 tokens, batches of 4,
    with our callback; `args_kw` override the TrainingArguments. Returns (trainer, callback)."""
    torch = pytest.importorskip("torch", reason="torch is an optional extra")
    transformers = pytest.importorskip("transformers", reason="transformers is the [hf] extra")
    from costexporter.integrations.hf import CostExporterCallback

    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=n_layer, n_head=2)

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return samples

        def __getitem__(self, i):
            ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    kw: dict[str, Any] = dict(
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


# ---- Lightning ---------------------------------------------------------------------------------
def pl_module():
    """(lightning.pytorch, Tiny): a one-layer regression module with a validation step."""
    torch = pytest.importorskip("torch", reason="torch is an optional extra")
    L = pytest.importorskip("lightning.pytorch", reason="lightning is the [lightning] extra")

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

    return L, Tiny


def pl_loader(n: int):
    """`n` random (x, y) pairs for Tiny, in batches of 8."""
    torch = pytest.importorskip("torch", reason="torch is an optional extra")
    data = torch.utils.data.TensorDataset(torch.randn(n, 4), torch.randn(n, 1))
    return torch.utils.data.DataLoader(data, batch_size=8)


def pl_callback(prefix: str, tmp_path: Path, job: str | None = None, **kw: Any):
    """Our Lightning callback, spooling under tmp_path, no heartbeats within a test."""
    from costexporter.integrations.lightning import CostExporterLightningCallback

    return CostExporterLightningCallback(
        job=job, prefix=prefix, spool_dir=tmp_path / "spool", heartbeat_s=3600, **kw
    )


def pl_trainer(L, tmp_path: Path, callbacks: list, max_steps: int, **kw: Any):
    """A quiet CPU Trainer rooted at tmp_path/root (unnamed jobs are named after it)."""
    base: dict[str, Any] = dict(
        max_steps=max_steps,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path / "root",
    )
    return L.Trainer(**{**base, **kw})
