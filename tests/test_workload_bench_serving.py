"""bench_serving's datasets as workload kinds: its names, its length distributions exactly, its structure."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from loadlab.profile import ProfileError, load_profile, validate_profile
from loadlab.workload import NUM_WORDS, build_workload
from loadlab.workload.bench_serving import length_range


def workload(seed: int = 0, **section):
    return build_workload(validate_profile({"seed": seed, "workload": section}))


def lengths(w, n: int) -> tuple[np.ndarray, np.ndarray]:
    specs = [w.spec(i) for i in range(n)]
    return np.array([s.input_len for s in specs]), np.array([s.max_new_tokens for s in specs])


def test_length_range_is_bench_servings():
    # max(1, int(L x ratio)) to L, both included
    assert length_range(1024, 0.0) == (1, 1024)
    assert length_range(1024, 0.5) == (512, 1024)
    assert length_range(1000, 0.333) == (333, 1000)
    assert length_range(1024, 1.0) == (1024, 1024)
    assert length_range(3, 0.5) == (1, 3)


@pytest.mark.parametrize("kind", ["random", "random-ids"])
@pytest.mark.parametrize(
    ("full_in", "full_out", "ratio"), [(1024, 256, 0.5), (300, 40, 0.25), (64, 8, 0.0), (128, 16, 1.0)]
)
def test_random_lengths_are_uniform_over_bench_servings_bounds(kind, full_in, full_out, ratio):
    w = workload(3, kind=kind, random_input_len=full_in, random_output_len=full_out, random_range_ratio=ratio)
    n = 4000
    ins, outs = lengths(w, n)
    (lo_in, hi_in), (lo_out, hi_out) = length_range(full_in, ratio), length_range(full_out, ratio)
    # Every draw inside the bounds, and both ends reached: the bounds themselves, exactly.
    assert ins.min() == lo_in and ins.max() == hi_in
    assert outs.min() == lo_out and outs.max() == hi_out
    # Uniform: every value about equally often (a chi-square-like bound on the counts).
    for values, lo, hi in ((ins, lo_in, hi_in), (outs, lo_out, hi_out)):
        if lo == hi:
            assert (values == hi).all()
            continue
        counts = np.bincount(values - lo, minlength=hi - lo + 1)
        expected = n / (hi - lo + 1)
        if hi - lo < 200:
            assert counts.min() > 0
        assert abs(values.mean() - (lo + hi) / 2) < 4 * (hi - lo + 1) / np.sqrt(12 * n)
        if hi - lo + 1 <= 40:  # few values: each count near n / values
            assert np.all(np.abs(counts - expected) < 5 * np.sqrt(expected)), counts


def test_random_default_ratio_zero_spans_one_to_L():
    w = workload(0, kind="random", random_input_len=50, random_output_len=20)  # bench_serving's default 0.0
    ins, outs = lengths(w, 3000)
    assert (ins.min(), ins.max(), outs.min(), outs.max()) == (1, 50, 1, 20)
    # A one-token prompt is the first lead word alone, still unique among len(WORDS) consecutive requests.
    ones = [w.spec(i) for i in range(3000) if w.spec(i).input_len == 1]
    assert ones and len({s.input_ids for s in ones}) == len(ones)


def test_random_prompts_share_no_prefix_and_random_ids_are_consecutive():
    r = workload(1, kind="random", random_input_len=200, random_output_len=4, random_range_ratio=1.0)
    ids = workload(1, kind="random-ids", random_input_len=200, random_output_len=4, random_range_ratio=1.0)
    a, b = r.spec(5).input_ids, ids.spec(5).input_ids
    assert len(a) == len(b) == 200 and a != b
    # random-ids: bench_serving's (offset + i + j) % vocab after the two lead words
    body = np.array(b[2:])
    assert np.all(np.diff(body) % NUM_WORDS == 1)
    assert len({s.input_ids[:2] for s in (r.spec(i) for i in range(1500))}) == 1500
    # The first lead word repeats only len(WORDS) requests later, and then alone.
    assert r.reusable_prefix(range(1500)).max() == 0 and r.reusable_prefix(range(1501)).max() == 1


def test_generated_shared_prefix_is_bench_servings_set_shuffled():
    G, P = 6, 4
    w = workload(2, kind="generated-shared-prefix", gsp_num_groups=G, gsp_prompts_per_group=P,
                 gsp_system_prompt_len=40, gsp_question_len=9, gsp_output_len=5)  # fmt: skip
    specs = [w.spec(i) for i in range(3 * G * P)]
    assert all(s.input_len == 49 and s.max_new_tokens == 5 for s in specs)
    for r in range(3):  # each round of G x P requests: every group's P questions once
        round_ = specs[r * G * P : (r + 1) * G * P]
        assert Counter(s.prefix_group for s in round_) == dict.fromkeys(range(G), P)
    order = [s.prefix_group for s in specs[: G * P]]
    assert order != sorted(order) and order != [i % G for i in range(G * P)]  # shuffled, not round robin
    # A group's requests share exactly its system prompt; groups share nothing; questions are unique.
    by_group: dict[int, list] = {}
    for s in specs:
        by_group.setdefault(s.prefix_group, []).append(s.input_ids)
    for prompts in by_group.values():
        assert {p[:40] for p in prompts} == {prompts[0][:40]} and len({p[40:] for p in prompts}) == len(
            prompts
        )
    assert len({prompts[0][0] for prompts in by_group.values()}) == G
    shared = w.reusable_prefix(range(len(specs)))
    firsts = {specs.index(next(s for s in specs if s.prefix_group == g)) for g in range(G)}
    assert all(shared[i] == (0 if i in firsts else 40) for i in range(len(specs))), shared.tolist()


def test_generated_shared_prefix_range_ratio():
    w = workload(0, kind="generated-shared-prefix", gsp_num_groups=50, gsp_prompts_per_group=8,
                 gsp_system_prompt_len=100, gsp_question_len=20, gsp_output_len=10, gsp_range_ratio=0.5)  # fmt: skip
    specs = [w.spec(i) for i in range(400)]
    system = {}
    for s in specs:
        system.setdefault(s.prefix_group, set()).add(w.system_len(s.prefix_group))
    assert all(len(v) == 1 for v in system.values())  # one length per group
    sys_lens = np.array([next(iter(v)) for v in system.values()])
    assert sys_lens.min() >= 50 and sys_lens.max() <= 100 and len(set(sys_lens)) > 10
    q = np.array([s.input_len - w.system_len(s.prefix_group) for s in specs])
    out = np.array([s.max_new_tokens for s in specs])
    assert (q.min(), q.max(), out.min(), out.max()) == (10, 20, 5, 10)


def test_defaults_are_bench_servings():
    r = validate_profile({"workload": {"kind": "random"}}).workload
    assert (r.random_input_len, r.random_output_len, r.random_range_ratio) == (1024, 1024, 0.0)
    g = validate_profile({"workload": {"kind": "generated-shared-prefix"}}).workload
    assert (g.gsp_num_groups, g.gsp_prompts_per_group, g.gsp_system_prompt_len, g.gsp_question_len,
            g.gsp_output_len, g.gsp_range_ratio) == (64, 16, 2048, 128, 256, 1.0)  # fmt: skip


def test_length_flags_map_to_bench_servings_names_and_mistakes_are_one_line(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text("workload:\n  kind: random\n  random_range_ratio: 1.5\n")
    with pytest.raises(
        ProfileError, match=r"p.yaml:3: workload.random_range_ratio: .*less than or equal to 1"
    ):
        load_profile(p)
    p.write_text("workload: {kind: random-ids}\n")
    prof = load_profile(p, {"workload.input_len": 77, "workload.output_len": 9})
    assert (prof.workload.random_input_len, prof.workload.random_output_len) == (77, 9)
    p.write_text("workload: {kind: generated-shared-prefix}\n")
    assert load_profile(p, {"workload.output_len": 9}).workload.gsp_output_len == 9
    with pytest.raises(
        ProfileError, match="--input-len: a generated-shared-prefix workload takes its lengths"
    ):
        load_profile(p, {"workload.input_len": 9})
