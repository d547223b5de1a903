"""Shared by the agent tests: an in-process agent over a synthetic trace, played on a clock the
test moves, one booking round per step of that clock."""

from __future__ import annotations

from typing import Any

from costexporter.services.agent import Agent, AgentConfig
from costexporter.sources.playback import ReplaySource
from costexporter.sources.synth import TraceBuilder


def replay_agent(b: TraceBuilder, **cfg: Any) -> tuple[Agent, list[float]]:
    """(agent, now): the agent reads `b`'s samples as of `now[0]` seconds into the trace."""
    now = [0.0]
    agent = Agent(ReplaySource(b.samples(), speed=1.0, clock=lambda: now[0]), AgentConfig(**cfg))
    return agent, now


def tick(agent: Agent, now: list[float], dt: float) -> None:
    """Move the clock by `dt` seconds, hand the agent what its source read, run one round."""
    now[0] += dt
    for r in agent.source.read():
        agent.sampler._buf.append(r)
    agent.tick()
