"""Shared by the API tests: the app served over real HTTP, and jobs written as the agent writes them."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator

import numpy as np
import redis
import uvicorn

from costexporter.api.app import create_app
from costexporter.api.auth import Tokens
from costexporter.core.attribution import GRANTABLE, Attribution
from costexporter.core.buckets import price_version
from costexporter.core.budgets import parse_budgets
from costexporter.core.cost import Prices
from costexporter.core.model import Category
from costexporter.store import keys, ledger
from costexporter.store.ledger_read import LedgerStore

from .redis_server import free_port

WINDOW = "2025-07-26T00:00:00Z,2025-07-28T00:00:00Z"
T0 = 1_753_531_200  # 2025-07-26T12:00:00Z
PRICE_VERSION = price_version(Prices(price_per_gpu_hour=3.5))


@contextlib.contextmanager
def served(store: LedgerStore, tokens: Tokens | None = None, **kw) -> Iterator[tuple[str, object]]:
    """The app under uvicorn in a thread on a free port: (base URL, app)."""
    app = create_app(store, tokens, **kw)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.config.port}", app
    finally:
        server.should_exit = True
        thread.join(10)


def write_job(
    r: redis.Redis, prefix: str, job: str, team: str | None, incidents: int = 1, **meta: str
) -> None:
    """A job with a registration, 2 hours of amounts, 10 steps and `incidents` incidents; its
    `team` and the owner and place keys of `meta` (cost_center, namespace, ...) as an agent
    attributes them by policy (the figures' `attr:` fields), the rest as the trainer's meta."""
    pipe = r.pipeline(transaction=True)
    pipe.zadd(keys.jobs_key(prefix), {job: T0 + 7200})
    owned = {"team": team} if team is not None else {}
    owned |= {k: v for k, v in meta.items() if k in GRANTABLE}
    data = {k: v for k, v in meta.items() if k not in GRANTABLE}
    if data:
        pipe.hset(keys.meta_key(prefix, job), mapping=data)
    if owned:
        values = tuple(
            (k, float(v) if k in ("budget", "price_per_gpu_hour") else v) for k, v in owned.items()
        )
        attr = Attribution(values, tuple((k, "policy rule 1") for k in owned))
        ledger.queue_attribution(pipe, prefix, job, attr)
    pipe.hset(keys.ranks_key(prefix, job), "0", json.dumps({"ts": T0, "host": "h", "gpu": 0}))
    a = np.zeros((len(Category), 3), np.int64)
    a[Category.PRODUCTIVE] = [3_600_000, 10**9, 3_500_000]
    a[Category.STALLED] = [360_000, 10**8, 350_000]
    ledger.queue_amounts(pipe, prefix, job, {T0: a, T0 + 3600: a}, PRICE_VERSION)
    pipe.zadd(keys.steps_key(prefix, job), {f"{i}:{100 * (i + 1)}": T0 + 60 * i for i in range(10)})
    incs = [
        {
            "category": "stalled",
            "start": (T0 + 1000 * i) * 1000,
            "end": (T0 + 1000 * i + 60) * 1000,
            "gpu_ms": 60_000,
            "ranks": [0],
            "host": f"{job}-host",
        }
        for i in range(incidents)
    ]
    ledger.queue_incidents(pipe, prefix, job, "agent-1", incs)
    pipe.execute()


def assert_no_server_error(store: LedgerStore, max_examples: int) -> int:
    """Every operation of the app's OpenAPI schema, driven through its Hypothesis strategy
    (schemathesis' pytest plugin does not run under pytest 9 yet): never a 5xx. Returns how
    many operations it drove."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    # budgets of each period and scope, so `/api/v1/budgets` is driven through its arithmetic
    budgets = parse_budgets(
        [
            {"name": "month", "amount": 100, "team": "*"},
            {"name": "quarter", "amount": 1e6, "period": "quarter", "job": "llm-*"},
            {"name": "rolling", "amount": 0.01, "period": "rolling:30d", "cluster": "*"},
        ]
    )
    schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(store, budgets=budgets))
    operations = [result.ok() for result in schema.get_all_operations()]
    for op in operations:

        @given(op.as_strategy())
        @settings(
            max_examples=max_examples, deadline=None, suppress_health_check=list(HealthCheck), database=None
        )
        def check(case):
            response = case.call()
            assert response.status_code < 500, (
                case.method,
                case.formatted_path,
                case.query,
                response.text[:300],
            )

        check()
    return len(operations)
