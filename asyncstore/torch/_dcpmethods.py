"""The distributed half of :class:`asyncstore.torch.Checkpointer`: versions saved and loaded
by every rank through ``torch.distributed.checkpoint`` (DCP), on a process group of the
checkpointer's own, and the whole training state (model, optimizer, your values) in one
call."""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from .._loop import run_sync
from ..checkpoint import Checkpointer as _AsyncCheckpointer
from ..checkpoint import Version
from ..errors import IntegrityError, InvalidArgument, NotFound, StoreError, UnsafeCheckpoint

if TYPE_CHECKING:
    from . import dcp
    from ._dcpwriter import VersionWriter

__all__ = ["DistributedMethods"]

logger = logging.getLogger("asyncstore.checkpoint")


def _agreed(find: Callable[[], int], group: Any = None) -> int:
    """``find()`` on rank 0, broadcast to every rank of ``group`` (the default group when
    ``None``; its error too, raised on every rank); in one process, ``find()``."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return find()
    outcome: list[Any] = [None]
    error: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            outcome[0] = ("ok", find())
        except Exception as exc:  # told to every rank, which would wait forever otherwise
            error = exc
            kind = (
                "missing"
                if isinstance(exc, NotFound)
                else "damaged"
                if isinstance(exc, IntegrityError)
                else "failed"
            )
            outcome[0] = (kind, str(exc))
    dist.broadcast_object_list(outcome, src=0, group=group)
    kind, value = outcome[0]
    if error is not None:
        raise error
    if kind == "missing":
        raise NotFound(value)
    if kind == "damaged":
        raise IntegrityError(value)
    if kind == "failed":
        raise StoreError(f"rank 0 could not find the version to load: {value}")
    return int(value)


def _fresh_group_names() -> None:
    """Under torchelastic, after a restart, name new process groups as no earlier attempt
    did (collectively, on the default group: every rank of a torchelastic job calls it).

    torchrun keeps its key-value store across restarts (a key set in one attempt is there
    in the next), and a gloo group's ranks find each other through addresses published
    there under the group's name; names count up from the same start in every attempt, so
    a group made after a restart may read the killed attempt's addresses and fail with
    "connection refused" (reproduced: 2 ranks, one SIGKILLed, ``--max-restarts=1``). Each
    rank proposes a count past its attempt's (``TORCHELASTIC_RESTART_COUNT``, which agents
    on different nodes may count differently) and every rank takes the largest, so that
    they still agree. Uses c10d's group counter (``_world.group_count``); without it,
    nothing changes.
    """
    import os

    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    world = getattr(distributed_c10d, "_world", None)
    count = getattr(world, "group_count", None)
    if attempt is None or not isinstance(count, int):
        return  # not torchelastic, or another c10d: nothing to do, on every rank
    proposed = max(count, int(attempt) * 1_000_000 if attempt.isdigit() else count)
    backend = str(dist.get_backend())
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if "gloo" not in backend and torch.cuda.is_available()
        else torch.device("cpu")
    )
    agreed = torch.tensor([proposed], dtype=torch.int64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    world.group_count = int(agreed.item())  # type: ignore[union-attr]


class DistributedMethods:
    """The ``dcp_*`` and ``*_training_state`` methods of
    :class:`asyncstore.torch.Checkpointer` (which see)."""

    _ckpt: _AsyncCheckpointer
    _group: Any  # the gloo group of DCP's collectives, made on first use
    _dcp_pending: concurrent.futures.Future[Any] | None  # the newest dcp_async_save's

    if TYPE_CHECKING:  # the Checkpointer's

        @property
        def url(self) -> str: ...

        def versions(self) -> list[Version]: ...

    def dcp_writer(self, step: int) -> dcp.StorageWriter:
        """A ``torch.distributed.checkpoint`` storage writer that saves the distributed
        version of ``step``: on every rank, ``dcp.save(state,
        storage_writer=ckpt.dcp_writer(step))`` (or ``dcp.async_save``).

        Each rank writes its shards under ``step-000001000.dcp/`` with this checkpointer's
        save options (its ``SaveConfig``: compression, level, chunks, staging, exclude,
        metadata, priority); the version exists once the coordinator has
        written its ``.metadata``. Then, on the coordinator, it replaces a single-object
        version of the same step, what killed distributed saves of earlier steps left is
        removed, and retention runs in the background as after :meth:`save` (closing the
        checkpointer waits for it).

        Raises:
            InvalidArgument: ``step`` is not an int >= 0, or the checkpointer has a mirror
                (every rank writes straight to the run's store: point the checkpointer at
                the shared store instead).
        """
        return self._version_writer(step)

    def _version_writer(self, step: int) -> VersionWriter:
        from ._dcpwriter import VersionWriter

        return VersionWriter(run_sync(self._ckpt.dcp_version(step)))

    def dcp_group(self) -> Any:
        """The process group this checkpointer's distributed saves and loads run their
        collectives on: a gloo group of every rank of the default group, made on first use
        (collectively: every rank calls the ``dcp_*`` methods in the same order, as DCP
        needs anyway); ``None`` outside an initialized process group.

        A group of its own, because DCP's collectives must not share a group with the
        training's: an ``async_save`` on the default group runs its collectives on a
        background thread while DDP's backward all-reduces on the same group, and on gloo
        the two interleave and deadlock (PyTorch's advice is a separate group for
        checkpoint collectives). Pass it as ``process_group=`` when calling DCP directly.
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        if self._group is None:
            _fresh_group_names()
            self._group = dist.new_group(backend="gloo")
        return self._group

    def dcp_save(self, state: dict[str, Any], step: int, *, planner: Any = None) -> None:
        """Save ``state`` as the distributed version of ``step``, on every rank
        (collectively), returning once it is committed: ``dcp.save`` with
        :meth:`dcp_writer` and :meth:`dcp_group`, after the previous :meth:`dcp_async_save`
        of this checkpointer has finished. ``planner`` goes to ``dcp.save``. Counted in
        :meth:`stats` on every rank (the whole call is blocking time).

        Raises:
            InvalidArgument: as :meth:`dcp_writer`.
        """
        from torch.distributed.checkpoint import state_dict_saver

        self._dcp_wait()
        writer = self._version_writer(step)
        writer.counted = True
        started = time.monotonic()
        try:
            state_dict_saver.save(
                state, storage_writer=writer, planner=planner, process_group=self.dcp_group()
            )
        except BaseException:
            run_sync(writer.version.counted(0.0, None))
            raise
        took = time.monotonic() - started
        run_sync(writer.version.counted(took, took))

    def dcp_async_save(
        self, state: dict[str, Any], step: int, *, planner: Any = None
    ) -> concurrent.futures.Future[Any]:
        """Save ``state`` as the distributed version of ``step`` in the background, on
        every rank (collectively): ``dcp.async_save`` with :meth:`dcp_writer` and
        :meth:`dcp_group`, so that its collectives never meet the training's (the default
        group's DDP all-reduces). Returns once ``state`` is staged (copied): training may
        change it at once. The returned future completes at the commit.

        One save at a time: a call first waits for the previous one of this checkpointer
        (and raises its error, if it failed); :meth:`close` waits for the last. Counted in
        :meth:`stats` on every rank: the staging as blocking time, the whole save as total.

        Raises:
            InvalidArgument: as :meth:`dcp_writer`.
        """
        from torch.distributed.checkpoint import state_dict_saver

        self._dcp_wait()
        writer = self._version_writer(step)
        writer.counted = True
        started = time.monotonic()
        try:
            staged = state_dict_saver.async_save(
                state, storage_writer=writer, planner=planner, process_group=self.dcp_group()
            )
        except BaseException:
            run_sync(writer.version.counted(0.0, None))
            raise
        blocking = time.monotonic() - started
        assert isinstance(staged, concurrent.futures.Future)
        # Completed once the save is counted, so that stats() is current when it returns.
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def finished(future: concurrent.futures.Future[Any]) -> None:
            error = future.exception()
            total = None if error is not None else time.monotonic() - started
            try:
                run_sync(writer.version.counted(blocking, total))
            finally:
                if error is not None:
                    done.set_exception(error)
                else:
                    done.set_result(future.result())

        staged.add_done_callback(finished)
        self._dcp_pending = done
        return done

    def _dcp_wait(self) -> None:
        # The previous dcp_async_save must end before another save starts (its error is
        # the caller's to see, here as at the future).
        pending, self._dcp_pending = self._dcp_pending, None
        if pending is not None:
            pending.result()

    def dcp_reader(
        self, step: int | None = None, *, weights_only: bool = True
    ) -> dcp.StorageReader:
        """A ``torch.distributed.checkpoint`` storage reader of the distributed version of
        ``step``, or of the newest one whose ``.metadata`` verifies: on every rank,
        ``dcp.load(state, storage_reader=ckpt.dcp_reader())``. :meth:`dcp_load` does the
        same and falls back to an older version when a rank finds the newest damaged.
        A :meth:`dcp_async_save` still running is waited for first (its collectives share
        the group); do not start one between this call and the ``dcp.load``.

        With ``step=None`` under an initialized process group, rank 0 finds the version and
        tells the others (collectively: call it on every rank), so that every rank loads the
        same version even if a save commits meanwhile.

        ``weights_only=True`` (the default, as for :meth:`load`): the state's non-tensor
        values are checked with torch's restricted unpickler and allow-list before DCP
        unpickles them (a plain :class:`~asyncstore.torch.dcp.StorageReader` defaults to
        DCP's own rule, ``False``); pass ``False`` for a run you trust whose state holds
        objects of your own classes.

        Raises:
            NotFound: there is no distributed version (of ``step``, or at all).
            IntegrityError: with ``step=None``, no version's ``.metadata`` verifies.
            InvalidArgument: ``step`` is not an int >= 0.
        """
        from . import dcp

        ckpt = self._ckpt
        if step is not None:
            ckpt.dcp_url(step)  # checks it
        self._dcp_wait()  # its collectives run on the same group as the agreement's
        found = self._agreed_dcp(step, {})
        return dcp.StorageReader(
            ckpt.dcp_url(found), store_options=ckpt.store_options, weights_only=weights_only
        )

    def dcp_load(
        self,
        state: dict[str, Any],
        step: int | None = None,
        *,
        planner: Any = None,
        partial_optimizer: bool = False,
        weights_only: bool = True,
    ) -> int:
        """Load a distributed version into ``state`` in place, on every rank (collectively),
        and return its step: ``step = ckpt.dcp_load(state)``.

        With ``step=None``, the newest version that loads whole. Rank 0 passes over versions
        whose ``.metadata`` does not verify; when any rank finds a chunk damaged or a rank
        object missing during the load (DCP reports every rank's failure to all of them),
        the version is marked damaged, a warning names it and what failed, and every rank
        loads the next older version, which fills every entry of ``state`` again. With
        ``step``, that version only. ``planner`` goes to ``dcp.load``. A
        :meth:`dcp_async_save` still running is waited for first.

        An optimizer's state is loaded whole or not at all: when ``state`` takes an
        optimizer's ``param_groups`` but not every saved entry of its ``state`` (a fresh
        optimizer's ``state_dict()`` has no moments yet), the load is refused rather than
        leaving AdamW's ``exp_avg``/``exp_avg_sq`` behind. Build ``state`` with
        ``get_state_dict(model, optimizer)`` (or use :meth:`load_training_state`), or pass
        ``partial_optimizer=True`` to load part of it on purpose. ``weights_only`` as for
        :meth:`dcp_reader` (default ``True``).

        Raises:
            NotFound: there is no distributed version (of ``step``, or at all).
            IntegrityError: the version of ``step`` is damaged, or every version is (each
                named with what failed).
            InvalidArgument: ``step`` is not an int >= 0, or ``state`` leaves out part of
                a saved optimizer state (every rank raises it).
            UnsafeCheckpoint: with ``weights_only=True``, a value the restricted
                unpickler refuses (every rank raises it).
            torch.distributed.checkpoint.api.CheckpointException: any other failure of the
                load (say, a ``state`` whose shapes are not the checkpoint's), as
                ``dcp.load`` raises it.
        """
        from torch.distributed.checkpoint import state_dict_loader
        from torch.distributed.checkpoint.api import CheckpointException

        from . import dcp

        ckpt = self._ckpt
        if step is not None:
            ckpt.dcp_url(step)  # checks it
        self._dcp_wait()  # a save in flight runs collectives on the same group
        failed: dict[int, str] = {}  # step -> what failed (rank 0's copy decides)
        while True:
            found = self._agreed_dcp(step, failed)
            url = ckpt.dcp_url(found)
            reader = dcp.StorageReader(
                url,
                store_options=ckpt.store_options,
                partial_optimizer=partial_optimizer,
                weights_only=weights_only,
            )
            try:
                state_dict_loader.load(
                    state, storage_reader=reader, planner=planner, process_group=self.dcp_group()
                )
            except CheckpointException as exc:
                refusals = [
                    error
                    for _, (error, _) in sorted(exc.failures.items())
                    if isinstance(error, InvalidArgument | UnsafeCheckpoint)
                ]
                if refusals and len(refusals) == len(exc.failures):
                    # Told to every rank by DCP: say it plainly, with no fallback (an older
                    # version holds the same kind of state).
                    raise refusals[0] from None
                damage = [
                    (rank, error)
                    for rank, (error, _) in sorted(exc.failures.items())
                    if isinstance(error, IntegrityError | NotFound)
                ]
                if not damage:
                    raise
                rank, error = damage[0]
                why = f"rank {rank}: {error}"
                ckpt.dcp_damaged(found)
                if step is not None:
                    raise IntegrityError(f"step {found} ({url}) does not load: {why}") from None
                failed[found] = why
                logger.warning("%s does not load (%s); loading an older version", url, why)
            else:
                return found

    def _agreed_dcp(self, step: int | None, failed: dict[int, str]) -> int:
        # The version every rank loads: ``step``'s, or the newest that may load (rank 0's
        # choice, collectively under a process group).
        group = self.dcp_group()
        if step is not None:
            return _agreed(lambda: self._dcp_versions(step)[-1].step, group)
        return _agreed(lambda: self._loadable_dcp(failed), group)

    def _dcp_versions(self, step: int | None) -> list[Version]:
        # The distributed versions (of ``step`` only, when given), oldest first.
        versions = [v for v in self.versions() if v.kind == "dcp"]
        if step is not None:
            versions = [v for v in versions if v.step == step]
        if not versions:
            which = "of step {step}" if step is not None else "at all"
            raise NotFound(
                f"{self.url} holds no distributed version {which.format(step=step)} "
                "(step-*.dcp/ with its .metadata): save one with dcp_writer(step)"
            )
        return versions

    def _loadable_dcp(self, failed: dict[int, str]) -> int:
        # The newest distributed version not known to be damaged whose .metadata verifies.
        from . import dcp

        ckpt = self._ckpt
        for version in reversed(self._dcp_versions(None)):
            step = version.step
            if step in failed:
                continue
            url = ckpt.dcp_url(step)
            if version.state == "damaged":
                failed[step] = "found damaged earlier"
                continue
            try:
                dcp.StorageReader(url, store_options=ckpt.store_options).read_metadata()
            except (IntegrityError, NotFound) as exc:  # NotFound: deleted since it was listed
                failed[step] = str(exc)
                if isinstance(exc, IntegrityError):
                    ckpt.dcp_damaged(step)
                    logger.warning("%s is damaged (%s); passing over it", url, exc)
                continue
            return step
        raise IntegrityError(
            f"no distributed version of {self.url} loads: "
            + "; ".join(f"step {s}: {why}" for s, why in sorted(failed.items(), reverse=True))
        )

    # -- the whole training state ---------------------------------------------------------

    def save_training_state(
        self,
        step: int,
        model: Any,
        optimizer: Any = None,
        *,
        extra: Mapping[str, Any] | None = None,
        blocking: bool = False,
    ) -> concurrent.futures.Future[Any]:
        """Save the model, the optimizer and ``extra`` as the distributed version of
        ``step``, on every rank (collectively): the safe default for a DDP, FSDP or
        single-process job.

        The model's and optimizer's state come from
        ``torch.distributed.checkpoint.state_dict.get_state_dict`` (plain names, without
        DDP's ``module.``; FSDP and tensor-parallel shards saved once; every moment of
        the optimizer), and are saved with :meth:`dcp_async_save`: this returns once the
        state is staged, the future completes at the commit, and the next call waits for
        the previous save. ``blocking=True`` saves with :meth:`dcp_save` instead and
        returns a completed future.

        ``extra`` holds your own values (a dataset's position, the epoch, random states):
        tensors and plain Python values. DCP keeps one copy of a value every rank saves
        under the same key, so a value that differs between ranks goes under a key of its
        rank's own (``{f"rank{rank}": ...}``).

        Raises:
            InvalidArgument: a bad argument (named), or as :meth:`dcp_writer`.
        """
        state = self._training_state(model, optimizer, extra, "save_training_state")
        if not blocking:
            return self.dcp_async_save(state, step)
        self.dcp_save(state, step)
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        done.set_result(None)
        return done

    def load_training_state(
        self,
        model: Any,
        optimizer: Any = None,
        *,
        extra: dict[str, Any] | None = None,
        step: int | None = None,
    ) -> int | None:
        """Load what :meth:`save_training_state` saved into ``model``, ``optimizer`` and
        ``extra``, on every rank (collectively), and return its step; ``None`` when the run
        holds no distributed version yet (a fresh start)::

            step = ckpt.load_training_state(model, optimizer, extra=extra) or 0

        The version is :meth:`dcp_load`'s: the newest that loads whole (or that of
        ``step``). ``extra`` is a template of the values saved with it, filled in place
        (a tensor's memory, a plain value's entry in its dict). The optimizer's state is
        loaded whole (with every moment, created first by ``get_state_dict``) and set with
        ``set_state_dict``; a checkpoint that holds optimizer state the optimizer does not
        take (another optimizer, other parameters) is refused, never half-loaded.

        Raises:
            NotFound: ``step`` was given and has no distributed version.
            IntegrityError: as :meth:`dcp_load`.
            InvalidArgument: a bad argument, or the checkpoint's optimizer state does not
                fit ``optimizer``.
            torch.distributed.checkpoint.api.CheckpointException: the checkpoint lacks
                entries the model, the optimizer or ``extra`` ask for (say, another model).
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        if extra is not None and not isinstance(extra, dict):
            raise InvalidArgument(
                f"load_training_state: extra={extra!r}: pass the dict of values saved with "
                "the state, which the load fills in place"
            )
        from ._dcpguard import TrainingLoadPlanner

        state = self._training_state(model, optimizer, extra, "load_training_state")
        planner = TrainingLoadPlanner()
        try:
            found = self.dcp_load(state, step, planner=planner)
        except NotFound:
            if step is not None:
                raise
            others = [v.step for v in self.versions() if v.kind != "dcp"]
            if others:
                logger.warning(
                    "%s holds no distributed version to resume from, only versions saved "
                    "with save() (steps %s): load_training_state starts afresh; load those "
                    "with load()",
                    self.url,
                    ", ".join(str(s) for s in others[-5:]),
                )
            return None  # the same on every rank: rank 0 found none and said so
        if optimizer is not None:
            for fqn in planner.stateless:  # as the saving optimizer had it: no state yet
                state["optim"]["state"].pop(fqn, None)
        if optimizer is None:
            from torch.distributed.checkpoint.state_dict import set_model_state_dict

            set_model_state_dict(model, state["model"])
        else:
            set_state_dict(
                model,
                optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optim"],
                # Those parameters' state is left out on purpose; the rest is whole (the
                # load asked for every entry of the template).
                options=StateDictOptions(strict=not planner.stateless),
            )
        return found

    @staticmethod
    def _training_state(
        model: Any, optimizer: Any, extra: Mapping[str, Any] | None, func: str
    ) -> dict[str, Any]:
        # {"model": ..., "optim": ..., "extra": ...} as get_state_dict gives them.
        import torch
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if not isinstance(model, torch.nn.Module):
            raise InvalidArgument(f"{func}: model={model!r}: pass the torch.nn.Module trained")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidArgument(
                f"{func}: optimizer={optimizer!r}: pass the torch.optim.Optimizer of the "
                "model, or None"
            )
        if extra is not None and (
            not isinstance(extra, Mapping) or not all(isinstance(k, str) for k in extra)
        ):
            raise InvalidArgument(f"{func}: extra={extra!r}: pass a dict with str keys (or None)")
        state: dict[str, Any] = {}
        if optimizer is None:
            state["model"] = get_model_state_dict(model)
        else:
            state["model"], state["optim"] = get_state_dict(model, optimizer)
        if extra:
            state["extra"] = extra if isinstance(extra, dict) else dict(extra)
        return state
