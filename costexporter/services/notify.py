"""Where the watcher's judgements go: a job's status (`Status`, one of `STATES`), the states
that alert (`ALERTING`) and their alert names, each alert's runbook link (the rules' and the
watcher's alike), and the webhook sender both alert paths post with (the watcher's own
webhook and `alertmanager.py`'s Alertmanager API)."""

from __future__ import annotations

import collections
import json
import logging
import queue
import re
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger("costexporter.watcher")

STATES = ("running", "done", "crashed", "hung", "starving", "unknown")
ALERTING = {"crashed", "hung", "starving", "unknown"}

# Each alert's `runbook_url`: its section of the alerts page (docs/alerts.md), on the project's
# site unless `--runbook-url` (of `costexporter rules` and `costexporter watch`) names a copy of
# your own. The Prometheus rules and the watcher's own alerts link by the same rule.
RUNBOOKS = "https://github.com/costexporter/costexporter/blob/main/docs/alerts.md"


def alertname(state: str) -> str:
    """The name of the alert the watcher raises for an alerting state (`hung` -> JobHung)."""
    return "Job" + state.capitalize()


# Every alert name the watcher posts (to Alertmanager, and as its webhook's firing alerts).
WATCHER_ALERTS = tuple(alertname(s) for s in STATES if s in ALERTING)


def runbook_url(name: str, base: str = RUNBOOKS) -> str:
    """The alert's section of the alerts page at `base` (the anchor of its heading)."""
    return f"{base}#{name.lower()}"


def check_runbooks(base: str) -> str:
    """`base` as an alerts page's URL (an absolute http(s) URL without a fragment: each alert
    adds its own), or ValueError saying why not."""
    if not re.fullmatch(r"https?://[^\s#]+", base):
        raise ValueError(f"{base!r} is not an http(s) URL without a '#' (each alert adds its own anchor)")
    return base


@dataclass
class Status:
    state: str
    reason: str
    since: float
    updated: float
    last_step: int | None = None
    last_step_ts: float | None = None
    seconds_since_last_step: float | None = None
    stall_threshold_s: float | None = None
    suspect: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Webhook:
    """POSTs payloads on its own thread, retrying with exponential backoff, so a slow or down
    receiver never delays the watcher's polls. Counts what was sent, retried and given up."""

    def __init__(self, url: str, retries: int = 5, timeout_s: float = 5.0, backoff_s: float = 0.5) -> None:
        self.url, self.retries, self.timeout_s, self.backoff_s = url, retries, timeout_s, backoff_s
        self.q: queue.Queue[Any] = queue.Queue(maxsize=10_000)
        self.stats: collections.Counter[str] = collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="costexporter-webhook", daemon=True)
        self._thread.start()

    def send(self, payload: dict[str, Any]) -> None:
        try:
            self.q.put_nowait(payload)
        except queue.Full:
            self.stats["dropped"] += 1

    def _post(self, payload: dict[str, Any]) -> None:
        req = urllib.request.Request(
            self.url,
            data=json.dumps(payload).encode(),
            headers={"Content-Type": "application/json", "User-Agent": "costexporter-watch"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
            resp.read()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                payload = self.q.get(timeout=0.2)
            except queue.Empty:
                continue
            for attempt in range(self.retries + 1):
                try:
                    self._post(payload)
                    self.stats["sent"] += 1
                    break
                except (urllib.error.URLError, OSError, ValueError) as e:
                    if attempt == self.retries:
                        self.stats["failed"] += 1
                        log.warning("webhook %s: giving up after %d tries: %s", self.url, attempt + 1, e)
                        break
                    self.stats["retries"] += 1
                    if self._stop.wait(self.backoff_s * 2**attempt):
                        return
            self.q.task_done()

    def drain(self, timeout: float = 10.0) -> None:
        """Wait until every queued payload was sent or given up (tests, shutdown)."""
        end = time.monotonic() + timeout
        while self.q.unfinished_tasks and time.monotonic() < end:
            time.sleep(0.02)

    def stop(self) -> None:
        self.drain(2.0)
        self._stop.set()
