"""A trace spilled to disk as it is read: a file per GPU and column (raw little-endian values,
read back by offset), and an index.

`replay` reads its input files one at a time; past a size it writes each file's samples here
instead of holding them, and books the trace window by window from the files
(`tracesource.SpilledTrace`): its memory then follows one input file and one window, not the
trace. The samples are the ones `tracefiles.combine` would hold, GPU for GPU: numbered by
(host, index) across files, each GPU's sorted by time, a duplicate stamp of one GPU kept from
the later line.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from costexporter.core.diagnostics import Diagnostics, InputError
from costexporter.core.model import GpuId, Samples
from costexporter.core.tracefiles import SampleChunk

# Each column's values, little-endian whatever the machine (a spill directory may be read elsewhere).
DTYPES: dict[str, str] = {"ts_ms": "<i8", "power_w": "<f8", "util_pct": "<f8", "energy_mj": "<f8"}
INDEX = "index.json"


def column_path(directory: Path, gpu: int, name: str) -> Path:
    return directory / f"gpu{gpu:06d}.{name}"


def read_column(directory: Path, gpu: int, name: str, start: int = 0, count: int = -1) -> np.ndarray:
    """`count` values (-1: all) of GPU `gpu`'s column from row `start`: only those bytes read."""
    dtype = np.dtype(DTYPES[name])
    return np.fromfile(column_path(directory, gpu, name), dtype, count, offset=start * dtype.itemsize)


def _part_path(directory: Path, order: int, k: int, name: str) -> Path:
    return directory / f"part{order:06d}.{k:05d}.{name}"


@dataclass(frozen=True, slots=True)
class Index:
    gpus: list[GpuId]
    counts: np.ndarray  # int64 per GPU
    first_ms: np.ndarray
    last_ms: np.ndarray


def read_index(directory: Path) -> Index:
    d = json.loads((directory / INDEX).read_text())
    return Index(
        [GpuId(g["host"], g["index"], g["uuid"], g["name"], g["power_limit_w"]) for g in d["gpus"]],
        np.asarray(d["counts"], np.int64),
        np.asarray(d["first_ms"], np.int64),
        np.asarray(d["last_ms"], np.int64),
    )


@dataclass(slots=True)
class _Part:
    order: int  # the input's position: a later one's duplicate stamp wins
    k: int
    count: int
    first_ms: int
    last_ms: int


# Per GPU (host, index): its UUID, name and power limit, as an input names them.
_Attrs = tuple[dict[tuple[str, int], str], dict[tuple[str, int], str], dict[tuple[str, int], float]]


class SpillStore:
    """Receives a trace's chunks (one per input file, from any thread) and writes them out."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._parts: dict[tuple[str, int], list[_Part]] = {}
        self._attrs: list[tuple[int, _Attrs]] = []  # (order, what the input names its GPUs)
        self.duplicates = 0

    def add(self, chunk: SampleChunk, order: int) -> None:
        """Write one input's samples, each GPU's sorted by time (`Samples.sort`)."""
        hosts = chunk.hosts
        width = int(chunk.index.max(initial=0)) + 1
        key = (
            chunk.host if chunk.host is not None else np.zeros(chunk.index.size, np.int64)
        ) * width + chunk.index
        keys, local = np.unique(key, return_inverse=True)
        n = chunk.index.size
        energy = chunk.energy_mj if chunk.energy_mj is not None else np.full(n, np.nan)
        raw = Samples(
            [GpuId("", int(i)) for i in range(keys.size)],
            local.astype(np.int32),
            chunk.ts_ms,
            chunk.power_w,
            chunk.util_pct,
            energy,
        )
        s = raw.sort()
        bounds = np.searchsorted(s.gpu, np.arange(keys.size + 1), "left")
        written = []
        for k in range(keys.size):
            a, b = int(bounds[k]), int(bounds[k + 1])
            for name in DTYPES:
                np.ascontiguousarray(getattr(s, name)[a:b], DTYPES[name]).tofile(
                    _part_path(self.dir, order, k, name)
                )
            gpu_key = (hosts[int(keys[k]) // width], int(keys[k]) % width)
            written.append((gpu_key, _Part(order, k, b - a, int(s.ts_ms[a]), int(s.ts_ms[b - 1]))))
        with self._lock:
            for gpu_key, part in written:
                self._parts.setdefault(gpu_key, []).append(part)
            self._attrs.append((order, (chunk.uuid, chunk.name, chunk.power_limit_w)))
            self.duplicates += len(raw) - len(s)

    def finish(self, diag: Diagnostics | None = None) -> Path:
        """Number the GPUs as `tracefiles.combine` does, join each GPU's parts, write the index."""
        uuids: dict[tuple[str, int], str] = {}
        names: dict[tuple[str, int], str] = {}
        limits: dict[tuple[str, int], float] = {}
        for _, (u, n, lim) in sorted(self._attrs, key=lambda x: x[0]):
            uuids.update(u)
            names.update(n)
            limits.update(lim)
        gpus, counts, first, last = [], [], [], []
        for g, gk in enumerate(sorted(self._parts)):
            parts = sorted(self._parts[gk], key=lambda p: p.order)
            if len(parts) == 1:  # the usual case: its input's files are its own
                p = parts[0]
                for name in DTYPES:
                    os.replace(_part_path(self.dir, p.order, p.k, name), column_path(self.dir, g, name))
                n_rows, lo, hi = p.count, p.first_ms, p.last_ms
            else:
                n_rows, lo, hi = self._merge(g, parts)
            gpus.append(GpuId(gk[0], gk[1], uuids.get(gk), names.get(gk), limits.get(gk)))
            counts.append(n_rows)
            first.append(lo)
            last.append(hi)
        (self.dir / INDEX).write_text(
            json.dumps(
                {
                    "gpus": [
                        {
                            "host": g.host,
                            "index": g.index,
                            "uuid": g.uuid,
                            "name": g.name,
                            "power_limit_w": g.power_limit_w,
                        }
                        for g in gpus
                    ],
                    "counts": counts,
                    "first_ms": first,
                    "last_ms": last,
                }
            )
        )
        if diag is not None and self.duplicates:
            # Two readings of one GPU at the same ms: the later line is kept, the other counted.
            diag.counts["duplicate_sample"] += self.duplicates
        return self.dir

    def _merge(self, g: int, parts: list[_Part]) -> tuple[int, int, int]:
        """One GPU in several inputs: its parts joined in input order, sorted by time and
        deduplicated together (the later input's stamp kept), written as GPU `g`'s columns.
        Returns its count, first and last stamp."""
        cols = {
            name: np.concatenate([np.fromfile(_part_path(self.dir, p.order, p.k, name), dt) for p in parts])
            for name, dt in DTYPES.items()
        }
        order = np.argsort(cols["ts_ms"], kind="stable")
        ts = cols["ts_ms"][order]
        keep = np.ones(ts.size, bool)
        keep[:-1] = ts[1:] != ts[:-1]
        order = order[keep]
        self.duplicates += int((~keep).sum())
        for name, col in cols.items():
            col[order].tofile(column_path(self.dir, g, name))
        for p in parts:
            for name in DTYPES:
                _part_path(self.dir, p.order, p.k, name).unlink()
        return int(order.size), int(ts[0]), int(ts[-1])


# A trace of more samples than this is spilled to disk as it is read (`TraceIntake`).
SPILL_ROWS = 2_000_000
# What a spilled sample takes on disk: its stamp, power, utilization and energy, 8 bytes each.
SPILL_BYTES_PER_SAMPLE = 32


class TraceIntake:
    """The chunks of a trace as its inputs are read (in any order, from any thread): held in
    memory while they are few, spilled (and every later one) once they hold more than
    `spill_rows` samples (None: never), to a directory of its own made under `parent` (default:
    the system's temporary directory) and removed by `close`. `trace` is then the samples in
    memory, or the spilled trace's directory."""

    def __init__(self, spill_rows: int | None = SPILL_ROWS, parent: Path | None = None) -> None:
        self.spill_rows = spill_rows
        # Made at once, so that an unusable parent is said before anything is read.
        self.directory = (
            None if spill_rows is None else Path(tempfile.mkdtemp(prefix="costexporter-replay-", dir=parent))
        )
        self._lock = threading.Lock()
        self._held: list[tuple[int, SampleChunk]] = []
        self._rows = 0
        self.store: SpillStore | None = None

    def __enter__(self) -> TraceIntake:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove the spilled trace (its directory and everything in it)."""
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)

    def add(self, chunk: SampleChunk, order: int) -> None:
        with self._lock:
            spill = self.store
            if spill is None:
                self._held.append((order, chunk))
                self._rows += chunk.index.size
                if self.directory is None or self.spill_rows is None or self._rows <= self.spill_rows:
                    return
                spill = self.store = SpillStore(self.directory)
                held, self._held = self._held, []
            else:
                held = [(order, chunk)]
        for o, c in held:  # (outside the lock: the other readers go on)
            with self._said():
                spill.add(c, o)

    def trace(self, diag: Diagnostics | None = None) -> Samples | Path:
        """The samples (`tracefiles.combine`), or the directory of the spilled trace."""
        from costexporter.core.tracefiles import combine

        if self.store is None:
            return combine([c for _, c in sorted(self._held, key=lambda x: x[0])], diag)
        with self._said():
            return self.store.finish(diag)

    @contextlib.contextmanager
    def _said(self) -> Iterator[None]:
        """A disk that is full or refuses the spill: one line (InputError), not a traceback."""
        try:
            yield
        except OSError as e:
            raise InputError(
                f"spilling the trace to {self.directory}: {e.strerror or e} (a spilled trace takes "
                f"~{SPILL_BYTES_PER_SAMPLE} bytes a sample: give --spill-dir on a disk with room)"
            ) from None
