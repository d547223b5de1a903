"""The GPU check: what NVML costs, what the agent costs, and what a real job looks like to us.

Run on a machine with an NVIDIA GPU, PyTorch and a `redis-server` binary (no network needed),
from the repository root (docs/gpu-check.md says what to carry to an air-gapped machine):

    python bench/gpu_check.py --out gpu_check.json

It prints, and writes to --out as JSON:
  (a) the CPU cost of each NVML call the source makes (power usage, instant power field,
      utilization, energy counter, name, power limit), over --calls calls each;
  (b) the agent's CPU (`costexporter serve --source nvml`, from /proc/<pid>/stat) sampling at
      1 Hz and at 10 Hz, against a private redis-server on a free port;
  (c) a real PyTorch job posting through StepReporter, in stretches: bf16 matmul steps, a
      declared checkpoint, a silent hang (a kernel spinning on a device flag, no steps), idle
      with the CUDA context alive, steps again; with the agent, the watcher and a 100-ms NVML
      trace recorder running. Per stretch: NVML power/utilization medians, the bands seen on
      the agent's /metrics, the categories booked in the ledger meanwhile, and the time to
      detection (seconds and agent rounds from the stretch's start to the first scrape with
      the band it should show and the watcher's state for it; the hang: `deadlock`, `hung`).
Everything it starts it stops. Without PyTorch, a GPU, NVML or redis-server it exits 2 with a
one-line reason. `--fake-nvml` (tests only) runs all of it on a CPU against tests/fake_nvml.py.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JOB = "gpu-check"
PREFIX = "gpucheck"
# R9 (an H200): the levels the fake reproduces, stretch by stretch.
FAKE_LEVELS = {
    "compute": (692_000, 100),
    "checkpoint": (124_100, 0),
    "hang": (124_100, 100),
    "idle": (123_700, 0),
    "steps": (692_000, 100),
}
STRETCHES = ("compute", "checkpoint", "hang", "idle", "steps")
# What each stretch should look like: the band on /metrics and the watcher's state. Time to
# detection is from the stretch's start to the first scrape showing it (a single GPU's checkpoint
# at 0% is `idle` to the bands: the phase, not the power, makes it overhead).
EXPECT = {
    "compute": ("compute", "running"),
    "checkpoint": ("idle", "running"),
    "hang": ("deadlock", "hung"),
    "idle": ("idle", "running"),
    "steps": ("compute", "running"),
}
STARTED: list[int] = []  # every child's pid, reported so a test can check each one is gone


class CheckUnavailable(Exception):
    """This machine cannot run the check; the message is the one-line reason."""


# ---- processes ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process from /proc/<pid>/stat (fields 14 and 15, after the name)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def started(cmd: list[str], env: dict | None = None, log: Path | None = None) -> Iterator[subprocess.Popen]:
    """A child process, stopped (TERM, then KILL) however the block ends."""
    out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115 - closed below
    p = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    STARTED.append(p.pid)
    try:
        yield p
    finally:
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if log:
            out.close()


@contextlib.contextmanager
def redis_server(workdir: Path) -> Iterator[str]:
    """A private redis-server on a free port, nothing on disk; yields its URL."""
    exe = shutil.which("redis-server")
    if not exe:
        raise CheckUnavailable("no redis-server on PATH (carry the binary, see docs/gpu-check.md)")
    port = free_port()
    cmd = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    cmd += ["--dir", str(workdir)]
    with started(cmd, log=workdir / "redis.log"):
        import redis

        r = redis.Redis(port=port)
        deadline = time.monotonic() + 10
        while True:
            try:
                r.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise CheckUnavailable("redis-server did not start") from None
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"


def costexporter_cmd(fake_state: Path | None) -> list[str]:
    """How to run the CLI: plainly, or with the file-driven fake NVML installed first."""
    if fake_state is None:
        return [sys.executable, "-m", "costexporter.cli"]
    boot = "from tests.fake_nvml import boot_from_env; boot_from_env()\n"
    boot += "from costexporter.cli import run; run()"
    return [sys.executable, "-c", boot]


def child_env(fake_state: Path | None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    if fake_state is not None:
        env["COSTEXPORTER_FAKE_NVML"] = str(fake_state)
    return env


def scrape(port: int, timeout: float = 2.0) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
        return r.read().decode()


def wait_http(port: int, proc: subprocess.Popen, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before serving /metrics")
        try:
            scrape(port, 0.5)
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"no /metrics on port {port} after {seconds:.0f} s")


# ---- (a) NVML call costs -----------------------------------------------------------------------


def nvml_calls(nv, h) -> dict[str, Callable[[], object]]:
    """The calls NvmlSource makes, by the name the table prints."""
    return {
        "power usage": lambda: nv.nvmlDeviceGetPowerUsage(h),
        "instant power field": lambda: nv.nvmlDeviceGetFieldValues(h, [nv.NVML_FI_DEV_POWER_INSTANT]),
        "utilization": lambda: nv.nvmlDeviceGetUtilizationRates(h),
        "energy counter": lambda: nv.nvmlDeviceGetTotalEnergyConsumption(h),
        "name": lambda: nv.nvmlDeviceGetName(h),
        "power limit": lambda: nv.nvmlDeviceGetEnforcedPowerLimit(h),
    }


def measure_calls(nv, h, n: int) -> list[dict]:
    """CPU (this thread's) and wall time per call, over n calls each; a failing call says why."""
    rows = []
    for name, call in nvml_calls(nv, h).items():
        try:
            call()
        except nv.NVMLError as e:
            rows.append({"call": name, "error": str(e)})
            continue
        c0, w0 = time.thread_time(), time.perf_counter()
        for _ in range(n):
            call()
        cpu, wall = time.thread_time() - c0, time.perf_counter() - w0
        rows.append({"call": name, "n": n, "cpu_ms": cpu / n * 1000, "wall_ms": wall / n * 1000})
    return rows


def print_calls(rows: list[dict], gpus: int = 8) -> None:
    print(f"\n(a) NVML call cost, per call; % of one core if read per sample for {gpus} GPUs")
    print(f"{'call':<22}{'CPU ms':>10}{'wall ms':>10}{'@1 Hz':>10}{'@10 Hz':>10}")
    for r in rows:
        if "error" in r:
            print(f"{r['call']:<22}  unavailable: {r['error']}")
            continue
        pct = r["cpu_ms"] / 1000 * gpus * 100
        print(f"{r['call']:<22}{r['cpu_ms']:>10.3f}{r['wall_ms']:>10.3f}{pct:>9.2f}%{pct * 10:>9.2f}%")


# ---- (b) the agent's CPU -----------------------------------------------------------------------


def agent_cpu(redis_url: str, hz: float, seconds: float, warmup: float, fake_state, workdir: Path) -> dict:
    """The agent's CPU% over `seconds` (after `warmup`), sampling at `hz`, 5-s rounds."""
    port = free_port()
    cmd = [
        *costexporter_cmd(fake_state),
        "serve", "--source", "nvml", "--redis-url", redis_url, "--prefix", f"{PREFIX}cpu{int(hz)}",
        "--listen", "127.0.0.1", "--port", str(port), "--sample-interval", str(1 / hz),
    ]  # fmt: skip
    with started(cmd, child_env(fake_state), workdir / f"agent-{hz:g}hz.log") as p:
        wait_http(port, p)
        time.sleep(warmup)
        c0, t0 = cpu_seconds(p.pid), time.monotonic()
        time.sleep(seconds)
        c1, t1 = cpu_seconds(p.pid), time.monotonic()
    return {"hz": hz, "seconds": round(t1 - t0, 2), "cpu_pct": (c1 - c0) / (t1 - t0) * 100}


# ---- (c) the job in stretches ------------------------------------------------------------------


@dataclass
class Timeline:
    """What the pollers saw, stamped with wall time: bands, watcher states, ledger snapshots."""

    bands: list[tuple[float, str]] = field(default_factory=list)
    allowance: list[tuple[float, float]] = field(default_factory=list)  # costexporter_job_in_allowance
    states: list[tuple[float, str, int]] = field(default_factory=list)
    stretches: list[tuple[str, float, float]] = field(default_factory=list)
    booked: dict[str, dict[str, float]] = field(default_factory=dict)


BAND_RE = re.compile(r'^costexporter_gpu_band\{[^}]*band="(\w+)"[^}]*\} 1(\.0)?$', re.M)
STATE_RE = re.compile(r'^costexporter_job_state\{[^}]*costexporter_job_state="(\w+)"[^}]*\} 1(\.0)?$', re.M)
SUSPECT_RE = re.compile(r"^costexporter_job_suspect_rank\{[^}]*\} (\S+)$", re.M)
ALLOWANCE_RE = re.compile(r"^costexporter_job_in_allowance\{[^}]*\} (\S+)$", re.M)


def poll_metrics(agent_port: int, watch_port: int, tl: Timeline, stop: threading.Event, every: float) -> None:
    while not stop.is_set():
        now = time.time()
        with contextlib.suppress(OSError):
            text = scrape(agent_port)
            bands = BAND_RE.findall(text)
            tl.bands.append((now, ",".join(sorted({b for b, _ in bands})) or "-"))
            flag = ALLOWANCE_RE.findall(text)
            if flag:
                tl.allowance.append((now, float(flag[0])))
        with contextlib.suppress(OSError):
            text = scrape(watch_port)
            st = STATE_RE.findall(text)
            sus = SUSPECT_RE.findall(text)
            tl.states.append((now, st[0][0] if st else "-", int(float(sus[0])) if sus else -1))
        stop.wait(every)


def record_trace(nv, handles: list, path: Path, stop: threading.Event, every: float = 0.1) -> None:
    """NVML every 100 ms to CSV, as the field recordings are made (R8)."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["ts", "gpu", "power_w", "util_pct"])
        while not stop.is_set():
            now = time.time()
            for i, h in enumerate(handles):
                with contextlib.suppress(nv.NVMLError):
                    p = nv.nvmlDeviceGetPowerUsage(h) / 1000
                    u = nv.nvmlDeviceGetUtilizationRates(h).gpu
                    w.writerow([f"{now:.3f}", i, f"{p:.1f}", u])
            stop.wait(every)


def ledger_seconds(redis_url: str) -> dict[str, float]:
    import redis

    from costexporter.store import ledger

    r = redis.Redis.from_url(redis_url)
    net = ledger.net_ms(ledger.read_amounts(r, PREFIX, JOB))
    return {c: ms / 1000 for c, ms in net.items() if ms}


class FakeJob:
    """The stretches on the fake GPU: the state file sets R9's levels, steps come on a timer."""

    def __init__(self, state: Path, step_s: float = 0.5) -> None:
        self.state, self.step_s = state, step_s

    def level(self, stretch: str) -> None:
        power, util = FAKE_LEVELS[stretch]
        tmp = self.state.with_suffix(".tmp")
        tmp.write_text(json.dumps({"0": {"power_mw": power, "util": util}}))
        os.replace(tmp, self.state)

    def run(self, stretch: str, seconds: float, rep, step: list[int]) -> None:
        self.level(stretch)
        end = time.monotonic() + seconds
        if stretch == "checkpoint":
            rep.phase_begin("checkpoint", step=step[0])
        while time.monotonic() < end:
            time.sleep(min(self.step_s, max(0.0, end - time.monotonic())))
            if stretch in ("compute", "steps") and time.monotonic() <= end:
                step[0] += 1
                rep.step(step[0])
        if stretch == "checkpoint":
            rep.phase_end("checkpoint", step=step[0])


class TorchJob:
    """The stretches on the real GPU with PyTorch."""

    SPIN_SRC = r"""
    extern "C" __global__ void spin(volatile int *flag) { while (*flag == 0) { } }
    """

    def __init__(self, torch, device: int, workdir: Path, ckpt_gb: float) -> None:
        self.torch, self.dev, self.workdir, self.ckpt_gb = torch, device, workdir, ckpt_gb
        self.a = torch.randn(8192, 8192, device=f"cuda:{device}", dtype=torch.bfloat16)
        self.b = torch.randn(8192, 8192, device=f"cuda:{device}", dtype=torch.bfloat16)

    def run(self, stretch: str, seconds: float, rep, step: list[int]) -> None:
        torch = self.torch
        end = time.monotonic() + seconds
        if stretch in ("compute", "steps"):
            while time.monotonic() < end:
                for _ in range(20):
                    self.a @ self.b
                torch.cuda.synchronize(self.dev)
                step[0] += 1
                rep.step(step[0])
        elif stretch == "checkpoint":
            rep.phase_begin("checkpoint", step=step[0])
            n = int(self.ckpt_gb * 2**30 / 2)
            blob = torch.empty(n, dtype=torch.bfloat16, device=f"cuda:{self.dev}")
            path = self.workdir / "ckpt.pt"
            torch.save(blob.cpu(), path)
            del blob
            path.unlink(missing_ok=True)
            time.sleep(max(0.0, end - time.monotonic()))
            rep.phase_end("checkpoint", step=step[0])
        elif stretch == "hang":
            self._spin(end)
        else:  # idle, the context alive
            time.sleep(max(0.0, end - time.monotonic()))

    def _spin(self, end: float) -> None:
        """One thread spinning on a device flag until it flips (cupy); else back-to-back sleep kernels."""
        torch = self.torch
        try:
            import cupy

            with cupy.cuda.Device(self.dev):
                kernel = cupy.RawKernel(self.SPIN_SRC, "spin")
                flag = cupy.zeros(1, dtype=cupy.int32)
                stream = cupy.cuda.Stream(non_blocking=True)
                kernel((1,), (1,), (flag,), stream=stream)
                time.sleep(max(0.0, end - time.monotonic()))
                cupy.cuda.runtime.memcpy(flag.data.ptr, cupy.ones(1, dtype=cupy.int32).data.ptr, 4, 3)
                stream.synchronize()
                return
        except ImportError:
            pass
        while time.monotonic() < end:  # torch.cuda._sleep: a one-thread busy loop on the GPU
            torch.cuda._sleep(50_000_000)
            torch.cuda.synchronize(self.dev)


def run_stretches(
    job, seconds: dict[str, float], redis_url: str, uuid: str, index: int, tl: Timeline, spool: Path
) -> None:
    from costexporter.trainer.reporter import StepReporter

    rep = StepReporter(
        JOB, redis_url, prefix=PREFIX, rank=0, local_rank=0, world_size=1, gpu_uuid=uuid, gpu_index=index,
        heartbeat_s=2.0, meta={"team": "gpu-check"}, spool_dir=spool,
    )  # fmt: skip
    step = [0]
    try:
        for name in STRETCHES:
            t0 = time.time()
            job.run(name, seconds[name], rep, step)
            tl.stretches.append((name, t0, time.time()))
            rep.flush(5)
            tl.booked[name] = ledger_seconds(redis_url)
    finally:
        rep.close()  # posts `run end` when no exception is in flight


def first_after(seen: list[tuple], t0: float, t1: float, match: Callable[[tuple], bool]) -> float | None:
    """Seconds from t0 to the first scrape in [t0, t1) that matches, or None."""
    t = next((x[0] for x in seen if t0 <= x[0] < t1 and match(x)), None)
    return None if t is None else round(t - t0, 1)


def detection(tl: Timeline, name: str, t0: float, t1: float, prev: str | None, round_s: float) -> dict:
    """Time to detection of a stretch: the live band it should show on /metrics and the
    watcher's state (EXPECT), in seconds and agent rounds from its start; around the
    checkpoint, the allowance flag going to 1, and back to 0 after it ends."""
    band, state = EXPECT[name]
    row = {
        "expect_band": band,
        "expect_watcher": state,
        "detect_band_s": first_after(tl.bands, t0, t1, lambda x: band in x[1].split(",")),
        "detect_watcher_s": first_after(tl.states, t0, t1, lambda x: x[1] == state),
    }
    for k in ("band", "watcher"):
        v = row[f"detect_{k}_s"]
        row[f"detect_{k}_rounds"] = None if v is None else round(v / round_s, 2)
    if name == "checkpoint":
        row["allowance_on_s"] = first_after(tl.allowance, t0, t1, lambda x: x[1] == 1)
    if prev == "checkpoint":
        row["allowance_off_s"] = first_after(tl.allowance, t0, t1, lambda x: x[1] == 0)
    return row


def summarize(tl: Timeline, trace: Path, round_s: float = 5.0) -> list[dict]:
    with open(trace, newline="") as f:
        rows = list(csv.DictReader(f))
    out, before, prev = [], {}, None
    for name, t0, t1 in tl.stretches:
        inside = [r for r in rows if t0 <= float(r["ts"]) < t1]
        bands: dict[str, int] = {}
        for t, b in tl.bands:
            if t0 <= t < t1:
                bands[b] = bands.get(b, 0) + 1
        states: dict[str, int] = {}
        for t, s, _ in tl.states:
            if t0 <= t < t1:
                states[s] = states.get(s, 0) + 1
        booked = tl.booked.get(name, {})
        delta = {
            c: round(v - before.get(c, 0.0), 1) for c, v in booked.items() if v - before.get(c, 0.0) > 0.05
        }
        before = booked
        row = {
            "stretch": name,
            "seconds": round(t1 - t0, 1),
            "power_w_median": statistics.median(float(r["power_w"]) for r in inside) if inside else None,
            "util_pct_median": statistics.median(float(r["util_pct"]) for r in inside) if inside else None,
            "bands_on_metrics": bands,
            "watcher_states": states,
            "booked_during_s": delta,
            **detection(tl, name, t0, t1, prev, round_s),
        }
        prev = name
        if name == "hang":
            band_t = next((t for t, b in tl.bands if t >= t0 and ("deadlock" in b or "stalled" in b)), None)
            hung = next(((t, r) for t, s, r in tl.states if t >= t0 and s == "hung"), None)
            row["detect_band_deadlock_s"] = round(band_t - t0, 1) if band_t else None
            row["detect_watcher_hung_s"] = round(hung[0] - t0, 1) if hung else None
            row["watcher_suspect_rank"] = hung[1] if hung else None
        out.append(row)
    return out


def print_stretches(rows: list[dict]) -> None:
    print("\n(c) the job, stretch by stretch (NVML medians from the 100-ms trace)")
    for r in rows:
        if "seconds" not in r:
            print(f"{r['stretch']}: {r.get('booked_total_s')}")
            continue
        print(
            f"{r['stretch']:<11}{r['seconds']:>6.1f} s  power {r['power_w_median']} W"
            f"  util {r['util_pct_median']}%  bands {r['bands_on_metrics']}"
            f"  watcher {r['watcher_states']}  booked {r['booked_during_s']}"
        )
        print(f"{'':<11}detection: {detection_line(r)}")


def _after(s: float | None, rounds: float | None) -> str:
    return "never" if s is None else f"after {s} s ({rounds} rounds)"


def detection_line(r: dict) -> str:
    """One stretch's time to detection, as the table prints it."""
    line = (
        f"band {r['expect_band']} {_after(r['detect_band_s'], r['detect_band_rounds'])}, "
        f"watcher {r['expect_watcher']} {_after(r['detect_watcher_s'], r['detect_watcher_rounds'])}"
    )
    if r["stretch"] == "hang":
        line += f" (suspect rank {r['watcher_suspect_rank']})"
    if "allowance_on_s" in r:
        line += f"; in_allowance 1 after {r['allowance_on_s']} s"
    if "allowance_off_s" in r:
        line += f"; in_allowance back to 0 {r['allowance_off_s']} s after the checkpoint ended"
    return line


# ---- the whole check ---------------------------------------------------------------------------


def open_nvml(fake_state: Path | None, gpu: int):
    if fake_state is not None:
        from tests.fake_nvml import R9_ENERGY_CALL_CPU_S, FileDrivenFakeNvml

        FileDrivenFakeNvml(
            str(fake_state), cpu_cost_s={"nvmlDeviceGetTotalEnergyConsumption": R9_ENERGY_CALL_CPU_S}
        ).install_global()
    try:
        import pynvml as nv
    except ImportError:
        raise CheckUnavailable("no nvidia-ml-py (import pynvml failed)") from None
    try:
        nv.nvmlInit()
        h = nv.nvmlDeviceGetHandleByIndex(gpu)
        uuid = nv.nvmlDeviceGetUUID(h)
    except nv.NVMLError as e:
        raise CheckUnavailable(f"NVML is not usable here ({e}): no NVIDIA GPU or driver") from None
    return nv, h, uuid.decode() if isinstance(uuid, bytes) else uuid


def open_torch(gpu: int):
    try:
        import torch
    except ImportError as e:
        raise CheckUnavailable(f"no PyTorch (import torch failed: {e})") from None
    if not torch.cuda.is_available() or torch.cuda.device_count() <= gpu:
        raise CheckUnavailable(f"PyTorch sees no CUDA GPU {gpu}")
    return torch


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="Where to write the JSON summary.")
    ap.add_argument("--gpu", type=int, default=0, help="The GPU index to run on.")
    ap.add_argument("--calls", type=int, default=200, help="Calls per NVML function in (a).")
    ap.add_argument("--cpu-seconds", type=float, default=30.0, help="Agent CPU window per rate in (b).")
    ap.add_argument("--warmup", type=float, default=5.0, help="Seconds before each CPU window.")
    ap.add_argument(
        "--stretches",
        default="compute=60,checkpoint=20,hang=45,idle=25,steps=30",
        help="Seconds of each stretch of (c).",
    )
    ap.add_argument(
        "--checkpoint-gb", type=float, default=3.2, help="Size of the checkpoint torch.save writes."
    )
    ap.add_argument("--book-interval", type=float, default=5.0, help="The agent's round in (c).")
    ap.add_argument("--poll", type=float, default=1.0, help="Scrape and watcher poll interval in (c).")
    ap.add_argument("--skip", default="", help="Parts to skip, e.g. 'b' or 'a,c'.")
    ap.add_argument("--fake-nvml", action="store_true", help=argparse.SUPPRESS)  # tests only
    return ap.parse_args(argv)


def run(args: argparse.Namespace, workdir: Path) -> dict:
    fake_state = workdir / "fake-gpu.json" if args.fake_nvml else None
    seconds = {k: float(v) for k, v in (kv.split("=") for kv in args.stretches.split(","))}
    missing = set(STRETCHES) - set(seconds)
    if missing:
        raise CheckUnavailable(f"--stretches lacks {', '.join(sorted(missing))}")
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if fake_state is not None:
        FakeJob(fake_state).level("idle")
        torch = None
    else:
        torch = open_torch(args.gpu)
    nv, h, uuid = open_nvml(fake_state, args.gpu)
    summary: dict = {"gpu": {"index": args.gpu, "uuid": uuid, "fake": fake_state is not None}}
    with contextlib.suppress(nv.NVMLError):
        name = nv.nvmlDeviceGetName(h)
        summary["gpu"]["name"] = name.decode() if isinstance(name, bytes) else name
        summary["gpu"]["power_limit_w"] = nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000
    if "a" not in skip:
        summary["nvml_calls"] = measure_calls(nv, h, args.calls)
        print_calls(summary["nvml_calls"])
    with redis_server(workdir) as redis_url:
        if "b" not in skip:
            summary["agent_cpu"] = [
                agent_cpu(redis_url, hz, args.cpu_seconds, args.warmup, fake_state, workdir)
                for hz in (1.0, 10.0)
            ]
            print("\n(b) the agent's CPU (one core = 100%; target: at most 1% at 10 Hz on real GPUs)")
            for r in summary["agent_cpu"]:
                print(f"  sampling at {r['hz']:>4g} Hz: {r['cpu_pct']:.2f}% over {r['seconds']} s")
        if "c" not in skip:
            summary["stretches"] = job_check(
                args, workdir, redis_url, nv, h, uuid, torch, fake_state, seconds
            )
            print_stretches(summary["stretches"])
    return summary


def job_check(args, workdir, redis_url, nv, h, uuid, torch, fake_state, seconds) -> list[dict]:
    a_port, w_port = free_port(), free_port()
    env = child_env(fake_state)
    serve = [
        *costexporter_cmd(fake_state),
        "serve", "--source", "nvml", "--redis-url", redis_url, "--prefix", PREFIX, "--listen", "127.0.0.1",
        "--port", str(a_port), "--sample-interval", "1", "--book-interval", str(args.book_interval),
    ]  # fmt: skip
    watch = [
        sys.executable, "-m", "costexporter.cli", "watch", "--redis-url", redis_url, "--prefix", PREFIX,
        "--job", JOB, "--poll", str(args.poll), "--listen", "127.0.0.1", "--port", str(w_port),
    ]  # fmt: skip
    tl, stop = Timeline(), threading.Event()
    trace = workdir / "trace.csv"
    job = (
        FakeJob(fake_state)
        if fake_state is not None
        else TorchJob(torch, args.gpu, workdir, args.checkpoint_gb)
    )
    with started(serve, env, workdir / "agent.log") as agent, started(watch, env, workdir / "watch.log") as w:
        wait_http(a_port, agent)
        wait_http(w_port, w)
        threads = [
            threading.Thread(target=record_trace, args=(nv, [h], trace, stop), daemon=True),
            threading.Thread(
                target=poll_metrics, args=(a_port, w_port, tl, stop, args.poll / 2), daemon=True
            ),
        ]
        for t in threads:
            t.start()
        try:
            run_stretches(job, seconds, redis_url, uuid, args.gpu, tl, workdir)
            time.sleep(2 * args.book_interval)  # the last round books the tail
            tl.booked["final"] = ledger_seconds(redis_url)
        finally:
            stop.set()
            for t in threads:
                t.join(5)
    rows = summarize(tl, trace, args.book_interval)
    rows.append({"stretch": "final ledger", "booked_total_s": tl.booked.get("final", {})})
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT))
    workdir = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    try:
        summary = run(args, workdir)
    except CheckUnavailable as e:
        print(f"gpu_check: cannot run here: {e}", file=sys.stderr)
        return 2
    finally:
        logs = {p.name: p.read_text(errors="replace")[-4000:] for p in workdir.glob("*.log")}
        shutil.rmtree(workdir, ignore_errors=True)
    summary["log_tails"] = logs
    summary["started_pids"] = STARTED
    Path(args.out).write_text(json.dumps(summary, indent=2, default=str))
    print(f"\nsummary written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
