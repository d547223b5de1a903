"""`costexporter acl`: the least-privilege `ACL SETUSER` line of one party (store/acl.py)."""

from __future__ import annotations

import sys

import click

from costexporter.cli.options import InputFailure, prefix_option
from costexporter.store.acl import ROLES


@click.command("acl")
@click.option(
    "--role",
    required=True,
    type=click.Choice(ROLES),
    help="The party the user is for.",
)
@click.option("--job", default=None, help="A trainer for this job only.")
@click.option("--team", default=None, help="A trainer for the jobs named <team>/<anything>.")
@click.option(
    "--user",
    default=None,
    help="The Redis user [default: costexporter-<role>, costexporter-trainer-<job or team>].",
)
@prefix_option
@click.option(
    "--password-stdin",
    is_flag=True,
    help="Read the password from stdin; the line sets its SHA-256 (#...), never the text. "
    "Without it the line sets no password: a new user cannot log in until you add one.",
)
@click.option("--cluster", is_flag=True, help="Add what a Redis Cluster client needs (slot map, COMMAND).")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["setuser", "aclfile"]),
    default="setuser",
    help="An ACL SETUSER command, or a line of a Redis ACL file (user <name> <rules>).",
)
def acl(
    role: str,
    job: str | None,
    team: str | None,
    user: str | None,
    prefix: str,
    password_stdin: bool,
    cluster: bool,
    fmt: str,
) -> None:
    """Print the ACL SETUSER line of one party: only the commands its code sends and only its
    keys. A trainer's covers its job's keys (or its team's) and cannot reach the ledger or
    another job's keys; what it writes is data, never its price or owner (the operator's
    --policy). Run it with redis-cli on every node (ACLs are per server)."""
    from costexporter.store import acl as rules

    password = None
    if password_stdin:
        password = sys.stdin.readline().rstrip("\r\n")
    try:
        args = rules.setuser_args(
            role, prefix, user=user, job=job, team=team, password=password, cluster=cluster
        )
    except rules.AclError as e:
        raise InputFailure(str(e)) from None
    click.echo(rules.setuser_line(args) if fmt == "setuser" else rules.aclfile_line(args))
    if role == "trainer":
        click.echo(
            "costexporter acl: a trainer writes its job's events, ranks and meta: data, never money "
            "(its meta price, team, cost_center, budget and thresholds are ignored unless a --policy "
            "rule grants them; docs/protocol.md)",
            err=True,
        )
    if role == "trainer" and job is None and team is None:
        click.echo(
            "costexporter acl: this trainer rule covers every job's keys (not the ledger): "
            "give --job or --team to confine it",
            err=True,
        )
