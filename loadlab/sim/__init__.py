"""The twin: a simulated SGLang server. It imports only ``loadlab.sim.*`` (and ``loadlab.lateness``): the
engine knows nothing of profiles, clients, analysis or Locust.

- ``settings``: the settings table (SGLang's flag names), validation, the argv round trip, resolution.
- ``cost``: GPU x model presets: step times and KV capacity.
- ``radix``: the prefix cache (token radix tree).
- ``scheduler``: SGLang's scheduling loop, pure (no clock, no asyncio).
- ``engine``: the scheduler on the asyncio clock (the real-time driver behind the server).
- ``clock``: the scheduler on a virtual clock (``run_requests``), the virtual time grid, token events.
- ``server``: SGLang's HTTP wire protocol on aiohttp; ``serve``: the server process.
- ``tokenize``: prompt text to token ids, and the output words.
"""

from loadlab import __version__

# The one line the server prints on stdout when it listens (``loadlab.procs.ReadyLineProcess`` reads it).
READY_PREFIX = "loadlab-sim listening on "
SIM_VERSION = f"loadlab-sim {__version__}"
