"""concat_keys under torch.compile: the spec passed in, closed over, or built inside the compiled
function (its key counts read from the keys' shape) runs the blocked backend's custom op,
forward and backward, matches the float64 oracle and eager, and new values of the parts'
tensors reuse the graph.

Compiling costs seconds on a 2-core CPU: the cases run through ``aot_eager`` (Dynamo and AOT
autograd, what decides whether a call traces and differentiates).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import attnkit
from attnkit.masks import causal, concat_keys, key_mask, sliding_window
from attnkit.masks.fields import flatten, rebuild
from oracle import reference_attention

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method`:DeprecationWarning")

B, H, Hkv, L, S1, S2, D = 2, 4, 2, 40, 40, 24, 16


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    """Each test counts its own graphs."""
    torch._dynamo.reset()


def _inputs(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, D, generator=g)
    k = torch.randn(B, Hkv, S1 + S2, D, generator=g)
    v = torch.randn(B, Hkv, S1 + S2, D, generator=g)
    keep = torch.rand(B, S2, generator=g) > 0.4
    return q, k, v, keep


def _spec(keep: torch.Tensor, S1: int) -> attnkit.masks.MaskSpec:
    return concat_keys(causal() & sliding_window(6), S1, key_mask(keep), keep.shape[1])


def _grads(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> list[torch.Tensor]:
    q, k, v, keep = args
    qkv = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fn(*qkv, keep)
    return [out.detach(), *torch.autograd.grad(out.sum(), qkv)]


def test_its_fields_rebuild_the_same_spec() -> None:
    spec = _spec(torch.rand(B, S2) > 0.4, S1)
    flat = flatten(spec)
    assert not isinstance(flat, str)
    tensors, ints, floats, structure = flat
    again = rebuild(tensors, ints, floats, structure)
    assert repr(again) == repr(spec)
    assert torch.equal(again.to_dense(L, S1 + S2), spec.to_dense(L, S1 + S2))  # type: ignore[union-attr]


def _oracle(dense: torch.Tensor) -> Callable[..., torch.Tensor]:
    """The float64 reference with the dense mask (the key mask argument unused)."""

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        return reference_attention(q, k, v, mask=dense)[0]  # type: ignore[no-any-return]

    return fn


@pytest.mark.parametrize("where", ["closed over", "built inside"])
def test_compiled_matches_the_oracle_and_eager_with_one_graph(where: str) -> None:
    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        spec = _spec(keep, k.shape[-2] - keep.shape[1])  # the keys' own count, traced
        return attnkit.attention(q, k, v, mask=spec, backend="blocked")

    def passed(spec: attnkit.masks.MaskSpec) -> Callable[..., torch.Tensor]:
        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
            return attnkit.attention(q, k, v, mask=spec, backend="blocked")

        return run

    counter = CompileCounterWithBackend("aot_eager")
    compiled_fn = torch.compile(fn, fullgraph=True, backend=counter)
    for seed in (0, 1):  # new key masks: the same graph
        q, k, v, keep = _inputs(seed)
        spec = _spec(keep, S1)
        compiled = compiled_fn
        if where == "closed over":
            compiled = torch.compile(passed(spec), fullgraph=True, backend=counter)
        got = _grads(compiled, q, k, v, keep)
        want = _grads(_oracle(spec.to_dense(L, S1 + S2)), q.double(), k.double(), v.double(), keep)
        for a, b in zip(got, want, strict=True):
            assert (a.double() - b).abs().max() < 2e-5
        for a, b in zip(got, _grads(passed(spec), q, k, v, keep), strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert counter.frame_count == 1  # a new spec of the same structure reuses the graph
