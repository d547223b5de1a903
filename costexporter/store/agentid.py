"""One agent id, one host: a lease in Redis (SET with a TTL, renewed every round).

The ledger keys an agent writes (watermarks, folds, stream positions) are named by its agent id.
Two hosts that present the same id would overwrite each other's watermarks every round, and each
would drop the time of its own GPUs the other's watermark had passed: half the money, quietly.
The first host to claim an id holds it while it renews the lease; another host presenting the id
is refused (at start: exit 2; later: it books nothing, says so, and takes over once the holder's
lease runs out). A restart on the same host (a new process) takes the id over at once.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from costexporter.store import keys
from costexporter.store.client import RedisClient
from costexporter.store.keyspace import VERSION

# Renew the lease, or take it when it is free or held by this host; else answer the holder.
_CLAIM = """
local ok, cur = pcall(redis.call, 'GET', KEYS[1])
if not ok then return {'wrongtype'} end
if cur then
  local good, d = pcall(cjson.decode, cur)
  if good and type(d) == 'table' and d['host'] ~= nil and d['host'] ~= ARGV[1] then return {'held', cur} end
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return {'ok'}
"""

_RELEASE = """
local cur = redis.call('GET', KEYS[1])
if cur then
  local good, d = pcall(cjson.decode, cur)
  if good and type(d) == 'table' and d['host'] == ARGV[1] then redis.call('DEL', KEYS[1]) end
end
return 0
"""


class AgentIdInUse(RuntimeError):
    """Another host holds this agent id."""

    def __init__(self, agent: str, host: str, holder: dict[str, Any]) -> None:
        try:
            since = f"renewed {time.time() - float(holder['ts']):.0f} s ago"
        except (KeyError, TypeError, ValueError):
            since = "renewed lately"
        other = str(holder.get("host"))[:255]
        super().__init__(
            f"agent id {agent!r} is held by host {other!r} ({since}), "
            f"not this host {host!r}: two hosts with one --agent-id would overwrite each other's "
            "watermarks and lose GPU time. Give every host its own --agent-id (the default is the "
            "host name)"
        )
        self.holder = holder


def claim(client: RedisClient, prefix: str, agent: str, host: str, ttl_s: float) -> dict[str, Any] | None:
    """Hold (or renew) agent id `agent` for `host` for `ttl_s`. None when this host holds it
    now; else the holder's entry (a dict with its `host`). A lease key of another type (not
    written by an agent) is replaced."""
    k = keys.agent_id_key(prefix, agent)
    # `keyspace`: the layout this agent writes (a migration waits for older ones: keyspace.py)
    entry = json.dumps({"host": host, "pid": os.getpid(), "ts": round(time.time(), 3), "keyspace": VERSION})
    got = [_text(x) for x in client.execute_command("EVAL", _CLAIM, 1, k, host, entry, int(ttl_s * 1000))]
    if got and got[0] == "wrongtype":
        client.delete(k)
        got = [_text(x) for x in client.execute_command("EVAL", _CLAIM, 1, k, host, entry, int(ttl_s * 1000))]
    if got and got[0] == "held":
        try:
            holder = json.loads(got[1])
        except (TypeError, ValueError):
            holder = {}
        return holder if isinstance(holder, dict) else {}
    return None


def _text(x: object) -> str:
    return x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x)


def release(client: RedisClient, prefix: str, agent: str, host: str) -> None:
    """Give the id up (at shutdown), if this host holds it: a host that takes over need not wait."""
    client.execute_command("EVAL", _RELEASE, 1, keys.agent_id_key(prefix, agent), host)
