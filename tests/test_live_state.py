"""The live state end to end on an H200's measured levels: a real `costexporter serve --source nvml` (the
file-driven fake NVML of tests/fake_nvml.py in its process), a real `costexporter watch`, the
shared Redis, and real /metrics scrapes every 0.2 s through a job's stretches:

idle with a CUDA context (123.7 W, 0%) before the job, compute (692 W, 100%) with steps, a
declared checkpoint (124.1 W, 0-5%), compute again, a silent hang (124.1 W, 100%, no step),
idle with the context (123.7 W, 0%), steps, run end.

Each scrape must carry the GPU's band; the allowance flag drops within a round of the phase's
end; during the hang the cost since the last step and the time at risk grow, the band turns
`deadlock` and the watcher says `hung` naming rank 0 and its GPU, within two agent rounds; the
ledger books the hang `stalled` from within two samples of its start; the derived profile's
idle edge sits above the GPU's learned idle level.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from costexporter.core import bandtable
from costexporter.store import keys, ledger, protocol
from costexporter.trainer.transport import send_entries

from .conftest import SHARED_URL
from .fake_nvml import ENV as FAKE_ENV
from .redis_server import free_port
from .test_agent import stop_all

BAND_NAMES = bandtable.current().names

# Played on a clock: another test's load can delay it past its windows (the README's test command).
pytestmark = pytest.mark.serial

ROOT = Path(__file__).resolve().parent.parent
UUID = "GPU-fa4e0000-0000-0000-0000-000000000000"  # FileDrivenFakeNvml's first GPU
HOST = "h200-node"
JOB = "r9-live"
ROUND_S = 2.0  # the agent's round
SAMPLE_S = 0.1  # R9's 100 ms
POLL_S = 0.25  # the watcher's poll
LEVELS = {  # R9: (mW, %)
    "compute": (692_000, 100),
    "checkpoint": (124_100, 0),
    "checkpoint5": (124_100, 5),
    "spin": (124_100, 100),
    "idle": (123_700, 0),
}
BOOT = "from tests.fake_nvml import boot_from_env; boot_from_env()\nfrom costexporter.cli import run; run()"


@dataclass
class Seen:
    """Every scrape, stamped: the agent's families and the watcher's, and the job's status key."""

    agent: list[tuple[float, dict]] = field(default_factory=list)
    watch: list[tuple[float, dict]] = field(default_factory=list)
    status: list[tuple[float, dict]] = field(default_factory=list)
    live: list[tuple[float, dict]] = field(default_factory=list)  # the agent's live hash entry of rank 0


def parse(text: str) -> dict[str, list[tuple[dict, float]]]:
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def get(port: int) -> dict:
    return parse(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode())


def one(m: dict, name: str, **labels) -> float | None:
    vals = [v for lb, v in m.get(name, []) if all(lb.get(k) == x for k, x in labels.items())]
    return vals[0] if vals else None


def band_of(m: dict) -> list[str]:
    return [lb["band"] for lb, v in m.get("costexporter_gpu_band", []) if lb["gpu"] == "0" and v == 1]


def state_of(m: dict) -> tuple[str | None, float | None]:
    st = [lb["costexporter_job_state"] for lb, v in m.get("costexporter_job_state", []) if v == 1]
    return (st[0] if st else None), one(m, "costexporter_job_suspect_rank", training_job=JOB)


@pytest.fixture
def gpu_state(tmp_path):
    path = tmp_path / "fake-gpu.json"

    def level(name: str) -> float:
        mw, util = LEVELS[name]
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"0": {"power_mw": mw, "util": util}}))
        os.replace(tmp, path)
        return time.time()

    level("idle")
    return path, level


def test_r9_stretches_live_state_every_round_and_the_hang_seen_within_two_rounds(shared, prefix, gpu_state):
    path, level = gpu_state
    env = {**os.environ, FAKE_ENV: str(path), "PYTHONPATH": str(ROOT)}
    a_port, w_port = free_port(), free_port()
    url = SHARED_URL
    agent = subprocess.Popen(
        [sys.executable, "-c", BOOT, "serve", "--source", "nvml", "--host", HOST, "--agent-id", HOST,
         "--redis-url", url, "--prefix", prefix, "--listen", "127.0.0.1", "--port", str(a_port),
         "--book-interval", str(ROUND_S), "--sample-interval", str(SAMPLE_S)],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    watcher = subprocess.Popen(
        [sys.executable, "-m", "costexporter.cli", "watch", "--redis-url", url, "--prefix", prefix,
         "--job", JOB, "--poll", str(POLL_S), "--listen", "127.0.0.1", "--port", str(w_port)],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    seen, stop = Seen(), threading.Event()
    seq = [0]

    def post(type_: str, **f) -> float:
        ts = time.time()
        fields = {"v": "1", "type": type_, "job": JOB, "ts": f"{ts:.3f}", "rank": 0, "session": "s0"}
        send_entries(shared, prefix, JOB, [protocol.encode_fields({**fields, "seq": seq[0], **f})])
        seq[0] += 1
        return ts

    def scraper() -> None:
        status = keys.status_key(prefix, JOB)
        while not stop.is_set():
            now = time.time()
            with contextlib.suppress(OSError):
                seen.agent.append((now, get(a_port)))
            with contextlib.suppress(OSError):
                seen.watch.append((now, get(w_port)))
            raw = shared.get(status)
            if raw:
                seen.status.append((now, json.loads(raw)))
            raw = shared.hget(keys.live_key(prefix, JOB, HOST), "0")
            if raw:
                seen.live.append((now, json.loads(raw)))
            stop.wait(0.2)

    def steps(seconds: float, step: list[int]) -> float:
        level("compute")
        end = time.time() + seconds
        while time.time() < end:
            time.sleep(0.25)
            step[0] += 1
            last = post("step", step=step[0])
        return last

    t = {}
    try:
        deadline = time.monotonic() + 60
        while True:  # both serve /metrics
            try:
                get(a_port), get(w_port)
                break
            except OSError:
                assert agent.poll() is None and watcher.poll() is None, "a process exited at start"
                assert time.monotonic() < deadline, "no /metrics after 60 s"
                time.sleep(0.2)
        threading.Thread(target=scraper, daemon=True).start()
        time.sleep(4.5)  # idle with a context before the job: > 30 readings at 0% to learn from
        t["job"] = post("register", host=HOST, gpu=0, gpu_uuid=UUID, world_size=1, local_rank=0)
        post("meta", gpu_model="NVIDIA H200")
        post("run", state="start")
        step = [0]
        steps(3.0, step)
        t["ckpt"] = post("phase", name="checkpoint", state="begin", step=step[0])
        for i in range(6):  # 0-5% while torch.save writes
            level("checkpoint" if i % 2 == 0 else "checkpoint5")
            time.sleep(0.5)
        t["ckpt_end"] = post("phase", name="checkpoint", state="end", step=step[0])
        t["last_step"] = steps(3.0, step)
        t["hang"] = level("spin")
        time.sleep(3 * ROUND_S)
        t["idle"] = level("idle")
        time.sleep(ROUND_S + 1.5)
        t["steps"] = time.time()
        steps(2.0, step)
        t["end"] = post("run", state="end")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            wm = ledger.load_watermark(shared, prefix, JOB, HOST)
            if wm and wm["booked_until"] >= int(t["end"] * 1000):
                break
            time.sleep(0.2)
        time.sleep(0.5)
    finally:
        stop.set()
        errs = stop_all([agent, watcher])
    assert "Traceback" not in "".join(errs)

    if os.environ.get("LIVE_STATE_DEBUG"):
        for ts, m in seen.agent:
            figs = ("job_in_allowance", "cost_since_last_step", "gpu_time_at_risk_seconds")
            vals = [one(m, f"costexporter_{f}", training_job=JOB) for f in figs]
            print(f"{ts - t['job']:7.2f}", band_of(m), *vals)
        for ts, m in seen.watch:
            print(f"{ts - t['job']:7.2f}", state_of(m))
        print({k: round(v - t["job"], 2) for k, v in t.items()})

    def during(a: float, b: float, which=None) -> list[tuple[float, dict]]:
        return [(ts, m) for ts, m in (which if which is not None else seen.agent) if a <= ts < b]

    # 1. The GPU's band is in every scrape once the job holds it (the agent's first round after
    # the register): in the checkpoint, the hang, idle. Before, a GPU of no job shows none.
    assert len(seen.agent) > 100
    held = during(t["job"] + ROUND_S + 0.5, t["end"] + 60)
    assert held and all(len(band_of(m)) == 1 for _, m in held), [
        (round(ts - t["job"], 1), band_of(m)) for ts, m in held if len(band_of(m)) != 1
    ]
    assert all(band_of(m) == [] for _, m in during(0, t["job"]))
    # ... and in the agent's live hash, which the watcher reads: a band name, never None.
    assert len(seen.live) > 50 and all(e["band"] in BAND_NAMES for _, e in seen.live)
    assert {e["band"] for _, e in during(t["hang"] + 2 * ROUND_S, t["idle"], seen.live)} == {"deadlock"}
    assert {(e["gpu"], e["uuid"]) for _, e in seen.live} == {(0, UUID)}
    assert {b for _, m in during(t["idle"] + ROUND_S + 0.5, t["steps"]) for b in band_of(m)} == {"idle"}

    # 2. The allowance flag: 1 inside the checkpoint, 0 within one round after its end.
    flag = [(ts, one(m, "costexporter_job_in_allowance", training_job=JOB)) for ts, m in seen.agent]
    assert any(v == 1 for ts, v in flag if t["ckpt"] + ROUND_S + 0.3 <= ts < t["ckpt_end"])
    after = [v for ts, v in flag if t["ckpt_end"] + ROUND_S + 0.5 <= ts < t["end"]]
    assert after and all(v == 0 for v in after), after

    # 3. During the hang: the band turns deadlock within two rounds, cost since the last step
    # and the time at risk grow scrape after scrape (nothing is booked meanwhile).
    hang = during(t["hang"], t["idle"])
    first_dead = next(ts for ts, m in hang if band_of(m) == ["deadlock"])
    assert first_dead - t["hang"] <= 2 * ROUND_S
    rounds_in = during(t["hang"] + ROUND_S + 0.3, t["idle"])  # from the first round into the hang on
    since = [one(m, "costexporter_cost_since_last_step", training_job=JOB) for _, m in rounds_in]
    risk = [one(m, "costexporter_gpu_time_at_risk_seconds", training_job=JOB) for _, m in rounds_in]
    assert since[-1] > since[0] > 0 and len(set(since)) >= 2, since
    assert risk[-1] - risk[0] >= ROUND_S - 0.5, risk

    # 4. The watcher: hung within two rounds, naming rank 0 and its GPU.
    hung = next(ts for ts, m in during(t["hang"], t["idle"], seen.watch) if state_of(m) == ("hung", 0))
    assert hung - t["hang"] <= 2 * ROUND_S + POLL_S, hung - t["hang"]
    assert all(state_of(m)[0] != "hung" for _, m in during(t["job"] + 1, t["hang"], seen.watch))
    st = next(s for ts, s in seen.status if ts >= hung and s["state"] == "hung")
    assert "spin signature" in st["reason"] and f"{HOST} GPU 0" in st["reason"]
    assert st["suspect"]["rank"] == 0 and st["suspect"]["gpu"] == 0 and st["suspect"]["uuid"] == UUID

    # 5. The ledger: the hang booked stalled from within two samples of its start.
    net = ledger.net_ms(ledger.read_amounts(shared, prefix, JOB))
    hang_ms = (t["idle"] - t["hang"]) * 1000
    assert hang_ms - 2 * SAMPLE_S * 1000 - 150 <= net["stalled"] <= hang_ms + 150, net
    incidents = [json.loads(v) for v in shared.hgetall(keys.incidents_key(prefix, JOB, HOST)).values()]
    stall = [i for i in incidents if i["category"] == "stalled"]
    assert stall and abs(stall[0]["start"] / 1000 - t["hang"]) <= 2 * SAMPLE_S + 0.1, (stall, t["hang"])

    # 6. The idle level the GPU showed (123.7 W with a context) was learned and kept by UUID,
    # and the derived H200 profile's idle edge sits above it (112 W from the limit alone).
    stored = json.loads(shared.get(keys.gpu_idle_key(prefix, UUID)))
    assert stored["idle_w"] == pytest.approx(123.7, abs=0.5)
    edge = one(seen.agent[-1][1], "costexporter_job_band_edge_watts", training_job=JOB, edge="idle_max")
    assert edge == pytest.approx(1.15 * stored["idle_w"], abs=0.2) and edge > 124.1
