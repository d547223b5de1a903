"""The documentation holds: every relative link and anchor in README.md and docs/ resolves (as
GitHub renders them), the generated reference pages are current, and the README's test command
is the one CI runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from costexporter.cli import docgen

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# The pages whose links are checked: the user's pages and the changelog (whose history may name
# what was, but whose links must still lead somewhere).
LINKED = [*PAGES, ROOT / "CHANGELOG.md"]
SOURCES = sorted((ROOT / "costexporter").rglob("*.py"))
# Pointers at what the repository does not hold: a design document's sections, a reference
# list's items, a tracker's issues. A docstring or comment says the fact instead, or links docs/.
FOREIGN_POINTER = re.compile(r"\bDESIGN section\b|\bREFERENCE R\d|\bissue \d+", re.IGNORECASE)

FENCE = re.compile(r"^(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def _prose(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: inline markup dropped (code spans keep their text, links
    their text), lower case, punctuation removed except `-` and `_`, spaces to `-`."""
    text = CODE_SPAN.sub(lambda m: m.group(2), heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[*_]{1,3}(?=\S)(.+?)(?<=\S)[*_]{1,3}", r"\1", text)
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor, with GitHub's -1, -2 suffixes for repeated headings."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose(text):
        m = HEADING.match(line)
        if not m:
            continue
        s = slug(m.group(2))
        if s in seen:
            seen[s] += 1
            s = f"{s}-{seen[s]}"
        else:
            seen[s] = 0
        out.add(s)
    return out


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every Markdown link outside code."""
    out = []
    for n, line in _prose(text):
        bare = CODE_SPAN.sub("", line)
        out += [(n, m.group(1)) for m in LINK.finditer(bare)]
    return out


def broken_links(pages: list[Path], root: Path) -> tuple[list[str], int]:
    """The relative links and anchors that do not resolve, and how many were checked."""
    bad, checked = [], 0
    cache: dict[Path, set[str]] = {}
    for page in pages:
        for n, target in links(page.read_text()):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            checked += 1
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(root)}:{n}: {target}"
            if not dest.exists():
                bad.append(f"{where} (no such file)")
                continue
            if anchor and dest.suffix == ".md":
                if dest not in cache:
                    cache[dest] = anchors(dest.read_text())
                if anchor not in cache[dest]:
                    bad.append(f"{where} (no heading #{anchor} in {dest.relative_to(root)})")
    return bad, checked


def test_every_relative_link_and_anchor_resolves():
    assert ROOT / "CHANGELOG.md" in LINKED and (ROOT / "CHANGELOG.md").exists()
    bad, checked = broken_links(LINKED, ROOT)
    assert checked > 50, f"only {checked} links found: the link pattern stopped matching"
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_the_checker_finds_a_broken_file_an_anchor_and_code_is_ignored(tmp_path):
    (tmp_path / "a.md").write_text(
        "# Title\n\n## The agent: `costexporter serve`\n\n## Step 1\n\n## Step 1\n\n"
        "[ok](b.md#reading-allocation-and-jobsjob) [ok](#the-agent-costexporter-serve) "
        "[ok](#step-1-1) [bad](#step-2) [bad](c.md) [web](https://example.com/x)\n"
        "`[not a link](nowhere.md)`\n```\n[in a fence](nowhere.md)\n```\n"
    )
    (tmp_path / "b.md").write_text("# B\n\n## Reading: `/allocation` and `/jobs/{job}`\n")
    bad, checked = broken_links([tmp_path / "a.md"], tmp_path)
    assert checked == 5
    assert [b.split(" (")[0] for b in bad] == ["a.md:9: #step-2", "a.md:9: c.md"]


def test_generated_reference_pages_are_current():
    assert docgen.PAGES, "no generated pages"
    stale = docgen.stale()
    assert not stale, f"not current: {stale}; run `{docgen.REGENERATE}`"


def test_generated_pages_cover_every_command_and_metric_family():
    from costexporter.cli.main import main

    cli = docgen.render_cli()
    commands = [ctx.command_path for ctx, _ in docgen._contexts(main)]
    assert len(commands) > 10
    for path in commands:
        assert f"\n## {path}\n" in cli
    metrics = docgen.render_metrics()
    for name in ("costexporter_cost_total", "costexporter_gpu_band", "costexporter_job_state"):
        assert f"`{name}`" in metrics
    # a family's labels are listed with it
    assert "| `costexporter_cost_total` | counter | `training_job`, `category`, `currency` |" in metrics


def test_docgen_check_exits_1_while_a_page_is_stale_and_regenerates_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(docgen, "DOCS", tmp_path)
    assert docgen.main(["--check"]) == 1  # no pages yet
    assert docgen.main([]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(docgen.PAGES)
    assert docgen.main(["--check"]) == 0
    (tmp_path / "metrics.md").write_text("old\n")
    assert docgen.stale() == ["docs/metrics.md"]
    assert docgen.main(["--check"]) == 1
    assert "docs/metrics.md" in capsys.readouterr().err
    assert docgen.main(["--bogus"]) == 2


def _readme_test_command() -> str:
    text = (ROOT / "README.md").read_text()
    cmds = [line for line in text.splitlines() if line.startswith("pytest ")]
    assert len(cmds) == 1, cmds
    return cmds[0]


def test_ci_runs_the_readmes_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    command = _readme_test_command()
    assert command in ci.splitlines()


def test_readme_names_the_system_packages_ci_installs():
    ci = (ROOT / ".ci" / "run").read_text()
    m = re.search(r"apt-get install [^\n]*--no-install-recommends ([\w .-]+?) >", ci)
    assert m, "no apt-get install line in .ci/run"
    packages = m.group(1).split()
    readme = (ROOT / "README.md").read_text()
    line = next(x for x in readme.splitlines() if "apt-get install" in x)
    assert line.split("apt-get install", 1)[1].split() == packages


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_the_product_speaks_of_itself_only(page):
    """No issue numbers or dated lab notes in the user's pages."""
    text = page.read_text()
    assert not re.search(r"\bissue \d+|\bstop \d+\b", text, re.IGNORECASE), page


def test_the_package_points_at_nothing_the_repository_lacks():
    """The package's docstrings and comments stand alone: no `DESIGN section N`, `REFERENCE R#`
    or `issue N` (the files and tracker they pointed at are not the reader's)."""
    assert len(SOURCES) > 50, SOURCES
    hits = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in SOURCES
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if FOREIGN_POINTER.search(line)
    ]
    assert not hits, "pointers at what the repository lacks:\n" + "\n".join(hits)


@pytest.mark.parametrize("line", ["see DESIGN section 4", "(REFERENCE R7)", "as issue 16 asked"])
def test_a_foreign_pointer_is_caught(line):
    assert FOREIGN_POINTER.search(line)
