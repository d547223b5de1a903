"""`costexporter preflight` (R5), through the real command: each check fails where it
should, passes where it should, and the result lands in the job's events."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import redis

from costexporter.core.model import GpuId, Samples
from costexporter.services.agent import Agent, AgentConfig
from costexporter.sources.playback import ReplaySource
from costexporter.store.reader import EventReader

from .conftest import SHARED_URL

SEQ = 2048
R4_BLOCKS = [30_888] * 16
R4_BLOCKS[3] = 30_835  # R4: min 30,835, max 30,888 (53 blocks, ~7 steps)


def make_cache(d: Path, blocks: list[int], seq_len: int = SEQ, sparse: bool = True) -> str:
    """One token file per rank, R4's realistic size (~250 MB each) as sparse files: stat and the
    sampled reads see the real size, the disk holds nearly nothing."""
    d.mkdir(parents=True, exist_ok=True)
    for rank, b in enumerate(blocks):
        f = d / f"tokens_rank{rank}.bin"
        with f.open("wb") as fh:
            fh.write(np.arange(64, dtype="<i4").tobytes())
            if sparse:
                fh.truncate(b * seq_len * 4)
    return str(d / "tokens_rank*.bin")


def gate(cli, *args: str) -> tuple[int, dict]:
    r = cli("preflight", "--format", "json", *args)
    assert "Traceback" not in r.stderr, r.stderr
    return r.returncode, json.loads(r.stdout)


def by_name(out: dict) -> dict:
    return {c["name"]: c for c in out["checks"]}


def test_r4_imbalance_fails_the_cache_check_and_names_the_ranks(cli, tmp_path, prefix):
    cache = make_cache(tmp_path / "cache", R4_BLOCKS)
    rc, out = gate(cli, "--job", "r4", "--prefix", prefix, "--cache", cache, "--no-post")
    c = by_name(out)["cache"]
    assert rc == 1 and not out["passed"] and c["status"] == "fail"
    assert c["detail"]["spread_blocks"] == 53 and c["detail"]["spread_steps"] == pytest.approx(6.62, abs=0.01)
    assert c["detail"]["shortest_rank"] == 3 and c["detail"]["longest_rank"] == 0
    assert "rank 3 has 30,835" in c["value"] and "rank 0 has 30,888" in c["value"]


def test_balanced_cache_and_token_total_pass(cli, tmp_path, prefix):
    cache = make_cache(tmp_path / "cache", [30_835] * 16)
    total = 16 * 30_835 * SEQ  # R5: ~1.01B tokens
    rc, out = gate(
        cli, "--job", "ok", "--prefix", prefix, "--cache", cache, "--expected-tokens", "1.01e9", "--no-post"
    )
    checks = by_name(out)
    assert rc == 0 and out["passed"], out
    assert checks["cache"]["status"] == "pass" and checks["tokens"]["status"] == "pass"
    assert checks["tokens"]["detail"]["total"] == total
    rc, out = gate(
        cli, "--job", "ok", "--prefix", prefix, "--cache", cache, "--expected-tokens", "2e9", "--no-post"
    )
    assert rc == 1 and by_name(out)["tokens"]["status"] == "fail"


def test_broken_token_files_fail_with_the_reason(cli, tmp_path, prefix):
    d = tmp_path / "cache"
    make_cache(d, [10, 10], sparse=True)
    (d / "tokens_rank1.bin").write_bytes(b"\x01\x00\x00\x00\x02")  # 5 bytes: not whole tokens
    rc, out = gate(cli, "--job", "x", "--prefix", prefix, "--cache", str(d / "tokens_rank*.bin"), "--no-post")
    assert rc == 1 and "not whole 4-byte tokens" in by_name(out)["cache"]["value"]
    (d / "tokens_rank1.bin").write_bytes(np.array([5, 999_999], "<i4").tobytes())
    rc, out = gate(
        cli,
        "--job",
        "x",
        "--prefix",
        prefix,
        "--cache",
        str(d / "tokens_rank*.bin"),
        "--vocab-size",
        "1000",
        "--no-post",
    )
    assert rc == 1 and "outside the vocabulary" in by_name(out)["cache"]["value"]
    rc, out = gate(cli, "--job", "x", "--prefix", prefix, "--cache", str(tmp_path / "none*.bin"), "--no-post")
    assert rc == 1 and "no token files" in by_name(out)["cache"]["value"]


def test_a_bound_master_port_fails(cli, prefix):
    def port_check(port: int):
        args = ("--job", "p", "--prefix", prefix, "--master-addr", "127.0.0.1", "--master-port", str(port))
        return gate(cli, *args, "--no-post")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc, out = port_check(port)
        assert (
            rc == 1 and by_name(out)["port"]["status"] == "fail" and "in use" in by_name(out)["port"]["value"]
        )
    rc, out = port_check(port)
    assert rc == 0 and by_name(out)["port"]["status"] == "pass"


def test_free_space_threshold(cli, tmp_path, prefix):
    def disk_check(path, min_free_gb: str):
        args = ("--job", "d", "--prefix", prefix, "--checkpoint-path", str(path))
        return gate(cli, *args, "--min-free-gb", min_free_gb, "--no-post")

    rc, out = disk_check(tmp_path / "ckpt", "1e9")
    d = by_name(out)["disk"]
    assert rc == 1 and d["status"] == "fail" and d["detail"]["min_free_gb"] == 1e9
    rc, out = disk_check(tmp_path, "0.001")
    assert rc == 0 and by_name(out)["disk"]["status"] == "pass"


def test_interconnect_probe_is_skipped_with_a_reason_without_tools(cli, prefix, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    import subprocess
    import sys

    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "costexporter.cli",
            "preflight",
            "--job",
            "i",
            "--prefix",
            prefix,
            "--ib-probe",
            "--no-post",
            "--format",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    ib = by_name(json.loads(r.stdout))["interconnect"]
    assert ib["status"] == "skip" and "no InfiniBand tool" in ib["value"]


def test_occupancy_reads_the_agents_node_state_and_blind_is_unknown(cli, prefix):
    gpus = [GpuId("gpu-node-a", i, uuid=f"GPU-a{i}", name="NVIDIA B300") for i in range(2)]
    ts = np.arange(10, dtype=np.int64) * 1000 + 1_760_000_000_000
    s = Samples(
        gpus,
        np.repeat([0, 1], 10).astype(np.int32),
        np.tile(ts, 2),
        np.full(20, 980.0),
        np.full(20, 100.0),
        np.full(20, np.nan),
    ).sort()
    agent = Agent(
        ReplaySource(s, speed=1e6, host="gpu-node-a"), AgentConfig(redis_url=SHARED_URL, prefix=prefix)
    )
    agent.sampler.start()
    try:
        import time

        time.sleep(1.2)
        agent.tick()
    finally:
        agent.shutdown()
    rc, out = gate(cli, "--job", "o", "--prefix", prefix, "--node", "gpu-node-a", "--no-post")
    occ = by_name(out)["occupancy"]
    assert rc == 0 and occ["status"] == "pass" and occ["detail"]["gpus"] == {"gpu-node-a": 2}
    rc, out = gate(
        cli, "--job", "o", "--prefix", prefix, "--node", "gpu-node-a", "--node", "gpu-node-b", "--no-post"
    )
    occ = by_name(out)["occupancy"]
    assert rc == 1 and occ["status"] == "unknown" and "gpu-node-b: no agent" in occ["value"]
    rc, _ = gate(
        cli, "--job", "o", "--prefix", prefix, "--node", "gpu-node-b", "--allow-unknown", "--no-post"
    )
    assert rc == 0


def test_the_result_is_posted_as_the_jobs_preflight_event(cli, tmp_path, prefix):
    cache = make_cache(tmp_path / "cache", R4_BLOCKS)
    r = cli("preflight", "--job", "r4-post", "--prefix", prefix, "--cache", cache, "--redis-url", SHARED_URL)
    assert r.returncode == 1 and "FAIL" in r.stdout and "cache" in r.stdout
    client = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    (ev,) = EventReader(client, "r4-post", prefix).read_all()
    assert ev.type == "preflight" and ev.get("passed") is False
    checks = {c["name"]: c for c in json.loads(ev.get("checks"))}  # a JSON field of the entry
    assert checks["cache"]["status"] == "fail" and checks["cache"]["shortest_rank"] == 3


def test_posting_without_a_redis_url_says_so():
    # It failed inside redis-py with AttributeError ('NoneType' object has no attribute ...).
    from costexporter.tools.preflight import PreflightConfig, post

    with pytest.raises(ValueError, match="redis_url is not set"):
        post(PreflightConfig(job="no-redis"), True, [])


def test_a_world_size_the_cache_does_not_match_fails_from_the_flag_or_the_launchers_environment(
    cli, tmp_path, prefix
):
    """4 cache files, launched with 8 ranks (torchrun sets WORLD_SIZE): ranks 4-7 would read
    nothing. Said from `--world-size` and from the launcher's variable alike; a match passes."""
    cache = make_cache(tmp_path / "cache", [30_835] * 4)
    rc, out = gate(cli, "--job", "ws", "--prefix", prefix, "--cache", cache, "--world-size", "8", "--no-post")
    c = by_name(out)["cache"]
    assert rc == 1 and c["status"] == "fail" and "ranks 4-7 have no file" in c["value"], c
    env = {**os.environ, "WORLD_SIZE": "8"}
    args = ["--format", "json", "--job", "ws", "--prefix", prefix, "--cache", str(cache), "--no-post"]
    r = subprocess.run(
        [sys.executable, "-m", "costexporter.cli", "preflight", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 1 and by_name(json.loads(r.stdout))["cache"]["detail"]["world_size"] == 8
    rc, out = gate(cli, "--job", "ws", "--prefix", prefix, "--cache", cache, "--world-size", "4", "--no-post")
    assert rc == 0 and by_name(out)["cache"]["status"] == "pass", out
