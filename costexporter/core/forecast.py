"""What a job will cost to finish, from its own recent cost per valid step and the steps it has
left (docs/accounting.md, "Cost to finish").

The rate is the job's whole cost (every category: its stalls, checkpoints and waits included, as
they recur) over its valid steps in the recent window, the last `WINDOW_S` of 5-minute buckets up
to its newest; the steps left are the trainer's `total_steps` (meta: data) minus its newest
step. The interval is the lowest and highest rate of the window's parts (`PARTS` of it, those
with a valid step): how much the recent rate moved, not a guess at stalls to come. The API and
replay both call `cost_to_finish` on the same 5-minute buckets.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

WINDOW_S = 3600  # the recent window: an hour of the job's buckets
PARTS = 6  # the window's parts for the interval (10 minutes each)
MIN_PARTS = 3  # an interval needs at least this many parts with a valid step
MAX_STEPS = 10**12  # a total_steps beyond this is not a step count


@dataclass(frozen=True, slots=True)
class Forecast:
    """A job's cost to finish (money in the ledger's currency; None: not computed, `notes` say
    why). `cost_at_finish` is what is spent plus the estimate: never below what is spent."""

    total_steps: int | None = None
    steps_left: int | None = None
    recent_cost_per_valid_step: float | None = None
    cost_to_finish: float | None = None
    low: float | None = None
    high: float | None = None
    cost_at_finish: float | None = None
    notes: list[str] = field(default_factory=list)

    def report(self) -> dict[str, Any]:
        return {
            "total_steps": self.total_steps,
            "steps_left": self.steps_left,
            "recent_cost_per_valid_step": self.recent_cost_per_valid_step,
            "cost_to_finish": self.cost_to_finish,
            "low": self.low,
            "high": self.high,
            "cost_at_finish": self.cost_at_finish,
            "notes": list(self.notes),
        }


def total_steps_of(meta: dict[str, Any]) -> int | None:
    """The trainer's `total_steps` (meta), where it is a whole number of steps; else None."""
    x = meta.get("total_steps")
    if isinstance(x, bool) or x is None:
        return None
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    if not (0 < f <= MAX_STEPS) or f != int(f):
        return None
    return int(f)


def cost_to_finish(
    buckets: Iterable[tuple[int, float, int]], spent: float, last_step: int, total_steps: int | None
) -> Forecast:
    """From the job's 5-minute buckets (start s, cost, valid steps completed in it), what it has
    spent, its newest step and the trainer's total steps."""
    if total_steps is None:
        return Forecast(notes=["the trainer posts no total_steps (meta): the steps left are unknown"])
    left = max(total_steps - max(last_step, 0), 0)
    if left == 0:
        return Forecast(total_steps, 0, None, 0.0, 0.0, 0.0, spent, ["no steps left"])
    rows = sorted(buckets)
    if not rows:
        return Forecast(total_steps, left, notes=["nothing booked yet: no rate"])
    newest = rows[-1][0]
    recent = [r for r in rows if r[0] > newest - WINDOW_S]
    cost = sum(c for _, c, _ in recent)
    steps = sum(n for _, _, n in recent)
    if steps <= 0:
        return Forecast(
            total_steps, left, notes=[f"no valid step in the last {WINDOW_S // 60} minutes: no rate"]
        )
    rate = cost / steps
    est = max(rate * left, 0.0)
    span = max(WINDOW_S // PARTS, 1)
    parts: dict[int, list[float]] = {}
    for t, c, n in recent:
        acc = parts.setdefault((newest - t) // span, [0.0, 0.0])
        acc[0] += c
        acc[1] += n
    rates = [c / n for c, n in parts.values() if n > 0]
    notes = []
    low = high = None
    if len(rates) >= MIN_PARTS:
        low, high = max(min(rates) * left, 0.0), max(max(rates) * left, 0.0)
    else:
        notes.append(f"fewer than {MIN_PARTS} parts of the window with a valid step: no interval")
    return Forecast(total_steps, left, rate, est, low, high, spent + est, notes)
