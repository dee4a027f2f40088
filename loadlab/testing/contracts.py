"""Checks that a typed contract (a pydantic model: the manifest, the summary) and its documentation agree:
every field, nested ones by dotted path, is named in the document's section, and nothing else is."""

from __future__ import annotations

import re
import typing

from pydantic import BaseModel


def field_paths(model: type[BaseModel], prefix: str = "") -> dict[str, str | None]:
    """Every field of ``model`` and of the models it nests (also in lists, dicts and unions), by dotted
    path, with its description."""
    paths: dict[str, str | None] = {}
    for name, field in model.model_fields.items():
        path = prefix + name
        paths[path] = field.description
        for nested in _models_in(field.annotation):
            paths.update(field_paths(nested, path + "."))
    return paths


def _models_in(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def documented_paths(markdown: str, heading: str) -> set[str]:
    """The backticked names in the first column of the tables under ``heading`` (up to the next heading of
    the same or a higher level)."""
    level = len(heading) - len(heading.lstrip("#"))
    lines = markdown.splitlines()
    start = lines.index(heading) + 1
    names: set[str] = set()
    for line in lines[start:]:
        if re.match(rf"#{{1,{level}}} ", line):
            break
        m = re.match(r"\|\s*`([^`]+)`\s*\|", line)
        if m:
            names.add(m.group(1))
    return names
