"""The trainer's side: `StepReporter` (importable as `costexporter.client.StepReporter`), its value
checks, its spool on local disk and the clean-exit check behind `run end`."""
