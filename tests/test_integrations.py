"""The Hugging Face and Lightning callbacks in tiny real training runs on CPU (nothing downloaded)."""

from __future__ import annotations

import pytest

from .conftest import SHARED_URL
from .tiny_runs import events, hf_trainer, pl_callback, pl_loader, pl_module, pl_trainer, timeline


def test_hugging_face_trainer_posts_steps_evals_and_checkpoints(prefix, tmp_path):
    trainer, _ = hf_trainer(
        tmp_path,
        prefix,
        "hf-tiny",
        max_steps=6,
        eval_strategy="steps",
        eval_steps=3,
        save_strategy="steps",
        save_steps=3,
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
    steps = [e for e in events(prefix, "hf-tiny") if e.type == "step"]
    assert all(int(e.get("tokens")) == 4 * 16 for e in steps)  # the batch's tokens, per step
    # its total steps, for the cost to finish
    assert [e.get("total_steps") for e in events(prefix, "hf-tiny") if e.type == "meta"] == [6]


def test_lightning_trainer_posts_steps_evals_and_checkpoints(prefix, tmp_path):
    L, Tiny = pl_module()
    loader = pl_loader(64)
    cb = pl_callback(prefix, tmp_path, "pl-tiny", tokens_per_batch=lambda b: len(b[0]))
    ckpt = L.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    trainer = pl_trainer(L, tmp_path, [ckpt, cb], 6, val_check_interval=3, limit_val_batches=2)
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
    assert [e.get("total_steps") for e in events(prefix, "pl-tiny") if e.type == "meta"] == [6]


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
    L, Tiny = pl_module()

    class Diverges(Tiny):
        def training_step(self, batch, i):
            if i == 3:
                raise FloatingPointError("loss is NaN")
            return super().training_step(batch, i)

    cb = pl_callback(prefix, tmp_path, "pl-crash")
    trainer = pl_trainer(L, tmp_path, [cb], 6, enable_checkpointing=False)
    with pytest.raises(FloatingPointError):
        trainer.fit(Diverges(), pl_loader(64))
    assert timeline(prefix, "pl-crash") == [("run", "start"), ("step", 1), ("step", 2), ("step", 3)]
