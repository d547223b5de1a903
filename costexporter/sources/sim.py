"""A simulated job: GPUs of a scenario read as a live source, while its simulated trainer posts
the scenario's events through the real StepReporter (one per rank and restart, like real
processes). Time can run `speed` times faster; events keep the scenario's own timestamps."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any, SupportsInt

import numpy as np

from costexporter.core.events import MAX_STEP, MAX_TOKENS
from costexporter.core.model import Event, Samples
from costexporter.sources.playback import ReplaySource
from costexporter.sources.synth import SCENARIOS, TraceBuilder
from costexporter.store import keys, protocol, redisconn
from costexporter.store.client import RedisClient
from costexporter.trainer import coerce
from costexporter.trainer.reporter import StepReporter

log = logging.getLogger("costexporter.sources.sim")


DIE = "_die"  # the sim's own marker: every process of the job dies here
HEARTBEAT_MIN_WALL_S = 0.1
EVENT_LAG_WALL_S = 0.5  # a reporter's 50 ms flush, a round trip, and a busy machine's scheduling
# How far behind the story's clock the watcher judges, in wall time: the simulated reporters
# flush every 50 ms, so an event is at most a flush and a round trip late. (The agent books
# behind the sim's longer event lag: a bill must be exact, a judgement must only not read an
# event on its way as silence.) Every wall second of lag shortens each crash the watcher can
# see by as much: at 160x, 0.5 s would be 80 s of a crash-loop crash's three minutes.
WATCH_LAG_WALL_S = 0.2


class SimSource(ReplaySource):
    def __init__(
        self,
        scenario: str | TraceBuilder,
        *,
        speed: float = 1.0,
        redis_url: str | None = None,
        prefix: str | None = None,
        spool_dir: str | None = None,
        host: str | None = None,
        ends_at: float | None = None,
    ) -> None:
        """`ends_at` (Unix s): place the story so that it ends then (the demo: at its own start,
        so the whole story lies in the past and any window ending now covers it); by default it
        starts now."""
        if isinstance(scenario, str):
            if scenario not in SCENARIOS:
                raise ValueError(f"unknown scenario {scenario!r}; known: {', '.join(sorted(SCENARIOS))}")
            scenario = SCENARIOS[scenario]()
        b = scenario
        self.builder = b
        start = time.time()
        shift_ms = int(((start if ends_at is None else ends_at - (b.t - b.t0)) - b.t0) * 1000)
        s = b.samples()
        shifted = Samples(s.gpus, s.gpu, s.ts_ms + shift_ms, s.power_w, s.util_pct, s.energy_mj)
        super().__init__(shifted, speed=speed, host=host or "sim", clock=time.monotonic)
        self.shift_ms = shift_ms
        self.shift_s = shift_ms / 1000
        self._t_wall = start
        # Past the story's end the clock runs at real time: a simulation left running (`demo
        # --forever`) keeps a plausible clock instead of racing days ahead of the wall clock.
        self._story_s = (b.t - b.t0) if len(shifted) else 0.0
        self._events: list[Event] = sorted(b.events + crash_loop_deaths(b), key=lambda e: (e.ts_ms, e.seq))
        self._redis_url, self._prefix = redis_url, prefix
        self._own_spool = spool_dir is None  # a directory of ours: removed at close()
        self._spool = spool_dir or tempfile.mkdtemp(prefix="costexporter-sim-")
        self._reporters: dict[int, StepReporter] = {}
        self._started: set[int] = set()
        self._fresh = False  # the processes were (re)started and have not trained since
        self._stop = threading.Event()
        self._clock_client: RedisClient | None = None  # redisconn.from_url's client
        self.trainer_done = threading.Event()
        self._trainer = threading.Thread(target=self._train, name="costexporter-sim-trainer", daemon=True)
        self._trainer.start()
        self._clock_thread = threading.Thread(
            target=self._publish_clock_loop, name="costexporter-sim-clock", daemon=True
        )
        self._clock_thread.start()

    @property
    def event_lag_s(self) -> float:
        """The simulated trainers post through real reporters, which flush every 50 ms of wall
        time: `speed` times longer in the story's time. While they post, the agent must not book
        closer than that to its newest sample, or it decides moments before their events arrive
        (a restart's `run start` a few seconds late books its startup as waste)."""
        return 0.0 if self.trainer_done.is_set() else EVENT_LAG_WALL_S * self.speed

    @property
    def heartbeat_wall_s(self) -> float:
        """The simulated trainers' heartbeat: 10 s of scenario time, but not faster than ten
        times a second of wall time (a watcher of the story allows for the longer gap)."""
        return max(10.0 / self.speed, HEARTBEAT_MIN_WALL_S)

    def sim_time(self) -> float:
        """The scenario's clock, in Unix seconds: `speed` times the wall clock through the story,
        the wall clock's pace after it."""
        wall = float(self._clock() - self._t0)
        story_wall = self._story_s / self.speed
        if wall <= story_wall:
            return float(self._trace_t0 / 1000 + wall * self.speed)
        return float(self._trace_t0 / 1000 + self._story_s + (wall - story_wall))

    @property
    def clock_speed(self) -> float:
        """How fast the clock runs now: `speed` through the story, 1 after it."""
        return self.speed if self._clock() - self._t0 <= self._story_s / self.speed else 1.0

    def _reporter(self, rank: int, ts: float, new: bool = False) -> StepReporter:
        """The rank's trainer process; `new`: it restarted (a new process, a new session)."""
        rep = self._reporters.get(rank)
        if rep is None or new:
            if rep is not None:
                rep.close(timeout=0.5, end_run=False)  # the old process died
            g = self.builder.gpu_ids()[rank]
            rep = StepReporter(
                self.builder.job,
                self._redis_url,
                rank=rank,
                local_rank=g.index,
                world_size=self.builder.n_gpus,
                host=g.host,
                gpu_uuid=g.uuid,
                gpu_index=g.index,
                prefix=self._prefix,
                spool_dir=self._spool,
                clock=self.sim_time,
                started_at=ts,
                heartbeat_s=self.heartbeat_wall_s,
            )
            self._reporters[rank] = rep
        return rep

    def _train(self) -> None:
        try:
            for ev in self._events:
                ts = (ev.ts_ms + self.shift_ms) / 1000  # the reporter takes seconds
                while self.sim_time() < ts:
                    if self._stop.wait(min(0.02, max((ts - self.sim_time()) / self.speed, 0.001))):
                        return
                self._post(ev, ts)
        finally:
            self.trainer_done.set()

    def _publish_clock_loop(self) -> None:
        """On its own thread: a slow Redis call here must not delay the simulated trainer, whose
        every millisecond of wall time is `speed` milliseconds of the story."""
        while True:
            self._publish_clock()
            if self._stop.wait(1.0):
                return

    def _publish_clock(self) -> None:
        """Tell watchers the scenario's clock (`watch --sim-clock`): at --speed, time in the
        events runs faster than the wall clock."""
        import redis

        try:
            if self._clock_client is None:
                self._clock_client = redisconn.from_url(
                    self._redis_url or protocol.DEFAULT_REDIS_URL,
                    socket_timeout=1.0,
                    socket_connect_timeout=1.0,
                )
            self._clock_client.set(
                keys.simclock_key(self._prefix or protocol.DEFAULT_PREFIX),
                json.dumps(
                    {
                        "sim": self.sim_time(),
                        "wall": time.time(),
                        "speed": self.clock_speed,
                        "lag": self.event_lag_s,
                    }
                ),
                ex=60,
            )
        except (redis.RedisError, OSError):
            pass  # the watcher falls back to the last clock it read

    def _restart_all(self, ts: float) -> None:
        """A restart restarts every rank, as torchrun does: each a new process with a new session,
        its own `register` and `run start`."""
        for rank in range(self.builder.n_gpus):
            self._reporter(rank, ts, new=True)
        self._fresh = True

    def _die(self) -> None:
        """Every process of the job dies (a crash): no `run end`, and the heartbeats stop."""
        for rep in self._reporters.values():
            rep.close(timeout=0.5, end_run=False)
        self._reporters.clear()
        self._fresh = False  # the next run event restarts them

    def _post(self, ev: Event, ts: float) -> None:
        f, state = ev.fields, ev.fields.get("state")
        if ev.type != "run" and ev.type != DIE:
            self._fresh = False
        if ev.type == DIE:
            self._die()
        elif ev.type == "register":
            self._reporter(ev.rank, ts)
        elif ev.type == "run" and state == "start":
            # The reporter posts its own first `run start`; a later one is a restart.
            if ev.rank in self._started:
                if ev.rank == 0:
                    self._restart_all(ts)
                else:
                    self._reporter(ev.rank, ts, new=True)
            self._started.add(ev.rank)
        elif ev.type == "run" and state == "resume":
            if ev.rank == 0 and not self._fresh:  # a resume is a new run of every process
                self._restart_all(ts)
            self._reporter(ev.rank, ts).resume(_int(f["step"]), ts=ts)
        elif ev.type == "run" and state == "end":
            self._reporter(ev.rank, ts).close(ts=ts)
        elif ev.type == "step":
            tokens = _count(f.get("tokens"), "tokens", MAX_TOKENS)
            self._reporter(ev.rank, ts).step(_int(f["step"]), tokens=tokens, ts=ts)
        elif ev.type == "phase":
            rep, name = self._reporter(ev.rank, ts), f["name"]
            if not isinstance(name, str):
                raise TypeError(f"a phase name must be a string, got {name!r}")
            post = rep.phase_begin if state == "begin" else rep.phase_end
            post(name, step=_count(f.get("step"), "step", MAX_STEP), ts=ts)
        elif ev.type == "meta":
            self._reporter(ev.rank, ts).meta(ts=ts, **f)

    def close(self) -> None:
        self._stop.set()
        self._trainer.join(2.0)
        for rep in self._reporters.values():
            rep.close(timeout=1.0, end_run=False)
        if self._own_spool:
            shutil.rmtree(self._spool, ignore_errors=True)

    @property
    def done(self) -> bool:
        return super().done and self.trainer_done.is_set()


def _int(x: object) -> int:
    """A number field of the scenario's own events (TraceBuilder writes ints) as an int."""
    if not isinstance(x, SupportsInt):
        raise TypeError(f"not a number: {x!r}")
    return int(x)


def _count(x: object, name: str, hi: int) -> int | None:
    """An optional count of an event as the reporter reads it (it would coerce it so anyway)."""
    return None if x is None else coerce.count(x, name, hi)


def crash_loop_deaths(b: TraceBuilder) -> list[Event]:
    """When the job's processes die before a restart: the first moment every GPU of the job
    reads 0% between the last progress (a step, or the previous run event) and the restart or
    resume. The scenario's trace shows the crash there; its events do not. The sim stops the
    processes then, so their heartbeats end like a real crash's (a watchdog kill, a crash loop)."""
    s = b.samples()
    if len(s) == 0:
        return []
    ts_all, idx = np.unique(s.ts_ms, return_inverse=True)
    busy = np.zeros(ts_all.size, bool)
    np.logical_or.at(busy, idx, s.util_pct > 0)
    idle_ms = ts_all[~busy]
    last = None  # the newest progress: a step or a run event of rank 0
    out = []
    for e in sorted(b.events, key=lambda e: (e.ts_ms, e.seq)):
        if e.type == "run" and e.rank == 0 and e.get("state") in ("start", "resume") and last is not None:
            dead = idle_ms[(idle_ms > last) & (idle_ms < e.ts_ms)]
            if dead.size:
                out.append(Event(DIE, b.job, int(dead[0]), 0, "", -1, {}))
        if e.type == "step" or (e.type == "run" and e.rank == 0):
            last = e.ts_ms
    return out


def published_clock(redis_url: str, prefix: str) -> Callable[[], float]:
    """A clock that follows the one a running simulation publishes (extrapolated between its
    writes, less the lag of its trainers' events); the wall clock until one is seen."""
    import redis

    client = redisconn.from_url(redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
    last: dict[str, Any] = {"sim": None, "wall": 0.0, "speed": 1.0, "lag": 0.0}  # updated from JSON

    def now() -> float:
        try:
            raw = client.get(keys.simclock_key(prefix))
            if raw:
                last.update(json.loads(raw))
        except (redis.RedisError, OSError, ValueError):
            pass
        if last["sim"] is None:
            return time.time()
        # Less what the simulated trainers' events may still lag, as the in-process demo's watcher
        # judges: WATCH_LAG_WALL_S, not the agent's longer booking lag.
        now_sim = float(last["sim"]) + (time.time() - float(last["wall"])) * float(last["speed"])
        return now_sim - min(float(last.get("lag") or 0.0), WATCH_LAG_WALL_S * float(last["speed"]))

    return now
