"""loadlab's Locust entry point: `locust -f locustfile.py --headless` load-tests with profiles/default.yaml.

All the logic lives in the loadlab package (loadlab/swarm/locustfile.py) so `loadlab run` runs the same code.
"""

from loadlab.swarm.locustfile import *  # noqa: F403 - the user class and the event hooks
