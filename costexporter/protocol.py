"""Redis keys and entry encoding of event protocol v1 (DESIGN section 5; docs/protocol.md).

Every key of a job carries the job as a hash tag, `<prefix>:{<job>}:...`, so all of a job's keys
live in one Redis Cluster slot and can be written in one transaction.
"""

from __future__ import annotations

import json
import re

DEFAULT_PREFIX = "costexporter"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
JOB_RE = re.compile(r"^[A-Za-z0-9._:/@+=-]{1,200}$")


def connect(url: str):
    """A client for the agent and the watcher: short timeouts and no retries, so an outage shows
    at once as an error the caller counts, instead of a round that hangs."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis.from_url(
        url,
        socket_timeout=2.0,
        socket_connect_timeout=1.0,
        retry=Retry(NoBackoff(), 0),
        decode_responses=True,
    )


def check_job(job: str) -> str:
    """A job name usable inside a hash tag: no braces, no whitespace, at most 200 characters."""
    if not isinstance(job, str) or not JOB_RE.match(job):
        raise ValueError(
            f"job name {job!r} must be 1-200 characters of letters, digits and ._:/@+=- "
            "(no braces or spaces: it is a Redis Cluster hash tag)"
        )
    return job


def job_key(prefix: str, job: str, suffix: str) -> str:
    return f"{prefix}:{{{job}}}:{suffix}"


def stream_key(prefix: str, job: str) -> str:
    return job_key(prefix, job, "events")


def ranks_key(prefix: str, job: str) -> str:
    return job_key(prefix, job, "ranks")


def meta_key(prefix: str, job: str) -> str:
    return job_key(prefix, job, "meta")


def jobs_key(prefix: str) -> str:
    return f"{prefix}:jobs"


def encode_fields(fields: dict[str, object]) -> dict[str, str]:
    """Flat string field/value pairs for XADD: numbers as text, booleans as 'true'/'false',
    nested values (preflight checks) as JSON; None values are left out."""
    out: dict[str, str] = {}
    for k, v in fields.items():
        if v is None:
            continue
        if isinstance(v, bool):
            out[k] = "true" if v else "false"
        elif isinstance(v, float):
            out[k] = repr(v)
        elif isinstance(v, (int, str)):
            out[k] = str(v)
        else:
            out[k] = json.dumps(v, separators=(",", ":"), sort_keys=True)
    return out
