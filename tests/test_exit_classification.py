"""Every way a Python process ends, classified by the reporter: `run end` only for a clean end.

Each case is a real trainer process posting to the real Redis; the test reads what it posted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from costexporter.store.reader import EventReader

from .conftest import SHARED_URL

HELPER = Path(__file__).resolve().parent / "helpers" / "trainer_ends.py"

# how -> (exit status, run end posted?)
CASES = {
    "return": (0, True),
    "builtin_exit0": (0, True),
    "builtin_exit1": (1, False),
    "builtin_quit3": (3, False),
    "builtin_exit_caught": (0, True),
    "sys_exit0": (0, True),
    "sys_exit1": (1, False),
    "sys_exit_none": (0, True),
    "sys_exit_msg": (1, False),
    "sys_exit1_caught_then_return": (0, True),
    "sys_exit0_caught_then_sys_exit3": (3, False),
    "finally_exit0": (0, True),
    "finally_exit1": (1, False),
    "with_exit0": (0, True),
    "with_exit1": (1, False),
    "uncaught": (1, False),
    "os_exit0": (0, True),
    "os_exit1": (1, False),
}

SIGNALS = {
    "signal_term": (signal.SIGTERM, -signal.SIGTERM),
    "signal_hup": (signal.SIGHUP, -signal.SIGHUP),
    "signal_int": (signal.SIGINT, -signal.SIGINT),  # KeyboardInterrupt, uncaught
}


def _default_signals() -> None:
    """The trainer starts with the signals at their defaults, as under torchrun or a shell in a
    terminal: a test run started in the background (`cmd &` ignores SIGINT) or under nohup
    (SIGHUP) would otherwise hand its ignoring on, and the signal would never arrive."""
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def _start(how: str, prefix: str, tmp_path: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(HELPER), how, prefix, SHARED_URL, str(tmp_path), how],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "RANK": "0"},
        preexec_fn=_default_signals,
    )


def _posted(shared, how: str, prefix: str) -> tuple[list[str | None], list[int]]:
    runs, steps, _ = _read(shared, how, prefix)
    return runs, steps


def _read(shared, how: str, prefix: str) -> tuple[list[str | None], list[int], dict | None]:
    """The run states and steps posted, and the crash record's fields (None: none posted)."""
    events = EventReader(shared, how, prefix=prefix).read_all()
    crash = next((e.fields for e in events if e.type == "run" and e.get("state") == "crash"), None)
    return (
        [e.get("state") for e in events if e.type == "run"],
        [e.get("step") for e in events if e.type == "step"],
        crash,
    )


@pytest.mark.parametrize("how", sorted(CASES))
def test_each_way_of_ending_is_classified(how, shared, prefix, tmp_path):
    status, clean = CASES[how]
    p = _start(how, prefix, tmp_path)
    _, err = p.communicate(timeout=60)
    assert p.returncode == status, err  # the reporter never changes how the process ends
    runs, steps, crash = _read(shared, how, prefix)
    # A failing end posts a crash record (how it ended, the exception's type where one was
    # raised): the watcher names the rank that failed.
    assert runs == (["start", "end"] if clean else ["start", "crash"]), err
    if not clean:
        assert crash is not None and crash["exit"], crash
        assert crash.get("error") == ("RuntimeError" if how == "uncaught" else None), crash
    assert steps, err  # what it posted before the end arrived
    assert "Traceback" not in err or how == "uncaught", err


@pytest.mark.parametrize("how", sorted(SIGNALS))
def test_a_fatal_signal_posts_no_run_end_and_sends_what_was_in_memory(how, shared, prefix, tmp_path):
    sig, status = SIGNALS[how]
    p = _start(how, prefix, tmp_path)
    try:
        assert p.stdout.readline().strip() == "stepping"
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == status, err  # still killed by the signal (its parent sees the same)
    runs, steps, crash = _read(shared, how, prefix)
    assert runs == ["start", "crash"], err
    assert crash is not None and (sig.name in crash["exit"] or crash.get("error") == "KeyboardInterrupt"), (
        crash
    )
    assert steps == [1, 2, 3, 4, 5, 6], err  # step 6 was still in memory when the signal came


def test_a_program_that_handles_sigterm_itself_decides(shared, prefix, tmp_path):
    """A program's own SIGTERM handler (graceful preemption: sys.exit(0)) owns the signal."""
    p = _start("own_sigterm_handler", prefix, tmp_path)
    try:
        assert p.stdout.readline().strip() == "stepping"
        assert p.stdout.readline().strip() == "handler"
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err
    runs, steps = _posted(shared, "own_sigterm_handler", prefix)
    assert runs == ["start", "end"], err
    assert steps == [1, 2, 3, 4, 5, 6], err
