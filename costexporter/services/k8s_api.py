"""A pod's labels and owners from the Kubernetes API, for pods dcgm-exporter names without them.

dcgm-exporter labels a GPU's series with the pod holding it, but its pod labels are off by
default (they need its own RBAC). The agent then reads the pod object itself: `GET` of one pod,
cached, through lightkube (the optional `k8s` extra: `pip install costexporter[k8s]`), with the
in-cluster service account (the chart's ClusterRole allows get/list/watch on pods). A pod it
cannot read is counted and named from dcgm-exporter's labels and its name instead.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

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


def lightkube_fetch() -> Callable[[str, str], Mapping[str, Any] | None]:
    """A `fetch` reading pods through lightkube with the in-cluster (or kubeconfig) credentials;
    raises KubernetesUnavailable with the reason when it cannot be set up."""
    try:
        from lightkube import ApiError, Client
        from lightkube.resources.core_v1 import Pod
    except ImportError as e:
        raise KubernetesUnavailable(
            "the Kubernetes API client is not installed (pip install 'costexporter[k8s]')"
        ) from e
    try:
        client = Client()  # lightkube's default timeouts (10 s): the loop has its own thread
    except Exception as e:  # lightkube raises its own config errors, or OSError for a missing file
        raise KubernetesUnavailable(f"no Kubernetes configuration ({type(e).__name__}: {e})") from e

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
