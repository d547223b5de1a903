"""The reporter's spool: events that could not reach Redis, on local disk, one JSON entry a line.

A spool file belongs to one reporter session and one destination. Its first line records the
destination (the Redis URL without user or password, and the key prefix), so a spool is only ever
sent where it was meant to go. The writing reporter holds an exclusive `flock` on its file for as
long as it lives; another process sends a file only after taking that lock, so a live writer's
file is never taken from under it, and a crashed writer's lock is released by the kernel.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO, cast
from urllib.parse import urlsplit

log = logging.getLogger("costexporter.client")

HEADER_KEY = "costexporter_spool"
_warned: set[tuple[str, str]] = set()


def destination(url: str) -> str:
    """The Redis a URL points at, without credentials or options: `redis://host:port/db`."""
    u = urlsplit(url)
    scheme = (u.scheme or "redis").lower()
    if scheme == "unix":
        return f"unix://{u.path}"
    db = (u.path or "/0").strip("/") or "0"
    host = (u.hostname or "127.0.0.1").lower()
    try:
        port = u.port or 6379
    except ValueError:
        port = 6379
    return f"{scheme}://{host}:{port}/{db}"


def safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)[:120]


def header(dest: str, prefix: str) -> dict[str, str]:
    return {HEADER_KEY: "1", "destination": dest, "prefix": prefix}


def is_header(d: object) -> bool:
    return isinstance(d, dict) and HEADER_KEY in d


def _encode(entry: dict[str, str]) -> str:
    return json.dumps(entry, separators=(",", ":")) + "\n"


def _write(f: TextIO, text: str) -> None:
    """Write at the file's end with the OS call itself, never through Python's buffer: a write
    the disk refuses (full, read-only) raises here, and leaves nothing buffered for a later write
    or close() to fail on again."""
    data = text.encode("utf-8", "surrogateescape")
    fd = f.fileno()
    while data:
        n = os.write(fd, data)
        data = data[n:]


class SpoolFile:
    """One reporter's spool file, opened and locked on first write, kept locked until `close`.
    Not thread-safe: the reporter serializes its use."""

    def __init__(self, path: Path, dest: str, prefix: str) -> None:
        self.path = path
        self._header = header(dest, prefix)
        self._f: TextIO | None = None
        self.lines = 0  # entries in the file now (the header not counted)

    def append(self, entries: list[dict[str, str]]) -> None:
        """All or nothing: on an error the file is cut back to where it was, and it raises OSError."""
        f = self._open()
        text = "".join(_encode(e) for e in entries)
        start = os.lseek(f.fileno(), 0, os.SEEK_END)
        try:
            _write(f, text)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(f.fileno(), start)
            raise
        self.lines += len(entries)

    def read(self) -> list[dict[str, str]]:
        return [] if self._f is None else entries_of(self._f)[0]

    def replace(self, entries: list[dict[str, str]]) -> None:
        """Keep only `entries` (what is still unsent)."""
        rewrite(self._open(), self._header, entries)
        self.lines = len(entries)

    def close(self) -> None:
        """Release the lock; an empty file is removed first."""
        if self._f is None:
            return
        with contextlib.suppress(OSError):
            if self.lines == 0:
                self.path.unlink()
        self._f.close()  # releases the flock
        self._f = None

    def _open(self) -> TextIO:
        while self._f is None:
            f = _open_spool(self.path, "a+")  # held open (and locked) for the reporter's life
            fcntl.flock(f, fcntl.LOCK_EX)
            if os.fstat(f.fileno()).st_nlink == 0:  # a sender took the empty file away meanwhile
                f.close()
                continue
            try:
                if f.seek(0, os.SEEK_END) == 0:
                    _write(f, _encode(self._header))
            except OSError:  # a full disk: leave no empty or torn file behind for others to puzzle over
                with contextlib.suppress(OSError):
                    if os.fstat(f.fileno()).st_size < len(_encode(self._header)):
                        self.path.unlink()
                f.close()
                raise
            self._f = f
        return self._f


def _open_spool(path: Path, mode: str) -> TextIO:
    """A spool file as text. Bytes that are not UTF-8 (a torn write, a disk error) read as
    surrogates instead of failing the whole file: `_lines` tells the lines that hold them."""
    return cast(TextIO, open(path, mode, encoding="utf-8", errors="surrogateescape"))


def _lines(f: TextIO) -> Iterator[dict[str, str] | None]:
    """Each line of a spool file as its event, or None for a line that is not one (torn,
    corrupted, not UTF-8: the reporter writes only UTF-8 JSON, and no blank line)."""
    for i, line in enumerate(f):
        try:
            line.encode("utf-8")  # surrogates: bytes that were never UTF-8
            d = json.loads(line)
        except ValueError:  # UnicodeEncodeError and JSONDecodeError both are
            d = None
        if i == 0 and is_header(d):
            continue
        yield {str(k): str(v) for k, v in d.items()} if isinstance(d, dict) and d.get("job") else None


def read_header(f: TextIO) -> dict[str, Any] | None:
    f.seek(0)
    first = f.readline()
    try:
        first.encode("utf-8")
        d = json.loads(first)
    except ValueError:
        return None
    return d if is_header(d) else None


@contextlib.contextmanager
def claim(path: Path) -> Iterator[TextIO | None]:
    """The file, opened and exclusively locked, or None when its writer (or another sender) holds
    it, or it is already gone. Unlinking it while claimed is safe: a waiting claimant sees it gone."""
    try:
        f = _open_spool(path, "r+")
    except OSError:
        yield None
        return
    try:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield None
            return
        yield None if os.fstat(f.fileno()).st_nlink == 0 else f
    finally:
        f.close()


def others(spool_dir: Path, prefix: str, skip: Path | None) -> list[Path]:
    return [p for p in sorted(spool_dir.glob(f"{safe_name(prefix)}.*.jsonl")) if p != skip]


def mismatch(path: Path, head: dict[str, Any] | None, dest: str, prefix: str) -> str | None:
    """Why this reporter must not send the file (None: it may), logged once per file."""
    if head is None:
        why = "it records no destination (written by an older version)"
    elif head.get("destination") != dest or head.get("prefix") != prefix:
        why = f"it is for {head.get('destination')} prefix {head.get('prefix')!r}"
    else:
        return None
    key = (str(path), why)
    if key not in _warned:
        _warned.add(key)
        log.warning(
            "costexporter: leaving spool %s alone: %s, and this reporter sends to %s prefix %r "
            "(send it with `costexporter events import` if it belongs there)",
            path,
            why,
            dest,
            prefix,
        )
    return why


def entries_of(f: TextIO) -> tuple[list[dict[str, str]], int]:
    """A spool file's events, and how many of its lines were not one (skipped)."""
    f.seek(0)
    lines = list(_lines(f))
    events = [e for e in lines if e is not None]
    return events, len(lines) - len(events)


def rewrite(f: TextIO, head: dict[str, Any], entries: list[dict[str, str]]) -> None:
    f.seek(0)  # (also drops what the text layer had read ahead)
    os.ftruncate(f.fileno(), 0)
    _write(f, _encode(head) + "".join(_encode(e) for e in entries))
