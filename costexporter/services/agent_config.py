"""The agent's configuration (`costexporter serve`'s options, as the agent reads them)."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path

from costexporter.core.booking import BookingConfig
from costexporter.core.carbon import GridIntensity
from costexporter.core.cost import Prices
from costexporter.core.pricing import Pricing
from costexporter.core.profiles import Profile
from costexporter.core.terms import Policy, PolicyRule
from costexporter.store import protocol


@dataclass
class AgentConfig:
    redis_url: str = protocol.DEFAULT_REDIS_URL
    prefix: str = protocol.DEFAULT_PREFIX
    agent_id: str = field(default_factory=socket.gethostname)
    host: str | None = None  # defaults to the source's host
    booking: BookingConfig = field(default_factory=BookingConfig)
    prices: Prices = field(default_factory=Prices)
    book_interval_s: float = 5.0
    sample_interval_s: float = 1.0
    context_s: float | None = None  # history kept for bands: default 2 x checkpoint allowance
    # Discovery runs when the trainers' registrations counter moves (one GET a round) and, as a
    # safety net for writers that do not move it, every `job_refresh_s`: keep it below
    # `unassigned_hold_s` so such a job's GPU time still reaches it.
    job_refresh_s: float = 300.0
    live_ttl_s: int = 30
    max_buffered_samples: int = 2_000_000
    series_ttl_s: float = 3600.0  # an ended job's series disappear from /metrics this long after
    # How long another agent of a job may stay silent before its ranks stop holding the booking
    # horizon back (default: max(6 rounds, 30 s)). Too short books moments without its samples,
    # and booked time is never re-booked; too long only delays booking.
    peer_timeout_s: float | None = None
    profile: Profile | None = None
    profile_dir: Path | None = None  # fitted profiles, matched by GPU model (profiles.find)
    gpu_model: str | None = None
    power_limit_w: float | None = None
    # Time of GPUs no job holds is booked `unassigned` only this long after it was sampled: a
    # register that arrives later than this (a trainer cut off from Redis at its start) gets
    # its GPU's time from then on; the time before stays `unassigned` (booked once either way).
    unassigned_hold_s: float = 600.0
    clock_skew_warn_s: float = 10.0  # event timestamps this far off their arrival: a warning
    # Book no closer to the newest sample than this: events that arrive up to this late are
    # booked as if on time (a startup or phase allowance is decided at once otherwise).
    event_lag_s: float = 0.0
    # Learn each GPU's idle power from its readings at 0% (idle.py) and derive a derived
    # profile's low edges from it; None: for sources that read GPUs now (NVML, dcgm-exporter),
    # not for a replayed trace (its bill must equal the offline replay's).
    learn_idle: bool | None = None
    # Events are folded into a job's timeline for good this far behind the newest data time; one
    # that arrives later than that (older than the fold) makes the agent rebuild the job's
    # timeline from its stream once (counted in `timeline_rebuilds`).
    fold_lag_s: float = 120.0
    # The fold is stored with the watermark (same MULTI) at most this often, so a restarted agent
    # resumes from it and reads only the stream since (a restart's catch-up is linear in that
    # backlog); 0: every commit, None: never (a restart folds the whole stream again).
    fold_persist_s: float | None = 60.0
    # Trim each job's event stream below the oldest position of its readers (agents' stored
    # folds, watchers) after a committed round; a reader silent this long no longer pins it.
    trim_streams: bool = True
    reader_stale_s: float = 86400.0
    # Events up to this late (behind the newest) are still folded in exactly after trimming: a
    # second stored fold is kept 1-2 x this far behind, and the stream from its position on.
    # Keep it under half of `reader_stale_s`.
    late_keep_s: float = 3600.0
    # The operator's policy file (`terms.parse_policy_file`): its rules (thresholds, owners and
    # prices by job name or namespace) and its price table.
    policy_rules: tuple[PolicyRule, ...] = ()
    pricing: Pricing = field(default_factory=Pricing)
    # Its grid carbon intensity (`core/carbon.py`): each round's energy is counted in kgCO2e too.
    carbon: GridIntensity | None = None

    def policy(self) -> Policy:
        """The operator's terms: the flags' thresholds and prices, the policy file's."""
        return Policy(self.booking, self.prices, self.policy_rules, self.pricing)


def samples_maxlen(cfg: AgentConfig) -> int:
    """Entries a host's sample stream keeps (one per round): the booking context, what an agent
    that starts on a running job reads to learn a signature run already under way (31 minutes
    by default)."""
    context_s = cfg.context_s or 2 * cfg.policy().widest_checkpoint_allowance_s() + 60
    return max(64, int(context_s / max(cfg.book_interval_s, 0.01)) + 8)
