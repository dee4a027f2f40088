"""The ``trace`` kind: a Mooncake-style trace replayed with synthesised prompts (docs/workloads.md).

A trace is JSONL, one request per line, in time order: ``timestamp`` (ms), ``input_length``,
``output_length`` and ``hash_ids``, one id per ``block_size`` prompt tokens (512 in Mooncake's traces; the
last block may be partial). Two requests with the same hash id at the same block position share that
block's tokens, and in Mooncake's traces an id stands for the whole prefix up to its block (the hash of
the block and all before it), so equal ids mean a shared prefix: what a prefix cache can reuse.

The prompts are made so: block ``h`` is a function of (seed, h) alone, ``block_size`` word ids of which a
block of n tokens takes the first n; tokens past the last hash id (a trace may hash fewer blocks than
the prompt has) are unique to the request. Request i is line i (a run longer than the trace starts it
again, with new unique tails); with ``load.arrival: trace`` it is due at the line's timestamp divided by
``load.speed`` (``loadlab.load.TraceArrivals``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from loadlab.profile import Profile, ProfileError, TraceWorkloadConfig
from loadlab.workload.datasets import file_error, jsonl_objects, read_text
from loadlab.workload.generators import (
    WorkloadGenerator,
    _cache_size,
    _rng,
    _seed_word,
    _words,
    register,
    repeated,
)
from loadlab.workload.spec import RequestSpec

_SALT_TRACE_BLOCK = 81  # never change: it fixes every block's tokens
_SALT_TRACE_TAIL = 82

FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


@dataclass(frozen=True, slots=True)
class TraceLine:
    line: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace(path: str, block_size: int) -> list[TraceLine]:
    """Every line of a trace file, checked: the four fields, their types, time order, and hash ids that fit
    the prompt (at most ceil(input_length / block_size))."""
    out: list[TraceLine] = []
    for n, obj in jsonl_objects(path, read_text(path)):
        for key in FIELDS:
            if key not in obj:
                raise file_error(path, n, key, f"missing: a trace line needs {', '.join(FIELDS)}")
        ts = obj["timestamp"]
        if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
            raise file_error(path, n, "timestamp", f"must be a number of milliseconds, got {ts!r}")
        if out and ts < out[-1].timestamp_ms:
            raise file_error(path, n, "timestamp", f"{ts:g} is before line {out[-1].line}'s {out[-1].timestamp_ms:g}: "
                        "a trace is replayed in its order, which must be time order")  # fmt: skip
        lengths = []
        for key in ("input_length", "output_length"):
            v = obj[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise file_error(path, n, key, f"must be a positive integer (tokens), got {v!r}")
            lengths.append(v)
        ids = obj["hash_ids"]
        if not isinstance(ids, list) or not all(type(h) is int for h in ids):
            raise file_error(path, n, "hash_ids", "must be a list of integers")
        blocks = -(-lengths[0] // block_size)
        if len(ids) > blocks:
            raise file_error(path, n, "hash_ids", f"{len(ids)} blocks, but input_length {lengths[0]} fills only "
                        f"{blocks} of block_size {block_size}")  # fmt: skip
        out.append(TraceLine(n, float(ts), lengths[0], lengths[1], tuple(ids)))
    if not out:
        raise file_error(path, None, "workload.path", "no requests in the trace")
    return out


class _Prefixes:
    """The block prefixes seen so far, as a tree of (parent, hash id) -> node: which of a prompt's blocks an
    earlier prompt already had (the longest block seen there, for a partial last block)."""

    def __init__(self):
        self.nodes: dict[tuple[int, int], int] = {}
        self.longest: list[int] = []

    def walk(self, t: TraceLine, block_size: int) -> tuple[int, int]:
        """(blocks already seen, their tokens in this prompt), then adds this prompt's blocks."""
        parent, seen, tokens, matching = -1, 0, 0, True
        for k, h in enumerate(t.hash_ids):
            n = min(block_size, t.input_length - k * block_size)
            node = self.nodes.get((parent, h))
            if node is None:
                matching = False
                node = self.nodes[(parent, h)] = len(self.longest)
                self.longest.append(0)
            elif matching:
                seen += 1
                tokens += min(n, self.longest[node])
                matching = self.longest[node] >= n
            self.longest[node] = max(self.longest[node], n)
            parent = node
        return seen, tokens


def repeated_shares(lines: list[TraceLine], block_size: int) -> tuple[float, float]:
    """The trace's reuse: (the share of its hashed blocks whose prefix, the block and every one before it,
    an earlier line already had; the share of its prompt tokens in those blocks). What a prefix cache that
    never evicts would serve, counted in blocks and in tokens (a partial last block weighs less)."""
    tree = _Prefixes()
    blocks = tokens = 0
    for t in lines:
        seen, shared = tree.walk(t, block_size)
        blocks, tokens = blocks + seen, tokens + shared
    total_blocks = sum(len(t.hash_ids) for t in lines)
    return blocks / max(1, total_blocks), tokens / sum(t.input_length for t in lines)


class TraceGenerator(WorkloadGenerator):
    """Line i % n of the trace: its blocks' shared tokens, then a unique tail; its output length."""

    kind = "trace"

    def __init__(self, profile: Profile):
        super().__init__(profile)
        w: TraceWorkloadConfig = self.config
        self.block_size = w.block_size
        self.lines = read_trace(w.path, w.block_size)
        if profile.load.arrival == "trace" and profile.total_requests > len(self.lines):
            raise ProfileError(
                f"{w.path}: requests: {profile.total_requests} requests (warm-up + measured) at the trace's "
                f"times, but the trace has {len(self.lines)} lines: ask for at most that many"
            )
        distinct = len({h for t in self.lines for h in t.hash_ids}) or 1
        self.block = functools.lru_cache(maxsize=_cache_size(w.block_size, distinct))(self._make_block)
        t0 = self.lines[0].timestamp_ms
        by_blocks, by_tokens = repeated_shares(self.lines, w.block_size)
        self.source = {
            "path": w.path,
            "format": "mooncake",
            "entries_read": len(self.lines),
            "entries": len(self.lines),
            "lengths": "the trace's input_length and output_length, in tokens (exact on /generate, with a "
            "tokenizer, or against the twin)",
            "trace_span_s": (self.lines[-1].timestamp_ms - t0) / 1000.0,
            "repeated_block_share": by_blocks,
            "repeated_token_share": by_tokens,
        }

    def _make_block(self, hash_id: int) -> np.ndarray:
        return _words(_rng(self._s, _seed_word(hash_id), _SALT_TRACE_BLOCK), self.block_size)

    def _spec(self, index: int) -> RequestSpec:
        t = self.lines[index % len(self.lines)]
        bs = self.block_size
        parts = [self.block(h)[: min(bs, t.input_length - k * bs)] for k, h in enumerate(t.hash_ids)]
        tail = t.input_length - len(t.hash_ids) * bs
        if tail > 0:
            parts.append(_words(_rng(self._s, index, _SALT_TRACE_TAIL), tail))
        ids = np.concatenate(parts).tolist()
        group = t.hash_ids[0] if t.hash_ids else None
        return RequestSpec(
            index=index, input_ids=tuple(ids), max_new_tokens=t.output_length, prefix_group=group
        )

    def reusable_prefix(self, indices: Sequence[int]) -> np.ndarray:
        # Blocks whose prefix an earlier request among them had; a partial block as far as both have it. A
        # line replayed again shares every block of its earlier replay (its tail is its own); only a line's
        # first replay is walked.
        indices = np.asarray(indices, dtype=np.int64)
        line = indices % len(self.lines)
        hashed = np.array(
            [min(t.input_length, len(t.hash_ids) * self.block_size) for t in self.lines], dtype=np.int64
        )
        inputs = np.array([t.input_length for t in self.lines], dtype=np.int64)
        out = np.minimum(hashed[line], inputs[line] - 1)
        tree = _Prefixes()
        for position in np.flatnonzero(~repeated(line)).tolist():
            t = self.lines[line[position]]
            out[position] = min(tree.walk(t, self.block_size)[1], t.input_length - 1)
        return out

    def arrival_times_s(self) -> list[float]:
        """Each line's time from the first line's, in seconds (``load.arrival: trace``)."""
        t0 = self.lines[0].timestamp_ms
        return [(t.timestamp_ms - t0) / 1000.0 for t in self.lines]

    def source_info(self) -> dict[str, Any]:
        return self.source


register(TraceGenerator)
