"""Reading recorded traces: every nvidia-smi CSV form parses to the same samples as JSONL."""

from __future__ import annotations

import datetime as dt
import itertools
from pathlib import Path
from zoneinfo import ZoneInfo

import numpy as np
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from costexporter.core import tracefiles as files
from costexporter.core.diagnostics import Diagnostics, InputError
from costexporter.sources.synth import TraceBuilder, write_nvidia_smi_csv, write_samples_jsonl


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


def test_bad_jsonl_samples_are_warned_not_an_internal_error(tmp_path):
    p = tmp_path / "h.jsonl"
    good = '{"ts": 1753577230.1, "host": "h", "gpu": 0, "power_w": 100, "util_pct": 5}'
    p.write_text(
        good
        + "\n"
        + good.replace('"gpu": 0', '"gpu": Infinity')  # json.loads reads it; int() overflows
        + "\n"
        + good.replace("}", ', "power_limit_w": "lots"}')
        + "\n"
    )
    import io

    out = io.StringIO()
    s, diag = read_all([p], diag=Diagnostics(stream=out))
    assert len(s) == 1
    assert diag.counts == {"bad_value": 2}
    assert f"{p}:2: bad_value" in out.getvalue() and f"{p}:3: bad_value" in out.getvalue()


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
        # A timestamp's shape but no such time: refused, not an internal error.
        (b"timestamp, power.draw [W], utilization.gpu [%]\n2025/13/45 99:99:99, 94.7 W, 0 %\n", "impossible"),
        (b"timestamp, power.draw [W], utilization.gpu [%]\n2025/02/30 00:00:00, 94.7 W, 0 %\n", "impossible"),
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


# What real 100 ms nvidia-smi files look like (tests/realtrace.py: skewed stamps, ramps, gaps).


def _real_csv(tmp_path, **kw):
    from tests.realtrace import Scenario, write_csv

    tr = Scenario.h100(seed=7, compute_s=20.0, checkpoints=1, idle_s=3.0, jitter_p=0.2).build()
    return tr, write_csv(tr, tmp_path / "node0.csv", **kw)


def test_index_less_lines_keep_their_gpu_when_gpu_0_is_stamped_early(tmp_path):
    # 15.2: the GPU 0 line of an instant stamped 50-80 ms early stays GPU 0.
    tr, p = _real_csv(tmp_path)
    got, diag = read_all([p])
    assert not diag.counts
    want = tr.samples
    assert np.bincount(got.gpu).tolist() == np.bincount(want.gpu).tolist()
    np.testing.assert_array_equal(got.gpu, want.gpu)
    np.testing.assert_array_equal(got.ts_ms, want.ts_ms)
    np.testing.assert_allclose(got.power_w, want.power_w, atol=0.006)


def test_a_short_instant_is_never_given_to_another_gpu_and_counting_restarts_after_it(tmp_path):
    tr, p = _real_csv(tmp_path)
    lines = p.read_text().splitlines(keepends=True)
    # Instant 100 lost the lines of GPUs 6 and 7 (lines 1 + 800 + 6, + 7). It is idle: the eight
    # GPUs read alike, so nothing tells which six GPUs its lines are: counted, said, not booked.
    del lines[1 + 800 + 6 : 1 + 800 + 8]
    p.write_text("".join(lines))
    got, diag = read_all([p])
    assert diag.counts == {"unplaced_line": 6}
    assert np.bincount(got.gpu).tolist() == [len(tr.samples) // 8 - 1] * 8
    # Every line before and after the short instant is numbered right.
    for g in range(8):
        want = tr.samples.ts_ms[tr.samples.gpu == g]
        np.testing.assert_array_equal(got.ts_ms[got.gpu == g], np.delete(want, 100))


def test_a_complete_last_line_without_a_newline_is_kept(tmp_path):
    # 15.7: nvidia-smi killed between two lines.
    tr, p = _real_csv(tmp_path, trailing_newline=False)
    got, diag = read_all([p])
    assert not diag.counts and len(got) == len(tr.samples)
    # Cut mid-value, it is still dropped and counted (and its instant is one line short).
    p.write_text(p.read_text()[:-4])
    got, diag = read_all([p])
    # The cut line still held GPU 7's place: no other line moves.
    assert diag.counts == {"truncated_last_line": 1} and len(got) == len(tr.samples) - 1
    assert np.bincount(got.gpu).tolist() == [len(tr.samples) // 8] * 7 + [len(tr.samples) // 8 - 1]


@pytest.mark.parametrize("unit", ["mW", "kW"])
def test_power_in_mw_or_kw_is_converted_from_the_header(tmp_path, unit):
    # 15.6: every row used to be rejected as out of range.
    tr, p = _real_csv(tmp_path, power_unit=unit)
    got, diag = read_all([p])
    assert not diag.counts
    np.testing.assert_allclose(got.power_w, tr.samples.power_w, atol=0.006)


def test_a_file_whose_every_row_is_rejected_is_an_input_error_with_the_reason(tmp_path):
    p = tmp_path / "x.csv"
    p.write_text(
        "timestamp, power.draw [W], utilization.gpu [%]\n"
        "2025/07/27 00:47:10.134, 555000.00 W, 90 %\n"
        "2025/07/27 00:47:10.234, 556000.00 W, 91 %\n"
    )
    with pytest.raises(InputError, match=r"no usable samples: every row was rejected \(bad_value=2\)"):
        files.read_samples(p, "h", "UTC", Diagnostics(stream=None))


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 8),
    st.lists(
        st.tuples(st.integers(0, 5).map(lambda x: x == 0), st.sampled_from([0] * 40 + list(range(1, 8)))),
        min_size=8,
        max_size=80,
    ),
)
# The file begins with an instant one line short, every other start after it hidden by an early
# GPU 0 line, then an instant three lines short: the count through the first shift was judged by
# the starts after the second and lost to a block of 3 lines that fits both.
@example(
    6,
    [(False, 1), (False, 0), (True, 0), (False, 0), (True, 0), (False, 0), (True, 0), (False, 3)]
    + [(False, 0)] * 4,
)
def test_positional_numbering_holds_for_early_stamps_and_short_instants(n_gpus, instants):
    """Each instant: (GPU 0 stamped 50-80 ms early?, lines lost at its end). As in real files,
    most instants are whole and on time. Every line that was written keeps its GPU or, in a
    short instant whose lines nothing tells apart, none: never another GPU's; every short
    instant is said. (Two short instants within six instants of each other whose lost lines
    make up for each other look exactly like one instant written in two bursts, when no reading
    tells the GPUs apart: the reader takes them for the burst, which real files show far more
    often. An instant that lost lines and whose GPU 0 line is stamped early joins the instant
    before it: only readings could show it. Early stamps come one instant at a time here.)"""
    assume(sum(e for e, _ in instants) * 4 <= len(instants))
    # Early stamps come one instant at a time (two in a row hide two instants' starts).
    assume(not any(a[0] and b[0] for a, b in itertools.pairwise(instants)))
    assume(sum(n > 0 for _, n in instants) * 5 <= len(instants))
    ts, gpu, short, shorts = [], [], [], 0
    last_loss = -10
    lost_counts = []
    for k, (early, lost) in enumerate(instants):
        nxt_early = k + 1 < len(instants) and instants[k + 1][0]
        lost = 0 if early or nxt_early or n_gpus == 1 or k - last_loss <= 6 else min(lost, n_gpus - 1)
        shorts += lost > 0
        lost_counts.append(lost)
        last_loss = k if lost else last_loss
        for g in range(n_gpus - lost):
            ts.append(1_753_577_230_000 + 100 * k + g - (65 if early and g == 0 and n_gpus > 1 else 0))
            gpu.append(g)
            short.append(lost > 0)
    warned = []
    got = files._positional_index(
        np.asarray(ts, np.int64), np.zeros(len(ts), bool), lambda *a: warned.append(a)
    )
    # Losses that add up to whole instants leave the count where it was: with no reading to tell
    # the GPUs apart they look like bursts, and the reader takes them for bursts.
    assume(all(c % n_gpus for c in np.cumsum([n for n in lost_counts if n])))
    want, short = np.asarray(gpu), np.asarray(short)
    assert ((got == want) | ((got == -1) & short)).all()
    assert (got[~short] == want[~short]).all()  # counting restarts right after each short instant
    said = {line for line, reason, _ in warned if reason in ("unplaced_line", "short_block")}
    short_lines = {i + 2 for i in np.flatnonzero(short)}
    assert short_lines <= said | {i + 2 for i in np.flatnonzero(got == want)}
    assert len({line for line in said if line in short_lines}) >= min(shorts, 1) if shorts else not said


_STAMPS = [
    "2025/07/27 00:47:10.135",
    "2025/07/27 00:47:10.180",
    "2025/07/27 00:47:11.135",
    "2025/13/45 99:99:99",
]
_VALUES = ["94.73 W", "100 %", "[N/A]", "", "x", "-5 W", "1e9 W", "0 %", " 50", "12.5 mW", "3 kW"]


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from(
        [
            "timestamp, power.draw [W], utilization.gpu [%]",
            "timestamp, index, power.draw [mW], utilization.gpu [%]",
            "timestamp, power.draw, utilization.gpu",
        ]
    ),
    st.lists(
        st.one_of(
            st.tuples(
                st.sampled_from([*_STAMPS, "", "timestamp", "garbage"]), *[st.sampled_from(_VALUES)] * 2
            ).map(", ".join),
            st.text(alphabet=',0123456789. W%\n"', max_size=30),
        ),
        max_size=40,
    ),
    st.booleans(),
)
def test_any_mix_of_bad_csv_lines_is_samples_or_an_input_error(tmp_path_factory, header, lines, newline):
    """Never an internal error: whatever the lines, the reader returns samples or refuses the
    file with InputError (the CLI's exit 2)."""
    p = tmp_path_factory.mktemp("fuzz") / "n.csv"
    p.write_text(header + "\n" + "\n".join(lines) + ("\n" if newline else ""))
    try:
        files.read_samples(p, "n", "UTC", Diagnostics(stream=None))
    except InputError as e:
        assert "\n" not in str(e)


def test_two_readings_of_one_gpu_at_one_ms_keep_the_later_and_are_counted(tmp_path):
    p = tmp_path / "h.csv"
    p.write_text(
        "timestamp, index, power.draw [W], utilization.gpu [%]\n"
        "2025/07/26 23:53:30.945, 0, 100.00 W, 0 %\n"
        "2025/07/26 23:53:30.945, 0, 900.00 W, 100 %\n"
        "2025/07/26 23:53:30.945, 1, 120.00 W, 0 %\n"
        "2025/07/26 23:53:31.945, 0, 905.00 W, 100 %\n"
    )
    diag = Diagnostics(stream=None)
    s = files.combine([files.read_samples(p, "h", "UTC", diag)], diag)
    assert len(s) == 3
    assert diag.counts["duplicate_sample"] == 1
    np.testing.assert_allclose(s.power_w[s.gpu == 0], [900.0, 905.0])
