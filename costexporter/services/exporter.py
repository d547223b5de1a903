"""Prometheus metrics of an agent and of the watcher (docs/metrics.md): custom Collectors over one snapshot.

Every family is built from `Agent.snapshot()`; nothing mutates gauges between scrapes. The
per-GPU and per-agent families are built at each scrape; the job families (per job: what changes
only in a round) once a round, written in the agent's thread after it (`AgentCollector.prepare`)
and served as written (`exposition.freeze`). Units are base units (seconds, joules); the
training job's label is `training_job` (Prometheus keeps `job` for the scrape target).

Aggregating across agents:
* per-GPU series and this agent's booked amounts (`costexporter_gpu_time_seconds_total`,
  `..._energy_joules_total`, `..._cost_total`, the `..._voided_...` corrections, GPU time at
  risk): `sum` over agents;
* job-level series (`costexporter_job_*`): every agent of the job exports the same value;
  aggregate with `max`, never `sum`.
Cost per valid step is a recording rule (sum of cost / max of valid steps), not a gauge here.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    StateSetMetricFamily,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector, CollectorRegistry

from costexporter import __version__
from costexporter.core import bandtable, flops, forecast
from costexporter.core.model import CATEGORIES, GpuId
from costexporter.services.exposition import freeze, prerender

if TYPE_CHECKING:
    from costexporter.services.agent import Agent
    from costexporter.services.snapshots import AgentSnapshot
    from costexporter.services.watcher import Watcher
    from costexporter.sources.dcgm import PodRef

# dcgm-exporter's label names on every per-GPU series, so joins with DCGM_FI_* need no
# label_replace (`gpu` is already DCGM's): `UUID` and `GPU_I_ID` (a MIG instance; "" for a whole
# GPU), `vgpu` (a time-sliced GPU's replica, as dcgm-exporter --kubernetes-virtual-gpus names
# it), the node under both spellings dcgm-exporter has used (`Hostname` before 4.x, `hostname`
# since), and the pod holding the GPU as `pod`/`namespace`/`container` and as the `exported_*`
# names a Prometheus gives dcgm-exporter's own pod labels under its default ServiceMonitor
# (`honorLabels: false`). Empty where unknown. Not modelName: `promtool check metrics` rejects
# camelCase label names; join it from DCGM by UUID instead.
DCGM_LABELS = [
    "UUID",
    "GPU_I_ID",
    "vgpu",
    "Hostname",
    "hostname",
    "pod",
    "namespace",
    "container",
    "exported_pod",
    "exported_namespace",
    "exported_container",
]


def dcgm_label_values(g: GpuId, pod: PodRef | None) -> list[str]:
    """Values of DCGM_LABELS for one GPU (`GpuId`) and the pod holding it, if known."""
    where = [pod.pod if pod else "", pod.namespace if pod else "", pod.container if pod else ""]
    parent = getattr(g, "parent_uuid", None)
    instance = getattr(g, "instance", None) or ""
    # A time-sliced GPU's replica is `<UUID>::<k>`, as the device plugin names it.
    vgpu = g.uuid.rpartition("::")[2] if parent and not instance and g.uuid and "::" in g.uuid else ""
    return [parent or g.uuid or "", instance, vgpu, g.host, g.host, *where, *where]


# A job's categories: `unassigned` is time outside every job, never a job's.
JOB_CATEGORIES = [(k, c) for k, c in enumerate(CATEGORIES) if c != "unassigned"]


def gpu_profile_info(s: AgentSnapshot) -> GaugeMetricFamily:
    """Which band profile each GPU's readings are banded with, and where it came from. A GPU
    without one (no model or power limit known) has no series (the agent logs why)."""
    fam = GaugeMetricFamily(
        "costexporter_gpu_profile_info",
        "1 per GPU: the band profile its readings are banded with and its source (builtin, file, "
        "calibrated, derived_from_limit, derived_from_model, learned_idle: a derived profile whose "
        "idle edges sit at the GPU's learned idle power).",
        labels=["host", "gpu", "uuid", "profile", "source"],
    )
    used = s.gpu_profiles
    for i, g in enumerate(s.gpus):
        if i in used:
            name, source = used[i]
            fam.add_metric([g.host, str(g.index), g.uuid or "", name, source], 1)
    return fam


class AgentCollector(Collector):
    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self._cache: list[Metric] = []
        self._cache_key: object = None
        self._lock = threading.Lock()  # the agent's `prepare` and the scrapes' threads

    def collect(self) -> Iterator[Metric]:
        s = self.agent.snapshot(with_jobs=False)
        host = s.host
        info = GaugeMetricFamily(
            "costexporter_agent_info", "The agent: 1 per running agent.", labels=["agent", "host", "version"]
        )
        info.add_metric([s.agent, host, __version__], 1)
        yield info
        up = GaugeMetricFamily("costexporter_redis_up", "Whether the last round could read and write Redis.")
        up.add_metric([], 1 if s.redis_up else 0)
        yield up

        # Per GPU: the live view. GPU index -> (job, rank, current band) of the GPUs a job holds.
        held = s.held
        labels = ["host", "gpu", "uuid", "training_job", "rank", *DCGM_LABELS]
        pods = self.agent.source.pods() if hasattr(self.agent.source, "pods") else {}
        power = GaugeMetricFamily(
            "costexporter_gpu_power_watts", "Board power of the newest sample.", labels=labels
        )
        util = GaugeMetricFamily(
            "costexporter_gpu_utilization_ratio", "GPU utilization of the newest sample (0-1).", labels=labels
        )
        band = GaugeMetricFamily(
            "costexporter_gpu_band",
            "1 for the GPU's current band, 0 for the others.",
            labels=[*labels, "band"],
        )
        for i, g in enumerate(s.gpus):
            job, rank, b = held.get(i, ("", "", None))
            if b is None and job:  # its job has no classified sample yet: the reading's own band
                # (a GPU no job holds shows none: the alert rules and dashboards are per job)
                b = s.gpu_bands.get(i)
            lv = [g.host, str(g.index), g.uuid or "", job, str(rank), *dcgm_label_values(g, pods.get(i))]
            r = s.latest.get(i)
            if r is not None:
                if not math.isnan(r.power_w):
                    power.add_metric(lv, r.power_w)
                if not math.isnan(r.util_pct):
                    util.add_metric(lv, r.util_pct / 100)
            if b is not None:
                for k, name in enumerate(bandtable.current().names):
                    band.add_metric([*lv, name], 1 if k == b else 0)
        yield power
        yield util
        yield band
        yield gpu_profile_info(s)

        errors = CounterMetricFamily(
            "costexporter_gpu_errors",
            "Per-GPU read errors of the source, by kind.",
            labels=["host", "gpu", "kind"],
        )
        for (gpu, kind), n in sorted(s.errors.items()):
            errors.add_metric([host, str(gpu) if gpu >= 0 else "", kind], n)
        yield errors
        hardware = CounterMetricFamily(
            "costexporter_gpu_hardware_events",
            "Hardware events read from a GPU: Xids (`code` the Xid) and hardware clock slowdowns (`code` "
            "NVML's clocks event reasons); what a wasted stretch's cause is read from.",
            labels=["host", "gpu", "kind", "code"],
        )
        for (gpu, kind, code), n in sorted(s.hardware.items()):
            hardware.add_metric([host, str(gpu), kind, str(code)], n)
        yield hardware
        dropped = CounterMetricFamily(
            "costexporter_samples_dropped", "Samples dropped from full buffers (their time books unobserved)."
        )
        dropped.add_metric([], s.dropped + s.stats.get("samples_dropped", 0))
        yield dropped
        pending = GaugeMetricFamily(
            "costexporter_samples_pending", "Samples held for booking (they grow while Redis is unreachable)."
        )
        pending.add_metric([], s.pending)
        yield pending
        rerr = CounterMetricFamily("costexporter_redis_errors", "Rounds that could not reach Redis.")
        rerr.add_metric([], s.stats.get("redis_errors", 0))
        yield rerr
        ferr = CounterMetricFamily(
            "costexporter_round_errors", "Booking rounds that failed unexpectedly (see the log)."
        )
        ferr.add_metric([], s.stats.get("round_errors", 0))
        yield ferr
        yield from self._cost_families(s)
        yield from self._fault_families(s)

        yield from self._jobs(s.jobs_key)

    def prepare(self) -> None:
        """After a round, in the agent's thread: the job families built and written now, so a
        scrape serves them as written (at 1,000 jobs, 58,000 samples) and only renders the
        per-GPU and per-agent families, which stay fresh per scrape."""
        prerender(self._jobs(self.agent.snapshot(with_jobs=False).jobs_key))

    def _jobs(self, key: object) -> list[Metric]:
        """The job families hold live figures (cost since the last step, time at risk, whether
        a phase's allowance holds) that change every round, booked or not: built from a whole
        snapshot once a round (by `prepare`, or by the first scrape after it) and frozen until
        the next."""
        with self._lock:
            if self._cache_key != key:
                s = self.agent.snapshot()
                self._cache = freeze(list(self._job_families(s)))
                self._cache_key = s.jobs_key
            return self._cache

    def _cost_families(self, s: AgentSnapshot) -> Iterator[Metric]:
        """What the agent itself costs: CPU per round, flat at any history (its memory per job
        is a job family: `costexporter_agent_state_bytes`)."""
        from costexporter.services.agent import ROUND_BUCKETS

        counts = s.round_counts
        if counts:
            cum, buckets = 0, []
            for b, n in zip([*map(str, ROUND_BUCKETS), "+Inf"], counts, strict=True):
                cum += n
                buckets.append((b, cum))
            h = HistogramMetricFamily(
                "costexporter_agent_round_seconds", "CPU time of each booking round (all jobs of the node)."
            )
            h.add_metric([], buckets, s.round_sum)
            yield h

    def _fault_families(self, s: AgentSnapshot) -> Iterator[Metric]:
        """What the agent refused or noticed: a second agent with its id, an empty Redis,
        rejected registrations and events, trainer clocks off their events' arrival."""
        conflicts = CounterMetricFamily(
            "costexporter_agent_conflicts",
            "Rounds dropped because the watermark changed under this agent: another agent runs "
            "with the same agent id (nothing is booked twice).",
        )
        conflicts.add_metric([], s.stats.get("conflicts", 0))
        yield conflicts
        epoch = CounterMetricFamily(
            "costexporter_redis_epoch_resets",
            "Times Redis came back empty (its epoch marker gone): the ledger before is lost there.",
        )
        epoch.add_metric([], s.stats.get("epoch_resets", 0))
        yield epoch
        steps = CounterMetricFamily(
            "costexporter_agent_clock_steps",
            "Steps of this host's wall clock against its monotonic clock (beyond 2 s), by direction: "
            "the samples keep one continuous clock, so a step's time is neither billed nor lost.",
            labels=["direction"],
        )
        for direction in ("forward", "backward"):
            steps.add_metric([direction], s.clock_steps.get(direction, 0))
        yield steps
        off = GaugeMetricFamily(
            "costexporter_agent_clock_offset_seconds",
            "How far the samples' clock runs behind this host's wall clock after the steps seen "
            "(0 without a step; a restart realigns it).",
        )
        off.add_metric([], s.clock_offset_s)
        yield off
        idr = CounterMetricFamily(
            "costexporter_agent_id_refused_rounds",
            "Rounds that booked nothing because another host holds this agent's --agent-id.",
        )
        idr.add_metric([], s.stats.get("agent_id_refused", 0))
        yield idr
        held = GaugeMetricFamily(
            "costexporter_agent_id_held",
            "1 while this host holds its --agent-id (0: refused, booking nothing).",
        )
        held.add_metric([], 0 if s.id_refused else 1)
        yield held
        uncovered = CounterMetricFamily(
            "costexporter_carbon_uncovered_rounds",
            "Job rounds with energy the policy's carbon_intensity series does not cover: not counted "
            "in costexporter_carbon_kg_total (never at a guessed intensity).",
        )
        uncovered.add_metric([], s.stats.get("carbon_uncovered_rounds", 0))
        yield uncovered
        jerr = CounterMetricFamily(
            "costexporter_job_errors", "Job rounds that failed and were skipped (the other jobs booked)."
        )
        jerr.add_metric([], s.stats.get("job_errors", 0))
        yield jerr
        regs = CounterMetricFamily(
            "costexporter_registrations_rejected",
            "Ranks entries (registrations) refused, by job and reason.",
            labels=["training_job", "reason"],
        )
        for (job, reason), n in sorted(s.registrations_rejected.items()):
            regs.add_metric([job, reason], n)
        yield regs
        yield meta_ignored(s.meta_ignored)
        yield data_rejected(s.data_rejected)

    def _job_families(self, s: AgentSnapshot) -> Iterator[Metric]:
        cur = s.currency
        # Booked amounts (this agent's GPUs): sum across agents.
        jl = ["training_job", "category"]
        t = CounterMetricFamily("costexporter_gpu_time_seconds", "GPU time booked, by category.", labels=jl)
        e = CounterMetricFamily("costexporter_energy_joules", "Energy booked, by category.", labels=jl)
        c = CounterMetricFamily(
            "costexporter_cost", "Cost booked, by category, in the currency.", labels=[*jl, "currency"]
        )
        vt = CounterMetricFamily(
            "costexporter_voided_gpu_time_seconds",
            "Valid GPU time later voided by a resume (moved to rolled_back).",
            labels=jl,
        )
        vc = CounterMetricFamily(
            "costexporter_voided_cost", "Valid cost later voided by a resume.", labels=[*jl, "currency"]
        )
        risk = GaugeMetricFamily(
            "costexporter_gpu_time_at_risk_seconds",
            "GPU time since the job's last saved checkpoint, on this agent's GPUs, to the newest sample.",
            labels=["training_job"],
        )
        booked_until = GaugeMetricFamily(
            "costexporter_booked_until_timestamp_seconds",
            "Everything before this time is booked (this agent).",
            labels=["training_job"],
        )
        since = GaugeMetricFamily(
            "costexporter_cost_since_last_step",
            "Cost on this agent's GPUs since the job's last progress point, booked and not yet booked "
            "(to the newest sample; sum over agents).",
            labels=["training_job", "currency"],
        )
        budget = GaugeMetricFamily(
            "costexporter_job_budget",
            "The job's budget from the operator's policy, in the currency (job-level: max).",
            labels=["training_job", "currency"],
        )
        prof = GaugeMetricFamily(
            "costexporter_job_profile_info",
            "The band profile of the job's GPUs on this agent; calibrated=false: derived from the power "
            "limit, fit one with `costexporter calibrate`.",
            labels=["training_job", "profile", "calibrated"],
        )
        for name, j in sorted(s.jobs.items()):
            since.add_metric([name, cur], j.since_cost / 1e6)
            if j.figures.get("profile"):
                calibrated = "true" if j.figures.get("profile_calibrated") else "false"
                prof.add_metric([name, j.figures["profile"], calibrated], 1)
            if j.figures.get("budget") is not None:
                budget.add_metric([name, cur], float(j.figures["budget"]))
            # As Python ints: no numpy scalar per value (58,000 of them at 1,000 jobs).
            booked, voided = j.booked.tolist(), j.voided.tolist()
            for k, cat in JOB_CATEGORIES:
                t.add_metric([name, cat], booked[k][0] / 1000)
                if cat != "unobserved":  # no sample, no energy
                    e.add_metric([name, cat], booked[k][1] / 1000)
                c.add_metric([name, cat, cur], booked[k][2] / 1e6)
                # Every counter from 0 at the job's first round, so rate() sees the first rollback.
                vt.add_metric([name, cat], voided[k][0] / 1000)
                vc.add_metric([name, cat, cur], voided[k][2] / 1e6)
            risk.add_metric([name], j.at_risk_ms / 1000)
            booked_until.add_metric([name], j.booked_until / 1000)
        yield from (t, e, c, vt, vc, risk, booked_until, since, budget, prof)
        carbon = CounterMetricFamily(
            "costexporter_carbon_kg",
            "kgCO2e of the energy booked on this agent's GPUs, at the grid's intensity of the operator's "
            "policy (carbon_intensity) in force at each 5-minute bucket; only with one.",
            labels=["training_job"],
        )
        for name, j in sorted(s.jobs.items()):
            if j.carbon_kg is not None:
                carbon.add_metric([name], j.carbon_kg)
        yield carbon
        slow = CounterMetricFamily(
            "costexporter_straggler_gpu_seconds",
            "GPU-seconds a slow rank held this agent's GPUs of the job longer than the next slowest "
            "rank would have (the what-if; valid time, priced, not a category). docs/accounting.md.",
            labels=["training_job", "rank"],
        )
        for name, j in sorted(s.jobs.items()):
            for rank, gpu_s in sorted(j.slow_gpu_s.items()):
                slow.add_metric([name, str(rank)], gpu_s)
        yield slow
        named = GaugeMetricFamily(
            "costexporter_straggler_wait_ratio",
            "The rank slowing the job now, named on its latest steps (five or more): the share of the "
            "job's time every other rank waits on it. Absent where no rank is named.",
            labels=["training_job", "rank"],
        )
        for name, j in sorted(s.jobs.items()):
            if j.slow_now is not None:
                named.add_metric([name, str(j.slow_now.rank)], round(j.slow_now.wait_ratio, 6))
        yield named
        rej = CounterMetricFamily(
            "costexporter_events_rejected",
            "Events refused (malformed), by job and reason.",
            labels=["training_job", "reason"],
        )
        skew = GaugeMetricFamily(
            "costexporter_event_clock_skew_seconds",
            "How far the job's event timestamps run ahead of their arrival in Redis (largest by "
            "size over its ranks; negative: behind, or delivered late). Keep trainer hosts on NTP.",
            labels=["training_job"],
        )
        state = GaugeMetricFamily(
            "costexporter_agent_state_bytes",
            "Memory the agent holds for a job's booking (folded timeline, events waiting, rollback "
            "index entries), about; bounded by the booking context, not the job's history.",
            labels=["training_job"],
        )
        for name, j in sorted(s.jobs.items()):
            for reason, n in sorted(j.rejected.items()):
                rej.add_metric([name, reason], n)
            if j.clock_skew_s is not None:
                skew.add_metric([name], j.clock_skew_s)
            state.add_metric([name], j.state_bytes)
        yield from (rej, skew, state)
        yield from _dashboard_families(s)

        # Job-level: the same on every agent of the job; aggregate with max.
        f = [
            (
                "costexporter_job_steps_completed",
                CounterMetricFamily,
                "Steps completed (rank 0).",
                "steps_completed",
                1,
            ),
            (
                "costexporter_job_steps_voided",
                CounterMetricFamily,
                "Steps voided by resumes.",
                "steps_voided",
                1,
            ),
            (
                "costexporter_job_valid_steps",
                GaugeMetricFamily,
                "Completed steps not voided.",
                "valid_steps",
                1,
            ),
            ("costexporter_job_tokens", GaugeMetricFamily, "Tokens of the valid steps.", "tokens", 1),
            (
                "costexporter_job_last_step",
                GaugeMetricFamily,
                "The newest completed step number.",
                "last_step",
                1,
            ),
            (
                "costexporter_job_last_step_timestamp_seconds",
                GaugeMetricFamily,
                "When the newest step completed (the last progress).",
                "last_step_ts",
                1,
            ),
            (
                "costexporter_job_last_checkpoint_timestamp_seconds",
                GaugeMetricFamily,
                "When the last checkpoint that saved a step ended.",
                "last_checkpoint_ts",
                1,
            ),
            (
                "costexporter_job_stall_threshold_seconds",
                GaugeMetricFamily,
                "No step for longer than this is progress stopped.",
                "stall_threshold_s",
                1,
            ),
            (
                "costexporter_job_last_progress_timestamp_seconds",
                GaugeMetricFamily,
                "The last progress point: the newest step, else the first registration. Never moves back.",
                "last_progress_ts",
                1,
            ),
            (
                "costexporter_job_in_allowance",
                GaugeMetricFamily,
                "1 while the job is inside a declared phase or its startup, within the allowance.",
                "in_allowance",
                1,
            ),
            ("costexporter_job_ended", GaugeMetricFamily, "1 once the run ended cleanly.", "ended", 1),
        ]
        for metric, kind, help_, key, scale in f:
            fam = kind(metric, help_, labels=["training_job"])
            for name, j in sorted(s.jobs.items()):
                if j.figures.get(key) is not None:
                    fam.add_metric([name], float(j.figures[key]) * scale)
            yield fam
        yield from _goodput_families(s)


# Band edges of the job's profile (figure key -> `edge` label), for the dashboard's thresholds.
BAND_EDGES = {"band_idle_max_w": "idle_max", "band_low_max_w": "low_max", "band_compute_min_w": "compute_min"}
JOB_INFO = ("team", "namespace", "cost_center", "progress")  # progress="none": a job without steps


def _goodput_families(s: AgentSnapshot) -> Iterator[Metric]:
    """Job-level inputs of the goodput rules (the same on every agent of a job: max): its ranks
    (ETTR's width), and what MFU divides (docs/accounting.md, goodput)."""
    ranks = GaugeMetricFamily(
        "costexporter_job_ranks",
        "Ranks the job registered: the GPUs its wall time is counted on (ETTR).",
        labels=["training_job"],
    )
    per_token = GaugeMetricFamily(
        "costexporter_job_model_flops_per_token",
        "The trainer's model FLOPs per token (model_flops_per_token, or 6 x model_params): MFU's numerator.",
        labels=["training_job"],
    )
    peak = GaugeMetricFamily(
        "costexporter_job_peak_flops",
        "Dense peak FLOPS of one of the job's GPUs for its dtype (its model's datasheet): MFU's denominator.",
        labels=["training_job"],
    )
    total = GaugeMetricFamily(
        "costexporter_job_total_steps",
        "The trainer's total_steps (meta): the cost-to-finish rule's steps left are it less the last step.",
        labels=["training_job"],
    )
    for name, j in sorted(s.jobs.items()):
        if j.ranks:
            ranks.add_metric([name], j.ranks)
        steps = forecast.total_steps_of(j.meta)
        if steps is not None:
            total.add_metric([name], steps)
        work = flops.work(j.meta, j.figures.get("gpu_name") or j.meta.get("gpu_model"), 0)
        if work.flops_per_token is not None and work.peak_flops is not None:
            per_token.add_metric([name], work.flops_per_token)
            peak.add_metric([name], work.peak_flops)
    yield from (ranks, per_token, peak, total)


def _dashboard_families(s: AgentSnapshot) -> Iterator[Metric]:
    """Job-level series the dashboard filters and draws with (the same on every agent: max):
    the job's team/namespace/cost center as an info series, and its profile's band edges."""
    info = GaugeMetricFamily(
        "costexporter_job_info",
        "1 per job: team, Kubernetes namespace and cost center as the operator's policy and the "
        "cluster attribute it, and progress (none: no steps) from its meta.",
        labels=["training_job", *JOB_INFO],
    )
    edges = GaugeMetricFamily(
        "costexporter_job_band_edge_watts",
        "Power edges of the band profile of the job's GPUs (idle_max, low_max, compute_min).",
        labels=["training_job", "edge"],
    )
    for name, j in sorted(s.jobs.items()):
        meta = j.meta
        info.add_metric([name, *(str(meta.get(k) or "") for k in JOB_INFO)], 1)
        for key, edge in BAND_EDGES.items():
            if j.figures.get(key) is not None:
                edges.add_metric([name, edge], float(j.figures[key]))
    yield info
    yield edges


def meta_ignored(counts: dict[tuple[str, str], int]) -> CounterMetricFamily:
    """Meta keys a job set that only the operator sets (booking thresholds, a price, an owner or
    a place no policy rule grants), ignored: counted once per job and key."""
    fam = CounterMetricFamily(
        "costexporter_meta_ignored",
        "Thresholds, prices, owners and places a job's meta tried to set that only the operator "
        "sets (flags or --policy, unless a policy rule grants the key): ignored, once per job and key.",
        labels=["training_job", "key"],
    )
    for (job, key), n in sorted(counts.items()):
        fam.add_metric([job, key], n)
    return fam


def data_rejected(counts: dict[tuple[str, str], int]) -> CounterMetricFamily:
    """Stored values a job's trainer can write that were refused, by job and reason (one family
    for the agent and the watcher)."""
    fam = CounterMetricFamily(
        "costexporter_data_rejected",
        "Stored values of a job refused (a key of the wrong type, a GPU claimed from the job that "
        "holds it, ...), by job and reason: that job's data is skipped, the other jobs go on. "
        "training_job is empty for keys across jobs (the jobs index, the registrations counter; "
        "index_cut: the jobs index held more names than a round takes, the jobs' ranks keys "
        "were scanned instead).",
        labels=["training_job", "reason"],
    )
    for (job, reason), n in sorted(counts.items()):
        fam.add_metric([job, reason], n)
    return fam


class WatchCollector(Collector):
    """The watcher's metrics: each job's state as a stateset, seconds since its last step and
    the suspect rank; the watcher's own health (Redis, webhook deliveries)."""

    def __init__(self, watcher: Watcher) -> None:
        self.watcher = watcher

    def collect(self) -> Iterator[Metric]:
        from costexporter.services.notify import STATES

        s = self.watcher.snapshot()
        info = GaugeMetricFamily("costexporter_watch_info", "The watcher: 1.", labels=["version"])
        info.add_metric([__version__], 1)
        yield info
        up = GaugeMetricFamily("costexporter_watch_redis_up", "Whether the last poll could read Redis.")
        up.add_metric([], 1 if s.redis_up else 0)
        yield up
        state = StateSetMetricFamily(
            "costexporter_job_state", "The job's state as the watcher decided it.", labels=["training_job"]
        )
        since = GaugeMetricFamily(
            "costexporter_job_seconds_since_last_step",
            "Seconds from the job's newest completed step to the watcher's last poll.",
            labels=["training_job"],
        )
        suspect = GaugeMetricFamily(
            "costexporter_job_suspect_rank",
            "The rank the watcher suspects (the one at 0%, or whose events diverge); -1: none.",
            labels=["training_job"],
        )
        for job, st in sorted(s.status.items()):
            state.add_metric([job], {name: name == st.state for name in STATES})
            if st.seconds_since_last_step is not None:
                since.add_metric([job], st.seconds_since_last_step)
            r = (st.suspect or {}).get("rank")
            suspect.add_metric([job], float(r) if r is not None else -1.0)
        yield from (state, since, suspect)
        transitions = CounterMetricFamily("costexporter_watch_transitions", "State transitions seen.")
        transitions.add_metric([], s.stats.get("transitions", 0))
        yield transitions
        wh = CounterMetricFamily(
            "costexporter_watch_webhook_deliveries",
            "Webhook notifications by outcome (sent, retries, failed, dropped).",
            labels=["outcome"],
        )
        for outcome in ("sent", "retries", "failed", "dropped"):
            wh.add_metric([outcome], s.webhook.get(outcome, 0))
        yield wh
        am = CounterMetricFamily(
            "costexporter_watch_alertmanager_posts",
            "Posts of alerts to Alertmanager by outcome (sent; retries; failed: given up after the "
            "retries; dropped: the queue was full).",
            labels=["outcome"],
        )
        for outcome in ("sent", "retries", "failed", "dropped"):
            am.add_metric([outcome], s.alertmanager.get(outcome, 0))
        yield am
        regs = CounterMetricFamily(
            "costexporter_registrations_rejected",
            "Ranks entries (registrations) refused, by job and reason.",
            labels=["training_job", "reason"],
        )
        for (job, reason), n in sorted(s.registrations_rejected.items()):
            regs.add_metric([job, reason], n)
        yield regs
        yield meta_ignored(s.meta_ignored)
        yield data_rejected(s.data_rejected)


def registry_for(agent: Agent) -> CollectorRegistry:
    return agent_registry(agent)[0]


def agent_registry(agent: Agent) -> tuple[CollectorRegistry, AgentCollector]:
    """The agent's /metrics registry and its collector (whose `prepare` the agent's loop calls
    after each round)."""
    collector = AgentCollector(agent)
    reg = CollectorRegistry(auto_describe=False)
    reg.register(collector)
    return reg, collector


def watch_registry(watcher: Watcher) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(WatchCollector(watcher))
    return reg
