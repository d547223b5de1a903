"""A rank's GPU is the one its first registration named: one that comes back on another GPU (an
elastic restart that renumbers the ranks, a requeue onto other GPUs), or two ranks naming one GPU,
are booked by the live agent as replay books them, whether or not the agent restarted in between,
and every GPU-millisecond lands once (the job's, or unassigned)."""

from __future__ import annotations

import secrets

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from costexporter.core import jobfacts
from costexporter.core.diagnostics import Diagnostics
from costexporter.core.model import CATEGORIES
from costexporter.core.replay import ReplayConfig, book_trace
from costexporter.services.agent import Agent
from costexporter.sources.synth import TraceBuilder
from costexporter.store import ledger

from .conftest import SHARED_URL, drop_prefix
from .test_incremental_agent import run_agent

N_GPUS = 3  # one host: GPUs 0-2, every one sampled all along
MOVE_S = 430  # when the processes come back (the second registrations)

# (rank, GPU) of the first processes, then of the processes that come back
SCENARIOS = {
    "same GPUs": (((0, 0), (1, 1)), ((0, 0), (1, 1))),
    "rank 1 moves to a free GPU": (((0, 0), (1, 1)), ((0, 0), (1, 2))),
    "renumbered: a new rank 2 on rank 1's GPU": (((0, 0), (1, 1)), ((0, 0), (1, 2), (2, 1))),
    "ranks swap GPUs": (((0, 0), (1, 1)), ((0, 1), (1, 0))),
    "two ranks name one GPU from the start": (((0, 0), (1, 1), (2, 1)), ((0, 0), (1, 1), (2, 1))),
    "the rank left out moves to a free GPU": (((0, 0), (1, 0)), ((0, 0), (1, 1))),
}


def scenario(first, second) -> TraceBuilder:
    b = TraceBuilder(n_gpus=N_GPUS, per_host=N_GPUS, job="moves", seed=7, register=False)

    def register(pairs, pid_base):
        for r, g in pairs:
            b.register_rank(r, g, pid_base + r, world_size=len(pairs))

    register(first, 1000)
    b.run("start")
    b.stretch("compute", MOVE_S - 30, step_s=4, tokens=10)
    b.stretch("idle", 30)  # the processes died
    b.new_processes(register=False)
    register(second, 2000)
    b.run("resume", step=100)
    b.stretch("compute", 400, step_s=4, tokens=10)
    b.run("end")
    b.stretch("idle", 30)
    return b


def replayed(b: TraceBuilder) -> tuple[dict[str, int], dict[str, float], int, Diagnostics]:
    """Offline replay's (ms, mJ per category of the job, unassigned ms, its diagnostics)."""
    diag = Diagnostics(stream=None)
    results, unassigned = book_trace(b.samples(), b.events, ReplayConfig(), diag)
    ms: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
    mj: dict[str, float] = dict.fromkeys(CATEGORIES, 0.0)
    for r in results:
        for c, d, e in zip(
            r.pieces.category.tolist(), r.pieces.dur_ms.tolist(), r.pieces.energy_mj.tolist(), strict=True
        ):
            ms[CATEGORIES[c]] += int(d)
            mj[CATEGORIES[c]] += e
    return ms, mj, round(unassigned["gpu_hours"] * 3_600_000), diag


def booked_as_replay_books(
    prefix: str, b: TraceBuilder, restart: tuple[int, ...]
) -> tuple[Agent, Diagnostics]:
    """Run the agent over `b` (restarted after the rounds in `restart`) and check its ledger
    against replay's: GPU time and energy per category (the energy tells the GPUs apart: their
    power differs sample by sample), the unassigned time, and every GPU's time booked once."""
    late = next(e for e in b.events if e.type == "step")  # posted on time (late_s=0)
    agent = run_agent(Agent, prefix, b, late, restart_at=restart, late_s=0, fold_persist_s=0)
    client = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    amounts = ledger.read_amounts(client, prefix, b.job)
    got_ms = ledger.net_ms(amounts)
    got_mj = {c: amounts.get(ledger.amount_field(c, "mj"), 0) for c in CATEGORIES}
    unassigned = ledger.read_amounts(client, prefix, ledger.UNASSIGNED_JOB).get("unassigned:ms", 0)

    want_ms, want_mj, want_unassigned, diag = replayed(b)
    assert got_ms == want_ms
    assert all(abs(got_mj[c] - want_mj[c]) <= 1e-6 * max(want_mj[c], 1.0) + 2 for c in CATEGORIES), (
        got_mj,
        want_mj,
    )
    assert unassigned == want_unassigned
    physical = N_GPUS * (round(b.t * 1000) - round(b.t0 * 1000))
    assert sum(got_ms.values()) + unassigned == physical
    return agent, diag


@pytest.mark.parametrize("restart_s", [None, 490], ids=["no restart", "restart after"])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_rank_is_booked_where_it_first_registered_as_replay_books_it_restarted_or_not(
    prefix, name, restart_s
):
    """The agent's ledger is replay's (`booked_as_replay_books`). An agent restarted after the
    processes came back sees only their newest registrations in the ranks hash: its stored
    state keeps each rank's GPU."""
    b = scenario(*SCENARIOS[name])
    restart = () if restart_s is None else (restart_s // 7,)  # run_agent's rounds are 7 s
    agent, diag = booked_as_replay_books(prefix, b, restart)

    # Said by replay, and by the agent that saw it happen: each rank once, not every discovery
    # (it runs every round here).
    first, second = SCENARIOS[name]
    moved = any(dict(first).get(r, g) != g for r, g in second)
    booked_on = {**dict(second), **dict(first)}  # each rank's first GPU
    shared = len(set(booked_on.values())) < len(booked_on)
    assert (diag.counts["register_other_gpu"] > 0) == moved
    if restart_s is None:
        said = agent.refusals.counts
        assert (
            0 < said[(b.job, "register_other_gpu")] <= len(second)
            if moved
            else not said[(b.job, "register_other_gpu")]
        )
        assert said[(b.job, "gpu_shared")] == int(shared)


registrations = st.lists(st.integers(0, N_GPUS - 1), min_size=1, max_size=3).map(
    lambda gs: tuple(enumerate(gs))
)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(registrations, registrations, st.one_of(st.none(), st.integers(1, 165)))
def test_any_registrations_and_restart_book_as_replay_and_every_gpu_millisecond_once(first, second, restart):
    """Ranks 0..n on any of the three GPUs (two on one GPU, moved, swapped, gone, new), then
    the processes back on any GPUs, the agent restarted at any round or not."""
    prefix = f"test-moves-{secrets.token_hex(6)}"
    client = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    try:
        booked_as_replay_books(prefix, scenario(first, second), () if restart is None else (restart,))
    finally:
        drop_prefix(client, prefix)


@given(
    st.lists(
        st.tuples(st.integers(0, 7), st.integers(0, 3), st.integers(-5, 5)),
        max_size=12,
        unique_by=lambda m: m[0],
    )
)
def test_one_rank_per_gpu_keeps_each_gpus_first_claim_and_names_it_for_the_others(members):
    kept, dropped = jobfacts.one_rank_per_gpu(members)
    assert sorted([r for r, _, _ in kept] + [r for r, _, _ in dropped]) == sorted(r for r, _, _ in members)
    assert len({g for _, g, _ in kept}) == len(kept)  # a GPU booked for one rank
    holder = {g: r for r, g, _ in kept}
    for g in {g for _, g, _ in members}:
        claims = [(t, r) for r, gg, t in members if gg == g]
        assert holder[g] == min(claims)[1]  # the first claim, the lower rank at a tie
    assert all(holder[g] == h and r != h for r, g, h in dropped)
    assert kept == sorted(kept)
