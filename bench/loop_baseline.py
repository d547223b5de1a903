"""A straightforward per-sample Python loop doing the core's work, for the benchmark to beat.

The same rules as the vectorized core (bands, the cross-rank signatures, slices, booking by the
timeline), written the obvious way: dictionaries and a loop over samples. The benchmark runs
both on the same samples in one process and checks that they agree on the totals.
"""

from __future__ import annotations

import bisect
from collections import defaultdict

from costexporter.core.booking import BookingConfig, build_timeline
from costexporter.core.model import Band, Category, Event, Samples
from costexporter.core.profiles import Profile

try:  # the band table's booking (bench_replay --baseline runs this file against older trees too)
    from costexporter.core import bandtable
    from costexporter.core.booking import category_table

    CATEGORY_TABLE = category_table(bandtable.current())
except ImportError:  # a release before the band table
    from costexporter.core.booking import CATEGORY_TABLE  # type: ignore[attr-defined,no-redef]


def book_loop(samples: Samples, events: list[Event], profile: Profile, cfg: BookingConfig) -> dict:
    """Category -> GPU-seconds for one implicit or registered job holding every GPU."""
    ts_all = samples.ts_ms.tolist()
    gpu_all = samples.gpu.tolist()
    pw_all = samples.power_w.tolist()
    ut_all = samples.util_pct.tolist()
    n = len(ts_all)
    # Sampling interval: median spacing of one GPU's samples.
    diffs = sorted(
        ts_all[i + 1] - ts_all[i] for i in range(min(n - 1, 100_000)) if gpu_all[i + 1] == gpu_all[i]
    )
    interval = diffs[len(diffs) // 2] if diffs else 1000
    grid = max(int(cfg.grid_s * 1000), interval)
    t0 = min(ts_all)

    # Per moment: each rank's shape.
    moments: dict[int, list[tuple[int, float, float]]] = defaultdict(list)
    for i in range(n):
        tick = (ts_all[i] - t0 + grid // 2) // grid
        moments[tick].append((gpu_all[i], pw_all[i], ut_all[i]))

    def shape(p: float, u: float) -> str:
        if p >= profile.compute_min_w:
            return "high"
        if p < profile.low_max_w:
            return "low"
        return "mid"

    signature: dict[int, str] = {}
    starving: set[int] = set()
    for tick, rows in moments.items():
        shapes = [(shape(p, u), u) for _, p, u in rows]
        n_obs = len(shapes)
        low = [u for s, u in shapes if s == "low"]
        if n_obs >= 2 and len(low) == n_obs:
            zero = sum(1 for u in low if u <= profile.zero_util_pct)
            busy = sum(1 for u in low if u >= profile.busy_util_pct)
            if zero >= 1 and busy * 2 >= n_obs:
                rank0_zero = any(g == 0 and u <= profile.zero_util_pct for g, _, u in rows)
                signature[tick] = "ckpt" if rank0_zero else "dead"
        mids = [u for s, u in shapes if s == "mid"]
        if n_obs >= 2 and len(mids) * 2 >= n_obs and any(u < profile.busy_util_pct for u in mids):
            starving.add(tick)
    # Two consecutive moments confirm a signature; a checkpoint past its allowance is a deadlock.
    confirmed: dict[int, int] = {}
    run_start = None
    for tick in sorted(signature):
        if run_start is None or tick - 1 not in signature:
            run_start = tick
        if tick + 1 in signature or tick - 1 in signature:
            confirmed[tick] = run_start
    allowance = cfg.checkpoint_allowance_s * 1000

    tl = build_timeline(events, cfg, t0, max(ts_all) + interval)
    bounds = tl.bounds.tolist()
    regime = tl.regime.tolist()
    out: dict[int, int] = defaultdict(int)
    for i in range(n):
        g, t, p, u = gpu_all[i], ts_all[i], pw_all[i], ut_all[i]
        tick = (t - t0 + grid // 2) // grid
        s = shape(p, u)
        if s == "high":
            band = Band.COMPUTE
        elif s == "mid":
            band = Band.STARVATION if (tick in starving or u < profile.busy_util_pct) else Band.COMMUNICATION
        elif u <= profile.zero_util_pct or (p <= profile.idle_max_w and u < profile.busy_util_pct):
            band = Band.IDLE
        else:
            band = Band.UNKNOWN
        if tick in confirmed:
            kind = signature[tick]
            elapsed = (tick - confirmed[tick]) * grid
            band = Band.CHECKPOINT if kind == "ckpt" and elapsed < allowance else Band.DEADLOCK
        last = i + 1 == n or gpu_all[i + 1] != g
        end = t + interval if last else ts_all[i + 1]
        if end - t > cfg.gap_intervals * interval:
            out[Category.UNOBSERVED] += end - t - interval
            end = t + interval
        seg = bisect.bisect_right(bounds, t) - 1
        out[int(CATEGORY_TABLE[regime[seg], band + 1])] += end - t
    return {Category(c).name.lower(): ms / 1000 for c, ms in out.items()}
