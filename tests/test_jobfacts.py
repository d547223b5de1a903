"""One home for what a job says about itself (`core/jobfacts.py`), the rank->GPU rule
(`model.GpuIndex`) and the live hash's entries (`protocol.LiveEntry`): the rules each caller
(agent, watcher, replay) used to spell on its own."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from costexporter.core.jobfacts import START_SKEW_GUARD_MS, job_start_ms, merge_meta, preflight_result
from costexporter.core.model import Event, GpuId, GpuIndex
from costexporter.store import protocol

times = st.integers(1_600_000_000_000, 1_900_000_000_000)


@given(st.lists(times, min_size=1, max_size=8), st.none() | times, st.none() | times, st.none() | times)
def test_a_jobs_start(regs, first, own, stored):
    start = job_start_ms(regs, first_event_ms=first, own_start_ms=own, stored_start_ms=stored)
    expect = min([*regs, *([first] if first is not None else [])])
    if own is not None:
        expect = max(expect, own - START_SKEW_GUARD_MS)  # an ancient registration is not trusted
    if stored is not None:
        expect = min(expect, stored)  # a stored fold's start never moves later
    assert start == expect
    assert job_start_ms(regs) == min(regs)  # replay: the earliest registration


def test_a_start_needs_something_to_date_it_by():
    with pytest.raises(ValueError, match="registration or an event"):
        job_start_ms([])
    assert job_start_ms([], first_event_ms=5) == 5


def _ev(kind: str, **fields) -> Event:
    return Event(kind, "j", 100_000, 0, "s", 1, fields)


def test_meta_merges_newest_first_and_keeps_the_readers_notes_out():
    meta: dict = {}
    merge_meta(meta, _ev("meta", team="a", stall_k=3.0, _unknown_fields=["x"]))
    merge_meta(meta, _ev("meta", team="b"))
    assert meta == {"team": "b", "stall_k": 3.0}
    assert preflight_result(_ev("preflight", passed=True, checks={"nccl": "ok"})) == {
        "passed": True,
        "checks": {"nccl": "ok"},
        "ts": 100.0,
    }


def test_a_registration_finds_its_gpu_by_uuid_first_then_host_and_index():
    gpus = [GpuId("h0", 0, "GPU-a"), GpuId("h0", 1, "GPU-b"), GpuId("h1", 0)]
    idx = GpuIndex(gpus)
    assert idx.find("GPU-b", "h9", 7) == 1  # the UUID wins over a wrong host and index
    assert idx.find("GPU-zz", "h0", 0) == 0  # an unknown UUID: by host and index
    assert idx.find(None, "h1", 0) == 2
    assert idx.find(None, None, 0) is None and idx.find(None, "h1", None) is None
    idx.add(3, GpuId("h2", 4, "GPU-c"))
    assert idx.find("GPU-c", None, None) == 3 and idx.find(None, "h2", 4) == 3


finite = st.floats(allow_nan=False, allow_infinity=False, width=32)


@given(
    st.integers(0, 2**50),
    finite,
    finite,
    st.none() | st.sampled_from(["compute", "deadlock"]),
    st.none() | st.integers(0, 64),
    st.none() | st.text(max_size=20),
)
def test_a_live_entry_reads_back_as_written(ts_ms, power, util, band, gpu, uuid):
    e = protocol.LiveEntry(ts_ms, power, util, band, gpu, uuid)
    back = protocol.decode_live(protocol.encode_live(e))
    assert abs(back.ts_ms - ts_ms) <= 1  # seconds on the wire
    assert (back.power_w, back.util_pct, back.band, back.gpu, back.uuid) == (power, util, band, gpu, uuid)


@pytest.mark.parametrize(
    "raw",
    [
        "not json",
        "[1, 2]",
        "7",
        '"x"',
        json.dumps({"ts": "soon", "power_w": 1, "util_pct": 2}),
        json.dumps({"ts": 1, "util_pct": 2}),
        json.dumps({"ts": 1e400, "power_w": 1, "util_pct": 2}),
    ],
)
def test_an_unusable_live_entry_is_one_clear_error(raw):
    with pytest.raises(protocol.LiveEntryError):
        protocol.decode_live(raw)


def test_odd_optional_fields_of_a_live_entry_read_as_absent():
    odd = {"ts": 1, "power_w": 1, "util_pct": 2, "band": 3, "gpu": True, "uuid": 7}
    e = protocol.decode_live(json.dumps(odd))
    assert (e.ts_ms, e.power_w, e.util_pct) == (1000, 1.0, 2.0)
    assert (e.band, e.gpu, e.uuid) == (None, None, None)
