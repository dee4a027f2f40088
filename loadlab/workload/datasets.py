"""The ``dataset`` kind: prompts replayed from a local file (docs/workloads.md).

Two formats:

- JSONL, one prompt per line: ``prompt`` or ``text`` (a string), ``input_ids`` (token ids) or ``messages``
  (chat messages, ``{role, content}``), with an optional output length, ``output_len`` or ``max_tokens``;
- ShareGPT: a JSON list of ``{"conversations": [{"from": ..., "value": ...}, ...]}``; each conversation's
  first turn with the reply after it (bench_serving's ``sharegpt``), or every human turn with its reply.
  A reply gives the output length (its tokens).

The whole file is read, counted and filtered when the workload is built; request i is then a pure function
of (file, profile, i): entry i of the file in order, or a seeded draw with or without replacement, so
distributed workers send exactly the file's requests. Lengths are in tokens of ``target.tokenizer`` when
one is given (exact for it), else in whitespace words (what the twin counts without a tokenizer; for a
real server an estimate). The manifest says which (``workload_source.lengths``).

A file that cannot be used is one ProfileError line naming the file, the line and the field.
"""

from __future__ import annotations

import bisect
import functools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loadlab.profile import DatasetWorkloadConfig, Profile, ProfileError
from loadlab.sim.tokenize import message_text, word_id
from loadlab.workload.bulk_rng import first_integers
from loadlab.workload.generators import WorkloadGenerator, _rng, register, repeated, shuffled
from loadlab.workload.spec import RequestSpec
from loadlab.workload.text import cached_tokenizer

_SALT_DATASET_ORDER = 71  # never change: it fixes which entry each request replays
_SALT_DATASET_DRAW = 72

PROMPT_KEYS = ("prompt", "text", "input_ids", "messages")
OUTPUT_KEYS = ("output_len", "max_tokens")
HUMAN = ("human", "user")  # ShareGPT's speakers whose turns are prompts; every other speaker's are replies


@dataclass(frozen=True, slots=True)
class Raw:
    """One prompt as read: where it starts, what it is, and its reply or output length if the file has one."""

    line: int
    text: str | None = None
    ids: tuple[int, ...] | None = None
    messages: tuple[tuple[str, str], ...] | None = None
    reply: str | None = None
    output_len: int | None = None


@dataclass(frozen=True, slots=True)
class Entry:
    """One prompt as sent: its tokens as counted, what goes on the wire, its output length."""

    line: int
    ids: tuple[int, ...]
    output_len: int
    text: str | None
    messages: tuple[tuple[str, str], ...] | None
    raw_ids: bool


def file_error(path: str, line: int | None, key: str, problem: str) -> ProfileError:
    """One line, ``file:line: key: problem`` (``file: key: problem`` for the file as a whole)."""
    return ProfileError(f"{path}:{line}: {key}: {problem}" if line else f"{path}: {key}: {problem}")


# ---------------------------------------------------------------------------------------------------------
# Reading


def sniff(path: str, text: str) -> str:
    """``sharegpt`` for a file whose first non-blank character is ``[`` (a JSON list), else ``jsonl``."""
    return "sharegpt" if text.lstrip()[:1] == "[" else "jsonl"


def read_text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise file_error(path, None, "workload.path", f"cannot read the file ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise file_error(
            path, None, "workload.path", f"not UTF-8 text ({e.reason} at byte {e.start})"
        ) from None


def jsonl_objects(path: str, text: str) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line; a line that is not a JSON object is an error."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise file_error(path, n, "(line)", f"not JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise file_error(path, n, "(line)", f"expected a JSON object, got {type(obj).__name__}")
        out.append((n, obj))
    return out


_BLANK = re.compile(r"[ \t\n\r]*")


def json_list_items(path: str, text: str) -> list[tuple[int, Any]]:
    """(line where it starts, item) for every item of a top-level JSON list, decoded one at a time so an
    error can say which line."""
    decoder = json.JSONDecoder()
    i = _BLANK.match(text, 0).end()
    if text[i : i + 1] != "[":
        raise file_error(path, 1, "(file)", "expected a JSON list of conversations (ShareGPT format)")
    items: list[tuple[int, Any]] = []
    line, counted = 1, 0
    i = _BLANK.match(text, i + 1).end()
    if text[i : i + 1] == "]":
        return items
    while True:
        line += text.count("\n", counted, i)
        counted = i
        try:
            item, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError as e:
            raise file_error(path, e.lineno, "(file)", f"not JSON ({e.msg} at column {e.colno})") from None
        items.append((line, item))
        i = _BLANK.match(text, end).end()
        if text[i : i + 1] == ",":
            i = _BLANK.match(text, i + 1).end()
            continue
        if text[i : i + 1] == "]":
            return items
        where = line + text.count("\n", counted, i)
        raise file_error(path, where, "(file)", "expected ',' or ']' after a conversation")


def _positive_int(path: str, line: int, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise file_error(path, line, key, f"must be a positive integer, got {value!r}")
    return value


def _messages(path: str, line: int, value: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise file_error(path, line, "messages", "must be a non-empty list of {role, content} objects")
    out = []
    for k, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise file_error(
                path, line, f"messages[{k}].role", "missing: each message needs a role and a content"
            )
        try:
            content = message_text(m.get("content"))
        except ValueError as e:
            raise file_error(path, line, f"messages[{k}].content", str(e)) from None
        out.append((m["role"], content))
    return tuple(out)


def jsonl_prompts(path: str, text: str) -> list[Raw]:
    out = []
    for n, obj in jsonl_objects(path, text):
        given = [k for k in PROMPT_KEYS if k in obj]
        if len(given) != 1:
            problem = f"one of {', '.join(PROMPT_KEYS)}, not " + (" and ".join(given) if given else "none")
            raise file_error(path, n, given[1] if len(given) > 1 else "prompt", f"each line needs {problem}")
        key, value = given[0], obj[given[0]]
        lengths = [k for k in OUTPUT_KEYS if k in obj]
        if len(lengths) > 1:
            raise file_error(path, n, lengths[1], f"give one output length, not {' and '.join(lengths)}")
        output_len = _positive_int(path, n, lengths[0], obj[lengths[0]]) if lengths else None
        if key in ("prompt", "text"):
            if not isinstance(value, str):
                raise file_error(path, n, key, f"must be a string, got {type(value).__name__}")
            out.append(Raw(n, text=value, output_len=output_len))
        elif key == "input_ids":
            if not isinstance(value, list) or not all(type(t) is int and t >= 0 for t in value):
                raise file_error(path, n, key, "must be a list of non-negative integer token ids")
            out.append(Raw(n, ids=tuple(value), output_len=output_len))
        else:
            out.append(Raw(n, messages=_messages(path, n, value), output_len=output_len))
    return out


def sharegpt_prompts(path: str, text: str, turns: str) -> tuple[list[Raw], int]:
    """(prompts, conversations skipped for having fewer than two turns)."""
    out: list[Raw] = []
    items = json_list_items(path, text)
    short = 0
    for line, item in items:
        if not isinstance(item, dict):
            raise file_error(path, line, "(conversation)", f"expected an object, got {type(item).__name__}")
        conv = item.get("conversations", item.get("conversation"))  # bench_serving accepts both names
        if not isinstance(conv, list):
            raise file_error(path, line, "conversations", 'missing: a ShareGPT entry is {"conversations": '
                        '[{"from": "human", "value": ...}, {"from": "gpt", "value": ...}]}')  # fmt: skip
        for k, turn in enumerate(conv):
            if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
                raise file_error(
                    path, line, f"conversations[{k}].value", "missing: each turn needs a string value"
                )
            if turns == "every" and not isinstance(turn.get("from"), str):
                raise file_error(
                    path, line, f"conversations[{k}].from", "missing: every turn needs its speaker"
                )
        if len(conv) < 2:
            short += 1
            continue
        if turns == "first":  # bench_serving's rule: the first two turns, whoever speaks them
            out.append(Raw(line, text=conv[0]["value"], reply=conv[1]["value"]))
            continue
        for k in range(len(conv) - 1):
            if conv[k]["from"].lower() in HUMAN and conv[k + 1]["from"].lower() not in HUMAN:
                out.append(Raw(line, text=conv[k]["value"], reply=conv[k + 1]["value"]))
    return out, short


# ---------------------------------------------------------------------------------------------------------
# Counting


class TokenCounter:
    """Token counts as the target will count them: the tokenizer's (without special tokens), else one per
    whitespace-separated word, with the ids the twin gives those words (so a virtual run caches alike)."""

    def __init__(self, tokenizer_path: str | None):
        self.tokenizer = cached_tokenizer(tokenizer_path) if tokenizer_path else None
        self.exact = self.tokenizer is not None
        self.how = (
            f"tokens of target.tokenizer {tokenizer_path} (exact for that tokenizer)"
            if self.exact
            else "whitespace words, one token each: exact against the embedded twin without a tokenizer, an "
            "estimate for a real server (give target.tokenizer for exact counts)"
        )

    def encode(self, texts: list[str]) -> list[tuple[int, ...]]:
        if self.tokenizer is not None:
            return [tuple(e.ids) for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]
        return [tuple(word_id(w) for w in t.split()) for t in texts]


# ---------------------------------------------------------------------------------------------------------
# The workload


class DatasetGenerator(WorkloadGenerator):
    """Request i replays one entry of the file (after the length filter): entry i % n in file order
    (``sequential``), or perm_r(i % n) of round r = i // n, a seeded permutation per round
    (``without_replacement``: every entry once per round), or a seeded uniform draw (``with_replacement``)."""

    kind = "dataset"

    def __init__(self, profile: Profile):
        super().__init__(profile)
        w: DatasetWorkloadConfig = self.config
        path, api = w.path, profile.target.api
        text = read_text(path)
        fmt = sniff(path, text) if w.format == "auto" else w.format
        filtered: dict[str, int] = {}
        if fmt == "sharegpt":
            raws, short = sharegpt_prompts(path, text, w.turns)
            read = len(raws) + short  # what is read minus what is filtered is what is used, in every format
            if short:
                filtered["conversations with fewer than 2 turns"] = short
        else:
            if sniff(path, text) == "sharegpt":
                raise file_error(
                    path, 1, "(file)", "a JSON list, not JSON lines: set format: sharegpt (or auto)"
                )
            raws = jsonl_prompts(path, text)
            read = len(raws)
        if not raws:
            raise file_error(path, None, "workload.path", "no prompts in the file")
        counter = TokenCounter(profile.target.tokenizer)
        self.entries = self._count(path, api, raws, counter, filtered)
        if not self.entries:
            why = ", ".join(f"{n} {reason}" for reason, n in filtered.items())
            raise file_error(
                path, None, "workload.path", f"no prompt is left after the length filter ({why})"
            )
        self.source = {
            "path": path,
            "format": fmt,
            "entries_read": read,
            "entries": len(self.entries),
            "filtered": filtered,
            "lengths": counter.how if not any(r.ids is not None for r in raws) else
            f"{counter.how}; token-id prompts: their own length (exact)",
        }  # fmt: skip
        self._order = functools.lru_cache(maxsize=4)(self._make_order)

    def _count(
        self, path: str, api: str, raws: list[Raw], counter: TokenCounter, filtered: dict
    ) -> list[Entry]:
        w: DatasetWorkloadConfig = self.config
        # What goes on the wire, and what is counted: chat gets messages (counted as their contents' tokens,
        # without the chat template), the other APIs one text (a chat line's contents joined by newlines).
        sent: list[tuple[str | None, tuple[tuple[str, str], ...] | None]] = []
        for r in raws:
            if r.ids is not None:
                if api == "chat":
                    raise file_error(path, r.line, "input_ids", "token-id prompts cannot be sent as chat messages "
                                "(api: chat): use api generate or completions")  # fmt: skip
                sent.append((None, None))
            elif r.messages is not None:
                joined = "\n".join(c for _, c in r.messages)
                sent.append((None, r.messages) if api == "chat" else (joined, None))
            else:
                sent.append((r.text, (("user", r.text),) if api == "chat" else None))
        pieces: list[str] = []  # every text to count, in one batch
        for r, (text, messages) in zip(raws, sent, strict=True):
            if messages is not None:
                pieces += [c for _, c in messages]
            elif text is not None:
                pieces.append(text)
            if r.reply is not None and w.output_len is None:
                pieces.append(r.reply)
        counted = iter(counter.encode(pieces))
        entries = []
        for r, (text, messages) in zip(raws, sent, strict=True):
            if r.ids is not None:
                ids = r.ids
            elif messages is not None:
                ids = tuple(t for _ in messages for t in next(counted))
            else:
                ids = next(counted)
            reply = len(next(counted)) if r.reply is not None and w.output_len is None else None
            out = next((n for n in (w.output_len, r.output_len, reply) if n is not None), None)
            if out is None:
                raise file_error(path, r.line, "output_len", f"no output length: give the line one of "
                            f"{', '.join(OUTPUT_KEYS)}, or the workload output_len")  # fmt: skip
            reason = self._filtered(len(ids), out)
            if reason:
                filtered[reason] = filtered.get(reason, 0) + 1
                continue
            raw = r.ids is not None or counter.exact  # the target's own token ids: sent as they are
            entries.append(Entry(r.line, ids, out, text, messages, raw))
        return entries

    def _filtered(self, n_in: int, n_out: int) -> str | None:
        w: DatasetWorkloadConfig = self.config
        if n_in < w.min_input_len:
            return "prompts shorter than min_input_len" if w.min_input_len > 1 else "empty prompts"
        if w.max_input_len is not None and n_in > w.max_input_len:
            return "prompts longer than max_input_len"
        if n_out < 1:
            return "empty replies"
        if w.max_output_len is not None and n_out > w.max_output_len:
            return "outputs longer than max_output_len"
        return None

    def _make_order(self, round_: int) -> np.ndarray:
        return _rng(self._s, round_, _SALT_DATASET_ORDER).permutation(len(self.entries))

    def entry_of(self, index: int) -> int:
        """Which entry (position after the filter) request ``index`` replays."""
        n, sample = len(self.entries), self.config.sample
        if sample == "sequential":
            return index % n
        if sample == "without_replacement":
            round_, position = divmod(index, n)
            return int(self._order(round_)[position])
        return int(_rng(self._s, index, _SALT_DATASET_DRAW).integers(n))

    def _spec(self, index: int) -> RequestSpec:
        e = self.entries[self.entry_of(index)]
        return RequestSpec(index=index, input_ids=e.ids, max_new_tokens=e.output_len, text=e.text,
                           messages=e.messages, raw_ids=e.raw_ids)  # fmt: skip

    def entries_of(self, indices: np.ndarray) -> np.ndarray:
        """``entry_of`` many indices at once."""
        n, sample = len(self.entries), self.config.sample
        if sample == "sequential":
            return indices % n
        if sample == "without_replacement":
            return shuffled(indices, n, [self._s], [_SALT_DATASET_ORDER])[1]
        return first_integers([self._s], indices, [_SALT_DATASET_DRAW], [(0, n - 1)])[:, 0]

    def reusable_prefix(self, indices: Sequence[int]) -> np.ndarray:
        # A replayed entry shares its whole prompt (but the last token) with its earlier replay. An entry's
        # first replay: the longest prefix shared with any earlier prompt is shared with a neighbour in sorted
        # order, so the earlier entries are kept sorted and compared with the two around the insertion point.
        indices = np.asarray(indices, dtype=np.int64)
        entry = self.entries_of(indices)
        lengths = np.array([len(e.ids) for e in self.entries], dtype=np.int64)
        out = np.maximum(lengths[entry] - 1, 0)
        earlier: list[tuple[int, ...]] = []
        for position in np.flatnonzero(~repeated(entry)).tolist():
            ids = self.entries[entry[position]].ids
            at = bisect.bisect_left(earlier, ids)
            best = max(
                (common_prefix(ids, earlier[j]) for j in (at - 1, at) if 0 <= j < len(earlier)), default=0
            )
            out[position] = max(0, min(best, len(ids) - 1))
            earlier.insert(at, ids)
        return out

    def source_info(self) -> dict[str, Any]:
        return self.source


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """How many leading tokens two prompts share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n


register(DatasetGenerator)
