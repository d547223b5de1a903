"""Replay: a recorded trace plus the trainer's events in, the ledger's numbers out.

Pure accounting: this module imports no Redis, FastAPI or NVML. It lines samples up with
events per job (registrations map ranks to GPUs; without any, the whole trace is one implicit
job), classifies bands, builds the booking timeline and books every slice.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import numpy as np

from costexporter.core import bands as bands_mod
from costexporter.core import bandtable, causes, flops, forecast, idle, jobfacts, profiles, straggler
from costexporter.core.attribution import SUBMITTED_KEY
from costexporter.core.booking import (
    NEG_INF,
    POS_INF,
    STEPLESS_META,
    BookingConfig,
    Pieces,
    Timeline,
    active_intervals,
    build_timeline,
    intersect,
    is_stepless,
    make_slices,
)
from costexporter.core.buckets import BUCKET_S, amounts, cost_by_category
from costexporter.core.carbon import GridIntensity
from costexporter.core.cost import (
    MICRO_PER_UNIT,
    MJ_PER_KWH,
    MS_PER_HOUR,
    Prices,
    cost_per_valid_step,
    to_micro,
)
from costexporter.core.diagnostics import Diagnostics
from costexporter.core.figures import at_risk_ms, extend_incidents, job_figures
from costexporter.core.forecast import Forecast
from costexporter.core.goodput import Goodput, JobSpan
from costexporter.core.goodput import job_goodput as job_goodput_of
from costexporter.core.live import TraceConstants
from costexporter.core.model import (
    CATEGORIES,
    JOB_CODES,
    VALID_CODES,
    WASTED_CATEGORIES,
    WASTED_CODES,
    Band,
    Category,
    Event,
    GpuId,
    GpuIndex,
    Samples,
)
from costexporter.core.pricing import PriceSchedule, Pricing
from costexporter.core.profiles import Profile
from costexporter.core.replayreport import (
    Incident,
    JobReport,
    ProfileReport,
    ReplayReport,
    SlowRankReport,
    Straggler,
    Unassigned,
)
from costexporter.core.replaywindows import book_windows
from costexporter.core.terms import JobTerms, Policy, PolicyRule, job_terms
from costexporter.core.tracesource import JobSamples, MemoryTrace, Trace

# A part of the report (costexporter/schemas): a JSON document, so its values are Any.


@dataclass(frozen=True)
class ReplayConfig:
    booking: BookingConfig = field(default_factory=BookingConfig)
    prices: Prices = field(default_factory=Prices)
    job: str | None = None  # the implicit job's name; default: the events' job, else "trace"
    gpu_model: str | None = None
    power_limit_w: float | None = None
    profile: Profile | None = None  # overrides model-based selection
    profile_dir: Path | None = None  # fitted profiles, matched by GPU model (profiles.find)
    # How progress is booked: "events" (steps and declared phases), "none" (by band alone), or
    # "auto": by events where the job has any progress event, by band alone where it has none.
    progress: str = "auto"
    # The operator's policy file (`terms.parse_policy_file`): its rules (thresholds, owners and
    # prices by job name or namespace) and its price table.
    policy_rules: tuple[PolicyRule, ...] = ()
    pricing: Pricing = field(default_factory=Pricing)
    # How long a stretch of the trace is booked at once (`replaywindows`); None: sized to hold
    # about WINDOW_ROWS samples of the job.
    window_ms: int | None = None
    # The grid's carbon intensity (the policy file's `carbon_intensity`); None: no carbon figures.
    carbon: GridIntensity | None = None

    def policy(self) -> Policy:
        """The operator's terms: the flags' thresholds and prices, the policy file's."""
        return Policy(self.booking, self.prices, self.policy_rules, self.pricing)


@dataclass(slots=True)
class JobResult:
    """A booked job: the pieces (slices cut at segment bounds, categorized) and context."""

    name: str
    gpus: list[GpuId]
    ranks: np.ndarray
    pieces: Pieces
    profile: Profile
    timeline: Timeline
    meta: dict[str, Any]  # the job's meta events' fields, merged (free-form, as in the report)
    band_result: bands_mod.BandResult
    preflight: dict[str, Any] | None
    member_intervals: list[list[tuple[int, int]]]  # per job GPU: when it belonged to the job
    sample_range_ms: tuple[int, int] | None = None  # the job's first and last sample
    event_range_ms: tuple[int, int] | None = None  # the job's first and last event
    profile_source: str = "file"  # where the profile came from (profiles.SOURCES)
    rows: np.ndarray | None = None  # the trace's samples that are the job's, in order (None: all)
    member_gpus: np.ndarray | None = None  # the trace's GPU number of each job GPU
    booked_by: str = "steps"  # "steps": by progress events; "band": by band alone
    terms: JobTerms | None = None  # what it was booked by (`terms.job_terms`)


def register_matches(
    samples: Samples | Trace, events: list[Event], diag: Diagnostics | None = None
) -> tuple[list[GpuId], dict[str, dict[int, tuple[int, int]]]]:
    """Map each job's registered ranks to GPU indices: job -> rank -> (gpu, register_ms).

    GPUs registered but absent from the trace are appended (they book `unobserved`). A rank's
    GPU is the one its first registration named (`jobfacts.one_rank_per_gpu`): one that comes
    back on another GPU is said (`register_other_gpu`), as the live agent says it.
    """
    gpus = list(samples.gpus)
    index = GpuIndex(gpus)
    out: dict[str, dict[int, tuple[int, int]]] = {}
    for ev in sorted((e for e in events if e.type == "register"), key=lambda e: e.ts_ms):
        uuid = ev.opt_str_field("gpu_uuid")
        host = str(ev.get("host"))
        number = ev.opt_int_field("gpu")
        g = index.find(uuid, host, number)
        if g is None:
            gpus.append(GpuId(host, number if number is not None else -1, uuid))
            g = len(gpus) - 1
            index.add(g, gpus[g])
        ranks = out.setdefault(ev.job, {})
        if ev.rank not in ranks:  # a re-registration after a restart keeps the first start
            ranks[ev.rank] = (g, ev.ts_ms)
        elif ranks[ev.rank][0] != g and diag is not None:
            first = gpus[ranks[ev.rank][0]]
            diag.warn(
                f"job {ev.job!r} rank {ev.rank}",
                None,
                "register_other_gpu",
                f"registered again on {gpus[g].host} GPU {gpus[g].index}; its time stays on "
                f"{first.host} GPU {first.index}, where it registered first",
            )
    return gpus, out


def _bound_registers(
    registered: dict[str, dict[int, tuple[int, int]]],
    trace: Trace,
    gpus: list[GpuId],
    diag: Diagnostics | None,
) -> dict[str, dict[int, tuple[int, int]]]:
    """Each rank's GPU time starts where the live agent starts it (`jobfacts.gpu_start_ms`):
    within its GPU's samples. A register far outside them is counted and warned about, as well
    as bounded: one dated far before (a clock years off) starts at the GPU's first sample. One
    dated far after every sample of its GPU (a clock a day ahead) cannot be placed at all: the
    live agent starts it when it reads the register, which a trace does not record, so its date
    is refused and it starts with its job (its other ranks' registers), else at its first sample.
    """
    if not len(trace):
        return registered
    trace_first = trace.first_sample_ms
    counts = trace.counts

    def span(g: int) -> tuple[int, int | None]:
        if g < len(counts) and counts[g] > 0:
            return int(trace.first_ms[g]), int(trace.last_ms[g])
        return trace_first, None

    def far_ahead(g: int, reg: int) -> bool:
        return jobfacts.register_far_ahead(reg, span(g)[1])

    out: dict[str, dict[int, tuple[int, int]]] = {}
    for job, ranks in registered.items():
        trusted = [jobfacts.gpu_start_ms(t, *span(g))[0] for g, t in ranks.values() if not far_ahead(g, t)]
        job_start = min(trusted, default=None)
        out[job] = {}
        for rank, (g, reg) in ranks.items():
            first, newest = span(g)
            gpu = gpus[g]
            where = f"job {job!r} rank {rank}"
            if far_ahead(g, reg):
                start, _ = jobfacts.gpu_start_ms(first if job_start is None else job_start, first, newest)
                if diag is not None:
                    diag.warn(
                        where,
                        None,
                        "register_after_samples",
                        f"registered {(reg - (newest or reg)) / 3_600_000:.1f} h after {gpu.host} GPU "
                        f"{gpu.index}'s last sample (a clock ahead?): its date is not used, its time "
                        "starts with its job's",
                    )
            else:
                start, _ = jobfacts.gpu_start_ms(reg, first, newest)
                if diag is not None and first - reg > jobfacts.REGISTER_FAR_MS:
                    diag.warn(
                        where,
                        None,
                        "register_before_samples",
                        f"registered {(first - reg) / 3_600_000:.1f} h before {gpu.host} GPU {gpu.index}'s "
                        "first sample (a clock behind?): its time starts at that sample, as the live agent "
                        "books it",
                    )
            out[job][rank] = (g, start)
    return out


def _one_rank_per_gpu(
    job: str, members: list[tuple[int, int, int]], gpus: list[GpuId]
) -> list[tuple[int, int, int]]:
    """`jobfacts.one_rank_per_gpu`, a warning naming each rank left out."""
    kept, dropped = jobfacts.one_rank_per_gpu(members)
    for rank, g, holder in dropped:
        logging.getLogger("costexporter.replay").warning(
            "job %r: ranks %d and %d both registered %s GPU %d; its time is booked once, for rank %d",
            job,
            holder,
            rank,
            gpus[g].host,
            gpus[g].index,
            holder,
        )
    return kept


def replay(
    samples: Samples, events: list[Event], cfg: ReplayConfig | None = None, diag: Diagnostics | None = None
) -> ReplayReport:
    """Book a trace; returns the report described in docs and costexporter/schemas. `diag`
    counts (and warns about) registers the trace's samples bound."""
    cfg = cfg or ReplayConfig()
    return report_of(*book_trace(samples, events, cfg, diag), cfg)


def report_of(results: list[JobResult], unassigned: Unassigned, cfg: ReplayConfig) -> ReplayReport:
    """The report of booked jobs (`book_trace`)."""
    return {
        "currency": cfg.prices.currency,
        "jobs": {r.name: job_report(r, cfg) for r in results},
        "unassigned": unassigned,
    }


def book_trace(
    samples: Samples | Trace, events: list[Event], cfg: ReplayConfig, diag: Diagnostics | None = None
) -> tuple[list[JobResult], Unassigned]:
    """Every job of the trace booked (`JobResult`s) and the time no job held (`unassigned`).
    `samples`: in memory, or a trace read window by window (`tracesource`)."""
    trace = samples if isinstance(samples, Trace) else MemoryTrace(samples)
    gpus, registered = register_matches(trace, events, diag)
    trace.extend(len(gpus))
    events_by_job: dict[str, list[Event]] = {}
    for e in events:
        events_by_job.setdefault(e.job, []).append(e)
    registered = _bound_registers(registered, trace, gpus, diag)
    jobs = _members(registered, trace, gpus, events_by_job, cfg)
    policy = cfg.policy()
    prepared = {
        job: _prepare_job(job, members, events_by_job.get(job, []), trace, gpus, cfg, policy)
        for job, members in jobs.items()
    }
    spans = _claims(jobs, {job: active_intervals(p.timeline) for job, p in prepared.items()}, gpus, diag)
    results: list[JobResult] = []
    member_ivals: list[tuple[int, int, int]] = []  # (gpu, start, end) across all jobs
    for prep in prepared.values():
        r = _book_job(prep, spans, trace.interval_ms, cfg.window_ms)
        prep.samples = None  # (its columns are let go once it is booked)
        gpus_of = r.member_gpus if r.member_gpus is not None else np.zeros(0, np.int64)
        member_ivals += [
            (int(g), a, b) for g, iv in zip(gpus_of, r.member_intervals, strict=True) for a, b in iv
        ]
        results.append(r)
    return results, _unassigned(trace, member_ivals, cfg)


def _members(
    registered: dict[str, dict[int, tuple[int, int]]],
    trace: Trace,
    gpus: list[GpuId],
    events_by_job: dict[str, list[Event]],
    cfg: ReplayConfig,
) -> dict[str, list[tuple[int, int, int]]]:
    """Jobs and their members, (rank, gpu, member_start): the registered ones, else one job
    holding every GPU of the trace from its first sample."""
    jobs: dict[str, list[tuple[int, int, int]]] = {}
    if registered:
        for job, job_ranks in registered.items():
            jobs[job] = _one_rank_per_gpu(job, sorted((r, g, t) for r, (g, t) in job_ranks.items()), gpus)
    elif trace.gpus:
        name = cfg.job or (next(iter(events_by_job)) if len(events_by_job) == 1 else "trace")
        t0 = trace.first_sample_ms
        jobs[name] = [(r, g, t0) for r, g in enumerate(range(len(trace.gpus)))]
    return jobs


def _claims(
    jobs: dict[str, list[tuple[int, int, int]]],
    live: dict[str, tuple[np.ndarray, np.ndarray]],
    gpus: list[GpuId],
    diag: Diagnostics | None,
) -> dict[tuple[str, int], tuple[int, int]]:
    """(job, gpu) -> [start, end) of the job's hold on the GPU. Claims are taken in time order;
    one by another job takes the GPU where the holder's run is over (`jobfacts.takeover_at`,
    as the live agent decides): a GPU is not taken from a live run. `live`: each job's stretches
    of a live run (`booking.active_intervals`)."""
    by_gpu: dict[int, list[tuple[int, str]]] = {}
    for job, mem in jobs.items():
        for _, g, t in mem:
            by_gpu.setdefault(g, []).append((t, job))
    spans: dict[tuple[str, int], tuple[int, int]] = {}
    for g, claims in by_gpu.items():
        claims.sort()
        holder, since = claims[0][1], claims[0][0]
        for t, job in claims[1:]:
            if job == holder:
                continue
            # (a claim dated before the holder's hold began, which waited itself, waits for it)
            at = jobfacts.takeover_at(max(t, since), intersect(since, POS_INF, *live[holder]))
            if at >= POS_INF:
                spans[(job, g)] = (t, t)
                if diag is not None:
                    diag.warn(
                        f"job {job!r}",
                        None,
                        "gpu_in_use",
                        f"registered {gpus[g].host} GPU {gpus[g].index} while job {holder!r}'s run held it "
                        "(its run never ended): refused, the GPU stays that job's",
                    )
                continue
            if at > t and diag is not None:
                diag.warn(
                    f"job {job!r}",
                    None,
                    "gpu_in_use",
                    f"registered {gpus[g].host} GPU {gpus[g].index} while job {holder!r}'s run held it: "
                    "it takes the GPU when that run ended",
                )
            spans[(holder, g)] = (since, at)
            holder, since = job, at
        spans[(holder, g)] = (since, POS_INF)
    return spans


def _job_facts(jev: list[Event]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The job's merged meta and its gate result, from its events in time order."""
    meta: dict[str, Any] = {}
    preflight: dict[str, Any] | None = None
    for e in sorted(jev, key=lambda e: e.ts_ms):
        if e.type == "meta":
            jobfacts.merge_meta(meta, e)
        elif e.type == "preflight":
            preflight = jobfacts.preflight_result(e)
    return meta, preflight


def _job_timeline(
    job: str, jev: list[Event], booked_by: str, bc: BookingConfig, start_ms: int, end_ms: int
) -> Timeline:
    """The job's booking timeline; booked by band alone, as a job declared stepless is, its
    steps say nothing."""
    if booked_by == "band" and not is_stepless(jev):
        field_, value = STEPLESS_META
        t_meta = min((e.ts_ms for e in jev), default=start_ms)
        jev_band = [e for e in jev if e.type != "step"]
        jev_band.append(Event("meta", job, t_meta, 0, "replay", -1, {field_: value}))
        return build_timeline(jev_band, bc, start_ms, end_ms)
    return build_timeline(jev, bc, start_ms, end_ms)


@dataclass(slots=True)
class _Job:
    """A job's facts, terms and timeline, before its GPUs' claims are settled."""

    name: str
    members: list[tuple[int, int, int]]  # (rank, gpu, its registration)
    events: list[Event]
    meta: dict[str, Any]
    preflight: dict[str, Any] | None
    profile: Profile
    profile_source: str
    terms: JobTerms
    timeline: Timeline
    end_ms: int  # where its data ends (its last event or its GPUs' last sample)
    booked_by: str
    samples: JobSamples | None  # the member GPUs' samples (None once booked)
    member_gpu_list: list[GpuId]


def _prepare_job(
    job: str,
    members: list[tuple[int, int, int]],
    jev: list[Event],
    trace: Trace,
    gpus: list[GpuId],
    cfg: ReplayConfig,
    policy: Policy,
) -> _Job:
    """One job's terms (`terms.job_terms`, as the agent and the watcher derive them) and its
    timeline."""
    meta, preflight = _job_facts(jev)
    member_gpus = np.asarray([g for _, g, _ in members], np.int64)
    samples = trace.job(member_gpus)
    member_gpu_list = [gpus[g] for g in member_gpus]
    profile, source = job_profile(cfg, meta, member_gpu_list, samples)
    terms = job_terms(
        job,
        meta,
        policy,
        (t for _, _, t in members),
        profile=profile,
        gpu_model=cfg.gpu_model or next((g.name for g in member_gpu_list if g.name), None),
        host=member_gpu_list[0].host if member_gpu_list else None,
    )
    # A register whose date is refused (far after its GPU's samples: a clock ahead) does not
    # stretch the job's data to it either (a day of its GPUs `unobserved`).
    gpu_of = {r: g for r, g, _ in members}
    last_end = trace.last_end_ms()

    def dated(e: Event) -> bool:
        g = gpu_of.get(e.rank)
        if e.type != "register" or g is None or g >= last_end.size or last_end[g] <= NEG_INF:
            return True
        return not jobfacts.register_far_ahead(e.ts_ms, int(last_end[g]) - trace.interval_ms)

    ev_end = max((e.ts_ms for e in jev if dated(e)), default=NEG_INF)
    end_ms = int(max(ev_end, last_end[member_gpus].max(initial=NEG_INF), terms.start_ms))
    booked_by = progress_of(jev, cfg.progress)
    timeline = _job_timeline(job, jev, booked_by, terms.booking, terms.start_ms, end_ms)
    return _Job(
        job,
        members,
        jev,
        meta,
        preflight,
        profile,
        source,
        terms,
        timeline,
        end_ms,
        booked_by,
        samples,
        member_gpu_list,
    )


def _book_job(
    prep: _Job, spans: dict[tuple[str, int], tuple[int, int]], interval_ms: int, window_ms: int | None
) -> JobResult:
    """One job booked on its terms, each GPU for the stretch its claim holds it: in time windows
    through the live agent's booking (`replaywindows`), so that memory holds one window's
    samples and slices, not the job's."""
    job, members, timeline, bc = prep.name, prep.members, prep.timeline, prep.terms.booking
    samples = prep.samples
    assert samples is not None, "a job is booked once"
    member_gpus = np.asarray([g for _, g, _ in members], np.int64)
    ranks = np.asarray([r for r, _, _ in members], np.int64)
    job_end = timeline.end_ms if timeline.end_ms is not None else prep.end_ms
    n_ranks = int(ranks.max()) + 1 if ranks.size else 0
    mem_start = np.asarray([spans[(job, g)][0] for _, g, _ in members], np.int64)
    mem_end = np.asarray([min(job_end, spans[(job, g)][1]) for _, g, _ in members], np.int64)
    mem_end = np.maximum(mem_end, mem_start)
    trace = TraceConstants(interval_ms, bands_mod.sampling_phase(samples.ts_prefix(), max(interval_ms, 1)))
    booked = book_windows(
        samples, timeline, bc, prep.profile, ranks, n_ranks, mem_start, mem_end, job_end, trace, window_ms
    )
    act_start, act_end = active_intervals(timeline)
    mem_ivals = [
        intersect(int(a), int(b), act_start, act_end) for a, b in zip(mem_start, mem_end, strict=True)
    ]
    jev = prep.events
    return JobResult(
        job,
        prep.member_gpu_list,
        ranks,
        booked.pieces,
        prep.profile,
        timeline,
        prep.meta,
        booked.bands,
        prep.preflight,
        mem_ivals,
        samples.ts_range,
        (min(e.ts_ms for e in jev), max(e.ts_ms for e in jev)) if jev else None,
        prep.profile_source,
        samples.trace_rows,
        member_gpus,
        prep.booked_by,
        prep.terms,
    )


def sample_timeline(samples: Samples, results: list[JobResult]) -> dict[str, np.ndarray]:
    """Per sample of the trace (in the trace's order): its band code (-1: no job banded it) and
    the category code of the time it starts (a sample no job held is `unassigned`). A sample's
    slice begins at its own timestamp, so the observed piece of its GPU that holds that moment is
    its own (a run of pieces is kept as one, `Pieces.merged`)."""
    n = len(samples)
    band = np.full(n, -1, np.int8)
    cat = np.full(n, int(Category.UNASSIGNED), np.int8)
    for r in results:
        rows = np.arange(n) if r.rows is None else r.rows
        if rows.size == 0:
            continue
        p = r.pieces
        local = np.full(len(samples.gpus), -1, np.int64)
        mg = r.member_gpus if r.member_gpus is not None else np.arange(len(r.gpus))
        local[mg[mg < local.size]] = np.flatnonzero(mg < local.size)
        g_local = local[samples.gpu[rows]]
        key_p = p.gpu.astype(np.int64) * (1 << 44) + (p.start_ms - int(samples.ts_ms.min(initial=0)))
        observed = p.category != Category.UNOBSERVED
        kp = key_p[observed]
        ke = kp + p.dur_ms[observed]  # (the same GPU's key at the piece's end)
        cp = p.category[observed]
        order = np.argsort(kp, kind="stable")
        kp, ke, cp = kp[order], ke[order], cp[order]
        ks = g_local * (1 << 44) + (samples.ts_ms[rows] - int(samples.ts_ms.min(initial=0)))
        if kp.size == 0:
            continue
        at = np.clip(np.searchsorted(kp, ks, "right") - 1, 0, kp.size - 1)
        hit = (kp[at] <= ks) & (ks < ke[at]) & (g_local >= 0)
        cat[rows[hit]] = cp[at[hit]]
    for r in results:  # every sample of a job's GPUs is banded by it (a later job's over it)
        rows = np.arange(n) if r.rows is None else r.rows
        banded = r.band_result.band >= 0
        band[rows[banded]] = r.band_result.band[banded]
    return {"band": band, "category": cat}


def recorded_gpus(samples: Samples) -> list[GpuId]:
    """A recorded trace's GPUs as a live agent playing it back should see them: each with its idle
    level learned over the whole trace (`idle.trace_levels`) and, where the trace names no model
    and no limit, the limit its own levels give (`profiles.from_trace`), so the agent's profile
    is the one offline replay derives."""
    from dataclasses import replace

    gpus = list(samples.gpus)
    if not gpus or not len(samples):
        return gpus
    levels = idle.trace_levels(
        samples.gpu, samples.power_w, samples.util_pct, [g.power_limit_w for g in gpus]
    )
    gpus = [replace(g, idle_w=lv) for g, lv in zip(gpus, levels, strict=True)]
    named = any(g.power_limit_w or (g.name and profiles.model_key(g.name)) for g in gpus)
    if not named:
        known = [x for x in levels if x is not None]
        try:
            est = profiles.from_trace(
                profiles.trace_levels(samples.power_w, samples.util_pct, max(known) if known else None),
                "derived",
            )
        except profiles.ProfileError:
            return gpus
        gpus = [replace(g, power_limit_w=est.power_limit_w, limit_from_trace=True) for g in gpus]
    return gpus


# Events that say how a job progresses: without any, a trace is bare.
PROGRESS_EVENTS = ("step", "run", "phase")


def progress_of(events: list[Event], progress: str) -> str:
    """How a job's time is booked: "steps" (rank 0's steps, runs and phases decide, the booking
    rules) or "band" (its band alone, as for a job without a trainer). `progress` "none" books by
    band; "events" by steps; "auto" by steps where the job has any progress event, by band where
    it has none (a bare trace is never waste for lack of events), and a job declared stepless
    (meta progress=none) by band."""
    if progress == "none" or is_stepless(events):
        return "band"
    if progress == "events":
        return "steps"
    return "steps" if any(e.type in PROGRESS_EVENTS for e in events) else "band"


def job_profile(
    cfg: ReplayConfig, meta: dict[str, Any], gpus: list[GpuId], samples: JobSamples
) -> tuple[Profile, str]:
    """A job's profile and its source by the one rule (`profiles.resolve`), with the idle level
    learned per GPU as the live agent learns it: a derived profile's idle and low edges follow the
    highest of the job's GPUs' idle levels (`profiles.with_idle`). A trace that names no model or
    limit has its profile derived from its own levels (`JobSamples.levels`, read only here)."""
    if cfg.profile is not None:
        return cfg.profile, "file"
    levels = samples.levels([g.power_limit_w for g in gpus])  # (a spilled trace: a pass over it)
    known = [x for x in levels.idle_w if x is not None]
    learned = max(known) if known else None
    profile, source = profiles.resolve(
        None,
        cfg.gpu_model,
        cfg.power_limit_w,
        meta=meta,
        gpus=gpus,
        directory=cfg.profile_dir,
        levels=lambda: profiles.busy_levels(levels.busy_w(), learned),
    )
    over = profiles.over_limit(profile, source, levels.all_w, levels.max_w)
    if over is not None:  # the named model is not the GPU that drew this power
        derived = profiles.from_trace(profiles.busy_levels(levels.busy_w(), learned), name=profile.name)
        profile = replace(derived, provenance={**(derived.provenance or {}), "over_limit": over})
        source = "derived_from_trace"
    return profiles.learned(profile, source, learned)


def _unassigned(trace: Trace, members: list[tuple[int, int, int]], cfg: ReplayConfig) -> Unassigned:
    """GPU time no job held: observed slices outside every job's membership."""
    zero: Unassigned = {"gpu_hours": 0.0, "energy_kwh": 0.0}
    if not len(trace):
        return zero
    interval_ms, counts = trace.interval_ms, trace.counts
    n_gpus = counts.size
    has = counts > 0
    span_start = np.where(has, trace.first_ms, 0)
    span_end = trace.last_end_ms()  # each GPU's last sample's slice end (read only where it has one)
    by_gpu: dict[int, list[tuple[int, int]]] = {}
    for g, a, b in members:
        by_gpu.setdefault(g, []).append((a, b))
    covered = np.zeros(n_gpus, bool)
    for g, ivals in by_gpu.items():
        if g < n_gpus and has[g]:
            covered[g] = any(a <= span_start[g] and b >= span_end[g] for a, b in ivals)
    todo = has & ~covered
    if not todo.any():
        return zero
    # Only the GPUs some of whose time is free are read (a spilled trace reads them alone).
    samples = trace.of_gpus(np.flatnonzero(todo))
    gpu, ts = samples.gpu, samples.ts_ms
    bounds = np.searchsorted(gpu, np.arange(n_gpus + 1), "left")
    first = bounds[:-1]
    # A sample's slice (and the gap after it) lies in [ts, next sample or ts + interval). One
    # inside the union of its GPU's memberships has no free time, so only the others (found by
    # binary search in each GPU's run of samples) and the sample after each (their slice ends
    # there) are sliced; the trace is not sliced again.
    ua, ub, ug = _union_by_gpu(by_gpu, todo)
    need_parts = []
    for g in np.flatnonzero(todo).tolist():
        f, c = int(first[g]), int(counts[g])
        seg = ts[f : f + c]
        at = 0  # samples before `at` are decided
        for a, b in zip(ua[ug == g].tolist(), ub[ug == g].tolist(), strict=True):
            lo = int(np.searchsorted(seg, a, "left"))
            hi = int(np.searchsorted(seg, b, "right"))  # seg[lo:hi] start inside [a, b]
            # Those whose next sample also starts by b are inside; the last one is, when it
            # is the GPU's last sample and its one interval ends by b.
            covered_end = hi if hi == c and hi > lo and seg[-1] + interval_ms <= b else hi - 1
            if covered_end > lo:
                if lo > at:
                    need_parts.append(np.arange(f + at, f + lo))
                at = max(at, covered_end)
        if at < c:
            need_parts.append(np.arange(f + at, f + c))
    if not need_parts:
        return zero
    need = np.concatenate(need_parts)
    not_last = need != (first + counts - 1)[gpu[need]]
    sub = np.union1d(need, need[not_last] + 1)
    # Runs of consecutive samples of one GPU become their own slicing groups: within a run every
    # sample's next sample is there, so its slice is the trace's; a run's last sample that was
    # only added as the next of another has a slice cut short, and is left out.
    new_run = np.ones(sub.size, bool)
    new_run[1:] = (sub[1:] != sub[:-1] + 1) | (gpu[sub[1:]] != gpu[sub[:-1]])
    run = np.cumsum(new_run) - 1
    n_runs = int(run[-1]) + 1
    run_gpu = gpu[sub[new_run]].astype(np.int64)
    none = np.full(n_runs, POS_INF, np.int64)
    s = make_slices(
        run.astype(np.int32),
        ts[sub],
        samples.power_w[sub],
        samples.energy_mj[sub],
        np.full(sub.size, Band.UNKNOWN, np.int8),
        n_runs,
        interval_ms,
        none,
        none,
        cfg.booking.gap_intervals,
    )
    run_last = np.append(new_run[1:], True)
    use = np.ones(s.gpu.size, bool)
    use[: sub.size] = ~run_last | np.isin(sub, need)
    g_of = run_gpu[s.gpu[use]]
    start, end, mj = s.start_ms[use], s.end_ms[use], s.energy_mj[use]
    assigned = np.zeros(start.size, np.int64)  # assigned ms per slice
    for g, ivals in by_gpu.items():
        if not (g < n_gpus and todo[g]):
            continue
        mine = np.flatnonzero(g_of == g)
        if mine.size == 0:
            continue
        st, en = start[mine], end[mine]
        for a, b in ivals:
            assigned[mine] += np.clip(np.minimum(en, b) - np.maximum(st, a), 0, None)
    dur = end - start
    free = np.clip(dur - assigned, 0, None)
    frac = np.divide(free, dur, out=np.zeros(free.size), where=dur > 0)
    return {
        "gpu_hours": float(free.sum() / MS_PER_HOUR),
        "energy_kwh": float((mj * frac).sum() / MJ_PER_KWH),
    }


def _union_by_gpu(
    by_gpu: dict[int, list[tuple[int, int]]], todo: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each GPU's memberships merged into disjoint intervals, sorted by (gpu, start)."""
    ua: list[int] = []
    ub: list[int] = []
    ug: list[int] = []
    for g in sorted(by_gpu):
        if not (g < todo.size and todo[g]):
            continue
        for a, b in sorted(by_gpu[g]):
            if b <= a:
                continue
            if ug and ug[-1] == g and a <= ub[-1]:
                ub[-1] = max(ub[-1], b)
            else:
                ua.append(a)
                ub.append(b)
                ug.append(g)
    return np.asarray(ua, np.int64), np.asarray(ub, np.int64), np.asarray(ug, np.int64)


def _money(x: float) -> float:
    return round(float(x), 6)


def _per_step(cost: float, valid: int) -> float | None:
    """Cost per valid step by the one rule (`cost.cost_per_valid_step`), of the cost in
    micro-units as the report rounds it."""
    q = cost_per_valid_step(to_micro(cost), valid)
    return None if q is None else q / MICRO_PER_UNIT


def job_goodput(r: JobResult, cfg: ReplayConfig, terms: JobTerms, cat_ms: np.ndarray, tokens: int) -> Goodput:
    """The job's goodput layers over the whole trace (`core.goodput`), as the API computes them
    from the ledger: its span from its timeline, its width its registered ranks."""
    p = r.pieces
    booked = p.end_ms[p.category != Category.UNASSIGNED]
    tl = r.timeline
    end = int(booked.max()) if booked.size else tl.start_ms
    submitted = terms.attribution.get(SUBMITTED_KEY)
    span = JobSpan(
        start_ms=tl.start_ms,
        end_ms=tl.end_ms,
        width=int(np.unique(r.ranks).size),
        submitted_ms=round(submitted * 1000) if isinstance(submitted, float) else None,
    )
    gpu_model = cfg.gpu_model or next((g.name for g in r.gpus if g.name), None) or r.meta.get("gpu_model")
    return job_goodput_of(
        float(cat_ms[VALID_CODES].sum()),
        float(cat_ms[JOB_CODES].sum()),
        span,
        (tl.start_ms, end if tl.end_ms is None else max(end, tl.end_ms)),
        flops.work(r.meta, gpu_model if isinstance(gpu_model, str) else None, tokens),
    )


def job_carbon(r: JobResult, cfg: ReplayConfig, kwh: float) -> float | None:
    """kgCO2e of the job's energy: at the policy's constant, or each 5-minute bucket of it (the
    ledger's) at the series' value then; None without an intensity or where the series leaves
    a bucket out (the API's rule)."""
    if cfg.carbon is None:
        return None
    return cfg.carbon.kg_of_energy(
        kwh,
        lambda: (
            (t * 1000, float(a[JOB_CODES, 1].sum()) / MJ_PER_KWH)
            for t, a in amounts(r.pieces, Prices()).items()
        ),
    )[0]


def job_terms_of(r: JobResult, cfg: ReplayConfig) -> JobTerms:
    """The terms the job was booked by (a result made without them: derived again)."""
    if r.terms is not None:
        return r.terms
    return job_terms(r.name, r.meta, cfg.policy(), [r.timeline.start_ms], profile=r.profile)


def _totals_by_key(key: np.ndarray, size: int, *weights: np.ndarray) -> list[np.ndarray]:
    """Per key (0..size-1), the sum of each of `weights`: a bincount each. Pieces come in long
    runs of one key (a GPU's time in one band and category), so where runs are long each run
    is summed first and only the runs are counted."""
    if key.size > 1:
        heads = np.flatnonzero(key[1:] != key[:-1])
        if heads.size * 4 < key.size:
            heads += 1
            heads = np.concatenate(([0], heads))
            k = key[heads].astype(np.intp)
            return [np.bincount(k, weights=np.add.reduceat(w, heads), minlength=size) for w in weights]
    return [np.bincount(key, weights=w, minlength=size) for w in weights]


def job_forecast(r: JobResult, spent: float, flat: Prices | None, scheds: list[PriceSchedule]) -> Forecast:
    """The job's cost to finish (`core.forecast`) from its 5-minute buckets as the ledger holds
    them: each bucket's cost (every job category) and the valid steps completed in it."""
    total = forecast.total_steps_of(r.meta)
    last_step = r.timeline.steps[-1].step if r.timeline.steps else -1
    if total is None or total <= last_step:
        return forecast.cost_to_finish([], spent, last_step, total)
    p = r.pieces
    cost: dict[int, float] = {}
    groups = (
        [(np.ones(p.gpu.size, bool), flat)]
        if flat is not None
        else [(p.gpu == g, sched) for g, sched in enumerate(scheds)]
    )
    for sel, prices in groups:
        if prices is None or not sel.any():
            continue
        for t, a in amounts(p.take(sel), prices).items():
            cost[t] = cost.get(t, 0.0) + float(a[JOB_CODES, 2].sum()) / 1e6
    steps: dict[int, int] = {}
    for rec in r.timeline.steps:
        if not rec.voided:
            t = rec.ts_ms // 1000 // BUCKET_S * BUCKET_S
            steps[t] = steps.get(t, 0) + 1
    buckets = [
        (t, cost.get(t, 0.0), steps.get(t, 0))
        for t in sorted(set(cost) | set(steps))
        if cost.get(t, 0.0) or steps.get(t, 0)
    ]
    return forecast.cost_to_finish(buckets, spent, last_step, total)


def slow_ranks(r: JobResult, valid_ms: float, valid_cost: float) -> tuple[list[SlowRankReport], int]:
    """Every rank judged slow in some block (core/straggler.py), its GPU-hours priced at the job's
    own cost of a valid GPU-hour (the steps were valid; they cost more), most costly first; and
    the blocks whose steps were too short for the sampling to tell."""
    led = straggler.Ledger()
    led.add(r.band_result.busy)
    led.close(None, int(r.ranks.max()) + 1 if r.ranks.size else 0, r.band_result.interval_ms, r.profile)
    per_ms = valid_cost / valid_ms if valid_ms > 0 else 0.0
    out: list[SlowRankReport] = []
    for rank, gpu_s in sorted(led.gpu_s.items(), key=lambda kv: -kv[1]):
        idx = np.flatnonzero(r.ranks == rank)
        g = r.gpus[int(idx[0])] if idx.size else None
        out.append(
            {
                "rank": rank,
                "host": g.host if g else None,
                "gpu": g.index if g else None,
                "uuid": g.uuid if g else None,
                "gpu_hours": gpu_s / 3600,
                "cost": _money(gpu_s * 1000 * per_ms),
                "blocks": led.blocks[rank],
                "named_at": r.band_result.named[rank] / 1000 if rank in r.band_result.named else None,
            }
        )
    return out, led.coarse


def job_report(r: JobResult, cfg: ReplayConfig) -> JobReport:
    """The JSON object of one job (schema: costexporter/schemas/replay-output.schema.json)."""
    p = r.pieces
    n_cat, n_band, n_gpu = len(Category), len(bandtable.current()), len(r.gpus)
    dur = p.dur_ms
    # One key (gpu, category, band + 1) summed per key gives every total as a sum over axes;
    # band column 0 holds unobserved pieces (no sample, no band).
    shape = (n_gpu, n_cat, n_band + 1)
    size = n_gpu * n_cat * (n_band + 1)
    # Built in place, one array; 32-bit where the keys fit, half the memory to pass over.
    wide = np.int32 if size < 2**31 else np.intp
    key: np.ndarray[Any, np.dtype[np.signedinteger[Any]]] = p.gpu.astype(wide)
    key *= n_cat
    key += p.category
    key *= n_band + 1
    key += p.band
    key += 1
    ms, mj = (t.reshape(shape) for t in _totals_by_key(key, size, dur, p.energy_mj))
    del key
    per_gpu_cat_ms = ms.sum(2)
    per_gpu_band_ms = ms.sum(1)[:, 1:]
    cat_ms = per_gpu_cat_ms.sum(0)
    cat_mj = mj.sum((0, 2))
    band_ms = per_gpu_band_ms.sum(0)
    terms = job_terms_of(r, cfg)
    flat, scheds = job_prices(r, cfg, terms)
    cat_cost = flat.cost(cat_ms, cat_mj) if flat is not None else cost_by_category(p, scheds)
    cat_cost[Category.UNASSIGNED] = 0.0

    per_gpu_cat = (per_gpu_cat_ms / MS_PER_HOUR).tolist()
    per_gpu_band = (per_gpu_band_ms / MS_PER_HOUR).tolist()
    rank_of = r.ranks.tolist()

    tl = r.timeline
    # The job-level figures and the GPU time at risk as the live agent computes them (figures).
    figs = job_figures(tl)
    valid, tokens = figs["valid_steps"], figs["tokens"]
    cost_total = float(cat_cost.sum())
    kwh = float(cat_mj[JOB_CODES].sum() / MJ_PER_KWH)
    kg = job_carbon(r, cfg, kwh)
    good = job_goodput(r, cfg, terms, cat_ms, int(tokens))
    wasted_ms = sum(cat_ms[c] for c in WASTED_CATEGORIES)
    # GPU time since the last saved checkpoint (all of it without one), over each stretch of
    # membership: the live rule with the stretch's end as the horizon.
    risk_ms = float(
        sum(at_risk_ms(tl, b, np.asarray([a], np.int64)) for iv in r.member_intervals for a, b in iv)
    )
    straggler: Straggler | None = None
    if r.band_result.straggler_rank is not None:
        rank = r.band_result.straggler_rank
        idx = np.flatnonzero(r.ranks == rank)
        if idx.size:
            g = r.gpus[int(idx[0])]
            straggler = {"rank": int(rank), "host": g.host, "gpu": g.index, "uuid": g.uuid}
    slow, coarse = slow_ranks(r, float(cat_ms[VALID_CODES].sum()), float(cat_cost[VALID_CODES].sum()))
    return {
        "gpu_hours": {c: float(cat_ms[i] / MS_PER_HOUR) for i, c in enumerate(CATEGORIES)},
        "energy_kwh": {c: float(cat_mj[i] / MJ_PER_KWH) for i, c in enumerate(CATEGORIES)},
        "cost": {c: _money(cat_cost[i]) for i, c in enumerate(CATEGORIES)},
        "band_gpu_hours": {
            b: float(band_ms[i] / MS_PER_HOUR) for i, b in enumerate(bandtable.current().names)
        },
        "cost_total": _money(cost_total),
        "gpu_hours_total": float(dur.sum() / MS_PER_HOUR),
        "wasted_gpu_hours": float(wasted_ms / MS_PER_HOUR),
        "gpu_hours_at_risk": float(risk_ms / MS_PER_HOUR),
        "steps_completed": int(figs["steps_completed"]),
        "steps_voided": int(figs["steps_voided"]),
        "valid_steps": int(valid),
        "tokens": int(tokens),
        "cost_per_valid_step": _per_step(cost_total, int(valid)),
        "productive_cost_per_step": _per_step(cat_cost[Category.PRODUCTIVE], int(valid)),
        "cost_per_million_tokens": _money(cost_total / tokens * 1e6) if tokens else None,
        "goodput": good.report(),
        "energy_kwh_total": kwh,
        "energy_kwh_per_valid_step": kwh / valid if valid > 0 else None,
        "carbon_kg": kg,
        "carbon_kg_per_valid_step": kg / valid if kg is not None and valid > 0 else None,
        "price_per_gpu_hour": terms.prices.price_per_gpu_hour,
        "attribution": terms.attribution.report(),
        "meta_ignored": list(terms.ignored_meta),
        "profile": profile_report(r.profile, r.profile_source),
        "booked_by": r.booked_by,
        "sampling_interval_s": r.band_result.interval_ms / 1000,
        "grid_s": r.band_result.grid_ms / 1000,
        "stall_threshold_s": figs["stall_threshold_s"],
        "last_checkpoint_step": int(figs["last_checkpoint_step"])
        if figs["last_checkpoint_step"] >= 0
        else None,
        "straggler": straggler,
        "slow_ranks": slow,
        "forecast": job_forecast(r, cost_total, flat, scheds).report(),
        "slow_ranks_untold_minutes": coarse,
        "meta": r.meta,
        "preflight": r.preflight,
        "gpus": [
            {
                "host": g.host,
                "gpu": g.index,
                "uuid": g.uuid,
                "rank": rank_of[i],
                "band_gpu_hours": dict(zip(bandtable.current().names, per_gpu_band[i], strict=True)),
                "gpu_hours": dict(zip(CATEGORIES, per_gpu_cat[i], strict=True)),
            }
            for i, g in enumerate(r.gpus)
        ],
        "incidents": incidents(r, flat if flat is not None else scheds),
        "energy_coverage": energy_coverage(p, dur),
        "time_range": {
            "samples": _range_s(r.sample_range_ms),
            "events": _range_s(r.event_range_ms),
        },
        "clock_offset_hours": clock_offset_hours(r.sample_range_ms, r.event_range_ms),
    }


def profile_report(p: Profile, source: str) -> ProfileReport:
    """The profile a job was banded with: its name, where it came from, its edges."""
    prov = p.provenance or {}
    out: ProfileReport = {
        "name": p.name,
        "calibrated": p.calibrated,
        "source": source,
        "idle_max_w": p.idle_max_w,
        "low_max_w": p.low_max_w,
        "compute_min_w": p.compute_min_w,
    }
    for k in ("derived_from", "learned_idle_w", "compute_level_w", "estimated_power_limit_w", "over_limit"):
        if k in prov:
            cast(dict[str, object], out)[k] = prov[k]  # (each one of ProfileReport's optional keys)
    return out


def _range_s(r: tuple[int, int] | None) -> list[float] | None:
    return None if r is None else [r[0] / 1000, r[1] / 1000]


def energy_coverage(p: Pieces, dur: np.ndarray | None = None) -> float | None:
    """Share of the job's GPU time whose energy is known: sampled time, and unobserved gaps an
    energy counter bridged (they carry the counter's delta). `dur`: the pieces' durations,
    when the caller has them."""
    if dur is None:
        dur = p.dur_ms
    total = float(dur.sum())
    if total <= 0:
        return None
    # Only the (few) unobserved pieces can be unknown: sum those, not a mask of every piece.
    uo = np.flatnonzero(p.category == Category.UNOBSERVED)
    unknown = float(dur[uo[~(p.energy_mj[uo] > 0)]].sum()) if uo.size else 0.0
    return round((total - unknown) / total, 6)


# Samples and events that overlap less than this share of the shorter range look misaligned.
MIN_CLOCK_OVERLAP = 0.5


def clock_offset_hours(samples_ms: tuple[int, int] | None, events_ms: tuple[int, int] | None) -> int | None:
    """Whole hours the samples' clock looks off from the events' (events minus samples), when
    the two barely overlap: the mark of a wrong --tz. 0 when they barely overlap but no whole
    number of hours explains it; None when they overlap well (or either is missing)."""
    if samples_ms is None or events_ms is None:
        return None
    if _aligned(samples_ms, events_ms):
        return None
    h = round((events_ms[0] - samples_ms[0]) / MS_PER_HOUR)
    shifted = (samples_ms[0] + h * int(MS_PER_HOUR), samples_ms[1] + h * int(MS_PER_HOUR))
    return h if h and _aligned(shifted, events_ms, GOOD_CLOCK_OVERLAP) else 0


# A whole-hour shift is named only when it lines the two up this well.
GOOD_CLOCK_OVERLAP = 0.9


def _aligned(a: tuple[int, int], b: tuple[int, int], share: float = MIN_CLOCK_OVERLAP) -> bool:
    """Whether two time ranges overlap for at least `share` of the shorter one; a range shorter
    than a minute (a job that only registered) need only fall within a minute of the other."""
    shorter = min(a[1] - a[0], b[1] - b[0])
    if shorter < 60_000:
        return min(a[1], b[1]) + 60_000 >= max(a[0], b[0])
    return min(a[1], b[1]) - max(a[0], b[0]) >= share * shorter


# The wasted category codes are consecutive: one unsigned range test finds their pieces.
_WASTED_LO, _WASTED_N = WASTED_CODES[0], len(WASTED_CODES)
if list(range(_WASTED_LO, _WASTED_LO + _WASTED_N)) != WASTED_CODES:  # pragma: no cover - a model change
    raise RuntimeError("the wasted categories' codes must be consecutive (core.model.Category)")


def _stretches(gpu: np.ndarray, start: np.ndarray, end: np.ndarray, tol: int) -> tuple[np.ndarray, int]:
    """(stretch number per piece, how many): the connected parts of the union of the pieces'
    [start, end + tol], numbered in time order: the stretches the incident rule makes of the
    pieces in time order. Pieces may come in any order; those that follow one another on one GPU
    (the pieces' usual order) are joined first, so only those runs are sorted, not the pieces."""
    n = start.size
    joined = np.zeros(n, bool)
    joined[1:] = (
        (gpu[1:] == gpu[:-1])
        & (start[1:] >= start[:-1])
        & (end[1:] >= end[:-1])
        & (start[1:] <= end[:-1] + tol)
    )
    head = np.flatnonzero(~joined)
    run_end = end[np.append(head[1:], n) - 1]  # a run's ends rise: its last is its reach
    order = np.argsort(start[head], kind="stable")
    reach = np.maximum.accumulate(run_end[order])
    new = np.ones(head.size, bool)
    new[1:] = start[head[order[1:]]] > reach[:-1] + tol
    of_run = np.empty(head.size, np.intp)
    of_run[order] = np.cumsum(new) - 1
    return np.repeat(of_run, np.diff(np.append(head, n))), int(new.sum())


def job_prices(r: JobResult, cfg: ReplayConfig, terms: JobTerms) -> tuple[Prices | None, list[PriceSchedule]]:
    """(one price for all of the job's time, or None), and each GPU's price schedule: the price
    table by the GPU's model and its host's node pool, as the agent on that host prices it."""
    policy = cfg.policy()
    price = terms.attribution.granted_price
    scheds = [
        policy.pricing.schedule(policy.prices, cfg.gpu_model or g.name or None, g.host, price) for g in r.gpus
    ]
    p = r.pieces
    if not scheds or p.gpu.size == 0:
        return terms.prices, scheds
    lo, hi = int(p.start_ms.min()), int(p.end_ms.max())
    if len({s.changes for s in scheds}) == 1 and not scheds[0].cuts(lo, hi):
        return scheds[0].at(lo), scheds
    return None, scheds


def incidents(r: JobResult, prices: Prices | list[PriceSchedule]) -> list[Incident]:
    """Merged job-level stretches of one wasted category.

    A stretch is what the live agent's rule (`figures.extend_incidents`: a piece within `tol`
    of the stretch's end extends it) makes of the pieces in time order, and its start, end,
    GPU time, ranks and deadlock ranks are that function's; replay adds what it knows of the
    whole job at once: the dominant band, the GPUs and hosts, and the cost."""
    p = r.pieces
    tol = 2 * r.band_result.grid_ms
    out: list[Incident] = []
    wasted = np.flatnonzero(p.category.view(np.uint8) - np.uint8(_WASTED_LO) < _WASTED_N)
    cats = p.category[wasted]
    for c in WASTED_CODES:
        sel = wasted[cats == c]
        if sel.size == 0:
            continue
        s, e = p.start_ms[sel], p.end_ms[sel]
        gid, n = _stretches(p.gpu[sel], s, e, tol)
        dur = e - s
        w = len(bandtable.current()) + 1  # (band + 1: column 0 is no band)
        band_ms = np.bincount(gid * w + (p.band[sel] + 1), weights=dur, minlength=n * w).reshape(n, w)
        g_ms = band_ms.sum(1)  # whole milliseconds: the same sum in any order
        g_mj = np.bincount(gid, weights=p.energy_mj[sel], minlength=n)
        if isinstance(prices, Prices):
            g_cost = prices.cost(g_ms, g_mj, np.full(n, c))
        else:  # priced piece by piece: the GPUs' prices differ, or change inside the job
            g_cost = np.asarray(
                [cost_by_category(p.take(sel[gid == i]), prices).sum() for i in range(n)], np.float64
            )
        dominant = band_ms.argmax(1) - 1
        if n > 1:  # each stretch's pieces together (a radix sort where the numbers are small)
            sel = sel[np.argsort(gid.astype(np.int16) if n < 2**15 else gid, kind="stable")]
        bounds = np.append(0, np.cumsum(np.bincount(gid, minlength=n)))
        for i in range(n):
            part = sel[bounds[i] : bounds[i + 1]]
            stretch = p.take(part)
            [inc] = extend_incidents({}, stretch, r.ranks, "", tol, r.band_result.signatures).values()
            gl = np.flatnonzero(np.bincount(stretch.gpu, minlength=len(r.gpus))).tolist()
            # the live agent's rule; a trace carries no hardware events: its checkpoint overruns
            # and the trainer's crash records can say (storage, job)
            cause, why = causes.cause_of(inc, (), r.timeline.phases_overrun, r.timeline.crashes)
            out.append(
                {
                    "start": inc["start"] / 1000,
                    "end": inc["end"] / 1000,
                    "category": inc["category"],
                    "band": bandtable.current().names[dominant[i]] if dominant[i] >= 0 else None,
                    "ranks": inc["ranks"],
                    # The deadlock signature's rank(s) at ~0% (R2): who left the collective.
                    "zero_util_ranks": inc["zero_util_ranks"],
                    "hosts": sorted({r.gpus[x].host for x in gl}),
                    "gpus": [
                        {"host": r.gpus[x].host, "gpu": r.gpus[x].index, "uuid": r.gpus[x].uuid} for x in gl
                    ],
                    "gpu_hours": inc["gpu_ms"] / MS_PER_HOUR,
                    "cost": _money(g_cost[i]),
                    "cause": cause,
                    "cause_why": why,
                }
            )
    out.sort(key=lambda x: (x["start"], x["category"]))
    return out
