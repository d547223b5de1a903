"""`costexporter calibrate`: a band profile fitted from your own baselines."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from costexporter.cli.options import InputFailure, check_tz, log_clock, parse_time, sample_spec
from costexporter.cli.render import calibration


@click.command()
@click.option(
    "--samples",
    "samples",
    multiple=True,
    required=True,
    metavar="[HOST=]PATH",
    help="Baseline trace(s): a known-healthy run and a known hang (nvidia-smi CSV or any format "
    "replay reads).",
)
@click.option(
    "--start", default=None, help="The time of a dateless log's first line (dmon without -o DT, dcgmi dmon)."
)
@click.option(
    "--interval", type=click.FloatRange(min=0.001), default=None, help="A dateless log's interval, s [1]."
)
@click.option("--events", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None)
@click.option(
    "--label",
    "labels",
    multiple=True,
    metavar="START..END=BAND",
    help="A window of one band (compute, communication, starvation, checkpoint, deadlock, idle); "
    "times in Unix seconds or ISO 8601.",
)
@click.option("--gpu-model", default=None, help="The GPU model [default: from the trace].")
@click.option("--power-limit", type=click.FloatRange(min=1), default=None, help="Board power limit in W.")
@click.option("--tz", default="UTC", callback=check_tz, help="Time zone of naive timestamps.")
@click.option("--out", "out", type=click.Path(dir_okay=False, path_type=Path), required=True)
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table")
def calibrate(
    samples: tuple[str, ...],
    start: str | None,
    interval: float | None,
    events: Path | None,
    labels: tuple[str, ...],
    gpu_model: str | None,
    power_limit: float | None,
    tz: str,
    out: Path,
    fmt: str,
) -> None:
    """Fit a GPU model's band profile from your own baselines (docs/background.md, the power bands)."""
    import json

    from costexporter.cli.allocator import keep_freed_memory
    from costexporter.core import gpulogs, profiles
    from costexporter.core import tracefiles as files
    from costexporter.core.diagnostics import Diagnostics, InputError
    from costexporter.tools.calibrate import CalibrationError, fit, parse_label

    keep_freed_memory()
    diag = Diagnostics(stream=sys.stderr)
    try:
        specs = [sample_spec(s) for s in samples]
        clock = log_clock(start, interval, tz)
        sample_set = files.combine([gpulogs.read_log(p, h, tz, diag, clock=clock) for h, p in specs], diag)
        evs = files.read_events_jsonl(events, diag) if events else []
        windows = [parse_label(x, parse_time(tz)) for x in labels]
        if not evs and not windows:
            raise CalibrationError(
                "give --events (steps, checkpoints) or --label windows: nothing says what is healthy"
            )
        result = fit(
            sample_set,
            evs,
            windows,
            gpu_model=gpu_model,
            power_limit_w=power_limit,
            sources=[str(p) for _, p in specs] + ([str(events)] if events else []),
            tz=tz,
        )
    except (InputError, CalibrationError, profiles.ProfileError) as e:
        raise InputFailure(str(e)) from None
    profiles.save(result.profile, out)
    if fmt == "json":
        click.echo(
            json.dumps(
                {
                    "profile": result.profile.to_dict(),
                    "levels": {k: vars(v) for k, v in result.levels.items()},
                    "confusion_gpu_seconds": result.confusion,
                    "held_out_accuracy": result.accuracy,
                    "warnings": result.warnings,
                },
                indent=2,
            )
        )
        return
    calibration(result, out)
