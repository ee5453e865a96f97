"""What the command-line tests share: an error checked to be one plain line."""

from __future__ import annotations

import pytest


def one_line_error(capsys: pytest.CaptureFixture[str], *words: str) -> str:
    """The command's error output, checked to be one line without a traceback, holding each of
    ``words``, and saying what an option takes rather than "got str" (the command line types
    text as text)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    for word in words:
        assert word in err, err
    assert "got str" not in err, err
    return err
