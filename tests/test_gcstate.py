"""`gcstate.FrozenState`: the watch process's long-lived state kept out of full collections,
cycles that die among it still reclaimed at each refresh, and a peak's freed memory returned."""

from __future__ import annotations

import gc
import platform
import weakref

import pytest

from costexporter.services.gcstate import FrozenState, rss_bytes


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> weakref.ref:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


@pytest.fixture(autouse=True)
def _unfrozen():
    yield
    gc.unfreeze()


def test_the_first_round_freezes_what_is_alive_and_full_collections_skip_it():
    state = [_Node() for _ in range(1000)]
    upkeep = FrozenState(refresh_rounds=3)
    upkeep.after_round()
    assert gc.get_freeze_count() >= len(state)
    dead = _cycle()  # born after the freeze: a plain collection reclaims it
    gc.collect()
    assert dead() is None


def test_a_cycle_that_dies_among_the_frozen_state_is_reclaimed_at_the_next_refresh():
    upkeep = FrozenState(refresh_rounds=3)
    held = _cycle()
    keep = held()  # alive at the freeze
    upkeep.after_round()
    del keep
    gc.collect()
    assert held() is not None  # frozen: the collector does not look at it
    upkeep.after_round()  # round 2: no refresh yet
    assert held() is not None
    upkeep.after_round()  # round 3: unfrozen, collected, frozen again
    assert held() is None


def test_refresh_rounds_must_be_positive():
    with pytest.raises(ValueError, match="refresh_rounds"):
        FrozenState(refresh_rounds=0)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc" or rss_bytes() is None, reason="glibc on Linux")
def test_a_peak_freed_since_the_last_round_is_handed_back_once():
    upkeep = FrozenState(trim_growth_bytes=16 << 20)
    upkeep.after_round()  # the first round returns what start-up left
    before, base = upkeep.trims, upkeep.rss_after_trim
    assert base is not None
    # A peak: at least 96 MB and half the process's RSS (a test worker that imported much has a
    # large one, and only growth by a quarter is returned) in heap-sized blocks (below glibc's
    # mmap threshold), all freed but the last, which pins the heap's top so that free() alone
    # cannot shrink it.
    peak = [bytearray(100_000) for _ in range(max(960, base // 2 // 100_000))]
    for b in peak:
        b[::4096] = b"\x01" * len(b[::4096])  # touch every page: resident
    last = peak[-1]
    del peak
    held = rss_bytes()
    upkeep.after_round()
    assert upkeep.trims == before + 1
    assert held - rss_bytes() > 48 << 20, "the freed peak stayed resident"
    upkeep.after_round()  # no growth since: no second trim
    assert upkeep.trims == before + 1
    assert last  # held to the end


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc" or rss_bytes() is None, reason="glibc on Linux")
def test_a_rounds_transient_below_a_quarter_of_the_rss_is_left_to_the_allocator():
    upkeep = FrozenState(trim_growth_bytes=1)
    upkeep.after_round()
    before, base = upkeep.trims, upkeep.rss_after_trim
    assert base is not None
    # An eighth of the RSS more (what a round's arrays take and give back each round): trimming
    # it would only make the next round fault the same pages in again.
    held = [bytearray(100_000) for _ in range(base // 8 // 100_000)]
    for b in held:
        b[::4096] = b"\x01" * len(b[::4096])
    upkeep.after_round()
    assert upkeep.trims == before
    assert held
