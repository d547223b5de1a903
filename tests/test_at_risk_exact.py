"""GPU time at risk counts from the last checkpoint's own time, not from the start of its
5-minute bucket: a job that saved at its last step and ended cleanly has nothing at risk."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from costexporter.api.app import create_app
from costexporter.core.cost import MS_PER_HOUR
from costexporter.core.figures import encode_at_risk, exact_at_risk_ms
from costexporter.services.agent import Agent
from costexporter.sources.synth import TraceBuilder
from costexporter.store import keys
from costexporter.store.ledger_read import LedgerStore

from .test_incremental_agent import run_agent

WINDOW = "2025-07-26T00:00:00Z,2025-07-28T00:00:00Z"


def _job(after_s: float, end: bool) -> TraceBuilder:
    b = TraceBuilder(n_gpus=2, per_host=2, job="risk", seed=5)
    b.run("start")
    b.stretch("compute", 130, step_s=5, tokens=10)  # the checkpoint lands mid-bucket
    b.phase("checkpoint", "begin")
    b.stretch("checkpoint", 10, zero_ranks=(0,))
    b.phase("checkpoint", "end", step=b.step)
    if after_s:
        b.stretch("compute", after_s, step_s=5, tokens=10)
    if end:
        b.run("end")
    b.stretch("idle", 20)
    return b


@pytest.mark.parametrize(("after_s", "end"), [(0, True), (60, True)])
def test_at_risk_from_the_checkpoints_time(shared, prefix, after_s, end):
    b = _job(after_s, end)
    late = b.events[-1]
    run_agent(Agent, prefix, b, late, late_s=0)
    fig = shared.hgetall(keys.figures_key(prefix, "risk"))
    ckpt = float(fig["last_checkpoint_ts"])
    got = (
        TestClient(create_app(LedgerStore(shared, prefix)))
        .get("/api/v1/jobs/risk", params={"window": WINDOW})
        .json()
    )
    # two GPUs, from the checkpoint's end to the run's end: 0 s, or the 60 s of steps after it
    assert got["gpu_hours_at_risk"] * MS_PER_HOUR == pytest.approx(2 * after_s * 1000, abs=2 * 1000)
    # the checkpoint's 5-minute bucket holds the whole job: counted from it, all of it was at risk
    assert int(ckpt) // 300 * 300 <= b.t0 and got["gpu_hours"] * 3600 >= 2 * (140 + after_s)


def test_exact_at_risk_only_when_every_agent_counted_from_that_checkpoint_inside_the_window():
    f = {
        "at_risk:a": encode_at_risk(5_000, 1_000, 9_000),
        "at_risk:b": encode_at_risk(7_000, 1_000, 9_500),
        "x": "1",
    }
    assert exact_at_risk_ms(f, 1_000, 0, 10_000) == 12_000
    assert exact_at_risk_ms(f, 2_000, 0, 10_000) is None  # another checkpoint since
    assert exact_at_risk_ms(f, 1_000, 0, 9_200) is None  # counted past the window's end
    assert exact_at_risk_ms(f, 1_000, 1_500, 10_000) is None  # the checkpoint before the window
    assert exact_at_risk_ms({**f, "at_risk:c": "junk"}, 1_000, 0, 10_000) is None
    assert exact_at_risk_ms({"x": "1"}, 1_000, 0, 10_000) is None
