"""`replay --timeline FILE`: one row per sample read, where it was read, its band and category."""

from __future__ import annotations

import csv
import json

import numpy as np

from costexporter.core import bandtable
from tests.realtrace import LABEL_BAND, Scenario, csv_lines, write_csv, write_events

BAND_NAMES = bandtable.current().names


def read_timeline(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_every_sample_read_is_one_row_naming_its_file_and_line(cli, tmp_path):
    tr = Scenario.h100(seed=4, checkpoints=1, compute_s=20.0).build()
    a = write_csv(tr, tmp_path / "a.csv")
    ev = write_events(tr, tmp_path / "a.jsonl")
    # A malformed line in the middle: read and rejected, so it has no row; the others keep theirs.
    lines = a.read_text().splitlines(keepends=True)
    bad_line = 500
    lines[bad_line - 1] = "2025/07/27 00:48:00.000, oops\n"
    a.write_text("".join(lines))
    out = tmp_path / "tl.csv"
    r = cli("replay", "--samples", f"node0={a}", "--events", ev, "--timeline", out, "--format", "json")
    assert r.returncode == 0, r.stderr
    rows = read_timeline(out)
    assert list(rows[0]) == [
        *("file", "line", "host", "gpu", "uuid", "name", "ts", "power_w", "util_pct", "band", "category")
    ]
    assert len(rows) == len(lines) - 2  # every data line but the malformed one
    text = a.read_text().splitlines()
    got_lines = [int(x["line"]) for x in rows]
    assert got_lines == sorted(got_lines) and bad_line not in got_lines
    checked = 0
    for x in rows[::97]:
        assert x["file"] == str(a) and x["host"] == "node0"
        written = text[int(x["line"]) - 1].split(", ")
        assert float(written[1].split()[0]) == float(x["power_w"])  # the line it names holds it
        assert float(written[2].split()[0]) == float(x["util_pct"])
        checked += 1
    assert checked > 10
    assert {x["band"] for x in rows} <= set(BAND_NAMES) | {""}
    # The timeline's bands are the report's: its GPU-hours by band, sample by sample.
    rep = json.loads(r.stdout)["jobs"]["real"]
    compute_rows = sum(x["band"] == "compute" for x in rows)
    assert abs(compute_rows * 0.1 / 3600 - rep["band_gpu_hours"]["compute"]) < 0.002


def test_the_timeline_agrees_with_the_generator_sample_by_sample(cli, tmp_path):
    tr = Scenario.h100(seed=6, checkpoints=2, compute_s=30.0).build()
    a = write_csv(tr, tmp_path / "n.csv")
    ev = write_events(tr, tmp_path / "n.jsonl")
    out = tmp_path / "tl.csv"
    r = cli("replay", "--samples", f"node0={a}", "--events", ev, "--timeline", out, "-q")
    assert r.returncode == 0, r.stderr
    rows = read_timeline(out)
    truth = np.asarray([LABEL_BAND[x] for x in tr.labels])[csv_lines(tr)]
    got = np.asarray([BAND_NAMES.index(x["band"]) if x["band"] else -1 for x in rows])
    line = np.asarray([int(x["line"]) for x in rows])
    gpu = np.asarray([int(x["gpu"]) for x in rows])
    assert (gpu == tr.samples.gpu[csv_lines(tr)][line - 2]).all()  # the right GPU on every line
    assert np.mean(got == truth[line - 2]) >= 0.99


def test_jsonl_samples_and_two_files_name_their_own_lines(cli, tmp_path):
    from costexporter.sources.synth import TraceBuilder, write_nvidia_smi_csv, write_samples_jsonl

    b = TraceBuilder(n_gpus=4, per_host=2, job="t", seed=1)
    b.stretch("compute", 30)
    s = b.samples()
    csvs = write_nvidia_smi_csv(s, tmp_path)
    j = write_samples_jsonl(s, tmp_path / "all.jsonl")
    out = tmp_path / "tl.csv"
    r = cli("replay", *[x for c in csvs for x in ("--samples", c)], "--gpu-model", "B300", "--timeline", out)
    assert r.returncode == 0, r.stderr
    rows = read_timeline(out)
    assert len(rows) == len(s) and {x["file"] for x in rows} == {str(c) for c in csvs}
    assert all(2 <= int(x["line"]) <= 61 for x in rows)
    r = cli("replay", "--samples", j, "--gpu-model", "B300", "--timeline", out)
    rows = read_timeline(out)
    assert [int(x["line"]) for x in rows] == list(range(1, len(s) + 1))  # JSONL: no header
    assert {x["band"] for x in rows} == {"compute"}
