"""Energy between two reads of a costly energy counter, shared out by integrated power.

NVML's energy counter costs ~3.9 ms of CPU per call on an H200, so it is read at anchors only
(once per booking round), not with every sample. The samples between two anchors get the
counter's delta shared out in proportion to each sample's integrated power: booked energy
between two anchors is then exactly the counter's delta (no drift, nothing lost), each sample's
figure is monotone, and the shape within the interval follows the power samples.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Anchor:
    """A real counter read: Unix seconds, mJ, and the power (W) in force at that time."""

    ts: float
    mj: float
    power_w: float = math.nan


def share(prev: Anchor, ts: Sequence[float], power_w: Sequence[float], nxt: Anchor) -> list[float]:
    """The counter value at each sample time in (prev.ts, nxt.ts], time-ordered.

    Power is piecewise constant: a sample's power holds until the next sample (as the booker
    integrates it); before the first sample the power in force at `prev` holds. Where no power
    is known the delta is shared out by time. Values stay within [prev.mj, nxt.mj], monotone.
    """
    n = len(ts)
    if n == 0:
        return []
    delta = nxt.mj - prev.mj
    edges = [prev.ts, *(min(max(t, prev.ts), nxt.ts) for t in ts), nxt.ts]
    for i in range(1, len(edges)):  # a clock step backwards must not make a segment negative
        edges[i] = max(edges[i], edges[i - 1])
    first_p = prev.power_w if _ok(prev.power_w) else power_w[0]
    powers = [first_p, *power_w]
    w = [_w(powers[i]) * (edges[i + 1] - edges[i]) for i in range(n + 1)]
    total = sum(w)
    if total <= 0:  # no power known: by time
        w = [edges[i + 1] - edges[i] for i in range(n + 1)]
        total = sum(w)
    out, acc = [], 0.0
    for i in range(n):
        acc += w[i]
        frac = acc / total if total > 0 else 1.0
        out.append(prev.mj + delta * min(frac, 1.0))
    return out


def _ok(p: float) -> bool:
    return p == p and p >= 0


def _w(p: float) -> float:
    return p if _ok(p) else 0.0
