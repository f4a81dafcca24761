"""``meshscope agent`` and ``meshscope ingest``.

    meshscope agent --store DIR [--port 9477] [--host 127.0.0.1] [--poll-interval 1] [--once]
                    [--tls-cert PEM --tls-key PEM] [--basic-auth-file FILE]
                    [--no-pack] [--upload s3://BUCKET/PREFIX [--keep-local S]]
                    [--otlp-endpoint URL [--otlp-interval S]]
    meshscope ingest --store DIR

Bad input (missing or unwritable store, bad port, unparsable numbers, unusable TLS or basic-auth files)
gives one error line naming the value and exit status 2. The agent binds 127.0.0.1 unless told
otherwise. With ``--tls-cert/--tls-key`` /metrics is served over HTTPS only; with ``--basic-auth-file``
every request needs HTTP basic auth (file format: ``agent.security``; make a hash with
``python -m meshscope.agent.security hash-password``). Basic auth without TLS sends the password in clear text:
the agent warns.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import ssl
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from meshscope.agent.cliargs import ArgParser, UsageError
from meshscope.agent.collector.agent import Agent, AgentConfig
from meshscope.agent.collector.catchup import lock_store
from meshscope.agent.collector.gpu import load_nvml
from meshscope.agent.collector.ingest import IngestConfig
from meshscope.agent.collector.otlp import INTERVAL_S as OTLP_INTERVAL_S, OtlpConfig
from meshscope.agent.collector.server import WebConfig, serve_metrics
from meshscope.agent.collector.upload import UploadConfig
from meshscope.agent.contract import AnchoredClock
from meshscope.agent.contract.storelayout import StoreLayout
from meshscope.agent.security import Credentials


LOCK_WAIT_S = 10.0  # longer than a reader's catch-up of a tour-sized store


def _build_parser(prog: str, *, agent: bool) -> argparse.ArgumentParser:
    p = ArgParser(prog=prog, description="Follow rank spools under a store, serve /metrics, write the run store."
                if agent else "Ingest every spool under a store once into the run store, then exit.")
    p.add_argument("--store", required=True, type=Path, help="the run store directory (must exist)")
    if agent:
        p.add_argument("--port", type=int, default=9477, help="HTTP port for /metrics (0: any free port)")
        p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
        p.add_argument("--poll-interval", type=float, default=1.0, metavar="S", help="seconds between polls")
        p.add_argument("--once", action="store_true", help="ingest what is there, write the store, exit")
        p.add_argument("--run-ttl", type=float, default=600.0, metavar="S",
                       help="drop a run's series this long after its last record")
        p.add_argument("--gpu-interval", type=float, default=5.0, metavar="S",
                       help="seconds between NVML samples (0: no GPU sampling)")
        p.add_argument("--part-age", type=float, default=30.0, metavar="S",
                       help="write buffered records to the store at least this often")
        p.add_argument("--part-bytes", type=int, default=IngestConfig().part_target_bytes, metavar="N",
                       help="spool bytes per Parquet part")
        p.add_argument("--no-pack", action="store_true",
                       help="keep one part file per rank instead of merging a run's final parts into one pack per "
                            "kind (agent/store/packs.py)")
        p.add_argument("--upload", default=None, metavar="s3://BUCKET/PREFIX",
                       help="also upload every sealed part to this S3-compatible bucket, exactly once (endpoint and "
                            "credentials: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, ~/.aws)")
        p.add_argument("--keep-local", type=float, default=UploadConfig(url="s3://bucket").keep_local_s, metavar="S",
                       help="with --upload: keep parts on local disk this long after the bucket acknowledged them")
        p.add_argument("--tls-cert", type=Path, default=None, metavar="PEM",
                       help="serve /metrics over HTTPS with this certificate (chain); needs --tls-key")
        p.add_argument("--tls-key", type=Path, default=None, metavar="PEM", help="the certificate's private key")
        p.add_argument("--basic-auth-file", type=Path, default=None, metavar="FILE",
                       help="require HTTP basic auth: user:hash lines ($pbkdf2-sha256$ or bcrypt)")
        p.add_argument("--otlp-endpoint", default=None, metavar="URL",
                       help="also push the metrics over OTLP/HTTP (protobuf) to this http(s) URL; without a path "
                            "/v1/metrics is appended. Headers (e.g. auth) from OTEL_EXPORTER_OTLP_HEADERS, TLS and "
                            "timeout from the other standard OTEL_EXPORTER_OTLP_* variables")
        p.add_argument("--otlp-interval", type=float, default=None, metavar="S",
                       help=f"with --otlp-endpoint: seconds between pushes (default {OTLP_INTERVAL_S:g})")
    return p


def _check_store(store: Path, *, create: bool) -> None:
    if str(store).startswith(("s3:/", "http:/", "https:/")):  # Path() made "s3://b" into "s3:/b"
        raise UsageError(f"--store {str(store)!r} is a URL: the agent writes a local store directory; give the "
                         "bucket as --upload s3://BUCKET/PREFIX")
    if not store.exists() and not create:
        raise UsageError(f"store directory {str(store)!r} does not exist")
    if not store.exists():  # the live flow starts the agent before the job that fills its store
        try:
            store.mkdir(parents=True)
        except OSError as exc:
            raise UsageError(f"cannot create store directory {str(store)!r} ({exc.strerror or exc})") from None
    if not store.is_dir():
        raise UsageError(f"store {str(store)!r} is not a directory")
    try:  # a real write: as root os.access() says yes even on a read-only mount
        agent_dir = Path(StoreLayout.of(store).agent)
        agent_dir.mkdir(exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=agent_dir, prefix=".probe-"):
            pass
    except OSError as exc:
        raise UsageError(f"store directory {str(store)!r} is not writable ({exc.strerror or exc})") from None


def _lock_store(store: Path) -> int:
    """One writer per store: a second one would race the first on parts and offsets. A dashboard or
    ``report`` that is catching the store up holds the lock for a moment: wait for it a little."""
    fd = lock_store(store, wait_s=LOCK_WAIT_S)
    if fd is None:
        raise UsageError(f"another meshscope agent or ingest is already writing store {str(store)!r}")
    return fd


def _config(args: argparse.Namespace, *, agent: bool) -> AgentConfig:
    if not agent:
        return AgentConfig(store=args.store, gpu_interval_s=0)
    try:
        return AgentConfig(
            store=args.store, host=args.host, port=args.port, poll_interval_s=args.poll_interval,
            gpu_interval_s=args.gpu_interval, run_ttl_s=args.run_ttl,
            ingest=IngestConfig(max_part_age_s=args.part_age, part_target_bytes=args.part_bytes,
                                pack=not args.no_pack),
            upload=UploadConfig(url=args.upload, keep_local_s=args.keep_local) if args.upload else None,
            otlp=_otlp(args),
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _otlp(args: argparse.Namespace) -> OtlpConfig | None:
    if args.otlp_endpoint is None:
        if args.otlp_interval is not None:  # an option that would be silently ignored
            raise UsageError(f"--otlp-interval {args.otlp_interval:g} needs --otlp-endpoint")
        return None
    interval = OTLP_INTERVAL_S if args.otlp_interval is None else args.otlp_interval
    return OtlpConfig(endpoint=args.otlp_endpoint, interval_s=interval)


def _main(argv: list[str] | None, *, prog: str, agent: bool) -> int:
    try:
        args = _build_parser(prog, agent=agent).parse_args(argv)
        config = _config(args, agent=agent)
        web = _web(args) if agent and not args.once else None
        _check_store(args.store, create=agent)
        lock_fd = _lock_store(args.store)
    except UsageError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    try:
        return _run(args, config, prog=prog, once=not agent or args.once, web=web)
    finally:
        os.close(lock_fd)


@dataclass(slots=True)
class _Web:
    """The endpoint's security, loaded before anything binds so that a bad file is a usage error."""

    config: WebConfig
    ssl_context: ssl.SSLContext | None
    credentials: Credentials | None


def _web(args: argparse.Namespace) -> _Web:
    try:
        web = WebConfig(tls_cert=args.tls_cert, tls_key=args.tls_key, basic_auth_file=args.basic_auth_file)
        return _Web(web, web.ssl_context(), web.credentials())
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _run(args: argparse.Namespace, config: AgentConfig, *, prog: str, once: bool, web: _Web | None) -> int:
    nvml = None
    if config.gpu_interval_s > 0:
        nvml, reason = load_nvml()
        if nvml is None:
            print(f"{prog}: no GPU sampling: {reason}", file=sys.stderr)
    app = Agent(config, clock=AnchoredClock(), nvml=nvml)
    if app.ingestor.load_error:
        print(f"{prog}: warning: offsets file unreadable, recovering from parts: {app.ingestor.load_error}",
              file=sys.stderr)
    try:
        if once:
            app.run_once()
            print(f"{prog}: ingested {sum(app.state.ingested.values())} records into {args.store}", flush=True)
            return 0
        if web.credentials is not None and web.ssl_context is None:
            print(f"{prog}: warning: basic auth without TLS sends passwords in clear text (add --tls-cert/--tls-key)",
                  file=sys.stderr)
        if web.credentials is None and not _loopback(config.host):
            print(f"{prog}: warning: /metrics on {config.host} is open to the network without authentication "
                  "(add --basic-auth-file and --tls-cert/--tls-key)", file=sys.stderr)
        try:
            app.server = serve_metrics(app.registry, host=config.host, port=config.port, web=web.config,
                                       ssl_context=web.ssl_context, credentials=web.credentials)
        except OSError as exc:
            print(f"{prog}: error: cannot listen on {config.host}:{config.port}: {exc.strerror or exc}",
                  file=sys.stderr)
            return 2
        print(f"{prog}: serving {app.server.scheme}://{config.host}:{app.server.port}/metrics, store {args.store}",
              flush=True)
        if config.otlp is not None:
            print(f"{prog}: pushing OTLP to {config.otlp.url} every {config.otlp.interval_s:g} s", flush=True)
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        app.run(stop)
        return 0
    finally:
        app.close()


def agent_main(argv: list[str] | None = None) -> int:
    return _main(argv, prog="meshscope agent", agent=True)


def ingest_main(argv: list[str] | None = None) -> int:
    return _main(argv, prog="meshscope ingest", agent=False)


if __name__ == "__main__":
    sys.exit(agent_main())
