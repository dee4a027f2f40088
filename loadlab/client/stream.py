"""One streaming HTTP exchange with every SSE line timestamped on receipt.

The per-line loop only reads a line, takes ``perf_counter()`` and keeps both; decoding happens after
the stream ends (``protocol.decode_stream``). Lines are read straight from geventhttpclient's response
(``readline``), which returns each line as soon as its bytes are in; Locust's ``iter_content`` /
``iter_lines`` are not used because they batch events (see docs/architecture.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import gevent
from geventhttpclient import HTTPClient
from geventhttpclient.response import HTTPConnectionClosed, HTTPParseError

from loadlab.records import (
    CONNECT_ERROR,
    DROPPED,
    HTTP_ERROR,
    OK,
    PROTOCOL_ERROR,
    STATUS_FRONT,
    STATUS_WORKER,
    TIMEOUT,
)
from loadlab.sim import FRONT_HEADER, WORKER_HEADER

MAX_ERROR_BODY = 64 * 1024
# sglang-router (sgl-model-gateway) marks the errors it answers itself (no worker reached, every retry
# failed, no healthy worker) with this header, never a worker's error it passes through (checked with 0.3.2).
ROUTER_ERROR_HEADER = "x-smg-error-code"
HEADERS = {
    "Content-Type": "application/json",
    "Accept": "text/event-stream",
    "Accept-Encoding": "identity",  # compressed streams would be buffered by the decoder
}


@dataclass(slots=True)
class Exchange:
    """The raw result of one request: receipt-timed lines and how the transport ended."""

    t_send: float  # perf_counter() just before the request was written
    t_send_wall: float
    status: int | None = None
    lines: list[bytes] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    last_whole: bytes | None = None  # with keep_from: the last line that was cut, as it arrived
    t_end: float | None = None
    transport: str = OK  # OK, HTTP_ERROR, DROPPED, TIMEOUT, CONNECT_ERROR or PROTOCOL_ERROR
    error: str | None = None
    body: bytes = b""  # the body of a non-2xx response
    served_by: str | None = None  # the response's x-loadlab-worker header
    status_source: str | None = None  # STATUS_WORKER (that header came), STATUS_FRONT (x-loadlab-front or
    # sglang-router's x-smg-error-code: a front's own answer), None


class StreamingClient:
    """A keep-alive connection to one server, for one request at a time (one per Locust user)."""

    def __init__(
        self,
        base_url: str,
        connect_timeout_s: float,
        idle_timeout_s: float,
        timeout_s: float,
        headers: dict[str, str] | None = None,
    ):
        """``headers``: sent with every request (the target's ``Authorization``)."""
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.base_path = parts.path.rstrip("/")
        self.timeout_s = timeout_s
        self.headers = {**HEADERS, **headers} if headers else HEADERS
        self._args = dict(
            host=parts.hostname,
            port=parts.port or (443 if parts.scheme == "https" else 80),
            ssl=parts.scheme == "https",
            connection_timeout=connect_timeout_s,
            network_timeout=idle_timeout_s,  # per-recv: an idle timeout, not a deadline
            concurrency=1,
        )
        self._http: HTTPClient | None = None

    def _client(self) -> HTTPClient:
        if self._http is None:
            self._http = HTTPClient(**self._args)
        return self._http

    def close(self) -> None:
        """Drops the connection; the next request opens a fresh one."""
        if self._http is not None:
            self._http.close()
            self._http = None

    def post_stream(
        self,
        path: str,
        body: bytes,
        ex: Exchange,
        keep_from: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> Exchange:
        """Sends the request and reads the whole stream into ``ex``, timing each line on receipt.

        ``keep_from``: keep each line only from the last occurrence of these bytes on (native SGLang
        events repeat the whole output so far before ``"meta_info":``; keeping only the tail makes memory
        linear in the output length instead of quadratic); the last line cut is kept whole as well, in
        ``ex.last_whole`` (the whole output, which a conversation's next turn repeats). ``headers``: extra
        request headers (a class's).
        """
        sent_headers = {**self.headers, **headers} if headers else self.headers
        deadline = gevent.Timeout(self.timeout_s)
        deadline.start()
        ex.t_send_wall = time.time()
        ex.t_send = time.perf_counter()
        try:
            try:
                resp = self._client().request("POST", self.base_path + path, body=body, headers=sent_headers)
            except TimeoutError:
                return self._fail(
                    ex, TIMEOUT, f"no response headers within {self._args['network_timeout']:g} s"
                )
            except (OSError, HTTPConnectionClosed, HTTPParseError) as e:
                return self._fail(ex, CONNECT_ERROR, f"{type(e).__name__}: {e}")
            ex.status = resp.status_code
            # Who answered: read once per response, from its headers, never on the per-line path.
            served_by = resp.get(WORKER_HEADER)
            if served_by is not None:
                ex.served_by, ex.status_source = _one(served_by), STATUS_WORKER
            elif resp.get(FRONT_HEADER) is not None or resp.get(ROUTER_ERROR_HEADER) is not None:
                ex.status_source = STATUS_FRONT
            if ex.status >= 300:
                ex.body = resp.read(MAX_ERROR_BODY)
                resp.release()
                return self._fail(ex, HTTP_ERROR, None)
            content_type = resp.get("content-type") or ""
            if "text/event-stream" not in content_type:
                head = resp.read(200)
                resp.release()
                got = f"{content_type or 'no content type'}: {head[:200]!r}"
                return self._fail(ex, PROTOCOL_ERROR, f"expected a text/event-stream reply, got {got}")
            readline = resp.readline
            lines, times = ex.lines, ex.times
            perf = time.perf_counter
            whole = None
            while True:
                line = readline(b"\n")
                t = perf()
                if not line:
                    break
                if keep_from is not None:
                    cut = line.rfind(keep_from)
                    if cut > 0:
                        whole = line  # a reference, not a copy: only the last one stays alive
                        line = line[cut:]
                lines.append(line)
                times.append(t)
            ex.last_whole = whole
            ex.t_end = times[-1] if times else perf()
            resp.release()
        except gevent.Timeout as e:
            if e is not deadline:
                raise
            self._fail(ex, TIMEOUT, f"request took longer than timeout_s={self.timeout_s:g}")
        except TimeoutError:
            self._fail(ex, TIMEOUT, f"no data for idle_timeout_s={self._args['network_timeout']:g}")
        except (OSError, HTTPConnectionClosed, HTTPParseError) as e:
            self._fail(ex, DROPPED, f"connection lost mid-stream ({type(e).__name__}: {e})")
        finally:
            deadline.close()
        return ex

    def _fail(self, ex: Exchange, transport: str, error: str | None) -> Exchange:
        """Ends an exchange that failed; the connection is dropped so the next request starts clean."""
        ex.transport, ex.error = transport, error
        ex.t_end = time.perf_counter()
        self.close()
        return ex


def _one(value: str | list[str]) -> str:
    """A header's value; a header sent twice (a front that added its own) keeps its first value."""
    return value[0] if isinstance(value, list) else value
