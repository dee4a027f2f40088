"""The twin as a server process: resolved settings -> the engine and the HTTP app on a socket.

When the server listens it prints exactly one line to stdout, ``loadlab-sim listening on http://HOST:PORT``
(``READY_PREFIX``; the real port, also with port 0), and then nothing else on stdout; logs go to stderr.
With ``instances`` N (``loadlab sim --instances N``, a cluster's workers) one process serves N twins on one
event loop, each with its own engine, app and socket, and prints N ready lines. SIGTERM or SIGINT stops
it. ``loadlab sim`` (``loadlab/cli.py``) parses the flags and calls ``serve``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import socket
import sys

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage

from loadlab.sim import READY_PREFIX
from loadlab.sim.engine import Engine
from loadlab.sim.server import SimServer
from loadlab.sim.settings import TwinSettings, base_url, engine_config
from loadlab.sim.tokenize import Tokenizer


def serve(
    settings: TwinSettings, tokenizer: Tokenizer, instances: int = 1, api_key: str | None = None
) -> None:
    """Serves until SIGTERM or SIGINT. ``instances``: that many twins with these settings in this process,
    on one event loop, each with its own engine and socket (port 0: a free port each; else port, port + 1,
    ...), each printing its ready line. ``api_key``: required as SGLang's ``--api-key`` does
    (``loadlab.sim.auth``). Raises OSError when it cannot listen."""
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(settings, tokenizer, instances, api_key))


def _not_a_bad_message(record: logging.LogRecord) -> bool:
    # A router probing whether the worker speaks gRPC (HTTP/2) first is not a server error worth a
    # traceback (sglang-router does it to every worker it registers); aiohttp answers it with a 400.
    return not (record.exc_info and isinstance(record.exc_info[1], BadHttpMessage))


async def _serve(settings: TwinSettings, tokenizer: Tokenizer, instances: int, api_key: str | None) -> None:
    host = settings.host
    log = logging.getLogger("loadlab.sim")
    logging.getLogger("aiohttp.server").addFilter(_not_a_bad_message)
    runners: list[web.AppRunner] = []
    engines: list[Engine] = []
    try:
        for i in range(instances):
            port = settings.port + i if settings.port else 0
            sock = socket.create_server((host, port), backlog=4096)
            sock.setblocking(False)
            port = sock.getsockname()[1]  # the real port, also with 0
            url = base_url(host, port)
            # Each instance is its own worker: its URL, or the given id numbered when there are several.
            named = settings.worker_id and (
                settings.worker_id if instances == 1 else f"{settings.worker_id}-{i}"
            )
            shown = dataclasses.replace(settings, port=port, worker_id=named or url)
            engine = Engine(engine_config(shown))
            engines.append(engine)
            await engine.start()
            runner = web.AppRunner(SimServer(shown, engine, tokenizer, api_key).build_app(), handler_cancellation=True,
                                   access_log=None, shutdown_timeout=1.0)  # fmt: skip
            runners.append(runner)
            await runner.setup()
            await web.SockSite(runner, sock).start()
            sys.stdout.write(f"{READY_PREFIX}{url}\n")
            sys.stdout.flush()
            log.info(
                "serving %s as worker %s on %s: max_running_requests=%s max_total_num_tokens=%s radix_cache=%s"
                "%s",
                shown.served_model_name,
                shown.worker_id,
                engine.cost.name,
                shown.max_running_requests,
                shown.max_total_num_tokens,
                "off" if shown.disable_radix_cache else "on",
                "; API key required" if api_key else "",
            )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        for engine in engines:
            await engine.stop()
        for runner in runners:
            await runner.cleanup()
