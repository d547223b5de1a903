"""Live GPU sources: NVML through a fake of the library behind pynvml, dcgm-exporter over HTTP."""

from __future__ import annotations

import math

import pynvml
import pytest

from costexporter.sources.base import GpuInitError
from costexporter.sources.nvml import NvmlSource

from .fake_nvml import FakeGpu, FakeNvml


def uuid(i: int) -> str:
    return f"GPU-{i:08x}-1111-2222-3333-444444444444"


def test_nvml_source_reads_power_utilization_energy_and_the_profile(monkeypatch):
    fake = FakeNvml([FakeGpu(uuid(0)), FakeGpu(uuid(1), power_mw=640_000, instant=False, energy=False)])
    fake.install(monkeypatch)
    src = NvmlSource(host="node7")
    gpus = src.gpus()
    assert [(g.host, g.index, g.uuid, g.name, g.power_limit_w) for g in gpus] == [
        ("node7", 0, uuid(0), "NVIDIA B300", 1100.0),
        ("node7", 1, uuid(1), "NVIDIA B300", 1100.0),
    ]
    first = src.read()
    second = src.read()
    assert [r.power_w for r in second] == [950.0, 640.0]  # mW -> W, instant field or power usage
    assert [r.util_pct for r in second] == [100.0, 100.0]
    assert second[0].energy_mj >= first[0].energy_mj >= 0  # mJ counter where supported
    assert math.isnan(second[1].energy_mj)  # pre-Volta: no counter, the agent integrates power
    assert not src.errors
    src.close()


def test_a_lost_gpu_is_counted_and_the_others_go_on(monkeypatch):
    fake = FakeNvml([FakeGpu(uuid(i)) for i in range(4)]).install(monkeypatch)
    src = NvmlSource(host="n")
    assert len(src.read()) == 4
    fake.gpus[2].lost = True
    for _ in range(3):
        readings = src.read()
        assert [r.gpu for r in readings] == [0, 1, 3]
    assert src.errors == {(2, "gpu_lost"): 3}


def test_no_permission_and_not_supported_are_counted(monkeypatch):
    fake = FakeNvml([FakeGpu(uuid(0)), FakeGpu(uuid(1))]).install(monkeypatch)
    src = NvmlSource(host="n")

    def denied(h):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetUtilizationRates", denied)
    assert src.read() == []
    assert src.errors == {(0, "no_permission"): 1, (1, "no_permission"): 1}
    assert fake.calls > 0


def test_nvml_missing_driver_is_an_init_error(monkeypatch):
    def no_driver():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    monkeypatch.setattr(pynvml, "nvmlInit", no_driver)
    with pytest.raises(GpuInitError):
        NvmlSource()


# --- dcgm-exporter -------------------------------------------------------------------------

DCGM_TEMPLATE = """# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).
# TYPE DCGM_FI_DEV_GPU_UTIL gauge
{util}
# HELP DCGM_FI_DEV_POWER_USAGE Power draw (in W).
# TYPE DCGM_FI_DEV_POWER_USAGE gauge
{power}
# HELP DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION Total energy consumption since boot (in mJ).
# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter
{energy}
# HELP DCGM_FI_PROF_SM_ACTIVE The ratio of cycles an SM has at least 1 warp assigned.
# TYPE DCGM_FI_PROF_SM_ACTIVE gauge
{sm}
"""


class DcgmExporter:
    """A real HTTP server that serves dcgm-exporter-shaped text for `n` GPUs."""

    def __init__(
        self, n: int, hostname_label: str = "Hostname", host: str = "gpu-node-1", frozen: bool = False
    ) -> None:
        import http.server
        import threading

        self.n, self.label, self.host, self.frozen = n, hostname_label, host, frozen
        self.requests = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                body = outer.render().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def render(self) -> str:
        k = 0 if self.frozen else self.requests
        self.requests += 1
        lines = {"util": [], "power": [], "energy": [], "sm": []}
        for g in range(self.n):
            labels = (
                f'gpu="{g}",UUID="{uuid(g)}",pci_bus_id="00000000:0{g}:00.0",device="nvidia{g}",'
                f'modelName="NVIDIA H100 80GB HBM3",{self.label}="{self.host}",'
                f'DCGM_FI_DRIVER_VERSION="550.54.15",container="trainer",namespace="ml",pod="job-{g}"'
            )
            lines["util"].append(f"DCGM_FI_DEV_GPU_UTIL{{{labels}}} {90 + g}")
            lines["power"].append(f"DCGM_FI_DEV_POWER_USAGE{{{labels}}} {600.5 + g + k}")
            lines["energy"].append(
                f"DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{{{labels}}} {1_000_000 + 600_000 * k}"
            )
            lines["sm"].append(f"DCGM_FI_PROF_SM_ACTIVE{{{labels}}} 0.{80 + g}")
        return DCGM_TEMPLATE.format(**{k: "\n".join(v) for k, v in lines.items()})

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_dcgm_source_scrapes_two_exporters(caplog):
    from costexporter.sources.dcgm import DcgmSource

    a = DcgmExporter(2, "Hostname", "gpu-node-1")
    b = DcgmExporter(1, "hostname", "gpu-node-2")
    try:
        src = DcgmSource([a.url, b.url])
        r1 = src.read()
        r2 = src.read()
    finally:
        a.close()
        b.close()
    assert [(g.host, g.index, g.uuid, g.name) for g in src.gpus()] == [
        ("gpu-node-1", 0, uuid(0), "NVIDIA H100 80GB HBM3"),
        ("gpu-node-1", 1, uuid(1), "NVIDIA H100 80GB HBM3"),
        ("gpu-node-2", 0, uuid(0), "NVIDIA H100 80GB HBM3"),
    ]
    assert [(r.gpu, r.power_w, r.util_pct) for r in r1] == [
        (0, 600.5, 90.0),
        (1, 601.5, 91.0),
        (2, 600.5, 90.0),
    ]
    assert r2[0].energy_mj - r1[0].energy_mj == 600_000  # mJ, counter without _total
    assert r1[1].sm_active == pytest.approx(0.81)
    assert (src.pod[0].namespace, src.pod[0].pod, src.pod[0].container) == ("ml", "job-0", "trainer")
    assert not src.coarse


def test_dcgm_source_warns_once_when_the_exporter_is_coarse(caplog):
    import logging

    from costexporter.sources.dcgm import DcgmSource

    exp = DcgmExporter(2, frozen=True)  # collects every 30 s: every scrape sees the same values
    try:
        src = DcgmSource([exp.url])
        with caplog.at_level(logging.WARNING, logger="costexporter.sources.dcgm"):
            for _ in range(6):
                src.read()
    finally:
        exp.close()
    assert src.coarse
    assert sum("coarser than the scrapes" in r.message for r in caplog.records) == 1


def test_dcgm_source_counts_a_dead_endpoint_and_keeps_the_live_one():
    from costexporter.sources.dcgm import DcgmSource
    from tests.redis_server import free_port

    live = DcgmExporter(1)
    try:
        src = DcgmSource([f"http://127.0.0.1:{free_port()}/metrics", live.url], timeout_s=0.5)
        readings = src.read()
    finally:
        live.close()
    assert len(readings) == 1 and readings[0].power_w == 600.5
    assert src.errors[(-1, "scrape_failed")] == 1


def test_sampler_reads_on_its_own_thread_and_bounds_its_buffer(monkeypatch):
    import time

    from costexporter.sources.sampler import Sampler

    FakeNvml([FakeGpu(uuid(i)) for i in range(8)]).install(monkeypatch)
    sampler = Sampler(NvmlSource(host="n"), interval_s=0.02, capacity=100).start()
    try:
        time.sleep(0.5)
        assert sampler.reads >= 10
        readings = sampler.drain()
        assert len(readings) == 100  # bounded...
        assert sampler.dropped >= 8  # ...and what fell out is counted
        assert sorted(sampler.latest()) == list(range(8))
        assert {r.gpu for r in readings} == set(range(8))
    finally:
        sampler.stop()


def test_replay_source_plays_a_trace_faster_than_real_time():
    from costexporter.sources.replay import ReplaySource
    from costexporter.synth import TraceBuilder

    b = TraceBuilder(n_gpus=2, per_host=2, job="r")
    b.stretch("compute", 100)
    samples = b.samples()
    now = [0.0]
    src = ReplaySource(samples, speed=10.0, clock=lambda: now[0])
    assert len(src.read()) == 2  # the first instant
    now[0] = 5.0  # 5 s of wall time = 50 s of trace
    got = src.read()
    assert len(got) == 2 * 50 and got[0].ts == samples.ts_ms.min() / 1000 + 1
    now[0] = 100.0
    assert len(src.read()) == 2 * 49 and src.done
