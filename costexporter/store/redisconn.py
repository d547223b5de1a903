"""One place that turns a Redis URL into a client: a single Redis or a Redis Cluster.

A Redis Cluster is named by its scheme, `redis+cluster://host:port` (TLS: `rediss+cluster://`),
or by `?cluster=true` on an ordinary `redis://` URL. Several seed nodes may be listed,
`redis+cluster://h1:7000,h2:7000`, so a client starts while one of them is down; the client
learns the rest of the cluster from whichever answers. Credentials and query options
(`ssl_ca_certs`, ...) are those of redis-py's URLs and apply to every node. A cluster has only
database 0.

Every key of a job carries the job as a hash tag (`<prefix>:<ns>:{<job>}:...`, keys.job_key), so a
job's transaction stays in one slot; the few keys outside a job (the jobs index, node and GPU
keys, the epoch marker) and the agents' sample streams (each under a tag of its own,
keys.samples_key) are written by single commands or non-transactional pipelines, which
redis-py's cluster client splits per node.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any, cast
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from costexporter.store.client import RedisClient

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
_TRUE = {"1", "true", "yes", "on"}
# WATCH/MULTI/EXEC on a cluster pipeline (the agent's compare-and-set round) came in redis-py 6.1.
MIN_CLUSTER_REDIS_PY = (6, 1)


def _version(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit()) or "0"
        out.append(int(digits))
    return tuple(out)


def is_cluster_url(url: str) -> bool:
    """Whether `url` names a Redis Cluster (`redis+cluster://`, `rediss+cluster://`, `?cluster=true`)."""
    u = urlsplit(url)
    if u.scheme.lower() in CLUSTER_SCHEMES:
        return True
    return any(k == "cluster" and v.lower() in _TRUE for k, v in parse_qsl(u.query))


def _cluster_parts(url: str) -> tuple[str, list[tuple[str, int]]]:
    """The URL redis-py's RedisCluster understands (first seed, no `cluster` option, no db) and
    every seed node as (host, port). ValueError (one line) for a database other than 0."""
    u = urlsplit(url)
    scheme = CLUSTER_SCHEMES.get(u.scheme.lower(), u.scheme.lower() or "redis")
    if scheme not in ("redis", "rediss"):
        raise ValueError(f"a Redis Cluster URL is redis+cluster:// or rediss+cluster://, not {u.scheme}://")
    query = [(k, v) for k, v in parse_qsl(u.query) if k != "cluster"]
    db = (u.path or "/").strip("/") or dict(query).get("db", "0")
    if db != "0":
        raise ValueError(f"a Redis Cluster has only database 0, not {db!r}")
    query = [(k, v) for k, v in query if k != "db"]
    creds, _, hosts = u.netloc.rpartition("@")
    seeds: list[tuple[str, int]] = []
    for h in hosts.split(","):
        part = urlsplit(f"//{h}")
        try:
            port = part.port or 6379
        except ValueError:
            raise ValueError(f"bad port in Redis Cluster node {h!r}") from None
        seeds.append((part.hostname or "127.0.0.1", port))
    first = f"{seeds[0][0]}:{seeds[0][1]}" if ":" not in seeds[0][0] else f"[{seeds[0][0]}]:{seeds[0][1]}"
    netloc = f"{creds}@{first}" if creds else first
    return urlunsplit((scheme, netloc, "", urlencode(query), "")), seeds


def from_url(url: str, **kwargs: Any) -> RedisClient:
    """A redis-py client for `url`: `redis.Redis` for one Redis, a `redis.RedisCluster` (behind
    `LazyCluster`) for a cluster URL, typed as the commands both share (`client.RedisClient`: redis-py
    types the two differently). `kwargs` (timeouts, `retry`, `decode_responses`) go to
    either, so each caller keeps its own timeouts; `retry` of a cluster client governs its outage
    retries (it follows MOVED/ASK redirects in any case)."""
    import redis

    if kwargs.get("decode_responses"):
        # A stream entry of bytes that are not UTF-8 (hostile or broken) must not make every
        # read of the key raise: it decodes with U+FFFD and the reader refuses it, counted.
        kwargs.setdefault("encoding_errors", "replace")
    if not is_cluster_url(url):
        single: Any = redis.Redis.from_url(url, **kwargs)  # (its replies typed Awaitable | Any)
        return cast(RedisClient, single)
    if _version(redis.__version__) < MIN_CLUSTER_REDIS_PY:
        raise ValueError(
            f"a Redis Cluster needs redis-py >= 6.1 (transactions on a cluster), not "
            f"{redis.__version__}: pip install -U 'redis>=6.1'"
        )
    from redis.cluster import ClusterNode, RedisCluster

    base, seeds = _cluster_parts(url)
    node: Any = ClusterNode  # redis-py leaves its __init__ untyped

    def make() -> Any:
        return RedisCluster(url=base, startup_nodes=[node(h, p) for h, p in seeds[1:]] or None, **kwargs)

    return cast(RedisClient, LazyCluster(make))


def _unreachable_class() -> type[Exception]:
    import redis
    from redis.exceptions import RedisClusterException

    class ClusterUnreachable(redis.ConnectionError, RedisClusterException):
        """No node of the cluster answered: a ConnectionError, as a single Redis's outage is."""

    return ClusterUnreachable


class LazyCluster:
    """A RedisCluster built on first use, and its topology errors shown as ConnectionError.

    redis-py's cluster client connects in its constructor and, when no node answers, raises
    RedisClusterException (not a RedisError). The trainer's reporter must start while Redis is
    down and every caller counts an outage as `redis.ConnectionError`, as with one Redis; this
    wrapper gives both. Every attribute is the real client's."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make
        self._client: Any = None
        self._lock = threading.Lock()

    def _get(self) -> Any:
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self._client = _guard(_call(self._make))
        return self._client

    @property
    def cluster(self) -> Any:
        """The redis-py RedisCluster (connecting now if it has not yet)."""
        return self._get()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._get(), name)

    def __repr__(self) -> str:
        return f"LazyCluster({self._client!r})"


def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """fn(...), with "no node answers" raised as ClusterUnreachable (a redis.ConnectionError)."""
    from redis.exceptions import RedisClusterException

    try:
        return fn(*args, **kwargs)
    except RedisClusterException as e:
        if isinstance(e, _UNREACHABLE) or "cannot be connected" not in str(e):
            raise
        raise _UNREACHABLE(str(e)) from None


def _guard(client: Any) -> Any:
    """Make the client's topology refresh (run after a node fails, also inside pipelines, which
    share its nodes manager) raise ClusterUnreachable when no node answers. (`client`: a
    RedisCluster, whose nodes manager redis-py leaves untyped.)"""
    nm = client.nodes_manager
    init = nm.initialize

    def initialize(*args: Any, **kwargs: Any) -> Any:
        return _call(init, *args, **kwargs)

    nm.initialize = initialize
    return client


# Server errors that pass (Redis full, loading, a replica during failover): retry, never drop.
_RETRYABLE_CODES = frozenset({"BUSY", "MISCONF", "NOREPLICAS"})


def retryable(exc: BaseException) -> bool:
    """Whether a server's refusal passes with time (Redis full, loading, failing over): the
    write waits and goes again. Any other refusal (a key of the wrong type, a command the ACL
    denies) would be refused again: the write is dropped and counted, not retried forever."""
    from redis import exceptions as rx

    transient = (
        rx.OutOfMemoryError,
        rx.ReadOnlyError,
        rx.BusyLoadingError,
        rx.TryAgainError,
        rx.ClusterDownError,
        rx.MasterDownError,
    )
    return isinstance(exc, transient) or str(exc).split(" ", 1)[0] in _RETRYABLE_CODES


def is_cluster(client: RedisClient) -> bool:
    """Whether `client` talks to a Redis Cluster."""
    if isinstance(client, LazyCluster):
        return True
    from redis.cluster import ClusterPipeline, RedisCluster

    return isinstance(client, (RedisCluster, ClusterPipeline))


def script(client: RedisClient, text: str) -> Callable[..., Any]:
    """`client.register_script(text)`, usable on a cluster's pipelines too.

    redis-py's Script loads itself only into a single Redis's pipelines; on a cluster pipeline it
    would send EVALSHA to a node that may never have seen the script (NOSCRIPT, a wrong None).
    There the call sends EVAL, which every node runs (and caches) whatever it loaded before."""
    if not is_cluster(client):
        registered: Callable[..., Any] = client.register_script(text)
        return registered

    def run(keys: Iterable[str] = (), args: Iterable[Any] = (), client: RedisClient = client) -> Any:
        keys, args = list(keys), list(args)
        # execute_command: ClusterPipeline has no eval(); the keys still pick the slot's node.
        return client.execute_command("EVAL", text, len(keys), *keys, *args)

    return run


def mget(client: RedisClient, keys: list[str]) -> list[Any]:
    """MGET of keys in any slots: one MGET on a single Redis; on a cluster, one per slot
    (redis-py's `mget_nonatomic`), as a cluster refuses a multi-key command across slots."""
    cluster: Any = client  # (mget_nonatomic: the cluster client's alone)
    got: list[Any] = cluster.mget_nonatomic(keys) if is_cluster(client) else client.mget(keys)
    return got


_UNREACHABLE = _unreachable_class()


def stream_replies(response: Any, **_options: Any) -> list[tuple[Any, list[Any]]]:
    """An XREAD reply as [(stream, entries)], whichever shape redis-py gave it: a list of pairs
    (RESP2, or RESP3 mapped back, redis-py's default) or a dict (a client asked for RESP3, as a
    URL's `?protocol=3` does)."""
    if not response:
        return []
    if isinstance(response, dict):
        return list(response.items())
    return [(key, entries) for key, entries in response]


# A sibling of each client, on its connection pool (its connections, their retry and decoding),
# whose XREAD leaves the entries as the server sent them.
_FLAT_XREAD: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


class SentXread:
    """An XREAD sent now on a connection of its own, its reply read later (`reply()`): Redis
    works out and sends the reply while the caller works on (a watcher decides the jobs it read
    before). The entries come as `xread_flat` gives them. A single Redis only. Call `reply()` or
    `cancel()` once: the connection goes back to the pool then (closed by `cancel`, or after
    a failure: an unread reply would answer its next command)."""

    def __init__(self, client: RedisClient, streams: dict[str, str], count: int) -> None:
        self._pool: Any = getattr(client, "connection_pool")  # noqa: B009 - a single Redis's (untyped here)
        self._conn: Any = self._pool.get_connection()
        try:
            self._conn.send_command("XREAD", "COUNT", count, "STREAMS", *streams, *streams.values())
        except BaseException:
            self.cancel()
            raise

    def reply(self) -> list[tuple[Any, list[Any]]]:
        import redis

        conn, self._conn = self._conn, None
        if conn is None:
            raise RuntimeError("this XREAD's reply was taken or cancelled already")
        try:
            got = conn.read_response()
        except redis.ResponseError:  # the server's refusal, read whole: the connection is sound
            raise
        except BaseException:
            conn.disconnect()
            raise
        finally:
            self._pool.release(conn)
        return stream_replies(got)

    def cancel(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.disconnect()
            self._pool.release(conn)


def xread_flat(
    client: RedisClient, streams: dict[str, str], count: int, block: int | None = None
) -> list[tuple[Any, list[Any]]]:
    """XREAD of many streams as [(stream, [(id, fields), ...])]. On a single Redis each entry's
    fields are the flat [field, value, ...] list the server sent: redis-py's reply callback
    builds a dict per entry through calls of its own, about 2 µs an entry, a fifth of a
    watcher's poll at 13,000 entries (the reader pairs them as it reads the entry). On a
    cluster, redis-py's reply."""
    if is_cluster(client):
        return stream_replies(client.xread(streams, count=count, block=block))
    import redis

    raw: Any = _FLAT_XREAD.get(client)
    if raw is None:
        pool: Any = getattr(client, "connection_pool")  # noqa: B009 - a single Redis's
        raw = redis.Redis(connection_pool=pool)  # never closes the pool
        raw.set_response_callback("XREAD", stream_replies)
        _FLAT_XREAD[client] = raw
    got: list[tuple[Any, list[Any]]] = raw.xread(streams, count=count, block=block)
    return got
