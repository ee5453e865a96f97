"""Lent writes: an S3 writer sends lent memory as it lies (its parts keep views, no copy) and
returns each loan once the parts holding it are sent, on every path: committed, aborted,
cancelled, failed. Against the real server, faults through the proxy."""

from __future__ import annotations

import asyncio
import os
from typing import Protocol, cast

import pytest

import asyncstore
from asyncstore.errors import InvalidArgument, StoreUnavailable
from asyncstore.stores import CheckedUploads, LentWrites, Loan, Writer
from asyncstore.testing import FaultProxy, SeaweedFS

from ..conftest import BUCKET, MiB, s3_options, unique

pytestmark = pytest.mark.anyio

PART = 5 * MiB


class LentWriter(Writer, LentWrites, Protocol):
    """An S3 writer, as these tests use it."""


class Counted(Loan):
    """A loan that counts how often it came back (it must come back exactly once)."""

    def __init__(self) -> None:
        self.returns = 0
        super().__init__(self._back)

    def _back(self) -> None:
        self.returns += 1


def lending(writer: Writer) -> LentWriter:
    assert isinstance(writer, LentWrites)
    return cast("LentWriter", writer)


def s3(seaweedfs: SeaweedFS, **options: object) -> asyncstore.Store:
    return asyncstore.open_store(
        f"s3://{BUCKET}/{unique('lent')}", **s3_options(seaweedfs, **options)
    )


async def test_lent_bytes_go_out_as_they_lie_and_their_loan_returns_once_sent(
    seaweedfs: SeaweedFS,
) -> None:
    head = os.urandom(1000)  # copied: the first part is a copy and a lent view
    lent = bytearray(os.urandom(2 * PART + 3 * MiB))
    async with s3(seaweedfs) as store:
        writer = lending(store.open_writer("a"))
        assert isinstance(writer, CheckedUploads)
        loan = Counted()
        async with writer:
            await writer.write(head)
            await writer.write_lent(memoryview(lent), loan)
            loan.release()  # the lender is done handing it out
            # The last 3 MiB (and 1000 bytes) wait for more in a part not yet full: the
            # writer holds a view of them, not a copy, and the loan is out.
            assert loan.returns == 0
            lent[-MiB:] = bytes(MiB)
        assert loan.returns == 1
        assert writer.server_checked  # each part's CRC32C, over all its views, matched
        assert await store.get("a") == head + lent
        # A single PUT (one part) of lent bytes: held until the commit too.
        small = bytearray(os.urandom(2 * MiB))
        loan = Counted()
        async with lending(store.open_writer("b")) as one:
            await one.write_lent(memoryview(small), loan)
            loan.release()
            assert loan.returns == 0
        assert loan.returns == 1
        assert await store.get("b") == small


async def test_unlend_copies_the_part_being_gathered_and_returns_its_loan(
    seaweedfs: SeaweedFS,
) -> None:
    lent = bytearray(os.urandom(PART + 2 * MiB))
    original = bytes(lent)
    async with s3(seaweedfs) as store:
        loan = Counted()
        async with lending(store.open_writer("a")) as writer:
            await writer.write_lent(memoryview(lent), loan)
            loan.release()
            writer.unlend()  # the 2 MiB past the first part: copied, their loan let go
            for _ in range(200):  # the first part is being sent meanwhile
                if loan.returns:
                    break
                await asyncio.sleep(0.05)
            assert loan.returns == 1
            lent[PART:] = bytes(2 * MiB)  # the owner reuses its memory
            await writer.write(b"tail")
        assert loan.returns == 1
        assert await store.get("a") == original + b"tail"


async def test_small_lent_pieces_are_copied(seaweedfs: SeaweedFS) -> None:
    # A part of many small views would cost a socket write and a checksum call each.
    lent = bytearray(os.urandom(1000))
    async with s3(seaweedfs) as store:
        loan = Counted()
        async with lending(store.open_writer("a")) as writer:
            await writer.write_lent(memoryview(lent), loan)
            loan.release()
            assert loan.returns == 1  # copied at once: nothing held
            lent[:] = bytes(1000)
        assert await store.get("a") != lent


async def test_loans_come_back_when_the_write_is_abandoned(seaweedfs: SeaweedFS) -> None:
    lent = bytearray(os.urandom(2 * PART + MiB))
    async with s3(seaweedfs) as store:
        loan = Counted()
        with pytest.raises(RuntimeError, match="caller gave up"):
            async with lending(store.open_writer("a")) as writer:
                await writer.write_lent(memoryview(lent), loan)
                loan.release()
                raise RuntimeError("caller gave up")
        assert loan.returns == 1
        assert [info.key async for info in store.list()] == []
        assert await store.abandoned_writes() == []  # type: ignore[attr-defined]


async def test_loans_come_back_when_a_stalled_upload_is_cancelled(
    seaweedfs: SeaweedFS, proxy: FaultProxy
) -> None:
    lent = bytearray(os.urandom(2 * PART + MiB))
    async with s3(seaweedfs, endpoint_url=proxy.url, read_timeout=30.0) as store:
        await store.put("warm", b"x")  # the connection and the upload path set up
        loan = Counted()
        proxy.stall(True)  # parts hang on their way to the server

        async def write() -> None:
            async with lending(store.open_writer("a")) as writer:
                try:
                    await writer.write_lent(memoryview(lent), loan)
                finally:
                    loan.release()  # the lender's hold, however the write ends

        task = asyncio.create_task(write())
        await asyncio.sleep(0.5)
        assert loan.returns == 0  # parts in flight (or waiting for the upload id) hold it
        task.cancel()
        proxy.stall(False)
        with pytest.raises(asyncio.CancelledError):
            await task
        assert loan.returns == 1
        assert [info.key async for info in store.list()] == ["warm"]


async def test_loans_come_back_when_a_part_fails(seaweedfs: SeaweedFS, proxy: FaultProxy) -> None:
    lent = bytearray(os.urandom(3 * PART))
    async with s3(seaweedfs, endpoint_url=proxy.url, max_attempts=1) as store:
        loan = Counted()
        proxy.fail_next(10, status=500, match="PUT ")
        with pytest.raises(StoreUnavailable):
            async with lending(store.open_writer("a")) as writer:
                try:
                    await writer.write_lent(memoryview(lent), loan)
                finally:
                    loan.release()
        assert loan.returns == 1
        assert [info.key async for info in store.list()] == []


async def test_a_returned_loan_cannot_be_held_again() -> None:
    loan = Counted()
    loan.release()
    assert loan.returned
    assert loan.returns == 1
    with pytest.raises(RuntimeError, match="returned loan"):
        loan.retain()
    assert loan.returns == 1


async def test_a_lent_write_needs_a_loan(seaweedfs: SeaweedFS) -> None:
    async with s3(seaweedfs) as store:
        async with lending(store.open_writer("a")) as writer:
            with pytest.raises(InvalidArgument, match="loan=None: pass an asyncstore"):
                await writer.write_lent(memoryview(b"x" * 100_000), None)  # type: ignore[arg-type]
            await writer.write(b"ok")
        assert await store.get("a") == b"ok"
