"""A TCP proxy that adds latency, caps bandwidth, counts HTTP requests and injects faults.

Put it between an fsspec client and an emulator::

    with MotoServer() as s3, LatencyProxy.in_front_of(s3, latency_s=0.02,
                                                      bandwidth_bps=200e6) as px:
        fs = s3.filesystem(px.endpoint)       # or s3.storage_options(px.endpoint)
        ...
        assert px.count("GET", "/bucket/key") == 1

Real networks add latency per round trip; ``tc netem`` is not available on
these machines, so the proxy does it in user space. One thread per connection
(daemon) serves both directions.
"""

from __future__ import annotations

import collections
import contextlib
import random
import re
import select
import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import Callable
from types import TracebackType
from typing import Any, Protocol

__all__ = ["LatencyProxy"]


class _HasAddress(Protocol):
    host: str
    port: int


# A request line as it starts a request; PARTIAL is a prefix of one still arriving.
_REQUEST_LINE = re.compile(rb"([A-Z]{3,16}) (\S+) HTTP/1\.[01]\r?\n")
_PARTIAL_REQUEST_LINE = re.compile(rb"[A-Z]{0,16}(?: \S*(?: [HTP/10.]*\r?)?)?")
_CHUNK = 256 * 1024


def _readable(socks: list[socket.socket], timeout_s: float) -> list[socket.socket]:
    """Those of ``socks`` that have bytes (or their end) to read within ``timeout_s``.

    ``poll``, not ``select``: select refuses descriptors past 1023, which a run
    with thousands of connections (a simulation of many ranks) reaches.
    """
    poller = select.poll()
    by_fd = {}
    for s in socks:
        poller.register(s, select.POLLIN)
        by_fd[s.fileno()] = s
    return [by_fd[fd] for fd, _ in poller.poll(timeout_s * 1000)]


class _TokenBucket:
    """Paces one direction of one connection to ``rate`` bytes/s."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.burst = float(min(_CHUNK, max(rate * 0.01, 16 * 1024)))
        self.tokens = self.burst
        self.stamp = time.monotonic()

    def take(self, n: int) -> None:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        self.tokens -= n
        if self.tokens < 0:
            time.sleep(-self.tokens / self.rate)


class _SharedBucket(_TokenBucket):
    """Paces one direction of every connection together (a node's link), thread-safe:
    each taker waits until its bytes are paid for."""

    def __init__(self, rate: float) -> None:
        super().__init__(rate)
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        with self._lock:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            self.tokens -= n
            wait = -self.tokens / self.rate if self.tokens < 0 else 0.0
        if wait:
            time.sleep(wait)


class _Drop(Exception):
    """Internal: reset this connection now."""


class _Stall(Exception):
    """Internal: hold this connection open and never answer (a hung server or proxy)."""


class _Answer(Exception):
    """Internal: answer this request with an error status and close the connection."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


_FAULT_KINDS = ("503", "500", "reset", "cut", "stall", "hold")
# Error bodies in S3's format (Azure and GCS clients go by the status alone).
_STATUS_TEXT = {500: ("Internal Server Error", "InternalError"),
                503: ("Slow Down", "SlowDown"), 429: ("Too Many Requests", "SlowDown")}


class LatencyProxy:
    """A TCP proxy on 127.0.0.1 that slows, counts and breaks HTTP/1.1 traffic.

    Args:
        target_host, target_port: where to forward.
        latency_s: delay added before each new request is forwarded (a request
            starts with the first client bytes after the server has answered,
            and must look like a request line, so keep-alive, uploads and
            ``Expect: 100-continue`` work).
        bandwidth_bps: cap in *bits* per second, per connection and direction
            (``200e6`` = 200 Mbit/s).
        total_bandwidth_bps: cap in bits per second per direction for all
            connections together (a node's link: without it, enough parallel
            streams make the store look faster than the link).
        fail_every: reset the connection on every N-th request (before it
            reaches the server).
        fault_rate: the share of requests (0..1) that get a fault, drawn with
            ``seed``: a 503 SlowDown or a 500 answer, a reset before the request
            reaches the server, a response cut part-way, or a stall: the request
            is read and never answered (``fault_kinds`` chooses among "503",
            "500", "reset", "cut", "stall", "hold": the response is forwarded
            part-way, then nothing more comes and the connection stays open; the
            default leaves stalls out). ``faults`` counts them, ``stalled`` counts
            both stalling kinds by request.

    ``requests`` counts every request seen, dropped ones included, by
    ``(method, path)`` with the path percent-decoded and the query removed:
    S3 ``/bucket/key``, Azure ``/devstoreaccount1/container/blob``, GCS media
    ``/download/storage/v1/b/bucket/o/key``. ``log`` keeps raw targets in order.
    Counts are per request, not per connection, so retries show up.
    """

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        latency_s: float = 0.0,
        bandwidth_bps: float | None = None,
        total_bandwidth_bps: float | None = None,
        fail_every: int | None = None,
        fault_rate: float = 0.0,
        fault_kinds: tuple[str, ...] = ("503", "500", "reset", "cut"),
        seed: int = 0,
    ) -> None:
        if latency_s < 0:
            raise ValueError("latency_s must be >= 0")
        if bandwidth_bps is not None and bandwidth_bps <= 0:
            raise ValueError("bandwidth_bps must be > 0 (or None for no cap)")
        if total_bandwidth_bps is not None and total_bandwidth_bps <= 0:
            raise ValueError("total_bandwidth_bps must be > 0 (or None for no cap)")
        if fail_every is not None and fail_every < 1:
            raise ValueError("fail_every must be >= 1 (or None)")
        self.target = (target_host, int(target_port))
        self.latency_s = latency_s
        self.bandwidth_bps = bandwidth_bps
        self.total_bandwidth_bps = total_bandwidth_bps
        total = total_bandwidth_bps / 8 if total_bandwidth_bps else None
        self._total_up = _SharedBucket(total) if total else None
        self._total_down = _SharedBucket(total) if total else None
        self.fail_every = fail_every
        if not 0.0 <= fault_rate <= 1.0 or set(fault_kinds) - set(_FAULT_KINDS):
            raise ValueError(f"fault_rate must be in [0, 1]; fault_kinds of {_FAULT_KINDS}")
        self.fault_rate = fault_rate
        self.fault_kinds = tuple(fault_kinds)
        self._rng = random.Random(seed)
        self.faults: collections.Counter[str] = collections.Counter()
        self.host = "127.0.0.1"
        self.port = 0
        self.requests: collections.Counter[tuple[str, str]] = collections.Counter()
        self.dropped: collections.Counter[tuple[str, str]] = collections.Counter()
        self.log: list[tuple[str, str]] = []
        self.headers: list[tuple[str, str, frozenset[str]]] = []
        self.connections = 0
        self._seq = 0
        # (response bytes before the reset, method, request bytes before the reset)
        self._drops: collections.deque[tuple[int, str | None, int | None]] = collections.deque()
        self._answers: collections.deque[tuple[int, str | None]] = collections.deque()
        self._stalls: collections.deque[tuple[str | None, int]] = collections.deque()
        self._hooks: collections.deque[tuple[Callable[[], None], str | None]] = (
            collections.deque()
        )
        self.stalled: collections.Counter[tuple[str, str]] = collections.Counter()
        self.answered: collections.Counter[int] = collections.Counter()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()

    @classmethod
    def in_front_of(cls, server: _HasAddress, **kwargs: Any) -> LatencyProxy:
        """A proxy (not started) forwarding to a started emulator (anything with host, port)."""
        if not server.port:
            raise RuntimeError("start the emulator before putting a proxy in front of it")
        return cls(server.host, server.port, **kwargs)

    @property
    def endpoint(self) -> str:
        if not self.port:
            raise RuntimeError("LatencyProxy is not started; call start() first")
        return f"http://{self.host}:{self.port}"

    # -- lifecycle -----------------------------------------------------------
    def start(self) -> LatencyProxy:
        if self._listener is not None:
            return self
        self._stopping.clear()
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, 0))
        listener.listen(128)
        # A timeout lets the accept loop notice stop() without cross-thread close tricks.
        listener.settimeout(0.2)
        self._listener = listener
        self.port = int(listener.getsockname()[1])
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"proxy-accept-{self.port}", daemon=True
        )
        self._accept_thread.start()
        return self

    def stop(self) -> None:
        if self._listener is None:
            return
        self._stopping.set()
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=2)
        self._listener.close()
        self._listener = None
        with self._lock:
            conns, threads = list(self._conns), list(self._threads)
        for s in conns:
            # shutdown wakes the select() of the owning thread; it closes the socket.
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        for t in threads:
            t.join(timeout=2)
        self.port = 0

    def __enter__(self) -> LatencyProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- faults and counts ---------------------------------------------------
    def drop_next(
        self, n: int = 1, *, after_bytes: int = 0, method: str | None = None,
        request_bytes: int | None = None,
    ) -> None:
        """Reset the connection (TCP RST) on each of the next ``n`` requests.

        ``after_bytes=0`` drops the request before it reaches the server;
        ``after_bytes=k`` forwards it and then cuts the response after ``k``
        bytes (headers included), i.e. mid-stream. ``request_bytes=k`` forwards
        the first ``k`` bytes of the request (its line and headers included) and
        then resets: the server saw part of it (an upload cut part-way); a
        request shorter than that is not cut. ``method`` limits which requests
        are hit (e.g. ``"GET"``).
        """
        if n < 0 or after_bytes < 0 or (request_bytes is not None and request_bytes < 1):
            raise ValueError("n and after_bytes must be >= 0, request_bytes >= 1 (or None)")
        if request_bytes is not None and after_bytes:
            raise ValueError("a request is cut either on its way (request_bytes) or in its "
                             "answer (after_bytes), not both")
        with self._lock:
            self._drops.extend([(after_bytes, method, request_bytes)] * n)

    def answer_next(self, n: int = 1, *, status: int = 503, method: str | None = None) -> None:
        """Answer each of the next ``n`` requests with HTTP ``status`` (503 SlowDown, 500,
        429) instead of forwarding them; ``method`` limits which requests are hit."""
        if n < 0 or status not in _STATUS_TEXT:
            raise ValueError(f"n must be >= 0 and status one of {sorted(_STATUS_TEXT)}")
        with self._lock:
            self._answers.extend([(status, method)] * n)

    def stall_next(
        self, n: int = 1, *, method: str | None = None, after_bytes: int = 0
    ) -> None:
        """Stall each of the next ``n`` requests: read it (body included) and never answer
        nor forward it, as a hung server or proxy does; the connection stays open until
        the client gives up or the proxy stops. ``after_bytes=k`` forwards it and holds
        the response after ``k`` bytes (headers included) instead. ``stalled`` counts
        them."""
        if n < 0 or after_bytes < 0:
            raise ValueError("n and after_bytes must be >= 0")
        with self._lock:
            self._stalls.extend([(method, after_bytes)] * n)

    def call_next(self, fn: Callable[[], None], *, method: str | None = None) -> None:
        """Run ``fn()`` when the next request (of ``method``) arrives, before it is forwarded:
        a deterministic "meanwhile" for tests (e.g. another job fills a disk)."""
        with self._lock:
            self._hooks.append((fn, method))

    def clear_faults(self) -> None:
        """Forget the faults still queued by ``drop_next``/``answer_next``/``stall_next``/
        ``call_next`` (the link is healthy again; requests already held stay held)."""
        with self._lock:
            self._drops.clear()
            self._answers.clear()
            self._stalls.clear()
            self._hooks.clear()

    @property
    def pending_stalls(self) -> int:
        with self._lock:
            return len(self._stalls)

    @property
    def pending_drops(self) -> int:
        with self._lock:
            return len(self._drops)

    def reset_counts(self) -> None:
        with self._lock:
            self.requests.clear()
            self.headers.clear()
            self.dropped.clear()
            self.log.clear()
            self._seq = 0

    def count(self, method: str, path: str) -> int:
        """Requests seen with ``method`` whose path equals ``path``."""
        with self._lock:
            return self.requests[(method, path)]

    def _on_request(self, method: str, target: str) -> tuple[int | None, bool, int | None]:
        """Record a request; returns the bytes of response to pass before a reset (or
        None), whether the connection is then held open instead of reset, and the
        bytes of the request to forward before a reset (or None)."""
        path = urllib.parse.unquote(urllib.parse.urlsplit(target).path)
        key = (method, path)
        hook = None
        with self._lock:
            if self._hooks and self._hooks[0][1] in (None, method):
                hook = self._hooks.popleft()[0]
        if hook is not None:
            hook()  # outside the lock: it may take a while
        with self._lock:
            self.requests[key] += 1
            self.log.append((method, target))
            self._seq += 1
            drop: int | None = None
            cut_request: int | None = None
            if self._answers and self._answers[0][1] in (None, method):
                status = self._answers.popleft()[0]
                self.answered[status] += 1
                raise _Answer(status)
            if self._stalls and self._stalls[0][0] in (None, method):
                after = self._stalls.popleft()[1]
                self.stalled[key] += 1
                if not after:
                    raise _Stall
                return after, True, None
            if self._drops and self._drops[0][1] in (None, method):
                drop, _, cut_request = self._drops.popleft()
                if cut_request is not None:
                    drop = None
                    self.dropped[key] += 1
            elif self.fail_every and self._seq % self.fail_every == 0:
                drop = 0
            elif self.fault_rate and self._rng.random() < self.fault_rate:
                kind = self._rng.choice(self.fault_kinds)
                self.faults[kind] += 1
                if kind in ("503", "500"):
                    raise _Answer(int(kind))
                if kind == "stall":
                    self.stalled[key] += 1
                    raise _Stall
                # A cut lands after the headers and a little of the body.
                drop = 0 if kind == "reset" else self._rng.randint(200, 4096)
                if kind == "hold":
                    self.stalled[key] += 1
                    return drop, True, None
            if drop is not None:
                self.dropped[key] += 1
        return drop, False, cut_request

    # -- plumbing ------------------------------------------------------------
    def _accept_loop(self) -> None:
        listener = self._listener
        while listener is not None and not self._stopping.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            t = threading.Thread(
                target=self._serve, args=(client,), name=f"proxy-conn-{self.port}", daemon=True
            )
            with self._lock:
                self.connections += 1
                self._threads.add(t)
            t.start()

    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        try:
            with self._lock:
                self._conns.add(client)
            try:
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                _reset(client)
                return
            upstream.settimeout(None)
            with self._lock:
                self._conns.add(upstream)
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._pump(client, upstream)
        except _Drop:
            _reset(client)
        except _Answer as answer:
            _answer(client, answer.status)
        except _Stall:
            self._hold(client)
        except OSError:
            pass  # a peer went away; both sides are closed below
        finally:
            for sock in (client, upstream):
                if sock is not None:
                    with self._lock:
                        self._conns.discard(sock)
                    with contextlib.suppress(OSError):
                        sock.close()
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _hold(self, client: socket.socket) -> None:
        """Read and drop what the client sends, never answer, until it hangs up or we stop."""
        with contextlib.suppress(OSError):  # the client reset it: as good as hanging up
            while not self._stopping.is_set():
                ready = _readable([client], 0.25)
                if ready and not client.recv(_CHUNK):
                    return

    def _pump(self, client: socket.socket, upstream: socket.socket) -> None:
        # One thread per connection serves both directions: every decision about
        # a connection (delay, reset, close) is taken by the thread that owns it.
        rate = self.bandwidth_bps / 8 if self.bandwidth_bps else None
        up_bucket = _TokenBucket(rate) if rate else None
        down_bucket = _TokenBucket(rate) if rate else None
        expect_request = True  # next client bytes may start a request
        pending = b""
        cut_after: int | None = None  # response bytes left before a mid-stream reset
        cut_request: int | None = None  # request bytes left to forward before a reset
        hold = False  # at cut_after, hold the connection open instead of resetting it
        open_ = {client: True, upstream: True}
        while not self._stopping.is_set():
            readable = [s for s, is_open in open_.items() if is_open]
            if not readable:
                return
            ready = _readable(readable, 0.25)
            for s in ready:
                data = s.recv(_CHUNK)
                if s is client:
                    if not data:
                        open_[client] = False
                        with contextlib.suppress(OSError):
                            upstream.shutdown(socket.SHUT_WR)
                        continue
                    if expect_request:
                        pending += data
                        if len(pending) < 8192 and _PARTIAL_REQUEST_LINE.fullmatch(pending):
                            continue  # request line not complete yet
                        data, pending = pending, b""
                        m = _REQUEST_LINE.match(data)
                        if m:
                            expect_request = False
                            head = data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]
                            names = frozenset(
                                h.split(b":", 1)[0].strip().lower().decode("latin-1")
                                for h in head if b":" in h)
                            with self._lock:
                                self.headers.append(
                                    (m.group(1).decode(), m.group(2).decode(), names))
                            drop, hold, cut_request = self._on_request(
                                m.group(1).decode(), m.group(2).decode()
                            )
                            if drop == 0:
                                raise _Drop
                            cut_after = drop
                            if self.latency_s:
                                time.sleep(self.latency_s)
                    if cut_request is not None:
                        if len(data) >= cut_request:
                            upstream.sendall(data[:cut_request])
                            raise _Drop
                        cut_request -= len(data)
                    if up_bucket:
                        up_bucket.take(len(data))
                    if self._total_up:
                        self._total_up.take(len(data))
                    upstream.sendall(data)
                else:
                    if not data:
                        open_[upstream] = False
                        with contextlib.suppress(OSError):
                            client.shutdown(socket.SHUT_WR)
                        continue
                    expect_request = True
                    if cut_after is not None:
                        if len(data) >= cut_after:
                            client.sendall(data[:cut_after])
                            raise _Stall if hold else _Drop
                        cut_after -= len(data)
                    if down_bucket:
                        down_bucket.take(len(data))
                    if self._total_down:
                        self._total_down.take(len(data))
                    client.sendall(data)


def _answer(sock: socket.socket, status: int) -> None:
    """Send an error response and close, as a throttling or failing server would."""
    reason, code = _STATUS_TEXT[status]
    body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
            f"<Message>{reason} (injected by the test proxy)</Message></Error>").encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    with contextlib.suppress(OSError):
        sock.sendall(head + body)
        sock.shutdown(socket.SHUT_WR)
    with contextlib.suppress(OSError):
        sock.close()


def _reset(sock: socket.socket) -> None:
    """Close with a TCP RST (linger 0), as a crashed peer or middlebox would."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()
