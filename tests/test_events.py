"""Event validation (`parse_event`): a stream entry's plain-text values take a fast path; it must
accept and refuse exactly what the general path (any value type, as JSONL lines have) does."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from costexporter.core.events import (
    EVENT_TYPES,
    FUTURE_SLACK_S,
    META_NUMBERS,
    META_TEXT,
    EventError,
    _checked_base,
    _text_base,
    parse_event,
    parse_heartbeat,
)


class _Text(str):
    """A str that is not exactly `str`: parse_event reads it through the general path."""


def _outcome(entry: dict) -> tuple:
    try:
        ev = parse_event(entry, job="j", now=2e9, strict_ids=True)
    except EventError as e:
        return ("error", type(e).__name__, e.reason, str(e))
    return ("ok", ev.type, ev.job, ev.ts, ev.rank, ev.session, ev.seq, sorted(ev.fields.items(), key=repr))


NUMBERISH = st.one_of(
    st.sampled_from(["", " ", "0", "1", " 7 ", "-1", "1.5", "1e3", "nan", "inf", "1_000", "0x10", "abc"]),
    st.integers(min_value=-(10**16), max_value=10**16).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(max_size=6),
)
FIELDS = [
    "type", "job", "ts", "rank", "session", "seq", "step", "tokens", "name", "state", "host",
    "gpu", "gpu_uuid", "local_rank", "world_size", "pid", "passed", "extra", *META_TEXT, *META_NUMBERS,
]  # fmt: skip


@st.composite
def entries(draw) -> dict:
    e = {
        "v": draw(st.sampled_from(["1", "1", "2", ""])),
        "type": draw(st.sampled_from([*sorted(EVENT_TYPES), "bogus", ""])),
        "job": draw(st.sampled_from(["j", "j", "other", ""])),
        "ts": draw(st.one_of(st.just("1764000000.5"), NUMBERISH)),
        "rank": draw(st.one_of(st.just("0"), NUMBERISH)),
        "session": draw(st.sampled_from(["s", "", " "])),
        "seq": draw(st.one_of(st.just("3"), NUMBERISH)),
    }
    for key in draw(st.lists(st.sampled_from(FIELDS), max_size=6)):
        e[key] = draw(st.one_of(NUMBERISH, st.sampled_from(["begin", "end", "start", "resume", "true"])))
    return e


@settings(max_examples=600, deadline=None)
@given(entry=entries())
def test_plain_text_values_are_judged_as_the_general_path_judges_them(entry):
    slow = {k: _Text(v) for k, v in entry.items()}
    assert _outcome(entry) == _outcome(slow)


@settings(max_examples=600, deadline=None)
@given(entry=entries(), job=st.sampled_from(["j", None]), strict=st.booleans())
def test_the_base_fields_fast_path_gives_what_the_field_by_field_checks_give(entry, job, strict):
    """`_text_base` answers only entries the checks accept, with the same values; it passes on
    every other one (the checks then word the error)."""
    limit = 2e9 + FUTURE_SLACK_S
    fast = _text_base(entry, job, limit)
    try:
        checked = _checked_base(entry, job, limit, strict)
    except EventError:
        assert fast is None
        return
    assert fast is None or fast == checked


@settings(max_examples=600, deadline=None)
@given(entry=entries(), plain=st.booleans())
def test_the_heartbeat_fast_path_gives_what_parse_event_gives(entry, plain):
    """`parse_heartbeat` (the heartbeat stream's reader) accepts and refuses exactly what
    `parse_event` does, with the same event or the same error, whatever the entry holds."""
    if plain:  # the common entry: the seven base fields only, most of them valid
        entry = {k: entry[k] for k in ("v", "type", "job", "ts", "rank", "session", "seq")}

    def outcome(parse) -> tuple:
        try:
            ev = parse(entry)
        except EventError as e:
            return ("error", type(e).__name__, e.reason, str(e))
        return ("ok", ev)

    want = outcome(lambda e: parse_event(e, job="j", now=2e9, strict_ids=True))
    assert outcome(lambda e: parse_heartbeat(e, job="j", now=2e9)) == want


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("rank", " 3 ", None),
        ("rank", "3.0", "bad_type"),
        ("rank", "", "missing_field"),
        ("seq", "-1", "out_of_range"),
        ("ts", "nan", "bad_type"),
        ("ts", "1", "bad_timestamp"),
        ("session", "", "missing_field"),
    ],
)
def test_stream_values(field, value, reason):
    entry = {
        "v": "1",
        "type": "heartbeat",
        "job": "j",
        "ts": "1764000000",
        "rank": "0",
        "session": "s",
        "seq": "1",
    }
    entry[field] = value
    got = _outcome(entry)
    # accepted with the value parsed, or refused with the reason
    assert (got[0], got[4]) == ("ok", 3) if reason is None else got[:3] == ("error", "EventError", reason)
