"""The flex backend: compiled flex_attention driven by attnkit's mask specs.

Compiling takes tens of seconds on a 2-core CPU, so exactly one kernel is compiled here: one
call whose spec combines every atom of attnkit.masks with &, | and ~, under GQA, L != S,
Dv != Dk, a batch-dependent spec and rows that see nothing, checked against the float64
oracle. Everything flex cannot serve is checked through its refusals, which compile nothing.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch._dynamo.utils import counters

import attnkit
from attnkit import AttentionInputError, masks
from attnkit.backends import flex
from attnkit.masks import MaskSpec
from oracle import reference_attention, within_naive


def _problem(cut: int = 60) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, MaskSpec]:
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, L, S = 2, 4, 2, 150, 170
    q = torch.randn(B, H, L, 16, generator=g)
    k = torch.randn(B, Hkv, S, 16, generator=g)
    v = torch.randn(B, Hkv, S, 8, generator=g)
    ids = torch.zeros(B, S, dtype=torch.long)
    ids[:, cut:] = 1
    ids[1, 120:] = 2
    keep = torch.rand(B, S, generator=g) > 0.2
    spec = (
        ((masks.causal() & masks.sliding_window(40)) | masks.prefix_lm(torch.tensor([10, 30])))
        & masks.document(ids)
        & masks.key_mask(keep)
        & ~masks.padding(torch.tensor([0, 5]), q_lengths=torch.tensor([0, 3]))
        & masks.padding(torch.tensor([S, 150]), q_lengths=torch.tensor([140, L]))
    )
    return q, k, v, spec


def test_flex_matches_the_oracle_and_compiles_once_per_shape_and_spec() -> None:
    q, k, v, spec = _problem()
    L, S = q.shape[2], k.shape[2]
    dense = spec.to_dense(L, S)
    assert not dense[0, 0, 140:].any()  # rows that see nothing
    assert "not compiled for this shape and mask yet" in str(
        attnkit.explain(q, k, v, mask=spec, backend="flex")
    )
    out = attnkit.attention(q, k, v, mask=spec, backend="flex")
    ref = reference_attention(q, k, v, mask=dense)[0]
    naive = reference_attention(q, k, v, mask=dense, dtype=torch.float32)[0]
    within_naive(out, ref, naive)
    err = (out.double() - ref).abs().max().item()
    assert torch.equal(out[0, :, 140:], torch.zeros_like(out[0, :, 140:]))
    again = attnkit.attention(q, k, v, mask=spec, backend="flex")  # the cached kernel
    assert torch.equal(again, out)
    report = str(attnkit.explain(q, k, v, mask=spec, backend="flex"))
    assert "compiled and cached for this shape and mask (the first call took" in report
    assert "2 calls since" in report
    blocked = attnkit.attention(q, k, v, mask=spec, backend="blocked")
    assert (blocked - out).abs().max().item() <= 1e-5
    # the same spec structure with other values (document boundaries): a new block mask from
    # the new spec's block map, the compiled kernel reused (no new graph)
    graphs = counters["stats"]["unique_graphs"]
    _, _, _, other = _problem(cut=100)
    out2 = attnkit.attention(q, k, v, mask=other, backend="flex")
    assert counters["stats"]["unique_graphs"] == graphs
    ref2 = reference_attention(q, k, v, mask=other.to_dense(L, S))[0]
    assert (out2.double() - ref2).abs().max().item() <= 2 * err + 2e-6
    assert not torch.equal(out2, out)


def test_flex_gives_nan_to_exactly_the_rows_that_see_a_nonfinite_entry() -> None:
    """NaN or inf in k, v or q: NaN in the rows that may attend to it (the oracle's rule),
    every other row as without it. The same shape and spec structure as above: no new kernel."""
    q, k, v, spec = _problem()
    L, S = q.shape[2], k.shape[2]
    k[0, 1, 50, 3] = math.nan
    v[1, 0, 125, 0] = math.inf
    q[1, 3, 20, 2] = -math.inf
    out = attnkit.attention(q, k, v, mask=spec, backend="flex")
    dense = spec.to_dense(L, S)
    ref = reference_attention(q, k, v, mask=dense)[0]
    naive = reference_attention(q, k, v, mask=dense, dtype=torch.float32)[0]
    nan = ref.isnan().any(dim=-1)  # (B, H, L)
    assert nan[0, 2:].any()
    assert nan[1, :2].any()
    assert not nan[0, :2].any()
    assert torch.equal(out.isnan().all(dim=-1), nan)
    within_naive(out, ref, naive, where=~nan)


def _why(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: object) -> str | None:
    return attnkit.explain(q, k, v, **kw).verdicts["flex"]  # type: ignore[arg-type]


def test_flex_says_why_it_cannot_serve_and_compiles_nothing() -> None:
    before = len(flex._CACHE)
    q, k, v, spec = _problem()
    cases = [
        ({"mask": spec, "return_weights": True}, q, "does not return the attention weights"),
        ({"mask": spec, "dropout_p": 0.1}, q, "no dropout"),
        ({"mask": spec.to_dense(150, 170)}, q, "takes mask specs"),
        ({"mask": spec}, q.double(), "compiles float32, bfloat16 and float16, not torch.float64"),
        ({"mask": spec}, q.requires_grad_(True), "has no backward on CPU"),
        ({"causal": True}, q[:, :, :100].detach(), None),  # 100 x 170: two key blocks
    ]
    for kwargs, qq, message in cases:
        kk, vv = (k.double(), v.double()) if qq.dtype == torch.float64 else (k, v)
        why = _why(qq, kk, vv, **kwargs)
        if message is None:
            assert why is None
        else:
            assert why is not None
            assert message in why, why
            with pytest.raises(AttentionInputError, match="backend 'flex' cannot serve"):
                attnkit.attention(qq, kk, vv, backend="flex", **kwargs)  # type: ignore[call-overload]
    small = torch.randn(1, 2, 100, 16)
    assert "fit in one 128 x 128 block" in str(_why(small, small, small, causal=True))
    assert len(flex._CACHE) == before  # nothing compiled


class _Biased(MaskSpec):
    has_bias = True

    def allowed(self, b, h, q, kv, off):  # type: ignore[no-untyped-def]
        return kv <= q + off

    def bias(self, b, h, q, kv, off):  # type: ignore[no-untyped-def]
        return -(q + off - kv).float()

    def block_bounds(self, q_lo, q_hi, k_lo, k_hi, off):  # type: ignore[no-untyped-def]
        return masks.causal().block_bounds(q_lo, q_hi, k_lo, k_hi, off)


def test_flex_refuses_score_biases_that_blocked_serves() -> None:
    q = torch.randn(1, 2, 200, 16, dtype=torch.float64)
    why = _why(q.float(), q.float(), q.float(), mask=_Biased())
    assert why is not None
    assert "score biases" in why
    out = attnkit.attention(q, q, q, mask=_Biased(), backend="blocked")
    i, j = torch.arange(200)[:, None], torch.arange(200)[None, :]
    bias = (-(i - j).double()).masked_fill(j > i, -math.inf)
    assert (out - reference_attention(q, q, q, mask=bias)[0]).abs().max().item() <= 1e-10


def test_flex_is_never_auto_s_choice() -> None:
    q = torch.randn(1, 2, 300, 16)
    report = attnkit.explain(q, q, q, mask=masks.causal() & masks.sliding_window(64))
    assert report.chosen == "blocked"
    assert report.verdicts["flex"] is None
    assert "flex: can serve, but auto uses it only when named" in str(report)
