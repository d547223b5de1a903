"""The reporter's spool: where events wait on local disk while Redis cannot take them, and the
sending of them once it can: this reporter's own file, and the files that crashed or exited
reporters of this host left for the same Redis and prefix (`spool.py` is the file format).
Used by the sender thread only, under its I/O lock."""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from costexporter.trainer import spool
from costexporter.trainer.transport import Encoder, Event, NotNow, Wire, weight

log = logging.getLogger("costexporter.client")

# Send entries: (entries, the stats key for what the server refuses, spooled) -> (arrived,
# the indices to retry). Raises on a dead connection.
Deliver = Callable[[list[dict[str, str]], str, bool], tuple[int, list[int]]]


class Spooler:
    """This reporter's spool file and the others'. `stats` and `log_once` are the sender's."""

    def __init__(
        self,
        wire: Wire,
        spool_dir: Path,
        destination: str,
        encoder: Encoder,
        stats: collections.Counter[str],
        log_once: Callable[..., None],
        *,
        batch_size: int,
        retry_errors: tuple[type[Exception], ...],
    ) -> None:
        self.wire = wire
        self.spool_dir = spool_dir
        self.destination = destination
        name = f"{spool.safe_name(wire.prefix)}.{spool.safe_name(wire.job)}.{wire.session}.jsonl"
        self.spool_path = spool_dir / name
        self.spool = spool.SpoolFile(self.spool_path, destination, wire.prefix)
        self.encoder = encoder
        self.stats = stats
        self._log_once = log_once
        self.batch_size = batch_size
        self.retry_errors = retry_errors
        self._bad_files: set[Path] = set()

    def put_late(self, events: list[Event], inflight: int) -> None:
        """Closing while a send is stuck: what is queued goes to a file of its own (the stuck
        send keeps the main one); what is in flight cannot be placed."""
        late = spool.SpoolFile(self.spool_path.with_suffix(".late.jsonl"), self.destination, self.wire.prefix)
        try:
            self.put(events, late)
        finally:
            self.close(late)
        if inflight:
            self._count_lost(inflight, "a send did not return in time")

    def close(self, f: spool.SpoolFile) -> None:
        """Close a spool file; its writes went to the OS unbuffered, so there is nothing left to
        lose here, and a disk error on closing is only logged (close() never raises for it)."""
        try:
            f.close()
        except OSError as e:
            self._log_once(f"close:{e.errno}", "costexporter: cannot close spool %s (%s)", f.path, e)

    def drain_own(self, deliver: Deliver, ping: Callable[[], object], stopping: Callable[[], bool]) -> None:
        """Send this reporter's own spool (older than anything in memory) once Redis is back."""
        if not self.spool.lines:
            return
        ping()  # while Redis is down, do not re-read a big spool every round
        entries = self.spool.read()
        remaining = entries
        try:
            while remaining and not stopping():
                chunk, rest = remaining[: self.batch_size], remaining[self.batch_size :]
                ok, retry = deliver(chunk, "rejected", True)
                self.stats["sent"] += ok
                self.stats["unspooled"] += sum(map(weight, chunk)) - sum(weight(chunk[i]) for i in retry)
                remaining = [chunk[i] for i in retry] + rest
                if retry:
                    raise NotNow(f"{len(retry)} spooled events refused for now")
        finally:
            if remaining is not entries:
                self.spool.replace(remaining)

    def drain_others(
        self, deliver: Deliver, ping: Callable[[], object], stopping: Callable[[], bool]
    ) -> None:
        """Send the spool files that crashed or exited reporters left for this Redis and prefix."""
        pinged = False
        for path in spool.others(self.spool_dir, self.wire.prefix, skip=self.spool_path):
            if stopping():
                return
            if path in self._bad_files:
                continue
            if not pinged:
                ping()  # while Redis is down, do not re-read the files every round
                pinged = True
            with spool.claim(path) as f:
                if f is None:
                    continue
                head = spool.read_header(f)
                if spool.mismatch(path, head, self.destination, self.wire.prefix) or head is None:
                    continue  # (mismatch() refuses a file without a header: head is a dict here)
                try:
                    if self._send_file(f, head, deliver, stopping):
                        path.unlink()
                except self.retry_errors:
                    raise
                except Exception:  # an unreadable file must not stop this reporter's own events
                    self._bad_files.add(path)
                    log.exception("costexporter: cannot send spool %s; leaving it", path)

    def _send_file(
        self, f: TextIO, head: dict[str, Any], deliver: Deliver, stopping: Callable[[], bool]
    ) -> bool:
        """Send a claimed file's events; on any stop, keep what is unsent in it. True: all sent."""
        remaining, skipped = spool.entries_of(f)
        total = len(remaining)
        if skipped:  # torn or corrupted lines: nothing of them can be sent
            self.stats["spool_corrupt_lines"] += skipped
            log.warning("costexporter: spool %s: %d corrupted lines skipped", f.name, skipped)
        try:
            while remaining and not stopping():
                chunk, rest = remaining[: self.batch_size], remaining[self.batch_size :]
                ok, retry = deliver(chunk, "drain_rejected", True)
                self.stats["drained"] += ok
                remaining = [chunk[i] for i in retry] + rest
                if retry:
                    raise NotNow(f"{len(retry)} spooled events refused for now")
        finally:
            if remaining and len(remaining) != total:
                spool.rewrite(f, head, remaining)
        return not remaining

    def put(self, batch: list[Event], into: spool.SpoolFile | None = None) -> None:
        """Encode and append to this reporter's spool (or `into`); counted spooled, or lost.
        The heartbeats of ranks other than 0 are not spooled: sent late they say nothing (only
        the watcher reads them), and a reporter of an older release that drained the file would
        post them to the events stream, where their seqs (the heartbeats' own) could pass for
        events' (counted `heartbeats_unsent`). Rank 0's are on the events' seqs and date its
        run's signs of life: spooled with the events."""
        if not self.encoder.beats_are_events and any(ev[0] == "heartbeat" for ev in batch):
            kept = [ev for ev in batch if ev[0] != "heartbeat"]
            self.stats["heartbeats_unsent"] += len(batch) - len(kept)
            batch = kept
        if not batch:
            return
        entries, _, _ = self.encoder.encode(batch)
        n = sum(map(weight, entries))
        try:
            (into or self.spool).append(entries)
            self.stats["spooled"] += n
        except OSError as e:
            self._count_lost(n, e)

    def _count_lost(self, n: int, why: object) -> None:
        """Events that could not even be spooled (a full, read-only or forbidden disk): counted
        in stats['lost'], logged once per reason (a disk stays full for every later try)."""
        self.stats["lost"] += n
        self._log_once(
            f"lost:{getattr(why, 'errno', None) or why}",
            "costexporter: cannot spool to %s (%s): %d events lost (counted in stats['lost'])",
            self.spool_path,
            why,
            n,
        )
