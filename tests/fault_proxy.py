"""A fault-injecting HTTP proxy for tests: a real TCP server on 127.0.0.1 in front of an HTTP
server (moto's ThreadedMotoServer), which a test programs to lose, cut or reset the answer to
chosen requests. Threads and the standard library only.

A client (s3fs, with ``endpoint_url=proxy.url``) talks HTTP/1.1 to the proxy; every request is
forwarded whole to the upstream server on a fresh connection and its answer is relayed back,
unless a :class:`Fault` matches it:

- ``"drop"``: the request is forwarded (it takes effect upstream) but the answer is lost: the
  client's connection is closed without a byte of it (a lost answer to a create, say);
- ``"truncate"``: the answer's headers are sent as they came, with ``keep`` bytes of the body,
  then the connection is closed (a body cut short by a dying connection);
- ``"short"``: as ``"truncate"``, but ``Content-Length`` is rewritten to ``keep``, so the
  client gets a complete, well-formed, short answer;
- ``"corrupt"``: the answer is relayed whole, with the body's byte at ``keep`` flipped (bytes
  garbled in transit: a client that checks the body's checksum notices);
- ``"reset"``: the connection is reset (TCP RST) without forwarding the request;
- ``"before"``: ``run()`` is called, then the request is relayed as usual (something another
  client does at exactly that moment: a bucket deleted just before a save's upload, say).

Faults apply to the ``nth`` matching request on, ``times`` times, and are then spent, so every
test is bounded: the client's retries reach the upstream server as usual.

    with FaultProxy("127.0.0.1", moto_port) as proxy:
        fault = proxy.add("drop", "PUT", r"/sentinel_checkpoint_complete\\.3$",
                          header=("If-None-Match", "*"))
        ...  # s3fs with endpoint_url=proxy.url
        assert fault.hits == 1
"""

from __future__ import annotations

import http.client
import re
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType

__all__ = ["ACTIONS", "Fault", "FaultProxy"]

ACTIONS = ("drop", "truncate", "short", "corrupt", "reset", "before")
# Seconds the proxy waits for the upstream server's answer, and for the client's next request
# on a kept-alive connection (both far beyond what moto needs on a loaded machine).
UPSTREAM_TIMEOUT = 120.0
CLIENT_TIMEOUT = 120.0
# Headers that describe one connection, not the message: never relayed.
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te"}


@dataclass
class Fault:
    """One programmed fault: ``action`` on the matching requests ``nth, nth+1, ...`` (``times``
    of them). ``path`` is a regex searched in the request's path (query string included);
    ``header`` a ``(name, value)`` the request must carry."""

    action: str
    method: str
    path: str
    header: tuple[str, str] | None = None
    nth: int = 1
    times: int = 1
    keep: int = 0
    run: Callable[[], object] | None = None  # the "before" action's call
    seen: int = 0  # matching requests so far
    hits: int = 0  # faults applied so far
    log: list[str] = field(default_factory=list)  # "METHOD path" of each request hit

    def matches(self, method: str, path: str, headers: http.client.HTTPMessage) -> bool:
        if method != self.method or re.search(self.path, path) is None:
            return False
        return self.header is None or headers.get(self.header[0]) == self.header[1]


class FaultProxy:
    """The proxy (see the module docstring); a context manager that starts and stops it."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self._faults: list[Fault] = []
        self._lock = threading.Lock()
        self.requests: list[str] = []  # "METHOD path" of every request, in order
        proxy = self

        class Handler(_Handler):
            owner = proxy

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=UPSTREAM_TIMEOUT)

    def add(
        self,
        action: str,
        method: str,
        path: str,
        *,
        header: tuple[str, str] | None = None,
        nth: int = 1,
        times: int = 1,
        keep: int = 0,
        run: Callable[[], object] | None = None,
    ) -> Fault:
        """Program a fault (see :class:`Fault`); returns it, to read its ``hits`` later."""
        if action not in ACTIONS:
            raise ValueError(f"unknown fault {action!r}; one of {ACTIONS}")
        if (action == "before") != (run is not None):
            raise ValueError('"before", and only it, takes run=')
        fault = Fault(action, method, path, header, nth, times, keep, run)
        with self._lock:
            self._faults.append(fault)
        return fault

    def clear(self) -> None:
        """Forget every programmed fault."""
        with self._lock:
            self._faults.clear()

    def _fault_for(self, method: str, path: str, headers: http.client.HTTPMessage) -> Fault | None:
        """The fault to apply to this request (None: relay it), counting it against each."""
        with self._lock:
            self.requests.append(f"{method} {path}")
            for fault in self._faults:
                if not fault.matches(method, path, headers):
                    continue
                fault.seen += 1
                if fault.seen >= fault.nth and fault.hits < fault.times:
                    fault.hits += 1
                    fault.log.append(f"{method} {path}")
                    return fault
        return None


class _Handler(BaseHTTPRequestHandler):
    """Relays one client connection's requests (HTTP/1.1, kept alive) to the upstream server."""

    owner: FaultProxy
    protocol_version = "HTTP/1.1"
    timeout = CLIENT_TIMEOUT

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: pytest shows what a failing test printed, not the proxy's access log."""

    def _body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _relay(self) -> None:
        method, path = self.command, self.path
        body = self._body()
        fault = self.owner._fault_for(method, path, self.headers)
        action = None if fault is None else fault.action
        if action == "reset":
            self._reset()
            return
        if action == "before" and fault is not None and fault.run is not None:
            fault.run()
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        headers["Content-Length"] = str(len(body))
        upstream = http.client.HTTPConnection(*self.owner.upstream, timeout=UPSTREAM_TIMEOUT)
        try:
            upstream.request(method, path, body=body, headers=headers)
            answer = upstream.getresponse()
            payload = answer.read()
            status, reason, answer_headers = answer.status, answer.reason, answer.getheaders()
        finally:
            upstream.close()
        if action == "drop":
            self._reset()
            return
        if action == "corrupt" and fault is not None and fault.keep < len(payload):
            payload = bytearray(payload)
            payload[fault.keep] ^= 0xFF
        keep = fault.keep if fault is not None and action in ("truncate", "short") else None
        self.send_response_only(status, reason)
        for name, value in answer_headers:
            if name.lower() in _HOP_BY_HOP:
                continue
            if name.lower() == "content-length" and method != "HEAD":
                continue
            self.send_header(name, value)
        if method != "HEAD":
            length = len(payload) if keep is None or action == "truncate" else keep
            self.send_header("Content-Length", str(length))
        if keep is not None:
            self.send_header("Connection", "close")
        self.end_headers()
        if method != "HEAD":
            self.wfile.write(payload if keep is None else payload[:keep])
        self.wfile.flush()
        if keep is not None:
            self.close_connection = True

    def _reset(self) -> None:
        """Close the client's connection with a TCP RST (SO_LINGER 0), answering nothing."""
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        self.connection.close()

    def __getattr__(self, name: str) -> object:
        if name.startswith("do_"):  # every method: GET, PUT, HEAD, POST, DELETE, ...
            return self._relay
        raise AttributeError(name)
