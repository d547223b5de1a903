"""Who pays for a job and where it ran (pure): its owner (team, cost centre, budget), its place
(cluster, namespace, controller kind) and where its price came from, each with its source.

A trainer writes its own meta, so a bill that took the team or the price from it would be the
subject's own word. Each value comes from the operator's side: a policy rule (matched on the job's
name or its Kubernetes namespace, never on meta), the policy's cluster, what the agent's
Kubernetes path read of the job's pod (`Facts`), or the price table. A meta key counts only where
the first policy rule that matches the job and grants keys names it (`grant_meta`); any other
meta value for these keys is ignored, counted and said.

The agent writes the attribution beside the job's figures (`store/ledger.py`); the API, the
exports and `/metrics` read it there, never the meta hash.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from costexporter.core.events import bounded_number
from costexporter.core.pricing import NEG_INF, PriceSchedule
from costexporter.core.replayreport import AttributionField
from costexporter.core.timeutil import parse_instant

OWNER_KEYS = ("team", "cost_center", "budget")
PLACE_KEYS = ("cluster", "namespace", "controller", "controller_kind")
PRICE_KEY = "price_per_gpu_hour"
# When the job was submitted (Unix seconds): its wait before the start is scheduling goodput's
# (`core/goodput.py`), so only the operator's side dates it (a pod's creation, or a launcher's
# `submitted_at` a policy rule grants).
SUBMITTED_KEY = "submitted_at"
# The meta keys only the operator sets unless a policy rule grants them.
GRANTABLE = (PRICE_KEY, *OWNER_KEYS, *PLACE_KEYS, SUBMITTED_KEY)
FIELDS = (*OWNER_KEYS, *PLACE_KEYS, PRICE_KEY, "node_pool", SUBMITTED_KEY)
_NUMBERS = ("budget", PRICE_KEY, SUBMITTED_KEY)
_MAX_TEXT = 200


@dataclass(frozen=True, slots=True)
class Facts:
    """What the operator's side read about a job: the agent's Kubernetes path, from the pod's
    namespace, its controlling owner and the team label the operator configured."""

    namespace: str | None = None
    controller: str | None = None
    controller_kind: str | None = None
    team: str | None = None
    submitted_at: float | None = None  # the earliest creation of the job's pods (Unix seconds)


@dataclass(frozen=True, slots=True)
class Attribution:
    """A job's owner, place and price, each with where it came from (`FIELDS`)."""

    values: tuple[tuple[str, str | float], ...] = ()
    sources: tuple[tuple[str, str], ...] = ()
    # A price for the job that overrides the price table: a rule's, or the trainer's where granted.
    granted_price: float | None = None

    def get(self, key: str) -> str | float | None:
        return dict(self.values).get(key)

    def source(self, key: str) -> str | None:
        return dict(self.sources).get(key)

    def priced(self, schedule: PriceSchedule, node_pool: str | None) -> Attribution:
        """With the job's GPU-hour price now and where it came from (the schedule's latest)."""
        _, prices, version = schedule.changes[-1]
        head = version.split(";", 1)[0]
        source = "flags" if head.startswith("gpu_hour=") else head
        if source == "rule":
            source = self.source(PRICE_KEY) or "policy rule"
        vals = [(k, v) for k, v in self.values if k not in (PRICE_KEY, "node_pool")]
        srcs = [(k, v) for k, v in self.sources if k not in (PRICE_KEY, "node_pool")]
        vals.append((PRICE_KEY, prices.price_per_gpu_hour))
        srcs.append((PRICE_KEY, source))
        if node_pool is not None:
            vals.append(("node_pool", node_pool))
            srcs.append(("node_pool", "policy node_pools"))
        if len(schedule.changes) > 1 or schedule.changes[0][0] != NEG_INF:
            srcs = [(k, f"{v}, dated" if k == PRICE_KEY else v) for k, v in srcs]
        return replace(self, values=tuple(vals), sources=tuple(srcs))

    def to_fields(self) -> dict[str, str]:
        """The Redis hash fields the agent writes (`<key>`, `<key>:source`)."""
        out = {k: _wire(v) for k, v in self.values}
        out.update({f"{k}:source": s for k, s in self.sources})
        return out

    @classmethod
    def from_fields(cls, fields: Mapping[Any, Any]) -> Attribution:
        """Back from the hash (readers); unknown fields ignored."""
        d = {_s(k): _s(v) for k, v in fields.items()}
        return cls.from_values(tuple(d.get(k) for k in FIELD_NAMES))

    @staticmethod
    def from_values(values: Sequence[Any]) -> Attribution:
        """Back from the hash's values in `FIELD_NAMES` order (an HMGET of them: None, or a
        script's false, where a field is absent). Jobs of one owner share one (a reader of
        10,000 jobs makes each distinct attribution once)."""
        return _from_values(
            tuple(v if type(v) is str else None if v is None or v is False else _s(v) for v in values)
        )

    def overlay(self, meta: Mapping[str, Any]) -> dict[str, Any]:
        """The job's meta as readers show it: its data keys, with the owner and place keys the
        operator's (a trainer's value for them is dropped)."""
        out = {k: v for k, v in meta.items() if k not in GRANTABLE and k != "node_pool"}
        out.update({k: v for k, v in self.values if k != PRICE_KEY})
        return out

    def report(self) -> dict[str, AttributionField]:
        """`{key: {value, source}}`: the API's and the exports' `attribution`."""
        return {k: {"value": v, "source": self.source(k)} for k, v in self.values}


# Every field an attribution is stored in: each key's value, then where it came from.
FIELD_NAMES = tuple(f"{k}{s}" for k in FIELDS for s in ("", ":source"))


@functools.lru_cache(maxsize=4096)
def _from_values(values: tuple[str | None, ...]) -> Attribution:
    vals: list[tuple[str, str | float]] = []
    srcs: list[tuple[str, str]] = []
    for i, k in enumerate(FIELDS):
        v: str | float | None = values[2 * i]
        if v is None:
            continue
        if k in _NUMBERS:
            v = _number(v)
            if v is None:
                continue
        vals.append((k, v))
        source = values[2 * i + 1]
        if source is not None:
            srcs.append((k, source))
    return Attribution(tuple(vals), tuple(srcs))


def _s(v: Any) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def _wire(v: str | float) -> str:
    return repr(v) if isinstance(v, float) else v


def _number(v: object) -> float | None:
    return bounded_number(v, 0, 1e12)


def _text(v: object) -> str | None:
    if isinstance(v, str) and v and len(v) <= _MAX_TEXT:
        return v
    return None


def _value(key: str, v: object) -> str | float | None:
    """A usable value of an attribution key, or None."""
    if key == SUBMITTED_KEY:
        return _time(v)
    return _number(v) if key in _NUMBERS else _text(v)


def _time(v: object) -> float | None:
    """A submission time: Unix seconds, or RFC 3339 text (a launcher's `date -Is`)."""
    if isinstance(v, str):
        try:
            v = parse_instant(v)  # Unix seconds as text too
        except ValueError:
            return None
    return bounded_number(v, 0, 1e11, above=True)


def parse_owner(raw: object) -> tuple[tuple[str, str | float], ...]:
    """A policy rule's `owner:` mapping (team, cost_center, budget); ValueError if unusable."""
    if raw is None:
        return ()
    if not isinstance(raw, Mapping) or not raw:
        raise ValueError("owner must be a mapping of team, cost_center, budget")
    out = []
    for k, v in raw.items():
        if k not in OWNER_KEYS:
            raise ValueError(f"owner: unknown key {k!r} (known: {', '.join(OWNER_KEYS)})")
        val = _value(k, v)
        if val is None:
            want = "a number >= 0" if k == "budget" else "a non-empty string"
            raise ValueError(f"owner: {k} must be {want}, got {v!r}")
        out.append((str(k), val))
    return tuple(out)


def parse_grants(raw: object) -> tuple[str, ...]:
    """A policy rule's `grant_meta:` list; ValueError if unusable."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or not raw or not all(isinstance(k, str) for k in raw):
        raise ValueError(f"grant_meta must be a list of meta keys ({', '.join(GRANTABLE)})")
    bad = [k for k in raw if k not in GRANTABLE]
    if bad:
        raise ValueError(
            f"grant_meta: {', '.join(bad)} cannot be granted (grantable: {', '.join(GRANTABLE)})"
        )
    return tuple(dict.fromkeys(raw))


def attribute(
    meta: Mapping[str, Any],
    facts: Facts | None,
    *,
    owner: tuple[str, Mapping[str, str | float]] | None = None,
    grants: tuple[str, tuple[str, ...]] | None = None,
    price: tuple[str, float | None] | None = None,
    cluster: str | None = None,
) -> tuple[Attribution, tuple[str, ...]]:
    """The job's attribution and the meta keys ignored. Each of `owner`, `grants`, `price` is
    (the rule that gave it, what it gives). Per key, the first that has a value of: the policy
    rule's owner or price, the policy's cluster, what the Kubernetes path read (`facts`), the
    trainer's meta where granted. The price table prices the rest (`pricing`)."""
    granted = set(grants[1]) if grants else set()
    grant_src = f"meta, granted by {grants[0]}" if grants else ""
    vals: list[tuple[str, str | float]] = []
    srcs: list[tuple[str, str]] = []
    fact_of = {
        "team": facts.team if facts else None,
        "namespace": facts.namespace if facts else None,
        "controller": facts.controller if facts else None,
        "controller_kind": facts.controller_kind if facts else None,
        SUBMITTED_KEY: facts.submitted_at if facts else None,
    }
    for key in (*OWNER_KEYS, *PLACE_KEYS, SUBMITTED_KEY):
        candidates: list[tuple[object, str]] = []
        if owner is not None and key in owner[1]:
            candidates.append((owner[1][key], owner[0]))
        if key == "cluster" and cluster is not None:
            candidates.append((cluster, "policy cluster"))
        if key in granted:
            candidates.append((meta.get(key), grant_src))
        if fact_of.get(key) is not None:
            candidates.append((fact_of[key], "kubernetes"))
        for v, src in candidates:
            val = _value(key, v)
            if val is not None:
                vals.append((key, val))
                srcs.append((key, src))
                break
    granted_price = None
    if price is not None and price[1] is not None:
        granted_price = price[1]
        srcs.append((PRICE_KEY, price[0]))
    elif PRICE_KEY in granted and _number(meta.get(PRICE_KEY)) is not None:
        granted_price = _number(meta.get(PRICE_KEY))
        srcs.append((PRICE_KEY, grant_src))
    ignored = tuple(k for k in GRANTABLE if k in meta and k not in granted)
    return Attribution(tuple(vals), tuple(srcs), granted_price), ignored
