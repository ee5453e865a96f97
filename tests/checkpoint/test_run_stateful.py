"""A run driven by random sequences of saves (rollbacks among them), deletes, prunes,
damage and looks with other settings, against a model of what must be there.

The model's rules are the documented ones: the newest version is the one saved last;
retention runs only after a save, and keeps the window back to the ``keep_last``-th
version that can load; a deleted version never comes back; every version listed and not
damaged loads what was saved. The default run is short (a few seconds, in every test run);
``ASYNCSTORE_STATEFUL_EXAMPLES=500`` runs it long.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, ClassVar

import anyio
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import asyncstore
import asyncstore.torch
from asyncstore.testing import SeaweedFS

from ..conftest import BUCKET, s3_options, unique

EXAMPLES = int(os.environ.get("ASYNCSTORE_STATEFUL_EXAMPLES", "12"))
KEEP_LAST = 2


def state(step: int, value: int) -> dict[str, Any]:
    return {
        "frozen": torch.arange(2048.0),
        "value": torch.full((1024,), float(value)),
        "step": step,
    }


class RunMachine(RuleBasedStateMachine):
    """One run, reopened for every operation (closing waits for retention, so what the
    run holds afterwards is settled)."""

    url: ClassVar[str] = ""
    options: ClassVar[dict[str, Any] | None] = None

    def __init__(self) -> None:
        super().__init__()
        self.where = f"{self.url}/{unique('machine')}"
        self.saved: dict[int, int] = {}  # step -> the value its version holds
        self.order: list[int] = []  # steps, in the order they were last saved
        self.damaged: set[int] = set()

    def checkpointer(self, keep_last: int = KEEP_LAST) -> asyncstore.torch.Checkpointer:
        return asyncstore.torch.Checkpointer(
            self.where, keep_last=keep_last, chunk_bytes=4096, store_options=self.options
        )

    # -- the model -------------------------------------------------------------------------

    def listed_order(self) -> list[int]:
        # The order the run knows: a damaged version's save time is in its unreadable
        # manifest, so it is placed just after the version of the step before it.
        position = {step: index for index, step in enumerate(self.order)}
        keyed = []
        before = -1
        for step in sorted(self.saved):
            if step not in self.damaged:
                before = position[step]
            keyed.append((before if step in self.damaged else position[step], step))
        return [step for _, step in sorted(keyed)]

    def retain(self, keep_last: int = KEEP_LAST) -> None:
        # The window back to the keep_last-th loadable version, newest first; the rest go.
        newest_first = list(reversed(self.listed_order()))
        good = 0
        for index, step in enumerate(newest_first):
            if good == keep_last:
                for gone in newest_first[index:]:
                    self.forget(gone)
                return
            good += step not in self.damaged

    def forget(self, step: int) -> None:
        self.saved.pop(step)
        self.order.remove(step)
        self.damaged.discard(step)

    # -- rules -----------------------------------------------------------------------------

    @rule(step=st.integers(0, 6), value=st.integers(0, 10**6))
    def save(self, step: int, value: int) -> None:
        with self.checkpointer() as ckpt:
            ckpt.save(state(step, value), step).result()
        self.saved[step] = value
        if step in self.order:
            self.order.remove(step)
        self.order.append(step)
        self.damaged.discard(step)
        self.retain()

    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        if not self.saved:
            return
        step = data.draw(st.sampled_from(sorted(self.saved)))
        with self.checkpointer() as ckpt:
            ckpt.delete(step)
        self.forget(step)

    @rule(data=st.data())
    def damage(self, data: st.DataObject) -> None:
        # Its manifest made unreadable: the version is listed, damaged, and loads nothing.
        if not self.saved:
            return
        step = data.draw(st.sampled_from(sorted(self.saved)))

        async def cut() -> None:
            key = f"step-{step:09d}.ckpt"
            async with asyncstore.open_store(self.where, **(self.options or {})) as store:
                body = await store.get(key)
                await store.put(key, body[: len(body) - 10])

        anyio.run(cut)
        self.damaged.add(step)

    @rule(keep_last=st.integers(1, 3))
    def prune(self, keep_last: int) -> None:
        # Counts versions that verify; refuses, deleting nothing, when none does.
        with self.checkpointer() as ckpt:
            if self.saved and not set(self.saved) - self.damaged:
                with pytest.raises(asyncstore.IntegrityError, match="deleted nothing"):
                    ckpt.prune(keep_last)
                return
            ckpt.prune(keep_last)
        self.retain(keep_last)

    @rule(keep_last=st.integers(1, 3))
    def look_with_other_settings(self, keep_last: int) -> None:
        # Listing, loading and verifying, as a script would: nothing may change.
        with self.checkpointer(keep_last) as ckpt:
            for version in ckpt.versions():
                ckpt.verify(version.step)
            if set(self.saved) - self.damaged:
                ckpt.load()

    # -- what must hold --------------------------------------------------------------------

    @invariant()
    def the_run_holds_what_the_model_does(self) -> None:
        with self.checkpointer() as ckpt:
            versions = ckpt.versions()
            assert sorted(v.step for v in versions) == sorted(self.saved)
            assert {v.step for v in versions if v.state == "damaged"} == self.damaged
            for step, value in self.saved.items():
                if step not in self.damaged:
                    loaded = ckpt.load(step=step)
                    assert int(loaded["value"][0]) == value, step
            loadable = [s for s in self.order if s not in self.damaged]
            if loadable:
                newest = ckpt.load()
                assert newest["step"] == loadable[-1]
                assert int(newest["value"][0]) == self.saved[loadable[-1]]

    def teardown(self) -> None:
        if self.options is None:
            shutil.rmtree(self.where, ignore_errors=True)


def run_machine(url: str, options: dict[str, Any] | None, examples: int) -> None:
    machine: type[RunMachine] = type("Run", (RunMachine,), {"url": url, "options": options})
    case = machine.TestCase
    case.settings = settings(
        max_examples=examples,
        stateful_step_count=10,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    case("runTest").runTest()


def test_a_local_run_under_random_operations() -> None:
    root = tempfile.mkdtemp(prefix="asyncstore-stateful-")
    try:
        run_machine(root, None, EXAMPLES)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.s3
def test_an_s3_run_under_random_operations(seaweedfs: SeaweedFS) -> None:
    run_machine(f"s3://{BUCKET}/{unique('stateful')}", s3_options(seaweedfs), max(3, EXAMPLES // 4))
