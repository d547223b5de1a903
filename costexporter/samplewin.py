"""A job's context window of samples, kept sorted by (rank, ts) from round to round.

A wide job's agent holds every rank's samples of the context window (a 4,096-GPU job: millions).
Sorting all of them every round cost more than the booking; here a round only sorts what is new
(its own GPUs' samples and the entries other hosts published since the last round) and merges
it into the window it kept, then drops what fell out of the window. The result is the array a
full stable sort of (own samples, then other hosts' samples in arrival order) would give.

Pure: numpy only.
"""

from __future__ import annotations

import numpy as np

Cols = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # rank, ts, p, u, e

_TS_BITS = 41  # ms timestamps below 2**41 (year 2039); ranks below 2**22: one int64 sort key
_RANK_LIMIT = 1 << (63 - _TS_BITS)
_TS_LIMIT = 1 << _TS_BITS
DTYPES = (np.int64, np.int64, np.float64, np.float64, np.float64)


def empty() -> Cols:
    return tuple(np.zeros(0, dt) for dt in DTYPES)  # type: ignore[return-value]


def _finite(c: Cols) -> Cols:
    """Power and energy readings that are not finite count as missing (NaN)."""
    r, t, p, u, e = c
    return r, t, np.where(np.isfinite(p), p, np.nan), u, np.where(np.isfinite(e), e, np.nan)


def _keyable(r: np.ndarray, t: np.ndarray) -> bool:
    return not r.size or (
        int(r.min()) >= 0 and int(r.max()) < _RANK_LIMIT and int(t.min()) >= 0 and int(t.max()) < _TS_LIMIT
    )


def _key(r: np.ndarray, t: np.ndarray) -> np.ndarray:
    return (r << _TS_BITS) | t


class SampleWindow:
    """A job's context window, sorted by (rank, ts): other hosts' samples (ties in arrival
    order) and, between rounds, this host's (rebuilt every round from what the agent holds)."""

    def __init__(self) -> None:
        self.cols: Cols = empty()
        self.keys = np.zeros(0, np.int64)
        self.ranks: set[int] = set()  # every rank with samples held (maybe a few more)
        self.own_held: set[int] = set()  # ranks whose held samples are this host's, not a peer's
        self.pending: list[Cols] = []  # entries read since the last round, in arrival order
        self.sorted_mode = True  # False once a sample cannot be keyed: a full sort every round

    @property
    def size(self) -> int:
        return int(self.cols[1].size) + sum(int(c[1].size) for c in self.pending)

    def nbytes(self) -> int:
        held = sum(a.nbytes for a in self.cols) + self.keys.nbytes
        return held + sum(a.nbytes for c in self.pending for a in c)

    def add(self, chunk: Cols) -> None:
        """Another host's entry, as read (booked into the window at the next round)."""
        self.pending.append(chunk)

    def round(self, own: Cols, lo_ms: int, own_ranks: set[int]) -> Cols:
        """The window of this round: `own` (this host's samples, in reading order) and every
        sample held or added, those at or after `lo_ms`, sorted by (rank, ts); ties keep own
        first, then arrival order. Afterwards peers' samples of `own_ranks` are no longer held.
        The arrays returned are held for the next round: read them, never write them."""
        new = tuple(np.concatenate(c) for c in zip(*self.pending, strict=True)) if self.pending else empty()
        self.pending = []
        new = _finite(new)  # type: ignore[arg-type]
        own = _finite(own)
        if self.sorted_mode and not (_keyable(new[0], new[1]) and _keyable(own[0], own[1])):
            self._strip_own()
            self.sorted_mode = False
        if not self.sorted_mode:
            return self._full(own, new, lo_ms, own_ranks)
        new_ranks = set(np.unique(new[0]).tolist())
        if (new_ranks | (self.ranks - self.own_held)) & own_ranks:
            # A peer's sample of one of this host's ranks (a rank that moved): shown this round
            # after this host's own, then no longer held, as the agent always did.
            self._strip_own()
            return self._merged(own, new, lo_ms, own_ranks)
        return self._spliced(own, new, lo_ms, own_ranks)

    def _spliced(self, own: Cols, new: Cols, lo_ms: int, own_ranks: set[int]) -> Cols:
        """The usual round: the window held, less what left it and this host's old samples, with
        the new samples spliced in; one copy of the window, no sort of what is held."""
        w = new[1] >= lo_ms
        if not w.all():
            new = tuple(a[w] for a in new)  # type: ignore[assignment]
        w = own[1] >= lo_ms
        if not w.all():
            own = tuple(a[w] for a in own)  # type: ignore[assignment]
        add = tuple(np.concatenate(c) for c in zip(own, new, strict=True))  # ranks disjoint here
        k = _key(add[0], add[1])
        order = np.argsort(k, kind="stable")
        k = k[order]
        add = tuple(a[order] for a in add)
        keys = self.keys
        n = keys.size
        pieces: list[tuple[int, int, int]] = []  # (0: held / 1: added, start, end), in order
        ranks = np.asarray(sorted(self.ranks), np.int64)
        held_ranks: list[int] = []
        ks: list[int] = []
        se: list[int] = []
        if ranks.size and n:
            seg_start = np.searchsorted(keys, ranks << _TS_BITS)
            seg_end = np.append(seg_start[1:], n)
            if lo_ms >= _TS_LIMIT:
                keep_start = seg_end.copy()
            else:
                keep_start = np.searchsorted(keys, (ranks << _TS_BITS) + max(lo_ms, 0))
            gone = np.isin(ranks, list(self.own_held | own_ranks))
            keep_start[gone] = seg_end[gone]
            kept = keep_start < seg_end
            held_ranks = ranks[kept].tolist()
            ks, se = keep_start[kept].tolist(), seg_end[kept].tolist()
        u: list[int] = []
        bs: list[int] = []
        be: list[int] = []
        if k.size:
            at = np.searchsorted(keys, k, side="right")  # after equal keys held: arrival order
            if ks:  # a place among dropped samples (this host's old ones): the next kept one's
                ks_a, se_a = np.asarray(ks, np.int64), np.asarray(se, np.int64)
                i = np.searchsorted(se_a, at, side="left")
                inside = i < ks_a.size
                nxt = np.where(inside, ks_a[np.minimum(i, ks_a.size - 1)], n)
                at = np.where(inside, np.maximum(at, nxt), n)
            uu, first = np.unique(at, return_index=True)
            u, bs = uu.tolist(), first.tolist()
            be = [*bs[1:], int(k.size)]
        g = 0
        for s0, e0 in zip(ks, se, strict=True):
            while g < len(u) and u[g] <= s0:
                pieces.append((1, bs[g], be[g]))
                g += 1
            cur = s0
            while g < len(u) and u[g] < e0:
                pieces.append((0, cur, u[g]))
                pieces.append((1, bs[g], be[g]))
                cur = u[g]
                g += 1
            pieces.append((0, cur, e0))
        pieces += [(1, bs[j], be[j]) for j in range(g, len(u))]
        if pieces != [(0, 0, n)]:
            srcs = [*zip(self.cols, add, strict=True), (keys, k)]
            del keys
            self.cols, self.keys = empty(), self.keys[:0]  # each old array goes as its new one comes
            out = []
            while srcs:
                held, added = srcs.pop(0)
                parts = [held[a:b] if src == 0 else added[a:b] for src, a, b in pieces]
                out.append(np.concatenate(parts) if parts else held[:0])
                del held, added, parts
            self.cols, self.keys = tuple(out[:5]), out[5]  # type: ignore[assignment]
        self.ranks = set(held_ranks) | set(np.unique(add[0]).tolist())
        self.own_held = set(np.unique(own[0]).tolist())
        for a in self.cols:
            a.flags.writeable = False  # held for the next round: a write would corrupt it
        return self.cols

    def _strip_own(self) -> None:
        """Drop the samples of this host held from the last round (they come again every round)."""
        if self.own_held:
            keep = ~np.isin(self.cols[0], list(self.own_held))
            self.cols = tuple(a[keep] for a in self.cols)  # type: ignore[assignment]
            self.keys = self.keys[keep] if self.keys.size else self.keys
            self.own_held = set()

    def _merged(self, own: Cols, new: Cols, lo_ms: int, own_ranks: set[int]) -> Cols:
        """Peers' samples held apart from this host's: the window is the two merged."""
        cols, keys = self.cols, self.keys
        if keys.size and int(cols[1].min()) < lo_ms:
            keep = cols[1] >= lo_ms
            cols, keys = tuple(a[keep] for a in cols), keys[keep]
        w = new[1] >= lo_ms
        if not w.all():
            new = tuple(a[w] for a in new)
        if new[1].size:
            k = _key(new[0], new[1])
            order = np.argsort(k, kind="stable")
            k = k[order]
            at = np.searchsorted(keys, k, side="right")  # after equal keys held: arrival order
            cols = tuple(np.insert(a, at, b[order]) for a, b in zip(cols, new, strict=True))
            keys = np.insert(keys, at, k)
            self.ranks.update(np.unique(new[0]).tolist())
        out = cols
        w = own[1] >= lo_ms
        if not w.all():
            own = tuple(a[w] for a in own)
        if own[1].size:
            k = _key(own[0], own[1])
            order = np.argsort(k, kind="stable")
            k = k[order]
            at = np.searchsorted(keys, k, side="left")  # before equal keys held: own first
            out = tuple(np.insert(a, at, b[order]) for a, b in zip(cols, own, strict=True))
        if self.ranks & own_ranks:  # a rank that became this host's: its samples are own now
            keep = ~np.isin(cols[0], list(own_ranks))
            cols, keys = tuple(a[keep] for a in cols), keys[keep]
            self.ranks = set(np.unique(cols[0]).tolist())
        self.cols, self.keys = cols, keys  # type: ignore[assignment]
        return out  # type: ignore[return-value]

    def _full(self, own: Cols, new: Cols, lo_ms: int, own_ranks: set[int]) -> Cols:
        """Timestamps or ranks out of the key's range: the whole window sorted, every round."""
        R, T, P, U, E = (np.concatenate(c) for c in zip(own, self.cols, new, strict=True))
        w = lo_ms <= T
        R, T, P, U, E = (a[w] for a in (R, T, P, U, E))
        remote = ~np.isin(R, list(own_ranks))
        self.cols = tuple(a[remote] for a in (R, T, P, U, E))  # type: ignore[assignment]
        self.keys = np.zeros(0, np.int64)
        order = np.lexsort((T, R))
        return tuple(a[order] for a in (R, T, P, U, E))  # type: ignore[return-value]
