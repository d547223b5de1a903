"""The live agent's incidents, GPU time at risk and job figures equal the offline replay's on the
same samples and events (both books call costexporter.figures, so they cannot drift).

The live side is the pure round: `book_window` + `ledger_delta` chained over booking rounds as
the agent runs them (no Redis); the offline side is `replay`'s JSON report.
"""

from __future__ import annotations

import numpy as np
import pytest

from costexporter.core import goodput, profiles
from costexporter.core.booking import BookingConfig
from costexporter.core.cost import MS_PER_HOUR, Prices
from costexporter.core.live import JobState, book_window, ledger_delta
from costexporter.core.model import JOB_CODES, VALID_CODES
from costexporter.core.replay import ReplayConfig, replay
from costexporter.sources.synth import TraceBuilder

PRICE = 3.5
GRID_MS = int(BookingConfig().grid_s * 1000)
TOL_MS = 2 * GRID_MS  # replay merges wasted pieces within two grid steps; the live round the same


def scenario(kind: str, seed: int = 3) -> TraceBuilder:
    b = TraceBuilder(n_gpus=4, per_host=2, job="same", seed=seed)
    b.run("start")
    b.stretch("compute", 120, step_s=5)
    if kind == "deadlock":
        b.stretch("deadlock", 60, zero_ranks=(seed % 4,))
        b.stretch("compute", 60, step_s=5)
    elif kind == "checkpoint":
        b.phase("checkpoint", "begin")
        b.stretch("checkpoint", 90, zero_ranks=(0,))
        b.phase("checkpoint", "end", step=b.step)
        b.stretch("compute", 60, step_s=5)
    elif kind == "resume":
        b.stretch("idle", 30)
        b.run("resume", step=10)
        b.stretch("compute", 90, step_s=5)
    elif kind == "hung":
        b.phase("checkpoint", "begin")
        b.stretch("checkpoint", 1500, zero_ranks=(0,))
    elif kind == "crash":  # the trainer says it crashed; a restart resumes from a checkpoint
        b.stretch("idle", 20)
        b.event("run", state="crash", exit="uncaught RuntimeError")
        b.stretch("idle", 40)
        b.run("resume", step=10)
        b.stretch("compute", 60, step_s=5)
    elif kind == "stalls":  # two separate wasted stretches of one category
        b.stretch("deadlock", 60, zero_ranks=(1,))
        b.stretch("compute", 60, step_s=5)
        b.stretch("deadlock", 60, zero_ranks=(3,))
        b.stretch("compute", 30, step_s=5)
    b.run("end")
    b.stretch("idle", 5)
    return b


def live_rounds(b: TraceBuilder, rounds_s: float, hardware: list | None = None) -> dict:
    """Book `b` round by round as one agent owning every rank: the incidents as the ledger
    stores them (one record per category and start, the last version written), every booked
    piece, and the last round's figures and GPU time at risk. `hardware`: (rank, HardwareEvent)
    that the agent's source read, each handed to the rounds from its time on."""
    s = b.samples()
    events = sorted(b.events, key=lambda e: e.ts)
    start, end = int(b.t0 * 1000), int(b.t * 1000)
    own = np.arange(b.n_gpus)
    state, now = JobState(booked_until=start), start
    stored: dict[str, dict] = {}
    pieces = []
    last = None
    while now < end + 30_000:
        now += int(rounds_s * 1000)
        seen = s.ts_ms <= now
        res = book_window(
            events=[e for e in events if e.ts_ms <= now],
            cfg=BookingConfig(),
            profile=profiles.B300,
            job_start_ms=start,
            rank=s.gpu.astype(np.int64)[seen],
            ts_ms=s.ts_ms[seen],
            power_w=s.power_w[seen],
            util_pct=s.util_pct[seen],
            energy_mj=s.energy_mj[seen],
            n_ranks=b.n_gpus,
            own_ranks=own,
            member_start_ms=np.full(own.size, start),
            booked_until_ms=state.booked_until,
            now_ms=min(now, end),
        )
        if res.horizon_ms <= state.booked_until:
            continue
        last = ledger_delta(
            state,
            res,
            prices=Prices(price_per_gpu_hour=PRICE),
            own_ranks=own,
            member_start_ms=np.full(own.size, start),
            job_start_ms=start,
            last_progress_ms=start,
            host="h",
            incident_tol_ms=TOL_MS,
            hardware=[(r, e) for r, e in hardware or () if e.ts_ms <= now],
        )
        for inc in last.incidents.values():
            stored[f"{inc['category']}:{inc['start']}"] = inc
        pieces.append(res.pieces)
        state = last.state
    assert last is not None
    return {
        "incidents": stored,
        "pieces": pieces,
        "figures": last.figures,
        "at_risk_ms": last.at_risk_ms,
        "state": state,
    }


def piece_cost(pieces: list, category: str, start_ms: int, end_ms: int) -> float:
    """What the live rounds booked in one category inside [start, end), priced as replay does."""
    from costexporter.core.model import CATEGORIES

    c = CATEGORIES.index(category)
    ms = mj = 0.0
    for p in pieces:
        sel = (p.category == c) & (p.start_ms >= start_ms) & (p.end_ms <= end_ms)
        ms += float((p.end_ms[sel] - p.start_ms[sel]).sum())
        mj += float(np.nan_to_num(p.energy_mj[sel]).sum())
    return float(Prices(price_per_gpu_hour=PRICE).cost(np.array([ms]), np.array([mj]), np.array([c]))[0])


@pytest.mark.parametrize("kind", ["deadlock", "checkpoint", "resume", "hung", "stalls", "crash"])
@pytest.mark.parametrize("rounds_s", [1.0, 2.0])
def test_live_and_replay_give_the_same_incidents_at_risk_and_figures(kind, rounds_s):
    b = scenario(kind)
    report = replay(b.samples(), b.events, ReplayConfig(prices=Prices(price_per_gpu_hour=PRICE)))
    [job] = report["jobs"].values()
    live = live_rounds(b, rounds_s)

    # Figures: the same function on the same events.
    figs = live["figures"]
    for k in ("steps_completed", "steps_voided", "valid_steps", "tokens", "stall_threshold_s"):
        assert job[k] == figs[k], k
    assert (job["last_checkpoint_step"] if job["last_checkpoint_step"] is not None else -1) == figs[
        "last_checkpoint_step"
    ]
    # Goodput: the one function over the live ledger's net amounts (a resume's voided valid time
    # moved to rolled_back) and the job's span as its figures date it, against replay's.
    st = live["state"]
    booked, voided = st.booked[:, 0], st.voided[:, 0]
    valid_ms = float(booked[VALID_CODES].sum() - voided.sum())
    held_ms = float(booked[JOB_CODES].sum() - voided.sum())
    end_ms = round(figs["end_ts"] * 1000) or None
    span = goodput.JobSpan(round(figs["start_ts"] * 1000), end_ms, b.n_gpus)
    on = goodput.job_goodput(valid_ms, held_ms, span, (span.start_ms, end_ms or st.booked_until))
    for layer in ("runtime", "ettr"):
        assert on.report()[layer] == pytest.approx(job["goodput"][layer], rel=1e-9), layer
    assert job["goodput"]["runtime"] is not None and job["goodput"]["ettr"] <= job["goodput"]["runtime"]
    # GPU time at risk since the last checkpoint, at the job's end.
    assert job["gpu_hours_at_risk"] * MS_PER_HOUR == pytest.approx(live["at_risk_ms"], abs=1e-6)

    # Incidents: the same stretches, ranks, deadlock ranks and GPU time; the replay's GPUs are
    # the ranks' registered GPUs, and its cost is what the live rounds booked in the stretch.
    # Rolled-back time is a correction in the live ledger (the resume moves amounts booked valid
    # already), replay's rolled_back pieces: the same stretch and GPU time either way.
    offline = job["incidents"]
    online = sorted(live["incidents"].values(), key=lambda i: (i["start"], i["category"]))
    assert [
        (
            i["category"],
            round(i["start"] * 1000),
            round(i["end"] * 1000),
            i["ranks"],
            i["zero_util_ranks"],
            i["cause"],
            i["cause_why"],
        )
        for i in offline
    ] == [
        (i["category"], i["start"], i["end"], i["ranks"], i["zero_util_ranks"], i["cause"], i["cause_why"])
        for i in online
    ]
    assert [round(i["gpu_hours"] * MS_PER_HOUR) for i in offline] == [i["gpu_ms"] for i in online]
    registered = {e.rank: (str(e.get("host")), int(e.get("gpu"))) for e in b.events if e.type == "register"}
    for off, on in zip(offline, online, strict=True):
        assert [(g["host"], g["gpu"]) for g in off["gpus"]] == [registered[r] for r in on["ranks"]]
        # A rolled-back stretch costs what the live rounds had booked valid inside it.
        cats = (
            ["productive", "communication", "starved"]
            if on["category"] == "rolled_back"
            else [on["category"]]
        )
        cost = sum(piece_cost(live["pieces"], c, on["start"], on["end"]) for c in cats)
        assert off["cost"] == pytest.approx(cost, abs=2e-6)
        # and the live incident carries that cost itself (the credit line prices it), each
        # round's part rounded to the micro-unit as the ledger's amounts are
        assert on["cost_micro"] / 1e6 == pytest.approx(off["cost"], abs=1e-4)
    if kind != "checkpoint":
        assert offline, "the scenario has incidents to compare"
    if kind == "resume":
        assert any(i["category"] == "rolled_back" for i in online)
    if kind in ("deadlock", "stalls", "hung"):
        assert any(i["zero_util_ranks"] for i in offline)  # the deadlock ranks were compared
    if kind == "stalls":
        assert len({i["category"] for i in offline}) < len(offline)  # two stretches of one category
    if kind == "hung":  # a checkpoint 25 minutes over its allowance: the stall is storage's
        assert {i["cause"] for i in offline if i["category"] == "stalled"} == {"storage"}
    if kind in ("deadlock", "stalls", "resume"):  # nothing says whose fault: never guessed
        assert {i["cause"] for i in offline} == {"unknown"}
    if kind == "crash":  # the stretches around the trainer's crash record are the job's own
        assert {(i["cause"], i["cause_why"]) for i in offline} == {
            ("job", "the trainer's crash record (uncaught RuntimeError)")
        }


@pytest.mark.parametrize(
    "xid, rank, at_s, want",
    [
        (79, 1, 150, ("hardware", "Xid 79: GPU has fallen off the bus on rank 1")),
        (74, 2, 170, ("network", "Xid 74: NVLink error on rank 2")),
        (
            31,
            0,
            140,
            (
                "job",
                "Xid 31: GPU memory page fault (the application touched memory it does not own) on rank 0",
            ),
        ),
        (79, 1, -5, ("unknown", "")),  # more than LEAD_MS (120 s) before the stretch
        (79, 1, 250, ("unknown", "")),  # after it
        (7, 1, 150, ("unknown", "")),  # an Xid the catalog does not name
    ],
)
def test_a_hardware_event_in_a_stretch_names_its_cause_from_the_round_that_reads_it(xid, rank, at_s, want):
    """The deadlock scenario's stall (120-180 s into the job) with an Xid read by the agent's
    source: the stretch's incident names the cause the catalog gives, on the rank it was raised
    on; an event out of the stretch, or one the catalog does not know, leaves it unknown."""
    from costexporter.core.causes import HardwareEvent

    b = scenario("deadlock", seed=1)
    ev = HardwareEvent(int(b.t0 * 1000) + at_s * 1000, rank, "xid", xid)
    live = live_rounds(b, 2.0, hardware=[(rank, ev)])
    stalls = [i for i in live["incidents"].values() if i["category"] != "rolled_back"]
    assert stalls and {(i["cause"], i["cause_why"]) for i in stalls} == {want}
