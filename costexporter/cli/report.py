"""Rendering a replay report: a readable table, JSON, or CSV for spreadsheets."""

from __future__ import annotations

import csv
import io
import itertools
import json
from typing import TYPE_CHECKING

from costexporter.core import bandtable
from costexporter.core.model import CATEGORIES, VALID_CATEGORIES, WASTED_CATEGORIES, Category
from costexporter.core.replayreport import JobReport, ProfileReport, ReplayReport
from costexporter.core.timeutil import tz_zone

if TYPE_CHECKING:
    from pathlib import Path

    from costexporter.core.model import Samples
    from costexporter.core.replay import JobResult

CSV_COLUMNS = ["job", "category", "kind", "gpu_hours", "energy_kwh", "cost", "currency"]


def _kind(category: str) -> str:
    c = Category[category.upper()]
    if c in VALID_CATEGORIES:
        return "valid"
    if c in WASTED_CATEGORIES:
        return "wasted"
    return {"overhead": "overhead", "unassigned": "outside", "unobserved": "unseen"}[category]


def to_json(report: ReplayReport) -> str:
    return json.dumps(report, indent=2, sort_keys=False)


def to_csv(report: ReplayReport) -> str:
    """One row per job and category, plus one `unassigned` row outside any job."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    cur = report["currency"]
    for job, j in report["jobs"].items():
        for c in CATEGORIES:
            if c == "unassigned":
                continue
            w.writerow(
                [
                    job,
                    c,
                    _kind(c),
                    f"{j['gpu_hours'][c]:.6f}",
                    f"{j['energy_kwh'][c]:.6f}",
                    f"{j['cost'][c]:.6f}",
                    cur,
                ]
            )
    u = report["unassigned"]
    w.writerow(
        ["", "unassigned", "outside", f"{u['gpu_hours']:.6f}", f"{u['energy_kwh']:.6f}", f"{0:.6f}", cur]
    )
    return buf.getvalue()


def _utc(t: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _span(r: list[float] | None) -> str:
    return "none" if r is None else f"{_utc(r[0])} .. {_utc(r[1])} UTC"


def _offset_of(tz: str, at_s: float) -> int:
    """Minutes east of UTC of `tz` (IANA name, UTC or +HH:MM) at time `at_s`."""
    import datetime as dt

    off = dt.datetime.fromtimestamp(at_s, tz_zone(tz)).utcoffset()
    return int(off.total_seconds() // 60) if off else 0


def clock_warnings(report: ReplayReport, tz: str) -> list[str]:
    """One line per job whose samples and events barely overlap: both ranges, the --tz in force
    and, where a whole number of hours explains it, the zone that would line them up."""
    out = []
    for job, j in report["jobs"].items():
        h = j.get("clock_offset_hours")
        if h is None:
            continue
        tr = j["time_range"]
        line = (
            f"job {job}: samples ({_span(tr['samples'])}) and events ({_span(tr['events'])}) barely overlap "
            f"with --tz {tz}"
        )
        if h and tr["samples"]:
            # Samples were read as local - offset(tz); lining up with the events needs offset - h.
            m = _offset_of(tz, tr["samples"][0]) - 60 * h
            sign = "+" if m >= 0 else "-"
            line += f"; the samples look {h:+d} h off: try --tz {sign}{abs(m) // 60:02d}:{abs(m) % 60:02d}"
        out.append(line)
    return out


def progress_notes(report: ReplayReport, progress: str) -> list[str]:
    """One line per job booked by band alone because it had no progress event: without steps no
    time is waste for lack of them, and the user learns how to book progress."""
    if progress != "auto":
        return []
    return [
        f"job {job}: no steps to book progress by: booked by band alone (--progress none); give "
        "--events with the trainer's steps to book its progress"
        for job, j in report["jobs"].items()
        if j.get("booked_by") == "band"
    ]


def from_trace(profile: ProfileReport) -> bool:
    """Whether a report's profile was derived from the trace's own levels (its idle edges may
    since have moved to the learned idle: `derived_from` keeps the origin)."""
    return profile.get("derived_from", profile.get("source")) == "derived_from_trace"


def profile_notes(report: ReplayReport) -> list[str]:
    """One line per job banded with a profile derived from the trace's own levels: no model and
    no limit named it, so the user knows what the bands stand on and how to pin them."""
    out = []
    for job, j in report["jobs"].items():
        p = j["profile"]
        if not from_trace(p):
            continue
        idle = p.get("learned_idle_w")
        model = p.get("name")
        over = p.get("over_limit")
        if over:
            what = (
                f"the trace names GPU model {model!r} (limit {over['limit_w']:.0f} W) but reads "
                f"{over['reading_w']:.0f} W: not that GPU's profile"
            )
        elif model and model != "derived":
            what = f"GPU model {model!r} has no known power limit and none is in the trace or flags"
        else:
            what = "no GPU model or power limit in the trace or flags"
        out.append(
            f"job {job}: {what}; its bands use a profile "
            f"derived from the trace's own levels (compute ~{p.get('compute_level_w', 0):.0f} W, "
            + (f"idle ~{idle:.0f} W" if idle is not None else "no idle level")
            + f"; edges {p['idle_max_w']:.0f}/{p['low_max_w']:.0f}/{p['compute_min_w']:.0f} W): "
            "give --gpu-model or --power-limit to pin them"
        )
    return out


ENERGY_COVERAGE_WARN = 0.99  # below this share of GPU time with known energy, replay says so


def energy_notes(report: ReplayReport) -> list[str]:
    """One line per job whose energy is known for less than ENERGY_COVERAGE_WARN of its GPU
    time (gaps longer than the bridge, with no energy counter): its kWh is a floor."""
    out = []
    for job, j in report["jobs"].items():
        cov = j.get("energy_coverage")
        if cov is not None and cov < ENERGY_COVERAGE_WARN:
            out.append(
                f"job {job}: energy known for {100 * cov:.1f}% of its GPU time (sample gaps longer "
                "than the bridge and no energy counter): its kWh is a floor; --gap-intervals "
                "counts longer gaps as observed"
            )
    return out


def write_timeline(path: Path, samples: Samples, results: list[JobResult], files: list[str]) -> None:
    """One CSV row per sample read, in the order of the input files and their lines: where it was
    read (file, line; header = line 1), its GPU (index, UUID and model where known), time (ISO
    8601 UTC), power, utilization, band and category. A sample no job held has no band and the
    category `unassigned`. One host's rows read back as a trace (`replay --samples`)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.csv as pcsv

    from costexporter.core.replay import sample_timeline

    tl = sample_timeline(samples, results)
    n = len(samples)
    src = samples.src if samples.src is not None else np.zeros(n, np.int64)
    order = np.argsort(src, kind="stable")
    file_no = (src >> 32)[order]
    names = np.asarray(files or [""], object)
    band_names = np.asarray(["", *bandtable.current().names], object)
    cat_names = np.asarray(CATEGORIES, object)
    hosts = np.asarray([g.host for g in samples.gpus] or [""], object)
    index = np.asarray([g.index for g in samples.gpus] or [0], np.int64)
    # The GPU's UUID and model where the trace named them: the timeline reads back as a trace.
    uuids = np.asarray([g.uuid or "" for g in samples.gpus] or [""], object)
    models = np.asarray([g.name or "" for g in samples.gpus] or [""], object)
    g = samples.gpu[order]
    ts = pa.array(samples.ts_ms[order], pa.timestamp("ms", tz="UTC"))
    table = pa.table(
        {
            "file": pa.array(names[np.clip(file_no, 0, names.size - 1)], pa.string()),
            "line": pa.array((src & 0xFFFFFFFF)[order]),
            "host": pa.array(hosts[g], pa.string()),
            "gpu": pa.array(index[g]),
            "uuid": pa.array(uuids[g], pa.string()),
            "name": pa.array(models[g], pa.string()),
            "ts": ts,
            "power_w": pa.array(samples.power_w[order]),
            "util_pct": pa.array(samples.util_pct[order]),
            "band": pa.array(band_names[tl["band"][order].astype(np.int64) + 1], pa.string()),
            "category": pa.array(cat_names[tl["category"][order]], pa.string()),
        }
    )
    import io

    buf = io.BytesIO()
    try:  # plain values; quoted only where a file or host name needs it
        pcsv.write_csv(table, buf, pcsv.WriteOptions(include_header=False, quoting_style="none"))
    except pa.ArrowInvalid:
        buf = io.BytesIO()
        pcsv.write_csv(table, buf, pcsv.WriteOptions(include_header=False, quoting_style="needed"))
    with open(path, "wb") as f:
        f.write((",".join(table.column_names) + "\n").encode())
        f.write(buf.getbuffer())


def _fmt_money(x: float | None, cur: str) -> str:
    return "n/a" if x is None else f"{x:,.4f} {cur}" if abs(x) < 1 else f"{x:,.2f} {cur}"


def rank_list(ranks: list[int]) -> str:
    """Rank ids as runs: [0, 1, 2, 3, 5] -> "0-3,5"."""
    out: list[str] = []
    for _, run in itertools.groupby(enumerate(sorted(set(ranks))), lambda p: p[1] - p[0]):
        ids = [r for _, r in run]
        out.append(str(ids[0]) if len(ids) == 1 else f"{ids[0]}-{ids[-1]}")
    return ",".join(out)


# The table lists incidents at least this long; shorter ones (a sample or two in a band: one
# 100 ms sample of a real trace is an "incident" of 0.000 GPU-h) are summed in one line. The
# JSON and CSV keep every one.
INCIDENT_FLOOR_S = 30.0


def goodput_line(j: JobReport) -> str:
    """Goodput's layers (a dash where not computed) and the carbon, where an intensity was given."""
    g = j["goodput"]

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    line = (
        f"goodput: runtime {pct(g['runtime'])}, ETTR {pct(g['ettr'])}, scheduling {pct(g['scheduling'])}, "
        f"MFU {pct(g['program'])}; {j['energy_kwh_total']:.2f} kWh"
    )
    if j["carbon_kg"] is not None:
        line += f", {j['carbon_kg']:.2f} kgCO2e"
        if j["carbon_kg_per_valid_step"] is not None:
            line += f" ({1000 * j['carbon_kg_per_valid_step']:.3g} g per valid step)"
    return line


def to_table(report: ReplayReport, incident_floor_s: float = INCIDENT_FLOOR_S) -> str:
    """The human view: where the GPU-hours went and what a valid step cost."""
    from rich.console import Console
    from rich.table import Table

    console = Console(file=io.StringIO(), width=100, force_terminal=False, color_system=None)
    cur = report["currency"]
    for job, j in report["jobs"].items():
        prof = j["profile"]
        console.print(
            f"[bold]job {job}[/]  profile {prof['name']}"
            + ("" if prof["calibrated"] else " (uncalibrated)")
            + (" (from the trace's own levels)" if from_trace(prof) else "")
            + f"  {j['gpu_hours_total']:.2f} GPU-h  {len(j['gpus'])} GPUs"
            + ("  booked by band alone" if j.get("booked_by") == "band" else "")
        )
        t = Table(show_edge=False, pad_edge=False)
        for col in ("category", "kind", "GPU-h", "share", "kWh", f"cost ({cur})"):
            t.add_column(col, justify="left" if col in ("category", "kind") else "right")
        total = j["gpu_hours_total"] or 1.0
        for c in CATEGORIES:
            h = j["gpu_hours"][c]
            if h == 0 and c in ("unassigned",):
                continue
            t.add_row(
                c,
                _kind(c),
                f"{h:.3f}",
                f"{100 * h / total:.1f}%",
                f"{j['energy_kwh'][c]:.2f}",
                f"{j['cost'][c]:,.2f}",
            )
        console.print(t)
        console.print(
            f"steps {j['steps_completed']} completed, {j['steps_voided']} voided, "
            f"{j['valid_steps']} valid; tokens {j['tokens']:,}"
        )
        console.print(
            f"cost {_fmt_money(j['cost_total'], cur)}; per valid step "
            f"{_fmt_money(j['cost_per_valid_step'], cur)} (productive only "
            f"{_fmt_money(j['productive_cost_per_step'], cur)}); per 1M tokens "
            f"{_fmt_money(j['cost_per_million_tokens'], cur)}"
        )
        console.print(
            f"wasted {j['wasted_gpu_hours']:.3f} GPU-h; bands: "
            + ", ".join(
                f"{b} {j['band_gpu_hours'][b]:.2f}"
                for b in bandtable.current().names
                if j["band_gpu_hours"][b] > 0
            )
        )
        console.print(goodput_line(j))
        tr = j.get("time_range") or {}
        if tr:
            console.print(f"samples {_span(tr.get('samples'))}; events {_span(tr.get('events'))}")
        coverage = j.get("energy_coverage")
        if coverage is not None and coverage < 1:
            console.print(f"energy known for {100 * coverage:.1f}% of the GPU time")
        s = j.get("straggler")
        if s:
            console.print(f"straggler: rank {s['rank']} ({s['host']} GPU {s['gpu']})")
        for slow in j.get("slow_ranks") or []:
            console.print(
                f"slow rank {slow['rank']} ({slow['host']} GPU {slow['gpu']}): held every GPU longer for "
                f"{slow['blocks']} min, {slow['gpu_hours']:.3f} GPU-h, {slow['cost']:.2f} {cur}"
            )
        untold = j.get("slow_ranks_untold_minutes")
        if untold:
            console.print(f"slow ranks: steps too short for the sampling in {untold} min (not told)")
        listed = [i for i in j["incidents"] if i["end"] - i["start"] >= incident_floor_s]
        short = [i for i in j["incidents"] if i["end"] - i["start"] < incident_floor_s]
        if listed:
            it = Table(title="incidents", show_edge=False, pad_edge=False)
            cols = (
                "start (UTC)",
                "minutes",
                "category",
                "band",
                "rank ids",
                "cause",
                "GPU-h",
                f"cost ({cur})",
            )
            for col in cols:
                it.add_column(col)
            import datetime as dt

            for inc in listed[:20]:
                start = dt.datetime.fromtimestamp(inc["start"], dt.timezone.utc)
                ranks = inc["ranks"]
                rtxt = rank_list(ranks) if len(ranks) <= 8 else f"{rank_list(ranks)} ({len(ranks)})"
                zero = inc.get("zero_util_ranks") or []
                it.add_row(
                    start.strftime("%Y-%m-%d %H:%M:%S"),
                    f"{(inc['end'] - inc['start']) / 60:.1f}",
                    inc["category"],
                    (inc["band"] or "") + (f" (0%: rank {','.join(map(str, zero))})" if zero else ""),
                    rtxt,
                    inc.get("cause", "unknown"),
                    f"{inc['gpu_hours']:.3f}",
                    f"{inc['cost']:,.2f}",
                )
            console.print(it)
            if len(listed) > 20:
                console.print(f"... and {len(listed) - 20} more incidents (see --format json)")
        if short:
            gpu_h = sum(i["gpu_hours"] for i in short)
            cost = sum(i["cost"] for i in short)
            console.print(
                f"{len(short)} incident(s) shorter than {incident_floor_s:g} s not listed: "
                f"{gpu_h:.3f} GPU-h, {_fmt_money(cost, cur)} (see --format json; --incident-floor)"
            )
        console.print()
    u = report["unassigned"]
    if u["gpu_hours"]:
        console.print(f"unassigned (no job registered these GPUs): {u['gpu_hours']:.3f} GPU-h")
    return str(console.file.getvalue())  # type: ignore[attr-defined]
