"""Bands (DESIGN section 3) and profiles: R2's table, derived profiles, profile files."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from costexporter.core import profiles
from costexporter.core.bands import classify
from costexporter.core.model import Band
from costexporter.core.profiles import ProfileError


def run(power: np.ndarray, util: np.ndarray, profile, **kw) -> np.ndarray:
    """Classify a ranks x moments matrix sampled every second; return bands as the same matrix."""
    n_ranks, n_t = power.shape
    rank = np.repeat(np.arange(n_ranks), n_t)
    ts = np.tile(np.arange(n_t) * 1000, n_ranks).astype(np.int64) + 1_753_570_000_000
    res = classify(rank, ts, power.ravel(), util.ravel(), n_ranks, profile, **kw)
    return res.band.reshape(n_ranks, n_t), res


def uniform(n_ranks: int, n_t: int, p: float, u: float) -> tuple[np.ndarray, np.ndarray]:
    return np.full((n_ranks, n_t), p), np.full((n_ranks, n_t), u)


@pytest.mark.parametrize(
    ("power", "util", "band"),
    [
        (990.0, 100.0, Band.COMPUTE),  # R2: 940-1040 W, 100% uniform
        (640.0, 100.0, Band.COMMUNICATION),  # R2: ~640 W, 100% uniform
        (135.0, 0.0, Band.IDLE),  # R2: ~135 W, 0% everywhere
    ],
)
def test_b300_table_uniform_states(power, util, band):
    bands, _ = run(*uniform(16, 10, power, util), profiles.B300)
    assert (bands == band).all()


def test_b300_deadlock_signature_one_rank_at_zero():
    p, u = uniform(16, 10, 192.0, 100.0)
    u[3] = 0.0  # R2: ONE rank 0%, all others 100%, 190-195 W
    bands, res = run(p, u, profiles.B300)
    assert (bands == Band.DEADLOCK).all()
    assert res.signature_moments == 10


def test_checkpoint_when_the_zero_rank_is_rank_0_until_the_allowance():
    p, u = uniform(8, 120, 192.0, 100.0)
    u[0] = 0.0
    bands, _ = run(p, u, profiles.B300, checkpoint_allowance_ms=60_000)
    assert (bands[:, :60] == Band.CHECKPOINT).all()
    assert (bands[:, 60:] == Band.DEADLOCK).all()


def test_starvation_is_job_level_and_names_the_straggler():
    p, u = uniform(8, 30, 575.0, 100.0)
    u[5] = 58.0  # R2: 55-100%, uneven across ranks
    u[2] = 80.0
    bands, res = run(p, u, profiles.B300)
    assert (bands == Band.STARVATION).all()  # every rank at that moment, not only the slow ones
    assert res.straggler_rank == 5


def test_deadlock_needs_two_consecutive_moments():
    p, u = uniform(4, 5, 990.0, 100.0)
    p[:, 2] = 192.0
    u[1, 2] = 0.0
    bands, res = run(p, u, profiles.B300)
    assert not (bands == Band.DEADLOCK).any()
    assert res.signature_moments == 0


def test_samples_within_half_a_grid_step_are_one_moment():
    """Ranks on different hosts sample at different offsets; the grid lines them up."""
    n_ranks, n_t = 4, 20
    rank = np.repeat(np.arange(n_ranks), n_t)
    ts = (np.tile(np.arange(n_t) * 1000, n_ranks) + rank * 130 + 1_753_570_000_000).astype(np.int64)
    power = np.full(rank.size, 192.0)
    util = np.where(rank == 2, 0.0, 100.0)
    res = classify(rank, ts, power, util, n_ranks, profiles.B300)
    assert (res.band == Band.DEADLOCK).all()


def test_coarse_sampling_widens_the_grid():
    """DCGM's default 30 s collection: two consecutive samples are 60 s apart, not 2 s."""
    n_ranks, n_t = 4, 6
    rank = np.repeat(np.arange(n_ranks), n_t)
    ts = (np.tile(np.arange(n_t) * 30_000, n_ranks) + 1_753_570_000_000).astype(np.int64)
    util = np.where(rank == 1, 0.0, 100.0)
    res = classify(rank, ts, np.full(rank.size, 192.0), util, n_ranks, profiles.B300)
    assert res.grid_ms == 30_000
    assert (res.band == Band.DEADLOCK).all()


def test_derived_profile_holds_for_a_small_model_below_the_power_limit():
    h100 = profiles.select("NVIDIA H100 80GB HBM3")
    assert not h100.calibrated and h100.power_limit_w == 700
    rng = np.random.default_rng(0)
    # A small model: 75-80% of the limit, utilization 85-97% rather than 100%.
    p = rng.uniform(0.75 * 700, 0.80 * 700, (8, 60))
    u = rng.uniform(85, 97, (8, 60))
    bands, _ = run(p, u, h100)
    assert (bands == Band.COMPUTE).all()


def test_derived_profile_sees_checkpoint_waiters_spinning_just_above_idle():
    h100 = profiles.select("NVIDIA H100 80GB HBM3")
    rng = np.random.default_rng(1)
    # Rank 0 writes the checkpoint at ~idle power and 0%; the others spin at 100% a little above idle.
    p = rng.uniform(95, 125, (8, 120))
    u = np.full((8, 120), 100.0)
    p[0], u[0] = 75.0, 0.0
    bands, _ = run(p, u, h100, checkpoint_allowance_ms=60_000)
    assert (bands[:, :60] == Band.CHECKPOINT).all()
    assert (bands[:, 60:] == Band.DEADLOCK).all()


def test_profile_selection():
    assert profiles.select("NVIDIA B300") is profiles.B300
    with pytest.raises(ProfileError, match="--gpu-model or --power-limit"):
        profiles.select(None, None)  # never another GPU's profile in silence
    derived = profiles.select("Some Future GPU", 900)
    assert derived.power_limit_w == 900 and not derived.calibrated
    with pytest.raises(ProfileError, match="unknown GPU model"):
        profiles.select("Some Future GPU")


def test_profile_files(tmp_path):
    y = tmp_path / "mine.yaml"
    y.write_text("idle_max_w: 90\nlow_max_w: 200\ncompute_min_w: 500\nbusy_util_pct: 80\n")
    prof = profiles.load(y)
    assert prof.name == "mine" and prof.calibrated and prof.compute_min_w == 500
    j = tmp_path / "p.json"
    j.write_text(json.dumps({"name": "x", "idle_max_w": 1, "low_max_w": 2, "compute_min_w": 3}))
    assert profiles.load(j).name == "x"
    bad = tmp_path / "bad.yaml"
    bad.write_text("idle_max_w: 500\nlow_max_w: 200\ncompute_min_w: 100\n")
    with pytest.raises(ProfileError, match="need 0 <= idle_max_w"):
        profiles.load(bad)
    unknown = tmp_path / "u.yaml"
    unknown.write_text("idle_max_w: 1\nlow_max_w: 2\ncompute_min_w: 3\nwat: 1\n")
    with pytest.raises(ProfileError, match="unknown profile keys"):
        profiles.load(unknown)


@pytest.mark.parametrize(("above", "signature"), [(-5.0, True), (5.0, False)])
def test_the_cross_rank_signature_holds_up_to_the_onset_edge(above, signature):
    """A checkpoint wait's onset (writer at 0%, waiters at 100%) reads above the low edge; the
    signature holds up to `onset_edge_w`, a quarter of the way to the compute edge, and no higher."""
    from costexporter.core.bands import ONSET_SHARE, onset_edge_w

    h100 = profiles.select("NVIDIA H100 80GB HBM3")
    edge = onset_edge_w(h100)
    assert edge == pytest.approx(h100.low_max_w + ONSET_SHARE * (h100.compute_min_w - h100.low_max_w))
    assert h100.low_max_w < 218.0 < 230.0 < edge  # an H100's onset readings are inside it
    p, u = uniform(8, 10, edge + above, 100.0)
    p[0] -= 12.0  # the writer reads a little below the waiters
    u[0] = 0.0
    bands, _ = run(p, u, h100)
    assert (bands == Band.CHECKPOINT).all() == signature
    assert (bands == Band.CHECKPOINT).any() == signature


def _titan_x_with_idle_learned():
    """A TITAN X's profile as replay derives it with idle learned at ~91 W: its mid band is
    154-162 W, so ramps from a checkpoint wait (118 W) into compute (215 W) read in the low band."""
    from dataclasses import replace

    return replace(profiles.select("NVIDIA TITAN X (Pascal)"), idle_max_w=105.0, low_max_w=154.4)


def run_100ms(power: np.ndarray, util: np.ndarray, profile, written: np.ndarray | None = None):
    """Classify a ranks x moments matrix sampled every 100 ms (`written`: which readings exist)."""
    n_ranks = power.shape[0]
    written = np.ones(power.shape, bool) if written is None else written
    rank, t = np.nonzero(written)
    ts = (t * 100 + 1_753_570_000_000).astype(np.int64)
    res = classify(rank, ts, power[rank, t], util[rank, t], n_ranks, profile)
    out = np.full(power.shape, -1, np.int8)
    out[rank, t] = res.band
    return out


def wait_then_compute(n_wait: int, n_compute: int) -> tuple[np.ndarray, np.ndarray]:
    """8 ranks in a checkpoint wait (rank 0 writing at 100 W / 2%, the others at 118 W / 100%),
    then compute at 215 W / 90%."""
    p = np.concatenate([np.full((8, n_wait), 118.0), np.full((8, n_compute), 215.0)], axis=1)
    u = np.concatenate([np.full((8, n_wait), 100.0), np.full((8, n_compute), 90.0)], axis=1)
    p[0, :n_wait], u[0, :n_wait] = 100.0, 2.0
    return p, u


def test_a_climb_into_compute_from_below_the_mid_band_bands_compute():
    prof = _titan_x_with_idle_learned()
    p, u = wait_then_compute(30, 20)
    p[:, 30:33], u[:, 30:33] = [127.0, 136.0, 145.0], 90.0  # the ramp, at compute's utilization
    p[3, 30:33] = [127.0, 125.0, 145.0]  # its noise dips a little on the way
    p[2, 29] = 121.0  # a waiter's noise rises too, by less than a climb: still the wait
    bands = run_100ms(p, u, prof)
    assert (bands[:, :30] == Band.CHECKPOINT).all()
    assert (bands[:, 30:] == Band.COMPUTE).all()


def test_a_lone_line_after_a_logger_hiccup_does_not_end_a_wait():
    """After a 0.3 s hiccup, GPU 0's line stamped early sits alone in its moment; the wait's
    0.9 s after it is the same wait, not a run too short to confirm."""
    prof = _titan_x_with_idle_learned()
    p, u = wait_then_compute(43, 20)
    written = np.ones(p.shape, bool)
    written[:, 30:34] = False
    written[0, 33] = True
    bands = run_100ms(p, u, prof, written)
    assert (bands[:, :43][written[:, :43]] == Band.CHECKPOINT).all()
    assert (bands[:, 43:] == Band.COMPUTE).all()


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 5).flatmap(
        lambda n_ranks: st.tuples(
            st.permutations(range(n_ranks)),
            st.lists(
                st.lists(
                    st.tuples(
                        st.sampled_from([135.0, 170.0, 250.0, 330.0, 640.0, 990.0, float("nan")]),
                        st.sampled_from([0.0, 3.0, 50.0, 100.0, float("nan")]),
                    ),
                    min_size=n_ranks,
                    max_size=n_ranks,
                ),
                min_size=2,
                max_size=40,
            ),
        )
    ),
    st.booleans(),
)
def test_a_dense_trace_in_any_rank_order_bands_as_scattered_samples_do(drawn, with_steps):
    """Every rank sampled once at every moment (GPUs in any rank order): the samples are taken
    as the moments x ranks matrix, rows copied, and band exactly as the general path's scatter
    of each sample to its cell does; so do the signatures, the straggler and the carry."""
    from unittest import mock

    from costexporter.core import bands

    order, moments_ = drawn
    n_ranks, n_t = len(order), len(moments_)
    reading = np.asarray(moments_)  # moments x ranks x (power, util)
    rank = np.repeat(np.asarray(order), n_t)  # GPU blocks, each a rank's, in GPU order
    ts = np.tile(np.arange(n_t) * 1000, n_ranks).astype(np.int64) + 1_753_570_000_000
    power = reading[:, :, 0].T[order].ravel()
    util = reading[:, :, 1].T[order].ravel()
    steps = ts[:n_t:3] + 400 if with_steps else None
    kw = dict(step_ms=steps, carry_at_ms=int(ts[n_t // 2]))
    assert bands._dense_blocks(rank, np.tile(np.arange(n_t), n_ranks), n_ranks, n_t) is not None
    got = classify(rank, ts, power, util, n_ranks, profiles.B300, **kw)
    with mock.patch.object(bands, "_dense_blocks", lambda *a: None):
        want = classify(rank, ts, power, util, n_ranks, profiles.B300, **kw)
    assert got.band.tolist() == want.band.tolist()
    assert (got.signature_moments, got.signatures, got.straggler_rank, got.carry) == (
        want.signature_moments,
        want.signatures,
        want.straggler_rank,
        want.carry,
    )


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 4).flatmap(
        lambda n_ranks: st.integers(1, 30).flatmap(
            lambda n_cols: st.tuples(
                st.lists(
                    st.lists(st.booleans(), min_size=n_cols, max_size=n_cols),
                    min_size=n_ranks,
                    max_size=n_ranks,
                ),
                st.lists(st.integers(1, 3), min_size=n_cols, max_size=n_cols),
            )
        )
    ),
    st.sampled_from([0, 100, 250, 1000]),
    st.integers(0, 2**31),
)
def test_a_rank_without_a_sample_holds_its_last_one_for_the_hold_time(drawn, hold, seed):
    """The moments a rank has no sample at take its last sample of at most `hold` ms before
    (power, utilization, climbing), the others read NaN: what walking each rank's moments in
    order gives."""
    from costexporter.core.bands import _hold_last

    present_rows, steps = drawn
    present = np.asarray(present_rows, bool)
    cols = np.cumsum(steps) - steps[0]  # moments with gaps between them
    rng = np.random.default_rng(seed)
    P = np.where(present, rng.random(present.shape) * 1000, -1.0).astype(np.float32)
    U = np.where(present, rng.random(present.shape) * 100, np.nan).astype(np.float32)
    C = present & (rng.random(present.shape) < 0.5)
    want_p, want_u, want_c, want_obs = P.copy(), U.copy(), C.copy(), present.copy()
    for r in range(present.shape[0]):
        last = None
        for c in range(present.shape[1]):
            if present[r, c]:
                last = c
            elif last is not None and (cols[c] - cols[last]) * 100 <= hold:
                want_p[r, c], want_u[r, c], want_c[r, c], want_obs[r, c] = (
                    P[r, last],
                    U[r, last],
                    C[r, last],
                    True,
                )
            else:
                want_p[r, c] = np.nan
    obs = _hold_last(P, U, C, present, cols, 100, hold)
    assert obs.tolist() == want_obs.tolist() and C.tolist() == want_c.tolist()
    np.testing.assert_array_equal(P, want_p)
    np.testing.assert_array_equal(U, want_u)
