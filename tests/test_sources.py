"""Live GPU sources: NVML through a fake of the library behind pynvml, dcgm-exporter over HTTP."""

from __future__ import annotations

import itertools
import math
import threading
import time

import pynvml
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from costexporter.sources.base import GpuInitError
from costexporter.sources.energy import Anchor, share
from costexporter.sources.nvml import NvmlSource
from costexporter.sources.sampler import Sampler

from .conftest import SHARED_URL
from .fake_nvml import FakeGpu, FakeNvml
from .http_stub import Exposition


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


def test_an_instant_power_of_zero_beside_a_real_average_falls_back_to_the_average(monkeypatch):
    # The H200 (R9): NVML_FI_DEV_POWER_INSTANT is "supported" and returns 0 W; the 1-s average is real.
    fake = FakeNvml([FakeGpu(uuid(0), power_mw=124_100, util=100, instant_zero=True), FakeGpu(uuid(1))])
    fake.install(monkeypatch)
    src = NvmlSource(host="h200")
    fake.counts.clear()
    for _ in range(3):
        assert [r.power_w for r in src.read()] == [124.1, 950.0]
    assert fake.counts["nvmlDeviceGetPowerUsage"] == 3  # only the H200 reads the average
    assert fake.counts["nvmlDeviceGetFieldValues"] == 3  # the other GPU keeps its instant field
    assert not src.errors


def test_an_instant_zero_seen_later_still_reads_the_average(monkeypatch):
    fake = FakeNvml([FakeGpu(uuid(0), power_mw=700_000)]).install(monkeypatch)
    src = NvmlSource(host="n")
    assert src.read()[0].power_w == 700.0
    fake.set(0, instant_zero=True)  # the field starts answering 0 after the probe
    assert src.read()[0].power_w == 700.0


# --- the energy counter: read once per round, shared out by power ---------------------------


def _anchored_sampler(fake, sample_s, round_s, seconds, energy_interval_s=0.0, script=None):
    """A real sampler on the fake at `sample_s`, drained every `round_s` like the agent does."""
    src = NvmlSource(host="n")
    sampler = Sampler(src, sample_s, energy_interval_s=energy_interval_s)
    fake.counts.clear()
    fake.energy_reads.clear()  # the source's probe at start is not the sampler's
    t0 = time.monotonic()
    sampler.start()
    out = []
    step = 0
    while time.monotonic() - t0 < seconds:
        time.sleep(round_s)
        if script:
            script(step)
        step += 1
        out.extend(sampler.drain())
    elapsed = time.monotonic() - t0
    sampler.stop()
    out.extend(sampler.drain())
    return src, sampler, out, elapsed


def test_at_10_hz_the_costly_energy_counter_is_read_once_per_round_not_per_sample(monkeypatch):
    # R9: ~3.9 ms of CPU per counter call on an H200; the fake charges it for real.
    gpus = [FakeGpu(uuid(i)) for i in range(8)]
    fake = FakeNvml(gpus, cpu_cost_s={"nvmlDeviceGetTotalEnergyConsumption": 0.0039}).install(monkeypatch)
    src, _sampler, out, elapsed = _anchored_sampler(fake, 0.1, 0.5, 2.0)
    samples = len(out) / 8
    assert samples >= 10  # ~10 Hz per GPU (a loaded CI box may lag)
    per_gpu_per_s = fake.counts["nvmlDeviceGetTotalEnergyConsumption"] / 8 / elapsed
    assert per_gpu_per_s <= 1 / 0.5 + 1  # one per round (2/s here) plus the start, not 10/s
    assert fake.counts["nvmlDeviceGetPowerUsage"] + fake.counts["nvmlDeviceGetFieldValues"] >= 8 * samples
    assert all(math.isfinite(r.energy_mj) for r in out)  # every sample has an energy figure
    assert not src.errors


def test_energy_interval_caps_counter_reads_and_holds_samples_back_until_the_next_read(monkeypatch):
    fake = FakeNvml([FakeGpu(uuid(0))]).install(monkeypatch)
    _src, sampler, out, elapsed = _anchored_sampler(fake, 0.05, 0.1, 2.0, energy_interval_s=0.5)
    assert fake.counts["nvmlDeviceGetTotalEnergyConsumption"] <= elapsed / 0.5 + 2
    assert all(math.isfinite(r.energy_mj) for r in out)  # held back, never handed out unknown
    assert not sampler.drain()  # the drain after stop() handed out the held samples too
    ts = [r.ts for r in out]
    assert ts == sorted(ts) and len(out) >= 20


def _energy_at(readings, t):
    """The booker's view of the cumulative energy at time t: a sample's slice runs to the next
    sample and its energy is the delta of the figures, cut in proportion to time."""
    for a, b in itertools.pairwise(readings):
        if a.ts <= t <= b.ts:
            f = (t - a.ts) / (b.ts - a.ts) if b.ts > a.ts else 1.0
            return a.energy_mj + (b.energy_mj - a.energy_mj) * f
    return None


def test_booked_energy_equals_the_counter_at_every_real_read_while_power_moves(monkeypatch):
    # The reported power is not what the counter integrates (a 1-s average lags, R8): between
    # two real reads the shares follow the samples, and at every real read the total is exact.
    fake = FakeNvml([FakeGpu(uuid(0), power_mw=692_000), FakeGpu(uuid(1), power_mw=124_100)])
    fake.install(monkeypatch)
    levels = [692_000, 124_100, 729_000, 123_700, 660_000]

    def script(step):
        fake.set(0, power_mw=levels[step % 5], counter_power_mw=levels[(step + 1) % 5])
        fake.set(1, power_mw=levels[(step + 2) % 5])

    _src, sampler, out, _ = _anchored_sampler(fake, 0.02, 0.15, 2.0, script=script)
    reads = [r for r in fake.energy_reads if r[0] in (0, 1)]
    assert {(g, v) for g, _, v in sampler.anchors} == {(g, v) for g, _, v in reads}  # anchors are real reads
    checked = 0
    for g in (0, 1):
        mine = [r for r in out if r.gpu == g]
        e = [r.energy_mj for r in mine]
        assert e == sorted(e)  # monotone
        for gg, ts, mj in sampler.anchors:
            v = _energy_at(mine, ts) if gg == g and (gg, ts) not in sampler.inexact else None
            if v is not None:
                assert v == pytest.approx(mj, abs=1e-6)
                checked += 1
    assert checked >= 10
    assert len(sampler.inexact) <= 0.2 * len(sampler.anchors)  # only a sample late under load
    # Over the window between the first and the last real read the booked energy is the delta.
    g0 = [a for a in sampler.anchors if a[0] == 0 and _energy_at([r for r in out if r.gpu == 0], a[1])]
    booked = _energy_at([r for r in out if r.gpu == 0], g0[-1][1]) - _energy_at(
        [r for r in out if r.gpu == 0], g0[0][1]
    )
    assert booked == pytest.approx(g0[-1][2] - g0[0][2], abs=1e-6)


def test_through_the_booker_slices_sum_to_the_counter_delta(monkeypatch):
    """make_slices (the booker) takes the shared figures as counter deltas, never power."""
    import numpy as np

    from costexporter.core.booking import make_slices

    fake = FakeNvml([FakeGpu(uuid(0), power_mw=500_000, counter_power_mw=700_000)]).install(monkeypatch)
    _src, _sampler, out, _ = _anchored_sampler(fake, 0.02, 0.2, 1.0)
    ts = np.array([round(r.ts * 1000) for r in out], np.int64)
    s = make_slices(
        np.zeros(ts.size, np.int32),
        ts,
        np.array([r.power_w for r in out]),
        np.array([r.energy_mj for r in out]),
        np.zeros(ts.size, np.int8),
        1,
        20,
        np.array([np.iinfo(np.int64).max]),
        np.array([np.iinfo(np.int64).max]),
        1e9,
    )
    inner = s.energy_mj[: ts.size - 1].sum()  # the last slice has no next sample: power
    assert inner == pytest.approx(out[-1].energy_mj - out[0].energy_mj, rel=1e-9)
    assert inner > 0.6 * (ts[-1] - ts[0]) * 500  # the counter's 700 W, not the samples' 500 W


def test_a_counter_that_fails_or_restarts_hands_samples_out_unknown_never_invented(monkeypatch):
    # Counters as a GPU up for a while has them (mJ since the driver loaded): a reload's 0 is
    # then below the last read however long the sampler takes (from 0, a slow machine's reads
    # after the reset could pass the read before it, and no restart would show).
    fake = FakeNvml([FakeGpu(uuid(0), energy_mj=5e9), FakeGpu(uuid(1), energy_mj=5e9)]).install(monkeypatch)
    src = NvmlSource(host="n")
    sampler = Sampler(src, 0.02).start()

    def drain_after_reads(n: int = 3, timeout: float = 10.0) -> list:
        # Waits for the sampler's own reads instead of a fixed sleep: a loaded machine samples
        # late, and a drain with no sample since the last counter read has nothing to mark.
        start, deadline = sampler.reads, time.monotonic() + timeout
        while sampler.reads < start + n and time.monotonic() < deadline:
            time.sleep(0.01)
        return sampler.drain()

    sampler.drain()
    assert all(math.isfinite(r.energy_mj) for r in drain_after_reads())
    fake.set(1, energy_mj=0.0)  # the driver reloaded: the counter starts again from 0
    around = drain_after_reads()
    assert {r.gpu for r in around if math.isnan(r.energy_mj)} == {1}
    again = drain_after_reads()
    assert again and all(math.isfinite(r.energy_mj) for r in again)  # counting again from there

    def broken(h):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetTotalEnergyConsumption", broken)
    got = drain_after_reads()
    sampler.stop()
    assert got and all(math.isnan(r.energy_mj) for r in got)  # booked from power, counted
    assert src.errors[(0, "energy_error")] == 1 and src.errors[(1, "energy_error")] == 1


@pytest.mark.serial  # real time: a loaded machine samples less than the thresholds assume
def test_a_real_agent_books_the_counters_energy_into_the_ledger_not_the_samples_power(
    shared, prefix, monkeypatch
):
    """Through the agent and real Redis: the samples say 500 W, the counter integrates 700 W;
    the ledger holds the counter's energy for every booked second, with one counter call per GPU
    per round."""
    from costexporter.services.agent import Agent, AgentConfig
    from costexporter.store import ledger

    gpus = [FakeGpu(uuid(i), power_mw=500_000, counter_power_mw=700_000) for i in range(2)]
    fake = FakeNvml(gpus, cpu_cost_s={"nvmlDeviceGetTotalEnergyConsumption": 0.0039}).install(monkeypatch)
    cfg = AgentConfig(
        redis_url=SHARED_URL,
        prefix=prefix,
        agent_id="n",
        book_interval_s=0.3,
        sample_interval_s=0.1,
        job_refresh_s=0.5,
    )
    agent = Agent(NvmlSource(host="n"), cfg)
    fake.counts.clear()
    t0 = time.monotonic()
    loop = threading.Thread(target=agent.start().run)
    loop.start()
    time.sleep(3.0)
    agent.stop()
    loop.join(10)
    agent.shutdown()
    elapsed = time.monotonic() - t0
    got = ledger.read_amounts(shared, prefix, ledger.UNASSIGNED_JOB)
    ms, mj = got["unassigned:ms"], got["unassigned:mj"]
    assert ms > 2 * 1500  # both GPUs, most of the 3 s
    assert mj == pytest.approx(0.7 * ms * 1000, rel=0.01)  # 700 W x booked time: the counter's figure
    samples = fake.counts["nvmlDeviceGetUtilizationRates"] / 2
    energy_calls = fake.counts["nvmlDeviceGetTotalEnergyConsumption"] / 2
    assert samples >= 15
    assert energy_calls <= elapsed / 0.3 + 3  # once per round (and the start), not per sample


finite = st.floats(0, 2000, allow_nan=False)


@given(
    c0=st.floats(0, 1e12),
    delta=st.floats(0, 1e9),
    gaps=st.lists(st.floats(0, 5), min_size=1, max_size=30),
    powers=st.lists(st.one_of(finite, st.just(math.nan)), min_size=31, max_size=31),
    p_prev=st.one_of(finite, st.just(math.nan)),
)
@example(c0=0.0, delta=1.0, gaps=[0.0, 0.0], powers=[math.nan, 5e-324, *[0.0] * 29], p_prev=math.nan)
def test_shares_are_monotone_bounded_and_add_up_to_the_counter(c0, delta, gaps, powers, p_prev):
    t0 = 1_700_000_000.0
    ts = list(itertools.accumulate(gaps, initial=t0))[1:]
    end = ts[-1] + 0.5
    a0, a1 = Anchor(t0, c0, p_prev), Anchor(end, c0 + delta)
    e = share(a0, ts, powers[: len(ts)], a1)
    assert len(e) == len(ts)
    assert e == sorted(e)
    assert all(c0 <= v <= c0 + delta for v in e)
    # The last sample's slice to the real read closes the sum exactly.
    p_last = powers[len(ts) - 1]
    if math.isfinite(p_last) and p_last > 0 and delta > 0:
        w = [
            (b - a) * (p if math.isfinite(p) else 0)
            for a, b, p in zip(ts, [*ts[1:], end], powers, strict=False)
        ]
        first = (ts[0] - t0) * (
            p_prev if math.isfinite(p_prev) else powers[0] if math.isfinite(powers[0]) else 0
        )
        total = first + sum(w)
        if total > 0:  # (5e-324 W for half a second weighs 0: there is nothing to split by)
            assert (c0 + delta) - e[-1] == pytest.approx(delta * w[-1] / total, rel=1e-6, abs=1e-3)


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
        self.n, self.label, self.host, self.frozen = n, hostname_label, host, frozen
        self.requests = 0
        self.http = Exposition(self.render)
        self.url = self.http.url

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
        self.http.close()


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
    from costexporter.sources.playback import ReplaySource
    from costexporter.sources.synth import TraceBuilder

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
