"""The OpenCost allocation API over the ledger: what OpenCost clients send (window, aggregate,
step, accumulate, filter, includeIdle) and what they read back (the `{"code", "status", "data"}`
envelope, allocations with OpenCost's names and numeric types).

Pure: parameters in, a plan out; per-job amounts in, allocations out. The router reads the
ledger. A parameter this API does not honour is an error naming it, never ignored: a filter
or an idle share left out silently would over-report. A parameter whose value changes nothing
here (`idleByNode=false`, an empty `filterClusters`, a `resolution` within the ledger's bucket:
what OpenCost clients such as kubectl-cost send on every call) is accepted and said.

Mapping: a training job is OpenCost's controller: its name the controller the Kubernetes path
read (else the job's name), its kind the controlling owner's, lower-cased as OpenCost writes it;
`namespace`, `cluster` and `team` are the job's attribution (the cluster the API's `--cluster`
where it has none); every other meta field is a label. A name holds no `/` (OpenCost clients
split names on it): a value's `/` is written `%2F` (and `%` `%25`). Only GPU time is costed:
CPU, RAM, storage, network and load-balancer fields are 0, and `totalCost` equals `gpuCost`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from costexporter.api import windows
from costexporter.api.windows import Window
from costexporter.core.buckets import BUCKET_S
from costexporter.core.cost import MICRO_PER_UNIT, cost_per_valid_step
from costexporter.core.timeutil import iso_utc

UNALLOCATED = "__unallocated__"
IDLE = "__idle__"
MAX_SETS = 1000  # steps in one answer

# Parameters OpenCost defines that this API cannot honour, and why (each a 400 naming it).
NOT_HONOURED = {
    "accumulateBy": "use accumulate=true (one set) or step=<duration> (one set per step)",
    "offset": "give the window as an RFC 3339 or Unix-seconds pair instead",
}
HONOURED = (
    "window",
    "aggregate",
    "step",
    "accumulate",
    "filter",
    "includeIdle",
    "idle",  # OpenCost's older name of includeIdle (kubectl-cost sends both)
    "shareIdle",
    "filterNamespaces",  # OpenCost's v1 namespace filter (kubectl-cost -n): comma-separated names
)


def _false(v: str) -> bool:
    return v.strip().lower() in ("", "0", "f", "false")


def _empty(v: str) -> bool:
    return not v.strip()


def _within_bucket(v: str) -> bool:
    t = v.strip()
    parts = _DUR.findall(t)
    if not t:
        return True
    return (
        bool(parts)
        and "".join(n + u for n, u in parts) == t
        and sum(int(n) * _DUR_S[u] for n, u in parts) <= BUCKET_S
    )


# Parameters OpenCost defines whose value here may change nothing: (that value, why; another
# value is a 400 naming the parameter).
NO_OP: dict[str, tuple[Callable[[str], bool], str]] = {
    "resolution": (
        _within_bucket,
        "the ledger is exact to the millisecond: a resolution up to 5m changes nothing",
    ),
    "idleByNode": (_false, "idle GPU time is not split by node"),
    "sharelb": (_false, "no load balancers are costed"),
    "includeProportionalAssetResourceCosts": (_false, "assets are not costed"),
    "includeAggregatedMetadata": (_false, "aggregated metadata is not kept"),
    "includeSharedCostBreakdown": (_false, "shared costs are not split"),
    "reconcile": (_false, "there is no cloud bill to reconcile against"),
    "shareTenancyCosts": (_false, "shared costs are not split"),
    "filterClusters": (_empty, 'use filter=cluster:"<name>"'),
    "filterControllers": (_empty, 'use filter=controllerName:"<name>"'),
    "filterLabels": (_empty, 'use filter=label[<name>]:"<value>"'),
    "shareNamespaces": (_empty, "shared costs are not split"),
    "shareLabels": (_empty, "shared costs are not split"),
    "shareCost": (lambda v: v.strip() in ("", "0"), "shared costs are not split"),
    "shareSplit": (lambda v: v.strip().lower() in ("", "weighted", "even"), "shared costs are not split"),
}

# aggregate -> why it is refused (OpenCost properties the ledger does not book by)
AGG_REFUSED = {
    "service": "services are not recorded",
    "providerid": "provider IDs are not recorded",
    "department": "use label:<name> with the meta field that holds it",
    "environment": "use label:<name> with the meta field that holds it",
    "owner": "use label:<name> with the meta field that holds it",
    "product": "use label:<name> with the meta field that holds it",
}
AGG_FIELDS = ("cluster", "namespace", "controller", "controllerkind", "team")
# OpenCost's per-kind aggregates: the controller's name where its kind is that one, else
# `__unallocated__` (as OpenCost has a pod without a deployment).
KIND_FIELDS = ("deployment", "statefulset", "daemonset", "job")
# Finer than the ledger books: every allocation's value is `__unallocated__`, and said.
FINER_FIELDS = {
    "pod": "the ledger books GPU time per training job, not per pod",
    "container": "the ledger books GPU time per training job, not per container",
    "node": "the ledger books GPU time per training job, not per node",
}
LABEL_RE = re.compile(r"^label:(.{1,100})$")


class OpenCostError(ValueError):
    """A request this API cannot answer as asked (a 400): the message says why and what works."""


def sanitize(name: str) -> str:
    """A label name as Prometheus (and OpenCost) write it: every other character an underscore."""
    return re.sub(r"[^A-Za-z0-9_]", "_", name)


# ---- parameters -------------------------------------------------------------------------------


def check_params(items: list[tuple[str, str]], notes: list[str] | None = None) -> dict[str, str]:
    """The query's parameters, each once; a parameter this API does not honour is an error, one
    whose value changes nothing here is left out (said in `notes` unless it is empty)."""
    out: dict[str, str] = {}
    seen: set[str] = set()
    for k, v in items:
        if k in seen:
            raise OpenCostError(f"parameter {k!r} given more than once")
        seen.add(k)
        if k in NO_OP:
            changes_nothing, why = NO_OP[k]
            if not changes_nothing(v):
                raise OpenCostError(f"parameter {k}={v!r} is not supported: {why}")
            if v.strip() and notes is not None:
                notes.append(f"{k}={v} changes nothing here ({why})")
            continue
        if k in NOT_HONOURED:
            raise OpenCostError(f"parameter {k!r} is not supported: {NOT_HONOURED[k]}")
        if k not in HONOURED:
            known = ", ".join([*HONOURED, *NO_OP])
            raise OpenCostError(f"parameter {k!r} is not supported; supported: {known}")
        out[k] = v
    return out


def include_idle(q: Mapping[str, str]) -> bool:
    """`includeIdle`, or OpenCost's older `idle`; both given, they agree."""
    a = parse_bool("includeIdle", q.get("includeIdle"), False)
    b = parse_bool("idle", q.get("idle"), a)
    if q.get("includeIdle") and q.get("idle") and a != b:
        raise OpenCostError(f"includeIdle={q['includeIdle']} and idle={q['idle']} disagree")
    return a or b


def namespaces_filter(text: str | None) -> Pred | None:
    """OpenCost's v1 `filterNamespaces=a,b`: the jobs of those namespaces (empty: no filter)."""
    names = {n.strip() for n in (text or "").split(",") if n.strip()}
    if not names:
        return None
    return lambda p: p.namespace in names


def parse_bool(name: str, text: str | None, default: bool) -> bool:
    """OpenCost's boolean parameters (Go's strconv.ParseBool); anything else is an error."""
    if text is None or text == "":
        return default
    t = text.strip()
    if t in ("1", "t", "T", "true", "TRUE", "True"):
        return True
    if t in ("0", "f", "F", "false", "FALSE", "False"):
        return False
    raise OpenCostError(f"{name}={text!r} is not a boolean (true or false)")


_DUR = re.compile(r"(\d{1,7})(ms|s|m|h|d|w)")
_DUR_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_step(text: str) -> int:
    """A step duration (`1h`, `2h`, `24h`, `1d`, `1w`, `90m`, `1h30m`) in seconds: a whole
    number of the ledger's 5-minute buckets."""
    t = text.strip()
    parts = _DUR.findall(t)
    if not parts or "".join(n + u for n, u in parts) != t:
        raise OpenCostError(f"step {text!r} is not a duration (e.g. 1h, 2h, 24h, 1d, 1w, 1h30m)")
    secs = sum(int(n) * _DUR_S[u] for n, u in parts)
    if secs <= 0 or secs % BUCKET_S:
        raise OpenCostError(f"step {text!r} must be a positive multiple of 5m (the ledger's buckets)")
    return int(secs)


def parse_window(text: str | None, tz: str = "UTC", now: float | None = None) -> Window:
    """OpenCost's windows (`windows.parse_window` with OpenCost's alignment): `today`,
    `yesterday`, `week` and `lastweek` (weeks start on Sunday), `month`, `lastmonth`, durations
    (`45m`, `24h`, `7d`, `2w`: the last N units, ending at the end of the current unit; minutes
    end at the end of the current 5 minutes) and RFC 3339 or Unix-seconds pairs `start,end`.
    Calendar words are taken in `tz`; a window that ends "now" ends at the end of the current 5
    minutes (nothing is booked later). Required."""
    try:
        return windows.parse_window(text, tz, now, default=None, align=windows.OPENCOST)
    except windows.WindowError as e:
        raise OpenCostError(str(e)) from None


def periods(w: Window, step_s: int | None, accumulate: bool) -> list[tuple[int, int]]:
    """The sets of the answer: one for the whole window (accumulate, or no step), else one per
    step from the window's start (the last one cut at the window's end)."""
    if accumulate or step_s is None or step_s >= w.end - w.start:
        return [(w.start, w.end)]
    if (w.end - w.start) / step_s > MAX_SETS:
        raise OpenCostError(f"this step over this window makes more than {MAX_SETS} sets: use a larger step")
    return [(t, min(t + step_s, w.end)) for t in range(w.start, w.end, step_s)]


# ---- aggregate ----------------------------------------------------------------------------------


def parse_aggregate(text: str | None) -> list[str]:
    """`controller`, `namespace`, `cluster`, `controllerKind`, `team`, `label:<name>`, or several
    comma-combined; `all` is one allocation of everything. Default: controller (a training job;
    OpenCost's default, per container, is finer than the ledger books)."""
    if text is None or not text.strip():
        return ["controller"]
    items = [a.strip() for a in text.split(",") if a.strip()]
    if items == ["all"]:
        return []
    out: list[str] = []
    for a in items:
        low = a.lower()
        if low in AGG_FIELDS or low in KIND_FIELDS or low in FINER_FIELDS:
            f = low
        elif m := LABEL_RE.match(a):
            f = "label:" + sanitize(m.group(1).strip())
        elif low.startswith("annotation:"):
            raise OpenCostError(f"aggregate {a!r} is not supported: annotations are not recorded")
        elif low in AGG_REFUSED:
            raise OpenCostError(f"aggregate {a!r} is not supported: {AGG_REFUSED[low]}")
        else:
            raise OpenCostError(
                f"aggregate {a!r} is not supported; supported: all, cluster, namespace, controller, "
                "controllerKind, team, label:<name> (comma-combined)"
            )
        if f not in out:
            out.append(f)
    return out


# ---- a job's properties -------------------------------------------------------------------------


@dataclass(frozen=True)
class JobProps:
    job: str
    cluster: str
    namespace: str
    kind: str  # lower-cased, as OpenCost writes controller kinds
    team: str
    labels: dict[str, str] = field(default_factory=dict)
    controller: str = ""  # the controller's name as the Kubernetes path read it ('' : the job's)

    @property
    def name(self) -> str:
        return self.controller or self.job

    def get(self, f: str) -> str:
        """The value of an aggregate or filter field ('' when the job has none)."""
        if f == "cluster":
            return self.cluster
        if f == "namespace":
            return self.namespace
        if f in ("controller", "controllername"):
            return self.name
        if f == "controllerkind":
            return self.kind
        if f == "team":
            return self.team
        if f in KIND_FIELDS:
            return self.name if self.kind == f else ""
        if f in FINER_FIELDS:
            return ""
        if f.startswith("label:"):
            return self.labels.get(f[6:], "")
        raise KeyError(f)


# meta fields that are properties, not labels
PROPERTY_META = ("cluster", "namespace", "controller", "controller_kind")


def job_props(job: str, meta: Mapping[str, object], cluster: str | None) -> JobProps:
    def s(k: str) -> str:
        v = meta.get(k)
        return v if isinstance(v, str) else ""

    labels = {
        sanitize(k): v for k, v in meta.items() if isinstance(v, str) and v != "" and k not in PROPERTY_META
    }
    home = s("cluster") or (cluster or "")
    kind = s("controller_kind").lower()
    return JobProps(job, home, s("namespace"), kind, s("team"), labels, s("controller"))


def escape(value: str) -> str:
    """A value as one part of an allocation's name: OpenCost clients split names on `/`."""
    return value.replace("%", "%25").replace("/", "%2F")


def key_of(fields: list[str], p: JobProps) -> str:
    """The allocation's name as OpenCost makes it: the fields' values joined by '/', a missing
    one `__unallocated__`; a controller with a kind is `<kind>:<name>`; a value's `/` escaped."""
    names = []
    for f in fields:
        v = p.get(f)
        if f == "controller" and p.kind:
            v = f"{p.kind}:{v}"
        names.append(escape(v) if v else UNALLOCATED)
    return "/".join(names)


def properties(members: list[JobProps]) -> dict[str, Any]:
    """OpenCost's `properties`: the values every member shares (labels: the shared pairs)."""
    first = members[0]
    out: dict[str, object] = {}
    getters: tuple[tuple[str, Callable[[JobProps], object]], ...] = (
        ("cluster", lambda p: p.cluster),
        ("namespace", lambda p: p.namespace),
        ("controller", lambda p: p.name),
        ("controllerKind", lambda p: p.kind),
    )
    for name, get in getters:
        v = get(first)
        if v and all(get(p) == v for p in members[1:]):
            out[name] = v
    labels = dict(first.labels)
    for p in members[1:]:
        labels = {k: v for k, v in labels.items() if p.labels.get(k) == v}
    if labels:
        out["labels"] = labels
    return out


# ---- filter (OpenCost's filter language, v2) ----------------------------------------------------

FILTER_FIELDS = {
    "cluster": "cluster",
    "namespace": "namespace",
    "controllername": "controllername",
    "controllerkind": "controllerkind",
    "team": "team",
}
FILTER_REFUSED = ("node", "pod", "container", "provider", "services", "annotation", "department",
                  "environment", "owner", "product")  # fmt: skip
_OPS = ("!~>:", "!<~:", "!~:", "~>:", "<~:", "!:", "~:", ":")
_TOKEN = re.compile(
    r'\s*(?:(?P<op>!~>:|!<~:|!~:|~>:|<~:|!:|~:|:)|(?P<punct>[()+|,])|"(?P<str>[^"]*)"'
    r"|\[(?P<key>[^\]]*)\]|(?P<ident>[A-Za-z_][A-Za-z0-9_.\-]*))"
)

Pred = Callable[[JobProps], bool]


def _compare(op: str, value: str, want: str) -> bool:
    neg = op.startswith("!")
    core = op.lstrip("!")
    if core == ":":
        hit = value == want
    elif core == "~:":
        hit = want in value
    elif core == "<~:":
        hit = value.startswith(want)
    else:  # "~>:"
        hit = value.endswith(want)
    return not hit if neg else hit


def parse_filter(text: str | None) -> Pred | None:
    """OpenCost's v2 filter: comparisons `field<op>"v1","v2"` (ops `:` `!:` `~:` `!~:` `<~:`
    `!<~:` `~>:` `!~>:`), fields namespace, controllerName, controllerKind, cluster, team and
    label[<name>], joined by `+` (and) or `|` (or), one of them per parenthesised group. None:
    no filter."""
    if text is None or not text.strip():
        return None
    toks: list[tuple[str, str]] = []
    pos, src = 0, text.strip()
    while pos < len(src):
        m = _TOKEN.match(src, pos)
        if not m or m.end() == pos:
            raise OpenCostError(f"filter {text!r}: cannot read it at {src[pos : pos + 20]!r}")
        kind = m.lastgroup or ""
        toks.append((kind, m.group(kind)))
        pos = m.end()
        while pos < len(src) and src[pos].isspace():
            pos += 1
    toks.append(("eof", ""))
    i = 0

    def peek() -> tuple[str, str]:
        return toks[i]

    def take() -> tuple[str, str]:
        nonlocal i
        t = toks[i]
        i += 1
        return t

    def comparison() -> Pred:
        kind, name = take()
        if kind != "ident":
            raise OpenCostError(f"filter {text!r}: expected a field name, found {name!r}")
        low = name.lower()
        if low == "label":
            k, key = take()
            if k != "key" or not key.strip():
                raise OpenCostError(f'filter {text!r}: label needs a key, e.g. label[app]:"x"')
            fld = "label:" + sanitize(key.strip())
        elif low in FILTER_FIELDS:
            fld = FILTER_FIELDS[low]
        elif low in FILTER_REFUSED:
            raise OpenCostError(f"filter field {name!r} is not supported: the ledger does not record it")
        else:
            raise OpenCostError(
                f"filter field {name!r} is not known; supported: cluster, namespace, controllerName, "
                "controllerKind, team, label[<name>]"
            )
        k, op = take()
        if k != "op":
            raise OpenCostError(f"filter {text!r}: expected an operator after {name!r}, found {op!r}")
        values = []
        while True:
            k, v = take()
            if k != "str":
                raise OpenCostError(f"filter {text!r}: expected a quoted value after {op!r}")
            values.append(v)
            if peek() == ("punct", ","):
                take()
                continue
            break
        if op.startswith("!"):  # a negated list: none of them
            return lambda p: all(_compare(op, p.get(fld), v) for v in values)
        return lambda p: any(_compare(op, p.get(fld), v) for v in values)

    def group(depth: int) -> Pred:
        parts: list[Pred] = []
        sep: str | None = None
        while True:
            if peek() == ("punct", "("):
                take()
                parts.append(group(depth + 1))
                if take() != ("punct", ")"):
                    raise OpenCostError(f"filter {text!r}: '(' without matching ')'")
            else:
                parts.append(comparison())
            nxt = peek()
            if nxt in (("punct", "+"), ("punct", "|")):
                if sep is not None and nxt[1] != sep:
                    raise OpenCostError(f"filter {text!r}: mix of '+' and '|' in one group: add parentheses")
                sep = nxt[1]
                take()
                continue
            break
        if len(parts) == 1:
            return parts[0]
        if sep == "+":
            return lambda p: all(f(p) for f in parts)
        return lambda p: any(f(p) for f in parts)

    pred = group(0)
    if peek()[0] != "eof":
        raise OpenCostError(f"filter {text!r}: unexpected {peek()[1]!r}")
    return pred


# ---- allocations --------------------------------------------------------------------------------


def _r(x: float) -> float:
    return round(x, 6)


@dataclass
class Sums:
    """Integer amounts of a group over one set: GPU milliseconds and micro-units of money."""

    ms: int = 0
    valid_ms: int = 0
    wasted_ms: int = 0
    ucost: int = 0
    wasted_ucost: int = 0
    valid_steps: int = 0

    def add(self, o: Sums) -> None:
        self.ms += o.ms
        self.valid_ms += o.valid_ms
        self.wasted_ms += o.wasted_ms
        self.ucost += o.ucost
        self.wasted_ucost += o.wasted_ucost
        self.valid_steps += o.valid_steps


ZERO_FIELDS = (
    "cpuCores", "cpuCoreRequestAverage", "cpuCoreLimitAverage", "cpuCoreUsageAverage", "cpuCoreHours",
    "cpuCost", "cpuCostAdjustment", "cpuCostIdle", "cpuEfficiency", "networkTransferBytes",
    "networkReceiveBytes", "networkCost", "networkCrossZoneCost", "networkCrossRegionCost",
    "networkInternetCost", "networkCostAdjustment", "loadBalancerCost", "loadBalancerCostAdjustment",
    "pvBytes", "pvByteHours", "pvCost", "pvCostAdjustment", "ramBytes", "ramByteRequestAverage",
    "ramByteLimitAverage", "ramByteUsageAverage", "ramByteHours", "ramCost", "ramCostAdjustment",
    "ramCostIdle", "ramEfficiency", "externalCost", "sharedCost",
)  # fmt: skip


def allocation(name: str, props: dict[str, Any], start: int, end: int, s: Sums) -> dict[str, Any]:
    """One allocation in OpenCost's JSON shape (numbers are numbers; money in the API's currency)."""
    minutes = (end - start) / 60
    hours = s.ms / 3_600_000
    cost = s.ucost / 1_000_000
    eff = _r(s.valid_ms / s.ms) if s.ms else 0.0
    out: dict[str, object] = {
        "name": name,
        "properties": props,
        "window": {"start": iso_utc(start), "end": iso_utc(end)},
        "start": iso_utc(start),
        "end": iso_utc(end),
        "minutes": _r(minutes),
    }
    out.update(dict.fromkeys(ZERO_FIELDS[:9], 0.0))
    out.update(
        {
            "gpuCount": _r(hours / (minutes / 60)) if minutes else 0.0,
            "gpuHours": _r(hours),
            "gpuCost": _r(cost),
            "gpuCostAdjustment": 0.0,
            "gpuCostIdle": 0.0,
            "gpuEfficiency": eff,
        }
    )
    out.update(dict.fromkeys(ZERO_FIELDS[9:], 0.0))
    out["pvs"] = None
    out["totalCost"] = _r(cost)
    out["totalEfficiency"] = eff
    out["proportionalAssetResourceCosts"] = {}
    out["lbAllocations"] = None
    out["sharedCostBreakdown"] = {}
    out["gpuAllocation"] = None
    # costexporter's own figures (OpenCost clients ignore fields they do not know)
    out["validGpuHours"] = _r(s.valid_ms / 3_600_000)
    out["wastedGpuHours"] = _r(s.wasted_ms / 3_600_000)
    out["wastedCost"] = _r(s.wasted_ucost / 1_000_000)
    out["validSteps"] = s.valid_steps
    per_step = cost_per_valid_step(s.ucost, s.valid_steps)  # the one rule (core/cost.py)
    out["costPerValidStep"] = per_step / MICRO_PER_UNIT if per_step is not None else None
    return out


def allocation_set(
    jobs: list[tuple[JobProps, Sums]], fields: list[str], start: int, end: int, idle: Sums | None
) -> dict[str, dict[str, Any]]:
    """One set: the jobs grouped by their key (sorted by name), and `__idle__` (GPU time no job
    registered) when asked for."""
    groups: dict[str, tuple[list[JobProps], Sums]] = {}
    for p, s in jobs:
        k = key_of(fields, p)
        g = groups.get(k)
        if g is None:
            groups[k] = ([p], Sums(**vars(s)))
        else:
            g[0].append(p)
            g[1].add(s)
    out = {k: allocation(k, properties(m), start, end, s) for k, (m, s) in sorted(groups.items())}
    if idle is not None:
        out[IDLE] = allocation(IDLE, {}, start, end, idle)
    return out


def envelope(data: list[dict[str, dict[str, Any]]], warnings: list[str]) -> dict[str, Any]:
    body: dict[str, object] = {"code": 200, "status": "success", "data": data}
    if warnings:
        body["warning"] = "; ".join(warnings)
    return body


def error(status: int, message: str) -> dict[str, Any]:
    """OpenCost's error body, with FastAPI's `detail` beside its `message`."""
    return {"code": status, "status": "error", "message": message, "detail": message}
