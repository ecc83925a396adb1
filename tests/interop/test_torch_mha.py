"""The boundary with torch.nn.MultiheadAttention: weights both ways, masks translated.

Dimension legend: B batch, H heads, L query length, S key length, E model width.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import attnkit
from attnkit import MultiHeadAttention
from attnkit.interop import mask_from_torch

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
    with pytest.raises(attnkit.AttentionInputError, match="attn_mask"):
        mask_from_torch(torch.zeros(1, 1, L, S, dtype=torch.bool), num_heads=2)
    with pytest.raises(attnkit.AttentionInputError, match="key_padding_mask"):
        mask_from_torch(key_padding_mask=torch.zeros(2, 1, 3, dtype=torch.bool), num_heads=2)


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


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_outputs_match_torch_with_translated_masks(batch_first: bool, kind: str) -> None:
    torch.manual_seed(2)
    B, H, E, L, S = 2, 3, 12, 4, 5
    m = nn.MultiheadAttention(E, H, kdim=6, vdim=7, batch_first=batch_first)
    with torch.no_grad():
        m.in_proj_bias.normal_()
        m.out_proj.bias.normal_()
    mod = MultiHeadAttention.from_torch(m)
    g = torch.Generator().manual_seed(3)
    query = torch.randn(B, L, E, generator=g)
    key = torch.randn(B, S, 6, generator=g)
    value = torch.randn(B, S, 7, generator=g)
    if not batch_first:
        query, key, value = (t.transpose(0, 1) for t in (query, key, value))
    attn_mask, kpm = _torch_masks(kind, B, H, L, S, g)
    expected, expected_w = m(
        query,
        key,
        value,
        attn_mask=attn_mask,
        key_padding_mask=kpm,
        need_weights=True,
        average_attn_weights=False,
    )
    mask = mask_from_torch(attn_mask, kpm, num_heads=H)
    res = mod(query, key, value, mask=mask, need_weights=True)
    torch.testing.assert_close(res.output, expected, **TOL)
    torch.testing.assert_close(res.weights, expected_w, **TOL)
    # without weights: a fused backend may serve the call, same numbers
    torch.testing.assert_close(mod(query, key, value, mask=mask).output, expected, **TOL)


def test_bool_key_padding_mask_also_works_through_key_padding_mask_argument() -> None:
    """torch's kpm (True = ignore) inverted is attnkit's key_padding_mask (True = real)."""
    torch.manual_seed(4)
    m = nn.MultiheadAttention(8, 2, batch_first=True)
    mod = MultiHeadAttention.from_torch(m)
    x = torch.randn(2, 5, 8)
    torch_kpm = torch.tensor([[False, False, False, True, True], [False] * 5])
    expected, _ = m(x, x, x, key_padding_mask=torch_kpm)
    torch.testing.assert_close(mod(x, key_padding_mask=~torch_kpm).output, expected, **TOL)


def test_to_torch_of_attnkit_module_matches() -> None:
    torch.manual_seed(5)
    mod = MultiHeadAttention(8, 4, kdim=3, vdim=3, batch_first=False)
    m = mod.to_torch()
    query, memory = torch.randn(3, 2, 8), torch.randn(6, 2, 3)
    expected, _ = m(query, memory, memory)
    torch.testing.assert_close(mod(query, memory).output, expected, **TOL)


@given(
    B=st.integers(1, 3),
    H=st.integers(1, 3),
    D=st.integers(1, 4),
    L=st.integers(1, 5),
    S=st.integers(1, 5),
    batch_first=st.booleans(),
    cross=st.booleans(),
    kpm_kind=st.sampled_from(["none", "bool", "float"]),
    attn_kind=st.sampled_from(["none", "bool2d", "bool3d", "float2d"]),
    seed=st.integers(0, 2**16),
)
def test_property_matches_torch(
    B: int,
    H: int,
    D: int,
    L: int,
    S: int,
    batch_first: bool,
    cross: bool,
    kpm_kind: str,
    attn_kind: str,
    seed: int,
) -> None:
    E = H * D
    if not cross:
        S = L
    kdim = E + 1 if cross else E
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    m = nn.MultiheadAttention(E, H, kdim=kdim, vdim=kdim, batch_first=batch_first)
    with torch.no_grad():
        m.in_proj_bias.normal_(generator=g)
    mod = MultiHeadAttention.from_torch(m)
    query = torch.randn(B, L, E, generator=g)
    memory = torch.randn(B, S, kdim, generator=g) if cross else query
    # one key per (batch, query) row that no mask blocks, so torch gives no NaN rows
    keep = torch.randint(0, S, (B, L), generator=g)
    open_ = torch.zeros(B, L, S, dtype=torch.bool).scatter_(2, keep[..., None], True)
    kpm: torch.Tensor | None = None
    if kpm_kind == "bool":  # True = ignore, never a key that some row needs
        kpm = (torch.rand(B, S, generator=g) < 0.5) & ~open_.any(dim=1)
    elif kpm_kind == "float":
        kpm = torch.randn(B, S, generator=g)
    attn_mask: torch.Tensor | None = None
    if attn_kind == "bool2d":
        attn_mask = (torch.rand(L, S, generator=g) < 0.5) & ~open_.any(dim=0)
    elif attn_kind == "bool3d":
        blocked = (torch.rand(B, H, L, S, generator=g) < 0.5) & ~open_[:, None]
        attn_mask = blocked.reshape(B * H, L, S)
    elif attn_kind == "float2d":
        attn_mask = torch.randn(L, S, generator=g)
    if not batch_first:
        query, memory = query.transpose(0, 1), memory.transpose(0, 1)
    expected, _ = m(query, memory, memory, attn_mask=attn_mask, key_padding_mask=kpm)
    mask = mask_from_torch(attn_mask, kpm, num_heads=H)
    with warnings.catch_warnings():  # a random mask may look like an inverted causal one
        warnings.simplefilter("ignore", attnkit.AttentionMaskWarning)
        got = mod(query, memory, memory, mask=mask).output
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, **TOL)


def test_training_mode_is_carried_across_the_boundary() -> None:
    m = nn.MultiheadAttention(8, 2, dropout=0.5).eval()
    mod = MultiHeadAttention.from_torch(m)
    assert mod.training is False
    x = torch.randn(3, 2, 8)
    assert torch.allclose(mod(x).output, m(x, x, x)[0], atol=1e-6)
    assert mod.train().to_torch().training is True
