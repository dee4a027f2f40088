"""The cluster file: SGLang workers (the twin) grouped in districts, behind one front. ``ClusterConfig``,
read and checked in one place (``load_cluster``); every mistake is one ``ClusterError`` line naming the
file, the line and the key. ``docs/cluster.md`` documents the format.
"""

from __future__ import annotations

import copy
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

from loadlab.cluster.policies import (
    CLASS_HEADER,
    DEFAULT_CLASS,
    SWITCH_AUTO,
    class_districts,
    switch_problem,
    switch_routes,
)
from loadlab.profile import CLUSTER_OVERRIDES, Profile, ProfileError, TargetConfig
from loadlab.sim.cost import GPUS, MODELS
from loadlab.sim.settings import BY_NAME, check_embedded_settings, resolve_settings
from loadlab.yamlconfig import ConfigError, Lines, describe, read_mapping, validation_message, where

FrontKind = Literal["router", "omni", "none"]
# The policies each front offers (the router's are sglang-router's `--policy` names).
POLICIES: dict[str, tuple[str, ...]] = {
    "router": ("cache_aware", "round_robin", "power_of_two"),
    "omni": ("round_robin", "power_of_two", "least_queue", "least_kv", "prefix"),
    "none": (),
}
DEFAULT_POLICY = {"router": "cache_aware", "omni": "least_queue"}  # the router's own default; omni's
DEFAULT_POLL_INTERVAL_S = 0.5
# sglang-router 0.3.2 polls every worker's /get_load (power_of_two's load signal) every
# --worker-startup-check-interval seconds; its default:
ROUTER_LOAD_CHECK_S = 30
DEFAULT_QUEUE_SIZE = 1024
DEFAULT_SWITCH_AFTER_WAITING = 0
DEFAULT_IN_FLIGHT_FRACTION = 1.0
# The seed's four orientations of its global scheduler (shared/seed/brief.md section 3), each a named set
# of omni's knobs; a key the file sets itself wins over its orientation's. docs/omni.md says why each value.
# The switch cannot name districts in a preset (they are the file's), so a preset says auto (every class
# may divert to every district not serving it) or false (no switch).
ORIENTATIONS: dict[str, dict[str, Any]] = {
    # offline batch: big decode batches. Cache affinity (prefix) raises radix hits, so less prefill cuts in;
    # a deep queue rejects nothing (tails uncontrolled); a class spills only a sustained backlog (32),
    # keeping the other district's batches mostly its own.
    "throughput": {"policy": "prefix", "poll_interval_s": 1.0, "queue_size": 4096, "in_flight_fraction": 1.0,
                   "switch": "auto", "switch_after_waiting": 32},
    # online chat / RAG: small batches in the stable range (omni fills only 3/4 of each worker's
    # max_running_requests, so fewer prefills cut into a decode batch: lower utilisation is its price); no
    # request waits at the front while another district has room; fresh signals for the decisions.
    "latency": {"policy": "least_queue", "poll_interval_s": 0.1, "queue_size": 256, "in_flight_fraction": 0.75,
                "switch": "auto", "switch_after_waiting": 0},
    # strict SLO on the main path: route by KV use (no worker pushed into preemption), a short bounded
    # queue that rejects overload (429) instead of letting P95 grow, and no switch: a class's overload
    # never moves into another class's district.
    "stability": {"policy": "least_kv", "poll_interval_s": 0.25, "queue_size": 32, "in_flight_fraction": 1.0,
                  "switch": False, "switch_after_waiting": 0},
    # scarce GPUs, mixed offline: every free slot anywhere is used at once, nothing is refused (queueing
    # accepted), slow cheap polls and a two-choice policy (latency swings accepted).
    "cost": {"policy": "power_of_two", "poll_interval_s": 2.0, "queue_size": 8192, "in_flight_fraction": 1.0,
             "switch": "auto", "switch_after_waiting": 0},
}  # fmt: skip
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
        description=f"how often the front polls each worker's load; omni: seconds (default "
        f"{DEFAULT_POLL_INTERVAL_S}); router: whole seconds, sglang-router's --worker-startup-check-interval, "
        f"which also times its /get_load polls for power_of_two (default: the router's, "
        f"{ROUTER_LOAD_CHECK_S} s)",
    )
    queue_size: StrictInt | None = Field(
        None, gt=0, description=f"omni: the most requests its queue holds (default {DEFAULT_QUEUE_SIZE})"
    )
    max_in_flight_per_worker: StrictInt | None = Field(
        None,
        gt=0,
        description="omni: the most requests it lets one worker have in flight (its --max-in-flight-per-worker; "
        "default: in_flight_fraction of the worker's max_running_requests); above max_running_requests, the "
        "wait is in the worker's own queue",
    )
    orientation: str | None = Field(
        None,
        description="omni: a named set of its knobs, the seed's four orientations: "
        f"{', '.join(ORIENTATIONS)} (keys set here win over it)",
    )
    switch: Any = Field(
        None,
        description="omni: where a saturated class's overflow may go: {class: [district, ...]}, auto (every "
        "district not serving the class) or false (none, the default)",
    )
    in_flight_fraction: float | None = Field(
        None,
        gt=0,
        le=1,
        description="omni: its limit on requests in flight at a worker, as a fraction of the worker's "
        f"max_running_requests (rounded down; default {DEFAULT_IN_FLIGHT_FRACTION:g}: the whole batch)",
    )
    switch_after_waiting: StrictInt | None = Field(
        None,
        ge=0,
        description="omni: a class switches only while more than this many of its requests wait at omni "
        f"(default {DEFAULT_SWITCH_AFTER_WAITING})",
    )

    @model_validator(mode="before")
    @classmethod
    def _defaults_of_the_kind(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        kind = data.get("kind", "router")
        if kind == "omni":
            defaults = {"policy": DEFAULT_POLICY["omni"], "poll_interval_s": DEFAULT_POLL_INTERVAL_S,
                        "queue_size": DEFAULT_QUEUE_SIZE, "in_flight_fraction": DEFAULT_IN_FLIGHT_FRACTION,
                        "switch": False,
                        "switch_after_waiting": DEFAULT_SWITCH_AFTER_WAITING}  # fmt: skip
            # An unknown name adds nothing here; the orientation field's check names the valid ones.
            name = data.get("orientation")
            preset = ORIENTATIONS.get(name, {}) if isinstance(name, str) else {}
            return {**defaults, **preset, **{k: v for k, v in data.items() if v is not None}}
        if kind == "router" and data.get("policy") is None:
            return {**data, "policy": DEFAULT_POLICY["router"]}
        return data

    @field_validator("orientation")
    @classmethod
    def _known_orientation(cls, orientation: str | None) -> str | None:
        if orientation is not None and orientation not in ORIENTATIONS:
            raise ValueError(f"expected one of {', '.join(ORIENTATIONS)}, got {orientation!r}")
        return orientation

    @field_validator("switch")
    @classmethod
    def _switch_shape(cls, switch: Any) -> Any:
        """False or None: no switch; ``auto``; or {class: [district, ...]} (one district may be given
        alone). What the names mean is checked against the districts by ``load_cluster``."""
        if switch is None or switch is False or switch == SWITCH_AUTO:
            return None if switch is False else switch
        if isinstance(switch, dict) and switch:
            out = {}
            for c, targets in switch.items():
                targets = [targets] if isinstance(targets, str) else targets
                if (
                    not isinstance(c, str)
                    or not isinstance(targets, list)
                    or not all(isinstance(d, str) for d in targets)
                ):
                    raise ValueError(f"{c}: expected a district or a list of districts, got {targets!r}")
                out[c] = targets
            return out
        raise ValueError(
            f"expected {SWITCH_AUTO}, false or a mapping of class to districts (e.g. {{online: [offline]}}), "
            f"got {switch!r}"
        )

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

    @field_validator("poll_interval_s")
    @classmethod
    def _poll_of_the_kind(cls, value: float | None, info: ValidationInfo) -> float | None:
        kind = info.data.get("kind")
        if value is None or kind is None or kind == "omni":
            return value
        if kind == "none":
            raise ValueError("a cluster without a front (kind: none) polls nothing")
        if value != int(value):  # the router's flag takes whole seconds
            raise ValueError(
                f"router: whole seconds (sglang-router's --worker-startup-check-interval), got {value:g}"
            )
        return value

    @field_validator(
        "queue_size",
        "max_in_flight_per_worker",
        "orientation",
        "in_flight_fraction",
        "switch",
        "switch_after_waiting",
    )
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

    def class_pools(self) -> dict[str, list[str]]:
        """Which districts serve each class (``policies.class_districts``)."""
        return class_districts([(d.name, d.serves) for d in self.districts])

    def switch_routes(self) -> dict[str, list[str]]:
        """Each class's switch districts, resolved (``auto`` expanded); empty without a switch."""
        return switch_routes(self.class_pools(), [d.name for d in self.districts], self.front.switch)

    def front_settings(self) -> dict[str, Any] | None:
        """The front's resolved knobs, as the launcher passes them (None without a front): omni's
        orientation, policy, poll interval, queue size, in-flight limit or fraction and switch (resolved); the
        router's policy (and its poll interval when the file sets one)."""
        f = self.front
        if f.kind == "none":
            return None
        if f.kind == "router":
            return {
                "policy": f.policy,
                **({"poll_interval_s": f.poll_interval_s} if f.poll_interval_s else {}),
            }
        return {"orientation": f.orientation, "policy": f.policy, "poll_interval_s": f.poll_interval_s,
                "queue_size": f.queue_size, "max_in_flight_per_worker": f.max_in_flight_per_worker,
                "in_flight_fraction": f.in_flight_fraction, "switch": self.switch_routes(),
                "switch_after_waiting": f.switch_after_waiting}  # fmt: skip

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
    or a single worker. ``overrides``: settings laid over the file, a district by its name
    (``districts.online.sglang.max_running_requests``; ``override_cluster``); ``source`` prefixes their
    keys in messages (``--set ``, ``target.cluster_overrides.``)."""
    path = Path(path)
    label = str(path)
    data, lines = read_mapping(path, "cluster", ClusterError)
    data.setdefault("name", path.stem)
    for d in data.get("districts") or []:
        sglang = d.get("sglang") if isinstance(d, dict) else None
        if isinstance(sglang, dict) and isinstance(sglang.get("tokenizer"), str):
            sglang["tokenizer"] = os.path.abspath(path.parent / sglang["tokenizer"])
    written = copy.deepcopy(data)  # the file's own keys, for the overrides (validation fills in the rest)
    try:
        config = ClusterConfig.model_validate(data)
    except ValidationError as e:
        raise ClusterError(validation_message(e, label, lines)) from None

    def fail(loc: list[str], problem: str) -> NoReturn:
        raise ClusterError(f"{where(label, lines, loc)}: {'.'.join(loc)}: {problem}")

    _check_config(config, as_target, fail, lines)
    if overrides:
        # The file is checked first, so every problem from here on is an override's.
        config = override_cluster(config, written, overrides, label, as_target, source)
    return config


def load_target_cluster(target: TargetConfig) -> ClusterConfig:
    """A profile's ``target.cluster`` as a run's target, with its ``target.cluster_overrides`` laid over."""
    if target.cluster is None:
        raise ValueError("the profile's target has no cluster")
    return load_cluster(target.cluster, True, target.cluster_overrides, f"{CLUSTER_OVERRIDES}.")


def _check_config(
    config: ClusterConfig, as_target: bool, fail: Callable[[list[str], str], NoReturn], given: Lines
) -> None:
    """What the schema cannot say about one field alone; ``fail(loc, problem)`` raises the error. ``given``:
    the key paths the file (or the overrides) set, for a problem of two keys to name the one given."""
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
    switch = config.front.switch
    if isinstance(switch, dict):  # auto needs no check: it names only districts that exist
        pools, names = config.class_pools(), [d.name for d in config.districts]
        for cls, targets in switch.items():
            problem = switch_problem(pools, names, cls, targets)
            if problem:
                fail(["front", "switch", cls], problem)
    front = config.front
    if config.switch_routes() and front.switch_after_waiting > front.queue_size:
        key = "switch_after_waiting" if ("front", "switch_after_waiting") in given else "queue_size"
        fail(["front", key], f"the switch waits for more than {front.switch_after_waiting} requests in line, but "
             f"the queue holds {front.queue_size}: it would answer 429 before the switch ever diverts "
             "(switch_after_waiting may not exceed queue_size)")  # fmt: skip
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
    written: Mapping[str, Any],
    overrides: Mapping[str, Any],
    label: str = "<cluster>",
    as_target: bool = False,
    source: str = "override ",
) -> ClusterConfig:
    """A new ``ClusterConfig``: ``config`` (loaded from the mapping ``written``) with ``overrides`` laid on
    (dotted keys, nested or flat; a district addressed by its name: ``districts.online.sglang.
    max_running_requests``, ``front.policy``, ``front.switch.online``), validated and checked as a file is;
    ``config`` itself is frozen and stays as it was. The values go over the file's own keys, not over the
    resolved config (``model_copy(update=)`` would also skip validation): what the front's kind and
    orientation fill in is filled in again for the new values, as if the file said so. A bad override is a
    ``ClusterOverrideError`` naming it."""
    flat = flatten_overrides(overrides)
    if not flat:
        return config
    data = copy.deepcopy(dict(written))
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
                district["sglang"] = {**(district.get("sglang") or {}), field[1]: value}
            elif len(field) == 1 and field[0] in DISTRICT_KEYS:
                district[field[0]] = value
            else:
                bad(key, f"not a key of a district (known: {', '.join(DISTRICT_KEYS)}, sglang.SETTING)")
        elif parts[0] == "front" and len(parts) == 2 and parts[1] in FRONT_KEYS:
            front[parts[1]] = value
        elif parts[:2] == ["front", "switch"] and len(parts) == 3:  # one class's switch districts
            switch = front.get("switch", (data.get("front") or {}).get("switch"))
            front["switch"] = {**(switch if isinstance(switch, dict) else {}), parts[2]: value}
        elif len(parts) == 1 and parts[0] in TOP_KEYS:
            data[parts[0]] = value
        else:
            bad(key, f"not a key of a cluster file that can be overridden (known: {OVERRIDE_KEYS})")
    if front:
        if front.get("kind", config.front.kind) != config.front.kind:
            data["front"] = front  # another kind of front: its own defaults, not the file's other kind's
        else:
            data["front"] = {**(data.get("front") or {}), **front}

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

    _check_config(new, as_target, fail, {tuple(k.split(".")): 0 for k in flat})
    return new


def check_classes(
    profile: Profile, profile_path: str | Path | None, config: ClusterConfig, cluster_path: str | Path
) -> list[str]:
    """A profile's SLO classes against the cluster it runs on (its ``target.cluster``, or virtual time's
    ``--cluster``), before any load: what omni would do with each class's requests. Here and not in the
    profile loader, which sits below the clusters (docs/architecture.md, Layers).

    Only a cluster that routes by class (an omni front, a district with ``serves``) is checked. A
    ``ProfileError`` (one line, the profile's file:line) for a class served by no district, for a class a
    district names whose requests do not carry it in omni's header (omni would route them as class-less),
    and for a profile without classes that no district serves. Returns warnings: a district serving a class
    the profile does not define is not an error (a cluster file serves many profiles)."""
    if config.front.kind != "omni" or all(d.serves is None for d in config.districts):
        return []  # every worker serves every request
    label = str(profile_path) if profile_path is not None else "<profile>"
    lines = _lines(profile_path, ProfileError)
    cluster = _shown(cluster_path)
    pools = class_districts([(d.name, d.serves) for d in config.districts])
    served = "; ".join(f"{d.name} serves {', '.join(d.serves) if d.serves else 'any class'}"
                       for d in config.districts)  # fmt: skip

    def fail(loc: list[str], problem: str) -> None:
        raise ProfileError(f"{where(label, lines, loc)}: {'.'.join(loc)}: {problem}")

    classes = profile.classes or []
    if not classes and DEFAULT_CLASS not in pools:
        fail(["target", "cluster"], f"every district of {cluster} serves named classes only ({served}) and the "
             "profile has no classes: omni would refuse every request; give the profile classes or the "
             "cluster a district without serves")  # fmt: skip
    for i, cls in enumerate(classes):
        if cls.name not in pools:  # no district names it: it goes where class-less requests go, if anywhere
            if DEFAULT_CLASS not in pools:
                fail(
                    ["classes", str(i), "name"],
                    f"{cls.name!r} is served by no district of {cluster} ({served})",
                )
            continue
        header = cls.carry.header
        if header is None or header.lower() != CLASS_HEADER:
            naming = ", ".join(d.name for d in config.districts if d.serves and cls.name in d.serves)
            sent = "no class header" if header is None else f"its class in {header}"
            fail(["classes", str(i), "carry", "header"],
                 f"class {cls.name!r} is routed to district {naming} of {cluster} by the {CLASS_HEADER} "
                 f"header, and its requests carry {sent}: set carry.header: {CLASS_HEADER}")  # fmt: skip
    names = {cls.name for cls in classes}
    cluster_lines = _lines(cluster_path, ClusterError)
    warnings = []
    for j, d in enumerate(config.districts):
        for c in d.serves or ():
            if c not in names:
                whose = f"its classes: {', '.join(sorted(names))}" if names else "it has no classes"
                warnings.append(f"{where(cluster, cluster_lines, ['districts', str(j), 'serves'])}: "
                                f"districts.{j}.serves: district {d.name} serves {c!r}, which is not a class "
                                f"of {label} ({whose}): no request of the run is of that class")  # fmt: skip
    return warnings


def _lines(path: str | Path | None, error: type[ConfigError]) -> Lines:
    """The key lines of a file already loaded (for the message's file:line); none when it cannot be read."""
    if path is None:
        return {}
    try:
        return read_mapping(path, "file", error)[1]
    except ConfigError:
        return {}


def _shown(path: str | Path) -> str:
    """A path as messages show it: relative to the working directory when under it (a profile's
    target.cluster is made absolute when it is loaded)."""
    rel = os.path.relpath(path)
    return str(path) if rel.startswith("..") else rel


def is_cluster_file(path: str | Path) -> bool:
    """A cluster file has districts; a profile and a sweep file do not (an unreadable file is left to the
    profile loader)."""
    try:
        data, _ = read_mapping(path, "cluster", ClusterError)
    except ClusterError:
        return False
    return "districts" in data
