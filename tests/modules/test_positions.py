"""Positions: RoPE and ALiBi against their formulas written out by hand, learned positions.

RoPE's reference rotates one pair of dims at a time with a 2x2 matrix, in float64, from the
paper's definition: pair ``i`` of position ``m`` turns by ``(m / scaling) * base^(-2i/d)``.
ALiBi's reference writes the slopes of Press et al. and the bias ``-slope_h * |i - j|`` per
(head, query, key) in Python loops; attention with the spec must equal the float64 oracle given
that bias as a dense float mask.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

import attnkit
from attnkit import AttentionCall, AttentionInputError
from attnkit.backends import Backend, Decision, register_backend, unregister_backend
from attnkit.masks import EMPTY, MaskSpec, causal, padding, sliding_window
from attnkit.modules.positions import LearnedPositions, RotaryEmbedding, alibi, alibi_slopes
from oracle import reference_attention


def rope_reference(
    x: torch.Tensor, positions: list[int], dim: int, base: float, scaling: float, layout: str
) -> torch.Tensor:
    """RoPE written out: one 2x2 rotation per (position, pair), in float64."""
    out = x.clone().double()
    for t, m in enumerate(positions):
        for i in range(dim // 2):
            theta = (m / scaling) * base ** (-2 * i / dim)
            a, b = (i, i + dim // 2) if layout == "half" else (2 * i, 2 * i + 1)
            rot = torch.tensor(
                [[math.cos(theta), -math.sin(theta)], [math.sin(theta), math.cos(theta)]],
                dtype=torch.float64,
            )
            pair = torch.stack([x[..., t, a], x[..., t, b]], dim=-1).double()  # (B, H, 2)
            turned = pair @ rot.T
            out[..., t, a], out[..., t, b] = turned[..., 0], turned[..., 1]
    return out


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize(
    ("dim", "head_dim", "base", "scaling"),
    [(8, 8, 10000.0, 1.0), (6, 10, 500.0, 1.0), (8, 8, 10000.0, 4.0)],
    ids=["plain", "partial-dim-small-base", "linear-scaling-4"],
)
def test_rope_matches_written_out_rotation(
    layout: str, dim: int, head_dim: int, base: float, scaling: float
) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, head_dim, dtype=torch.float64)
    positions = [0, 1, 7, 30, 1000]
    rope = RotaryEmbedding(dim, base=base, layout=layout, scaling=scaling)  # type: ignore[arg-type]
    got = rope(x, torch.tensor(positions))
    torch.testing.assert_close(
        got, rope_reference(x, positions, dim, base, scaling, layout), atol=1e-10, rtol=0
    )
    x32 = x.float()
    torch.testing.assert_close(
        rope(x32, torch.tensor(positions)).double(),
        rope_reference(x32, positions, dim, base, scaling, layout),
        atol=1e-4,
        rtol=0,
    )


def test_rope_layouts_differ_only_by_a_permutation_of_dims() -> None:
    """Interleaved pairs (2i, 2i+1) are half-split pairs (i, i + d/2) after a permutation."""
    x = torch.randn(1, 2, 6, 8, dtype=torch.float64)
    perm = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])  # half-split order -> interleaved order
    half = RotaryEmbedding(8, layout="half")(x)
    inter = RotaryEmbedding(8, layout="interleaved")(x[..., perm])
    torch.testing.assert_close(inter, half[..., perm], atol=1e-12, rtol=0)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rope_scores_depend_only_on_relative_position(layout: str) -> None:
    torch.manual_seed(1)
    q = torch.randn(1, 1, 1, 16, dtype=torch.float64)
    k = torch.randn(1, 1, 1, 16, dtype=torch.float64)
    rope = RotaryEmbedding(16, layout=layout)  # type: ignore[arg-type]

    def score(m: int, n: int) -> float:
        qm = rope(q, torch.tensor([m]))
        kn = rope(k, torch.tensor([n]))
        return float((qm * kn).sum())

    for m, n in [(3, 1), (10, 4), (0, 5)]:
        for shift in (1, 17, 250):
            assert score(m + shift, n + shift) == pytest.approx(score(m, n), abs=1e-9)
    assert score(3, 1) != pytest.approx(score(4, 1), abs=1e-6)  # and it does depend on m - n


def test_rope_per_sequence_positions_and_norm() -> None:
    x = torch.randn(2, 2, 3, 8, dtype=torch.float64)
    rope = RotaryEmbedding(8)
    pos = torch.tensor([[0, 1, 2], [5, 6, 7]])
    got = rope(x, pos)
    torch.testing.assert_close(got[1:], rope(x[1:], torch.tensor([5, 6, 7])))
    torch.testing.assert_close(got.norm(dim=-1), x.norm(dim=-1))  # a rotation keeps norms
    torch.testing.assert_close(rope(x), rope(x, torch.arange(3)))  # default 0 .. L-1


def test_rope_bad_input_messages() -> None:
    with pytest.raises(AttentionInputError, match="unknown layout 'neox'"):
        RotaryEmbedding(8, layout="neox")  # type: ignore[arg-type]
    with pytest.raises(AttentionInputError, match="even int"):
        RotaryEmbedding(7)
    for bad in ({"base": math.inf}, {"scaling": math.inf}, {"base": 0.0}, {"scaling": math.nan}):
        with pytest.raises(AttentionInputError, match="must be a finite number > 0"):
            RotaryEmbedding(8, **bad)  # type: ignore[arg-type]
    assert RotaryEmbedding(8, base=np.float32(500.0)).base == 500.0
    with pytest.raises(AttentionInputError, match="D >= dim = 16") as e:
        RotaryEmbedding(16)(torch.randn(1, 2, 3, 8))
    assert "split_heads" in str(e.value)
    with pytest.raises(AttentionInputError, match="positions") as e:
        RotaryEmbedding(8)(torch.randn(1, 2, 3, 8), torch.arange(4))
    assert "(3,) or (1, 3)" in str(e.value)


def test_alibi_slopes_for_8_and_12_heads() -> None:
    assert alibi_slopes(8).tolist() == [2.0**-k for k in range(1, 9)]
    # 12 heads: the 8-head slopes, then every other slope of 16 heads (2^-0.5, 2^-1.5, ...)
    expected_12 = [2.0**-k for k in range(1, 9)] + [2.0 ** -(k + 0.5) for k in range(4)]
    torch.testing.assert_close(alibi_slopes(12), torch.tensor(expected_12, dtype=torch.float64))
    assert alibi_slopes(1).tolist() == [2.0**-8]
    with pytest.raises(AttentionInputError, match="num_heads"):
        alibi_slopes(0)


def alibi_bias_reference(H: int, L: int, S: int) -> torch.Tensor:
    """``-slope_h * |i + S - L - j|`` for every head, query and key, in loops (float64)."""
    slopes = alibi_slopes(H).tolist()
    bias = torch.zeros(1, H, L, S, dtype=torch.float64)
    for h in range(H):
        for i in range(L):
            for j in range(S):
                bias[0, h, i, j] = -slopes[h] * abs(i + S - L - j)
    return bias


@pytest.mark.parametrize(("H", "L", "S"), [(8, 6, 6), (12, 3, 7), (4, 5, 5)])
@pytest.mark.parametrize("with_causal", [True, False], ids=["causal", "bidirectional"])
def test_alibi_attention_equals_math_with_dense_float_bias(
    H: int, L: int, S: int, with_causal: bool
) -> None:
    torch.manual_seed(2)
    q = torch.randn(2, H, L, 16, dtype=torch.float64)
    k = torch.randn(2, H, S, 16, dtype=torch.float64)
    v = torch.randn(2, H, S, 16, dtype=torch.float64)
    bias = alibi_bias_reference(H, L, S)
    spec = alibi(H) & causal() if with_causal else alibi(H)
    if with_causal:
        bias = bias.masked_fill(~attnkit.causal_mask(L, S), float("-inf"))
    ref_out, ref_w = reference_attention(q, k, v, mask=bias)
    verdicts = attnkit.explain(q, k, v, mask=spec).verdicts
    serving = [name for name, reason in verdicts.items() if reason is None]
    assert "math" in serving
    for backend in ["auto", *serving]:
        got = attnkit.attention(q, k, v, mask=spec, backend=backend)
        torch.testing.assert_close(got, ref_out, atol=1e-10, rtol=0)
    _, w = attnkit.attention(q, k, v, mask=spec, return_weights=True)
    torch.testing.assert_close(w, ref_w, atol=1e-10, rtol=0)
    # the causal flag absorbs into the spec the same way
    if with_causal:
        torch.testing.assert_close(
            attnkit.attention(q, k, v, mask=alibi(H), causal=True), ref_out, atol=1e-10, rtol=0
        )


def test_alibi_float32_dense_mask_has_q_dtype() -> None:
    q = torch.randn(1, 4, 5, 8)
    out = attnkit.attention(q, q, q, mask=alibi(4) & causal())  # float32 end to end
    bias = alibi_bias_reference(4, 5, 5).masked_fill(~attnkit.causal_mask(5, 5), float("-inf"))
    ref, _ = reference_attention(q, q, q, mask=bias)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
    dense = (alibi(4) & causal()).to_dense(5, 5, dtype=torch.float16)
    assert dense.dtype == torch.float16
    assert dense.shape == (1, 4, 5, 5)


def test_alibi_bias_evaluated_per_block_matches_the_formula() -> None:
    """What a block-sparse backend does: the bias of one block from that block's indices."""
    H, L, S = 12, 40, 56
    spec = alibi(H) & causal()
    full = alibi_bias_reference(H, L, S)
    h = torch.arange(H).view(1, H, 1, 1)
    for q_lo, k_lo in [(0, 0), (16, 32), (32, 48)]:
        q = torch.arange(q_lo, min(q_lo + 16, L)).view(1, 1, -1, 1)
        kv = torch.arange(k_lo, min(k_lo + 16, S)).view(1, 1, 1, -1)
        b = torch.zeros(1, 1, 1, 1, dtype=torch.long)
        block = spec.bias(b, h, q, kv, S - L)
        expected = full[:, :, q_lo : q_lo + 16, k_lo : k_lo + 16]
        torch.testing.assert_close(block.double(), expected, atol=1e-6, rtol=0)
    # ALiBi allows every pair, so the block map is the causal rule's: empty blocks stay empty
    assert torch.equal(spec.block_map(L, S, 16, 16).state, causal().block_map(L, S, 16, 16).state)
    assert torch.equal(
        alibi(H).block_map(L, S, 16, 16).state.unique(), torch.tensor([2], dtype=torch.uint8)
    )


def _blocked_run(call: AttentionCall) -> tuple[torch.Tensor, None]:
    """A tiny spec-taking backend: online softmax over 4x4 blocks, skipping empty ones, the
    spec's predicate and bias evaluated per block (as backends/blocked is meant to)."""
    q, k, v, mask, scale = call.q, call.k, call.v, call.mask, call.scale
    assert isinstance(mask, MaskSpec), "a spec-taking backend must get the spec itself"
    B, H, L = q.shape[:3]
    S = k.shape[2]
    bq = bk = 4
    bmap = mask.block_map(L, S, bq, bk).state  # (B', H', nq, nk)
    out = torch.zeros(B, H, L, v.shape[-1], dtype=q.dtype)
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    for qi, q0 in enumerate(range(0, L, bq)):
        qs = slice(q0, q0 + bq)
        row_max = torch.full((B, H, len(range(L)[qs]), 1), float("-inf"), dtype=q.dtype)
        row_sum = torch.zeros_like(row_max)
        acc = torch.zeros(B, H, row_max.shape[2], v.shape[-1], dtype=q.dtype)
        for ki, k0 in enumerate(range(0, S, bk)):
            if bool((bmap[..., qi, ki] == EMPTY).all()):
                continue
            ks = slice(k0, k0 + bk)
            qq = torch.arange(L)[qs].view(1, 1, -1, 1)
            kk = torch.arange(S)[ks].view(1, 1, 1, -1)
            s = q[:, :, qs] @ k[:, :, ks].transpose(-2, -1) * scale
            bias = mask.bias(b, h, qq, kk, S - L) if mask.has_bias else None
            if bias is not None:
                s = s + bias.to(q.dtype)
            s = s.masked_fill(~mask.allowed(b, h, qq, kk, S - L), float("-inf"))
            new_max = torch.maximum(row_max, s.amax(-1, keepdim=True))
            safe = torch.where(new_max == float("-inf"), 0.0, new_max)
            p = (s - safe).exp()
            corr = (row_max - safe).exp()
            row_sum = row_sum * corr + p.sum(-1, keepdim=True)
            acc = acc * corr + p @ v[:, :, ks]
            row_max = new_max
        out[:, :, qs] = torch.where(row_sum > 0, acc / row_sum.clamp(min=1e-300), 0.0)
    return out, None


class _SpecBackend(Backend):
    name = "test_blocked"
    description = "test"

    def decide(self, call: AttentionCall) -> Decision:
        spec = call.mask
        ok = spec is not None and not spec.from_tensor and not call.causal
        return Decision(self.name, reason=None if ok else "test backend: specs only")

    def run(self, call: AttentionCall, plan: None) -> tuple[torch.Tensor, None]:
        return _blocked_run(call)


def test_alibi_reaches_a_spec_taking_backend_as_a_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    """attention() hands ALiBi to a backend that reads call.mask without materialising it."""
    register_backend(_SpecBackend())
    try:

        def no_dense(*args: object, **kwargs: object) -> torch.Tensor:
            raise AssertionError("the spec was materialised to an L x S tensor")

        monkeypatch.setattr(MaskSpec, "to_dense", no_dense)
        torch.manual_seed(3)
        H, L, S = 8, 10, 13
        q = torch.randn(2, H, L, 8, dtype=torch.float64)
        k = torch.randn(2, H, S, 8, dtype=torch.float64)
        v = torch.randn(2, H, S, 8, dtype=torch.float64)
        lengths = torch.tensor([13, 9])
        spec = alibi(H) & causal() & padding(lengths) & sliding_window(6)
        spec_takers = ["blocked", "test_blocked"]  # flex: no score biases
        got = {name: attnkit.attention(q, k, v, mask=spec, backend=name) for name in spec_takers}
    finally:
        unregister_backend("test_blocked")
        monkeypatch.undo()
    i = torch.arange(L).view(L, 1) + S - L
    j = torch.arange(S).view(1, S)
    allowed = (j <= i) & ((i - j).abs() < 6) & (j < lengths.view(2, 1, 1, 1))  # (B, 1, L, S)
    bias = alibi_bias_reference(H, L, S).masked_fill(~allowed, float("-inf"))  # (B, H, L, S)
    ref, _ = reference_attention(q, k, v, mask=bias)
    assert "test_blocked" in got
    for out in got.values():
        torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)


def test_alibi_combinations_and_head_checks() -> None:
    with pytest.raises(ValueError, match="combines with & only"):
        alibi(4) | causal()
    with pytest.raises(ValueError, match="cannot be inverted"):
        ~alibi(4)
    with pytest.raises(ValueError, match="different head counts"):
        alibi(4) & alibi(8)
    q = torch.randn(1, 8, 3, 4)
    with pytest.raises(AttentionInputError, match="built for 4 heads but q has H=8"):
        attnkit.attention(q, q, q, mask=alibi(4) & causal())
    assert repr(alibi(4) & causal()) == "alibi(4) & causal()"
    assert "1 . . ." in str(alibi(4) & causal())  # draws its allowed pairs


def test_learned_positions() -> None:
    pe = LearnedPositions(10, 4)
    pos = torch.tensor([[0, 3, 9], [1, 1, 2]])
    assert torch.equal(pe(pos), pe.weight[pos])
    assert pe(torch.arange(3)).shape == (3, 4)
    with pytest.raises(AttentionInputError, match="position 10 is past the table's 10") as e:
        pe(torch.tensor([8, 9, 10]))
    assert "shorten" in str(e.value)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda pe: pe(torch.tensor([-1, 0])), "position -1 is negative"),
        (lambda pe: pe(torch.tensor([0.0, 1.0])), "`positions` must be a tensor of integer"),
        (lambda pe: pe(torch.tensor([True])), "`positions` must be a tensor of integer"),
        (lambda pe: LearnedPositions(0, 4), "`max_positions` must be a positive int, got 0"),
        (lambda pe: LearnedPositions(4.0, 4), "`max_positions` must be a positive int"),
        (lambda pe: LearnedPositions(8, 0), "`dim` must be a positive int, got 0"),
    ],
)
def test_learned_positions_refuse_what_is_not_a_position(make: Any, message: str) -> None:
    """torch's embedding answered these with an IndexError or a RuntimeError (or built an
    empty table)."""
    with pytest.raises(AttentionInputError) as e:
        make(LearnedPositions(10, 4))
    assert message in str(e.value)


def test_rope_refuses_integer_vectors() -> None:
    """cos and sin cast to int64 turned every rotated row to zeros, silently."""
    x = torch.tensor([[[[3, 4, 5, 6]]]]).expand(1, 1, 3, 4).contiguous()
    with pytest.raises(AttentionInputError, match="RoPE rotates float vectors") as e:
        RotaryEmbedding(4)(x)
    assert "fix:      x.float()" in str(e.value)


def test_rope_in_multi_head_attention_is_checked_and_not_dropped() -> None:
    with pytest.raises(AttentionInputError, match="rotates at most the head dim") as e:
        attnkit.MultiHeadAttention(16, 2, rope=RotaryEmbedding(16))
    assert "RotaryEmbedding(8)" in str(e.value)
    mha = attnkit.MultiHeadAttention(16, 2, rope=RotaryEmbedding(8))
    with pytest.raises(AttentionInputError, match="no rotary embedding"):
        mha.to_torch()  # torch's module cannot rotate: refused rather than silently dropped
    x = torch.randn(1, 4, 16)
    shifted = mha(x, positions=torch.arange(4) + 7).output  # scores see distances only
    torch.testing.assert_close(shifted, mha(x).output, atol=1e-5, rtol=0)
    spread = mha(x, positions=torch.tensor([0, 1, 2, 9])).output  # other distances
    assert not torch.allclose(spread, mha(x).output, atol=1e-3)
