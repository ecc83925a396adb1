"""attnkit's AVX2 band kernel (causal sliding window, float32, CPU) against the float64 oracle,
and how the blocked backend hands it the calls it serves.

The kernel is built by ``make setup`` (``attnkit.backends.blocked.band.main()``); these tests
need it built: a machine without gcc or AVX2 fails them rather than skipping (the blocked
backend itself still runs there, on torch's kernel, and says so in ``explain``).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import masks
from attnkit.backends import blocked
from attnkit.backends.blocked import band
from attnkit.masks import alibi
from oracle import reference_attention


def _oracle(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    L = q.shape[2]
    i = torch.arange(L)[:, None]
    j = torch.arange(L)[None, :]
    allowed = (j <= i) & (j > i - window)
    out, _ = reference_attention(q, k, v, mask=allowed, scale=scale)
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    lse = torch.logsumexp(scores.masked_fill(~allowed, -math.inf), dim=-1)
    return out, lse


def test_the_kernel_is_built_here() -> None:
    assert band.available(), band.status()
    assert band.status() == "attnkit's AVX2 band kernel"


@settings(max_examples=40, deadline=None)
@given(
    B=st.integers(1, 2),
    H=st.integers(1, 3),
    L=st.integers(1, 300),
    window=st.integers(1, 400),
    D=st.sampled_from([8, 20, 32, 64, 128]),
    scale=st.sampled_from([None, 0.05, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_band_kernel_equals_the_float64_oracle(
    B: int, H: int, L: int, window: int, D: int, scale: float | None, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, L, D, generator=gen) for _ in range(3))
    s = D**-0.5 if scale is None else scale
    out, lse = band.kernel().band_forward(q, k, v, window, s)
    want_out, want_lse = _oracle(q, k, v, window, s)
    assert out.shape == (B, H, L, D)
    assert lse.shape == (B, H, L)
    assert out.dtype == lse.dtype == torch.float32
    # float32 rounding of the scores grows with their spread (|q.k| * scale)
    spread = float((q.abs().amax() * k.abs().amax()) * D * s)
    assert (out.double() - want_out).abs().max() <= 1e-5 * max(1.0, spread / 8)
    assert (lse.double() - want_lse).abs().max() <= 1e-4 * max(1.0, spread / 8)


def test_non_contiguous_inputs_are_read_correctly() -> None:
    x = torch.randn(2, 100, 3, 32)  # (B, L, H, D) in memory, as projections leave it
    q = k = v = x.transpose(1, 2)
    out, lse = band.kernel().band_forward(q, k, v, 17, 0.2)
    want_out, want_lse = _oracle(q, k, v, 17, 0.2)
    assert (out.double() - want_out).abs().max() <= 1e-5
    assert (lse.double() - want_lse).abs().max() <= 1e-4


@pytest.mark.parametrize(
    ("spec", "window"),
    [
        (masks.causal() & masks.sliding_window(5), 5),
        (masks.sliding_window(9) & masks.causal(), 9),
        (masks.sliding_window(5), None),  # two-sided
        (masks.causal(), None),
        (masks.causal() & masks.sliding_window(5) & masks.padding(torch.tensor([7])), None),
        (alibi(2) & masks.causal(), None),
        (None, None),
    ],
)
def test_the_band_is_recognised_exactly(spec: masks.MaskSpec | None, window: int | None) -> None:
    assert masks.causal_window(spec) == window


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[object, ...]]:
    seen: list[tuple[object, ...]] = []
    real = band.kernel()

    class Spy:
        def band_forward(self, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
            seen.append((*args[0].shape, args[3]))
            return real.band_forward(*args)  # type: ignore[no-any-return]

        def band_backward(self, *args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            seen.append(("backward", *args[0].shape))
            return real.band_backward(*args)  # type: ignore[no-any-return]

    monkeypatch.setattr(band, "kernel", Spy)
    return seen


def test_attention_and_training_with_a_causal_window_use_the_kernel(
    calls: list[tuple[object, ...]],
) -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 150, 16, generator=gen) for _ in range(3))
    g = torch.randn(2, 3, 150, 16, generator=gen)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attnkit.attention(*leaves, causal=True, mask=masks.sliding_window(40))
    (out * g).sum().backward()
    assert calls == [(2, 3, 150, 16, 40), ("backward", 2, 3, 150, 16)]
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    spec = masks.causal() & masks.sliding_window(40)
    want = attnkit.attention(*ref, mask=spec, backend="math")
    (want * g.double()).sum().backward()
    assert (out.double() - want).abs().max() <= 1e-5
    for a, b in zip(leaves, ref, strict=True):
        assert a.grad is not None
        assert b.grad is not None
        assert (a.grad.double() - b.grad).abs().max() <= 1e-5


def test_calls_the_kernel_does_not_serve_go_to_torchs_kernel(
    calls: list[tuple[object, ...]], monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = masks.causal() & masks.sliding_window(8)
    q = torch.randn(1, 4, 64, 16)
    kv = torch.randn(1, 2, 64, 16)
    attnkit.attention(q, kv, kv, mask=spec, backend="blocked")  # grouped-query heads
    # bfloat16 as it is (the CPU path `torch`; on `fp32-upcast` the kernel sees float32
    # copies: tests/test_low_precision_paths.py)
    monkeypatch.setenv("ATTNKIT_CPU_PATH", "torch")
    attnkit.attention(q.bfloat16(), q.bfloat16(), q.bfloat16(), mask=spec, backend="blocked")
    attnkit.attention(q, q[:, :, :32], q[:, :, :32], mask=spec, backend="blocked")  # L != S
    out, lse = blocked.forward_with_lse(q, q, q, mask=spec, scale=0.25, q_start=32, k_start=32)
    assert calls == []
    assert out.shape == (1, 4, 64, 16)
    assert lse.shape == (1, 4, 64)
    note = attnkit.explain(q.bfloat16(), q.bfloat16(), q.bfloat16(), mask=spec).notes["blocked"]
    assert "band kernel is float32-only (q is torch.bfloat16)" in note


def test_explain_says_which_kernel_runs_the_band(monkeypatch: pytest.MonkeyPatch) -> None:
    q = torch.randn(1, 2, 256, 32)
    spec = masks.causal() & masks.sliding_window(64)
    note = attnkit.explain(q, q, q, mask=spec).notes["blocked"]
    assert note == (
        "causal sliding window 64: forward and backward run attnkit's AVX2 band kernel "
        "(one pass each, no tiles); under torch.compile the same, as one custom op "
        "(attnkit::blocked_attention)"
    )
    # switched off (as on a machine where it cannot be built): torch's kernel, and why
    monkeypatch.setenv(band.ENV, "0")
    monkeypatch.setattr(band, "_tried", False)
    monkeypatch.setattr(band, "_module", None)
    assert not band.available()
    assert band.status() == (
        "torch's fused kernel (attnkit's band kernel is off: ATTNKIT_BAND_KERNEL=0 in the "
        "environment)"
    )
    note = attnkit.explain(q, q, q, mask=spec).notes["blocked"]
    assert "causal sliding window 64 (torch's fused kernel (attnkit's band kernel is off" in note
    out = attnkit.attention(q, q, q, mask=spec)
    want, _ = _oracle(q, q, q, 64, 32**-0.5)
    assert (out.double() - want).abs().max() <= 1e-5


@settings(max_examples=25, deadline=None)
@given(
    B=st.integers(1, 2),
    H=st.integers(1, 3),
    L=st.integers(1, 300),
    window=st.integers(1, 400),
    D=st.sampled_from([8, 20, 32, 64, 128]),
    seed=st.integers(0, 2**16),
)
def test_band_backward_equals_float64_autograd(
    B: int, H: int, L: int, window: int, D: int, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    q, k, v, g = (torch.randn(B, H, L, D, generator=gen) for _ in range(4))
    s = D**-0.5
    out, lse = band.kernel().band_forward(q, k, v, window, s)
    dq, dk, dv = band.kernel().band_backward(q, k, v, out, g, lse, window, s)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    i = torch.arange(L)[:, None]
    j = torch.arange(L)[None, :]
    allowed = (j <= i) & (j > i - window)
    scores = (leaves[0] @ leaves[1].transpose(-1, -2)) * s
    want = torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1) @ leaves[2]
    (want * g.double()).sum().backward()
    for got, ref in zip((dq, dk, dv), leaves, strict=True):
        assert got.shape == (B, H, L, D)
        assert got.dtype == torch.float32
        assert ref.grad is not None
        assert (got.double() - ref.grad).abs().max() <= 1e-4
