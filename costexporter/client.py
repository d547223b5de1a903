"""`costexporter.client`: the import path trainers use. The reporter lives in
`costexporter.trainer` (`reporter`, and its parts `detect`, `sender`, `transport`); this module
keeps its public names where users import them."""

from costexporter.trainer.detect import detect_gpu, detect_ranks
from costexporter.trainer.reporter import StepReporter
from costexporter.trainer.transport import Delivery, send_entries

__all__ = ["Delivery", "StepReporter", "detect_gpu", "detect_ranks", "send_entries"]
