"""The naive utilization rule of R7 (docs/background.md: the team's earlier exporter), for comparison.

It counts a GPU-second as useful when utilization is above 60%, so a deadlock where every rank
but one spins at 100% reads as useful work (R1). The demo and the tests show its bill
next to costexporter's.
"""

from __future__ import annotations

import numpy as np

from costexporter.core.cost import MS_PER_HOUR
from costexporter.core.model import Samples


def utilization_rule(
    samples: Samples, threshold_pct: float = 60.0, interval_ms: int | None = None
) -> dict[str, float]:
    """GPU-hours the utilization rule counts as useful and as not useful.

    Each sample stands for the time until the next sample of its GPU (the last one for one
    interval), matching how costexporter cuts slices.
    """
    if len(samples) == 0:
        return {"useful_gpu_hours": 0.0, "not_useful_gpu_hours": 0.0}
    ts, gpu = samples.ts_ms, samples.gpu
    same = gpu[1:] == gpu[:-1]
    if interval_ms is None:
        d = np.diff(ts)[same]
        interval_ms = int(np.median(d)) if d.size else 1000
    dur = np.full(ts.size, interval_ms, np.int64)
    dur[:-1] = np.where(same, np.minimum(np.diff(ts), 3 * interval_ms), interval_ms)
    useful = samples.util_pct > threshold_pct
    return {
        "useful_gpu_hours": float(dur[useful].sum() / MS_PER_HOUR),
        "not_useful_gpu_hours": float(dur[~useful].sum() / MS_PER_HOUR),
    }
