"""A job's events between Redis and a JSONL file (`costexporter events export` / `import`).

The file is exactly what `replay --events` reads: one flat protocol-v1 entry per line. Export
reads the stream through `EventReader`, so what it writes is validated and de-duplicated; import
reads the file through the same parser as replay, so a file that replays also imports, and bad
lines are counted and skipped the same way.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from costexporter.core.diagnostics import Diagnostics, InputError
from costexporter.core.model import Event
from costexporter.store import keys, protocol, redisconn
from costexporter.store.client import RedisClient
from costexporter.store.reader import EventReader


def _text(x: object) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def _id(x: str) -> tuple[int, int]:
    a, _, b = x.partition("-")
    return int(a), int(b or 0)


# Kept by `--since` whatever their time: a replay needs the GPU map and the price.
STATE_TYPES = frozenset({"register", "meta"})
BATCH = 2000


def entry_of(ev: Event) -> dict[str, str]:
    """The flat protocol entry of a validated event (the inverse of `events.parse_event`)."""
    base: dict[str, object] = {
        "v": "1",
        "type": ev.type,
        "job": ev.job,
        "ts": f"{ev.ts:.6f}",
        "rank": ev.rank,
    }
    if ev.session:
        base["session"] = ev.session
    if ev.seq >= 0:
        base["seq"] = ev.seq
    fields = {k: v for k, v in ev.fields.items() if not k.startswith("_")}
    return protocol.encode_fields({**base, **fields})


def export_lines(
    client: RedisClient, job: str, prefix: str, since: float | None = None
) -> tuple[Iterator[str], Counter[str]]:
    """JSONL lines of the job's events in stream order, and the reader's counts (filled as the
    lines are consumed). The entries the agents moved out of the stream when they trimmed it
    (registrations, run events, meta) are merged back in by id. `since`: drop events before it,
    except registrations and meta."""
    reader = EventReader(client, job, prefix=prefix)
    kept = client.xrange(keys.kept_key(prefix, job))  # small: a job's registrations, runs and meta

    def lines() -> Iterator[str]:
        nonlocal kept
        cursor = "0-0"
        while True:
            resp = redisconn.xread_flat(client, {reader.key: cursor}, 10_000)
            entries = [e for _key, got in resp for e in got]
            if entries:
                cursor = _text(entries[-1][0])
                top = _id(cursor)
                older = [e for e in kept if _id(_text(e[0])) <= top]
                kept = kept[len(older) :]
            else:
                older, kept = kept, []
            merged = sorted(older + entries, key=lambda e: _id(_text(e[0])))
            for ev in reader.consume(merged):
                if since is None or ev.ts >= since or ev.type in STATE_TYPES:
                    yield json.dumps(entry_of(ev), separators=(",", ":")) + "\n"
            if not entries:
                return

    return lines(), reader.stats


@dataclass
class ImportResult:
    sent: int = 0
    refused: Counter[str] = field(default_factory=Counter)  # by the server, by reason
    jobs: Counter[str] = field(default_factory=Counter)  # events sent per job


def import_file(
    client: RedisClient, path: Path, prefix: str, diag: Diagnostics, job: str | None = None
) -> ImportResult:
    """Post a JSONL file's events to Redis (bad lines are counted in `diag` and skipped).

    Entries without `session`/`seq` (hand-written files) get a session derived from the file's
    content and their line order, so importing the same file twice posts nothing new."""
    from costexporter.core.tracefiles import read_events_jsonl
    from costexporter.trainer.transport import send_entries

    if job is not None:
        protocol.check_job(job)
    events = read_events_jsonl(path, diag)
    session = "import-" + hashlib.sha256(path.read_bytes()).hexdigest()[:12]
    by_job: dict[str, list[dict[str, str]]] = {}
    for n, ev in enumerate(events):
        e = entry_of(ev)
        e.setdefault("session", session)
        e.setdefault("seq", str(n))
        target = job or ev.job
        if not protocol.JOB_RE.match(target):
            diag.warn(str(path), None, "bad_job", f"job name {target!r} cannot be a Redis key's hash tag")
            continue
        e["job"] = target
        by_job.setdefault(target, []).append(e)
    if not by_job:
        raise InputError(f"{path}: no events with a usable job name")
    out = ImportResult()
    for name, entries in by_job.items():
        for i in range(0, len(entries), BATCH):
            res = send_entries(client, prefix, name, entries[i : i + BATCH], raise_on_error=False)
            for exc in res.failed.values():
                out.refused[str(exc)] += 1
            sent = len(entries[i : i + BATCH]) - len(res.failed)
            out.sent += sent
            out.jobs[name] += sent
    return out
