"""`costexporter calibrate`: fit a GPU model's band profile from a team's own baselines.

REFERENCE R2: the B300 wattages do not carry over to other GPUs, the shapes do; record a
known-healthy run and a known hang and classify against them. The fit works on power levels:

1. Label what is known: explicit windows (`START..END=BAND`); from events, time inside
   completed steps is healthy (compute, communication or starvation) and completed declared
   checkpoints are the low "waiters" level (checkpoint/deadlock).
2. Find the power levels of all samples (a histogram split at empty stretches), and name each:
   explicit labels win; a level at ~0% utilization is idle; a level with checkpoint examples, or
   busy and below every healthy level, is the low level (deadlock/checkpoint waiters); among the
   healthy levels the highest is compute and the others are starvation where utilization is
   uneven across ranks at a moment (a rank well below the rest), else communication.
3. Edges sit between neighbouring levels; the utilization rules between the straggler's
   utilization and the busy ranks'.

Every 4th minute of the baselines is held out: the fit never sees it, and the fitted profile
classifies it (the real classifier, `bands.classify`) for the confusion matrix. Pure: no Redis.
"""

from __future__ import annotations

import datetime as dt
import itertools
from dataclasses import dataclass, field, replace

import numpy as np

from . import bands as bands_mod
from .model import Band, Event, Samples
from .profiles import KNOWN_POWER_LIMITS_W, Profile, _model_key, derive
from .replay import register_matches

LEVELS = ("compute", "communication", "starvation", "low", "idle")
# The classifier's bands, seen at the level of power: deadlock and checkpoint are both "low".
BAND_LEVEL = {
    Band.COMPUTE: "compute",
    Band.COMMUNICATION: "communication",
    Band.STARVATION: "starvation",
    Band.CHECKPOINT: "low",
    Band.DEADLOCK: "low",
    Band.IDLE: "idle",
    Band.UNKNOWN: "unknown",
}
LABEL_NAMES = {
    "compute": "compute",
    "communication": "communication",
    "starvation": "starvation",
    "checkpoint": "low",
    "deadlock": "low",
    "low": "low",
    "idle": "idle",
}
HEALTHY, CHECKPOINT = "healthy", "low"
HOLD_OUT_EVERY = 4  # every 4th minute is held out
MIN_LEVEL_SHARE = 0.002  # a level needs at least this share of the samples


class CalibrationError(ValueError):
    """Baselines a profile cannot be fitted from."""


@dataclass
class Level:
    name: str
    centre: float
    lo: float  # 1st percentile of power
    hi: float  # 99th percentile
    samples: int
    util_median: float


@dataclass
class Fit:
    profile: Profile
    levels: dict[str, Level]
    confusion: dict[str, dict[str, float]]  # truth level -> predicted level -> GPU-seconds
    accuracy: float | None
    warnings: list[str] = field(default_factory=list)
    defaulted: list[str] = field(default_factory=list)


def parse_label(spec: str, parse_time) -> tuple[int, int, str]:
    """'START..END=BAND' -> (start_ms, end_ms, level)."""
    span, sep, band = spec.rpartition("=")
    start, dots, end = span.partition("..")
    if not sep or not dots or band.lower() not in LABEL_NAMES:
        raise CalibrationError(
            f"label {spec!r}: expected START..END=BAND with BAND one of {', '.join(sorted(LABEL_NAMES))}"
        )
    a, b = parse_time(start), parse_time(end)
    if b <= a:
        raise CalibrationError(f"label {spec!r}: the window is empty")
    return a, b, LABEL_NAMES[band.lower()]


def _ranks(samples: Samples, events: list[Event]) -> np.ndarray:
    """Rank of each GPU of `samples` from the register events, matched as replay matches them
    (UUID, else host + index); a GPU no rank registered keeps its index."""
    out = np.arange(len(samples.gpus))
    for ranks in register_matches(samples, events)[1].values():
        for rank, (g, _) in ranks.items():
            if g < out.size:
                out[g] = rank
    return out


def event_labels(events: list[Event], n: int, ts_ms: np.ndarray) -> np.ndarray:
    """Per sample: 'healthy' inside completed steps (outside phases), 'low' inside completed
    checkpoint phases, '' elsewhere."""
    lab = np.full(n, "", dtype=object)
    evs = sorted((e for e in events if e.rank == 0), key=lambda e: e.ts)
    phases: list[tuple[int, int]] = []
    open_: dict[str, int] = {}
    for e in events:
        if e.type == "phase":
            t = int(e.ts * 1000)
            name = str(e.get("name"))
            if e.get("state") == "begin":
                open_[name] = t
            elif name in open_:
                b = open_.pop(name)
                if name == "checkpoint" and e.rank == 0:
                    lab[(ts_ms >= b) & (ts_ms < t)] = CHECKPOINT
                phases.append((b, t))
    prev = None
    for e in evs:
        t = int(e.ts * 1000)
        if e.type == "step":
            if prev is not None:
                lab[(ts_ms >= prev) & (ts_ms < t) & (lab == "")] = HEALTHY
            prev = t
        elif e.type == "run":
            prev = None  # the interval after a (re)start is startup, not a step
    for b, t in phases:  # time inside any declared phase is not a step's
        inside = (ts_ms >= b) & (ts_ms < t) & (lab == HEALTHY)
        lab[inside] = ""
    return lab


def _levels(power: np.ndarray, limit: float) -> list[np.ndarray]:
    """Split the samples into power levels at empty stretches of the histogram; indexes per level."""
    finite = np.isfinite(power)
    width = max(limit / 200.0, 2.0)
    lo = float(np.nanmin(power[finite]))
    bins = np.full(power.size, -1, np.int64)
    bins[finite] = ((power[finite] - lo) // width).astype(np.int64)
    counts = np.bincount(bins[finite])
    floor = max(1, int(MIN_LEVEL_SHARE * finite.sum() / 20))
    occupied = counts >= floor
    # Runs of occupied bins are levels; a gap of one empty bin still splits.
    run_id = np.cumsum(np.concatenate([[True], occupied[1:] & ~occupied[:-1]])) - 1
    out = []
    for r in np.unique(run_id[occupied]):
        members = np.flatnonzero(occupied & (run_id == r))
        idx = np.flatnonzero(finite & np.isin(bins, members))
        if idx.size >= MIN_LEVEL_SHARE * finite.sum():
            out.append(idx)
    return out


def fit(
    samples: Samples,
    events: list[Event] | None = None,
    labels: list[tuple[int, int, str]] | None = None,
    *,
    gpu_model: str | None = None,
    power_limit_w: float | None = None,
    grid_ms: int = 1000,
    sources: list[str] | None = None,
) -> Fit:
    events = events or []
    labels = labels or []
    if len(samples) < 100:
        raise CalibrationError(f"{len(samples)} samples: too few to fit a profile from")
    meta_model = next(
        (str(e.get("gpu_model")) for e in events if e.type == "meta" and e.get("gpu_model")), None
    )
    model = gpu_model or next((g.name for g in samples.gpus if g.name), None) or meta_model
    if not model:
        raise CalibrationError(
            "the baselines do not name the GPU model (no name column, no meta event): give --gpu-model"
        )
    key = _model_key(model)
    limit = power_limit_w or next((g.power_limit_w for g in samples.gpus if g.power_limit_w), None)
    limit = (
        limit or (KNOWN_POWER_LIMITS_W.get(key) if key else None) or float(np.nanmax(samples.power_w)) * 1.1
    )

    ts, power, util = samples.ts_ms, samples.power_w, samples.util_pct
    rank = _ranks(samples, events)[samples.gpu]
    lab = event_labels(events, len(samples), ts) if events else np.full(len(samples), "", dtype=object)
    for a, b, level in labels:
        lab[(ts >= a) & (ts < b)] = level
    held = ((ts // 60_000) % HOLD_OUT_EVERY) == HOLD_OUT_EVERY - 1
    train = ~held & np.isfinite(power) & np.isfinite(util)

    levels = _levels(np.where(train, power, np.nan), limit)
    if not levels:
        raise CalibrationError("no power levels found in the baselines")
    named = _name_levels(levels, power, util, lab, rank, ts, grid_ms)
    warnings, defaulted = [], []
    prof = _profile(named, limit, model, warnings, defaulted)
    _overlaps(named, limit, warnings)
    confusion, acc = _confusion(samples, rank, held, named, prof, grid_ms)
    prof = replace(
        prof,
        centres={k: round(v.centre, 1) for k, v in named.items()},
        provenance={
            "fitted_from": sources or [],
            "fitted_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "samples": int(train.sum()),
            "held_out": int(held.sum()),
            "labels": [f"{a}..{b}={lv}" for a, b, lv in labels],
            "events": len(events),
            "defaulted": defaulted,
            "held_out_accuracy": None if acc is None else round(acc, 4),
        },
    )
    return Fit(prof, named, confusion, acc, warnings, defaulted)


def _name_levels(
    levels: list[np.ndarray],
    power: np.ndarray,
    util: np.ndarray,
    lab: np.ndarray,
    rank: np.ndarray,
    ts: np.ndarray,
    grid_ms: int,
) -> dict[str, Level]:
    info = []
    for idx in levels:
        labs = lab[idx]
        explicit = [x for x in labs if x and x not in (HEALTHY,)]
        votes = {k: explicit.count(k) for k in set(explicit)}
        healthy = float(np.mean(labs == HEALTHY))
        info.append(
            {
                "idx": idx,
                "centre": float(np.median(power[idx])),
                "util": float(np.median(util[idx])),
                "vote": max(votes, key=votes.get) if votes and max(votes.values()) > 0.2 * idx.size else None,
                "healthy": healthy,
            }
        )
    names: dict[int, str] = {}
    for i, x in enumerate(info):
        # A checkpoint vote on a level that is mostly inside steps is a label at its edges.
        if x["vote"] in LEVELS and (x["vote"] != CHECKPOINT or x["healthy"] < 0.5):
            names[i] = x["vote"]
    for i, x in enumerate(info):
        if i in names:
            continue
        if x["util"] <= 10.0:
            names[i] = "idle"
    healthy_levels = [i for i, x in enumerate(info) if i not in names and x["healthy"] >= 0.3]
    lowest_healthy = min((info[i]["centre"] for i in healthy_levels), default=np.inf)
    for i, x in enumerate(info):
        if i not in names and i not in healthy_levels and x["centre"] < lowest_healthy:
            names[i] = "low"  # busy, below every healthy level: the waiters of a hang or a checkpoint
    if healthy_levels:
        top = max(healthy_levels, key=lambda i: info[i]["centre"])
        names[top] = "compute"
        for i in healthy_levels:
            if i != top:
                names[i] = (
                    "starvation" if _uneven(info[i]["idx"], util, rank, ts, grid_ms) else "communication"
                )
    # Unnamed leftovers (busy levels between healthy ones, unlabelled): nearest named level.
    for i, x in enumerate(info):
        if i not in names and names:
            j = min(names, key=lambda k: abs(info[k]["centre"] - x["centre"]))
            names[i] = names[j]
    out: dict[str, Level] = {}
    for name in LEVELS:
        members = [info[i]["idx"] for i, n in names.items() if n == name]
        if not members:
            continue
        idx = np.concatenate(members)
        p = power[idx]
        out[name] = Level(
            name,
            float(np.median(p)),
            float(np.percentile(p, 1)),
            float(np.percentile(p, 99)),
            int(idx.size),
            float(np.median(util[idx])),
        )
    return out


def _uneven(idx: np.ndarray, util: np.ndarray, rank: np.ndarray, ts: np.ndarray, grid_ms: int) -> bool:
    """Starvation's shape: at most moments some rank sits well below the others."""
    moment = ts[idx] // grid_ms
    order = np.argsort(moment, kind="stable")
    m, u = moment[order], util[idx][order]
    starts = np.flatnonzero(np.concatenate([[True], m[1:] != m[:-1]]))
    lo = np.minimum.reduceat(u, starts)
    hi = np.maximum.reduceat(u, starts)
    return bool(np.mean(hi - lo > 20.0) > 0.5)


def _profile(
    lv: dict[str, Level], limit: float, name: str, warnings: list[str], defaulted: list[str]
) -> Profile:
    d = derive(limit, name=name)
    if "compute" not in lv:
        raise CalibrationError("no healthy compute level: give a known-healthy run (events or a label)")
    compute = lv["compute"]
    mids = [lv[k] for k in ("communication", "starvation") if k in lv]
    low, idle = lv.get("low"), lv.get("idle")
    if low is None:
        defaulted.append("low_max_w")
        warnings.append(
            "no deadlock/checkpoint baseline (a known hang or a declared checkpoint): the edge is derived"
        )
    if idle is None:
        defaulted.append("idle_max_w")
    below_compute = max((m.hi for m in mids), default=None)
    if below_compute is not None:
        compute_min = (below_compute + compute.lo) / 2
    else:
        floor = low.hi if low else (idle.hi if idle else d.low_max_w)
        compute_min = compute.lo - 0.1 * (compute.lo - floor)
    if low is not None:
        above_low = min((m.lo for m in mids), default=None)
        low_max = (low.hi + above_low) / 2 if above_low is not None else low.hi + 0.25 * (compute.lo - low.hi)
    else:
        low_max = min(d.low_max_w, compute_min * 0.9)
    if idle is not None and low is not None:
        idle_max = (idle.hi + low.lo) / 2
    elif idle is not None:
        idle_max = idle.hi + 0.25 * (low_max - idle.hi)
    else:
        idle_max = min(d.idle_max_w, (low.lo if low else low_max) * 0.9)
    busy = d.busy_util_pct
    if "starvation" in lv:
        busy = 85.0  # R2: the straggler sits at 55-65%, busy ranks at ~100%
    zero = d.zero_util_pct
    idle_max, low_max = min(idle_max, low_max), min(low_max, compute_min)
    return Profile(
        name=name,
        calibrated=True,
        idle_max_w=round(idle_max, 1),
        low_max_w=round(low_max, 1),
        compute_min_w=round(compute_min, 1),
        busy_util_pct=busy,
        zero_util_pct=zero,
        power_limit_w=limit,
        gpu_model=name,
    )


def _overlaps(lv: dict[str, Level], limit: float, warnings: list[str]) -> None:
    items = sorted(lv.values(), key=lambda x: x.centre)
    for a, b in itertools.pairwise(items):
        gap = b.centre - a.centre
        if a.hi >= b.lo:
            warnings.append(
                f"{a.name} (~{a.centre:.0f} W) and {b.name} (~{b.centre:.0f} W) overlap in power: "
                "the utilization pattern must decide"
            )
        elif gap < 0.1 * limit:
            warnings.append(
                f"{a.name} (~{a.centre:.0f} W) and {b.name} (~{b.centre:.0f} W) are only {gap:.0f} W apart: "
                "the utilization pattern must decide"
            )


def _confusion(
    samples: Samples, rank: np.ndarray, held: np.ndarray, lv: dict[str, Level], prof: Profile, grid_ms: int
) -> tuple[dict[str, dict[str, float]], float | None]:
    """Classify the baselines with the fitted profile; on the held-out part, compare each sample's
    predicted level with the level its power was fitted into."""
    order = np.lexsort((samples.ts_ms, rank))
    r, t = rank[order], samples.ts_ms[order]
    p, u = samples.power_w[order], samples.util_pct[order]
    res = bands_mod.classify(r, t, p, u, int(rank.max()) + 1, prof, grid_ms=grid_ms)
    pred = np.asarray([BAND_LEVEL[Band(b)] for b in res.band])
    # Truth: the nearest level by power, within its range.
    names = list(lv)
    centres = np.asarray([lv[n].centre for n in names])
    truth = np.asarray(names)[np.argmin(np.abs(p[:, None] - centres[None, :]), axis=1)]
    h = held[order] & np.isfinite(p)
    if not h.any():
        return {}, None
    dt_s = res.interval_ms / 1000
    conf: dict[str, dict[str, float]] = {}
    for tr, pr in zip(truth[h], pred[h], strict=True):
        row = conf.setdefault(str(tr), {})
        row[str(pr)] = row.get(str(pr), 0.0) + dt_s
    acc = float(np.mean(truth[h] == pred[h]))
    return conf, acc
