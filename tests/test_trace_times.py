"""Traces as loggers write them: times in any ISO 8601 form, with or without a zone, or Unix
seconds/milliseconds (one vectorised rule, `timeutil.parse_times`); the common column names of
other loggers; replay's own `--timeline` reads back as a trace."""

from __future__ import annotations

import datetime as dt
import json

import pyarrow as pa
from hypothesis import given
from hypothesis import strategies as st

from costexporter.core.timeutil import parse_times, to_ms

from .conftest import ROOT

EXAMPLE = ROOT / "examples" / "r1-mini"
ZONES = [dt.timezone(dt.timedelta(minutes=m)) for m in (-480, -300, 0, 60, 330, 540, 840)]


def _write(t: dt.datetime, form: str, zone: dt.tzinfo) -> str:
    local = t.astimezone(zone)
    frac = f"{local:%Y-%m-%d}T{local:%H:%M:%S}.{local.microsecond // 1000:03d}"
    off = local.strftime("%z")
    return {
        "Z": t.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z",
        "z-lower": t.astimezone(dt.timezone.utc).strftime("%Y-%m-%dt%H:%M:%S.%f")[:-3] + "z",
        "colon": frac + off[:3] + ":" + off[3:],
        "compact": frac.replace("T", " ") + off,
        "slashes": frac.replace("-", "/").replace("T", " ") + off[:3] + ":" + off[3:],
        "unix_s": f"{t.timestamp():.3f}",
        "unix_ms": str(round(t.timestamp() * 1000)),
    }[form]


@given(
    ms=st.integers(978_307_200_000, 2_051_222_400_000),  # 2001 .. 2035
    form=st.sampled_from(["Z", "z-lower", "colon", "compact", "slashes", "unix_s", "unix_ms"]),
    zone=st.sampled_from(ZONES),
)
def test_every_written_form_reads_back_as_its_instant(ms, form, zone):
    t = dt.datetime.fromtimestamp(ms / 1000, dt.timezone.utc)
    text = _write(t, form, zone)
    got, bad, how = parse_times(pa.chunked_array([[text, text]]), "Asia/Tokyo")  # tz: zone-less only
    assert not bad.any() and list(got) == [ms, ms], (text, how)
    assert how == (form if form.startswith("unix") else "zoned")


@given(ms=st.integers(978_307_200_000, 2_051_222_400_000), zone=st.sampled_from(["UTC", "America/New_York"]))
def test_a_time_without_a_zone_is_taken_in_tz(ms, zone):
    from zoneinfo import ZoneInfo

    local = dt.datetime.fromtimestamp(ms / 1000, ZoneInfo(zone)).replace(tzinfo=None)
    text = local.isoformat(sep=" ", timespec="milliseconds")
    got, bad, how = parse_times(pa.chunked_array([[text]]), zone)
    back = dt.datetime.fromisoformat(text).replace(tzinfo=ZoneInfo(zone))  # the earlier of a repeated hour
    assert how == "local" and not bad.any() and got[0] == to_ms(back.timestamp())


def test_rows_that_are_no_time_are_marked_and_the_rest_read():
    got, bad, _ = parse_times(
        pa.chunked_array([["2025-07-26T03:41:43Z", "soon", "", "2025-07-26 03:41:44Z"]]), "UTC"
    )
    assert list(bad) == [False, True, True, False] and got[3] - got[0] == 1000


def _nvidia_smi_rows() -> tuple[list[str], list[list[str]]]:
    lines = (EXAMPLE / "node0.csv").read_text().splitlines()
    return lines[0].split(","), [x.split(",") for x in lines[1:] if x]


def _bill(cli, path, *extra) -> dict:
    r = cli(
        "replay",
        "--samples",
        f"node0={path}",
        "--events",
        EXAMPLE / "events.jsonl",
        "--format",
        "json",
        *extra,
    )
    assert r.returncode == 0, r.stderr
    job = json.loads(r.stdout)["jobs"]["qwen3-mini"]
    return {k: job[k] for k in ("gpu_hours", "energy_kwh", "cost_total", "steps_completed")} | {
        "stderr": r.stderr
    }


def test_a_trace_with_zoned_iso_or_unix_times_books_as_the_nvidia_smi_one(cli, tmp_path):
    """The same samples, their times written as nanoGPT's logger (…Z), with an offset, as Unix
    seconds and as Unix milliseconds: the same bill as nvidia-smi's local times; a Unix column
    is said (seconds or milliseconds)."""
    header, rows = _nvidia_smi_rows()
    ts_col = [c.strip().lower() for c in header].index("timestamp")
    want = _bill(cli, EXAMPLE / "node0.csv")
    for form in ("Z", "colon", "unix_s", "unix_ms"):
        out = tmp_path / f"{form}.csv"
        lines = [",".join(header)]
        for row in rows:
            t = dt.datetime.strptime(row[ts_col].strip(), "%Y/%m/%d %H:%M:%S.%f").replace(
                tzinfo=dt.timezone.utc
            )
            lines.append(",".join([*row[:ts_col], _write(t, form, ZONES[5]), *row[ts_col + 1 :]]))
        out.write_text("\n".join(lines) + "\n")
        got = _bill(cli, out)
        said = got.pop("stderr")
        assert got == {k: v for k, v in want.items() if k != "stderr"}, form
        if form.startswith("unix"):
            assert f"timestamps read as Unix {form[5:]}" in said


def test_other_loggers_column_names_are_read(cli, tmp_path):
    """nanoGPT-style names (gpu_index, power_W, utilization_gpu_percent, a time with Z)."""
    header, rows = _nvidia_smi_rows()
    keys = [c.strip().lower().split(" [")[0] for c in header]
    rename = {
        "timestamp": "time",
        "index": "gpu_index",
        "power.draw": "power_W",
        "utilization.gpu": "utilization_gpu_percent",
    }
    out = tmp_path / "logger.csv"
    out.write_text("\n".join([",".join(rename.get(k, k) for k in keys), *(",".join(r) for r in rows)]) + "\n")
    want, got = _bill(cli, EXAMPLE / "node0.csv"), _bill(cli, out)
    assert {k: v for k, v in got.items() if k != "stderr"} == {k: v for k, v in want.items() if k != "stderr"}


def test_replays_timeline_reads_back_as_the_trace_it_came_from(cli, tmp_path):
    """`--timeline` writes ISO times with a Z, the GPU's index, UUID and model: replayed as a
    trace, it books the same bill."""
    tl = tmp_path / "timeline.csv"
    want = _bill(cli, EXAMPLE / "node0.csv", "--timeline", tl)
    got = _bill(cli, tl)
    assert {k: v for k, v in got.items() if k != "stderr"} == {k: v for k, v in want.items() if k != "stderr"}


def test_columns_map_a_loggers_own_names(cli, tmp_path):
    """Names no synonym knows (when, card, watts, busy): `--columns` says which is which; the same
    bill. A role it does not know, or a column the file lacks, is one line and exit 2."""
    header, rows = _nvidia_smi_rows()
    keys = [c.strip().lower().split(" [")[0] for c in header]
    rename = {"timestamp": "when", "index": "card", "power.draw": "watts", "utilization.gpu": "busy"}
    out = tmp_path / "own.csv"
    out.write_text("\n".join([",".join(rename.get(k, k) for k in keys), *(",".join(r) for r in rows)]) + "\n")
    want = _bill(cli, EXAMPLE / "node0.csv")
    got = _bill(cli, out, "--columns", "time=when, gpu=card,power=watts,util=busy")
    assert {k: v for k, v in got.items() if k != "stderr"} == {k: v for k, v in want.items() if k != "stderr"}
    for bad, says in (
        ("temp=gpu_temp", "the role is one of"),
        ("power=volts", "'volts', which is not a column"),
    ):
        r = cli("replay", "--samples", f"node0={out}", "--columns", f"time=when,{bad}")
        assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_model_nobody_knows_is_named_in_the_note(cli, tmp_path):
    """A trace whose `name` column says a model without a known limit: the note names it (it
    said "no GPU model" although the trace named one)."""
    header, rows = _nvidia_smi_rows()
    out = tmp_path / "named.csv"
    out.write_text(
        "\n".join([",".join([*header, " name"]), *(",".join([*r, " Quadro Z9000"]) for r in rows)]) + "\n"
    )
    said = _bill(cli, out)["stderr"]
    assert "GPU model 'Quadro Z9000' has no known power limit" in said and "no GPU model or" not in said
