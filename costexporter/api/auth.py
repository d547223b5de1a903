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
for chargeback across teams. A tokens file that is given but unusable (empty, no tokens, an
unknown key, a token without explicit `teams`) stops the API at start: it never opens up.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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


ENTRY_KEYS = {"name", "sha256", "teams"}


def parse_tokens(data: object) -> list[tuple[str, str, frozenset[str] | None]]:
    """Validate a tokens document: `{"tokens": [{name?, sha256, teams}, ...]}`, at least one
    token, no unknown keys, every token's teams explicit (a list of team names, or "*")."""
    if not isinstance(data, dict):
        raise ValueError("the file must be a mapping with a 'tokens' list (it is empty or not a mapping)")
    unknown = sorted(str(k) for k in data if k != "tokens")
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r} (the only key is 'tokens')")
    items = data.get("tokens")
    if not isinstance(items, list) or not items:
        raise ValueError("'tokens' must be a non-empty list (a tokens file that grants nothing is refused)")
    entries, digests = [], set()
    for i, t in enumerate(items):
        where = f"token #{i + 1}"
        if not isinstance(t, dict):
            raise ValueError(f"{where}: must be a mapping with sha256 and teams")
        where = f"token #{i + 1} ({t['name']})" if isinstance(t.get("name"), str) else where
        bad = sorted(str(k) for k in t if k not in ENTRY_KEYS)
        if bad:
            raise ValueError(f"{where}: unknown key {bad[0]!r} (keys: name, sha256, teams)")
        digest = t.get("sha256")
        if (
            not isinstance(digest, str)
            or len(digest) != 64
            or any(c not in "0123456789abcdef" for c in digest.lower())
        ):
            raise ValueError(f"{where}: sha256 must be 64 hex digits (costexporter api --hash-token TOKEN)")
        digest = digest.lower()
        if digest in digests:
            raise ValueError(f"{where}: the same sha256 as an earlier token")
        digests.add(digest)
        entries.append((str(t.get("name") or f"token-{i + 1}"), digest, _scope(t, where)))
    return entries


def _scope(t: dict[str, Any], where: str) -> frozenset[str] | None:
    if "teams" not in t:
        raise ValueError(f"{where}: no 'teams': name its teams as a list, or \"*\" for every team")
    teams = t["teams"]
    if teams == "*":
        return None
    if not isinstance(teams, list) or not teams:
        raise ValueError(f"{where}: 'teams' must be a non-empty list of team names, or \"*\" (got {teams!r})")
    if not all(isinstance(x, str) and x for x in teams):
        raise ValueError(f"{where}: every team must be a non-empty string (got {teams!r})")
    if "*" in teams:
        raise ValueError(f'{where}: "*" stands alone (teams: "*"), not in a list')
    return frozenset(teams)


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
        """The tokens of a file, or none when no file is given (the API is then open).

        A file that is given but grants nothing or is ambiguous is an error, never an open API:
        fails closed."""
        if not path:
            return cls([])
        p = Path(path)
        import yaml

        try:
            text = p.read_text()
            data = json.loads(text) if p.suffix.lower() == ".json" else yaml.safe_load(text)
        except (OSError, ValueError, yaml.YAMLError) as e:
            detail = " ".join(str(e).split())
            raise TokenConfigError(f"{p}: cannot read tokens: {detail}") from None
        try:
            entries = parse_tokens(data)
        except ValueError as e:
            raise TokenConfigError(f"{p}: {e}") from None
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
