"""The sample exchange between the agents of one job: each host publishes its ranks' samples
on its own stream (`:samples:<host>`) and reads the others', so cross-rank signatures see every
rank. A host whose samples stop coming holds the booking horizon back only for a while."""

from __future__ import annotations

import collections
import time
from typing import Any

import numpy as np

from costexporter.core import samplewin
from costexporter.services.agent_job import AgentJob
from costexporter.store.keys import samples_key

Local = tuple[np.ndarray, ...]  # this node's samples: (gpu, ts ms, W, %, mJ)


class PeerExchange:
    """Publishes this host's samples of a job and reads its other hosts' (one XREAD a round)."""

    def __init__(
        self,
        redis: Any,
        prefix: str,
        host: str,
        stats: collections.Counter[str],
        maxlen: int,
        grace_s: float,
    ) -> None:
        self.redis = redis
        self.prefix = prefix
        self.host = host
        self.stats = stats
        self.maxlen = maxlen  # entries a host's stream keeps
        self.grace_s = grace_s  # how long a silent host still holds the horizon back
        self.started_at = time.monotonic()
        self.redis_back_at = 0.0  # when Redis was last back after an outage

    def has_peers(self, job: AgentJob) -> bool:
        """Whether another host holds ranks of the job: only then are its samples published (a
        job on this host alone needs no sample stream). A rank registered later on another host
        gets this host's samples then, from the whole context kept."""
        return any(h != self.host for h in job.peers.hosts)

    def read(self, job: AgentJob, keep_from: int) -> None:
        """The other hosts' new sample entries of the job: one XREAD for all of them, decoded as
        one array. A host read for the first time (a start, a restart) is read from its newest
        entry back to `keep_from` only, not its whole stream."""
        hosts = sorted(h for h in job.peers.hosts if h != self.host)
        if not hosts:
            return
        keys = {samples_key(self.prefix, job.name, h): h for h in hosts}
        raw: list[bytes] = []
        first = {k: h for k, h in keys.items() if h not in job.peers.ids}
        if first:
            self._tails(job, first, keep_from, raw)
        resp = self.redis.xread({k: job.peers.ids[h] for k, h in keys.items()}, count=10_000)
        for k, entries in resp or []:
            self._take(job, keys[k.decode() if isinstance(k, bytes) else k], entries, raw)
        if raw:
            job.peers.remote.add(samplewin.decode_entries(b"".join(raw)))

    def _take(self, job: AgentJob, host: str, entries: list[Any], into: list[bytes]) -> None:
        """A host's entries read: their packed samples onto `into` (a damaged one is counted)."""
        if entries:
            job.peers.seen[host] = time.monotonic()
        for entry_id, f in entries:
            job.peers.ids[host] = entry_id
            try:
                into.append(samplewin.entry_bytes(f))
            except (KeyError, ValueError):
                self.stats["bad_sample_entries"] += 1

    def _tails(
        self, job: AgentJob, keys: dict[str, str], keep_from: int, into: list[bytes], chunk: int = 16
    ) -> None:
        """Each stream's entries from the newest back to the first whose samples all lie before
        `keep_from`, pipelined, `chunk` entries a stream at a time (doubling)."""
        got: dict[str, list[Any]] = {k: [] for k in keys}
        todo = {k: "+" for k in keys}
        while todo:
            pipe = self.redis.pipeline(transaction=False)
            for k, hi in todo.items():
                pipe.xrevrange(k, max=hi, count=chunk)
            nxt = {}
            for k, entries in zip(todo, pipe.execute(), strict=True):
                for entry_id, f in entries:
                    got[k].append((entry_id, f))
                    try:
                        old = int(samplewin.decode_entry(f)[1].max(initial=-1)) < keep_from
                    except (KeyError, ValueError):  # counted when taken
                        old = False
                    if old:
                        break
                else:
                    if len(entries) == chunk:
                        nxt[k] = f"({entries[-1][0]}"
            todo, chunk = nxt, chunk * 2
        for k, entries in got.items():
            job.peers.ids[keys[k]] = "0-0"
            self._take(job, keys[k], entries[::-1], into)

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
            self.redis.xadd(
                samples_key(self.prefix, job.name, self.host),
                samplewin.encode_entry(
                    (own_rank[new], own_ts[new], p[mine][new], u[mine][new], e[mine][new])
                ),
                maxlen=self.maxlen,
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
