"""Least-privilege Redis ACL rules for each party (pure): the `ACL SETUSER` line of `costexporter acl`.

Each party gets the commands its code really sends and the keys of its own sub-prefix
(keys.py): a trainer appends to its own job's keys and writes nothing else, not the ledger its
bill is made of, not another job's keys (it reads only the agents' node keys, for the pre-run
gate); the agents read what the trainers post and
write the ledger; the watchers read both and write each job's state; the finance API only reads.
The stream readers' hash (`<prefix>:r:`) is the agents' and the watchers'. No party gets a
channel. Read-only access and the agent's one write to a trainer key (`XTRIM` of the event
streams, in a selector of its own) use Redis 7's `%R~` patterns and selectors: the rules need
Redis 7.0 or later.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

from costexporter.store import keys

ROLES = ("trainer", "agent", "watcher", "api", "sealer", "retention")

# Every client: the handshake (AUTH, HELLO, SELECT for a database other than 0) and PING, which
# the reporter and the API's /readyz use. Not CLIENT SETINFO, which redis-py sends on Redis 7.2+
# and goes on without when it is refused (Redis 7.0 does not know it, so no rule can name it).
_CONNECTION = ("+auth", "+hello", "+select", "+ping")
# A Redis Cluster client reads the slot map and the commands' key positions when it connects.
_CLUSTER = ("+cluster|slots", "+cluster|shards", "+command")


def _cmds(text: str) -> tuple[str, ...]:
    return tuple(text.split())


# The commands each party's code sends, beyond the connection's. Tests run every party under
# these rules against a real Redis: a command missing here fails them with NOPERM.
COMMANDS: dict[str, tuple[str, ...]] = {
    # trainer/reporter.py's batch: XADD the events and the heartbeats (MAXLEN ~, no XTRIM),
    # HSET ranks and meta, ZADD the jobs index,
    # INCR the registrations counter; and `costexporter preflight`'s occupancy check, which
    # reads the agents' node keys (HGETALL, read only).
    "trainer": _cmds("+xadd +hset +zadd +incr +hgetall"),
    # services/agent.py, services/k8s.py, store/ledger.py and store/reader.py: discovery, the
    # booking round (WATCH the watermark, MULTI ... EXEC, the rollup script and the commands in
    # it), live and sample streams, idle levels, node keys, the readers hash and trimming; SCAN
    # for the jobs' ranks keys when the jobs index cannot be trusted (store/jobindex.py).
    "agent": _cmds(
        """+scan +get +mget +set +del +expire +exists +type
        +hget +hmget +hgetall +hvals +hset +hdel +hexists +hincrby +sadd +srem +scard
        +zadd +zrange +zrangebyscore +zrevrangebyscore +zrem
        +xadd +xread +xrange +xrevrange +xtrim
        +watch +unwatch +multi +exec +discard +eval +evalsha +script|load +script|exists"""
    ),
    # services/watcher.py: the jobs index, ranks, events, heartbeats, live state and the
    # simulation's clock; its status and its position in the readers hash; SCAN and each scanned
    # job's newest entry when the jobs index cannot be trusted (store/jobindex.py); TYPE, to tell
    # a job's stream of the wrong type (set aside, the other jobs judged) from an outage.
    "watcher": _cmds("+get +set +hgetall +hset +zrangebyscore +xread +xrange +xrevrange +scan +type"),
    # store/ledger_read.py (the API): reads only, also in its scripts (which read the rollups and
    # buckets), and the oldest entries of a job's streams (its first register); SCAN for the
    # jobs' ranks keys when the jobs index is of the wrong type (store/jobindex.py).
    # services/sealer.py (`costexporter archive seal`): the jobs' 5-minute bucket indexes and the
    # agents' watermarks (found by SCAN patterns; MGET), each job's buckets and step members, its
    # incidents (the agents that wrote some: SMEMBERS; theirs: HGETALL), its meta and attribution
    # (HGETALL, HMGET), the ledger's start: reads only.
    "sealer": _cmds("+get +mget +hgetall +hmget +smembers +zrange +zrangebyscore +zrevrangebyscore +scan"),
    # services/retention.py (`costexporter archive expire`): the sealer's reads, then it moves
    # the ledger's start (WATCH, MULTI, SET) and drops what lies before it (DEL,
    # ZREMRANGEBYSCORE, in a MULTI per job).
    "retention": _cmds(
        """+get +mget +set +del +hgetall +hmget +smembers +zrange +zrangebyscore +zrevrangebyscore
        +zremrangebyscore +scan
        +watch +unwatch +multi +exec +discard"""
    ),
    "api": _cmds(
        """+get +hget +hgetall +hvals +hmget +smembers +exists +type +xrange +scan
        +zrange +zscore +zcount +zrevrangebyscore +eval +evalsha +script|load +script|exists"""
    ),
}

_NAME = re.compile(r"^[A-Za-z0-9._@+=-]{1,64}$")
_PREFIX = re.compile(r"^[A-Za-z0-9._/@+=-]{1,100}(:[A-Za-z0-9._/@+=-]{1,100})*$")
_TEAM = re.compile(r"^[A-Za-z0-9._@+=-]{1,100}$")
_JOB = re.compile(r"^[A-Za-z0-9._:/@+=-]{1,200}$")


class AclError(ValueError):
    """Arguments that make no safe rule; the message is one line."""


@dataclass(frozen=True)
class Scope:
    """Which jobs a trainer's rule covers: one job, a team's jobs (named `<team>/<anything>`), or
    every job."""

    job: str | None = None
    team: str | None = None

    def tag(self) -> str:
        """The glob inside the hash tag."""
        if self.job is not None:
            return self.job
        if self.team is not None:
            return f"{self.team}/*"
        return "*"


def check_prefix(prefix: str) -> str:
    """A prefix that is literal inside an ACL key pattern: no glob characters, braces or spaces."""
    if not isinstance(prefix, str) or not _PREFIX.match(prefix):
        raise AclError(
            f"prefix {prefix!r} must be letters, digits and ._/@+=- in parts joined by ':' "
            "(no glob characters, braces or spaces: it sits in ACL key patterns)"
        )
    return prefix


def key_patterns(role: str, prefix: str, scope: Scope = Scope()) -> list[str]:
    """The role's key patterns (`~` read and write, `%R~` read only), without its selectors."""
    check_prefix(prefix)

    def t(*p: str) -> str:
        return keys.ns_key(prefix, keys.TRAINER, *p)

    def ns(n: str) -> str:
        return keys.ns_key(prefix, n, "*")

    if role == "trainer":
        own = [f"~{t('{' + scope.tag() + '}', '*')}", f"~{t('jobs')}", f"~{t('registrations')}"]
        return [*own, f"%R~{keys.node_key(prefix, '*')}"]
    if role == "agent":
        return [f"%R~{ns(keys.TRAINER)}", f"~{ns(keys.AGENT)}", f"~{ns(keys.READERS)}"]
    if role == "watcher":
        read = [f"%R~{ns(keys.TRAINER)}", f"%R~{ns(keys.AGENT)}"]
        return [*read, f"~{ns(keys.READERS)}", f"~{ns(keys.WATCHER)}"]
    if role == "sealer":  # reads the agents' ledger and watermarks, the jobs' meta; writes nothing
        return [f"%R~{ns(keys.TRAINER)}", f"%R~{ns(keys.AGENT)}"]
    if role == "retention":  # the sealer's reads; writes the ledgers and the ledger's start only
        ledgers = keys.ledger_key(prefix, "*", "*")
        return [
            f"%R~{ns(keys.TRAINER)}",
            f"%R~{ns(keys.AGENT)}",
            f"~{ledgers}",
            f"~{keys.hot_from_key(prefix)}",
        ]
    if role == "api":
        # Not `%R~`: Redis counts a script's keys as written (EVALSHA has no read-only form before
        # Redis 7's EVALSHA_RO), and the API reads through scripts. Its commands are all reads,
        # and a script runs only the commands its user has: it writes nothing either way.
        return [f"~{ns(n)}" for n in (keys.TRAINER, keys.AGENT, keys.WATCHER)]
    raise AclError(f"role {role!r} is not one of {', '.join(ROLES)}")


def selectors(role: str, prefix: str) -> list[str]:
    """The role's selectors: the agents trim the trainers' event streams, and write nothing else
    of theirs. The trim runs as a script over the stream and the kept stream (`ledger.trim`):
    the selector lets the script be called with both keys; each command inside it is checked
    again on its own, so the script cannot add to the stream either."""
    if role == "agent":
        stream, kept = keys.stream_key(prefix, "*"), keys.kept_key(prefix, "*")
        return [f"(~{stream} ~{kept} +xtrim +eval +evalsha)"]
    return []


def setuser_args(
    role: str,
    prefix: str = "costexporter",
    *,
    user: str | None = None,
    job: str | None = None,
    team: str | None = None,
    password: str | None = None,
    cluster: bool = False,
) -> list[str]:
    """The arguments of `ACL SETUSER` (after the command itself), first the user name.

    The rule resets the user's keys, channels, commands and selectors, so running it again
    narrows a user that had more. Without `password` it sets none: a new user cannot log in
    until one is added (`ACL SETUSER <user> >...`), an existing one keeps its own."""
    if role not in ROLES:
        raise AclError(f"role {role!r} is not one of {', '.join(ROLES)}")
    if (job is not None or team is not None) and role != "trainer":
        raise AclError("--job and --team scope a trainer: agents, watchers and the API serve every job")
    if job is not None and team is not None:
        raise AclError("give --job or --team, not both")
    if job is not None and not _JOB.match(job):
        raise AclError(f"job name {job!r} must be 1-200 characters of letters, digits and ._:/@+=-")
    if team is not None and not _TEAM.match(team):
        raise AclError(f"team {team!r} must be 1-100 characters of letters, digits and ._@+=- (no '/')")
    name = user or default_user(role, job, team)
    if not _NAME.match(name):
        raise AclError(f"user name {name!r} must be 1-64 characters of letters, digits and ._@+=-")
    args = [name, "on"]
    if password is not None:
        if not password:
            raise AclError("the password is empty")
        args += ["resetpass", "#" + hashlib.sha256(password.encode()).hexdigest()]
    args += ["resetkeys", "resetchannels", "clearselectors", "-@all"]
    args += key_patterns(role, prefix, Scope(job, team))
    args += [*_CONNECTION, *COMMANDS[role], *(_CLUSTER if cluster else ())]
    args += selectors(role, prefix)
    return args


def default_user(role: str, job: str | None = None, team: str | None = None) -> str:
    """`costexporter-<role>`, `costexporter-trainer-<team>` for a team's trainers and
    `costexporter-trainer-<job>` for one job's (`--user` when the job name is no user name)."""
    if team is not None:
        return f"costexporter-trainer-{team}"
    if job is not None:
        name = f"costexporter-trainer-{job}"
        if not _NAME.match(name):
            raise AclError(f"job {job!r} makes no user name ({name!r}): give one with --user")
        return name
    return f"costexporter-{role}"


def setuser_line(args: Sequence[str]) -> str:
    """`ACL SETUSER ...` as redis-cli reads it (a selector quoted)."""
    return "ACL SETUSER " + " ".join(f'"{a}"' if " " in a else a for a in args)


def aclfile_line(args: Sequence[str]) -> str:
    """The same user as a line of a Redis ACL file (`aclfile`): `user <name> <rules>`, a
    selector unquoted (the file's reader joins the words of a `(...)` itself)."""
    return "user " + " ".join(args)
