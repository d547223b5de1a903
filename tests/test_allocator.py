"""The batch commands' allocator settings take on glibc and change nothing elsewhere."""

from __future__ import annotations

import ctypes.util
import platform

import pytest

from costexporter.cli.allocator import keep_freed_memory


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_settings_take_on_glibc() -> None:
    assert ctypes.util.find_library("c")
    assert keep_freed_memory() is True
