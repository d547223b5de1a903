"""`costexporter preflight`: the pre-run invariant gate."""

from __future__ import annotations

import sys

import click

from costexporter.cli.options import prefix_option, redis_url_option
from costexporter.cli.render import preflight_table


@click.command()
@click.option("--job", required=True, help="The job the gate is for (the result is posted as its event).")
@click.option(
    "--cache",
    multiple=True,
    metavar="PATH|GLOB",
    help="Pretokenized cache: one file of 4-byte tokens per rank, in rank order (globs sort by rank number).",
)
@click.option(
    "--world-size",
    envvar=["WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"],
    type=click.IntRange(min=1),
    default=None,
    help="Ranks launched: the cache must hold one file each [default: the launcher's WORLD_SIZE, "
    "SLURM_NTASKS or OMPI_COMM_WORLD_SIZE].",
)
@click.option("--seq-len", type=click.IntRange(min=1), default=2048, help="Tokens per block.")
@click.option(
    "--blocks-per-step", type=click.IntRange(min=1), default=8, help="Blocks per rank per optimizer step."
)
@click.option("--expected-tokens", type=click.FloatRange(min=1), default=None, help="Expected token total.")
@click.option(
    "--token-tolerance", type=click.FloatRange(min=0), default=0.10, help="Allowed deviation (0.1 = 10%)."
)
@click.option(
    "--vocab-size", type=click.IntRange(min=1), default=None, help="Sampled tokens must be below it."
)
@click.option(
    "--node", "nodes", multiple=True, help="A node of the job (repeatable): its agent must report GPUs."
)
@redis_url_option()
@prefix_option
@click.option("--master-addr", envvar="MASTER_ADDR", default=None)
@click.option("--master-port", envvar="MASTER_PORT", type=click.IntRange(1, 65535), default=None)
@click.option("--checkpoint-path", type=click.Path(), default=None)
@click.option("--min-free-gb", type=click.FloatRange(min=0), default=150.0)
@click.option(
    "--ib-probe", is_flag=True, help="Probe InfiniBand (skipped with a reason where no tool is present)."
)
@click.option("--allow-unknown", is_flag=True, help="Let checks that could not observe pass the gate.")
@click.option("--no-post", is_flag=True, help="Do not post the result to Redis.")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table")
def preflight(
    job: str,
    cache: tuple[str, ...],
    world_size: int | None,
    seq_len: int,
    blocks_per_step: int,
    expected_tokens: float | None,
    token_tolerance: float,
    vocab_size: int | None,
    nodes: tuple[str, ...],
    redis_url: str,
    prefix: str,
    master_addr: str | None,
    master_port: int | None,
    checkpoint_path: str | None,
    min_free_gb: float,
    ib_probe: bool,
    allow_unknown: bool,
    no_post: bool,
    fmt: str,
) -> None:
    """The pre-run invariant gate (R5 in docs/background.md): exit 0 only when every required check passes."""
    import time as time_mod

    from costexporter.store import keys, protocol
    from costexporter.tools.preflight import PreflightConfig, post, run, to_json

    try:
        protocol.check_job(job)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--job") from None
    cfg = PreflightConfig(
        job=job,
        cache=list(cache),
        seq_len=seq_len,
        blocks_per_step=blocks_per_step,
        expected_tokens=expected_tokens,
        token_tolerance=token_tolerance,
        vocab_size=vocab_size,
        nodes=list(nodes),
        redis_url=redis_url,
        prefix=prefix,
        master_addr=master_addr,
        master_port=master_port,
        checkpoint_path=checkpoint_path,
        min_free_gb=min_free_gb,
        ib_probe=ib_probe,
        allow_unknown=allow_unknown,
        world_size=world_size,
    )
    t0 = time_mod.perf_counter()
    passed, checks = run(cfg)
    elapsed = time_mod.perf_counter() - t0
    posted = ""
    if not no_post:
        import redis

        try:
            post(cfg, passed, checks)
            posted = f"posted to {keys.stream_key(prefix, job)}"
        except (redis.RedisError, OSError) as e:
            posted = f"not posted: Redis unreachable ({e})"
    if fmt == "json":
        click.echo(to_json(passed, checks))
    else:
        preflight_table(job, passed, checks, elapsed)
        if posted:
            click.echo(posted, err=True)
    sys.exit(0 if passed else 1)
