"""The power bands as data: one row per band (`data/bands.json`), from which the classifier's
reading rules, booking's band x regime table, calibrate's levels, the dashboard's and the demo's
colours and the alert rules derive (docs/bands.md).

A band is seen two ways. From a sample alone (`reading`): conditions on its power and
utilization against the GPU profile's edges (`idle_max_w`, `low_max_w`, `compute_min_w`,
`busy_util_pct`, `zero_util_pct`, `power_limit_w`) or numbers; a new band of this kind is one
row. From a job's moments (`signature`): a detector in `bands.py` (starvation, deadlock,
checkpoint) lays the band over the readings; a new signature needs its detector.

The built-in rows keep the codes of `model.Band` (0-6): the detectors name them. A user's table
(`--bands FILE`, or COSTEXPORTER_BANDS) changes built-in rows by name (a colour, a category) and
appends new ones after them, numbered on; `install` makes it the table every part of this
process reads (`current`).
"""

from __future__ import annotations

import json
import math
import operator
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from importlib import resources
from pathlib import Path

import numpy as np

from costexporter.core.model import Band, Category


class BandTableError(ValueError):
    """A band table that cannot be used."""


# The edges a reading condition may name: the GPU profile's fields.
EDGES = ("idle_max_w", "low_max_w", "compute_min_w", "busy_util_pct", "zero_util_pct", "power_limit_w")
# Levels calibrate fits (tools/calibrate.py), and "unknown" for a band it does not fit.
LEVELS = ("compute", "communication", "starvation", "low", "idle", "unknown")
SIGNATURES = ("starvation", "deadlock", "checkpoint")
# `x op edge`; NaN (no reading) fails every comparison, and so passes its negation ("!>=").
_OPS = {
    ">=": np.greater_equal,
    ">": np.greater,
    "<": np.less,
    "<=": np.less_equal,
}
_SCALAR_OPS = {
    ">=": operator.ge,
    ">": operator.gt,
    "<": operator.lt,
    "<=": operator.le,
}
_REGIME_FIELDS = ("step", "stall", "stepless")
# A reading row, planned: (its code, its code in a one-GPU job, its rules as (comparison, negated)).
_RowPlan = tuple[int, int, tuple[tuple[tuple[int, bool], ...], ...]]


@dataclass(frozen=True, slots=True)
class Condition:
    """`field op edge`: field is "power" (W) or "util" (%); edge a profile field or a number."""

    field: str
    op: str
    edge: str | float


@dataclass(frozen=True, slots=True)
class BandRow:
    """One band: its code, how it books in each regime, how it is seen, how it is shown."""

    name: str
    code: int
    step: Category
    stall: Category
    stepless: Category
    level: str
    colour: str
    terminal: str
    alerts: bool = False
    reading: tuple[tuple[Condition, ...], ...] = ()
    lone: str | None = None  # the band a one-GPU job's readings of this band are instead
    signature: str | None = None
    default: bool = False
    about: str = ""


@dataclass(frozen=True, eq=False)  # compared and hashed as itself: cheap as a cache key
class BandTable:
    rows: tuple[BandRow, ...]
    source: str = "built-in"
    _by_name: dict[str, BandRow] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._by_name.update({r.name: r for r in self.rows})

    @cached_property
    def names(self) -> tuple[str, ...]:
        """Band names by code: the `band` label's values, replay's `band_gpu_hours` keys."""
        return tuple(r.name for r in self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, name: str) -> BandRow:
        return self._by_name[name]

    def code(self, name: str) -> int:
        return self._by_name[name].code

    @cached_property
    def default_code(self) -> int:
        return next(r.code for r in self.rows if r.default)

    @cached_property
    def reading_rows(self) -> tuple[BandRow, ...]:
        return tuple(r for r in self.rows if r.reading)

    @cached_property
    def alerting(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.rows if r.alerts)

    @cached_property
    def level_of_code(self) -> tuple[str, ...]:
        return tuple(r.level for r in self.rows)

    @cached_property
    def _plan(self) -> tuple[tuple[tuple[str, str, str | float], ...], tuple[_RowPlan, ...]]:
        """The comparisons the reading rules make, each once, and per reading row its codes and
        rules as (comparison index, negated) lists: worked out once per table."""
        keys: list[tuple[str, str, str | float]] = []
        rows: list[_RowPlan] = []
        for r in self.reading_rows:
            rules = []
            for conds in r.reading:
                rule = []
                for c in conds:
                    key = (c.field, c.op.lstrip("!"), c.edge)
                    if key not in keys:
                        keys.append(key)
                    rule.append((keys.index(key), c.op.startswith("!")))
                rules.append(tuple(rule))
            lone = self.code(r.lone) if r.lone else r.code
            rows.append((r.code, lone, tuple(rules)))
        return tuple(keys), tuple(rows)

    def classify_readings(
        self, power_w: np.ndarray, util_pct: np.ndarray, edges: Mapping[str, float | None], lone: bool
    ) -> np.ndarray:
        """Each sample's band from its own reading: the rows' reading rules in table order (a
        later row wins where two match), the default row where none does. Each comparison the
        rules share is made once; one reading is judged without arrays (the live path asks for
        one GPU's newest reading every round)."""
        keys, rows = self._plan
        if power_w.size == 1:
            return np.asarray(
                [self._classify_one(float(power_w[0]), float(util_pct[0]), edges, lone)], np.int8
            )
        masks: list[np.ndarray] = []
        with np.errstate(invalid="ignore"):
            for fld, op, edge in keys:
                e = edge if isinstance(edge, float) else edges.get(edge)
                x = power_w if fld == "power" else util_pct
                masks.append(np.zeros(x.shape, bool) if e is None else _OPS[op](x, e))
        band = np.full(power_w.size, self.default_code, np.int8)
        for code, lone_code, rules in rows:
            for rule in rules:
                k, neg = rule[0]
                mask = ~masks[k] if neg else masks[k].copy()
                for k, neg in rule[1:]:
                    mask &= ~masks[k] if neg else masks[k]
                band[mask] = lone_code if lone else code
        return band

    def _classify_one(self, p: float, u: float, edges: Mapping[str, float | None], lone: bool) -> int:
        keys, rows = self._plan
        held = []
        for fld, op, edge in keys:
            e = edge if isinstance(edge, float) else edges.get(edge)
            held.append(False if e is None else bool(_SCALAR_OPS[op](p if fld == "power" else u, e)))
        out = self.default_code
        for code, lone_code, rules in rows:
            if any(all(held[k] != neg for k, neg in rule) for rule in rules):
                out = lone_code if lone else code
        return out


def _category(name: object, where: str) -> Category:
    try:
        return Category[str(name).upper()]
    except KeyError:
        names = ", ".join(
            c.name.lower() for c in Category if c not in (Category.UNASSIGNED, Category.UNOBSERVED)
        )
        raise BandTableError(f"{where}: {name!r} is not a category ({names})") from None


def _condition(raw: object, where: str) -> Condition:
    if not (isinstance(raw, list | tuple) and len(raw) == 3):
        raise BandTableError(f"{where}: a condition is [field, op, edge], got {raw!r}")
    fld, op, edge = raw
    if fld not in ("power", "util"):
        raise BandTableError(f"{where}: field {fld!r} is not power or util")
    if str(op).lstrip("!") not in _OPS or str(op).count("!") > 1:
        raise BandTableError(f"{where}: op {op!r} is not one of >=, >, <, <= (or one negated: !>=)")
    if isinstance(edge, bool) or not (
        edge in EDGES or (isinstance(edge, int | float) and math.isfinite(edge))
    ):
        raise BandTableError(f"{where}: edge {edge!r} is not a number or one of {', '.join(EDGES)}")
    return Condition(str(fld), str(op), edge if isinstance(edge, str) else float(edge))


_NAME = re.compile(r"[a-z][a-z0-9_]{0,39}")
_FIELDS = frozenset(
    {"name", "about", "step", "stall", "stepless", "level", "colour", "terminal"}
    | {"alerts", "reading", "lone", "signature", "default"}
)


def _row(raw: Mapping[str, object], code: int, base: BandRow | None, where: str) -> BandRow:
    """A row from its JSON object; over `base` (a built-in row of the same name) only the fields
    it gives change, never its code or how it is seen by signature."""
    unknown = sorted(set(raw) - _FIELDS)
    if unknown:
        raise BandTableError(f"{where}: unknown field(s) {', '.join(unknown)}")
    if base is None:
        missing = [k for k in (*_REGIME_FIELDS, "level", "reading") if not raw.get(k)]
        if missing:
            raise BandTableError(f"{where}: a new band needs {', '.join(missing)}")
        if not _NAME.fullmatch(str(raw["name"])):
            raise BandTableError(f"{where}: a band name is lowercase letters, digits and _ (a label value)")
        if raw.get("signature") or raw.get("default"):
            raise BandTableError(f"{where}: a new band is seen by its reading (signatures are built in)")
    elif base.code < len(Band) and ("signature" in raw and raw["signature"] != base.signature):
        raise BandTableError(f"{where}: a built-in band's signature cannot change")
    kw: dict[str, object] = {}
    for k in _REGIME_FIELDS:
        if k in raw:
            kw[k] = _category(raw[k], f"{where} {k}")
    if "level" in raw:
        if raw["level"] not in LEVELS:
            raise BandTableError(f"{where}: level {raw['level']!r} is not one of {', '.join(LEVELS)}")
        kw["level"] = str(raw["level"])
    for k in ("colour", "terminal", "about"):
        if k in raw:
            kw[k] = str(raw[k])
    if "alerts" in raw:
        kw["alerts"] = bool(raw["alerts"])
    if "reading" in raw:
        rules = raw["reading"]
        if not isinstance(rules, list) or not all(isinstance(x, list) and x for x in rules):
            raise BandTableError(f"{where}: reading is a list of non-empty condition lists")
        kw["reading"] = tuple(tuple(_condition(c, f"{where} reading") for c in conds) for conds in rules)
    if "lone" in raw:
        kw["lone"] = None if raw["lone"] is None else str(raw["lone"])
    if base is None:
        base = _blank(str(raw["name"]), code)
    return replace(base, **kw)  # type: ignore[arg-type]


def _blank(name: str, code: int, signature: str | None = None, default: bool = False) -> BandRow:
    """A row before its fields are read: booked as busy time, shown grey."""
    return BandRow(
        name=name,
        code=code,
        step=Category.PRODUCTIVE,
        stall=Category.NO_PROGRESS,
        stepless=Category.PRODUCTIVE,
        level="unknown",
        colour="#808080",
        terminal="white",
        signature=signature,
        default=default,
    )


def _rows_of(doc: object, where: str) -> list[Mapping[str, object]]:
    if not isinstance(doc, dict) or not isinstance(doc.get("bands"), list):
        raise BandTableError(f"{where}: a band table is an object with a `bands` list")
    rows: list[Mapping[str, object]] = doc["bands"]
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or not isinstance(r.get("name"), str) or not r["name"]:
            raise BandTableError(f"{where}: band {i + 1} has no name")
    return rows


def _check(table: BandTable) -> BandTable:
    names = table.names
    if len(set(names)) != len(names):
        raise BandTableError(f"{table.source}: a band name is given twice")
    for r in table.rows:
        if r.lone is not None and r.lone not in names:
            raise BandTableError(f"{table.source}: band {r.name}: lone band {r.lone!r} is not in the table")
    if sum(r.default for r in table.rows) != 1:
        raise BandTableError(f"{table.source}: exactly one band is the default")
    if len(table.rows) > MAX_BANDS:
        raise BandTableError(f"{table.source}: at most {MAX_BANDS} bands")
    return table


MAX_BANDS = 100  # band codes are int8 arrays


def from_rows(extra: Iterable[Mapping[str, object]], base: BandTable, source: str) -> BandTable:
    """`base` with `extra`'s rows: a row named as one of base's changes it, a new one is
    appended with the next code."""
    rows = list(base.rows)
    at = {r.name: i for i, r in enumerate(rows)}
    for raw in extra:
        name = str(raw["name"])
        where = f"{source}: band {name!r}"
        if name in at:
            rows[at[name]] = _row(raw, rows[at[name]].code, rows[at[name]], where)
        else:
            at[name] = len(rows)
            rows.append(_row(raw, len(rows), None, where))
    return _check(BandTable(tuple(rows), source))


def builtin() -> BandTable:
    """The built-in table (`data/bands.json`), its rows in `model.Band`'s codes."""
    doc = json.loads(resources.files("costexporter.core").joinpath("data/bands.json").read_text())
    rows: list[BandRow] = []
    for raw in _rows_of(doc, "built-in bands"):
        name = str(raw["name"])
        if name.upper() not in Band.__members__:
            raise BandTableError(f"built-in band {name!r} is not one of model.Band's")
        code = int(Band[name.upper()])
        signature = str(raw["signature"]) if raw.get("signature") else None
        base = _blank(name, code, signature, bool(raw.get("default")))
        rows.append(_row(raw, code, base, f"built-in band {name!r}"))
    rows.sort(key=lambda r: r.code)
    if [r.code for r in rows] != [int(b) for b in Band]:
        raise BandTableError("the built-in band table must hold model.Band's bands, each once")
    return _check(BandTable(tuple(rows)))


def load(path: str | Path) -> BandTable:
    """The built-in table with a user's file's rows (JSON: `{"bands": [...]}`)."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except OSError as e:
        raise BandTableError(f"cannot read band table {p}: {e.strerror or e}") from None
    except ValueError as e:
        raise BandTableError(f"band table {p} is not JSON: {e}") from None
    return from_rows(_rows_of(doc, str(p)), builtin(), str(p))


_current: BandTable | None = None


def current() -> BandTable:
    """The table this process classifies, books and shows by: the built-in one, or the one
    `install` set (COSTEXPORTER_BANDS names a file to load at first use)."""
    global _current
    if _current is None:
        env = os.environ.get("COSTEXPORTER_BANDS")
        _current = load(env) if env else builtin()
    return _current


def install(table: BandTable | None) -> None:
    """Make `table` the process's (None: back to the built-in one, or COSTEXPORTER_BANDS')."""
    global _current
    _current = table
