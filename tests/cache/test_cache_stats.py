"""Latency percentiles: what the window holds now, whether or not they were asked before."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from asyncstore.cache._stats import LatencyWindow

ACTIONS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.floats(0, 10)),
        st.tuples(st.just("zeros"), st.integers(-2, 12)),
        st.tuples(st.just("ask"), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(actions=ACTIONS, size=st.integers(1, 16))
def test_percentiles_follow_every_sample_even_when_asked_in_between(
    actions: list[tuple[str, float]], size: int
) -> None:
    window = LatencyWindow(size)
    kept: list[float] = []  # the reference: the last ``size`` samples
    for action, value in actions:
        if action == "add":
            window.add(value)
            kept = [*kept, value][-size:]
        elif action == "zeros":
            window.add_zeros(int(value))
            kept = [*kept, *[0.0] * max(0, int(value))][-size:]
        ordered = sorted(kept)
        last = len(ordered) - 1
        expected = (
            tuple(ordered[min(last, round(q * last))] for q in (0.50, 0.95, 0.99))
            if ordered
            else (0.0, 0.0, 0.0)
        )
        assert window.percentiles() == expected
