"""The OpenCost allocation API over real HTTP against a real Redis ledger: OpenCost's envelope,
names and numeric types; its aggregate, step, accumulate and filter vocabulary; every parameter
it does not honour refused by name; windows off the 5-minute buckets said, never widened in
silence; team-scoped tokens; the finance API under /api/v1 unchanged beside it."""

from __future__ import annotations

import datetime as dt

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from costexporter.api import opencost as oc
from costexporter.api.auth import Tokens, hash_token
from costexporter.core.model import Category
from costexporter.core.timeutil import iso_utc
from costexporter.store import keys, ledger
from costexporter.store.ledger_read import LedgerStore

from .api_helpers import PRICE_VERSION, T0, WINDOW, served, write_job

DAY = "2025-07-26T00:00:00Z,2025-07-27T00:00:00Z"
PATHS = ["/allocation", "/allocation/compute", "/model/allocation"]


@pytest.fixture
def store(shared, prefix):
    """Four jobs: two of team llm (namespaces ns-a, ns-b; one a PyTorchJob of cluster east), one
    of team vision (ns-a), one with no meta; and 0.5 GPU-h no job registered. Each job books
    2 GPU-h productive and 0.2 GPU-h stalled, 7.70 over the two hours from T0 (12:00 UTC)."""
    write_job(shared, prefix, "llm-1", "llm", namespace="ns-a", cluster="east", controller_kind="pytorchjob")
    write_job(shared, prefix, "llm-2", "llm", namespace="ns-b", project="atlas")
    write_job(shared, prefix, "vis-1", "vision", namespace="ns-a", project="atlas")
    write_job(shared, prefix, "bare", None)
    u = np.zeros((len(Category), 3), np.int64)
    u[Category.UNASSIGNED] = [1_800_000, 0, 1_750_000]
    pipe = shared.pipeline()
    ledger.queue_amounts(pipe, prefix, ledger.UNASSIGNED_JOB, {T0: u}, PRICE_VERSION)
    pipe.execute()
    return LedgerStore(shared, prefix)


def get(url: str, path: str = "/allocation", headers: dict | None = None, **params) -> httpx.Response:
    return httpx.get(url + path, params=params, headers=headers, timeout=30)


def test_envelope_names_and_numeric_types(store):
    with served(store, cluster="west") as (url, _):
        for path in PATHS:
            r = get(url, path, window=DAY, aggregate="controller", accumulate="true")
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["code"] == 200 and body["status"] == "success" and "warning" not in body
            assert isinstance(body["data"], list) and len(body["data"]) == 1
            (allocs,) = body["data"]
            assert sorted(allocs) == ["bare", "llm-2", "pytorchjob:llm-1", "vis-1"]
            a = allocs["pytorchjob:llm-1"]
            assert a["name"] == "pytorchjob:llm-1"
            for k in ("totalCost", "gpuCost", "gpuHours", "minutes", "gpuCount", "cpuCost", "ramCost",
                      "pvCost", "networkCost", "sharedCost", "externalCost", "totalEfficiency"):  # fmt: skip
                assert type(a[k]) is float, (k, a[k])
            assert a["gpuHours"] == pytest.approx(2.2) and a["totalCost"] == pytest.approx(7.7)
            assert a["gpuCost"] == a["totalCost"] and a["cpuCost"] == 0.0
            assert a["minutes"] == 1440.0 and a["gpuCount"] == pytest.approx(2.2 / 24, abs=1e-6)
            assert a["window"] == {"start": "2025-07-26T00:00:00Z", "end": "2025-07-27T00:00:00Z"}
            assert a["start"] == "2025-07-26T00:00:00Z" and a["end"] == "2025-07-27T00:00:00Z"
            assert a["properties"]["controller"] == "llm-1"
            assert a["properties"]["controllerKind"] == "pytorchjob"
            assert a["properties"]["namespace"] == "ns-a"
            assert a["properties"]["cluster"] == "east"  # the meta's, not the API's default
            assert a["properties"]["labels"]["team"] == "llm"
            assert allocs["llm-2"]["properties"]["cluster"] == "west"  # the API's --cluster
            assert a["validSteps"] == 10 and a["costPerValidStep"] == pytest.approx(0.77)
            assert a["gpuEfficiency"] == pytest.approx(2 / 2.2, abs=1e-6)
    # /api/v1 stays as it was: money a string, its own names
    with served(store) as (url, _):
        r = get(url, "/api/v1/allocation", window=DAY)
        rows = {x["key"]: x for x in r.json()["rows"]}
        assert rows["llm-1"]["cost"] == "7.700000" and "totalCost" not in rows["llm-1"]


def test_aggregates(store):
    with served(store) as (url, _):
        ns = get(url, window=DAY, aggregate="namespace").json()["data"][0]
        assert sorted(ns) == ["__unallocated__", "ns-a", "ns-b"]
        assert ns["ns-a"]["totalCost"] == pytest.approx(15.4)  # llm-1 + vis-1
        assert ns["ns-a"]["properties"] == {"namespace": "ns-a"}  # only what both share
        team = get(url, window=DAY, aggregate="label:team").json()["data"][0]
        assert sorted(team) == ["__unallocated__", "llm", "vision"]
        assert team["llm"]["totalCost"] == pytest.approx(15.4)
        assert get(url, window=DAY, aggregate="team").json()["data"][0].keys() == team.keys()
        both = get(url, window=DAY, aggregate="namespace,label:team").json()["data"][0]
        assert sorted(both) == ["__unallocated__/__unallocated__", "ns-a/llm", "ns-a/vision", "ns-b/llm"]
        everything = get(url, window=DAY, aggregate="all").json()["data"][0]
        assert list(everything) == [""] and everything[""]["totalCost"] == pytest.approx(4 * 7.7)
        clusters = get(url, window=DAY, aggregate="cluster").json()["data"][0]
        assert sorted(clusters) == ["__unallocated__", "east"]
        default = get(url, window=DAY).json()["data"][0]  # no aggregate: per training job
        assert sorted(default) == ["bare", "llm-2", "pytorchjob:llm-1", "vis-1"]
        # finer than the ledger books: every allocation's pod is __unallocated__, and said
        pods = get(url, window=DAY, aggregate="namespace,pod").json()
        assert sorted(pods["data"][0]) == [
            "__unallocated__/__unallocated__",
            "ns-a/__unallocated__",
            "ns-b/__unallocated__",
        ]
        assert "not per pod" in pods["warning"]
        # a per-kind aggregate: the controller where its kind is that one (OpenCost's semantics)
        jobs = get(url, window=DAY, aggregate="statefulset").json()["data"][0]
        assert list(jobs) == ["__unallocated__"] and jobs["__unallocated__"]["totalCost"] == pytest.approx(
            4 * 7.7
        )
        kinds = get(url, window=DAY, aggregate="controllerKind").json()["data"][0]
        assert sorted(kinds) == ["__unallocated__", "pytorchjob"]
        for agg, word in (
            ("annotation:x", "annotations"),
            ("service", "not recorded"),
            ("bogus", "supported"),
        ):
            r = get(url, window=DAY, aggregate=agg)
            assert r.status_code == 400 and word in r.json()["message"], (agg, r.text)
            assert r.json()["code"] == 400 and r.json()["status"] == "error"


def test_steps_and_accumulate(store):
    with served(store) as (url, _):
        # OpenCost's accumulate default is false: step=1h over a day is 24 sets
        sets = get(url, window=DAY, step="1h", aggregate="controller").json()["data"]
        assert len(sets) == 24
        assert sets[12]["llm-2"]["start"] == "2025-07-26T12:00:00Z"
        assert sets[12]["llm-2"]["totalCost"] == pytest.approx(3.85)
        assert sum(s.get("llm-2", {}).get("totalCost", 0) for s in sets) == pytest.approx(7.7)
        for step, n in (("2h", 12), ("24h", 1), ("1d", 1), ("90m", 16), ("1h30m", 16), ("6h", 4)):
            data = get(url, window=DAY, step=step).json()["data"]
            assert len(data) == n, step
            assert sum(x["totalCost"] for d in data for x in d.values()) == pytest.approx(4 * 7.7)
        two_days = get(url, window=WINDOW, step="1d").json()["data"]
        assert len(two_days) == 2  # step=1d does not accumulate unless asked
        one = get(url, window=WINDOW, step="1d", accumulate="true").json()["data"]
        assert len(one) == 1 and one[0]["llm-2"]["window"]["end"] == "2025-07-28T00:00:00Z"
        for bad in ("7m", "0h", "1x", "-1h"):
            r = get(url, window=DAY, step=bad)
            assert r.status_code == 400 and "step" in r.json()["message"], bad
        assert get(url, window=DAY, accumulate="maybe").status_code == 400


def test_filters(store):
    with served(store, cluster="west") as (url, _):

        def names(f: str) -> list[str]:
            r = get(url, window=DAY, aggregate="controller", filter=f)
            assert r.status_code == 200, r.text
            return sorted(r.json()["data"][0])

        assert names('namespace:"ns-a"') == ["pytorchjob:llm-1", "vis-1"]
        assert names('namespace:"ns-a","ns-b"') == ["llm-2", "pytorchjob:llm-1", "vis-1"]
        assert names('namespace!:"ns-a"') == ["bare", "llm-2"]
        assert names('namespace!:"ns-a","ns-b"') == ["bare"]
        assert names('controllerName:"llm-2"') == ["llm-2"]
        assert names('controllerName<~:"llm"') == ["llm-2", "pytorchjob:llm-1"]
        assert names('controllerName~>:"-1"') == ["bare", "pytorchjob:llm-1", "vis-1"][1:]
        assert names('controllerKind:"pytorchjob"') == ["pytorchjob:llm-1"]
        assert names('label[team]:"llm"') == ["llm-2", "pytorchjob:llm-1"]
        assert names('label[project]:"atlas"+namespace:"ns-a"') == ["vis-1"]
        assert names('label[project]:"atlas"|controllerName:"bare"') == ["bare", "llm-2", "vis-1"]
        assert names('(namespace:"ns-b"|namespace:"ns-a")+label[team]:"vision"') == ["vis-1"]
        assert names('cluster:"west"') == ["bare", "llm-2", "vis-1"]
        assert names('namespace:"kube-system"') == []  # filtered to nothing: not everything
        for bad, word in (('pod:"x"', "not supported"), ('namespace:"a"+', "expected"),
                          ('namespace:"a"|namespace:"b"+namespace:"c"', "parentheses"),
                          ("namespace:ns-a", "quoted"), ('(namespace:"a"', "matching"),
                          ('wat:"x"', "not known")):  # fmt: skip
            r = get(url, window=DAY, filter=bad)
            assert r.status_code == 400 and word in r.json()["message"], (bad, r.text)


@pytest.mark.parametrize(
    "param,value",
    [("includeIdle", "maybe"), ("shareIdle", "true"), ("resolution", "1h"), ("resolution", "soon"),
     ("accumulateBy", "day"), ("idleByNode", "true"), ("sharelb", "true"), ("filterClusters", "east"),
     ("shareNamespaces", "kube-system"), ("includeAggregatedMetadata", "true"), ("nonsense", "1")],
)  # fmt: skip
def test_parameters_not_honoured_are_400_naming_them(store, param, value):
    with served(store) as (url, _):
        r = get(url, window=DAY, **{param: value})
        assert r.status_code == 400, r.text
        assert param in r.json()["message"] and r.json()["code"] == 400
        # the same parameter twice is refused too, not resolved by a guess
        r = httpx.get(url + "/allocation", params=[("window", DAY), ("window", "1d")], timeout=30)
        assert r.status_code == 400 and "more than once" in r.json()["message"]


@pytest.mark.parametrize(
    "params",
    [{"idleByNode": "false", "sharelb": "false", "includeAggregatedMetadata": "false",
      "includeProportionalAssetResourceCosts": "false", "includeSharedCostBreakdown": "false",
      "reconcile": "false", "shareTenancyCosts": "false"},
     {"resolution": "1m"}, {"resolution": "5m"},
     {"filterClusters": "", "filterControllers": "", "filterLabels": "", "shareNamespaces": "",
      "shareLabels": "", "shareCost": "0", "shareSplit": "weighted"}],
)  # fmt: skip
def test_parameters_whose_value_changes_nothing_are_accepted_and_said(store, params):
    """What OpenCost clients send on every call: the same answer as without them; a non-empty
    one said in `warning`."""
    with served(store) as (url, _):
        plain = get(url, window=DAY).json()
        r = get(url, window=DAY, **params)
        assert r.status_code == 200, r.text
        assert r.json()["data"] == plain["data"]
        said = [k for k, v in params.items() if v and v != "0" and f"{k}={v}" in r.json().get("warning", "")]
        assert said == [k for k, v in params.items() if v and v != "0"]


def test_filter_namespaces_and_idle_are_opencosts_older_names(store):
    with served(store) as (url, _):
        one = get(url, window=DAY, filterNamespaces="ns-a").json()["data"][0]
        assert sorted(one) == ["pytorchjob:llm-1", "vis-1"]
        assert get(url, window=DAY, filter='namespace:"ns-a"').json()["data"][0] == one
        two = get(url, window=DAY, filterNamespaces="ns-a,ns-b", filter='label[team]:"llm"').json()["data"][0]
        assert sorted(two) == ["llm-2", "pytorchjob:llm-1"]
        idle = get(url, window=DAY, idle="true").json()["data"][0]
        assert idle["__idle__"]["gpuHours"] == pytest.approx(0.5)
        assert get(url, window=DAY, idle="true", includeIdle="true").json()["data"][0] == idle
        r = get(url, window=DAY, idle="true", includeIdle="false")
        assert r.status_code == 400 and "disagree" in r.json()["message"]


def test_idle(store):
    with served(store) as (url, _):
        data = get(url, window=DAY, includeIdle="true", shareIdle="false").json()["data"][0]
        assert data["__idle__"]["gpuHours"] == pytest.approx(0.5)
        assert data["__idle__"]["totalCost"] == pytest.approx(1.75)
        assert "__idle__" not in get(url, window=DAY).json()["data"][0]
        r = get(url, window=DAY, includeIdle="true", filter='namespace:"ns-a"').json()
        assert "__idle__" not in r["data"][0] and "__idle__" in r["warning"]


def test_windows_off_buckets_say_the_window_used(store):
    with served(store) as (url, _):
        r = get(url, window="2025-07-26T12:02:00Z,2025-07-26T13:58:00Z").json()
        a = r["data"][0]["llm-2"]
        assert a["window"] == {"start": "2025-07-26T12:00:00Z", "end": "2025-07-26T14:00:00Z"}
        assert "12:02:00" in r["warning"]
        assert "used 2025-07-26T12:00:00Z to 2025-07-26T14:00:00Z" in r["warning"]
        exact = get(url, window="2025-07-26T12:00:00Z,2025-07-26T13:00:00Z").json()
        assert "warning" not in exact and exact["data"][0]["llm-2"]["minutes"] == 60.0
        unix = get(url, window=f"{T0},{T0 + 3600}").json()
        assert unix["data"][0]["llm-2"]["totalCost"] == pytest.approx(3.85)
        assert get(url, window="3h").json()["data"][0]["llm-2"]["minutes"] == 180.0  # not 3h05m
        for bad in ("", "soon", "2025-07-27T00:00:00Z,2025-07-26T00:00:00Z", "2025-07-26T00:00:00,1"):
            r = get(url, window=bad)
            msg = r.json()["message"]
            assert r.status_code == 400 and ("window" in msg or "RFC 3339" in msg), (bad, msg)


NOW = dt.datetime(2025, 7, 30, 10, 17, 31, tzinfo=dt.timezone.utc).timestamp()  # a Wednesday


@pytest.mark.parametrize(
    "text,start,end",
    [("3h", "2025-07-30T08:00:00Z", "2025-07-30T11:00:00Z"),
     ("24h", "2025-07-29T11:00:00Z", "2025-07-30T11:00:00Z"),
     ("1d", "2025-07-30T00:00:00Z", "2025-07-31T00:00:00Z"),
     ("7d", "2025-07-24T00:00:00Z", "2025-07-31T00:00:00Z"),
     ("45m", "2025-07-30T09:35:00Z", "2025-07-30T10:20:00Z"),
     ("today", "2025-07-30T00:00:00Z", "2025-07-31T00:00:00Z"),
     ("yesterday", "2025-07-29T00:00:00Z", "2025-07-30T00:00:00Z"),
     ("week", "2025-07-27T00:00:00Z", "2025-07-30T10:20:00Z"),
     ("lastweek", "2025-07-20T00:00:00Z", "2025-07-27T00:00:00Z"),
     ("lastmonth", "2025-06-01T00:00:00Z", "2025-07-01T00:00:00Z")],
)  # fmt: skip
def test_window_words_as_opencost_resolves_them(text, start, end):
    w = oc.parse_window(text, "UTC", NOW)
    assert (iso_utc(w.start), iso_utc(w.end)) == (start, end) and w.exact


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(a=st.integers(0, 4_000_000_000), n=st.integers(1, 400 * 86400))
def test_window_used_holds_the_asked_one_and_is_exact_when_it_can_be(a, n):
    w = oc.parse_window(f"{a},{a + n}", "UTC", NOW)
    assert w.start <= a and w.end >= a + n and w.start % 300 == 0 and w.end % 300 == 0
    assert w.end - w.start < n + 600  # never more than a bucket on each side
    assert w.exact == (a % 300 == 0 and (a + n) % 300 == 0)


def test_team_token_sees_its_team_only(store):
    tokens = Tokens([("llm", hash_token("t-llm"), frozenset({"llm"}))])
    with served(store, tokens) as (url, _):
        assert get(url, window=DAY).status_code == 401
        h = {"Authorization": "Bearer t-llm"}
        data = get(url, headers=h, window=DAY).json()["data"][0]
        assert sorted(data) == ["llm-2", "pytorchjob:llm-1"]
        assert sorted(get(url, headers=h, window=DAY, aggregate="all").json()["data"][0]) == [""]
        everything = get(url, headers=h, window=DAY, aggregate="all").json()["data"][0]
        assert everything[""]["totalCost"] == pytest.approx(15.4)
        r = get(url, headers=h, window=DAY, includeIdle="true")  # kubectl-cost's default
        assert (
            r.status_code == 200
            and "__idle__" not in r.json()["data"][0]
            and "every team" in r.json()["warning"]
        )


def test_redis_down_is_503(shared, prefix):
    import redis

    from .redis_server import free_port

    client = redis.Redis(port=free_port(), decode_responses=True, socket_connect_timeout=0.5)
    dead = LedgerStore(client, prefix)
    with served(dead) as (url, _):
        r = get(url, window=DAY)
        assert r.status_code == 503


def test_hostile_meta_does_not_break_the_answer(shared, prefix):
    write_job(shared, prefix, "odd", "t", namespace="", cluster="c/1")
    shared.hset(keys.meta_key(prefix, "odd"), mapping={"weird key!": "v", "controller_kind": ""})
    with served(LedgerStore(shared, prefix)) as (url, _):
        d = get(url, window=DAY, aggregate="namespace,cluster").json()["data"][0]
        assert list(d) == ["__unallocated__/c%2F1"]  # OpenCost clients split names on "/"
        assert d["__unallocated__/c%2F1"]["properties"]["labels"]["weird_key_"] == "v"
        assert d["__unallocated__/c%2F1"]["properties"]["cluster"] == "c/1"
        assert list(get(url, window=DAY, filter='label[weird key!]:"v"').json()["data"][0]) == ["odd"]
