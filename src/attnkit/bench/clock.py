"""Clocks around the functions a model looks up by name at every call (transformers'
attention and mask interfaces), for the benchmark programs that split a model's time
(``benchmarks/hf_speed.py``, ``benchmarks/decode.py``).

>>> table = {"f": lambda x: x + 1}
>>> spent = {"f": 0.0}
>>> with clocking(table, {"f": "f"}, spent):
...     table["f"](1)
2
>>> spent["f"] > 0 and table["f"](1) == 2
True
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Hashable, Iterator, MutableMapping
from typing import Any

__all__ = ["clocked", "clocking"]


def clocked(fn: Callable[..., Any], spent: dict[Any, float], key: Hashable) -> Callable[..., Any]:
    """``fn``, adding the seconds each call takes (a raise included) to ``spent[key]``."""

    def call(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - t0

    return call


@contextlib.contextmanager
def clocking(
    table: MutableMapping[str, Callable[..., Any]],
    keys: dict[str, Hashable],
    spent: dict[Any, float],
) -> Iterator[None]:
    """While open, ``table[name]`` (for each ``name`` of ``keys``) adds its time to
    ``spent[keys[name]]``; the functions it held are put back when it closes."""
    originals = {name: table[name] for name in keys}
    try:
        for name, fn in originals.items():
            table[name] = clocked(fn, spent, keys[name])
        yield
    finally:
        for name, fn in originals.items():
            table[name] = fn
