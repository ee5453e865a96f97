"""The unpickler of a distributed checkpoint's ``.metadata``: it builds DCP's metadata
classes and the torch values they hold, nothing else (see :mod:`._distributed`).

A module of its own because it imports torch (its base class does): the layout module
stays importable without it.
"""

from __future__ import annotations

import enum
import io
from typing import Any

from ..errors import IntegrityError
from ._unpickle import BoundedUnpickler

__all__ = ["MetadataUnpickler"]


class MetadataUnpickler(BoundedUnpickler):
    """Builds DCP's metadata classes and the torch values they hold; nothing else.

    The pure-Python unpickler with lengths checked against the pickle (see
    :class:`BoundedUnpickler`): the C one allocates whatever length a crafted ``BINBYTES8``
    claims before it finds the bytes missing.
    """

    def __init__(self, data: bytes, where: str) -> None:
        super().__init__(io.BytesIO(data), where)

    def find_class(self, module: str, name: str) -> Any:
        import torch
        import torch.distributed.checkpoint.metadata as dcp_metadata
        import torch.serialization

        value: Any = None
        if module == "torch.distributed.checkpoint.metadata":
            value = getattr(dcp_metadata, name, None)
            if not isinstance(value, type) or value.__module__ != module:
                value = None
        elif module == "torch" and name == "Size":
            value = torch.Size
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            value = getattr(torch, name)
        elif module == "torch.serialization" and name == "_get_layout":
            value = torch.serialization._get_layout
        elif module == "collections" and name == "OrderedDict":
            import collections

            value = collections.OrderedDict
        elif module == "builtins" and name == "getattr":
            # Python 3.11.0-3.11.3 pickle an enum member as getattr(cls, name): taken for
            # the metadata's own enums only, never as getattr in general.
            value = self._enum_member
        if value is None:
            raise IntegrityError(
                f"{self._where} names {module}.{name}, which DCP metadata does not hold: "
                "it was not written by asyncstore.torch.dcp; refusing to build it"
            )
        return value

    def _enum_member(self, cls: object, name: object) -> Any:
        if not (
            isinstance(cls, type)
            and issubclass(cls, enum.Enum)
            and cls.__module__ == "torch.distributed.checkpoint.metadata"
            and isinstance(name, str)
            and name in cls.__members__
        ):
            raise IntegrityError(
                f"{self._where} asks for getattr({cls!r:.80}, {name!r:.80}), which is not a "
                "member of a DCP metadata enum: it was not written by asyncstore.torch.dcp; "
                "refusing to build it"
            )
        return cls[name]
