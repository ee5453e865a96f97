"""A ``torch.distributed.checkpoint`` storage plugin over any asyncstore store.

``dcp.save(state, storage_writer=StorageWriter(url))`` and
``dcp.load(state, storage_reader=StorageReader(url))`` keep DCP's planning, resharding and
collectives, and put the bytes through asyncstore's checkpoint engine: each rank writes its
items as one checkpoint object (compressed where it pays, every chunk checksummed, staged
in bounded memory, atomic), and the coordinator writes DCP's metadata last, so a checkpoint
is complete or invisible. A load reads, from each rank's object, only the entries its plan
asks for, and verifies every chunk it reads.

Layout under ``url``: ``__<rank>_<save>.ckpt`` per rank that wrote items (``<save>`` new for
every save, so saving again into the same directory never writes over the checkpoint there
until the new one is complete), and ``.metadata`` (DCP's ``Metadata``, checksummed; read back
with an unpickler that builds only DCP's metadata classes). See
:mod:`asyncstore.checkpoint.engine`.

With a :class:`asyncstore.torch.Checkpointer`, ``ckpt.dcp_writer(step)`` and
``ckpt.dcp_reader()`` save and load numbered versions of a run, with its retention.
"""

from __future__ import annotations

from ._dcpreader import StorageReader
from ._dcpwriter import StorageWriter

__all__ = ["StorageReader", "StorageWriter"]

# Shown (and pickled) under the module users import them from.
StorageReader.__module__ = __name__
StorageWriter.__module__ = __name__
