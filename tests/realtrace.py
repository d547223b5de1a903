"""A generator of real-like 100 ms nvidia-smi traces with per-sample labels.

The project's `synth` draws clean, flat stretches; real recordings are messier, and the
classification and `calibrate` must hold on what real files look like:

* 100 ms sampling of 8 GPUs; each line stamped a few ms apart, and sometimes the GPU 0 line of an
  instant stamped 50-80 ms before GPUs 1-7;
* power ramps over 1-3 samples between levels (values between bands are real), and rare noise
  tails that bridge levels;
* with `ramp_s`, slow ramps into compute: after the climb, power rises from ~72% to ~90% of the
  compute level over 0.5-1.5 s (an H100 at 400-500 W) at compute's utilization, labelled compute;
* occasional 0.3-1 s gaps where the logger wrote nothing (the GPUs kept drawing power);
* checkpoint waits: rank 0 at 0-5 % and ~120-150 W writing, ranks 1-7 at 100 % and ~150-165 W;
* an energy counter (mJ) integrating the true power, quantized to its own step;
* per-sample labels: the state each GPU was really in (what a careful human labels).

`Scenario.h100()` and `Scenario.b300()` give the levels of two GPU models.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from costexporter.core.model import Band, Event, GpuId, Samples
from costexporter.core.timeutil import to_ms
from costexporter.sources.synth import _local_stamps, write_events_jsonl

# state -> (power centre W, power sd W, util lo %, util hi %), per rank class (rank 0, others).
LevelTable = dict[str, tuple[tuple[float, float, float, float], tuple[float, float, float, float]]]

H100_LEVELS: LevelTable = {
    # The first 0.5-1 s of a checkpoint wait (when onset plateaus are on): rank 0 at ~218 W and
    # 0% while the others wait at ~230 W and 100%, above the waiters' level, before it settles.
    "onset": ((218.0, 4.0, 0.0, 2.0), (230.0, 3.0, 100.0, 100.0)),
    "compute": ((555.0, 12.0, 84.0, 97.0), (555.0, 12.0, 84.0, 97.0)),
    "checkpoint": ((135.0, 7.0, 0.0, 5.0), (157.0, 3.5, 100.0, 100.0)),
    "idle": ((98.0, 9.0, 0.0, 0.0), (98.0, 9.0, 0.0, 0.0)),
    "communication": ((330.0, 10.0, 100.0, 100.0), (330.0, 10.0, 100.0, 100.0)),
}
# R2's table at B300 levels, with the same real-trace mess.
B300_LEVELS: LevelTable = {
    "compute": ((990.0, 20.0, 95.0, 100.0), (990.0, 20.0, 95.0, 100.0)),
    "communication": ((640.0, 6.0, 100.0, 100.0), (640.0, 6.0, 100.0, 100.0)),
    "checkpoint": ((185.0, 3.0, 0.0, 5.0), (193.0, 1.5, 100.0, 100.0)),
    "idle": ((135.0, 3.0, 0.0, 0.0), (135.0, 3.0, 0.0, 0.0)),
}

LABEL_BAND = {
    "compute": Band.COMPUTE,
    "communication": Band.COMMUNICATION,
    "checkpoint": Band.CHECKPOINT,
    "idle": Band.IDLE,
}


@dataclass
class RealTrace:
    samples: Samples  # sorted by (gpu, ts)
    labels: np.ndarray  # per sample (same order): the true state name
    truth_power: np.ndarray  # per sample: the level's centre (before ramps and noise)
    events: list[Event]
    true_energy_mj: np.ndarray  # per GPU: energy really used from the first to the last sample
    instant_of_line: np.ndarray  # CSV line order: (instant, gpu) of each written line
    gap_ms: int  # total time inside logger gaps (per GPU)
    line_sample: np.ndarray | None = None  # CSV line order: the sample each line holds
    memory_mib: np.ndarray | None = None  # per sample: memory.used (with `memory`)
    slow_ramp: np.ndarray | None = None  # per sample: inside a slow ramp into compute (`ramp_s`)
    onset: np.ndarray | None = None  # per sample: inside a checkpoint wait's onset plateau (`onset_s`)
    phases: list[tuple[str, int, int]] = field(default_factory=list)  # (state, first ms, end ms)
    phase_energy_mj: np.ndarray | None = None  # phases x GPUs: energy really used in each phase

    def label_bands(self) -> np.ndarray:
        return np.asarray([LABEL_BAND[x] for x in self.labels], np.int8)


@dataclass
class Scenario:
    """A run: idle, then compute with steps, checkpoint waits every so often, idle at the end."""

    levels: LevelTable = field(default_factory=lambda: dict(H100_LEVELS))
    gpu_name: str = "NVIDIA H100 80GB HBM3"
    n_gpus: int = 8
    interval_ms: int = 100
    compute_s: float = 90.0  # between checkpoints
    checkpoint_s: float = 8.0
    checkpoints: int = 3
    idle_s: float = 15.0
    comm_s: float = 0.0  # a communication stretch after each compute stretch (0: none)
    step_s: float = 2.0
    gap_every_s: float = 45.0  # mean time between logger gaps
    jitter_p: float = 0.1  # share of instants whose GPU 0 line is stamped 50-80 ms early
    tail_p: float = 0.001  # share of samples drawn from a tail that bridges levels
    energy_quantum_mj: float = 1000.0  # the counter's own step (1 J)
    # The real files' harder features (off by default; `Scenario.field` turns them on):
    burst_p: float = 0.0  # share of instants written in two bursts ~110 ms apart
    onset_s: tuple[float, float] = (0.0, 0.0)  # a checkpoint wait's onset plateau, s (lo, hi)
    gap_s: tuple[float, float] = (0.3, 1.0)  # a logger hiccup's length, s (lo, hi)
    ramp_s: tuple[float, float] = (0.0, 0.0)  # a slow ramp into compute after the climb, s (lo, hi)
    vanish: tuple[int, float, float] | None = None  # (GPU, from s, for s): it writes no lines
    memory: bool = False  # a memory.used column: each GPU's own, drifting slowly
    offsets_w: tuple[float, ...] | None = None  # per GPU: its steady power above its level's centre
    seed: int = 0
    t0: float = 1_753_577_230.134  # 2025-07-27 00:47:10.134 UTC

    @classmethod
    def h100(cls, **kw) -> Scenario:
        return cls(**kw)

    @classmethod
    def field(cls, **kw) -> Scenario:
        """Every feature of the real 8xH100 recordings: instants written in bursts, onset plateaus
        of checkpoint waits, ramps (slow ones into compute), logger hiccups of 0.3-0.5 s, a GPU
        missing for a minute, memory.used per GPU."""
        kw.setdefault("burst_p", 0.02)
        kw.setdefault("ramp_s", (0.5, 1.5))
        kw.setdefault("onset_s", (0.5, 1.0))
        kw.setdefault("gap_s", (0.3, 0.5))
        kw.setdefault("gap_every_s", 20.0)
        kw.setdefault("compute_s", 150.0)
        kw.setdefault("vanish", (3, kw.get("idle_s", 15.0) + 40.0, 60.0))
        kw.setdefault("memory", True)
        return cls(**kw)

    @classmethod
    def b300(cls, **kw) -> Scenario:
        kw.setdefault("comm_s", 20.0)
        return cls(levels=dict(B300_LEVELS), gpu_name="NVIDIA B300", **kw)

    def plan(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = [("idle", self.idle_s)]
        for _ in range(self.checkpoints):
            out.append(("compute", self.compute_s))
            if self.comm_s:
                out.append(("communication", self.comm_s))
            out.append(("checkpoint", self.checkpoint_s))
        out.append(("compute", self.compute_s))
        out.append(("idle", self.idle_s))
        return out

    def build(self) -> RealTrace:
        rng = np.random.default_rng(self.seed)
        iv = self.interval_ms
        plan = self.plan()
        n_inst = int(sum(round(d * 1000 / iv) for _, d in plan))
        state = np.empty(n_inst, object)
        bounds = []  # (state, first instant, end instant)
        i = 0
        for name, d in plan:
            k = round(d * 1000 / iv)
            state[i : i + k] = name
            bounds.append((name, i, i + k))
            i += k
        t_inst = self.t0 * 1000 + np.arange(n_inst) * iv  # true instants (ms, float)

        # Logger gaps: whole instants with no lines.
        logged = np.ones(n_inst, bool)
        n_gaps = max(1, int(n_inst * iv / 1000 / self.gap_every_s))
        lo, hi = (round(x * 1000 / iv) for x in self.gap_s)
        for start in rng.integers(50, n_inst - 50, n_gaps):
            logged[start : start + int(rng.integers(lo, hi + 1))] = False

        G = self.n_gpus
        power = np.empty((G, n_inst))
        util = np.empty((G, n_inst))
        centre = np.empty((G, n_inst))
        onset = np.zeros(n_inst, bool)
        ramping = np.zeros((G, n_inst), bool)
        if self.onset_s[1] > 0 and "onset" in self.levels:
            for name, a, b in bounds:
                if name == "checkpoint":
                    k = round(rng.uniform(*self.onset_s) * 1000 / iv)
                    onset[a : min(a + k, b)] = True
        for g in range(G):
            cls_ = 0 if g == 0 else 1
            for name, a, b in bounds:
                c, sd, ulo, uhi = self.levels[name][cls_]
                if self.offsets_w is not None and name != "idle":
                    c += self.offsets_w[g]
                centre[g, a:b] = c
                power[g, a:b] = rng.normal(c, sd, b - a)
                util[g, a:b] = rng.uniform(ulo, uhi, b - a).round()
            if onset.any():
                c, sd, ulo, uhi = self.levels["onset"][cls_]
                k = int(onset.sum())
                centre[g, onset] = c
                power[g, onset] = rng.normal(c, sd, k)
                util[g, onset] = rng.uniform(ulo, uhi, k).round()
            # Ramps: 1-3 samples after each level change move linearly from the old level; with
            # `ramp_s`, a climb into compute goes on slowly from ~72% to ~90% of the compute level.
            for (_, _, e), (name2, a2, b2) in itertools.pairwise(bounds):
                k = int(rng.integers(1, 4))
                old, new = centre[g, e - 1], centre[g, a2]
                slow = 0
                if self.ramp_s[1] > 0 and name2 == "compute" and old < new:
                    slow = min(round(rng.uniform(*self.ramp_s) * 1000 / iv), b2 - a2 - k)
                    new = 0.72 * new
                for j in range(k):
                    if a2 + j < n_inst:
                        power[g, a2 + j] = old + (new - old) * (j + 1) / (k + 1) + rng.normal(0, 3)
                if slow > 0:
                    c = centre[g, a2]
                    rise = 0.72 + 0.18 * np.arange(1, slow + 1) / slow
                    power[g, a2 + k : a2 + k + slow] = c * rise + rng.normal(0, 5, slow)
                    ramping[g, a2 : a2 + k + slow] = True
            # Noise tails: a rare sample far from its level, possibly between bands.
            tail = rng.random(n_inst) < self.tail_p
            power[g, tail] += (
                rng.choice([-1, 1], tail.sum()) * rng.uniform(0.1, 0.3, tail.sum()) * centre[g, tail]
            )
        power = np.clip(power, 20.0, None).round(2)

        # The energy counter integrates the true power across every instant (gaps included).
        cum = np.cumsum(power * iv, axis=1)  # energy at the end of each instant's 100 ms
        counter = np.floor((cum - power * iv) / self.energy_quantum_mj) * self.energy_quantum_mj

        # Stamps: a few ms apart per GPU line; sometimes GPU 0 is 50-80 ms early.
        stamp = (
            t_inst[None, :] + np.arange(G)[:, None] * rng.uniform(0.2, 0.6) + rng.uniform(0, 3, (G, n_inst))
        )
        early = rng.random(n_inst) < self.jitter_p
        stamp[0, early] -= rng.uniform(50, 80, early.sum())
        # Bursts: GPUs k.. of an instant written ~110 ms after GPUs ..k-1; the logger's timer
        # then writes the next instant, overdue, right after the second burst.
        burst = np.flatnonzero((rng.random(n_inst) < self.burst_p) & ~early)
        burst = burst[(burst > 0) & (burst < n_inst - 2)] if G > 1 else burst[:0]
        for j in burst.tolist():
            k = int(rng.integers(1, G))
            stamp[k:, j] += rng.uniform(100, 120)
            stamp[:, j + 1] = np.maximum(stamp[:, j + 1], stamp[G - 1, j] + rng.uniform(1, 5))
            early[j + 1] = False
        stamp = np.round(stamp).astype(np.int64)
        # One GPU's lines are stamped in order (a burst's overdue next instant never ties).
        k = np.arange(n_inst)
        stamp = np.maximum.accumulate(stamp - k, axis=1) + k

        # Memory: each GPU's own level per state, drifting by a few MiB.
        mem = np.empty((G, n_inst))
        base = rng.uniform(60_000, 75_000, G).round()
        for g in range(G):
            busy = np.asarray([x != "idle" for x in state])
            mem[g] = np.where(busy, base[g], 4.0 + 130.0 * (g == 0))
            mem[g] += np.where(busy, np.cumsum(rng.integers(-2, 3, n_inst)), 0)

        written = np.repeat(logged[None, :], G, 0)
        if self.vanish is not None:
            vg, at_s, for_s = self.vanish
            a = round(at_s * 1000 / iv)
            written[vg, a : a + round(for_s * 1000 / iv)] = False
        # Samples: written entries, sorted by (gpu, ts); lines: instant by instant, GPUs in order.
        gg, jj = np.nonzero(written)
        order = np.lexsort((stamp[gg, jj], gg))
        gg, jj = gg[order], jj[order]
        s = Samples(
            [GpuId("node0", g, f"GPU-{self.seed:04x}-{g:04x}", self.gpu_name, None) for g in range(G)],
            gg.astype(np.int32),
            stamp[gg, jj],
            power[gg, jj],
            util[gg, jj],
            counter[gg, jj],
        )
        labels = state[jj]
        truth = centre[gg, jj]
        cols = np.flatnonzero(logged)
        first, last = cols[0], cols[-1]
        true_energy = cum[:, last] - (cum[:, first] - power[:, first] * iv)
        gaps = int((~logged[first : last + 1]).sum()) * iv
        sample_of = np.full((G, n_inst), -1, np.int64)
        sample_of[gg, jj] = np.arange(gg.size)
        lj, lg = np.nonzero(written.T)  # line order: instant, then GPU
        line = np.stack([lj, lg], -1)
        return RealTrace(
            s,
            labels,
            truth,
            self.events(bounds, t_inst),
            true_energy,
            line,
            gaps,
            sample_of[lg, lj],
            mem[gg, jj] if self.memory else None,
            ramping[gg, jj],
            onset[jj],
            [(name, round(t_inst[a]), round(t_inst[b - 1] + iv)) for name, a, b in bounds],
            np.asarray([power[:, a:b].sum(1) * iv for _, a, b in bounds]),
        )

    def events(self, bounds: list, t_inst: np.ndarray) -> list[Event]:
        evs: list[Event] = []
        seq = [0] * self.n_gpus

        def ev(type_: str, t_ms: float, rank: int = 0, **f) -> None:
            evs.append(Event(type_, "real", to_ms(t_ms / 1000), rank, f"s{rank}", seq[rank], f))
            seq[rank] += 1

        t_start = t_inst[0]
        for r in range(self.n_gpus):
            ev("register", t_start, r, host="node0", gpu=r, gpu_uuid=f"GPU-{self.seed:04x}-{r:04x}")
        ev("meta", t_start, gpu_model=self.gpu_name)
        ev("run", t_start, state="start")
        step = 0
        iv = self.interval_ms
        for name, a, b in bounds:
            ta, tb = t_inst[a], t_inst[b - 1] + iv
            if name == "compute" and a > 0:
                k = 1
                while ta + k * self.step_s * 1000 <= tb + 1e-6:
                    step += 1
                    ev("step", ta + k * self.step_s * 1000, step=step, tokens=4096)
                    k += 1
            elif name == "communication":
                step += 1  # a slow step that completes at the end of the stretch
                ev("step", tb, step=step, tokens=4096)
            elif name == "checkpoint":
                ev("phase", ta, name="checkpoint", state="begin")
                ev("phase", tb, name="checkpoint", state="end", step=step)
        ev("run", t_inst[-1] + iv, state="end")
        return evs


def agreement(bands: np.ndarray, trace: RealTrace) -> float:
    """Per-sample agreement of classified bands with the generator's labels."""
    return float(np.mean(bands == trace.label_bands()))


def csv_lines(trace: RealTrace) -> np.ndarray:
    """The sample (index into `trace.samples`) written on each data line of `write_csv`: line
    k of the file (header = 1) holds sample `csv_lines(trace)[k - 2]`."""
    assert trace.line_sample is not None
    return trace.line_sample


def write_csv(trace: RealTrace, path: Path, *, power_unit: str = "W", trailing_newline: bool = True) -> Path:
    """The trace as index-less `nvidia-smi --format=csv -lms 100` output, local time = UTC (with
    a memory.used column where the trace has one)."""
    s = trace.samples
    order = csv_lines(trace)
    scale = {"W": 1.0, "mW": 1000.0, "kW": 0.001}[power_unit]
    digits = {"W": 2, "mW": 0, "kW": 5}[power_unit]
    mem = trace.memory_mib
    header = f"timestamp, power.draw [{power_unit}], utilization.gpu [%]"
    lines = [header + (", memory.used [MiB]" if mem is not None else "")]
    # Line order: instant by instant, GPUs 0..G-1 within one (whatever their stamps).
    stamps = _local_stamps(s.ts_ms[order], None).tolist()
    pw, ut = (s.power_w[order] * scale).tolist(), s.util_pct[order].tolist()
    if mem is None:
        for stamp, p, u in zip(stamps, pw, ut, strict=True):
            lines.append(f"{stamp}, {p:.{digits}f} {power_unit}, {int(u)} %")
    else:
        for stamp, p, u, m in zip(stamps, pw, ut, mem[order].tolist(), strict=True):
            lines.append(f"{stamp}, {p:.{digits}f} {power_unit}, {int(u)} %, {int(m)} MiB")
    path.write_text("\n".join(lines) + ("\n" if trailing_newline else ""))
    return path


def write_events(trace: RealTrace, path: Path) -> Path:
    """The trace's events as protocol v1 JSONL."""
    return write_events_jsonl(trace.events, path)
