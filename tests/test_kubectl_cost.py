"""`kubectl cost` works unchanged: every subcommand's request, with its flags as kubectl-cost
sends them (tests/kubectl_cost.py, ported from its source), answered over real HTTP; the
reply unmarshals as kubectl-cost's Go types do and its table logic builds every row (a name
with a "/" of its own made kubectl-cost panic); the money is the ledger's."""

from __future__ import annotations

import itertools

import httpx
import pytest

from costexporter.api.auth import Tokens, hash_token
from costexporter.core.attribution import Attribution
from costexporter.store import ledger
from costexporter.store.ledger_read import LedgerStore

from . import kubectl_cost as kc
from .api_helpers import served, write_job

DAY = "2025-07-26T00:00:00Z,2025-07-27T00:00:00Z"


@pytest.fixture
def store(shared, prefix):
    """A PyTorchJob the Kubernetes path registered (named `ml:llama-ft`, its controller
    `llama-ft` of kind PyTorchJob in namespace ml), a Deployment's job, a team-scoped trainer's
    job whose name holds a "/", and a job with no owner at all; each 7.70 over the day."""
    write_job(shared, prefix, "ml:llama-ft", None, app="llama")
    write_job(shared, prefix, "serving:vllm", None)
    write_job(shared, prefix, "llm/pretrain", "llm", app="pre/train")
    write_job(shared, prefix, "bare", None)
    pipe = shared.pipeline()
    for job, ns, name, kind in (
        ("ml:llama-ft", "ml", "llama-ft", "PyTorchJob"),
        ("serving:vllm", "serving", "vllm", "Deployment"),
    ):
        vals = (("namespace", ns), ("controller", name), ("controller_kind", kind), ("cluster", "east"))
        ledger.queue_attribution(
            pipe, prefix, job, Attribution(vals, tuple((k, "kubernetes") for k, _ in vals))
        )
    pipe.execute()
    return LedgerStore(shared, prefix)


CASES = [
    (sub, flags)
    for sub in kc.SUBCOMMANDS
    for flags in ({}, {"idle": False}, {"namespace": "ml"}, {"window": "1d"})
    if not (flags.get("namespace") and sub not in kc.NAMESPACE_FLAG)
]


@pytest.mark.parametrize(
    ("sub", "flags"), CASES, ids=[f"{s}-{'-'.join(map(str, f.items())) or 'plain'}" for s, f in CASES]
)
def test_every_kubectl_cost_request_is_answered_and_its_table_builds(store, sub, flags):
    flags = {"window": DAY, **flags}
    params = kc.request(sub, **flags)
    with served(store) as (url, _):
        r = httpx.get(url + "/allocation/compute", params=params, timeout=30)
    assert r.status_code == 200, (params, r.text[:300])
    (allocs,) = kc.unmarshal(r.json())
    rows = kc.table(kc.aggregation_of(sub), allocs, monthly=True)
    assert rows or flags["window"] == "1d"  # (1d: the day before now, no booked time)
    if flags["window"] == "1d":
        return
    assert any(row.fields[0] == "__idle__" for row in rows) == (
        flags.get("idle", True) and not flags.get("namespace")
    )
    if flags.get("namespace"):
        assert {row.fields[1] for row in rows} == {"ml"}


def test_kubectl_cost_sees_controllers_and_namespaces_as_opencost_names_them(store):
    """`kubectl cost controller`: the PyTorchJob as `pytorchjob:llama-ft` in namespace ml (not the
    job's name `ml:llama-ft`); `kubectl cost deployment`: the Deployment's job; the money each
    row shows is the ledger's (historical: the window's cost)."""
    with served(store) as (url, _):
        got = {}
        for sub in ("controller", "deployment", "namespace"):
            body = httpx.get(
                url + "/allocation/compute", params=kc.request(sub, window=DAY, idle=False), timeout=30
            ).json()
            got[sub] = {
                tuple(r.fields): r.total
                for r in kc.table(kc.aggregation_of(sub), body["data"][0], monthly=False)
            }
    assert got["controller"] == {
        ("east", "ml", "pytorchjob:llama-ft"): pytest.approx(7.7),
        ("east", "serving", "deployment:vllm"): pytest.approx(7.7),
        ("__unallocated__", "__unallocated__", "llm%2Fpretrain"): pytest.approx(7.7),
        ("__unallocated__", "__unallocated__", "bare"): pytest.approx(7.7),
    }
    assert got["deployment"] == {
        ("east", "serving", "vllm"): pytest.approx(7.7),
        ("east", "ml", "__unallocated__"): pytest.approx(7.7),
        ("__unallocated__", "__unallocated__", "__unallocated__"): pytest.approx(15.4),
    }
    assert sum(got["namespace"].values()) == pytest.approx(4 * 7.7)


def test_kubectl_cost_reads_the_currency_and_a_team_scoped_token_gets_its_table(store):
    tokens = Tokens([("llm", hash_token("t-llm"), frozenset({"llm"})), ("all", hash_token("t-all"), None)])
    h = {"Authorization": "Bearer t-llm"}
    with served(store, tokens, currency="EUR") as (url, _):
        conf = httpx.get(url + "/model/getConfigs", headers=h, timeout=30).json()
        body = httpx.get(
            url + "/allocation/compute", params=kc.request("namespace", window=DAY), headers=h, timeout=30
        )
    assert conf["data"]["currencyCode"] == "EUR"  # configapi.go:13 reads data.currencyCode
    assert body.status_code == 200, body.text
    (allocs,) = kc.unmarshal(body.json())
    rows = kc.table(kc.aggregation_of("namespace"), allocs)
    assert [r.fields for r in rows] == [["__unallocated__", "__unallocated__"]]  # llm's job only, no __idle__
    assert "__idle__" in body.json()["warning"]


def test_names_with_a_slash_never_break_kubectl_costs_table(shared, prefix):
    """Any job name and label the protocol allows: each allocation splits into its fields."""
    names = ["a/b", "a/b/c", "x%2Fy", "/lead", "trail/", "ok"]
    for n, lab in zip(names, itertools.cycle(["v/1", "%", "plain"]), strict=False):
        write_job(shared, prefix, n, None, app=lab, namespace="ns/1")
    tables = {}
    with served(LedgerStore(shared, prefix)) as (url, _):
        for sub in kc.SUBCOMMANDS:
            body = httpx.get(
                url + "/allocation/compute", params=kc.request(sub, window=DAY, idle=False), timeout=30
            )
            assert body.status_code == 200, body.text
            tables[sub] = kc.table(kc.aggregation_of(sub), kc.unmarshal(body.json())[0])
    assert set(tables) == set(kc.SUBCOMMANDS) and all(tables.values())
    assert len(tables["controller"]) == len(names)  # one row a job: no two names escape alike
    assert {r.fields[1] for r in tables["namespace"]} == {"ns%2F1"}
