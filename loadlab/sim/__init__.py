"""The embedded simulated SGLang server (``loadlab sim``).

- ``loadlab.sim.cli``: command line (``main``, ``build_parser``), ``check_embedded_settings`` and
  ``settings_to_argv`` for a profile's ``target.embedded`` mapping.
- ``loadlab.sim.engine``: the continuous-batching engine with a prefix cache and its cost model.
- ``loadlab.sim.server``: SGLang's HTTP wire protocol on aiohttp.
- ``loadlab.sim.tokenize``: prompt text to token ids, and the output words.

This module imports nothing heavy, so ``loadlab.sim.cli.check_embedded_settings`` stays cheap to import.
"""

READY_PREFIX = "loadlab-sim listening on "
