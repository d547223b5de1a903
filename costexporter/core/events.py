"""Event protocol v1 (docs/protocol.md): validation of one flat entry into an `Event`.

The same function validates a JSONL line of `replay --events` and a Redis stream entry (whose
values are all strings), so both paths accept and reject the same things.
"""

from __future__ import annotations

import base64
import itertools
import math
import time
import zlib
from collections.abc import Mapping
from typing import Literal, SupportsFloat, SupportsIndex, overload

import numpy as np

from costexporter.core.model import Event
from costexporter.core.timeutil import to_ms

PROTOCOL_VERSION = "1"
# Thresholds a meta event may carry, in seconds (or a factor: stall_k), validated as numbers.
# Those that move GPU time between categories are operator policy (`terms` ignores them in a
# job's meta); the liveness cadence is the job's own.
POLICY_THRESHOLDS = (
    "stall_floor_s",
    "stall_k",
    "checkpoint_allowance_s",
    "eval_allowance_s",
    "startup_allowance_s",
    "phase_allowance_s",
    "liveness_timeout_s",
    "liveness_timeout_max_s",
)
# Text fields of a run event: a crash record's (`exit`: how the process ended, `error`: the
# exception's type) and an operator's close (`by`, `operator`, `reason`: `claims close`).
RUN_TEXT = ("exit", "error", "by", "operator", "reason")
LIVENESS_TERMS = ("heartbeat_timeout_s", "heartbeat_interval_s")
META_THRESHOLDS = (*LIVENESS_TERMS, *POLICY_THRESHOLDS)
EVENT_TYPES = frozenset({"register", "step", "phase", "run", "heartbeat", "meta", "preflight"})
# A batched entry: a run of steps of one session with consecutive seqs (`parse_events` expands it).
STEPS_TYPE = "steps"
STEPS_FORMATS = frozenset({"1"})
MAX_BATCH_STEPS = 10_000  # steps in one `steps` entry
MAX_BATCH_CHARS = 33 * MAX_BATCH_STEPS + 1024  # its packed field's length (base64 of at most 24 bytes a step)
_ENTRY_TYPES = EVENT_TYPES | {STEPS_TYPE}
# Text fields of a meta event; the Kubernetes ones come from `costexporter.k8s` (namespace for the
# API's aggregation, progress=none for a job without steps, booked by band).
META_TEXT = (
    "gpu_model",
    "team",
    "cost_center",
    "namespace",
    "pod",
    "container",
    "source",
    "progress",
    "dtype",
)
# Data numbers a trainer posts for the figures: the steps of the whole run (cost to finish), the
# model's FLOPs per token or parameters (MFU).
META_DATA_NUMBERS = ("total_steps", "model_flops_per_token", "model_params")
# Number fields of a meta event: finite and >= 0.
META_NUMBERS = ("price_per_gpu_hour", "budget", *META_THRESHOLDS, *META_DATA_NUMBERS)
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


def bounded_number(value: object, lo: float, hi: float, *, above: bool = False) -> float | None:
    """An untrusted value (a meta field, a stored figure) as a finite number in [lo, hi) (`above`:
    (lo, hi)), else None: a bool, text that is no number, nan, inf and 1e300 are not numbers here."""
    if isinstance(value, bool):
        return None
    try:
        v = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    if not math.isfinite(v) or v >= hi or v < lo or (above and v == lo):
        return None
    return v


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
    if not (etype and ev_job and session) or etype not in _ENTRY_TYPES or (job is not None and ev_job != job):
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
    if etype not in _ENTRY_TYPES:
        raise UnknownEventType("unknown_type", f"event type {etype!r} is not known to v1")
    return etype, ev_job, ts, rank, session, -1 if seq is None else seq


def _versioned_base(entry: Mapping[str, object], job: str | None, limit: float, strict_ids: bool) -> _Base:
    """The protocol version checked, then the base fields (one entry or a batch of steps);
    `limit`: the latest time accepted (now + FUTURE_SLACK_S)."""
    v = entry.get("v")
    if v is None and strict_ids:
        raise EventError("missing_field", "'v' is required")
    if v is not None and str(v) != PROTOCOL_VERSION:
        raise EventError("bad_version", f"protocol version {v!r} is not supported (want '1')")
    return _text_base(entry, job, limit) or _checked_base(entry, job, limit, strict_ids)


def parse_event(
    entry: Entry, *, job: str | None = None, now: float | None = None, strict_ids: bool = False
) -> Event:
    """Validate one entry. `job`: the stream's job (a foreign job is rejected).

    `strict_ids`: require `v`, `session` and `seq` (stream entries); files may omit them.
    """
    if not isinstance(entry, dict):
        raise EventError("not_an_object", "an event is a flat object of fields")
    limit = (time.time() if now is None else now) + FUTURE_SLACK_S
    etype, ev_job, ts, rank, session, seq = _versioned_base(entry, job, limit, strict_ids)

    f: dict[str, object] = {}
    if etype == STEPS_TYPE:
        raise EventError("bad_steps", "a batched steps entry holds many events: read it with parse_events")
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
        f["state"] = _str(entry, "state", choices=frozenset({"start", "resume", "end", "crash"}))
        f["step"] = _int(entry, "step", required=False)
        for key in RUN_TEXT:  # a crash record's exit and error; a close's by, operator, reason
            f[key] = _str(entry, key, required=False)
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
    return Event(etype, ev_job, to_ms(ts), rank, session, seq, f)


def parse_heartbeat(entry: Entry, *, job: str, now: float) -> Event:
    """`parse_event(entry, job=job, now=now, strict_ids=True)` of a heartbeat stream's entry:
    the common one (the seven base fields, plain valid text) without parse_event's work for
    payloads and unknown fields; anything else goes through parse_event. A watcher reads 8,000
    of them a poll at 1,000 jobs of 8 ranks."""
    if type(entry) is dict and len(entry) == 7 and entry.get("v") == PROTOCOL_VERSION:
        base = _text_base(entry, job, now + FUTURE_SLACK_S)  # reads the six other fields
        if base is not None and base[0] == "heartbeat":
            return Event("heartbeat", base[1], to_ms(base[2]), base[3], base[4], base[5], {})
    return parse_event(entry, job=job, now=now, strict_ids=True)


def parse_events(
    entry: Entry, *, job: str | None = None, now: float | None = None, strict_ids: bool = False
) -> list[Event]:
    """Validate one entry into its events: a batched `steps` entry gives its steps, as the
    single `step` entries they stand for would; any other entry one event (`parse_event`).
    A bad `steps` entry is refused whole (EventError), never in part."""
    if not isinstance(entry, dict) or entry.get("type") != STEPS_TYPE:
        return [parse_event(entry, job=job, now=now, strict_ids=strict_ids)]
    limit = (time.time() if now is None else now) + FUTURE_SLACK_S
    _etype, ev_job, ts, rank, session, seq = _versioned_base(entry, job, limit, strict_ids)
    fmt = entry.get("fmt")
    if str(fmt) not in STEPS_FORMATS:
        raise EventError(
            "bad_steps", f"steps format {fmt!r} is not known (want one of {sorted(STEPS_FORMATS)})"
        )
    n = _int(entry, "n", hi=1 << 62)
    if not 1 <= n <= MAX_BATCH_STEPS:
        raise EventError("too_many_steps", f"'n'={n}: a steps entry holds 1..{MAX_BATCH_STEPS} steps")
    if seq >= 0 and seq + n - 1 > 1 << 62:
        raise EventError("out_of_range", "'seq' + 'n' overflows the sequence numbers")
    packed = _str(entry, "b")
    if len(packed) > MAX_BATCH_CHARS:
        raise EventError("too_many_steps", f"'b' is {len(packed)} characters, at most {MAX_BATCH_CHARS}")
    cols = unpack_steps(packed, n)
    base_us = micros(entry.get("ts"), ts)
    steps = np.cumsum(cols[0])
    times = np.cumsum(cols[1]) + base_us
    tokens = cols[2]
    lo_us, hi_us = int(MIN_TS * 1_000_000), int(limit * 1_000_000)
    if int(steps.min()) < 0 or int(steps.max()) > MAX_STEP:
        raise EventError("out_of_range", f"a step of the batch is outside 0..{MAX_STEP}")
    if int(times.min()) < lo_us or int(times.max()) > hi_us:
        raise EventError("bad_timestamp", "a step of the batch is not at a plausible Unix time")
    if int(tokens.min()) < -1 or int(tokens.max()) > MAX_TOKENS:
        raise EventError("out_of_range", f"a step of the batch has tokens outside 0..{MAX_TOKENS}")
    extra = entry.keys() - _STEPS_FIELDS
    out: list[Event] = []
    seqs = range(seq, seq + n) if seq >= 0 else itertools.repeat(-1, n)
    for i, (s, t, k, q) in enumerate(
        zip(steps.tolist(), (times / 1_000_000).tolist(), tokens.tolist(), seqs, strict=True)
    ):
        f: dict[str, object] = {"step": s, "tokens": None if k < 0 else k}
        if i == 0 and extra:
            f["_unknown_fields"] = sorted(extra)
        out.append(Event("step", ev_job, to_ms(t), rank, session, q, f))
    return out


# A delta bound that keeps the running sums of MAX_BATCH_STEPS deltas inside int64.
_MAX_DELTA = 10**14


def pack_steps(steps: np.ndarray, micros_: np.ndarray, tokens: np.ndarray, first_us: int) -> str:
    """The `b` field of a `steps` entry, format 1: base64 of the zlib-compressed little-endian
    int64 array [step deltas (the first against 0), time deltas in microseconds (the first
    against the entry's `ts`), tokens (-1: none)], n of each."""
    ds = np.diff(steps, prepend=0)
    dt = np.diff(micros_, prepend=first_us)
    body = np.concatenate((ds, dt, tokens)).astype("<i8", copy=False).tobytes()
    return base64.b64encode(zlib.compress(body, 1)).decode("ascii")


def unpack_steps(packed: str, n: int) -> np.ndarray:
    """The (3, n) int64 array of deltas and tokens a `b` field holds; EventError for anything
    that is not exactly that (bad base64, a bad or oversized zlib stream, a wrong length,
    a delta too large to add up)."""
    try:
        raw = base64.b64decode(packed, validate=True)
        z = zlib.decompressobj()
        body = z.decompress(raw, 24 * n + 1)
        if len(body) != 24 * n or not z.eof or z.unused_data or z.unconsumed_tail:
            raise ValueError(f"it unpacks to {len(body)} bytes or more, not {24 * n}")
    except (ValueError, zlib.error) as e:  # (binascii.Error is a ValueError)
        raise EventError("bad_steps", f"'b' is not {n} packed steps: {e}") from None
    cols = np.frombuffer(body, dtype="<i8").reshape(3, n)
    if int(cols[:2].min()) < -_MAX_DELTA or int(cols[:2].max()) > _MAX_DELTA:
        raise EventError("bad_steps", "'b' holds a delta too large to be a step or a time")
    return cols


_STEPS_FIELDS = BASE_FIELDS | {"fmt", "n", "b"}


def micros(v: object, ts: float) -> int:
    """A timestamp's microseconds, exactly as its text says (`1753570005.004` is
    1753570005004000): a batch's times add to it in whole microseconds, and each step's time,
    microseconds / 1e6, is then the float a single `step` entry's `ts` text parses to. `ts` is
    the value already parsed (its fallback, rounded to the microsecond)."""
    if type(v) is str:
        a, _dot, b = v.partition(".")
        if a.isascii() and a.isdigit() and (not b or (b.isascii() and b.isdigit() and len(b) <= 6)):
            return int(a) * 1_000_000 + (int(b.ljust(6, "0")) if b else 0)
    return round(ts * 1_000_000)
