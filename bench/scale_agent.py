"""The agent at scale: round CPU and RSS against a job's history, and restart catch-up.

Each history size runs in a process of its own against a private `redis-server` (no
persistence, a free port): an 8-GPU job on one node (an agent's usual share) whose stream holds
N steps of rank 0 (one a second, a checkpoint every 1,000) and a heartbeat every 10 s from each
of its 8 ranks. The agent starts with
that backlog (a restart after its watermark: `catch-up`, the CPU to read and fold it), then
books steady rounds of 5 s, 5 new steps each (`round`: median thread CPU of a round; `rss`: the
process's resident memory after them; `trimmed`: after malloc_trim, what the process holds
rather than what the allocator kept from the catch-up's peak; `state`: the agent's estimate of
its booking state, `costexporter_agent_state_bytes`). Targets (docs/benchmarks.md): round <= 20 ms at
any history, RSS flat <= 150 MB, catch-up linear in the backlog.

Then the agent is killed, BACKLOG s of steps arrive, and a new agent starts: it resumes from the
fold stored with the watermark (`restart`: CPU to read and fold the backlog; the first start,
above, had no stored fold and folded the whole history). `Redis bytes`: the job's keys
(MEMORY USAGE) after the stream was trimmed, their growth per booked step split by key, and the
day of a 256-GPU job (32 agents, a step a second) extrapolated from it (target <= 1 GB/day); a
host's sample stream at its cap is measured on a stream of 8-GPU round entries written for it (a
one-node job publishes none).

Run through bench/bench_scale.py, or alone: python bench/scale_agent.py [--steps 1000,100000]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

T0 = 1_750_000_000.0
WINDOW_S = 600  # samples before the agent's start (its context for bands)
ROUNDS = 12
RANKS = 8
BACKLOG = 600  # seconds (steps) of events that arrive while the agent is down


def _redis() -> tuple[subprocess.Popen, str, str]:
    from tests.redis_server import free_port

    d = tempfile.mkdtemp(prefix="scale-agent-")
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no", "--dir", d],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    import redis

    c = redis.Redis(port=port)
    for _ in range(100):
        try:
            c.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0", d


def _entries(job: str, first: int, last: int, seqs: dict, beats_apart: bool = False) -> list[dict[str, str]]:
    """Steps first..last of rank 0 (one a second), checkpoints, every rank's heartbeats.
    `beats_apart`: heartbeats numbered apart from the events, as the reporter numbers those it
    sends to the job's heartbeat stream (`send_entries(..., beats_cap=...)` puts them there);
    else on the events' seqs, as earlier reporters sent them in the events stream."""
    from costexporter.store import protocol

    def entry(kind: str, rank: int, ts: float, **fields) -> dict[str, str]:
        key = ("beat", rank) if beats_apart and kind == "heartbeat" else rank
        seq = seqs.get(key, 0)
        seqs[key] = seq + 1
        base = {"v": "1", "type": kind, "job": job, "ts": f"{ts:.3f}", "rank": rank, "session": f"s{rank}"}
        return protocol.encode_fields({**base, "seq": seq, **fields})

    out = []
    for k in range(first, last + 1):
        t = T0 + k
        out.append(entry("step", 0, t, step=k, tokens=4096))
        if k % 1000 == 0:
            out.append(entry("phase", 0, t + 0.1, name="checkpoint", state="begin"))
            out.append(entry("phase", 0, t + 0.6, name="checkpoint", state="end", step=k))
        if k % 10 == 0:
            out += [entry("heartbeat", r, t + 0.5) for r in range(RANKS)]
    return out


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


JOB, PREFIX = "scale", "bench"


def _post_history(n_steps: int, url: str) -> dict[int, int]:
    """The job's registrations and its N steps of history (by this process, not the agent's)."""
    import redis

    from costexporter.sources.synth import TraceBuilder
    from costexporter.trainer.transport import send_entries
    from tests.test_agent import event_entry

    client = redis.Redis.from_url(url, decode_responses=True)
    reg = TraceBuilder(n_gpus=RANKS, per_host=RANKS, job=JOB, seed=1, interval_s=1.0, t0=T0)
    send_entries(client, PREFIX, JOB, [event_entry(e) for e in reg.events])
    seqs = dict.fromkeys(range(RANKS), 1)  # after the registrations' seq numbers
    for a in range(1, n_steps + 1, 20_000):
        send_entries(client, PREFIX, JOB, _entries(JOB, a, min(a + 19_999, n_steps), seqs))
    return seqs


def _one(n_steps: int, url: str, seqs: dict[int, int], out) -> None:
    """In a fresh process: start an agent on the history, catch up, book steady rounds."""
    import redis

    from costexporter.services.agent import Agent, AgentConfig
    from costexporter.services.gcstate import FrozenState
    from costexporter.sources.playback import ReplaySource
    from costexporter.sources.synth import TraceBuilder
    from costexporter.store import keys
    from costexporter.trainer.transport import send_entries

    job, prefix = JOB, PREFIX
    client = redis.Redis.from_url(url, decode_responses=True)
    # Samples: the last WINDOW_S s of the history, and the steady rounds to come.
    sb = TraceBuilder(
        n_gpus=RANKS,
        per_host=RANKS,
        job=job,
        seed=1,
        interval_s=1.0,
        t0=T0 + n_steps - WINDOW_S,
        register=False,
    )
    sb.stretch("compute", WINDOW_S + 5 * ROUNDS + BACKLOG + 40)
    # The agent restarts: its watermark says it booked the job up to the samples it still has.
    wm = {
        "booked_until": int((T0 + n_steps - WINDOW_S) * 1000),
        "starts": {"0": int(T0 * 1000), "1": int(T0 * 1000)},
    }
    client.set(keys.watermark_key(prefix, job, "node0"), json.dumps(wm))
    now = [0.0]
    agent = Agent(
        ReplaySource(sb.samples(), speed=1.0, clock=lambda: now[0]),
        AgentConfig(redis_url=url, prefix=prefix, agent_id="node0", job_refresh_s=3600),
    )
    now[0] = float(WINDOW_S)  # the samples reach the history's last step
    rss0 = _rss_mb()

    upkeep = FrozenState()  # what `serve` does after each round (untimed here, as the round is)

    def tick() -> float:
        for r in agent.source.read():
            agent.sampler._buf.append(r)
        t = time.thread_time()
        agent.tick()
        took = time.thread_time() - t
        upkeep.after_round()
        return took

    last_id = client.xrevrange(keys.stream_key(prefix, job), count=1)[0][0]
    catch_cpu, catch_wall, catch_rounds = 0.0, time.perf_counter(), 0
    while True:
        catch_cpu += tick()
        catch_rounds += 1
        j = agent.jobs.get(job)
        if j is not None and j.reader.cursor == last_id and j.fold is not None:
            break
    catch_wall = time.perf_counter() - catch_wall
    rounds = []
    for k in range(ROUNDS):
        now[0] += 5
        a = n_steps + 5 * k + 1
        send_entries(client, prefix, job, _entries(job, a, a + 4, seqs))
        rounds.append(tick())
    j = agent.jobs[job]
    rss = _rss_mb()
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what the allocator keeps after the catch-up's peak
    rss_trimmed, state_kb = _rss_mb(), j.state_bytes() / 1024
    rebuilds = agent.folds.stats["timeline_rebuilds"]
    booked_rounds = agent.booker.stats["rounds"]
    mem0 = _job_bytes(client, prefix, job)
    trimmed0 = agent.folds.stats["stream_entries_trimmed"]
    # Killed; BACKLOG s of events arrive; a new agent resumes from the stored fold.
    del agent, j
    a = n_steps + 5 * ROUNDS + 1
    send_entries(client, prefix, job, _entries(job, a, a + BACKLOG - 1, seqs))
    now[0] += BACKLOG
    started = [False]

    def clock() -> float:  # 0 at creation: the new source plays the samples from their start
        if not started[0]:
            started[0] = True
            return 0.0
        return now[0]

    agent = Agent(
        ReplaySource(sb.samples(), speed=1.0, clock=clock),
        AgentConfig(redis_url=url, prefix=prefix, agent_id="node0", job_refresh_s=3600),
    )
    last_id = client.xrevrange(keys.stream_key(prefix, job), count=1)[0][0]
    restart_cpu, restart_wall, restart_rounds = 0.0, time.perf_counter(), 0
    while True:
        restart_cpu += tick()
        restart_rounds += 1
        j = agent.jobs.get(job)
        if j is not None and j.reader.cursor == last_id and j.fold is not None:
            break
    restart_wall = time.perf_counter() - restart_wall
    for _ in range(3):  # book the backlog to the samples' end
        now[0] += 5
        tick()
    mem1 = _job_bytes(client, prefix, job)
    booked_steps = BACKLOG + 5 * ROUNDS  # about what the second agent booked past the first
    growth = {k: (mem1.get(k, 0) - mem0.get(k, 0)) / BACKLOG for k in set(mem0) | set(mem1)}
    out.put(
        {
            "restart_s": restart_cpu,
            "restart_wall_s": restart_wall,
            "restart_rounds": restart_rounds,
            "restored": agent.folds.stats["fold_restores"],
            "restart_rebuilds": agent.folds.stats["timeline_rebuilds"],
            "accepted_after_restart": j.reader.stats["accepted"],
            "trimmed": trimmed0 + agent.folds.stats["stream_entries_trimmed"],
            "stream_len": client.xlen(keys.stream_key(prefix, job)),
            "samples_len": client.xlen(keys.samples_key(prefix, job, agent.host)),
            "mem_kb": {k: v / 1024 for k, v in mem1.items()},
            "sample_stream_bytes": _sample_stream_bytes(client),
            "bytes_per_step": growth,
            "booked_steps": booked_steps,
        }
    )
    out.put(
        {
            "steps": n_steps,
            "round_ms": statistics.median(rounds) * 1000,
            "round_max_ms": max(rounds) * 1000,
            "rss_mb": rss,
            "rss_trimmed_mb": rss_trimmed,
            "rss_start_mb": rss0,
            "state_kb": state_kb,
            "catchup_s": catch_cpu,
            "catchup_wall_s": catch_wall,
            "catchup_rounds": catch_rounds,
            "booked_rounds": booked_rounds,
            "rebuilds": rebuilds,
        }
    )


def _sample_stream_bytes(client, n: int = 200) -> float:
    """A host's sample stream at its cap (`samples_maxlen` entries, one a 5-s round of 8 GPUs at
    1 Hz, as `Agent._window` publishes them): MEMORY USAGE of `n` such entries, scaled."""
    import numpy as np

    from costexporter.core.samplewin import encode_entry
    from costexporter.services.agent import AgentConfig, samples_maxlen

    key = "scratch:samples"
    rng = np.random.default_rng(0)
    pipe = client.pipeline(transaction=False)
    for k in range(n):
        r = np.repeat(np.arange(8), 5)
        t = np.tile(np.round((T0 + 5 * k + np.arange(5)) * 1000).astype(np.int64), 8)
        p = rng.uniform(940.0, 1040.0, r.size).round(1)
        e = ((t - T0 * 1000) * 1000.0 + r).round()
        pipe.xadd(key, encode_entry((r, t, p, np.full(r.size, 100.0), e)))
    pipe.execute()
    used = int(client.memory_usage(key, samples=0) or 0)
    client.delete(key)
    return used / n * samples_maxlen(AgentConfig())


def _job_bytes(client, prefix: str, job: str) -> dict[str, int]:
    """The job's Redis memory by kind of key (MEMORY USAGE, every sample of a key)."""
    from costexporter.store import keys

    out: dict[str, int] = {}
    for k in client.scan_iter(keys.job_key(prefix, "?", job, "*"), count=1000):  # every party's
        rest = k.split("}:", 1)[1]
        parts = rest.split(":")
        if parts[0] == "ledger" and parts[1] in ("5m", "1h", "1d", "1w"):
            kind = "ledger buckets"
        elif parts[0] == "ledger":
            kind = "ledger:" + parts[1]
        else:
            kind = parts[0] if parts[0] != "fold" else "fold (stored)"
        out[kind] = out.get(kind, 0) + int(client.memory_usage(k, samples=0) or 0)
    return out


def in_fresh_processes(cases, prepare, target, args, replies: int = 1) -> list[dict]:
    """For each case: a private redis-server seeded by `prepare(case, url)`, then `target` in a
    fresh spawned process (`args(case, url, prepared, queue)`), its `replies` queue items merged
    into one figure dict (the first one's keys win)."""
    if not shutil.which("redis-server"):
        raise SystemExit("redis-server is not on PATH")
    ctx = multiprocessing.get_context("spawn")
    res = []
    for case in cases:
        proc, url, d = _redis()
        try:
            prepared = prepare(case, url)
            q = ctx.Queue()
            p = ctx.Process(target=target, args=args(case, url, prepared, q))
            p.start()
            merged: dict = {}
            for got in reversed([q.get(timeout=1800) for _ in range(replies)]):
                merged.update(got)
            res.append(merged)
            p.join(60)
        finally:
            proc.terminate()
            proc.wait(10)
            shutil.rmtree(d, ignore_errors=True)
    return res


def measure(steps: list[int]) -> list[dict]:
    """One fresh process and one private Redis per history size (the restart figures first)."""
    return in_fresh_processes(
        steps, _post_history, _one, lambda n, url, seqs, q: (n, url, seqs, q), replies=2
    )


def report(res: list[dict]) -> None:
    print("agent round vs history (target: round <= 20 ms at any history, RSS flat <= 150 MB)")
    print(
        f"  {'steps':>8} {'round ms':>9} {'max ms':>7} {'RSS MB':>7} {'trimmed':>8} {'state KB':>9} "
        f"{'catch-up s':>11} {'s/100k steps':>13}"
    )
    for r in res:
        per = r["catchup_s"] / max(r["steps"], 1) * 100_000
        print(
            f"  {r['steps']:>8} {r['round_ms']:>9.1f} {r['round_max_ms']:>7.1f} {r['rss_mb']:>7.0f} "
            f"{r['rss_trimmed_mb']:>8.0f} {r['state_kb']:>9.0f} {r['catchup_s']:>11.2f} {per:>13.2f}"
        )
    ok_round = all(r["round_ms"] <= 20 for r in res)
    ok_rss = all(r["rss_mb"] <= 150 for r in res)
    print(
        f"  round <= 20 ms: {'MET' if ok_round else 'MISSED'}; "
        f"RSS <= 150 MB: {'MET' if ok_rss else 'MISSED'}; "
        "catch-up linear: compare s/100k steps across sizes"
    )
    if not res or "restart_s" not in res[0]:
        return
    print(f"restart after {BACKLOG} s down, from the stored fold (target: linear in backlog, not history)")
    cols = f"{'history s':>10} {'restart s':>10} {'rounds':>7} {'events read':>12} {'restored':>9}"
    print(f"  {'steps':>8} {cols}")
    for r in res:
        print(
            f"  {r['steps']:>8} {r['catchup_s']:>10.2f} {r['restart_s']:>10.3f} {r['restart_rounds']:>7} "
            f"{r['accepted_after_restart']:>12} {r['restored']:>9}"
        )
    flat = max(r["restart_s"] for r in res) <= 3 * min(r["restart_s"] for r in res) + 0.05
    print(f"  restart flat across history (same backlog): {'MET' if flat else 'MISSED'}")
    print("Redis bytes of the job after trimming (target: <= 1 GB/day for a 256-GPU job)")
    print(f"  {'steps':>8} {'stream len':>10} {'trimmed':>9} {'job KB':>8}  growth per step (B): by key")
    for r in res:
        g = {k: v for k, v in sorted(r["bytes_per_step"].items()) if abs(v) >= 0.5}
        print(
            f"  {r['steps']:>8} {r['stream_len']:>10} {r['trimmed']:>9} {sum(r['mem_kb'].values()):>8.0f}  "
            + ", ".join(f"{k} {v:.0f}" for k, v in g.items())
        )
    from costexporter.services.agent import AgentConfig

    r = res[-1]
    g = r["bytes_per_step"]
    # Trimmed stream, capped sample streams, and the rollback index (pruned to the steps since the
    # oldest of the last `rollback_checkpoints` checkpoints: it grows between two checkpoints,
    # then shrinks): not per step.
    bounded = ("events", "samples", "ledger:rbidx")
    per_agent = sum(v for k, v in g.items() if k == "fold (stored)")
    shared = sum(v for k, v in g.items() if k not in bounded) - per_agent
    rbidx = 32 * r["mem_kb"].get("ledger:rbidx", 0) * 1024 * 2  # at most ~2x what is held at the end
    # A 256-GPU job, 32 agents (8 GPUs each), a step a second: the shared keys once, each agent's
    # own 32 times; the stream kept up to 2 x late_keep_s, its entries scaled from these 8 ranks'
    # (a heartbeat each every 10 s, a step a second) to 256 ranks'; each host's sample stream
    # capped at samples_maxlen entries (one a 5-s round) of 8 GPUs' samples.
    entry = r["mem_kb"].get("events", 0) * 1024 / max(r["stream_len"], 1)
    stream = entry * (1 + 256 / 10) * 2 * AgentConfig.late_keep_s
    samples = 32 * r["sample_stream_bytes"]
    day = 86400 * (shared + 32 * per_agent)
    total = day + stream + samples + rbidx
    print(
        f"  per step: {shared:.0f} B shared + {per_agent:.0f} B per agent (per GPU-hour of this 8-GPU job: "
        f"{3600 * (shared + per_agent) / RANKS / 1024:.0f} KB); rollback index held at the end: "
        f"{r['mem_kb'].get('ledger:rbidx', 0):.0f} KB per agent\n  256-GPU job: grows {day / 1e6:.0f} MB/day "
        f"({'<=' if day <= 1e9 else '>'} 1 GB/day), plus what stays bounded: {stream / 1e6:.0f} MB of stream "
        f"kept, {samples / 1e6:.0f} MB of sample streams at their cap, {rbidx / 1e6:.0f} MB of rollback "
        f"indexes; {total / 1e9:.2f} GB after a day"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", default="1000,100000,300000", help="history sizes (steps), comma-separated")
    ap.add_argument(
        "--watcher",
        default="1000x1000,1000x1000/2,1x100000",
        help="watcher shapes: JOBSxSTEPS[/SHARDS], comma-separated",
    )
    a = ap.parse_args()
    report(measure([int(x) for x in a.steps.split(",")]))
    report_watcher(measure_watcher(parse_shapes(a.watcher)))


# ---- the watcher ---------------------------------------------------------------------------------
def _watch_shard(shard: tuple[int, int], url: str, cmds, out, code: str | None = None) -> None:
    """In a fresh process: a watcher of one shard of the jobs ((0, 1): every job) polling when
    told to (at the clock time given), replying each poll's time. The first poll reads every
    job's history; between polls it does what the watch command's loop does (untimed, as there).
    `code`: the directory of the costexporter package to run (a baseline's), else this tree's."""
    if code is not None:
        sys.path.insert(0, code)
    import dataclasses

    from costexporter.services.gcstate import FrozenState
    from costexporter.services.watcher import WatchConfig, Watcher

    clock = [0.0]
    settings = {
        "redis_url": url,
        "prefix": PREFIX,
        "clock": lambda: clock[0],
        "forget_after_s": 1e9,
        "gpu_model": "NVIDIA B300",  # the benchmark's jobs are B300 jobs, as a watch --gpu-model says
        "shard": None if shard[1] == 1 else shard,
    }
    known = {f.name for f in dataclasses.fields(WatchConfig)}  # a baseline's may lack some
    w = Watcher(WatchConfig(**{k: v for k, v in settings.items() if k in known}))
    upkeep = FrozenState()
    while (now := cmds.get()) is not None:
        clock[0] = now
        t = time.perf_counter()
        st = w.poll()
        took = time.perf_counter() - t
        upkeep.after_round()
        out.put((took, len(st), sorted({s.state for s in st.values()}), _rss_mb()))


def _poster(jobs: int, steps: int, active: int, url: str, cmds, out, code: str | None = None) -> None:
    """In a fresh process running `code`'s package (None: this tree's): seed the jobs' history,
    end the runs of all but the first `active` jobs (every rank's `run end`), then post each
    round's events of the active ones when told (round k: 5 new steps a job, numbered on from
    the history's), replying when they are in. Each tree writes its own keys and protocol."""
    if code is not None:
        sys.path.insert(0, code)
    import redis

    from costexporter.store import keys, protocol

    seqs0 = _post_jobs(jobs, steps, url)
    client = redis.Redis.from_url(url, decode_responses=True)
    names = [f"w{i}" for i in range(jobs)]
    seqs = {n: dict(seqs0) for n in names}
    cap = protocol.beats_cap(RANKS)
    pipe = client.pipeline(transaction=False)
    for n in names[active:]:  # ended after their history, as most of a day's jobs have
        for r in (0, 1):
            seq = seqs[n].get(r, 0)
            seqs[n][r] = seq + 1
            base = {"v": "1", "type": "run", "job": n, "ts": f"{T0 + steps + 0.5:.3f}", "rank": r}
            end = {**base, "session": f"s{r}", "seq": seq, "state": "end"}
            pipe.xadd(keys.stream_key(PREFIX, n), protocol.encode_fields(end))
            pipe.zadd(keys.jobs_key(PREFIX), {n: T0 + steps + 0.5}, gt=True)
    pipe.execute()
    out.put("seeded")
    while (k := cmds.get()) is not None:
        a = steps + 5 * k + 1
        pipe = client.pipeline(transaction=False)
        for n in names[:active]:  # where the reporter sends them: heartbeats to their own stream
            for e in _entries(n, a, a + 4, seqs[n], beats_apart=True):
                if e["type"] == "heartbeat":
                    pipe.xadd(keys.beats_key(PREFIX, n), e, maxlen=cap, approximate=True)
                else:
                    pipe.xadd(keys.stream_key(PREFIX, n), e)
        pipe.execute()
        out.put(k)


def _watch(jobs: int, steps: int, shards: int, active: int, code: dict[str, str | None]) -> dict[str, dict]:
    """Poll times of `shards` watcher processes sharing `jobs` jobs of `steps` steps each, all
    polling at once after the same new events: ten 5-s polls, 5 new steps each of the `active`
    jobs (the others' runs ended; ten more polls where some are: their rechecks). Each
    variant of `code` (name -> package directory, None: this tree) has a Redis of its own,
    seeded and fed by its own code (a baseline reads the keys and protocol it wrote), the
    variants polling in turns after each round of events, in alternating order."""
    ctx = multiprocessing.get_context("spawn")
    redises = {name: _redis() for name in code}
    kids: dict[str, list] = {name: [] for name in code}
    posters: dict[str, tuple] = {}
    try:
        for name, root in code.items():
            url = redises[name][1]
            cmds, out = ctx.Queue(), ctx.Queue()
            p = ctx.Process(target=_poster, args=(jobs, steps, active, url, cmds, out, root))
            p.start()
            posters[name] = (p, cmds, out)
            if out.get(timeout=3600) != "seeded":
                raise RuntimeError(f"{name}: seeding failed")
            for i in range(shards):
                cmds_w, out_w = ctx.Queue(), ctx.Queue()
                w = ctx.Process(target=_watch_shard, args=((i, shards), url, cmds_w, out_w, root))
                w.start()
                kids[name].append((w, cmds_w, out_w))

        def poll(name: str, now: float) -> list[tuple]:
            for _, cmds, _ in kids[name]:
                cmds.put(now)
            return [out.get(timeout=1800) for _, _, out in kids[name]]

        clock = T0 + steps + 1
        first = {name: poll(name, clock) for name in code}
        polls: dict[str, list] = {name: [] for name in code}
        for k in range(10 if active == jobs else 20):
            clock += 5
            for _, cmds, _ in posters.values():
                cmds.put(k)
            for _, _, out in posters.values():
                out.get(timeout=600)
            for name in list(code) if k % 2 == 0 else list(code)[::-1]:
                polls[name].append(poll(name, clock))
        out_rows: dict[str, dict] = {}
        for name in code:
            per_poll = [max(r[0] for r in got) for got in polls[name]]  # the slowest shard's poll
            last = polls[name][-1]
            out_rows[name] = {
                "jobs": jobs,
                "active": active,
                "steps": steps,
                "shards": shards,
                "first_s": max(r[0] for r in first[name]),
                "poll_ms": statistics.median(per_poll) * 1000,
                "max_ms": max(per_poll) * 1000,  # the polls that also bring every rank's heartbeats
                "rss_mb": max(r[3] for r in last),
                "per_shard": [r[1] for r in last],
                "states": sorted({s for r in last for s in r[2]}),
            }
        return out_rows
    finally:
        for lst in [*kids.values(), list(posters.values())]:
            for _, cmds, _ in lst:
                cmds.put(None)
        for lst in [*kids.values(), list(posters.values())]:
            for p, _, _ in lst:
                p.join(60)
                if p.is_alive():
                    p.kill()
        for proc, _url, d in redises.values():
            proc.terminate()
            proc.wait(10)
            shutil.rmtree(d, ignore_errors=True)


def _post_jobs(jobs: int, steps: int, url: str) -> dict:
    """Every job's registrations and history, heartbeats where the reporter sends them; returns
    the next seq number of each rank's events and heartbeats."""
    import redis

    from costexporter.sources.synth import TraceBuilder
    from costexporter.store import protocol
    from costexporter.trainer.transport import send_entries

    def event_entry(e) -> dict[str, str]:  # a synthetic trace's event as a trainer sends it
        base = {"v": "1", "type": e.type, "job": e.job, "ts": f"{e.ts:.3f}", "rank": e.rank}
        return protocol.encode_fields({**base, "session": e.session, "seq": e.seq, **e.fields})

    client = redis.Redis.from_url(url, decode_responses=True)
    for i in range(jobs):
        n = f"w{i}"
        reg = TraceBuilder(n_gpus=2, per_host=2, job=n, seed=1, interval_s=1.0, t0=T0)
        send_entries(client, PREFIX, n, [event_entry(e) for e in reg.events])
        seqs: dict = {0: 1, 1: 1}
        for a in range(1, steps + 1, 20_000):
            history = _entries(n, a, min(a + 19_999, steps), seqs, beats_apart=True)
            send_entries(client, PREFIX, n, history, beats_cap=protocol.beats_cap(RANKS))
    return seqs


def parse_shapes(text: str) -> list[tuple[int, int, int, int]]:
    """'1000x1000,1000x1000/2,10000x100:1000' -> [(jobs, steps per job, watcher shards, jobs
    running: the rest ended)]."""
    out = []
    for x in text.split(","):
        shape, _, shards = x.partition("/")
        shape, _, active = shape.partition(":")
        jobs, steps = map(int, shape.split("x"))
        out.append((jobs, steps, int(shards or 1), int(active or jobs)))
    return out


def measure_watcher(shapes: list[tuple[int, int, int, int]], baseline: str | None = None) -> list[dict]:
    """Watcher poll time per (jobs, steps per job, shards), each on a private Redis; with a
    `baseline` git revision, that revision's watcher's beside this tree's (its rows named)."""
    if baseline is None:
        return [_watch(*shape, {"this tree": None})["this tree"] for shape in shapes]
    from bench_replay import _export

    with tempfile.TemporaryDirectory(prefix="watch-baseline-") as tmp:
        code = {"this tree": None, baseline: str(_export(baseline, Path(tmp)))}
        rows = []
        for shape in shapes:
            for name, r in _watch(*shape, code).items():
                rows.append({**r, "variant": name})
        return rows


# the targets, per (jobs, steps per job, jobs running)
WATCHER_TARGET_MS = {(1000, 1000, 1000): 100, (1, 100_000, 1): 20, (10_000, 100, 1000): 500}
WATCHER_TARGET_RSS_MB = {(10_000, 100, 1000): 200}


def report_watcher(res: list[dict]) -> None:
    print(
        "watcher poll (target: 1,000 running jobs x 1k steps <= 100 ms; 1 job x 100k steps <= 20 ms; "
        "10,000 jobs, 1,000 running, <= 500 ms and RSS <= 200 MB; with shards: the slowest "
        "shard's poll, all polling at once)"
    )
    head = (
        f"{'jobs':>6} {'running':>7} {'steps/job':>10} {'shards':>6} {'poll ms':>8} {'target':>14} "
        f"{'max ms':>7} {'first poll s':>13} {'RSS MB':>7}"
    )
    print(f"  {head}  jobs per shard, states")
    for r in res:
        shape = (r["jobs"], r["steps"], r["active"])
        target = WATCHER_TARGET_MS.get(shape)
        rss = WATCHER_TARGET_RSS_MB.get(shape)
        verdict = "" if target is None else f"<= {target} " + ("MET" if r["poll_ms"] <= target else "MISSED")
        if rss is not None:
            verdict += f"; RSS <= {rss} " + ("MET" if r["rss_mb"] <= rss else "MISSED")
        if r.get("variant") not in (None, "this tree"):
            verdict = "(baseline)"
        print(
            f"  {r['jobs']:>6} {r['active']:>7} {r['steps']:>10} {r['shards']:>6} {r['poll_ms']:>8.1f} "
            f"{verdict:>14} {r['max_ms']:>7.1f} {r['first_s']:>13.2f} {r['rss_mb']:>7.0f}  "
            f"{'+'.join(map(str, r['per_shard']))}, {','.join(r['states'])}"
            + (f"  [{r['variant']}]" if "variant" in r else "")
        )


if __name__ == "__main__":
    main()
