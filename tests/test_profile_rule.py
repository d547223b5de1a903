"""One profile rule (`profiles.resolve`) for serve, watch, replay and calibrate: an unknown or
missing GPU model never becomes another GPU's profile in silence. The live agent runs on the
fake NVML (pynvml's own functions replaced) and real Redis; the commands run as processes."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from costexporter.core import profiles
from costexporter.core.model import Event, GpuId
from costexporter.core.profiles import ProfileError
from costexporter.core.timeutil import to_ms
from costexporter.services.watcher import JobView, WatchConfig, Watcher, _live_bands, _profile, decide

from .conftest import SHARED_URL
from .fake_nvml import FakeGpu, FakeNvml

UNKNOWN = "NVIDIA RTX PRO 6000 Blackwell"  # a real board the table does not know


# ---- the rule ------------------------------------------------------------------------------
def test_an_operators_unknown_model_is_refused_whatever_limit_the_gpu_reports():
    gpu = GpuId("n", 0, "GPU-1", "NVIDIA H100 80GB HBM3", 700.0)
    with pytest.raises(ProfileError, match=r"unknown GPU model 'BOGUS'.*--power-limit.*--profile") as e:
        profiles.resolve(None, "BOGUS", gpus=[gpu])
    assert "known models: GB300" in str(e.value) and "\n" not in str(e.value)
    # Given with a limit, it is the operator's own: derived from that limit, under its name.
    prof, source = profiles.resolve(None, "BOGUS", 300.0, gpus=[gpu])
    assert (prof.name, prof.power_limit_w, source) == ("BOGUS", 300.0, "derived_from_limit")


def test_a_gpus_own_unknown_name_is_derived_from_its_own_limit():
    gpu = GpuId("n", 0, "GPU-1", UNKNOWN, 600.0)
    prof, source = profiles.resolve(None, gpus=[gpu])
    assert (prof.name, prof.power_limit_w, prof.calibrated, source) == (
        UNKNOWN,
        600.0,
        False,
        "derived_from_limit",
    )
    # No limit either: refused, never the B300 table.
    with pytest.raises(ProfileError, match="--gpu-model or --power-limit"):
        profiles.resolve(None, gpus=[GpuId("n", 0, "GPU-1", UNKNOWN, None)])


def test_a_trainers_meta_never_gives_a_gpu_another_models_profile():
    h100 = GpuId("n", 0, "GPU-1", "NVIDIA H100 80GB HBM3", 700.0)
    prof, source = profiles.resolve(None, meta={"gpu_model": "NVIDIA B300"}, gpus=[h100])
    assert prof.name == "H100" and prof is not profiles.B300 and source == "derived_from_limit"


def test_learned_idle_is_a_source_and_keeps_what_it_was_derived_from():
    prof, source = profiles.resolve(None, "NVIDIA H200")
    moved, src = profiles.learned(prof, source, 123.7)
    assert src == "learned_idle" and moved.provenance["derived_from"] == "derived_from_model"
    assert moved.idle_max_w == pytest.approx(142.3)
    # A calibrated or built-in profile is used as it is, its source unchanged.
    assert profiles.learned(profiles.B300, "builtin", 135.0) == (profiles.B300, "builtin")
    assert profiles.learned(prof, source, None) == (prof, source)


names = st.one_of(
    st.none(),
    st.sampled_from([key for key, _, _ in profiles.MODEL_VARIANTS]),
    st.sampled_from(["NVIDIA B300 SXM6 AC", "NVIDIA H100 80GB HBM3", UNKNOWN, "BOGUS", ""]),
)
limits = st.one_of(st.none(), st.floats(50, 2000))


@settings(max_examples=300, deadline=None)
@given(flag=names, flag_limit=limits, gpu_name=names, gpu_limit=limits, meta_name=names)
def test_never_another_gpus_profile(flag, flag_limit, gpu_name, gpu_limit, meta_name):
    """Whatever the flags, the GPU and the meta say: the profile is the B300 table only for a
    B300, a derived profile's limit is one somebody gave (flag, GPU) or the named model's, and
    an operator's unknown model without a limit is refused."""
    gpus = [GpuId("n", 0, "GPU-1", gpu_name or None, gpu_limit)]
    meta = {"gpu_model": meta_name} if meta_name else {}
    model = flag or gpu_name or meta_name or None
    key = profiles.model_key(model) if model else None
    try:
        prof, source = profiles.resolve(None, flag or None, flag_limit, meta=meta, gpus=gpus)
    except ProfileError as e:
        if flag and profiles.model_key(flag) is None and not flag_limit:
            assert str(e).startswith(f"unknown GPU model {flag!r}")
        else:
            assert key is None and not (flag_limit or gpu_limit)
        return
    assert not (flag and profiles.model_key(flag) is None and not flag_limit)
    if prof is profiles.B300:
        assert key == "B300" and source == "builtin"
        return
    assert source in ("derived_from_limit", "derived_from_model") and not prof.calibrated
    given_limits = {x for x in (flag_limit, gpu_limit) if x}
    if source == "derived_from_limit":
        assert prof.power_limit_w == (flag_limit or gpu_limit)
    else:
        assert not given_limits and prof.power_limit_w == profiles.KNOWN_POWER_LIMITS_W[key]


# ---- the commands: an unknown --gpu-model is the same exit 2 in serve, watch and replay ------
def test_serve_watch_and_replay_refuse_an_unknown_gpu_model_alike(cli, prefix, tmp_path):
    csv = tmp_path / "t.csv"
    csv.write_text("timestamp, index, power.draw [W], utilization.gpu [%]\n2025-01-01 00:00:00, 0, 100, 0\n")
    runs = {
        "serve": cli(
            "serve",
            "--source",
            "sim",
            "--prefix",
            prefix,
            "--port",
            "0",
            "--api-port",
            "0",
            "--gpu-model",
            "BOGUS",
        ),
        "watch": cli("watch", "--prefix", prefix, "--once", "--port", "0", "--gpu-model", "BOGUS"),
        "replay": cli("replay", "--samples", f"n={csv}", "--gpu-model", "BOGUS"),
    }
    lines = set()
    for what, r in runs.items():
        assert r.returncode == 2, (what, r.stderr)
        err = [x for x in r.stderr.splitlines() if x.strip()]
        assert len(err) == 1 and "Traceback" not in r.stderr, (what, r.stderr)
        assert "unknown GPU model 'BOGUS'" in err[0] and "--power-limit" in err[0] and "H100" in err[0]
        lines.add(err[0])
    assert len(lines) == 1  # the same line from each command
    # With its limit the model is usable: watch runs.
    r = cli(
        "watch", "--prefix", prefix, "--once", "--port", "0", "--gpu-model", "BOGUS", "--power-limit", "300"
    )
    assert r.returncode == 0, r.stderr


# ---- the live agent: fake NVML, real Redis ---------------------------------------------------
def _scrape(agent) -> dict[str, dict[str, str]]:
    from costexporter.services.exporter import registry_for

    out = {}
    for fam in registry_for(agent).collect():
        if fam.name == "costexporter_gpu_profile_info":
            for s in fam.samples:
                assert s.value == 1
                out[s.labels["gpu"]] = s.labels
    return out


def test_the_agent_exports_each_gpus_profile_and_says_a_derived_one_once(shared, prefix, monkeypatch, caplog):
    from costexporter.services.agent import Agent, AgentConfig
    from costexporter.sources.nvml import NvmlSource

    gpus = [
        FakeGpu("GPU-0000aaaa-0000-0000-0000-000000000000"),  # a B300
        FakeGpu(
            "GPU-0000aaaa-0000-0000-0000-000000000001",
            name=UNKNOWN,
            power_mw=95_000,
            util=0,
            limit_mw=600_000,
        ),
        FakeGpu("GPU-0000aaaa-0000-0000-0000-000000000002", name=UNKNOWN, limit_mw=0),  # no limit read
    ]
    FakeNvml(gpus).install(monkeypatch)
    agent = Agent(NvmlSource(host="n"), AgentConfig(redis_url=SHARED_URL, prefix=prefix, agent_id="n"))
    try:
        with caplog.at_level(logging.INFO, logger="costexporter.agent"):
            for _ in range(4):
                agent.tick()
    finally:
        agent.shutdown()
    seen = _scrape(agent)
    assert seen["0"]["profile"] == "B300" and seen["0"]["source"] == "builtin"
    assert seen["0"]["uuid"] == gpus[0].uuid and seen["0"]["host"] == "n"
    assert seen["1"]["profile"] == UNKNOWN and seen["1"]["source"] in ("derived_from_limit", "learned_idle")
    assert "2" not in seen  # no model known, no limit: no profile, never the B300's
    lines = [
        r for r in caplog.records if "band profile" in r.getMessage() or "no power limit" in r.getMessage()
    ]
    by_gpu = {g.uuid: [r for r in lines if g.uuid in r.getMessage()] for g in gpus}
    assert all(len(v) == 1 for v in by_gpu.values()), [r.getMessage() for r in lines]
    [derived] = by_gpu[gpus[1].uuid]
    assert (
        derived.levelno == logging.WARNING and "derived from the power limit (600 W)" in derived.getMessage()
    )
    [missing] = by_gpu[gpus[2].uuid]
    assert missing.levelno == logging.ERROR and "--gpu-model or --power-limit" in missing.getMessage()


def test_the_agent_with_a_profile_file_says_file(shared, prefix, monkeypatch):
    from costexporter.services.agent import Agent, AgentConfig
    from costexporter.sources.nvml import NvmlSource

    FakeNvml([FakeGpu("GPU-0000bbbb-0000-0000-0000-000000000000", name=UNKNOWN)]).install(monkeypatch)
    mine = profiles.Profile("lab", True, 80, 200, 400)
    agent = Agent(
        NvmlSource(host="n"), AgentConfig(redis_url=SHARED_URL, prefix=prefix, agent_id="n", profile=mine)
    )
    try:
        agent.tick()
    finally:
        agent.shutdown()
    assert {k: v["source"] for k, v in _scrape(agent).items()} == {"0": "file"}
    assert _scrape(agent)["0"]["profile"] == "lab"


# ---- the watcher: never the B300 table in silence --------------------------------------------
T0 = 1_760_000_000.0


def _view(meta: dict) -> JobView:
    evs = [
        Event("register", "j", to_ms(T0), r, f"s{r}", 0, {"host": "h", "gpu": r, "world_size": 4})
        for r in range(4)
    ]
    evs += [Event("run", "j", to_ms(T0), 0, "s0", 1, {"state": "start"})]
    evs += [
        Event("step", "j", to_ms(T0 + s), r, f"s{r}", s + 1, {"step": s})
        for s in range(1, 111)
        for r in range(4)
    ]
    evs += [
        Event("heartbeat", "j", to_ms(T0 + t), r, f"s{r}", 100 + t, {})
        for t in range(0, 200, 10)
        for r in range(4)
    ]
    v = JobView("j", meta=meta)
    v.fold(sorted(evs, key=lambda e: e.ts_ms))
    # An H100 job computing at ~600 W, one rank at 58%: under the B300 table (compute >= 850 W)
    # that is starvation with a straggler; an H100 computes there.
    for t in (100, 105, 110):
        v.live.append([(r, int((T0 + t) * 1000), 600.0, 58.0 if r == 2 else 97.0) for r in range(4)])
    return v


def test_the_watcher_without_a_model_judges_no_power_band_and_says_so(prefix, caplog, tmp_path):
    cfg = WatchConfig(redis_url=SHARED_URL, prefix=prefix)
    v = _view({})
    assert _profile(v, cfg) is None and _live_bands(v, cfg) is None
    assert decide(v, T0 + 111, cfg).state == "running"
    # The same job named an H100 by its meta: judged with the H100's profile, no straggler.
    h100 = _view({"gpu_model": "NVIDIA H100 80GB HBM3"})
    assert _profile(h100, cfg).name == "H100" and decide(h100, T0 + 111, cfg).state == "running"
    # The B300 table would have called it starving: what the old fallback did.
    b300 = WatchConfig(profile=profiles.B300)
    assert decide(_view({}), T0 + 111, b300).state == "starving"
    # Said once per job, through a real poll of real Redis.
    from costexporter.trainer.reporter import StepReporter

    job = f"{prefix}-nomodel"
    rep = StepReporter(
        job, SHARED_URL, prefix=prefix, rank=0, world_size=1, host="h0", spool_dir=str(tmp_path)
    )
    rep.step(1)
    rep.close()
    w = Watcher(cfg)
    with caplog.at_level(logging.INFO, logger="costexporter.watcher"):
        w.poll()
        w.poll()
    said = [r for r in caplog.records if job in r.getMessage() and "profile" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, [r.getMessage() for r in said]
    assert "--gpu-model or --power-limit" in said[0].getMessage() and w.stats["jobs_without_profile"] == 1


def test_calibrate_names_where_its_power_limit_came_from(tmp_path):
    from costexporter.core.model import Samples
    from costexporter.tools.calibrate import _power_limit

    n = 400
    power = np.concatenate([np.full(n // 2, 90.0), np.full(n // 2, 510.0)])
    util = np.concatenate([np.zeros(n // 2), np.full(n // 2, 100.0)])
    s = Samples(
        [GpuId("h", 0, None, UNKNOWN, None)],
        np.zeros(n, np.int64),
        np.arange(n, dtype=np.int64) * 1000,
        power,
        util,
        np.full(n, np.nan),
    )
    assert _power_limit(s, UNKNOWN, None) == (pytest.approx(600.0), "derived_from_trace")
    assert _power_limit(s, UNKNOWN, 450.0) == (450.0, "derived_from_limit")
    assert _power_limit(s, "NVIDIA H100 80GB HBM3", None) == (700.0, "derived_from_model")
    idle_only = Samples(s.gpus, s.gpu, s.ts_ms, np.full(n, 90.0), np.zeros(n), s.energy_mj)
    assert _power_limit(idle_only, UNKNOWN, None) == (pytest.approx(99.0), "highest_reading")


def test_replay_report_schema_names_every_source():
    from pathlib import Path

    schema = json.loads(
        (Path(profiles.__file__).parents[1] / "schemas" / "replay-output.schema.json").read_text()
    )

    def find(d):
        if isinstance(d, dict):
            if "source" in d.get("properties", {}) and "derived_from" in d["properties"]:
                return d["properties"]
            for v in d.values():
                if (got := find(v)) is not None:
                    return got
        return None

    props = find(schema)
    assert props is not None and props["source"]["enum"] == list(profiles.SOURCES)


def test_a_played_back_trace_without_model_or_limit_says_its_profile_is_from_the_trace(
    shared, prefix, caplog
):
    """`serve --source playback` of a trace naming no model or limit: the agent bands it with the
    profile offline replay derives from the trace's own levels, and says so (never
    `derived_from_limit`: nobody gave a limit)."""
    from costexporter.core.replay import ReplayConfig, book_trace
    from costexporter.services.agent import Agent, AgentConfig
    from costexporter.sources.playback import ReplaySource

    from .realtrace import Scenario
    from .test_trace_profiles import A100_LEVELS, _nameless

    tr = _nameless(Scenario(seed=2, levels=A100_LEVELS, checkpoints=1, compute_s=30.0).build())
    [job], _ = book_trace(tr.samples, tr.events, ReplayConfig())
    src = ReplaySource(tr.samples, speed=1e6)
    agent = Agent(src, AgentConfig(redis_url=SHARED_URL, prefix=prefix, agent_id="pb", learn_idle=False))
    try:
        with caplog.at_level(logging.INFO, logger="costexporter.agent"):
            agent.tick()
            prof, source = agent.node.profile_source(0)
    finally:
        agent.shutdown()
    assert (prof.provenance or {}).get("derived_from", source) == "derived_from_trace"
    assert job.profile.provenance["derived_from"] == "derived_from_trace"
    assert prof.compute_min_w == pytest.approx(job.profile.compute_min_w)
    assert _scrape(agent)["0"]["source"] in ("derived_from_trace", "learned_idle")
    said = [r.getMessage() for r in caplog.records if "band profile" in r.getMessage()]
    assert said and all("derived from the trace's own levels" in m for m in said), said
