"""YAML configuration files checked by pydantic, every mistake one line naming the file, the line and the
key: the machinery profiles (``loadlab/profile.py``) and cluster files (``loadlab/cluster/config.py``)
share.

- ``read_mapping(path, noun, error)``: the file's top-level mapping and the line of every key path (a key
  given twice is an error; YAML loaders silently keep the last one).
- ``validation_message(e, label, lines)``: a pydantic ``ValidationError`` as ``file:line: key: problem``.
- ``check_mapping(...)``: a free-form mapping (the twin's SGLang settings) checked one key at a time, so the
  error points at the offending key's line.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

Lines = dict[tuple[str, ...], int]  # key path -> its 1-based line in the file


class ConfigError(Exception):
    """A user mistake in a configuration file; its message is the one line to print."""


def read_mapping(path: str | Path, noun: str, error: type[ConfigError]) -> tuple[dict[str, Any], Lines]:
    """Reads a YAML file whose top level is a mapping. ``noun`` names the kind of file in messages
    ("profile": "profile file not found", "profile is empty"); every problem raises ``error``."""
    label = str(path)
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise error(f"{label}: {noun} file not found") from None
    except OSError as e:
        raise error(f"{label}: cannot read {noun}: {e.strerror}") from None
    try:
        root = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise error(f"{label}{where}: not valid YAML: {problem}") from None
    if data is None:
        raise error(f"{label}: {noun} is empty")
    if not isinstance(data, dict):
        raise error(f"{label}:1: a {noun} must be a mapping of keys, got {type(data).__name__}")
    return data, key_lines(root, label=label, error=error)


def key_lines(node, prefix=(), label="<config>", error: type[ConfigError] = ConfigError) -> Lines:
    """Maps each key path in a composed YAML tree to its 1-based line number (list items by index); a key
    given twice in one mapping raises ``error``."""
    out: Lines = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            path = prefix + (str(key_node.value),)
            if path in out:
                line = key_node.start_mark.line + 1
                raise error(f"{label}:{line}: {'.'.join(path)}: duplicate key (first at line {out[path]})")
            out[path] = key_node.start_mark.line + 1
            out.update(key_lines(value_node, path, label, error))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            path = prefix + (str(i),)
            out[path] = item.start_mark.line + 1
            out.update(key_lines(item, path, label, error))
    return out


def line_for(lines: Lines, loc: Sequence[str]) -> int | None:
    """The line of key path ``loc``, else of its nearest enclosing key that has one."""
    loc = tuple(loc)
    while loc:
        if loc in lines:
            return lines[loc]
        loc = loc[:-1]
    return None


def where(label: str, lines: Lines, loc: Sequence[str]) -> str:
    """``file:line`` for key path ``loc`` (``file`` alone when no line is known)."""
    line = line_for(lines, loc)
    return f"{label}:{line}" if line else label


UNION_TAG_ERRORS = ("union_tag_invalid", "union_tag_not_found")


def describe(err: dict[str, Any], tags: Sequence[str] = ()) -> str:
    """One pydantic error in words; ``tags``: the values a discriminated union's ``kind`` may take."""
    kind = err["type"]
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "missing":
        return "required key is missing"
    if kind in UNION_TAG_ERRORS:
        return f"kind must be one of {', '.join(tags)}"
    msg = err["msg"]
    msg = msg.removeprefix("Value error, ")
    given = err.get("input")
    if kind not in ("value_error",) and not isinstance(given, dict | list):
        msg = f"{msg} (got {given!r})"
    return msg


def validation_message(e: ValidationError, label: str, lines: Lines, tags: Sequence[str] = ()) -> str:
    """The first error of a validation as ``file:line: dotted.key: problem``. ``tags``: the values of a
    discriminated union's ``kind`` (pydantic puts the value into the error location; it is dropped)."""
    err = e.errors()[0]
    loc = [str(p) for p in err["loc"] if p not in tags]
    if err["type"] in UNION_TAG_ERRORS:
        loc.append("kind")
    key = ".".join(loc) or "(top level)"
    return f"{where(label, lines, loc)}: {key}: {describe(err, tags)}"


def check_mapping(
    mapping: dict[str, Any],
    check: Callable[[dict], str | None],
    loc: Sequence[str],
    label: str,
    lines: Lines,
    error: type[ConfigError],
) -> None:
    """Checks a free-form mapping at key path ``loc`` with ``check`` (None or ``"key: problem"``): one
    key at a time first, so the error points at the offending key's line, then the whole mapping (keys
    that conflict with each other)."""
    dotted = ".".join(loc)
    for key, value in mapping.items():
        problem = check({key: value})
        if problem:
            raise error(
                f"{where(label, lines, [*loc, str(key)])}: {dotted}.{key}: {problem.removeprefix(f'{key}: ')}"
            )
    problem = check(mapping)
    if problem:
        line = line_for(lines, loc)
        raise error(f"{label}:{line}: {dotted}: {problem}" if line else f"{label}: {problem}")
