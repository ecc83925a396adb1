"""Second derivatives (Hessians, gradgradcheck, gradient penalties) through every backend.

The fused backends' own backward is not differentiable: ``blocked``'s gave a Hessian of 0 (its
backward ran outside autograd), torch's fused ``sdpa`` kernels raised. Now every backend gives
the float64 oracle's second derivatives (the gradients are recomputed differentiably under
``create_graph=True``), or refuses with attnkit's error: ``flex`` on CPU (no backward there),
dropout on a backend that would have to draw its mask again, a recompute above the memory limit.
Ring attention has its own test (tests/distributed/test_ring_second_order.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.autograd import gradgradcheck
from torch.autograd.functional import hessian, hvp

import attnkit
from attnkit import AttentionInputError, AttentionMemoryError, masks
from attnkit.backends import Backend, get_backend, register_backend, unregister_backend
from attnkit.call import AttentionCall
from oracle import reference_attention

F64 = torch.float64
L, S = 3, 4


def _tensors(H: int = 2, Hkv: int = 1, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "q": torch.randn(1, H, L, 2, generator=gen, dtype=F64),
        "k": torch.randn(1, Hkv, S, 2, generator=gen, dtype=F64),
        "v": torch.randn(1, Hkv, S, 2, generator=gen, dtype=F64),
        "w": torch.randn(1, H, L, 2, generator=gen, dtype=F64),  # weighs the loss
        "sinks": torch.randn(H, generator=gen, dtype=F64),
    }


_ROW_BLOCKED = torch.tensor([[True, False, True, True], [False] * 4, [True, True, False, True]])

#: case -> (attention keywords, oracle keywords, backends that serve it); the oracle takes
#: dense masks only, so a spec goes to it materialised
CASES: dict[str, tuple[dict[str, Any], dict[str, Any], tuple[str, ...]]] = {
    "plain": ({}, {}, ("math", "sdpa", "blocked", "auto")),
    "causal": ({"causal": True}, {"causal": True}, ("math", "sdpa", "blocked", "auto")),
    "bool_mask_empty_row": (
        {"mask": _ROW_BLOCKED},
        {"mask": _ROW_BLOCKED},
        ("math", "sdpa", "blocked", "auto"),
    ),
    "window_spec": (
        {"mask": masks.causal() & masks.sliding_window(2)},
        {"mask": (masks.causal() & masks.sliding_window(2)).to_dense(L, S)},
        ("math", "sdpa", "blocked", "auto"),
    ),
    "alibi_spec": (
        {"mask": masks.alibi(2)},
        {"mask": masks.alibi(2).to_dense(L, S, dtype=F64)},
        ("math", "sdpa", "blocked", "auto"),
    ),
    "softcap_causal": (
        {"softcap": 1.5, "causal": True},
        {"softcap": 1.5, "causal": True},
        ("math", "blocked", "auto"),
    ),
}
BACKEND_CASES = [(b, c) for c, (_, _, served) in CASES.items() for b in served]


def _loss(out: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (out**2 * w).sum()  # not linear in out: its Hessian needs out's second derivative


@pytest.mark.parametrize(("backend", "case"), BACKEND_CASES)
def test_hessian_equals_the_oracle(backend: str, case: str) -> None:
    kw, oracle_kw, _ = CASES[case]
    t = _tensors(Hkv=1)  # grouped-query heads: H = 2, Hkv = 1

    def ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _loss(attnkit.attention(q, k, v, backend=backend, **kw), t["w"])

    def oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _loss(reference_attention(q, k, v, **oracle_kw)[0], t["w"])

    inputs = (t["q"], t["k"], t["v"])
    got, want = hessian(ours, inputs), hessian(oracle, inputs)
    for i in range(3):
        for j in range(3):
            assert want[i][j].abs().max() > 1e-3
            torch.testing.assert_close(got[i][j], want[i][j], rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("backend", ["math", "blocked", "auto"])
def test_hessian_with_sinks_equals_the_oracle(backend: str) -> None:
    t = _tensors(H=2, Hkv=2)

    def ours(q: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
        out = attnkit.attention(q, t["k"], t["v"], causal=True, sinks=sinks, backend=backend)
        return _loss(out, t["w"])

    def oracle(q: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
        out = reference_attention(q, t["k"], t["v"], causal=True, sinks=sinks)[0]
        return _loss(out, t["w"])

    got = hessian(ours, (t["q"], t["sinks"]))
    want = hessian(oracle, (t["q"], t["sinks"]))
    for i in range(2):
        for j in range(2):
            assert want[i][j].abs().max() > 1e-3
            torch.testing.assert_close(got[i][j], want[i][j], rtol=1e-9, atol=1e-10)


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.clone().requires_grad_()


@pytest.mark.parametrize(
    ("backend", "kw"),
    [
        ("blocked", {"mask": masks.causal() & masks.sliding_window(2)}),
        ("blocked", {"softcap": 2.0, "causal": True}),
        ("blocked", {"mask": masks.padding(torch.tensor([2]))}),
        ("sdpa", {"mask": _ROW_BLOCKED}),
        ("sdpa", {"causal": True}),
    ],
    ids=["blocked-window", "blocked-softcap", "blocked-padding", "sdpa-mask", "sdpa-causal"],
)
def test_gradgradcheck_passes(backend: str, kw: dict[str, Any]) -> None:
    t = _tensors(Hkv=1)
    inputs = (_leaf(t["q"]), _leaf(t["k"]), _leaf(t["v"]))
    assert gradgradcheck(lambda q, k, v: attnkit.attention(q, k, v, backend=backend, **kw), inputs)


def test_gradgradcheck_with_sinks_and_shared_kv() -> None:
    """Sinks get their own second derivatives; ``k is v`` keeps the partials of k and v apart."""
    t = _tensors(H=2, Hkv=2)
    kv = t["k"][..., :2].clone()
    inputs = (_leaf(t["q"]), _leaf(kv), _leaf(t["sinks"]))

    def fn(q: torch.Tensor, kv: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
        return attnkit.attention(q, kv, kv, sinks=sinks, backend="blocked")

    assert gradgradcheck(fn, inputs)


def _hvp_check(
    fn: Callable[[torch.Tensor], torch.Tensor],
    oracle: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    rtol: float,
) -> None:
    direction = torch.randn(x.shape, generator=torch.Generator().manual_seed(1), dtype=x.dtype)
    got = hvp(fn, x, direction)[1]
    want = hvp(oracle, x.double(), direction.double())[1]
    assert want.abs().max() > 1e-3
    err = (got.double() - want).abs().max() / want.abs().max()
    assert err <= rtol, f"Hessian-vector product off by {err:.3g} (relative)"


def test_auto_on_blocked_with_a_spec_gives_the_oracles_second_derivative() -> None:
    n = 128  # L x S = 128 x 128: auto takes blocked for a mask spec
    spec = masks.causal() & masks.sliding_window(16)
    gen = torch.Generator().manual_seed(2)
    q, k, v, w = (torch.randn(1, 2, n, 4, generator=gen, dtype=F64) for _ in range(4))
    assert attnkit.explain(q, k, v, mask=spec).chosen == "blocked"
    dense = spec.to_dense(n, n)

    def ours(x: torch.Tensor) -> torch.Tensor:
        return _loss(attnkit.attention(x, k, v, mask=spec), w)

    def oracle(x: torch.Tensor) -> torch.Tensor:
        return _loss(reference_attention(x, k, v, mask=dense)[0], w)

    _hvp_check(ours, oracle, q, rtol=1e-9)


def test_auto_on_the_row_span_kernel_gives_the_oracles_second_derivative() -> None:
    n = 1024  # causal, L x S = 1024 x 1024, float32: auto takes blocked's row-span kernel
    gen = torch.Generator().manual_seed(3)
    q, k, v, w = (torch.randn(1, 1, n, 4, generator=gen) for _ in range(4))
    why = attnkit.explain(q, k, v, causal=True)
    assert why.chosen == "blocked"

    def ours(x: torch.Tensor) -> torch.Tensor:
        return _loss(attnkit.attention(x, k, v, causal=True), w)

    def oracle(x: torch.Tensor) -> torch.Tensor:
        out = reference_attention(x, k.double(), v.double(), causal=True)[0]
        return _loss(out, w.double())

    _hvp_check(ours, oracle, q, rtol=1e-4)  # float32 against float64


def test_first_derivatives_with_create_graph_equal_the_fast_ones() -> None:
    t = _tensors(Hkv=1)
    spec = masks.causal() & masks.sliding_window(2)
    for backend in ("blocked", "sdpa"):
        inputs = [_leaf(t[n]) for n in ("q", "k", "v")]
        out = attnkit.attention(*inputs, mask=spec, backend=backend)
        fast = torch.autograd.grad(_loss(out, t["w"]), inputs, retain_graph=True)
        graph = torch.autograd.grad(_loss(out, t["w"]), inputs, create_graph=True)
        for f, g in zip(fast, graph, strict=True):
            assert g.requires_grad  # a graph autograd can differentiate again
            torch.testing.assert_close(g, f, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("module", ["SelfAttention", "MultiHeadAttention"])
@pytest.mark.parametrize("backend", ["sdpa", "blocked"])
def test_module_gradient_penalty_equals_math(module: str, backend: str) -> None:
    """A gradient penalty on a module's parameters (the WGAN-GP pattern): its gradient through
    a fused backend equals the math backend's."""
    results = []
    for name in ("math", backend):
        torch.manual_seed(0)
        if module == "SelfAttention":
            m: torch.nn.Module = attnkit.SelfAttention(8, 4, backend=name, causal=True)
        else:
            m = attnkit.MultiHeadAttention(8, 2, backend=name, causal=True)
        m = m.double()
        x = torch.randn(2, 5, 8, dtype=F64, requires_grad=True)
        out = m(x).output
        (gx,) = torch.autograd.grad(_loss(out, torch.ones_like(out)), x, create_graph=True)
        (gx**2).sum().backward()
        results.append([p.grad for p in m.parameters()])
    assert max(float(g.abs().max()) for g in results[0] if g is not None) > 1e-3
    for want, got in zip(*results, strict=True):
        assert want is not None
        assert got is not None
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_flex_on_cpu_refuses_any_derivative_with_its_reason() -> None:
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 1, 256, 16, generator=gen) for _ in range(3))
    spec = masks.causal() & masks.sliding_window(64)
    with pytest.raises(AttentionInputError) as err:
        hessian(lambda x: attnkit.attention(x, k, v, mask=spec, backend="flex").sum(), q)
    assert "backend 'flex' cannot serve this call" in str(err.value)
    assert "no backward on CPU" in str(err.value)


class _DropoutToy(Backend):
    """A backend with dropout whose graph attnkit does not take as twice differentiable (the
    default for a registered backend): a second derivative would recompute without its mask."""

    name = "test-dropout-toy"
    priority = None

    def run(self, call: AttentionCall, plan: None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return get_backend("math").run(call)[0], None


def test_dropout_second_derivative_is_refused_where_the_mask_cannot_be_redrawn() -> None:
    register_backend(_DropoutToy())
    try:
        t = _tensors(H=1, Hkv=1)
        q = _leaf(t["q"])
        out = attnkit.attention(q, t["k"], t["v"], dropout_p=0.5, backend="test-dropout-toy")
        (g,) = torch.autograd.grad(out.sum(), q, retain_graph=True)  # first order: its own
        assert torch.isfinite(g).all()
        with pytest.raises(AttentionInputError) as err:
            torch.autograd.grad(out.sum(), q, create_graph=True)
        message = str(err.value)
        assert "dropout_p" in message
        assert "backend 'test-dropout-toy' cannot give a second derivative with dropout" in message
        assert "backend='math'" in message
        # the math backend's own graph keeps its dropout mask: its second derivative runs
        q2 = _leaf(t["q"])
        out2 = attnkit.attention(q2, t["k"], t["v"], dropout_p=0.5, backend="math")
        (g2,) = torch.autograd.grad(_loss(out2, t["w"][:, :1]), q2, create_graph=True)
        assert g2.requires_grad
    finally:
        unregister_backend("test-dropout-toy")


def test_a_recompute_above_the_memory_limit_is_refused() -> None:
    n = 256
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 1, n, 4, generator=gen, dtype=F64) for _ in range(3))
    x = q.clone().requires_grad_()
    previous = attnkit.set_memory_limit(1 << 20)  # 1 MiB: 5 x 256 x 256 float64 do not fit
    try:
        out = attnkit.attention(x, k, v, causal=True, backend="blocked")
        (g,) = torch.autograd.grad(out.sum(), x, retain_graph=True)  # first order: fits
        assert torch.isfinite(g).all()
        with pytest.raises(AttentionMemoryError) as err:
            torch.autograd.grad(out.sum(), x, create_graph=True)
    finally:
        attnkit.set_memory_limit(previous)
    message = str(err.value)
    assert "a second derivative through backend 'blocked'" in message
    assert "(B=1, H=1, L=256, S=256)" in message
    assert "create_graph=False" in message


def test_torch_func_grad_still_runs_on_sdpa() -> None:
    t = _tensors(Hkv=1)

    def loss(backend: str) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda x: _loss(attnkit.attention(x, t["k"], t["v"], backend=backend), t["w"])

    got = torch.func.grad(loss("sdpa"))(t["q"])
    want = torch.func.grad(loss("math"))(t["q"])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_blocked_compiled_with_the_eager_backend_gives_the_oracles_hessian() -> None:
    """Under torch.compile the blocked backend is one custom op; with ``backend="eager"``
    torch runs the op's registered backward eagerly, which now differentiates too (it raised:
    the backward op had no autograd formula). AOT autograd refuses double backward itself."""
    t = _tensors(Hkv=1)
    spec = masks.causal() & masks.sliding_window(2)

    def blocked(q: torch.Tensor) -> torch.Tensor:
        return attnkit.attention(q, t["k"], t["v"], mask=spec, backend="blocked")

    compiled = torch.compile(blocked, fullgraph=True, backend="eager")
    got = hessian(lambda q: _loss(compiled(q), t["w"]), t["q"])
    dense = spec.to_dense(L, S)
    want = hessian(
        lambda q: _loss(reference_attention(q, t["k"], t["v"], mask=dense)[0], t["w"]), t["q"]
    )
    assert want.abs().max() > 1e-3
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
