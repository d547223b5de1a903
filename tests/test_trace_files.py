"""Reading recorded traces: every nvidia-smi CSV form parses to the same samples as JSONL."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from zoneinfo import ZoneInfo

import numpy as np
import pytest

from costexporter.diagnostics import Diagnostics, InputError
from costexporter.sources import files
from costexporter.synth import TraceBuilder, write_nvidia_smi_csv, write_samples_jsonl


@pytest.fixture
def trace():
    b = TraceBuilder(n_gpus=8, per_host=4, job="f", seed=3)
    b.stretch("compute", 120, step_s=5)
    b.stretch("deadlock", 60, zero_ranks=(3,))
    s = b.samples()
    # Real nvidia-smi lines of one instant differ by a few ms.
    s.ts_ms = s.ts_ms + np.array([g.index for g in s.gpus])[s.gpu] * 3
    return s


def read_all(paths: list[Path], tz: str = "UTC", diag: Diagnostics | None = None):
    diag = diag or Diagnostics(stream=None)
    return files.combine([files.read_samples(p, p.stem, tz, diag) for p in paths]), diag


def assert_same(a, b):
    assert [(g.host, g.index) for g in a.gpus] == [(g.host, g.index) for g in b.gpus]
    np.testing.assert_array_equal(a.gpu, b.gpu)
    np.testing.assert_array_equal(a.ts_ms, b.ts_ms)
    np.testing.assert_allclose(a.power_w, b.power_w, atol=0.005)
    np.testing.assert_array_equal(a.util_pct, b.util_pct)


def test_index_less_units_in_values_local_time_csv_equals_jsonl(tmp_path, trace):
    jsonl = [write_samples_jsonl(trace, tmp_path / "all.jsonl")]
    from_jsonl, _ = read_all(jsonl)
    csvs = write_nvidia_smi_csv(
        trace, tmp_path / "csv", units=True, index=False, uuid=False, tz=ZoneInfo("Asia/Shanghai")
    )
    from_csv, diag = read_all(csvs, tz="Asia/Shanghai")
    assert not diag.counts
    assert_same(from_csv, from_jsonl)
    assert all(g.uuid is None for g in from_csv.gpus)


def test_nounits_csv_with_uuid_in_any_column_order(tmp_path, trace):
    from_jsonl, _ = read_all([write_samples_jsonl(trace, tmp_path / "all.jsonl")])
    for p in write_nvidia_smi_csv(trace, tmp_path / "csv", units=False):
        lines = p.read_text().splitlines()
        cols = [c.strip() for c in lines[0].split(",")]
        perm = [4, 2, 0, 3, 1]  # utilization, uuid, timestamp, power, index
        out = [", ".join(cols[i] for i in perm)]
        for line in lines[1:]:
            v = [x.strip() for x in line.split(",")]
            out.append(", ".join(v[i] for i in perm) + ", extra")
        out[0] += ", pstate"
        p.write_text("\n".join(out) + "\n")
    from_csv, diag = read_all(sorted((tmp_path / "csv").glob("*.csv")))
    assert not diag.counts
    assert_same(from_csv, from_jsonl)
    assert from_csv.gpus[0].uuid == trace.gpus[0].uuid


def test_dst_offsets_follow_the_zone(tmp_path):
    # 2025-03-30 02:00 in Europe/Berlin jumps to 03:00: local times must map back to UTC exactly.
    b = TraceBuilder(
        n_gpus=1,
        per_host=1,
        job="d",
        t0=dt.datetime(2025, 3, 30, 0, 30, tzinfo=dt.timezone.utc).timestamp(),
        interval_s=60,
    )
    b.stretch("compute", 3 * 3600)
    s = b.samples()
    [p] = write_nvidia_smi_csv(s, tmp_path, tz=ZoneInfo("Europe/Berlin"))
    got, _ = read_all([p], tz="Europe/Berlin")
    np.testing.assert_array_equal(got.ts_ms, s.ts_ms)


def test_na_values_truncated_last_line_and_blank_lines(tmp_path):
    p = tmp_path / "h.csv"
    p.write_text(
        "timestamp, index, power.draw [W], power.draw.instant [W], utilization.gpu [%], "
        "power.limit [W], name\n"
        "2025/07/26 23:53:30.945, 0, 951.20 W, [N/A], 100 %, 1100.00 W, NVIDIA B300\n"
        "2025/07/26 23:53:30.947, 1, [N/A], [Not Supported], 100 %, 1100.00 W, NVIDIA B300\n"
        "\n"
        "2025/07/26 23:53:31.945, 0, 940.00 W, 1001.5 W, [N/A], 1100.00 W, NVIDIA B300\n"
        "2025/07/26 23:53:31.947, 1, 935.00 W, 990.0 W, 99 %, 1100.00 W, NVIDIA B300\n"
        "2025/07/26 23:53:32.945, 0, 9"
    )
    s, diag = read_all([p])
    assert len(s) == 4
    assert diag.counts == {"truncated_last_line": 1}
    g0 = s.gpu == 0
    # The instant field is preferred for classification where present.
    np.testing.assert_allclose(s.power_w[g0], [951.2, 1001.5])
    assert np.isnan(s.util_pct[g0][1])
    assert np.isnan(s.power_w[~g0][0])
    assert s.gpus[0].name == "NVIDIA B300" and s.gpus[0].power_limit_w == 1100.0


def test_bad_rows_are_warned_with_file_and_line(tmp_path):
    p = tmp_path / "h.csv"
    p.write_text(
        "timestamp, index, power.draw [W], utilization.gpu [%]\n"
        "2025/07/26 23:53:30.945, 0, 951.20 W, 100 %\n"
        "2025/07/26 23:53:30.945, 1, lots W, 100 %\n"
        "2025/07/26 23:53:31.945, 0, 951.20 W\n"
        "2099/07/26 23:53:31.945, 0, 951.20 W, 100 %\n"
        "2025/07/26 23:53:32.945, 0, 951.20 W, 180 %\n"
        "2025/07/26 23:53:33.945, 0, 951.20 W, 100 %\n"
    )
    import io

    out = io.StringIO()
    s, diag = read_all([p], diag=Diagnostics(stream=out))
    assert len(s) == 2
    assert diag.counts == {"bad_value": 2, "malformed_row": 1, "bad_timestamp": 1}
    text = out.getvalue()
    assert f"{p}:3: bad_value" in text
    assert f"{p}:4: malformed_row" in text
    assert f"{p}:5: bad_timestamp" in text
    assert f"{p}:6: bad_value" in text


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file"),
        (b"", "file is empty"),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "binary data"),
        (b"name,age\nbob,3\n", "not an nvidia-smi CSV"),
        (b'{"type": "step", "job": "x"}\n', "not a samples JSONL file"),
    ],
)
def test_unusable_files_raise_one_clear_error(tmp_path, content, message):
    p = tmp_path / "x.csv"
    if content is not None:
        p.write_bytes(content)
    with pytest.raises(InputError, match=message):
        files.read_samples(p, "h", "UTC", Diagnostics(stream=None))


def test_events_jsonl_dedupes_and_counts_bad_entries(tmp_path):
    p = tmp_path / "e.jsonl"
    first = '{"v": "1", "type": "step", "job": "j", "ts": 1753570000.5, "rank": 0, "session": "a", "seq": 0'
    p.write_text(
        first
        + ', "step": 1}\n'
        + first
        + ', "step": 1}\n'
        + '{"type": "step", "job": "j", "ts": 1753570001.5, "rank": 0}\n'
        '{"type": "telemetry", "job": "j", "ts": 1753570001.5, "rank": 0}\n'
        '{"type": "step", "job": "j", "ts": 4102444800, "rank": 0, "step": 3}\n'
        "not json\n"
        '{"type": "step", "job": "j", "ts": 1753570002.5, "rank": 0, "step": 2, "new_field": 1}\n'
    )
    diag = Diagnostics(stream=None)
    evs = files.read_events_jsonl(p, diag)
    assert [e.get("step") for e in evs] == [1, 2]
    assert diag.counts == {
        "duplicate_event": 1,
        "missing_field": 1,
        "unknown_type": 1,
        "bad_timestamp": 1,
        "malformed_event": 1,
        "unknown_field": 1,
    }
    assert evs[1].get("_unknown_fields") == ["new_field"]
