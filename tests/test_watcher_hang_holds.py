"""A hang ends with a step, not with its signature clearing: the watcher does not flap between
`hung` and `running` (each flap resolves the JobHung alert and fires it again)."""

from __future__ import annotations

from costexporter.services.watcher import decide

from .test_watcher import CFG, T0, beats, ev, live, registered, steps, view

BUSY = {0: 100.0, 1: 100.0, 2: 100.0, 3: 100.0}


def _hung_view(extra=()):
    v = view([*registered(), *steps(1, 20), *beats(300), *extra])  # last step at 100 s
    live(v, 105, BUSY, 1000.0)
    live(v, 110, {**BUSY, 3: 0.0}, 192.0)
    live(v, 115, {**BUSY, 3: 0.0}, 192.0)
    return v


def test_a_cleared_signature_without_a_step_stays_hung_until_a_step_arrives():
    v = _hung_view()
    hung = decide(v, T0 + 116, CFG)
    assert hung.state == "hung" and hung.suspect["rank"] == 3
    # an operator kills rank 3: the signature clears, every GPU idle now; no new step
    live(v, 120, {0: 0.0, 1: 0.0, 2: 0.0, 3: 0.0}, 130.0)
    live(v, 125, {0: 0.0, 1: 0.0, 2: 0.0, 3: 0.0}, 130.0)
    states = []
    prev = hung
    for t in (126, 131, 136):
        prev = decide(v, T0 + t, CFG, prev)
        states.append(prev)
    assert [s.state for s in states] == ["hung"] * 3
    assert all(s.last_step == 20 and s.since == hung.since for s in states)  # one episode, one since
    assert states[-1].reason.startswith("no step since it hung (deadlock signature")
    assert states[-1].suspect == hung.suspect
    # a step at last: running
    v.fold(steps(21, 21, t0=137))
    live(v, 140, BUSY, 1000.0)
    after = decide(v, T0 + 143, CFG, states[-1])
    assert after.state == "running" and after.last_step == 21


def test_without_a_previous_hang_a_quiet_job_before_its_threshold_is_running():
    """The hold needs the hang: the same view decided afresh is not hung (no flap the other way)."""
    v = _hung_view()
    live(v, 120, BUSY, 1000.0)
    live(v, 125, BUSY, 1000.0)
    assert decide(v, T0 + 126, CFG).state == "running"


def test_a_run_end_after_a_hang_is_done_and_silence_is_crashed():
    v = _hung_view()
    hung = decide(v, T0 + 116, CFG)
    live(v, 120, BUSY, 1000.0)
    live(v, 125, BUSY, 1000.0)
    assert decide(v, T0 + 400, CFG, hung).state == "crashed"  # heartbeats stopped at 300 s
    v.fold([ev("run", 130, r, state="end") for r in range(4)])
    assert decide(v, T0 + 131, CFG, hung).state == "done"


def test_a_step_at_the_polls_own_time_ends_the_stall_so_no_hang_is_held():
    """The millisecond before a step belongs to the stall it ends: a poll at that step's time (or
    before it, the trainer's clock ahead) sees progress, not `hung` for 0 s that a hold would keep."""
    v = view([*registered(), *steps(1, 20), *beats(300), *steps(21, 21, t0=195)])  # 100 s gap
    for t in (200, 198):
        st = decide(v, T0 + t, CFG)
        assert st.state == "running" and st.last_step == 21, (t, st.reason)
        assert decide(v, T0 + t + 1, CFG, st).state == "running"
    assert decide(v, T0 + 199, CFG).state == "running"
