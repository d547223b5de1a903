"""Event protocol v1 (docs/protocol.md): validation of one flat entry into an `Event`.

The same function validates a JSONL line of `replay --events` and a Redis stream entry (whose
values are all strings), so both paths accept and reject the same things.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Literal, SupportsFloat, SupportsIndex, overload

from costexporter.core.model import Event

PROTOCOL_VERSION = "1"
# A job's own watcher thresholds, in seconds (or a factor: stall_k), carried in its meta.
META_THRESHOLDS = (
    "heartbeat_timeout_s",
    "heartbeat_interval_s",
    "stall_floor_s",
    "stall_k",
    "checkpoint_allowance_s",
    "eval_allowance_s",
    "startup_allowance_s",
    "phase_allowance_s",
)
EVENT_TYPES = frozenset({"register", "step", "phase", "run", "heartbeat", "meta", "preflight"})
# Text fields of a meta event; the Kubernetes ones come from `costexporter.k8s` (namespace for the
# API's aggregation, progress=none for a job without steps, booked by band).
META_TEXT = ("gpu_model", "team", "cost_center", "namespace", "pod", "container", "source", "progress")
# Number fields of a meta event: finite and >= 0.
META_NUMBERS = ("price_per_gpu_hour", "budget", *META_THRESHOLDS)
BASE_FIELDS = frozenset({"v", "type", "job", "ts", "rank", "session", "seq"})
_META_TEXT_SET = frozenset(META_TEXT)
# Per event type, the fields parse_event reads (every type but meta reads the same ones each
# time): learned from the first event of the type, so one set difference finds unknown fields.
_KNOWN_FIELDS: dict[str, frozenset[str]] = {}

# Timestamps outside [2000-01-01, now + 1 day] are absurd: a clock gone wrong, not an event.
MIN_TS = 946_684_800.0
FUTURE_SLACK_S = 86_400.0
MAX_STEP = 10**12
MAX_TOKENS = 10**15
# Bounds on a register's numbers; the reporter refuses at its constructor what these refuse here.
MAX_RANK = 1 << 20
MAX_WORLD_SIZE = 1 << 20
MAX_GPU_INDEX = 1 << 16  # also bounds local_rank (a rank's GPU on its host)


class EventError(ValueError):
    """An entry that is not a valid v1 event; `reason` is a short stable label for counting."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class UnknownEventType(EventError):
    """A well-formed entry of a type this version does not know: ignored and counted."""


# An entry as it arrives: a JSON object's fields or a Redis stream entry's (all strings).
Entry = Mapping[str, object]


def _present(entry: Entry, key: str, required: bool) -> object:
    """The field's value, or None when it is absent and optional ('' counts as absent)."""
    v = entry.get(key)
    if (v is None or v == "") and required:
        raise EventError("missing_field", f"{key!r} is required")
    return None if v == "" else v


# The field readers give None only for an optional field that is absent (the overloads say so).
@overload
def _int(
    entry: Entry, key: str, *, lo: int = 0, hi: int = MAX_STEP, required: Literal[True] = True
) -> int: ...
@overload
def _int(entry: Entry, key: str, *, lo: int = 0, hi: int = MAX_STEP, required: bool) -> int | None: ...
def _int(entry: Entry, key: str, *, lo: int = 0, hi: int = MAX_STEP, required: bool = True) -> int | None:
    v = entry.get(key)
    if type(v) is not str or not v:  # a stream entry's text skips these checks (a fast path)
        v = _present(entry, key, required)
        if v is None:
            return None
        if isinstance(v, bool):
            raise EventError("bad_type", f"{key!r} must be an integer, got {v!r}")
    try:
        if type(v) is str:
            n = int(v)  # takes what int(str(v).strip()) would
        elif isinstance(v, float):
            if not v.is_integer():
                raise ValueError
            n = int(v)
        else:
            n = int(str(v).strip())
    except (TypeError, ValueError):
        raise EventError("bad_type", f"{key!r} must be an integer, got {v!r}") from None
    if not lo <= n <= hi:
        raise EventError("out_of_range", f"{key!r}={n} outside [{lo}, {hi}]")
    return n


@overload
def _float(entry: Entry, key: str, *, required: Literal[True] = True) -> float: ...
@overload
def _float(entry: Entry, key: str, *, required: bool) -> float | None: ...
def _float(entry: Entry, key: str, *, required: bool = True) -> float | None:
    v = entry.get(key)
    if type(v) is not str or not v:
        v = _present(entry, key, required)
    if v is None:
        return None
    if isinstance(v, bool):
        raise EventError("bad_type", f"{key!r} must be a number, got {v!r}")
    try:
        # What float() takes (the common types first: isinstance stops at the first match).
        if not isinstance(v, (str, float, int, bytes, bytearray, SupportsFloat, SupportsIndex)):
            raise TypeError
        x = float(v)
    except (TypeError, ValueError):
        raise EventError("bad_type", f"{key!r} must be a number, got {v!r}") from None
    if not math.isfinite(x):
        raise EventError("bad_type", f"{key!r} must be finite, got {v!r}")
    return x


@overload
def _str(
    entry: Entry, key: str, *, required: Literal[True] = True, choices: frozenset[str] | None = None
) -> str: ...
@overload
def _str(entry: Entry, key: str, *, required: bool, choices: frozenset[str] | None = None) -> str | None: ...
def _str(
    entry: Entry, key: str, *, required: bool = True, choices: frozenset[str] | None = None
) -> str | None:
    v = entry.get(key)
    if type(v) is not str or not v:
        v = _present(entry, key, required)
    if v is None:
        return None
    if not isinstance(v, str):
        raise EventError("bad_type", f"{key!r} must be a string, got {v!r}")
    if choices is not None and v not in choices:
        raise EventError("bad_value", f"{key!r}={v!r}, expected one of {sorted(choices)}")
    return v


# (type, job, ts, rank, session, seq): what every event has, read before its payload
_Base = tuple[str, str, float, int, str, int]


def _text_base(entry: Mapping[str, object], job: str | None, limit: float) -> _Base | None:
    """The base fields of an entry whose values are plain, non-empty text, all valid (a stream
    entry, nearly always), in one pass: what `_checked_base` gives them, without its calls per
    field (they count at 10,000 events a poll). None for anything else: `_checked_base` then
    judges the entry, and words its error."""
    get = entry.get
    etype, ev_job, session = get("type"), get("job"), get("session")
    ts, rank, seq = get("ts"), get("rank"), get("seq")
    if not (
        type(etype) is str
        and type(ev_job) is str
        and type(session) is str
        and type(ts) is str
        and type(rank) is str
        and type(seq) is str
    ):
        return None
    if not (etype and ev_job and session) or etype not in EVENT_TYPES or (job is not None and ev_job != job):
        return None
    try:
        t, r, n = float(ts), int(rank), int(seq)  # what _float and _int take of text
    except ValueError:
        return None
    if not (MIN_TS <= t <= limit and 0 <= r <= MAX_RANK and 0 <= n <= 1 << 62):
        return None  # NaN fails the first comparison, infinities the bounds
    return etype, ev_job, t, r, session, n


def _checked_base(entry: Mapping[str, object], job: str | None, limit: float, strict_ids: bool) -> _Base:
    """(type, job, ts, rank, session, seq) of any entry, checked field by field in order (the
    first fault is the one reported)."""
    etype = _str(entry, "type")
    ev_job = _str(entry, "job")
    if job is not None and ev_job != job:
        raise EventError("foreign_job", f"event of job {ev_job!r} in the stream of {job!r}")
    ts = _float(entry, "ts")
    if not MIN_TS <= ts <= limit:
        raise EventError("bad_timestamp", f"ts={ts} is not a plausible Unix time")
    rank = _int(entry, "rank", hi=MAX_RANK)
    session = _str(entry, "session", required=strict_ids) or ""
    seq = _int(entry, "seq", hi=1 << 62, required=strict_ids)
    if etype not in EVENT_TYPES:
        raise UnknownEventType("unknown_type", f"event type {etype!r} is not known to v1")
    return etype, ev_job, ts, rank, session, -1 if seq is None else seq


def parse_event(
    entry: Entry, *, job: str | None = None, now: float | None = None, strict_ids: bool = False
) -> Event:
    """Validate one entry. `job`: the stream's job (a foreign job is rejected).

    `strict_ids`: require `v`, `session` and `seq` (stream entries); files may omit them.
    """
    if not isinstance(entry, dict):
        raise EventError("not_an_object", "an event is a flat object of fields")
    v = entry.get("v")
    if v is None and strict_ids:
        raise EventError("missing_field", "'v' is required")
    if v is not None and str(v) != PROTOCOL_VERSION:
        raise EventError("bad_version", f"protocol version {v!r} is not supported (want '1')")
    limit = (time.time() if now is None else now) + FUTURE_SLACK_S
    base = _text_base(entry, job, limit) or _checked_base(entry, job, limit, strict_ids)
    etype, ev_job, ts, rank, session, seq = base

    f: dict[str, object] = {}
    if etype == "register":
        f["host"] = _str(entry, "host")
        f["gpu_uuid"] = _str(entry, "gpu_uuid", required=False)
        f["gpu"] = _int(entry, "gpu", hi=MAX_GPU_INDEX, required=False)
        if f["gpu_uuid"] is None and f["gpu"] is None:
            raise EventError("missing_field", "register needs 'gpu_uuid' or 'gpu'")
        f["local_rank"] = _int(entry, "local_rank", hi=MAX_GPU_INDEX, required=False)
        f["world_size"] = _int(entry, "world_size", lo=1, hi=MAX_WORLD_SIZE, required=False)
        f["pid"] = _int(entry, "pid", hi=1 << 40, required=False)
    elif etype == "step":
        f["step"] = _int(entry, "step")
        f["tokens"] = _int(entry, "tokens", hi=MAX_TOKENS, required=False)
    elif etype == "phase":
        f["name"] = _str(entry, "name")
        f["state"] = _str(entry, "state", choices=frozenset({"begin", "end"}))
        f["step"] = _int(entry, "step", required=False)
    elif etype == "run":
        f["state"] = _str(entry, "state", choices=frozenset({"start", "resume", "end"}))
        f["step"] = _int(entry, "step", required=False)
    elif etype == "meta":
        for key in META_TEXT:
            val = entry.get(key)
            if val is not None and val != "":  # '' is absent, as for every optional field
                f[key] = _str(entry, key)
        for key in META_NUMBERS:
            x = _float(entry, key, required=False)
            if x is not None:
                if x < 0:
                    raise EventError("out_of_range", f"{key!r} must be >= 0")
                f[key] = x
    elif etype == "preflight":
        passed = entry.get("passed")
        if isinstance(passed, str):
            passed = passed.strip().lower() in ("1", "true", "yes")
        if not isinstance(passed, bool):
            raise EventError("missing_field", "preflight needs 'passed' (bool)")
        f["passed"] = passed
        f["checks"] = entry.get("checks")
    known = _KNOWN_FIELDS.get(etype)
    if known is None:
        known = BASE_FIELDS | f.keys() | _META_TEXT_SET
        if etype != "meta":  # a meta reads only the numbers it is given: its set varies
            _KNOWN_FIELDS[etype] = known
    extra = entry.keys() - known
    if extra:
        f["_unknown_fields"] = sorted(extra)
    return Event(etype, ev_job, ts, rank, session, seq, f)
