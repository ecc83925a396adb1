"""Per-token attention sinks (Inkling 2's ``sinks``, one logit per query row and head,
``(B, H, L)`` or ``(1, H, L)``) against the float64 oracle, forward and backward (the
gradients of q, k, v and the sinks, of the sinks' shape), on ``math`` and ``blocked``, under
masks (causal, window, padding), grouped-query heads, rows that see no key, torch.compile and
bfloat16; sinks of both kinds under torch.compile's inductor backend too.

Tolerances: float64 to 1e-9 relative to the largest value (as tests/core/test_softcap_sinks.py);
float32 (compiled) to 1e-5 relative; bfloat16 to 2**-5 relative (16 roundings, as
tests/core/test_low_precision_paths.py).

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S key length.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import attnkit
from attnkit import masks
from attnkit.backends.blocked import compiled
from attnkit.masks import MaskSpec
from oracle import reference_attention

B, H, HKV, L, D = 2, 4, 2, 40, 16
F64 = torch.float64


def _mask(name: str) -> MaskSpec:
    lengths = torch.tensor([L, 23])
    return {
        "causal": masks.causal(),
        "window": masks.causal() & masks.sliding_window(9),
        "padding": masks.padding(lengths),
        "padding-causal": masks.causal() & masks.padding(lengths),
    }[name]


def _inputs(seed: int, sink_batch: int, dtype: torch.dtype = F64) -> list[torch.Tensor]:
    """q (B, H, L, D), k and v (B, Hkv, L, D), sinks (sink_batch, H, L), in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, H, L, D), (B, HKV, L, D), (B, HKV, L, D), (sink_batch, H, L))
    return [(torch.randn(*s, generator=g, dtype=F64) * 1.5).to(dtype) for s in shapes]


def _grads(
    leaves: list[torch.Tensor], out: torch.Tensor, w: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad((out * w).sum(), leaves)


def _oracle(tensors: list[torch.Tensor], spec: MaskSpec, w: torch.Tensor) -> list[torch.Tensor]:
    """The float64 oracle's output and gradients of q, k, v and the sinks."""
    leaves = [t.detach().double().requires_grad_() for t in tensors]
    dense = spec.to_dense(L, L)
    want, _ = reference_attention(*leaves[:3], mask=dense, sinks=leaves[3])
    return [want.detach(), *_grads(leaves, want, w.double())]


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.double() - want).abs().max().item() / max(1.0, want.abs().max().item())


@pytest.mark.parametrize("backend", ["math", "blocked"])
@pytest.mark.parametrize("mask", ["causal", "window", "padding", "padding-causal"])
@pytest.mark.parametrize("sink_batch", [B, 1], ids=["BHL", "1HL"])
def test_per_token_sinks_match_the_oracle(backend: str, mask: str, sink_batch: int) -> None:
    tensors = _inputs(seed=3, sink_batch=sink_batch)
    spec = _mask(mask)
    leaves = [t.clone().requires_grad_() for t in tensors]
    out = attnkit.attention(*leaves[:3], mask=spec, sinks=leaves[3], backend=backend)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    got = [out.detach(), *_grads(leaves, out, w)]
    want = _oracle(tensors, spec, w)
    assert got[4].shape == (sink_batch, H, L)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, want, strict=True):
        assert _rel_err(a, b) <= 1e-9, (name, _rel_err(a, b))


def test_per_row_sinks_are_not_one_per_head() -> None:
    """Sinks that differ only along L change the rows they belong to, nothing else."""
    q, k, v, sinks = _inputs(seed=4, sink_batch=B)
    base = attnkit.attention(q, k, v, causal=True, sinks=sinks, backend="blocked")
    moved = sinks.clone()
    moved[1, 2, 7] += 3.0
    out = attnkit.attention(q, k, v, causal=True, sinks=moved, backend="blocked")
    changed = (out != base).any(dim=-1)  # (B, H, L)
    assert changed.nonzero().tolist() == [[1, 2, 7]]


@pytest.mark.parametrize("backend", ["math", "blocked"])
def test_a_row_that_sees_no_key_gives_zero_and_its_sink_no_gradient(backend: str) -> None:
    """A sequence of length 0: the sink alone takes the weight, so the output is 0, and so are
    the gradients of its q, k, v and sinks; the other sequence is unchanged."""
    q, k, v, sinks = (t.requires_grad_() for t in _inputs(seed=5, sink_batch=B))
    spec = masks.padding(torch.tensor([L, 0]))
    out = attnkit.attention(q, k, v, mask=spec, sinks=sinks, backend=backend)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    dq, dk, dv, ds = torch.autograd.grad(out.square().sum(), (q, k, v, sinks))
    for g in (dq[1], dk[1], dv[1], ds[1]):
        assert torch.equal(g, torch.zeros_like(g))
    assert ds[0].abs().sum() > 0
    alone = attnkit.attention(q[:1], k[:1], v[:1], sinks=sinks[:1], backend=backend)
    torch.testing.assert_close(out[:1], alone, atol=1e-12, rtol=0)


def test_decode_step_with_per_token_sinks_matches_the_oracle() -> None:
    """One query against a cache (the decode-shaped call, without gradients)."""
    g = torch.Generator().manual_seed(6)
    q = torch.randn(B, H, 1, D, generator=g)
    k, v = (torch.randn(B, HKV, 50, D, generator=g) for _ in range(2))
    sinks = torch.randn(B, H, 1, generator=g) * 2
    with torch.no_grad():
        out = attnkit.attention(q, k, v, causal=True, sinks=sinks)
    want, _ = reference_attention(q, k, v, causal=True, sinks=sinks)
    assert _rel_err(out, want) <= 2e-6


def _window(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return attnkit.attention(q, k, v, mask=masks.causal() & masks.sliding_window(9), sinks=s)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method`:DeprecationWarning")
def test_per_token_sinks_compile_as_the_blocked_op_with_their_gradient() -> None:
    tensors = _inputs(seed=7, sink_batch=B, dtype=torch.float32)
    fn = torch.compile(_window, fullgraph=True, backend="aot_eager")
    w = torch.randn(B, H, L, D, generator=torch.Generator().manual_seed(1))
    runs = []
    for f in (fn, _window):
        leaves = [t.clone().requires_grad_() for t in tensors]
        out = f(*leaves)
        runs.append([out.detach(), *_grads(leaves, out, w)])
    want = _oracle(tensors, masks.causal() & masks.sliding_window(9), w)
    for got, eager, ref in zip(*runs, want, strict=True):
        torch.testing.assert_close(got, eager, atol=1e-5, rtol=1e-5)
        assert _rel_err(got, ref) <= 1e-5
    assert runs[0][4].shape == (B, H, L)


@pytest.mark.parametrize("backend", ["math", "blocked"])
def test_bfloat16_per_token_sinks_within_the_low_precision_tolerance(backend: str) -> None:
    tensors = _inputs(seed=8, sink_batch=B, dtype=torch.bfloat16)
    spec = _mask("window")
    leaves = [t.clone().requires_grad_() for t in tensors]
    out = attnkit.attention(*leaves[:3], mask=spec, sinks=leaves[3], backend=backend)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    got = [out.detach(), *_grads(leaves, out, w)]
    want = _oracle(tensors, spec, w)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, want, strict=True):
        assert a.dtype == torch.bfloat16, name
        assert _rel_err(a, b) <= 2**-5, (name, _rel_err(a, b))


def test_explain_names_per_token_sinks() -> None:
    q, k, v, sinks = _inputs(seed=9, sink_batch=B, dtype=torch.float32)
    e = attnkit.explain(q, k, v, causal=True, sinks=sinks)
    assert f"sinks: ({B}, {H}, {L}) per query row" in e.summary
    assert "sinks: (4,) per head" in attnkit.explain(q, k, v, sinks=torch.zeros(H)).summary


def test_per_token_sinks_have_second_derivatives_on_blocked() -> None:
    """create_graph=True through blocked recomputes the math backend's gradients, per-token
    sinks included (tests/core/test_second_order.py does the same for ``(H,)``)."""
    g = torch.Generator().manual_seed(10)
    shapes = ((1, 2, 5, 3), (1, 1, 5, 3), (1, 1, 5, 3), (1, 2, 5))
    inputs = tuple(torch.randn(*s, generator=g, dtype=F64).requires_grad_() for s in shapes)

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return attnkit.attention(q, k, v, causal=True, sinks=s, backend="blocked")

    assert torch.autograd.gradgradcheck(fn, inputs)


def _both(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, per_head: torch.Tensor, per_row: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    spec = masks.causal() & masks.sliding_window(5)
    return (
        attnkit.attention(q, k, v, mask=spec, sinks=per_head, backend="blocked"),
        attnkit.attention(q, k, v, mask=spec, sinks=per_row, backend="blocked"),
    )


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method`:DeprecationWarning")
def test_sinks_per_head_and_per_token_compile_with_inductor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch.compile's default backend (inductor, not only aot_eager) over the blocked op with
    sinks ``(H,)`` and ``(B, H, L)``, in one graph (one compile, tiny sizes): the op runs
    forward and backward for each, and the outputs and the gradients of q, k, v and both
    sinks match the float64 oracle."""
    calls: list[str] = []
    for name in ("forward_with_lse", "backward_from_lse"):
        real = getattr(compiled, name)

        def counting(*args: object, _real: Any = real, _name: str = name, **kw: object) -> Any:
            calls.append(_name)
            return _real(*args, **kw)

        monkeypatch.setattr(compiled, name, counting)
    g = torch.Generator().manual_seed(11)
    b, h, hkv, n, d = 1, 2, 1, 12, 8
    shapes = ((b, h, n, d), (b, hkv, n, d), (b, hkv, n, d), (h,), (b, h, n))
    leaves = [(torch.randn(*s, generator=g) * 1.5).requires_grad_() for s in shapes]
    with torch._inductor.config.patch(compile_threads=1):
        fn = torch.compile(_both, fullgraph=True, backend="inductor")
        outs = fn(*leaves)
        ws = [torch.randn(o.shape, generator=g) for o in outs]
        grads = torch.autograd.grad(
            sum((o * w).sum() for o, w in zip(outs, ws, strict=True)), leaves
        )
    assert sorted(calls) == ["backward_from_lse"] * 2 + ["forward_with_lse"] * 2
    ref = [t.detach().double().requires_grad_() for t in leaves]
    dense = (masks.causal() & masks.sliding_window(5)).to_dense(n, n)
    wants = [reference_attention(*ref[:3], mask=dense, sinks=s)[0] for s in ref[3:]]
    total = sum((o * w.double()).sum() for o, w in zip(wants, ws, strict=True))
    want_grads = torch.autograd.grad(total, ref)
    for got, want in zip((*outs, *grads), (*wants, *want_grads), strict=True):
        assert got.shape == want.shape
        assert _rel_err(got.detach(), want) <= 1e-5
