"""`costexporter acl`: each party under its own Redis user, against a real Redis.

The trainer's rule must leave it no way to reach the ledger its bill is made of, nor another
job; the agents, the watcher and the API must still do their whole work under theirs. The keys
the trainer is refused are those a real booking creates (two real agents book a job), not a
hand-made list.
"""

from __future__ import annotations

import json
import shlex
import time
import urllib.request
import uuid

import pytest
import redis

from costexporter.services.watcher import WatchConfig, Watcher
from costexporter.sources.synth import write_nvidia_smi_csv
from costexporter.store import acl, keys, ledger, migrate
from costexporter.store.ledger_read import LedgerStore
from costexporter.tools import preflight
from costexporter.trainer.reporter import StepReporter

from .api_helpers import WINDOW, served
from .redis_server import RedisServer, free_port
from .test_agent import event_entry, offline_ms, serve, stop_all, two_host_job, wait_booked

PREFIX = "ce"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = RedisServer(tmp_path_factory.mktemp("acl-redis")).start()
    yield s
    s.stop()


def url_as(server: RedisServer, user: str, password: str) -> str:
    return f"redis://{user}:{password}@127.0.0.1:{server.port}/0"


def setuser(admin: redis.Redis, role: str, **kw) -> tuple[str, str]:
    """The rule `costexporter acl` prints, run as printed; returns (user, password)."""
    pw = uuid.uuid4().hex
    args = acl.setuser_args(role, PREFIX, password=pw, **kw)
    admin.execute_command(*shlex.split(acl.setuser_line(args)))
    return args[0], pw


def client_as(server: RedisServer, user: str, pw: str) -> redis.Redis:
    return redis.Redis(port=server.port, username=user, password=pw, decode_responses=True)


def refused(fn, *args) -> bool:
    """Whether Redis refuses the call for want of permission (NOPERM, or, inside a script, the
    error a script's refused command raises)."""
    try:
        fn(*args)
    except redis.exceptions.NoPermissionError:
        return True
    except redis.exceptions.ResponseError as e:
        return any(m in str(e) for m in ("can't run this command", "can't access", "No permissions"))
    return False


def acl_denials(admin: redis.Redis, user: str) -> list[dict]:
    out = []
    for e in admin.acl_log(count=1000):
        if e.get("username") == user:
            out.append(e)
    return out


@pytest.fixture(scope="module")
def booked(server, tmp_path_factory):
    """A two-host job posted by a job-scoped trainer user and booked to its end by two real
    agents, each under the agent rule."""
    admin = server.client()
    admin.execute_command("ACL", "LOG", "RESET")
    b = two_host_job()
    csvs = {p.stem: p for p in write_nvidia_smi_csv(b.samples(), tmp_path_factory.mktemp("trace"))}
    trainer = setuser(admin, "trainer", job=b.job)
    agent = setuser(admin, "agent")
    as_trainer = client_as(server, *trainer)
    from costexporter.trainer.transport import send_entries

    send_entries(as_trainer, PREFIX, b.job, [event_entry(e) for e in sorted(b.events, key=lambda e: e.ts)])
    expected, offline = offline_ms(b)
    url = url_as(server, *agent)
    procs = [serve(csvs[h], h, url, PREFIX, free_port()) for h in ("node0", "node1")]
    try:
        wait_booked(admin, PREFIX, b.job, ["node0", "node1"], offline.timeline.end_ms)
    finally:
        errs = stop_all(procs)
    return {"b": b, "expected": expected, "trainer": trainer, "agent": agent, "errs": errs}


def test_two_agents_book_a_job_to_the_ms_under_the_agent_rule(server, booked):
    admin = server.client()
    total = ledger.read_amounts(admin, PREFIX, booked["b"].job)
    assert ledger.net_ms(total) == booked["expected"]
    denied = acl_denials(admin, booked["agent"][0])
    # The persistence check's CONFIG GET is not granted (it reveals the whole configuration):
    # the agent says it could not check, and that is the only thing refused.
    # redis-py's CLIENT SETINFO (Redis 7.2+) is refused too, and redis-py goes on without it; and
    # the agent's look at start for keys of the legacy layout (it then leaves them alone).
    objects = {e["object"] for e in denied if not migrate.new_name(PREFIX, e["object"])}
    assert objects <= {"config|get", "client|setinfo"}, denied
    assert sum(e["count"] for e in denied) <= 20, denied  # once per agent, not every round
    assert not acl_denials(admin, booked["trainer"][0])
    state = admin.hgetall(keys.rollup_state_key(PREFIX, booked["b"].job))
    assert state.get("v") == "1", state  # the rollup script ran whole: nothing in it was refused


def trainer_writes(c: redis.Redis, key: str) -> list:
    """Every write a trainer's rule grants, aimed at `key`."""
    return [
        (c.xadd, key, {"v": "1"}),
        (c.hset, key, "f", "1"),
        (c.zadd, key, {"m": 1}),
        (c.execute_command, "INCR", key),  # incr() sends INCRBY
    ]


def test_every_key_the_booking_wrote_is_refused_to_the_trainer(server, booked):
    admin = server.client()
    job = booked["b"].job
    as_trainer = client_as(server, *booked["trainer"])
    written = sorted(admin.scan_iter(f"{PREFIX}:*"))
    own = {keys.stream_key(PREFIX, job), keys.ranks_key(PREFIX, job), keys.meta_key(PREFIX, job)}
    own.add(keys.beats_key(PREFIX, job))
    cross = {keys.jobs_key(PREFIX), keys.registrations_key(PREFIX)}
    others = [k for k in written if k not in own | cross]
    # The booking wrote the ledger, watermarks, folds, live and sample streams, readers, idle
    # levels, node keys and the epoch: dozens of keys, none of them the trainer's.
    assert len(others) >= 30 and any(":ledger:total" in k for k in others), others
    tried = 0
    for k in others:
        for fn, *args in trainer_writes(as_trainer, k):
            assert refused(fn, *args), (fn.__name__, k)
            tried += 1
        assert refused(as_trainer.delete, k) and refused(as_trainer.get, k), k
    assert tried == 4 * len(others)
    # What was booked is as it was.
    assert ledger.net_ms(ledger.read_amounts(admin, PREFIX, job)) == booked["expected"]


def test_a_trainer_reaches_its_own_job_and_no_other(server, tmp_path):
    admin = server.client()
    user = setuser(admin, "trainer", job="mine", user=f"t-{uuid.uuid4().hex[:6]}")
    c = client_as(server, *user)
    # The reporter does its whole work under the rule: nothing refused, nothing spooled.
    rep = StepReporter(  # rank 1: its heartbeats go to the heartbeat stream (rank 0's to its events)
        "mine",
        url_as(server, *user),
        rank=1,
        world_size=2,
        prefix=PREFIX,
        spool_dir=tmp_path,
        heartbeat_s=0.05,
    )
    rep.meta(team="llm", price_per_gpu_hour=2.5)
    for step in range(1, 4):
        rep.step(step, tokens=10)
    with rep.phase("checkpoint", step=3):
        pass
    deadline = time.monotonic() + 5
    while not admin.xlen(keys.beats_key(PREFIX, "mine")) and time.monotonic() < deadline:
        time.sleep(0.02)
    rep.close()
    assert rep.stats["sent"] >= 8 and not rep.stats["rejected"] and not rep.stats["side_rejected"], rep.stats
    assert not rep.stats["counter_rejected"] and not rep.stats["spooled"], rep.stats
    assert admin.hget(keys.meta_key(PREFIX, "mine"), "team") == "llm"
    # Its heartbeats went to the job's heartbeat stream (XADD MAXLEN ~ under the same rule).
    beats = admin.xrange(keys.beats_key(PREFIX, "mine"))
    assert beats and {f["type"] for _, f in beats} == {"heartbeat"}, beats
    assert c.xadd(keys.beats_key(PREFIX, "mine"), {"v": "1"}, maxlen=10, approximate=True)
    assert c.xadd(keys.stream_key(PREFIX, "mine"), {"v": "1"})
    assert c.hset(keys.ranks_key(PREFIX, "mine"), "9", "{}") == 1
    assert c.zadd(keys.jobs_key(PREFIX), {"mine-2": 1}) == 1
    assert c.execute_command("INCR", keys.registrations_key(PREFIX)) >= 1
    tried = 0
    for other in ("other", "mine2", "min", "mine/x", "x-mine"):
        theirs = (keys.stream_key, keys.beats_key, keys.ranks_key, keys.meta_key)
        for k in (key(PREFIX, other) for key in theirs):
            for fn, *args in trainer_writes(c, k):
                assert refused(fn, *args), (other, k, fn.__name__)
                tried += 1
    assert tried >= 5 * 3, tried  # every other job's keys, each written at least one way
    # The pre-run gate's occupancy check reads the agents' node keys, and writes none.
    admin.hset(keys.node_key(PREFIX, "gpu-host-1"), mapping={"0": "{}", "1": "{}"})
    check = preflight.check_occupancy(
        preflight.PreflightConfig(
            job="mine", nodes=["gpu-host-1"], redis_url=url_as(server, *user), prefix=PREFIX
        )
    )
    assert check.status == "pass", check
    assert refused(c.hset, keys.node_key(PREFIX, "gpu-host-1"), "2", "{}")
    # Nor its own keys read back, nor under another prefix, nor the stream trimmed.
    assert refused(c.xrange, keys.stream_key(PREFIX, "mine"))
    assert refused(c.xtrim, keys.stream_key(PREFIX, "mine"), 0)
    assert refused(c.xadd, keys.stream_key("other-prefix", "mine"), {"v": "1"})
    admin.execute_command("ACL", "DELUSER", user[0])


def test_a_team_rule_covers_the_teams_jobs_only(server):
    admin = server.client()
    user = setuser(admin, "trainer", team="llm")
    c = client_as(server, *user)
    for job in ("llm/a", "llm/b:run-7"):
        assert c.xadd(keys.stream_key(PREFIX, job), {"v": "1"})
    for job in ("vision/a", "llm-a", "llm", "llmx/a", "x/llm/a"):
        assert refused(c.xadd, keys.stream_key(PREFIX, job), {"v": "1"}), job
    admin.execute_command("ACL", "DELUSER", user[0])


def test_the_agent_rule_refuses_the_trainers_and_the_watchers_writes(server, booked):
    c = client_as(server, *booked["agent"])
    job = booked["b"].job
    events = keys.stream_key(PREFIX, job)
    assert refused(c.xadd, events, {"v": "1"})
    assert refused(c.xadd, keys.beats_key(PREFIX, job), {"v": "1"})
    assert refused(c.xtrim, keys.beats_key(PREFIX, job), 0)  # its trimmer is the trainer's MAXLEN
    assert refused(c.xdel, events, "0-1")
    assert refused(c.delete, events)
    assert refused(c.hset, keys.ranks_key(PREFIX, job), "0", "{}")
    assert refused(c.hset, keys.meta_key(PREFIX, job), "price_per_gpu_hour", "0")
    assert refused(c.zadd, keys.jobs_key(PREFIX), {job: 1})
    assert refused(c.set, keys.registrations_key(PREFIX), "1")
    assert refused(c.set, keys.status_key(PREFIX, job), "{}")
    assert c.xtrim(events, minid="0-1") == 0  # the one write it has on a trainer key
    # Nor through a script, which its trimming selector may call with the stream's key.
    script = "return redis.call('XADD', KEYS[1], '*', 'v', '1')"
    assert refused(c.eval, script, 2, events, keys.kept_key(PREFIX, job))
    assert refused(c.eval, "return redis.call('DEL', KEYS[1])", 2, events, keys.kept_key(PREFIX, job))


def test_the_watcher_polls_and_writes_its_state_and_nothing_else(server, booked):
    admin = server.client()
    job = booked["b"].job
    user, pw = setuser(admin, "watcher")
    # A heartbeat in the job's heartbeat stream, as the reporter posts it: the watcher reads it.
    b = booked["b"]
    beat = {"v": "1", "type": "heartbeat", "job": job, "ts": f"{b.t0 + 1:.3f}", "rank": "0"}
    first = admin.xadd(keys.beats_key(PREFIX, job), {**beat, "session": "acl", "seq": "0"})
    # recheck_s tiny: the next poll looks at the settled job's stream ids (XREAD) at once
    cfg = WatchConfig(redis_url=url_as(server, user, pw), prefix=PREFIX, forget_after_s=1e12, recheck_s=1e-3)
    w = Watcher(cfg)
    try:
        got = w.poll()
        assert w._settled[job].cursors[1] == first  # its heartbeat stream read, to the beat
        second = admin.xadd(keys.beats_key(PREFIX, job), {**beat, "session": "acl", "seq": "1"})
        time.sleep(0.01)
        again = w.poll()
    finally:
        w.stop()
    assert w._settled[job].cursors[1] == second  # the recheck found it and the job was read again
    assert got[job].state == again[job].state == "done"
    assert json.loads(admin.get(keys.status_key(PREFIX, job)))["state"] == "done"
    assert not [e for e in acl_denials(admin, user) if e["object"] != "client|setinfo"]
    c = client_as(server, user, pw)
    for k in (keys.total_key(PREFIX, job), keys.figures_key(PREFIX, job), keys.ranks_key(PREFIX, job)):
        assert refused(c.hset, k, "f", "1"), k
    assert refused(c.xadd, keys.beats_key(PREFIX, job), {"v": "1"})
    assert refused(c.set, keys.watermark_key(PREFIX, job, "node0"), "{}")
    assert refused(c.zadd, keys.jobs_key(PREFIX), {job: 1})
    assert refused(c.delete, keys.total_key(PREFIX, job))
    assert refused(c.set, keys.epoch_key(PREFIX), "x")
    admin.execute_command("ACL", "DELUSER", user)


def test_the_agent_and_the_watcher_scan_for_jobs_under_their_rules(server, booked):
    # The jobs index refused (here: any name is over the bound): both find the jobs by SCAN of
    # the ranks keys (the watcher reads each one's newest entry too), with no command denied.
    import logging

    from costexporter.store import untrusted
    from costexporter.store.jobindex import JobIndex

    admin = server.client()
    job = booked["b"].job
    agent_user, agent_pw = booked["agent"]
    user, pw = setuser(admin, "watcher")

    def denied() -> list:  # (what other tests' refused writes left in the log stays as it was)
        return [(u, e["object"], e["count"]) for u in (user, agent_user) for e in acl_denials(admin, u)]

    denied_before = denied()
    w = Watcher(WatchConfig(redis_url=url_as(server, user, pw), prefix=PREFIX, forget_after_s=1e12))
    w.index.max_names = 0
    try:
        got = w.poll()
    finally:
        w.stop()
    assert got[job].state == "done" and w.index.scans == 1, (got, w.index.scans)
    refusals = untrusted.Refusals(logging.getLogger("test"))
    index = JobIndex(client_as(server, agent_user, agent_pw), PREFIX, refusals, (redis.RedisError,), 0)
    assert job in index.names() and refusals.counts[("", "index_cut")] == 1  # (other tests: more jobs)
    assert [d for d in denied() if d[1] != "client|setinfo"] == [
        d for d in denied_before if d[1] != "client|setinfo"
    ]
    admin.execute_command("ACL", "DELUSER", user)


def test_the_api_answers_under_a_read_only_rule_that_refuses_every_write(server, booked):
    admin = server.client()
    job = booked["b"].job
    user, pw = setuser(admin, "api")
    c = redis.Redis.from_url(url_as(server, user, pw), decode_responses=True)
    with served(LedgerStore(c, PREFIX), cache_s=0) as (base, _app):
        paths = [
            "/readyz",
            f"/api/v1/jobs?window={WINDOW}",
            f"/api/v1/jobs/{job}/series?window={WINDOW}&step=5m",
            f"/api/v1/jobs/{job}/incidents?window={WINDOW}",
            *(f"/api/v1/allocation?window={WINDOW}&aggregate={a}" for a in ("job", "team")),
            f"/api/v1/allocation?window={WINDOW}&format=csv",
            f"/api/v1/allocation?window={WINDOW}&format=focus",
            f"/api/v1/allocation?window={WINDOW}&accumulate=false&step=1h",
        ]
        for path in paths:
            with urllib.request.urlopen(base + path, timeout=10) as resp:
                assert resp.status == 200, path
                resp.read()
        with urllib.request.urlopen(f"{base}/api/v1/jobs/{job}?window={WINDOW}", timeout=10) as resp:
            body = json.loads(resp.read())
    assert body["gpu_hours"] == pytest.approx(sum(booked["expected"].values()) / 3.6e6, rel=1e-6)
    # the trainer's meta team is not the job's: said, nothing else is
    assert body["warnings"] == [
        f"{job}: its meta sets team, which only the operator's policy sets: ignored "
        "(counted in costexporter_meta_ignored_total)"
    ], body["warnings"]
    assert not [e for e in acl_denials(admin, user) if e["object"] != "client|setinfo"]
    for k in (keys.total_key(PREFIX, job), keys.meta_key(PREFIX, job), keys.status_key(PREFIX, job)):
        assert refused(c.hset, k, "f", "1"), k
        assert refused(c.delete, k), k
    # Its scripts read: one that writes is refused even on a key it may read.
    assert refused(c.eval, "return redis.call('HSET', KEYS[1], 'f', '1')", 1, keys.total_key(PREFIX, job))
    admin.execute_command("ACL", "DELUSER", user)


def test_the_sealer_seals_real_bookings_under_its_read_only_rule(server, booked, tmp_path):
    """Two real agents' ledger, sealed by the sealer's user: the archive's job total is the
    ledger's, to the micro-unit; the sealer wrote nothing in Redis."""
    from costexporter.services.sealer import Sealer, window_totals
    from costexporter.store.archive import Archive

    admin = server.client()
    user, pw = setuser(admin, "sealer")
    job = booked["b"].job
    before = {k: admin.dump(k) for k in admin.scan_iter(f"{PREFIX}:*") if admin.ttl(k) == -1}
    archive = Archive.open(str(tmp_path))
    far = int(time.time()) + 30 * 86400
    rep = Sealer(client_as(server, user, pw), PREFIX, archive, "c1", delay_s=0).seal(far)
    assert rep.written, rep
    total = ledger.read_amounts(admin, PREFIX, job)
    sealed = window_totals(archive, 0, far)[("c1", job)].to_json()
    steps = sealed.pop("_steps")  # every step the agents recorded, sealed with its day
    assert steps[0] == admin.zcard(keys.steps_key(PREFIX, job)) > 0
    # and every incident the agents recorded (their wasted stretches), with its cost
    incidents = sealed.pop("_incidents", [0, 0, 0])
    agents = admin.smembers(keys.incident_index_key(PREFIX, job))
    assert incidents[0] == sum(admin.hlen(keys.incidents_key(PREFIX, job, a)) for a in agents)
    want = {
        c: [total.get(f"{c}:{u}", 0) - total.get(f"voided:{c}:{u}", 0) for u in ("ms", "mj", "ucost")]
        for c in sealed
    }
    assert sealed == want and sum(v[0] for v in sealed.values()) > 0
    after = {k: admin.dump(k) for k in before}
    assert after == before and not acl_denials(admin, user)  # read only, and never refused
    admin.execute_command("ACL", "DELUSER", user)


def test_retention_drops_only_what_the_archive_holds_under_its_rule(server, booked, tmp_path):
    """A copy of two real agents' ledger (its own prefix: the other tests keep theirs), sealed by
    the sealer's user and expired by the retention user: the bill of the whole run is the same
    before and after, read across Redis and the archive; the retention user was never refused,
    and every write its rule holds is refused on the trainers', the watchers' and the agents'
    other keys."""
    from costexporter.services.retention import Retention
    from costexporter.services.sealer import Sealer
    from costexporter.store.archive import Archive
    from costexporter.store.coldledger import ColdLedger
    from costexporter.store.ledger_read import LedgerStore

    admin, other = server.client(), "cx"
    job = booked["b"].job
    for k in admin.scan_iter(f"{PREFIX}:*"):
        if admin.ttl(k) == -1:
            admin.restore(other + k[len(PREFIX) :], 0, admin.dump(k), replace=True)
    users = {}
    for role in ("sealer", "retention"):
        pw = uuid.uuid4().hex
        args = acl.setuser_args(role, other, password=pw)
        admin.execute_command(*shlex.split(acl.setuser_line(args)))
        users[role] = client_as(server, args[0], pw)
    day = 86400
    t0 = int(booked["b"].t0) // day * day
    span = [(t0 - day, t0 + 2 * day)]
    (before,) = LedgerStore(admin, other).tables([job], span, tokens=True)[1]
    archive = Archive.open(str(tmp_path))
    far = int(time.time()) + 60 * day
    assert Sealer(users["sealer"], other, archive, "c1", delay_s=0).seal(far).written
    rep = Retention(Sealer(users["retention"], other, archive, "c1"), hot_days=1).expire(far)
    assert rep.keys > 0 and not rep.held, rep
    assert not admin.keys(f"{other}:a:{{{job}}}:ledger:5m:*")
    (after,) = LedgerStore(admin, other, cold=ColdLedger(archive, "c1")).tables([job], span, tokens=True)[1]
    assert after.net.tolist() == before.net.tolist() and after.steps == before.steps
    assert int(before.net.sum()) > 0
    name = acl.default_user("retention")
    assert not acl_denials(admin, name)
    c = users["retention"]
    foreign = [k for k in admin.scan_iter(f"{other}:*") if ":ledger:" not in k and not k.endswith(":hotfrom")]
    assert any(f":{keys.TRAINER}:" in k for k in foreign) and any(":wm:" in k for k in foreign), foreign
    lasting = {k: admin.dump(k) for k in foreign}
    writes = [w for w in WRITES if w in acl.COMMANDS["retention"]]
    assert writes == ["+set", "+del"]
    for k in foreign:
        for w in writes:
            assert refused(WRITES[w], c, k), (w, k)
    assert {k: admin.dump(k) for k in foreign} == lasting
    for role in users:
        admin.execute_command("ACL", "DELUSER", acl.default_user(role))


def test_every_rule_is_accepted_by_redis_as_printed(server, cli):
    admin = server.client()
    for role, extra in [("trainer", ["--job", "j"]), ("trainer", ["--team", "t"]), ("trainer", []),
                        ("agent", []), ("watcher", []), ("api", []), ("sealer", []),
                        ("retention", [])]:  # fmt: skip
        user = f"u-{uuid.uuid4().hex[:8]}"
        r = cli("acl", "--role", role, *extra, "--user", user, "--prefix", "p1", "--cluster")
        assert r.returncode == 0, r.stderr
        line = r.stdout.strip()
        assert line.startswith(f"ACL SETUSER {user} on ") and "nopass" not in line
        assert admin.execute_command(*shlex.split(line)) in (b"OK", "OK", True)
        assert ("covers every job" in r.stderr) == (role == "trainer" and not extra), r.stderr
        got = admin.execute_command("ACL", "GETUSER", user)
        assert got
        admin.execute_command("ACL", "DELUSER", user)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--role", "agent", "--job", "j"], "scope a trainer"),
        (["--role", "trainer", "--job", "a", "--team", "b"], "not both"),
        (["--role", "trainer", "--job", "bad job"], "job name"),
        (["--role", "trainer", "--team", "a/b"], "team"),
        (["--role", "api", "--prefix", "ce*"], "prefix"),
        (["--role", "root"], "root"),
    ],
)
def test_a_rule_that_would_not_be_what_it_says_exits_2_with_one_line(cli, args, message):
    r = cli("acl", *args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


# Each write command a rule may hold, aimed at a key (the argument shapes Redis checks).
WRITES = {
    "+set": lambda c, k: c.set(k, "x"),
    "+del": lambda c, k: c.delete(k),
    "+expire": lambda c, k: c.expire(k, 1),
    "+hset": lambda c, k: c.hset(k, "f", "1"),
    "+hdel": lambda c, k: c.hdel(k, "f"),
    "+hincrby": lambda c, k: c.hincrby(k, "f", 1),
    "+sadd": lambda c, k: c.sadd(k, "m"),
    "+srem": lambda c, k: c.srem(k, "m"),
    "+zadd": lambda c, k: c.zadd(k, {"m": 1}),
    "+zrem": lambda c, k: c.zrem(k, "m"),
    "+xadd": lambda c, k: c.xadd(k, {"v": "1"}),
    "+xtrim": lambda c, k: c.xtrim(k, minid="0-1"),
    "+incr": lambda c, k: c.execute_command("INCR", k),
}


@pytest.mark.parametrize("role", ["agent", "watcher", "api", "sealer"])
def test_every_write_a_service_should_not_make_is_refused(server, booked, role):
    """Every key under the prefix (those a real booking wrote), every write command the role's
    rule holds (and, for the API, which holds none, every one): refused outside its own
    sub-prefixes. The agent's one exception is XTRIM of an event stream."""
    admin = server.client()
    user, pw = setuser(admin, role)
    c = client_as(server, user, pw)
    own = {
        "agent": (keys.AGENT, keys.READERS),
        "watcher": (keys.READERS, keys.WATCHER),
        "api": (),
        "sealer": (),
    }[role]
    granted = [w for w in WRITES if w in acl.COMMANDS[role]] or list(WRITES)
    foreign = [k for k in admin.scan_iter(f"{PREFIX}:*") if k.split(":")[1] not in own]
    # the trainer's five keys at least (jobs index, registrations, the job's meta, events and
    # ranks), and for the others the agents' ledger too; whatever tests ran before in this module
    assert len(foreign) >= (5 if role == "agent" else 8), foreign
    lasting = [k for k in foreign if admin.ttl(k) == -1]  # live, node and status keys expire
    before = {k: admin.dump(k) for k in lasting}
    tried = 0
    for k in foreign:
        for w in granted:
            if role == "agent" and w == "+xtrim" and k.endswith(":events"):
                continue  # trimming is the agents' (below the readers' positions only)
            assert refused(WRITES[w], c, k), (role, w, k)
            tried += 1
    assert tried >= len(foreign) * len(granted) - len(foreign)
    assert {k: admin.dump(k) for k in lasting} == before  # nothing changed
    admin.execute_command("ACL", "DELUSER", user)
