"""The R4 fix for trainers: stop every rank at the same batch count.

R4 (docs/background.md): ranks packed into fixed-size blocks got different block counts (30,835 to 30,888);
the rank with fewest left the loop for the save barrier while the rest waited in the gradient
all-reduce, and the job hung for 3 hours. All-reduce the per-rank count with MIN before the loop
and every rank stops together:

    n = even_batches(len(loader))            # after init_process_group
    for i, batch in zip(range(n), loader):
        ...
"""

from __future__ import annotations

from typing import Any


def even_batches(count: int, group: Any = None) -> int:  # a torch ProcessGroup
    """The global minimum of `count` over the ranks of `group` (every rank must call it)."""
    # torch is no dependency (the user installs the build they need), so mypy may not find it;
    # where it is installed the ignore is unused, hence both codes.
    import torch  # type: ignore[import-not-found, unused-ignore]
    import torch.distributed as dist  # type: ignore[import-not-found, unused-ignore]

    if not (dist.is_available() and dist.is_initialized()):
        return int(count)
    backend = dist.get_backend(group)
    device = "cuda" if backend == "nccl" and torch.cuda.is_available() else "cpu"
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    t = torch.tensor([int(count)], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())
