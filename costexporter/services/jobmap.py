"""Which job held each GPU of a past window, for replay, as the registrations a trainer would have
posted: pods seen on the GPUs (dcgm-exporter's labels) named as the live Kubernetes path names
them (`k8s_owner.owner_of`, with the pod's owner and labels from kube-state-metrics' history
where the trace comes from Prometheus), or by a job map file; a SLURM `sacct` export by node and
time.

A job made from pods has no trainer: it declares itself stepless (booked by band, as the live
agent books a pod without a reporter) unless its steps come from elsewhere (an events file,
TensorBoard), and its run ends at its last reading, after which its GPUs are free.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from costexporter.core import timeutil
from costexporter.core.booking import STEPLESS_META
from costexporter.core.diagnostics import Diagnostics, InputError
from costexporter.core.model import Event, GpuId
from costexporter.services.history import PodFacts, PodSpan
from costexporter.services.k8s_owner import job_id, owner_of
from costexporter.sources.dcgm import PodRef
from costexporter.store.protocol import job_segment

SESSION = "replay-jobmap"


@dataclass(frozen=True, slots=True)
class SlurmJob:
    """One allocation of a `sacct -P` export: its nodes, its time, its GPUs per node (None: the
    export does not say)."""

    job_id: str
    name: str
    nodes: tuple[str, ...]
    start_ms: int
    end_ms: int | None  # None: still running when exported
    gpus_per_node: int | None


@dataclass(frozen=True)
class JobMap:
    """A job map file: pods by name (`namespace/pod` or a bare pod name) -> job, and SLURM jobs."""

    pods: Mapping[tuple[str, str], str] = field(default_factory=dict)
    slurm: tuple[SlurmJob, ...] = ()


def load(path: Path, tz: str) -> JobMap:
    """A CSV with columns `pod`, `job` and optionally `namespace`; or `sacct -P` output (a header
    with JobID, NodeList, Start and End, fields split by '|')."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise InputError(f"{path}: cannot read the job map: {e.strerror or e}") from None
    first = text.split("\n", 1)[0]
    if "|" in first and "jobid" in first.lower():
        return JobMap(slurm=tuple(_sacct(path, text, tz)))
    rows = list(csv.DictReader(io.StringIO(text)))
    cols = {c.strip().lower() for c in (rows[0].keys() if rows else first.split(","))}
    if not {"pod", "job"} <= cols:
        raise InputError(
            f"{path}: a job map needs columns pod and job (namespace optional), or is `sacct -P` "
            f"output with JobID, NodeList, Start and End (got {', '.join(sorted(cols)) or 'no header'})"
        )
    pods: dict[tuple[str, str], str] = {}
    for row in rows:
        r = {k.strip().lower(): (v or "").strip() for k, v in row.items() if k}
        if r.get("pod") and r.get("job"):
            try:
                pods[(r.get("namespace", ""), r["pod"])] = job_segment(r["job"])
            except ValueError as e:
                raise InputError(f"{path}: {e}") from None
    return JobMap(pods=pods)


def _sacct(path: Path, text: str, tz: str) -> list[SlurmJob]:
    lines = [x for x in text.splitlines() if x.strip()]
    head = [h.strip().lower() for h in lines[0].split("|")]
    need = {"jobid", "nodelist", "start", "end"}
    if not need <= set(head):
        raise InputError(
            f"{path}: a sacct export needs {', '.join(sorted(need))} "
            "(sacct -P -o JobID,JobName,NodeList,Start,End,AllocTRES)"
        )
    zone = timeutil.tz_zone(tz)
    out = []
    for n, line in enumerate(lines[1:], 2):
        row = dict(zip(head, (x.strip() for x in line.split("|")), strict=False))
        if "." in row.get("jobid", "") or not row.get("nodelist") or row["nodelist"] == "None assigned":
            continue  # a job step (1234.batch), or a job that never ran
        try:
            start = timeutil.to_ms(timeutil.parse_instant(row["start"], zone))
        except ValueError:
            raise InputError(f"{path}:{n}: start {row['start']!r} is no time") from None
        end_text = row.get("end", "")
        try:
            end = (
                None
                if end_text in ("", "Unknown", "None")
                else timeutil.to_ms(timeutil.parse_instant(end_text, zone))
            )
        except ValueError:
            raise InputError(f"{path}:{n}: end {end_text!r} is no time") from None
        nodes = tuple(expand_hostlist(row["nodelist"]))
        gpus = _tres_gpus(row.get("alloctres", ""))
        per_node = None if gpus is None else gpus // max(len(nodes), 1)
        out.append(SlurmJob(row["jobid"], row.get("jobname") or row["jobid"], nodes, start, end, per_node))
    return out


def _tres_gpus(tres: str) -> int | None:
    m = re.search(r"gres/gpu(?::[^=,]+)?=(\d+)", tres)
    return int(m.group(1)) if m else None


def expand_hostlist(text: str) -> list[str]:
    """SLURM's compressed host list ('gpu[01-03,07],login1') as names."""
    out: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", text):
        m = re.match(r"^([^\[]*)\[([^\]]*)\](.*)$", part)
        if not m:
            out.append(part)
            continue
        pre, body, post = m.groups()
        for rng in body.split(","):
            lo, _, hi = rng.partition("-")
            if not hi:
                out.append(f"{pre}{lo}{post}")
                continue
            width = len(lo)
            out += [f"{pre}{i:0{width}d}{post}" for i in range(int(lo), int(hi) + 1)]
    return out


def pod_jobs(
    spans: Iterable[PodSpan],
    job_map: JobMap | None = None,
    owners: Mapping[tuple[str, str], PodFacts] | None = None,
) -> dict[PodRef, str]:
    """Each pod's job: the job map's name, else as the live Kubernetes path names it
    (`k8s_owner.job_id`: `<namespace>:<workload>`), the workload from the owner and labels
    kube-state-metrics knew, else from the labels dcgm-exporter exported and the pod's name."""
    out: dict[PodRef, str] = {}
    for s in spans:
        p = s.pod
        if p in out:
            continue
        mapped = None
        if job_map is not None:
            mapped = job_map.pods.get((p.namespace, p.pod)) or job_map.pods.get(("", p.pod))
        if mapped:
            out[p] = mapped
            continue
        known = (owners or {}).get((p.namespace, p.pod)) or PodFacts()
        owner = owner_of(p.namespace, p.pod, {**p.labels, **known.labels}, known.owner_refs)
        out[p] = job_id(p, owner.name)
    return out


def span_events(spans: Iterable[PodSpan], names: Mapping[PodRef, str], interval_ms: int) -> list[Event]:
    """The registrations, the stepless declaration and the run end of each pod-made job."""
    by_job: dict[str, list[PodSpan]] = {}
    for s in spans:
        by_job.setdefault(names[s.pod], []).append(s)
    out: list[Event] = []
    for job, js in sorted(by_job.items()):
        js.sort(key=lambda s: (s.first_ms, s.host, s.gpu))
        first = min(s.first_ms for s in js)
        field_, value = STEPLESS_META
        pods = sorted({s.pod.pod for s in js})
        out.append(Event("meta", job, first, 0, SESSION, -1, {field_: value, "pod": ",".join(pods[:10])}))
        ranks: dict[tuple[str, int], int] = {}
        for s in js:
            key = (s.host, s.gpu)
            if key in ranks:
                continue
            ranks[key] = len(ranks)
            reg: dict[str, object] = {"host": s.host, "gpu": s.gpu}
            if s.uuid:
                reg["gpu_uuid"] = s.uuid
            out.append(Event("register", job, s.first_ms, ranks[key], SESSION, -1, reg))
        last = max(s.last_ms for s in js) + interval_ms
        out.append(Event("run", job, last, 0, SESSION, -1, {"state": "end"}))
    return out


def slurm_events(
    jobs: Iterable[SlurmJob], gpus: list[GpuId], trace_end_ms: int, diag: Diagnostics
) -> list[Event]:
    """Registrations and run ends of SLURM allocations on the trace's GPUs, by node and time. A
    job given fewer GPUs than its node has is not placed (the export does not say which), said."""
    by_host: dict[str, list[GpuId]] = {}
    for g in gpus:
        by_host.setdefault(g.host, []).append(g)
    out: list[Event] = []
    for j in jobs:
        rank = 0
        job = job_segment(j.name if j.name == j.job_id else f"{j.name}-{j.job_id}")
        registers: list[Event] = []
        for node in j.nodes:
            node_gpus = sorted(by_host.get(node, []), key=lambda g: g.index)
            if not node_gpus:
                continue
            if j.gpus_per_node is not None and j.gpus_per_node < len(node_gpus):
                diag.warn(
                    "job map",
                    None,
                    "slurm_partial_node",
                    f"SLURM job {j.job_id} holds {j.gpus_per_node} of {node}'s {len(node_gpus)} GPUs; "
                    "the export does not say which: not placed",
                )
                continue
            for g in node_gpus:
                reg: dict[str, object] = {"host": g.host, "gpu": g.index}
                if g.uuid:
                    reg["gpu_uuid"] = g.uuid
                registers.append(Event("register", job, j.start_ms, rank, SESSION, -1, reg))
                rank += 1
        if not registers:
            continue
        field_, value = STEPLESS_META
        out.append(Event("meta", job, j.start_ms, 0, SESSION, -1, {field_: value, "slurm_job_id": j.job_id}))
        out += registers
        end = j.end_ms if j.end_ms is not None else trace_end_ms
        out.append(Event("run", job, end, 0, SESSION, -1, {"state": "end"}))
    return out
