"""Workload generators: a profile becomes a deterministic, random-access stream of request specs.

The contract: ``build_workload(profile).spec(i)`` is a pure function of (the workload section, the
profile seed, i). It does not depend on which other indices were asked for, in what order, or by which
process, so any number of workers can each generate any index and a run sends the same requests
however it is split. Each request draws from its own generator seeded with ``[seed, i, salt]``; the
material requests share (the rag instruction and passage corpus, the shared_prefix system prompts, the
random_prefix leading-token permutations) is a function of the seed alone and is cached per process.

Prompts are sequences of word ids (indices into ``loadlab.workload.words.WORDS``); the renderer in
``loadlab.workload.text`` turns them into token ids or text for the wire.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from loadlab.manifest import WorkloadSource
from loadlab.profile import (
    ClassConfig,
    Profile,
    ProfileError,
    RagWorkloadConfig,
    RandomPrefixWorkloadConfig,
)
from loadlab.workload import bulk_rng
from loadlab.workload.bulk_rng import first_doubles, first_integers, permutations
from loadlab.workload.spec import RequestSpec
from loadlab.workload.words import NUM_WORDS

# Salts keep the random streams of different purposes apart; never change them (that changes every
# generated prompt for a given seed).
_SALT_RAG_INSTRUCTION = 11
_SALT_RAG_PASSAGE = 12
_SALT_RAG_REQUEST = 13
_SALT_GSP_SYSTEM = 21
_SALT_GSP_SYSTEM_FIRST = 22
_SALT_GSP_REQUEST = 23
_SALT_GSP_QUESTION_LEAD = 24
_SALT_GSP_GROUP = 25
_SALT_RP_LEAD = 31
_SALT_RP_REQUEST = 32
_SALT_CLASS_WARMUP = 41
_SALT_CLASS_MEASURED = 42
_SALT_CLASS_BEYOND = 43

# Many requests drawn in bulk a chunk at a time: past ~10^5 rows each temporary would be fresh memory (page
# faults cost more than the arithmetic: 2.5 -> 1.0 s for a million RAG requests on a 2-vCPU VM).
_BULK_CHUNK = 1 << 17

# Upper bound on shared material cached per process, in tokens (int32: 4 bytes each).
_CACHE_TOKENS = 4 << 20


def _seed_word(seed: int) -> int:
    """numpy seed sequences take non-negative integers; negative profile seeds map into 64 bits."""
    return seed % (1 << 64)


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng(list(key))


def _words(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, NUM_WORDS, size=n, dtype=np.int32)


def _cache_size(item_tokens: int, items: int) -> int:
    return max(1, min(items, _CACHE_TOKENS // max(1, item_tokens)))


class WorkloadGenerator:
    """A deterministic, random-access stream of request specs; subclasses implement ``_spec``."""

    kind: str = ""

    def __init__(self, profile: Profile):
        self.profile = profile
        self.config = profile.workload
        self.seed = profile.seed
        self._s = _seed_word(profile.seed)

    def spec(self, index: int) -> RequestSpec:
        """The request spec for ``index`` (>= 0): a pure function of (workload, seed, index)."""
        if isinstance(index, bool) or not isinstance(index, int | np.integer) or index < 0:
            raise ValueError(f"request index must be a non-negative integer (got {index!r})")
        spec = self._spec(int(index))
        return spec if self.config.ignore_eos else dataclasses.replace(spec, ignore_eos=False)

    def specs(self, indices: Iterable[int]) -> Iterator[RequestSpec]:
        for i in indices:
            yield self.spec(i)

    def _spec(self, index: int) -> RequestSpec:  # pragma: no cover - abstract
        raise NotImplementedError

    def reusable_prefix(self, indices: Sequence[int]) -> np.ndarray:
        """For each of ``indices`` (ascending, distinct), how many leading prompt tokens it shares with a
        request of a lower index among them: what a prefix cache that never evicts could serve it.

        Capped at the prompt's length - 1 (a server always computes the last prompt token itself, so it
        never reports the whole prompt cached). Computed from the workload's structure (which shared parts
        each prompt is built from), not from the prompts, so it costs a small part of generating them.
        Two different random parts (passages, questions) begin with the same word only by chance (1 in
        len(WORDS)); the few tokens such a coincidence adds are not counted.
        """
        raise NotImplementedError  # pragma: no cover - each kind's, in bulk (a million indices in about a second)

    def source_info(self) -> dict | None:
        """What the manifest records of a workload read from a file (``Manifest.workload_source``)."""
        return None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} seed={self.seed} {self.config!r}>"


class RagGenerator(WorkloadGenerator):
    """Shared instruction + k Zipf-popular passages (most popular first) + a unique question.

    Passage p has popularity rank p (0 = most popular, probability proportional to 1/(p+1)^s); its
    content is a function of (seed, p, passage length). Each request draws k distinct passages by
    popularity and orders them by rank, as a retriever's score order would, so requests whose top
    passage is the same share instruction + that passage as a cacheable prefix. prefix_group is the
    id of the first (most popular) passage in the prompt.
    """

    kind = "rag"

    def __init__(self, profile: Profile):
        super().__init__(profile)
        w: RagWorkloadConfig = self.config
        k = w.passages_per_prompt
        if k > w.corpus_size:
            raise ProfileError(
                f"workload.passages_per_prompt: {k} passages per prompt cannot be drawn without "
                f"replacement from a corpus of {w.corpus_size} (corpus_size)"
            )
        self.k = k
        body = w.input_len - w.instruction_len - w.question_len
        self.passage_len = body // k
        self.question_len = w.question_len + body % k  # the remainder goes to the question
        self.instruction = _words(_rng(self._s, _SALT_RAG_INSTRUCTION), w.instruction_len)
        weights = np.arange(1, w.corpus_size + 1, dtype=np.float64) ** -w.zipf_s
        self.popularity = weights / weights.sum()
        cdf = np.cumsum(self.popularity)
        cdf[-1] = 1.0
        self._cdf = cdf
        self.passage = functools.lru_cache(maxsize=_cache_size(self.passage_len, w.corpus_size))(
            self._make_passage
        )

    def _make_passage(self, pid: int) -> np.ndarray:
        """The content of passage ``pid``: a function of (seed, pid, passage length)."""
        return _words(_rng(self._s, pid, _SALT_RAG_PASSAGE), self.passage_len)

    def draw_passages(self, rng: np.random.Generator) -> list[int]:
        """k distinct passage ids by Zipf popularity, most popular (lowest id) first."""
        k, n = self.k, len(self._cdf)
        chosen: list[int] = []
        seen: set[int] = set()
        for _ in range(8):
            picks = np.searchsorted(self._cdf, rng.random(2 * k), side="right")
            for p in picks.tolist():
                p = min(p, n - 1)
                if p not in seen:
                    seen.add(p)
                    chosen.append(p)
                    if len(chosen) == k:
                        return sorted(chosen)
        # Rare: k close to the corpus size or an extreme exponent; draw the rest exactly.
        p = self.popularity.copy()
        p[list(seen)] = 0.0
        p /= p.sum()
        rest = rng.choice(n, size=k - len(chosen), replace=False, p=p)
        return sorted(chosen + rest.tolist())

    def _spec(self, index: int) -> RequestSpec:
        rng = _rng(self._s, index, _SALT_RAG_REQUEST)
        pids = self.draw_passages(rng)
        question = _words(rng, self.question_len)
        parts = [self.instruction, *(self.passage(p) for p in pids), question]
        ids = np.concatenate(parts).tolist()
        return RequestSpec(
            index=index,
            input_ids=tuple(ids),
            max_new_tokens=self.config.output_len,
            prefix_group=pids[0],
        )

    def reusable_prefix(self, indices: Sequence[int]) -> np.ndarray:
        # Any earlier request shares the instruction; one that began with the same d passages shares those
        # too (passages are in rank order, so equal leading passage ids are equal leading tokens).
        w: RagWorkloadConfig = self.config
        indices = np.asarray(indices, dtype=np.int64)
        if not indices.size:
            return np.zeros(0, dtype=np.int64)
        pids = self.passages_of(indices)
        depth = np.zeros(indices.size, dtype=np.int64)
        n = len(self._cdf)
        keys = np.zeros(indices.size, dtype=np.int64)
        for d in range(1, self.k + 1):  # each request's first d passages: seen in an earlier request?
            if n**d < 1 << 62:  # the first d ids as one number
                keys = keys * n + pids[:, d - 1]
                depth += repeated(keys)
            else:
                depth += repeated(pids[:, :d])
        shared = np.minimum(w.instruction_len + depth * self.passage_len, w.input_len - 1)
        shared[0] = 0
        return shared

    def passages_of(self, indices: np.ndarray) -> np.ndarray:
        """Each request's passage ids (``draw_passages`` of its generator), for many indices at once: their
        generators' first draws in bulk (``bulk_rng``), a request whose first 2k picks hold fewer than k
        distinct passages drawn again one at a time."""
        k, n = self.k, len(self._cdf)
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size > _BULK_CHUNK:  # a chunk's temporaries reused, not a million rows' fresh each
            return np.concatenate(
                [
                    self.passages_of(indices[at : at + _BULK_CHUNK])
                    for at in range(0, indices.size, _BULK_CHUNK)
                ]
            )
        if indices.size and (indices.min() < 0 or indices.max() > 0xFFFFFFFF):
            return np.array([self.draw_passages(_rng(self._s, int(i), _SALT_RAG_REQUEST)) for i in indices])
        draws = first_doubles([self._s], indices, [_SALT_RAG_REQUEST], 2 * k)
        picks = np.minimum(np.searchsorted(self._cdf, draws, "right"), n - 1)
        chosen = np.full((indices.size, k), -1, dtype=np.int64)
        count = np.zeros(indices.size, dtype=np.int64)
        rows = np.arange(indices.size)
        for j in range(2 * k):  # in draw order, each pick not chosen yet, until k are
            p = picks[:, j]
            take = (count < k) & ~(chosen == p[:, None]).any(axis=1)
            chosen[rows[take], count[take]] = p[take]
            count += take
        for row in np.flatnonzero(count < k).tolist():  # rare: the slow path's later rounds
            chosen[row] = self.draw_passages(_rng(self._s, int(indices[row]), _SALT_RAG_REQUEST))
        chosen.sort(axis=1)
        return chosen


def _lead_pair(perm0: np.ndarray, perm1: np.ndarray, j: int) -> list[int]:
    """Two leading word ids unique for each j in [0, W*W): the low digit first, so even the first
    token differs between any W consecutive j."""
    return [int(perm0[j % NUM_WORDS]), int(perm1[(j // NUM_WORDS) % NUM_WORDS])]


class SharedPrefixGenerator(WorkloadGenerator):
    """bench_serving's generated-shared-prefix: num_groups fixed system prompts plus unique questions.

    Request i belongs to group i % num_groups (round-robin, so any window of num_groups consecutive
    requests covers every group once) and is the (i // num_groups)-th question of its group. The
    system prompt of group g is a function of (seed, g); its first word differs between groups (for up
    to len(WORDS) groups), so groups share no prefix. The question's first two words encode the
    within-group index, so two requests of one group share exactly system_prompt_len leading tokens
    (for up to len(WORDS)**2 requests per group; question_len 1 gives len(WORDS)). prefix_group = g.
    """

    kind = "shared_prefix"

    def __init__(self, profile: Profile):
        super().__init__(profile)
        self._first = _rng(self._s, _SALT_GSP_SYSTEM_FIRST).permutation(NUM_WORDS)
        lead = _rng(self._s, _SALT_GSP_QUESTION_LEAD)
        self._q0 = lead.permutation(NUM_WORDS)
        self._q1 = lead.permutation(NUM_WORDS)
        groups, longest = self.cache_shape()
        self.system_prompt = functools.lru_cache(maxsize=_cache_size(longest, groups))(
            self._make_system_prompt
        )

    def cache_shape(self) -> tuple[int, int]:
        """(groups, the longest system prompt): what the system-prompt cache is sized by."""
        return self.config.num_groups, self.config.system_prompt_len

    def _make_system_prompt(self, group: int) -> np.ndarray:
        ids = _words(_rng(self._s, group, _SALT_GSP_SYSTEM), self.system_len(group))
        ids[0] = self._first[group % NUM_WORDS]
        return ids

    # The hooks a variant of this structure (bench_serving's generated-shared-prefix) overrides: which group
    # and question number request i is, and the lengths.
    def group_of(self, index: int) -> int:
        if self.config.group_order == "random":
            return int(_rng(self._s, index, _SALT_GSP_GROUP).integers(self.config.num_groups))
        return index % self.config.num_groups

    def question_number(self, index: int) -> int:
        """What the question's lead words encode: its number within the group (round robin), or the index
        itself (random order, where that number is not known without counting)."""
        return index // self.config.num_groups if self.config.group_order == "round_robin" else index

    def system_len(self, group: int) -> int:
        return self.config.system_prompt_len

    def lengths(self, index: int) -> tuple[int, int]:
        """(question length, output length) of request ``index``."""
        return self.config.question_len, self.config.output_len

    def _spec(self, index: int) -> RequestSpec:
        group = self.group_of(index)
        question_len, output_len = self.lengths(index)
        rng = _rng(self._s, index, _SALT_GSP_REQUEST)
        question = _words(rng, question_len)
        # The lead words make each question of a group unique.
        lead = _lead_pair(self._q0, self._q1, self.question_number(index))
        n = min(2, question_len)
        question[:n] = lead[:n]
        ids = np.concatenate([self.system_prompt(group), question]).tolist()
        return RequestSpec(index=index, input_ids=tuple(ids), max_new_tokens=output_len, prefix_group=group)

    # The same hooks for many indices at once (the cache-hit bound over a whole run).
    def groups_of(self, indices: np.ndarray) -> np.ndarray:
        if self.config.group_order == "random":
            return first_integers([self._s], indices, [_SALT_GSP_GROUP], [(0, self.config.num_groups - 1)])[
                :, 0
            ]
        return indices % self.config.num_groups

    def question_numbers(self, indices: np.ndarray) -> np.ndarray:
        return indices // self.config.num_groups if self.config.group_order == "round_robin" else indices

    def system_lens(self, groups: np.ndarray) -> np.ndarray:
        distinct, which = np.unique(groups, return_inverse=True)
        return np.array([self.system_len(g) for g in distinct.tolist()], dtype=np.int64)[which.ravel()]

    def question_lens(self, indices: np.ndarray) -> np.ndarray:
        return np.full(indices.size, self.config.question_len, dtype=np.int64)

    def reusable_prefix(self, indices: Sequence[int]) -> np.ndarray:
        # An earlier request of the group shares the system prompt, and one or both lead words of the question
        # when its number agrees modulo W (or W*W); another group whose number agrees modulo W shares the
        # system prompt's first word only. In bulk: "earlier" is "not the first with that key".
        W = NUM_WORDS
        indices = np.asarray(indices, dtype=np.int64)
        if not indices.size:
            return np.zeros(0, dtype=np.int64)
        group, nth = self.groups_of(indices), self.question_numbers(indices)
        system_len, question_len = self.system_lens(group), self.question_lens(indices)
        lead = np.where(
            repeated(group * (W * W) + nth % (W * W)) & (question_len >= 2),
            2,
            repeated(group * W + nth % W).astype(np.int64),
        )
        shared = np.where(repeated(group), system_len + lead, repeated(group % W).astype(np.int64))
        return np.minimum(shared, system_len + question_len - 1)


def shuffled(
    indices: np.ndarray, round_size: int, prefix: list[int], suffix: list[int]
) -> tuple[np.ndarray, np.ndarray]:
    """Requests in rounds of ``round_size``, round r shuffled by ``_rng(*prefix, r, *suffix).permutation``: each
    index's round and place (``order[i % round_size]``), each round's permutation made once."""
    rounds, positions = np.divmod(np.asarray(indices, dtype=np.int64), round_size)
    distinct, which = np.unique(rounds, return_inverse=True)
    which = which.ravel()
    if round_size <= bulk_rng.SHORT:  # short rounds: all their permutations together
        return rounds, permutations(prefix, distinct, suffix, round_size)[which, positions]
    places = np.empty(rounds.size, dtype=np.int64)  # long ones: one held at a time
    by_round = np.argsort(which, kind="stable")
    for k, mine in enumerate(
        np.split(by_round, np.searchsorted(which[by_round], np.arange(1, distinct.size)))
    ):
        places[mine] = permutations(prefix, distinct[k : k + 1], suffix, round_size)[0, positions[mine]]
    return rounds, places


def repeated(keys: np.ndarray) -> np.ndarray:
    """For each key (a number, or a row of a 2-D array), whether an earlier one equals it (True but for each
    value's first place)."""
    out = np.ones(len(keys), dtype=bool)
    out[np.unique(keys, return_index=True, axis=0 if np.ndim(keys) == 2 else None)[1]] = False
    return out


class RandomPrefixGenerator(WorkloadGenerator):
    """Prompts that share nothing from the first token.

    The first two words encode the index through two seed-dependent permutations of the word table
    (word 0 from i % W, word 1 from (i // W) % W, W = len(WORDS)): no two of any W*W consecutive
    requests share their first two tokens, no two of any W consecutive ones even their first token.
    The rest is random per request. Lengths are fixed, or drawn uniformly (inclusive) per request from
    input_len_range / output_len_range when set (a range wins over the fixed length).
    """

    kind = "random_prefix"
    # Variants (bench_serving's random, random-ids) keep their own streams apart with their own salts.
    salt_lead, salt_request = _SALT_RP_LEAD, _SALT_RP_REQUEST

    def __init__(self, profile: Profile):
        super().__init__(profile)
        lead = _rng(self._s, self.salt_lead)
        self._p0 = lead.permutation(NUM_WORDS)
        self._p1 = lead.permutation(NUM_WORDS)

    def lengths(self, rng: np.random.Generator) -> tuple[int, int]:
        """(input, output) length, drawn first from the request's generator."""
        w: RandomPrefixWorkloadConfig = self.config
        if w.input_len_range is not None:
            n_in = int(rng.integers(w.input_len_range[0], w.input_len_range[1] + 1))
        else:
            n_in = w.input_len
        if w.output_len_range is not None:
            n_out = int(rng.integers(w.output_len_range[0], w.output_len_range[1] + 1))
        else:
            n_out = w.output_len
        return n_in, n_out

    def shortest_input(self) -> int:
        w: RandomPrefixWorkloadConfig = self.config
        return w.input_len_range[0] if w.input_len_range is not None else w.input_len

    def body(self, rng: np.random.Generator, index: int, n: int) -> list[int]:
        """The ``n`` words after the two lead words."""
        return _words(rng, n).tolist()

    def _spec(self, index: int) -> RequestSpec:
        rng = _rng(self._s, index, self.salt_request)
        n_in, n_out = self.lengths(rng)
        ids = (_lead_pair(self._p0, self._p1, index) + self.body(rng, index, max(0, n_in - 2)))[:n_in]
        return RequestSpec(index=index, input_ids=tuple(ids), max_new_tokens=n_out, prefix_group=None)

    def reusable_prefix(self, indices: Sequence[int]) -> np.ndarray:
        # Only the two lead words can repeat: the first for indices equal modulo W, both modulo W*W. In bulk
        # (a million indices in milliseconds): an index shares a residue when it is not the first with it.
        W = NUM_WORDS
        indices = np.asarray(indices, dtype=np.int64)
        out = np.zeros(indices.size, dtype=np.int64)
        for words, modulus in ((1, W), (2, W * W)):
            out[repeated(indices % modulus)] = words
        # At most the prompt less one token (the server computes the last): only prompts this short.
        for pos in np.flatnonzero(out >= self.shortest_input()).tolist():
            n_in = self.lengths(_rng(self._s, int(indices[pos]), self.salt_request))[0]
            out[pos] = min(out[pos], n_in - 1)
        return out


_GENERATORS: dict[str, type[WorkloadGenerator]] = {
    g.kind: g for g in (RagGenerator, SharedPrefixGenerator, RandomPrefixGenerator)
}


def register(*generators: type[WorkloadGenerator]) -> type[WorkloadGenerator]:
    """Adds workload kinds defined in modules of their own (they import this one, so this one cannot import
    them; ``loadlab.workload`` imports every such module, so the kinds are known wherever a workload is
    built). Returns the first, so it also serves as a class decorator."""
    for g in generators:
        _GENERATORS[g.kind] = g
    return generators[0]


def quotas(shares: list[float], n: int) -> list[int]:
    """Largest remainder: integer counts summing to ``n``, as close to ``share * n`` as integers can be
    (ties to the class listed first)."""
    exact = [share * n for share in shares]
    counts = [math.floor(x + 1e-9) for x in exact]
    order = sorted(range(len(shares)), key=lambda c: (-(exact[c] - counts[c]), c))
    left = n - sum(counts)
    for c in order[: max(0, left)]:
        counts[c] += 1
    for c in reversed(order):  # only if float slack overshot: take back from the smallest remainders
        if sum(counts) <= n:
            break
        if counts[c] > 0:
            counts[c] -= 1
    return counts


class _Phase:
    """Class assignment over one phase's indices [start, start + n): exactly ``quotas`` of each class, by a
    permutation of the phase's positions seeded by (seed, salt, n)."""

    def __init__(self, seed_word: int, salt: int, start: int, n: int, shares: list[float]):
        self.start, self.n = start, n
        self._key = (seed_word, salt, n)
        self._bounds = np.cumsum(quotas(shares, n)) if n else np.zeros(len(shares), dtype=np.int64)
        self._perm: np.ndarray | None = None

    def class_of(self, index: int) -> int:
        if self._perm is None:  # made on first use: the warm-up of a sweep may never be asked for
            self._perm = _rng(*self._key).permutation(self.n)
        slot = int(self._perm[index - self.start])
        return int(np.searchsorted(self._bounds, slot, side="right"))

    def classes_of(self, indices: np.ndarray) -> np.ndarray:
        """``class_of`` of each of ``indices`` (all in the phase)."""
        if self._perm is None:
            self._perm = _rng(*self._key).permutation(self.n)
        return np.searchsorted(self._bounds, self._perm[indices - self.start], side="right")


class ClassedWorkload:
    """A profile with ``classes``: request i's class, then the spec of that class's workload.

    The class of i is a pure function of (profile, seed, i): warm-up indices [0, warmup) and measured
    indices [warmup, warmup + measured) are each split into exact largest-remainder quotas of the shares,
    assigned to the phase's indices by a permutation seeded with (seed, salt, phase size); an index beyond
    the fixed count (none in a normal run) draws its class from (seed, i, salt). The prompt is the class's
    workload's ``spec(i)``: a class on the profile's workload sends what the profile alone would.
    """

    kind = "classes"

    def __init__(self, profile: Profile):
        self.profile = profile
        self.seed = profile.seed
        self._s = _seed_word(profile.seed)
        self.classes: list[ClassConfig] = list(profile.classes or [])
        shares = [c.share for c in self.classes]
        self._cdf = np.cumsum(shares)
        self._cdf[-1] = 1.0
        base = self.base = _GENERATORS[profile.workload.kind](profile)
        self.generators: list[WorkloadGenerator] = []
        for c in self.classes:
            if c.workload is None or c.workload == profile.workload:
                self.generators.append(base)
            else:
                sub = profile.model_copy(update={"workload": c.workload})
                self.generators.append(_GENERATORS[c.workload.kind](sub))
        warmup, measured = profile.requests.warmup, profile.requests.measured
        self._phases = (
            _Phase(self._s, _SALT_CLASS_WARMUP, 0, warmup, shares),
            _Phase(self._s, _SALT_CLASS_MEASURED, warmup, measured, shares),
        )

    def class_index(self, index: int) -> int:
        """The position in ``classes`` of request ``index``'s class."""
        for phase in self._phases:
            if phase.start <= index < phase.start + phase.n:
                return phase.class_of(index)
        u = _rng(self._s, index, _SALT_CLASS_BEYOND).random()
        return min(int(np.searchsorted(self._cdf, u, side="right")), len(self.classes) - 1)

    def class_of(self, index: int) -> str:
        return self.classes[self.class_index(index)].name

    def spec(self, index: int) -> RequestSpec:
        if isinstance(index, bool) or not isinstance(index, int | np.integer) or index < 0:
            raise ValueError(f"request index must be a non-negative integer (got {index!r})")
        index = int(index)
        c = self.class_index(index)
        cls = self.classes[c]
        return dataclasses.replace(
            self.generators[c].spec(index),
            request_class=cls.name,
            priority=cls.carry.priority,
            class_header=cls.carry.header,
            model=cls.carry.model,
        )

    def specs(self, indices: Iterable[int]) -> Iterator[RequestSpec]:
        for i in indices:
            yield self.spec(i)

    def reusable_prefix(self, indices: Sequence[int]) -> np.ndarray:
        """``WorkloadGenerator.reusable_prefix`` per class workload: each workload's requests among ``indices``
        share only with each other (classes on different workloads are taken to share no prefix)."""
        indices = np.asarray(indices, dtype=np.int64)
        out = np.zeros(indices.size, dtype=np.int64)
        # Each class's workload as a small number (classes on the profile's workload share one).
        first_of = {}
        workload = np.array(
            [first_of.setdefault(id(g), c) for c, g in enumerate(self.generators)], dtype=np.int64
        )
        of = workload[self.class_indices(indices)] if indices.size else workload[:0]
        for key in np.unique(of).tolist():
            positions = np.flatnonzero(of == key)
            out[positions] = self.generators[key].reusable_prefix(indices[positions])
        return out

    def class_indices(self, indices: np.ndarray) -> np.ndarray:
        """``class_index`` of each of ``indices``, the fixed phases' in bulk (a million in milliseconds)."""
        out = np.empty(indices.size, dtype=np.int64)
        done = np.zeros(indices.size, dtype=bool)
        for phase in self._phases:
            mine = (indices >= phase.start) & (indices < phase.start + phase.n)
            if mine.any():
                out[mine] = phase.classes_of(indices[mine])
                done |= mine
        for pos in np.flatnonzero(~done).tolist():  # beyond the fixed counts: none in a normal run
            out[pos] = self.class_index(int(indices[pos]))
        return out

    def source_info(self) -> dict | None:
        return self.base.source_info()

    def __repr__(self) -> str:
        return f"<ClassedWorkload seed={self.seed} {[c.name for c in self.classes]}>"


def build_workload(profile: Profile) -> WorkloadGenerator | ClassedWorkload:
    """The request-spec stream of a validated profile (raises ProfileError for combinations the
    schema cannot check alone)."""
    if profile.classes:
        return ClassedWorkload(profile)
    return _GENERATORS[profile.workload.kind](profile)


def workload_source(workload: WorkloadGenerator | ClassedWorkload) -> WorkloadSource | None:
    """What the manifest records of a workload replayed from a file (its ``source_info()``), else None."""
    info = workload.source_info()
    return WorkloadSource(**info) if info is not None else None
