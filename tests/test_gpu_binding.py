"""The GPU a rank really uses: CUDA_VISIBLE_DEVICES (indices, UUIDs or their prefixes, MIG
devices) mapped through NVML (tests/fake_nvml.py: pynvml's real functions replaced) to the
physical index and UUID, and a truthful log line when that cannot be done."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from costexporter.trainer import detect, reporter
from costexporter.trainer.detect import locate_gpu

from .fake_nvml import FakeGpu, FakeNvml

UUIDS = [f"GPU-{i:08x}-aaaa-bbbb-cccc-dddddddddddd" for i in range(8)]
MIG = ("MIG-11111111-2222-3333-4444-555555555555", "MIG-66666666-2222-3333-4444-555555555555")


@pytest.fixture
def nvml(monkeypatch):
    gpus = [FakeGpu(u) for u in UUIDS]
    gpus[6].mig = MIG
    return FakeNvml(gpus).install(monkeypatch)


@pytest.mark.parametrize(
    ("visible", "local_rank", "want"),
    [
        ("5", 1, 5),  # SLURM per-task binding: one GPU visible, SLURM_LOCALID=1
        ("2,3", 1, 3),  # torchrun: the local rank picks the entry
        (None, 4, 4),  # nothing set: the local rank is the index
        (f"{UUIDS[5]},{UUIDS[6]}", 0, 5),  # whole UUIDs
        ("GPU-00000003", 0, 3),  # a unique prefix, as CUDA takes it
        (MIG[1], 0, 6),  # a MIG device: the GPU that holds it (what the agent samples)
    ],
)
def test_the_visible_entry_maps_to_the_physical_gpu(nvml, monkeypatch, visible, local_rank, want):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    g = locate_gpu(local_rank)
    assert (g.index, g.uuid, g.problem) == (want, UUIDS[want], None)


def test_what_cannot_be_mapped_is_said_not_guessed(nvml, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    g = locate_gpu(3)  # more local ranks than entries
    assert (g.index, g.uuid) == (None, None) and "has no entry 3" in g.source
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-0000")  # a prefix of every GPU: ambiguous
    g = locate_gpu(0)
    assert (g.index, g.uuid) == (None, None) and "knows no GPU" in g.problem
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-99999999-0000-0000-0000-000000000000")
    assert locate_gpu(0).uuid is None


def test_the_reporter_registers_the_mapped_gpu_and_says_truthfully_when_nvml_is_missing(
    nvml, monkeypatch, tmp_path, caplog
):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    rep = reporter.StepReporter("bind", "redis://127.0.0.1:1/0", rank=1, spool_dir=tmp_path, heartbeat_s=3600)
    try:
        assert (rep.gpu_index, rep.gpu_uuid, rep.local_rank) == (5, UUIDS[5], 1)
    finally:
        rep.close(end_run=False, timeout=0)
    # without nvidia-ml-py: index 5 from the one visible GPU, and the log says so
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(detect, "_told_gpu", False)
    with caplog.at_level(logging.INFO, logger="costexporter.client"):
        rep = reporter.StepReporter(
            "bind", "redis://127.0.0.1:1/0", rank=1, spool_dir=tmp_path, heartbeat_s=3600
        )
        rep.close(end_run=False, timeout=0)
    assert (rep.gpu_index, rep.gpu_uuid) == (5, None)
    msg = caplog.text
    assert (
        "nvidia-ml-py is not installed" in msg and "index 5" in msg and "the one GPU this process sees" in msg
    )


def test_a_process_launched_slurm_style_registers_its_bound_gpu(tmp_path):
    """A real process with SLURM's per-task variables and the fake NVML installed in it."""
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})\n"
        "from tests.fake_nvml import FakeGpu, FakeNvml\n"
        f"FakeNvml([FakeGpu(u) for u in {UUIDS!r}]).install_global()\n"
        "from costexporter.trainer.reporter import StepReporter\n"
        f"r = StepReporter('slurm', 'redis://127.0.0.1:1/0', spool_dir={str(tmp_path)!r}, heartbeat_s=3600)\n"
        "print(r.rank, r.local_rank, r.gpu_index, r.gpu_uuid)\n"
        "r.close(end_run=False, timeout=0)\n"
    )
    env = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4", "CUDA_VISIBLE_DEVICES": "5"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env={**os.environ, **env}
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["3", "1", "5", UUIDS[5]]
