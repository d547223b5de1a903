"""`StepReporter.close()` never raises for a full, read-only or forbidden spool disk: what cannot
be spooled is counted `lost`, logged once, and close() returns.

A real reporter with its Redis down, so that everything goes to the spool; the disk fails at the
OS call (a filled tmpfs, /dev/full, a tmpfs remounted read-only, or `os.write` failing with the
errno)."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import subprocess
import time
from pathlib import Path

import pytest

from costexporter.trainer import spool
from costexporter.trainer.reporter import StepReporter

from .redis_server import free_port

STEPS = 300


def _reporter(spool_dir: Path, **kw) -> StepReporter:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens: every event goes to the spool
    kw = {"heartbeat_s": 3600, "socket_timeout_s": 0.2, "exit_timeout_s": 0.3, **kw}
    return StepReporter("full-disk", url, rank=0, spool_dir=spool_dir, **kw)


def _post_and_close(rep: StepReporter, caplog) -> int:
    caplog.set_level(logging.ERROR, logger="costexporter.client")
    for s in range(1, STEPS + 1):
        rep.step(s)
    rep.close()  # must not raise
    assert rep._inactive  # it really closed
    return STEPS + 3  # the steps, the register, the run start and its end


def _spooled_lines(spool_dir: Path) -> list[dict]:
    out = []
    for p in spool_dir.glob("*.jsonl"):
        if p.is_symlink():
            continue
        lines = p.read_text().splitlines()
        for line in lines:
            d = json.loads(line)  # every line whole: a refused write was cut back
            if spool.is_header(d):
                continue
            if d.get("type") == "steps":  # a batched entry: one per step it carries
                out += [{**d, "type": "step", "seq": str(int(d["seq"]) + i)} for i in range(int(d["n"]))]
            else:
                out.append(d)
    return out


def _lost_logs(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "cannot spool" in r.getMessage()]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES])
def test_a_write_the_os_refuses_is_counted_lost_and_close_returns(code, tmp_path, monkeypatch, caplog):
    rep = _reporter(tmp_path / "spool")

    def refuse(fd, data):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(spool.os, "write", refuse)
    posted = _post_and_close(rep, caplog)
    assert rep.stats["lost"] == posted and rep.stats["spooled"] == 0, rep.stats
    assert len(_lost_logs(caplog)) == 1, _lost_logs(caplog)  # once, however often it failed
    assert os.strerror(code) in _lost_logs(caplog)[0]
    assert not list((tmp_path / "spool").glob("*.jsonl"))  # no empty or torn file left behind


def test_a_spool_on_dev_full_is_counted_lost_and_close_returns(tmp_path, caplog):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    rep = _reporter(tmp_path / "spool")
    rep._sender.spooler.spool_path.symlink_to("/dev/full")  # the kernel answers every write with ENOSPC
    posted = _post_and_close(rep, caplog)
    assert rep.stats["lost"] == posted and rep.stats["spooled"] == 0, rep.stats
    assert len(_lost_logs(caplog)) == 1
    assert "No space left on device" in _lost_logs(caplog)[0]


def test_the_sender_spilling_to_a_full_disk_and_close_log_once(tmp_path, monkeypatch, caplog):
    """Spills while Redis is down fail, then close() fails too: counted each time, logged once."""
    rep = _reporter(tmp_path / "spool", buffer_size=40)

    def refuse(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(spool.os, "write", refuse)
    caplog.set_level(logging.ERROR, logger="costexporter.client")
    posted = 3  # the register, the run start, and at close the run end
    for s in range(1, 2000):
        rep.step(s)
        posted += 1
        if s % 30 == 0:  # let the sender try (and fail) to send, then spill
            deadline = 200
            while rep.stats["lost"] == 0 and deadline:
                deadline -= 1
                rep._sender.wake.set()
                time.sleep(0.01)
            if rep.stats["lost"]:
                break
    assert rep.stats["lost"] > 0, rep.stats  # a spill failed before close
    rep.close()
    accounted = rep.stats["lost"] + rep.stats["spooled"] + rep.stats["overflow"]
    assert accounted == posted, rep.stats
    assert len(_lost_logs(caplog)) == 1, _lost_logs(caplog)


@contextlib.contextmanager
def _tmpfs(where: Path, size: str = "256k"):
    where.mkdir(parents=True)
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
            check=True,
            capture_output=True,
        )
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot mount a tmpfs here ({e})")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True)


def _fill(fs: Path, leave: int) -> None:
    """Fill the filesystem until at most `leave` bytes are free."""
    with open(fs / "filler", "wb", buffering=0) as f:
        while True:
            st = os.statvfs(fs)
            free = st.f_bavail * st.f_frsize
            if free <= leave:
                return
            try:
                f.write(b"\0" * min(65536, free - leave if free - leave >= 4096 else free))
            except OSError as e:
                assert e.errno == errno.ENOSPC
                return


def test_a_full_filesystem_keeps_only_whole_lines_and_counts_the_rest(tmp_path, caplog):
    with _tmpfs(tmp_path / "fs") as fs:
        rep = _reporter(fs / "spool", batch_steps=False)  # a line per event: they fill the disk
        _fill(fs, leave=8192)  # room for part of the events only
        posted = _post_and_close(rep, caplog)
        on_disk = _spooled_lines(fs / "spool")
        assert rep.stats["lost"] > 0, rep.stats
        assert rep.stats["spooled"] == len(on_disk)  # what is counted spooled is on disk, whole
        assert rep.stats["spooled"] + rep.stats["lost"] == posted, rep.stats
        assert len(_lost_logs(caplog)) == 1


def test_a_filesystem_remounted_read_only_is_counted_lost_and_close_returns(tmp_path, caplog):
    with _tmpfs(tmp_path / "fs") as fs:
        rep = _reporter(fs / "spool")
        subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True, capture_output=True)
        posted = _post_and_close(rep, caplog)
        assert rep.stats["lost"] == posted and rep.stats["spooled"] == 0, rep.stats
        assert "Read-only file system" in _lost_logs(caplog)[0]


def test_a_disk_that_fills_after_the_spool_opened_does_not_make_close_raise(tmp_path, caplog):
    """The spool file is open (an earlier spill went through), then the disk fills: a refused
    write must leave nothing buffered that close() would try, and fail, to write again."""
    with _tmpfs(tmp_path / "fs") as fs:
        rep = _reporter(fs / "spool", buffer_size=40, batch_steps=False)  # a line per event
        caplog.set_level(logging.ERROR, logger="costexporter.client")
        posted = 3  # the register, the run start, and at close the run end
        for s in range(1, 31):
            rep.step(s)
            posted += 1
        deadline = time.monotonic() + 10
        while not rep.stats["spooled"] and time.monotonic() < deadline:
            rep._sender.wake.set()
            time.sleep(0.01)
        assert rep.stats["spooled"], rep.stats  # the file is open and holds a spill
        _fill(fs, leave=0)
        for s in range(31, 31 + STEPS):
            rep.step(s)
            posted += 1
        rep.close()  # raised OSError (ENOSPC) from the file's buffered write before
        on_disk = _spooled_lines(fs / "spool")
        assert rep.stats["spooled"] == len(on_disk) > 0
        assert rep.stats["lost"] + rep.stats["spooled"] + rep.stats["overflow"] == posted, rep.stats
        assert len(_lost_logs(caplog)) == 1
