"""/metrics is written by services/exposition.py: the same bytes as prometheus_client's writers,
for any families (drawn, hostile label values included) and over real HTTP, header for header."""

from __future__ import annotations

import contextlib
import gzip
import string
import urllib.error
import urllib.request
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client import start_http_server as library_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeHistogramMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    StateSetMetricFamily,
    SummaryMetricFamily,
    UnknownMetricFamily,
)
from prometheus_client.openmetrics.exposition import generate_latest as om_generate_latest
from prometheus_client.registry import CollectorRegistry
from prometheus_client.samples import Exemplar

from costexporter.services import exposition
from costexporter.services.exposition import generate_openmetrics, generate_text

from .conftest import SHARED_URL
from .redis_server import free_port


class Fixed:
    """Families fixed once, collected the same way by every writer."""

    def __init__(self, families):
        self.families = families

    def collect(self):
        return iter(self.families)


def registry(families) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=True)
    reg.register(Fixed(families))
    return reg


def assert_same(families) -> None:
    reg = registry(families)
    assert generate_text(reg) == generate_latest(reg)
    assert generate_openmetrics(reg) == om_generate_latest(reg)
    for ours, library in ((generate_text, generate_latest), (generate_openmetrics, om_generate_latest)):
        assert one_gzip_member(exposition.GZIPPED[ours](reg)) == library(reg)


def one_gzip_member(data: bytes) -> bytes:
    """The body of a gzip answer that is one whole member (what every client reads), its CRC
    and size checked."""
    d = zlib.decompressobj(31)
    body = d.decompress(data)
    assert d.eof and not d.unused_data
    return body


plain = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,12}", fullmatch=True)
# Names the fast writer hands to the library: a colon, a non-ASCII letter.
odd = st.sampled_from(["job:rate5m", "gpu_é", "a.b"])
names = st.one_of(plain, plain, plain, odd)
values = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-(10**20), 10**20),
    st.sampled_from([0.0, -0.0, 1e-300, 1234567.0, 12345678.9, 1e22, 0.1]),
    st.booleans(),
)
label_values = st.text(alphabet=st.sampled_from(string.printable + '\\"\né€\u2028\x00'), max_size=12)


@st.composite
def families(draw):
    out = []
    used = set()
    for _ in range(draw(st.integers(1, 6))):
        name = draw(names.filter(lambda n: n not in used))
        used.add(name)
        kind = draw(
            st.sampled_from(["gauge", "counter", "histogram", "summary", "info", "unknown", "gh", "ss"])
        )
        labels = draw(st.lists(names.filter(lambda n: n not in ("le", "quantile")), max_size=3, unique=True))
        doc = draw(label_values)
        rows = draw(
            st.lists(
                st.tuples(st.lists(label_values, min_size=len(labels), max_size=len(labels)), values),
                max_size=4,
            )
        )
        if kind == "gauge":
            f = GaugeMetricFamily(name, doc, labels=labels)
            for lv, v in rows:
                f.add_metric(lv, v)
        elif kind == "counter":
            f = CounterMetricFamily(name, doc, labels=labels)
            for lv, v in rows:
                f.add_metric(
                    lv, abs(v) if v == v else v, created=draw(st.one_of(st.none(), st.floats(0, 2e9)))
                )
        elif kind == "histogram":
            f = HistogramMetricFamily(name, doc, labels=labels)
            for lv, v in rows:
                f.add_metric(lv, [("0.5", 1), ("1e+06", 2), ("+Inf", 3)], v)
        elif kind == "gh":
            f = GaugeHistogramMetricFamily(name, doc, labels=labels)
            for lv, v in rows:
                f.add_metric(lv, [("1.0", 1), ("+Inf", 2)], v)
        elif kind == "summary":
            f = SummaryMetricFamily(name, doc, labels=labels)
            for lv, v in rows:
                f.add_metric(lv, 3, v)
        elif kind == "info":
            f = InfoMetricFamily(name, doc, labels=labels)
            for lv, _ in rows:
                f.add_metric(lv, {"version": draw(label_values)})
        elif kind == "ss":
            f = StateSetMetricFamily(name, doc, labels=labels)
            for lv, _ in rows:
                f.add_metric(lv, {"on": True, "off": False})
        else:
            f = UnknownMetricFamily(name, doc, labels=labels)
            for lv, v in rows:
                f.add_metric(lv, v)
        out.append(f)
    return out


@settings(max_examples=150, deadline=None)
@given(families())
def test_drawn_families_write_the_libraries_bytes(fams):
    assert_same(fams)


@settings(max_examples=100, deadline=None)
@given(families(), st.data())
def test_frozen_families_written_ahead_are_served_as_the_libraries_bytes(fams, data):
    """Some families frozen (the agent's job families), some of them written ahead in one
    format: every scrape in either format is still the library's bytes, the second as the first."""
    frozen = [f for f in fams if data.draw(st.booleans())]
    exposition.freeze(frozen)
    if data.draw(st.booleans()):
        # (a name the fast writer leaves to the library is written there, per scrape)
        with contextlib.suppress(exposition._NotPlain):
            exposition.prerender(frozen, data.draw(st.sampled_from(["text", "openmetrics"])))
    for _ in range(2):
        assert_same(fams)


def test_what_the_fast_writer_hands_to_the_library_is_written_the_same():
    g = GaugeMetricFamily("plain", "x", labels=["a"])
    g.add_metric(["v"], 1.0, timestamp=1700000000.5)
    c = CounterMetricFamily("with_exemplar", "y")
    c.add_sample("with_exemplar_total", {}, 2.0, exemplar=Exemplar({"trace": 'a"b'}, 1.0))
    assert_same([g])
    assert_same([c])
    assert_same([GaugeMetricFamily("rule:name", "colon")])


# Beyond its samples: every family of a 1-GPU... 8-GPU agent with hostile job names.
def agent_families(monkeypatch, n_jobs: int):
    from costexporter.core.model import Category
    from costexporter.services.agent import Agent, AgentConfig, _Job
    from costexporter.services.exporter import registry_for
    from costexporter.sources.nvml import NvmlSource
    from costexporter.store.reader import EventReader

    from .fake_nvml import FakeGpu, FakeNvml

    uuids = [f"GPU-{i:08x}-aaaa-bbbb-cccc-{i:012x}" for i in range(8)]
    FakeNvml([FakeGpu(u) for u in uuids]).install(monkeypatch)
    agent = Agent(NvmlSource(host="exp-host"), AgentConfig(redis_url=SHARED_URL, agent_id="exp"))
    for r in agent.sampler.source.read():
        agent.sampler._latest[r.gpu] = r
    rng = np.random.default_rng(1)
    for j in range(n_jobs):
        name = ["job-a", "ns/job:b", "job@c+d=e", "job.f_g"][j % 4] + str(j)
        job = _Job(name, EventReader(agent.redis, name))
        job.meta = {"team": ['q"uote', "back\\slash", "new\nline", "jöb-€"][j % 4], "namespace": "ns"}
        job.own = {r: (j + r) % 8 for r in range(8)}
        job.state.booked = rng.integers(0, 10**12, (len(Category), 3))
        job.figures = {
            "steps_completed": j,
            "valid_steps": j,
            "tokens": 10**9 + j,
            "last_step_ts": 1.7e9 + j / 7,
        }
        job.latest_band = {r: r % 4 for r in range(8)}
        agent.jobs[name] = job
    return Families(registry_for(agent).collect(), agent)


class Families(list):
    """An agent's families, and the agent."""

    def __init__(self, fams, agent):
        super().__init__(fams)
        self.agent = agent


def test_an_agents_families_write_the_libraries_bytes(monkeypatch):
    fams = agent_families(monkeypatch, 12)
    assert sum(len(f.samples) for f in fams) > 500
    assert_same(fams)


def _get(url, headers):
    req = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.headers.get("Content-Type"), r.headers.get("Content-Encoding"), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type"), None, e.read()


PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)


@pytest.mark.parametrize(
    "headers, path",
    [
        ({"Accept": PROMETHEUS_ACCEPT}, "/metrics"),  # what Prometheus sends: OpenMetrics 1.0.0
        ({}, "/metrics"),  # curl: the text format 0.0.4
        ({"Accept": "text/plain;version=1.0.0;escaping=underscores"}, "/metrics"),
        ({"Accept": "text/plain;version=1.0.0;escaping=allow-utf-8"}, "/metrics"),  # the library's
        ({"Accept": "application/openmetrics-text;version=2.0.0"}, "/metrics"),  # the library's
        ({"Accept-Encoding": "gzip"}, "/metrics"),
        ({}, "/favicon.ico"),
    ],
)
def test_the_server_answers_as_the_librarys_does(monkeypatch, headers, path):
    reg = registry(agent_families(monkeypatch, 5))
    ours, theirs = free_port(), free_port()
    httpd = exposition.start_http_server(ours, addr="127.0.0.1", registry=reg)
    lib, _ = library_server(theirs, addr="127.0.0.1", registry=reg)
    try:
        a = _get(f"http://127.0.0.1:{ours}{path}", headers)
        b = _get(f"http://127.0.0.1:{theirs}{path}", headers)
        if a[2] == "gzip":  # gzip's header holds a time
            a, b = (*a[:3], gzip.decompress(a[3])), (*b[:3], gzip.decompress(b[3]))
        assert a == b
        assert a[0] == 200 and (path == "/favicon.ico" or len(a[3]) > 0)
    finally:
        httpd.shutdown()
        lib.shutdown()


def test_other_methods_are_refused_as_the_library_does(monkeypatch):
    reg = registry([GaugeMetricFamily("x", "y", value=1)])
    port = free_port()
    httpd = exposition.start_http_server(port, addr="127.0.0.1", registry=reg)
    try:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", method="POST", data=b"")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=5)
        assert e.value.code == 405 and e.value.headers["Allow"] == "OPTIONS,GET"
    finally:
        httpd.shutdown()


def test_name_filters_give_only_the_samples_named(monkeypatch):
    """`?name[]=`: the named samples (a counter by its `_total` name, as prometheus_client
    filters), each line as in the whole exposition, on the agent's own registry."""
    from prometheus_client.parser import text_string_to_metric_families

    reg = CollectorRegistry(auto_describe=False)  # as `serve` registers it: names not known up front
    reg.register(Fixed(agent_families(monkeypatch, 5)))
    port = free_port()
    httpd = exposition.start_http_server(port, addr="127.0.0.1", registry=reg)
    names = ["costexporter_job_tokens", "costexporter_gpu_time_seconds_total", "costexporter_redis_up"]
    try:
        q = "&".join(f"name[]={n}" for n in names)
        _, ctype, _, body = _get(f"http://127.0.0.1:{port}/metrics?{q}", {})
        _, _, _, whole = _get(f"http://127.0.0.1:{port}/metrics", {})
    finally:
        httpd.shutdown()
    got = [s for f in text_string_to_metric_families(body.decode()) for s in f.samples]
    want = [s for f in text_string_to_metric_families(whole.decode()) for s in f.samples if s.name in names]
    assert ctype.startswith("text/plain") and {s.name for s in got} == set(names)
    assert sorted(map(repr, got)) == sorted(map(repr, want))
    samples = [line for line in body.decode().splitlines() if not line.startswith("#")]
    assert set(samples) <= set(whole.decode().splitlines())


def test_the_agents_job_families_are_written_once_a_round_and_a_scrape_serves_them(monkeypatch):
    """After `prepare` (the agent's loop, after each round) a scrape neither builds nor writes a
    job family, in the format Prometheus asks for; the body is the library's bytes; the per-GPU
    gauges stay fresh per scrape; and the next round's figures are served, never the last's."""
    from costexporter.services.exporter import agent_registry

    fams = agent_families(monkeypatch, 12)
    agent = fams.agent
    reg, collector = agent_registry(agent)
    collector.prepare()
    built, written = [], []
    real_build, real_write = type(collector)._job_families, exposition._FAMILY["openmetrics"]
    monkeypatch.setattr(type(collector), "_job_families", lambda c, s: built.append(1) or real_build(c, s))
    monkeypatch.setitem(
        exposition._FAMILY, "openmetrics", lambda m, lines: written.append(m.name) or real_write(m, lines)
    )
    body = generate_openmetrics(reg)
    assert body == om_generate_latest(reg) and b"costexporter_gpu_time_seconds_total{" in body
    job_families = {m.name for m in collector._jobs(agent.snapshot(with_jobs=False).jobs_key)}
    assert "costexporter_gpu_time_seconds" in job_families and len(built) == 0
    assert written and not job_families & set(written)
    assert "costexporter_gpu_power_watts" in written  # the live gauges: per scrape
    name = next(iter(agent.jobs))
    agent.jobs[name].state.booked[0, 0] += 7_000  # the next round books 7 s more
    agent.booker.stats["rounds"] += 1
    collector.prepare()
    assert len(built) == 1
    deflated = []
    real_deflate = exposition._deflate
    monkeypatch.setattr(exposition, "_deflate", lambda raw: deflated.append(len(raw)) or real_deflate(raw))
    gz = exposition.GZIPPED[generate_openmetrics](reg)  # what Prometheus asks for: gzip
    assert one_gzip_member(gz) == om_generate_latest(reg)
    assert deflated and sum(deflated) < len(body) / 2  # only the fresh families, now
    after = generate_openmetrics(reg)
    assert after == om_generate_latest(reg) and after != body
    fresh, _ = agent_registry(agent)  # built and written in its first scrape: the same body
    assert generate_openmetrics(fresh) == after
    assert generate_text(reg) == generate_latest(reg)


def test_a_real_prometheus_reads_the_gzip_body_joined_from_parts_compressed_ahead(monkeypatch, tmp_path):
    """Prometheus asks for OpenMetrics with gzip; our answer is one gzip member whose deflate
    stream joins the job families compressed by `prepare` with the per-scrape ones. A real
    Prometheus (Go's gzip reader) scrapes it: every sample of the body is stored."""
    import json
    import time
    import urllib.parse

    import yaml

    from costexporter.services.exporter import agent_registry

    from . import prom_server

    if prom_server.PROMETHEUS is None:
        pytest.skip("prometheus not installed (.ci/run installs it)")
    reg, collector = agent_registry(agent_families(monkeypatch, 12).agent)
    collector.prepare()
    samples = sum(1 for x in om_generate_latest(reg).decode().splitlines() if x and not x.startswith("#"))
    port, prom_port = free_port(), free_port()
    httpd = exposition.start_http_server(port, addr="127.0.0.1", registry=reg)
    config = tmp_path / "prometheus.yml"
    scrape = {
        "job_name": "agent",
        "scrape_interval": "1s",
        "static_configs": [{"targets": [f"127.0.0.1:{port}"]}],
    }
    config.write_text(yaml.safe_dump({"scrape_configs": [scrape]}))
    prom = prom_server.start(config, prom_port)
    base = f"http://127.0.0.1:{prom_port}"

    def query(expr: str) -> list:
        url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.loads(r.read())["data"]["result"]

    try:
        assert prom_server.wait_ready(base)
        deadline, got = time.monotonic() + 60, []
        while time.monotonic() < deadline:
            got = query('scrape_samples_scraped{job="agent"}')
            if got:
                break
            time.sleep(0.5)
        assert got and float(got[0]["value"][1]) == samples
        assert query('up{job="agent"}')[0]["value"][1] == "1"
        time_series = next(m for m in collector._cache if m.name == "costexporter_gpu_time_seconds")
        assert len(query("costexporter_gpu_time_seconds_total")) == len(time_series.samples) > 0
    finally:
        prom.terminate()
        prom.wait(10)
        httpd.shutdown()


def test_scrapes_during_rounds_are_each_one_whole_body_of_one_round(monkeypatch):
    """The agent's thread rebuilds and compresses the job families each round while scrapes
    run in other threads (as `serve`'s HTTP threads do): every answer, gzip or not, is one
    whole body (one gzip member; each family once; the EOF last) whose job figures are those of
    a single round, never a mix of two."""
    import threading
    import time

    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    from costexporter.services.exporter import agent_registry

    agent = agent_families(monkeypatch, 6).agent
    reg, collector = agent_registry(agent)
    collector.prepare()
    stop, bodies, errors = threading.Event(), [], []

    def rounds() -> None:
        try:
            for k in range(1, 16):
                with agent.lock:  # a round's booking: every job's first category +k s at once
                    for j in agent.jobs.values():
                        j.state.booked[0, 0] = k * 1000
                    agent.booker.stats["rounds"] += 1
                collector.prepare()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            stop.set()

    def scrapes(zipped: bool) -> None:
        while not stop.is_set():
            if zipped:
                bodies.append(one_gzip_member(exposition.GZIPPED[generate_openmetrics](reg)))
            else:
                bodies.append(generate_openmetrics(reg))
            time.sleep(0.002)  # (a scrape loop without a pause would starve the rounds of the GIL)

    threads = [threading.Thread(target=rounds)] + [
        threading.Thread(target=scrapes, args=(z,)) for z in (True, False, True)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(bodies) >= 10
    for body in bodies:
        text = body.decode()
        assert text.endswith("# EOF\n") and text.count("# EOF") == 1
        fams = list(text_string_to_metric_families(text))  # each family once, or it raises
        [gpu_time] = [f for f in fams if f.name == "costexporter_gpu_time_seconds"]
        firsts = {s.value for s in gpu_time.samples if s.labels["category"] == "productive"}
        assert len(firsts) == 1  # one round's figures for every job
