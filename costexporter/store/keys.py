"""The Redis keyspace (pure): one named builder for every key in docs/protocol.md's table.

Everything of a job lives under its hash tag, `<prefix>:{<job>}:`, so one MULTI covers a booking
round and a Redis Cluster keeps the job on one node; the few keys across jobs (the jobs set, the
registrations counter, nodes, GPUs, the epoch, the sim clock) carry only the prefix. Callers
build keys here and never spell a suffix themselves.
"""

from __future__ import annotations


def job_key(prefix: str, job: str, *parts: str) -> str:
    """`<prefix>:{<job>}:<part>:<part>...`: every per-job key below is one of these."""
    return f"{prefix}:{{{job}}}:{':'.join(parts)}"


# ---- written by the trainers (the reporter) ----------------------------------------------------
def stream_key(prefix: str, job: str) -> str:
    """The job's event stream."""
    return job_key(prefix, job, "events")


def ranks_key(prefix: str, job: str) -> str:
    """Rank -> JSON of its latest `register` (hash)."""
    return job_key(prefix, job, "ranks")


def meta_key(prefix: str, job: str) -> str:
    """The job's `meta` fields, last write wins (hash)."""
    return job_key(prefix, job, "meta")


def jobs_key(prefix: str) -> str:
    """Job -> Unix time of its latest event (zset)."""
    return f"{prefix}:jobs"


def registrations_key(prefix: str) -> str:
    """A counter every batch with a register entry increments: agents discover jobs when it moves."""
    return f"{prefix}:registrations"


# ---- written by the agents ---------------------------------------------------------------------
def watermark_key(prefix: str, job: str, agent: str) -> str:
    """What one agent has booked of a job (JSON), the compare-and-set point of its rounds."""
    return job_key(prefix, job, "wm", agent)


def fold_key(prefix: str, job: str, agent: str, old: bool = False) -> str:
    """An agent's folded timeline of a job and its stream position (`fold.dump_fold`, base64),
    written with its watermark: a restarted agent resumes from the newest (`fold:new:`); an
    older one (`fold:old:`, kept a while behind) lets a late event be folded in again after the
    stream below the newest was trimmed."""
    return job_key(prefix, job, "fold", "old" if old else "new", agent)


def kept_key(prefix: str, job: str) -> str:
    """The job's registrations, run events, meta and gate results moved out of the event stream
    when the agents trim it (stream, same entry ids): what a replay of the job needs whatever
    their age. Only the trimming agent writes it; readers merge it with the stream by id."""
    return job_key(prefix, job, "kept")


def readers_key(prefix: str, job: str) -> str:
    """The job's stream readers (hash reader id -> JSON `{"id": stream id, "ts": Unix s}`): what
    each still needs of the stream. The stream is trimmed below the oldest fresh one."""
    return job_key(prefix, job, "readers")


def live_key(prefix: str, job: str, host: str) -> str:
    """Rank -> JSON of its GPU's newest sample and band, from the agent of `host` (hash, TTL)."""
    return job_key(prefix, job, "live", host)


def samples_key(prefix: str, job: str, host: str) -> str:
    """The samples of the job's GPUs on `host`, one packed entry a round (stream)."""
    return job_key(prefix, job, "samples", host)


def ledger_key(prefix: str, job: str, *parts: str) -> str:
    """`<prefix>:{<job>}:ledger:<part>...`: the ledger family below."""
    return job_key(prefix, job, "ledger", *parts)


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
    return f"{prefix}:node:{host}"


def agent_id_key(prefix: str, agent: str) -> str:
    """Which host runs agent id `agent` (JSON: host, pid, since), with a TTL its agent renews
    every round: a second host that presents the same id is refused (agentid.py)."""
    return f"{prefix}:agentid:{agent}"


def gpu_idle_key(prefix: str, gpu_uuid: str) -> str:
    """A GPU's idle power as its agent learned it (JSON: idle_w, n, host, updated), by the GPU's
    UUID so it follows the GPU, not the agent: a restarted agent starts from it (idle.py)."""
    return f"{prefix}:gpu:{gpu_uuid}:idle"


def epoch_key(prefix: str) -> str:
    """The ledger's epoch: a Redis restarted empty has another (or none)."""
    return f"{prefix}:epoch"


def k8s_ranks_key(prefix: str, job: str) -> str:
    """A Kubernetes job's GPU -> rank allocation, the same on every agent (hash; `_next`, `_ended`)."""
    return job_key(prefix, job, "k8s")


def k8s_gpus_key(prefix: str, job: str) -> str:
    """The GPUs a Kubernetes job's pods hold now, across agents (set)."""
    return job_key(prefix, job, "k8s", "gpus")


# ---- written by the watcher and the simulation -------------------------------------------------
def status_key(prefix: str, job: str) -> str:
    """The watcher's JSON state of the job (string, TTL)."""
    return job_key(prefix, job, "status")


def simclock_key(prefix: str) -> str:
    """A simulated job's clock (`demo`, `serve --source sim`), for `watch --sim-clock`."""
    return f"{prefix}:simclock"


def demo_key(prefix: str) -> str:
    """Marks a prefix whose data the demo wrote (JSON of its last run): a later demo on the same
    prefix clears it and plays the story again; a prefix without it is never cleared."""
    return f"{prefix}:demo"


def demo_lease_key(prefix: str) -> str:
    """A demo is playing on this prefix now (JSON of its host and pid, short TTL, renewed)."""
    return f"{prefix}:demo:lease"
