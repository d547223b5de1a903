"""Replay in bounded memory: a trace booked in time windows (through the live agent's booking)
gives the report of the trace booked in one window, wherever the windows fall; a trace spilled to
disk as it is read gives the report of the trace held in memory; the command spills a large
trace and says so nowhere but in its memory."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from costexporter.core.booking import Pieces
from costexporter.core.diagnostics import Diagnostics
from costexporter.core.model import Category, Samples
from costexporter.core.replay import ReplayConfig, book_trace, replay, sample_timeline
from costexporter.core.tracefiles import SampleChunk
from costexporter.core.tracesource import SpilledTrace
from costexporter.core.tracestore import SpillStore, TraceIntake
from costexporter.sources.synth import TraceBuilder, write_nvidia_smi_csv

from .replay_corpus import cases

CORPUS = {c.name: c for c in cases(long=False)}


def same_report(a: object, b: object, path: str = "") -> list[str]:
    """Where two reports differ: money to the micro-unit, hours and energy to float rounding
    (a window's pieces are summed in another order), everything else exactly."""
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(set(a) ^ set(b))}"]
        return [d for k in a for d in same_report(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} vs {len(b)} items"]
        return [
            d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in same_report(x, y, f"{path}[{i}]")
        ]
    if isinstance(a, float) and isinstance(b, float):
        tol = 1.5e-6 if "cost" in path else 0.0
        return (
            [] if math.isclose(a, b, rel_tol=1e-9, abs_tol=max(tol, 1e-12)) else [f"{path}: {a!r} vs {b!r}"]
        )
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def windowed(cfg: ReplayConfig, window_s: float | None) -> ReplayConfig:
    return dataclasses.replace(cfg, window_ms=None if window_s is None else int(window_s * 1000))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(CORPUS)), window_s=st.floats(2.0, 900.0))
def test_any_window_length_books_every_trace_as_one_window(name, window_s):
    """Every kind of trace (several jobs handing GPUs over, free GPUs, gaps, resumes, real-like
    100 ms recordings with bursts and hiccups, logs of other tools), windows of any length: the
    same report, and each sample's band and category the same in the timeline."""
    c = CORPUS[name]
    whole_results, whole_free = book_trace(c.samples, c.events, c.cfg)
    results, free = book_trace(c.samples, c.events, windowed(c.cfg, window_s))
    from costexporter.core.replay import report_of

    diffs = same_report(report_of(whole_results, whole_free, c.cfg), report_of(results, free, c.cfg))
    assert not diffs, diffs[:5]
    a, b = sample_timeline(c.samples, whole_results), sample_timeline(c.samples, results)
    assert (a["band"] == b["band"]).all() and (a["category"] == b["category"]).all()


@st.composite
def random_jobs(draw):
    """A job of 1-4 GPUs at 1 s or 100 ms through any sequence of states, with steps or without,
    logger gaps, a crash and a resume from an earlier step, ended or not."""
    interval = draw(st.sampled_from([1.0, 0.1]))
    b = TraceBuilder(
        n_gpus=draw(st.integers(1, 4)),
        per_host=2,
        interval_s=interval,
        job="j",
        seed=draw(st.integers(0, 99)),
    )
    b.run("start")
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(
            st.sampled_from(
                ["compute", "communication", "starvation", "checkpoint", "deadlock", "idle", "gap", "resume"]
            )
        )
        d = draw(st.integers(3, 240 if interval == 1.0 else 40))
        if kind == "gap":
            b.gap(d)
        elif kind == "resume":
            b.run("resume", step=max(0, b.step - draw(st.integers(0, 10))))
        elif kind in ("checkpoint", "deadlock"):
            b.stretch(kind, d, zero_ranks=(0,))
        elif kind == "starvation":
            b.stretch(kind, d, step_s=4.0, straggler=b.n_gpus - 1)
        else:
            b.stretch(kind, d, step_s=draw(st.sampled_from([None, 2.0, 5.0])))
    if draw(st.booleans()):
        b.run("end")
    b.stretch("idle", 3)
    return b, draw(st.booleans())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(job=random_jobs(), window_s=st.floats(1.0, 400.0))
def test_any_job_booked_in_windows_is_booked_as_one(job, window_s):
    b, energy = job
    samples = b.samples(energy_counter=energy)
    note(f"{len(samples)} samples, window {window_s:.1f} s")
    cfg = ReplayConfig(gpu_model="NVIDIA B300")
    diffs = same_report(replay(samples, b.events, cfg), replay(samples, b.events, windowed(cfg, window_s)))
    assert not diffs, diffs[:5]


def test_the_windows_hold_the_agents_rounds_each_moment_once():
    """The windows really are windows (many rounds, each of a part of the samples), and their
    pieces together cover the job's GPU time once: no moment booked twice, none left out."""
    from costexporter.core import replaywindows

    c = CORPUS["mini"]
    seen = []
    real = replaywindows.book_window

    def spy(**kw):
        res = real(**kw)
        seen.append((kw["ts_ms"].size, kw["booked_until_ms"], res.horizon_ms))
        return res

    replaywindows.book_window = spy
    try:
        [r], _ = book_trace(c.samples, c.events, windowed(c.cfg, 60.0))
    finally:
        replaywindows.book_window = real
    assert len(seen) >= 20 and max(n for n, _, _ in seen) < len(c.samples) / 10
    assert all(b1 == h0 for (_, _, h0), (_, b1, _) in itertools.pairwise(seen))  # back to back
    p = r.pieces
    for g in range(len(r.gpus)):
        mine = np.flatnonzero(p.gpu == g)
        order = mine[np.argsort(p.start_ms[mine], kind="stable")]
        assert (p.start_ms[order][1:] >= p.end_ms[order][:-1]).all()  # no GPU-ms twice
    whole = book_trace(c.samples, c.events, c.cfg)[0][0].pieces
    assert int(p.dur_ms.sum()) == int(whole.dur_ms.sum())
    assert len(p.gpu) < len(c.samples) / 4  # a window keeps runs of pieces, not one per sample


def test_merged_pieces_sum_as_the_pieces_do():
    p = Pieces(
        np.array([0, 0, 0, 0, 1, 1], np.int32),
        np.array([0, 10, 20, 35, 0, 10], np.int64),
        np.array([10, 20, 30, 40, 10, 20], np.int64),
        np.array([1, 1, 1, 1, 1, 2], np.int8),
        np.array([1, 1, Category.UNOBSERVED, 1, 1, 1], np.int8),
        np.array([1.0, 2.0, 0.0, 4.0, 5.0, 6.0]),
    )
    m = p.merged()
    # 0-10 and 10-20 join; the unobserved piece and the one after a hole stay; another band stays.
    assert m.start_ms.tolist() == [0, 20, 35, 0, 10] and m.end_ms.tolist() == [20, 30, 40, 10, 20]
    assert m.energy_mj.tolist() == [3.0, 0.0, 4.0, 5.0, 6.0]


def chunks_of(s: Samples, how: str, dup: bool) -> list[SampleChunk]:
    """The samples as input files would give them: split by time or by GPU; `dup`: the second
    file repeats some stamps of the first with other readings (the later line wins)."""
    hosts = sorted({g.host for g in s.gpus})
    hno = np.asarray([hosts.index(g.host) for g in s.gpus], np.int32)
    idx = np.asarray([g.index for g in s.gpus], np.int64)
    sels = (
        [s.ts_ms < np.median(s.ts_ms), s.ts_ms >= np.median(s.ts_ms)]
        if how == "time"
        else [s.gpu % 2 == 0, s.gpu % 2 == 1]
    )
    if dup:
        sels[1] = sels[1] | (np.arange(len(s)) % 7 == 0)
    attrs = (
        {(g.host, g.index): g.uuid for g in s.gpus if g.uuid},
        {(g.host, g.index): g.name for g in s.gpus if g.name},
        {(g.host, g.index): g.power_limit_w for g in s.gpus if g.power_limit_w},
    )
    out = []
    for k, sel in enumerate(sels):
        g = s.gpu[sel]
        power = s.power_w[sel] + (3.0 if dup and k == 1 else 0.0)
        out.append(
            SampleChunk(hosts, hno[g], idx[g], s.ts_ms[sel], power, s.util_pct[sel], s.energy_mj[sel], *attrs)
        )
    return out


@pytest.mark.parametrize("name", ["mini-energy", "handover", "field-100ms", "dcgmi-dmon.txt"])
@pytest.mark.parametrize("how", ["time", "gpu"])
@pytest.mark.parametrize("dup", [False, True])
def test_a_trace_spilled_as_it_is_read_books_as_the_trace_in_memory(tmp_path, name, how, dup):
    c = CORPUS[name]
    chunks = chunks_of(c.samples, how, dup)
    in_memory = TraceIntake(None)
    spilled = TraceIntake(0, tmp_path)
    d_mem, d_spill = Diagnostics(stream=None), Diagnostics(stream=None)
    for order in (1, 0):  # (inputs finish in any order: the later input's line still wins)
        in_memory.add(chunks[order], order)
        spilled.add(chunks[order], order)
    samples = in_memory.trace(d_mem)
    where = spilled.trace(d_spill)
    assert isinstance(samples, Samples) and not isinstance(where, Samples)
    assert d_mem.counts == d_spill.counts and (d_mem.counts["duplicate_sample"] > 0) == dup
    trace = SpilledTrace(where)
    assert trace.gpus == samples.gpus and len(trace) == len(samples)
    for w in (None, 45.0):
        cfg = windowed(c.cfg, w)
        diffs = same_report(replay(samples, c.events, cfg), replay(trace, c.events, cfg))
        assert not diffs, diffs[:5]
    assert not list(where.glob("part*")), "the inputs' parts are joined and removed"


def test_a_spilled_trace_reads_a_window_from_disk_not_the_trace(tmp_path):
    """A window's columns come from the GPU files, only the rows asked for."""
    c = CORPUS["mini"]
    store = SpillStore(tmp_path / "t")
    for i, ch in enumerate(chunks_of(c.samples, "gpu", False)):
        store.add(ch, i)
    trace = SpilledTrace(store.finish())
    job = trace.job(np.arange(len(trace.gpus)))
    lo, hi = int(c.samples.ts_ms.min()) + 600_000, int(c.samples.ts_ms.min()) + 660_000
    rows = job.between(lo, hi)
    g, ts, *_ = job.take(rows)
    assert 4 * 60 <= rows.size <= 4 * 63  # a minute of 4 GPUs, and the sample either side
    assert len(trace.gpus) == 4
    for k in range(len(trace.gpus)):
        mine = ts[g == k]
        want = np.sort(c.samples.ts_ms[c.samples.gpu == k])
        lo_i, hi_i = np.searchsorted(want, lo) - 1, np.searchsorted(want, hi, "right") + 1
        assert mine.tolist() == want[lo_i:hi_i].tolist()


def test_the_command_spills_a_large_trace_and_prints_the_same_report(cli, tmp_path):
    b = TraceBuilder(n_gpus=4, per_host=2, job="big", seed=5)
    b.run("start")
    b.stretch("compute", 600, step_s=5)
    b.stretch("deadlock", 120, zero_ranks=(1,))
    b.stretch("compute", 300, step_s=5)
    b.run("end")
    csvs = write_nvidia_smi_csv(b.samples(), tmp_path / "t")
    events = b.write_events(tmp_path / "events.jsonl")
    args = ["replay", "--events", events, "--format", "json", "-q"]
    for p in csvs:
        args += ["--samples", p]
    spill = tmp_path / "spill"
    held = cli(*args)
    spilled = cli(*args, "--spill-after", "0", "--spill-dir", spill)
    assert held.returncode == 0 and spilled.returncode == 0, spilled.stderr
    diffs = same_report(json.loads(held.stdout), json.loads(spilled.stdout))
    assert not diffs, diffs[:5]
    assert spill.is_dir() and not list(spill.iterdir()), "the spilled trace is removed at exit"
    # --timeline holds every sample: the trace is not spilled, the timeline is written.
    tl = cli(*args, "--spill-after", "0", "--timeline", tmp_path / "tl.csv")
    assert tl.returncode == 0, tl.stderr
    assert len((tmp_path / "tl.csv").read_text().splitlines()) == len(b.samples()) + 1


def test_an_unusable_spill_directory_is_one_clear_line(cli, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = cli("replay", "--samples", tmp_path / "none.csv", "--spill-dir", blocker / "sub")
    assert r.returncode != 0
    assert "--spill-dir" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_disk_that_refuses_the_spill_is_one_clear_line(tmp_path):
    """The spill's files may not grow past 64 KB (RLIMIT_FSIZE in the child: the write fails as
    a full disk's does): one line naming --spill-dir, exit 2, nothing left behind."""
    import resource
    import subprocess
    import sys

    from .conftest import ROOT

    b = TraceBuilder(n_gpus=1, per_host=1, interval_s=0.1, job="long", seed=2)
    b.stretch("compute", 1200)  # 12,000 samples: 96 KB of stamps for the GPU
    [csv] = write_nvidia_smi_csv(b.samples(), tmp_path / "t")
    spill = tmp_path / "spill"

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    args = ["replay", "--samples", csv, "--spill-after", "0", "--spill-dir", spill, "--gpu-model", "B300"]
    r = subprocess.run(
        [sys.executable, "-m", "costexporter.cli", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        preexec_fn=small_files,
    )
    assert r.returncode == 2, r.stderr
    [line] = r.stderr.strip().splitlines()
    assert "spilling the trace" in line and "--spill-dir" in line and "Traceback" not in r.stderr
    assert not list(spill.iterdir())
