"""The bounded JSON decoder every reader of trainer-writable values goes through: what the product
writes reads back as written; anything else is refused with a reason, never another exception."""

from __future__ import annotations

import json
import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from costexporter.store import untrusted

REGISTRATION = st.fixed_dictionaries(
    {"ts": st.floats(1e9, 4e9), "host": st.text(max_size=40), "gpu": st.integers(0, 1023)},
    optional={
        "gpu_uuid": st.text(max_size=60),
        "world_size": st.integers(1, 65_536),
        "pid": st.integers(1, 2**22),
    },
)


@given(REGISTRATION)
def test_what_a_reporter_writes_reads_back(reg):
    assert untrusted.loads(json.dumps(reg)) == reg
    assert untrusted.loads(json.dumps(reg).encode()) == reg


@given(st.one_of(st.text(max_size=300), st.binary(max_size=300)))
def test_any_text_is_a_value_or_a_refusal_with_a_reason(raw):
    try:
        untrusted.loads(raw)
    except untrusted.UntrustedValue as e:
        assert e.reason in {"bad_json", "too_deep", "too_large"}


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ("[" * 200_000 + "]" * 200_000, "too_large"),
        ("[" * 5_000 + "]" * 5_000, "too_deep"),
        ('{"a":' * 40 + "1" + "}" * 40, "too_deep"),
        (json.dumps({"ts": 1, "pad": "x" * 70_000}), "too_large"),
        ("NaN", "bad_json"),
        ("{", "bad_json"),
        (None, "bad_json"),
    ],
)
def test_deep_huge_and_broken_values_are_refused_before_they_are_built(raw, reason):
    with pytest.raises(untrusted.UntrustedValue) as e:
        untrusted.loads(raw)
    assert e.value.reason == reason


def test_brackets_inside_strings_are_not_depth():
    assert untrusted.loads(json.dumps({"name": "[" * 1000})) == {"name": "[" * 1000}


def test_refusals_count_every_one_and_log_a_job_and_reason_once_an_hour(caplog):
    r = untrusted.Refusals(logging.getLogger("t.refusals"))
    name = "j" * 1_000_000
    with caplog.at_level(logging.WARNING, "t.refusals"):
        for _ in range(50):
            r.refuse(name, "wrong_type", "its ranks key is not a hash")
        r.refuse("other", "wrong_type", "its ranks key is not a hash")
    assert r.counts[(name, "wrong_type")] == 50 and r.counts[("other", "wrong_type")] == 1
    assert len(caplog.records) == 2
    assert max(len(rec.getMessage()) for rec in caplog.records) < 400  # the name cut short
