"""Carbon from energy: kgCO2e = kWh x the grid's intensity (gCO2e/kWh) / 1000, the intensity
being the operator's policy (`carbon_intensity` in the policy file, docs/terms.md): one constant
for the cluster, or an hourly series file (CSV rows `time,g_per_kwh`; a row holds until the
next one, the last for an hour). Energy outside the series is not guessed: it is counted as
not covered, and the figure is then withheld (None)."""

from __future__ import annotations

import bisect
import csv
import datetime as dt
import io
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from costexporter.core.cost import MJ_PER_KWH
from costexporter.core.timeutil import parse_instant

G_PER_KG = 1000.0
MAX_G_PER_KWH = 5000.0  # far above any grid (coal ~1000): a bound against a unit mistake
HOUR_MS = 3_600_000


class IntensityError(ValueError):
    """A carbon intensity the policy cannot use (one line: what and where)."""


@dataclass(frozen=True, slots=True)
class GridIntensity:
    """gCO2e per kWh: a constant (`starts_ms` empty), or a series of (start ms, value) rows."""

    constant: float | None = None
    starts_ms: tuple[int, ...] = ()
    values: tuple[float, ...] = ()
    source: str = "policy"

    def _row(self, t_ms: int) -> tuple[float, float] | None:
        """(value, end ms) of what is in force at `t_ms`; None outside the series."""
        if self.constant is not None:
            return self.constant, math.inf
        i = bisect.bisect_right(self.starts_ms, t_ms) - 1
        if i < 0:
            return None
        end = self.starts_ms[i + 1] if i + 1 < len(self.starts_ms) else self.starts_ms[i] + HOUR_MS
        return (self.values[i], end) if t_ms < end else None

    def at(self, t_ms: int) -> float | None:
        """The intensity in force at `t_ms` (None: outside the series)."""
        row = self._row(t_ms)
        return None if row is None else row[0]

    def over(self, start_ms: int, end_ms: int) -> float | None:
        """The one intensity in force over all of [start, end), or None where the series changes
        inside it (a period longer than its rows) or does not cover it."""
        row = self._row(start_ms)
        return None if row is None or end_ms > row[1] else row[0]

    def kg(self, kwh_at: Iterable[tuple[int, float]]) -> tuple[float, float]:
        """(kgCO2e, kWh not covered) of energy given as (time ms, kWh) parts: each part at the
        intensity in force at its time (a ledger bucket's start)."""
        kg = uncovered = 0.0
        for t, kwh in kwh_at:
            g = self.at(t)
            if g is None:
                uncovered += kwh
            else:
                kg += kwh * g / G_PER_KG
        return kg, uncovered

    def kg_of_energy(
        self, kwh: float, parts: Callable[[], Iterable[tuple[int, float]]]
    ) -> tuple[float | None, float]:
        """(kgCO2e, kWh not covered) of `kwh` of energy: at the constant, or each of its `parts`
        (made only for a series) at its time; None where the series leaves some out. The API's
        job page and replay's report both take their figure from here."""
        if self.constant is not None:
            return kg_of(kwh, self.constant), 0.0
        kg, uncovered = self.kg(parts())
        return (None if uncovered > 0 else kg), uncovered

    def micrograms(self, mj_at: Iterable[tuple[int, float]]) -> tuple[int, float]:
        """`kg` of energy in millijoules, as (µgCO2e, mJ not covered): the agent's counter."""
        kg, uncovered = self.kg((t, mj / MJ_PER_KWH) for t, mj in mj_at)
        return round(kg * 1e9), uncovered * MJ_PER_KWH

    def describe(self) -> str:
        if self.constant is not None:
            return f"{self.constant:g} gCO2e/kWh ({self.source})"
        return f"an hourly series of {len(self.values)} rows ({self.source})"


def kg_of(kwh: float, g_per_kwh: float | None) -> float | None:
    """kgCO2e of `kwh` at one intensity (None: the intensity is not known)."""
    return None if g_per_kwh is None else kwh * g_per_kwh / G_PER_KG


def _value(raw: object, where: str) -> float:
    v = None if isinstance(raw, bool) else _float(raw)
    if v is None or not (math.isfinite(v) and 0 <= v < MAX_G_PER_KWH):
        raise IntensityError(f"{where}: expected gCO2e/kWh, a number in [0, {MAX_G_PER_KWH:g}), got {raw!r}")
    return v


def _float(raw: object) -> float | None:
    try:
        return float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def parse_series(text: str, where: str) -> GridIntensity:
    """An hourly series file: `time,g_per_kwh` rows (RFC 3339 or Unix seconds; a header row and
    `#` comments are skipped), in time order."""
    starts: list[int] = []
    values: list[float] = []
    for n, row in enumerate(csv.reader(io.StringIO(text)), 1):
        if not row or not row[0].strip() or row[0].lstrip().startswith("#"):
            continue
        if len(row) < 2:
            raise IntensityError(f"{where} line {n}: expected time,g_per_kwh")
        if not starts and _float(row[1]) is None:
            continue  # a header: its value column is no number
        try:
            t = parse_instant(row[0].strip(), dt.timezone.utc)
        except ValueError:
            raise IntensityError(f"{where} line {n}: {row[0].strip()!r} is not a time") from None
        t_ms = round(t * 1000)
        if starts and t_ms <= starts[-1]:
            raise IntensityError(f"{where} line {n}: times must increase")
        starts.append(t_ms)
        values.append(_value(row[1].strip(), f"{where} line {n}"))
    if not starts:
        raise IntensityError(f"{where}: no rows")
    return GridIntensity(None, tuple(starts), tuple(values), source=where)


def parse_policy_intensity(
    raw: object, where: str, read: Callable[[str], str] | None = None
) -> GridIntensity:
    """The policy's `carbon_intensity`: a number, or {file: PATH} of an hourly series (`read`
    reads it; default: the path as given)."""
    if isinstance(raw, Mapping):
        path = raw.get("file")
        if set(raw) != {"file"} or not isinstance(path, str) or not path:
            raise IntensityError(f"{where}: carbon_intensity is a number (gCO2e/kWh) or {{file: PATH}}")
        try:
            text = read(path) if read is not None else Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise IntensityError(f"{where}: carbon_intensity file {path}: {e.strerror or e}") from None
        return parse_series(text, f"{where}: carbon_intensity file {path}")
    return GridIntensity(_value(raw, f"{where}: carbon_intensity"), source=where)
