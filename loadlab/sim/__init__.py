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
- ``auth``: SGLang's API key check (``--api-key``), for the twin and the omni front.
"""

from loadlab import __version__

# The one line the server prints on stdout when it listens (``loadlab.procs.ReadyLineProcess`` reads it).
READY_PREFIX = "loadlab-sim listening on "
SIM_VERSION = f"loadlab-sim {__version__}"

# Attribution headers (docs/sim.md, docs/records.md). Every response of a twin carries WORKER_HEADER: the
# worker's id (its base URL unless set); a router passes it through, so the client learns which worker
# served. A front (loadlab's omni front) marks the answers it gives itself (a 429, ...) with FRONT_HEADER.
WORKER_HEADER = "x-loadlab-worker"
FRONT_HEADER = "x-loadlab-front"
REQUEST_ID_HEADER = "x-request-id"  # echoed back when a request sends it (routers forward it)
