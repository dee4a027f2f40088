"""The sweep file: `SweepSpec`, read and checked in one place (`load_sweep`), and its configurations.

Every mistake in a sweep file is one ``SweepError`` line, ``path: key: what is wrong``, raised before any
server starts: the base profile and every configuration's overrides are loaded here too.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from loadlab.cluster.config import ClusterOverrideError, check_classes, load_target_cluster
from loadlab.profile import (
    CLUSTER_OVERRIDES,
    EMBEDDED,
    NonNegativeInt,
    PositiveInt,
    Profile,
    ProfileError,
    load_profile,
    parse_set_option,
)
from loadlab.yamlconfig import ConfigError

DEFAULT_URL = "http://127.0.0.1:{port}"
DEFAULT_READY_TIMEOUT_S = 600.0
KEYS = ("name", "profile", "axes", "repeats", "launch", "url", "ready_timeout_s", "set", "slo", "refine")
# A sweep key `cluster.K` sets K of the profile's cluster file (target.cluster_overrides.K): a district by
# its name (cluster.districts.online.sglang.max_running_requests), the front (cluster.front.policy).
CLUSTER_PREFIX = "cluster."
KEY_OF = {"overrides": "set"}  # a SweepSpec field -> its key in the sweep file, for error messages


class SweepError(ProfileError):
    """A bad sweep file: one line, like a profile error."""


class SweepSpec(BaseModel):
    """A sweep file as loaded and checked by `load_sweep` (paths resolved, defaults filled in)."""

    # Frozen: a spec is read once and only read after. `overrides` is the file's `set:` (the alias), and
    # keeps that key when the spec is written into sweep.json.
    model_config = ConfigDict(frozen=True, extra="forbid", validate_by_name=True, validate_by_alias=True)

    name: str = Field(description="the sweep's name (default: the file's stem); names reports/sweep-<name>")
    file: str = Field(description="the sweep file this spec was read from")
    profile: str = Field(description="the base profile's path, resolved against the sweep file's directory")
    axes: dict[str, tuple[Any, ...]] = Field(
        description="axis -> its values, in sweep order; a dotted name is a profile key (a client axis, "
        "applied as --set), a plain one a {placeholder} of launch (a server axis)"
    )
    repeats: PositiveInt = Field(1, description="runs per configuration; the table shows their median")
    launch: tuple[str, ...] | None = Field(
        None, description="argv template of the server started per configuration; None: the profile's target"
    )
    url: str = Field(
        DEFAULT_URL, description="where the launched server answers ({port} and the server axes)"
    )
    ready_timeout_s: float = Field(
        DEFAULT_READY_TIMEOUT_S, description="how long a server may take to come up"
    )
    overrides: tuple[str, ...] = Field(
        (), alias="set", description="profile overrides for every run, as `--set KEY=VALUE` items"
    )
    # Passed on to every run as --set slo.KEY=VALUE (so `loadlab run` checks the keys and values).
    slo: dict[str, Any] = Field(
        default_factory=dict, description="the SLO of the choice (default: the base profile's)"
    )
    warmup: NonNegativeInt = Field(0, description="the base profile's warm-up requests (the first repeat's)")
    fresh_target: bool = Field(
        False,
        description="every run starts its own target (no launch:, the profile's embedded twin or "
        "target.cluster), so every repeat warms it up",
    )
    refine: NonNegativeInt = Field(
        0, description="values added on each side of the knee after the coarse sweep"
    )

    def configurations(self) -> list[dict[str, Any]]:
        """The coarse configurations: the product of the axes."""
        return configurations(self.axes)


def is_sweep_file(path: str | Path) -> bool:
    """A sweep file has axes; a profile does not (an unreadable file is left to the profile loader)."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(data, dict) and "axes" in data


def load_sweep(path: str | Path) -> SweepSpec:
    """Reads and checks a sweep file, its base profile and every configuration's overrides."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise SweepError(f"{path}: cannot read the sweep file: {e}") from None
    if not isinstance(data, dict):
        raise SweepError(f"{path}: a sweep file is a mapping (profile, axes, ...)")
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise SweepError(f"{path}: {unknown[0]}: unknown key (known: {', '.join(sorted(KEYS))})")
    if "profile" not in data:
        raise SweepError(f"{path}: profile: missing (the base profile, e.g. profiles/rag.yaml)")
    axes = data.get("axes")
    if not isinstance(axes, dict) or not axes or not all(isinstance(v, list) and v for v in axes.values()):
        raise SweepError(f"{path}: axes: a mapping of name -> non-empty list of values")
    launch = data.get("launch")
    if launch is not None and not (
        isinstance(launch, list) and all(isinstance(a, str | int | float) for a in launch)
    ):
        raise SweepError(f"{path}: launch: an argv list (strings), never a shell string")
    server_axes = [a for a in axes if "." not in a]
    if server_axes and launch is None:
        raise SweepError(
            f"{path}: axes: {server_axes[0]}: a server argument needs a launch template (launch:)"
        )
    for axis in server_axes:
        if not any("{" + axis + "}" in str(a) for a in launch):
            raise SweepError(f"{path}: axes: {axis}: not a {{{axis}}} placeholder in launch")
    repeats = data.get("repeats", 1)
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise SweepError(f"{path}: repeats: a positive integer (got {repeats!r})")
    refine = data.get("refine") or 0
    if not isinstance(refine, int) or isinstance(refine, bool) or refine < 0:
        raise SweepError(f"{path}: refine: a whole number >= 0 of values to add on each side of the knee "
                         f"(got {refine!r})")  # fmt: skip
    if refine:
        (axis, values), *others = axes.items()
        if others:
            raise SweepError(f"{path}: refine: needs a sweep over one axis (this one has {len(axes)})")
        if (
            len(values) < 2
            or not all(is_number(v) for v in values)
            or any(b <= a for a, b in itertools.pairwise(values))
        ):
            raise SweepError(f"{path}: refine: axes: {axis}: needs two or more increasing numbers")
    base = (
        (path.parent / data["profile"]) if not Path(data["profile"]).is_absolute() else Path(data["profile"])
    )
    if not base.exists() and Path(data["profile"]).exists():
        base = Path(data["profile"])
    profile = load_profile(base)  # a bad base profile fails here, with its own file:line message
    sets = dict(parse_set_option(str(item)) for item in data.get("set") or [])
    cluster_keys = [(where, k) for where, keys in (("set", sets), ("axes", axes)) for k in keys
                    if k == "target.cluster" or cluster_key(k) is not None]  # fmt: skip
    if cluster_keys and launch is not None:
        where, key = cluster_keys[0]
        raise SweepError(f"{path}: {where}: {key}: the runs aim at the launched server (launch:), not at the "
                         "profile's cluster; drop launch: (each run starts its cluster)")  # fmt: skip
    # Every configuration's overrides (set: and the client and cluster axes) checked now, not after a
    # server started: the profile, and the cluster each run would start with what is laid over it.
    fresh = launch is None
    for config in configurations({a: v for a, v in axes.items() if "." in a}):
        given = {**sets, **config}
        try:
            run_profile = load_profile(base, profile_overrides(given, base.parent))
        except ProfileError as e:
            if not _has_cluster(base, {k: v for k, v in given.items() if cluster_key(k) is None}):
                _check_cluster(path, base, None, sets, config)  # a cluster axis without a cluster: says so
            raise SweepError(f"{path}: set/axes {label(given)}: {e}") from None
        fresh = fresh and run_profile.target.url == EMBEDDED
        _check_cluster(path, base, run_profile, sets, config)
    try:
        return SweepSpec(
            name=str(data.get("name") or path.stem),
            file=str(path),
            profile=str(base),
            axes=axes,
            repeats=repeats,
            launch=[str(a) for a in launch] if launch else None,
            url=str(data.get("url", DEFAULT_URL)),
            ready_timeout_s=float(data.get("ready_timeout_s", DEFAULT_READY_TIMEOUT_S)),
            overrides=[str(s) for s in data.get("set") or []],
            slo=data.get("slo") or profile.slo.model_dump(exclude_none=True),
            warmup=profile.requests.warmup,
            fresh_target=fresh,
            refine=refine,
        )
    except ValidationError as e:  # what the checks above let through (e.g. slo: not a mapping)
        err = e.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        raise SweepError(f"{path}: {KEY_OF.get(key, key)}: {err['msg']}") from None


def cluster_key(key: str) -> str | None:
    """The setting of the cluster file that a sweep key sets (``cluster.K``, or the profile's own spelling
    ``target.cluster_overrides.K``: K, a district by its name), or None."""
    for prefix in (CLUSTER_PREFIX, CLUSTER_OVERRIDES + "."):
        if key.startswith(prefix):
            return key.removeprefix(prefix)
    return None


def profile_key(key: str) -> str:
    """A sweep key as the profile's: ``cluster.K`` is ``target.cluster_overrides.K``."""
    found = cluster_key(key)
    return f"{CLUSTER_OVERRIDES}.{found}" if found is not None else key


def profile_value(key: str, value: Any, profile_dir: Path) -> Any:
    """A value as the profile would read it: a relative ``target.cluster`` is relative to the base profile,
    as the profile's own is (``--set`` alone would take it relative to the working directory)."""
    if key == "target.cluster" and isinstance(value, str) and value and not Path(value).is_absolute():
        return os.path.abspath(profile_dir / value)
    return value


def profile_overrides(given: dict[str, Any], profile_dir: Path) -> dict[str, Any]:
    """The sweep's keys and values (``set:`` and a configuration's dotted axes) as profile overrides."""
    return {profile_key(k): profile_value(k, v, profile_dir) for k, v in given.items()}


def run_sets(spec: SweepSpec, config: dict[str, Any]) -> list[str]:
    """A run's ``--set`` items for configuration ``config``: the sweep's ``set:``, then its dotted axes, in
    the profile's keys (a ``set:`` item keeps its value as written)."""
    profile_dir = Path(spec.profile).parent
    items = []
    for item in spec.overrides:
        key, value = parse_set_option(item)
        raw = item.partition("=")[2]
        if key == "target.cluster":
            raw = str(profile_value(key, value, profile_dir))
        items.append(f"{profile_key(key)}={raw}")
    for axis, value in config.items():
        if "." in axis:
            items.append(f"{profile_key(axis)}={profile_value(axis, value, profile_dir)}")
    return items


def _has_cluster(base: Path, given: dict[str, Any]) -> bool:
    """Whether the profile with these overrides runs a cluster (True when it does not load: not the
    question, and its own error is the one to show)."""
    try:
        return load_profile(base, profile_overrides(given, base.parent)).target.cluster is not None
    except ProfileError:
        return True


def _check_cluster(
    path: Path, base: Path, profile: Profile | None, sets: dict[str, Any], config: dict[str, Any]
) -> None:
    """The cluster a configuration's runs would start: its file and what the sweep lays over it, checked
    as the run will check it; a problem names the sweep key behind it (``axes: KEY=VALUE`` or ``set:``)."""
    given = {**sets, **config}

    def blame(key: str) -> str:
        return f"{path}: {'axes' if key in config else 'set'}: {key}={given[key]}"

    if profile is None or profile.target.cluster is None:
        key = next((k for k in given if cluster_key(k) is not None), None)
        if key is not None:
            raise SweepError(f"{blame(key)}: the profile runs no cluster (target.cluster) to lay it over")
        return
    try:
        cluster = load_target_cluster(profile.target)
        # The profile's classes against this configuration's districts (a layout that serves no district
        # for a class would fail its run); its warnings are the runs' to log.
        check_classes(profile, base, cluster, profile.target.cluster)
    except ClusterOverrideError as e:
        # The sweep key that set e.key: that key, or a mapping above it (set: [cluster.front={...}]).
        key = next((k for k in given if (c := cluster_key(k)) is not None
                    and (e.key == c or e.key.startswith(c + "."))), None)  # fmt: skip
        if key is None:  # the profile's own target.cluster_overrides
            raise SweepError(f"{path}: profile {profile.target.cluster}: {e}") from None
        raise SweepError(f"{blame(key)}: {e.problem} (cluster {_shown(profile.target.cluster)})"
                         ) from None  # fmt: skip
    except ConfigError as e:  # the cluster file itself, or the classes it does not serve
        # Blame the layout axis first, else a cluster setting (a serves that leaves a class unserved).
        keys = sorted((k for k in given if k == "target.cluster" or cluster_key(k) is not None),
                      key=lambda k: k != "target.cluster")  # fmt: skip
        where = blame(keys[0]) if keys else f"{path}: the profile's cluster"
        raise SweepError(f"{where}: {e}") from None


def _shown(path: str) -> str:
    """A path as messages show it: relative to the working directory when under it."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def configurations(axes: dict[str, Any]) -> list[dict[str, Any]]:
    """The product of the axes, in order (the last axis varies fastest): one dict per configuration."""
    names = list(axes)
    return [dict(zip(names, values, strict=True)) for values in itertools.product(*(axes[n] for n in names))]


def label(config: dict[str, Any]) -> str:
    """A configuration as the tables and messages name it: ``axis=value, axis=value``."""
    return ", ".join(f"{k}={v}" for k, v in config.items())


def is_number(v: Any) -> bool:
    """An int or float axis value (not a bool)."""
    return isinstance(v, int | float) and not isinstance(v, bool)
