"""A job's context window of samples, kept sorted by (rank, ts) from round to round.

A wide job's agent holds every rank's samples of its band window (a 4,096-GPU job: tens of
thousands). A round sorts only what is new (its own GPUs' samples and the entries other hosts
published since the last round) and merges it into the window it kept, after dropping what fell
out of the window. The result is the array a full stable sort of (own samples, then other hosts'
samples in arrival order) would give.

Pure: numpy only.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

Cols = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # rank, ts, p, u, e

_TS_BITS = 41  # ms timestamps below 2**41 (year 2039); ranks below 2**22: one int64 sort key
_RANK_LIMIT = 1 << (63 - _TS_BITS)
_TS_LIMIT = 1 << _TS_BITS
DTYPES = (np.int64, np.int64, np.float64, np.float64, np.float64)


def _cols(arrays: Iterable[np.ndarray]) -> Cols:
    """Five columns as a `Cols` (mypy cannot count a generator's items; this unpacking can)."""
    r, t, p, u, e = arrays
    return r, t, p, u, e


def empty() -> Cols:
    return _cols(np.zeros(0, dt) for dt in DTYPES)


def _finite(c: Cols) -> Cols:
    """Power and energy readings that are not finite count as missing (NaN)."""
    r, t, p, u, e = c
    return r, t, np.where(np.isfinite(p), p, np.nan), u, np.where(np.isfinite(e), e, np.nan)


def _keyable(r: np.ndarray, t: np.ndarray) -> bool:
    return not r.size or (
        int(r.min()) >= 0 and int(r.max()) < _RANK_LIMIT and int(t.min()) >= 0 and int(t.max()) < _TS_LIMIT
    )


def _key(r: npt.NDArray[np.int64], t: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    return (r << _TS_BITS) | t


def keep_from(rank: np.ndarray, ts: np.ndarray, lo_ms: int) -> np.ndarray:
    """Rows (sorted by rank, ts) at or after `lo_ms`, and each rank's last row before it: its
    slice reaches into the window (a logger gap across the window's start stays a gap)."""
    ge = ts >= lo_ms
    if ge.all():
        return ge
    last = np.ones(ts.size, bool)
    last[:-1] = (rank[1:] != rank[:-1]) | ge[1:]
    return ge | last


class SampleWindow:
    """A job's window of other hosts' samples, sorted by (rank, ts), ties in arrival order; a
    round merges this host's samples (what the agent holds) into it."""

    def __init__(self) -> None:
        self.cols: Cols = empty()
        self.keys = np.zeros(0, np.int64)
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
        sample held or added, those at or after `lo_ms` and each rank's last before it
        (`keep_from`), sorted by (rank, ts); ties keep own first, then arrival order.
        Afterwards peers' samples of `own_ranks` are no longer held. The arrays returned are
        held for the next round: read them, never write them."""
        new = _cols(np.concatenate(c) for c in zip(*self.pending, strict=True)) if self.pending else empty()
        self.pending = []
        new = _finite(new)
        own = _finite(own)
        if self.sorted_mode and not (_keyable(new[0], new[1]) and _keyable(own[0], own[1])):
            self.sorted_mode = False
        if not self.sorted_mode:
            return self._full(own, new, lo_ms, own_ranks)
        return self._merged(own, new, lo_ms, own_ranks)

    def _merged(self, own: Cols, new: Cols, lo_ms: int, own_ranks: set[int]) -> Cols:
        """Peers' samples held apart from this host's: the window is the two merged, from
        `lo_ms` on (`keep_from`); the peers' part of it is held for the next round."""
        cols, keys = self.cols, self.keys
        if new[1].size:
            k = _key(new[0], new[1])
            order = np.argsort(k, kind="stable")
            k = k[order]
            at = np.searchsorted(keys, k, side="right")  # after equal keys held: arrival order
            cols = _cols(np.insert(a, at, b[order]) for a, b in zip(cols, new, strict=True))
            keys = np.insert(keys, at, k)
        if own[1].size:
            k = _key(own[0], own[1])
            order = np.argsort(k, kind="stable")
            k = k[order]
            at = np.searchsorted(keys, k, side="left")  # before equal keys held: own first
            cols = _cols(np.insert(a, at, b[order]) for a, b in zip(cols, own, strict=True))
            keys = np.insert(keys, at, k)
        keep = keep_from(cols[0], cols[1], lo_ms)
        if not keep.all():
            cols, keys = _cols(a[keep] for a in cols), keys[keep]
        if own_ranks:  # hold the peers' part only
            peers = ~np.isin(cols[0], list(own_ranks))
            self.cols, self.keys = _cols(a[peers] for a in cols), keys[peers]
        else:
            self.cols, self.keys = cols, keys
        return cols

    def _full(self, own: Cols, new: Cols, lo_ms: int, own_ranks: set[int]) -> Cols:
        """Timestamps or ranks out of the key's range: the whole window sorted, every round."""
        R, T, P, U, E = (np.concatenate(c) for c in zip(own, self.cols, new, strict=True))
        order = np.lexsort((T, R))
        R, T, P, U, E = (a[order] for a in (R, T, P, U, E))
        w = keep_from(R, T, lo_ms)
        R, T, P, U, E = (a[w] for a in (R, T, P, U, E))
        remote = ~np.isin(R, list(own_ranks))
        self.cols = _cols(a[remote] for a in (R, T, P, U, E))
        self.keys = np.zeros(0, np.int64)
        return R, T, P, U, E


# ---- a host's sample stream entries (`<p>:a:{job}:samples:<host>`, one per agent round) ----------
# A sample packed little-endian: rank, ts (ms), power W, utilization %, energy mJ (36 bytes).
ENTRY = np.dtype([("r", "<i4"), ("t", "<i8"), ("p", "<f8"), ("u", "<f8"), ("e", "<f8")])
ENTRY_NAMES: tuple[str, ...] = ENTRY.names or ()  # a structured dtype's names are never None


def encode_entry(cols: Cols, host: str | None = None) -> dict[str, str]:
    """One round of this host's samples as a stream entry: the samples packed (`ENTRY`) in field
    `b`, base64 (a round's entries of every peer then decode as one array), and the host that
    wrote them in field `h` (hosts share a stream)."""
    import base64

    rec = np.empty(cols[0].size, ENTRY)
    for name, a in zip(ENTRY_NAMES, cols, strict=True):
        rec[name] = a
    out = {"b": base64.b64encode(rec.tobytes()).decode()}
    if host is not None:
        out["h"] = host
    return out


def entry_bytes(fields: dict[str, str]) -> bytes:
    """An entry's packed samples (`ENTRY`); the older layout (a JSON list per column, NaN as
    null) packed the same way. Raises ValueError or KeyError on a damaged entry."""
    import base64
    import binascii
    import json

    if "b" in fields:
        try:
            raw = base64.b64decode(fields["b"], validate=True)
        except (binascii.Error, TypeError) as e:
            raise ValueError(f"not base64: {e}") from None
        if len(raw) % ENTRY.itemsize:
            raise ValueError("truncated entry")
        return raw
    cols = [np.asarray(json.loads(fields[c]), dt) for c, dt in zip("rtpue", DTYPES, strict=True)]
    if len({a.shape for a in cols}) != 1 or cols[0].ndim != 1:
        raise ValueError("columns of different lengths")
    rec = np.empty(cols[0].size, ENTRY)
    for name, a in zip(ENTRY_NAMES, cols, strict=True):
        rec[name] = a
    return rec.tobytes()


def decode_entries(raw: bytes) -> Cols:
    """Packed samples (one entry's, or many entries' joined) as columns."""
    rec = np.frombuffer(raw, ENTRY)
    return _cols(rec[name].astype(dt) for name, dt in zip(ENTRY_NAMES, DTYPES, strict=True))


def decode_entry(fields: dict[str, str]) -> Cols:
    return decode_entries(entry_bytes(fields))
