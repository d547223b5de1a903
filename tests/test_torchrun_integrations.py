"""The Hugging Face and Lightning callbacks in real 2-rank runs under torchrun (CPU, gloo).

What a single process cannot show: every rank reports into the same job (an unnamed run's name is
rank 0's, agreed across the ranks), only rank 0 carries the global batch's tokens, and each rank's
second `train()`/`fit()` on the same callback is a new run of its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import SHARED_URL
from .tiny_runs import _redis, booked_steps, events, job_names

pytest.importorskip("torch", reason="torch is an optional extra")
HERE = Path(__file__).parent


def torchrun(script: str, *args: object) -> None:
    env = {**os.environ, "PYTHONPATH": str(HERE.parent), "OMP_NUM_THREADS": "1"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env["COSTEXPORTER_REDIS_URL"] = SHARED_URL
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    r = subprocess.run(
        [*cmd, str(HERE / "helpers" / script), *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])


def per_rank(prefix: str, job: str) -> dict[int, list[tuple]]:
    """Each rank's events as short tuples: (type, step or phase name, state, tokens)."""
    out: dict[int, list[tuple]] = {0: [], 1: []}
    for e in events(prefix, job):
        if e.type == "step":
            out[e.rank].append(("step", e.get("step"), e.get("tokens")))
        elif e.type == "phase":
            out[e.rank].append((e.get("name"), e.get("state"), e.get("step")))
        elif e.type in ("run", "register"):
            out[e.rank].append((e.type, e.get("state"), e.get("step")))
    return out


def steps(tokens: int | None, *ks: int) -> list[tuple]:
    return [("step", k, tokens) for k in ks]


def saved(k: int) -> list[tuple]:
    return [("checkpoint", "begin", None), ("checkpoint", "end", k)]


def epoch(tokens: int | None, first: int) -> list[tuple]:
    """An epoch of two steps, then its eval and its save (strategies "epoch")."""
    return [
        *steps(tokens, first, first + 1),
        ("eval", "begin", None),
        ("eval", "end", None),
        *saved(first + 1),
    ]


def test_hf_under_torchrun_two_ranks_one_job_two_runs_epoch_phases_and_rank_0_tokens(prefix, tmp_path):
    """Two train() on one output directory: one job (its default name is the directory's), two
    runs of it, each rank's events in both; the second run voids nothing of the first."""
    pytest.importorskip("transformers", reason="transformers is the [hf] extra")
    torchrun("hf_torchrun.py", prefix, tmp_path)
    [job] = job_names(prefix)
    assert job.startswith("out-"), job
    assert sorted(_redis().hkeys(f"{prefix}:t:{{{job}}}:ranks")) == ["0", "1"]  # both ranks in it
    got = per_rank(prefix, job)
    for rank in (0, 1):
        tokens = 4 * 16 * 2 if rank == 0 else None  # the global batch: 4 x 16 tokens x 2 ranks
        run = [
            ("register", None, None),
            ("run", "start", None),
            *epoch(tokens, 1),
            *epoch(tokens, 3),
            ("run", "end", None),
        ]
        assert got[rank] == run + run, (rank, got[rank])
    assert booked_steps(prefix, job) == (8, 0)


def test_lightning_under_torchrun_resumes_from_a_checkpoint_in_a_second_fit(prefix, tmp_path):
    pytest.importorskip("lightning.pytorch", reason="lightning is the [lightning] extra")
    torchrun("lightning_torchrun.py", "pl-ddp", prefix, tmp_path)
    got = per_rank(prefix, "pl-ddp")
    for rank in (0, 1):
        tokens = 2 * 8 * 2 if rank == 0 else None  # two micro-batches of 8 on each of 2 ranks
        assert got[rank] == [
            ("register", None, None),
            ("run", "start", None),
            *steps(tokens, 1, 2),
            *saved(2),
            *steps(tokens, 3, 4),
            *saved(4),
            ("run", "end", None),
            # The second fit: a new run that resumes at the restored step, no bogus step before it
            # (Lightning's ModelCheckpoint saves step 2 again once the checkpoint is restored).
            ("register", None, None),
            ("run", "start", None),
            ("run", "resume", 2),
            *saved(2),
            *steps(tokens, 3, 4),
            *saved(4),
            ("run", "end", None),
        ], (rank, got[rank])
