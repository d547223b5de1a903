"""The OpenAPI's `pattern` for `window=` and the parser agree: a string the pattern matches is
refused only for what a pattern cannot say (with a 400 naming it), one it does not match is
refused, and every documented form matches."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from costexporter.api.windows import PATTERN, WindowError, parse_window

NOW = 1_780_000_000.0
# What a pattern cannot say; every other refusal is about the syntax the pattern describes.
SEMANTIC = (
    "between 1 minute and 400 days",
    "the end must come after the start",
    "longer than 400 days",
    "must lie between 1970-01-01 and 3000-01-01",
    "is not a time this API can use",
    "is not a date in the calendar",
)


def _refusal(text: str) -> str | None:
    try:
        parse_window(text, now=NOW)
    except WindowError as e:
        return str(e)
    return None


@given(st.from_regex(PATTERN, fullmatch=True))
def test_a_string_the_pattern_matches_is_refused_only_for_its_values(text):
    why = _refusal(text)
    assert why is None or any(s in why for s in SEMANTIC), (text, why)


@given(st.text(max_size=60))
def test_a_string_the_pattern_does_not_match_is_refused(text):
    assert re.fullmatch(PATTERN, text) is not None or _refusal(text) is not None, text


@pytest.mark.parametrize(
    "text",
    [
        "30m",
        "24h",
        "7d",
        "2w",
        "400d",
        "30D",
        " today ",
        "Yesterday",
        "week",
        "lastweek",
        "month",
        "lastmonth",
        "2025-11-01T00:00:00Z,2025-12-01T00:00:00Z",
        "2025-11-01T00:00:00.5+08:00, 2025-11-02T00:00Z",
        "2025-11-01t00:00:00z,2025-11-01 06:00:00-02:00",
        "1761955200,1764547200",
        "1761955200.5,1764547200",
    ],
)
def test_every_documented_form_matches_and_is_accepted(text):
    assert re.fullmatch(PATTERN, text), text
    assert _refusal(text) is None


def test_the_openapi_documents_the_pattern(shared, prefix):
    from costexporter.api.app import create_app
    from costexporter.store.ledger_read import LedgerStore

    spec = create_app(LedgerStore(shared, prefix), None).openapi()
    params = [
        p
        for path in spec["paths"].values()
        for op in path.values()
        for p in op.get("parameters", [])
        if p["name"] == "window"
    ]
    assert params and all(p["schema"].get("pattern") == PATTERN for p in params), params
