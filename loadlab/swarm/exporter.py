"""The live figures as Prometheus metrics (``loadlab_*``), served at ``/metrics`` on the web UI and, with
``--metrics-port``, by a small HTTP server of their own (a headless run or master has no web UI).

Histograms are exact: each bucket is the count of samples at or under its bound, read from the sorted
samples of the live figures (``loadlab.swarm.live``) at scrape time, not a second copy of the data. Names,
labels and buckets: docs/web-ui.md.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from gevent.pywsgi import WSGIServer
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, make_wsgi_app

from loadlab.swarm.live import LiveFigures

log = logging.getLogger("loadlab")

# Bucket upper bounds in seconds, for LLM serving: TTFT from tens of ms (short prompts, idle server) to a
# minute (long prompts behind a queue); TPOT and ITL from 1 ms to a few seconds (a token stuck behind a
# prefill); E2E up to 10 minutes.
BUCKETS_S = {
    "ttft_ms": (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 7.5, 10, 15, 20, 30, 60),
    "tpot_ms": (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                0.2, 0.3, 0.5, 1, 2.5),
    "itl_ms": (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
               0.2, 0.3, 0.5, 1, 2.5),
    "e2e_latency_ms": (0.1, 0.25, 0.5, 1, 2, 3, 5, 7.5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 300, 600),
}  # fmt: skip
HISTOGRAMS = {
    "ttft_ms": ("loadlab_ttft_seconds", "time to first token of completed measured requests"),
    "tpot_ms": ("loadlab_tpot_seconds", "time per output token, (E2E - TTFT) / (output tokens - 1)"),
    "itl_ms": ("loadlab_itl_seconds", "inter-token latency, one sample per token"),
    "e2e_latency_ms": ("loadlab_e2e_seconds", "end-to-end latency of completed measured requests"),
}
# Every name /metrics can show (tests/test_prometheus.py checks the dashboard and docs/web-ui.md against it).
METRIC_NAMES = (
    *(name for name, _ in HISTOGRAMS.values()),
    "loadlab_output_tokens_total",
    "loadlab_requests_total",
    "loadlab_requests_expected",
    "loadlab_requests_in_flight",
    "loadlab_slo_attainment",
    "loadlab_slo_pass",
    "loadlab_run_info",
)


class LiveCollector:
    """A prometheus_client collector over the current run's live figures (none before the first run)."""

    def __init__(self, environment):
        self.environment = environment

    def live(self) -> LiveFigures | None:
        run = self.environment.loadlab.run
        return getattr(run, "live", None)

    def collect(self) -> Iterator[Metric]:
        live = self.live()
        if live is None:
            return
        figures = live.figures(fresh=settled(self.environment))
        info = GaugeMetricFamily(
            "loadlab_run_info", "the run these figures are of", labels=["run_id", "profile", "api"]
        )
        info.add_metric([live.run_id, live.profile_name or "", live.api], 1)
        yield info
        # Per class when the profile has classes, else the run as class "".
        scopes = live.classes.items() if live.classes else [("", live.run)]
        for metric, (name, doc) in HISTOGRAMS.items():
            family = HistogramMetricFamily(name, doc, labels=["api", "class"])
            for cls, scope in scopes:
                samples = scope.samples[metric]
                bounds = BUCKETS_S[metric]
                counts = samples.count_at_most([b * 1000.0 for b in bounds])
                buckets = [(_le(b), int(c)) for b, c in zip(bounds, counts, strict=True)]
                buckets.append(("+Inf", len(samples)))
                family.add_metric([live.api, cls], buckets, sum_value=samples.total / 1000.0)
            yield family
        tokens = CounterMetricFamily(
            "loadlab_output_tokens", "output tokens of completed measured requests", labels=["api", "class"]
        )
        for cls, scope in scopes:
            tokens.add_metric([live.api, cls], int(scope.output_tokens))
        yield tokens
        requests = CounterMetricFamily(
            "loadlab_requests",
            "requests recorded, by phase and outcome",
            labels=["api", "class", "phase", "outcome"],
        )
        for (phase, cls, outcome), n in sorted(live.requests.items()):
            requests.add_metric([live.api, cls, phase, outcome], n)
        yield requests
        expected = GaugeMetricFamily("loadlab_requests_expected", "requests the run sends", labels=["phase"])
        t = live.tickets
        expected.add_metric(["warmup"], t.warmup)
        expected.add_metric(["measure"], t.total - t.warmup)
        yield expected
        yield GaugeMetricFamily(
            "loadlab_requests_in_flight", "requests sent and not ended", value=figures["in_flight"]
        )
        yield from _slo_families(live, figures["slo"])


def settled(environment) -> bool:
    """The run is not going (stopped, or never started): what the live figures show is final."""
    runner = getattr(environment, "runner", None)
    # Locust's STATE_RUNNING and STATE_SPAWNING by value: importing locust monkey-patches the process, and
    # this module is also used without it (tests, bench/live_figures.py).
    return runner is None or runner.state not in ("running", "spawning")


def _slo_families(live: LiveFigures, slo: dict) -> Iterator[Metric]:
    attainment = GaugeMetricFamily(
        "loadlab_slo_attainment",
        "share of an objective's samples at or under its threshold so far (a P95 objective needs 0.95)",
        labels=["class", "objective"],
    )
    verdict = GaugeMetricFamily(
        "loadlab_slo_pass", "1 while every objective holds so far, else 0", labels=["class"]
    )
    judged = [("", live.run, slo["run"])]
    judged += [(name, live.classes[name], v) for name, v in slo["classes"].items()]
    for cls, scope, result in judged:
        for objective in result["objectives"]:
            samples = scope.samples[objective["metric"]]
            if len(samples):
                within = int(samples.count_at_most([objective["threshold_ms"]])[0])
                attainment.add_metric([cls, objective["key"]], within / len(samples))
        if result["pass"] is not None:
            verdict.add_metric([cls], 1 if result["pass"] else 0)
    yield attainment
    yield verdict


def _le(bound: float) -> str:
    return f"{bound:g}"


def registry_for(environment) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LiveCollector(environment))
    return registry


def exposition(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The /metrics page and its content type."""
    return generate_latest(registry), CONTENT_TYPE_LATEST


class MetricsServer:
    """``--metrics-port``: /metrics on a port of its own, a gevent WSGI server in this process."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int):
        self.host, self.port = host, port
        self.server = WSGIServer((host, port), make_wsgi_app(registry), log=None)

    def start(self) -> MetricsServer:
        """Binds now (an OSError when the port is taken) and serves in a greenlet."""
        self.server.start()
        log.info("loadlab: Prometheus metrics on http://%s:%d/metrics", self.host or "0.0.0.0", self.port)
        return self

    def stop(self) -> None:
        self.server.stop(timeout=1)
