"""`costexporter archive`: seal the ledger's finished days to Parquet (`seal`), drop from Redis
what the archive holds past the hot window (`expire`), rebuild the hot window in a Redis that
lost it (`restore`), check what the archive holds (`verify`), and read a window's totals back
from it (`totals`)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import click

from costexporter.cli.options import (
    F,
    InputFailure,
    instant_ms,
    prefix_option,
    redis_url_option,
    require_redis,
)

archive_option = click.option(
    "--archive",
    "url",
    required=True,
    metavar="URL",
    help="The archive's root: a directory, file:///path, s3://bucket/root (gs://, abfs:// too; "
    "S3 credentials from AWS_* variables, ?endpoint_override=host:port&scheme=http for an "
    "S3-API server).",
)


cluster_option = click.option(
    "--cluster", required=True, help="This cluster's name: its partition of the archive (cluster=NAME)."
)


def hot_days_option(text: str) -> Callable[[F], F]:
    return click.option("--hot-days", type=click.IntRange(min=1), default=35, show_default=True, help=text)


def _open(url: str):  # type: ignore[no-untyped-def]  # (store.archive.Archive, imported late)
    from costexporter.store.archive import Archive, ArchiveError

    try:
        return Archive.open(url)
    except ArchiveError as e:
        raise InputFailure(str(e)) from None


@click.group("archive")
def archive_group() -> None:
    """The sealed ledger: finished days as Parquet on a directory or object storage."""


@archive_group.command("seal")
@redis_url_option()
@prefix_option
@archive_option
@cluster_option
@click.option(
    "--delay",
    type=click.FloatRange(min=0),
    default=3600.0,
    metavar="SECONDS",
    help="A day is sealed once every agent of the job booked past its end, and this long after.",
)
@click.option(
    "--shards", type=click.IntRange(1, 1024), default=16, help="Files a day's jobs are spread over."
)
@click.option(
    "--max-wait",
    type=click.FloatRange(min=0),
    default=2 * 86400.0,
    metavar="SECONDS",
    help="A day whose agents stopped short of its end (the job ended, an agent is gone) is sealed "
    "this long after it; anything booked into it later is sealed again as a new version.",
)
def archive_seal(
    redis_url: str, prefix: str, url: str, cluster: str, delay: float, shards: int, max_wait: float
) -> None:
    """Seal every day of the ledger that can no longer change. Idempotent: run it again, twice at
    once, or after a crash, and the archive holds each day once. Run it as a CronJob with the
    sealer's ACL (`costexporter acl --role sealer`): it writes nothing in Redis."""
    import redis

    from costexporter.services.sealer import Sealer
    from costexporter.store import protocol
    from costexporter.store.archive import ArchiveError

    require_redis(redis_url, "cannot reach Redis at {url}: {e}")
    client, archive = protocol.connect(redis_url), _open(url)
    sealer = Sealer(
        client, prefix, archive, cluster, shards=shards, delay_s=int(delay), max_wait_s=int(max_wait)
    )
    try:
        report = sealer.seal(int(time.time()))
    except ArchiveError as e:
        raise InputFailure(f"{e}; nothing was lost: run it again") from None
    except redis.RedisError as e:
        raise InputFailure(f"sealing stopped: {e}; run it again") from None
    for path in report.written:
        click.echo(path)
    click.echo(f"costexporter: {report.line()}", err=True)


@archive_group.command("expire")
@redis_url_option()
@prefix_option
@archive_option
@cluster_option
@hot_days_option("Days Redis keeps before today (UTC); what lies before them is read from the archive.")
@click.option(
    "--shards", type=click.IntRange(1, 1024), default=16, help="The shards the sealer wrote (its --shards)."
)
def archive_expire(redis_url: str, prefix: str, url: str, cluster: str, hot_days: int, shards: int) -> None:
    """Drop from Redis the days before the hot window that the archive holds exactly as Redis
    does (each file read back, its hash checked, each job's rows compared), keeping the base
    records that make cumulative figures exact. A day not sealed, or booked into since, holds
    the window's start back (said). Run it after `archive seal`, with the retention ACL
    (`costexporter acl --role retention`); point the API at the archive (`api --archive`)
    before the first run, or it cannot count the days that left."""
    import redis

    from costexporter.services.retention import Retention
    from costexporter.services.sealer import Sealer
    from costexporter.store import protocol
    from costexporter.store.archive import ArchiveError

    require_redis(redis_url, "cannot reach Redis at {url}: {e}")
    client, archive = protocol.connect(redis_url), _open(url)
    retention = Retention(Sealer(client, prefix, archive, cluster, shards=shards), hot_days)
    try:
        report = retention.expire(int(time.time()))
    except ArchiveError as e:
        raise InputFailure(f"{e}; nothing was dropped that the archive does not hold") from None
    except redis.RedisError as e:
        raise InputFailure(f"expiry stopped: {e}; run it again") from None
    for line in report.held:
        click.echo(f"held: {line}", err=True)
    click.echo(f"costexporter: {report.line()}", err=True)


@archive_group.command("restore")
@redis_url_option()
@prefix_option
@archive_option
@cluster_option
@hot_days_option("Days before today (UTC) to write back into Redis; the older ones stay in the archive.")
def archive_restore(redis_url: str, prefix: str, url: str, cluster: str, hot_days: int) -> None:
    """Rebuild the hot window of a Redis that lost the ledger (restarted empty, a new Redis)
    from the archive: each sealed job-day of the last --hot-days written back as the agents
    wrote it, steps, meta and attribution included. A job-day Redis holds already is left as it
    is (said): running it again, or beside agents that booked again, never counts twice. Run it
    as Redis's admin (it writes the trainers' jobs index and meta too); the days since the last
    seal are the agents' to book again."""
    import redis

    from costexporter.services.restore import Restore
    from costexporter.store import protocol
    from costexporter.store.archive import ArchiveError

    require_redis(redis_url, "cannot reach Redis at {url}: {e}")
    client, archive = protocol.connect(redis_url), _open(url)
    from_s = (int(time.time()) // 86400 - hot_days) * 86400
    try:
        report = Restore(client, prefix, archive, cluster).restore(from_s)
    except ArchiveError as e:
        raise InputFailure(f"{e}; what was written stays, and running it again goes on from there") from None
    except redis.RedisError as e:
        raise InputFailure(
            f"restoring stopped: {e}; run it again (days written are not written twice)"
        ) from None
    for line in report.kept:
        click.echo(f"kept: {line}", err=True)
    click.echo(f"costexporter: {report.line()}", err=True)


@archive_group.command("verify")
@archive_option
@click.option(
    "--cluster", "clusters", multiple=True, help="Only this cluster (repeatable; default every one)."
)
def archive_verify(url: str, clusters: tuple[str, ...]) -> None:
    """Read every file the manifests name back and check its hash, rows and totals. Exits 1 on a
    missing or damaged file (listed)."""
    from costexporter.services.sealer import verify
    from costexporter.store.archive import ArchiveError

    try:
        check = verify(_open(url), clusters or None)
    except ArchiveError as e:
        raise InputFailure(str(e)) from None
    for p in check.problems:
        click.echo(p)
    for p in check.orphans:
        click.echo(f"costexporter: {p}: named by no manifest (the next seal removes it)", err=True)
    click.echo(
        f"costexporter: {check.files} file(s), {check.rows:,} rows checked; {len(check.problems)} problem(s)",
        err=True,
    )
    if check.problems:
        raise SystemExit(1)


@archive_group.command("totals")
@archive_option
@click.option("--start", required=True, help="Window start: ISO 8601 or Unix seconds (UTC unless zoned).")
@click.option("--end", required=True, help="Window end.")
@click.option("--cluster", "clusters", multiple=True, help="Only this cluster (repeatable).")
def archive_totals(url: str, start: str, end: str, clusters: tuple[str, ...]) -> None:
    """A window's net GPU-hours, kWh, cost and steps by cluster and job, from the archive alone
    (JSON lines). The window is cut at 5-minute buckets."""
    from costexporter.core.archive import STEPS_TOTAL
    from costexporter.core.cost import MJ_PER_KWH, MS_PER_HOUR
    from costexporter.core.model import MS
    from costexporter.services.sealer import window_totals
    from costexporter.store.archive import ArchiveError

    a, b = instant_ms(start, "UTC", "--start") // MS, instant_ms(end, "UTC", "--end") // MS
    if b <= a:
        raise InputFailure("--end must be after --start")
    try:
        got = window_totals(_open(url), a, b, clusters or None)
    except ArchiveError as e:
        raise InputFailure(str(e)) from None
    for (cluster, job), t in sorted(got.items()):
        cats = t.to_json()
        done, tokens, voided, voided_tokens = cats.pop(STEPS_TOTAL, [0, 0, 0, 0])
        click.echo(
            json.dumps(
                {
                    "cluster": cluster,
                    "job": job,
                    "steps": {"completed": done, "voided": voided, "valid": done - voided},
                    "tokens": tokens - voided_tokens,
                    "gpu_hours": {c: v[0] / MS_PER_HOUR for c, v in cats.items()},
                    "energy_kwh": {c: v[1] / MJ_PER_KWH for c, v in cats.items()},
                    "cost": {c: v[2] / 1e6 for c, v in cats.items()},
                    "cost_micro": {c: v[2] for c, v in cats.items()},
                },
                sort_keys=True,
            )
        )
