"""Calibrate refuses what no sound profile can come from, and never writes a profile that
misclassifies its own labels."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from costexporter.core import bands
from costexporter.tools.calibrate import BAND_LEVEL, LABEL_NAMES, CalibrationError, fit
from tests.realtrace import Scenario
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
    pred = np.asarray([BAND_LEVEL[b] for b in res.band.tolist()])
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


_TR = Scenario.h100(seed=8, checkpoints=1, compute_s=30.0, checkpoint_s=6.0, idle_s=8.0).build()
_SPANS = spans(_TR)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(
            st.integers(0, len(_SPANS) - 1),
            st.floats(0.0, 0.9),
            st.floats(0.1, 1.0),
            st.sampled_from(sorted(LABEL_NAMES)),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_calibrate_never_returns_a_profile_that_fails_its_own_labels(windows):
    """Labelled windows, right or wrong, over stretches of a real-like trace: the fit is refused,
    or the profile it returns bands each label's samples as labelled (>= 0.9 of the held-out
    ones, checked again here on all of them with a margin for the few held-out ones)."""
    labels = []
    for k, a_share, len_share, band in windows:
        _, a, b = _SPANS[k]
        start = int(a + a_share * (b - a))
        end = min(b, int(start + max(len_share * (b - a), 2000)))
        if end > start:
            labels.append((start, end, LABEL_NAMES[band]))
    if not labels:
        return
    try:
        f = fit(_TR.samples, labels=labels)
    except CalibrationError:
        return
    assert label_agreement(_TR, f.profile, labels) >= 0.8
