"""/metrics: prometheus_client's two text formats, written faster, byte for byte the same.

prometheus_client spends ~5 us a sample writing the exposition (each label name validated and
escaped, each OpenMetrics sample name escaped a character at a time): 3 ms of the 4 ms an agent's
/metrics takes at 10 jobs, 220 ms at 1,000. Every name here is a plain one
(`[a-zA-Z_][a-zA-Z0-9_]*`), for which all that escaping is the identity: this module writes
such families with only the label values escaped, and hands anything else (a name with a colon
or beyond ASCII, exemplars, native histograms, timestamps, the other escaping schemes) to the
library unchanged. tests/test_exposition.py holds the two outputs equal.

A family marked with `freeze` (one that will not change again: the agent's job families, until
its next round) is written once per format and served as written; `prerender` writes it ahead,
in the agent's thread, so a scrape only joins the text; compressed ahead too, a gzip answer
joins its deflate blocks with the fresh families' in one gzip member (`GZIPPED`).

The HTTP side is prometheus_client's own (`choose_encoder` picks the format from the scraper's
Accept header, gzip when asked), with this writer in place of its encoder
for the Prometheus text format 0.0.4 and OpenMetrics 1.0.0 (what Prometheus asks for).
"""

from __future__ import annotations

import gzip
import math
import re
import socket
import struct
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import Any
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import exposition as _text
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics import exposition as _om
from prometheus_client.registry import Collector

_om_generate_latest: Callable[[Collector], bytes] = _om.generate_latest  # (untyped there)
_PLAIN = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")
# prometheus_client's text format: these samples move to a gauge family of their own.
_OM_SUFFIXES = ("_created", "_gsum", "_gcount")
# Text format: counters gain _total, info families _info; some types are renamed.
_TEXT_TYPE = {"info": "gauge", "stateset": "gauge", "gaugehistogram": "histogram", "unknown": "untyped"}


class _NotPlain(Exception):
    """A family this writer does not handle: the library writes the whole output."""


def _go_float(d: float) -> str:
    """prometheus_client's floatToGoString, with the common cases first."""
    d = float(d)
    if d != d:
        return "NaN"
    if d == math.inf:
        return "+Inf"
    if d == -math.inf:
        return "-Inf"
    s = repr(d)
    dot = s.find(".")
    if d > 0 and dot > 6:  # Go switches to exponents sooner than Python
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return s


def _escape_value(v: str) -> str:
    if "\\" in v:
        v = v.replace("\\", "\\\\")
    if "\n" in v:
        v = v.replace("\n", "\\n")
    if '"' in v:
        v = v.replace('"', '\\"')
    return v


class _Lines:
    """Sample lines of plain names, with each label set's order and each value's escape
    worked out once per render."""

    def __init__(self) -> None:
        self.plain: dict[str, bool] = {}
        self.orders: dict[tuple[str, ...], tuple[str, ...]] = {}
        self.escaped: dict[str, str] = {}

    def check(self, name: str) -> None:
        ok = self.plain.get(name)
        if ok is None:
            ok = self.plain[name] = _PLAIN.match(name) is not None
        if not ok:
            raise _NotPlain(name)

    def line(self, s: Any) -> str:
        if (
            s.timestamp is not None
            or s.exemplar is not None
            or s.native_histogram is not None
            or s.value is None
        ):
            raise _NotPlain(s.name)
        self.check(s.name)
        labels = s.labels
        if not labels:
            return f"{s.name} {_go_float(s.value)}\n"
        keys = tuple(labels)
        order = self.orders.get(keys)
        if order is None:
            for k in keys:
                self.check(k)
            order = self.orders[keys] = tuple(sorted(keys))
        esc = self.escaped
        parts = []
        for k in order:
            v = labels[k]
            e = esc.get(v)
            if e is None:
                e = esc[v] = _escape_value(v)
            parts.append(f'{k}="{e}"')
        return f"{s.name}{{{','.join(parts)}}} {_go_float(s.value)}\n"


def _text_family(m: Metric, lines: _Lines) -> str:
    out: list[str] = []
    name, mtype = m.name, m.type
    if mtype == "counter":
        name += "_total"
    elif mtype == "info":
        name += "_info"
    mtype = _TEXT_TYPE.get(mtype, mtype)
    lines.check(name)
    doc = m.documentation.replace("\\", "\\\\").replace("\n", "\\n")
    out.append(f"# HELP {name} {doc}\n# TYPE {name} {mtype}\n")
    moved: dict[str, list[str]] = {}
    for s in m.samples:
        for suffix in _OM_SUFFIXES:
            if s.name == m.name + suffix:
                moved.setdefault(suffix, []).append(lines.line(s))
                break
        else:
            out.append(lines.line(s))
    for suffix, sl in sorted(moved.items()):
        out.append(f"# HELP {m.name}{suffix} {doc}\n# TYPE {m.name}{suffix} gauge\n")
        out.extend(sl)
    return "".join(out)


def _openmetrics_family(m: Metric, lines: _Lines) -> str:
    lines.check(m.name)
    doc = _escape_value(m.documentation)
    head = f"# HELP {m.name} {doc}\n# TYPE {m.name} {m.type}\n"
    if m.unit:
        head += f"# UNIT {m.name} {m.unit}\n"
    return head + "".join(lines.line(s) for s in m.samples)


# A frozen family's text in each format (and, for gzip, its bytes and deflate blocks), made the
# first time it is asked for (or by `prerender`), kept on the family itself: dropped with it.
_WRITTEN = "_costexporter_written"
_FAMILY: dict[str, Callable[[Metric, _Lines], str]] = {
    "text": _text_family,
    "openmetrics": _openmetrics_family,
}
_END = {"text": "", "openmetrics": "# EOF\n"}  # what follows the last family


def freeze(metrics: list[Metric]) -> list[Metric]:
    """Mark families that will not change again: each is written once per format and served as
    written (a collector that rebuilds its families on a change hands out new ones)."""
    for m in metrics:
        setattr(m, _WRITTEN, {})
    return metrics


def prerender(metrics: Iterable[Metric], fmt: str = "openmetrics") -> None:
    """Write and compress frozen families now (the agent after its round), so a scrape only
    joins them."""
    lines = _Lines()
    for m in metrics:
        _compressed(m, fmt, lines)


def _family(m: Metric, fmt: str, lines: _Lines) -> str:
    written: dict[str, str] | None = getattr(m, _WRITTEN, None)
    if written is None:
        return _FAMILY[fmt](m, lines)
    text = written.get(fmt)
    if text is None:  # two scrapes at once may both write it: the same text
        text = written[fmt] = _FAMILY[fmt](m, lines)
    return text


def _compressed(m: Metric, fmt: str, lines: _Lines) -> tuple[bytes, bytes]:
    """A frozen family's bytes in `fmt` and their deflate blocks, made once."""
    written: dict[str, Any] = getattr(m, _WRITTEN)
    got: tuple[bytes, bytes] | None = written.get(fmt + "+deflate")
    if got is None:
        raw = _family(m, fmt, lines).encode()
        got = written[fmt + "+deflate"] = (raw, _deflate(raw))
    return got


# gzip over a body of which some parts were compressed ahead. A gzip member's deflate stream
# may be any run of blocks: each part is compressed on its own (no reference into another
# part) and ended byte-aligned and not final (a sync flush), so the parts follow one another,
# then one final empty block; the trailer holds the CRC and size of the whole body. One
# standard member, for every client (several concatenated members are not read by all).
_GZIP_LEVEL = 6  # zlib's default: an eighth of level 9's time on a large body, ~8% larger
_GZIP_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"  # deflate, no name, no time
_FINAL_BLOCK = zlib.compressobj(_GZIP_LEVEL, zlib.DEFLATED, -15).flush()


def _deflate(raw: bytes) -> bytes:
    c = zlib.compressobj(_GZIP_LEVEL, zlib.DEFLATED, -15)
    return c.compress(raw) + c.flush(zlib.Z_SYNC_FLUSH)


def _gzip(parts: Iterable[tuple[bytes, bytes | None]]) -> bytes:
    """One gzip member of the parts' bytes, in order: (bytes, their deflate blocks where they
    were compressed ahead, else None)."""
    out, crc, size = [_GZIP_HEADER], 0, 0
    for raw, blocks in parts:
        out.append(_deflate(raw) if blocks is None else blocks)
        crc = zlib.crc32(raw, crc)
        size += len(raw)
    out += [_FINAL_BLOCK, struct.pack("<II", crc, size & 0xFFFFFFFF)]
    return b"".join(out)


def _parts(metrics: Iterable[Metric], fmt: str) -> Iterator[tuple[bytes, bytes | None]]:
    """The body in `fmt` as parts: each frozen family with its deflate blocks, the families
    between them written now, together."""
    lines, fresh = _Lines(), []
    for m in metrics:
        if getattr(m, _WRITTEN, None) is None:
            fresh.append(_FAMILY[fmt](m, lines))
            continue
        if fresh:
            yield "".join(fresh).encode(), None
            fresh = []
        yield _compressed(m, fmt, lines)
    tail = "".join(fresh) + _END[fmt]
    if tail:
        yield tail.encode(), None


def _write_gzip(registry: Collector, fmt: str, library: Callable[[Collector], bytes]) -> bytes:
    """`gzip.compress` of the body `_write` gives, its frozen families compressed ahead."""
    metrics = list(registry.collect())
    try:
        return _gzip(_parts(metrics, fmt))
    except _NotPlain:
        return gzip.compress(library(_Fixed(metrics)))


def _families(metrics: Iterable[Metric], fmt: str) -> str:
    lines = _Lines()
    return "".join(_family(m, fmt, lines) for m in metrics) + _END[fmt]


def _text_families(metrics: Iterable[Metric]) -> str:
    return _families(metrics, "text")


def _openmetrics_families(metrics: Iterable[Metric]) -> str:
    return _families(metrics, "openmetrics")


def _write(
    registry: Collector,
    fast: Callable[[list[Metric]], str],
    library: Callable[[Collector], bytes],
) -> bytes:
    """The families collected once, written by `fast`, else (a family it does not handle) by
    the library's writer."""
    metrics = list(registry.collect())
    try:
        return fast(metrics).encode()
    except _NotPlain:
        return library(_Fixed(metrics))


def generate_text(registry: Collector) -> bytes:
    """`prometheus_client.generate_latest(registry)`, the same bytes."""
    return _write(registry, _text_families, _text.generate_latest)


def generate_openmetrics(registry: Collector) -> bytes:
    """`prometheus_client.openmetrics.exposition.generate_latest(registry)`, the same bytes."""
    return _write(registry, _openmetrics_families, _om_generate_latest)


# Our writers' gzip bodies (what Prometheus asks for), with the frozen families compressed ahead.
GZIPPED: dict[Callable[[Collector], bytes], Callable[[Collector], bytes]] = {
    generate_text: partial(_write_gzip, fmt="text", library=_text.generate_latest),
    generate_openmetrics: partial(_write_gzip, fmt="openmetrics", library=_om_generate_latest),
}


class _Fixed(Collector):
    """Families already collected, for the library's writer (collecting twice would also
    count twice what a collector counts per scrape)."""

    def __init__(self, metrics: list[Metric]) -> None:
        self.metrics = metrics

    def collect(self) -> Iterable[Metric]:
        return self.metrics


class _Only(Collector):
    """`?name[]=a&name[]=b`: only the samples of those names, as prometheus_client's
    `restricted_registry` gives (whose registry would have to know every collector's names
    up front; these collectors name their families as they collect)."""

    def __init__(self, registry: Collector, names: Iterable[str]) -> None:
        self.registry, self.names = registry, set(names)

    def collect(self) -> Iterable[Metric]:
        for m in self.registry.collect():
            samples = [s for s in m.samples if s.name in self.names]
            if samples:
                only = Metric(m.name, m.documentation, m.type)
                only.samples = samples
                yield only


def choose_encoder(accept_header: str | None) -> tuple[Callable[[Collector], bytes], str]:
    """prometheus_client's choice of format for an Accept header, with this module's writers
    where they give the same bytes (the default escaping of names)."""
    encoder, content_type = _text.choose_encoder(accept_header or "")
    if encoder is _text.generate_latest:
        return generate_text, content_type
    if isinstance(encoder, partial) and not encoder.args:
        kw = encoder.keywords
        if encoder.func is _text.generate_latest and kw == {"escaping": _om.UNDERSCORES}:
            return generate_text, content_type
        if encoder.func is _om.generate_latest and kw == {"escaping": _om.UNDERSCORES, "version": "1.0.0"}:
            return generate_openmetrics, content_type
    return encoder, content_type


def make_wsgi_app(registry: Collector) -> Callable[..., list[bytes]]:
    """prometheus_client's `make_wsgi_app`, with `choose_encoder` above."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        method = environ["REQUEST_METHOD"]
        headers: list[tuple[str, str]]
        if method == "OPTIONS":
            status, headers, output = "200 OK", [("Allow", "OPTIONS,GET")], b""
        elif method != "GET":
            status, headers = "405 Method Not Allowed", [("Allow", "OPTIONS,GET")]
            output = f"# HTTP {status}: {method}; use OPTIONS or GET\n".encode()
        elif environ["PATH_INFO"] == "/favicon.ico":
            status, headers, output = "200 OK", [], b""
        else:
            encoder, content_type = choose_encoder(environ.get("HTTP_ACCEPT"))
            params = parse_qs(environ.get("QUERY_STRING", ""))
            source = _Only(registry, params["name[]"]) if "name[]" in params else registry
            status, headers = "200 OK", [("Content-Type", content_type)]
            if not _text.gzip_accepted(environ.get("HTTP_ACCEPT_ENCODING", "")):
                output = encoder(source)
            else:
                gzipped = GZIPPED.get(encoder)
                output = gzipped(source) if gzipped else gzip.compress(encoder(source))
                headers.append(("Content-Encoding", "gzip"))
        start_response(status, headers)
        return [output]

    return app


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """A scrape every few seconds is not worth a log line."""


def start_http_server(port: int, addr: str, registry: Collector) -> Any:
    """prometheus_client's `start_http_server` (a thread per scrape, daemon threads, IPv6
    addresses) serving `make_wsgi_app` above; returns the server."""
    family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]

    class Server(_text.ThreadingWSGIServer):
        address_family = family

    httpd = make_server(addr, port, make_wsgi_app(registry), Server, handler_class=_Quiet)
    threading.Thread(target=httpd.serve_forever, daemon=True, name="metrics-http").start()
    return httpd
