"""A ranks entry whose `host` or `gpu_uuid` is not text is refused with a reason, not turned into
text that matches no GPU; a `ts` no sum can hold is refused at parse, not an OverflowError later."""

from __future__ import annotations

import json

import pytest

from costexporter.store import protocol

OK = {"host": "node0", "gpu": 1, "ts": 1_753_570_000.0}


def _parse(**fields):
    return protocol.parse_registration("0", json.dumps({**OK, **fields}))


@pytest.mark.parametrize("ts", [1e300, -1.0, 0, 1e20])
def test_absurd_dates_are_refused(ts):
    with pytest.raises(protocol.RegistrationError) as e:
        _parse(ts=ts)
    assert e.value.reason == "bad_ts"


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("host", ["node0"], "bad_host"),
        ("host", 7, "bad_host"),
        ("host", {"a": 1}, "bad_host"),
        ("gpu_uuid", 5, "bad_gpu_uuid"),
        ("gpu_uuid", ["GPU-1"], "bad_gpu_uuid"),
        ("gpu_uuid", True, "bad_gpu_uuid"),
    ],
)
def test_a_host_or_uuid_that_is_not_text_is_refused(field, value, reason):
    with pytest.raises(protocol.RegistrationError) as e:
        _parse(**{field: value})
    assert e.value.reason == reason
    assert len(str(e.value)) < 300


def test_text_fields_are_kept_as_they_are():
    reg = _parse(gpu_uuid="GPU-abc")
    assert (reg.host, reg.gpu_uuid, reg.gpu) == ("node0", "GPU-abc", 1)
    assert _parse(gpu_uuid="").gpu_uuid is None  # '' is absent, as for events
