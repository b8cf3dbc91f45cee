"""``tokentrace proxy --upstream URL``: the agent for engines it cannot patch (docs/proxy.md).

Import-light: argparse only; the proxy and the agent's runtime load inside ``run()``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

_DEFAULT_LISTEN = "127.0.0.1:8090"
_ENGINES = ("auto", "llama-server", "tgi", "ollama", "openai")
"""``proxy_engines.ENGINES`` (spelled here too, to keep this module import-light)."""
_DEFAULT_SERVICE = "tokentrace-proxy"
_SWITCH_INTERVAL_S = 0.001


class ProxyCommand:
    name = "proxy"
    help = (
        "a reverse proxy beside an engine the agent cannot patch (llama-server, TGI, Ollama, "
        "any OpenAI-compatible server): request spans from the stream and the engine's timings"
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.error = _one_line_error  # type: ignore[method-assign]
        parser.add_argument(
            "--upstream",
            required=True,
            metavar="URL",
            help="the engine, e.g. http://127.0.0.1:8080",
        )
        parser.add_argument(
            "--listen",
            default=_DEFAULT_LISTEN,
            metavar="HOST:PORT",
            help=f"where clients connect (default {_DEFAULT_LISTEN}; port 0: any free port)",
        )
        parser.add_argument(
            "--engine",
            default="auto",
            choices=_ENGINES,
            help="whose timing report to read (default auto: from each response)",
        )
        parser.add_argument(
            "--service-name",
            help="service.name of the spans (default OTEL_SERVICE_NAME, else the engine's name)",
        )

    def run(self, args: argparse.Namespace) -> int:
        import asyncio
        import logging

        from tokentrace.agent.proxy import ProxyError, ProxyServer, parse_listen, parse_upstream

        try:
            host, port = parse_listen(args.listen)
            parse_upstream(args.upstream)
        except ProxyError as error:
            print(f"tokentrace proxy: {error}", file=sys.stderr)
            return 2
        if args.service_name:
            os.environ["OTEL_SERVICE_NAME"] = args.service_name
        elif not os.environ.get("OTEL_SERVICE_NAME") and "service.name=" not in os.environ.get(
            "OTEL_RESOURCE_ATTRIBUTES", ""
        ):
            name = args.engine if args.engine != "auto" else _DEFAULT_SERVICE
            os.environ["OTEL_SERVICE_NAME"] = name
        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        # The emitter's and sender's threads share the GIL with the event loop: a 1 ms switch
        # interval (default 5 ms) bounds how long a chunk can wait for them.
        sys.setswitchinterval(_SWITCH_INTERVAL_S)
        try:
            return asyncio.run(_serve(ProxyServer, args, host, port))
        except OSError as error:  # the listen address is taken or not ours
            print(f"tokentrace proxy: cannot listen on {args.listen}: {error}", file=sys.stderr)
            return 2


def _one_line_error(message: str) -> NoReturn:
    """argparse's errors as one line (no usage block): exit status 2."""
    print(f"tokentrace proxy: {message} (see tokentrace proxy --help)", file=sys.stderr)
    sys.exit(2)


async def _serve(server_class: type, args: argparse.Namespace, host: str, port: int) -> int:
    import asyncio
    import signal

    from tokentrace.agent.runtime import get_runtime

    runtime = get_runtime()
    proxy = server_class(args.upstream, runtime=runtime, engine=args.engine, host=host, port=port)
    await proxy.start()
    shown = f"[{proxy.host}]" if ":" in proxy.host else proxy.host
    tracing = (
        "tracing off (TOKENTRACE_ENABLED / OTEL_SDK_DISABLED)"
        if runtime is None
        else (f"spans to {runtime.config.exporter.endpoint}")
    )
    print(
        f"tokentrace proxy: listening on http://{shown}:{proxy.port} -> {args.upstream} "
        f"(engine {args.engine}; {tracing})",
        file=sys.stderr,
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await proxy.close()
    if runtime is not None:
        await loop.run_in_executor(None, runtime.shutdown)
    return 0
