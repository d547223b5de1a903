"""The policy's budgets watched: the API's budget gauges are the budgets route's figures (scraped
over real HTTP), the same alerts reach a real Alertmanager from the API (band by band, resolved
when the period turns) and from the Prometheus rules over the gauges (promtool), and the shipped
Alertmanager config pages once per budget; `costexporter api` fails closed on an unusable
Alertmanager setting."""

from __future__ import annotations

import json
import time
import urllib.request
import uuid

import httpx
import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from costexporter.api.app import create_app
from costexporter.api.budgetwatch import BudgetWatch
from costexporter.core import budgets
from costexporter.core.terms import parse_policy_file
from costexporter.services.alertmanager import AlertSet
from costexporter.services.exposition import start_http_server
from costexporter.services.notify import runbook_url
from costexporter.store.ledger_read import LedgerStore

from .alertmanager import ALERTMANAGER, running_alertmanager
from .api_helpers import T0, write_job
from .conftest import SHARED_URL, drop_prefix, spawn_cli
from .redis_server import free_port
from .test_alert_paths import SHIPPED_AM
from .test_budgets import AT, POLICY
from .test_rules import SHIPPED, _case, _run, _series, needs_promtool

needs_am = pytest.mark.skipif(ALERTMANAGER is None, reason="no prometheus-alertmanager (.ci/run installs it)")
AUGUST = T0 + 8 * 86400  # 2025-08-03: July's spend is in the past month


@pytest.fixture(scope="module")
def ledger():
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    r = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    for job, team in (("llm-a", "llm"), ("llm-b", "llm"), ("vision-a", "vision")):
        write_job(r, prefix, job, team)  # two hours from T0 at 3.85 an hour
    yield LedgerStore(r, prefix), prefix
    drop_prefix(r, prefix)


def _watch(store, clock, post=None, cluster=None) -> BudgetWatch:
    app = create_app(store, budgets=parse_policy_file(POLICY).budgets, cluster=cluster)
    return BudgetWatch(app.state.config, post=post, runbook=runbook_url, clock=clock)


def _key(a: dict) -> tuple:
    return a["labels"]["alertname"], a["labels"]["budget"], a["labels"].get("threshold")


@given(
    used=st.floats(0, 3),
    f_used=st.one_of(st.none(), st.floats(0, 5)),
    ths=st.lists(st.floats(0.01, 2), min_size=1, max_size=5, unique=True),
)
def test_a_budget_raises_one_band_or_its_overrun_and_its_forecast(used, f_used, ths):
    b = budgets.Budget("b", 100.0, "month", (("team", "x"),), tuple(sorted(ths)))
    crossed = [t for t in b.thresholds if used >= t]
    st_ = budgets.BudgetStatus(
        used * 100, used, crossed, None if f_used is None else f_used * 100, f_used, []
    )
    got = budgets.alerts(st_)
    names = [a.name for a in got]
    assert len(names) == len(set(names))  # one alert per cause
    if used >= 1:
        assert names == [budgets.EXCEEDED]  # past its amount nothing else pages
        return
    burn = [a for a in got if a.name == budgets.BURN]
    under = [t for t in crossed if t < 1]
    assert [a.threshold for a in burn] == ([max(under)] if under else [])
    assert (budgets.FORECAST in names) == (f_used is not None and f_used >= 1)


def test_the_gauges_are_the_budgets_routes_figures_scraped_over_http(ledger):
    store, _ = ledger
    watch = _watch(store, lambda: AT)
    watch.refresh()
    registry = CollectorRegistry()
    registry.register(watch)
    port = free_port()
    httpd = start_http_server(port, "127.0.0.1", registry)
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    finally:
        httpd.shutdown()
    got: dict[tuple[str, str], float] = {}
    ths: dict[str, list[str]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if "budget" in s.labels and s.name != "costexporter_budget_threshold":
                got[s.name, s.labels["budget"]] = s.value
                assert s.labels["currency"] == "USD" and s.labels["period"]
            elif s.name == "costexporter_budget_threshold":
                ths.setdefault(s.labels["budget"], []).append(s.labels["threshold"])
    # the route's figures at the same instant (test_budgets.py's)
    assert got["costexporter_budget_spent", "llm-month"] == pytest.approx(15.4)
    assert got["costexporter_budget_used_ratio", "llm-month"] == pytest.approx(0.77)
    assert got["costexporter_budget_amount", "everyone-quarter"] == 100
    assert got["costexporter_budget_spent", "everyone-quarter"] == pytest.approx(23.1)
    assert ("costexporter_budget_forecast", "llm-a-day") not in got  # a rolling window: none
    assert got["costexporter_budget_forecast", "llm-month"] > 20
    assert ths["llm-a-day"] == ["50%"] and ths["llm-month"] == ["50%", "75%", "90%", "100%"]
    assert "costexporter_budget_evaluated_timestamp_seconds" in text
    # a team's budget carries its team (Alertmanager routes on it); a pattern's does not
    labels = {
        s.labels["budget"]: s.labels
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "costexporter_budget_spent"
    }
    assert labels["llm-month"]["team"] == "llm" and labels["everyone-quarter"].get("team", "") == ""


def test_a_ledger_it_cannot_read_keeps_the_last_figures_and_is_counted(ledger):
    store, prefix = ledger
    watch = _watch(store, lambda: AT)
    assert watch.refresh()
    dead = LedgerStore(redis.Redis(port=free_port(), socket_connect_timeout=0.2), prefix)
    watch.cfg.store = dead
    assert watch.refresh() == [] and watch.errors == 1
    assert {r.budget.name for r in watch.rows} == {b["name"] for b in POLICY["budgets"]}


@needs_am
def test_the_apis_budget_alerts_reach_alertmanager_band_by_band_and_resolve(ledger, tmp_path):
    store, _ = ledger
    now = [float(AT)]
    with running_alertmanager(SHIPPED_AM, tmp_path / "am") as base:
        poster = AlertSet(base, resend_s=3600, clock=time.time)
        sent: list[list[dict]] = []
        watch = _watch(store, lambda: now[0], post=lambda a: sent.append(poster.update(a)), cluster="east")
        firing = watch.refresh()
        assert list(map(_key, firing)) == list(map(_key, sent[-1]))  # every one is new: all posted
        posted = sent[-1]
        poster.drain()
        assert sorted(map(_key, posted)) == [
            ("PolicyBudgetBurn", "llm-a-day", "50%"),
            ("PolicyBudgetBurn", "llm-month", "75%"),
            ("PolicyBudgetExceeded", "vision-month", None),
            ("PolicyBudgetForecastExceeded", "everyone-quarter", None),
            ("PolicyBudgetForecastExceeded", "llm-month", None),
        ]
        month = next(a for a in posted if _key(a) == ("PolicyBudgetBurn", "llm-month", "75%"))
        assert month["labels"] | {"alertname": ""} == {
            "alertname": "",
            "severity": "info",
            "source": "api",
            "currency": "USD",
            "budget": "llm-month",
            "period": "month",
            "team": "llm",
            "threshold": "75%",
            "cluster": "east",
        }
        assert "15.400000 of 20.000000 USD" in month["annotations"]["description"]
        assert month["annotations"]["runbook_url"].endswith("#policybudgetburn")
        live = _alerts(base)
        assert {(k[0], k[1]): s for k, s in live.items()} == {
            (n, b): "active" for n, b, _ in map(_key, posted)
        }
        # nothing changed: nothing posted again before its resend
        assert len(watch.refresh()) == len(posted) and sent[-1] == []
        # August: July's budgets start again at nothing spent, their alerts resolve; the
        # quarter's and the rolling day's stand (the day's window holds no spend either)
        now[0] = float(AUGUST)
        watch.refresh()
        posted = sent[-1]
        poster.drain()
        resolved = {_key(a) for a in posted if a["endsAt"] <= a["startsAt"] or _ended(a)}
        assert ("PolicyBudgetBurn", "llm-month", "75%") in resolved
        assert ("PolicyBudgetExceeded", "vision-month", None) in resolved
        deadline = time.monotonic() + 10
        while ("PolicyBudgetBurn", "llm-month", "75%") in _alerts(base) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ("PolicyBudgetBurn", "llm-month", "75%") not in _alerts(base)
        poster.stop()


def _ended(a: dict) -> bool:
    return a["endsAt"] <= time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(time.time() + 1))


def _alerts(base: str) -> dict[tuple, str]:
    with urllib.request.urlopen(f"{base}/api/v2/alerts", timeout=5) as r:
        got = json.loads(r.read())
    return {_key(a): a["status"]["state"] for a in got if a["labels"]["alertname"].startswith("PolicyBudget")}


@needs_am
def test_the_shipped_alertmanager_config_pages_once_per_budget(tmp_path):
    """A budget spent holds back its band and its forecast; the API's alert holds back the
    rules' same alert; another cluster's budget of the same name is not held back."""

    def alert(name, source, cluster="east", **extra):
        return {
            "labels": {"alertname": name, "source": source, "cluster": cluster, "budget": "b", **extra},
            "annotations": {},
        }

    with running_alertmanager(SHIPPED_AM, tmp_path / "am") as base:
        req = urllib.request.Request(
            f"{base}/api/v2/alerts",
            data=json.dumps(
                [
                    alert("PolicyBudgetExceeded", "api"),
                    alert("PolicyBudgetExceeded", "rules"),
                    alert("PolicyBudgetBurn", "rules", threshold="90%"),
                    alert("PolicyBudgetForecastExceeded", "api"),
                    alert("PolicyBudgetBurn", "rules", cluster="west", threshold="90%"),
                ]
            ).encode(),
            headers={"Content-Type": "application/json"},
        )
        urllib.request.urlopen(req, timeout=5).read()
        want = {
            ("PolicyBudgetExceeded", "api", "east"): "active",
            ("PolicyBudgetExceeded", "rules", "east"): "suppressed",
            ("PolicyBudgetBurn", "rules", "east"): "suppressed",
            ("PolicyBudgetForecastExceeded", "api", "east"): "suppressed",
            ("PolicyBudgetBurn", "rules", "west"): "active",
        }
        deadline = time.monotonic() + 20
        while True:
            with urllib.request.urlopen(f"{base}/api/v2/alerts", timeout=5) as r:
                got = json.loads(r.read())
            state = {
                tuple(a["labels"][k] for k in ("alertname", "source", "cluster")): a["status"]["state"]
                for a in got
            }
            if state == want or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert state == want


B = 'budget="m",period="month",currency="USD",team="llm",instance="{i}"'


@needs_promtool
def test_the_rules_raise_the_apis_alerts_from_its_gauges(tmp_path):
    """Two API replicas' gauges (one alert, not two); spend rising 1% of the amount a minute
    from 40%: the 50% band at minute 10, the 75% band at 35, past 100% the overrun only."""

    def series(used: str, forecast: str | None) -> list[dict]:
        out = []
        for i in ("api-0", "api-1"):
            lab = B.format(i=i)
            out.append(_series("costexporter_budget_used_ratio", lab, used))
            out.append(_series("costexporter_budget_amount", lab, "100x90"))
            for t in ("0.5", "0.75", "1"):
                out.append(
                    _series("costexporter_budget_threshold", f'{lab},threshold="{float(t):.0%}"', t + "x90")
                )
            if forecast:
                out.append(_series("costexporter_budget_forecast", lab, forecast))
        return out

    labels = {"budget": "m", "period": "month", "currency": "USD", "team": "llm"}

    def burn(th: str) -> list[dict]:
        return [
            {
                "exp_labels": {**labels, "severity": "info", "threshold": th},
                "exp_annotations": {
                    "summary": f"budget m has passed {th} of its amount",
                    "description": f"The net cost of the jobs in the budget's scope this month passed {th} "
                    "of its amount, in USD (the operator's policy).",
                },
            }
        ]

    over = [
        {
            "exp_labels": {**labels, "severity": "warning"},
            "exp_annotations": {
                "summary": "budget m is spent",
                "description": "105% of its amount spent this month (the operator's policy).",
            },
        }
    ]
    forecast = [
        {
            "exp_labels": {**labels, "severity": "warning"},
            "exp_annotations": {
                "summary": "budget m will be spent before its period ends",
                "description": "120.00 USD by the end of this month, at the last 7 days' daily spend: more "
                "than its amount (the operator's policy).",
            },
        }
    ]
    rising = "0.4+0.01x90"
    tests = [
        _case(
            series(rising, None),
            [
                ("8m", "PolicyBudgetBurn", []),
                ("20m", "PolicyBudgetBurn", burn("50%")),
                ("45m", "PolicyBudgetBurn", burn("75%")),
                ("65m", "PolicyBudgetBurn", []),
                ("65m", "PolicyBudgetExceeded", over),
            ],
        ),
        _case(
            series("0.3x90", "120x90"),
            [("20m", "PolicyBudgetForecastExceeded", forecast), ("20m", "PolicyBudgetBurn", [])],
        ),
        # spent past its amount: the forecast says nothing more
        _case(series("1.2x90", "130x90"), [("20m", "PolicyBudgetForecastExceeded", [])]),
    ]
    _run(tmp_path, SHIPPED, tests)


@pytest.mark.parametrize(
    "args, says",
    [
        (["--alertmanager-url", "alertmanager:9093"], "not an http(s) URL"),
        (["--alertmanager-url", "http://127.0.0.1:1"], "names no budgets"),
        (["--runbook-url", "wiki#x", "--metrics-port", "0"], "--runbook-url"),
    ],
)
def test_api_refuses_an_alertmanager_it_cannot_use(cli, args, says):
    prefix = f"test-{uuid.uuid4().hex[:12]}"  # the API builds its rollups at start: its own keys
    try:
        r = cli("api", "--prefix", prefix, "--port", str(free_port()), *args)
    finally:
        drop_prefix(redis.Redis.from_url(SHARED_URL), prefix)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr


@needs_am
def test_the_api_command_serves_budget_gauges_and_posts_to_alertmanager(tmp_path):
    """The real command: a policy whose rolling 1000-day budget holds the ledger's jobs."""
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    r = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    write_job(r, prefix, "llm-a", "llm")  # 7.70
    policy = tmp_path / "policy.json"
    policy.write_text(
        json.dumps({"budgets": [{"name": "llm", "team": "llm", "amount": 10, "period": "rolling:1000d"}]})
    )
    port, mport = free_port(), free_port()
    try:
        with running_alertmanager(SHIPPED_AM, tmp_path / "am") as base:
            log = tmp_path / "api.log"
            proc = spawn_cli(
                "api", "--prefix", prefix, "--port", port, "--listen", "127.0.0.1", "--policy", policy,
                "--metrics-port", mport, "--alertmanager-url", base, "--budget-interval", "1",
                stderr=log.open("w"),
            )  # fmt: skip
            try:
                deadline = time.monotonic() + 60
                text, live = "", {}
                while time.monotonic() < deadline:
                    try:
                        text = httpx.get(f"http://127.0.0.1:{mport}/metrics", timeout=2).text
                        live = _alerts(base)
                    except (httpx.HTTPError, OSError):
                        pass
                    if live and "costexporter_budget_spent{" in text:
                        break
                    assert proc.poll() is None
                    time.sleep(0.3)
                assert live == {("PolicyBudgetBurn", "llm", "75%"): "active"}, (live, text[-500:])
                assert 'costexporter_budget_spent{budget="llm",' in text and "7.7" in text
                # the log says which budgets it judges by (the policy's history says who set them)
                assert (
                    "budget 'llm': 10.00 USD a rolling:1000d for team=llm, thresholds 50%, 75%, 90%, 100%"
                    in (log.read_text())
                )
            finally:
                proc.terminate()
                proc.wait(10)
    finally:
        drop_prefix(r, prefix)


@needs_promtool
def test_a_jobs_money_alerts_carry_its_team_for_routing(tmp_path):
    """BudgetExceeded (and the job's other money alerts) carry the team of the job's info series,
    from two agents; a job without one still pages, without the label."""

    def job(name: str, team: str | None) -> list[dict]:
        j = f'training_job="{name}"'
        out = []
        for a in ("a1", "a2"):
            out.append(
                _series(
                    "costexporter_cost_total",
                    f'{j},category="productive",currency="USD",instance="{a}"',
                    "0+5x60",
                )
            )
            out.append(_series("costexporter_job_budget", f'{j},currency="USD",instance="{a}"', "100x60"))
            if team:
                info = f'{j},team="{team}",namespace="ns",cost_center="",progress="steps",instance="{a}"'
                out.append(_series("costexporter_job_info", info, "1x60"))
        return out

    def over(name: str, team: str | None) -> dict:
        labels = {"severity": "warning", "training_job": name, "currency": "USD"}
        return {"exp_labels": labels | ({"team": team} if team else {})}

    # 2 agents x 5 a minute: past the budget of 100 at minute 10, paged from minute 15
    series = job("j", "llm") + job("k", None)
    checks = [("30m", "BudgetExceeded", [over("j", "llm"), over("k", None)])]
    tests = [_case(series, checks)]
    for t in tests:  # the annotations are BudgetExceeded's own test's; the labels are this one's
        for c in t["alert_rule_test"]:
            for e in c["exp_alerts"]:
                e["exp_annotations"] = {
                    "summary": f"{e['exp_labels']['training_job']} is over budget",
                    "description": "300.00 USD spent, more than its budget (the operator's policy).",
                }
    _run(tmp_path, SHIPPED, tests)
