"""selected_keys under torch.compile: the blocked backend's custom op runs the gather kernel,
forward and backward, and matches the float64 oracle and eager; no ``L x S`` mask is built;
decode steps with new indices compile one graph; bad indices are refused when the op runs.

Compiling costs seconds on a 2-core CPU: the cases run through ``aot_eager`` (Dynamo and AOT
autograd, what decides whether a call traces and differentiates), with one through inductor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import attnkit
from attnkit import masks
from attnkit.backends.blocked import gather
from attnkit.errors import AttentionInputError
from attnkit.masks.selected import SelectedKeys
from oracle import reference_attention

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method`:DeprecationWarning")


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    """Each test counts its own graphs."""
    torch._dynamo.reset()


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Calls of the gather kernel's forward and backward; ``to_dense`` of a selected-keys spec
    (the ``L x S`` mask) fails the test."""
    calls = {"forward": 0, "backward": 0}

    def spy(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            calls[name] += 1
            return fn(*args)

        return run

    def dense(*args: Any, **kw: Any) -> torch.Tensor:
        raise AssertionError("selected_keys was materialised as an L x S mask")

    monkeypatch.setattr(gather, "forward", spy("forward", gather.forward))
    monkeypatch.setattr(gather, "backward", spy("backward", gather.backward))
    monkeypatch.setattr(SelectedKeys, "to_dense", dense)
    return calls


def _scatter(ind: torch.Tensor, S: int) -> torch.Tensor:
    """Eager's meaning of ``(B, L, k)`` indices: a bool mask ``(B, 1, L, S)``."""
    m = torch.zeros(*ind.shape[:2], S + 1, dtype=torch.bool)
    m.scatter_(-1, torch.where(ind < 0, S, ind), True)
    return m[..., :S].unsqueeze(1)


def _inputs(L: int, S: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, L, 16, generator=gen)
    kk = torch.randn(2, 2, S, 16, generator=gen)
    v = torch.randn(2, 2, S, 12, generator=gen)
    ind = torch.randint(-1, S, (2, L, k), generator=gen)
    return q, kk, v, ind


def _attend(backend: str, causal: bool) -> Callable[..., torch.Tensor]:
    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ind: torch.Tensor) -> torch.Tensor:
        spec = masks.selected_keys(ind)
        return attnkit.attention(q, k, v, mask=masks.causal() & spec if causal else spec,
                                 backend=backend)  # fmt: skip

    return fn


def _grads(fn: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           ind: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:  # fmt: skip
    qkv = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fn(*qkv, ind)
    return [out.detach(), *torch.autograd.grad((out * w.to(out.dtype)).sum(), qkv)]


def _oracle(dense: torch.Tensor) -> Callable[..., torch.Tensor]:
    """The float64 reference with the scattered mask (the indices argument unused)."""

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        return reference_attention(q, k, v, mask=dense)[0]  # type: ignore[no-any-return]

    return fn


@pytest.mark.parametrize("fullgraph", [True, False])
@pytest.mark.parametrize(("backend", "causal"), [("blocked", True), ("auto", False)])
def test_compiled_matches_oracle_and_eager_on_the_gather_kernel(
    counted: dict[str, int], fullgraph: bool, backend: str, causal: bool
) -> None:
    fn = _attend(backend, causal)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, fullgraph=fullgraph, backend=counter)
    L = S = 40
    for seed in (0, 1):  # new indices: the same graph
        q, k, v, ind = _inputs(L, S, 7, seed)
        w = torch.randn(2, 4, L, 12, generator=torch.Generator().manual_seed(seed))
        got = _grads(compiled, q, k, v, ind, w)
        dense = _scatter(ind, S) & (torch.ones(L, S, dtype=torch.bool).tril() if causal else True)
        want = _grads(_oracle(dense), q.double(), k.double(), v.double(), ind, w.double())
        for a, b in zip(got, want, strict=True):
            assert (a.double() - b).abs().max() < 2e-5
        for a, b in zip(got, _grads(fn, q, k, v, ind, w), strict=True):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert counter.frame_count == 1
    assert counted["forward"] == 4  # compiled and eager, twice
    assert counted["backward"] == 4


def test_inductor_runs_the_gather_kernel(counted: dict[str, int]) -> None:
    fn = _attend("blocked", True)
    q, k, v, ind = _inputs(24, 24, 5, 3)
    w = torch.randn(2, 4, 24, 12)
    with torch._inductor.config.patch(compile_threads=1):
        got = _grads(torch.compile(fn, fullgraph=True, backend="inductor"), q, k, v, ind, w)
    for a, b in zip(got, _grads(fn, q, k, v, ind, w), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert counted["forward"] == 2
    assert counted["backward"] == 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_low_precision_matches_eager(counted: dict[str, int], dtype: torch.dtype) -> None:
    """bf16/fp16 on the CPU: the op picks the CPU path as an eager call does (float32 copies
    on ``fp32-upcast``), so the compiled call gives eager's result bit for bit."""
    fn = _attend("blocked", True)
    q, k, v, ind = (t.to(dtype) if t.is_floating_point() else t for t in _inputs(32, 48, 6, 4))
    w = torch.randn(2, 4, 32, 12)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for a, b in zip(_grads(compiled, q, k, v, ind, w), _grads(fn, q, k, v, ind, w), strict=True):
        assert a.dtype == dtype
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert counted["forward"] == 2


def test_decode_steps_with_new_indices_compile_one_graph(counted: dict[str, int]) -> None:
    """A static cache of S keys, one query per step, new top-k indices at every step: one
    graph for every step; each step's output is the float64 oracle's."""
    S, topk = 64, 8

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ind: torch.Tensor) -> torch.Tensor:
        return attnkit.attention(q, k, v, mask=masks.selected_keys(ind), backend="auto")

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    gen = torch.Generator().manual_seed(7)
    k, v = torch.randn(2, 2, S, 16, generator=gen), torch.randn(2, 2, S, 12, generator=gen)
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        for t in range(5):
            q = torch.randn(2, 4, 1, 16, generator=gen)
            ind = torch.randint(-1, 20 + 8 * t, (2, 1, topk), generator=gen)  # keys seen so far
            want, _ = reference_attention(q.double(), k.double(), v.double(),
                                          mask=_scatter(ind, S))  # fmt: skip
            assert (compiled(q, k, v, ind).double() - want).abs().max() < 2e-6
    assert counter.frame_count == 1
    assert counted["forward"] == 5


def test_a_growing_cache_compiles_once_more_with_symbolic_sizes() -> None:
    """A dynamic cache (S grows by one at every step): the second step compiles a graph with
    symbolic sizes, which serves every step after it."""

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ind: torch.Tensor) -> torch.Tensor:
        return attnkit.attention(q, k, v, mask=masks.causal() & masks.selected_keys(ind))

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for S in range(30, 36):
            q, k, v = (torch.randn(1, 2, n, 8, generator=gen) for n in (1, S, S))
            ind = torch.randint(-1, S, (1, 1, 4), generator=gen)
            torch.testing.assert_close(compiled(q, k, v, ind), step(q, k, v, ind))
    assert counter.frame_count == 2


def test_out_of_range_indices_are_refused_when_the_op_runs() -> None:
    """A trace cannot read the indices' values; the op checks them before its kernel reads a
    key, with the eager message (argument, shapes, expected range, fix)."""
    q, k, v, ind = _inputs(8, 8, 3, 5)
    ind[1, 2, 0] = 8
    compiled = torch.compile(_attend("blocked", True), fullgraph=True, backend="aot_eager")
    with pytest.raises(AttentionInputError) as e:
        compiled(q, k, v, ind)
    msg = str(e.value)
    assert e.value.argument == "mask"
    assert "indices (B=2, L=8, k=3)" in msg
    assert "outside the 8 keys of k" in msg
    assert "-1 <= indices < S=8" in msg


@pytest.mark.parametrize("per_head", [False, True])
def test_to_dense_traces_in_one_graph(per_head: bool) -> None:
    """The scattered mask built inside a compiled function (what the HF path does where
    transformers hands a dense mask): the same bools as eager, duplicates and -1 included, and
    ``allowed`` at keys that are no ``arange`` (a key asked past the last, -1), fullgraph."""

    def dense(ind: torch.Tensor, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        spec = masks.selected_keys(ind, heads=4 if per_head else None)
        b, h = torch.arange(2).view(2, 1, 1, 1), torch.arange(4).view(1, 4, 1, 1)
        q = torch.arange(5).view(1, 1, 5, 1)
        return spec.to_dense(5, 9), spec.allowed(b, h, q, kv, 4)

    gen = torch.Generator().manual_seed(9)
    ind = torch.randint(-1, 9, (2, 2, 5, 3) if per_head else (2, 5, 3), generator=gen)
    ind[..., 0, 1] = ind[..., 0, 0]
    kv = torch.tensor([3, -1, 12, 0, 8]).view(1, 1, 1, 5)
    compiled = torch.compile(dense, fullgraph=True, backend="aot_eager")
    for a, b in zip(compiled(ind, kv), dense(ind, kv), strict=True):
        assert a.dtype == torch.bool
        assert torch.equal(a, b)
    got = dense(ind, kv)[0]  # (2, 4 | 1, 5, 9)
    for head in range(got.shape[1]):  # eager's meaning: each head's indices scattered
        rows = ind[:, head // 2] if per_head else ind
        assert torch.equal(got[:, head], _scatter(rows, 9)[:, 0])
