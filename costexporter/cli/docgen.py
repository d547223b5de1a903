"""Writes the generated reference pages, docs/cli.md (every command and option, from the click
commands) and docs/metrics.md (every metric family and its labels, from the agent's and the
watcher's collectors), so the reference cannot drift from the code. One command regenerates
both; tests/test_docs.py fails while a page differs from what it would write:

    python -m costexporter.cli.docgen            # rewrite docs/cli.md and docs/metrics.md
    python -m costexporter.cli.docgen --check    # exit 1 naming the pages that are not current
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

REGENERATE = "python -m costexporter.cli.docgen"
DOCS = Path(__file__).resolve().parents[2] / "docs"


def _cell(text: str) -> str:
    """One Markdown table cell: no line breaks, no unescaped pipes."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _contexts(group: click.Group) -> Iterator[tuple[click.Context, click.Command]]:
    """Every command under the group, depth first in the group's order, each with the context
    `--help` would have (so defaults and environment variable names come out as it shows them)."""
    root = click.Context(group, info_name="costexporter", **(group.context_settings or {}))

    def walk(ctx: click.Context, cmd: click.Command) -> Iterator[tuple[click.Context, click.Command]]:
        yield ctx, cmd
        if isinstance(cmd, click.Group):
            for name in cmd.list_commands(ctx):
                sub = cmd.get_command(ctx, name)
                if sub is not None and not sub.hidden:
                    yield from walk(click.Context(sub, info_name=name, parent=ctx), sub)

    yield from walk(root, group)


def _option_row(ctx: click.Context, p: click.Option) -> str:
    flags = ", ".join(p.opts)
    if p.secondary_opts:
        flags += " / " + ", ".join(p.secondary_opts)
    metavar = "" if p.is_flag else p.make_metavar(ctx)
    extra: dict[str, Any] = dict(p.get_help_extra(ctx))
    default = extra.get("default", "")
    notes = [v for k, v in extra.items() if k in ("range", "required") and v]
    help_ = (p.help or "").strip()
    if notes:
        help_ = f"{help_} ({'; '.join(notes)})" if help_ else "; ".join(notes)
    env = ", ".join(f"`{e}`" for e in extra.get("envvars", ()))
    name = f"`{flags}`" + (f" `{metavar}`" if metavar else "")
    default = f"`{default}`" if default not in ("", None) else ""
    return f"| {_cell(name)} | {_cell(default)} | {env} | {_cell(help_)} |"


def render_cli(group: click.Group | None = None) -> str:
    if group is None:
        from costexporter.cli.main import main

        group = main
    out = [
        "# Command-line reference",
        "",
        "Generated from the commands themselves: after changing an option, run",
        f"`{REGENERATE}` (a test fails while this page differs from what it writes).",
        "",
        "Every option can also come from its environment variable or from the `--config` YAML file,",
        "keyed by command name (`replay: {price_per_gpu_hour: 4.1}`); flags win over the",
        "environment, which wins over the file. A key of the file that names no command or option",
        "stops the command (exit 2, naming it). Variables are `COSTEXPORTER_<COMMAND>_<OPTION>`,",
        "after the flag; `COSTEXPORTER_REDIS_URL`, `COSTEXPORTER_PREFIX`, `COSTEXPORTER_PROFILE`",
        "and `COSTEXPORTER_CONFIG` are shared by every command. Older names (after the parameter,",
        "such as `COSTEXPORTER_REPLAY_FMT`, and `COSTEXPORTER_PROFILE_DIR`) are still read, with",
        "a deprecation line on stderr.",
        "",
        "Commands:",
        "",
    ]
    entries = list(_contexts(group))
    for ctx, cmd in entries[1:]:
        path = ctx.command_path
        out.append(f"* [`{path}`](#{path.replace(' ', '-')}): {cmd.get_short_help_str(limit=120)}")
    for ctx, cmd in entries:
        path = ctx.command_path
        out += ["", f"## {path}", ""]
        if cmd.help:
            out += [click.unstyle(cmd.help).strip().replace("\b\n", ""), ""]
        pieces = cmd.collect_usage_pieces(ctx)
        out += ["```", f"{path} {' '.join(pieces)}".rstrip(), "```", ""]
        opts = [p for p in cmd.get_params(ctx) if isinstance(p, click.Option) and not p.hidden]
        args = [p for p in cmd.get_params(ctx) if isinstance(p, click.Argument)]
        for a in args:
            out.append(f"Argument `{a.make_metavar(ctx)}`{' (required)' if a.required else ''}.")
        if args:
            out.append("")
        if opts:
            out += ["| option | default | environment | meaning |", "|---|---|---|---|"]
            out += [_option_row(ctx, p) for p in opts]
        if isinstance(cmd, click.Group):
            subs = cmd.list_commands(ctx)
            out += ["", "Commands: " + ", ".join(f"`{path} {s}`" for s in subs) + "."]
    return "\n".join(out).rstrip() + "\n"


def _collectors() -> tuple[Any, Any, Any]:
    """The agent's and the watcher's collectors over a real Agent and Watcher that hold no GPU
    and no job (nothing connects to Redis until they run), and the watcher to stop after."""
    from costexporter.services.agent import Agent, AgentConfig
    from costexporter.services.exporter import AgentCollector, WatchCollector
    from costexporter.services.watcher import WatchConfig, Watcher
    from costexporter.sources.base import GpuSource, Reading

    class NoGpus(GpuSource):
        host = "node0"

        def gpus(self) -> list[Any]:
            return []

        def read(self) -> list[Reading]:
            return []

    nowhere = "redis://127.0.0.1:1/0"
    agent = Agent(NoGpus(), AgentConfig(redis_url=nowhere, agent_id="node0"))
    watcher = Watcher(WatchConfig(redis_url=nowhere))
    return AgentCollector(agent), WatchCollector(watcher), watcher


def _budget_watch() -> Any:
    """The API's budget collector over an app with no ledger to read (its families are declared
    whatever it holds)."""
    from costexporter.api.app import create_app
    from costexporter.api.budgetwatch import BudgetWatch
    from costexporter.store import redisconn
    from costexporter.store.ledger_read import LedgerStore

    app = create_app(LedgerStore(redisconn.from_url("redis://127.0.0.1:1/0"), "docgen"))
    return BudgetWatch(app.state.config)


_SUFFIX = {"counter": "_total", "histogram": ""}


def _families(collector: Any) -> list[tuple[str, str, list[str], str]]:
    """(exposed name, type, labels, help) of every family the collector yields."""
    rows = []
    for fam in collector.collect():
        labels = list(getattr(fam, "_labelnames", ()))
        if fam.type == "stateset":
            labels.append(fam.name)  # the state is a label named after the family
        rows.append((fam.name + _SUFFIX.get(fam.type, ""), fam.type, labels, fam.documentation))
    return rows


def render_metrics() -> str:
    agent, watch, watcher = _collectors()
    try:
        sections = [
            ("The agent: `costexporter serve` (and the demo), on `:9402/metrics`", _families(agent)),
            ("The watcher: `costexporter watch`, on `:9404/metrics`", _families(watch)),
            (
                "The API's budgets: `costexporter api --metrics-port` (the chart's `:9405/metrics`), one "
                "series per budget of the policy",
                _families(_budget_watch()),
            ),
        ]
    finally:
        watcher.stop()
    out = [
        "# Metrics reference",
        "",
        "Generated from the collectors: after changing a metric, run",
        f"`{REGENERATE}` (a test fails while this page differs from what it writes).",
        "",
        "Units are base units (seconds, joules, watts, ratios 0-1); money is in the unit of the",
        "`currency` label. The training job's label is `training_job`, since Prometheus keeps",
        "`job` for the scrape target.",
        "",
        "Aggregating across agents (each agent books only its own node's GPUs):",
        "",
        "* per-GPU series and the booked amounts (`costexporter_gpu_time_seconds_total`,",
        "  `costexporter_energy_joules_total`, `costexporter_cost_total`, the `voided` corrections,",
        "  GPU time at risk, cost since the last step): `sum` over agents;",
        "* job-level series (`costexporter_job_*`): every agent of the job exports the same value:",
        "  `max`, never `sum`.",
        "",
        "Cost per valid step is a ratio across agents, so it is a recording rule,",
        "`training_job:costexporter_cost_per_valid_step:ratio`:",
        "`(sum(costexporter_cost_total) - sum(costexporter_voided_cost_total)) /",
        "max(costexporter_job_valid_steps)` per job. The per-GPU series also carry dcgm-exporter's",
        "label names (`UUID`, `GPU_I_ID`, `vgpu`, `Hostname` and `hostname`, `pod`, `namespace`, `container`",
        "and their `exported_` twins), so they join with",
        "`DCGM_FI_*` series `on (UUID)`",
        "([deployment.md](deployment.md#joining-with-dcgm-exporter-the-label-mapping)).",
        "The alert and recording rules built on these series are in [dashboard.md](dashboard.md).",
        "",
        "Freshness: the per-GPU gauges (power, utilization, band) and the agent's own figures are",
        "read at each scrape; the per-job series (`training_job` label) are as of the agent's last",
        "booking round (every `--book-interval`), built and written once a round, so a scrape's",
        "time does not grow with the number of jobs. An agent exports about 58 series per job it",
        "holds, whatever the job's history: 58,000 at 1,000 jobs.",
    ]
    for title, families in sections:
        out += ["", f"## {title}", "", "| metric | type | labels | meaning |", "|---|---|---|---|"]
        for name, kind, labels, help_ in families:
            lab = ", ".join(f"`{x}`" for x in labels)
            out.append(f"| `{name}` | {kind} | {lab} | {_cell(help_)} |")
    return "\n".join(out) + "\n"


PAGES = {"cli.md": render_cli, "metrics.md": render_metrics}


def stale(docs: Path | None = None) -> list[str]:
    """The generated pages that differ from what they would be now."""
    docs = docs or DOCS
    out = []
    for name, render in PAGES.items():
        path = docs / name
        if not path.exists() or path.read_text() != render():
            out.append(f"docs/{name}")
    return out


def write(docs: Path | None = None) -> list[str]:
    docs = docs or DOCS
    written = []
    for name, render in PAGES.items():
        path = docs / name
        text = render()
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            written.append(f"docs/{name}")
    return written


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["--check"]:
        bad = stale()
        if bad:
            print(f"not current: {', '.join(bad)}; run `{REGENERATE}`", file=sys.stderr)
            return 1
        return 0
    if args:
        print(f"usage: {REGENERATE} [--check]", file=sys.stderr)
        return 2
    for name in write():
        print(f"wrote {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
