"""The `costexporter` command: thin click commands over the rooms, and their rendering."""

from costexporter.cli.main import main, run

__all__ = ["main", "run"]
