"""Workloads: deterministic request specs with exact lengths, and prompt rendering for the wire."""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from loadlab.profile import ProfileError, validate_profile
from loadlab.workload import (
    NUM_WORDS,
    TOKEN_ID_BASE,
    WORDS,
    Renderer,
    RenderError,
    build_workload,
)

REPO = Path(__file__).resolve().parents[1]
needs_tokenizers = pytest.mark.skipif(
    importlib.util.find_spec("tokenizers") is None, reason="needs the tokenizers package"
)


def workload(seed: int = 0, **section):
    return build_workload(validate_profile({"seed": seed, "workload": section}))


RAG = {"kind": "rag", "input_len": 1024, "output_len": 64}
GSP = {
    "kind": "shared_prefix",
    "num_groups": 8,
    "system_prompt_len": 300,
    "question_len": 20,
    "output_len": 7,
}
RP = {"kind": "random_prefix", "input_len": 256, "output_len": 16}
RP_RANGE = {"kind": "random_prefix", "input_len_range": [2, 40], "output_len_range": [1, 5]}
KINDS = [RAG, GSP, RP, RP_RANGE]


# ---------------------------------------------------------------- words


def test_word_table():
    assert 1000 <= NUM_WORDS == len(WORDS) <= 2000
    assert len(set(WORDS)) == len(WORDS)
    assert all(w.isascii() and w.isalpha() and w.islower() for w in WORDS)


# ---------------------------------------------------------------- determinism


@pytest.mark.parametrize("section", KINDS, ids=lambda s: s["kind"] + str(len(s)))
def test_spec_is_a_pure_function_of_profile_seed_index(section):
    a = workload(5, **section)
    forward = [a.spec(i) for i in range(60)]
    b = workload(5, **section)  # a fresh instance (another process), asked in another order
    backward = {i: b.spec(i) for i in reversed(range(60))}
    assert forward == [backward[i] for i in range(60)]
    assert [a.spec(i) for i in (59, 3, 3, 0)] == [forward[i] for i in (59, 3, 3, 0)]
    assert all(s.index == i for i, s in enumerate(forward))
    assert all(0 <= t < NUM_WORDS for s in forward for t in s.input_ids)
    other = workload(6, **section)
    assert sum(other.spec(i).input_ids != forward[i].input_ids for i in range(60)) == 60


def test_same_specs_in_another_process():
    code = (
        "import json, sys; from loadlab.profile import validate_profile; "
        "from loadlab.workload import build_workload; "
        "sections = json.loads(sys.argv[1]); "
        "print(json.dumps([[list(build_workload(validate_profile({'seed': 11, 'workload': s})).spec(i).input_ids) "
        "for i in (0, 7, 123)] for s in sections]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(KINDS)], capture_output=True, text=True, check=True, cwd=REPO
    ).stdout
    here = [[list(workload(11, **s).spec(i).input_ids) for i in (0, 7, 123)] for s in KINDS]
    assert json.loads(out) == here


def test_negative_seed_and_numpy_index():
    w = workload(-3, **RP)
    assert w.spec(np.int64(4)) == w.spec(4)
    assert w.spec(4) != workload(3, **RP).spec(4)
    with pytest.raises(ValueError):
        w.spec(-1)


def test_spec_speed():
    for section in (RAG, RP):
        w = workload(1, **section)
        w.spec(0)
        n = 500
        start = time.perf_counter()
        for i in range(n):
            w.spec(i)
        per = (time.perf_counter() - start) / n
        print(f"{section['kind']}: {per * 1e6:.0f} us per 1024/256-token spec")
        assert per < 0.02  # generous: the target is well under 1 ms


# ---------------------------------------------------------------- lengths


@pytest.mark.parametrize("input_len", [1024, 1000, 77, 56])
def test_rag_lengths_exact(input_len):
    w = workload(2, kind="rag", input_len=input_len, output_len=9, instruction_len=48, question_len=4)
    for i in range(50):
        s = w.spec(i)
        assert s.input_len == input_len and s.max_new_tokens == 9


def test_fixed_lengths():
    for i in range(30):
        assert workload(**RP).spec(i).input_len == 256
        assert workload(**RP).spec(i).max_new_tokens == 16
        assert workload(**GSP).spec(i).input_len == 320
        assert workload(**GSP).spec(i).max_new_tokens == 7


def test_random_prefix_ranges_inclusive_and_range_wins():
    w = workload(0, kind="random_prefix", input_len=100, input_len_range=[2, 6], output_len_range=[3, 4])
    specs = [w.spec(i) for i in range(400)]
    assert {s.input_len for s in specs} == {2, 3, 4, 5, 6}
    assert {s.max_new_tokens for s in specs} == {3, 4}
    assert all(s.prefix_group is None for s in specs)


# ---------------------------------------------------------------- structure


def test_rag_structure_and_zipf_skew():
    w = workload(7, **RAG)
    k, plen = w.k, w.passage_len
    assert k == 4 and plen == (1024 - 48 - 32) // 4
    corpus = {tuple(w.passage(p).tolist()): p for p in range(w.config.corpus_size)}
    assert len(corpus) == w.config.corpus_size
    counts: Counter[int] = Counter()
    for i in range(2000):
        s = w.spec(i)
        ids = s.input_ids
        assert ids[:48] == tuple(w.instruction.tolist())
        found = []
        for j in range(k):
            chunk = ids[48 + j * plen : 48 + (j + 1) * plen]
            found.append(corpus[chunk])
        assert found == sorted(set(found))  # distinct, most popular first
        assert s.prefix_group == found[0]
        counts.update(found)
    median_passage = w.config.corpus_size // 2
    assert counts[0] > 500
    assert counts[0] > 20 * max(1, counts[median_passage])
    assert counts[0] > counts[10] > counts[median_passage]


def test_rag_passage_content_depends_on_seed_and_id_only():
    a, b = workload(3, **RAG), workload(3, **RAG)
    assert np.array_equal(a.passage(17), b.passage(17))
    assert not np.array_equal(a.passage(17), a.passage(18))
    assert not np.array_equal(a.passage(17), workload(4, **RAG).passage(17))


def test_rag_small_corpus_uses_exact_draw():
    w = workload(0, kind="rag", input_len=200, passages_per_prompt=10, corpus_size=10, zipf_s=3.0)
    for i in range(20):
        s = w.spec(i)
        assert s.input_len == 200 and s.prefix_group == 0  # all ten passages, in rank order
    with pytest.raises(ProfileError, match="passages_per_prompt"):
        workload(0, kind="rag", input_len=200, passages_per_prompt=11, corpus_size=10)


def test_shared_prefix_groups():
    w = workload(1, **GSP)
    specs = [w.spec(i) for i in range(8 * 30)]
    for s in specs:
        assert s.prefix_group == s.index % 8
    by_group: dict[int, list] = {}
    for s in specs:
        by_group.setdefault(s.prefix_group, []).append(s.input_ids)
    for prompts in by_group.values():
        head = prompts[0][:300]
        assert all(p[:300] == head for p in prompts)
        assert len({p[300] for p in prompts}) == len(prompts)  # differ right after the system prompt
    firsts = {g: ps[0][0] for g, ps in by_group.items()}
    assert len(set(firsts.values())) == 8  # groups share no prefix at all


def test_random_prefix_first_two_tokens_unique():
    w = workload(9, **RP_RANGE)
    pairs = [w.spec(i).input_ids[:2] for i in range(5000)]
    assert len(set(pairs)) == 5000
    firsts = [p[0] for p in pairs[:NUM_WORDS]]
    assert len(set(firsts)) == NUM_WORDS  # any W consecutive requests differ in the first token
    assert pairs != [workload(10, **RP_RANGE).spec(i).input_ids[:2] for i in range(5000)]


# ---------------------------------------------------------------- rendering without a tokenizer


def test_renderer_without_tokenizer():
    r = Renderer(None)
    ids = workload(0, **RP).spec(3).input_ids
    text = r.text(ids)
    assert len(text.split(" ")) == len(ids) and "  " not in text
    assert text.split() == [WORDS[i] for i in ids]
    assert r.token_ids(ids) == [TOKEN_ID_BASE + i for i in ids]
    assert not r.exact and r.text([]) == ""


# ---------------------------------------------------------------- rendering with a tokenizer


def _corpus(n_lines: int = 800, seed: int = 0) -> list[str]:
    rnd = random.Random(seed)
    return [" ".join(rnd.choice(WORDS) for _ in range(40)) for _ in range(n_lines)]


def _bpe(path, vocab_size: int, pre=None) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre or pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    lines = _corpus()
    if pre is not None:
        lines = [line + " of the of the" for line in lines]
    tok.train_from_iterator(lines, trainer)
    tok.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory):
    """A GPT-style byte-level BPE trained on the word table (most " word"s are one token)."""
    return _bpe(tmp_path_factory.mktemp("tok") / "tokenizer.json", 3000)


def _count(path: str, text: str) -> int:
    from tokenizers import Tokenizer

    return len(Tokenizer.from_file(path).encode(text, add_special_tokens=False).ids)


@needs_tokenizers
@pytest.mark.parametrize("section", KINDS, ids=lambda s: s["kind"] + str(len(s)))
def test_text_has_exact_token_count_with_tokenizer(bpe_path, section):
    r = Renderer(bpe_path)
    assert r.exact and len(r.usable) >= 256
    w = workload(4, **section)
    for i in range(12):
        ids = w.spec(i).input_ids
        text = r.text(ids)
        assert _count(bpe_path, text) == len(ids)
        tids = r.token_ids(ids)
        assert len(tids) == len(ids)
        assert tids[1:] == [r._token_ids[i] for i in ids[1:]]


@needs_tokenizers
@pytest.mark.parametrize("n", [1, 2, 3, 17, 256, 1000])
def test_text_lengths_with_tokenizer(bpe_path, n):
    r = Renderer(bpe_path)
    for start in (0, 500, 1499):
        ids = [(start + 37 * j) % NUM_WORDS for j in range(n)]
        assert _count(bpe_path, r.text(ids)) == n


@needs_tokenizers
def test_tokenizer_directory_and_token_ids_are_single_words(bpe_path):
    from tokenizers import Tokenizer

    r = Renderer(str(__import__("pathlib").Path(bpe_path).parent))  # a directory holding tokenizer.json
    tok = Tokenizer.from_file(bpe_path)
    for wid in r.usable[:50]:
        assert tok.decode(r.token_ids([wid])) == " " + WORDS[wid]


@needs_tokenizers
def test_word_level_tokenizer_is_exact(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "wl.json"
    tok.save(str(path))
    r = Renderer(str(path))
    assert len(r.usable) == NUM_WORDS
    ids = workload(0, **RAG).spec(0).input_ids
    assert r.text(ids) == Renderer(None).text(ids)
    assert r.token_ids(ids) == [i + 1 for i in ids]


@needs_tokenizers
def test_fix_up_when_words_merge(tmp_path):
    """A tokenizer that merges "of the" into one token: the text is repaired to the exact length."""
    from tokenizers import Regex, pre_tokenizers

    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r" ?of the| ?[a-z]+"), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    path = _bpe(tmp_path / "merge.json", 3000, pre=pre)
    assert _count(path, "x of the") == 2
    r = Renderer(path)
    of, the = WORDS.index("of"), WORDS.index("the")
    for n in (3, 4, 9, 50):
        ids = [5] + [of, the] * ((n - 1) // 2) + [7] * ((n - 1) % 2)
        assert _count(path, r.text(ids)) == n


@needs_tokenizers
def test_unfixable_text_raises(bpe_path, monkeypatch):
    r = Renderer(bpe_path)
    monkeypatch.setattr(r, "_encode", lambda text: [0] * 10_000)
    with pytest.raises(RenderError, match="exactly 5 tokens"):
        r.text([1, 2, 3, 4, 5])


@needs_tokenizers
def test_too_few_usable_words(tmp_path):
    path = _bpe(tmp_path / "tiny.json", 300)
    with pytest.raises(ProfileError, match=r"need at least 256"):
        Renderer(path)


@needs_tokenizers
@pytest.mark.parametrize("content", [None, "not json", '{"version": "1.0"}'])
def test_bad_tokenizer_path_is_one_line_profile_error(tmp_path, content):
    path = tmp_path / "x.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ProfileError) as info:
        Renderer(str(path))
    msg = str(info.value)
    assert msg.startswith(f"target.tokenizer: cannot load tokenizer file '{path}': ")
    assert "\n" not in msg and len(msg) > len(f"target.tokenizer: cannot load tokenizer file '{path}': ")


def test_missing_tokenizers_package(monkeypatch, tmp_path):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "tokenizers":
            raise ImportError("no tokenizers")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ProfileError, match=r"pip install 'loadlab\[tokenizer\]'"):
        Renderer(str(tmp_path / "t.json"))


def test_shared_prefix_random_group_order():
    # Groups drawn per request from (seed, i): about equally often, no round-robin pattern, and still the
    # shared-prefix guarantees (same system prompt within a group, unique questions, pure in i).
    w = workload(1, **{**GSP, "group_order": "random"})
    specs = [w.spec(i) for i in range(8 * 200)]
    groups = [s.prefix_group for s in specs]
    counts = np.bincount(groups, minlength=8)
    assert counts.min() > 0.75 * 200 and counts.max() < 1.25 * 200  # binomial(1600, 1/8): sd ~13
    assert sum(g == i % 8 for i, g in enumerate(groups)) < 0.25 * len(groups)  # not round robin
    by_group: dict[int, list] = {}
    for s in specs:
        by_group.setdefault(s.prefix_group, []).append(s.input_ids)
    for prompts in by_group.values():
        assert all(p[:300] == prompts[0][:300] for p in prompts)
        assert len({p[300:302] for p in prompts}) == len(prompts)  # every question unique
    again = workload(1, **{**GSP, "group_order": "random"})
    assert [again.spec(i) for i in (1599, 3, 800)] == [specs[1599], specs[3], specs[800]]
