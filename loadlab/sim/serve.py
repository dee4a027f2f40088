"""The twin as a server process: resolved settings -> the engine and the HTTP app on a socket.

When the server listens it prints exactly one line to stdout, ``loadlab-sim listening on http://HOST:PORT``
(``READY_PREFIX``; the real port, also with port 0), and then nothing else on stdout; logs go to stderr.
SIGTERM or SIGINT stops it. ``loadlab sim`` (``loadlab/cli.py``) parses the flags and calls ``serve``.
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

from loadlab.sim import READY_PREFIX
from loadlab.sim.engine import Engine
from loadlab.sim.server import SimServer
from loadlab.sim.settings import TwinSettings, base_url, engine_config
from loadlab.sim.tokenize import Tokenizer


def serve(settings: TwinSettings, tokenizer: Tokenizer) -> None:
    """Serves until SIGTERM or SIGINT. Raises OSError when it cannot listen."""
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(settings, tokenizer))


async def _serve(settings: TwinSettings, tokenizer: Tokenizer) -> None:
    engine = Engine(engine_config(settings))
    host = settings.host
    sock = socket.create_server((host, settings.port), backlog=4096)
    sock.setblocking(False)
    port = sock.getsockname()[1]  # the real port, also with 0
    url = base_url(host, port)
    settings = dataclasses.replace(settings, port=port, worker_id=settings.worker_id or url)
    await engine.start()
    app = SimServer(settings, engine, tokenizer).build_app()
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    try:
        site = web.SockSite(runner, sock)
        await site.start()
        sys.stdout.write(f"{READY_PREFIX}{url}\n")
        sys.stdout.flush()
        logging.getLogger("loadlab.sim").info(
            "serving %s as worker %s on %s: max_running_requests=%s max_total_num_tokens=%s radix_cache=%s",
            settings.served_model_name,
            settings.worker_id,
            engine.cost.name,
            settings.max_running_requests,
            settings.max_total_num_tokens,
            "off" if settings.disable_radix_cache else "on",
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await engine.stop()
        await runner.cleanup()
