"""Checking many keys at once (a plan's slice) agrees with checking each one."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncstore import InvalidKey
from asyncstore.stores import check_key, check_key_list

# The characters every rule is about, and a long segment; joined in every order.
PIECES = st.sampled_from(["a", "b", "/", ".", "\x00", "é", " ", "..", ".asyncstore", "x" * 200])
KEY = st.lists(PIECES, max_size=6).map("".join)


def valid(key: str) -> bool:
    try:
        check_key(key, "memory://test")
    except InvalidKey:
        return False
    return True


@settings(max_examples=2000, deadline=None)
@given(keys=st.lists(KEY, max_size=5))
def test_a_list_passes_exactly_when_every_key_does(keys: list[str]) -> None:
    if all(valid(key) for key in keys):
        assert check_key_list(keys, "memory://test") is keys
    else:
        first = next(key for key in keys if not valid(key))
        with pytest.raises(InvalidKey) as raised:
            check_key_list(keys, "memory://test")
        with pytest.raises(InvalidKey) as alone:
            check_key(first, "memory://test")
        assert str(raised.value) == str(alone.value)  # the first bad key, named the same way


@pytest.mark.parametrize(
    "keys",
    [[""], ["a", ""], ["", "a"], ["a", "/b"], ["a", "b/"], ["a", "b//c"], ["a\x00b"], ["a", 7]],
)
def test_lists_with_a_bad_key_are_refused(keys: list[str]) -> None:
    with pytest.raises(InvalidKey):
        check_key_list(keys, "memory://test")


def test_an_empty_list_passes() -> None:
    assert check_key_list([], "memory://test") == []
