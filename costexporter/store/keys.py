"""The Redis keyspace (pure): one named builder for every key in docs/protocol.md's table.

Each key sits under the sub-prefix of the party that writes it, so a Redis ACL can give each its
own keys and nothing else (`acl.py` prints the lines):

    <prefix>:t:...   the trainers (reporters): a job's events, heartbeats, registrations and meta,
                     the jobs index
    <prefix>:a:...   the agents: the ledger, watermarks, folds, live state, node and GPU keys
    <prefix>:r:...   the stream readers (agents, watchers, a reader of your own)
    <prefix>:w:...   the watchers: each job's state

A job's keys carry its hash tag, `<prefix>:<ns>:{<job>}:`, in every sub-prefix: the tag alone
picks the Redis Cluster slot, so all of a job's keys stay on one node and one MULTI covers a
booking round. The agents' sample streams, which no transaction covers, are the exception: each
has a tag of its own (`samples_key`). The few keys across jobs carry no tag. Callers build keys
here and never spell a suffix themselves. The layout before the sub-prefixes
(`<prefix>:{<job>}:...`) is the legacy one; `migrate.py` moves it.
"""

from __future__ import annotations

TRAINER = "t"
AGENT = "a"
READERS = "r"
WATCHER = "w"
NAMESPACES = (TRAINER, AGENT, READERS, WATCHER)


def ns_key(prefix: str, ns: str, *parts: str) -> str:
    """`<prefix>:<ns>:<part>...`: a key across jobs."""
    return ":".join((prefix, ns, *parts))


def job_key(prefix: str, ns: str, job: str, *parts: str) -> str:
    """`<prefix>:<ns>:{<job>}:<part>...`: every per-job key below is one of these."""
    return f"{prefix}:{ns}:{{{job}}}:{':'.join(parts)}"


# ---- written by the trainers (the reporter) ----------------------------------------------------
def stream_key(prefix: str, job: str) -> str:
    """The job's event stream."""
    return job_key(prefix, TRAINER, job, "events")


def beats_key(prefix: str, job: str) -> str:
    """The job's heartbeats (stream, capped by its writers with `XADD MAXLEN ~`,
    `protocol.beats_cap`): apart from the events, so the agents, which never use a heartbeat,
    never read one. The watchers read it for liveness."""
    return job_key(prefix, TRAINER, job, "beats")


def ranks_key(prefix: str, job: str) -> str:
    """Rank -> JSON of its latest `register` (hash)."""
    return job_key(prefix, TRAINER, job, "ranks")


def meta_key(prefix: str, job: str) -> str:
    """The job's `meta` fields, last write wins (hash)."""
    return job_key(prefix, TRAINER, job, "meta")


def jobs_key(prefix: str) -> str:
    """Job -> Unix time of its latest event (zset)."""
    return ns_key(prefix, TRAINER, "jobs")


def registrations_key(prefix: str) -> str:
    """A counter every batch with a register entry increments: agents discover jobs when it moves."""
    return ns_key(prefix, TRAINER, "registrations")


# ---- written by the stream's readers (the agents, the watchers, a reader of your own) ----------
def readers_key(prefix: str, job: str) -> str:
    """The job's stream readers (hash reader id -> JSON `{"id": stream id, "ts": Unix s}`): what
    each still needs of the stream. The stream is trimmed below the oldest fresh one."""
    return job_key(prefix, READERS, job, "readers")


# ---- written by the agents ---------------------------------------------------------------------
def watermark_key(prefix: str, job: str, agent: str) -> str:
    """What one agent has booked of a job (JSON), the compare-and-set point of its rounds."""
    return job_key(prefix, AGENT, job, "wm", agent)


def fold_key(prefix: str, job: str, agent: str, old: bool = False) -> str:
    """An agent's folded timeline of a job and its stream position (`fold.dump_fold`, base64),
    written with its watermark: a restarted agent resumes from the newest (`fold:new:`); an
    older one (`fold:old:`, kept a while behind) lets a late event be folded in again after the
    stream below the newest was trimmed."""
    return job_key(prefix, AGENT, job, "fold", "old" if old else "new", agent)


def kept_key(prefix: str, job: str) -> str:
    """The job's registrations, run events, meta and gate results moved out of the event stream
    when the agents trim it (stream, same entry ids): what a replay of the job needs whatever
    their age. Only the trimming agent writes it; readers merge it with the stream by id."""
    return job_key(prefix, AGENT, job, "kept")


def live_key(prefix: str, job: str, host: str) -> str:
    """Rank -> JSON of its GPU's newest sample and band, from the agent of `host` (hash, TTL)."""
    return job_key(prefix, AGENT, job, "live", host)


# A job's hosts share this many sample streams (a host's by a hash of its name): an agent reads
# at most this many keys a round however wide the job, and each stream has a hash tag of its own.
SAMPLE_STREAMS = 16


def sample_stream(host: str) -> int:
    """The job's sample stream `host` publishes on (stable across processes and releases)."""
    import zlib

    return zlib.crc32(host.encode()) % SAMPLE_STREAMS


def samples_key(prefix: str, job: str, host: str) -> str:
    """The stream `host` publishes the samples of the job's GPUs on, one packed entry a round
    naming the host, shared with the other hosts of its `sample_stream`. Under a hash tag of its
    own, `{<job>#<n>}`: no transaction covers the samples, so a wide job's streams spread over
    Redis Cluster slots while its ledger stays on its own."""
    return f"{prefix}:{AGENT}:{{{job}#{sample_stream(host)}}}:samples"


def ledger_key(prefix: str, job: str, *parts: str) -> str:
    """`<prefix>:a:{<job>}:ledger:<part>...`: the ledger family below."""
    return job_key(prefix, AGENT, job, "ledger", *parts)


def total_key(prefix: str, job: str) -> str:
    """The job's all-time amounts (hash)."""
    return ledger_key(prefix, job, "total")


def bucket_key(prefix: str, job: str, res: str, start: int | str) -> str:
    """One bucket's amounts (hash) of resolution `res` (5m, 1h, 1d, 1w) starting at `start` (s)."""
    return ledger_key(prefix, job, res, str(start))


def index_key(prefix: str, job: str, res: str) -> str:
    """The buckets of resolution `res` that have data (zset)."""
    return ledger_key(prefix, job, "index", res)


def rollup_key(prefix: str, job: str) -> str:
    """The job's rollup records (zset: 5-minute bucket start -> `[start, net amounts...]`)."""
    return ledger_key(prefix, job, "cum")


def rollup_state_key(prefix: str, job: str) -> str:
    """The rollup's state (hash: `v`, `pv`)."""
    return ledger_key(prefix, job, "cumstate")


def hot_from_key(prefix: str) -> str:
    """Where the ledger in Redis begins (Unix s, a UTC day's start; absent: it holds everything):
    every job's amounts and steps before it are in the archive, and readers read them there
    (`services/retention.py` moves it, then drops what lies before)."""
    return ns_key(prefix, AGENT, "hotfrom")


def steps_key(prefix: str, job: str) -> str:
    """Valid step records (zset)."""
    return ledger_key(prefix, job, "steps")


def voids_key(prefix: str, job: str) -> str:
    """Voided step records (zset)."""
    return ledger_key(prefix, job, "voids")


def figures_key(prefix: str, job: str) -> str:
    """The job's figures: last checkpoint, GPU time at risk, cost since the last step (hash)."""
    return ledger_key(prefix, job, "job")


def incidents_key(prefix: str, job: str, agent: str) -> str:
    """One agent's incidents of a job (hash incident id -> JSON)."""
    return ledger_key(prefix, job, "incidents", agent)


def incident_index_key(prefix: str, job: str) -> str:
    """The agents that wrote incidents of a job: readers find the incident hashes here, never by
    SCAN (a pattern would need the job name escaped, and a SCAN walks the whole keyspace)."""
    return ledger_key(prefix, job, "incidents")


def rbidx_key(prefix: str, job: str, agent: str) -> str:
    """One agent's rollback index of a job: what a resume can move (zset)."""
    return ledger_key(prefix, job, "rbidx", agent)


def node_key(prefix: str, host: str) -> str:
    """A node's GPUs as its agent last read them (hash gpu index -> JSON), with a TTL: the
    pre-run gate's occupancy check reads it before any job has registered."""
    return ns_key(prefix, AGENT, "node", host)


def agent_id_key(prefix: str, agent: str) -> str:
    """Which host runs agent id `agent` (JSON: host, pid, since), with a TTL its agent renews
    every round: a second host that presents the same id is refused (agentid.py)."""
    return ns_key(prefix, AGENT, "agentid", agent)


def gpu_idle_key(prefix: str, gpu_uuid: str) -> str:
    """A GPU's idle power as its agent learned it (JSON: idle_w, n, host, updated), by the GPU's
    UUID so it follows the GPU, not the agent: a restarted agent starts from it (idle.py)."""
    return ns_key(prefix, AGENT, "gpu", gpu_uuid, "idle")


def keyspace_key(prefix: str) -> str:
    """The keyspace's version and the migrations that brought it there (hash: `version`,
    `migration:<name>` -> JSON), `store/keyspace.py`."""
    return ns_key(prefix, AGENT, "keyspace")


def epoch_key(prefix: str) -> str:
    """The ledger's epoch: a Redis restarted empty has another (or none)."""
    return ns_key(prefix, AGENT, "epoch")


def k8s_ranks_key(prefix: str, job: str) -> str:
    """A Kubernetes job's GPU -> rank allocation, the same on every agent (hash; `_next`, `_ended`)."""
    return job_key(prefix, AGENT, job, "k8s")


def k8s_gpus_key(prefix: str, job: str) -> str:
    """The GPUs a Kubernetes job's pods hold now, across agents (set)."""
    return job_key(prefix, AGENT, job, "k8s", "gpus")


def simclock_key(prefix: str) -> str:
    """A simulated job's clock, written by the agent that simulates it (`demo`, `serve --source
    sim`), for `watch --sim-clock`."""
    return ns_key(prefix, AGENT, "simclock")


def demo_key(prefix: str) -> str:
    """Marks a prefix whose data the demo wrote (JSON of its last run): a later demo on the same
    prefix clears it and plays the story again; a prefix without it is never cleared."""
    return ns_key(prefix, AGENT, "demo")


def demo_lease_key(prefix: str) -> str:
    """A demo is playing on this prefix now (JSON of its host and pid, short TTL, renewed)."""
    return ns_key(prefix, AGENT, "demo", "lease")


# ---- written by the watchers -------------------------------------------------------------------
def status_key(prefix: str, job: str) -> str:
    """The watcher's JSON state of the job (string, TTL)."""
    return job_key(prefix, WATCHER, job, "status")


# ---- the legacy layout (`migrate.py` moves it) -------------------------------------------------
def legacy_job_key(prefix: str, job: str, *parts: str) -> str:
    """A job's key before the sub-prefixes: `<prefix>:{<job>}:<part>...` (every party's)."""
    return f"{prefix}:{{{job}}}:{':'.join(parts)}"


def legacy_key(prefix: str, *parts: str) -> str:
    """A key across jobs before the sub-prefixes: `<prefix>:jobs`, `<prefix>:node:<host>`, ..."""
    return ":".join((prefix, *parts))
