"""Traces of every kind replay meets, for tests that hold one booking against another (a trace
booked in time windows against the same trace in one window): synthetic jobs with every kind of
time, real-like 100 ms recordings, several jobs handing GPUs over, free GPUs, logs of other
tools, an energy counter."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from costexporter.core.diagnostics import Diagnostics
from costexporter.core.model import Event, Samples
from costexporter.core.replay import ReplayConfig
from costexporter.core.tracefiles import combine
from costexporter.sources import synth
from costexporter.sources.synth import TraceBuilder

from .realtrace import Scenario
from .test_live import scenario as live_scenario

DATA = Path(__file__).parent / "data"


@dataclass(frozen=True)
class Case:
    name: str
    samples: Samples
    events: list[Event]
    cfg: ReplayConfig


def _gap() -> TraceBuilder:
    """A job whose logger stops for 90 s mid-run, then goes on."""
    b = TraceBuilder(n_gpus=4, per_host=2, job="live", seed=11)
    b.run("start")
    b.stretch("compute", 300, step_s=5)
    b.gap(90)
    b.stretch("compute", 60, step_s=5)
    b.run("end")
    b.stretch("idle", 5)
    return b


def _handover() -> tuple[Samples, list[Event]]:
    """Job a on 2 GPUs crashes; job b takes them; a third GPU no job holds."""
    a = TraceBuilder(n_gpus=3, per_host=3, job="a", seed=4, register=False)
    for r in range(2):
        a.register_rank(r, r, 100 + r, world_size=2)
    a.run("start")
    a.stretch("compute", 120, step_s=4)
    a.stretch("idle", 40)
    b = TraceBuilder(n_gpus=2, per_host=3, job="b", seed=4, t0=a.t, register=False)
    for r in range(2):
        b.event(
            "register", rank=r, host="node0", gpu=r, gpu_uuid=a.uuid(r), local_rank=r, world_size=2, pid=7 + r
        )
    b.run("start")
    for k in range(1, 30):
        b.event("step", ts=b.t + 4 * k, step=k)
    b.t += 120
    b.run("end")
    a.stretch("compute", 120)  # b's samples
    a.stretch("idle", 10)
    return a.samples(), sorted(a.events + b.events, key=lambda e: e.ts_ms)


def _gpulog(name: str) -> tuple[Samples, list[Event]]:
    from costexporter.core import gpulogs

    diag = Diagnostics(stream=None)
    clock = gpulogs.LogClock(1_753_577_230_000, 1000)
    return combine([gpulogs.read_log(DATA / "gpulogs" / name, "host", "UTC", diag, None, clock)]), []


def cases(long: bool = True) -> Iterator[Case]:
    """Every case, built as it is taken (`long`: the multi-hour ones too)."""
    b300 = ReplayConfig(gpu_model="NVIDIA B300")
    builders: list[tuple[str, Callable[[], tuple[Samples, list[Event]]], ReplayConfig]] = []

    def tb(b: TraceBuilder, energy: bool = False) -> tuple[Samples, list[Event]]:
        return b.samples(energy_counter=energy), b.events

    for kind in ("steps", "checkpoint", "deadlock", "resume", "hung"):
        builders.append((f"live-{kind}", lambda k=kind: tb(live_scenario(k)), ReplayConfig()))
    builders.append(("live-gap", lambda: tb(_gap()), ReplayConfig()))
    builders.append(("mini", lambda: tb(synth.scenario_mini()), b300))
    builders.append(("mini-energy", lambda: tb(synth.scenario_mini(), energy=True), b300))
    builders.append(("mini-bare", lambda: (synth.scenario_mini().samples(), []), b300))
    builders.append(("handover", _handover, ReplayConfig()))
    for name, scen in (
        ("h100-100ms", Scenario.h100(seed=1)),
        ("field-100ms", Scenario.field(seed=2)),
        ("b300-100ms", Scenario.b300(seed=3)),
    ):
        builders.append((name, lambda s=scen: (lambda t: (t.samples, t.events))(s.build()), ReplayConfig()))
    for log in ("dmon-default.txt", "dmon-DT-pucet.txt", "dcgmi-dmon.txt"):
        builders.append((log, lambda n=log: _gpulog(n), ReplayConfig(gpu_model="NVIDIA H100 80GB HBM3")))
    if long:
        builders.append(("r1-story", lambda: tb(synth.scenario_r1_story()), b300))
    for name, build, cfg in builders:
        samples, events = build()
        yield Case(name, samples, events, cfg)
