"""SGLang bench_serving's synthetic datasets as workload kinds, under its names and with its length
distributions, so an old bench_serving experiment can be rerun here and compared (docs/workloads.md).

- ``random`` / ``random-ids`` (``--random-input-len``, ``--random-output-len``, ``--random-range-ratio``):
  each request's input length uniform (inclusive) from max(1, int(L x ratio)) to L, its output length from
  max(1, int(O x ratio)) to O. ``random`` fills the prompt with random words (bench_serving: ShareGPT text
  cut to length), ``random-ids`` with consecutive ids from a random offset (bench_serving's
  ``(offset + i + j) % vocab``). Both begin with the two lead words that keep every prompt's prefix
  unique (``random_prefix``): with only len(WORDS) ids, prompts that began alike would share a cached prefix
  by accident.
- ``generated-shared-prefix`` (``--gsp-*``): ``gsp_num_groups`` system prompts, ``gsp_prompts_per_group``
  questions each, shuffled as bench_serving shuffles them; the structure is ``shared_prefix``'s.
"""

from __future__ import annotations

import functools

import numpy as np

from loadlab.profile import GeneratedSharedPrefixWorkloadConfig, Profile, RandomWorkloadConfig
from loadlab.workload.bulk_rng import first_integers
from loadlab.workload.generators import (
    RandomPrefixGenerator,
    SharedPrefixGenerator,
    _rng,
    register,
    shuffled,
)
from loadlab.workload.words import NUM_WORDS

# Salts: never change them (that changes every prompt of these kinds for a given seed).
_SALT_RANDOM_LEAD = 51
_SALT_RANDOM_REQUEST = 52
_SALT_RANDOM_IDS_LEAD = 53
_SALT_RANDOM_IDS_REQUEST = 54
_SALT_GSP_ORDER = 61
_SALT_GSP_SYSTEM_LEN = 62
_SALT_GSP_LENGTHS = 63


def length_range(full: int, ratio: float) -> tuple[int, int]:
    """bench_serving's range of a length: max(1, int(full x ratio)) to full, both included."""
    return max(1, int(full * ratio)), full


def _draw(rng: np.random.Generator, full: int, ratio: float) -> int:
    low, high = length_range(full, ratio)
    return int(rng.integers(low, high + 1)) if low < high else high


class RandomGenerator(RandomPrefixGenerator):
    """bench_serving's ``random``: lengths from its ranges, random words after the two lead words.

    Unlike bench_serving's older rule (outputs from int(O x ratio), so 0 with the default ratio 0), an output
    is at least one token, as in newer bench_serving: a request without output has no first token to time.
    """

    kind = "random"
    salt_lead, salt_request = _SALT_RANDOM_LEAD, _SALT_RANDOM_REQUEST

    def lengths(self, rng: np.random.Generator) -> tuple[int, int]:
        w: RandomWorkloadConfig = self.config
        return _draw(rng, w.random_input_len, w.random_range_ratio), _draw(
            rng, w.random_output_len, w.random_range_ratio
        )

    def shortest_input(self) -> int:
        w: RandomWorkloadConfig = self.config
        return length_range(w.random_input_len, w.random_range_ratio)[0]


class RandomIdsGenerator(RandomGenerator):
    """bench_serving's ``random-ids``: the same lengths; consecutive word ids from a random offset."""

    kind = "random-ids"
    salt_lead, salt_request = _SALT_RANDOM_IDS_LEAD, _SALT_RANDOM_IDS_REQUEST

    def body(self, rng: np.random.Generator, index: int, n: int) -> list[int]:
        offset = int(rng.integers(NUM_WORDS))
        return ((offset + index + np.arange(n)) % NUM_WORDS).tolist()


class GeneratedSharedPrefixGenerator(SharedPrefixGenerator):
    """bench_serving's ``generated-shared-prefix``: G groups x P questions, in a shuffled order.

    bench_serving builds the G x P prompts (group g's questions after its system prompt) and shuffles them.
    Here requests come in rounds of N = G x P: request i is slot perm_r(i % N) of round r = i // N, a seeded
    permutation per round, and slot s is question (s % P) of group s // P. So each round sends every group's
    P questions once in a random order, as one bench_serving run does; later rounds ask new questions of the
    same groups. With ``gsp_range_ratio`` below 1 (newer bench_serving) each group's system prompt length and
    each request's question and output lengths are drawn from their ranges.
    """

    kind = "generated-shared-prefix"

    def __init__(self, profile: Profile):
        w: GeneratedSharedPrefixWorkloadConfig = profile.workload
        self.groups, self.per_group = w.gsp_num_groups, w.gsp_prompts_per_group
        self.round_size = self.groups * self.per_group
        self._order = functools.lru_cache(maxsize=4)(self._make_order)
        super().__init__(profile)
        self._system_lens = functools.lru_cache(maxsize=None)(self._make_system_len)

    def cache_shape(self) -> tuple[int, int]:
        return self.groups, self.config.gsp_system_prompt_len

    def _make_order(self, round_: int) -> np.ndarray:
        return _rng(self._s, round_, _SALT_GSP_ORDER).permutation(self.round_size)

    def _slot(self, index: int) -> tuple[int, int]:
        round_, position = divmod(index, self.round_size)
        return round_, int(self._order(round_)[position])

    def group_of(self, index: int) -> int:
        return self._slot(index)[1] // self.per_group

    def question_number(self, index: int) -> int:
        round_, slot = self._slot(index)
        return round_ * self.per_group + slot % self.per_group

    def _slots(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``_slot`` of many indices: their rounds and slots."""
        return shuffled(indices, self.round_size, [self._s], [_SALT_GSP_ORDER])

    def groups_of(self, indices: np.ndarray) -> np.ndarray:
        return self._slots(indices)[1] // self.per_group

    def question_numbers(self, indices: np.ndarray) -> np.ndarray:
        rounds, slots = self._slots(indices)
        return rounds * self.per_group + slots % self.per_group

    def question_lens(self, indices: np.ndarray) -> np.ndarray:
        w: GeneratedSharedPrefixWorkloadConfig = self.config
        if w.gsp_range_ratio == 1:
            return np.full(indices.size, w.gsp_question_len, dtype=np.int64)
        # ``lengths``' two draws (a range of one length draws nothing, as ``_draw`` doesn't).
        ranges = [
            length_range(w.gsp_question_len, w.gsp_range_ratio),
            length_range(w.gsp_output_len, w.gsp_range_ratio),
        ]
        return first_integers([self._s], indices, [_SALT_GSP_LENGTHS], ranges)[:, 0]

    def _make_system_len(self, group: int) -> int:
        w: GeneratedSharedPrefixWorkloadConfig = self.config
        return _draw(_rng(self._s, group, _SALT_GSP_SYSTEM_LEN), w.gsp_system_prompt_len, w.gsp_range_ratio)

    def system_len(self, group: int) -> int:
        return self._system_lens(group)

    def lengths(self, index: int) -> tuple[int, int]:
        w: GeneratedSharedPrefixWorkloadConfig = self.config
        if w.gsp_range_ratio == 1:
            return w.gsp_question_len, w.gsp_output_len
        rng = _rng(self._s, index, _SALT_GSP_LENGTHS)
        return _draw(rng, w.gsp_question_len, w.gsp_range_ratio), _draw(
            rng, w.gsp_output_len, w.gsp_range_ratio
        )


register(RandomGenerator, RandomIdsGenerator, GeneratedSharedPrefixGenerator)
