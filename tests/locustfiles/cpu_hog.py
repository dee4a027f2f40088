"""loadlab's users plus a CPU hog in the same process: a deliberately starved load generator."""

import time

import gevent
from locust import events

from loadlab.swarm.locustfile import *  # noqa: F403 - loadlab's users, options and hooks

HOG_BUSY_S = 0.04  # the hog holds the process this long at a time, every HOG_PERIOD_S
HOG_PERIOD_S = 0.05


def _hog() -> None:
    while True:
        start = time.perf_counter()
        while time.perf_counter() - start < HOG_BUSY_S:
            pass
        gevent.sleep(HOG_PERIOD_S - HOG_BUSY_S)


@events.test_start.add_listener
def _start_hog(environment, **_kw):
    gevent.spawn(_hog)
