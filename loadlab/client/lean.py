"""loadlab's own HTTP/1.1 stream reader: one plain socket per user, every wake-up's bytes in one read, the
receipt time from the kernel.

What it does per wake-up of the event loop: one ``recvmsg`` of everything the socket holds (no second call
that returns EAGAIN: the loop waits for readability first and reads again at once only when a read filled
the buffer), the bytes through ``httptools`` (llhttp: status line, headers, chunked or Content-Length
framing, keep-alive), the body split into SSE lines in bulk, and every line that the read completed
stamped with that read's receipt time. Blank lines (event separators) are not kept.

The receipt time (``clock="kernel"``): ``SO_TIMESTAMPNS`` is set on the socket, so every ``recvmsg``
carries the time the kernel queued the last packet it returns (``SCM_TIMESTAMPNS``, CLOCK_REALTIME ns),
which is converted to the ``perf_counter()`` clock of the send times with an offset taken from a tight
pair of clock reads (``ClockOffset``). The kernel stamps a packet when the network stack receives it
(on loopback, in the sender's context), so it does not wait for this process to be scheduled: a busy
core delays when the bytes are handled, not their time. Where a read brings no timestamp (a platform or
socket without it, or a clock step that would put the kernel's time after the user-space one), the
user-space time of the read is used and counted (``Stream.user_reads``). ``clock="user"``: the
user-space time only (``perf_counter()`` right after the read returned).

One read that completes several events gives them one time, the last packet's: they are counted as
coalesced by the caller (``request.to_record``), from equal times. Plain http only: over TLS the bytes
are decrypted by the ssl module in its own reads, so a read's packets are no longer the bytes of the lines
it completes (the https path stays on geventhttpclient, see ``stream.py``).
"""

from __future__ import annotations

import errno
import socket
import struct
import sys
import time

import gevent
import gevent.socket
import httptools
from gevent.hub import get_hub

READ_SIZE = 256 * 1024  # one read takes whatever the socket holds, up to this
# Linux's values (asm-generic and x86); the socket module lacks the names on some builds.
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35 if sys.platform.startswith("linux") else None)
SCM_TIMESTAMPNS = getattr(socket, "SCM_TIMESTAMPNS", SO_TIMESTAMPNS)
_TIMESPEC = struct.Struct("@qq")  # struct timespec: tv_sec, tv_nsec (64-bit longs)
ANC_SIZE = socket.CMSG_SPACE(_TIMESPEC.size) if hasattr(socket, "CMSG_SPACE") else 0
NS = 1_000_000_000
STEP_S = 0.001  # a kernel time this far after the user-space one is a wall clock step, not a receipt
KERNEL, USER = "kernel", "user"


class Closed(ConnectionError):
    """The peer closed the connection (EOF), before the response ended."""


class IdleTimeout(TimeoutError):
    """No byte for the idle timeout."""


class ParseError(ConnectionError):
    """The peer's bytes are not HTTP/1.1."""


_KEEPER: socket.socket | None = None


def kernel_timestamps_available() -> tuple[bool, str | None]:
    """Whether this platform gives receive timestamps on a TCP socket (``SO_TIMESTAMPNS`` and ``recvmsg``),
    and if not, why."""
    if SO_TIMESTAMPNS is None or not hasattr(socket.socket, "recvmsg") or not ANC_SIZE:
        return False, f"{sys.platform}: no SO_TIMESTAMPNS / recvmsg"
    global _KEEPER
    if _KEEPER is None:
        try:
            keeper = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            keeper.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        except OSError as e:
            return False, f"SO_TIMESTAMPNS refused: {e}"
        # Kept open for the process's life: Linux stamps received packets only while some socket asks
        # for it, and switches that on lazily (a deferred static key), so the first packets of the
        # first connections would otherwise come without a timestamp.
        _KEEPER = keeper
    return True, None


class ClockOffset:
    """CLOCK_REALTIME ns minus ``perf_counter_ns()`` (CLOCK_MONOTONIC), from the tightest of a few
    (perf, time, perf) brackets: its error is half the bracket (~0.1 us) unless the wall clock is stepped
    (settimeofday, an NTP step) after it was taken; NTP slewing moves both clocks alike. ``refresh`` is
    called once per request, so a step misplaces at most the events of the requests in flight."""

    __slots__ = ("ns",)

    def __init__(self) -> None:
        self.ns = 0
        self.refresh()

    def refresh(self) -> None:
        perf, wall = time.perf_counter_ns, time.time_ns
        best = None
        for _ in range(3):
            a = perf()
            w = wall()
            b = perf()
            if best is None or b - a < best[0]:
                best = (b - a, w - (a + b) // 2)
        self.ns = best[1]


class Stream:
    """One response as it is read: status, headers, and the body's SSE lines with their receipt times."""

    __slots__ = ("status", "headers", "head_done", "done", "keep_alive", "pieces", "user_reads",
                 "kernel_reads", "reads")  # fmt: skip

    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[str, list[str]] = {}
        self.head_done = False
        self.done = False
        self.keep_alive = True  # False: the body ended with the connection
        self.pieces: list[bytes] = []  # body bytes of the current read, not yet split
        self.user_reads = 0  # reads with body bytes timed in user space
        self.kernel_reads = 0  # reads with body bytes timed by the kernel
        self.reads = 0

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.setdefault(name.decode("latin-1").lower(), []).append(value.decode("latin-1"))

    def on_headers_complete(self) -> None:
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        self.pieces.append(body)

    def on_message_complete(self) -> None:
        self.done = True

    def header(self, name: str) -> str | list[str] | None:
        """A header's value (a list when it came more than once), by lower-case name."""
        values = self.headers.get(name)
        if not values:
            return None
        return values[0] if len(values) == 1 else values


class LeanConnection:
    """A keep-alive HTTP/1.1 connection over a plain non-blocking socket, for one request at a time; the
    waits go through the gevent hub (read and write watchers of its own), so it runs beside any other
    greenlet. ``clock``: KERNEL (receive timestamps where the platform gives them) or USER."""

    def __init__(self, host: str, port: int, connect_timeout_s: float, idle_timeout_s: float, clock: str):
        self.host, self.port = host, port
        self.connect_timeout_s = connect_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.kernel = clock == KERNEL and kernel_timestamps_available()[0]
        self.offset = ClockOffset()
        self.sock: socket.socket | None = None
        self._read = self._write = None
        self._more = False  # the last read filled the buffer: read again before waiting
        self._last = 0.0  # perf_counter of the last read (or of the start of the wait for it)

    # ---- connection ---------------------------------------------------------------------------

    def connect(self) -> None:
        """Connects a fresh socket; raises OSError (TimeoutError past the connect timeout)."""
        self.close()
        gsock = gevent.socket.create_connection((self.host, self.port), timeout=self.connect_timeout_s)
        sock = socket.socket(gsock.family, gsock.type, gsock.proto, fileno=gsock.detach())
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.kernel:
            sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        loop = get_hub().loop
        self._read = loop.io(sock.fileno(), 1)
        self._write = loop.io(sock.fileno(), 2)
        self.sock = sock
        self._more = False

    def close(self) -> None:
        if self.sock is not None:
            self._read.close()
            self._write.close()
            self.sock.close()
            self.sock = None

    def usable(self) -> bool:
        """A connected socket the server has not closed meanwhile (a non-blocking peek: nothing to read
        means alive; EOF, a reset or stray bytes mean start afresh)."""
        if self.sock is None:
            return False
        try:
            self.sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return True
        except OSError:
            pass
        return False

    # ---- one exchange -------------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        """Writes the whole request; OSError when the connection is gone."""
        view = memoryview(data)
        sock, hub = self.sock, get_hub()
        while view:
            try:
                n = sock.send(view)
            except BlockingIOError:
                hub.wait(self._write)
                continue
            view = view[n:]

    def fill(self, feed, stream: Stream) -> tuple[float, bool]:
        """One read: waits until the socket is readable (unless the last read filled the buffer), takes
        everything it holds with one ``recvmsg`` and feeds it to the parser. Returns the read's receipt time
        (perf_counter clock) and whether the kernel gave it. Raises Closed (EOF before the end of the
        response), ParseError, OSError.

        Reads that stop at chunk ends would not give queued events their own times: Linux merges a
        packet into the one still queued before it (``tcp_try_coalesce``) and keeps the later timestamp
        only, so what a late reader finds queued has one time, the last packet's, however it is read."""
        perf = time.perf_counter
        while True:
            if not self._more:
                self._last = perf()
                get_hub().wait(self._read)
            try:
                data, ancdata, _flags, _addr = self.sock.recvmsg(READ_SIZE, ANC_SIZE if self.kernel else 0)
                break
            except BlockingIOError:
                self._more = False
        t = perf()
        self._last = t
        if not data:
            if stream.head_done and _close_delimited(stream):
                stream.done = True  # a body without a length ends with the connection
                stream.keep_alive = False
                return t, False
            raise Closed("connection closed by the server")
        self._more = len(data) == READ_SIZE
        stream.reads += 1
        kernel = False
        if ancdata:
            sec, nsec = _TIMESPEC.unpack_from(ancdata[0][2])
            tk = (sec * NS + nsec - self.offset.ns) / NS
            if tk <= t + STEP_S:  # else the wall clock was stepped since the offset was taken: user time
                t, kernel = min(tk, t), True  # tk a hair after t: the offset's own error (~0.1 us)
        try:
            feed(data)
        except httptools.HttpParserError as e:
            raise ParseError(f"{type(e).__name__}: {e}") from None
        return t, kernel

    def read_head(self, parser, stream: Stream) -> tuple[float, bool]:
        """Reads until the response's headers are in; body bytes read with them stay in ``stream.pieces``.
        Returns the last read's time and clock (those bytes' receipt)."""
        feed = parser.feed_data
        t, kernel = self.fill(feed, stream)
        while not stream.head_done:
            t, kernel = self.fill(feed, stream)
        return t, kernel

    def read_lines(self, parser, stream: Stream, t: float, kernel: bool, lines: list, times: list,
                   keep_from: bytes | None):  # fmt: skip
        """Reads the body to its end as SSE lines: each line without its line end is appended to ``lines``
        and the receipt time of the read that completed it to ``times``; blank lines are dropped. ``t``,
        ``kernel``: the time of the head's read (for body bytes it carried). With ``keep_from``, each line
        is kept from the last occurrence of it on; returns the last line cut, whole (else None)."""
        feed, pieces = parser.feed_data, stream.pieces
        pending = b""
        whole = None
        while True:
            if pieces:
                if kernel:
                    stream.kernel_reads += 1
                else:
                    stream.user_reads += 1
                data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
                pieces.clear()
                if pending:
                    data = pending + data
                if b"\n" in data:
                    parts = data.split(b"\n")
                    pending = parts.pop()
                    for line in parts:
                        if not line or line == b"\r":
                            continue
                        if keep_from is not None:
                            cut = line.rfind(keep_from)
                            if cut > 0:
                                whole = line  # a reference, not a copy: only the last one stays alive
                                line = line[cut:]
                        lines.append(line)
                        times.append(t)
                else:
                    pending = data
            if stream.done:
                break
            t, kernel = self.fill(feed, stream)
        if pending:  # a last line without its newline, as readline returns it
            lines.append(pending)
            times.append(t)
        return whole

    def read_body(self, parser, stream: Stream, limit: int) -> bytes:
        """Reads up to ``limit`` bytes of the body (an error reply's); the connection is not reused after."""
        feed, pieces = parser.feed_data, stream.pieces
        got = b"".join(pieces)
        pieces.clear()
        while not stream.done and len(got) < limit:
            self.fill(feed, stream)
            got += b"".join(pieces)
            pieces.clear()
        return got[:limit]

    def watch_idle(self) -> _IdleWatch:
        """The idle timeout of one exchange, from now: IdleTimeout in this greenlet after
        ``idle_timeout_s`` without a read. Stop it when the exchange ends."""
        self._last = time.perf_counter()
        return _IdleWatch(self.idle_timeout_s, self)


class _IdleWatch:
    """The idle timeout without a timer restart per read: one timer, which on expiry checks the time of
    the last byte (``conn._last``) and either raises IdleTimeout in the reading greenlet or waits again
    for what is left."""

    __slots__ = ("idle", "conn", "greenlet", "timer")

    def __init__(self, idle: float, conn: LeanConnection):
        self.idle, self.conn = idle, conn
        self.greenlet = gevent.getcurrent()
        self.timer = None
        self._arm(idle)

    def _arm(self, after: float) -> None:
        self.timer = get_hub().loop.timer(max(after, 0.0))
        self.timer.start(self._check)

    def _check(self) -> None:
        left = self.conn._last + self.idle - time.perf_counter()
        self.timer.close()
        if left > 0:
            self._arm(left)
        else:
            self.timer = None
            self.greenlet.throw(IdleTimeout(f"no data for {self.idle:g} s"))

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.close()
            self.timer = None


def _close_delimited(stream: Stream) -> bool:
    """A response whose body ends at EOF (no Content-Length, not chunked): httptools waits for more."""
    te = stream.headers.get("transfer-encoding")
    return "content-length" not in stream.headers and not (te and "chunked" in te[-1].lower())


def request_head(method: str, target: str, host: str, headers: dict[str, str], length: int) -> bytes:
    """An HTTP/1.1 request head (latin-1, as HTTP)."""
    out = [f"{method} {target} HTTP/1.1\r\nHost: {host}\r\n"]
    out += [f"{name}: {value}\r\n" for name, value in headers.items()]
    out.append(f"Content-Length: {length}\r\n\r\n")
    return "".join(out).encode("latin-1")


def is_reset(e: OSError) -> bool:
    """The connection went away (EOF, reset, broken pipe): a kept-alive one the server had closed."""
    return isinstance(e, Closed) or e.errno in (errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED)
