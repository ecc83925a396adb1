"""The CUDA tier: every backend and every spec kind on the GPU against the float64 oracle.

Marked ``cuda`` (``make test-cuda`` runs ``pytest -m cuda``); skipped with the reason where
``torch.cuda.is_available()`` is False (tests/conftest.py). Mirrors the CPU tests'
structure (tests/core/test_low_precision_backward.py): q, k, v drawn in float64 on the CPU, rounded
to the dtype under test, moved to the GPU; the oracle runs on the CPU in float64 on the same
rounded inputs, and once more in the dtype under test (the "naive run").

Tolerance (flash-attention's rule, as everywhere in attnkit's tests): a backend's error against
the oracle is at most 2x (output, log-sum-exp) / 3x (gradients) the naive run's error, plus a
floor for the dtype's rounding near 1 at these magnitudes (values here are at most about 5):
float32 2e-4 (GPU reductions sum in another order than the CPU's), float16 2e-3 (11 bits of
mantissa), bfloat16 2e-2 (8 bits).

Sizes are awkward on purpose (L = 300, S = 313: no multiple of any block), with grouped-query
heads (H = 4, Hkv = 2), batch-dependent specs, and rows that see nothing (padding with
q_lengths), whose output and dq must be exactly 0.

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
Dk query/key head dim, Dv value head dim.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

import attnkit
from attnkit import masks
from attnkit.backends.blocked import forward_with_lse
from attnkit.masks import MaskSpec
from oracle import reference_attention, within_naive

pytestmark = pytest.mark.cuda

B, H, Hkv, L, S, Dk, Dv = 2, 4, 2, 300, 313, 64, 64
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BACKENDS = ["math", "sdpa", "blocked", "flex", "auto"]


def _ids(device: str) -> torch.Tensor:
    ids = torch.zeros(B, S, dtype=torch.long)
    ids[:, 100:] = 1
    ids[1, 250:] = 2
    return ids.to(device)


#: every kind of mask attnkit takes, built on a device (the backend's) or on the CPU (oracle)
SPECS: dict[str, Callable[[str], MaskSpec | torch.Tensor | None]] = {
    "none": lambda d: None,
    "causal": lambda d: masks.causal(),
    "causal-window": lambda d: masks.causal() & masks.sliding_window(64),
    "window": lambda d: masks.sliding_window(40),
    "documents": lambda d: masks.causal() & masks.document(_ids(d)),
    "padding": lambda d: masks.padding(
        torch.tensor([S, 141], device=d), q_lengths=torch.tensor([L, 125], device=d)
    ),
    "key_mask": lambda d: masks.key_mask(
        (torch.arange(S) % 3 != 0).expand(B, S).contiguous().to(d)
    ),
    "prefix_lm": lambda d: masks.prefix_lm(torch.tensor([20, 150], device=d)),
    "alibi": lambda d: masks.causal() & masks.alibi(H, device=d),
    "combined": lambda d: (
        (
            (masks.causal() & masks.sliding_window(40))
            | masks.prefix_lm(torch.tensor([10, 30], device=d))
        )
        & masks.document(_ids(d))
        & ~masks.padding(torch.tensor([0, 5], device=d), q_lengths=torch.tensor([0, 3], device=d))
    ),
    "dense-bool": lambda d: (torch.rand(L, S, generator=torch.Generator().manual_seed(3)) > 0.3).to(
        d
    ),
}

#: the refusals a backend may give on a GPU; anything else it must serve
MAY_REFUSE = {
    "flex": {
        "alibi": "score biases (has_bias) are not wired into flex's score_mod",
        "dense-bool": "it takes mask specs",
    },
}


def _dense(name: str) -> torch.Tensor | None:
    """The mask of ``name`` as the oracle takes it: a CPU tensor, bool or float."""
    m = SPECS[name]("cpu")
    if m is None or isinstance(m, torch.Tensor):
        return m
    return m.to_dense(L, S)


@dataclass(frozen=True)
class Reference:
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # q, k, v in float64 (CPU)
    dout: torch.Tensor  # (B, H, L, Dv) in the dtype under test (CPU)
    out: torch.Tensor  # the float64 oracle on the inputs rounded to the dtype
    grads: tuple[torch.Tensor, ...]
    lse: torch.Tensor  # (B, H, L) float64, -inf for rows that see nothing
    naive_out: torch.Tensor  # the oracle run in the dtype under test
    naive_grads: tuple[torch.Tensor, ...]
    naive_lse: torch.Tensor


def _lse(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """log-sum-exp over the allowed keys of the scaled scores (bias included), per row."""
    kk = k.repeat_interleave(H // Hkv, dim=1)
    s = (q @ kk.transpose(-1, -2)) / math.sqrt(Dk)  # (B, H, L, S)
    if mask is not None and mask.dtype == torch.bool:
        s = s.masked_fill(~mask, float("-inf"))
    elif mask is not None:
        s = s + mask.to(s.dtype)
    return torch.logsumexp(s, dim=-1)


@functools.cache
def reference(dtype: torch.dtype, name: str) -> Reference:
    g = torch.Generator().manual_seed(16)
    q64 = torch.randn(B, H, L, Dk, generator=g, dtype=torch.float64)
    k64 = torch.randn(B, Hkv, S, Dk, generator=g, dtype=torch.float64)
    v64 = torch.randn(B, Hkv, S, Dv, generator=g, dtype=torch.float64)
    dout = torch.randn(B, H, L, Dv, generator=g, dtype=torch.float64).to(dtype)
    mask = _dense(name)
    q, k, v = (t.to(dtype).double().requires_grad_(True) for t in (q64, k64, v64))
    out = reference_attention(q, k, v, mask=mask)[0]
    grads = torch.autograd.grad(out, (q, k, v), dout.double())
    qn, kn, vn = (t.to(dtype).requires_grad_(True) for t in (q64, k64, v64))
    naive = reference_attention(qn, kn, vn, mask=mask, dtype=dtype)[0]
    naive_grads = torch.autograd.grad(naive, (qn, kn, vn), dout)
    with torch.no_grad():
        lse = _lse(q.detach(), k.detach(), mask)
        naive_lse = _lse(qn.detach(), kn.detach(), mask).to(dtype)
    return Reference(
        (q64, k64, v64), dout, out.detach(), grads, lse, naive.detach(), naive_grads, naive_lse
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_backend_and_spec_kind_matches_the_oracle_on_the_gpu(
    dtype: torch.dtype, name: str, backend: str
) -> None:
    ref = reference(dtype, name)
    q, k, v = (t.to(dtype).cuda().requires_grad_(True) for t in ref.inputs)
    mask = SPECS[name]("cuda")
    if backend != "auto":
        why = attnkit.explain(q, k, v, mask=mask, backend="auto").verdicts[backend]
        if why is not None:  # a refusal must be one this backend is known to give on CUDA
            allowed = MAY_REFUSE.get(backend, {}).get(name)
            torch_rule = backend == "sdpa" and why.startswith("torch reports no fused CUDA kernel")
            assert torch_rule or (allowed is not None and allowed in why), why
            return
    out = attnkit.attention(q, k, v, mask=mask, backend=backend)
    assert out.device.type == "cuda"
    assert out.dtype == dtype
    grads = torch.autograd.grad(out, (q, k, v), ref.dout.cuda())
    assert not out.isnan().any()
    within_naive(out, ref.out, ref.naive_out)
    for part, got, want, naive in zip("qkv", grads, ref.grads, ref.naive_grads, strict=True):
        assert got.dtype == dtype, part
        assert not got.isnan().any(), part
        within_naive(got, want, naive, grad=True, what=part)
    if name == "padding":  # query rows past q_lengths see nothing: output and dq are exactly 0
        assert torch.equal(out[1, :, 125:], torch.zeros_like(out[1, :, 125:]))
        assert torch.equal(grads[0][1, :, 125:], torch.zeros_like(grads[0][1, :, 125:]))


@pytest.mark.parametrize("name", [n for n in SPECS if n != "dense-bool"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_blocked_log_sum_exp_matches_the_oracle_on_the_gpu(dtype: torch.dtype, name: str) -> None:
    """The log-sum-exp ring attention merges with: float32 (``-inf`` for rows that see none)."""
    ref = reference(dtype, name)
    q, k, v = (t.to(dtype).cuda() for t in ref.inputs)
    spec = SPECS[name]("cuda")
    out, lse = forward_with_lse(q, k, v, mask=spec, scale=1 / math.sqrt(Dk))  # type: ignore[arg-type]
    assert lse.shape == (B, H, L)
    within_naive(out, ref.out, ref.naive_out)
    dead = ref.lse == float("-inf")
    assert torch.equal(lse.cpu() == float("-inf"), dead)
    within_naive(lse, ref.lse, ref.naive_lse, where=~dead, what="log-sum-exp")


@pytest.mark.parametrize("backend", ["math", "blocked", "flex", "auto"])
def test_value_head_dim_other_than_the_key_s_on_the_gpu(backend: str) -> None:
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 200, 32, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, 260, 32, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, 260, 64, generator=g, dtype=torch.float64)
    spec = masks.causal() & masks.sliding_window(50)
    ref = reference_attention(q, k, v, mask=spec.to_dense(200, 260))[0]
    naive = reference_attention(q, k, v, mask=spec.to_dense(200, 260), dtype=torch.float32)[0]
    out = attnkit.attention(*(t.float().cuda() for t in (q, k, v)), mask=spec, backend=backend)
    assert out.shape == (1, 4, 200, 64)
    within_naive(out, ref, naive)
