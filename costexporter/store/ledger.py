"""The ledger in Redis (docs/ledger.md): exact integer amounts per job, bucket and category.

Keys (built in keys.py; all in the job's hash-tag slot, so one MULTI/EXEC covers a round):

    <p>:a:{job}:ledger:total               hash  all-time amounts
    <p>:a:{job}:ledger:5m:<start>          hash  one 5-minute bucket (start: Unix seconds)
    <p>:a:{job}:ledger:1h:<start>, :1d:, :1w:     hourly, daily and weekly (Monday) rollups
    <p>:a:{job}:ledger:index:<res>         zset  bucket start -> start, to find buckets by time
    <p>:a:{job}:ledger:job                 hash  job-level figures (steps, tokens, ...), SET not added
    <p>:a:{job}:ledger:rbidx:<agent>       hash  step record -> cumulative valid amounts (rollback)
    <p>:a:{job}:ledger:incidents:<agent>   hash  incident id -> JSON
    <p>:a:{job}:ledger:incidents           set   agents that wrote incidents of the job (the index)
    <p>:a:{job}:ledger:cum                 zset  the job's rollup: per 5-minute bucket the net
                                                  amounts up to and including it (see below)
    <p>:a:{job}:ledger:cumstate            hash  whether the rollup is usable, its price version
    <p>:a:{job}:wm:<agent>                 string the agent's watermark (JSON)
    <p>:a:epoch                            string this Redis's life: set once, gone after an
                                                  empty restart (the agents notice)

Fields of an amounts hash: `<category>:ms` (GPU-milliseconds), `<category>:mj` (millijoules),
`<category>:ucost` (micro-units of the currency), and the rollback corrections
`voided:<category>:ms|mj|ucost` (valid amounts later voided by a resume; the same amounts are
added to `rolled_back`). Counters only go up; a reader subtracts the `voided:` fields.
`price_version` names the price table the bucket was costed with.

The rollup lets the API answer any 5-minute-aligned window of a job with two reads (the record
of the last bucket before the window's end minus that before its start) instead of summing every
bucket of the window. `ledger:cum` is a sorted set, score a 5-minute bucket start, member the
record `[start, amounts...]`: a JSON array of the start and the net amounts (valid minus
`voided:`) of every 5-minute bucket up to and including it, in the order CATEGORIES x UNITS.
`ledger:cumstate` holds `v`: "1" usable; "big" a sum reached 2^53 (Lua's exact integer limit);
"bad" the rollup met something that is not a record or an amount: readers then sum buckets (the
exact path); and `pv`: the one price version every write used (a newline once two differed:
readers sum buckets, which name each bucket's version). Both are written by a script queued in
the same MULTI as the amounts, so they can never disagree with them: a write that loses the
watermark's compare-and-set writes neither. A ledger written before the rollup existed has none
until `build_rollup` makes it (the API does, at start); until then writes leave it alone.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from costexporter.core.attribution import FIELD_NAMES, Attribution
from costexporter.core.buckets import RESOLUTIONS, UNITS, bucket_start
from costexporter.core.model import CATEGORIES
from costexporter.store import keys
from costexporter.store.client import Pipeline, RedisClient

UNASSIGNED_JOB = "_unassigned"  # GPU time no job registered: a ledger of its own, same layout


VOIDED = "voided:"  # the prefix of a rollback correction's field
ATTR = "attr:"  # the prefix of a figures field holding the job's attribution (`queue_attribution`)
NOTE = "note:"  # the prefix of a figures field that says something about the job (`note`)
MAX_NOTES = 32  # notes an agent writes per job (a flood of claimants cannot grow the hash)


def amount_field(category: str, unit: str, *, voided: bool = False) -> str:
    """The name of one amount in an amounts hash (the one spelling its writer and readers use)."""
    return f"{VOIDED if voided else ''}{category}:{unit}"


def _fields(a: np.ndarray, voided: bool = False) -> dict[str, int]:
    return {
        amount_field(CATEGORIES[c], u, voided=voided): int(a[c, j])
        for c in range(a.shape[0])
        for j, u in enumerate(UNITS)
        if a[c, j]
    }


PACKED = [amount_field(c, u) for c in CATEGORIES for u in UNITS]  # the rollup's packing order
EXACT_LIMIT = 2**53  # Lua numbers are doubles: integers below this are exact

_LUA_PARSE = r"""
-- A record: a JSON array of `n` integers, the bucket start then the amounts (cjson decodes in C:
-- a third of the time of a Lua loop). nil if it is not one.
local function parse(s, n)
  local ok, t = pcall(cjson.decode, s)
  if not ok or type(t) ~= 'table' or #t ~= n then return nil end
  for i = 1, n do
    local v = t[i]
    if type(v) ~= 'number' or v ~= v or v == math.huge or v == -math.huge or v ~= math.floor(v) then
      return nil
    end
  end
  return t
end
-- Written by hand: cjson.encode keeps only 14 significant digits.
local function pack(b, t, width)
  local out = {b}
  for i = 1, width do out[i + 1] = string.format('%.0f', t[i] or 0) end
  return '[' .. table.concat(out, ',') .. ']'
end
"""

# KEYS: the rollup's state, its records, the 5-minute index. ARGV: the price version, then
# (5-minute bucket start, JSON array of net amounts) pairs in ascending order. Runs inside the
# booking's MULTI before its HINCRBYs and ZADDs, so an empty index means a new ledger (the
# rollup starts with it). Every record at or after a bucket gains its amounts: usually none but
# the newest; a bucket without a record gets one (the previous record plus its amounts).
ROLLUP_ADD = (
    _LUA_PARSE
    + r"""
local st, cum, idx, width = KEYS[1], KEYS[2], KEYS[3], @WIDTH@
local function run()
  local state = redis.call('HGET', st, 'v')
  if not state then
    if redis.call('EXISTS', idx) == 1 then return 0 end  -- older ledger: build_rollup makes it
    redis.call('HSET', st, 'v', '1')
  elseif state ~= '1' then
    return 0
  end
  local pv = redis.call('HGET', st, 'pv')
  if not pv then redis.call('HSET', st, 'pv', ARGV[1])
  elseif pv ~= ARGV[1] then redis.call('HSET', st, 'pv', '\n') end
  local big = false
  local function put(b, base, d, old)
    local out = {}
    for i = 1, width do
      local v = (base[i + 1] or 0) + (d[i] or 0)
      if v >= @LIMIT@ or v <= -@LIMIT@ then big = true end
      out[i] = v
    end
    if old then redis.call('ZREM', cum, old) end
    redis.call('ZADD', cum, b, pack(b, out, width))
  end
  for i = 2, #ARGV, 2 do
    local b, d = ARGV[i], parse(ARGV[i + 1], width)
    local later = redis.call('ZRANGEBYSCORE', cum, b, '+inf')
    local first = later[1] and parse(later[1], width + 1)
    if not first or string.format('%.0f', first[1]) ~= b then
      local p = redis.call('ZREVRANGEBYSCORE', cum, '(' .. b, '-inf', 'LIMIT', 0, 1)[1]
      local base = p and parse(p, width + 1)
      if p and not base then redis.call('HSET', st, 'v', 'bad'); return 0 end
      put(b, base or {}, d, nil)
    end
    for _, m in ipairs(later) do
      local rec = parse(m, width + 1)
      if not rec then redis.call('HSET', st, 'v', 'bad'); return 0 end
      put(string.format('%.0f', rec[1]), rec, d, m)
    end
  end
  if big then redis.call('HSET', st, 'v', 'big') end
  return 1
end
-- Never fail the booking's MULTI (its other writes would stand without the rollup's share): on
-- any error (a key of the wrong type) the rollup is marked unusable, or is unreadable anyway.
local ok, res = pcall(run)
if ok then return res end
pcall(redis.call, 'HSET', st, 'v', 'bad')
return 0
""".replace("@WIDTH@", str(len(PACKED))).replace("@LIMIT@", str(EXACT_LIMIT))
)

# KEYS: the rollup's state, its records, the 5-minute index. ARGV: the 5-minute bucket key's
# prefix. Builds the rollup of a ledger written before it existed, from its 5-minute buckets,
# atomically (a booking of the job runs before or after it, never during). Does nothing if
# there is one.
ROLLUP_BUILD = (
    _LUA_PARSE
    + r"""
local st, cum, idx, width = KEYS[1], KEYS[2], KEYS[3], @WIDTH@
if redis.call('HEXISTS', st, 'v') == 1 then return 0 end
redis.call('DEL', cum)
local names = {@NAMES@}
local field = {}
for i, n in ipairs(names) do field[n] = {i, 1}; field['voided:' .. n] = {i, -1} end
local acc, state, pv = {}, '1', false
for i = 1, width do acc[i] = 0 end
local n = 0
for _, b in ipairs(redis.call('ZRANGE', idx, 0, -1)) do
  local k = ARGV[1] .. b
  local t = redis.call('TYPE', k)['ok']
  local version = ''
  if t == 'hash' then
    local h = redis.call('HGETALL', k)
    for j = 1, #h, 2 do
      local f, v = h[j], h[j + 1]
      if f == 'price_version' then version = v
      elseif field[f] then
        local x = tonumber(v)
        if x == nil or x ~= x or x == math.huge or x == -math.huge then state = 'bad'
        else
          local pos, sign = field[f][1], field[f][2]
          acc[pos] = acc[pos] + sign * x
          if acc[pos] >= @LIMIT@ or acc[pos] <= -@LIMIT@ then state = 'big' end
        end
      end
    end
  elseif t ~= 'none' then state = 'bad' end
  if pv == false then pv = version elseif pv ~= version then pv = '\n' end
  if tonumber(b) == nil then state = 'bad'
  else redis.call('ZADD', cum, b, pack(b, acc, width)) end
  n = n + 1
end
if pv then redis.call('HSET', st, 'pv', pv) end
redis.call('HSET', st, 'v', state)
return n + 1
""".replace("@WIDTH@", str(len(PACKED)))
    .replace("@LIMIT@", str(EXACT_LIMIT))
    .replace("@NAMES@", ", ".join(f"'{f}'" for f in PACKED))
)


def drop_rollup(client: RedisClient, prefix: str, job: str) -> None:
    """Remove a job's rollup (the API's next start rebuilds it from the buckets; until then the
    job is read by summing buckets): after editing a ledger by hand."""
    client.delete(keys.rollup_state_key(prefix, job), keys.rollup_key(prefix, job))


def _rollup_keys(prefix: str, job: str) -> list[str]:
    return [
        keys.rollup_state_key(prefix, job),
        keys.rollup_key(prefix, job),
        keys.index_key(prefix, job, "5m"),
    ]


def queue_rollup(
    pipe: Pipeline, prefix: str, job: str, by_bucket: dict[int, np.ndarray], version: str, sign: int = 1
) -> None:
    """The rollup's share of one write (inside the caller's MULTI, before its HINCRBYs): the net
    amounts per 5-minute bucket (`sign` -1 for the `voided:` corrections). EVAL, not EVALSHA: a
    script missing at EXEC would fail alone while the amounts were written."""
    net: dict[int, np.ndarray] = {}
    for start, a in by_bucket.items():
        b = bucket_start(start, "5m")
        net[b] = net.get(b, 0) + sign * np.asarray(a, np.int64)
    args: list[Any] = [version]
    for b in sorted(net):
        args += [str(b), "[" + ",".join(str(int(x)) for x in net[b].reshape(-1)) + "]"]
    # execute_command: a cluster's pipeline has no eval(); the keys still pick the job's node.
    pipe.execute_command("EVAL", ROLLUP_ADD, 3, *_rollup_keys(prefix, job), *args)


def build_rollup(client: RedisClient, prefix: str, job: str) -> int:
    """Build the rollup of a ledger written before rollups existed (one atomic script): 0 if it
    already had one, else 1 + the number of 5-minute buckets rolled up (1: a ledger with no
    amounts yet, whose rollup starts empty)."""
    bucket_prefix = keys.bucket_key(prefix, job, "5m", "")
    return int(client.execute_command("EVAL", ROLLUP_BUILD, 3, *_rollup_keys(prefix, job), bucket_prefix))


def build_rollups(client: RedisClient, prefix: str) -> int:
    """Build the missing rollups of every job in the jobs index and of `_unassigned` (once, at the
    API's start); returns how many older ledgers (ones holding amounts) were rolled up. A job
    with nothing booked yet gets its empty rollup too, uncounted: nothing older was there."""
    import redis

    jobs = [*client.zrange(keys.jobs_key(prefix), 0, -1), UNASSIGNED_JOB]
    built = 0
    for i in range(0, len(jobs), 500):
        chunk = jobs[i : i + 500]
        pipe = client.pipeline(transaction=False)
        for j in chunk:
            pipe.hexists(keys.rollup_state_key(prefix, j), "v")
        found = pipe.execute(raise_on_error=False)
        missing = [j for j, has in zip(chunk, found, strict=True) if has is False]
        for j in missing:
            try:
                built += build_rollup(client, prefix, j) > 1
            except redis.ResponseError:  # a key of the wrong type: readers sum buckets for it
                continue
    return built


Version = str | Callable[[int], str]  # one price version, or each bucket's (by its start, s)


def queue_amounts(
    pipe: Pipeline,
    prefix: str,
    job: str,
    by_bucket: dict[int, np.ndarray],
    version: Version,
    *,
    voided: bool = False,
) -> None:
    """HINCRBY every bucket, its rollups and the total, and the job's rollup (inside the caller's
    MULTI); `voided`: the amounts are rollback corrections (the `voided:` fields). `version`:
    the price version of each bucket (a price changes only on a 5-minute bound)."""
    of = version if callable(version) else (lambda _start, v=version: v)
    by_version: dict[str, dict[int, np.ndarray]] = {}
    for start, a in by_bucket.items():
        by_version.setdefault(of(start), {})[start] = a
    for pv, part in by_version.items():
        queue_rollup(pipe, prefix, job, part, pv, -1 if voided else 1)
    total: dict[str, int] = {}
    for start, a in by_bucket.items():
        fields = _fields(a, voided)
        for res in RESOLUTIONS:
            b = bucket_start(start, res)
            k = keys.bucket_key(prefix, job, res, b)
            for f, v in fields.items():
                pipe.hincrby(k, f, v)
            pipe.hset(k, "price_version", of(start))
            pipe.zadd(keys.index_key(prefix, job, res), {str(b): b})
        for f, v in fields.items():
            total[f] = total.get(f, 0) + v
    tk = keys.total_key(prefix, job)
    for f, v in total.items():
        pipe.hincrby(tk, f, v)


def queue_incidents(pipe: Pipeline, prefix: str, job: str, agent: str, incidents: Any) -> None:
    """Write incidents (dicts with category and start) and index their hash (in the caller's MULTI)."""
    written = False
    for inc in incidents:
        field = f"{inc['category']}:{inc['start']}"
        pipe.hset(keys.incidents_key(prefix, job, agent), field, json.dumps(inc))
        written = True
    if written:
        pipe.sadd(keys.incident_index_key(prefix, job), agent)


def _glob_escaped(text: str) -> str:
    """`text` matched literally in a SCAN pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def index_incidents(client: RedisClient, prefix: str, count: int = 1000) -> int:
    """Index incident hashes written before the index existed (one SCAN at startup, never on a
    request). Returns how many hashes were indexed."""
    # The key's parts around the job and the agent, from its builder: `<head_of><job><mid><agent>`.
    template = keys.incidents_key(prefix, "\0", "\1")
    head_of, rest = template.split("\0")
    mid = rest.split("\1")[0]
    pattern = f"{_glob_escaped(head_of)}*{_glob_escaped(mid)}*"
    n = 0
    for k in client.scan_iter(match=pattern, count=count):
        k = k.decode() if isinstance(k, bytes) else k
        head, sep, agent = k.rpartition(mid)
        job = head[len(head_of) :]
        if not sep or not head.startswith(head_of) or not agent:
            continue
        client.sadd(keys.incident_index_key(prefix, job), agent)
        n += 1
    return n


def queue_steps(
    pipe: Pipeline, prefix: str, job: str, steps: list[Any], after_ms: int, upto_ms: int, voids: set[int]
) -> None:
    """Step completions and voids as sorted sets keyed by step record, so every agent writes the
    same members (idempotent) and a window's counts are ZCOUNTs.

    `ledger:steps`: score = completion time (s), member = "<record>:<cumulative tokens>";
    `ledger:voids`: score = when the voiding resume was seen, member = "<record>:<cumulative
    voided tokens>". Only completions in (after_ms, upto_ms] and the voids in `voids` (record
    numbers) are sent.
    """
    done, voided = {}, {}
    cum = cum_v = 0
    for i, s in enumerate(steps):
        cum += s.tokens
        if after_ms < s.ts_ms <= upto_ms:
            done[f"{i}:{cum}"] = s.ts_ms / 1000
    order = sorted((i for i, s in enumerate(steps) if s.voided), key=lambda i: (steps[i].voided_ms or 0, i))
    for i in order:
        cum_v += steps[i].tokens
        if i in voids:
            voided[f"{i}:{cum_v}"] = (steps[i].voided_ms or steps[i].ts_ms) / 1000
    if done:
        pipe.zadd(keys.steps_key(prefix, job), done)
    if voided:
        pipe.zadd(keys.voids_key(prefix, job), voided)


def read_amounts(
    client: RedisClient, prefix: str, job: str, res: str | None = None, start: int | None = None
) -> dict[str, int]:
    """One amounts hash as integers (the total, or with `res` the bucket starting at `start`)."""
    if res is None:
        k = keys.total_key(prefix, job)
    elif start is None:
        raise ValueError(f"the {res} bucket of {job!r} needs its start")
    else:
        k = keys.bucket_key(prefix, job, res, start)
    raw = client.hgetall(k)
    out = {}
    for f, v in raw.items():
        f = f.decode() if isinstance(f, bytes) else f
        if f != "price_version":
            out[f] = int(v)
    return out


def net_ms(amounts_: dict[str, int]) -> dict[str, int]:
    """Per category GPU-milliseconds after rollback corrections."""
    return {
        c: amounts_.get(amount_field(c, "ms"), 0) - amounts_.get(amount_field(c, "ms", voided=True), 0)
        for c in CATEGORIES
    }


def load_watermark(client: RedisClient, prefix: str, job: str, agent: str) -> dict[str, Any] | None:
    raw = client.get(keys.watermark_key(prefix, job, agent))
    return json.loads(raw) if raw else None


class Conflict(Exception):
    """The watermark is not what this agent read or wrote last: another process with the same
    agent id wrote it. `stored`: what it holds instead (raw), which says who (`conflict_writer`)."""

    def __init__(self, job: str, stored: object = None) -> None:
        super().__init__(job)
        self.stored = stored


def conflict_writer(stored: object) -> dict[str, Any] | None:
    """Who wrote a watermark met in a Conflict (its `agent`, `host`, `instance`), if it says."""
    try:
        d = json.loads(stored) if isinstance(stored, str | bytes) else None
    except ValueError:
        return None
    return d if isinstance(d, dict) else None


class WrongType(Exception):
    """Keys a round writes hold another type than the one written there (created by someone
    else): nothing of the round was written. `keys`: key -> the type expected."""

    def __init__(self, job: str, wrong: dict[str, str]) -> None:
        super().__init__(f"{len(wrong)} key(s) of job {job[:80]!r} of the wrong type: {sorted(wrong)[:5]}")
        self.keys = wrong


# The type each writing command needs its key to be (commands absent here take any).
_KEY_TYPES = {
    **dict.fromkeys(("HSET", "HINCRBY", "HINCRBYFLOAT", "HDEL", "HMSET", "HSETNX"), "hash"),
    **dict.fromkeys(("ZADD", "ZREM", "ZREMRANGEBYSCORE", "ZINCRBY"), "zset"),
    **dict.fromkeys(("SADD", "SREM"), "set"),
    **dict.fromkeys(("SET", "INCR", "INCRBY", "INCRBYFLOAT", "GET"), "string"),
    **dict.fromkeys(("XADD", "XTRIM"), "stream"),
}

# Keys and types checked (the watermark first), then the wrong-typed ones returned after the
# watermark's value: one round trip, in place of the GET a commit did before.
_CHECK_TYPES = """
local wm = false
if redis.call('TYPE', KEYS[1]).ok == 'string' then wm = redis.call('GET', KEYS[1]) end
local out = {wm}
for i = 1, #KEYS do
  local t = redis.call('TYPE', KEYS[i]).ok
  if t ~= 'none' and t ~= ARGV[i] then table.insert(out, KEYS[i]) end
end
return out
"""


class _Recorded:
    """A round's writes queued once: each call goes to a pipeline that is never sent (which says
    the Redis command it makes, so the keys and their types are known before the transaction)
    and is kept to be replayed on the transaction."""

    def __init__(self, client: RedisClient) -> None:
        self.scratch = client.pipeline(transaction=False)
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.scratch, name)
        if not callable(method):
            return method

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args, kwargs))
            return method(*args, **kwargs)

        return call

    def written_types(self) -> dict[str, str]:
        """The keys the round writes and the type each must have."""
        out: dict[str, str] = {}
        stack: list[Any] = getattr(self.scratch, "command_stack")  # noqa: B009 - redis-py's, untyped
        for c in stack:
            args = c.args if hasattr(c, "args") else c[0]  # a cluster's pipeline keeps objects
            name = str(args[0]).upper()
            if name == "EVAL" and args[1] == ROLLUP_ADD:
                out.update(zip(args[3 : 3 + int(args[2])], ("hash", "zset", "zset"), strict=True))
            elif name in _KEY_TYPES:
                out.setdefault(str(args[1]), _KEY_TYPES[name])
        self.scratch.reset()
        return out

    def replay(self, pipe: Pipeline) -> None:
        for name, args, kwargs in self.calls:
            getattr(pipe, name)(*args, **kwargs)


def agent_keys(prefix: str, job: str, agent: str, host: str) -> dict[str, str]:
    """The keys of a job one agent writes whatever the round (buckets aside: those a round names
    are checked with its commit), and their types."""
    return {
        keys.watermark_key(prefix, job, agent): "string",
        keys.fold_key(prefix, job, agent): "string",
        keys.fold_key(prefix, job, agent, old=True): "string",
        keys.readers_key(prefix, job): "hash",
        keys.live_key(prefix, job, host): "hash",
        keys.samples_key(prefix, job, host): "stream",
        keys.total_key(prefix, job): "hash",
        keys.figures_key(prefix, job): "hash",
        keys.steps_key(prefix, job): "zset",
        keys.voids_key(prefix, job): "zset",
        keys.rollup_key(prefix, job): "zset",
        keys.rollup_state_key(prefix, job): "hash",
        keys.rbidx_key(prefix, job, agent): "hash",
        keys.incidents_key(prefix, job, agent): "hash",
        keys.incident_index_key(prefix, job): "set",
        **{keys.index_key(prefix, job, res): "zset" for res in RESOLUTIONS},
    }


def wrong_types(client: RedisClient, expected: dict[str, str]) -> dict[str, str]:
    """Those of `expected` (key -> type) that exist with another type (one pipeline)."""
    pipe = client.pipeline(transaction=False)
    for k in expected:
        pipe.type(k)
    got = pipe.execute()
    return {k: t for (k, t), have in zip(expected.items(), got, strict=True) if have not in ("none", t)}


def set_aside(
    client: RedisClient, wrong: dict[str, str], prefix: str | None = None, job: str | None = None
) -> list[str]:
    """Move keys of the wrong type out of the way (to `<key>:wrongtype`, the same slot, kept for
    a look), so the writer's next round writes them afresh. These are keys only the agents
    write: a value of another type there was never the ledger's. Returns the keys moved.

    The rollup is a cache of the buckets whose state says it is whole: with either of its two
    keys moved, the other would make a later round's rollup (its records started afresh) look
    whole. So the job's rollup is dropped (`prefix`, `job` given): readers sum the buckets until
    the API's next start rebuilds it."""
    import redis

    moved = []
    for k in wrong:
        try:
            client.rename(k, f"{k}:wrongtype")
            moved.append(k)
        except redis.ResponseError:  # gone meanwhile
            continue
    if (
        prefix is not None
        and job is not None
        and {keys.rollup_key(prefix, job), keys.rollup_state_key(prefix, job)} & set(wrong)
    ):
        drop_rollup(client, prefix, job)
    return moved


def commit(
    client: RedisClient,
    prefix: str,
    job: str,
    agent: str,
    expected: str | None,
    wm: dict[str, Any],
    queue: Any,
) -> str:
    """Write one round of a job exactly once: `queue(pipe)` and the new watermark in one
    MULTI/EXEC that runs only if the watermark is still `expected` (the raw JSON this agent read
    or wrote last; None: absent). Returns the new raw watermark; raises Conflict otherwise, and
    WrongType (nothing written) when a key the round writes holds another type: Redis would run
    the rest of the transaction without that command, a round half written."""
    import redis

    k = keys.watermark_key(prefix, job, agent)
    raw = json.dumps(wm)
    round_ = _Recorded(client)
    queue(round_)
    types = {key: t for key, t in round_.written_types().items() if key != k}
    with client.pipeline(transaction=True) as pipe:
        try:
            pipe.watch(k)
            got = pipe.execute_command(
                "EVAL", _CHECK_TYPES, 1 + len(types), k, *types, "string", *types.values()
            )
            wrong = {str(x): ({k: "string"} | types)[str(x)] for x in got[1:]}
            if wrong:
                raise WrongType(job, wrong)
            if got[0] != expected:
                raise Conflict(job, got[0])
            pipe.multi()
            round_.replay(pipe)
            pipe.set(k, raw)
            pipe.execute()
        except redis.WatchError:
            # redis-py answers a connection lost while watching with WatchError too: the EXEC may
            # have applied and only its reply been lost. The watermark tells (`raw` is unique: it
            # holds this process's id and the time): if it is ours, the whole round is written.
            stored = client.get(k)
            if (stored.decode() if isinstance(stored, bytes) else stored) == raw:
                return raw
            raise Conflict(job, stored) from None
    return raw


def queue_delta(
    pipe: Pipeline,
    prefix: str,
    job: str,
    agent: str,
    delta: Any,
    version: Version,
    steps: list[Any],
    after_ms: int,
    figures: dict[str, Any] | None = None,
) -> None:
    """The writes of one round's `live.LedgerDelta` (inside the caller's MULTI); `figures`, the
    job-level figures to SET, default to the delta's own."""
    queue_amounts(pipe, prefix, job, delta.by_bucket, version)
    if delta.moved.any():
        b = {delta.correction_bucket: delta.moved}
        queue_amounts(pipe, prefix, job, b, version, voided=True)
        queue_amounts(pipe, prefix, job, {delta.correction_bucket: delta.rolled}, version)
    rbidx = keys.rbidx_key(prefix, job, agent)
    if delta.index_new:
        pipe.hset(rbidx, mapping={str(k): json.dumps(v) for k, v in delta.index_new.items()})
    drops = sorted(delta.index_drops)
    for i in range(0, len(drops), 10_000):  # entries no resume reads again (pruned)
        pipe.hdel(rbidx, *map(str, drops[i : i + 10_000]))
    queue_incidents(pipe, prefix, job, agent, delta.incidents.values())
    figures = delta.figures if figures is None else figures
    pipe.hset(keys.figures_key(prefix, job), mapping={k: v for k, v in figures.items() if v is not None})
    members = getattr(delta, "step_members", None)  # a folded timeline's (incremental agent)
    if members is None:
        queue_steps(pipe, prefix, job, steps, after_ms, delta.state.booked_until, delta.voids)
    else:
        for name, m in zip(("steps", "voids"), members, strict=True):
            if m:
                pipe.zadd(keys.ledger_key(prefix, job, name), m)


def attribution_fields() -> list[str]:
    """Every figures field an attribution may hold (`attribution.FIELD_NAMES`: each key and
    its source), in the order `Attribution.from_values` takes their values."""
    return [f"{ATTR}{k}" for k in FIELD_NAMES]


def queue_attribution(pipe: Pipeline, prefix: str, job: str, attr: Attribution) -> None:
    """The job's attribution into its figures hash (inside the caller's MULTI): fields it no longer
    has are removed, so a changed policy leaves no stale owner behind."""
    k = keys.figures_key(prefix, job)
    pipe.hdel(k, *attribution_fields())
    fields = {f"{ATTR}{f}": v for f, v in attr.to_fields().items()}
    if fields:
        pipe.hset(k, mapping=fields)


def attribution_of(figures: dict[Any, Any]) -> Attribution:
    """A job's attribution back from its figures hash (readers)."""
    out = {}
    for k, v in figures.items():
        name = k.decode() if isinstance(k, bytes) else str(k)
        if name.startswith(ATTR):
            out[name[len(ATTR) :]] = v
    return Attribution.from_fields(out)


def queue_position(
    pipe: Pipeline, prefix: str, job: str, reader: str, stream_id: str, now: float | None = None, **extra: Any
) -> None:
    """Register how far `reader` needs the job's stream kept (from `stream_id` on); `ts` (now)
    says the reader is alive."""
    import time

    ts = time.time() if now is None else now
    pos = {"id": stream_id, "ts": round(ts, 3), **extra}
    pipe.hset(keys.readers_key(prefix, job), reader, json.dumps(pos))


def _stream_id(x: str) -> tuple[int, int]:
    a, _, b = x.partition("-")
    return int(a), int(b or 0)


def trim_stream(
    client: RedisClient, prefix: str, job: str, now: float, stale_s: float, ranks: set[int] | None = None
) -> int:
    """Trim the job's event stream below the oldest position of its fresh readers (XTRIM MINID;
    idempotent). A reader not heard of for `stale_s` no longer counts (and is forgotten); with no
    fresh reader nothing is trimmed, nor while a rank of `ranks` (the job's registered ones) is
    not in the `ranks` of some fresh agent's position (its agent has not stored a fold yet: it
    still needs the whole stream). Returns the entries removed; -1: waiting for an agent."""
    positions = []
    covered: set[int] = set()
    stale = []
    for reader, raw in client.hgetall(keys.readers_key(prefix, job)).items():
        try:
            pos = json.loads(raw)
            sid, ts = _stream_id(str(pos["id"])), float(pos["ts"])
        except (ValueError, KeyError, TypeError):
            stale.append(reader)  # not a position: never pins the stream
            continue
        if now - ts > stale_s:
            stale.append(reader)
        else:
            positions.append(sid)
            r = pos.get("ranks")
            if isinstance(r, list):
                covered.update(x for x in r if isinstance(x, int))
    if stale:
        client.hdel(keys.readers_key(prefix, job), *stale)
    if ranks and not ranks <= covered:
        return -1
    if not positions:
        return 0
    lo = min(positions)
    if lo <= (0, 0):
        return 0
    return trim_keeping(client, prefix, job, f"{lo[0]}-{lo[1]}")


# The entry types a replay needs whatever their age: kept apart when the stream is trimmed.
KEPT_TYPES = ("register", "run", "meta", "preflight")
TRIM_PAGE = 1000  # entries a script call looks at: Redis is blocked one page at a time
MAX_KEPT_FIELDS = 256  # an entry with more fields is not copied (no protocol entry has that many)
MAX_KEPT = 100_000  # the kept stream's length bound: a trainer posting meta in a loop cannot grow it

# Move the kept types of one page of the entries below the trim point to the kept stream (under
# their own ids, so a second agent doing the same adds nothing), then trim that page. Returns
# {entries trimmed, entries copied, 1 when the trim point was reached}.
_TRIM_KEEPING = """
local function id_gt(x, y)
  local xa, xb = string.match(x, '^(%d+)-(%d+)$')
  local ya, yb = string.match(y, '^(%d+)-(%d+)$')
  xa, xb, ya, yb = tonumber(xa), tonumber(xb), tonumber(ya), tonumber(yb)
  return xa > ya or (xa == ya and xb > yb)
end
local page = tonumber(ARGV[2])
local keep = {}
for i = 5, #ARGV do keep[ARGV[i]] = true end
local entries = redis.call('XRANGE', KEYS[1], '-', '(' .. ARGV[1], 'COUNT', page)
local top = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
local last = '0-0'
if top[1] then last = top[1][1] end
local copied = 0
for _, e in ipairs(entries) do
  local id, f = e[1], e[2]
  if #f <= tonumber(ARGV[3]) then
    for i = 1, #f - 1, 2 do
      if f[i] == 'type' then
        if keep[f[i + 1]] and id_gt(id, last) then
          redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], id, unpack(f))
          copied = copied + 1
        end
        break
      end
    end
  end
end
local done = #entries < page
local upto = ARGV[1]
if not done then upto = entries[#entries][1] end
local trimmed = 0
if #entries > 0 then trimmed = redis.call('XTRIM', KEYS[1], 'MINID', upto) end
return {trimmed, copied, done and 1 or 0}
"""


def trim_keeping(client: RedisClient, prefix: str, job: str, minid: str) -> int:
    """`XTRIM <stream> MINID <minid>`, moving the entries of `KEPT_TYPES` below it to the job's
    kept stream first, a page at a time (each page one script: atomic, idempotent). Returns the
    entries removed from the stream."""
    from costexporter.store import redisconn

    run = redisconn.script(client, _TRIM_KEEPING)
    stream, kept = keys.stream_key(prefix, job), keys.kept_key(prefix, job)
    total = 0
    while True:
        trimmed, _copied, done = run(
            keys=[stream, kept], args=[minid, TRIM_PAGE, MAX_KEPT_FIELDS, MAX_KEPT, *KEPT_TYPES]
        )
        total += int(trimmed)
        if int(done):
            return total


def ensure_epoch(client: RedisClient, prefix: str, candidate: str) -> str:
    """This Redis's epoch marker: `candidate` if none was set, else the one there."""
    client.set(keys.epoch_key(prefix), candidate, nx=True)
    return client.get(keys.epoch_key(prefix)) or candidate


UNKNOWN_BEFORE = "unknown_before:"  # a figures field: Redis restarted empty under this agent


def unknown_field(agent: str) -> str:
    """The figures field in which `agent` says from when (Unix ms) the job's ledger is whole:
    Redis restarted empty while it booked the job, and what was booked before went with it."""
    return f"{UNKNOWN_BEFORE}{agent}"


def unknown_before(figures: dict[str, str]) -> int | None:
    """From when (Unix ms) a job's ledger is whole, as its agents said it (the latest of
    theirs); None where none said so. A field that is not a time is skipped."""
    out = None
    for k, v in figures.items():
        if k.startswith(UNKNOWN_BEFORE):
            try:
                t = int(v)
            except (TypeError, ValueError):
                continue
            if 0 < t < 2**53:
                out = t if out is None else max(out, t)
    return out


SLOW = "slow:"  # a figures field: the slow ranks an agent priced on its GPUs (`slow_field`)


def slow_field(agent: str) -> str:
    """The figures field in which `agent` says, per slow rank, the GPU-seconds it held this
    agent's GPUs longer and the minutes it led (`core/straggler.py`), over the job's life."""
    return f"{SLOW}{agent}"


def encode_slow(gpu_s: dict[int, float], blocks: dict[int, int]) -> str:
    """`slow_field`'s value: {rank: [GPU-seconds, minutes]}."""
    per = {str(r): [round(x, 3), blocks.get(r, 0)] for r, x in gpu_s.items()}
    return json.dumps(per, separators=(",", ":"))


def slow_ranks(figures: dict[str, str]) -> dict[int, tuple[float, int]]:
    """Per slow rank, the GPU-seconds its agents priced (summed over their GPUs) and the minutes
    it led (the most any agent counted: each judged the same minutes); a field that is not one
    this release wrote is skipped."""
    out: dict[int, tuple[float, int]] = {}
    for k, v in figures.items():
        if not k.startswith(SLOW):
            continue
        try:
            per = {int(r): (float(x[0]), int(x[1])) for r, x in json.loads(v).items()}
        except (TypeError, ValueError, KeyError, IndexError, AttributeError):
            continue
        for r, (gpu_s, blocks) in per.items():
            if r >= 0 and 0 <= gpu_s < 1e12 and 0 <= blocks < 2**31:
                had_s, had_b = out.get(r, (0.0, 0))
                out[r] = (had_s + gpu_s, max(had_b, blocks))
    return out


def note_field(reason: str, about: str = "") -> str:
    """The figures field of a note: `note:<reason>` or `note:<reason>:<about>`."""
    return f"{NOTE}{reason}:{about}" if about else f"{NOTE}{reason}"


def note(client: RedisClient, prefix: str, job: str, reason: str, about: str, text: str) -> None:
    """Say something about a job where its readers look (the API's warnings): a field of its
    figures hash, JSON of the text and when it was said (one per reason and other party)."""
    value = json.dumps({"text": text, "ts": round(time.time(), 3)}, separators=(",", ":"))
    client.hset(keys.figures_key(prefix, job), note_field(reason, about), value)


def notes_of(figures: dict[str, str]) -> list[str]:
    """The notes in a job's figures hash, as their texts, oldest first; a field that is not one
    this release wrote is skipped."""
    out: list[tuple[float, str]] = []
    for k, v in figures.items():
        if not k.startswith(NOTE):
            continue
        try:
            x = json.loads(v)
        except (TypeError, ValueError):
            continue
        if isinstance(x, dict) and isinstance(x.get("text"), str) and isinstance(x.get("ts"), int | float):
            out.append((float(x["ts"]), x["text"]))
    return [t for _, t in sorted(out)]
