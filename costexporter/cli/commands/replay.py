"""`costexporter replay`: a recorded trace and the events in, the report out."""

from __future__ import annotations

import itertools
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from collections.abc import Mapping

    from costexporter.core.diagnostics import Diagnostics
    from costexporter.core.gpulogs import LogClock
    from costexporter.core.model import Event
    from costexporter.core.tracefiles import SampleChunk
    from costexporter.core.tracesource import Trace
    from costexporter.core.tracestore import TraceIntake
    from costexporter.services.history import PodSpan, Prometheus

    PromWindow = tuple[Prometheus, float, float]  # --prometheus: the API, --start and --end (Unix s)

from costexporter.cli.options import (
    InputFailure,
    booking_config,
    booking_options,
    check_tz,
    instant_ms,
    load_profile,
    log_clock,
    policy_terms,
    price_config,
    price_options,
    profile_option,
    sample_spec,
)


@click.command()
@click.option(
    "--samples",
    "samples",
    multiple=True,
    metavar="[HOST=]PATH",
    help="GPU samples: nvidia-smi CSV (or another logger's CSV, one column per GPU too), JSONL, "
    "nvidia-smi dmon, dcgmi dmon, a dcgm-exporter dump; repeatable. HOST defaults to the file's stem.",
)
@click.option(
    "--prometheus",
    metavar="URL",
    default=None,
    help="Replay the DCGM series a Prometheus (Thanos, Mimir) holds for --start..--end instead of "
    "(or beside) sample files; pods become jobs (kube-state-metrics' owners where it has them).",
)
@click.option(
    "--match",
    "selector",
    default="",
    metavar="MATCHERS",
    help='Label matchers added to every --prometheus query: cluster="a",Hostname=~"node-1.*".',
)
@click.option(
    "--start",
    "start",
    default=None,
    help="Start of the --prometheus window, or the time of a dateless log's first line (dmon without "
    "-o DT, dcgmi dmon, a dump without times); ISO 8601 or Unix seconds, zone-less in --tz.",
)
@click.option("--end", "end", default=None, help="End of the --prometheus window.")
@click.option(
    "--interval",
    type=click.FloatRange(min=0.001),
    default=None,
    help="A dateless log's sampling interval (its -d), default 1 s; the --prometheus query step, "
    "default 15 s.",
)
@click.option(
    "--job-map",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Jobs of a past window: a CSV of pod,job[,namespace], or SLURM `sacct -P -o "
    "JobID,JobName,NodeList,Start,End,AllocTRES` output (whole nodes by node and time).",
)
@click.option(
    "--steps-from-tensorboard",
    "tensorboard",
    type=click.Path(path_type=Path),
    default=None,
    help="The job's steps from a TensorBoard run directory (the wall times of --tag's values).",
)
@click.option(
    "--tag", default=None, help="The TensorBoard tag logged with every (Nth) step, e.g. train/loss."
)
@click.option(
    "--events", type=click.Path(dir_okay=False, path_type=Path), help="Trainer events, JSONL of protocol v1."
)
@click.option(
    "--job",
    default=None,
    help="Name of the implicit job when no event registers a GPU [default: the events' job, else 'trace'].",
)
@click.option(
    "--tz", default="UTC", callback=check_tz, help="Time zone of naive CSV timestamps (IANA name or +HH:MM)."
)
@click.option(
    "--progress",
    type=click.Choice(["auto", "events", "none"]),
    default="auto",
    show_default=True,
    help="How progress is booked: 'events' by the trainer's steps, runs and phases; 'none' by band "
    "alone (a trace without a trainer); 'auto' by events where a job has any progress event, else "
    "by band (said on stderr).",
)
@click.option("--gpu-model", default=None, help="GPU model (picks or derives the band profile).")
@click.option(
    "--power-limit",
    type=click.FloatRange(min=1),
    default=None,
    help="Board power limit in W (derives an uncalibrated profile).",
)
@profile_option
@booking_options
@price_options
@click.option("--format", "fmt", type=click.Choice(["table", "json", "csv"]), default="table")
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, writable=True, path_type=Path),
    default=None,
    help="Write the report here instead of stdout.",
)
@click.option(
    "--timeline",
    type=click.Path(dir_okay=False, writable=True, path_type=Path),
    default=None,
    help="Also write one CSV row per sample read (file, line, host, gpu, uuid, name, ts, power_w, "
    "util_pct, band, category): plot it, check it against your own labels, or replay one host's "
    "rows as a trace.",
)
@click.option(
    "--columns",
    default=None,
    metavar="ROLE=COLUMN,...",
    help="The CSV's column for each role (time, gpu, power, util, uuid, name) where its names are "
    "not nvidia-smi's nor a common one: gpu=gpu_index,power=power_W,util=utilization_gpu_percent.",
)
@click.option(
    "--incident-floor",
    type=click.FloatRange(min=0),
    default=None,
    help="The table lists incidents at least this many seconds long and sums the shorter ones in "
    "one line (default 30; JSON and CSV keep every incident).",
)
@click.option(
    "--spill-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where a trace too large to hold is written as it is read, then booked from, a window "
    "at a time (default: the system's temporary directory; removed at exit). It takes about 32 "
    "bytes a sample.",
)
@click.option(
    "--spill-after",
    type=click.IntRange(min=0),
    default=None,
    metavar="SAMPLES",
    help="Spill a trace of more samples than this (default 2,000,000; memory then follows one "
    "input file and one booking window). Not with --timeline, which holds every sample.",
)
@click.option("-q", "--quiet", is_flag=True, help="Do not print warnings about skipped input.")
@click.option("--timings", is_flag=True, help="Print where the time went (JSON, to stderr).")
def replay(
    samples: tuple[str, ...],
    prometheus: str | None,
    selector: str,
    start: str | None,
    end: str | None,
    interval: float | None,
    job_map: Path | None,
    tensorboard: Path | None,
    tag: str | None,
    events: Path | None,
    job: str | None,
    tz: str,
    progress: str,
    gpu_model: str | None,
    power_limit: float | None,
    profile_path: Path | None,
    fmt: str,
    output: Path | None,
    timeline: Path | None,
    columns: str | None,
    incident_floor: float | None,
    spill_dir: Path | None,
    spill_after: int | None,
    quiet: bool,
    timings: bool,
    **config: Any,
) -> None:
    """Book a recorded GPU trace and the trainer's events: where did the GPU-hours go?"""
    from costexporter.cli import report
    from costexporter.cli.allocator import keep_freed_memory
    from costexporter.core import profiles, tracestore
    from costexporter.core import tracefiles as files
    from costexporter.core.diagnostics import Diagnostics, InputError
    from costexporter.core.replay import ReplayConfig, book_trace, report_of
    from costexporter.core.tracesource import MemoryTrace, SpilledTrace

    keep_freed_memory()
    diag = Diagnostics(stream=None if quiet else sys.stderr)
    clock = [("start", time.perf_counter())]
    # A large trace is spilled to disk as it is read (never with --timeline: it lists every sample).
    try:
        if spill_dir is not None:
            spill_dir.mkdir(parents=True, exist_ok=True)
        spill_rows = tracestore.SPILL_ROWS if spill_after is None else spill_after
        intake = tracestore.TraceIntake(None if timeline else spill_rows, spill_dir)
    except OSError as e:
        raise InputFailure(f"--spill-dir {spill_dir or e.filename}: {e.strerror or e}") from None
    try:
        profile, profile_dir = load_profile(profile_path)
        if profile is None:
            profiles.check_model(gpu_model, power_limit, profile_dir)
        specs = [sample_spec(s) for s in samples]
        if not specs and not prometheus:
            raise InputFailure("give --samples FILE (repeatable) or --prometheus URL with --start and --end")
        try:
            mapping = files.parse_columns(columns) if columns else None
        except ValueError as e:
            raise InputFailure(str(e)) from None
        spans = _read_samples(specs, tz, diag, mapping, log_clock(start, interval, tz), intake)
        window = _prometheus_window(prometheus, start, end, tz) if prometheus else None
        if window is not None:
            got, more = _read_prometheus(window, selector, interval, diag)
            intake.add(got, len(specs))
            del got
            spans += more
        read = intake.trace(diag)
        sample_set: Trace = SpilledTrace(read) if isinstance(read, Path) else MemoryTrace(read)
        evs = files.read_events_jsonl(events, diag) if events else []
        evs += _job_events(sample_set, spans, job_map, window, tz, diag)
        if tensorboard:
            evs += _tensorboard_steps(tensorboard, tag, job, evs)
        clock.append(("read_s", time.perf_counter()))
        cfg = ReplayConfig(
            booking=booking_config(config),
            **policy_terms(config),
            prices=price_config(config),
            job=job,
            gpu_model=gpu_model,
            power_limit_w=power_limit,
            profile=profile,
            profile_dir=profile_dir,
            progress=progress,
        )
        results, unassigned = book_trace(sample_set, evs, cfg, diag)
        result = report_of(results, unassigned, cfg)
        clock.append(("book_s", time.perf_counter()))
        if timeline and isinstance(sample_set, MemoryTrace):  # (never spilled with --timeline)
            report.write_timeline(timeline, sample_set.samples, results, [str(p) for _, p in specs])
    except (InputError, profiles.ProfileError) as e:
        raise InputFailure(str(e)) from None
    finally:
        intake.close()
    result["warnings"] = diag.summary()
    for line in [] if quiet else report.clock_warnings(result, tz):
        click.echo(f"warning: {line}", err=True)
    if not quiet:
        _term_notes(results)
        for line in report.progress_notes(result, progress):
            click.echo(f"costexporter: {line}", err=True)
        for line in report.profile_notes(result) + report.energy_notes(result):
            click.echo(f"costexporter: {line}", err=True)
    if fmt == "table":
        floor = report.INCIDENT_FLOOR_S if incident_floor is None else incident_floor
        text = report.to_table(result, floor)
    else:
        text = {"json": report.to_json, "csv": report.to_csv}[fmt](result)
    if output:
        output.write_text(text if text.endswith("\n") else text + "\n")
    else:
        click.echo(text, nl=not text.endswith("\n"))
    if timings:
        import json

        clock.append(("render_s", time.perf_counter()))
        t = {name: round(b - a, 4) for (_, a), (name, b) in itertools.pairwise(clock)}
        t["rows"] = len(sample_set)
        t["rows_per_s"] = round(len(sample_set) / (clock[2][1] - clock[0][1]))
        click.echo("timings: " + json.dumps(t), err=True)
    if diag.counts and not quiet:
        total = sum(diag.counts.values())
        click.echo(
            f"costexporter: {total} input problem(s) counted: "
            + ", ".join(f"{k}={v}" for k, v in diag.summary().items()),
            err=True,
        )


def _term_notes(results: list[Any]) -> None:
    """Say once per job what its meta set that only the operator sets (thresholds, a price, an
    owner): ignored, with the policy key that would trust it."""
    from costexporter.core.terms import ignored_meta_note

    for r in results:
        if r.terms is None:
            continue
        if r.terms.ignored_meta:
            click.echo(f"costexporter: {ignored_meta_note(r.name, r.terms.ignored_meta)}", err=True)


def _read_samples(
    specs: list[tuple[str, Path]],
    tz: str,
    diag: Diagnostics,
    mapping: Mapping[str, str] | None,
    clock: LogClock,
    intake: TraceIntake,
) -> list[PodSpan]:
    """Every --samples file, read by its format in parallel, each file's samples handed to
    `intake` as it is read (held, or spilled to disk); the pods a dcgm-exporter dump saw on its
    GPUs (the Prometheus text parser imported only for one)."""
    from costexporter.core import gpulogs

    def read(spec: tuple[str, Path]) -> tuple[SampleChunk, list[PodSpan]]:
        host, path = spec
        if gpulogs.kind_of(path, mapping) == "dcgm-exporter":
            from costexporter.services import history

            return history.read_exporter_dump(path, host, clock, diag, tz)
        return gpulogs.read_log(path, host, tz, diag, mapping, clock), []

    def read_into(order: int) -> list[PodSpan]:
        chunk, spans = read(specs[order])
        intake.add(chunk, order)
        return spans

    if not specs:
        return []
    with ThreadPoolExecutor(max_workers=min(len(specs), os.cpu_count() or 1)) as pool:
        return [s for spans in pool.map(read_into, range(len(specs))) for s in spans]


def _prometheus_window(url: str, start: str | None, end: str | None, tz: str) -> PromWindow:
    """--prometheus with its --start and --end: the API and the window in Unix seconds."""
    from costexporter.services import history

    if not start or not end:
        raise InputFailure("--prometheus needs --start and --end")
    return (
        history.Prometheus(url),
        instant_ms(start, tz, "--start") / 1000,
        instant_ms(end, tz, "--end") / 1000,
    )


def _read_prometheus(
    window: PromWindow, selector: str, interval: float | None, diag: Diagnostics
) -> tuple[SampleChunk, list[PodSpan]]:
    from costexporter.services import history

    prom, t0, t1 = window
    try:
        return history.read_prometheus(prom, t0, t1, interval or 15.0, diag, selector)
    except history.PrometheusError as e:
        raise InputFailure(str(e)) from None


def _job_events(
    sample_set: Trace,
    spans: list[PodSpan],
    job_map_path: Path | None,
    window: PromWindow | None,
    tz: str,
    diag: Diagnostics,
) -> list[Event]:
    """The registrations of the jobs a past window's pods (or a SLURM export) say held its GPUs."""
    if not spans and job_map_path is None:
        return []  # (a plain trace: nothing to import)
    from costexporter.services import history, jobmap

    jm = jobmap.load(job_map_path, tz) if job_map_path else None
    out = []
    if jm is not None and jm.slurm:
        end_ms = int(sample_set.last_ms[sample_set.counts > 0].max()) if len(sample_set) else 0
        out += jobmap.slurm_events(jm.slurm, sample_set.gpus, end_ms, diag)
    if jm is not None and jm.pods and not spans:
        click.echo(
            "costexporter: the job map names pods, but no reading named the pod holding its GPU "
            "(only dcgm-exporter's series do: a dump or --prometheus): it maps nothing here",
            err=True,
        )
    if spans:
        owners = {}
        if window is not None:
            try:
                owners = history.pod_owners(*window)
            except history.PrometheusError as e:
                click.echo(
                    f"costexporter: kube-state-metrics' pod owners not read ({e}): jobs named by pod",
                    err=True,
                )
        names = jobmap.pod_jobs(spans, jm, owners)
        out += jobmap.span_events(spans, names, sample_set.interval_ms)
    return out


def _tensorboard_steps(path: Path, tag: str | None, job: str | None, evs: list[Event]) -> list[Event]:
    from costexporter.services import tbsteps

    if not tag:
        raise InputFailure(
            "--steps-from-tensorboard needs --tag (the scalar logged with each step, e.g. train/loss)"
        )
    jobs = sorted({e.job for e in evs})
    name = job or (jobs[0] if len(jobs) == 1 else None)
    if name is None and jobs:
        raise InputFailure(
            f"--steps-from-tensorboard: say which job they are with --job (jobs: {', '.join(jobs[:10])})"
        )
    return tbsteps.step_events(tbsteps.logged_steps(path, tag), name or "trace")
