"""loadlab's command-line options, shared by `locust -f locustfile.py` and `loadlab run`."""

from __future__ import annotations

from typing import Any

from loadlab import exits
from loadlab.cliargs import non_negative, port, positive
from loadlab.profile import APIS, CLI_OVERRIDES, parse_set_option

DEFAULT_PROFILE = "profiles/default.yaml"
# Probe lateness P99 above this flags the run. The probe is conservative (1.5-3x the measured P99 timing
# error of runs well inside capacity on this VM; saturated runs read 10 ms and more): bench/RESULTS.md.
DEFAULT_LIMIT_MS = 5.0
# Open loop without a cap: one Locust user per request of the run, up to this many (each user holds a
# connection; past it requests wait in the client and the report shows that as client queue).
OPEN_LOOP_MAX_USERS = 2048
# Of one core, mean over the measured phase: on a shared machine a saturated process measured 0.67-0.92 and
# well-inside ones 0.20-0.47 (bench/RESULTS.md, client cost).
DEFAULT_LIMIT_CPU = 0.65
PASSED_THROUGH = (
    "client_limit_ms",
    "client_limit_cpu",
    "strict",
    "target_wait",
    "metrics_port",
    "metrics_host",
)  # loadlab run -> Locust, not profile keys
DEFAULT_OUT = "reports"
# A worker with no heartbeat from its master for this long stops its users and exits (Locust alone waits 60 s).
DEFAULT_MASTER_LOST_S = 10.0


def add_loadlab_arguments(parser, *, locust: bool) -> None:
    """Adds loadlab's options. Under Locust they also appear in the web UI and take LOADLAB_* env vars."""

    def add(*names, **kw):
        if locust:
            kw["env_var"] = "LOADLAB_" + names[0].lstrip("-").replace("-", "_").upper()
            # The profile is resolved once at startup; the web UI's form sets only users and host.
            kw["include_in_web_ui"] = False
        parser.add_argument(*names, **kw)

    if locust:
        add("--profile-file", default=DEFAULT_PROFILE, metavar="PATH", help="loadlab profile (YAML)")
        # The web UI's login (Locust's --web-login turns it on): docs/web-ui.md, "Login".
        add("--web-login-file", default=None, metavar="PATH",
            help="a file holding the web UI's user:password (or set LOADLAB_WEB_LOGIN=user:password)")  # fmt: skip
        add("--web-ui-open", action="store_true", default=False,
            help="let the web UI listen beyond loopback without a login: anyone who reaches it can start load "
            "against any host")  # fmt: skip
    add("--api", choices=APIS, default=None, help="SGLang API: native /generate or OpenAI completions/chat")
    add("--concurrency", type=positive(int), default=None, help="requests held in flight (Locust's -u wins)")
    add("--num-requests", type=positive(int), default=None, help="measured requests")
    add("--warmup-requests", type=non_negative(int), default=None, help="warm-up requests, not measured")
    add("--input-len", type=positive(int), default=None, help="prompt tokens (workload.input_len)")
    add("--output-len", type=positive(int), default=None, help="output tokens (workload.output_len)")
    add("--seed", type=int, default=None, help="workload seed")
    add("--tokenizer", default=None, metavar="PATH", help="local tokenizer.json for exact text lengths")
    add("--model", default=None, help="model name sent on the OpenAI APIs (default: the server's)")
    add("--out", default=DEFAULT_OUT, metavar="DIR", help="directory that receives the run directory")
    add(
        "--run-name",
        default=None,
        metavar="NAME",
        help="run directory name under --out (default: time-profile)",
    )
    add("--target-wait", type=non_negative(float), default=0.0, metavar="SECONDS",
        help="keep trying to reach the target this long before giving up (a server still starting)")  # fmt: skip
    add("--client-limit-ms", type=positive(float), default=DEFAULT_LIMIT_MS, metavar="MS",
        help="client-bound when a load generator handles I/O later than this at P99")  # fmt: skip
    add("--client-limit-cpu", type=positive(float), default=DEFAULT_LIMIT_CPU, metavar="FRACTION",
        help="client-bound when a load generator's mean CPU passes this fraction of a core")  # fmt: skip
    if locust:  # a worker's (loadlab run --workers N: the environment variable)
        add("--master-lost-s", type=positive(float), default=DEFAULT_MASTER_LOST_S, metavar="SECONDS",
            help="a worker stops and exits after this long without a heartbeat from its master")  # fmt: skip
    add("--strict", action="store_true", default=False,
        help=f"exit {exits.CLIENT_BOUND} when the run is client-bound (its figures are suspect)")  # fmt: skip
    # Off by default: a port opened by every run would collide between runs on one machine; the web UI
    # serves /metrics on its own port anyway.
    add("--metrics-port", type=port, default=None, metavar="PORT",
        help="serve the live figures for Prometheus at http://HOST:PORT/metrics (a one-process run or a master)")  # fmt: skip
    add("--metrics-host", default=None, metavar="HOST",
        help="the address --metrics-port listens on (default: Locust's --web-host, all interfaces)")  # fmt: skip
    add(
        "--set",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="override any profile key, e.g. --set workload.zipf_s=1.3 (repeatable)",
    )


def overrides_from_options(options, host: str | None) -> dict[str, Any]:
    """The profile overrides the options ask for, as dotted keys."""
    out: dict[str, Any] = {}
    for item in getattr(options, "set", None) or []:
        key, value = parse_set_option(item)
        out[key] = value
    for flag, key in CLI_OVERRIDES.items():
        value = host if flag == "host" else getattr(options, flag, None)
        if value not in (None, ""):
            out[key] = value
    return out
