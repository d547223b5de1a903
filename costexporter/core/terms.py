"""A job's terms: when its booking starts, the thresholds it is booked and judged by, its prices,
its profile. One function (`job_terms`) makes them from the job's meta, its registrations, the
operator's flags and policy and the GPUs; the agent, the watcher and replay all call it, so the
ledger and the watcher's judgement of one job cannot disagree on its terms.

Where each term comes from (docs/terms.md):

* the thresholds that move GPU time between valid, overhead and wasted (`stall_floor_s`,
  `stall_k`, the phases' allowances, ...) are the operator's: the flags, or the first rule of the
  operator's policy file that matches the job's name or team. A trainer's meta event that sets one
  is ignored (and said: `JobTerms.ignored_meta`), since a trainer could otherwise declare its own
  waste away. The allowance learned from the job's own phases still applies (`core/booking`);
* the liveness cadence (`heartbeat_timeout_s`, `heartbeat_interval_s`) may come from the job's
  meta: a job of 5-minute steps beats at its own pace. Its `heartbeat_timeout_s` also lengthens
  the booking's liveness timeout (where a crashed run's claim on its GPUs ends), up to the
  operator's longest, never shortening it (`liveness`);
* the GPU-hour price is the job's meta `price_per_gpu_hour` where it sets one, else the flag's;
* the profile is resolved by `core/profiles` and carried here as given.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from costexporter.core import jobfacts
from costexporter.core.booking import BookingConfig
from costexporter.core.cost import Prices
from costexporter.core.events import POLICY_THRESHOLDS
from costexporter.core.profiles import Profile

_MAX_SECONDS = 1e9


class PolicyError(ValueError):
    """An operator policy that cannot be used (one line: what and where)."""


def _seconds(value: object) -> float | None:
    """A positive finite threshold from an untrusted value, or None."""
    if isinstance(value, bool):
        return None
    try:
        v = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) and 0 < v < _MAX_SECONDS else None


@dataclass(frozen=True, slots=True)
class PolicyRule:
    """Booking thresholds for the jobs whose name matches `job` (a shell pattern) and whose team
    is `team` (either may be None: any). `thresholds`: (name, value) pairs of POLICY_THRESHOLDS."""

    thresholds: tuple[tuple[str, float], ...]
    job: str | None = None
    team: str | None = None

    def matches(self, job: str, team: str | None) -> bool:
        if self.team is not None and self.team != team:
            return False
        return self.job is None or fnmatch.fnmatchcase(job, self.job)


@dataclass(frozen=True, slots=True)
class Policy:
    """The operator's terms: the flags' booking thresholds and prices, and the policy file's rules
    (the first rule that matches a job gives its thresholds over the flags')."""

    booking: BookingConfig = field(default_factory=BookingConfig)
    prices: Prices = field(default_factory=Prices)
    rules: tuple[PolicyRule, ...] = ()

    def booking_for(self, job: str, team: str | None = None) -> BookingConfig:
        for rule in self.rules:
            if rule.matches(job, team):
                return self._with(rule)
        return self.booking

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


def parse_policy(doc: object, where: str = "the policy") -> tuple[PolicyRule, ...]:
    """The rules of an operator's policy document (parsed YAML or JSON):

        rules:
          - job: "llm-*"          # a shell pattern of job names (optional)
            team: research        # the job's meta team (optional)
            stall_floor_s: 600
            checkpoint_allowance_s: 1800

    PolicyError (one line) for anything else: the policy fails closed."""
    if not isinstance(doc, Mapping) or set(doc) - {"rules"}:
        raise PolicyError(f"{where}: expected a mapping with one key, 'rules'")
    raw_rules = doc.get("rules") or []
    if not isinstance(raw_rules, list):
        raise PolicyError(f"{where}: 'rules' must be a list")
    rules = []
    for i, raw in enumerate(raw_rules):
        if not isinstance(raw, Mapping):
            raise PolicyError(f"{where}: rule {i + 1} is not a mapping")
        job, team = raw.get("job"), raw.get("team")
        for name, v in (("job", job), ("team", team)):
            if v is not None and not (isinstance(v, str) and v):
                raise PolicyError(f"{where}: rule {i + 1}: {name} must be a non-empty string")
        unknown = set(raw) - {"job", "team", *POLICY_THRESHOLDS}
        if unknown:
            raise PolicyError(
                f"{where}: rule {i + 1}: unknown key(s) {', '.join(sorted(map(str, unknown)))} "
                f"(known: job, team, {', '.join(POLICY_THRESHOLDS)})"
            )
        thresholds = []
        for name in POLICY_THRESHOLDS:
            if name in raw:
                v = _seconds(raw[name])
                if v is None:
                    raise PolicyError(
                        f"{where}: rule {i + 1}: {name} must be a number > 0, got {raw[name]!r}"
                    )
                thresholds.append((name, v))
        if not thresholds:
            raise PolicyError(f"{where}: rule {i + 1} sets no threshold")
        rules.append(PolicyRule(tuple(thresholds), job, team))
    return tuple(rules)


@dataclass(frozen=True, slots=True)
class JobTerms:
    """What one job is booked and judged by (`job_terms`)."""

    start_ms: int
    booking: BookingConfig
    prices: Prices  # `price_per_gpu_hour`: the job's own
    heartbeat_timeout_s: float | None = None  # from the job's meta; None: the watcher's own
    heartbeat_interval_s: float | None = None
    profile: Profile | None = None  # as `core/profiles` resolved it (None: not resolved here)
    # Meta keys the job set that are the operator's to set (POLICY_THRESHOLDS): ignored.
    ignored_meta: tuple[str, ...] = ()
    # The one line saying the job's meta price overrides the flag's (None: the flag's is used).
    price_note: str | None = None


def job_price(job: str, meta: Mapping[str, Any], prices: Prices) -> tuple[Prices, str | None]:
    """The job's prices: its meta `price_per_gpu_hour` wins over the flag's where it sets a usable
    one (a price of 0 or none at all: the flag's), with the line that says so."""
    meta_price = meta.get("price_per_gpu_hour")
    if isinstance(meta_price, bool):
        return prices, None
    try:
        price = float(meta_price or 0)
    except (TypeError, ValueError):
        return prices, None
    if not (math.isfinite(price) and price > 0) or price == prices.price_per_gpu_hour:
        return prices, None
    note = (
        f"job {job}: its meta sets price_per_gpu_hour={meta_price}, which overrides "
        f"--price-per-gpu-hour {prices.price_per_gpu_hour:g}"
    )
    return dataclasses.replace(prices, price_per_gpu_hour=price), note


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
) -> JobTerms:
    """The job's terms. The start follows `jobfacts.job_start_ms` (ValueError when nothing dates
    it); the rest is described in this module's docstring."""
    start = jobfacts.job_start_ms(
        registered_ms,
        first_event_ms=first_event_ms,
        own_start_ms=own_start_ms,
        stored_start_ms=stored_start_ms,
    )
    team = meta.get("team")
    booking = liveness(policy.booking_for(job, team if isinstance(team, str) else None), meta)
    prices, note = job_price(job, meta, policy.prices)
    return JobTerms(
        start_ms=start,
        booking=booking,
        prices=prices,
        heartbeat_timeout_s=_seconds(meta.get("heartbeat_timeout_s")),
        heartbeat_interval_s=_seconds(meta.get("heartbeat_interval_s")),
        profile=profile,
        ignored_meta=tuple(k for k in POLICY_THRESHOLDS if k in meta),
        price_note=note,
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
    """The one line saying a job's meta tried to set operator thresholds."""
    return (
        f"job {job}: its meta sets {', '.join(keys)}, which only the operator sets (flags or "
        "--policy): ignored, the operator's thresholds apply"
    )
