"""A job's trace booked in time windows, through the live agent's booking (`live.book_window`).

Replay holds one window of samples, its bands and its slices at a time: memory grows with the
trace's width and the window, not its length. Each window is booked as an agent books a round
whose samples reach past it, with what replay knows of the whole trace held fixed (the sampling
interval and phase, `live.TraceConstants`), the band classification's open signature run
carried from one window into the next, and the straggler's evidence counted once per moment;
the result is the booking of the whole trace at once, piece for piece.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from costexporter.core import bands as bands_mod
from costexporter.core import straggler
from costexporter.core.booking import NEG_INF, POS_INF, BookingConfig, Pieces, Timeline, hiccup_ms, job_bands
from costexporter.core.live import TraceConstants, book_window
from costexporter.core.profiles import Profile
from costexporter.core.tracesource import JobSamples, every_row

# A window holds about this many samples of a job (its length follows the job's width).
WINDOW_ROWS = 1_000_000
# ... and is never shorter than this many band windows' overlap, nor longer than a day.
MIN_WINDOW_OVERLAPS = 8
MAX_WINDOW_MS = 24 * 3600 * 1000


@dataclass(slots=True)
class Booked:
    """A job's pieces over all windows, and what its bands say of the whole trace."""

    pieces: Pieces
    bands: bands_mod.BandResult  # band: each of the job's samples' (as its window banded it)


def window_length_ms(n_gpus: int, trace: TraceConstants, cfg: BookingConfig, rows: int = WINDOW_ROWS) -> int:
    """About `rows` samples of `n_gpus` GPUs, within the bounds above."""
    overlap = bands_mod.window_overlap_ms(trace.interval_ms, int(cfg.grid_s * 1000), cfg.gap_intervals)
    want = rows * max(trace.interval_ms, 1) // max(n_gpus, 1)
    return int(min(max(want, MIN_WINDOW_OVERLAPS * overlap), MAX_WINDOW_MS))


def margin_ms(trace: TraceConstants, cfg: BookingConfig) -> int:
    """How far past a window's end its samples reach: what a moment's band and the data horizon
    look ahead to, and a logger hiccup bridged across the end."""
    grid = int(cfg.grid_s * 1000)
    ahead = bands_mod.step_lookahead_ms(trace.interval_ms, grid)
    return 2 * (ahead + bands_mod.window_overlap_ms(trace.interval_ms, grid, cfg.gap_intervals)) + hiccup_ms(
        trace.interval_ms
    )


def book_windows(
    samples: JobSamples,
    timeline: Timeline,
    cfg: BookingConfig,
    profile: Profile,
    ranks: np.ndarray,
    n_ranks: int,
    member_start: np.ndarray,
    member_end: np.ndarray,
    end_ms: int,
    trace: TraceConstants,
    window_ms: int | None = None,
) -> Booked:
    """The job's time [its members' starts, `end_ms`) booked window by window, each window's
    samples read as it is booked (`samples`: in memory, or from disk). Pieces number GPUs in
    member order, as `ranks` does. Its GPUs' samples before and after that time are banded in
    windows too (a timeline shows them), as one classification of them all would band them."""
    w = _Windows(samples, timeline, cfg, profile, ranks, n_ranks, trace)
    length = window_ms or window_length_ms(ranks.size, trace, cfg)
    start = int(member_start.min()) if member_start.size else timeline.start_ms
    first, last = samples.ts_range or (start, start)
    t = first
    while t + length < start:  # before the job's time: banded only
        t += length
        w.band(t, last=False)
    w.booked_until = start
    t = start
    more = last >= end_ms  # samples after the job's time, banded after it
    while True:
        t += length
        final = t >= end_ms
        w.book(min(t, end_ms), final, member_start, member_end, end_ms, more)
        if final:
            break
    # After the job's time (or where its booking banded nothing: a claim refused), banded only.
    t = max(w.banded_until, first)
    while w.banded_until <= last:
        t += length
        w.band(t, last=t > last)
    return w.result()


class _Windows:
    """The windows' state: where the next one's samples start and the signature run it carries
    in, which samples are banded and which moments counted so far, and what they found."""

    def __init__(
        self,
        samples: JobSamples,
        timeline: Timeline,
        cfg: BookingConfig,
        profile: Profile,
        ranks: np.ndarray,
        n_ranks: int,
        trace: TraceConstants,
    ) -> None:
        self.samples, self.timeline, self.cfg, self.profile = samples, timeline, cfg, profile
        self.ranks, self.n_ranks, self.trace = ranks, n_ranks, trace
        grid = int(cfg.grid_s * 1000)
        self.ahead = margin_ms(trace, cfg)
        self.overlap = bands_mod.window_overlap_ms(trace.interval_ms, grid, cfg.gap_intervals)
        self.band_of = np.full(samples.size, -1, np.int8)
        self.parts: list[Pieces] = []
        self.sigs: dict[int, tuple[int, int, list[int]]] = {}
        self.starved: bands_mod.Starved | None = None
        self.busy: dict[int, straggler.Busy] = {}  # per block, over the job's time only
        self.naming = straggler.Ledger()  # who is named slow, window by window, as an agent does
        self.since = NEG_INF
        self.carry: bands_mod.RunCarry | None = None
        self.banded_until, self.booked_until = NEG_INF, NEG_INF
        self.grid_ms = max(grid, trace.interval_ms)

    def _read(self, hi_ms: int) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
        idx = self.samples.between(self.since, hi_ms)
        lg, ts, pw, ut, en = self.samples.take(idx)
        return idx, (self.ranks[lg], ts, pw, ut, en)

    def _found(self, idx: np.ndarray, ts: np.ndarray, br: bands_mod.BandResult, until: int | None) -> None:
        """A window's bands: its samples in [banded_until, until) take theirs, its signature runs
        that start before `until` are kept (a run is said again by each window it reaches into),
        its straggler evidence is added."""
        self.grid_ms = br.grid_ms
        self.starved = br.starved if self.starved is None else self.starved.add(br.starved)
        for run in br.signatures:
            if until is None or run[0] < until:
                self.sigs[run[0]] = run
        mine = ts >= self.banded_until
        if until is not None:
            mine &= ts < until
            self.banded_until = until
        else:
            self.banded_until = POS_INF
        if mine.all() and every_row(idx, self.band_of.size):  # (one window: every sample in order)
            self.band_of = br.band.copy()
        else:
            self.band_of[idx[mine]] = br.band[mine]
        if until is not None:
            self.trace = dataclasses.replace(self.trace, counted_until_ms=until)

    def band(self, t: int, last: bool) -> None:
        """A window of samples outside the job's time, up to `t`: banded, nothing booked."""
        idx, (rank, ts, pw, ut, _) = self._read(t + self.ahead)
        count = (self.trace.counted_until_ms, None if last else t)
        br = job_bands(
            self.cfg, self.timeline, rank, ts, pw, ut, self.n_ranks, self.profile,
            self.trace.interval_ms, self.carry, t, self.trace.phase_ms, count,
        )  # fmt: skip
        self._found(idx, ts, br, None if last else t)
        self.since, self.carry = t - self.overlap, br.carry

    def book(
        self, t: int, final: bool, member_start: np.ndarray, member_end: np.ndarray, end_ms: int, more: bool
    ) -> None:
        """A window of the job's time up to `t` (the last one: to its end), booked as the agent
        books a round (`live.book_window`); `more`: samples after the end are banded later."""
        idx, (rank, ts, pw, ut, en) = self._read(end_ms if final else t + self.ahead)
        res = book_window(
            events=[],
            cfg=self.cfg,
            profile=self.profile,
            job_start_ms=self.timeline.start_ms,
            rank=rank,
            ts_ms=ts,
            power_w=pw,
            util_pct=ut,
            energy_mj=en,
            n_ranks=self.n_ranks,
            own_ranks=self.ranks,
            member_start_ms=member_start,
            member_end_ms=member_end,
            booked_until_ms=self.booked_until,
            now_ms=end_ms if final else t,
            final=final,
            timeline=self.timeline,
            carry=self.carry,
            trace=dataclasses.replace(self.trace, counts_the_rest=not more),
        )
        br = res.bands
        if br is None:  # nothing decided in this window: the next one reads from here again
            return
        self.parts.append(res.pieces.merged())
        self._found(idx, ts, br, None if final and not more else res.horizon_ms)
        for b, busy in br.busy.items():
            self.busy[b] = busy.add(self.busy.get(b))
        if br.busy:
            self.naming.name(br.busy, res.horizon_ms, self.n_ranks, self.trace.interval_ms, self.profile)
        self.booked_until = max(self.booked_until, res.horizon_ms)
        if res.next_window is not None:
            self.since, _, self.carry = res.next_window

    def result(self) -> Booked:
        return Booked(
            Pieces.concat(self.parts) if self.parts else Pieces.empty(),
            bands_mod.BandResult(
                self.band_of,
                self.grid_ms,
                self.trace.interval_ms,
                bands_mod.straggler(self.starved),
                0,
                [self.sigs[k] for k in sorted(self.sigs)],
                None,
                self.starved,
                busy=self.busy,
                named=self.naming.named,
            ),
        )
