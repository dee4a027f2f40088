"""The "LLM" tab in Locust's own web UI (its extension points, no fork of its front end): the live figures
of ``loadlab.swarm.live`` as rows of one table, refreshed with Locust's 2 s poll of ``/stats/requests``;
the run's summary.md, report.html and records.parquet in "Download Data"; ``/metrics`` (Prometheus).

Only where Locust runs a web UI (``environment.web_ui``: not on workers, not headless); on a master the
master's figures are the whole run's. docs/web-ui.md.
"""

from __future__ import annotations

import json
import re
from typing import Any

from flask import Response, request, send_file

from loadlab.swarm.exporter import exposition, settled
from loadlab.swarm.live import LATENCIES, QUANTILES

TAB = "llm"
COLUMNS = (
    ("scope", "Scope"),
    ("figure", "Figure"),
    *((f"p{q}", f"P{q}") for q in QUANTILES),
    ("value", "Value"),
)  # row keys without "name" on purpose: Locust's table sorts rows by a "name" key, the order here is meant
# The run directory's files offered in "Download Data": (content type, download rather than show).
FILES = {
    "summary.md": ("text/plain", False),  # shown as text: browsers download text/markdown
    "report.html": ("text/html", False),
    "records.parquet": ("application/vnd.apache.parquet", True),
}
MAX_WORKERS_SHOWN = 64  # rows per worker beyond this would crowd the table (Locust draws at most 500 rows)


def install(environment, registry) -> None:
    """Adds the tab, the download links and the routes to Locust's web UI (call from init)."""
    web_ui = environment.web_ui
    app = web_ui.app
    base = (environment.parsed_options.web_base_path or "").rstrip("/")
    web_ui.template_args["extended_tabs"] = [{"title": "LLM", "key": TAB}]
    web_ui.template_args["extended_tables"] = [
        {"key": TAB, "structure": [{"key": key, "title": title} for key, title in COLUMNS]}
    ]
    # The page reads these once, when it loads, so they are there from the start and answer once the run
    # has ended (until then with a one-line 404 that says so).
    web_ui.template_args["extended_csv_files"] = [
        {"href": f"./loadlab/files/{name}", "title": f"loadlab: the last run's {name} (when it has ended)"}
        for name in FILES
    ]

    @app.after_request
    def _llm_rows(response: Response) -> Response:
        if request.path != f"{base}/stats/requests" or response.status_code != 200:
            return response
        try:
            data = json.loads(response.get_data())
        except ValueError:
            return response
        data["extended_stats"] = [{"key": TAB, "data": rows(environment)}]
        response.set_data(json.dumps(data))
        return response

    @app.route(f"{base}/loadlab/files/<name>", endpoint="loadlab_file")
    @web_ui.auth_required_if_enabled
    def _run_file(name: str):
        return run_file(environment, name)

    @app.route(f"{base}/metrics", endpoint="loadlab_metrics")
    @web_ui.auth_required_if_enabled
    def _metrics():
        body, content_type = exposition(registry)
        return Response(body, content_type=content_type)


def run_file(environment, name: str):
    """One of the last run's report files, only those of FILES and only from its own directory."""
    if name not in FILES:
        return _not_found(f"no such file; the run's files here are {', '.join(FILES)}")
    run = environment.loadlab.run
    if run is None:
        return _not_found("no run yet: press Start")
    if run.summary is None:
        return _not_found(f"run {run.run_id} has not ended yet: its {name} is written when it ends")
    path = (run.dir / name).resolve()
    if not path.is_file():
        return _not_found(f"run {run.run_id} has no {name}")
    content_type, attachment = FILES[name]
    return send_file(
        path, mimetype=content_type, as_attachment=attachment, download_name=f"{run.run_id}-{name}", max_age=0
    )


def shown(text: str) -> str:
    """A URL or message as the tab shows it: without credentials (``http://user:secret@host``)."""
    return re.sub(r"(\w+://)[^/@\s]+@", r"\1", text)


def _not_found(why: str) -> Response:
    return Response(f"loadlab: {why}\n", status=404, content_type="text/plain; charset=utf-8")


# -- the rows ---------------------------------------------------------------------------------------------
def rows(environment) -> list[dict[str, str]]:
    """The LLM tab's rows for the current run (or the last one)."""
    run = environment.loadlab.run
    live = getattr(run, "live", None)
    if live is None:
        return [_row("run", "state", value="no run yet: press Start")]
    return live.lane(table, live.figures(fresh=settled(environment)))


def _row(scope: str, figure: str, value: str = "", **percentiles: str) -> dict[str, str]:
    row = {"scope": scope, "figure": figure, **{f"p{q}": "" for q in QUANTILES}, "value": value}
    row.update(percentiles)
    return row


def ms(value: float | None) -> str:
    """A latency cell: milliseconds with 2 decimals (summary.md's precision)."""
    return "" if value is None else f"{value:.2f}"


def _count_line(scope: dict[str, Any]) -> str:
    line = f"{scope['measured']} measured: {scope['completed']} ok, {scope['failed']} failed"
    if scope["failures"]:
        line += " (" + ", ".join(f"{kind} {n}" for kind, n in scope["failures"].items()) + ")"
    return line


def _latency_rows(scope_name: str, scope: dict[str, Any]) -> list[dict[str, str]]:
    out = []
    for metric, label in LATENCIES.items():
        values = scope["latencies"][metric]
        cells = {} if values is None else {f"p{q}": ms(v) for q, v in zip(QUANTILES, values, strict=True)}
        note = f"{scope['samples'][metric]} samples"
        if metric == "itl_ms" and scope.get("itl_estimated"):  # as summary.md says it
            note += (f"; estimated for {scope['itl_estimated']} of {scope['completed']} requests (the server "
                     "sent no per-chunk token counts)")  # fmt: skip
        out.append(_row(scope_name, f"{label} (ms)", note, **cells))
    return out


def _slo_rows(scope_name: str, verdict: dict[str, Any]) -> list[dict[str, str]]:
    out = []
    for o in verdict["objectives"]:
        word = "PASS" if o["pass"] else "FAIL"
        got = "no samples yet" if o["value_ms"] is None else f"P{o['percentile']:g} {ms(o['value_ms'])} ms"
        out.append(_row(scope_name, f"SLO {o['key']}", f"{word}: {got}, limit {o['threshold_ms']:g} ms"))
    return out


def verdict_word(passed: bool | None) -> str:
    return "no objectives" if passed is None else "PASS so far" if passed else "FAIL so far"


def table(f: dict[str, Any]) -> list[dict[str, str]]:
    """The figures of ``LiveFigures.figures`` as the tab's rows: the run, the server, then each class and
    each worker."""
    (warm_done, warm_total), (done, total) = f["warmup"], f["measured"]
    run = f["run"]
    out = [
        _row("run", "run", f"{f['run_id']} ({f['api']})"),
        _row("run", "progress", f"warm-up {warm_done}/{warm_total}, measured {done}/{total} done"),
        _row("run", "requests", _count_line(run)),
        _row("run", "in flight", str(f["in_flight"])),
        _row("run", "output tokens/s", _throughput(f)),
    ]
    out += _latency_rows("run", run)
    out += _server_rows(f["server"], f["now"])
    out += _slo_rows("run", f["slo"]["run"])
    # The overall verdict: the run's objectives and every class's.
    out.append(_row("run", "SLO verdict", verdict_word(f["slo"]["pass"])))
    for name, scope in f["classes"].items():
        label = f"class {name}"
        out.append(_row(label, "requests", _count_line(scope)))
        out += _latency_rows(label, scope)
        out += _slo_rows(label, f["slo"]["classes"][name])
        out.append(_row(label, "SLO verdict", verdict_word(f["slo"]["classes"][name]["pass"])))
    # One worker's rows would repeat the run's: shown only when several served the run.
    workers = list(f["workers"].items()) if len(f["workers"]) > 1 else []
    for name, scope in workers[:MAX_WORKERS_SHOWN]:
        label = f"worker {shown(name)}"
        out.append(_row(label, "requests", _count_line(scope)))
        out += _latency_rows(label, scope)
    if len(workers) > MAX_WORKERS_SHOWN:
        out.append(_row("worker", "more", f"{len(workers) - MAX_WORKERS_SHOWN} more workers: see the report"))
    return out


def _throughput(f: dict[str, Any]) -> str:
    whole = f["output_throughput"]
    so_far = "none yet" if whole is None else f"{whole:.1f} over the run so far"
    return f"{so_far}; {f['recent_output_throughput']:.1f} in the last 10 s"


def _server_rows(server: dict[str, Any], now: float) -> list[dict[str, str]]:
    if not server["servers"]:
        return [_row("server", "/metrics", "not scraped yet")]
    if server["running"] is None and server["errors"]:
        return [_row("server", "/metrics", shown(next(iter(server["errors"].values()))))]

    def n(value: float | None) -> str:
        return "?" if value is None else f"{value:g}"

    age = f" (scraped {max(0.0, now - server['scraped_at']):.0f} s ago)" if server["scraped_at"] else ""
    out = [
        _row("server", "running / queued requests", f"{n(server['running'])} / {n(server['queued'])}{age}")
    ]
    kv = server["kv_usage"]
    if kv:
        detail = "" if len(kv) == 1 else f" (highest of {len(kv)} servers)"
        out.append(_row("server", "KV cache usage", f"{server['max_kv_usage']:.1%}{detail}"))
    for url, error in server["errors"].items():
        out.append(_row("server", f"/metrics of {shown(url)}", shown(error)))
    return out
