"""Synthetic traces shaped like the B300 power-band table (R2 in docs/background.md): a
scenario of stretches in, samples and events out.

Used by the tests, the benchmark and the shipped example; the `sim` source builds on it. Power
and utilization per state follow the B300 triage table (R2) with a little noise.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from costexporter.core.model import Event, GpuId, Samples
from costexporter.core.timeutil import to_ms, to_ms_array

# (power low, power high, util low, util high) per state, from the B300 table (R2, docs/background.md).
STATES = {
    "compute": (940.0, 1040.0, 100.0, 100.0),
    "communication": (630.0, 650.0, 100.0, 100.0),
    "starvation": (560.0, 590.0, 85.0, 100.0),
    "deadlock": (190.0, 195.0, 100.0, 100.0),
    "checkpoint": (188.0, 196.0, 100.0, 100.0),
    "idle": (130.0, 140.0, 0.0, 0.0),
    "crashloop": (130.0, 1000.0, 0.0, 100.0),
}


@dataclass
class TraceBuilder:
    """Builds a job's trace stretch by stretch. Rank r trains on GPU r % per_host of host r // per_host."""

    n_gpus: int = 16
    per_host: int = 8
    interval_s: float = 1.0
    t0: float = 1_753_570_000.0  # 2025-07-26 22:46:40 UTC
    job: str = "r1"
    seed: int = 0
    register: bool = True
    host_prefix: str = "node"
    gpu_name: str = "NVIDIA B300"
    # state -> (W lo, W hi, % lo, % hi)
    states: dict[str, tuple[float, float, float, float]] = field(default_factory=lambda: dict(STATES))
    t: float = field(init=False)
    step: int = field(init=False, default=0)
    _rows: list[tuple[np.ndarray, ...]] = field(init=False, default_factory=list)  # ranks, ts, power, util
    events: list[Event] = field(init=False, default_factory=list)
    _seq: dict[int, int] = field(init=False, default_factory=dict)
    _generation: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.t = self.t0
        self.rng = np.random.default_rng(self.seed)
        if self.register:
            self._register_all(pid_base=1000)

    def _register_all(self, pid_base: int) -> None:
        """Every rank registers its host, GPU and process (pids from `pid_base`: a new generation
        of processes has new pids)."""
        for r in range(self.n_gpus):
            self.register_rank(r, r, pid_base + r)

    def register_rank(self, rank: int, slot: int, pid: int, world_size: int | None = None) -> TraceBuilder:
        """Rank `rank` registers the GPU that rank `slot` trains on by default (its host, index
        and UUID) from process `pid`: a rank that comes back on another GPU, two on one."""
        h, g = self.host_of(slot)
        self.event(
            "register",
            rank=rank,
            host=h,
            gpu=g,
            gpu_uuid=self.uuid(slot),
            local_rank=g,
            world_size=world_size or self.n_gpus,
            pid=pid,
        )
        return self

    def host_of(self, rank: int) -> tuple[str, int]:
        return f"{self.host_prefix}{rank // self.per_host}", rank % self.per_host

    def uuid(self, rank: int) -> str:
        return f"GPU-{self.seed:04x}{rank:04x}-0000-4000-8000-{rank:012x}"

    def event(self, type: str, rank: int = 0, ts: float | None = None, **fields: object) -> None:
        seq = self._seq.get(rank, 0)
        self._seq[rank] = seq + 1
        self.events.append(
            Event(
                type,
                self.job,
                to_ms(self.t if ts is None else ts),
                rank,
                f"s{rank}" if not self._generation else f"s{rank}.{self._generation}",
                seq,
                {k: v for k, v in fields.items() if v is not None},
            )
        )

    # Run and phase markers --------------------------------------------------------------
    def run(self, state: str, step: int | None = None) -> TraceBuilder:
        self.event("run", state=state, step=step)
        if state == "resume" and step is not None:
            self.step = step
        return self

    def new_processes(self, register: bool = True) -> TraceBuilder:
        """The job's processes start again (a requeue, a resume): new reporter sessions, their
        entries numbered from 0, each rank registering again."""
        self._generation += 1
        self._seq.clear()
        if register:
            self._register_all(pid_base=2000)
        return self

    def phase(self, name: str, state: str, rank: int = 0, step: int | None = None) -> TraceBuilder:
        self.event("phase", rank=rank, name=name, state=state, step=step)
        return self

    def meta(self, **fields: object) -> TraceBuilder:
        self.event("meta", 0, None, **fields)
        return self

    # Stretches ---------------------------------------------------------------------------
    def stretch(
        self,
        state: str,
        duration_s: float,
        *,
        step_s: float | None = None,
        tokens: int | None = None,
        zero_ranks: tuple[int, ...] = (),
        straggler: int | None = None,
        step_ranks: tuple[int, ...] = (0,),
        gpus: tuple[int, ...] | None = None,
    ) -> TraceBuilder:
        """`duration_s` of one state on every GPU; steps every `step_s` posted by `step_ranks`."""
        n_t = max(round(duration_s / self.interval_s), 0)
        ts = self.t + np.arange(n_t) * self.interval_s
        ranks = np.arange(self.n_gpus) if gpus is None else np.asarray(gpus)
        p_lo, p_hi, u_lo, u_hi = self.states[state]
        shape = (ranks.size, n_t)
        power = self.rng.uniform(p_lo, p_hi, shape)
        util = self.rng.uniform(u_lo, u_hi, shape).round()
        if state == "crashloop":  # restarts: busy a while, then down
            busy = (np.arange(n_t) // max(1, int(60 / self.interval_s))) % 3 != 2
            power = np.where(busy, self.rng.uniform(700, 1000, shape), 135.0)
            util = np.where(busy, self.rng.uniform(30, 100, shape).round(), 0.0)
        for z in zero_ranks:
            util[ranks == z] = 0.0
        if straggler is not None:
            util[ranks == straggler] = self.rng.uniform(55, 65, (1, n_t)).round()
        self._rows.append((ranks, ts, power, util))
        if step_s:
            k = 1
            while k * step_s <= duration_s + 1e-9:
                self.step += 1
                for r in step_ranks:
                    self.event(
                        "step",
                        rank=r,
                        ts=self.t + k * step_s,
                        step=self.step,
                        tokens=tokens if r == 0 else None,
                    )
                k += 1
        self.t += n_t * self.interval_s
        return self

    def synchronous(
        self,
        steps: int,
        compute_s: float,
        comm_s: float,
        *,
        slow: dict[int, float] | None = None,
        jitter: float = 0.02,
        average: bool = False,
        tokens: int | None = None,
    ) -> float:
        """`steps` data-parallel steps on every GPU: each rank computes `compute_s` (rank r
        `1 + slow[r]` times longer; every rank's every step +-`jitter`), spins in the collective at
        low power and ~100% until the slowest is done, then all communicate `comm_s`; rank 0 posts
        each step. Readings every `interval_s`: instantaneous, or (`average`) the mean power over
        the interval before, as NVML's 1-s average reads. Returns the what-if: the GPU-seconds the
        job would not have held had the slow ranks been as fast as the rest."""
        fine = 0.01  # s: the grid the GPUs' states are drawn on before they are read
        slow = slow or {}
        n = self.n_gpus
        c = compute_s * (1 + self.rng.uniform(-jitter, jitter, (steps, n)))
        base = c.max(1)
        for r, x in slow.items():
            c[:, r] *= 1 + x
        saved = float(n * (c.max(1) - base).sum())
        step_len = c.max(1) + comm_s
        edges = np.concatenate([[0.0], np.cumsum(step_len)])
        n_fine = int(np.ceil(edges[-1] / fine))
        t = (np.arange(n_fine) + 0.5) * fine
        k = np.minimum(np.searchsorted(edges, t, side="right") - 1, steps - 1)
        into = t - edges[k]
        lo, hi = self.states["compute"][:2]
        level = {s: (self.states[s][0] + self.states[s][1]) / 2 for s in ("deadlock", "communication")}
        power = np.empty((n, n_fine))
        for r in range(n):
            computing = into < c[k, r]
            waiting = ~computing & (into < c[k].max(1))
            power[r] = np.where(
                computing,
                self.rng.uniform(lo, hi, n_fine),
                np.where(waiting, level["deadlock"], level["communication"]),
            )
        per = max(round(self.interval_s / fine), 1)
        n_t = n_fine // per
        if average:
            read = power[:, : n_t * per].reshape(n, n_t, per).mean(2)
        else:
            read = power[:, per - 1 : n_t * per : per]
        ts = self.t + (np.arange(n_t) + 1) * per * fine
        self._rows.append((np.arange(n), ts, read, np.full((n, n_t), 100.0)))
        for i in range(steps):
            self.step += 1
            self.event("step", rank=0, ts=self.t + edges[i + 1], step=self.step, tokens=tokens)
        self.t += n_t * per * fine
        return saved

    def gap(self, duration_s: float) -> TraceBuilder:
        """Time passes with no samples from any GPU."""
        self.t += duration_s
        return self

    # Output ------------------------------------------------------------------------------
    def gpu_ids(self) -> list[GpuId]:
        return [GpuId(*self.host_of(r), uuid=self.uuid(r), name=self.gpu_name) for r in range(self.n_gpus)]

    def samples(self, energy_counter: bool = False) -> Samples:
        gpu = (
            np.concatenate([np.repeat(r, ts.size) for r, ts, _, _ in self._rows])
            if self._rows
            else np.zeros(0, int)
        )
        ts = (
            np.concatenate([np.tile(ts, r.size) for r, ts, _, _ in self._rows]) if self._rows else np.zeros(0)
        )
        pw = np.concatenate([p.ravel() for _, _, p, _ in self._rows]) if self._rows else np.zeros(0)
        ut = np.concatenate([u.ravel() for _, _, _, u in self._rows]) if self._rows else np.zeros(0)
        s = Samples(
            self.gpu_ids(),
            gpu.astype(np.int32),
            to_ms_array(ts),
            pw.round(2),
            ut,
            np.full(gpu.size, np.nan),
        ).sort()
        if energy_counter:
            e = np.zeros(len(s))
            for g in range(self.n_gpus):
                m = s.gpu == g
                dt_ms = np.diff(s.ts_ms[m], prepend=s.ts_ms[m][:1])
                e[m] = np.cumsum(s.power_w[m] * dt_ms)
            s.energy_mj = e
        return s

    def write_events(self, path: Path) -> Path:
        return write_events_jsonl(self.events, path)


def write_events_jsonl(events: list[Event], path: Path) -> Path:
    """Events as protocol v1 JSONL, in time order."""
    import json

    with path.open("w") as f:
        for e in sorted(events, key=lambda e: e.ts_ms):
            d = {
                "v": "1",
                "type": e.type,
                "job": e.job,
                "ts": e.ts,
                "rank": e.rank,
                "session": e.session,
                "seq": e.seq,
                **e.fields,
            }
            f.write(json.dumps(d) + "\n")
    return path


def _offset_s(ts: int, tz: dt.tzinfo) -> float:
    """The zone's UTC offset at Unix second `ts`, in seconds."""
    off = dt.datetime.fromtimestamp(ts, tz).utcoffset()
    assert off is not None  # fromtimestamp() with a zone refuses one whose offset is None
    return off.total_seconds()


def _local_stamps(ts_ms: np.ndarray, tz: dt.tzinfo | None) -> np.ndarray:
    """nvidia-smi's timestamp text ('2025/07/26 23:53:30.945') in zone `tz` (None: UTC)."""
    if tz is None:
        local = ts_ms
    else:  # the zone's offset per distinct second, DST included
        secs, inv = np.unique(ts_ms // 1000, return_inverse=True)
        off = np.array([_offset_s(int(x), tz) for x in secs])
        local = ts_ms + (off[inv] * 1000).astype(np.int64)
    text = np.datetime_as_string(local.astype("datetime64[ms]"), unit="ms")
    return np.char.replace(np.char.replace(text, "-", "/"), "T", " ")


def write_nvidia_smi_csv(
    samples: Samples,
    directory: Path,
    *,
    units: bool = True,
    index: bool = True,
    uuid: bool = True,
    tz: dt.tzinfo | None = None,
    name: bool = False,
) -> list[Path]:
    """One nvidia-smi-style CSV per host, rows grouped by sampling instant like the real tool."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for host in sorted({g.host for g in samples.gpus}):
        gids = [i for i, g in enumerate(samples.gpus) if g.host == host]
        sel = np.isin(samples.gpu, gids)
        order = np.lexsort((samples.gpu[sel], samples.ts_ms[sel]))
        g = samples.gpu[sel][order]
        w, pct = (" W", " %") if units else ("", "")
        cols = [_local_stamps(samples.ts_ms[sel][order], tz)]
        header = ["timestamp"]
        if name:
            cols.append(np.array([samples.gpus[i].name or "" for i in range(len(samples.gpus))])[g])
            header.append("name")
        if index:
            cols.append(np.array([samples.gpus[i].index for i in range(len(samples.gpus))])[g].astype(str))
            header.append("index")
        if uuid:
            cols.append(np.array([samples.gpus[i].uuid or "" for i in range(len(samples.gpus))])[g])
            header.append("uuid")
        power = samples.power_w[sel][order]
        util = samples.util_pct[sel][order]
        cols.append(np.char.add(np.char.mod("%.2f", power), w))
        cols.append(np.char.add(np.char.mod("%.0f", util), pct))
        header += ["power.draw [W]", "utilization.gpu [%]"]
        rows = cols[0]
        for c in cols[1:]:
            rows = np.char.add(np.char.add(rows, ", "), c)
        path = directory / f"{host}.csv"
        path.write_text(", ".join(header) + "\n" + "\n".join(rows.tolist()) + "\n")
        paths.append(path)
    return paths


def write_samples_jsonl(samples: Samples, path: Path) -> Path:
    """The JSONL sample form: {"ts", "host", "gpu", "uuid", "power_w", "util_pct", "energy_mj"?}."""
    import json

    with path.open("w") as f:
        for gi, t, p, u, e in zip(
            samples.gpu.tolist(),
            samples.ts_ms.tolist(),
            samples.power_w.tolist(),
            samples.util_pct.tolist(),
            samples.energy_mj.tolist(),
            strict=True,
        ):
            g = samples.gpus[gi]
            d = {"ts": t / 1000, "host": g.host, "gpu": g.index, "uuid": g.uuid, "power_w": p, "util_pct": u}
            if e == e:
                d["energy_mj"] = e
            f.write(json.dumps(d) + "\n")
    return path


def r1_incident(
    interval_s: float = 1.0, steps: int = 3850, step_s: float = 5.0, deadlock_h: float = 3.0, seed: int = 1
) -> TraceBuilder:
    """R1 (docs/background.md): 16 B300 on two hosts, ~5 h of ~5 s steps, then the end-of-epoch checkpoint
    that deadlocks for 3 h with rank 3 at 0% (it entered the save barrier; the rest wait in the
    gradient all-reduce). The NCCL watchdog kills the job: no run end."""
    b = TraceBuilder(n_gpus=16, per_host=8, interval_s=interval_s, job="qwen3-32b-ft", seed=seed)
    b.meta(gpu_model="NVIDIA B300")  # the owner is the operator's (demo.DEMO_OWNERS)
    b.run("start")
    b.stretch("compute", steps * step_s, step_s=step_s, tokens=8 * 2048 * 16)
    b.phase("checkpoint", "begin", rank=3, step=steps)
    b.stretch("deadlock", deadlock_h * 3600, zero_ranks=(3,))
    return b


def scenario_mini(seed: int = 3) -> TraceBuilder:
    """Every kind of time in 40 minutes on 4 GPUs over 2 hosts: compute, a communication-bound
    stretch, a straggler, a checkpoint, a deadlock on rank 1, an idle gap, a crash loop with
    restarts, and a resume from an earlier checkpoint."""
    b = TraceBuilder(n_gpus=4, per_host=2, job="sim-mini", seed=seed, host_prefix="sim-node")
    b.meta(gpu_model="NVIDIA B300")  # the owner is the operator's (demo.DEMO_OWNERS)
    b.run("start")
    b.stretch("compute", 300, step_s=5, tokens=65_536)
    b.stretch("communication", 120, step_s=8, tokens=65_536)
    b.stretch("starvation", 120, step_s=8, tokens=65_536, straggler=2)
    b.phase("checkpoint", "begin")
    b.stretch("checkpoint", 60, zero_ranks=(0,))
    b.phase("checkpoint", "end", step=b.step)
    saved = b.step
    b.stretch("compute", 300, step_s=5, tokens=65_536)
    b.stretch("deadlock", 300, zero_ranks=(1,))
    b.stretch("idle", 120)
    for _ in range(3):  # the watchdog killed it; the scheduler restarts it, it crashes again
        b.run("start")
        b.stretch("crashloop", 120)
    b.run("resume", step=saved)
    b.stretch("compute", 300, step_s=5, tokens=65_536)
    b.run("end")
    b.stretch("idle", 10)
    return b


def scenario_r1_story(seed: int = 1) -> TraceBuilder:
    """R1 then R7 (docs/background.md), on 16 B300 over two hosts (the demo's story): healthy compute, a
    communication-bound stretch, a straggler, the end-of-epoch checkpoint that deadlocks on rank 3
    until the watchdog; then a restart whose checkpoint write hangs, a crash loop, and a resume
    from an earlier checkpoint."""
    b = TraceBuilder(n_gpus=16, per_host=8, job="qwen3-32b-ft", seed=seed, interval_s=1.0)
    # the owner is the operator's (demo.DEMO_OWNERS); the run's steps, for its cost to finish
    b.meta(gpu_model="NVIDIA B300", total_steps=4000)
    b.run("start")
    b.stretch("compute", 2 * 3600, step_s=5, tokens=262_144)
    b.stretch("communication", 1200, step_s=7, tokens=262_144)
    b.stretch("starvation", 1200, step_s=7, tokens=262_144, straggler=11)
    b.phase("checkpoint", "begin")
    b.stretch("checkpoint", 240, zero_ranks=(0,))
    b.phase("checkpoint", "end", step=b.step)
    saved = b.step
    b.stretch("compute", 1800, step_s=5, tokens=262_144)
    b.phase("checkpoint", "begin", rank=3, step=b.step)
    b.stretch("deadlock", 3 * 3600, zero_ranks=(3,))
    b.run("resume", step=saved)
    b.stretch("compute", 900, step_s=5, tokens=262_144)
    b.phase("checkpoint", "begin")
    b.stretch("checkpoint", 1800, zero_ranks=(0,))  # the 3 a.m. NFS write that hangs (R7)
    for _ in range(4):
        b.run("start")
        b.stretch("crashloop", 300)
    b.run("resume", step=saved)
    b.stretch("compute", 1200, step_s=5, tokens=262_144)
    b.run("end")
    b.stretch("idle", 30)
    return b


SCENARIOS = {"mini": scenario_mini, "r1": scenario_r1_story}
