"""The checks of :meth:`attnkit.models.GPT.generate`'s arguments (sampling, compiling).

Each raises an :class:`~attnkit.AttentionInputError` naming the argument, what it got and what
it takes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from attnkit.errors import AttentionInputError
from attnkit.validate import is_real

__all__ = ["Backend", "check_compile_args", "check_generate_args"]

#: what ``torch.compile(backend=...)`` takes: a registered name or a backend callable
Backend = str | Callable[..., Any]


def check_generate_args(
    where: str, max_new_tokens: int, temperature: float, top_k: int | None
) -> None:
    """``max_new_tokens`` an int >= 0, ``temperature`` a finite number >= 0, ``top_k`` None or
    an int >= 1."""
    if (
        isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, int)
        or max_new_tokens < 0
    ):
        raise AttentionInputError(
            where,
            "max_new_tokens",
            "`max_new_tokens` must be an int >= 0.",
            got=f"max_new_tokens={max_new_tokens!r}",
            expected="an int >= 0",
        )
    real = is_real(temperature)
    if not real or not math.isfinite(temperature) or temperature < 0:
        kind = "" if real else f" (a {type(temperature).__name__})"
        raise AttentionInputError(
            where,
            "temperature",
            f"`temperature` must be a finite number >= 0 (0 is greedy), got {temperature!r}{kind}.",
            got=f"temperature={temperature!r}",
            expected="0 (greedy) or a finite number > 0 (sampling)",
            fix="temperature=float(t) for a tensor; a very large temperature samples "
            "uniformly, which is rarely meant",
        )
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise AttentionInputError(
            where,
            "top_k",
            "`top_k` must be None or an int >= 1.",
            got=f"top_k={top_k!r}",
            expected="None (every token) or an int >= 1",
        )


def check_compile_args(
    where: str, compile: bool | Backend, static_cache: bool | None, use_cache: bool
) -> tuple[Backend | None, bool]:
    """``generate``'s ``compile`` and ``static_cache``, checked: the ``torch.compile`` backend
    (``None``: eager) and whether the cache is static."""
    backend: Backend | None
    if isinstance(compile, bool):
        backend = "inductor" if compile else None
    elif (isinstance(compile, str) and compile) or callable(compile):
        backend = compile
    else:
        raise AttentionInputError(
            where,
            "compile",
            f"`compile` must be a bool or a torch.compile backend, got {compile!r}.",
            got=f"compile={compile!r}",
            expected='False, True (inductor), a backend name such as "aot_eager" or a '
            "backend callable",
        )
    if static_cache is not None and not isinstance(static_cache, bool):
        raise AttentionInputError(
            where,
            "static_cache",
            f"`static_cache` must be None, True or False, got {static_cache!r}.",
            got=f"static_cache={static_cache!r}",
            expected="None (static when compiling), True or False",
        )
    if backend is not None and (static_cache is False or not use_cache):
        given = "static_cache=False" if static_cache is False else "use_cache=False"
        raise AttentionInputError(
            where,
            "compile",
            f"compiled decoding needs the static KV cache; {given} would grow the inputs "
            "at every step and recompile the step each time.",
            got=f"compile={compile!r}  {given}",
            expected="compile with use_cache=True and static_cache None or True",
            fix="drop static_cache=False / use_cache=False, or compile=False",
        )
    if static_cache and not use_cache:
        raise AttentionInputError(
            where,
            "static_cache",
            "`static_cache=True` names the KV cache's kind; use_cache=False uses none.",
            got="static_cache=True  use_cache=False",
            expected="use_cache=True with static_cache=True",
        )
    static = backend is not None if static_cache is None else static_cache
    return backend, static
