"""The agent's own wall clock steps (a manual `date`, NTP stepping, a VM resumed): the step is
detected against the monotonic clock, logged and counted, and its time is neither billed nor
lost. Real Redis; the agent in-process with an injected clock and a live (wall-clock) source.
"""

from __future__ import annotations

import logging

import pytest
from prometheus_client import generate_latest

from costexporter.core.model import GpuId
from costexporter.services.agent import Agent, AgentConfig
from costexporter.services.exporter import registry_for
from costexporter.sources.base import GpuSource, Reading
from costexporter.sources.sampler import ClockWatch
from costexporter.store import ledger, protocol
from costexporter.trainer.transport import send_entries

T0 = 1_790_000_000.0
JOB_S = 70  # the job's length: 140 GPU-s on its two GPUs


class SteppedClock:
    """Monotonic seconds advance one at a time; the wall clock is T0 + that + the steps so far."""

    def __init__(self, steps: dict[int, float]) -> None:
        self.t, self.steps = 0, steps  # at monotonic second -> wall-clock step (s)

    def mono(self) -> float:
        return float(self.t)

    def wall(self) -> float:
        return T0 + self.t + sum(d for at, d in self.steps.items() if self.t >= at)


class LiveGpus(GpuSource):
    """Two busy GPUs read now, stamped with the (stepped) wall clock, as NVML's readings are."""

    wall_clock = True

    def __init__(self, clock: SteppedClock) -> None:
        super().__init__()
        self.clock, self.host = clock, "clk0"

    def gpus(self) -> list[GpuId]:
        return [GpuId("clk0", i, f"GPU-clk-{i}", "NVIDIA H100", 700.0) for i in range(2)]

    def read(self) -> list[Reading]:
        return [Reading(i, self.clock.wall(), 650.0, 100.0) for i in range(2)]


def _event(rank: int, seq: int, type_: str, ts: float, **f) -> dict:
    return protocol.encode_fields(
        {
            "v": "1",
            "type": type_,
            "job": "clk",
            "ts": f"{ts:.3f}",
            "rank": rank,
            "session": f"s{rank}",
            "seq": seq,
            **f,
        }
    )


def _run(shared, prefix: str, steps: dict[int, float]) -> tuple[dict, Agent]:
    """A 70-s job on both GPUs (its trainer's clock right), the agent sampling every second and
    booking every 5 for 200 s; returns the job's ledger and the node's unassigned time."""
    clock = SteppedClock(steps)
    agent = Agent(
        LiveGpus(clock),
        AgentConfig(
            prefix=prefix, agent_id="clk0", book_interval_s=5, learn_idle=False, unassigned_hold_s=30
        ),
        clock=ClockWatch(wall=clock.wall, mono=clock.mono),
    )
    events = [
        *(
            _event(r, 0, "register", T0 + 2, host="clk0", gpu=r, gpu_uuid=f"GPU-clk-{r}", world_size=2)
            for r in (0, 1)
        ),
        _event(0, 1, "run", T0 + 2, state="start"),
        *(_event(0, 1 + k, "step", T0 + 2 + 5 * k, step=k) for k in range(1, JOB_S // 5 + 1)),
        _event(0, 2 + JOB_S // 5, "run", T0 + 2 + JOB_S, state="end"),
    ]
    for clock.t in range(1, 2 * JOB_S + 60):
        agent.sampler.sample_once()
        due = [e for e in events if float(e["ts"]) <= T0 + clock.t]
        if due:
            send_entries(shared, prefix, "clk", due)
            events = events[len(due) :]
        if clock.t % 5 == 0:
            agent.tick()
    assert not events
    agent.shutdown()
    got = ledger.net_ms(ledger.read_amounts(shared, prefix, "clk"))
    got["_unassigned"] = ledger.read_amounts(shared, prefix, ledger.UNASSIGNED_JOB).get("unassigned:ms", 0)
    return got, agent


@pytest.mark.parametrize(
    "steps",
    [{30: 300.0, 55: -300.0}, {40: -50.0}, {25: 120.0}],
    ids=["ahead_300s_for_25s", "back_50s", "ahead_120s"],
)
def test_a_wall_clock_step_neither_bills_nor_loses_time(shared, prefix, steps, caplog):
    clean, _ = _run(shared, f"{prefix}:clean", {})
    assert sum(clean.values()) - clean["_unassigned"] == 2 * JOB_S * 1000  # 140 GPU-s, every one
    # The node's whole time, job and unassigned, is what the clean run has: no second billed
    # twice or dropped across the step.
    with caplog.at_level(logging.WARNING, "costexporter.sources.sampler"):
        got, agent = _run(shared, f"{prefix}:stepped", steps)
    assert got == clean, (got, clean)
    forward = sum(d > 0 for d in steps.values())
    assert dict(agent.sampler.clock.steps) == {
        k: n for k, n in (("forward", forward), ("backward", len(steps) - forward)) if n
    }
    assert "the wall clock stepped" in caplog.text
    text = generate_latest(registry_for(agent)).decode()
    assert f'costexporter_agent_clock_steps_total{{direction="forward"}} {float(forward)}' in text
    assert f"costexporter_agent_clock_offset_seconds {float(sum(steps.values()))}" in text
