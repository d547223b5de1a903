"""`costexporter.reader`: the import path of `EventReader` that consumers use. The reader lives in
`costexporter.store.reader`; this module keeps its public names where users import them."""

from costexporter.store.reader import EventReader, read_all_many

__all__ = ["EventReader", "read_all_many"]
