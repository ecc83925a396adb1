"""The boundary with torch.nn.MultiheadAttention: weights both ways, masks translated, and a
``from_torch`` copy that is called, and answers, as torch's module.

Dimension legend: B batch, H heads, L query length, S key length, E model width.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import attnkit
from attnkit import MultiHeadAttention, masks
from attnkit.interop import TorchMultiheadAttention, mask_from_torch

TOL = {"rtol": 1e-5, "atol": 1e-5}

# torch warns when a bool attn_mask meets a float key_padding_mask (and vice versa)
pytestmark = pytest.mark.filterwarnings("ignore:Support for mismatched:UserWarning")


def _assert_same_parameters(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype, name
        assert torch.equal(sa[name], sb[name]), name


# --------------------------------------------------------------------------- weights


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"bias": False},
        {"kdim": 5, "vdim": 7},
        {"kdim": 5, "vdim": 7, "bias": False},
        {"dropout": 0.25},
    ],
    ids=["default", "no-bias", "kdim-vdim", "kdim-vdim-no-bias", "dropout"],
)
def test_round_trip_is_bit_exact(batch_first: bool, kwargs: dict[str, object]) -> None:
    torch.manual_seed(0)
    m = nn.MultiheadAttention(12, 3, batch_first=batch_first, **kwargs)  # type: ignore[arg-type]
    if m.in_proj_bias is not None:  # torch zero-initialises the biases; make them visible
        with torch.no_grad():
            m.in_proj_bias.normal_()
            m.out_proj.bias.normal_()
    mod = MultiHeadAttention.from_torch(m)
    assert isinstance(mod, MultiHeadAttention)
    assert mod.batch_first is batch_first
    assert (mod.embed_dim, mod.num_heads, mod.kdim, mod.vdim) == (12, 3, m.kdim, m.vdim)
    assert mod.dropout == m.dropout
    # the pieces land in the right projections
    if m._qkv_same_embed_dim:
        wq, wk, wv = m.in_proj_weight.chunk(3)
    else:
        wq, wk, wv = m.q_proj_weight, m.k_proj_weight, m.v_proj_weight
    assert torch.equal(mod.q_proj.weight, wq)
    assert torch.equal(mod.k_proj.weight, wk)
    assert torch.equal(mod.v_proj.weight, wv)
    assert torch.equal(mod.out_proj.weight, m.out_proj.weight)
    if m.in_proj_bias is None:
        assert mod.q_proj.bias is None
        assert mod.out_proj.bias is None
    else:
        bq, bk, bv = m.in_proj_bias.chunk(3)
        assert torch.equal(mod.q_proj.bias, bq)
        assert torch.equal(mod.k_proj.bias, bk)
        assert torch.equal(mod.v_proj.bias, bv)
        assert torch.equal(mod.out_proj.bias, m.out_proj.bias)
    back = mod.to_torch()
    assert isinstance(back, nn.MultiheadAttention)
    assert back.batch_first is batch_first
    assert back.dropout == m.dropout
    assert back._qkv_same_embed_dim == m._qkv_same_embed_dim
    _assert_same_parameters(back, m)
    # and attnkit -> torch -> attnkit
    _assert_same_parameters(MultiHeadAttention.from_torch(back), mod)


def test_float64_is_preserved() -> None:
    torch.manual_seed(1)
    m = nn.MultiheadAttention(8, 2, kdim=3, vdim=4, dtype=torch.float64)
    mod = MultiHeadAttention.from_torch(m)
    assert all(p.dtype == torch.float64 for p in mod.parameters())
    back = mod.to_torch()
    assert all(p.dtype == torch.float64 for p in back.parameters())
    _assert_same_parameters(back, m)
    query = torch.randn(2, 3, 8, dtype=torch.float64).transpose(0, 1)  # (L, B, E)
    key = torch.randn(2, 5, 3, dtype=torch.float64).transpose(0, 1)
    value = torch.randn(2, 5, 4, dtype=torch.float64).transpose(0, 1)
    expected, _ = m(query, key, value)
    torch.testing.assert_close(mod(query, key, value).output, expected, rtol=1e-12, atol=1e-12)


def test_from_torch_passes_backend() -> None:
    mod = MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2), backend="math")
    assert mod.backend == "math"


def test_from_torch_refuses_bias_kv_and_zero_attn() -> None:
    with pytest.raises(attnkit.AttentionInputError, match="add_bias_kv") as info:
        MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2, add_bias_kv=True))
    assert info.value.argument == "m"
    assert "add_bias_kv=True" in info.value.got
    with pytest.raises(attnkit.AttentionInputError, match="add_zero_attn=True"):
        MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2, add_zero_attn=True))
    with pytest.raises(attnkit.AttentionInputError, match=r"not an nn\.MultiheadAttention"):
        MultiHeadAttention.from_torch(nn.Linear(8, 8))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"num_kv_heads": 2}, "num_kv_heads=2 != num_heads=4"),
        ({"num_kv_heads": 1}, "num_kv_heads=1 != num_heads=4"),
        ({"causal": True}, "causal=True"),
        ({"head_dim": 3}, "head_dim=3"),
        ({"v_head_dim": 5}, "v_head_dim=5"),
        ({"output_projection": False}, "no output projection"),
    ],
)
def test_to_torch_refuses_what_torch_cannot_express(kwargs: dict[str, object], why: str) -> None:
    mod = MultiHeadAttention(8, 4, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(attnkit.AttentionInputError, match=r"no nn\.MultiheadAttention equivalent"):
        mod.to_torch()
    with pytest.raises(attnkit.AttentionInputError) as info:
        mod.to_torch()
    assert why in str(info.value)


# --------------------------------------------------------------------------- masks


def test_mask_from_torch_inverts_bool_masks() -> None:
    kpm = torch.tensor([[False, False, True], [False, True, True]])  # torch: True = ignore
    got = mask_from_torch(key_padding_mask=kpm, num_heads=2)
    assert got is not None
    assert got.dtype == torch.bool
    assert got.shape == (2, 1, 1, 3)
    assert torch.equal(got[:, 0, 0], ~kpm)
    attn = torch.tensor([[False, True, True], [False, False, True]])  # (L=2, S=3)
    both = mask_from_torch(attn, kpm, num_heads=2)
    assert both is not None
    assert both.shape == (2, 1, 2, 3)
    assert torch.equal(both, ~attn & ~kpm[:, None, None, :])
    assert mask_from_torch(num_heads=4) is None


def test_mask_from_torch_unfolds_3d_and_mixes_float() -> None:
    B, H, L, S = 2, 3, 2, 4
    attn3 = torch.rand(B * H, L, S) > 0.5
    got = mask_from_torch(attn3, num_heads=H)
    assert got is not None
    assert got.shape == (B, H, L, S)
    for b in range(B):
        for h in range(H):
            assert torch.equal(got[b, h], ~attn3[b * H + h])  # torch's order: b * H + h
    bias = torch.randn(L, S)
    kpm = torch.tensor([[False, False, False, True], [True, False, False, False]])
    mixed = mask_from_torch(bias, kpm, num_heads=H)
    assert mixed is not None
    assert mixed.dtype == torch.float32
    expected = bias + torch.zeros(B, 1, 1, S).masked_fill(kpm[:, None, None, :], float("-inf"))
    assert torch.equal(mixed, expected)
    with pytest.raises(attnkit.AttentionInputError, match="not a multiple of num_heads"):
        mask_from_torch(torch.zeros(5, L, S, dtype=torch.bool), num_heads=2)
    with pytest.raises(attnkit.AttentionInputError, match=r"`attn_mask` is 4-D torch\.bool") as e:
        mask_from_torch(torch.zeros(1, 1, L, S, dtype=torch.bool), num_heads=2)
    assert e.value.got == f"attn_mask (4-D: 1, 1, {L}, {S}) dtype=torch.bool"
    assert e.value.expected == (
        "a bool or float attn_mask (L, S) or (B * num_heads, L, S), as nn.MultiheadAttention"
    )
    assert e.value.fix is None
    with pytest.raises(attnkit.AttentionInputError, match="`key_padding_mask` is 3-D") as e:
        mask_from_torch(key_padding_mask=torch.zeros(2, 1, 3, dtype=torch.bool), num_heads=2)
    assert e.value.argument == "key_padding_mask"
    assert e.value.expected == "a bool or float key_padding_mask (B, S), as nn.MultiheadAttention"


def _torch_masks(kind: str, B: int, H: int, L: int, S: int, g: torch.Generator):
    """torch-convention masks of one kind; key 0 is never blocked, so no row is empty."""
    kpm_bool = torch.rand(B, S, generator=g) < 0.4  # True = ignore
    kpm_bool[:, 0] = False
    attn_bool = torch.rand(L, S, generator=g) < 0.4
    attn_bool[:, 0] = False
    attn3 = torch.rand(B * H, L, S, generator=g) < 0.4
    attn3[..., 0] = False
    attn_float = torch.randn(L, S, generator=g)
    attn_float[:, -1] = float("-inf") if S > 1 else 0.0
    kpm_float = torch.randn(B, S, generator=g)
    return {
        "none": (None, None),
        "kpm-bool": (None, kpm_bool),
        "attn-bool": (attn_bool, None),
        "attn-3d": (attn3, None),
        "attn-float": (attn_float, None),
        "kpm-float": (None, kpm_float),
        "both-bool": (attn_bool, kpm_bool),
        "attn-3d+kpm": (attn3, kpm_bool),
        "attn-float+kpm-bool": (attn_float, kpm_bool),
        "attn-bool+kpm-float": (attn_bool, kpm_float),
    }[kind]


MASK_KINDS = [
    "none",
    "kpm-bool",
    "attn-bool",
    "attn-3d",
    "attn-float",
    "kpm-float",
    "both-bool",
    "attn-3d+kpm",
    "attn-float+kpm-bool",
    "attn-bool+kpm-float",
]


def _torch_pair(E: int, H: int, seed: int, **kwargs: Any) -> tuple[nn.MultiheadAttention, Any]:
    """An ``nn.MultiheadAttention`` with visible biases, and its ``from_torch`` copy."""
    torch.manual_seed(seed)
    m = nn.MultiheadAttention(E, H, **kwargs)
    with torch.no_grad():
        if m.in_proj_bias is not None:
            m.in_proj_bias.normal_()
            m.out_proj.bias.normal_()
    return m, MultiHeadAttention.from_torch(m)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_from_torch_module_is_called_as_torch(batch_first: bool, kind: str) -> None:
    """Every mask kind, passed as to torch; weights averaged or per head, or none."""
    B, H, E, L, S = 2, 3, 12, 4, 5
    m, ours = _torch_pair(E, H, 2, kdim=6, vdim=7, batch_first=batch_first)
    assert isinstance(ours, TorchMultiheadAttention)
    g = torch.Generator().manual_seed(3)
    query = torch.randn(B, L, E, generator=g)
    key = torch.randn(B, S, 6, generator=g)
    value = torch.randn(B, S, 7, generator=g)
    if not batch_first:
        query, key, value = (t.transpose(0, 1) for t in (query, key, value))
    attn_mask, kpm = _torch_masks(kind, B, H, L, S, g)
    for kwargs in (
        {},  # torch's defaults: need_weights=True, averaged over heads
        {"average_attn_weights": False},
        {"need_weights": False},
    ):
        expected, expected_w = m(query, key, value, kpm, attn_mask=attn_mask, **kwargs)
        got, got_w = ours(query, key, value, kpm, attn_mask=attn_mask, **kwargs)
        torch.testing.assert_close(got, expected, **TOL)
        if expected_w is None:
            assert got_w is None
        else:
            assert got_w is not None
            assert got_w.shape == expected_w.shape  # (B, L, S) or (B, H, L, S), batch first
            torch.testing.assert_close(got_w, expected_w, **TOL)


@pytest.mark.parametrize("kind", MASK_KINDS)
def test_translated_masks_on_an_attnkit_module(kind: str) -> None:
    """mask_from_torch's result is attnkit's `mask=`: same numbers on a plain module."""
    B, H, E, L, S = 2, 3, 12, 4, 5
    m, ours = _torch_pair(E, H, 4, batch_first=True)
    plain = MultiHeadAttention(E, H)
    plain.load_state_dict(ours.state_dict())
    g = torch.Generator().manual_seed(5)
    query, memory = torch.randn(B, L, E, generator=g), torch.randn(B, S, E, generator=g)
    attn_mask, kpm = _torch_masks(kind, B, H, L, S, g)
    expected, expected_w = m(
        query, memory, memory, kpm, attn_mask=attn_mask, average_attn_weights=False
    )
    mask = mask_from_torch(attn_mask, kpm, num_heads=H)
    res = plain(query, memory, mask=mask, need_weights=True)
    torch.testing.assert_close(res.output, expected, **TOL)
    torch.testing.assert_close(res.weights, expected_w, **TOL)
    # without weights: a fused backend may serve the call, same numbers
    torch.testing.assert_close(plain(query, memory, mask=mask).output, expected, **TOL)
    # and the same torch masks under torch's names on the plain module
    same = plain(query, memory, key_padding_mask=kpm, attn_mask=attn_mask, need_weights=True)
    torch.testing.assert_close(same.output, expected, **TOL)
    torch.testing.assert_close(same.weights, expected_w, **TOL)


ATTN_KINDS = ["none", "bool2d", "bool3d", "float2d", "float3d", "causal-bool", "causal-float"]


@given(
    B=st.integers(1, 3),
    H=st.integers(1, 3),
    D=st.integers(1, 4),
    L=st.integers(1, 5),
    S=st.integers(1, 5),
    batch_first=st.booleans(),
    cross=st.booleans(),
    kpm_kind=st.sampled_from(["none", "bool", "float"]),
    padded_row=st.booleans(),
    attn_kind=st.sampled_from(ATTN_KINDS),
    need_weights=st.booleans(),
    average=st.booleans(),
    inference=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_same_calls_as_torch(
    B: int,
    H: int,
    D: int,
    L: int,
    S: int,
    batch_first: bool,
    cross: bool,
    kpm_kind: str,
    padded_row: bool,
    attn_kind: str,
    need_weights: bool,
    average: bool,
    inference: bool,
    seed: int,
) -> None:
    """Random calls, fed as they are to nn.MultiheadAttention and to its from_torch copy.

    Both layouts; self-attention (torch's fast path under ``inference``: eval and no_grad)
    and cross-attention; every mask kind, ``is_causal`` with the ``attn_mask`` torch demands,
    ``need_weights`` and ``average_attn_weights`` both ways. Outputs and weights agree to
    1e-5, except in a batch row that is all padding (``padded_row``): torch makes it NaN
    (or its SDPA path the output bias), attnkit's documented answer is attention output 0,
    so the output is ``out_proj.bias`` and the weights are 0, and that is what is compared.
    """
    E = H * D
    if not cross:
        S = L
    kdim = E + 1 if cross else E
    g = torch.Generator().manual_seed(seed)
    m, ours = _torch_pair(E, H, seed, kdim=kdim, vdim=kdim, batch_first=batch_first)
    query = torch.randn(B, L, E, generator=g)
    memory = torch.randn(B, S, kdim, generator=g) if cross else query
    causal = attn_kind.startswith("causal")
    # one key per (batch, query) row that no mask blocks, so only padded_row empties rows
    keep = (
        torch.zeros(B, L, dtype=torch.long) if causal else torch.randint(0, S, (B, L), generator=g)
    )
    open_ = torch.zeros(B, L, S, dtype=torch.bool).scatter_(2, keep[..., None], True)
    kpm: torch.Tensor | None = None
    padded = torch.zeros(B, dtype=torch.bool)  # batch rows that are all padding
    if kpm_kind == "bool":  # True = ignore, never a key that some row needs
        kpm = (torch.rand(B, S, generator=g) < 0.5) & ~open_.any(dim=1)
        if padded_row:
            padded[B - 1] = True
            kpm[B - 1] = True
    elif kpm_kind == "float":
        kpm = torch.randn(B, S, generator=g)
    blocked2 = (torch.rand(L, S, generator=g) < 0.5) & ~open_.any(dim=0)  # (L, S)
    blocked3 = ((torch.rand(B, H, L, S, generator=g) < 0.5) & ~open_[:, None]).reshape(B * H, L, S)
    attn_mask = {
        "none": None,
        "bool2d": blocked2,
        "bool3d": blocked3,
        "float2d": torch.randn(L, S, generator=g).masked_fill(blocked2, float("-inf")),
        "float3d": torch.randn(B * H, L, S, generator=g).masked_fill(blocked3, float("-inf")),
        "causal-bool": torch.ones(L, S, dtype=torch.bool).triu(1),  # torch's top-left rule
        "causal-float": torch.zeros(L, S).masked_fill(
            torch.ones(L, S, dtype=torch.bool).triu(1), float("-inf")
        ),
    }[attn_kind]
    if not batch_first:
        query, memory = query.transpose(0, 1), memory.transpose(0, 1)
    kwargs: dict[str, Any] = {
        "key_padding_mask": kpm,
        "need_weights": need_weights,
        "attn_mask": attn_mask,
        "average_attn_weights": average,
        "is_causal": causal,
    }
    if inference:
        m.eval()
        ours.eval()
    with torch.inference_mode(inference):
        expected, expected_w = m(query, memory, memory, **kwargs)
    with warnings.catch_warnings():  # a padded row, or a random mask that looks inverted
        warnings.simplefilter("ignore", attnkit.AttentionMaskWarning)
        got, got_w = ours(query, memory, memory, **kwargs)
    assert got.shape == expected.shape
    if not batch_first:
        got, expected = got.transpose(0, 1), expected.transpose(0, 1)  # (B, L, E)
    assert not bool(got.isnan().any())
    bias = ours.out_proj.bias.detach().expand_as(got)
    torch.testing.assert_close(got, torch.where(padded[:, None, None], bias, expected), **TOL)
    if not need_weights:
        assert got_w is None
        assert expected_w is None
        return
    assert got_w is not None
    assert expected_w is not None
    assert got_w.shape == expected_w.shape == ((B, L, S) if average else (B, H, L, S))
    rows = padded.view(B, *[1] * (expected_w.dim() - 1))
    torch.testing.assert_close(got_w, expected_w.masked_fill(rows, 0.0), **TOL)


@pytest.mark.parametrize("batch_first", [True, False])
def test_unbatched_inputs_as_torch(batch_first: bool) -> None:
    """torch also takes one sequence (L, E), with key_padding_mask (S,), attn_mask (H, L, S)."""
    m, ours = _torch_pair(8, 2, 6, batch_first=batch_first)
    g = torch.Generator().manual_seed(7)
    query, memory = torch.randn(3, 8, generator=g), torch.randn(5, 8, generator=g)
    kpm = torch.tensor([False, False, True, False, True])
    attn3 = torch.rand(2, 3, 5, generator=g) < 0.3
    attn3[..., 0] = False
    for kwargs in (
        {},
        {"key_padding_mask": kpm, "average_attn_weights": False},
        {"attn_mask": attn3, "key_padding_mask": kpm},
        {"attn_mask": attn3[0], "need_weights": False},
    ):
        expected, expected_w = m(query, memory, memory, **kwargs)
        got, got_w = ours(query, memory, memory, **kwargs)
        assert got.shape == expected.shape == (3, 8)
        torch.testing.assert_close(got, expected, **TOL)
        if expected_w is None:
            assert got_w is None
        else:
            assert got_w is not None
            torch.testing.assert_close(got_w, expected_w, **TOL)
    y, w = ours(query)  # attnkit's default key=query still works
    assert y.shape == (3, 8)
    assert w is not None
    assert w.shape == (3, 3)


def test_compat_module_keeps_attnkit_keywords() -> None:
    """`mask=` (True = may attend) and `attention_mask=` (1 = real) work on the copy too."""
    m, ours = _torch_pair(8, 2, 8, batch_first=True)
    x = torch.randn(2, 4, 8)
    ignore = torch.tensor([[False] * 4, [False, False, True, True]])
    expected, expected_w = m(x, x, x, key_padding_mask=ignore)
    for kwargs in (
        {"attention_mask": (~ignore).long()},
        {"mask": ~ignore[:, None, None, :]},
        {"mask": masks.key_mask(~ignore)},
    ):
        got, got_w = ours(x, x, x, **kwargs)
        torch.testing.assert_close(got, expected, **TOL)
        torch.testing.assert_close(got_w, expected_w, **TOL)


# --------------------------------------------------------------------------- issue 15


def test_issue15_row1_torch_key_padding_mask_means_padding() -> None:
    """Row 1: torch's key_padding_mask (True = padding) on a from_torch module, as to torch.

    attnkit used to read it as True = a real key: 0.75 max error, silently.
    """
    m, ours = _torch_pair(16, 4, 9, batch_first=False)
    x = torch.rand(5, 2, 16)  # (L, B, E), as in seed 002
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])  # torch: True = ignore
    expected, expected_w = m(x, x, x, key_padding_mask=pad)
    plain = MultiHeadAttention(16, 4, batch_first=False)  # attnkit's own module: same meaning
    plain.load_state_dict(ours.state_dict())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, got_w = ours(x, x, x, key_padding_mask=pad)
        torch.testing.assert_close(got, expected, **TOL)
        torch.testing.assert_close(got_w, expected_w, **TOL)
        torch.testing.assert_close(plain(x, key_padding_mask=pad).output, expected, **TOL)
        torch.testing.assert_close(plain(x, attention_mask=~pad).output, expected, **TOL)
    assert [str(w.message) for w in caught] == []  # every row has real keys: nothing to say


@pytest.mark.parametrize("need_weights", [True, False])
def test_issue15_row2_a_batch_row_all_padding(need_weights: bool) -> None:
    """Row 2: one batch row entirely padding. The other rows are torch's; that row, where
    torch gives NaN, is attnkit's documented attention output 0: out_proj.bias, weights 0."""
    m, ours = _torch_pair(16, 4, 10, batch_first=True)
    x = torch.randn(3, 5, 16)
    pad = torch.tensor([[False] * 5, [True] * 5, [False] * 3 + [True] * 2])
    expected, expected_w = m(x, x, x, key_padding_mask=pad, need_weights=need_weights)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, got_w = ours(x, x, x, key_padding_mask=pad, need_weights=need_weights)
    others = [0, 2]
    torch.testing.assert_close(got[others], expected[others], **TOL)
    torch.testing.assert_close(got[1], ours.out_proj.bias.detach().expand(5, 16), **TOL)
    if need_weights:
        assert bool(expected_w[1].isnan().all())  # torch's answer for that row
        torch.testing.assert_close(got_w[others], expected_w[others], **TOL)
        assert bool((got_w[1] == 0).all())
    assert len(caught) == 1
    assert caught[0].category is attnkit.AttentionMaskWarning
    assert "key_padding_mask leaves batch rows [1] with no key to attend to" in str(
        caught[0].message
    )


def test_float_key_padding_mask_is_added_as_torch_adds_it() -> None:
    m, ours = _torch_pair(8, 2, 11, batch_first=True)
    x = torch.randn(2, 4, 8)
    bias = torch.randn(2, 4)
    bias[1, 2] = float("-inf")
    expected, expected_w = m(x, x, x, key_padding_mask=bias)
    got, got_w = ours(x, x, x, key_padding_mask=bias)
    torch.testing.assert_close(got, expected, **TOL)
    torch.testing.assert_close(got_w, expected_w, **TOL)
    assert bool((got_w[1, :, 2] == 0).all())


def test_mask_from_torch_refuses_integer_masks() -> None:
    with pytest.raises(attnkit.AttentionInputError, match="torch's masks are bool") as info:
        mask_from_torch(key_padding_mask=torch.zeros(2, 3, dtype=torch.long), num_heads=2)
    assert info.value.argument == "key_padding_mask"
    assert "dtype=torch.int64" in info.value.got
    with pytest.raises(attnkit.AttentionInputError, match="attn_mask") as info:
        mask_from_torch(torch.zeros(2, 3, dtype=torch.int32), num_heads=2)
    assert info.value.fix == "attn_mask.bool() if 1 means ignore"


def test_training_mode_is_carried_across_the_boundary() -> None:
    m = nn.MultiheadAttention(8, 2, dropout=0.5).eval()
    mod = MultiHeadAttention.from_torch(m)
    assert mod.training is False
    x = torch.randn(3, 2, 8)
    assert torch.allclose(mod(x).output, m(x, x, x)[0], atol=1e-6)
    assert mod.train().to_torch().training is True
