"""A misbehaving HTTP proxy in front of a loopback S3 (moto's server), for tests of remote outputs.

It forwards every request unchanged (method, path, headers, body: plain, chunked or aws-chunked, as
the client sent it) and streams the answer back on a kept-alive connection, except where a rule set
with `fail()` picks the request. Each fault models one thing a real object store does:

- "503": answer `503 SlowDown` with S3's XML error body and never forward: the store is throttling,
  nothing was written, a retry is expected to work.
- "drop_upload": read part of the request body, then close the socket without an answer: the
  network died mid-upload, the request never reached the store, so nothing was written.
- "drop_reply": forward the request, read the store's whole answer, then close the socket without
  sending it: the write happened but the client never heard, so a retried PUT meets its own object
  (this is where a retried create must be idempotent).
- "ignore_conditions": forward the request without its If-None-Match / If-Match: a store that
  does not honour conditional writes (some S3 compatibles), where a create overwrites.

    proxy = FaultyProxy("http://127.0.0.1:PORT").start()
    proxy.fail(method="PUT", match="shard-", times=2, how="503")   # the first 2 PUTs on shard-*
    proxy.fail(every=3, how="drop_reply")                           # every 3rd request, forever
    ...; proxy.seen["PUT"], proxy.fired["503"]; proxy.clear(); proxy.stop()
"""

from __future__ import annotations

import http.client
import re
import socket
import threading
import uuid
from collections import Counter, namedtuple
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

FAULTS = ("503", "drop_upload", "drop_reply", "ignore_conditions")
CONDITIONS = {"if-none-match", "if-match"}
# Hop-by-hop headers belong to one connection, not to the message: each side sets its own. A request's
# Transfer-Encoding is kept (its body goes on still chunked); its Expect was answered here already.
HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade"}
HOP_REQUEST = HOP - {"transfer-encoding"} | {"expect"}
PIECE = 64 * 1024
# One request the proxy saw: what it did with it ("forward" or the fault), its headers (lower-cased).
Seen = namedtuple("Seen", "method path how headers")


@dataclass
class Rule:
    """Fire `how` on requests whose method is `method` (None: any) and whose path (with its query)
    matches the regex `match` (None: any; a plain substring is a regex too): on every `every`-th
    such request, at most `times` times (None: forever)."""

    how: str
    method: str | None = None
    match: str | None = None
    times: int | None = None
    every: int = 1
    matched: int = 0
    fired: int = 0

    def picks(self, method: str, path: str) -> bool:
        if self.method not in (None, method) or (self.match and not re.search(self.match, path)):
            return False
        if self.times is not None and self.fired >= self.times:
            return False
        self.matched += 1
        if self.matched % self.every:
            return False
        self.fired += 1
        return True


class FaultyProxy:
    """The proxy: start() it, point clients at .url, add rules with fail() while it runs."""

    def __init__(self, upstream: str):
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port or 80)
        self.rules: list[Rule] = []
        self.seen: Counter = Counter()  # requests seen, by method, faulted or not
        self.fired: Counter = Counter()  # faults fired, by kind
        self.log: list[Seen] = []  # every request, in order
        self.lock = threading.Lock()
        self.server: ThreadingHTTPServer | None = None
        self.open: set[socket.socket] = set()  # client connections now held, kept alive or busy

    def fail(self, how: str, method: str | None = None, match: str | None = None,
             times: int | None = None, every: int = 1) -> Rule:
        if how not in FAULTS:
            raise ValueError(f"how must be one of {FAULTS}, not {how!r}")
        rule = Rule(how, method and method.upper(), match, times, every)
        with self.lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        """Drop every rule and zero the counters."""
        with self.lock:
            self.rules.clear()
            self.seen.clear()
            self.fired.clear()
            self.log.clear()

    def decide(self, method: str, path: str, headers: dict) -> str | None:
        """Count the request; the first rule that picks it names its fault (None: forward it)."""
        with self.lock:
            self.seen[method] += 1
            how = next((r.how for r in self.rules if r.picks(method, path)), None)
            if how:
                self.fired[how] += 1
            self.log.append(Seen(method, path, how or "forward", headers))
            return how

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FaultyProxy:
        handler = type("Handler", (_Handler,), {"proxy": self})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        # Clients keep connections alive: stop() must not wait for their threads.
        self.server.daemon_threads, self.server.block_on_close = True, False
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop listening and cut the kept-alive connections, which would go on being served."""
        self.server.shutdown()
        self.server.server_close()
        for sock in list(self.open):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # the client closed it already
                pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as botocore and aiohttp expect
    proxy: FaultyProxy

    def log_message(self, *args):  # quiet: the proxy's own log is proxy.log
        pass

    def setup(self):
        super().setup()
        self.proxy.open.add(self.connection)

    def finish(self):
        self.proxy.open.discard(self.connection)
        super().finish()

    def handle_one_request(self):
        # BaseHTTPRequestHandler dispatches on do_<METHOD>; one handler serves them all.
        self.raw_requestline = self.rfile.readline(65537)
        if not self.raw_requestline or not self.parse_request():
            self.close_connection = True
            return
        how = self.proxy.decide(self.command, self.path, {k.lower(): v for k, v in self.headers.items()})
        if how == "drop_upload":
            self.read_part()
            self.close_connection = True  # no answer; the socket closes when this returns
            return
        body = self.read_body()
        if how == "503":
            return self.slow_down()
        conn = http.client.HTTPConnection(*self.proxy.upstream, timeout=60)
        try:
            reply = self.forward(conn, body, drop=CONDITIONS if how == "ignore_conditions" else set())
            if how == "drop_reply":
                reply.read()  # the store has done the write; the client never hears of it
                self.close_connection = True
                return
            self.relay(reply)
        finally:
            conn.close()

    def chunked(self) -> bool:
        return "chunked" in self.headers.get("Transfer-Encoding", "").lower()

    def read_part(self) -> None:
        """Half of a sized body, or a chunked body's first chunk line: the upload has begun."""
        if self.chunked():
            self.rfile.readline()
        else:
            self.rfile.read(int(self.headers.get("Content-Length") or 0) // 2)

    def read_body(self) -> bytes:
        """The body exactly as sent: chunked bodies keep their chunk lines and trailers."""
        if not self.chunked():
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))
        raw = []
        while True:
            line = self.rfile.readline()
            raw.append(line)
            size = int(line.split(b";")[0], 16)
            if size == 0:
                break
            raw.append(self.rfile.read(size + 2))
        while True:  # trailers, up to the empty line
            line = self.rfile.readline()
            raw.append(line)
            if line in (b"\r\n", b"\n", b""):
                return b"".join(raw)

    def forward(self, conn: http.client.HTTPConnection, body: bytes, drop=frozenset()) -> http.client.HTTPResponse:
        conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
        for name, value in self.headers.items():
            if name.lower() not in HOP_REQUEST and name.lower() not in drop:
                conn.putheader(name, value)
        conn.endheaders(body or None)
        return conn.getresponse()

    def relay(self, reply: http.client.HTTPResponse) -> None:
        self.wfile.write(f"HTTP/1.1 {reply.status} {reply.reason}\r\n".encode("latin-1"))
        for name, value in reply.getheaders():
            if name.lower() not in HOP:
                self.wfile.write(f"{name}: {value}\r\n".encode("latin-1"))
        # http.client undoes chunking; re-chunk when no length says where the body ends (its length
        # is 0 for HEAD, 204 and 304, which have no body).
        chunked = reply.length is None
        if chunked:
            self.wfile.write(b"Transfer-Encoding: chunked\r\n")
        self.wfile.write(b"\r\n")
        while piece := reply.read(PIECE):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
        if chunked:
            self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def slow_down(self) -> None:
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
            "<Message>Please reduce your request rate.</Message>"
            f"<Resource>{self.path}</Resource><RequestId>{uuid.uuid4().hex}</RequestId></Error>"
        ).encode()
        self.send_response(503, "Slow Down")
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
