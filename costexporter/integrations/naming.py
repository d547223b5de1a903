"""Default job names for the integrations: unique per run, the same on every rank."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from typing import Any

from costexporter.store import protocol

_NOT_ALLOWED = re.compile(r"[^A-Za-z0-9._:/@+=-]+")


def job_name(name: str, agree: bool = False, broadcast: Callable[[Any], Any] | None = None) -> str:
    """`name` made a valid job name (characters outside the protocol's set become `-`, at most
    200). `agree`: every rank takes rank 0's (`broadcast(obj) -> obj`, else torch.distributed's
    when it runs), since ranks started a moment apart would name different jobs."""
    clean = _NOT_ALLOWED.sub("-", name).strip("-")[:200] or "run"
    if agree:
        clean = (broadcast or _torch_broadcast)(clean)
    return protocol.check_job(clean)


def owner_hash(path: str) -> str:
    """8 hex digits of (the user, `path`): a stable name part that two users' runs in equally
    named directories never share."""
    import getpass
    import hashlib

    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # a container without a passwd entry for its uid
        user = str(os.getuid())
    return hashlib.sha256(f"{user}\0{path}".encode()).hexdigest()[:8]


def start_stamp(now: float | None = None) -> str:
    """UTC to the millisecond, `20260726T224640123Z`: two runs a second apart get two names."""
    t = time.time() if now is None else now
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(t)) + f"{int(t * 1000) % 1000:03d}Z"


def _torch_broadcast(obj: str) -> str:
    try:
        import torch.distributed as dist
    except ImportError:
        return obj
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])
