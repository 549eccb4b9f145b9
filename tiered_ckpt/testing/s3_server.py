"""moto's S3 server for tests, over HTTP on a free loopback port: :func:`start_s3_server` starts it in a
subprocess and returns an :class:`S3Server` (endpoint, credentials, ``env()``, ``storage_options()``,
``client()``). The fault proxy in front of it and the pytest fixtures are in :mod:`tiered_ckpt.testing.s3`
(which re-exports these names). Standard library only; moto runs in the subprocess, boto3 is imported where used.
"""

from __future__ import annotations

import contextlib
import http.client
import secrets
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

LOOPBACK = "127.0.0.1"

# ----- the server ------------------------------------------------------------------------------------------
# Run in a subprocess: moto's server gets its own interpreter (and GIL), and dies with its stdin.
_SERVER_SCRIPT = r"""
import logging, sys
logging.getLogger("werkzeug").setLevel(logging.ERROR)
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address=sys.argv[1], port=0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
sys.stdin.read()  # until the parent closes our stdin or exits
server.stop()
"""


@dataclass
class S3Server:
    """A running S3 endpoint and the (fake) credentials it accepts."""

    endpoint: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"
    process: subprocess.Popen | None = field(default=None, repr=False)
    _clients: dict[str, Any] = field(default_factory=dict, repr=False)

    def env(self) -> dict[str, str]:
        """The AWS_* environment variables that point boto3/s3fs (and the ``tiered-ckpt`` CLI) here."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_DEFAULT_REGION": self.region, "AWS_ENDPOINT_URL_S3": self.endpoint}

    def storage_options(self, endpoint: str | None = None) -> dict[str, Any]:
        """Storage options for an ``fsspec`` tier on ``s3://`` (``endpoint``: e.g. a proxy in front)."""
        return {"endpoint_url": endpoint or self.endpoint, "key": self.access_key, "secret": self.secret_key,
                "client_kwargs": {"region_name": self.region}}

    def client(self, endpoint: str | None = None) -> Any:
        """A plain boto3 S3 client (not our code) for this server (or ``endpoint``); cached, thread-safe."""
        endpoint = endpoint or self.endpoint
        client = self._clients.get(endpoint)
        if client is None:
            import boto3

            client = self._clients[endpoint] = boto3.client(
                "s3", endpoint_url=endpoint, aws_access_key_id=self.access_key,
                aws_secret_access_key=self.secret_key, region_name=self.region)
        return client

    def create_bucket(self, name: str | None = None) -> str:
        name = name or f"tc-{uuid.uuid4().hex[:20]}"
        self.client().create_bucket(Bucket=name)
        return name

    def remove_bucket(self, name: str) -> None:
        """Abort unfinished uploads, delete every object, delete the bucket (moto holds it all in memory)."""
        client = self.client()
        for up in client.list_multipart_uploads(Bucket=name).get("Uploads", []):
            client.abort_multipart_upload(Bucket=name, Key=up["Key"], UploadId=up["UploadId"])
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=name, Delete={"Objects": keys})
        client.delete_bucket(Bucket=name)

    def stop(self) -> None:
        proc, self.process = self.process, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _answers(host: str, port: int) -> bool:
    try:
        conn = http.client.HTTPConnection(host, port, timeout=2)
        conn.request("GET", "/")
        conn.getresponse().read()
        conn.close()
        return True
    except OSError:
        return False


def start_s3_server(host: str = LOOPBACK, timeout_s: float = 60.0) -> S3Server:
    """Start moto's S3 server in a subprocess on a port the OS picks; return once it answers HTTP."""
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-c", _SERVER_SCRIPT, host],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
    server = S3Server("", f"tiered-ckpt-test-key-{secrets.token_hex(6)}",
                      f"tiered-ckpt-test-secret-{secrets.token_hex(12)}", process=proc)
    try:
        line = proc.stdout.readline().decode().strip()  # the port, once bound
        if not line.isdigit():
            log.seek(0)
            raise RuntimeError(f"moto's S3 server did not start (exit code {proc.poll()}): "
                               f"{log.read().decode(errors='replace')[-2000:]}")
        port = int(line)
        deadline = time.monotonic() + timeout_s
        while not _answers(host, port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"moto's S3 server on {host}:{port} does not answer")
            time.sleep(0.05)
        server.endpoint = f"http://{host}:{port}"
        return server
    except BaseException:
        server.stop()
        raise
    finally:
        log.close()
