"""Liveness and readiness (Redis reachable)."""

from __future__ import annotations

import redis
from fastapi import APIRouter, HTTPException

from costexporter import __version__
from costexporter.api.deps import Store
from costexporter.api.schemas import Health

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
def healthz() -> Health:
    return Health(status="ok", version=__version__)


@router.get("/readyz", response_model=Health, responses={503: {"description": "Redis unreachable"}})
def readyz(s: Store) -> Health:
    try:
        s.ping()
    except redis.RedisError:
        raise HTTPException(503, "Redis is unreachable") from None
    return Health(status="ready", version=__version__)
