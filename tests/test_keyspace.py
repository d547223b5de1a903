"""The keyspace's version and its ordered migrations (store/keyspace.py): every earlier layout
comes to this release's, each step idempotent (run twice, or after a crash halfway, the same
keys); a fresh Redis is stamped; a keyspace newer than this release is never written; the
version never goes down; a step waits for agents that still write the layout before it."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from costexporter.store import keys, keyspace, ledger, migrate

from .api_helpers import write_job
from .conftest import SHARED_URL, drop_prefix
from .test_migrate import to_legacy


def _booked(client: redis.Redis, prefix: str) -> None:
    """Two jobs' ledgers, meta and registrations, as this release writes them."""
    write_job(client, prefix, "llm-1", "llm", namespace="ns-a")
    write_job(client, prefix, "vis-1", None, project="atlas")
    client.set(keys.epoch_key(prefix), "e1")


def layout_legacy(client: redis.Redis, prefix: str) -> None:
    _booked(client, prefix)
    to_legacy(client, prefix)


# A builder of the layout before each migration: a new migration without one fails
# `test_every_migration_has_the_layout_before_it`.
LAYOUTS: dict[int, Callable[[redis.Redis, str], None]] = {keyspace.LEGACY: layout_legacy}


def snapshot(client: redis.Redis, prefix: str) -> dict[str, bytes]:
    raw = redis.Redis.from_url(SHARED_URL)
    return {
        k.decode(): raw.dump(k)
        for k in raw.scan_iter(f"{prefix}:*")
        if k != keys.keyspace_key(prefix).encode()
    }


@pytest.fixture
def client():
    return redis.Redis.from_url(SHARED_URL, decode_responses=True)


def test_every_migration_has_the_layout_before_it():
    tos = [m.to for m in keyspace.MIGRATIONS]
    assert tos == list(range(keyspace.LEGACY + 1, keyspace.VERSION + 1))  # consecutive, in order
    assert len({m.name for m in keyspace.MIGRATIONS}) == len(tos)
    assert set(LAYOUTS) == {t - 1 for t in tos}


@pytest.mark.parametrize("version", sorted(LAYOUTS))
def test_every_earlier_layout_comes_to_this_releases_and_a_second_run_changes_nothing(client, version):
    prefix, fresh = f"ks-{uuid.uuid4().hex[:8]}", f"ks-{uuid.uuid4().hex[:8]}"
    try:
        LAYOUTS[version](client, prefix)
        _booked(client, fresh)  # the same data written by this release, its rollups built (what
        ledger.build_rollups(client, fresh)  # the API does at its start, and the legacy move too)
        assert keyspace.detect(client, prefix) == version
        done = keyspace.upgrade(client, prefix, by="test")
        assert [line.split(" ")[0] for line in done] == [m.name for m in keyspace.pending(version)]
        assert keyspace.stored(client, prefix) == keyspace.VERSION
        after = snapshot(client, prefix)
        assert {k.replace(prefix, "P", 1) for k in after} == {
            k.replace(fresh, "P", 1) for k in snapshot(client, fresh)
        }
        assert keyspace.upgrade(client, prefix) == [] and snapshot(client, prefix) == after
        record = client.hgetall(keys.keyspace_key(prefix))
        ran = {
            f.removeprefix("migration:"): json.loads(v)
            for f, v in record.items()
            if f.startswith("migration:")
        }
        assert set(ran) == {m.name for m in keyspace.pending(version)} and all(
            r["by"] == "test" for r in ran.values()
        )
    finally:
        drop_prefix(client, prefix)
        drop_prefix(client, fresh)


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(crash_after=st.integers(0, 40))
def test_a_migration_that_crashed_halfway_ends_in_the_same_keys_when_run_again(crash_after):
    """The legacy move stopped after any number of keys (the process killed): run again, it ends
    where an uninterrupted run ends."""
    client = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    prefix, whole = f"ks-{uuid.uuid4().hex[:8]}", f"ks-{uuid.uuid4().hex[:8]}"
    real_move = migrate.move
    moved = [0]

    def crashing(*args, **kw):
        if moved[0] >= crash_after:
            raise ConnectionError("killed")
        moved[0] += 1
        return real_move(*args, **kw)

    try:
        for p in (prefix, whole):
            layout_legacy(client, p)
        keyspace.upgrade(client, whole)
        migrate.move = crashing
        try:
            keyspace.upgrade(client, prefix)
            crashed = False
        except ConnectionError:
            crashed = True
        finally:
            migrate.move = real_move
        if crashed:
            assert keyspace.stored(client, prefix) is None  # the version moves only once the step is done
        keyspace.upgrade(client, prefix)
        assert keyspace.stored(client, prefix) == keyspace.VERSION
        assert {k.replace(prefix, "P", 1) for k in snapshot(client, prefix)} == {
            k.replace(whole, "P", 1) for k in snapshot(client, whole)
        }
    finally:
        migrate.move = real_move
        drop_prefix(client, prefix)
        drop_prefix(client, whole)


def test_a_fresh_keyspace_is_stamped_and_a_newer_one_is_never_written(client, prefix, cli, caplog):
    assert keyspace.detect(client, prefix) == keyspace.VERSION and keyspace.stored(client, prefix) is None
    assert keyspace.ensure(client, prefix) is True
    assert keyspace.stored(client, prefix) == keyspace.VERSION
    ok = cli("keys", "status", "--redis-url", SHARED_URL, "--prefix", prefix)
    assert ok.returncode == 0 and f"version {keyspace.VERSION} (stored)" in ok.stdout, ok.stdout + ok.stderr
    # A newer release migrated it: this one books nothing, says why once, and never lowers it.
    client.hset(keys.keyspace_key(prefix), "version", keyspace.VERSION + 1)
    with caplog.at_level("ERROR", logger="costexporter.keyspace"):
        assert keyspace.ensure(client, prefix) is False
        assert keyspace.ensure(client, prefix) is False
    said = [r.getMessage() for r in caplog.records if "newer than this release" in r.getMessage()]
    assert len(said) == 1, said
    with pytest.raises(keyspace.NewerKeyspace):
        keyspace.upgrade(client, prefix)
    assert keyspace.stored(client, prefix) == keyspace.VERSION + 1
    newer = cli("keys", "status", "--redis-url", SHARED_URL, "--prefix", prefix)
    assert newer.returncode == 1 and "newer than this release" in newer.stdout
    refused = cli("keys", "migrate", "--redis-url", SHARED_URL, "--prefix", prefix)
    assert (
        refused.returncode == 2
        and "upgrade this program" in refused.stderr
        and "Traceback" not in refused.stderr
    )


def test_an_agent_books_nothing_under_a_newer_keyspace(client, prefix):
    from costexporter.services.agent import Agent
    from costexporter.services.agent_config import AgentConfig
    from costexporter.sources.playback import ReplaySource
    from costexporter.sources.synth import TraceBuilder

    client.hset(keys.keyspace_key(prefix), "version", keyspace.VERSION + 1)
    b = TraceBuilder(n_gpus=1, per_host=1, job="newer", seed=2)
    b.stretch("compute", 30, step_s=5)
    agent = Agent(ReplaySource(b.samples(), speed=1e6), AgentConfig(redis_url=SHARED_URL, prefix=prefix))
    try:
        for _ in range(3):
            agent.tick()
        assert agent.stats["layout_waits"] == 3
        assert not client.exists(keys.watermark_key(prefix, "_unassigned", agent.cfg.agent_id))
    finally:
        agent.stop()


def test_the_version_never_goes_down_and_a_step_waits_for_agents_of_the_layout_before_it(
    client, prefix, monkeypatch
):
    """A later step (a test migration to version 3) waits while an agent's lease says it writes
    version 2; once that lease is gone it runs, once; an older program's stamp cannot lower it."""
    ran: list[str] = []

    def step(c, p, force):
        ran.append(p)
        c.set(keys.ns_key(p, keys.AGENT, "moved-by-step-3"), "1")
        return "1 key written"

    monkeypatch.setattr(keyspace, "VERSION", 3)
    monkeypatch.setattr(keyspace, "MIGRATIONS", (*keyspace.MIGRATIONS, keyspace.Migration(3, "step-3", step)))
    client.hset(keys.keyspace_key(prefix), "version", 2)
    lease = keys.agent_id_key(prefix, "gpu-9")
    client.set(lease, json.dumps({"host": "gpu-9", "ts": 0, "keyspace": 2}), ex=30)
    client.set(
        keys.agent_id_key(prefix, "gpu-8"), json.dumps({"host": "gpu-8", "ts": 0, "keyspace": 3}), ex=30
    )
    with pytest.raises(keyspace.OlderAgentsRunning, match="gpu-9"):
        keyspace.upgrade(client, prefix)
    assert keyspace.ensure(client, prefix) is False and ran == []
    client.delete(lease)
    assert keyspace.ensure(client, prefix) is True and ran == [prefix]
    assert keyspace.ensure(client, prefix) is True and ran == [prefix]  # once
    assert keyspace.stored(client, prefix) == 3
    client.execute_command("EVAL", keyspace._RAISE, 1, keys.keyspace_key(prefix), 2, "", "")
    assert keyspace.stored(client, prefix) == 3
