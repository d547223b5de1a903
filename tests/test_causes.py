"""Whose fault a wasted stretch was: the catalog, the rule (one for the agent and replay), and
the NVML source that reads the hardware events (Xids through an event set, hardware clock
slowdowns) through a fake of the library behind pynvml, with NVML's own functions and codes."""

from __future__ import annotations

import json
from importlib import resources

import pynvml
import pytest
from hypothesis import given
from hypothesis import strategies as st

from costexporter.core import causes
from costexporter.core.causes import HardwareEvent, attach, cause_of
from costexporter.sources.nvml import NvmlSource
from costexporter.sources.sampler import Sampler

from .fake_nvml import FakeGpu, FakeNvml


def uuid(i: int) -> str:
    return f"GPU-{i:08x}-1111-2222-3333-444444444444"


def test_the_catalog_names_only_known_causes_and_nvmls_hardware_bits():
    doc = json.loads(resources.files("costexporter.core").joinpath("data/hardware_events.json").read_text())
    assert {v[0] for table in ("xid", "throttle") for v in doc[table].values()} <= set(causes.CAUSES) - {
        "unknown",
        "storage",
    }
    bits = sum(int(b) for b in doc["throttle"])
    assert (
        bits
        == causes.HARDWARE_SLOWDOWN
        == (
            pynvml.nvmlClocksEventReasonHwSlowdown
            | pynvml.nvmlClocksEventReasonSwThermalSlowdown
            | pynvml.nvmlClocksEventReasonHwThermalSlowdown
            | pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown
        )
    )
    # a power cap or an idle GPU's clocks say nothing of a fault
    assert causes.what(HardwareEvent(0, 0, "throttle", pynvml.nvmlClocksEventReasonSwPowerCap)) is None
    assert causes.what(HardwareEvent(0, 0, "throttle", pynvml.nvmlClocksEventReasonGpuIdle)) is None


events = st.lists(
    st.tuples(
        st.integers(0, 7),
        st.builds(
            HardwareEvent,
            st.integers(0, 1_000_000),
            st.integers(0, 7),
            st.sampled_from(causes.KINDS),
            st.one_of(st.sampled_from([13, 31, 48, 74, 79, 7, 45]), st.integers(0, 511)),
        ),
    ),
    max_size=8,
)


@given(
    start=st.integers(0, 900_000),
    length=st.integers(0, 100_000),
    ranks=st.sets(st.integers(0, 7), max_size=4),
    evs=events,
    overrun=st.one_of(st.none(), st.tuples(st.integers(0, 1_000_000), st.integers(0, 200_000))),
)
def test_a_cause_is_the_first_telling_event_in_the_stretch_else_storage_else_unknown(
    start, length, ranks, evs, overrun
):
    inc = {"start": start, "end": start + length, "ranks": sorted(ranks)}
    overruns = [("checkpoint", overrun[0], overrun[0] + overrun[1])] if overrun else []
    cause, why = cause_of(inc, evs, overruns)
    assert cause in causes.CAUSES
    inside = sorted(
        (
            (e.ts_ms, r, e)
            for r, e in evs
            if r in ranks
            and start - causes.LEAD_MS <= e.ts_ms <= start + length
            and causes.what(e) is not None
        ),
        key=lambda h: (h[0], h[1]),
    )
    if inside:
        first = inside[0]
        assert (cause, why) == (causes.what(first[2])[0], f"{causes.what(first[2])[1]} on rank {first[1]}")
    elif overrun and overrun[0] < start + length and sum(overrun) > start:
        assert (cause, why) == ("storage", "a checkpoint ran over its allowance")
    else:
        assert (cause, why) == ("unknown", "")  # never guessed
    # once found, a cause stays with the stretch whatever later rounds read
    named = attach({"stalled": {**inc, "cause": cause, "cause_why": why}}, [], [])
    assert named["stalled"]["cause"] == cause


def test_nvml_source_reads_xids_once_and_a_slowdown_when_it_begins(monkeypatch):
    fake = FakeNvml([FakeGpu(uuid(i)) for i in range(4)]).install(monkeypatch)
    src = NvmlSource(host="n")
    assert src.hardware_events() == []
    fake.inject_xid(2, 79)
    fake.inject_xid(0, 48)
    got = src.hardware_events()
    assert [(e.gpu, e.kind, e.code) for e in got] == [(2, "xid", 79), (0, "xid", 48)]
    assert src.hardware_events() == []  # each read once
    fake.set(1, clocks_event_reasons=pynvml.nvmlClocksEventReasonHwThermalSlowdown | 0x4)
    [t] = src.hardware_events()
    assert (t.gpu, t.kind, t.code) == (1, "throttle", pynvml.nvmlClocksEventReasonHwThermalSlowdown)
    assert src.hardware_events() == []  # while it lasts, not again
    fake.set(1, clocks_event_reasons=pynvml.nvmlClocksEventReasonSwPowerCap)  # a power cap: nothing
    assert src.hardware_events() == []
    fake.set(1, clocks_event_reasons=pynvml.nvmlClocksEventReasonHwSlowdown)
    assert [(e.gpu, e.code) for e in src.hardware_events()] == [(1, pynvml.nvmlClocksEventReasonHwSlowdown)]
    src.close()
    assert fake.counts["nvmlEventSetFree"] == 1


def test_a_source_of_some_gpus_maps_nvmls_index_to_its_own(monkeypatch):
    fake = FakeNvml([FakeGpu(uuid(i)) for i in range(4)]).install(monkeypatch)
    src = NvmlSource(host="n", indices=[3, 1])
    fake.inject_xid(3, 79)
    fake.inject_xid(0, 79)  # not this source's GPU: never registered
    assert [(e.gpu, e.code) for e in src.hardware_events()] == [(0, 79)]  # its first GPU, NVML's 3


def test_gpus_without_xid_events_or_a_driver_that_refuses_them_read_none(monkeypatch):
    fake = FakeNvml([FakeGpu(uuid(0), xid_events=False), FakeGpu(uuid(1))]).install(monkeypatch)
    src = NvmlSource(host="n")
    fake.inject_xid(0, 79)
    fake.inject_xid(1, 74)
    assert [(e.gpu, e.code) for e in src.hardware_events()] == [(1, 74)]

    def refuse(*_a):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    monkeypatch.setattr(pynvml, "nvmlEventSetCreate", refuse)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", refuse)
    src = NvmlSource(host="n")
    fake.inject_xid(1, 74)
    assert src.hardware_events() == []  # no event set, no clocks reasons: nothing, no error


def test_the_sampler_reads_hardware_events_once_a_second_and_hands_them_out_once(monkeypatch):
    fake = FakeNvml([FakeGpu(uuid(0))]).install(monkeypatch)
    src = NvmlSource(host="n")
    sampler = Sampler(src, interval_s=0.01)
    sampler.sample_once()
    fake.inject_xid(0, 94)
    sampler.sample_once()  # within the second: not read yet
    assert sampler.drain_hardware() == []
    sampler._hardware_at -= 1.0
    sampler.sample_once()
    assert [(e.kind, e.code) for e in sampler.drain_hardware()] == [("xid", 94)]
    assert sampler.drain_hardware() == []


@pytest.mark.parametrize("code", [79, 74])
def test_the_agent_keeps_the_nodes_hardware_events_and_counts_them(monkeypatch, code):
    """The agent's share of it, without Redis: its round takes the sampler's events into the
    context, and a job's round gets those of its own GPUs as (rank, event)."""
    from costexporter.services.agent import Agent, AgentConfig
    from costexporter.services.agent_job import AgentJob

    fake = FakeNvml([FakeGpu(uuid(i)) for i in range(2)]).install(monkeypatch)
    agent = Agent(NvmlSource(host="n"), AgentConfig(redis_url="redis://127.0.0.1:1/0", agent_id="n"))
    fake.inject_xid(1, code)
    agent.sampler._hardware_at = -1e9
    agent.sampler.sample_once()
    agent._take_hardware(agent.sampler.drain_hardware())
    assert agent.snapshot(with_jobs=False).hardware == {(1, "xid", code): 1}
    job = AgentJob("j", reader=None)
    job.own = {5: 1}  # rank 5 of the job on this node's GPU 1
    assert [(r, e.code) for r, e in agent.booker._hardware_of(job)] == [(5, code)]


def test_dcgm_source_reads_a_new_xid_and_a_slowdown_from_the_exporters_fields():
    """dcgm-exporter's DCGM_FI_DEV_XID_ERRORS (the last Xid) and clocks event reasons, served
    over real HTTP: the first scrape's Xid is a baseline (raised before the agent looked), a
    new one is an event, a slowdown is one when it begins."""
    from costexporter.sources.dcgm import DcgmSource

    from .test_sources import DcgmExporter

    state = {"xid": 43, "reasons": 0}

    class WithHardware(DcgmExporter):
        def render(self) -> str:
            labels = (
                f'gpu="1",UUID="{uuid(1)}",modelName="NVIDIA H100 80GB HBM3",Hostname="gpu-node-1",'
                'container="trainer",namespace="ml",pod="job-1"'
            )
            return (
                super().render()
                + "# HELP DCGM_FI_DEV_XID_ERRORS Value of the last XID error encountered.\n"
                + "# TYPE DCGM_FI_DEV_XID_ERRORS gauge\n"
                + f"DCGM_FI_DEV_XID_ERRORS{{{labels}}} {state['xid']}\n"
                + "# HELP DCGM_FI_DEV_CLOCK_THROTTLE_REASONS Current clock throttle reasons.\n"
                + "# TYPE DCGM_FI_DEV_CLOCK_THROTTLE_REASONS gauge\n"
                + f"DCGM_FI_DEV_CLOCK_THROTTLE_REASONS{{{labels}}} {state['reasons']}\n"
            )

    exporter = WithHardware(2)
    try:
        src = DcgmSource([exporter.url])
        src.read()
        assert src.hardware_events() == []  # Xid 43 was there before: a baseline
        state["xid"] = 79
        src.read()
        src.read()  # the same Xid still shown: not again
        state["reasons"] = (
            pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown | pynvml.nvmlClocksEventReasonSwPowerCap
        )
        src.read()
        got = src.hardware_events()
    finally:
        exporter.close()
    assert [(e.gpu, e.kind, e.code) for e in got] == [
        (1, "xid", 79),
        (1, "throttle", pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown),
    ]
    assert src.hardware_events() == []
