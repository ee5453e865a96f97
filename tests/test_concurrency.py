"""The concurrency primitives every module uses: shield, wait_shared, to_thread, TaskSet,
bounded_map and bounded_each, with_retries, and the fork and exit hooks."""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from asyncstore import _concurrency
from asyncstore._concurrency import TaskSet, shield, to_thread, wait_shared
from asyncstore.errors import StoreClosed

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("how", ["task.cancel", "anyio scope"])
async def test_shield_runs_cleanup_to_the_end_then_reraises(how: str) -> None:
    finished = asyncio.Event()

    async def cleanup() -> str:
        await asyncio.sleep(0.1)
        finished.set()
        return "done"

    async def caller() -> str:
        return await shield(cleanup())

    if how == "task.cancel":
        task = asyncio.ensure_future(caller())
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    else:
        with anyio.move_on_after(0.02) as scope:
            await caller()
        assert scope.cancelled_caught
    assert finished.is_set()


async def test_shield_returns_the_result_and_raises_the_error() -> None:
    async def ok() -> int:
        return 7

    async def bad() -> None:
        raise ValueError("boom")

    assert await shield(ok()) == 7
    with pytest.raises(ValueError, match="boom"):
        await shield(bad())


async def test_wait_shared_cancels_the_waiter_not_the_work() -> None:
    work = asyncio.ensure_future(asyncio.sleep(0.1, result="shared"))
    waiter = asyncio.ensure_future(wait_shared(work))
    await asyncio.sleep(0.01)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert not work.cancelled()
    assert await work == "shared"


@pytest.mark.parametrize("how", ["task.cancel", "anyio scope"])
async def test_to_thread_waits_for_the_thread_when_cancelled(how: str) -> None:
    done = threading.Event()

    def slow() -> None:
        time.sleep(0.2)
        done.set()

    if how == "task.cancel":
        task = asyncio.ensure_future(to_thread(slow))
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    else:
        with anyio.move_on_after(0.02):
            await to_thread(slow)
    # The memory the thread uses is the caller's again only once the thread is done.
    assert done.is_set()


async def test_to_thread_result_error_limiter_and_priority() -> None:
    assert await to_thread(sum, [1, 2, 3]) == 6
    with pytest.raises(ZeroDivisionError):
        await to_thread(lambda: 1 / 0)

    running = 0
    most = 0
    lock = threading.Lock()

    def one() -> None:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.02)
        with lock:
            running -= 1

    limiter = anyio.CapacityLimiter(2)
    await asyncio.gather(*(to_thread(one, limiter=limiter) for _ in range(8)))
    assert most == 2

    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    assert await to_thread(niceness, background=True) == _concurrency.LOW_PRIORITY
    assert await to_thread(niceness) < _concurrency.LOW_PRIORITY


async def test_task_set_close_cancels_and_awaits_every_task() -> None:
    tasks = TaskSet("test component")
    ended: list[str] = []

    async def forever(name: str) -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0.01)  # cleanup that takes a moment
            ended.append(name)

    spawned = [tasks.spawn(forever(f"t{i}"), name=f"t{i}") for i in range(3)]
    await asyncio.sleep(0)
    assert len(tasks) == 3
    assert spawned[0].get_name() == "asyncstore: t0"
    await tasks.aclose()
    assert sorted(ended) == ["t0", "t1", "t2"]
    assert all(task.done() for task in spawned)
    assert len(tasks) == 0
    await tasks.aclose()  # idempotent

    coro = forever("late")
    with pytest.raises(StoreClosed, match="test component is closed"):
        tasks.spawn(coro, name="late")
    assert inspect.getcoroutinestate(coro) == inspect.CORO_CLOSED  # no "never awaited" warning


async def test_task_set_cancel_from_sync_code() -> None:
    tasks = TaskSet("a connection")
    task = tasks.spawn(asyncio.sleep(3600), name="relay")
    await asyncio.sleep(0)
    tasks.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    coro = asyncio.sleep(0)
    with pytest.raises(StoreClosed):
        tasks.spawn(coro, name="late")


async def test_task_set_logs_a_detached_failure_once(caplog: pytest.LogCaptureFixture) -> None:
    tasks = TaskSet("the cache")

    async def fail() -> None:
        raise OSError("disk gone")

    async def fine() -> int:
        return 1

    with caplog.at_level(logging.ERROR, logger="asyncstore"):
        tasks.spawn(fail(), name="write batch", detached=True)
        owned = tasks.spawn(fail(), name="fetch")
        await tasks.join()
        assert await tasks.spawn(fine(), name="ok") == 1
    records = [r for r in caplog.records if "background task" in r.getMessage()]
    assert len(records) == 1
    assert "the cache" in records[0].getMessage()
    assert "write batch" in records[0].getMessage()
    assert records[0].exc_info is not None
    # The owner of an awaited task gets its error; the set does not log it.
    with pytest.raises(OSError, match="disk gone"):
        await owned
    await tasks.aclose()


def test_exit_hooks_run_in_step_order_and_survive_a_failing_hook() -> None:
    script = textwrap.dedent(
        """
        import logging
        logging.basicConfig()  # the application's logging: asyncstore itself never prints
        from asyncstore._concurrency import ExitStep, at_exit
        at_exit(ExitStep.STOP_THREADS, lambda: print("threads", flush=True))
        at_exit(ExitStep.STOP_LOOP, lambda: print("loop", flush=True))
        def broken():
            raise RuntimeError("hook failed")
        at_exit(ExitStep.FINISH_SAVES, broken)
        at_exit(ExitStep.FINISH_SAVES, lambda: print("saves", flush=True))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["saves", "loop", "threads"]
    assert "hook failed" in out.stderr


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX only")
def test_a_forked_child_gets_fresh_thread_pools() -> None:
    asyncio.run(to_thread(lambda: None))  # the parent's pool exists and has a thread
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        status = 1
        try:
            fresh = not _concurrency._EXECUTORS
            result = asyncio.run(to_thread(lambda: 41 + 1))
            os.write(write, f"{fresh} {result}".encode())
            status = 0
        finally:
            os._exit(status)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    answer = os.read(read, 100).decode()
    os.close(read)
    assert os.waitstatus_to_exitcode(status) == 0
    assert answer == "True 42"


def test_a_save_started_with_save_async_commits_at_exit(tmp_path: Path) -> None:
    # The interpreter waits for a pending save as it would for torch.save: the exit hooks
    # finish it while the background loop and the worker threads still run. The state is
    # large enough for the save to be still running at exit (the log line says it was).
    target = tmp_path / "exit.ckpt"
    script = textwrap.dedent(
        f"""
        import logging
        logging.basicConfig()  # the application's logging: asyncstore itself never prints
        import torch, asyncstore.torch as at
        torch.manual_seed(0)
        state = {{f"w{{i}}": torch.randn(10_000_000) for i in range(4)}}
        at.save_async(state, {str(target)!r})
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert "waiting for 1 checkpoint save" in out.stderr
    assert "failed" not in out.stderr
    import torch

    import asyncstore.torch

    torch.manual_seed(0)
    expected = {f"w{i}": torch.randn(10_000_000) for i in range(4)}
    loaded = asyncstore.torch.load(str(target))
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor)


# -- bounded_map ---------------------------------------------------------------------------------


async def test_bounded_map_keeps_order_and_its_bound() -> None:
    running = peak = 0

    async def work(n: int) -> int:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.001 * (n % 3))  # finish out of order
        running -= 1
        return n * n

    assert await _concurrency.bounded_map(work, range(20), limit=4) == [n * n for n in range(20)]
    assert peak == 4
    assert await _concurrency.bounded_map(work, [], limit=4) == []


@pytest.mark.parametrize(
    ("fan_out", "kind"),
    [("bounded_map", "generator"), ("bounded_each", "generator"), ("bounded_each", "async")],
)
async def test_a_fan_out_raises_the_first_failure_and_stops_the_rest(
    fan_out: str, kind: str
) -> None:
    taken: list[int] = []
    started: list[int] = []
    cancelled: list[int] = []

    async def work(n: int) -> int:
        started.append(n)
        if n == 1:
            raise ValueError("piece 1 failed")
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(n)
            raise
        return n

    items = _stream(kind, list(range(10)), taken)
    with pytest.raises(ValueError, match="piece 1 failed"):  # itself, not in a group
        await getattr(_concurrency, fan_out)(work, items, limit=3)
    assert sorted(started) == [0, 1, 2]  # items 3 to 9 never started
    assert sorted(cancelled) == [0, 2]
    if fan_out == "bounded_each":
        assert taken == [0, 1, 2]  # a stream is not read past what was started


@pytest.mark.parametrize("fan_out", ["bounded_map", "bounded_each"])
async def test_a_cancelled_fan_out_leaves_nothing_running(fan_out: str) -> None:
    ended: list[int] = []

    async def work(n: int) -> int:
        try:
            await asyncio.sleep(10)
        finally:
            ended.append(n)
        return n

    task = asyncio.ensure_future(getattr(_concurrency, fan_out)(work, range(1000), limit=5))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sorted(ended) == [0, 1, 2, 3, 4]  # all ended before the caller saw the cancel


# -- bounded_each --------------------------------------------------------------------------------


def _stream(kind: str, items: list[int], taken: list[int]) -> Any:
    """``items`` as a generator or an async generator, noting each item as it is taken."""

    def plain() -> Iterator[int]:
        for item in items:
            taken.append(item)
            yield item

    async def lazy() -> AsyncIterator[int]:
        for item in items:
            await asyncio.sleep(0)  # an async source waits between items
            taken.append(item)
            yield item

    return plain() if kind == "generator" else lazy()  # or "async"


@pytest.mark.parametrize("kind", ["generator", "async"])
async def test_bounded_each_takes_items_only_when_there_is_room(kind: str) -> None:
    taken: list[int] = []
    finished: list[int] = []
    running = peak = ahead = 0

    async def work(n: int) -> str:
        nonlocal running, peak, ahead
        running += 1
        peak = max(peak, running)
        ahead = max(ahead, len(taken) - len(finished))  # taken, not yet done
        await asyncio.sleep(0.001 * (n % 3))
        running -= 1
        finished.append(n)
        return "dropped"

    count = await _concurrency.bounded_each(work, _stream(kind, list(range(50)), taken), limit=4)
    assert count == 50
    assert sorted(finished) == list(range(50))
    assert taken == list(range(50))  # in the stream's order, each once
    assert peak == 4
    assert ahead == 4  # never more items held than calls allowed at once
    assert await _concurrency.bounded_each(work, [], limit=4) == 0


async def test_bounded_each_with_a_limit_of_one_runs_in_order() -> None:
    order: list[int] = []

    async def work(n: int) -> None:
        await asyncio.sleep(0.001 * (3 - n))
        order.append(n)

    assert await _concurrency.bounded_each(work, iter(range(4)), limit=1) == 4
    assert order == [0, 1, 2, 3]


@pytest.mark.parametrize("kind", ["generator", "async"])
async def test_bounded_each_raises_the_streams_own_error(kind: str) -> None:
    cancelled: list[int] = []

    def plain() -> Iterator[int]:
        yield 0
        raise OSError("the listing broke")

    async def lazy() -> AsyncIterator[int]:
        yield 0
        raise OSError("the listing broke")

    async def work(n: int) -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(n)
            raise

    items = plain() if kind == "generator" else lazy()
    with pytest.raises(OSError, match="the listing broke"):
        await _concurrency.bounded_each(work, items, limit=4)
    assert cancelled == [0]  # the call running when the stream failed was stopped


@pytest.mark.parametrize("fan_out", ["bounded_map", "bounded_each"])
def test_calls_failing_as_they_are_stopped_are_not_reported_as_never_retrieved(
    fan_out: str,
) -> None:
    # One piece fails; the others, cancelled, fail in their cleanup (a connection that
    # breaks as it is dropped). One error is raised; asyncio must not log the others, which
    # it would do when their tasks are collected (at the latest as the loop closes).
    import gc

    reported: list[dict[str, Any]] = []

    async def work(n: int) -> None:
        if n == 0:
            await asyncio.sleep(0.01)
            raise ValueError("piece 0 failed")
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            raise OSError(f"piece {n} broke as it was stopped") from None

    async def job() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, context: reported.append(context))
        with pytest.raises(ValueError, match="piece 0 failed"):
            await getattr(_concurrency, fan_out)(work, range(6), limit=6)

    asyncio.run(job())
    gc.collect()
    assert [c.get("message") for c in reported] == []


# -- with_retries --------------------------------------------------------------------------------


class _Flaky(Exception):
    pass


async def test_with_retries_retries_what_is_retryable_then_succeeds() -> None:
    calls = 0
    retried: list[tuple[int, float]] = []

    async def call() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise _Flaky(calls)
        return "ok"

    got = await _concurrency.with_retries(
        call,
        max_attempts=5,
        base_delay=0.001,
        max_delay=0.002,
        retryable=lambda exc: isinstance(exc, _Flaky),
        exhausted=lambda exc, n: RuntimeError(n),
        what="flaky call",
        on_retry=lambda exc, attempt, delay: retried.append((attempt, delay)),
    )
    assert got == "ok"
    assert [attempt for attempt, _ in retried] == [1, 2]
    assert all(0 <= delay <= 0.002 for _, delay in retried)


async def test_with_retries_gives_up_after_the_attempts_and_passes_others_at_once() -> None:
    calls = 0

    async def always(exc: Exception) -> None:
        nonlocal calls
        calls += 1
        raise exc

    def policy(call: Any) -> Any:
        return _concurrency.with_retries(
            call,
            max_attempts=3,
            base_delay=0.0,
            max_delay=0.0,
            retryable=lambda exc: isinstance(exc, _Flaky),
            exhausted=lambda exc, n: RuntimeError(f"gave up after {n}"),
            what="call",
        )

    with pytest.raises(RuntimeError, match="gave up after 3") as info:
        await policy(lambda: always(_Flaky()))
    assert isinstance(info.value.__cause__, _Flaky)
    assert calls == 3
    calls = 0
    with pytest.raises(KeyError):
        await policy(lambda: always(KeyError("not retryable")))
    assert calls == 1


def test_backoff_delay_is_full_jitter_under_the_cap() -> None:
    delays = [
        _concurrency.backoff_delay(attempt, 0.1, 0.5) for attempt in range(1, 8) for _ in "ab"
    ]
    assert all(0.0 <= d < 0.5 for d in delays)
    assert all(0.0 <= _concurrency.backoff_delay(1, 0.1, 5.0) < 0.1 for _ in range(50))


async def test_a_cancelled_callers_thread_error_is_not_reported_as_never_retrieved() -> None:
    # A load cancels its other reads when one fails; their threads may fail too, after
    # their callers are gone. Nobody can read those errors: asyncio must not log them.
    import gc

    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    release = threading.Event()

    def fails_later() -> None:
        release.wait(5)
        raise OSError("the thread failed after its caller left")

    try:
        task = asyncio.ensure_future(to_thread(fails_later))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.sleep(0.05)
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        del task
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(previous)
    assert [c.get("message") for c in reported] == []
