"""Hugging Face `transformers` integration: `Trainer(..., callbacks=[CostExporterCallback(job=...)])`.

Posts every optimizer step (with the global batch's tokens, when the Trainer counts them:
`include_num_input_tokens_seen=True`; the Trainer gathers that count across ranks), evaluation
as an `eval` phase and checkpoint saves as a `checkpoint` phase carrying the saved step, for the
step and the epoch strategies alike: the phase begins when the Trainer has decided to evaluate
or save (after the step, or at the epoch's end) and ends when it is done. A run resumed from a
checkpoint posts `run resume`. Without `job`, the job is the run's `run_name`, else the output
directory's name plus a hash of the user and that directory's absolute path (the same on every
rank): a `resume_from_checkpoint` run is the job it resumes (the steps it redoes are voided),
two users' runs never share a job. Each `train()` is a run: a second one on the same callback
opens a new reporter, and a new run of the job.
"""

from __future__ import annotations

try:
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "costexporter.integrations.hf needs transformers: pip install 'costexporter[hf]'"
    ) from e

import os
from typing import Any

from costexporter.integrations.naming import job_name, owner_hash
from costexporter.trainer.reporter import StepReporter


class CostExporterCallback(TrainerCallback):
    """Reports a `transformers.Trainer` run to costexporter."""

    def __init__(
        self, job: str | None = None, reporter: StepReporter | None = None, **reporter_kwargs: Any
    ) -> None:
        self.job = job
        self.reporter = reporter
        self._owns = reporter is None
        self._kwargs = reporter_kwargs
        self._first_step = True
        self._tokens_seen = 0
        self._rank0 = True
        self._eval_open = False
        self._ckpt_open = False

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.reporter is None:
            self.reporter = StepReporter(
                self.job or default_job(args),
                rank=args.process_index,
                local_rank=max(args.local_process_index, 0),
                world_size=args.world_size,
                **self._kwargs,
            )
        self._first_step = True
        self._eval_open = self._ckpt_open = False
        self._tokens_seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)
        total = getattr(state, "max_steps", 0)
        if state.is_world_process_zero and isinstance(total, int) and total > 0:
            self.reporter.meta(total_steps=total)  # what is left to pay for (cost to finish)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The hot path (once an optimizer step): attribute reads and one queue append; the
        # reporter converts what is not already an int.
        rep = self.reporter
        if rep is None:
            return
        step = state.global_step
        if self._first_step:
            self._first_step = False
            self._rank0 = state.is_world_process_zero
            if step > 1:
                rep.resume(step - 1)  # resumed from a checkpoint
        seen = getattr(state, "num_input_tokens_seen", 0) or 0
        prev, self._tokens_seen = self._tokens_seen, seen
        rep.step(step, seen - prev if seen > prev and self._rank0 else None)
        if control.should_evaluate or control.should_save:  # (no call otherwise)
            self._open_phase(control)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # `eval_strategy`/`save_strategy="epoch"`: decided here, done right after.
        if self.reporter is not None:
            self._open_phase(control)

    def _open_phase(self, control: Any) -> None:
        """The default flow callback (it runs before user callbacks) has decided what the
        Trainer does next: begin that phase now, before the work."""
        rep = self.reporter
        if rep is None:
            return
        if control.should_evaluate and not self._eval_open:
            rep.phase_begin("eval")
            self._eval_open = True
        elif control.should_save and not control.should_evaluate and not self._ckpt_open:
            rep.phase_begin("checkpoint")
            self._ckpt_open = True

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.reporter is None or not self._eval_open:
            return
        self.reporter.phase_end("eval")
        self._eval_open = False
        if control.should_save:  # with save_strategy="best" this is decided after evaluation
            self.reporter.phase_begin("checkpoint")
            self._ckpt_open = True

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.reporter is None:
            return
        if not self._ckpt_open:
            self.reporter.phase_begin("checkpoint")
        self.reporter.phase_end("checkpoint", step=int(state.global_step))
        self._ckpt_open = False

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.reporter is not None and self._owns:
            self.reporter.close()
            self.reporter = None  # a second train() is another run: a new reporter


def default_job(args: Any) -> str:  # transformers' TrainingArguments
    """The run's `run_name`, else `<output dir name>-<hash of the user and the absolute output
    dir>`: what a resume shares with the run it resumes (`resume_from_checkpoint` reads that
    directory), so the resume is the same job and voids the steps it redoes, while two users'
    `trainer_output` never merge. The same on every rank (rank 0's, broadcast when
    torch.distributed runs)."""
    if args.run_name and args.run_name != args.output_dir:
        return job_name(str(args.run_name))
    out = os.path.abspath(str(args.output_dir or "hf"))
    base = os.path.basename(os.path.normpath(out)) or "hf"
    return job_name(f"{base}-{owner_hash(out)}", agree=True)
