"""A job's terms: when its booking starts, the thresholds it is booked and judged by, its prices,
its profile. One function (`job_terms`) makes them from the job's meta, its registrations, the
operator's flags and policy and the GPUs; the agent, the watcher and replay all call it, so the
ledger and the watcher's judgement of one job cannot disagree on its terms.

Where each term comes from (docs/terms.md):

* the thresholds that move GPU time between valid, overhead and wasted (`stall_floor_s`,
  `stall_k`, the phases' allowances, ...) are the operator's: the flags, or the first rule of the
  operator's policy file that matches the job (by its name or Kubernetes namespace) and sets
  them. A trainer's meta event that sets one is ignored (and said: `JobTerms.ignored_meta`),
  since a trainer could otherwise declare its own waste away. The allowance learned from the
  job's own phases still applies (`core/booking`);
* the liveness cadence (`heartbeat_timeout_s`, `heartbeat_interval_s`) may come from the job's
  meta: a job of 5-minute steps beats at its own pace. Its `heartbeat_timeout_s` also lengthens
  the booking's liveness timeout (where a crashed run's claim on its GPUs ends), up to the
  operator's longest, never shortening it (`liveness`);
* the price, the owner (team, cost centre, budget) and the place (cluster, namespace, controller
  kind) are the operator's (`core/attribution`, `core/pricing`): a policy rule, the policy's
  price table by GPU model and node pool from effective dates, the flags; a trainer's meta value
  counts only where a rule grants it, else it is ignored and said like a threshold;
* the profile is resolved by `core/profiles` and carried here as given.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import fnmatch
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from costexporter.core import jobfacts
from costexporter.core.attribution import (
    GRANTABLE,
    Attribution,
    Facts,
    attribute,
    parse_grants,
    parse_owner,
)
from costexporter.core.booking import BookingConfig
from costexporter.core.budgets import Budget, BudgetError, parse_budgets
from costexporter.core.carbon import GridIntensity, IntensityError, parse_policy_intensity
from costexporter.core.causes import CAUSES, UNKNOWN
from costexporter.core.cost import Prices
from costexporter.core.events import POLICY_THRESHOLDS, bounded_number
from costexporter.core.pricing import PriceSchedule, Pricing, PricingError, parse_pricing, price_value
from costexporter.core.profiles import Profile
from costexporter.core.timeutil import parse_instant

_MAX_SECONDS = 1e9


class PolicyError(ValueError):
    """An operator policy that cannot be used (one line: what and where)."""


def _seconds(value: object) -> float | None:
    """A positive finite threshold from an untrusted value, or None."""
    return bounded_number(value, 0, _MAX_SECONDS, above=True)


@dataclass(frozen=True, slots=True)
class PolicyRule:
    """One rule of the operator's policy: for the jobs whose name matches `job` and whose
    Kubernetes namespace (as the agent read it from the cluster) matches `namespace` (shell
    patterns; None: any), the booking `thresholds` ((name, value) pairs of POLICY_THRESHOLDS),
    the `owner` (team, cost_center, budget), a GPU-hour `price` over the price table's, and the
    meta keys the operator `grants` the trainer (`attribution.GRANTABLE`). Never matched on a
    trainer's own meta."""

    thresholds: tuple[tuple[str, float], ...] = ()
    job: str | None = None
    namespace: str | None = None
    owner: tuple[tuple[str, str | float], ...] = ()
    price: float | None = None
    grants: tuple[str, ...] = ()
    controller: str | None = None  # the pod's controlling owner, as the agent read it

    def matches(self, job: str, facts: Facts | None = None) -> bool:
        for pattern, value in (
            (self.namespace, facts.namespace if facts is not None else None),
            (self.controller, facts.controller if facts is not None else None),
        ):
            if pattern is not None and (value is None or not fnmatch.fnmatchcase(value, pattern)):
                return False
        return self.job is None or fnmatch.fnmatchcase(job, self.job)


@dataclass(frozen=True, slots=True)
class Policy:
    """The operator's terms: the flags' booking thresholds and prices, the policy file's rules
    (each term from the first rule that matches a job and sets it) and its price table."""

    booking: BookingConfig = field(default_factory=BookingConfig)
    prices: Prices = field(default_factory=Prices)
    rules: tuple[PolicyRule, ...] = ()
    pricing: Pricing = field(default_factory=Pricing)

    def first(self, job: str, facts: Facts | None, has: str) -> tuple[int, PolicyRule] | None:
        """(number from 1, rule): the first rule matching the job that sets `has`."""
        for i, rule in enumerate(self.rules, 1):
            if getattr(rule, has) not in ((), None) and rule.matches(job, facts):
                return i, rule
        return None

    def booking_for(self, job: str, facts: Facts | None = None) -> BookingConfig:
        hit = self.first(job, facts, "thresholds")
        return self.booking if hit is None else self._with(hit[1])

    def _with(self, rule: PolicyRule) -> BookingConfig:
        kw: dict[str, Any] = dict(rule.thresholds)
        return dataclasses.replace(self.booking, **kw)

    def bookings(self) -> list[BookingConfig]:
        """Every booking configuration the policy can give a job (the flags' first)."""
        out = [self.booking]
        for rule in self.rules:
            b = self._with(rule)
            if b not in out:
                out.append(b)
        return out

    def widest_checkpoint_allowance_s(self) -> float:
        """The longest checkpoint allowance any job may get (how much context the agent keeps)."""
        rules = (dict(r.thresholds).get("checkpoint_allowance_s", 0.0) for r in self.rules)
        return max([self.booking.checkpoint_allowance_s, *rules])

    def attribution(
        self, job: str, meta: Mapping[str, Any], facts: Facts | None = None
    ) -> tuple[Attribution, tuple[str, ...]]:
        """The job's owner, place and price source (`attribution.attribute`), and the meta keys
        it ignored."""
        owner = self.first(job, facts, "owner")
        grant = self.first(job, facts, "grants")
        price = self.first(job, facts, "price")
        return attribute(
            meta,
            facts,
            owner=None if owner is None else (f"policy rule {owner[0]}", dict(owner[1].owner)),
            grants=None if grant is None else (f"policy rule {grant[0]}", grant[1].grants),
            price=None if price is None else (f"policy rule {price[0]}", price[1].price),
            cluster=self.pricing.cluster,
        )


RULE_KEYS = ("job", "namespace", "controller", "owner", "price_per_gpu_hour", "grant_meta")
POLICY_KEYS = ("rules", "prices", "node_pools", "cluster", "carbon_intensity", "budgets", "credit_causes")


def parse_policy(doc: object, where: str = "the policy") -> tuple[PolicyRule, ...]:
    """The rules of an operator's policy document (`parse_policy_file` for the whole file)."""
    return parse_policy_file(doc, where).rules


@dataclass(frozen=True, slots=True)
class PolicyFile:
    """An operator's policy file: its rules and its price side."""

    rules: tuple[PolicyRule, ...] = ()
    pricing: Pricing = field(default_factory=Pricing)
    carbon: GridIntensity | None = None  # the grid's intensity (`core/carbon.py`); None: not given
    budgets: tuple[Budget, ...] = ()  # the API's budgets (`core/budgets.py`)
    # The causes of wasted time the platform credits back (`core/causes.py`): the API's credit
    # line of a job's incidents. Empty: no credit line.
    credit_causes: tuple[str, ...] = ()


def parse_policy_file(
    doc: object, where: str = "the policy", read: Callable[[str], str] | None = None
) -> PolicyFile:
    """An operator's policy document (parsed YAML or JSON), docs/terms.md:

        cluster: prod-east
        node_pools: {spot: "gpu-spot-*"}        # pool: host pattern
        prices:                                  # first matching row of the latest date wins
          - {gpu_model: "*H100*", price_per_gpu_hour: 2.9}
          - {gpu_model: "*H100*", node_pool: spot, price_per_gpu_hour: 1.4, from: 2026-11-01}
        rules:
          - job: "llm/*"          # a shell pattern of job names (a team's ACL scope: <team>/*)
            namespace: "ml-*"     # the Kubernetes namespace the agent read (optional)
            controller: "llama-*" # the pod's controlling owner the agent read (optional)
            owner: {team: llm, cost_center: cc-42, budget: 2000}
            price_per_gpu_hour: 4.1
            grant_meta: [cost_center]
            stall_floor_s: 600
        carbon_intensity: 390                    # gCO2e/kWh, or {file: grid.csv} (hourly rows)
        budgets:                                 # the API's (GET /api/v1/budgets)
          - {name: llm-monthly, team: llm, amount: 50000, period: month}
        credit_causes: [hardware, network]      # wasted time the platform credits back

    `read` reads a file the policy names (the carbon intensity series). PolicyError (one line)
    for anything else: the policy fails closed."""
    if not isinstance(doc, Mapping) or set(doc) - set(POLICY_KEYS):
        raise PolicyError(f"{where}: expected a mapping with the keys {', '.join(POLICY_KEYS)}")
    try:
        price_side = parse_pricing(doc, where, lambda t: parse_instant(t, dt.timezone.utc))
    except PricingError as e:
        raise PolicyError(str(e)) from None
    raw_rules = doc.get("rules") or []
    if not isinstance(raw_rules, list):
        raise PolicyError(f"{where}: 'rules' must be a list")
    intensity = None
    if doc.get("carbon_intensity") is not None:
        try:
            intensity = parse_policy_intensity(doc["carbon_intensity"], where, read)
        except IntensityError as e:
            raise PolicyError(str(e)) from None
    try:
        budgets = parse_budgets(doc.get("budgets"), where)
    except BudgetError as e:
        raise PolicyError(str(e)) from None
    credit = doc.get("credit_causes") or []
    credited = set(CAUSES) - {UNKNOWN}
    if not isinstance(credit, list) or not all(isinstance(c, str) and c in credited for c in credit):
        raise PolicyError(f"{where}: credit_causes must be a list of {', '.join(sorted(credited))}")
    return PolicyFile(
        tuple(_rule(raw, f"{where}: rule {i + 1}") for i, raw in enumerate(raw_rules)),
        price_side,
        intensity,
        budgets,
        tuple(dict.fromkeys(credit)),
    )


def _rule(raw: object, at: str) -> PolicyRule:
    if not isinstance(raw, Mapping):
        raise PolicyError(f"{at} is not a mapping")
    if "team" in raw:
        raise PolicyError(
            f"{at}: 'team' no longer matches (a trainer writes its own meta team); match on job or "
            "namespace, and give the job its team with owner: {team: ...}"
        )
    for name in ("job", "namespace", "controller"):
        v = raw.get(name)
        if v is not None and not (isinstance(v, str) and v):
            raise PolicyError(f"{at}: {name} must be a non-empty string")
    unknown = set(raw) - {*RULE_KEYS, *POLICY_THRESHOLDS}
    if unknown:
        raise PolicyError(
            f"{at}: unknown key(s) {', '.join(sorted(map(str, unknown)))} "
            f"(known: {', '.join(RULE_KEYS)}, {', '.join(POLICY_THRESHOLDS)})"
        )
    thresholds = []
    for name in POLICY_THRESHOLDS:
        if name in raw:
            v = _seconds(raw[name])
            if v is None:
                raise PolicyError(f"{at}: {name} must be a number > 0, got {raw[name]!r}")
            thresholds.append((name, v))
    try:
        owner = parse_owner(raw.get("owner"))
        grants = parse_grants(raw.get("grant_meta"))
    except ValueError as e:
        raise PolicyError(f"{at}: {e}") from None
    price = None
    if raw.get("price_per_gpu_hour") is not None:
        price = price_value(raw["price_per_gpu_hour"])
        if price is None:
            raise PolicyError(
                f"{at}: price_per_gpu_hour must be a number >= 0, got {raw['price_per_gpu_hour']!r}"
            )
    if not (thresholds or owner or grants or price is not None):
        raise PolicyError(f"{at} sets nothing (a threshold, owner, price_per_gpu_hour or grant_meta)")
    return PolicyRule(
        tuple(thresholds), raw.get("job"), raw.get("namespace"), owner, price, grants, raw.get("controller")
    )


@dataclass(frozen=True, slots=True)
class JobTerms:
    """What one job is booked and judged by (`job_terms`)."""

    start_ms: int
    booking: BookingConfig
    prices: Prices  # the job's prices now (the schedule's latest)
    heartbeat_timeout_s: float | None = None  # from the job's meta; None: the watcher's own
    heartbeat_interval_s: float | None = None
    profile: Profile | None = None  # as `core/profiles` resolved it (None: not resolved here)
    # Meta keys the job set that only the operator sets (POLICY_THRESHOLDS, and the owner and
    # price keys the policy does not grant): ignored.
    ignored_meta: tuple[str, ...] = ()
    attribution: Attribution = field(default_factory=Attribution)
    # The job's prices over time on the GPUs priced here (`pricing.PriceSchedule`).
    schedule: PriceSchedule | None = None


def job_terms(
    job: str,
    meta: Mapping[str, Any],
    policy: Policy,
    registered_ms: Iterable[int] = (),
    *,
    first_event_ms: int | None = None,
    own_start_ms: int | None = None,
    stored_start_ms: int | None = None,
    profile: Profile | None = None,
    facts: Facts | None = None,
    gpu_model: str | None = None,
    host: str | None = None,
) -> JobTerms:
    """The job's terms. The start follows `jobfacts.job_start_ms` (ValueError when nothing dates
    it); the rest is described in this module's docstring. `facts`: what the operator's side
    read of the job (Kubernetes); `gpu_model`, `host`: the GPUs priced (the price table's keys)."""
    start = jobfacts.job_start_ms(
        registered_ms,
        first_event_ms=first_event_ms,
        own_start_ms=own_start_ms,
        stored_start_ms=stored_start_ms,
    )
    booking = liveness(policy.booking_for(job, facts), meta)
    attr, ignored = policy.attribution(job, meta, facts)
    schedule = policy.pricing.schedule(policy.prices, gpu_model, host, attr.granted_price)
    attr = attr.priced(schedule, policy.pricing.pool_of(host))
    return JobTerms(
        start_ms=start,
        booking=booking,
        prices=schedule.latest,
        heartbeat_timeout_s=_seconds(meta.get("heartbeat_timeout_s")),
        heartbeat_interval_s=_seconds(meta.get("heartbeat_interval_s")),
        profile=profile,
        ignored_meta=(*(k for k in POLICY_THRESHOLDS if k in meta), *ignored),
        attribution=attr,
        schedule=schedule,
    )


def liveness(booking: BookingConfig, meta: Mapping[str, Any]) -> BookingConfig:
    """The job's liveness timeout: the operator's, lengthened by the job's meta
    `heartbeat_timeout_s` (a job of 5-minute steps beats at its own pace) up to the operator's
    longest (`liveness_timeout_max_s`); never shortened by it, since a shorter one would end the
    job's claim (and its bill) sooner."""
    asked = _seconds(meta.get("heartbeat_timeout_s"))
    timeout = booking.liveness_timeout_s
    if asked is not None:
        timeout = max(timeout, min(asked, booking.liveness_timeout_max_s))
    if timeout == booking.liveness_timeout_s:
        return booking
    return dataclasses.replace(booking, liveness_timeout_s=timeout)


def ignored_meta_note(job: str, keys: Iterable[str]) -> str:
    """The one line saying a job's meta tried to set what only the operator sets; for a price,
    owner or place, it names the policy key that trusts it again."""
    keys = list(keys)
    line = (
        f"job {job}: its meta sets {', '.join(keys)}, which only the operator sets (flags or "
        "--policy): ignored"
    )
    granted = [k for k in keys if k in GRANTABLE]
    if granted:
        line += (
            f"; to trust the trainer's value again, a --policy rule matching the job grants it: "
            f"grant_meta: [{', '.join(granted)}]"
        )
    return line
