"""Which GPU each line of an index-less nvidia-smi CSV is.

Without an `index` column, nvidia-smi writes one line per GPU per instant, GPUs in order. So the
lines are GPUs 0..N-1, N-line block after N-line block, and counting lines is right as long as no
line is lost: a line the reader rejects (malformed, a bad value) still counts, since nvidia-smi
wrote it for its GPU. Timestamps alone cannot number lines: nvidia-smi stamps an instant's GPU 0
line 50-80 ms early at times, and writes an instant in two bursts ~110 ms apart at others, so the
gaps between lines do not always fall between instants.

Timestamps instead say where counting may have slipped. Instants begin after a pause of most of a
sampling interval; in a steady file they begin every N lines. A pause where counting says none
belongs is a burst or a jittered stamp when the instants after it begin where counting says
again; when they keep beginning elsewhere, lines were lost (or a GPU stopped answering, and the
instants are one line shorter for a while; where the starts such a count expects stop showing,
the GPU is back). An instant start an early-stamped GPU 0 line hides (its pause is one line late
and shorter) is not held against a count. Counting then restarts there. Where the readings tell
the GPUs apart they check the stamps: a restart off the count that the readings say the old
count goes on through is undone (bursts a few instants apart put starts off the count every
other start, as lost lines do); a short restart that keeps the readings from telling which GPU
the instants after it lack is folded into the count before it. The boundary then moves by
whole blocks to where each GPU's readings continue, and the lines between are placed by what
each GPU's own readings say: its memory.used and power change little from
one instant to the next, so the lines of a short instant (or of a stretch where one GPU is
missing) go to the GPUs whose readings they continue. A line whose GPU the readings do not tell
apart from another is not placed: it is counted and said, never given to a GPU by guess.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# Lines of one instant are within this of each other (the rest of the instant after an early
# GPU 0 line, or after a burst, starts a new group).
INSTANT_TOLERANCE_MS = 50
# An instant begins where most of a sampling interval passes without a line.
SPLIT_GAP_SHARE = 0.85
# Instant starts after a shift that set the new block size.
CONFIRM_STARTS = 3
# How many blocks apart the on-count starts around a burst may be.
BURST_BLOCKS = 6
# Placing by continuity: how many instants each side are compared, how much better the best
# placement must be than the next (in units of a typical step of a GPU's own readings).
COMPARE_INSTANTS = 3
PLACE_MARGIN = 1.5
REF_BLOCKS = 4  # a GPU's readings before a segment: the median of this many blocks
REFINE_BLOCKS = 6  # how many blocks a boundary may move by the readings (as BURST_BLOCKS)
REFINE_LINES = 64  # ... and at least this many lines (bursts and early stamps around a GPU that
# stops or comes back put the stamps' boundary up to ~8 instants off, more blocks of short ones)
JOIN_BLOCKS = 4  # blocks after a restarted count compared with the count before continued
POWER_STEP_W, POWER_STEP_SHARE = 15.0, 0.05  # a GPU's power moves about this much per instant
MEMORY_STEP_MIB, MEMORY_STEP_SHARE = 4.0, 0.0002  # ... and its memory.used this much
MAX_TERM = 8.0  # one reading's mismatch counts at most this much


@dataclass(frozen=True, slots=True)
class Note:
    """Something the numbering has to say about lines `first`..`last` (slots)."""

    first: int
    last: int
    reason: str  # "short_block", "unplaced_line", "gpu_missing"
    detail: str
    lines: int = 1  # how many lines it counts


def number_lines(
    slot: np.ndarray,
    ts_ms: np.ndarray,
    valid: np.ndarray,
    n_slots: int,
    power_w: np.ndarray | None = None,
    memory_mib: Callable[[], np.ndarray | None] | None = None,
) -> tuple[np.ndarray, list[Note]]:
    """GPU of each slot (0..n_slots-1: the data lines nvidia-smi wrote, rejected ones included),
    -1 where it cannot be told, and what to say. `slot`, `ts_ms`, `power_w`, `memory_mib` are per
    row of the file (`valid`: the row's stamp can be trusted); `memory_mib` is read only when
    lines must be placed."""
    gpu = np.full(n_slots, -1, np.int64)
    notes: list[Note] = []
    sv, tv = slot[valid], ts_ms[valid]
    if sv.size == 0:
        return gpu, notes
    starts, hints = _instant_starts(sv, tv)
    n_gpus = _usual_block(starts, n_slots)
    segments = _segments(starts, n_gpus, n_slots, hints)
    if len(segments) == 1 and segments[0][2] == n_gpus and n_slots % n_gpus == 0:
        return np.arange(n_slots) % n_gpus, notes  # the usual file: counting is right throughout
    p = np.full(n_slots, np.nan)
    m = np.full(n_slots, np.nan)
    if power_w is not None:
        p[slot] = power_w
    mem = memory_mib() if memory_mib is not None else None
    if mem is not None:
        m[slot] = mem
    # Each segment: lines [a, b) of blocks of n lines, and where its last block ends short.
    segments, mapping = _settled(segments, n_gpus, p, m)
    if _rejoin(segments, mapping, n_gpus, p, m):
        segments, mapping = _settled(segments, n_gpus, p, m)
    if _refine(segments, mapping, n_gpus, p, m):
        mapping = _mappings(segments, n_gpus, p, m)
    for k, (a, b, n) in enumerate(segments):
        full_end = a + (b - a) // n * n
        mp = mapping[k]
        if mp is not None and full_end > a:
            gpu[a:full_end] = mp[(np.arange(a, full_end) - a) % n]
        elif full_end > a:
            notes.append(
                Note(
                    a,
                    full_end - 1,
                    "unplaced_line",
                    f"instants of {n_gpus} GPUs have {n} lines here and the readings do not tell "
                    "which GPU is missing: these lines are not booked",
                    full_end - a,
                )
            )
        if full_end < b:  # a short instant: placed by continuity, or not at all
            last_segment = k == len(segments) - 1
            if last_segment:  # the file ends inside an instant: its first lines are in order
                gpu[full_end:b] = (mp if mp is not None else np.arange(n_gpus))[: b - full_end]
                notes.append(
                    Note(
                        full_end,
                        b - 1,
                        "short_block",
                        f"the file ends inside an instant of {n_gpus} GPUs after {b - full_end} line(s)",
                    )
                )
                continue
            ref_prev = _values_before(gpu, p, m, full_end, n_gpus)
            ref_next = _values_after(segments, mapping, k + 1, p, m, n_gpus)
            placed = _place(np.arange(full_end, b), n_gpus, p, m, ref_prev, ref_next)
            if placed is None:
                notes.append(
                    Note(
                        full_end,
                        b - 1,
                        "unplaced_line",
                        f"an instant of {n_gpus} GPUs has {b - full_end} line(s) and the readings do "
                        "not tell which GPUs they are: not booked",
                        b - full_end,
                    )
                )
            else:
                gpu[full_end:b] = placed
                notes.append(
                    Note(
                        full_end,
                        b - 1,
                        "short_block",
                        f"an instant of {n_gpus} GPUs has {b - full_end} line(s); placed as GPU "
                        + ",".join(map(str, placed.tolist()))
                        + " by what each GPU's own readings continue",
                    )
                )
    for lo, hi in _edges_of_steady(segments, mapping, n_slots):
        placed = np.flatnonzero(gpu[lo:hi] >= 0) + lo
        if placed.size:
            gpu[placed] = -1
            notes.append(
                Note(
                    int(placed[0]),
                    int(placed[-1]),
                    "unplaced_line",
                    "a GPU stopped or came back near here and only the GPUs' steady power tells "
                    "them apart, not any one instant's: these lines are not booked",
                    int(placed.size),
                )
            )
    return gpu, notes


def _instant_starts(slot: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Slots where an instant begins, by the stamps: after most of a sampling interval without a
    line (an early-stamped GPU 0 line sits 50-80 ms before the rest of its instant, not one
    interval); and the slots after a shorter pause (the rest of an instant whose GPU 0 line was
    stamped early: its start is hidden one line before)."""
    new = np.ones(t.size, bool)
    new[1:] = np.abs(np.diff(t)) > INSTANT_TOLERANCE_MS
    group_start = np.flatnonzero(new)
    if group_start.size < 2:
        return slot[group_start], slot[:0]
    interval = float(np.median(np.diff(t[group_start])))
    gap_before = t[group_start[1:]] - t[group_start[1:] - 1]
    begins = np.concatenate([[True], gap_before >= SPLIT_GAP_SHARE * interval])
    return slot[group_start[begins]], slot[group_start[~begins]]


def _usual_block(starts: np.ndarray, n_slots: int) -> int:
    """N: the usual number of lines between instant starts (a tie: the larger)."""
    bounds = np.append(starts, n_slots)
    counts = np.bincount(np.diff(bounds))
    return max(int(counts.size - 1 - np.argmax(counts[::-1])), 1)


def _segments(
    starts: np.ndarray, n_gpus: int, n_slots: int, hints: np.ndarray | None = None
) -> list[tuple[int, int, int]]:
    """Stretches [a, b) counted in blocks of n lines from a: a new one begins where instants keep
    beginning off the count (lines lost, or a GPU not answering: then n is the new usual block).
    nvidia-smi begins a file with an instant's first GPU. `hints`: slots one line after an
    instant start the stamps hide (an early-stamped GPU 0 line)."""
    extra = [] if hints is None else [hints, hints - 1]
    hidden_: list[np.ndarray] = []

    def hidden() -> np.ndarray:  # sorted (repeats do no harm): needed only where counting slips
        if not hidden_:
            hidden_.append(np.sort(np.concatenate([starts, *extra])))
        return hidden_[0]

    out: list[tuple[int, int, int]] = []
    a, n, i = 0, n_gpus, 0
    if starts[-1] < n_slots:  # the file's end is where the next instant would begin
        starts = np.append(starts, n_slots)
    while i < starts.size:
        rest = starts[i:]
        on = (rest - a) % n == 0
        # An off-count start is a burst (or jitter) when it is the only one between two on-count
        # starts at most BURST_BLOCKS blocks apart (the instant after a burst follows it closely
        # and early-stamped lines hide starts, so the next starts may not show); lost lines put
        # every start after them off the count.
        j = np.arange(rest.size)
        prev_on = np.maximum.accumulate(np.where(on, j, -1))
        next_on = np.minimum.accumulate(np.where(on, j, rest.size)[::-1])[::-1]
        burst = (
            (prev_on >= 0)
            & (next_on < rest.size)
            & (next_on - prev_on == 2)
            & (rest[np.minimum(next_on, rest.size - 1)] - rest[np.maximum(prev_on, 0)] <= BURST_BLOCKS * n)
        )
        # Bursts are rare: off-count starts every other start (instants of one line fewer than
        # counted, as when one of two GPUs stops answering) are not bursts.
        if burst.size > 2:
            near = np.zeros(burst.size, bool)
            near[2:] |= burst[:-2]
            near[:-2] |= burst[2:]
            burst &= ~near
        off = np.flatnonzero(~on & ~burst & (j + 1 < rest.size))
        k = i + int(off[0]) if off.size else starts.size
        if n < n_gpus:  # a GPU back: the count expects starts that no longer show
            gone = _starts_stop(hidden(), a, n, int(starts[k - 1]) if k < starts.size else n_slots)
            if gone is not None:
                k = int(np.searchsorted(starts, gone))
        if k >= starts.size - 1:
            break
        b = int(starts[k])
        # Where counting restarts and in blocks of how many: of b, the starts just after it and
        # the places the old count reaches (a GPU that stopped answering right after a burst),
        # and of the block sizes up to N, the pair the next starts agree with most (a tie: the
        # larger block, then the earliest place). An early-stamped GPU 0 line can hide an
        # instant's start, so the next starts may be two blocks apart.
        before = starts[i:k]
        on_before = before[(before - a) % n == 0]
        last_on = int(on_before[-1]) if on_before.size else a
        reach = np.arange(last_on, b + 2 * n + 1, n)
        near = starts[(starts > b) & (starts <= b + 2 * n)]
        cands = np.unique(np.concatenate([[b], near, reach[reach > a]])).tolist()
        after = starts[k : k + 1 + 4 * CONFIRM_STARTS]
        best = (-np.inf, n, b)
        for size in range(n_gpus, 0, -1):
            for c in cands:
                seen = after[after > c]
                on_seen = ((seen - c) % size) == 0
                # A count is judged up to where it slips for good (two starts in a row off it:
                # lines lost again further on), not by the next stretch's count: that one
                # would speak against the right count here, and for a smaller block that
                # happens to fit both.
                slip = np.flatnonzero(~on_seen[:-1] & ~on_seen[1:])
                if slip.size:
                    seen, on_seen = seen[: slip[0]], on_seen[: slip[0]]
                on_count = int(on_seen.sum())
                # Starts off the count speak against it, and so do instants it expects where no
                # start shows, not even one hidden by an early-stamped GPU 0 line (a smaller
                # block always fits more starts).
                unseen = 0
                if seen.size:
                    expect = np.arange(c + size, int(seen[-1]) + 1, size)
                    hid = hidden()
                    at = np.minimum(np.searchsorted(hid, expect), hid.size - 1)
                    unseen = int((hid[at] != expect).sum())
                score = (
                    on_count - (seen.size - on_count) - unseen + 3 * (size == n)
                )  # inertia: keep the block size
                if score > best[0]:
                    best = (score, size, c)
        n_new, new_a = int(best[1]), int(best[2])
        if new_a > a:
            out.append((a, new_a, n))
        a, n = new_a, n_new
        i = max(k + 1, int(np.searchsorted(starts, new_a, "right")))
    out.append((a, n_slots, n))
    return [s for s in out if s[1] > s[0]]


def _starts_stop(hidden: np.ndarray, a: int, n: int, until: int) -> int | None:
    """Where a count of n-line blocks from slot `a` stops matching the stamps before `until`:
    the first missing start of the first 2 x CONFIRM_STARTS starts it expects of which at least
    CONFIRM_STARTS do not show (hidden ones included; instants of 2 lines counted as 1 miss
    every other start), if any."""
    expect = np.arange(a + n, until, n)
    w = 2 * CONFIRM_STARTS
    if expect.size < w:
        return None
    at = np.minimum(np.searchsorted(hidden, expect), hidden.size - 1)
    missing = hidden[at] != expect
    run = np.convolve(missing.astype(np.int64), np.ones(w, np.int64), "valid")
    hit = np.flatnonzero(run >= CONFIRM_STARTS)
    if not hit.size:
        return None
    first = int(hit[0]) + int(np.argmax(missing[hit[0] : hit[0] + w]))
    return int(expect[first])


def _mappings(
    segments: list[tuple[int, int, int]], n_gpus: int, p: np.ndarray, m: np.ndarray
) -> list[np.ndarray | None]:
    """Each segment's GPUs, in order (None: the readings do not tell which GPU is missing)."""
    mapping: list[np.ndarray | None] = []
    for k, (a, b, n) in enumerate(segments):
        if n == n_gpus:
            mapping.append(np.arange(n_gpus))
            continue
        prev = _block_before(segments, mapping, k, a)
        mapping.append(_choose_mapping(a, b, n, n_gpus, p, m, prev))
    return mapping


def _settled(
    segments: list[tuple[int, int, int]], n_gpus: int, p: np.ndarray, m: np.ndarray
) -> tuple[list[tuple[int, int, int]], list[np.ndarray | None]]:
    """Segments' GPUs (`_mappings`) and segments that continue each other joined (`_merged`),
    until no more join: a segment's GPUs are chosen by the blocks before it, so a join before
    it (a few blocks of one count the stamps cut apart) can change them."""
    mapping = _mappings(segments, n_gpus, p, m)
    while True:
        joined, mapping = _merged(segments, mapping)
        if len(joined) == len(segments):
            without = _without_short(joined, mapping, n_gpus, p, m)
            if without is None:
                return joined, mapping
            joined = without
        segments = joined
        mapping = _mappings(segments, n_gpus, p, m)


def _without_short(
    segments: list[tuple[int, int, int]],
    mapping: list[np.ndarray | None],
    n_gpus: int,
    p: np.ndarray,
    m: np.ndarray,
) -> list[tuple[int, int, int]] | None:
    """The segments with one short segment joined to the one before (its count carried on),
    where that lets the readings tell which GPU the segment after it lacks, which they could not
    by the short one's blocks (bursts right after a GPU stopped answering restart the count for
    a few blocks off both the old and the new block size; `_refine` then moves the boundary to
    where the readings change); None when there is no such segment."""
    for k in range(2, len(segments)):
        (a0, _, n0), (a1, b1, n1), (b, c, n) = segments[k - 2 : k + 1]
        if mapping[k] is not None or mapping[k - 2] is None or n0 != n1 or b1 - a1 > REFINE_BLOCKS * n1:
            continue
        trial = [*segments[: k - 2], (a0, b1, n0), *segments[k:]]
        trial_map = [*mapping[: k - 1], *mapping[k:]]
        prev = _block_before(trial, trial_map, k - 1, b)
        if _choose_mapping(b, c, n, n_gpus, p, m, prev) is not None:
            return trial
    return None


def _merged(
    segments: list[tuple[int, int, int]], mapping: list[np.ndarray | None]
) -> tuple[list[tuple[int, int, int]], list[np.ndarray | None]]:
    """Segments that continue the one before (same block, same GPUs, on its count) joined: the
    same numbering, with room on both sides of each boundary left to move."""
    segs, maps = [segments[0]], [mapping[0]]
    for (a, b, n), mp in zip(segments[1:], mapping[1:], strict=True):
        a0, _, n0 = segs[-1]
        mp0 = maps[-1]
        if n == n0 and (a - a0) % n == 0 and mp is not None and mp0 is not None and (mp == mp0).all():
            segs[-1] = (a0, b, n)
        else:
            segs.append((a, b, n))
            maps.append(mp)
    return segs, maps


def _rejoin(
    segments: list[tuple[int, int, int]],
    mapping: list[np.ndarray | None],
    n_gpus: int,
    p: np.ndarray,
    m: np.ndarray,
) -> bool:
    """Join (in place) each segment to the one before where both count blocks of the same GPUs,
    the stamps restarted the count off the earlier one's, and the readings say the earlier count
    goes on: bursts a few instants apart put starts off the count every other start, as lost
    lines or instants of one line fewer do, though no line was lost. Whether any joined."""
    k, joined = 1, False
    while k < len(segments):
        (a1, _, n1), (b, c, n) = segments[k - 1], segments[k]
        mp1, mp = mapping[k - 1], mapping[k]
        if (
            n == n1
            and (b - a1) % n
            and mp is not None
            and mp1 is not None
            and (mp == mp1).all()
            and _count_goes_on(a1, b, c, n, n_gpus, mp, p, m)
        ):
            segments[k - 1] = (a1, c, n)
            del segments[k], mapping[k]
            joined = True
        else:
            k += 1
    return joined


def _count_goes_on(
    a1: int, b: int, c: int, n: int, n_gpus: int, mp: np.ndarray, p: np.ndarray, m: np.ndarray
) -> bool:
    """Whether the lines from the last full block before slot `b` to JOIN_BLOCKS blocks after it
    continue each GPU's readings (the median of REF_BLOCKS blocks before) counted in n-line blocks
    from `a1` clearly better than counted afresh from `b` (the lines before `b` then a short
    instant): by a whole mismatch per block compared at least, far beyond what noise on GPUs that
    read alike gives, so only readings that tell the GPUs apart join."""
    full_end = a1 + (b - a1) // n * n
    k_ref = min(REF_BLOCKS, (full_end - a1) // n)
    k = min(JOIN_BLOCKS, (c - b) // n)
    if k_ref == 0 or k == 0:
        return False
    firsts = [full_end - (j + 1) * n for j in range(k_ref)]
    ref = np.full((n_gpus, 2), np.nan)
    ref[mp, 0] = np.median(np.stack([p[f : f + n] for f in firsts]), axis=0)
    ref[mp, 1] = np.median(np.stack([m[f : f + n] for f in firsts]), axis=0)
    if np.isnan(ref[:, 0]).all():
        return False
    end = b + k * n
    old_lines = np.arange(full_end, end)
    old = _cost2(old_lines, mp[(old_lines - a1) % n], p, m, ref)
    new_lines = np.arange(b, end)
    new = _cost2(new_lines, mp[(new_lines - b) % n], p, m, ref)
    if b > full_end:
        new += _best_short(np.arange(full_end, b), n_gpus, p, m, ref)
    return bool(new - old >= MAX_TERM * k)


def _refine(
    segments: list[tuple[int, int, int]],
    mapping: list[np.ndarray | None],
    n_gpus: int,
    p: np.ndarray,
    m: np.ndarray,
) -> bool:
    """Move each boundary between two placed segments by whole blocks of the later one where the
    readings say so: the stamps put it within a few blocks (an early-stamped GPU 0 line or a
    burst hides an instant's start), and each GPU's memory.used and power continue across the
    true boundary only. Whether any moved."""
    moved = False
    for k in range(len(segments) - 1):
        (a1, _, n1), (b, c, n2) = segments[k], segments[k + 1]
        mp1, mp2 = mapping[k], mapping[k + 1]
        if mp1 is None or mp2 is None or (n1 == n2 and (mp1 == mp2).all()):
            continue
        if isinstance(mp1, SteadyChoice) or isinstance(mp2, SteadyChoice):
            continue  # single instants do not tell these GPUs apart: the edge stays unplaced
        reach = max(REFINE_BLOCKS, REFINE_LINES // n2)
        j_lo = min(reach, (b - a1 - n1) // n2)
        j_hi = min(reach, (c - b) // n2 - 2)  # keep a block after as reference
        lo, hi = b - j_lo * n2 - n1, b + (j_hi + 1) * n2
        before = _block_ending(segments, mapping, k, lo)
        if j_lo < 0 or j_hi < 0 or before is None or hi + n2 > c:
            continue
        refs = np.full((2, n_gpus, 2), np.nan)
        r0, rn, rmp, ra = before
        # The median of a few blocks each side: one block's power is as noisy as the GPUs' own
        # differences on some boards.
        back = [r0 - j * rn for j in range(REF_BLOCKS) if r0 - j * rn >= ra]
        ahead = [hi + j * n2 for j in range(REF_BLOCKS) if hi + (j + 1) * n2 <= c]
        with warnings.catch_warnings():  # a column without readings (no memory.used): NaN
            warnings.simplefilter("ignore", RuntimeWarning)
            for side, firsts, width, gpus_of in ((0, back, rn, rmp), (1, ahead, n2, mp2)):
                for col, values in ((0, p), (1, m)):
                    blocks = np.stack([values[f : f + width] for f in firsts])
                    refs[side, gpus_of, col] = np.nanmedian(blocks, axis=0)
        ref = _combined(refs)
        scored = []
        for j in range(-j_lo, j_hi + 1):
            x = b + j * n2
            full_end = a1 + (x - a1) // n1 * n1
            cost = 0.0
            if full_end > lo:
                ls = np.arange(lo, full_end)
                cost += _cost2(ls, mp1[(ls - a1) % n1], p, m, ref)
            if x > full_end:  # a short instant: the GPUs it continues best
                ls = np.arange(max(full_end, lo), x)
                cost += _best_short(ls, n_gpus, p, m, ref)
            ls = np.arange(x, hi)
            cost += _cost2(ls, mp2[(ls - x) % n2], p, m, ref)
            scored.append((cost, x))
        scored.sort()
        here = next(cost for cost, x in scored if x == b)
        if scored[0][1] != b and here - scored[0][0] >= PLACE_MARGIN:
            x = scored[0][1]
            segments[k], segments[k + 1] = (a1, x, n1), (x, c, n2)
            moved = True
    return moved


def _block_ending(
    segments: list[tuple[int, int, int]], mapping: list[np.ndarray | None], k: int, upto: int
) -> tuple[int, int, np.ndarray, int] | None:
    """The last full block of segment `k` or an earlier one that ends by slot `upto`, its GPUs
    known: (first slot, size, GPUs, its segment's first slot)."""
    for j in range(k, -1, -1):
        a0, b0, n0 = segments[j]
        mp = mapping[j]
        full = (min(b0, upto) - a0) // n0
        if mp is not None and full > 0:
            return a0 + (full - 1) * n0, n0, mp, a0
    return None


def _best_short(lines: np.ndarray, n_gpus: int, p: np.ndarray, m: np.ndarray, ref: np.ndarray) -> float:
    """The lowest cost of a short instant's lines over every choice of GPUs in order (as
    `_cost` would score each choice, all at once)."""
    if np.isnan(ref[:, 0]).all():
        return MAX_TERM * lines.size
    cols = [(p[lines], ref[:, 0], POWER_STEP_W, POWER_STEP_SHARE)]
    if not np.isnan(m[lines]).all():
        cols.append((m[lines], ref[:, 1], MEMORY_STEP_MIB, MEMORY_STEP_SHARE))
    per = np.zeros((lines.size, n_gpus))  # line x GPU
    for x, r, step, share in cols:
        t = _step(x[:, None], r[None, :], step, share)
        unknown = np.isnan(t) & ~np.isnan(x)[:, None]
        per += np.where(np.isnan(t), 0.0, t) + unknown * (MAX_TERM / 2)
    choices = np.asarray(list(itertools.combinations(range(n_gpus), lines.size)), np.int64)
    if choices.size == 0:
        return 0.0
    return float(per[np.arange(lines.size), choices].sum(axis=1).min())


def _cost2(lines: np.ndarray, gpus: np.ndarray, p: np.ndarray, m: np.ndarray, ref: np.ndarray) -> float:
    """How badly lines continue their GPUs' readings `ref` (before and after, `_combined`)."""
    c = _cost(lines, gpus, p, m, ref)
    return c if c == c else MAX_TERM * lines.size


def _combined(refs: np.ndarray) -> np.ndarray:
    """Each GPU's readings before and after (refs: 2 x GPU x [power, memory]): their mean, or
    the one known (a GPU missing on one side is compared with the other side alone)."""
    known = ~np.isnan(refs)
    total = np.where(known, refs, 0.0).sum(axis=0)
    count = known.sum(axis=0)
    out: np.ndarray = np.where(count > 0, total / np.maximum(count, 1), np.nan)
    return out


def _block_before(
    segments: list[tuple[int, int, int]], mapping: list[np.ndarray | None], k: int, a: int
) -> tuple[int, int, np.ndarray, int] | None:
    """A full block before slot `a` whose GPUs are known: (first slot, size, GPUs); a few blocks
    back where there are (the stamps may have put the boundary a few blocks late), and the first
    slot of its segment."""
    for j in range(k - 1, -1, -1):
        a0, b0, n0 = segments[j]
        mp = mapping[j]
        full = (b0 - a0) // n0
        if mp is not None and full:
            return a0 + (full - 1 - min(full - 1, REFINE_BLOCKS)) * n0, n0, mp, a0
    return None


def _step(x: np.ndarray, ref: np.ndarray, step: float, share: float) -> np.ndarray:
    """Mismatch of readings `x` with `ref`, in typical steps; NaN where either is unknown."""
    d = np.abs(x - ref) / np.maximum(step, share * np.abs(ref))
    out: np.ndarray = np.minimum(d, MAX_TERM)
    return out


def _cost(lines: np.ndarray, gpus: np.ndarray, p: np.ndarray, m: np.ndarray, ref: np.ndarray) -> float:
    """How badly lines (slots) continue the readings `ref` (GPU x [power, memory]) of `gpus`: a
    line given to a GPU with no reading to continue costs half the most a mismatch can."""
    terms = [_step(p[lines], ref[gpus, 0], POWER_STEP_W, POWER_STEP_SHARE)]
    if not np.isnan(m[lines]).all():
        terms.append(_step(m[lines], ref[gpus, 1], MEMORY_STEP_MIB, MEMORY_STEP_SHARE))
    t = np.concatenate(terms)
    if np.isnan(ref[:, 0]).all():
        return float("nan")
    unknown = np.isnan(t) & np.concatenate([~np.isnan(p[lines])] + [~np.isnan(m[lines])] * (len(terms) - 1))
    return float(np.nansum(t) + unknown.sum() * MAX_TERM / 2)


def _choose_mapping(
    a: int,
    b: int,
    n: int,
    n_gpus: int,
    p: np.ndarray,
    m: np.ndarray,
    prev: tuple[int, int, np.ndarray, int] | None,
) -> np.ndarray | None:
    """The GPUs of a stretch whose instants have n < N lines (a GPU not answering): the n of N,
    in order, whose readings before the stretch its first instants continue best; None when no
    choice is clearly best."""
    if prev is None:
        return None
    ref = np.full((n_gpus, 2), np.nan)
    p0, n0, mp0, a0 = prev
    # The median of a few blocks: one block's power is too noisy a reference where GPUs draw
    # alike (memory.used then tells them apart).
    firsts = [p0 - j * n0 for j in range(REF_BLOCKS) if p0 - j * n0 >= a0]
    ref[mp0, 0] = np.median(np.stack([p[f : f + n0] for f in firsts]), axis=0)
    ref[mp0, 1] = np.median(np.stack([m[f : f + n0] for f in firsts]), axis=0)
    k = min((b - a) // n, COMPARE_INSTANTS)
    if k == 0:
        return None
    lines = np.arange(a, a + k * n)
    best = _best(itertools.combinations(range(n_gpus), n), lines, n, p, m, ref)
    return best if best is not None else _by_steady_power(a, b, n, n_gpus, p, prev)


# Where the first instants do not tell (GPUs reading alike within their noise), each GPU's own
# steady power may: the median of up to STEADY_INSTANTS instants each side, on a level that holds
# (the stretch's median within STEADY_LEVEL_SHARE of the blocks' before it), the best choice's
# summed mismatch at least STEADY_MARGIN_W below the next one's.
STEADY_INSTANTS = 30
STEADY_LEVEL_SHARE = 0.05
STEADY_MARGIN_W = 8.0


def _by_steady_power(
    a: int, b: int, n: int, n_gpus: int, p: np.ndarray, prev: tuple[int, int, np.ndarray, int]
) -> np.ndarray | None:
    """The n GPUs of a short stretch told apart by each GPU's steady power (18-45 W apart on
    real boards at one level), or None where the levels do not differ clearly."""
    p0, n0, mp0, a0 = prev
    firsts = [p0 - j * n0 for j in range(STEADY_INSTANTS) if p0 - j * n0 >= a0]
    k = min((b - a) // n, STEADY_INSTANTS)
    if k < COMPARE_INSTANTS or len(firsts) < COMPARE_INSTANTS:
        return None
    ref = np.full(n_gpus, np.nan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        ref[mp0] = np.nanmedian(np.stack([p[f : f + n0] for f in firsts]), axis=0)
        here = np.nanmedian(p[a : a + k * n].reshape(k, n), axis=0)
    level = float(np.nanmedian(ref))
    if not np.isfinite(here).all() or abs(float(np.median(here)) - level) > STEADY_LEVEL_SHARE * level:
        return None
    scored = []
    for ch in itertools.combinations(range(n_gpus), n):
        c = float(np.abs(here - ref[list(ch)]).sum())
        if c == c:
            scored.append((c, ch))
    if not scored:
        return None
    scored.sort(key=lambda x: x[0])
    if len(scored) > 1 and scored[1][0] - scored[0][0] < STEADY_MARGIN_W:
        return None
    return np.asarray(scored[0][1], np.int64).view(SteadyChoice)


class SteadyChoice(np.ndarray):
    """A segment's GPUs told by their steady power alone: right for the stretch, but no single
    instant's readings place its edges, so the blocks around them are left unplaced."""


def _edges_of_steady(
    segments: list[tuple[int, int, int]], mapping: list[np.ndarray | None], n_slots: int
) -> list[tuple[int, int]]:
    """[first, end) slots around each edge of a segment placed by steady power: as far either
    side as the stamps may put an edge off (`_refine`'s reach), on both segments."""
    out = []
    for k, (a, b, n) in enumerate(segments):
        if not isinstance(mapping[k], SteadyChoice):
            continue
        reach = max(REFINE_BLOCKS, REFINE_LINES // n) * n
        out += [(max(0, a - reach), min(n_slots, a + reach)), (max(0, b - reach), min(n_slots, b + reach))]
    return out


def _best(
    choices: itertools.combinations[tuple[int, ...]],
    lines: np.ndarray,
    n: int,
    p: np.ndarray,
    m: np.ndarray,
    ref: np.ndarray,
) -> np.ndarray | None:
    """The choice of GPUs (for each block of n lines) with the clearly lowest cost, or None."""
    scored = []
    for ch in choices:
        g = np.tile(np.asarray(ch), lines.size // n)
        scored.append((_cost(lines, g, p, m, ref), ch))
    scored = [s for s in scored if s[0] == s[0]]
    if not scored:
        return None
    scored.sort(key=lambda s: s[0])
    best = scored[0]
    if len(scored) > 1 and scored[1][0] - best[0] < PLACE_MARGIN:
        return None
    return np.asarray(best[1], np.int64)


def _values_before(gpu: np.ndarray, p: np.ndarray, m: np.ndarray, at: int, n_gpus: int) -> np.ndarray:
    """Each GPU's readings on its last placed line before slot `at` (GPU x [power, memory])."""
    ref = np.full((n_gpus, 2), np.nan)
    lo = max(0, at - 3 * n_gpus)
    for s in range(at - 1, lo - 1, -1):
        g = gpu[s]
        if g >= 0 and np.isnan(ref[g, 0]):
            ref[g] = p[s], m[s]
    return ref


def _values_after(
    segments: list[tuple[int, int, int]],
    mapping: list[np.ndarray | None],
    k: int,
    p: np.ndarray,
    m: np.ndarray,
    n_gpus: int,
) -> np.ndarray:
    """Each GPU's readings on the first full block of segment `k` (GPU x [power, memory])."""
    ref = np.full((n_gpus, 2), np.nan)
    if k >= len(segments) or mapping[k] is None:
        return ref
    a, b, n = segments[k]
    if b - a < n:
        return ref
    mp = mapping[k]
    assert mp is not None
    ref[mp, 0] = p[a : a + n]
    ref[mp, 1] = m[a : a + n]
    return ref


def _place(
    lines: np.ndarray,
    n_gpus: int,
    p: np.ndarray,
    m: np.ndarray,
    ref_prev: np.ndarray,
    ref_next: np.ndarray,
) -> np.ndarray | None:
    """The GPUs of a short instant's lines (in order): those whose readings before and after
    they continue clearly best; None when the readings do not tell."""
    ref = _combined(np.stack([ref_prev, ref_next]))
    scored = []
    for ch in itertools.combinations(range(n_gpus), lines.size):
        c = _cost(lines, np.asarray(ch), p, m, ref)
        if c == c:
            scored.append((c, ch))
    if not scored:
        return None
    scored.sort(key=lambda s: s[0])
    if len(scored) > 1 and scored[1][0] - scored[0][0] < PLACE_MARGIN:
        return None
    return np.asarray(scored[0][1], np.int64)
