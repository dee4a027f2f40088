"""omni: loadlab's model of the seed's global scheduler, a real HTTP front (aiohttp) over SGLang workers.

    python -m loadlab.cluster.omni --host 127.0.0.1 --port 0 --policy NAME --poll-interval-s S \\
        --queue-size N [--max-in-flight-per-worker K] [--class-header H] \\
        [--switch CLASS=DISTRICT,... ... [--switch-after-waiting N]] \\
        (WORKER_URL... | --district NAME[:CLASS,...]=URL,URL... ...)

prints ``loadlab-omni listening on http://HOST:PORT`` when it listens (``omni_process.READY_PREFIX``), logs
to stderr, and stops on SIGTERM or SIGINT (exit 0); a bad flag is one line and exit 2.

- Proxy: ``POST /generate``, ``/v1/completions``, ``/v1/chat/completions`` go to the worker the policy picks
  (``loadlab.cluster.policies``), body bytes unchanged; the worker's status, headers (hop-by-hop removed)
  and body come back unchanged, chunk by chunk as they arrive. Request headers forwarded: content-type,
  authorization, x-request-id and ``x-request-id-*``, x-correlation-id, traceparent, tracestate (the
  real sglang-router's set). ``GET /v1/models``, ``/server_info``, ``/model_info`` come from a healthy
  worker; ``/flush_cache`` is fanned out; ``/health`` and ``/metrics`` are omni's own.
- Feedback loop: every ``--poll-interval-s`` each worker's ``GET /get_load`` and ``GET /metrics``
  (``loadlab.cluster.signals``); decisions use these stale signals plus omni's own in-flight count per
  worker. A failed poll, or a connection error while proxying, marks a worker down until a poll succeeds.
- Bounded queue: a request waits in a FIFO while every healthy worker has its limit in flight
  (``--max-in-flight-per-worker``, default each worker's ``max_running_requests``); beyond
  ``--queue-size`` waiting it gets 429, with no healthy worker 503. Every response omni produces itself
  carries ``x-loadlab-front: omni``.
- API key: with ``LOADLAB_SERVER_API_KEY`` set, clients must send it as SGLang's ``--api-key`` wants
  (``loadlab.sim.auth``: 401 otherwise, /health and /metrics open), and omni sends it to its workers.

- Districts and SLO classes: ``--district NAME[:CLASS,...]=URL,...`` groups workers; a district naming
  classes serves only those, one without serves any. A request's class is the value of its class header
  (``--class-header``, default ``x-request-id-class``, the header a profile's ``classes[].carry.header``
  sets); it goes to a worker of a district serving it (the policy chooses among those), waiting in its
  class's own bounded queue (``SloClass``). A request without the header, or naming a class no district
  names, is class ``default``: the districts serving any class; with none, 400 ``unserved_class``.
  Positional WORKER_URLs are one district, ``default``, serving any class.
- The switch: ``--switch CLASS=DISTRICT,...`` lets a class's overflow go to other districts: when no worker
  of its own districts has room and more than ``--switch-after-waiting`` of its requests are in line, the
  first in line goes to a worker of a switch district with room (``policies.next_in_line``; docs/omni.md).
docs/cluster.md ("The omni front") is the user's description.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import random
import re
import signal
import socket
import sys
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from loadlab import exits
from loadlab.cliargs import OneLineParser, non_negative, positive
from loadlab.cluster.omni_process import READY_PREFIX
from loadlab.cluster.policies import (
    CLASS_HEADER,
    DEFAULT_CLASS,
    POLICIES,
    PolicyParams,
    Snapshot,
    WorkerLoad,
    class_districts,
    class_of,
    in_flight_limit,
    next_in_line,
    prompt_prefix,
    switch_problem,
)
from loadlab.cluster.signals import Signals, combine, parse_get_load, parse_metrics
from loadlab.sim.auth import API_KEY_ENV, UNAUTHORIZED, authorized, key_problem, needs_key, server_api_key

log = logging.getLogger("loadlab.omni")

PROG = "python -m loadlab.cluster.omni"
FRONT_HEADER = "x-loadlab-front"
FRONT_VALUE = "omni"
PROXIED = ("/generate", "/v1/completions", "/v1/chat/completions")
FROM_A_WORKER = ("/v1/models", "/server_info", "/get_server_info", "/model_info", "/get_model_info")
# Request headers passed to the worker (sglang-router's set, plus the body's content type).
FORWARD_HEADERS = ("content-type", "authorization", "x-request-id", "x-correlation-id", "traceparent",
                   "tracestate")  # fmt: skip
FORWARD_PREFIXES = ("x-request-id-",)
HOP_BY_HOP = frozenset(("connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                        "trailer", "trailers", "transfer-encoding", "upgrade"))  # fmt: skip
QUEUE_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
PASSTHROUGH = "omni.passthrough"  # request key: the response is a worker's, not omni's


@dataclass(frozen=True)
class DistrictSpec:
    """A group of workers and the classes it serves (None: any class)."""

    name: str
    workers: tuple[str, ...]
    serves: tuple[str, ...] | None = None

    def arg(self) -> str:
        """Its ``--district`` value."""
        serves = "" if self.serves is None else ":" + ",".join(self.serves)
        return f"{self.name}{serves}={','.join(self.workers)}"


@dataclass(frozen=True)
class OmniConfig:
    """The front's settings (the command line's flags). ``districts``: empty means one district,
    ``default``, over ``workers``, serving any class."""

    workers: tuple[str, ...]
    policy: str = "round_robin"
    poll_interval_s: float = 1.0
    queue_size: int = 100
    max_in_flight_per_worker: int | None = None
    in_flight_fraction: float = 1.0  # without max_in_flight_per_worker: this much of max_running_requests
    host: str = "127.0.0.1"
    port: int = 0
    poll_timeout_s: float = 2.0
    prefix_len: int = 256
    params: PolicyParams = field(default_factory=PolicyParams)
    seed: int = 0
    districts: tuple[DistrictSpec, ...] = ()
    class_header: str = CLASS_HEADER
    # The switch: (class, the districts its overflow may go to) each; see policies.next_in_line.
    switch: tuple[tuple[str, tuple[str, ...]], ...] = ()
    switch_after_waiting: int = 0
    # The key clients must send and omni sends its workers (LOADLAB_SERVER_API_KEY); never in a repr.
    api_key: str | None = field(default=None, repr=False)

    def district_specs(self) -> tuple[DistrictSpec, ...]:
        return self.districts or (DistrictSpec(DEFAULT_CLASS, tuple(self.workers)),)


class Reject(Exception):
    """A request omni answers itself (429 queue full, 503 no healthy worker, 502 worker error)."""

    def __init__(self, status: int, reason: str, message: str, **extra):
        super().__init__(message)
        self.status, self.reason, self.message, self.extra = status, reason, message, extra


class _ConnectFailed(Exception):
    """The worker could not be reached: it never got the request, so another worker may take it."""


class Worker:
    """One worker's state: health, omni's own counts, the last poll's signals."""

    def __init__(self, index: int, url: str, district: str = DEFAULT_CLASS):
        self.index = index
        self.url = url.rstrip("/")
        self.district = district
        self.up = False
        self.down_reason = "not polled yet"
        self.in_flight = 0
        self.routed = 0
        self.max_running: int | None = None  # from /server_info
        self.max_total_tokens: int | None = None
        self.info_read = False  # /server_info read since the worker last came up
        self.limit_flag: int | None = None  # --max-in-flight-per-worker
        self.fraction = 1.0  # --in-flight-fraction
        self.signals = Signals()
        self.in_flight_at_poll = 0
        self.polled_at: float | None = None  # loop time of the last successful poll

    @property
    def limit(self) -> int | None:
        return in_flight_limit(self.max_running, self.limit_flag, self.fraction)

    def load(self) -> WorkerLoad:
        s = self.signals
        return WorkerLoad(
            index=self.index,
            name=self.url,
            up=self.up,
            in_flight=self.in_flight,
            limit=self.limit,
            routed=self.routed,
            running=s.running,
            waiting=s.waiting,
            token_usage=s.token_usage,
            in_flight_at_poll=self.in_flight_at_poll,
            max_running=self.max_running,
        )


@dataclass
class SloClass:
    """A class of requests: its own FIFO queue and bound, over its own pool of workers (its district), and
    the workers of its switch districts (``spill``) its overflow may go to."""

    name: str
    queue_size: int
    workers: list[Worker]
    queue: deque[_Waiter] = field(default_factory=deque)
    cursor: int = 0  # round robin: the worker index after the last choice
    spill: list[Worker] = field(default_factory=list)
    spill_cursor: int = 0
    switch_after: int = 0
    switched: dict[str, int] = field(default_factory=dict)  # district -> requests diverted there


@dataclass
class _Waiter:
    future: asyncio.Future
    key: bytes | None
    since: float


class _Metrics:
    """omni's own Prometheus metrics: counters as events happen, gauges read from the state at scrape time."""

    def __init__(self, omni: Omni):
        from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
        from prometheus_client.core import GaugeMetricFamily

        disable_created_metrics()  # no *_created series: omni is a process of its own

        r = self.registry = CollectorRegistry(auto_describe=True)
        urls = [w.url for w in omni.workers]
        self.received = Counter("omni_requests", "Requests received on the proxied endpoints.",
                                ["endpoint"], registry=r)  # fmt: skip
        self.routed = Counter("omni_requests_routed", "Requests sent to each worker (again after a failed "
                              "connection moved one to another worker).", ["worker"], registry=r)  # fmt: skip
        self.responses = Counter("omni_worker_responses", "Worker responses passed through, by HTTP status.",
                                 ["worker", "code"], registry=r)  # fmt: skip
        self.rejects = Counter("omni_rejects", "Requests omni answered itself instead of a worker, by reason.",
                               ["reason"], registry=r)  # fmt: skip
        self.proxy_errors = Counter("omni_proxy_errors", "Connection errors while proxying to a worker.",
                                    ["worker", "kind"], registry=r)  # fmt: skip
        self.polls = Counter("omni_polls", "Polls of each worker's load signals, by result.",
                             ["worker", "result"], registry=r)  # fmt: skip
        self.queue_wait = Histogram("omni_queue_wait_seconds", "Time requests waited in omni's queue.",
                                    ["slo_class"], buckets=QUEUE_WAIT_BUCKETS, registry=r)  # fmt: skip
        for endpoint in PROXIED:
            self.received.labels(endpoint)
        for url in urls:
            self.routed.labels(url)
            for result in ("ok", "failed"):
                self.polls.labels(url, result)
        self.class_received = Counter("omni_class_requests", "Requests received, by the SLO class omni "
                                      "gave them.", ["slo_class"], registry=r)  # fmt: skip
        self.class_routed = Counter("omni_class_routed", "Requests of each class sent to a worker of each "
                                    "district.", ["slo_class", "district"], registry=r)  # fmt: skip
        self.class_rejects = Counter("omni_class_rejects", "Requests of each class omni answered itself, by "
                                     "reason.", ["slo_class", "reason"], registry=r)  # fmt: skip
        self.class_switched = Counter("omni_class_switched", "Requests of each class the switch diverted to a "
                                      "worker of another district (its own districts full).",
                                      ["slo_class", "district"], registry=r)  # fmt: skip
        for reason in ("queue_full", "no_healthy_worker", "worker_error", "unserved_class"):
            self.rejects.labels(reason)
        for cls in omni.classes.values():
            self.queue_wait.labels(cls.name)
            self.class_received.labels(cls.name)
            for reason in ("queue_full", "no_healthy_worker", "worker_error"):
                self.class_rejects.labels(cls.name, reason)
            for d in dict.fromkeys(w.district for w in cls.workers):
                self.class_routed.labels(cls.name, d)
            for d in dict.fromkeys(w.district for w in cls.spill):
                self.class_routed.labels(cls.name, d)
                self.class_switched.labels(cls.name, d)

        class _State:
            def collect(self):
                now = asyncio.get_running_loop().time()
                up = GaugeMetricFamily("omni_worker_up", "1 while omni routes to the worker, 0 while down.",
                                       labels=["worker"])  # fmt: skip
                fl = GaugeMetricFamily("omni_requests_in_flight", "omni's requests in flight per worker.",
                                       labels=["worker"])  # fmt: skip
                lim = GaugeMetricFamily("omni_worker_max_in_flight", "The most requests omni lets a worker "
                                        "have in flight (0: no limit).", labels=["worker"])  # fmt: skip
                sig = GaugeMetricFamily("omni_worker_signal", "The last poll's load signals per worker.",
                                        labels=["worker", "signal"])  # fmt: skip
                age = GaugeMetricFamily("omni_worker_signal_age_seconds", "Age of each worker's last "
                                        "successful poll.", labels=["worker"])  # fmt: skip
                for w in omni.workers:
                    up.add_metric([w.url], 1.0 if w.up else 0.0)
                    fl.add_metric([w.url], w.in_flight)
                    lim.add_metric([w.url], w.limit or 0)
                    s = w.signals
                    for name in ("running", "waiting", "token_usage", "num_tokens"):
                        value = getattr(s, name)
                        if value is not None:
                            sig.add_metric([w.url, name], value)
                    if w.polled_at is not None:
                        age.add_metric([w.url], now - w.polled_at)
                q = GaugeMetricFamily("omni_queue_length", "Requests waiting in omni's queue.",
                                      labels=["slo_class"])  # fmt: skip
                for c in omni.classes.values():
                    q.add_metric([c.name], len(c.queue))
                yield from (up, fl, lim, sig, age, q)

            def describe(self):
                return []

        r.register(_State())

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _error(status: int, reason: str, message: str, **extra) -> web.Response:
    """An error omni produces: an SGLang-style OpenAI error body, with omni's reason."""
    body = {"object": "error", "message": message, "type": reason, "param": None, "code": status,
            "front": FRONT_VALUE, "reason": reason, **extra}  # fmt: skip
    return web.json_response(body, status=status)


def _pass_headers(headers: Iterable[tuple[str, str]]) -> CIMultiDict:
    """A worker's response headers without the hop-by-hop ones (nor those its Connection header names)."""
    items = list(headers)
    drop = set(HOP_BY_HOP)
    for k, v in items:
        if k.lower() == "connection":
            drop.update(t.strip().lower() for t in v.split(","))
    return CIMultiDict((k, v) for k, v in items if k.lower() not in drop)


def _forward_headers(headers) -> dict[str, str]:
    out = {}
    for k, v in headers.items():
        lk = k.lower()
        if lk in FORWARD_HEADERS or lk.startswith(FORWARD_PREFIXES):
            out[k] = v
    return out


class Omni:
    """The front: workers, classes, the poller, the queue, the proxy. ``start()``, ``app``, ``stop()``."""

    def __init__(self, config: OmniConfig):
        self.config = config
        self.districts = config.district_specs()
        self.workers = [Worker(i, url, d.name) for i, (d, url) in
                        enumerate((d, url) for d in self.districts for url in d.workers)]  # fmt: skip
        for w in self.workers:
            w.limit_flag = config.max_in_flight_per_worker
            w.fraction = config.in_flight_fraction
        self.class_header = config.class_header
        self._pools = class_districts([(d.name, d.serves) for d in self.districts])
        self.classes = {name: SloClass(name, config.queue_size, [w for w in self.workers if w.district in ds])
                        for name, ds in self._pools.items()}  # fmt: skip
        for name, targets in config.switch:
            c = self.classes[name]
            c.spill = [w for w in self.workers if w.district in targets]
            c.switch_after = config.switch_after_waiting
            c.switched = dict.fromkeys(targets, 0)
        self.rng = random.Random(config.seed)
        self.needs_key = config.policy == "prefix"
        self.auth = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self.metrics = _Metrics(self)
        self.session: aiohttp.ClientSession | None = None
        self._pollers: list[asyncio.Task] = []

    # -- life ---------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Opens the client session and polls every worker once (so the first requests have signals and
        limits); then polls each worker every ``poll_interval_s`` in the background."""
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, enable_cleanup_closed=True)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.config.poll_timeout_s)
        self.session = aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                             skip_auto_headers=("Accept-Encoding", "User-Agent"))  # fmt: skip
        await asyncio.gather(*(self._poll(w) for w in self.workers))
        self._pollers = [asyncio.create_task(self._poll_loop(w)) for w in self.workers]

    async def stop(self) -> None:
        for t in self._pollers:
            t.cancel()
        for t in self._pollers:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        for c in self.classes.values():
            while c.queue:
                waiter = c.queue.popleft()
                if not waiter.future.done():
                    waiter.future.set_exception(Reject(503, "no_healthy_worker", "omni is stopping"))
        if self.session is not None:
            await self.session.close()

    def build_app(self) -> web.Application:
        # SGLang's check on omni's own door too (only with a key: an open front pays nothing per request).
        middlewares = [self._check_key] if self.config.api_key else []
        app = web.Application(client_max_size=256 * 1024 * 1024, middlewares=middlewares)
        r = app.router
        for path in PROXIED:
            r.add_post(path, self.proxy)
        for path in FROM_A_WORKER:
            r.add_get(path, self.from_a_worker)
        r.add_route("GET", "/flush_cache", self.flush_cache)
        r.add_route("POST", "/flush_cache", self.flush_cache)
        r.add_get("/health", self.health)
        r.add_get("/metrics", self.metrics_endpoint)
        r.add_get("/omni/workers", self.workers_endpoint)
        app.on_response_prepare.append(self._mark_own)
        return app

    @web.middleware
    async def _check_key(self, request: web.Request, handler) -> web.StreamResponse:
        """401 ``{"error": "Unauthorized"}`` without the key, as SGLang answers (``loadlab.sim.auth``)."""
        headers = request.headers
        if needs_key(request.method, request.path) and not authorized(
            headers.get("Authorization"), headers.get("x-api-key"), self.config.api_key
        ):
            self.metrics.rejects.labels("unauthorized").inc()
            return web.Response(body=UNAUTHORIZED, status=401, content_type="application/json")
        return await handler(request)

    def _to_worker(self, headers) -> dict[str, str]:
        """The client's headers a worker gets (sglang-router's set: Authorization among them); with a key of
        its own omni authenticates with it (a client may have sent x-api-key, which is not forwarded)."""
        return {**_forward_headers(headers), **self.auth}

    @staticmethod
    async def _mark_own(request: web.Request, response: web.StreamResponse) -> None:
        if not request.get(PASSTHROUGH):
            response.headers[FRONT_HEADER] = FRONT_VALUE

    # -- the feedback loop --------------------------------------------------------------------------------
    async def _poll_loop(self, w: Worker) -> None:
        loop = asyncio.get_running_loop()
        interval = self.config.poll_interval_s
        due = loop.time()
        while True:
            due += interval
            delay = due - loop.time()
            if delay < 0:  # a poll overran: skip the missed ticks
                due = loop.time()
                delay = 0.0
            await asyncio.sleep(delay)
            try:
                await self._poll(w)
            except Exception:  # a bug must not stop the loop: say it and go on
                log.exception("polling %s", w.url)

    async def _get(self, w: Worker, path: str) -> tuple[int, bytes]:
        assert self.session is not None
        async with self.session.get(w.url + path, headers=self.auth) as r:
            return r.status, await r.read()

    async def _poll(self, w: Worker) -> None:
        """One poll of ``w``: ``/get_load`` and ``/metrics`` (a 404 from either: no signal from it). Any
        other answer below 500 counts as alive; a 5xx, a connection error or a timeout marks it down."""
        try:
            async with asyncio.timeout(self.config.poll_timeout_s):
                (ls, lb), (ms, mb) = await asyncio.gather(self._get(w, "/get_load"), self._get(w, "/metrics"))
                if not w.up or not w.info_read:
                    await self._read_server_info(w)
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            self.metrics.polls.labels(w.url, "failed").inc()
            self._mark_down(w, f"poll failed: {type(e).__name__}: {e}".rstrip(": "))
            return
        if ls >= 500 or ms >= 500:
            self.metrics.polls.labels(w.url, "failed").inc()
            self._mark_down(w, f"poll failed: /get_load HTTP {ls}, /metrics HTTP {ms}")
            return
        load = parse_get_load(lb) if ls == 200 else None
        metrics = parse_metrics(mb.decode("utf-8", "replace")) if ms == 200 else None
        w.signals = combine(load, metrics, w.max_total_tokens)
        w.in_flight_at_poll = w.in_flight
        w.polled_at = asyncio.get_running_loop().time()
        self.metrics.polls.labels(w.url, "ok").inc()
        if not w.up:
            w.up = True
            log.info("worker %s is up (limit %s, signals from %s)", w.url, w.limit, w.signals.source)
        self._pump()

    async def _read_server_info(self, w: Worker) -> None:
        status, body = await self._get(w, "/server_info")
        if status == 404:
            status, body = await self._get(w, "/get_server_info")
        w.info_read = True
        if status != 200:
            return
        try:
            info = json.loads(body)
        except ValueError:
            return
        if not isinstance(info, dict):
            return
        mrr, mtt = info.get("max_running_requests"), info.get("max_total_num_tokens")
        w.max_running = mrr if isinstance(mrr, int) and mrr > 0 else None
        w.max_total_tokens = mtt if isinstance(mtt, int) and mtt > 0 else None

    def _mark_down(self, w: Worker, reason: str) -> None:
        if w.up:
            log.warning("worker %s is down: %s", w.url, reason)
        w.up = False
        w.info_read = False  # it may come back with other settings
        w.down_reason = reason
        for c in self.classes.values():
            if not any(x.up for x in c.workers):
                self._fail_waiters(c)

    # -- the queue ----------------------------------------------------------------------------------------
    def _classify(self, request: web.Request) -> SloClass:
        """The request's SLO class: its class header's value when a district names that class, else
        ``default`` (the districts serving any class). Raises Reject 400 when no district serves it."""
        name = request.headers.get(self.class_header, "").strip()
        served_as = class_of(self._pools, name)
        if served_as is None:
            what = f"class {name!r}" if name else f"a request without a {self.class_header} header"
            served = "; ".join(f"{d.name} serves {', '.join(d.serves or ())}" for d in self.districts)
            raise Reject(400, "unserved_class", f"omni: no district serves {what} ({served})",
                         slo_class=name or None)  # fmt: skip
        return self.classes[served_as]

    def _pick(self, c: SloClass, key: bytes | None, in_line: int, switch: bool = True) -> Worker | None:
        """Where the first of the class's ``in_line`` requests in line goes (``policies.next_in_line``: its
        own districts' workers with room, else, by the switch rule, a switch district's), counted as in
        flight there; None: it waits. ``switch`` False: its own districts only."""
        own = Snapshot(tuple(w.load() for w in c.workers), key, c.cursor)
        spill = (
            Snapshot(tuple(w.load() for w in c.spill), key, c.spill_cursor) if switch and c.spill else None
        )
        got = next_in_line(
            self.config.policy, own, spill, in_line, c.switch_after, self.rng, self.config.params
        )
        if got is None:
            return None
        index, switched = got
        w = self.workers[index]
        if switched:
            c.spill_cursor = index + 1
            c.switched[w.district] += 1
            self.metrics.class_switched.labels(c.name, w.district).inc()
        else:
            c.cursor = index + 1
        w.in_flight += 1
        w.routed += 1
        self.metrics.routed.labels(w.url).inc()
        self.metrics.class_routed.labels(c.name, w.district).inc()
        return w

    def _release(self, w: Worker) -> None:
        w.in_flight -= 1
        self._pump()

    def _pump(self) -> None:
        """Hands the heads of the queues to workers that have room, in order: every class to its own
        districts first, then the switch, so a diverted request only takes room no request of the
        district's own classes is waiting for."""
        for c in self.classes.values():
            self._drain(c, switch=False)
        for c in self.classes.values():
            if c.spill:
                self._drain(c, switch=True)

    def _drain(self, c: SloClass, switch: bool) -> None:
        q = c.queue
        while q:
            waiter = q[0]
            if waiter.future.done():  # its client went away
                q.popleft()
                continue
            w = self._pick(c, waiter.key, len(q), switch)
            if w is None:
                break
            q.popleft()
            waiter.future.set_result(w)

    def _no_worker(self, c: SloClass) -> Reject:
        return _no_worker(c.workers, c.name)

    def _fail_waiters(self, c: SloClass) -> None:
        while c.queue:
            waiter = c.queue.popleft()
            if not waiter.future.done():
                waiter.future.set_exception(self._no_worker(c))

    async def _acquire(self, c: SloClass, key: bytes | None, retry: bool = False) -> Worker:
        """A worker for one request, counted as in flight; it waits in the class's queue while no worker
        has room (or, with a switch, goes to a switch district's worker by ``policies.next_in_line``'s rule).
        Raises Reject: 503 without a healthy worker of its own districts, 429 when the queue is full. A
        retry (its first worker could not be reached) goes to the head of the queue."""
        if not any(w.up for w in c.workers):  # the switch diverts overflow; it is not a failover
            raise self._no_worker(c)
        first = not c.queue or retry  # first in line: it may take room now (else FIFO: room is the head's)
        if first:
            w = self._pick(c, key, len(c.queue) + 1)
            if w is not None:
                return w
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop.create_future(), key, loop.time())
        if retry:
            c.queue.appendleft(waiter)
        else:
            c.queue.append(waiter)
        if not first and c.spill:
            # The line grew by one: by the switch rule its head (the longest waiting, not this arrival) may
            # now go to a switch district, so the class keeps its order.
            self._drain(c, switch=True)
        if len(c.queue) > c.queue_size and not retry:
            c.queue.remove(waiter)
            n = len(c.queue)
            raise Reject(429, "queue_full", f"omni: class {c.name!r}: the queue is full ({n} waiting, "
                         f"--queue-size {c.queue_size}; every healthy worker of its districts at its in-flight "
                         f"limit{', and of its switch districts' if c.spill else ''})", waiting=n,
                         slo_class=c.name)  # fmt: skip
        try:
            return await waiter.future
        except asyncio.CancelledError:
            f = waiter.future
            if f.done() and not f.cancelled() and f.exception() is None:
                self._release(f.result())  # assigned just before the client went away
            with contextlib.suppress(ValueError):
                c.queue.remove(waiter)
            raise
        finally:
            self.metrics.queue_wait.labels(c.name).observe(loop.time() - waiter.since)

    # -- the proxy ----------------------------------------------------------------------------------------
    def _key(self, path: str, body: bytes) -> bytes | None:
        if not self.needs_key:
            return None
        try:
            parsed = json.loads(body)
        except ValueError:
            return None
        return prompt_prefix(path, parsed, self.config.prefix_len)

    async def proxy(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        self.metrics.received.labels(path).inc()
        body = await request.read()
        try:
            c = self._classify(request)
        except Reject as r:
            self.metrics.rejects.labels(r.reason).inc()
            return _error(r.status, r.reason, r.message, **r.extra)
        self.metrics.class_received.labels(c.name).inc()
        request["omni.class"] = c.name
        key = self._key(path, body)
        headers = self._to_worker(request.headers)
        retry = False
        while True:
            try:
                w = await self._acquire(c, key, retry)
            except Reject as r:
                self.metrics.rejects.labels(r.reason).inc()
                self.metrics.class_rejects.labels(c.name, r.reason).inc()
                return _error(r.status, r.reason, r.message, **r.extra)
            try:
                return await self._forward(request, w, body, headers)
            except _ConnectFailed as e:  # the worker never got it: mark it down, pick again
                self.metrics.proxy_errors.labels(w.url, "connect").inc()
                self._mark_down(w, f"connection failed: {e}")
                retry = True
            finally:
                self._release(w)

    async def _forward(
        self, request: web.Request, w: Worker, body: bytes, headers: dict
    ) -> web.StreamResponse:
        assert self.session is not None
        url = w.url + request.path_qs
        try:
            up = await self.session.post(url, data=body, headers=headers)
        except (
            aiohttp.ClientConnectorError,
            aiohttp.ConnectionTimeoutError,
        ) as e:  # it never got the request
            raise _ConnectFailed(str(e)) from None
        except (aiohttp.ClientError, OSError, TimeoutError) as e:  # sent, but no response
            self.metrics.proxy_errors.labels(w.url, "no_response").inc()
            self._mark_down(w, f"no response: {type(e).__name__}: {e}")
            self.metrics.rejects.labels("worker_error").inc()
            self.metrics.class_rejects.labels(request.get("omni.class", DEFAULT_CLASS), "worker_error").inc()
            return _error(502, "worker_error", f"omni: worker {w.url} gave no response: {type(e).__name__}")
        self.metrics.responses.labels(w.url, str(up.status)).inc()
        request[PASSTHROUGH] = True
        try:
            resp = web.StreamResponse(
                status=up.status, reason=up.reason, headers=_pass_headers(up.headers.items())
            )
            await resp.prepare(request)
            content = up.content
            while True:
                try:
                    chunk = await content.readany()
                except (aiohttp.ClientError, OSError, TimeoutError) as e:  # the worker broke off mid-response
                    self.metrics.proxy_errors.labels(w.url, "mid_response").inc()
                    self._mark_down(w, f"connection lost mid-response: {type(e).__name__}")
                    _cut(request)
                    return resp
                if not chunk:
                    break
                try:
                    await resp.write(chunk)
                except ConnectionError:  # the client went away: the worker's connection closes below
                    return resp
            await resp.write_eof()
            return resp
        finally:
            up.close()

    async def from_a_worker(self, request: web.Request) -> web.StreamResponse:
        """A GET answered by the first healthy worker that answers (its response unchanged)."""
        assert self.session is not None
        for w in [w for w in self.workers if w.up]:
            try:
                async with self.session.get(
                    w.url + request.path_qs, headers=self._to_worker(request.headers)
                ) as up:
                    body = await up.read()
                    request[PASSTHROUGH] = True
                    headers = _pass_headers(up.headers.items())
                    headers.popall("Content-Length", None)
                    return web.Response(status=up.status, reason=up.reason, body=body, headers=headers)
            except (aiohttp.ClientError, OSError, TimeoutError) as e:
                self._mark_down(w, f"{request.path} failed: {type(e).__name__}")
        r = _no_worker(self.workers)
        self.metrics.rejects.labels(r.reason).inc()
        return _error(r.status, r.reason, r.message)

    async def flush_cache(self, request: web.Request) -> web.Response:
        """Fanned out to every healthy worker: 200 when each flushed, else the first failure's status."""
        assert self.session is not None
        targets = [w for w in self.workers if w.up]

        async def one(w: Worker) -> tuple[int, str]:
            try:
                async with self.session.post(w.url + "/flush_cache", headers=self.auth) as r:
                    return r.status, (await r.text()).strip().splitlines()[0:1]
            except (aiohttp.ClientError, OSError, TimeoutError) as e:
                return 502, [f"{type(e).__name__}"]

        results = await asyncio.gather(*(one(w) for w in targets))
        if not targets:
            return web.Response(status=503, text="omni: no healthy worker to flush\n")
        failed = [s for s, _ in results if s != 200]
        lines = [f"{w.url}: {s} {' '.join(t)}" for w, (s, t) in zip(targets, results, strict=True)]
        return web.Response(status=failed[0] if failed else 200, text="\n".join(lines) + "\n")

    async def health(self, request: web.Request) -> web.Response:
        up = sum(w.up for w in self.workers)
        body = {"status": "ok" if up else "no healthy worker", "front": FRONT_VALUE, "workers_up": up,
                "workers": len(self.workers), "queued": sum(len(c.queue) for c in self.classes.values())}  # fmt: skip
        return web.json_response(body, status=200 if up else 503)

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        body, content_type = self.metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def workers_endpoint(self, request: web.Request) -> web.Response:
        """omni's view of each worker (JSON): what a decision sees, and why a worker is down."""
        now = asyncio.get_running_loop().time()
        out = []
        for w in self.workers:
            load = w.load()
            out.append({"url": w.url, "district": w.district, "up": w.up, "down_reason": None if w.up else w.down_reason,
                        "in_flight": w.in_flight, "limit": w.limit, "routed": w.routed,
                        "max_running_requests": w.max_running, "signals": dataclasses.asdict(w.signals),
                        "signal_age_s": None if w.polled_at is None else round(now - w.polled_at, 4),
                        "estimate": {"total": load.total_est, "running": load.running_est,
                                     "waiting": load.waiting_est}})  # fmt: skip
        queues = {c.name: len(c.queue) for c in self.classes.values()}
        classes = {c.name: sorted({w.district for w in c.workers}) for c in self.classes.values()}
        districts = [{"name": d.name, "serves": None if d.serves is None else list(d.serves),
                      "workers": list(d.workers)} for d in self.districts]  # fmt: skip
        # Each class with a switch: where its overflow may go, the rule's threshold, what it diverted so far.
        switch = {c.name: {"to": list(c.switched), "after_waiting": c.switch_after, "switched": dict(c.switched)}
                  for c in self.classes.values() if c.spill}  # fmt: skip
        cfg = self.config
        settings = {"policy": cfg.policy, "poll_interval_s": cfg.poll_interval_s, "queue_size": cfg.queue_size,
                    "max_in_flight_per_worker": cfg.max_in_flight_per_worker,
                    "in_flight_fraction": cfg.in_flight_fraction,
                    "switch_after_waiting": cfg.switch_after_waiting}  # fmt: skip
        return web.json_response({"policy": cfg.policy, "settings": settings, "workers": out, "queues": queues,
                                  "districts": districts, "classes": classes, "switch": switch})  # fmt: skip


def _no_worker(workers: Sequence[Worker], cls: str | None = None) -> Reject:
    down = "; ".join(f"{w.url}: {w.down_reason}" for w in workers)
    of = f" for class {cls!r}" if cls is not None and cls != DEFAULT_CLASS else ""
    return Reject(503, "no_healthy_worker", f"omni: no healthy worker{of} ({down})")


def _cut(request: web.Request) -> None:
    """Ends the client's connection without the chunked terminator: the client sees the stream broken off,
    as it would have from the worker."""
    transport = request.transport
    if transport is not None:
        transport.abort()


# -- the process ------------------------------------------------------------------------------------------
def _worker_url(text: str) -> str:
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"expected a worker URL like http://HOST:PORT, got {text!r}")
    try:
        parts.port  # noqa: B018 - validates the port
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad port in worker URL {text!r}") from None
    return text.rstrip("/")


_DISTRICT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_CLASS_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def _district(text: str) -> DistrictSpec:
    """``NAME[:CLASS,...]=URL,...``: a district, the classes it serves (none named: any), its workers."""
    head, eq, urls = text.partition("=")
    name, colon, classes = head.partition(":")
    if not eq or not urls:
        raise argparse.ArgumentTypeError(f"expected NAME[:CLASS,...]=URL,..., got {text!r}")
    if not _DISTRICT_NAME.fullmatch(name):
        raise argparse.ArgumentTypeError(f"bad district name {name!r} in {text!r}")
    serves = None
    if colon:
        serves = tuple(c.strip() for c in classes.split(","))
        bad = [c for c in serves if not _CLASS_NAME.fullmatch(c)]
        if bad:
            raise argparse.ArgumentTypeError(f"bad class name {bad[0]!r} in {text!r}")
    return DistrictSpec(name, tuple(_worker_url(u.strip()) for u in urls.split(",")), serves)


def _switch(text: str) -> tuple[str, tuple[str, ...]]:
    """``CLASS=DISTRICT,...``: a class and the districts its overflow may go to."""
    cls, eq, targets = text.partition("=")
    names = tuple(d.strip() for d in targets.split(",")) if targets else ()
    if not eq or not _CLASS_NAME.fullmatch(cls) or not names or not all(map(_DISTRICT_NAME.fullmatch, names)):
        raise argparse.ArgumentTypeError(f"expected CLASS=DISTRICT,..., got {text!r}")
    return cls, names


def _fraction(text: str) -> float:
    value = positive(float)(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}")
    return value


def _port(text: str) -> int:
    port = non_negative(int)(text)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"expected a port 0-65535, got {text!r}")
    return port


def build_parser() -> OneLineParser:
    p = OneLineParser(prog=PROG, description="omni: loadlab's global front over SGLang workers (a proxy with "
                      "routing policies fed by each worker's polled load, and a bounded queue).")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=_port, default=30000, help="port to listen on, 0: any free one "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--policy", choices=sorted(POLICIES), default="round_robin",
                   help="routing policy (default: %(default)s)")  # fmt: skip
    p.add_argument("--poll-interval-s", type=positive(float), default=1.0,
                   help="seconds between polls of each worker's load (default: %(default)s)")  # fmt: skip
    p.add_argument("--poll-timeout-s", type=positive(float), default=2.0,
                   help="a poll slower than this fails and marks the worker down (default: %(default)s)")  # fmt: skip
    p.add_argument("--queue-size", type=non_negative(int), default=100,
                   help="most requests waiting in omni's queue; more get 429 (default: %(default)s)")  # fmt: skip
    p.add_argument("--max-in-flight-per-worker", type=positive(int), default=None, metavar="K",
                   help="most requests omni keeps in flight at one worker (default: the worker's "
                   "max_running_requests from /server_info; none if it reports none)")  # fmt: skip
    p.add_argument("--in-flight-fraction", type=_fraction, default=1.0, metavar="F",
                   help="without --max-in-flight-per-worker: omni's limit per worker is F times its "
                   "max_running_requests, rounded down (the batch window it lets a worker fill) "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--prefix-len", type=positive(int), default=256,
                   help="prefix policy: token ids or characters of the prompt that make the key "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--prefix-balance-abs", type=non_negative(int), default=PolicyParams.balance_abs,
                   help="prefix policy: fall back to least_queue when the key's worker has more than this "
                   "many requests more than the least busy ... (default: %(default)s)")  # fmt: skip
    p.add_argument(
        "--prefix-balance-rel",
        type=positive(float),
        default=PolicyParams.balance_rel,
        help="... and more than this many times its requests (default: %(default)s)",
    )
    p.add_argument("--seed", type=int, default=0, help="power_of_two's random choices (default: %(default)s)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info",
                   help="log level; logs go to stderr (default: %(default)s)")  # fmt: skip
    p.add_argument("--district", action="append", type=_district, default=[], dest="districts",
                   metavar="NAME[:CLASS,...]=URL,...",
                   help="a district: its workers, and the SLO classes it serves (none named: any class); "
                   "repeat for each district, instead of WORKER_URLs")  # fmt: skip
    p.add_argument("--switch", action="append", type=_switch, default=[], dest="switch",
                   metavar="CLASS=DISTRICT,...",
                   help="the switch: when every worker of CLASS's own districts is at its in-flight limit (and "
                   "more than --switch-after-waiting of its requests are in line), its next request goes to "
                   "a worker of these districts with room; repeat per class (docs/omni.md)")  # fmt: skip
    p.add_argument("--switch-after-waiting", type=non_negative(int), default=0, metavar="N",
                   help="the switch diverts only while more than N of the class's requests are in line at omni "
                   "(0: as soon as its districts are full) (default: %(default)s)")  # fmt: skip
    p.add_argument("--class-header", default=CLASS_HEADER, type=str.lower,
                   help="the request header naming a request's SLO class (default: %(default)s)")  # fmt: skip
    p.add_argument("workers", nargs="*", type=_worker_url, metavar="WORKER_URL",
                   help="the SGLang workers, e.g. http://127.0.0.1:30001 (one district serving any class)")  # fmt: skip
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.workers and args.districts:
        p.error("give WORKER_URLs or --district, not both")
    if not args.workers and not args.districts:
        p.error("the following arguments are required: WORKER_URL (or --district)")
    names = [d.name for d in args.districts]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        p.error(f"--district {dup}: two districts of that name")
    urls = [u for d in args.districts for u in d.workers] or args.workers
    dup = next((u for u in urls if urls.count(u) > 1), None)
    if dup:
        p.error(f"worker {dup} is given twice")
    specs = tuple(args.districts) or (DistrictSpec(DEFAULT_CLASS, tuple(args.workers)),)
    pools = class_districts([(d.name, d.serves) for d in specs])
    classes = [c for c, _ in args.switch]
    dup = next((c for c in classes if classes.count(c) > 1), None)
    if dup:
        p.error(f"--switch {dup}: given twice")
    for cls, targets in args.switch:
        problem = switch_problem(pools, [d.name for d in specs], cls, list(targets))
        if problem:
            p.error(f"--switch {cls}={','.join(targets)}: {problem}")
    if args.switch and args.switch_after_waiting > args.queue_size:
        p.error(f"--switch-after-waiting {args.switch_after_waiting} exceeds --queue-size {args.queue_size}: "
                "the queue would answer 429 before the switch ever diverts")  # fmt: skip
    return args


def config_from_args(args: argparse.Namespace) -> OmniConfig:
    districts = tuple(args.districts)
    return OmniConfig(
        workers=tuple(u for d in districts for u in d.workers) or tuple(args.workers),
        districts=districts,
        class_header=args.class_header,
        switch=tuple(args.switch),
        switch_after_waiting=args.switch_after_waiting,
        policy=args.policy,
        poll_interval_s=args.poll_interval_s,
        queue_size=args.queue_size,
        max_in_flight_per_worker=args.max_in_flight_per_worker,
        in_flight_fraction=args.in_flight_fraction,
        host=args.host,
        port=args.port,
        poll_timeout_s=args.poll_timeout_s,
        prefix_len=args.prefix_len,
        params=PolicyParams(args.prefix_balance_abs, args.prefix_balance_rel),
        seed=args.seed,
        api_key=server_api_key(),  # from the environment only: omni's command line is in ps
    )


async def serve(config: OmniConfig) -> None:
    """Serves until SIGTERM or SIGINT. Raises OSError when it cannot listen."""
    sock = socket.create_server((config.host, config.port), backlog=4096)
    sock.setblocking(False)
    omni = Omni(config)
    runner = web.AppRunner(omni.build_app(), handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    try:
        await omni.start()
        await web.SockSite(runner, sock).start()
        port = sock.getsockname()[1]
        shown = f"[{config.host}]" if ":" in config.host else config.host
        sys.stdout.write(f"{READY_PREFIX}http://{shown}:{port}\n")
        sys.stdout.flush()
        up = sum(w.up for w in omni.workers)
        log.info("omni: policy %s over %d workers (%d up), poll every %g s, queue %d, limit per worker %s%s",
                 config.policy, len(omni.workers), up, config.poll_interval_s, config.queue_size,
                 config.max_in_flight_per_worker or "max_running_requests",
                 "; API key required" if config.api_key else "")  # fmt: skip
        for c in omni.classes.values():
            log.info("omni: class %s -> districts %s (%d workers)%s", c.name,
                     ", ".join(dict.fromkeys(w.district for w in c.workers)), len(c.workers),
                     f"; switch to {', '.join(c.switched)} with more than {c.switch_after} in line" if c.spill
                     else "")  # fmt: skip
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await omni.stop()
        await runner.cleanup()
        sock.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    config = config_from_args(args)
    problem = config.api_key and key_problem(config.api_key)
    if problem:
        print(f"{PROG}: error: {API_KEY_ENV}: {problem}", file=sys.stderr)
        return exits.BAD_INPUT
    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve(config))
    except OSError as e:
        print(
            f"{PROG}: error: cannot listen on {config.host}:{config.port}: {e.strerror or e}", file=sys.stderr
        )
        return exits.PARTIAL
    return exits.OK


if __name__ == "__main__":
    sys.exit(main())

__all__ = ["DistrictSpec", "Omni", "OmniConfig", "build_parser", "main", "parse_args", "serve"]
