"""`booking.percentile` is `np.percentile` (linear) to the last bit: the stall threshold, and so
every booking, must not move by one ulp when numpy's call is replaced by plain Python."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from costexporter.core.booking import BookingConfig, percentile, stall_threshold_ms

Q = st.one_of(st.sampled_from([0.0, 50.0, 90.0, 95.0, 99.0, 100.0]), st.floats(0, 100))


@settings(max_examples=500, deadline=None)
@given(st.lists(st.integers(0, 10**9), min_size=1, max_size=300), Q)
def test_percentile_is_numpys_to_the_bit(values, q):
    want = float(np.percentile(np.fromiter(values, float), q))
    got = percentile(values, q)
    assert got == want or (got != got and want != want)
    assert np.float64(got).tobytes() == np.float64(want).tobytes()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 10**7), max_size=120), st.floats(1.0, 10.0), Q)
def test_stall_threshold_as_with_numpy(durations, k, q):
    cfg = BookingConfig(stall_k=k, stall_percentile=q)
    floor = int(cfg.stall_floor_s * 1000)
    want = floor
    if durations:
        want = max(int(k * float(np.percentile(np.asarray(durations, float), q))), floor)
    assert stall_threshold_ms(durations, cfg) == want


def test_edges():
    assert percentile([7], 95.0) == 7.0
    assert percentile([1, 2], 50.0) == 1.5
    assert percentile([3, 1, 2], 100.0) == 3.0 and percentile([3, 1, 2], 0.0) == 1.0
