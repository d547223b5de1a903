"""Property: every GPU-millisecond of a job's GPUs lands in exactly one category, and money adds up."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

from costexporter.core import bandtable
from costexporter.core.cost import Prices
from costexporter.core.model import CATEGORIES
from costexporter.core.replay import ReplayConfig, book_trace, job_report
from costexporter.sources.synth import STATES, TraceBuilder

BAND_NAMES = bandtable.current().names


@st.composite
def scenarios(draw):
    n = draw(st.integers(1, 5))
    b = TraceBuilder(
        n_gpus=n,
        per_host=draw(st.integers(1, 4)),
        interval_s=draw(st.sampled_from([0.5, 1.0, 2.0, 5.0])),
        job="p",
        seed=draw(st.integers(0, 10_000)),
    )
    dropped = draw(st.sets(st.integers(0, n - 1), max_size=n - 1))
    b.events = [e for e in b.events if not (e.type == "register" and e.rank in dropped)]
    b.run("start")
    log = [f"n={n} interval={b.interval_s} dropped={sorted(dropped)}"]
    for _ in range(draw(st.integers(1, 8))):
        log.append(f"t={b.t - b.t0:.1f} step={b.step}")
        action = draw(st.sampled_from(["stretch"] * 5 + ["gap", "phase", "resume", "start", "end", "lost"]))
        if action == "gap":
            b.gap(draw(st.integers(1, 120)))
        elif action == "phase":
            b.phase(
                draw(st.sampled_from(["checkpoint", "eval", "x"])),
                draw(st.sampled_from(["begin", "end"])),
                rank=draw(st.integers(0, n - 1)),
            )
        elif action == "resume":
            b.run("resume", step=draw(st.integers(0, max(b.step, 0))))
        elif action in ("start", "end"):
            b.run(action)
        else:
            gpus = None
            if action == "lost" and n > 1:
                gpus = tuple(sorted(draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=n - 1))))
            state = draw(st.sampled_from(sorted(STATES)))
            b.stretch(
                state,
                draw(st.integers(1, 900)),
                gpus=gpus,
                step_s=draw(st.one_of(st.none(), st.integers(1, 40))),
                zero_ranks=tuple(draw(st.sets(st.integers(0, n - 1), max_size=2))),
                straggler=draw(st.one_of(st.none(), st.integers(0, n - 1))),
            )
    note(
        "\n".join(
            log
            + [
                repr((e.type, e.rank, round(e.ts - b.t0, 1), e.fields))
                for e in b.events
                if e.type != "register"
            ]
        )
    )
    if draw(st.booleans()):
        b.step = draw(st.integers(0, max(b.step, 0)))  # the trainer jumps back: implicit resume
        b.stretch("compute", draw(st.integers(1, 200)), step_s=5)
    return b, draw(st.booleans())


@given(scenarios())
def test_categories_tile_each_gpus_time_and_cost_adds_up(scenario):
    b, energy = scenario
    cfg = ReplayConfig(prices=Prices(wasted_price_per_gpu_hour=1.0, price_per_kwh=0.3, pue=1.2))
    results, _ = book_trace(b.samples(energy_counter=energy), b.events, cfg)
    assert results, "no job was booked"
    for r in results:
        p = r.pieces
        assert r.member_intervals, "a job without GPUs"
        for g, ivals in enumerate(r.member_intervals):
            mine = np.flatnonzero(p.gpu == g)
            order = mine[np.argsort(p.start_ms[mine], kind="stable")]
            s, e = p.start_ms[order], p.end_ms[order]
            # The pieces tile the GPU's time in the job exactly: no gap, no overlap, nothing twice.
            assert int((e - s).sum()) == sum(b - a for a, b in ivals)
            assert (s[1:] >= e[:-1]).all()
            bounds = np.asarray(ivals, np.int64).reshape(-1, 2)
            k = np.searchsorted(bounds[:, 0], s, "right") - 1
            assert (k >= 0).all() and (e <= bounds[k, 1]).all()
        rep = job_report(r, cfg)
        assert sum(rep["gpu_hours"].values()) == pytest.approx(rep["gpu_hours_total"], abs=1e-9)
        observed = rep["gpu_hours_total"] - rep["gpu_hours"]["unobserved"]
        assert sum(rep["band_gpu_hours"].values()) == pytest.approx(observed, abs=1e-9)
        assert rep["cost_total"] == pytest.approx(sum(rep["cost"].values()), abs=1e-5)
        wasted_cost = sum(rep["cost"][c] for c in ("stalled", "idle", "no_progress", "rolled_back"))
        assert sum(i["cost"] for i in rep["incidents"]) == pytest.approx(wasted_cost, abs=1e-4)
        assert sum(i["gpu_hours"] for i in rep["incidents"]) == pytest.approx(
            rep["wasted_gpu_hours"], abs=1e-9
        )
        for gpu in rep["gpus"]:
            assert set(gpu["gpu_hours"]) == set(CATEGORIES) and set(gpu["band_gpu_hours"]) == set(BAND_NAMES)
        assert rep["valid_steps"] == rep["steps_completed"] - rep["steps_voided"] >= 0
