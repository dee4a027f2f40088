"""The cluster file: SGLang workers (the twin) grouped in districts, behind one front. ``ClusterConfig``,
read and checked in one place (``load_cluster``); every mistake is one ``ClusterError`` line naming the
file, the line and the key. ``docs/cluster.md`` documents the format.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from loadlab.profile import CLUSTER_OVERRIDES, TargetConfig
from loadlab.sim.cost import GPUS, MODELS
from loadlab.sim.settings import BY_NAME, check_embedded_settings, resolve_settings
from loadlab.yamlconfig import ConfigError, describe, read_mapping, validation_message, where

FrontKind = Literal["router", "omni", "none"]
# The policies each front offers (the router's are sglang-router's `--policy` names).
POLICIES: dict[str, tuple[str, ...]] = {
    "router": ("cache_aware", "round_robin", "power_of_two"),
    "omni": ("round_robin", "power_of_two", "least_queue", "least_kv", "prefix"),
    "none": (),
}
DEFAULT_POLICY = {"router": "cache_aware", "omni": "least_queue"}  # the router's own default; omni's
DEFAULT_POLL_INTERVAL_S = 0.5
DEFAULT_QUEUE_SIZE = 1024
# Twins served by one process (one event loop); measured in bench/cluster_realtime.py (docs/cluster.md).
DEFAULT_WORKERS_PER_PROCESS = 1
# Set by the district itself (gpu, model) or by the launcher (where a worker listens, how it logs).
NOT_IN_SGLANG = ("gpu", "model")
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"


class ClusterError(ConfigError):
    """A bad cluster file: one line naming the file, the line and the key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


CLASS_NAME_PATTERN = r"^[A-Za-z0-9_.-]+$"  # a profile's classes[].name


class District(_Strict):
    """Workers of one kind: the same GPU, model and SGLang settings, and the SLO classes they serve."""

    name: str = Field(pattern=NAME_PATTERN, description="the district's name, unique in the cluster")
    workers: StrictInt = Field(1, gt=0, description="how many workers (twins) it has")
    gpu: Literal[tuple(GPUS)] = Field("a100-80gb", description="the twin's GPU preset")  # type: ignore[valid-type]
    model: Literal[tuple(MODELS)] = Field("llama-3.1-8b", description="the twin's model preset")  # type: ignore[valid-type]
    sglang: dict[str, Any] = Field(
        default_factory=dict,
        description="the workers' settings under SGLang's launch-flag names (e.g. max_running_requests: "
        "64), as a profile's target.embedded; enable_metrics is on unless set false",
    )
    serves: list[Annotated[str, Field(pattern=CLASS_NAME_PATTERN)]] | None = Field(
        None,
        min_length=1,
        description="the SLO classes (a profile's classes[].name) it serves; omni routes each class to the "
        "districts serving it. Unset: any class (and requests without a class)",
    )

    @field_validator("serves")
    @classmethod
    def _unique(cls, serves: list[str] | None) -> list[str] | None:
        if serves is not None:
            dup = next((c for c in serves if serves.count(c) > 1), None)
            if dup is not None:
                raise ValueError(f"{dup!r} is named twice")
        return serves


class Front(_Strict):
    """What the clients talk to: sglang-router, loadlab's omni front, or nothing (the workers directly)."""

    kind: FrontKind = Field("router", description="router (sglang-router), omni (loadlab.cluster.omni), none")
    policy: str | None = Field(
        None,
        description="how the front picks a worker; router: cache_aware (default), round_robin, "
        "power_of_two; omni: round_robin, power_of_two, least_queue (default), least_kv, prefix",
    )
    poll_interval_s: float | None = Field(
        None,
        gt=0,
        description=f"omni: how often it polls each worker's load (default {DEFAULT_POLL_INTERVAL_S})",
    )
    queue_size: StrictInt | None = Field(
        None, gt=0, description=f"omni: the most requests its queue holds (default {DEFAULT_QUEUE_SIZE})"
    )

    @model_validator(mode="before")
    @classmethod
    def _defaults_of_the_kind(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        kind = data.get("kind", "router")
        if kind == "omni":
            defaults = {"policy": DEFAULT_POLICY["omni"], "poll_interval_s": DEFAULT_POLL_INTERVAL_S,
                        "queue_size": DEFAULT_QUEUE_SIZE}  # fmt: skip
            return {**defaults, **{k: v for k, v in data.items() if v is not None}}
        if kind == "router" and data.get("policy") is None:
            return {**data, "policy": DEFAULT_POLICY["router"]}
        return data

    @field_validator("policy")
    @classmethod
    def _policy_of_the_kind(cls, policy: str | None, info: ValidationInfo) -> str | None:
        kind = info.data.get("kind")
        if kind is None:  # the kind itself is wrong; that error is reported
            return policy
        if kind == "none":
            if policy is not None:
                raise ValueError("a cluster without a front (kind: none) has no policy")
            return None
        if policy not in POLICIES[kind]:
            raise ValueError(f"{kind}: expected one of {', '.join(POLICIES[kind])}, got {policy!r}")
        return policy

    @field_validator("poll_interval_s", "queue_size")
    @classmethod
    def _omni_only(cls, value: Any, info: ValidationInfo) -> Any:
        kind = info.data.get("kind")
        if value is not None and kind is not None and kind != "omni":
            raise ValueError(f"only for kind: omni (this front is {kind})")
        return value


class ClusterConfig(_Strict):
    """A cluster file as loaded and checked by ``load_cluster``."""

    name: str = Field(pattern=NAME_PATTERN, description="the cluster's name (default: the file's stem)")
    districts: list[District] = Field(min_length=1, description="the workers, by district, in order")
    front: Front = Field(default_factory=Front, description="what the clients talk to")
    workers_per_process: StrictInt = Field(
        DEFAULT_WORKERS_PER_PROCESS,
        gt=0,
        description="twins served by one process, each on its own port (a process serves one district)",
    )

    @property
    def total_workers(self) -> int:
        return sum(d.workers for d in self.districts)

    def processes(self) -> list[tuple[District, int]]:
        """The worker processes to start: (district, twins in it), districts in order."""
        out = []
        for d in self.districts:
            left = d.workers
            while left:
                n = min(left, self.workers_per_process)
                out.append((d, n))
                left -= n
        return out


def worker_settings(district: District) -> dict[str, Any]:
    """A district's workers' twin settings (``target.embedded``-style): its gpu and model, metrics on
    unless its sglang settings turn them off, then its sglang settings."""
    return {"gpu": district.gpu, "model": district.model, "enable_metrics": True, **district.sglang}


def _check_sglang(settings: dict) -> str | None:
    for key in settings:
        if key in NOT_IN_SGLANG:
            return f"{key}: a key of the district (next to sglang), not an sglang setting"
        if key in BY_NAME and not BY_NAME[key].embedded:
            return f"{key}: set by loadlab cluster for each worker, not in a cluster file"
    return check_embedded_settings(settings)


def load_cluster(
    path: str | Path,
    as_target: bool = False,
    overrides: Mapping[str, Any] | None = None,
    source: str = "override ",
) -> ClusterConfig:
    """Reads and checks a cluster file. Relative paths in it (a tokenizer) are relative to the file.
    ``as_target``: a run's target (a profile's ``target.cluster``), which needs one URL to aim at: a front,
    or a single worker. ``overrides``: settings laid over the file (``override_cluster``); ``source``
    prefixes their keys in messages (``--set ``, ``target.cluster_overrides.``)."""
    path = Path(path)
    label = str(path)
    data, lines = read_mapping(path, "cluster", ClusterError)
    data.setdefault("name", path.stem)
    for d in data.get("districts") or []:
        sglang = d.get("sglang") if isinstance(d, dict) else None
        if isinstance(sglang, dict) and isinstance(sglang.get("tokenizer"), str):
            sglang["tokenizer"] = os.path.abspath(path.parent / sglang["tokenizer"])
    try:
        config = ClusterConfig.model_validate(data)
    except ValidationError as e:
        raise ClusterError(validation_message(e, label, lines)) from None

    def fail(loc: list[str], problem: str) -> NoReturn:
        raise ClusterError(f"{where(label, lines, loc)}: {'.'.join(loc)}: {problem}")

    _check_config(config, as_target, fail)
    if overrides:
        # The file is checked first, so every problem from here on is an override's.
        config = override_cluster(config, overrides, label, as_target, source)
    return config


def load_target_cluster(target: TargetConfig) -> ClusterConfig:
    """A profile's ``target.cluster`` as a run's target, with its ``target.cluster_overrides`` laid over."""
    if target.cluster is None:
        raise ValueError("the profile's target has no cluster")
    return load_cluster(target.cluster, True, target.cluster_overrides, f"{CLUSTER_OVERRIDES}.")


def _check_config(config: ClusterConfig, as_target: bool, fail: Callable[[list[str], str], NoReturn]) -> None:
    """What the schema cannot say about one field alone; ``fail(loc, problem)`` raises the error."""
    seen: dict[str, int] = {}
    for i, d in enumerate(config.districts):
        loc = ["districts", str(i)]
        if d.name in seen:
            fail([*loc, "name"], f"{d.name!r} is also district {seen[d.name]}'s name")
        seen[d.name] = i
        for key, value in d.sglang.items():  # one key at a time first: the error names that key
            problem = _check_sglang({key: value})
            if problem:
                fail([*loc, "sglang", str(key)], problem.removeprefix(f"{key}: "))
        problem = _check_sglang(dict(d.sglang))
        if problem:
            fail([*loc, "sglang"], problem)
        try:
            resolve_settings(worker_settings(d))
        except ValueError as e:  # settings that cannot work together (no room left for the KV cache)
            fail([*loc, "sglang"], str(e))
    serving = [i for i, d in enumerate(config.districts) if d.serves is not None]
    if serving and config.front.kind != "omni":
        fail(["districts", str(serving[0]), "serves"], "routing by class needs front kind omni (this front "
             f"is {config.front.kind}: every worker serves every class)")  # fmt: skip
    if as_target and config.front.kind == "none" and config.total_workers > 1:
        fail(["front", "kind"], f"a run aims at one URL, and a cluster without a front has "
             f"{config.total_workers} workers: give it a front (router or omni)")  # fmt: skip


class ClusterOverrideError(ClusterError):
    """A bad override of a cluster file: ``key`` (the override's dotted key, districts by name) and
    ``problem`` (what is wrong), for a caller that names the override its own way (a sweep's axis)."""

    def __init__(self, label: str, source: str, key: str, problem: str):
        super().__init__(f"{label}: {source}{key}: {problem}")
        self.key, self.problem = key, problem


DISTRICT_KEYS = ("workers", "gpu", "model", "serves")
FRONT_KEYS = tuple(Front.model_fields)
TOP_KEYS = ("name", "workers_per_process")
OVERRIDE_KEYS = "name, workers_per_process, front.KEY, districts.NAME.KEY"


def flatten_overrides(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``{"districts": {"online": {"sglang": {"max_running_requests": 32}}}}`` (as ``--set`` nests a dotted
    key) and ``{"districts.online.sglang.max_running_requests": 32}`` alike -> the flat form."""
    flat: dict[str, Any] = {}

    def walk(node: Mapping[str, Any], prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, Mapping):
                walk(value, f"{prefix}{key}.")
            else:
                flat[f"{prefix}{key}"] = value

    walk(overrides, "")
    return flat


def override_cluster(
    config: ClusterConfig,
    overrides: Mapping[str, Any],
    label: str = "<cluster>",
    as_target: bool = False,
    source: str = "override ",
) -> ClusterConfig:
    """A new ``ClusterConfig``: ``config`` with ``overrides`` laid on (dotted keys, nested or flat; a
    district addressed by its name: ``districts.online.sglang.max_running_requests``, ``front.policy``),
    validated as a file is. The config itself is frozen and left as it was; ``model_copy(update=)`` would
    skip validation, so the copy is made from a dump. A bad override is a ``ClusterOverrideError``."""
    flat = flatten_overrides(overrides)
    if not flat:
        return config
    data = config.model_dump()
    names = [d.name for d in config.districts]
    front: dict[str, Any] = {}

    def bad(key: str, problem: str) -> NoReturn:
        raise ClusterOverrideError(label, source, key, problem) from None

    for key, value in flat.items():
        parts = key.split(".")
        if parts[0] == "districts":
            rest = key.removeprefix("districts.")
            # A district's name may hold dots: the longest name the key starts with.
            name = next((n for n in sorted(names, key=len, reverse=True) if rest.startswith(n + ".")), None)
            if len(parts) < 3 or name is None:
                asked = parts[1] if len(parts) > 1 else None
                if asked in names:
                    bad(key, f"name a key of district {asked!r}: {', '.join(DISTRICT_KEYS)}, sglang.SETTING")
                missing = f"no district {asked!r} in this cluster; " if asked else ""
                bad(key, f"{missing}address a district by its name, districts.NAME.KEY (its districts: "
                    f"{', '.join(names)})")  # fmt: skip
            district = data["districts"][names.index(name)]
            field = rest.removeprefix(name + ".").split(".")
            if field[0] == "sglang" and len(field) == 2:
                district["sglang"] = {**district["sglang"], field[1]: value}
            elif len(field) == 1 and field[0] in DISTRICT_KEYS:
                district[field[0]] = value
            else:
                bad(key, f"not a key of a district (known: {', '.join(DISTRICT_KEYS)}, sglang.SETTING)")
        elif parts[0] == "front" and len(parts) == 2 and parts[1] in FRONT_KEYS:
            front[parts[1]] = value
        elif len(parts) == 1 and parts[0] in TOP_KEYS:
            data[parts[0]] = value
        else:
            bad(key, f"not a key of a cluster file that can be overridden (known: {OVERRIDE_KEYS})")
    if front:
        if front.get("kind", data["front"]["kind"]) != data["front"]["kind"]:
            data["front"] = front  # another kind of front: its own defaults, not the file's other kind's
        else:
            data["front"] = {**data["front"], **front}

    def blame(loc: list[str]) -> str:
        """The override behind a problem at ``loc`` (districts by name): the key at, under or above it;
        else the first one (a changed front kind makes a district's serves wrong)."""
        if loc[:1] == ["districts"] and len(loc) > 1 and loc[1].isdigit() and int(loc[1]) < len(names):
            loc = ["districts", names[int(loc[1])], *loc[2:]]
        at = ".".join(loc)
        related = [k for k in flat if k == at or k.startswith(at + ".") or at.startswith(k + ".")]
        return (related or list(flat))[0]

    try:
        new = ClusterConfig.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        bad(blame([str(p) for p in err["loc"]]), describe(err))

    def fail(loc: list[str], problem: str) -> NoReturn:
        bad(blame(loc), problem)

    _check_config(new, as_target, fail)
    return new


def is_cluster_file(path: str | Path) -> bool:
    """A cluster file has districts; a profile and a sweep file do not (an unreadable file is left to the
    profile loader)."""
    try:
        data, _ = read_mapping(path, "cluster", ClusterError)
    except ClusterError:
        return False
    return "districts" in data
