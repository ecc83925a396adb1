"""attention() and explain(): conventions, dispatch, dropout, fully masked rows, gradcheck."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import AttentionInputError, attention, causal_mask, explain, masks
from oracle import reference_attention

# flex serves no float64 and compiles a kernel per shape: tests/backends/test_flex.py covers it
BACKENDS = [name for name in attnkit.available_backends() if name != "flex"]


def _qkv(B=2, H=4, Hkv=2, L=5, S=7, Dk=8, Dv=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, H, L, Dk, generator=g, dtype=dtype),
        torch.randn(B, Hkv, S, Dk, generator=g, dtype=dtype),
        torch.randn(B, Hkv, S, Dv, generator=g, dtype=dtype),
    )


def test_causal_mask_is_aligned_to_the_end() -> None:
    assert causal_mask(2, 4).int().tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert causal_mask(4, 2).int().tolist() == [[0, 0], [0, 0], [1, 0], [1, 1]]
    assert torch.equal(causal_mask(5, 5), torch.ones(5, 5, dtype=torch.bool).tril())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("L", "S"), [(3, 7), (7, 7), (7, 3), (1, 9)])
def test_causal_matches_the_end_aligned_mask(backend: str, L: int, S: int) -> None:
    q, k, v = _qkv(L=L, S=S)
    got = attention(q, k, v, causal=True, backend=backend)
    explicit = attention(q, k, v, mask=causal_mask(L, S), backend="math")
    assert torch.allclose(got, explicit, atol=1e-12)
    assert torch.allclose(got, reference_attention(q, k, v, causal=True)[0], atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_and_mask_together(backend: str) -> None:
    q, k, v = _qkv(L=6, S=6)
    pad = torch.tensor([True] * 4 + [False] * 2)  # keys 4, 5 are padding
    out = attention(q, k, v, mask=pad, causal=True, backend=backend)
    both = causal_mask(6, 6) & pad
    assert torch.allclose(out, reference_attention(q, k, v, mask=both)[0], atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bool_and_float_masks_agree(backend: str) -> None:
    q, k, v = _qkv()
    allowed = torch.rand(2, 1, 5, 7, generator=torch.Generator().manual_seed(1)) > 0.3
    allowed[..., 0] = True
    additive = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, -torch.inf)
    a = attention(q, k, v, mask=allowed, backend=backend)
    b = attention(q, k, v, mask=additive, backend=backend)
    assert torch.allclose(a, b, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["mask", "causal L > S", "S = 0"])
def test_fully_masked_rows_give_zero_output_and_zero_gradient(backend: str, where: str) -> None:
    S = 0 if where == "S = 0" else 4
    q, k, v = (t.requires_grad_(True) for t in _qkv(L=6, S=S))
    mask = None
    if where == "mask":
        mask = torch.ones(2, 1, 6, S, dtype=torch.bool)
        mask[:, :, [1, 4]] = False  # query rows 1 and 4 see nothing
        dead = [1, 4]
    else:
        dead = [0, 1] if where == "causal L > S" else list(range(6))
    out = attention(q, k, v, mask=mask, causal=where == "causal L > S", backend=backend)
    assert not out.isnan().any()
    assert torch.equal(out[:, :, dead], torch.zeros_like(out[:, :, dead]))
    out.backward(torch.randn_like(out))
    for t in (q, k, v):
        assert t.grad is not None
        assert not t.grad.isnan().any()
    assert torch.equal(q.grad[:, :, dead], torch.zeros_like(q.grad[:, :, dead]))


def test_fully_masked_rows_have_zero_weights() -> None:
    q, k, v = _qkv(L=3, S=3)
    mask = torch.tensor([[True, True, False], [False, False, False], [True, True, True]])
    out, weights = attention(q, k, v, mask=mask, return_weights=True)
    assert weights is not None
    assert out[:, :, 1].abs().sum() == 0
    assert weights[:, :, 1].abs().sum() == 0
    assert torch.allclose(weights[:, :, [0, 2]].sum(-1), torch.ones(2, 4, 2, dtype=q.dtype))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["none", "causal", "bool", "float", "gqa-causal"])
def test_gradcheck_float64(backend: str, kind: str) -> None:
    Hkv = 1 if kind == "gqa-causal" else 2
    q, k, v = (t.requires_grad_(True) for t in _qkv(B=1, H=2, Hkv=Hkv, L=4, S=5, Dk=3, Dv=3))
    mask = None
    g = torch.Generator().manual_seed(3)
    if kind == "bool":
        mask = torch.rand(4, 5, generator=g) > 0.3
    elif kind == "float":
        mask = torch.randn(1, 2, 4, 5, generator=g, dtype=torch.float64)

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention(q, k, v, mask=mask, causal="causal" in kind, backend=backend)

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_gradcheck_through_a_float_mask() -> None:
    q, k, v = (t.requires_grad_(True) for t in _qkv(B=1, H=2, Hkv=2, L=3, S=4, Dk=3, Dv=2))
    bias = torch.randn(1, 2, 3, 4, dtype=torch.float64, requires_grad=True)
    assert explain(q, k, v, mask=bias).chosen == "math"  # torch's fused CPU kernel cannot
    assert torch.autograd.gradcheck(lambda b: attention(q, k, v, mask=b), (bias,))


def test_scale_is_used_and_defaults_to_inverse_sqrt_dk() -> None:
    q, k, v = _qkv(Dk=16)
    assert torch.allclose(attention(q, k, v), attention(q, k, v, scale=0.25), atol=1e-14)
    assert torch.allclose(
        attention(q, k, v, scale=0.7), reference_attention(q, k, v, scale=0.7)[0], atol=1e-12
    )


def test_dv_differs_from_dk_and_l_from_s() -> None:
    q, k, v = _qkv(L=3, S=11, Dk=24, Dv=28)
    out = attention(q, k, v)
    assert out.shape == (2, 4, 3, 28)
    assert explain(q, k, v).chosen == "math"
    assert torch.allclose(out, reference_attention(q, k, v)[0], atol=1e-12)


def test_grouped_query_heads_map_like_repeat_interleave() -> None:
    q, k, v = _qkv(H=6, Hkv=2)
    expanded = attention(q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1))
    for backend in BACKENDS:
        assert torch.allclose(attention(q, k, v, backend=backend), expanded, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_query_does_not_repeat_kv(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = _qkv(H=8, Hkv=1)

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("K/V were repeated per query head")

    monkeypatch.setattr(torch, "repeat_interleave", forbidden)
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", forbidden)
    monkeypatch.setattr(torch.Tensor, "repeat", forbidden)
    attention(q, k, v, backend=backend)


def test_return_weights_returns_output_and_weights_together() -> None:
    q, k, v = _qkv()
    result = attention(q, k, v, return_weights=True)
    assert isinstance(result, attnkit.AttentionOutput)
    out, weights = result
    assert weights is not None
    assert weights.shape == (2, 4, 5, 7)
    assert torch.allclose(out, attention(q, k, v), atol=1e-12)
    assert torch.allclose(weights.sum(-1), torch.ones(2, 4, 5, dtype=q.dtype))


def test_dropout_only_when_asked() -> None:
    q, k, v = _qkv(dtype=torch.float32)
    assert torch.equal(attention(q, k, v, dropout_p=0.0), attention(q, k, v))
    assert explain(q, k, v, dropout_p=0.5).chosen == "math"  # the fused CPU kernel has none
    torch.manual_seed(0)
    out, dropped = attention(q, k, v, dropout_p=0.5, return_weights=True)
    _, clean = attention(q, k, v, return_weights=True)
    assert dropped is not None
    assert clean is not None
    kept = dropped != 0
    assert 0.3 < kept.float().mean().item() < 0.7
    assert torch.allclose(dropped[kept], clean[kept] / 0.5)  # inverted dropout scaling
    assert torch.allclose(out, dropped @ v.repeat_interleave(2, dim=1), atol=1e-6)


def test_named_backend_that_cannot_serve_raises_instead_of_falling_back() -> None:
    q, k, v = _qkv(Dk=8, Dv=4)
    with pytest.raises(AttentionInputError, match="backend 'sdpa' cannot serve") as info:
        attention(q, k, v, backend="sdpa")
    assert info.value.argument == "backend"
    assert "Dv=4 differs from Dk=8" in str(info.value)


def test_explain_reports_the_choice_and_each_reason() -> None:
    q = torch.randn(1, 8, 64, 32)
    report = explain(q, q, q, return_weights=True)
    assert report.chosen == "math"
    assert report.verdicts["math"] is None
    assert "return the attention weights" in str(report.verdicts["sdpa"])
    text = str(report)
    assert "auto takes: math" in text
    assert "sdpa: cannot serve: fused kernels do not return the attention weights" in text
    text = str(explain(q, q, q, causal=True))
    assert "auto takes: sdpa" in text
    assert "math: can serve, but auto prefers sdpa" in text
    assert "backend='math' named" in str(explain(q, q, q, backend="math"))


def test_explain_validates_like_attention() -> None:
    q = torch.randn(1, 8, 64, 32)
    with pytest.raises(AttentionInputError, match=r"^attnkit\.explain: "):
        explain(q, q[..., :16], q)


def test_inverted_causal_mask_of_seed_001_warns() -> None:
    q, k, v = _qkv(L=6, S=6, Hkv=4)
    seed_001_mask = torch.ones(6, 6).triu(1).bool()
    with pytest.warns(attnkit.AttentionMaskWarning, match=r"causal=True.*~mask"):
        attention(q, k, v, mask=seed_001_mask)
    attention(q, k, v, mask=~seed_001_mask)  # the fix: no warning (warnings are errors here)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_per_head_mask_that_blocks_one_head_entirely(backend: str) -> None:
    # Regression: blocked's one-call shortcut used to run a single head's plan on every head.
    q, k, v = (t.requires_grad_(True) for t in _qkv(B=1, H=2, Hkv=1, L=1, S=1))
    mask = torch.tensor([True, False]).view(1, 2, 1, 1)  # head 1 sees nothing
    out = attention(q, k, v, mask=mask, backend=backend)
    ref = reference_attention(q, k, v, mask=mask)[0]
    assert torch.allclose(out, ref, atol=1e-12)
    assert torch.equal(out[:, 1], torch.zeros_like(out[:, 1]))
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    for g, r in zip(grads, ref_grads, strict=True):
        assert torch.allclose(g, r, atol=1e-12)


def test_explain_never_materialises_a_spec(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """At L = S = 65536 a dense mask would be 4 GiB: explain shows the dense-mask backends a
    zero-stride stand-in with the mask's shape and dtype, and their verdicts stay the same
    (under an ample memory limit: the verdicts here are the backends' own)."""
    from attnkit.masks import MaskSpec, causal, sliding_window
    from attnkit.modules.positions import alibi

    previous = attnkit.set_memory_limit(2**50)
    request.addfinalizer(lambda: attnkit.set_memory_limit(previous))

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("explain materialised a mask spec")

    small = torch.randn(1, 2, 64, 8)
    spec = causal() & sliding_window(16)
    want = attnkit.explain(small, small, small, mask=spec, backend="sdpa")
    monkeypatch.setattr(MaskSpec, "to_dense", refuse)
    q = torch.randn(1, 1, 65536, 8)
    e = attnkit.explain(q, q, q, mask=spec)
    assert e.chosen == "blocked"
    assert e.verdicts["sdpa"] is None
    assert e.verdicts["math"] is None
    assert attnkit.explain(small, small, small, mask=spec, backend="sdpa").verdicts == want.verdicts
    # with a bias (ALiBi) the stand-in is a float (1, H, L, S) mask
    qh = torch.randn(1, 2, 4096, 8, requires_grad=True)
    e = attnkit.explain(qh, qh, qh, mask=alibi(2) & causal(), backend="sdpa")
    assert e.chosen == "sdpa"


def test_one_causal_query_builds_no_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step (L = 1, end-aligned causal) sees every key: no L x S mask is built."""
    import attnkit.masks.normalize

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a causal mask was built for one query")

    q = torch.randn(2, 4, 1, 8)
    k = torch.randn(2, 4, 37, 8)
    want = attnkit.attention(q, k, k)
    monkeypatch.setattr(attnkit.masks.normalize, "causal_mask", refuse)
    monkeypatch.setattr(attnkit.masks.MaskSpec, "to_dense", refuse)
    got = attnkit.attention(q, k, k, causal=True)
    assert torch.equal(got, want)


def test_meta_tensors_with_a_spec_never_reach_blocked() -> None:
    """blocked plans from values; on the meta device auto passes it over and says why."""
    from attnkit.masks import causal, sliding_window

    q = torch.empty(1, 2, 512, 16, device="meta")
    spec = causal() & sliding_window(64)
    e = explain(q, q, q, mask=spec)
    assert e.verdicts["blocked"] == "it plans from the mask's values, and meta tensors have none"
    assert e.chosen != "blocked"
    out = attention(q, q, q, mask=spec)
    assert out.device.type == "meta"
    assert out.shape == (1, 2, 512, 16)
    with pytest.raises(AttentionInputError, match="meta tensors have none"):
        attention(q, q, q, mask=spec, backend="blocked")


@pytest.mark.parametrize("masked", [False, True], ids=["no mask", "window"])
@pytest.mark.parametrize("backend", ["auto", "math", "sdpa", "blocked"])
def test_a_query_row_holding_nan_or_inf_gives_nan_not_zeros(backend: str, masked: bool) -> None:
    """Its scores are all NaN, which torch's fused CPU kernels take for "masked" (output 0,
    finite gradients): a diverged model would go on silently. attnkit gives the row NaN, on
    every backend; the other rows are untouched."""
    q, k, v = _qkv(B=1, H=2, Hkv=2, L=6, S=6, dtype=torch.float32)
    q[0, 0, 1, 3] = float("nan")
    q[0, 1, 4, 0] = float("inf")
    spec = masks.causal() & masks.sliding_window(3) if masked else None
    out = attnkit.attention(q, k, v, mask=spec, backend=backend)
    assert out[0, 0, 1].isnan().all()
    assert out[0, 1, 4].isnan().all()
    good = torch.ones(1, 2, 6, dtype=torch.bool)
    good[0, 0, 1] = good[0, 1, 4] = False
    clean = q.masked_fill(~good[..., None], 0.0)
    ref = reference_attention(clean, k, v, mask=None if spec is None else spec.to_dense(6, 6))[0]
    torch.testing.assert_close(out[good], ref[good].float(), atol=1e-5, rtol=0)
    loss = (out**2).mean()
    assert not torch.isfinite(loss)  # what a training loop (or a gradient scaler) checks


def test_nan_rows_win_over_empty_rows_and_reach_the_weights() -> None:
    q, k, v = _qkv(B=1, H=1, Hkv=1, L=4, S=4)
    q[0, 0, 0, 0] = float("nan")
    keep = torch.tensor([[False, True, True, True]])  # row 0 of the causal mask sees no key
    res = attnkit.attention(
        q, k, v, mask=masks.causal() & masks.key_mask(keep), return_weights=True
    )
    assert res.output[0, 0, 0].isnan().all()  # NaN in, NaN out: not the empty row's 0
    assert res.weights is not None
    assert res.weights[0, 0, 0].isnan().all()
    assert torch.isfinite(res.output[0, 0, 1:]).all()
