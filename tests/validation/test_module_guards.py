"""What the bad-input hypothesis test (tests/validation/test_bad_inputs.py) found in the modules
and the mask plumbing, pinned case by case with their messages: inputs on another device than the
parameters, a module ``mask`` that is neither a tensor nor a spec, masks on different devices,
0-D and 1-D masks on every backend, and specs whose tensors hold no values (``meta``).

Dimension legend: B batch, H heads, L query length, S key length, E model width.
"""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import AttentionInputError, masks
from validation_cases import Case, check_error, param

E, H, L, S = 8, 2, 5, 7
WHERE = "attnkit.MultiHeadAttention"


def mha() -> attnkit.MultiHeadAttention:
    torch.manual_seed(0)
    return attnkit.MultiHeadAttention(E, H)


x = torch.randn(1, L, E)

CASES = [
    param(
        "query-on-meta",
        Case(
            lambda: mha()(x.to("meta")),
            "query",
            ("`query` is on meta but the module's parameters are on cpu.",),
            ("query (B=1, L=5, E=8) on meta  parameters: on cpu",),
            "query on cpu",
            "query.to('cpu'), or module.to('meta')",
            where=WHERE,
        ),
    ),
    param(
        "mask-a-list",
        Case(
            lambda: mha()(x, mask=[[True] * L] * L),
            "mask",
            ("`mask` is a list, not a tensor or a mask spec.",),
            ("mask: list",),
            "a bool tensor (True = may attend)",
            "torch.as_tensor(mask, dtype=torch.bool)",
            where=WHERE,
        ),
    ),
    param(
        "masks-on-two-devices",
        Case(
            lambda: mha()(
                x,
                mask=torch.ones(L, L, dtype=torch.bool, device="meta"),
                attn_mask=torch.zeros(L, L),
            ),
            "attn_mask",
            ("the masks given are on different devices.",),
            ("mask on meta  attn_mask on cpu",),
            "every mask on the query's device",
            "move them with .to(query.device)",
            where=WHERE,
        ),
    ),
    param(
        "spec-and-key-mask-on-two-devices",
        Case(
            lambda: mha()(
                x,
                mask=masks.padding(torch.tensor([3], device="meta")),
                key_padding_mask=torch.zeros(1, L, dtype=torch.bool),
            ),
            "key_padding_mask",
            ("the masks given are on different devices.",),
            ("mask on meta  key_padding_mask on cpu",),
            "every mask on the query's device",
            ".to(query.device)",
            where=WHERE,
        ),
    ),
    param(
        "spec-on-meta",  # its repr shows the shape: a meta tensor has no values to print
        Case(
            lambda: attnkit.attention(
                torch.randn(2, H, L, 4),
                torch.randn(2, H, L, 4),
                torch.randn(2, H, L, 4),
                mask=masks.padding(torch.tensor([3, 5], device="meta")),
            ),
            "mask",
            ("the mask spec's tensors are on meta but q is on cpu.",),
            ("mask=padding(<(2,) on meta>)",),
            "the spec's tensors on q's device",
            "build it from tensors on 'cpu'",
        ),
    ),
]


@pytest.mark.parametrize("case", CASES)
def test_found_by_the_hypothesis_test(case: Case) -> None:
    with pytest.raises(AttentionInputError) as info:
        case.call()
    check_error(info.value, case)


@pytest.mark.parametrize("backend", ["math", "sdpa", "blocked"])
@pytest.mark.parametrize("shape", [(), (S,), (1, S)], ids=["0-D", "1-D", "2-D"])
def test_a_mask_of_any_rank_broadcasts_on_every_backend(
    backend: str, shape: tuple[int, ...]
) -> None:
    """A 0-D or 1-D mask broadcasts to (B, H, L, S) as any other (sdpa needed 2 dims)."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, H, L, 4, generator=g)
    k, v = torch.randn(2, H, S, 4, generator=g), torch.randn(2, H, S, 4, generator=g)
    keep = torch.tensor([True, False, True, True, False, True, True])
    mask = keep.reshape(shape) if shape else torch.tensor(True)
    want = attnkit.attention(q, k, v, mask=mask.expand(2, H, L, S), backend="math")
    got = attnkit.attention(q, k, v, mask=mask, backend=backend)
    assert torch.allclose(got, want, atol=1e-6)
