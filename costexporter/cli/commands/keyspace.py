"""`costexporter keys`: the keyspace's version (`keys status`) and its migrations (`keys migrate`:
store/keyspace.py, the legacy layout's move in store/migrate.py)."""

from __future__ import annotations

import time

import click

from costexporter.cli.options import InputFailure, prefix_option, redis_url_option, require_redis


@click.group("keys")
def keys_group() -> None:
    """The Redis keyspace: its version, and moving a deployment's keys to this release's layout."""


@keys_group.command("status")
@redis_url_option()
@prefix_option
def keys_status(redis_url: str, prefix: str) -> None:
    """Print the keyspace's version, this release's, the migrations that ran and those pending.
    Exits 1 when a migration is pending or the keyspace is newer than this release."""
    import json

    from costexporter.store import keys, keyspace, protocol

    require_redis(redis_url, "cannot reach Redis at {url}: {e}")
    client = protocol.connect(redis_url)
    found, stored = keyspace.detect(client, prefix), keyspace.stored(client, prefix)
    how = "stored" if stored is not None else "not stored: dated by the keys it holds"
    click.echo(f"keyspace under {prefix}: version {found} ({how}); this release writes {keyspace.VERSION}")
    for field, raw in sorted(client.hgetall(keys.keyspace_key(prefix)).items()):
        if field.startswith("migration:"):
            try:
                rec = json.loads(raw)
            except ValueError:
                rec = {}
            click.echo(f"  ran {field[10:]}: by {rec.get('by') or '?'} at {rec.get('at')}: {rec.get('did')}")
    steps = keyspace.pending(found)
    for m in steps:
        click.echo(
            f"  pending {m.name} (to version {m.to}): run `costexporter keys migrate`, or start an agent"
        )
    if found > keyspace.VERSION:
        click.echo(f"  newer than this release: upgrade to a release that writes version {found}")
    if steps or found > keyspace.VERSION:
        raise SystemExit(1)


@keys_group.command("migrate")
@redis_url_option()
@prefix_option
@click.option("--dry-run", is_flag=True, help="List the legacy keys and their new names; change nothing.")
@click.option(
    "--force",
    is_flag=True,
    help="Move even while agents of the previous version still run (their rounds since are lost).",
)
@click.option(
    "--follow",
    type=click.FloatRange(min=0.1),
    default=None,
    metavar="SECONDS",
    help="Then keep forwarding what trainers of the previous version write, every SECONDS, until "
    "interrupted (the agents of this version also do).",
)
def keys_migrate(redis_url: str, prefix: str, dry_run: bool, force: bool, follow: float | None) -> None:
    """Move every key of the legacy layout (<prefix>:{<job>}:...) to its new name. Agents of this
    version do it themselves before their first round; run it to see the plan (--dry-run), or
    before you apply `costexporter acl` rules, under which agents cannot read the legacy names.
    Exits 1 when a key could not be moved because its new name exists too (listed)."""
    import redis

    from costexporter.store import keyspace, migrate, protocol

    require_redis(redis_url, "cannot reach Redis at {url}: {e}")
    client = protocol.connect(redis_url)
    try:
        report = migrate.migrate(client, prefix, force=force, dry_run=dry_run)
    except migrate.OldAgentsRunning as e:
        raise InputFailure(f"{e} (or --force)") from None
    except redis.RedisError as e:
        raise InputFailure(f"migration stopped: {e}; run it again, it goes on where it stopped") from None
    if dry_run:
        for old, new, kind in report.plan:
            if kind == migrate.STALE:
                click.echo(f"{old} deleted (a host's sample stream: no agent reads it now)")
            else:
                click.echo(f"{old} -> {new} ({kind})")
        click.echo(f"costexporter: {len(report.plan)} legacy keys under {prefix}", err=True)
        return
    click.echo(f"costexporter: {report.summary()}", err=True)
    for old, new in report.conflicts:
        click.echo(f"not moved: {old} ({new} exists too; compare the two and keep one)")
    if report.conflicts:
        raise SystemExit(1)
    try:  # the keyspace's later migrations, and its version recorded
        for line in keyspace.upgrade(client, prefix, force=force, by="costexporter keys migrate"):
            click.echo(f"costexporter: {line}", err=True)
    except (keyspace.NewerKeyspace, keyspace.OlderAgentsRunning) as e:
        raise InputFailure(str(e)) from None
    click.echo(f"costexporter: keyspace version {keyspace.stored(client, prefix)}", err=True)
    while follow is not None:
        time.sleep(follow)
        try:
            got = migrate.forward(client, prefix)
        except redis.RedisError as e:
            click.echo(f"costexporter: forwarding failed ({e}); retrying", err=True)
            continue
        if got.touched:
            click.echo(f"costexporter: forwarded {got.summary()}", err=True)
