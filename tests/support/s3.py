"""A real S3 endpoint on loopback for tests and benchmarks: moto's server mode, and a TCP proxy in front
of it that can be taken down and brought back (an endpoint outage without losing the bucket, which a
restarted moto would: it keeps objects in memory)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from tests.support.harness import poll_until, terminate
from tests.support.harness import free_port  # noqa: E402,F401


@dataclass
class Moto:
    proc: subprocess.Popen
    endpoint: str

    def client(self, service: str = "s3", **kw):
        import boto3  # moto's own dependency; only tests use it (to make buckets and users)

        return boto3.client(service, endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=kw.pop("key", "testing"),
                            aws_secret_access_key=kw.pop("secret", "testing"), **kw)

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def add_user(self, name: str) -> tuple[str, str]:
        """An IAM user allowed s3:* and its access key (for a server started with ``auth=True``)."""
        iam = self.client("iam")
        iam.create_user(UserName=name)
        iam.put_user_policy(UserName=name, PolicyName="s3", PolicyDocument=json.dumps({
            "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
        key = iam.create_access_key(UserName=name)["AccessKey"]
        return key["AccessKeyId"], key["SecretAccessKey"]


@contextmanager
def moto_server(*, auth_free_requests: int | None = None) -> Iterator[Moto]:
    """``python -m moto.server`` on 127.0.0.1. ``auth_free_requests``: only that many requests go
    unauthenticated (to create a user, its policy, its key and a bucket); later ones need real keys."""
    port = free_port()
    env = dict(os.environ)
    if auth_free_requests is not None:
        env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(auth_free_requests)
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        poll_until(lambda: _accepts(port) or proc.poll() is not None, timeout_s=60, interval_s=0.1,
                   what="moto server listens")
        if proc.poll() is not None:
            raise RuntimeError(f"moto server exited ({proc.returncode})")
        yield Moto(proc, endpoint)
    finally:
        terminate(proc)


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


class Proxy:
    """TCP forwarding from a loopback port to ``target``; ``down()`` closes the listener and every open
    connection (clients get connection refused), ``up()`` listens on the same port again."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = free_port()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self.up()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def up(self) -> None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(64)
        self._listener = s
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def down(self) -> None:
        with self._lock:
            s, self._listener = self._listener, None
            conns, self._conns = self._conns, set()
        if s is not None:
            # shutdown first: close() alone does not wake the thread blocked in accept(), and the socket
            # would keep listening (and accepting) until a connection arrives.
            _close(s)
        for c in conns:
            _close(c)

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed by down()
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _close(client)
                continue
            with self._lock:
                # A connection accepted just before down() must not outlive it (CI saw one upload land
                # through such a connection during an "outage").
                alive = self._listener is listener
                if alive:
                    self._conns.update((client, upstream))
            if not alive:
                _close(client), _close(upstream)
                return
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                _close(s)
                with self._lock:
                    self._conns.discard(s)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()


def s3_env(endpoint: str, *, key: str = "testing", secret: str = "testing") -> dict[str, str]:
    """What the agent and the readers need to reach the endpoint (the AWS SDKs' variables)."""
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}

