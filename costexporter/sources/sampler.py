"""Sampling on a background thread, off the scrape path: the agent drains, /metrics peeks."""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable

from costexporter.core.causes import HardwareEvent
from costexporter.sources.base import GpuSource, Reading
from costexporter.sources.energy import Anchor, share

log = logging.getLogger("costexporter.sources.sampler")
HARDWARE_EVERY_S = 1.0  # the hardware events' read (an Xid is queued by the driver meanwhile)


class ClockWatch:
    """The host's wall clock checked against its monotonic clock at every read.

    A live source stamps its readings with the wall clock, which can step (a manual `date`, NTP
    stepping instead of slewing, a VM resumed): +300 s would bill five minutes nobody used, -50 s
    would stamp new readings over booked ones. A difference between the two clocks' advance
    beyond `tolerance_s` is a step: it is counted (`steps`), logged, and added to `offset_s`,
    which `stamp()` takes off every later wall-clock stamp, so the samples keep one continuous
    clock and the time across the step is neither invented nor lost. The samples then run
    `offset_s` off the wall clock (exported) until the agent restarts.
    """

    def __init__(
        self,
        wall: Callable[[], float] = time.time,
        mono: Callable[[], float] = time.monotonic,
        tolerance_s: float = 2.0,
    ) -> None:
        self.wall, self.mono, self.tolerance_s = wall, mono, tolerance_s
        self.offset_s = 0.0
        self.steps: collections.Counter[str] = collections.Counter()  # "forward" / "backward"
        self._last: tuple[float, float] | None = None
        self._logged_at = -math.inf

    def check(self) -> float | None:
        """The step since the last check (s, + forward), if one beyond the tolerance."""
        w, m = self.wall(), self.mono()
        last, self._last = self._last, (w, m)
        if last is None:
            return None
        step: float = (w - last[0]) - (m - last[1])
        if abs(step) <= self.tolerance_s:
            return None
        self.offset_s += step
        self.steps["forward" if step > 0 else "backward"] += 1
        if m - self._logged_at >= 60:  # a clock that flaps: a line a minute
            self._logged_at = m
            log.warning(
                "the wall clock stepped %+.1f s against the monotonic clock: samples keep one "
                "continuous clock (now %+.1f s off the wall clock), so the step's time is neither "
                "billed nor lost (counted in costexporter_agent_clock_steps_total); keep the host "
                "on NTP, slewing rather than stepping, and restart the agent to realign",
                step,
                -self.offset_s,
            )
        return step

    def stamp(self, ts: float) -> float:
        """A wall-clock stamp on the samples' continuous clock."""
        return ts - self.offset_s


class Sampler:
    """Reads `source` every `interval_s` into a bounded buffer.

    `drain()` hands the booker everything read since the last drain; `latest()` is each GPU's
    newest reading, for the live view. When the buffer is full the oldest readings go first and
    are counted in `dropped` (their time will book `unobserved`, never silently vanish).

    Where the source's energy counter is costly (`source.costly_energy`, NVML), samples are read
    without it and `drain()` reads the counter once (at most once per `energy_interval_s`; 0:
    every drain, i.e. once per booking round), then gives the samples since the previous read
    the counter's delta shared out by integrated power (sources/energy.py). A drain that comes
    sooner keeps those GPUs' samples back until the next read, so energy is never guessed.
    `latest()` readings carry no energy in that mode.
    """

    def __init__(
        self,
        source: GpuSource,
        interval_s: float = 1.0,
        capacity: int = 1_000_000,
        energy_interval_s: float = 0.0,
        clock: ClockWatch | None = None,
    ) -> None:
        self.source = source
        # Only a source stamped with this host's wall clock is checked for steps; a replay or a
        # simulation plays its own time.
        self.clock = (clock or ClockWatch()) if getattr(source, "wall_clock", False) else None
        self.interval_s = interval_s
        self.energy_interval_s = energy_interval_s
        self._buf: collections.deque[Reading] = collections.deque()
        self.capacity = capacity
        self.dropped = 0
        self.reads = 0
        self._latest: dict[int, Reading] = {}
        self._lock = threading.Lock()  # the buffer, and the source between two threads
        self._anchored = bool(getattr(source, "costly_energy", False))
        self._energy_gpus = source.energy_gpus() if self._anchored else set()
        self._anchors: dict[int, Anchor] = {}  # each GPU's last counter read
        self._tails: dict[int, tuple[float, float, float]] = {}
        # Reads where the booked total could not meet the counter exactly: the first sample after
        # the read came so late that the slice's rate would pass the next read (rare; no drift).
        self.inexact: collections.deque[tuple[int, float]] = collections.deque(maxlen=10_000)
        self._anchor_at = -math.inf  # monotonic time of the last counter read
        self.anchors: collections.deque[tuple[int, float, float]] = collections.deque(maxlen=10_000)
        # The GPUs' hardware events (Xids, clock slowdowns), read at most once a second: what the
        # agent reads its wasted stretches' causes from (`drain_hardware`).
        self.hardware: collections.deque[HardwareEvent] = collections.deque(maxlen=10_000)
        self._hardware_at = -math.inf
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="costexporter-sampler", daemon=True)

    def start(self) -> Sampler:
        if self._anchored:
            with self._lock:
                self._anchors = self._read_anchors()  # the first samples share from here
        self._thread.start()
        return self

    def _read(self) -> list[Reading]:
        return self.source.read(energy=False) if self._anchored else self.source.read()  # type: ignore[call-arg]

    def sample_once(self) -> None:
        """One read of every GPU into the buffer (the sampling thread's tick), stamped on the
        samples' continuous clock."""
        with self._lock:
            try:
                readings = self._read()
            except Exception:  # a source bug must not kill sampling: log, count, go on
                log.exception("sampling failed")
                self.source.errors[(-1, "read_failed")] += 1
                readings = []
            self._take(readings)
            if time.monotonic() - self._hardware_at >= HARDWARE_EVERY_S:
                self._hardware_at = time.monotonic()
                try:
                    self.hardware.extend(self.source.hardware_events())
                except Exception:  # as a read's: counted and logged, sampling goes on
                    log.exception("reading hardware events failed")
                    self.source.errors[(-1, "hardware_events_failed")] += 1

    def drain_hardware(self) -> list[HardwareEvent]:
        """The hardware events read since the last drain."""
        with self._lock:
            out = list(self.hardware)
            self.hardware.clear()
            return out

    def take(self, readings: list[Reading]) -> None:
        """Readings just read elsewhere (a test's driver), stamped and buffered as a read's."""
        with self._lock:
            self._take(readings)

    def _take(self, readings: list[Reading]) -> None:
        """(Under the lock.) Checked for a clock step, stamped, buffered."""
        if self.clock is not None:
            self.clock.check()
            if self.clock.offset_s:
                readings = [dataclasses.replace(r, ts=self.clock.stamp(r.ts)) for r in readings]
        self.reads += 1
        for r in readings:
            self._latest[r.gpu] = r
        overflow = len(self._buf) + len(readings) - self.capacity
        for _ in range(max(overflow, 0)):
            self._buf.popleft()
            self.dropped += 1
        self._buf.extend(readings)

    def _run(self) -> None:
        next_t = time.monotonic()
        while not self._stop.is_set():
            self.sample_once()
            next_t += self.interval_s
            delay = next_t - time.monotonic()
            if delay < 0:  # fell behind (a slow read): skip the missed ticks, do not burst
                next_t = time.monotonic()
                delay = 0
            self._stop.wait(delay)

    def drain(self) -> list[Reading]:
        with self._lock:
            buf = list(self._buf)
            self._buf.clear()
            if not self._anchored or not self._energy_gpus:
                return buf
            due = time.monotonic() - self._anchor_at >= self.energy_interval_s
            if not due and not self._stop.is_set():  # stopped: the last drain hands out everything
                held = [r for r in buf if r.gpu in self._energy_gpus]
                self._buf.extend(held)
                return [r for r in buf if r.gpu not in self._energy_gpus]
            prev = dict(self._anchors)
            now = self._read_anchors()
            return self._shared(buf, prev, now)

    def _read_anchors(self) -> dict[int, Anchor]:
        try:
            got = self.source.read_energy()
        except Exception:  # a source bug: the samples are booked from power instead
            log.exception("energy counter read failed")
            self.source.errors[(-1, "read_failed")] += 1
            got = {}
        self._anchor_at = time.monotonic()
        now: dict[int, Anchor] = {}
        for g, (ts, mj) in got.items():
            if self.clock is not None:
                ts = self.clock.stamp(ts)
            now[g] = Anchor(ts, mj)
            self.anchors.append((g, ts, mj))
        return now

    def _shared(self, buf: list[Reading], prev: dict[int, Anchor], now: dict[int, Anchor]) -> list[Reading]:
        """Each counter GPU's samples with the counter's delta shared out; the new anchors kept."""
        by_gpu: dict[int, list[int]] = collections.defaultdict(list)
        for k, r in enumerate(buf):
            if r.gpu in self._energy_gpus:
                by_gpu[r.gpu].append(k)
        out = list(buf)
        self._anchors = {}
        for g in self._energy_gpus:
            idx = by_gpu.get(g, [])
            a0, a1 = prev.get(g), now.get(g)
            if a1 is None:  # the counter failed: these samples are booked from power
                self._tails.pop(g, None)
                continue
            self._anchors[g] = a1
            if a0 is None or a1.mj < a0.mj:  # no earlier read, or the counter restarted
                self._tails.pop(g, None)
                continue
            values = self._share_one(g, a0, a1, [buf[k].ts for k in idx], [buf[k].power_w for k in idx])
            for k, v in zip(idx, values, strict=True):
                out[k] = dataclasses.replace(buf[k], energy_mj=v)
        return out

    def _share_one(self, g: int, a0: Anchor, a1: Anchor, ts: list[float], pw: list[float]) -> list[float]:
        """One GPU's figures. The slice that straddles a read keeps one rate on both sides, so
        the booker, which cuts a slice in proportion to time, finds the counter exactly there."""
        tail = self._tails.get(g)  # (ts, mJ) of the last sample handed out, and its slice's rate
        if not ts:
            if tail is not None:  # no sample this round: the straddling slice runs on to a1
                t, e, _ = tail
                self._tails[g] = (t, e, (a1.mj - e) / (a1.ts - t) if a1.ts > t else 0.0)
            return []
        if tail is None:
            values = share(a0, ts, pw, a1)
        else:
            _, _, rate = tail
            first = max(a0.mj + rate * (ts[0] - a0.ts), a0.mj)
            if first > a1.mj:  # that rate would pass the next read: stay monotone, inexact at a0
                first = a1.mj
                self.inexact.append((g, a0.ts))
            values = [first, *share(Anchor(ts[0], first, pw[0]), ts[1:], pw[1:], a1)]
        t_last, e_last = ts[-1], values[-1]
        self._tails[g] = (t_last, e_last, (a1.mj - e_last) / (a1.ts - t_last) if a1.ts > t_last else 0.0)
        return values

    def latest(self) -> dict[int, Reading]:
        return dict(self._latest)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
