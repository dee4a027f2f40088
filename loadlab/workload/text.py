"""Rendering word-id prompts for the wire: token ids for native /generate, text for the OpenAI APIs.

Without a tokenizer:
  * ``token_ids``: word id w becomes token id ``TOKEN_ID_BASE + w`` (1000..2499): ordinary ids, below
    any real model's vocabulary size and clear of the low ids where special tokens usually live. The
    server sees exactly len(word_ids) prompt tokens.
  * ``text``: the words joined by single spaces. One common word is about one token in real BPE
    tokenizers (every word of the table is a single " word" token in Llama 3, Qwen 3 and GPT-4/4o
    tokenizers), and the embedded simulated server counts one whitespace word as one token, so against
    it the length is exact; against a real server it is an approximation (the first word, which has no
    leading space, may take two tokens).

With a tokenizer (``target.tokenizer``, a local tokenizer.json; nothing is ever downloaded):
  * only the table words that add exactly one token after a space are used (found once at load);
    a usable word id maps to itself, any other to ``usable[w % len(usable)]``;
  * ``token_ids`` gives the tokenizer's id of " word";
  * ``text`` encodes (without special tokens) to exactly len(word_ids) tokens: it is verified, and
    words are added or removed at the end if a merge changed the count.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from loadlab.profile import ProfileError
from loadlab.workload.words import NUM_WORDS, WORDS

TOKEN_ID_BASE = 1000
MIN_USABLE_WORDS = 256
_FIT_ATTEMPTS = 24


class RenderError(ValueError):
    """A prompt could not be rendered to the exact token count with the given tokenizer."""


def _one_line(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def load_tokenizer(path: str):
    """Loads a local tokenizer.json (or a directory holding one) with the ``tokenizers`` package.

    Every failure is one ProfileError line; nothing is downloaded."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ProfileError(
            f"target.tokenizer: cannot load tokenizer file {path!r}: the 'tokenizers' package is not "
            "installed (pip install 'loadlab[tokenizer]')"
        ) from None
    p = Path(path).expanduser()
    if p.is_dir() and (p / "tokenizer.json").is_file():
        p = p / "tokenizer.json"
    if not p.exists():
        raise ProfileError(f"target.tokenizer: cannot load tokenizer file {path!r}: no such file")
    if not p.is_file():
        raise ProfileError(
            f"target.tokenizer: cannot load tokenizer file {path!r}: not a file (give a tokenizer.json)"
        )
    try:
        return Tokenizer.from_file(str(p))
    except Exception as e:  # tokenizers raises plain Exception subclasses with multi-line text
        reason = _one_line(str(e)) or type(e).__name__
        raise ProfileError(f"target.tokenizer: cannot load tokenizer file {path!r}: {reason}") from None


@functools.lru_cache(maxsize=4)
def cached_tokenizer(path: str):
    """``load_tokenizer``, once per process and path: the renderer and a dataset's token counts share it."""
    return load_tokenizer(path)


class Renderer:
    """Turns word ids into token ids or text, exactly sized when a tokenizer file is given."""

    def __init__(self, tokenizer_path: str | None = None):
        self.tokenizer_path = tokenizer_path
        self.tokenizer = None
        if not tokenizer_path:
            self.words = list(WORDS)
            return
        self.tokenizer = cached_tokenizer(tokenizer_path)
        self._build_table()

    @property
    def exact(self) -> bool:
        """True when text lengths are exact for the target's tokenizer (a tokenizer file is set)."""
        return self.tokenizer is not None

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def _build_table(self) -> None:
        tok = self.tokenizer
        label = f"target.tokenizer: {self.tokenizer_path!r}"
        try:
            context = self._encode(WORDS[0])
            after = tok.encode_batch([f"{WORDS[0]} {w}" for w in WORDS], add_special_tokens=False)
            alone = tok.encode_batch(list(WORDS), add_special_tokens=False)
        except Exception as e:
            raise ProfileError(f"{label}: cannot encode plain English words: {_one_line(str(e))}") from None
        # A word is usable when, after a word and a space, it adds exactly one token (" word").
        token_of: dict[int, int] = {}
        for wid, enc in enumerate(after):
            ids = enc.ids
            if len(ids) == len(context) + 1 and ids[: len(context)] == context:
                token_of[wid] = ids[-1]
        usable = sorted(token_of)
        if len(usable) < MIN_USABLE_WORDS:
            raise ProfileError(
                f"{label}: only {len(usable)} of the {NUM_WORDS} table words are single tokens after a "
                f"space (need at least {MIN_USABLE_WORDS}); is this an English BPE tokenizer?"
            )
        self.usable = usable
        word_map = [wid if wid in token_of else usable[wid % len(usable)] for wid in range(NUM_WORDS)]
        self._word_map = np.array(word_map, dtype=np.int64)
        self._token_ids = np.array([token_of[m] for m in word_map], dtype=np.int64)
        self.words = [WORDS[m] for m in word_map]
        # Words that are one token at the very start of a text too (no leading space there).
        starters = [wid for wid in usable if len(alone[wid].ids) == 1]
        self._starters = set(starters)
        self._starter_list = starters or usable
        for n in (1, 2, 255, 1024):
            sample = [(i * 7919) % NUM_WORDS for i in range(n)]
            try:
                self.text(sample)
            except RenderError as e:
                raise ProfileError(f"{label}: {e}") from None

    def token_ids(self, word_ids: Sequence[int]) -> list[int]:
        """Token ids for native /generate ``input_ids``: exactly one per word id."""
        if self.tokenizer is None:
            return [TOKEN_ID_BASE + w for w in word_ids]
        return self._token_ids[np.asarray(word_ids, dtype=np.int64)].tolist()

    def text(self, word_ids: Sequence[int]) -> str:
        """Prompt text for the OpenAI APIs; with a tokenizer it encodes to exactly len(word_ids)
        tokens (without special tokens)."""
        n = len(word_ids)
        if n == 0:
            return ""
        words = [self.words[w] for w in word_ids]
        if self.tokenizer is None:
            return " ".join(words)
        first = int(self._word_map[word_ids[0]])
        if first not in self._starters:
            words[0] = WORDS[self._starter_list[first % len(self._starter_list)]]
        return self._fit(words, n, word_ids)

    def _fit(self, words: list[str], n: int, word_ids: Sequence[int]) -> str:
        fill = 0
        for _ in range(_FIT_ATTEMPTS):
            text = " ".join(words)
            m = len(self._encode(text))
            if m == n:
                return text
            if m > n:
                drop = min(m - n, len(words) - 1)
                if drop <= 0:
                    break
                del words[-drop:]
            else:
                for _ in range(n - m):
                    wid = self.usable[(int(word_ids[fill % len(word_ids)]) + fill) % len(self.usable)]
                    words.append(WORDS[wid])
                    fill += 1
        raise RenderError(
            f"cannot make a text of exactly {n} tokens with tokenizer {self.tokenizer_path!r} "
            f"(words merge or split unpredictably)"
        )


@functools.lru_cache(maxsize=8)
def get_renderer(tokenizer_path: str | None) -> Renderer:
    """A per-process shared Renderer for a tokenizer path (loading a tokenizer costs ~0.1-1 s)."""
    return Renderer(tokenizer_path)
