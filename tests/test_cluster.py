"""Redis Cluster: the trainer client, a real agent process, the watcher and the finance API against a
real local 3-master cluster give the same ledger and the same answers as on a single Redis.

The same two jobs (and a spare GPU nobody registered) are booked by one `costexporter serve` per
backend; the ledgers must both equal the offline replay to the millisecond, and every API answer
on the cluster must equal the single Redis's.
"""

from __future__ import annotations

import json
import re
import time
import uuid

import numpy as np
import pytest
import redis
from fastapi.testclient import TestClient
from redis.exceptions import RedisClusterException

from costexporter.api.app import create_app
from costexporter.core.buckets import RESOLUTIONS
from costexporter.services.watcher import WatchConfig, Watcher
from costexporter.store import acl, keys, ledger, protocol, redisconn
from costexporter.store.ledger_read import LedgerStore
from costexporter.store.reader import EventReader
from costexporter.trainer.reporter import StepReporter

from .api_helpers import WINDOW
from .conftest import SHARED_URL, drop_prefix
from .redis_cluster import RedisCluster
from .redis_server import free_port
from .test_agent import offline_ms
from .test_api import book_two_jobs


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = RedisCluster(tmp_path_factory.mktemp("cluster")).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def backends(cluster, tmp_path_factory):
    """The same data booked on the shared single Redis and on the cluster."""
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    out = {
        "single": book_two_jobs(SHARED_URL, prefix, tmp_path_factory.mktemp("single")),
        "cluster": book_two_jobs(cluster.url, prefix, tmp_path_factory.mktemp("clustered")),
    }
    yield out
    r = redis.Redis.from_url(SHARED_URL)
    drop_prefix(r, prefix)


def test_the_cluster_url_forms_and_their_errors():
    assert redisconn.is_cluster_url("redis+cluster://h:7000")
    assert redisconn.is_cluster_url("rediss+cluster://h:7000")
    assert redisconn.is_cluster_url("redis://h:7000/0?cluster=true")
    assert not redisconn.is_cluster_url("redis://h:7000/0")
    assert not redisconn.is_cluster_url("redis://h:7000/0?cluster=no")
    base, seeds = redisconn._cluster_parts(
        "redis+cluster://u:p%40ss@h1:7000,h2:7001/0?ssl_ca_certs=/x&cluster=1"
    )
    assert base == "redis://u:p%40ss@h1:7000?ssl_ca_certs=%2Fx" and seeds == [("h1", 7000), ("h2", 7001)]
    with pytest.raises(ValueError, match="only database 0"):
        redisconn._cluster_parts("redis+cluster://h:7000/3")
    # The other callers keep getting a plain client for a plain URL.
    assert isinstance(redisconn.from_url(SHARED_URL), redis.Redis)


def test_an_unreachable_cluster_is_a_connection_error_and_a_trainer_still_starts(tmp_path):
    url = f"redis+cluster://127.0.0.1:{free_port()}"
    client = redisconn.from_url(url, socket_connect_timeout=0.2)  # connects on first use, not here
    with pytest.raises(redis.ConnectionError):
        client.ping()
    # The trainer's reporter starts while the cluster is down, and spools instead of failing.
    rep = StepReporter("down-job", url, rank=0, world_size=1, spool_dir=tmp_path, socket_timeout_s=0.2)
    rep.step(1)
    rep.close()
    assert list(tmp_path.glob("*.jsonl")), "the events were not spooled"


def test_every_key_is_in_its_jobs_slot_or_one_of_the_few_cross_job_keys(backends):
    """A job's transaction spans only its hash tag; the keys outside any job are few and known."""
    b = backends["cluster"]
    keys = list(b["redis"].scan_iter(match=f"{b['prefix']}:*"))
    assert keys
    p = re.escape(b["prefix"])
    cross_job = re.compile(
        rf"^{p}:(t:jobs|t:registrations|a:epoch|a:keyspace|a:node:[^{{}}]+|a:gpu:[^{{}}]+:idle|a:agentid:[^{{}}]+)$"
    )
    tagged = re.compile(rf"^{p}:[tarw]:\{{([^{{}}]+)\}}:")
    odd = [k for k in keys if not tagged.match(k) and not cross_job.match(k)]
    assert odd == []
    assert {tagged.match(k).group(1) for k in keys if tagged.match(k)} >= {
        "llm-run",
        "vision-run",
        "_unassigned",
    }


@pytest.mark.parametrize("backend", ["single", "cluster"])
def test_the_agent_stored_its_fold_and_trimmed_the_streams(backends, backend):
    """The fold stored with the watermark, the reader position and the stream trimmed below it:
    single-key writes in the job's slot, the same on a cluster (the ledger, checked beside, is
    the offline replay's)."""
    b = backends[backend]
    r, prefix, agent = b["redis"], b["prefix"], b["agent"]
    assert b["jobs"], "no jobs were booked"
    for name, trace in b["jobs"].items():
        assert r.exists(keys.fold_key(prefix, name, agent)), name
        pos = json.loads(r.hget(keys.readers_key(prefix, name), f"agent:{agent}"))
        first = r.xrange(keys.stream_key(prefix, name), count=1)
        assert first and first[0][0] == pos["id"], name  # trimmed exactly below the position
        assert r.xlen(keys.stream_key(prefix, name)) < len(trace.events), name


@pytest.mark.parametrize("backend", ["single", "cluster"])
def test_the_ledger_equals_the_offline_replay(backends, backend):
    b = backends[backend]
    r, prefix = b["redis"], b["prefix"]
    assert b["jobs"], "no jobs were booked"
    for name, trace in b["jobs"].items():
        expected, offline = offline_ms(trace)
        total = ledger.read_amounts(r, prefix, name)
        assert ledger.net_ms(total) == expected, name  # to the millisecond
        figures = r.hgetall(keys.figures_key(prefix, name))
        assert int(figures["steps_completed"]) == len(offline.timeline.steps)
        for res in ("5m", "1h", "1d"):  # the rollups hold the same amounts as the total
            got: dict[str, int] = {}
            for s in r.zrange(keys.index_key(prefix, name, res), 0, -1):
                for f, v in ledger.read_amounts(r, prefix, name, res, int(s)).items():
                    got[f] = got.get(f, 0) + v
            assert got and got == total, (name, res)


def _close(a: dict[str, int], b: dict[str, int]) -> bool:
    """Amounts hashes equal: GPU-milliseconds exactly; millijoules and micro-cost to their
    rounding, which each round does once per bucket (the rounds fall where each run's timing puts
    them, so two runs of the same files differ by a few units there, on any backend)."""
    if a.keys() != b.keys():
        return False
    return all(
        a[f] == b[f] if f.endswith(":ms") else abs(a[f] - b[f]) <= max(10, 1e-5 * abs(b[f])) for f in a
    )


def test_the_cluster_ledger_is_the_single_redis_ledger(backends):
    """Every amount, figure, step and incident of every job (and the unassigned pool's)."""
    s, c = backends["single"], backends["cluster"]

    def dump(b: dict, job: str) -> dict:
        r, p = b["redis"], b["prefix"]
        incidents = [json.loads(v) for v in r.hvals(keys.incidents_key(p, job, b["agent"]))]
        return {
            "figures": r.hgetall(keys.figures_key(p, job)),
            "steps": r.zrange(keys.steps_key(p, job), 0, -1, withscores=True),
            "voids": r.zrange(keys.voids_key(p, job), 0, -1, withscores=True),
            "incidents": sorted((i["category"], i["start"], i["end"], i["gpu_ms"]) for i in incidents),
            "buckets": {res: r.zrange(keys.index_key(p, job, res), 0, -1) for res in RESOLUTIONS},
        }

    for job in [*s["jobs"], ledger.UNASSIGNED_JOB]:
        assert dump(c, job) == dump(s, job), job
        assert _close(
            ledger.read_amounts(c["redis"], c["prefix"], job),
            ledger.read_amounts(s["redis"], s["prefix"], job),
        ), job


API_CALLS = [
    ("/api/v1/jobs", {}),
    ("/api/v1/jobs", {"team": "vision"}),
    ("/api/v1/jobs/llm-run", {"window": WINDOW}),
    ("/api/v1/jobs/vision-run", {"window": WINDOW}),
    ("/api/v1/jobs/llm-run/series", {"window": WINDOW, "step": "5m"}),
    ("/api/v1/jobs/llm-run/series", {"window": WINDOW, "step": "1h"}),
    ("/api/v1/jobs/llm-run/incidents", {"window": WINDOW}),
    ("/api/v1/allocation", {"window": WINDOW}),
    ("/api/v1/allocation", {"window": WINDOW, "aggregate": "team"}),
    ("/api/v1/allocation", {"window": WINDOW, "format": "csv"}),
]


def _api(url: str, prefix: str) -> TestClient:
    return TestClient(create_app(LedgerStore(redisconn.from_url(url, decode_responses=True), prefix)))


@pytest.fixture(scope="module")
def mirrored(backends, cluster):
    """The single Redis's ledger copied key by key (DUMP/RESTORE) into the cluster under a prefix
    of its own: the same bytes on both backends, so every API answer must be byte-identical."""
    prefix = backends["single"]["prefix"]
    src, dst = redis.Redis.from_url(SHARED_URL), redisconn.from_url(cluster.url)
    new = f"test-{uuid.uuid4().hex[:12]}"
    n = 0
    for k in src.scan_iter(f"{prefix}:*"):
        ttl, data = src.pttl(k), src.dump(k)
        if data is not None:
            dst.restore(new.encode() + k[len(prefix) :], max(ttl, 0), data, replace=True)
            n += 1
    assert n > 20
    return new


@pytest.mark.parametrize(("path", "params"), API_CALLS)
def test_the_api_answers_the_same_on_the_cluster(backends, mirrored, cluster, path, params):
    single = _api(SHARED_URL, backends["single"]["prefix"]).get(path, params=params)
    clustered = _api(cluster.url, mirrored).get(path, params=params)
    assert single.status_code == clustered.status_code == 200, clustered.text
    assert clustered.text == single.text


def test_the_agents_own_api_and_allocation_on_the_cluster(backends):
    """The API over what the agent booked on the cluster: the same GPU-hours as on one Redis."""
    s, c = backends["single"], backends["cluster"]
    assert c["over_http"]["by_category"]["gpu_hours"] == s["over_http"]["by_category"]["gpu_hours"]
    got = {}
    for name, b in backends.items():
        body = _api(b["url"], b["prefix"]).get("/api/v1/allocation", params={"window": WINDOW}).json()
        got[name] = {r["key"]: r["gpu_hours"] for r in body["rows"]}
    assert set(got["cluster"]) == {"llm-run", "vision-run", "unassigned"}
    assert got["cluster"] == got["single"]
    assert got["cluster"]["unassigned"] == pytest.approx(c["offline_unassigned_h"], abs=2 / 3600)


def test_the_watcher_judges_the_same_on_the_cluster(backends):
    """Both jobs ended: the watcher on either backend says done, with the same reasons."""
    states = {}
    for name, b in backends.items():
        end = max(e.ts for t in b["jobs"].values() for e in t.events)
        w = Watcher(
            WatchConfig(
                redis_url=b["url"], prefix=b["prefix"], jobs=tuple(b["jobs"]), clock=lambda e=end: e + 5
            )
        )
        states[name] = {j: (st.state, st.reason) for j, st in w.poll().items()}
        assert w.redis_up and all(s == "done" for s, _ in states[name].values()), states[name]
    assert states["cluster"] == states["single"]


def test_a_trainer_posts_to_the_cluster_and_the_watcher_sees_it_run_and_hang(cluster, tmp_path):
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    job = f"{prefix}-job"
    clock = [time.time()]
    rep = StepReporter(
        job,
        cluster.url,
        rank=0,
        world_size=1,
        prefix=prefix,
        spool_dir=tmp_path,
        heartbeat_s=0.2,
        clock=lambda: clock[0],
    )
    from costexporter.core.booking import BookingConfig

    w = Watcher(
        WatchConfig(
            redis_url=cluster.url,
            prefix=prefix,
            booking=BookingConfig(stall_floor_s=5.0),
            heartbeat_timeout_s=30.0,
            clock=lambda: clock[0],
        )
    )
    try:
        for s in range(1, 6):
            clock[0] += 1
            rep.step(s, tokens=100)
        assert rep.flush(5)
        r = redisconn.from_url(cluster.url, decode_responses=True)
        types = [e.type for e in EventReader(r, job, prefix).read_all()]  # (steps go out batched)
        assert types.count("step") == 5 and types[0] == "register"
        assert json.loads(r.hget(keys.ranks_key(prefix, job), "0"))["world_size"] == "1"
        assert r.zscore(keys.jobs_key(prefix), job) == pytest.approx(clock[0], abs=1)
        assert w.poll()[job].state == "running"
        clock[0] += 30  # no step for 30 s > the 5 s threshold; heartbeats go on
        time.sleep(0.6)
        assert rep.flush(5)
        st = w.poll()[job]
        assert st.state == "hung" and st.seconds_since_last_step == pytest.approx(30, abs=0.5)
        # The status the watcher wrote (in the job's slot) is what the API reads.
        assert LedgerStore(r, prefix).info_many([job])[job]["status"] == "hung"
    finally:
        rep.close()
        w.stop()


def test_the_documented_trainer_acl_works_on_the_cluster(cluster, tmp_path):
    """`costexporter acl --role trainer --cluster`, set on every node: the trainer posts and
    nothing is spooled."""
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    job = "acl-job"
    user = f"trainer-{uuid.uuid4().hex[:6]}"
    rules = acl.setuser_args("trainer", prefix, job=job, user=user, password="s3cret", cluster=True)
    for port in cluster.ports:
        redis.Redis(port=port).execute_command("ACL", "SETUSER", *rules)
    url = cluster.url.replace("redis+cluster://", f"redis+cluster://{user}:s3cret@")
    try:
        rep = StepReporter(job, url, rank=0, world_size=1, prefix=prefix, spool_dir=tmp_path)
        for s in range(1, 4):
            rep.step(s)
        assert rep.flush(5)
        rep.close()
        admin = redisconn.from_url(cluster.url, decode_responses=True)
        types = [e.type for e in EventReader(admin, job, prefix).read_all()]
        assert types == ["register", "run", "step", "step", "step", "run"]  # start ... end at close
        assert admin.zscore(keys.jobs_key(prefix), job) is not None
        assert admin.get(keys.registrations_key(prefix)) == "1" and not rep.stats["counter_rejected"]
        assert not list(tmp_path.glob("*.jsonl")) or all(
            p.stat().st_size == 0 for p in tmp_path.glob("*.jsonl")
        )
    finally:
        for port in cluster.ports:
            redis.Redis(port=port).execute_command("ACL", "DELUSER", user)


def test_mget_across_slots_on_the_cluster(cluster):
    """The agent's idle levels (one key per GPU, in many slots) are read in one call."""
    r = redisconn.from_url(cluster.url, decode_responses=True)
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    names = [keys.gpu_idle_key(prefix, f"GPU-{i}") for i in range(20)]
    assert len({r.keyslot(k) for k in names}) > 1
    for i, k in enumerate(names[::2]):
        r.set(k, str(i))
    assert redisconn.mget(r, names) == [str(i // 2) if i % 2 == 0 else None for i in range(20)]
    with pytest.raises(RedisClusterException, match="same key slot"):
        r.mget(names)  # what the agent did before: refused across slots


def test_a_master_down_loses_no_trainer_event_and_the_jobs_index_comes_back(tmp_path):
    """The node holding `<p>:jobs` dies (no replica) and comes back empty: the reporter keeps the
    events while the batch fails, delivers every one once the node is back, and the next batch
    writes the lost index entry again (the job's stream is on another node)."""
    c = RedisCluster(tmp_path / "cluster").start()
    try:
        prefix = f"test-{uuid.uuid4().hex[:12]}"
        r = redisconn.from_url(c.url, decode_responses=True)
        jobs_node = r.get_node_from_key(keys.jobs_key(prefix)).port
        job = next(
            f"job-{i}"
            for i in range(1000)
            if r.get_node_from_key(keys.stream_key(prefix, f"job-{i}")).port != jobs_node
        )
        rep = StepReporter(
            job,
            c.url,
            rank=0,
            world_size=1,
            prefix=prefix,
            spool_dir=tmp_path / "spool",
            socket_timeout_s=0.5,
        )
        for s in range(1, 4):
            rep.step(s)
        assert rep.flush(5)
        c.kill(jobs_node)
        for s in range(4, 7):
            rep.step(s)
        assert not rep.flush(1.5)  # the batch cannot go out whole: it is kept, not dropped
        c.restart(jobs_node)
        assert rep.flush(20)
        rep.close()
        reader = EventReader(r, job, prefix)
        steps = [e.int_field("step") for e in reader.read_all() if e.type == "step"]
        assert sorted(steps) == [1, 2, 3, 4, 5, 6]  # duplicates (a batch resent) are dropped
        assert r.zscore(keys.jobs_key(prefix), job) is not None
        assert rep.stats["rejected"] == 0
    finally:
        c.stop()


def test_kubernetes_registrations_and_the_incident_index_on_the_cluster(cluster):
    """The agent's other writers: the pod registrations' allocation script and transactions (one
    job's slot each), and the API's startup SCAN that indexes incident hashes (run per node)."""
    from costexporter.services.k8s import KubernetesJobs
    from costexporter.sources.dcgm import DcgmSource

    from .test_k8s import HOST, FakeDcgmExporter, _wait

    prefix = f"test-{uuid.uuid4().hex[:12]}"
    r = redisconn.from_url(cluster.url, decode_responses=True)
    exp = FakeDcgmExporter([{"power": 1000.0, "util": 100, "pod": "bert-x7k2p", "ns": "nlp"}] * 2)
    src = DcgmSource([exp.url], host=HOST)
    kj = KubernetesJobs(protocol.connect(cluster.url), prefix, src, HOST)
    try:
        src.read()
        kj.sync()
        _wait("registered", lambda: len(r.hgetall(keys.ranks_key(prefix, "nlp:bert"))) == 2)
        for g in (0, 1):
            exp.set(g, pod=None, ns=None)
        src.read()
        kj.sync()
        runs = [
            f.get("state") for _, f in r.xrange(keys.stream_key(prefix, "nlp:bert")) if f["type"] == "run"
        ]
        assert runs == ["end"] and kj.errors == 0  # as on one Redis (test_k8s)
    finally:
        exp.close()
    # Incident hashes of jobs in different slots, without their index: one SCAN finds them all.
    jobs = [f"job-{i}" for i in range(12)]
    assert len({r.keyslot(keys.stream_key(prefix, j)) for j in jobs}) > 3
    for j in jobs:
        r.hset(keys.incidents_key(prefix, j, "agent-a"), "stalled:1", "{}")
    assert ledger.index_incidents(r, prefix) == len(jobs)
    assert all(r.smembers(keys.incident_index_key(prefix, j)) == {"agent-a"} for j in jobs)


def test_an_old_redis_py_is_a_one_line_error_for_a_cluster_url(monkeypatch):
    monkeypatch.setattr(redis, "__version__", "5.2.1")
    with pytest.raises(ValueError, match=r"redis-py >= 6.1 .* not 5.2.1"):
        redisconn.from_url("redis+cluster://127.0.0.1:7000")
    assert isinstance(redisconn.from_url(SHARED_URL), redis.Redis)  # one Redis: any redis-py


def test_the_helm_chart_takes_a_cluster_url():
    """`redis.url` with the cluster scheme passes the chart's schema and reaches the Secret."""
    from .test_helm import TOKENS, _by_kind, _render

    url = "redis+cluster://costexporter:pw@redis-0.redis:6379,redis-1.redis:6379"
    k = _by_kind(_render({**TOKENS, "redis": {"enabled": False, "url": url}}))
    (sec,) = [s for s in k["Secret"] if s["metadata"]["name"].endswith("redis-url")]
    assert sec["stringData"]["url"] == url
    with pytest.raises(Exception, match="/redis/url"):
        _render({**TOKENS, "redis": {"enabled": False, "url": "cluster://redis-0:6379"}})


def test_schemathesis_finds_no_server_error_on_the_cluster(cluster, mirrored):
    """Every operation with generated parameters over the cluster's copy of the ledger: never a
    5xx (odd windows send a script no bucket key, odd job names hash anywhere)."""
    from .api_helpers import assert_no_server_error

    store = LedgerStore(redisconn.from_url(cluster.url, decode_responses=True), mirrored)
    assert assert_no_server_error(store, max_examples=15) >= 7


def test_a_window_with_no_bucket_and_an_unknown_job_on_the_cluster(backends, mirrored, cluster):
    api = _api(cluster.url, mirrored)
    empty = api.get("/api/v1/jobs/llm-run", params={"window": "2025-07-26T00:00:00Z,2025-07-26T00:00:01Z"})
    assert empty.status_code == 200 and empty.json()["gpu_hours"] == 0
    assert api.get("/api/v1/jobs/no-such-job").status_code == 404


def test_the_agents_compare_and_set_round_is_one_transaction_on_the_cluster(cluster, monkeypatch):
    """ledger.commit on a cluster: a watermark changed between WATCH and EXEC (a second agent
    with the same id) aborts the whole round, amounts included; a clean round applies whole."""
    import numpy as np

    from costexporter.core.model import Category

    prefix, job, agent = f"test-{uuid.uuid4().hex[:12]}", "cas-job", "node0"
    r = redisconn.from_url(cluster.url, decode_responses=True)
    other = redisconn.from_url(cluster.url, decode_responses=True)
    a = np.zeros((len(Category), 3), np.int64)
    a[Category.PRODUCTIVE] = [1000, 5, 7]

    def queue(pipe) -> None:
        ledger.queue_amounts(pipe, prefix, job, {1_753_531_200: a}, "v1")

    raw = ledger.commit(r, prefix, job, agent, None, {"booked_until": 2}, queue)
    assert ledger.read_amounts(r, prefix, job)["productive:ms"] == 1000
    # commit() queues the round once, checks the types of the keys it writes with the watermark
    # under WATCH, then replays the round inside MULTI: another writer of the same watermark
    # comes in there, after WATCH and before EXEC
    replay = ledger._Recorded.replay

    def sneak(self, pipe) -> None:
        other.set(keys.watermark_key(prefix, job, agent), '{"booked_until": 1}')
        replay(self, pipe)

    with monkeypatch.context() as m, pytest.raises(ledger.Conflict):
        m.setattr(ledger._Recorded, "replay", sneak)
        ledger.commit(r, prefix, job, agent, raw, {"booked_until": 3}, queue)
    assert ledger.read_amounts(r, prefix, job)["productive:ms"] == 1000  # nothing of the aborted round
    with pytest.raises(ledger.Conflict):  # and a stale expectation is refused before MULTI
        ledger.commit(r, prefix, job, agent, raw, {"booked_until": 4}, queue)
    assert ledger.load_watermark(r, prefix, job, agent) == {"booked_until": 1}


def test_the_legacy_keyspace_moves_on_the_cluster(cluster):
    """A job's keys are renamed in their slot (the hash tag picks it); the keys across jobs, whose
    old and new names lie in different slots, are copied with their TTL and removed."""
    from costexporter.store import migrate

    r = redisconn.from_url(cluster.url, decode_responses=True)
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    jobs = [f"job-{i}" for i in range(6)]
    for j in jobs:
        r.xadd(keys.legacy_job_key(prefix, j, "events"), {"v": "1", "job": j})
        r.set(keys.legacy_job_key(prefix, j, "wm", "a"), '{"booked_until": 7}')
        r.zadd(keys.legacy_key(prefix, "jobs"), {j: 1.0})
    r.set(keys.legacy_key(prefix, "epoch"), "e1")
    r.set(keys.legacy_key(prefix, "gpu", "GPU-1", "idle"), "{}", ex=3600)
    old_slots = {r.keyslot(keys.legacy_key(prefix, "jobs")), r.keyslot(keys.jobs_key(prefix))}
    assert len(old_slots) == 2  # a cross-slot move is exercised
    report = migrate.migrate(r, prefix)
    assert report.moved == 2 * len(jobs) + 3 and not report.conflicts, report
    assert r.zrange(keys.jobs_key(prefix), 0, -1) == sorted(jobs)
    assert r.get(keys.epoch_key(prefix)) == "e1" and 0 < r.ttl(keys.gpu_idle_key(prefix, "GPU-1")) <= 3600
    for j in jobs:
        assert r.xlen(keys.stream_key(prefix, j)) == 1
        assert r.get(keys.watermark_key(prefix, j, "a")) == '{"booked_until": 7}'
    assert migrate.legacy_keys(r, prefix) == []


def test_seal_expire_read_across_and_restore_on_a_cluster(cluster, tmp_path):
    """The archive's lifecycle on a 3-master Redis Cluster: sealed, expired (the ledger's start
    on one node, each job's drop in a MULTI on its own), every window read the same across the
    archive and Redis, then the keys lost and the hot window restored: the same again."""
    from costexporter.services.restore import Restore
    from costexporter.services.retention import Retention
    from costexporter.services.sealer import Sealer
    from costexporter.store import keys as k
    from costexporter.store import ledger
    from costexporter.store.archive import Archive
    from costexporter.store.coldledger import ColdLedger
    from costexporter.store.ledger_read import LedgerStore

    from .test_archive import DAY0, N_CAT, set_watermark
    from .test_retention import snapshot, write_steps

    r, p, day = redisconn.from_url(cluster.url, decode_responses=True), f"lc-{uuid.uuid4().hex[:8]}", 86400
    rng = np.random.default_rng(1)
    jobs = ["a/1", "b/2", "c/3"]
    for job in jobs:
        pipe = r.pipeline(transaction=False)
        b = {DAY0 + 3600 * h: rng.integers(0, 10**6, (N_CAT, 3)) for h in range(6 * 24)}
        ledger.queue_amounts(pipe, p, job, b, "pv1")
        pipe.zadd(k.jobs_key(p), {job: DAY0})
        pipe.execute()
        write_steps(r, p, job, [(DAY0 * 1000 + 600_000 * n, 5) for n in range(6 * 144)], [2])
        set_watermark(r, p, job, "n0", DAY0 + 7 * day)
    spans = [(DAY0, DAY0 + 6 * day), (DAY0 + 3600, DAY0 + 4 * day)]
    before = snapshot(LedgerStore(r, p), jobs, spans)
    archive = Archive.open(str(tmp_path))
    sealer = Sealer(r, p, archive, "east", shards=2, delay_s=0)
    assert sealer.seal(DAY0 + 8 * day).written
    rep = Retention(sealer, hot_days=3).expire(DAY0 + 6 * day)
    assert rep.hot_from == DAY0 + 3 * day and rep.keys > 0 and not rep.held
    assert snapshot(LedgerStore(r, p, cold=ColdLedger(archive, "east")), jobs, spans) == before
    for key in list(r.scan_iter(f"{p}:*")):
        r.delete(key)
    back = Restore(r, p, archive, "east").restore(DAY0 + 2 * day)
    assert back.restored == 12 and not back.kept
    assert snapshot(LedgerStore(r, p, cold=ColdLedger(archive, "east")), jobs, spans) == before
    for key in list(r.scan_iter(f"{p}:*")):
        r.delete(key)


def test_a_settled_jobs_recheck_finds_events_that_did_not_move_the_index_on_the_cluster(cluster):
    """On a cluster the recheck asks each stream's newest id (one command's keys share a slot):
    events behind the job's index score are found by it, as on a single Redis."""
    from .test_watcher_settled import T0, Trainer

    prefix = f"test-{uuid.uuid4().hex[:12]}"
    r = redisconn.from_url(cluster.url, decode_responses=True)
    tr = Trainer(r, prefix, "ended")
    tr.run(T0)
    clock = [T0 + 60]
    cfg = WatchConfig(
        redis_url=cluster.url, prefix=prefix, clock=lambda: clock[0], recheck_s=60.0, forget_after_s=1e9
    )
    w = Watcher(cfg)
    try:
        assert w.poll()["ended"].state == "done" and "ended" not in w.views  # settled
        tr.run(tr.ended_at + 1, steps=2, end=False, linger=False)  # behind the index's score
        clock[0] += 5
        assert w.poll()["ended"].state == "done" and "ended" not in w.views  # not looked at yet
        clock[0] += 60
        got = w.poll()["ended"]
        assert "ended" in w.views and got.state != "done"  # found by its recheck
        want = Watcher(cfg).poll()["ended"]
        assert (got.state, got.reason, got.last_step) == (want.state, want.reason, want.last_step)
    finally:
        w.stop()
