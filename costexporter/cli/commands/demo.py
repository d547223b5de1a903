"""`costexporter demo`: the simulated story, live, then the bill."""

from __future__ import annotations

import click

from costexporter.cli.options import (
    DEFAULT_API_PORT,
    DEFAULT_METRICS_PORT,
    InputFailure,
    bind_port,
    check_port,
    listen_option,
    prefix_option,
    redis_url_option,
    require_redis,
    setup_logging,
)
from costexporter.cli.render import demo_bill, demo_loop
from costexporter.cli.servers import api_app, serve_in_thread


@click.command()
@redis_url_option(None, "Redis to use [default: a private redis-server in a temporary directory].")
@prefix_option
@click.option(
    "--speed",
    type=click.FloatRange(min=1),
    default=160.0,
    help="Times faster than real time (160: the ~8-hour story in about 3 minutes).",
)
@click.option(
    "--scenario",
    type=click.Choice(["r1", "mini"]),
    default="r1",
    help="The story: r1 (16 x B300, R1 + R7) or mini (4 GPUs, 40 min).",
)
# Loopback: the demo's API has no tokens; a container (the compose stack) passes 0.0.0.0.
@listen_option("/metrics server and the finance API", default="127.0.0.1")
@click.option(
    "--port", type=int, default=DEFAULT_METRICS_PORT, help="/metrics of the agent and the watcher (0: none)."
)
@click.option("--api-port", type=int, default=DEFAULT_API_PORT, help="The finance API (0: none).")
@click.option("--plain", is_flag=True, help="Print a status line every few seconds instead of the live view.")
@click.option(
    "--linger",
    type=click.FloatRange(min=0),
    default=0.0,
    help="Keep serving this many seconds after the story ends.",
)
@click.option("--forever", is_flag=True, help="Keep serving after the story ends until stopped.")
@click.option(
    "--no-watch", is_flag=True, help="Do not run the watcher in-process (run `costexporter watch`)."
)
@click.option("--json", "as_json", is_flag=True, help="Print the final bill as JSON.")
def demo(
    redis_url: str | None,
    prefix: str,
    speed: float,
    scenario: str,
    listen: str,
    port: int,
    api_port: int,
    plain: bool,
    linger: float,
    forever: bool,
    no_watch: bool,
    as_json: bool,
) -> None:
    """Play the R1 + R7 story (a deadlock at a checkpoint, a hung write, a crash loop and a
    resume) on a simulated job, live, then print the bill.

    The story is placed so that it ends when the demo starts: the finance API's default window
    covers it. A rerun on the same Redis and prefix clears the earlier demo's data first; a
    prefix holding other data is refused. Interrupted (Ctrl-C, SIGTERM, SIGHUP), it prints the
    bill so far marked partial and exits 128 + the signal."""
    import contextlib
    import json
    import logging
    import signal
    import threading

    from costexporter.tools.demo import (
        Demo,
        DemoConfig,
        DemoError,
        PrivateRedis,
        embedded_redis,
    )

    setup_logging(logging.WARNING)
    check_port(listen, port, "--port")
    api_sock = bind_port(listen, api_port, "--api-port")
    stop = threading.Event()
    got: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        got.append(signum)
        stop.set()

    # Ctrl-C, SIGTERM and closing the terminal (SIGHUP) stop the demo the same way: the bill so
    # far (partial), then the private Redis, the temporary directories and the threads go.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    failed: str | None = None
    partial = False
    try:
        if redis_url:
            # Fail fast instead of playing a story of zeros.
            require_redis(
                redis_url, "the Redis of --redis-url does not answer ({e}); omit it for a private one"
            )
        ctx = contextlib.nullcontext(PrivateRedis(redis_url)) if redis_url else embedded_redis()
        with ctx as private:
            url = private.url
            cfg = DemoConfig(
                redis_url=url,
                prefix=prefix,
                scenario=scenario,
                speed=speed,
                watch=not no_watch,
                redis=private if private.proc is not None else None,
            )
            d = Demo(cfg)
            try:
                d.start()
                if port:
                    from costexporter.services.exposition import start_http_server

                    start_http_server(port, addr=listen, registry=d.registry())
                if api_sock is not None:
                    serve_in_thread(api_app(url, prefix, None, "USD", "UTC"), api_sock)
                click.echo(
                    f"costexporter demo: Redis {url}, /metrics {f':{port}' if port else 'off'}, "
                    f"API {f':{api_port}' if api_port else 'off'}, speed {speed:g}x",
                    err=True,
                )
                if api_port:
                    host = "127.0.0.1" if listen in ("0.0.0.0", "::") else listen
                    click.echo(
                        f"costexporter demo: the bill over HTTP: curl -s http://{host}:{api_port}"
                        f"/api/v1/jobs/{d.job}",
                        err=True,
                    )
                # Status (live view or plain lines) goes to stderr: stdout carries only the bill.
                demo_loop(d, plain, stop)
                failed = d.failure()
                partial = not d.finished
                bill = d.bill(partial=partial)
                with contextlib.suppress(OSError):  # the terminal may be gone (SIGHUP)
                    if as_json:
                        click.echo(json.dumps(bill, indent=2))
                    else:
                        demo_bill(bill)
                if failed:
                    click.echo(f"costexporter demo: {failed}", err=True)
                elif partial:
                    click.echo(
                        "costexporter demo: stopped before the story's end: the bill is partial", err=True
                    )
                elif forever:
                    stop.wait()
                elif linger:
                    stop.wait(linger)
            finally:
                d.stop()
    except DemoError as e:
        raise InputFailure(str(e)) from None
    if got and partial:
        raise SystemExit(128 + got[0])
    if failed:
        raise SystemExit(1)
