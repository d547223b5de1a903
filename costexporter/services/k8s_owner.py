"""Which training job a Kubernetes pod belongs to: the workload that owns it, by its controller.

Each controller marks its pods in its own way, and a pod belongs to exactly one workload. In order:

1. the operator's labels (configured ones first): Kubeflow's `training.kubeflow.org/job-name`
   (PyTorchJob, MPIJob, TFJob...), JobSet's `jobset.sigs.k8s.io/jobset-name` (before the batch
   Job labels its child Jobs also put on the pods), Volcano's `volcano.sh/job-name`,
   LeaderWorkerSet's `leaderworkerset.sigs.k8s.io/name`, then a batch Job's
   `batch.kubernetes.io/job-name` (or the older `job-name`);
2. the pod's controller `ownerReference`: a ReplicaSet is its Deployment (the name less the
   `pod-template-hash`), a StatefulSet, a Job or any operator's kind is itself;
3. the pod name less what its controller appended (a Deployment pod's template hash and random
   suffix, a replica role and index).

Labels are read as Kubernetes has them or as dcgm-exporter exports them
(`--kubernetes-enable-pod-labels` turns `.`, `/` and `-` into `_`; kube-state-metrics adds
`label_`). The team is the first configured team label present, else the namespace.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from costexporter.core.timeutil import parse_instant
from costexporter.store import protocol

if TYPE_CHECKING:
    from costexporter.sources.dcgm import PodRef

# (label, the workload kind it names), in the order they are tried.
OWNER_LABELS: tuple[tuple[str, str], ...] = (
    ("training.kubeflow.org/job-name", "KubeflowJob"),
    ("jobset.sigs.k8s.io/jobset-name", "JobSet"),
    ("volcano.sh/job-name", "VolcanoJob"),
    ("leaderworkerset.sigs.k8s.io/name", "LeaderWorkerSet"),
    ("batch.kubernetes.io/job-name", "Job"),
    ("job-name", "Job"),
)
DEFAULT_TEAM_LABELS = ("team",)
TEMPLATE_HASH = "pod-template-hash"
# A pod name less the suffixes its controller adds: -worker-3, -launcher, -0-1, -x7k2p.
POD_NAME_RE = re.compile(
    r"^(?P<job>.+?)(?:-(?:master|worker|launcher|chief|ps|evaluator|replica|node|leader)s?)?"
    r"(?:-\d+)*(?:-[a-z0-9]{5})?$"
)
# A Deployment pod's name: `<deployment>-<pod-template-hash>-<5 random>`. The hash is drawn from
# Kubernetes' safe alphabet (no vowels, no 0, 1, 3), so a word of a job's name is not taken for it.
_SAFE = "[bcdfghjklmnpqrstvwxz2456789]"
DEPLOYMENT_POD_RE = re.compile(rf"^(?P<job>.+)-(?=[a-z0-9]*\d){_SAFE}{{5,10}}-[a-z0-9]{{5}}$")
# Kubeflow's controller kinds, for a job known only by its label.
_KUBEFLOW_OPERATORS = {
    "pytorchjob-controller": "PyTorchJob",
    "mpijob-controller": "MPIJob",
    "mpi-operator": "MPIJob",
    "tfjob-controller": "TFJob",
    "xgboostjob-controller": "XGBoostJob",
    "paddlejob-controller": "PaddleJob",
    "jaxjob-controller": "JAXJob",
}


@dataclass(frozen=True)
class Owner:
    """The workload a pod belongs to, and how that was found (`label:<key>`, `ownerReference`,
    `pod-name`): the job's name, its kind, and its team."""

    name: str
    kind: str
    via: str
    team: str = ""
    created: float | None = None  # the pod's creationTimestamp (Unix seconds), where read


def label(labels: Mapping[str, str], name: str) -> str | None:
    """A pod label as Kubernetes has it, as dcgm-exporter exports it, or `label_`-prefixed."""
    clean = re.sub(r"[^A-Za-z0-9_]", "_", name)
    for k in (name, clean, f"label_{clean}"):
        v = labels.get(k)
        if v:
            return v
    return None


def _controller(owner_refs: Iterable[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    refs = [r for r in owner_refs if isinstance(r, Mapping) and r.get("name")]
    return next((r for r in refs if r.get("controller")), refs[0] if refs else None)


def _strip_hash(name: str, template_hash: str | None) -> str:
    """A ReplicaSet's (or its pod's) name less the Deployment's pod-template-hash."""
    if template_hash and f"-{template_hash}" in name:
        return name[: name.rindex(f"-{template_hash}")]
    return name


def owner_of(
    namespace: str,
    pod: str,
    labels: Mapping[str, str],
    owner_refs: Iterable[Mapping[str, Any]] = (),
    *,
    job_labels: Iterable[str] = (),
    team_labels: Iterable[str] = DEFAULT_TEAM_LABELS,
) -> Owner:
    """The workload holding pod `namespace/pod`: `labels` as the API or dcgm-exporter gives them,
    `owner_refs` the pod's `metadata.ownerReferences` (empty when only dcgm-exporter's labels are
    known). `job_labels` are tried before the built-in ones."""
    team = next((v for v in (label(labels, t) for t in team_labels) if v), None) or namespace
    ctrl = _controller(owner_refs)
    rules = [(k, "") for k in job_labels] + list(OWNER_LABELS)
    for key, kind in rules:
        v = label(labels, key)
        if not v:
            continue
        if not kind:  # a configured label: the controller says what kind it is, if known
            kind = str(ctrl.get("kind", "")) if ctrl else ""
        if kind == "KubeflowJob":
            op = label(labels, "training.kubeflow.org/operator-name") or ""
            ref_kind = (
                str(ctrl.get("kind", "")) if ctrl and "kubeflow.org" in str(ctrl.get("apiVersion")) else ""
            )
            kind = ref_kind or _KUBEFLOW_OPERATORS.get(op, "KubeflowJob")
        return Owner(v, kind or "Pod", f"label:{key}", team)
    template_hash = label(labels, TEMPLATE_HASH)
    if ctrl is not None:
        kind, name = str(ctrl.get("kind", "")), str(ctrl["name"])
        if kind == "ReplicaSet":
            stripped = _strip_hash(name, template_hash)
            # A bare ReplicaSet (no Deployment, no template hash) is its own workload.
            return Owner(stripped, "Deployment" if stripped != name else "ReplicaSet", "ownerReference", team)
        return Owner(name, kind or "Pod", "ownerReference", team)
    if template_hash and f"-{template_hash}-" in pod:
        return Owner(pod[: pod.rindex(f"-{template_hash}-")], "Deployment", "pod-name", team)
    m = DEPLOYMENT_POD_RE.match(pod)
    if m:
        return Owner(m.group("job"), "Deployment", "pod-name", team)
    m = POD_NAME_RE.match(pod)
    return Owner(m.group("job") if m else pod, "Pod", "pod-name", team)


def owner_of_pod(
    obj: Mapping[str, Any],
    *,
    job_labels: Iterable[str] = (),
    team_labels: Iterable[str] = DEFAULT_TEAM_LABELS,
) -> Owner:
    """`owner_of` for a pod object as the Kubernetes API returns it (a dict of its JSON)."""
    meta = obj.get("metadata") or {}
    own = owner_of(
        str(meta.get("namespace", "")),
        str(meta.get("name", "")),
        {str(k): str(v) for k, v in (meta.get("labels") or {}).items()},
        meta.get("ownerReferences") or (),
        job_labels=job_labels,
        team_labels=team_labels,
    )
    return replace(own, created=_created(meta.get("creationTimestamp")))


def _created(raw: object) -> float | None:
    """A pod's creationTimestamp (RFC 3339, as the API writes it) in Unix seconds, or None."""
    if not isinstance(raw, str) or not raw:
        return None
    try:
        return parse_instant(raw)
    except ValueError:
        return None


def job_id(ref: PodRef, name: str) -> str:
    """`<namespace>:<name>`, usable as a hash tag and one path segment (ValueError if not): the
    job a pod's workload is, live (`k8s`) and in replay (`jobmap`)."""
    return protocol.job_segment(f"{ref.namespace}:{name}" if ref.namespace else name)
