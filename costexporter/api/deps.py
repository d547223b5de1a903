"""The API's dependencies: its settings, the ledger, the caller and the window.

Everything a handler needs comes through `Depends`, so a test (or another deployment) can swap
any of them with `app.dependency_overrides`. The dependencies do no I/O and are `async`: FastAPI
would run a plain `def` in its thread pool, one hop per dependency per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from costexporter.api.auth import Principal, Tokens
from costexporter.api.cache import ResponseCache
from costexporter.api.export import FocusSettings
from costexporter.api.windows import ACCEPTED, Window, WindowError, parse_window
from costexporter.api.windows import PATTERN as WINDOW_PATTERN
from costexporter.core.budgets import Budget
from costexporter.core.carbon import GridIntensity
from costexporter.store.ledger_read import LedgerStore, Warnings


@dataclass
class ApiConfig:
    """What create_app was given, kept on `app.state.config`."""

    store: LedgerStore
    tokens: Tokens
    currency: str = "USD"
    tz: str = "UTC"
    cluster: str | None = None  # the cluster name of jobs whose meta names none (OpenCost's `cluster`)
    focus: FocusSettings = field(default_factory=FocusSettings)
    carbon: GridIntensity | None = None  # the grid's carbon intensity (the policy's); None: no carbon figures
    budgets: tuple[Budget, ...] = ()  # the policy's budgets (`core/budgets.py`)
    credit_causes: tuple[str, ...] = ()  # the policy's credited causes of wasted time
    cache: ResponseCache = field(default_factory=ResponseCache)


async def get_config(request: Request) -> ApiConfig:
    config: ApiConfig = request.app.state.config
    return config


Config = Annotated[ApiConfig, Depends(get_config)]


async def get_store(cfg: Config) -> LedgerStore:
    return cfg.store


bearer = HTTPBearer(
    auto_error=False,
    description="A token from the API's tokens file (`costexporter api --hash-token` makes its hash).",
)


async def principal(
    cfg: Config, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)] = None
) -> Principal:
    who = cfg.tokens.check(f"Bearer {credentials.credentials}" if credentials else None)
    if who is None:
        raise HTTPException(401, "a valid bearer token is required", headers={"WWW-Authenticate": "Bearer"})
    return who


async def window(
    cfg: Config,
    window: Annotated[
        str | None,
        # the pattern documents the syntax; parse_window checks it, with a 400 (never a 422)
        Query(description=ACCEPTED, max_length=120, json_schema_extra={"pattern": WINDOW_PATTERN}),
    ] = None,
) -> Window:
    try:
        return parse_window(window, cfg.tz)
    except WindowError as e:
        raise HTTPException(400, str(e)) from None


Store = Annotated[LedgerStore, Depends(get_store)]
Who = Annotated[Principal, Depends(principal)]
Win = Annotated[Window, Depends(window)]


def visible_job(
    job: str, who: Principal, s: LedgerStore, full: bool = False, warn: Warnings | None = None
) -> dict[str, Any]:
    """The job's info (all of it with `full`, else just its team), or 404: unknown, or outside the
    token's scope (as if absent)."""
    info: dict[str, Any] | None
    if full:  # existence, team and the rest of the info in one round trip
        info = s.job_info(job, warn)
        team = info["meta"].get("team") if info is not None else None
    else:
        exists, team = s.job_team(job)
        info = {"meta": {"team": team}} if exists else None
    if info is None or not who.sees(team):
        raise HTTPException(404, f"no job {job!r}")
    return info
