"""Goodput, MFU and carbon (core/goodput.py, core/flops.py, core/carbon.py): consistent with the
ledger's totals for any amounts, MFU against a hand computation on a real-like 8xH100 trace, and
carbon at a constant or an hourly series, never guessed where the series stops."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from costexporter.api import aggregate as agg
from costexporter.core import carbon, flops, goodput, profiles
from costexporter.core.buckets import amounts
from costexporter.core.carbon import GridIntensity, IntensityError, parse_policy_intensity, parse_series
from costexporter.core.cost import Prices
from costexporter.core.model import CATEGORIES, JOB_CODES, Event
from costexporter.core.replay import ReplayConfig, book_trace, job_report
from costexporter.core.terms import PolicyError, parse_policy_file
from costexporter.store.ledger_read import JOB_CATS, VALID, Amounts, Steps
from tests.realtrace import Scenario

HOUR = 3_600_000
amount = st.integers(0, 10**10)
per_category = st.lists(amount, min_size=len(CATEGORIES), max_size=len(CATEGORIES))


@settings(max_examples=300, deadline=None)
@given(
    ms=st.lists(amount, min_size=len(JOB_CATS), max_size=len(JOB_CATS)),
    width=st.integers(0, 16_384),
    start=st.integers(0, 10**9),
    run=st.integers(0, 10**9),
    ended=st.booleans(),
    window=st.tuples(st.integers(0, 2 * 10**9), st.integers(0, 2 * 10**9)),
    wait=st.one_of(st.none(), st.integers(-(10**6), 10**9)),
)
def test_layers_are_consistent_with_the_totals_for_any_amounts(ms, width, start, run, ended, window, wait):
    by_cat = dict(zip(JOB_CATS, ms, strict=True))
    valid, held = sum(by_cat[c] for c in VALID), sum(ms)
    a, b = sorted(window)
    span = goodput.JobSpan(
        start, start + run if ended else None, width, None if wait is None else start - wait
    )
    g = goodput.job_goodput(valid, held, span, (a, b))
    assert (g.runtime is None) == (held == 0)
    assert g.runtime is None or (g.runtime == valid / held and 0 <= g.runtime <= 1)
    end = start + run if ended else b
    wall = (min(end, b) if ended else b) - max(start, a)
    capacity = max(width * max(wall, 0), held)
    if width == 0:
        assert g.ettr is None and any(n.startswith("ettr:") for n in g.notes)
    elif capacity == 0:
        assert g.ettr is None
    else:  # never above runtime goodput: the capacity is at least what was held
        assert g.ettr == pytest.approx(valid / capacity)
        assert 0 <= g.ettr <= 1 and g.runtime is not None and g.ettr <= g.runtime + 1e-12
    if wait is None:
        assert g.scheduling is None and any(n.startswith("scheduling:") for n in g.notes)
    elif g.scheduling is not None:
        w, r = max(wait, 0), max(end - start, 0)
        assert g.scheduling == pytest.approx(r / (r + w)) and 0 <= g.scheduling <= 1
    else:
        assert end - start <= 0 and wait <= 0  # nothing ran and nothing waited


def test_a_job_that_held_its_gpus_all_along_has_ettr_equal_to_runtime_goodput():
    # 8 GPUs for 10 h, 7.5 h of it valid: both 0.75; a 2-hour gap between runs: ETTR over 12 h
    valid, held = 8 * 7.5 * HOUR, 8 * 10 * HOUR
    whole = goodput.job_goodput(valid, held, goodput.JobSpan(0, 10 * HOUR, 8), (0, 10 * HOUR))
    assert whole.runtime == whole.ettr == 0.75
    gap = goodput.job_goodput(valid, held, goodput.JobSpan(0, 12 * HOUR, 8), (0, 12 * HOUR))
    assert gap.runtime == 0.75 and gap.ettr == pytest.approx(7.5 / 12)
    # submitted 30 min before its start: scheduling 12 / 12.5
    sub = goodput.job_goodput(valid, held, goodput.JobSpan(0, 12 * HOUR, 8, -HOUR // 2), (0, 12 * HOUR))
    assert sub.scheduling == pytest.approx(12 / 12.5)


@settings(max_examples=100, deadline=None)
@given(
    jobs=st.lists(
        st.lists(amount, min_size=len(CATEGORIES), max_size=len(CATEGORIES)), min_size=1, max_size=5
    )
)
def test_allocation_rows_give_valid_over_held_and_the_energy(jobs):
    parts = []
    for i, ms in enumerate(jobs):
        a = Amounts()
        for c, v in zip(CATEGORIES, ms, strict=True):
            a.ms[c], a.mj[c] = v, 3 * v
        parts.append(agg.JobPart(f"j{i}", {"team": "t"}, a, Steps()))
    rows = agg.rows(parts, ["team"], 0, 3600, g_per_kwh=400.0)
    assert len(rows) == 1
    row = rows[0]
    valid = sum(ms[CATEGORIES.index(c)] for ms in jobs for c in VALID)
    held = sum(ms[CATEGORIES.index(c)] for ms in jobs for c in JOB_CATS)
    assert row.runtime_goodput == (valid / held if held else None)
    assert row.energy_kwh == pytest.approx(3 * held / carbon.MJ_PER_KWH)
    assert row.carbon_kg == pytest.approx(row.energy_kwh * 0.4)
    assert agg.rows(parts, ["team"], 0, 3600)[0].carbon_kg is None  # no intensity: none


# ---- MFU ---------------------------------------------------------------------------------------
def _h100_report(meta: dict, cfg: ReplayConfig | None = None) -> dict:
    tr = Scenario.h100(seed=4).build()
    t0 = min(e.ts_ms for e in tr.events)
    events = [*tr.events, Event("meta", "real", t0, 0, "s-meta", 0, meta)]
    [job], _ = book_trace(tr.samples, events, cfg or ReplayConfig())
    return job_report(job, cfg or ReplayConfig())


def test_mfu_on_a_real_like_8xh100_trace_is_the_hand_computed_figure():
    rep = _h100_report({"model_params": 7e9})
    valid_h = sum(rep["gpu_hours"][c] for c in VALID)
    assert rep["tokens"] > 0 and valid_h > 0
    # 6 FLOPs per parameter and token, the H100 SXM's dense BF16 peak (989.5 TFLOPS)
    by_hand = rep["tokens"] * 6 * 7e9 / (valid_h * 3600 * 989.5e12)
    assert rep["goodput"]["program"] == pytest.approx(by_hand, rel=1e-9)
    # posted per token and in FP8: its own figure, the FP8 peak
    fp8 = _h100_report({"model_flops_per_token": 5e10, "dtype": "float8"})
    assert fp8["goodput"]["program"] == pytest.approx(
        fp8["tokens"] * 5e10 / (valid_h * 3600 * 1979e12), rel=1e-9
    )


@pytest.mark.parametrize(
    ("meta", "says"),
    [
        ({}, "posts no model_flops_per_token or model_params"),
        ({"model_params": "lots"}, "posts no model_flops_per_token or model_params"),
        ({"model_params": True}, "posts no model_flops_per_token or model_params"),
        ({"model_params": -7e9}, "posts no model_flops_per_token or model_params"),
        ({"model_params": 7e9, "dtype": "int4"}, "dtype 'int4' is not one of"),
    ],
)
def test_mfu_without_what_it_needs_is_null_and_says_why(meta, says):
    rep = _h100_report(meta)
    assert rep["goodput"]["program"] is None
    assert any(says in n for n in rep["goodput"]["notes"]), rep["goodput"]["notes"]


def test_a_gpu_model_without_a_peak_row_has_no_mfu():
    w = flops.work({"model_params": 7e9}, "NVIDIA B300", 1000)
    assert w.peak_flops is None and "no peak bf16 FLOPS known for GPU model NVIDIA B300" in w.why_not[0]


def test_every_peak_row_names_its_source_and_device_names_find_it():
    table = flops.peak_table()
    assert table
    for model, row in table.items():
        assert row["source"] and model in profiles.KNOWN_POWER_LIMITS_W, model
        assert all(row.get(d, 1) > 0 for d in flops.DTYPES)
    assert flops.peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989.5e12
    assert flops.peak_flops("NVIDIA H100 PCIe", "bf16") == 756.5e12
    assert flops.peak_flops("NVIDIA A100-SXM4-80GB", "tf32") == 156e12
    assert flops.peak_flops("NVIDIA A100-SXM4-80GB", "fp8") is None  # no FP8 on an A100


# ---- carbon ------------------------------------------------------------------------------------
def test_carbon_at_a_constant_is_the_energy_times_the_intensity():
    rep = _h100_report({}, ReplayConfig(carbon=GridIntensity(400.0)))
    assert rep["energy_kwh_total"] > 0
    assert rep["carbon_kg"] == pytest.approx(rep["energy_kwh_total"] * 0.4, rel=1e-9)
    assert rep["carbon_kg_per_valid_step"] == pytest.approx(rep["carbon_kg"] / rep["valid_steps"])
    assert _h100_report({})["carbon_kg"] is None  # no intensity, no figure


def test_carbon_at_an_hourly_series_weighs_each_bucket_and_withholds_what_it_does_not_cover():
    tr = Scenario.h100(seed=4).build()
    t0 = int(tr.samples.ts_ms.min()) // HOUR * HOUR
    rows = [(t0 + k * HOUR, 100.0 + 50 * k) for k in range(-1, 3)]
    series = parse_series("time,g_per_kwh\n" + "".join(f"{t / 1000},{g}\n" for t, g in rows), "grid.csv")
    at = dict(rows)
    [job], _ = book_trace(tr.samples, tr.events, ReplayConfig(carbon=series))
    rep = job_report(job, ReplayConfig(carbon=series))
    by_hand = sum(
        float(a[JOB_CODES, 1].sum()) / carbon.MJ_PER_KWH * at[t * 1000 // HOUR * HOUR] / 1000
        for t, a in amounts(job.pieces, Prices()).items()
    )
    assert rep["carbon_kg"] == pytest.approx(by_hand, rel=1e-12) and by_hand > 0
    late = parse_series(f"{(t0 + HOUR) / 1000},300\n", "late.csv")  # starts after the trace did
    assert job_report(job, ReplayConfig(carbon=late))["carbon_kg"] is None


def test_a_series_row_holds_until_the_next_and_the_last_for_an_hour():
    s = parse_series("2026-12-01T00:00:00Z,100\n2026-12-01T02:00:00Z,300\n", "x")
    t = 1796083200_000
    assert s.at(t - 1) is None and s.at(t) == 100 and s.at(t + 2 * HOUR - 1) == 100
    assert s.at(t + 3 * HOUR - 1) == 300 and s.at(t + 3 * HOUR) is None
    assert s.over(t, t + HOUR) == 100 and s.over(t + HOUR, t + 3 * HOUR) is None
    kg, left = s.kg([(t, 2.0), (t + 3 * HOUR, 1.0)])
    assert kg == pytest.approx(0.2) and left == 1.0


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (-1, "a number in [0, 5000)"),
        ("lots", "a number in [0, 5000)"),
        (True, "a number in [0, 5000)"),
        (float("nan"), "a number in [0, 5000)"),
        ({"file": "missing.csv"}, "carbon_intensity file missing.csv"),
        ({"path": "x.csv"}, "a number (gCO2e/kWh) or {file: PATH}"),
    ],
)
def test_an_unusable_carbon_intensity_stops_the_policy_with_one_line(raw, says, tmp_path):
    with pytest.raises(PolicyError) as e:
        parse_policy_file({"carbon_intensity": raw}, "--policy p.yaml", lambda p: (tmp_path / p).read_text())
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "no rows"),
        ("2026-12-01T00:00:00Z\n", "line 1: expected time,g_per_kwh"),
        ("yesterday,100\n", "line 1: 'yesterday' is not a time"),
        ("2026-12-01T01:00:00Z,100\n2026-12-01T00:00:00Z,100\n", "line 2: times must increase"),
        ("2026-12-01T00:00:00Z,9e9\n", "line 1: expected gCO2e/kWh"),
    ],
)
def test_a_bad_series_file_names_its_line(text, says):
    with pytest.raises(IntensityError) as e:
        parse_series(text, "grid.csv")
    assert says in str(e.value)


def test_the_policy_reads_a_series_file_beside_it(tmp_path):
    (tmp_path / "grid.csv").write_text("# ElectricityMaps export\ntime,g\n1796083200,250\n")
    pf = parse_policy_file(
        {"carbon_intensity": {"file": "grid.csv"}}, "p", lambda p: (tmp_path / p).read_text()
    )
    assert pf.carbon is not None and pf.carbon.at(1796083200_000) == 250.0
    assert parse_policy_intensity(390, "p").constant == 390.0
    assert carbon.kg_of(10.0, None) is None and carbon.kg_of(10.0, 390.0) == pytest.approx(3.9)


# ---- scheduling: only the operator's side dates a submission ------------------------------------
def test_a_submission_time_is_the_operators_a_trainers_only_where_granted():
    from costexporter.core.attribution import SUBMITTED_KEY, Facts, attribute

    meta = {SUBMITTED_KEY: "2026-12-01T00:00:00Z"}
    attr, ignored = attribute(meta, None)
    assert attr.get(SUBMITTED_KEY) is None and ignored == (SUBMITTED_KEY,)  # the subject's own word
    attr, ignored = attribute(meta, None, grants=("policy rule 1", (SUBMITTED_KEY,)))
    assert attr.get(SUBMITTED_KEY) == 1796083200.0 and ignored == ()
    assert attr.source(SUBMITTED_KEY) == "meta, granted by policy rule 1"
    attr, _ = attribute({}, Facts("ml", "llama", "PyTorchJob", None, 1796083100.0))
    assert attr.get(SUBMITTED_KEY) == 1796083100.0 and attr.source(SUBMITTED_KEY) == "kubernetes"
    for junk in ("soon", True, -5, float("inf")):  # never a time: nothing
        assert (
            attribute({SUBMITTED_KEY: junk}, None, grants=("r", (SUBMITTED_KEY,)))[0].get(SUBMITTED_KEY)
            is None
        )
    # stored and read back as readers see it (a float)
    from costexporter.core.attribution import Attribution

    back = Attribution.from_fields(attr.to_fields())
    assert back.get(SUBMITTED_KEY) == 1796083100.0


def test_replay_gives_scheduling_goodput_from_a_granted_submission():
    tr = Scenario.h100(seed=4).build()
    t0 = min(e.ts_ms for e in tr.events)
    wait_ms = 20 * 60_000
    events = [*tr.events, Event("meta", "real", t0, 0, "s-meta", 0, {"submitted_at": (t0 - wait_ms) / 1000})]
    from costexporter.core.terms import PolicyRule

    rule = PolicyRule(job="real", grants=("submitted_at",))
    cfg = ReplayConfig(policy_rules=(rule,))
    [job], _ = book_trace(tr.samples, events, cfg)
    rep = job_report(job, cfg)
    tl = job.timeline
    run, waited = tl.end_ms - tl.start_ms, tl.start_ms - (t0 - wait_ms)  # from the submission
    assert waited >= wait_ms
    assert rep["goodput"]["scheduling"] == pytest.approx(run / (run + waited), rel=1e-9)
    assert rep["attribution"]["submitted_at"]["source"] == "meta, granted by policy rule 1"
    [plain], _ = book_trace(tr.samples, events, ReplayConfig())
    assert job_report(plain, ReplayConfig())["goodput"]["scheduling"] is None  # not granted: unknown


def test_the_api_counts_a_running_jobs_wall_time_to_the_window_end_or_now(shared, prefix):
    """A job still running (its figures' end 0, as the agents write it) has its ETTR over its ranks
    x the window from its first registration: 2 ranks for 36 h here, 2 GPU-h valid of 2.2 held."""
    import json

    from fastapi.testclient import TestClient

    from costexporter.api.app import create_app
    from costexporter.store import keys
    from costexporter.store.ledger_read import LedgerStore
    from tests.api_helpers import T0, WINDOW, write_job

    write_job(shared, prefix, "run", "llm")
    shared.hset(keys.ranks_key(prefix, "run"), "1", json.dumps({"ts": T0, "host": "h", "gpu": 1}))
    shared.hset(keys.figures_key(prefix, "run"), mapping={"start_ts": T0, "end_ts": 0.0})
    api = TestClient(create_app(LedgerStore(shared, prefix)))
    body = api.get("/api/v1/jobs/run", params={"window": WINDOW}).json()
    valid, held = 2 * 3_600_000, 2 * 3_960_000
    wall = (1_753_660_800 - T0) * 1000  # to the window's end (2025-07-28), long past
    assert body["goodput"]["runtime"] == pytest.approx(valid / held)
    assert body["goodput"]["ettr"] == pytest.approx(valid / (2 * wall))
    # ended an hour after its start: the wall time stops there (never below what it held)
    shared.hset(keys.figures_key(prefix, "run"), "end_ts", T0 + 7200)
    body = api.get("/api/v1/jobs/run", params={"window": WINDOW}).json()
    assert body["goodput"]["ettr"] == pytest.approx(valid / (2 * 7_200_000))


@pytest.mark.parametrize(
    ("policy", "says"),
    [
        ("carbon_intensity: -3\n", "carbon_intensity: expected gCO2e/kWh"),
        ("carbon_intensity: {file: grid.csv}\n", "carbon_intensity file grid.csv"),
        ("carbon_intensity: {file: bad.csv}\n", "bad.csv line 1: 'noon' is not a time"),
    ],
)
def test_commands_given_an_unusable_carbon_intensity_stop_with_one_line(tmp_path, cli, policy, says):
    (tmp_path / "bad.csv").write_text("noon,300\n")
    (tmp_path / "policy.yaml").write_text(policy)
    trace = str(Path(__file__).resolve().parents[1] / "examples" / "r1-mini" / "node0.csv")
    for cmd in (["api", "--port", "0"], ["replay", "--samples", trace]):
        r = cli(*cmd, "--policy", str(tmp_path / "policy.yaml"))
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, (cmd, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_the_api_weighs_a_jobs_buckets_at_the_series_and_withholds_what_it_leaves_out(shared, prefix):
    """Two hours of a job (1.1e9 mJ in each hour's first bucket): at 100 then 300 gCO2e/kWh, each
    bucket at its own hour's; a series that stops after the first hour gives no figure, and says so."""
    from fastapi.testclient import TestClient

    from costexporter.api.app import create_app
    from costexporter.store.ledger_read import LedgerStore
    from tests.api_helpers import T0, WINDOW, write_job

    write_job(shared, prefix, "run", "llm")
    both = parse_series(f"{T0},100\n{T0 + 3600},300\n", "grid.csv")
    body = TestClient(create_app(LedgerStore(shared, prefix), carbon=both)).get(
        "/api/v1/jobs/run", params={"window": WINDOW}
    )
    kwh = 1.1e9 / carbon.MJ_PER_KWH
    assert body.json()["carbon_kg"] == pytest.approx(kwh * 0.1 + kwh * 0.3)
    first = parse_series(f"{T0},100\n", "grid.csv")
    body = TestClient(create_app(LedgerStore(shared, prefix), carbon=first)).get(
        "/api/v1/jobs/run", params={"window": WINDOW}
    )
    assert body.json()["carbon_kg"] is None and body.json()["energy_kwh"] == pytest.approx(2 * kwh)
    assert any("series leaves" in w for w in body.json()["warnings"])
