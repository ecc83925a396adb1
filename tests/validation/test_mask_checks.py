"""Mask checks of issue 15: spec lengths against S (row 8), negative padding lengths, and
``+inf`` / NaN in float masks (row 9). Each case reads the message part by part
(``validation_cases.check_error``).

Dimension legend: B batch, H query heads, L query length, S key length, Dk head dim.
"""

from __future__ import annotations

import math

import pytest
import torch

import attnkit
from attnkit import AttentionInputError, masks
from oracle import reference_attention
from validation_cases import Case, check_error, param

B, H, L, S, Dk = 2, 2, 5, 7, 4


def qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, L, Dk, generator=g, dtype=torch.float64)
    k = torch.randn(B, H, S, Dk, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, S, Dk, generator=g, dtype=torch.float64)
    return q, k, v


def attend(mask: object, **kw: object) -> torch.Tensor:
    return attnkit.attention(*qkv(), mask=mask, **kw)  # type: ignore[arg-type]


K = f"k (B={B}, Hkv={H}, S={S}, Dk={Dk})"
ids5 = torch.zeros(5, dtype=torch.long)

LENGTH_CASES = [
    param(
        "document-short",
        Case(
            lambda: attend(masks.document(torch.zeros(B, 6, dtype=torch.long))),
            "mask",
            ("the mask spec document(<ids (2, 6)>) is built for 6 keys but k has S=7",),
            ("mask=document(<ids (2, 6)>) (length 6)", K),
            "document ids / key_mask keep with one entry per key: 7",
            "build it from a tensor with one entry per key, S of them",
        ),
    ),
    param(
        "document-per-query",  # one id per query (L) instead of per key (S)
        Case(
            lambda: attend(masks.document(ids5) & masks.causal()),
            "mask",
            ("document(<ids (1, 5)>) & causal() is built for 5 keys but k has S=7",),
            ("(length 5)",),
            "one entry per key: 7",
            f"its tensor has one entry per query (L={L}); it needs one per key",
        ),
    ),
    param(
        "key-mask-long",
        Case(
            lambda: attend(masks.key_mask(torch.ones(B, 9, dtype=torch.bool))),
            "mask",
            ("key_mask(<bool (2, 9)>) is built for 9 keys but k has S=7",),
            ("mask=key_mask(<bool (2, 9)>) (length 9)", K),
            "one entry per key: 7",
            "(with a KV cache, S counts the cached keys too)",
        ),
    ),
    param(
        "inverted-key-mask",
        Case(
            lambda: attend(~masks.key_mask(torch.ones(B, 3, dtype=torch.bool))),
            "mask",
            ("~key_mask(<bool (2, 3)>) is built for 3 keys",),
            ("(length 3)",),
            "one entry per key: 7",
            "one entry per key",
        ),
    ),
    param(
        "to-dense",
        Case(
            lambda: masks.document(ids5).to_dense(5, 7),
            "S",
            ("document(<ids (1, 5)>) is built for 5 keys, not S = 7.",),
            ("spec length 5  L=5  S=7",),
            "S == 5, the length of the spec's tensor",
            "one entry per key",
            where="attnkit.masks.to_dense",
        ),
    ),
    param(
        "combined-lengths",
        Case(
            lambda: masks.document(ids5) & masks.key_mask(torch.ones(1, 7, dtype=torch.bool)),
            "other",
            ("mask specs for different key lengths were combined: [5, 7]",),
            ("document(<ids (1, 5)>) and key_mask(<bool (1, 7)>)",),
            "specs that agree on their key lengths",
            "key lengths must agree",
            where="attnkit.masks.&",
        ),
    ),
]


@pytest.mark.parametrize("case", LENGTH_CASES)
def test_spec_length_must_be_s(case: Case) -> None:
    with pytest.raises(AttentionInputError) as info:
        case.call()
    check_error(info.value, case)


def test_module_checks_spec_length_before_making_it_dense() -> None:
    """A module merges a spec with torch's attn_mask into one tensor first: the length is
    checked there too, not read past the ids."""
    mha = attnkit.MultiHeadAttention(8, 2)
    x = torch.randn(1, 7, 8)
    spec = masks.document(ids5)
    with pytest.raises(AttentionInputError, match="is built for 5 keys but k has S=7"):
        mha(x, mask=spec)
    with pytest.raises(AttentionInputError, match="is built for 5 keys, not S = 7"):
        mha(x, mask=spec, attn_mask=torch.zeros(7, 7))


def test_matching_lengths_are_accepted() -> None:
    ids = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    out = attend(masks.document(ids))
    allowed = (ids[S - L :, None] == ids[None, :])[None, None]  # query i stands at key i + S - L
    assert torch.allclose(out, reference_attention(*qkv(), mask=allowed)[0], atol=1e-12)


PADDING_CASES = [
    param(
        "negative-lengths",
        Case(
            lambda: masks.padding(torch.tensor([3, -1])),
            "lengths",
            ("`lengths` holds negative values [-1]; a length counts real keys.",),
            ("lengths=[3, -1]",),
            "lengths >= 0 (0: none)",
            "lengths.clamp(min=0) if negative meant empty",
            where="attnkit.masks.padding",
        ),
    ),
    param(
        "negative-q-lengths",
        Case(
            lambda: masks.padding(torch.tensor([3, 4]), torch.tensor([-2, 5])),
            "q_lengths",
            ("`q_lengths` holds negative values [-2]; a length counts real queries.",),
            ("q_lengths=[-2, 5]",),
            "q_lengths >= 0",
            "q_lengths.clamp(min=0)",
            where="attnkit.masks.padding",
        ),
    ),
    param(
        "negative-prefix",
        Case(
            lambda: masks.prefix_lm(torch.tensor([-3, 2])),
            "prefix_len",
            ("`prefix_len` holds negative values [-3]",),
            ("prefix_len=[-3, 2]",),
            "prefix_len >= 0 (0: plain causal)",
            "prefix_len.clamp(min=0)",
            where="attnkit.masks.prefix_lm",
        ),
    ),
]


@pytest.mark.parametrize("case", PADDING_CASES)
def test_negative_lengths_are_refused(case: Case) -> None:
    with pytest.raises(AttentionInputError) as info:
        case.call()
    check_error(info.value, case)


def test_lengths_beyond_s_mean_every_key_is_real() -> None:
    """A length past S (or a query length past L) is harmless: all keys (queries) are real."""
    spec = masks.padding(torch.tensor([S + 3, 100]), q_lengths=torch.tensor([L + 1, 50]))
    assert torch.allclose(attend(spec), attend(None), atol=1e-12)


def _inf_mask(value: float, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    m = torch.zeros(L, S, dtype=dtype)
    m[1, 2] = value
    m[3, 0] = -math.inf  # allowed: -inf blocks
    return m


def _both() -> torch.Tensor:
    m = torch.full((L, S), math.inf, dtype=torch.float64).tril()  # 15 +inf, 0 elsewhere
    m[0, S - 1] = math.nan
    return m


MASK = f"mask (L={L}, S={S})"
INF_FIX = "mask.masked_fill(mask == float('inf'), float('-inf')) if +inf meant blocked"

VALUE_CASES = [
    param(
        "plus-inf",
        Case(
            lambda: attend(_inf_mask(math.inf)),
            "mask",
            ("the float `mask` holds 1 +inf: those are not mask values", "whole query row NaN"),
            (f"{MASK} dtype=torch.float64: 1 +inf",),
            "0 where a key is allowed, -inf where it is blocked",
            INF_FIX,
        ),
    ),
    param(
        "nan",
        Case(
            lambda: attend(_inf_mask(math.nan)),
            "mask",
            ("the float `mask` holds 1 NaN",),
            (f"{MASK} dtype=torch.float64: 1 NaN",),
            "-inf where it is blocked",
            "mask.nan_to_num(nan=0.0) if NaN meant allowed",
        ),
    ),
    param(
        "both-with-causal",
        Case(
            lambda: attend(_both(), causal=True),  # checked before causal blocks the NaN
            "mask",
            ("holds 15 +inf and 1 NaN",),
            ("dtype=torch.float64: 15 +inf and 1 NaN",),
            "-inf where it is blocked",
            INF_FIX,
        ),
    ),
    param(
        "explain",
        Case(
            lambda: attnkit.explain(*qkv(), mask=_inf_mask(math.inf)),
            "mask",
            ("holds 1 +inf",),
            ("1 +inf",),
            "-inf where it is blocked",
            INF_FIX,
            where="attnkit.explain",
        ),
    ),
    param(
        "module-attn-mask",
        Case(
            lambda: attnkit.MultiHeadAttention(8, 2)(
                torch.randn(1, L, 8), attn_mask=_inf_mask(math.inf, torch.float32)[:, :L]
            ),
            "attn_mask",
            ("the float `attn_mask` holds 1 +inf",),
            (f"attn_mask (2-D: {L}, {L}) dtype=torch.float32: 1 +inf",),
            "-inf where it is blocked",
            "attn_mask.masked_fill(attn_mask == float('inf'), float('-inf'))",
            where="attnkit.MultiHeadAttention",
        ),
    ),
    param(
        "module-key-padding-mask",
        Case(
            lambda: attnkit.CrossAttention(8, 2)(
                torch.randn(1, L, 8),
                torch.randn(1, S, 8),
                key_padding_mask=torch.tensor([[0.0] * (S - 1) + [math.nan]]),
            ),
            "key_padding_mask",
            ("the float `key_padding_mask` holds 1 NaN",),
            (f"key_padding_mask (2-D: 1, {S}) dtype=torch.float32: 1 NaN",),
            "-inf where it is blocked",
            "key_padding_mask.nan_to_num(nan=0.0) if NaN meant allowed",
            where="attnkit.CrossAttention",
        ),
    ),
]


@pytest.mark.parametrize("case", VALUE_CASES)
def test_inf_and_nan_are_not_mask_values(case: Case) -> None:
    with pytest.raises(AttentionInputError) as info:
        case.call()
    check_error(info.value, case)


def test_minus_inf_and_finite_biases_are_mask_values() -> None:
    m = _inf_mask(-2.5)
    out = attend(m)
    assert torch.allclose(out, reference_attention(*qkv(), mask=m)[0], atol=1e-12)


def test_the_value_check_is_skipped_while_compiling(monkeypatch: pytest.MonkeyPatch) -> None:
    """A value check is a data-dependent branch: torch.compile traces without it (as the
    inverted-causal warning), so a compiled model keeps one graph; shapes are still checked."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    out = attend(_inf_mask(math.inf), backend="math")
    assert out[:, :, 1].isnan().all()  # what +inf does: the row is NaN
    assert not out[:, :, 0].isnan().any()
    with pytest.raises(AttentionInputError, match="does not broadcast"):
        attend(torch.zeros(S, L, dtype=torch.float64))


def test_a_key_shard_is_checked_against_the_whole_sequence() -> None:
    """Ring attention validates its shard of the keys against a spec over every shard."""
    from calls import make_call

    q, k, v = qkv()
    whole = masks.document(torch.zeros(2 * S, dtype=torch.long))
    assert make_call(q, k, v, whole, False, None, 0.0, key_shards=2).mask is whole
    with pytest.raises(AttentionInputError) as info:
        make_call(q, k, v, whole, False, None, 0.0, key_shards=3)
    assert info.value.problem == (
        f"the mask spec document(<ids (1, 14)>) is built for 14 keys but k has S=21 "
        f"(3 shards of {S} keys)."
    )
