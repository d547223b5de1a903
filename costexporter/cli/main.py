"""The `costexporter` command line.

Configuration precedence: flags, then `COSTEXPORTER_*` environment variables
(`COSTEXPORTER_REPLAY_PRICE_PER_GPU_HOUR`, ...), then an optional YAML file given with
`--config` (before or after the command) or `COSTEXPORTER_CONFIG`, whose top-level keys are
command names holding option names (`replay: {price_per_gpu_hour: 4.1}`).
"""

from __future__ import annotations

import itertools
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# No command does linear algebra; OpenBLAS's thread pool, started when numpy is first imported,
# costs 0.1 s of CPU (0.2 s of wall) of every command's start-up on a 2-core machine, measured
# (bench/bench_replay.py). Set before numpy loads; a user's own setting wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import click

from costexporter import __version__

EXIT_INPUT = 2


class InputFailure(click.ClickException):
    """Unusable input: one clear line and exit 2."""

    exit_code = EXIT_INPUT


def _load_config(ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    """--config before the command (`costexporter --config f.yaml serve`) or after it
    (`costexporter serve --config f.yaml`): the file's section of the command gives defaults."""
    if not value:
        return value
    import yaml

    try:
        data = yaml.safe_load(Path(value).read_text()) or {}
    except OSError as e:
        raise click.BadParameter(f"cannot read {value}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise click.BadParameter(f"{value} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise click.BadParameter(f"{value}: expected a mapping of command names to options")
    sections = {k: v for k, v in data.items() if isinstance(v, dict)}
    ctx.default_map = sections if ctx.parent is None else sections.get(ctx.info_name or "", {})
    return value


def _config_option() -> click.Option:
    return click.Option(
        ["--config"],
        type=click.Path(dir_okay=False),
        envvar="COSTEXPORTER_CONFIG",
        callback=_load_config,
        is_eager=True,
        expose_value=False,
        help="YAML file of defaults, keyed by command name (flags and environment variables win).",
    )


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
    callback=_load_config,
    is_eager=True,
    expose_value=False,
    help="YAML file of defaults, keyed by command name.",
)
def main() -> None:
    """Cost per valid step and wasted GPU-hours for distributed training jobs."""


def _check_port(listen: str, port: int, flag: str) -> None:
    """A port already in use: say which one and which flag moves it (exit 2), before anything
    starts, instead of an OSError from a server thread."""
    import socket

    if not port:
        return
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(listen, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(addr)
    except OSError as e:
        raise InputFailure(
            f"port {port} on {listen} is not available ({e.strerror or e}): "
            f"choose another with {flag} (0: none)"
        ) from None


def _require_redis(url: str, says: str = "Redis at {url} is unreachable: {e}") -> None:
    """Exit 2 with one line when Redis does not answer (or the URL is not one): `says` with
    `{url}` (without credentials) and `{e}` filled in."""
    import redis

    from costexporter.store import redisconn

    try:
        redisconn.from_url(url, socket_connect_timeout=2, socket_timeout=2).ping()
    except (redis.RedisError, OSError, ValueError) as e:
        raise InputFailure(says.format(url=_safe_url(url), e=e)) from None


def _safe_url(url: str) -> str:
    """A Redis URL fit for a message: no credentials, no options."""
    from costexporter.trainer.spool import destination

    return destination(url)


def _tz(_ctx, _param, value: str) -> str:
    if value.upper() in ("UTC", "Z"):
        return value
    if m := re.fullmatch(r"[+-](\d{2}):(\d{2})", value):
        if int(m[1]) <= 23 and int(m[2]) <= 59:  # what a UTC offset can be (Arrow refuses more)
            return value
        raise click.BadParameter(f"{value!r} is not an offset like +08:00 (at most +/-23:59)")
    try:
        from zoneinfo import ZoneInfo

        ZoneInfo(value)
    except (KeyError, ValueError, OSError):  # ZoneInfoNotFoundError is a KeyError
        raise click.BadParameter(f"{value!r} is not an IANA time zone or an offset like +08:00") from None
    return value


profile_option = click.option(
    "--profile",
    "profile_path",
    type=click.Path(exists=True, path_type=Path),
    default=None,
    help="Band profile file (YAML or JSON), or a directory of them matched by GPU model "
    "[default: $COSTEXPORTER_PROFILE_DIR].",
)


REDIS_URL_HELP = "Redis of the events and the ledger; rediss:// for TLS, user:password@ for ACL users."


def redis_url_option(default: str | None = "redis://127.0.0.1:6379/0", help: str = REDIS_URL_HELP):
    return click.option("--redis-url", envvar="COSTEXPORTER_REDIS_URL", default=default, help=help)


prefix_option = click.option(
    "--prefix",
    envvar="COSTEXPORTER_PREFIX",
    default="costexporter",
    help="Redis key prefix of this deployment.",
)


def listen_option(what: str):
    return click.option("--listen", default="0.0.0.0", help=f"Address the {what} listens on.")


def _profile(path: Path | None):
    """--profile: a file is the profile; a directory is searched by GPU model (like
    $COSTEXPORTER_PROFILE_DIR); nothing: pick by model."""
    from costexporter.core import profiles

    if path is None:
        return None
    if path.is_dir():
        os.environ[profiles.PROFILE_DIR_ENV] = str(path)
        return None
    return profiles.load(path)


def _sample_spec(spec: str) -> tuple[str, Path]:
    """'[HOST=]PATH' -> (host, path); the host defaults to the file's stem."""
    host, sep, path = spec.partition("=")
    if sep and host and "/" not in host and not Path(spec).exists():
        return host, Path(path)
    return Path(spec).stem, Path(spec)


# Flags of the booking rules and prices, shared by every command that books. Defaults come from
# BookingConfig and Prices, so the dataclasses stay the one place where they are written.
BOOKING_FLAGS = [
    ("--grid", "grid_s", 0.001, "Shared time grid, seconds."),
    ("--stall-k", "stall_k", 0, "Stall threshold: k x p95 of recent step durations..."),
    ("--stall-floor", "stall_floor_s", 0, "...but at least this many seconds."),
    ("--checkpoint-allowance", "checkpoint_allowance_s", 0, "Seconds."),
    ("--eval-allowance", "eval_allowance_s", 0, "Seconds."),
    ("--startup-allowance", "startup_allowance_s", 0, "Seconds."),
    ("--phase-allowance", "phase_allowance_s", 0, "Seconds, for other declared phases."),
    ("--allowance-k", "allowance_k", 0, "Learned allowance: k x median of the job's own phase durations."),
    (
        "--gap-intervals",
        "gap_intervals",
        1,
        "A sample gap longer than this many intervals books 'unobserved'.",
    ),
    (
        "--rollback-checkpoints",
        "rollback_checkpoints",
        1,
        "A resume reaches back at most this many declared checkpoints (the agent's rollback index "
        "keeps entries back to the oldest of them).",
    ),
]
PRICE_FLAGS = [
    ("--price-per-gpu-hour", "price_per_gpu_hour", 0, "Price of a GPU-hour (a job's meta price wins)."),
    (
        "--wasted-price-per-gpu-hour",
        "wasted_price_per_gpu_hour",
        0,
        "Price for wasted categories (a base rate).",
    ),
    ("--price-per-kwh", "price_per_kwh", 0, "Energy price, on top of the GPU-hour price."),
    ("--pue", "pue", 1, "Power usage effectiveness, multiplies the energy cost."),
]


def _param(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _options(flags: list, defaults: object):
    def decorate(f):
        for flag, field, lo, help_ in reversed(flags):
            default = getattr(defaults, field)
            kind = click.IntRange(min=lo) if type(default) is int else click.FloatRange(min=lo)
            f = click.option(flag, type=kind, default=default, help=help_)(f)
        return f

    return decorate


def booking_options(f):
    from costexporter.core.booking import BookingConfig

    return _options(BOOKING_FLAGS, BookingConfig())(f)


def price_options(f):
    from costexporter.core.cost import Prices

    f = click.option("--currency", default=Prices().currency, help="Currency of all prices.")(f)
    return _options(PRICE_FLAGS, Prices())(f)


def booking_config(params: dict):
    from costexporter.core.booking import BookingConfig

    return BookingConfig(**{field: params[_param(flag)] for flag, field, _, _ in BOOKING_FLAGS})


def price_config(params: dict):
    from costexporter.core.cost import Prices

    fields = {field: params[_param(flag)] for flag, field, _, _ in PRICE_FLAGS}
    return Prices(currency=params["currency"], **fields)


@main.command()
@click.option(
    "--samples",
    "samples",
    multiple=True,
    required=True,
    metavar="[HOST=]PATH",
    help="nvidia-smi CSV or JSONL samples; repeatable. HOST defaults to the file's stem.",
)
@click.option(
    "--events", type=click.Path(dir_okay=False, path_type=Path), help="Trainer events, JSONL of protocol v1."
)
@click.option(
    "--job",
    default=None,
    help="Name of the implicit job when no event registers a GPU [default: the events' job, else 'trace'].",
)
@click.option(
    "--tz", default="UTC", callback=_tz, help="Time zone of naive CSV timestamps (IANA name or +HH:MM)."
)
@click.option("--gpu-model", default=None, help="GPU model (picks or derives the band profile).")
@click.option(
    "--power-limit",
    type=click.FloatRange(min=1),
    default=None,
    help="Board power limit in W (derives an uncalibrated profile).",
)
@profile_option
@booking_options
@price_options
@click.option("--format", "fmt", type=click.Choice(["table", "json", "csv"]), default="table")
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, writable=True, path_type=Path),
    default=None,
    help="Write the report here instead of stdout.",
)
@click.option("-q", "--quiet", is_flag=True, help="Do not print warnings about skipped input.")
@click.option("--timings", is_flag=True, help="Print where the time went (JSON, to stderr).")
def replay(
    samples,
    events,
    job,
    tz,
    gpu_model,
    power_limit,
    profile_path,
    fmt,
    output,
    quiet,
    timings,
    **config,
) -> None:
    """Book a recorded GPU trace and the trainer's events: where did the GPU-hours go?"""
    from costexporter.cli import report
    from costexporter.core import profiles
    from costexporter.core import tracefiles as files
    from costexporter.core.diagnostics import Diagnostics, InputError
    from costexporter.core.replay import ReplayConfig
    from costexporter.core.replay import replay as run_replay

    diag = Diagnostics(stream=None if quiet else sys.stderr)
    clock = [("start", time.perf_counter())]
    try:
        profile = _profile(profile_path)
        specs = [_sample_spec(s) for s in samples]
        with ThreadPoolExecutor(max_workers=min(len(specs), os.cpu_count() or 1)) as pool:
            chunks = list(pool.map(lambda hp: files.read_samples(hp[1], hp[0], tz, diag), specs))
        sample_set = files.combine(chunks)
        evs = files.read_events_jsonl(events, diag) if events else []
        clock.append(("read_s", time.perf_counter()))
        cfg = ReplayConfig(
            booking=booking_config(config),
            prices=price_config(config),
            job=job,
            gpu_model=gpu_model,
            power_limit_w=power_limit,
            profile=profile,
        )
        result = run_replay(sample_set, evs, cfg)
        clock.append(("book_s", time.perf_counter()))
    except (InputError, profiles.ProfileError) as e:
        raise InputFailure(str(e)) from None
    result["warnings"] = diag.summary()
    for line in [] if quiet else report.clock_warnings(result, tz):
        click.echo(f"warning: {line}", err=True)
    if not quiet:
        _price_overrides(result, config["price_per_gpu_hour"])
    text = {"json": report.to_json, "csv": report.to_csv, "table": report.to_table}[fmt](result)
    if output:
        output.write_text(text if text.endswith("\n") else text + "\n")
    else:
        click.echo(text, nl=not text.endswith("\n"))
    if timings:
        import json

        clock.append(("render_s", time.perf_counter()))
        t = {name: round(b - a, 4) for (_, a), (name, b) in itertools.pairwise(clock)}
        t["rows"] = len(sample_set)
        t["rows_per_s"] = round(len(sample_set) / (clock[2][1] - clock[0][1]))
        click.echo("timings: " + json.dumps(t), err=True)
    if diag.counts and not quiet:
        total = sum(diag.counts.values())
        click.echo(
            f"costexporter: {total} input problem(s) counted and skipped: "
            + ", ".join(f"{k}={v}" for k, v in diag.summary().items()),
            err=True,
        )


def _price_overrides(result: dict, flag_price: float) -> None:
    """Say once per job when its meta's price wins over --price-per-gpu-hour, which would
    otherwise seem to do nothing."""
    from costexporter.core.cost import price_override_note

    for name, j in result.get("jobs", {}).items():
        meta_price = (j.get("meta") or {}).get("price_per_gpu_hour")
        note = price_override_note(name, meta_price, j.get("price_per_gpu_hour", flag_price), flag_price)
        if note:
            click.echo(f"costexporter: {note}", err=True)


DEFAULT_METRICS_PORT = 9402  # dcgm-exporter has 9400, node-exporter 9100


@main.command()
@click.option(
    "--source",
    type=click.Choice(["nvml", "dcgm", "replay", "sim"]),
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
@click.option("--tz", default="UTC", callback=_tz, help="Time zone of naive CSV timestamps.")
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
    help="Pod label naming the job (repeatable, first present wins) [default: Kubeflow, JobSet, batch Job].",
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
    source,
    scenario,
    dcgm_urls,
    samples,
    speed,
    tz,
    host,
    agent_id,
    redis_url,
    prefix,
    listen,
    port,
    book_interval,
    sample_interval,
    gpu_model,
    power_limit,
    profile_path,
    exit_when_done,
    api_port,
    peer_timeout,
    tokens_file,
    series_ttl,
    k8s_jobs,
    k8s_job_labels,
    event_lag,
    unassigned_hold,
    trim_streams,
    late_keep,
    **config,
) -> None:
    """The per-node agent: sample GPUs, book the ledger exactly once, serve /metrics."""
    import logging
    import signal

    from costexporter.core import profiles
    from costexporter.core.diagnostics import Diagnostics, InputError
    from costexporter.services.agent import Agent, AgentConfig
    from costexporter.sources.base import GpuInitError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _check_port(listen, port, "--port")
    _check_port(listen, api_port, "--api-port")
    try:
        src = _make_source(
            source, dcgm_urls, samples, speed, tz, host, Diagnostics(), scenario, redis_url, prefix
        )
        profile = _profile(profile_path)
    except GpuInitError as e:
        hint = (
            " (no GPU here? `--source sim --scenario mini` plays a simulated job)" if source == "nvml" else ""
        )
        raise InputFailure(f"{e}{hint}") from None
    except (InputError, profiles.ProfileError, ValueError) as e:
        raise InputFailure(str(e)) from None
    if exit_when_done:
        # A batch run that cannot book must say so, not wait for ever for Redis.
        _require_redis(redis_url)
    cfg = AgentConfig(
        redis_url=redis_url,
        prefix=prefix,
        agent_id=agent_id or host or src.host,
        host=host,
        booking=booking_config(config),
        prices=price_config(config),
        book_interval_s=book_interval,
        sample_interval_s=sample_interval,
        profile=profile,
        gpu_model=gpu_model,
        power_limit_w=power_limit,
        series_ttl_s=series_ttl,
        peer_timeout_s=peer_timeout,
        event_lag_s=event_lag,
        unassigned_hold_s=unassigned_hold,
        trim_streams=trim_streams,
        late_keep_s=late_keep,
    )
    agent = Agent(src, cfg).start()
    if port:
        from prometheus_client import start_http_server

        from costexporter.services.exporter import registry_for

        start_http_server(port, addr=listen, registry=registry_for(agent))
        click.echo(
            f"costexporter serve: /metrics on {listen}:{port}, source {source}, agent {cfg.agent_id}",
            err=True,
        )
    if api_port:
        import threading

        import uvicorn

        app = _api_app(redis_url, prefix, tokens_file, cfg.prices.currency, "UTC")
        server = uvicorn.Server(uvicorn.Config(app, host=listen, port=api_port, log_level="warning"))
        server.install_signal_handlers = lambda: None  # the agent owns SIGTERM
        threading.Thread(target=server.run, name="costexporter-api", daemon=True).start()
    if source == "dcgm" and k8s_jobs:
        from costexporter.services.k8s import start_kubernetes_jobs

        start_kubernetes_jobs(agent, k8s_job_labels)
    signal.signal(signal.SIGTERM, lambda *_: agent.stop())
    idle_rounds = [0, -1]

    def done() -> bool:
        if not exit_when_done or not getattr(src, "done", False):
            return False
        progress = sum(j.booked_until for j in agent.jobs.values())
        idle_rounds[0] = idle_rounds[0] + 1 if progress == idle_rounds[1] else 0
        idle_rounds[1] = progress
        return (all(j.done for j in agent.jobs.values() if j.own) and bool(agent.jobs)) or idle_rounds[0] >= 5

    try:
        agent.run(until=done)
    except KeyboardInterrupt:
        pass
    finally:
        agent.shutdown()


def _make_source(kind, dcgm_urls, samples, speed, tz, host, diag, scenario=None, redis_url=None, prefix=None):
    if kind == "dcgm":
        from costexporter.sources.dcgm import DcgmSource

        if not dcgm_urls:
            raise ValueError("--source dcgm needs --dcgm-url")
        return DcgmSource(list(dcgm_urls), host=host)
    if kind == "sim":
        from costexporter.sources.sim import SimSource

        return SimSource(scenario, speed=speed, redis_url=redis_url, prefix=prefix, host=host)
    if kind == "replay":
        from costexporter.core import tracefiles as files
        from costexporter.sources.playback import ReplaySource

        if not samples:
            raise ValueError("--source replay needs --samples")
        chunks = [files.read_samples(p, h, tz, diag) for h, p in (_sample_spec(x) for x in samples)]
        return ReplaySource(files.combine(chunks), speed=speed, host=host)
    from costexporter.sources.nvml import NvmlSource

    return NvmlSource(host=host)


DEFAULT_API_PORT = 9403


def _api_app(redis_url: str, prefix: str, tokens_file, currency: str, tz: str, **options):
    """The finance API app; `options`: cache_mb and the FOCUS names (focus_provider, ...)."""
    from costexporter.api.app import create_app
    from costexporter.api.auth import TokenConfigError, Tokens
    from costexporter.api.export import FocusSettings
    from costexporter.api.store import LedgerStore
    from costexporter.store import redisconn

    try:
        tokens = Tokens.load(tokens_file)
    except TokenConfigError as e:
        raise InputFailure(str(e)) from None
    if not tokens.enabled:
        click.echo("costexporter api: no tokens file: the API is open to anyone who can reach it", err=True)
    client = redisconn.from_url(redis_url, decode_responses=True, socket_timeout=5, socket_connect_timeout=2)
    store = LedgerStore(client, prefix)
    _index_incidents_in_background(store)
    names = {k[6:]: v for k, v in options.items() if k.startswith("focus_") and v}
    return create_app(
        store,
        tokens,
        currency=currency,
        tz=tz,
        cache_bytes=int(float(64 if options.get("cache_mb") is None else options["cache_mb"]) * 2**20),
        focus=FocusSettings(**names) if names else None,
    )


def _index_incidents_in_background(store) -> None:
    """Incidents written before the per-job index existed, and ledgers written before the rollups:
    indexed and rolled up once, off the request path (until then those jobs are read exactly)."""
    import logging
    import threading

    import redis

    def run() -> None:
        try:
            n = store.index_incidents()
        except redis.RedisError as e:
            logging.getLogger("costexporter.api").warning("incident index migration skipped: %s", e)
            return
        if n:
            log = logging.getLogger("costexporter.api")
            log.warning("indexed %d incident hashes written before the index", n)
        try:
            n = store.build_rollups()
        except redis.RedisError as e:
            logging.getLogger("costexporter.api").warning("ledger rollups not built: %s", e)
            return
        if n:
            logging.getLogger("costexporter.api").warning("built the rollups of %d older ledgers", n)

    threading.Thread(target=run, name="costexporter-incident-index", daemon=True).start()


@main.command()
@redis_url_option()
@prefix_option
@listen_option("finance API")
@click.option("--port", type=int, default=DEFAULT_API_PORT, help="Port of the finance API.")
@click.option(
    "--tokens-file",
    envvar="COSTEXPORTER_API_TOKENS_FILE",
    type=click.Path(dir_okay=False),
    default=None,
    help="Bearer tokens with team scopes (YAML or JSON); without it the API is open.",
)
@click.option("--currency", default="USD", help="The ledger's currency.")
@click.option("--tz", default="UTC", callback=_tz, help="Time zone of calendar windows (today, month, ...).")
@click.option(
    "--hash-token",
    default=None,
    metavar="TOKEN",
    help="Print the sha256 of TOKEN for the tokens file, and exit.",
)
@click.option(
    "--cache-mb",
    envvar="COSTEXPORTER_API_CACHE_MB",
    type=click.FloatRange(min=0),
    default=64,
    show_default=True,
    help="Memory for cached series responses (0: no cache).",
)
@click.option("--focus-provider", default="costexporter", show_default=True, help="FOCUS ProviderName.")
@click.option("--focus-publisher", default=None, help="FOCUS PublisherName (default: the provider).")
@click.option("--focus-invoice-issuer", default=None, help="FOCUS InvoiceIssuerName (default: the provider).")
@click.option(
    "--focus-billing-account-id", default=None, help="FOCUS BillingAccountId (default: the provider)."
)
@click.option("--focus-billing-account-name", default=None, help="FOCUS BillingAccountName.")
def api(redis_url, prefix, listen, port, tokens_file, currency, tz, hash_token, **options) -> None:
    """The finance API over the ledger: /api/v1, OpenAPI at /docs."""
    if hash_token:
        from costexporter.api.auth import hash_token as h

        click.echo(h(hash_token))
        return
    import uvicorn

    _check_port(listen, port, "--port")
    uvicorn.run(
        _api_app(redis_url, prefix, tokens_file, currency, tz, **options),
        host=listen,
        port=port,
        log_level="info",
    )


def _parse_time(tz: str):
    """Label times: Unix seconds, or ISO 8601 (naive times in --tz)."""
    import datetime as dt

    def parse(text: str) -> int:
        text = text.strip()
        try:
            return int(float(text) * 1000)
        except ValueError:
            pass
        try:
            t = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
        except ValueError:
            raise click.BadParameter(f"{text!r} is neither Unix seconds nor an ISO 8601 time") from None
        if t.tzinfo is None:
            from costexporter.core.timeutil import tz_zone

            t = t.replace(tzinfo=tz_zone(tz))
        return int(t.timestamp() * 1000)

    return parse


@main.command()
@click.option(
    "--samples",
    "samples",
    multiple=True,
    required=True,
    metavar="[HOST=]PATH",
    help="Baseline trace(s): a known-healthy run and a known hang (nvidia-smi CSV or JSONL).",
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
@click.option("--tz", default="UTC", callback=_tz, help="Time zone of naive timestamps.")
@click.option("--out", "out", type=click.Path(dir_okay=False, path_type=Path), required=True)
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table")
def calibrate(samples, events, labels, gpu_model, power_limit, tz, out, fmt) -> None:
    """Fit a GPU model's band profile from your own baselines (docs/background.md, the power bands)."""
    import json

    from costexporter.core import profiles
    from costexporter.core import tracefiles as files
    from costexporter.core.diagnostics import Diagnostics, InputError
    from costexporter.tools.calibrate import CalibrationError, fit, parse_label

    diag = Diagnostics(stream=sys.stderr)
    try:
        specs = [_sample_spec(s) for s in samples]
        sample_set = files.combine([files.read_samples(p, h, tz, diag) for h, p in specs])
        evs = files.read_events_jsonl(events, diag) if events else []
        windows = [parse_label(x, _parse_time(tz)) for x in labels]
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
    from rich.console import Console
    from rich.table import Table

    con = Console()
    p = result.profile
    t = Table(title=f"profile {p.name}: {len(result.levels)} bands fitted, written to {out}")
    for col in ("band", "centre W", "range W (p1-p99)", "median util %", "samples"):
        t.add_column(col, justify="right" if col != "band" else "left")
    for lv in sorted(result.levels.values(), key=lambda x: -x.centre):
        t.add_row(
            lv.name, f"{lv.centre:.1f}", f"{lv.lo:.0f}-{lv.hi:.0f}", f"{lv.util_median:.0f}", str(lv.samples)
        )
    con.print(t)
    con.print(
        f"edges: idle <= {p.idle_max_w:g} W < low < {p.low_max_w:g} W <= mid "
        f"< {p.compute_min_w:g} W <= compute; "
        f"busy >= {p.busy_util_pct:g}%, zero <= {p.zero_util_pct:g}%"
        + (f" (derived: {', '.join(result.defaulted)})" if result.defaulted else "")
    )
    if result.confusion:
        names = sorted({k for row in result.confusion.values() for k in row} | set(result.confusion))
        c = Table(title=f"held-out baselines (1 block in 4): {result.accuracy:.2%} of GPU-seconds right")
        c.add_column("truth \\ predicted")
        for n in names:
            c.add_column(n, justify="right")
        for tr in names:
            row = result.confusion.get(tr, {})
            c.add_row(tr, *(f"{row.get(n, 0):.0f}" for n in names))
        con.print(c)
    for w in result.warnings:
        con.print(f"[yellow]warning:[/] {w}")


@main.command()
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None)
def dashboard(output) -> None:
    """Print (or write) the Grafana dashboard JSON."""
    from costexporter.tools.dashboard import render

    text = render()
    if output:
        output.write_text(text)
    else:
        click.echo(text, nl=False)


@main.command()
@click.option(
    "--short", is_flag=True, help="Short windows (seconds), for tests and the time-compressed demo."
)
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="NAME=VALUE",
    help="Override one window or threshold (e.g. slope_window=20m); see costexporter/tools/rules.py.",
)
@click.option(
    "--speed",
    type=click.FloatRange(min=1),
    default=None,
    help="Windows for a story played this many times faster (the demo's --speed): each divided by it.",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["rules", "prometheusrule"]),
    default="rules",
    help="A Prometheus rule file, or a prometheus-operator PrometheusRule object.",
)
@click.option("--name", default="costexporter", help="metadata.name of the PrometheusRule.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None)
def rules(short, speed, overrides, fmt, name, output) -> None:
    """Print (or write) the Prometheus alert and recording rules."""
    import dataclasses

    from costexporter.tools.rules import RuleWindows, for_speed, render, render_prometheus_rule

    w = RuleWindows.short() if short else RuleWindows()
    if speed:
        w = for_speed(w, speed)
    known = {f.name: f.type for f in dataclasses.fields(RuleWindows)}
    kw = {}
    for o in overrides:
        key, sep, value = o.partition("=")  # not `name`: that is the PrometheusRule's --name
        if not sep or key not in known:
            raise click.BadParameter(f"{o!r}: expected NAME=VALUE with NAME one of {', '.join(known)}")
        kw[key] = float(value) if known[key] in (float, "float") else value
    w = dataclasses.replace(w, **kw)
    text = render(w) if fmt == "rules" else render_prometheus_rule(w, name)
    if output:
        output.write_text(text)
    else:
        click.echo(text, nl=False)


@main.command()
@redis_url_option(None, "Redis to use [default: a private redis-server in a temporary directory].")
@prefix_option
@click.option(
    "--speed",
    type=click.FloatRange(min=1),
    default=160.0,
    help="Times faster than real time (160: the ~8-hour story in about 3 minutes).",
)
@click.option("--scenario", default="r1", help="The story: r1 (16 x B300, R1 + R7) or mini (4 GPUs, 40 min).")
@listen_option("/metrics server and the finance API")
@click.option(
    "--port", type=int, default=DEFAULT_METRICS_PORT, help="/metrics of the agent and the watcher (0: none)."
)
@click.option("--api-port", type=int, default=DEFAULT_API_PORT, help="The finance API (0: none).")
@click.option("--plain", is_flag=True, help="Print a status line every few seconds instead of the live view.")
@click.option(
    "--linger",
    type=click.FloatRange(min=0),
    default=0.0,
    help="Keep serving this many seconds after the story ends.",
)
@click.option("--forever", is_flag=True, help="Keep serving after the story ends until stopped.")
@click.option(
    "--no-watch", is_flag=True, help="Do not run the watcher in-process (run `costexporter watch`)."
)
@click.option("--json", "as_json", is_flag=True, help="Print the final bill as JSON.")
def demo(
    redis_url, prefix, speed, scenario, listen, port, api_port, plain, linger, forever, no_watch, as_json
) -> None:
    """Play the R1 + R7 story (docs/background.md) on a simulated job, live, then print the bill."""
    import contextlib
    import json
    import logging
    import signal
    import threading

    from costexporter.tools.demo import (
        Demo,
        DemoConfig,
        DemoError,
        embedded_redis,
        plain_line,
        render_bill,
        render_view,
    )

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _check_port(listen, port, "--port")
    _check_port(listen, api_port, "--api-port")
    stop = threading.Event()
    # Closing the terminal (SIGHUP) stops the demo like SIGTERM: the private Redis, the temporary
    # directories and the threads are cleaned up on the way out.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    try:
        if redis_url:
            # Fail fast instead of playing a story of zeros.
            _require_redis(
                redis_url, "the Redis of --redis-url does not answer ({e}); omit it for a private one"
            )
        ctx = contextlib.nullcontext(redis_url) if redis_url else embedded_redis()
        with ctx as url:
            cfg = DemoConfig(redis_url=url, prefix=prefix, scenario=scenario, speed=speed, watch=not no_watch)
            d = Demo(cfg)
            try:
                d.start()
                if port:
                    from prometheus_client import start_http_server

                    start_http_server(port, addr=listen, registry=d.registry())
                if api_port:
                    import uvicorn

                    app = _api_app(url, prefix, None, "USD", "UTC")
                    server = uvicorn.Server(
                        uvicorn.Config(app, host=listen, port=api_port, log_level="warning")
                    )
                    server.install_signal_handlers = lambda: None
                    threading.Thread(target=server.run, name="costexporter-api", daemon=True).start()
                click.echo(
                    f"costexporter demo: Redis {url}, /metrics {f':{port}' if port else 'off'}, "
                    f"API {f':{api_port}' if api_port else 'off'}, speed {speed:g}x",
                    err=True,
                )
                # Status (live view or plain lines) goes to stderr: stdout carries only the bill.
                _demo_loop(d, plain, stop, render_view, plain_line)
                bill = d.bill()
                with contextlib.suppress(OSError):  # the terminal may be gone (SIGHUP)
                    if as_json:
                        click.echo(json.dumps(bill, indent=2))
                    else:
                        from rich.console import Console

                        Console().print(render_bill(bill))
                if forever:
                    stop.wait()
                elif linger:
                    stop.wait(linger)
            finally:
                d.stop()
    except DemoError as e:
        raise InputFailure(str(e)) from None
    except KeyboardInterrupt:
        pass


def _demo_loop(d, plain: bool, stop, render_view, plain_line) -> None:
    if plain or not sys.stderr.isatty():
        last = 0.0
        while not d.finished and not stop.wait(0.5):
            if time.monotonic() - last >= 5:
                last = time.monotonic()
                click.echo(plain_line(d.state()), err=True)
        click.echo(plain_line(d.state()), err=True)
        return
    from rich.console import Console
    from rich.live import Live

    with Live(render_view(d.state()), refresh_per_second=4, console=Console(stderr=True)) as live:
        while not d.finished and not stop.wait(0.25):
            live.update(render_view(d.state()))
        live.update(render_view(d.state()))


@main.command()
@click.option("--job", required=True, help="The job the gate is for (the result is posted as its event).")
@click.option(
    "--cache",
    multiple=True,
    metavar="PATH|GLOB",
    help="Pretokenized cache: one file of 4-byte tokens per rank, in rank order (globs sort by rank number).",
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
    job,
    cache,
    seq_len,
    blocks_per_step,
    expected_tokens,
    token_tolerance,
    vocab_size,
    nodes,
    redis_url,
    prefix,
    master_addr,
    master_port,
    checkpoint_path,
    min_free_gb,
    ib_probe,
    allow_unknown,
    no_post,
    fmt,
) -> None:
    """The pre-run invariant gate (R5 in docs/background.md): exit 0 only when every required check passes."""
    import time as time_mod

    from costexporter.store import protocol
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
    )
    t0 = time_mod.perf_counter()
    passed, checks = run(cfg)
    elapsed = time_mod.perf_counter() - t0
    posted = ""
    if not no_post:
        import redis

        try:
            post(cfg, passed, checks)
            posted = f"posted to {protocol.stream_key(prefix, job)}"
        except (redis.RedisError, OSError) as e:
            posted = f"not posted: Redis unreachable ({e})"
    if fmt == "json":
        click.echo(to_json(passed, checks))
    else:
        from rich.console import Console
        from rich.table import Table

        verdict = "PASS" if passed else "FAIL"
        if all(c.status == "skip" for c in checks):
            verdict = "FAIL (nothing was checked: give --cache, --node, --master-port or --checkpoint-path)"
        t = Table(title=f"preflight {job}: {verdict} in {elapsed:.2f} s")
        for col in ("check", "result", "measured", "time"):
            t.add_column(col)
        style = {"pass": "green", "fail": "bold red", "unknown": "yellow", "skip": "dim"}
        for c in checks:
            t.add_row(c.name, f"[{style[c.status]}]{c.status}[/]", c.value, f"{c.seconds * 1000:.0f} ms")
        Console().print(t)
        if posted:
            click.echo(posted, err=True)
    sys.exit(0 if passed else 1)


DEFAULT_WATCH_PORT = 9404


@main.command()
@redis_url_option()
@prefix_option
@click.option("--job", "jobs", multiple=True, help="Watch only this job (repeatable) [default: every job].")
@click.option("--poll", type=click.FloatRange(min=0.05), default=5.0, help="Seconds between polls.")
@click.option(
    "--heartbeat-timeout",
    type=click.FloatRange(min=0.1),
    default=60.0,
    help="Seconds without any event from a rank before its process counts as gone.",
)
@click.option("--status-ttl", type=click.FloatRange(min=1), default=None, help="TTL of the status keys.")
@click.option("--webhook-url", envvar="COSTEXPORTER_WEBHOOK_URL", default=None, help="POST transitions here.")
@click.option("--webhook-retries", type=click.IntRange(min=0), default=5, help="Retries of a failed POST.")
@click.option(
    "--alertmanager-url",
    envvar="COSTEXPORTER_ALERTMANAGER_URL",
    default=None,
    help="Alertmanager base URL (http://alertmanager:9093): crashed/hung/starving/unknown are posted "
    "to its /api/v2/alerts and resolved when they end.",
)
@click.option(
    "--alertmanager-resend",
    type=click.FloatRange(min=0.1),
    default=60.0,
    help="Seconds between re-posts of a firing alert (its endsAt lies 4 re-posts ahead).",
)
@listen_option("/metrics server")
@click.option("--port", type=int, default=DEFAULT_WATCH_PORT, help="Port of the /metrics server (0: none).")
@click.option("--gpu-model", default=None, help="GPU model of the live signature [default: the job's meta].")
@profile_option
@click.option(
    "--sim-clock",
    is_flag=True,
    help="Judge time by the clock a simulated job publishes (the demo at --speed), not the wall clock.",
)
@click.option("--once", is_flag=True, help="Poll once, print each job's status as JSON, exit.")
@booking_options
def watch(
    redis_url,
    prefix,
    jobs,
    poll,
    heartbeat_timeout,
    status_ttl,
    webhook_url,
    webhook_retries,
    alertmanager_url,
    alertmanager_resend,
    listen,
    port,
    gpu_model,
    profile_path,
    sim_clock,
    once,
    **config,
) -> None:
    """Decide each job's state from outside it: running, done, crashed, hung, starving, unknown."""
    import json
    import logging
    import signal

    from costexporter.core import profiles
    from costexporter.services.watcher import WatchConfig, Watcher

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        profile = _profile(profile_path) or (profiles.select(gpu_model) if gpu_model else None)
    except profiles.ProfileError as e:
        raise InputFailure(str(e)) from None
    cfg = WatchConfig(
        redis_url=redis_url,
        prefix=prefix,
        booking=booking_config(config),
        poll_s=poll,
        heartbeat_timeout_s=heartbeat_timeout,
        status_ttl_s=status_ttl,
        jobs=tuple(jobs),
        webhook_url=webhook_url,
        webhook_retries=webhook_retries,
        alertmanager_url=alertmanager_url,
        alertmanager_resend_s=alertmanager_resend,
        profile=profile,
    )
    if sim_clock:
        from costexporter.sources.sim import published_clock

        cfg.clock = published_clock(redis_url, prefix)
    watcher = Watcher(cfg)
    if once:
        decided = watcher.poll()
        watcher.stop()
        if not watcher.redis_up:
            raise InputFailure(f"Redis at {_safe_url(redis_url)} is unreachable: no job can be judged")
        click.echo(json.dumps({j: st.to_dict() for j, st in decided.items()}, indent=2))
        return
    if port:
        from prometheus_client import start_http_server

        from costexporter.services.exporter import watch_registry

        _check_port(listen, port, "--port")
        start_http_server(port, addr=listen, registry=watch_registry(watcher))
        click.echo(f"costexporter watch: /metrics on {listen}:{port}", err=True)
    signal.signal(signal.SIGTERM, lambda *_: watcher.stop())
    try:
        watcher.run()
    except KeyboardInterrupt:
        pass
    finally:
        watcher.stop()


@main.group()
def events() -> None:
    """A job's events as JSONL: export a live job for `replay --events`, or import a file."""


def _events_redis(redis_url: str):
    """A client that answers, or exit 2 with one line naming the Redis (without its password)."""
    from costexporter.store import protocol

    _require_redis(redis_url, "cannot reach Redis at {url}: {e}")
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
def events_export(job, since, redis_url, prefix, output) -> None:
    """Write a job's events (validated, de-duplicated) as JSONL, the format `replay --events` reads."""
    import redis

    from costexporter.store import protocol
    from costexporter.tools.eventfile import export_lines

    try:
        protocol.check_job(job)
    except ValueError as e:
        raise InputFailure(str(e)) from None
    since_s = None if since is None else _parse_time("UTC")(since) / 1000
    client = _events_redis(redis_url)
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
def events_import(path, job, redis_url, prefix) -> None:
    """Post a JSONL events file (as `replay --events` reads it) to a job's stream in Redis.
    Bad lines are reported and skipped; importing the same file twice adds nothing."""
    import redis

    from costexporter.core.diagnostics import Diagnostics, InputError
    from costexporter.tools.eventfile import import_file

    diag = Diagnostics(stream=sys.stderr)
    client = _events_redis(redis_url)
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


def _finish_options(group: click.Group) -> None:
    """Every command: --config after the command name too, and --help that names the
    environment variable of each option (COSTEXPORTER_REDIS_URL, COSTEXPORTER_PREFIX, ...;
    the others are COSTEXPORTER_<COMMAND>_<OPTION>)."""
    for cmd in group.commands.values():
        if isinstance(cmd, click.Group):
            _finish_options(cmd)
            continue
        if not any(p.name == "config" for p in cmd.params):
            cmd.params.append(_config_option())
        for p in cmd.params:
            if isinstance(p, click.Option) and p.name not in ("help",):
                p.show_envvar = True


_finish_options(main)


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

