"""`costexporter dashboard` and `costexporter rules`: the Grafana dashboard and the Prometheus rules."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click


@click.command()
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None)
def dashboard(output: Path | None) -> None:
    """Print (or write) the Grafana dashboard JSON."""
    from costexporter.tools.dashboard import render

    text = render()
    if output:
        output.write_text(text)
    else:
        click.echo(text, nl=False)


@click.command()
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
@click.option(
    "--runbook-url",
    "runbooks",
    default=None,
    metavar="URL",
    help="The alerts page each alert's runbook_url links (URL#<alert name in lower case>), "
    "e.g. your own copy of docs/alerts.md; default: the project's.",
)
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None)
def rules(
    short: bool,
    speed: float | None,
    overrides: tuple[str, ...],
    fmt: str,
    name: str,
    runbooks: str | None,
    output: Path | None,
) -> None:
    """Print (or write) the Prometheus alert and recording rules."""
    import dataclasses

    from costexporter.services.notify import RUNBOOKS, check_runbooks
    from costexporter.tools.rules import RuleWindows, for_speed, render, render_prometheus_rule

    try:
        runbooks = check_runbooks(runbooks) if runbooks is not None else RUNBOOKS
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--runbook-url") from None

    w = RuleWindows.short() if short else RuleWindows()
    if speed:
        w = for_speed(w, speed)
    known = {f.name: f.type for f in dataclasses.fields(RuleWindows)}
    kw: dict[str, Any] = {}  # each value of its field's type, checked here
    for o in overrides:
        key, sep, value = o.partition("=")  # not `name`: that is the PrometheusRule's --name
        if not sep or key not in known:
            raise click.BadParameter(f"{o!r}: expected NAME=VALUE with NAME one of {', '.join(known)}")
        try:
            if known[key] in (float, "float"):
                kw[key] = float(value)
            elif str(known[key]).startswith("tuple"):  # shares, comma-separated: budget_burn=0.5,0.8
                kw[key] = tuple(float(x) for x in value.split(","))
                if not all(0 < x < 1 for x in kw[key]):
                    raise click.BadParameter(f"{o!r}: {key} takes shares between 0 and 1")
            else:
                kw[key] = value
        except ValueError:
            raise click.BadParameter(f"{o!r}: {key} takes a number") from None
    w = dataclasses.replace(w, **kw)
    text = render(w, runbooks) if fmt == "rules" else render_prometheus_rule(w, name, runbooks=runbooks)
    if output:
        output.write_text(text)
    else:
        click.echo(text, nl=False)
