"""Which jobs hold this node's GPUs: the trainers' registrations read (validated, the refused
ones counted), each job's ranks on this node's GPUs made its own, and a GPU that a later job
registers handed over from the earlier one."""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Any

from costexporter.core import jobfacts, shares
from costexporter.core.booking import NEG_INF, POS_INF
from costexporter.core.model import GpuIndex
from costexporter.services.agent_context import AgentContext
from costexporter.services.agent_fold import JobFolds
from costexporter.services.agent_job import AgentJob, held_until
from costexporter.services.agent_notes import JobNotes
from costexporter.services.agent_unassigned import UnassignedBooker
from costexporter.sources.base import GpuSource
from costexporter.store import protocol, untrusted
from costexporter.store.jobindex import JobIndex
from costexporter.store.keys import ranks_key, registrations_key
from costexporter.store.reader import EventReader

# A rank's claim of one of this node's GPUs: (its job, its registration, the GPU, whether its
# job's stored state booked the rank before: a claim made before, which stands).
_Claim = tuple[AgentJob, protocol.Registration, int, bool]


def _gpu_name(gpus: list[Any], g: int) -> str:
    """How a log line names the node's GPU `g`."""
    return f"GPU {gpus[g].index} of {untrusted.short(gpus[g].host)}" if g < len(gpus) else f"GPU #{g}"


@dataclasses.dataclass
class Found:
    """What a discovery found: the jobs it met for the first time, and those whose keys held
    the wrong type (set aside by the agent's `KeyGuard`; their claims are looked at again next
    round)."""

    new: list[str] = dataclasses.field(default_factory=list)
    wrong_type: dict[str, BaseException] = dataclasses.field(default_factory=dict)


class JobDiscovery:
    """Finds the jobs of this node's GPUs (its `jobs`, which the agent books), when the trainers'
    registrations counter moves, the node's GPUs change, or `job_refresh_s` has passed."""

    def __init__(
        self,
        ctx: AgentContext,
        source: GpuSource,
        folds: JobFolds,
        unassigned: UnassignedBooker,
        notes: JobNotes,
    ) -> None:
        self.redis = ctx.redis
        self.prefix = ctx.cfg.prefix
        self.source = source
        self.jobs: dict[str, AgentJob] = {}  # the jobs of this node's GPUs, by name
        self.folds = folds
        self.unassigned = unassigned
        self.refusals = ctx.refusals
        self._log_once = ctx.said
        self._redis_errors = ctx.redis_errors
        self._found = Found()
        self.last_refresh = 0.0
        self._reg_version: str | None = "?"  # the registrations counter at the last discovery
        self._reg_read: str | None = None  # ... and as this round read it
        self._reg_prev: str | None = "?"  # ... and as the discovery before read it
        self._gpus_seen: tuple[Any, ...] = ()  # the node's GPUs at the last discovery
        self.rejected: collections.Counter[tuple[str, str]] = collections.Counter()
        # the jobs to look at: the trainers' index, scanned around when it cannot be trusted
        self.index = JobIndex(ctx.redis, ctx.cfg.prefix, ctx.refusals, ctx.redis_errors)
        self._rejected_seen: set[tuple[str, str, int]] = set()
        # (reason, job, rank, GPU) said already: a rank moved off a UUID holder's GPU, registered
        # again on another GPU, left out of a GPU another rank of its job holds
        self._said: set[tuple[str, str, int, int | None]] = set()
        # (job, rank) -> the job whose live run its claim waits for, and the GPU
        self.deferred: dict[tuple[str, int], tuple[str, int]] = {}
        self._unread: set[int] = set()  # GPUs a job names whose state could not be read (a discovery)
        self.notes = notes

    def _uuids(self) -> dict[int, str | None]:
        """This node's GPUs' UUIDs by index (a claim naming one outranks one by host + index)."""
        return {g: gpu.uuid for g, gpu in enumerate(self.source.gpus())}

    def _gpu_ids(self) -> tuple[Any, ...]:
        return tuple((g.uuid, g.host, g.index) for g in self.source.gpus())

    def changed(self) -> bool:
        """Whether a register arrived since the last discovery (the trainers' counter moved; also
        when Redis lost it) or the node's GPUs changed (a source that finds them late): discovery
        then reads every job's registrations again."""
        try:
            raw = self.redis.get(registrations_key(self.prefix))
        except self._redis_errors as e:
            if not untrusted.is_wrong_type(e):
                raise
            self.refusals.refuse(
                "", "wrong_type", "the registrations counter is not a string: jobs are looked for every round"
            )
            return True
        self._reg_read = raw.decode() if isinstance(raw, bytes) else raw
        return self._reg_read != self._reg_version or self._gpu_ids() != self._gpus_seen

    def reject(self, job: str, rank_s: str, raw: str, reason: str, message: str) -> None:
        """Counted once per entry, logged once per job and reason; the job's other ranks go on."""
        seen = (job, rank_s[:100], hash(raw))  # not the entry itself: it may be a megabyte
        if seen in self._rejected_seen:
            return
        if len(self._rejected_seen) < 100_000:
            self._rejected_seen.add(seen)
        # (a job name is at most 200 characters: a longer one is cut for the metric's label too)
        self.rejected[(untrusted.short(job, 200), reason)] += 1
        self._log_once(
            ("registration", job, reason),
            logging.WARNING,
            "job %r: registration of rank %s rejected (%s): %s; counted in "
            "costexporter_registrations_rejected_total, the other ranks and jobs book on",
            untrusted.short(job),
            untrusted.short(rank_s),
            reason,
            message,
        )

    def _listed(self) -> list[str]:
        """The valid names of the jobs index (or of the jobs' ranks keys when the index is of the
        wrong type or flooded: `jobindex.JobIndex`), a bad one rejected, counted."""
        names = []
        for name in self.index.names():
            try:
                protocol.check_job(name)
            except ValueError as e:
                self.reject(name, "*", "", "bad_job_name", str(e))
                continue
            names.append(name)
        return names

    def discover(self) -> Found:
        """Jobs whose registered GPUs are this node's (by UUID, else host + index), into `jobs`;
        returns what was new, and which jobs' keys held the wrong type."""
        self._found = Found()
        self._discover()
        return self._found

    def _discover(self) -> None:
        self.last_refresh = time.monotonic()
        self._reg_version = "?"  # a discovery cut short by an error is run again next round
        self._gpus_seen = self._gpu_ids()
        if self.unassigned.until is None:
            self.unassigned.load()
        node_gpus = GpuIndex(self.source.gpus())
        self._unread = set()  # GPUs a job names whose state could not be read
        names = self._listed()
        # Every job's registrations in one round trip (512 jobs: one, not 512). A reply that is
        # an error (a ranks key of the wrong type) is that job's alone.
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(ranks_key(self.prefix, name))
        fresh, retry = [False], False
        claims: list[_Claim] = []
        for name, ranks in zip(names, pipe.execute(raise_on_error=False) if names else [], strict=True):
            if isinstance(ranks, Exception):
                if not untrusted.is_wrong_type(ranks):
                    raise ranks
                self.refusals.refuse(
                    name, "wrong_type", "its ranks key is not a hash: its registrations are not read"
                )
                continue
            try:
                claims += self._discover_job(name, ranks, node_gpus)
            except self._redis_errors as e:
                if not untrusted.is_wrong_type(e):
                    raise
                self._found.wrong_type.setdefault(name, e)
                retry = True  # its keys set aside: looked at again next round
        # The claims of this node's GPUs, those naming the GPU's UUID first, then by time: which job
        # the index lists first (a trainer's ZADD decides that) never decides who holds a GPU.
        if self._unread:  # (a claim made before stands: its job's stored state booked it)
            claims = [c for c in claims if c[3] or c[2] not in self._unread]
        uuids = self._uuids()
        claims.sort(
            key=lambda c: (not c[3] and c[1].gpu_uuid != uuids.get(c[2]), c[1].ts_ms, c[0].name, c[1].rank)
        )
        for job, reg, g, stored in claims:
            try:
                self._claim(job, reg, g, fresh, stored)
            except self._redis_errors as e:
                if not untrusted.is_wrong_type(e):
                    raise
                self._found.wrong_type.setdefault(job.name, e)
                retry = True
        for job in self.jobs.values():
            hosts: dict[str, list[int]] = {}
            for r, peer in sorted(job.ranks.items()):
                if r not in job.named:  # (a rank on this node's GPU that is not its own: no peer's)
                    hosts.setdefault(str(peer.host), []).append(r)
            job.peers.hosts = hosts
        self._handover()
        # A counter that moved since a discovery is looked at once more next round: on a cluster
        # it and a job's `:ranks` sit on different nodes, and the trainer's INCR may land before
        # its HSET. (Not after the first: that one reads what was there before the agent.)
        settled = not retry and (self._reg_prev == "?" or self._reg_read == self._reg_prev)
        self._reg_version = self._reg_read if settled else "?"
        self._reg_prev = self._reg_read

    def _discover_job(self, name: str, ranks: dict[str, str], node_gpus: GpuIndex) -> list[_Claim]:
        """One job's registrations read; returns its ranks on this node's GPUs not yet its own,
        for `_claim` once every job's are read. A rank's GPU is the one its time was first
        booked on (in memory, else in the stored state): a later registration naming another
        GPU is said and changes nothing, as replay has it (`jobfacts.one_rank_per_gpu`)."""
        job = self.jobs.get(name)
        regs = []
        for rank_s, raw in ranks.items():
            try:
                reg = protocol.parse_registration(rank_s, raw)
            except protocol.RegistrationError as e:
                self.reject(name, rank_s, raw, e.reason, str(e))
                continue
            g = node_gpus.find(reg.gpu_uuid, reg.host, reg.gpu)
            regs.append((reg, g))
        if job is None and all(g is None for _reg, g in regs):
            return []  # no GPU of this node: not this agent's job
        # Every rank of the job, the other hosts' too (whatever order the hash gives them):
        # their samples are read, and this agent's shared, only for ranks it knows of.
        claims = []
        for reg, g in regs:
            if job is None:
                job = self.jobs[name] = AgentJob(name, EventReader(self.redis, name, prefix=self.prefix))
                self._found.new.append(name)
                # its stored GPU starts and watermark before any claim or handover uses them (a
                # restarted agent would otherwise hand a crashed job time its successor booked)
                try:
                    self.folds.load(job)
                except self._redis_errors:
                    # Its claims are read next round: until then no other job's new claim of
                    # those GPUs is decided (it may date inside this job's run).
                    self._unread |= {x for _r, x in regs if x is not None}
                    raise
            job.newest_reg[reg.rank] = reg.ts_ms  # (the hash keeps the newest: a restart's)
            old = job.ranks.get(reg.rank)
            if old is not None:  # a restart registers again: the GPU is the job's from the
                # rank's first registration on (the hash keeps only the newest)
                reg = dataclasses.replace(reg, ts_ms=min(old.ts_ms, reg.ts_ms))
            booked_on = job.own.get(reg.rank, job.state.gpus.get(reg.rank))
            if booked_on is not None and booked_on != g:
                self._say_moved(job, reg, g, booked_on)
                reg = self._as_claimed(reg, old, booked_on, node_gpus)
                g = booked_on
            job.ranks[reg.rank] = reg
            if g is not None:
                job.named[reg.rank] = g
            else:
                job.named.pop(reg.rank, None)
            if g is not None and reg.rank not in job.own:
                claims.append((job, reg, g, reg.rank in job.state.starts))
        return self._one_rank_per_gpu(job, claims) if job is not None else claims

    def _as_claimed(
        self, reg: protocol.Registration, old: protocol.Registration | None, g: int, node_gpus: GpuIndex
    ) -> protocol.Registration:
        """A rank's registration naming the GPU it stays on, as its claim named it: by UUID or by
        host and index (who holds a GPU by its UUID decides between jobs, `_claim_refused`). The
        one read before says how; after a restart, a rank that registers by UUID now did then."""
        if old is not None and node_gpus.find(old.gpu_uuid, old.host, old.gpu) == g:
            return dataclasses.replace(reg, host=old.host, gpu=old.gpu, gpu_uuid=old.gpu_uuid)
        gpus = self.source.gpus()
        if g >= len(gpus):  # (the GPU left the node: nothing to name it by)
            return reg
        return dataclasses.replace(
            reg, host=gpus[g].host, gpu=gpus[g].index, gpu_uuid=gpus[g].uuid if reg.gpu_uuid else None
        )

    def _say_moved(self, job: AgentJob, reg: protocol.Registration, g: int | None, booked_on: int) -> None:
        """A rank registered again naming another GPU than the one its time is booked on: said
        once (counted), its time stays there."""
        gpus = self.source.gpus()
        where = f"GPU {reg.gpu} of {untrusted.short(reg.host)}" if g is None else _gpu_name(gpus, g)
        self._refuse_once(
            (job.name, reg.rank, g),
            "register_other_gpu",
            "rank %d registered again on %s; its time stays on %s, where it registered first",
            reg.rank,
            where,
            _gpu_name(gpus, booked_on),
        )

    def _refuse_once(
        self, who: tuple[str, int, int | None], reason: str, message: str, *args: object
    ) -> None:
        """`refusals.refuse` for (job, rank, GPU) `who`, the first time only: discovery meets the
        same registrations round after round."""
        if (reason, *who) in self._said:
            return
        self._said.add((reason, *who))
        self.refusals.refuse(who[0], reason, message, *args)

    def _one_rank_per_gpu(self, job: AgentJob, claims: list[_Claim]) -> list[_Claim]:
        """The claims of one job less those of a GPU another of its ranks holds or claims
        first (`jobfacts.one_rank_per_gpu`: a rank that holds it, in memory or as stored, before
        any new claim); each rank left out said once (counted)."""
        members = [(r, g, NEG_INF) for r, g in job.own.items()]
        members += [(reg.rank, g, NEG_INF if stored else reg.ts_ms) for _j, reg, g, stored in claims]
        _kept, dropped = jobfacts.one_rank_per_gpu(members)
        if not dropped:
            return claims
        out = {r for r, _g, _holder in dropped}
        gpus = self.source.gpus()
        for rank, g, holder in dropped:
            # the GPU the rank named first, where it stays when it registers again elsewhere
            job.state.gpus.setdefault(rank, g)
            self._refuse_once(
                (job.name, rank, g),
                "gpu_shared",
                "ranks %d and %d both registered %s; its time is booked once, for rank %d",
                holder,
                rank,
                _gpu_name(gpus, g),
                holder,
            )
        return [c for c in claims if c[1].rank not in out]

    def _claim(
        self, job: AgentJob, reg: protocol.Registration, g: int, fresh: list[bool], stored: bool = False
    ) -> None:
        """The rank's GPU made the job's own, unless another job holds it by its UUID, or with a
        live run (`stored`: the job's stored state booked the rank there before, a claim made
        before: it stands). A claim dated inside another job's live run starts where that run
        ended; while it runs the claim waits, said once and counted."""
        at = reg.ts_ms
        if not stored:
            if self._claim_refused(job, reg, g):
                return
            at, holder = self._takeover_at(job, reg, g)
            self.deferred.pop((job.name, reg.rank), None)
            if at >= POS_INF:
                self.deferred[(job.name, reg.rank)] = (holder, g)
                self._in_use(job, reg, g, holder)
                return
        if not fresh[0]:  # a twin agent may have booked `_unassigned` further
            self.unassigned.load(ahead_only=True)
            fresh[0] = True
        job.own[reg.rank] = g
        floor = self._booked_elsewhere(g, job, reg)
        # (a claim that waited starts where the run it waited for ended; one that did not keeps
        # its registration's date, which an earlier register read later can still move back)
        job.floors[reg.rank] = max(floor, at) if at > reg.ts_ms else floor

    def _takeover_at(self, job: AgentJob, reg: protocol.Registration, gpu: int) -> tuple[int, str]:
        """When the claim `reg` takes this GPU from the jobs that hold it before it
        (`jobfacts.takeover_at`: at once, or where a holder's live run ends, `POS_INF` while it
        runs), and the holder it waits for. A claim by the GPU's UUID is not held back by one
        that names it by index only (it outranks it: `_squatters_out`). A slice of a shared GPU
        (MIG, time-slicing) is shared by design."""
        gpus = self.source.gpus()
        if gpu < len(gpus) and gpus[gpu].lanes != shares.WHOLE:
            return reg.ts_ms, ""
        uuid_ = gpus[gpu].uuid if gpu < len(gpus) else None
        by_uuid = bool(uuid_) and reg.gpu_uuid == uuid_
        holds = []  # the holds of the claims dated before this one, in the order they hold
        for other in self.jobs.values():
            if other is job:
                continue
            for r, g in other.own.items():
                held = other.ranks.get(r)
                if g != gpu or held is None or (by_uuid and held.gpu_uuid != uuid_):
                    continue
                if held.ts_ms > reg.ts_ms:
                    continue  # a claim dated after this one: this claim's successor
                holds.append((other.claim(r)[0], other.name, other.live_hold(r)))
        at, holder = reg.ts_ms, ""
        for start, name, stretches in sorted(holds):
            # (a hold that began after this claim's date waited itself: this claim waits for it)
            t = jobfacts.takeover_at(max(at, start), stretches)
            if t > at:
                at, holder = t, name
        return at, holder

    def _in_use(self, job: AgentJob, reg: protocol.Registration, g: int, holder: str) -> None:
        """A claim that waits for a live run's end: counted once (`gpu_in_use`), logged once, and
        noted for both jobs, where the API shows it."""
        where = _gpu_name(self.source.gpus(), g)
        self.reject(
            job.name,
            str(reg.rank),
            f"{g}:{reg.ts_ms}:{holder}",
            "gpu_in_use",
            f"it names {where}, which job {untrusted.short(holder)!r} holds with a live run: its time stays "
            "that job's until the run ends (a clean end, or silent past its liveness timeout)",
        )
        self.notes.note(
            job.name,
            "gpu_in_use",
            f"rank {reg.rank} registered {where} while job {holder!r}'s run held it: that GPU is not "
            "this job's until that run ends",
            about=holder,
        )
        self.notes.note(
            holder,
            "gpu_claimed",
            f"job {job.name!r} registered {where} (rank {reg.rank}) while this job's run held it: refused, "
            "the GPU stays this job's until its run ends",
            about=job.name,
        )

    def deferred_due(self) -> bool:
        """Whether a claim waits for a run that has ended since (discover again now, so the
        claim starts where that run ended, not where the next discovery finds it)."""
        for holder, g in self.deferred.values():
            j = self.jobs.get(holder)
            if j is None or not any(g2 == g and j.claim(r)[1] >= POS_INF for r, g2 in j.own.items()):
                return True
        return False

    def _claim_refused(self, job: AgentJob, reg: protocol.Registration, gpu: int) -> bool:
        """A registration that names this GPU by host and index only, dated while another job
        holds it by its UUID (that job had not ended): refused (counted, logged), the holder keeps
        it, also after it ends. A
        trainer could otherwise move another job's GPU time to itself by naming the GPU's index;
        a real successor reads the UUID (the reporter does) and takes over as usual."""
        uuid_ = self._uuids().get(gpu)
        if not uuid_ or reg.gpu_uuid == uuid_:
            return False
        for other in self.jobs.values():
            if other is job or (other.end_at is not None and other.end_at <= reg.ts_ms):
                continue  # (a registration dated inside the holder's run stays refused after it)
            for r, g in other.own.items():
                held = other.ranks.get(r)
                if g == gpu and held is not None and held.gpu_uuid == uuid_ and held.ts_ms <= reg.ts_ms:
                    self.refusals.refuse(
                        job.name,
                        "gpu_held",
                        "rank %d names GPU %s of %s by its index, which job %r holds by its UUID %s: "
                        "refused, the GPU stays that job's (register with gpu_uuid to take it over)",
                        reg.rank,
                        reg.gpu,
                        untrusted.short(reg.host),
                        untrusted.short(other.name),
                        uuid_,
                    )
                    return True
        return False

    def _squatters_out(
        self, lst: list[tuple[int, str, int]], uuid_: str | None
    ) -> list[tuple[int, str, int]]:
        """A GPU's claims less those by host and index only that are dated inside the run of a
        job holding it by its UUID: a squatter that claimed it before that job's registration
        was read (it came late) leaves at that job's claim, counted, and never ends its run."""
        if not uuid_:
            return lst
        by_uuid = [(t, n, r) for t, n, r in lst if self.jobs[n].ranks[r].gpu_uuid == uuid_]
        out = []
        for t, name, r in lst:
            job = self.jobs[name]
            holders = [(n2, r2) for t2, n2, r2 in by_uuid if n2 != name and t2 <= t]
            holder = next((h for h in holders if _running_at(self.jobs[h[0]], t)), None)
            if job.ranks[r].gpu_uuid == uuid_ or holder is None:
                out.append((t, name, r))
                continue
            job.ends[r] = min(job.ends.get(r, POS_INF), self.jobs[holder[0]].claim(holder[1])[0])
            self._refuse_once(
                (name, r, None),
                "gpu_held",
                "rank %d named GPU %s by its index; job %r, registered earlier by its UUID %s, "
                "holds it: the rank leaves it (register with gpu_uuid to take it over)",
                r,
                job.ranks[r].gpu,
                untrusted.short(holder[0]),
                uuid_,
            )
        return out

    def _booked_elsewhere(self, gpu: int, new: AgentJob, reg: protocol.Registration) -> int:
        """How far this GPU's time is booked already (unassigned, or by another job) for the
        claim `reg`: a claim that arrives late starts there, so no GPU-second is booked twice.
        A job that registered the GPU after this claim (`reg`) takes it over where this
        claim's hold ends (`_handover`) and booked nothing before: a claim read late, after its
        successor's (its first round dropped), keeps the time before the successor's. Not so a
        claim by index under this claim by UUID (it leaves, `_squatters_out`), nor what a refused
        claim booked (`booked_unheld`): those stay floors wherever they lie."""
        uuid_ = self._uuids().get(gpu)
        by_uuid = bool(uuid_) and reg.gpu_uuid == uuid_

        def successor(j: AgentJob, r: int) -> bool:
            held = j.ranks[r]
            return held.ts_ms > reg.ts_ms and not (by_uuid and held.gpu_uuid != uuid_)

        until = self.unassigned.booked_until(gpu)
        for j in self.jobs.values():
            if j is new:
                continue
            for r, g in j.own.items():
                if g == gpu and not successor(j, r):
                    # How far that job booked this GPU (not its watermark: its hold may have
                    # ended), in memory and as stored: a twin agent (the same agent id) may
                    # have booked it further than this agent's memory says.
                    stored = self.folds.stored_state(j)
                    until = max(until, held_until(j.state, r), held_until(stored, r))
            for g, _start, end in j.booked_unheld():
                if g == gpu:
                    until = max(until, end)
        return until

    def _handover(self) -> None:
        """A GPU registered by a later job leaves the earlier job at the later one's start (the
        earlier one crashed without `run end`), as offline replay does."""
        claims: dict[int, list[tuple[int, str, int]]] = {}
        for j in self.jobs.values():
            for r, g in j.own.items():
                claims.setdefault(g, []).append((j.ranks[r].ts_ms, j.name, r))
        uuids = self._uuids()
        for g, lst in claims.items():
            lst.sort()
            lst = self._squatters_out(lst, uuids.get(g))
            for i, (_t, name, r) in enumerate(lst):
                later = [(n2, r2) for _t2, n2, r2 in lst[i + 1 :] if n2 != name]
                if later:
                    n2, r2 = later[0]
                    self.jobs[name].ends[r] = self.jobs[n2].claim(r2)[0]
                else:
                    self.jobs[name].ends.pop(r, None)


def _running_at(job: AgentJob, ts_ms: int) -> bool:
    """Whether the job's run had not ended (cleanly) by `ts_ms`."""
    return job.end_at is None or job.end_at > ts_ms
