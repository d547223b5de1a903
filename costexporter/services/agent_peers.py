"""The sample exchange between the agents of one job: each host publishes its ranks' samples
on the job's sample stream its name hashes to (`keys.samples_key`: at most `SAMPLE_STREAMS` a
job, each entry naming its host) and reads the others', so cross-rank signatures see every rank.
A round reads at most `SAMPLE_STREAMS` keys however wide the job: a key costs Redis more than an
entry. A host whose samples stop coming holds the booking horizon back only for a while."""

from __future__ import annotations

import collections
import time
from typing import Any

import numpy as np

from costexporter.core import samplewin
from costexporter.services.agent_context import AgentContext
from costexporter.services.agent_job import AgentJob
from costexporter.store.keys import samples_key

Local = tuple[np.ndarray, ...]  # this node's samples: (gpu, ts ms, W, %, mJ)


class PeerExchange:
    """Publishes this host's samples of a job and reads its other hosts' (one pipeline a round)."""

    def __init__(
        self,
        ctx: AgentContext,
        maxlen: int,
        grace_s: float,
    ) -> None:
        self.redis = ctx.redis
        self.prefix = ctx.cfg.prefix
        self.host = ctx.host
        self.stats: collections.Counter[str] = collections.Counter()
        self.maxlen = maxlen  # entries a host's stream keeps
        self.grace_s = grace_s  # how long a silent host still holds the horizon back
        self.started_at = time.monotonic()
        self.redis_back_at = 0.0  # when Redis was last back after an outage

    def has_peers(self, job: AgentJob) -> bool:
        """Whether another host holds ranks of the job: only then are its samples published (a
        job on this host alone needs no sample stream). A rank registered later on another host
        gets this host's samples then, from the whole context kept."""
        return any(h != self.host for h in job.peers.hosts)

    def _streams(self, job: AgentJob) -> dict[str, set[str]]:
        """The job's sample streams that carry another host's samples, and those hosts."""
        out: dict[str, set[str]] = {}
        for h in job.peers.hosts:
            if h != self.host:
                out.setdefault(samples_key(self.prefix, job.name, h), set()).add(h)
        return out

    def read(self, job: AgentJob, keep_from: int) -> None:
        """The other hosts' new sample entries of the job: one XRANGE a stream, pipelined (the
        streams lie in different Cluster slots), decoded as one array. A host read for the first
        time (a start, a restart, a host that joined) is read from its newest entry back to
        `keep_from` only, not its whole stream."""
        streams = self._streams(job)
        # A host that comes back is read back to what was taken of it before.
        job.peers.tailed &= job.peers.hosts.keys()
        if not streams:
            return
        first = {k: hs - job.peers.tailed for k, hs in streams.items()}
        first = {k: hs for k, hs in first.items() if hs}
        if first:
            back: list[bytes] = []
            self._tails(job, first, keep_from, back)
            if back:  # kept even if the reads below fail: these hosts count as read back
                job.peers.remote.add(samplewin.decode_entries(b"".join(back)))
        raw: list[bytes] = []
        # XRANGE from after the last entry read, not XREAD: a cluster client sends an XREAD's
        # keys to the server to learn its slot (COMMAND GETKEYS, a round trip each).
        pipe = self.redis.pipeline(transaction=False)
        for k in streams:
            pipe.xrange(k, min=f"({job.peers.ids[k]}", count=10_000)
        for k, entries in zip(streams, pipe.execute(), strict=True):
            for entry_id, f in entries:
                job.peers.ids[k] = entry_id
                self._take(job, streams[k], entry_id, f, raw)
        if raw:
            job.peers.remote.add(samplewin.decode_entries(b"".join(raw)))

    def _take(
        self, job: AgentJob, hosts: set[str], entry_id: str, f: dict[str, str], into: list[bytes]
    ) -> None:
        """An entry read: its packed samples onto `into` when one of `hosts` wrote it (this
        host's own, and a host not known yet, are skipped; a damaged one is counted)."""
        host = f.get("h")
        if host is None:
            self.stats["bad_sample_entries"] += 1
            return
        if host not in hosts:
            return
        job.peers.seen[host] = time.monotonic()
        job.peers.taken[host] = entry_id
        try:
            into.append(samplewin.entry_bytes(f))
        except (KeyError, ValueError):
            self.stats["bad_sample_entries"] += 1

    def _tails(
        self,
        job: AgentJob,
        streams: dict[str, set[str]],
        keep_from: int,
        into: list[bytes],
        chunk: int = 16,
    ) -> None:
        """The entries of `streams`' new hosts from the newest (or the stream's last entry read,
        after which the round's XRANGE takes them) back to each host's first whose samples all
        lie before `keep_from`, or to the last taken of it before, pipelined, `chunk` entries a
        stream at a time (doubling)."""
        got: dict[str, list[Any]] = {k: [] for k in streams}
        left = {k: set(hs) for k, hs in streams.items()}
        todo = {k: job.peers.ids.get(k, "+") for k in streams}
        newest: dict[str, str] = {}
        while todo:
            pipe = self.redis.pipeline(transaction=False)
            for k, hi in todo.items():
                pipe.xrevrange(k, max=hi, count=chunk)
            nxt = {}
            for k, entries in zip(todo, pipe.execute(), strict=True):
                if entries and k not in newest:
                    newest[k] = entries[0][0]
                for entry_id, f in entries:
                    host = f.get("h")
                    if host not in left[k]:
                        continue
                    if host in job.peers.taken and _id(entry_id) <= _id(job.peers.taken[host]):
                        left[k].discard(host)
                        continue
                    got[k].append((entry_id, f))
                    try:
                        old = int(samplewin.decode_entry(f)[1].max(initial=-1)) < keep_from
                    except (KeyError, ValueError):  # counted when taken
                        old = False
                    if old:
                        left[k].discard(host)
                if left[k] and len(entries) == chunk:
                    nxt[k] = f"({entries[-1][0]}"
            todo, chunk = nxt, chunk * 2
        for k, entries in got.items():
            job.peers.ids.setdefault(k, newest.get(k, "0-0"))
            for entry_id, f in entries[::-1]:
                self._take(job, streams[k], entry_id, f, into)
            job.peers.tailed |= streams[k]

    def window(self, job: AgentJob, local: Local, keep_from: int) -> tuple[Local, Local]:
        """Every rank's samples from `keep_from`, sorted by (rank, ts), and this agent's own
        (shared with the job's other agents as they come)."""
        gpu, ts, p, u, e = local
        lut = np.full(max([*job.own.values(), int(gpu.max(initial=-1))]) + 1, -1, np.int64)
        for r, g in job.own.items():
            lut[g] = r
        mine = lut[gpu] >= 0 if gpu.size else np.zeros(0, bool)
        own_rank, own_ts = lut[gpu[mine]], ts[mine]
        new = np.zeros(0, bool)
        if self.has_peers(job) and own_rank.size:
            ranks, at = np.unique(own_rank, return_inverse=True)
            published = job.peers.published_ts
            new = own_ts > np.asarray([published.get(r, -1) for r in ranks.tolist()], np.int64)[at]
        if new.any():
            key = samples_key(self.prefix, job.name, self.host)
            hosts = {*job.peers.hosts, self.host}
            sharing = sum(samples_key(self.prefix, job.name, h) == key for h in hosts)
            self.redis.xadd(
                key,
                samplewin.encode_entry(
                    (own_rank[new], own_ts[new], p[mine][new], u[mine][new], e[mine][new]), self.host
                ),
                maxlen=self.maxlen * sharing,  # `maxlen` entries for each host on it
                approximate=True,
            )
            for r in np.unique(own_rank[new]).tolist():
                job.peers.published_ts[r] = int(own_ts[new][own_rank[new] == r].max())
        # Only what is new is sorted into the window kept from the last round (samplewin.py).
        own = (own_rank, own_ts, p[mine], u[mine], e[mine])
        window = job.peers.remote.round(own, keep_from, set(job.own))
        return window, (own_rank, own_ts, p[mine], u[mine])

    def liveness(self, job: AgentJob) -> tuple[np.ndarray, np.ndarray, bool]:
        """(ranks that hold the horizon back, ranks to ignore, whether to wait this round).

        Another host's samples come once a round. Its ranks hold the horizon back while the host
        has published within `peer_timeout_s`, counted from its last entry or from when this
        agent's Redis came back (after an outage every host looks stale for a while). A host that
        has registered ranks but published nothing yet makes the round wait, within that time.
        """
        now = time.monotonic()
        hold: list[int] = []
        ignore: list[int] = []
        wait = False
        for host, ranks in job.peers.hosts.items():
            since = max(job.peers.seen.get(host, 0.0), self.redis_back_at, self.started_at)
            if now - since <= self.grace_s:
                if host in job.peers.seen:
                    hold += ranks
                else:
                    wait = True
            else:
                ignore += ranks
        return np.asarray(hold, np.int64), np.asarray(ignore, np.int64), wait


def _id(entry_id: str) -> tuple[int, int]:
    """A stream entry id, ordered as Redis orders them."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
