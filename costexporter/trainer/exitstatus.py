"""Is this process ending cleanly? The reporter posts `run end` only if so.

A `run end` tells the watcher and the ledger that the job finished on purpose; posting it for a
crash would hide the crash (the watcher says `done`, the time after it is booked `unassigned`
instead of waste). Python does not tell an atexit handler how the process is ending, so we watch
the three ways it can end badly and remember them:

* an uncaught exception in the main thread (`sys.excepthook`), including KeyboardInterrupt, and
  in any other thread (`threading.excepthook`); in a multi-node job, a rank whose peer was killed
  raises from the collective, so it lands here too;
* `sys.exit(n)` with a non-zero or non-integer `n` (the last call wins, so a `sys.exit(1)`
  caught and followed by `sys.exit(0)` is clean).

Known limit: `raise SystemExit(1)` written out (not through `sys.exit`, or through an `exit`
imported from `sys` before `install`) and `os._exit()` cannot be seen; `os._exit` also skips the
reporter's exit flush. The hooks chain to whatever hooks were
installed before, and are installed once, by the first reporter.
"""

from __future__ import annotations

import sys
import threading
from typing import NoReturn

_installed = False
_crash: str | None = None  # why this process is not ending cleanly, once we know


def crash_reason() -> str | None:
    """None while nothing says the process is failing; else a short reason."""
    return _crash


def note_crash(reason: str) -> None:
    global _crash
    if _crash is None:
        _crash = reason


def install() -> None:
    """Chain our hooks in front of the current ones (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    prev_hook = sys.excepthook
    prev_thread_hook = threading.excepthook
    prev_exit = sys.exit

    def excepthook(exc_type, exc, tb):
        note_crash(f"uncaught {exc_type.__name__}")
        prev_hook(exc_type, exc, tb)

    def thread_excepthook(args):
        if args.exc_type is not SystemExit:  # SystemExit ends only its thread, silently
            name = args.thread.name if args.thread is not None else "?"
            note_crash(f"uncaught {args.exc_type.__name__} in thread {name}")
        prev_thread_hook(args)

    def exit(status: str | int | None = None) -> NoReturn:  # sys.exit's signature
        global _crash
        if status is None or status == 0:
            if _crash is not None and _crash.startswith("sys.exit("):
                _crash = None  # the last exit request wins
        else:
            note_crash(f"sys.exit({status!r})")
        prev_exit(status)

    sys.excepthook = excepthook
    threading.excepthook = thread_excepthook
    sys.exit = exit
