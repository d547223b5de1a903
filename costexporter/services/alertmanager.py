"""The watcher's states as alerts in Alertmanager, through its own API (`POST /api/v2/alerts`).

Alertmanager keeps an alert firing until its `endsAt`, so, like Prometheus, the watcher posts
each firing alert again every `resend_s` with `endsAt` a few resends ahead (a watcher that dies
lets its alerts expire rather than fire for ever), and posts `endsAt = now` when the job leaves
the state: the alert is resolved. Only the alerting states (`crashed`, `hung`, `starving`,
`unknown`) are alerts; `running` and `done` are states, and resolve the job's alert.

The alert's identity is its labels (`alertname`, `training_job`, `severity`, `source="watcher"`,
and `cluster` when the watcher is given one): the suspect, the reason and the `runbook_url` (the
alert's section of the alerts page, linked as the rules link theirs) are annotations, so a
suspect named later updates the alert instead of opening a second one. `source` keeps these
alerts apart from the same-named ones the Prometheus rules raise (`source="rules"`) from the
watcher's exported state: the two paths never merge into one alert whose annotations flip or
whose resolve by one path ends the other's. Times are the wall clock (Alertmanager's), whatever
clock the watcher judges by.
"""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from costexporter.core.timeutil import iso_utc
from costexporter.services.notify import ALERTING, RUNBOOKS, Status, Webhook, alertname, runbook_url

ALERTS_PATH = "/api/v2/alerts"
RESEND_FACTOR = 4  # a firing alert's endsAt lies this many resends ahead


def severity(state: str) -> str:
    return "critical" if state in ("hung", "crashed") else "warning"


@dataclass
class _Firing:
    state: str
    started: float  # wall clock
    posted: float  # wall clock of the last post


SOURCE = "watcher"  # the `source` label of the alerts this path posts (the rules' are "rules")


def postable(
    job: str,
    st: Status,
    starts: float,
    ends: float,
    generator_url: str = "",
    cluster: str | None = None,
    runbooks: str = RUNBOOKS,
) -> dict[str, Any]:
    """One alert in the shape of Alertmanager's `postableAlert`; `generator_url`'s `{job}` is the
    job's name, URL-quoted (Alertmanager shows the link as the alert's source)."""
    suspect = st.suspect or {}
    name = alertname(st.state)
    annotations = {
        "summary": f"training job {job} is {st.state}",
        "description": st.reason,
        "runbook_url": runbook_url(name, runbooks),
    }
    if suspect.get("rank") is not None:
        annotations["suspect_rank"] = str(suspect["rank"])
    if suspect.get("why"):
        annotations["suspect"] = str(suspect["why"])
    labels = {
        "alertname": name,
        "training_job": job,
        "severity": severity(st.state),
        "source": SOURCE,
    }
    if cluster:
        labels["cluster"] = cluster
    return {
        "labels": labels,
        "annotations": annotations,
        "startsAt": iso_utc(starts),
        "endsAt": iso_utc(ends),
        "generatorURL": generator_url.replace("{job}", urllib.parse.quote(job, safe="")),
    }


class _Poster:
    """What both alert paths share: Alertmanager's alerts API behind the webhook's sender (its
    thread, retries and counters), the re-post interval and the clock."""

    def __init__(
        self,
        base_url: str,
        resend_s: float,
        retries: int,
        timeout_s: float,
        backoff_s: float,
        clock: Callable[[], float],
    ) -> None:
        self.url = base_url.rstrip("/") + ALERTS_PATH
        self.resend_s = resend_s
        self.clock = clock
        self.sender = Webhook(self.url, retries, timeout_s, backoff_s)

    @property
    def stats(self) -> dict[str, Any]:
        return self.sender.stats

    def _ends(self, now: float) -> float:
        """A firing alert's endsAt: RESEND_FACTOR re-posts ahead (a poster that dies lets it expire)."""
        return now + RESEND_FACTOR * self.resend_s

    def _send(self, out: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if out:
            self.sender.send(out)  # type: ignore[arg-type]
        return out

    def drain(self, timeout: float = 10.0) -> None:
        self.sender.drain(timeout)

    def stop(self) -> None:
        self.sender.stop()


class Alertmanager(_Poster):
    """Posts the watcher's alerting states to Alertmanager (`base_url`, e.g.
    http://alertmanager:9093), on the webhook's thread with its retries and counters."""

    def __init__(
        self,
        base_url: str,
        resend_s: float = 60.0,
        retries: int = 5,
        timeout_s: float = 5.0,
        backoff_s: float = 0.5,
        clock: Callable[[], float] = time.time,
        generator_url: str = "",
        cluster: str | None = None,
        runbooks: str = RUNBOOKS,
    ) -> None:
        super().__init__(base_url, resend_s, retries, timeout_s, backoff_s, clock)
        self.runbooks = runbooks
        self.generator_url = generator_url
        self.cluster = cluster
        self.firing: dict[str, _Firing] = {}
        self.last: dict[str, Status] = {}

    def _postable(self, job: str, st: Status, starts: float, ends: float) -> dict[str, Any]:
        return postable(job, st, starts, ends, self.generator_url, self.cluster, self.runbooks)

    def update(self, decided: dict[str, Status]) -> list[dict[str, Any]]:
        """One poll's statuses -> the alerts to post (new, resent, resolved); posts them."""
        now = self.clock()
        out = []
        for job, st in decided.items():
            cur = self.firing.get(job)
            if cur is not None and cur.state != st.state:  # left the alerting state: resolve it
                out.append(self._postable(job, self.last[job], cur.started, now))
                del self.firing[job]
                cur = None
            if st.state in ALERTING:
                if cur is None:
                    cur = self.firing[job] = _Firing(st.state, now, 0.0)
                changed = self.last.get(job) is not None and (
                    self.last[job].reason != st.reason or self.last[job].suspect != st.suspect
                )
                if now - cur.posted >= self.resend_s or cur.posted == 0.0 or changed:
                    out.append(self._postable(job, st, cur.started, self._ends(now)))
                    cur.posted = now
            self.last[job] = st
        return self._send(out)


@dataclass
class _Posted:
    alert: dict[str, Any]  # labels, annotations, generatorURL
    started: float  # wall clock
    posted: float  # wall clock of the last post


class AlertSet(_Poster):
    """Keeps a set of alerts in Alertmanager that its caller restates whole each time (the API's
    budget alerts): a new alert is posted, a lasting one re-posted every `resend_s` (or at once
    when its annotations change) with `endsAt` RESEND_FACTOR re-posts ahead, and one no longer
    stated is resolved (`endsAt` = now). An alert's identity is its labels, as Alertmanager's."""

    def __init__(
        self,
        base_url: str,
        resend_s: float = 60.0,
        retries: int = 5,
        timeout_s: float = 5.0,
        backoff_s: float = 0.5,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(base_url, resend_s, retries, timeout_s, backoff_s, clock)
        self.live: dict[tuple[tuple[str, str], ...], _Posted] = {}

    def update(self, alerts: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`alerts`: every alert firing now (`labels`, `annotations`, optional `generatorURL`);
        posts what is new, due again, changed or gone, and returns it."""
        now = self.clock()
        out = []
        current = {tuple(sorted(a["labels"].items())): a for a in alerts}
        for key in [k for k in self.live if k not in current]:
            gone = self.live.pop(key)
            out.append({**gone.alert, "startsAt": iso_utc(gone.started), "endsAt": iso_utc(now)})
        for key, a in current.items():
            cur = self.live.get(key)
            if cur is None:
                cur = self.live[key] = _Posted(a, now, 0.0)
            changed = cur.alert.get("annotations") != a.get("annotations")
            if changed or cur.posted == 0.0 or now - cur.posted >= self.resend_s:
                cur.alert, cur.posted = a, now
                out.append({**a, "startsAt": iso_utc(cur.started), "endsAt": iso_utc(self._ends(now))})
        return self._send(out)
