"""A simulated job's clock: placed in the past (the demo's story ends when it starts) and, past
the story's end, at the wall clock's pace (`demo --forever` must not race days ahead, where
readers refuse its timestamps)."""

from __future__ import annotations

import time

from costexporter.sources.sim import SimSource

from .conftest import SHARED_URL


def test_a_story_placed_in_the_past_ends_now_and_then_runs_at_real_time(prefix):
    speed = 40_000.0  # the 40-minute story in 0.06 s
    before = time.time()
    src = SimSource("mini", speed=speed, redis_url=SHARED_URL, prefix=prefix, host="t", ends_at=before)
    try:
        story_s = src.builder.t - src.builder.t0
        first = src.sim_time()
        assert before - story_s - 1 <= first <= before  # the story starts in the past
        time.sleep(0.5)  # well past the story's end (0.06 s of wall time)
        a = src.sim_time()
        assert a <= time.time()  # never ahead of the wall clock
        assert src.clock_speed == 1.0
        time.sleep(0.3)
        b = src.sim_time()
        assert 0.2 <= b - a <= 1.0  # real time's pace, not 40,000x (which would be hours)
    finally:
        src.close()


def test_a_story_that_starts_now_plays_at_its_speed(prefix):
    src = SimSource("mini", speed=100.0, redis_url=SHARED_URL, prefix=prefix, host="t")
    try:
        assert abs(src.sim_time() - time.time()) < 5
        assert src.clock_speed == 100.0
        a = src.sim_time()
        time.sleep(0.2)
        assert src.sim_time() - a >= 10  # 100x
    finally:
        src.close()
