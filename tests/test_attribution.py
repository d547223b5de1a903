"""Who pays is the operator's word: a trainer under its own generated ACL writes the cheapest
price and another team's name into its meta, and the ledger, the API, the team scopes and the
FOCUS export still bill the job at the policy's price to the policy's owner, saying what was
ignored. A rule that grants a key trusts the trainer's value for it, and only there."""

from __future__ import annotations

import csv
import io
import uuid
from typing import ClassVar

import httpx
import pytest

from costexporter.api.auth import Tokens, hash_token
from costexporter.core.model import CATEGORIES
from costexporter.core.pricing import PriceRule, Pricing
from costexporter.core.replay import ReplayConfig, book_trace, report_of
from costexporter.core.terms import PolicyRule
from costexporter.sources.synth import TraceBuilder
from costexporter.store import keys, ledger
from costexporter.store.ledger_read import LedgerStore

from .api_helpers import served
from .poison_roles import _AsAgent, client, setuser
from .redis_server import RedisServer
from .test_ledger_faults_property import HOLD_S, ROUND_S

JOB = "llm/pretrain"
WINDOW = "2025-07-26T00:00:00Z,2025-07-28T00:00:00Z"
RULES = (PolicyRule(job="llm/*", owner=(("team", "llm"), ("cost_center", "cc-42"), ("budget", 900.0))),)
PRICING = Pricing((PriceRule(4.0, "*B300*", name="price:*B300*/*"),), cluster="east")


def hostile_job(**meta: object) -> TraceBuilder:
    b = TraceBuilder(n_gpus=2, per_host=2, job=JOB, seed=8)
    b.meta(**meta)
    b.run("start")
    b.stretch("compute", 120, step_s=4, tokens=100)
    b.stretch("idle", 60)
    b.run("end")
    b.stretch("idle", HOLD_S + 3 * ROUND_S)
    return b


class _Policied(_AsAgent):
    agent_kw: ClassVar[dict] = {"policy_rules": RULES, "pricing": PRICING}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = RedisServer(tmp_path_factory.mktemp("attribution-redis")).start()
    yield s
    s.stop()


def _cost(admin, prefix: str) -> int:
    total = ledger.read_amounts(admin, prefix, JOB)
    return sum(int(total.get(f"{c}:ucost", 0)) for c in CATEGORIES)


def test_a_trainer_under_its_own_acl_cannot_set_its_price_or_its_owner(server):
    admin, port = server.client(), server.port
    prefix = f"attr-{uuid.uuid4().hex[:8]}"
    url = lambda who: f"redis://{who}@127.0.0.1:{port}/0"  # noqa: E731
    as_trainer = client(url(setuser(admin, prefix, "trainer", team="llm")))
    b = hostile_job(price_per_gpu_hour=1e-9, team="victim-team", cost_center="cc-victim", budget=1e12)
    run = _Policied(url(setuser(admin, prefix, "agent")), as_trainer, prefix, b, [b], None)
    run.run()
    # The ledger: the policy's price, to the micro-unit of replay under the same policy.
    rcfg = ReplayConfig(policy_rules=RULES, pricing=PRICING)
    results, un = book_trace(b.samples(), b.events, rcfg)
    report = report_of(results, un, rcfg)["jobs"][JOB]
    assert report["price_per_gpu_hour"] == 4.0
    assert _cost(admin, prefix) / 1e6 == pytest.approx(report["cost_total"], abs=1e-4)
    assert _cost(admin, prefix) / 1e6 == pytest.approx(4.0 * report["gpu_hours_total"], rel=1e-4)
    assert set(report["meta_ignored"]) == {"price_per_gpu_hour", "team", "cost_center", "budget"}
    [agent] = run.agents
    assert {k for j, k in agent.meta_ignored if j == JOB} == set(report["meta_ignored"])
    # The API under its own user: the policy's owner, the sources, the warning; team scopes
    # follow the operator's team, not the trainer's.
    tokens = Tokens(
        [
            ("llm", hash_token("t-llm"), frozenset({"llm"})),
            ("victim", hash_token("t-victim"), frozenset({"victim-team"})),
        ]
    )
    reader = client(url(setuser(admin, prefix, "api")))
    as_llm = {"Authorization": "Bearer t-llm"}
    as_victim = {"Authorization": "Bearer t-victim"}
    with served(LedgerStore(reader, prefix), tokens, cache_s=0) as (base, _app):
        get = lambda path, who, **params: httpx.get(f"{base}{path}", params=params, headers=who, timeout=20)  # noqa: E731
        page = get(f"/api/v1/jobs/{JOB}", as_llm, window=WINDOW)
        hidden = get(f"/api/v1/jobs/{JOB}", as_victim, window=WINDOW)
        listed = get("/api/v1/jobs", as_victim)
        by_team = get("/api/v1/allocation", as_llm, window=WINDOW, aggregate="team")
        focus = get("/api/v1/allocation", as_llm, window=WINDOW, aggregate="job", format="focus")
        alloc = get("/api/v1/allocation", as_llm, window=WINDOW, aggregate="job")
        as_csv = get("/api/v1/allocation", as_llm, window=WINDOW, aggregate="job", format="csv")
    assert page.status_code == 200, page.text
    body = page.json()
    assert (body["team"], body["cost_center"], body["budget"]) == ("llm", "cc-42", "900.000000")
    assert body["attribution"]["team"] == {"value": "llm", "source": "policy rule 1"}
    assert body["attribution"]["price_per_gpu_hour"] == {"value": 4.0, "source": "price:*B300*/*"}
    assert body["attribution"]["cluster"] == {"value": "east", "source": "policy cluster"}
    assert any("price_per_gpu_hour" in w and "ignored" in w for w in body["warnings"]), body["warnings"]
    assert hidden.status_code == 404 and JOB not in [j["job"] for j in listed.json()["jobs"]]
    assert [r["key"] for r in by_team.json()["rows"] if r["key"] != "unassigned"] == ["llm"]
    [row] = [r for r in alloc.json()["rows"] if r["key"] == JOB]
    assert row["attribution"]["cost_center"]["value"] == "cc-42"
    [line] = [r for r in csv.DictReader(io.StringIO(focus.text)) if r["x_TrainingJob"] == JOB]
    assert (line["x_PriceSource"], line["x_OwnerSource"], line["SubAccountId"]) == (
        "price:*B300*/*",
        "policy rule 1",
        "llm",
    )
    [line] = [r for r in csv.DictReader(io.StringIO(as_csv.text)) if r["key"] == JOB]
    assert (line["team"], line["price_source"], line["owner_source"]) == (
        "llm",
        "price:*B300*/*",
        "policy rule 1",
    )
    # The agent keeps the attribution beside the figures; nothing of the trainer's is in it.
    stored = ledger.attribution_of(admin.hgetall(keys.figures_key(prefix, JOB)))
    assert stored.get("team") == "llm" and stored.get("price_per_gpu_hour") == 4.0


def test_a_granted_key_trusts_the_trainer_for_the_jobs_the_rule_matches_only():
    """`grant_meta` is explicit: the trainer's price counts for the jobs of that rule, and every
    other job's meta price is ignored."""
    granted = (PolicyRule(job="llm/*", grants=("price_per_gpu_hour", "team")),)
    cfg = ReplayConfig(policy_rules=granted)
    b = hostile_job(price_per_gpu_hour=2.0, team="llm-infra")
    other = TraceBuilder(n_gpus=1, per_host=1, job="vision/x", seed=9, host_prefix="v")
    other.meta(price_per_gpu_hour=0.01, team="llm-infra")
    other.run("start")
    other.stretch("compute", 60, step_s=4)
    other.run("end")
    samples = b.samples()
    results, un = book_trace(samples, b.events, cfg)
    report = report_of(results, un, cfg)["jobs"][JOB]
    assert report["price_per_gpu_hour"] == 2.0 and report["attribution"]["team"]["value"] == "llm-infra"
    assert report["attribution"]["team"]["source"] == "meta, granted by policy rule 1"
    results, un = book_trace(other.samples(), other.events, cfg)
    report = report_of(results, un, cfg)["jobs"]["vision/x"]
    assert report["price_per_gpu_hour"] == ReplayConfig().prices.price_per_gpu_hour
    assert "team" not in report["attribution"]
    assert set(report["meta_ignored"]) == {"price_per_gpu_hour", "team"}
