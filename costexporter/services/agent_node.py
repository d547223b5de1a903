"""This node's GPUs as the agent sees them: the samples read from them and kept until booked,
each GPU's band profile (with its learned idle level and a shared GPU's slice), and what the
agent publishes of the node (its GPUs and newest readings, the learned idle levels)."""

from __future__ import annotations

import collections
import json
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from costexporter.core import bands as bands_mod
from costexporter.core import profiles, shares
from costexporter.core.idle import IdleLearner
from costexporter.core.profiles import Profile
from costexporter.core.timeutil import to_ms
from costexporter.services.agent_config import AgentConfig
from costexporter.sources.base import GpuSource, Reading
from costexporter.store.client import RedisClient
from costexporter.store.keys import gpu_idle_key, node_key

log = logging.getLogger("costexporter.agent")

Local = tuple[np.ndarray, ...]  # (gpu, ts ms, W, %, mJ)
_DTYPES = (np.int64, np.int64, np.float64, np.float64, np.float64)


class LocalSamples:
    """This node's samples, kept until every job (and the unassigned ledger) has booked them;
    bounded, the overflow counted."""

    def __init__(self, max_buffered: int) -> None:
        self.max_buffered = max_buffered
        self.stats: collections.Counter[str] = collections.Counter()
        self.chunks: list[Local] = []
        self.first_seen: dict[int, int] = {}  # GPU -> this process's first sample of it (ms)
        self.newest: dict[int, int] = {}  # GPU -> newest sample (ms)

    def add(self, readings: Sequence[Reading]) -> Local | None:
        """A round's readings, as arrays (ts: `round(ts * 1000)`); None when there are none."""
        if not readings:
            return None
        n = len(readings)
        chunk = (
            np.fromiter((r.gpu for r in readings), np.int64, n),
            np.fromiter((to_ms(r.ts) for r in readings), np.int64, n),
            np.fromiter((r.power_w for r in readings), np.float64, n),
            np.fromiter((r.util_pct for r in readings), np.float64, n),
            np.fromiter((r.energy_mj for r in readings), np.float64, n),
        )
        self.chunks.append(chunk)
        for g in np.unique(chunk[0]).tolist():
            t = chunk[1][chunk[0] == g]
            self.first_seen.setdefault(g, int(t.min()))
            self.newest[g] = max(self.newest.get(g, 0), int(t.max()))
        return chunk

    def arrays(self) -> Local:
        """Every sample kept, as one set of arrays."""
        if not self.chunks:
            return tuple(np.zeros(0, dt) for dt in _DTYPES)
        if len(self.chunks) > 1:
            self.chunks = [tuple(np.concatenate(c) for c in zip(*self.chunks, strict=True))]
        return self.chunks[0]

    def pending(self) -> int:
        return int(self.chunks[0][0].size) if self.chunks else 0

    def trim(self, local: Local, keep_from: int) -> None:
        """Keep the samples from `keep_from` on, at most `max_buffered` (the oldest dropped)."""
        ts = local[1]
        keep = ts >= keep_from
        if keep.sum() > self.max_buffered:
            drop = int(keep.sum()) - self.max_buffered
            idx = np.flatnonzero(keep)[np.argsort(ts[keep], kind="stable")[:drop]]
            keep[idx] = False
            self.stats["samples_dropped"] += drop
        if not keep.all():
            self.chunks = [tuple(a[keep] for a in local)]


class NodeGpus:
    """Each GPU's profile, lanes and learned idle level; the node's entries in Redis."""

    def __init__(
        self,
        source: GpuSource,
        cfg: AgentConfig,
        host: str,
        idle: IdleLearner | None,
    ) -> None:
        self.source = source
        self.cfg = cfg
        self.host = host
        self.idle = idle
        self.stats: collections.Counter[str] = collections.Counter()
        self._idle_seeded = False
        self._idle_saved: dict[str, tuple[float, float]] = {}  # GPU key -> (level, monotonic time) stored
        self._profile_said: dict[str, object] = {}  # GPU key -> the profile last logged for it

    def key(self, g: int) -> str:
        """A GPU's key for what is learned of it: its UUID, else host and index."""
        gpus = self.source.gpus()
        uuid_ = gpus[g].uuid if g < len(gpus) else None
        return uuid_ or f"{self.host}:{g}"

    def learn(self, chunk: Local) -> None:
        """Each GPU's readings of a round into its idle level (when idle levels are learned)."""
        if self.idle is None:
            return
        for g in np.unique(chunk[0]).tolist():
            sel = chunk[0] == g
            self.idle.add(self.key(g), chunk[2][sel], chunk[3][sel])

    def profile(self, g: int) -> Profile:
        """The band profile of one GPU of this node, with its learned idle level."""
        return self.profile_source(g)[0]

    def profile_source(self, g: int) -> tuple[Profile, str]:
        """One GPU's profile and where it came from (`profiles.SOURCES`), by the one rule: the
        operator's --profile/--gpu-model/--power-limit, else the GPU's own name and limit."""
        if self.cfg.profile is not None:
            return self.cfg.profile, "file"
        gpus = self.source.gpus()
        cfg = self.cfg
        prof, source = profiles.resolve(
            None, cfg.gpu_model, cfg.power_limit_w, gpus=gpus[g : g + 1], directory=cfg.profile_dir
        )
        return profiles.learned(self.sliced(prof, [g]), source, self.idle_level([g]))

    def profiles_in_use(self) -> dict[int, tuple[Profile, str]]:
        """Each GPU's profile and source; a GPU without one (no model or limit known) is left
        out. Each GPU's profile, or why it has none, is logged once, and again when it changes."""
        used: dict[int, tuple[Profile, str]] = {}
        gpus = self.source.gpus()
        for g in range(len(gpus)):
            key = self.key(g)
            try:
                prof, source = used[g] = self.profile_source(g)
            except profiles.ProfileError as e:
                if self._profile_said.get(key) != str(e):
                    self._profile_said[key] = str(e)
                    log.error("GPU %s: %s; its readings get no band until one is given", key, e)
                continue
            line = profiles.describe(prof, source)
            if self._profile_said.get(key) != line:
                self._profile_said[key] = line
                origin = (prof.provenance or {}).get("derived_from", source)
                level = logging.INFO if origin in ("file", "calibrated", "builtin") else logging.WARNING
                log.log(level, "GPU %s (%s): band profile %s", key, gpus[g].name or "no model name", line)
        return used

    def job_profile(self, meta: dict[str, Any], gpus: list[int]) -> Profile:
        """The band profile a job's GPUs (`gpus`, sorted) are booked with."""
        cfg = self.cfg
        if cfg.profile is not None:
            return cfg.profile
        ids = self.source.gpus()
        prof = profiles.choose(
            None,
            cfg.gpu_model,
            cfg.power_limit_w,
            meta=meta,
            gpus=[ids[g] for g in gpus if g < len(ids)],  # the job's own GPUs, not the node's first
            directory=cfg.profile_dir,
        )
        return profiles.with_idle(self.sliced(prof, gpus), self.idle_level(gpus))

    def gpu_model(self, gpus: list[int]) -> str | None:
        """The model of a job's GPUs on this node, as the operator or the source names it (the
        price table's key; never the trainer's meta)."""
        if self.cfg.gpu_model:
            return self.cfg.gpu_model
        ids = self.source.gpus()
        return next((ids[g].name for g in gpus if g < len(ids) and ids[g].name), None)

    def lanes(self, gpus: list[int]) -> np.ndarray | None:
        """Each GPU's lanes (lo, hi, den) where one of them is a slice of a shared GPU; None when
        all are whole GPUs (the common case: nothing to weigh)."""
        ids = self.source.gpus()
        lanes = [ids[g].lanes if g < len(ids) else shares.WHOLE for g in gpus]
        if all(x == shares.WHOLE for x in lanes):
            return None
        return np.asarray(lanes, np.int64).reshape(-1, 3)

    def sliced(self, prof: Profile, gpus: list[int]) -> Profile:
        """A whole GPU's profile for a slice of it (a MIG instance): its power edges scaled by the
        slice's share, as the source scales the slice's power."""
        ids = self.source.gpus()
        fracs = {shares.fraction(ids[g].lanes) for g in gpus if g < len(ids)}
        if len(fracs) != 1 or fracs == {1.0}:
            return prof
        return profiles.scaled(prof, fracs.pop())

    def idle_level(self, gpus: list[int]) -> float | None:
        """The highest learned idle level of these GPUs (so each one's idle is under the edge)."""
        ids = self.source.gpus()
        if self.idle is None:  # a played-back trace brings its own levels (replay learns them)
            given = [lv for g in gpus if g < len(ids) and (lv := ids[g].idle_w) is not None]
            return max(given) if given else None
        levels = [self.idle.level(self.key(g), ids[g].power_limit_w if g < len(ids) else None) for g in gpus]
        known = [lv for lv in levels if lv is not None]
        return max(known) if known else None

    def reading_bands(self, latest: dict[int, Reading]) -> tuple[dict[int, int], dict[int, tuple[str, str]]]:
        """Each GPU's band from its newest reading alone: the band shown for a job's GPU whose
        job has no classified sample yet, so /metrics always has one; and each GPU's profile
        (name, source) in use."""
        out = {}
        used = self.profiles_in_use()
        for g, r in latest.items():
            if g not in used:
                continue
            prof = used[g][0]
            out[g] = int(bands_mod.reading_bands(np.asarray([r.power_w]), np.asarray([r.util_pct]), prof)[0])
        return out, {g: (p.name, src) for g, (p, src) in used.items()}

    def sync_idle(self, redis: RedisClient) -> None:
        """Learned idle levels in Redis by GPU UUID (`keys.gpu_idle_key`): read once at start (a
        restarted agent starts from them), written when they move or every 10 minutes."""
        if self.idle is None:
            return
        gpus = self.source.gpus()
        keys = {g.uuid: gpu_idle_key(self.cfg.prefix, g.uuid) for g in gpus if g.uuid}
        if not keys:
            return
        if not self._idle_seeded:
            self._seed_idle(redis, keys)
        now = time.monotonic()
        pipe, saved_now = None, {}
        for i, g in enumerate(gpus):
            if not g.uuid:
                continue
            lv = self.idle.level(g.uuid, g.power_limit_w)
            saved = self._idle_saved.get(g.uuid)
            if lv is None or (saved and abs(saved[0] - lv) < 0.5 and now - saved[1] < 600):
                continue
            pipe = pipe or redis.pipeline(transaction=False)
            entry = {"idle_w": round(lv, 2), "n": self.idle.count(g.uuid), "host": self.host, "gpu": i}
            pipe.set(keys[g.uuid], json.dumps({**entry, "updated": time.time()}), ex=30 * 86400)
            saved_now[g.uuid] = (lv, now)
        if pipe is not None:
            pipe.execute()
            self._idle_saved.update(saved_now)

    def _seed_idle(self, redis: RedisClient, keys: dict[str, str]) -> None:
        from costexporter.store import redisconn  # MGET across slots: one per slot on a Redis Cluster

        assert self.idle is not None
        for u, raw in zip(keys, redisconn.mget(redis, list(keys.values())), strict=True):
            try:
                d = json.loads(raw) if raw else None
                if d:
                    self.idle.seed(u, float(d["idle_w"]), int(d["n"]))
            except (ValueError, TypeError, KeyError):
                self.stats["bad_idle_entries"] += 1
        self._idle_seeded = True

    def publish(self, redis: RedisClient, latest: dict[int, Reading], ttl_s: int) -> None:
        """This node's GPUs and their newest readings, for `preflight`'s occupancy check."""
        gpus = self.source.gpus()
        if not gpus:
            return
        mapping = {}
        for i, g in enumerate(gpus):
            r = latest.get(i)
            mapping[str(i)] = json.dumps(
                {
                    "uuid": g.uuid,
                    "name": g.name,
                    "ts": r.ts if r else None,
                    "power_w": None if r is None or r.power_w != r.power_w else r.power_w,
                    "util_pct": None if r is None or r.util_pct != r.util_pct else r.util_pct,
                }
            )
        k = node_key(self.cfg.prefix, self.host)
        pipe = redis.pipeline(transaction=True)
        pipe.delete(k)
        pipe.hset(k, mapping=mapping)
        pipe.expire(k, ttl_s)
        pipe.execute()
