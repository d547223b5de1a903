"""Optional training-framework integrations: `pip install costexporter[hf]` or `[lightning]`."""
