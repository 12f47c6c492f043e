"""A delaying, faulting HTTP proxy in front of an S3 server (the tests' SeaweedFS): it
gives a loopback server the latency of a real object store, and lets a test make the
bucket throttle.

Every request is forwarded as it came (method, path, headers with the Host the client
signed, body) after ``delay`` seconds, except that the next ``fail_next(n)`` requests are
answered ``503 SlowDown`` as a throttled bucket answers them.  Every request is recorded
(method, path, when it arrived, its Range header, the bytes its answer carried) so a test
can check what reached the bucket: nothing but reads, in which order, how much.  ``tc``'s
netem would be the usual way to add latency, but this kernel has no netem qdisc.

Cost, measured on the 2-core VM (2026-11-29, 110 KB GETs by obstore, one at a time,
SeaweedFS answering in 2.2 ms median): the proxy adds 0.65 ms of latency and spends
0.6-0.8 ms of CPU per request without a delay; with ``delay=0.01`` a GET took 14.4 ms
median (the 10 ms, the proxy's 0.65 and ~1.5 ms of sleep overshoot on a loaded machine)
and 0.9-1.4 ms of proxy CPU.  That CPU would be taken from what a benchmark measures on
the same cores, so the benchmark suite's S3 rows use ``tools/s3_proxy_c`` (C, the same
per-request delay, ~0.1 ms of CPU per GET, no faults and no record).  Each client
connection has its own thread and its own upstream keep-alive connection (both S3
clients pool connections).  ``with S3Proxy(target_port, delay=0.01) as proxy:``."""

from __future__ import annotations

import http.client
import threading
import time
from dataclasses import dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType

SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")
# Headers that describe one hop's connection, not the request: never forwarded.
HOP_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade"})
# Seconds an upstream answer may take: far beyond any answer of a loopback server, so a
# client's own timeout (backendTimeout) always fires first.
UPSTREAM_TIMEOUT = 30.0


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    path: str  # as sent: "/bucket/key?query" (path style)
    at: float  # time.monotonic() when it arrived
    range: str = ""  # its Range header, "" if none
    sent: int = 0  # bytes of the answer's body sent back (0 until it is answered)


class S3Proxy:
    def __init__(self, target_port: int, *, delay: float = 0.0) -> None:
        self.target_port = target_port
        self.delay = delay  # seconds added to every request before it is forwarded
        self.lock = threading.Lock()
        self.to_fail = 0
        self.failed = 0  # requests answered 503
        self.requests: list[Request] = []  # every request, in order of arrival
        self.stopped = False
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the clients pool connections
            upstream: http.client.HTTPConnection | None = None  # this client connection's

            def log_message(self, format: str, *args: object) -> None:
                pass  # quiet: pytest's output is for failures

            def _forward(self, body: bytes) -> http.client.HTTPResponse:
                for attempt in range(2):  # a kept-alive upstream connection the server closed: one new one
                    if self.upstream is None:
                        self.upstream = http.client.HTTPConnection("127.0.0.1", proxy.target_port,
                                                                   timeout=UPSTREAM_TIMEOUT)
                    try:
                        self.upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                        for name, value in self.headers.items():
                            if name.lower() not in HOP_HEADERS:
                                self.upstream.putheader(name, value)
                        self.upstream.endheaders(body or None)
                        return self.upstream.getresponse()
                    except (ConnectionError, http.client.HTTPException):
                        self.upstream.close()
                        self.upstream = None
                        if attempt:
                            raise
                raise AssertionError("unreachable")

            def _handle(self) -> None:
                if proxy.stopped:  # a kept-alive connection outlives the server: drop it unanswered
                    self.close_connection = True
                    return
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with proxy.lock:
                    index = len(proxy.requests)
                    proxy.requests.append(Request(self.command, self.path, time.monotonic(),
                                                  self.headers.get("Range") or ""))
                    fail = proxy.to_fail > 0
                    if fail:
                        proxy.to_fail -= 1
                        proxy.failed += 1
                if proxy.delay:
                    time.sleep(proxy.delay)
                if fail:
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOW_DOWN)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(SLOW_DOWN)
                    return
                answer = self._forward(body)
                data = answer.read()
                self.send_response(answer.status, answer.reason)
                for name, value in answer.getheaders():
                    if name.lower() not in HOP_HEADERS and name.lower() != "content-length":
                        self.send_header(name, value)
                # A HEAD answer's Content-Length is the object's size, with no body.
                length_header = answer.getheader("Content-Length") if self.command == "HEAD" else str(len(data))
                if length_header is not None:
                    self.send_header("Content-Length", length_header)
                self.end_headers()
                if self.command != "HEAD":
                    with proxy.lock:
                        proxy.requests[index] = replace(proxy.requests[index], sent=len(data))
                    self.wfile.write(data)

            def finish(self) -> None:
                super().finish()
                if self.upstream is not None:
                    self.upstream.close()

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def methods(self) -> list[str]:
        """Every request's method, in order of arrival."""
        with self.lock:
            return [r.method for r in self.requests]

    def fail_next(self, n: int) -> None:
        with self.lock:
            self.to_fail = n

    def __enter__(self) -> S3Proxy:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stopped = True
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(10)

