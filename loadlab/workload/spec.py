"""The request spec: what to send for request i, a pure function of (profile, seed, i)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestSpec:
    index: int
    input_ids: tuple[int, ...]  # the prompt as token ids; native /generate sends these exactly
    max_new_tokens: int
    prefix_group: int | None = None  # requests sharing a deliberate prefix (system prompt, ...)

    @property
    def input_len(self) -> int:
        return len(self.input_ids)
