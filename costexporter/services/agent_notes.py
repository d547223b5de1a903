"""What the agent says about a job where the job's readers look: a note in its figures hash
(`ledger.note`), which the API lists among the job's warnings. Each note is written once per
process (a discovery meets the same refusal round after round), at most `ledger.MAX_NOTES` per
job."""

from __future__ import annotations

import logging

from costexporter.services.agent_context import AgentContext
from costexporter.store import ledger, untrusted

log = logging.getLogger("costexporter.agent")


class JobNotes:
    def __init__(self, ctx: AgentContext) -> None:
        self.redis = ctx.redis
        self.prefix = ctx.cfg.prefix
        self._redis_errors = ctx.redis_errors
        self._said: dict[str, set[tuple[str, str]]] = {}

    def note(self, job: str, reason: str, text: str, about: str = "") -> None:
        """Note `text` for `job` under `reason` (and the other party, `about`), once."""
        said = self._said.setdefault(job, set())
        if (reason, about) in said or len(said) >= ledger.MAX_NOTES:
            return
        try:
            ledger.note(self.redis, self.prefix, job, reason, untrusted.short(about, 200), text)
        except self._redis_errors as e:
            if not untrusted.is_wrong_type(e):
                raise
            log.warning(
                "job %r: its figures key has the wrong type: note %r not written",
                untrusted.short(job),
                reason,
            )
        said.add((reason, about))
