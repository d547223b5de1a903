"""Whose fault a wasted stretch was: `hardware`, `network`, `storage`, `job` or `unknown`
(docs/accounting.md, causes). Pure: the agent and replay attach a cause to each incident with
the same rule, from what was seen while the stretch lasted.

* a GPU's hardware event on one of the stretch's ranks, from a little before it opened to its
  end: an NVIDIA Xid (the catalog in `data/hardware_events.json`: a double-bit ECC error or a
  GPU off the bus is hardware, an NVLink error network, a page fault the job's own), or a
  hardware clock slowdown (HW_SLOWDOWN, hardware thermal, power brake);
* else a checkpoint that ran over its allowance while the stretch lasted: storage;
* else the trainer's crash record (its reporter's `run` event of state `crash`) near the
  stretch: the job's own;
* else `unknown`: nothing said otherwise, and a cause is never guessed.

The first event that points to a cause wins; a cause once found stays with the stretch.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

CAUSES = ("hardware", "network", "storage", "job", "unknown")
UNKNOWN = "unknown"
# An event this long before a stretch opened still counts for it: a GPU that fell off the bus
# stops the collective a few seconds later, and the stall opens after the stall threshold.
LEAD_MS = 120_000
KINDS = ("xid", "throttle")


# NVML's clocks event reasons that point to the hardware (nvmlClocksEventReasonHwSlowdown,
# HwThermalSlowdown, HwPowerBrakeSlowdown): the table's throttle bits. Not the software thermal
# slowdown: a busy GPU at its temperature target reads it in normal work.
HARDWARE_SLOWDOWN = 0x8 | 0x40 | 0x80


@dataclass(frozen=True, slots=True)
class HardwareEvent:
    """One hardware event of one GPU: an Xid (`code` its number) or the clocks' event reasons
    (`code` the bitmask, as NVML and DCGM give it)."""

    ts_ms: int
    gpu: int  # the source's GPU index (the agent maps it to the job's rank)
    kind: str  # xid | throttle
    code: int


def slowdown(ts_ms: int, gpu: int, last_bits: int, reasons: int) -> tuple[int, HardwareEvent | None]:
    """A GPU's clocks event reasons as read now, against the hardware bits read last: (the bits
    now, the event where a hardware slowdown began, else None). A slowdown that lasts is one
    event, at its start; the NVML and dcgm sources share this rule."""
    bits = reasons & HARDWARE_SLOWDOWN
    return bits, HardwareEvent(ts_ms, gpu, "throttle", bits) if bits & ~last_bits else None


@cache
def _table() -> dict[str, dict[int, tuple[str, str]]]:
    doc = json.loads(resources.files("costexporter.core").joinpath("data/hardware_events.json").read_text())
    return {kind: {int(k): (v[0], v[1]) for k, v in doc[kind].items()} for kind in KINDS}


def what(ev: HardwareEvent) -> tuple[str, str] | None:
    """(cause, what it says) of one event, or None where it points to no cause (an Xid not in
    the catalog, a power cap, an idle GPU's clocks)."""
    table = _table()
    if ev.kind == "xid":
        hit = table["xid"].get(ev.code)
        return None if hit is None else (hit[0], f"Xid {ev.code}: {hit[1]}")
    if ev.kind == "throttle":
        for bit, (cause, text) in sorted(table["throttle"].items()):
            if ev.code & bit:
                return cause, f"clocks event reason {text}"
    return None


def cause_of(
    inc: dict[str, Any],
    events: Iterable[tuple[int, HardwareEvent]],
    overruns: Sequence[tuple[str, int, int]] = (),
    crashes: Sequence[tuple[int, str]] = (),
    lead_ms: int = LEAD_MS,
) -> tuple[str, str]:
    """(cause, why) of an incident (`start`, `end` in ms, `ranks`): `events` as (job rank,
    event); `overruns` the timeline's phases that ran over their allowance (name, start, end);
    `crashes` the trainer's crash records (ms, how it ended)."""
    start, end, ranks = int(inc["start"]), int(inc["end"]), set(inc.get("ranks") or ())
    hits = sorted(
        ((ev.ts_ms, rank, ev) for rank, ev in events if rank in ranks and start - lead_ms <= ev.ts_ms <= end),
        key=lambda h: (h[0], h[1]),  # in time, then by rank; as read where both tie
    )
    for _ts, rank, ev in hits:
        said = what(ev)
        if said is not None:
            return said[0], f"{said[1]} on rank {rank}"
    for name, a, b in overruns:
        if name == "checkpoint" and a < end and b > start:
            return "storage", "a checkpoint ran over its allowance"
    for t, how in crashes:
        if start - lead_ms <= t <= end + lead_ms:
            return "job", f"the trainer's crash record ({how})" if how else "the trainer's crash record"
    return UNKNOWN, ""


def attach(
    incidents: dict[str, dict[str, Any]],
    events: Sequence[tuple[int, HardwareEvent]],
    overruns: Sequence[tuple[str, int, int]] = (),
    crashes: Sequence[tuple[int, str]] = (),
) -> dict[str, dict[str, Any]]:
    """Each open incident with its cause (`cause`, `cause_why`); one that has a cause keeps it."""
    out = {}
    for k, inc in incidents.items():
        if inc.get("cause", UNKNOWN) != UNKNOWN:
            out[k] = inc
            continue
        cause, why = cause_of(inc, events, overruns, crashes)
        out[k] = {**inc, "cause": cause, "cause_why": why}
    return out


def window_totals(
    incidents: Iterable[dict[str, Any]], start_s: float, end_s: float
) -> dict[str, list[float]]:
    """cause -> [GPU-ms, micro-cost] of the incidents (the reader's: `start`, `end` in s,
    `gpu_ms`, `cost_micro` or None where it was not kept, `cause`) inside [start_s, end_s): each
    incident's part inside, in proportion to its time."""
    out: dict[str, list[float]] = {}
    for i in incidents:
        span = i["end"] - i["start"]
        inside = min(i["end"], end_s) - max(i["start"], start_s)
        f = (1.0 if inside >= 0 else 0.0) if span <= 0 else max(inside, 0.0) / span
        tot = out.setdefault(i["cause"], [0.0, 0.0])
        tot[0] += f * i["gpu_ms"]
        tot[1] += f * (i["cost_micro"] or 0)
    return out


def credited(totals: dict[str, list[float]], credit_causes: Iterable[str]) -> tuple[float, int]:
    """(GPU-ms, micro-cost) of the credited causes' totals."""
    picked = [totals[c] for c in credit_causes if c in totals]
    return sum(t[0] for t in picked), round(sum(t[1] for t in picked))
