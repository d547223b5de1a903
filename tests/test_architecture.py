"""The architecture, checked: the accounting core (pyproject's import-linter contract) imports
no I/O library, directly or through another module of the package."""

from __future__ import annotations

import subprocess
import sys

from .conftest import ROOT


def test_the_core_imports_no_redis_http_cli_rendering_prometheus_or_nvml():
    # In its own process: import-linter reconfigures logging, which the reporter tests read.
    code = "import sys; from importlinter import cli; sys.exit(cli.lint_imports(no_cache=True, no_logo=True))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
