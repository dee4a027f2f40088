"""A worker's load signals as omni polls them: SGLang's ``GET /get_load`` and the ``sglang:*`` gauges of
``GET /metrics``, parsed (pure functions of the response bodies, no I/O)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

METRIC_GAUGES = {
    "sglang:num_running_reqs": "running",
    "sglang:num_queue_reqs": "waiting",
    "sglang:token_usage": "token_usage",
}


@dataclass(frozen=True)
class Signals:
    """One poll's signals (None: the worker did not give it). ``num_tokens`` is ``/get_load``'s: KV tokens in
    use plus the waiting requests' prompt tokens."""

    running: int | None = None
    waiting: int | None = None
    token_usage: float | None = None
    num_tokens: int | None = None
    source: str = "none"  # where running/waiting came from: get_load, metrics or none


def parse_get_load(body: bytes) -> tuple[int, int, int] | None:
    """(running, waiting, num_tokens) summed over the data-parallel ranks of SGLang's ``/get_load`` list
    (``num_reqs`` counts running + waiting); None when the body is not that list."""
    try:
        ranks = json.loads(body)
    except ValueError:
        return None
    if isinstance(ranks, dict):  # one rank, not in a list
        ranks = [ranks]
    if not isinstance(ranks, list) or not ranks:
        return None
    running = waiting = tokens = 0
    for r in ranks:
        if not isinstance(r, dict):
            return None
        reqs, wait, tok = r.get("num_reqs"), r.get("num_waiting_reqs"), r.get("num_tokens", 0)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (reqs, wait, tok)):
            return None
        running += max(0, reqs - wait)
        waiting += wait
        tokens += tok
    return running, waiting, tokens


def parse_metrics(text: str) -> dict[str, float]:
    """The ``METRIC_GAUGES`` found in a Prometheus text page: running and waiting summed over their series
    (data-parallel ranks), token_usage the highest. Missing gauges are absent from the result."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("sglang:"):
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        if name_end < 0:
            continue
        field = METRIC_GAUGES.get(line[:name_end])
        if field is None:
            continue
        rest = line[name_end:]
        if rest.startswith("{"):
            rest = rest[rest.rfind("}") + 1 :]
        try:
            value = float(rest.split()[0])
        except (ValueError, IndexError):
            continue
        if not math.isfinite(value):
            continue
        if field == "token_usage":
            out[field] = max(out.get(field, value), value)
        else:
            out[field] = out.get(field, 0.0) + value
    return out


def combine(
    get_load: tuple[int, int, int] | None, metrics: dict[str, float] | None, max_total_tokens: int | None
) -> Signals:
    """One poll's signals: running and waiting from ``/get_load`` when it answered (SGLang's own load
    report), else from ``/metrics``; token_usage from ``/metrics``, else ``num_tokens / max_total_tokens``."""
    metrics = metrics or {}
    usage = metrics.get("token_usage")
    tokens = get_load[2] if get_load is not None else None
    if usage is None and tokens is not None and max_total_tokens:
        usage = tokens / max_total_tokens
    if get_load is not None:
        return Signals(get_load[0], get_load[1], usage, tokens, "get_load")
    if "running" in metrics and "waiting" in metrics:
        return Signals(int(metrics["running"]), int(metrics["waiting"]), usage, None, "metrics")
    return Signals(None, None, usage, None, "none")
