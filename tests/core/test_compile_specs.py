"""torch.compile(fullgraph=True) of functions that call attnkit.attention with mask specs, on
every path a spec takes: short calls go to torch's SDPA on the materialised spec (traced into
the graph), long ones to the blocked backend's custom op, and ``math`` traces the spec too.

Each case compiles first (so that no eager call, ``explain`` included, has filled a cache the
trace could read), then runs eagerly on the same inputs; output and gradients must match, and
new values of the spec's tensors (new document ids, new lengths, a new spec object) must not
compile the graph again.
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

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method`:DeprecationWarning")

TOL = {"atol": 1e-5, "rtol": 1e-5}
B, H, HKV = 2, 4, 2


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    """Every case's function shares one code object (``_attend``'s ``fn``): Dynamo's cache of
    it is emptied first, so that each test counts its own graphs."""
    torch._dynamo.reset()


def _qkv(L: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, H, L, 16), (B, HKV, L, 16), (B, HKV, L, 16))
    return [torch.randn(*s, generator=g).requires_grad_() for s in shapes]


def _ids(L: int, seed: int) -> torch.Tensor:
    """(B, L) document ids: new documents at random places, per sequence."""
    cuts = torch.randint(0, 2, (B, L), generator=torch.Generator().manual_seed(seed))
    return cuts.cumsum(1) // 9


def _lengths(L: int, seed: int) -> torch.Tensor:
    return torch.tensor([L - 3 - seed, L // 2 + seed])


def _keep(L: int, seed: int) -> torch.Tensor:
    return torch.rand(B, L, generator=torch.Generator().manual_seed(seed)) > 0.3


#: a spec built outside the compiled function, which closes over it (``~`` included: Dynamo
#: cannot trace ``~`` on a Python object, so an inverted spec is built before the call)
OUTSIDE = masks.document(torch.arange(64) // 20) & ~masks.padding(torch.tensor([5, 9]))


#: name -> (the function's spec from its extra arguments, the extra arguments for a seed)
CASES: dict[str, tuple[Callable[..., masks.MaskSpec], Callable[[int, int], tuple[Any, ...]]]] = {
    # a window wider than the call allows every pair (eager runs SDPA without a mask)
    "causal & sliding_window(97)": (
        lambda: masks.causal() & masks.sliding_window(97),
        lambda L, s: (),
    ),
    "causal & sliding_window(16)": (
        lambda: masks.causal() & masks.sliding_window(16),
        lambda L, s: (),
    ),
    "document(ids) from an input": (masks.document, lambda L, s: (_ids(L, s),)),
    "document(ids) & causal & sliding_window": (
        lambda ids: masks.document(ids) & masks.causal() & masks.sliding_window(24),
        lambda L, s: (_ids(L, s),),
    ),
    "key_mask(keep) & causal": (
        lambda keep: masks.key_mask(keep) & masks.causal(),
        lambda L, s: (_keep(L, s),),
    ),
    "padding(lengths, q_lengths)": (
        lambda n: masks.padding(n, q_lengths=n),
        lambda L, s: (_lengths(L, s),),
    ),
    "prefix_lm(tensor)": (masks.prefix_lm, lambda L, s: (torch.tensor([3 + s, 10]),)),
    "sequence_causal": (
        lambda n, L: masks.sequence_causal(n, L),
        lambda L, s: (torch.tensor([L, L - 3 - s]), L),
    ),
    "alibi & causal": (lambda: masks.alibi(H) & masks.causal(), lambda L, s: ()),
    "(document | padding) & causal": (
        lambda ids, n: (masks.document(ids) | masks.padding(n)) & masks.causal(),
        lambda L, s: (_ids(L, s), _lengths(L, s)),
    ),
    "a spec passed in, new each call": (lambda spec: spec, lambda L, s: (_new_spec(L, s),)),
    "a spec built outside, with ~": (lambda: OUTSIDE, lambda L, s: ()),
}


def _new_spec(L: int, seed: int) -> masks.MaskSpec:
    return masks.padding(_lengths(L, seed)) & masks.document(_ids(L, seed))


def _attend(make: Callable[..., masks.MaskSpec], backend: str) -> Callable[..., torch.Tensor]:
    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *extra: Any) -> torch.Tensor:
        return attnkit.attention(q, k, v, mask=make(*extra), backend=backend)

    return fn


def _out_and_grads(fn: Callable[..., torch.Tensor], L: int, seed: int, extra: Any) -> list[Any]:
    qkv = _qkv(L, seed)
    out = fn(*qkv, *extra)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out * w).sum().backward()
    return [out.detach(), *(t.grad for t in qkv)]


def _compiled_matches_eager(name: str, backend: str, L: int, compiler: str = "aot_eager") -> int:
    """Compiled output and gradients equal eager's for two sets of spec values; returns how
    many graphs were compiled."""
    make, extra = CASES[name]
    fn = _attend(make, backend)
    counter = CompileCounterWithBackend(compiler)
    compiled = torch.compile(fn, fullgraph=True, backend=counter)
    for seed in (0, 1):
        got = _out_and_grads(compiled, L, seed, extra(L, seed))  # compiled first
        want = _out_and_grads(fn, L, seed, extra(L, seed))
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, **TOL)
    return counter.frame_count


@pytest.mark.parametrize("name", list(CASES))
def test_a_spec_on_the_sdpa_path_compiles_and_matches_eager(name: str) -> None:
    """L = 64 is below blocked's pairs: auto hands the materialised spec to torch's SDPA
    inside the graph (its ``allows_all`` shortcut is not taken while tracing: it reads the
    spec's values)."""
    assert _compiled_matches_eager(name, "auto", 64) == 1  # new values: the same graph
    q, k, v = _qkv(64, 0)
    make, extra = CASES[name]
    assert attnkit.explain(q, k, v, mask=make(*extra(64, 0))).chosen == "sdpa"


@pytest.mark.parametrize(
    "name", ["document(ids) from an input", "padding(lengths, q_lengths)", "sequence_causal"]
)
def test_a_spec_on_the_math_path_compiles_and_matches_eager(name: str) -> None:
    assert _compiled_matches_eager(name, "math", 64) == 1


@pytest.mark.parametrize(
    "name", ["key_mask(keep) & causal", "padding(lengths, q_lengths)", "prefix_lm(tensor)"]
)
def test_a_spec_on_the_blocked_path_compiles_and_matches_eager(name: str) -> None:
    """L = 160 is above blocked's pairs: the spec goes into the custom op as tensors and
    numbers, and is planned when the op runs."""
    assert _compiled_matches_eager(name, "auto", 160) == 1
    q, k, v = _qkv(160, 0)
    make, extra = CASES[name]
    assert attnkit.explain(q, k, v, mask=make(*extra(160, 0))).chosen == "blocked"


def test_inductor_compiles_a_document_spec_on_the_sdpa_path() -> None:
    with torch._inductor.config.patch(compile_threads=1):
        assert _compiled_matches_eager("document(ids) & causal & sliding_window", "auto", 64,
                                       compiler="inductor") == 1  # fmt: skip


@pytest.mark.parametrize(
    "name", ["document(ids) & causal & sliding_window", "causal & sliding_window(16)"]
)
def test_new_lengths_compile_one_graph_with_symbolic_sizes(name: str) -> None:
    """The second length compiles a graph with symbolic sizes, which serves every length
    after it: nothing on the spec's path turns a size back into a constant (formatting it into
    a message, hashing it into a set)."""
    make, extra = CASES[name]
    fn = _attend(make, "auto")
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, fullgraph=True, backend=counter)
    for L in (48, 64, 80, 96):
        got = _out_and_grads(compiled, L, L, extra(L, L))
        for a, b in zip(got, _out_and_grads(fn, L, L, extra(L, L)), strict=True):
            torch.testing.assert_close(a, b, **TOL)
    assert counter.frame_count == 2


def test_the_causal_flag_compiles_one_graph_for_new_lengths() -> None:
    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attnkit.attention(q, k, v, causal=True)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, fullgraph=True, backend=counter)
    for L in (48, 64, 80, 96):
        qkv = [t.detach() for t in _qkv(L, L)]
        torch.testing.assert_close(compiled(*qkv), fn(*qkv), **TOL)
    assert counter.frame_count == 2
