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


@dataclass
class Amounts:
    """Net amounts per category (after rollback corrections) and the price versions seen."""

    ms: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    mj: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    ucost: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    price_versions: set[str] = field(default_factory=set)

    def add_hash(self, h: dict) -> None:
        for f, v in h.items():
            if f == "price_version":
                self.price_versions.add(v)
                continue
            parts = f.split(":")
            sign = -1 if parts[0] == "voided" else 1
            cat, unit = parts[-2], parts[-1]
            target = {"ms": self.ms, "mj": self.mj, "ucost": self.ucost}.get(unit)
            if target is not None and cat in target:
                target[cat] += sign * int(v)

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


class LedgerStore:
    def __init__(self, client, prefix: str = protocol.DEFAULT_PREFIX) -> None:
        self.r = client
        self.prefix = prefix

    def k(self, job: str, *parts: str) -> str:
        return ledger.key(self.prefix, job, *parts)

    def ping(self) -> bool:
        return bool(self.r.ping())

    def jobs(self) -> list[tuple[str, float]]:
        """Every job with the time of its newest event."""
        return [(j, s) for j, s in self.r.zrange(protocol.jobs_key(self.prefix), 0, -1, withscores=True)]

    def job_exists(self, job: str) -> bool:
        return self.r.zscore(protocol.jobs_key(self.prefix), job) is not None

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
        """Window totals of many jobs: whole days, hours, then 5-minute buckets, one pipeline."""
        parts = decompose(start, end)
        pipe = self.r.pipeline(transaction=False)
        for j in jobs:
            for res, b in parts:
                pipe.hgetall(self.k(j, "ledger", res, str(b)))
        raw = pipe.execute()
        out = {}
        n = len(parts)
        for i, j in enumerate(jobs):
            a = Amounts()
            for h in raw[i * n : (i + 1) * n]:
                if h:
                    a.add_hash(h)
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
            for name in ("steps", "voids"):
                k = self.k(j, "ledger", name)
                pipe.zcount(k, start, f"({end}")
                pipe.zrevrangebyscore(k, f"({end}", "-inf", start=0, num=1)
                pipe.zrevrangebyscore(k, f"({start}", "-inf", start=0, num=1)
        raw = pipe.execute()

        def cum(members: list) -> int:
            return int(members[0].rsplit(":", 1)[1]) if members else 0

        out = {}
        for i, j in enumerate(jobs):
            c_n, c_end, c_start, v_n, v_end, v_start = raw[6 * i : 6 * i + 6]
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
