"""`costexporter serve`: the per-node agent."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from costexporter.cli.options import (
    DEFAULT_METRICS_PORT,
    InputFailure,
    bind_port,
    booking_config,
    booking_options,
    check_port,
    check_tz,
    listen_option,
    load_profile,
    policy_terms,
    prefix_option,
    price_config,
    price_options,
    profile_option,
    redis_url_option,
    require_redis,
    sample_spec,
    setup_logging,
)
from costexporter.cli.servers import api_app, serve_in_thread
from costexporter.sources.factory import KINDS, make_source


@click.command()
@click.option(
    "--source",
    type=click.Choice(KINDS),
    default="nvml",
    help="Where samples come from.",
)
@click.option("--scenario", default="mini", help="The simulated job of --source sim (mini, r1).")
@click.option(
    "--dcgm-url",
    "dcgm_urls",
    multiple=True,
    metavar="URL",
    help="dcgm-exporter /metrics endpoint(s) for --source dcgm.",
)
@click.option(
    "--samples", "samples", multiple=True, metavar="[HOST=]PATH", help="Trace file(s) for --source replay."
)
@click.option("--speed", type=click.FloatRange(min=0.001), default=1.0, help="Replay speed (1 = real time).")
@click.option("--tz", default="UTC", callback=check_tz, help="Time zone of naive CSV timestamps.")
@click.option("--host", default=None, help="This node's name [default: the source's].")
@click.option("--agent-id", default=None, help="This agent's id in the ledger [default: the host].")
@redis_url_option()
@prefix_option
@listen_option("/metrics server (and the API of --api-port)")
@click.option("--port", type=int, default=DEFAULT_METRICS_PORT, help="Port of the /metrics server (0: none).")
@click.option("--book-interval", type=click.FloatRange(min=0.05), default=5.0, help="Seconds between rounds.")
@click.option(
    "--sample-interval", type=click.FloatRange(min=0.01), default=1.0, help="Seconds between samples."
)
@click.option("--gpu-model", default=None, help="GPU model (picks or derives the band profile).")
@click.option("--power-limit", type=click.FloatRange(min=1), default=None, help="Board power limit in W.")
@profile_option
@click.option("--exit-when-done", is_flag=True, help="Replay: exit once the trace is played and booked.")
@click.option("--api-port", type=int, default=0, help="Also serve the finance API on this port (0: no).")
@click.option(
    "--peer-timeout",
    type=click.FloatRange(min=1),
    default=None,
    help="Seconds another agent of a job may stay silent before booking goes on without it "
    "[default: max(6 rounds, 30 s)].",
)
@click.option(
    "--tokens-file",
    envvar="COSTEXPORTER_API_TOKENS_FILE",
    type=click.Path(dir_okay=False),
    default=None,
    help="Bearer tokens of the finance API.",
)
@click.option(
    "--series-ttl",
    type=click.FloatRange(min=0),
    default=3600.0,
    help="Seconds an ended job's series stay on /metrics.",
)
@click.option(
    "--k8s-jobs/--no-k8s-jobs",
    default=True,
    help="--source dcgm: book GPUs dcgm-exporter attributes to a pod as that pod's job (no trainer needed).",
)
@click.option(
    "--k8s-job-label",
    "k8s_job_labels",
    multiple=True,
    metavar="LABEL",
    help="Pod label naming the job (repeatable, first present wins), tried before the built-in ones "
    "(Kubeflow, JobSet, Volcano, LeaderWorkerSet, batch Job) and the pod's owner.",
)
@click.option(
    "--time-slicing-replicas",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="--source dcgm: the device plugin's time-slicing replicas per GPU. Each replica dcgm-exporter "
    "names (--kubernetes-virtual-gpus) is a device of 1/N of the GPU's time, booked to its pod's job; "
    "0: a shared GPU is booked to one pod's job.",
)
@click.option(
    "--k8s-team-label",
    "k8s_team_labels",
    multiple=True,
    metavar="LABEL",
    help="Pod label naming a Kubernetes job's team (repeatable, first present wins) [default: team; "
    "else the namespace].",
)
@click.option(
    "--k8s-api",
    type=click.Choice(["auto", "on", "off"]),
    default="auto",
    show_default=True,
    help="Read each GPU pod's labels and owners from the Kubernetes API (the `k8s` extra; RBAC get "
    "on pods): auto = when running in a cluster with the client installed; on = required (stops "
    "with the reason if it cannot be used).",
)
@click.option(
    "--event-lag",
    type=click.FloatRange(min=0),
    default=0.0,
    help="Seconds live booking stays behind the newest sample, so trainer events that arrive up to "
    "this late still count as on time (trainers behind a slow or buffering path).",
)
@click.option(
    "--unassigned-hold",
    type=click.FloatRange(min=0),
    default=600.0,
    help="Seconds the time of GPUs no job holds waits before it is booked `unassigned`, so a "
    "register that arrives this late still wins its GPU's time for the job.",
)
@click.option(
    "--trim/--no-trim",
    "trim_streams",
    default=True,
    help="Trim each job's event stream below its readers' oldest position (docs/agent.md, "
    '"Restart and trimming").',
)
@click.option(
    "--late-keep",
    type=click.FloatRange(min=0),
    default=3600.0,
    help="Seconds late an event may arrive and still be folded in exactly after trimming (the "
    "stream is kept 1-2 x this behind its slowest reader).",
)
@booking_options
@price_options
def serve(
    source: str,
    scenario: str,
    dcgm_urls: tuple[str, ...],
    samples: tuple[str, ...],
    speed: float,
    tz: str,
    host: str | None,
    agent_id: str | None,
    redis_url: str,
    prefix: str,
    listen: str,
    port: int,
    book_interval: float,
    sample_interval: float,
    gpu_model: str | None,
    power_limit: float | None,
    profile_path: Path | None,
    exit_when_done: bool,
    api_port: int,
    peer_timeout: float | None,
    tokens_file: str | None,
    series_ttl: float,
    k8s_jobs: bool,
    k8s_job_labels: tuple[str, ...],
    k8s_team_labels: tuple[str, ...],
    k8s_api: str,
    time_slicing_replicas: int,
    event_lag: float,
    unassigned_hold: float,
    trim_streams: bool,
    late_keep: float,
    **config: Any,
) -> None:
    """The per-node agent: sample GPUs, book the ledger exactly once, serve /metrics."""
    import logging
    import signal

    from costexporter.core import profiles
    from costexporter.core.diagnostics import Diagnostics, InputError
    from costexporter.services.agent import Agent, AgentConfig
    from costexporter.services.gcstate import FrozenState
    from costexporter.sources.base import GpuInitError

    setup_logging(logging.INFO)
    check_port(listen, port, "--port")
    api_sock = bind_port(listen, api_port, "--api-port")
    try:
        profile, profile_dir = load_profile(profile_path)
        if profile is None:  # before the GPUs are opened: a flag that cannot be used stops it first
            profiles.check_model(gpu_model, power_limit, profile_dir)
        src = make_source(
            source,
            host=host,
            dcgm_urls=dcgm_urls,
            samples=[sample_spec(x) for x in samples],
            speed=speed,
            tz=tz,
            diag=Diagnostics(),
            scenario=scenario,
            redis_url=redis_url,
            prefix=prefix,
            time_slicing_replicas=time_slicing_replicas,
        )
    except GpuInitError as e:
        hint = (
            " (no GPU here? `--source sim --scenario mini` plays a simulated job)" if source == "nvml" else ""
        )
        raise InputFailure(f"{e}{hint}") from None
    except (InputError, profiles.ProfileError, ValueError) as e:
        raise InputFailure(str(e)) from None
    lookup = node_pods = None
    if source == "dcgm" and k8s_jobs and k8s_api != "off":
        from costexporter.services import k8s_api as k8s_api_mod

        try:
            if k8s_api == "on" or k8s_api_mod.in_cluster():
                lookup = k8s_api_mod.PodLookup(k8s_api_mod.lightkube_fetch())
                # The node's pods, for their HAMi shares of its GPUs (none: nothing changes).
                node_pods = k8s_api_mod.NodePods(k8s_api_mod.lightkube_list(), host or src.host)
                # Before the first sample: a GPU pods share is never booked whole to one of them.
                node_pods.refresh(force=True)
                src.allocations = node_pods.allocations  # type: ignore[attr-defined]
        except k8s_api_mod.KubernetesUnavailable as e:
            if k8s_api == "on":  # asked for and unusable: stop, never run on half the configuration
                raise InputFailure(f"--k8s-api on: {e}") from None
            logging.getLogger("costexporter.k8s").warning(
                "Kubernetes API not used (%s): jobs are named from dcgm-exporter's pod labels", e
            )
    if exit_when_done:
        # A batch run that cannot book must say so, not wait for ever for Redis.
        require_redis(redis_url)
    cfg = AgentConfig(
        redis_url=redis_url,
        prefix=prefix,
        agent_id=agent_id or host or src.host,
        host=host,
        booking=booking_config(config),
        **policy_terms(config),
        prices=price_config(config),
        book_interval_s=book_interval,
        sample_interval_s=sample_interval,
        profile=profile,
        profile_dir=profile_dir,
        gpu_model=gpu_model,
        power_limit_w=power_limit,
        series_ttl_s=series_ttl,
        peer_timeout_s=peer_timeout,
        event_lag_s=event_lag,
        unassigned_hold_s=unassigned_hold,
        trim_streams=trim_streams,
        late_keep_s=late_keep,
    )
    from costexporter.store.agentid import AgentIdInUse

    try:
        agent = Agent(src, cfg).start()
    except AgentIdInUse as e:
        src.close()
        raise InputFailure(str(e)) from None
    prepare_metrics: Callable[[], None] | None = None
    if port:
        from costexporter.services.exporter import agent_registry
        from costexporter.services.exposition import start_http_server

        registry, collector = agent_registry(agent)
        prepare_metrics = collector.prepare
        start_http_server(port, addr=listen, registry=registry)
        click.echo(
            f"costexporter serve: /metrics on {listen}:{port}, source {source}, agent {cfg.agent_id}",
            err=True,
        )
    if api_sock is not None:
        serve_in_thread(api_app(redis_url, prefix, tokens_file, cfg.prices.currency, "UTC"), api_sock)
    if source == "dcgm" and k8s_jobs:
        from costexporter.services.k8s import start_kubernetes_jobs

        start_kubernetes_jobs(agent, k8s_job_labels, k8s_team_labels, lookup, node_pods)
    signal.signal(signal.SIGTERM, lambda *_: agent.stop())
    idle_rounds = [0, -1]

    def done() -> bool:
        if not exit_when_done or not getattr(src, "done", False):
            return False
        progress = sum(j.booked_until for j in agent.jobs.values())
        idle_rounds[0] = idle_rounds[0] + 1 if progress == idle_rounds[1] else 0
        idle_rounds[1] = progress
        return (all(j.done for j in agent.jobs.values() if j.own) and bool(agent.jobs)) or idle_rounds[0] >= 5

    # This process is the agent's alone: its long-lived state (jobs, folds, the exporter's
    # families) is kept out of the collector's full walks, which otherwise land in a /metrics
    # scrape's tail as in a watcher's poll (services/gcstate.py).
    frozen = FrozenState()

    def after_round() -> bool:
        if prepare_metrics is not None:  # the job families written once a round, not a scrape
            prepare_metrics()
        frozen.after_round()
        return done()

    try:
        agent.run(until=after_round)
    except KeyboardInterrupt:
        pass
    finally:
        agent.shutdown()
