"""Foreign messages made fit to quote inside an asyncstore error or a log line."""

from __future__ import annotations

import re

__all__ = ["plain"]

_TERMINAL_CODES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def plain(error: BaseException | str) -> str:
    """``error``'s message without terminal escape codes (torch's messages bold some
    words), on one line."""
    return " ".join(_TERMINAL_CODES.sub("", str(error)).split())
