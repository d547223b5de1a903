"""Shared GPUs booked once: a slice of a GPU (a MIG instance, or what is left of a partitioned GPU)
holds lanes [lo, hi) of the GPU's `den` lanes, and its GPU-milliseconds are counted so that the
slices of one GPU always add up to the GPU's own time, exactly, in integers.

Each wall-clock millisecond m goes whole to the slice whose lanes hold m mod den: a slice's
GPU-time from 0 to t is F(t) = (t // den) * (hi - lo) + clip(t % den - lo, 0, hi - lo), and the time
of [a, b) is F(b) - F(a). F never decreases (a piece is never negative); over any pieces of one
slice it telescopes to F(end) - F(start), within den milliseconds of its share; over slices that
partition the lanes it adds up to t: every GPU-millisecond lands once.
"""

from __future__ import annotations

import re

import numpy as np
import numpy.typing as npt

WHOLE = (0, 1, 1)  # a whole GPU: lanes [0, 1) of 1

# Compute slices of a MIG-capable GPU: the `Ng` of a profile counts sevenths on these models,
# quarters on A30. A profile names its compute slices first: 1g.10gb, 3g.40gb, 1c.3g.40gb (a
# compute instance of a larger GPU instance counts its GPU instance: the 3g).
_MIG_SLICES = (("A30", 4),)
DEFAULT_MIG_SLICES = 7
_PROFILE_RE = re.compile(r"^(?:\d+c\.)?(?P<g>\d+)g\.")


def mig_slices(gpu_model: str | None) -> int:
    """How many compute slices the GPU model divides into."""
    for key, n in _MIG_SLICES:
        if gpu_model and key in gpu_model:
            return n
    return DEFAULT_MIG_SLICES


def profile_slices(profile: str) -> int:
    """The compute slices of a MIG profile (`1g.10gb` -> 1); ValueError if it names none."""
    m = _PROFILE_RE.match(profile.strip())
    if not m or int(m.group("g")) <= 0:
        raise ValueError(f"MIG profile {profile!r} names no compute slices (e.g. 1g.10gb)")
    return int(m.group("g"))


def fraction(lanes: tuple[int, int, int]) -> float:
    lo, hi, den = lanes
    return (hi - lo) / den


def gpu_ms(
    start_ms: npt.NDArray[np.int64], end_ms: npt.NDArray[np.int64], lanes: npt.NDArray[np.int64] | None
) -> npt.NDArray[np.int64]:
    """GPU-milliseconds of each [start, end) of a slice holding `lanes` (rows of lo, hi, den; None:
    whole GPUs, the wall time)."""
    if lanes is None:
        out: npt.NDArray[np.int64] = end_ms - start_ms
        return out
    lo, hi, den = lanes[:, 0], lanes[:, 1], lanes[:, 2]
    width = hi - lo

    def f(t: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        r: npt.NDArray[np.int64] = (t // den) * width + np.clip(t % den - lo, 0, width)
        return r

    return f(end_ms) - f(start_ms)
