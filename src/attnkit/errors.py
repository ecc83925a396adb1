"""The one exception type of attnkit, and the helpers that write its messages.

Every message has the same four parts, so a user can read any of them the same way::

    attnkit.attention: `k` has 4 heads, which does not divide the 6 heads of `q`.
      got:      q (B=2, H=6, L=5, Dk=16)  k (B=2, Hkv=4, S=5, Dk=16)  v (B=2, Hkv=4, S=5, Dv=16)
      expected: H % Hkv == 0 (each key/value head serves H/Hkv query heads)
      fix:      project keys/values to a number of heads that divides H (1 is multi-query)
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from typing import TypeGuard

import torch

__all__ = [
    "DTYPES",
    "AttentionInputError",
    "AttentionMaskWarning",
    "check_bool",
    "check_dtype_arg",
    "check_int",
    "dtype_error",
    "is_int_tensor",
    "shape_str",
    "tensor_got",
    "warn_user",
]


#: the dtypes attnkit computes in; q, k, v, float masks, sinks and module inputs of any other
#: dtype (float8, complex, integers, bool) are refused before any backend sees them
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
DTYPE_NAMES = "float16, bfloat16, float32 or float64"


def dtype_error(
    where: str,
    name: str,
    dtype: torch.dtype,
    got: str,
    *,
    fix_int: str | None = None,
    expected: str | None = None,
) -> AttentionInputError | None:
    """``None`` when attnkit computes in ``dtype`` (:data:`DTYPES`); else the error for the
    argument ``name`` of that dtype, naming the dtypes attnkit computes in (``got`` is the
    message's ``got``; ``fix_int`` the fix for an integer or bool tensor, default a cast;
    ``expected`` what the argument takes, when it is more than those dtypes)."""
    if dtype in DTYPES:
        return None
    if dtype.is_complex:
        problem = (
            f"`{name}` has dtype {dtype}; attention takes real floating-point tensors (a softmax "
            "over complex scores is not defined)."
        )
        fix = (
            f"{name}.real, or the real and imaginary parts as features: "
            f"torch.view_as_real({name}).flatten(-2)"
        )
    elif dtype.is_floating_point:
        problem = (
            f"`{name}` has dtype {dtype}, which attnkit does not compute in (none of its "
            "backends has kernels for it)."
        )
        fix = (
            f"{name}.to(torch.bfloat16) or .float(): dequantize float8 values (with their scale) "
            "before attention"
        )
    else:
        problem = f"`{name}` has dtype {dtype}; attention needs floating-point inputs."
        fix = fix_int if fix_int is not None else f"{name}.float()"
    computes = f"{DTYPE_NAMES} (the dtypes attnkit computes in)"
    return AttentionInputError(
        where, name, problem, got=got, expected=computes if expected is None else expected,
        fix=fix,
    )  # fmt: skip


def check_dtype_arg(where: str, dtype: object, name: str = "dtype") -> None:
    """A ``dtype=`` argument (a module's, a cache's): ``None`` or one of :data:`DTYPES`."""
    if dtype is None or dtype in DTYPES:
        return
    raise AttentionInputError(
        where,
        name,
        f"`{name}` is {dtype}, which attnkit does not compute in.",
        got=f"{name}={dtype!r}",
        expected=f"None (torch's default dtype) or {DTYPE_NAMES}",
        fix=f"{name}=torch.bfloat16 (or float16, float32, float64); float8 weights are "
        "dequantized before use",
    )


def is_int_tensor(x: object) -> TypeGuard[torch.Tensor]:
    """A tensor of integers: not bool, float or complex (token ids, positions)."""
    return isinstance(x, torch.Tensor) and not (
        x.is_floating_point() or x.is_complex() or x.dtype == torch.bool
    )


def tensor_got(name: str, x: object, dims: Sequence[str] | None) -> str:
    """The ``got`` of an argument that should be a tensor: its named shape and dtype, or, for
    anything else, its type."""
    if isinstance(x, torch.Tensor):
        return f"{shape_str(name, x, dims)} dtype={x.dtype}"
    return f"{name}: {type(x).__name__}"


def shape_str(name: str, t: torch.Tensor | Sequence[int], dims: Sequence[str] | None) -> str:
    """``q (B=2, H=8, L=5, Dk=64)``: a tensor's shape with its dimension names.

    When ``dims`` does not match the rank (the usual case for a wrong-rank input) the sizes are
    printed without names.
    """
    sizes = tuple(t.shape) if isinstance(t, torch.Tensor) else tuple(t)
    if dims is not None and len(dims) == len(sizes):
        inner = ", ".join(f"{d}={s}" for d, s in zip(dims, sizes, strict=True))
    else:
        inner = ", ".join(str(s) for s in sizes) + (", " if len(sizes) == 1 else "")
        inner = f"{len(sizes)}-D: {inner}" if sizes else "0-D"
    return f"{name} ({inner})"


class AttentionInputError(ValueError):
    """Bad input to an attnkit function or module.

    The message names the argument, shows the shapes it got with their dimension names, says what
    was expected and, where a common mistake explains it, the likely fix. The same parts are kept
    as attributes for programs: ``argument``, ``got``, ``expected``, ``fix``.
    """

    def __init__(
        self,
        where: str,
        argument: str,
        problem: str,
        *,
        got: str,
        expected: str,
        fix: str | None = None,
    ) -> None:
        self.where = where
        self.argument = argument
        self.problem = problem
        self.got = got
        self.expected = expected
        self.fix = fix
        lines = [f"{where}: {problem}", f"  got:      {got}", f"  expected: {expected}"]
        if fix:
            lines.append(f"  fix:      {fix}")
        # what ValueError.__init__(message) sets. Dynamo traces this assignment, not that call:
        # under torch.compile(fullgraph=True) its error names this one (where and problem), and
        # without fullgraph this one reaches the caller whole
        self.args = ("\n".join(lines),)


def rank_error(
    where: str,
    name: str,
    x: object,
    dims: Sequence[str],
    *,
    fix: str,
    got: str | None = None,
    expected: str | None = None,
) -> AttentionInputError:
    """The error for an argument ``name`` that is not a ``len(dims)``-D tensor ``(dims)``.

    >>> print(rank_error("f", "x", torch.zeros(2, 3), ("B", "L", "E"), fix="x.unsqueeze(0)"))
    f: `x` is 2-D; it must be 3-D (B, L, E).
      got:      x (2-D: 2, 3)
      expected: x (B, L, E)
      fix:      x.unsqueeze(0)
    """
    wanted = f"{len(dims)}-D ({', '.join(dims)})"
    if isinstance(x, torch.Tensor):
        problem = f"`{name}` is {x.dim()}-D; it must be {wanted}."
        got = got or shape_str(name, x, dims)
    else:
        problem = f"`{name}` is a {type(x).__name__}; it must be a {wanted} tensor."
        got = got or f"{name}: {type(x).__name__}"
    return AttentionInputError(
        where, name, problem, got=got, expected=expected or f"{name} ({', '.join(dims)})", fix=fix
    )


def check_int(where: str, name: str, value: object, *, minimum: int = 1) -> int:
    """``value`` if it is an int (not a bool) ``>= minimum``, else an error naming ``name``.

    >>> check_int("attnkit.TransformerStack", "num_layers", 0, minimum=0)
    0
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise AttentionInputError(
            where,
            name,
            f"`{name}` must be {what}, got {value!r}.",
            got=f"{name}={value!r}",
            expected=f"an int >= {minimum}",
        )
    return value


def check_bool(where: str, name: str, value: object, expected: str) -> bool:
    """``value`` if it is a bool, else an error naming ``name``.

    >>> check_bool("attnkit.KVCache", "static", True, "True or False")
    True
    """
    if not isinstance(value, bool):
        raise AttentionInputError(
            where,
            name,
            f"`{name}` must be True or False, got {value!r}.",
            got=f"{name}={value!r}",
            expected=expected,
        )
    return value


class AttentionMaskWarning(UserWarning):
    """A mask that is valid but almost certainly not what was meant (for example, inverted)."""


def warn_user(message: str, category: type[Warning] = AttentionMaskWarning) -> None:
    """Warn, pointing at the first caller outside attnkit and torch (the user's line)."""
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and str(frame.f_globals.get("__name__", "")).startswith(
        ("attnkit.", "torch.")
    ):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level + 1)
