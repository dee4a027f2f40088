"""One streaming HTTP exchange with every SSE line timestamped on receipt.

Two readers (``StreamingClient(reader=...)``, the profile's ``target.reader``):

* ``lean`` (the default for http): loadlab's own (``lean.py``): one ``recvmsg`` per wake-up, httptools
  framing, lines split in bulk, each line timed by the read that completed it, with the kernel's receive
  timestamp (``clock="kernel"``, ``SO_TIMESTAMPNS``) or ``perf_counter()`` after the read
  (``clock="user"``).
* ``geventhttpclient``: ``readline`` per line then ``perf_counter()`` (user space only). Always used for
  https: over TLS the ssl module does the socket reads, so no receive timestamp belongs to a line.

Decoding happens after the stream ends (``protocol.decode_stream``); Locust's ``iter_content`` /
``iter_lines`` are not used because they batch events (see docs/architecture.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import gevent
from geventhttpclient import HTTPClient
from geventhttpclient.response import HTTPConnectionClosed, HTTPParseError

from loadlab.client import lean
from loadlab.manifest import ReceiptInfo
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
LEAN, GEVENTHTTPCLIENT = "lean", "geventhttpclient"
READERS = (LEAN, GEVENTHTTPCLIENT)
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
    kernel_reads: int = 0  # reads of body bytes timed by the kernel's receive timestamp
    user_reads: int = 0  # reads of body bytes (geventhttpclient: lines) timed in user space


def receipt_setup(base_url: str, reader: str, clock: str) -> tuple[str, str, str | None]:
    """(reader, clock, fallback) a StreamingClient for ``base_url`` uses when asked for ``reader`` and
    ``clock``: https goes through geventhttpclient, timed in user space; the kernel clock falls back to user
    space where the platform gives no receive timestamps. ``fallback``: why the kernel is not used when
    asked for (None otherwise)."""
    used = GEVENTHTTPCLIENT if urlsplit(base_url).scheme == "https" else reader
    if clock != lean.KERNEL:
        return used, lean.USER, None
    if used != LEAN:
        why = "https: TLS is read by the ssl module" if reader == LEAN else "the geventhttpclient reader"
        return used, lean.USER, f"{why}: no receive timestamps, user space"
    ok, why = lean.kernel_timestamps_available()
    return (used, lean.KERNEL, None) if ok else (used, lean.USER, f"{why}: user space")


def receipt_info(target, base_url: str) -> ReceiptInfo:
    """The manifest's ``receipt``: what a run's users (``target``: the profile's TargetConfig) time with."""
    reader, clock, fallback = receipt_setup(base_url, target.reader, target.receipt_clock)
    return ReceiptInfo(reader=reader, clock_requested=target.receipt_clock, clock=clock, fallback=fallback)


class StreamingClient:
    """A keep-alive connection to one server, for one request at a time (one per Locust user)."""

    def __init__(
        self,
        base_url: str,
        connect_timeout_s: float,
        idle_timeout_s: float,
        timeout_s: float,
        headers: dict[str, str] | None = None,
        reader: str = LEAN,
        clock: str = lean.KERNEL,
    ):
        """``headers``: sent with every request (the target's ``Authorization``). ``reader``: LEAN or
        GEVENTHTTPCLIENT (https always uses the latter); ``clock``: the lean reader's receipt clock,
        ``lean.KERNEL`` (where the platform gives receive timestamps; else user space) or ``lean.USER``."""
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
        if reader not in READERS or clock not in (lean.KERNEL, lean.USER):
            raise ValueError(f"reader {reader!r} / clock {clock!r}: not one of {READERS} / kernel, user")
        self.reader = GEVENTHTTPCLIENT if parts.scheme == "https" else reader
        self._lean: lean.LeanConnection | None = None
        if self.reader == LEAN:
            self._lean = lean.LeanConnection(
                parts.hostname, self._args["port"], connect_timeout_s, idle_timeout_s, clock
            )
            self._host = parts.netloc.rpartition("@")[2]
            self._head_cache: dict[str, str] = {}

    def _client(self) -> HTTPClient:
        if self._http is None:
            self._http = HTTPClient(**self._args)
        return self._http

    def close(self) -> None:
        """Drops the connection; the next request opens a fresh one."""
        if self._http is not None:
            self._http.close()
            self._http = None
        if self._lean is not None:
            self._lean.close()

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
        if self._lean is not None:
            return self._post_lean(path, body, ex, keep_from, sent_headers)
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
            ex.user_reads = len(ex.times)  # a line per read
        return ex

    def _post_lean(
        self, path: str, body: bytes, ex: Exchange, keep_from: bytes | None, sent_headers: dict[str, str]
    ) -> Exchange:
        """``post_stream`` on the lean reader: the same outcomes, errors and fields as the other path."""
        conn = self._lean
        head = lean.request_head("POST", self.base_path + path, self._host, sent_headers, len(body))
        request = head + body
        idle_s = self._args["network_timeout"]
        deadline = gevent.Timeout(self.timeout_s)
        deadline.start()
        idle = None
        finished = False
        stream = lean.Stream()
        try:
            for attempt in (1, 2):
                fresh = not conn.usable()
                conn.offset.refresh()
                ex.t_send_wall = time.time()
                ex.t_send = time.perf_counter()
                if idle is None:
                    idle = conn.watch_idle()
                try:
                    if fresh:
                        conn.connect()
                except lean.IdleTimeout:
                    raise
                except TimeoutError:
                    error = f"could not connect within {conn.connect_timeout_s:g} s"
                    return self._fail(ex, CONNECT_ERROR, error)
                except OSError as e:
                    return self._fail(ex, CONNECT_ERROR, f"{type(e).__name__}: {e}")
                stream = lean.Stream()
                parser = lean.httptools.HttpResponseParser(stream)
                try:
                    conn.send(request)
                    t, kernel = conn.read_head(parser, stream)
                    break
                except lean.IdleTimeout:
                    return self._fail(ex, TIMEOUT, f"no response headers within idle_timeout_s={idle_s:g}")
                except OSError as e:
                    # A kept-alive connection the server closed as we sent: once more on a fresh one.
                    if attempt == 1 and not fresh and stream.reads == 0 and lean.is_reset(e):
                        conn.close()
                        continue
                    return self._fail(ex, CONNECT_ERROR, f"{type(e).__name__}: {e}")
            ex.status = status = parser.get_status_code()
            served_by = stream.header(WORKER_HEADER.lower())
            if served_by is not None:
                ex.served_by, ex.status_source = _one(served_by), STATUS_WORKER
            elif stream.header(FRONT_HEADER.lower()) is not None or stream.header(ROUTER_ERROR_HEADER):
                ex.status_source = STATUS_FRONT
            if status >= 300:
                ex.body = conn.read_body(parser, stream, MAX_ERROR_BODY)
                return self._fail(ex, HTTP_ERROR, None)
            content_type = _one(stream.header("content-type") or "")
            if "text/event-stream" not in content_type:
                head = conn.read_body(parser, stream, 200)
                got = f"{content_type or 'no content type'}: {head[:200]!r}"
                return self._fail(ex, PROTOCOL_ERROR, f"expected a text/event-stream reply, got {got}")
            lines, times = ex.lines, ex.times
            ex.last_whole = conn.read_lines(parser, stream, t, kernel, lines, times, keep_from)
            ex.t_end = times[-1] if times else time.perf_counter()
            ex.kernel_reads, ex.user_reads = stream.kernel_reads, stream.user_reads
            if not (stream.keep_alive and parser.should_keep_alive()):
                conn.close()
            finished = True
        except gevent.Timeout as e:
            if e is not deadline:
                raise
            self._fail(ex, TIMEOUT, f"request took longer than timeout_s={self.timeout_s:g}")
        except lean.IdleTimeout:
            self._fail(ex, TIMEOUT, f"no data for idle_timeout_s={idle_s:g}")
        except OSError as e:  # Closed, ParseError, a reset
            self._fail(ex, DROPPED, f"connection lost mid-stream ({type(e).__name__}: {e})")
        finally:
            deadline.close()
            if idle is not None:
                idle.stop()
            if not finished and ex.transport == OK:  # e.g. GreenletExit mid-stream: never reuse it
                conn.close()
        if ex.transport != OK:
            ex.kernel_reads, ex.user_reads = stream.kernel_reads, stream.user_reads
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
