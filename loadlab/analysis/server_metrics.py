"""Reading a run's ``server_metrics.jsonl`` (written by ``loadlab.target.scraper``): the scrape interval,
a cluster's gauges per scrape round, when a server stopped answering, and the seed's server-side columns
over the measured window."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loadlab.records import DEFAULT_SCRAPE_INTERVAL_S, SERVER_METRICS


def scrape_interval(rows: list[dict[str, Any]]) -> float:
    """The interval the rows were scraped at (the median gap between one server's scrapes),
    DEFAULT_SCRAPE_INTERVAL_S with too few rows."""
    by_url: dict[str, list[float]] = {}
    for r in rows:
        if isinstance(r.get("t"), int | float):
            by_url.setdefault(r.get("url", ""), []).append(r["t"])
    gaps = sorted(b - a for t in by_url.values() for a, b in itertools.pairwise(sorted(t)))
    return gaps[len(gaps) // 2] if len(gaps) >= 2 else DEFAULT_SCRAPE_INTERVAL_S


def read_server_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / SERVER_METRICS
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a torn last line
    return rows


def same_server(url: str) -> str:
    """A server URL as ``server_metrics.jsonl`` and ``served_by`` are matched: without a trailing slash."""
    return url.rstrip("/")


def _by_server(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Each server's scrapes (``same_server`` URL), good and failed, in time order."""
    by_url: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if isinstance(r.get("url"), str) and isinstance(r.get("t"), int | float):
            by_url.setdefault(same_server(r["url"]), []).append(r)
    for scrapes in by_url.values():
        scrapes.sort(key=lambda r: r["t"])
    return by_url


def outages(rows: list[dict[str, Any]]) -> dict[str, tuple[float, float | None]]:
    """Servers (``same_server`` URL) that stopped answering: (the first failed scrape after a good one,
    the first good scrape after that or None if it never answered again), epoch s. Only the first outage
    of each server; servers that never failed after a good scrape are absent."""
    found: dict[str, tuple[float, float | None]] = {}
    for url, scrapes in _by_server(rows).items():
        seen_good, down = False, None
        for r in scrapes:
            good = "m" in r
            if down is None:
                if good:
                    seen_good = True
                elif seen_good:
                    down = r["t"]
            elif good:
                found[url] = (down, r["t"])
                break
        if down is not None and url not in found:
            found[url] = (down, None)
    return found


def gone_from(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Servers (URL as scraped) whose scrapes failed from some point to the end of ``rows`` after a good
    one: the time of that first failed scrape (a worker that died and never came back)."""
    last_good: dict[str, float] = {}
    first_fail_after: dict[str, float] = {}
    timed = [r for r in rows if isinstance(r.get("url"), str) and isinstance(r.get("t"), int | float)]
    for r in sorted(timed, key=lambda r: r["t"]):
        url = r["url"]
        if "m" in r:
            last_good[url] = r["t"]
            first_fail_after.pop(url, None)
        elif url in last_good:
            first_fail_after.setdefault(url, r["t"])
    return first_fail_after


def gauge_series(
    rows: list[dict[str, Any]], name: str, combine: Callable[[list[float]], float] = sum
) -> tuple[list[float], list[float]]:
    """A gauge per scrape round (at the round's first scrape), summed across the servers (or ``combine``d:
    ``max``, a mean): the requests running or queued in a cluster are the sum of its servers'. A round where
    a server's value is missing (a failed scrape, the edge of a window) is left out rather than summed short,
    except for a server that is gone (``gone_from``: its scrapes failed from then to the end): from its first
    failed scrape on, the sum is over the servers left, so a worker that died does not blank the rest of the
    run."""
    servers = {r["url"] for r in rows if "m" in r}
    gone = gone_from(rows)
    rounds: dict[Any, dict[str, tuple[float, float]]] = {}
    started: dict[Any, float] = {}  # each round's first scrape, good or failed
    position: dict[str, int] = {}
    for r in rows:
        url = r.get("url")
        key = r.get("round")
        if key is None:  # written before rounds were numbered: the n-th scrape of each server
            key = position[url] = position.get(url, -1) + 1
        if isinstance(r.get("t"), int | float):
            started[key] = min(started.get(key, r["t"]), r["t"])
        if "m" in r and name in r["m"]:
            rounds.setdefault(key, {})[url] = (r["t"], r["m"][name])
    whole = []
    for key, by_url in sorted(rounds.items()):
        t = started.get(key, min(t for t, _ in by_url.values()))
        needed = {s for s in servers if s not in gone or t < gone[s]}
        if needed <= set(by_url):
            whole.append({url: v for url, v in by_url.items() if url in needed})
    whole = [b for b in whole if b]
    times = [min(t for t, _ in b.values()) for b in whole]
    return times, [combine([v for _, v in b.values()]) for b in whole]


def gauge_peaks(
    rows: list[dict[str, Any]], name: str, start: float | None, end: float | None
) -> dict[str, float]:
    """The largest value of gauge ``name`` per server URL (``same_server``) over [start, end] (epoch s);
    servers without a value there are absent."""
    peaks: dict[str, float] = {}
    for r in rows:
        m = r.get("m")
        if not isinstance(m, dict) or name not in m or not isinstance(r.get("url"), str):
            continue
        if start is not None and r["t"] < start or end is not None and r["t"] > end:
            continue
        url = same_server(r["url"])
        peaks[url] = max(peaks.get(url, m[name]), m[name])
    return peaks


def server_summary(rows: list[dict[str, Any]], start: float | None, end: float | None) -> dict[str, Any]:
    """The seed's server-side columns over [start, end] (the measured window, epoch s), per target URL
    summed or maxed across servers: mean queue delay, peak KV usage, running and queued requests,
    cache-hit rate, retractions. ``available`` is False when no scrape in the window had metrics."""
    window = [r for r in rows if isinstance(r.get("t"), int | float)
              and (start is None or start <= r["t"] <= (end or r["t"]))]  # fmt: skip
    good = [r for r in window if "m" in r]
    errors = sorted({r["error"] for r in rows if "error" in r})
    if not good:
        return {"available": False, "scrapes": 0, "errors": errors[:3]}
    by_url: dict[str, list[dict[str, Any]]] = {}
    for r in good:
        by_url.setdefault(r["url"], []).append(r["m"])

    def delta(name: str) -> float | None:
        total, seen = 0.0, False
        for series in by_url.values():
            values = [m[name] for m in series if name in m]
            if len(values) >= 2:
                total += values[-1] - values[0]
                seen = True
        return total if seen else None

    def gauge(name: str) -> list[float]:
        return gauge_series(window, name)[1]  # failed scrapes too: a server that died leaves the sums

    def stat(values: list[float], fn) -> float | None:
        return float(fn(values)) if values else None

    q_sum, q_count = delta("sglang:queue_time_seconds_sum"), delta("sglang:queue_time_seconds_count")
    cached, prompt = delta("sglang:cached_tokens_total"), delta("sglang:prompt_tokens_total")
    usage = [m["sglang:token_usage"] for s in by_url.values() for m in s if "sglang:token_usage" in m]
    running, queued = gauge("sglang:num_running_reqs"), gauge("sglang:num_queue_reqs")
    retracted = delta("sglang:num_retracted_requests_total")
    return {
        "available": True,
        "servers": len(by_url),
        "scrapes": len(good),
        "mean_queue_time_ms": q_sum / q_count * 1000.0 if q_sum is not None and q_count else None,
        "peak_token_usage": stat(usage, max),
        "mean_running": stat(running, lambda v: sum(v) / len(v)),
        "max_running": stat(running, max),
        "mean_queued": stat(queued, lambda v: sum(v) / len(v)),
        "max_queued": stat(queued, max),
        "cache_hit_rate": cached / prompt if cached is not None and prompt else None,
        "retractions": retracted,
        "errors": errors[:3],
    }
