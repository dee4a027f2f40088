"""The request spec: what to send for request i, a pure function of (profile, seed, i)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestSpec:
    index: int
    input_ids: tuple[int, ...]  # the prompt as token ids; native /generate sends these exactly
    max_new_tokens: int
    prefix_group: int | None = None  # requests sharing a deliberate prefix (system prompt, ...)
    request_class: str | None = None  # the profile's SLO class of this request; None without classes
    # How the class is carried to the server (the class's `carry`): SGLang's priority field, a header named
    # x-request-id-... whose value is the class name, a served model name. None: not carried that way.
    priority: int | None = None
    class_header: str | None = None
    model: str | None = None
    ignore_eos: bool = True  # SGLang's sampling parameter: False lets the model stop before max_new_tokens
    # A conversation's turn (loadlab.workload.conversation): input_ids are the turn's own new tokens (the
    # session's system prompt, the first system_len of them, then the user message); the prompt sent is the
    # session's history followed by them. None / 0 for any other request.
    session: int | None = None
    turn: int | None = None  # 1 for a session's first turn
    system_len: int = 0
    think_time_s: float = 0.0  # sent this long after the previous turn's reply ended
    # A prompt replayed from a file (the dataset kind), sent as the file has it: its text (/generate's text,
    # /v1/completions' prompt, a chat user message) or chat messages ((role, content) pairs). input_ids are
    # then its tokens as counted (docs/workloads.md). raw_ids: input_ids are the target's token ids, sent as
    # they are (/generate's input_ids, a token-id completions prompt), not word ids to render.
    text: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None
    raw_ids: bool = False

    @property
    def input_len(self) -> int:
        return len(self.input_ids)
