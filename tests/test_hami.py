"""HAMi fractional GPUs: pods sharing a GPU by HAMi's core limits, read from the pods as HAMi
writes them, each booked by its declared share; every GPU-second once.

The annotation format and the examples are HAMi's own (Project-HAMi/HAMi at
4707fb02c91c545bc7343ce26dba4c32919f9a3e): docs/develop/protocol.md line 69,
pkg/device-plugin/nvidiadevice/nvinternal/plugin/alloc_refactor_test.go lines 358 and 610,
pkg/device/devices.go `DecodeContainerDevices` (what it refuses)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from costexporter.core import hami, shares
from costexporter.services.k8s import KubernetesJobs
from costexporter.services.k8s_api import NodePods, PodLookup
from costexporter.sources.dcgm import DcgmSource
from costexporter.store import keys, protocol

from .conftest import SHARED_URL, spawn_cli
from .http_stub import HttpStub, write_kubeconfig
from .redis_server import free_port
from .test_dcgm_joins import StaticFiles
from .test_shared_gpus import assert_booked_by_lanes, wait_booked

PODS = Path(__file__).parent / "data" / "k8s_pods" / "hami"
U1 = "GPU-5b2c3f1e-8a44-2d7e-91c0-3e6f0a1b2c3d"
U2 = "GPU-0fc3eda5-e98b-a25b-5b0d-cf5c855d1448"
NODE = "gpu-node-3"
LAB = 'modelName="NVIDIA H100 80GB HBM3",Hostname="gpu-node-3"'
# dcgm-exporter on the node: two GPUs; the pod-resources view names one pod per GPU.
EXPOSITION = "\n".join(
    [
        "# TYPE DCGM_FI_DEV_POWER_USAGE gauge",
        f'DCGM_FI_DEV_POWER_USAGE{{gpu="0",UUID="{U1}",{LAB},namespace="ml",pod="infer-a-7d9f8-x2k4q"}} 400',
        f'DCGM_FI_DEV_POWER_USAGE{{gpu="1",UUID="{U2}",{LAB},namespace="research",pod="notebook-0"}} 200',
        "# TYPE DCGM_FI_DEV_GPU_UTIL gauge",
        f'DCGM_FI_DEV_GPU_UTIL{{gpu="0",UUID="{U1}",{LAB},namespace="ml",pod="infer-a-7d9f8-x2k4q"}} 60',
        f'DCGM_FI_DEV_GPU_UTIL{{gpu="1",UUID="{U2}",{LAB},namespace="research",pod="notebook-0"}} 10',
    ]
)


def _pods() -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(PODS.glob("*.json"))]


# ---- the annotation ----------------------------------------------------------------------------


def test_decode_reads_hamis_own_examples():
    # protocol.md: two containers, one GPU each (3 GB and 5 GB), no core limit
    two = f"{U2},NVIDIA,3000,0:;{U2},NVIDIA,5000,0:;"
    assert hami.decode(two) == [
        [hami.HamiDevice(U2, "NVIDIA", 3000, 0)],
        [hami.HamiDevice(U2, "NVIDIA", 5000, 0)],
    ]
    # the device plugin's tests: core limits; a MIG device's UUID
    assert hami.decode("GPU-aaa,NVIDIA,3000,50:;GPU-bbb,NVIDIA,4000,60:;")[1] == [
        hami.HamiDevice("GPU-bbb", "NVIDIA", 4000, 60)
    ]
    assert hami.decode("MIG-aaa,NVIDIA,3000,50:;") == [[hami.HamiDevice("MIG-aaa", "NVIDIA", 3000, 50)]]
    # several devices in one container (`:` between them), an empty container kept in its place
    assert [len(c) for c in hami.decode(";GPU-a,NVIDIA,1,10:GPU-b,NVIDIA,1,20:;")] == [0, 2]


@pytest.mark.parametrize(
    "bad", ["GPU-a,NVIDIA,3000:;", "GPU-a,NVIDIA,x,10:;", "GPU-a,NVIDIA,10,101:;", ",NVIDIA,10,10:;"]
)
def test_decode_refuses_what_hamis_decoder_refuses(bad):
    with pytest.raises(ValueError, match="HAMi device"):
        hami.decode(bad)


def test_holders_read_from_pods_in_hamis_format():
    claims, bad = hami.by_gpu(_pods())
    assert not bad
    assert claims[U1] == [
        hami.Holder("ml", "infer-a-7d9f8-x2k4q", "server", 30, 20000),
        hami.Holder("ml", "infer-b-0", "server", 20, 10000),  # its second container's claim
    ]  # the Succeeded pod's annotation no longer holds anything
    assert claims[U2] == [hami.Holder("research", "notebook-0", "lab", 0, 8000)]
    (a,) = [p for p in _pods() if p["metadata"]["name"] == "infer-a-7d9f8-x2k4q"]
    broken = {**a, "metadata": {**a["metadata"], "annotations": {hami.ALLOCATED: "x,y:;"}}}
    claims, bad = hami.by_gpu([broken, *_pods()])
    assert len(bad) == 1 and "HAMi device" in bad[0] and U1 in claims  # the others still read


# ---- lanes: every GPU-second once --------------------------------------------------------------

holders = st.lists(
    st.builds(
        hami.Holder,
        st.just("ns"),
        st.text("abcdef", min_size=1, max_size=4),
        st.just("c"),
        st.integers(0, hami.DEN),
        st.integers(0, 80_000),
    ),
    max_size=8,
)


@given(hs=holders, start=st.integers(0, 10**7), length=st.integers(0, 10**6))
def test_lanes_partition_the_gpu_and_its_time_adds_up_exactly(hs, start, length):
    cut, over = hami.lanes(hs)
    assert [h for h, _ in cut] == hs
    lo = 0
    for h, (a, b, den) in cut:
        assert den == hami.DEN and a == lo and b >= a
        lo = b
        if h.cores and sum(x.cores for x in hs) <= hami.DEN:
            assert b - a == h.cores  # a core limit is its share, while they fit
    assert lo <= hami.DEN
    if any(h.cores == 0 for h in hs):
        assert lo == hami.DEN  # pods without a limit take what is left
    assert over == max(sum(h.cores for h in hs) - hami.DEN, 0)
    rest = (lo, hami.DEN, hami.DEN)
    lanes = np.asarray([*(x for _, x in cut), rest], np.int64).reshape(-1, 3)
    n = len(lanes)
    got = shares.gpu_ms(np.full(n, start, np.int64), np.full(n, start + length, np.int64), lanes)
    assert int(got.sum()) == length and (got >= 0).all()


# ---- the source: a device per pod, the GPU keeps the rest ----------------------------------------


@pytest.fixture
def exporter(tmp_path):
    (tmp_path / "hami.prom").write_text(EXPOSITION + "\n")
    files = StaticFiles({"hami.prom": tmp_path / "hami.prom"})
    yield f"http://{files.addr}/hami.prom"
    files.close()


def test_pods_sharing_a_gpu_are_devices_of_their_declared_share(exporter):
    """GPU 0 held 30% and 20% by two pods: a device each, lanes [0, 30) and [30, 50) of 100, the
    GPU's own device the rest [50, 100) and nobody's; power by share, adding up to the GPU's;
    each pod's device reads the GPU's utilization. GPU 1, one pod without a core limit: all of
    it. A pod that leaves gives its lanes back to the GPU."""
    node = NodePods(lambda n: _pods() if n == NODE else [], NODE)
    node.refresh()
    src = DcgmSource([exporter], host=NODE)
    src.allocations = node.allocations
    readings = {r.gpu: r for r in src.read()}
    gpus, pods = src.gpus(), src.pods()
    held = {(p.namespace, p.pod): i for i, p in pods.items()}
    a, b, nb = (
        held[("ml", "infer-a-7d9f8-x2k4q")],
        held[("ml", "infer-b-0")],
        held[("research", "notebook-0")],
    )
    assert (gpus[a].lanes, gpus[b].lanes, gpus[nb].lanes) == ((0, 30, 100), (30, 50, 100), (0, 100, 100))
    (g0,) = [i for i, g in enumerate(gpus) if g.uuid == U1]
    assert gpus[g0].lanes == (50, 100, 100) and g0 not in pods  # the rest is nobody's
    assert gpus[a].parent_uuid == U1 and gpus[a].uuid.startswith(f"{U1}::h")
    assert sum(readings[i].power_w for i in (a, b, g0)) == pytest.approx(400.0)
    assert readings[a].power_w == pytest.approx(120.0) and readings[b].power_w == pytest.approx(80.0)
    assert readings[a].util_pct == readings[b].util_pct == 60.0 and readings[g0].util_pct == 0.0
    (g1,) = [i for i, g in enumerate(gpus) if g.uuid == U2]
    assert gpus[g1].lanes[0] == gpus[g1].lanes[1] and g1 not in readings  # no time of its own
    assert readings[nb].power_w == pytest.approx(200.0)
    # infer-b's pod ends: its lanes go back to the GPU, its device stays (its booked time with it)
    node.list_pods = lambda n: [p for p in _pods() if p["metadata"]["name"] != "infer-b-0"]
    node.refresh(force=True)
    readings = {r.gpu: r for r in src.read()}
    assert src.gpus()[b].lanes == (0, 0, 100) and b not in readings and b not in src.pods()
    assert src.gpus()[g0].lanes == (30, 100, 100)
    assert sum(readings[i].power_w for i in (a, g0)) == pytest.approx(400.0)
    # every HAMi pod gone: the GPU is whole again, and a pod given it whole (dcgm-exporter names
    # it) holds it
    node.list_pods = lambda n: []
    node.refresh(force=True)
    readings = {r.gpu: r for r in src.read()}
    assert src.gpus()[g0].lanes == (0, 100, 100) and src.pods()[g0].pod == "infer-a-7d9f8-x2k4q"
    assert readings[g0].power_w == pytest.approx(400.0) and readings[g0].util_pct == 60.0
    assert a not in readings


def test_the_kubernetes_path_registers_each_hami_pods_share_as_its_jobs_gpu(shared, prefix, exporter):
    node = NodePods(lambda n: _pods(), NODE)
    node.refresh()
    src = DcgmSource([exporter], host=NODE)
    src.allocations = node.allocations
    src.read()
    by_name = {p["metadata"]["name"]: p for p in _pods()}
    kj = KubernetesJobs(shared, prefix, src, NODE, lookup=PodLookup(lambda ns, n: by_name.get(n)))
    kj.sync()
    assert set(shared.zrange(keys.jobs_key(prefix), 0, -1)) == {
        "ml:infer-a",
        "ml:infer-b",
        "research:notebook",
    }
    (raw,) = shared.hvals(keys.ranks_key(prefix, "ml:infer-b"))
    assert protocol.parse_registration("0", raw).gpu_uuid.startswith(f"{U1}::h")


def test_a_pod_the_node_list_has_not_seen_waits_for_the_next_list_not_booked_the_whole_gpu(
    shared, prefix, exporter
):
    """dcgm-exporter names a pod before the node's pod list holds it (scheduled between two
    lists): its GPU waits for a new list, which shows the GPU shared, and is never registered
    whole to that pod. A pod no list ever holds is registered as dcgm-exporter names it."""
    lists = [[], _pods()]
    node = NodePods(lambda n: lists.pop(0) if len(lists) > 1 else lists[0], NODE)
    node.refresh()
    src = DcgmSource([exporter], host=NODE)
    src.allocations = node.allocations
    src.read()
    by_name = {p["metadata"]["name"]: p for p in _pods()}
    kj = KubernetesJobs(
        shared, prefix, src, NODE, lookup=PodLookup(lambda ns, n: by_name.get(n)), node_pods=node
    )
    kj.sync()  # nothing yet: a new list is asked for
    assert not shared.zrange(keys.jobs_key(prefix), 0, -1)
    src.read()
    kj.sync()
    for job in ("ml:infer-a", "research:notebook"):
        (raw,) = shared.hvals(keys.ranks_key(prefix, job))
        assert "::h" in protocol.parse_registration("0", raw).gpu_uuid, job
    # no list ever holds it: registered whole after one wait
    ghost = NodePods(lambda n: [], NODE)
    src2 = DcgmSource([exporter], host=NODE)
    src2.allocations = ghost.allocations
    src2.read()
    kj2 = KubernetesJobs(shared, f"{prefix}-2", src2, NODE, node_pods=ghost)
    kj2.sync()
    kj2.sync()
    assert len(shared.zrange(keys.jobs_key(f"{prefix}-2"), 0, -1)) == 2
    for k in shared.scan_iter(f"{prefix}-2:*"):
        shared.delete(k)


# ---- a real agent, its pods listed through the Kubernetes API ----------------------------------


class PodsApi:
    """The pods API as lightkube calls it: a node's pods (fieldSelector spec.nodeName) and one pod."""

    def __init__(self, pods: list[dict]) -> None:
        self.pods = pods
        self.http = HttpStub(self.answer)
        self.url = self.http.url

    def answer(self, path: str) -> tuple[int, str, bytes]:
        parts = urlsplit(path)
        one = re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)", parts.path)
        if parts.path == "/api/v1/pods":
            sel = parse_qs(parts.query).get("fieldSelector", [""])[0]
            items = [p for p in self.pods if sel in ("", f"spec.nodeName={p['spec']['nodeName']}")]
            body = {
                "kind": "PodList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": "1"},
                "items": items,
            }
            return 200, "application/json", json.dumps(body).encode()
        if one:
            for p in self.pods:
                if (p["metadata"]["namespace"], p["metadata"]["name"]) == one.groups():
                    return 200, "application/json", json.dumps(p).encode()
        status = {
            "kind": "Status",
            "apiVersion": "v1",
            "status": "Failure",
            "reason": "NotFound",
            "code": 404,
        }
        return 404, "application/json", json.dumps(status).encode()

    def close(self) -> None:
        self.http.close()


def test_a_real_agent_books_each_hami_pod_by_its_share(shared, prefix, exporter, tmp_path):
    """`serve --source dcgm --k8s-api on`, the pods listed from an API server speaking the pods
    API (lightkube): each pod's job holds, to the millisecond, its lanes of the time from its
    registration to its watermark."""
    pytest.importorskip("lightkube")
    api = PodsApi(_pods())
    cfg = write_kubeconfig(tmp_path / "kubeconfig", api.url)
    env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"} | {"KUBECONFIG": str(cfg)}
    args = ["serve", "--source", "dcgm", "--dcgm-url", exporter, "--host", NODE, "--agent-id", NODE]
    args += ["--k8s-api", "on", "--redis-url", SHARED_URL, "--prefix", prefix, "--port", str(free_port())]
    args += ["--listen", "127.0.0.1", "--book-interval", "0.3", "--sample-interval", "0.2"]
    jobs = {"ml:infer-a": (0, 30, 100), "ml:infer-b": (30, 50, 100), "research:notebook": (0, 100, 100)}
    agent = spawn_cli(*args, stderr=subprocess.PIPE, env=env)
    try:
        wait_booked(shared, prefix, jobs, agent)
        agent.terminate()
        _out, err = agent.communicate(timeout=30)
        assert "Traceback" not in err, err
        assert_booked_by_lanes(shared, prefix, NODE, jobs)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.communicate(timeout=30)
        api.close()
