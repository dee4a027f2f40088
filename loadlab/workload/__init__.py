"""Workloads: a profile becomes a deterministic stream of request specs, rendered for the wire.

``build_workload(profile).spec(i)`` is a pure function of (profile workload, seed, i); prompts are word
ids into ``WORDS``; ``Renderer`` turns them into token ids (native /generate) or text (OpenAI APIs); a
conversation's turns go out through a ``Dialogue`` (the session's history, with the server's replies).
See docs/workloads.md.
"""

# Importing a kind's module registers it with build_workload.
from loadlab.workload.conversation import Dialogue, Prompt
from loadlab.workload.generators import build_workload
from loadlab.workload.text import TOKEN_ID_BASE, Renderer, RenderError, get_renderer
from loadlab.workload.words import NUM_WORDS, WORDS

__all__ = [
    "NUM_WORDS",
    "TOKEN_ID_BASE",
    "WORDS",
    "Dialogue",
    "Prompt",
    "RenderError",
    "Renderer",
    "build_workload",
    "get_renderer",
]
