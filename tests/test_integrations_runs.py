"""The Hugging Face and Lightning callbacks in tiny real runs (CPU, models built from configs,
nothing downloaded): epoch strategies, a Lightning resume from a checkpoint, a second
train()/fit() on one callback, unique default job names."""

from __future__ import annotations

import shutil

import pytest

from .tiny_runs import (
    booked_steps,
    events,
    hf_trainer,
    job_names,
    pl_callback,
    pl_loader,
    pl_module,
    pl_trainer,
    timeline,
)

pytest.importorskip("torch", reason="torch is an optional extra")


# ---- Hugging Face ------------------------------------------------------------------------------
def _hf(tmp_path, prefix, job=None, **args_kw):
    return hf_trainer(tmp_path, prefix, job, n_layer=2, samples=16, **args_kw)


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
    evs = events(prefix, "hf-epoch")
    ckpt = [e.ts for e in evs if e.type == "phase" and e.get("name") == "checkpoint"]
    assert ckpt[1] > ckpt[0] and ckpt[3] > ckpt[2]  # the save lies between: not one instant
    assert (tmp_path / "out" / "checkpoint-4").is_dir()


def test_hf_an_unnamed_second_train_is_a_second_run_of_its_job_and_voids_nothing(prefix, tmp_path):
    """Without `run_name` the job is named by its output directory (and the user): a second
    train() is a new run of the same job, after the first one's clean end: its steps 1-2 again
    void nothing (4 completed, 4 valid)."""
    trainer, _ = _hf(tmp_path, prefix, max_steps=2, save_strategy="no")
    trainer.train()
    trainer.train()  # the same callback, a second run
    [job] = job_names(prefix)
    assert job.startswith("out-")
    once = [("run", "start"), ("step", 1), ("step", 2), ("run", "end")]
    assert timeline(prefix, job) == once + once
    assert booked_steps(prefix, job) == (4, 0)
    named, _ = _hf(tmp_path, prefix, max_steps=1, save_strategy="no", run_name="my run #1")
    named.train()
    assert "my-run-1" in job_names(prefix)


def test_hf_resume_from_checkpoint_without_a_run_name_is_the_same_job_and_voids_the_redone_steps(
    prefix, tmp_path
):
    """`resume_from_checkpoint=True` after a run of 4 steps that saved at 2 and 4, told to
    resume from step 2: the resume's steps 3-4 redo the first run's 3-4, in the same job (its
    default name is the output directory's, not the start time's), so those are voided: 6
    completed, 2 voided, 4 valid."""
    first, _ = _hf(tmp_path, prefix, max_steps=4, save_strategy="steps", save_steps=2)
    first.train()
    ckpt = tmp_path / "out" / "checkpoint-4"
    assert ckpt.is_dir()
    shutil.rmtree(ckpt)  # the run is resumed from its checkpoint at step 2
    again, _ = _hf(tmp_path, prefix, max_steps=4, save_strategy="steps", save_steps=2)
    again.train(resume_from_checkpoint=True)
    [job] = job_names(prefix)
    assert booked_steps(prefix, job) == (6, 2)


# ---- Lightning ---------------------------------------------------------------------------------
def _pl_trainer(L, tmp_path, cb, max_steps, ckpt=None):
    return pl_trainer(L, tmp_path, [cb, *([ckpt] if ckpt else [])], max_steps, accumulate_grad_batches=2)


def test_lightning_resume_from_a_checkpoint_posts_run_resume_and_no_bogus_step(prefix, tmp_path):
    L, Tiny = pl_module()
    loader = pl_loader(64)

    def cb():
        return pl_callback(prefix, tmp_path, "pl-resume", tokens_per_batch=lambda b: len(b[0]))

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
    evs = events(prefix, "pl-resume")
    resume = [e for e in evs if e.type == "run" and e.get("state") == "resume"]
    assert [e.get("step") for e in resume] == [2]
    steps = [e for e in evs if e.type == "step"]
    assert [e.get("step") for e in steps] == [1, 2, 3, 4, 3, 4]
    # The second fit resumes the first run (its `run start`, then `run resume 2` before any step):
    # the redone steps 3-4 are voided.
    assert booked_steps(prefix, "pl-resume") == (6, 2)
    assert all(e.get("tokens") == 16 for e in steps)  # two micro-batches of 8, never half a step


def test_lightning_second_fit_reopens_and_unnamed_fits_get_their_own_jobs(prefix, tmp_path):
    L, Tiny = pl_module()
    loader = pl_loader(32)
    cb = pl_callback(prefix, tmp_path)
    _pl_trainer(L, tmp_path, cb, 2).fit(Tiny(), loader)
    _pl_trainer(L, tmp_path, cb, 2).fit(Tiny(), loader)
    jobs = job_names(prefix)
    assert len(jobs) == 2 and all(j.startswith("root-") for j in jobs)
    for j in jobs:
        got = [x for x in timeline(prefix, j) if x[0] in ("run", "step")]
        assert got == [("run", "start"), ("step", 1), ("step", 2), ("run", "end")]
    # With a job named, a second fit() is the job's second run: its steps 1-2 void nothing.
    named = pl_callback(prefix, tmp_path, "pl-twice")
    _pl_trainer(L, tmp_path, named, 2).fit(Tiny(), loader)
    _pl_trainer(L, tmp_path, named, 2).fit(Tiny(), loader)
    assert booked_steps(prefix, "pl-twice") == (4, 0)
