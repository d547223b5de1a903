"""`python -m costexporter.cli`: the `costexporter` command."""

from costexporter.cli.main import run

run()
