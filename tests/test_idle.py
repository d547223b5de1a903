"""Each GPU's idle level learned from its own 0% samples (costexporter/core/idle.py), the derived
profile's low edges moved to it (profiles.with_idle), and the level kept in Redis by GPU UUID.
The levels are R9's H200: idle 79.6 W without a CUDA context, 123.7 W with one; checkpoint and
spin at 124.1 W; compute 660-729 W at 100%."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from costexporter.core import bands, idle, profiles
from costexporter.core.model import Band
from costexporter.core.profiles import B300, derive, with_idle
from costexporter.store import keys

from .conftest import SHARED_URL

H200 = derive(700.0, "H200")


def test_no_level_before_enough_zero_percent_readings():
    lr = idle.IdleLearner()
    lr.add("g", np.full(idle.MIN_SAMPLES - 1, 123.7), np.zeros(idle.MIN_SAMPLES - 1))
    lr.add("g", np.full(500, 692.0), np.full(500, 100.0))  # busy readings never count
    assert lr.level("g", 700.0) is None
    lr.add("g", np.asarray([123.7]), np.asarray([0.0]))
    assert lr.level("g", 700.0) == pytest.approx(123.7)


def test_junk_does_not_move_the_median_and_nan_is_ignored():
    lr = idle.IdleLearner()
    n = 100
    # 30% of the 0% readings are a power tail after compute ended (the 1-s average still high),
    # some readings NaN, a few negative or with NaN utilization.
    p = np.concatenate([np.full(70, 123.7), np.linspace(650, 200, 30), [np.nan] * 5, [-3.0]])
    u = np.concatenate([np.zeros(n), np.zeros(5), [0.0]])
    lr.add("g", p, u)
    lr.add("g", np.asarray([5.0]), np.asarray([np.nan]))
    assert lr.level("g", 700.0) == pytest.approx(123.7)


def test_an_implausible_level_is_never_used():
    lr = idle.IdleLearner()
    lr.add("zero", np.zeros(100), np.zeros(100))  # a sensor reading 0 W
    lr.add("hot", np.full(100, 400.0), np.zeros(100))  # 57% of the limit at "0%": not idle
    assert lr.level("zero", 700.0) is None and lr.level("hot", 700.0) is None
    assert lr.level("zero") is None and lr.level("hot") == 400.0  # no limit: absolute bounds


def test_the_window_follows_a_cuda_context_appearing():
    lr = idle.IdleLearner()
    lr.add("g", np.full(idle.WINDOW, 79.6), np.zeros(idle.WINDOW))  # no context yet
    assert lr.level("g", 700.0) == pytest.approx(79.6)
    lr.add("g", np.full(idle.WINDOW // 2 + 1, 123.7), np.zeros(idle.WINDOW // 2 + 1))
    assert lr.level("g", 700.0) == pytest.approx(123.7)


@given(
    level=st.floats(60.0, 200.0),
    noise=st.lists(st.floats(-2.0, 2.0), min_size=60, max_size=idle.WINDOW // 2),
    junk=st.lists(st.one_of(st.floats(0.0, 700.0), st.just(float("nan"))), max_size=idle.WINDOW // 2),
    busy=st.lists(st.floats(0.0, 700.0), max_size=200),
    chunks=st.integers(1, 7),
)
def test_a_majority_at_idle_decides_whatever_the_junk_and_the_chunking(level, noise, junk, busy, chunks):
    """Readings at 0%: more at `level` (+-2 W) than junk (any power, NaN) among the newest WINDOW;
    busy readings at any power; fed in any number of chunks: the level is within 2 W."""
    junk = junk[: len(noise) - 1]
    p = np.asarray([level + x for x in noise] + junk + busy)
    u = np.asarray([0.0] * (len(noise) + len(junk)) + [100.0] * len(busy))
    order = np.random.default_rng(len(noise) + len(junk)).permutation(p.size)
    p, u = p[order], u[order]
    lr = idle.IdleLearner()
    for part in np.array_split(np.arange(p.size), chunks):
        lr.add("g", p[part], u[part])
    got = lr.level("g", 700.0)
    assert got is not None and abs(got - level) <= 2.0 + 1e-9


def test_a_stored_level_is_used_until_this_process_has_its_own():
    lr = idle.IdleLearner()
    lr.seed("g", 120.0, 500)
    lr.seed("few", 120.0, idle.MIN_SAMPLES - 1)  # stored from too few readings: ignored
    assert lr.level("g", 700.0) == 120.0 and lr.level("few", 700.0) is None
    lr.add("g", np.full(idle.MIN_SAMPLES, 123.7), np.zeros(idle.MIN_SAMPLES))
    assert lr.level("g", 700.0) == pytest.approx(123.7)


def test_derived_h200_edges_put_idle_with_a_context_in_idle():
    assert H200.idle_max_w == pytest.approx(112.0)  # the fixed fraction: below 123.7 W
    learned = with_idle(H200, 123.7)
    assert learned.idle_max_w == pytest.approx(142.3) and learned.low_max_w == pytest.approx(247.4)
    assert learned.compute_min_w == H200.compute_min_w and learned.provenance == {"learned_idle_w": 123.7}
    p = np.asarray([660.0, 729.0, 124.1, 124.1, 123.7, 123.7, 124.1])
    u = np.asarray([100.0, 100.0, 0.0, 5.0, 0.0, 30.0, 100.0])
    got = bands.reading_bands(p, u, learned)
    assert got.tolist() == [Band.COMPUTE] * 2 + [Band.IDLE] * 4 + [Band.UNKNOWN]  # the spin: not idle
    # The fixed fraction put idle with a context at 30% utilization above idle.
    assert bands.reading_bands(p, u, H200)[5] == Band.UNKNOWN


def test_calibrated_and_fitted_profiles_stay_as_they_are():
    assert with_idle(B300, 123.7) is B300
    assert with_idle(H200, None) is H200


@given(st.floats(700 * idle.MIN_FRACTION, 700 * idle.MAX_FRACTION))
def test_learned_edges_stay_ordered_and_above_the_idle_level(level):
    p = with_idle(H200, level)
    assert level < p.idle_max_w <= p.low_max_w < p.compute_min_w
    assert p.low_max_w >= 1.5 * level  # room for R2's deadlock (1.4x idle) below the low edge


def test_the_agent_keeps_each_gpus_idle_in_redis_by_uuid_and_a_new_agent_starts_from_it(
    shared, prefix, monkeypatch
):
    from costexporter.services.agent import Agent, AgentConfig
    from costexporter.sources.nvml import NvmlSource

    from .fake_nvml import FakeGpu, FakeNvml

    uuid = "GPU-fa4e0000-0000-0000-0000-000000000007"
    gpu = FakeGpu(uuid, name="NVIDIA H200", power_mw=123_700, util=0, limit_mw=700_000)
    fake = FakeNvml([gpu]).install(monkeypatch)
    cfg = AgentConfig(
        redis_url=SHARED_URL,
        prefix=prefix,
        agent_id="n",
        sample_interval_s=0.02,
        book_interval_s=0.2,
    )

    def run_for(agent: Agent, seconds: float) -> None:
        agent.start()
        loop = threading.Thread(target=agent.run, daemon=True)
        loop.start()
        time.sleep(seconds)
        agent.stop()
        loop.join(10)
        agent.shutdown()

    a = Agent(NvmlSource(host="n"), cfg)
    run_for(a, 1.5)
    stored = json.loads(shared.get(keys.gpu_idle_key(prefix, uuid)))
    assert stored["idle_w"] == pytest.approx(123.7) and stored["n"] >= idle.MIN_SAMPLES
    assert stored["host"] == "n" and stored["gpu"] == 0
    # The GPU computes now: a new agent sees no 0% reading, yet knows the idle level at once.
    fake.set(0, power_mw=692_000, util=100)
    b = Agent(NvmlSource(host="n"), cfg)
    b.tick()
    assert b.node.idle_level([0]) == pytest.approx(123.7)
    assert b.node.profile(0).idle_max_w == pytest.approx(142.3)
    # Learning can be turned off (a replayed trace's default: its bill must equal the offline replay's).
    assert Agent(NvmlSource(host="n"), AgentConfig(prefix=prefix, learn_idle=False)).idle is None


def test_junk_in_the_stored_level_is_counted_not_raised(shared, prefix, monkeypatch):
    from costexporter.services.agent import Agent, AgentConfig
    from costexporter.sources.nvml import NvmlSource

    from .fake_nvml import FakeGpu, FakeNvml

    uuid = "GPU-fa4e0000-0000-0000-0000-000000000008"
    FakeNvml([FakeGpu(uuid, name="NVIDIA H200", limit_mw=700_000)]).install(monkeypatch)
    shared.set(keys.gpu_idle_key(prefix, uuid), "not json")
    a = Agent(NvmlSource(host="n"), AgentConfig(prefix=prefix, agent_id="n"))
    a.tick()
    assert a.node.stats["bad_idle_entries"] == 1 and a.stats["round_errors"] == 0
    assert profiles.select("NVIDIA H200").idle_max_w == a.node.profile(0).idle_max_w
