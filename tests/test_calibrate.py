"""`costexporter calibrate`: a profile fitted from a team's own baselines classifies a separate
incident of the same GPU; the B300 fit lands on R2's numbers; fitted profiles are
found by GPU model; uncalibrated ones are flagged in the replay output, the metrics and the API."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import redis
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from costexporter.core import bands, profiles
from costexporter.core.model import Band
from costexporter.sources.synth import STATES, TraceBuilder, write_nvidia_smi_csv
from costexporter.store import keys
from costexporter.tools.calibrate import fit

from .conftest import SHARED_URL
from .redis_server import free_port
from .test_agent import post_events, scrape, serve

# A 700 W GPU unlike the B300: compute well below the limit, checkpoint waiters just above idle.
H200 = {
    "compute": (430.0, 470.0, 95.0, 100.0),
    "communication": (330.0, 345.0, 100.0, 100.0),
    "starvation": (290.0, 310.0, 85.0, 100.0),
    "deadlock": (96.0, 102.0, 100.0, 100.0),
    "checkpoint": (95.0, 103.0, 100.0, 100.0),
    "idle": (70.0, 78.0, 0.0, 0.0),
    "crashloop": STATES["crashloop"],
}
TRUTH = {
    "compute": Band.COMPUTE,
    "communication": Band.COMMUNICATION,
    "starvation": Band.STARVATION,
    "checkpoint": Band.CHECKPOINT,
    "deadlock": Band.DEADLOCK,
    "idle": Band.IDLE,
}


def h200(seed: int, job: str) -> TraceBuilder:
    return TraceBuilder(
        n_gpus=8, per_host=4, job=job, seed=seed, gpu_name="NVIDIA H200", states=H200, host_prefix="h"
    )


def baselines() -> TraceBuilder:
    """A known-healthy run (compute, communication, a straggler, a checkpoint) and a known hang."""
    b = h200(1, "baseline")
    b.run("start")
    b.stretch("compute", 1800, step_s=4, tokens=1000)
    b.stretch("communication", 600, step_s=6, tokens=1000)
    b.stretch("starvation", 600, step_s=6, tokens=1000, straggler=5)
    b.phase("checkpoint", "begin")
    b.stretch("checkpoint", 300, zero_ranks=(0,))
    b.phase("checkpoint", "end", step=b.step)
    b.stretch("compute", 600, step_s=4, tokens=1000)
    b.stretch("deadlock", 900, zero_ranks=(2,))
    b.stretch("idle", 600)
    return b


def incident() -> tuple[TraceBuilder, list[tuple[float, float, str]]]:
    """Another run of the same GPU model (another seed, other ranks): every band, with the truth."""
    b = h200(7, "incident")
    spans = []

    def stretch(state: str, dur: float, **kw) -> None:
        t0 = b.t
        b.stretch(state, dur, **kw)
        spans.append((t0, b.t, state))

    b.run("start")
    stretch("compute", 900, step_s=4, tokens=1000)
    stretch("communication", 300, step_s=6)
    stretch("starvation", 300, step_s=6, straggler=3)
    b.phase("checkpoint", "begin")
    stretch("checkpoint", 200, zero_ranks=(0,))
    b.phase("checkpoint", "end", step=b.step)
    stretch("compute", 300, step_s=4)
    stretch("deadlock", 1200, zero_ranks=(6,))
    stretch("idle", 300)
    return b, spans


def right_share(prof: profiles.Profile) -> float:
    """Share of the incident's GPU-seconds the profile puts in the right band."""
    b, spans = incident()
    s = b.samples()
    truth = np.full(len(s), -1)
    for a, c, state in spans:
        truth[(s.ts_ms >= a * 1000) & (s.ts_ms < c * 1000)] = TRUTH[state]
    order = np.lexsort((s.ts_ms, s.gpu))
    res = bands.classify(
        s.gpu[order].astype(np.int64), s.ts_ms[order], s.power_w[order], s.util_pct[order], 8, prof
    )
    return float(np.mean(res.band == truth[order]))


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """The real command on baseline files: a profile YAML and its JSON report."""
    from .conftest import run_cli

    d = tmp_path_factory.mktemp("cal")
    b = baselines()
    csvs = write_nvidia_smi_csv(b.samples(), d / "baseline", name=True)
    events = b.write_events(d / "events.jsonl")
    out = d / "profiles" / "h200.yaml"
    out.parent.mkdir()
    args = ["calibrate", "--events", str(events), "--out", str(out), "--format", "json"]
    for c in csvs:
        args += ["--samples", f"{c.stem}={c}"]
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    return {"report": json.loads(r.stdout), "path": out, "dir": out.parent, "csvs": csvs, "events": events}


def test_fitted_profile_classifies_a_separate_incident_of_the_same_gpu(fitted):
    prof = profiles.load(fitted["path"])
    assert prof.calibrated and prof.gpu_model == "NVIDIA H200" and prof.power_limit_w == 700
    share = right_share(prof)
    print(
        f"\nH200-like incident: fitted profile {share:.2%} of GPU-seconds in the right band, "
        f"derived from the 700 W limit {right_share(profiles.derive(700.0, 'H200')):.2%}"
    )
    assert share >= 0.99
    # The profile derived from the power limit alone does much worse: calibration matters here.
    assert right_share(profiles.derive(700.0, "H200")) < 0.9


def test_report_has_bands_separation_warnings_and_provenance(fitted):
    rep = fitted["report"]
    assert set(rep["levels"]) == {"compute", "communication", "starvation", "low", "idle"}
    assert rep["held_out_accuracy"] >= 0.99
    conf = rep["confusion_gpu_seconds"]
    assert conf["compute"]["compute"] > 0 and conf["low"]["low"] > 0
    assert any("starvation" in w and "communication" in w and "apart" in w for w in rep["warnings"])
    saved = yaml.safe_load(fitted["path"].read_text())
    assert {"gpu_model", "power_limit_w", "centres", "provenance", "busy_util_pct", "zero_util_pct"} <= set(
        saved
    )
    assert saved["provenance"]["fitted_from"][-1] == str(fitted["events"])
    assert "fitted_at" in saved["provenance"] and saved["provenance"]["held_out_accuracy"] >= 0.99


def test_b300_fit_from_an_r1_like_trace_lands_on_r2():
    b = TraceBuilder(n_gpus=16, per_host=8, job="r1-like", seed=5)
    b.run("start")
    b.stretch("compute", 3600, step_s=5, tokens=1)
    b.stretch("communication", 900, step_s=7)
    b.stretch("starvation", 900, step_s=7, straggler=11)
    b.stretch("compute", 900, step_s=5)
    b.phase("checkpoint", "begin", rank=3, step=b.step)  # R1: never ends
    b.stretch("deadlock", 3600, zero_ranks=(3,))
    b.stretch("idle", 600)
    f = fit(b.samples(), b.events)
    # R2: compute 940-1040 W, communication ~640, starvation ~575, deadlock 190-195, idle ~135.
    r2 = {"compute": 990.0, "communication": 640.0, "starvation": 575.0, "low": 192.5, "idle": 135.0}
    for name, want in r2.items():
        assert f.levels[name].centre == pytest.approx(want, rel=0.05), name
    # The fitted edges classify R2's table like the built-in profile.
    assert f.profile.idle_max_w < 190 < f.profile.low_max_w < 575 and 640 < f.profile.compute_min_w < 940


def test_a_level_above_the_power_limit_is_said():
    """B300 baselines fitted as an H200 (700 W): compute at ~990 W cannot be that GPU's; the
    fit says so instead of writing a profile with a centre above the limit in silence."""
    b = TraceBuilder(n_gpus=4, per_host=4, job="b300", seed=6)
    b.run("start")
    b.stretch("compute", 1200, step_s=5, tokens=1)
    b.stretch("idle", 600)
    right = fit(b.samples(), b.events)
    assert not [w for w in right.warnings if "above the" in w]
    wrong = fit(b.samples(), b.events, gpu_model="NVIDIA H200")
    said = [w for w in wrong.warnings if "above the 700 W power limit" in w]
    assert len(said) == 1 and said[0].startswith("compute sits at ~9") and "--gpu-model" in said[0]


def test_labels_alone_are_enough_and_bad_labels_are_clear(cli, tmp_path):
    b = h200(3, "labelled")
    t0 = b.t
    b.stretch("compute", 1200)
    t1 = b.t
    b.stretch("deadlock", 600, zero_ranks=(1,))
    t2 = b.t
    b.stretch("idle", 300)
    csvs = write_nvidia_smi_csv(b.samples(), tmp_path / "t", name=True)
    out = tmp_path / "p.yaml"
    args = ["calibrate", "--out", str(out), "--format", "json", "--gpu-model", "NVIDIA H200"]
    for c in csvs:
        args += ["--samples", f"{c.stem}={c}"]
    r = cli(*args, "--label", f"{t0}..{t1}=compute", "--label", f"{t1}..{t2}=deadlock")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["levels"]["compute"]["centre"] == pytest.approx(450, rel=0.05)
    assert rep["levels"]["low"]["centre"] == pytest.approx(99, rel=0.05)
    r = cli(*args, "--label", f"{t0}..{t1}=fast")
    assert r.returncode == 2 and "BAND one of" in r.stderr and "Traceback" not in r.stderr
    r = cli(*args)
    assert r.returncode == 2 and "nothing says what is healthy" in r.stderr


def test_replay_finds_the_profile_by_gpu_model_and_flags_uncalibrated(cli, fitted, tmp_path):
    b, _ = incident()
    csvs = write_nvidia_smi_csv(b.samples(), tmp_path / "inc", name=True)
    events = b.write_events(tmp_path / "inc.jsonl")
    args = ["replay", "--events", str(events), "--format", "json"]
    for c in csvs:
        args += ["--samples", f"{c.stem}={c}"]
    derived = json.loads(cli(*args).stdout)["jobs"]["incident"]
    assert derived["profile"]["name"] == "H200" and derived["profile"]["calibrated"] is False
    assert derived["profile"].get("derived_from", derived["profile"]["source"]) == "derived_from_model"
    r = cli(*args, "--profile", str(fitted["dir"]))
    found = json.loads(r.stdout)["jobs"]["incident"]
    assert found["profile"]["name"] == "NVIDIA H200" and found["profile"]["calibrated"] is True
    assert found["profile"]["source"] == "calibrated"
    table = cli(*[a for a in args if a not in ("--format", "json")]).stdout
    assert "profile H200 (uncalibrated)" in table


def test_agent_metrics_and_api_flag_an_uncalibrated_profile(fitted, prefix, tmp_path):
    r = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    b = h200(11, "h200-live")
    b.run("start")
    b.stretch("compute", 240, step_s=4, tokens=1000)
    b.run("end")
    post_events(r, prefix, b)
    csvs = write_nvidia_smi_csv(b.samples(), tmp_path / "live", name=True)
    seen = {}
    for label, extra in (("derived", []), ("fitted", ["--profile", str(fitted["dir"])])):
        p = f"{prefix}-{label}"
        post_events(r, p, b)
        port, api_port = free_port(), free_port()
        more = [x for c in csvs[1:] for x in ("--samples", f"{c.stem}={c}")]
        proc = serve(
            csvs[0], "h0", SHARED_URL, p, port, *more, "--api-port", str(api_port), *extra, speed=200
        )
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                fig = r.hgetall(keys.figures_key(p, "h200-live"))
                if fig.get("profile"):
                    break
                time.sleep(0.2)
            metrics, _ = scrape(port)
            api = httpx.get(f"http://127.0.0.1:{api_port}/api/v1/jobs/h200-live", timeout=10).json()
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=30)
            for k in r.scan_iter(f"{p}:*"):
                r.delete(k)
        info = [lab for lab, _ in metrics["costexporter_job_profile_info"]]
        seen[label] = (info, api["profile"])
    assert seen["derived"][0] == [{"training_job": "h200-live", "profile": "H200", "calibrated": "false"}]
    assert seen["derived"][1] == {"name": "H200", "calibrated": False}
    assert seen["fitted"][0][0]["calibrated"] == "true" and seen["fitted"][1]["calibrated"] is True


def test_bad_profile_directory_is_a_clear_error(cli, tmp_path):
    (tmp_path / "broken.yaml").write_text("gpu_model: [unclosed")
    b = h200(2, "x")
    b.stretch("compute", 60)
    csvs = write_nvidia_smi_csv(b.samples(), tmp_path / "t", name=True)
    r = cli("replay", "--samples", f"{csvs[0].stem}={csvs[0]}", "--profile", str(tmp_path))
    assert r.returncode == 2 and "not a valid profile file" in r.stderr


def test_find_matches_by_model_key(tmp_path):
    prof = profiles.Profile("mine", True, 80, 200, 400, gpu_model="NVIDIA H200 141GB HBM3e")
    profiles.save(prof, tmp_path / "a.yaml")
    assert profiles.find("NVIDIA H200", tmp_path).name == "mine"
    assert profiles.find("NVIDIA H100 80GB HBM3", tmp_path) is None
    assert Path(tmp_path / "a.yaml").read_text().startswith("name: mine")


def test_one_rule_picks_a_jobs_profile(tmp_path):
    """profiles.choose, the rule replay, the agent and the watcher share: the configured profile
    wins; the model comes from the flag, the GPUs' own name, then the job's meta (a trainer's
    meta never gives a GPU another model's profile); a fitted profile of the directory beats a
    derived one; the directory is only the one given (no environment)."""
    from costexporter.core.model import GpuId

    mine = profiles.Profile("mine", True, 80, 200, 400, gpu_model="NVIDIA H200 141GB HBM3e")
    profiles.save(mine, tmp_path / "a.yaml")
    h100 = GpuId("n", 0, "GPU-1", "NVIDIA H100 80GB HBM3", 700.0)
    assert profiles.choose(profiles.B300, "NVIDIA H200", gpus=[h100], directory=tmp_path) is profiles.B300
    assert profiles.choose(None, gpus=[h100]).name == "H100"
    assert profiles.choose(None, meta={"gpu_model": "NVIDIA B300"}, gpus=[h100]).name == "H100"
    nameless = GpuId("n", 0, "GPU-1", None, None)
    assert profiles.choose(None, meta={"gpu_model": "NVIDIA H200"}, gpus=[nameless]).name == "H200"
    assert profiles.choose(None, "NVIDIA H200", meta={"gpu_model": "NVIDIA H100"}).name == "H200"
    fitted = profiles.choose(None, meta={"gpu_model": "NVIDIA H200"}, directory=tmp_path)
    assert fitted.name == "mine" and fitted.calibrated
    assert profiles.choose(None, gpus=[h100], directory=tmp_path).name == "H100"  # no fitted H100
    odd = GpuId("n", 0, "GPU-2", "Some Future GPU", 900.0)
    assert profiles.choose(None, gpus=[odd]).power_limit_w == 900.0  # derived from the GPU's limit


def test_the_watcher_judges_with_the_fitted_profile_of_its_directory(tmp_path):
    """`watch --profile DIR`: the job's meta names its GPU model, the directory's fitted profile
    for it is the one the live signature is judged with; a model it lacks is derived."""
    from costexporter.services.watcher import JobView, WatchConfig, _profile

    profiles.save(profiles.Profile("mine", True, 80, 200, 400, gpu_model="NVIDIA H200"), tmp_path / "a.yaml")
    cfg = WatchConfig(profile_dir=tmp_path)
    assert _profile(JobView("j", meta={"gpu_model": "NVIDIA H200"}), cfg).name == "mine"
    assert _profile(JobView("j", meta={"gpu_model": "NVIDIA H100 80GB HBM3"}), cfg).name == "H100"
    assert _profile(JobView("j", meta={"gpu_model": "NVIDIA H200"}), WatchConfig()).name == "H200"


def test_the_profile_directory_of_the_environment_is_read_at_the_command(tmp_path):
    """$COSTEXPORTER_PROFILE_DIR: a fitted profile there is the replay's; a directory that does
    not exist stops the command with one line (exit 2), before any booking."""
    import os
    import subprocess
    import sys

    from .conftest import ROOT

    mine = profiles.Profile("mine", True, 80, 200, 400, gpu_model="NVIDIA H200")
    (tmp_path / "profiles").mkdir()
    profiles.save(mine, tmp_path / "profiles" / "h200.yaml")
    b = h200(2, "x")
    b.stretch("compute", 60)
    csv = write_nvidia_smi_csv(b.samples(), tmp_path / "t", name=True)[0]

    def replay(profile_dir: Path) -> subprocess.CompletedProcess:
        env = {**os.environ, "COSTEXPORTER_PROFILE_DIR": str(profile_dir)}
        args = ["replay", "--samples", f"{csv.stem}={csv}", "--format", "json"]
        return subprocess.run(
            [sys.executable, "-m", "costexporter.cli", *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=env,
            timeout=120,
        )

    ok = replay(tmp_path / "profiles")
    assert ok.returncode == 0, ok.stderr
    assert {j["profile"]["name"] for j in json.loads(ok.stdout)["jobs"].values()} == {"mine"}
    missing = replay(tmp_path / "nowhere")
    assert missing.returncode == 2 and "COSTEXPORTER_PROFILE_DIR" in missing.stderr
    assert "Traceback" not in missing.stderr


# calibrate on real-like noisy baselines (tests/realtrace.py: ramps, skewed stamps, gaps; two GPU models).


def _truth_centres(tr) -> dict[str, float]:
    names = {"checkpoint": "low"}
    return {
        names.get(k, k): float(np.median(tr.truth_power[tr.labels == k])) for k in set(tr.labels.tolist())
    }


@pytest.mark.parametrize("model", ["h100", "b300"])
def test_real_like_baselines_recover_every_band_centre_within_3_percent(model):
    from tests.realtrace import Scenario, agreement

    make = getattr(Scenario, model)
    base = make(seed=10, compute_s=120.0, checkpoints=4).build()
    f = fit(base.samples, base.events)
    truth = _truth_centres(base)
    assert set(f.levels) == set(truth)
    for name, want in truth.items():
        assert f.levels[name].centre == pytest.approx(want, rel=0.03), name
    assert f.accuracy >= 0.99
    # The profile fitted from one run classifies another run of the same GPU.
    other = make(seed=11).build()
    from costexporter.core.replay import ReplayConfig, book_trace

    [job], _ = book_trace(other.samples, other.events, ReplayConfig(profile=f.profile))
    assert agreement(job.band_result.band, other) >= 0.995


_BASE = None


def _base():
    global _BASE
    if _BASE is None:
        from tests.realtrace import Scenario

        _BASE = Scenario.h100(seed=12, compute_s=40.0, checkpoints=2, idle_s=20.0).build()
    return _BASE


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(
            st.floats(0, 1),
            st.floats(0.005, 0.4),
            st.sampled_from(["compute", "idle", "deadlock", "communication"]),
        ),
        max_size=3,
    ),
    st.booleans(),
)
def test_calibrate_never_returns_an_inverted_profile(windows, with_events):
    """Whatever the labels say, the fit refuses (one line) or its bands are in physical order."""
    from costexporter.tools.calibrate import ORDER, CalibrationError

    tr = _base()
    t0, t1 = int(tr.samples.ts_ms.min()), int(tr.samples.ts_ms.max())
    labels = [(t0 + int(a * (t1 - t0)), t0 + int(min(a + w, 1) * (t1 - t0)) + 1, lv) for a, w, lv in windows]
    labels = [(a, b, "low" if lv == "deadlock" else lv) for a, b, lv in labels if b > a]
    try:
        f = fit(tr.samples, tr.events if with_events else [], labels)
    except CalibrationError as e:
        assert "\n" not in str(e)
        return
    centres = [f.levels[k].centre for k in ORDER if k in f.levels and k != "starvation"]
    assert centres == sorted(centres)
    p = f.profile
    assert p.idle_max_w <= p.low_max_w <= p.compute_min_w
    if "compute" in f.levels and "low" in f.levels:
        assert f.levels["low"].centre < p.low_max_w <= p.compute_min_w <= f.levels["compute"].centre


def test_a_compute_label_on_an_idle_stretch_is_refused_and_nothing_is_written(cli, tmp_path):
    from tests.realtrace import write_csv

    tr = _base()
    csv_path = write_csv(tr, tmp_path / "node0.csv")
    idle = tr.samples.ts_ms[(tr.labels == "idle") & (tr.samples.gpu == 1)]
    compute = tr.samples.ts_ms[(tr.labels == "compute") & (tr.samples.gpu == 1)]
    out = tmp_path / "p.yaml"
    args = ["calibrate", "--samples", str(csv_path), "--out", str(out), "--gpu-model", "NVIDIA H100"]
    r = cli(*args, "--label", f"{idle[0] / 1000}..{idle[100] / 1000}=compute")
    assert r.returncode == 2, r.stdout
    assert len(r.stderr.strip().splitlines()) == 1 and "impossible profile" in r.stderr
    assert not out.exists()
    # The same trace with a right label fits.
    r = cli(*args, "--label", f"{compute[0] / 1000}..{compute[200] / 1000}=compute")
    assert r.returncode == 0, r.stderr
    assert profiles.load(out).compute_min_w > 300


def test_a_label_window_that_matches_no_samples_names_the_trace_range_and_the_tz(cli, tmp_path):
    from tests.realtrace import write_csv

    tr = _base()
    csv_path = write_csv(tr, tmp_path / "node0.csv")
    out = tmp_path / "p.yaml"
    # The file's wall clock reads 00:47 and is taken as Shanghai time; a label written as if the
    # file were UTC (08:47 in Shanghai) misses it by 8 h.
    r = cli(
        "calibrate",
        "--samples",
        str(csv_path),
        "--out",
        str(out),
        "--tz",
        "Asia/Shanghai",
        "--gpu-model",
        "NVIDIA H100",
        "--label",
        "2025-07-27T08:47:30..2025-07-27T08:48:00=compute",
    )
    assert r.returncode == 2 and not out.exists()
    [line] = r.stderr.strip().splitlines()
    assert "matches no samples" in line and "--tz Asia/Shanghai" in line
    assert "the trace runs 2025-07-27T00:47:10..2025-07-27T00:" in line  # read as Shanghai time
