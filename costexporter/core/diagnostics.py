"""Counted rejections: bad input is warned about with file and line, counted, and skipped."""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import TextIO


class InputError(Exception):
    """A file that cannot be used at all (missing, empty, binary, wrong format): exit 2."""


@dataclass
class Diagnostics:
    """Collects warnings; prints the first `max_per_reason` of each (file, reason) pair."""

    stream: TextIO | None = field(default_factory=lambda: sys.stderr)
    max_per_reason: int = 10
    counts: Counter[str] = field(default_factory=Counter)  # reason -> warnings
    printed: Counter[tuple[str, str]] = field(default_factory=Counter)  # (where, reason) -> warnings

    def warn(self, where: str, line: int | None, reason: str, detail: str = "") -> None:
        self.counts[reason] += 1
        key = (where, reason)
        self.printed[key] += 1
        if self.stream is not None and self.printed[key] <= self.max_per_reason:
            loc = f"{where}:{line}" if line is not None else where
            msg = f"warning: {loc}: {reason}" + (f": {detail}" if detail else "")
            print(msg, file=self.stream)
            if self.printed[key] == self.max_per_reason:
                print(f"warning: {where}: further {reason!r} warnings suppressed", file=self.stream)

    def note(self, where: str, text: str) -> None:
        """Say how an input was read (not a problem: not counted), once per (where, text)."""
        key = (where, f"note:{text}")
        self.printed[key] += 1
        if self.stream is not None and self.printed[key] == 1:
            print(f"costexporter: {where}: {text}", file=self.stream)

    def summary(self) -> dict[str, int]:
        return dict(sorted(self.counts.items()))
