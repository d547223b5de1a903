"""The agent's incremental context window equals the full sort it replaced, round after round."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from costexporter.core.samplewin import SampleWindow, keep_from


class FullSort:
    """The construction the agent used before samplewin.py: concatenate own samples and every
    other host's chunk, lexsort by (rank, ts), keep the window (with each rank's last sample
    before it), hold the non-own part."""

    def __init__(self) -> None:
        self.remote: list = []

    def round(self, own, new_chunks, lo, own_ranks):
        self.remote += new_chunks
        chunks = [own, *self.remote]
        R, T, P, U, E = (np.concatenate(c) for c in zip(*chunks, strict=True))
        P = np.where(np.isfinite(P), P, np.nan)
        E = np.where(np.isfinite(E), E, np.nan)
        order = np.lexsort((T, R))
        R, T, P, U, E = (a[order] for a in (R, T, P, U, E))
        w = keep_from(R, T, lo)  # from `lo`, and each rank's last sample before it
        R, T, P, U, E = (a[w] for a in (R, T, P, U, E))
        remote = ~np.isin(R, list(own_ranks))
        self.remote = [tuple(a[remote] for a in (R, T, P, U, E))]
        return R, T, P, U, E


def _cols(rows):
    r = np.asarray([x[0] for x in rows], np.int64)
    t = np.asarray([x[1] for x in rows], np.int64)
    # Values carry the sample's identity (its draw order), so a tie broken differently shows.
    p = np.asarray([x[2] for x in rows], np.float64)
    u = np.arange(len(rows), dtype=np.float64) + 1000 * np.random.default_rng(len(rows)).random()
    e = np.asarray([x[3] for x in rows], np.float64)
    return r, t, p, u, e


value = st.sampled_from([1.0, 2.5, float("nan"), float("inf"), -float("inf"), 300.0])
row = st.tuples(st.integers(0, 7), st.integers(0, 60), value, value)


def _assert_same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)  # NaN equals NaN here


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rounds=st.lists(
        st.tuples(
            st.lists(row, max_size=12),  # this host's samples (all it holds, as the agent passes them)
            st.lists(st.lists(row, max_size=10), max_size=3),  # other hosts' entries read
            st.integers(-5, 40),  # the window's start
            st.sets(st.integers(0, 7), max_size=3),  # this host's ranks
        ),
        max_size=8,
    ),
    base=st.sampled_from([0, 1_750_000_000_000]),
)
def test_window_equals_full_sort(rounds, base) -> None:
    old, new = FullSort(), SampleWindow()
    for own_rows, entries, lo, own_ranks in rounds:
        own = _cols([(r, t + base, p, e) for r, t, p, e in own_rows if r in own_ranks])
        chunks = [_cols([(r, t + base, p, e) for r, t, p, e in ent]) for ent in entries]
        for c in chunks:
            new.add(c)
        _assert_same(old.round(own, chunks, lo + base, own_ranks), new.round(own, lo + base, own_ranks))


def test_out_of_range_timestamps_fall_back_to_the_full_sort() -> None:
    """A negative timestamp cannot be keyed: the window is then sorted whole, with the same result."""
    old, new = FullSort(), SampleWindow()
    for k, ts in enumerate(([5, -3, 2], [1, 9], [-10, 4])):
        c = _cols([(k % 3, t, 1.0, 2.0) for t in ts])
        new.add(c)
        _assert_same(old.round(_cols([]), [c], -20, set()), new.round(_cols([]), -20, set()))
    assert not new.sorted_mode


def test_a_round_sorts_only_what_is_new() -> None:
    """Held samples are not re-sorted: a window of 100k samples takes one new entry by merging."""
    w = SampleWindow()
    n = 100_000
    w.add((np.repeat(np.arange(100), n // 100), np.tile(np.arange(n // 100), 100), *(np.ones(n),) * 3))
    w.round(_cols([]), 0, set())
    w.add((np.arange(100), np.full(100, n // 100), *(np.zeros(100),) * 3))
    R, T, *_ = w.round(_cols([]), 1, set())
    # Every sample: those before 1 ms are each rank's last before the window (kept, `keep_from`).
    assert R.size == n + 100 and (np.diff(R * 10**6 + T) > 0).all()
    assert w.keys.size == n + 100


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mine=st.sets(st.integers(0, 9), min_size=1, max_size=5),  # this host's ranks, anywhere
    rounds=st.lists(
        st.tuples(
            st.lists(row10 := st.tuples(st.integers(0, 9), st.integers(0, 60), value, value), max_size=12),
            st.lists(st.lists(row10, max_size=10), max_size=3),
            st.integers(-5, 40),
            st.integers(0, 3),  # how many of this host's ranks it holds this round
        ),
        max_size=10,
    ),
)
def test_the_usual_round_equals_the_full_sort(mine, rounds) -> None:
    """Peers' ranks apart from this host's (the usual case), this host's anywhere among them."""
    old, new = FullSort(), SampleWindow()
    ordered = sorted(mine)
    for own_rows, entries, lo, k in rounds:
        own_ranks = set(ordered[: max(1, len(ordered) - k)])  # ranks move within this host's only
        own = _cols([x for x in own_rows if x[0] in own_ranks])
        chunks = [_cols([x for x in ent if x[0] not in mine]) for ent in entries]
        for c in chunks:
            new.add(c)
        _assert_same(old.round(own, chunks, lo, own_ranks), new.round(own, lo, own_ranks))


def test_a_stream_entry_decodes_to_what_was_encoded_and_the_older_layout_still_reads() -> None:
    from costexporter.core.samplewin import decode_entry, encode_entry

    cols = (
        np.array([3, 3, 7], np.int64),
        np.array([1_750_000_000_000, 1_750_000_001_000, 1_750_000_000_500], np.int64),
        np.array([950.25, np.nan, 123.5]),
        np.array([100.0, 0.0, np.nan]),
        np.array([np.nan, 1e12 + 0.5, 3.0]),
    )
    got = decode_entry(encode_entry(cols))
    assert len(got) == len(cols)
    for a, b in zip(got, cols, strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)
    old = {c: json.dumps(a.tolist()).replace("NaN", "null") for c, a in zip("rtpue", cols, strict=True)}
    for a, b in zip(decode_entry(old), cols, strict=True):
        assert np.array_equal(a, b, equal_nan=True)
    for bad in ({"b": "not base64!"}, {"b": encode_entry(cols)["b"][:-8]}, {"r": "[1]"}):
        with pytest.raises((ValueError, KeyError)):
            decode_entry(bad)
