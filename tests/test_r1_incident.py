"""R1 rebuilt: the 3-hour silent deadlock at the end-of-epoch checkpoint."""

from __future__ import annotations

import pytest

from costexporter.core.baseline import utilization_rule
from costexporter.core.replay import replay
from costexporter.sources import synth


@pytest.fixture(scope="module")
def r1():
    b = synth.r1_incident()
    samples = b.samples()
    return samples, b.events, replay(samples, b.events)["jobs"]["qwen3-32b-ft"]


def test_deadlock_books_48_gpu_hours_stalled(r1):
    _, _, job = r1
    # 16 GPUs x 3 h = 48 GPU-h (R6: "~48 GPU·h stalled"), within 1%.
    assert job["gpu_hours"]["stalled"] == pytest.approx(48.0, rel=0.01)
    assert job["band_gpu_hours"]["deadlock"] == pytest.approx(48.0, rel=0.01)
    assert job["steps_completed"] == 3850
    assert job["valid_steps"] == 3850
    assert job["steps_voided"] == 0
    # One incident, the whole job, both hosts.
    stalled = [i for i in job["incidents"] if i["category"] == "stalled"]
    assert len(stalled) == 1
    assert stalled[0]["ranks"] == list(range(16))
    assert stalled[0]["hosts"] == ["node0", "node1"]
    assert stalled[0]["band"] == "deadlock"
    assert stalled[0]["end"] - stalled[0]["start"] == pytest.approx(3 * 3600, abs=5)


def test_utilization_rule_counts_the_deadlock_as_useful(r1):
    samples, _, job = r1
    naive = utilization_rule(samples)
    deadlock_start = max(e.ts for e in r1[1] if e.type == "step")
    in_deadlock = samples.ts_ms >= deadlock_start * 1000
    sub = type(samples)(
        samples.gpus,
        samples.gpu[in_deadlock],
        samples.ts_ms[in_deadlock],
        samples.power_w[in_deadlock],
        samples.util_pct[in_deadlock],
        samples.energy_mj[in_deadlock],
    )
    naive_deadlock = utilization_rule(sub)
    print(
        f"\nR1 deadlock (3 h x 16 GPUs): utilization>60% rule counts "
        f"{naive_deadlock['useful_gpu_hours']:.2f} GPU-h useful; costexporter books "
        f"{job['gpu_hours']['stalled']:.2f} GPU-h stalled"
    )
    valid = sum(job["gpu_hours"][c] for c in ("productive", "communication", "starved"))
    print(
        f"whole job: rule useful {naive['useful_gpu_hours']:.2f} GPU-h, costexporter valid {valid:.2f} GPU-h"
    )
    # 15 of 16 ranks spin at 100%: the naive rule calls 45 GPU-h of the deadlock useful.
    assert naive_deadlock["useful_gpu_hours"] == pytest.approx(45.0, rel=0.01)
    assert naive["useful_gpu_hours"] > valid + 44
