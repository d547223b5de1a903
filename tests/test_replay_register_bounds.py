"""Replay bounds a rank's register by its GPU's samples, with the live agent's rule
(`jobfacts.gpu_start_ms`): a register dated years back or a day ahead neither books the years in
between nor drops the GPU; it is counted, warned about on stderr and in the report's JSON."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json

import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st

from costexporter.core import jobfacts
from costexporter.core.timeutil import to_ms
from costexporter.sources.synth import TraceBuilder, write_events_jsonl, write_nvidia_smi_csv

from .conftest import ROOT

SCHEMA = json.loads((ROOT / "costexporter" / "schemas" / "replay-output.schema.json").read_text())
Y2001 = dt.datetime(2001, 6, 1, tzinfo=dt.UTC).timestamp()


def _trace() -> TraceBuilder:
    b = TraceBuilder(n_gpus=4, per_host=4, seed=7)
    b.run("start")
    b.stretch("compute", 900, step_s=2.0, tokens=1000)
    b.run("end")
    return b


def _replay(cli, tmp_path, events, name: str):
    b = _trace()
    d = tmp_path / name
    d.mkdir()
    [csv_path] = write_nvidia_smi_csv(b.samples(), d)
    ev = write_events_jsonl(events, d / "events.jsonl")
    r = cli("replay", "--samples", f"node0={csv_path}", "--events", ev, "--format", "json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    jsonschema.validate(rep, SCHEMA)
    return rep, r.stderr


def _redate(events, rank: int, ts: float):
    ms = to_ms(ts)
    mine = lambda e: e.type == "register" and e.rank == rank  # noqa: E731
    return [dataclasses.replace(e, ts_ms=ms) if mine(e) else e for e in events]


def _hours(rep) -> float:
    [job] = rep["jobs"].values()
    return sum(job["gpu_hours"].values())


def test_a_register_dated_years_back_books_what_its_samples_say(cli, tmp_path):
    good, err = _replay(cli, tmp_path, _trace().events, "good")
    assert "register" not in err and not good["warnings"]
    bad, err = _replay(cli, tmp_path, _redate(_trace().events, 1, Y2001), "y2001")
    assert _hours(bad) == pytest.approx(_hours(good), abs=1e-3)  # not 24 years of `unobserved`
    [job], [ok] = bad["jobs"].values(), good["jobs"].values()
    assert job["cost_total"] == pytest.approx(ok["cost_total"], abs=0.01)
    assert bad["warnings"] == {"register_before_samples": 1}
    assert "job 'r1' rank 1: register_before_samples" in err and "h before node0 GPU 1" in err


def test_a_register_dated_a_day_ahead_keeps_its_gpu(cli, tmp_path):
    b = _trace()
    good, _ = _replay(cli, tmp_path, b.events, "good")
    ahead = b.t0 + 22 * 3600
    bad, err = _replay(cli, tmp_path, _redate(b.events, 2, ahead), "ahead")
    [job], [ok] = bad["jobs"].values(), good["jobs"].values()
    assert len(job["gpus"]) == 4  # the GPU is still the job's
    assert _hours(bad) == pytest.approx(_hours(good), abs=1e-3)
    assert job["gpu_hours"]["productive"] == pytest.approx(ok["gpu_hours"]["productive"], abs=1e-3)
    assert bad["warnings"] == {"register_after_samples": 1}
    assert "job 'r1' rank 2: register_after_samples" in err


def test_every_rank_ahead_starts_at_its_first_sample(cli, tmp_path):
    b = _trace()
    good, _ = _replay(cli, tmp_path, b.events, "good")
    events = b.events
    for r in range(4):
        events = _redate(events, r, b.t0 + 22 * 3600)
    bad, _ = _replay(cli, tmp_path, events, "all-ahead")
    assert _hours(bad) == pytest.approx(_hours(good), abs=1e-3)
    assert bad["warnings"] == {"register_after_samples": 4}


T = st.integers(0, 10**13)


@given(reg=T, first=T, span=st.integers(0, 10**9), floor=st.integers(0, 10**13))
def test_a_gpus_start_lies_within_its_samples(reg, first, span, floor):
    newest = first + span
    start, ahead = jobfacts.gpu_start_ms(reg, first, newest, floor)
    assert first <= start <= newest  # never before what was observed, never past it
    if first <= reg <= newest and floor <= reg:
        assert (start, ahead) == (reg, 0)  # a register within the samples is taken as it is
    assert ahead == max(0, max(reg, first, floor) - newest)
    # no newest sample: only the lower bounds apply
    assert jobfacts.gpu_start_ms(reg, first, None, floor) == (max(reg, first, floor), 0)


def test_one_rank_a_day_ahead_among_punctual_ones_does_not_stretch_the_job(cli, tmp_path):
    """No `run end` (the recording stopped with the job): the late rank's register date is
    refused as its start and as the end of the job's data, so the job is not billed a day of
    `unobserved` GPUs (before: 176 GPU-h of a 12 GPU-h job with 8 ranks)."""
    b = TraceBuilder(n_gpus=4, per_host=4, seed=7)
    b.run("start")
    b.stretch("compute", 900, step_s=2.0, tokens=1000)
    d = tmp_path / "late-rank"
    d.mkdir()
    [csv_path] = write_nvidia_smi_csv(b.samples(), d)
    reps = {}
    for name, events in (("good", b.events), ("late", _redate(b.events, 2, b.t0 + 22 * 3600))):
        ev = write_events_jsonl(events, d / f"{name}.jsonl")
        r = cli("replay", "--samples", f"node0={csv_path}", "--events", ev, "--format", "json")
        assert r.returncode == 0, r.stderr
        reps[name] = json.loads(r.stdout)
    assert _hours(reps["late"]) == pytest.approx(_hours(reps["good"]), abs=1e-3)
    [job] = reps["late"]["jobs"].values()
    assert job["gpu_hours"]["unobserved"] == pytest.approx(0, abs=1e-3)
    assert reps["late"]["warnings"] == {"register_after_samples": 1}
