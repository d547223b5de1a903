"""A trainer's data is data: whatever a trainer writes under its own job (a phase name, a key of
the wrong type, deep or huge JSON, absurd numbers, the jobs index's order, a GPU another job
holds), booking stays exact for every other job and for its own exact where it can be.

Real Redis (the shared one, each test its own prefix); agents run in-process on a replayed
trace driven round by round (the conservation property's harness), the watcher and the API for
real (the FastAPI app over HTTP through its test client).
"""

from __future__ import annotations

from costexporter.sources.synth import TraceBuilder
from costexporter.store import ledger

from ..test_agent import offline_ms
from ..test_ledger_faults_property import Run


def startup_phase_job(name: str) -> TraceBuilder:
    """A job that trains, checkpoints step 20, runs 300 s more, then restarts: its rank 0
    declares a phase called `name` while it starts again and resumes from step 20 (60 steps,
    600 GPU-s, rolled back)."""
    b = TraceBuilder(n_gpus=2, per_host=2, job="st", seed=3)
    b.run("start")
    b.stretch("compute", 100, step_s=5, tokens=10)
    b.phase("checkpoint", "begin")
    b.stretch("checkpoint", 10)
    b.phase("checkpoint", "end", step=20)
    b.stretch("compute", 300, step_s=5, tokens=10)
    b.phase(name, "begin")
    b.stretch("idle", 20)
    b.phase(name, "end")
    b.run("resume", step=20)
    b.stretch("compute", 100, step_s=5, tokens=10)
    b.run("end")
    b.stretch("idle", 100)
    return b


def _booked(client, prefix: str, b: TraceBuilder) -> tuple[dict, Run]:
    run = Run(client, prefix, b, [b], None)
    run.run()
    return ledger.net_ms(ledger.read_amounts(client, prefix, b.job)), run


def test_a_phase_named_startup_keeps_rollbacks_exact_after_the_stream_is_trimmed(shared, prefix):
    # A declared phase named like the run's own startup allowance made the agent's fold give up:
    # every round walked the (trimmed) stream again, and the rollback's 600 GPU-s stayed productive.
    for name in ("startup", "warmup"):
        b = startup_phase_job(name)
        expected, _ = offline_ms(b)
        got, run = _booked(shared, f"{prefix}:{name}", b)
        trimmed = sum(ag.stats["stream_entries_trimmed"] for ag in run.agents)
        assert trimmed > 0, (name, "the stream was never trimmed: the case is not exercised")
        assert got == expected, (name, got, expected)
        assert expected["rolled_back"] >= 2 * 290_000, expected  # the resume voided ~300 s on 2 GPUs
        assert not any(ag.stats["timeline_rebuilds"] for ag in run.agents), name
