"""The finance API (FastAPI) under /api/v1: cost per valid step and wasted GPU-hours, per job, team
and window. Read-only. Money is a decimal string with 6 places; every response carries its
currency and the window it resolved to.

This module wires the parts together: settings and dependencies in `deps`, one router per
resource in `routers/`, response models in `schemas`, CSV/FOCUS in `export`.
"""

from __future__ import annotations

from typing import Any

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from fastapi_offline import FastAPIOffline

from costexporter import __version__
from costexporter.api.auth import Tokens
from costexporter.api.cache import DEFAULT_MAX_BYTES, ResponseCache
from costexporter.api.deps import ApiConfig
from costexporter.api.export import CSV_COLUMNS, FOCUS_COLUMNS, FOCUS_X, FocusSettings
from costexporter.api.format import by_category, iso, json_bytes, micro, money, per
from costexporter.api.routers import allocation, health, jobs, opencost
from costexporter.api.routers import budgets as budgets_router
from costexporter.api.schemas import *  # noqa: F403  (the models were importable from here)
from costexporter.core.budgets import Budget
from costexporter.core.carbon import GridIntensity
from costexporter.store.archive import ArchiveError
from costexporter.store.ledger_read import LedgerStore

__all__ = [
    "CSV_COLUMNS",
    "FOCUS_COLUMNS",
    "FOCUS_X",
    "FocusSettings",
    "by_category",
    "create_app",
    "iso",
    "json_bytes",
    "micro",
    "money",
    "per",
]


def create_app(
    store: LedgerStore,
    tokens: Tokens | None = None,
    currency: str = "USD",
    tz: str = "UTC",
    provider: str = "costexporter",
    cache_s: float = 5.0,
    cache_bytes: int = DEFAULT_MAX_BYTES,
    focus: FocusSettings | None = None,
    cluster: str | None = None,
    carbon: GridIntensity | None = None,
    budgets: tuple[Budget, ...] = (),
    credit_causes: tuple[str, ...] = (),
) -> FastAPI:
    """The app. `cache_s`: series responses are reused this long (dashboards poll the same
    ranges; 0 turns it off), in at most `cache_bytes` of response bodies. `focus`: the names the
    FOCUS export gives (default: `provider` for all of them). `cluster`: the cluster of jobs whose
    meta names none, in the OpenCost endpoint's `cluster` property. `carbon`: the grid's intensity
    (the policy's `carbon_intensity`); without it the carbon figures are null. `budgets`: the
    policy's, for `/api/v1/budgets`. `credit_causes`: the policy's, the incidents' credit line."""
    app = FastAPIOffline(  # Swagger UI and ReDoc served from the package: no CDN, air-gap safe
        title="costexporter finance API",
        version=__version__,
        description="Cost per valid step and wasted GPU-hours of training jobs, per window, job and team.",
        swagger_ui_parameters={"validatorUrl": None},  # no badge fetched from validator.swagger.io
    )
    app.state.config = ApiConfig(
        store=store,
        tokens=tokens or Tokens([]),
        currency=currency,
        tz=tz,
        cluster=cluster or None,
        focus=focus or FocusSettings(provider=provider),
        cache=ResponseCache(cache_s, cache_bytes),
        carbon=carbon,
        budgets=budgets,
        credit_causes=credit_causes,
    )

    # ---- errors: bad input is a 400, a Redis outage a 503, never a 500 ------------------------
    @app.exception_handler(RequestValidationError)
    async def bad_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
        msgs = "; ".join(f"{'.'.join(str(x) for x in e['loc'][1:])}: {e['msg']}" for e in exc.errors())
        return JSONResponse({"detail": f"bad parameter: {msgs}"}, status_code=400)

    @app.exception_handler(redis.RedisError)
    async def redis_down(_request: Request, exc: redis.RedisError) -> JSONResponse:
        return JSONResponse(
            {"detail": f"the ledger (Redis) is unreachable: {type(exc).__name__}"}, status_code=503
        )

    @app.exception_handler(ArchiveError)
    async def archive_unusable(_request: Request, exc: ArchiveError) -> JSONResponse:
        # a damaged or missing sealed file: no bill rather than a short one
        return JSONResponse({"detail": f"the archive cannot be read: {exc}"}, status_code=503)

    for module in (health, jobs, allocation, budgets_router, opencost):
        app.include_router(module.router)
    app.openapi = lambda: document_errors(app)  # type: ignore[method-assign]
    return app


ERRORS = {
    "400": "Bad input: a window, step, aggregate, format, cursor or limit the API cannot use.",
    "401": "No valid bearer token (only when the API has a tokens file).",
    "404": "No such job, or not one of the token's teams.",
    "503": "The ledger (Redis) is unreachable.",
}


def document_errors(app: FastAPI) -> dict[str, Any]:
    """The OpenAPI schema with the errors the API really answers (400, 401, 404, 503, each a
    `{"detail": "..."}` body) instead of FastAPI's 422, which it never sends."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    schema.setdefault("components", {}).setdefault("schemas", {})["Error"] = {
        "type": "object",
        "properties": {"detail": {"type": "string"}},
        "required": ["detail"],
    }
    for path, ops in schema.get("paths", {}).items():
        for op in ops.values():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            codes = []
            if op.get("parameters"):
                codes.append("400")
            if op.get("security"):
                codes.append("401")
            if "{job}" in path:
                codes.append("404")
            if path != "/healthz":
                codes.append("503")
            for code in codes:
                responses[code] = {
                    "description": responses.get(code, {}).get("description") or ERRORS[code],
                    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
                }
    schemas = schema["components"]["schemas"]
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    app.openapi_schema = schema
    return schema
