"""`costexporter replay`: a recorded trace and the events in, the report out."""

from __future__ import annotations

import itertools
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click

from costexporter.cli.options import (
    InputFailure,
    booking_config,
    booking_options,
    check_tz,
    load_profile,
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
    required=True,
    metavar="[HOST=]PATH",
    help="nvidia-smi CSV or JSONL samples; repeatable. HOST defaults to the file's stem.",
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
@click.option("-q", "--quiet", is_flag=True, help="Do not print warnings about skipped input.")
@click.option("--timings", is_flag=True, help="Print where the time went (JSON, to stderr).")
def replay(
    samples,
    events,
    job,
    tz,
    progress,
    gpu_model,
    power_limit,
    profile_path,
    fmt,
    output,
    timeline,
    columns,
    incident_floor,
    quiet,
    timings,
    **config,
) -> None:
    """Book a recorded GPU trace and the trainer's events: where did the GPU-hours go?"""
    from costexporter.cli import report
    from costexporter.cli.allocator import keep_freed_memory
    from costexporter.core import profiles
    from costexporter.core import tracefiles as files
    from costexporter.core.diagnostics import Diagnostics, InputError
    from costexporter.core.replay import ReplayConfig, book_trace, report_of

    keep_freed_memory()
    diag = Diagnostics(stream=None if quiet else sys.stderr)
    clock = [("start", time.perf_counter())]
    try:
        profile, profile_dir = load_profile(profile_path)
        if profile is None:
            profiles.check_model(gpu_model, power_limit, profile_dir)
        specs = [sample_spec(s) for s in samples]
        try:
            mapping = files.parse_columns(columns) if columns else None
        except ValueError as e:
            raise InputFailure(str(e)) from None
        with ThreadPoolExecutor(max_workers=min(len(specs), os.cpu_count() or 1)) as pool:
            chunks = list(pool.map(lambda hp: files.read_samples(hp[1], hp[0], tz, diag, mapping), specs))
        sample_set = files.combine(chunks, diag)
        evs = files.read_events_jsonl(events, diag) if events else []
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
        if timeline:
            report.write_timeline(timeline, sample_set, results, [str(p) for _, p in specs])
    except (InputError, profiles.ProfileError) as e:
        raise InputFailure(str(e)) from None
    result["warnings"] = diag.summary()
    for line in [] if quiet else report.clock_warnings(result, tz):
        click.echo(f"warning: {line}", err=True)
    if not quiet:
        _term_notes(results)
        for line in report.progress_notes(result, progress):
            click.echo(f"costexporter: {line}", err=True)
        for line in report.profile_notes(result):
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


def _term_notes(results: list) -> None:
    """Say once per job what its meta set that only the operator sets (thresholds, a price, an
    owner): ignored, with the policy key that would trust it."""
    from costexporter.core.terms import ignored_meta_note

    for r in results:
        if r.terms is None:
            continue
        if r.terms.ignored_meta:
            click.echo(f"costexporter: {ignored_meta_note(r.name, r.terms.ignored_meta)}", err=True)
