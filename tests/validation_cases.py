"""The shared parts of the input-validation tests: a table row (`Case`) and how it is checked.

``tests/validation/test_validate.py`` (``attnkit.attention``) and
``tests/validation/test_module_validation.py`` (the modules) import it as ``validation_cases``
(``tests/`` is on ``sys.path``, see conftest).

Each case reads the message: the argument it names (``exc.argument`` and the text), the shapes it
got with their dim names, the expected part and, where one exists, the likely fix. The message
layout is the same everywhere (see ``attnkit.errors``)::

    attnkit.attention: <problem>
      got:      <shapes with dim names>
      expected: <what was expected>
      fix:      <the likely fix>           (only where a common mistake explains it)

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
Dk query/key head dim, Dv value head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from attnkit import AttentionInputError

B, H, L, S, Dk = 2, 6, 5, 7, 16


def r(*shape: int, **kw: Any) -> torch.Tensor:
    return torch.randn(*shape, **kw)


def qkv(
    *, Hkv: int = H, S: int = L, Dv: int = Dk
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Valid q (B, H, L, Dk), k (B, Hkv, S, Dk), v (B, Hkv, S, Dv)."""
    return r(B, H, L, Dk), r(B, Hkv, S, Dk), r(B, Hkv, S, Dv)


Q = f"q (B={B}, H={H}, L={L}, Dk={Dk})"  # how a valid q is printed


@dataclass
class Case:
    """One bad input and what its error must say.

    ``problem``: substrings of the first line (they name the argument); ``got``: substrings of
    the got part (shapes with dim names); ``expected``: a substring of the expected part;
    ``fix``: a substring of the fix, or None where the error has no fix line.
    """

    call: Callable[[], object]
    argument: str
    problem: tuple[str, ...]
    got: tuple[str, ...]
    expected: str
    fix: str | None
    where: str = "attnkit.attention"
    marks: tuple[Any, ...] = field(default=())


def check_error(exc: AttentionInputError, case: Case) -> None:
    """The parts of the message, as text and as attributes."""
    assert isinstance(exc, ValueError)
    for attr in ("argument", "got", "expected", "fix"):
        assert hasattr(exc, attr)
    assert exc.argument == case.argument
    lines = str(exc).splitlines()
    assert lines[0] == f"{case.where}: {exc.problem}"
    assert lines[1] == f"  got:      {exc.got}"
    assert lines[2] == f"  expected: {exc.expected}"
    for part in case.problem:
        assert part in exc.problem, (part, str(exc))
    for part in case.got:
        assert part in exc.got, (part, str(exc))
    assert case.expected in exc.expected, str(exc)
    if case.fix is None:
        assert exc.fix is None
        assert len(lines) == 3
    else:
        assert exc.fix is not None, str(exc)
        assert case.fix in exc.fix, str(exc)
        assert lines[3] == f"  fix:      {exc.fix}"
        assert len(lines) == 4


def param(case_id: str, case: Case) -> Any:
    return pytest.param(case, id=case_id, marks=case.marks)
