"""Two mistakes the DCP plugin refuses before they cost a job: ``dcp.async_save``'s
collectives on the training's process group (a hang), and a load that leaves part of a saved
optimizer state out (a silent loss of its moments)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable
from types import FrameType
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from ..errors import InvalidArgument

__all__ = [
    "TrainingLoadPlanner",
    "refuse_shared_group",
    "refuse_untaken",
    "untaken_optimizer_entries",
]

# How far up the stack to look for DCP's frames: ``save``'s own ``process_group`` argument,
# ``distW`` (its ``_DistWrapper``) further in, and the async executor's ``save_wrapper``
# further out. Bounded, so that a change in DCP costs a missed check, never a hang.
_FRAMES = 32


def _dcp_save_frames() -> tuple[bool, Any, bool]:
    """(found, group, background) of the DCP save that called the writer: ``group`` is what
    was passed as ``process_group`` (``None``: the default group), ``background`` whether it
    runs on ``dcp.async_save``'s executor thread."""
    found, group, background = False, None, False
    frame: FrameType | None = sys._getframe(2)
    for _ in range(_FRAMES):
        if frame is None:
            break
        names, code = frame.f_locals, frame.f_code
        wrapper = names.get("distW")
        if not found and wrapper is not None and hasattr(wrapper, "group"):
            found, group = True, wrapper.group
        elif (
            not found
            and code.co_name == "save"
            and code.co_filename.endswith("state_dict_saver.py")
            and "process_group" in names
        ):
            found, group = True, names["process_group"]
        elif code.co_name == "save_wrapper" and code.co_filename.endswith(
            "_async_thread_executor.py"
        ):
            background = True
            break
        frame = frame.f_back
    return found, group, background


def refuse_shared_group(url: str) -> None:
    """Raise when ``dcp.async_save`` runs its collectives on the default process group: what
    ``dcp.async_save(state, storage_writer=...)`` without ``process_group`` does. Every rank
    makes the same call, so every rank raises here, before DCP's first collective (see
    :class:`~asyncstore.torch.dcp.StorageWriter`'s ``__bool__``): the save fails at once
    instead of hanging.

    On the default group, the background thread's collectives and the training's own (DDP's
    backward all-reduces, a metric's all_reduce) interleave in a different order on each
    rank; gloo then deadlocks (reproduced: a 2-rank DDP job hangs at its first save). A
    blocking ``dcp.save`` runs on the caller's thread (the training's, whichever thread that
    is) and is left alone.
    """
    import torch.distributed as dist

    if threading.current_thread() is threading.main_thread():
        return  # never the async executor's thread
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    found, group, background = _dcp_save_frames()
    if not (found and background):
        return
    from torch.distributed.distributed_c10d import _get_default_group

    if group is not None and group is not _get_default_group():
        return
    raise InvalidArgument(
        f"dcp.async_save of {url} runs its collectives on the default process group, in the "
        "background, where the training's own collectives (DDP's all-reduces) run too: on "
        "gloo the two interleave and the job hangs. Use ckpt.dcp_async_save(state, step) or "
        "ckpt.save_training_state(...), or pass process_group=ckpt.dcp_group() to "
        "dcp.async_save"
    )


def untaken_optimizer_entries(saved: Iterable[str], requested: Iterable[str]) -> list[str]:
    """The saved entries of an optimizer's state that a load does not ask for, although it
    asks for that optimizer's ``param_groups``: a template made from a fresh optimizer's
    ``state_dict()`` (which has no moments yet) loads the learning rates and silently skips
    AdamW's ``exp_avg`` and ``exp_avg_sq``.

    ``saved`` and ``requested`` are DCP's flattened names (``optim.state.fc.weight.exp_avg``,
    ``optim.param_groups.0.lr``); an optimizer is any prefix ``P`` with ``P.param_groups.*``
    entries, its state the entries under ``P.state.``.
    """
    asked = set(requested)
    prefixes = {
        name.partition("param_groups.")[0]
        for name in asked
        if name.startswith("param_groups.") or ".param_groups." in name
    }
    return sorted(
        name
        for name in saved
        if name not in asked and any(name.startswith(f"{prefix}state.") for prefix in prefixes)
    )


def refuse_untaken(url: str, untaken: list[str]) -> None:
    """Raise for the entries :func:`untaken_optimizer_entries` found, if any."""
    if not untaken:
        return
    shown = ", ".join(untaken[:4]) + (f", … ({len(untaken)} in all)" if len(untaken) > 4 else "")
    raise InvalidArgument(
        f"{url} holds optimizer state that the state being loaded does not ask for ({shown}): "
        "the load would leave it out and the optimizer would go on without it. Build the "
        "state with torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer), "
        "which creates the optimizer's moments for the load to fill, or use "
        "ckpt.load_training_state(model, optimizer); to load only part of it on purpose, "
        "pass partial_optimizer=True"
    )


class TrainingLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner for ``load_training_state``'s template, less the optimizer
    state of parameters the checkpoint holds none for.

    ``get_state_dict`` gives every parameter its moments (it takes a step with zero
    gradients on a fresh optimizer), but the optimizer that saved may have had none yet for
    some (an unused head, an expert no token reached): those entries are not asked for, and
    :attr:`stateless` names the parameters, whose state the caller then drops, as it was
    when saved. A parameter with part of its state saved keeps all of it asked for (a
    damaged or foreign checkpoint still fails the load).
    """

    stateless: set[str]

    def set_up_planner(
        self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False
    ) -> None:
        """Plan as DCP does, then leave out what :attr:`stateless` names."""
        super().set_up_planner(state_dict, metadata, is_coordinator)
        saved = set(metadata.state_dict_metadata) if metadata is not None else set()
        entries: dict[str, list[str]] = {}
        for name in self.state_dict:
            if name.startswith("optim.state."):
                fqn = name[len("optim.state.") :].rpartition(".")[0]
                entries.setdefault(fqn, []).append(name)
        self.stateless = set()
        for fqn, names in entries.items():
            if not any(name in saved for name in names):
                self.stateless.add(fqn)
                for name in names:
                    del self.state_dict[name]
