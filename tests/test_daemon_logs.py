"""The daemons' logs stay readable through a fault that repeats every sample: the same line at
most once a window, the next one saying how many like it were left out."""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
import time

from costexporter.core import logflood

from .conftest import SHARED_URL, spawn_cli
from .redis_server import free_port


def _record(msg: str, *args: object, name: str = "costexporter.x") -> logging.LogRecord:
    return logging.LogRecord(name, logging.WARNING, __file__, 1, msg, args, None)


def test_the_same_line_passes_once_a_window_and_then_says_how_many_were_left_out(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(logflood.time, "monotonic", lambda: now[0])
    flood = logflood.FloodFilter(window_s=60, by_message=True)
    fmt = "dcgm-exporter %s: %s"
    passed = [flood.filter(_record(fmt, "http://a", "Connection refused")) for i in range(50)]
    assert passed == [True] + [False] * 49  # the same line: one
    assert flood.filter(_record(fmt, "http://b", "Connection refused"))  # another exporter's is its own
    assert flood.filter(_record("job %r skipped", "a")) and flood.filter(_record("job %r skipped", "b"))
    assert flood.filter(_record(fmt, "http://a", "Connection refused", name="costexporter.y"))
    now[0] += 59.9
    assert not flood.filter(_record(fmt, "http://a", "Connection refused"))
    now[0] += 0.2
    rec = _record(fmt, "http://a", "Connection refused")
    assert flood.filter(rec)
    assert (
        rec.getMessage()
        == "dcgm-exporter http://a: Connection refused [50 more like this in the last 60 s not logged]"
    )
    # by format (the API's server log): the varying arguments are one line
    by_format = logflood.FloodFilter(window_s=60)
    assert [by_format.filter(_record(fmt, "x", str(i))) for i in range(3)] == [True, False, False]


def test_an_agent_whose_dcgm_exporter_is_down_says_so_once_a_minute(prefix):
    """`serve --source dcgm` with its exporter down, sampling 5 times a second: one warning line
    about it in 4 s of sampling (it was one a sample). The 4 s count from its first line, not
    from the start of the process: a loaded machine may take longer than that to start it."""
    dead = f"http://127.0.0.1:{free_port()}/metrics"
    args = ["serve", "--source", "dcgm", "--dcgm-url", dead, "--k8s-api", "off", "--port", "0"]
    args += [
        "--redis-url",
        SHARED_URL,
        "--prefix",
        prefix,
        "--sample-interval",
        "0.2",
        "--book-interval",
        "0.5",
    ]
    proc = spawn_cli(*args, stderr=subprocess.PIPE)
    err: list[str] = []
    first = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            err.append(line)
            if f"dcgm-exporter {dead}" in line:
                first.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert first.wait(60), "".join(err)[-3000:]
        time.sleep(4)  # 20 more samples, each failing
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        reader.join(timeout=10)
    text = "".join(err)
    lines = [x for x in text.splitlines() if f"dcgm-exporter {dead}" in x]
    assert len(lines) == 1 and "Traceback" not in text, text[-3000:]
