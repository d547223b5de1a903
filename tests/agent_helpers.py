"""Shared by the tests that run a real agent over Redis against a fake NVML: a trainer's entries
as the reporter encodes them, the agent's loop on a thread, and the wait for its booking."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

from costexporter.store import ledger, protocol


def entry_maker(job: str) -> Callable[..., dict[str, str]]:
    """`entry(rank, seq, type, **fields)`: one of the job's stream entries, stamped now."""

    def entry(rank: int, seq: int, type_: str, **f: object) -> dict[str, str]:
        return protocol.encode_fields(
            {"v": "1", "type": type_, "job": job, "ts": f"{time.time():.3f}", "rank": rank,
             "session": f"s{rank}", "seq": seq, **f}
        )  # fmt: skip

    return entry


@contextlib.contextmanager
def running(agent) -> Iterator[None]:
    """The agent's loop on a thread while the block runs; stopped and shut down after."""
    stop = threading.Event()
    runner = threading.Thread(target=agent.run, kwargs={"until": stop.is_set}, daemon=True)
    runner.start()
    try:
        yield
    finally:
        stop.set()
        agent.stop()
        runner.join(10)
        agent.shutdown()


def wait_booked(client, prefix: str, job: str, agents: list[str], until_ms: int, timeout: float = 60) -> None:
    """Until every one of `agents` has booked the job up to `until_ms`; fails the test after
    `timeout` seconds, naming the watermarks."""
    deadline = time.monotonic() + timeout
    wms: list = []
    while time.monotonic() < deadline:
        wms = [ledger.load_watermark(client, prefix, job, a) for a in agents]
        if all(w and w["booked_until"] >= until_ms for w in wms):
            return
        time.sleep(0.2)
    raise AssertionError(f"not booked to the end in time: {wms}")
