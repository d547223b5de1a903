"""Band thresholds per GPU model (docs/profiles.md).

Profiles are data: the calibrated ones shipped with the package are files of `data/profiles/`
(the B300's, from the measured field table, R2 in docs/background.md), read by `load` as a
user's are, and the board power limits of known models are rows of `data/gpus.json`. Other
models get a profile derived from their power limit, flagged uncalibrated: R2 says the shapes
carry over between GPUs but the absolute watts do not, so the derived thresholds are fractions
of the limit chosen to hold where absolute numbers would not (a small model computing at 75-80%
of the limit with 85-97% utilization; checkpoint waiters spinning at 100% just above idle
power). The live agent moves a derived profile's idle and low edges to each GPU's learned idle
power (`with_idle`, costexporter/core/idle.py): idle depends on a live CUDA context, not only on
the limit (an H200 draws 79.6 W idle without a context, 123.7 W with one)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, fields, replace
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from costexporter.core.model import GpuId


class ProfileError(ValueError):
    """A profile file or model name that cannot be used."""


# The utilization edges of every derived profile: they do not depend on the GPU model, so a
# judge that has no profile (no model, no limit) can still tell ~0% from ~100% by them.
BUSY_UTIL_PCT = 80.0
ZERO_UTIL_PCT = 10.0


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    calibrated: bool
    idle_max_w: float  # at or below: idle power
    low_max_w: float  # below: "only a little above idle" (deadlock / checkpoint waiters)
    compute_min_w: float  # at or above: matmul-bound compute
    busy_util_pct: float = BUSY_UTIL_PCT  # at or above: the "~100%" of R2
    zero_util_pct: float = ZERO_UTIL_PCT  # at or below: the "~0%" of R2
    power_limit_w: float | None = None
    gpu_model: str | None = None  # the device name a fitted profile is for (matched by model key)
    centres: dict[str, float] | None = None  # fitted: each band's power centre (W)
    provenance: dict[str, object] | None = None  # fitted: from which files, when, how well it separates

    def __post_init__(self) -> None:
        if not (0 <= self.idle_max_w <= self.low_max_w <= self.compute_min_w):
            raise ProfileError(
                f"profile {self.name!r}: need 0 <= idle_max_w <= low_max_w <= compute_min_w, "
                f"got {self.idle_max_w}, {self.low_max_w}, {self.compute_min_w}"
            )
        if not (0 <= self.zero_util_pct < self.busy_util_pct <= 100):
            raise ProfileError(f"profile {self.name!r}: need 0 <= zero_util_pct < busy_util_pct <= 100")

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def profile_edges(p: Profile) -> dict[str, float | None]:
    """The edges a band table's reading conditions name (`bandtable.EDGES`)."""
    return {
        "idle_max_w": p.idle_max_w,
        "low_max_w": p.low_max_w,
        "compute_min_w": p.compute_min_w,
        "busy_util_pct": p.busy_util_pct,
        "zero_util_pct": p.zero_util_pct,
        "power_limit_w": p.power_limit_w,
    }


# Fractions of the power limit for derived profiles. B300 through these fractions gives
# idle <= 176 W, low < 330 W, compute >= 715 W: R2's table still classifies correctly.
IDLE_FRACTION = 0.16
LOW_FRACTION = 0.30
COMPUTE_FRACTION = 0.65


def _gpu_table() -> list[tuple[str, tuple[str, ...], float]]:
    """Board power limits (W) of the GPUs training teams use (`data/gpus.json`), for deriving a
    profile from a model name: (model key, the words a device name must hold, limit W)."""
    doc = json.loads(resources.files("costexporter.core").joinpath("data/gpus.json").read_text())
    return [(str(m["model"]), tuple(m["words"]), float(m["power_limit_w"])) for m in doc["models"]]


# Device names ('NVIDIA H100 80GB HBM3', 'NVIDIA A100-PCIE-40GB') are matched by their words: each
# row's words must all be in the name, the first row that matches wins.
MODEL_VARIANTS: list[tuple[str, tuple[str, ...], float]] = _gpu_table()
KNOWN_POWER_LIMITS_W: dict[str, float] = {key: limit for key, _, limit in MODEL_VARIANTS}


def derive(power_limit_w: float, name: str = "derived") -> Profile:
    """An uncalibrated profile from a power limit."""
    if not power_limit_w or power_limit_w <= 0:
        raise ProfileError(f"cannot derive a profile from power limit {power_limit_w!r} W")
    return Profile(
        name=name,
        calibrated=False,
        idle_max_w=IDLE_FRACTION * power_limit_w,
        low_max_w=LOW_FRACTION * power_limit_w,
        compute_min_w=COMPUTE_FRACTION * power_limit_w,
        busy_util_pct=BUSY_UTIL_PCT,
        zero_util_pct=ZERO_UTIL_PCT,
        power_limit_w=power_limit_w,
    )


# A learned idle level (costexporter/core/idle.py) moves a derived profile's low edges: idle up to
# IDLE_MARGIN x idle, "only a little above idle" (deadlock, checkpoint waiters) below
# LOW_RATIO x idle. R2's B300 through these (idle ~135 W): idle <= 155 W, low < 270 W, with its
# deadlock at 190-195 W and starvation at ~575 W; an H200 measured with NVML (123.7 W idle with a
# context): idle <= 142 W, low < 247 W, its checkpoint and spin at 124 W and compute at 660-729 W.
IDLE_MARGIN = 1.15
LOW_RATIO = 2.0


def with_idle(profile: Profile, idle_w: float | None) -> Profile:
    """`profile` with its idle and low edges derived from the GPUs' learned idle power. Only a
    derived (uncalibrated) profile changes: a calibrated or fitted one is kept as it is. The
    edges stay below the compute edge."""
    if idle_w is None or profile.calibrated or not idle_w > 0:
        return profile
    ceiling = 0.95 * profile.compute_min_w
    idle_max = min(IDLE_MARGIN * idle_w, ceiling)
    low_max = min(max(LOW_RATIO * idle_w, idle_max), ceiling)
    return replace(
        profile,
        idle_max_w=round(idle_max, 1),
        low_max_w=round(low_max, 1),
        provenance={**(profile.provenance or {}), "learned_idle_w": round(float(idle_w), 1)},
    )


def scaled(profile: Profile, fraction: float) -> Profile:
    """`profile` for a slice of its GPU that gets `fraction` of the GPU's power (a MIG instance):
    every power edge scaled by it; the utilization edges stay."""
    f = float(fraction)
    return replace(
        profile,
        name=f"{profile.name}x{f:.3g}",
        idle_max_w=profile.idle_max_w * f,
        low_max_w=profile.low_max_w * f,
        compute_min_w=profile.compute_min_w * f,
        power_limit_w=None if profile.power_limit_w is None else profile.power_limit_w * f,
        centres=None if profile.centres is None else {k: v * f for k, v in profile.centres.items()},
    )


def model_key(gpu_model: str) -> str | None:
    """Match a device name such as 'NVIDIA H100 80GB HBM3' to a key of KNOWN_POWER_LIMITS_W."""
    words = set(gpu_model.upper().replace("-", " ").replace("(", " ").replace(")", " ").split())
    return next((key for key, need, _ in MODEL_VARIANTS if words.issuperset(need)), None)


def known_models() -> str:
    """The model names a profile can be derived for, for an error message."""
    return ", ".join(key for key, _, _ in MODEL_VARIANTS)


# A trace that names no model and no limit: its profile is derived from its own levels. A GPU
# computing draws most of its limit (an H100 at 530-580 W of 700 W, an H200 at its 700 W cap,
# R2's B300 at 940-1040 W of 1100 W): the limit is taken as the busy readings' 95th percentile
# over this share. A compute level less than this many times the idle level is not told apart.
TRACE_COMPUTE_SHARE = 0.85
TRACE_MIN_COMPUTE_OVER_IDLE = 2.0
TRACE_BUSY_UTIL_PCT = 80.0
TRACE_MIN_BUSY = 30  # busy readings a compute level stands on


@dataclass(frozen=True, slots=True)
class TraceLevels:
    """What a trace says of its own GPUs' power: the learned idle level (None: too few readings
    at 0%) and the compute level (95th percentile of busy readings; None: too few)."""

    idle_w: float | None
    compute_w: float | None


def trace_levels(power_w: np.ndarray, util_pct: np.ndarray, idle_w: float | None) -> TraceLevels:
    """The compute level of readings at or above TRACE_BUSY_UTIL_PCT, with the idle level
    learned per GPU (`costexporter/core/idle.py`)."""
    return busy_levels(busy_readings(power_w, util_pct), idle_w)


def busy_readings(power_w: np.ndarray, util_pct: np.ndarray) -> np.ndarray:
    """The power readings at or above TRACE_BUSY_UTIL_PCT: what the compute level is taken from
    (a trace read GPU by GPU keeps only these)."""
    with np.errstate(invalid="ignore"):
        busy: np.ndarray = power_w[(util_pct >= TRACE_BUSY_UTIL_PCT) & np.isfinite(power_w)]
    return busy


def busy_levels(busy_w: np.ndarray, idle_w: float | None) -> TraceLevels:
    """`trace_levels` of the busy readings (`busy_readings`)."""
    compute = float(np.percentile(busy_w, 95)) if busy_w.size >= TRACE_MIN_BUSY else None
    return TraceLevels(idle_w, compute)


def from_trace(levels: TraceLevels, name: str) -> Profile:
    """An uncalibrated profile from a trace's own levels (`trace_levels`), derived as from a power
    limit; ProfileError when the trace does not tell compute from idle."""
    c, i = levels.compute_w, levels.idle_w
    if c is None or (i is not None and c < TRACE_MIN_COMPUTE_OVER_IDLE * i):
        what = "no busy readings" if c is None else f"busy readings at ~{c:.0f} W, idle at ~{i:.0f} W"
        raise ProfileError(
            f"the trace names no GPU model or power limit and its own levels do not tell compute from "
            f"idle ({what}): give --gpu-model or --power-limit"
        )
    limit = round(c / TRACE_COMPUTE_SHARE, 1)
    p = derive(limit, name=name)
    return replace(p, provenance={"compute_level_w": round(c, 1), "estimated_power_limit_w": limit})


# Where a profile came from: the replay report's `profile.source`, the `source` label of
# costexporter_gpu_profile_info. `learned_idle`: a derived profile whose idle and low edges
# follow the GPU's learned idle power (`learned`); what it was derived from is kept beside it.
SOURCES = (
    "file",  # --profile FILE
    "calibrated",  # fitted by `costexporter calibrate`, found by model in the profile directory
    "builtin",  # a calibrated profile shipped with the package (data/profiles: the B300 table)
    "derived_from_limit",  # from a power limit (the flag, NVML's, the trace's column)
    "derived_from_model",  # from a known model's board power limit
    "derived_from_trace",  # from a trace's own levels: no model or limit anywhere
    "learned_idle",  # one of the derived ones, its low edges at the learned idle power
)


def unknown_model(gpu_model: str) -> ProfileError:
    """The one error for a model given by the operator that no table or fitted profile knows."""
    return ProfileError(
        f"unknown GPU model {gpu_model!r}: give --power-limit W or --profile FILE "
        f"(known models: {known_models()})"
    )


def check_model(
    gpu_model: str | None, power_limit_w: float | None = None, directory: str | Path | None = None
) -> None:
    """An operator's --gpu-model must be usable as given: a known model, a fitted profile of the
    profile directory, or named together with --power-limit. Otherwise ProfileError
    (`unknown_model`): every command stops at start with the same line, rather than deriving a
    profile the operator did not ask for from whatever limit the GPU or trace reports."""
    if not gpu_model or power_limit_w or model_key(gpu_model) is not None:
        return
    if find(gpu_model, directory) is None:
        raise unknown_model(gpu_model)


def select(
    gpu_model: str | None = None,
    power_limit_w: float | None = None,
    directory: str | Path | None = None,
) -> Profile:
    """Pick the profile: a fitted one for the model in `directory` (see `find`), else the
    built-in calibrated profile of the model (the B300's), else derive from the limit (an explicit one wins
    over the table of known limits). ProfileError without a model or limit to go by."""
    return resolve(None, gpu_model, power_limit_w, directory=directory)[0]


def resolve(
    configured: Profile | None,
    gpu_model: str | None = None,
    power_limit_w: float | None = None,
    *,
    meta: Mapping[str, object] | None = None,
    gpus: Iterable[GpuId] = (),
    directory: str | Path | None = None,
    levels: TraceLevels | Callable[[], TraceLevels] | None = None,
) -> tuple[Profile, str]:
    """The profile and where it came from (one of SOURCES), by the one rule serve (the agent),
    watch (the watcher), replay, calibrate and the demo share.

    The configured profile (--profile FILE) wins. Else the model is the operator's (`gpu_model`),
    else the GPUs' own name (NVML's, the trace's `name` column), else the job's meta
    `gpu_model`; the limit is the operator's (`power_limit_w`), else the first GPU's that reports
    one. In order: a fitted profile of `directory` for the model; a built-in one; a profile
    derived from the limit; one derived from the model's known limit; one derived from the
    trace's `levels` (a function: called only then). An operator's model that is not known and
    comes without an operator's limit is an error (`check_model`), whatever limit the GPUs
    report. Never another GPU's profile in silence: without any of these, ProfileError naming
    --gpu-model and --power-limit."""
    if configured is not None:
        return configured, "file"
    gpus = list(gpus)
    named = next((g.name for g in gpus if g.name), None) or (meta or {}).get("gpu_model")
    model = gpu_model or (str(named) if named else None)
    reported = next((g for g in gpus if g.power_limit_w), None)
    limit = power_limit_w or (reported.power_limit_w if reported is not None else None)
    fitted = find(model, directory)
    if fitted is not None:
        return fitted, "calibrated"
    check_model(gpu_model, power_limit_w)
    key = model_key(model) if model else None
    builtin = BUILTIN.get(key) if key else None
    if builtin is not None and limit in (None, builtin.power_limit_w):
        return builtin, "builtin"
    if limit:
        estimated = not power_limit_w and reported is not None and reported.limit_from_trace
        source = "derived_from_trace" if estimated else "derived_from_limit"
        return derive(limit, name=key or (model or "derived")), source
    if key:
        return derive(KNOWN_POWER_LIMITS_W[key], name=key), "derived_from_model"
    if levels is not None:
        if callable(levels):
            levels = levels()
        return from_trace(levels, name=model or "derived"), "derived_from_trace"
    what = f"unknown GPU model {model!r} and no power limit" if model else "no GPU model and no power limit"
    raise ProfileError(
        f"{what}: give --gpu-model or --power-limit (or --profile FILE); "
        "no other GPU's profile is used in its place"
    )


# A model's known limit is doubted where this share of a GPU's readings lies above it by more
# than OVER_LIMIT_MARGIN (boards briefly exceed their limit by a few percent; a trace that reads
# 739 W for an "A100" of 400 W is another GPU, or a mislabelled one).
OVER_LIMIT_SHARE = 0.01
OVER_LIMIT_MARGIN = 1.15


def over_limit(
    profile: Profile, source: str, power_w: np.ndarray | Callable[[], np.ndarray], max_w: float | None = None
) -> dict[str, float] | None:
    """Where a profile taken from a model's name (its known limit, not one the trace or the
    operator gave) is contradicted by the readings: {limit_w, reading_w} (the reading at the top
    OVER_LIMIT_SHARE), else None. `power_w` may be a function giving the readings, and `max_w`
    their highest, known without them (a trace read GPU by GPU): they are read only past it."""
    if source not in ("derived_from_model", "builtin") or not profile.power_limit_w:
        return None
    edge = profile.power_limit_w * OVER_LIMIT_MARGIN
    if max_w is not None and not max_w > edge:
        return None
    p = np.asarray(power_w() if callable(power_w) else power_w, np.float64)
    if p.size == 0 or not np.nanmax(p, initial=0.0) > edge:  # the usual trace: one pass, no sort
        return None
    p = p[np.isfinite(p)]
    top = float(np.quantile(p, 1 - OVER_LIMIT_SHARE))
    if top <= edge:
        return None
    return {"limit_w": float(profile.power_limit_w), "reading_w": round(top, 1)}


def learned(profile: Profile, source: str, idle_w: float | None) -> tuple[Profile, str]:
    """`with_idle` with the source it leaves: `learned_idle` when the learned idle power moved a
    derived profile's edges (what it was derived from stays in its provenance, `derived_from`),
    else the source unchanged."""
    moved = with_idle(profile, idle_w)
    if moved is profile:
        return profile, source
    prov = {**(moved.provenance or {}), "derived_from": source}
    return replace(moved, provenance=prov), "learned_idle"


def describe(profile: Profile, source: str) -> str:
    """One line for a log: the profile and where it came from (for a derived one, what from).
    The learned idle is left out: the line stays the same while the idle level is learned."""
    prov = profile.provenance or {}
    origin = str(prov.get("derived_from", source))
    limit = f"{profile.power_limit_w:g} W" if profile.power_limit_w else "unknown"
    what = {
        "file": "from --profile",
        "calibrated": "fitted by calibrate",
        "builtin": "built-in, calibrated",
        "derived_from_limit": f"derived from the power limit ({limit}), uncalibrated",
        "derived_from_model": f"derived from the model's board limit ({limit}), uncalibrated",
        "derived_from_trace": "derived from the trace's own levels, uncalibrated",
    }.get(origin, origin)
    return f"{profile.name} ({what})"


def choose(
    configured: Profile | None,
    gpu_model: str | None = None,
    power_limit_w: float | None = None,
    *,
    meta: Mapping[str, object] | None = None,
    gpus: Iterable[GpuId] = (),
    directory: str | Path | None = None,
    levels: TraceLevels | Callable[[], TraceLevels] | None = None,
) -> Profile:
    """A job's (or one GPU's) profile by the one rule (`resolve`), without its source."""
    return resolve(
        configured, gpu_model, power_limit_w, meta=meta, gpus=gpus, directory=directory, levels=levels
    )[0]


# The directory of fitted profiles a command uses when --profile names none (read by the CLI).
PROFILE_DIR_ENV = "COSTEXPORTER_PROFILE_DIR"


def save(profile: Profile, path: str | Path) -> Path:
    import yaml

    p = Path(path)
    d = {k: v for k, v in profile.to_dict().items() if v is not None}
    p.write_text(yaml.safe_dump(d, sort_keys=False))
    return p


def find(gpu_model: str | None, directory: str | Path | None = None) -> Profile | None:
    """A profile file of `directory` for this GPU model: its `gpu_model` (or file name) has the
    same model key ('NVIDIA H200' matches 'H200')."""
    if not directory or not gpu_model:
        return None
    d = Path(directory)
    if not d.is_dir():
        raise ProfileError(f"{d}: the profile directory does not exist")
    want = model_key(gpu_model) or gpu_model.upper()
    files = sorted([*d.glob("*.yaml"), *d.glob("*.yml"), *d.glob("*.json")])
    stamp = (str(d), want, tuple((str(f), f.stat().st_mtime_ns) for f in files))
    if stamp not in _FOUND:  # the agent asks every round: read the files only when they change
        _FOUND.clear()
        match = None
        for f in files:
            prof = load(f)
            have = prof.gpu_model or prof.name
            if (model_key(have) or have.upper()) == want:
                match = prof
                break
        _FOUND[stamp] = match
    return _FOUND[stamp]


# (directory, model key, (file, mtime) of each profile file) -> the profile found there
_FOUND: dict[tuple[str, str, tuple[tuple[str, int], ...]], Profile | None] = {}


def load(path: str | Path) -> Profile:
    """Read a profile from YAML or JSON. Missing keys are an error; unknown keys too."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ProfileError(f"{p}: cannot read profile: {e.strerror or e}") from None
    import yaml

    try:
        data = json.loads(text) if p.suffix.lower() == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        raise ProfileError(f"{p}: not a valid profile file: {e}") from None
    if not isinstance(data, dict):
        raise ProfileError(f"{p}: a profile is a mapping of thresholds")
    known = {f.name for f in fields(Profile)}
    unknown = set(data) - known
    if unknown:
        raise ProfileError(f"{p}: unknown profile keys {sorted(unknown)}; known: {sorted(known)}")
    data.setdefault("name", p.stem)
    data.setdefault("calibrated", True)
    try:
        return Profile(**data)
    except TypeError as e:
        raise ProfileError(f"{p}: {e}") from None


def _builtin_profiles() -> dict[str, Profile]:
    """The calibrated profiles shipped with the package (`data/profiles/*.json`, each with its
    source in `provenance`), by model key: read by `load`, as a user's profile is."""
    out: dict[str, Profile] = {}
    for f in sorted(resources.files("costexporter.core").joinpath("data/profiles").iterdir(), key=str):
        if f.name.endswith(".json"):
            with resources.as_file(f) as path:
                prof = load(path)
            out[model_key(prof.gpu_model or prof.name) or prof.name.upper()] = prof
    return out


BUILTIN: dict[str, Profile] = _builtin_profiles()
# R2's B300 (docs/background.md): the calibrated profile the field table gives.
B300 = BUILTIN["B300"]
