"""Job figures both books compute the same way: the live agent round by round
(costexporter.live), offline replay once over the whole trace (costexporter.replay).

Pure: incidents from booked pieces, the job-level step figures, the GPU time at risk since the
last checkpoint. Sharing them is what keeps the live and offline books from drifting apart.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from costexporter.core.booking import Pieces, Timeline
from costexporter.core.model import CATEGORIES, WASTED_CATEGORIES, Band

# One open incident: category, start, end, gpu_ms, ranks, zero_util_ranks, host. A JSON record
# (the agent's watermark stores it, older ones lack keys), so its values are Any.
Incident = dict[str, Any]


def zero_util_ranks(
    pieces: Pieces, sel: np.ndarray, signatures: list[tuple[int, int, list[int]]], tol_ms: int
) -> list[int]:
    """The ranks at ~0% in the signature runs that meet the deadlock-band pieces of `sel` (R2:
    the rank that left the collective); empty when none of them is in the deadlock band."""
    dead = sel & (pieces.band == Band.DEADLOCK)
    if not dead.any() or not signatures:
        return []
    s, e = pieces.start_ms[dead], pieces.end_ms[dead]
    return sorted(
        {int(rk) for a, b, zr in signatures if bool(((a < e + tol_ms) & (b > s - tol_ms)).any()) for rk in zr}
    )


def _present(gpu: np.ndarray) -> list[int]:
    """The distinct GPU indices of `gpu`, ascending (small non-negative ints: a count, not a sort)."""
    return np.flatnonzero(np.bincount(gpu)).tolist() if gpu.size else []


def extend_incidents(
    open_: dict[str, Incident],
    pieces: Pieces,
    own_ranks: np.ndarray,
    host: str,
    tol_ms: int,
    signatures: list[tuple[int, int, list[int]]] | None = None,
    cost: Callable[[Pieces], int] | None = None,
) -> dict[str, Incident]:
    """Extend or open the incidents (one open stretch per wasted category) with `pieces`;
    `signatures` (the window's confirmed signature runs) name a deadlock's ~0% ranks; `cost`
    (the live agent's prices: a selection of pieces -> micro-units) adds up each stretch's
    `cost_micro`."""
    out = {k: dict(v) for k, v in open_.items()}
    for c in sorted(WASTED_CATEGORIES):
        sel = pieces.category == c
        if not sel.any():
            continue
        _extend(
            out,
            CATEGORIES[c],
            int(pieces.start_ms[sel].min()),
            int(pieces.end_ms[sel].max()),
            int(pieces.gpu_ms[sel].sum()),
            sorted({int(own_ranks[g]) for g in _present(pieces.gpu[sel])}),
            zero_util_ranks(pieces, sel, signatures or [], tol_ms),
            host,
            tol_ms,
            None if cost is None else cost(pieces.take(sel)),
        )
    return out


def extend_rolled_back(
    open_: dict[str, Incident],
    spans: list[tuple[int, int]],
    gpu_ms: int,
    ranks: list[int],
    host: str,
    tol_ms: int,
    cost_micro: int | None = None,
) -> dict[str, Incident]:
    """The `rolled_back` incident of a resume whose voided steps were booked valid already (the
    live ledger moves their amounts by correction, not as pieces): the span of those steps
    that held valid time, and the GPU time moved. Replay books the same time as rolled_back
    pieces, so both books show the stretch."""
    out = {k: dict(v) for k, v in open_.items()}
    if spans and gpu_ms > 0:
        start, end = min(a for a, _ in spans), max(b for _, b in spans)
        _extend(out, "rolled_back", start, end, gpu_ms, ranks, [], host, tol_ms, cost_micro)
    return out


def _extend(
    out: dict[str, Incident],
    name: str,
    s: int,
    e: int,
    ms: int,
    ranks: list[int],
    zero: list[int],
    host: str,
    tol_ms: int,
    cost_micro: int | None = None,
) -> None:
    """One category's new stretch: it extends the open incident when it starts within `tol_ms`
    of its end, else it opens the next one."""
    cur = out.get(name)
    if cur is not None and s <= cur["end"] + tol_ms:
        cur["end"] = max(cur["end"], e)
        cur["gpu_ms"] += ms
        if cost_micro is not None:
            cur["cost_micro"] = cur.get("cost_micro", 0) + cost_micro
        cur["ranks"] = sorted(set(cur["ranks"]) | set(ranks))
        cur["zero_util_ranks"] = sorted(set(cur.get("zero_util_ranks", [])) | set(zero))
    else:
        out[name] = {
            "category": name,
            "start": s,
            "end": e,
            "gpu_ms": ms,
            "ranks": ranks,
            "zero_util_ranks": zero,
            "host": host,
            **({} if cost_micro is None else {"cost_micro": cost_micro}),
        }


def job_figures(tl: Timeline) -> dict[str, float]:
    """Job-level figures: the same for every agent that reads the job's events (SET, not added)."""
    steps = tl.steps
    summary = tl.summary  # a folded timeline's counts over records it no longer holds
    if summary is not None:
        n, n_voided, tokens, last = summary.n_steps, summary.n_voided, summary.valid_tokens, summary.last_step
    else:
        n, last = len(steps), steps[-1] if steps else None
        n_voided = sum(1 for s in steps if s.voided)
        tokens = sum(s.tokens for s in steps if not s.voided)
    return {
        "steps_completed": n,
        "steps_voided": n_voided,
        "valid_steps": n - n_voided,
        "tokens": tokens,
        "last_step": last.step if last else -1,
        "last_step_ts": last.ts_ms / 1000 if last else 0,
        "last_checkpoint_step": tl.last_checkpoint_step if tl.last_checkpoint_step is not None else -1,
        "last_checkpoint_ts": (tl.last_checkpoint_ms or 0) / 1000,
        "stall_threshold_s": tl.stall_threshold_ms / 1000,
        "ended": int(tl.end_ms is not None and not tl.lapsed),  # cleanly (a lapse is no end of it)
        # What dates the job's wall time (goodput's ETTR): its first registration, and its end
        # (a clean end, or its claim lapsing; 0 while it runs).
        "start_ts": tl.start_ms / 1000,
        "end_ts": tl.end_ms / 1000 if tl.end_ms is not None else 0,
    }


def at_risk_ms(tl: Timeline, horizon: int, member_start: np.ndarray) -> int:
    """GPU time since the job's last saved checkpoint (all of it without one), on these GPUs."""
    since = tl.last_checkpoint_ms
    return int(sum(max(0, horizon - max(int(ms), since or int(ms))) for ms in member_start))


AT_RISK_PREFIX = "at_risk:"  # a field of the job's figures hash per agent: `at_risk:<agent>`


def at_risk_field(agent: str) -> str:
    return AT_RISK_PREFIX + agent


def encode_at_risk(ms: int, checkpoint_ms: int | None, upto_ms: int) -> str:
    """One agent's GPU time at risk: `<ms>,<the checkpoint's time in ms or empty>,<booked to ms>`."""
    return f"{int(ms)},{'' if checkpoint_ms is None else int(checkpoint_ms)},{int(upto_ms)}"


def exact_at_risk_ms(
    figures: dict[str, str], checkpoint_ms: int, window_start_ms: int, window_end_ms: int
) -> int | None:
    """The job's GPU time at risk since the checkpoint at `checkpoint_ms`, summed over the agents'
    exact figures, when every agent counted from that checkpoint and the window holds what they
    counted; None otherwise (the caller reads the ledger's buckets)."""
    total, seen = 0, False
    for k, raw in figures.items():
        if not k.startswith(AT_RISK_PREFIX):
            continue
        try:
            ms_s, ck_s, upto_s = str(raw).split(",")
            ms, upto = int(ms_s), int(upto_s)
            ck = int(ck_s) if ck_s else None
        except ValueError:
            return None
        if ck != checkpoint_ms or ms < 0 or upto > window_end_ms or checkpoint_ms < window_start_ms:
            return None
        total, seen = total + ms, True
    return total if seen else None
