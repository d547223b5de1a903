"""`costexporter preflight`: the pre-run invariant gate of R5 (docs/background.md).

Six checks that take seconds and would have stopped the R1 launch whose 53-block imbalance
later cost ~130 GPU-hours (R4, R6):

1. cache: one per-rank token file for each rank launched (`--world-size`, the launcher's
   WORLD_SIZE), every one readable and of whole 4-byte tokens, and the per-rank block counts
   (file_bytes // 4 // seq_len) equal; otherwise the spread in blocks and optimizer steps,
   naming the shortest and the longest rank;
2. tokens: the total within a tolerance of the expected total;
3. occupancy: every node of the job has an agent reporting its GPUs (the agents' node state in
   Redis), `unknown` where none reports;
4. port: `master_port` free on the master address;
5. disk: at least N GB free on the checkpoint path;
6. interconnect: an InfiniBand probe, skipped with a reason where no tool is present.

A check is `pass`, `fail`, `unknown` (it could not observe: not a pass) or `skip` (not asked
for). The gate passes when no check fails or is unknown (`allow_unknown` lets unknown through).
Sizes come from `stat` and a few sampled reads, so a 16-rank cache of R4's size is checked in
well under a second.
"""

from __future__ import annotations

import errno
import functools
import glob
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

TOKEN_BYTES = 4
SAMPLE_READS = 4  # sampled reads per file: readable from start to end


@dataclass
class Check:
    name: str
    status: str  # pass, fail, unknown, skip
    value: str  # what was measured, in words
    detail: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


@dataclass
class PreflightConfig:
    job: str
    cache: list[str] = field(default_factory=list)  # files or globs, one per rank, in rank order
    seq_len: int = 2048
    blocks_per_step: int = 8  # blocks one rank consumes per optimizer step (R4: 8)
    expected_tokens: float | None = None
    token_tolerance: float = 0.10
    vocab_size: int | None = None  # sampled tokens must be in [0, vocab_size)
    nodes: list[str] = field(default_factory=list)
    redis_url: str | None = None
    prefix: str = "costexporter"
    master_addr: str | None = None
    master_port: int | None = None
    checkpoint_path: str | None = None
    min_free_gb: float = 150.0
    ib_probe: bool = False
    allow_unknown: bool = False
    world_size: int | None = None  # the ranks launched (WORLD_SIZE): one cache file each


def _timed(fn: Callable[[], Check]) -> Check:
    t = time.perf_counter()
    c = fn()
    c.seconds = round(time.perf_counter() - t, 4)
    return c


def rank_files(specs: list[str]) -> list[Path]:
    """Files in rank order: explicit paths as given, globs expanded and sorted by the last
    number in the name (rank_2 before rank_10)."""

    def by_rank(p: str) -> tuple[int, str]:
        nums = re.findall(r"\d+", Path(p).name)
        return (int(nums[-1]) if nums else -1, p)

    out: list[Path] = []
    for s in specs:
        matches = glob.glob(s) if any(ch in s for ch in "*?[") else [s]
        out += [Path(p) for p in sorted(matches, key=by_rank)]
    return out


def check_cache(cfg: PreflightConfig) -> Check:
    """Check 1. Where every file was read, `detail["tokens"]` is the total for check 2."""
    if not cfg.cache:
        return Check("cache", "skip", "no --cache")
    files = rank_files(cfg.cache)
    if not files:
        return Check("cache", "fail", "no token files matched " + " ".join(cfg.cache))
    if cfg.world_size is not None and len(files) != cfg.world_size:
        return Check(
            "cache",
            "fail",
            f"{len(files)} cache files for a world of {cfg.world_size} ranks: "
            + (
                f"ranks {len(files)}-{cfg.world_size - 1} have no file"
                if len(files) < cfg.world_size
                else f"{len(files) - cfg.world_size} file(s) no rank reads"
            )
            + " (a launch with the wrong --nproc-per-node or --nnodes, or a cache built for another size)",
            {"files": len(files), "world_size": cfg.world_size},
        )
    blocks: list[int] = []
    problems: list[str] = []
    total = 0
    for rank, f in enumerate(files):
        try:
            size = f.stat().st_size
            if size % TOKEN_BYTES:
                problems.append(f"rank {rank} ({f.name}): {size} bytes is not whole 4-byte tokens")
            n_tok = size // TOKEN_BYTES
            total += n_tok
            blocks.append(n_tok // cfg.seq_len)
            bad = _sample_tokens(f, n_tok, cfg.vocab_size)
            if bad:
                problems.append(f"rank {rank} ({f.name}): {bad}")
        except OSError as e:
            problems.append(f"rank {rank} ({f}): unreadable: {e.strerror or e}")
            blocks.append(-1)
    detail: dict[str, Any] = {"files": len(files), "blocks": blocks, "seq_len": cfg.seq_len}
    if problems:
        return Check("cache", "fail", "; ".join(problems[:5]), detail)
    detail["tokens"] = total
    lo, hi = min(blocks), max(blocks)
    short, long_ = blocks.index(lo), blocks.index(hi)
    spread = hi - lo
    steps = spread / cfg.blocks_per_step
    detail.update(
        spread_blocks=spread,
        spread_steps=round(steps, 2),
        shortest_rank=short,
        longest_rank=long_,
        min_blocks=lo,
        max_blocks=hi,
    )
    if spread == 0:
        return Check("cache", "pass", f"{len(files)} ranks x {lo:,} blocks, balanced", detail)
    return Check(
        "cache",
        "fail",
        f"per-rank blocks differ by {spread:,} (~{steps:.1f} optimizer steps): "
        f"rank {short} has {lo:,}, rank {long_} has {hi:,}; the short rank will leave the loop "
        "while the others wait in a collective (R4 in docs/background.md): all-reduce MIN the count "
        "(costexporter.integrations.torch_dist.even_batches) or rebalance the cache",
        detail,
    )


def _sample_tokens(f: Path, n_tok: int, vocab: int | None) -> str | None:
    """Read a few tokens at the start, the end and in between: the file reads through, and the
    tokens are in the vocabulary."""
    if n_tok == 0:
        return "empty"
    with f.open("rb") as fh:
        for i in range(SAMPLE_READS):
            pos = (n_tok - 1) * i // max(SAMPLE_READS - 1, 1)
            fh.seek(pos * TOKEN_BYTES)
            raw = fh.read(TOKEN_BYTES)
            if len(raw) != TOKEN_BYTES:
                return f"short read at token {pos}"
            tok = int.from_bytes(raw, "little", signed=True)
            if tok < 0 or (vocab is not None and tok >= vocab):
                return f"token {tok} at position {pos} is outside the vocabulary"
    return None


def check_tokens(cfg: PreflightConfig, cache: Check) -> Check:
    if cfg.expected_tokens is None:
        return Check("tokens", "skip", "no --expected-tokens")
    total = cache.detail.get("tokens")
    if total is None:
        return Check("tokens", "unknown", "the cache could not be read")
    dev = (total - cfg.expected_tokens) / cfg.expected_tokens
    detail = {"total": total, "expected": cfg.expected_tokens, "deviation": round(dev, 4)}
    ok = abs(dev) <= cfg.token_tolerance
    return Check(
        "tokens",
        "pass" if ok else "fail",
        f"{total:,} tokens, {dev:+.1%} from {cfg.expected_tokens:,.0f} (tolerance {cfg.token_tolerance:.0%})",
        detail,
    )


def check_occupancy(cfg: PreflightConfig) -> Check:
    if not cfg.nodes:
        return Check("occupancy", "skip", "no --node given")
    if not cfg.redis_url:
        return Check("occupancy", "unknown", "no Redis to read the agents' node state from")
    import redis

    from costexporter.store import keys, redisconn

    try:
        r = redisconn.from_url(
            cfg.redis_url, socket_timeout=2, socket_connect_timeout=2, decode_responses=True
        )
        pipe = r.pipeline(transaction=False)
        for n in cfg.nodes:
            pipe.hgetall(keys.node_key(cfg.prefix, n))
        states = pipe.execute()
    except (redis.RedisError, OSError) as e:
        return Check("occupancy", "unknown", f"cannot read Redis: {e}")
    per_node: dict[str, int | None] = {}
    for n, st in zip(cfg.nodes, states, strict=True):
        per_node[n] = len(st) if st else None
    missing = [n for n, k in per_node.items() if k is None]
    empty = [n for n, k in per_node.items() if k == 0]
    detail = {"gpus": per_node}
    summary = ", ".join(f"{n}: {'no agent' if k is None else f'{k} GPUs'}" for n, k in per_node.items())
    if empty:
        return Check("occupancy", "fail", summary, detail)
    if missing:
        return Check("occupancy", "unknown", summary + " (no agent reports: unknown, not zero)", detail)
    return Check("occupancy", "pass", summary, detail)


def _is_local(addr: str) -> bool:
    try:
        infos = socket.getaddrinfo(addr, None)
    except OSError:
        return False
    for *_, sa in infos:
        ip = sa[0]
        if not isinstance(ip, str):  # an IPv4 or IPv6 address is text; (int, bytes) is not one
            continue
        try:
            with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((ip, 0))
            return True
        except OSError:
            continue
    return False


def check_port(cfg: PreflightConfig) -> Check:
    if cfg.master_port is None:
        return Check("port", "skip", "no --master-port")
    addr = cfg.master_addr or "127.0.0.1"
    detail = {"addr": addr, "port": cfg.master_port}
    if _is_local(addr):
        try:
            with socket.socket() as s:
                s.bind((addr, cfg.master_port))
        except OSError as e:
            why = "in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
            return Check("port", "fail", f"{addr}:{cfg.master_port} {why}", detail)
        return Check("port", "pass", f"{addr}:{cfg.master_port} free", detail)
    try:
        with socket.create_connection((addr, cfg.master_port), timeout=1.0):
            return Check("port", "fail", f"{addr}:{cfg.master_port} accepts connections: in use", detail)
    except ConnectionRefusedError:
        return Check("port", "pass", f"{addr}:{cfg.master_port} free (connection refused)", detail)
    except OSError as e:
        return Check("port", "unknown", f"{addr}:{cfg.master_port}: {e.strerror or e}", detail)


def check_disk(cfg: PreflightConfig) -> Check:
    if not cfg.checkpoint_path:
        return Check("disk", "skip", "no --checkpoint-path")
    p = Path(cfg.checkpoint_path)
    probe = p if p.exists() else next((q for q in p.parents if q.exists()), Path("/"))
    try:
        free = shutil.disk_usage(probe).free / 1e9
    except OSError as e:
        return Check("disk", "unknown", f"{probe}: {e.strerror or e}")
    detail = {"path": str(probe), "free_gb": round(free, 1), "min_free_gb": cfg.min_free_gb}
    ok = free >= cfg.min_free_gb
    return Check(
        "disk", "pass" if ok else "fail", f"{free:,.1f} GB free on {probe} (need {cfg.min_free_gb:g})", detail
    )


def check_interconnect(cfg: PreflightConfig) -> Check:
    if not cfg.ib_probe:
        return Check("interconnect", "skip", "not asked for (--ib-probe)")
    tool = shutil.which("ibstat")
    if tool is None:
        return Check("interconnect", "skip", "skipped: no InfiniBand tool (ibstat) on this node")
    try:
        out = subprocess.run([tool], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return Check("interconnect", "unknown", f"ibstat: {e}")
    states = re.findall(r"State:\s*(\w+)", out)
    active = states.count("Active")
    detail = {"ports": len(states), "active": active}
    if active:
        return Check("interconnect", "pass", f"{active} of {len(states)} InfiniBand ports active", detail)
    return Check("interconnect", "fail", f"no active InfiniBand port ({len(states)} seen)", detail)


def run(cfg: PreflightConfig) -> tuple[bool, list[Check]]:
    """Run every check; the gate passes when none failed, none is unknown (unless allowed) and
    not every check was skipped."""
    cache = _timed(lambda: check_cache(cfg))
    checks = [cache, _timed(lambda: check_tokens(cfg, cache))]
    checks += [
        _timed(functools.partial(f, cfg))
        for f in (check_occupancy, check_port, check_disk, check_interconnect)
    ]
    bad = {"fail"} | (set() if cfg.allow_unknown else {"unknown"})
    # A gate that checked nothing (every check skipped) proves nothing: no PASS.
    checked = any(c.status != "skip" for c in checks)
    passed = checked and not any(c.status in bad for c in checks)
    return passed, checks


def post(cfg: PreflightConfig, passed: bool, checks: list[Check]) -> None:
    """Post the result as the job's `preflight` event, so the ledger and the API
    show that a run was launched with a failing gate."""
    from costexporter.store import protocol, redisconn
    from costexporter.trainer.transport import send_entries

    if not cfg.redis_url:
        raise ValueError("preflight.post needs the Redis to post to: cfg.redis_url is not set")
    r = redisconn.from_url(cfg.redis_url, socket_timeout=5, socket_connect_timeout=2, decode_responses=True)
    entry = protocol.encode_fields(
        {
            "v": "1",
            "type": "preflight",
            "job": cfg.job,
            "ts": f"{time.time():.6f}",
            "rank": int(os.environ.get("RANK", "0") or 0),
            "session": "preflight-" + secrets.token_hex(6),
            "seq": 0,
            "passed": passed,
            "checks": [{k: v for k, v in asdict(c).items() if k != "detail"} | c.detail for c in checks],
        }
    )
    send_entries(r, cfg.prefix, cfg.job, [entry])


def to_json(passed: bool, checks: list[Check]) -> str:
    return json.dumps({"passed": passed, "checks": [asdict(c) for c in checks]}, indent=2)
