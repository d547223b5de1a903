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
in the agent's thread, so a scrape only joins the text.

The HTTP side is prometheus_client's own (`choose_encoder` picks the format from the scraper's
Accept header, gzip when asked), with this writer in place of its encoder
for the Prometheus text format 0.0.4 and OpenMetrics 1.0.0 (what Prometheus asks for).
"""

from __future__ import annotations

import gzip
import math
import re
import socket
import threading
from collections.abc import Callable, Iterable
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


# A frozen family's text in each format, written the first time it is asked for (or by
# `prerender`), kept on the family itself: it is dropped with it.
_WRITTEN = "_costexporter_written"
_FAMILY: dict[str, Callable[[Metric, _Lines], str]] = {
    "text": _text_family,
    "openmetrics": _openmetrics_family,
}


def freeze(metrics: list[Metric]) -> list[Metric]:
    """Mark families that will not change again: each is written once per format and served as
    written (a collector that rebuilds its families on a change hands out new ones)."""
    for m in metrics:
        setattr(m, _WRITTEN, {})
    return metrics


def prerender(metrics: Iterable[Metric], fmt: str = "openmetrics") -> None:
    """Write frozen families now (the agent after its round), so a scrape only joins them."""
    lines = _Lines()
    for m in metrics:
        _family(m, fmt, lines)


def _family(m: Metric, fmt: str, lines: _Lines) -> str:
    written: dict[str, str] | None = getattr(m, _WRITTEN, None)
    if written is None:
        return _FAMILY[fmt](m, lines)
    text = written.get(fmt)
    if text is None:  # two scrapes at once may both write it: the same text
        text = written[fmt] = _FAMILY[fmt](m, lines)
    return text


def _text_families(metrics: Iterable[Metric]) -> str:
    lines = _Lines()
    return "".join(_family(m, "text", lines) for m in metrics)


def _openmetrics_families(metrics: Iterable[Metric]) -> str:
    lines = _Lines()
    return "".join(_family(m, "openmetrics", lines) for m in metrics) + "# EOF\n"


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
            output = encoder(_Only(registry, params["name[]"]) if "name[]" in params else registry)
            status, headers = "200 OK", [("Content-Type", content_type)]
            if _text.gzip_accepted(environ.get("HTTP_ACCEPT_ENCODING", "")):
                output = gzip.compress(output)
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
