"""The figures of the run in progress, on the process that owns the run (a one-process run, or the master
of a distributed one, fed by the record batches its workers send): exact P50/P95/P99 of TTFT, TPOT, ITL
and E2E over the measured requests so far, for the run and per SLO class and per serving worker; output
tokens/s; requests in flight; failures by outcome; the server's latest scrape; the SLO verdict so far.

The web UI's LLM tab (``loadlab.swarm.webui``) and Prometheus' ``/metrics`` (``loadlab.swarm.exporter``)
read them. The definitions are the post-processor's own functions (``loadlab.analysis.stats``) over the
same records, so when the run has ended the figures equal summary.json's.

Cost: ``add`` only queues the record; a refresh turns the queued records into samples, merged into sorted
arrays in time linear in the new samples (amortised), and reads each percentile from them in O(log n), at
most once per ``REFRESH_S`` while the run goes: bench/live_figures.py.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from gevent.lock import Semaphore

from loadlab.analysis.stats import SortedSamples, evaluate_slo, latency_samples, overall_pass
from loadlab.profile import Profile
from loadlab.records import MEASURE, OK, SERVER_METRICS, RequestRecord

# The latency metrics shown, by summary.json stem.
LATENCIES = {"ttft_ms": "TTFT", "tpot_ms": "TPOT", "itl_ms": "ITL", "e2e_latency_ms": "E2E"}
QUANTILES = (50, 95, 99)
RECENT_S = 10.0  # "output tokens/s, last 10 s": requests that ended in this window
REFRESH_S = 1.0  # the figures are recomputed at most this often while the run goes


class Scope:
    """One set of measured requests (the run, an SLO class, a serving worker): counts and samples."""

    def __init__(self) -> None:
        self.samples = {metric: SortedSamples() for metric in LATENCIES}
        self.measured = 0
        self.completed = 0
        self.failures: dict[str, int] = {}
        self.output_tokens = 0.0
        self.itl_estimated = (
            0  # completed requests whose server counted tokens only at the end (summary's too)
        )

    @property
    def failed(self) -> int:
        return self.measured - self.completed

    def count(self, rec: RequestRecord) -> None:
        self.measured += 1
        if rec.outcome == OK:
            self.completed += 1
        else:
            kind = rec.outcome or "unknown"
            self.failures[kind] = self.failures.get(kind, 0) + 1

    def feed(self, done: list[RequestRecord], adds: list[tuple[SortedSamples, np.ndarray]]) -> np.ndarray:
        """Completed requests' samples (the post-processor's definitions), appended to ``adds`` for the
        caller to merge in; returns their output token counts."""
        samples, out = latency_samples(
            _floats([r.ttft_ms for r in done]),
            _floats([r.e2e_ms for r in done]),
            _floats([r.output_tokens for r in done]),
            [r.arrival_ms for r in done],
            [r.arrival_tokens for r in done],
        )
        adds += [(values, samples[metric]) for metric, values in self.samples.items()]
        self.output_tokens += float(np.nansum(out))
        self.itl_estimated += sum(1 for r in done if r.tokens_per_event_exact is False)
        return out

    def latencies(self) -> dict[str, np.ndarray | None]:
        return {metric: values.quantiles(QUANTILES) for metric, values in self.samples.items()}


def _floats(values: list[float | int | None]) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in values], dtype=float)


class ServerTail:
    """The scraper's latest round, read from the end of server_metrics.jsonl as it grows (only the bytes
    added since the last read; a torn last line waits for the next read)."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.rest = b""
        self.latest: dict[str, dict[str, Any]] = {}  # server URL -> its latest scrape line

    def read(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return  # not written yet
        self.offset += len(data)
        *lines, self.rest = (self.rest + data).split(b"\n")
        for line in lines:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("url"), str):
                self.latest[row["url"]] = row

    def figures(self) -> dict[str, Any]:
        """Running and queued requests summed over the servers, KV usage per server and its maximum, the
        latest scrape's time and any server whose latest scrape failed."""
        good = {url: row["m"] for url, row in self.latest.items() if isinstance(row.get("m"), dict)}

        def total(name: str) -> float | None:
            values = [m[name] for m in good.values() if name in m]
            return float(sum(values)) if values else None

        kv = {url: float(m["sglang:token_usage"]) for url, m in good.items() if "sglang:token_usage" in m}
        return {
            "servers": len(self.latest),
            "running": total("sglang:num_running_reqs"),
            "queued": total("sglang:num_queue_reqs"),
            "kv_usage": kv,
            "max_kv_usage": max(kv.values()) if kv else None,
            "scraped_at": max((row.get("t", 0.0) for row in self.latest.values()), default=None),
            "errors": {url: row["error"] for url, row in self.latest.items() if "error" in row},
        }


def _call(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def _add_all(adds: list[tuple[SortedSamples, np.ndarray]]) -> None:
    for samples, values in adds:
        samples.add(values)


class LiveFigures:
    """The live figures of one run: ``add`` every record as it is recorded (cheap), ``figures`` for a
    snapshot.

    ``lane`` runs the CPU work of a refresh (Locust's users' CPU lane, so that lines already received are
    timestamped first); ``offload`` runs the merges of large sorted arrays (gevent's thread pool: numpy
    releases the GIL, the event loop goes on). Both default to running inline."""

    def __init__(
        self,
        profile: Profile,
        run_dir: Path,
        tickets,
        lane: Callable[..., Any] = _call,
        offload: Callable[..., Any] | None = None,
    ):
        self.lane = lane
        self.offload = offload
        self.lock = Semaphore()  # one refresh at a time (a merge off the loop yields to other viewers)
        dumped = profile.model_dump(mode="json")  # the manifest's profile: what the post-processor reads
        self.api = profile.target.api
        self.run_id = Path(run_dir).name
        self.profile_name = profile.name
        self.tickets = tickets
        self.slo = dumped.get("slo")
        self.class_slo = {
            c["name"]: c["slo"] if c.get("slo") is not None else self.slo for c in dumped.get("classes") or []
        }
        self.run = Scope()
        self.classes: dict[str, Scope] = {name: Scope() for name in self.class_slo}
        self.workers: dict[str, Scope] = {}  # served_by -> its requests
        # Every record by (phase, class or "", outcome): Prometheus' loadlab_requests_total.
        self.requests: dict[tuple[str, str, str], int] = {}
        self.window: tuple[float, float] | None = None  # first measured send, last measured end (epoch s)
        self.recent: deque[tuple[float, float]] = deque()  # (end, output tokens) of recent completed requests
        self.server = ServerTail(Path(run_dir) / SERVER_METRICS)
        self.pending: list[RequestRecord] = []
        self.records = 0
        self._snapshot: dict[str, Any] | None = None
        self._snapshot_at = 0.0
        self._snapshot_records = -1

    def add(self, rec: RequestRecord) -> None:
        """A record of the run (any phase and outcome), as it is recorded: queued for the next refresh."""
        self.pending.append(rec)

    def refresh(self) -> None:
        """Turns the queued records into counts and samples: in short steps through the lane (each one
        lets the lines that arrived meanwhile be timestamped first), large merges in ``offload``."""
        with self.lock:
            for scope, done in self.lane(self._count):
                inline, large = [], []
                for samples, values in self.lane(self._samples, scope, done):
                    big = self.offload is not None and samples.copies(values.size) > samples.INLINE_MAX
                    (large if big else inline).append((samples, values))
                self.lane(_add_all, inline)
                for samples, values in large:  # outside the lane: users' bookkeeping need not wait
                    samples.add(values, run=self.offload)

    def _count(self) -> list[tuple[Scope, list[RequestRecord]]]:
        """Counts the queued records; returns the completed ones of each scope, for their samples."""
        batch, self.pending = self.pending, []
        if not batch:
            return []
        self.records += len(batch)
        measured = []
        for rec in batch:
            key = (rec.phase, rec.request_class or "", rec.outcome or "unknown")
            self.requests[key] = self.requests.get(key, 0) + 1
            if rec.phase == MEASURE:
                measured.append(rec)
        done: dict[int, tuple[Scope, list[RequestRecord]]] = {id(self.run): (self.run, [])}
        for rec in measured:
            end = rec.t_send_wall + rec.e2e_ms / 1000.0 if rec.e2e_ms is not None else rec.t_send_wall
            start, last = self.window or (rec.t_send_wall, end)
            self.window = (min(start, rec.t_send_wall), max(last, end))
            scopes = [self.run]
            if rec.request_class is not None:
                scopes.append(self._scope(self.classes, rec.request_class))
            if rec.served_by is not None:
                scopes.append(self._scope(self.workers, rec.served_by))
            for scope in scopes:
                scope.count(rec)
                if rec.outcome == OK:
                    done.setdefault(id(scope), (scope, []))[1].append(rec)
        return [(scope, recs) for scope, recs in done.values() if recs]

    def _samples(self, scope: Scope, done: list[RequestRecord]) -> list[tuple[SortedSamples, np.ndarray]]:
        adds: list[tuple[SortedSamples, np.ndarray]] = []
        out = scope.feed(done, adds)
        if scope is self.run:
            for rec, tokens in zip(done, out, strict=True):
                if rec.e2e_ms is not None and np.isfinite(tokens):
                    self.recent.append((rec.t_send_wall + rec.e2e_ms / 1000.0, float(tokens)))
        return adds

    @staticmethod
    def _scope(scopes: dict[str, Scope], name: str) -> Scope:
        scope = scopes.get(name)
        if scope is None:
            scope = scopes[name] = Scope()
        return scope

    def output_throughput(self) -> float | None:
        """Output tokens of completed measured requests over the measured window so far (summary.json's
        output_throughput once the run has ended)."""
        if self.window is None or self.window[1] <= self.window[0]:
            return None
        return int(self.run.output_tokens) / (self.window[1] - self.window[0])

    def recent_throughput(self, now: float) -> float:
        while self.recent and self.recent[0][0] < now - RECENT_S:
            self.recent.popleft()
        return sum(tokens for _, tokens in self.recent) / RECENT_S

    def slo_verdicts(self) -> dict[str, Any]:
        """The SLO verdict so far: the run's objectives over every measured request, each class's over its
        own (summary.json's slo and classes[].slo, computed the same way), and the overall one."""
        run = evaluate_slo(self.slo, self.run.samples, self.run.failed)
        classes = {
            name: evaluate_slo(self.class_slo.get(name, self.slo), scope.samples, scope.failed)
            for name, scope in self.classes.items()
        }
        return {
            "run": run,
            "classes": classes,
            "pass": overall_pass([run["pass"], *(c["pass"] for c in classes.values())]),
        }

    def figures(self, now: float | None = None, fresh: bool = False) -> dict[str, Any]:
        """A snapshot of every figure (refreshing first), recomputed at most every REFRESH_S, so that any
        number of web UI tabs and scrapers cost one computation; ``fresh``: at once if records arrived
        since (the run has stopped: the last view must have every record)."""
        now = time.time() if now is None else now
        self.refresh()
        with self.lock:
            if (
                self._snapshot is None
                or now - self._snapshot_at >= REFRESH_S
                or (fresh and self._snapshot_records != self.records)
            ):
                self._snapshot = self._compute(now)
                self._snapshot_at, self._snapshot_records = now, self.records
            return self._snapshot

    def _compute(self, now: float) -> dict[str, Any]:
        """Every figure, a step through the lane per scope."""
        lane, t = self.lane, self.tickets
        return {
            "now": now,
            "run_id": self.run_id,
            "api": self.api,
            "warmup": (t.warmup_finished, t.warmup),
            "measured": (t.measured_finished, t.total - t.warmup),
            "in_flight": t.in_flight(now),
            "run": lane(self._scope_figures, self.run),
            "classes": {name: lane(self._scope_figures, s) for name, s in self.classes.items()},
            "workers": {name: lane(self._scope_figures, s) for name, s in sorted(self.workers.items())},
            "output_throughput": self.output_throughput(),
            "recent_output_throughput": self.recent_throughput(now),
            "server": lane(self._server_figures),
            "slo": lane(self.slo_verdicts),
        }

    def _server_figures(self) -> dict[str, Any]:
        self.server.read()
        return self.server.figures()

    @staticmethod
    def _scope_figures(scope: Scope) -> dict[str, Any]:
        return {
            "measured": scope.measured,
            "completed": scope.completed,
            "failed": scope.failed,
            "failures": dict(sorted(scope.failures.items())),
            "output_tokens": int(scope.output_tokens),
            "latencies": scope.latencies(),
            "samples": {metric: len(values) for metric, values in scope.samples.items()},
            "itl_estimated": scope.itl_estimated,
        }
