"""`costexporter claims close`: an operator ends a job's run by hand.

A job's claim on its GPUs ends with its run: a clean `run end`, or its rank 0 silent past the
liveness timeout. Where neither comes soon enough (a job known dead whose liveness timeout is
long, a run an operator stops billing), the operator posts the run's end for it: a `run end` of
rank 0 in the job's events stream, marked `by=operator` with the reason, from a session of its
own. The agents and `replay` book it as any end (the GPUs are outside the job from then on, until
a later `run start`), the agents keep it with the job's run events when they trim the stream,
`events export` carries it, and a note in the job's figures says who closed it, when and why
(the API lists it among the job's warnings).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

from costexporter.store import keys, ledger, protocol
from costexporter.store.client import RedisClient
from costexporter.trainer.transport import send_entries


@dataclass(frozen=True)
class Closed:
    job: str
    at: float  # Unix seconds
    entry: dict[str, str]


def close_run(client: RedisClient, prefix: str, job: str, at: float | None, reason: str, who: str) -> Closed:
    """Post the job's run end at `at` (default now) for the operator `who`; ValueError when the
    job is unknown (no registration, no jobs-index entry) or the name is not a job's."""
    protocol.check_job(job)
    if not client.exists(keys.ranks_key(prefix, job)) and client.zscore(keys.jobs_key(prefix), job) is None:
        raise ValueError(f"no job {job!r} under prefix {prefix!r}")
    ts = time.time() if at is None else at
    entry = protocol.encode_fields(
        {
            "v": "1",
            "type": "run",
            "job": job,
            "ts": f"{ts:.6f}",
            "rank": 0,
            "session": f"operator-{secrets.token_hex(6)}",
            "seq": 0,
            "state": "end",
            "by": "operator",
            "operator": who,
            "reason": reason,
        }
    )
    send_entries(client, prefix, job, [entry])
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))
    ledger.note(
        client,
        prefix,
        job,
        "closed",
        entry["session"],
        f"its run was closed by hand at {when} by {who}: {reason}",
    )
    return Closed(job, ts, entry)
