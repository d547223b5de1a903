"""One rounding rule for time at every edge (docs/protocol.md, "Time in milliseconds"): a time
given in seconds becomes integer milliseconds once, the nearest one, whichever path it comes
by. An event and a sample at the same instant land on the same millisecond; an event read from
the stream and the same event read back from `events export`'s file have the same `ts_ms`."""

from __future__ import annotations

import json
import math
import time
import uuid
from pathlib import Path

import numpy as np
import redis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from costexporter.core.diagnostics import Diagnostics
from costexporter.core.events import MIN_TS, parse_event
from costexporter.core.timeutil import to_ms, to_ms_array
from costexporter.core.tracefiles import read_events_jsonl, read_samples_jsonl
from costexporter.store import protocol
from costexporter.store.reader import EventReader
from costexporter.tools.eventfile import entry_of, export_lines
from costexporter.trainer.transport import send_entries

from .conftest import SHARED_URL

# Plausible Unix times (what the parsers accept), as floats of any precision.
INSTANTS = st.floats(min_value=MIN_TS, max_value=time.time(), allow_nan=False, allow_infinity=False)
# How a time reaches us as text: the reporter's six decimals, three, Python's shortest repr, nine.
SPELLINGS = st.sampled_from(["{:.6f}", "{:.3f}", "{!r}", "{:.9f}"])
# Instants where truncating and rounding part ways (1076499726.853 is ...726.85299... as a float).
NEAR = [1_076_499_726.853, 1_754_006_410.0005, 1_754_006_410.9995, 1_000_000_000.001]


@given(t=INSTANTS)
@example(t=NEAR[0])
@example(t=NEAR[1])
def test_to_ms_is_the_nearest_millisecond_scalar_and_array_alike(t):
    ms = to_ms(t)
    assert isinstance(ms, int)
    assert abs(ms - t * 1000) <= 0.5 + 1e-6  # within the float's own error of the nearest
    assert int(to_ms_array(np.asarray([t]))[0]) == ms


@given(ms=st.integers(min_value=int(MIN_TS * 1000), max_value=int(time.time() * 1000)))
def test_a_millisecond_written_as_seconds_reads_back_as_itself(ms):
    """ms -> seconds (float, or text with three or six decimals) -> ms is the identity: the
    round trips the product makes (exported files, the live hash) lose nothing."""
    assert to_ms(ms / 1000) == ms
    assert to_ms(float(f"{ms / 1000:.3f}")) == ms
    assert to_ms(float(f"{ms / 1000:.6f}")) == ms


def _sample_line(ts: object) -> str:
    return json.dumps({"ts": ts, "host": "h", "gpu": 0, "power_w": 500.0, "util_pct": 90.0}) + "\n"


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(t=INSTANTS, spelling=SPELLINGS)
@example(t=NEAR[0], spelling="{!r}")
@example(t=NEAR[2], spelling="{:.6f}")
def test_an_event_and_a_sample_at_one_instant_land_on_one_millisecond(tmp_path: Path, t, spelling):
    text = spelling.format(t)
    want = to_ms(float(text))
    # An event: a stream entry (all text) and a JSON file's line (a number).
    stream = parse_event(
        {
            "v": "1",
            "type": "step",
            "job": "j",
            "ts": text,
            "rank": "0",
            "session": "s",
            "seq": "0",
            "step": "1",
        },
        strict_ids=True,
    )
    from_file = parse_event(
        json.loads(json.dumps({"type": "step", "job": "j", "ts": float(text), "rank": 0, "step": 1}))
    )
    # A registration in the ranks hash (text and number).
    reg_text = protocol.parse_registration("0", json.dumps({"ts": text, "host": "h", "gpu": 0}))
    reg_num = protocol.parse_registration("0", json.dumps({"ts": float(text), "host": "h", "gpu": 0}))
    # A sample: a samples JSONL trace (number and text), and a live source's reading (the agent
    # takes a Reading's float seconds with the same rule).
    path = tmp_path / "s.jsonl"
    path.write_text(_sample_line(float(text)) + _sample_line(text))
    chunk = read_samples_jsonl(path, "h", Diagnostics())
    live = protocol.decode_live(json.dumps({"ts": float(text), "power_w": 1.0, "util_pct": 1.0}))
    got = {
        "stream event": stream.ts_ms,
        "file event": from_file.ts_ms,
        "registration (text)": reg_text.ts_ms,
        "registration (number)": reg_num.ts_ms,
        "trace sample (number)": int(chunk.ts_ms[0]),
        "trace sample (text)": int(chunk.ts_ms[1]),
        "live hash sample": live.ts_ms,
    }
    assert len(chunk.ts_ms) == 2
    assert got == dict.fromkeys(got, want), text


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stamps=st.lists(INSTANTS, min_size=1, max_size=8), spelling=SPELLINGS)
@example(stamps=NEAR, spelling="{!r}")
def test_events_from_the_stream_and_from_their_exported_file_have_the_same_ms(
    tmp_path: Path, stamps, spelling
):
    """Real Redis: entries posted as a trainer posts them, read by the agents' reader, exported
    by `events export`'s lines and read back by `replay --events`' parser."""
    client = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    prefix = f"test-ms-{uuid.uuid4().hex[:12]}"
    try:
        entries = [
            protocol.encode_fields(
                {
                    "v": "1",
                    "type": "step",
                    "job": "j",
                    "ts": spelling.format(t),
                    "rank": 0,
                    "session": "s",
                    "seq": i,
                    "step": i,
                }
            )
            for i, t in enumerate(stamps)
        ]
        send_entries(client, prefix, "j", entries)
        live = EventReader(client, "j", prefix=prefix).read_all()
        lines, _stats = export_lines(client, "j", prefix)
        path = tmp_path / "events.jsonl"
        path.write_text("".join(lines))
        back = read_events_jsonl(path, Diagnostics())
        assert [e.ts_ms for e in live] == [to_ms(float(spelling.format(t))) for t in stamps]
        assert [(e.seq, e.ts_ms) for e in back] == [(e.seq, e.ts_ms) for e in live]
        # and the exported entry of each event parses to the same millisecond on its own
        assert all(parse_event(entry_of(e)).ts_ms == e.ts_ms for e in live)
    finally:
        for k in client.scan_iter(match=f"{prefix}:*"):
            client.delete(k)
        client.close()


def test_truncating_would_have_lost_a_millisecond():
    """The rule matters: 1076499726.853 s is stored as ...726.85299... and truncation reads 852."""
    t = 1_076_499_726.853
    assert math.floor(t * 1000) == 1_076_499_726_852  # what int(ts * 1000) gave
    assert (
        to_ms(t)
        == parse_event({"type": "step", "job": "j", "ts": "1076499726.853", "rank": 0, "step": 1}).ts_ms
    )
    assert to_ms(t) == 1_076_499_726_853
