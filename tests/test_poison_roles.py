"""A few poisons under each reader's least-privilege rule (tests/poison_roles.py); the whole
matrix, every trainer-writable key under every role, is `python bench/bench_poison.py`."""

from __future__ import annotations

import pytest

from .poison_roles import check
from .redis_server import RedisServer

CASES = [
    ("agent", "jobs_index"),
    ("agent", "events"),
    ("watcher", "events"),
    ("watcher", "beats"),
    ("api", "jobs_index"),
    ("api", "ranks"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = RedisServer(tmp_path_factory.mktemp("poison-redis")).start()
    yield s
    s.stop()


@pytest.mark.parametrize(("role", "poison"), CASES)
def test_a_reader_goes_on_past_a_poisoned_job_under_its_own_rule(server, role, poison):
    check(server.port, server.client(), role, poison)
