"""Cost to finish: the job's own recent cost per valid step times the steps it has left, never
below what it has spent; none without total_steps or a recent rate (said); replay's and the
API's the same function on the same buckets."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from costexporter.core import forecast
from costexporter.core.replay import ReplayConfig, book_trace, job_report
from costexporter.sources.synth import TraceBuilder

B = 300  # a bucket


def test_the_rate_is_the_last_hours_cost_over_its_valid_steps():
    # two hours: an older, dearer one (its steps slower), then an hour at 0.5 a step
    old = [(t * B, 12.0, 10) for t in range(12)]
    new = [((12 + t) * B, 6.0, 12) for t in range(12)]
    f = forecast.cost_to_finish(old + new, spent=216.0, last_step=264, total_steps=1264)
    assert f.steps_left == 1000 and f.recent_cost_per_valid_step == pytest.approx(0.5)
    assert f.cost_to_finish == pytest.approx(500.0) and f.cost_at_finish == pytest.approx(716.0)
    assert f.low == f.high == pytest.approx(500.0) and f.notes == []


def test_the_interval_is_the_spread_of_the_hours_parts():
    # six 10-minute parts at 0.4, 0.5, 0.6 a step (two each), in any order
    rates = [0.4, 0.5, 0.6, 0.4, 0.5, 0.6]
    rows = [(i * B, rates[i // 2] * 10, 10) for i in range(12)]
    f = forecast.cost_to_finish(rows, 100.0, 120, 220)
    assert (f.low, f.high) == (pytest.approx(40.0), pytest.approx(60.0))
    assert f.cost_to_finish == pytest.approx(50.0)


@pytest.mark.parametrize(
    "rows, total, note",
    [
        ([(0, 5.0, 10)], None, "no total_steps"),
        ([(0, 5.0, 10), (B, 5.0, 0), (13 * B, 5.0, 0)], 100, "no valid step in the last 60 minutes"),
        ([], 100, "nothing booked yet"),
        ([(0, 5.0, 10)], 100, "fewer than 3 parts"),
    ],
)
def test_what_cannot_be_told_is_said(rows, total, note):
    f = forecast.cost_to_finish(rows, 10.0, 10, total)
    assert any(note in n for n in f.notes), f.notes
    assert (f.low, f.high) == (None, None)


def test_a_finished_job_has_nothing_left_and_a_hostile_total_is_none():
    f = forecast.cost_to_finish([(0, 5.0, 10)], 42.0, 500, 500)
    assert (f.steps_left, f.cost_to_finish, f.cost_at_finish) == (0, 0.0, 42.0)
    for bad in ("-5", "1e30", "nan", "inf", "ten", True, [], "2.5", 0):
        assert forecast.total_steps_of({"total_steps": bad}) is None, bad
    assert forecast.total_steps_of({"total_steps": "1000"}) == 1000
    assert forecast.total_steps_of({"total_steps": 1000.0}) == 1000


rows_st = st.lists(
    st.tuples(
        st.integers(0, 40).map(lambda i: i * B),
        st.floats(0, 1e4, allow_nan=False, allow_infinity=False),
        st.integers(0, 500),
    ),
    max_size=40,
    unique_by=lambda r: r[0],
)


@settings(max_examples=300, deadline=None)
@given(
    rows_st, st.floats(0, 1e7, allow_nan=False), st.integers(-1, 10**6), st.integers(1, 2 * 10**6) | st.none()
)
def test_a_forecast_never_goes_below_what_is_spent_nor_outside_its_interval(rows, spent, last, total):
    f = forecast.cost_to_finish(rows, spent, last, total)
    if f.cost_at_finish is not None:
        assert f.cost_at_finish >= spent
        assert f.cost_to_finish is not None and f.cost_to_finish >= 0
        assert f.steps_left is not None and f.steps_left >= 0
        if f.recent_cost_per_valid_step is not None:
            assert f.cost_to_finish == pytest.approx(f.recent_cost_per_valid_step * f.steps_left)
    if f.low is not None:
        assert (
            f.high is not None
            and 0 <= f.low <= f.cost_to_finish * (1 + 1e-9) + 1e-9 <= f.high * (1 + 1e-9) + 2e-9
        )
    else:
        assert f.high is None
    assert (f.cost_at_finish is None) == bool(f.notes and f.cost_to_finish is None)


def steady(total: int, steps: int, step_s: float = 5.0) -> TraceBuilder:
    b = TraceBuilder(n_gpus=4, per_host=4, job="fc", seed=3)
    b.meta(total_steps=total)
    b.run("start")
    b.stretch("compute", steps * step_s, step_s=step_s, tokens=100)
    return b


def test_replay_forecasts_a_steady_run_to_its_cost_at_the_end():
    """Halfway through a steady run, what is left costs what was spent (within the partial
    first bucket), and the run's end, at its cost per valid step, is the whole run's cost."""
    half = steady(1440, 720)  # an hour of 5-s steps of 1,440
    [job], _ = book_trace(half.samples(), half.events, ReplayConfig())
    rep = job_report(job, ReplayConfig())
    f = rep["forecast"]
    assert f["total_steps"] == 1440 and f["steps_left"] == 720 and f["notes"] == []
    assert f["cost_to_finish"] == pytest.approx(rep["cost_total"], rel=0.02)
    assert f["low"] <= f["cost_to_finish"] <= f["high"]
    assert f["cost_at_finish"] == pytest.approx(rep["cost_total"] + f["cost_to_finish"])
    whole = steady(1440, 1440)
    [job], _ = book_trace(whole.samples(), whole.events, ReplayConfig())
    assert f["cost_at_finish"] == pytest.approx(job_report(job, ReplayConfig())["cost_total"], rel=0.02)


def test_replay_of_files_reads_total_steps_from_the_events_file(cli, tmp_path):
    """The `replay` command on an nvidia-smi CSV and a JSONL events file (the meta as a trainer
    posts it): the forecast's total_steps come through the events parser, and the JSON is the
    schema's."""
    import json

    import jsonschema

    from costexporter.sources.synth import write_events_jsonl, write_nvidia_smi_csv

    b = steady(2000, 360)
    b.meta(model_params=7e9, dtype="bf16")
    [csv_path] = write_nvidia_smi_csv(b.samples(), tmp_path / "trace")
    events = write_events_jsonl(b.events, tmp_path / "events.jsonl")
    r = cli("replay", "--samples", str(csv_path), "--events", str(events), "--format", "json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    schema = json.loads(
        (Path(__file__).parents[1] / "costexporter/schemas/replay-output.schema.json").read_text()
    )
    jsonschema.validate(rep, schema)
    f = rep["jobs"]["fc"]["forecast"]
    assert (f["total_steps"], f["steps_left"]) == (2000, 1640) and f["cost_to_finish"] > 0
    assert rep["jobs"]["fc"]["meta_ignored"] == []
