"""Allocator settings for the batch commands (replay, calibrate).

A batch command makes and drops arrays of several MB many times over (a piece's start, end and
energy for every sample). glibc serves each from fresh mmap'ed pages, or trims its heap after a
free, so every such array is faulted in again: 20-50 ms of kernel time per replay of 921,600
rows on a 2-core machine (`bench/bench_replay.py`), a quarter of the accounting's CPU. Keeping
freed memory in the heap for the next array removes it. Long-lived processes (the agent, the
watcher, the API) keep glibc's defaults: they return memory to the system.
"""

from __future__ import annotations

import ctypes
import ctypes.util

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

# Arrays up to this size come from the heap (glibc's ceiling for the setting on 64-bit).
MMAP_THRESHOLD = 32 << 20
# Free memory at the heap's top up to this much stays mapped.
TRIM_THRESHOLD = 512 << 20


def keep_freed_memory() -> bool:
    """Serve large arrays from the heap and keep freed memory for the next ones (glibc only;
    elsewhere nothing changes). Returns whether the settings took."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt): its defaults stand
        return False
    mmap_ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    return bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and mmap_ok
