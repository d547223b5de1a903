"""Goodput: how much of a job's time moved it forward, in the layers fleets report
(docs/accounting.md, goodput). Pure: the API, replay and the metrics all call `job_goodput`,
so the figures cannot drift between them.

- **runtime**: valid GPU-time over the GPU-time the job held (every job category).
- **ETTR**, the effective training time ratio: valid GPU-time over the GPU-time of the job's
  wall time (its ranks x from its first registration to its end, or now). The time between a
  crash and the rerun counts against it; runtime goodput does not see it (nothing was held).
- **scheduling**: the job's wall time over that plus its wait before the start, where something
  the operator trusts says when it was submitted (its pod's creation, or a granted meta
  `submitted_at`); unknown otherwise.
- **program** (MFU): the model FLOPs of the valid steps' tokens over the peak FLOPs of the valid
  GPU-time, where the trainer says what a token costs (`core/flops.py`).

A layer that cannot be computed is None, with the reason in `notes`: never a guess.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict


class GoodputReport(TypedDict):
    """A job's (or a group's) goodput layers as the API and replay write them (ratios 0..1)."""

    runtime: float | None
    ettr: float | None
    scheduling: float | None
    program: float | None
    notes: list[str]


@dataclass(frozen=True, slots=True)
class Goodput:
    """The layers of one job over one window; None: not computed (see `notes`)."""

    runtime: float | None = None
    ettr: float | None = None
    scheduling: float | None = None
    program: float | None = None
    notes: tuple[str, ...] = ()

    def report(self) -> GoodputReport:
        return {
            "runtime": self.runtime,
            "ettr": self.ettr,
            "scheduling": self.scheduling,
            "program": self.program,
            "notes": list(self.notes),
        }


def runtime(valid_ms: float, held_ms: float) -> float | None:
    """Valid over held GPU-time; None when nothing was held."""
    return valid_ms / held_ms if held_ms > 0 else None


def ettr(valid_ms: float, held_ms: float, width: int, wall_ms: float) -> float | None:
    """Valid GPU-time over `width` GPUs for `wall_ms`. The capacity is never taken below what
    was held (a job that held more GPUs than it registered ranks, after a move), so ETTR is
    never above runtime goodput."""
    capacity = max(width * max(wall_ms, 0.0), held_ms)
    return valid_ms / capacity if capacity > 0 else None


def scheduling(submitted_ms: float | None, start_ms: float, end_ms: float) -> float | None:
    """Run time over run time plus the wait from submission to the start; None without a
    submission time. A submission stamped after the start (clocks apart) waits nothing."""
    if submitted_ms is None:
        return None
    wait = max(start_ms - submitted_ms, 0.0)
    run = max(end_ms - start_ms, 0.0)
    return run / (run + wait) if run + wait > 0 else None


def program(
    tokens: int, flops_per_token: float | None, valid_ms: float, peak_flops: float | None
) -> float | None:
    """MFU: the valid steps' model FLOPs over the peak FLOPs of the valid GPU-time."""
    if flops_per_token is None or peak_flops is None or valid_ms <= 0:
        return None
    return tokens * flops_per_token / (valid_ms / 1000.0 * peak_flops)


@dataclass(frozen=True, slots=True)
class JobSpan:
    """What dates a job's wall time: its first registration, its end (a clean end or its claim
    lapsing; None while it runs), its ranks, and when it was submitted where known."""

    start_ms: int | None
    end_ms: int | None
    width: int
    submitted_ms: int | None = None


NO_FLOPS = "program: the trainer posts no model_flops_per_token or model_params"


@dataclass(frozen=True, slots=True)
class Work:
    """What the program layer needs: the valid steps' tokens, the model FLOPs per token and the
    peak FLOPS of one GPU for the job's model and dtype (None: not known, with why)."""

    tokens: int = 0
    flops_per_token: float | None = None
    peak_flops: float | None = None
    why_not: tuple[str, ...] = ()


def job_goodput(
    valid_ms: float,
    held_ms: float,
    span: JobSpan,
    window: tuple[int, int],
    work: Work | None = None,
) -> Goodput:
    """A job's layers over `window` ([start, end) ms; its end is `now` for a job still running):
    ETTR's wall time is the part of the window inside the job's span."""
    notes: list[str] = []
    run_ettr = None
    if span.start_ms is None:
        notes.append("ettr: the job's start is not known (no registration read)")
    elif span.width <= 0:
        notes.append("ettr: the job registered no rank")
    else:
        end = window[1] if span.end_ms is None else min(span.end_ms, window[1])
        run_ettr = ettr(valid_ms, held_ms, span.width, end - max(span.start_ms, window[0]))
    sched = None
    if span.start_ms is None or span.submitted_ms is None:
        notes.append(
            "scheduling: unknown (no submission time: the job's pod creation, or a submitted_at "
            "the policy trusts)"
        )
    else:
        sched = scheduling(
            span.submitted_ms, span.start_ms, window[1] if span.end_ms is None else span.end_ms
        )
    mfu = None
    work = work or Work(why_not=(NO_FLOPS,))
    if work.why_not:
        notes.extend(work.why_not)
    else:
        mfu = program(work.tokens, work.flops_per_token, valid_ms, work.peak_flops)
    return Goodput(runtime(valid_ms, held_ms), run_ettr, sched, mfu, tuple(notes))
