"""Moving a deployment from the legacy keyspace (`<prefix>:{<job>}:...`) to the sub-prefixes.

The legacy layout is made the way the previous version made it: real agents book part of a job,
are killed, and every key is given the name the previous version used (the same name without
the party's letter after the prefix). Upgraded agents must then book the rest, each GPU-second
once.
"""

from __future__ import annotations

import json
import signal
import time

import pytest
import redis

from costexporter.sources.synth import write_nvidia_smi_csv
from costexporter.store import keys, keyspace, ledger, migrate
from costexporter.store.reader import EventReader

from .redis_server import RedisServer
from .test_agent import event_entry, offline_ms, post_events, serve, two_host_job, wait_booked

PREFIX = "ce"


def legacy_name(key: str, prefix: str = PREFIX) -> str:
    """The previous version's name of `key`: every key of a job under `<prefix>:{<job>}:`, the
    keys across jobs right under the prefix (its docs/protocol.md key table)."""
    ns, sep, rest = key[len(prefix) + 1 :].partition(":")
    assert key.startswith(prefix + ":") and sep and ns in keys.NAMESPACES, key
    return f"{prefix}:{rest}"


def to_legacy(client, prefix: str = PREFIX) -> list[str]:
    """Rename every key under `prefix` to its legacy name; returns the legacy names."""
    out = []
    for k in list(client.scan_iter(f"{prefix}:*")):
        k = k.decode() if isinstance(k, bytes) else k
        if k == keys.keyspace_key(prefix):  # the legacy layout kept no version
            client.delete(k)
            continue
        old = legacy_name(k, prefix)
        client.rename(k, old)
        out.append(old)
    return out


@pytest.fixture
def server(tmp_path):
    s = RedisServer(tmp_path / "redis").start()
    yield s
    s.stop()


def test_every_key_a_booking_writes_maps_back_from_its_legacy_name(server, tmp_path):
    """new_name is the inverse of the previous layout for every key a real booking creates."""
    client = server.client()
    b = two_host_job()
    csvs = {p.stem: p for p in write_nvidia_smi_csv(b.samples(), tmp_path / "trace")}
    post_events(client, PREFIX, b)
    _, offline = offline_ms(b)
    # the keys, not the pace: node1's agent is not run, so node0 waits on it 2 s, not the default
    p = serve(csvs["node0"], "node0", server.url, PREFIX, 0, "--peer-timeout", "2", speed=400)
    try:
        wait_booked(client, PREFIX, b.job, ["node0"], offline.timeline.end_ms)
    finally:
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=30)
    written = sorted(client.scan_iter(f"{PREFIX}:*"))
    assert len(written) >= 20
    for k in written:
        if k == keys.keyspace_key(PREFIX):
            continue  # the keyspace's version: the legacy layout had none (keyspace.detect dates it)
        got = migrate.new_name(PREFIX, legacy_name(k))
        assert got is not None and got[0] == k, (k, got)
        assert migrate.new_name(PREFIX, k) is None  # a new name is never taken for a legacy one


def test_upgraded_agents_book_a_job_begun_under_the_legacy_layout_exactly_once(server, tmp_path, cli):
    client = server.client()
    b = two_host_job()
    csvs = {p.stem: p for p in write_nvidia_smi_csv(b.samples(), tmp_path / "trace")}
    post_events(client, PREFIX, b)
    expected, offline = offline_ms(b)
    # The previous version's agents book part of the job and stop (SIGKILL: mid-round).
    first = [serve(csvs[h], h, server.url, PREFIX, 0) for h in ("node0", "node1")]
    try:
        deadline = time.monotonic() + 60
        while True:
            wms = [ledger.load_watermark(client, PREFIX, b.job, h) for h in ("node0", "node1")]
            if all(w and w["booked_until"] > offline.timeline.start_ms + 200_000 for w in wms):
                break
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        for p in first:
            p.send_signal(signal.SIGKILL)
            p.wait(10)
    half = ledger.net_ms(ledger.read_amounts(client, PREFIX, b.job))
    assert 0 < sum(half.values()) < sum(expected.values())
    legacy = to_legacy(client)
    # Their node keys are gone 30 s after they stopped: the upgraded agents do not wait.
    for k in legacy:
        if k.startswith(f"{PREFIX}:node:"):
            client.delete(k)
    plan = cli("keys", "migrate", "--dry-run", "--redis-url", server.url, "--prefix", PREFIX)
    assert plan.returncode == 0, plan.stderr
    assert len(plan.stdout.splitlines()) == len(client.keys(f"{PREFIX}:*")) > 20
    assert ledger.read_amounts(client, PREFIX, b.job) == {}  # nothing under the new names yet

    second = [serve(csvs[h], h, server.url, PREFIX, 0) for h in ("node0", "node1")]
    try:
        wait_booked(client, PREFIX, b.job, ["node0", "node1"], offline.timeline.end_ms)
    finally:
        for p in second:
            p.send_signal(signal.SIGTERM)
        errs = [p.communicate(timeout=30)[1] for p in second]
    assert all(p.returncode == 0 for p in second), errs
    assert "migrated the keyspace under ce: sub-prefixes (to version 2)" in "".join(errs)
    assert keyspace.stored(client, PREFIX) == keyspace.VERSION
    assert "was not moved" not in "".join(errs)
    # Every GPU-second of the job once: the first agents' part and the rest, to the ms.
    assert ledger.net_ms(ledger.read_amounts(client, PREFIX, b.job)) == expected
    left = [k for k in client.scan_iter(f"{PREFIX}:*") if migrate.new_name(PREFIX, k)]
    assert left == []
    state = client.hgetall(keys.rollup_state_key(PREFIX, b.job))
    assert state.get("v") == "1", state


def test_an_agent_starting_during_another_agents_move_sees_it_unfinished(server, monkeypatch):
    """While any legacy key is left, one of the keys `ensure` looks for is too: an agent that
    starts while another moves the keys moves along with it, rather than booking (and writing
    its samples under the new names) before its own keys have moved."""
    client = server.client()
    job = "j"
    client.xadd(keys.stream_key(PREFIX, job), {"x": "1"})
    client.hset(keys.ranks_key(PREFIX, job), "0", "{}")
    client.zadd(keys.jobs_key(PREFIX), {job: 1})
    client.incr(keys.registrations_key(PREFIX))
    client.set(keys.epoch_key(PREFIX), "e1")
    client.hset(keys.readers_key(PREFIX, job), "a", "1")
    for host in ("node0", "node1"):
        client.xadd(keys.samples_key(PREFIX, job, host), {"x": "1"})
        client.hset(keys.watermark_key(PREFIX, job, host), "booked_until", "1")
    to_legacy(client)
    marker_left: list[bool] = []
    real_move = migrate.move

    def move_then_look(*args):
        real_move(*args)
        if migrate.legacy_keys(client, PREFIX):  # the move is not finished: what a starting agent sees
            marker_left.append(any(client.exists(k) for k in migrate.legacy_markers(PREFIX)))

    monkeypatch.setattr(migrate, "move", move_then_look)
    migrate.migrate(client, PREFIX)
    assert len(marker_left) >= 9 and all(marker_left), marker_left
    assert migrate.legacy_keys(client, PREFIX) == []


def test_a_hosts_legacy_sample_stream_is_deleted_not_moved_under_a_name_nobody_reads(server, cli):
    """A host's sample stream of the legacy layout (`<prefix>:{<job>}:samples:<host>`) is a few
    seconds of band window: this version reads a job's shared streams, so the migration deletes
    it, says so in the dry run and the summary, and leaves no key under a per-host name."""
    client = server.client()
    job = "j"
    client.set(keys.legacy_key(PREFIX, "epoch"), "e1")
    client.xadd(keys.legacy_job_key(PREFIX, job, "events"), {"x": "1"})
    for host in ("node0", "node1"):
        client.xadd(keys.legacy_job_key(PREFIX, job, "samples", host), {"x": "1"})
    plan = cli("keys", "migrate", "--dry-run", "--redis-url", server.url, "--prefix", PREFIX)
    assert plan.returncode == 0, plan.stderr
    assert plan.stdout.count("deleted (a host's sample stream") == 2, plan.stdout
    done = cli("keys", "migrate", "--redis-url", server.url, "--prefix", PREFIX)
    assert done.returncode == 0, done.stderr
    assert "2 deleted" in done.stderr, done.stderr
    left = sorted(client.scan_iter(f"{PREFIX}:*"))
    assert not [k for k in left if "samples" in k], left
    assert migrate.legacy_keys(client, PREFIX) == []
    assert client.xlen(keys.stream_key(PREFIX, job)) == 1  # the trainer's events moved, as before


def test_agents_of_the_previous_version_still_running_hold_the_move(server, cli):
    client = server.client()
    client.set(keys.legacy_key(PREFIX, "epoch"), "e1")
    client.set(keys.legacy_key(PREFIX, "node", "gpu-7"), "{}", ex=30)
    assert keyspace.ensure(client, PREFIX) is False
    assert client.get(keys.legacy_key(PREFIX, "epoch")) == "e1"  # nothing moved
    assert keyspace.stored(client, PREFIX) is None and keyspace.detect(client, PREFIX) == keyspace.LEGACY
    r = cli("keys", "migrate", "--redis-url", server.url, "--prefix", PREFIX)
    assert r.returncode == 2 and "gpu-7" in r.stderr and "Traceback" not in r.stderr, r.stderr
    client.delete(keys.legacy_key(PREFIX, "node", "gpu-7"))  # it stopped 30 s ago
    assert keyspace.ensure(client, PREFIX) is True
    assert client.get(keys.epoch_key(PREFIX)) == "e1" and not client.exists(keys.legacy_key(PREFIX, "epoch"))
    assert keyspace.stored(client, PREFIX) == keyspace.VERSION


def legacy_post(client, job: str, entries: list[dict]) -> None:
    """What a reporter of the previous version sends: XADD, the register to the ranks hash, the
    jobs index, the counter."""
    pipe = client.pipeline(transaction=False)
    for e in entries:
        pipe.xadd(keys.legacy_job_key(PREFIX, job, "events"), e)
        if e["type"] == "register":
            pipe.hset(keys.legacy_job_key(PREFIX, job, "ranks"), e["rank"], json.dumps(e))
    pipe.zadd(keys.legacy_key(PREFIX, "jobs"), {job: max(float(e["ts"]) for e in entries)}, gt=True)
    pipe.execute_command("INCR", keys.legacy_key(PREFIX, "registrations"))
    pipe.execute()


def test_what_old_trainers_write_after_the_move_is_forwarded_once(server):
    client = redis.Redis(port=server.port, decode_responses=True)
    b = two_host_job()
    entries = [event_entry(e) for e in sorted(b.events, key=lambda e: e.ts)]
    cut = len(entries) // 2
    legacy_post(client, b.job, entries[:cut])
    assert migrate.migrate(client, PREFIX).moved == 4  # events, ranks, jobs, counter
    # The old trainer goes on: part of it twice (a batch resent after a lost reply).
    legacy_post(client, b.job, entries[cut - 5 :])
    report = migrate.forward(client, PREFIX)
    assert report.events == len(entries) - cut + 5 and report.merged >= 3
    assert migrate.forward(client, PREFIX).touched == 0  # nothing new: nothing moved
    assert not client.exists(keys.legacy_job_key(PREFIX, b.job, "events"), keys.legacy_key(PREFIX, "jobs"))
    reader = EventReader(client, b.job, prefix=PREFIX)
    got = reader.read_all()
    assert len(got) == len(entries) and reader.stats["duplicate"] == 5
    latest = max(float(e["ts"]) for e in entries)
    assert client.zscore(keys.jobs_key(PREFIX), b.job) == pytest.approx(latest)
    assert int(client.get(keys.registrations_key(PREFIX))) >= 2


def test_a_newer_registration_wins_and_a_ledger_is_never_merged(server, cli):
    client = redis.Redis(port=server.port, decode_responses=True)
    new_ranks, old_ranks = keys.ranks_key(PREFIX, "j"), keys.legacy_job_key(PREFIX, "j", "ranks")
    client.hset(new_ranks, mapping={"0": json.dumps({"ts": 200}), "1": json.dumps({"ts": 100})})
    client.hset(old_ranks, mapping={"0": json.dumps({"ts": 150}), "1": json.dumps({"ts": 300}), "2": "{"})
    client.set(keys.watermark_key(PREFIX, "j", "a"), '{"booked_until": 5}')
    client.set(keys.legacy_job_key(PREFIX, "j", "wm", "a"), '{"booked_until": 9}')
    client.hset(keys.total_key(PREFIX, "j"), "productive:ms", 5)
    client.hset(keys.legacy_job_key(PREFIX, "j", "ledger", "total"), "productive:ms", 5)
    r = cli("keys", "migrate", "--redis-url", f"redis://127.0.0.1:{server.port}/0", "--prefix", PREFIX)
    assert r.returncode == 1 and keys.legacy_job_key(PREFIX, "j", "wm", "a") in r.stdout, r.stdout + r.stderr
    ranks = {k: json.loads(v).get("ts") if v != "{" else v for k, v in client.hgetall(new_ranks).items()}
    assert ranks == {"0": 200, "1": 300, "2": "{"}
    # The watermarks differ: both kept, neither changed. The identical totals: one kept.
    assert client.get(keys.watermark_key(PREFIX, "j", "a")) == '{"booked_until": 5}'
    assert client.get(keys.legacy_job_key(PREFIX, "j", "wm", "a")) == '{"booked_until": 9}'
    assert not client.exists(keys.legacy_job_key(PREFIX, "j", "ledger", "total"))
    assert client.hget(keys.total_key(PREFIX, "j"), "productive:ms") == "5"


def test_the_previous_releases_per_host_sample_streams_are_deleted_and_nothing_else(server, cli):
    """`<prefix>:a:{<job>}:samples:<host>` (one stream per host, before the shared streams) is
    read by no agent now: `keys migrate` lists and deletes it; the job's shared sample streams
    and every other key of the current layout stay."""
    client = server.client()
    job = "ns/train:1"
    kept = [keys.samples_key(PREFIX, job, "node0"), keys.stream_key(PREFIX, job)]
    for k in kept:
        client.xadd(k, {"x": "1"})
    client.set(keys.job_key(PREFIX, keys.AGENT, job, "watermark", "node0"), "1")
    stale = [keys.job_key(PREFIX, keys.AGENT, job, "samples", h) for h in ("node0", "node-1.example")]
    for k in stale:
        client.xadd(k, {"x": "1"})
    before = sorted(client.scan_iter(f"{PREFIX}:*"))
    plan = cli("keys", "migrate", "--dry-run", "--redis-url", server.url, "--prefix", PREFIX)
    assert plan.returncode == 0, plan.stderr
    assert sorted(line.split()[0] for line in plan.stdout.splitlines()) == sorted(stale), plan.stdout
    assert sorted(client.scan_iter(f"{PREFIX}:*")) == before  # a dry run deletes nothing
    done = cli("keys", "migrate", "--redis-url", server.url, "--prefix", PREFIX)
    assert done.returncode == 0 and "2 deleted" in done.stderr, done.stderr
    after = set(client.scan_iter(f"{PREFIX}:*"))  # (plus what the API's start-up upkeep writes)
    assert not after & set(stale) and set(before) - set(stale) <= after, after
