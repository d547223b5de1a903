"""A past run's steps from its TensorBoard event files, as rank 0's step events for replay.

TensorBoard holds what the trainer logged: a tag's values with their step and wall time, every
N steps. How they map onto the run model:

* each logged step is rank 0's step completed at its wall time;
* the steps between two logged ones (N - 1 of them when it logs every N) completed in between:
  they are counted, spread evenly over the interval (their count is known, their times are not);
* a logged step at or below one already logged is a restart from a checkpoint: an implicit
  resume, which voids the steps above it, as the trainer's own events would say;
* TensorBoard has no run events: no clean end, no crash record; the run ends with the trace.

Read with TensorBoard's own event reader (the `tensorboard` package, an optional extra).
"""

from __future__ import annotations

from pathlib import Path

from costexporter.core import timeutil
from costexporter.core.diagnostics import InputError
from costexporter.core.model import Event

SESSION = "replay-tensorboard"
MAX_FILL = 100_000  # the most steps spread between two logged ones (a gap beyond: logged only)


def logged_steps(path: Path, tag: str) -> list[tuple[float, int]]:
    """(wall time, step) of each value of `tag` in the event files under `path` (a run's
    directory, or one event file), in file order."""
    try:
        from tensorboard.backend.event_processing import event_accumulator as ea
    except ImportError:
        raise InputError(
            "reading TensorBoard logs needs the tensorboard package: pip install 'costexporter[tensorboard]'"
        ) from None
    if not path.exists():
        raise InputError(f"{path}: no such file or directory")
    acc = ea.EventAccumulator(str(path), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
    try:
        acc.Reload()
    except Exception as e:  # noqa: BLE001 - a corrupt file: one line, whatever TensorBoard raised
        raise InputError(f"{path}: cannot read TensorBoard events: {e}") from None
    tags = acc.Tags()
    if tag in tags.get("scalars", []):
        return [(e.wall_time, int(e.step)) for e in acc.Scalars(tag)]
    if tag in tags.get("tensors", []):
        return [(e.wall_time, int(e.step)) for e in acc.Tensors(tag)]
    have = sorted(set(tags.get("scalars", [])) | set(tags.get("tensors", [])))
    raise InputError(f"{path}: no tag {tag!r} (tags: {', '.join(have[:20]) or 'none'})")


def step_events(logged: list[tuple[float, int]], job: str) -> list[Event]:
    """Rank 0's step events for the logged steps, the steps between them filled in (above)."""
    out: list[Event] = []
    prev: tuple[int, int] | None = None  # (ms, step) of the last logged step
    for wall, step in logged:
        ms = timeutil.to_ms(wall)
        if prev is not None and step > prev[1] + 1 and ms > prev[0]:
            gap = step - prev[1]
            if gap <= MAX_FILL:
                for k in range(1, gap):
                    at = prev[0] + (ms - prev[0]) * k // gap
                    out.append(Event("step", job, at, 0, SESSION, -1, {"step": prev[1] + k}))
        out.append(Event("step", job, ms, 0, SESSION, -1, {"step": step}))
        prev = (ms, step)
    return out
