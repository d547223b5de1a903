"""`costexporter api`: the finance API."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import click

from costexporter.cli.options import (
    DEFAULT_API_PORT,
    alertmanager_resend_option,
    alertmanager_url_option,
    check_port,
    check_tz,
    listen_option,
    prefix_option,
    redis_url_option,
    runbook_url_option,
)
from costexporter.cli.servers import api_app, serve_forever


@click.command()
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
@click.option(
    "--tz", default="UTC", callback=check_tz, help="Time zone of calendar windows (today, month, ...)."
)
@click.option(
    "--hash-token",
    default=None,
    metavar="TOKEN",
    # An action, not a setting: a variable left in the environment must not turn the server
    # into a one-shot hash printer.
    allow_from_autoenv=False,
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
@click.option(
    "--cluster",
    envvar="COSTEXPORTER_CLUSTER",
    default=None,
    help="Cluster name of jobs whose meta names none (the OpenCost endpoint's `cluster`).",
)
@click.option(
    "--policy",
    "policy",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="The operator's policy file (the agents'): the API takes its carbon_intensity (the grid's "
    "gCO2e/kWh, or an hourly series file) for the carbon figures (docs/terms.md).",
)
@click.option(
    "--archive",
    envvar="COSTEXPORTER_ARCHIVE",
    default=None,
    metavar="URL",
    help="The sealed archive (a directory, s3://bucket/root, ...): windows before the ledger's start "
    "in Redis (`archive expire`) are read there, from this cluster's partition (--cluster).",
)
@click.option(
    "--archive-cluster",
    "archive_clusters",
    multiple=True,
    envvar="COSTEXPORTER_ARCHIVE_CLUSTERS",
    metavar="NAME",
    help="Another cluster whose sealed days this API bills too, from the archive (repeatable): "
    "its jobs are `<cluster>:<job>` in /allocation and OpenCost's /allocation (aggregate=cluster "
    "groups by cluster), up to its last seal.",
)
@click.option(
    "--header-timeout",
    envvar="COSTEXPORTER_API_HEADER_TIMEOUT",
    type=click.FloatRange(min=0.1),
    default=10.0,
    show_default=True,
    help="Seconds a client has to send a request's head (line and headers); then it is closed.",
)
@click.option(
    "--body-timeout",
    envvar="COSTEXPORTER_API_BODY_TIMEOUT",
    type=click.FloatRange(min=0.1),
    default=30.0,
    show_default=True,
    help="Seconds a client has to send a request's body after its head.",
)
@click.option(
    "--keep-alive-timeout",
    envvar="COSTEXPORTER_API_KEEP_ALIVE_TIMEOUT",
    type=click.IntRange(min=1),
    default=5,
    show_default=True,
    help="Seconds an idle kept-alive connection stays open.",
)
@click.option(
    "--max-connections",
    envvar="COSTEXPORTER_API_MAX_CONNECTIONS",
    type=click.IntRange(min=1),
    default=1024,
    show_default=True,
    help="Connections open at once (kept under the file-descriptor limit); past it the one "
    "waiting longest for its request head is closed.",
)
@click.option(
    "--metrics-port",
    envvar="COSTEXPORTER_API_METRICS_PORT",
    type=int,
    default=0,
    help="Port of a /metrics server with the policy's budgets as gauges (0: none), for the "
    "PolicyBudget* rules.",
)
@alertmanager_url_option("the policy's budget alerts are")
@alertmanager_resend_option
@click.option(
    "--budget-interval",
    type=click.FloatRange(min=0.05),
    default=60.0,
    show_default=True,
    help="Seconds between evaluations of the policy's budgets (for /metrics and Alertmanager).",
)
@runbook_url_option
@click.option("--focus-provider", default="costexporter", show_default=True, help="FOCUS ProviderName.")
@click.option("--focus-publisher", default=None, help="FOCUS PublisherName (default: the provider).")
@click.option(
    "--focus-invoice-issuer",
    default=None,
    help="FOCUS InvoiceIssuerName (default: the provider; another issuer marks, to FOCUS 1.2, a "
    "marketplace charge whose BilledCost validators expect to be 0).",
)
@click.option(
    "--focus-billing-account-id", default=None, help="FOCUS BillingAccountId (default: the provider)."
)
@click.option("--focus-billing-account-name", default=None, help="FOCUS BillingAccountName.")
def api(
    redis_url: str,
    prefix: str,
    listen: str,
    port: int,
    tokens_file: str | None,
    currency: str,
    tz: str,
    hash_token: str | None,
    **options: Any,
) -> None:
    """The finance API over the ledger: /api/v1, OpenAPI at /docs."""
    if hash_token:
        from costexporter.api.auth import hash_token as h

        click.echo(h(hash_token))
        return
    from costexporter.api.server import ServerLimits

    check_port(listen, port, "--port")
    limits = ServerLimits(
        header_timeout_s=options.pop("header_timeout"),
        body_timeout_s=options.pop("body_timeout"),
        keep_alive_s=options.pop("keep_alive_timeout"),
        max_connections=options.pop("max_connections"),
    )
    watch = {k: options.pop(k) for k in ("metrics_port", "alertmanager_url", "alertmanager_resend")}
    watch |= {k: options.pop(k) for k in ("budget_interval", "runbooks")}
    if watch["metrics_port"] and watch["metrics_port"] == port:
        raise click.BadParameter("the finance API's --port", param_hint="--metrics-port")
    check_port(listen, watch["metrics_port"], "--metrics-port")
    app = api_app(redis_url, prefix, tokens_file, currency, tz, **options)
    start_budget_watch(app.state.config, listen, **watch)
    serve_forever(app, listen, port, limits)


def start_budget_watch(
    cfg: Any,
    listen: str,
    metrics_port: int,
    alertmanager_url: str | None,
    alertmanager_resend: float,
    budget_interval: float,
    runbooks: str | None,
) -> Any:
    """The budgets watched (`api/budgetwatch.py`) when a /metrics port or an Alertmanager is
    given; None otherwise. Fails closed: an Alertmanager URL or runbook page that cannot be used,
    or an Alertmanager with no budget in the policy to post."""
    from costexporter.core import budgets as budgets_mod
    from costexporter.services.notify import RUNBOOKS, check_runbooks, runbook_url

    try:
        base = check_runbooks(runbooks) if runbooks is not None else RUNBOOKS
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--runbook-url") from None
    if alertmanager_url is not None:
        if not re.fullmatch(r"https?://[^\s]+", alertmanager_url):
            raise click.BadParameter(
                f"{alertmanager_url!r} is not an http(s) URL", param_hint="--alertmanager-url"
            )
        if not cfg.budgets:
            raise click.BadParameter(
                "the policy (--policy) names no budgets: there is nothing to post",
                param_hint="--alertmanager-url",
            )
    for b in cfg.budgets:  # the log says which budgets this API judges by, from its start
        scope = " ".join(f"{k}={v}" for k, v in b.scope)
        click.echo(
            f"costexporter api: budget {b.name!r}: {b.amount:,.2f} {cfg.currency} a {b.period} for {scope}, "
            f"thresholds {', '.join(budgets_mod.threshold_label(t) for t in b.thresholds)}",
            err=True,
        )
    if not metrics_port and alertmanager_url is None:
        return None
    from costexporter.api.budgetwatch import BudgetWatch
    from costexporter.services.alertmanager import AlertSet

    post = AlertSet(alertmanager_url, resend_s=alertmanager_resend).update if alertmanager_url else None
    watch = BudgetWatch(cfg, budget_interval, post, lambda name: runbook_url(name, base)).start()
    if metrics_port:
        from prometheus_client import CollectorRegistry

        from costexporter.services.exposition import start_http_server

        registry = CollectorRegistry(auto_describe=True)
        registry.register(watch)
        start_http_server(metrics_port, addr=listen, registry=registry)
        click.echo(f"costexporter api: budgets' /metrics on {listen}:{metrics_port}", err=True)
    return watch
