"""What the agent and the watcher show their /metrics collectors and the demo: one frozen view
each, taken under their lock (`Agent.snapshot()`, `Watcher.snapshot()`), read by attribute.

A collector builds every family from one snapshot (prometheus_client's custom-collector model):
nothing it reads changes while it renders, and a field the exporter reads that the snapshot does
not have is a type error, not a KeyError at scrape time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from costexporter.core.model import GpuId
    from costexporter.core.straggler import Named
    from costexporter.services.notify import Status
    from costexporter.sources.base import Reading


@dataclass(frozen=True, slots=True)
class JobView:
    """One job this agent books, as its collectors show it."""

    own: dict[int, int]  # rank -> this host's GPU index
    booked: np.ndarray  # category x (ms, mJ, micro-units): what the ledger holds for it
    voided: np.ndarray  # the same, of work a rollback voided
    figures: dict[str, Any]  # job-level figures (steps, profile, budget, thresholds)
    meta: dict[str, Any]  # its data keys, its owner and place the operator's (`attribution`)
    latest_band: dict[int, int]  # rank -> the band of its newest classified sample
    booked_until: int  # epoch ms
    at_risk_ms: int  # GPU time since the last checkpoint
    since_cost: int  # micro-units since the last checkpoint
    done: bool
    rejected: dict[str, int]  # its events refused, by reason
    clock_skew_s: float | None
    state_bytes: int  # the size of its fold state in Redis
    carbon_kg: float | None = None  # kgCO2e of the energy booked (None: no grid intensity given)
    ranks: int = 0  # the ranks the job registered (ETTR's width)
    slow_gpu_s: dict[int, float] = field(default_factory=dict)  # slow rank -> GPU-s on own GPUs
    slow_now: Named | None = None  # the rank slowing the job now, named on its latest steps


@dataclass(frozen=True, slots=True)
class AgentSnapshot:
    """An agent between rounds."""

    pending: int  # samples not yet booked
    host: str
    agent: str
    currency: str
    redis_up: bool
    id_refused: bool  # another host holds this agent id
    gpus: list[GpuId]
    latest: dict[int, Reading]  # GPU index -> its newest reading
    gpu_bands: dict[int, int]  # GPU index -> the band of its newest reading alone
    gpu_profiles: dict[int, tuple[str, str]]  # GPU index -> (profile, source) in use
    live_seq: int  # rounds that published live state: the exporter's cache key
    errors: dict[tuple[int, str], int]  # the source's read errors, by GPU and kind
    stats: dict[str, int]
    dropped: int  # samples the sampler's buffer dropped
    clock_steps: dict[str, int]
    clock_offset_s: float
    registrations_rejected: dict[tuple[str, str], int]
    meta_ignored: dict[tuple[str, str], int]
    data_rejected: dict[tuple[str, str], int]
    round_counts: list[int]  # the round-duration histogram's buckets
    round_sum: float
    jobs: dict[str, JobView]  # empty in a snapshot taken without them
    held: dict[int, tuple[str, int, int | None]]  # GPU index -> (job, rank, its newest band)
    jobs_key: tuple[Any, ...]  # changes whenever `jobs` may: the round, the jobs shown
    # (GPU index, kind, code) -> hardware events read (Xids, clock slowdowns)
    hardware: dict[tuple[int, str, int], int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class WatcherSnapshot:
    """A watcher between polls."""

    status: dict[str, Status]  # job -> its state
    redis_up: bool
    stats: dict[str, int]
    registrations_rejected: dict[tuple[str, str], int]
    meta_ignored: dict[tuple[str, str], int]
    data_rejected: dict[tuple[str, str], int]
    webhook: dict[str, int]  # posts by outcome
    alertmanager: dict[str, int]
    now: float  # the watcher's clock (a simulated one in the demo)
