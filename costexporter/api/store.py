"""Reading the ledger for the API: window totals from the fewest buckets, series, incidents.

All amounts are the ledger's integers; money leaves here as `Decimal` (micro-units / 10^6), so the
API can print it with a fixed number of places and never a binary float.

Stored data is not trusted: a value that does not parse (a budget of "5k", a registration time of
null, a bucket field that is not a number, a key of the wrong type) is skipped and named in the
`Warnings` the caller passes, so one bad record never fails a request for everyone.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation

import redis

from .. import ledger, protocol
from ..model import CATEGORIES, VALID_CATEGORIES, WASTED_CATEGORIES
from .windows import decompose

WASTED = [c.name.lower() for c in sorted(WASTED_CATEGORIES)]
VALID = [c.name.lower() for c in sorted(VALID_CATEGORIES)]
JOB_CATS = [c for c in CATEGORIES if c != "unassigned"]


LATEST_TS = 32_503_680_000  # 3000-01-01: a stored time beyond it (or before 1970) is not a time


class Warnings(list):
    """What a request skipped in the stored data, one line per job and problem (deduplicated)."""

    def add(self, job: str, what: str) -> None:
        line = f"{job}: {what}"
        if line not in self and len(self) < 100:
            self.append(line)


def timestamp(v: object) -> float | None:
    """A stored Unix time, or None if it is not a finite number of seconds within 1970..3000."""
    if isinstance(v, bool):
        return None
    try:
        t = float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return t if math.isfinite(t) and 0 <= t < LATEST_TS else None


def number(v: object) -> int | None:
    """A stored integer (counts, amounts), or None."""
    if isinstance(v, bool):
        return None
    try:
        return int(v)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        try:
            f = float(v)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return None
        return int(f) if math.isfinite(f) and f == int(f) else None


def decimal(v: object) -> Decimal | None:
    """A stored finite decimal amount (a budget), or None."""
    try:
        d = Decimal(str(v).strip())
    except (InvalidOperation, ValueError):
        return None
    return d if d.is_finite() and abs(d) < Decimal(10) ** 15 else None


# Ledger field -> (unit index, category, sign): parsed once, not per field per bucket.
_FIELDS = {
    f"{prefix}{c}:{u}": (i, c, -1 if prefix else 1)
    for prefix in ("", "voided:")
    for c in CATEGORIES
    for i, u in enumerate(("ms", "mj", "ucost"))
}


@dataclass
class Amounts:
    """Net amounts per category (after rollback corrections) and the price versions seen."""

    ms: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    mj: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    ucost: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    price_versions: set[str] = field(default_factory=set)

    def add_hash(self, h: dict) -> int:
        """Add one amounts hash; returns how many of its amounts were not integers (skipped)."""
        targets = (self.ms, self.mj, self.ucost)
        bad = 0
        for f, v in h.items():
            parsed = _FIELDS.get(f)
            if parsed is not None:
                n = number(v)
                if n is None:
                    bad += 1
                    continue
                unit, cat, sign = parsed
                targets[unit][cat] += sign * n
            elif f == "price_version":
                self.price_versions.add(str(v))
        return bad

    def cost(self, cat: str) -> Decimal:
        return Decimal(self.ucost[cat]) / Decimal(10**6)

    def total_cost(self, cats: list[str] = JOB_CATS) -> Decimal:
        return sum((self.cost(c) for c in cats), Decimal(0))

    def hours(self, cats: list[str]) -> float:
        return sum(self.ms[c] for c in cats) / 3.6e6


@dataclass
class Steps:
    completed: int = 0
    voided: int = 0
    tokens: int = 0

    @property
    def valid(self) -> int:
        return self.completed - self.voided


# Sums a job's bucket hashes inside Redis: one short reply per job instead of every bucket.
# Lua numbers are doubles: integers stay exact up to 2^53 (9e9 currency units in micro-units).
SUM_BUCKETS = r"""
-- A key of another type or a value that is no finite number is skipped and counted (`_bad`).
local acc, order, versions, seen, bad = {}, {}, {}, {}, 0
for i = 1, #KEYS do
  local t = redis.call('TYPE', KEYS[i])['ok']
  if t == 'hash' then
    local h = redis.call('HGETALL', KEYS[i])
    for j = 1, #h, 2 do
      local f, v = h[j], h[j + 1]
      if f == 'price_version' then
        if not seen[v] then seen[v] = true; versions[#versions + 1] = v end
      else
        local n = tonumber(v)
        if n == nil or n ~= n or n == math.huge or n == -math.huge then
          bad = bad + 1
        elseif acc[f] == nil then acc[f] = n; order[#order + 1] = f else acc[f] = acc[f] + n end
      end
    end
  elseif t ~= 'none' then
    bad = bad + 1
  end
end
local out = {}
for _, f in ipairs(order) do out[#out + 1] = f; out[#out + 1] = string.format('%.0f', acc[f]) end
if #versions > 0 then out[#out + 1] = 'price_version'; out[#out + 1] = table.concat(versions, '\n') end
if bad > 0 then out[#out + 1] = '_bad'; out[#out + 1] = tostring(bad) end
return out
"""

# Steps and voids of a window from the job's sorted sets (KEYS: steps, voids; ARGV: start, end):
# counts, and the cumulative tokens at both ends (members are "<record>:<cumulative tokens>").
STEPS_WINDOW = r"""
local out = {}
for i = 1, 2 do
  local n = redis.call('ZCOUNT', KEYS[i], ARGV[1], '(' .. ARGV[2])
  local a = redis.call('ZREVRANGEBYSCORE', KEYS[i], '(' .. ARGV[2], '-inf', 'LIMIT', 0, 1)
  local b = redis.call('ZREVRANGEBYSCORE', KEYS[i], '(' .. ARGV[1], '-inf', 'LIMIT', 0, 1)
  out[#out + 1] = n
  out[#out + 1] = a[1] or ''
  out[#out + 1] = b[1] or ''
end
return out
"""


def _run(pipe) -> list:
    """Execute a pipeline; a command that failed on the stored data (a key of the wrong type, a
    script error) gives None instead of failing every other result. Outages still raise."""
    return [None if isinstance(x, redis.ResponseError) else x for x in pipe.execute(raise_on_error=False)]


def _json(raw: object) -> object:
    try:
        return json.loads(raw) if isinstance(raw, str | bytes) else None
    except ValueError:
        return None


class LedgerStore:
    def __init__(self, client, prefix: str = protocol.DEFAULT_PREFIX) -> None:
        from .. import redisconn

        self.r = client
        self.prefix = prefix
        self._sum = redisconn.script(client, SUM_BUCKETS)  # EVAL on a cluster's pipelines
        self._steps = redisconn.script(client, STEPS_WINDOW)

    def k(self, job: str, *parts: str) -> str:
        return ledger.key(self.prefix, job, *parts)

    def ping(self) -> bool:
        return bool(self.r.ping())

    def jobs(self, warn: Warnings | None = None) -> list[tuple[str, float | None]]:
        """Every job with the time of its newest event (None where that is not a time)."""
        out = []
        for j, score in self.r.zrange(protocol.jobs_key(self.prefix), 0, -1, withscores=True):
            t = timestamp(score)
            if t is None and warn is not None:
                warn.add(j, f"newest event time {score!r} is not a time: ignored")
            out.append((j, t))
        return out

    def job_exists(self, job: str) -> bool:
        return self.r.zscore(protocol.jobs_key(self.prefix), job) is not None

    def job_team(self, job: str) -> tuple[bool, str | None]:
        """Whether the job exists, and its team: one round trip."""
        pipe = self.r.pipeline(transaction=False)
        pipe.zscore(protocol.jobs_key(self.prefix), job)
        pipe.hget(protocol.meta_key(self.prefix, job), "team")
        score, team = _run(pipe)
        return score is not None, team

    def meta_many(self, jobs: list[str], warn: Warnings | None = None) -> dict[str, dict]:
        """Each job's meta (team, cost center, ...) in one round trip."""
        pipe = self.r.pipeline(transaction=False)
        for j in jobs:
            pipe.hgetall(protocol.meta_key(self.prefix, j))
        out = {}
        for j, meta in zip(jobs, _run(pipe), strict=True):
            if meta is None and warn is not None:
                warn.add(j, "meta is not a hash: ignored")
            out[j] = meta or {}
        return out

    def info_many(self, jobs: list[str], warn: Warnings | None = None) -> dict[str, dict]:
        """meta, figures, status and first registration of many jobs in one round trip."""
        warn = Warnings() if warn is None else warn
        pipe = self.r.pipeline(transaction=False)
        for j in jobs:
            self._queue_info(pipe, j)
        raw = _run(pipe)
        return {j: _info(j, *raw[4 * i : 4 * i + 4], warn) for i, j in enumerate(jobs)}

    def job_info(self, job: str, warn: Warnings | None = None) -> dict | None:
        """One job's `info_many` entry, or None if there is no such job: one round trip."""
        warn = Warnings() if warn is None else warn
        pipe = self.r.pipeline(transaction=False)
        pipe.zscore(protocol.jobs_key(self.prefix), job)
        self._queue_info(pipe, job)
        score, *raw = _run(pipe)
        return None if score is None else _info(job, *raw, warn)

    def _queue_info(self, pipe, j: str) -> None:
        """The 4 reads `_info` parses."""
        pipe.hgetall(protocol.meta_key(self.prefix, j))
        pipe.hgetall(self.k(j, "ledger", "job"))
        pipe.get(self.k(j, "status"))
        pipe.hvals(protocol.ranks_key(self.prefix, j))

    def amounts_many(
        self, jobs: list[str], start: int, end: int, warn: Warnings | None = None
    ) -> dict[str, Amounts]:
        """Window totals of many jobs: the fewest buckets (whole days, hours, then 5 minutes),
        summed inside Redis by a script, one call per job, one pipeline."""
        pipe = self.r.pipeline(transaction=False)
        self._queue_amounts(pipe, jobs, start, end)
        return _amounts(jobs, _run(pipe), warn)

    def window_many(
        self, jobs: list[str], start: int, end: int, warn: Warnings | None = None
    ) -> tuple[dict[str, Amounts], dict[str, Steps]]:
        """`amounts_many` of a window, and the steps completed and voided in it with the tokens of
        the valid ones, in one round trip."""
        pipe = self.r.pipeline(transaction=False)
        self._queue_amounts(pipe, jobs, start, end)
        self._queue_steps(pipe, jobs, start, end)
        raw = _run(pipe)
        return _amounts(jobs, raw[: len(jobs)], warn), _steps(jobs, raw[len(jobs) :], warn)

    def _queue_amounts(self, pipe, jobs: list[str], start: int, end: int) -> None:
        parts = decompose(start, end)
        for j in jobs:
            self._sum(keys=[self.k(j, "ledger", res, str(b)) for res, b in parts], client=pipe)

    def _queue_steps(self, pipe, jobs: list[str], start: float, end: float) -> None:
        for j in jobs:
            self._steps(
                keys=[self.k(j, "ledger", "steps"), self.k(j, "ledger", "voids")],
                args=[start, end],
                client=pipe,
            )

    def totals_many(self, jobs: list[str], warn: Warnings | None = None) -> dict[str, Amounts]:
        """All-time amounts (the `ledger:total` hash) of many jobs, one pipeline."""
        pipe = self.r.pipeline(transaction=False)
        for j in jobs:
            pipe.hgetall(self.k(j, "ledger", "total"))
        out = {}
        for j, h in zip(jobs, _run(pipe), strict=True):
            a = Amounts()
            bad = a.add_hash(h) if h is not None else 1
            if bad and warn is not None:
                warn.add(j, f"{bad} all-time amounts are not numbers or not in a hash: skipped")
            out[j] = a
        return out

    def series(
        self, job: str, start: int, end: int, res: str, warn: Warnings | None = None
    ) -> list[tuple[int, Amounts]]:
        secs = ledger.RESOLUTIONS[res]
        first = start // secs * secs
        starts = list(range(first, end, secs))
        pipe = self.r.pipeline(transaction=False)
        for b in starts:
            pipe.hgetall(self.k(job, "ledger", res, str(b)))
        out = []
        bad = 0
        for b, h in zip(starts, _run(pipe), strict=True):
            a = Amounts()
            bad += a.add_hash(h) if h is not None else 1
            out.append((b, a))
        if bad and warn is not None:
            warn.add(job, f"{bad} ledger amounts are not numbers or not in a hash: skipped")
        return out

    def incidents(
        self, job: str, start: int, end: int, tol_s: float = 5.0, warn: Warnings | None = None
    ) -> list[dict]:
        """Every agent's incidents merged job-wide: one stretch per category and overlap.

        The agents that wrote incidents are read from the job's index (never a SCAN)."""
        warn = Warnings() if warn is None else warn
        pipe = self.r.pipeline(transaction=False)
        pipe.smembers(ledger.incident_index_key(self.prefix, job))
        (agents,) = _run(pipe)
        if agents is None:
            warn.add(job, "the incident index is not a set: incidents skipped")
        agents = sorted(agents or ())
        pipe = self.r.pipeline(transaction=False)
        for agent in agents:
            pipe.hvals(ledger.incidents_key(self.prefix, job, agent))
        raw = []
        for values in _run(pipe) if agents else []:
            for v in values or []:
                inc = incident(_json(v))
                if inc is None:
                    warn.add(job, "an incident that is not a valid record: skipped")
                else:
                    raw.append(inc)
        merged: list[dict] = []
        for inc in sorted(raw, key=lambda x: (x["category"], x["start"])):
            s, e = inc["start"] / 1000, inc["end"] / 1000
            last = merged[-1] if merged else None
            if last and last["category"] == inc["category"] and s <= last["end"] + tol_s:
                last["end"] = max(last["end"], e)
                last["gpu_ms"] += inc["gpu_ms"]
                last["ranks"] = sorted(set(last["ranks"]) | set(inc["ranks"]))
                last["hosts"] = sorted(set(last["hosts"]) | {inc["host"]})
                last["zero_util_ranks"] = sorted(set(last["zero_util_ranks"]) | set(inc["zero_util_ranks"]))
            else:
                merged.append(
                    {
                        "category": inc["category"],
                        "start": s,
                        "end": e,
                        "gpu_ms": inc["gpu_ms"],
                        "ranks": list(inc["ranks"]),
                        "hosts": [inc["host"]],
                        "zero_util_ranks": list(inc["zero_util_ranks"]),
                    }
                )
        return [m for m in merged if m["end"] > start and m["start"] < end]

    def index_incidents(self) -> int:
        """Index incidents written before the index existed (once, at startup)."""
        return ledger.index_incidents(self.r, self.prefix)

    def unassigned(self, start: int, end: int, warn: Warnings | None = None) -> Amounts:
        return self.amounts_many([ledger.UNASSIGNED_JOB], start, end, warn)[ledger.UNASSIGNED_JOB]


def _amounts(jobs: list[str], replies: list, warn: Warnings | None) -> dict[str, Amounts]:
    """Each job's window amounts from the replies of `LedgerStore._queue_amounts`."""
    out = {}
    for j, flat in zip(jobs, replies, strict=True):
        a = Amounts()
        h = dict(zip(flat[::2], flat[1::2], strict=True)) if flat else {}
        versions = h.pop("price_version", None)
        bad = (number(h.pop("_bad", 0)) or 0) + a.add_hash(h) + (flat is None)
        if versions:
            a.price_versions.update(versions.split("\n"))
        if bad and warn is not None:
            warn.add(j, f"{bad} ledger amounts are not numbers or not in a hash: skipped")
        out[j] = a
    return out


def _steps(jobs: list[str], replies: list, warn: Warnings | None) -> dict[str, Steps]:
    """Each job's window steps from the replies of `LedgerStore._queue_steps`."""
    warn = Warnings() if warn is None else warn
    out = {}
    for j, got in zip(jobs, replies, strict=True):
        if got is None:
            warn.add(j, "the step sets have the wrong type: steps skipped")
            out[j] = Steps()
            continue
        c_n, c_end, c_start, v_n, v_end, v_start = got

        def cum(member: str, j: str = j) -> int:
            n = number(member.rsplit(":", 1)[-1]) if member else 0
            if n is None:
                warn.add(j, f"step member {member[:40]!r} has no cumulative tokens: counted as 0")
            return n or 0

        tokens = (cum(c_end) - cum(c_start)) - (cum(v_end) - cum(v_start))
        out[j] = Steps(int(c_n), int(v_n), max(tokens, 0))
    return out


def _info(j: str, meta, figures, status, ranks, warn: Warnings) -> dict:
    """A job's info from the replies of `LedgerStore._queue_info`."""
    for what, value in (("meta", meta), ("figures", figures), ("ranks", ranks)):
        if value is None:
            warn.add(j, f"{what} key has the wrong type: ignored")
    regs = []
    for r in ranks or []:
        entry = _json(r)
        t = timestamp(entry.get("ts")) if isinstance(entry, dict) else None
        if t is None:
            warn.add(j, "a ranks entry without a valid registration time: ignored")
        else:
            regs.append(t)
    state = "unknown"
    if status:
        parsed = _json(status)
        state = str(parsed.get("state", "unknown")) if isinstance(parsed, dict) else str(status)
    return {
        "meta": meta or {},
        "figures": figures or {},
        "status": state,
        "first_seen": min(regs) if regs else None,
    }


def incident(x: object) -> dict | None:
    """A stored incident as the reader needs it, or None if it is not one."""
    if not isinstance(x, dict) or not isinstance(x.get("category"), str):
        return None
    start, end = timestamp_ms(x.get("start")), timestamp_ms(x.get("end"))
    gpu_ms, ranks = number(x.get("gpu_ms")), x.get("ranks")
    if start is None or end is None or end < start or gpu_ms is None or not isinstance(ranks, list):
        return None
    zero = x.get("zero_util_ranks", [])  # absent in incidents written before it existed
    if not isinstance(zero, list) or not all(
        isinstance(r, int) and not isinstance(r, bool) for r in [*ranks, *zero]
    ):
        return None
    host = x.get("host", "")
    return {
        "category": x["category"],
        "start": start,
        "end": end,
        "gpu_ms": gpu_ms,
        "ranks": ranks,
        "zero_util_ranks": sorted(set(zero)),
        "host": host if isinstance(host, str) else "",
    }


def timestamp_ms(v: object) -> float | None:
    """A stored time in Unix milliseconds, or None."""
    t = timestamp(v / 1000 if isinstance(v, int | float) and not isinstance(v, bool) else None)
    return None if t is None else float(v)  # type: ignore[arg-type]
