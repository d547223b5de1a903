"""A job's terms, one home (`core/terms.job_terms`): the agent, the watcher and replay derive
equal terms from the same meta, registrations, flags, policy and GPUs, and book and judge the
job alike; thresholds that move GPU time are the operator's (flags or --policy), never a
trainer's meta; a policy file given but unusable stops the command with one line."""

from __future__ import annotations

import dataclasses
import json
import uuid

import numpy as np
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from costexporter.core.attribution import Facts
from costexporter.core.booking import BookingConfig
from costexporter.core.cost import Prices
from costexporter.core.model import CATEGORIES
from costexporter.core.pricing import PriceRule, Pricing
from costexporter.core.replay import ReplayConfig, book_trace, report_of
from costexporter.core.terms import (
    Policy,
    PolicyError,
    PolicyRule,
    ignored_meta_note,
    job_terms,
    liveness,
    parse_policy,
    parse_policy_file,
)
from costexporter.services.watcher import WatchConfig, Watcher
from costexporter.sources.synth import TraceBuilder
from costexporter.store import keys, ledger

from .agent_rounds import replay_agent, tick
from .conftest import SHARED_URL
from .test_agent import post_events


def test_policy_rules_pick_a_jobs_terms_by_name_and_namespace_and_never_from_meta():
    flags = BookingConfig(stall_floor_s=60.0)
    rules = parse_policy(
        {
            "rules": [
                {"job": "pretrain-*", "stall_floor_s": 1800},
                {"namespace": "research-*", "stall_k": 8, "checkpoint_allowance_s": 3600},
                {"job": "pretrain-*", "owner": {"team": "llm", "budget": 500}, "price_per_gpu_hour": 3},
            ]
        }
    )
    policy = Policy(flags, Prices(price_per_gpu_hour=2.0), rules)
    meta = {"team": "research", "stall_floor_s": 5, "heartbeat_timeout_s": 900, "price_per_gpu_hour": 4}
    t = job_terms("pretrain-7", meta, policy, [1_000, 2_000])
    assert t.start_ms == 1_000
    # each term from the first rule that matches and sets it; the meta's heartbeat timeout
    # lengthens the liveness timeout; its team and price are not the job's
    assert t.booking == dataclasses.replace(flags, stall_floor_s=1800.0, liveness_timeout_s=900.0)
    assert t.ignored_meta == ("stall_floor_s", "price_per_gpu_hour", "team") and t.heartbeat_timeout_s == 900
    assert t.prices.price_per_gpu_hour == 3 and t.attribution.get("team") == "llm"
    assert t.attribution.source("team") == "policy rule 3" == t.attribution.source("price_per_gpu_hour")
    assert t.attribution.get("budget") == 500
    # a rule matches the namespace the agent read, never the meta's
    t = job_terms("finetune", {**meta, "namespace": "research-a"}, policy, [5])
    assert t.booking == dataclasses.replace(flags, liveness_timeout_s=900.0)
    t = job_terms("finetune", meta, policy, [5], facts=Facts(namespace="research-a", team="rs"))
    assert t.booking == dataclasses.replace(
        flags, stall_k=8.0, checkpoint_allowance_s=3600.0, liveness_timeout_s=900.0
    )
    assert t.attribution.get("team") == "rs" and t.attribution.source("team") == "kubernetes"
    assert t.attribution.get("namespace") == "research-a"
    t = job_terms("finetune", {"team": "llm"}, policy, [5])
    assert t.booking is flags and t.prices == policy.prices and t.attribution.get("team") is None
    # ... or the pod's controlling owner the agent read (never a meta `controller`)
    by_owner = Policy(
        flags, rules=parse_policy({"rules": [{"controller": "llama-*", "owner": {"team": "llm"}}]})
    )
    assert job_terms("ml:x", {"controller": "llama-7"}, by_owner, [0]).attribution.get("team") is None
    owned = job_terms("ml:x", {}, by_owner, [0], facts=Facts("ml", "llama-7", "PyTorchJob"))
    assert owned.attribution.get("team") == "llm" and owned.attribution.source("team") == "policy rule 1"
    assert t.attribution.source("price_per_gpu_hour") == "flags"
    assert max(policy.widest_checkpoint_allowance_s(), 0) == 3600


def test_a_meta_key_counts_only_where_a_rule_grants_it_and_the_ignored_note_names_the_grant():
    rules = parse_policy({"rules": [{"job": "ok-*", "grant_meta": ["price_per_gpu_hour", "cost_center"]}]})
    policy = Policy(BookingConfig(), Prices(price_per_gpu_hour=2.0), rules)
    meta = {"price_per_gpu_hour": 9.0, "cost_center": "cc-1", "team": "victims"}
    t = job_terms("ok-1", meta, policy, [0])
    assert t.prices.price_per_gpu_hour == 9.0 and t.attribution.get("cost_center") == "cc-1"
    assert t.ignored_meta == ("team",) and t.attribution.get("team") is None
    assert "granted by policy rule 1" in (t.attribution.source("cost_center") or "")
    t = job_terms("other", meta, policy, [0])
    assert t.prices.price_per_gpu_hour == 2.0 and t.attribution.get("cost_center") is None
    assert set(t.ignored_meta) == {"price_per_gpu_hour", "cost_center", "team"}
    note = ignored_meta_note("other", t.ignored_meta)
    assert "grant_meta: [price_per_gpu_hour, team, cost_center]" in note and "\n" not in note
    # a granted value that is not usable is not used (nor is a hostile one: 1e300, nan, a list)
    for bad in (float("nan"), 1e300, -1.0, [1], "cheap"):
        t = job_terms("ok-1", {"price_per_gpu_hour": bad}, policy, [0])
        assert t.prices.price_per_gpu_hour == 2.0


def test_the_price_table_prices_by_gpu_model_and_node_pool_from_its_dates():
    doc = {
        "cluster": "east",
        "node_pools": {"spot": "spot-*"},
        "prices": [
            {"gpu_model": "*H100*", "node_pool": "spot", "price_per_gpu_hour": 1.0},
            {"gpu_model": "*h100*", "price_per_gpu_hour": 2.5},
            {"gpu_model": "*H100*", "price_per_gpu_hour": 3.0, "from": "2026-11-01T00:05:00Z"},
        ],
    }
    pf = parse_policy_file(doc)
    policy = Policy(BookingConfig(), Prices(price_per_gpu_hour=3.5), pf.rules, pf.pricing)
    change = 1_793_491_500_000
    t = job_terms("j", {}, policy, [0], gpu_model="NVIDIA H100 80GB HBM3", host="n1")
    assert t.schedule is not None and t.schedule.at(change - 1).price_per_gpu_hour == 2.5
    assert t.schedule.at(change).price_per_gpu_hour == 3.0 == t.prices.price_per_gpu_hour
    assert t.schedule.version_at(change - 1) != t.schedule.version_at(change)
    assert t.attribution.get("cluster") == "east"
    spot = job_terms("j", {}, policy, [0], gpu_model="NVIDIA H100", host="spot-3")
    assert spot.schedule is not None and spot.schedule.at(0).price_per_gpu_hour == 1.0
    assert spot.attribution.get("node_pool") == "spot"
    other = job_terms("j", {"gpu_model": "NVIDIA H100"}, policy, [0], gpu_model="NVIDIA A100", host="n1")
    assert other.prices.price_per_gpu_hour == 3.5  # the flags': the meta's model is not the GPU's
    with pytest.raises(PolicyError, match="5-minute boundary"):
        parse_policy_file({"prices": [{"price_per_gpu_hour": 1, "from": "2026-11-01T00:01:00Z"}]})


@pytest.mark.parametrize(
    "doc",
    [
        [1, 2],
        {"rules": {"job": "x"}},
        {"rules": [{"job": "x"}]},  # sets nothing
        {"rules": [{"job": "x", "stall_floor": 5}]},  # unknown key (a typo)
        {"rules": [{"job": "x", "stall_floor_s": -5}]},
        {"rules": [{"job": "x", "stall_floor_s": "soon"}]},
        {"rules": [{"job": 7, "stall_floor_s": 5}]},
        {"policy": []},
        {"rules": [{"team": "research", "stall_k": 8}]},  # a trainer writes its meta team
        {"rules": [{"job": "x", "owner": {"team": ""}}]},
        {"rules": [{"job": "x", "owner": {"tenant": "a"}}]},
        {"rules": [{"job": "x", "grant_meta": ["stall_floor_s"]}]},
        {"rules": [{"job": "x", "price_per_gpu_hour": -1}]},
        {"prices": [{"gpu_model": "*", "price_per_gpu_hour": "cheap"}]},
        {"prices": [{"node_pool": "nope", "price_per_gpu_hour": 1}]},
        {"prices": [{"price_per_gpu_hour": 1, "from": "next week"}]},
        {"node_pools": ["a"]},
    ],
)
def test_an_unusable_policy_is_refused_with_one_line(doc):
    with pytest.raises(PolicyError) as e:
        parse_policy(doc, "p.yaml")
    assert "\n" not in str(e.value) and str(e.value).startswith("p.yaml")


@pytest.mark.parametrize("command", ["replay", "watch"])
@pytest.mark.parametrize(
    "text",
    [None, "rules: [", '{"rules": [{"job": "x", "stall_floor_s": 0}]}'],
    ids=["missing", "yaml", "zero"],
)
def test_a_policy_file_given_but_unusable_stops_the_command(cli, tmp_path, command, text):
    path = tmp_path / "policy.yaml"
    if text is not None:
        path.write_text(text)
    ex = ["--samples", "examples/r1-mini/node0.csv"] if command == "replay" else ["--once", "--port", "0"]
    r = cli(command, "--policy", str(path), *ex)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--policy" in r.stderr and "Traceback" not in r.stderr
    assert len([ln for ln in r.stderr.splitlines() if "--policy" in ln]) == 1


def _job(name: str, meta: dict) -> TraceBuilder:
    """Two GPUs on one host: steps, a 100 s stop (a stall under a 60 s floor, not under 1800 s),
    steps again, the run's end."""
    b = TraceBuilder(n_gpus=2, per_host=2, job=name, seed=5)
    if meta:
        b.meta(**meta)
    b.run("start")
    b.stretch("compute", 120, step_s=5)
    b.stretch("idle", 100)
    b.stretch("compute", 60, step_s=5)
    b.run("end")
    b.stretch("idle", 5)
    return b


META = st.fixed_dictionaries(
    {},
    optional={
        "stall_floor_s": st.sampled_from([30.0, 1800.0]),
        "checkpoint_allowance_s": st.sampled_from([60.0, 3600.0]),
        "heartbeat_timeout_s": st.sampled_from([120.0, 900.0]),
        "price_per_gpu_hour": st.sampled_from([2.0, 5.0]),
        "team": st.sampled_from(["llm", "research"]),
        "cost_center": st.sampled_from(["cc-1", "cc-victim"]),
    },
)
RULES = st.sampled_from(
    [
        (),
        (PolicyRule((("stall_floor_s", 1800.0),), namespace="research"),),  # no facts: no match
        (
            PolicyRule((("stall_floor_s", 1800.0), ("stall_k", 6.0)), job="terms-*"),
            PolicyRule(job="terms-*", owner=(("team", "llm"),), grants=("cost_center",)),
        ),
        (PolicyRule(job="terms-*", price=4.1),),
        (PolicyRule(job="terms-*", grants=("price_per_gpu_hour",)),),
    ]
)
# The trace starts at 22:46:40 UTC; 22:50:00 is a bucket boundary inside it.
CHANGE_MS = 1_753_570_200_000
PRICING = st.sampled_from(
    [
        Pricing(),
        Pricing((PriceRule(2.5, "*B300*"),), cluster="east"),
        Pricing(
            (PriceRule(2.5, "*B300*", "pool"), PriceRule(4.75, "*B300*", None, CHANGE_MS, name="later")),
            (("pool", "*"),),
        ),
    ]
)


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    meta=META,
    rules=RULES,
    pricing=PRICING,
    floor=st.sampled_from([20.0, 60.0]),
    price=st.sampled_from([3.5, 2.0]),
)
def test_the_agent_the_watcher_and_replay_derive_equal_terms_and_book_and_judge_alike(
    meta, rules, pricing, floor, price
):
    """Same meta, registrations, flags, policy and GPUs: equal terms in all three programs; the
    agent's ledger equals replay's to the millisecond and micro-unit, a price change inside the
    job included; the price and owner are the operator's unless a rule grants the meta's; the
    watcher's stall threshold is the ledger's."""
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    shared = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    booking, prices = BookingConfig(stall_floor_s=floor), Prices(price_per_gpu_hour=price)
    b = _job(f"terms-{uuid.uuid4().hex[:6]}", meta)
    rcfg = ReplayConfig(booking=booking, prices=prices, policy_rules=rules, pricing=pricing)
    try:
        post_events(shared, prefix, b)
        [r], _ = book_trace(b.samples(), b.events, rcfg)
        offline = r.terms
        # The watcher first: the agent trims the stream it has read (no watcher registered).
        w = Watcher(  # given the job: its view stays after a poll that finds it done
            WatchConfig(
                redis_url=SHARED_URL,
                prefix=prefix,
                booking=booking,
                policy_rules=rules,
                clock=lambda: b.t,
                jobs=(b.job,),
            )
        )
        try:
            st_ = w.poll()[b.job]
            judged = w.views[b.job].judged_terms
        finally:
            w.stop()
        agent, now = replay_agent(
            b,
            prefix=prefix,
            agent_id="t",
            job_refresh_s=0,
            booking=booking,
            prices=prices,
            policy_rules=rules,
            pricing=pricing,
        )
        for _ in range(8):
            tick(agent, now, 50)
        live = agent.jobs[b.job].terms
        assert offline is not None and live is not None and judged is not None
        # Equal terms: what the operator sets, what the meta may set, what it may not.
        policy = Policy(booking, prices, rules, pricing)
        want = liveness(policy.booking_for(b.job), meta)
        assert offline.booking == live.booking == judged.booking == want
        assert offline.start_ms == live.start_ms == judged.start_ms
        assert offline.prices == live.prices and offline.schedule == live.schedule
        assert offline.attribution == live.attribution
        granted = {g for rule in rules for g in rule.grants}
        if "price_per_gpu_hour" in meta and "price_per_gpu_hour" not in granted:
            assert offline.attribution.source("price_per_gpu_hour") != "meta"
        if "team" in meta:  # never the trainer's team
            assert offline.attribution.get("team") in (None, "llm")
            assert offline.attribution.source("team") in (None, "policy rule 2")
        assert offline.ignored_meta == live.ignored_meta == judged.ignored_meta
        operator = {"stall_floor_s", "checkpoint_allowance_s", "price_per_gpu_hour", "team", "cost_center"}
        assert set(offline.ignored_meta) == (set(meta) & operator) - granted
        hb = (offline.heartbeat_timeout_s, live.heartbeat_timeout_s, judged.heartbeat_timeout_s)
        assert hb == (meta.get("heartbeat_timeout_s"),) * 3
        assert offline.profile is not None and live.profile is not None
        assert offline.profile.name == live.profile.name
        # Booked alike: the agent's ledger is replay's, time and money.
        total = ledger.read_amounts(shared, prefix, b.job)
        ms = np.bincount(r.pieces.category, weights=r.pieces.dur_ms, minlength=len(CATEGORIES))
        assert {c: v for c, v in ledger.net_ms(total).items() if v} == {
            c: int(v) for c, v in zip(CATEGORIES, ms, strict=True) if v
        }
        report = report_of([r], {}, rcfg)
        ucost = sum(total.get(f"{c}:ucost", 0) for c in CATEGORIES)
        assert ucost / 1e6 == pytest.approx(report["jobs"][b.job]["cost_total"], abs=1e-4)
        # The ledger keeps the attribution the API reads, and each bucket its price's version.
        figures = shared.hgetall(keys.figures_key(prefix, b.job))
        assert ledger.attribution_of(figures) == dataclasses.replace(live.attribution, granted_price=None)
        assert report["jobs"][b.job]["attribution"] == live.attribution.report()
        versions = {
            shared.hget(keys.bucket_key(prefix, b.job, "5m", t), "price_version")
            for t in (CHANGE_MS // 1000 - 300, CHANGE_MS // 1000)
        }
        dated = len(pricing.table) == 2 and live.attribution.granted_price is None
        assert len(versions) == (2 if dated else 1)
        # Judged alike: the watcher's stall threshold is the ledger's timeline's.
        assert st_.stall_threshold_s == r.timeline.stall_threshold_ms / 1000
        if offline.ignored_meta:
            assert {k for (j, k) in agent.meta_ignored if j == b.job} == set(offline.ignored_meta)
            assert {k for (j, k) in w.meta_ignored if j == b.job} == set(offline.ignored_meta)
    finally:
        keys_ = list(shared.scan_iter(f"{prefix}:*"))
        if keys_:
            shared.delete(*keys_)


def test_replay_ignores_and_says_a_meta_that_sets_a_booking_threshold():
    b = _job("said", {"stall_floor_s": 1800.0})
    cfg = ReplayConfig(booking=BookingConfig(stall_floor_s=60.0))
    [r], un = book_trace(b.samples(), b.events, cfg)
    report = report_of([r], un, cfg)["jobs"]["said"]
    assert report["meta_ignored"] == ["stall_floor_s"]
    assert r.timeline.stall_threshold_ms == 60_000  # the flags' floor, not the meta's 1800 s
    json.dumps(report)


@given(
    policy_s=st.floats(1, 10_000),
    longest_s=st.floats(1, 100_000),
    asked=st.one_of(st.none(), st.floats(-10, 200_000), st.just("nan"), st.just(True), st.text(max_size=3)),
)
def test_a_jobs_meta_lengthens_its_liveness_timeout_up_to_the_operators_longest_and_never_shortens_it(
    policy_s, longest_s, asked
):
    """Where a crashed run's claim ends moves money: the operator's timeout is the floor, their
    longest the ceiling; the job's meta `heartbeat_timeout_s` moves it only between them, and a
    meta `liveness_timeout_s` is ignored like any threshold."""
    booking = BookingConfig(liveness_timeout_s=policy_s, liveness_timeout_max_s=longest_s)
    meta = {"heartbeat_timeout_s": asked, "liveness_timeout_s": 1.0, "liveness_timeout_max_s": 1e9}
    terms = job_terms("j", meta, Policy(booking), [0])
    got = terms.booking
    assert got.liveness_timeout_s >= policy_s
    assert got.liveness_timeout_s <= max(policy_s, longest_s)
    assert got.liveness_timeout_max_s == longest_s  # (what a job that posts no heartbeat gets)
    if isinstance(asked, float) and policy_s < asked < longest_s:
        assert got.liveness_timeout_s == asked
    assert {"liveness_timeout_s", "liveness_timeout_max_s"} <= set(terms.ignored_meta)
    rule = parse_policy({"rules": [{"job": "j*", "liveness_timeout_s": 30, "liveness_timeout_max_s": 60}]})
    assert job_terms("job", {}, Policy(booking, rules=rule), [0]).booking.liveness_timeout_s == 30
