"""Verdicts on a run from its records: goodput, the overload verdict, the method's pitfalls as findings, and
the prefix-cache hits the workload allows.

Pure functions over record columns (numpy arrays, one entry per record) that ``compute_summary`` calls; the
definitions and the reasons for each threshold are in docs/metrics.md ("Goodput", "Overload", "Findings");
keep the two in step. Every finding appears only when the data shows it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from loadlab.profile import ProfileError, validate_profile
from loadlab.workload import build_workload

# Goodput: the SLO metrics a single request has a value for. ITL is pooled over gaps, so an ITL objective
# bounds the gaps' distribution, not any one request: it sets no per-request limit.
PER_REQUEST_METRICS = ("ttft_ms", "tpot_ms", "e2e_latency_ms")

# Overload.
MIN_ARRIVALS = 20  # fewer measured due times say nothing about a trend
OFFERED_MARGIN = 0.10  # offered more than 10% above what the server took in: over capacity
SLOPE_MIN = 0.05  # TTFT rising 50 ms per second of arrivals: a FIFO queue fed 5% faster than served
SLOPE_T_MIN = 3.0  # and not by chance
SLOPE_MIN_SAMPLES = 10
GROWTH_MIN = 0.05  # in flight growing by 5% of the arrival rate per second: 5% not served

# No warm-up.
COLD_TTFT_RATIO = 2.0  # the first requests' median TTFT at least twice the rest's ...
COLD_TTFT_MIN_MS = 20.0  # ... and at least this much above it (a doubling of 2 ms is no cold start)
CACHE_RISE_MIN = 0.05  # the cached-token ratio 5 points higher after the first tenth of the run ...
CACHE_RISE_Z = 3.0  # ... and not by chance (per-request ratios, Welch's z)
MIN_WARMUP_SAMPLES = 40

# Load not locked: more in flight than the cap for 5% of the window (a send stamped by the wall clock can
# overlap the previous request's end, computed on the monotonic clock, by a slewing clock's few ms: that is
# no excess), or a closed loop whose time-weighted in-flight mean is under 75% of its concurrency.
LOCK_ABOVE_FRACTION = 0.05
LOCK_MEAN_FRACTION = 0.75

# KV reservation: the peak KV usage this close to the pool.
KV_NEAR_FULL = 0.90
# Errors that refuse a request for its size (SGLang's and the twin's messages).
_SIZE_WORDS = ("context length", "max_total_num_tokens", "kv cache tokens", "too long", "exceeds the maximum")

# Expected versus delivered prefix-cache hits: points apart before it is a finding.
CACHE_GAP_MAX = 0.10


def _rows(mask: np.ndarray) -> int:
    return int(np.count_nonzero(mask))


# ---------------------------------------------------------------------------------------------------
# Goodput


def goodput_limits(objectives: list[tuple[str, float, float, str]]) -> dict[str, float] | None:
    """Per-request limits from parsed SLO objectives (metric, percentile, threshold, key): each objective's
    threshold limits every request; where a metric has several, all must hold, so the lowest binds. None
    when no objective bounds a per-request metric."""
    limits: dict[str, float] = {}
    for metric, _, threshold, _ in objectives:
        if metric in PER_REQUEST_METRICS:
            limits[metric] = min(limits.get(metric, math.inf), threshold)
    return dict(sorted(limits.items(), key=lambda kv: PER_REQUEST_METRICS.index(kv[0]))) or None


def goodput(
    limits: dict[str, float] | None,
    measured: np.ndarray,
    ok: np.ndarray,
    ttft: np.ndarray,
    tpot: np.ndarray,
    e2e: np.ndarray,
    output_tokens: np.ndarray,
    duration: float | None,
) -> dict[str, Any]:
    """Goodput of the records ``measured`` selects: the completed ones within every limit. A request with no
    TPOT (one output token: nothing decoded) meets a TPOT limit; one with no TTFT or E2E does not meet a limit
    on it. ``tpot`` is each request's TPOT (NaN without one)."""
    fields = ("goodput_limits", "good_requests", "goodput_ratio", "request_goodput", "output_goodput")
    if limits is None:
        return dict.fromkeys(fields)
    good = measured & ok
    if "ttft_ms" in limits:
        good &= ttft <= limits["ttft_ms"]  # NaN compares False: no TTFT, no pass
    if "tpot_ms" in limits:
        good &= ~(tpot > limits["tpot_ms"])  # NaN (nothing decoded) passes
    if "e2e_latency_ms" in limits:
        good &= e2e <= limits["e2e_latency_ms"]
    count, total = _rows(good), _rows(measured)
    per_s = duration is not None and duration > 0
    return {
        "goodput_limits": limits,
        "good_requests": count,
        "goodput_ratio": count / total if total else None,
        "request_goodput": count / duration if per_s else None,
        "output_goodput": float(np.nansum(output_tokens[good])) / duration if per_s else None,
    }


# ---------------------------------------------------------------------------------------------------
# Overload


def _union_length(starts: np.ndarray, ends: np.ndarray) -> float:
    """Total length of the union of the intervals [start, end)."""
    if starts.size == 0:
        return 0.0
    order = np.argsort(starts, kind="stable")
    s = starts[order]
    reach = np.maximum.accumulate(ends[order])  # the furthest end so far
    # A stretch of overlapping intervals begins where a start lies beyond every end before it.
    begins = np.flatnonzero(np.concatenate([[True], s[1:] > reach[:-1]]))
    last = np.concatenate([begins[1:] - 1, [s.size - 1]])
    return float(np.sum(np.maximum(reach[last] - s[begins], 0.0)))


def _mean_in_flight(starts: np.ndarray, ends: np.ndarray, a: float, b: float) -> float:
    """Time-weighted mean of the intervals [start, end) in flight over [a, b]: their overlaps / its length."""
    overlap = np.minimum(ends, b) - np.maximum(starts, a)
    return float(np.sum(overlap[overlap > 0]) / (b - a))


def _slope(x: np.ndarray, y: np.ndarray) -> tuple[float, float | None]:
    """Least-squares slope of y on x and its t statistic (None when the residuals are all zero)."""
    dx = x - x.mean()
    sxx = float(np.sum(dx * dx))
    slope = float(np.sum(dx * (y - y.mean())) / sxx)
    residuals = y - y.mean() - slope * dx
    se = math.sqrt(float(np.sum(residuals * residuals)) / (x.size - 2) / sxx)
    return slope, (slope / se if se > 1e-12 * max(1.0, abs(slope)) else None)


def overload(
    due: np.ndarray,
    send: np.ndarray,
    ttft_ms: np.ndarray,
    prompt_tokens: np.ndarray,
    measured: np.ndarray,
    ok: np.ndarray,
    flight_starts: np.ndarray,
    flight_ends: np.ndarray,
) -> dict[str, Any] | None:
    """The overload verdict of an open-loop run (records with due times); None for a closed loop or too few
    arrivals. ``prompt_tokens`` is each record's prompt length (the server's, else the intended); the flight
    intervals are every record's [send, end) (s)."""
    arrived = measured & np.isfinite(due)
    if _rows(arrived) < MIN_ARRIVALS:
        return None
    dues = due[arrived]
    first, last = float(dues.min()), float(dues.max())
    span = last - first
    if span <= 0:
        return None
    rate = (dues.size - 1) / span
    prompts = prompt_tokens[arrived]
    mean_prompt = float(np.mean(prompts[np.isfinite(prompts)])) if np.isfinite(prompts).any() else None
    offered = rate * mean_prompt if mean_prompt is not None else None

    # What the server took in while it had a backlog: a request waits from its send to its first token.
    started = measured & ok & np.isfinite(ttft_ms) & np.isfinite(send)
    backlog = _union_length(send[started], send[started] + ttft_ms[started] / 1000.0)
    taken = prompt_tokens[started]
    served = float(np.sum(taken[np.isfinite(taken)])) / backlog if backlog > 0 else None
    offered_above = offered is not None and served is not None and offered > served * (1 + OFFERED_MARGIN)

    # The queue still growing: TTFT counted from the due time (the wait in the client too) against the due
    # time, over the arrivals' second half (the start's transient left out).
    late = started & np.isfinite(due) & (due >= first + span / 2)
    slope = slope_t = None
    if _rows(late) >= SLOPE_MIN_SAMPLES:
        waited_ms = ttft_ms[late] + (send[late] - due[late]) * 1000.0
        slope, slope_t = _slope(due[late] * 1000.0, waited_ms)
    ttft_growing = slope is not None and slope >= SLOPE_MIN and (slope_t is None or slope_t >= SLOPE_T_MIN)

    keep = np.isfinite(flight_starts) & np.isfinite(flight_ends)
    starts, ends = flight_starts[keep], flight_ends[keep]
    quarter = span / 4
    growth = (
        _mean_in_flight(starts, ends, last - quarter, last)
        - _mean_in_flight(starts, ends, last - 2 * quarter, last - quarter)
    ) / quarter
    in_flight_growing = growth >= GROWTH_MIN * rate
    return {
        "over_capacity": bool(offered_above or ttft_growing or in_flight_growing),
        "offered_above_capacity": bool(offered_above),
        "ttft_growing": bool(ttft_growing),
        "in_flight_growing": bool(in_flight_growing),
        "arrival_rate": rate,
        "arrival_span_s": span,
        "mean_prompt_tokens": mean_prompt,
        "offered_prompt_tokens_per_s": offered,
        "served_prompt_tokens_per_s": served,
        "backlog_s": backlog,
        "ttft_slope": slope,
        "ttft_slope_t": slope_t,
        "ttft_slope_samples": _rows(late),
        "in_flight_growth_per_s": growth,
    }


def overload_finding(verdict: dict[str, Any] | None, measured_requests: int) -> dict[str, Any] | None:
    """The overload verdict in plain words, naming the criteria that fired with their figures."""
    if not verdict or not verdict["over_capacity"]:
        return None
    v = verdict
    why = []
    if v["offered_above_capacity"]:
        why.append(f"offered {v['offered_prompt_tokens_per_s']:.0f} prompt tok/s ({v['arrival_rate']:.1f} req/s x "
                   f"{v['mean_prompt_tokens']:.0f} tokens) against the {v['served_prompt_tokens_per_s']:.0f} prompt "
                   "tok/s the server took in while requests waited for their first token")  # fmt: skip
    if v["ttft_growing"]:
        why.append(f"TTFT (from the due time) rose {v['ttft_slope'] * 1000:.0f} ms per second of arrivals over "
                   "their second half")  # fmt: skip
    if v["in_flight_growing"]:
        why.append(
            f"requests in flight grew by {v['in_flight_growth_per_s']:.1f}/s at the end of the arrivals"
        )
    message = (
        "Over capacity: arrivals outran the server; " + "; ".join(why) + ". TTFT grows with run length: the "
        f"percentiles describe this run's length ({measured_requests} measured requests arriving over "
        f"{v['arrival_span_s']:.0f} s), not a steady state, and no server limit can meet a TTFT SLO at this rate. "
        "Lower the rate or add capacity."
    )
    evidence = {k: float(v[k]) if v[k] is not None else None for k in (
        "arrival_rate", "offered_prompt_tokens_per_s", "served_prompt_tokens_per_s", "ttft_slope",
        "in_flight_growth_per_s")}  # fmt: skip
    return {"kind": "over_capacity", "message": message, "evidence": evidence}


# ---------------------------------------------------------------------------------------------------
# The pitfalls


def warmup_finding(
    warmup_requests: int,
    burst: int | None,
    send: np.ndarray,
    ttft_ms: np.ndarray,
    cached: np.ndarray,
    prompt: np.ndarray,
    done: np.ndarray,
) -> dict[str, Any] | None:
    """No (or too little) warm-up: without any warm-up, the first measured requests' TTFT well above the rest's
    (any warm-up runs the server's first-use initialisation); or the cache-hit ratio rising after the first
    tenth of the run (a cache still filling: the warm-up was too small for it). ``burst``: a closed loop's
    concurrency, whose first requests are sent at once. ``done``: the completed measured records."""
    order = np.flatnonzero(done)[np.argsort(send[done], kind="stable")]
    evidence: dict[str, float | None] = {"warmup_requests": float(warmup_requests)}
    said = []

    ttft = ttft_ms[order]
    ttft = ttft[np.isfinite(ttft)]
    if warmup_requests == 0 and ttft.size >= MIN_WARMUP_SAMPLES:
        k = max(5, ttft.size // 20)
        head, rest = float(np.median(ttft[:k])), float(np.median(ttft[k:]))
        if head >= COLD_TTFT_RATIO * rest and head - rest >= COLD_TTFT_MIN_MS:
            evidence |= {
                "first_requests": float(k),
                "first_median_ttft_ms": head,
                "rest_median_ttft_ms": rest,
            }
            # A closed loop's users all start at once, after a warm-up too (the measured phase waits for the
            # warm-up to drain): part of this may be that burst, which no warm-up removes.
            also = (f" (the first {burst} were also sent at once, as a closed loop starts, which adds to their "
                    "TTFT with or without a warm-up)" if burst and burst > 1 else "")  # fmt: skip
            said.append(f"the first {k} measured requests' median TTFT was {head:.0f} ms against {rest:.0f} ms for "
                        f"the rest{also}")  # fmt: skip

    reported = order[np.isfinite(cached[order]) & np.isfinite(prompt[order]) & (prompt[order] > 0)]
    if reported.size >= MIN_WARMUP_SAMPLES:
        k = max(10, reported.size // 10)
        head_idx, rest_idx = reported[:k], reported[k:]
        head = float(np.sum(cached[head_idx]) / np.sum(prompt[head_idx]))
        rest = float(np.sum(cached[rest_idx]) / np.sum(prompt[rest_idx]))
        a, b = cached[head_idx] / prompt[head_idx], cached[rest_idx] / prompt[rest_idx]
        se = math.sqrt(float(np.var(a)) / a.size + float(np.var(b)) / b.size)
        z = (
            (float(np.mean(b)) - float(np.mean(a))) / se
            if se > 0
            else (math.inf if b.mean() > a.mean() else 0.0)
        )
        if rest - head >= CACHE_RISE_MIN and z >= CACHE_RISE_Z:
            evidence |= {"first_cached_ratio": head, "rest_cached_ratio": rest}
            said.append(f"the cache-hit ratio rose from {head:.0%} over the first {k} requests to {rest:.0%} over "
                        "the rest")  # fmt: skip
    if not said:
        return None
    what = "No warm-up" if warmup_requests == 0 else f"Too little warm-up ({warmup_requests} requests)"
    return {
        "kind": "no_warmup",
        "message": f"{what}: " + "; ".join(said) + ". The start of the run measured a cold server (an empty "
        "prefix cache, first-use initialisation), not the steady state: warm up first (requests.warmup; the "
        "seed used 200).",
        "evidence": evidence,
    }


def lock_finding(
    closed: bool, concurrency: int | None, flight: dict[str, Any], above_s: float, window_s: float | None
) -> dict[str, Any] | None:
    """Load not locked: more in flight than the configured cap for at least LOCK_ABOVE_FRACTION of the window
    (``above_s`` of ``window_s``), or a closed loop whose time-weighted mean in flight sits far below its
    concurrency."""
    if concurrency is None or flight.get("max") is None or not window_s:
        return None
    said = []
    if above_s >= LOCK_ABOVE_FRACTION * window_s:
        said.append(f"up to {flight['max']} requests were in flight against a configured {concurrency} (more for "
                    f"{above_s / window_s:.0%} of the measured window): the client did not cap concurrency, so "
                    "the run measured that load, not the configured one (Locust's -u above the profile's "
                    "concurrency, or several load generators each holding it)")  # fmt: skip
    if closed and flight["mean"] is not None and flight["mean"] < LOCK_MEAN_FRACTION * concurrency:
        said.append(f"the closed loop held {flight['mean']:.1f} requests in flight on average (time-weighted) "
                    f"against a configured {concurrency}: users waited between requests (a client-bound load "
                    "generator) or the run had too few requests for its concurrency (the tail drains)")  # fmt: skip
    if not said:
        return None
    return {
        "kind": "load_not_locked",
        "message": "Load not locked: " + "; ".join(said) + ". Figures at this load are not figures at the "
        "configured one.",
        "evidence": {
            "configured_concurrency": float(concurrency),
            "in_flight_mean": flight["mean"],
            "in_flight_max": float(flight["max"]),
            "above_concurrency_s": above_s,
        },
    }


def refused_for_size(http_status: np.ndarray, errors: np.ndarray, failed: np.ndarray) -> int:
    """Failed records refused for their size (HTTP 400 naming a length or the KV pool)."""
    count = 0
    for status, error in zip(http_status[failed], errors[failed], strict=True):
        if status == 400 and isinstance(error, str) and any(w in error.lower() for w in _SIZE_WORDS):
            count += 1
    return count


def kv_finding(peak_usage: float | None, retractions: float | None, refused: int) -> dict[str, Any] | None:
    """KV reservation: the peak KV usage near the pool, retractions, or requests refused for their size."""
    said = []
    if peak_usage is not None and peak_usage >= KV_NEAR_FULL:
        said.append(f"peak KV usage {peak_usage:.0%} of the pool")
    if retractions:
        said.append(f"{retractions:.0f} retraction(s) (running requests evicted from the KV cache and recomputed "
                    "later: pure loss)")  # fmt: skip
    if refused:
        said.append(f"{refused} request(s) refused as too large for the context or the KV pool")
    if not said:
        return None
    return {
        "kind": "kv_reservation",
        "message": "KV reservation: "
        + "; ".join(said)
        + ". The KV pool was the limit: SGLang reserves KV for "
        "the running requests' outputs, so memory that looks free is already spoken for; lower "
        "--max-running-requests, give the KV pool more memory (--mem-fraction-static) or shorten the requests.",
        "evidence": {
            "peak_token_usage": peak_usage,
            "retractions": retractions,
            "refused_for_size": float(refused),
        },
    }


# ---------------------------------------------------------------------------------------------------
# Expected versus delivered prefix-cache hits


def reusable_prefix(profile: dict[str, Any] | None, indices: np.ndarray) -> np.ndarray | None:
    """For each record's index, the prompt tokens its workload shares with a lower-index request of the run
    (every index below the highest recorded one: tickets hand them out in order, warm-up first). None when
    the profile's seed, workload, requests and classes do not validate (an old or hand-made manifest), or
    when the workload cannot say before the run (a conversation whose replies may end early)."""
    finite = indices[np.isfinite(indices)]
    if not isinstance(profile, dict) or finite.size == 0:
        return None
    # Only what the requests are made of: the target and load sections (a cluster's front URL in place of
    # "embedded", say) are no business of the prompts and need not validate.
    prompts = {key: profile[key] for key in ("seed", "workload", "requests", "classes") if key in profile}
    target = profile.get("target")
    if isinstance(target, dict):  # a dataset's prompts are counted with the tokenizer, for the API
        prompts["target"] = {key: target[key] for key in ("tokenizer", "api") if key in target}
    top = int(finite.max())
    try:
        shared = build_workload(validate_profile(prompts)).reusable_prefix(range(top + 1)).astype(float)
    except (ProfileError, ValueError):
        return None
    out = np.full(indices.size, np.nan)
    known = np.isfinite(indices) & (indices >= 0)
    out[known] = shared[indices[known].astype(np.int64)]
    return out


def cache_finding(expected: float | None, delivered: float | None, workers: int) -> dict[str, Any] | None:
    """The server's cached-token ratio more than 10 points from the workload's upper bound."""
    if expected is None or delivered is None or abs(expected - delivered) <= CACHE_GAP_MAX:
        return None
    gap = delivered - expected
    if gap < 0:
        causes = ["the cache is too small for the prefixes in use (evicted before they recur)",
                  "the cache is disabled (--disable-radix-cache)"]  # fmt: skip
        if workers > 1:
            causes.insert(1, f"routing spreads shared prefixes over the {workers} workers")
        why = f"{-gap * 100:.0f} points short. Likely: " + "; ".join(causes) + "."
    else:
        why = (f"{gap * 100:.0f} points above the bound: prompts share tokens the workload does not know of (a "
               "chat template, other traffic on the server).")  # fmt: skip
    return {
        "kind": "prefix_cache_mismatch",
        "message": f"Prefix cache: the server reported {delivered:.0%} of prompt tokens cached against the "
        f"{expected:.0%} the workload allows (every prefix shared with an earlier request, first occurrences "
        f"excluded): {why}",
        "evidence": {"expected_cached_token_ratio": expected, "cached_token_ratio": delivered},
    }
