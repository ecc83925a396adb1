"""Attention sinks of a shape attnkit does not take: refused by
:func:`attnkit.validate.check_sinks` with the argument, the shapes with their dimension names,
what was expected (``(H,)``, ``(B, H, L)`` or ``(1, H, L)``) and the fix.

Dimension legend: B batch, H query heads, L query length.
"""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import AttentionInputError

B, H, L, D = 2, 4, 6, 8
EXPECTED = "sinks (H=4,) or (B=2, H=4, L=6) or (1, H=4, L=6), of dtype torch.float32 on cpu"


@pytest.mark.parametrize(
    ("shape", "got", "problem", "fix"),
    [
        ((H + 1,), "sinks (H=5)", "it holds one logit per query head", "torch.zeros(H)"),
        (
            (B, H, L, 1),
            "sinks (4-D: 2, 4, 6, 1)",
            "per-token sinks hold one logit per query row and head",
            "sinks.squeeze(-1) (transformers passes Inkling 2's sinks as (B, H, L, 1))",
        ),
        ((B, L, H), "sinks (B=2, H=6, L=4)", "per-token sinks", "sinks.transpose(1, 2)"),
        ((B, H, L + 1), "sinks (B=2, H=4, L=7)", "per-token sinks", "(B=2, H=4, L=6) for one"),
        ((3, H, L), "sinks (B=3, H=4, L=6)", "per-token sinks", "(H=4,) for one sink per head"),
        ((H, L), "sinks (2-D: 4, 6)", "per-token sinks", "or (B=2, H=4, L=6)"),
    ],
)
@pytest.mark.parametrize("backend", ["auto", "math", "blocked"])
def test_sinks_of_another_shape_are_refused_by_name(
    shape: tuple[int, ...], got: str, problem: str, fix: str, backend: str
) -> None:
    q = torch.randn(B, H, L, D)
    with pytest.raises(AttentionInputError) as info:
        attnkit.attention(q, q, q, sinks=torch.zeros(shape), backend=backend)
    err = info.value
    assert err.argument == "sinks"
    assert err.got == f"{got}  q (B={B}, H={H}, L={L})"
    assert err.expected == EXPECTED
    assert problem in err.problem
    assert err.fix is not None
    assert fix in err.fix
    assert f"`sinks` has shape {shape}" in str(err)


@pytest.mark.parametrize("shape", [(H,), (B, H, L), (1, H, L)], ids=str)
def test_the_three_shapes_are_taken_by_explain_too(shape: tuple[int, ...]) -> None:
    q = torch.randn(B, H, L, D)
    assert attnkit.explain(q, q, q, sinks=torch.zeros(shape)).chosen == "math"
    with pytest.raises(AttentionInputError, match="per-token sinks"):
        attnkit.explain(q, q, q, sinks=torch.zeros(B, H, L, 1))
