"""A faulting HTTP proxy in front of the test S3 server: every request is forwarded as it
came (method, path, headers with the Host the client signed, body), except that the next
``fail_next(n)`` requests are answered ``503 SlowDown`` as a throttled bucket answers.
It records every method it saw, so a test can check that nothing but reads reached the
bucket.  Threads, loopback, a free port; ``with FaultProxy(target) as proxy:``."""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType

SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")
# Headers that describe one hop's connection, not the request: never forwarded.
HOP_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade"})


class FaultProxy:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.lock = threading.Lock()
        self.to_fail = 0
        self.failed = 0  # requests answered 503
        self.methods: list[str] = []  # every request's method, in order
        self.stopped = False
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the clients pool connections

            def log_message(self, format: str, *args: object) -> None:
                pass  # quiet: pytest's output is for failures

            def _handle(self) -> None:
                if proxy.stopped:  # a kept-alive connection outlives the server: drop it unanswered
                    self.close_connection = True
                    return
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with proxy.lock:
                    proxy.methods.append(self.command)
                    fail = proxy.to_fail > 0
                    if fail:
                        proxy.to_fail -= 1
                        proxy.failed += 1
                if fail:
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOW_DOWN)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(SLOW_DOWN)
                    return
                # 30 s: far beyond any answer of a loopback server; a test never waits on it.
                upstream = http.client.HTTPConnection("127.0.0.1", proxy.target_port, timeout=30)
                try:
                    upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                    for name, value in self.headers.items():
                        if name.lower() not in HOP_HEADERS:
                            upstream.putheader(name, value)
                    upstream.endheaders(body or None)
                    answer = upstream.getresponse()
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
                        self.wfile.write(data)
                finally:
                    upstream.close()

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def fail_next(self, n: int) -> None:
        with self.lock:
            self.to_fail = n

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stopped = True
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(10)
