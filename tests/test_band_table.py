"""Bands and GPU models as data (core/bandtable.py, core/data/): the built-in table gives the
bands and the bookings the hand-written rules gave; a band and a GPU model added from fixture
files, with no code edit, classify, book, show and alert; a table that cannot be used stops
with one line."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from costexporter.core import bands, bandtable, profiles
from costexporter.core.booking import Regime, category_table
from costexporter.core.model import Band, Category, GpuId, Samples
from costexporter.sources.synth import write_nvidia_smi_csv

from .conftest import ROOT, run_cli

DATA = Path(__file__).parent / "data" / "bandtable"
PARKED = DATA / "parked.json"
SCHEMA = json.loads((ROOT / "costexporter/schemas/replay-output.schema.json").read_text())


def _old_reading_bands(P: np.ndarray, U: np.ndarray, p: profiles.Profile, lone: bool) -> np.ndarray:
    """The reading rule as it was written in code before the table (the reference)."""
    with np.errstate(invalid="ignore"):
        high, low, at_idle = p.compute_min_w <= P, p.low_max_w > P, p.idle_max_w >= P
        busy, zero = p.busy_util_pct <= U, p.zero_util_pct >= U
    mid = ~high & ~low & ~np.isnan(P)
    band = np.full(P.size, Band.UNKNOWN, np.int8)
    band[high] = Band.COMPUTE
    band[mid & busy] = Band.COMPUTE if lone else Band.COMMUNICATION
    band[mid & ~busy & ~np.isnan(U)] = Band.STARVATION
    band[low & (zero | (at_idle & ~busy))] = Band.IDLE
    return band


_reading = st.one_of(st.floats(0, 1500, allow_nan=False), st.just(float("nan")))
_util = st.one_of(st.floats(0, 100, allow_nan=False), st.just(float("nan")))


@given(
    readings=st.lists(st.tuples(_reading, _util), min_size=1, max_size=200),
    limit=st.floats(50, 1500),
    lone=st.booleans(),
    model=st.sampled_from([None, "B300"]),
)
@settings(max_examples=300, deadline=None)
def test_the_built_in_table_bands_every_reading_as_the_hand_written_rule_did(readings, limit, lone, model):
    p = profiles.B300 if model else profiles.derive(limit)
    P = np.asarray([r[0] for r in readings])
    U = np.asarray([r[1] for r in readings])
    table, edges = bandtable.builtin(), profiles.profile_edges(p)
    got = table.classify_readings(P, U, edges, lone)
    assert got.tolist() == _old_reading_bands(P, U, p, lone).tolist()
    # one reading at a time (the live path's own, without arrays) says the same
    one = [
        int(table.classify_readings(P[i : i + 1], U[i : i + 1], edges, lone)[0])
        for i in range(min(P.size, 30))
    ]
    assert one == got[:30].tolist()
    # readings on the edges themselves too
    edges = np.asarray([p.idle_max_w, p.low_max_w, p.compute_min_w])
    utils = np.asarray([p.zero_util_pct, p.busy_util_pct, np.nan])
    P2, U2 = np.repeat(edges, 3), np.tile(utils, 3)
    assert bandtable.builtin().classify_readings(P2, U2, profiles.profile_edges(p), lone).tolist() == (
        _old_reading_bands(P2, U2, p, lone).tolist()
    )


def test_the_built_in_table_books_each_band_in_each_regime_as_the_rules_say():
    t = category_table(bandtable.builtin())
    C, B = Category, Band
    step = {
        B.COMPUTE: C.PRODUCTIVE,
        B.COMMUNICATION: C.COMMUNICATION,
        B.STARVATION: C.STARVED,
        B.IDLE: C.STARVED,
        B.DEADLOCK: C.STALLED,
        B.CHECKPOINT: C.OVERHEAD,
        B.UNKNOWN: C.PRODUCTIVE,
    }
    stall = {B.IDLE: C.IDLE, B.DEADLOCK: C.STALLED, B.CHECKPOINT: C.OVERHEAD}
    assert [t[Regime.STEP, b + 1] for b in B] == [step[b] for b in B]
    assert [t[Regime.STALL, b + 1] for b in B] == [stall.get(b, C.NO_PROGRESS) for b in B]
    valid = {C.PRODUCTIVE, C.COMMUNICATION, C.STARVED}
    assert [t[Regime.VOID, b + 1] for b in B] == [C.ROLLED_BACK if step[b] in valid else step[b] for b in B]
    assert [t[Regime.BAND, b + 1] for b in B] == [C.IDLE if b == B.IDLE else step[b] for b in B]
    assert (t[:, 0] == C.UNOBSERVED)[[Regime.STEP, Regime.STALL, Regime.BAND]].all()
    assert (t[Regime.UNASSIGNED] == C.UNASSIGNED).all() and (t[Regime.OVERHEAD, 1:] == C.OVERHEAD).all()


def _trace(tmp_path: Path) -> Path:
    """Two X1000 GPUs, 1 s apart: 10 min computing, 10 min parked (a context held, 90 W, 0%),
    10 min idle (40 W)."""
    n = 1800
    ts = 1_760_000_000_000 + np.arange(n, dtype=np.int64) * 1000
    power = np.where(np.arange(n) < 600, 450.0, np.where(np.arange(n) < 1200, 90.0, 40.0))
    util = np.where(np.arange(n) < 600, 100.0, 0.0)
    gpus = [GpuId("node1", i, f"GPU-{i:08d}-0000-0000-0000-000000000000", "NVIDIA X1000") for i in (0, 1)]
    s = Samples(
        gpus=gpus,
        gpu=np.repeat(np.arange(2, dtype=np.int32), n),
        ts_ms=np.tile(ts, 2),
        power_w=np.tile(power, 2),
        util_pct=np.tile(util, 2),
        energy_mj=np.full(2 * n, np.nan),
    )
    return write_nvidia_smi_csv(s, tmp_path / "trace", name=True)[0]


def _replay(csv: Path, *extra: str) -> dict:
    done = run_cli(
        *extra,
        "replay",
        "--samples",
        csv,
        "--profile",
        DATA / "profiles",
        "--progress",
        "none",
        "--format",
        "json",
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    jsonschema.validate(report, SCHEMA)  # an added band's hours and incidents are in the contract
    return report["jobs"]["trace"]


def test_a_band_and_a_gpu_model_added_as_data_classify_book_and_show(tmp_path):
    """The acceptance: `--bands parked.json` adds a band, a profile file adds the X1000; no code
    changed. The parked time is its own band, booked as its row says (idle, in a job without
    steps); without the table the same time is idle; every GPU-second in one band."""
    csv = _trace(tmp_path)
    plain = _replay(csv)
    with_band = _replay(csv, "--bands", str(PARKED))
    assert with_band["profile"]["name"] == "X1000" and with_band["profile"]["source"] == "calibrated"
    hours = with_band["band_gpu_hours"]
    assert hours["parked"] == pytest.approx(2 * 600 / 3600, abs=2 * 5 / 3600)
    assert hours["idle"] == pytest.approx(2 * 600 / 3600, abs=2 * 5 / 3600)
    assert hours["compute"] == pytest.approx(2 * 600 / 3600, abs=2 * 5 / 3600)
    assert "parked" not in plain["band_gpu_hours"]
    assert plain["band_gpu_hours"]["idle"] == pytest.approx(hours["idle"] + hours["parked"], abs=1e-9)
    # booked by the row's stepless category: the same idle hours as before, none lost or doubled
    assert with_band["gpu_hours"] == pytest.approx(plain["gpu_hours"], abs=1e-9)
    assert sum(hours.values()) == pytest.approx(with_band["gpu_hours_total"], abs=1e-9)


def test_an_added_band_books_by_its_own_row_in_each_regime():
    table = bandtable.load(PARKED)
    parked = table.code("parked")
    assert parked == len(Band) and table.names[: len(Band)] == bandtable.builtin().names
    t = category_table(table)
    assert t[Regime.STEP, parked + 1] == Category.STARVED
    assert t[Regime.STALL, parked + 1] == Category.IDLE
    assert t[Regime.VOID, parked + 1] == Category.ROLLED_BACK  # starved is valid: a resume voids it
    assert t[Regime.BAND, parked + 1] == Category.IDLE
    # the built-in row it changed keeps its code and booking, with the new colour
    assert table.row("checkpoint").colour == "dark-purple" and table.code("checkpoint") == Band.CHECKPOINT
    assert (t[:, : len(Band) + 1] == category_table(bandtable.builtin())).all()


def test_the_dashboard_the_demo_calibrate_and_the_alerts_derive_from_the_table():
    from costexporter.tools import calibrate, dashboard, demo, rules

    def mappings() -> dict[str, str]:
        board = dashboard.dashboard()
        panel = next(p for p in board["panels"] if p.get("title") == "Band of each GPU")
        opts = panel["fieldConfig"]["defaults"]["mappings"][0]["options"]
        return {o["text"]: o["color"] for o in opts.values()}

    def alert_names() -> list[str]:
        return [
            a["alert"] for g in rules.rules(rules.RuleWindows())["groups"] for a in g["rules"] if "alert" in a
        ]

    assert "parked" not in mappings() and "GpuInAlertingBand" not in alert_names()
    bandtable.install(bandtable.load(PARKED))
    try:
        assert mappings()["parked"] == "orange" and mappings()["checkpoint"] == "dark-purple"
        assert "GpuInAlertingBand" in alert_names() and "DeadlockSignature" in alert_names()
        assert demo._band_style("parked") == "magenta"
        assert bandtable.current().level_of_code[bandtable.current().code("parked")] == "idle"
        assert "idle" in calibrate.LEVELS
        res = bands.classify(
            np.zeros(4, np.int64),
            np.arange(4, dtype=np.int64) * 1000,
            np.full(4, 250.0),
            np.zeros(4),
            1,
            profiles.B300,
        )
        assert (res.band == bandtable.current().code("parked")).all()  # B300: 165 < 250 < 320 W at 0%
    finally:
        bandtable.install(None)
    assert "parked" not in mappings()


BAD = {
    "not json": ("{", "is not JSON"),
    "no bands list": ('{"rows": []}', "a `bands` list"),
    "unknown field": ('{"bands": [{"name": "compute", "colur": "red"}]}', "unknown field(s) colur"),
    "bad category": ('{"bands": [{"name": "compute", "step": "useful"}]}', "'useful' is not a category"),
    "new band without reading": (
        '{"bands": [{"name": "x", "step": "idle", "stall": "idle", "stepless": "idle", "level": "idle"}]}',
        "needs reading",
    ),
    "bad edge": (
        '{"bands": [{"name": "x", "step": "idle", "stall": "idle", "stepless": "idle", "level": "idle",'
        ' "reading": [[["power", "<", "low_w"]]]}]}',
        "edge 'low_w'",
    ),
    "bad op": (
        '{"bands": [{"name": "x", "step": "idle", "stall": "idle", "stepless": "idle", "level": "idle",'
        ' "reading": [[["power", "=", 3]]]}]}',
        "op '='",
    ),
    "label-unsafe name": (
        '{"bands": [{"name": "a|b", "step": "idle", "stall": "idle", "stepless": "idle", "level": "idle",'
        ' "reading": [[["power", "<", 3]]]}]}',
        "lowercase letters",
    ),
    "a signature of its own": (
        '{"bands": [{"name": "x", "step": "idle", "stall": "idle", "stepless": "idle", "level": "idle",'
        ' "reading": [[["power", "<", 3]]], "signature": "deadlock"}]}',
        "signatures are built in",
    ),
    "bad level": ('{"bands": [{"name": "idle", "level": "sleepy"}]}', "level 'sleepy'"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_band_table_that_cannot_be_used_stops_with_one_line(case, tmp_path):
    text, says = BAD[case]
    f = tmp_path / "bands.json"
    f.write_text(text)
    with pytest.raises(bandtable.BandTableError, match=None) as e:
        bandtable.load(f)
    assert says in str(e.value)
    if case == "bad edge":  # the command line: exit 2, one line, no traceback
        done = run_cli("--bands", str(f), "rules")
        assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr


def test_a_known_gpu_is_a_row_of_the_gpu_table_and_a_calibrated_one_a_file():
    assert profiles.select("NVIDIA H100 80GB HBM3").power_limit_w == 700.0
    assert profiles.select("NVIDIA B300") is profiles.B300 and profiles.B300.provenance
    doc = json.loads((ROOT / "costexporter/core/data/gpus.json").read_text())
    assert [m["model"] for m in doc["models"]] == [k for k, _, _ in profiles.MODEL_VARIANTS]
    shipped = sorted(p.name for p in (ROOT / "costexporter/core/data/profiles").glob("*.json"))
    assert shipped == ["b300.json"] and set(profiles.BUILTIN) == {"B300"}
