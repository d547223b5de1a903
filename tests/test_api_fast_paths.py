"""The finance API's fast paths give the bytes of the paths they replace (random data)."""

from __future__ import annotations

from decimal import Decimal

from hypothesis import example, given, settings
from hypothesis import strategies as st

from costexporter.api.format import per, per_micro

MICRO = st.one_of(st.integers(-(10**16), 10**16), st.integers(-50, 50), st.integers(-(10**7), 10**7))
COUNT = st.one_of(st.integers(-2, 50), st.integers(1, 10**10), st.sampled_from([2, 4, 8, 10**9 - 1, 10**9]))


@settings(max_examples=2000, deadline=None)
@given(MICRO, COUNT)
@example(1, 2)  # ties: half-even
@example(3, 2)
@example(-1, 2)
@example(-1, 3)  # rounds to zero: Decimal says "-0.000000"
@example(0, 7)
@example(10**15 - 1, 2)
@example(-(10**15) + 1, 2)
def test_cost_per_step_by_integers_is_decimals(u, n):
    assert per_micro(u, n) == per(Decimal(u).scaleb(-6), n)


@settings(max_examples=500, deadline=None)
@given(st.integers(-(10**8), 10**8), st.integers(1, 10**6).map(lambda n: 2 * n))
def test_exact_ties_round_half_even_as_decimal(k, n):
    u = k * n + n // 2  # exactly halfway between two micro-units
    assert per_micro(u, n) == per(Decimal(u).scaleb(-6), n)
