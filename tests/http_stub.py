"""Shared by the tests that scrape or call an HTTP endpoint (dcgm-exporter, the Kubernetes API):
a real HTTP server on a free loopback port, in a thread, answering GETs from a function."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Callable

EXPOSITION = "text/plain; version=0.0.4"  # Prometheus' text format, as exporters serve it

Answer = Callable[[str], tuple[int, str, bytes]]  # path -> (status, content type, body)


class HttpStub:
    """GET <path> answered by `answer(path)`; `addr` is host:port, `url` the root URL."""

    def __init__(self, answer: Answer) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                code, content_type, body = answer(self.path)
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.addr = f"127.0.0.1:{self.server.server_address[1]}"
        self.url = f"http://{self.addr}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Exposition(HttpStub):
    """An exporter's /metrics: every GET answered with `render()`'s text."""

    def __init__(self, render: Callable[[], str]) -> None:
        super().__init__(lambda _path: (200, EXPOSITION, render().encode()))
        self.url = f"{self.url}/metrics"


def write_kubeconfig(path, server: str):
    """A kubeconfig naming `server` (a stub speaking the pods API) with a token user: what
    lightkube reads where KUBECONFIG points."""
    import json

    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": server}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u", "namespace": "default"}}],
                "current-context": "x",
            }
        )
    )
    return path
