"""omni's routing policies: small pure functions of a snapshot of the workers (no I/O, no clock, no aiohttp),
so that the real front (``loadlab.cluster.omni``) and a virtual-time model can share them.

A ``Snapshot`` holds, per worker, what omni knows when it decides: the worker's last polled signals
(``/get_load``, ``/metrics``: stale by up to one poll interval) and omni's own, exact count of the requests
it has in flight there now. ``WorkerLoad`` combines the two into estimates of the worker's state now
(``total_est``, ``running_est``, ``waiting_est``, ``kv_est``); the policies compare those estimates.
``choose(policy, snapshot, rng)`` is the one entry point. docs/cluster.md ("The omni front") describes each
policy and the estimates.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerLoad:
    """One worker as omni sees it at a decision.

    ``index``: the worker's position in omni's worker list (what ``choose`` returns). ``name``: its URL (the
    prefix policy hashes it, so a choice does not depend on the list's order). ``in_flight``: omni's own
    requests there now; ``limit``: the most omni lets it have (None: no limit); ``routed``: requests omni has
    sent it so far (the last tie-break, so that ties spread). ``running``, ``waiting``, ``token_usage``: the
    last poll's signals (None: no signal); ``in_flight_at_poll``: omni's count when that poll answered;
    ``max_running``: the worker's ``max_running_requests`` (None: unknown).
    """

    index: int
    name: str
    up: bool = True
    in_flight: int = 0
    limit: int | None = None
    routed: int = 0
    running: int | None = None
    waiting: int | None = None
    token_usage: float | None = None
    in_flight_at_poll: int = 0
    max_running: int | None = None

    @property
    def has_room(self) -> bool:
        """Up, and below omni's limit for it."""
        return self.up and (self.limit is None or self.in_flight < self.limit)

    @property
    def total_est(self) -> int:
        """Requests at the worker now (running + waiting): the polled total, corrected by what omni's own
        count did since the poll (requests omni sent since are added, those that finished since are
        taken off), never below omni's own count. Without a polled signal, omni's own count."""
        if self.running is None or self.waiting is None:
            return self.in_flight
        return max(self.in_flight, self.running + self.waiting + self.in_flight - self.in_flight_at_poll)

    @property
    def running_est(self) -> int:
        """Of ``total_est``, those running: up to the batch the worker showed it holds (the polled running
        count if requests were waiting then, else ``max_running`` or no bound)."""
        total = self.total_est
        if self.running is not None and self.waiting:
            return min(total, self.running)
        if self.max_running is not None:
            return min(total, max(self.max_running, self.running or 0))
        return total

    @property
    def waiting_est(self) -> int:
        """Of ``total_est``, those waiting in the worker's queue."""
        return self.total_est - self.running_est

    def kv_est(self, per_request: float) -> float:
        """KV usage now (fraction of the pool): the polled ``token_usage`` plus ``per_request`` (or this
        worker's own polled usage per running request) for each running request more than at the poll."""
        polled_running = self.running or 0
        if self.token_usage is None:
            return per_request * self.running_est
        per = self.token_usage / polled_running if polled_running > 0 else per_request
        return max(0.0, self.token_usage + (self.running_est - polled_running) * per)


@dataclass(frozen=True)
class Snapshot:
    """What a decision sees: the workers omni may route this request to (its district), the request's
    prefix key (``prefix_key``; None when it has none) and the round-robin cursor (the index after the
    last choice)."""

    workers: tuple[WorkerLoad, ...]
    key: bytes | None = None
    cursor: int = 0

    def healthy(self) -> list[WorkerLoad]:
        return [w for w in self.workers if w.up]

    def candidates(self) -> list[WorkerLoad]:
        """Healthy workers below their limit: the only ones a request may go to now."""
        return [w for w in self.workers if w.has_room]

    def kv_per_request(self) -> float:
        """The cluster's polled KV usage per running request (0.0 without any)."""
        usage = sum(w.token_usage for w in self.workers if w.token_usage is not None and w.running)
        running = sum(w.running for w in self.workers if w.token_usage is not None and w.running)
        return usage / running if running else 0.0


@dataclass(frozen=True)
class PolicyParams:
    """The prefix policy's fallback rule: the affinity worker is "far busier" than the least busy candidate
    when its ``total_est`` exceeds the least by more than ``balance_abs`` requests AND is more than
    ``balance_rel`` times it (sglang-router's cache_aware rule, with thresholds for small batches)."""

    balance_abs: int = 8
    balance_rel: float = 1.5


Policy = Callable[[Snapshot, list[WorkerLoad], random.Random, PolicyParams], int]


def _tie(w: WorkerLoad) -> tuple[int, int, int]:
    return (w.in_flight, w.routed, w.index)


def round_robin(snap: Snapshot, cands: list[WorkerLoad], rng: random.Random, params: PolicyParams) -> int:
    """The next candidate in list order from the cursor on (wrapping round)."""
    return min(cands, key=lambda w: (w.index < snap.cursor, w.index)).index


def power_of_two(snap: Snapshot, cands: list[WorkerLoad], rng: random.Random, params: PolicyParams) -> int:
    """Two distinct random candidates; the lighter by waiting + running (estimated) wins."""
    pair = rng.sample(cands, 2) if len(cands) > 1 else cands
    return min(pair, key=lambda w: (w.waiting_est + w.running_est, *_tie(w))).index


def least_queue(snap: Snapshot, cands: list[WorkerLoad], rng: random.Random, params: PolicyParams) -> int:
    """Fewest waiting, then fewest running (estimated); then omni's own in-flight and routed counts."""
    return min(cands, key=lambda w: (w.waiting_est, w.running_est, *_tie(w))).index


def least_kv(snap: Snapshot, cands: list[WorkerLoad], rng: random.Random, params: PolicyParams) -> int:
    """Lowest KV usage (estimated, ``WorkerLoad.kv_est``); then fewest requests."""
    per = snap.kv_per_request()
    return min(cands, key=lambda w: (w.kv_est(per), w.total_est, *_tie(w))).index


def prefix_score(key: bytes, name: str) -> int:
    """Rendezvous (highest random weight) hashing: the worker with the highest score owns the key, so a key
    keeps its worker while that worker is up, and only the keys of a worker that goes down move."""
    digest = hashlib.blake2b(key + b"\0" + name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def affinity_worker(snap: Snapshot) -> WorkerLoad | None:
    """The healthy worker that owns the snapshot's key (None without a key or a healthy worker)."""
    healthy = snap.healthy()
    if snap.key is None or not healthy:
        return None
    key = snap.key
    return max(healthy, key=lambda w: prefix_score(key, w.name))


def far_busier(w: WorkerLoad, cands: Sequence[WorkerLoad], params: PolicyParams) -> bool:
    """``PolicyParams``'s rule: ``w`` is far busier than the least busy candidate."""
    low = min(c.total_est for c in cands)
    load = w.total_est
    return load - low > params.balance_abs and load > params.balance_rel * low


def prefix(snap: Snapshot, cands: list[WorkerLoad], rng: random.Random, params: PolicyParams) -> int:
    """Affinity: the key's owner among the healthy workers (``prefix_score``). ``least_queue`` instead when
    the request has no key, the owner is at its limit, or the owner is far busier (``far_busier``)."""
    owner = affinity_worker(snap)
    if owner is not None and owner.has_room and not far_busier(owner, cands, params):
        return owner.index
    return least_queue(snap, cands, rng, params)


POLICIES: dict[str, Policy] = {
    "round_robin": round_robin,
    "power_of_two": power_of_two,
    "least_queue": least_queue,
    "least_kv": least_kv,
    "prefix": prefix,
}


# The request header naming a request's class, as omni reads it (its --class-header default, which the
# launcher keeps) and loadlab's profiles set it (classes[].carry.header); here, beside the routing, so that
# what checks a profile against a cluster need not import the front (aiohttp).
CLASS_HEADER = "x-request-id-class"
DEFAULT_CLASS = "default"  # the class of a request without one (or naming a class no district names)


def class_districts(districts: Sequence[tuple[str, Sequence[str] | None]]) -> dict[str, list[str]]:
    """Which districts serve each class, from (district name, classes it serves or None for any) each:
    every class a district names, over the districts naming it and those serving any class; ``default``
    (a request without a class, or of a class no district names) over the districts serving any class,
    when there are such. A class missing here is served by no district. Districts in the given order."""
    names = list(dict.fromkeys(c for _, serves in districts for c in serves or ()))
    out = {n: [d for d, serves in districts if serves is None or n in serves] for n in names}
    anyone = [d for d, serves in districts if serves is None]
    if anyone and DEFAULT_CLASS not in out:
        out[DEFAULT_CLASS] = anyone
    return out


def class_of(pools: dict[str, list[str]], name: str | None) -> str | None:
    """The class a request named ``name`` (None: no class) is served as: its own when a district names it,
    else ``default`` when some district serves any class, else None (no district serves it)."""
    if name and name in pools:
        return name
    return DEFAULT_CLASS if DEFAULT_CLASS in pools else None


def choose(policy: str, snap: Snapshot, rng: random.Random, params: PolicyParams | None = None) -> int | None:
    """The index of the worker ``policy`` sends the request to, or None when no worker has room (the
    request waits, or is refused when no worker is up)."""
    cands = snap.candidates()
    if not cands:
        return None
    return POLICIES[policy](snap, cands, rng, params or PolicyParams())


def in_flight_limit(max_running: int | None, fixed: int | None = None, fraction: float = 1.0) -> int | None:
    """omni's limit on its requests in flight at one worker: ``fixed`` (``--max-in-flight-per-worker``) when
    given, else ``fraction`` of the worker's ``max_running_requests`` (rounded down, at least 1: the batch
    window omni lets it fill), else no limit (a worker that reports none)."""
    if fixed is not None:
        return fixed
    if max_running is None:
        return None
    return max(1, math.floor(max_running * fraction + 1e-9))


# -- the switch -------------------------------------------------------------------------------------------
SWITCH_AUTO = "auto"  # every class may divert to every district that does not already serve it


def switch_problem(
    pools: dict[str, list[str]], districts: Sequence[str], cls: str, targets: Sequence[str]
) -> str | None:
    """What is wrong with switching class ``cls`` to the districts ``targets`` (None: nothing), given the
    classes' own districts (``class_districts``) and every district's name. No cycle check is needed: a
    diverted request keeps its class and is never diverted again (one hop), so online -> offline and
    offline -> online may both be set."""
    if cls not in pools:
        named = ", ".join(pools) or "none"
        return f"no district serves class {cls!r}, so it has nothing to switch from (classes: {named})"
    if not targets:
        return "expected at least one district to switch to"
    for d in targets:
        if d not in districts:
            return f"no district {d!r} (districts: {', '.join(districts)})"
        if targets.count(d) > 1:
            return f"district {d!r} is named twice"
        if d in pools[cls]:
            return f"district {d!r} already serves class {cls!r}: a switch diverts to districts that do not"
    return None


def switch_routes(
    pools: dict[str, list[str]], districts: Sequence[str], switch: str | dict[str, Sequence[str]] | None
) -> dict[str, list[str]]:
    """Each class's switch districts, from a switch setting: None (no switch), ``auto`` (every district not
    serving the class; classes served everywhere get none) or {class: [district, ...]} (checked with
    ``switch_problem``; ValueError naming the class). Districts in ``districts`` order."""
    if switch is None:
        return {}
    if switch == SWITCH_AUTO:
        out = {c: [d for d in districts if d not in own] for c, own in pools.items()}
        return {c: ds for c, ds in out.items() if ds}
    if isinstance(switch, str):
        raise ValueError(f"expected {SWITCH_AUTO!r} or a mapping of class to districts, got {switch!r}")
    for cls, targets in switch.items():
        problem = switch_problem(pools, districts, cls, list(targets))
        if problem:
            raise ValueError(f"{cls}: {problem}")
    return {c: [d for d in districts if d in targets] for c, targets in switch.items()}


def next_in_line(
    policy: str,
    own: Snapshot,
    spill: Snapshot | None,
    in_line: int,
    switch_after_waiting: int,
    rng: random.Random,
    params: PolicyParams | None = None,
) -> tuple[int, bool] | None:
    """Where the first request in a class's line goes (the real front and the virtual one both ask this):
    (worker index, diverted?), or None when it must wait.

    The switch rule, from the front's own state only: the class's own districts (``own``) come first; when
    none of their workers has room (every one at its in-flight limit, or down) and more than
    ``switch_after_waiting`` of the class's requests are in line (``in_line``: those waiting in its queue,
    counting a new arrival), the request goes to a worker of a switch district (``spill``: None when the
    class has none, or when this decision may not divert) that has room. Room is the same limit as the
    district's own requests meet, and a district's own waiting requests take its room first (the caller
    drains every class's own districts before any switch)."""
    index = choose(policy, own, rng, params)
    if index is not None:
        return index, False
    if spill is None or in_line <= switch_after_waiting:
        return None
    index = choose(policy, spill, rng, params)
    return None if index is None else (index, True)


# -- the prefix key ---------------------------------------------------------------------------------------
def prompt_prefix(path: str, body: object, length: int) -> bytes | None:
    """The prefix key of a request body (parsed JSON): the first ``length`` token ids of ``input_ids`` (or a
    completions ``prompt`` of ids), or the first ``length`` characters of the prompt text (``/generate``
    ``text``, completions ``prompt``, chat: each message as ``role: content`` on its own line). None when
    the body has no prompt omni can read."""
    if not isinstance(body, dict):
        return None
    if path.endswith("/chat/completions"):
        return _chat_key(body.get("messages"), length)
    prompt = body.get("input_ids") if path.endswith("/generate") else body.get("prompt")
    if path.endswith("/generate") and prompt is None:
        prompt = body.get("text")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return b"t:" + prompt[:length].encode()
    if isinstance(prompt, list) and prompt and all(type(i) is int for i in prompt[:length]):
        return b"i:" + ",".join(map(str, prompt[:length])).encode()
    return None


def _chat_key(messages: object, length: int) -> bytes | None:
    if not isinstance(messages, list) or not messages:
        return None
    parts: list[str] = []
    size = 0
    for m in messages:
        if not isinstance(m, dict):
            return None
        content = m.get("content")
        if isinstance(content, list):  # content parts: their text
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        piece = f"{m.get('role', '')}: {content if isinstance(content, str) else ''}\n"
        parts.append(piece)
        size += len(piece)
        if size >= length:
            break
    return b"t:" + "".join(parts)[:length].encode()


__all__ = [
    "POLICIES",
    "SWITCH_AUTO",
    "PolicyParams",
    "Snapshot",
    "WorkerLoad",
    "affinity_worker",
    "choose",
    "far_busier",
    "in_flight_limit",
    "next_in_line",
    "prefix_score",
    "prompt_prefix",
    "switch_problem",
    "switch_routes",
]
