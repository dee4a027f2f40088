"""Test and benchmark support, not part of a run.

- ``scripted``: the scripted server with exactly known event times, an independent reference for the
  client's timing (on purpose sharing no wire code with the twin; it only prints the twin's ready line).
- ``servers``: the twin and the scripted server started as children (``ServerProcess``, ``ScriptedServer``,
  ``start_scripted``, ``start_twin``), for the tests and the benchmarks alike.
"""
