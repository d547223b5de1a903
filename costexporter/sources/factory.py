"""One place that opens a live source by its `--source` name (the agent's `serve`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from costexporter.core.diagnostics import Diagnostics

if TYPE_CHECKING:  # the CLI imports this module at start-up: numpy loads only with a source
    from costexporter.sources.base import GpuSource

KINDS = ("nvml", "dcgm", "replay", "sim")


def make_source(
    kind: str,
    *,
    host: str | None = None,
    dcgm_urls: Sequence[str] = (),
    samples: Sequence[tuple[str, Path]] = (),
    speed: float = 1.0,
    tz: str = "UTC",
    diag: Diagnostics | None = None,
    scenario: str | None = None,
    redis_url: str | None = None,
    prefix: str | None = None,
    time_slicing_replicas: int = 0,
) -> GpuSource:
    """The source of `kind`; `samples` are (host, path) trace files for `replay`. A source that
    lacks what it needs raises ValueError naming the flag (the CLI prints it as one line)."""
    if kind == "dcgm":
        from costexporter.sources.dcgm import DcgmSource

        if not dcgm_urls:
            raise ValueError("--source dcgm needs --dcgm-url")
        return DcgmSource(list(dcgm_urls), host=host, replicas=time_slicing_replicas)
    if kind == "sim":
        import time

        from costexporter.sources.sim import SimSource

        # The story ends as it starts playing, as the demo's: played faster than real time from
        # now, it would date its samples and steps ahead of the clock.
        return SimSource(
            scenario or "mini",
            speed=speed,
            redis_url=redis_url,
            prefix=prefix,
            host=host,
            ends_at=time.time(),
        )
    if kind == "replay":
        from costexporter.core import tracefiles
        from costexporter.sources.playback import ReplaySource

        if not samples:
            raise ValueError("--source replay needs --samples")
        diag = diag or Diagnostics()
        chunks = [tracefiles.read_samples(p, h, tz, diag) for h, p in samples]
        return ReplaySource(tracefiles.combine(chunks), speed=speed, host=host)
    if kind == "nvml":
        from costexporter.sources.nvml import NvmlSource

        return NvmlSource(host=host)
    raise ValueError(f"unknown source {kind!r}: one of {', '.join(KINDS)}")
