"""The prefix cache: a token-level radix tree over token ids, like SGLang's RadixCache.

- ``match_prefix(ids, now)``: the longest cached prefix of ``ids`` (splitting a node so the match ends on a
  node boundary, as SGLang does) and the node that ends it; ``peek_prefix_len`` measures without changing
  anything.
- ``insert(ids, now)``: adds ``ids`` (a prompt after its prefill, prompt + output when a request ends);
  returns the node ending them and how many tokens were new to the tree.
- ``lock(node)`` / ``unlock(node)``: running requests hold a lock on the path from the root to their
  node; locked tokens are ``protected_size``, the rest ``evictable_size``.
- ``evict(n)``: frees at least ``n`` tokens if it can, least recently used unlocked leaves first (a parent
  whose last child goes becomes a leaf and a candidate in turn). Candidates live in a heap keyed by last
  access that is brought up to date lazily (a popped entry older than its node's last access goes back
  in with the newer time), so an eviction does not walk the tree.

Token ids are Python lists (a tuple never compares equal to a list slice).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence


class Node:
    __slots__ = ("children", "key", "last_access", "lock_ref", "parent")

    def __init__(self, key: list[int], parent: Node | None, lock_ref: int, last_access: float):
        self.children: dict[int, Node] = {}
        self.parent = parent
        self.key = key
        self.lock_ref = lock_ref
        self.last_access = last_access


def _common_len(key: list[int], ids: Sequence[int], start: int) -> int:
    n = min(len(key), len(ids) - start)
    i = 0
    while i < n and key[i] == ids[start + i]:
        i += 1
    return i


class RadixCache:
    """Token-level radix tree. Locked nodes (used by running requests) are never evicted; eviction removes
    the least recently used unlocked leaves."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.root = Node([], None, 1, 0.0)
        self.evictable_size = 0
        self.protected_size = 0
        self.evicted_total = 0
        self._heap: list[tuple[float, int, Node]] = []  # eviction candidates (lazily up to date)
        self._tie = itertools.count()
        self.num_nodes = 0

    def _candidate(self, node: Node) -> None:
        heapq.heappush(self._heap, (node.last_access, next(self._tie), node))
        if len(self._heap) > 2 * self.num_nodes + 64:
            self._compact()

    @property
    def size(self) -> int:
        return self.evictable_size + self.protected_size

    def peek_prefix_len(self, ids: Sequence[int]) -> int:
        """Length of the cached prefix of ``ids``, without changing the tree."""
        node = self.root
        i = 0
        n = len(ids)
        while i < n:
            child = node.children.get(ids[i])
            if child is None:
                break
            m = _common_len(child.key, ids, i)
            i += m
            if m < len(child.key):
                break
            node = child
        return i

    def match_prefix(self, ids: list[int], now: float) -> tuple[Node, int]:
        """The node ending the longest cached prefix of ``ids`` (split so it ends exactly there) and the
        prefix length. Touches the matched nodes (LRU)."""
        node = self.root
        i = 0
        n = len(ids)
        while i < n:
            child = node.children.get(ids[i])
            if child is None:
                break
            key = child.key
            kl = len(key)
            if ids[i : i + kl] == key:
                child.last_access = now
                node = child
                i += kl
                continue
            m = _common_len(key, ids, i)
            node = self._split(child, m)
            node.last_access = now
            i += m
            break
        return node, i

    def insert(self, ids: list[int], now: float) -> tuple[Node, int]:
        """Inserts ``ids``; returns the node ending them and how many tokens were new to the cache."""
        node = self.root
        i = 0
        n = len(ids)
        while i < n:
            child = node.children.get(ids[i])
            if child is None:
                leaf = Node(ids[i:], node, 0, now)
                node.children[ids[i]] = leaf
                self.evictable_size += n - i
                self.num_nodes += 1
                self._candidate(leaf)
                return leaf, n - i
            key = child.key
            kl = len(key)
            if ids[i : i + kl] == key:
                child.last_access = now
                node = child
                i += kl
                continue
            m = _common_len(key, ids, i)
            node = self._split(child, m)
            node.last_access = now
            i += m
        return node, 0

    def _split(self, child: Node, m: int) -> Node:
        parent = child.parent
        assert parent is not None and 0 < m < len(child.key)
        new = Node(child.key[:m], parent, child.lock_ref, child.last_access)
        self.num_nodes += 1
        new.children[child.key[m]] = child
        parent.children[new.key[0]] = new
        child.key = child.key[m:]
        child.parent = new
        return new

    def lock(self, node: Node) -> None:
        root = self.root
        while node is not root:
            if node.lock_ref == 0:
                kl = len(node.key)
                self.evictable_size -= kl
                self.protected_size += kl
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: Node) -> None:
        root = self.root
        while node is not root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                kl = len(node.key)
                self.evictable_size += kl
                self.protected_size -= kl
                if not node.children:
                    self._candidate(node)
            node = node.parent  # type: ignore[assignment]

    def evict(self, num_tokens: int) -> int:
        """Frees at least ``num_tokens`` tokens if it can (LRU unlocked leaves first); returns freed."""
        if num_tokens <= 0 or self.evictable_size == 0:
            return 0
        heap = self._heap
        root = self.root
        freed = 0
        while freed < num_tokens and heap:
            t, _, node = heapq.heappop(heap)
            parent = node.parent
            if (
                parent is None
                or node.children
                or node.lock_ref
                or parent.children.get(node.key[0]) is not node
            ):
                continue  # gone, no longer a leaf, or locked: a stale entry
            if t < node.last_access:
                self._candidate(node)  # touched since it was queued: requeue with its real time
                continue
            del parent.children[node.key[0]]
            node.parent = None
            self.num_nodes -= 1
            kl = len(node.key)
            freed += kl
            self.evictable_size -= kl
            if parent is not root and not parent.children and parent.lock_ref == 0:
                self._candidate(parent)
        self.evicted_total += freed
        return freed

    def _compact(self) -> None:
        """Drops stale heap entries (keeps the heap proportional to the tree)."""
        keep = []
        seen = set()
        for _t, tie, node in self._heap:
            p = node.parent
            if p is None or node.children or node.lock_ref or id(node) in seen:
                continue
            if p.children.get(node.key[0]) is not node:
                continue
            seen.add(id(node))
            keep.append((node.last_access, tie, node))
        heapq.heapify(keep)
        self._heap = keep


__all__ = ["Node", "RadixCache"]
