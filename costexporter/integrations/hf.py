"""Hugging Face `transformers` integration: `Trainer(..., callbacks=[CostExporterCallback(job=...)])`.

Posts every optimizer step (with the tokens seen, when the Trainer counts them:
`include_num_input_tokens_seen=True`), evaluation as an `eval` phase and checkpoint saves as a
`checkpoint` phase carrying the saved step. A run resumed from a checkpoint posts `run resume`.
"""

from __future__ import annotations

try:
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "costexporter.integrations.hf needs transformers: pip install 'costexporter[hf]'"
    ) from e

from costexporter.trainer.reporter import StepReporter


class CostExporterCallback(TrainerCallback):
    """Reports a `transformers.Trainer` run to costexporter."""

    def __init__(
        self, job: str | None = None, reporter: StepReporter | None = None, **reporter_kwargs
    ) -> None:
        self.job = job
        self.reporter = reporter
        self._owns = reporter is None
        self._kwargs = reporter_kwargs
        self._first_step = True
        self._tokens_seen = 0
        self._eval_open = False
        self._ckpt_open = False

    def on_train_begin(self, args, state, control, **kwargs):
        if self.reporter is None:
            job = self.job or args.run_name or "hf-trainer"
            self.reporter = StepReporter(
                job,
                rank=args.process_index,
                local_rank=max(args.local_process_index, 0),
                world_size=args.world_size,
                **self._kwargs,
            )
        self._first_step = True
        self._tokens_seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)

    def on_step_end(self, args, state, control, **kwargs):
        rep = self.reporter
        if rep is None:
            return
        step = int(state.global_step)
        if self._first_step and step > 1:
            rep.resume(step - 1)  # resumed from a checkpoint
        self._first_step = False
        seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)
        tokens = (
            seen - self._tokens_seen if seen > self._tokens_seen and state.is_world_process_zero else None
        )
        self._tokens_seen = seen
        rep.step(step, tokens=tokens)
        # The default flow callback has decided what happens next (it runs before user callbacks).
        if control.should_evaluate:
            rep.phase_begin("eval")
            self._eval_open = True
        elif control.should_save:
            rep.phase_begin("checkpoint")
            self._ckpt_open = True

    def on_evaluate(self, args, state, control, **kwargs):
        if self.reporter is None or not self._eval_open:
            return
        self.reporter.phase_end("eval")
        self._eval_open = False
        if control.should_save:  # with save_strategy="best" this is decided after evaluation
            self.reporter.phase_begin("checkpoint")
            self._ckpt_open = True

    def on_save(self, args, state, control, **kwargs):
        if self.reporter is None:
            return
        if not self._ckpt_open:
            self.reporter.phase_begin("checkpoint")
        self.reporter.phase_end("checkpoint", step=int(state.global_step))
        self._ckpt_open = False

    def on_train_end(self, args, state, control, **kwargs):
        if self.reporter is not None and self._owns:
            self.reporter.close()
