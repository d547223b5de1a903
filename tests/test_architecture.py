"""The architecture, checked: the accounting core (pyproject's import-linter contract) imports
no I/O library, directly or through another module of the package."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .conftest import ROOT


def test_the_core_imports_no_redis_http_cli_rendering_prometheus_or_nvml():
    # In its own process: import-linter reconfigures logging, which the reporter tests read.
    code = "import sys; from importlinter import cli; sys.exit(cli.lint_imports(no_cache=True, no_logo=True))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_public_import_paths_still_work():
    """What users import keeps working from where they always imported it (the rooms moved)."""
    from costexporter import client, reader
    from costexporter.integrations import torch_dist
    from costexporter.store.reader import EventReader
    from costexporter.trainer.reporter import StepReporter
    from costexporter.trainer.transport import send_entries

    assert client.StepReporter is StepReporter and client.send_entries is send_entries
    assert reader.EventReader is EventReader
    assert torch_dist.even_batches
    # The callbacks need their optional extras (CI installs both).
    pytest.importorskip("transformers")
    pytest.importorskip("lightning")
    from costexporter.integrations import hf, lightning

    assert hf.CostExporterCallback and lightning.CostExporterLightningCallback


def test_the_package_is_its_rooms():
    """No module sits loose beside the rooms but the two kept for users' import paths."""
    pkg = ROOT / "costexporter"
    loose = sorted(p.name for p in pkg.glob("*.py"))
    assert loose == ["__init__.py", "client.py", "reader.py"]
    rooms = sorted(p.name for p in pkg.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert rooms == ["api", "cli", "core", "integrations", "services", "sources", "store", "tools", "trainer"]


def test_no_module_imports_itself_back():
    """No import cycle in the package, directly or through other modules (type-only imports
    count: a cycle for the checker is one a newcomer must untangle too)."""
    import grimp

    graph = grimp.build_graph("costexporter")
    modules = sorted(graph.modules)
    cycles = [
        (m, n)
        for m in modules
        for n in sorted(graph.find_modules_directly_imported_by(m))
        if graph.chain_exists(importer=n, imported=m)
    ]
    assert len(modules) > 100  # the graph holds the package
    assert cycles == []


def test_every_module_is_named_in_the_architecture_page():
    """docs/architecture.md is the map: a module it does not name is one a newcomer cannot find."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    pkg = ROOT / "costexporter"
    modules = [p for p in sorted(pkg.rglob("*.py")) if p.stem not in ("__init__", "__main__")]
    unnamed = []
    for p in modules:
        rel = p.relative_to(pkg).with_suffix("").as_posix()
        names = (
            f"`{p.stem}`",
            f"{p.stem}.py",
            f"`{rel}`",
            f"{rel}.py",
            f"`{rel}/",
            "costexporter." + rel.replace("/", "."),
        )
        if not any(n in page for n in names):
            unnamed.append(rel)
    assert len(modules) > 50  # the package's modules were found
    assert unnamed == []
