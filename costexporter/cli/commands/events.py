"""`costexporter events export|import`: a job's events as JSONL."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from costexporter.cli.options import InputFailure, parse_time, prefix_option, redis_url_option, require_redis


@click.group()
def events() -> None:
    """A job's events as JSONL: export a live job for `replay --events`, or import a file."""


def events_redis(redis_url: str) -> Any:  # a redis client
    """A client that answers, or exit 2 with one line naming the Redis (without its password)."""
    from costexporter.store import protocol

    require_redis(redis_url, "cannot reach Redis at {url}: {e}")
    return protocol.connect(redis_url)


@events.command("export")
@click.option("--job", required=True, help="The training job.")
@click.option(
    "--since",
    default=None,
    help="Only events at or after this time (Unix seconds or ISO 8601, UTC if naive); "
    "registrations and meta are kept whatever their time.",
)
@redis_url_option(help="Redis of the events.")
@prefix_option
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="File [default: stdout].",
)
def events_export(job: str, since: str | None, redis_url: str, prefix: str, output: Path | None) -> None:
    """Write a job's events (validated, de-duplicated) as JSONL, the format `replay --events` reads."""
    import redis

    from costexporter.store import protocol
    from costexporter.tools.eventfile import export_lines

    try:
        protocol.check_job(job)
    except ValueError as e:
        raise InputFailure(str(e)) from None
    since_s = None if since is None else parse_time("UTC")(since) / 1000
    client = events_redis(redis_url)
    lines, stats = export_lines(client, job, prefix, since_s)
    n = 0
    out = output.open("w") if output else sys.stdout
    try:
        for line in lines:
            out.write(line)
            n += 1
    except redis.RedisError as e:
        raise InputFailure(f"reading the events of {job} failed after {n} lines: {e}") from None
    finally:
        if output:
            out.close()
    skipped = {k: v for k, v in sorted(stats.items()) if k != "accepted"}
    if not stats["accepted"]:
        raise InputFailure(f"no events for job {job!r} under prefix {prefix!r}")
    note = ", ".join(f"{k}={v}" for k, v in skipped.items())
    click.echo(
        f"costexporter: exported {n} events of {job}" + (f"; skipped {note}" if note else ""), err=True
    )


@events.command("import")
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--job", default=None, help="Post into this job instead of each event's own.")
@redis_url_option(help="Redis of the events.")
@prefix_option
def events_import(path: Path, job: str | None, redis_url: str, prefix: str) -> None:
    """Post a JSONL events file (as `replay --events` reads it) to a job's stream in Redis.
    Bad lines are reported and skipped; importing the same file twice adds nothing."""
    import redis

    from costexporter.core.diagnostics import Diagnostics, InputError
    from costexporter.tools.eventfile import import_file

    diag = Diagnostics(stream=sys.stderr)
    client = events_redis(redis_url)
    try:
        res = import_file(client, path, prefix, diag, job=job)
    except (InputError, ValueError) as e:
        raise InputFailure(str(e)) from None
    except redis.RedisError as e:
        raise InputFailure(f"importing {path} failed: {e}") from None
    jobs = ", ".join(f"{j} ({n})" for j, n in res.jobs.items())
    click.echo(f"costexporter: imported {res.sent} events into {jobs}", err=True)
    if diag.counts:
        total = sum(diag.counts.values())
        detail = ", ".join(f"{k}={v}" for k, v in diag.summary().items())
        click.echo(f"costexporter: {total} line(s) skipped: {detail}", err=True)
    if res.refused:
        detail = "; ".join(f"{n} x {why}" for why, n in res.refused.items())
        raise InputFailure(f"Redis refused {sum(res.refused.values())} events: {detail}")
