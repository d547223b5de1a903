"""PyTorch Lightning integration: `Trainer(callbacks=[CostExporterLightningCallback(job=...)])`.

Posts every optimizer step (`trainer.global_step`), validation as an `eval` phase and every
checkpoint save (whoever triggers it: ModelCheckpoint or your code) as a `checkpoint` phase
carrying the saved step. `tokens_per_batch(batch)` returns the tokens of one micro-batch across
every rank (this rank's count x `trainer.world_size` under DDP): the step posts the sum over
its micro-batches, the global batch's tokens, as the protocol counts them. A `fit(ckpt_path=...)`
posts `run resume` at the restored step (once the checkpoint is loaded, at `on_train_start`).
Without `job`, the job is `<default_root_dir name>-<start time, UTC>` (rank 0's on every rank),
so unnamed runs never share a job. Each `fit()` is a run: a second one opens a new reporter.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

try:
    from lightning.pytorch import Callback
except ImportError:  # pragma: no cover - the standalone package name
    try:
        # The standalone package's Callback is another class of the same shape.
        from pytorch_lightning import Callback  # type: ignore[assignment, unused-ignore]
    except ImportError as e:
        raise ImportError(
            "costexporter.integrations.lightning needs lightning: pip install 'costexporter[lightning]'"
        ) from e

from costexporter.integrations.naming import job_name, start_stamp
from costexporter.trainer.reporter import StepReporter


class CostExporterLightningCallback(Callback):
    """Reports a Lightning `Trainer.fit` to costexporter."""

    def __init__(
        self,
        job: str | None = None,
        reporter: StepReporter | None = None,
        tokens_per_batch: Callable[[object], int] | None = None,
        **reporter_kwargs: Any,
    ) -> None:
        self.job = job
        self.reporter = reporter
        self._owns = reporter is None
        self._kwargs = reporter_kwargs
        self._tokens_per_batch = tokens_per_batch
        self._last_step = -1
        self._tokens = 0
        self._rank0 = True

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if self.reporter is None:
            self.reporter = StepReporter(
                self.job or default_job(trainer),
                rank=trainer.global_rank,
                local_rank=trainer.local_rank,
                world_size=trainer.world_size,
                **self._kwargs,
            )
        self._tokens = 0
        if getattr(trainer, "_costexporter_save", None) is None:
            save = trainer.save_checkpoint

            def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
                rep = self.reporter
                if rep is None:
                    return save(*args, **kwargs)
                with rep.phase("checkpoint", step=int(trainer.global_step)):
                    return save(*args, **kwargs)

            trainer._costexporter_save = save
            trainer.save_checkpoint = save_checkpoint  # every save, whoever triggers it

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # The checkpoint of `fit(ckpt_path=...)` is restored by now (not yet at on_fit_start).
        self._rank0 = trainer.global_rank == 0
        self._last_step = int(trainer.global_step)
        self._tokens = 0
        if self._rank0 and self.reporter is not None:
            total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
            if total is None:
                est = getattr(trainer, "estimated_stepping_batches", None)
                total = int(est) if isinstance(est, (int, float)) and 0 < est < float("inf") else None
            if total is not None:
                self.reporter.meta(total_steps=total)  # what is left to pay for (cost to finish)
        if self._last_step > 0 and self.reporter is not None:
            self.reporter.resume(self._last_step)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # The hot path (once a micro-batch): no call unless an optimizer step completed.
        count = self._tokens_per_batch
        if count is not None:
            n = count(batch)
            self._tokens += n if type(n) is int else int(n)  # (a tensor, a numpy integer)
        step = trainer.global_step
        if step != self._last_step:
            rep = self.reporter
            if rep is not None:
                rep.step(step, self._tokens if self._tokens and self._rank0 else None)
                self._tokens = 0
                self._last_step = step

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self.reporter is not None and not trainer.sanity_checking:
            self.reporter.phase_begin("eval")

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self.reporter is not None and not trainer.sanity_checking:
            self.reporter.phase_end("eval")

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if self.reporter is not None and self._owns:
            self.reporter.close()
            self.reporter = None  # a second fit() is another run: a new reporter

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.reporter is not None and self._owns:
            self.reporter.close(end_run=False)
            self.reporter = None


def default_job(trainer: Any) -> str:  # lightning's Trainer
    """`<default_root_dir name>-<start time, UTC>`, rank 0's on every rank."""
    root = (
        os.path.basename(os.path.normpath(str(getattr(trainer, "default_root_dir", "") or ""))) or "lightning"
    )
    name = f"{root}-{start_stamp()}"
    broadcast = getattr(getattr(trainer, "strategy", None), "broadcast", None)
    return job_name(name, agree=True, broadcast=(lambda x: broadcast(x, src=0)) if broadcast else None)
