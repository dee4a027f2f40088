"""Profiles: the YAML description of a load test, its schema, validation and command-line overrides.

Every user mistake becomes one ``ProfileError`` line naming the file, the line, the key and what is
wrong; callers turn it into exit status 2 before any load is sent.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from loadlab.sim.settings import check_embedded_settings
from loadlab.yamlconfig import ConfigError, Lines, check_mapping, read_mapping, validation_message, where

APIS = ("generate", "completions", "chat")
API_PATHS = {"generate": "/generate", "completions": "/v1/completions", "chat": "/v1/chat/completions"}
EMBEDDED = "embedded"
CLUSTER_OVERRIDES = "target.cluster_overrides"  # the profile key of the settings laid over a cluster file


class ProfileError(ConfigError):
    """A user mistake in a profile or an override; its message is the one line to print."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# Strict: YAML's `true` or `1.5` for a count is a mistake, not 1.
PositiveInt = Annotated[StrictInt, Field(gt=0)]
NonNegativeInt = Annotated[StrictInt, Field(ge=0)]


class TargetConfig(_Strict):
    url: str = Field(EMBEDDED, description="SGLang server base URL, or 'embedded' for the simulated server")
    # Settings for the embedded server, as SGLang launch flags without the dashes
    # (e.g. max_running_requests: 64); ignored when url is a real server.
    embedded: dict[str, Any] = Field(default_factory=dict)
    # A cluster file (`loadlab cluster`, docs/cluster.md) started for the run in place of the one twin;
    # the run aims at its front. Relative to the profile file; loaded and checked where it is started.
    cluster: str | None = Field(None, description="cluster file started for the run (url: embedded)")
    # Settings laid over that file (a district by its name), nested or dotted: `--set
    # target.cluster_overrides.districts.online.sglang.max_running_requests=32` (a sweep's `cluster.` axes).
    # Checked against the file where the cluster is loaded (loadlab.cluster.config.override_cluster).
    cluster_overrides: dict[str, Any] = Field(
        default_factory=dict, description="settings laid over target.cluster's file, districts by name"
    )
    api: Literal["generate", "completions", "chat"] = "generate"
    model: str | None = Field(None, description="model name for the OpenAI APIs; default: the server's")
    tokenizer: str | None = Field(None, description="local tokenizer.json for exact text prompt lengths")
    timeout_s: float = Field(600.0, gt=0, description="deadline for a whole request")
    idle_timeout_s: float = Field(60.0, gt=0, description="longest silence allowed within a stream")
    reader: Literal["lean", "geventhttpclient"] = Field(
        "lean",
        description="the stream reader: loadlab's own, or geventhttpclient's (https: always the latter)",
    )
    receipt_clock: Literal["kernel", "user"] = Field(
        "kernel",
        description="what times each event on receipt: the kernel's receive timestamp (lean reader, where the "
        "platform has SO_TIMESTAMPNS; else user space) or user space (perf_counter() after the read)",
    )
    metrics_interval_s: float = Field(1.0, gt=0, description="how often the server's /metrics is scraped")
    # A cluster behind a router: list every worker; the series are kept per server and summed per round.
    metrics_urls: list[str] | None = Field(
        None, description="servers whose /metrics are scraped; default: url"
    )
    # Where the target's API key is (never the key itself: the resolved profile is recorded in the
    # manifest). Neither: the variable LOADLAB_API_KEY when it is set, else no key (read_api_key).
    api_key_env: str | None = Field(None, description="environment variable holding the target's API key")
    api_key_file: str | None = Field(
        None, description="file holding the target's API key (relative to the profile)"
    )

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, name: str | None) -> str | None:
        if name is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ValueError(f"the name of an environment variable, e.g. SGLANG_API_KEY (got {name!r})")
        return name

    @field_validator("api_key_file")
    @classmethod
    def _one_key_source(cls, path: str | None, info: ValidationInfo) -> str | None:
        if path is not None and not path:
            raise ValueError("the path of a file holding the key")
        if path is not None and info.data.get("api_key_env") is not None:
            raise ValueError("give api_key_env or api_key_file, not both")
        return path

    @field_validator("cluster")
    @classmethod
    def _cluster_alone(cls, cluster: str | None, info: ValidationInfo) -> str | None:
        if cluster is None:
            return None
        if not cluster:
            raise ValueError("the path of a cluster file, e.g. ../clusters/four-a100.yaml")
        if info.data.get("url", EMBEDDED) != EMBEDDED:
            raise ValueError("only with url: embedded (the run starts the cluster and aims at its front)")
        if info.data.get("embedded"):
            raise ValueError("the cluster file sets its workers' settings: drop target.embedded")
        return cluster

    @field_validator("cluster_overrides")
    @classmethod
    def _overrides_need_a_cluster(cls, overrides: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if overrides and not info.data.get("cluster"):
            raise ValueError("only with target.cluster (the cluster file they are laid over)")
        return overrides

    @model_validator(mode="after")
    def _url_shape(self):
        for i, url in enumerate(self.metrics_urls or []):
            problem = url_problem(url)
            if problem:
                raise ValueError(f"metrics_urls[{i}]: not an http(s) URL: {problem} (got {url!r})")
            if url in self.metrics_urls[:i]:
                raise ValueError(f"metrics_urls[{i}]: {url} is listed twice")
        if self.url == EMBEDDED:
            return self
        problem = url_problem(self.url)
        if problem:
            raise ValueError(f"url must be 'embedded' or an http(s) URL: {problem} (got {self.url!r})")
        return self


def url_problem(url: str) -> str | None:
    """What is wrong with a target URL, or None."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in 0-65535
    except ValueError as e:
        return str(e)
    if parts.scheme not in ("http", "https"):
        return "it must start with http:// or https://"
    if not parts.hostname:
        return "it has no host name"
    if parts.query or parts.fragment:
        return "a query string or fragment cannot be part of the base URL"
    return None


class LoadConfig(_Strict):
    # closed: `concurrency` requests always in flight. open: requests arrive at `rate` per second
    # whatever the server does (bench_serving's --request-rate), optionally capped at `concurrency`.
    model: Literal["closed", "open"] = "closed"
    concurrency: PositiveInt | None = 8
    rate: float | None = Field(None, gt=0, description="open loop: requests per second")
    # trace: each request at its own timestamp in a `trace` workload's file (no rate), divided by `speed`.
    arrival: Literal["poisson", "constant", "trace"] = "poisson"
    speed: float = Field(
        1.0, gt=0, description="arrival: trace: replay this many times faster than the trace"
    )

    @model_validator(mode="before")
    @classmethod
    def _open_loop_is_uncapped_by_default(cls, data: Any) -> Any:
        # The default of 8 is the closed loop's; an open loop has no cap unless the profile sets one.
        if isinstance(data, dict) and data.get("model") == "open" and "concurrency" not in data:
            return {**data, "concurrency": None}
        return data

    @model_validator(mode="after")
    def _model_fields(self):
        if self.arrival == "trace":
            if self.model != "open":
                raise ValueError("arrival: trace is an open-loop arrival process: set model: open")
            if self.rate is not None:
                raise ValueError("arrival: trace sends at the trace's own times: drop rate (use speed)")
            return self
        if self.speed != 1.0:
            raise ValueError("speed applies to arrival: trace only")
        if self.model == "open" and self.rate is None:
            raise ValueError("an open-loop load needs rate (requests per second)")
        if self.model == "closed" and self.concurrency is None:
            raise ValueError("a closed-loop load needs concurrency")
        if self.model == "closed" and self.rate is not None:
            raise ValueError("rate applies to model: open only (closed loop holds concurrency in flight)")
        return self


class RequestsConfig(_Strict):
    warmup: NonNegativeInt = 0
    measured: PositiveInt = 100


class SloConfig(_Strict):
    ttft_p95_ms: float | None = Field(None, gt=0)
    tpot_p95_ms: float | None = Field(None, gt=0)
    itl_p95_ms: float | None = Field(None, gt=0)
    e2e_p95_ms: float | None = Field(None, gt=0)


def _check_length_ranges(config: BaseModel, names: tuple[str, ...], at_least: dict[str, int]) -> None:
    """Each ``name`` is fixed or drawn from ``name_range`` ([low, high], inclusive): one must be set, the range
    must be ordered, and ``at_least`` gives a smallest length."""
    for name in names:
        rng = getattr(config, f"{name}_range")
        if rng is not None and rng[0] > rng[1]:
            raise ValueError(f"{name}_range must be [low, high] with low <= high (got {list(rng)})")
        if rng is None and getattr(config, name) is None:
            raise ValueError(f"set {name} or {name}_range")
        least = at_least.get(name, 1)
        if rng is None and getattr(config, name) < least:
            raise ValueError(f"{name} must be at least {least} (the first two tokens make prompts unique)")
        if rng is not None and rng[0] < least:
            raise ValueError(f"{name}_range must start at {least} or more")


class _WorkloadBase(_Strict):
    """What every workload kind has."""

    # SGLang's sampling parameter: true (bench_serving's choice) runs every request to max_new_tokens; false
    # lets the model stop at its EOS (the twin: at a length drawn by its --eos-len-dist, docs/twin.md).
    ignore_eos: StrictBool = Field(True, description="run every request to max_new_tokens (no early EOS)")


class RagWorkloadConfig(_WorkloadBase):
    kind: Literal["rag"]
    input_len: PositiveInt = 1024
    output_len: PositiveInt = 256
    instruction_len: NonNegativeInt = 48  # shared by every request
    question_len: PositiveInt = 32  # unique per request
    passages_per_prompt: PositiveInt = 4
    corpus_size: PositiveInt = 2000
    zipf_s: float = Field(1.1, gt=0, description="Zipf exponent of passage popularity")

    @model_validator(mode="after")
    def _fits(self):
        if self.passages_per_prompt > self.corpus_size:
            raise ValueError(
                f"passages_per_prompt ({self.passages_per_prompt}) cannot exceed corpus_size ({self.corpus_size})"
            )
        fixed = self.instruction_len + self.question_len
        if self.input_len < fixed + self.passages_per_prompt:
            raise ValueError(
                f"input_len {self.input_len} is too short for instruction_len + question_len "
                f"({fixed}) plus {self.passages_per_prompt} passages of at least one token"
            )
        return self


class SharedPrefixWorkloadConfig(_WorkloadBase):
    kind: Literal["shared_prefix"]
    num_groups: PositiveInt = 16
    # round_robin: request i is of group i % num_groups; random: a seeded draw per request (bench_serving
    # shuffles its prompts), so a front's round robin cannot line up with the groups by accident.
    group_order: Literal["round_robin", "random"] = "round_robin"
    system_prompt_len: PositiveInt = 2048
    question_len: PositiveInt = 128
    output_len: PositiveInt = 256


class RandomPrefixWorkloadConfig(_WorkloadBase):
    kind: Literal["random_prefix"]
    input_len: PositiveInt | None = 512
    input_len_range: tuple[PositiveInt, PositiveInt] | None = None  # drawn uniformly, inclusive
    output_len: PositiveInt | None = 128
    output_len_range: tuple[PositiveInt, PositiveInt] | None = None

    @model_validator(mode="after")
    def _ranges(self):
        _check_length_ranges(self, ("input_len", "output_len"), {"input_len": 2})
        return self


class ConversationWorkloadConfig(_WorkloadBase):
    """Multi-turn sessions (docs/workloads.md, *conversation*): request i is turn i % turns + 1 of session
    i // turns; each turn's prompt holds the session's earlier turns and the server's replies."""

    kind: Literal["conversation"]
    turns: PositiveInt = 3  # requests per session
    system_prompt_len: NonNegativeInt = 256  # opens every session's first prompt; 0: none
    num_system_prompts: PositiveInt = 1  # session s has system prompt s % num_system_prompts
    user_len: PositiveInt | None = 64  # each turn's user message
    user_len_range: tuple[PositiveInt, PositiveInt] | None = None  # drawn uniformly, inclusive
    output_len: PositiveInt | None = 128
    output_len_range: tuple[PositiveInt, PositiveInt] | None = None
    think_time_s: float = Field(0.0, ge=0, description="after a reply ends, before the next turn is sent")

    @model_validator(mode="after")
    def _lengths(self):
        _check_length_ranges(self, ("user_len", "output_len"), {"user_len": 2})
        return self


class DatasetWorkloadConfig(_WorkloadBase):
    """Prompts replayed from a local file (loadlab/workload/datasets.py)."""

    kind: Literal["dataset"]
    path: str = Field(description="a JSONL file of prompts or a ShareGPT JSON file (relative to the profile)")
    format: Literal["auto", "jsonl", "sharegpt"] = "auto"  # auto: a file starting with [ is ShareGPT
    turns: Literal["first", "every"] = "first"  # ShareGPT: each conversation's first turn, or every turn
    sample: Literal["sequential", "without_replacement", "with_replacement"] = "sequential"
    output_len: PositiveInt | None = Field(None, description="every request's output length, not the file's")
    # The length filter, in tokens as counted (docs/workloads.md): entries outside it are left out.
    min_input_len: PositiveInt = 1
    max_input_len: PositiveInt | None = None
    max_output_len: PositiveInt | None = None

    @model_validator(mode="after")
    def _filter(self):
        if not self.path:
            raise ValueError("path: the dataset file, e.g. data/prompts.jsonl")
        if self.max_input_len is not None and self.max_input_len < self.min_input_len:
            raise ValueError(
                f"max_input_len {self.max_input_len} is below min_input_len {self.min_input_len}"
            )
        return self


class TraceWorkloadConfig(_WorkloadBase):
    """A Mooncake-style trace replayed with synthesised prompts (loadlab/workload/trace.py)."""

    kind: Literal["trace"]
    path: str = Field(description="a Mooncake-style JSONL trace (relative to the profile)")
    block_size: PositiveInt = Field(512, description="prompt tokens per hash id")

    @field_validator("path")
    @classmethod
    def _path(cls, path: str) -> str:
        if not path:
            raise ValueError("the trace file, e.g. data/trace.jsonl")
        return path


RangeRatio = Annotated[float, Field(ge=0, le=1)]


class RandomWorkloadConfig(_WorkloadBase):
    """bench_serving's random and random-ids datasets, under its option names (loadlab/workload/bench_serving.py)."""

    kind: Literal["random", "random-ids"]
    random_input_len: PositiveInt = 1024
    random_output_len: PositiveInt = 1024
    random_range_ratio: RangeRatio = 0.0  # lengths uniform from max(1, int(L x ratio)) to L


class GeneratedSharedPrefixWorkloadConfig(_WorkloadBase):
    """bench_serving's generated-shared-prefix dataset, under its option names."""

    kind: Literal["generated-shared-prefix"]
    gsp_num_groups: PositiveInt = 64
    gsp_prompts_per_group: PositiveInt = 16
    gsp_system_prompt_len: PositiveInt = 2048
    gsp_question_len: PositiveInt = 128
    gsp_output_len: PositiveInt = 256
    gsp_range_ratio: RangeRatio = 1.0  # newer bench_serving: each length uniform from max(1, int(L x r)) to L


WorkloadConfig = Annotated[
    RagWorkloadConfig
    | SharedPrefixWorkloadConfig
    | RandomPrefixWorkloadConfig
    | ConversationWorkloadConfig
    | DatasetWorkloadConfig
    | TraceWorkloadConfig
    | RandomWorkloadConfig
    | GeneratedSharedPrefixWorkloadConfig,
    Field(discriminator="kind"),
]
FILE_KINDS = ("dataset", "trace")  # the kinds that read a file from `path`


# Custom request headers the real router (sglang-router) forwards to its workers: only these (and a few fixed
# ones), so a class carried in a header must use one for a front to see it (/work/shared/design/omni.md).
CLASS_HEADER_PREFIX = "x-request-id-"
SHARE_TOLERANCE = 1e-9


class CarryConfig(_Strict):
    """How a class is carried to the server (any combination; none: the class is only in the records)."""

    # SGLang's request field `priority` (/generate and /v1/completions; --enable-priority-scheduling)
    priority: StrictInt | None = None
    # A request header, x-request-id-<something>, whose value is the class name
    header: str | None = Field(None, description="header named x-request-id-..., valued the class name")
    # The served model name to ask for (the OpenAI APIs' `model`): a front routing by model sees it
    model: str | None = None

    @field_validator("header")
    @classmethod
    def _forwarded_header(cls, header: str | None) -> str | None:
        if header is None:
            return None
        if not header.lower().startswith(CLASS_HEADER_PREFIX) or len(header) == len(CLASS_HEADER_PREFIX):
            raise ValueError(
                f"must start with {CLASS_HEADER_PREFIX} (e.g. x-request-id-class): the only custom "
                f"headers the router forwards (got {header!r})"
            )
        if not re.fullmatch(r"[A-Za-z0-9-]+", header):
            raise ValueError(f"letters, digits and dashes only (got {header!r})")
        return header

    @field_validator("model")
    @classmethod
    def _model_name(cls, model: str | None) -> str | None:
        if model is not None and not model.strip():
            raise ValueError("a served model name, not empty")
        return model


class ClassConfig(_Strict):
    """One SLO class: a share of the requests, optionally its own workload and SLO, and how it is carried."""

    name: str
    share: float = Field(gt=0, le=1, description="fraction of the requests")
    workload: WorkloadConfig | None = None  # default: the profile's
    slo: SloConfig | None = None  # default: the profile's
    carry: CarryConfig = Field(default_factory=CarryConfig)

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise ValueError(f"letters, digits, '_', '.' and '-' only, not empty (got {name!r})")
        return name


class Profile(_Strict):
    name: str = "unnamed"
    description: str = ""
    seed: StrictInt = 0
    target: TargetConfig = Field(default_factory=TargetConfig)
    load: LoadConfig = Field(default_factory=LoadConfig)
    requests: RequestsConfig = Field(default_factory=RequestsConfig)
    workload: WorkloadConfig
    slo: SloConfig = Field(default_factory=SloConfig)
    classes: list[ClassConfig] | None = None  # SLO classes (docs/workloads.md); None: one class, as before
    # Without it a class with no objective (no slo of its own and none in the profile's to inherit) gets the
    # verdict n/a, which the overall verdict skips: a forgotten SLO would pass silently.
    classes_require_slo: StrictBool = Field(
        False, description="every class must have an SLO objective, its own or the profile's slo it inherits"
    )

    def class_slo(self, cls: ClassConfig) -> SloConfig:
        """The SLO a class is judged by: its own ``slo`` when it sets one, else the profile's."""
        return cls.slo if cls.slo is not None else self.slo

    @property
    def total_requests(self) -> int:
        return self.requests.warmup + self.requests.measured

    @property
    def conversation(self) -> bool:
        """Whether requests are turns of sessions, each prompt holding the session's history."""
        return isinstance(self.workload, ConversationWorkloadConfig)

    @property
    def session_turns(self) -> int:
        """Requests per session, sent in order by one user: a conversation's turns, else 1."""
        return self.workload.turns if isinstance(self.workload, ConversationWorkloadConfig) else 1


# Command-line overrides common to `loadlab run` and `locust -f locustfile.py`: flag -> profile key.
CLI_OVERRIDES = {
    "host": "target.url",
    "api": "target.api",
    "concurrency": "load.concurrency",
    "num_requests": "requests.measured",
    "warmup_requests": "requests.warmup",
    "input_len": "workload.input_len",
    "output_len": "workload.output_len",
    "seed": "seed",
    "tokenizer": "target.tokenizer",
    "model": "target.model",
}


def load_profile(path: str | Path, overrides: dict[str, Any] | None = None) -> Profile:
    """Loads and validates a profile file, applying dotted-key overrides ({"load.concurrency": 4})."""
    path = Path(path)
    label = str(path)
    data, lines = read_mapping(path, "profile", ProfileError)
    target = data.get("target")
    if isinstance(target, dict):
        # The file's paths are relative to the profile file (an override's, to the working directory).
        for key in ("cluster", "api_key_file"):
            if isinstance(target.get(key), str) and target[key]:
                target[key] = os.path.abspath(path.parent / target[key])
    workloads = [data.get("workload")]
    if isinstance(data.get("classes"), list):
        workloads += [c.get("workload") for c in data["classes"] if isinstance(c, dict)]
    for w in workloads:
        if (
            isinstance(w, dict)
            and w.get("kind") in FILE_KINDS
            and isinstance(w.get("path"), str)
            and w["path"]
        ):
            # A workload's file is relative to the profile file too.
            w["path"] = os.path.abspath(path.parent / Path(w["path"]).expanduser())
    kind = data.get("workload", {}).get("kind") if isinstance(data.get("workload"), dict) else None
    for key, value in (overrides or {}).items():
        if kind == "shared_prefix" and key == "workload.input_len":
            raise ProfileError(
                f"{label}: --input-len: a shared_prefix workload has no input_len; use "
                "--set workload.system_prompt_len=N or --set workload.question_len=N"
            )
        if kind == "conversation" and key == "workload.input_len":
            raise ProfileError(
                f"{label}: --input-len: a conversation workload has no input_len (each turn's prompt holds the "
                "earlier turns); use --set workload.user_len=N or --set workload.system_prompt_len=N"
            )
        if key in _LENGTH_KEYS.get(kind, {}):
            named = _LENGTH_KEYS[kind][key]
            if named is None:
                raise ProfileError(f"{label}: --{key.split('.')[1].replace('_', '-')}: a {kind} workload "
                                   f"takes its lengths from {_LENGTH_SOURCE[kind]}")  # fmt: skip
            key = named
        if kind in ("random_prefix", "conversation") and key in ("workload.input_len", "workload.output_len"):
            data["workload"].pop(key.split(".")[1] + "_range", None)  # a fixed length replaces a range
        if key == "target.url" and value != EMBEDDED and isinstance(data.get("target"), dict):
            # A server given on the command line replaces the cluster, and what was laid over it.
            data["target"].pop("cluster", None)
            data["target"].pop("cluster_overrides", None)
        _set_dotted(data, key, value, label)
    return validate_profile(data, label, lines)


# --input-len / --output-len on kinds whose lengths have other names (bench_serving's), or come from a file
# (None: refused).
_RANDOM_LENGTHS = {
    "workload.input_len": "workload.random_input_len",
    "workload.output_len": "workload.random_output_len",
}
_LENGTH_KEYS: dict[str | None, dict[str, str | None]] = {
    "random": _RANDOM_LENGTHS,
    "random-ids": _RANDOM_LENGTHS,
    "generated-shared-prefix": {"workload.input_len": None, "workload.output_len": "workload.gsp_output_len"},
    "dataset": {"workload.input_len": None},
    "trace": {"workload.input_len": None, "workload.output_len": None},
}
_LENGTH_SOURCE = {
    "generated-shared-prefix": "gsp_system_prompt_len + gsp_question_len (--set workload.gsp_question_len=N)",
    "dataset": "its file (filter them with --set workload.max_input_len=N)",
    "trace": "its file's input_length and output_length",
}

WORKLOAD_KINDS = (
    "rag", "shared_prefix", "random_prefix", "conversation", "dataset", "trace", "random", "random-ids",
    "generated-shared-prefix",
)  # fmt: skip


def validate_profile(data: dict[str, Any], label: str = "<profile>", lines: Lines | None = None) -> Profile:
    lines = lines or {}
    target = data.get("target")
    if isinstance(target, dict) and "api_key" in target:
        # Said without the value (pydantic's message would quote it), and before it could be recorded.
        loc = ["target", "api_key"]
        raise ProfileError(
            f"{where(label, lines, loc)}: target.api_key: a key is never a profile value (the profile is "
            "recorded in the manifest): name its environment variable (target.api_key_env) or file "
            "(target.api_key_file)"
        )
    try:
        profile = Profile.model_validate(data)
    except ValidationError as e:
        raise ProfileError(validation_message(e, label, lines, WORKLOAD_KINDS)) from None
    if profile.target.embedded:
        embedded = profile.target.embedded
        check_mapping(embedded, check_embedded_settings, ["target", "embedded"], label, lines, ProfileError)
    if profile.classes is not None:
        _check_classes(profile, label, lines)
    if profile.session_turns > 1:
        _check_sessions(profile, label, lines)
    _check_files_and_arrivals(profile, label, lines)
    return profile


def _check_files_and_arrivals(profile: Profile, label: str, lines: Lines) -> None:
    """Every workload's file exists; trace arrivals have a trace to take their times from."""

    def fail(loc: list[str], problem: str) -> None:
        raise ProfileError(f"{where(label, lines, loc)}: {'.'.join(loc)}: {problem}")

    places = [(["workload"], profile.workload)]
    places += [(["classes", str(i), "workload"], c.workload) for i, c in enumerate(profile.classes or [])]
    for loc, w in places:
        if w is not None and w.kind in FILE_KINDS:
            p = Path(w.path)
            if not p.is_file():
                fail(
                    [*loc, "path"],
                    f"cannot read {w.path!r}: {'not a file' if p.exists() else 'no such file'}",
                )
    if profile.load.arrival == "trace":
        if profile.workload.kind != "trace":
            fail(
                ["load", "arrival"],
                f"trace arrivals need a trace workload (kind: trace), not {profile.workload.kind}",
            )
        if profile.classes:
            fail(["load", "arrival"], "trace arrivals replay one trace in its order: not with classes")


def _check_sessions(profile: Profile, label: str, lines: Lines) -> None:
    """A conversation's sessions are whole within a phase (request i is turn i % turns + 1 of session
    i // turns, so warm-up must end at a session boundary) and of one class."""
    turns = profile.session_turns
    warmup = profile.requests.warmup
    if warmup % turns:
        lower, upper = warmup - warmup % turns, warmup + turns - warmup % turns
        raise ProfileError(
            f"{where(label, lines, ['requests', 'warmup'])}: requests.warmup: {warmup} warm-up requests are not "
            f"whole sessions of workload.turns {turns} (a session's turns share one phase): use a multiple of "
            f"{turns}, e.g. {lower} or {upper}"
        )
    if profile.classes is not None:
        raise ProfileError(
            f"{where(label, lines, ['classes'])}: classes: not with a conversation workload (the classes split "
            "requests one by one; a session's turns must stay together): drop classes"
        )


def _check_classes(profile: Profile, label: str, lines: Lines) -> None:
    """What the schema cannot say about one class alone: the shares, the names, the carry against the API."""

    def fail(loc: list[str], problem: str) -> None:
        raise ProfileError(f"{where(label, lines, loc)}: {'.'.join(loc)}: {problem}")

    classes = profile.classes
    if not classes:
        fail(["classes"], "an empty list: drop the key or give at least one class")
    seen: dict[str, int] = {}
    for i, cls in enumerate(classes):
        if cls.name in seen:
            fail(["classes", str(i), "name"], f"{cls.name!r} is also the name of classes[{seen[cls.name]}]")
        seen[cls.name] = i
        if isinstance(cls.workload, ConversationWorkloadConfig):
            fail(["classes", str(i), "workload", "kind"],
                 "not conversation (the classes split requests one by one; a session's turns must stay "
                 "together)")  # fmt: skip
        api = profile.target.api
        if cls.carry.priority is not None and api == "chat":
            fail(["classes", str(i), "carry", "priority"],
                 "not with api: chat (the router drops priority on /v1/chat/completions); use generate or "
                 "completions, or carry the class in a header")  # fmt: skip
        if cls.carry.model is not None and api == "generate":
            fail(["classes", str(i), "carry", "model"],
                 "the native /generate has no model field; use api: completions or chat")  # fmt: skip
        if profile.classes_require_slo and not has_objective(profile.class_slo(cls)):
            why = (
                "its slo sets none" if cls.slo is not None else "it has no slo and the profile's slo has none"
            )
            fail(["classes", str(i), "slo"],
                 f"class {cls.name!r} has no SLO objective ({why}) and classes_require_slo is true: give it "
                 "one, e.g. slo: {ttft_p95_ms: 2000}")  # fmt: skip
    total = sum(cls.share for cls in classes)
    if abs(total - 1.0) > SHARE_TOLERANCE:
        fail(
            ["classes"],
            f"the shares sum to {total:.12g}, not 1 ({', '.join(f'{c.name} {c.share:g}' for c in classes)})",
        )


def has_objective(slo: SloConfig) -> bool:
    """Whether an SLO bounds anything (every key of ``SloConfig`` is an objective, unset ones None)."""
    return any(v is not None for v in slo.model_dump().values())


def _set_dotted(data: dict[str, Any], key: str, value: Any, label: str) -> None:
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ProfileError(f"{label}: override {key}: {part} is not a mapping")
        node = child
    node[parts[-1]] = value


def parse_set_option(item: str) -> tuple[str, Any]:
    """Parses one `--set key=value` override; the value is read as YAML (numbers, lists, null)."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ProfileError(f"--set {item!r}: expected KEY=VALUE, e.g. --set workload.zipf_s=1.3")
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


# The API key of a secured target (SGLang's --api-key, a gateway's): read from the environment or a file at
# start, never from a profile value or the command line, and sent as `Authorization: Bearer <key>`.
API_KEY_ENV = "LOADLAB_API_KEY"  # used when the profile names neither a variable nor a file
REDACTED = "<redacted>"


def read_api_key(target: TargetConfig, label: str = "<profile>") -> str | None:
    """The target's API key: from ``target.api_key_env``'s variable, ``target.api_key_file``'s file, or
    else ``LOADLAB_API_KEY`` when set (None: no key). A variable or file the profile names that is missing
    or empty is a ProfileError naming it (never quoting the key)."""
    if target.api_key_file is not None:
        path = target.api_key_file
        try:
            with open(path, encoding="utf-8") as f:
                key = f.read().strip()  # a file written by echo, or a mounted Secret, may end with a newline
        except (OSError, UnicodeDecodeError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
            raise ProfileError(
                f"{label}: target.api_key_file: {path}: cannot read the API key ({why})"
            ) from None
        where_from = f"target.api_key_file: {path}"
        if not key:
            raise ProfileError(f"{label}: {where_from}: the file is empty (it must hold the API key)")
    elif target.api_key_env is not None:
        name = target.api_key_env
        key = os.environ.get(name, "").strip()
        where_from = f"target.api_key_env: {name}"
        if not key:
            raise ProfileError(
                f"{label}: {where_from}: the environment variable is not set or empty (it must hold the API key)"
            )
    else:
        key = os.environ.get(API_KEY_ENV, "").strip()
        where_from = API_KEY_ENV
        if not key:
            return None
    if any(c.isspace() or not c.isprintable() for c in key):
        raise ProfileError(f"{label}: {where_from}: the API key has spaces or control characters inside it")
    return key


def api_key_source(target: TargetConfig) -> str:
    """Where the key is read from, in words for an error message: ``$SGLANG_API_KEY``, a file's path."""
    if target.api_key_file is not None:
        return f"the file {target.api_key_file}"
    return f"${target.api_key_env or API_KEY_ENV}"


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The request header that carries the key (SGLang's check: ``Authorization: Bearer <key>``)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def redact(value: Any, secret: str | None, hide_named: bool = False) -> Any:
    """``value`` (JSON-like) with every occurrence of ``secret`` in its strings replaced; ``hide_named``:
    also every non-empty value under a key naming an API key (SGLang's server_info lists its ``api_key``)."""
    if isinstance(value, dict):
        return {
            k: REDACTED
            if hide_named and v and isinstance(k, str) and "api_key" in k.lower()
            else redact(v, secret, hide_named)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return type(value)(redact(v, secret, hide_named) for v in value)
    if isinstance(value, str) and secret and secret in value:
        return value.replace(secret, REDACTED)
    return value
