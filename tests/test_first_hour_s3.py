"""What users meet in their first hour with S3: credentials, buckets, a local server, and
saves that block the training loop."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import anyio
import pytest

import asyncstore
from asyncstore.stores import _s3client
from asyncstore.testing import FaultProxy, SeaweedFS

from .conftest import BUCKET, s3_options, unique

# -- credentials ---------------------------------------------------------------------------


@pytest.fixture
def no_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A process where the AWS chain finds no credentials at all."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    empty = tmp_path / "empty"
    empty.write_text("")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(empty))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(empty))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    # Sessions resolve the chain once; start from a fresh one.
    monkeypatch.setattr(_s3client, "_SESSIONS", {})


@pytest.mark.anyio
@pytest.mark.usefixtures("no_credentials")
async def test_missing_credentials_are_permission_denied(seaweedfs: SeaweedFS) -> None:
    prefix = unique()
    store = asyncstore.open_store(f"s3://{BUCKET}/{prefix}", endpoint_url=seaweedfs.endpoint_url)
    try:
        for call in (
            lambda: store.get("run/model.ckpt"),
            lambda: store.put("run/model.ckpt", b"x"),
        ):
            with pytest.raises(asyncstore.PermissionDenied) as caught:
                await call()
            message = str(caught.value)
            assert f"s3://{BUCKET}/{prefix}/run/model.ckpt" in message  # the object, not the prefix
            for where in ("aws_access_key_id", "AWS_ACCESS_KEY_ID", "AWS_SHARED_CREDENTIALS_FILE"):
                assert where in message
    finally:
        await store.aclose()


# -- buckets ---------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_save_to_a_new_bucket_with_create(seaweedfs: SeaweedFS) -> None:
    import torch

    bucket = unique("new")
    options = s3_options(seaweedfs, create=True)
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    target = f"s3://{bucket}/run/step-1.ckpt"
    await (await asyncstore.save(state, target, store_options=options))
    loaded = await asyncstore.load(target, store_options=options)
    assert torch.equal(loaded["w"], state["w"])
    assert bucket in {b["Name"] for b in seaweedfs.client().list_buckets()["Buckets"]}


@pytest.mark.anyio
async def test_create_is_idempotent_and_safe_between_racing_openers(seaweedfs: SeaweedFS) -> None:
    bucket = unique("race")
    stores = [
        asyncstore.open_store(f"s3://{bucket}/p{i}", **s3_options(seaweedfs, create=True))
        for i in range(4)
    ]

    async def use(i: int) -> None:
        async with stores[i] as store:
            await store.put("k", str(i).encode())

    async with anyio.create_task_group() as tg:
        for i in range(len(stores)):
            tg.start_soon(use, i)
    # An existing bucket is used as it is, its objects kept.
    async with asyncstore.open_store(f"s3://{bucket}", **s3_options(seaweedfs, create=True)) as s:
        assert sorted([i.key async for i in s.list()]) == [f"p{i}/k" for i in range(4)]


def test_create_by_an_identity_without_the_right_is_permission_denied(tmp_path: Path) -> None:
    limited = {
        "access_key": "limited",
        "secret_key": "limited-secret",
        "actions": ["Read", "Write", "List"],
    }
    with SeaweedFS(data_dir=tmp_path / "weed", extra_identities=[limited]) as server:
        server.create_bucket("exists")
        options = server.store_options(
            aws_access_key_id="limited", aws_secret_access_key="limited-secret", create=True
        )

        async def main() -> None:
            async with asyncstore.open_store("s3://exists/p", **options) as store:
                await store.put("k", b"v")  # an existing bucket needs no right to create
            with pytest.raises(
                asyncstore.PermissionDenied, match="not allowed to create bucket 'fresh'"
            ):
                async with asyncstore.open_store("s3://fresh/p", **options):
                    pass

        anyio.run(main)
        assert "fresh" not in {b["Name"] for b in server.client().list_buckets()["Buckets"]}


@pytest.mark.anyio
async def test_create_when_not_allowed_is_permission_denied(seaweedfs: SeaweedFS) -> None:
    bucket = unique("denied")
    options = s3_options(seaweedfs, create=True, aws_secret_access_key="not-the-secret")
    with pytest.raises(asyncstore.PermissionDenied, match=f"create bucket '{bucket}'"):
        async with asyncstore.open_store(f"s3://{bucket}/x", **options):
            pass
    assert bucket not in {b["Name"] for b in seaweedfs.client().list_buckets()["Buckets"]}


@pytest.mark.anyio
async def test_a_missing_bucket_is_named_apart_from_a_missing_key(seaweedfs: SeaweedFS) -> None:
    bucket = unique("missing")
    async with asyncstore.open_store(f"s3://{bucket}/run", **s3_options(seaweedfs)) as store:
        for call in (lambda: store.stat("a.bin"), lambda: store.get("a.bin")):
            with pytest.raises(asyncstore.NotFound) as caught:
                await call()
            message = str(caught.value)
            assert f"bucket {bucket!r} does not exist" in message
            assert "create=True" in message
            assert f"s3://{bucket}/run/a.bin" in message
    with pytest.raises(asyncstore.NotFound, match=f"bucket {bucket!r} does not exist"):
        await asyncstore.load(f"s3://{bucket}/run/step.ckpt", store_options=s3_options(seaweedfs))
    # In a bucket that exists, a missing key is only that.
    async with asyncstore.open_store(f"s3://{BUCKET}/{unique()}", **s3_options(seaweedfs)) as store:
        for call in (lambda: store.stat("a.bin"), lambda: store.get("a.bin")):
            with pytest.raises(asyncstore.NotFound) as caught:
                await call()
            assert "bucket" not in str(caught.value)


# -- a local server for development ------------------------------------------------------


def _start_server(data_dir: Path) -> tuple[subprocess.Popen[str], str, dict[str, Any]]:
    """``asyncstore server`` on a free port; its process, endpoint and options as printed."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncstore", "server", "--dir", str(data_dir), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line)
        if "Stop with Ctrl-C" in line:
            break
    else:
        proc.wait()
        raise AssertionError(f"no endpoint printed: {''.join(lines)}{proc.stderr.read()}")  # type: ignore[union-attr]
    text = "".join(lines)
    endpoint = re.search(r"^\s*export AWS_ENDPOINT_URL=(\S+)$", text, re.M)
    assert endpoint is not None, text
    printed = re.search(r"store_options = (\{.*?\})", text, re.S)
    assert printed is not None, text
    options = json.loads(printed.group(1))
    assert options["endpoint_url"] == endpoint.group(1)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert f"export {name}=" in text
    return proc, endpoint.group(1), options


def _interrupt(proc: subprocess.Popen[str], sig: signal.Signals = signal.SIGINT) -> int:
    proc.send_signal(sig)
    try:
        return proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def test_local_server_serves_many_buckets_and_keeps_them(tmp_path: Path) -> None:
    data_dir = tmp_path / "s3data"
    buckets = [f"dev-{i}-{uuid.uuid4().hex[:8]}" for i in range(5)]

    async def put_all(options: dict[str, Any]) -> None:
        for bucket in buckets:
            async with asyncstore.open_store(f"s3://{bucket}/p", create=True, **options) as store:
                await store.put("obj.bin", bucket.encode() * 1000)

    async def get_all(options: dict[str, Any]) -> None:
        for bucket in buckets:
            async with asyncstore.open_store(f"s3://{bucket}/p", **options) as store:
                assert await store.get("obj.bin") == bucket.encode() * 1000

    proc, _, options = _start_server(data_dir)
    try:
        anyio.run(put_all, options)
        anyio.run(get_all, options)
    finally:
        status = _interrupt(proc)
    assert status == 0
    assert any(data_dir.iterdir())  # the data stays

    proc, _, options = _start_server(data_dir)  # a restart serves the same objects
    try:
        anyio.run(get_all, options)
    finally:
        assert _interrupt(proc, signal.SIGTERM) == 0  # as a service manager stops it


# -- saves that do not block on the network ----------------------------------------------


def test_save_async_to_s3_reuses_one_client(
    seaweedfs: SeaweedFS, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch
    from aiobotocore.session import AioSession

    import asyncstore.torch

    created: list[str] = []
    create_client = AioSession.create_client

    def counting(self: AioSession, *args: Any, **kwargs: Any) -> Any:
        created.append(str(kwargs.get("endpoint_url")))
        return create_client(self, *args, **kwargs)

    monkeypatch.setattr(AioSession, "create_client", counting)
    # Options no other test uses, so that no pooled client exists for them yet.
    options = s3_options(seaweedfs, connect_timeout=9.25)
    run = unique("run")
    state = {"w": torch.arange(4096, dtype=torch.float32)}
    futures = [
        asyncstore.torch.save_async(
            state, f"s3://{BUCKET}/{run}/step-{i}.ckpt", store_options=options
        )
        for i in range(5)
    ]
    for future in futures:
        future.result(timeout=60)
    assert created == [seaweedfs.endpoint_url]  # one client for the five saves
    loaded = asyncstore.torch.load(f"s3://{BUCKET}/{run}/step-4.ckpt", store_options=options)
    assert torch.equal(loaded["w"], state["w"])


def test_save_async_reports_a_stopped_server_through_its_future(seaweedfs: SeaweedFS) -> None:
    import torch

    import asyncstore.torch

    state = {"w": torch.arange(4096, dtype=torch.float32)}
    run = unique("run")
    with FaultProxy("127.0.0.1", seaweedfs.s3_port) as proxy:
        options = s3_options(seaweedfs, endpoint_url=proxy.url, max_attempts=2)
        url = f"s3://{BUCKET}/{run}/step-0.ckpt"
        asyncstore.torch.save_async(state, url, store_options=options).result(timeout=60)
        proxy.refuse(True)  # the server is gone: connections are refused
        future = asyncstore.torch.save_async(
            state, f"s3://{BUCKET}/{run}/step-1.ckpt", store_options=options
        )
        with pytest.raises(asyncstore.StoreUnavailable):
            future.result(timeout=60)
    # Cold, too: the first save to a server that is down.
    with FaultProxy("127.0.0.1", seaweedfs.s3_port) as proxy:
        proxy.refuse(True)
        options = s3_options(seaweedfs, endpoint_url=proxy.url, max_attempts=2)
        future = asyncstore.torch.save_async(
            state, f"s3://{BUCKET}/{run}/step-2.ckpt", store_options=options
        )
        with pytest.raises(asyncstore.StoreUnavailable):
            future.result(timeout=60)


def test_a_forked_child_makes_its_own_client(seaweedfs: SeaweedFS) -> None:
    import torch
    from aiobotocore.session import AioSession

    import asyncstore.torch

    options = s3_options(seaweedfs, connect_timeout=9.75)
    url = f"s3://{BUCKET}/{unique('run')}/step-0.ckpt"
    state = {"w": torch.arange(256, dtype=torch.float32)}
    asyncstore.torch.save(state, url, store_options=options)  # the parent pools a client
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            created: list[object] = []
            create_client = AioSession.create_client

            def counting(self: AioSession, *args: Any, **kwargs: Any) -> Any:
                created.append(kwargs.get("endpoint_url"))
                return create_client(self, *args, **kwargs)

            AioSession.create_client = counting
            loaded = asyncstore.torch.load(url, store_options=options)
            code = 0 if torch.equal(loaded["w"], state["w"]) and len(created) == 1 else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    # The parent's client still works after the fork.
    assert torch.equal(asyncstore.torch.load(url, store_options=options)["w"], state["w"])
