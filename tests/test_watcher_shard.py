"""Watchers that share a fleet (`watch --shard I/N`): every job is judged by exactly one of them,
and judged as a single watcher of every job judges it."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from costexporter.services.watcher import WatchConfig, Watcher, in_shard, parse_shard
from costexporter.store import keys, protocol
from costexporter.trainer.transport import send_entries

from .conftest import SHARED_URL


@given(st.lists(st.text(min_size=1, max_size=40), min_size=1, max_size=50, unique=True), st.integers(1, 8))
def test_the_shards_partition_any_set_of_job_names(names, count):
    for name in names:
        owners = [i for i in range(count) if in_shard(name, (i, count))]
        assert len(owners) == 1, (name, owners)
    assert sum(in_shard(n, (i, count)) for n in names for i in range(count)) == len(names)


def test_a_jobs_shard_is_the_same_in_every_process():
    """Python's own string hash differs between processes: the shard must not."""
    code = (
        "from costexporter.services.watcher import in_shard; "
        "print([in_shard(f'j{i}', (0, 3)) for i in range(40)])"
    )
    runs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        for _ in range(2)
    }
    assert runs == {str([in_shard(f"j{i}", (0, 3)) for i in range(40)]) + "\n"}
    assert "True" in next(iter(runs)) and "False" in next(iter(runs))


@pytest.mark.parametrize("text", ["2/2", "-1/2", "0/0", "1", "a/b", "1/2/3", "", "/2"])
def test_a_shard_that_owns_no_job_is_refused(text):
    with pytest.raises(ValueError, match="INDEX/COUNT"):
        parse_shard(text)
    bad = tuple(int(x) for x in text.split("/")) if text in ("2/2", "-1/2", "0/0") else None
    if bad is not None:  # the library refuses it too, before it polls anything
        with pytest.raises(ValueError, match="INDEX/COUNT"):
            Watcher(WatchConfig(redis_url=SHARED_URL, shard=bad))


@pytest.mark.parametrize(("text", "want"), [("0/1", (0, 1)), ("3/4", (3, 4)), (" 1/2 ", (1, 2))])
def test_a_usable_shard_is_read(text, want):
    assert parse_shard(text) == want


def _events_of(job: str):
    """A maker of the job's stream entries, numbering each rank's events."""
    seqs = {0: 0, 1: 0}

    def e(kind: str, rank: int, ts: float, **fields) -> dict[str, str]:
        seqs[rank] += 1
        base = {"v": "1", "type": kind, "job": job, "ts": f"{ts:.3f}", "rank": rank}
        return protocol.encode_fields({**base, "session": f"s{rank}", "seq": seqs[rank], **fields})

    return e


def _post_jobs(shared, prefix: str, now: float) -> dict[str, str]:
    """Twelve jobs of three fates on the shared Redis: the state each must be judged in."""
    want = {}
    for i in range(12):
        job = f"job-{i}"
        fate = ("running", "done", "crashed")[i % 3]
        t0 = now - 600 if fate != "crashed" else now - 900
        last = now - 2 if fate != "crashed" else now - 300  # crashed: silent for 5 minutes
        e = _events_of(job)
        out = [e("register", r, t0, host="h0", gpu=r, world_size=2) for r in (0, 1)]
        out.append(e("run", 0, t0 + 1, state="start"))
        t, step = t0 + 5, 0
        while t <= last:
            step += 1
            out.append(e("step", 0, t, step=step))
            if step % 5 == 0:
                out.append(e("heartbeat", 1, t))
            t += 5
        out.append(e("heartbeat", 1, last))
        if fate == "done":
            out.append(e("run", 0, last, state="end"))
            out.append(e("run", 1, last, state="end"))
        send_entries(shared, prefix, job, out)
        want[job] = fate
    return want


def _watch(prefix: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = ["watch", "--redis-url", SHARED_URL, "--prefix", prefix, "--once", "--port", "0", *extra]
    return subprocess.run(
        [sys.executable, "-m", "costexporter.cli", *cmd], capture_output=True, text=True, timeout=120
    )


def _watch_once(prefix: str, *extra: str) -> dict[str, dict]:
    r = _watch(prefix, *extra)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_two_sharded_watcher_processes_judge_each_job_once_as_one_watcher_does(prefix, shared):
    want = _post_jobs(shared, prefix, time.time())
    whole = _watch_once(prefix)
    assert {j: s["state"] for j, s in whole.items()} == want
    parts = [_watch_once(prefix, "--shard", f"{i}/2") for i in range(2)]
    assert all(parts), "a shard of 12 jobs judged none: the split is not by job"
    assert not set(parts[0]) & set(parts[1])  # no job judged twice
    both = {**parts[0], **parts[1]}
    assert set(both) == set(want)  # and none left out
    for job, st_ in both.items():  # the same judgement (the reasons' durations run on the wall clock)
        same = ("state", "last_step", "stall_threshold_s", "suspect")
        assert {k: st_[k] for k in same} == {k: whole[job][k] for k in same}, job
    # Each shard wrote the status of its own jobs, as the API reads them.
    assert json.loads(shared.get(keys.status_key(prefix, "job-0")))["state"] == want["job-0"]


def test_the_cli_refuses_an_unusable_shard_in_one_line(prefix):
    r = _watch(prefix, "--shard", "2/2")
    assert r.returncode == 2
    assert "--shard" in r.stderr and "0 <= INDEX < COUNT" in r.stderr
    assert "Traceback" not in r.stderr
