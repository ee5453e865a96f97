"""``asyncstore export`` of a distributed (DCP) checkpoint and ``asyncstore import``: the
conversions of :mod:`asyncstore.torch`'s ``dcp_to_torch_save`` / ``torch_save_to_dcp``, with
a progress bar when stderr is a terminal.

``export`` writes the whole, un-sharded state as one plain ``torch.save`` file, the file
that ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` writes from a
checkpoint in DCP's own file format: rebuilt from ``.metadata`` as DCP rebuilds it, read
with every chunk verified and every non-tensor value checked with ``weights_only=True``,
and written to the destination in one atomic put (a failure at any point leaves the
destination as it was). Like ``dcp_to_torch_save``, this holds the whole state in memory
(and here the file's bytes too, for the atomic put).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._common import progress

if TYPE_CHECKING:
    from .._config import SaveConfig

__all__ = ["export_dcp", "import_dcp"]


def export_dcp(src: str, dst: str, options: dict[str, Any], dst_options: dict[str, Any]) -> str:
    """Write the distributed checkpoint at ``src`` (its directory's URL) as one
    ``torch.save`` file at ``dst`` (a path or URL); ``options`` and ``dst_options`` are
    the two stores' options. Returns the URL written. A progress bar
    shows the tensor bytes read when stderr is a terminal.

    Raises:
        NotFound: there is no complete checkpoint at ``src``.
        IntegrityError: it is damaged (a chunk, a rank object, ``.metadata``).
        UnsafeCheckpoint: a value in it needs a trusted load.
    """
    from ..torch import dcp_to_torch_save

    with progress(None, "exporting") as bar:
        return dcp_to_torch_save(
            src,
            dst,
            store_options=options,
            file_store_options=dst_options,
            weights_only=True,
            progress=bar,
        )


def import_dcp(
    src: str,
    dst: str,
    options: dict[str, Any],
    dst_options: dict[str, Any],
    step: int | None,
    config: SaveConfig,
) -> str:
    """Save the state dict in the ``torch.save`` file at ``src`` as a distributed
    checkpoint at ``dst`` (a directory's URL; with ``step``, that version of the run at
    ``dst``), the file loaded with ``weights_only=True``; ``options`` and ``dst_options``
    are the two stores' options; every rank object is saved with ``config``. Returns the
    checkpoint's URL. A progress bar shows the
    tensor bytes read and written when stderr is a terminal.

    Raises:
        NotFound: there is no file at ``src``.
        InvalidArgument: it holds no dict.
        UnsafeCheckpoint: it holds objects ``weights_only=True`` refuses.
    """
    from ..torch import torch_save_to_dcp

    with progress(None, "importing") as bar:
        return torch_save_to_dcp(
            src,
            dst,
            step=step,
            store_options=dst_options,
            file_store_options=options,
            weights_only=True,
            save_config=config,
            progress=bar,
        )
