"""What a job says about itself, read the same way by the agent, the watcher and replay: its
start, its meta and its gate's result. Each reader folds its events as they come; the rules of
what they mean live here, once."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from costexporter.core.model import Event

# A registration from another host dated more than this before the agent's own ranks started is
# not trusted as the job's start (a skewed clock, a name reused from an old job).
START_SKEW_GUARD_MS = 600_000


def job_start_ms(
    registered_ms: Iterable[int],
    *,
    first_event_ms: int | None = None,
    own_start_ms: int | None = None,
    stored_start_ms: int | None = None,
) -> int:
    """When the job's booking timeline starts: its earliest registration, and

    * `first_event_ms`: no later than its first event (the watcher, which reads the whole
      stream: a run start posted before the ranks registered);
    * `own_start_ms`: no earlier than `START_SKEW_GUARD_MS` before the agent's own ranks
      started (the agent books only its own GPUs, from their start);
    * `stored_start_ms`: no later than where a restarted agent's stored fold started (the fold
      stays valid; its start never moves later).

    ValueError when there is nothing to date it by.
    """
    candidates = list(registered_ms)
    if first_event_ms is not None:
        candidates.append(first_event_ms)
    if not candidates:
        raise ValueError("a job's start needs a registration or an event")
    start = min(candidates)
    if own_start_ms is not None:
        start = max(start, own_start_ms - START_SKEW_GUARD_MS)
    if stored_start_ms is not None:
        start = min(start, stored_start_ms)
    return start


# A register this far before its GPU's first sample, or after its newest, is not a late start or a
# skewed clock within reason: replay says so (counted, warned) as well as bounding it.
REGISTER_FAR_MS = 600_000


def register_far_ahead(register_ms: int, newest_sample_ms: int | None) -> bool:
    """A register dated more than `REGISTER_FAR_MS` after its GPU's newest sample: a clock ahead,
    whose date is not used (not for its start, not as the end of the job's data)."""
    return newest_sample_ms is not None and register_ms - newest_sample_ms > REGISTER_FAR_MS


def gpu_start_ms(
    register_ms: int, first_sample_ms: int, newest_sample_ms: int | None, floor_ms: int = 0
) -> tuple[int, int]:
    """When a rank's GPU time starts, and how far its register lies past the GPU's newest sample.

    The start is the register's time, but no earlier than the GPU's first sample (the time before
    it was never observed: a register dated years back books nothing there) or than `floor_ms`
    (what is booked already elsewhere), and no later than the GPU's newest sample (a register
    dated after every sample, a clock ahead, starts at that sample instead of dropping the GPU).
    The second value (ms, > 0 only when the register is past the newest sample) lets the live
    agent wait a round for a register just past its last sampling round. `newest_sample_ms`
    None: nothing to bound it by (a GPU never sampled).
    """
    start = max(register_ms, first_sample_ms, floor_ms)
    if newest_sample_ms is None or start <= newest_sample_ms:
        return start, 0
    return newest_sample_ms, start - newest_sample_ms


Member = tuple[int, int, int]  # (rank, GPU, when its claim dates from), as `one_rank_per_gpu` takes it


def one_rank_per_gpu(members: Iterable[Member]) -> tuple[list[Member], list[Member]]:
    """A job's GPU is booked for one rank: the one whose claim dates first (the lower rank at a
    tie). Two ranks of a job name one GPU when an elastic restart renumbers the ranks (rank 1
    comes back on another GPU, a new rank 2 on rank 1's), or two launchers post the same host
    and index. A rank's GPU is the one its first registration named: a later registration
    naming another GPU changes nothing. Returns (the members kept, by rank; the ranks left out
    as (rank, GPU, the rank that keeps it)), for the caller to say."""
    first: dict[int, Member] = {}
    dropped: list[Member] = []
    for m in sorted(members, key=lambda m: (m[2], m[0])):
        kept = first.setdefault(m[1], m)
        if kept is not m:
            dropped.append((m[0], m[1], kept[0]))
    return sorted(first.values()), dropped


def takeover_at(claim_ms: int, held: Iterable[tuple[int, int]]) -> int:
    """When a claim of a GPU dated `claim_ms` takes the GPU from the job that holds it: at once
    where that job's run is not live then (it ended cleanly, or lapsed), else where that run
    ends: a live job's GPU is never taken over. `held`: the holder's stretches [start, end) of
    its live run on the GPU, the open one ending at `POS_INF` (`booking.POS_INF`): a claim dated
    inside it takes the GPU only once the holder's run is over (refused until then). The agent
    and replay both decide by it."""
    for a, b in held:
        if a <= claim_ms < b:
            return b
    return claim_ms


def merge_meta(meta: dict[str, Any], ev: Event) -> None:
    """A `meta` event's fields merged into the job's meta, the newest value of a key winning;
    the reader's notes (`_unknown_fields`) are not the job's."""
    meta.update({k: v for k, v in ev.fields.items() if not k.startswith("_")})


def preflight_result(ev: Event) -> dict[str, Any]:
    """A `preflight` event as the job's gate result: passed, its checks, when."""
    return {"passed": ev.get("passed"), "checks": ev.get("checks"), "ts": ev.ts}
