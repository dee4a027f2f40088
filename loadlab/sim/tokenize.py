"""Text <-> token ids for the simulated server.

By default the sim needs no tokenizer file: one whitespace-separated word is one token, and a word's id is
a stable hash of it (``zlib.crc32(word) % 128000 + 1000``), so the same text always gives the same ids and
repeated text hits the prefix cache. With ``--tokenizer PATH`` (a local ``tokenizer.json``) the
``tokenizers`` package encodes prompts instead (imported only then).

Chat prompts: the content tokens of every message plus a fixed template overhead of 4 tokens per
message and 4 per conversation (``<begin>`` and the assistant header that opens the reply), laid
out like the Llama 3 template: ``<begin> (<hdr> role <end_hdr> content <eot>)* <hdr> assistant <end_hdr>``.
Because the reply is tokenized the same way, a follow-up turn that repeats the reply hits the prefix cache
for the whole history (the sim caches prompt + output when a request ends).

Output: the sim writes words from ``OUTPUT_WORDS``, one word (with a leading space) per output token. Some
words have multi-byte UTF-8 characters (é, ü, 数, an emoji) so clients meet UTF-8 sequences split across
reads. Output token ids are the default tokenizer's ids of those words, whatever tokenizer encodes the
prompts.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

VOCAB_BASE = 1000
VOCAB_SPAN = 128000
# Special ids used by the default chat layout (Llama 3's values).
BEGIN_OF_TEXT = 128000
START_HEADER = 128006
END_HEADER = 128007
END_OF_TURN = 128009

# fmt: off
OUTPUT_WORDS: tuple[str, ...] = (
    "the", "model", "answers", "with", "care", "and", "café", "data", "from", "über", "a", "long",
    "context", "数据", "is", "served", "by", "naïve", "batching", "of", "tokens", "模型", "in", "Zürich",
    "while", "the", "cache", "résumé", "keeps", "prefixes", "warm", "😀", "so", "latency", "stays", "low",
    "東京", "to", "each", "request", "señor", "streams", "text", "as", "it", "goes", "Ωmega", "then",
    "stops",
)
# fmt: on


def word_id(word: str) -> int:
    """The default tokenizer's id for one word."""
    return zlib.crc32(word.encode("utf-8")) % VOCAB_SPAN + VOCAB_BASE


ASSISTANT_ID = word_id("assistant")
OUTPUT_TEXTS: tuple[str, ...] = tuple(" " + w for w in OUTPUT_WORDS)
OUTPUT_IDS: tuple[int, ...] = tuple(word_id(w) for w in OUTPUT_WORDS)


def output_start(prompt_ids: Sequence[int]) -> int:
    """Where in ``OUTPUT_WORDS`` a request's output starts: a function of the prompt (like greedy decoding)."""
    if not prompt_ids:
        return 0
    return (prompt_ids[-1] + len(prompt_ids)) % len(OUTPUT_WORDS)


class Tokenizer:
    """Encodes prompt text. Default: whitespace words hashed to ids; with a path: a tokenizer.json."""

    def __init__(self, path: str | None = None):
        self.path = path
        self._hf = None
        if path:
            try:
                from tokenizers import Tokenizer as HFTokenizer
            except ImportError as e:  # pragma: no cover - depends on the environment
                raise ValueError("--tokenizer needs the 'tokenizers' package (pip install tokenizers)") from e
            try:
                self._hf = HFTokenizer.from_file(path)
            except Exception as e:
                raise ValueError(f"cannot load tokenizer {path!r}: {e}") from e
        self._cache: dict[str, int] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._hf is not None:
            return self._hf.encode(text, add_special_tokens=add_special_tokens).ids
        cache = self._cache
        out = []
        for w in text.split():
            i = cache.get(w)
            if i is None:
                i = word_id(w)
                if len(cache) < 200_000:
                    cache[w] = i
            out.append(i)
        return out

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of a chat conversation (content tokens + a small fixed template overhead)."""
        ids = [BEGIN_OF_TEXT]
        for m in messages:
            role = str(m.get("role", "user"))
            ids.append(START_HEADER)
            ids.append(word_id(role))
            ids.append(END_HEADER)
            ids.extend(self.encode(message_text(m.get("content")), add_special_tokens=False))
            ids.append(END_OF_TURN)
        ids += (START_HEADER, ASSISTANT_ID, END_HEADER)
        return ids


def message_text(content: Any) -> str:
    """A chat message's text: a string, or the text parts of a content list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, dict) and p.get("type") == "text":
                parts.append(str(p.get("text", "")))
            elif isinstance(p, str):
                parts.append(p)
        return " ".join(parts)
    raise ValueError("message content must be a string or a list of content parts")
