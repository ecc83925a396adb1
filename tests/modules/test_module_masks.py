"""The modules' mask arguments (attnkit's ``mask``, torch's ``key_padding_mask`` / ``attn_mask`` /
``is_causal``, Hugging Face's ``attention_mask``), their merging, their errors; and the input
dtype check (issue 15, rows 2 and 12).

Dimension legend: B batch, H heads, L query length, S key length, E model width.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import pytest
import torch

import attnkit
from attnkit import AttentionInputError, CrossAttention, MultiHeadAttention, SelfAttention, masks
from attnkit.modules import TransformerConfig, TransformerLayer
from attnkit.modules.masking import combine

F64 = torch.float64
TOL64 = {"rtol": 0.0, "atol": 1e-10}
B, H, L, S, E = 2, 4, 3, 5, 8
MHA = "attnkit.MultiHeadAttention"


def _mha(**kw: Any) -> MultiHeadAttention:
    torch.manual_seed(0)
    return MultiHeadAttention(E, H, dtype=F64, **kw)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, L, E, generator=g, dtype=F64), torch.randn(
        B, S, E, generator=g, dtype=F64
    )


# --------------------------------------------------------------------------- torch's attn_mask


def test_attn_mask_is_torchs_inverse_of_mask() -> None:
    """bool attn_mask True = not allowed; (L, S) and (B * H, L, S) with row b * H + h."""
    mod = _mha()
    query, memory = _inputs()
    g = torch.Generator().manual_seed(2)
    blocked = torch.rand(L, S, generator=g) < 0.4
    blocked[:, 0] = False
    ref = mod(query, memory, mask=~blocked, need_weights=True)
    got = mod(query, memory, attn_mask=blocked, need_weights=True)
    torch.testing.assert_close(got.output, ref.output, **TOL64)
    torch.testing.assert_close(got.weights, ref.weights, **TOL64)
    blocked3 = torch.rand(B, H, L, S, generator=g) < 0.4
    blocked3[..., 0] = False
    ref = mod(query, memory, mask=~blocked3, need_weights=True)
    got = mod(query, memory, attn_mask=blocked3.reshape(B * H, L, S), need_weights=True)
    torch.testing.assert_close(got.output, ref.output, **TOL64)
    torch.testing.assert_close(got.weights, ref.weights, **TOL64)
    bias = torch.randn(L, S, generator=g, dtype=F64)
    torch.testing.assert_close(
        mod(query, memory, attn_mask=bias).output, mod(query, memory, mask=bias).output, **TOL64
    )


def test_every_mask_given_must_allow() -> None:
    """mask, attn_mask and the key mask together: a key is attended where all three allow it."""
    mod = _mha()
    query, memory = _inputs()
    mask = torch.ones(L, S, dtype=torch.bool)
    mask[:, 1] = False  # attnkit: key 1 blocked
    attn_mask = torch.zeros(L, S, dtype=torch.bool)
    attn_mask[:, 2] = True  # torch: key 2 blocked
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[1, 3] = True  # torch: key 3 of batch row 1 is padding
    res = mod(
        query, memory, mask=mask, attn_mask=attn_mask, key_padding_mask=kpm, need_weights=True
    )
    allowed = mask & ~attn_mask & ~kpm[:, None, None, :]  # (B, 1, L, S)
    ref = mod(query, memory, mask=allowed, need_weights=True)
    torch.testing.assert_close(res.output, ref.output, **TOL64)
    assert res.weights is not None
    assert bool((res.weights.masked_select(~allowed) == 0).all())
    assert bool((res.weights[0, :, :, 3] > 0).all())


def test_is_causal_applies_the_attn_mask_it_comes_with() -> None:
    mod = _mha()
    query, _ = _inputs()
    causal = torch.ones(L, L, dtype=torch.bool).triu(1)  # torch: True = not allowed
    got = mod(query, attn_mask=causal, is_causal=True).output
    torch.testing.assert_close(got, mod(query, mask=~causal).output, **TOL64)
    torch.testing.assert_close(got, _mha(causal=True)(query).output, **TOL64)


def test_average_attn_weights_averages_over_heads() -> None:
    mod = _mha()
    query, memory = _inputs()
    per_head = mod(query, memory, need_weights=True).weights
    mean = mod(query, memory, need_weights=True, average_attn_weights=True).weights
    assert per_head is not None
    assert mean is not None
    assert per_head.shape == (B, H, L, S)
    assert mean.shape == (B, L, S)
    torch.testing.assert_close(mean, per_head.mean(dim=1), **TOL64)
    assert mod(query, memory, average_attn_weights=True).weights is None


def test_all_three_modules_take_the_same_mask_keywords() -> None:
    torch.manual_seed(3)
    x = torch.randn(B, S, E, dtype=F64)
    kpm = torch.tensor([[False] * S, [False] * 3 + [True] * 2])
    attn = torch.zeros(S, S, dtype=torch.bool)
    attn[:, 1] = True
    allowed = ~attn & ~kpm[:, None, None, :]
    for mod, args in (
        (SelfAttention(E, 4, dtype=F64), (x,)),
        (CrossAttention(E, 2, dtype=F64), (x, x)),
    ):
        ref = mod(*args, mask=allowed, need_weights=True)
        got = mod(*args, key_padding_mask=kpm, attn_mask=attn, need_weights=True)
        torch.testing.assert_close(got.output, ref.output, **TOL64)
        twin = mod(*args, attention_mask=~kpm, attn_mask=attn, need_weights=True)
        torch.testing.assert_close(twin.output, ref.output, **TOL64)
        mean = mod(*args, mask=allowed, need_weights=True, average_attn_weights=True).weights
        assert ref.weights is not None
        torch.testing.assert_close(mean, ref.weights.mean(dim=1), **TOL64)


# --------------------------------------------------------------------------- merging


def test_a_key_mask_joins_a_spec_as_a_spec() -> None:
    """With a mask spec, the key mask stays a spec (a backend may skip its empty blocks)."""
    keep = torch.tensor([[True, True, False], [True, False, False]])
    merged = combine(masks.causal(), keep[:, None, None, :], 3, 3, torch.float32)
    assert isinstance(merged, masks.MaskSpec)
    assert torch.equal(merged.to_dense(3, 3), masks.causal_mask(3, 3) & keep[:, None, None, :])
    mod = _mha()
    query, _ = _inputs()
    via_spec = mod(
        query,
        mask=masks.sliding_window(2),
        key_padding_mask=torch.tensor([[False, True, False], [False] * 3]),
    )
    dense = (
        masks.sliding_window(2).to_dense(L, L)
        & torch.tensor([[True, False, True], [True] * 3])[:, None, None, :]
    )
    torch.testing.assert_close(via_spec.output, mod(query, mask=dense).output, **TOL64)


def test_combine_follows_torch_for_mixed_kinds() -> None:
    bias = torch.tensor([[0.5, -1.0, 2.0]])
    other = torch.tensor([[1.0, 1.0, 1.0]])
    allowed = torch.tensor([[True, False, True]])
    assert torch.equal(combine(bias, other, 1, 3, torch.float32), bias + other)  # floats add
    assert torch.equal(
        combine(bias, allowed, 1, 3, torch.float32), torch.tensor([[0.5, float("-inf"), 2.0]])
    )
    assert torch.equal(combine(allowed, ~allowed, 1, 3, torch.float32), torch.zeros(1, 3).bool())
    ints = torch.ones(1, 3, dtype=torch.int32)
    assert combine(ints, allowed, 1, 3, torch.float32) is ints  # left to attention to refuse
    assert combine(None, None, 1, 3, torch.float32) is None


def test_an_integer_mask_with_a_key_mask_gets_attentions_message() -> None:
    with pytest.raises(AttentionInputError, match="integer masks are ambiguous"):
        _mha()(
            _inputs()[0],
            mask=torch.ones(L, L, dtype=torch.int32),
            attention_mask=torch.ones(B, L, dtype=torch.bool),
        )


# --------------------------------------------------------------------------- issue 15, row 2


def test_issue15_row2_transformer_layer_with_a_batch_row_all_padding() -> None:
    """A row of padding only (torch's key_padding_mask) changes nothing in the other rows."""
    torch.manual_seed(4)
    layer = TransformerLayer(TransformerConfig(dim=E, num_heads=2, norm_first=True)).double()
    x = torch.randn(3, 5, E, dtype=F64)
    kpm = torch.tensor([[False] * 3 + [True] * 2, [True] * 5, [False] * 5])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = layer(x, key_padding_mask=kpm, need_weights=True)
        alone = [
            layer(x[b : b + 1], key_padding_mask=kpm[b : b + 1], need_weights=True) for b in (0, 2)
        ]
    for b, one in zip((0, 2), alone, strict=True):
        torch.testing.assert_close(out.hidden[b], one.hidden[0], **TOL64)
        torch.testing.assert_close(out.weights[b], one.weights[0], **TOL64)
    assert bool(out.hidden.isfinite().all())
    assert bool((out.weights[1] == 0).all())
    # the padded keys of row 0 get no weight, its real ones do
    assert bool((out.weights[0, ..., 3:] == 0).all())
    assert bool((out.weights[0, ..., :3] > 0).all())
    assert [w.category for w in caught] == [attnkit.AttentionMaskWarning]
    assert "batch rows [1] with no key" in str(caught[0].message)


def test_issue15_row2_transformer_layer_against_torchs_encoder_layer() -> None:
    """The same layer in torch, called with the same key_padding_mask: the rows with real keys
    agree; the row that is all padding is finite in attnkit (0 attention output)."""
    torch.manual_seed(5)
    t = torch.nn.TransformerEncoderLayer(E, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
    config = TransformerConfig(dim=E, num_heads=2, ffn_dim=16, activation="relu")
    ours = TransformerLayer(config)
    ours.attn.load_state_dict(MultiHeadAttention.from_torch(t.self_attn).state_dict())
    ours.mlp.fc_in.load_state_dict(t.linear1.state_dict())
    ours.mlp.fc_out.load_state_dict(t.linear2.state_dict())
    ours.attn_norm.load_state_dict(t.norm1.state_dict())
    ours.mlp_norm.load_state_dict(t.norm2.state_dict())
    x = torch.randn(3, 5, E)
    kpm = torch.tensor([[False] * 3 + [True] * 2, [True] * 5, [False] * 5])  # torch's meaning
    ref = t(x, src_key_padding_mask=kpm)  # training mode: torch's plain path, every row
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = ours(x, key_padding_mask=kpm).hidden
    torch.testing.assert_close(got[[0, 2]], ref[[0, 2]], rtol=1e-5, atol=1e-5)
    assert bool(got[1].isfinite().all())
    assert [w.category for w in caught] == [attnkit.AttentionMaskWarning]


# --------------------------------------------------------------------------- issue 15, row 12


@pytest.mark.parametrize(
    ("dtype", "fix"),
    [
        (torch.float64, "query.to(torch.float32), or module.to(torch.float64)"),
        (torch.int64, "token ids go through an nn.Embedding first"),
        (torch.float16, "query.to(torch.float32)"),
    ],
)
def test_issue15_row12_input_of_another_dtype_is_named(dtype: torch.dtype, fix: str) -> None:
    """A float32 module called with float64 or int input: attnkit's error naming both dtypes."""
    mha = MultiHeadAttention(E, H)
    x = torch.ones(B, L, E).to(dtype)
    with pytest.raises(AttentionInputError) as info:
        mha(x)
    e = info.value
    assert e.argument == "query"
    assert e.problem == (
        f"`query` has dtype {dtype} but the module's parameters are torch.float32; attnkit "
        "never casts silently."
    )
    assert f"query (B={B}, L={L}, E={E}) dtype={dtype}" in e.got
    assert "parameters: dtype=torch.float32" in e.got
    assert e.expected == "query of dtype torch.float32"
    assert e.fix is not None
    assert fix in e.fix


def test_issue15_row12_every_input_and_every_module() -> None:
    x32 = torch.randn(B, L, E)
    with pytest.raises(AttentionInputError, match=r"`key` has dtype torch\.float64") as info:
        MultiHeadAttention(E, H)(x32, x32.double(), x32)
    assert "dtype=torch.float64" in info.value.got
    with pytest.raises(AttentionInputError, match=r"`value` has dtype torch\.float64"):
        MultiHeadAttention(E, H)(x32, x32, x32.double())
    with pytest.raises(AttentionInputError, match=r"`key` has dtype torch\.int32"):
        CrossAttention(E, H)(x32, x32.int())
    with pytest.raises(AttentionInputError, match=r"`query` has dtype torch\.float64"):
        SelfAttention(E, 4)(x32.double())
    with pytest.raises(AttentionInputError, match=r"`query` has dtype torch\.float64") as info:
        TransformerLayer(TransformerConfig(dim=E, num_heads=2))(x32.double())
    assert info.value.where == MHA
    m = torch.nn.MultiheadAttention(E, H)
    with pytest.raises(AttentionInputError, match=r"torch\.float32") as info:
        MultiHeadAttention.from_torch(m)(x32.double(), x32.double(), x32.double())
    assert "dtype=torch.float64" in info.value.got
    assert info.value.where == "attnkit.interop.TorchMultiheadAttention"


def test_autocast_may_feed_another_float_dtype() -> None:
    """Under autocast the projections cast; a bfloat16 input is what autocast is for."""
    mha = MultiHeadAttention(E, H)
    x = torch.randn(B, L, E)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mha(x.bfloat16()).output
    assert out.dtype == torch.bfloat16
    assert bool(out.isfinite().all())
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(AttentionInputError):
        mha(x.long())  # token ids are refused under autocast too


# --------------------------------------------------------------------------- bad mask arguments


def _err(call: Any) -> AttentionInputError:
    with pytest.raises(AttentionInputError) as info:
        call()
    assert info.value.where == MHA
    return info.value


def test_both_key_masks_are_refused() -> None:
    query, _ = _inputs()
    e = _err(
        lambda: _mha()(
            query,
            key_padding_mask=torch.zeros(B, L, dtype=torch.bool),
            attention_mask=torch.ones(B, L, dtype=torch.bool),
        )
    )
    assert e.argument == "attention_mask"
    assert "two forms of the same key mask; give one" in e.problem
    assert e.got == "key_padding_mask and attention_mask both given"
    assert "True = padding, as in torch" in e.expected
    assert "True/1 = a real key, as in Hugging Face" in e.expected
    assert e.fix == "drop one; key_padding_mask == ~attention_mask.bool()"


@pytest.mark.parametrize(
    ("value", "shown"), [(2, "[2]"), (-1, "[-1]"), (7, "[7]")], ids=["two", "minus-one", "ids"]
)
def test_attention_mask_other_ints_are_refused(value: int, shown: str) -> None:
    query, _ = _inputs()
    am = torch.ones(B, L, dtype=torch.long)
    am[1, 2] = value
    e = _err(lambda: _mha()(query, attention_mask=am))
    assert e.argument == "attention_mask"
    assert e.problem == f"`attention_mask` holds values other than 0 and 1: {shown}."
    assert f"attention_mask (B={B}, S={L}) dtype=torch.int64, values {shown}" == e.got
    assert e.expected == "0 (padding) or 1 (a real key), as in Hugging Face"
    assert e.fix is not None
    assert "ids != pad_id" in e.fix


def test_float_attention_mask_is_refused() -> None:
    query, _ = _inputs()
    e = _err(lambda: _mha()(query, attention_mask=torch.ones(B, L)))
    assert e.argument == "attention_mask"
    assert "`attention_mask` has dtype torch.float32" in e.problem
    assert e.expected == "bool or int (B, S), True/1 = a real key"
    assert e.fix is not None
    assert "attention_mask.bool()" in e.fix
    assert "attn_mask=" in e.fix


@pytest.mark.parametrize("name", ["key_padding_mask", "attention_mask"])
@pytest.mark.parametrize(
    ("shape", "fix"),
    [
        ((S, B), "it looks transposed: use {name}.T"),
        ((B, S + 1), "build it as (batch, key length)"),
        ((B, 1, 1, S), "build it as (batch, key length)"),
    ],
)
def test_key_mask_of_the_wrong_shape(name: str, shape: tuple[int, ...], fix: str) -> None:
    query, memory = _inputs()
    t = torch.zeros(shape, dtype=torch.bool) if name == "key_padding_mask" else torch.ones(shape)
    t = t.bool()
    e = _err(lambda: _mha()(query, memory, **{name: t}))
    assert e.argument == name
    assert e.problem == f"`{name}` does not match (B, S)."
    assert e.got.endswith(f"target (B={B}, S={S})")
    meaning = "True = padding" if name == "key_padding_mask" else "True/1 = a real key"
    assert e.expected == f"{name} (B, S), {meaning}"
    assert e.fix == fix.format(name=name)


@pytest.mark.parametrize(
    ("shape", "fix"),
    [
        ((S, L), "it looks transposed: use attn_mask.T"),
        ((B, L, S), "torch wants one mask per head: attn_mask.repeat_interleave(num_heads, dim=0)"),
        ((B, H, L, S), "attn_mask.flatten(0, 1), or mask=~attn_mask (attnkit's (B, H, L, S))"),
        ((L, S + 1), "build it as (L, S), or (B * num_heads, L, S) with row b * num_heads + h"),
    ],
    ids=["transposed", "per-batch", "4-d", "wrong-S"],
)
def test_attn_mask_of_the_wrong_shape(shape: tuple[int, ...], fix: str) -> None:
    query, memory = _inputs()
    e = _err(lambda: _mha()(query, memory, attn_mask=torch.zeros(shape, dtype=torch.bool)))
    assert e.argument == "attn_mask"
    assert e.problem == "`attn_mask` has neither of the shapes nn.MultiheadAttention takes."
    assert e.got.endswith(f"target (B={B}, H={H}, L={L}, S={S})")
    assert e.expected == f"attn_mask (L={L}, S={S}) or (B*H={B * H}, L={L}, S={S})"
    assert e.fix == fix


@pytest.mark.parametrize(
    ("kwargs", "argument", "problem", "fix"),
    [
        (
            {"attn_mask": torch.zeros(L, S, dtype=torch.int64)},
            "attn_mask",
            "`attn_mask` has dtype torch.int64; as in nn.MultiheadAttention it is bool",
            "attn_mask.bool() if 1 means blocked",
        ),
        (
            {"attn_mask": torch.zeros(L, S, dtype=torch.float32)},
            "attn_mask",
            "float `attn_mask` has dtype torch.float32 but the query has torch.float64",
            "attn_mask.to(torch.float64)",
        ),
        (
            {"is_causal": True},
            "is_causal",
            "`is_causal=True` is torch's hint that `attn_mask` is causal; it needs the attn_mask",
            "generate_square_subsequent_mask(L)",
        ),
        (
            {"is_causal": 1},
            "is_causal",
            "`is_causal` must be a bool.",
            None,
        ),
        (
            {"key_padding_mask": [[False] * S] * B},
            "key_padding_mask",
            "`key_padding_mask` must be a tensor, got list.",
            None,
        ),
        (
            {"attn_mask": [[False] * S] * L},
            "attn_mask",
            "`attn_mask` must be a tensor, got list.",
            None,
        ),
    ],
    ids=["attn-int", "attn-float32", "is-causal-alone", "is-causal-int", "kpm-list", "attn-list"],
)
def test_bad_torch_mask_arguments(
    kwargs: dict[str, Any], argument: str, problem: str, fix: str | None
) -> None:
    query, memory = _inputs()
    e = _err(lambda: _mha()(query, memory, **kwargs))
    assert e.argument == argument
    assert problem in e.problem
    if fix is None:
        assert e.fix is None
    else:
        assert e.fix is not None
        assert fix in e.fix


def test_torch_masks_are_refused_with_a_kv_cache() -> None:
    mha = MultiHeadAttention(16, 2, causal=True)
    cache = attnkit.KVCache(1, 2, max_len=4, head_dim=8)
    x = torch.randn(1, 3, 16)
    for kwargs in (
        {"attn_mask": torch.zeros(3, 3, dtype=torch.bool)},
        {"attn_mask": torch.zeros(3, 3, dtype=torch.bool), "is_causal": True},
    ):
        with pytest.raises(AttentionInputError, match=re.escape("`attn_mask` is not taken")):
            mha(x, kv_cache=cache, **kwargs)
    assert cache.next_pos() == 0  # refused before anything was written
