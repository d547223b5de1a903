"""A commit whose EXEC reply is lost (the transaction applied, the connection cut before the
answer; redis-py then raises WatchError, as for a real conflict) is this agent's own write: the
round counts as written, nothing is booked twice, and no log claims that another agent runs with
its id."""

from __future__ import annotations

import logging

import redis
import redis.client

from costexporter.core.model import CATEGORIES
from costexporter.services.agent import Agent
from costexporter.sources.synth import TraceBuilder
from costexporter.store import keys, ledger

from .agent_rounds import replay_agent, tick
from .test_agent import post_events


def _run(shared, prefix: str, lose: int | None, monkeypatch) -> tuple[Agent, dict, int]:
    b = TraceBuilder(n_gpus=2, per_host=2, job="lost-reply", seed=4)
    b.run("start")
    b.stretch("compute", 240, step_s=5)
    b.run("end")
    b.stretch("idle", 5)
    post_events(shared, prefix, b)
    wm_key = keys.watermark_key(prefix, b.job, "lr")
    real = redis.client.Pipeline._execute_transaction
    seen = [0]

    def lossy(self, connection, commands, raise_on_error):
        out = real(self, connection, commands, raise_on_error)
        if any(wm_key in map(str, c[0]) for c in commands):
            seen[0] += 1
            if seen[0] == lose:  # applied in Redis; the connection dies before EXEC's reply
                self.watching = True  # (as then: the reply is what would have cleared it)
                raise redis.ConnectionError("Connection closed by server.")
        return out

    monkeypatch.setattr(redis.client.Pipeline, "_execute_transaction", lossy)
    agent, now = replay_agent(b, prefix=prefix, agent_id="lr", job_refresh_s=0)
    for _ in range(10):
        tick(agent, now, 30)
    total = ledger.read_amounts(shared, prefix, b.job)
    return agent, {c: total.get(f"{c}:ms", 0) for c in CATEGORIES}, seen[0]


def test_a_lost_exec_reply_is_not_called_a_twin_and_books_nothing_twice(shared, prefix, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="costexporter.agent")
    agent, booked, commits = _run(shared, prefix, 2, monkeypatch)
    assert commits >= 3  # the lost reply, and rounds after it
    assert agent.guard.stats["conflicts"] == 0, agent.stats
    assert "same agent id" not in caplog.text, caplog.text
    # an unfaulted agent, under the test's prefix (its keys are removed with it)
    _, clean, _ = _run(shared, prefix + ":clean", None, monkeypatch)
    assert booked == clean and sum(booked.values()) > 0  # exactly what an unfaulted agent books
