"""The keyspace's version, and the ordered migrations that bring an older keyspace to it.

A Redis says which layout it holds in one key, `<prefix>:a:keyspace` (a hash: `version`, and per
migration that ran, when and by whom). An agent checks it before its first booking round
(`ensure`): a keyspace of an older version is migrated, one step at a time in `MIGRATIONS`'
order, each step idempotent (run twice, or after a crash halfway, it ends in the same keys); a
keyspace of a newer version than this release's is never written: the agent books nothing and
says to upgrade it. A Redis with no version key is dated by what it holds (`detect`): the
legacy layout's keys, else this release's layout (a fresh Redis too).

Additive changes (a new field, a new key no older reader needs) do not bump the version: older
agents and readers ignore what they do not know. A change that moves or rewrites keys does,
with its migration here and a builder of the layout before it in tests/test_keyspace.py (the
test fails for a migration without one). docs/compatibility.md is the written policy.

Rolling upgrades: a migration waits while an agent of an older version still renews its lease
(`agentid`, which names the keyspace version each agent writes), since it would go on writing
the old layout; agents of the legacy layout are seen by their node keys (`migrate.old_agents`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from costexporter.store import keys, migrate
from costexporter.store.client import RedisClient

log = logging.getLogger("costexporter.keyspace")

LEGACY = 1  # `<prefix>:{<job>}:...`: every key of a job under one tag (store/migrate.py)
VERSION = 2  # the sub-prefixed layout (store/keys.py): trainers t:, agents a:, readers r:, watchers w:

# Set the version only upward, and record the step (KEYS: the version key; ARGV: version, step
# name, its record as JSON). Returns the version stored after it.
_RAISE = """
local cur = tonumber(redis.call('HGET', KEYS[1], 'version') or '0') or 0
local want = tonumber(ARGV[1])
if want > cur then
  redis.call('HSET', KEYS[1], 'version', ARGV[1])
  if ARGV[2] ~= '' then redis.call('HSET', KEYS[1], 'migration:' .. ARGV[2], ARGV[3]) end
  return want
end
return cur
"""


@dataclass(frozen=True, slots=True)
class Migration:
    """One step: from version `to - 1` to `to`. `run` is idempotent and raises
    `migrate.OldAgentsRunning` while agents that write the older layout still run."""

    to: int
    name: str
    run: Callable[[Any, str, bool], str]  # (client, prefix, force) -> what it did, one line


def _sub_prefixes(client: RedisClient, prefix: str, force: bool) -> str:
    report = migrate.migrate(client, prefix, force=force)
    for old, new in report.conflicts:
        log.error("%s was not moved: %s exists too; compare the two, keep one", old, new)
    return report.summary()


MIGRATIONS: tuple[Migration, ...] = (Migration(2, "sub-prefixes", _sub_prefixes),)


class NewerKeyspace(RuntimeError):
    """The keyspace is of a newer version than this release writes."""

    def __init__(self, found: int) -> None:
        super().__init__(
            f"the keyspace is version {found}, newer than this release's {VERSION}: upgrade this "
            "program (an older agent would write the layout the newer ones moved away from)"
        )
        self.found = found


class OlderAgentsRunning(RuntimeError):
    """Agents that write an older keyspace version still run."""

    def __init__(self, agents: list[str], target: int) -> None:
        shown = ", ".join(agents[:5]) + (f" and {len(agents) - 5} more" if len(agents) > 5 else "")
        super().__init__(
            f"agents that write keyspace version < {target} still run ({shown}): upgrade them; "
            "the keyspace moves once none has renewed its lease"
        )
        self.agents = agents


def stored(client: RedisClient, prefix: str) -> int | None:
    """The version the keyspace says it holds; None where it says nothing (or nothing usable)."""
    raw = client.hget(keys.keyspace_key(prefix), "version")
    try:
        return int(raw) if raw is not None else None
    except (TypeError, ValueError):
        return None


def detect(client: RedisClient, prefix: str) -> int:
    """The keyspace's version: as stored, else dated by what it holds (the legacy layout's marker
    keys: LEGACY; anything else, a fresh Redis included: this release's)."""
    v = stored(client, prefix)
    if v is not None:
        return v
    import redis

    try:
        legacy = any(client.exists(k) for k in migrate.legacy_markers(prefix))
    except redis.exceptions.NoPermissionError:
        legacy = False  # a user of this version's ACL cannot read the legacy names: none to move
    return LEGACY if legacy else VERSION


def older_agents(client: RedisClient, prefix: str, target: int) -> list[str]:
    """Agent ids whose live lease says they write a keyspace version below `target` (a lease of a
    release before the field: version 2)."""
    out = []
    for k in client.scan_iter(match=migrate.escape(keys.agent_id_key(prefix, "")) + "*", count=1000):
        raw = client.get(k)
        try:
            entry = json.loads(raw) if raw is not None else {}
        except (TypeError, ValueError):
            continue
        if isinstance(entry, dict) and int(entry.get("keyspace", 2) or 2) < target:
            name = k.decode() if isinstance(k, bytes) else str(k)
            out.append(name.rsplit(":", 1)[-1])
    return sorted(out)


def pending(version: int) -> list[Migration]:
    """The migrations that bring a keyspace of `version` to this release's, in order."""
    return [m for m in MIGRATIONS if m.to > version]


def upgrade(client: RedisClient, prefix: str, *, force: bool = False, by: str = "") -> list[str]:
    """Bring the keyspace to `VERSION`: each pending migration in order, the version raised
    after each (never lowered). Returns one line per step run. NewerKeyspace for a keyspace
    newer than this release; migrate.OldAgentsRunning / OlderAgentsRunning while agents of an
    older layout still write (unless `force`)."""
    current = detect(client, prefix)
    if current > VERSION:
        raise NewerKeyspace(current)
    done = []
    for m in pending(current):
        if not force and m.to > LEGACY + 1:
            agents = older_agents(client, prefix, m.to)
            if agents:
                raise OlderAgentsRunning(agents, m.to)
        what = m.run(client, prefix, force)
        record = json.dumps({"at": round(time.time(), 3), "by": by, "did": what})
        client.execute_command("EVAL", _RAISE, 1, keys.keyspace_key(prefix), m.to, m.name, record)
        done.append(f"{m.name} (to version {m.to}): {what}")
    if stored(client, prefix) is None:  # a fresh keyspace, or one this release found current
        client.execute_command("EVAL", _RAISE, 1, keys.keyspace_key(prefix), VERSION, "", "")
    return done


_said: set[str] = set()


def ensure(client: RedisClient, prefix: str, by: str = "") -> bool:
    """An agent's check before its first round: True when the keyspace is this release's (moving
    it there now when no agent of an older layout runs); False while one still runs, or while
    the keyspace is newer than this release (said once, at ERROR)."""
    import redis

    try:
        done = upgrade(client, prefix, by=by)
    except (migrate.OldAgentsRunning, OlderAgentsRunning) as e:
        _once(f"old:{e}", logging.WARNING, "not booking yet: %s", e)
        return False
    except NewerKeyspace as e:
        _once(f"newer:{e.found}", logging.ERROR, "not booking: %s", e)
        return False
    except redis.exceptions.NoPermissionError as e:
        _once("noperm", logging.ERROR, "cannot check the keyspace's version under this ACL (%s)", e)
        return False
    for line in done:
        log.warning("migrated the keyspace under %s: %s", prefix, line)
    return True


def _once(key: str, level: int, msg: str, *args: object) -> None:
    if key not in _said:
        _said.add(key)
        log.log(level, msg, *args)
