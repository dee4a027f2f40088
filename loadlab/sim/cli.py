"""``loadlab sim`` / ``python -m loadlab.sim``: run the simulated SGLang server.

Flags carry SGLang's launch-flag names (``python -m sglang.launch_server``). When the server listens it
prints exactly one line to stdout, ``loadlab-sim listening on http://HOST:PORT`` (the real port, also with
``--port 0``), and then nothing else on stdout; logs go to stderr. SIGTERM or SIGINT stops it (exit 0).

The same table of settings drives the command line and the validation of a profile's
``target.embedded`` mapping (``check_embedded_settings``, ``settings_to_argv``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import signal
import socket
import sys
from dataclasses import dataclass
from typing import Any

from loadlab.cliargs import OneLineParser, non_negative, positive
from loadlab.sim import READY_PREFIX
from loadlab.sim.cost import GPUS, MODELS

PROG = "loadlab sim"


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
        "chunked_prefill_size", "int", 8192, "most new prompt tokens per prefill pass (-1: no chunking)", -1
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
        "mem_fraction_static", "float", None, "GPU memory fraction for weights + KV (default 0.88)", 0.0, 1.0
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


VIRTUAL_OPTIONS = ("out", "run_name", "concurrency", "rate", "arrival", "num_requests", "warmup_requests")


def build_parser(suppress_defaults: bool = False) -> argparse.ArgumentParser:
    """The command line. ``suppress_defaults``: leave unset flags out of the namespace (to tell which
    settings were given explicitly)."""
    p = OneLineParser(
        prog=PROG,
        description="Simulated SGLang server (SGLang's scheduler on a GPU cost model, prefix cache, SGLang's "
        "wire protocol). Flags use SGLang's launch-flag names. Prints 'loadlab-sim listening on "
        "http://HOST:PORT' when ready. With --virtual PROFILE it runs the profile against the twin in "
        "virtual time instead and prints the run directory.",
    )
    for s in SETTINGS:
        default = argparse.SUPPRESS if suppress_defaults else s.default
        if s.kind == "bool":
            p.add_argument(s.flag, *s.aliases, dest=s.name, action="store_true", help=s.help,
                           default=argparse.SUPPRESS if suppress_defaults else False)  # fmt: skip
        else:
            default_note = "" if s.default is None else f" (default: {s.default})"
            p.add_argument(
                s.flag,
                *s.aliases,
                dest=s.name,
                type=_arg_type(s),
                default=default,
                metavar=s.kind.upper() if not s.choices else "{" + ",".join(s.choices) + "}",
                help=s.help + default_note,
            )
    v = p.add_argument_group("virtual time (loadlab sim --virtual PROFILE)")
    v.add_argument("--virtual", metavar="PROFILE", default=None,
                   help="run PROFILE against the twin on a simulated clock; writes a run directory")  # fmt: skip
    v.add_argument(
        "--out", metavar="DIR", default=None, help="directory that receives the run directory (reports)"
    )
    v.add_argument(
        "--run-name", metavar="NAME", default=None, help="run directory name (default: time-profile-virtual)"
    )
    load = v.add_mutually_exclusive_group()
    load.add_argument(
        "--concurrency", type=positive(int), default=None, help="closed loop: requests held in flight"
    )
    load.add_argument("--rate", type=positive(float), default=None, help="open loop: requests per second")
    v.add_argument(
        "--arrival", choices=("poisson", "constant"), default=None, help="open-loop arrival process"
    )
    v.add_argument("--num-requests", type=positive(int), default=None, help="measured requests")
    v.add_argument("--warmup-requests", type=non_negative(int), default=None, help="warm-up requests")
    return p


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


def resolve_settings(args: argparse.Namespace | dict[str, Any]) -> dict[str, Any]:
    """Every server argument with defaults resolved, under SGLang's names (what /server_info shows).

    ``args`` is the parsed command line, or a mapping of settings (missing ones take their defaults).
    Raises ValueError for a combination that cannot work (weights that leave no room for the KV cache)."""
    from loadlab.sim.cost import DEFAULT_MEM_FRACTION_STATIC, CostModel, default_max_running_requests

    if isinstance(args, dict):
        s = {st.name: args.get(st.name, st.default) for st in SETTINGS}
    else:
        s = {st.name: getattr(args, st.name) for st in SETTINGS}
    cost = CostModel(s["gpu"], s["model"], s["tp_size"])
    s["tp_size"] = cost.tp
    if s["mem_fraction_static"] is None:
        s["mem_fraction_static"] = DEFAULT_MEM_FRACTION_STATIC
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
    s["tokenizer_path"] = s["tokenizer"] or s["model_path"]
    if s["max_running_requests"] is None:
        s["max_running_requests"] = default_max_running_requests(kv, s["context_length"])
    s.update(
        max_total_num_tokens=kv,
        max_req_input_len=min(s["context_length"] - 1, kv - 1),
        dp_size=1,
        page_size=1,
        incremental_streaming_output=False,
        skip_server_warmup=True,
    )
    return s


def engine_config(settings: dict[str, Any], record_token_times: bool = False):
    """The engine/scheduler configuration for resolved settings."""
    from loadlab.sim.engine import EngineConfig

    return EngineConfig(
        max_running_requests=settings["max_running_requests"],
        max_queued_requests=settings["max_queued_requests"],
        max_total_tokens=settings["max_total_num_tokens"],
        chunked_prefill_size=settings["chunked_prefill_size"],
        max_prefill_tokens=settings["max_prefill_tokens"],
        schedule_policy=settings["schedule_policy"],
        disable_radix_cache=settings["disable_radix_cache"],
        stream_interval=settings["stream_interval"],
        schedule_conservativeness=settings["schedule_conservativeness"],
        enable_mixed_chunk=settings["enable_mixed_chunk"],
        record_token_times=record_token_times,
        gpu=settings["gpu"],
        model=settings["model"],
        tp_size=settings["tp_size"],
    )


async def _serve(settings: dict[str, Any], tokenizer) -> None:
    from aiohttp import web

    from loadlab.sim.engine import Engine
    from loadlab.sim.server import SimServer

    engine = Engine(engine_config(settings))
    host, port = settings["host"], settings["port"]
    sock = socket.create_server((host, port), backlog=4096)
    sock.setblocking(False)
    await engine.start()
    app = SimServer(settings, engine, tokenizer).build_app()
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    try:
        site = web.SockSite(runner, sock)
        await site.start()
        settings["port"] = sock.getsockname()[1]
        shown = f"[{host}]" if ":" in host else host
        sys.stdout.write(f"{READY_PREFIX}http://{shown}:{settings['port']}\n")
        sys.stdout.flush()
        logging.getLogger("loadlab.sim").info(
            "serving %s on %s: max_running_requests=%s max_total_num_tokens=%s radix_cache=%s",
            settings["served_model_name"],
            engine.cost.name,
            settings["max_running_requests"],
            settings["max_total_num_tokens"],
            "off" if settings["disable_radix_cache"] else "on",
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await engine.stop()
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # bad flags (2) or --help (0); argparse has printed the message
        return e.code if isinstance(e.code, int) else 2
    if args.virtual is None:
        given = [o for o in VIRTUAL_OPTIONS if getattr(args, o) is not None]
        if given:
            flags = ", ".join("--" + o.replace("_", "-") for o in given)
            print(f"{PROG}: error: {flags}: only with --virtual PROFILE (see --help)", file=sys.stderr)
            return 2
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.virtual is not None:
        return _main_virtual(args, argv)
    from loadlab.sim.tokenize import Tokenizer

    try:
        settings = resolve_settings(args)
        tokenizer = Tokenizer(settings["tokenizer"])
    except ValueError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve(settings, tokenizer))
    except OSError as e:
        print(f"{PROG}: error: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


def _main_virtual(args: argparse.Namespace, argv: list[str]) -> int:
    """``loadlab sim --virtual PROFILE``: the profile's settings (``target.embedded``) with the flags given
    on the command line on top; prints the run directory as the last line."""
    from loadlab.profile import ProfileError, load_profile
    from loadlab.sim.virtual import run_virtual

    explicit = vars(build_parser(suppress_defaults=True).parse_args(argv))
    overrides: dict[str, Any] = {}
    if args.concurrency is not None:
        overrides.update({"load.model": "closed", "load.concurrency": args.concurrency, "load.rate": None})
    if args.rate is not None:
        overrides.update({"load.model": "open", "load.rate": args.rate, "load.concurrency": None})
    if args.arrival is not None:
        overrides["load.arrival"] = args.arrival
    if args.num_requests is not None:
        overrides["requests.measured"] = args.num_requests
    if args.warmup_requests is not None:
        overrides["requests.warmup"] = args.warmup_requests
    try:
        profile = load_profile(args.virtual, overrides)
    except ProfileError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    settings = dict(profile.target.embedded)
    settings.update(
        {k: v for k, v in explicit.items() if k in BY_NAME and k not in ("host", "port", "log_level")}
    )
    try:
        run_dir = run_virtual(
            profile, settings, args.out or "reports", args.run_name, profile_path=args.virtual,
            command=["loadlab", "sim", *argv],
        )  # fmt: skip
    except (ValueError, ProfileError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    from loadlab.records import read_manifest

    m = read_manifest(run_dir)
    ok = m.get("counts", {}).get("outcomes", {}).get("ok", 0)
    vs = m.get("virtual_stats", {})
    print(
        f"loadlab sim: virtual run complete: {ok} ok / {m.get('counts', {}).get('records', 0)} requests, "
        f"{vs.get('virtual_duration_s', 0):.1f} s simulated in {vs.get('wall_s', 0):.2f} s; "
        f"report {run_dir / 'summary.md'}",
        file=sys.stderr,
        flush=True,
    )
    print(run_dir, flush=True)
    return 0
