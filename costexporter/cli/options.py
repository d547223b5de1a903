"""Shared by every command: the --config file, the options several commands take, the booking
and price flags, and the checks that turn unusable input into one line and exit 2."""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

if TYPE_CHECKING:
    from costexporter.core.booking import BookingConfig
    from costexporter.core.cost import Prices
    from costexporter.core.gpulogs import LogClock
    from costexporter.core.profiles import Profile

F = TypeVar("F", bound=Callable[..., Any])  # a click command being decorated

EXIT_INPUT = 2


class InputFailure(click.ClickException):
    """Unusable input: one clear line and exit 2."""

    exit_code = EXIT_INPUT


def load_bands(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    """`--bands FILE`: the band table every command of this process reads (`bandtable.install`);
    an unusable one stops here with one line."""
    from costexporter.core import bandtable

    if not value:
        return
    try:
        bandtable.install(bandtable.load(value))
    except bandtable.BandTableError as e:
        raise click.BadParameter(str(e), ctx=ctx, param=param) from None


def load_config(ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    """--config before the command (`costexporter --config f.yaml serve`) or after it
    (`costexporter serve --config f.yaml`): the file's section of the command gives defaults.
    A key that names no command or option stops the command (exit 2) with the names: a typo
    must not be ignored in silence."""
    if not value:
        return value
    import yaml

    try:
        data = yaml.safe_load(Path(value).read_text()) or {}
    except OSError as e:
        raise InputFailure(f"--config: cannot read {value}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InputFailure(f"--config: {value} is not valid YAML: {first}") from None
    if not isinstance(data, dict):
        raise InputFailure(f"--config: {value}: expected a mapping of command names to options")
    root = ctx.find_root()
    defaults = config_defaults(root.command, data, value)
    path: list[str] = []
    c: click.Context | None = ctx
    while c is not None and c.parent is not None:
        path.insert(0, c.info_name or "")
        c = c.parent
    for name in path:
        defaults = defaults.get(name, {})
    ctx.default_map = defaults
    return value


def config_defaults(cmd: click.Command, data: dict[str, Any], where: str, at: str = "") -> dict[str, Any]:
    """The defaults a --config mapping gives `cmd`, keyed as click looks them up: a group's keys
    are its commands, a command's keys its options (written as on the command line, `gpu-model`
    or `gpu_model`, or by the option's parameter name). Unknown keys raise InputFailure naming
    each of them and what is known there."""
    out: dict[str, Any] = {}
    unknown: list[str] = []
    if isinstance(cmd, click.Group):
        for key, section in data.items():
            sub = cmd.commands.get(str(key))
            if sub is None:
                unknown.append(str(key))
                continue
            if section is None:
                continue
            if not isinstance(section, dict):
                raise InputFailure(f"--config: {where}: {at}{key} must be a mapping of options")
            out[str(key)] = config_defaults(sub, section, where, f"{at}{key}.")
        known = sorted(cmd.commands)
        what = "command"
    else:
        names = config_names(cmd)
        for key, v in data.items():
            name = names.get(str(key).replace("-", "_"))
            if name is None:
                unknown.append(str(key))
            else:
                out[name] = v
        known = sorted({k for k, n in names.items() if k == _flag_key(cmd, n)})
        what = "option"
    if unknown:
        listed = ", ".join(f"{at}{k}" for k in unknown)
        raise InputFailure(
            f"--config: {where}: unknown {what}{'s' if len(unknown) > 1 else ''} {listed} "
            f"(known{' at ' + at.rstrip('.') if at else ''}: {', '.join(known)})"
        )
    return out


def config_names(cmd: click.Command) -> dict[str, str]:
    """Key in a --config file (underscored) -> the option's parameter name."""
    names: dict[str, str] = {}
    for p in cmd.params:
        if not isinstance(p, click.Option) or p.name is None or not p.expose_value:
            continue
        names[p.name] = p.name
        for opt in p.opts + p.secondary_opts:
            if opt.startswith("--"):
                names[opt[2:].replace("-", "_")] = p.name
    return names


def _flag_key(cmd: click.Command, name: str) -> str:
    """The key a --config file names an option by in messages: its first long flag."""
    for p in cmd.params:
        if p.name == name:
            for opt in p.opts:
                if opt.startswith("--"):
                    return opt[2:].replace("-", "_")
    return name


def config_option() -> click.Option:
    return click.Option(
        ["--config"],
        type=click.Path(dir_okay=False),
        envvar="COSTEXPORTER_CONFIG",
        callback=load_config,
        is_eager=True,
        expose_value=False,
        help="YAML file of defaults, keyed by command name (flags and environment variables win).",
    )


# A long-running command's same log line at most once this often (core/logflood.py).
LOG_WINDOW_S = 60.0


def setup_logging(level: int) -> None:
    """The daemons' logging (serve, watch, demo): timestamped lines on stderr, the same line at
    most once a minute with a count of those left out (a dcgm-exporter or a Redis that stays
    down is one line a minute, not one a sample)."""
    import logging

    from costexporter.core import logflood

    root = logging.getLogger()
    before = list(root.handlers)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Only the handler set up here: where logging was configured already (an embedding program,
    # a test runner's capture), its handlers are left as they are.
    logflood.install(LOG_WINDOW_S, [h for h in root.handlers if h not in before])


def check_port(listen: str, port: int, flag: str) -> None:
    """A port already in use: say which one and which flag moves it (exit 2), before anything
    starts, instead of an OSError from a server thread."""
    sock = bind_port(listen, port, flag)
    if sock is not None:
        sock.close()


def bind_port(listen: str, port: int, flag: str) -> socket.socket | None:
    """The port bound now and held (None for port 0), for a server that starts later on another
    thread: nothing else (an outgoing connection's ephemeral port, another process) can take it
    in between, and a port in use is one line naming the flag (exit 2)."""
    if not port:
        return None
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(listen, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise InputFailure(f"{flag}: cannot listen on {listen}:{port} ({e.strerror or e})") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise InputFailure(
            f"port {port} on {listen} is not available ({e.strerror or e}): "
            f"choose another with {flag} (0: none)"
        ) from None
    return sock


def require_redis(url: str, says: str = "Redis at {url} is unreachable: {e}") -> None:
    """Exit 2 with one line when Redis does not answer (or the URL is not one): `says` with
    `{url}` (without credentials) and `{e}` filled in."""
    import redis

    from costexporter.store import redisconn

    try:
        redisconn.from_url(url, socket_connect_timeout=2, socket_timeout=2).ping()
    except (redis.RedisError, OSError, ValueError) as e:
        raise InputFailure(says.format(url=safe_url(url), e=e)) from None


def safe_url(url: str) -> str:
    """A Redis URL fit for a message: no credentials, no options."""
    from costexporter.trainer.spool import destination

    return destination(url)


def check_tz(_ctx: click.Context | None, _param: click.Parameter | None, value: str) -> str:
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


PROFILE_ENV = "COSTEXPORTER_PROFILE"

profile_option = click.option(
    "--profile",
    "profile_path",
    envvar=PROFILE_ENV,
    type=click.Path(exists=True, path_type=Path),
    default=None,
    help="Band profile file (YAML or JSON), or a directory of them matched by GPU model.",
)


REDIS_URL_HELP = "Redis of the events and the ledger; rediss:// for TLS, user:password@ for ACL users."


def check_redis_url(_ctx: object, _param: object, value: str | None) -> str | None:
    """A Redis URL's scheme, checked before anything connects: one line, not a traceback."""
    if value is None:
        return value
    from urllib.parse import urlsplit

    from costexporter.store.redisconn import CLUSTER_SCHEMES

    schemes = ("redis", "rediss", "unix", *CLUSTER_SCHEMES)
    try:
        scheme = urlsplit(value).scheme.lower()
    except ValueError:
        scheme = ""
    if scheme not in schemes:
        raise InputFailure(
            f"--redis-url {safe_url(value)!r} is not a Redis URL ({', '.join(s + '://' for s in schemes)})"
        )
    return value


def redis_url_option(
    default: str | None = "redis://127.0.0.1:6379/0", help: str = REDIS_URL_HELP
) -> Callable[[F], F]:
    return click.option(
        "--redis-url", envvar="COSTEXPORTER_REDIS_URL", default=default, help=help, callback=check_redis_url
    )


prefix_option = click.option(
    "--prefix",
    envvar="COSTEXPORTER_PREFIX",
    default="costexporter",
    help="Redis key prefix of this deployment.",
)


def listen_option(what: str, default: str = "0.0.0.0") -> Callable[[F], F]:
    return click.option("--listen", default=default, help=f"Address the {what} listens on.")


def alertmanager_url_option(what: str) -> Callable[[F], F]:
    """--alertmanager-url: where `what` (the alerts this command raises) is posted."""
    return click.option(
        "--alertmanager-url",
        envvar="COSTEXPORTER_ALERTMANAGER_URL",
        default=None,
        help=f"Alertmanager base URL (http://alertmanager:9093): {what} posted to its /api/v2/alerts "
        "and resolved when they end.",
    )


def alertmanager_resend_option(f: F) -> F:
    return click.option(
        "--alertmanager-resend",
        type=click.FloatRange(min=0.1),
        default=60.0,
        show_default=True,
        help="Seconds between re-posts of a firing alert (its endsAt lies 4 re-posts ahead).",
    )(f)


def runbook_url_option(f: F) -> F:
    return click.option(
        "--runbook-url",
        "runbooks",
        default=None,
        metavar="URL",
        help="The alerts page each posted alert's runbook_url links (URL#<alert name in lower case>), as "
        "`costexporter rules --runbook-url` gives the rules' alerts; default: the project's docs/alerts.md.",
    )(f)


def load_profile(path: Path | None) -> tuple[Profile | None, Path | None]:
    """--profile: a file is the profile; a directory holds fitted profiles matched by GPU model.
    Without it, $COSTEXPORTER_PROFILE_DIR (the older name of $COSTEXPORTER_PROFILE) names the
    directory. Returns (profile, directory); a directory that is named but missing stops the
    command here, not a round later."""
    from costexporter.core import profiles

    if path is None:
        env = os.environ.get(profiles.PROFILE_DIR_ENV)
        if not env:
            return None, None
        path = Path(env)
        if not path.is_dir():
            raise InputFailure(f"${profiles.PROFILE_DIR_ENV}: {path} is not a directory")
    if path.is_dir():
        return None, path
    return profiles.load(path), None


def instant_ms(text: str, tz: str, flag: str) -> int:
    """A time flag (ISO 8601 or Unix seconds; zone-less in --tz) as epoch ms, or one line."""
    from costexporter.core import timeutil

    try:
        return timeutil.to_ms(timeutil.parse_instant(text, timeutil.tz_zone(tz)))
    except ValueError as e:
        raise InputFailure(f"{flag}: {e}") from None


def log_clock(start: str | None, interval_s: float | None, tz: str) -> LogClock:
    """How a log without dates is dated: --start (its first line's time) and --interval (its -d)."""
    from costexporter.core import gpulogs

    return gpulogs.LogClock(
        instant_ms(start, tz, "--start") if start else None, round(1000 * (interval_s or 1.0))
    )


def sample_spec(spec: str) -> tuple[str, Path]:
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
        "--liveness-timeout",
        "liveness_timeout_s",
        1,
        "A run that stops without 'run end' is over once rank 0 shows no sign of life (a step, a "
        "run event, a heartbeat) for this many seconds: its claim on its GPUs ends there.",
    ),
    (
        "--liveness-timeout-max",
        "liveness_timeout_max_s",
        1,
        "The longest liveness timeout: a job's meta heartbeat_timeout_s lengthens it up to here, and "
        "a job whose rank 0 posts no heartbeat to its events stream (an older reporter) gets it.",
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
    (
        "--price-per-gpu-hour",
        "price_per_gpu_hour",
        0,
        "Price of a GPU-hour where the policy's price table has no row for the GPU (never a job's meta).",
    ),
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


def _options(flags: list[Any], defaults: object) -> Callable[[F], F]:
    def decorate(f: F) -> F:
        for flag, field, lo, help_ in reversed(flags):
            default = getattr(defaults, field)
            kind = click.IntRange(min=lo) if type(default) is int else click.FloatRange(min=lo)
            f = click.option(flag, type=kind, default=default, help=help_)(f)
        return f

    return decorate


def booking_options(f: F) -> F:
    from costexporter.core import booking

    f = click.option(
        "--policy",
        "policy",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help="The operator's policy file (YAML or JSON): booking thresholds, owners and prices by "
        "job-name pattern or Kubernetes namespace, and the price table by GPU model and node pool "
        "(docs/terms.md). Never a job's meta.",
    )(f)
    return _options(BOOKING_FLAGS, booking.BookingConfig())(f)


def policy_terms(params: dict[str, Any]) -> dict[str, Any]:
    """A config's `policy_rules` and `pricing` from `--policy`."""
    pf = policy_file(params)
    return {"policy_rules": pf.rules, "pricing": pf.pricing, "carbon": pf.carbon}


def policy_file(params: dict[str, Any]) -> Any:
    """`--policy` as a `terms.PolicyFile` (an empty one without it); an unusable file stops the
    command with one line (exit 2): a policy given but unusable fails closed."""
    from costexporter.core.terms import PolicyError, PolicyFile, parse_policy_file

    path = params.get("policy")
    if path is None:
        return PolicyFile()
    import yaml

    try:
        doc = yaml.safe_load(Path(path).read_text())  # JSON is YAML
    except OSError as e:
        raise InputFailure(f"--policy: cannot read {path}: {e.strerror or e}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InputFailure(f"--policy: {path} is not valid YAML or JSON: {first}") from None

    def read(name: str) -> str:  # a file the policy names, relative to the policy's own
        return (Path(path).parent / name).read_text(encoding="utf-8")

    try:
        return parse_policy_file(doc, f"--policy {path}", read)
    except PolicyError as e:
        raise InputFailure(str(e)) from None


def price_options(f: F) -> F:
    from costexporter.core import cost

    f = click.option("--currency", default=cost.Prices().currency, help="Currency of all prices.")(f)
    return _options(PRICE_FLAGS, cost.Prices())(f)


def booking_config(params: dict[str, Any]) -> BookingConfig:
    from costexporter.core import booking

    return booking.BookingConfig(**{field: params[_param(flag)] for flag, field, _, _ in BOOKING_FLAGS})


def price_config(params: dict[str, Any]) -> Prices:
    from costexporter.core import cost

    fields = {field: params[_param(flag)] for flag, field, _, _ in PRICE_FLAGS}
    return cost.Prices(currency=params["currency"], **fields)


DEFAULT_METRICS_PORT = 9402  # dcgm-exporter has 9400, node-exporter 9100


DEFAULT_API_PORT = 9403


DEFAULT_WATCH_PORT = 9404


def parse_time(tz: str) -> Callable[[str], int]:
    """Label times: Unix seconds, or RFC 3339 / ISO 8601 (naive times in --tz), as milliseconds."""
    from costexporter.core.timeutil import parse_instant, tz_zone

    def parse(text: str) -> int:
        try:
            return int(parse_instant(text, tz_zone(tz)) * 1000)
        except (ValueError, OverflowError) as e:
            raise click.BadParameter(str(e)) from None

    return parse


# Old environment variable -> the one that replaced it (filled by finish_options): still read,
# with a deprecation line on stderr.
DEPRECATED_ENV: dict[str, str] = {}
ENV_PREFIX = "COSTEXPORTER"


def env_name(path: list[str], option: click.Option) -> str:
    """The one naming rule: COSTEXPORTER_<COMMAND>_<OPTION>, from the command's path and the
    option's first long flag (`replay --format` -> COSTEXPORTER_REPLAY_FORMAT)."""
    flag = next((o for o in option.opts if o.startswith("--")), None)
    name = flag[2:] if flag else (option.name or "")
    return "_".join([ENV_PREFIX, *path, name]).replace("-", "_").upper()


def finish_options(group: click.Group, path: list[str] | None = None) -> None:
    """Every command: --config after the command name too, --help that names the environment
    variable of each option (COSTEXPORTER_REDIS_URL, COSTEXPORTER_PREFIX, COSTEXPORTER_PROFILE
    are shared; the others are COSTEXPORTER_<COMMAND>_<OPTION>, named after the flag), and the
    variables of older releases (named after the parameter: COSTEXPORTER_REPLAY_FMT) still read,
    with a deprecation line."""
    path = path or []
    for name, cmd in group.commands.items():
        here = [*path, name]
        if isinstance(cmd, click.Group):
            finish_options(cmd, here)
            continue
        if not any(p.name == "config" for p in cmd.params):
            cmd.params.append(config_option())
        for p in cmd.params:
            if not isinstance(p, click.Option) or p.name in ("help", "config"):
                continue
            p.show_envvar = True
            if not p.allow_from_autoenv and p.envvar is None:
                continue
            old = "_".join([ENV_PREFIX, *here, p.name or ""]).replace("-", "_").upper()
            if p.envvar is None:
                new = env_name(here, p)
                if new != old:
                    p.envvar = new
                    DEPRECATED_ENV[old] = new
            elif p.name == "profile_path":
                DEPRECATED_ENV[old] = PROFILE_ENV


def warn_deprecated_env(command: str | None) -> None:
    """Variables of an older release that the command reads: each set one is read as its new
    name (unless that is set too), with one line on stderr. Runs before the command parses its
    options, so --help names only the new variables."""
    from costexporter.core.profiles import PROFILE_DIR_ENV

    mine = f"{ENV_PREFIX}_{(command or '').replace('-', '_').upper()}_"
    olds = {o: n for o, n in DEPRECATED_ENV.items() if command is None or o.startswith(mine)}
    for old, new in sorted(olds.items()):
        if old not in os.environ:
            continue
        if new in os.environ:
            click.echo(f"costexporter: ${old} is ignored: ${new} is set", err=True)
        else:
            click.echo(f"costexporter: ${old} is deprecated: use ${new}", err=True)
            os.environ[new] = os.environ[old]
    if PROFILE_DIR_ENV in os.environ:
        # Still read where --profile and $COSTEXPORTER_PROFILE are not given (load_profile).
        click.echo(f"costexporter: ${PROFILE_DIR_ENV} is deprecated: use ${PROFILE_ENV}", err=True)
