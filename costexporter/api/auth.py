"""Bearer tokens with team scopes, stored as SHA-256 hashes and compared in constant time.

A tokens file (YAML or JSON; `--tokens-file` or COSTEXPORTER_API_TOKENS_FILE):

    tokens:
      - name: finance          # sees every team, and the unassigned GPU time
        sha256: 9f86d081...    # sha256 of the token: `costexporter api --hash-token TOKEN`
        teams: "*"
      - name: llm-lead
        sha256: 2c26b46b...
        teams: [llm]

Without a tokens file the API is open (and says so at start): fine on a trusted network, not
for chargeback across teams.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from pathlib import Path


class TokenConfigError(ValueError):
    """A tokens file that cannot be used."""


@dataclass(frozen=True)
class Principal:
    name: str
    teams: frozenset[str] | None  # None: every team

    def sees(self, team: str | None) -> bool:
        return self.teams is None or (team or "") in self.teams

    @property
    def all_teams(self) -> bool:
        return self.teams is None


ANONYMOUS = Principal("anonymous", None)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Tokens:
    def __init__(self, entries: list[tuple[str, str, frozenset[str] | None]]) -> None:
        self.entries = entries

    @property
    def enabled(self) -> bool:
        return bool(self.entries)

    @classmethod
    def load(cls, path: str | Path | None) -> Tokens:
        if not path:
            return cls([])
        p = Path(path)
        import yaml

        try:
            text = p.read_text()
            data = json.loads(text) if p.suffix.lower() == ".json" else yaml.safe_load(text)
        except (OSError, ValueError, yaml.YAMLError) as e:
            raise TokenConfigError(f"{p}: cannot read tokens: {e}") from None
        entries = []
        for i, t in enumerate((data or {}).get("tokens") or []):
            try:
                digest = str(t["sha256"]).lower()
                if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                    raise ValueError("sha256 must be 64 hex digits")
                teams = t.get("teams", "*")
                scope = None if teams == "*" else frozenset(str(x) for x in teams)
                entries.append((str(t.get("name") or f"token-{i}"), digest, scope))
            except (KeyError, TypeError, ValueError) as e:
                raise TokenConfigError(f"{p}: token #{i + 1}: {e}") from None
        return cls(entries)

    def check(self, authorization: str | None) -> Principal | None:
        """The principal of a valid `Authorization: Bearer <token>`, else None.

        Every stored hash is compared, whatever matched, so the time taken says nothing."""
        if not self.enabled:
            return ANONYMOUS
        if not authorization or not authorization.lower().startswith("bearer "):
            return None
        digest = hash_token(authorization[7:].strip())
        found = None
        for name, stored, scope in self.entries:
            if hmac.compare_digest(digest, stored):
                found = Principal(name, scope)
        return found
