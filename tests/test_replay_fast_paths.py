"""The replay command's fast paths (bench/bench_replay.py) give what the plain ways give.

Each fast path is checked against a slow, obvious reference on random input: nvidia-smi
timestamps read as fixed-width digits against Arrow's own parse, per-GPU cuts that only look at
the slices a cut falls in against cutting every slice, and the GPU time no job held (sliced only
where a sample lies outside the memberships) against slicing the whole trace, and the incident
stretches found from runs of pieces against the rule applied piece by piece in time order, and the
report's totals summed run by run against one bincount of every piece.
"""

from __future__ import annotations

import datetime as dt
import itertools

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from hypothesis import example, given, settings
from hypothesis import strategies as st

from costexporter.core import tracefiles as files
from costexporter.core.booking import NEG_INF, POS_INF, Slices, _cut_per_gpu, make_slices
from costexporter.core.cost import MJ_PER_KWH, MS_PER_HOUR
from costexporter.core.model import Band, GpuId, Samples
from costexporter.core.replay import ReplayConfig, _stretches, _totals_by_key, _unassigned
from costexporter.core.tracesource import MemoryTrace


def arrow_ms(values: pa.ChunkedArray, tz: str = "UTC") -> np.ndarray | None:
    """Arrow's parse of the whole column (None when it refuses one value)."""
    try:
        t = pc.cast(pc.replace_substring(values, "/", "-"), pa.timestamp("ms"))
    except pa.ArrowInvalid:
        return None
    if tz != "UTC":
        t = pc.assume_timezone(t, timezone=tz, ambiguous="earliest", nonexistent="earliest")
    return pc.cast(t, pa.int64()).to_numpy(zero_copy_only=False)


stamp = st.builds(
    lambda t, fmt, ms: t.strftime(fmt) + (f".{t.microsecond // 1000:03d}" if ms else ""),
    st.datetimes(min_value=dt.datetime(1970, 1, 2), max_value=dt.datetime(2200, 1, 1)),
    st.sampled_from(["%Y/%m/%d %H:%M:%S", "%Y-%m-%d %H:%M:%S", "%Y/%m/%dT%H:%M:%S"]),
    st.booleans(),
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(stamp, min_size=1, max_size=40),
    st.lists(
        st.tuples(st.integers(0, 39), st.integers(0, 22), st.sampled_from("0123456789/-: T.xZ")), max_size=2
    ),
    st.integers(1, 5),
    st.sampled_from(["UTC", "Europe/Berlin"]),
)
def test_fixed_width_timestamps_are_arrows_or_left_to_it(values, edits, chunks, tz):
    """Every column the fixed-width reader takes is read as Arrow reads it; every other (a bad
    character anywhere, Feb 30, hour 24) is left to the careful path."""
    values = list(values)
    for row, pos, ch in edits:  # corrupt a character, maybe into an impossible date or time
        if row < len(values) and pos < len(values[row]):
            values[row] = values[row][:pos] + ch + values[row][pos + 1 :]
    step = max(1, len(values) // chunks)
    col = pa.chunked_array([pa.array(values[i : i + step]) for i in range(0, len(values), step)])
    ref = arrow_ms(col, tz)
    fixed = files._fixed_timestamps(col)
    # The fixed-width reader never takes a column Arrow refuses.
    assert fixed is None or arrow_ms(col) is not None
    if fixed is not None:
        assert arrow_ms(col) is not None and fixed.tolist() == arrow_ms(col).tolist()
    if ref is not None:
        ms, bad, _how = files.timestamp_ms(col, tz)
        assert ms.tolist() == ref.tolist() and not bad.any()


def cut_reference(s: Slices, cut_gpu: np.ndarray, cut_ms: np.ndarray) -> list[tuple]:
    """Each slice cut at every cut of its GPU strictly inside it, in slice order."""
    out = []
    for g, a, b, band, e in zip(s.gpu, s.start_ms, s.end_ms, s.band, s.energy_mj, strict=True):
        inner = sorted({int(t) for gg, t in zip(cut_gpu, cut_ms, strict=True) if gg == g and a < t < b})
        edges = [int(a), *inner, int(b)]
        for x, y in itertools.pairwise(edges):
            out.append((int(g), x, y, int(band), float(e) * (y - x) / (b - a) if inner else float(e)))
    return out


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 4),
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2_000), st.integers(1, 300)), max_size=40),
    st.lists(st.tuples(st.integers(0, 3), st.integers(-100, 2_400)), max_size=30),
    st.booleans(),
)
def test_cut_per_gpu_equals_cutting_every_slice(n_gpus, slices, cuts, with_spans):
    rows = [(g % n_gpus, a, a + d) for g, a, d in slices]
    gpu = np.asarray([r[0] for r in rows], np.int32)
    start = np.asarray([r[1] for r in rows], np.int64)
    end = np.asarray([r[2] for r in rows], np.int64)
    band = (np.arange(gpu.size) % 6).astype(np.int8)
    energy = np.arange(gpu.size, dtype=float) * 7.5 + 1
    spans = (None, None)
    if with_spans:
        lo = np.full(n_gpus, POS_INF, np.int64)
        hi = np.full(n_gpus, NEG_INF, np.int64)
        np.minimum.at(lo, gpu, start)
        np.maximum.at(hi, gpu, end)
        spans = (lo, hi)
    s = Slices(gpu, start, end, band, energy, *spans)
    cut_gpu = np.asarray([c[0] % n_gpus for c in cuts], np.int64)
    cut_ms = np.asarray([c[1] for c in cuts], np.int64)
    got = _cut_per_gpu(s, cut_gpu, cut_ms)
    ref = cut_reference(s, cut_gpu, cut_ms)
    assert [
        tuple(int(x) for x in t[:4]) for t in zip(got.gpu, got.start_ms, got.end_ms, got.band, strict=True)
    ] == [r[:4] for r in ref]
    assert np.allclose(got.energy_mj, [r[4] for r in ref], rtol=1e-12, atol=0)


def test_cut_per_gpu_equals_cutting_every_slice_when_hundreds_are_cut():
    """Past a few hundred cut slices the pieces are laid out another way: the same result."""
    rng = np.random.default_rng(7)
    n = 900
    gpu = rng.integers(0, 3, n).astype(np.int32)
    start = rng.integers(0, 20_000, n).astype(np.int64)
    end = start + rng.integers(1, 400, n)
    s = Slices(gpu, start, end, (np.arange(n) % 6).astype(np.int8), rng.random(n) * 1e3)
    cut_gpu, cut_ms = rng.integers(0, 3, 500), rng.integers(0, 20_400, 500)
    got = _cut_per_gpu(s, cut_gpu, cut_ms)
    ref = cut_reference(s, cut_gpu, cut_ms)
    assert len(ref) - n > 256  # (664 of the 900 slices are cut)
    assert list(zip(got.gpu.tolist(), got.start_ms.tolist(), got.end_ms.tolist(), strict=True)) == [
        r[:3] for r in ref
    ]
    assert np.allclose(got.energy_mj, [r[4] for r in ref], rtol=1e-12, atol=0)


def unassigned_reference(samples: Samples, n_gpus: int, interval: int, members: list, gap: float) -> dict:
    """Slice the whole trace; each slice's time outside every membership of its GPU is free."""
    s = make_slices(
        samples.gpu,
        samples.ts_ms,
        samples.power_w,
        samples.energy_mj,
        np.full(len(samples), Band.UNKNOWN, np.int8),
        n_gpus,
        interval,
        np.full(n_gpus, POS_INF, np.int64),
        np.full(n_gpus, POS_INF, np.int64),
        gap,
    )
    free_ms = free_mj = 0.0
    for g, a, b, e in zip(s.gpu, s.start_ms, s.end_ms, s.energy_mj, strict=True):
        held = sum(max(0, min(b, y) - max(a, x)) for gg, x, y in members if gg == g)
        free = max(0, (b - a) - held)
        free_ms += free
        free_mj += e * free / (b - a) if b > a else 0.0
    return {"gpu_hours": free_ms / MS_PER_HOUR, "energy_kwh": free_mj / MJ_PER_KWH}


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 3),
    st.lists(st.tuples(st.integers(0, 2), st.sampled_from([1, 1, 1, 3, 9]), st.booleans()), max_size=60),
    st.lists(st.tuples(st.integers(0, 3), st.integers(-3, 70), st.integers(-2, 40)), max_size=6),
    st.booleans(),
)
def test_unassigned_time_equals_slicing_the_whole_trace(n_gpus, steps, memberships, counter):
    interval = 1000
    t = {g: 1_700_000_000_000 + 500 * g for g in range(n_gpus)}
    gpu, ts, power, energy = [], [], [], []
    for g, dt_steps, bump in steps:
        g %= n_gpus
        t[g] += dt_steps * interval + (137 if bump else 0)
        gpu.append(g)
        ts.append(t[g])
        power.append(100.0 + 10 * g)
        energy.append(float(t[g]) * 0.3 if counter else np.nan)
    samples = Samples(
        [GpuId("h", g) for g in range(n_gpus)],
        np.asarray(gpu, np.int32),
        np.asarray(ts, np.int64),
        np.asarray(power),
        np.full(len(ts), 50.0),
        np.asarray(energy),
    ).sort()
    if not len(samples):
        return
    base = int(samples.ts_ms.min())
    members = [(g, base + a * interval, base + (a + d) * interval) for g, a, d in memberships]
    cfg = ReplayConfig()
    trace = MemoryTrace(samples)
    trace.extend(n_gpus)
    trace.interval_ms = interval
    got = _unassigned(trace, members, cfg)
    ref = unassigned_reference(samples, n_gpus, interval, members, cfg.booking.gap_intervals)
    assert ref and set(got) == set(ref), (got, ref)
    for k in ref:
        assert abs(got[k] - ref[k]) <= 1e-9 * max(1.0, abs(ref[k])), (k, got, ref)


def stretches_reference(start: list[int], end: list[int], tol: int) -> list[int]:
    """The incident rule as written: pieces in time order, a piece that starts more than `tol`
    after the stretch's reach so far opens the next stretch."""
    order = sorted(range(len(start)), key=lambda i: start[i])
    out = [0] * len(start)
    sid, reach = -1, None
    for i in order:
        if reach is None or start[i] > reach + tol:
            sid, reach = sid + 1, end[i]
        reach = max(reach, end[i])
        out[i] = sid
    return out


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 60), st.integers(0, 8)), min_size=1, max_size=80),
    st.integers(0, 5),
    st.sampled_from(["as drawn", "by gpu and time", "reversed"]),
)
# A piece inside its predecessor on one GPU: the run's reach is the predecessor's end.
@example([(0, 0, 8), (0, 1, 0), (1, 5, 0)], 0, "as drawn")
def test_incident_stretches_are_the_rule_applied_in_time_order(pieces, tol, order):
    """Joining the pieces that follow one another on a GPU before sorting changes no stretch,
    whatever order the pieces come in (cut pieces are appended after their GPU's run)."""
    if order == "by gpu and time":
        pieces = sorted(pieces)
    elif order == "reversed":
        pieces = sorted(pieces, reverse=True)
    gpu = np.asarray([g for g, _, _ in pieces], np.int32)
    start = np.asarray([s for _, s, _ in pieces], np.int64)
    end = start + np.asarray([d for _, _, d in pieces], np.int64)
    got, n = _stretches(gpu, start, end, tol)
    ref = stretches_reference(start.tolist(), end.tolist(), tol)
    assert got.tolist() == ref
    assert n == max(ref) + 1


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 6), st.integers(1, 40)), min_size=1, max_size=30),
    st.integers(0, 2**31),
)
def test_totals_by_key_summed_in_runs_are_a_bincount(runs, seed):
    """Per-key totals summed run by run (where keys come in long runs) are what one bincount
    of every piece gives: durations exactly, energies to rounding."""
    key = np.repeat([k for k, _ in runs], [n for _, n in runs]).astype(np.int32)
    rng = np.random.default_rng(seed)
    dur = rng.integers(0, 10**6, key.size)
    mj = rng.random(key.size) * 1e6
    ms_got, mj_got = _totals_by_key(key, 8, dur, mj)
    assert ms_got.tolist() == np.bincount(key, weights=dur, minlength=8).tolist()
    np.testing.assert_allclose(mj_got, np.bincount(key, weights=mj, minlength=8), rtol=1e-12)
