"""`costexporter claims close`: end a job's run (and its claim on its GPUs) by hand."""

from __future__ import annotations

import getpass

import click

from costexporter.cli.options import InputFailure, parse_time, prefix_option, redis_url_option, require_redis


@click.group()
def claims() -> None:
    """A job's claim on its GPUs: it ends with the job's run (a clean end, or rank 0 silent past
    the liveness timeout); `close` ends it by hand."""


@claims.command("close")
@click.argument("job")
@click.option(
    "--at",
    default=None,
    help="When the run ended (Unix seconds or ISO 8601, UTC if naive) [default: now]. The GPUs' "
    "time after it is outside the job.",
)
@click.option("--reason", required=True, help="Why, recorded with the close (the API shows it).")
@redis_url_option(help="Redis of the ledger (a user that may write the job's events and figures).")
@prefix_option
def claims_close(job: str, at: str | None, reason: str, redis_url: str, prefix: str) -> None:
    """Post the job's `run end` for it (rank 0, by=operator), recorded in its events and its
    figures: the agents and replay end its claim on its GPUs there."""
    import redis

    from costexporter.store import protocol
    from costexporter.tools.claims import close_run

    at_s = None if at is None else parse_time("UTC")(at) / 1000
    require_redis(redis_url, "cannot reach Redis at {url}: {e}")
    client = protocol.connect(redis_url)
    try:
        closed = close_run(client, prefix, job, at_s, reason, getpass.getuser())
    except ValueError as e:
        raise InputFailure(str(e)) from None
    except redis.RedisError as e:
        raise InputFailure(f"closing {job}'s run failed: {e}") from None
    click.echo(f"costexporter: closed the run of {closed.job} at {closed.at:.3f} ({reason})", err=True)
