"""Workloads: a profile becomes a deterministic stream of request specs, rendered for the wire.

``build_workload(profile).spec(i)`` is a pure function of (profile workload, seed, i); prompts are word
ids into ``WORDS``; ``Renderer`` turns them into token ids (native /generate) or text (OpenAI APIs); a
conversation's turns go out through a ``Dialogue`` (the session's history, with the server's replies).
See docs/workloads.md.
"""

# The kinds kept in modules of their own register themselves with the generators on import.
from loadlab.workload import bench_serving, datasets, trace  # noqa: F401
from loadlab.workload.conversation import Dialogue, Prompt
from loadlab.workload.generators import build_workload, workload_source
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
    "workload_source",
]
