"""The pieces a call is built from (issue 23): the checks of attnkit.validate and
attnkit.mask_checks, then the keyword-only AttentionCall.build; each caller runs the checks it
needs. attention() and explain() run the same ones, so every bad input reads the same from both
(but for the caller's name); the modules skip only the inverted-causal-mask warning, which they
give in the convention of the argument the mask came as.

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
Dk query/key head dim, Dv value head dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

import attnkit
from attnkit import AttentionInputError, AttentionMaskWarning, masks
from attnkit.call import AttentionCall, Dims
from attnkit.mask_checks import check_mask
from attnkit.memory import AttentionMemoryError, set_memory_limit, too_big_error
from attnkit.validate import check_qkv, check_scalars, check_sinks
from validation_cases import B, Dk, H, L, qkv, r

W = "attnkit.attention"

# one bad input per check: q/k/v, the mask (tensor, spec, values), the numbers, sinks
BAD: list[tuple[str, dict[str, Any], Callable[[], tuple[torch.Tensor, ...]]]] = [
    ("q-int", {}, lambda: (torch.ones(B, H, L, Dk, dtype=torch.long), *qkv()[1:])),
    ("k-3d", {}, lambda: (r(B, H, L, Dk), r(B, L, Dk), r(B, H, L, Dk))),
    ("v-length", {}, lambda: (*qkv()[:2], r(B, H, L + 1, Dk))),
    ("heads", {}, lambda: qkv(Hkv=4)),
    ("mask-int", {"mask": torch.ones(L, L, dtype=torch.long)}, qkv),
    ("mask-shape", {"mask": torch.ones(L + 1, L, dtype=torch.bool)}, qkv),
    ("mask-inf", {"mask": torch.full((L, L), math.inf)}, qkv),
    ("mask-list", {"mask": [[True]]}, qkv),
    ("spec-batch", {"mask": masks.padding(torch.tensor([1, 2, 3]))}, qkv),
    ("spec-length", {"mask": masks.key_mask(torch.ones(B, L + 2, dtype=torch.bool))}, qkv),
    ("causal", {"causal": 1}, qkv),
    ("scale-tensor", {"scale": torch.tensor(0.5)}, qkv),
    ("scale-negative", {"scale": -1.0}, qkv),
    ("dropout", {"dropout_p": 1.0}, qkv),
    ("return-weights", {"return_weights": "yes"}, qkv),
    ("softcap", {"softcap": 0.0}, qkv),
    ("sinks-shape", {"sinks": torch.zeros(H + 1)}, qkv),
    ("sinks-dtype", {"sinks": torch.zeros(H, dtype=torch.float64)}, qkv),
]


@pytest.mark.parametrize(("kwargs", "tensors"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_explain_refuses_what_attention_refuses_with_the_same_message(
    kwargs: dict[str, Any], tensors: Callable[[], tuple[torch.Tensor, ...]]
) -> None:
    q, k, v = tensors()
    with pytest.raises(AttentionInputError) as ran:
        attnkit.attention(q, k, v, **kwargs)
    with pytest.raises(AttentionInputError) as explained:
        attnkit.explain(q, k, v, **kwargs)
    a, e = ran.value, explained.value
    assert str(a).startswith("attnkit.attention: ")
    assert str(e).startswith("attnkit.explain: ")
    assert (a.argument, a.problem, a.got, a.expected, a.fix) == (
        e.argument,
        e.problem,
        e.got,
        e.expected,
        e.fix,
    )


def test_check_qkv_returns_the_sizes_by_name() -> None:
    q, k, v = r(2, 8, 3, 16), r(2, 2, 5, 16), r(2, 2, 5, 4)
    dims = check_qkv(q, k, v, where=W)
    assert dims == Dims(B=2, H=8, Hkv=2, L=3, S=5, Dk=16, Dv=4)
    with pytest.raises(AttentionInputError) as info:
        check_qkv(q, k, r(2, 2, 6, 4), where="mine")
    assert str(info.value).startswith("mine: k and v have different lengths: k has S=5, v has S=6.")


def test_the_pieces_are_keyword_only_past_their_tensors() -> None:
    q, k, v = qkv()
    dims = check_qkv(q, k, v, where=W)
    with pytest.raises(TypeError):
        AttentionCall.build(q, k, v, dims, W)  # type: ignore[misc]
    with pytest.raises(TypeError):
        check_scalars(dims, W, True)  # type: ignore[misc]
    with pytest.raises(TypeError):
        check_mask(None, q, dims, W)  # type: ignore[misc]
    with pytest.raises(TypeError):
        check_qkv(q, k, v, W)  # type: ignore[misc]


def test_build_folds_causal_and_fixes_the_scale() -> None:
    q, k, v = r(1, 2, 1, 16), r(1, 2, 9, 16), r(1, 2, 9, 16)
    dims = check_qkv(q, k, v, where=W)
    decode = AttentionCall.build(q=q, k=k, v=v, dims=dims, where=W, causal=True)
    assert decode.mask is None  # one query at the last key sees every key: no rule needed
    assert decode.scale == 1 / math.sqrt(16)
    assert (decode.dropout_p, decode.return_weights, decode.explaining) == (0.0, False, False)
    spec = masks.sliding_window(4)
    call = AttentionCall.build(q=q, k=k, v=v, dims=dims, where=W, mask=spec, causal=True, scale=2)
    assert repr(call.mask) == repr(spec & masks.causal())
    assert call.scale == 2.0
    assert type(call.scale) is float


def test_check_sinks_and_check_mask_take_none() -> None:
    q, k, v = qkv()
    dims = check_qkv(q, k, v, where=W)
    check_sinks(None, q, dims, where=W)
    check_mask(None, q, dims, where=W)
    with pytest.raises(AttentionInputError, match="`sinks` is not a tensor"):
        check_sinks([0.0] * H, q, dims, where=W)


def test_too_big_error_lives_next_to_the_memory_guard() -> None:
    q = r(1, 2, 64, 8)
    dims = check_qkv(q, q, q, where=W)
    call = AttentionCall.build(q=q, k=q, v=q, dims=dims, where=W, return_weights=True)
    error = too_big_error(W, call, "math", 2**30, "the math backend's weights", 2**20)
    assert isinstance(error, AttentionMemoryError)
    assert (error.argument, error.nbytes, error.limit) == ("return_weights", 2**30, 2**20)
    assert "return_weights=False" in error.fix
    previous = set_memory_limit(2**20)
    try:  # what attention() raises above the limit is this error
        with pytest.raises(AttentionMemoryError) as info:
            attnkit.attention(r(1, 4, 1024, 16), r(1, 4, 1024, 16), r(1, 4, 1024, 16),
                              return_weights=True)  # fmt: skip
    finally:
        set_memory_limit(previous)
    assert info.value.argument == "return_weights"
    assert "return_weights=False" in info.value.fix


def test_a_module_warns_once_of_an_inverted_causal_mask() -> None:
    """The module warns in its argument's convention; the call it makes does not warn again."""
    mha = attnkit.MultiHeadAttention(16, 2).eval()
    x = r(1, 4, 16)
    inverted = torch.ones(4, 4, dtype=torch.bool).triu(1)
    with pytest.warns(AttentionMaskWarning) as record:
        mha(x, mask=inverted)
    assert len(record) == 1
    assert "this mask blocks every token from itself" in str(record[0].message)
    with pytest.warns(AttentionMaskWarning) as record:
        mha(x, attn_mask=~inverted)  # torch's convention: True = blocked
    assert len(record) == 1
    assert "this attn_mask blocks every token" in str(record[0].message)
    q = r(1, 2, 4, 8)
    with pytest.warns(AttentionMaskWarning) as record:
        attnkit.attention(q, q, q, mask=inverted)
    assert len(record) == 1
