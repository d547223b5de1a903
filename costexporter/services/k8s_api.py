"""A pod's labels and owners from the Kubernetes API, for pods dcgm-exporter names without them;
the pods of the agent's node, for their HAMi shares of its GPUs (`NodePods`).

dcgm-exporter labels a GPU's series with the pod holding it, but its pod labels are off by
default (they need its own RBAC). The agent then reads the pod object itself: `GET` of one pod,
cached, through lightkube (the optional `k8s` extra: `pip install costexporter[k8s]`), with the
in-cluster service account (the chart's ClusterRole allows get/list/watch on pods). A pod it
cannot read is counted and named from dcgm-exporter's labels and its name instead.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from costexporter.core import hami

log = logging.getLogger("costexporter.k8s")

CACHE_TTL_S = 600.0  # a pod's owners do not change; its labels rarely do
MISS_TTL_S = 30.0  # a pod not found (yet) is asked again after this


class KubernetesUnavailable(RuntimeError):
    """The API cannot be used here: the client is not installed, or no cluster configuration."""


def in_cluster() -> bool:
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST"))


class PodLookup:
    """Pod objects by (namespace, name), cached. `fetch` returns the pod as a dict of its JSON,
    None when it does not exist, or raises; tests give their own, the agent lightkube's."""

    def __init__(
        self,
        fetch: Callable[[str, str], Mapping[str, Any] | None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fetch = fetch
        self.clock = clock
        self._cache: dict[tuple[str, str], tuple[float, Mapping[str, Any] | None]] = {}
        self._lock = threading.Lock()
        self.errors: Counter[str] = Counter()

    def get(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        """The pod, or None (not found, or the API failed: counted, logged once per kind)."""
        key = (namespace, name)
        now = self.clock()
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None and now < hit[0]:
            return hit[1]
        try:
            obj = self.fetch(namespace, name)
        except Exception as e:  # noqa: BLE001 - the API's errors are many (HTTP, TLS, auth): each is counted
            kind = type(e).__name__
            if not self.errors[kind]:
                log.warning(
                    "cannot read pod %s/%s from the Kubernetes API (%s: %s); naming its job from "
                    "dcgm-exporter's labels until it answers",
                    namespace,
                    name,
                    kind,
                    e,
                )
            self.errors[kind] += 1
            return hit[1] if hit is not None else None
        with self._lock:
            self._cache[key] = (now + (CACHE_TTL_S if obj is not None else MISS_TTL_S), obj)
            if len(self._cache) > 10_000:  # pods come and go: keep the fresh ones
                for k in [k for k, (t, _) in self._cache.items() if t <= now]:
                    del self._cache[k]
        return obj


def _lightkube_client() -> Any:
    """lightkube's Client with the in-cluster (or kubeconfig) credentials; KubernetesUnavailable
    with the reason when it is not installed or finds no configuration."""
    try:
        from lightkube import Client
    except ImportError as e:
        raise KubernetesUnavailable(
            "the Kubernetes API client is not installed (pip install 'costexporter[k8s]')"
        ) from e
    try:
        return Client()  # lightkube's default timeouts (10 s): the callers have their own thread
    except Exception as e:  # lightkube raises its own config errors, or OSError for a missing file
        raise KubernetesUnavailable(f"no Kubernetes configuration ({type(e).__name__}: {e})") from e


def lightkube_fetch() -> Callable[[str, str], Mapping[str, Any] | None]:
    """A `fetch` reading pods through lightkube with the in-cluster (or kubeconfig) credentials;
    raises KubernetesUnavailable with the reason when it cannot be set up."""
    client = _lightkube_client()
    from lightkube import ApiError
    from lightkube.resources.core_v1 import Pod

    def fetch(namespace: str, name: str) -> Mapping[str, Any] | None:
        try:
            pod = client.get(Pod, name=name, namespace=namespace)
        except ApiError as e:
            if getattr(e.status, "code", None) == 404:
                return None
            raise
        meta = pod.metadata
        return {
            "metadata": {
                "name": meta.name if meta else name,
                "namespace": meta.namespace if meta else namespace,
                "labels": dict(meta.labels or {}) if meta else {},
                "creationTimestamp": meta.creationTimestamp.isoformat()
                if meta and meta.creationTimestamp
                else None,
                "ownerReferences": [
                    {
                        "apiVersion": r.apiVersion,
                        "kind": r.kind,
                        "name": r.name,
                        "controller": bool(r.controller),
                    }
                    for r in ((meta.ownerReferences or []) if meta else [])
                ],
            }
        }

    return fetch


class NodePods:
    """The pods on this agent's node, listed through the Kubernetes API every `refresh_s` by the
    Kubernetes path's thread (never by the sampler, which only reads the newest list): HAMi's
    claims on the node's GPUs (`core.hami`). A list that fails keeps the last one (counted,
    logged once per kind); a pod whose claim cannot be read is left out and said once."""

    def __init__(
        self,
        list_pods: Callable[[str], list[Mapping[str, Any]]],
        node: str,
        refresh_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.list_pods = list_pods
        self.node = node
        self.refresh_s = refresh_s
        self.clock = clock
        self._at = -math.inf
        self._claims: dict[str, list[hami.Holder]] = {}
        self._names: frozenset[tuple[str, str]] = frozenset()
        self.errors: Counter[str] = Counter()
        self._said: set[str] = set()

    def refresh(self, force: bool = False) -> None:
        if not force and self.clock() - self._at < self.refresh_s:
            return
        self._at = self.clock()
        try:
            pods = self.list_pods(self.node)
        except Exception as e:  # noqa: BLE001 - the API's errors are many: each kind counted
            kind = type(e).__name__
            if not self.errors[kind]:
                log.warning(
                    "cannot list the pods of node %s (%s: %s); HAMi shares as last read", self.node, kind, e
                )
            self.errors[kind] += 1
            return
        self._names = frozenset(
            ((p.get("metadata") or {}).get("namespace", ""), (p.get("metadata") or {}).get("name", ""))
            for p in pods
        )
        claims, bad = hami.by_gpu(pods)
        for line in bad:
            self.errors["hami_annotation"] += 1
            if line not in self._said:
                self._said.add(line)
                log.warning("pod %s; its HAMi share is not booked to it", line)
        self._claims = claims  # replaced, not mutated: the sampler reads it from another thread

    def listed(self, namespace: str, name: str) -> bool:
        """Whether the newest list held this pod."""
        return (namespace, name) in self._names

    def allocations(self) -> dict[str, list[hami.Holder]]:
        """The newest list's claims by GPU UUID."""
        return self._claims


def lightkube_list() -> Callable[[str], list[Mapping[str, Any]]]:
    """A `list_pods(node)` through lightkube (the pods on one node, every namespace); raises
    KubernetesUnavailable with the reason when it cannot be set up."""
    client = _lightkube_client()
    from lightkube.resources.core_v1 import Pod

    def list_pods(node: str) -> list[Mapping[str, Any]]:
        out: list[Mapping[str, Any]] = []
        for pod in client.list(Pod, namespace="*", fields={"spec.nodeName": node}):
            meta, spec, status = pod.metadata, pod.spec, pod.status
            out.append(
                {
                    "metadata": {
                        "name": meta.name if meta else "",
                        "namespace": meta.namespace if meta else "",
                        "annotations": dict(meta.annotations or {}) if meta else {},
                    },
                    "spec": {"containers": [{"name": c.name} for c in (spec.containers if spec else [])]},
                    "status": {"phase": status.phase if status else None},
                }
            )
        return out

    return list_pods
