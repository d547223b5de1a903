"""Kubernetes jobs without code changes: GPUs that dcgm-exporter attributes to a pod become a
job's ranks, registered in Redis exactly as a trainer's `StepReporter` would register them.

dcgm-exporter's Kubernetes mode labels each GPU's series with the `pod`, `namespace` and
`container` the device plugin gave it to (and, with `--kubernetes-enable-pod-labels`, the pod's
labels). The job is `<namespace>:<name>` (no `/`: a job name is one path segment of the finance
API), the name that of the workload owning the pod (`k8s_owner`: PyTorchJob, JobSet, Volcano
Job, LeaderWorkerSet, batch Job, Deployment, StatefulSet), read from the pod object through the
Kubernetes API where the agent may (`k8s_api`), else from the labels dcgm-exporter exported and
the pod name. Such a job posts no steps, so its meta says `progress=none` and the booking books it by
band (`booking.band_timeline`): busy bands valid, idle and deadlock waste. Its meta records the
namespace (the API aggregates by it). When a trainer registers the same GPU itself, its events
win: this module leaves that GPU alone, and a rank-0 step switches the job to the step rules.

The agent books these jobs through its normal path; nothing here books.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, cast

from costexporter.core.attribution import Facts
from costexporter.core.model import GpuId
from costexporter.services.k8s_api import NodePods, PodLookup
from costexporter.services.k8s_owner import DEFAULT_TEAM_LABELS, Owner, job_id, owner_of, owner_of_pod
from costexporter.sources.dcgm import DcgmSource, PodRef
from costexporter.store import keys, protocol, redisconn, untrusted
from costexporter.store.client import RedisClient
from costexporter.trainer.transport import send_entries

if TYPE_CHECKING:
    from costexporter.services.agent import Agent

log = logging.getLogger("costexporter.k8s")

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


def owner(
    ref: PodRef,
    job_labels: Iterable[str] = (),
    team_labels: Iterable[str] = DEFAULT_TEAM_LABELS,
    lookup: PodLookup | None = None,
) -> Owner:
    """The workload holding a pod: from its object in the API when `lookup` can read it, else
    from what dcgm-exporter exported."""
    obj = lookup.get(ref.namespace, ref.pod) if lookup is not None and ref.namespace else None
    if obj is not None:
        return owner_of_pod(obj, job_labels=job_labels, team_labels=team_labels)
    return owner_of(ref.namespace, ref.pod, ref.labels, job_labels=job_labels, team_labels=team_labels)


def job_name(ref: PodRef, job_labels: Iterable[str] = (), lookup: PodLookup | None = None) -> str:
    """`<namespace>:<job>` for the pod holding a GPU."""
    return job_id(ref, owner(ref, job_labels, lookup=lookup).name)


class KubernetesJobs:
    """Registers the pods' GPUs of one node (one `DcgmSource`) as jobs, and ends a job when its
    last GPU on every node is released."""

    def __init__(
        self,
        redis: RedisClient,
        prefix: str,
        source: DcgmSource,
        host: str,
        job_labels: Iterable[str] = (),
        clock: Callable[[], float] = time.time,
        team_labels: Iterable[str] = DEFAULT_TEAM_LABELS,
        lookup: PodLookup | None = None,
        node_pods: NodePods | None = None,
    ) -> None:
        self.redis = redis
        self.node_pods = node_pods
        self._asked: set[tuple[str, str]] = set()  # pods a new node list was asked for
        self.prefix = prefix
        self.source = source
        self.host = host
        self.job_labels = tuple(job_labels)
        self.team_labels = tuple(team_labels)
        self.lookup = lookup
        self.clock = clock
        self.session = f"{SESSION_PREFIX}{host}:{secrets.token_hex(4)}"
        self._seq = 0
        self.registered: dict[tuple[str, int], int] = {}  # (job, GPU index) -> rank
        self.skipped: set[tuple[str, int]] = set()  # GPUs a trainer registered itself
        self._beat: dict[str, float] = {}
        self._allocate = redis.register_script(_ALLOCATE)
        self.errors = 0
        self.facts: dict[str, Facts] = {}  # job -> what the cluster says of it (`attribution`)
        # Parts of a round Redis refused for good (a key of the job's of the wrong type): set
        # aside so the other jobs go on; each job's first refusal is logged as a warning.
        self.refused = 0
        self._refused_jobs: set[str] = set()
        # What is to be written, in order, kept until Redis acknowledged it: (job, entries, whether
        # the write marks the job ended). A write whose reply was lost (Redis died after applying
        # it) is sent again whole: its entries keep their seqs, so readers take each once.
        self._outbox: list[tuple[str, list[dict[str, str]], bool]] = []

    # ---- one round ----------------------------------------------------------------------------
    def sync(self) -> None:
        """Register new pods' GPUs, heartbeat the live jobs, end the jobs whose GPUs all left."""
        self._flush()  # what an outage interrupted, first
        pods, gpus = self.source.pods(), self.source.gpus()
        current: dict[tuple[str, int], tuple[PodRef, Owner]] = {}
        for i, ref in pods.items():
            try:
                own = owner(ref, self.job_labels, self.team_labels, self.lookup)
                current[(job_id(ref, own.name), i)] = (ref, own)
            except ValueError as e:  # a name no hash tag can hold: say so, skip the GPU
                log.warning("pod %s/%s: %s", ref.namespace, ref.pod, e)
        unlisted = False
        for (job, i), (ref, own) in sorted(current.items(), key=lambda kv: kv[0]):
            if (job, i) not in self.registered and (job, i) not in self.skipped and i < len(gpus):
                if self._unlisted(ref):
                    unlisted = True
                    continue
                self._for_job(job, "its registration", self._register, job, i, ref, own, gpus[i])
        if unlisted and self.node_pods is not None:
            self.node_pods.refresh(force=True)
        for key in sorted(set(self.registered) - set(current)):
            self._for_job(key[0], "a release", self._release, *key)
        self.skipped &= set(current)
        self._asked &= {(ref.namespace, ref.pod) for ref, _own in current.values()}
        now = self.clock()
        for job in sorted({j for j, _ in self.registered}):
            if now - self._beat.get(job, 0.0) >= HEARTBEAT_S:  # every rank: the watcher checks each
                ranks = sorted(r for (j, _), r in self.registered.items() if j == job)
                self._for_job(
                    job,
                    "its heartbeats",
                    send_entries,
                    self.redis,
                    self.prefix,
                    job,
                    [self._entry("heartbeat", job, r, now, {}) for r in ranks],
                    beats_cap=protocol.beats_cap(max(ranks) + 1),  # the job's heartbeat stream
                )
                self._beat[job] = now

    def run(self, stop: threading.Event, interval_s: float = 5.0) -> None:
        """`sync()` every interval until `stop` is set; Redis errors are logged and retried."""
        import redis as redis_mod

        while not stop.is_set():
            if self.node_pods is not None:
                self.node_pods.refresh()
            try:
                self.sync()
            except (redis_mod.RedisError, OSError) as e:
                self.errors += 1
                log.warning("cannot register Kubernetes jobs (%s); retrying", e)
            stop.wait(interval_s)

    # ---- the parts ------------------------------------------------------------------------------
    def _unlisted(self, ref: PodRef) -> bool:
        """A pod dcgm-exporter names that the node's last pod list did not hold: it may share
        its GPU through HAMi, which that list would say. Its GPU waits for one new list (asked
        for now); a pod still not listed then is registered as dcgm-exporter names it."""
        if self.node_pods is None or self.node_pods.listed(ref.namespace, ref.pod):
            return False
        key = (ref.namespace, ref.pod)
        if key in self._asked:
            return False
        self._asked.add(key)
        return True

    def _gpu_key(self, gpu: GpuId) -> str:
        return gpu.uuid or f"{gpu.host}:{gpu.index}"

    def _trainer_has(self, job: str, gpu: GpuId) -> bool:
        """Whether a trainer (not this module) registered this GPU for the job: its events win."""
        for raw in self.redis.hvals(keys.ranks_key(self.prefix, job)):
            e = _json(raw)
            if str(e.get("session", "")).startswith(SESSION_PREFIX):
                continue
            if gpu.uuid and e.get("gpu_uuid") == gpu.uuid:
                return True
            if e.get("host") == gpu.host and str(e.get("gpu")) == str(gpu.index):
                return True
        return False

    def _register(self, job: str, i: int, ref: PodRef, own: Owner, gpu: GpuId) -> None:
        # What the cluster says of the job (its namespace, owner, team label): the operator's
        # side, read by this node's agent for the job's attribution (never written as meta).
        # Submitted: the earliest creation of its pods (a pod that came back later waits no more).
        before = self.facts.get(job)
        created = [t for t in (own.created, before.submitted_at if before else None) if t is not None]
        first = min(created, default=None)
        self.facts[job] = Facts(ref.namespace, own.name, own.kind, own.team or None, first)
        if self._trainer_has(job, gpu):
            self.skipped.add((job, i))
            return
        now = self.clock()
        k8s = keys.k8s_ranks_key(self.prefix, job)
        rank = int(self._allocate(keys=[k8s], args=[self._gpu_key(gpu)]))
        pipe = self.redis.pipeline(transaction=True)
        pipe.sadd(keys.k8s_gpus_key(self.prefix, job), self._gpu_key(gpu))
        pipe.hget(k8s, "_ended")
        pipe.hdel(k8s, "_ended")
        _, ended, _ = pipe.execute()
        entries = []
        if ended:  # the job's pods came back (a retried Job): its run starts again
            entries.append(self._entry("run", job, 0, now, {"state": "start"}))
        meta = {"progress": "none", "source": "kubernetes", "pod": ref.pod, "owner_kind": own.kind}
        if ref.container:
            meta["container"] = ref.container
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
        # Held from here on: the GPU is in the job's set, so its release must end the job even
        # if the registration's reply is lost in an outage (it is sent again).
        self.registered[(job, i)] = rank
        self._send(job, entries)
        log.info(
            "Kubernetes job %s: GPU %s of %s (pod %s) as rank %d", job, gpu.index, gpu.host, ref.pod, rank
        )

    def _release(self, job: str, i: int) -> None:
        """The pod let the GPU go; the job ends when no GPU of it is left on any node."""
        rank = self.registered[(job, i)]
        gpus = self.source.gpus()
        pipe = self.redis.pipeline(transaction=True)
        pipe.srem(keys.k8s_gpus_key(self.prefix, job), self._gpu_key(gpus[i]))
        pipe.scard(keys.k8s_gpus_key(self.prefix, job))
        _, left = pipe.execute()
        del self.registered[(job, i)]
        if not any(j == job for j, _ in self.registered):
            self._beat.pop(job, None)
        if left == 0:
            log.info("Kubernetes job %s: its last GPU was released (rank %d): run end", job, rank)
            self._send(job, [self._entry("run", job, 0, self.clock(), {"state": "end"})], ended=True)

    def _send(self, job: str, entries: list[dict[str, str]], ended: bool = False) -> None:
        """Queue a write and send what is queued (an outage leaves it queued: `_flush`)."""
        self._outbox.append((job, entries, ended))
        self._flush()

    def _flush(self) -> None:
        """Send the queued writes in order; each leaves the queue once Redis acknowledged it."""
        while self._outbox:
            job, entries, ended = self._outbox[0]
            self._for_job(job, f"{len(entries)} event(s)", self._write, job, entries, ended)
            self._outbox.pop(0)

    def _write(self, job: str, entries: list[dict[str, str]], ended: bool) -> None:
        send_entries(self.redis, self.prefix, job, entries)
        if ended:
            self.redis.hset(keys.k8s_ranks_key(self.prefix, job), "_ended", "1")

    def _for_job(self, job: str, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """One job's part of a round. A refusal that would come again (`redisconn.retryable`:
        a key of the job's of the wrong type, a command the ACL denies) sets the part aside,
        counted, and the other jobs on this node go on; an outage, or a refusal that passes
        (Redis full, failing over), raises: the round goes again, the queued writes first."""
        import redis as redis_mod

        try:
            fn(*args, **kwargs)
        except redis_mod.ResponseError as e:
            if redisconn.retryable(e):
                raise
            self.refused += 1
            first = job not in self._refused_jobs
            self._refused_jobs.add(job)
            log.log(
                logging.WARNING if first else logging.DEBUG,
                "Kubernetes job %s: Redis refused %s (%s); set aside, the other jobs go on",
                untrusted.short(job),
                what,
                e,
            )

    def _entry(self, type_: str, job: str, rank: int, ts: float, fields: dict[str, Any]) -> dict[str, str]:
        seq, self._seq = self._seq, self._seq + 1
        base = {"v": "1", "type": type_, "job": job, "ts": f"{ts:.6f}", "rank": rank}
        base.update(session=self.session, seq=seq)
        return protocol.encode_fields({**base, **fields})


def _json(raw: str) -> dict[str, Any]:
    """A ranks entry as a dict ({} when it is not one: a trainer may have written anything)."""
    try:
        e = untrusted.loads(raw)
    except untrusted.UntrustedValue:
        return {}
    return e if isinstance(e, dict) else {}


def start_kubernetes_jobs(
    agent: Agent,
    job_labels: Iterable[str] = (),
    team_labels: Iterable[str] = DEFAULT_TEAM_LABELS,
    lookup: PodLookup | None = None,
    node_pods: NodePods | None = None,
) -> KubernetesJobs:
    """Run the registrations beside an agent (a daemon thread, stopped with the agent); with
    `node_pods`, the node's pod list is refreshed on that thread (the caller gives the source its
    `allocations` before the first sample, so a shared GPU is never booked whole)."""
    kj = KubernetesJobs(
        protocol.connect(agent.cfg.redis_url),
        agent.cfg.prefix,
        cast(DcgmSource, agent.source),  # serve starts this for --source dcgm only
        agent.host,
        job_labels,
        team_labels=team_labels or DEFAULT_TEAM_LABELS,
        lookup=lookup,
        node_pods=node_pods,
    )
    agent.booker.facts = kj.facts
    threading.Thread(
        target=kj.run,
        args=(agent.stopping, min(agent.cfg.book_interval_s, 5.0)),
        name="costexporter-k8s",
        daemon=True,
    ).start()
    return kj
