"""Entry encoding of event protocol v1 (docs/protocol.md) and the trainer's side of Redis.

The keys are built in `keys.py` (one named builder per key; every caller imports them from there).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from costexporter.core.events import STEPS_TYPE, pack_steps
from costexporter.core.timeutil import to_ms
from costexporter.store import untrusted
from costexporter.store.client import RedisClient

DEFAULT_PREFIX = "costexporter"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
JOB_RE = re.compile(r"^[A-Za-z0-9._:/@+=-]{1,200}$")


def connect(url: str) -> RedisClient:
    """A client for the agent and the watcher: short timeouts and no retries, so an outage shows
    at once as an error the caller counts, instead of a round that hangs. A Redis Cluster URL
    (`redis+cluster://host:port`) gives a cluster client (redisconn)."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from costexporter.store import redisconn

    return redisconn.from_url(
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
            f"job name {untrusted.short(job)!r} must be 1-200 characters of letters, digits and ._:/@+=- "
            "(no braces or spaces: it is a Redis Cluster hash tag)"
        )
    return job


def job_segment(name: str) -> str:
    """`name` made a job name that is also one URL path segment: characters outside letters,
    digits and ._:@+=- become '-', at most 200 (the Kubernetes path's and replay's job maps'
    names); ValueError where nothing usable is left."""
    return check_job(re.sub(r"[^A-Za-z0-9._:@+=-]", "-", name)[:200])


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


def ts_text(us: int) -> str:
    """Unix seconds to the microsecond, from microseconds (a time reads the same whether it goes
    out in a single entry or in a batched `steps` entry)."""
    return f"{us // 1_000_000}.{us % 1_000_000:06d}"


def steps_entry(
    job: str, rank: int, session: str, seq: int, steps: np.ndarray, micros: np.ndarray, tokens: np.ndarray
) -> dict[str, str]:
    """A batched `steps` entry (format 1): steps `steps` at Unix microseconds `micros`, with
    `tokens` (-1: none), numbered seq, seq + 1, ... (int64 arrays of one length, 1..MAX_BATCH_STEPS)."""
    first = int(micros[0])
    return {
        "v": "1",
        "type": STEPS_TYPE,
        "job": job,
        "ts": ts_text(first),
        "rank": str(rank),
        "session": session,
        "seq": str(seq),
        "fmt": "1",
        "n": str(len(steps)),
        "b": pack_steps(steps, micros, tokens, first),
    }


# ---- heartbeats (`<prefix>:t:{<job>}:beats`) ----------------------------------------------------
BEATS_PER_RANK = 16  # heartbeats kept per rank: 160 s at the default 10-s cadence
BEATS_MIN = 1_024


def beats_cap(world_size: int) -> int:
    """The `XADD MAXLEN ~` bound of a job's heartbeat stream: a bound in proportion to the job's
    width, so every rank's newest heartbeats stay there for the watcher (one reader a job, each
    poll), and the stream never grows past it (Redis trims whole nodes: a hundred entries more
    at most)."""
    return max(BEATS_MIN, BEATS_PER_RANK * max(int(world_size), 1))


# ---- registrations (`<prefix>:t:{<job>}:ranks`: rank -> JSON of the register event) ------------
MAX_WORLD_SIZE = 65_536  # ranks are 0 .. world_size - 1; a larger number is a corrupt entry
MAX_GPU_INDEX = 1_024
MAX_TS = 4_102_444_800.0  # 2100-01-01: a registration dated later is a corrupt entry


class RegistrationError(ValueError):
    """A ranks entry the agent cannot use; `reason` is the short label it is counted under."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Registration:
    rank: int
    ts_ms: int  # Unix milliseconds (`timeutil.to_ms` of the entry's seconds)
    host: str | None
    gpu: int | None  # index on the host
    gpu_uuid: str | None
    world_size: int | None

    @property
    def ts(self) -> float:
        """Unix seconds, for what people read (the watcher's status)."""
        return self.ts_ms / 1000


def _int_field(entry: dict[str, Any], name: str, hi: int, reason: str) -> int | None:
    v = entry.get(name)
    if v is None or v == "":
        return None
    try:
        if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
            raise ValueError
        n = int(v)
    except (TypeError, ValueError):
        raise RegistrationError(f"bad_{name}", f"{name} {v!r} is not an integer") from None
    if not 0 <= n < hi:
        raise RegistrationError(reason, f"{name} {n} is outside 0..{hi - 1}")
    return n


def parse_registration(rank_s: str, raw: str) -> Registration:
    """Validate one ranks entry, as the events are validated: a clear reason, never an exception
    other than RegistrationError, and bounded numbers (a rank of 99999999999 would size arrays)."""
    try:
        rank = int(rank_s)
    except (TypeError, ValueError):
        raise RegistrationError("bad_rank", f"rank {rank_s!r} is not an integer") from None
    if not 0 <= rank < MAX_WORLD_SIZE:
        raise RegistrationError("rank_out_of_range", f"rank {rank} is outside 0..{MAX_WORLD_SIZE - 1}")
    try:
        entry = untrusted.loads(raw)
    except untrusted.UntrustedValue as e:
        raise RegistrationError(e.reason, f"the entry is refused: {e}") from None
    if not isinstance(entry, dict):
        raise RegistrationError("not_an_object", f"the entry is a JSON {type(entry).__name__}, not an object")
    ts = entry.get("ts")
    if isinstance(ts, str):
        with contextlib.suppress(ValueError):
            ts = float(ts)
    if (
        isinstance(ts, bool)
        or not isinstance(ts, (int, float))
        or not math.isfinite(ts)
        or not 0 < ts < MAX_TS
    ):
        raise RegistrationError("bad_ts", f"ts {untrusted.short(entry.get('ts'))} is not a Unix time")
    world = _int_field(entry, "world_size", MAX_WORLD_SIZE + 1, "world_size_out_of_range")
    if world is not None and rank >= world:
        raise RegistrationError("rank_out_of_range", f"rank {rank} is not below world_size {world}")
    gpu = _int_field(entry, "gpu", MAX_GPU_INDEX, "gpu_out_of_range")
    uuid = entry.get("gpu_uuid")
    host = entry.get("host")
    if host is not None and not (isinstance(host, str) and 0 < len(host) <= 255):
        raise RegistrationError("bad_host", f"host {untrusted.short(host)} is not a host name")
    if uuid not in (None, "") and not (isinstance(uuid, str) and len(uuid) <= 255):
        raise RegistrationError("bad_gpu_uuid", f"gpu_uuid {untrusted.short(uuid)} is not a GPU UUID")
    return Registration(rank, to_ms(float(ts)), host, gpu, uuid or None, world)


# ---- the live hash (`<prefix>:a:{job}:live:<host>`): rank -> its newest sample, as its agent saw it


class LiveEntryError(ValueError):
    """A live hash entry that cannot be used (not JSON, a field missing or not a number)."""


@dataclass(frozen=True, slots=True)
class LiveEntry:
    """One rank's newest sample and the band its agent gave it. The agent writes it every
    round; the watcher reads it to see a hang within a round (`band`: None from an agent that
    does not band)."""

    ts_ms: int
    power_w: float
    util_pct: float
    band: str | None = None
    gpu: int | None = None
    uuid: str | None = None


def encode_live(e: LiveEntry) -> str:
    return json.dumps(
        {
            "ts": e.ts_ms / 1000,
            "power_w": e.power_w,
            "util_pct": e.util_pct,
            "band": e.band,
            "gpu": e.gpu,
            "uuid": e.uuid,
        }
    )


def decode_live(raw: str) -> LiveEntry:
    """One entry, checked: LiveEntryError if its sample is unusable; optional fields of the
    wrong type read as absent (one odd field must not hide the sample)."""
    try:
        d = untrusted.loads(raw)
        if not isinstance(d, dict):
            raise TypeError
        ts_ms, power_w, util_pct = to_ms(float(d["ts"])), float(d["power_w"]), float(d["util_pct"])
    except (ValueError, TypeError, KeyError, OverflowError) as e:
        raise LiveEntryError(f"not a live entry: {type(e).__name__}") from None
    band, gpu, uuid = d.get("band"), d.get("gpu"), d.get("uuid")
    return LiveEntry(
        ts_ms,
        power_w,
        util_pct,
        band if isinstance(band, str) else None,
        gpu if isinstance(gpu, int) and not isinstance(gpu, bool) else None,
        uuid if isinstance(uuid, str) else None,
    )
