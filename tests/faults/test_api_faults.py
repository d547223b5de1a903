"""The finance API under hostile tokens files, job names and stored data.

Real Redis (a prefix per test), the real app over HTTP, the real CLI for startup failures."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import threading
import time
from urllib.parse import quote

import httpx
import pytest
import redis
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from costexporter.api.auth import TokenConfigError, Tokens, hash_token, parse_tokens
from costexporter.api.cache import ResponseCache
from costexporter.core.buckets import bucket_start
from costexporter.store import keys, ledger
from costexporter.store.ledger_read import LedgerStore

from ..api_helpers import T0, WINDOW, served, write_job
from ..conftest import ROOT, spawn_cli
from ..redis_server import RedisServer, free_port

DIGEST = hash_token("secret")


# ---- 13: auth fails closed ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "text", "says"),
    [
        ("empty.yaml", "", "not a mapping"),
        ("no-tokens.yaml", "tokens: []\n", "non-empty list"),
        ("typo.yaml", f"token:\n  - sha256: {DIGEST}\n    teams: '*'\n", "unknown key 'token'"),
        ("no-teams.yaml", f"tokens:\n  - name: a\n    sha256: {DIGEST}\n", "no 'teams'"),
        ("string-teams.yaml", f"tokens:\n  - sha256: {DIGEST}\n    teams: alpha\n", "non-empty list"),
        ("entry-typo.yaml", f"tokens:\n  - sha256: {DIGEST}\n    team: [a]\n", "unknown key 'team'"),
        ("empty.json", "{}", "non-empty list"),
        ("bad.yaml", "tokens: [\n", "cannot read"),
    ],
)
def test_an_unusable_tokens_file_stops_the_api_with_one_line(tmp_path, name, text, says):
    f = tmp_path / name
    f.write_text(text)
    port = free_port()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "costexporter.cli", "api", "--tokens-file", str(f), "--port", str(port)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=30,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the API started with {name!r} instead of refusing it")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in done.stderr, done.stderr
    assert "open to anyone" not in done.stderr


scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.text(max_size=5), st.just("*"), st.just(DIGEST)
)
documents = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(
            st.sampled_from(["tokens", "token", "name", "sha256", "teams", "team"]), inner, max_size=4
        ),
    ),
    max_leaves=12,
)


@given(documents)
def test_any_document_either_fails_or_scopes_every_token_explicitly(data):
    """Whatever the file holds: a refusal, or a non-empty list of tokens each with the teams it names."""
    try:
        entries = parse_tokens(data)
    except ValueError:
        return
    assert entries
    for (_name, _digest, scope), raw in zip(entries, data["tokens"], strict=True):
        assert raw["teams"] == "*" if scope is None else scope == frozenset(raw["teams"])


def test_a_good_tokens_file_loads(tmp_path):
    f = tmp_path / "t.yaml"
    f.write_text(f"tokens:\n  - name: fin\n    sha256: {DIGEST}\n    teams: '*'\n")
    assert Tokens.load(f).check("Bearer secret").all_teams
    with pytest.raises(TokenConfigError):
        Tokens.load(tmp_path / "missing.yaml")


@pytest.fixture
def r(shared):
    return shared


def get(base: str, path: str, token: str | None = None, **params) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.get(base + path, params=params, headers=headers, timeout=30)


# ---- 14: no SCAN pattern, no leak ------------------------------------------------------------------
@pytest.mark.parametrize("name", ["j*", "?obB", "[jo]*", "job\\A"])
def test_a_glob_job_name_sees_only_its_own_incidents(r, prefix, tmp_path, name):
    write_job(r, prefix, "jobA", "a", incidents=3)
    write_job(r, prefix, "jobB", "a", incidents=2)
    write_job(r, prefix, name, "b", incidents=1)
    f = tmp_path / "t.yaml"
    f.write_text(f"tokens:\n  - sha256: {hash_token('b')}\n    teams: [b]\n")
    with served(LedgerStore(r, prefix), Tokens.load(f)) as (base, _):
        got = get(base, f"/api/v1/jobs/{quote(name, safe='')}/incidents", "b", window=WINDOW)
        assert got.status_code == 200, got.text
        incs = got.json()["incidents"]
        assert len(incs) == 1 and incs[0]["hosts"] == [f"{name}-host"], incs
        assert get(base, "/api/v1/jobs/jobA/incidents", "b", window=WINDOW).status_code == 404


def test_incidents_are_read_without_scan(tmp_path):
    """A private Redis: the request path sends no SCAN (INFO commandstats counts every command)."""
    server = RedisServer(tmp_path / "redis").start()
    try:
        c = server.client()
        write_job(c, "p", "jobA", "a", incidents=5)
        with served(LedgerStore(c, "p")) as (base, _):
            got = get(base, "/api/v1/jobs/jobA/incidents", window=WINDOW)
            assert got.status_code == 200 and len(got.json()["incidents"]) == 5
            for path in ("/api/v1/jobs", "/api/v1/jobs/jobA", "/api/v1/allocation"):
                assert get(base, path, window=WINDOW).status_code == 200
        stats = c.info("commandstats")
        assert "cmdstat_hvals" in stats and "cmdstat_scan" not in stats, sorted(stats)
    finally:
        server.stop()


def test_incidents_written_before_the_index_are_indexed_once(r, prefix):
    """Migration: hashes without an index entry are found by one SCAN (at startup), and only this
    prefix's (a prefix with glob characters matches only itself)."""
    odd = prefix + "[x]"
    for p in (prefix, odd, prefix + "x"):
        r.zadd(keys.jobs_key(p), {"old": T0})
        inc = {"category": "idle", "start": T0 * 1000, "end": (T0 + 60) * 1000, "gpu_ms": 1, "ranks": [0]}
        r.hset(keys.incidents_key(p, "old", "agent-0"), "idle:1", json.dumps(inc))
    try:
        store = LedgerStore(r, odd)
        assert store.incidents("old", T0 - 3600, T0 + 3600) == []
        assert store.index_incidents() == 1
        assert [i["category"] for i in store.incidents("old", T0 - 3600, T0 + 3600)] == ["idle"]
        assert r.smembers(keys.incident_index_key(prefix, "old")) == set()
    finally:
        for p in (odd, prefix + "x"):
            r.delete(*r.keys(p.replace("[", "\\[").replace("]", "\\]") + ":*"))


def test_the_api_indexes_old_incidents_at_start(r, prefix):
    """`costexporter api` itself runs the migration at start: an incident written without the
    index appears on /incidents without anyone running anything else."""
    write_job(r, prefix, "legacy", "a", incidents=0)
    inc = {"category": "idle", "start": T0 * 1000, "end": (T0 + 60) * 1000, "gpu_ms": 60_000, "ranks": [0]}
    r.hset(keys.incidents_key(prefix, "legacy", "old-agent"), "idle:1", json.dumps(inc))
    port = free_port()
    proc = spawn_cli(
        "api",
        "--prefix",
        prefix,
        "--port",
        str(port),
        "--listen",
        "127.0.0.1",
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                got = httpx.get(
                    f"http://127.0.0.1:{port}/api/v1/jobs/legacy/incidents", params={"window": WINDOW}
                )
                if got.status_code == 200 and got.json()["incidents"]:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the old incident never appeared"
            time.sleep(0.2)
        assert [i["category"] for i in got.json()["incidents"]] == ["idle"]
    finally:
        proc.terminate()
        proc.wait(10)


# ---- 15: never a 500 from stored data --------------------------------------------------------------
BAD_STORED = [
    ("budget 5k", lambda r, p, j: r.hset(keys.meta_key(p, j), "budget", "5k"), "budget"),
    ("budget inf", lambda r, p, j: r.hset(keys.meta_key(p, j), "budget", "inf"), "budget"),
    ("budget nan", lambda r, p, j: r.hset(keys.meta_key(p, j), "budget", "NaN"), "budget"),
    ("ranks ts null", lambda r, p, j: r.hset(keys.ranks_key(p, j), "1", '{"ts": null}'), "ranks"),
    ("ranks ts inf", lambda r, p, j: r.hset(keys.ranks_key(p, j), "1", '{"ts": 1e400}'), "ranks"),
    ("ranks a list", lambda r, p, j: r.hset(keys.ranks_key(p, j), "1", "[1, 2]"), "ranks"),
    ("ranks not json", lambda r, p, j: r.hset(keys.ranks_key(p, j), "1", "{nope"), "ranks"),
    (
        "preflight not json",
        lambda r, p, j: r.hset(keys.figures_key(p, j), "preflight", "{"),
        "preflight",
    ),
    (
        "preflight a list",
        lambda r, p, j: r.hset(keys.figures_key(p, j), "preflight", "[]"),
        "preflight",
    ),
    (
        "valid_steps text",
        lambda r, p, j: r.hset(keys.figures_key(p, j), "valid_steps", "x"),
        "valid_steps",
    ),
    (
        "checkpoint inf",
        lambda r, p, j: r.hset(keys.figures_key(p, j), "last_checkpoint_ts", "inf"),
        "last_checkpoint",
    ),
    # Buckets are summed where a ledger has no rollup (written before rollups existed): the
    # rollup is removed with the damage. (A rollup is never rebuilt from damaged buckets: see
    # test_api_rollup.py.)
    (
        "bucket text",
        lambda r, p, j: (
            ledger.drop_rollup(r, p, j),
            r.hset(keys.bucket_key(p, j, "1h", str(T0 // 3600 * 3600)), "productive:ms", "abc"),
        ),
        "amounts",
    ),
    (
        "total text",
        lambda r, p, j: r.hset(keys.total_key(p, j), "productive:ucost", "1e999"),
        "amounts",
    ),
    (
        "total 40 digits",
        lambda r, p, j: r.hset(keys.total_key(p, j), "productive:ucost", "9" * 40),
        "amounts",
    ),
    (
        "bucket 40 digits",
        lambda r, p, j: (
            ledger.drop_rollup(r, p, j),
            r.hset(keys.bucket_key(p, j, "1h", T0 // 3600 * 3600), "productive:ms", "9" * 40),
        ),
        "amounts",
    ),
    (
        "bucket wrong type",
        lambda r, p, j: (
            ledger.drop_rollup(r, p, j),
            r.delete(k := keys.bucket_key(p, j, "1d", str(T0 // 86400 * 86400))),
            r.set(k, "x"),
        ),
        "amounts",
    ),
    (
        "meta wrong type",
        lambda r, p, j: (r.delete(keys.meta_key(p, j)), r.set(keys.meta_key(p, j), "x")),
        "meta",
    ),
    (
        "steps wrong type",
        lambda r, p, j: (r.delete(k := keys.steps_key(p, j)), r.set(k, "x")),
        "step",
    ),
    (
        "step member",
        lambda r, p, j: r.zadd(keys.steps_key(p, j), {"garbage": T0 + 7000}),
        "step member",
    ),
    (
        "incident garbage",
        lambda r, p, j: r.hset(keys.incidents_key(p, j, "agent-1"), "x", '{"category": 1}'),
        "incident",
    ),
    (
        "incident zero_util_ranks garbage",
        lambda r, p, j: r.hset(
            keys.incidents_key(p, j, "agent-1"),
            "x",
            json.dumps(
                {
                    "category": "stalled",
                    "start": T0 * 1000,
                    "end": T0 * 1000 + 1,
                    "gpu_ms": 1,
                    "ranks": [0],
                    "zero_util_ranks": ["0"],
                }
            ),
        ),
        "incident",
    ),
    (
        "incident deep JSON",
        lambda r, p, j: r.hset(keys.incidents_key(p, j, "agent-1"), "x", "[" * 200_000 + "]" * 200_000),
        "incident",
    ),
    (
        "incident deep object",
        lambda r, p, j: r.hset(
            keys.incidents_key(p, j, "agent-1"),
            "y",
            '{"category": ' + '{"a": ' * 100_000 + "1" + "}" * 100_001,
        ),
        "incident",
    ),
    (
        "incident index type",
        lambda r, p, j: (r.delete(k := keys.incident_index_key(p, j)), r.set(k, "x")),
        "incident index",
    ),
    ("newest event inf", lambda r, p, j: r.zadd(keys.jobs_key(p), {j: float("inf")}), "not a time"),
]


@pytest.mark.parametrize(("case", "spoil", "says"), BAD_STORED, ids=[c[0] for c in BAD_STORED])
def test_bad_stored_values_are_skipped_and_reported(r, prefix, case, spoil, says):
    write_job(r, prefix, "good", "a")
    write_job(r, prefix, "bad", "a", budget="100")
    spoil(r, prefix, "bad")
    with served(LedgerStore(r, prefix)) as (base, _):
        listed = get(base, "/api/v1/jobs")
        assert listed.status_code == 200, listed.text
        assert {j["job"] for j in listed.json()["jobs"]} == {"good", "bad"}  # the healthy job is there
        warned = list(listed.json()["warnings"])
        for path in (
            "/api/v1/jobs/bad",
            "/api/v1/jobs/bad/series",
            "/api/v1/jobs/bad/incidents",
            "/api/v1/allocation",
        ):
            got = get(base, path, window=WINDOW)
            assert got.status_code == 200, (path, got.text)
            warned += got.json()["warnings"]
        for fmt in ("csv", "focus"):
            assert get(base, "/api/v1/allocation", window=WINDOW, format=fmt).status_code == 200
        assert any(w.startswith("bad: ") and says in w for w in warned), warned
        assert not any(w.startswith("good: ") for w in warned)
        good = get(base, "/api/v1/jobs/good", window=WINDOW).json()
        assert good["cost"] == "7.700000" and good["valid_steps"] == 10 and good["warnings"] == []


@pytest.mark.parametrize(
    "window",
    [
        "9999-01-01T00:00:00Z,9999-12-31T23:59:59Z",
        "9999-12-31T23:00:00Z,9999-12-31T23:59:59.9Z",
        "1969-01-01T00:00:00Z,1969-02-01T00:00:00Z",
        "99999999999,99999999999.5",
        "0001-01-01T00:00:00+14:00,0001-01-02T00:00:00Z",
    ],
)
def test_a_window_outside_the_calendar_is_a_400(r, prefix, window):
    write_job(r, prefix, "good", "a")
    with served(LedgerStore(r, prefix)) as (base, _):
        for path in ("/api/v1/jobs/good", "/api/v1/jobs/good/series", "/api/v1/allocation"):
            got = get(base, path, window=window)
            detail = got.json()["detail"]
            assert got.status_code == 400 and ("window" in detail or "time" in detail), detail


def bucket(p: str, j: str, res: str) -> str:
    return keys.bucket_key(p, j, res, bucket_start(T0, res))


# Every key of a job the API reads, by name (the builder for the key of job `j` under prefix `p`).
JOB_KEYS = {
    "meta": keys.meta_key,
    "ranks": keys.ranks_key,
    "status": keys.status_key,
    "ledger:job": keys.figures_key,
    "ledger:total": keys.total_key,
    "ledger:steps": keys.steps_key,
    "ledger:voids": keys.voids_key,
    "ledger:incidents": keys.incident_index_key,
    "ledger:incidents:agent-1": lambda p, j: keys.incidents_key(p, j, "agent-1"),
    **{f"ledger:{res}": functools.partial(bucket, res=res) for res in ("1h", "1d", "5m", "1w")},
}
KEY_SUFFIXES = list(JOB_KEYS)
values = st.one_of(
    st.text(max_size=12),
    st.integers(),
    st.floats(allow_nan=True),
    st.sampled_from(
        [
            "inf",
            "-inf",
            "nan",
            "5k",
            "null",
            "[]",
            "{}",
            '{"ts": null}',
            '{"state": []}',
            '{"category": "idle"}',
            '{"category":"idle","start":1e30,"end":1e31,"gpu_ms":1,"ranks":[0]}',
            "1e999",
            "",
            "agent-1",
        ]
    ),
).map(str)
garbage = st.lists(
    st.tuples(
        st.sampled_from(KEY_SUFFIXES),
        st.sampled_from(["hash", "string", "zset", "set", "list"]),
        st.dictionaries(
            st.one_of(
                st.sampled_from(
                    [
                        "team",
                        "budget",
                        "ts",
                        "productive:ms",
                        "voided:idle:ucost",
                        "price_version",
                        "valid_steps",
                        "preflight",
                        "last_checkpoint_ts",
                        "profile",
                        "0",
                        "idle:1",
                    ]
                ),
                st.text(max_size=6),
            ),
            values,
            min_size=1,
            max_size=4,
        ),
    ),
    min_size=1,
    max_size=6,
)


def _decimal(v: str) -> bool:
    """Whether `v` is a plain decimal number (str.isdigit also takes '²', which float refuses)."""
    digits = v.replace(".", "", 1)
    return digits.isascii() and digits.isdigit()


def spoil(r: redis.Redis, prefix: str, job: str, writes) -> None:
    for suffix, kind, mapping in writes:
        k = JOB_KEYS[suffix](prefix, job)
        r.delete(k)
        if kind == "hash":
            r.hset(k, mapping=mapping)
        elif kind == "string":
            r.set(k, next(iter(mapping.values())))
        elif kind == "zset":
            r.zadd(k, {m: (float(v) if _decimal(v) else T0) for m, v in mapping.items()})
        elif kind == "set":
            r.sadd(k, *mapping.values())
        else:
            r.rpush(k, *mapping.values())


def test_fuzzed_requests_over_fuzzed_stored_data_never_get_a_5xx(r, prefix):
    """Hypothesis writes garbage into a job's keys (any key, any type, any value), schemathesis
    generates requests from the OpenAPI schema, and every answer over real HTTP is below 500."""
    write_job(r, prefix, "good", "a")
    store = LedgerStore(r, prefix)
    with served(store, cache_s=0) as (base, app):
        schema = schemathesis.openapi.from_asgi("/openapi.json", app)
        operations = [result.ok() for result in schema.get_all_operations()]
        cases = st.sampled_from(operations).flatmap(lambda op: op.as_strategy())
        fixed = st.sampled_from(
            [
                "/api/v1/jobs",
                "/api/v1/jobs/victim",
                "/api/v1/jobs/victim/series",
                "/api/v1/jobs/victim/incidents",
                "/api/v1/allocation",
            ]
        )

        @given(
            garbage,
            cases,
            fixed,
            st.sampled_from([WINDOW, "30d", "month", None]),
            st.sampled_from(["job", "team", "json", "csv", "focus"]),
        )
        @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(writes, case, path, window, choice):
            r.delete(*[build(prefix, "victim") for build in JOB_KEYS.values()])
            write_job(r, prefix, "victim", "a")
            spoil(r, prefix, "victim", writes)
            params = {"window": window} if window else {}
            if choice in ("csv", "focus", "json"):
                params["format"] = choice
            else:
                params["aggregate"] = choice
            for resp in (httpx.get(base + path, params=params, timeout=30), case.call(base_url=base)):
                assert resp.status_code < 500, (writes, path, params, resp.status_code, resp.text[:300])

        check()


# ---- 16: bounded memory ----------------------------------------------------------------------------
def test_many_distinct_series_keep_the_cache_under_its_bound(r, prefix):
    write_job(r, prefix, "good", "a")
    bound = 1_000_000
    with served(LedgerStore(r, prefix), cache_bytes=bound, cache_s=600) as (base, app):
        cache = app.state.config.cache
        sizes = []
        for i in range(80):  # about 100 kB each: 80 of them would be 8 MB
            start = T0 - 86400 * 30 + 3600 * i
            got = get(base, "/api/v1/jobs/good/series", window=f"{start},{start + 86400 * 30}", step="1h")
            assert got.status_code == 200
            assert cache.size_bytes <= bound
            sizes.append(len(got.content))
        assert sum(sizes) > 5 * bound
        assert 0 < len(cache) < 80 and cache.locks == 0
        for i in range(50):  # refused requests take no lock and no cache entry
            got = get(
                base, "/api/v1/jobs/good/series", window=f"{T0 - 86400 * 300 + i * 300},{T0}", step="5m"
            )
            assert got.status_code == 400
        assert cache.locks == 0 and cache.size_bytes <= bound


@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 5000)), max_size=200), st.integers(1, 20_000))
def test_the_cache_never_holds_more_than_its_bound(ops, bound):
    from fastapi.responses import Response

    cache = ResponseCache(ttl_s=1e9, max_bytes=bound)
    for key, size in ops:
        body = cache.get(key, lambda size=size: Response(b"x" * size)).body
        assert cache.size_bytes <= bound and cache.locks == 0
        assert cache.size_bytes == sum(len(v[1].body) for v in cache._items.values())
        assert cache.get(key, lambda: Response(b"other")).body == body or size > bound
    # Also with no operations at all (hypothesis draws an empty list too): nothing held, no lock.
    assert cache.size_bytes == sum(len(v[1].body) for v in cache._items.values()) <= bound
    assert cache.locks == 0


def test_one_computation_per_key_while_others_wait():
    from fastapi.responses import Response

    cache = ResponseCache(ttl_s=60)
    calls = []

    def slow() -> Response:
        calls.append(1)
        time.sleep(0.2)
        return Response(b"body")

    threads = [threading.Thread(target=cache.get, args=("k", slow)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and cache.locks == 0


def test_a_failed_computation_is_not_cached_and_a_stale_answer_never_waits():
    """A compute that raises (Redis down) leaves no entry and no lock; while one request refreshes
    a stale entry, another gets the previous answer at once instead of waiting for it."""
    from fastapi.responses import Response

    def down() -> Response:
        raise redis.ConnectionError("down")

    cache = ResponseCache(ttl_s=0.05)
    with pytest.raises(redis.ConnectionError):
        cache.get("k", down)
    assert len(cache) == 0 and cache.locks == 0
    assert cache.get("k", lambda: Response(b"old")).body == b"old"
    time.sleep(0.1)  # stale now
    started, release = threading.Event(), threading.Event()

    def slow() -> Response:
        started.set()
        release.wait(10)
        return Response(b"new")

    refresher = threading.Thread(target=cache.get, args=("k", slow))
    refresher.start()
    try:
        assert started.wait(10)
        assert cache.get("k", down).body == b"old"
        assert refresher.is_alive()  # served stale without waiting for the refresh in flight
    finally:
        release.set()
        refresher.join(10)
    assert cache._items["k"][1].body == b"new" and cache.locks == 0


# ---- 17: job names with "/" ------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["a/b", "team/run/7", "a/b/c"])
def test_a_job_name_with_a_slash_is_reachable(r, prefix, name):
    write_job(r, prefix, name, "a", incidents=2)
    write_job(r, prefix, "a", "a")
    with served(LedgerStore(r, prefix)) as (base, _):
        assert name in {j["job"] for j in get(base, "/api/v1/jobs").json()["jobs"]}
        for path in (f"/api/v1/jobs/{name}", f"/api/v1/jobs/{quote(name, safe='')}"):
            got = get(base, path, window=WINDOW)
            assert got.status_code == 200 and got.json()["job"] == name and got.json()["valid_steps"] == 10
        series = get(base, f"/api/v1/jobs/{name}/series", window=WINDOW)
        assert series.status_code == 200 and series.json()["job"] == name
        incs = get(base, f"/api/v1/jobs/{name}/incidents", window=WINDOW)
        assert incs.status_code == 200 and len(incs.json()["incidents"]) == 2


def test_bytes_that_are_not_utf8_in_a_trainer_writable_key_never_break_the_api(r, prefix):
    """The jobs set and a job's meta hash take any bytes a trainer's ACL writes. The API's client
    (as `costexporter api` builds it) reads them as U+FFFD instead of failing every request."""
    from costexporter.store import redisconn

    from ..conftest import SHARED_URL

    write_job(r, prefix, "good", "a")
    write_job(r, prefix, "bad", "a")
    raw = redis.Redis.from_url(SHARED_URL)
    raw.zadd(keys.jobs_key(prefix), {b"j\xff\xfe": T0 + 7200})
    raw.hset(keys.meta_key(prefix, "bad"), mapping={"team": b"t\xff", b"\xfe": b"1"})
    client = redisconn.from_url(SHARED_URL, decode_responses=True, socket_timeout=5)
    with served(LedgerStore(client, prefix)) as (base, _):
        for path in ("/api/v1/jobs", "/api/v1/allocation", "/api/v1/jobs/good", "/api/v1/jobs/bad"):
            got = get(base, path, window=WINDOW)
            assert got.status_code == 200, (path, got.text)
        listed = {j["job"] for j in get(base, "/api/v1/jobs").json()["jobs"]}
        assert {"good", "bad"} <= listed
        good = get(base, "/api/v1/jobs/good", window=WINDOW).json()
        assert good["cost"] == "7.700000" and good["valid_steps"] == 10
