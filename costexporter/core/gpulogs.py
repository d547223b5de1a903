"""Other GPU loggers' formats, read into the trace's samples: `nvidia-smi dmon` (with or without
`-o DT`), `dcgmi dmon`, and wide CSVs (one power and one utilization column per GPU, as pynvml
loggers write them).

A log without dates (dmon without `-o D`, dcgmi dmon) is dated by a `LogClock`: the time of its
first line and the logger's interval (`-d`), its k-th line of a GPU at start + k x interval.
Each format says which way it was read (`Diagnostics.note`); a line that is no sample is skipped
and counted, never a traceback.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from costexporter.core import timeutil
from costexporter.core.diagnostics import Diagnostics, InputError
from costexporter.core.tracefiles import (
    MAX_POWER_W,
    RowFilter,
    SampleChunk,
    check_file,
    column_key,
    csv_header,
    csv_strings,
    no_usable_samples,
    numeric,
    read_samples,
    row_lines,
    timestamp_ms,
)


@dataclass(frozen=True, slots=True)
class LogClock:
    """When a log without dates began (epoch ms; None: not given) and its sampling interval."""

    start_ms: int | None = None
    interval_ms: int = 1000

    def need(self, path: Path, what: str) -> int:
        """The start, or InputError saying how to give it."""
        if self.start_ms is None:
            raise InputError(
                f"{path}: {what} has no dates: give --start (the time of its first line) and "
                "--interval (its -d, default 1 s)"
            )
        return self.start_ms


def sniff(head: bytes) -> str | None:
    """'dmon', 'dcgmi' or 'dcgm-exporter' from a file's first bytes; None for anything else."""
    for raw in head.splitlines()[:8]:
        line = raw.strip()
        if not line:
            continue
        words = line.lstrip(b"#").split()
        low = [w.lower() for w in words]
        if line.startswith(b"#") and low[:1] == [b"entity"]:
            return "dcgmi"
        if line.startswith(b"#") and b"gpu" in low[:3] and not line.startswith(b"# HELP"):
            return "dmon"
        if line.startswith((b"# HELP DCGM_", b"# TYPE DCGM_", b"DCGM_FI_")):
            return "dcgm-exporter"
    return None


def _rows(path: Path) -> list[tuple[int, list[str]]]:
    """(line number, whitespace-split words) of every line."""
    with path.open("r", encoding="utf-8", errors="replace") as f:
        return [(i, line.split()) for i, line in enumerate(f, 1)]


def _floats(values: list[str]) -> np.ndarray:
    """Words to floats: '-' and 'N/A' (a field the GPU does not report) NaN; anything else that
    is no number NaN too, its row then told bad by the caller."""
    out = np.full(len(values), np.nan)
    for i, v in enumerate(values):
        with contextlib.suppress(ValueError):
            out[i] = float(v)
    return out


def _chunk(
    host: str,
    index: list[int],
    ts: np.ndarray | list[int],
    power: list[float],
    util: list[float],
    lines: list[int],
    energy: list[float] | None = None,
) -> SampleChunk:
    idx = np.asarray(index, np.int64)
    return SampleChunk(
        hosts=[host],
        host=None,
        index=idx,
        ts_ms=np.asarray(ts, np.int64),
        power_w=np.asarray(power, np.float64),
        util_pct=np.asarray(util, np.float64),
        energy_mj=None if energy is None else np.asarray(energy, np.float64),
        uuid={},
        name={},
        power_limit_w={},
        line=np.asarray(lines, np.int64),
    )


def _clocked(index: list[int], start_ms: int, interval_ms: int) -> np.ndarray:
    """The k-th line of each GPU at start + k x interval."""
    idx = np.asarray(index, np.int64)
    if idx.size == 0:
        return np.zeros(0, np.int64)
    order = np.argsort(idx, kind="stable")
    sorted_idx = idx[order]
    first = np.searchsorted(sorted_idx, sorted_idx, "left")
    k = np.empty(idx.size, np.int64)
    k[order] = np.arange(idx.size) - first
    return start_ms + k * interval_ms


# --- nvidia-smi dmon ---------------------------------------------------------------------------

_DATE_RE = re.compile(r"^(\d{4})[/-]?(\d{2})[/-]?(\d{2})$")


def read_dmon(path: Path, host: str, tz: str, clock: LogClock, diag: Diagnostics) -> SampleChunk:
    """`nvidia-smi dmon [-s pu...] [-o DT]`: a '# gpu pwr ... sm ...' header (repeated every
    screen), a units line, one line per GPU per interval. Power from `pwr` (W), utilization
    from `sm` (%, what utilization.gpu reads); dates from `Date`/`Time` (local, in `tz`), else
    from `clock` (a `Time` without `Date` takes the start's date and rolls over at midnight)."""
    check_file(path)
    where = str(path)
    before = diag.counts.copy()
    names: list[str] | None = None
    index: list[int] = []
    power: list[float] = []
    util: list[float] = []
    lines: list[int] = []
    dates: list[str] = []
    times: list[str] = []
    for n, words in _rows(path):
        if not words:
            continue
        if words[0].startswith("#"):
            cols = [w.lower() for w in " ".join(words).lstrip("#").split()]
            if "gpu" in cols:
                names = cols  # a units line ('# Idx W C ...') names no column
            continue
        if names is None:
            diag.warn(where, n, "malformed_row", "a line before dmon's '# gpu ...' header")
            continue
        if len(words) != len(names):
            diag.warn(where, n, "malformed_row", f"{len(words)} values for {len(names)} columns")
            continue
        row = dict(zip(names, words, strict=True))
        if "pwr" not in row:
            raise InputError(
                f"{path}: nvidia-smi dmon without power: record it with -s pu (pwr and sm columns)"
            )
        try:
            gpu = int(row["gpu"])
        except ValueError:
            diag.warn(where, n, "bad_value", f"GPU index {row['gpu']!r}")
            continue
        p, u = _floats([row["pwr"], row.get("sm", "-")])
        if not np.isnan(p) and not 0 <= p <= MAX_POWER_W:
            diag.warn(where, n, "bad_value", f"power {row['pwr']} W out of range")
            continue
        index.append(gpu)
        power.append(float(p))
        util.append(float(u))
        lines.append(n)
        dates.append(row.get("date", ""))
        times.append(row.get("time", ""))
    if not index:
        raise no_usable_samples(path, diag, before)
    if "sm" not in (names or []):
        diag.note(where, "no sm column (dmon -s without u): utilization unknown, bands by power alone")
    ts = _dmon_times(path, dates, times, tz, clock, index, lines, diag)
    chunk = _chunk(host, index, ts, power, util, lines)
    keep = ts >= 0
    if not keep.all():
        for name in ("index", "ts_ms", "power_w", "util_pct", "line"):
            setattr(chunk, name, getattr(chunk, name)[keep])
    return chunk


def _dmon_times(
    path: Path,
    dates: list[str],
    times: list[str],
    tz: str,
    clock: LogClock,
    index: list[int],
    lines: list[int],
    diag: Diagnostics,
) -> np.ndarray:
    """Epoch ms of each line (-1 where its date or time is no time, said)."""
    where = str(path)
    if not any(times) and not any(dates):
        start = clock.need(path, "this nvidia-smi dmon log")
        every = f"{clock.interval_ms / 1000:g} s"
        diag.note(where, f"no dates (dmon without -o DT): dated from --start every {every}")
        return _clocked(index, start, clock.interval_ms)
    if not any(dates):  # -o T: the start's date, rolling over at midnight
        start = clock.need(path, "this nvidia-smi dmon log (-o T: times without a date)")
        day0 = timeutil.tz_zone(tz)
        import datetime as dt

        d0 = dt.datetime.fromtimestamp(start / 1000, day0).date()
        texts = [f"{d0.isoformat()} {t}" for t in times]
        ms, bad, _ = timeutil.parse_times(pa.array(texts), tz)
        day = 86_400_000
        back = np.concatenate([[0], np.cumsum(np.diff(ms) < -day // 2)])
        ms = ms + back * day
    else:
        texts = []
        for d, t in zip(dates, times, strict=True):
            m = _DATE_RE.match(d)
            texts.append(f"{m.group(1)}-{m.group(2)}-{m.group(3)} {t}".strip() if m else "")
        ms, bad, _ = timeutil.parse_times(pa.array(texts), tz)
    ms = np.asarray(ms, np.int64)
    RowFilter(where, len(lines), np.asarray(lines, np.int64), diag).bad(
        bad, "bad_timestamp", "unparseable date and time"
    )
    ms[bad] = -1
    return ms


# --- dcgmi dmon --------------------------------------------------------------------------------

# dcgmi dmon's short names (`dcgmi dmon -l`) of the fields read: POWER (field 155, W), PWINST
# (157, instant W), GPUTL (203, %), TOTEC (156, total energy since boot, mJ).


def read_dcgmi_dmon(path: Path, host: str, clock: LogClock, diag: Diagnostics) -> SampleChunk:
    """`dcgmi dmon -e 155,203,156 [-d MS]`: an '#Entity POWER GPUTL TOTEC' header (repeated), a
    units line, one 'GPU <id> <values>' line per GPU per interval; `N/A` where a field has no
    value. No dates: `clock` dates them. The energy counter (TOTEC) is kept: energy from it
    beats integrated power. Other entities (MIG instances, NVSwitches, CPUs) are counted and
    skipped."""
    check_file(path)
    where = str(path)
    before = diag.counts.copy()
    fields: list[str] | None = None
    index: list[int] = []
    power: list[float] = []
    util: list[float] = []
    energy: list[float] = []
    lines: list[int] = []
    for n, words in _rows(path):
        if not words:
            continue
        if words[0].startswith("#"):
            fields = [w.lower() for w in " ".join(words).lstrip("#").split()[1:]]
            continue
        if words[0] == "ID" or fields is None:
            continue  # the units line, or text before the first header
        if words[0] != "GPU":
            diag.counts["other_entity"] += 1
            diag.note(where, f"{words[0]} entities skipped: only whole GPUs are replayed")
            continue
        if len(words) != len(fields) + 2:
            diag.warn(where, n, "malformed_row", f"{len(words) - 2} values for {len(fields)} fields")
            continue
        try:
            gpu = int(words[1])
        except ValueError:
            diag.warn(where, n, "bad_value", f"GPU id {words[1]!r}")
            continue
        row = dict(zip(fields, _floats(words[2:]), strict=True))
        p = row.get("pwinst", np.nan) if np.isnan(row.get("power", np.nan)) else row["power"]
        if "power" not in row and "pwinst" not in row:
            raise InputError(
                f"{path}: dcgmi dmon without power: record fields 155 (POWER), 203 (GPUTL) and "
                "156 (TOTEC): dcgmi dmon -e 155,203,156"
            )
        index.append(gpu)
        power.append(float(p))
        util.append(float(row.get("gputl", np.nan)))
        energy.append(float(row.get("totec", np.nan)))
        lines.append(n)
    if not index:
        raise no_usable_samples(path, diag, before)
    if "gputl" not in (fields or []):
        diag.note(where, "no GPUTL field (203): utilization unknown, bands by power alone")
    start = clock.need(path, "a dcgmi dmon log")
    diag.note(where, f"dcgmi dmon has no dates: dated from --start every {clock.interval_ms / 1000:g} s")
    ts = _clocked(index, start, clock.interval_ms)
    has_energy = fields is not None and "totec" in fields
    return _chunk(host, index, ts, power, util, lines, energy if has_energy else None)


# --- wide CSV: one column per GPU ---------------------------------------------------------------

_GPU_NO = re.compile(r"(?:^|[^a-z0-9])(?:gpu|cuda|dev|device)?[\s_\-.:#\[(]*(\d{1,3})(?=$|[^0-9])")
_ROLE_WORDS = (("power", ("power", "pwr", "watt")), ("util", ("util", "sm_active", "busy")))


def wide_columns(names: list[str]) -> dict[int, dict[str, int]] | None:
    """GPU number -> {role: column} for a header with one power (and utilization) column per GPU
    ('gpu0_power_w', 'power_1', 'GPU 2 Power (W)'); None when the header is not such a file."""
    out: dict[int, dict[str, int]] = {}
    for i, name in enumerate(names):
        low = name.strip().lower()
        if "mem" in low or "temp" in low or "clock" in low:
            continue
        m = _GPU_NO.search(low)
        if m is None:
            continue
        rest = low[: m.start(1)] + low[m.end(1) :]
        role = next((r for r, words in _ROLE_WORDS if any(w in rest for w in words)), None)
        if role is not None:
            out.setdefault(int(m.group(1)), {}).setdefault(role, i)
    if not out or not all("power" in roles for roles in out.values()):
        return None
    return out


def read_wide_csv(path: Path, host: str, tz: str, diag: Diagnostics) -> SampleChunk:
    """A CSV with a time column and one power (W) and utilization (%) column per GPU, melted to
    one sample per GPU and row; a row whose cells of a GPU are empty has no sample of it (the
    logger did not read it then: unobserved, not a reading)."""
    check_file(path)
    where = str(path)
    names, ends_with_newline = csv_header(path)
    gpus = wide_columns(names)
    keys = [column_key(c) for c in names]
    if gpus is None or "timestamp" not in keys:
        raise InputError(
            f"{path}: not a one-column-per-GPU CSV: need a time column and a power column per GPU"
        )
    before = diag.counts.copy()
    table, invalid, _not_lines = csv_strings(path, names)
    n = table.num_rows
    line, _last = row_lines(path, n, invalid, ends_with_newline, diag)
    ts, bad_ts, read_as = timestamp_ms(table.column(keys.index("timestamp")), tz)
    if read_as.startswith("unix_"):
        diag.note(where, f"timestamps read as Unix {read_as[5:]} (told by their magnitude)")
    RowFilter(where, n, line, diag).bad(bad_ts, "bad_timestamp", "unparseable timestamp")
    if not any("util" in roles for roles in gpus.values()):
        diag.note(where, "no utilization columns: bands by power alone")
    diag.note(where, f"one column per GPU: {len(gpus)} GPUs ({', '.join(map(str, sorted(gpus)))})")
    parts = []
    for gpu, roles in sorted(gpus.items()):
        p, bad_p = numeric(table.column(roles["power"]))
        if "util" in roles:
            u, bad_u = numeric(table.column(roles["util"]))
        else:
            u, bad_u = np.full(n, np.nan), np.zeros(n, bool)
        cells = RowFilter(where, n, line, diag)  # this GPU's cells; a bad time drops every GPU's
        cells.drop |= bad_ts
        cells.bad(bad_p | bad_u, "bad_value", f"GPU {gpu}: a value that is no number")
        with np.errstate(invalid="ignore"):
            cells.bad((p < 0) | (p > MAX_POWER_W), "bad_value", f"GPU {gpu}: power outside [0, 10000] W")
        keep = ~cells.drop & ~(np.isnan(p) & np.isnan(u))  # both cells empty: the GPU was not logged
        parts.append((np.full(int(keep.sum()), gpu), ts[keep], p[keep], u[keep], line[keep]))
    idx = np.concatenate([x[0] for x in parts])
    if idx.size == 0:
        raise no_usable_samples(path, diag, before)
    return SampleChunk(
        hosts=[host],
        host=None,
        index=idx.astype(np.int64),
        ts_ms=np.concatenate([x[1] for x in parts]).astype(np.int64),
        power_w=np.concatenate([x[2] for x in parts]),
        util_pct=np.concatenate([x[3] for x in parts]),
        energy_mj=None,
        uuid={},
        name={},
        power_limit_w={},
        line=np.concatenate([x[4] for x in parts]).astype(np.int64),
    )


# --- one entry for every file format -----------------------------------------------------------


def kind_of(path: Path, columns: Mapping[str, str] | None = None) -> str:
    """The file's format: 'jsonl', 'csv' (nvidia-smi's and loggers' like it), 'wide',
    'dmon', 'dcgmi' or 'dcgm-exporter'."""
    head = check_file(path)
    found = sniff(head)
    if found is not None:
        return found
    if head.lstrip()[:1] in (b"{", b"["):
        return "jsonl"
    if columns:
        return "csv"
    names = head.split(b"\n", 1)[0].decode("utf-8", "replace").rstrip("\r").split(",")
    keys = {column_key(c) for c in names}
    if not keys & {"power.draw", "power.draw.instant", "power.draw.average"} and wide_columns(names):
        return "wide"
    return "csv"


def read_log(
    path: Path,
    host: str,
    tz: str,
    diag: Diagnostics,
    columns: Mapping[str, str] | None = None,
    clock: LogClock | None = None,
) -> SampleChunk:
    """Any supported samples file but a dcgm-exporter dump (read by sources.history: it needs
    the Prometheus text parser), by its `kind_of`."""
    clock = clock or LogClock()
    kind = kind_of(path, columns)
    if kind == "dmon":
        return read_dmon(path, host, tz, clock, diag)
    if kind == "dcgmi":
        return read_dcgmi_dmon(path, host, clock, diag)
    if kind == "wide":
        return read_wide_csv(path, host, tz, diag)
    if kind == "dcgm-exporter":
        raise InputError(f"{path}: a dcgm-exporter dump: read it with sources.history")
    return read_samples(path, host, tz, diag, columns)
