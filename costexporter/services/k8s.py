"""Kubernetes jobs without code changes: GPUs that dcgm-exporter attributes to a pod become a
job's ranks, registered in Redis exactly as a trainer's `StepReporter` would register them.

dcgm-exporter's Kubernetes mode labels each GPU's series with the `pod`, `namespace` and
`container` the device plugin gave it to (and, with `--kubernetes-enable-pod-labels`, the pod's
labels). The job is `<namespace>:<name>` (no `/`: a job name is one path segment of the finance
API), the name taken from the first configured pod label
present (Kubeflow, JobSet, batch Job), else from the pod name without its replica/ordinal/hash
suffixes. Such a job posts no steps, so its meta says `progress=none` and the booking books it by
band (`booking.band_timeline`): busy bands valid, idle and deadlock waste. Its meta records the
namespace (the API aggregates by it). When a trainer registers the same GPU itself, its events
win: this module leaves that GPU alone, and a rank-0 step switches the job to the step rules.

The agent books these jobs through its normal path; nothing here books.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterable

from costexporter.sources.dcgm import PodRef
from costexporter.store import protocol
from costexporter.store.keys import k8s_gpus_key, k8s_ranks_key
from costexporter.trainer.reporter import send_entries

log = logging.getLogger("costexporter.k8s")

DEFAULT_JOB_LABELS = (
    "training.kubeflow.org/job-name",
    "jobset.sigs.k8s.io/jobset-name",
    "batch.kubernetes.io/job-name",
)
# A pod name less the suffixes its controller adds: -worker-3, -launcher, -0-1, -x7k2p.
POD_NAME_RE = re.compile(
    r"^(?P<job>.+?)(?:-(?:master|worker|launcher|chief|ps|evaluator|replica|node|leader)s?)?"
    r"(?:-\d+)*(?:-[a-z0-9]{5})?$"
)
HEARTBEAT_S = 10.0
SESSION_PREFIX = "k8s:"
# One rank per GPU of a job, the same on every agent: allocated once, in the job's slot.
_ALLOCATE = """
local r = redis.call('HGET', KEYS[1], ARGV[1])
if r then return tonumber(r) end
r = redis.call('HINCRBY', KEYS[1], '_next', 1) - 1
redis.call('HSET', KEYS[1], ARGV[1], r)
return r
"""


def _label(labels: dict[str, str], name: str) -> str | None:
    """A pod label as dcgm-exporter may export it: as is, sanitized, or `label_`-prefixed."""
    clean = re.sub(r"[^A-Za-z0-9_]", "_", name)
    for k in (name, clean, f"label_{clean}"):
        if labels.get(k):
            return labels[k]
    return None


def job_name(ref: PodRef, job_labels: Iterable[str] = DEFAULT_JOB_LABELS) -> str:
    """`<namespace>:<job>` for the pod holding a GPU."""
    name = next((v for v in (_label(ref.labels, n) for n in job_labels) if v), None)
    if name is None:
        m = POD_NAME_RE.match(ref.pod)
        name = m.group("job") if m else ref.pod
    job = f"{ref.namespace}:{name}" if ref.namespace else name
    return protocol.check_job(re.sub(r"[^A-Za-z0-9._:@+=-]", "-", job)[:200])


class KubernetesJobs:
    """Registers the pods' GPUs of one node (one `DcgmSource`) as jobs, and ends a job when its
    last GPU on every node is released."""

    def __init__(
        self,
        redis,
        prefix: str,
        source,
        host: str,
        job_labels: Iterable[str] = DEFAULT_JOB_LABELS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.redis = redis
        self.prefix = prefix
        self.source = source
        self.host = host
        self.job_labels = tuple(job_labels) or DEFAULT_JOB_LABELS
        self.clock = clock
        self.session = f"{SESSION_PREFIX}{host}:{secrets.token_hex(4)}"
        self._seq = 0
        self.registered: dict[tuple[str, int], int] = {}  # (job, GPU index) -> rank
        self.skipped: set[tuple[str, int]] = set()  # GPUs a trainer registered itself
        self._beat: dict[str, float] = {}
        self._allocate = redis.register_script(_ALLOCATE)
        self.errors = 0

    # ---- one round ----------------------------------------------------------------------------
    def sync(self) -> None:
        """Register new pods' GPUs, heartbeat the live jobs, end the jobs whose GPUs all left."""
        pods, gpus = self.source.pods(), self.source.gpus()
        current: dict[tuple[str, int], PodRef] = {}
        for i, ref in pods.items():
            try:
                current[(job_name(ref, self.job_labels), i)] = ref
            except ValueError as e:  # a name no hash tag can hold: say so, skip the GPU
                log.warning("pod %s/%s: %s", ref.namespace, ref.pod, e)
        for (job, i), ref in sorted(current.items()):
            if (job, i) not in self.registered and (job, i) not in self.skipped and i < len(gpus):
                self._register(job, i, ref, gpus[i])
        for key in sorted(set(self.registered) - set(current)):
            self._release(*key)
        self.skipped &= set(current)
        now = self.clock()
        for job in sorted({j for j, _ in self.registered}):
            if now - self._beat.get(job, 0.0) >= HEARTBEAT_S:  # every rank: the watcher checks each
                ranks = sorted(r for (j, _), r in self.registered.items() if j == job)
                send_entries(
                    self.redis, self.prefix, job, [self._entry("heartbeat", job, r, now, {}) for r in ranks]
                )
                self._beat[job] = now

    def run(self, stop: threading.Event, interval_s: float = 5.0) -> None:
        """`sync()` every interval until `stop` is set; Redis errors are logged and retried."""
        import redis as redis_mod

        while not stop.is_set():
            try:
                self.sync()
            except (redis_mod.RedisError, OSError) as e:
                self.errors += 1
                log.warning("cannot register Kubernetes jobs (%s); retrying", e)
            stop.wait(interval_s)

    # ---- the parts ------------------------------------------------------------------------------
    def _gpu_key(self, gpu) -> str:
        return gpu.uuid or f"{gpu.host}:{gpu.index}"

    def _trainer_has(self, job: str, gpu) -> bool:
        """Whether a trainer (not this module) registered this GPU for the job: its events win."""
        for raw in self.redis.hvals(protocol.ranks_key(self.prefix, job)):
            e = _json(raw)
            if str(e.get("session", "")).startswith(SESSION_PREFIX):
                continue
            if gpu.uuid and e.get("gpu_uuid") == gpu.uuid:
                return True
            if e.get("host") == gpu.host and str(e.get("gpu")) == str(gpu.index):
                return True
        return False

    def _register(self, job: str, i: int, ref: PodRef, gpu) -> None:
        if self._trainer_has(job, gpu):
            self.skipped.add((job, i))
            return
        now = self.clock()
        k8s = k8s_ranks_key(self.prefix, job)
        rank = int(self._allocate(keys=[k8s], args=[self._gpu_key(gpu)]))
        pipe = self.redis.pipeline(transaction=True)
        pipe.sadd(k8s_gpus_key(self.prefix, job), self._gpu_key(gpu))
        pipe.hget(k8s, "_ended")
        pipe.hdel(k8s, "_ended")
        _, ended, _ = pipe.execute()
        entries = []
        if ended:  # the job's pods came back (a retried Job): its run starts again
            entries.append(self._entry("run", job, 0, now, {"state": "start"}))
        meta = {"progress": "none", "source": "kubernetes", "namespace": ref.namespace, "pod": ref.pod}
        if ref.container:
            meta["container"] = ref.container
        team = _label(ref.labels, "team")
        if team:
            meta["team"] = team
        if gpu.name:
            meta["gpu_model"] = gpu.name
        entries.append(self._entry("meta", job, rank, now, meta))
        entries.append(
            self._entry(
                "register",
                job,
                rank,
                now,
                {"host": gpu.host, "gpu_uuid": gpu.uuid, "gpu": gpu.index, "local_rank": gpu.index, "pid": 0},
            )
        )
        send_entries(self.redis, self.prefix, job, entries)
        self.registered[(job, i)] = rank
        log.info(
            "Kubernetes job %s: GPU %s of %s (pod %s) as rank %d", job, gpu.index, gpu.host, ref.pod, rank
        )

    def _release(self, job: str, i: int) -> None:
        """The pod let the GPU go; the job ends when no GPU of it is left on any node."""
        rank = self.registered[(job, i)]
        gpus = self.source.gpus()
        pipe = self.redis.pipeline(transaction=True)
        pipe.srem(k8s_gpus_key(self.prefix, job), self._gpu_key(gpus[i]))
        pipe.scard(k8s_gpus_key(self.prefix, job))
        _, left = pipe.execute()
        if left == 0:
            now = self.clock()
            send_entries(self.redis, self.prefix, job, [self._entry("run", job, 0, now, {"state": "end"})])
            self.redis.hset(k8s_ranks_key(self.prefix, job), "_ended", "1")
            log.info("Kubernetes job %s: its last GPU was released (rank %d): run end", job, rank)
        del self.registered[(job, i)]
        if not any(j == job for j, _ in self.registered):
            self._beat.pop(job, None)

    def _entry(self, type_: str, job: str, rank: int, ts: float, fields: dict) -> dict[str, str]:
        seq, self._seq = self._seq, self._seq + 1
        base = {"v": "1", "type": type_, "job": job, "ts": f"{ts:.6f}", "rank": rank}
        base.update(session=self.session, seq=seq)
        return protocol.encode_fields({**base, **fields})


def _json(raw: str) -> dict:
    try:
        e = json.loads(raw)
    except ValueError:
        return {}
    return e if isinstance(e, dict) else {}


def start_kubernetes_jobs(agent, job_labels: Iterable[str] = ()) -> KubernetesJobs:
    """Run the registrations beside an agent (a daemon thread, stopped with the agent)."""
    kj = KubernetesJobs(
        protocol.connect(agent.cfg.redis_url), agent.cfg.prefix, agent.source, agent.host, job_labels
    )
    threading.Thread(
        target=kj.run,
        args=(agent.stopping, min(agent.cfg.book_interval_s, 5.0)),
        name="costexporter-k8s",
        daemon=True,
    ).start()
    return kj
