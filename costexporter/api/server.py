"""uvicorn, hardened for a network with slow or hostile clients.

uvicorn on its own holds a connection whose request head never completes forever (its keep-alive
timeout only runs between requests), accepts connections until the process runs out of file
descriptors, and then logs every failed accept. Here:

* a request's head (request line and headers) must arrive within `header_timeout_s` of the
  connection opening or of the previous response; its body within `body_timeout_s` of its head;
  otherwise the connection is closed (counted, and said in a log line at most once a minute);
* at most `max_connections` are open at once, kept under the process's file-descriptor limit:
  past it, the connection that has waited longest for its request head is closed to make room
  (a slow client gives way to a new one), or, with none waiting, the new one is refused;
* the same log message is written at most once every `FloodFilter.window_s` per logger, with
  how many like it were left out, so that no fault (a descriptor limit reached, a client that
  keeps failing) can write thousands of lines a second.

uvicorn's own `limit_concurrency` is not used for the cap: it still accepts the connection and
answers 503, holding the socket, and counts idle slow clients against real requests.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import logging
import resource
import threading
import time
from dataclasses import dataclass
from typing import Any

from costexporter.core.logflood import FloodFilter

log = logging.getLogger("costexporter.api")

# File descriptors kept free for what is not a client connection: Redis, logs, the listener.
FD_RESERVE = 128


@dataclass(frozen=True)
class ServerLimits:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_s: int = 5
    max_connections: int | None = None  # None: 1,024, or less under a low descriptor limit
    max_header_bytes: int = 16 * 1024  # a request head larger than this is refused (h11)

    def connection_cap(self) -> tuple[int, int]:
        """The connections allowed at once (as asked, but under the descriptor limit), and the
        listen backlog: asyncio accepts up to that many connections in one go before any of them
        can be closed, and on a failed accept logs and retries that many times. A connection over
        the cap frees its victim's descriptor only three loop turns after its accept (task,
        connection_made, the abort's close), and every turn may accept another batch: so the
        backlog is an eighth of the descriptors left above the cap, four batches in flight
        leaving half of them for Redis, logs and the listener."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            soft = 1 << 20
        room = max(8, soft - FD_RESERVE)
        wanted = 1024 if self.max_connections is None else self.max_connections
        if wanted > room:
            log.warning(
                "--max-connections %d is more than the file-descriptor limit allows (ulimit -n %d): using %d",
                wanted,
                soft,
                room,
            )
        cap = min(wanted, room)
        return cap, max(8, min(2048, (soft - cap) // 8))


# What the guard did, since the start (read by tests and the periodic log line).
stats: collections.Counter[str] = collections.Counter()
_stats_lock = threading.Lock()
_said_at = [0.0]


def _count(what: str) -> None:
    with _stats_lock:
        stats[what] += 1
        now = time.monotonic()
        if now - _said_at[0] < 60.0:
            return
        _said_at[0] = now
        snapshot = dict(stats)
    log.warning(
        "slow or excess clients closed so far: %s (header, body timeouts; connections over the cap)",
        ", ".join(f"{k}={v}" for k, v in sorted(snapshot.items())),
    )


def protocol_class(limits: ServerLimits, cap: int) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with the timeouts and the connection cap of `limits`."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._timer: asyncio.TimerHandle | None = None
            self._timer_kind = ""
            self._waiting_since: float | None = None  # waiting for a request head since (loop time)
            self._seen_cycle: object = None

        # -- the connection's clock --------------------------------------------------------
        def _arm(self, seconds: float, kind: str) -> None:
            self._disarm()
            self._timer = self.loop.call_later(seconds, self._expire, kind)
            self._timer_kind = kind

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
                self._timer_kind = ""

        def _expire(self, kind: str) -> None:
            self._timer = None
            if self.transport is not None and not self.transport.is_closing():
                _count(f"{kind}_timeouts")
                self.transport.abort()  # a slow client reads nothing: free the descriptor now

        def _await_head(self) -> None:
            self._waiting_since = self.loop.time()
            self._arm(limits.header_timeout_s, "header")

        # -- uvicorn's hooks ---------------------------------------------------------------
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._await_head()
            if len(self.connections) > cap:
                self._make_room()

        def _make_room(self) -> None:
            waiting = [
                (since, c)
                for c in self.connections
                if c is not self and (since := getattr(c, "_waiting_since", None)) is not None
            ]
            victim = min(waiting, key=lambda w: w[0], default=(0.0, self))[1]
            _count("over_cap_closed")
            victim.transport.abort()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            cycle = self.cycle
            if cycle is None:
                return
            if cycle is not self._seen_cycle:  # a new request's head is in: its clock stops
                self._seen_cycle = cycle
                self._waiting_since = None
                if cycle.more_body:
                    self._arm(limits.body_timeout_s, "body")
                else:
                    self._disarm()
            elif self._timer_kind == "body" and not cycle.more_body:
                self._disarm()

        def on_response_complete(self) -> None:
            # The next request's head is awaited from now (armed before uvicorn reads a pipelined
            # one); a body the client still owes keeps its own clock.
            if not self.transport.is_closing() and not (self.cycle is not None and self.cycle.more_body):
                self._await_head()
            super().on_response_complete()

    return GuardedH11Protocol


def log_config(level: str) -> dict[str, Any]:
    """uvicorn's logging setup, every handler behind a FloodFilter, and the root logger (asyncio,
    the API's own) written through the same stderr handler."""
    from uvicorn.config import LOGGING_CONFIG

    cfg = copy.deepcopy(LOGGING_CONFIG)
    cfg["filters"] = {"flood": {"()": FloodFilter}}
    for handler in cfg["handlers"].values():
        handler["filters"] = ["flood"]
    cfg["root"] = {"handlers": ["default"], "level": level.upper()}
    return cfg


def config(app: Any, host: str, port: int, limits: ServerLimits, log_level: str, *, own_logging: bool) -> Any:
    """A uvicorn Config with the limits. `own_logging`: the process is the API's alone, and its
    logging is set up here (behind the FloodFilter); else (beside an agent) it is left as is."""
    import uvicorn

    cap, backlog = limits.connection_cap()
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        backlog=backlog,
        http=protocol_class(limits, cap),
        timeout_keep_alive=limits.keep_alive_s,
        h11_max_incomplete_event_size=limits.max_header_bytes,
        log_level=log_level,
        log_config=log_config(log_level) if own_logging else None,
    )
