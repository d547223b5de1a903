"""Issue 13, cases 13-17: the finance API under hostile tokens files, job names and stored data.

Real Redis (a prefix per test), the real app over HTTP, the real CLI for startup failures."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from costexporter.api.auth import TokenConfigError, Tokens, hash_token, parse_tokens

from ..conftest import ROOT
from ..redis_server import free_port

DIGEST = hash_token("secret")


# ---- 13: auth fails closed ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "text", "says"),
    [
        ("empty.yaml", "", "not a mapping"),
        ("no-tokens.yaml", "tokens: []\n", "non-empty list"),
        ("typo.yaml", f"token:\n  - sha256: {DIGEST}\n    teams: '*'\n", "unknown key 'token'"),
        ("no-teams.yaml", f"tokens:\n  - name: a\n    sha256: {DIGEST}\n", "no 'teams'"),
        ("string-teams.yaml", f"tokens:\n  - sha256: {DIGEST}\n    teams: alpha\n", "non-empty list"),
        ("entry-typo.yaml", f"tokens:\n  - sha256: {DIGEST}\n    team: [a]\n", "unknown key 'team'"),
        ("empty.json", "{}", "non-empty list"),
        ("bad.yaml", "tokens: [\n", "cannot read"),
    ],
)
def test_an_unusable_tokens_file_stops_the_api_with_one_line(tmp_path, name, text, says):
    f = tmp_path / name
    f.write_text(text)
    port = free_port()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "costexporter.cli", "api", "--tokens-file", str(f), "--port", str(port)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=30,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the API started with {name!r} instead of refusing it")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in done.stderr, done.stderr
    assert "open to anyone" not in done.stderr


scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.text(max_size=5), st.just("*"), st.just(DIGEST)
)
documents = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(
            st.sampled_from(["tokens", "token", "name", "sha256", "teams", "team"]), inner, max_size=4
        ),
    ),
    max_leaves=12,
)


@given(documents)
def test_any_document_either_fails_or_scopes_every_token_explicitly(data):
    """Whatever the file holds: a refusal, or a non-empty list of tokens each with the teams it names."""
    try:
        entries = parse_tokens(data)
    except ValueError:
        return
    assert entries
    for (_name, _digest, scope), raw in zip(entries, data["tokens"], strict=True):
        assert raw["teams"] == "*" if scope is None else scope == frozenset(raw["teams"])


def test_a_good_tokens_file_loads(tmp_path):
    f = tmp_path / "t.yaml"
    f.write_text(f"tokens:\n  - name: fin\n    sha256: {DIGEST}\n    teams: '*'\n")
    assert Tokens.load(f).check("Bearer secret").all_teams
    with pytest.raises(TokenConfigError):
        Tokens.load(tmp_path / "missing.yaml")
