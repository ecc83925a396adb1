"""bfloat16 and float16 forward and backward on every backend that trains (issue 15, row 10:
bf16 backward with a sliding window used to fail inside ``blocked``'s ``index_add_``).

Against the float64 oracle, with flash-attention's tolerance rule: the backend's error must be
at most 2x (output) and 3x (gradients) the error of a naive run of the oracle in the same
dtype, plus a floor for the dtype's rounding near 1 (bfloat16 keeps 8 bits of mantissa,
2**-8 = 0.004; float16 keeps 11, 2**-11 = 0.0005): 0.02 and 0.002, for outputs and gradients
(values here are at most about 5). Sizes are awkward on purpose (L = 300 and S = 313 are
not multiples of any block), with grouped-query heads; at these sizes ``blocked`` runs a causal
window as several tiles per launch, whose key gradients overlap (the ``index_add_`` path).

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
Dk query/key head dim, Dv value head dim.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch

import attnkit
from attnkit import masks
from oracle import reference_attention, within_naive

B, H, Hkv, L, S, Dk, Dv = 2, 2, 1, 300, 313, 16, 16

SPECS = {
    "causal": masks.causal(),
    "causal-window": masks.causal() & masks.sliding_window(32),
    "documents": masks.document(torch.tensor([0] * 100 + [1] * 150 + [2] * 63)) & masks.causal(),
    "padding": masks.padding(torch.tensor([313, 141]), q_lengths=torch.tensor([300, 125])),
}


@dataclass(frozen=True)
class Reference:
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # q, k, v in float64
    dout: torch.Tensor  # (B, H, L, Dv) in the low dtype
    out: torch.Tensor  # the float64 oracle, from the inputs rounded to the low dtype
    grads: tuple[torch.Tensor, ...]
    naive_out: torch.Tensor  # the oracle run in the low dtype
    naive_grads: tuple[torch.Tensor, ...]


@functools.cache
def reference(dtype: torch.dtype, spec_name: str) -> Reference:
    """The oracle's output and gradients, in float64 and in ``dtype`` (shared by the backends)."""
    g = torch.Generator().manual_seed(15)
    q64 = torch.randn(B, H, L, Dk, generator=g, dtype=torch.float64)
    k64 = torch.randn(B, Hkv, S, Dk, generator=g, dtype=torch.float64)
    v64 = torch.randn(B, Hkv, S, Dv, generator=g, dtype=torch.float64)
    dout = torch.randn(B, H, L, Dv, generator=g, dtype=torch.float64).to(dtype)
    dense = SPECS[spec_name].to_dense(L, S)  # (B', 1, L, S) bool
    q, k, v = (t.to(dtype).double().requires_grad_(True) for t in (q64, k64, v64))
    out = reference_attention(q, k, v, mask=dense)[0]
    grads = torch.autograd.grad(out, (q, k, v), dout.double())
    qn, kn, vn = (t.to(dtype).requires_grad_(True) for t in (q64, k64, v64))
    naive = reference_attention(qn, kn, vn, mask=dense, dtype=dtype)[0]
    naive_grads = torch.autograd.grad(naive, (qn, kn, vn), dout)
    return Reference((q64, k64, v64), dout, out.detach(), grads, naive.detach(), naive_grads)


@pytest.mark.parametrize("backend", ["math", "sdpa", "blocked"])
@pytest.mark.parametrize("spec_name", list(SPECS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_forward_and_backward_match_the_oracle(
    dtype: torch.dtype, spec_name: str, backend: str
) -> None:
    ref = reference(dtype, spec_name)
    q, k, v = (t.to(dtype).requires_grad_(True) for t in ref.inputs)
    out = attnkit.attention(q, k, v, mask=SPECS[spec_name], backend=backend)
    assert out.dtype == dtype
    grads = torch.autograd.grad(out, (q, k, v), ref.dout)

    assert not out.isnan().any()
    within_naive(out, ref.out, ref.naive_out)
    for name, got, want, naive in zip("qkv", grads, ref.grads, ref.naive_grads, strict=True):
        assert got.dtype == dtype, name
        assert not got.isnan().any(), name
        within_naive(got, want, naive, grad=True, what=name)
    if spec_name == "padding":  # query rows past q_lengths see nothing: output and dq are 0
        assert torch.equal(out[1, :, 125:], torch.zeros_like(out[1, :, 125:]))
        assert torch.equal(grads[0][1, :, 125:], torch.zeros_like(grads[0][1, :, 125:]))
