"""The finance API app for a command, and uvicorn to serve it (in the foreground, or on a thread
beside an agent or the demo)."""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING, Any

import click

from costexporter.cli.options import InputFailure, policy_file

if TYPE_CHECKING:
    from costexporter.api.server import ServerLimits


def api_app(
    redis_url: str, prefix: str, tokens_file: str | None, currency: str, tz: str, **options: Any
) -> Any:  # a FastAPI app
    """The finance API app; `options`: cache_mb and the FOCUS names (focus_provider, ...)."""
    from costexporter.api.app import create_app
    from costexporter.api.auth import TokenConfigError, Tokens
    from costexporter.api.export import FocusSettings
    from costexporter.store import redisconn
    from costexporter.store.ledger_read import LedgerStore

    policy = policy_file(options)  # a policy given but unusable stops here (one line)
    try:
        tokens = Tokens.load(tokens_file)
    except TokenConfigError as e:
        raise InputFailure(str(e)) from None
    if not tokens.enabled:
        click.echo("costexporter api: no tokens file: the API is open to anyone who can reach it", err=True)
    client = redisconn.from_url(redis_url, decode_responses=True, socket_timeout=5, socket_connect_timeout=2)
    cluster = options.get("cluster") or None
    cold, others = cold_ledgers(options.get("archive"), cluster, options.get("archive_clusters") or ())
    store = LedgerStore(client, prefix, cold=cold, others=others)
    index_in_background(store)
    warm_in_background([c for c in (cold, *others.values()) if c is not None])
    names = {k[6:]: v for k, v in options.items() if k.startswith("focus_") and v}
    return create_app(
        store,
        tokens,
        currency=currency,
        tz=tz,
        cache_bytes=int(float(64 if options.get("cache_mb") is None else options["cache_mb"]) * 2**20),
        focus=FocusSettings(**names) if names else None,
        cluster=cluster,
        carbon=policy.carbon,
        budgets=policy.budgets,
        credit_causes=policy.credit_causes,
    )


def cold_ledgers(url: str | None, cluster: str | None, others: tuple[str, ...] = ()) -> tuple[Any, Any]:
    """The archive the API reads the days before the ledger's start in Redis from (this
    cluster's partition), and the other clusters it bills from the archive alone; (None, {})
    without --archive. Given but unusable (no cluster, cannot be opened, another cluster with no
    partition there): one line, exit 2."""
    if not url:
        if others:
            raise InputFailure("--archive-cluster needs --archive: the archive its sealed days are in")
        return None, {}
    from costexporter.store.archive import Archive, ArchiveError
    from costexporter.store.coldledger import ColdLedger

    if not cluster:
        raise InputFailure("--archive needs --cluster: the cluster partition (cluster=NAME) this API reads")
    bad = [c for c in others if not c or ":" in c or c == cluster]
    if bad:
        raise InputFailure(f"--archive-cluster {bad[0]!r}: another cluster's name, without ':'")
    try:
        archive = Archive.open(url, create=False)
        found = archive.clusters()  # reachable now, or not at all
    except ArchiveError as e:
        raise InputFailure(str(e)) from None
    missing = [c for c in others if c not in found]
    if missing:
        raise InputFailure(
            f"the archive {url} has no partition of cluster {missing[0]!r} (cluster={missing[0]}/)"
        )
    return ColdLedger(archive, cluster), {c: ColdLedger(archive, c) for c in others}


def warm_in_background(colds: list[Any]) -> None:  # store.coldledger.ColdLedger
    """Each archive's sealed days read once at start, on a thread: the first bill over months
    then reads kept sums, not every file (a year of files takes seconds to tens of seconds)."""
    if not colds:
        return
    import logging
    import threading

    from costexporter.store.archive import ArchiveError

    log = logging.getLogger("costexporter.api")

    def run() -> None:
        for c in colds:
            try:
                n = c.warm()
            except ArchiveError as e:  # said here; a request that needs the day says it again
                log.warning("archive of cluster %s not read ahead: %s", c.cluster, e)
                continue
            log.info("read %d sealed days of cluster %s ahead", n, c.cluster)

    threading.Thread(target=run, name="costexporter-archive-warm", daemon=True).start()


def index_in_background(store: Any) -> None:  # the API's LedgerStore
    """Incidents written before the per-job index existed, and ledgers written before the rollups:
    indexed and rolled up once, off the request path (until then those jobs are read exactly)."""
    import logging
    import threading

    import redis

    log = logging.getLogger("costexporter.api")

    def run() -> None:
        try:
            n = store.index_incidents()
        except redis.exceptions.NoPermissionError:
            log.info("read-only Redis user: older ledgers are indexed by `costexporter keys migrate`")
            return
        except redis.RedisError as e:
            log.warning("incident index migration skipped: %s", e)
            return
        if n:
            log.warning("indexed %d incident hashes written before the index", n)
        try:
            n = store.build_rollups()
        except redis.RedisError as e:
            log.warning("ledger rollups not built: %s", e)
            return
        if n:
            log.warning("built the rollups of %d older ledgers", n)

    threading.Thread(target=run, name="costexporter-incident-index", daemon=True).start()


def serve_in_thread(app: Any, sock: socket.socket, limits: ServerLimits | None = None) -> None:
    """The API on a daemon thread beside an agent or the demo, which own the signals (SIGTERM)
    and the logging. `sock`: bound by the command when it checked its flags (options.bind_port),
    so the port cannot be lost between that check and this thread's start."""
    import threading

    import uvicorn

    from costexporter.api.server import ServerLimits, config

    host, port = sock.getsockname()[:2]
    cfg = config(app, host, port, limits or ServerLimits(), "warning", own_logging=False)
    server = uvicorn.Server(cfg)
    # The owner of the process handles SIGTERM (uvicorn.Server reads this attribute when it starts).
    server.install_signal_handlers = lambda: None  # type: ignore[attr-defined]
    threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="costexporter-api", daemon=True
    ).start()


def serve_forever(app: Any, listen: str, port: int, limits: ServerLimits | None = None) -> None:
    """The API in the foreground (`costexporter api`): uvicorn owns the signals and the logging
    (bounded: the same line at most once every few seconds)."""
    import gc

    import uvicorn

    from costexporter.api.server import ServerLimits, config

    server = uvicorn.Server(config(app, listen, port, limits or ServerLimits(), "info", own_logging=True))
    # What is alive now (the app, its routes and models, the imported libraries) lives as long as
    # the process: frozen out of the collector's full passes, which a large answer's new objects
    # (70,000 containers for /allocation at 10,000 jobs) would otherwise make walk all of it,
    # ~40% of that request's CPU. Garbage made later is collected as before.
    gc.collect()
    gc.freeze()
    server.run()
