"""A job's registrations, run events and meta survive the agents' trimming of its stream: they
move to the job's kept stream, and `events export` merges them back, so the export of a live
job always replays. Real Redis, the real agent and the real command."""

from __future__ import annotations

import json

from costexporter.core.diagnostics import Diagnostics
from costexporter.core.tracefiles import read_events_jsonl
from costexporter.services.agent import Agent
from costexporter.sources.synth import write_samples_jsonl
from costexporter.store import keys, ledger
from costexporter.tools.eventfile import export_lines

from .conftest import SHARED_URL
from .test_incremental_agent import run_agent, trace


def _entry(i: int, type_: str, **f) -> dict[str, str]:
    return {
        "v": "1",
        "type": type_,
        "job": "j",
        "ts": str(1_753_570_000 + i),
        "rank": "0",
        "session": "s",
        "seq": str(i),
        **f,
    }


def test_trimming_moves_the_kept_types_once_and_pages_through_a_long_stream(shared, prefix, monkeypatch):
    monkeypatch.setattr(ledger, "TRIM_PAGE", 4)  # several script calls for one trim
    stream, kept = keys.stream_key(prefix, "j"), keys.kept_key(prefix, "j")
    types = [
        "register",
        "run",
        "step",
        "step",
        "meta",
        "step",
        "heartbeat",
        "step",
        "run",
        "preflight",
        "step",
        "step",
    ]
    ids = [shared.xadd(stream, _entry(i, t), id=f"{1000 + i}-0") for i, t in enumerate(types)]
    shared.xadd(
        stream, {"type": "meta", **{f"f{i}": "x" for i in range(200)}}, id="1012-0"
    )  # too wide to copy
    shared.xadd(stream, {"no": "type"}, id="1013-0")
    ids.append(shared.xadd(stream, _entry(14, "step"), id="1014-0"))
    assert ledger.trim_keeping(shared, prefix, "j", "1014-0") == 14
    assert [e[0] for e in shared.xrange(stream)] == ["1014-0"]
    moved = shared.xrange(kept)
    assert [f["type"] for _, f in moved] == ["register", "run", "meta", "run", "preflight"]
    assert [i for i, _ in moved] == [ids[k] for k in (0, 1, 4, 8, 9)]  # under their own ids
    assert moved[0][1] == _entry(0, "register")  # field for field
    # a second agent trimming at the same point (or an older one) adds nothing
    assert ledger.trim_keeping(shared, prefix, "j", "1014-0") == 0
    assert ledger.trim_keeping(shared, prefix, "j", "1005-0") == 0
    assert shared.xlen(kept) == 5


def test_the_export_of_a_trimmed_live_job_has_its_registrations_runs_and_meta_and_replays(
    shared, prefix, cli, tmp_path
):
    b = trace()
    b.meta(team="llm", price_per_gpu_hour=2.0)  # posted after the run: kept too
    late = next(e for e in b.events if e.type == "phase" and e.rank == 1 and e.get("state") == "begin")
    agent = run_agent(Agent, prefix, b, late, fold_persist_s=0, late_keep_s=60)
    assert agent.folds.stats["stream_entries_trimmed"] > 0
    stream = keys.stream_key(prefix, b.job)
    left = {f["type"] for _, f in shared.xrange(stream)}
    assert "register" not in left  # trimmed from the stream ...
    lines, stats = export_lines(shared, b.job, prefix)
    out = tmp_path / "export.jsonl"
    out.write_text("".join(lines))
    evs = read_events_jsonl(out, Diagnostics(stream=None))
    got = [(e.type, e.rank, e.get("state")) for e in evs]
    # ... yet exported: every register, both run events of rank 0 before the resume, the meta
    want = [
        (e.type, e.rank, e.get("state"))
        for e in sorted(b.events, key=lambda e: e.ts)
        if e.type in ("register", "run", "meta")
    ]
    assert [g for g in got if g[0] in ("register", "run", "meta")] == want
    assert stats["duplicate"] == 0 and not [k for k in stats if k.startswith("rejected")]
    samples = write_samples_jsonl(b.samples(), tmp_path / "samples.jsonl")
    rep = cli("replay", "--samples", samples, "--events", out, "--format", "json")
    assert rep.returncode == 0, rep.stderr
    job = json.loads(rep.stdout)["jobs"][b.job]
    assert job["gpus"] and job["valid_steps"] > 0
    # through the command as well
    r = cli("events", "export", "--job", b.job, "--prefix", prefix, "--redis-url", SHARED_URL)
    assert r.returncode == 0, r.stderr
    assert r.stdout == out.read_text()
