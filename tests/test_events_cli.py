"""`costexporter events export/import`: a live job's events as the JSONL that `replay --events`
reads, through the real command against real Redis servers."""

from __future__ import annotations

import json

from costexporter.core.diagnostics import Diagnostics
from costexporter.core.tracefiles import read_events_jsonl
from costexporter.sources.synth import scenario_mini, write_samples_jsonl
from costexporter.store import keys
from costexporter.store.reader import EventReader
from costexporter.trainer.reporter import StepReporter
from costexporter.trainer.transport import send_entries

from .conftest import SHARED_URL
from .redis_server import free_port


def _lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _events(path) -> list[tuple]:
    evs = read_events_jsonl(path, Diagnostics(stream=None))
    return [
        (e.type, e.job, round(e.ts, 6), e.rank, {k: v for k, v in e.fields.items() if v is not None})
        for e in evs
    ]


def test_export_of_a_live_stream_replays_to_the_same_report_as_the_original_file(
    cli, shared, prefix, tmp_path
):
    b = scenario_mini()
    original = b.write_events(tmp_path / "original.jsonl")
    samples = write_samples_jsonl(b.samples(), tmp_path / "samples.jsonl")
    entries = [{k: str(v) for k, v in d.items()} for d in _lines(original)]
    send_entries(shared, prefix, "sim-mini", entries)
    key = keys.stream_key(prefix, "sim-mini")
    shared.xadd(key, entries[5])  # a resent batch: a duplicate the reader drops
    shared.xadd(key, {**entries[6], "seq": "999999", "step": "eleven"})  # malformed: rejected
    out = tmp_path / "exported.jsonl"
    r = cli("events", "export", "--job", "sim-mini", "--prefix", prefix, "--redis-url", SHARED_URL, "-o", out)
    assert r.returncode == 0, r.stderr
    assert f"exported {len(entries)} events of sim-mini" in r.stderr
    assert "duplicate=1" in r.stderr and "rejected:bad_type=1" in r.stderr
    reports = []
    for ev in (original, out):
        rep = cli("replay", "--samples", samples, "--events", ev, "--format", "json")
        assert rep.returncode == 0, rep.stderr
        reports.append(json.loads(rep.stdout))
    assert reports[1]["jobs"] == reports[0]["jobs"] and reports[1]["unassigned"] == reports[0]["unassigned"]
    assert reports[0]["jobs"]["sim-mini"]["valid_steps"] > 0 and reports[0]["jobs"]["sim-mini"]["incidents"]
    # to stdout as well, line for line the same
    r2 = cli("events", "export", "--job", "sim-mini", "--prefix", prefix, "--redis-url", SHARED_URL)
    assert r2.stdout == out.read_text()


def test_export_of_what_a_reporter_posted(cli, shared, prefix, tmp_path):
    rep = StepReporter("posted", SHARED_URL, prefix=prefix, rank=0, spool_dir=tmp_path, heartbeat_s=3600)
    rep.meta(team="llm", budget=100)
    for s in range(1, 4):
        rep.step(s, tokens=8)
    rep.close()
    out = tmp_path / "posted.jsonl"
    r = cli("events", "export", "--job", "posted", "--prefix", prefix, "--redis-url", SHARED_URL, "-o", out)
    assert r.returncode == 0, r.stderr
    got = _lines(out)
    assert [d["type"] for d in got] == ["register", "run", "meta", "step", "step", "step", "run"]
    assert all(d["session"] == rep.session for d in got)
    assert _events(out)[3][4] == {"step": 1, "tokens": 8}
    assert _events(out)[2][4] == {"team": "llm", "budget": 100.0}


def test_import_then_export_round_trips_and_importing_twice_adds_nothing(cli, shared, prefix, tmp_path):
    b = scenario_mini()
    original = b.write_events(tmp_path / "original.jsonl")
    # Hand-written lines without session/seq, as `replay --events` allows.
    with original.open("a") as f:
        f.write(
            json.dumps({"type": "step", "job": "sim-mini", "ts": 1753580000.5, "rank": 1, "step": 7}) + "\n"
        )
    for _ in range(2):
        r = cli("events", "import", original, "--prefix", prefix, "--redis-url", SHARED_URL)
        assert r.returncode == 0, r.stderr
        assert f"imported {len(_lines(original))} events into sim-mini" in r.stderr
    out = tmp_path / "back.jsonl"
    r = cli("events", "export", "--job", "sim-mini", "--prefix", prefix, "--redis-url", SHARED_URL, "-o", out)
    assert r.returncode == 0, r.stderr
    assert "duplicate=" in r.stderr  # the second import was all duplicates
    assert sorted(_events(out)) == sorted(_events(original))
    # The import wrote the side keys the agents and the watcher read.
    assert sorted(shared.hkeys(keys.ranks_key(prefix, "sim-mini"))) == ["0", "1", "2", "3"]
    assert shared.hget(keys.meta_key(prefix, "sim-mini"), "gpu_model") == "NVIDIA B300"
    # --job posts into another job.
    r = cli(
        "events", "import", original, "--job", "copy-of-mini", "--prefix", prefix, "--redis-url", SHARED_URL
    )
    assert r.returncode == 0, r.stderr
    copied = EventReader(shared, "copy-of-mini", prefix=prefix).read_all()
    assert len(copied) == len(_lines(original)) and {e.job for e in copied} == {"copy-of-mini"}


def test_bad_lines_on_import_are_counted_reported_and_not_fatal(cli, shared, prefix, tmp_path):
    good = {
        "v": "1",
        "type": "step",
        "job": "imp",
        "ts": 1753570000.0,
        "rank": 0,
        "session": "s",
        "seq": 0,
        "step": 1,
    }
    path = tmp_path / "mixed.jsonl"
    path.write_text(
        "\n".join(
            [
                json.dumps(good),
                "this is not json",
                json.dumps({**good, "seq": 1, "step": "eleven"}),
                json.dumps({**good, "seq": 2, "ts": None}),
                json.dumps({**good, "seq": 3, "job": "bad{job}"}),
                json.dumps([1, 2]),
                json.dumps({**good, "seq": 4, "step": 2}),
            ]
        )
        + "\n"
    )
    r = cli("events", "import", path, "--prefix", prefix, "--redis-url", SHARED_URL)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert "imported 2 events into imp (2)" in r.stderr
    assert f"{path}:2: malformed_event" in r.stderr and f"{path}:3: bad_type" in r.stderr
    assert "5 line(s) skipped" in r.stderr and "bad_job=1" in r.stderr
    assert [int(e.get("step")) for e in EventReader(shared, "imp", prefix=prefix).read_all()] == [1, 2]


def test_unusable_input_exits_2_with_one_line(cli, prefix, tmp_path):
    down = f"redis://u:secretpw@127.0.0.1:{free_port()}/0"
    r = cli("events", "export", "--job", "j", "--redis-url", down)
    assert r.returncode == 2 and "cannot reach Redis at redis://127.0.0.1:" in r.stderr
    assert "secretpw" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = cli("events", "export", "--job", "j", "--redis-url", "nonsense")  # not a URL at all
    assert r.returncode == 2 and "internal error" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = cli("events", "export", "--job", "nobody", "--prefix", prefix, "--redis-url", SHARED_URL)
    assert r.returncode == 2 and "no events for job 'nobody'" in r.stderr
    r = cli("events", "export", "--job", "bad{job}", "--redis-url", SHARED_URL)
    assert r.returncode == 2 and "hash tag" in r.stderr
    empty = tmp_path / "empty.jsonl"
    empty.write_text("junk\n")
    r = cli("events", "import", empty, "--prefix", prefix, "--redis-url", SHARED_URL)
    assert r.returncode == 2 and "no usable events" in r.stderr
    r = cli("events", "import", tmp_path / "missing.jsonl", "--redis-url", SHARED_URL)
    assert r.returncode == 2 and "no such file" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_since_keeps_registrations_and_meta(cli, shared, prefix, tmp_path):
    b = scenario_mini()
    original = b.write_events(tmp_path / "original.jsonl")
    lines = _lines(original)
    send_entries(shared, prefix, "sim-mini", [{k: str(v) for k, v in d.items()} for d in lines])
    cut = sorted(d["ts"] for d in lines)[len(lines) // 2]
    r = cli(
        "events",
        "export",
        "--job",
        "sim-mini",
        "--prefix",
        prefix,
        "--redis-url",
        SHARED_URL,
        "--since",
        str(cut),
    )
    assert r.returncode == 0, r.stderr
    got = [json.loads(x) for x in r.stdout.splitlines()]
    assert {d["type"] for d in got if float(d["ts"]) < cut} == {"register", "meta"}
    assert sum(d["type"] == "register" for d in got) == 4
    assert len([d for d in got if float(d["ts"]) >= cut]) == len([d for d in lines if d["ts"] >= cut])
