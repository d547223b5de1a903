"""The commands of `costexporter`, one module each (a group of two where they belong together)."""
