"""attnkit.bench.clock: the clocks the model benchmarks put around transformers' interfaces."""

from __future__ import annotations

import time

import pytest

from attnkit.bench.clock import clocking


def test_a_clock_counts_each_call_and_a_raise_and_puts_the_functions_back() -> None:
    def slow(x: int) -> int:
        time.sleep(0.01)
        if x < 0:
            raise ValueError("negative")
        return x * 2

    def other(x: int) -> int:
        return x

    table = {"slow": slow, "other": other}
    spent = {"a": 0.0}

    def run() -> None:
        with clocking(table, {"slow": "a"}, spent):
            assert table["slow"](3) == 6
            assert table["other"] is other  # only the names asked for are clocked
            table["slow"](-1)

    with pytest.raises(ValueError, match="negative"):
        run()
    assert table == {"slow": slow, "other": other}
    assert spent["a"] >= 0.02  # both calls, the one that raised too
