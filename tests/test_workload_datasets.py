"""The dataset kind: JSONL and ShareGPT files replayed exactly, lengths counted as the target counts them,
bad files as one-line errors with the line; and the acceptance run through `loadlab run --workers 2`."""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from loadlab.client.protocol import build_body
from loadlab.profile import ProfileError, load_profile, validate_profile
from loadlab.sim.tokenize import Tokenizer as TwinTokenizer
from loadlab.workload import WORDS, Renderer, build_workload, workload_source
from loadlab.workload.datasets import common_prefix

REPO = Path(__file__).resolve().parents[1]
needs_tokenizers = pytest.mark.skipif(
    importlib.util.find_spec("tokenizers") is None, reason="needs the tokenizers package"
)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def dataset(path: Path, api: str = "generate", tokenizer: str | None = None, seed: int = 0, **keys):
    target = {"api": api, **({"tokenizer": tokenizer} if tokenizer else {})}
    return build_workload(validate_profile({"seed": seed, "target": target,
                                            "workload": {"kind": "dataset", "path": str(path), **keys}}))  # fmt: skip


def sentence(rnd: random.Random, n: int) -> str:
    """Text that is not one token per word for a real tokenizer: capitals, punctuation, digits."""
    words = [rnd.choice(WORDS) for _ in range(n)]
    words[0] = words[0].capitalize()
    for k in range(3, n, 7):
        words[k] += rnd.choice([",", ";", "!", "?", " 42", "'s"])
    return " ".join(words) + "."


# ---------------------------------------------------------------- reading


def test_jsonl_prompts_in_file_order_with_their_lengths(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "hello there my friend", "output_len": 5},
        {"text": "the quick brown fox", "max_tokens": 3},
        "",
        {"input_ids": [11, 12, 13, 14, 15], "output_len": 2},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi you"}],
         "output_len": 4},
    ])  # fmt: skip
    w = dataset(f)
    specs = [w.spec(i) for i in range(8)]
    assert [s.input_len for s in specs[:4]] == [4, 4, 5, 4]
    assert [s.max_new_tokens for s in specs[:4]] == [5, 3, 2, 4]
    assert all(specs[i + 4].input_ids == specs[i].input_ids for i in range(4))  # sequential: entry i % n
    assert specs[0].text == "hello there my friend" and not specs[0].raw_ids
    # Without a tokenizer a word is a token, with the ids the twin gives it: a virtual run caches alike.
    assert list(specs[0].input_ids) == TwinTokenizer().encode("hello there my friend")
    assert specs[2].raw_ids and specs[2].input_ids == (11, 12, 13, 14, 15) and specs[2].text is None
    assert specs[3].text == "be brief\nhi you"  # a chat line on a text API: its contents, one per line
    src = workload_source(w)
    assert (src.format, src.entries_read, src.entries, src.filtered) == ("jsonl", 4, 4, {})
    assert "whitespace words" in src.lengths and "token-id prompts" in src.lengths


def test_what_goes_on_the_wire(tmp_path):
    ids = write_jsonl(tmp_path / "ids.jsonl", [{"prompt": "hello there", "output_len": 2},
                                               {"input_ids": [7, 8, 9], "output_len": 2}])  # fmt: skip
    chat = write_jsonl(tmp_path / "chat.jsonl", [
        {"prompt": "hello there", "output_len": 2},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], "output_len": 2},
    ])  # fmt: skip

    def body(api: str, f: Path, i: int) -> dict:
        return orjson.loads(build_body(api, dataset(f, api).spec(i), Renderer(None), "m", "rid")[1])

    # Without a tokenizer /generate sends the text (the server counts it), a file's token ids as they are.
    assert body("generate", ids, 0)["text"] == "hello there" and "input_ids" not in body("generate", ids, 0)
    assert body("generate", ids, 1)["input_ids"] == [7, 8, 9]
    assert body("completions", ids, 0)["prompt"] == "hello there"
    assert body("completions", ids, 1)["prompt"] == [7, 8, 9]
    assert body("chat", chat, 0)["messages"] == [{"role": "user", "content": "hello there"}]
    assert body("chat", chat, 1)["messages"] == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}
    ]  # fmt: skip
    assert dataset(chat, "chat").spec(1).input_len == 3  # chat: the contents' tokens, without the template
    with pytest.raises(
        ProfileError, match=r"ids.jsonl:2: input_ids: token-id prompts cannot be sent as chat"
    ):
        dataset(ids, "chat")


def sharegpt(path: Path, conversations: list) -> Path:
    path.write_text(
        json.dumps([{"id": str(i), "conversations": c} for i, c in enumerate(conversations)], indent=1)
    )
    return path


def turns(*values: str) -> list[dict]:
    return [{"from": "human" if k % 2 == 0 else "gpt", "value": v} for k, v in enumerate(values)]


def test_sharegpt_first_turn_or_every_turn(tmp_path):
    f = sharegpt(tmp_path / "s.json", [
        turns("what is up", "not much really", "ok then", "bye"),
        turns("alone"),
        [{"from": "system", "value": "you help"}, *turns("tell me a story", "once upon a time")],
    ])  # fmt: skip
    first = dataset(f)
    assert [(first.spec(i).text, first.spec(i).max_new_tokens) for i in range(2)] == [
        ("what is up", 3), ("you help", 4),  # bench_serving: the first two turns, whoever speaks them
    ]  # fmt: skip
    src = workload_source(first)
    assert (src.format, src.entries_read, src.entries) == ("sharegpt", 3, 2)
    assert src.filtered == {"conversations with fewer than 2 turns": 1}
    every = dataset(f, turns="every")
    assert [(every.spec(i).text, every.spec(i).max_new_tokens) for i in range(3)] == [
        ("what is up", 3), ("ok then", 1), ("tell me a story", 4),
    ]  # fmt: skip
    assert (
        dataset(f, turns="every", output_len=7).spec(0).max_new_tokens == 7
    )  # bench_serving's --sharegpt-output-len
    empty = sharegpt(tmp_path / "e.json", [turns("a question", ""), turns("another one", "an answer")])
    assert workload_source(dataset(empty)).filtered == {"empty replies": 1}


def test_sampling_is_seeded_and_the_filter_counts_what_it_drops(tmp_path):
    rows = [{"prompt": " ".join(["w"] * (k % 40 + 1)), "output_len": k % 9 + 1} for k in range(100)]
    f = write_jsonl(tmp_path / "p.jsonl", rows)
    seq = dataset(f)
    assert [seq.entry_of(i) for i in range(205)] == [i % 100 for i in range(205)]
    wo = dataset(f, sample="without_replacement", seed=3)
    rounds = [[wo.entry_of(r * 100 + i) for i in range(100)] for r in range(3)]
    assert all(sorted(x) == list(range(100)) for x in rounds) and rounds[0] != rounds[1] != list(range(100))
    assert [dataset(f, sample="without_replacement", seed=3).entry_of(i) for i in range(300)] == sum(
        rounds, []
    )
    assert [dataset(f, sample="without_replacement", seed=4).entry_of(i) for i in range(100)] != rounds[0]
    wr = dataset(f, sample="with_replacement", seed=3)
    drawn = [wr.entry_of(i) for i in range(300)]
    assert len(set(drawn)) < 100 < 300 and drawn == [dataset(f, sample="with_replacement", seed=3).entry_of(i)
                                                    for i in range(300)]  # fmt: skip
    cut = dataset(f, min_input_len=5, max_input_len=30, max_output_len=8)
    src = workload_source(cut)
    assert src.entries == sum(1 for r in rows if 5 <= len(r["prompt"].split()) <= 30 and r["output_len"] <= 8)
    assert src.filtered == {"prompts shorter than min_input_len": 12, "prompts longer than max_input_len": 20,
                            "outputs longer than max_output_len": 8}  # fmt: skip
    assert all(5 <= cut.spec(i).input_len <= 30 and cut.spec(i).max_new_tokens <= 8 for i in range(200))


def test_reusable_prefix_is_the_longest_shared_with_an_earlier_prompt(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p, "output_len": 1} for p in (
        "a b c d e", "a b x", "q r s", "a b c d f g", "q r s",
    )])  # fmt: skip
    # -, a b, -, a b c d, the whole "q r s" but the last token (the server computes it)
    assert dataset(f).reusable_prefix(range(5)).tolist() == [0, 2, 0, 4, 2]


@pytest.mark.parametrize("sample", ["sequential", "without_replacement", "with_replacement"])
def test_the_bound_over_several_rounds_is_the_longest_prefix_of_any_earlier_prompt(tmp_path, sample):
    """Each sampling replays entries again over rounds (computed in bulk); the bound is each prompt's longest
    prefix shared with an earlier one among the indices, but its last token, for a run and a subset."""
    rnd = random.Random(5)
    stems = [" ".join(rnd.choice(WORDS[:4]) for _ in range(rnd.randint(1, 6))) for _ in range(12)]
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p, "output_len": 1} for p in stems])
    w = dataset(f, sample=sample, seed=7)
    for indices in (list(range(40)), [i for i in range(40) if i % 3]):
        prompts = [w.spec(i).input_ids for i in indices]
        truth = [max(0, min(max((common_prefix(p, q) for q in prompts[:n]), default=0), len(p) - 1))
                 for n, p in enumerate(prompts)]  # fmt: skip
        assert w.reusable_prefix(indices).tolist() == truth


@pytest.mark.parametrize(("rows", "message"), [
    (["{not json"], r"p.jsonl:1: \(line\): not JSON"),
    ([{"prompt": "a", "output_len": 1}, "[1, 2]"], r"p.jsonl:2: \(line\): expected a JSON object, got list"),
    ([{"prompt": "a", "output_len": 1}, {"output_len": 3}], r"p.jsonl:2: prompt: each line needs one of prompt, "
     r"text, input_ids, messages, not none"),
    ([{"prompt": "a", "text": "b", "output_len": 1}], r"p.jsonl:1: text: each line needs one of .*not prompt and text"),
    (["", {"prompt": "a b"}], r"p.jsonl:2: output_len: no output length: give the line one of output_len, "
     r"max_tokens, or the workload output_len"),
    ([{"prompt": 3, "output_len": 1}], r"p.jsonl:1: prompt: must be a string, got int"),
    ([{"input_ids": [1, "x"], "output_len": 1}], r"p.jsonl:1: input_ids: must be a list of non-negative"),
    ([{"prompt": "a", "output_len": 0}], r"p.jsonl:1: output_len: must be a positive integer, got 0"),
    ([{"messages": [{"content": "hi"}], "output_len": 1}], r"p.jsonl:1: messages\[0\].role: missing"),
    ([{"prompt": "", "output_len": 1}], r"p.jsonl: workload.path: no prompt is left after the length filter "
     r"\(1 empty prompts\)"),
    ([], r"p.jsonl: workload.path: no prompts in the file"),
])  # fmt: skip
def test_bad_jsonl_is_one_line_with_the_line_number(tmp_path, rows, message):
    f = write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(ProfileError, match=message) as e:
        dataset(f)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(("text", "message"), [
    ('[\n {"conversations": []},\n {"id": 2}\n]', r"s.json:3: conversations: missing"),
    ('[\n {"conversations": [{"from": "human", "value": "a"},\n   {"from": "gpt"}]}\n]',
     r"s.json:2: conversations\[1\].value: missing"),
    ('[\n {"conversations": []}\n {"conversations": []}]', r"s.json:3: \(file\): expected ',' or ']'"),
    ('[\n {"conversations": [}\n]', r"s.json:2: \(file\): not JSON"),
    ('{"conversations": []}', r"s.json:1: \(file\): expected a JSON list of conversations"),
    ('[\n 7\n]', r"s.json:2: \(conversation\): expected an object, got int"),
])  # fmt: skip
def test_bad_sharegpt_is_one_line_with_the_line_number(tmp_path, text, message):
    f = tmp_path / "s.json"
    f.write_text(text)
    fmt = "sharegpt" if text.startswith("{") else "auto"
    with pytest.raises(ProfileError, match=message) as e:
        dataset(f, format=fmt)
    assert "\n" not in str(e.value)


def test_missing_file_and_wrong_format_are_the_profiles_one_line_errors(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text("name: x\nworkload:\n  kind: dataset\n  path: nothere.jsonl\n")
    with pytest.raises(
        ProfileError, match=r"p.yaml:4: workload.path: cannot read '.*nothere.jsonl': no such file"
    ):
        load_profile(p)
    (tmp_path / "d").mkdir()
    p.write_text("workload: {kind: dataset, path: d}\n")
    with pytest.raises(ProfileError, match=r"p.yaml:1: workload.path: cannot read .*: not a file"):
        load_profile(p)
    sharegpt(tmp_path / "s.json", [turns("a", "b")])
    p.write_text("workload: {kind: dataset, path: s.json, format: jsonl}\n")
    prof = load_profile(p)  # relative to the profile file
    assert prof.workload.path == str(tmp_path / "s.json")
    with pytest.raises(
        ProfileError, match=r"s.json:1: \(file\): a JSON list, not JSON lines: set format: sharegpt"
    ):
        build_workload(prof)
    p.write_text("workload: {kind: dataset, path: s.json, sample: shuffle}\n")
    with pytest.raises(ProfileError, match=r"p.yaml:1: workload.sample: Input should be 'sequential'"):
        load_profile(p)
    p.write_text("workload: {kind: dataset, path: s.json}\n")
    with pytest.raises(
        ProfileError, match=r"--input-len: a dataset workload takes its lengths from its file"
    ):
        load_profile(p, {"workload.input_len": 5})
    assert load_profile(p, {"workload.output_len": 5}).workload.output_len == 5
    done = subprocess.run([sys.executable, "-m", "loadlab", "validate", str(p)], capture_output=True, text=True,
                          cwd=REPO, timeout=60)  # fmt: skip
    assert done.returncode == 0 and "1 of 1 sharegpt prompts usable" in done.stdout, done.stderr


@needs_tokenizers
def test_lengths_are_the_tokenizers_with_one(tmp_path, bpe):
    rnd = random.Random(5)
    texts = [sentence(rnd, rnd.randint(3, 40)) for _ in range(30)]
    f = write_jsonl(tmp_path / "p.jsonl", [{"text": t, "output_len": 2} for t in texts])
    tok = bpe[1]
    w = dataset(f, api="completions", tokenizer=bpe[0])
    for i, t in enumerate(texts):
        s = w.spec(i)
        assert list(s.input_ids) == tok.encode(t, add_special_tokens=False).ids and s.raw_ids and s.text == t
    assert sum(w.spec(i).input_len != len(texts[i].split()) for i in range(30)) > 20  # not one per word
    assert "tokens of target.tokenizer" in workload_source(w).lengths
    # /generate then sends the tokenizer's ids: exactly that many prompt tokens.
    body = orjson.loads(
        build_body("generate", dataset(f, tokenizer=bpe[0]).spec(0), Renderer(None), None, "r")[1]
    )
    assert body["input_ids"] == tok.encode(texts[0], add_special_tokens=False).ids


# ---------------------------------------------------------------- acceptance, through loadlab run


def train_bpe(path: Path):
    """A small BPE trained on the word table (as tests/test_end_to_end.py does): many words take several
    tokens, so a word count is far from the token count."""
    import tokenizers

    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    tok.decoder = tokenizers.decoders.Metaspace()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=1200, special_tokens=["[UNK]"], show_progress=False)
    tok.train_from_iterator([" ".join(WORDS[i : i + 40]) for i in range(0, len(WORDS), 7)] * 3, trainer)
    tok.save(str(path))
    return tok


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    pytest.importorskip("tokenizers")
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    return str(path), train_bpe(path)


PROFILE = """\
name: {name}
target:
  url: embedded
  api: {api}
  tokenizer: {tok}
  embedded: {{gpu: h100-80gb, tokenizer: {tok}}}
load: {{model: closed, concurrency: 16}}
requests: {{warmup: 0, measured: {n}}}
workload: {{kind: dataset, path: {path}{extra}}}
"""


def replay(tmp_path: Path, name: str, api: str, tok: str, data: Path, n: int, extra: str = ""):
    profile = tmp_path / f"{name}.yaml"
    profile.write_text(PROFILE.format(name=name, api=api, tok=tok, n=n, path=data, extra=extra))
    done = subprocess.run([sys.executable, "-m", "loadlab", "run", str(profile), "--workers", "2",
                           "--out", str(tmp_path / "runs")], capture_output=True, text=True, cwd=REPO,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    from loadlab.manifest import read_manifest
    from loadlab.records import load_records

    run_dir = Path(done.stdout.strip().splitlines()[-1])
    return load_records(run_dir).sort_values("index"), read_manifest(run_dir), run_dir


@needs_tokenizers
def test_a_500_prompt_jsonl_and_a_sharegpt_file_replay_exactly_through_two_workers(tmp_path, bpe):
    tok_path, tok = bpe

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False).ids)

    rnd = random.Random(15)
    texts = [sentence(rnd, rnd.randint(2, 60)) for _ in range(500)]
    outs = [rnd.randint(1, 3) for _ in range(500)]
    data = write_jsonl(
        tmp_path / "prompts.jsonl", [{"prompt": t, "output_len": o} for t, o in zip(texts, outs, strict=True)]
    )
    records, manifest, run_dir = replay(tmp_path, "jsonl", "completions", tok_path, data, 500)
    assert records["index"].tolist() == list(range(500)) and (records.outcome == "ok").all()
    assert records.worker_id.nunique() == 2  # both workers sent part of the file
    want = [count(t) for t in texts]
    assert records.prompt_tokens.tolist() == want  # the server counted the file's prompt i, for every i
    assert records.input_len.tolist() == want
    assert records.max_new_tokens.tolist() == outs and records.output_tokens.tolist() == outs
    assert sum(w != len(t.split()) for w, t in zip(want, texts, strict=True)) > 400  # tokens, not words
    assert (
        manifest.workload_source.entries == 500
        and "tokens of target.tokenizer" in manifest.workload_source.lengths
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "tokens of target.tokenizer" in summary["prompt_lengths"]
    assert "- Prompt lengths: tokens of target.tokenizer" in (run_dir / "summary.md").read_text()

    # ShareGPT, every human turn, on the chat API: the server adds its chat template (8 tokens for one user
    # message in the twin's Llama-3-like layout) to the prompt's own tokens.
    convs = []
    for k in range(40):
        n = 1 if k % 10 == 3 else rnd.randint(1, 3)  # some conversations are one turn: skipped
        convs.append(turns(*[sentence(rnd, rnd.randint(2, 30)) if j % 2 == 0 else sentence(rnd, rnd.randint(1, 4))
                             for j in range(2 * n - (k % 10 == 3))]))  # fmt: skip
    data = sharegpt(tmp_path / "sharegpt.json", convs)
    pairs = [(c[j]["value"], c[j + 1]["value"]) for c in convs for j in range(0, len(c) - 1, 2)]
    records, manifest, _ = replay(tmp_path, "sharegpt", "chat", tok_path, data, len(pairs), ", turns: every")
    assert manifest.workload_source.filtered == {"conversations with fewer than 2 turns": 4}
    assert records["index"].tolist() == list(range(len(pairs))) and (records.outcome == "ok").all()
    assert records.input_len.tolist() == [count(p) for p, _ in pairs]
    assert (records.prompt_tokens - records.input_len == 8).all()
    assert records.max_new_tokens.tolist() == [count(r) for _, r in pairs]  # each reply's length
