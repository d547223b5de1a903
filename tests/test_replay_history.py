"""Last month from what a team already has: `replay --prometheus` books the DCGM series a real
Prometheus holds (loaded with `promtool tsdb create-blocks-from openmetrics`) as the same readings
from a file would be, its pods made jobs by kube-state-metrics' owners; the window is pulled in
chunks and a failing API is retried; a job map (pods, or a SLURM sacct export) names the jobs;
TensorBoard event files written by torch's SummaryWriter give the steps."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from costexporter.core.diagnostics import Diagnostics, InputError
from costexporter.services import history, jobmap, tbsteps
from costexporter.sources.dcgm import PodRef

from . import prom_server
from .conftest import ROOT
from .http_stub import HttpStub
from .redis_server import free_port

PROMETHEUS, PROMTOOL = prom_server.PROMETHEUS, prom_server.PROMTOOL
EXAMPLE = ROOT / "examples" / "r1-mini"
T0 = 1753570000  # the example's first sample (2025-07-26T22:46:40Z)
T_END = T0 + 3595  # its last
UUID = "GPU-0007000{n}-0000-4000-8000-00000000000{n}"
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None or PROMTOOL is None, reason="prometheus/promtool not installed (.ci/run installs them)"
)


def _readings() -> list[tuple[int, str, int, float, float]]:
    """(epoch s, host, index, power W, util %) of the example's two hosts."""
    out = []
    for host in ("node0", "node1"):
        for line in (EXAMPLE / f"{host}.csv").read_text().splitlines()[1:]:
            ts, idx, _uuid, pw, ut = (x.strip() for x in line.split(","))
            t = dt.datetime.strptime(ts, "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=dt.timezone.utc)
            out.append((int(t.timestamp()), host, int(idx), float(pw.split()[0]), float(ut.split()[0])))
    return out


def _pod(host: str, t: int) -> tuple[str, str] | None:
    """Who holds a host's GPUs when: the PyTorchJob llama-7b's worker pods for the first 30
    minutes, nothing for 10, then a pod of a bare Deployment on node1 only."""
    if t < T0 + 1800:
        return "ml", f"llama-7b-worker-{host[-1]}"
    if t >= T0 + 2400 and host == "node1":
        return "nlp", "bert-serve-7d9f8c6b5-x2k9q"
    return None


def _openmetrics(rows) -> str:
    out = []
    for metric, k in (("DCGM_FI_DEV_POWER_USAGE", 3), ("DCGM_FI_DEV_GPU_UTIL", 4)):
        out.append(f"# TYPE {metric} gauge")
        series: dict[str, list[str]] = {}
        for r in rows:
            t, host, idx = r[0], r[1], r[2]
            n = idx + (4 if host == "node1" else 0)
            labels = f'gpu="{idx}",UUID="{UUID.format(n=n)}",Hostname="{host}",modelName="NVIDIA B300"'
            pod = _pod(host, t)
            if pod:
                labels += f',namespace="{pod[0]}",pod="{pod[1]}",container="main"'
            series.setdefault(labels, []).append(f"{metric}{{{labels}}} {r[k]} {t}")
        for lines in series.values():
            out += lines
    out.append("# TYPE kube_pod_owner gauge")
    for host in ("node0", "node1"):
        out.append(
            f'kube_pod_owner{{namespace="ml",pod="llama-7b-worker-{host[-1]}",owner_kind="PyTorchJob",'
            f'owner_name="llama-7b-run3",owner_is_controller="true"}} 1 {T0}'
        )
    out.append("# EOF")
    return "\n".join(out) + "\n"


@pytest.fixture(scope="module")
def prom(tmp_path_factory):
    """A real Prometheus serving the example's readings as dcgm-exporter series."""
    d = tmp_path_factory.mktemp("prom")
    om = d / "dcgm.om"
    om.write_text(_openmetrics(_readings()))
    tsdb = d / "tsdb"
    r = subprocess.run(
        [PROMTOOL, "tsdb", "create-blocks-from", "openmetrics", str(om), str(tsdb)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    (d / "prometheus.yml").write_text("global:\n  scrape_interval: 1m\n")
    port = free_port()
    proc = prom_server.start(d / "prometheus.yml", port, tsdb, "--storage.tsdb.retention.time=100y")
    url = f"http://127.0.0.1:{port}"
    if not prom_server.wait_ready(url):
        proc.kill()
        pytest.fail("prometheus did not become ready")
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def _csv(path: Path, rows, keep=lambda r: True) -> None:
    lines = ["timestamp, index, uuid, power.draw [W], utilization.gpu [%], name"]
    for t, host, idx, p, u in rows:
        if keep((t, host, idx, p, u)):
            n = idx + (4 if host == "node1" else 0)
            stamp = dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y/%m/%d %H:%M:%S.000")
            lines.append(f"{stamp}, {idx}, {UUID.format(n=n)}, {p:.2f} W, {u:.0f} %, NVIDIA B300")
    path.write_text("\n".join(lines) + "\n")


def _report(cli, *args) -> dict:
    r = cli("replay", *args, "--format", "json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout) | {"_stderr": r.stderr}


def _figures(job: dict) -> dict:
    return {k: job[k] for k in ("gpu_hours", "band_gpu_hours", "energy_kwh", "cost_total")}


@needs_prometheus
def test_a_prometheus_window_bills_as_the_same_readings_from_files(cli, prom, tmp_path):
    """Each pod's stretch is a job's: the PyTorchJob llama-7b-run3 (its owner, from
    kube-state-metrics: the pod names alone say 'llama-7b'), then a Deployment's pod on node1;
    the GPUs nobody held in between are unassigned. The same readings as nvidia-smi CSVs, each job's
    part replayed by itself, give the same figures."""
    got = _report(cli, "--prometheus", prom, "--start", str(T0), "--end", str(T_END), "--interval", "5")
    assert set(got["jobs"]) == {"ml:llama-7b-run3", "nlp:bert-serve"}, got["_stderr"]
    rows = _readings()
    for job, keep in (
        ("ml:llama-7b-run3", lambda r: _pod(r[1], r[0]) == ("ml", f"llama-7b-worker-{r[1][-1]}")),
        ("nlp:bert-serve", lambda r: _pod(r[1], r[0]) == ("nlp", "bert-serve-7d9f8c6b5-x2k9q")),
    ):
        hosts = ("node1",) if job == "nlp:bert-serve" else ("node0", "node1")
        for host in hosts:
            _csv(tmp_path / f"{host}.csv", rows, lambda r, h=host, k=keep: r[1] == h and k(r))
        files = [a for h in hosts for a in ("--samples", f"{h}={tmp_path / f'{h}.csv'}")]
        want = _report(cli, *files, "--job", job)["jobs"][job]
        assert _figures(got["jobs"][job]) == _figures(want), job
    held = 8 * 1800 + 4 * (T_END + 5 - T0 - 2400)
    assert got["unassigned"]["gpu_hours"] == pytest.approx((8 * (T_END + 5 - T0) - held) / 3600, abs=1e-6)


@needs_prometheus
def test_the_window_is_pulled_in_chunks_and_a_failing_api_retried(prom, monkeypatch):
    """A 503 twice, then the real answers; the window in pieces of 50 points: the same samples
    as one query of the whole."""
    whole_chunk, _ = history.read_prometheus(
        history.Prometheus(prom), T0, T_END, 5.0, Diagnostics(stream=None)
    )
    failures = {"left": 2}

    def answer(path: str):
        if failures["left"] > 0:
            failures["left"] -= 1
            return 503, "text/plain", b"overloaded"
        with urllib.request.urlopen(prom + path, timeout=30) as r:
            return 200, "application/json", r.read()

    stub = HttpStub(answer)
    try:
        monkeypatch.setattr(history, "MAX_POINTS", 50)
        api = history.Prometheus(stub.url, sleep=lambda _s: None)
        chunk, spans = history.read_prometheus(api, T0, T_END, 5.0, Diagnostics(stream=None))
    finally:
        stub.close()
    assert failures["left"] == 0 and api.queries >= 4 * (720 // 50) + 2
    for name in ("ts_ms", "power_w", "util_pct", "index"):
        assert np.array_equal(getattr(chunk, name), getattr(whole_chunk, name)), name
    assert len(chunk.ts_ms) == 8 * 720 and {s.pod.pod for s in spans} >= {"llama-7b-worker-0"}


def test_a_prometheus_that_refuses_is_one_line_exit_2(cli):
    stub = HttpStub(
        lambda _p: (400, "application/json", b'{"status":"error","error":"parse error at char 3"}')
    )
    try:
        r = cli("replay", "--prometheus", stub.url, "--start", str(T0), "--end", str(T_END))
    finally:
        stub.close()
    assert r.returncode == 2 and "Traceback" not in r.stderr and "parse error at char 3" in r.stderr


def test_pods_are_named_by_a_job_map_before_their_owner(tmp_path):
    spans = [
        history.PodSpan(PodRef("ml", "llama-7b-worker-0"), "node0", 0, "GPU-a", 0, 10_000),
        history.PodSpan(PodRef("ml", "llama-7b-worker-0"), "node0", 1, "GPU-b", 0, 10_000),
        history.PodSpan(PodRef("ci", "smoke-x7k2p"), "node1", 0, None, 5_000, 8_000),
    ]
    owners = {
        ("ml", "llama-7b-worker-0"): history.PodFacts(
            owner_refs=[{"kind": "PyTorchJob", "name": "llama-7b-run3", "controller": True}]
        )
    }
    assert jobmap.pod_jobs(spans, None, owners) == {
        spans[0].pod: "ml:llama-7b-run3",
        spans[2].pod: "ci:smoke",
    }
    (tmp_path / "map.csv").write_text("namespace,pod,job\nml,llama-7b-worker-0,llama-ablation-3\n")
    jm = jobmap.load(tmp_path / "map.csv", "UTC")
    assert jobmap.pod_jobs(spans, jm, owners)[spans[0].pod] == "llama-ablation-3"
    evs = jobmap.span_events(spans, jobmap.pod_jobs(spans, jm, owners), 1000)
    regs = [(e.job, e.rank, e.get("host"), e.get("gpu")) for e in evs if e.type == "register"]
    assert regs == [
        ("ci:smoke", 0, "node1", 0),
        ("llama-ablation-3", 0, "node0", 0),
        ("llama-ablation-3", 1, "node0", 1),
    ]
    ends = {e.job: e.ts_ms for e in evs if e.type == "run"}
    assert ends == {"ci:smoke": 9_000, "llama-ablation-3": 11_000}


def test_a_slurm_export_places_whole_node_jobs_by_node_and_time(cli, tmp_path):
    rows = _readings()
    files = []
    for host in ("node0", "node1"):
        _csv(tmp_path / f"{host}.csv", rows, lambda r, h=host: r[1] == h)
        files += ["--samples", f"{host}={tmp_path / f'{host}.csv'}"]
    at = [f"{dt.datetime.fromtimestamp(T0 + m * 60, dt.timezone.utc):%Y-%m-%dT%H:%M:%S}" for m in (0, 20, 30)]
    (tmp_path / "sacct.txt").write_text(
        "JobID|JobName|NodeList|Start|End|AllocTRES\n"
        f"101|pretrain|node[0-1]|{at[0]}|{at[1]}|cpu=64,gres/gpu=8,node=2\n"
        f"101.batch|batch|node0|{at[0]}|{at[1]}|cpu=32\n"
        f"102|sweep|node1|{at[2]}|Unknown|cpu=8,gres/gpu=2,node=1\n"
    )
    got = _report(cli, *files, "--job-map", tmp_path / "sacct.txt")
    assert set(got["jobs"]) == {"pretrain-101"}
    assert got["jobs"]["pretrain-101"]["gpu_hours_total"] == pytest.approx(8 * 20 / 60)
    assert "SLURM job 102 holds 2 of node1's 4 GPUs" in got["_stderr"]
    assert jobmap.expand_hostlist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]


@pytest.fixture(scope="module")
def trainer_events():
    return [json.loads(x) for x in (EXAMPLE / "events.jsonl").read_text().splitlines() if x.strip()]


def _tensorboard(path: Path, steps: list[tuple[float, int]]) -> None:
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(log_dir=str(path))
    for wall, step in steps:
        w.add_scalar("train/loss", 2.0 / (1 + step), global_step=step, walltime=wall)
    w.close()


def test_tensorboard_steps_bill_as_the_trainers_own(cli, tmp_path, trainer_events):
    """Every step logged: the same bill as the trainer's step events. Every 10th logged: the
    same step count (the steps between spread over the interval). A step going back: a resume
    from that checkpoint, the steps above it voided."""
    pytest.importorskip("tensorboard")
    steps = [(e["ts"], e["step"]) for e in trainer_events if e["type"] == "step" and e["rank"] == 0]
    others = tmp_path / "no-steps.jsonl"
    others.write_text("".join(json.dumps(e) + "\n" for e in trainer_events if e["type"] != "step"))
    samples = [a for h in ("node0", "node1") for a in ("--samples", f"{h}={EXAMPLE / f'{h}.csv'}")]
    want = _report(cli, *samples, "--events", EXAMPLE / "events.jsonl")["jobs"]["qwen3-mini"]
    _tensorboard(tmp_path / "every", steps)
    got = _report(
        cli,
        *samples,
        "--events",
        others,
        "--steps-from-tensorboard",
        tmp_path / "every",
        "--tag",
        "train/loss",
    )["jobs"]["qwen3-mini"]
    assert _figures(got) == _figures(want) and got["valid_steps"] == want["valid_steps"] == 420
    _tensorboard(tmp_path / "tenth", [s for s in steps if s[1] % 10 == 0 or s[1] == 1])
    got = _report(
        cli,
        *samples,
        "--events",
        others,
        "--steps-from-tensorboard",
        tmp_path / "tenth",
        "--tag",
        "train/loss",
    )["jobs"]["qwen3-mini"]
    assert got["valid_steps"] == 420 and got["steps_voided"] == 0
    resumed = [s for s in steps if s[1] <= 200] + [(wall + 1000, step) for wall, step in steps if step > 150]
    _tensorboard(tmp_path / "resumed", [s for s in resumed if s[0] <= T0 + 3595])
    got = _report(
        cli,
        *samples,
        "--events",
        others,
        "--steps-from-tensorboard",
        tmp_path / "resumed",
        "--tag",
        "train/loss",
    )["jobs"]["qwen3-mini"]
    assert got["steps_voided"] == 50, got


def test_tensorboard_without_the_tag_names_the_tags(tmp_path):
    pytest.importorskip("tensorboard")
    _tensorboard(tmp_path / "tb", [(T0 + 5.0, 1), (T0 + 10.0, 2)])
    with pytest.raises(InputError, match="no tag 'loss' \\(tags: train/loss\\)"):
        tbsteps.logged_steps(tmp_path / "tb", "loss")
    assert tbsteps.logged_steps(tmp_path / "tb", "train/loss") == [(T0 + 5.0, 1), (T0 + 10.0, 2)]


def test_job_map_names_are_made_job_names_as_the_kubernetes_path_makes_them(tmp_path):
    from costexporter.core.model import GpuId

    evs = jobmap.slurm_events(
        [jobmap.SlurmJob("7", "my run {a}", ("n1",), 0, 60_000, None)],
        [GpuId("n1", 0, "GPU-0", None, None)],
        60_000,
        Diagnostics(stream=None),
    )
    assert {e.job for e in evs} == {"my-run--a--7"}
    (tmp_path / "map.csv").write_text("pod,job\nw-0,team a/run 1\n")
    assert jobmap.load(tmp_path / "map.csv", "UTC").pods == {("", "w-0"): "team-a-run-1"}
