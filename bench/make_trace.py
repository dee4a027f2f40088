"""Writes a small Mooncake-style trace (JSONL: timestamp ms, input_length, output_length, hash_ids) with
shared prefixes, for tests and examples: nothing is downloaded.

    python bench/make_trace.py profiles/data/mooncake-sample.jsonl            # the shipped file
    python bench/make_trace.py OUT.jsonl --requests 1000 --rate 4 --seed 1

Each request's prompt is made of 512-token blocks, as in Mooncake's traces, where a hash id stands for a
block together with every block before it:

- a system prompt, one of a few (1-4 blocks each), the popular ones more often (Zipf);
- with some probability the full blocks of an earlier request of the same system prompt (a conversation
  that goes on: its history is a shared prefix), else nothing more in common;
- 1-3 blocks of its own, the last one partial (so the last block of a prompt is never shared: a partial
  block hashes differently from the full block it would grow into).

Arrivals are Poisson at ``--rate`` per second; outputs are short (8-64 tokens) so a replay is quick. The
share of blocks an earlier line already had is printed (and is what the twin's cache-hit ratio should come
close to, tests/test_workload_trace.py).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

BLOCK = 512


def make_trace(requests: int = 200, rate: float = 2.0, seed: int = 0, systems: int = 4) -> list[dict]:
    rnd = random.Random(seed)
    next_id = iter(range(10**9))
    roots = [[next(next_id) for _ in range(rnd.randint(1, 4))] for _ in range(systems)]
    weights = [1 / (k + 1) for k in range(systems)]
    history: list[list[list[int]]] = [[] for _ in range(systems)]  # per system prompt: earlier full chains
    lines, t = [], 0.0
    for _ in range(requests):
        s = rnd.choices(range(systems), weights)[0]
        chain = list(roots[s])
        if history[s] and rnd.random() < 0.5:
            chain = list(rnd.choice(history[s][-8:]))  # a recent conversation goes on
        own = rnd.randint(1, 3)
        chain += [next(next_id) for _ in range(own)]
        history[s].append(chain[:-1])  # its full blocks (the last is partial)
        length = (len(chain) - 1) * BLOCK + rnd.randint(BLOCK // 4, BLOCK)
        lines.append({"timestamp": round(t * 1000), "input_length": length,
                      "output_length": rnd.randint(8, 64), "hash_ids": chain})  # fmt: skip
        t += rnd.expovariate(rate)
    return lines


def repeated_share(lines: list[dict]) -> float:
    seen: set[tuple[int, ...]] = set()
    repeated = total = 0
    for line in lines:
        ids = line["hash_ids"]
        for k in range(len(ids)):
            repeated += tuple(ids[: k + 1]) in seen
            total += 1
        seen.update(tuple(ids[: k + 1]) for k in range(len(ids)))
    return repeated / total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--rate", type=float, default=2.0, help="requests per second (Poisson)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--systems", type=int, default=4, help="distinct system prompts")
    a = p.parse_args()
    lines = make_trace(a.requests, a.rate, a.seed, a.systems)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    print(f"{a.out}: {len(lines)} requests over {lines[-1]['timestamp'] / 1000:.1f} s, "
          f"{repeated_share(lines):.1%} of blocks repeated")  # fmt: skip


if __name__ == "__main__":
    main()
