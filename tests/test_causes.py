"""Whose fault a wasted stretch was: the catalog, the rule (one for the agent and replay), and
the NVML source that reads the hardware events (Xids through an event set, hardware clock
slowdowns) through a fake of the library behind pynvml, with NVML's own functions and codes."""

from __future__ import annotations

import json
import time
from importlib import resources

import pynvml
import pytest
import redis
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
            | pynvml.nvmlClocksEventReasonHwThermalSlowdown
            | pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown
        )
    )
    # a power cap, a GPU at its temperature target or an idle GPU's clocks say nothing of a fault
    assert causes.what(HardwareEvent(0, 0, "throttle", pynvml.nvmlClocksEventReasonSwPowerCap)) is None
    assert causes.what(HardwareEvent(0, 0, "throttle", pynvml.nvmlClocksEventReasonSwThermalSlowdown)) is None
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


def test_the_incidents_route_adds_up_causes_and_the_policys_credit_line(tmp_path):
    """Two agents' incidents of one job (as `ledger.queue_incidents` stores them), one host
    naming a hardware cause the other did not see: the job-wide stretch takes the named cause
    and both hosts' cost; by_cause counts each incident's part inside the window; the credit
    line is the policy's credited causes, over real HTTP."""
    import uuid as uuid_mod

    import httpx
    import redis

    from costexporter.core.terms import parse_policy_file
    from costexporter.store import ledger
    from costexporter.store.ledger_read import LedgerStore

    from .api_helpers import T0, served, write_job
    from .conftest import SHARED_URL, drop_prefix

    prefix = f"test-{uuid_mod.uuid4().hex[:12]}"
    r = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    write_job(r, prefix, "j", "llm", incidents=0)
    ms = lambda s: (T0 + s) * 1000  # noqa: E731

    def inc(cat, a, b, host, cause="unknown", why="", ucost=1_000_000, gpu_ms=60_000):
        return dict(category=cat, start=ms(a), end=ms(b), gpu_ms=gpu_ms, ranks=[0], host=host,
                    zero_util_ranks=[], cause=cause, cause_why=why, cost_micro=ucost)  # fmt: skip

    pipe = r.pipeline(transaction=True)
    ledger.queue_incidents(pipe, prefix, "j", "agent-a", [
        inc("stalled", 250, 350, "a"),
        inc("idle", 1000, 1100, "a", "storage", "a checkpoint ran over its allowance", 500_000),
    ])  # fmt: skip
    ledger.queue_incidents(pipe, prefix, "j", "agent-b", [
        inc("stalled", 250, 350, "b", "hardware", "Xid 79: GPU has fallen off the bus on rank 1", 2_000_000),
        # hostile values: an unknown cause, no cost
        {**inc("no_progress", 3000, 3100, "b"), "cause": "mystery", "cost_micro": -5},
    ])  # fmt: skip
    pipe.execute()
    policy = parse_policy_file({"credit_causes": ["hardware", "network"]})
    store = LedgerStore(redis.Redis.from_url(SHARED_URL, decode_responses=True), prefix)
    try:
        with served(store, credit_causes=policy.credit_causes) as (base, _):
            window = f"{T0},{T0 + 3600}"
            body = httpx.get(f"{base}/api/v1/jobs/j/incidents", params={"window": window}, timeout=10).json()
            half = f"{T0},{T0 + 300}"  # the stalled stretch 250-350 s: half of it inside
            part = httpx.get(f"{base}/api/v1/jobs/j/incidents", params={"window": half}, timeout=10).json()
    finally:
        drop_prefix(r, prefix)
    got = {i["category"]: i for i in body["incidents"]}
    assert (got["stalled"]["cause"], got["stalled"]["cost"]) == ("hardware", "3.000000")
    assert got["stalled"]["cause_why"].startswith("Xid 79")
    assert (got["idle"]["cause"], got["idle"]["cost"]) == ("storage", "0.500000")
    assert (got["no_progress"]["cause"], got["no_progress"]["cost"]) == ("unknown", None)
    assert body["by_cause"]["hardware"]["cost"] == "3.000000"
    assert body["by_cause"]["storage"] == {"gpu_hours": pytest.approx(60 / 3600), "cost": "0.500000"}
    assert body["credit"] == {
        "causes": ["hardware", "network"],
        "gpu_hours": pytest.approx(120 / 3600),
        "cost": "3.000000",
    }
    assert any("before their cost was kept" in w for w in body["warnings"])
    # half of the stretch inside the window: half its time and cost are credited
    assert part["credit"]["cost"] == "1.500000" and part["credit"]["gpu_hours"] == pytest.approx(60 / 3600)


@pytest.mark.parametrize("raw", [["hardware", "weather"], "hardware", ["unknown"]])
def test_a_credit_the_policy_cannot_name_fails_it_closed(raw):
    from costexporter.core.terms import PolicyError, parse_policy_file

    with pytest.raises(PolicyError, match="credit_causes must be a list of hardware, job, network, storage"):
        parse_policy_file({"credit_causes": raw})


def test_a_real_agent_books_a_stall_with_the_xid_its_gpu_raised(shared, prefix, monkeypatch):
    """The agent over a real Redis and the fake NVML: a job's steps stop (its heartbeats go on),
    GPU 1 raises Xid 79 as they stop; the stalled stretch the agent books names it, on rank 1,
    and the finance API's incidents route credits it (the policy credits hardware)."""
    import httpx

    from costexporter.core.booking import BookingConfig
    from costexporter.services.agent import Agent, AgentConfig
    from costexporter.store.ledger_read import LedgerStore
    from costexporter.trainer.transport import send_entries

    from .agent_helpers import entry_maker, running, wait_booked
    from .api_helpers import served
    from .conftest import SHARED_URL

    uuids = [f"GPU-{i:08x}-aaaa-bbbb-cccc-{i:012x}" for i in range(2)]
    fake = FakeNvml([FakeGpu(u) for u in uuids]).install(monkeypatch)
    agent = Agent(
        NvmlSource(host="gpu-host"),
        AgentConfig(
            redis_url=SHARED_URL,
            prefix=prefix,
            agent_id="gpu-host",
            book_interval_s=0.1,
            sample_interval_s=0.05,
            job_refresh_s=0.2,
            booking=BookingConfig(gap_intervals=100, stall_floor_s=0.5, stall_k=2.0),
        ),
    ).start()
    job = "xid-job"
    entry = entry_maker(job)
    send_entries(
        shared,
        prefix,
        job,
        [entry(r, 0, "register", host="gpu-host", gpu=r, gpu_uuid=uuids[r]) for r in range(2)]
        + [entry(0, 1, "run", state="start")],
    )
    with running(agent):
        seq = 2
        for step in range(1, 12):  # steps every 0.1 s
            time.sleep(0.1)
            send_entries(shared, prefix, job, [entry(0, seq, "step", step=step)])
            seq += 1
        fake.inject_xid(1, 79)  # as the steps stop
        for _ in range(25):  # 2.5 s without a step, the trainer alive
            time.sleep(0.1)
            send_entries(shared, prefix, job, [entry(0, seq, "heartbeat")])
            seq += 1
        send_entries(shared, prefix, job, [entry(0, seq, "run", state="end")])
        end = time.time()
        wait_booked(shared, prefix, job, ["gpu-host"], int(end * 1000))
    assert agent.snapshot(with_jobs=False).hardware == {(1, "xid", 79): 1}
    store = LedgerStore(redis.Redis.from_url(SHARED_URL, decode_responses=True), prefix)
    with served(store, credit_causes=("hardware",)) as (base, _):
        window = f"{int(end) - 600},{int(end) + 600}"
        body = httpx.get(f"{base}/api/v1/jobs/{job}/incidents", params={"window": window}, timeout=10).json()
    wasted = [i for i in body["incidents"] if i["category"] in ("stalled", "no_progress")]
    assert wasted, body
    assert {(i["cause"], i["cause_why"]) for i in wasted} == {
        ("hardware", "Xid 79: GPU has fallen off the bus on rank 1")
    }, body
    assert body["credit"]["cost"] == body["by_cause"]["hardware"]["cost"] != "0.000000"


def test_replays_table_says_each_incidents_cause():
    """A checkpoint 25 minutes over its allowance: replay's table lists the stall as storage's."""
    from costexporter.cli.report import to_table
    from costexporter.core.replay import ReplayConfig, replay

    from .test_live_replay_figures import scenario

    b = scenario("hung")
    text = to_table(replay(b.samples(), b.events, ReplayConfig()))
    incidents = text[text.index("incidents") :]
    row = next(line for line in incidents.splitlines() if "stalled" in line)
    assert "storage" in row, text
