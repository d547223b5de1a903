"""The `costexporter` command line: the group, its commands (one module each in `commands/`) and
the console entry point.

Configuration precedence: flags, then `COSTEXPORTER_*` environment variables
(`COSTEXPORTER_<COMMAND>_<OPTION>` after the flag: `COSTEXPORTER_REPLAY_PRICE_PER_GPU_HOUR`;
shared: `COSTEXPORTER_REDIS_URL`, `_PREFIX`, `_PROFILE`, `_CONFIG`), then an optional YAML file
given with `--config` (before or after the command) or `COSTEXPORTER_CONFIG`, whose top-level
keys are command names holding option names (`replay: {price_per_gpu_hour: 4.1}`); an unknown
command or option there stops the command with exit 2.
"""

from __future__ import annotations

import os
import sys

# No command does linear algebra; OpenBLAS's thread pool, started when numpy is first imported,
# costs 0.1 s of CPU (0.2 s of wall) of every command's start-up on a 2-core machine, measured
# (bench/bench_replay.py). Set before numpy loads; a user's own setting wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import click

from costexporter import __version__
from costexporter.cli.commands import (
    acl,
    api,
    archive,
    artifacts,
    calibrate,
    claims,
    demo,
    events,
    keyspace,
    preflight,
    replay,
    serve,
    watch,
)
from costexporter.cli.options import finish_options, load_bands, load_config, warn_deprecated_env


@click.group(
    context_settings={
        "auto_envvar_prefix": "COSTEXPORTER",
        "show_default": True,
        "help_option_names": ["-h", "--help"],
    }
)
@click.version_option(__version__, prog_name="costexporter")
@click.option(
    "--config",
    type=click.Path(dir_okay=False),
    envvar="COSTEXPORTER_CONFIG",
    callback=load_config,
    is_eager=True,
    expose_value=False,
    help="YAML file of defaults, keyed by command name.",
)
@click.option(
    "--bands",
    type=click.Path(dir_okay=False),
    envvar="COSTEXPORTER_BANDS",
    callback=load_bands,
    is_eager=True,
    expose_value=False,
    help="Band table (JSON) whose rows change built-in bands or add new ones (docs/bands.md).",
)
@click.pass_context
def main(ctx: click.Context) -> None:
    """Cost per valid step and wasted GPU-hours for distributed training jobs."""
    warn_deprecated_env(ctx.invoked_subcommand)


for command in (
    replay.replay,
    serve.serve,
    api.api,
    calibrate.calibrate,
    artifacts.dashboard,
    artifacts.rules,
    demo.demo,
    preflight.preflight,
    watch.watch,
    events.events,
    acl.acl,
    archive.archive_group,
    keyspace.keys_group,
    claims.claims,
):
    main.add_command(command)
finish_options(main)


def run() -> None:
    """Console entry point: bad input exits 2 with one line; nothing ends in a traceback."""
    try:
        main(standalone_mode=True)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:
        if os.environ.get("COSTEXPORTER_DEBUG"):
            raise
        click.echo(
            f"costexporter: internal error: {type(e).__name__}: {e} "
            "(set COSTEXPORTER_DEBUG=1 for the traceback)",
            err=True,
        )
        sys.exit(1)
