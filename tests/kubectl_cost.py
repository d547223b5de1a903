"""kubectl-cost's side of the OpenCost API, ported from its source at a pinned commit
(github.com/kubecost/kubectl-cost 3f74536): the requests each subcommand sends, how it
unmarshals the reply, and the table logic that panics on a name it cannot split. Line numbers
refer to that commit."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

COMMIT = "3f74536"

# pkg/cmd/cost.go:135-158: the aggregated subcommands and their aggregations; label.go:70 the
# label subcommand's (`node` reads the assets API, not allocations).
SUBCOMMANDS: dict[str, list[str]] = {
    "namespace": ["cluster", "namespace"],
    "deployment": ["cluster", "namespace", "deployment"],
    "controller": ["cluster", "namespace", "controller"],
    "pod": ["cluster", "namespace", "pod"],
    "label": ["cluster", "label:{label}"],
}
# cost.go:139-157: the subcommands that take -n (enableNamespaceFilter); `namespace` does not.
NAMESPACE_FLAG = {"deployment", "controller", "pod"}


def request(
    subcommand: str, *, window: str = "1d", idle: bool = True, namespace: str = "", label: str = "app"
) -> dict[str, str]:
    """The query parameters kubectl-cost sends (aggregatedcommandbuilder.go:75-82; label.go:83-90
    sends no filterNamespaces). `--idle` defaults to true (common.go:28), `--window` to 1d (:26);
    a Go map of strings sends every key, an empty value too."""
    aggregation = [a.format(label=label) for a in SUBCOMMANDS[subcommand]]
    params = {
        "window": window,
        "aggregate": ",".join(aggregation),
        "accumulate": "true",
        "includeIdle": str(idle).lower(),  # fmt.Sprintf("%t", ...)
        "idle": str(idle).lower(),
    }
    if subcommand != "label":
        params["filterNamespaces"] = namespace if subcommand in NAMESPACE_FLAG else ""
    return params


def aggregation_of(subcommand: str, label: str = "app") -> list[str]:
    return [a.format(label=label) for a in SUBCOMMANDS[subcommand]]


class Unmarshal(ValueError):
    """json.Unmarshal into allocationResponse failed (allocation.go:51-55)."""


_FLOATS = ("cpuCost", "gpuCost", "ramCost", "networkCost", "loadBalancerCost", "sharedCost", "totalCost")


def unmarshal(body: Any) -> list[dict[str, dict[str, Any]]]:
    """allocation.go:20-23: `{"code": int, "data": []map[string]opencost.Allocation}`; Go's
    decoder refuses a number given as a string, a non-string label, a time that is not RFC 3339."""
    if not isinstance(body, dict) or not isinstance(body.get("code"), int):
        raise Unmarshal("code")
    data = body.get("data")
    if not isinstance(data, list) or not all(isinstance(s, dict) for s in data):
        raise Unmarshal("data is not []map[string]Allocation")
    for allocs in data:
        for name, a in allocs.items():
            if not isinstance(a, dict) or a.get("name") != name:
                raise Unmarshal(f"{name}: not an Allocation")
            for k in _FLOATS:
                if k in a and not isinstance(a[k], (int, float)):
                    raise Unmarshal(f"{name}.{k}: {a[k]!r} is not a number")
            for k in ("start", "end"):
                datetime.fromisoformat(str(a[k]).replace("Z", "+00:00"))  # time.Time: RFC 3339
            labels = (a.get("properties") or {}).get("labels") or {}
            if not all(isinstance(v, str) for v in labels.values()):
                raise Unmarshal(f"{name}: labels are not map[string]string")
    return data


@dataclass
class Row:
    fields: list[str]
    gpu_cost: float
    total: float


def table(aggregation: list[str], allocations: dict[str, dict[str, Any]], monthly: bool = True) -> list[Row]:
    """display/output.go:265-292 (MakeAllocationTable's loop): `__idle__` fills every column
    (:282-285); any other name is split on "/" and must give one value per aggregated field,
    or it panics (:287-290). With the projected monthly rate (the default, not --historical)
    each cost is scaled by 43200 / the allocation's minutes (:276)."""
    rows = []
    for alloc in allocations.values():
        scale = 1.0
        if monthly:
            start = datetime.fromisoformat(alloc["start"].replace("Z", "+00:00"))
            end = datetime.fromisoformat(alloc["end"].replace("Z", "+00:00"))
            minutes = (end - start).total_seconds() / 60  # Allocation.Minutes()
            scale = 43200 / minutes if minutes else float("inf")
        if alloc["name"] == "__idle__":
            fields = ["__idle__"] * len(aggregation)
        else:
            fields = alloc["name"].split("/")
            if len(fields) != len(aggregation):
                raise RuntimeError(
                    f"panic: name {alloc['name']!r} split into {fields} (len {len(fields)}) should have "
                    f"the same number of fields as aggregation {aggregation} (len {len(aggregation)})"
                )
        rows.append(Row(fields, alloc["gpuCost"] * scale, alloc["totalCost"] * scale))
    return rows
