"""Reading the ledger for the API: window totals from the fewest buckets, series, incidents.

All amounts are the ledger's integers; money leaves here as `Decimal` (micro-units / 10^6), so the
API can print it with a fixed number of places and never a binary float.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from decimal import Decimal

from .. import ledger, protocol
from ..model import CATEGORIES, VALID_CATEGORIES, WASTED_CATEGORIES
from .windows import decompose

WASTED = [c.name.lower() for c in sorted(WASTED_CATEGORIES)]
VALID = [c.name.lower() for c in sorted(VALID_CATEGORIES)]
JOB_CATS = [c for c in CATEGORIES if c != "unassigned"]


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

    def add_hash(self, h: dict) -> None:
        targets = (self.ms, self.mj, self.ucost)
        for f, v in h.items():
            parsed = _FIELDS.get(f)
            if parsed is not None:
                unit, cat, sign = parsed
                targets[unit][cat] += sign * int(v)
            elif f == "price_version":
                self.price_versions.add(v)

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
local acc, order, versions, seen = {}, {}, {}, {}
for i = 1, #KEYS do
  local h = redis.call('HGETALL', KEYS[i])
  for j = 1, #h, 2 do
    local f, v = h[j], h[j + 1]
    if f == 'price_version' then
      if not seen[v] then seen[v] = true; versions[#versions + 1] = v end
    else
      local n = tonumber(v) or 0
      if acc[f] == nil then acc[f] = n; order[#order + 1] = f else acc[f] = acc[f] + n end
    end
  end
end
local out = {}
for _, f in ipairs(order) do out[#out + 1] = f; out[#out + 1] = string.format('%.0f', acc[f]) end
if #versions > 0 then out[#out + 1] = 'price_version'; out[#out + 1] = table.concat(versions, '\n') end
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


class LedgerStore:
    def __init__(self, client, prefix: str = protocol.DEFAULT_PREFIX) -> None:
        self.r = client
        self.prefix = prefix
        self._sum = client.register_script(SUM_BUCKETS)
        self._steps = client.register_script(STEPS_WINDOW)

    def k(self, job: str, *parts: str) -> str:
        return ledger.key(self.prefix, job, *parts)

    def ping(self) -> bool:
        return bool(self.r.ping())

    def jobs(self) -> list[tuple[str, float]]:
        """Every job with the time of its newest event."""
        return [(j, s) for j, s in self.r.zrange(protocol.jobs_key(self.prefix), 0, -1, withscores=True)]

    def job_exists(self, job: str) -> bool:
        return self.r.zscore(protocol.jobs_key(self.prefix), job) is not None

    def job_team(self, job: str) -> tuple[bool, str | None]:
        """Whether the job exists, and its team: one round trip."""
        pipe = self.r.pipeline(transaction=False)
        pipe.zscore(protocol.jobs_key(self.prefix), job)
        pipe.hget(protocol.meta_key(self.prefix, job), "team")
        score, team = pipe.execute()
        return score is not None, team

    def meta_many(self, jobs: list[str]) -> dict[str, dict]:
        """Each job's meta (team, cost center, ...) in one round trip."""
        pipe = self.r.pipeline(transaction=False)
        for j in jobs:
            pipe.hgetall(protocol.meta_key(self.prefix, j))
        return dict(zip(jobs, pipe.execute(), strict=True))

    def info_many(self, jobs: list[str]) -> dict[str, dict]:
        """meta, figures, status and first registration of many jobs in one round trip."""
        pipe = self.r.pipeline(transaction=False)
        for j in jobs:
            pipe.hgetall(protocol.meta_key(self.prefix, j))
            pipe.hgetall(self.k(j, "ledger", "job"))
            pipe.get(self.k(j, "status"))
            pipe.hvals(protocol.ranks_key(self.prefix, j))
        raw = pipe.execute()
        out = {}
        for i, j in enumerate(jobs):
            meta, figures, status, ranks = raw[4 * i : 4 * i + 4]
            regs = []
            for r in ranks:
                try:
                    regs.append(float(json.loads(r).get("ts", 0)))
                except (ValueError, AttributeError):
                    continue
            state = "unknown"
            if status:
                try:
                    state = str(json.loads(status).get("state", "unknown"))
                except (ValueError, AttributeError):
                    state = str(status)
            out[j] = {
                "meta": meta,
                "figures": figures,
                "status": state,
                "first_seen": min(regs) if regs else None,
            }
        return out

    def amounts_many(self, jobs: list[str], start: int, end: int) -> dict[str, Amounts]:
        """Window totals of many jobs: the fewest buckets (whole days, hours, then 5 minutes),
        summed inside Redis by a script, one call per job, one pipeline."""
        parts = decompose(start, end)
        pipe = self.r.pipeline(transaction=False)
        for j in jobs:
            self._sum(keys=[self.k(j, "ledger", res, str(b)) for res, b in parts], client=pipe)
        out = {}
        for j, flat in zip(jobs, pipe.execute(), strict=True):
            a = Amounts()
            h = dict(zip(flat[::2], flat[1::2], strict=True))
            versions = h.pop("price_version", None)
            a.add_hash(h)
            if versions:
                a.price_versions.update(versions.split("\n"))
            out[j] = a
        return out

    def totals_many(self, jobs: list[str]) -> dict[str, Amounts]:
        """All-time amounts (the `ledger:total` hash) of many jobs, one pipeline."""
        pipe = self.r.pipeline(transaction=False)
        for j in jobs:
            pipe.hgetall(self.k(j, "ledger", "total"))
        out = {}
        for j, h in zip(jobs, pipe.execute(), strict=True):
            a = Amounts()
            a.add_hash(h)
            out[j] = a
        return out

    def series(self, job: str, start: int, end: int, res: str) -> list[tuple[int, Amounts]]:
        secs = ledger.RESOLUTIONS[res]
        first = start // secs * secs
        starts = list(range(first, end, secs))
        pipe = self.r.pipeline(transaction=False)
        for b in starts:
            pipe.hgetall(self.k(job, "ledger", res, str(b)))
        out = []
        for b, h in zip(starts, pipe.execute(), strict=True):
            a = Amounts()
            a.add_hash(h)
            out.append((b, a))
        return out

    def steps_many(self, jobs: list[str], start: float, end: float) -> dict[str, Steps]:
        """Steps completed and voided in [start, end), and the tokens of the valid ones."""
        pipe = self.r.pipeline(transaction=False)
        for j in jobs:
            self._steps(
                keys=[self.k(j, "ledger", "steps"), self.k(j, "ledger", "voids")],
                args=[start, end],
                client=pipe,
            )

        def cum(member: str) -> int:
            return int(member.rsplit(":", 1)[1]) if member else 0

        out = {}
        for j, (c_n, c_end, c_start, v_n, v_end, v_start) in zip(jobs, pipe.execute(), strict=True):
            tokens = (cum(c_end) - cum(c_start)) - (cum(v_end) - cum(v_start))
            out[j] = Steps(int(c_n), int(v_n), max(tokens, 0))
        return out

    def incidents(self, job: str, start: int, end: int, tol_s: float = 5.0) -> list[dict]:
        """Every agent's incidents merged job-wide: one stretch per category and overlap."""
        raw = []
        for key in self.r.scan_iter(match=self.k(job, "ledger", "incidents", "*")):
            for v in self.r.hvals(key):
                try:
                    raw.append(json.loads(v))
                except ValueError:
                    continue
        merged: list[dict] = []
        for inc in sorted(raw, key=lambda x: (x["category"], x["start"])):
            s, e = inc["start"] / 1000, inc["end"] / 1000
            last = merged[-1] if merged else None
            if last and last["category"] == inc["category"] and s <= last["end"] + tol_s:
                last["end"] = max(last["end"], e)
                last["gpu_ms"] += inc["gpu_ms"]
                last["ranks"] = sorted(set(last["ranks"]) | set(inc["ranks"]))
                last["hosts"] = sorted(set(last["hosts"]) | {inc.get("host", "")})
            else:
                merged.append(
                    {
                        "category": inc["category"],
                        "start": s,
                        "end": e,
                        "gpu_ms": inc["gpu_ms"],
                        "ranks": list(inc["ranks"]),
                        "hosts": [inc.get("host", "")],
                    }
                )
        return [m for m in merged if m["end"] > start and m["start"] < end]

    def unassigned(self, start: int, end: int) -> Amounts:
        return self.amounts_many([ledger.UNASSIGNED_JOB], start, end)[ledger.UNASSIGNED_JOB]
