"""A cluster of SGLang workers (the twin) behind one front, from a cluster file (``docs/cluster.md``).

- ``config``: the cluster file (``ClusterConfig``, ``load_cluster``: one-line file:line errors).
- ``launch``: ``loadlab cluster CLUSTER.yaml``: the workers, then the front, one ready line, then serve
  until SIGTERM or SIGINT.
- ``omni``: loadlab's own global front (its own process; the launcher starts it), ``policies``: its
  routing decisions as pure functions (shared with the virtual-time model), ``signals``: what it polls.

It imports the twin's settings, ``loadlab.procs``, ``loadlab.yamlconfig`` and ``loadlab.profile`` (to check
a profile's classes against the districts: ``config.check_classes``); never the targets, the swarm or the
analysis (``loadlab.target.cluster`` starts a cluster for a run).
"""

# The one line ``loadlab cluster`` prints on stdout when every worker and the front answer, followed by a
# JSON object: {"name", "front": URL or null, "kind", "policy", "workers": [{"url", "district"}]}.
READY_PREFIX = "loadlab-cluster ready "
# In each line the launcher logs on stderr when something goes wrong while it serves (a worker that died, a
# front that exited): what starts a cluster for a run echoes these lines into the run's own log.
ERROR_MARK = "ERROR loadlab cluster: "
