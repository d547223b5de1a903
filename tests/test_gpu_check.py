"""bench/gpu_check.py, the prepared GPU check, run here on a CPU as far as it goes: its parts
against the fake NVML, the whole script with `--fake-nvml` (real agent, watcher, redis-server),
and its clean refusal where there is no GPU, so the script cannot rot before a GPU runs it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pynvml
import pytest

from .fake_nvml import FakeGpu, FakeNvml

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_check.py"
sys.path.insert(0, str(ROOT / "bench"))
import gpu_check  # noqa: E402


def env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), e.get("PYTHONPATH", "")) if p)
    return e


def test_without_a_gpu_it_exits_2_with_one_line(tmp_path):
    p = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path / "x.json")],
        capture_output=True,
        text=True,
        env=env(),
        timeout=120,
    )
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: cannot run here:")
    assert "PyTorch" in lines[0] or "GPU" in lines[0] or "NVML" in lines[0]
    assert "Traceback" not in p.stderr and not (tmp_path / "x.json").exists()


def test_nvml_without_a_driver_is_a_one_line_refusal(monkeypatch):
    def no_driver():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    monkeypatch.setattr(pynvml, "nvmlInit", no_driver)
    with pytest.raises(gpu_check.CheckUnavailable, match="no NVIDIA GPU or driver"):
        gpu_check.open_nvml(None, 0)


def test_call_costs_are_measured_per_call(monkeypatch):
    fake = FakeNvml([FakeGpu("GPU-0")], cpu_cost_s={"nvmlDeviceGetTotalEnergyConsumption": 0.002})
    fake.install(monkeypatch)
    rows = {r["call"]: r for r in gpu_check.measure_calls(pynvml, 0, 25)}
    assert set(rows) == {
        "power usage",
        "instant power field",
        "utilization",
        "energy counter",
        "name",
        "power limit",
    }
    assert rows["energy counter"]["cpu_ms"] == pytest.approx(2.0, rel=0.5)  # the fake's charged CPU
    assert rows["power usage"]["cpu_ms"] < 0.5
    assert fake.counts["nvmlDeviceGetTotalEnergyConsumption"] == 26  # one probe + 25 timed


def test_a_call_the_gpu_lacks_is_reported_not_raised(monkeypatch):
    FakeNvml([FakeGpu("GPU-0", energy=False)]).install(monkeypatch)
    rows = {r["call"]: r for r in gpu_check.measure_calls(pynvml, 0, 5)}
    assert "error" in rows["energy counter"] and "cpu_ms" in rows["utilization"]


def test_cpu_seconds_reads_proc_stat():
    before = gpu_check.cpu_seconds(os.getpid())
    end = time.thread_time() + 0.2
    while time.thread_time() < end:
        pass
    assert gpu_check.cpu_seconds(os.getpid()) - before >= 0.15


@pytest.mark.skipif(not shutil.which("redis-server"), reason="needs redis-server")
def test_the_whole_check_runs_on_the_fake_gpu_and_leaves_nothing_behind(tmp_path):
    out = tmp_path / "summary.json"
    args = ["--out", str(out), "--fake-nvml", "--calls", "20", "--cpu-seconds", "2", "--warmup", "0.5"]
    args += ["--stretches", "compute=3,checkpoint=2,hang=6,idle=2,steps=2", "--book-interval", "1"]
    args += ["--poll", "0.5"]
    p = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env(), timeout=300
    )
    assert p.returncode == 0, p.stdout + p.stderr
    s = json.loads(out.read_text())
    assert s["gpu"]["fake"] and s["gpu"]["name"] == "NVIDIA H200" and s["gpu"]["power_limit_w"] == 700
    calls = {r["call"]: r for r in s["nvml_calls"]}
    assert calls["energy counter"]["cpu_ms"] > 3  # R9's 3.9 ms, charged by the fake and measured
    assert [r["hz"] for r in s["agent_cpu"]] == [1.0, 10.0]
    assert all(r["cpu_pct"] >= 0 for r in s["agent_cpu"])
    rows = {r["stretch"]: r for r in s["stretches"]}
    # R9's levels come back out of the 100-ms trace, stretch by stretch.
    assert rows["compute"]["power_w_median"] == 692 and rows["compute"]["util_pct_median"] == 100
    assert rows["checkpoint"]["power_w_median"] == 124.1 and rows["checkpoint"]["util_pct_median"] == 0
    assert rows["hang"]["power_w_median"] == 124.1 and rows["hang"]["util_pct_median"] == 100
    assert rows["idle"]["power_w_median"] == 123.7 and rows["idle"]["util_pct_median"] == 0
    assert "compute" in rows["compute"]["bands_on_metrics"]  # scraped from the real agent
    assert "running" in rows["compute"]["watcher_states"]  # scraped from the real watcher
    assert {"detect_band_deadlock_s", "detect_watcher_hung_s", "watcher_suspect_rank"} <= set(rows["hang"])
    # Time to detection of every stretch's band and watcher state, in seconds and agent rounds.
    for name in gpu_check.STRETCHES:
        assert {"detect_band_s", "detect_band_rounds", "detect_watcher_s", "detect_watcher_rounds"} <= set(
            rows[name]
        )
    assert rows["compute"]["detect_band_s"] is not None and rows["compute"]["detect_watcher_s"] is not None
    # The 6-s hang is seen (1-s samples here: two clear of the last step, two to confirm).
    assert rows["hang"]["detect_band_s"] is not None and rows["hang"]["watcher_suspect_rank"] == 0
    assert rows["hang"]["detect_watcher_s"] is not None
    assert "allowance_on_s" in rows["checkpoint"] and "allowance_off_s" in rows["hang"]
    assert rows["final ledger"]["booked_total_s"].get("productive", 0) > 1  # read from the ledger
    assert "(a) NVML call cost" in p.stdout and "(b) the agent's CPU" in p.stdout
    assert p.stdout.count("detection:") == 5
    # Everything it started is gone: redis-server, 2 agents for (b), the agent and the watcher.
    assert len(s["started_pids"]) == 5
    assert not [pid for pid in s["started_pids"] if Path(f"/proc/{pid}").exists()]
