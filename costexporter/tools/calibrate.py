"""`costexporter calibrate`: fit a GPU model's band profile from a team's own baselines.

The B300 wattages (R2 in docs/background.md) do not carry over to other GPUs, the shapes do; record a
known-healthy run and a known hang and classify against them. Real baselines are noisy (power
ramps between levels, noise tails, a checkpoint's writer and waiters at different levels), so:

1. Labels are authoritative: explicit windows (`START..END=BAND`) and, from events, completed
   declared checkpoints (the low "waiters" level) are fitted from their own samples with robust
   statistics (median, a MAD-based range); time inside completed steps is healthy, and its peaks
   are compute (the highest) and communication or starvation (by the utilization pattern
   across ranks).
2. Only bands no label covers are proposed by the histogram (peaks split at valleys) of the
   unlabelled samples: ~0% utilization is idle, busy below every healthy level is the low level.
3. A physically impossible result (compute below idle, overlapping bands) is refused with one
   line. Edges sit between neighbouring levels; the utilization rules between the straggler's
   utilization and the busy ranks'.

Every 4th block of 15 s of the baselines is held out: the fit never sees it, and the fitted
profile classifies it (the real classifier, `bands.classify`) for the confusion matrix. Pure:
no Redis.
"""

from __future__ import annotations

import datetime as dt
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from costexporter.core import bands as bands_mod
from costexporter.core import bandtable, profiles
from costexporter.core.model import Event, Samples
from costexporter.core.profiles import Profile, derive, model_key
from costexporter.core.replay import register_matches

LEVELS = ("compute", "communication", "starvation", "low", "idle")
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
HOLD_OUT_EVERY = 4  # every 4th block of 15 s is held out (short baselines keep every band)
HOLD_OUT_BLOCK_MS = 15_000
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


def parse_label(spec: str, parse_time: Callable[[str], int]) -> tuple[int, int, str]:
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
    evs = sorted((e for e in events if e.rank == 0), key=lambda e: e.ts_ms)
    phases: list[tuple[int, int]] = []
    open_: dict[str, int] = {}
    for e in events:
        if e.type == "phase":
            t = e.ts_ms
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
        t = e.ts_ms
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


def modes(power: np.ndarray, limit: float) -> list[np.ndarray]:
    """Propose power levels: the peaks of a smoothed histogram, split at the valleys between them.

    Real traces fill in between levels (ramps, noise tails), so a level is not a run of occupied
    bins but a peak; two peaks are one level unless the valley between them drops below half of
    the smaller one. Returns the sample indexes of each level, low to high.
    """
    finite = np.flatnonzero(np.isfinite(power))
    if finite.size == 0:
        return []
    width = max(limit / 400.0, 1.0)
    p = power[finite]
    lo = float(p.min())
    bins = ((p - lo) // width).astype(np.int64)
    counts = np.bincount(bins).astype(float)
    kernel = np.exp(-0.5 * (np.arange(-6, 7) / 2.0) ** 2)
    smooth = np.convolve(counts, kernel / kernel.sum(), mode="same")
    floor = MIN_LEVEL_SHARE * p.size / 10
    ext = np.concatenate([[-1.0], smooth, [-1.0]])
    peaks = np.flatnonzero((ext[1:-1] >= ext[:-2]) & (ext[1:-1] > ext[2:]) & (smooth >= floor))
    cuts: list[int] = []
    keep = [int(peaks[0])] if peaks.size else []
    for pk in peaks[1:].tolist():
        prev = keep[-1]
        v = prev + int(np.argmin(smooth[prev : pk + 1]))
        if smooth[v] < 0.5 * min(smooth[prev], smooth[pk]):
            cuts.append(v)
            keep.append(pk)
        elif smooth[pk] > smooth[prev]:
            keep[-1] = pk
    seg = np.searchsorted(np.asarray(cuts, np.int64), bins, side="right")
    out = []
    for k in range(len(cuts) + 1):
        idx = finite[seg == k]
        if idx.size >= MIN_LEVEL_SHARE * p.size:
            out.append(idx)
    return out


def _level(name: str, idx: np.ndarray, power: np.ndarray, util: np.ndarray) -> Level:
    """Robust statistics of one band's samples: the median, and a range of six robust standard
    deviations (MAD) either side within the 1st-99th percentiles, so the ramp samples at the
    edges of a labelled window do not widen the band."""
    p = power[idx]
    centre = float(np.median(p))
    sigma = max(1.4826 * float(np.median(np.abs(p - centre))), 0.5)
    return Level(
        name,
        centre,
        max(float(np.percentile(p, 1)), centre - 6 * sigma),
        min(float(np.percentile(p, 99)), centre + 6 * sigma),
        int(idx.size),
        float(np.median(util[idx])),
    )


def _find_levels(
    power: np.ndarray,
    util: np.ndarray,
    lab: np.ndarray,
    train: np.ndarray,
    rank: np.ndarray,
    ts: np.ndarray,
    limit: float,
    grid_ms: int,
) -> dict[str, Level]:
    """Labels are authoritative; the histogram only proposes levels for what no label covers.

    1. Each band labelled explicitly (`--label`, or a declared checkpoint for the low level)
       is fitted from its own samples.
    2. Time inside completed steps is healthy: its peaks are compute (the highest) and, below
       it, communication or starvation (by the utilization pattern across ranks).
    3. Unlabelled samples propose levels for the bands still missing: ~0% utilization is idle;
       busy below every healthy level is the low level (a hang's waiters).
    """
    out: dict[str, Level] = {}
    for name in LEVELS:
        idx = np.flatnonzero(train & (lab == name))
        if idx.size >= MIN_LABELLED:
            out[name] = _level(name, idx, power, util)
    healthy = train & (lab == HEALTHY)
    if healthy.sum() >= MIN_LABELLED:
        # Every level `modes` returns is made of healthy samples (the rest is NaN to it).
        found = modes(np.where(healthy, power, np.nan), limit)
        if found and "compute" not in out:
            out["compute"] = _level("compute", found[-1], power, util)
        for idx in found[:-1]:
            lv = _level("", idx, power, util)
            if _inside(lv.centre, out):
                continue
            lv.name = "starvation" if _uneven(idx, util, rank, ts, grid_ms) else "communication"
            if lv.name not in out:
                out[lv.name] = lv
    rest = train & (lab == "")
    if rest.any():
        lowest_healthy = min(
            (out[k].centre for k in ("compute", "communication", "starvation") if k in out), default=np.inf
        )
        for idx in modes(np.where(rest, power, np.nan), limit):
            lv = _level("", idx, power, util)
            if _inside(lv.centre, out):
                continue  # a level some label already covers
            if lv.util_median <= ZERO_UTIL:
                lv.name = "idle"
            elif lv.centre < lowest_healthy:
                lv.name = "low"
            else:
                continue  # busy, above the low level, unlabelled: no label says what it is
            if lv.name not in out:
                out[lv.name] = lv
    return out


MIN_LABELLED = 20  # samples a labelled band needs to be fitted from
ZERO_UTIL = 10.0


def _inside(centre: float, levels: dict[str, Level]) -> bool:
    return any(lv.lo <= centre <= lv.hi for lv in levels.values())


# Bands from low to high power: a fitted profile must keep this order, without overlaps.
ORDER = ("idle", "low", "starvation", "communication", "compute")


# A GPU computing draws well above its idle power: compute below this share of the limit is idle.
MIN_COMPUTE_FRACTION = 0.2


# A level this far above the power limit is not of a GPU with that limit (boards briefly exceed
# it; a level's centre does not).
ABOVE_LIMIT = 1.05


def check_physical(levels: dict[str, Level], limit: float) -> None:
    """Refuse a profile no GPU can have: compute at idle power or ~0% utilization, a band above
    one it must sit below (compute below idle), or two bands whose ranges reach past each
    other's centres."""
    c = levels.get("compute")
    if c is not None and (c.util_median <= ZERO_UTIL or c.centre < MIN_COMPUTE_FRACTION * limit):
        raise CalibrationError(
            f"impossible profile: compute at ~{c.centre:.0f} W and {c.util_median:.0f}% utilization is "
            f"idle for a {limit:.0f} W GPU; check the labels and events"
        )
    present = [levels[k] for k in ORDER if k in levels]
    for i, a in enumerate(present):
        for b in present[i + 1 :]:
            if {a.name, b.name} == {"starvation", "communication"}:
                continue  # R2: ~575 W and ~640 W; the utilization pattern tells them apart
            if b.centre <= a.centre:
                raise CalibrationError(
                    f"impossible profile: {b.name} (~{b.centre:.0f} W) is not above {a.name} "
                    f"(~{a.centre:.0f} W); check the labels and events"
                )
            if a.hi >= b.centre or b.lo <= a.centre:
                raise CalibrationError(
                    f"impossible profile: {a.name} ({a.lo:.0f}-{a.hi:.0f} W) and {b.name} "
                    f"({b.lo:.0f}-{b.hi:.0f} W) overlap; check the labels and events"
                )


def fit(
    samples: Samples,
    events: list[Event] | None = None,
    labels: list[tuple[int, int, str]] | None = None,
    *,
    gpu_model: str | None = None,
    power_limit_w: float | None = None,
    grid_ms: int = 1000,
    sources: list[str] | None = None,
    tz: str = "UTC",
) -> Fit:
    """Fit a profile; CalibrationError (one line) when the baselines cannot give a sound one."""
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
    limit, limit_from = _power_limit(samples, model, power_limit_w)

    ts, power, util = samples.ts_ms, samples.power_w, samples.util_pct
    rank = _ranks(samples, events)[samples.gpu]
    lab = event_labels(events, len(samples), ts) if events else np.full(len(samples), "", dtype=object)
    notes: list[str] = []
    for a, b, level in labels:
        inside = (ts >= a) & (ts < b)
        if not inside.any():
            raise CalibrationError(
                f"label {_when(a, tz)}..{_when(b, tz)}={level} matches no samples: the trace runs "
                f"{_when(int(ts.min()), tz)}..{_when(int(ts.max()), tz)} (times in --tz {tz})"
            )
        lab[inside] = level
        if _one_level(a, b, level, inside & np.isfinite(power), power, limit, tz, ts, grid_ms, util):
            notes.append(
                f"label {_when(a, tz)}..{_when(b, tz)}={level} holds two power levels (GPUs at "
                f"levels of their own, or an idle decay): both fitted as {level}"
            )
    held = ((ts // HOLD_OUT_BLOCK_MS) % HOLD_OUT_EVERY) == HOLD_OUT_EVERY - 1
    train = ~held & np.isfinite(power) & np.isfinite(util)

    named = _find_levels(power, util, lab, train, rank, ts, limit, grid_ms)
    if not named:
        raise CalibrationError("no power levels found in the baselines")
    check_physical(named, limit)
    warnings: list[str] = list(notes)
    if workloads(samples, events) <= 1:
        warnings.append(
            "fitted on one workload (one run): its levels may not carry over to another workload "
            "of this GPU (one TITAN X run's fit banded another's 0.72-0.75 alike); calibrate from "
            "baselines of two or more of your workloads"
        )
    if limit_from in ("derived_from_trace", "highest_reading"):
        warnings.append(
            f"the power limit ({limit:.0f} W, the scale of the fit) is "
            + (
                "estimated from the baselines' busy level"
                if limit_from == "derived_from_trace"
                else "taken as 1.1x the highest reading"
            )
            + ": give --power-limit W if you know it"
        )
    above = [lv for lv in named.values() if lv.centre > ABOVE_LIMIT * limit]
    for lv in sorted(above, key=lambda x: -x.centre):
        warnings.append(
            f"{lv.name} sits at ~{lv.centre:.0f} W, above the {limit:.0f} W power limit ({limit_from}): the "
            "baselines are not of this GPU model (--gpu-model) or the limit is wrong (--power-limit)"
        )
    defaulted: list[str] = []
    prof = _profile(named, limit, model, warnings, defaulted)
    _overlaps(named, limit, warnings)
    confusion, acc = _confusion(samples, rank, held, named, prof, grid_ms)
    _check_labels(samples, rank, held, lab, labels, named, prof, grid_ms)
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
            "power_limit_from": limit_from,
        },
    )
    return Fit(prof, named, confusion, acc, warnings, defaulted)


SEPARATE_RUNS_MS = 10 * 60 * 1000  # recordings this far apart in time are separate runs


def workloads(samples: Samples, events: list[Event]) -> int:
    """How many runs the baselines hold: the events' jobs, or recordings apart in time."""
    t = np.unique(samples.ts_ms)
    recordings = 1 + int(np.sum(np.diff(t) > SEPARATE_RUNS_MS)) if t.size else 0
    return max(len({e.job for e in events}), recordings)


def _power_limit(samples: Samples, model: str, power_limit_w: float | None) -> tuple[float, str]:
    """The power limit that scales the fit, by the profile rule (`profiles.resolve`): --power-limit,
    the trace's `power.limit`, the model's known limit, else the baselines' own busy level; and
    where it came from. The model being calibrated may be one no table knows: it names the fit,
    it does not pick a limit. Baselines with no busy level (only idle labelled) fall back to 1.1x
    the highest reading, and the fit says so."""
    known = model if model_key(model) else None
    try:
        basis, source = profiles.resolve(
            None,
            known,
            power_limit_w,
            gpus=samples.gpus,
            levels=lambda: profiles.trace_levels(samples.power_w, samples.util_pct, None),
        )
    except profiles.ProfileError:
        return float(np.nanmax(samples.power_w)) * 1.1, "highest_reading"
    if basis.power_limit_w is None:  # pragma: no cover - every profile the rule builds has one
        return float(np.nanmax(samples.power_w)) * 1.1, "highest_reading"
    return float(basis.power_limit_w), source


# A label's samples fall into two levels when a second one holds this share of them and sits this
# far (a ratio of centres) from the first: a checkpoint's writer and waiters (~135 and ~157 W on an
# H100) are one level; compute at 551 W and waiters at 153 W are two.
TWO_LEVEL_SHARE = 0.1
TWO_LEVEL_RATIO = 1.5
# A fitted profile must band at least this share of each labelled band's held-out samples as it.
MIN_LABEL_AGREEMENT = 0.9


# Two levels of one label that share at least this share of their moments are simultaneous.
SIMULTANEOUS_SHARE = 0.5


def _one_level(
    a: int,
    b: int,
    level: str,
    inside: np.ndarray,
    power: np.ndarray,
    limit: float,
    tz: str,
    ts: np.ndarray,
    grid_ms: int,
    util: np.ndarray,
) -> bool:
    """Refuse a label whose samples are two power levels far apart one after the other: one
    label, one level, and a time split separates them. Two levels at the same moments (GPUs
    idling at their own levels, one GPU's power decaying while the others stay) are what the
    label says of every GPU, and so is an idle label over a decay (both levels at ~0%
    utilization: a board's idle power falls as its clocks drop after a run): accepted, and True
    is returned."""
    idx = np.flatnonzero(inside)
    if idx.size < MIN_LABELLED:
        return False
    found = modes(np.where(inside, power, np.nan), limit)
    big = [f for f in found if f.size >= TWO_LEVEL_SHARE * idx.size]
    if len(big) < 2:
        return False
    by_centre = sorted(big, key=lambda f: float(np.median(power[f])))
    centres = [float(np.median(power[f])) for f in by_centre]
    if centres[-1] >= TWO_LEVEL_RATIO * centres[0]:
        lo, hi = (set((ts[f] // grid_ms).tolist()) for f in (by_centre[0], by_centre[-1]))
        if len(lo & hi) >= SIMULTANEOUS_SHARE * min(len(lo), len(hi)):
            return True
        if level == "idle" and all(float(np.nanmedian(util[f])) <= ZERO_UTIL for f in by_centre):
            return True
        raise CalibrationError(
            f"label {_when(a, tz)}..{_when(b, tz)}={level} spans two power levels (~{centres[-1]:.0f} W and "
            f"~{centres[0]:.0f} W): a label holds one band; split it where the power changes"
        )
    return False


# What a fitted profile's bands say of a label: the label's level, or for time inside completed
# steps (healthy) any valid level.
_AGREES = {HEALTHY: ("compute", "communication", "starvation")}


def _check_labels(
    samples: Samples,
    rank: np.ndarray,
    held: np.ndarray,
    lab: np.ndarray,
    windows: list[tuple[int, int, str]],
    levels: dict[str, Level],
    prof: Profile,
    grid_ms: int,
) -> None:
    """Refuse a profile that misclassifies its own labels: classified with the real classifier,
    each labelled band's held-out samples (all of them when too few are held out) must land in
    that band at MIN_LABEL_AGREEMENT at least, and so must each labelled window's on its own (a
    wrong window can hide between hold-out blocks behind a right one of the same name); an idle
    edge below the labelled idle's readings is named."""
    order = np.lexsort((samples.ts_ms, rank))
    r, t = rank[order], samples.ts_ms[order]
    p, u = samples.power_w[order], samples.util_pct[order]
    res = bands_mod.classify(r, t, p, u, int(rank.max()) + 1, prof, grid_ms=grid_ms)
    pred = np.asarray(bandtable.current().level_of_code, object)[res.band]
    lab_o, held_o = lab[order], held[order]
    groups = [(name, lab_o == name) for name in sorted({str(x) for x in lab_o if x})]
    groups += [(name, (t >= a) & (t < b)) for a, b, name in windows]
    for name, in_group in groups:
        mine = in_group & np.isfinite(p)
        if (mine & held_o).sum() >= MIN_LABELLED:
            mine &= held_o
        if not mine.any():  # a short label is checked too: its few samples are all it says
            continue
        ok = np.isin(pred[mine], _AGREES.get(name, (name,)))
        share = float(ok.mean())
        if share >= MIN_LABEL_AGREEMENT:
            continue
        why = ""
        if name == "idle" and "idle" in levels and prof.idle_max_w < levels["idle"].hi:
            why = (
                f": the idle edge ({prof.idle_max_w:.0f} W) clips the labelled idle "
                f"(up to {levels['idle'].hi:.0f} W)"
            )
        shown = "healthy" if name == HEALTHY else name
        raise CalibrationError(
            f"the fitted profile bands only {100 * share:.0f}% of the {shown}-labelled samples as {shown}"
            f"{why}; no profile written: check the labels and events"
        )


def _when(ms: int, tz: str) -> str:
    """Epoch ms as local time in `tz` (IANA name, UTC or +HH:MM), as the user writes labels."""
    from costexporter.core.timeutil import tz_zone

    return dt.datetime.fromtimestamp(ms / 1000, tz_zone(tz)).strftime("%Y-%m-%dT%H:%M:%S")


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
        if idle is not None:  # above the labelled idle: an old board idles high (a TITAN X at 95 W)
            low_max = min(max(low_max, 1.2 * idle.hi), compute_min * 0.95)
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
    pred = np.asarray(bandtable.current().level_of_code, object)[res.band]
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
