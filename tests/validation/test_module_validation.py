"""Input validation of the modules (MultiHeadAttention, CrossAttention, ...): every bad input
raises AttentionInputError with a message that helps, and the mask warnings reach the caller.

The cases are rows of the same table as tests/validation/test_validate.py
(``validation_cases.Case``), read the same way. Dimension legend: B batch, L query length,
S key length, E model width.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from attnkit import (
    AttentionInputError,
    AttentionMaskWarning,
    CrossAttention,
    KVCache,
    MultiHeadAttention,
)
from attnkit.modules.transformer import TransformerConfig, TransformerLayer, TransformerStack
from validation_cases import B, Case, L, S, check_error, param, r

MHA = "attnkit.MultiHeadAttention"
E = 16


def mha(**kw: Any) -> MultiHeadAttention:
    return MultiHeadAttention(E, 4, **kw)


def _kpm(*shape: int) -> torch.Tensor:
    return torch.zeros(*shape, dtype=torch.bool)  # torch's meaning: no key is padding


MODULE_CASES = [
    param(
        "embed-dim-not-divisible",
        Case(
            lambda: MultiHeadAttention(10, 3),
            "embed_dim",
            ("embed_dim=10 is not divisible by num_heads=3",),
            ("embed_dim=10", "num_heads=3"),
            "embed_dim % num_heads == 0",
            "choose num_heads from [1, 2, 5, 10], or pass head_dim=",
            where=MHA,
        ),
    ),
    param(
        "kv-heads-not-dividing",
        Case(
            lambda: MultiHeadAttention(E, 4, num_kv_heads=3),
            "num_kv_heads",
            ("num_kv_heads=3 does not divide num_heads=4",),
            ("num_heads=4", "num_kv_heads=3"),
            "num_heads % num_kv_heads == 0",
            "num_kv_heads=1 is multi-query",
            where=MHA,
        ),
    ),
    param(
        "num-heads-zero",
        Case(
            lambda: MultiHeadAttention(E, 0),
            "num_heads",
            ("`num_heads` must be a positive int, got 0",),
            ("num_heads=0",),
            "an int >= 1",
            None,
            where=MHA,
        ),
    ),
    param(
        "kv-cache-max-len-zero",
        Case(
            lambda: KVCache(B, 2, max_len=0, head_dim=4),
            "max_len",
            ("`max_len` must be a positive int, got 0",),
            ("max_len=0",),
            "an int >= 1",
            None,
            where="attnkit.KVCache",
        ),
    ),
    param(
        "transformer-config-ffn-dim-zero",
        Case(
            lambda: TransformerConfig(dim=E, num_heads=4, ffn_dim=0),
            "ffn_dim",
            ("`ffn_dim` must be a positive int, got 0",),
            ("ffn_dim=0",),
            "an int >= 1",
            None,
            where="attnkit.TransformerConfig",
        ),
    ),
    param(
        "transformer-stack-num-layers-negative",
        Case(
            lambda: TransformerStack(TransformerConfig(dim=E, num_heads=4), num_layers=-1),
            "num_layers",
            ("`num_layers` must be an int >= 0, got -1",),
            ("num_layers=-1",),
            "an int >= 0",
            None,
            where="attnkit.TransformerStack",
        ),
    ),
    param(
        "embed-dim-float",
        Case(
            lambda: MultiHeadAttention(16.0, 4),  # type: ignore[arg-type]
            "embed_dim",
            ("`embed_dim` must be a positive int, got 16.0",),
            ("embed_dim=16.0",),
            "an int >= 1",
            None,
            where=MHA,
        ),
    ),
    param(
        "dropout-one",
        Case(
            lambda: mha(dropout=1.0),
            "dropout",
            ("`dropout` must be in [0, 1), got 1.0",),
            ("dropout=1.0",),
            "0 <= dropout < 1",
            "dropout=0.0 turns it off",
            where=MHA,
        ),
    ),
    param(
        "dropout-negative",
        Case(
            lambda: mha(dropout=-0.1),
            "dropout",
            ("got -0.1",),
            ("dropout=-0.1",),
            "0 <= dropout < 1",
            "dropout=0.0 turns it off",
            where=MHA,
        ),
    ),
    param(
        "query-width",
        Case(
            lambda: mha()(r(B, L, 12)),
            "query",
            ("`query` has width 12 but the module expects embed_dim=16",),
            (f"query (B={B}, L={L}, E=12)",),
            "query.shape[-1] == embed_dim == 16",
            "build the module with embed_dim=12",
            where=MHA,
        ),
    ),
    param(
        "key-width-kdim",
        Case(
            lambda: mha(kdim=8, vdim=12)(r(B, L, E), r(B, S, 10), r(B, S, 12)),
            "key",
            ("`key` has width 10 but the module expects kdim=8",),
            (f"key (B={B}, S={S}, E=10)",),
            "key.shape[-1] == kdim == 8",
            "build the module with kdim=10",
            where=MHA,
        ),
    ),
    param(
        "value-width-vdim",
        Case(
            lambda: mha(kdim=8, vdim=12)(r(B, L, E), r(B, S, 8), r(B, S, 10)),
            "value",
            ("`value` has width 10 but the module expects vdim=12",),
            (f"value (B={B}, S={S}, E=10)",),
            "value.shape[-1] == vdim == 12",
            "build the module with vdim=10",
            where=MHA,
        ),
    ),
    param(
        "query-2d",
        Case(
            lambda: mha()(r(L, E)),
            "query",
            ("`query` is 2-D; it must be 3-D (B, L, E)",),
            (f"query (2-D: {L}, {E})",),
            f"query (B, L, E) with E={E}",
            "add a batch dim with x.unsqueeze(0)",
            where=MHA,
        ),
    ),
    param(
        "query-4d",
        Case(
            lambda: mha()(r(B, 4, L, 4)),
            "query",
            ("it must be 3-D",),
            (f"query (4-D: {B}, 4, {L}, 4)",),
            "query (B, L, E)",
            "attnkit.attention(q, k, v)",
            where=MHA,
        ),
    ),
    param(
        "query-not-tensor",
        Case(
            lambda: mha()("hello"),
            "query",
            ("`query` is a str; it must be a 3-D (B, L, E) tensor",),
            ("str",),
            "query (B, L, E)",
            "attnkit.attention",
            where=MHA,
        ),
    ),
    param(
        "seq-first-to-batch-first",
        # nn.MultiheadAttention's layout: query (L, B, E), key (S, B, E) with L != S.
        Case(
            lambda: mha()(r(L, B, E), r(S, B, E)),
            "key",
            ("disagree on batch or key length",),
            (f"query (B={L}, L={B}, E={E})", f"key (B={S}, S={B}, E={E})"),
            "the same B in all three",
            "these look like (seq, batch, embed) tensors: pass batch_first=False",
            where=MHA,
        ),
    ),
    param(
        "batch-first-to-seq-first",
        # batch-first tensors given to a batch_first=False module: the shapes as passed
        Case(
            lambda: mha(batch_first=False)(r(B, L, E), r(B, S, E)),
            "key",
            ("disagree on batch or key length",),
            (f"query (L={B}, B={L}, E={E})", f"key (S={B}, B={S}, E={E})"),
            "the same B in all three",
            "these look like (batch, seq, embed) tensors, and this module was built with "
            "batch_first=False: build it with batch_first=True, or pass x.transpose(0, 1)",
            where=MHA,
        ),
    ),
    param(
        "key-value-length",
        Case(
            lambda: mha()(r(B, L, E), r(B, S, E), r(B, S + 1, E)),
            "value",
            ("disagree on batch or key length",),
            (f"key (B={B}, S={S}, E={E})", f"value (B={B}, S={S + 1}, E={E})"),
            "the same S in key and value",
            "key and value must come from the same sequence",
            where=MHA,
        ),
    ),
    param(
        "kpm-with-seq-first-input",
        # x is (S, B, E) but the key_padding_mask is the real (B, S).
        Case(
            lambda: mha()(r(S, B, E), key_padding_mask=_kpm(B, S)),
            "key_padding_mask",
            ("`key_padding_mask` does not match (B, S)",),
            (f"key_padding_mask (B={B}, S={S})", f"target (B={S}, S={B})"),
            "key_padding_mask (B, S), True = padding",
            "it looks transposed: use key_padding_mask.T; or, if the inputs are (seq, batch, "
            "embed), pass batch_first=False or x.transpose(0, 1)",
            where=MHA,
        ),
    ),
    param(
        "kpm-transposed-self-attention",
        # L == S: a (S, B) mask with batch-first inputs is the mask transposed, or the inputs
        # are (seq, batch, embed); the fix names both, the mask's transpose first
        Case(
            lambda: mha()(r(B, S, E), key_padding_mask=_kpm(S, B)),
            "key_padding_mask",
            ("`key_padding_mask` does not match (B, S)",),
            (f"key_padding_mask (B={S}, S={B})", f"target (B={B}, S={S})"),
            "key_padding_mask (B, S), True = padding",
            "it looks transposed: use key_padding_mask.T; or, if the inputs are (seq, batch, "
            "embed), pass batch_first=False or x.transpose(0, 1)",
            where=MHA,
        ),
    ),
    param(
        "attention-mask-transposed-in-a-transformer-layer",
        Case(
            lambda: TransformerLayer(TransformerConfig(dim=E, num_heads=4))(
                r(B, S, E), attention_mask=torch.ones(S, B, dtype=torch.long)
            ),
            "attention_mask",
            ("`attention_mask` does not match (B, S)",),
            (f"attention_mask (B={S}, S={B})", f"target (B={B}, S={S})"),
            "attention_mask (B, S), True/1 = a real key",
            "it looks transposed: use attention_mask.T; or, if the inputs",
            where=MHA,
        ),
    ),
    param(
        "kpm-of-the-query-length-in-cross-attention",
        # (L, B) is not a transposed (B, S) here (L != S), nor a sign of (seq, batch, embed)
        # inputs (those fail the batch check first when L != S)
        Case(
            lambda: CrossAttention(E, 4)(r(B, L, E), r(B, S, E), key_padding_mask=_kpm(L, B)),
            "key_padding_mask",
            ("does not match (B, S)",),
            (f"key_padding_mask (B={L}, S={B})", f"target (B={B}, S={S})"),
            "key_padding_mask (B, S)",
            "build it as (batch, key length)",
            where="attnkit.CrossAttention",
        ),
    ),
    param(
        "kpm-transposed",
        Case(
            lambda: CrossAttention(E, 4)(r(B, L, E), r(B, S, E), key_padding_mask=_kpm(S, B)),
            "key_padding_mask",
            ("does not match (B, S)",),
            (f"key_padding_mask (B={S}, S={B})", f"target (B={B}, S={S})"),
            "key_padding_mask (B, S)",
            "it looks transposed: use key_padding_mask.T",
            where="attnkit.CrossAttention",
        ),
    ),
    param(
        "kpm-wrong-shape",
        Case(
            lambda: mha()(r(B, S, E), key_padding_mask=_kpm(B, S + 1)),
            "key_padding_mask",
            ("does not match (B, S)",),
            (f"key_padding_mask (B={B}, S={S + 1})", f"target (B={B}, S={S})"),
            "key_padding_mask (B, S)",
            "build it as (batch, key length)",
            where=MHA,
        ),
    ),
    param(
        "kpm-float-of-another-dtype",
        # a float key_padding_mask is added to the scores, as torch adds it: of q's dtype
        Case(
            lambda: mha()(r(B, S, E), key_padding_mask=torch.zeros(B, S, dtype=torch.float64)),
            "key_padding_mask",
            ("float `key_padding_mask` has dtype torch.float64 but the query has torch.float32",),
            ("key_padding_mask.dtype=torch.float64", "query.dtype=torch.float32"),
            "a float key_padding_mask of dtype torch.float32, or a bool one",
            "key_padding_mask.to(torch.float32)",
            where=MHA,
        ),
    ),
    param(
        "kpm-int",
        Case(
            lambda: mha()(r(B, S, E), key_padding_mask=torch.ones(B, S, dtype=torch.long)),
            "key_padding_mask",
            ("`key_padding_mask` has dtype torch.int64", "bool (True = padding) or float"),
            (f"key_padding_mask (B={B}, S={S}) dtype=torch.int64",),
            "bool (B, S), True = padding; or float (B, S)",
            "0/1 ints with 1 = a real token are attention_mask=...",
            where=MHA,
        ),
    ),
    param(
        "module-mask-integer",
        # a module's mask is checked by attnkit.attention, with attention's message
        Case(
            lambda: mha()(r(B, L, E), mask=torch.ones(L, L, dtype=torch.int32)),
            "mask",
            ("integer masks are ambiguous",),
            (f"mask (L={L}, S={L}) dtype=torch.int32",),
            "a bool mask",
            "mask.bool()",
        ),
    ),
]


@pytest.mark.parametrize("case", MODULE_CASES)
def test_module_bad_input_message(case: Case) -> None:
    with pytest.raises(AttentionInputError) as info:
        case.call()
    check_error(info.value, case)


def test_seq_first_module_accepts_seq_first_input() -> None:
    """The same tensors that fail above are fine with batch_first=False."""
    out = mha(batch_first=False)(r(L, B, E), r(S, B, E)).output
    assert out.shape == (L, B, E)


# ------------------------------------------------------------------------------ warnings


def test_inverted_causal_mask_warns_through_module() -> None:
    with pytest.warns(AttentionMaskWarning, match="inverted causal mask") as record:
        mha()(r(B, L, E), mask=torch.ones(L, L).triu(1).bool())
    assert len(record) == 1
    assert "this mask blocks every token" in str(record[0].message)
    assert "attnkit's convention is True = may attend" in str(record[0].message)


def test_an_inverted_attn_mask_is_named_in_torchs_convention() -> None:
    """attn_mask keeps torch's meaning (True = may not attend): a tril mask there keeps only
    the future, and the warning says so in that convention, once."""
    with pytest.warns(AttentionMaskWarning, match="inverted causal mask") as record:
        mha()(r(B, L, E), attn_mask=torch.ones(L, L).tril().bool())
    assert len(record) == 1
    message = str(record[0].message)
    assert "this attn_mask blocks every token from itself" in message
    assert "attn_mask keeps torch's convention, True = may NOT attend" in message
    assert "ones(L, L).triu(1).bool()" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's own causal attn_mask: no warning
        mha()(r(B, L, E), attn_mask=torch.ones(L, L).triu(1).bool())


def test_key_padding_mask_with_empty_row_warns() -> None:
    """An all-True row is all padding (torch's meaning): perhaps True was meant as a real key."""
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[1] = True
    with pytest.warns(AttentionMaskWarning, match=r"batch rows \[1\] with no key") as record:
        out = mha()(r(B, S, E), key_padding_mask=kpm).output
    message = str(record[0].message)
    assert "True = padding, as in nn.MultiheadAttention" in message
    assert "attention_mask=" in message
    assert not out.isnan().any()  # the empty row gives 0, not NaN


def test_attention_mask_with_empty_row_warns() -> None:
    """An all-0 row of the positive form: perhaps 1 was meant as padding."""
    real = torch.ones(B, S, dtype=torch.long)
    real[0] = 0
    with pytest.warns(AttentionMaskWarning, match=r"batch rows \[0\] with no key") as record:
        mha()(r(B, S, E), attention_mask=real)
    assert "pass it as key_padding_mask=" in str(record[0].message)


def test_key_masks_with_real_keys_do_not_warn() -> None:
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[1, 3:] = True
    with warnings.catch_warnings():
        warnings.simplefilter("error", AttentionMaskWarning)
        mha()(r(B, S, E), key_padding_mask=kpm)
        mha()(r(B, S, E), attention_mask=~kpm)


def test_key_padding_warning_points_at_caller() -> None:
    kpm = torch.ones(B, S, dtype=torch.bool)
    with pytest.warns(AttentionMaskWarning) as record:
        mha()(r(B, S, E), key_padding_mask=kpm)
    assert record[0].filename == __file__
