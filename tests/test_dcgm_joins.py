"""The PromQL joins docs/deployment.md shows, on a real Prometheus: costexporter's per-GPU series
against dcgm-exporter's under both of its host label spellings (`Hostname` up to 3.x,
`hostname` since 4.x) and under its default ServiceMonitor (`honorLabels: false`: its pod labels
become `exported_pod`/`exported_namespace`), with costexporter scraped either way.

Two recorded dcgm-exporter expositions are served over HTTP as static files; one real
`costexporter serve --source dcgm` reads both; Prometheus scrapes the files with target labels
as a ServiceMonitor gives them (the exporter's own pod and namespace) and the agent twice."""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.error
import urllib.parse
from pathlib import Path

import pytest
import yaml

from .conftest import SHARED_URL, spawn_cli
from .http_stub import EXPOSITION, HttpStub
from .redis_server import free_port
from .test_stack import _get, _prometheus, _query

PROMETHEUS = shutil.which("prometheus")
PARENT = "GPU-5e1d0c3b-7a9f-4c2e-8b1d-2f3a4b5c6d70"  # the MIG GPU of the recorded H100 node
DATA = Path(__file__).parent / "data" / "dcgm"
OLD, NEW, MIG = "dcgm-3.3-Hostname.prom", "dcgm-4.2-hostname.prom", "dcgm-4.2-mig-h100.prom"

# The queries docs/deployment.md shows (kept here, so a change to either is seen).
JOINS = {
    "uuid": "DCGM_FI_DEV_FB_USED * on (UUID, GPU_I_ID) group_left (training_job) {ours}",
    "Hostname": "{ours} * on (UUID, Hostname, gpu, GPU_I_ID) group_left (modelName) DCGM_FI_DEV_POWER_USAGE",
    "hostname": "{ours} * on (UUID, hostname, gpu, GPU_I_ID) group_left (modelName) DCGM_FI_DEV_POWER_USAGE",
    "exported_pod": (
        "DCGM_FI_DEV_FB_USED * on (exported_namespace, exported_pod, gpu, GPU_I_ID) "
        "group_left (training_job) {ours_pod}"
    ),
}


def test_the_joins_run_here_are_the_ones_the_docs_show():
    """docs/deployment.md shows each join this file runs, and the README the first one."""
    root = Path(__file__).resolve().parent.parent
    docs = " ".join((root / "docs" / "deployment.md").read_text().split())
    readme = " ".join((root / "README.md").read_text().split())
    ours = "costexporter_gpu_power_watts"
    for name, q in JOINS.items():
        shown = q.format(ours=ours, ours_pod=f'{ours}{{exported_pod!=""}}')
        assert shown in docs, name
    assert JOINS["uuid"].format(ours=ours) in readme


class StaticFiles:
    """A real HTTP server answering /<name> with a file's bytes, as an exporter's /metrics."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files
        self.http = HttpStub(self.answer)
        self.addr = self.http.addr

    def answer(self, path: str) -> tuple[int, str, bytes]:
        file = self.files.get(path.strip("/"))
        if file is None:
            return 404, "text/plain", b"no such file\n"
        return 200, EXPOSITION, file.read_bytes()

    def close(self) -> None:
        self.http.close()


def _scrape(job: str, target: str, path: str, honor: bool, pod: str, namespace: str) -> dict:
    """A scrape config as the Prometheus Operator makes of a ServiceMonitor: the target's own pod
    and namespace as target labels."""
    return {
        "job_name": job,
        "honor_labels": honor,
        "metrics_path": path,
        "static_configs": [{"targets": [target], "labels": {"pod": pod, "namespace": namespace}}],
    }


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (.ci/run installs it)")
def test_documented_joins_work_under_both_host_spellings_and_the_default_servicemonitor(prefix, tmp_path):
    files = StaticFiles({OLD: DATA / OLD, NEW: DATA / NEW, MIG: DATA / MIG})
    port, prom_port = free_port(), free_port()
    args = ["serve", "--source", "dcgm", "--dcgm-url", f"http://{files.addr}/{OLD}"]
    args += ["--dcgm-url", f"http://{files.addr}/{NEW}", "--agent-id", "a1", "--k8s-api", "off"]
    args += ["--dcgm-url", f"http://{files.addr}/{MIG}"]
    args += ["--redis-url", SHARED_URL, "--prefix", prefix, "--port", str(port), "--listen", "127.0.0.1"]
    args += ["--book-interval", "0.5", "--sample-interval", "0.5"]
    agent = spawn_cli(*args, stderr=subprocess.PIPE)
    (tmp_path / "prometheus.yml").write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "scrape_configs": [
                    # dcgm-exporter's chart: its ServiceMonitor, honorLabels false.
                    _scrape("dcgm-old", files.addr, f"/{OLD}", False, "dcgm-exporter-4kx8p", "gpu-operator"),
                    _scrape("dcgm-new", files.addr, f"/{NEW}", False, "dcgm-exporter-9zq2m", "gpu-operator"),
                    _scrape("dcgm-mig", files.addr, f"/{MIG}", False, "dcgm-exporter-7hw4d", "gpu-operator"),
                    # costexporter's chart (honorLabels true), and a ServiceMonitor without it.
                    _scrape("ce-honor", f"127.0.0.1:{port}", "/metrics", True, "ce-agent", "monitoring"),
                    _scrape("ce-default", f"127.0.0.1:{port}", "/metrics", False, "ce-agent", "monitoring"),
                ],
            }
        )
    )
    prom = _prometheus(tmp_path / "prometheus.yml", prom_port)
    base = f"http://127.0.0.1:{prom_port}"
    try:
        ready = 'count(costexporter_gpu_power_watts{training_job!=""}) by (job)'
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                if len(_query(base, ready)) == 2 and len(_query(base, "DCGM_FI_DEV_FB_USED")) == 8:
                    break
            except OSError:
                pass
            time.sleep(1)
        seen = 0
        for scrape_job in ("ce-honor", "ce-default"):
            ours = f'costexporter_gpu_power_watts{{job="{scrape_job}"}}'
            # DCGM's series of every GPU a training job holds, by UUID: all four GPUs, both nodes.
            res = _query(base, JOINS["uuid"].format(ours=ours))
            jobs = {r["metric"].get("training_job", "") for r in res}
            assert jobs == {"ml:llama-ft", "team-a:infer-a", "nlp:bert-eval", "ml:sft", ""}, scrape_job
            assert len(res) == 8  # every GPU and every MIG instance, each once
            mig = {
                r["metric"].get("GPU_I_ID"): r["metric"].get("training_job", "")
                for r in res
                if r["metric"]["UUID"] == PARENT
            }
            assert mig == {"1": "ml:llama-ft", "5": "nlp:bert-eval", "13": ""}
            # The old exporter's `Hostname` joins its two GPUs, the new one's `hostname` its two.
            for label, node in (("Hostname", "gpu-node-a"), ("hostname", "gpu-node-b")):
                on_node = f'costexporter_gpu_power_watts{{job="{scrape_job}",{label}="{node}"}}'
                res = _query(base, JOINS[label].format(ours=on_node))
                assert len(res) == 2 and {r["metric"][label] for r in res} == {node}, (scrape_job, label)
                assert {r["metric"]["modelName"] for r in res} == {"NVIDIA H100 80GB HBM3"}
            # A MIG node as dcgm-exporter writes it (no row of the GPU itself, the GPU's power on
            # every instance): each instance and the whole GPU beside it join once, no
            # "duplicate series for the match group" (the join without GPU_I_ID failed here).
            on_mig = f'costexporter_gpu_power_watts{{job="{scrape_job}",hostname="gpu-node-m"}}'
            res = _query(base, JOINS["hostname"].format(ours=on_mig))
            got_mig = sorted((r["metric"]["gpu"], r["metric"].get("GPU_I_ID", "")) for r in res)
            assert got_mig == [("0", "1"), ("0", "13"), ("0", "5"), ("1", "")], (scrape_job, got_mig)
            # Under dcgm-exporter's default ServiceMonitor its `pod` is its own pod: the workload is
            # `exported_pod`, and costexporter's series carry that name too.
            ours_pod = f'costexporter_gpu_power_watts{{job="{scrape_job}",exported_pod!=""}}'
            res = _query(base, JOINS["exported_pod"].format(ours_pod=ours_pod))
            got = {
                (r["metric"]["exported_pod"], r["metric"]["gpu"], r["metric"]["training_job"]) for r in res
            }
            assert got == {
                ("llama-ft-worker-0", "0", "ml:llama-ft"),
                ("llama-ft-worker-0", "1", "ml:llama-ft"),
                ("infer-a-7d9f8c6b5-x2k9q", "0", "team-a:infer-a"),
                ("infer-a-7d9f8c6b5-x2k9q", "1", "team-a:infer-a"),
                ("llama-ft-worker-0", "0", "ml:llama-ft"),  # the MIG node's 3g instance
                ("bert-eval-x7k2p", "0", "nlp:bert-eval"),
                ("sft-0", "1", "ml:sft"),
            }, scrape_job
            seen += 1
        assert seen == 2
        # What breaks without those labels: dcgm-exporter's `pod` is its own pod, one per node,
        # so matching on it pairs every GPU of a node with every other.
        bad = "DCGM_FI_DEV_FB_USED * on (pod, namespace) group_left (training_job) " + (
            'costexporter_gpu_power_watts{job="ce-honor"}'
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            _get(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": bad}))
        assert e.value.code == 422
    finally:
        prom.terminate()
        agent.terminate()
        _out, err = agent.communicate(timeout=30)
        prom.wait(30)
        files.close()
    assert "Traceback" not in err, err


def test_an_exporter_of_another_node_is_named_once(caplog):
    """A `--dcgm-url` that reaches another node's exporter (a ClusterIP Service without
    internalTrafficPolicy: Local) is said, once, with the node it reached."""
    from costexporter.sources.dcgm import DcgmSource

    files = StaticFiles({NEW: DATA / NEW})
    try:
        src = DcgmSource([f"http://{files.addr}/{NEW}"], host="gpu-node-a")
        with caplog.at_level("WARNING", logger="costexporter.sources.dcgm"):
            assert len(src.read()) == 2 and len(src.read()) == 2
        said = [r.getMessage() for r in caplog.records if "not this agent's node" in r.getMessage()]
        assert len(said) == 1 and "'gpu-node-b'" in said[0]
        assert src.foreign_hosts == {"gpu-node-b"}
        same = DcgmSource([f"http://{files.addr}/{NEW}"], host="gpu-node-b")
        same.read()
        assert not same.foreign_hosts
    finally:
        files.close()
