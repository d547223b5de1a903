"""What the commands show people: rich tables for calibrate and preflight, the demo's live view
or its plain status lines. Machine output (JSON, CSV) is written by the commands themselves.
rich is imported where it is used: every command's start-up would pay for it."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    import threading
    from pathlib import Path

    from costexporter.tools.calibrate import Fit
    from costexporter.tools.demo import Demo


def calibration(result: Fit, out: Path) -> None:
    """The fitted bands, the profile's edges, the held-out confusion table and the warnings."""
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


def preflight_table(job: str, passed: bool, checks: list[Any], elapsed: float) -> None:
    """One row per check, coloured by its status, titled with the verdict."""
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


def demo_loop(d: Demo, plain: bool, stop: threading.Event) -> None:
    """Status to stderr until the story ends (or is stopped, or its Redis is lost): a live view on a
    terminal, else a line every 5 s."""
    from costexporter.tools.demo import plain_line, render_view

    if plain or not sys.stderr.isatty():
        last = 0.0
        while not d.finished and not d.failure() and not stop.wait(0.5):
            if time.monotonic() - last >= 5:
                last = time.monotonic()
                click.echo(plain_line(d.state()), err=True)
        click.echo(plain_line(d.state()), err=True)
        return
    from rich.console import Console
    from rich.live import Live

    with Live(render_view(d.state()), refresh_per_second=4, console=Console(stderr=True)) as live:
        while not d.finished and not d.failure() and not stop.wait(0.25):
            live.update(render_view(d.state()))
        live.update(render_view(d.state()))


def demo_bill(bill: dict[str, Any]) -> None:
    """The demo's closing bill as a table (`--json` prints the same dict as JSON instead)."""
    from rich.console import Console

    from costexporter.tools.demo import render_bill

    Console().print(render_bill(bill))
