"""`costexporter demo`: the simulated story, live, then the bill."""

from __future__ import annotations

import click

from costexporter.cli.options import (
    DEFAULT_API_PORT,
    DEFAULT_METRICS_PORT,
    InputFailure,
    check_port,
    listen_option,
    prefix_option,
    redis_url_option,
    require_redis,
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
@click.option("--scenario", default="r1", help="The story: r1 (16 x B300, R1 + R7) or mini (4 GPUs, 40 min).")
@listen_option("/metrics server and the finance API")
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
    redis_url, prefix, speed, scenario, listen, port, api_port, plain, linger, forever, no_watch, as_json
) -> None:
    """Play the R1 + R7 story (docs/background.md) on a simulated job, live, then print the bill."""
    import contextlib
    import json
    import logging
    import signal
    import threading

    from costexporter.tools.demo import (
        Demo,
        DemoConfig,
        DemoError,
        embedded_redis,
    )

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    check_port(listen, port, "--port")
    check_port(listen, api_port, "--api-port")
    stop = threading.Event()
    # Closing the terminal (SIGHUP) stops the demo like SIGTERM: the private Redis, the temporary
    # directories and the threads are cleaned up on the way out.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    try:
        if redis_url:
            # Fail fast instead of playing a story of zeros.
            require_redis(
                redis_url, "the Redis of --redis-url does not answer ({e}); omit it for a private one"
            )
        ctx = contextlib.nullcontext(redis_url) if redis_url else embedded_redis()
        with ctx as url:
            cfg = DemoConfig(redis_url=url, prefix=prefix, scenario=scenario, speed=speed, watch=not no_watch)
            d = Demo(cfg)
            try:
                d.start()
                if port:
                    from prometheus_client import start_http_server

                    start_http_server(port, addr=listen, registry=d.registry())
                if api_port:
                    serve_in_thread(api_app(url, prefix, None, "USD", "UTC"), listen, api_port)
                click.echo(
                    f"costexporter demo: Redis {url}, /metrics {f':{port}' if port else 'off'}, "
                    f"API {f':{api_port}' if api_port else 'off'}, speed {speed:g}x",
                    err=True,
                )
                # Status (live view or plain lines) goes to stderr: stdout carries only the bill.
                demo_loop(d, plain, stop)
                bill = d.bill()
                with contextlib.suppress(OSError):  # the terminal may be gone (SIGHUP)
                    if as_json:
                        click.echo(json.dumps(bill, indent=2))
                    else:
                        demo_bill(bill)
                if forever:
                    stop.wait()
                elif linger:
                    stop.wait(linger)
            finally:
                d.stop()
    except DemoError as e:
        raise InputFailure(str(e)) from None
    except KeyboardInterrupt:
        pass
