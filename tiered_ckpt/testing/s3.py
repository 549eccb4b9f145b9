"""A real S3 endpoint for tests: moto's server over HTTP on a free loopback port, and a fault-injecting proxy.

Fixtures (registered by ``tiered_ckpt.testing.pytest_plugin``):

* ``s3_server`` (session): moto's S3 server in a subprocess on ``127.0.0.1`` and a port the OS picked, up
  until the session ends. Yields an :class:`S3Server`: ``endpoint``, ``access_key``, ``secret_key``,
  ``region``, ``env()`` (the AWS_* variables for it), ``storage_options()`` (for an ``fsspec`` tier),
  ``client()`` (plain boto3). Nothing has to be started by hand; the test is skipped when moto is not
  installed.
* ``s3_bucket``: a fresh, uniquely named bucket on ``s3_server``, emptied and removed after the test.
* ``s3_fault_proxy``: an :class:`S3FaultProxy` in front of ``s3_server`` for one test. Point the tier at
  ``proxy.endpoint`` (or ``proxy.storage_options()``) and inject faults while the test runs::

      proxy.inject("slowdown", op="UploadPart", nth=2)            # the 2nd part upload gets 503 SlowDown
      proxy.inject("internal_error", op="PutObject", path=r"manifest", times=2)
      proxy.inject("reset", op="GetObject", probability=0.3, seed=1)  # forwarded, then the answer is cut
      proxy.inject("stall", op="UploadPart", delay_s=5)            # held longer than the client's timeout
      proxy.requests                                               # what went through: op, times, status
      proxy.max_in_flight("UploadPart")                            # how many overlapped at most

This module imports only the standard library and pytest; moto and boto3 are imported where used (moto only
in the server's subprocess). The server itself (:class:`S3Server`, :func:`start_s3_server`) is in
:mod:`tiered_ckpt.testing.s3_server`; this module holds the fault proxy and the fixtures, and re-exports both.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import random
import re
import socket
import struct
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from .s3_server import LOOPBACK, S3Server, start_s3_server

# ----- the fault proxy -------------------------------------------------------------------------------------
FAULT_KINDS = ("slowdown", "internal_error", "access_denied", "reset", "stall", "trickle", "bad_gateway",
               "gateway_timeout", "too_many_requests")
# What a load balancer or gateway in front of the store answers: HTML, no S3 error code
_HTML_ANSWERS = {
    "bad_gateway": (502, "Bad Gateway"),
    "gateway_timeout": (504, "Gateway Timeout"),
    "too_many_requests": (429, "Too Many Requests"),
}
_ERROR_ANSWERS = {
    "slowdown": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
    "access_denied": (403, "Forbidden", "AccessDenied", "Access Denied"),  # a policy without the permission
    "internal_error": (500, "Internal Server Error", "InternalError",
                       "We encountered an internal error. Please try again."),
}
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
               "transfer-encoding", "upgrade", "expect", "content-length"}


def s3_operation(method: str, path: str, query: dict[str, list[str]], headers: Any = None) -> str:
    """The S3 API operation of a path-style request (``UploadPart``, ``GetObject``, ``ListObjectsV2``...)."""
    method = method.upper()
    bucket_key = path.lstrip("/").split("/", 1)
    has_key = len(bucket_key) == 2 and bucket_key[1] != ""
    if "uploads" in query:
        return "CreateMultipartUpload" if method == "POST" else "ListMultipartUploads"
    if "uploadId" in query:
        return {"PUT": "UploadPart", "POST": "CompleteMultipartUpload", "DELETE": "AbortMultipartUpload",
                "GET": "ListParts"}.get(method, method)
    if method == "POST" and "delete" in query:
        return "DeleteObjects"
    if not has_key:
        if "location" in query:
            return "GetBucketLocation"
        return {"GET": "ListObjectsV2" if query.get("list-type") == ["2"] else "ListObjects",
                "HEAD": "HeadBucket", "PUT": "CreateBucket", "DELETE": "DeleteBucket"}.get(method, method)
    if method == "PUT" and headers is not None and headers.get("x-amz-copy-source"):
        return "CopyObject"
    return {"GET": "GetObject", "HEAD": "HeadObject", "PUT": "PutObject", "DELETE": "DeleteObject"}.get(method,
                                                                                                      method)


@dataclass
class Fault:
    """A rule: which requests fail, and how. Matching requests are counted; see :meth:`S3FaultProxy.inject`."""

    kind: str
    op: str | None = None
    method: str | None = None
    path: str | None = None
    query: str | None = None
    nth: int = 1
    times: int | None = 1
    probability: float | None = None
    delay_s: float = 0.0
    forward: bool = True
    seed: int = 0
    seen: int = 0  # matching requests so far
    hits: int = 0  # of them, how many this rule failed
    _rng: random.Random = field(default_factory=random.Random, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind {self.kind!r}: expected one of {', '.join(FAULT_KINDS)}")
        if self.nth < 1 or (self.times is not None and self.times < 0):
            raise ValueError("nth must be >= 1 and times >= 0 (or None for every matching request)")
        if self.probability is not None and not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"probability must be within [0, 1], got {self.probability}")
        self._rng.seed(self.seed)

    def matches(self, record: RequestRecord) -> bool:
        return ((self.op is None or self.op == record.op)
                and (self.method is None or self.method.upper() == record.method)
                and (self.path is None or re.search(self.path, record.path) is not None)
                and (self.query is None or re.search(self.query, record.query) is not None))

    def fires(self) -> bool:
        """Count one matching request; True if this one fails."""
        self.seen += 1
        if self.probability is not None:
            fire = (self.times is None or self.hits < self.times) and self._rng.random() < self.probability
        else:
            fire = self.seen >= self.nth and (self.times is None or self.seen < self.nth + self.times)
        self.hits += fire
        return fire


@dataclass
class RequestRecord:
    """One request that went through the proxy."""

    method: str
    path: str
    query: str
    op: str
    start: float  # time.monotonic()
    end: float | None = None
    status: int | None = None  # what the client was sent (None: nothing, the connection was cut)
    fault: str | None = None
    bytes_in: int = 0
    bytes_out: int = 0
    range: str | None = None
    part_number: int | None = None
    payload_hash: str | None = None  # x-amz-content-sha256: UNSIGNED-PAYLOAD, or the signed body's SHA-256
    checksum_crc32: str | None = None  # x-amz-checksum-crc32, when the request carries one


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _ProxyServer

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self._handle()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _handle(self) -> None:
        proxy = self.server.proxy
        url = urlsplit(self.path)
        query = parse_qs(url.query, keep_blank_values=True)
        body = self._read_body()
        part = query.get("partNumber", [None])[0]
        record = RequestRecord(self.command, url.path, url.query, s3_operation(self.command, url.path, query,
                                                                               self.headers),
                               time.monotonic(), bytes_in=len(body), range=self.headers.get("Range"),
                               part_number=int(part) if part and part.isdigit() else None,
                               payload_hash=self.headers.get("x-amz-content-sha256"),
                               checksum_crc32=self.headers.get("x-amz-checksum-crc32"))
        fault = proxy._begin(record)
        try:
            if fault is not None and (fault.kind in _ERROR_ANSWERS or fault.kind in _HTML_ANSWERS):
                self._send_error_answer(record, fault.kind)
                return
            answer = proxy._forward(self.command, self.path, self.headers, body) \
                if fault is None or fault.forward else None
            if fault is None:
                self._send(record, *answer)
            elif fault.kind == "reset":
                self._reset(record, answer)
            elif fault.kind == "trickle":
                self._trickle(record, answer, fault.delay_s)
            elif fault.kind == "stall":
                proxy._closing.wait(fault.delay_s)
                self.close_connection = True
                if answer is not None:
                    self._send(record, *answer)
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, TimeoutError, ValueError, OSError):
            self.close_connection = True
        finally:
            record.end = time.monotonic()

    def _raw_answer(self, status: int, reason: str, headers: list[tuple[str, str]], data: bytes) -> bytes:
        lines = [f"HTTP/1.1 {status} {reason}"]
        length = None
        for name, value in headers:
            if name.lower() == "content-length":
                length = value
            elif name.lower() not in _HOP_BY_HOP:
                lines.append(f"{name}: {value}")
        if self.command == "HEAD":
            lines.append(f"Content-Length: {length or 0}")
            data = b""
        else:
            lines.append(f"Content-Length: {len(data)}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + data

    def _send(self, record: RequestRecord, status: int, reason: str, headers: list[tuple[str, str]],
              data: bytes) -> None:
        raw = self._raw_answer(status, reason, headers, data)
        record.status, record.bytes_out = status, len(data)
        self.wfile.write(raw)
        self.wfile.flush()

    def _send_error_answer(self, record: RequestRecord, kind: str) -> None:
        if kind in _HTML_ANSWERS:
            status, reason = _HTML_ANSWERS[kind]
            html = f"<html><body><h1>{status} {reason}</h1></body></html>".encode()
            self._send(record, status, reason, [("Content-Type", "text/html")], html)
            return
        status, reason, code, message = _ERROR_ANSWERS[kind]
        request_id = uuid.uuid4().hex[:16].upper()
        xml = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
               f"<Resource>{record.path}</Resource><RequestId>{request_id}</RequestId></Error>").encode()
        self._send(record, status, reason, [("Content-Type", "application/xml"), ("x-amz-request-id", request_id)],
                   xml)

    def _trickle(self, record: RequestRecord, answer: tuple | None, pause_s: float) -> None:
        """Send the answer one byte at a time, ``pause_s`` between bytes (each shorter than the client's read
        timeout, the whole longer than any ceiling), then close: until the proxy stops."""
        self.close_connection = True
        if answer is None:
            return
        raw = self._raw_answer(*answer)
        record.status = answer[0]
        for i in range(len(raw)):
            if self.server.proxy._closing.wait(pause_s):
                return
            self.wfile.write(raw[i:i + 1])
            self.wfile.flush()
        record.bytes_out = len(answer[3])

    def _reset(self, record: RequestRecord, answer: tuple | None) -> None:
        """Send half of the answer (or nothing), then reset the connection (RST, not FIN)."""
        if answer is not None:
            raw = self._raw_answer(*answer)
            self.wfile.write(raw[:max(1, len(raw) // 2)])
            self.wfile.flush()
        self.close_connection = True
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.rfile.close()
        self.wfile.close()
        self.connection.close()  # with linger 0 and no other references: the kernel sends RST
        self.rfile, self.wfile = io.BytesIO(), io.BytesIO()  # for the base class's final flush and close


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    proxy: S3FaultProxy


class S3FaultProxy:
    """A loopback HTTP proxy in front of an S3 endpoint that fails chosen requests on purpose.

    Fault kinds: ``slowdown`` (503 with S3's ``SlowDown`` XML error), ``internal_error`` (500
    ``InternalError``), ``access_denied`` (403), ``bad_gateway`` / ``gateway_timeout`` / ``too_many_requests``
    (502 / 504 / 429 as HTML, a gateway's answers), ``reset`` (the request reaches the server, then the answer is
    cut halfway and the connection reset: the client cannot know whether it landed; ``forward=False`` cuts it
    before), ``stall``
    (the request reaches the server, the answer is held ``delay_s`` seconds: longer than the client's read
    timeout, it sees a timeout; ``forward=False`` never forwards it), ``trickle`` (the answer sent one byte every
    ``delay_s`` seconds: each byte within the client's read timeout, the whole far beyond it).
    """

    def __init__(self, upstream: str, host: str = LOOPBACK, server: S3Server | None = None):
        url = urlsplit(upstream)
        self.server = server
        self.upstream_host, self.upstream_port = url.hostname or LOOPBACK, url.port or 80
        self.requests: list[RequestRecord] = []
        self.faults: list[Fault] = []
        self._lock = threading.Lock()
        self._local = threading.local()
        self._closing = threading.Event()
        self._server = _ProxyServer((host, 0), _Handler)
        self._server.proxy = self
        self.endpoint = f"http://{host}:{self._server.server_address[1]}"
        self._thread: threading.Thread | None = None

    def storage_options(self) -> dict[str, Any]:
        """Storage options for an ``fsspec`` tier that goes through this proxy (needs ``server``)."""
        if self.server is None:
            raise ValueError("this proxy was made without its S3Server: pass storage options yourself")
        return self.server.storage_options(self.endpoint)

    # ----- lifecycle ---------------------------------------------------------------------------------------
    def start(self) -> S3FaultProxy:
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="s3-fault-proxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._closing.set()
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> S3FaultProxy:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ----- configuration (from the test, at any time) ------------------------------------------------------
    def inject(self, kind: str, *, op: str | None = None, method: str | None = None, path: str | None = None,
               query: str | None = None, nth: int = 1, times: int | None = 1, probability: float | None = None,
               delay_s: float = 0.0, forward: bool = True, seed: int = 0) -> Fault:
        """Fail requests matching every given filter (``op``: S3 operation name, ``method``, ``path`` and
        ``query``: regular expressions searched in the URL path / raw query string).

        Without ``probability``: matching requests ``nth`` to ``nth + times - 1`` fail (``times=None``: every
        one from ``nth`` on). With it: each matching request fails with that probability (seeded), at most
        ``times`` times. The first rule that fires decides. Returns the rule (``seen``, ``hits``).
        """
        fault = Fault(kind, op=op, method=method, path=path, query=query, nth=nth, times=times,
                      probability=probability, delay_s=delay_s, forward=forward, seed=seed)
        with self._lock:
            self.faults.append(fault)
        return fault

    def clear(self) -> None:
        """Remove every fault rule (the request log stays)."""
        with self._lock:
            self.faults.clear()

    def reset_log(self) -> None:
        with self._lock:
            self.requests.clear()

    # ----- what happened -----------------------------------------------------------------------------------
    def ops(self, op: str | None = None, **match: Any) -> list[RequestRecord]:
        """Records of operation ``op`` (all if None) whose attributes equal ``match`` (e.g. ``fault="reset"``)."""
        with self._lock:
            records = list(self.requests)
        return [r for r in records if (op is None or r.op == op)
                and all(getattr(r, k) == v for k, v in match.items())]

    def count(self, op: str | None = None, **match: Any) -> int:
        return len(self.ops(op, **match))

    def max_in_flight(self, op: str | None = None) -> int:
        """The most requests of ``op`` that were in the proxy at the same time."""
        events = []
        for r in self.ops(op):
            events += [(r.start, 1), (r.end if r.end is not None else float("inf"), -1)]
        peak = cur = 0
        for _, delta in sorted(events, key=lambda e: (e[0], e[1])):
            cur += delta
            peak = max(peak, cur)
        return peak

    def summary(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.ops():
            out[r.op] = out.get(r.op, 0) + 1
        return out

    # ----- the handler's side ------------------------------------------------------------------------------
    def _begin(self, record: RequestRecord) -> Fault | None:
        with self._lock:
            self.requests.append(record)
            for fault in self.faults:
                if fault.matches(record) and fault.fires():
                    record.fault = fault.kind
                    return fault
        return None

    def _forward(self, method: str, target: str, headers: Any, body: bytes
                 ) -> tuple[int, str, list[tuple[str, str]], bytes]:
        out_headers = {k: v for k, v in headers.items() if k.lower() not in _HOP_BY_HOP}
        out_headers["Content-Length"] = str(len(body))
        for attempt in (1, 2):
            conn = getattr(self._local, "conn", None)
            if conn is None:
                conn = self._local.conn = http.client.HTTPConnection(self.upstream_host, self.upstream_port,
                                                                     timeout=300)
            try:
                conn.request(method, target, body=body, headers=out_headers)
                resp = conn.getresponse()
                data = resp.read()
                return resp.status, resp.reason, resp.getheaders(), data
            except (http.client.HTTPException, OSError):
                conn.close()
                self._local.conn = None
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")


# ----- fixtures --------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """moto's S3 server over real HTTP on 127.0.0.1 and a free port, for the whole session."""
    pytest.importorskip("moto.server", reason="moto[server] is needed for the S3 tests")
    pytest.importorskip("s3fs", reason="s3fs is needed for the S3 tests")
    server = start_s3_server()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> Iterator[str]:
    """A new, uniquely named bucket; emptied and deleted after the test."""
    name = s3_server.create_bucket()
    yield name
    with contextlib.suppress(Exception):
        s3_server.remove_bucket(name)


@pytest.fixture
def s3_fault_proxy(s3_server: S3Server) -> Iterator[S3FaultProxy]:
    """A fault-injecting proxy in front of ``s3_server`` for one test (``.endpoint``, ``.inject(...)``)."""
    proxy = S3FaultProxy(s3_server.endpoint, server=s3_server).start()
    try:
        yield proxy
    finally:
        proxy.stop()


__all__ = ["FAULT_KINDS", "Fault", "RequestRecord", "S3FaultProxy", "S3Server", "s3_bucket", "s3_fault_proxy",
           "s3_operation", "s3_server", "start_s3_server"]
