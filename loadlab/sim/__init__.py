"""The embedded simulated SGLang server (``loadlab sim``).

- ``loadlab.sim.cli``: command line (``main``, ``build_parser``), ``check_embedded_settings`` and
  ``settings_to_argv`` for a profile's ``target.embedded`` mapping, ``loadlab sim --virtual``.
- ``loadlab.sim.cost``: GPU x model presets: step times and KV capacity.
- ``loadlab.sim.radix``: the prefix cache (token radix tree).
- ``loadlab.sim.scheduler``: SGLang's scheduling loop, pure (no clock, no asyncio).
- ``loadlab.sim.engine``: the scheduler on the asyncio clock (the real-time driver behind the server).
- ``loadlab.sim.virtual``: the scheduler on a simulated clock with a client model; ``run_virtual``.
- ``loadlab.sim.server``: SGLang's HTTP wire protocol on aiohttp.
- ``loadlab.sim.tokenize``: prompt text to token ids, and the output words.

This module imports nothing heavy, so ``loadlab.sim.cli.check_embedded_settings`` stays cheap to import.
"""

READY_PREFIX = "loadlab-sim listening on "
