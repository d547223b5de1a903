"""`costexporter watch`: each job's state, decided from outside it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from costexporter.cli.options import (
    DEFAULT_WATCH_PORT,
    InputFailure,
    alertmanager_resend_option,
    alertmanager_url_option,
    booking_config,
    booking_options,
    check_port,
    listen_option,
    load_profile,
    policy_file,
    prefix_option,
    profile_option,
    redis_url_option,
    runbook_url_option,
    safe_url,
    setup_logging,
)


def _shard(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, int] | None:
    from costexporter.services.watcher import parse_shard

    if value is None:
        return None
    try:
        return parse_shard(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


@click.command()
@redis_url_option()
@prefix_option
@click.option("--job", "jobs", multiple=True, help="Watch only this job (repeatable) [default: every job].")
@click.option(
    "--shard",
    envvar="COSTEXPORTER_WATCH_SHARD",
    default=None,
    callback=_shard,
    metavar="INDEX/COUNT",
    help="Watch only shard INDEX of COUNT (0/2 and 1/2: two watchers share the jobs, each job in "
    "exactly one, by a hash of its name) [default: every job].",
)
@click.option("--poll", type=click.FloatRange(min=0.05), default=5.0, help="Seconds between polls.")
@click.option(
    "--heartbeat-timeout",
    type=click.FloatRange(min=0.1),
    default=60.0,
    help="Seconds without any event from a rank before its process counts as gone.",
)
@click.option("--status-ttl", type=click.FloatRange(min=1), default=None, help="TTL of the status keys.")
@click.option(
    "--recheck",
    type=click.FloatRange(min=1),
    default=60.0,
    help="Seconds a job judged done, whose jobs index score has not moved, is skipped before its "
    "streams are looked at again (the longest a rerun whose clock is behind goes unseen).",
)
@click.option("--webhook-url", envvar="COSTEXPORTER_WEBHOOK_URL", default=None, help="POST transitions here.")
@click.option("--webhook-retries", type=click.IntRange(min=0), default=5, help="Retries of a failed POST.")
@alertmanager_url_option("crashed/hung/starving/unknown are")
@click.option(
    "--cluster",
    envvar="COSTEXPORTER_CLUSTER",
    default=None,
    help="The `cluster` label of the alerts posted to Alertmanager (the one Prometheus gives the "
    "rules' alerts), so both paths' alerts of a job share it.",
)
@runbook_url_option
@click.option(
    "--generator-url",
    default="",
    metavar="URL",
    help="The link each alert posted to Alertmanager carries (its source, generatorURL), {job} "
    "replaced by the job's name: a dashboard (https://grafana/d/costexporter?var-training_job={job}) "
    "or the API's job page.",
)
@alertmanager_resend_option
@listen_option("/metrics server")
@click.option("--port", type=int, default=DEFAULT_WATCH_PORT, help="Port of the /metrics server (0: none).")
@click.option("--gpu-model", default=None, help="GPU model of the live signature [default: the job's meta].")
@click.option(
    "--power-limit",
    type=click.FloatRange(min=1),
    default=None,
    help="Board power limit in W (derives the live signature's profile; with an unknown --gpu-model).",
)
@profile_option
@click.option(
    "--sim-clock",
    is_flag=True,
    help="Judge time by the clock a simulated job publishes (the demo at --speed), not the wall clock.",
)
@click.option("--once", is_flag=True, help="Poll once, print each job's status as JSON, exit.")
@booking_options
def watch(
    redis_url: str,
    prefix: str,
    jobs: tuple[str, ...],
    shard: tuple[int, int] | None,
    poll: float,
    heartbeat_timeout: float,
    status_ttl: float | None,
    recheck: float,
    webhook_url: str | None,
    webhook_retries: int,
    alertmanager_url: str | None,
    generator_url: str,
    alertmanager_resend: float,
    cluster: str | None,
    runbooks: str | None,
    listen: str,
    port: int,
    gpu_model: str | None,
    power_limit: float | None,
    profile_path: Path | None,
    sim_clock: bool,
    once: bool,
    **config: Any,
) -> None:
    """Decide each job's state from outside it: running, done, crashed, hung, starving, unknown."""
    import json
    import logging
    import signal

    from costexporter.core import profiles
    from costexporter.services.gcstate import FrozenState
    from costexporter.services.notify import RUNBOOKS, check_runbooks
    from costexporter.services.watcher import WatchConfig, Watcher

    try:
        runbooks = check_runbooks(runbooks) if runbooks is not None else RUNBOOKS
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--runbook-url") from None
    if generator_url and not generator_url.startswith(("http://", "https://")):
        raise click.BadParameter(f"{generator_url!r} is not an http(s) URL", param_hint="--generator-url")
    setup_logging(logging.INFO)
    try:
        profile, profile_dir = load_profile(profile_path)
        if profile is None:
            profiles.check_model(gpu_model, power_limit, profile_dir)
    except profiles.ProfileError as e:
        raise InputFailure(str(e)) from None
    cfg = WatchConfig(
        redis_url=redis_url,
        prefix=prefix,
        booking=booking_config(config),
        policy_rules=policy_file(config).rules,
        poll_s=poll,
        heartbeat_timeout_s=heartbeat_timeout,
        status_ttl_s=status_ttl,
        recheck_s=recheck,
        jobs=tuple(jobs),
        shard=shard,
        webhook_url=webhook_url,
        webhook_retries=webhook_retries,
        alertmanager_url=alertmanager_url,
        alertmanager_resend_s=alertmanager_resend,
        cluster=cluster or None,
        runbooks=runbooks,
        generator_url=generator_url,
        profile=profile,
        profile_dir=profile_dir,
        gpu_model=gpu_model,
        power_limit_w=power_limit,
    )
    if sim_clock:
        from costexporter.sources.sim import published_clock

        cfg.clock = published_clock(redis_url, prefix)
    watcher = Watcher(cfg)
    if shard is not None:
        click.echo(f"costexporter watch: shard {shard[0]}/{shard[1]} of the jobs", err=True)
    if once:
        decided = watcher.poll()
        watcher.stop()
        if not watcher.redis_up:
            raise InputFailure(f"Redis at {safe_url(redis_url)} is unreachable: no job can be judged")
        click.echo(json.dumps({j: st.to_dict() for j, st in decided.items()}, indent=2))
        return
    if port:
        from costexporter.services.exporter import watch_registry
        from costexporter.services.exposition import start_http_server

        check_port(listen, port, "--port")
        start_http_server(port, addr=listen, registry=watch_registry(watcher))
        click.echo(f"costexporter watch: /metrics on {listen}:{port}", err=True)
    signal.signal(signal.SIGTERM, lambda *_: watcher.stop())
    try:
        # This process is the watcher's alone: its long-lived state is kept out of the collector's
        # full walks (services/gcstate.py).
        watcher.run(after_poll=FrozenState().after_round)
    except KeyboardInterrupt:
        pass
    finally:
        watcher.stop()
