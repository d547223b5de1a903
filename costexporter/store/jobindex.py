"""Which jobs exist, read so that no trainer can hide one: the trainers' jobs index, and when it
cannot be trusted, the jobs' own registration keys.

Every trainer may write the jobs index (`<prefix>:t:jobs`, a zset): a rogue one can create it
with the wrong type before anyone else (a fresh deployment, Redis restarted empty), or flood it
with names. Neither may stop discovery for the other jobs: an index of the wrong type, or one
holding more than `max_names` names, is refused (counted under an empty job: `wrong_type`,
`index_cut`) and the jobs are found by a `SCAN` over `<prefix>:t:{*}:ranks` instead, each job's
own key, which a trainer scoped to its job cannot forge for another. The scan is bounded (at
most `max_scanned` names, cut counted) and kept `scan_every_s`. An index score is never a reason
to drop a job: it only picks which jobs to look at first.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from costexporter.store import keys, untrusted
from costexporter.store.client import RedisClient

MAX_INDEX_NAMES = 50_000  # names one discovery or watcher poll takes from the index, at most
SCAN_EVERY_S = 60.0  # how long a scan of the jobs' ranks keys is kept


def _escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


class JobIndex:
    """The job names to look at this round (`names`), the index refused and scanned around
    when it is of the wrong type or over `max_names`."""

    def __init__(
        self,
        redis: RedisClient,
        prefix: str,
        refusals: untrusted.Refusals,
        redis_errors: tuple[type[BaseException], ...],
        max_names: int = MAX_INDEX_NAMES,
        max_scanned: int = MAX_INDEX_NAMES,
        scan_every_s: float = SCAN_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.redis = redis
        self.prefix = prefix
        self.refusals = refusals
        self._redis_errors = redis_errors
        self.max_names = max_names  # names taken from the index
        self.max_scanned = max_scanned  # ... and from a scan
        self.scan_every_s = scan_every_s
        self._clock = clock
        self._scanned: list[str] = []
        self._scanned_at: float | None = None
        self.scans = 0  # SCAN walks made
        self.fell_back = False  # whether the last `names` came from the scan
        # The last `names(min_score)`'s scores by name (the newest time each job's trainer
        # posted, as it says): empty when they came from the scan. A hint, never a proof.
        self.scores: dict[str, float] = {}

    def names(self, min_score: float | None = None) -> list[str]:
        """The index's names (those scored `min_score` or later when given), or, when the index
        is of the wrong type or holds more than `max_names` of them, every job's ranks key's."""
        key = keys.jobs_key(self.prefix)
        self.fell_back = True
        self.scores = {}
        try:
            if min_score is None:
                got = self.redis.zrange(key, 0, self.max_names)
            else:
                scored = self.redis.zrangebyscore(
                    key, min_score, "+inf", start=0, num=self.max_names + 1, withscores=True
                )
                got = [name for name, _ in scored]
        except self._redis_errors as e:
            if not untrusted.is_wrong_type(e):
                raise
            self.refusals.refuse(
                "", "wrong_type", "the jobs index is not a sorted set: the jobs' ranks keys are scanned"
            )
            return self.scanned()
        if len(got) > self.max_names:
            self.refusals.refuse(
                "",
                "index_cut",
                "the jobs index holds more than %d names: the jobs' ranks keys are scanned instead",
                self.max_names,
            )
            return self.scanned()
        self.fell_back = False
        if min_score is not None:
            self.scores = {n: float(v) for n, v in scored}
        return list(got)

    def scanned(self) -> list[str]:
        """Every job that has a ranks key (at most `max_scanned`, cut counted), kept `scan_every_s`."""
        now = self._clock()
        if self._scanned_at is not None and now - self._scanned_at < self.scan_every_s:
            return list(self._scanned)
        head = keys.ranks_key(self.prefix, "\0").split("\0")
        pattern = _escape(head[0]) + "*" + _escape(head[1])
        found: list[str] = []
        for k in self.redis.scan_iter(match=pattern, count=1000):
            k = k.decode() if isinstance(k, bytes) else k
            if len(found) >= self.max_scanned:
                self.refusals.refuse(
                    "", "index_cut", "more than %d jobs' ranks keys: the scan is cut", self.max_scanned
                )
                break
            found.append(k[len(head[0]) : len(k) - len(head[1])])
        self.scans += 1
        self._scanned, self._scanned_at = sorted(set(found)), now
        return list(self._scanned)

    def recent(self, names: list[str], since_s: float) -> list[str]:
        """Those of `names` whose own event stream's or heartbeat stream's newest entry was added
        at `since_s` (Unix s, Redis's clock: the entry id) or later: a scanned job judged by its
        streams, not a score (a job that only beats, hung for a day, is still heard from)."""
        if not names:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.xrevrange(keys.stream_key(self.prefix, name), count=1)
            pipe.xrevrange(keys.beats_key(self.prefix, name), count=1)
        replies = pipe.execute(raise_on_error=False)
        out = []
        for i, name in enumerate(names):
            for reply in replies[2 * i : 2 * i + 2]:
                if isinstance(reply, Exception):
                    if not untrusted.is_wrong_type(reply):
                        raise reply
                    out.append(name)  # the watcher's own read refuses it, counted per job
                    break
                if reply:
                    entry_id = reply[0][0]
                    entry_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                    if int(str(entry_id).split("-")[0]) >= since_s * 1000:
                        out.append(name)
                        break
        return out
