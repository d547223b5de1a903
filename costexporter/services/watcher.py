"""The watcher behind `costexporter watch`: each job's state, decided from outside the job.

R3 (docs/background.md): a watcher on another machine, so it does not hang with the job, tells done from
crashed from hung. It reads only Redis: the trainers' events (progress, phases), their heartbeats
(`<p>:t:{job}:beats`, one stream a job that only watchers read; an older trainer's heartbeats
come in its events and count the same) and the agents' live GPU state
(`<p>:a:{job}:live:<host>`). Each poll it decides, per job, the first state that applies:

* `unknown`: it cannot observe (Redis unreachable, no events). A blind watcher never says healthy.
* `done`: the run ended (`run end` on rank 0).
* `crashed`: a rank's heartbeats are gone (no event for `heartbeat_timeout_s`) and no end.
* `hung`: an agent banded a rank's newest sample after the last step `deadlock` (the spin on any
  number of GPUs or the cross-rank signature, confirmed by the agent on two samples): seen one
  agent round after it shows; or progress stopped by the ledger's own rule (no step for longer
  than the stall threshold of the booking rules, with the same parameters, or a declared phase
  past its allowance), or the deadlock signature on two consecutive samples of the live GPU state.
* `starving`: the live GPU state shows data starvation; the straggler is named.
* `running`: none of the above.

It names a suspect: the rank (host, GPU) at 0% in the signature, else the rank whose events
diverge from the others' (the one rank inside a phase, or that ended, or whose last step
differs). Each job's status is written to `<p>:w:{job}:status` with a TTL, so a watcher that
stops leaves `unknown` behind rather than a stale `running`. Transitions are POSTed to an
optional webhook as Alertmanager-style payloads, with retries, off the polling thread; the
alerting states can also go to Alertmanager's own API (costexporter/services/alertmanager.py).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import math
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from costexporter.core import bands as bands_mod
from costexporter.core import jobfacts, profiles
from costexporter.core.booking import (
    NEG_INF,
    BookingConfig,
    Regime,
    StepRecord,
    Timeline,
    build_timeline,
    is_point,
)
from costexporter.core.cost import Prices
from costexporter.core.fold import TimelineFold, walk_relevant
from costexporter.core.model import Band, Event
from costexporter.core.profiles import Profile
from costexporter.core.terms import JobTerms, Policy, PolicyRule, ignored_meta_note, job_terms
from costexporter.core.timeutil import iso_utc, to_ms
from costexporter.services.alertmanager import Alertmanager
from costexporter.services.notify import ALERTING, RUNBOOKS, Status, Webhook, alertname, runbook_url
from costexporter.services.snapshots import WatcherSnapshot
from costexporter.store import keys, ledger, protocol, redisconn, untrusted
from costexporter.store.jobindex import JobIndex
from costexporter.store.reader import EventReader, read_ahead, read_all_many
from costexporter.store.redisconn import SentXread

log = logging.getLogger("costexporter.watcher")
JOBS_PER_READ = 100  # a poll reads the jobs' new events 100 jobs per XREAD

LIVE_HISTORY = 12  # live snapshots kept per job for the two-sample signature
NO_AGENT_DATA = "no agent data: cannot name a rank"
# What one poisoned job (a bad name, stored values of the wrong type) raises: it is set aside.
SETTLED_MARGIN_MS = 1_000  # `JobView.settled_ms`: events of a rank may be this much out of order
JUDGE_ERRORS = (ValueError, TypeError, KeyError, AttributeError, IndexError, OverflowError)


@dataclass
class WatchConfig:
    redis_url: str = protocol.DEFAULT_REDIS_URL
    prefix: str = protocol.DEFAULT_PREFIX
    booking: BookingConfig = field(default_factory=BookingConfig)
    poll_s: float = 5.0
    # No event (heartbeats included; the reporter sends one every 10 s) for this long: the
    # rank's process is gone.
    heartbeat_timeout_s: float = 60.0
    # The trainers' heartbeat: a rank is named as the one that died first only when its silence
    # started more than two of these before the others' (else they stopped together).
    heartbeat_interval_s: float = 10.0
    status_ttl_s: float | None = None  # default max(60 s, 6 polls)
    forget_after_s: float = 86_400.0  # jobs not seen for this long are no longer watched
    # A job judged `done` is not read again while its jobs index score stays, until this long
    # has passed (each job at its own point of the second half of it), when its streams' newest
    # ids are looked at: what bounds the wait for events posted without moving the score.
    recheck_s: float = 60.0
    jobs: tuple[str, ...] = ()  # watch only these (default: every job in `<p>:jobs`)
    # (index, count): watch only the jobs of shard `index` of `count` (`in_shard`), so that
    # `count` watchers share a fleet, each polling its part. None: every job.
    shard: tuple[int, int] | None = None
    webhook_url: str | None = None
    webhook_retries: int = 5
    webhook_timeout_s: float = 5.0
    webhook_backoff_s: float = 0.5
    # Alertmanager's base URL: the alerting states are posted to its /api/v2/alerts, resent
    # every alertmanager_resend_s while they last, resolved when they end.
    alertmanager_url: str | None = None
    # The link each posted alert carries (Alertmanager's generatorURL), `{job}` its job: a
    # dashboard or the API's job page.
    generator_url: str = ""
    alertmanager_resend_s: float = 60.0
    # The `cluster` label of the alerts posted to Alertmanager (as Prometheus's external labels
    # give the rules' alerts one), so the two paths' alerts of one job share it.
    cluster: str | None = None
    # The alerts page each alert's `runbook_url` links (`<runbooks>#<alert name in lower case>`),
    # as `costexporter rules --runbook-url` gives the rules' alerts.
    runbooks: str = RUNBOOKS
    profile: Profile | None = None
    profile_dir: Path | None = None  # fitted profiles, matched by the job's GPU model
    gpu_model: str | None = None  # the operator's model (wins over the job's meta)
    power_limit_w: float | None = None  # the operator's board power limit
    watcher_id: str = "watcher"
    # How often the watcher registers how far it has read each job's stream (`<p>:r:{job}:readers`,
    # `watcher:<watcher_id>`): the agents trim no stream below it. None: never (it pins nothing).
    register_position_s: float | None = 60.0
    clock: Callable[[], float] = time.time  # Unix seconds; the sim's clock in the demo
    # The operator's policy file's rules (`terms.parse_policy_file`): thresholds by job name or
    # Kubernetes namespace.
    policy_rules: tuple[PolicyRule, ...] = ()

    def policy(self) -> Policy:
        """The operator's terms the watcher judges by: the flags' thresholds and the policy
        file's rules (the watcher prices nothing: its prices are the defaults)."""
        return Policy(self.booking, Prices(), self.policy_rules)


@dataclass
class _Rank:
    last_seen_ms: int = 0  # newest event of any type (heartbeats included)
    last_step: int | None = None
    open_phases: dict[str, float] = field(default_factory=dict)
    ended: bool = False  # its latest run event is `end`
    # its process's crash record (`run crash`, posted as it died): (ts, how it exited, error type)
    crash: tuple[float, str, str | None] | None = None
    session: str | None = None  # the rank's newest process


# What `decide` reads for a registered rank without any event yet (read only: one instance
# instead of a new one per rank per job per poll).
_NO_EVENTS = _Rank()


@dataclass
class JobView:
    """What the watcher knows of one job: its events folded per rank, and its live GPU state."""

    name: str
    registrations: dict[int, dict[str, Any]] = field(default_factory=dict)
    ranks: dict[int, _Rank] = field(default_factory=dict)
    live: collections.deque[Any] = field(default_factory=lambda: collections.deque(maxlen=LIVE_HISTORY))
    meta: dict[str, Any] = field(default_factory=dict)
    # rank -> when (the watcher's clock) its registration was read from the ranks hash
    registrations_read: dict[int, float] = field(default_factory=dict)
    # The agents' live hashes as last read: rank -> (the agent's host, its entry: the rank's newest
    # sample and the band the agent gave it), for the ranks an agent banded.
    agent_live: dict[int, tuple[str, protocol.LiveEntry]] = field(default_factory=dict)
    # The booking timeline, folded once per event (`fold.TimelineFold`) instead of rebuilt from
    # every event each poll. It is folded again from every walk-relevant event (rank 0's steps
    # and runs, every rank's phases: no heartbeats) when an event arrives older than the fold,
    # the job's start moves or its meta changes the booking thresholds: those of `refold()`
    # (the watcher reads them from the job's stream), else the ones kept in `walk`.
    first_ms: int | None = None  # the earliest event seen
    newest_ms: int = 0
    walk: list[Event] = field(default_factory=list)
    refold: Callable[[], list[Event]] | None = None
    timeline_fold: TimelineFold | None = None
    fresh: list[Event] = field(default_factory=list)
    rebuilds: int = 0
    unfoldable: bool = False  # a fold that cannot give its view: built from every event each poll
    profile_said: bool = False  # the job's profile (or why it has none) was logged
    metas: int = 0  # meta events folded: the terms change only with them, a registration or the start
    # (the config judged by, what dates the terms, the terms, the config with them): a poll
    # derives them again only when one of their inputs changed
    _judged: tuple[WatchConfig, tuple[int | None, int, int], JobTerms, WatchConfig] | None = None

    def timeline(self, booking: BookingConfig, start_ms: int, now_ms: int, lag_ms: int = 120_000) -> Timeline:
        """`build_timeline` over every event of the job at `now_ms`, from the fold."""
        end_ms = max(now_ms, start_ms + 1)
        f = self.timeline_fold
        rank0_ms, others_ms = self.settled_ms()
        frontier = min(end_ms, max(self.newest_ms - lag_ms, rank0_ms))
        others = min(end_ms, max(self.newest_ms - lag_ms, others_ms))

        def view(f: TimelineFold) -> Timeline | None:
            if not f.late:  # walk for good what is settled first: the view walks only the rest
                f.advance(frontier, frontier, others_ms=others)
            return f.timeline(end_ms)

        if f is not None and f.start_ms == start_ms and f.cfg == booking:
            f.add(self.fresh)
            self.fresh = []
            tl = view(f)
        else:
            tl = None
        if tl is None:
            if f is not None or self.unfoldable:
                self.rebuilds += 1
            if self.refold is None:
                walk = self.walk
            elif f is None and not self.unfoldable:
                walk = self.fresh  # the first fold: every event read so far is fresh
            else:
                walk = self.refold()
            f = self.timeline_fold = TimelineFold(booking, start_ms)
            f.add(walk)
            self.fresh = []
            tl = view(f)
            if tl is None:  # not foldable (never expected: a safety net)
                self.timeline_fold, self.unfoldable = None, True
                return build_timeline(walk, booking, start_ms, end_ms, final=False)
        return tl

    def settled_ms(self) -> tuple[int, int]:
        """Up to when rank 0's events are in, and every other rank's, as far as the watcher can
        tell: each rank sends its events in time order, so none older than its newest one (less
        a margin for a process's threads) is to come. The fold walks for good up to here, not
        just up to `lag_ms` behind the newest event: a poll re-walks a few seconds, not the whole
        lag. Rank 0's walk waits for rank 0 alone (other ranks' phases never change it), so a
        rank that only sends a heartbeat every few seconds, or has gone silent, does not make
        every poll walk rank 0's last seconds again. A rank that breaks the order costs a refold
        from the stream (counted), never a wrong view."""
        ranks = self.ranks
        r0 = ranks.get(0)
        rank0 = NEG_INF if r0 is None else r0.last_seen_ms - SETTLED_MARGIN_MS
        seen = [r.last_seen_ms for k, r in ranks.items() if k != 0]
        others = min(seen) - SETTLED_MARGIN_MS if seen else rank0
        return rank0, others

    def last_heard(self, rank: int) -> float:
        """When the rank last showed life: its newest event, or its registration if later. The
        ranks hash is read after the events, so it can name a rank whose register event the
        same poll did not bring: silent since 1970 it is not. A registration counts no later
        than when the watcher read it (a clock ahead must not hide a silence)."""
        seen = self.ranks.get(rank, _NO_EVENTS).last_seen_ms / 1000
        ts = self.registrations.get(rank, {}).get("ts")
        read = self.registrations_read.get(rank)
        if type(ts) is not float or read is None:
            return seen
        return max(seen, min(ts, read))

    def fold(self, events: list[Event]) -> None:
        ranks = self.ranks
        for ev in events:
            t = ev.ts_ms
            if self.first_ms is None or t < self.first_ms:
                self.first_ms = t
            if t > self.newest_ms:
                self.newest_ms = t
            r = ranks.get(ev.rank)
            if r is None:
                r = ranks[ev.rank] = _Rank()
            if t > r.last_seen_ms:
                r.last_seen_ms = t
            if ev.type == "heartbeat" and ev.session == r.session and not is_point(ev):
                continue  # most events: nothing more (rank 0's in its events stream date its lapse)
            if walk_relevant(ev):
                if self.refold is None:
                    self.walk.append(ev)
                self.fresh.append(ev)
            if ev.session and ev.session != r.session:
                # A new process of the rank: what its older process had open died with it.
                if r.session is not None:
                    r.open_phases.clear()
                    r.ended = False
                    r.crash = None
                r.session = ev.session
            if ev.type == "step":
                r.last_step = ev.int_field("step")
            elif ev.type == "phase":
                name = str(ev.get("name"))
                if ev.get("state") == "begin":
                    r.open_phases[name] = ev.ts
                else:
                    r.open_phases.pop(name, None)
            elif ev.type == "run" and ev.get("state") == "crash":
                error = ev.get("error")
                r.crash = (
                    ev.ts,
                    str(ev.get("exit") or "a failure"),
                    error if isinstance(error, str) else None,
                )
            elif ev.type == "run":
                r.ended = ev.get("state") == "end"
                if not r.ended:
                    r.open_phases.clear()  # a new process starts outside every phase
                if ev.rank == 0 and ev.get("state") in ("start", "resume"):
                    # Rank 0 (re)starting the run ends every rank's phases from before it.
                    for other in self.ranks.values():
                        other.open_phases = {n: t for n, t in other.open_phases.items() if t > ev.ts}
            elif ev.type == "register":
                self.registrations.setdefault(ev.rank, dict(ev.fields))
            elif ev.type == "meta":
                jobfacts.merge_meta(self.meta, ev)
                self.metas += 1

    def terms(self, cfg: WatchConfig) -> JobTerms:
        """The job's terms (`terms.job_terms`, as the agent and replay derive them): its start
        (its registrations, no later than its first event), the operator's booking thresholds
        the ledger books it by, its liveness cadence from its meta."""
        registered = (to_ms(float(r["ts"])) for r in self.registrations.values() if "ts" in r)
        return job_terms(self.name, self.meta, cfg.policy(), registered, first_event_ms=self.first_ms)

    @property
    def judged_terms(self) -> JobTerms | None:
        """The terms of the last decision (`terms.job_terms`); None before the first."""
        return None if self._judged is None else self._judged[2]

    def judged(self, cfg: WatchConfig) -> tuple[JobTerms, WatchConfig]:
        """The job's terms and `cfg` with them, derived again only when the meta, the
        registrations (they only grow) or the first event changed: they count at 1,000 jobs."""
        inputs = (self.first_ms, len(self.registrations), self.metas)
        memo = self._judged
        if memo is None or memo[0] is not cfg or memo[1] != inputs:
            terms = self.terms(cfg)
            memo = self._judged = (cfg, inputs, terms, self.config(cfg, terms))
        return memo[2], memo[3]

    @staticmethod
    def config(cfg: WatchConfig, terms: JobTerms) -> WatchConfig:
        """`cfg` with the job's terms: the booking thresholds it is booked by, and its own
        heartbeat cadence where its meta sets one (a job of 5-minute steps may beat slower)."""
        kw: dict[str, Any] = {}
        if terms.booking is not cfg.booking:
            kw["booking"] = terms.booking
        if terms.heartbeat_timeout_s is not None:
            kw["heartbeat_timeout_s"] = terms.heartbeat_timeout_s
        if terms.heartbeat_interval_s is not None:
            kw["heartbeat_interval_s"] = terms.heartbeat_interval_s
        return dataclasses.replace(cfg, **kw) if kw else cfg

    def where(self, rank: int) -> dict[str, Any]:
        reg = self.registrations.get(rank, {})
        return {"rank": rank, "host": reg.get("host"), "gpu": reg.get("gpu")}


def in_shard(job: str, shard: tuple[int, int]) -> bool:
    """Whether `job` belongs to shard (index, count): by CRC-32 of its name, the same in every
    process and release (Python's own string hash changes with each process)."""
    index, count = shard
    return zlib.crc32(job.encode("utf-8", "surrogatepass")) % count == index


def parse_shard(text: str) -> tuple[int, int]:
    """'I/N' -> (I, N), 0 <= I < N (ValueError with a one-line reason otherwise)."""
    index, sep, count = text.strip().partition("/")
    try:
        i, n = int(index), int(count)
    except ValueError:
        raise ValueError(f"expected INDEX/COUNT such as 0/2, got {text!r}") from None
    if not sep:
        raise ValueError(f"expected INDEX/COUNT with 0 <= INDEX < COUNT, got {text!r}")
    return check_shard((i, n))


def check_shard(shard: tuple[int, int]) -> tuple[int, int]:
    """`shard` if it owns jobs (0 <= index < count), else ValueError: fails closed."""
    i, n = shard
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"expected INDEX/COUNT with 0 <= INDEX < COUNT, got '{i}/{n}'")
    return shard


def human(seconds: float) -> str:
    """A duration for people: 45s, 12m30s, 4h17m."""
    s = max(round(seconds), 0)
    if s < 120:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s" if s % 60 else f"{s // 60}m"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


# ---- the decision (pure: no Redis) ---------------------------------------------------------
def decide(view: JobView, now: float, cfg: WatchConfig, previous: Status | None = None) -> Status:
    """The job's state at `now` (Unix seconds, the clock of the trainers' timestamps)."""

    def status(state: str, reason: str, suspect: dict[str, Any] | None = None, **kw: Any) -> Status:
        since = previous.since if previous is not None and previous.state == state else now
        return Status(state, reason, since, now, suspect=suspect, **kw)

    if view.first_ms is None:
        return status("unknown", "no events from the job yet")
    terms, cfg = view.judged(cfg)
    start_ms = terms.start_ms
    tl = view.timeline(cfg.booking, start_ms, int(now * 1000), lag_ms=30_000)
    last = tl.steps[-1] if tl.steps else None
    progress: dict[str, Any] = dict(  # Status's progress fields
        last_step=last.step if last else None,
        last_step_ts=last.ts_ms / 1000 if last else None,
        seconds_since_last_step=since_step(now, last.ts_ms / 1000) if last else None,
        stall_threshold_s=tl.stall_threshold_ms / 1000,
    )
    if tl.end_ms is not None and not tl.lapsed:
        return status("done", "the run ended", **progress)
    members = sorted(set(view.registrations) | set(view.ranks))
    running = [r for r in members if not view.ranks.get(r, _NO_EVENTS).ended]
    verdict = _crashed(view, running, now, cfg)
    if verdict is None:
        live = _live_bands(view, cfg)
        verdict = (
            _hung(view, tl, now, cfg, live, running, start_ms)
            or _still_hung(previous, last)
            or _starving(view, live)
        )
    if verdict is None:
        return status("running", "steps advancing", **progress)
    state, reason, suspect = verdict
    return status(state, reason, suspect, **progress)


# A decision other than `running`: (state, reason, suspect).
Verdict = tuple[str, str, dict[str, Any] | None]


def _crashed(view: JobView, running: list[int], now: float, cfg: WatchConfig) -> Verdict | None:
    """Crashed: a rank that has not ended posted a crash record as its process died (named at
    once: the first to post one), or went silent."""
    records = sorted((c[0], r, c) for r in running if (c := view.ranks.get(r, _NO_EVENTS).crash) is not None)
    if records:
        _ts, rank, (_, exit_, error) = records[0]
        how = f"{exit_}" + (f" ({error})" if error and error not in exit_ else "")
        others = f"; {len(records) - 1} more rank(s) did too" if len(records) > 1 else ""
        return (
            "crashed",
            f"rank {rank} crashed ({how}) and no run end{others}",
            {**view.where(rank), "why": f"posted a crash record: {how}"},
        )
    silent = [r for r in running if now - view.last_heard(r) > cfg.heartbeat_timeout_s]
    if not (running and silent):
        return None
    who = "every rank" if len(silent) == len(running) else f"{len(silent)} of {len(running)} ranks"
    quiet = now - max(view.last_heard(r) for r in silent)
    return (
        "crashed",
        f"no heartbeat from {who} for {human(quiet)} and no run end",
        _first_silent(view, running, silent, cfg.heartbeat_interval_s),
    )


def _hung(
    view: JobView,
    tl: Timeline,
    now: float,
    cfg: WatchConfig,
    live: dict[str, Any] | None,
    running: list[int],
    start_ms: int,
) -> Verdict | None:
    """Hung: the deadlock signature in the agents' live bands, a hang an agent banded, no step
    past the stall threshold, or a phase past its allowance."""
    if live is not None and live["deadlock"] is not None:
        r = live["deadlock"]
        return (
            "hung",
            f"deadlock signature on two consecutive samples: rank {r} at 0%, the rest busy at low power",
            {**view.where(r), "why": "0% utilization in the deadlock signature"},
        )
    hang = _agent_hang(view, tl, now, cfg)  # names the GPU, also past the stall threshold
    if hang is not None:
        return ("hung", hang[0], hang[1])
    overrun = _phase_overrun(view, tl, now)
    if overrun:
        name, rank, open_s, allow_s = overrun
        reason = f"{name} on rank {rank} open for {human(open_s)}, past its {human(allow_s)} allowance"
    elif _stalled(tl, int(now * 1000)):
        since = tl.steps[-1].ts_ms / 1000 if tl.steps else start_ms / 1000
        threshold = human(tl.stall_threshold_ms / 1000)
        reason = f"no step for {human(now - since)} (stall threshold {threshold})"
    else:
        return None
    return ("hung", reason, _divergent(view, running) or _zero_util_rank(view, cfg))


def _stalled(tl: Timeline, now_ms: int) -> bool:
    """No step for longer than the stall threshold, now. A step at `now` (or later: a trainer
    whose clock runs ahead) ends the stall the millisecond before it belongs to: judged `hung`,
    the hold would keep a job hung that just made progress, and a fresh watcher would not."""
    if tl.steps and tl.steps[-1].ts_ms >= now_ms:
        return False
    return tl.regime_at(now_ms) == Regime.STALL


def _still_hung(previous: Status | None, last: StepRecord | None) -> Verdict | None:
    """A hang's signature cleared (an operator killed a rank, an elastic restart is under way)
    but no step came: a hang ends with progress, not with the GPUs going quiet."""
    if previous is None or previous.state != "hung" or _stepped_since(previous, last):
        return None
    reason = previous.reason
    if not reason.startswith(STILL_HUNG):
        reason = f"{STILL_HUNG} it hung ({reason})"
    return ("hung", reason, previous.suspect)


def _starving(view: JobView, live: dict[str, Any] | None) -> Verdict | None:
    """Starving: the agents' live bands name a straggler."""
    if live is None or live["straggler"] is None:
        return None
    r = live["straggler"]
    return (
        "starving",
        f"data starvation: rank {r} lowest in utilization",
        {**view.where(r), "why": "straggler"},
    )


STILL_HUNG = "no step since"


def _stepped_since(previous: Status, last: StepRecord | None) -> bool:
    """Whether a step completed after the poll that said `previous`: a newer last step (by its
    time: after a resume the step number may go down)."""
    if last is None:
        return False
    return previous.last_step_ts is None or last.ts_ms / 1000 > previous.last_step_ts


def _agent_hang(
    view: JobView, tl: Timeline, now: float, cfg: WatchConfig
) -> tuple[str, dict[str, Any]] | None:
    """A hang the agents already see: a rank whose newest sample, after the job's last step,
    the agent banded `deadlock`. The agent confirms that band on two consecutive samples: the
    spin on any number of GPUs (~100% utilization at idle-level power, no step) or the
    cross-rank deadlock signature. So the watcher says `hung` the first poll after the agent's
    round that saw it, not a stall threshold later. Inside a declared phase within its
    allowance the phase decides, as booking does."""
    now_ms = int(now * 1000)
    last_ms = tl.steps[-1].ts_ms if tl.steps else tl.start_ms
    stale_ms = int(cfg.heartbeat_timeout_s * 1000)
    dead = {
        r: e
        for r, (_, e) in view.agent_live.items()
        if e.band == "deadlock" and e.ts_ms > last_ms and now_ms - e.ts_ms <= stale_ms
    }
    if not dead:
        return None
    if tl.regime_at(now_ms) == Regime.OVERHEAD:
        return None
    zero_pct = _util_edges(view, cfg)[0]
    zero = [r for r in sorted(dead) if dead[r].util_pct <= zero_pct]
    r = zero[0] if zero else min(dead)
    e = dead[r]
    where = view.where(r)
    where = {
        "rank": r,
        "host": where["host"] if where["host"] is not None else view.agent_live[r][0],
        "gpu": where["gpu"] if where["gpu"] is not None else e.gpu,
    }
    if e.uuid:
        where["uuid"] = e.uuid
    gpu = f"{where['host']} GPU {where['gpu']}"
    quiet = human(now - last_ms / 1000)
    if zero:
        reason = (
            f"deadlock signature: rank {r} ({gpu}) at {e.util_pct:.0f}% utilization while "
            f"ranks {sorted(dead)} sit at low power, no step for {quiet}"
        )
        why = "0% utilization in the deadlock signature"
    else:
        reason = (
            f"spin signature: rank {r} ({gpu}) at {e.util_pct:.0f}% utilization drawing "
            f"{e.power_w:.0f} W, idle-level power, no step for {quiet}"
        )
        why = "spinning at ~100% utilization at idle-level power with no step"
    return reason, {**where, "why": why}


def _phase_overrun(view: JobView, tl: Timeline, now: float) -> tuple[str, int, float, float] | None:
    """A declared phase still open past its allowance (rank 0's are job-wide; any rank's counts)."""
    for rank in sorted(view.ranks):
        for name, begin in view.ranks[rank].open_phases.items():
            allow = tl.allowances.current(name) / 1000
            if now - begin > allow:
                return name, rank, now - begin, allow
    return None


def _first_silent(view: JobView, running: list[int], silent: list[int], interval_s: float) -> dict[str, Any]:
    """The rank whose silence started measurably first (more than two heartbeat intervals
    before any other rank's), else none: when torchrun's survivors are SIGTERMed within
    milliseconds of a kill -9, the first to stop cannot be told from its heartbeats."""
    seen = sorted((view.last_heard(r), r) for r in running)
    first_ts, first = seen[0]
    if first in silent and (len(seen) == 1 or seen[1][0] - first_ts > 2 * interval_s):
        return {**view.where(first), "why": "heartbeats gone first"}
    if len(silent) == len(running):
        return _unnamed("all ranks stopped together")
    if len(silent) == 1:
        return _unnamed(
            f"rank {silent[0]} is silent past the timeout, and the others' heartbeats stopped within "
            f"{human(2 * interval_s)} of its: the first to stop cannot be told"
        )
    return _unnamed(f"ranks {sorted(silent)} stopped together")


def _unnamed(why: str) -> dict[str, Any]:
    """A suspect without a rank: why none can be named."""
    return {"rank": None, "host": None, "gpu": None, "why": why}


def _zero_util_rank(view: JobView, cfg: WatchConfig) -> dict[str, Any]:
    """A hang whose events do not diverge (a DDP hang keeps the ranks in lockstep, and the hung
    rank's reporter thread keeps heartbeating): the agents' live state names the rank at 0%
    while the others spin. Without agent data no rank can be named."""
    if not view.live:
        return _unnamed(NO_AGENT_DATA)
    newest: dict[int, tuple[int, float]] = {}
    for snap in view.live:
        for rank, ts, _power, util in snap:
            if rank not in newest or ts >= newest[rank][0]:
                newest[rank] = (ts, util)
    zero_pct, busy_pct = _util_edges(view, cfg)
    zero = [r for r, (_, u) in newest.items() if u <= zero_pct]
    busy = [r for r, (_, u) in newest.items() if u >= busy_pct]
    if len(zero) == 1 and len(busy) * 2 >= len(newest):
        return {**view.where(zero[0]), "why": "0% utilization while the other ranks spin"}
    return _unnamed("the agents' live state names no single rank at 0%")


def _resolve(view: JobView, cfg: WatchConfig) -> tuple[Profile, str]:
    """The job's profile and its source by the one rule (`profiles.resolve`): the watcher's
    --profile, else --gpu-model/--power-limit, else the job's meta `gpu_model`."""
    return profiles.resolve(
        cfg.profile, cfg.gpu_model, cfg.power_limit_w, meta=view.meta, directory=cfg.profile_dir
    )


def _profile(view: JobView, cfg: WatchConfig) -> Profile | None:
    """The job's profile, or None when nothing names its model or limit: then the watcher leaves
    the power bands to the agents (the band each gives a rank in the live state) and judges
    utilization by the edges every derived profile has (`_util_edges`), never by another GPU's
    profile (`Watcher` says so once per job)."""
    try:
        return _resolve(view, cfg)[0]
    except profiles.ProfileError:
        return None


def _util_edges(view: JobView, cfg: WatchConfig) -> tuple[float, float]:
    """(~0%, ~100%) utilization edges of the job's profile; without one, the derived profiles'."""
    p = _profile(view, cfg)
    if p is None:
        return profiles.ZERO_UTIL_PCT, profiles.BUSY_UTIL_PCT
    return p.zero_util_pct, p.busy_util_pct


def _divergent(view: JobView, running: list[int]) -> dict[str, Any] | None:
    """The rank whose events differ from the others': the one inside a phase the rest are not
    in, the one that ended, or the one whose last step differs from the majority's."""
    ranks = [r for r in sorted(view.ranks) if r in running or view.ranks[r].ended]
    if len(ranks) < 2:
        return None
    inside = [r for r in ranks if view.ranks[r].open_phases]
    if 0 < len(inside) * 2 < len(ranks):
        r = inside[0]
        name = next(iter(view.ranks[r].open_phases))
        return {**view.where(r), "why": f"the only rank(s) inside {name}: {inside}"}
    ended = [r for r in ranks if view.ranks[r].ended]
    if 0 < len(ended) * 2 < len(ranks):
        return {**view.where(ended[0]), "why": f"left the run while the others did not: {ended}"}
    steps = {r: view.ranks[r].last_step for r in ranks if view.ranks[r].last_step is not None}
    if len(steps) >= 2:
        common, n = collections.Counter(steps.values()).most_common(1)[0]
        odd = [r for r, s in steps.items() if s != common]
        if odd and n * 2 > len(steps):
            return {
                **view.where(odd[0]),
                "why": f"last step {steps[odd[0]]} while the others are at {common}",
            }
    return None


def _live_bands(view: JobView, cfg: WatchConfig) -> dict[str, Any] | None:
    """Classify the live snapshots seen so far: a rank in a confirmed deadlock signature (at 0%)
    at the newest moment, or the straggler of a starvation lasting two moments."""
    rows = [x for snap in view.live for x in snap]
    if not rows:
        return None
    arr = np.asarray(sorted(set(rows)), np.float64)  # (rank, ts_ms, power, util), de-duplicated
    rank, ts = arr[:, 0].astype(np.int64), arr[:, 1].astype(np.int64)
    if np.unique(ts).size < 2:
        return None
    n_ranks = int(max(rank.max(), max(view.registrations, default=0))) + 1
    profile = _profile(view, cfg)
    if profile is None:  # no model or limit: the agents' bands decide (`_agent_deadlock`)
        return None
    res = bands_mod.classify(
        rank,
        ts,
        arr[:, 2],
        arr[:, 3],
        n_ranks,
        profile,
        grid_ms=int(cfg.booking.grid_s * 1000),
        gap_intervals=cfg.booking.gap_intervals,
        checkpoint_allowance_ms=cfg.booking.default_allowance_ms("checkpoint"),
    )
    newest = ts == ts.max()
    # The newest moment of each rank (ranks on other hosts may lag by a round).
    last_of = {int(r): i for i, r in enumerate(rank.tolist())}  # sorted by (rank, ts): last wins
    idx = np.asarray(sorted(last_of.values()))
    band = res.band[idx]
    out: dict[str, int | None] = {"deadlock": None, "straggler": None}
    if (band == Band.DEADLOCK).any() and newest[idx].any():
        zero = idx[arr[idx, 3] <= profile.zero_util_pct]
        out["deadlock"] = int(rank[zero[0]]) if zero.size else int(rank[idx[0]])
    starving_moments = np.unique(ts[res.band == Band.STARVATION]).size
    if (band == Band.STARVATION).any() and starving_moments >= 2 and res.straggler_rank is not None:
        out["straggler"] = res.straggler_rank
    return out


# ---- notifications -----------------------------------------------------------------------
def _alert(job: str, st: Status, status: str, now: float, prefix: str, runbooks: str) -> dict[str, Any]:
    labels = {
        "alertname": alertname(st.state),
        "training_job": job,
        "state": st.state,
        "severity": "critical"
        if st.state in ("hung", "crashed")
        else "warning"
        if st.state in ALERTING
        else "info",
        "source": "watcher",
    }
    if st.suspect and st.suspect.get("rank") is not None:
        labels["suspect_rank"] = str(st.suspect["rank"])
    fp = hashlib.sha256(f"{prefix}|{job}|{st.state}".encode()).hexdigest()[:16]
    return {
        "status": status,
        "labels": labels,
        "annotations": {
            "summary": f"training job {job} is {st.state}",
            "description": st.reason,
            "suspect": json.dumps(st.suspect) if st.suspect else "",
            # an alerting state's section of the alerts page (running and done have none)
            "runbook_url": runbook_url(alertname(st.state), runbooks) if st.state in ALERTING else "",
        },
        "startsAt": iso_utc(st.since),
        "endsAt": iso_utc(now) if status == "resolved" else "0001-01-01T00:00:00Z",
        "generatorURL": "",
        "fingerprint": fp,
    }


def notification(
    job: str, old: Status | None, new: Status, now: float, prefix: str, runbooks: str = RUNBOOKS
) -> dict[str, Any]:
    """An Alertmanager webhook payload (version 4) for one transition: the old state's alert
    resolved, the new state's firing."""
    alerts = []
    if old is not None and old.state in ALERTING:
        alerts.append(_alert(job, old, "resolved", now, prefix, runbooks))
    alerts.append(_alert(job, new, "firing", now, prefix, runbooks))
    common = {"training_job": job}
    return {
        "version": "4",
        "receiver": "costexporter-watch",
        "status": "firing",
        "groupKey": f'{{}}:{{training_job="{job}"}}',
        "truncatedAlerts": 0,
        "groupLabels": common,
        "commonLabels": common,
        "commonAnnotations": {},
        "externalURL": "",
        "alerts": alerts,
    }


# ---- the polling loop --------------------------------------------------------------------
def _registration(rank: str, raw: str) -> tuple[int, dict[str, Any]]:
    """A ranks-hash entry as (rank, registration), checked as the agent checks it
    (`protocol.parse_registration`: RegistrationError with the reason it is counted under)."""
    reg = protocol.parse_registration(rank, raw)
    entry = {
        "ts": reg.ts,
        "host": reg.host,
        "gpu": reg.gpu,
        "gpu_uuid": reg.gpu_uuid,
        "world_size": reg.world_size,
    }
    return reg.rank, {k: v for k, v in entry.items() if v is not None}


@dataclass(frozen=True, slots=True)
class Settled:
    """A job judged `done`, as the poll that read it left it: its view is dropped, and
    later polls skip it (no read, no decision) while its jobs index score stays `score` and
    `recheck_at` is ahead. A trainer that posts again moves the score (the index keeps each
    job's newest time), so the next poll reads the job afresh from its stream; one whose events
    do not (a clock behind the run it reran, a score someone reset) is found by the recheck:
    its streams' newest entry ids against where they were read to (`cursors`)."""

    score: float
    recheck_at: float
    cursors: tuple[str, str]  # the events' and the heartbeats' last entry read
    status: Status  # as judged then (`done`): what a skipped poll answers, moved to its time

    def holds(self, score: float | None, now: float) -> bool:
        return score == self.score and now < self.recheck_at


def settle(
    job: str, score: float, now: float, recheck_s: float, cursors: tuple[str, str], status: Status
) -> Settled:
    """`Settled` for a job found done at `now`: its recheck at its own point of the
    second half of `recheck_s` (by its name), so rechecks do not all fall on one poll."""
    return Settled(score, now + recheck_s * _share(job), cursors, status)


def _newest_id(reply: object) -> str | None:
    """The entry id of an `XREVRANGE ... COUNT 1` reply ("0-0": an empty or absent stream;
    None: not a stream, which is read to be refused)."""
    if isinstance(reply, Exception):
        return None
    if not reply:
        return "0-0"
    return _text(reply[0][0])  # type: ignore[index]


def _text(x: object) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def _share(job: str) -> float:
    """The job's point in [0.5, 1), by its name: when in a period it is due (so that jobs
    settled at one poll are not all due at one later poll)."""
    return 0.5 + 0.5 * (zlib.crc32(job.encode("utf-8", "replace")) % 1024) / 1024


def _rewrite_after(job: str, ttl: float) -> float:
    """How long a skipped job's status stands before it is written again: between a third and
    two thirds of its TTL."""
    return ttl * 2 / 3 * _share(job)


def _still_done(prev: Status, now: float) -> Status:
    """`decide` for a job it found `done` whose view has had no event since, at a later `now`:
    an ended run stays ended and its last step stays its last, so only the time since that step
    moves (a watcher of a day's jobs holds many ended ones; they cost nothing to re-judge)."""
    since = None if prev.last_step_ts is None else since_step(now, prev.last_step_ts)
    # Status(...), not dataclasses.replace: a fifth of its time, for every settled job a poll
    return Status(
        prev.state,
        prev.reason,
        prev.since,
        now,
        prev.last_step,
        prev.last_step_ts,
        since,
        prev.stall_threshold_s,
        prev.suspect,
    )


def since_step(now: float, step_ts: float) -> float:
    """Seconds from a step to `now`, never below 0: a trainer whose clock runs ahead of the
    watcher's dates its steps in the watcher's future, and a negative age would read as a step
    yet to come (the step is as fresh as can be: 0)."""
    return max(0.0, round(now - step_ts, 3))


class Watcher:
    def __init__(self, cfg: WatchConfig) -> None:
        import redis

        if cfg.shard is not None:
            check_shard(cfg.shard)  # fails closed: a shard that owns no job
        self.cfg = cfg
        self.redis = protocol.connect(cfg.redis_url)
        self._errors = (redis.RedisError, OSError)
        self.views: dict[str, JobView] = {}
        self.readers: dict[str, EventReader] = {}
        # Each job's heartbeat stream (`keys.beats_key`): the reporter's heartbeats, read only
        # here (the agents never do); an older trainer's still come in its events.
        self.beats: dict[str, EventReader] = {}
        self.status: dict[str, Status] = {}
        self.bad_jobs: dict[str, str] = {}  # job -> why it is skipped (logged once)
        self._unregistered: set[str] = set()  # views whose ranks hash is still to be read
        self._hosts: dict[str, tuple[dict[int, dict[str, Any]], int, list[str]]] = {}  # `_live_hosts`' cache
        # Jobs decided `done`, with the view that was: while no new event arrives, still done.
        self._ended: dict[str, JobView] = {}
        # Jobs done that polls skip while the jobs index says nothing new (`Settled`),
        # and when each job's status was last written (a skipped job's is rewritten only before
        # it would expire).
        self._settled: dict[str, Settled] = {}
        self._written: dict[str, float] = {}
        # The latest transitions (job, state, reason, the clock's time), for views and tests.
        self.history: collections.deque[tuple[str, str, str, float]] = collections.deque(maxlen=1000)
        self.redis_up = False
        self.stats: collections.Counter[str] = collections.Counter()
        # Refused ranks entries and other values a trainer can write, by (job, reason).
        self.registrations_rejected: collections.Counter[tuple[str, str]] = collections.Counter()
        self.refusals = untrusted.Refusals(log)
        # (job, key): meta keys a job set that only the operator sets (ignored; said once per job)
        self.meta_ignored: dict[tuple[str, str], int] = {}
        self.webhook = (
            Webhook(cfg.webhook_url, cfg.webhook_retries, cfg.webhook_timeout_s, cfg.webhook_backoff_s)
            if cfg.webhook_url
            else None
        )
        self.alertmanager = None
        if cfg.alertmanager_url:
            self.alertmanager = Alertmanager(
                cfg.alertmanager_url,
                resend_s=cfg.alertmanager_resend_s,
                retries=cfg.webhook_retries,
                timeout_s=cfg.webhook_timeout_s,
                backoff_s=cfg.webhook_backoff_s,
                cluster=cfg.cluster,
                runbooks=cfg.runbooks,
                generator_url=cfg.generator_url,
            )
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self.ttl = int(cfg.status_ttl_s or max(60.0, 6 * cfg.poll_s))
        self._positions: dict[str, float] = {}  # job -> when its stream position was last registered
        # the jobs to watch: the trainers' index, scanned around when it cannot be trusted
        self.index = JobIndex(self.redis, cfg.prefix, self.refusals, self._errors)

    def run(self, after_poll: Callable[[], None] | None = None) -> None:
        """Poll every `poll_s` until stopped; `after_poll`: the process's upkeep between polls
        (the `watch` command's `gcstate.FrozenState`)."""
        while not self._stop.is_set():
            self.poll()
            if after_poll is not None:
                after_poll()
            self._stop.wait(self.cfg.poll_s)

    def stop(self) -> None:
        self._stop.set()
        for sender in (self.webhook, self.alertmanager):
            if sender is not None:
                sender.stop()

    def poll(self) -> dict[str, Status]:
        """One round: read every watched job, decide, write the statuses, notify transitions."""
        now = self.cfg.clock()
        try:
            decided = self._poll(now)
            self._register_positions(now, decided)
            self.redis_up = True
        except self._errors as e:
            self.stats["redis_errors"] += 1
            if self.redis_up or self.stats["redis_errors"] % 60 == 1:
                log.warning("Redis unreachable: every job is unknown (%s)", e)
            self.redis_up = False
            decided = {
                job: Status("unknown", f"the watcher cannot read Redis: {type(e).__name__}", now, now)
                for job in (self.status or {})
            }
            for job, st in decided.items():
                prev = self.status.get(job)
                if prev is not None and prev.state == "unknown":
                    st.since = prev.since
        self._transitions(decided, now)
        return decided

    def _poll(self, now: float) -> dict[str, Status]:
        cfg = self.cfg
        jobs = list(cfg.jobs) or self._listed(now)
        if cfg.shard is not None:
            jobs = [j for j in jobs if in_shard(j, cfg.shard)]
        decided: dict[str, Status] = {}
        scores = {} if cfg.jobs or self.index.fell_back else self.index.scores
        jobs, skipped = self._skip_settled(jobs, scores, now)
        for job in skipped:
            done = decided[job] = _still_done(self._settled[job].status, now)
            was = self.status[job]  # `unknown` after an outage: done again since now
            done.since = was.since if was.state == "done" else now
        for batch, fresh in self._read_batches(jobs):
            # One XREAD for the next jobs' events (bounded memory), one round trip for their
            # registrations (first seen only) and one for the agents' live hashes, then decide.
            views: dict[str, JobView] = {}
            quiet: set[str] = set()  # jobs without a new event this poll
            for job in batch:
                if job in self.bad_jobs:  # set aside while its events were read
                    continue
                try:
                    events = fresh.pop(job, [])
                    views[job] = self._fold(job, events)
                    if not events:
                        quiet.add(job)
                except self._errors:
                    raise
                except JUDGE_ERRORS as e:
                    self._set_aside(job, e)
            self._read_registrations([v for j, v in views.items() if j in self._unregistered], now)
            for job, err in self.read_live(list(views.values())).items():
                self._set_aside(job, err)
                del views[job]
            for job, view in views.items():
                prev = self.status.get(job)
                ended = job in quiet and self._ended.get(job) is view
                self._say_profile(job, view)
                try:
                    if ended and prev is not None and prev.state == "done" and now >= prev.updated:
                        decided[job] = _still_done(prev, now)  # what decide() answers, without its work
                    else:
                        decided[job] = decide(view, now, cfg, prev)
                except JUDGE_ERRORS as e:
                    self._set_aside(job, e)
                    continue
                if view.judged_terms is not None and view.judged_terms.ignored_meta:
                    self._meta_ignored(job, view.judged_terms.ignored_meta)
                if decided[job].state == "done":
                    if job in scores:  # read past where its score (read before) says: settled
                        cursors = self._cursors(job)
                        self._settle(job, settle(job, scores[job], now, cfg.recheck_s, cursors, decided[job]))
                    else:  # no score to skip it by: read each poll, not judged again while quiet
                        self._ended[job] = view
                else:
                    self._ended.pop(job, None)
        pipe = self.redis.pipeline(transaction=False)
        for job, st in decided.items():
            if job in skipped and now - self._written.get(job, -math.inf) < _rewrite_after(job, self.ttl):
                continue
            # vars(): what asdict() gives, without its deep copy; orjson: a 10th of json's time
            pipe.set(keys.status_key(cfg.prefix, job), orjson.dumps(vars(st)), ex=self.ttl)
            self._written[job] = now
        pipe.execute()
        return decided

    def _skip_settled(
        self, jobs: list[str], scores: dict[str, float], now: float
    ) -> tuple[list[str], set[str]]:
        """(the jobs to read this poll, those skipped: settled, with their index score unchanged
        and either their recheck ahead or their streams where they were read to). A job read
        again is read afresh, as a new watcher reads it. Without scores (a job list given, the
        index scanned around) every job is read."""
        if not self._settled:
            return jobs, set()
        read, skipped, due = [], set(), []
        for job in jobs:
            st = self._settled.get(job)
            if st is None:
                read.append(job)
            elif st.holds(scores.get(job), now) and job in self.status:
                skipped.add(job)
            elif st.score == scores.get(job) and job in self.status:
                due.append(job)  # its recheck: only its streams' ids are read
            else:
                del self._settled[job]
                read.append(job)
        moved = self._moved(due) if due else set()
        for job in due:
            st = self._settled[job]
            if job in moved:
                del self._settled[job]
                read.append(job)
            else:
                self._settled[job] = settle(job, st.score, now, self.cfg.recheck_s, st.cursors, st.status)
                skipped.add(job)
        return read, skipped

    def _moved(self, jobs: list[str]) -> set[str]:
        """Those of the settled `jobs` whose events or heartbeats stream has an entry past
        where it was read to: one `XREAD COUNT 1` of every stream from its cursor (it answers
        only the streams that have one), or on a Redis Cluster, where one command's keys share a
        slot, each stream's newest entry id (`XREVRANGE … COUNT 1`, pipelined). A stream that
        cannot be read (not a stream) counts as moved: reading it refuses it."""
        p = self.cfg.prefix
        at = {}
        for job in jobs:
            events, beats = self._settled[job].cursors
            at[keys.stream_key(p, job)] = (job, events)
            at[keys.beats_key(p, job)] = (job, beats)
        if redisconn.is_cluster(self.redis):
            pipe = self.redis.pipeline(transaction=False)
            for k in at:
                pipe.xrevrange(k, count=1)
            replies = pipe.execute(raise_on_error=False)
            return {
                job for (job, cursor), r in zip(at.values(), replies, strict=True) if _newest_id(r) != cursor
            }
        try:
            got = self.redis.xread({k: cursor for k, (_, cursor) in at.items()}, count=1)
        except self._errors as e:
            if not untrusted.is_wrong_type(e):
                raise
            return set(jobs)
        return {at[_text(k)][0] for k, _entries in got}

    def _cursors(self, job: str) -> tuple[str, str]:
        """Where the job's events and heartbeats have been read to."""
        beats = self.beats.get(job)
        return self.readers[job].cursor, "0-0" if beats is None else beats.cursor

    def _settle(self, job: str, st: Settled) -> None:
        """Skip the job from the next poll on, holding only its status: what was kept to read
        and judge it goes (a watcher of a day's jobs holds mostly ended ones)."""
        self._settled[job] = st
        for held in (self.views, self.readers, self.beats, self._ended, self._hosts):
            held.pop(job, None)
        self._unregistered.discard(job)

    def _listed(self, now: float) -> list[str]:
        """The jobs heard from within `forget_after_s`: the index's by their scores (or, when the
        index is of the wrong type or flooded, the scanned jobs whose own stream has an entry that
        recent), and every job already watched whose own newest event is that recent: a score a
        trainer set (`ZADD jobs 0 <job>`) hides no job."""
        since = now - self.cfg.forget_after_s
        jobs = self.index.names(min_score=since)
        if self.index.fell_back:  # scanned: a job's own stream says how recent it is
            jobs = self.index.recent(jobs, time.time() - self.cfg.forget_after_s)
        listed = set(jobs)
        for name, view in self.views.items():
            if name not in listed and view.newest_ms >= since * 1000:
                jobs.append(name)
        return jobs

    def _register_positions(self, now: float, jobs: Iterable[str]) -> None:
        """Register how far this watcher has read the stream of each job it judged (at most every
        `register_position_s`, one pipeline): the agents keep the stream from there on. A job it
        no longer watches stops being refreshed, so its entry goes stale and pins nothing."""
        every = self.cfg.register_position_s
        if every is None:
            return
        pipe = None
        for job in jobs:
            reader = self.readers.get(job)
            if reader is None or reader.cursor in ("0", "0-0"):
                continue
            if now - self._positions.get(job, float("-inf")) < every:
                continue
            pipe = pipe or self.redis.pipeline(transaction=False)
            ledger.queue_position(pipe, self.cfg.prefix, job, f"watcher:{self.cfg.watcher_id}", reader.cursor)
            self._positions[job] = now
        if pipe is not None:
            for reply in pipe.execute(raise_on_error=False):
                if isinstance(reply, Exception) and not untrusted.is_wrong_type(reply):
                    raise reply
                # a readers hash of the wrong type: the agents set it aside (they write it too)

    def _read_batches(self, jobs: list[str]) -> Iterator[tuple[list[str], dict[str, list[Event]]]]:
        """`JOBS_PER_READ` jobs at a time, those not set aside, with their new events. The next
        jobs' XREAD is sent before these are handed out: Redis answers it while they are decided."""
        batches = [jobs[i : i + JOBS_PER_READ] for i in range(0, len(jobs), JOBS_PER_READ)]
        if not batches:
            return
        ahead = [self._send_read(b) for b in batches[:1]]  # the batch whose XREAD is on its way
        try:
            for nxt in [*batches[1:], None]:
                batch, readers, sent = ahead.pop()
                fresh = read_all_many(self.redis, readers, on_wrong_type=self._wrong_stream, first=sent)
                if nxt is not None:
                    ahead.append(self._send_read(nxt))
                yield batch, fresh
        finally:  # the poll failed or ended early: the reply sent for is not waited for
            for _batch, _readers, sent in ahead:
                if sent is not None:
                    sent.cancel()

    def _send_read(self, jobs: list[str]) -> tuple[list[str], list[EventReader], SentXread | None]:
        """The jobs not set aside, their readers and their first XREAD sent (`read_ahead`). A
        job whose name is refused is left to `_fold`, whose refusal sets it aside."""
        jobs = [j for j in jobs if j not in self.bad_jobs]
        readers: list[EventReader] = []
        for job in jobs:
            if job not in self.readers:
                try:
                    self.readers[job] = EventReader(self.redis, job, self.cfg.prefix)  # checks the name
                except ValueError:
                    continue
                self.beats.pop(job, None)  # read from the start again too
                self.views.pop(job, None)  # a new reader: the view is read from the start again
            # Its heartbeat stream first, in the same XREAD: every event a heartbeat read now
            # follows (the reporter sends a batch's events before its heartbeats) is read too.
            beats = self.beats.get(job) or self.beats.setdefault(
                job, EventReader(self.redis, job, self.cfg.prefix, beats=True)
            )
            readers += (beats, self.readers[job])
        return jobs, readers, read_ahead(self.redis, readers)

    def _wrong_stream(self, job: str) -> None:
        """The job's events or heartbeat key is not a stream: the job is set aside (counted),
        the others read."""
        self.refusals.refuse(
            job, "wrong_type", "its events or heartbeat key is not a stream: the job is not watched"
        )
        self._set_aside(job, TypeError("its events or heartbeat key is not a stream"))

    def _refold_source(self, job: str) -> Callable[[], list[Event]]:
        """The job's walk-relevant events up to where its reader is, read again from its stream
        (to fold its timeline again; the view keeps none of them)."""

        def read() -> list[Event]:
            self.stats["timeline_rebuilds"] += 1  # an event older than the fold, a moved start
            reader = EventReader(self.redis, job, self.cfg.prefix)
            return reader.read_until(self.readers[job].cursor, keep=walk_relevant)

        return read

    def _set_aside(self, job: str, e: Exception) -> None:
        """One poisoned job (a bad name, stored values of the wrong type) must not stop the others."""
        self.bad_jobs[job] = f"{type(e).__name__}: {e}"
        self.stats["bad_jobs"] += 1
        self.views.pop(job, None)
        self.readers.pop(job, None)
        self.beats.pop(job, None)
        self._hosts.pop(job, None)
        self._ended.pop(job, None)
        self._settled.pop(job, None)
        log.warning("job %r skipped: %s", untrusted.short(job), untrusted.short(self.bad_jobs[job], 300))

    def _fold(self, job: str, events: list[Event]) -> JobView:
        """The job's view with its new events folded in."""
        if job not in self.readers:
            self.readers[job] = EventReader(self.redis, job, self.cfg.prefix)  # checks the name
        if job not in self.views:
            self.views[job] = JobView(job, refold=self._refold_source(job))
            self._unregistered.add(job)
        view = self.views[job]
        view.fold(events)
        return view

    def _meta_ignored(self, job: str, keys: tuple[str, ...]) -> None:
        """Count and say once the thresholds a job's meta tried to set (the operator's alone)."""
        name = untrusted.short(job, 200)
        new = [k for k in keys if (name, k) not in self.meta_ignored]
        if new:
            for k in new:
                self.meta_ignored[(name, k)] = 1
            log.warning("%s", ignored_meta_note(untrusted.short(job), new))

    def _read_registrations(self, views: list[JobView], now: float) -> None:
        """Registrations arrive as `register` events; the hash keeps them once their events are
        trimmed away, so it is read once, when the job is first seen (one round trip for all)."""
        if not views:
            return
        pipe = self.redis.pipeline(transaction=False)
        for view in views:
            pipe.hgetall(keys.ranks_key(self.cfg.prefix, view.name))
        for view, raw in zip(views, pipe.execute(raise_on_error=False), strict=True):
            self._unregistered.discard(view.name)
            if isinstance(raw, Exception):
                if not untrusted.is_wrong_type(raw):
                    raise raw
                self.refusals.refuse(
                    view.name, "wrong_type", "its ranks key is not a hash: judged from its events"
                )
                continue
            for rank, value in raw.items():
                try:
                    entry = _registration(rank, value)
                except protocol.RegistrationError as e:
                    self.stats["bad_registrations"] += 1
                    self.registrations_rejected[(view.name, e.reason)] += 1
                    self.refusals.log_once(
                        view.name,
                        f"registration:{e.reason}",
                        "a registration of rank %s refused (%s): %s",
                        untrusted.short(rank),
                        e.reason,
                        e,
                    )
                    continue
                view.registrations.setdefault(*entry)
                view.registrations_read.setdefault(entry[0], now)

    def _say_profile(self, job: str, view: JobView) -> None:
        """Log once per job which profile judges its live power, or why none does."""
        if view.profile_said:
            return
        view.profile_said = True
        try:
            prof, source = _resolve(view, self.cfg)
        except profiles.ProfileError as e:
            self.stats["jobs_without_profile"] += 1
            log.warning(
                "job %r: %s; the watcher judges its live power by the agents' bands only and its "
                "utilization at the derived profiles' edges (<= %.0f%%, >= %.0f%%)",
                untrusted.short(job),
                e,
                profiles.ZERO_UTIL_PCT,
                profiles.BUSY_UTIL_PCT,
            )
            return
        log.info("job %r: band profile %s (%s)", untrusted.short(job), prof.name, source)

    def _live_hosts(self, view: JobView) -> list[str]:
        """The job's registered hosts, worked out again only when a rank registers (the
        registrations only grow)."""
        regs = view.registrations
        got = self._hosts.get(view.name)
        if got is None or got[0] is not regs or got[1] != len(regs):
            hosts = sorted({str(r.get("host")) for r in regs.values() if r.get("host")})
            got = self._hosts[view.name] = (regs, len(regs), hosts)
        return got[2]

    def read_live(self, views: list[JobView]) -> dict[str, Exception]:
        """The agents' live hashes of every host of these jobs, in one round trip; returns the
        jobs whose stored values could not be used (each set aside by the caller)."""
        bad: dict[str, Exception] = {}
        wanted: list[tuple[JobView, list[str]]] = []
        pipe = self.redis.pipeline(transaction=False)
        for view in views:
            try:
                hosts = self._live_hosts(view)
            except JUDGE_ERRORS as e:
                bad[view.name] = e
                continue
            if not hosts:
                continue
            wanted.append((view, hosts))
            for h in hosts:
                pipe.hgetall(keys.live_key(self.cfg.prefix, view.name, h))
        if not wanted:
            return bad
        replies = iter(pipe.execute(raise_on_error=False))
        for view, hosts in wanted:
            got = [(h, next(replies)) for h in hosts]
            for _h, reply in got:
                if isinstance(reply, Exception) and not untrusted.is_wrong_type(reply):
                    raise reply
            if any(isinstance(reply, Exception) for _h, reply in got):
                self.refusals.refuse(
                    view.name, "wrong_type", "a live key is not a hash: its hosts' samples skipped"
                )
                got = [(h, reply) for h, reply in got if not isinstance(reply, Exception)]
            try:
                self._apply_live(view, got)
            except JUDGE_ERRORS as e:
                bad[view.name] = e
        return bad

    def _apply_live(self, view: JobView, replies: list[tuple[str, dict[str, Any]]]) -> None:
        snap, agent_live = [], {}
        for h, raw in replies:
            for rank, v in raw.items():
                try:
                    r, e = int(rank), protocol.decode_live(v)
                except ValueError:  # LiveEntryError too
                    self.stats["bad_live"] += 1
                    continue
                snap.append((r, e.ts_ms, e.power_w, e.util_pct))
                if e.band is not None:
                    agent_live[r] = (h, e)
        view.agent_live = agent_live
        if snap and (not view.live or set(snap) != set(view.live[-1])):
            view.live.append(tuple(snap))

    def _transitions(self, decided: dict[str, Status], now: float) -> None:
        if self.alertmanager is not None:
            self.alertmanager.update(decided)
        with self.lock:
            for job, st in decided.items():
                old = self.status.get(job)
                self.status[job] = st
                if old is None or old.state != st.state:
                    self.stats["transitions"] += 1
                    self.history.append((job, st.state, st.reason, now))
                    log.info("%s: %s -> %s (%s)", job, old.state if old else "-", st.state, st.reason)
                    if self.webhook is not None:
                        self.webhook.send(notification(job, old, st, now, self.cfg.prefix, self.cfg.runbooks))

    def snapshot(self) -> WatcherSnapshot:
        with self.lock:
            return WatcherSnapshot(
                status=dict(self.status),
                redis_up=self.redis_up,
                stats=dict(self.stats),
                registrations_rejected=dict(self.registrations_rejected),
                meta_ignored=dict(self.meta_ignored),
                data_rejected=dict(self.refusals.counts),
                webhook=dict(self.webhook.stats) if self.webhook else {},
                alertmanager=dict(self.alertmanager.stats) if self.alertmanager else {},
                now=self.cfg.clock(),
            )
