"""selected_keys in bfloat16 and float16: the gather kernel's C++ reads q, k, v in place
(widened to float32 as it loads them; out, dq, dk, dv in their dtype, dK/dV summed in float32)
on every CPU path, forward and backward, against the float64 oracle under the tolerance rule
(tests/oracle.py); and where a build does not read float16 (no F16C), float32 copies."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import masks
from attnkit.backends.blocked import gather, gather_native
from cpu_paths import use_path
from oracle import reference_attention, within_naive
from selected_cases import indices, scatter

LOW = [torch.bfloat16, torch.float16]
#: the paths a low-precision call may take here (each skipped where this CPU cannot run it)
PATHS = ["native", "fp32-upcast", "native-simulated"]
Tensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@pytest.fixture(autouse=True)
def _kernel_built() -> None:
    if gather_native.kernel() is None:
        pytest.skip(f"the C++ gather kernel is not built here: {gather_native._gather.reason}")


@pytest.fixture
def handed(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[torch.dtype]]:
    """The dtypes of q, k, v that the C++ forward and backward were handed (in place: the
    call's; on copies: float32)."""
    seen: dict[str, list[torch.dtype]] = {"forward": [], "backward": []}
    for name in seen:
        real = getattr(gather_native, name)

        def spy(*args: torch.Tensor, _real: Callable[..., object] = real, _n: str = name) -> object:
            seen[_n].append(args[0].dtype)
            return _real(*args)

        monkeypatch.setattr(gather_native, name, spy)
    return seen


def _against_oracle(
    leaves: Tensors, view: Callable[[Tensors], Tensors], spec: masks.MaskSpec, dense: torch.Tensor
) -> None:
    """attnkit's output and gradients (of the ``leaves``, through ``view``: slices of a cache,
    an expanded batch) against the float64 oracle's, within the rule of a naive run in the
    leaves' dtype."""
    dtype = leaves[0].dtype
    xs = tuple(t.detach().clone().requires_grad_() for t in leaves)
    out = attnkit.attention(*view(xs), mask=spec, backend="blocked")  # type: ignore[arg-type]
    assert out.dtype == dtype
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    got = torch.autograd.grad(out, xs, g)
    xd = tuple(t.detach().double().requires_grad_() for t in leaves)
    want, _ = reference_attention(*view(xd), mask=dense)  # type: ignore[arg-type]
    want_g = torch.autograd.grad(want, xd, g.double())
    xl = tuple(t.detach().clone().requires_grad_() for t in leaves)
    naive, _ = reference_attention(*view(xl), mask=dense, dtype=dtype)  # type: ignore[arg-type]
    naive_g = torch.autograd.grad(naive, xl, g)
    within_naive(out, want, naive, what=f"{dtype} output")
    for a, b, c, name in zip(got, want_g, naive_g, "qkv", strict=True):
        assert a.dtype == dtype
        within_naive(a, b, c, grad=True, what=f"{dtype} d{name}")


def _as_is(ts: Tensors) -> Tensors:
    return ts


CASES = [  # B, H, Hkv, per-kv-head indices, L, S, k, other rules, Dk, Dv
    (2, 4, 2, True, 9, 23, 5, "causal", 16, 16),  # grouped-query, indices per key/value head
    (1, 6, 3, True, 7, 30, 8, "padding", 16, 12),
    (2, 8, 1, False, 13, 70, 12, "causal", 36, 20),  # multi-query; head dims with tails
    (2, 8, 2, True, 1, 300, 32, "causal", 64, 64),  # a decode step
    (1, 4, 4, True, 16, 300, 64, "padding", 16, 24),  # a few speculative tokens
    (1, 2, 1, False, 6, 40, 150, "causal", 16, 8),  # k > S: keys repeated across blocks
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", LOW, ids=_name)
@pytest.mark.parametrize("case", CASES)
def test_reads_in_place_and_matches_oracle(  # type: ignore[no-untyped-def]
    case, dtype: torch.dtype, path: str, handed, monkeypatch: pytest.MonkeyPatch
) -> None:
    """q, k, v go to the C++ kernel as they are (the spy sees their dtype, forward and
    backward; the plan reads it; explain says so), with -1 entries, a duplicate and a row with
    no key; output and gradients within the rule."""
    use_path(monkeypatch, path, dtype)
    if dtype not in gather_native.reads():
        pytest.skip(f"this build does not read {dtype} (built without F16C)")
    B, H, Hkv, per_head, L, S, k, rule, Dk, Dv = case
    gen = torch.Generator().manual_seed(L * S + k)
    q, kk, v = (torch.randn(B, h, n, d, generator=gen).to(dtype)
                for h, n, d in ((H, L, Dk), (Hkv, S, Dk), (Hkv, S, Dv)))  # fmt: skip
    ind = indices(B, Hkv if per_head else None, L, S, k, seed=k)
    if L > 2:
        ind[..., 2, :] = -1  # a row with no key: output 0, gradient 0
    extra = masks.causal() if rule == "causal" else masks.padding(torch.tensor([S - 3] * B))
    spec = extra & masks.selected_keys(ind, heads=H)
    p = gather.plan(spec, None, L, S, dtype, q.device)
    assert p is not None
    assert dtype in p.reads
    assert not p.needs_float32(dtype)
    note = attnkit.explain(q, kk, v, mask=spec, backend="blocked").notes["blocked"]
    assert f"in C++ ({_name(dtype)} q, k, v read in place, float32 inside" in note
    assert "float32 copies" not in note
    _against_oracle((q, kk, v), _as_is, spec, scatter(ind, S, H) & extra.to_dense(L, S))
    assert handed == {"forward": [dtype], "backward": [dtype]}


@pytest.mark.parametrize("dtype", LOW, ids=_name)
def test_strided_cache_and_expanded_batch(dtype: torch.dtype, handed) -> None:  # type: ignore[no-untyped-def]
    """K/V read in place where they lie: views of a longer cache buffer, the batch expanded from
    one sequence's cache (stride 0); a decode step under no_grad, then the gradients."""
    if dtype not in gather_native.reads():
        pytest.skip(f"this build does not read {dtype} (built without F16C)")
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(2, 8, 3, 32, generator=gen).to(dtype)
    cache_k, cache_v = (torch.randn(1, 2, 64, d, generator=gen).to(dtype) for d in (32, 24))

    def view(ts: Tensors) -> Tensors:
        qq, ck, cv = ts
        return qq, ck[:, :, :40].expand(2, -1, -1, -1), cv[:, :, :40].expand(2, -1, -1, -1)

    ind = indices(2, 2, 3, 40, 9, seed=3)
    spec = masks.selected_keys(ind, heads=8) & masks.causal()
    dense = scatter(ind, 40, 8) & masks.causal().to_dense(3, 40)
    step = q[:, :, 2:].clone()  # one new query against the cache
    with torch.no_grad():
        last = masks.selected_keys(ind[:, :, 2:], heads=8)
        out = attnkit.attention(*view((step, cache_k, cache_v)), mask=last, backend="blocked")
        want, _ = reference_attention(*view((step.double(), cache_k.double(), cache_v.double())),
                                      mask=scatter(ind[:, :, 2:], 40, 8))  # fmt: skip
        naive, _ = reference_attention(*view((step, cache_k, cache_v)),
                                       mask=scatter(ind[:, :, 2:], 40, 8), dtype=dtype)  # fmt: skip
    assert out.dtype == dtype
    within_naive(out, want, naive, what=f"{dtype} decode step")
    _against_oracle((q, cache_k, cache_v), view, spec, dense)
    assert handed == {"forward": [dtype, dtype], "backward": [dtype]}


def test_float16_without_f16c_runs_on_float32_copies(  # type: ignore[no-untyped-def]
    handed, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build without F16C reads bfloat16 in place but not float16: float16 calls run the C++
    kernel on float32 copies (the plan needs them; explain says so), within the rule."""
    monkeypatch.setattr(gather_native, "reads", lambda: (torch.float32, torch.bfloat16))
    gen = torch.Generator().manual_seed(2)
    q, kk, v = (torch.randn(2, 4, n, 16, generator=gen).to(torch.float16) for n in (9, 23, 23))
    kk, v = kk[:, :2], v[:, :2]
    ind = indices(2, 2, 9, 23, 5, seed=5)
    spec = masks.causal() & masks.selected_keys(ind, heads=4)
    p = gather.plan(spec, None, 9, 23, torch.float16, q.device)
    assert p is not None
    assert p.needs_float32(torch.float16)
    assert not p.needs_float32(torch.bfloat16)
    note = attnkit.explain(q, kk, v, mask=spec, backend="blocked").notes["blocked"]
    assert "float32 copies" in note
    assert "in C++ (float32;" in note
    _against_oracle((q, kk, v), _as_is, spec, scatter(ind, 23, 4) & masks.causal().to_dense(9, 23))
    assert handed == {"forward": [torch.float32], "backward": [torch.float32]}


@pytest.mark.parametrize("dtype", LOW, ids=_name)
def test_a_block_of_a_longer_sequence_keeps_float32_results(dtype: torch.dtype) -> None:
    """Ring attention merges its blocks in float32: a block plan reads float32 only, so a
    low-precision block runs the torch operations and returns float32 (never rounded partial
    results)."""
    from attnkit.backends.blocked import BlockAt, forward_with_lse
    from attnkit.backends.blocked.blocks import BlockPlan
    from attnkit.backends.blocked.rowspan import NOT_SPANS

    ind = indices(1, None, 8, 12, 4, seed=1)
    spec = masks.causal() & masks.selected_keys(ind)
    p = gather.block_plan(spec, None, (0, 4), (0, 6), 4, dtype, torch.device("cpu"))
    assert p is not None
    assert p.reads == (torch.float32,)
    q, k = torch.randn(1, 2, 4, 8).to(dtype), torch.randn(1, 2, 6, 8).to(dtype)
    whole = BlockPlan(spec, 0, 0, 4, NOT_SPANS, None, None, p)
    out, lse = forward_with_lse(q, k, k, mask=spec, scale=0.3, at=BlockAt(0, 0, 8, 12), plan=whole)
    assert out.dtype == torch.float32
    assert lse.dtype == torch.float32


@settings(max_examples=20, deadline=None)
@given(
    dtype=st.sampled_from(LOW),
    L=st.integers(1, 12),
    S=st.integers(1, 40),
    k=st.integers(1, 9),
    g=st.sampled_from([1, 2, 4]),
    per_head=st.booleans(),
    dims=st.sampled_from([(8, 8), (13, 5), (32, 24), (72, 40)]),
    seed=st.integers(0, 10_000),
)
def test_sweep(
    dtype: torch.dtype,
    L: int,
    S: int,
    k: int,
    g: int,
    per_head: bool,
    dims: tuple[int, int],
    seed: int,
) -> None:
    """Random sizes, head dims with and without 8-lane tails, group sizes; in place where the
    build reads the dtype."""
    B, Hkv = 2, 2
    H, (Dk, Dv) = Hkv * g, dims
    gen = torch.Generator().manual_seed(seed)
    q, kk, v = (torch.randn(B, h, n, d, generator=gen).to(dtype)
                for h, n, d in ((H, L, Dk), (Hkv, S, Dk), (Hkv, S, Dv)))  # fmt: skip
    ind = indices(B, Hkv if per_head else None, L, S, k, seed)
    spec = masks.selected_keys(ind, heads=H) & masks.causal()
    _against_oracle((q, kk, v), _as_is, spec, scatter(ind, S, H) & masks.causal().to_dense(L, S))
