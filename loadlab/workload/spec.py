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
