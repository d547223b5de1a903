"""Recorded traces: nvidia-smi CSV and JSONL samples, JSONL events.

The CSV path is vectorized with pyarrow (a million rows a second and more): every column is read
as text, units and `[N/A]` markers are stripped with Arrow compute kernels, and only rows that
fail validation are looked at one by one, to name their line in a warning.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.csv as pcsv

try:  # the compute kernels a clean file needs, without pyarrow.compute's start-up (see _pc)
    from pyarrow._compute import CastOptions, TrimOptions, call_function
except ImportError:  # pragma: no cover - a pyarrow that moved them
    from pyarrow.compute import CastOptions, TrimOptions, call_function

from costexporter.core import numbering, timeutil
from costexporter.core.diagnostics import Diagnostics, InputError
from costexporter.core.events import (
    FUTURE_SLACK_S,
    MIN_TS,
    EventError,
    UnknownEventType,
    parse_events,
)
from costexporter.core.model import Event, GpuId, Samples
from costexporter.core.timeutil import to_ms


def _pc() -> Any:  # pyarrow ships no types: Any at the boundary (pyproject [tool.mypy])
    """pyarrow.compute, imported on first use: it builds ~280 Python wrappers at import (30 ms of
    the command's start-up, measured), and only files with odd rows need more than a trim and a
    cast."""
    import pyarrow.compute as pc

    return pc


# pyarrow's default pool on Linux (mimalloc) maps fresh memory for a run's first large buffers:
# 0.2-0.4 s of kernel time per million CSV rows, measured, more than the parse itself. glibc's
# malloc reuses the process heap. ARROW_DEFAULT_MEMORY_POOL, when set, still decides.
if "ARROW_DEFAULT_MEMORY_POOL" not in os.environ:
    pa.set_memory_pool(pa.system_memory_pool())

NA_MARKERS = [
    "[N/A]",
    "N/A",
    "[Not Supported]",
    "[Unknown Error]",
    "[Insufficient Permissions]",
    "[GPU is lost]",
    "ERR!",
]
NUMBER_RE = r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$"
MAX_POWER_W = 10_000.0


@dataclass(slots=True)
class SampleChunk:
    """Samples of one file, before GPUs are numbered across files."""

    hosts: list[str]  # host names; `host` indexes into them
    host: np.ndarray | None  # int32; None: every row is of hosts[0]
    index: np.ndarray  # int64
    ts_ms: np.ndarray
    power_w: np.ndarray
    util_pct: np.ndarray
    energy_mj: np.ndarray | None  # None: no energy counter (NaN in every row)
    uuid: dict[tuple[str, int], str]  # per GPU, not per row
    name: dict[tuple[str, int], str]
    power_limit_w: dict[tuple[str, int], float]
    line: np.ndarray | None = None  # int64: each row's line in its file (header = 1)


def check_file(path: Path) -> bytes:
    """The first bytes of a usable text file; InputError with one clear line otherwise."""
    try:
        with path.open("rb") as f:
            head = f.read(8192)
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"{path}: is a directory, not a file") from None
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror or e}") from None
    if not head.strip():
        raise InputError(f"{path}: file is empty")
    if b"\0" in head:
        raise InputError(f"{path}: binary data, not a text trace")
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 4:  # not just a multi-byte char cut at the 8 KiB edge
            raise InputError(f"{path}: not UTF-8 text") from None
    return head


def sniff_format(path: Path) -> str:
    """'csv' or 'jsonl', from the first non-blank character."""
    head = check_file(path).lstrip()
    return "jsonl" if head[:1] in (b"{", b"[") else "csv"


# Column names other loggers (pynvml scripts, nanoGPT-style loggers, replay's own --timeline)
# write for what nvidia-smi calls timestamp, index, power.draw, utilization.gpu, uuid and name.
SYNONYMS = {
    **dict.fromkeys(("ts", "time", "datetime", "date_time", "wall_time", "walltime"), "timestamp"),
    **dict.fromkeys(("gpu", "gpu_index", "gpu_id", "gpu_idx", "device", "device_index"), "index"),
    **dict.fromkeys(("power_w", "power", "power_watts", "power_draw", "power_draw_w"), "power.draw"),
    **dict.fromkeys(
        ("util_pct", "util", "gpu_util", "utilization", "utilization_gpu", "utilization_gpu_percent"),
        "utilization.gpu",
    ),
    **dict.fromkeys(("gpu_uuid",), "uuid"),
    **dict.fromkeys(("gpu_name", "model", "gpu_model"), "name"),
}


# `--columns` names (what the column is) -> nvidia-smi's key.
COLUMN_ROLES = {
    "time": "timestamp",
    "timestamp": "timestamp",
    "gpu": "index",
    "index": "index",
    "power": "power.draw",
    "util": "utilization.gpu",
    "uuid": "uuid",
    "name": "name",
}


def parse_columns(text: str) -> dict[str, str]:
    """`gpu=gpu_index,power=power_W` -> {nvidia-smi key: the file's column name}; ValueError
    naming what is wrong."""
    out: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        role, sep, column = part.partition("=")
        role = role.strip().lower()
        if not sep or not column.strip():
            raise ValueError(f"--columns {part!r}: write ROLE=COLUMN, e.g. power=power_W")
        if role not in COLUMN_ROLES:
            raise ValueError(f"--columns {part!r}: the role is one of {', '.join(sorted(COLUMN_ROLES))}")
        out[COLUMN_ROLES[role]] = column.strip()
    return out


def column_key(name: str) -> str:
    """'power.draw [W]' -> 'power.draw'; a common other name -> nvidia-smi's ('power_W')."""
    key = name.strip().lower()
    if "[" in key:
        key = key[: key.index("[")].strip()
    return SYNONYMS.get(key, key)


UNIT_CHARS = " W%JkmMiBHz"


def numeric(col: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """Text like ' 951.20 W', '100 %', '[N/A]' to float64 (NaN for N/A), plus a bad-value mask."""
    # ASCII units: the same as utf8_trim, faster.
    s = call_function("ascii_trim", [col], TrimOptions(UNIT_CHARS))
    try:  # fast path: a clean column casts in one kernel
        x = call_function("cast", [s], CastOptions.safe(pa.float64()))  # (Array.cast imports pc)
        return x.to_numpy(zero_copy_only=False), np.zeros(len(col), bool)
    except pa.ArrowInvalid:
        pass
    pc = _pc()
    markers = pa.array(NA_MARKERS + [m.strip(UNIT_CHARS) for m in NA_MARKERS] + [""])
    na = pc.fill_null(pc.is_in(s, value_set=markers), True)
    ok = pc.fill_null(pc.match_substring_regex(s, NUMBER_RE), False)
    bad = ~ok.to_numpy(zero_copy_only=False) & ~na.to_numpy(zero_copy_only=False)
    x = pc.cast(pc.if_else(ok, s, pa.scalar(None, pa.string())), pa.float64())
    return x.to_numpy(zero_copy_only=False).astype(np.float64), bad


# 'YYYY/MM/DD HH:MM:SS.fff': the separators of the date and time (the date's may be '-', the
# middle one 'T'), and where the digits are.
_TS_SEPS = {4: b"/-", 7: b"/-", 10: b" T", 13: b":", 16: b":", 19: b"."}
_MINUTE_DIGITS = [0, 1, 2, 3, 5, 6, 8, 9, 11, 12, 14, 15]
_MONTH_DAYS = np.array([0, 31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31])


def _days_from_civil(
    y: npt.NDArray[np.int64], m: npt.NDArray[np.int64], d: npt.NDArray[np.int64]
) -> npt.NDArray[np.int64]:
    """Days since 1970-01-01 of proleptic Gregorian dates (H. Hinnant's algorithm)."""
    y = y - (m <= 2)
    era = y // 400
    yoe = y - era * 400
    doy = (153 * ((m + 9) % 12) + 2) // 5 + d - 1
    days: npt.NDArray[np.int64] = era * 146097 + yoe * 365 + yoe // 4 - yoe // 100 + doy - 719468
    return days  # (annotated: numpy's stubs lose the dtype in the mixed int/bool arithmetic above)


def _fixed_timestamps(col: pa.ChunkedArray) -> np.ndarray | None:
    """Epoch ms (the naive time read as UTC) of a column whose every value is exactly
    'YYYY/MM/DD HH:MM:SS' or 'YYYY/MM/DD HH:MM:SS.fff' (nvidia-smi writes nothing else), read
    as fixed-width digits straight from Arrow's buffer; None when any value is not (or is not
    a real date and time): the careful path decides those.

    Consecutive rows mostly share their minute ('YYYY/MM/DD HH:MM'), so dates are worked out
    once per minute and only the seconds per row."""
    out = []
    for ch in col.chunks:
        n = len(ch)
        if n == 0:
            continue
        if ch.null_count or not pa.types.is_string(ch.type):
            return None
        offs = np.frombuffer(ch.buffers()[1], np.int32, n + 1, ch.offset * 4)
        width = int(offs[1] - offs[0])
        if width not in (19, 23) or int(offs[-1] - offs[0]) != width * n or (np.diff(offs) != width).any():
            return None
        buf = ch.buffers()[2]
        b = np.frombuffer(buf, np.uint8, width * n, int(offs[0])).reshape(n, width)
        # Where the minute changes: its 16 bytes as two (unaligned) 8-byte words per row.
        words = [np.ndarray((n,), "<u8", buf, int(offs[0]) + k, (width,)) for k in (0, 8)]
        change = np.ones(n, bool)
        change[1:] = (words[0][1:] != words[0][:-1]) | (words[1][1:] != words[1][:-1])
        at = np.flatnonzero(change)
        head = b[at]
        for pos, allowed in _TS_SEPS.items():
            if pos < width:
                c = head[:, pos] if pos < 16 else b[:, pos]
                ok = c == allowed[0]
                if len(allowed) > 1:
                    ok |= c == allowed[1]
                if not ok.all():
                    return None
        dg = head[:, _MINUTE_DIGITS].astype(np.int64) - 48
        sec = b[:, [17, 18, 20, 21, 22][: 2 if width == 19 else 5]].astype(np.int32) - 48
        if ((dg < 0) | (dg > 9)).any() or ((sec < 0) | (sec > 9)).any():
            return None
        y = dg[:, 0] * 1000 + dg[:, 1] * 100 + dg[:, 2] * 10 + dg[:, 3]
        mo = dg[:, 4] * 10 + dg[:, 5]
        d = dg[:, 6] * 10 + dg[:, 7]
        hh = dg[:, 8] * 10 + dg[:, 9]
        mi = dg[:, 10] * 10 + dg[:, 11]
        leap = (y % 4 == 0) & ((y % 100 != 0) | (y % 400 == 0))
        dim = _MONTH_DAYS[np.clip(mo, 0, 12)] + (leap & (mo == 2))
        if not ((mo >= 1) & (mo <= 12) & (d >= 1) & (d <= dim) & (hh < 24) & (mi < 60)).all():
            return None
        ss = sec[:, 0] * 10 + sec[:, 1]
        if (ss >= 60).any():
            return None
        ms = ss * 1000
        if width == 23:
            ms += sec[:, 2] * 100 + sec[:, 3] * 10 + sec[:, 4]
        minute_ms = (_days_from_civil(y, mo, d) * 1440 + hh * 60 + mi) * 60_000
        out.append(np.repeat(minute_ms, np.diff(np.append(at, n))) + ms)
    return np.concatenate(out) if out else None


def timestamp_ms(col: pa.ChunkedArray, tz: str) -> tuple[np.ndarray, np.ndarray, str]:
    """Logged times to UTC epoch ms, the rows that are no time, and how they were read
    (`timeutil.parse_times`): nvidia-smi's local times ('2025/07/26 23:53:30.945') in zone `tz`
    on the fast path, else any ISO 8601 form with or without a zone, or Unix time."""
    fixed = _fixed_timestamps(col)
    if fixed is None:
        return timeutil.parse_times(col, tz)
    if tz.upper() in ("UTC", "Z", "+00:00"):
        return fixed, np.zeros(fixed.size, bool), "local"
    pc = _pc()
    t = pc.assume_timezone(
        pa.array(fixed, pa.timestamp("ms")), timezone=tz, ambiguous="earliest", nonexistent="earliest"
    )
    ms = pc.fill_null(pc.cast(t, pa.int64()), 0).to_numpy(zero_copy_only=False)
    return ms.astype(np.int64), np.zeros(len(col), bool), "local"


def read_nvidia_smi_csv(
    path: Path, host: str, tz: str, diag: Diagnostics, columns: Mapping[str, str] | None = None
) -> SampleChunk:
    """`nvidia-smi --query-gpu=... --format=csv[,nounits] -lms N` output, in any column order
    (or another logger's CSV: its column names as `columns` maps them, or the common ones)."""
    check_file(path)
    names, keys, ends_with_newline = _smi_header(path, columns)
    counts_before = diag.counts.copy()
    table, invalid, not_lines = csv_strings(path, names)
    n = table.num_rows
    line_of_row, last_line = row_lines(path, n, invalid, ends_with_newline, diag)
    col = {k: table.column(i) for i, k in enumerate(keys) if k}
    rows = RowFilter(str(path), n, line_of_row, diag)
    try:
        ts_ms, bad_ts, read_as = timestamp_ms(col["timestamp"], tz)
    except pa.ArrowInvalid as e:  # the shape of a timestamp, not a time ('2025/13/45 99:99:99')
        raise InputError(f"{path}: impossible timestamp: {e}") from None
    if read_as.startswith("unix_"):
        diag.note(str(path), f"timestamps read as Unix {read_as[5:]} (told by their magnitude)")
    skip = np.zeros(n, bool)  # rows that are no GPU's line
    if bad_ts.any():  # blank lines and repeated headers are skipped silently
        pc = _pc()
        ts_text = pc.utf8_lower(pc.utf8_trim_whitespace(col["timestamp"]))
        skip = pc.is_in(ts_text, value_set=pa.array(["", "timestamp"])).to_numpy(zero_copy_only=False)
        rows.drop |= skip
    if (
        not ends_with_newline
        and n
        and (not invalid or invalid[-1] != last_line)
        and not _last_row_complete(table)
    ):
        # The last line parsed with the right column count but was cut mid-value.
        diag.warn(str(path), int(line_of_row[-1]), "truncated_last_line", "skipped")
        rows.drop[-1] = True

    rows.bad(bad_ts, "bad_timestamp", "unparseable timestamp")
    now_ms = (time.time() + FUTURE_SLACK_S) * 1000
    rows.bad(
        (ts_ms > now_ms) | (ts_ms < MIN_TS * 1000),
        "bad_timestamp",
        "timestamp far outside the plausible range",
    )
    power, util = _smi_readings(col, names, keys, rows)
    if "index" in col:
        idx_f, bad = numeric(col["index"])
        rows.bad(bad | np.isnan(idx_f), "bad_value", "non-numeric index")
        index = np.nan_to_num(idx_f, nan=-1).astype(np.int64)
    else:
        index = _positional_index(
            ts_ms,
            rows.drop,
            lambda line, reason, why: diag.warn(str(path), line, reason, why),
            line_of_row,
            skip=skip,
            power=power,
            memory=(lambda: numeric(col["memory.used"])[0]) if "memory.used" in col else None,
            invalid_lines=[x for x in invalid if x not in set(not_lines)],
        )
        rows.drop |= index < 0

    drop = rows.drop
    keep = np.flatnonzero(~drop) if drop.any() else None  # None: every row
    _say_missing_gpus(
        index if keep is None else index[keep],
        ts_ms if keep is None else ts_ms[keep],
        line_of_row if keep is None else line_of_row[keep],
        lambda line, why: diag.warn(str(path), line, "gpu_missing", why),
    )
    if (keep is not None and keep.size == 0) or n == 0:
        raise no_usable_samples(path, diag, counts_before)
    uuids, gpu_names, limits = _smi_gpu_attributes(col, host, index, keep)
    lines = line_of_row
    if keep is not None:
        index, ts_ms, power, util = (a[keep] for a in (index, ts_ms, power, util))
        lines = lines[keep]
    return SampleChunk(
        hosts=[host],
        host=None,
        index=index,
        ts_ms=ts_ms,
        power_w=power,
        util_pct=util,
        energy_mj=None,
        uuid=uuids,
        name=gpu_names,
        power_limit_w=limits,
        line=lines,
    )


def csv_header(path: Path) -> tuple[list[str], bool]:
    """A CSV's column names, and whether the file ends with a newline (a last line without one
    may have been cut by a killed logger)."""
    with path.open("rb") as f:
        header = f.readline().decode("utf-8", "replace")
        f.seek(0, 2)
        size = f.tell()
        f.seek(max(size - 1, 0))
        ends_with_newline = f.read(1) in (b"\n", b"\r")
    return header.rstrip("\r\n").split(","), ends_with_newline


def _smi_header(path: Path, columns: Mapping[str, str] | None = None) -> tuple[list[str], list[str], bool]:
    """The header's column names, their keys, and whether the file ends with a newline (a last
    line without one may have been cut by a killed logger). InputError when the columns are
    not an nvidia-smi CSV's."""
    names, ends_with_newline = csv_header(path)
    keys = [column_key(c) for c in names]
    for key, column in (columns or {}).items():  # the user's mapping wins over the names
        at = [i for i, c in enumerate(names) if c.strip().lower() == column.lower()]
        if not at:
            at = [i for i, c in enumerate(names) if c.strip().lower().split(" [")[0] == column.lower()]
        if not at:
            raise InputError(
                f"{path}: --columns names {column!r}, which is not a column here "
                f"(columns: {', '.join(c.strip() for c in names)})"
            )
        keys = ["" if k == key else k for k in keys]
        keys[at[0]] = key
    if (
        "timestamp" not in keys
        or "utilization.gpu" not in keys
        or not ({"power.draw", "power.draw.instant", "power.draw.average"} & set(keys))
    ):
        raise InputError(
            f"{path}: not an nvidia-smi CSV: need columns timestamp, power.draw and "
            f"utilization.gpu (got {', '.join(k for k in keys if k) or 'none'})"
        )
    return names, keys, ends_with_newline


def csv_strings(path: Path, names: list[str]) -> tuple[pa.Table, list[int], list[int]]:
    """The CSV as strings, with the line numbers of the rows skipped as invalid and, among them,
    those that are no GPU's line (blank, a repeated header)."""
    invalid: list[int] = []
    not_lines: list[int] = []

    def on_invalid(row: pcsv.InvalidRow) -> str:
        invalid.append(row.number if row.number is not None else -1)
        text = (row.text or "").strip().lower()
        if not text or text.startswith("timestamp"):
            not_lines.append(invalid[-1])
        return "skip"

    try:
        table = pcsv.read_csv(
            path,
            read_options=pcsv.ReadOptions(use_threads=False, block_size=1 << 20),
            parse_options=pcsv.ParseOptions(invalid_row_handler=on_invalid, ignore_empty_lines=False),
            convert_options=pcsv.ConvertOptions(
                column_types={n: pa.string() for n in names}, strings_can_be_null=False
            ),
        )
    except (pa.ArrowInvalid, OSError) as e:
        raise InputError(f"{path}: cannot parse as CSV: {e}") from None
    return table, invalid, not_lines


def row_lines(
    path: Path, n: int, invalid: list[int], ends_with_newline: bool, diag: Diagnostics
) -> tuple[np.ndarray, int]:
    """The physical line of each table row (header is line 1; skipped rows hold their own
    lines) and the file's last line; each skipped row said (a cut last line as such)."""
    total_lines = n + len(invalid) + 1
    if invalid:
        line_of_row = np.setdiff1d(np.arange(2, total_lines + 1), np.asarray(invalid))
    else:
        line_of_row = np.arange(2, n + 2, dtype=np.int64)
    last_line = total_lines
    for num in invalid:
        if num == last_line and not ends_with_newline:
            diag.warn(str(path), num, "truncated_last_line", "skipped (logger killed mid-write?)")
        else:
            diag.warn(str(path), num, "malformed_row", "wrong number of columns")
    return line_of_row, last_line


def no_usable_samples(path: Path, diag: Diagnostics, counts_before: Counter[str]) -> InputError:
    """The one line for a file whose every row was rejected: the reasons counted while reading it."""
    mine = diag.counts - counts_before
    reasons = ", ".join(f"{k}={v}" for k, v in sorted(mine.items())) or "no data rows"
    return InputError(f"{path}: no usable samples: every row was rejected ({reasons})")


class RowFilter:
    """The rows of a file dropped so far (`drop`), and `bad`: drop more, saying each newly
    dropped row (up to the diagnostics' limit per reason, the rest counted)."""

    def __init__(self, path: str, n: int, line_of_row: np.ndarray, diag: Diagnostics) -> None:
        self.path, self.line_of_row, self.diag = path, line_of_row, diag
        self.drop = np.zeros(n, bool)

    def bad(self, mask: np.ndarray, reason: str, detail: str) -> None:
        if not mask.any():  # the usual case: one quick pass
            return
        diag = self.diag
        new = mask & ~self.drop
        for i in np.flatnonzero(new)[: diag.max_per_reason + 1]:
            diag.warn(self.path, int(self.line_of_row[i]), reason, detail)
        extra = int(new.sum()) - min(int(new.sum()), diag.max_per_reason + 1)
        if extra:
            diag.counts[reason] += extra
        self.drop[:] |= mask


def _smi_readings(
    col: dict[str, pa.ChunkedArray], names: list[str], keys: list[str], rows: RowFilter
) -> tuple[np.ndarray, np.ndarray]:
    """Power (W: the instant reading first, then power.draw, then the average) and utilization
    (%), each value out of range or not a number dropping its row."""
    power = None
    for k in ("power.draw.instant", "power.draw", "power.draw.average"):
        if k in col:
            p, bad = numeric(col[k])
            p = p * POWER_UNITS[_power_unit(names[keys.index(k)], col[k])]
            rows.bad(bad, "bad_value", f"non-numeric {k}")
            power = p if power is None else np.where(np.isnan(power), p, power)
    assert power is not None
    with np.errstate(invalid="ignore"):
        rows.bad((power < 0) | (power > MAX_POWER_W), "bad_value", "power outside [0, 10000] W")
    util, bad = numeric(col["utilization.gpu"])
    rows.bad(bad, "bad_value", "non-numeric utilization.gpu")
    with np.errstate(invalid="ignore"):
        rows.bad((util < 0) | (util > 100), "bad_value", "utilization outside [0, 100] %")
    return power, util


def _smi_gpu_attributes(
    col: dict[str, pa.ChunkedArray], host: str, index: np.ndarray, keep: np.ndarray | None
) -> tuple[dict[tuple[str, int], str], dict[tuple[str, int], str], dict[tuple[str, int], float]]:
    """Per-GPU UUID, name and power limit from each GPU's first row: a few values, not a column
    of strings."""
    first = _first_rows(index, keep)

    def per_gpu(key: str) -> dict[tuple[str, int], str]:
        if key not in col:
            return {}
        vals = [v.strip() for v in call_function("take", [col[key], pa.array(first)]).to_pylist()]
        return {(host, int(index[i])): v for i, v in zip(first, vals, strict=True) if v}

    limits: dict[tuple[str, int], float] = {}
    if "power.limit" in col:
        lim = numeric(call_function("take", [col["power.limit"], pa.array(first)]))[0]
        limits = {(host, int(index[i])): float(x) for i, x in zip(first, lim, strict=True) if x > 0}
    return per_gpu("uuid"), per_gpu("name"), limits


# A GPU without samples for longer than this many sampling intervals (and at least MISSING_MIN_MS)
# while the file's other GPUs have theirs is said to be missing.
MISSING_INTERVALS = 10
MISSING_MIN_MS = 2000


def _say_missing_gpus(
    index: np.ndarray, ts_ms: np.ndarray, line: np.ndarray, warn: Callable[[int, str], None]
) -> None:
    """Say each stretch where one GPU of a file has no samples while the others do (it fell off
    the bus, or its lines were lost): its index, the span, and the line where it went missing.
    A stretch where no GPU has samples (the logger paused) is no GPU's."""
    if index.size < 4 or int(index.max(initial=0)) >= 1 << 15:
        return
    gpus = np.unique(index[index >= 0])
    if gpus.size < 2:
        return
    order = np.argsort(index.astype(np.int16), kind="stable")
    g, t = index[order], ts_ms[order]
    same = g[1:] == g[:-1]
    d = np.diff(t)
    iv = float(np.median(d[same][:100_000])) if same.any() else 0.0
    if iv <= 0:
        return
    limit = max(MISSING_INTERVALS * iv, MISSING_MIN_MS)
    t0, t1 = int(ts_ms.min()), int(ts_ms.max())
    firsts = np.flatnonzero(np.concatenate([[True], ~same]))
    lasts = np.append(firsts[1:] - 1, g.size - 1)
    spans = [(int(g[i]), int(t[i]), int(t[i + 1]), int(order[i])) for i in np.flatnonzero(same & (d > limit))]
    spans += [(int(g[f]), t0, int(t[f]), int(order[f])) for f in firsts if t[f] - t0 > limit]
    spans += [(int(g[e]), int(t[e]), t1, int(order[e])) for e in lasts if t1 - t[e] > limit]
    if not spans:
        return
    mono = np.maximum.accumulate(ts_ms)
    import datetime as dt

    def when(ms: int) -> str:
        return dt.datetime.fromtimestamp(ms / 1000, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]

    for gpu, a, b, row in sorted(spans, key=lambda x: (x[1], x[0])):
        others = int(np.searchsorted(mono, b, "left") - np.searchsorted(mono, a, "right"))
        expected = (gpus.size - 1) * (b - a) / iv
        if others < 0.5 * expected:
            continue  # the logger paused for every GPU
        warn(
            int(line[row]),
            f"GPU {gpu} has no samples from {when(a)} to {when(b)} UTC ({(b - a) / 1000:.1f} s) while the "
            "file's other GPUs do: its time there is unobserved",
        )


def _first_rows(index: np.ndarray, keep: np.ndarray | None) -> np.ndarray:
    """The first kept row (None: every row is kept) of each GPU index, in index order. Every GPU
    shows up within the first instants, so the head of the rows holds them all; a full sort
    only when it does not."""
    sub = index if keep is None else index[keep]
    gpus, at = np.unique(sub[:4096], return_index=True)
    if not (sub.min() >= 0 and sub.max() < 1 << 16 and np.count_nonzero(np.bincount(sub)) == gpus.size):
        at = np.unique(sub, return_index=True)[1]
    return at if keep is None else keep[at]


def _positional_index(
    ts_ms: np.ndarray,
    drop: np.ndarray,
    warn: Callable[[int, str, str], None] | None = None,
    line_of_row: np.ndarray | None = None,
    *,
    skip: np.ndarray | None = None,
    power: np.ndarray | None = None,
    memory: Callable[[], np.ndarray] | None = None,
    invalid_lines: list[int] | None = None,
) -> np.ndarray:
    """Without an index column, each row's GPU by its place among the lines nvidia-smi wrote
    (`costexporter/core/numbering.py`); -1 for a row whose GPU cannot be told (said through
    `warn(line, reason, detail)`, never given to another GPU). `drop`: rows rejected (they still
    held their GPU's place); `skip`: rows that are no GPU's line (blank, a repeated header);
    `invalid_lines`: lines the CSV parser rejected that held a GPU's place."""
    n = ts_ms.size
    if line_of_row is None:
        line_of_row = np.arange(2, n + 2, dtype=np.int64)
    skip = np.zeros(n, bool) if skip is None else skip
    # Each GPU line's place: rows and rejected lines in file order, without the non-lines.
    extra = np.asarray(sorted(invalid_lines or []), np.int64)
    if not extra.size and not skip.any():  # the usual file: rows are the lines
        slot_of_row = rows = np.arange(n)
        all_lines = line_of_row
        valid = ~drop
    else:
        is_line = ~skip
        lines = line_of_row[is_line]
        all_lines = np.union1d(lines, extra) if extra.size else lines
        slot_of_row = np.full(n, -1, np.int64)
        slot_of_row[is_line] = np.searchsorted(all_lines, lines)
        valid = is_line & ~drop
        rows = np.flatnonzero(is_line)
    index = np.full(n, -1, np.int64)
    if rows.size == 0:
        return index
    every = rows.size == n
    gpu, notes = numbering.number_lines(
        slot_of_row if every else slot_of_row[rows],
        ts_ms if every else ts_ms[rows],
        valid if every else valid[rows],
        int(all_lines.size),
        None if power is None else (power if every else power[rows]),
        None if memory is None else (memory if every else (lambda: memory()[rows])),
    )
    if every and gpu.size == n:
        index = gpu
    else:
        index[rows] = gpu[slot_of_row[rows]]
    if warn is not None:
        for note in notes:
            first_line = int(all_lines[note.first])
            warn(first_line, note.reason, note.detail)
            if note.reason == "unplaced_line" and note.lines > 1:
                for s in range(note.first + 1, note.last + 1):
                    warn(int(all_lines[s]), note.reason, "(as above)")
    return index


POWER_UNITS = {"w": 1.0, "mw": 0.001, "kw": 1000.0}


def _power_unit(header: str, col: pa.ChunkedArray) -> str:
    """'power.draw [mW]' -> 'mw'; without a unit in the header, the first value's suffix."""
    h = header.strip().lower()
    if "[" in h and "]" in h:
        unit = h[h.index("[") + 1 : h.index("]")].strip()
        if unit in POWER_UNITS:
            return unit
    for v in col.slice(0, 16).to_pylist():
        v = (v or "").strip().lower()
        for unit in ("mw", "kw"):
            if v.endswith(unit) and v[: -len(unit)].strip()[-1:].isdigit():
                return unit
    return "w"


def _last_row_complete(table: pa.Table) -> bool:
    """Whether a last line without a trailing newline is complete (nvidia-smi killed between
    lines) rather than cut mid-value: where the line before it ends its fields with a unit
    ('W', '%'), so must it; without units it must be at least as long as the line before."""
    if table.num_rows < 2:
        return False
    prev = [str(c[table.num_rows - 2]) for c in table.columns]
    last = [str(c[table.num_rows - 1]) for c in table.columns]
    units = [p.strip()[-1:] for p in prev]
    if any(u and not u.isdigit() and u not in "]" for u in units):
        return all(
            not u or u.isdigit() or u == "]" or x.strip().endswith(u)
            for u, x in zip(units, last, strict=True)
        )
    return len(",".join(last)) >= len(",".join(prev))


def _json_lines(path: Path) -> Iterator[tuple[int, bytes, Any]]:  # Any: what json.loads gave
    """(line number, raw bytes, parsed value or None) for each non-blank line of a JSONL file."""
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                yield lineno, raw, json.loads(raw)
            except ValueError:
                yield lineno, raw, None


def read_samples_jsonl(path: Path, host: str, diag: Diagnostics) -> SampleChunk:
    """One JSON object a line: ts, host, gpu, uuid?, power_w, util_pct, energy_mj?."""
    check_file(path)
    cols: dict[str, list[float]] = {k: [] for k in ("host", "gpu", "ts", "p", "u", "e", "line")}
    host_ids: dict[str, int] = {}
    uuids: dict[tuple[str, int], str] = {}
    names: dict[tuple[str, int], str] = {}
    limits: dict[tuple[str, int], float] = {}
    where = str(path)
    hi_ts = time.time() + FUTURE_SLACK_S
    good = 0
    for lineno, raw, d in _json_lines(path):
        try:
            if not isinstance(d, dict):
                raise ValueError("not an object")
            if not good and not {"ts", "power_w", "util_pct"} <= d.keys():
                raise InputError(
                    f"{path}:{lineno}: not a samples JSONL file: a sample has ts, host, gpu, "
                    f"power_w and util_pct (got {', '.join(sorted(d)[:8])})"
                )
        except ValueError:
            reason = "truncated_last_line" if not raw.endswith(b"\n") else "malformed_row"
            diag.warn(where, lineno, reason, "not a JSON object")
            continue
        try:
            ts = float(d["ts"])
            gpu = d["gpu"]
            if isinstance(gpu, bool) or int(gpu) != gpu or gpu < 0:
                raise ValueError(f"gpu={gpu!r}")
            p = d["power_w"]  # required keys; null stands for N/A
            u = d["util_pct"]
            p = float("nan") if p is None else float(p)
            u = float("nan") if u is None else float(u)
            e = d.get("energy_mj")
            e = float("nan") if e is None else float(e)
            limit = float(d["power_limit_w"]) if d.get("power_limit_w") else None
        except KeyError as k:
            diag.warn(where, lineno, "missing_field", f"{k.args[0]!r} is required")
            continue
        except (TypeError, ValueError, OverflowError) as x:  # OverflowError: "gpu": Infinity
            diag.warn(where, lineno, "bad_value", str(x))
            continue
        if not MIN_TS <= ts <= hi_ts:
            diag.warn(where, lineno, "bad_timestamp", f"ts={ts} outside the plausible range")
            continue
        if not (0 <= p <= MAX_POWER_W or p != p) or not (0 <= u <= 100 or u != u):
            diag.warn(where, lineno, "bad_value", "power or utilization out of range")
            continue
        h = str(d.get("host") or host)
        g = int(gpu)
        cols["host"].append(host_ids.setdefault(h, len(host_ids)))
        cols["gpu"].append(g)
        if d.get("uuid"):
            uuids.setdefault((h, g), str(d["uuid"]))
        cols["ts"].append(to_ms(ts))
        cols["p"].append(p)
        cols["u"].append(u)
        cols["e"].append(e)
        cols["line"].append(lineno)
        if d.get("name"):
            names.setdefault((h, g), str(d["name"]))
        if limit:
            limits.setdefault((h, g), limit)
        good += 1
    if good == 0:
        raise InputError(f"{path}: no usable samples (is this a samples JSONL file?)")
    return SampleChunk(
        hosts=list(host_ids),
        host=np.asarray(cols["host"], np.int32),
        index=np.asarray(cols["gpu"], np.int64),
        ts_ms=np.asarray(cols["ts"], np.int64),
        power_w=np.asarray(cols["p"], np.float64),
        util_pct=np.asarray(cols["u"], np.float64),
        energy_mj=np.asarray(cols["e"], np.float64),
        uuid=uuids,
        name=names,
        power_limit_w=limits,
        line=np.asarray(cols["line"], np.int64),
    )


def combine(chunks: list[SampleChunk], diag: Diagnostics | None = None) -> Samples:
    """Number GPUs by (host, index) across files and sort by (gpu, ts)."""
    if not chunks:
        return Samples.empty()
    hosts = sorted({h for c in chunks for h in c.hosts})
    host_no = {h: i for i, h in enumerate(hosts)}
    uuids: dict[tuple[str, int], str] = {}
    names: dict[tuple[str, int], str] = {}
    limits: dict[tuple[str, int], float] = {}
    width = max((int(c.index.max()) + 1 for c in chunks if c.index.size), default=1)
    keys = []
    for c in chunks:
        remap = np.asarray([host_no[h] for h in c.hosts], np.int64)
        keys.append((remap[c.host] if c.host is not None else remap[0]) * width + c.index)
        uuids.update(c.uuid)
        names.update(c.name)
        limits.update(c.power_limit_w)

    def joined(arrays: list[np.ndarray]) -> np.ndarray:
        return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)  # one file: no copy

    key = joined(keys)
    # Dense numbering in O(n): keys are host * width + index, a small range.
    if key.size and len(hosts) * width <= 1 << 24:
        present = np.bincount(key, minlength=len(hosts) * width) > 0
        gpu = (np.cumsum(present) - 1)[key]
        gpu_keys = np.flatnonzero(present)
    else:
        gpu_keys, gpu = np.unique(key, return_inverse=True)
    gpus = []
    for k in gpu_keys.tolist():
        h, ix = hosts[k // width], k % width
        gpus.append(GpuId(h, ix, uuids.get((h, ix)), names.get((h, ix)), limits.get((h, ix))))
    if all(c.energy_mj is None for c in chunks):
        energy = np.full(key.size, np.nan)
    else:
        energy = joined(
            [c.energy_mj if c.energy_mj is not None else np.full(c.index.size, np.nan) for c in chunks]
        )
    src = None
    if all(c.line is not None for c in chunks):
        src = joined([(np.int64(i) << 32) | c.line for i, c in enumerate(chunks)])  # type: ignore[operator]
    raw = Samples(
        gpus=gpus,
        gpu=gpu.astype(np.int32),
        ts_ms=joined([c.ts_ms for c in chunks]),
        power_w=joined([c.power_w for c in chunks]),
        util_pct=joined([c.util_pct for c in chunks]),
        energy_mj=energy,
        src=src,
    )
    out = raw.sort()
    if diag is not None and len(out) < len(raw):
        # Two readings of one GPU at the same ms: the later line is kept, the other counted.
        diag.counts["duplicate_sample"] += len(raw) - len(out)
    return out


def read_samples(
    path: Path, host: str, tz: str, diag: Diagnostics, columns: Mapping[str, str] | None = None
) -> SampleChunk:
    if sniff_format(path) == "jsonl":
        return read_samples_jsonl(path, host, diag)
    return read_nvidia_smi_csv(path, host, tz, diag, columns)


def read_events_jsonl(path: Path, diag: Diagnostics) -> list[Event]:
    """Events of protocol v1, one JSON object a line; de-duplicated on (rank, session, seq)."""
    check_file(path)
    where = str(path)
    out: list[Event] = []
    seen: set[tuple[object, ...]] = set()
    parsed_any = False
    now = time.time()
    for lineno, _raw, d in _json_lines(path):
        if d is None:
            diag.warn(where, lineno, "malformed_event", "not valid JSON")
            continue
        try:
            evs = parse_events(d, now=now)  # a batched steps line gives its steps
        except UnknownEventType as e:
            parsed_any = True
            diag.warn(where, lineno, e.reason, str(e))
            continue
        except EventError as e:
            diag.warn(where, lineno, e.reason, str(e))
            continue
        parsed_any = True
        for ev in evs:
            if ev.seq >= 0:
                key: tuple[object, ...] = (ev.job, ev.rank, ev.session, ev.seq)
            else:
                key = (ev.job, ev.rank, ev.type, ev.ts_ms, ev.get("step"), ev.get("name"), ev.get("state"))
            if key in seen:
                diag.counts["duplicate_event"] += 1
                continue
            seen.add(key)
            if ev.get("_unknown_fields"):
                diag.counts["unknown_field"] += 1  # forward compatibility: ignored, counted
            out.append(ev)
    if not parsed_any:
        raise InputError(f"{path}: no usable events (is this an events JSONL file?)")
    return out
