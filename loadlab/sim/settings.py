"""The twin's settings: one table, under SGLang's launch-flag names, for the command line, a profile's
``target.embedded`` mapping and the resolved values ``/server_info`` shows.

- ``SETTINGS`` / ``BY_NAME``: every setting, its type, default, bounds and help.
- ``add_arguments(parser)``: the flags on an argparse parser (``loadlab sim``); ``settings_to_argv``: a
  mapping back to flags (the embedded server's command line). The two round-trip.
- ``check_embedded_settings``: one-line validation of a profile's mapping.
- ``resolve_settings``: every setting with its default resolved (SGLang's rules); ``engine_config``: the
  scheduler's configuration from resolved settings.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

from loadlab.sim.cost import (
    GPUS,
    MODELS,
    CostModel,
    default_max_running_requests,
    sglang_memory_defaults,
)
from loadlab.sim.engine import EngineConfig
from loadlab.sim.eos import parse_eos_dist


@dataclass(frozen=True)
class Setting:
    name: str  # SGLang's name, with underscores (the flag is --name-with-dashes)
    kind: str  # "int" | "float" | "bool" | "str"
    default: Any
    help: str
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] | None = None
    embedded: bool = True  # may appear in a profile's target.embedded
    aliases: tuple[str, ...] = ()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


SETTINGS: tuple[Setting, ...] = (
    Setting("host", "str", "127.0.0.1", "address to listen on", embedded=False),
    Setting("port", "int", 30000, "port to listen on (0: any free port)", 0, 65535, embedded=False),
    Setting("gpu", "str", "a100-80gb", "GPU preset of the cost model", choices=tuple(GPUS)),
    Setting("model", "str", "llama-3.1-8b", "model preset of the cost model", choices=tuple(MODELS)),
    Setting(
        "tp_size",
        "int",
        None,
        "tensor parallel size (default: the model preset's, 1 for 8B, 4 for 70B)",
        1,
        aliases=("--tensor-parallel-size",),
    ),
    Setting(
        "model_path", "str", None, "model name to report, nothing is loaded (default: the --model preset's)"
    ),
    Setting(
        "served_model_name", "str", None, "model name in responses and /v1/models (default: --model-path)"
    ),
    Setting(
        "tokenizer",
        "str",
        None,
        "local tokenizer.json for prompt text (default: one whitespace-separated word = one token)",
        aliases=("--tokenizer-path",),
    ),
    Setting("context_length", "int", None, "the model's context length in tokens (default: the preset's)", 2),
    Setting("max_running_requests", "int", None, "most requests running at once (default: SGLang's rule)", 1),
    Setting(
        "max_queued_requests", "int", None, "most requests waiting; more get HTTP 503 (default: no limit)", 1
    ),
    Setting(
        "max_total_tokens",
        "int",
        None,
        "KV cache pool size in tokens (default: from --mem-fraction-static)",
        1,
    ),
    Setting(
        "chunked_prefill_size",
        "int",
        None,
        "most new prompt tokens per prefill pass (-1: no chunking; default: SGLang's for the GPU's memory, "
        "8192 on 60-160 GB, 4096 on 35-60 GB)",
        -1,
    ),
    Setting("max_prefill_tokens", "int", 16384, "new-token budget of one prefill pass", 1),
    Setting(
        "schedule_policy",
        "str",
        "fcfs",
        "queue order: fcfs, or lpm (longest cached prefix first)",
        choices=("fcfs", "lpm"),
    ),  # fmt: skip
    Setting("disable_radix_cache", "bool", False, "turn the prefix cache off"),
    Setting(
        "schedule_conservativeness",
        "float",
        1.0,
        "scales the initial new_token_ratio (admission optimism)",
        0.0,
    ),
    Setting("enable_mixed_chunk", "bool", False, "run prefill chunks together with the decode batch"),
    Setting(
        "enable_priority_scheduling",
        "bool",
        False,
        "order the queue by each request's priority (higher first; none: last) and let a waiting request "
        "preempt running ones",
    ),
    Setting(
        "schedule_low_priority_values_first",
        "bool",
        False,
        "with --enable-priority-scheduling: lower priority values first",
    ),
    Setting(
        "priority_scheduling_preemption_threshold",
        "int",
        10,
        "with --enable-priority-scheduling: a waiting request preempts a running one only if its priority "
        "is better by more than this",
    ),
    Setting(
        "abort_on_priority_when_disabled",
        "bool",
        False,
        "without --enable-priority-scheduling: refuse a request carrying a priority (HTTP 503) instead of "
        "ignoring it",
    ),
    Setting(
        "eos_len_dist",
        "str",
        None,
        "where the model stops when a request does not ignore EOS: fixed:N, uniform:LOW-HIGH or "
        "exponential:MEAN tokens, drawn per request from its prompt (default: never before max_new_tokens)",
    ),
    Setting(
        "mem_fraction_static",
        "float",
        None,
        "GPU memory fraction for weights + KV (default: 0.88 on the calibrated presets, SGLang 0.5's rule for "
        "the memory size on the others)",
        0.0,
        1.0,
    ),
    Setting("stream_interval", "int", 1, "tokens per streamed event after the first (at least)", 1),
    Setting("enable_metrics", "bool", False, "serve Prometheus /metrics and timing fields in meta_info"),
    Setting(
        "enable_cache_report", "bool", False, "report prompt_tokens_details.cached_tokens in OpenAI usage"
    ),
    Setting(
        "log_level",
        "str",
        "info",
        "log level (logs go to stderr)",
        choices=("debug", "info", "warning", "error", "critical"),
    ),  # fmt: skip
    Setting(
        "worker_id",
        "str",
        None,
        "this worker's id in the x-loadlab-worker header of every response (default: its base URL, "
        "http://HOST:PORT)",
    ),
)
BY_NAME = {s.name: s for s in SETTINGS}


def _check_value(s: Setting, value: Any) -> str | None:
    """None if ``value`` (a Python value) suits setting ``s``, else what is wrong (without the name)."""
    if value is None:
        return None
    if s.kind == "bool":
        return None if isinstance(value, bool) else f"expected true or false, got {value!r}"
    if s.kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            return f"expected an integer, got {value!r}"
    elif s.kind == "float":
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return f"expected a number, got {value!r}"
    elif s.kind == "str":
        if not isinstance(value, str) or not value:
            return f"expected a non-empty string, got {value!r}"
        if s.choices and value not in s.choices:
            return f"expected one of {', '.join(s.choices)}, got {value!r}"
        if s.name == "tokenizer" and not os.path.isfile(value):
            return f"no such file: {value!r}"
        if s.name == "worker_id" and not (value.isascii() and value.isprintable()):
            return f"expected printable ASCII (it is sent as an HTTP header), got {value!r}"
        if s.name == "eos_len_dist":
            try:
                parse_eos_dist(value)
            except ValueError as e:
                return str(e)
        return None
    if s.name == "mem_fraction_static" and not 0 < value <= 1:
        return f"must be greater than 0 and at most 1, got {value!r}"
    if s.minimum is not None and value < s.minimum:
        return f"must be at least {s.minimum:g}, got {value!r}"
    if s.maximum is not None and value > s.maximum:
        return f"must be at most {s.maximum:g}, got {value!r}"
    return None


def _arg_type(s: Setting):
    def parse(text: str):
        if s.kind == "int":
            try:
                value: Any = int(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        elif s.kind == "float":
            try:
                value = float(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        else:
            value = text
        problem = _check_value(s, value)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value

    parse.__name__ = s.kind
    return parse


# Server-only settings: where it listens, how it logs and what it calls itself, never part of what a run's
# report shows.
PROCESS_SETTINGS = ("host", "port", "log_level", "worker_id")


def base_url(host: str, port: int) -> str:
    """A server's base URL, ``http://HOST:PORT`` (an IPv6 host in brackets): the ready line's URL and the
    default ``worker_id``."""
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def add_arguments(parser: argparse.ArgumentParser, suppress_defaults: bool = False) -> None:
    """Every setting as a flag (``--max-running-requests``, SGLang's aliases too). ``suppress_defaults``:
    unset flags stay out of the namespace (to tell which settings were given explicitly)."""
    for s in SETTINGS:
        if s.kind == "bool":
            parser.add_argument(s.flag, *s.aliases, dest=s.name, action="store_true", help=s.help,
                                default=argparse.SUPPRESS if suppress_defaults else False)  # fmt: skip
            continue
        default_note = "" if s.default is None else f" (default: {s.default})"
        parser.add_argument(
            s.flag,
            *s.aliases,
            dest=s.name,
            type=_arg_type(s),
            default=argparse.SUPPRESS if suppress_defaults else s.default,
            metavar=s.kind.upper() if not s.choices else "{" + ",".join(s.choices) + "}",
            help=s.help + default_note,
        )


def check_embedded_settings(settings: dict) -> str | None:
    """Validates a profile's ``target.embedded`` mapping (SGLang flag names, underscores, no dashes).

    Returns None if every key is known and every value fits, else a one-line description of the first
    problem, e.g. ``unknown setting 'foo_bar'`` or ``max_running_requests: expected an integer, got 'abc'``.
    """
    if not isinstance(settings, dict):
        return f"expected a mapping of setting names to values, got {type(settings).__name__}"
    for key, value in settings.items():
        if not isinstance(key, str):
            return f"unknown setting {key!r}"
        s = BY_NAME.get(key)
        if s is None:
            fixed = key.lstrip("-").replace("-", "_")
            if fixed in BY_NAME and BY_NAME[fixed].embedded:
                return f"unknown setting {key!r} (write it as {fixed!r})"
            return f"unknown setting {key!r}"
        if not s.embedded:
            return f"{key}: set by loadlab for the embedded server, not in a profile"
        problem = _check_value(s, value)
        if problem:
            return f"{key}: {problem}"
    return None


def settings_to_argv(settings: dict) -> list[str]:
    """Turns a valid ``target.embedded`` mapping into command-line flags: true booleans become bare flags,
    false booleans and None values are left out. Raises ValueError on an invalid mapping."""
    problem = check_embedded_settings(settings)
    if problem:
        raise ValueError(problem)
    argv: list[str] = []
    for key, value in settings.items():
        s = BY_NAME[key]
        if value is None or value is False:
            continue
        if value is True:
            argv.append(s.flag)
        else:
            argv += [s.flag, str(value)]
    return argv


@dataclass(frozen=True)
class TwinSettings:
    """Every server setting with its default resolved (SGLang's rules), under SGLang's names: what
    ``/server_info`` shows. One field per row of ``SETTINGS`` (a test checks), then the derived ones."""

    host: str
    port: int
    gpu: str
    model: str
    tp_size: int
    model_path: str
    served_model_name: str
    tokenizer: str | None
    context_length: int
    max_running_requests: int
    max_queued_requests: int | None
    max_total_tokens: int | None
    chunked_prefill_size: int
    max_prefill_tokens: int
    schedule_policy: str
    disable_radix_cache: bool
    schedule_conservativeness: float
    enable_mixed_chunk: bool
    enable_priority_scheduling: bool
    schedule_low_priority_values_first: bool
    priority_scheduling_preemption_threshold: int
    abort_on_priority_when_disabled: bool
    eos_len_dist: str | None
    mem_fraction_static: float
    stream_interval: int
    enable_metrics: bool
    enable_cache_report: bool
    log_level: str
    worker_id: str | None  # None until the server listens: then its base URL unless set
    # Derived, as SGLang reports them:
    tokenizer_path: str  # the tokenizer file, else the model path
    max_total_num_tokens: int  # the KV cache pool, from max_total_tokens or the memory fraction
    max_req_input_len: int
    cuda_graph_max_bs: int  # SGLang's default for the GPU's memory: reported, not modelled (docs/twin.md)
    dp_size: int = 1
    page_size: int = 1
    incremental_streaming_output: bool = False
    skip_server_warmup: bool = True

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def shown(self) -> dict[str, Any]:
        """The settings without where the process listens and logs (what a run's report keeps)."""
        return {k: v for k, v in self.as_dict().items() if k not in PROCESS_SETTINGS}


def resolve_settings(args: argparse.Namespace | dict[str, Any]) -> TwinSettings:
    """Every setting with its default resolved. ``args`` is the parsed command line, or a mapping of
    settings (missing ones take their defaults). Raises ValueError for a combination that cannot work
    (weights that leave no room for the KV cache)."""
    if isinstance(args, dict):
        s = {st.name: args.get(st.name, st.default) for st in SETTINGS}
    else:
        s = {st.name: getattr(args, st.name) for st in SETTINGS}
    cost = CostModel(s["gpu"], s["model"], s["tp_size"])
    s["tp_size"] = cost.tp
    if s["chunked_prefill_size"] is None:
        s["chunked_prefill_size"] = cost.gpu.chunked_prefill_size
    if s["mem_fraction_static"] is None:
        s["mem_fraction_static"] = cost.default_mem_fraction_static(s["chunked_prefill_size"])
    kv = s["max_total_tokens"] or cost.kv_tokens(s["mem_fraction_static"])
    if kv < 1:
        raise ValueError(
            f"mem_fraction_static {s['mem_fraction_static']} leaves no memory for the KV cache on "
            f"{cost.gpu.key} ({cost.model.key} weights need {cost.weight_bytes_per_gpu / 2**30:.1f} GiB per GPU "
            f"at tp_size {cost.tp})"
        )
    s["model_path"] = s["model_path"] or cost.model.model_path
    s["context_length"] = s["context_length"] or cost.model.context_length
    s["served_model_name"] = s["served_model_name"] or s["model_path"]
    if s["max_running_requests"] is None:
        s["max_running_requests"] = default_max_running_requests(kv, s["context_length"])
    return TwinSettings(
        **s,
        tokenizer_path=s["tokenizer"] or s["model_path"],
        max_total_num_tokens=kv,
        max_req_input_len=min(s["context_length"] - 1, kv - 1),
        cuda_graph_max_bs=sglang_memory_defaults(cost.gpu.memory_mib, cost.tp)[1],
    )


def engine_config(settings: TwinSettings, record_token_times: bool = False) -> EngineConfig:
    """The engine/scheduler configuration for resolved settings."""
    return EngineConfig(
        max_running_requests=settings.max_running_requests,
        max_queued_requests=settings.max_queued_requests,
        max_total_tokens=settings.max_total_num_tokens,
        chunked_prefill_size=settings.chunked_prefill_size,
        max_prefill_tokens=settings.max_prefill_tokens,
        schedule_policy=settings.schedule_policy,
        disable_radix_cache=settings.disable_radix_cache,
        stream_interval=settings.stream_interval,
        schedule_conservativeness=settings.schedule_conservativeness,
        enable_mixed_chunk=settings.enable_mixed_chunk,
        enable_priority_scheduling=settings.enable_priority_scheduling,
        schedule_low_priority_values_first=settings.schedule_low_priority_values_first,
        priority_scheduling_preemption_threshold=settings.priority_scheduling_preemption_threshold,
        abort_on_priority_when_disabled=settings.abort_on_priority_when_disabled,
        eos_len_dist=settings.eos_len_dist,
        record_token_times=record_token_times,
        gpu=settings.gpu,
        model=settings.model,
        tp_size=settings.tp_size,
    )
