"""Moving a deployment's keys from the legacy layout, `<prefix>:{<job>}:...`, to keys.py's.

Before the sub-prefixes every key of a job sat under `<prefix>:{<job>}:`, so no ACL could give a
trainer its events without the ledger. `migrate` moves each legacy key to its new name: in one
RENAME when nothing is there yet (a job's old and new keys share the hash tag, so this works on a
Redis Cluster too; the keys across jobs are copied with DUMP/RESTORE where slots differ).

An agent of this version moves them itself before its first booking round (`keyspace.ensure`,
the first of the keyspace's migrations): nothing
is booked from legacy keys and nothing twice, because each agent's watermark, fold and ledger
move whole, and it waits while an agent of the old version still runs (its node key, which
lives 30 s, says so), since that one would keep writing legacy keys. Trainers of the old
version go on writing legacy keys while their jobs run: every agent forwards what they write
(`forward`: events, registrations, meta, the jobs index, the counter) to the new keys, until
no such trainer is left. Forwarded events get new stream ids; the reader drops any it has seen
by (rank, session, seq).

When a key exists under both names: a trainer's keys are merged (events appended, the newer
registration of each rank kept, meta and readers' fields filled in, the jobs index by latest
time); short-lived state (status, live, node, simulation clock, idle level) keeps the new one;
a ledger, watermark or fold is never merged: it is left under its legacy name and reported as a
conflict, for a person to look at. A host's legacy sample stream is deleted, not moved: its
samples are a few seconds' band window for the job's other agents, and this version's agents
publish and read a job's shared sample streams (`keys.samples_key`) instead. So is the previous
release's per-host sample stream, `<prefix>:a:{<job>}:samples:<host>` (the only key of the
sub-prefixed layout that this module touches).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from costexporter.store import keys, redisconn
from costexporter.store.client import Pipeline, RedisClient

log = logging.getLogger("costexporter.migrate")

# Kinds of legacy key: how a collision with its new name is resolved.
EVENTS, RANKS, META, JOBS, COUNTER = "events", "ranks", "meta", "jobs", "counter"
READERS, FRESH, OWNED = "readers", "fresh", "owned"
STALE = "stale"  # read by no agent of this version: deleted

# A job's trainer keys (legacy suffix -> new builder), its readers and watcher keys.
_JOB_KEYS: dict[str, tuple[Callable[[str, str], str], str]] = {
    "events": (keys.stream_key, EVENTS),
    "ranks": (keys.ranks_key, RANKS),
    "meta": (keys.meta_key, META),
    "readers": (keys.readers_key, READERS),
    "status": (keys.status_key, FRESH),
}
# Every other key of a job was an agent's: `<prefix>:a:{<job>}:<same rest>`; these few of them
# are rewritten every round and keep the newer copy.
_FRESH_AGENT_PARTS = ("live",)
_CROSS: dict[str, tuple[Callable[[str], str], str]] = {
    "jobs": (keys.jobs_key, JOBS),
    "registrations": (keys.registrations_key, COUNTER),
    "epoch": (keys.epoch_key, OWNED),
    "simclock": (keys.simclock_key, FRESH),
    "demo": (keys.demo_key, FRESH),
    "demo:lease": (keys.demo_lease_key, FRESH),
}

_MOVE_EVENTS = """
local batch = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', tonumber(ARGV[1]))
for _, e in ipairs(batch) do
  redis.call('XADD', KEYS[2], '*', unpack(e[2]))
  redis.call('XDEL', KEYS[1], e[1])
end
if redis.call('XLEN', KEYS[1]) == 0 then redis.call('DEL', KEYS[1]) end
return #batch
"""
_EVENTS_BATCH = 1000


class OldAgentsRunning(RuntimeError):
    """Agents of the legacy layout still run: moving their keys now would lose their rounds."""

    def __init__(self, hosts: list[str]) -> None:
        shown = ", ".join(hosts[:5]) + (f" and {len(hosts) - 5} more" if len(hosts) > 5 else "")
        super().__init__(
            f"agents of the previous version still run on {shown} (their node keys are fresh): "
            "stop or upgrade them; the keys move once none has written for 30 s"
        )
        self.hosts = hosts


@dataclass
class Report:
    """What a migration did (or, dry, would do): keys moved, merged, dropped (a newer copy
    existed), deleted (no agent reads them now), events forwarded, and conflicts left under
    their legacy names."""

    moved: int = 0
    merged: int = 0
    dropped: int = 0
    deleted: int = 0
    events: int = 0
    conflicts: list[tuple[str, str]] = field(default_factory=list)
    plan: list[tuple[str, str, str]] = field(default_factory=list)  # (legacy, new, kind), dry runs

    @property
    def touched(self) -> int:
        return self.moved + self.merged + self.dropped + self.deleted

    def summary(self) -> str:
        return (
            f"{self.moved} renamed, {self.merged} merged, {self.dropped} dropped (a newer copy "
            f"existed), {self.deleted} deleted (sample streams no agent reads), "
            f"{self.events} events forwarded, {len(self.conflicts)} conflicts"
        )


def escape(text: str) -> str:
    """`text` as a SCAN pattern matching itself."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def new_name(prefix: str, key: str) -> tuple[str, str] | None:
    """(new key, kind) of a key of the legacy layout under `prefix`; None for any other key
    (a key of the new layout included: the two never read alike)."""
    head = prefix + ":"
    if not key.startswith(head):
        return None
    rest = key[len(head) :]
    if rest.startswith(keys.AGENT + ":{"):  # the previous release's per-host sample stream
        job, sep, tail = rest[len(keys.AGENT) + 2 :].partition("}:")
        host = tail.removeprefix("samples:")
        if sep and job and not any(c in job for c in "{#") and host != tail and host and ":" not in host:
            return keys.samples_key(prefix, job, host), STALE
        return None
    if rest.startswith("{"):
        job, sep, tail = rest[1:].partition("}:")
        if not sep or not job or "{" in job or not tail:
            return None
        if tail in _JOB_KEYS:
            build, kind = _JOB_KEYS[tail]
            return build(prefix, job), kind
        parts = tail.split(":")
        if len(parts) == 2 and parts[0] == "samples":  # a host's own sample stream
            return keys.samples_key(prefix, job, parts[1]), STALE
        kind = FRESH if parts[0] in _FRESH_AGENT_PARTS else OWNED
        return keys.job_key(prefix, keys.AGENT, job, *parts), kind
    if rest in _CROSS:
        build_cross, kind = _CROSS[rest]
        return build_cross(prefix), kind
    if rest.startswith("node:") and len(rest) > 5:
        return keys.node_key(prefix, rest[5:]), FRESH
    if rest.startswith("agentid:") and len(rest) > 8:
        return keys.agent_id_key(prefix, rest[8:]), FRESH
    if rest.startswith("gpu:") and rest.endswith(":idle") and len(rest) > 9:
        return keys.gpu_idle_key(prefix, rest[4:-5]), FRESH
    return None


def legacy_keys(client: RedisClient, prefix: str) -> list[tuple[str, str, str]]:
    """Every key of the legacy layout under `prefix`: (legacy, new, kind), found by one SCAN."""
    out = []
    for k in client.scan_iter(match=escape(prefix) + ":*", count=1000):
        k = k.decode() if isinstance(k, bytes) else k
        got = new_name(prefix, k)
        if got is not None:
            out.append((k, *got))
    return out


def old_agents(found: list[tuple[str, str, str]], prefix: str) -> list[str]:
    """Hosts whose legacy agent wrote its node key in the last 30 s (the key's TTL)."""
    head = keys.legacy_key(prefix, "node", "")
    return sorted(k[len(head) :] for k, _new, _kind in found if k.startswith(head))


def migrate(client: RedisClient, prefix: str, *, force: bool = False, dry_run: bool = False) -> Report:
    """Move every legacy key under `prefix` (see the module's docstring). OldAgentsRunning while
    an agent of the legacy layout still runs, unless `force`."""
    from costexporter.store import ledger

    found = legacy_keys(client, prefix)
    hosts = old_agents(found, prefix)
    if hosts and not force:
        raise OldAgentsRunning(hosts)
    report = Report()
    if dry_run:
        report.plan = sorted(found)
        return report
    # The trainers' keys first: a job's events are in place before its ledger. The keys `ensure`
    # looks for last: an agent starting meanwhile sees one, moves along (a key moved by the
    # other is skipped), and books only once every key has its new name.
    order = {EVENTS: 0, RANKS: 0, META: 0, JOBS: 1, COUNTER: 1, READERS: 2, FRESH: 3, OWNED: 3, STALE: 3}
    markers = set(legacy_markers(prefix))
    for old, new, kind in sorted(found, key=lambda f: (f[0] in markers, order[f[2]], f[0])):
        move(client, old, new, kind, report)
    # What the API does at its start, for ledgers written before the incident index and the
    # rollups: also here, for an API whose read-only user cannot.
    ledger.index_incidents(client, prefix)
    ledger.build_rollups(client, prefix)
    return report


def forward(client: RedisClient, prefix: str) -> Report:
    """Move what trainers of the legacy layout wrote since the last call: the jobs in the legacy
    jobs index (their events, registrations and meta), the index and the counter. Two reads
    when there is none; no SCAN."""
    report = Report()
    legacy_jobs, legacy_counter = keys.legacy_key(prefix, "jobs"), keys.legacy_key(prefix, "registrations")
    pipe = client.pipeline(transaction=False)
    pipe.exists(legacy_jobs)
    pipe.exists(legacy_counter)
    has_jobs, has_counter = pipe.execute()
    if not has_jobs and not has_counter:
        return report
    for job in client.zrange(legacy_jobs, 0, -1) if has_jobs else []:
        job = job.decode() if isinstance(job, bytes) else job
        for suffix in ("events", "ranks", "meta"):
            build, kind = _JOB_KEYS[suffix]
            move(client, keys.legacy_job_key(prefix, job, suffix), build(prefix, job), kind, report)
    if has_jobs:
        move(client, legacy_jobs, keys.jobs_key(prefix), JOBS, report)
    if has_counter:
        move(client, legacy_counter, keys.registrations_key(prefix), COUNTER, report)
    return report


def move(client: RedisClient, old: str, new: str, kind: str, report: Report) -> None:
    """Move one key: rename it when `new` is free, else resolve the collision by `kind`; a key
    no agent reads now is deleted."""
    import redis
    from redis.exceptions import RedisClusterException

    if kind == STALE:
        report.deleted += client.delete(old)
        return

    try:
        cluster: Any = client  # (keyslot: the cluster client's alone)
        if redisconn.is_cluster(client) and cluster.keyslot(old) != cluster.keyslot(new):
            raise RedisClusterException("CROSSSLOT")  # the cluster client would refuse it itself
        renamed = client.renamenx(old, new)
    except (redis.ResponseError, RedisClusterException) as e:
        text = str(e)
        if "no such key" in text.lower():
            return  # moved by another agent meanwhile, or expired
        if "CROSSSLOT" not in text:
            raise
        renamed = _copy_across_slots(client, old, new)
        if renamed is None:
            return
    if renamed:
        report.moved += 1
        return
    _collide(client, old, new, kind, report)


def _copy_across_slots(client: RedisClient, old: str, new: str) -> bool | None:
    """RENAMENX where the two names hash to different slots (a cluster's keys across jobs):
    DUMP, RESTORE with its TTL, then DEL. None when the key is gone; False when `new` exists."""
    import redis

    pipe = client.pipeline(transaction=False)
    pipe.dump(old)
    pipe.pttl(old)
    payload, ttl = pipe.execute()
    if payload is None:
        return None
    try:
        client.restore(new, max(int(ttl), 0), payload)
    except redis.ResponseError as e:
        if "BUSYKEY" in str(e):
            return False
        raise
    client.delete(old)
    return True


def _collide(client: RedisClient, old: str, new: str, kind: str, report: Report) -> None:
    """Both names exist: merge, drop the legacy copy, or leave it as a conflict."""
    if kind == EVENTS:
        script = redisconn.script(client, _MOVE_EVENTS)
        while True:
            n = int(script(keys=[old, new], args=[_EVENTS_BATCH]))
            report.events += n
            if n < _EVENTS_BATCH:
                break
        report.merged += 1
    elif kind in (RANKS, META, READERS):
        _merge_hash(client, old, new, newer_registration if kind == RANKS else None)
        report.merged += 1
    elif kind == JOBS:
        _merge_then_delete(client, old, lambda pairs: client.zadd(new, dict(pairs), gt=True), zset=True)
        report.merged += 1
    elif kind == COUNTER:
        _merge_then_delete(client, old, lambda _v: client.execute_command("INCR", new), zset=False)
        report.merged += 1
    elif kind == FRESH or client.dump(old) == client.dump(new):
        client.delete(old)
        report.dropped += 1
    else:
        report.conflicts.append((old, new))


def _merge_hash(client: RedisClient, old: str, new: str, pick: Callable[[str, str], bool] | None) -> None:
    """Fill `new`'s hash from `old`'s and delete `old`, in one transaction on the job's slot
    (WATCH: a trainer writing `old` meanwhile makes it run again). `pick(old value, new value)`
    says whether the old value replaces a new one; without it the new one stays."""

    def run(pipe: Pipeline) -> None:
        theirs = pipe.hgetall(old)
        ours = pipe.hgetall(new)
        take = {f: v for f, v in theirs.items() if f not in ours or (pick is not None and pick(v, ours[f]))}
        pipe.multi()
        if take:
            pipe.hset(new, mapping=take)
        pipe.delete(old)

    client.transaction(run, old, new)


def _merge_then_delete(client: RedisClient, old: str, merge: Callable[[Any], Any], *, zset: bool) -> None:
    """Merge `old` into a key of another slot (the jobs index, the counter), then delete it
    unless it changed meanwhile (then merge again)."""
    for _ in range(100):
        with client.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(old)
                value = pipe.zrange(old, 0, -1, withscores=True) if zset else pipe.get(old)
                if value:
                    merge(value)
                pipe.multi()
                pipe.delete(old)
                pipe.execute()
                return
            except _watch_error():
                continue


def _watch_error() -> type[Exception]:
    import redis

    return redis.WatchError


def newer_registration(theirs: str, ours: str) -> bool:
    """Whether a legacy registration of a rank is newer than the one under the new name (by its
    `ts`; an unreadable one never wins)."""

    def ts(raw: str | bytes) -> float:
        try:
            t = float(json.loads(raw).get("ts"))
        except (ValueError, TypeError, AttributeError, RecursionError):
            return -math.inf
        return t if math.isfinite(t) else -math.inf

    return ts(theirs) > ts(ours)


class LayoutPending(Exception):
    """The agent waits for the legacy keys to be moved before it books anything."""


_said: set[str] = set()


def _once(key: str, level: int, msg: str, *args: object) -> None:
    if key not in _said:
        _said.add(key)
        log.log(level, msg, *args)


def legacy_markers(prefix: str) -> list[str]:
    """The legacy keys whose presence says a move is due or under way (`migrate` moves them last)."""
    return [keys.legacy_key(prefix, n) for n in ("jobs", "epoch", "registrations")]


def forward_quietly(client: RedisClient, prefix: str) -> bool:
    """`forward`, logging what it moved; False when this user may not read the legacy names
    (the caller stops asking)."""
    import redis

    try:
        report = forward(client, prefix)
    except redis.exceptions.NoPermissionError:
        _once("noperm", logging.INFO, "legacy keys are not readable under this ACL: nothing to forward")
        return False
    if report.touched:
        _once(
            "forward",
            logging.WARNING,
            "trainers of the previous version still write legacy keys under %s: forwarding them",
            prefix,
        )
    return True
