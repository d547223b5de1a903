"""`costexporter.client`: the import path trainers use. The reporter lives in
`costexporter.trainer.reporter`; this module keeps its public names where users import them."""

from costexporter.trainer.reporter import (
    Delivery,
    StepReporter,
    detect_gpu,
    detect_ranks,
    send_entries,
)

__all__ = ["Delivery", "StepReporter", "detect_gpu", "detect_ranks", "send_entries"]
