"""The S3 client pool and a store's first request do their I/O outside any lock: stores
waiting for a client that is slow to make share its making, others are not held up by it,
and closing a store in the middle of it is safe and does not wait for it.

The slow I/O is real: credentials from a ``credential_process`` (run by botocore as a
subprocess) that answers only once the test opens its gate.
"""

from __future__ import annotations

import asyncio
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import asyncstore
from asyncstore.testing import SeaweedFS

from ..conftest import BUCKET, unique

pytestmark = pytest.mark.anyio

# Bounds on waits that should end at once: a test that is wrong fails instead of hanging.
PROMPT = 20.0


class Gate:
    """A credential process that counts its runs and answers once :meth:`open` is called."""

    def __init__(self, folder: Path, server: SeaweedFS) -> None:
        self.opened = folder / "open"
        self.runs = folder / "runs"
        script = folder / "credentials.py"
        script.write_text(
            textwrap.dedent(
                f"""
                import json, pathlib, time
                with open({str(self.runs)!r}, "a") as runs:
                    runs.write("run\\n")
                while not pathlib.Path({str(self.opened)!r}).exists():
                    time.sleep(0.01)
                print(json.dumps({{
                    "Version": 1,
                    "AccessKeyId": {server.access_key!r},
                    "SecretAccessKey": {server.secret_key!r},
                }}))
                """
            )
        )
        self.profile = unique("gated")  # a new profile: a new botocore session reads it
        self.config = folder / "aws-config"
        self.config.write_text(
            f"[profile {self.profile}]\ncredential_process = {sys.executable} {script}\n"
        )

    @property
    def count(self) -> int:
        return len(self.runs.read_text().splitlines()) if self.runs.exists() else 0

    async def started(self) -> None:
        with anyio.fail_after(PROMPT):
            while self.count == 0:  # noqa: ASYNC110 - another process writes it
                await asyncio.sleep(0.01)

    def open(self) -> None:
        self.opened.touch()


@pytest.fixture
def gate(tmp_path: Path, seaweedfs: SeaweedFS, monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    made = Gate(tmp_path, seaweedfs)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(made.config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    yield made
    made.open()  # a process still waiting ends


def gated_options(server: SeaweedFS, gate: Gate) -> dict[str, Any]:
    options = server.store_options(profile=gate.profile)
    del options["aws_access_key_id"], options["aws_secret_access_key"]
    return options


async def test_stores_share_a_client_being_made_and_others_are_not_held_up(
    seaweedfs: SeaweedFS, gate: Gate
) -> None:
    options = gated_options(seaweedfs, gate)
    stores = [asyncstore.open_store(f"s3://{BUCKET}/{unique()}", **options) for _ in range(4)]
    puts = [asyncio.ensure_future(store.put("k", b"v%d" % i)) for i, store in enumerate(stores)]
    await gate.started()
    # Meanwhile, a store with other options makes its own client and does its work at once.
    async with asyncstore.open_store(
        f"s3://{BUCKET}/{unique()}", **seaweedfs.store_options()
    ) as other:
        with anyio.fail_after(PROMPT):
            await other.put("k", b"other")
            assert await other.get("k") == b"other"
    assert not any(put.done() for put in puts)  # still waiting for their credentials
    gate.open()
    with anyio.fail_after(PROMPT):
        await asyncio.gather(*puts)
    for i, store in enumerate(stores):
        assert await store.get("k") == b"v%d" % i
    assert gate.count == 1  # one client made, once, for the four
    leases = {id(store._lease) for store in stores}  # type: ignore[attr-defined]
    assert len(leases) == 1
    for store in stores:
        await store.aclose()


async def test_closing_a_store_while_its_client_is_made_is_safe_and_prompt(
    seaweedfs: SeaweedFS, gate: Gate
) -> None:
    options = gated_options(seaweedfs, gate)
    store = asyncstore.open_store(f"s3://{BUCKET}/{unique()}", **options)
    get = asyncio.ensure_future(store.get("missing"))
    await gate.started()
    with anyio.fail_after(PROMPT):
        await store.aclose()  # the gate is still shut: close does not wait behind the I/O
    with pytest.raises(asyncstore.StoreClosed):
        await get
    assert gate.count == 1
    gate.open()
    # The pool finished the client for the next store with these options: no second run of
    # the credential process, and the closed store holds no share of it.
    async with asyncstore.open_store(f"s3://{BUCKET}/{unique()}", **options) as again:
        with anyio.fail_after(PROMPT):
            await again.put("k", b"v")
        lease = again._lease  # type: ignore[attr-defined]
        assert lease.refs == 1
    assert gate.count == 1
