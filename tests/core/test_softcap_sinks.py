"""Logit soft-capping (Gemma 2) and attention sinks (gpt-oss ``s_aux`` ``(H,)``, Inkling 2's
per-token ``(B, H, L)``) against the float64 oracle, forward and backward, on every backend
that serves them (``math`` and ``blocked``); the others refuse them with the reason.

Tolerances: float64 backends must match the oracle to 1e-9 (outputs and gradients); float32 to
2e-5 relative to the largest value (the exact float32 softmax of the oracle differs from a
blocked online softmax by a few units of float32 rounding over a row).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import AttentionInputError, masks
from attnkit.backends.blocked import rowspan_builds
from attnkit.masks import MaskSpec
from oracle import reference_attention
from strategies import Sizes, qkv, specs

SIZES = Sizes(
    batch=(1, 2),
    kv_heads=(1, 2),
    groups=(1, 2),
    lengths=(1, 5, 33, 70),
    head_dims=(8, 16),
    value_dims=(8, 12),
)
TOL = {torch.float64: 1e-9, torch.float32: 2e-5}


def _oracle(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: MaskSpec | None,
    causal: bool,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    L, S = q.shape[2], k.shape[2]
    dense = masks.as_spec(spec, causal, L=L, S=S)
    mask = None if dense is None else dense.to_dense(L, S, dtype=torch.float64)
    out, _ = reference_attention(q, k, v, mask=mask, softcap=softcap, sinks=sinks)
    return out


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    err = (got.double() - want).abs().max().item() if got.numel() else 0.0
    bound = TOL[dtype] * max(1.0, want.abs().max().item() if want.numel() else 1.0)
    assert err <= bound, f"{what}: error {err:.3g} > {bound:.3g}"


@settings(deadline=None)
@given(
    data=st.data(),
    backend=st.sampled_from(["math", "blocked", "auto"]),
    dtype=st.sampled_from([torch.float64, torch.float32]),
    softcap=st.one_of(st.none(), st.floats(0.5, 30.0)),
    sink_rows=st.sampled_from([None, "H", "BHL", "1HL"]),
    causal=st.booleans(),
)
def test_softcap_and_sinks_match_the_oracle(
    data: st.DataObject,
    backend: str,
    dtype: torch.dtype,
    softcap: float | None,
    sink_rows: str | None,
    causal: bool,
) -> None:
    q, k, v = data.draw(qkv(SIZES, dtype))
    B, H, L = q.shape[:3]
    S = k.shape[2]
    spec = data.draw(st.one_of(st.none(), specs(B, L, S, depth=1)))
    if softcap is None and sink_rows is None:
        softcap = 5.0  # every example exercises at least one of the two
    sink_shape = {None: None, "H": (H,), "BHL": (B, H, L), "1HL": (1, H, L)}[sink_rows]
    sinks = (
        None if sink_shape is None else torch.randn(sink_shape, dtype=torch.float64).to(dtype) * 2
    )
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sink_leaf = sinks.clone().requires_grad_() if sinks is not None else None
    out = attnkit.attention(
        *leaves, mask=spec, causal=causal, softcap=softcap, sinks=sink_leaf, backend=backend
    )
    g = torch.randn(out.shape, dtype=torch.float64).to(dtype)
    (out * g).sum().backward()
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref_sink = sinks.double().requires_grad_() if sinks is not None else None
    ref = _oracle(*ref_leaves, spec, causal, softcap, ref_sink)
    (ref * g.double()).sum().backward()
    _close(out, ref, dtype, "out")
    for name, got, want in zip("qkv", leaves, ref_leaves, strict=True):
        assert got.grad is not None
        assert want.grad is not None
        _close(got.grad, want.grad, dtype, f"d{name}")
    if sink_leaf is not None:
        assert sink_leaf.grad is not None
        assert ref_sink is not None
        assert ref_sink.grad is not None
        _close(sink_leaf.grad, ref_sink.grad, dtype, "dsinks")


def test_a_row_that_sees_nothing_gives_zero_with_sinks_too() -> None:
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(1, 2, 4, 8, dtype=torch.float64, requires_grad=True)
    sinks = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    keep = torch.tensor([[False, False, False, False]])  # no key at all
    for backend in ("math", "blocked"):
        out = attnkit.attention(q, kv, kv, mask=masks.key_mask(keep), sinks=sinks, backend=backend)
        assert torch.equal(out, torch.zeros_like(out))
        grads = torch.autograd.grad(out.sum(), (q, kv, sinks))
        assert all(torch.equal(gr, torch.zeros_like(gr)) for gr in grads)


def test_auto_takes_blocked_for_long_soft_capped_calls_and_explain_says_so() -> None:
    q = torch.randn(1, 2, 256, 16)
    e = attnkit.explain(q, q, q, causal=True, softcap=30.0)
    assert e.chosen == "blocked"
    assert "a soft-cap or sinks (no fused torch kernel)" in e.rule
    assert "softcap: 30.0; sinks: none" in e.summary
    assert e.verdicts["sdpa"] == "torch's fused kernels have no logit soft-cap or attention sinks"
    assert "no soft-cap" in str(e.verdicts["flex"]) or "soft-cap" in str(e.verdicts["flex"])
    window = attnkit.explain(q, q, q, mask=masks.causal() & masks.sliding_window(64), softcap=5.0)
    runs = rowspan_builds.status()
    assert window.notes["blocked"].startswith(
        f"causal sliding window 64, soft-capped at 5: forward and backward run {runs}"
    )
    small = torch.randn(1, 2, 8, 16)
    assert attnkit.explain(small, small, small, sinks=torch.zeros(2)).chosen == "math"


@pytest.mark.parametrize(
    ("kwargs", "argument", "needle"),
    [
        ({"softcap": 0.0}, "softcap", "`softcap` must be a positive finite number, got 0.0"),
        ({"softcap": float("inf")}, "softcap", "must be a positive finite number, got inf"),
        ({"softcap": True}, "softcap", "got True"),
        ({"sinks": [0.0, 0.0]}, "sinks", "`sinks` is not a tensor"),
        ({"sinks": torch.zeros(3)}, "sinks", "holds one logit per query head"),
        ({"sinks": torch.zeros(2, dtype=torch.float64)}, "sinks", "another dtype or device"),
    ],
)
def test_bad_softcap_and_sinks_are_named(
    kwargs: dict[str, object], argument: str, needle: str
) -> None:
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(AttentionInputError, match="expected: ") as info:
        attnkit.attention(q, q, q, **kwargs)  # type: ignore[arg-type]
    assert info.value.argument == argument
    assert needle in str(info.value)


def test_named_backends_without_them_refuse() -> None:
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(AttentionInputError, match="no logit soft-cap or attention sinks"):
        attnkit.attention(q, q, q, softcap=5.0, backend="sdpa")
