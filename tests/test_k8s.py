"""Kubernetes jobs without code changes: GPUs dcgm-exporter attributes to pods
become jobs booked by band, with namespace in the meta and DCGM's labels on the per-GPU series.

End to end: a real HTTP server serving dcgm-exporter's text with pod labels, a real
`costexporter serve --source dcgm` process, the shared Redis; pure parts with hypothesis."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import threading
import time

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from costexporter.core import bandtable
from costexporter.core.booking import (
    POS_INF,
    BookingConfig,
    Regime,
    Slices,
    band_timeline,
    book,
    build_timeline,
    category_table,
    is_stepless,
)
from costexporter.core.model import CATEGORIES, Band, Category, Event
from costexporter.core.timeutil import to_ms
from costexporter.services.k8s import job_name
from costexporter.sources.dcgm import PodRef
from costexporter.store import keys, ledger, protocol

from .conftest import SHARED_URL, promtool_check_metrics, skip_unchecked_exposition, spawn_cli
from .http_stub import Exposition
from .redis_server import free_port
from .test_agent import scrape

BAND_NAMES = bandtable.current().names

CFG = BookingConfig()
ROLES = {"master", "worker", "launcher", "chief", "ps", "evaluator", "replica", "node", "leader"}
KUBEFLOW = "training.kubeflow.org/job-name"

# ---- the job's name -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pod", "labels", "want"),
    [
        ("llama-ft-worker-3", {"training_kubeflow_org_job_name": "llama-ft"}, "ml:llama-ft"),  # sanitized
        ("x-0", {KUBEFLOW: "llama-ft"}, "ml:llama-ft"),  # as is
        ("x-0", {"label_jobset_sigs_k8s_io_jobset_name": "js"}, "ml:js"),  # kube-state-metrics style
        ("llama-ft-worker-3", {}, "ml:llama-ft"),  # PyTorchJob replica
        ("llama-ft-launcher-x7k2p", {}, "ml:llama-ft"),  # MPIJob launcher
        ("bert-pretrain-x7k2p", {}, "ml:bert-pretrain"),  # batch Job pod
        ("js-workers-0-3-abcde", {}, "ml:js"),  # JobSet
        ("sft-run-12-master-0", {}, "ml:sft-run-12"),
        ("trainer", {}, "ml:trainer"),  # a bare pod
    ],
)
def test_job_name_from_pod_labels_else_the_pod_name(pod, labels, want):
    assert job_name(PodRef("ml", pod, "trainer", labels)) == want


def test_job_label_order_is_the_configured_one():
    ref = PodRef(
        "ml", "p-0", "", {"batch_kubernetes_io_job_name": "b", "jobset_sigs_k8s_io_jobset_name": "j"}
    )
    assert job_name(ref) == "ml:j"  # JobSet before batch Job by default
    assert job_name(ref, ["batch.kubernetes.io/job-name"]) == "ml:b"


@given(
    parts=st.lists(
        st.from_regex(r"[a-z]{6,10}", fullmatch=True).filter(lambda w: w.rstrip("s") not in ROLES),
        min_size=1,
        max_size=3,
    ),
    suffix=st.sampled_from(["", "-worker-3", "-launcher-x7k2p", "-x7k2p", "-master-0", "-workers-0-1-abcde"]),
)
@settings(max_examples=200, deadline=None)
def test_a_controllers_pod_name_gives_back_its_job(parts, suffix):
    # A job named like a replica role ("...-worker") is ambiguous by name: use a pod label.
    """Any job name of words (6+ letters each), under the suffixes Kubernetes controllers add."""
    job = "-".join(parts)
    assert job_name(PodRef("ml", job + suffix)) == f"ml:{job}"


@given(ns=st.from_regex(r"[a-z][a-z0-9-]{0,20}", fullmatch=True), pod=st.text(min_size=1, max_size=80))
@settings(max_examples=200, deadline=None)
def test_any_pod_name_gives_a_job_name_usable_as_a_hash_tag_and_a_path_segment(ns, pod):
    name = job_name(PodRef(ns, pod))
    assert protocol.check_job(name) == name
    assert "/" not in name and name.startswith(f"{ns}:")


# ---- booking by band ------------------------------------------------------------------------


def _ev(type_: str, ts: float, rank: int = 0, **fields) -> Event:
    return Event(type_, "j", to_ms(ts), rank, "s", int(ts * 1000), dict(fields))


STEPLESS = [_ev("meta", 0.0, progress="none", namespace="ml")]


def test_band_categories_busy_valid_idle_and_deadlock_waste():
    row = {
        Band(b): Category(category_table(bandtable.current())[Regime.BAND, b + 1])
        for b in range(len(BAND_NAMES))
    }
    assert row[Band.COMPUTE] == Category.PRODUCTIVE
    assert row[Band.COMMUNICATION] == Category.COMMUNICATION
    assert row[Band.IDLE] == Category.IDLE
    assert row[Band.DEADLOCK] == Category.STALLED
    assert (
        category_table(bandtable.current())[Regime.BAND, 0] == Category.UNOBSERVED
    )  # no sample: unseen, not valid


def test_events_win_a_rank0_step_switches_to_the_step_rules():
    assert is_stepless(STEPLESS)
    assert not is_stepless([*STEPLESS, _ev("step", 5.0, step=1)])
    assert is_stepless([*STEPLESS, _ev("step", 5.0, rank=3, step=1)])  # only rank 0 is progress
    assert not is_stepless([_ev("meta", 0.0, namespace="ml")])  # a trainer's job: step rules
    tl = build_timeline([*STEPLESS, _ev("step", 5.0, step=1)], CFG, 0, 600_000, final=True)
    assert Regime.BAND not in tl.regime.tolist()
    # 10 minutes without a step after step 1: progress stopped, not "busy is valid".
    assert Regime.STALL in tl.regime.tolist()


@st.composite
def _runs(draw):
    """Rank-0 run events (start/end in any order) over [0, 1000) s, and extra noise events."""
    n = draw(st.integers(0, 6))
    evs = [
        _ev("run", draw(st.floats(0, 1000)), state=draw(st.sampled_from(["start", "end", "resume"])))
        for _ in range(n)
    ]
    evs += [_ev("run", draw(st.floats(0, 1000)), rank=1, state="end") for _ in range(draw(st.integers(0, 2)))]
    return sorted(STEPLESS + evs, key=lambda e: e.ts)


@given(
    events=_runs(),
    bands=st.lists(st.integers(0, len(BAND_NAMES) - 1), min_size=1, max_size=60),
    n_gpus=st.integers(1, 4),
)
@settings(max_examples=200, deadline=None)
def test_stepless_booking_conserves_time_and_books_each_slice_by_its_band(events, bands, n_gpus):
    """Every GPU-millisecond of every slice lands in exactly one category: its band's, while the
    run is open; unassigned outside it (before start, after rank 0's end)."""
    start, end = 0, 1_000_000
    tl = band_timeline(events, CFG, start, end)
    assert tl.bounds[0] < start and tl.bounds[-1] == POS_INF
    assert (np.diff(tl.bounds) > 0).all() and (tl.regime[1:] != tl.regime[:-1]).all()
    assert tl.decided_until_ms == (tl.end_ms if tl.end_ms is not None else end)  # nothing pending
    k = len(bands)
    edges = np.linspace(start, end, k + 1).astype(np.int64)
    g = np.repeat(np.arange(n_gpus), k)
    s = Slices(
        g,
        np.tile(edges[:-1], n_gpus),
        np.tile(edges[1:], n_gpus),
        np.tile(np.asarray(bands, np.int8), n_gpus),
        np.ones(g.size),
        None,
        None,
    )
    ranks = np.arange(n_gpus)
    pieces = book(s, tl, ranks, np.zeros(n_gpus, np.int64), np.full(n_gpus, end, np.int64))
    assert int(pieces.dur_ms.sum()) == n_gpus * (end - start)  # conserved
    i = np.searchsorted(tl.bounds, pieces.start_ms, "right") - 1
    open_ = tl.regime[i] == Regime.BAND
    want = category_table(bandtable.current())[Regime.BAND, pieces.band.astype(int) + 1]
    assert (pieces.category[open_] == want[open_]).all()
    assert (pieces.category[~open_] == Category.UNASSIGNED).all()
    ends = [e for e in events if e.type == "run" and e.rank == 0 and e.get("state") == "end"]
    if not ends:
        assert open_.all()  # no run end from rank 0: the whole span is the job's


# ---- end to end: fake dcgm-exporter, real agent process, real Redis -------------------------

HEAD = {
    "DCGM_FI_DEV_GPU_UTIL": ("gauge", "GPU utilization (in %)."),
    "DCGM_FI_DEV_POWER_USAGE": ("gauge", "Power draw (in W)."),
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": ("counter", "Total energy consumption since boot (in mJ)."),
}
HOST = "gpu-node-7"


def uuid(g: int) -> str:
    return f"GPU-7e57{g:04d}-0000-4000-8000-00000000000{g}"


class FakeDcgmExporter:
    """A real HTTP server speaking dcgm-exporter 3.x's text format in Kubernetes mode: each
    GPU's series carry the pod the device plugin gave it to; the state can change at any time."""

    def __init__(self, gpus: list[dict]) -> None:
        self.gpus = gpus
        self.energy = [0.0] * len(gpus)
        self.last = time.time()
        self.lock = threading.Lock()
        self.http = Exposition(self.render)
        self.url = self.http.url

    def render(self) -> str:
        with self.lock:
            now = time.time()
            for g, st_ in enumerate(self.gpus):
                self.energy[g] += st_["power"] * (now - self.last) * 1000
            self.last = now
            out = []
            for name, (kind, help_) in HEAD.items():
                out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
                for g, st_ in enumerate(self.gpus):
                    labels = {
                        "gpu": str(g),
                        "UUID": uuid(g),
                        "pci_bus_id": f"00000000:{g + 0x18:02X}:00.0",
                        "device": f"nvidia{g}",
                        "modelName": "NVIDIA B300 SXM6 AC",
                        "Hostname": HOST,
                        "DCGM_FI_DRIVER_VERSION": "580.65.06",
                    }
                    if st_.get("pod"):
                        labels.update(container="trainer", namespace=st_["ns"], pod=st_["pod"])
                        labels.update(st_.get("labels", {}))
                    lab = ",".join(f'{k}="{v}"' for k, v in labels.items())
                    value = {
                        "DCGM_FI_DEV_GPU_UTIL": st_["util"],
                        "DCGM_FI_DEV_POWER_USAGE": st_["power"],
                        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": round(self.energy[g]),
                    }[name]
                    out.append(f"{name}{{{lab}}} {value}")
            return "\n".join(out) + "\n"

    def set(self, g: int, **kw) -> None:
        with self.lock:
            self.gpus[g].update(kw)
            if kw.get("pod") is None and "pod" in kw:
                self.gpus[g].pop("labels", None)

    def close(self) -> None:
        self.http.close()


def _serve(url: str, prefix: str, port: int) -> subprocess.Popen:
    args = ["serve", "--source", "dcgm", "--dcgm-url", url, "--host", HOST, "--agent-id", HOST]
    args += ["--redis-url", SHARED_URL, "--prefix", prefix, "--port", str(port), "--listen", "127.0.0.1"]
    args += ["--book-interval", "0.3", "--sample-interval", "0.2", "--k8s-job-label", KUBEFLOW]
    args += ["--no-trim"]  # the tests read the jobs' whole streams (what was posted, heartbeats too)
    return spawn_cli(*args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait(what, cond, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_pods_seen_through_dcgm_exporter_are_booked_as_jobs_by_band(shared, prefix):
    llama, resnet = "ml:llama-ft", "vision:resnet"
    exp = FakeDcgmExporter(
        [
            # Two GPUs of a PyTorchJob's worker, named by its Kubeflow label (sanitized by dcgm-exporter).
            {"power": 1000.0, "util": 100, "pod": "llama-ft-worker-0", "ns": "ml",
             "labels": {"training_kubeflow_org_job_name": "llama-ft"}},
            {"power": 990.0, "util": 100, "pod": "llama-ft-worker-0", "ns": "ml",
             "labels": {"training_kubeflow_org_job_name": "llama-ft"}},
            # A batch Job's pod holding its GPU and doing nothing: named from the pod name.
            {"power": 135.0, "util": 0, "pod": "resnet-x7k2p", "ns": "vision"},
            # No pod: nobody's GPU.
            {"power": 130.0, "util": 0},
        ]
    )  # fmt: skip
    port = free_port()
    agent = _serve(exp.url, prefix, port)
    try:
        _wait("both jobs", lambda: set(shared.zrange(keys.jobs_key(prefix), 0, -1)) >= {llama, resnet})
        time.sleep(0.5)
        jobs = set(shared.zrange(keys.jobs_key(prefix), 0, -1))
        assert jobs == {llama, resnet}  # the pod-less GPU is no job's
        meta = shared.hgetall(keys.meta_key(prefix, llama))
        assert meta["pod"] == "llama-ft-worker-0" and meta["progress"] == "none"
        assert "namespace" not in meta  # the cluster's word, in the agent's attribution
        fig = keys.figures_key(prefix, llama)
        _wait("attributed", lambda: shared.hget(fig, "attr:namespace") == "ml")
        assert shared.hget(fig, "attr:namespace:source") == "kubernetes"
        assert meta["gpu_model"] == "NVIDIA B300 SXM6 AC"
        ranks = {int(r): json.loads(v) for r, v in shared.hgetall(keys.ranks_key(prefix, llama)).items()}
        assert sorted((e["gpu_uuid"], e["host"]) for e in ranks.values()) == [
            (uuid(0), HOST),
            (uuid(1), HOST),
        ]
        assert sorted(ranks) == [0, 1]

        def booked(job, cat, ms):
            return ledger.net_ms(ledger.read_amounts(shared, prefix, job)).get(cat, 0) >= ms

        _wait("llama productive", lambda: booked(llama, "productive", 4000))
        _wait("resnet idle", lambda: booked(resnet, "idle", 2000))
        # The llama GPUs now sit idle inside the pod: still the job's, booked as waste.
        exp.set(0, power=135.0, util=0)
        exp.set(1, power=135.0, util=0)
        before = ledger.net_ms(ledger.read_amounts(shared, prefix, llama))
        _wait("llama idle", lambda: booked(llama, "idle", before["idle"] + 2000))

        # The series carry DCGM's labels, the pod and the namespace: `* on(UUID)` joins.
        m, text = scrape(port)
        power = {lab["UUID"]: lab for lab, _ in m["costexporter_gpu_power_watts"]}
        assert power[uuid(0)]["Hostname"] == HOST and power[uuid(0)]["gpu"] == "0"
        assert power[uuid(0)]["pod"] == "llama-ft-worker-0" and power[uuid(0)]["namespace"] == "ml"
        assert power[uuid(0)]["container"] == "trainer" and power[uuid(0)]["training_job"] == llama
        assert power[uuid(2)]["namespace"] == "vision" and power[uuid(3)]["pod"] == ""
        exposition_checked = promtool_check_metrics(text)

        # resnet's pod goes away: its last GPU is released, so the job ends; GPU 2 is nobody's again.
        exp.set(2, pod=None, ns=None)
        _wait(
            "resnet ended",
            lambda: shared.hget(keys.figures_key(prefix, resnet), "ended") == "1",
        )
        events = shared.xrange(keys.stream_key(prefix, resnet))
        ends = [f for _, f in events if f["type"] == "run" and f["state"] == "end"]
        assert len(ends) == 1 and ends[0]["rank"] == "0"
        # The watcher sees it alive meanwhile, from the job's heartbeat stream (no agent reads it).
        assert not any(f["type"] == "heartbeat" for _, f in events)
        assert any(f["type"] == "heartbeat" for _, f in shared.xrange(keys.beats_key(prefix, resnet)))
        beats = {
            f["rank"] for _, f in shared.xrange(keys.beats_key(prefix, llama)) if f["type"] == "heartbeat"
        }
        assert beats == {"0", "1"}  # every rank, or the watcher would call the silent one crashed
        # A retried Job: the same job's pod takes the GPU again, so its run starts again.
        exp.set(2, pod="resnet-k9d2q", ns="vision")

        def restarted():
            evs = shared.xrange(keys.stream_key(prefix, resnet))
            return [f for _, f in evs if f["type"] == "run" and f["state"] == "start" and f["rank"] == "0"]

        _wait("resnet restarted", restarted)

        # Conservation: every millisecond from registration to the watermark, on each GPU, once.
        for job in (llama,):
            wm = ledger.load_watermark(shared, prefix, job, HOST)["booked_until"]
            by_rank = shared.hgetall(keys.ranks_key(prefix, job))
            regs = [protocol.parse_registration(r, v).ts_ms for r, v in by_rank.items()]
            total = sum(ledger.net_ms(ledger.read_amounts(shared, prefix, job)).values())
            assert total == sum(wm - r for r in regs), job
        assert set(ledger.net_ms(ledger.read_amounts(shared, prefix, llama))) <= set(CATEGORIES)
        wasted = ledger.net_ms(ledger.read_amounts(shared, prefix, resnet))
        assert wasted["productive"] == 0 and wasted["idle"] > 0
    finally:
        agent.terminate()
        _out, err = agent.communicate(timeout=30)
        exp.close()
    assert "Traceback" not in err, err
    if not exposition_checked:
        skip_unchecked_exposition()


def test_a_gpu_the_trainer_registered_itself_is_left_to_the_trainer(shared, prefix):
    """Events win: the trainer's registration of the GPU stands; the pod adds no second one."""
    from costexporter.trainer.transport import send_entries

    job = "ml:llama-ft"
    trainer = {
        "v": "1", "type": "register", "job": job, "ts": f"{time.time():.6f}", "rank": "0",
        "session": "trainer-1", "seq": "0", "host": HOST, "gpu_uuid": uuid(0), "gpu": "0",
    }  # fmt: skip
    send_entries(shared, prefix, job, [trainer])
    exp = FakeDcgmExporter(
        [
            {
                "power": 1000.0,
                "util": 100,
                "pod": "llama-ft-worker-0",
                "ns": "ml",
                "labels": {"training_kubeflow_org_job_name": "llama-ft"},
            }
        ]
    )
    port = free_port()
    agent = _serve(exp.url, prefix, port)
    try:
        _wait("the agent booked the trainer's job", lambda: ledger.load_watermark(shared, prefix, job, HOST))
        time.sleep(1.0)  # a few more k8s sync rounds
        entries = shared.xrange(keys.stream_key(prefix, job))
        assert [f["session"] for _, f in entries if f["type"] == "register"] == ["trainer-1"]
        assert not any(f["type"] == "meta" and f.get("progress") == "none" for _, f in entries)
    finally:
        agent.terminate()
        agent.communicate(timeout=30)
        exp.close()


# ---- the rules: a job without steps never "stops making progress" -----------------------------


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
@pytest.mark.parametrize(("progress", "fires"), [("none", False), ("", True), (None, True)])
def test_cost_slope_alert_ignores_jobs_without_steps(tmp_path, progress, fires):
    """`promtool test rules` on the shipped rules: cost rising for an hour with the progress
    timestamp still fires CostSlopeWithoutSteps for a trainer's job, not for a stepless one."""
    from costexporter.tools.rules import RuleWindows, render

    rules = tmp_path / "rules.yaml"
    rules.write_text(render(RuleWindows()))
    lab = 'training_job="ml:j",instance="a1"'
    series = [
        {
            "series": f'costexporter_cost_total{{{lab},category="productive",currency="USD"}}',
            "values": "0+1x60",
        },
        {"series": f'costexporter_cost_since_last_step{{{lab},currency="USD"}}', "values": "0+1x60"},
        {"series": f"costexporter_job_last_progress_timestamp_seconds{{{lab}}}", "values": "100x60"},
        {"series": f"costexporter_job_in_allowance{{{lab}}}", "values": "0x60"},
        {"series": f"costexporter_job_ended{{{lab}}}", "values": "0x60"},
    ]
    if progress is not None:
        info = f'costexporter_job_info{{{lab},team="",namespace="ml",cost_center="",progress="{progress}"}}'
        series.append({"series": info, "values": "1x60"})
    from costexporter.tools.rules import rules as rule_doc

    (slope,) = [
        r
        for g in rule_doc(RuleWindows())["groups"]
        for r in g["rules"]
        if r.get("alert") == "CostSlopeWithoutSteps"
    ]
    notes = {
        k: v.replace("{{ $labels.training_job }}", "ml:j")
        .replace('{{ $value | printf "%.2f" }}', "40.00")
        .replace("{{ $labels.currency }}", "USD")
        for k, v in slope["annotations"].items()
    }
    exp = (
        [
            {
                "exp_labels": {
                    "training_job": "ml:j",
                    "severity": "critical",
                    "source": "rules",
                    "currency": "USD",
                },
                "exp_annotations": notes,
            }
        ]
        if fires
        else []
    )
    doc = {
        "rule_files": [str(rules)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": series,
                "alert_rule_test": [
                    {"eval_time": "40m", "alertname": "CostSlopeWithoutSteps", "exp_alerts": exp}
                ],
            }
        ],
    }
    f = tmp_path / "test.yaml"
    f.write_text(yaml.safe_dump(doc, sort_keys=False))
    r = subprocess.run(["promtool", "test", "rules", str(f)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_registrations_survive_a_redis_outage_without_duplicates(tmp_path, prefix):
    """Redis dies while the pods come and go: the sync loop keeps running (errors counted), and
    once Redis is back every GPU is registered once, the run ends once and restarts once."""
    from costexporter.services.k8s import KubernetesJobs
    from costexporter.sources.dcgm import DcgmSource

    from .redis_server import RedisServer

    server = RedisServer(tmp_path / "redis").start()
    exp = FakeDcgmExporter(
        [
            {"power": 1000.0, "util": 100, "pod": "bert-x7k2p", "ns": "nlp"},
            {"power": 1000.0, "util": 100, "pod": "bert-x7k2p", "ns": "nlp"},
        ]
    )
    src = DcgmSource([exp.url], host=HOST)
    stop = threading.Event()
    kj = KubernetesJobs(protocol.connect(server.url), prefix, src, HOST)
    loop = threading.Thread(target=kj.run, args=(stop, 0.05), daemon=True)
    job = "nlp:bert"
    r = server.client()

    def entries(type_: str, **match) -> list[dict]:
        """The job's events as its readers take them: one per (rank, session, seq) (a write whose
        reply the outage cut is sent again whole)."""
        got = {(f["rank"], f["session"], f["seq"]): f for _, f in r.xrange(keys.stream_key(prefix, job))}
        out = [f for f in got.values() if f["type"] == type_]
        return [f for f in out if all(f.get(k) == v for k, v in match.items())]

    try:
        src.read()
        loop.start()
        _wait("registered", lambda: len(entries("register")) == 2)
        server.kill()
        for g in (0, 1):
            exp.set(g, pod=None, ns=None)  # the pod ends while Redis is down
        src.read()
        _wait("errors counted", lambda: kj.errors >= 3)
        assert loop.is_alive()
        server.start()
        r = server.client()
        _wait("run end", lambda: entries("run", state="end"))
        for g in (0, 1):
            exp.set(g, pod="bert-4hq8w", ns="nlp")  # a retried Job
        src.read()
        _wait("run start", lambda: entries("run", state="start"))
        time.sleep(0.5)  # more rounds: nothing more is posted
        assert len(entries("run", state="end")) == 1 and len(entries("run", state="start")) == 1
        regs = entries("register")
        assert len(regs) == 4  # each GPU once per run
        assert sorted({(f["gpu_uuid"], f["rank"]) for f in regs}) == [(uuid(0), "0"), (uuid(1), "1")]
        assert len(r.hgetall(keys.ranks_key(prefix, job))) == 2
    finally:
        stop.set()
        loop.join(5)
        server.stop()
        exp.close()


def test_a_write_whose_reply_an_outage_cut_is_sent_again_and_the_job_still_ends(shared, prefix, monkeypatch):
    """Redis applied a registration (or the run end) and died before it replied: the GPU is held
    all the same, the write goes again whole (its seqs kept: readers take each event once) and
    the job's last release still ends it. Before, the lost reply left the GPU in the job's set
    but not in the agent's memory, and the job never ended."""
    import redis as redis_mod

    from costexporter.services import k8s
    from costexporter.sources.dcgm import DcgmSource
    from costexporter.store.reader import EventReader

    real = k8s.send_entries
    cut: list[str] = []  # the types of the writes whose reply is to be lost, in order

    def send(client, prefix_, job_, entries, **kw):
        delivery = real(client, prefix_, job_, entries, **kw)
        if cut and cut[0] in {e["type"] for e in entries}:
            cut.pop(0)
            raise redis_mod.ConnectionError("Connection closed by server.")
        return delivery

    monkeypatch.setattr(k8s, "send_entries", send)
    exp = FakeDcgmExporter([{"power": 1000.0, "util": 100, "pod": "bert-x7k2p", "ns": "nlp"}] * 2)
    try:
        src = DcgmSource([exp.url], host=HOST)
        kj = k8s.KubernetesJobs(protocol.connect(SHARED_URL), prefix, src, HOST)
        src.read()
        cut[:] = ["register", "register"]  # both registrations applied, neither acknowledged
        for _ in range(3):
            try:
                kj.sync()
            except redis_mod.ConnectionError:
                kj.errors += 1
        assert kj.errors == 2 and not cut and len(kj.registered) == 2
        for g in (0, 1):
            exp.set(g, pod=None, ns=None)
        src.read()
        cut[:] = ["run"]  # the run end applied, not acknowledged
        for _ in range(3):
            try:
                kj.sync()
            except redis_mod.ConnectionError:
                kj.errors += 1
        assert kj.errors == 3 and not cut and not kj.registered
    finally:
        exp.close()
    job = "nlp:bert"
    raw = [f for _, f in shared.xrange(keys.stream_key(prefix, job))]
    assert len(raw) > 5  # some writes went twice, as an outage makes them
    reader = EventReader(shared, job, prefix)
    events = reader.read_all()
    assert sorted(e.type for e in events) == ["meta", "meta", "register", "register", "run"]
    assert reader.stats["duplicate"] == len(raw) - len(events)
    assert shared.hget(keys.k8s_ranks_key(prefix, job), "_ended") == "1"


BAD, GOOD = "nlp:bert", "vision:resnet"


@contextlib.contextmanager
def two_jobs_node(shared, prefix: str):
    """A node of two GPUs with a pod each (jobs BAD and GOOD, seen through dcgm-exporter's labels)
    and its Kubernetes registrations: (exporter, source, registrations, the types of a job's
    events in its stream), the source read once."""
    from costexporter.services import k8s
    from costexporter.sources.dcgm import DcgmSource

    exp = FakeDcgmExporter(
        [
            {"power": 1000.0, "util": 100, "pod": "bert-x7k2p", "ns": "nlp"},
            {"power": 1000.0, "util": 100, "pod": "resnet-k9d2q", "ns": "vision"},
        ]
    )
    try:
        src = DcgmSource([exp.url], host=HOST)
        kj = k8s.KubernetesJobs(protocol.connect(SHARED_URL), prefix, src, HOST)
        src.read()
        yield exp, src, kj, lambda job: [f["type"] for _, f in shared.xrange(keys.stream_key(prefix, job))]
    finally:
        exp.close()


def test_a_job_whose_keys_redis_refuses_does_not_stall_the_other_jobs_on_the_node(
    shared, prefix, monkeypatch, caplog
):
    """One job's events stream is not a stream (its trainer wrote anything there): Redis refuses
    every write to it for good. That job's writes are set aside, counted and logged once; the
    other jobs of the node are still registered, beat and ended. A refusal that passes (Redis
    full) keeps its write queued, and it goes once Redis takes it. Before, the refused write was
    queued first and sent again every round, and nothing after it was ever written."""
    import logging

    import redis as redis_mod

    from costexporter.services import k8s

    bad, good = BAD, GOOD
    shared.set(keys.stream_key(prefix, bad), "not a stream")
    with two_jobs_node(shared, prefix) as (exp, src, kj, types):
        with caplog.at_level(logging.DEBUG, logger=k8s.log.name):
            for _ in range(3):
                kj.sync()  # raises nothing: the refusal is the bad job's alone
        assert sorted(kj.registered) == [(bad, 0), (good, 1)]  # the GPU is held all the same
        assert types(good) == ["meta", "register"]
        assert shared.xlen(keys.beats_key(prefix, good)) == 1
        assert kj.refused == 1 and not kj._outbox  # its registration (heartbeats: a stream of their own)
        warned = [r for r in caplog.records if r.levelno == logging.WARNING and "refused" in r.message]
        assert len(warned) == 1 and "nlp:bert" in warned[0].message

        # Both pods go: the good job ends, the bad job's run end is refused and set aside.
        exp.set(0, pod=None, ns=None)
        exp.set(1, pod=None, ns=None)
        src.read()
        refused = kj.refused
        kj.sync()
        assert not kj.registered and not kj._outbox and kj.refused == refused + 1
        assert types(good)[-1] == "run"
        assert shared.hget(keys.k8s_ranks_key(prefix, good), "_ended") == "1"

        # Redis is full as the good job's pod comes back: its write waits, then goes.
        real, full = k8s.send_entries, [1]

        def send(*a, **kw):
            if full:
                full.pop()
                raise redis_mod.OutOfMemoryError("OOM command not allowed when used memory > 'maxmemory'.")
            return real(*a, **kw)

        monkeypatch.setattr(k8s, "send_entries", send)
        exp.set(1, pod="resnet-k9d2q", ns="vision")
        src.read()
        with pytest.raises(redis_mod.OutOfMemoryError):
            kj.sync()
        assert len(kj._outbox) == 1 and kj.refused == refused + 1  # kept, not counted refused
        kj.sync()
        assert not kj._outbox
        assert types(good)[-3:] == ["run", "meta", "register"]
        runs = [f["state"] for _, f in shared.xrange(keys.stream_key(prefix, good)) if f["type"] == "run"]
        assert runs == ["end", "start"]


def test_a_job_whose_ranks_hash_redis_refuses_is_retried_each_round_and_registers_once_mended(
    shared, prefix, caplog
):
    """The ranks hash of one job is not a hash (a trainer wrote anything there): the read that
    asks whether a trainer registered the GPU itself is refused. The registration is set aside
    (counted each round, logged once) and the other job of the node registers and beats; once
    the key is mended the GPU registers on the next round, once."""
    import logging

    from costexporter.services import k8s

    bad, good = BAD, GOOD
    shared.set(keys.ranks_key(prefix, bad), "not a hash")
    with two_jobs_node(shared, prefix) as (_exp, _src, kj, types):
        with caplog.at_level(logging.DEBUG, logger=k8s.log.name):
            for _ in range(3):
                kj.sync()  # raises nothing: the refusal is the bad job's alone
        assert sorted(kj.registered) == [(good, 1)]
        assert types(good) == ["meta", "register"] and types(bad) == []
        assert shared.xlen(keys.beats_key(prefix, good)) == 1
        assert kj.refused == 3 and not kj._outbox
        warned = [r for r in caplog.records if r.levelno == logging.WARNING and "refused" in r.message]
        assert len(warned) == 1 and "nlp:bert" in warned[0].message and "registration" in warned[0].message

        shared.delete(keys.ranks_key(prefix, bad))  # mended
        kj.sync()
        kj.sync()
        assert sorted(kj.registered) == [(bad, 0), (good, 1)] and kj.refused == 3
        assert types(bad) == ["meta", "register"]
