"""A naive Locust user for SGLang's native /generate stream, written the way peers write one: the baseline
for bench/client_cost.py (not part of loadlab, and not a strawman).

Each user is a `FastHttpUser` with one streaming request in flight (`wait_time = constant(0)`). It reads the
body line by line from geventhttpclient (`resp.stream.readline`, which returns each SSE line as soon as it
is in: Locust's own `iter_lines` / `iter_content` batch 1 KiB and would ruin the timing), takes
`perf_counter()` on receipt, `json.loads` every event, and fires a Locust request event per token event
(TTFT for the first, ITL for the others), as Locust-based LLM load tests do. None of loadlab's devices
are used: no deferred decoding, no CPU lane, no self-calibration.

So that the same error analysis can run on it, it keeps a loadlab-shaped record per request in memory
(index, phase, t_send_wall, ttft_ms, arrival_ms, arrival_tokens, server_id, outcome) and writes them as
JSON lines to `--records-out` when Locust quits. Every user sends `--warmup-per-user` warm-up requests,
then `--requests-per-user` measured ones, then stops; the process quits when every user has stopped.

    python -m locust -f bench/naive_locustfile.py --headless -u 64 -r 64 \\
        --host http://127.0.0.1:PORT/case/normal --records-out naive.jsonl \\
        [--requests-per-user 6] [--warmup-per-user 1] [--max-new-tokens 64]
"""

from __future__ import annotations

import itertools
import json
import time

import gevent
from locust import FastHttpUser, constant, events, task
from locust.exception import StopUser

RECORDS: list[dict] = []
_index = itertools.count()
_done_users = 0


@events.init_command_line_parser.add_listener
def _options(parser):
    parser.add_argument("--records-out", default="naive_records.jsonl", help="per-request JSON lines")
    parser.add_argument("--requests-per-user", type=int, default=6, help="measured requests per user")
    parser.add_argument("--warmup-per-user", type=int, default=1, help="warm-up requests per user")
    parser.add_argument("--max-new-tokens", type=int, default=64)


@events.quitting.add_listener
def _write_records(environment, **_kw):
    with open(environment.parsed_options.records_out, "w") as f:
        for rec in RECORDS:
            f.write(json.dumps(rec) + "\n")


class NaiveSGLangUser(FastHttpUser):
    wait_time = constant(0)
    network_timeout = 30.0
    connection_timeout = 10.0

    def on_start(self):
        opts = self.environment.parsed_options
        self.left_warmup = opts.warmup_per_user
        self.left_measured = opts.requests_per_user
        self.max_new_tokens = opts.max_new_tokens

    @task
    def generate(self):
        if self.left_warmup > 0:
            self.left_warmup -= 1
            phase = "warmup"
        elif self.left_measured > 0:
            self.left_measured -= 1
            phase = "measure"
        else:
            self._finished()
        index = next(_index)
        body = {
            "text": f"request {index}: " + "lorem ipsum " * 8,
            "sampling_params": {
                "max_new_tokens": self.max_new_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
            },
            "stream": True,
        }
        fire = self.environment.events.request.fire
        rec = {"index": index, "phase": phase, "outcome": "error", "server_id": None, "ttft_ms": None}
        arrivals: list[float] = []
        tokens: list[int] = []
        seen = 0  # completion tokens so far
        t_send_wall = time.time()
        t0 = time.perf_counter()
        with self.client.post(
            "/generate",
            json=body,
            stream=True,
            catch_response=True,
            headers={"Accept-Encoding": "identity", "Accept": "text/event-stream"},
            name="/generate",
        ) as resp:
            try:
                if resp.status_code != 200:
                    resp.failure(f"HTTP {resp.status_code}")
                    return
                stream = resp.stream
                last = t0
                finished = False
                while True:
                    line = stream.readline(b"\n")
                    t = time.perf_counter()
                    if not line:
                        break
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        continue  # read on to the end of the body so the connection goes back to the pool
                    event = json.loads(data)
                    meta = event["meta_info"]
                    n = meta["completion_tokens"] - seen
                    if n <= 0:
                        continue
                    seen += n
                    ms = (t - t0) * 1000.0
                    if not arrivals:
                        rec["server_id"] = meta["id"]
                        fire(request_type="SSE", name="TTFT", response_time=ms, response_length=n,
                             exception=None, context={})  # fmt: skip
                    else:
                        fire(request_type="SSE", name="ITL", response_time=(t - last) * 1000.0,
                             response_length=n, exception=None, context={})  # fmt: skip
                    last = t
                    arrivals.append(ms)
                    tokens.append(n)
                    if meta.get("finish_reason"):
                        finished = True
                if finished:
                    rec["outcome"] = "ok"
                    resp.success()
                else:
                    resp.failure("stream ended without a finish_reason")
            except Exception as e:  # a bad event costs this request, visibly, not the user
                resp.failure(f"{type(e).__name__}: {e}")
            finally:
                rec.update(
                    t_send_wall=t_send_wall,
                    ttft_ms=arrivals[0] if arrivals else None,
                    e2e_ms=(time.perf_counter() - t0) * 1000.0,
                    arrival_ms=arrivals,
                    arrival_tokens=tokens,
                    output_tokens=seen,
                )
                RECORDS.append(rec)

    def _finished(self):
        global _done_users
        _done_users += 1
        runner = self.environment.runner
        if _done_users >= runner.target_user_count:
            gevent.spawn_later(0.1, runner.quit)  # the last user is done: end the run (headless)
        raise StopUser()
