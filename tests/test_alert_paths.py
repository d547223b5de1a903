"""The watcher's alert path beside the rules' one: its own identity (`source="watcher"`), a
counter of failed posts to Alertmanager, and the age of the last step never negative when a
trainer's clock runs ahead of the watcher's."""

from __future__ import annotations

import json
import shutil
import time
import urllib.request

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.exposition import generate_latest

from costexporter.core.timeutil import iso_utc
from costexporter.services.alertmanager import Alertmanager, postable
from costexporter.services.exporter import watch_registry
from costexporter.services.watcher import Status, Watcher, decide

from .alertmanager import ALERTMANAGER, running_alertmanager
from .conftest import SHARED_URL
from .redis_server import free_port
from .test_rules import SHIPPED, J, _case, _run, _series, _slope_alert, _slope_series
from .test_watcher import CFG, T0, beats, registered, steps, view


@given(ahead=st.floats(0.001, 3600))
def test_seconds_since_last_step_is_never_negative_when_the_trainer_runs_ahead(ahead):
    v = view(registered() + steps(1, 20) + beats(100))  # the last step at T0 + 100
    st_ = decide(v, T0 + 100 - ahead, CFG)  # the watcher's clock behind the trainer's
    assert st_.last_step is not None, st_
    assert st_.seconds_since_last_step is not None and st_.seconds_since_last_step >= 0.0
    later = decide(v, T0 + 130, CFG)
    assert later.seconds_since_last_step == pytest.approx(30)


def test_the_watchers_alerts_carry_their_source():
    a = postable("j", Status("hung", "no step for 30 min", T0, T0), T0, T0 + 60)
    assert a["labels"] == {
        "alertname": "JobHung",
        "training_job": "j",
        "severity": "critical",
        "source": "watcher",
    }
    c = postable("j", Status("hung", "x", T0, T0), T0, T0 + 60, cluster="east")
    assert c["labels"]["cluster"] == "east"
    assert a["generatorURL"] == ""  # none configured
    g = postable(
        "llm/run 7", Status("hung", "x", T0, T0), T0, T0 + 60, "https://grafana/d/ce?var-training_job={job}"
    )
    assert g["generatorURL"] == "https://grafana/d/ce?var-training_job=llm%2Frun%207"


def test_watch_refuses_a_generator_url_that_is_not_one(cli):
    r = cli("watch", "--once", "--generator-url", "grafana/d/ce", "--port", "0")
    assert r.returncode == 2 and "--generator-url" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("base", [None, "https://wiki.example.com/ml/alerts"])
def test_the_watchers_alerts_link_their_runbook_as_the_rules_do(base, prefix):
    """Every alert the watcher posts (to Alertmanager, and as its webhook's firing alerts) carries
    a `runbook_url` built by the rules' rule: the alerts page (the project's, or the one
    `watch --runbook-url` names) at the alert's name in lower case."""
    from costexporter.services.notify import ALERTING, RUNBOOKS, WATCHER_ALERTS
    from costexporter.services.watcher import WatchConfig, notification
    from costexporter.tools.rules import runbook_url

    cfg = WatchConfig(
        redis_url=SHARED_URL,
        prefix=prefix,
        alertmanager_url=f"http://127.0.0.1:{free_port()}",
        webhook_retries=0,
        webhook_timeout_s=0.2,
        **({} if base is None else {"runbooks": base}),
    )
    page = base or RUNBOOKS
    w = Watcher(cfg)
    try:
        assert isinstance(w.alertmanager, Alertmanager)
        posted = w.alertmanager.update({f"j-{s}": Status(s, "why", T0, T0) for s in sorted(ALERTING)})
    finally:
        w.stop()
    assert {a["labels"]["alertname"] for a in posted} == set(WATCHER_ALERTS) and len(WATCHER_ALERTS) == 4
    for a in posted:
        assert a["annotations"]["runbook_url"] == runbook_url(a["labels"]["alertname"], page)
    hooks = [notification("j", None, Status(s, "why", T0, T0), T0, "p", page)["alerts"][0] for s in ALERTING]
    assert len(hooks) == 4
    for a in hooks:
        assert a["annotations"]["runbook_url"] == f"{page}#{a['labels']['alertname'].lower()}"


def test_watch_refuses_a_runbook_url_it_cannot_link(cli):
    """`watch --runbook-url` takes what `rules --runbook-url` takes: an http(s) URL without a '#'."""
    for bad in ("wiki/alerts", "https://wiki.example.com/alerts#top"):
        r = cli("watch", "--once", "--runbook-url", bad)
        assert r.returncode == 2 and "--runbook-url" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_failed_alertmanager_posts_are_counted_and_exported(prefix):
    """Alertmanager down (nothing listens): every post fails after its retries and the watcher's
    /metrics says so, by outcome."""
    from costexporter.services.watcher import WatchConfig

    cfg = WatchConfig(
        redis_url=SHARED_URL,
        prefix=prefix,
        alertmanager_url=f"http://127.0.0.1:{free_port()}",
        webhook_retries=1,
        webhook_timeout_s=0.5,
        webhook_backoff_s=0.01,
    )
    w = Watcher(cfg)
    try:
        assert isinstance(w.alertmanager, Alertmanager)
        w.alertmanager.update({"j": Status("crashed", "heartbeats gone", T0, T0)})
        w.alertmanager.drain(20)
        assert w.alertmanager.stats["failed"] == 1 and w.alertmanager.stats["sent"] == 0
        text = generate_latest(watch_registry(w)).decode()
        assert 'costexporter_watch_alertmanager_posts_total{outcome="failed"} 1.0' in text
        assert 'costexporter_watch_alertmanager_posts_total{outcome="sent"} 0.0' in text
    finally:
        w.stop()


# ---- the rules' path: promtool runs the shipped rules --------------------------------------------
needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")


def _states60(states: dict[str, str], suspect: str = "3x60", labels: str = J) -> list[dict]:
    out = [_series("costexporter_job_suspect_rank", labels, suspect)]
    for s in ("running", "done", "crashed", "hung", "starving", "unknown"):
        out.append(
            _series("costexporter_job_state", f'{labels},costexporter_job_state="{s}"', states.get(s, "0x60"))
        )
    return out


CRASHED = {
    "exp_labels": {"severity": "critical", "training_job": "j", "source": "rules"},
    "exp_annotations": {
        "summary": "j crashed",
        "description": "The watcher reports crashed: heartbeats gone and no run end; suspect rank 3.",
    },
}


@needs_promtool
def test_no_cost_slope_page_between_hung_and_crashed(tmp_path):
    """Hung for 30 minutes (steps stopped at minute 20), then crashed, the cost still rising:
    JobHung pages, then JobCrashed after its `for`. CostSlopeWithoutSteps fires during the hang
    (JobHung inhibits it in Alertmanager: the next test) and stops the moment the job reads
    crashed: no page in the gap where JobHung has cleared and JobCrashed is still pending."""
    n = "CostSlopeWithoutSteps"
    series = _slope_series("1000+60x20 2200x40") + _states60(
        {"running": "1x20 0x39", "hung": "0x20 1x29 0x9", "crashed": "0x50 1x9"}
    )  # hung from minute 21 to 50, crashed from 51
    checks = [("45m", n, _slope_alert("45.00")), ("50m", n, _slope_alert("50.00"))]
    checks += [(t, n, []) for t in ("51m", "52m", "55m", "59m")]
    checks += [("50m", "JobCrashed", []), ("51m", "JobHung", []), ("51m", "JobCrashed", [])]
    checks += [("53m", "JobCrashed", [dict(CRASHED)])]
    _run(tmp_path, SHIPPED, [_case(series, checks)])
    # the same story where the watcher says nothing: the slope alert still pages after minute 50
    # (the rule stands aside for the watcher's verdict only)
    alone = _slope_series("1000+60x20 2200x40")
    _run(tmp_path, SHIPPED, [_case(alone, [("55m", n, _slope_alert("55.00"))])])


@needs_promtool
def test_no_cost_slope_page_as_a_hung_job_recovers(tmp_path):
    """Hung from minute 21 to 40; the watcher reads it running at 41, but the agents' progress
    series moves only at 42 (a scrape and a booking round behind). JobHung clears at 41 and with
    it the inhibition: CostSlopeWithoutSteps must not be firing then, or it pages alone (the
    critical route waits 0 s). During the hang it fires (inhibited in Alertmanager), and a job
    that stays without steps after the hold pages again."""
    n = "CostSlopeWithoutSteps"
    states = _states60({"running": "1x20 0x19 1x19", "hung": "0x20 1x19 0x19"})
    resumes = _slope_series("1000+60x20 2200x20 2260+60x17") + states
    checks = [("35m", n, _slope_alert("35.00")), ("41m", "JobHung", [])]
    checks += [("41m", n, []), ("42m", n, []), ("44m", n, [])]
    _run(tmp_path, SHIPPED, [_case(resumes, checks)])
    # The watcher says running, the steps never come back: the slope pages again once the hold
    # is over and its `for` has passed anew (43m + 5m).
    stays = _slope_series("1000+60x20 2200x39") + states
    _run(
        tmp_path, SHIPPED, [_case(stays, [("42m", n, []), ("47m", n, []), ("49m", n, _slope_alert("49.00"))])]
    )


REC = "training_job:costexporter_cost:sum"


@needs_promtool
def test_same_named_jobs_of_two_clusters_stay_apart(tmp_path):
    """One Prometheus scraping two clusters (a `cluster` label on their series): a job named
    alike in both is two recorded costs and two alerts, not one merged."""
    series = []
    for c, rate in (("east", 1), ("west", 3)):
        labels = f'{J},cluster="{c}",category="productive",currency="USD"'
        series.append(_series("costexporter_cost_total", labels, f"0+{rate}x60"))
        series += _states60({"crashed": "1x60"}, labels=f'{J},cluster="{c}"')
    test = _case(series, [("10m", "JobCrashed", [
        {**CRASHED, "exp_labels": {**CRASHED["exp_labels"], "cluster": c}} for c in ("east", "west")
    ])])  # fmt: skip
    test["promql_expr_test"] = [{
        "expr": REC, "eval_time": "10m",
        "exp_samples": [
            {"labels": f'{REC}{{cluster="{c}",currency="USD",training_job="j"}}', "value": v}
            for c, v in (("east", 10), ("west", 30))
        ],
    }]  # fmt: skip
    _run(tmp_path, SHIPPED, [test])


# ---- the shipped Alertmanager config, on a real Alertmanager -----------------------------------
SHIPPED_AM = SHIPPED.parents[1] / "docker" / "alertmanager" / "alertmanager.yml"


def _post(base: str, alerts: list[dict]) -> None:
    req = urllib.request.Request(
        f"{base}/api/v2/alerts", json.dumps(alerts).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.status == 200


def _alert(name: str, source: str, job: str = "j", **labels: str) -> dict:
    now = time.time()
    return {
        "labels": {"alertname": name, "training_job": job, "severity": "critical", "source": source} | labels,
        "annotations": {"summary": name},
        "startsAt": iso_utc(now - 60),
        "endsAt": iso_utc(now + 600),
    }


@pytest.mark.skipif(ALERTMANAGER is None, reason="no prometheus-alertmanager (.ci/run installs it)")
def test_the_shipped_alertmanager_config_pages_once_per_stop(tmp_path):
    """Both paths' JobHung stay two alerts (their identities differ by `source`); the watcher's
    inhibits the rules' one and a CostSlopeWithoutSteps of the same job; DataStarvation holds
    back the same job's SlowRank; the same job name in another cluster is not inhibited."""
    with running_alertmanager(SHIPPED_AM, tmp_path / "am") as base:
        _post(base, [
            _alert("JobHung", "watcher", cluster="east"),
            _alert("JobHung", "rules", cluster="east"),
            _alert("CostSlopeWithoutSteps", "rules", cluster="east"),
            _alert("CostSlopeWithoutSteps", "rules", cluster="west"),
            _alert("DataStarvation", "rules", cluster="east", rank="5"),
            _alert("SlowRank", "rules", cluster="east", rank="2"),
            _alert("SlowRank", "rules", cluster="west", rank="2"),
            _alert("CostPerStepJump", "rules", cluster="west"),
            _alert("CostPerStepJump", "rules", cluster="east", job="k"),
        ])  # fmt: skip
        want = {
            ("JobHung", "watcher", "east"): "active",
            ("JobHung", "rules", "east"): "suppressed",
            ("CostSlopeWithoutSteps", "rules", "east"): "suppressed",
            ("CostSlopeWithoutSteps", "rules", "west"): "active",
            # one straggler page a job
            ("DataStarvation", "rules", "east"): "active",
            ("SlowRank", "rules", "east"): "suppressed",
            ("SlowRank", "rules", "west"): "active",
            # the straggler is the cause of the dearer steps (job j in west); not of job k's
            ("CostPerStepJump", "rules", "west"): "suppressed",
            ("CostPerStepJump", "rules", "east"): "active",
        }
        # Alertmanager works out an alert's state when asked, from what its inhibitor has taken
        # in so far: a target can read "active" until the inhibitor has its source. So the test
        # waits for the expected states (or the deadline), then holds the last answer to them.
        deadline = time.monotonic() + 20
        while True:
            with urllib.request.urlopen(f"{base}/api/v2/alerts", timeout=5) as r:
                got = json.loads(r.read())
            key = lambda a: tuple(a["labels"][k] for k in ("alertname", "source", "cluster"))  # noqa: E731
            state = {key(a): a["status"]["state"] for a in got}
            if state == want or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert state == want
