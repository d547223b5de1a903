"""Reading what a trainer can write: one bounded JSON decoder, a key of the wrong type told
from an outage, and names cut short for log lines.

A trainer writes its job's events, ranks and meta hashes and the jobs index. Whatever it puts
there (200k nested brackets, a megabyte of JSON, a stream where a hash belongs) must be refused
as a counted, per-job rejection, never an exception that stops the agent, the watcher or the API
for every other job.
"""

from __future__ import annotations

import collections
import logging
import re
import time
from itertools import accumulate

import orjson

MAX_JSON_BYTES = 64 * 1024  # a registration or a status is a few hundred bytes
MAX_JSON_DEPTH = 32  # the values read are flat objects; nesting this deep is no registration
LOG_NAME_CHARS = 80  # a job name in a log line (names are checked only where keys are built)

_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_DEPTH = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


class UntrustedValue(ValueError):
    """A stored value refused; `reason` is the short label it is counted under."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def loads(raw: object, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH) -> object:
    """JSON text as Python values, refused (UntrustedValue: too_large, too_deep, bad_json) when it
    is larger or deeper than any value the product writes, or not JSON. Never RecursionError or
    MemoryError from the input: the size and depth are checked before anything is built."""
    if isinstance(raw, bytes | bytearray):
        text = bytes(raw)
        size = len(text)
    elif isinstance(raw, str):
        text = raw.encode("utf-8", "surrogatepass")
        size = len(text)
    else:
        raise UntrustedValue("bad_json", f"a {type(raw).__name__}, not JSON text")
    if size > max_bytes:
        raise UntrustedValue("too_large", f"{size} bytes of JSON, more than {max_bytes}")
    if text.count(b"[") + text.count(b"{") > max_depth and _depth(text) > max_depth:
        raise UntrustedValue("too_deep", f"JSON nested deeper than {max_depth}")
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as e:
        raise UntrustedValue("bad_json", f"not JSON ({e})") from None


def _depth(text: bytes) -> int:
    """The deepest nesting of brackets outside strings."""
    try:
        s = _STRINGS.sub("", text.decode("utf-8", "replace"))
    except RecursionError:  # pragma: no cover - the regex is iterative
        return 1 << 30
    return max(accumulate(_DEPTH.get(ord(c), 0) for c in s if c in "[]{}"), default=0)


def is_wrong_type(e: BaseException) -> bool:
    """Whether a Redis error is about the stored data (a key of the wrong type: WRONGTYPE), not
    about reaching Redis: the job that owns the key is set aside, the others go on."""
    import redis

    return isinstance(e, redis.ResponseError) and "WRONGTYPE" in str(e)


def short(name: object, limit: int = LOG_NAME_CHARS) -> str:
    """A name for a log line: as is when short, else its start and its length (a 1 MB job name
    must not make a 1 MB log line)."""
    s = name if isinstance(name, str) else repr(name)
    return s if len(s) <= limit else f"{s[:limit]}...({len(s)} chars)"


class Refusals:
    """Refused trainer-written values, counted per (job, reason) for a metric and logged at most
    once per `log_every_s` per (job, reason), the job's name cut short: a trainer that rewrites a
    bad value every second makes one line an hour, not one a round."""

    def __init__(self, logger: logging.Logger, log_every_s: float = 3600.0) -> None:
        self.log = logger
        self.log_every_s = log_every_s
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self._logged: dict[tuple[str, str], float] = {}

    def refuse(self, job: str, reason: str, message: str, *args: object) -> None:
        """Count one refusal of `job`'s data (`reason`: a short label) and log `message % args`
        (prefixed with the job) unless this job and reason were logged within `log_every_s`."""
        self.counts[(job, reason)] += 1
        self.log_once(job, reason, message + " [%s; counted, the other jobs go on]", *args, reason)

    def log_once(self, job: str, key: str, message: str, *args: object) -> None:
        """Log `message % args` about `job`, at most once per `log_every_s` per (job, key)."""
        now = time.monotonic()
        last = self._logged.get((job, key))
        if last is not None and now - last < self.log_every_s:
            return
        if len(self._logged) >= 10_000:  # a flood of job names: start over
            self._logged.clear()
        self._logged[(job, key)] = now
        self.log.warning("job %r: " + message, short(job), *args)
