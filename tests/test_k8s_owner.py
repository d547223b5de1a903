"""A GPU pod's training job by its owner: recorded pod objects of each controller (the labels and
ownerReferences PyTorchJob, MPIJob, Volcano, JobSet, batch Job, LeaderWorkerSet, Deployment and
StatefulSet put on their pods), read from the API or only from what dcgm-exporter exports; the
registration loop with a pod lookup; lightkube against an HTTP server speaking the pods API."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from costexporter.core.attribution import Facts
from costexporter.services.k8s import KubernetesJobs, job_name
from costexporter.services.k8s_api import PodLookup
from costexporter.services.k8s_owner import OWNER_LABELS, owner_of, owner_of_pod
from costexporter.sources.dcgm import DcgmSource, PodRef, pod_of
from costexporter.store import keys

from .http_stub import HttpStub, write_kubeconfig
from .test_k8s import HOST, FakeDcgmExporter

PODS = Path(__file__).parent / "data" / "k8s_pods"

# fixture -> (job, kind, team)
WANT = {
    "pytorchjob-worker": ("llama-ft", "PyTorchJob", "llm"),
    "pytorchjob-master": ("llama-ft", "PyTorchJob", "llm"),
    "mpijob-launcher": ("gpt-neox", "MPIJob", "ml"),
    "volcano-job": ("bert-pretrain", "VolcanoJob", "nlp"),
    "jobset": ("gpt-trainer", "JobSet", "ml"),  # not its child Job gpt-trainer-workers-0
    "batch-job": ("resnet-sweep-7", "Job", "vision"),
    "lws-leader": ("vllm-70b", "LeaderWorkerSet", "serving"),
    "lws-worker": ("vllm-70b", "LeaderWorkerSet", "serving"),  # not its group's StatefulSet
    "deployment": ("infer-a", "Deployment", "team-a"),  # no ReplicaSet hash
    "statefulset": ("tgi-server", "StatefulSet", "serving"),
    "bare-pod": ("notebook-gpu", "Pod", "vision-lab"),
}


def pod(name: str) -> dict:
    return json.loads((PODS / f"{name}.json").read_text())


def dcgm_labels(obj: dict) -> dict[str, str]:
    """The pod's labels as dcgm-exporter exports them (--kubernetes-enable-pod-labels)."""
    return {re.sub(r"[^A-Za-z0-9_]", "_", k): v for k, v in obj["metadata"]["labels"].items()}


def test_every_recorded_kind_is_covered():
    assert {p.stem for p in PODS.glob("*.json")} == set(WANT)


@pytest.mark.parametrize("fixture", sorted(WANT))
def test_a_pod_object_maps_to_its_workload(fixture):
    name, kind, team = WANT[fixture]
    o = owner_of_pod(pod(fixture))
    assert (o.name, o.kind, o.team) == (name, kind, team)


@pytest.mark.parametrize("fixture", sorted(WANT))
def test_dcgm_exporters_pod_labels_alone_give_the_same_job(fixture):
    """No API access: the labels dcgm-exporter exported (sanitized) and the pod name."""
    obj = pod(fixture)
    ref = PodRef(obj["metadata"]["namespace"], obj["metadata"]["name"], "trainer", dcgm_labels(obj))
    assert job_name(ref) == f"{obj['metadata']['namespace']}:{WANT[fixture][0]}"


@pytest.mark.parametrize(
    ("fixture", "want"),
    [
        ("deployment", "infer-a"),  # the case: not infer-a-7d9f8c6b5
        ("pytorchjob-worker", "llama-ft"),
        ("volcano-job", "bert-pretrain"),
        ("statefulset", "tgi-server"),
        # Not "resnet-sweep-7-x9k2p": a trailing number reads as a replica index by name alone;
        # the Job's label (dcgm-exporter's pod labels) or the API names it right.
    ],
)
def test_without_pod_labels_the_pod_name_still_names_the_workload(fixture, want):
    """dcgm-exporter's default (no pod labels, no API): only the pod's name is known."""
    obj = pod(fixture)
    assert owner_of(obj["metadata"]["namespace"], obj["metadata"]["name"], {}).name == want


def test_a_configured_label_wins_and_takes_the_controllers_kind():
    obj = pod("jobset")
    obj["metadata"]["labels"]["example.com/experiment"] = "exp-42"
    o = owner_of_pod(obj, job_labels=["example.com/experiment"])
    assert (o.name, o.kind, o.via) == ("exp-42", "Job", "label:example.com/experiment")


def test_team_from_the_configured_label_else_the_namespace():
    obj = pod("batch-job")
    obj["metadata"]["labels"]["org/cost-team"] = "vision-infra"
    assert owner_of_pod(obj, team_labels=["org/cost-team", "team"]).team == "vision-infra"
    assert owner_of_pod(pod("batch-job")).team == "vision"


def test_a_bare_replicaset_is_its_own_workload():
    obj = pod("deployment")
    del obj["metadata"]["labels"]["pod-template-hash"]
    obj["metadata"]["ownerReferences"][0]["name"] = "infer-rs"
    o = owner_of_pod(obj)
    assert (o.name, o.kind) == ("infer-rs", "ReplicaSet")


_word = st.from_regex(r"[a-z][a-z0-9]{2,8}", fullmatch=True)


@given(
    jobset=_word,
    rjob=_word,
    idx=st.integers(0, 30),
    extra=st.dictionaries(st.from_regex(r"[a-z]{1,8}\.io/[a-z-]{1,10}", fullmatch=True), _word, max_size=4),
    sanitized=st.booleans(),
)
def test_a_jobset_pod_is_the_jobsets_whatever_else_it_carries(jobset, rjob, idx, extra, sanitized):
    """JobSet's pods also carry their child Job's batch labels and owner: the JobSet wins."""
    child = f"{jobset}-{rjob}-{idx}"
    labels = {
        **extra,
        "jobset.sigs.k8s.io/jobset-name": jobset,
        "batch.kubernetes.io/job-name": child,
        "job-name": child,
    }
    if sanitized:
        labels = {re.sub(r"[^A-Za-z0-9_]", "_", k): v for k, v in labels.items()}
    refs = [{"apiVersion": "batch/v1", "kind": "Job", "name": child, "controller": True}]
    o = owner_of("ml", f"{child}-0-abcde", labels, refs)
    assert (o.name, o.kind) == (jobset, "JobSet")


@given(
    name=_word,
    hash_=st.from_regex(r"[a-z0-9]{5,10}", fullmatch=True),
    suffix=st.from_regex(r"[a-z0-9]{5}", fullmatch=True),
)
def test_a_deployment_pod_never_keeps_its_template_hash(name, hash_, suffix):
    labels = {"pod-template-hash": hash_}
    pod_name = f"{name}-{hash_}-{suffix}"
    by_ref = owner_of(
        "ns", pod_name, labels, [{"kind": "ReplicaSet", "name": f"{name}-{hash_}", "controller": True}]
    )
    by_name = owner_of("ns", pod_name, {"pod_template_hash": hash_})  # dcgm-exporter's spelling
    assert by_ref.name == by_name.name == name
    assert by_ref.kind == by_name.kind == "Deployment"


def test_owner_labels_are_tried_jobset_before_batch_job_and_lws_before_statefulset():
    keys = [k for k, _ in OWNER_LABELS]
    assert keys.index("jobset.sigs.k8s.io/jobset-name") < keys.index("batch.kubernetes.io/job-name")
    assert keys.index("training.kubeflow.org/job-name") < keys.index("batch.kubernetes.io/job-name")


# ---- the lookup: cached, failures counted, never raised -------------------------------------


def test_lookup_caches_and_a_failing_api_falls_back_to_dcgm_labels():
    calls: list[tuple[str, str]] = []
    now = [0.0]
    fail = [False]

    def fetch(ns, name):
        calls.append((ns, name))
        if fail[0]:
            raise ConnectionError("apiserver unreachable")
        return pod("pytorchjob-worker") if name == "llama-ft-worker-1" else None

    lookup = PodLookup(fetch, clock=lambda: now[0])
    ref = PodRef("ml", "llama-ft-worker-1", "trainer", {})
    assert job_name(ref, lookup=lookup) == "ml:llama-ft"
    assert job_name(ref, lookup=lookup) == "ml:llama-ft"
    assert calls == [("ml", "llama-ft-worker-1")]  # cached
    fail[0] = True
    now[0] += 3600  # past the cache: the API fails, the last answer stands
    assert job_name(ref, lookup=lookup) == "ml:llama-ft"
    other = PodRef("ml", "sft-7d9f8c6b5-x2k9q", "", {"pod_template_hash": "7d9f8c6b5"})
    assert job_name(other, lookup=lookup) == "ml:sft"  # never read: named from dcgm's labels
    assert lookup.errors["ConnectionError"] == 2


def test_registrations_name_jobs_by_owner_through_the_lookup(shared, prefix):
    """The registration loop, with dcgm-exporter exporting no pod labels (its default) and the
    pods read from the API: every GPU lands in its workload's job, its kind in meta (data) and
    its namespace, owner and team in the facts the agent attributes it by (never meta: a trainer
    writes meta)."""
    fixtures = ["pytorchjob-worker", "jobset", "deployment", "lws-worker"]
    objs = {pod(f)["metadata"]["name"]: pod(f) for f in fixtures}
    exp = FakeDcgmExporter(
        [
            {"power": 900.0, "util": 100, "pod": o["metadata"]["name"], "ns": o["metadata"]["namespace"]}
            for o in objs.values()
        ]
    )
    try:
        src = DcgmSource([exp.url], host=HOST)
        src.read()
        kj = KubernetesJobs(shared, prefix, src, HOST, lookup=PodLookup(lambda ns, n: objs.get(n)))
        kj.sync()
        jobs = set(shared.zrange(keys.jobs_key(prefix), 0, -1))
        assert jobs == {"ml:llama-ft", "ml:gpt-trainer", "team-a:infer-a", "serving:vllm-70b"}
        meta = shared.hgetall(keys.meta_key(prefix, "ml:llama-ft"))
        assert meta["owner_kind"] == "PyTorchJob" and "team" not in meta and "namespace" not in meta
        # submitted: the pod's creationTimestamp (2026-11-30T08:14:03Z), scheduling goodput's start
        assert kj.facts["ml:llama-ft"] == Facts("ml", "llama-ft", "PyTorchJob", "llm", 1796026443.0)
        assert kj.facts["team-a:infer-a"].team == "team-a"
    finally:
        exp.close()


# ---- lightkube against an HTTP server speaking the pods API ---------------------------------


class PodsApi:
    """GET /api/v1/namespaces/<ns>/pods/<name>: the recorded pods, 404 for others, 403 on demand."""

    def __init__(self, pods: dict[tuple[str, str], dict]) -> None:
        self.pods = pods
        self.forbidden = False
        self.http = HttpStub(self.answer)
        self.url = self.http.url

    def answer(self, path: str) -> tuple[int, str, bytes]:
        m = re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods/([^/?]+)", path.split("?")[0])
        if self.forbidden:
            code, body = (
                403,
                _status(
                    403,
                    "Forbidden",
                    'pods is forbidden: User "system:serviceaccount:x:y" cannot get resource "pods"',
                ),
            )
        elif m and (m.group(1), m.group(2)) in self.pods:
            code, body = 200, self.pods[(m.group(1), m.group(2))]
        else:
            code, body = 404, _status(404, "NotFound", "pods not found")
        return code, "application/json", json.dumps(body).encode()

    def close(self) -> None:
        self.http.close()


def _status(code: int, reason: str, message: str) -> dict:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def test_lightkube_reads_pods_and_maps_404_to_none_and_403_to_a_counted_error(tmp_path, monkeypatch):
    pytest.importorskip("lightkube")
    from costexporter.services.k8s_api import lightkube_fetch

    recorded = [pod(f) for f in ("volcano-job", "statefulset")]
    api = PodsApi({(o["metadata"]["namespace"], o["metadata"]["name"]): o for o in recorded})
    cfg = write_kubeconfig(tmp_path / "kubeconfig", api.url)
    monkeypatch.setenv("KUBECONFIG", str(cfg))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    try:
        lookup = PodLookup(lightkube_fetch())
        o = owner_of_pod(lookup.get("nlp", "bert-pretrain-worker-3"))
        assert (o.name, o.kind) == ("bert-pretrain", "VolcanoJob")
        assert owner_of_pod(lookup.get("serving", "tgi-server-2")).kind == "StatefulSet"
        assert lookup.get("nlp", "gone-0") is None and not lookup.errors
        api.forbidden = True
        assert lookup.get("ml", "other-0") is None
        assert sum(lookup.errors.values()) == 1
    finally:
        api.close()


@pytest.mark.parametrize(
    "labels",
    [
        {"pod": "llama-ft-worker-1", "namespace": "ml", "container": "trainer"},  # default
        {"pod_name": "llama-ft-worker-1", "pod_namespace": "ml", "container_name": "trainer"},  # old names
        # Through a Prometheus that renamed them (a federation URL): exported_* is the workload.
        {
            "exported_pod": "llama-ft-worker-1",
            "exported_namespace": "ml",
            "exported_container": "trainer",
            "pod": "dcgm-exporter-x2k9q",
            "namespace": "gpu-operator",
        },
    ],
)
def test_every_spelling_of_dcgm_exporters_pod_labels_gives_the_job(labels):
    ref = pod_of({"gpu": "0", "UUID": "GPU-1", **labels})
    assert ref is not None
    assert (ref.namespace, ref.pod, ref.container) == ("ml", "llama-ft-worker-1", "trainer")
    assert job_name(ref) == "ml:llama-ft" and not ref.labels  # no label of dcgm's own taken for a pod's
