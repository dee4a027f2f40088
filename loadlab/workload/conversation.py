"""Multi-turn conversations (``workload.kind: conversation``): sessions of ``turns`` requests, each turn's
prompt holding the session's earlier turns and the server's replies to them.

Request i is turn ``i % turns + 1`` of session ``i // turns``. ``spec(i)`` stays a pure function of (the
workload section, seed, i), but holds only what the turn adds: the session's system prompt (first turn
only) and the user message. The prompt sent is ``Dialogue.prompt(spec)``: the history (every earlier turn's
prompt and the server's actual reply, as it arrived) followed by those tokens. So a turn's prompt depends on
the server's replies, as in a real chat, and a server's prefix cache sees what it would see in one (the
reply it generated is in the next prompt); the record keeps what was sent (its ``input_len``). The replies
are fed back, not synthesised: a synthetic reply would miss a real server's cache after the previous
prompt. With ``ignore_eos`` and the twin (whose output is a function of the prompt) the whole prompt is
still deterministic; docs/workloads.md says why this was chosen.

A session stays on one user: a ticket (``loadlab.load``) hands out a session's turns together, and the
user sends turn t + 1 only after turn t's reply has ended and ``think_time_s`` has passed.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from loadlab.profile import ConversationWorkloadConfig, Profile
from loadlab.workload.bulk_rng import first_integers
from loadlab.workload.generators import (
    WorkloadGenerator,
    _cache_size,
    _lead_pair,
    _rng,
    _words,
    register,
    repeated,
)
from loadlab.workload.spec import RequestSpec
from loadlab.workload.text import Renderer
from loadlab.workload.words import NUM_WORDS

# Salts (see generators.py): never change them.
_SALT_CONV_SYSTEM = 51
_SALT_CONV_SYSTEM_FIRST = 52
_SALT_CONV_LEAD = 53
_SALT_CONV_TURN = 54


@register
class ConversationGenerator(WorkloadGenerator):
    """Sessions of ``turns`` requests. Session s opens with system prompt ``s % num_system_prompts`` (a
    function of (seed, that number); its first word differs between system prompts, so different ones share
    nothing), then the user message of turn 1, whose first two words encode s (as random_prefix's lead
    words), so two sessions share exactly their system prompt. Every turn's user message and output length
    are drawn from (seed, i). prefix_group: the session's system prompt (None without one)."""

    kind = "conversation"

    def __init__(self, profile: Profile):
        super().__init__(profile)
        w: ConversationWorkloadConfig = self.config
        self.turns = w.turns
        self._first = _rng(self._s, _SALT_CONV_SYSTEM_FIRST).permutation(NUM_WORDS)
        lead = _rng(self._s, _SALT_CONV_LEAD)
        self._l0 = lead.permutation(NUM_WORDS)
        self._l1 = lead.permutation(NUM_WORDS)
        self.system_prompt = functools.lru_cache(
            maxsize=_cache_size(w.system_prompt_len, w.num_system_prompts)
        )(self._make_system_prompt)

    def _make_system_prompt(self, group: int) -> np.ndarray:
        ids = _words(_rng(self._s, group, _SALT_CONV_SYSTEM), self.config.system_prompt_len)
        if ids.size:
            ids[0] = self._first[group % NUM_WORDS]
        return ids

    def _draws(self, index: int) -> tuple[np.random.Generator, int, int]:
        """Request ``index``'s generator and its user message and output lengths (drawn first)."""
        w: ConversationWorkloadConfig = self.config
        rng = _rng(self._s, index, _SALT_CONV_TURN)
        n_user = w.user_len if w.user_len_range is None else int(rng.integers(w.user_len_range[0],
                                                                              w.user_len_range[1] + 1))  # fmt: skip
        n_out = w.output_len if w.output_len_range is None else int(rng.integers(w.output_len_range[0],
                                                                                 w.output_len_range[1] + 1))  # fmt: skip
        return rng, n_user, n_out

    def _spec(self, index: int) -> RequestSpec:
        w: ConversationWorkloadConfig = self.config
        session, t0 = divmod(index, self.turns)
        rng, n_user, n_out = self._draws(index)
        user = _words(rng, n_user)
        group = session % w.num_system_prompts
        system_len = 0
        if t0 == 0:
            user[:2] = _lead_pair(self._l0, self._l1, session)
            system_len = w.system_prompt_len
            user = np.concatenate([self.system_prompt(group), user])
        return RequestSpec(
            index=index,
            input_ids=tuple(user.tolist()),
            max_new_tokens=n_out,
            prefix_group=group if w.system_prompt_len else None,
            session=session,
            turn=t0 + 1,
            system_len=system_len,
            think_time_s=w.think_time_s if t0 else 0.0,
        )

    def lengths_of(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``_draws``' user message and output lengths for many indices at once (``bulk_rng``)."""
        w: ConversationWorkloadConfig = self.config
        fixed = {"user": w.user_len_range is None, "output": w.output_len_range is None}
        ranges = [r for r in (w.user_len_range, w.output_len_range) if r is not None]
        drawn = iter(first_integers([self._s], indices, [_SALT_CONV_TURN], ranges).T if ranges else ())
        n_user = np.full(indices.size, w.user_len, dtype=np.int64) if fixed["user"] else next(drawn)
        n_out = np.full(indices.size, w.output_len, dtype=np.int64) if fixed["output"] else next(drawn)
        return n_user, n_out

    def reusable_prefix(self, indices: Sequence[int]) -> np.ndarray:
        # A turn shares with the session's previous turn that turn's prompt and its reply but the reply's last
        # token (which never had KV): the previous request left them in the cache. A first turn (or a turn
        # whose previous one is not among ``indices``) shares the system prompt with an earlier request of
        # the same one. The replies are taken to be max_new_tokens long, which holds only when EOS is ignored.
        w: ConversationWorkloadConfig = self.config
        if not w.ignore_eos:
            raise ValueError("the replies' lengths are not known before the run when EOS is not ignored")
        indices = np.asarray(indices, dtype=np.int64)
        if not indices.size:
            return np.zeros(0, dtype=np.int64)
        session, turn = np.divmod(indices, self.turns)
        # Every turn of each session up to its last among ``indices``, for the prompt lengths before it.
        sessions, which = np.unique(session, return_inverse=True)
        which = which.ravel()
        span = np.zeros(sessions.size, dtype=np.int64)
        np.maximum.at(span, which, turn + 1)
        start = np.zeros(sessions.size, dtype=np.int64)
        np.cumsum(span[:-1], out=start[1:])
        k = np.arange(int(span.sum())) - np.repeat(start, span)
        n_user, n_out = self.lengths_of(np.repeat(sessions, span) * self.turns + k)
        # Turn k's prompt: the system prompt, every user message up to k and every reply before it.
        before = np.cumsum(n_user + n_out) - n_out
        prompt = w.system_prompt_len + before - np.repeat(before[start] - n_user[start], span)
        at = start[which] + turn  # each index's turn among them
        previous = (turn > 0) & np.isin(indices - 1, indices)
        first = np.where(repeated(session % w.num_system_prompts), w.system_prompt_len, 0)
        shared = np.where(previous, prompt[at - 1] + n_out[at - 1] - 1, first)
        return np.minimum(shared, prompt[at] - 1)


@dataclass(frozen=True, slots=True)
class Prompt:
    """A conversation turn's prompt as the wire sends it."""

    # The body's prompt: {"input_ids": [...]}, {"prompt": "..."} or {"messages": [...]}.
    fields: dict[str, Any]
    # Its length in tokens: the renderer's count of every turn's own part, the server's of the replies.
    input_len: int


class Dialogue:
    """One session's conversation in the wire form of one API: the native API's token ids (the replies'
    ``output_ids``), the completions API's text (the replies' text), or chat messages (system, user,
    assistant, ...). ``prompt(spec)`` gives a turn's prompt; ``reply(reply, tokens)`` adds the server's reply
    to it before the next turn (a turn that got none, e.g. a failed request, adds nothing)."""

    def __init__(self, api: str, renderer: Renderer):
        self.api = api
        self.renderer = renderer
        self._history: Any = [] if api != "completions" else ""
        self._tokens = 0
        self._pending: Prompt | None = None  # the last prompt, until its reply comes
        self.input_len = 0  # the last prompt's length

    def prompt(self, spec: RequestSpec) -> Prompt:
        if self._pending is not None:
            self.reply(None, 0)
        own, renderer, history = spec.input_ids, self.renderer, self._history
        if self.api == "generate":
            fields: dict[str, Any] = {"input_ids": history + renderer.token_ids(own)}
        elif self.api == "completions":
            text = renderer.text(own)
            gap = " " if history and not history[-1].isspace() else ""  # the reply's last word stays a word
            fields = {"prompt": history + gap + text}
        else:
            n = spec.system_len
            system = [{"role": "system", "content": renderer.text(own[:n])}] if n else []
            fields = {"messages": [*history, *system, {"role": "user", "content": renderer.text(own[n:])}]}
        self._pending = Prompt(fields, self._tokens + len(own))
        self.input_len = self._pending.input_len
        return self._pending

    def reply(self, reply: list[int] | str | None, tokens: int) -> None:
        """The server's reply to the last prompt: output ids (native API) or text, ``tokens`` long."""
        sent = self._pending
        if sent is None:
            return
        self._pending = None
        (body,) = sent.fields.values()
        if not reply:
            self._history, self._tokens = body, sent.input_len
            return
        if self.api == "chat":
            self._history = [*body, {"role": "assistant", "content": reply}]
        else:
            self._history = body + (list(reply) if self.api == "generate" else reply)
        self._tokens = sent.input_len + tokens
