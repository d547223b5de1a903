"""Is this process ending cleanly? The reporter posts `run end` only if so.

A `run end` tells the watcher and the ledger that the job finished on purpose; posting it for a
crash would hide the crash (the watcher says `done`, the time after it is booked `unassigned`
instead of waste). Python does not tell an atexit handler how the process is ending, so we watch
the ways it can end and remember how it did:

* an uncaught exception in the main thread (`sys.excepthook`), including KeyboardInterrupt, and
  in any other thread (`threading.excepthook`); in a multi-node job, a rank whose peer was killed
  raises from the collective, so it lands here too;
* the exit request that reaches the top of the main thread. `sys.exit` and the builtins `exit`
  and `quit` raise a `SystemExit` of our own, which notices when the interpreter reads its `code`
  to end the process (it does so with no Python frame left on the stack). A `sys.exit(1)` caught
  by the program is therefore not a crash, and the code that really ends the process counts:
  0 or None is clean, anything else (a number, a message) is not;
* `os._exit(n)`: its status counts the same way, and the reporters are closed first (the exit
  handlers do not run);
* SIGTERM and SIGHUP with no handler of the program's own: the reporters are closed without
  `run end`, then the signal is delivered again with its default action, so the process still
  ends killed by it (its parent sees the same status).

Known limit: a `SystemExit` raised by C code or written out (`raise SystemExit(1)`, or an `exit`
imported from `sys` before `install`) cannot be seen and counts as clean. The hooks chain to
whatever was installed before, and are installed once, by the first reporter.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any, NoReturn

_installed = False
_crash: str | None = None  # why this process is not ending cleanly, once we know
_final: tuple[object, str] | None = None  # (code, how) of the exit request that ended the process
_hard_exit_hooks: list[Callable[[], None]] = []
_REAL_SYSTEM_EXIT = SystemExit
_CODE = SystemExit.__dict__["code"]  # the C slot behind SystemExit.code


def failing(code: object) -> bool:
    """Whether an exit with this code is a failure, as the interpreter maps it to a status:
    None and 0 are 0, another integer is itself, anything else (a message) is 1."""
    return not (code is None or (isinstance(code, int) and code == 0))


def crash_reason() -> str | None:
    """None while nothing says the process is failing; else a short reason."""
    if _crash is not None:
        return _crash
    if _final is not None and failing(_final[0]):
        return f"{_final[1]}({_final[0]!r})"
    return None


def exception_reason(exc: BaseException | None) -> str | None:
    """Why an exception that is propagating (close() in a `finally:`, a `with` block left by it)
    means the run did not end cleanly; None when it does not: a `SystemExit` of 0 or None."""
    if exc is None:
        return None
    if isinstance(exc, SystemExit):
        return f"SystemExit({exc.code!r}) in flight" if failing(exc.code) else None
    return f"{type(exc).__name__} in flight"


def error_type(reason: str) -> str | None:
    """The exception type a crash reason names (`uncaught ValueError`, `KeyError in flight`),
    else None (an exit status, a signal)."""
    for head, tail in (("uncaught ", ""), ("", " in flight")):
        if reason.startswith(head) and reason.endswith(tail):
            name = reason[len(head) : len(reason) - len(tail)].split(" ")[0]
            if name.isidentifier() and not name.startswith("SystemExit"):
                return name
    return None


def note_crash(reason: str) -> None:
    global _crash
    if _crash is None:
        _crash = reason


def reset() -> None:
    """Forget what was seen (tests that run in one process)."""
    global _crash, _final
    _crash = None
    _final = None


def on_hard_exit(hook: Callable[[], None]) -> None:
    """Call `hook` before the process ends without running its exit handlers (`os._exit`, a
    fatal signal): the reporter closes there."""
    if hook not in _hard_exit_hooks:
        _hard_exit_hooks.append(hook)


def _run_hard_exit_hooks() -> None:
    hooks, _hard_exit_hooks[:] = list(_hard_exit_hooks), []
    for hook in hooks:
        with contextlib.suppress(Exception):  # the process is ending: nothing may stop that
            hook()


def _ended_with(code: object, how: str) -> None:
    global _final
    _final = (code, how)


class _Exit(SystemExit):
    """The `SystemExit` our `sys.exit`, `exit` and `quit` raise: it tells us whether it was the
    one that ended the process. The interpreter reads `code` when a `SystemExit` reaches the top
    of the main thread, from C, with no Python frame on the stack; a program that catches it
    reads it, if at all, from a frame of its own."""

    how = "sys.exit"

    @property
    def code(self) -> Any:
        value = _CODE.__get__(self)
        try:
            sys._getframe(1)
        except ValueError:  # no caller frame: the interpreter is ending the process with it
            _ended_with(value, self.how)
        return value

    @code.setter
    def code(self, value: Any) -> None:
        _CODE.__set__(self, value)

    def __reduce__(self) -> tuple[Any, ...]:  # pickled as what it stands for
        return (_REAL_SYSTEM_EXIT, self.args)


_Exit.__name__ = _Exit.__qualname__ = "SystemExit"  # how tracebacks and repr() show it


class _BuiltinExit(_Exit):
    how = "exit"


class _Quitter:
    """The builtins `exit` and `quit` (site.Quitter), raising our `SystemExit`."""

    def __init__(self, name: str, original: object) -> None:
        self.name = name
        self._original = original

    def __repr__(self) -> str:
        return repr(self._original)

    def __call__(self, code: object = None) -> NoReturn:
        with contextlib.suppress(Exception):  # as site.Quitter: close stdin first (IDLE)
            sys.stdin.close()
        exc = _BuiltinExit(code)
        exc.how = self.name
        raise exc


def _raise_exit(status: object = None) -> NoReturn:  # sys.exit's signature
    # sys.exit(t) with a tuple t raises SystemExit(*t), as the C function does.
    raise _Exit(*status) if isinstance(status, tuple) else _Exit(status)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    """A fatal signal the program does not handle: close the reporters without `run end`, then
    die of it as if we had not been there. Chained to by another handler (a framework that
    installed its own after us and calls the previous one), do nothing: it owns the signal."""
    if signal.getsignal(signum) is not _on_signal:
        return
    note_crash(f"signal {signal.Signals(signum).name}")
    _run_hard_exit_hooks()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def install() -> None:
    """Chain our hooks in front of the current ones (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    prev_hook = sys.excepthook
    prev_thread_hook = threading.excepthook
    prev_os_exit = os._exit

    def excepthook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        note_crash(f"uncaught {exc_type.__name__}")
        prev_hook(exc_type, exc, tb)

    def thread_excepthook(args: threading.ExceptHookArgs) -> None:
        if not issubclass(args.exc_type, SystemExit):  # SystemExit ends only its thread, silently
            name = args.thread.name if args.thread is not None else "?"
            note_crash(f"uncaught {args.exc_type.__name__} in thread {name}")
        prev_thread_hook(args)

    def os_exit(status: int) -> NoReturn:
        _ended_with(status, "os._exit")
        _run_hard_exit_hooks()
        prev_os_exit(status)

    sys.excepthook = excepthook
    threading.excepthook = thread_excepthook
    sys.exit = _raise_exit
    os._exit = os_exit
    for name in ("exit", "quit"):
        original = getattr(builtins, name, None)
        if original is not None and not isinstance(original, _Quitter):
            setattr(builtins, name, _Quitter(name, original))
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            with contextlib.suppress(ValueError, OSError):
                if signal.getsignal(sig) == signal.SIG_DFL:
                    signal.signal(sig, _on_signal)
