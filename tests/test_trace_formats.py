"""Other GPU loggers' formats replay as nvidia-smi's CSV does: `nvidia-smi dmon` (with and without
dates), `dcgmi dmon` (its energy counter kept), one-column-per-GPU CSVs and dcgm-exporter text
dumps. The same readings written in each format give the same bill; the documented layouts
parse to their values; a dateless log without --start is one clear line. And the rules that
decide what a trace is: the energy bridge follows the logger's own period (a 1 s log's 4 s
pauses keep their energy), a lone GPU is never `communication`, a trace that reads far above
its named model's limit gets a profile of its own, said."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from costexporter.core import gpulogs
from costexporter.core.diagnostics import Diagnostics, InputError

from .conftest import ROOT

EXAMPLE = ROOT / "examples" / "r1-mini"
DATA = ROOT / "tests" / "data" / "gpulogs"
JOB = "qwen3-mini"


def _rows(host: str) -> list[tuple[dt.datetime, int, str, int, int]]:
    """(time, index, uuid, power W rounded as dmon writes it, util %) of an example host."""
    out = []
    for line in (EXAMPLE / f"{host}.csv").read_text().splitlines()[1:]:
        ts, idx, uuid, pw, ut = (x.strip() for x in line.split(","))
        t = dt.datetime.strptime(ts, "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=dt.timezone.utc)
        out.append((t, int(idx), uuid, round(float(pw.split()[0])), int(ut.split()[0])))
    return out


def _smi(rows) -> str:
    lines = ["timestamp, index, uuid, power.draw [W], utilization.gpu [%]"]
    lines += [f"{t:%Y/%m/%d %H:%M:%S}.000, {i}, {u}, {p}.00 W, {x} %" for t, i, u, p, x in rows]
    return "\n".join(lines) + "\n"


def _dmon(rows, dates: str) -> str:
    """`nvidia-smi dmon -s pu [-o DT|T]`, its header again every 40 lines, as dmon repeats it."""
    head = {"DT": "#Date       Time        ", "T": "#Time        ", "": "# "}[dates]
    units = {"DT": "#YYYYMMDD   HH:MM:SS    ", "T": "#HH:MM:SS    ", "": "# "}[dates]
    out = []
    for k, (t, i, _u, p, x) in enumerate(rows):
        if k % 40 == 0:
            out += [f"{head}gpu   pwr gtemp mtemp    sm   mem", f"{units}Idx     W     C     C     %     %"]
        stamp = {"DT": f" {t:%Y%m%d}   {t:%H:%M:%S}    ", "T": f" {t:%H:%M:%S}    ", "": "  "}[dates]
        out.append(f"{stamp}{i:>3}   {p:>3}    40     -   {x:>3}     7")
    return "\n".join(out) + "\n"


def _dcgmi(rows) -> str:
    out = []
    for k, (_t, i, _u, p, x) in enumerate(rows):
        if k % 50 == 0:
            out += ["#Entity   POWER    GPUTL", "ID        W        %"]
        out.append(f"GPU {i}     {p:.3f}  {x}")
    return "\n".join(out) + "\n"


def _wide(rows) -> str:
    by_t: dict[dt.datetime, dict[int, tuple[int, int]]] = {}
    for t, i, _u, p, x in rows:
        by_t.setdefault(t, {})[i] = (p, x)
    gpus = sorted({i for _t, i, *_ in rows})
    lines = ["time," + ",".join(f"gpu{g}_power_w,gpu{g}_util_pct" for g in gpus)]
    for t, vals in sorted(by_t.items()):
        lines.append(f"{t:%Y-%m-%dT%H:%M:%S}Z," + ",".join(f"{vals[g][0]},{vals[g][1]}" for g in gpus))
    return "\n".join(lines) + "\n"


def _dump(rows, host: str, stamps: str) -> str:
    """dcgm-exporter scrapes one after another: exposition timestamps, or a `date` line before
    each scrape."""
    by_t: dict[dt.datetime, list] = {}
    for r in rows:
        by_t.setdefault(r[0], []).append(r)
    out = []
    for t, rs in sorted(by_t.items()):
        if stamps == "date-lines":
            out.append(t.isoformat())
        for name, k in (("DCGM_FI_DEV_POWER_USAGE", 3), ("DCGM_FI_DEV_GPU_UTIL", 4)):
            out += [f"# HELP {name} x", f"# TYPE {name} gauge"]
            for r in rs:
                labels = f'gpu="{r[1]}",UUID="{r[2]}",device="nvidia{r[1]}",modelName="NVIDIA B300"'
                labels += f',Hostname="{host}"'
                ts = f" {int(t.timestamp() * 1000)}" if stamps == "exposition" else ""
                out.append(f"{name}{{{labels}}} {r[k]}{ts}")
    return "\n".join(out) + "\n"


def _bill(cli, files: dict[str, Path], *extra) -> dict:
    args = [a for host, p in files.items() for a in ("--samples", f"{host}={p}")]
    r = cli(
        "replay",
        *args,
        "--events",
        EXAMPLE / "events.jsonl",
        "--gpu-model",
        "B300",
        "--format",
        "json",
        *extra,
    )
    assert r.returncode == 0, r.stderr
    job = json.loads(r.stdout)["jobs"][JOB]
    return {k: job[k] for k in ("gpu_hours", "band_gpu_hours", "energy_kwh", "cost_total", "valid_steps")}


FORMATS = {
    "dmon -o DT": (lambda rows, host: _dmon(rows, "DT"), ()),
    "dmon -o T": (lambda rows, host: _dmon(rows, "T"), ("--start", "2025-07-26T22:46:40Z")),
    "dmon": (lambda rows, host: _dmon(rows, ""), ("--start", "2025-07-26T22:46:40Z", "--interval", "5")),
    "dcgmi dmon": (lambda rows, host: _dcgmi(rows), ("--start", "1753570000", "--interval", "5")),
    "wide csv": (lambda rows, host: _wide(rows), ()),
    "dcgm-exporter dump": (lambda rows, host: _dump(rows, host, "exposition"), ()),
    "dcgm-exporter dump, date lines": (lambda rows, host: _dump(rows, host, "date-lines"), ()),
}


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    d = tmp_path_factory.mktemp("smi")
    files = {}
    for host in ("node0", "node1"):
        files[host] = d / f"{host}.csv"
        files[host].write_text(_smi(_rows(host)))
    return files


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_format_bills_as_the_nvidia_smi_csv_of_the_same_readings(cli, tmp_path, baseline, fmt):
    write, extra = FORMATS[fmt]
    files = {}
    for host in ("node0", "node1"):
        files[host] = tmp_path / f"{host}.log"
        files[host].write_text(write(_rows(host), host))
    want = _bill(cli, baseline)
    assert want["valid_steps"] > 0 and want["gpu_hours"]["productive"] > 0
    assert _bill(cli, files, *extra) == want


def test_documented_dmon_with_dates_reads_its_values():
    chunk = gpulogs.read_log(DATA / "dmon-DT-pucet.txt", "h", "UTC", Diagnostics(stream=None))
    assert chunk.index.tolist() == [0, 0, 0]
    assert chunk.power_w.tolist() == [37.0, 39.0, 39.0] and chunk.util_pct.tolist() == [0.0, 0.0, 0.0]
    t0 = dt.datetime(2021, 1, 2, 19, 12, 31, tzinfo=dt.timezone.utc).timestamp() * 1000
    assert (chunk.ts_ms - t0).tolist() == [0, 2000, 4000] and chunk.line.tolist() == [3, 4, 5]


def test_documented_dmon_without_dates_is_dated_from_start_and_interval():
    diag = Diagnostics(stream=None)
    with pytest.raises(InputError, match="no dates: give --start"):
        gpulogs.read_log(DATA / "dmon-default.txt", "h", "UTC", diag)
    chunk = gpulogs.read_log(
        DATA / "dmon-default.txt", "h", "UTC", diag, clock=gpulogs.LogClock(10_000, 2000)
    )
    assert chunk.index.tolist() == [0, 1, 0, 1] and chunk.ts_ms.tolist() == [10_000, 10_000, 12_000, 12_000]
    assert chunk.power_w.tolist() == [312, 305, 318, 71] and chunk.util_pct.tolist() == [98, 97, 99, 0]


def test_documented_dcgmi_dmon_keeps_its_energy_and_skips_other_entities():
    diag = Diagnostics(stream=None)
    chunk = gpulogs.read_log(DATA / "dcgmi-dmon.txt", "h", "UTC", diag, clock=gpulogs.LogClock(0, 1000))
    assert chunk.index.tolist() == [0, 1, 0, 1] and chunk.ts_ms.tolist() == [0, 0, 1000, 1000]
    assert chunk.power_w[[0, 2, 3]].tolist() == [120.512, 121.25, 65.001] and np.isnan(chunk.power_w[1])
    assert chunk.energy_mj is not None and chunk.energy_mj[[0, 2]].tolist() == [1234567, 1355079]
    assert diag.counts["other_entity"] == 1  # the MIG instance's line


def test_a_dateless_log_without_start_is_one_line_exit_2(cli):
    for name in ("dmon-default.txt", "dcgmi-dmon.txt"):
        r = cli("replay", "--samples", DATA / name, "--gpu-model", "H100")
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert "has no dates: give --start" in r.stderr, r.stderr


@settings(max_examples=40, deadline=None)
@given(
    readings=st.lists(
        st.tuples(st.integers(0, 7), st.integers(0, 1500), st.one_of(st.integers(0, 100), st.none())),
        min_size=1,
        max_size=60,
    ),
    header_every=st.integers(1, 30),
)
def test_any_dmon_log_reads_back_its_lines(tmp_path_factory, readings, header_every):
    """Whatever GPUs, values and '-' (unsupported) fields, and wherever dmon repeats its header:
    each line is one sample with its own values, the k-th of its GPU at start + k x interval."""
    path = tmp_path_factory.mktemp("dmon") / "d.txt"
    lines = []
    for k, (g, p, u) in enumerate(readings):
        if k % header_every == 0:
            lines += ["# gpu   pwr    sm", "# Idx     W     %"]
        lines.append(f"  {g}  {p}  {'-' if u is None else u}")
    path.write_text("\n".join(lines) + "\n")
    chunk = gpulogs.read_log(path, "h", "UTC", Diagnostics(stream=None), clock=gpulogs.LogClock(0, 1000))
    assert chunk.index.tolist() == [g for g, _, _ in readings]
    assert chunk.power_w.tolist() == [float(p) for _, p, _ in readings]
    assert [None if np.isnan(u) else u for u in chunk.util_pct] == [u for _, _, u in readings]
    seen: dict[int, int] = {}
    want = []
    for g, _, _ in readings:
        want.append(seen.get(g, 0) * 1000)
        seen[g] = seen.get(g, 0) + 1
    assert chunk.ts_ms.tolist() == want


def test_wide_columns_are_told_by_a_gpu_number_and_a_role():
    assert gpulogs.wide_columns(["time", "gpu0_power_w", "gpu0_util", "gpu1_power_w", "gpu1_util"]) == {
        0: {"power": 1, "util": 2},
        1: {"power": 3, "util": 4},
    }
    assert gpulogs.wide_columns(["timestamp", "GPU 3 Power (W)", "GPU 3 Utilization (%)"]) == {
        3: {"power": 1, "util": 2}
    }
    assert gpulogs.wide_columns(["ts", "power_0", "power_1", "gpu0_memory_util"]) == {
        0: {"power": 1},
        1: {"power": 2},
    }
    # nvidia-smi's own names, and one GPU's logger columns, are no wide file
    assert gpulogs.wide_columns(["timestamp", "index", "power.draw [W]", "utilization.gpu [%]"]) is None
    assert gpulogs.wide_columns(["time", "gpu_index", "power_W", "utilization_gpu_percent"]) is None


# --- the rules a trace's shape decides --------------------------------------------------------


def _one_gpu_csv(path: Path, readings: list[tuple[float, float, float]], name: str = "") -> None:
    """(seconds from the start, power W, util %) of GPU 0."""
    t0 = dt.datetime(2026, 3, 1, tzinfo=dt.timezone.utc)
    head = "timestamp, index, power.draw [W], utilization.gpu [%]" + (", name" if name else "")
    lines = [head]
    for s, p, u in readings:
        t = t0 + dt.timedelta(seconds=s)
        lines.append(
            f"{t:%Y/%m/%d %H:%M:%S}.{t.microsecond // 1000:03d}, 0, {p:.2f} W, {u:.0f} %"
            + (f", {name}" if name else "")
        )
    path.write_text("\n".join(lines) + "\n")


def test_a_one_second_log_keeps_the_energy_of_its_pauses(cli, tmp_path):
    """A 1 s log with a ~4 s pause every 20 s (the RTX 4090 log's shape): the bridge follows the
    logger's period, so the pauses' energy is booked (interpolated) and the coverage is whole;
    a 20 s hole stays unknown, and the command says so on stderr."""
    readings, truth_j, s = [], 0.0, 0
    while s < 600:
        p = 300.0 + 50 * np.sin(s / 30)
        readings.append((s, p, 100.0))
        step = 5 if s % 20 == 19 else 1
        truth_j += p * step
        s += step
    path = tmp_path / "one-second.csv"
    _one_gpu_csv(path, readings)
    r = cli("replay", "--samples", path, "--power-limit", "450", "--format", "json")
    assert r.returncode == 0, r.stderr
    job = json.loads(r.stdout)["jobs"]["trace"]
    kwh = sum(job["energy_kwh"].values())
    assert abs(kwh * 3.6e6 / truth_j - 1) < 0.01, (kwh * 3.6e6, truth_j)
    assert job["energy_coverage"] == 1.0 and "energy known for" not in r.stderr
    holed = [x for x in readings if not 200 <= x[0] < 220]
    _one_gpu_csv(path, holed)
    r = cli("replay", "--samples", path, "--power-limit", "450", "--format", "json")
    assert r.returncode == 0 and json.loads(r.stdout)["jobs"]["trace"]["energy_coverage"] < 0.99
    assert "energy known for 96." in r.stderr and "its kWh is a floor" in r.stderr, r.stderr


def test_a_lone_gpu_busy_at_mid_power_is_compute_not_communication(cli, tmp_path):
    """A single GPU at 100% alternating ~440 W and ~250 W (a memory-bound kernel): no peer to
    wait on, so never `communication`; two GPUs reading the same are (their job's peers)."""
    path = tmp_path / "lone.csv"
    _one_gpu_csv(path, [(s * 0.1, (440.0 if (s // 300) % 2 else 250.0) + s % 7, 100.0) for s in range(6000)])
    for extra in ((), ("--power-limit", "450")):
        r = cli("replay", "--samples", path, "--format", "json", *extra)
        assert r.returncode == 0, r.stderr
        bands = json.loads(r.stdout)["jobs"]["trace"]["band_gpu_hours"]
        assert bands["communication"] == 0 and bands["compute"] == pytest.approx(1 / 6)
    lines = path.read_text().splitlines()
    two = [lines[0]] + [x for line in lines[1:] for x in (line, line.replace(", 0, ", ", 1, ", 1))]
    path.write_text("\n".join(two) + "\n")
    r = cli("replay", "--samples", path, "--format", "json")
    bands = json.loads(r.stdout)["jobs"]["trace"]["band_gpu_hours"]
    assert bands["communication"] == pytest.approx(1 / 6) and bands["compute"] == pytest.approx(1 / 6)


def test_a_reading_far_above_the_named_models_limit_gets_a_profile_of_its_own(cli, tmp_path):
    """A trace named A100 (limit 400 W) that reads 739 W is not banded with the A100's profile:
    warned by name and figure, the profile derived from the trace's own levels."""
    path = tmp_path / "mislabelled.csv"
    readings = [(s, 739.0 if s < 300 else 80.0, 100.0 if s < 300 else 0.0) for s in range(600)]
    _one_gpu_csv(path, readings, name="NVIDIA A100-SXM4-40GB")
    r = cli("replay", "--samples", path, "--format", "json")
    assert r.returncode == 0, r.stderr
    prof = json.loads(r.stdout)["jobs"]["trace"]["profile"]
    assert prof["over_limit"] == {"limit_w": 400.0, "reading_w": 739.0}
    assert prof.get("derived_from", prof["source"]) == "derived_from_trace" and prof["compute_min_w"] > 400
    assert "names GPU model" in r.stderr and "reads 739 W" in r.stderr, r.stderr
    # a trace within its model's limit keeps the model's profile, and no such line
    _one_gpu_csv(path, [(s, min(p, 390.0), u) for s, p, u in readings], name="NVIDIA A100-SXM4-40GB")
    r = cli("replay", "--samples", path, "--format", "json")
    assert "over_limit" not in json.loads(r.stdout)["jobs"]["trace"]["profile"] and "reads" not in r.stderr


def _numbered(seed: int, offsets: tuple[float, ...] | None, tmp: Path) -> tuple[int, int, int]:
    """(lines given a wrong GPU, lines unplaced, lines of the minute GPU 3 was gone) of an
    index-less 8xH100 file without memory.used whose readings are noisier (+-40 W) than the
    boards' own steady differences."""
    from costexporter.core import tracefiles as files
    from tests.realtrace import H100_LEVELS, Scenario, csv_lines, write_csv

    levels = {**H100_LEVELS, "compute": ((555.0, 40.0, 84.0, 97.0), (555.0, 40.0, 84.0, 97.0))}
    tr = Scenario.field(seed=seed, memory=False, levels=levels, offsets_w=offsets).build()
    path = write_csv(tr, tmp / f"f{seed}.csv")
    diag = Diagnostics(stream=None)
    samples = files.combine([files.read_samples(path, "node0", "UTC", diag)], diag)
    assert samples.src is not None
    line = (samples.src & 0xFFFFFFFF).astype(np.int64)
    truth = csv_lines(tr)[line - 2]
    index = np.asarray([g.index for g in samples.gpus])[samples.gpu]
    wrong = int(np.sum(index != tr.samples.gpu[truth]))
    gone = int(
        np.sum(
            (tr.samples.ts_ms >= tr.samples.ts_ms.min() + 55_000)
            & (tr.samples.ts_ms < tr.samples.ts_ms.min() + 115_000)
        )
    )
    return wrong, len(csv_lines(tr)) - line.size, gone


def test_an_index_less_file_missing_a_gpu_is_placed_by_the_boards_steady_power(tmp_path):
    """Boards 18-45 W apart at compute, each reading noisier than that: a few instants do not
    tell which GPU is missing, a minute's medians do. The missing minute's lines are placed but
    for the blocks around its edges (no one instant places them); never a line to a wrong GPU.
    Boards that draw alike stay unplaced, as before."""
    offsets = (0.0, 18.0, 63.0, -20.0, 25.0, -43.0, 45.0, 90.0)
    for seed in (0, 3):
        wrong, unplaced, gone = _numbered(seed, offsets, tmp_path)
        assert wrong == 0 and 0 < unplaced <= 0.1 * gone, (seed, unplaced, gone)
    wrong, unplaced, gone = _numbered(0, None, tmp_path)
    assert wrong == 0 and unplaced >= 0.9 * gone


def test_a_wide_files_empty_cells_are_no_reading_of_that_gpu(tmp_path):
    """A pynvml logger that could not read GPU 1 for a minute leaves its cells empty: those rows
    have no sample of GPU 1 (its time unobserved), not a sample without values."""
    lines = ["time,gpu0_power_w,gpu0_util,gpu1_power_w,gpu1_util"]
    for s in range(300):
        gone = 100 <= s < 160
        lines.append(f"{1_780_000_000 + s},500,100,{'' if gone else 510},{'' if gone else 100}")
    path = tmp_path / "wide.csv"
    path.write_text("\n".join(lines) + "\n")
    chunk = gpulogs.read_log(path, "h", "UTC", Diagnostics(stream=None))
    assert np.bincount(chunk.index).tolist() == [300, 240] and not np.isnan(chunk.power_w).any()


def test_calibrate_reads_the_same_formats_and_dates_a_dateless_log_by_start(cli, tmp_path):
    path = tmp_path / "dmon.txt"
    rows = [
        (
            dt.datetime(2026, 3, 1, tzinfo=dt.timezone.utc),
            g,
            "",
            560 if s < 300 else 90,
            100 if s < 300 else 0,
        )
        for s in range(600)
        for g in range(2)
    ]
    path.write_text(_dmon(rows, ""))
    out = tmp_path / "p.yaml"
    label = "--label", "1772323200..1772323500=compute", "--label", "1772323500..1772323800=idle"
    r = cli("calibrate", "--samples", path, "--gpu-model", "H100", *label, "--out", out)
    assert r.returncode == 2 and "give --start" in r.stderr, r.stderr
    r = cli(
        "calibrate",
        "--samples",
        path,
        "--start",
        "2026-03-01T00:00:00Z",
        "--gpu-model",
        "H100",
        *label,
        "--out",
        out,
    )
    assert r.returncode == 0, r.stderr
    assert out.exists()


def test_dcgm_exporters_own_output_saved_scrape_after_scrape_reads_as_a_dump(tmp_path):
    """dcgm-exporter 3.3 (`Hostname`) and 4.2 (`hostname`, MIG) scrapes, each after a `date -Is`
    line: one sample per GPU a scrape at that time, the GPU named by its labels, the pods that
    held it kept; MIG instances' series counted and skipped."""
    from costexporter.services import history

    src = ROOT / "tests" / "data" / "dcgm"
    for name, host, pod, n_gpus in (
        ("dcgm-3.3-Hostname.prom", "gpu-node-a", "llama-ft-worker-0", 2),
        ("dcgm-4.2-hostname.prom", "gpu-node-b", "infer-a-7d9f8c6b5-x2k9q", 2),
    ):
        body = (src / name).read_text()
        path = tmp_path / name
        path.write_text(f"2026-03-01T00:00:00+00:00\n{body}2026-03-01T00:00:15+00:00\n{body}")
        diag = Diagnostics(stream=None)
        chunk, spans = history.read_exporter_dump(path, "ignored", gpulogs.LogClock(), diag)
        t0 = 1772323200000
        assert chunk.hosts == [host] and chunk.index.tolist() == [i for i in range(n_gpus) for _ in (0, 1)]
        assert chunk.ts_ms.tolist() == [t0, t0 + 15000] * n_gpus
        assert {s.pod.pod for s in spans} == {pod} and all(s.last_ms == t0 + 15000 for s in spans)
        assert chunk.name[(host, 0)] == "NVIDIA H100 80GB HBM3" and chunk.energy_mj is not None
    path = tmp_path / "mig.prom"
    path.write_text("2026-03-01T00:00:00Z\n" + (src / "dcgm-4.2-mig-h100.prom").read_text())
    diag = Diagnostics(stream=None)
    chunk, _ = history.read_exporter_dump(path, "h", gpulogs.LogClock(), diag)
    assert chunk.index.tolist() == [1]  # GPU 0 is split into MIG instances: not replayed
    assert diag.counts["mig_instance_series"] > 0


def test_only_a_sustained_reading_above_the_limit_doubts_the_model():
    """Brief spikes over the limit (under 1% of readings) keep the model's profile; a level above
    it does not; an operator's limit or a file is never doubted."""
    from costexporter.core import profiles

    a100 = profiles.derive(400.0, name="A100")
    spikes = np.r_[np.full(995, 380.0), np.full(5, 700.0), np.nan]
    assert profiles.over_limit(a100, "derived_from_model", spikes) is None
    level = np.r_[np.full(500, 739.0), np.full(500, 80.0)]
    assert profiles.over_limit(a100, "derived_from_model", level) == {"limit_w": 400.0, "reading_w": 739.0}
    assert profiles.over_limit(a100, "derived_from_limit", level) is None
    assert profiles.over_limit(a100, "file", level) is None


def test_a_wide_files_bad_cell_drops_that_gpus_reading_only_and_is_said(tmp_path):
    """A cell that is no number, or power out of range, drops that GPU's reading of the row
    (counted, its line named), not the other GPU's; a bad time drops the row for every GPU."""
    path = tmp_path / "wide.csv"
    path.write_text(
        "time,gpu0_power_w,gpu0_util,gpu1_power_w,gpu1_util\n"
        "2026-05-28T20:26:40Z,500,100,510,100\n"
        "2026-05-28T20:26:41Z,oops,100,510,100\n"
        "2026-05-28T20:26:42Z,500,100,20000,100\n"
        "soon,500,100,510,100\n"
        "2026-05-28T20:26:44Z,500,100,510,100\n"
    )
    diag = Diagnostics(stream=None)
    chunk = gpulogs.read_log(path, "h", "UTC", diag)
    assert sorted(zip(chunk.index.tolist(), chunk.line.tolist(), strict=True)) == [
        (0, 2),
        (0, 4),
        (0, 6),
        (1, 2),
        (1, 3),
        (1, 6),
    ]
    assert diag.counts["bad_value"] == 2 and diag.counts["bad_timestamp"] == 1


_LINES = {
    "dmon": ["# gpu   pwr    sm", "# Idx     W     %", "    0   312    98", "    1     -     -"],
    "dcgmi": [
        "#Entity   POWER    GPUTL    TOTEC",
        "ID  W  %  mJ",
        "GPU 0  120.5  45  1234",
        "GPU-I 3 N/A 1 N/A",
    ],
    "wide": ["time,gpu0_power_w,gpu0_util", "2026-03-01T00:00:00Z,500,100", "2026-03-01T00:00:01Z,,"],
    "dump": [
        "2026-03-01T00:00:00Z",
        "# TYPE DCGM_FI_DEV_POWER_USAGE gauge",
        'DCGM_FI_DEV_POWER_USAGE{gpu="0",UUID="GPU-1",Hostname="n"} 71.2',
    ],
}


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(sorted(_LINES)),
    picks=st.lists(st.integers(0, 3), min_size=1, max_size=12),
    junk=st.lists(st.text(max_size=40), max_size=4),
)
def test_any_mix_of_a_formats_lines_and_junk_reads_or_is_one_line(tmp_path_factory, kind, picks, junk):
    """Lines of a format in any order, repeated, with junk between them (a cut line, stray text,
    control characters): the reader gives samples or one InputError, never another exception."""
    from costexporter.services import history

    lines = _LINES[kind]
    body = [lines[0]] + [lines[i % len(lines)] for i in picks] + [j.replace("\0", "") for j in junk]
    path = tmp_path_factory.mktemp("fuzz") / f"f.{kind}"
    path.write_text("\n".join(body) + "\n", encoding="utf-8", errors="replace")
    diag = Diagnostics(stream=None)
    clock = gpulogs.LogClock(1_772_323_200_000, 1000)
    try:
        if gpulogs.kind_of(path) == "dcgm-exporter":
            chunk, _ = history.read_exporter_dump(path, "h", clock, diag)
        else:
            chunk = gpulogs.read_log(path, "h", "UTC", diag, clock=clock)
    except InputError as e:
        assert "\n" not in str(e)
        return
    assert chunk.index.size == chunk.ts_ms.size == chunk.power_w.size and chunk.index.size > 0
