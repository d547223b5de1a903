"""The archive on an existing engine: sealed ledger files as Parquet on a local directory or on
object storage, through pyarrow's filesystems (`file:///srv/archive` or a path, `s3://bucket/root`,
`gs://bucket/root`, `abfs://...`; credentials and endpoints as pyarrow reads them: the usual
`AWS_*` variables, or `?endpoint_override=host:port&scheme=http` for an S3-API server).

Layout under the root: `cluster=<name>/manifest.json` and `cluster=<name>/date=<day>/part-<shard>-
<hash>.parquet` (`core/archive.py`): each cluster's sealer writes its own partition, so one
reader pointed at the root reads every cluster's bill. Files are written whole (a local file by
rename, an object by one PUT), never changed: a new version is a new file.
"""

from __future__ import annotations

import hashlib
import io
import json
import posixpath
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from costexporter.core.archive import (
    COLUMNS,
    META_COLUMNS,
    STEP_COLUMNS,
    V1_COLUMNS,
    V2_COLUMNS,
    Entry,
    Manifest,
    Row,
    Totals,
    ordered,
)

MANIFEST = "manifest.json"


class ArchiveError(RuntimeError):
    """An archive that cannot be used, or a file that is not what the manifest says."""


def _pa() -> tuple[Any, Any, Any]:
    import pyarrow as pa
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    return pa, pafs, pq


def parquet_bytes(rows: Iterable[Row]) -> bytes:
    """The rows as one Parquet file, the same bytes for the same rows (ordered, fixed options)."""
    pa, _, pq = _pa()
    rows = ordered(rows)
    cols = list(zip(*rows, strict=True)) if rows else [() for _ in COLUMNS]
    arrays = [pa.array(list(c), type=getattr(pa, t)()) for c, (_, t) in zip(cols, COLUMNS, strict=True)]
    table = pa.Table.from_arrays(arrays, names=[n for n, _ in COLUMNS])
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd", use_dictionary=True, write_statistics=True)
    return buf.getvalue()


def _table(data: bytes) -> Any:
    """A sealed file as an Arrow table in COLUMNS' layout (a file of schema 1 gains the step
    columns, 0, and the attributes, ""; of schema 1 or 2, the incidents' columns, empty)."""
    pa, _, pq = _pa()
    # Read in this thread from a buffer Arrow owns. Handed Python's bytes (BytesIO, or even a
    # BufferReader over them), the read goes through Arrow's I/O pool, whose worker can drop the
    # last reference to the Python buffer while the interpreter exits: std::terminate, exit -6,
    # ~1 exit in 400 here. A copy of one day of a shard costs nothing beside that.
    sink = pa.BufferOutputStream()
    sink.write(data)
    table = pq.ParquetFile(pa.BufferReader(sink.getvalue())).read(use_threads=False)
    names = [n for n, _ in COLUMNS]
    if table.column_names == names:
        return table
    if table.column_names == [n for n, _ in V1_COLUMNS]:
        for n in STEP_COLUMNS:
            table = table.append_column(n, pa.array([0] * table.num_rows, type=pa.int64()))
        for n in META_COLUMNS:  # not sealed then: unknown
            table = table.append_column(n, pa.array([""] * table.num_rows, type=pa.string()))
    if table.column_names == [n for n, _ in V2_COLUMNS]:  # no incident was sealed then
        for n, t in COLUMNS[len(V2_COLUMNS) :]:
            empty = [""] * table.num_rows if t == "string" else [0] * table.num_rows
            table = table.append_column(n, pa.array(empty, type=getattr(pa, t)()))
        return table
    raise ArchiveError(f"a sealed file has columns {table.column_names}, not {names}")


def rows_of(data: bytes) -> list[Row]:
    """A sealed file's rows, read back."""
    table = _table(data)
    cols = [table.column(n).to_pylist() for n, _ in COLUMNS]
    return [tuple(r) for r in zip(*cols, strict=True)]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Archive:
    """One archive root. `cluster(name)` names the partition a sealer writes and reads."""

    fs: Any  # a pyarrow FileSystem
    root: str
    url: str

    @classmethod
    def open(cls, url: str, create: bool = True) -> Archive:
        """The archive at `url`; a local directory is created if missing, or with `create`
        False (a reader's: a mistyped path must not read as an empty archive) an error."""
        _, pafs, _ = _pa()
        try:
            fs, root = pafs.FileSystem.from_uri(url if "://" in url else f"file://{posixpath.abspath(url)}")
            if isinstance(fs, pafs.LocalFileSystem):
                if create:
                    fs.create_dir(root, recursive=True)
                elif fs.get_file_info(root).type != pafs.FileType.Directory:
                    raise ArchiveError(f"no archive at {url!r}: not a directory")
        except (ValueError, OSError) as e:
            raise ArchiveError(f"cannot open archive {url!r}: {e}") from None
        return cls(fs, root.rstrip("/"), url)

    def _path(self, cluster: str, rel: str) -> str:
        return f"{self.root}/cluster={cluster}/{rel}"

    def put(self, cluster: str, rel: str, data: bytes) -> None:
        """Write a file whole: a local file through a temporary name and a rename, an object by
        one PUT. A reader never sees half of it."""
        _, pafs, _ = _pa()
        path = self._path(cluster, rel)
        try:
            if isinstance(self.fs, pafs.LocalFileSystem):  # (an object store needs no directories)
                self.fs.create_dir(posixpath.dirname(path), recursive=True)
                tmp = f"{path}.tmp-{uuid.uuid4().hex}"  # each writer its own: two sealers at once
                with self.fs.open_output_stream(tmp) as f:
                    f.write(data)
                self.fs.move(tmp, path)
            else:
                with self.fs.open_output_stream(path) as f:
                    f.write(data)
        except OSError as e:
            raise ArchiveError(f"cannot write {path} in {self.url}: {e}") from None

    def delete(self, cluster: str, rel: str) -> None:
        """Remove a file (gone already: nothing to do)."""
        _, pafs, _ = _pa()
        path = self._path(cluster, rel)
        try:
            if self.fs.get_file_info(path).type != pafs.FileType.NotFound:
                self.fs.delete_file(path)
        except OSError as e:
            raise ArchiveError(f"cannot remove {path} from {self.url}: {e}") from None

    def get(self, cluster: str, rel: str) -> bytes | None:
        _, pafs, _ = _pa()
        path = self._path(cluster, rel)
        try:
            if self.fs.get_file_info(path).type == pafs.FileType.NotFound:
                return None
            with self.fs.open_input_stream(path) as f:
                data: bytes = f.read()
        except OSError as e:
            raise ArchiveError(f"cannot read {path} in {self.url}: {e}") from None
        return data

    def exists(self, cluster: str, rel: str) -> bool:
        _, pafs, _ = _pa()
        path = self._path(cluster, rel)
        try:
            return bool(self.fs.get_file_info(path).type != pafs.FileType.NotFound)
        except OSError as e:
            raise ArchiveError(f"cannot read {path} in {self.url}: {e}") from None

    def files(self, cluster: str) -> list[tuple[str, float]]:
        """Every file under the cluster's days (path relative to its root, modified time in Unix
        seconds; 0 where the store does not say)."""
        _, pafs, _ = _pa()
        base = self._path(cluster, "").rstrip("/")
        try:
            info = self.fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
        except OSError as e:
            raise ArchiveError(f"cannot list {base} in {self.url}: {e}") from None
        out = []
        for i in info:
            if i.type == pafs.FileType.File and i.path.startswith(base + "/date="):
                mtime = i.mtime.timestamp() if i.mtime is not None else 0.0
                out.append((i.path[len(base) + 1 :], mtime))
        return sorted(out)

    def manifest(self, cluster: str) -> Manifest:
        raw = self.get(cluster, MANIFEST)
        if raw is None:
            return Manifest(cluster)
        try:
            return Manifest.from_json(json.loads(raw))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ArchiveError(
                f"the manifest of cluster {cluster!r} in {self.url} is unreadable: {e}"
            ) from None

    def save_manifest(self, m: Manifest) -> None:
        text = json.dumps(m.to_json(), indent=1, sort_keys=True) + "\n"
        self.put(m.cluster, MANIFEST, text.encode())

    def clusters(self) -> list[str]:
        """The clusters with a partition under the root."""
        _, pafs, _ = _pa()
        try:
            info = self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True))
        except OSError as e:
            raise ArchiveError(f"cannot list archive {self.url}: {e}") from None
        return sorted(i.base_name[len("cluster=") :] for i in info if i.base_name.startswith("cluster="))

    def _checked(self, cluster: str, entry: Entry) -> bytes:
        data = self.get(cluster, entry.path)
        if data is None:
            raise ArchiveError(f"{entry.path} of cluster {cluster!r} is missing from {self.url}")
        got = sha256(data)
        if got != entry.sha256:
            raise ArchiveError(
                f"{entry.path} of cluster {cluster!r} is damaged: sha256 {got[:16]}, not {entry.sha256[:16]}"
            )
        return data

    def read(self, cluster: str, entry: Entry) -> list[Row]:
        """A manifest entry's rows, its content checked against the manifest (hash and totals)."""
        rows = rows_of(self._checked(cluster, entry))
        if len(rows) != entry.rows or Totals.of(rows).to_json() != entry.totals:
            raise ArchiveError(
                f"{entry.path} of cluster {cluster!r} does not hold the totals its manifest says"
            )
        return rows

    def table(self, cluster: str, entry: Entry) -> Any:
        """A manifest entry as an Arrow table (COLUMNS), its hash checked: the content the
        manifest's totals were made of."""
        return _table(self._checked(cluster, entry))
