"""MultiHeadAttention, SelfAttention and CrossAttention against a hand-written float64 forward.

The hand-written forward projects with the module's own weights, splits heads with
``view``/``transpose`` as the seeds do, runs the float64 oracle and merges heads back. The
modules must match it to 1e-10 in float64.

Dimension legend: B batch, L query length, S key length, E model width, H query heads,
Hkv key/value heads, Dk query/key head dim, Dv value head dim.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import attnkit
from attnkit import CrossAttention, MultiHeadAttention, SelfAttention
from oracle import reference_attention

F64 = torch.float64
TOL64 = {"rtol": 0.0, "atol": 1e-10}
TOL32 = {"rtol": 1e-5, "atol": 1e-5}


def _lin(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    assert isinstance(layer, nn.Linear)
    bias = None if layer.bias is None else layer.bias.double()
    return F.linear(x.double(), layer.weight.double(), bias)


def manual_forward(
    mod: MultiHeadAttention | CrossAttention,
    query: torch.Tensor,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    *,
    mask: torch.Tensor | None = None,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch-first float64 forward written out by hand with ``mod``'s parameters.

    Differentiable with respect to the module's parameters when the module is float64.
    """
    key = query if key is None else key
    value = key if value is None else value
    B, L, _ = query.shape
    S = key.shape[1]
    H, Hkv, Dk, Dv = mod.num_heads, mod.num_kv_heads, mod.head_dim, mod.v_head_dim
    q = _lin(mod.q_proj, query).view(B, L, H, Dk).transpose(1, 2)  # (B, H, L, Dk)
    k = _lin(mod.k_proj, key).view(B, S, Hkv, Dk).transpose(1, 2)  # (B, Hkv, S, Dk)
    v = _lin(mod.v_proj, value).view(B, S, Hkv, Dv).transpose(1, 2)  # (B, Hkv, S, Dv)
    out, weights = reference_attention(q, k, v, mask=mask, causal=causal)
    merged = out.transpose(1, 2).reshape(B, L, H * Dv)  # (B, L, H*Dv)
    y = _lin(mod.out_proj, merged) if isinstance(mod.out_proj, nn.Linear) else merged
    return y, weights


def _copy(dst: nn.Module, src: nn.Module) -> None:
    dst.load_state_dict(src.state_dict())


# --------------------------------------------------------------------------- self-attention


def test_self_attention_equals_hand_written_float64() -> None:
    torch.manual_seed(0)
    mod = MultiHeadAttention(12, 3, dtype=F64)
    x = torch.randn(2, 5, 12, dtype=F64)
    res = mod(x)
    expected, _ = manual_forward(mod, x)
    assert res.output.shape == (2, 5, 12)
    assert res.output.dtype == F64
    torch.testing.assert_close(res.output, expected, **TOL64)


def test_self_attention_float32_close_to_float64_reference() -> None:
    torch.manual_seed(1)
    mod = MultiHeadAttention(16, 4)
    x = torch.randn(3, 7, 16)
    expected, _ = manual_forward(mod, x)
    torch.testing.assert_close(mod(x).output.double(), expected, **TOL32)


def test_cross_attention_with_kdim_vdim_and_different_lengths() -> None:
    torch.manual_seed(2)
    mod = MultiHeadAttention(8, 2, kdim=5, vdim=7, dtype=F64)
    assert mod.k_proj.weight.shape == (8, 5)
    assert mod.v_proj.weight.shape == (8, 7)
    query = torch.randn(2, 3, 8, dtype=F64)  # L = 3
    key = torch.randn(2, 6, 5, dtype=F64)  # S = 6
    value = torch.randn(2, 6, 7, dtype=F64)
    res = mod(query, key, value, need_weights=True)
    expected, expected_w = manual_forward(mod, query, key, value)
    assert res.output.shape == (2, 3, 8)
    torch.testing.assert_close(res.output, expected, **TOL64)
    assert res.weights is not None
    assert res.weights.shape == (2, 2, 3, 6)
    torch.testing.assert_close(res.weights, expected_w, **TOL64)


def test_value_defaults_to_key() -> None:
    torch.manual_seed(3)
    mod = MultiHeadAttention(8, 2, dtype=F64)
    query = torch.randn(2, 3, 8, dtype=F64)
    memory = torch.randn(2, 4, 8, dtype=F64)
    torch.testing.assert_close(mod(query, memory).output, mod(query, memory, memory).output)
    expected, _ = manual_forward(mod, query, memory, memory)
    torch.testing.assert_close(mod(query, memory).output, expected, **TOL64)


@pytest.mark.parametrize("num_kv_heads", [2, 1])
def test_grouped_query_against_oracle(num_kv_heads: int) -> None:
    torch.manual_seed(4)
    E, H = 16, 4
    mod = MultiHeadAttention(E, H, num_kv_heads=num_kv_heads, dtype=F64)
    Dk = E // H
    assert mod.q_proj.weight.shape == (H * Dk, E)
    assert mod.k_proj.weight.shape == (num_kv_heads * Dk, E)
    assert mod.v_proj.weight.shape == (num_kv_heads * Dk, E)
    assert mod.out_proj.weight.shape == (E, H * Dk)
    x = torch.randn(2, 5, E, dtype=F64)
    memory = torch.randn(2, 7, E, dtype=F64)
    for key in (None, memory):
        res = mod(x, key, need_weights=True)
        expected, expected_w = manual_forward(mod, x, key)
        torch.testing.assert_close(res.output, expected, **TOL64)
        assert res.weights is not None
        torch.testing.assert_close(res.weights, expected_w, **TOL64)
    # without weights (another backend may serve the call) the numbers are the same
    torch.testing.assert_close(mod(x).output, manual_forward(mod, x)[0], **TOL64)


def test_grouped_query_heads_share_keys() -> None:
    """With Hkv=1 every query head that has the same query sees the same weights."""
    torch.manual_seed(5)
    mod = MultiHeadAttention(8, 4, num_kv_heads=1, dtype=F64)
    with torch.no_grad():  # all four query heads get head 0's projection
        w = mod.q_proj.weight.view(4, 2, 8)
        w[1:] = w[0]
        mod.q_proj.bias.view(4, 2)[1:] = mod.q_proj.bias.view(4, 2)[0]
    weights = mod(torch.randn(1, 3, 8, dtype=F64), need_weights=True).weights
    assert weights is not None
    for h in range(1, 4):
        torch.testing.assert_close(weights[:, h], weights[:, 0], rtol=0, atol=0)


def test_head_dim_and_v_head_dim_overrides() -> None:
    torch.manual_seed(6)
    E, H, Dk, Dv = 10, 3, 5, 7  # 10 % 3 != 0: fine once head_dim is given
    mod = MultiHeadAttention(E, H, head_dim=Dk, v_head_dim=Dv, dtype=F64)
    assert (mod.head_dim, mod.v_head_dim) == (Dk, Dv)
    assert mod.q_proj.weight.shape == (H * Dk, E)
    assert mod.k_proj.weight.shape == (H * Dk, E)
    assert mod.v_proj.weight.shape == (H * Dv, E)
    assert mod.out_proj.weight.shape == (E, H * Dv)
    x = torch.randn(2, 4, E, dtype=F64)
    res = mod(x, need_weights=True)
    assert res.output.shape == (2, 4, E)
    expected, expected_w = manual_forward(mod, x)
    torch.testing.assert_close(res.output, expected, **TOL64)
    assert res.weights is not None
    torch.testing.assert_close(res.weights, expected_w, **TOL64)


def test_head_dim_override_with_gqa_and_kdim() -> None:
    torch.manual_seed(7)
    mod = MultiHeadAttention(6, 4, num_kv_heads=2, head_dim=3, v_head_dim=2, kdim=9, dtype=F64)
    assert mod.q_proj.weight.shape == (12, 6)
    assert mod.k_proj.weight.shape == (6, 9)
    assert mod.v_proj.weight.shape == (4, 6)  # vdim defaults to embed_dim
    assert mod.out_proj.weight.shape == (6, 8)
    query = torch.randn(2, 3, 6, dtype=F64)
    key = torch.randn(2, 5, 9, dtype=F64)
    value = torch.randn(2, 5, 6, dtype=F64)
    expected, _ = manual_forward(mod, query, key, value)
    torch.testing.assert_close(mod(query, key, value).output, expected, **TOL64)


def test_output_projection_false() -> None:
    torch.manual_seed(8)
    mod = MultiHeadAttention(8, 2, v_head_dim=3, output_projection=False, dtype=F64)
    assert isinstance(mod.out_proj, nn.Identity)
    x = torch.randn(2, 4, 8, dtype=F64)
    out = mod(x).output
    assert out.shape == (2, 4, 6)  # (B, L, H * Dv)
    torch.testing.assert_close(out, manual_forward(mod, x)[0], **TOL64)


# --------------------------------------------------------------------------- weights, return type


def test_need_weights_true_returns_normalised_oracle_weights() -> None:
    torch.manual_seed(9)
    mod = MultiHeadAttention(12, 3, dtype=F64)
    query = torch.randn(2, 4, 12, dtype=F64)
    key = torch.randn(2, 6, 12, dtype=F64)
    res = mod(query, key, need_weights=True)
    assert res.weights is not None
    assert res.weights.shape == (2, 3, 4, 6)  # (B, H, L, S)
    torch.testing.assert_close(
        res.weights.sum(dim=-1), torch.ones(2, 3, 4, dtype=F64), rtol=0, atol=1e-12
    )
    assert bool((res.weights >= 0).all())
    _, expected_w = manual_forward(mod, query, key)
    torch.testing.assert_close(res.weights, expected_w, **TOL64)
    # the output does not depend on whether the weights were asked for
    torch.testing.assert_close(mod(query, key).output, res.output, **TOL64)


def test_need_weights_false_gives_none() -> None:
    mod = MultiHeadAttention(8, 2)
    res = mod(torch.randn(1, 3, 8))
    assert res.weights is None
    assert mod(torch.randn(1, 3, 8), need_weights=False).weights is None


@pytest.mark.parametrize("need_weights", [False, True])
def test_return_type_is_attention_output(need_weights: bool) -> None:
    torch.manual_seed(10)
    x = torch.randn(2, 3, 8)
    results = [
        MultiHeadAttention(8, 2)(x, need_weights=need_weights),
        MultiHeadAttention(8, 2, batch_first=False)(x, need_weights=need_weights),
        SelfAttention(8, 4)(x, need_weights=need_weights),
        CrossAttention(8, 2, context_dim=5)(x, torch.randn(2, 4, 5), need_weights=need_weights),
    ]
    for res in results:
        assert type(res) is attnkit.AttentionOutput
        assert res._fields == ("output", "weights")
        out, weights = res  # unpacks as a pair
        assert out is res.output
        assert (weights is None) is (not need_weights)


# --------------------------------------------------------------------------- masks


def _real(B: int, S: int, seed: int = 0) -> torch.Tensor:
    """Random bool (B, S), True = a real key; key 0 is always real."""
    g = torch.Generator().manual_seed(seed)
    real = torch.rand(B, S, generator=g) > 0.4
    real[:, 0] = True
    return real


def test_key_padding_mask_equals_explicit_mask() -> None:
    torch.manual_seed(11)
    mod = MultiHeadAttention(12, 3, dtype=F64)
    x = torch.randn(3, 5, 12, dtype=F64)
    real = _real(3, 5)
    assert not bool(real.all())  # some keys are really padded
    res = mod(x, key_padding_mask=~real, need_weights=True)  # torch's: True = padding
    via_mask = mod(x, mask=real[:, None, None, :], need_weights=True)
    for positive in (real, real.long(), real.int()):  # attention_mask: 1 = a real key
        twin = mod(x, attention_mask=positive, need_weights=True)
        torch.testing.assert_close(twin.output, res.output, rtol=0, atol=0)
        torch.testing.assert_close(twin.weights, res.weights, rtol=0, atol=0)
    torch.testing.assert_close(res.output, via_mask.output, rtol=0, atol=0)
    expected, expected_w = manual_forward(mod, x, mask=real[:, None, None, :])
    torch.testing.assert_close(res.output, expected, **TOL64)
    assert res.weights is not None
    torch.testing.assert_close(res.weights, expected_w, **TOL64)
    # padded keys get weight exactly 0
    assert bool((res.weights.masked_select(~real[:, None, None, :]) == 0).all())


def test_key_padding_mask_combined_with_bool_mask() -> None:
    torch.manual_seed(12)
    mod = MultiHeadAttention(8, 2, dtype=F64)
    query = torch.randn(2, 4, 8, dtype=F64)
    key = torch.randn(2, 6, 8, dtype=F64)
    real = _real(2, 6, seed=1)
    mask = torch.rand(4, 6) > 0.5  # (L, S), True = may attend
    mask[:, 0] = True
    res = mod(query, key, mask=mask, key_padding_mask=~real, need_weights=True)
    combined = mask & real[:, None, None, :]
    expected, expected_w = manual_forward(mod, query, key, mask=combined)
    torch.testing.assert_close(res.output, expected, **TOL64)
    assert res.weights is not None
    torch.testing.assert_close(res.weights, expected_w, **TOL64)
    torch.testing.assert_close(mod(query, key, mask=combined).output, res.output, **TOL64)


def test_key_padding_mask_combined_with_float_mask() -> None:
    torch.manual_seed(13)
    mod = MultiHeadAttention(8, 2, dtype=F64)
    query = torch.randn(2, 4, 8, dtype=F64)
    key = torch.randn(2, 6, 8, dtype=F64)
    real = _real(2, 6, seed=2)
    bias = torch.randn(1, 2, 4, 6, dtype=F64)  # additive, per head
    bias[..., 3] = float("-inf")
    res = mod(query, key, mask=bias, attention_mask=real, need_weights=True)
    combined = bias.masked_fill(~real[:, None, None, :], float("-inf"))  # (B, H, L, S)
    expected, expected_w = manual_forward(mod, query, key, mask=combined)
    torch.testing.assert_close(res.output, expected, **TOL64)
    assert res.weights is not None
    torch.testing.assert_close(res.weights, expected_w, **TOL64)
    assert bool((res.weights[..., 3] == 0).all())


def test_float_mask_is_added_to_scores() -> None:
    torch.manual_seed(14)
    mod = MultiHeadAttention(8, 2, dtype=F64)
    x = torch.randn(2, 5, 8, dtype=F64)
    bias = torch.randn(5, 5, dtype=F64)
    expected, _ = manual_forward(mod, x, mask=bias)
    torch.testing.assert_close(mod(x, mask=bias).output, expected, **TOL64)


@pytest.mark.parametrize(("L", "S"), [(5, 5), (3, 6)])
def test_causal_module_equals_oracle(L: int, S: int) -> None:
    torch.manual_seed(15)
    mod = MultiHeadAttention(8, 2, causal=True, dtype=F64)
    query = torch.randn(2, L, 8, dtype=F64)
    key = torch.randn(2, S, 8, dtype=F64)
    res = mod(query, key, need_weights=True)
    expected, expected_w = manual_forward(mod, query, key, causal=True)
    torch.testing.assert_close(res.output, expected, **TOL64)
    assert res.weights is not None
    torch.testing.assert_close(res.weights, expected_w, **TOL64)
    # end-aligned: query i sees keys j <= i + S - L, nothing later
    allowed = torch.ones(L, S, dtype=torch.bool).tril(S - L)
    assert bool((res.weights.masked_select(~allowed) == 0).all())
    torch.testing.assert_close(mod(query, key).output, expected, **TOL64)


def test_causal_with_key_padding_mask() -> None:
    torch.manual_seed(16)
    mod = MultiHeadAttention(8, 2, num_kv_heads=1, causal=True, dtype=F64)
    x = torch.randn(2, 5, 8, dtype=F64)
    real = _real(2, 5, seed=3)
    expected, _ = manual_forward(mod, x, mask=real[:, None, None, :], causal=True)
    torch.testing.assert_close(mod(x, key_padding_mask=~real).output, expected, **TOL64)
    torch.testing.assert_close(mod(x, attention_mask=real).output, expected, **TOL64)


def test_fully_masked_key_padding_row_gives_out_proj_bias() -> None:
    torch.manual_seed(17)
    mod = MultiHeadAttention(8, 2, dtype=F64)
    x = torch.randn(2, 4, 8, dtype=F64, requires_grad=True)
    real = torch.tensor([[True, True, False, True], [False, False, False, False]])
    with pytest.warns(attnkit.AttentionMaskWarning, match=r"rows \[1\] with no key"):
        res = mod(x, key_padding_mask=~real, need_weights=True)
    out = res.output
    assert not bool(out.isnan().any())
    # batch row 1 attends to nothing: attention output 0, so out_proj(0) = out_proj.bias
    torch.testing.assert_close(out[1], mod.out_proj.bias.detach().expand(4, 8), rtol=0, atol=0)
    assert res.weights is not None
    assert bool((res.weights[1] == 0).all())
    expected, _ = manual_forward(mod, x, mask=real[:, None, None, :])
    torch.testing.assert_close(out, expected, **TOL64)
    out.sum().backward()
    assert x.grad is not None
    assert bool(x.grad.isfinite().all())
    assert bool((x.grad[1] == 0).all())  # nothing flows back through an empty row
    for name, p in mod.named_parameters():
        assert p.grad is not None, name
        assert bool(p.grad.isfinite().all()), name


def test_fully_masked_row_without_weights_is_finite() -> None:
    """The same with need_weights=False, where a fused backend may serve the call."""
    torch.manual_seed(18)
    mod = MultiHeadAttention(8, 2)
    x = torch.randn(2, 3, 8, requires_grad=True)
    real = torch.tensor([[True, True, True], [False, False, False]])
    with pytest.warns(attnkit.AttentionMaskWarning):
        out = mod(x, attention_mask=real).output
    torch.testing.assert_close(out[1], mod.out_proj.bias.detach().expand(3, 8), rtol=0, atol=0)
    out.sum().backward()
    assert x.grad is not None
    assert bool(x.grad.isfinite().all())
    assert bool((x.grad[1] == 0).all())


# --------------------------------------------------------------------------- layout, dropout, grads


def test_batch_first_false_is_the_transpose() -> None:
    torch.manual_seed(19)
    bf = MultiHeadAttention(8, 2, kdim=6, vdim=6, dtype=F64)
    sf = MultiHeadAttention(8, 2, kdim=6, vdim=6, batch_first=False, dtype=F64)
    _copy(sf, bf)
    query = torch.randn(2, 3, 8, dtype=F64)  # (B, L, E)
    memory = torch.randn(2, 5, 6, dtype=F64)  # (B, S, kdim)
    real = _real(2, 5, seed=4)
    res_bf = bf(query, memory, key_padding_mask=~real, need_weights=True)
    res_sf = sf(
        query.transpose(0, 1), memory.transpose(0, 1), key_padding_mask=~real, need_weights=True
    )
    assert res_sf.output.shape == (3, 2, 8)  # (L, B, E)
    torch.testing.assert_close(res_sf.output, res_bf.output.transpose(0, 1), **TOL64)
    assert res_sf.weights is not None
    assert res_sf.weights.shape == (2, 2, 3, 5)  # weights stay (B, H, L, S)
    torch.testing.assert_close(res_sf.weights, res_bf.weights, **TOL64)


def test_seq_first_input_to_batch_first_module_is_refused() -> None:
    mod = MultiHeadAttention(8, 2)
    query = torch.randn(3, 2, 8)  # (L, B, E)
    memory = torch.randn(5, 2, 8)  # (S, B, E)
    with pytest.raises(attnkit.AttentionInputError, match="batch_first=False"):
        mod(query, memory)


def test_dropout_is_off_in_eval_mode() -> None:
    torch.manual_seed(20)
    with_dropout = MultiHeadAttention(8, 2, dropout=0.5)
    without = MultiHeadAttention(8, 2, dropout=0.0)
    _copy(without, with_dropout)
    with_dropout.eval()
    without.eval()
    x = torch.randn(2, 6, 8)
    a = with_dropout(x, need_weights=True)
    b = without(x, need_weights=True)
    torch.testing.assert_close(a.output, b.output, rtol=0, atol=0)
    torch.testing.assert_close(a.weights, b.weights, rtol=0, atol=0)
    torch.testing.assert_close(with_dropout(x).output, a.output, **TOL32)


def test_dropout_applies_in_training_mode_only() -> None:
    torch.manual_seed(21)
    mod = MultiHeadAttention(8, 2, dropout=0.5)
    x = torch.randn(2, 6, 8)
    mod.eval()
    clean = mod(x, need_weights=True)
    assert clean.weights is not None
    mod.train()
    first = mod(x, need_weights=True)
    second = mod(x, need_weights=True)
    assert not torch.allclose(first.output, second.output)
    assert not torch.allclose(first.output, clean.output)
    assert first.weights is not None
    # each weight is dropped (0) or kept and scaled by 1 / (1 - p) = 2
    dropped = first.weights == 0
    assert bool(dropped.any())
    assert bool((~dropped).any())
    torch.testing.assert_close(
        first.weights[~dropped], 2 * clean.weights[~dropped], rtol=1e-5, atol=1e-6
    )
    # a module with dropout=0 gives the same result in both modes
    plain = MultiHeadAttention(8, 2)
    plain.train()
    torch.testing.assert_close(plain(x).output, plain.eval()(x).output, rtol=0, atol=0)


def test_gradients_reach_every_projection_and_match_float64_reference() -> None:
    torch.manual_seed(22)
    mod = MultiHeadAttention(8, 4, num_kv_heads=2, kdim=6, vdim=5, dtype=F64)
    query = torch.randn(2, 3, 8, dtype=F64)
    key = torch.randn(2, 4, 6, dtype=F64)
    value = torch.randn(2, 4, 5, dtype=F64)
    target = torch.randn(2, 3, 8, dtype=F64)
    loss = (mod(query, key, value).output * target).sum()
    grads = torch.autograd.grad(loss, list(mod.parameters()))
    ref_out, _ = manual_forward(mod, query, key, value)
    ref_grads = torch.autograd.grad((ref_out * target).sum(), list(mod.parameters()))
    names = [n for n, _ in mod.named_parameters()]
    assert set(names) == {
        f"{p}_proj.{w}" for p in ("q", "k", "v", "out") for w in ("weight", "bias")
    }
    for name, g, rg in zip(names, grads, ref_grads, strict=True):
        assert bool(g.abs().sum() > 0), name
        torch.testing.assert_close(g, rg, rtol=1e-9, atol=1e-10, msg=name)


# --------------------------------------------------------------------------- SelfAttention


class SeedSelfAttention(nn.Module):
    """Seed 000's hand-written single-head self-attention, verbatim in its arithmetic."""

    def __init__(self, embedding_dim: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.query_linear = nn.Linear(embedding_dim, head_dim, bias=False)
        self.key_linear = nn.Linear(embedding_dim, head_dim, bias=False)
        self.value_linear = nn.Linear(embedding_dim, head_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.query_linear(x).unsqueeze(1)  # (B, 1, L, D)
        k = self.key_linear(x).unsqueeze(1)
        v = self.value_linear(x).unsqueeze(1)
        scores = torch.matmul(q, k.transpose(-2, -1)) / (self.head_dim**0.5)
        weights = F.softmax(scores, dim=-1)
        return torch.matmul(weights, v).squeeze(1)  # (B, L, D)


def test_self_attention_defaults() -> None:
    sa = SelfAttention(16, 6)
    assert sa.q_proj.bias is None
    assert sa.k_proj.bias is None
    assert sa.v_proj.bias is None
    assert isinstance(sa.out_proj, nn.Identity)
    assert sa.q_proj.weight.shape == sa.k_proj.weight.shape == sa.v_proj.weight.shape == (6, 16)
    assert sum(p.numel() for p in sa.parameters()) == 3 * 6 * 16
    assert sa(torch.randn(3, 5, 16)).output.shape == (3, 5, 6)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_self_attention_equals_seed_000(dtype: torch.dtype) -> None:
    torch.manual_seed(23)
    seed = SeedSelfAttention(32, 8).to(dtype)
    sa = SelfAttention(32, 8, dtype=dtype)
    with torch.no_grad():
        sa.q_proj.weight.copy_(seed.query_linear.weight)
        sa.k_proj.weight.copy_(seed.key_linear.weight)
        sa.v_proj.weight.copy_(seed.value_linear.weight)
    x = torch.randn(4, 10, 32, dtype=dtype)
    res = sa(x, need_weights=True)
    assert res.output.shape == (4, 10, 8)
    tol = TOL64 if dtype == F64 else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(res.output, seed(x), **tol)
    assert res.weights is not None
    assert res.weights.shape == (4, 1, 10, 10)
    scores = (x @ seed.query_linear.weight.T) @ (x @ seed.key_linear.weight.T).transpose(1, 2)
    torch.testing.assert_close(res.weights[:, 0], (scores / math.sqrt(8)).softmax(-1), **tol)


def test_self_attention_with_seed_003s_value_width() -> None:
    """Seed 003's walk-through: d_q = d_k = 24, d_v = 28 on 16-wide embeddings, by hand."""
    torch.manual_seed(123)
    x = torch.rand(1, 6, 16, dtype=F64)
    w_query, w_key = torch.rand(24, 16, dtype=F64), torch.rand(24, 16, dtype=F64)
    w_value = torch.rand(28, 16, dtype=F64)
    sa = SelfAttention(16, 24, v_head_dim=28, dtype=F64)
    assert sa.v_proj.weight.shape == (28, 16)
    with torch.no_grad():
        sa.q_proj.weight.copy_(w_query)
        sa.k_proj.weight.copy_(w_key)
        sa.v_proj.weight.copy_(w_value)
    queries, keys, values = x[0] @ w_query.T, x[0] @ w_key.T, x[0] @ w_value.T  # as seed 003
    weights = torch.softmax(queries @ keys.T / 24**0.5, dim=-1)  # (6, 6)
    res = sa(x, need_weights=True)
    assert res.output.shape == (1, 6, 28)
    torch.testing.assert_close(res.output[0], weights @ values, **TOL64)
    assert res.weights is not None
    torch.testing.assert_close(res.weights[0, 0], weights, **TOL64)


def test_self_attention_causal_and_padding() -> None:
    torch.manual_seed(24)
    sa = SelfAttention(8, 4, causal=True, dtype=F64)
    x = torch.randn(2, 5, 8, dtype=F64)
    real = _real(2, 5, seed=5)
    expected, _ = manual_forward(sa, x, mask=real[:, None, None, :], causal=True)
    torch.testing.assert_close(sa(x, key_padding_mask=~real).output, expected, **TOL64)
    torch.testing.assert_close(sa(x, attention_mask=real).output, expected, **TOL64)


# --------------------------------------------------------------------------- CrossAttention


def test_cross_attention_equals_multihead_with_kdim_vdim() -> None:
    torch.manual_seed(25)
    cross = CrossAttention(12, 3, context_dim=7, dtype=F64)
    mha = MultiHeadAttention(12, 3, kdim=7, vdim=7, dtype=F64)
    assert cross.state_dict().keys() == mha.state_dict().keys()
    _copy(mha, cross)
    x = torch.randn(2, 4, 12, dtype=F64)
    context = torch.randn(2, 9, 7, dtype=F64)
    real = _real(2, 9, seed=6)
    a = cross(x, context, key_padding_mask=~real, need_weights=True)
    b = mha(x, context, context, attention_mask=real, need_weights=True)
    assert a.output.shape == (2, 4, 12)
    torch.testing.assert_close(a.output, b.output, rtol=0, atol=0)
    torch.testing.assert_close(a.weights, b.weights, rtol=0, atol=0)
    expected, _ = manual_forward(cross, x, context, mask=real[:, None, None, :])
    torch.testing.assert_close(a.output, expected, **TOL64)


def test_cross_attention_gqa() -> None:
    torch.manual_seed(26)
    cross = CrossAttention(8, 4, context_dim=3, num_kv_heads=2, dtype=F64)
    x = torch.randn(1, 2, 8, dtype=F64)
    context = torch.randn(1, 5, 3, dtype=F64)
    expected, _ = manual_forward(cross, x, context)
    torch.testing.assert_close(cross(x, context).output, expected, **TOL64)


# --------------------------------------------------------------------------- seed 002 parity


def test_parity_with_torch_multihead_attention_seed_002() -> None:
    """Seed 002: nn.MultiheadAttention(16, 4) on (seq=5, batch=2, embed=16) inputs."""
    torch.manual_seed(27)
    batch_size, seq_len, embed_dim, num_heads = 2, 5, 16, 4
    ref = nn.MultiheadAttention(embed_dim=embed_dim, num_heads=num_heads)
    query = torch.rand(seq_len, batch_size, embed_dim)
    key = torch.rand(seq_len, batch_size, embed_dim)
    value = torch.rand(seq_len, batch_size, embed_dim)
    expected, expected_w = ref(query, key, value, average_attn_weights=False)
    assert expected.shape == (5, 2, 16)

    mod = MultiHeadAttention(embed_dim, num_heads, batch_first=False)
    with torch.no_grad():  # copied by hand here; interop has its own tests
        wq, wk, wv = ref.in_proj_weight.chunk(3)
        bq, bk, bv = ref.in_proj_bias.chunk(3)
        for proj, w, b in ((mod.q_proj, wq, bq), (mod.k_proj, wk, bk), (mod.v_proj, wv, bv)):
            proj.weight.copy_(w)
            proj.bias.copy_(b)
        mod.out_proj.weight.copy_(ref.out_proj.weight)
        mod.out_proj.bias.copy_(ref.out_proj.bias)
    res = mod(query, key, value, need_weights=True)
    assert res.output.shape == (5, 2, 16)
    torch.testing.assert_close(res.output, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(res.weights, expected_w, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- errors


def test_bad_arguments_are_named() -> None:
    with pytest.raises(attnkit.AttentionInputError, match="not divisible by num_heads"):
        MultiHeadAttention(10, 3)
    with pytest.raises(attnkit.AttentionInputError, match="num_kv_heads"):
        MultiHeadAttention(12, 4, num_kv_heads=3)
    mod = MultiHeadAttention(8, 2)
    x = torch.randn(2, 3, 8)
    with pytest.raises(attnkit.AttentionInputError, match=r"has dtype torch\.int64"):
        mod(x, key_padding_mask=torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(attnkit.AttentionInputError, match=r"key_padding_mask\.T"):
        mod(x[:, :2], torch.randn(2, 3, 8), key_padding_mask=torch.ones(3, 2, dtype=torch.bool))
    with pytest.raises(attnkit.AttentionInputError, match="kdim"):
        mod(x, torch.randn(2, 3, 5))


# --------------------------------------------------------------------------- torch.compile


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method`:DeprecationWarning")
def test_compile_fullgraph_matches_eager() -> None:
    """Three tiny compiled cases: plain self-attention, causal + GQA, and a key padding mask."""
    torch.manual_seed(28)
    plain = MultiHeadAttention(8, 2).eval()
    gqa = MultiHeadAttention(8, 4, num_kv_heads=2, causal=True).eval()
    x = torch.randn(2, 3, 8)
    real = torch.tensor([[True, True, False], [True, False, False]])
    # one compile thread: no worker pool to start and shut down on this small machine
    with torch.no_grad(), torch._inductor.config.patch(compile_threads=1):
        compiled_plain = torch.compile(plain, fullgraph=True)
        compiled_gqa = torch.compile(gqa, fullgraph=True)
        got = compiled_plain(x)
        assert type(got) is attnkit.AttentionOutput
        assert got.weights is None
        torch.testing.assert_close(got.output, plain(x).output, **TOL32)
        torch.testing.assert_close(compiled_gqa(x).output, gqa(x).output, **TOL32)
        torch.testing.assert_close(
            compiled_gqa(x, key_padding_mask=~real).output,
            gqa(x, key_padding_mask=~real).output,
            **TOL32,
        )
        torch.testing.assert_close(
            compiled_gqa(x, attention_mask=real.long()).output,
            gqa(x, attention_mask=real).output,
            **TOL32,
        )
    expected, _ = manual_forward(gqa, x, mask=real[:, None, None, :], causal=True)
    torch.testing.assert_close(gqa(x, attention_mask=real).output.double(), expected, **TOL32)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method`:DeprecationWarning")
def test_compile_fullgraph_backward_matches_eager() -> None:
    """Training step through dynamo + AOT autograd (aot_eager: no C++ compile, fast)."""
    torch.manual_seed(29)
    mod = MultiHeadAttention(8, 2, num_kv_heads=1)
    x = torch.randn(2, 4, 8)
    real = _real(2, 4, seed=7)
    compiled = torch.compile(mod, fullgraph=True, backend="aot_eager")
    compiled(x, key_padding_mask=~real).output.square().sum().backward()
    compiled_grads = [p.grad.clone() for p in mod.parameters()]
    mod.zero_grad()
    mod(x, attention_mask=real).output.square().sum().backward()
    for p, g in zip(mod.parameters(), compiled_grads, strict=True):
        torch.testing.assert_close(g, p.grad, **TOL32)
