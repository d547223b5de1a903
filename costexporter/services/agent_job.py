"""A job as one agent books it: its registrations, its own GPUs, its watermark state, its
folded timeline and what is stored of it, and the other hosts' samples of it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from costexporter.core.booking import POS_INF, Regime, Timeline
from costexporter.core.fold import TimelineFold
from costexporter.core.live import JobState
from costexporter.core.model import Event
from costexporter.core.samplewin import SampleWindow
from costexporter.core.terms import JobTerms
from costexporter.store import protocol
from costexporter.store.reader import EventReader


@dataclass
class PeerStreams:
    """The job's other hosts, as this agent exchanges samples with them."""

    remote: SampleWindow = field(default_factory=SampleWindow)  # other hosts' samples, sorted
    ids: dict[str, str] = field(default_factory=dict)  # sample stream -> its last entry read
    tailed: set[str] = field(default_factory=set)  # hosts whose entries before `ids` were read
    taken: dict[str, str] = field(default_factory=dict)  # host -> its last entry taken
    seen: dict[str, float] = field(default_factory=dict)  # host -> monotonic time of its last entry
    hosts: dict[str, list[int]] = field(default_factory=dict)  # other ranks by host (discovery)
    published_ts: dict[int, int] = field(default_factory=dict)  # rank -> newest ts published


@dataclass
class SavedFolds:
    """What this agent stored of the job's fold: when, and the candidates for the older one."""

    saved_at: float | None = None  # data time (s) of the last stored fold
    old_at: float | None = None  # data time (s) of the stored older fold (`fold:old:`)
    # Stored folds that may become the older one: (data time, blob, stream position)
    candidates: list[tuple[float, str, str]] = field(default_factory=list)


@dataclass
class AgentJob:
    name: str
    reader: EventReader
    # The job's timeline, folded event by event (bounded); the walk-relevant events read since
    # the last round wait in `fresh` until the round knows the job's start.
    fold: TimelineFold | None = None
    fresh: list[Event] = field(default_factory=list)
    newest_event_ms: int = 0  # the newest event time read (the fold stays behind it)
    meta: dict[str, Any] = field(default_factory=dict)  # the job's meta events folded, last write wins
    terms: JobTerms | None = None  # the terms of its last round (`terms.job_terms`)
    preflight: str = ""  # JSON of the latest pre-run gate result
    ranks: dict[int, protocol.Registration] = field(default_factory=dict)
    # Each rank's newest registration as read (`ranks` keeps its first date): a process started
    # again after the job's clean end registers anew.
    newest_reg: dict[int, int] = field(default_factory=dict)
    own: dict[int, int] = field(default_factory=dict)  # rank -> source GPU index
    # rank -> this node's GPU its registration names, held or not (a claim refused now may have
    # booked that GPU before: `booked_unheld`)
    named: dict[int, int] = field(default_factory=dict)
    floors: dict[int, int] = field(default_factory=dict)  # rank -> GPU time already booked elsewhere
    ends: dict[int, int] = field(default_factory=dict)  # rank -> a later job's claim of its GPU
    state: JobState = field(default_factory=JobState)
    wm_raw: str | None = None  # the watermark as this agent last read or wrote it (the CAS)
    saved: SavedFolds = field(default_factory=lambda: SavedFolds())  # the folds stored
    # The job's start its restored fold was walked with: the ranks hash keeps only each rank's
    # newest registration, so a restarted agent would otherwise see a later start.
    fold_start: int | None = None
    loaded: bool = False
    ever_loaded: bool = False
    # Another agent with this agent's id committed the job (a compare-and-set conflict): its
    # stored fold and stream position go with the watermark reloaded, not this agent's fold
    # (that agent may have trimmed the stream past what this one read).
    restore: bool = False
    peers: PeerStreams = field(default_factory=lambda: PeerStreams())  # the other hosts' samples
    figures: dict[str, Any] = field(default_factory=lambda: {"steps_completed": 0, "steps_voided": 0})
    latest_band: dict[int, int] = field(default_factory=dict)  # rank -> band
    at_risk_ms: int = 0
    live: dict[str, Any] = field(default_factory=dict)  # this round's live figures (livestate.py)
    end_ms: int | None = None  # the run's end while it is ended (a later run start reopens it)
    end_at: int | None = None  # ... as the timeline dates it (end_ms: no earlier than what was booked)
    # Stretches between a run's clean end and the job's next run start (a resume or a plain
    # start after `run end`): the GPUs were free then, and `_unassigned` books them.
    gaps: dict[int, tuple[int, int]] = field(default_factory=dict)  # gap start in the timeline -> [a, b)
    done: bool = False
    done_at: float | None = None  # monotonic time when the job was booked to its end
    skew_s: float | None = None

    @property
    def remote(self) -> SampleWindow:
        """The other hosts' samples of the job, sorted."""
        return self.peers.remote

    @property
    def remote_ids(self) -> dict[str, str]:
        """Each sample stream's last entry read."""
        return self.peers.ids

    @property
    def booked_until(self) -> int:
        return self.state.booked_until

    @property
    def start_settled(self) -> bool:
        """Whether every rank the job declares (`world_size`) has registered, as far as this
        agent has read. Until then a registration read late may date the job's start earlier,
        and the timeline is then walked again from the whole stream, so the stream must be
        there whole. Registrations that declare no size cannot tell: settled."""
        sizes = [r.world_size for r in self.ranks.values() if r.world_size]
        return not sizes or len(self.ranks) >= max(sizes)

    @property
    def oldest_unbooked(self) -> int:
        """Where the job's least-booked GPU is: the watermark, or a late rank catching up."""
        return min([self.state.booked_until, *self.state.behind.values()])

    @property
    def booked(self) -> np.ndarray:
        """All amounts this agent booked for the job, [category, (ms, mJ, micro-cost)]."""
        return self.state.booked

    @property
    def voided(self) -> np.ndarray:
        return self.state.voided

    def state_bytes(self) -> int:
        """About what the agent holds for this job's booking: its folded timeline, the events
        waiting to be folded and the rollback index entries in memory."""
        n = self.fold.state_bytes() if self.fold is not None else 0
        return n + 700 * len(self.fresh) + 400 * len(self.state.rb_index) + 16 * len(self.state.rb_applied)

    def window_from(self, context_ms: int) -> int:
        """Where the job's band window starts: its state's window, else (before the first booked
        round, a rank registered late, a state stored without one) the whole booking context."""
        w, oldest = self.state.win, self.oldest_unbooked
        return w[0] if w is not None and w[1] <= oldest else oldest - context_ms

    def claim(self, rank: int) -> tuple[int, int]:
        """[start, end) of the job's hold on its rank's GPU, as far as known now."""
        start = self.state.starts.get(rank)
        if start is None:
            start = max(self.ranks[rank].ts_ms, self.floors.get(rank, 0))
        end = min(self.ends.get(rank, POS_INF), self.end_ms if self.end_ms is not None else POS_INF)
        return start, max(start, end)

    def booked_unheld(self) -> list[tuple[int, int, int]]:
        """(GPU, start, end) the job's state booked on GPUs of ranks it does not hold now. A
        claim by index booked a GPU while the GPU's holder by UUID was not read yet (its register
        late); an agent restarted after that reads both at once and refuses the claim, but what
        it booked stays booked: the holder and `_unassigned` start after it. The GPU is the one
        the state booked the rank on (a state stored before it kept that: the one its
        registration names)."""
        out = []
        for r, g in {**self.named, **self.state.gpus}.items():
            if r in self.own:
                continue
            start, end = self.state.starts.get(r), self.state.held.get(r)
            if start is not None and end is not None and end > start:
                out.append((g, start, end))
        return out

    def held(self, rank: int) -> list[tuple[int, int]]:
        """The job's hold on its rank's GPU as [start, end) stretches: its claim less the gaps
        between a clean end and the next run start."""
        start, end = self.claim(rank)
        out, cur = [], start
        for a, b in sorted(self.gaps.values()):
            if b <= cur or a >= end:
                continue
            if a > cur:
                out.append((cur, a))
            cur = max(cur, b)
        if end > cur:
            out.append((cur, end))
        return out

    def live_hold(self, rank: int) -> list[tuple[int, int]]:
        """`held`, for deciding another job's claim now: a rank whose process registered again
        after the job's clean end runs again from that registration, before a round's timeline
        shows the new run (its events are booked a lag behind), so its GPU is not free then."""
        out = self.held(rank)
        again = self.newest_reg.get(rank)
        if self.end_at is not None and again is not None and again > self.end_at:
            out = [(a, min(b, again)) for a, b in out if a < again] + [(again, POS_INF)]
        return out

    def note_runs(self, tl: Timeline) -> None:
        """Follow the run's ends and restarts from this round's timeline. A run that starts again
        after a clean end (a resume, a requeue, a second `train()`) reopens the job's hold on its
        GPUs: the stretch between stays free. Time booked before a late `run end` arrived stays
        the job's."""
        b, r = tl.bounds, tl.regime
        if tl.end_ms is None and self.end_at is not None:
            i = int(np.searchsorted(b, self.end_at, "right")) - 1
            if r[i] == Regime.UNASSIGNED and b[i + 1] >= POS_INF:
                return  # a run start seen at the edge of the data: reopened when it has time
        for i in np.flatnonzero(r == Regime.UNASSIGNED).tolist():
            lo, hi = int(b[i]), int(b[i + 1])
            if lo > tl.start_ms and hi < POS_INF and lo not in self.gaps:
                held_to = self.end_ms if lo == self.end_at and self.end_ms is not None else lo
                self.gaps[lo] = (min(max(lo, held_to), hi), hi)
        if tl.end_ms is None:
            self.end_ms = self.end_at = None
        elif tl.end_ms != self.end_at:
            self.end_ms, self.end_at = max(tl.end_ms, self.booked_until), tl.end_ms


def held_until(state: JobState, rank: int) -> int:
    """How far a job's state has booked its rank's GPU (states stored before `held` was kept:
    the watermark)."""
    return state.held.get(rank, state.booked_until)
