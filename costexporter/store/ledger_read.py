"""Reading the ledger for the API: window totals from the fewest buckets, series, incidents.

All amounts are the ledger's integers; money leaves here as `Decimal` (micro-units / 10^6), so the
API can print it with a fixed number of places and never a binary float.

Stored data is not trusted: a value that does not parse (a budget of "5k", a registration time of
null, a bucket field that is not a number, a key of the wrong type) is skipped and named in the
`Warnings` the caller passes, so one bad record never fails a request for everyone.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

import numpy as np
import orjson
import redis
import redis.cluster

from costexporter.core import causes
from costexporter.core.attribution import GRANTABLE, Attribution
from costexporter.core.buckets import RESOLUTIONS, UNITS, decompose
from costexporter.core.cost import MS_PER_HOUR
from costexporter.core.events import bounded_number
from costexporter.core.model import CATEGORIES, JOB_CATEGORY_NAMES, VALID_NAMES, WASTED_NAMES
from costexporter.store import keys, ledger, protocol, untrusted
from costexporter.store.client import Pipeline, RedisClient
from costexporter.store.coldledger import ColdLedger
from costexporter.store.jobindex import JobIndex

# The category sets by name (`core/model.py`'s), as the API's readers use them.
WASTED, VALID, JOB_CATS = WASTED_NAMES, VALID_NAMES, JOB_CATEGORY_NAMES


LATEST_TS = 32_503_680_000  # 3000-01-01: a stored time beyond it (or before 1970) is not a time


class Warnings(list[str]):
    """What a request skipped in the stored data, one line per job and problem (deduplicated)."""

    def add(self, job: str, what: str) -> None:
        line = f"{job}: {what}"
        if line not in self and len(self) < 100:
            self.append(line)


def timestamp(v: object) -> float | None:
    """A stored Unix time, or None if it is not a finite number of seconds within 1970..3000."""
    return bounded_number(v, 0, LATEST_TS)


INT64 = 1 << 63  # what HINCRBY can hold: a larger amount was never the ledger's (HSET by hand)


def number(v: object) -> int | None:
    """A stored integer (counts, amounts) that fits Redis's 64-bit integers, or None (a
    40-digit amount would overflow every sum and format it enters)."""
    if isinstance(v, bool):
        return None
    try:
        n = int(v)  # type: ignore[call-overload]
    except (TypeError, ValueError, OverflowError):
        try:
            f = float(v)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return None
        if not (math.isfinite(f) and f == int(f)):
            return None
        n = int(f)
    return n if -INT64 <= n < INT64 else None


def decimal(v: object) -> Decimal | None:
    """A stored finite decimal amount (a budget), or None."""
    try:
        d = Decimal(str(v).strip())
    except (InvalidOperation, ValueError):
        return None
    return d if d.is_finite() and abs(d) < Decimal(10) ** 15 else None


# Ledger field -> (unit index, category, sign): parsed once, not per field per bucket.
_FIELDS = {
    ledger.amount_field(c, u, voided=voided): (i, c, -1 if voided else 1)
    for voided in (False, True)
    for c in CATEGORIES
    for i, u in enumerate(UNITS)
}


@dataclass
class Amounts:
    """Net amounts per category (after rollback corrections) and the price versions seen."""

    ms: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    mj: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    ucost: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    price_versions: set[str] = field(default_factory=set)

    def add_hash(self, h: dict[str, Any]) -> int:
        """Add one amounts hash; returns how many of its amounts were not integers (skipped)."""
        targets = (self.ms, self.mj, self.ucost)
        bad = 0
        for f, v in h.items():
            parsed = _FIELDS.get(f)
            if parsed is not None:
                n = number(v)
                if n is None:
                    bad += 1
                    continue
                unit, cat, sign = parsed
                targets[unit][cat] += sign * n
            elif f == "price_version":
                self.price_versions.add(str(v))
        return bad

    def cost(self, cat: str) -> Decimal:
        return Decimal(self.ucost[cat]) / Decimal(10**6)

    def total_cost(self, cats: list[str] = JOB_CATS) -> Decimal:
        return sum((self.cost(c) for c in cats), Decimal(0))

    def hours(self, cats: list[str]) -> float:
        return sum(self.ms[c] for c in cats) / MS_PER_HOUR


@dataclass
class Steps:
    completed: int = 0
    voided: int = 0
    # The valid steps' tokens less the voided ones': below 0 where a window holds more voided
    # tokens than valid ones (shown as 0; kept, so that parts of a window add up exactly).
    net_tokens: int = 0

    @property
    def tokens(self) -> int:
        return max(self.net_tokens, 0)

    @property
    def valid(self) -> int:
        return self.completed - self.voided


# Sums a job's bucket hashes inside Redis: one short reply per job instead of every bucket.
# Lua numbers are doubles: integers stay exact up to 2^53 (9e9 currency units in micro-units).
SUM_BUCKETS = r"""
-- A key of another type or a value that is no finite number is skipped and counted (`_bad`).
local acc, order, versions, seen, bad = {}, {}, {}, {}, 0
for i = 1, #KEYS do
  local t = redis.call('TYPE', KEYS[i])['ok']
  if t == 'hash' then
    local h = redis.call('HGETALL', KEYS[i])
    for j = 1, #h, 2 do
      local f, v = h[j], h[j + 1]
      if f == 'price_version' then
        if not seen[v] then seen[v] = true; versions[#versions + 1] = v end
      else
        local n = tonumber(v)
        if n == nil or n ~= n or n == math.huge or n == -math.huge then
          bad = bad + 1
        elseif acc[f] == nil then acc[f] = n; order[#order + 1] = f else acc[f] = acc[f] + n end
      end
    end
  elseif t ~= 'none' then
    bad = bad + 1
  end
end
local out = {}
for _, f in ipairs(order) do out[#out + 1] = f; out[#out + 1] = string.format('%.0f', acc[f]) end
if #versions > 0 then out[#out + 1] = 'price_version'; out[#out + 1] = table.concat(versions, '\n') end
if bad > 0 then out[#out + 1] = '_bad'; out[#out + 1] = tostring(bad) end
return out
"""

# Steps and voids of a window from the job's sorted sets (KEYS: steps, voids; ARGV: start, end):
# counts, and the cumulative tokens at both ends (members are "<record>:<cumulative tokens>").
STEPS_WINDOW = r"""
local out = {}
for i = 1, 2 do
  local n = redis.call('ZCOUNT', KEYS[i], ARGV[1], '(' .. ARGV[2])
  local a = redis.call('ZREVRANGEBYSCORE', KEYS[i], '(' .. ARGV[2], '-inf', 'LIMIT', 0, 1)
  local b = redis.call('ZREVRANGEBYSCORE', KEYS[i], '(' .. ARGV[1], '-inf', 'LIMIT', 0, 1)
  out[#out + 1] = n
  out[#out + 1] = a[1] or ''
  out[#out + 1] = b[1] or ''
end
return out
"""


# Windows of many jobs from their rollups (ledger.ROLLUP_ADD) and step sets, in one call.
# KEYS: per job its rollup state, rollup records, steps, voids and (with meta) meta.
# ARGV: the number of windows, '1' to read meta, '1' to read tokens, then each window's start
# and end. Reply: one flat list, per job the same number of values (`_per_job`): meta (a flat
# HGETALL; false: not a hash; 0: not read), the rollup's state ('1' usable), its price version,
# then per window: the record of the last bucket before the end ('' if none; false if the rollup
# is unusable), that before the start, and the steps: STEPS_WINDOW's six values with tokens, else
# the two counts (the first false if the sets are not sorted sets). Records are returned as
# stored: the API subtracts them (exact integers, and no JSON decoding inside Redis). Flat, with
# no table per job or window, and a window's start record taken from the window before when they
# share the bound, and not read when there is no record before its end (a job that began after
# the window): most of a call's time is Lua's, not the commands'.
ROLLUP_WINDOWS = (
    "local ATTR = {"
    + ", ".join(f"'{f}'" for f in ledger.attribution_fields())
    + r"""}
local nwin, with_meta, with_tokens = tonumber(ARGV[1]), ARGV[2] == '1', ARGV[3] == '1'
local per = with_meta and 6 or 4
local w, width = with_tokens and 3 or 1, with_tokens and 6 or 2
local S, E, oS, oE = {}, {}, {}, {}  -- each window's bounds, and as exclusive ZRANGE bounds
for i = 1, nwin do
  S[i], E[i] = ARGV[2 + 2 * i], ARGV[3 + 2 * i]
  oS[i], oE[i] = '(' .. S[i], '(' .. E[i]
end
-- redis.pcall, not pcall: a key of the wrong type answers an error reply (a table with `err`)
local pc = redis.pcall
local out, n = {}, 0
for b = 0, #KEYS - per, per do
  local cum, ks, kv = KEYS[b + 2], KEYS[b + 3], KEYS[b + 4]
  local m = 0
  if with_meta then
    local mp = pc('HGETALL', KEYS[b + 5])
    if mp.err ~= nil then mp = false end
    local got, at = pc('HMGET', KEYS[b + 6], unpack(ATTR)), {}
    if got.err == nil then  -- only the fields set, as (position, value): most are not
      for i = 1, #ATTR do
        if got[i] then at[#at + 1] = i; at[#at + 1] = got[i] end
      end
    end
    m = {mp, at}
  end
  local h = pc('HMGET', KEYS[b + 1], 'v', 'pv')
  local usable = h.err == nil and h[1] == '1' and h[2] ~= '\n'
  out[n + 1] = m
  if usable then out[n + 2], out[n + 3] = '1', h[2] or '' else out[n + 2], out[n + 3] = '', '' end
  n = n + 3
  local voids = pc('EXISTS', kv) == 1  -- most jobs never voided a step
  local pe, pa = nil, nil  -- the window before's end and its record
  for i = 1, nwin do
    local re, rs = false, false
    if usable then
      local a = pc('ZREVRANGEBYSCORE', cum, oE[i], '-inf', 'LIMIT', 0, 1)
      local r0 = a  -- no record before the end (or an error): none before the start either
      if S[i] == pe then r0 = pa
      elseif a[1] ~= nil then r0 = pc('ZREVRANGEBYSCORE', cum, oS[i], '-inf', 'LIMIT', 0, 1) end
      pe, pa = E[i], a
      if a.err == nil and r0.err == nil then re, rs = a[1] or '', r0[1] or '' end
    end
    out[n + 1], out[n + 2] = re, rs
    n = n + 2
    if with_tokens then
      out[n + 1], out[n + 2], out[n + 3], out[n + 4], out[n + 5], out[n + 6] = 0, '', '', 0, '', ''
    else
      out[n + 1], out[n + 2] = 0, 0
    end
    for v = 0, (voids and 1 or 0) do
      local k = v == 0 and ks or kv
      local c = pc('ZCOUNT', k, S[i], oE[i])
      if type(c) == 'table' then out[n + 1] = false; break end
      out[n + w * v + 1] = c
      if with_tokens then
        out[n + 3 * v + 2] = pc('ZREVRANGEBYSCORE', k, oE[i], '-inf', 'LIMIT', 0, 1)[1] or ''
        out[n + 3 * v + 3] = pc('ZREVRANGEBYSCORE', k, oS[i], '-inf', 'LIMIT', 0, 1)[1] or ''
      end
    end
    n = n + width
  end
end
return out
"""
)


def key_templates(prefix: str, builders: Sequence[Callable[[str, str], str]]) -> list[tuple[str, str]]:
    """Each key builder's text before and after the job's name: a key is then one concatenation
    (50,000 keys of a 10,000-job read made without 150,000 calls). Equal to the builders' keys
    for every job name (tests/test_api_fast_paths.py)."""
    out = []
    for k in builders:
        head, mark, tail = k(prefix, _MARK).partition(_MARK)
        if not mark or _MARK in tail:
            raise ValueError(f"key builder {k.__name__} does not hold the job's name once")
        out.append((head, tail))
    return out


_MARK = "\x00job\x00"


def _per_job(windows: int, tokens: bool) -> int:
    """How many values ROLLUP_WINDOWS replies per job."""
    return 3 + (8 if tokens else 4) * windows


# Each job's team as the agents attributed it (KEYS: figures hashes): false where there is none.
TEAMS = r"""
local out = {}
for i, k in ipairs(KEYS) do
  local t = redis.pcall('HGET', k, 'attr:team')
  if type(t) == 'table' then t = false end
  out[i] = t
end
return out
"""
# A job's series from its rollup (KEYS: rollup state, records; ARGV: first bound, step, count):
# {state '1' usable, then the record of the last bucket before each of the count + 1 bounds ('' if
# none; '=' if the same as the bound before: a sparse series sends each record once)}; {0} if the
# rollup is absent or unusable.
SERIES = r"""
local h = redis.pcall('HMGET', KEYS[1], 'v', 'pv')
if type(h) ~= 'table' or h.err or h[1] ~= '1' then return {0} end
local out, prev = {'1'}, nil
local t, step = tonumber(ARGV[1]), tonumber(ARGV[2])
for i = 0, tonumber(ARGV[3]) do
  local bound = string.format('(%.0f', t + i * step)
  local r = redis.pcall('ZREVRANGEBYSCORE', KEYS[2], bound, '-inf', 'LIMIT', 0, 1)
  if r.err then return {0} end
  local rec = r[1] or ''
  if i > 0 and rec == prev then out[#out + 1] = '=' else out[#out + 1] = rec end
  prev = rec
end
return out
"""
BATCH = 200  # jobs per script call: one call stays ~2 ms of Redis time
CHUNK = 2000  # jobs per read that `LedgerStore.table_chunks` overlaps with the work on the last
WIDTH = len(ledger.PACKED) + 1  # a record: the bucket start, then the amounts
ZEROS = "[" + ",".join(["-1"] + ["0"] * (WIDTH - 1)) + "]"  # before the first bucket


class WindowTable:
    """Many jobs' net amounts over one window as one integer matrix (a row per job, columns
    `ledger.PACKED`), with their price versions and steps: allocation sums it by column."""

    def __init__(
        self, jobs: list[str], net: np.ndarray, versions: list[Any], steps: dict[str, Steps]
    ) -> None:
        self.jobs = jobs
        self.net = net
        self.versions = versions  # per job: a set of price versions
        self.steps = steps

    def amounts(self, j: str) -> Amounts:
        i = self.jobs.index(j) if len(self.jobs) > 1 else 0
        return _packed(self.net[i].tolist(), self.versions[i])


def _vector(a: Amounts) -> list[int]:
    """Amounts as a row of the matrix (the order of `ledger.PACKED`)."""
    return [x for c in CATEGORIES for x in (a.ms[c], a.mj[c], a.ucost[c])]


def _records(raw: list[str]) -> np.ndarray | None:
    """Records (JSON arrays of WIDTH integers) as a matrix, parsed in one go (numpy's text
    parser: a third of the time of JSON); None if any is not one (the caller then checks them
    one by one)."""
    if not raw:
        return np.zeros((0, WIDTH), np.int64)
    if any(r.count(",") != WIDTH - 1 for r in raw):
        return None
    try:
        m = np.fromstring(",".join(raw).replace("[", "").replace("]", ""), dtype=np.int64, sep=",")
    except ValueError:
        return None
    if m.size != len(raw) * WIDTH or np.abs(m).max() >= ledger.EXACT_LIMIT:  # int64 clamps
        return None
    return m.reshape(len(raw), WIDTH)


def _record(raw: str) -> list[int] | None:
    try:
        v = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    ok = isinstance(v, list) and len(v) == WIDTH
    ok = ok and all(type(x) is int and abs(x) < ledger.EXACT_LIMIT for x in v)
    return v if ok else None


def _metas(jobs: list[str], raw: list[Any], warn: Warnings) -> dict[str, dict[str, Any]]:
    """Each job's meta from ROLLUP_WINDOWS's replies (per job its first value: the meta hash's
    pairs; None: not a hash)."""
    metas: dict[str, dict[str, Any]] = {}
    for j, m in zip(jobs, raw, strict=True):
        mp, at = m if isinstance(m, list) and len(m) == 2 else (m or [], [])
        if mp is None or mp is False:
            warn.add(j, "meta is not a hash: ignored")
            mp = []
        pairs = iter(mp)  # HGETALL's pairs: field, value, field, value...
        metas[j] = _job_meta(dict(zip(pairs, pairs, strict=True)), _placed(at))
    return metas


_NO_ATTRIBUTION = (None,) * len(ledger.attribution_fields())


def _placed(at: object) -> Attribution:
    """An attribution from ROLLUP_WINDOWS's (position from 1, value) pairs of the fields set."""
    if not isinstance(at, list) or not at:
        return Attribution.from_values(_NO_ATTRIBUTION)
    values = list(_NO_ATTRIBUTION)
    try:
        for i in range(0, len(at) - 1, 2):
            values[at[i] - 1] = at[i + 1]
    except (TypeError, IndexError):
        return Attribution.from_values(_NO_ATTRIBUTION)
    return Attribution.from_values(values)


def _attribution(values: object) -> Attribution:
    """An attribution from an HMGET of `ledger.attribution_fields()` (anything else: none)."""
    if not isinstance(values, list) or len(values) != len(_NO_ATTRIBUTION):
        return Attribution.from_values(_NO_ATTRIBUTION)
    return Attribution.from_values(values)


class JobMeta(dict[str, Any]):
    """A job's meta as readers show it: its data keys, with the owner and place keys the agents'
    attribution (`Attribution.overlay`; a trainer's value for them is dropped), and the
    attribution itself and the meta keys it ignored."""

    attribution: Attribution
    ignored: tuple[str, ...]


def job_meta(meta: dict[str, Any], attr_fields: dict[str, Any]) -> JobMeta:
    """`JobMeta` from a meta hash and the figures' attribution fields (`ledger.ATTR`...)."""
    return _job_meta(meta, ledger.attribution_of({k: v for k, v in attr_fields.items() if v is not None}))


def _job_meta(meta: dict[str, Any], attr: Attribution) -> JobMeta:
    out = JobMeta(attr.overlay(meta))
    out.attribution = attr
    given = [k for k in GRANTABLE if k in meta]  # most jobs' meta sets none of them
    out.ignored = tuple(k for k in given if not (attr.source(k) or "").startswith("meta"))
    return out


def _rollup_net(
    usable: list[Any], pvs: list[Any], ends: list[Any], starts: list[Any]
) -> tuple[np.ndarray, list[set[str] | None], list[int]]:
    """One window's net amounts from the rollup records (per job: whether its rollup is usable,
    its price version, the record at the window's end and that at its start) of each job whose
    rollup is usable; returns the amounts, the price versions (None where not read) and the jobs
    (indices) to read exactly instead: no usable rollup, or a damaged record."""
    n = len(usable)
    ok = [
        u == "1" and re is not None and rs is not None for u, re, rs in zip(usable, ends, starts, strict=True)
    ]
    if all(ok):
        fast, exact = list(range(n)), []
        e_raw, s_raw = ends, starts
    else:
        fast = [i for i, o in enumerate(ok) if o]
        exact = [i for i, o in enumerate(ok) if not o]
        e_raw, s_raw = [ends[i] for i in fast], [starts[i] for i in fast]
    net = np.zeros((n, WIDTH - 1), np.int64)
    versions: list[set[str] | None] = [None] * n  # per job; the caller sets the exact ones
    e_m, s_m = _records_or_zeros(e_raw), _records_or_zeros(s_raw)
    if e_m is None or s_m is None:  # a damaged record somewhere: check them one by one
        good = [
            (i, a, b)
            for i, a, b in zip(
                fast, (_record(r or ZEROS) for r in e_raw), (_record(r or ZEROS) for r in s_raw), strict=True
            )
        ]
        exact += [i for i, a, b in good if a is None or b is None]
        good = [(i, a, b) for i, a, b in good if a is not None and b is not None]
        fast = [i for i, _, _ in good]
        e_m = np.array([a for _, a, _ in good], np.int64).reshape(len(good), WIDTH)
        s_m = np.array([b for _, _, b in good], np.int64).reshape(len(good), WIDTH)
    net[fast] = e_m[:, 1:] - s_m[:, 1:]
    moved = (e_m[:, 0] != s_m[:, 0]).tolist()  # some bucket lies in the window
    for i, m in zip(fast, moved, strict=True):
        pv = pvs[i]
        versions[i] = {pv} if m and pv else set()
    return net, versions, exact


def _records_or_zeros(raw: list[str]) -> np.ndarray | None:
    """`_records` of records where '' (no bucket before the bound) is the record before the
    first bucket (ZEROS), parsing only the others: a job that began inside the window has no
    record before its start."""
    full = [i for i, r in enumerate(raw) if r]
    if len(full) == len(raw):
        return _records(raw)
    m = np.zeros((len(raw), WIDTH), np.int64)
    m[:, 0] = -1
    if full:
        parsed = _records([raw[i] for i in full])
        if parsed is None:
            return None
        m[full] = parsed
    return m


def _run(pipe: Pipeline) -> list[Any]:
    """Execute a pipeline; a command that failed on the stored data (a key of the wrong type, a
    script error) gives None instead of failing every other result. Outages still raise."""
    return [None if isinstance(x, redis.ResponseError) else x for x in pipe.execute(raise_on_error=False)]


def _json(raw: object) -> object:
    """A stored JSON value, or None when it is not one (or is deeper or larger than any value
    the product writes: a trainer may have written it)."""
    try:
        return untrusted.loads(raw) if isinstance(raw, str | bytes) else None
    except untrusted.UntrustedValue:
        return None


def hot_from(client: RedisClient, prefix: str) -> int:
    """Where the ledger in Redis begins (Unix s); 0: it holds every day. A value that is not a
    whole number of seconds is taken as 0 (every day is then read from Redis, as before any
    expiry): never a window read short."""
    raw = client.get(keys.hot_from_key(prefix))
    try:
        v = int(raw) if raw is not None else 0
    except (TypeError, ValueError):
        return 0
    return v if v > 0 and v % 86_400 == 0 else 0


class LedgerStore:
    """The API's reads. `use_rollups` False: window amounts always summed from the buckets (the
    exact path the rollups are tested against)."""

    def __init__(
        self,
        client: RedisClient,
        prefix: str = protocol.DEFAULT_PREFIX,
        use_rollups: bool = True,
        cold: ColdLedger | None = None,
        others: dict[str, ColdLedger] | None = None,
    ) -> None:
        from costexporter.store import redisconn

        self.r = client
        self.prefix = prefix
        self.use_rollups = use_rollups
        self.cold = cold  # the archive, for what lies before the ledger's start in Redis
        # Other clusters billed here from their sealed days alone: their jobs are named
        # `<cluster>:<job>` (`job_names` with a window), read from the archive only.
        self.others = dict(others or {})
        # EVAL, not EVALSHA, on a cluster's pipelines: a node may never have loaded the script.
        self._sum = redisconn.script(client, SUM_BUCKETS)
        self._steps = redisconn.script(client, STEPS_WINDOW)
        self._windows = redisconn.script(client, ROLLUP_WINDOWS)
        self._teams = redisconn.script(client, TEAMS)
        self._series = redisconn.script(client, SERIES)
        self.batch = 1 if redisconn.is_cluster(client) else BATCH
        # The jobs found by their ranks keys where the jobs index is of the wrong type (kept a
        # minute: a bounded SCAN, as the agents and the watcher do).
        self._index = JobIndex(
            client, prefix, untrusted.Refusals(logging.getLogger("costexporter.api")), (redis.RedisError,)
        )

    def ping(self) -> bool:
        return bool(self.r.ping())

    def jobs(self, warn: Warnings | None = None) -> list[tuple[str, float | None]]:
        """Every job with the time of its newest event (None where that is not a time, or the
        jobs index is of the wrong type: the jobs are then found by their ranks keys)."""
        try:
            listed = self.r.zrange(keys.jobs_key(self.prefix), 0, -1, withscores=True)
        except redis.ResponseError as e:
            if not untrusted.is_wrong_type(e):
                raise
            return [(j, None) for j in self._scanned(warn)]
        out = []
        for j, score in listed:
            t = timestamp(score)
            if t is None and warn is not None:
                warn.add(j, f"newest event time {score!r} is not a time: ignored")
            out.append((j, t))
        return out

    def job_names(self, start: int | None = None, end: int | None = None) -> list[str]:
        """Every job's name (no times: cheaper where they are not shown); with a window, the
        other clusters' jobs sealed with a day in it too (`<cluster>:<job>`)."""
        try:
            names: list[str] = self.r.zrange(keys.jobs_key(self.prefix), 0, -1)
        except redis.ResponseError as e:
            if not untrusted.is_wrong_type(e):
                raise
            names = self._scanned(None)
        if start is not None and end is not None:
            for c, cold in sorted(self.others.items()):
                names = names + [f"{c}:{j}" for j in cold.jobs(start, end) if j != ledger.UNASSIGNED_JOB]
        return names

    def _scanned(self, warn: Warnings | None) -> list[str]:
        """The jobs index is not a sorted set (a trainer wrote it so, on a fresh deployment or
        after Redis restarted empty): every job is found by its ranks key, as the agents and the
        watcher find them (`jobindex.JobIndex`), and the answer says so."""
        if warn is not None:
            warn.add("*", "the jobs index is not a sorted set: jobs found by their registrations instead")
        return self._index.scanned()

    def _exists(self, job: str, score: object) -> bool:
        """Whether a job exists, from its index score (the reply to ZSCORE; None where it failed
        on the index's type: then by its ranks key, or a ledger of its own)."""
        if score is not None:
            return True
        if self._index_wrong_type():
            pipe = self.r.pipeline(transaction=False)
            pipe.exists(keys.ranks_key(self.prefix, job))
            pipe.exists(keys.total_key(self.prefix, job))
            return any(bool(x) for x in _run(pipe))
        return False

    def _index_wrong_type(self) -> bool:
        return bool(self.r.type(keys.jobs_key(self.prefix)) not in ("zset", b"zset", "none", b"none"))

    def job_team(self, job: str) -> tuple[bool, str | None]:
        """Whether the job exists, and its team: one round trip (two where the jobs index is
        not a sorted set)."""
        pipe = self.r.pipeline(transaction=False)
        pipe.zscore(keys.jobs_key(self.prefix), job)
        pipe.hget(keys.figures_key(self.prefix, job), f"{ledger.ATTR}team")
        score, team = _run(pipe)
        return self._exists(job, score), team

    def teams_many(self, jobs: list[str]) -> dict[str, str | None]:
        """Each job's team, for filtering before anything else is read: BATCH jobs a script call,
        one pipeline."""
        pipe = self.r.pipeline(transaction=False)
        for i in range(0, len(jobs), self.batch):
            figs = [keys.figures_key(self.prefix, j) for j in jobs[i : i + self.batch]]
            self._teams(keys=figs, client=pipe)
        teams: list[Any] = []
        for i, got in zip(range(0, len(jobs), self.batch), _run(pipe) if jobs else [], strict=True):
            teams += got if got is not None else [None] * len(jobs[i : i + self.batch])
        return dict(zip(jobs, teams, strict=True))

    def meta_many(self, jobs: list[str], warn: Warnings | None = None) -> dict[str, dict[str, Any]]:
        """Each job's meta as readers show it (`JobMeta`: team, cost center, ... the agents'
        attribution) in one round trip."""
        fields = ledger.attribution_fields()
        pipe = self.r.pipeline(transaction=False)
        for j in jobs:
            pipe.hgetall(keys.meta_key(self.prefix, j))
            pipe.hmget(keys.figures_key(self.prefix, j), fields)
        raw = _run(pipe)
        out: dict[str, dict[str, Any]] = {}
        for i, j in enumerate(jobs):
            meta, attr = raw[2 * i], raw[2 * i + 1]
            if meta is None and warn is not None:
                warn.add(j, "meta is not a hash: ignored")
            out[j] = _job_meta(meta or {}, _attribution(attr))
        return out

    def info_many(self, jobs: list[str], warn: Warnings | None = None) -> dict[str, dict[str, Any]]:
        """meta, figures, status and first registration of many jobs in one round trip."""
        warn = Warnings() if warn is None else warn
        pipe = self.r.pipeline(transaction=False)
        for j in jobs:
            self._queue_info(pipe, j)
        raw = _run(pipe)
        return {j: _info(j, raw[4 * i : 4 * i + 4], warn) for i, j in enumerate(jobs)}

    def job_info(self, job: str, warn: Warnings | None = None) -> dict[str, Any] | None:
        """One job's `info_many` entry, or None if there is no such job: one round trip."""
        warn = Warnings() if warn is None else warn
        pipe = self.r.pipeline(transaction=False)
        pipe.zscore(keys.jobs_key(self.prefix), job)
        self._queue_info(pipe, job)
        score, *raw = _run(pipe)
        return _info(job, raw, warn) if self._exists(job, score) else None

    def _queue_info(self, pipe: Pipeline, j: str) -> None:
        """The 4 reads `_info` parses."""
        pipe.hgetall(keys.meta_key(self.prefix, j))
        pipe.hgetall(keys.figures_key(self.prefix, j))
        pipe.get(keys.status_key(self.prefix, j))
        pipe.hvals(keys.ranks_key(self.prefix, j))

    def first_seen_many(self, jobs: list[str], info: dict[str, dict[str, Any]]) -> dict[str, float | None]:
        """Each job's first start, in one round trip: its oldest register, from the oldest
        entries of its kept stream (registrations moved out when the stream was trimmed), else
        of its event stream; never later than `info`'s `first_seen` (`info_many`'s, from the
        ranks hash, which holds each rank's latest register only: a resume overwrites it)."""
        pipe = self.r.pipeline(transaction=False)
        for j in jobs:
            pipe.xrange(keys.kept_key(self.prefix, j), "-", "+", count=FIRST_ENTRIES)
            pipe.xrange(keys.stream_key(self.prefix, j), "-", "+", count=FIRST_ENTRIES)
        raw = _run(pipe) if jobs else []
        out = {}
        for i, j in enumerate(jobs):
            first = _first_register(raw[2 * i])
            if first is None:
                first = _first_register(raw[2 * i + 1])
            known = [t for t in (first, info[j]["first_seen"]) if t is not None]
            out[j] = min(known) if known else None
        return out

    def amounts_many(
        self, jobs: list[str], start: int, end: int, warn: Warnings | None = None
    ) -> dict[str, Amounts]:
        """Window totals of many jobs (see `tables`)."""
        (t,) = self.tables(jobs, [(start, end)], warn)[1]
        return {j: _packed(t.net[i].tolist(), t.versions[i]) for i, j in enumerate(jobs)}

    def window_many(
        self, jobs: list[str], start: int, end: int, warn: Warnings | None = None
    ) -> tuple[dict[str, Amounts], dict[str, Steps]]:
        """Window totals of many jobs, and the steps completed and voided in the window with the
        tokens of the valid ones (see `tables`)."""
        (t,) = self.tables(jobs, [(start, end)], warn, tokens=True)[1]
        return {j: _packed(t.net[i].tolist(), t.versions[i]) for i, j in enumerate(jobs)}, t.steps

    def spans_of(
        self, job: str, spans: list[tuple[int, int]], warn: Warnings | None = None
    ) -> list[tuple[Amounts, Steps]]:
        """One job's totals and steps in each of `spans`, in one read (see `tables`)."""
        _, tables = self.tables([job], spans, warn)
        return [(_packed(t.net[0].tolist(), t.versions[0]), t.steps.get(job, Steps())) for t in tables]

    def tables(
        self,
        jobs: list[str],
        spans: list[tuple[int, int]],
        warn: Warnings | None = None,
        meta: bool = False,
        tokens: bool = False,
    ) -> tuple[dict[str, dict[str, Any]], list[WindowTable]]:
        """Each job's meta (with `meta`; else {}) and, per window, a `WindowTable` of the jobs'
        amounts and steps (tokens counted only with `tokens`).

        From each job's rollup: two records per window whatever its length, by a script that
        takes up to BATCH jobs a call (one job a call on Redis Cluster, where a script's keys
        share one slot), all calls in one pipeline. Jobs without a usable rollup (not built yet,
        two price versions, sums past 2^53, damaged) are summed from the fewest buckets (weeks,
        days, hours, then 5 minutes): the exact path, which the rollup equals."""
        warn = Warnings() if warn is None else warn
        if not self.use_rollups:
            local, foreign = self._split(jobs)
            metas = self.meta_many(local, warn) if meta and local else {}
            cut, hot = self._hot_spans(spans, warn)
            tables = [self._exact_table(local, start, end, warn) for start, end in hot]
            chunks = [(local, metas, self._with_cold(local, spans, cut, tables))]
            if foreign:
                chunks.append((foreign, *self._foreign_tables(foreign, spans, meta)))
        else:
            chunks = list(self.table_chunks(jobs, spans, warn, meta, tokens))
        if len(chunks) == 1 and chunks[0][0] == jobs:
            return chunks[0][1], chunks[0][2]
        metas = {}
        for _, m, _ in chunks:
            metas.update(m)
        order = {j: i for i, j in enumerate(j for c in chunks for j in c[0])}
        at = [order[j] for j in jobs]  # the chunks' rows in the order asked
        out = []
        for w in range(len(spans)):
            parts = [c[2][w] for c in chunks]
            steps: dict[str, Steps] = {}
            for t in parts:
                steps.update(t.steps)
            versions = [v for t in parts for v in t.versions]
            out.append(
                WindowTable(
                    jobs, np.concatenate([t.net for t in parts])[at], [versions[i] for i in at], steps
                )
            )
        return metas, out

    def table_chunks(
        self,
        jobs: list[str],
        spans: list[tuple[int, int]],
        warn: Warnings,
        meta: bool = False,
        tokens: bool = False,
    ) -> Iterator[tuple[list[str], dict[str, dict[str, Any]], list[WindowTable]]]:
        """`tables` CHUNK jobs at a time, in order: (the chunk's jobs, their meta, their tables).

        Redis runs the scripts of the next chunks (on a thread of their own, which waits on the
        socket) while the caller works on this one, so a request of 10,000 jobs costs about the
        larger of Redis's time and Python's rather than their sum. The warnings reach `warn` in
        the order of one pass over every job (meta, then per window the steps and the exact
        path's), once the last chunk is done. A window that begins before the ledger's start in
        Redis (`hot_from`) is read from the archive up to it."""
        local, foreign = self._split(jobs)
        if local or not foreign:
            cut, hot = self._hot_spans(spans, warn)
            for part, metas, tables in self._table_chunks(local, hot, warn, meta, tokens):
                yield part, metas, self._with_cold(part, spans, cut, tables)
        if foreign:  # other clusters' jobs: one chunk, from the archive
            yield foreign, *self._foreign_tables(foreign, spans, meta)

    def foreign(self, jobs: list[str]) -> set[str]:
        """Which of `jobs` are other clusters' (billed from the archive: `<cluster>:<job>`)."""
        return set(self._split(jobs)[1])

    def _split(self, jobs: list[str]) -> tuple[list[str], list[str]]:
        """This cluster's jobs, and other clusters' (`<cluster>:<job>`)."""
        if not self.others:
            return jobs, []
        foreign = [j for j in jobs if j.split(":", 1)[0] in self.others and ":" in j]
        if not foreign:
            return jobs, []
        theirs = set(foreign)
        return [j for j in jobs if j not in theirs], foreign

    def _foreign_tables(
        self, names: list[str], spans: list[tuple[int, int]], meta: bool
    ) -> tuple[dict[str, dict[str, Any]], list[WindowTable]]:
        """Other clusters' jobs over the windows, from their sealed days: their meta (their
        attributes as sealed, and their `cluster`) and their tables."""
        by: dict[str, list[tuple[int, str]]] = {}
        for i, n in enumerate(names):
            c, j = n.split(":", 1)
            by.setdefault(c, []).append((i, j))
        attrs = [""] * len(names)
        tables = []
        for start, end in spans:
            net = np.zeros((len(names), WIDTH - 1), np.int64)
            versions: list[Any] = [set() for _ in names]
            steps: dict[str, Steps] = {}
            for c, members in by.items():
                w = self.others[c].window([j for _, j in members], start, end)
                for k, (i, _) in enumerate(members):
                    net[i] = w.sums[k, : WIDTH - 1]
                    versions[i] = w.versions[k]
                    done, tokens, voided, voided_tokens = w.sums[k, WIDTH - 1 :].tolist()
                    steps[names[i]] = Steps(done, voided, tokens - voided_tokens)
                    attrs[i] = w.attributes[k] or attrs[i]
            tables.append(WindowTable(names, net, versions, steps))
        metas: dict[str, dict[str, Any]] = {}
        if meta:
            for n, text in zip(names, attrs, strict=True):
                got = _json(text) if text else {}
                metas[n] = {**(got if isinstance(got, dict) else {}), "cluster": n.split(":", 1)[0]}
        return metas, tables

    def _hot_spans(self, spans: list[tuple[int, int]], warn: Warnings) -> tuple[int, list[tuple[int, int]]]:
        """The ledger's start in Redis, and the windows' parts from it on (empty before it)."""
        cut = hot_from(self.r, self.prefix)
        if not cut or all(start >= cut for start, _ in spans):
            return 0, spans
        if self.cold is None:
            warn.add(
                "ledger",
                f"amounts before {_day(cut)} are in the archive, which this API does not read "
                "(--archive): not counted",
            )
        return cut, [(max(start, cut), max(end, cut)) for start, end in spans]

    def _with_cold(
        self, jobs: list[str], spans: list[tuple[int, int]], cut: int, tables: list[WindowTable]
    ) -> list[WindowTable]:
        """Each window's tables plus, for a window that begins before `cut`, the archive's part."""
        if not cut or self.cold is None:
            return tables
        for (start, end), t in zip(spans, tables, strict=True):
            if start >= cut:
                continue
            cold = self.cold.window(jobs, start, min(end, cut))
            t.net += cold.sums[:, : WIDTH - 1]
            for i, j in enumerate(jobs):
                if cold.versions[i]:
                    t.versions[i] = set(t.versions[i] or ()) | cold.versions[i]
                c = cold.sums[i, WIDTH - 1 :].tolist()
                if any(c):
                    was = t.steps.get(j, Steps())
                    t.steps[j] = Steps(was.completed + c[0], was.voided + c[2], was.net_tokens + c[1] - c[3])
        return tables

    def _table_chunks(
        self,
        jobs: list[str],
        spans: list[tuple[int, int]],
        warn: Warnings,
        meta: bool = False,
        tokens: bool = False,
    ) -> Iterator[tuple[list[str], dict[str, dict[str, Any]], list[WindowTable]]]:
        n = len(jobs)
        cuts = list(range(0, n, CHUNK)) or [0]
        args = [len(spans), int(meta), int(tokens), *(t for span in spans for t in span)]
        # per job, in this order
        builders = [keys.rollup_state_key, keys.rollup_key, keys.steps_key, keys.voids_key]
        builders += [keys.meta_key, keys.figures_key] * meta
        around = key_templates(self.prefix, builders)

        def read(i: int) -> list[Any]:
            part = jobs[i : i + CHUNK]
            if not part:
                return []
            pipe = self.r.pipeline(transaction=False)
            for b in range(0, len(part), self.batch):
                names = [h + j + t for j in part[b : b + self.batch] for h, t in around]
                self._windows(keys=names, args=args, client=pipe)
            return _run(pipe)

        notes: list[list[Warnings]] = []  # per chunk: meta, then per window steps and exact
        if len(cuts) == 1:
            part = jobs[:CHUNK]
            notes.append([Warnings() for _ in range(1 + 2 * len(spans))])
            yield part, *self._chunk(part, read(0), spans, meta, tokens, notes[-1])
        else:
            pool = ThreadPoolExecutor(1, thread_name_prefix="costexporter-read")
            try:
                pending = [pool.submit(read, i) for i in cuts]
                for i, fut in zip(cuts, pending, strict=True):
                    part = jobs[i : i + CHUNK]
                    notes.append([Warnings() for _ in range(1 + 2 * len(spans))])
                    yield part, *self._chunk(part, fut.result(), spans, meta, tokens, notes[-1])
            finally:
                pool.shutdown(wait=True, cancel_futures=True)
        for k in range(1 + 2 * len(spans)):
            for lines in notes:
                for line in lines[k]:
                    if line not in warn and len(warn) < 100:
                        warn.append(line)

    def _chunk(
        self,
        jobs: list[str],
        results: list[Any],
        spans: list[tuple[int, int]],
        meta: bool,
        tokens: bool,
        notes: list[Warnings],
    ) -> tuple[dict[str, dict[str, Any]], list[WindowTable]]:
        """One chunk's replies of ROLLUP_WINDOWS as its meta and tables; `notes`: where its
        warnings go (meta, then per window the steps' and the exact path's)."""
        per_w = 8 if tokens else 4
        k = _per_job(len(spans), tokens)
        flat: list[Any] = []  # every job's values in a row; a job's value x is flat[x::k]
        for i, got in zip(range(0, len(jobs), self.batch), results, strict=True):
            if got is None:  # cannot happen short of an outage (which raises): read exactly
                flat += ([0, "", ""] + [False] * (per_w * len(spans))) * len(jobs[i : i + self.batch])
            else:
                flat += got
        metas = _metas(jobs, flat[0::k], notes[0]) if meta else {}
        usable, pvs = flat[1::k], flat[2::k]
        out = []
        for w, (start, end) in enumerate(spans):
            at = 3 + per_w * w
            warn, exact_warn = notes[1 + 2 * w], notes[2 + 2 * w]
            if tokens:
                cols = [flat[at + x :: k] for x in range(2, 8)]
                counted = [None if got[0] is None else list(got) for got in zip(*cols, strict=True)]
                steps = _steps(jobs, counted, warn)
            else:
                steps = _counts(jobs, flat[at + 2 :: k], flat[at + 3 :: k], warn)
            net, versions, exact = _rollup_net(usable, pvs, flat[at::k], flat[at + 1 :: k])
            if exact:
                names = [jobs[i] for i in exact]
                pipe = self.r.pipeline(transaction=False)
                self._queue_amounts(pipe, names, start, end)
                for i, a in zip(exact, _amounts(names, _run(pipe), exact_warn).values(), strict=True):
                    net[i] = _vector(a)
                    versions[i] = a.price_versions
            out.append(WindowTable(jobs, net, versions, steps))
        return metas, out

    def _exact_table(self, jobs: list[str], start: int, end: int, warn: Warnings) -> WindowTable:
        """A window summed from the buckets (the path the rollups are tested against)."""
        pipe = self.r.pipeline(transaction=False)
        self._queue_amounts(pipe, jobs, start, end)
        self._queue_steps(pipe, jobs, start, end)
        raw = _run(pipe) if jobs else []
        amounts = _amounts(jobs, raw[: len(jobs)], warn)
        net = np.array([_vector(amounts[j]) for j in jobs], np.int64).reshape(len(jobs), WIDTH - 1)
        versions = [amounts[j].price_versions for j in jobs]
        return WindowTable(jobs, net, versions, _steps(jobs, raw[len(jobs) :], warn))

    def _queue_amounts(self, pipe: Pipeline, jobs: list[str], start: int, end: int) -> None:
        parts = decompose(start, end)
        for j in jobs:
            self._sum(keys=[keys.bucket_key(self.prefix, j, res, b) for res, b in parts], client=pipe)

    def _queue_steps(self, pipe: Pipeline, jobs: list[str], start: float, end: float) -> None:
        for j in jobs:
            self._steps(
                keys=[keys.steps_key(self.prefix, j), keys.voids_key(self.prefix, j)],
                args=[start, end],
                client=pipe,
            )

    def totals_many(self, jobs: list[str], warn: Warnings | None = None) -> dict[str, Amounts]:
        """All-time amounts (the `ledger:total` hash) of many jobs, one pipeline."""
        pipe = self.r.pipeline(transaction=False)
        for j in jobs:
            pipe.hgetall(keys.total_key(self.prefix, j))
        out = {}
        for j, h in zip(jobs, _run(pipe), strict=True):
            a = Amounts()
            bad = a.add_hash(h) if h is not None else 1
            if bad and warn is not None:
                warn.add(j, f"{bad} all-time amounts are not numbers or not in a hash: skipped")
            out[j] = a
        return out

    def series_matrix(
        self, job: str, start: int, end: int, res: str, warn: Warnings | None = None
    ) -> tuple[list[int], np.ndarray]:
        """The series' bucket starts and their net amounts as a matrix (a row per point, columns
        `ledger.PACKED`): each point the difference of two rollup records (one script call);
        from the buckets of `res` where the job has no usable rollup."""
        secs = RESOLUTIONS[res]
        first = start // secs * secs
        starts = list(range(first, end, secs))
        cut = hot_from(self.r, self.prefix) if starts else 0
        cut = cut if cut > first else 0  # the series begins before the ledger's start
        hot = None
        if self.use_rollups and starts:
            got = self._series(
                keys=[keys.rollup_state_key(self.prefix, job), keys.rollup_key(self.prefix, job)],
                args=[first, secs, len(starts)],
            )
            if got and got[0] == "1":
                unique, at = [], []
                for r in got[1:]:
                    if r != "=":
                        unique.append(r or ZEROS)
                    at.append(len(unique) - 1)
                m = _records(unique)
                if m is not None and cut:  # a bound before the ledger's start: its base record
                    base = self.r.zrevrangebyscore(keys.rollup_key(self.prefix, job), f"({cut}", "-inf", 0, 1)
                    b = _records([base[0]] if base else [ZEROS])
                    if b is None:
                        m = None
                    else:
                        m = m[at]
                        bounds = np.arange(len(starts) + 1) * secs + first
                        m[bounds <= cut] = b[0]
                        at = list(range(len(at)))
                if m is not None:
                    m = m[at]
                    hot = m[1:, 1:] - m[:-1, 1:]
        if hot is None:
            hot = np.array(
                [_vector(a) for _, a in self.series(job, start, end, res, warn, cut)], np.int64
            ).reshape(len(starts), WIDTH - 1)
        if cut and self.cold is not None:
            hot += self.cold.series(job, starts, secs, cut)[:, : WIDTH - 1]
        elif cut and warn is not None:
            warn.add("ledger", f"amounts before {_day(cut)} are in the archive, which this API does not read")
        return starts, hot

    def series(
        self, job: str, start: int, end: int, res: str, warn: Warnings | None = None, cut: int = 0
    ) -> list[tuple[int, Amounts]]:
        """The series from the buckets of `res` (the exact path); from `cut` on only (the
        ledger's start in Redis: a point across it is summed from the buckets after it)."""
        secs = RESOLUTIONS[res]
        first = start // secs * secs
        starts = list(range(first, end, secs))
        pipe = self.r.pipeline(transaction=False)
        for b in starts:
            if b >= cut:
                pipe.hgetall(keys.bucket_key(self.prefix, job, res, b))
            else:
                parts = decompose(cut, b + secs) if b + secs > cut else []
                self._sum(keys=[keys.bucket_key(self.prefix, job, r, s) for r, s in parts], client=pipe)
        out = []
        bad = 0
        for b, h in zip(starts, _run(pipe), strict=True):
            a = Amounts()
            if b < cut and h is not None:  # SUM_BUCKETS' flat reply
                h = dict(zip(h[::2], h[1::2], strict=True))
                versions = h.pop("price_version", None)
                bad += number(h.pop("_bad", 0)) or 0
                a.price_versions.update(versions.split("\n") if versions else ())
            bad += a.add_hash(h) if h is not None else 1
            out.append((b, a))
        if bad and warn is not None:
            warn.add(job, f"{bad} ledger amounts are not numbers or not in a hash: skipped")
        return out

    def incidents(
        self, job: str, start: int, end: int, tol_s: float = 5.0, warn: Warnings | None = None
    ) -> list[dict[str, Any]]:
        """Every agent's incidents of `job` merged job-wide: one stretch per category and overlap."""
        return self.incidents_many([job], start, end, tol_s, warn)[job]

    def incidents_many(
        self, jobs: list[str], start: int, end: int, tol_s: float = 5.0, warn: Warnings | None = None
    ) -> dict[str, list[dict[str, Any]]]:
        """`incidents` of each job, in two round trips for all of them: the agents that wrote
        incidents are read from each job's index (never a SCAN), then their records."""
        warn = Warnings() if warn is None else warn
        jobs, foreign = self._split(jobs)
        out = self._foreign_incidents(foreign, start, end, tol_s, warn) if foreign else {}
        pipe = self.r.pipeline(transaction=False)
        for job in jobs:
            pipe.smembers(keys.incident_index_key(self.prefix, job))
        indexes = _run(pipe) if jobs else []
        pipe = self.r.pipeline(transaction=False)
        wrote: list[tuple[str, list[str]]] = []
        for job, agents in zip(jobs, indexes, strict=True):
            if agents is None:
                warn.add(job, "the incident index is not a set: incidents skipped")
            wrote.append((job, sorted(agents or ())))
            for agent in wrote[-1][1]:
                pipe.hvals(keys.incidents_key(self.prefix, job, agent))
        values = iter(_run(pipe) if any(a for _, a in wrote) else [])
        for job, agents in wrote:
            raw = []
            for _ in agents:
                for v in next(values) or []:
                    inc = incident(_json(v))
                    if inc is None:
                        warn.add(job, "an incident that is not a valid record: skipped")
                    else:
                        raw.append(inc)
            out[job] = _merged(raw, start, end, tol_s)
        return out

    def _foreign_incidents(
        self, names: list[str], start: int, end: int, tol_s: float, warn: Warnings
    ) -> dict[str, list[dict[str, Any]]]:
        """Other clusters' jobs' incidents (`<cluster>:<job>`), from their sealed days."""
        by: dict[str, list[str]] = {}
        for n in names:
            c, j = n.split(":", 1)
            by.setdefault(c, []).append(j)
        out = {}
        for c, jobs in by.items():
            for j, records in self.others[c].incidents(jobs, start, end).items():
                raw = [x for x in map(incident, records) if x is not None]
                if len(raw) < len(records):
                    warn.add(f"{c}:{j}", "an incident that is not a valid record: skipped")
                out[f"{c}:{j}"] = _merged(raw, start, end, tol_s)
        return out

    def index_incidents(self) -> int:
        """Index incidents written before the index existed (once, at startup)."""
        return ledger.index_incidents(self.r, self.prefix)

    def build_rollups(self) -> int:
        """Build the rollups of ledgers written before they existed (once, at startup)."""
        return ledger.build_rollups(self.r, self.prefix)

    def unassigned(self, start: int, end: int, warn: Warnings | None = None) -> Amounts:
        """GPU time no job registered, in this cluster and the others billed here."""
        a = self.amounts_many([ledger.UNASSIGNED_JOB], start, end, warn)[ledger.UNASSIGNED_JOB]
        for cold in self.others.values():
            w = cold.window([ledger.UNASSIGNED_JOB], start, end)
            theirs = _packed(w.sums[0, : WIDTH - 1].tolist(), w.versions[0])
            for mine, more in ((a.ms, theirs.ms), (a.mj, theirs.mj), (a.ucost, theirs.ucost)):
                for c in mine:
                    mine[c] += more[c]
            a.price_versions |= theirs.price_versions
        return a


def _day(t: int) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d")


def _packed(values: list[Any], versions: set[Any]) -> Amounts:
    """Amounts from a matrix row: net values in the order `ledger.PACKED`."""
    return Amounts(
        dict(zip(CATEGORIES, values[0::3], strict=True)),
        dict(zip(CATEGORIES, values[1::3], strict=True)),
        dict(zip(CATEGORIES, values[2::3], strict=True)),
        set(versions),
    )


def _amounts(jobs: list[str], replies: list[Any], warn: Warnings | None) -> dict[str, Amounts]:
    """Each job's window amounts from the replies of `LedgerStore._queue_amounts`."""
    out = {}
    for j, flat in zip(jobs, replies, strict=True):
        a = Amounts()
        h = dict(zip(flat[::2], flat[1::2], strict=True)) if flat else {}
        versions = h.pop("price_version", None)
        bad = (number(h.pop("_bad", 0)) or 0) + a.add_hash(h) + (flat is None)
        if versions:
            a.price_versions.update(versions.split("\n"))
        if bad and warn is not None:
            warn.add(j, f"{bad} ledger amounts are not numbers or not in a hash: skipped")
        out[j] = a
    return out


def _counts(jobs: list[str], done: list[Any], voided: list[Any], warn: Warnings) -> dict[str, Steps]:
    """Steps completed and voided (no tokens), a column each; a completed count of None: the
    sets have the wrong type."""
    out = {}
    for j, c_n, v_n in zip(jobs, done, voided, strict=True):
        if c_n is None:
            warn.add(j, "the step sets have the wrong type: steps skipped")
            out[j] = Steps()
        else:
            out[j] = Steps(c_n, v_n or 0)
    return out


def _steps(jobs: list[str], replies: list[Any], warn: Warnings | None) -> dict[str, Steps]:
    """Each job's window steps from the replies of `LedgerStore._queue_steps`."""
    warn = Warnings() if warn is None else warn
    out = {}
    for j, got in zip(jobs, replies, strict=True):
        if got is None:
            warn.add(j, "the step sets have the wrong type: steps skipped")
            out[j] = Steps()
            continue
        c_n, c_end, c_start, v_n, v_end, v_start = got

        def cum(member: str, j: str = j) -> int:
            n = number(member.rsplit(":", 1)[-1]) if member else 0
            if n is None:
                warn.add(j, f"step member {member[:40]!r} has no cumulative tokens: counted as 0")
            return n or 0

        tokens = (cum(c_end) - cum(c_start)) - (cum(v_end) - cum(v_start))
        out[j] = Steps(int(c_n), int(v_n), tokens)
    return out


# The oldest entries of a stream looked at for the job's first register: a reporter's first
# batch starts with it, and the kept stream holds only registrations, runs, meta and gates.
FIRST_ENTRIES = 16


def _first_register(entries: object) -> float | None:
    """The time of the oldest `register` among a stream's oldest entries (XRANGE's reply)."""
    if not isinstance(entries, list):
        return None
    for entry in entries:
        fields = entry[1] if isinstance(entry, list | tuple) and len(entry) == 2 else None
        if isinstance(fields, dict) and fields.get("type") == "register":
            t = timestamp(fields.get("ts"))
            if t is not None:
                return t
    return None


def _info(j: str, replies: list[Any], warn: Warnings) -> dict[str, Any]:
    """A job's info from the 4 replies of `LedgerStore._queue_info`. `first_seen` is its ranks'
    oldest latest register (`LedgerStore.first_seen_many` finds the first start)."""
    meta, figures, status, ranks = replies
    for what, value in (("meta", meta), ("figures", figures), ("ranks", ranks)):
        if value is None:
            warn.add(j, f"{what} key has the wrong type: ignored")
    regs = []
    for r in ranks or []:
        entry = _json(r)
        t = timestamp(entry.get("ts")) if isinstance(entry, dict) else None
        if t is None:
            warn.add(j, "a ranks entry without a valid registration time: ignored")
        else:
            regs.append(t)
    state = "unknown"
    if status:
        parsed = _json(status)
        state = str(parsed.get("state", "unknown")) if isinstance(parsed, dict) else str(status)
    return {
        "meta": job_meta(meta or {}, figures or {}),
        "figures": figures or {},
        "status": state,
        "first_seen": min(regs) if regs else None,
        "ranks": len(regs),  # the ranks registered (goodput's ETTR: the job's width)
    }


def _merged(raw: list[dict[str, Any]], start: int, end: int, tol_s: float) -> list[dict[str, Any]]:
    """One job's incidents from every agent, merged: one stretch per category and overlap (a
    host that saw the cause names it; the cost of each host's part added up), those meeting
    [start, end)."""
    merged: list[dict[str, Any]] = []
    for inc in sorted(raw, key=lambda x: (x["category"], x["start"])):
        s, e = inc["start"] / 1000, inc["end"] / 1000
        last = merged[-1] if merged else None
        if last and last["category"] == inc["category"] and s <= last["end"] + tol_s:
            last["end"] = max(last["end"], e)
            last["gpu_ms"] += inc["gpu_ms"]
            last["ranks"] = sorted(set(last["ranks"]) | set(inc["ranks"]))
            last["hosts"] = sorted(set(last["hosts"]) | {inc["host"]})
            last["zero_util_ranks"] = sorted(set(last["zero_util_ranks"]) | set(inc["zero_util_ranks"]))
            if last["cause"] == causes.UNKNOWN:  # a host that saw the cause names it
                last["cause"], last["cause_why"] = inc["cause"], inc["cause_why"]
            known = last["cost_micro"] is not None and inc["cost_micro"] is not None
            last["cost_micro"] = last["cost_micro"] + inc["cost_micro"] if known else None
        else:
            merged.append(
                {
                    "category": inc["category"],
                    "start": s,
                    "end": e,
                    "gpu_ms": inc["gpu_ms"],
                    "ranks": list(inc["ranks"]),
                    "hosts": [inc["host"]],
                    "zero_util_ranks": list(inc["zero_util_ranks"]),
                    "cause": inc["cause"],
                    "cause_why": inc["cause_why"],
                    "cost_micro": inc["cost_micro"],
                }
            )
    return [m for m in merged if m["end"] > start and m["start"] < end]


def incident(x: object) -> dict[str, Any] | None:
    """A stored incident as the reader needs it, or None if it is not one."""
    if not isinstance(x, dict) or not isinstance(x.get("category"), str):
        return None
    start, end = timestamp_ms(x.get("start")), timestamp_ms(x.get("end"))
    gpu_ms, ranks = number(x.get("gpu_ms")), x.get("ranks")
    if start is None or end is None or end < start or gpu_ms is None or not isinstance(ranks, list):
        return None
    zero = x.get("zero_util_ranks", [])  # absent in incidents written before it existed
    if not isinstance(zero, list) or not all(
        isinstance(r, int) and not isinstance(r, bool) for r in [*ranks, *zero]
    ):
        return None
    host = x.get("host", "")
    cause, why = x.get("cause"), x.get("cause_why")  # absent in incidents written before causes
    known = cause in causes.CAUSES and isinstance(why, str)
    ucost = x.get("cost_micro")  # absent in incidents written before their cost was kept
    return {
        "cost_micro": ucost
        if isinstance(ucost, int) and not isinstance(ucost, bool) and ucost >= 0
        else None,
        "cause": cause if known else causes.UNKNOWN,
        "cause_why": why[:500] if known else "",  # type: ignore[index]
        "category": x["category"],
        "start": start,
        "end": end,
        "gpu_ms": gpu_ms,
        "ranks": ranks,
        "zero_util_ranks": sorted(set(zero)),
        "host": host if isinstance(host, str) else "",
    }


def timestamp_ms(v: object) -> float | None:
    """A stored time in Unix milliseconds, or None."""
    t = timestamp(v / 1000 if isinstance(v, int | float) and not isinstance(v, bool) else None)
    return None if t is None else float(v)  # type: ignore[arg-type]
