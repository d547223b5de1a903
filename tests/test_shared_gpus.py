"""Shared GPUs booked once: MIG instances are devices of their own holding their profile's slices
of the GPU, the GPU's rest is one more, and the slices' GPU-time always adds up to the GPU's own
time, to the millisecond, through booking, buckets and the live agent's ledger.

Pure properties with hypothesis; a recorded dcgm-exporter exposition of an H100 node with MIG
read by the real source; a real `costexporter serve` booking MIG pods into the shared Redis."""

from __future__ import annotations

import itertools
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from costexporter.core import bandtable, shares
from costexporter.core.booking import (
    BookingConfig,
    Pieces,
    Regime,
    Slices,
    band_timeline,
    book,
    category_table,
)
from costexporter.core.buckets import amounts
from costexporter.core.cost import Prices
from costexporter.core.model import Category, Event
from costexporter.core.timeutil import to_ms
from costexporter.sources.dcgm import DcgmSource
from costexporter.store import keys, ledger, protocol

from .conftest import SHARED_URL, promtool_check_metrics, skip_unchecked_exposition, spawn_cli
from .redis_server import free_port
from .test_dcgm_joins import StaticFiles

BAND_NAMES = bandtable.current().names

DATA = Path(__file__).parent / "data" / "dcgm"
MIG = "dcgm-4.2-mig-h100.prom"
PARENT = "GPU-5e1d0c3b-7a9f-4c2e-8b1d-2f3a4b5c6d70"
WHOLE_GPU = "GPU-5e1d0c3b-7a9f-4c2e-8b1d-2f3a4b5c6d71"
T0 = 1_764_000_000_000  # a real epoch in ms: the lane arithmetic must stay exact at this size


@st.composite
def partitions(draw):
    """A GPU of `den` lanes cut into consecutive slices (some may be empty)."""
    den = draw(st.sampled_from([1, 4, 7, 8]))
    cuts = sorted(draw(st.lists(st.integers(0, den), max_size=6)))
    edges = [0, *cuts, den]
    return [(a, b, den) for a, b in itertools.pairwise(edges)]


@given(
    part=partitions(),
    start=st.integers(0, 10**7),
    lengths=st.lists(st.integers(0, 10**6), min_size=1, max_size=30),
)
def test_slices_of_a_gpu_add_up_to_its_time_exactly_however_cut(part, start, lengths):
    """Any partition of the lanes, any pieces of time: the slices' GPU-ms are the GPU's ms, and
    each slice gets its share within a few milliseconds (whole milliseconds go round the lanes)."""
    edges = T0 + start + np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    a, b = edges[:-1], edges[1:]
    total = 0
    for lanes in part:
        lane_rows = np.tile(np.asarray(lanes, np.int64), (a.size, 1))
        ms = shares.gpu_ms(a, b, lane_rows)
        assert (ms >= 0).all()
        share = int(ms.sum())
        assert abs(share - shares.fraction(lanes) * int(edges[-1] - edges[0])) < 2 * lanes[2]
        total += share
    assert total == int(edges[-1] - edges[0])
    assert (shares.gpu_ms(a, b, None) == b - a).all()


def _ev(type_: str, ts: float, rank: int = 0, **fields) -> Event:
    return Event(type_, "j", to_ms(ts), rank, "s", int(ts * 1000), dict(fields))


@given(
    part=partitions(),
    bands=st.lists(st.integers(0, len(BAND_NAMES) - 1), min_size=1, max_size=40),
    end_at=st.one_of(st.none(), st.integers(1, 999)),
)
def test_booking_and_buckets_conserve_a_gpus_time_across_its_slices(part, bands, end_at):
    """The conservation property, extended to slices: each slice of one GPU is booked as a GPU
    of its own (by band, as a Kubernetes job is), then summed into 5-minute buckets: over every
    slice, category and bucket the GPU-milliseconds are the GPU's time, exactly."""
    start, end = T0, T0 + 1_000_000
    events = [_ev("meta", start / 1000, progress="none")]
    if end_at is not None:
        events.append(_ev("run", (start + end_at * 1000) / 1000, state="end"))
    tl = band_timeline(events, BookingConfig(), start, end)
    n, k = len(part), len(bands)
    edges = np.linspace(start, end, k + 1).astype(np.int64)
    g = np.repeat(np.arange(n), k)
    s = Slices(
        g.astype(np.int32),
        np.tile(edges[:-1], n),
        np.tile(edges[1:], n),
        np.tile(np.asarray(bands, np.int8), n),
        np.ones(g.size),
        None,
        None,
    )
    pieces = book(s, tl, np.arange(n), np.full(n, start, np.int64), np.full(n, end, np.int64))
    pieces.lanes = np.asarray(part, np.int64)[pieces.gpu]
    assert int(pieces.gpu_ms.sum()) == end - start  # booked once across the slices
    assert (pieces.gpu_ms >= 0).all()  # no piece is negative, however short
    # The categories are the band table's, whatever the weight.
    i = np.searchsorted(tl.bounds, pieces.start_ms, "right") - 1
    open_ = tl.regime[i] == Regime.BAND
    want = category_table(bandtable.current())[Regime.BAND, pieces.band.astype(int) + 1]
    assert (pieces.category[open_] == want[open_]).all()
    by_bucket = amounts(pieces, Prices(), 3.5)
    assert sum(int(a[:, 0].sum()) for a in by_bucket.values()) == end - start
    # Money follows the GPU-time: the slices together cost what the whole GPU would.
    whole = Pieces(pieces.gpu, pieces.start_ms, pieces.end_ms, pieces.band, pieces.category, pieces.energy_mj)
    cost = sum(int(a[:, 2].sum()) for a in by_bucket.values())
    assert (
        abs(cost - sum(int(a[:, 2].sum()) for a in amounts(whole, Prices(), 3.5).values()) / n)
        <= (n * len(by_bucket) * Category.UNOBSERVED)
        or n == 1
    )


# ---- the recorded exposition, through the real source ----------------------------------------


@pytest.fixture
def mig_exporter():
    files = StaticFiles({MIG: DATA / MIG})
    yield f"http://{files.addr}/{MIG}"
    files.close()


def test_mig_instances_are_devices_with_their_share_of_the_gpus_power(mig_exporter):
    src = DcgmSource([mig_exporter], host="gpu-node-m")
    readings = {r.gpu: r for r in src.read()}
    gpus = src.gpus()
    mig = {g.instance: (i, g) for i, g in enumerate(gpus) if g.parent_uuid == PARENT}
    assert set(mig) == {"1", "5", "13"}
    lanes = {gi: g.lanes for gi, (_i, g) in mig.items()}
    assert lanes == {"1": (0, 3, 7), "5": (3, 5, 7), "13": (5, 6, 7)}  # 3g, 2g, 1g of an H100's 7
    (rest_i,) = [i for i, g in enumerate(gpus) if g.uuid == PARENT]
    assert gpus[rest_i].lanes == (6, 7, 7) and gpus[rest_i].instance is None
    (whole_i,) = [i for i, g in enumerate(gpus) if g.uuid == WHOLE_GPU]
    assert gpus[whole_i].lanes == shares.WHOLE
    # Power: the GPU's 520 W, a fifth by slice size, the rest by size x engine activity: all of
    # it and no more, the busy 3g reading busy and its idle neighbours idle.
    parts = [readings[i].power_w for i, _g in mig.values()] + [readings[rest_i].power_w]
    assert sum(parts) == pytest.approx(520.0)
    assert readings[mig["1"][0]].power_w == pytest.approx(520 * (0.2 * 3 / 7 + 0.8))
    assert readings[mig["13"][0]].power_w == pytest.approx(520 * 0.2 / 7)
    assert readings[rest_i].power_w == pytest.approx(520 * 0.2 / 7)
    # The GPU's energy counter cannot be split: a slice's energy is its power over time.
    assert all(np.isnan(readings[i].energy_mj) for i in [*(i for i, _g in mig.values()), rest_i])
    # Utilization: the instance's own engine (GPU_UTIL reads nothing in MIG mode), not NaN.
    assert readings[mig["1"][0]].util_pct == pytest.approx(96.2)
    assert readings[mig["5"][0]].util_pct == 0.0 and readings[rest_i].util_pct == 0.0
    assert readings[whole_i].util_pct == 97.0 and readings[whole_i].power_w == 612.5
    # The pods hold the instances, not the GPU.
    pods = src.pods()
    assert pods[mig["1"][0]].pod == "llama-ft-worker-0" and pods[mig["5"][0]].namespace == "nlp"
    assert mig["13"][0] not in pods and rest_i not in pods
    assert {gpus[i].uuid for i in (mig["1"][0], mig["5"][0])} == {f"MIG-{PARENT}/1", f"MIG-{PARENT}/5"}
    # A second scrape keeps the devices and their lanes.
    src.read()
    assert [g.lanes for g in src.gpus()] == [g.lanes for g in gpus]


@pytest.mark.parametrize(
    ("profile", "slices"),
    [("1g.10gb", 1), ("3g.40gb", 3), ("7g.80gb", 7), ("1c.3g.40gb", 3), ("1g.10gb+me", 1), ("2g.24gb", 2)],
)
def test_profile_slices(profile, slices):
    assert shares.profile_slices(profile) == slices


def test_a30_has_four_slices_and_a_bad_profile_is_a_clear_error():
    assert shares.mig_slices("NVIDIA A30") == 4 and shares.mig_slices("NVIDIA H100 80GB HBM3") == 7
    with pytest.raises(ValueError, match="names no compute slices"):
        shares.profile_slices("gpu")


# ---- end to end: a real agent books MIG pods into the ledger, each by its share ----------------


def assert_booked_by_lanes(shared, prefix: str, host: str, jobs: dict) -> None:
    """Each job's ledger holds, to the millisecond, its one GPU slice's lanes of the time from
    its registration to its watermark on `host`."""
    for job, lanes in jobs.items():
        (raw,) = shared.hvals(keys.ranks_key(prefix, job))
        reg = protocol.parse_registration("0", raw)
        wm = ledger.load_watermark(shared, prefix, job, host)["booked_until"]
        start = np.asarray([reg.ts_ms], np.int64)
        want = int(shares.gpu_ms(start, np.asarray([wm], np.int64), np.asarray([lanes], np.int64))[0])
        got = sum(ledger.net_ms(ledger.read_amounts(shared, prefix, job)).values())
        assert got == want > 0, (job, got, want)


def wait_booked(shared, prefix: str, jobs: dict, agent) -> None:
    """Until each job holds 3 s of its slice (or 60 s pass, or the agent exits)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        booked = {j: sum(ledger.net_ms(ledger.read_amounts(shared, prefix, j)).values()) for j in jobs}
        if all(v >= 3000 * shares.fraction(jobs[j]) for j, v in booked.items()):
            return
        assert agent.poll() is None, agent.communicate()[1][-3000:]
        time.sleep(0.3)


def _agent_books_by_lanes(shared, prefix, url, host, jobs, *extra) -> None:
    """A real agent on `url`: each job's ledger holds, to the millisecond, its slice's lanes of
    the time from its registration to its watermark."""
    port = free_port()
    args = ["serve", "--source", "dcgm", "--dcgm-url", url, "--host", host, "--agent-id", host]
    args += ["--k8s-api", "off", "--redis-url", SHARED_URL, "--prefix", prefix, *extra]
    args += [
        "--port",
        str(port),
        "--listen",
        "127.0.0.1",
        "--book-interval",
        "0.3",
        "--sample-interval",
        "0.2",
    ]
    agent = spawn_cli(*args, stderr=subprocess.PIPE)
    try:
        wait_booked(shared, prefix, jobs, agent)
        agent.terminate()
        _out, err = agent.communicate(timeout=30)
        assert "Traceback" not in err, err
        assert_booked_by_lanes(shared, prefix, host, jobs)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.communicate(timeout=30)


def test_a_real_agent_books_each_mig_instance_by_its_share(prefix, shared, mig_exporter):
    jobs = {"ml:llama-ft": (0, 3, 7), "nlp:bert-eval": (3, 5, 7), "ml:sft": shares.WHOLE}
    _agent_books_by_lanes(shared, prefix, mig_exporter, "gpu-node-m", jobs)
    busy = ledger.net_ms(ledger.read_amounts(shared, prefix, "ml:llama-ft"))
    idle = ledger.net_ms(ledger.read_amounts(shared, prefix, "nlp:bert-eval"))
    # The busy 3g instance is compute, not idle; the idle 2g beside it is idle.
    assert busy["productive"] > 0 and busy["idle"] == 0
    assert idle["idle"] > 0 and idle["productive"] == 0


TS_LAB = 'gpu="0",UUID="GPU-1",modelName="NVIDIA H100 80GB HBM3",hostname="n1",container="c"'
# dcgm-exporter --kubernetes-virtual-gpus on a GPU the device plugin time-slices into 4 replicas,
# two of them held: the device's series fanned out per pod, GPU_UTIL per pod (4.6+).
TIME_SLICED = "\n".join(
    [
        "# TYPE DCGM_FI_DEV_POWER_USAGE gauge",
        f'DCGM_FI_DEV_POWER_USAGE{{{TS_LAB},namespace="a",pod="infer-a-0",vgpu="0"}} 300',
        f'DCGM_FI_DEV_POWER_USAGE{{{TS_LAB},namespace="b",pod="infer-b-0",vgpu="2"}} 300',
        "# TYPE DCGM_FI_DEV_GPU_UTIL gauge",
        f'DCGM_FI_DEV_GPU_UTIL{{{TS_LAB},namespace="a",pod="infer-a-0",vgpu="0"}} 40',
        f'DCGM_FI_DEV_GPU_UTIL{{{TS_LAB},namespace="b",pod="infer-b-0",vgpu="2"}} 35',
    ]
)


@pytest.fixture
def time_sliced(tmp_path):
    (tmp_path / "ts.prom").write_text(TIME_SLICED + "\n")
    files = StaticFiles({"ts.prom": tmp_path / "ts.prom"})
    yield f"http://{files.addr}/ts.prom"
    files.close()


def test_a_time_sliced_gpu_without_replicas_is_said_and_counted_not_booked_twice(time_sliced, caplog):
    """No replica count given: the GPU stays one device, booked to one job, and the sharing is
    counted and said once."""
    src = DcgmSource([time_sliced], host="n1")
    with caplog.at_level("WARNING", logger="costexporter.sources.dcgm"):
        (r,) = src.read()
        src.read()
    assert len(src.gpus()) == 1 and r.power_w == 300.0
    assert src.pods()[0].pod == "infer-a-0"
    said = [m for m in caplog.messages if "shared by 2 pods" in m]
    assert len(said) == 1 and "a/infer-a-0" in said[0]
    assert src.errors[(0, "time_sliced")] == 1


def test_time_sliced_replicas_are_devices_sharing_the_gpu(time_sliced):
    """With the device plugin's replica count: each replica is a device of 1/4 of the GPU's time,
    held by its pod; the replicas no pod holds are devices too (nobody's); power adds up to the
    GPU's, shared by the pods' own utilization."""
    src = DcgmSource([time_sliced], host="n1", replicas=4)
    readings = {r.gpu: r for r in src.read()}
    gpus = src.gpus()
    reps = {g.uuid: i for i, g in enumerate(gpus) if g.parent_uuid == "GPU-1"}
    assert set(reps) == {f"GPU-1::{k}" for k in range(4)}
    assert [gpus[reps[f"GPU-1::{k}"]].lanes for k in range(4)] == [(k, k + 1, 4) for k in range(4)]
    (whole,) = [g for g in gpus if g.uuid == "GPU-1"]
    assert whole.lanes[0] == whole.lanes[1]  # no time of its own
    assert set(readings) == set(reps.values())
    assert sum(r.power_w for r in readings.values()) == pytest.approx(300.0)
    busy = 0.25 * 0.40 + 0.25 * 0.35
    p0 = readings[reps["GPU-1::0"]].power_w
    assert p0 == pytest.approx(300 * (0.2 * 0.25 + 0.8 * 0.25 * 0.40 / busy))
    assert readings[reps["GPU-1::1"]].power_w == pytest.approx(300 * 0.2 * 0.25)
    assert readings[reps["GPU-1::1"]].util_pct == 0.0 and readings[reps["GPU-1::2"]].util_pct == 35.0
    pods = src.pods()
    assert pods[reps["GPU-1::0"]].pod == "infer-a-0" and pods[reps["GPU-1::2"]].pod == "infer-b-0"
    assert reps["GPU-1::1"] not in pods and not any(k[1] == "time_sliced" for k in src.errors)


def test_a_replica_past_the_configured_count_is_said(time_sliced, caplog):
    src = DcgmSource([time_sliced], host="n1", replicas=2)  # the exposition names replica 2
    with caplog.at_level("WARNING", logger="costexporter.sources.dcgm"):
        src.read()
        src.read()
    assert len([m for m in caplog.messages if "names replica 2" in m]) == 1
    # Counted per series read (two per scrape), and the pod it was given to is said shared too.
    assert sum(n for (_g, kind), n in src.errors.items() if kind == "replica_out_of_range") == 4
    assert len([m for m in caplog.messages if "shared by 2 pods" in m]) == 1


def test_a_real_agent_books_each_time_sliced_replica_by_its_share(prefix, shared, time_sliced):
    jobs = {"a:infer-a": (0, 1, 4), "b:infer-b": (2, 3, 4)}
    _agent_books_by_lanes(shared, prefix, time_sliced, "n1", jobs, "--time-slicing-replicas", "4")


def test_slices_carry_dcgm_exporters_labels_on_metrics(shared, prefix, mig_exporter, time_sliced):
    """/metrics names each slice as dcgm-exporter does: a MIG instance by its parent's UUID and
    GPU_I_ID, a replica by the UUID and vgpu; `promtool check metrics` stays clean (skipped, after
    the other checks, without promtool)."""
    from .test_agent import scrape

    port = free_port()
    args = ["serve", "--source", "dcgm", "--dcgm-url", mig_exporter, "--dcgm-url", time_sliced]
    args += ["--time-slicing-replicas", "4", "--agent-id", "m", "--k8s-api", "off", "--redis-url", SHARED_URL]
    args += ["--prefix", prefix, "--port", str(port), "--listen", "127.0.0.1", "--book-interval", "0.3"]
    agent = spawn_cli(*args, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        power: list = []
        while time.monotonic() < deadline and len(power) < 9:
            try:
                m, text = scrape(port)
                power = m.get("costexporter_gpu_power_watts", [])
            except OSError:
                pass
            time.sleep(0.3)
        keys = {(lab["UUID"], lab["GPU_I_ID"], lab["vgpu"]) for lab, _v in power}
        assert keys == {
            (PARENT, "1", ""),
            (PARENT, "5", ""),
            (PARENT, "13", ""),
            (PARENT, "", ""),  # the MIG GPU's rest
            (WHOLE_GPU, "", ""),
            *{("GPU-1", "", str(k)) for k in range(4)},
        }
        exposition_checked = promtool_check_metrics(text)
    finally:
        agent.terminate()
        _out, err = agent.communicate(timeout=30)
    assert "Traceback" not in err, err
    if not exposition_checked:
        skip_unchecked_exposition()
