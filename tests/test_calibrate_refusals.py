"""Calibrate refuses what no sound profile can come from, and never writes a profile that
misclassifies its own labels."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from costexporter.core import bands, bandtable
from costexporter.tools.calibrate import (
    HOLD_OUT_BLOCK_MS,
    HOLD_OUT_EVERY,
    LABEL_NAMES,
    MIN_LABEL_AGREEMENT,
    MIN_LABELLED,
    CalibrationError,
    fit,
)
from tests.realtrace import Scenario, write_csv
from tests.test_trace_profiles import TITAN_X_LEVELS


def spans(tr):
    """(state, first ms, end ms) of each stretch of the trace, from its labels (GPU 0's samples)."""
    s = tr.samples
    g0 = s.gpu == 0
    t, lab = s.ts_ms[g0], tr.labels[g0]
    cut = np.flatnonzero(lab[1:] != lab[:-1]) + 1
    starts = np.concatenate([[0], cut])
    ends = np.concatenate([cut, [t.size]])
    return [(str(lab[a]), int(t[a]), int(t[b - 1]) + 100) for a, b in zip(starts, ends, strict=True)]


def label_agreement(tr, prof, labels) -> float:
    """Independently of calibrate: the share of each label's samples the profile bands as it."""
    s = tr.samples
    res = bands.classify(s.gpu, s.ts_ms, s.power_w, s.util_pct, len(s.gpus), prof)
    pred = np.asarray(bandtable.current().level_of_code, object)[res.band]
    worst = 1.0
    for a, b, level in labels:
        inside = (s.ts_ms >= a) & (s.ts_ms < b)
        worst = min(worst, float(np.mean(pred[inside] == level)))
    return worst


def test_a_label_spanning_two_power_levels_is_refused():
    tr = Scenario.h100(seed=3, checkpoints=1, compute_s=40.0, checkpoint_s=10.0).build()
    st_ = spans(tr)
    (_, c0, c1), (_, k0, k1) = (
        next(x for x in st_ if x[0] == "compute"),
        next(x for x in st_ if x[0] == "checkpoint"),
    )
    with pytest.raises(CalibrationError, match=r"spans two power levels \(~5\d\d W and ~1[3-6]\d W\)"):
        fit(tr.samples, labels=[(c0, k1, "compute")])  # compute and the checkpoint's waiters as one
    prof = fit(tr.samples, labels=[(c0 + 1000, c1 - 1000, "compute"), (k0 + 1500, k1 - 500, "low")]).profile
    assert prof.compute_min_w > 300 and prof.low_max_w < 300


def test_labelled_idle_of_an_old_board_is_not_clipped_by_a_derived_edge():
    # A TITAN X idles at 87-95 W with a CUDA context, above 30% of its 250 W limit.
    tr = Scenario(seed=5, levels=TITAN_X_LEVELS, gpu_name="NVIDIA TITAN X (Pascal)", checkpoints=1).build()
    st_ = spans(tr)
    idle = [(a + 500, b - 500, "idle") for name, a, b in st_ if name == "idle"]
    compute = [(a + 1000, b - 1000, "compute") for name, a, b in st_ if name == "compute"]
    f = fit(tr.samples, labels=idle + compute)
    assert f.profile.idle_max_w > 95
    assert label_agreement(tr, f.profile, idle + compute) >= 0.95


def test_a_profile_that_misclassifies_its_own_labels_is_refused():
    tr = Scenario.h100(seed=4, checkpoints=1).build()
    st_ = spans(tr)
    (_, c0, c1) = next(x for x in st_ if x[0] == "compute")
    (_, i0, i1) = next(x for x in st_ if x[0] == "idle")
    # Idle readings labelled as compute: compute would sit at idle power; and compute labelled idle.
    with pytest.raises(CalibrationError):
        fit(tr.samples, labels=[(c0, c1, "idle"), (i0, i1, "compute")])


def held_out_agreement(tr, prof, labels) -> float:
    """The fit's own held-out rule, computed here independently: with the profile, each label
    name's samples and each labelled window's (the held-out ones, or all of them when fewer than
    MIN_LABELLED are held out) band as labelled; the worst share."""
    s = tr.samples
    res = bands.classify(s.gpu, s.ts_ms, s.power_w, s.util_pct, len(s.gpus), prof)
    pred = np.asarray(bandtable.current().level_of_code, object)[res.band]
    held = (s.ts_ms // HOLD_OUT_BLOCK_MS) % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1
    lab = np.full(s.ts_ms.size, "", object)
    for a, b, level in labels:  # a later window relabels what it covers, as the fit reads them
        lab[(s.ts_ms >= a) & (s.ts_ms < b)] = level
    groups = [(name, lab == name) for name in {str(x) for x in lab if x}]
    groups += [(name, (s.ts_ms >= a) & (s.ts_ms < b)) for a, b, name in labels]
    worst = 1.0
    for name, mine in groups:
        mine = mine & np.isfinite(s.power_w)
        if (mine & held).sum() >= MIN_LABELLED:
            mine &= held
        if mine.any():
            worst = min(worst, float(np.mean(pred[mine] == name)))
    return worst


_TRACES = [
    Scenario.h100(seed=8, checkpoints=1, compute_s=30.0, checkpoint_s=6.0, idle_s=8.0).build(),
    Scenario(
        seed=9,
        levels=TITAN_X_LEVELS,
        gpu_name="NVIDIA TITAN X (Pascal)",
        checkpoints=1,
        compute_s=30.0,
        checkpoint_s=6.0,
        idle_s=8.0,
    ).build(),
]
_SPANS = [spans(tr) for tr in _TRACES]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(0, len(_TRACES) - 1),
    st.lists(
        st.tuples(
            st.integers(0, min(len(x) for x in _SPANS) - 1),
            st.floats(0.0, 0.9),
            st.floats(0.1, 1.0),
            # None: the stretch's own band (3 in 4 windows), else any, right or wrong.
            st.one_of(st.none(), st.none(), st.none(), st.sampled_from(sorted(LABEL_NAMES))),
        ),
        min_size=1,
        max_size=4,
    ),
)
def test_calibrate_never_returns_a_profile_that_fails_its_own_labels(which, windows):
    """Labelled windows, right or wrong, over stretches of real-like traces of two GPU models:
    the fit is refused, or the profile it returns passes its own held-out check
    (MIN_LABEL_AGREEMENT of each label's held-out samples banded as labelled), checked again here
    independently of the fit."""
    tr, sp = _TRACES[which], _SPANS[which]
    labels = []
    for k, a_share, len_share, band in windows:
        state, a, b = sp[k]
        start = int(a + a_share * (b - a))
        end = min(b, int(start + max(len_share * (b - a), 2000)))
        if end > start:
            labels.append((start, end, LABEL_NAMES[band or state]))
    if not labels:
        return
    try:
        f = fit(tr.samples, labels=labels)
    except CalibrationError:
        event("refused")
        return
    event("fitted")
    assert held_out_agreement(tr, f.profile, labels) >= MIN_LABEL_AGREEMENT


def _label_args(labels) -> list[str]:
    out = []
    for a, b, level in labels:
        out += ["--label", f"{a / 1000:.3f}..{b / 1000:.3f}={level}"]
    return out


def test_the_cli_refuses_a_label_spanning_two_power_levels_in_one_line(cli, tmp_path):
    tr = Scenario.h100(seed=3, checkpoints=1, compute_s=40.0, checkpoint_s=10.0).build()
    st_ = spans(tr)
    (_, c0, _), (_, _, k1) = (
        next(x for x in st_ if x[0] == "compute"),
        next(x for x in st_ if x[0] == "checkpoint"),
    )
    csv_path = write_csv(tr, tmp_path / "h100.csv")
    out = tmp_path / "p.json"
    r = cli(
        "calibrate", "--samples", csv_path, "--gpu-model", "NVIDIA H100", "--out", out,
        *_label_args([(c0, k1, "compute")]),
    )  # fmt: skip
    assert r.returncode == 2, r.stdout + r.stderr
    [line] = r.stderr.strip().splitlines()
    assert "spans two power levels" in line and "split it where the power changes" in line
    assert "Traceback" not in r.stderr and not out.exists()


def test_the_cli_refuses_an_idle_edge_that_clips_labelled_idle_in_one_line(cli, tmp_path):
    # A board "computing" at ~100 W, barely above its 91 W idle: no idle edge both keeps the
    # labelled idle (up to ~96 W) and stays below compute.
    lv = dict(TITAN_X_LEVELS)
    lv["compute"] = ((100.0, 3.0, 85.0, 100.0), (100.0, 3.0, 85.0, 100.0))
    tr = Scenario(seed=5, levels=lv, gpu_name="NVIDIA TITAN X (Pascal)", checkpoints=1).build()
    st_ = spans(tr)
    labels = [(a + 500, b - 500, "idle") for n, a, b in st_ if n == "idle"]
    labels += [(a + 1000, b - 1000, "compute") for n, a, b in st_ if n == "compute"]
    csv_path = write_csv(tr, tmp_path / "titanx.csv")
    out = tmp_path / "p.json"
    r = cli(
        "calibrate", "--samples", csv_path, "--gpu-model", "NVIDIA TITAN X (Pascal)", "--out", out,
        *_label_args(labels),
    )  # fmt: skip
    assert r.returncode == 2, r.stdout + r.stderr
    [line] = r.stderr.strip().splitlines()
    assert "idle-labelled samples as idle" in line and "clips the labelled idle" in line
    assert "no profile written" in line and not out.exists()


def _eight_gpus(idle_w_of, seconds: int = 600, seed: int = 0):
    """8 H100s at 100 ms: compute (~560 W, 100%) for the first half, then idle (0%) at the
    power `idle_w_of(gpu, t_s)` gives, with noise."""
    from costexporter.core.model import GpuId, Samples

    rng = np.random.default_rng(seed)
    t = np.arange(seconds * 10) * 100 + 1_780_000_000_000
    gpus = [GpuId("node0", g, f"GPU-{g}", "NVIDIA H100 80GB HBM3", 700.0) for g in range(8)]
    cols = {"gpu": [], "ts": [], "p": [], "u": []}
    for g in range(8):
        s = (t - t[0]) / 1000
        busy = s < seconds / 2
        p = np.where(busy, 560.0, [idle_w_of(g, x) for x in s]) + rng.normal(0, 2, t.size)
        cols["gpu"].append(np.full(t.size, g, np.int32))
        cols["ts"].append(t)
        cols["p"].append(p)
        cols["u"].append(np.where(busy, 100.0, 0.0))
    smp = Samples(
        gpus,
        np.concatenate(cols["gpu"]),
        np.concatenate(cols["ts"]),
        np.concatenate(cols["p"]),
        np.concatenate(cols["u"]),
        np.full(8 * t.size, np.nan),
    )
    half = int(t[0] + seconds * 500)
    return smp, [(int(t[0]), half, "compute"), (half + 2000, int(t[-1]) + 100, "idle")]


@pytest.mark.parametrize(
    "shape",
    [
        "one GPU decays while the others stay",  # the real run's end: GPU 0 125 -> 70 W
        "each GPU idles at its own level",
    ],
)
def test_a_label_over_simultaneous_levels_is_fitted_not_refused(shape):
    def idle_w(g: int, s: float) -> float:
        if shape.startswith("one"):
            return 124.0 if g else max(70.0, 125.0 - (s - 300.0) * 0.5)
        return 70.0 if g % 2 else 124.0

    smp, labels = _eight_gpus(idle_w)
    f = fit(smp, labels=labels)
    assert any("holds two power levels" in w for w in f.warnings), f.warnings
    assert f.profile.idle_max_w >= 124 + 6 and f.profile.compute_min_w > 300
    assert label_agreement_samples(smp, f.profile, labels) >= MIN_LABEL_AGREEMENT


def test_an_idle_label_over_a_decay_is_fitted_but_busy_levels_one_after_the_other_are_refused():
    """Every GPU's idle power decaying 125 -> 70 W after the run (both levels at 0%): idle, as
    labelled. Compute at ~560 W and then waiters at ~150 W, 100% busy, labelled compute as one:
    a split in time separates them, refused."""
    smp, labels = _eight_gpus(lambda g, s: 124.0 if s < 450 else 70.0)
    f = fit(smp, labels=labels)
    assert any("holds two power levels" in w for w in f.warnings) and f.profile.idle_max_w >= 124
    smp, labels = _eight_gpus(lambda g, s: 80.0)
    busy = smp.util_pct > 0
    smp.power_w = np.where(busy & (smp.ts_ms >= smp.ts_ms.min() + 150_000), 150.0, smp.power_w)
    with pytest.raises(CalibrationError, match="spans two power levels"):
        fit(smp, labels=labels)


def test_a_fit_from_one_workload_says_so():
    smp, labels = _eight_gpus(lambda g, s: 80.0)
    assert any("fitted on one workload" in w for w in fit(smp, labels=labels).warnings)
    other, _ = _eight_gpus(lambda g, s: 80.0, seed=1)
    other.ts_ms = other.ts_ms + 86_400_000  # another run, the next day
    both = type(smp)(
        smp.gpus,
        np.concatenate([smp.gpu, other.gpu]),
        np.concatenate([smp.ts_ms, other.ts_ms]),
        np.concatenate([smp.power_w, other.power_w]),
        np.concatenate([smp.util_pct, other.util_pct]),
        np.concatenate([smp.energy_mj, other.energy_mj]),
    ).sort()
    assert not any("fitted on one workload" in w for w in fit(both, labels=labels).warnings)


def label_agreement_samples(s, prof, labels) -> float:
    res = bands.classify(s.gpu, s.ts_ms, s.power_w, s.util_pct, len(s.gpus), prof)
    pred = np.asarray(bandtable.current().level_of_code, object)[res.band]
    return min(float(np.mean(pred[(s.ts_ms >= a) & (s.ts_ms < b)] == lv)) for a, b, lv in labels)
