"""The agent in a wide job: round CPU, RSS and Redis load against the job's width.

One agent owns 8 GPUs (host node0) of a job of W GPUs, 8 per host. Its W/8 - 1 peers are
simulated as real agents publish: each peer host's sample stream (`<p>:a:{job}:samples:<host>`)
gets one entry per 5-s round with its 8 ranks' readings, written straight into a private
`redis-server` (no persistence, a free port) in the agents' own format. Before the agent starts
the streams hold the whole booking context (2 x the checkpoint allowance + 60 s: 1,860 s at 1 Hz),
and the agent's watermark sits at its end with its band window, as after a restart (the first
round reads each peer's stream back to that window only). The trainer posts a step a second,
and every rank its heartbeat every 10 s (the reporter's default; `--heartbeat 0`: none), spread
over the 10 s as independent processes' are: a 4,096-GPU job posts ~410 heartbeats a second,
into the job's heartbeat stream as the reporter sends them (`keys.beats_key`, which the agent
does not read).

Per width, in a fresh process: the first round (it reads and merges the whole context), then
steady rounds of 5 s: `round` is the median thread CPU of the real `Agent.tick()`, `RSS` the
process's resident memory after them; `cmds` the Redis commands one round sends (INFO
commandstats deltas around the tick), `redis ms` the Redis CPU it costs (INFO cpu deltas), with
the peer's own XADD per round added. `cores@W` is that Redis CPU for all W/8 agents of the job at
one round per 5 s. Targets: round <= 50 ms and RSS <= 150 MB at 4,096 GPUs; Redis <= 0.5 core
at 4,096 GPUs (512 agents). `--cluster`: the same on a private 3-master Redis Cluster
(tests/redis_cluster.py; redis-cli needed), Redis CPU summed over the masters and the busiest
one's shown (`busiest@W`): what a job's keys spread over the shards takes off each.

Run through bench/bench_scale.py --part wide, or alone:
python bench/scale_wide.py [--widths 64,512] [--heartbeat 10] [--cluster]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from costexporter.store import keys

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from scale_agent import T0, _rss_mb, in_fresh_processes  # noqa: E402

JOB, PREFIX = "wide", "bench"
PER_HOST = 8
ROUND_S = 5
ROUNDS = 8
CONTEXT_S = 2 * 900 + 60  # the agent's default context: 2 x checkpoint allowance + 60 s
HISTORY_S = CONTEXT_S + 60


def _peer_entry(host: int, t0: float, seconds: int, rng: np.random.Generator) -> dict[str, str]:
    """One round of a peer host's 8 ranks, as `Agent._window` publishes it."""
    ranks = np.arange(host * PER_HOST, (host + 1) * PER_HOST)
    r = np.repeat(ranks, seconds)
    t = np.tile(np.round((t0 + np.arange(seconds)) * 1000).astype(np.int64), ranks.size)
    p = rng.uniform(940.0, 1040.0, r.size).round(1)
    u = np.full(r.size, 100.0)
    e = ((t - T0 * 1000) * 1000.0 + r).round()  # cumulative mJ, as NVML's counter
    from costexporter.core.samplewin import encode_entry

    return encode_entry((r, t, p, u, e), f"node{host}")


def _publish(client, hosts: range, t0: float, seconds: int, rng: np.random.Generator) -> None:

    pipe = client.pipeline(transaction=False)
    for h in hosts:
        pipe.xadd(keys.samples_key(PREFIX, JOB, f"node{h}"), _peer_entry(h, t0, seconds, rng))
    pipe.execute()


def _steps(first: int, last: int, seqs: dict[int, int]) -> list[dict[str, str]]:
    from costexporter.store import protocol

    out = []
    for k in range(first, last + 1):
        seq = seqs.get(0, 0)
        seqs[0] = seq + 1
        out.append(
            protocol.encode_fields(
                {
                    "v": "1",
                    "type": "step",
                    "job": JOB,
                    "ts": f"{T0 + k:.3f}",
                    "rank": 0,
                    "session": "s0",
                    "seq": seq,
                    "step": k,
                    "tokens": 4096,
                }
            )
        )
    return out


HEARTBEAT_S = 10.0  # the reporter's default


def _heartbeats(width: int, t0: float, t1: float, seqs: dict[int, int], every: float) -> list[dict[str, str]]:
    """Each rank's heartbeats in [t0, t1), every `every` s at a phase of its own."""
    from costexporter.store import protocol

    if every <= 0:
        return []
    out = []
    for r in range(width):
        phase = (r * 7919 % 1000) / 1000 * every
        k = np.ceil((t0 - T0 - phase) / every)
        t = T0 + phase + k * every
        while t < t1:
            seq = seqs.get(-1 - r, 0)  # the heartbeats' own seqs (keyed apart from the events')
            seqs[-1 - r] = seq + 1
            out.append(
                protocol.encode_fields(
                    {"v": "1", "type": "heartbeat", "job": JOB, "ts": f"{t:.3f}", "rank": r,
                     "session": f"s{r}", "seq": seq}
                )
            )  # fmt: skip
            t += every
    out.sort(key=lambda e: float(e["ts"]))
    return out


def _prepare(width: int, url: str) -> dict[int, int]:
    """Registrations of every rank, a step a second and the peers' context, before the agent."""

    from costexporter.sources.synth import TraceBuilder
    from costexporter.trainer.transport import send_entries
    from tests.test_agent import event_entry

    client = _client(url)
    reg = TraceBuilder(n_gpus=width, per_host=PER_HOST, job=JOB, seed=1, interval_s=1.0, t0=T0)
    send_entries(client, PREFIX, JOB, [event_entry(e) for e in reg.events])
    seqs = {0: 1}  # after rank 0's register
    send_entries(client, PREFIX, JOB, _steps(1, HISTORY_S, seqs))
    rng = np.random.default_rng(width)
    hosts = range(1, width // PER_HOST)
    for t in range(0, HISTORY_S, ROUND_S):
        _publish(client, hosts, T0 + t, ROUND_S, rng)
    from costexporter.core.bands import window_overlap_ms

    booked = int((T0 + HISTORY_S - 60) * 1000)
    overlap = window_overlap_ms(1000, 1000, 3.0)
    wm = {
        "booked_until": booked,
        "starts": {str(r): int(T0 * 1000) for r in range(8)},
        # As a running agent stores it: its band window, seconds before the watermark.
        "win": [[booked - overlap, booked, None], None],
    }
    client.set(keys.watermark_key(PREFIX, JOB, "node0"), json.dumps(wm))
    return seqs


def _client(url: str):
    """A client for one Redis or, for a cluster URL, the cluster (as the agent connects)."""
    from costexporter.store import redisconn

    return redisconn.from_url(url, decode_responses=True)


def _nodes(url: str) -> list:
    """A plain client per Redis: the one, or each master of a cluster."""
    import redis

    from costexporter.store import redisconn

    if not redisconn.is_cluster_url(url):
        return [redis.Redis.from_url(url, decode_responses=True)]
    hosts = url.split("://", 1)[1].split(",")
    return [
        redis.Redis(host=h.rsplit(":", 1)[0], port=int(h.rsplit(":", 1)[1]), decode_responses=True)
        for h in hosts
    ]


def _stats(nodes: list) -> tuple[dict[str, tuple[int, int]], list[float]]:
    """Commands (calls, usec) summed over `nodes`, and each node's CPU (s)."""
    calls: dict[str, tuple[int, int]] = {}
    cpus = []
    for n in nodes:
        for k, v in n.info("commandstats").items():
            c, u = calls.get(k.removeprefix("cmdstat_"), (0, 0))
            calls[k.removeprefix("cmdstat_")] = (c + v["calls"], u + v["usec"])
        cpu = n.info("cpu")
        cpus.append(float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]))
    return calls, cpus


def _delta(a, b) -> tuple[dict[str, int], float, float]:
    """Commands sent between two snapshots (the snapshots' own INFO and a cluster client's
    topology reads left out), Redis CPU (s) over all nodes, and the busiest node's."""
    calls = {k: v[0] - a[0].get(k, (0, 0))[0] for k, v in b[0].items() if k not in ("info", "cluster")}
    cpu = [y - x for x, y in zip(a[1], b[1], strict=True)]
    return {k: n for k, n in calls.items() if n}, sum(cpu), max(cpu)


def _one(width: int, url: str, seqs: dict[int, int], out, heartbeat_s: float = HEARTBEAT_S) -> None:

    from costexporter.services.agent import Agent, AgentConfig
    from costexporter.sources.playback import ReplaySource
    from costexporter.sources.synth import TraceBuilder
    from costexporter.store.protocol import beats_cap
    from costexporter.trainer.transport import send_entries

    client = _client(url)
    nodes = _nodes(url)
    sb = TraceBuilder(n_gpus=8, per_host=PER_HOST, job=JOB, seed=1, interval_s=1.0, t0=T0, register=False)
    sb.stretch("compute", HISTORY_S + ROUND_S * (ROUNDS + 2) + 10)
    now = [0.0]
    agent = Agent(
        ReplaySource(sb.samples(), speed=1.0, clock=lambda: now[0]),
        AgentConfig(redis_url=url, prefix=PREFIX, agent_id="node0", job_refresh_s=3600),
    )
    now[0] = float(HISTORY_S)
    rss0 = _rss_mb()

    def tick() -> float:
        for r in agent.source.read():
            agent.sampler._buf.append(r)
        t = time.thread_time()
        agent.tick()
        return time.thread_time() - t

    first = tick()
    rng = np.random.default_rng(width + 1)
    hosts = range(1, width // PER_HOST)
    rounds, cmds, redis_s, xadd_s, busiest_s = [], [], [], [], []
    for k in range(ROUNDS + 1):
        t = HISTORY_S + k * ROUND_S
        now[0] = float(t + ROUND_S)
        s0 = _stats(nodes)
        _publish(client, hosts, T0 + t, ROUND_S, rng)
        s1 = _stats(nodes)
        send_entries(client, PREFIX, JOB, _steps(t + 1, t + ROUND_S, seqs))
        beats = _heartbeats(width, T0 + t, T0 + t + ROUND_S, seqs, heartbeat_s)
        send_entries(client, PREFIX, JOB, beats, beats_cap=beats_cap(width))  # as the reporter does
        s2 = _stats(nodes)
        cpu = tick()
        s3 = _stats(nodes)
        if k == 0:  # the first steady round still books the catch-up's tail
            continue
        rounds.append(cpu)
        c, r, top = _delta(s2, s3)
        cmds.append(c)
        redis_s.append(r)
        busiest_s.append(top)
        xadd_s.append(_delta(s0, s1)[1] / max(len(hosts), 1))
    j = agent.jobs[JOB]
    out.put(
        {
            "width": width,
            "first_s": first,
            "round_ms": statistics.median(rounds) * 1000,
            "round_max_ms": max(rounds) * 1000,
            "rss_mb": _rss_mb(),
            "rss_start_mb": rss0,
            "window": j.remote.size,
            "booked_rounds": agent.booker.stats["rounds"],
            "cmds": cmds[len(cmds) // 2],
            "redis_ms": statistics.median(redis_s) * 1000,
            "busiest_ms": statistics.median(busiest_s) * 1000,
            "nodes": len(nodes),
            "xadd_ms": statistics.median(xadd_s) * 1000,
        }
    )


def measure(widths: list[int], heartbeat_s: float = HEARTBEAT_S, cluster: bool = False) -> list[dict]:
    """One fresh process and one private Redis (or 3-master cluster) per width."""

    def args(w, url, seqs, q):
        return (w, url, seqs, q, heartbeat_s)

    if not cluster:
        return in_fresh_processes(widths, _prepare, _one, args)
    import multiprocessing
    import tempfile

    from tests.redis_cluster import RedisCluster

    ctx = multiprocessing.get_context("spawn")
    res = []
    for w in widths:
        with tempfile.TemporaryDirectory() as d:
            c = RedisCluster(Path(d)).start()
            try:
                seqs = _prepare(w, c.url)
                q = ctx.Queue()
                p = ctx.Process(target=_one, args=args(w, c.url, seqs, q))
                p.start()
                res.append(q.get(timeout=1800))
                p.join(60)
            finally:
                c.stop()
    return res


def report(res: list[dict]) -> None:
    print(
        "agent round vs job width, 8 own GPUs (targets at 4,096 GPUs: round <= 50 ms, RSS <= 150 MB, "
        "Redis <= 0.5 core for 512 agents)"
    )
    print(
        f"  {'GPUs':>6} {'window':>9} {'first s':>8} {'round ms':>9} {'max ms':>7} {'RSS MB':>7} "
        f"{'cmds/round':>10} {'redis ms':>9} {'cores@W':>8} {'busiest@W':>9}  commands"
    )
    for r in res:
        agents = r["width"] // PER_HOST
        cores = (r["redis_ms"] + r["xadd_ms"]) / 1000 * agents / ROUND_S
        r["cores"] = cores
        # The busiest node's share of the agents' rounds, each peer's XADD counted there in full.
        busiest = (r["busiest_ms"] + r["xadd_ms"]) / 1000 * agents / ROUND_S
        r["busiest"] = busiest
        top = f"{busiest:>9.2f}" if r["nodes"] > 1 else f"{'':>9}"
        kinds = ",".join(f"{k}:{n}" for k, n in sorted(r["cmds"].items()))
        print(
            f"  {r['width']:>6} {r['window']:>9} {r['first_s']:>8.2f} {r['round_ms']:>9.1f} "
            f"{r['round_max_ms']:>7.1f} {r['rss_mb']:>7.0f} {sum(r['cmds'].values()):>10} "
            f"{r['redis_ms'] + r['xadd_ms']:>9.2f} {cores:>8.2f} {top}  {kinds}"
        )
    wide = [r for r in res if r["width"] >= 4096]
    if wide:
        r = wide[-1]

        def v(ok: bool) -> str:
            return "MET" if ok else "MISSED"

        print(
            f"  at {r['width']} GPUs: round <= 50 ms: {v(r['round_ms'] <= 50)}; "
            f"RSS <= 150 MB: {v(r['rss_mb'] <= 150)}; Redis <= 0.5 core: {v(r['cores'] <= 0.5)}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", default="64,512,4096", help="job widths (GPUs), comma-separated")
    ap.add_argument("--heartbeat", type=float, default=HEARTBEAT_S, help="each rank's heartbeat, s (0: none)")
    ap.add_argument("--cluster", action="store_true", help="on a private 3-master Redis Cluster")
    a = ap.parse_args()
    report(measure([int(x) for x in a.widths.split(",")], a.heartbeat, a.cluster))


if __name__ == "__main__":
    main()
