"""attnkit's row-span kernel (one run of keys per query row, CPU; float32, and bfloat16 /
float16 read directly) against the float64 oracle, the spans :func:`attnkit.masks.row_spans`
gives for each spec kind, and how the blocked backend hands the kernel the calls it serves.
Each float32 build this CPU runs is tested (``span_builds``: the AVX2 one, and the AVX-512 one
where the CPU has it), called directly and as the build ``attnkit.attention`` runs, and so is
the choice between them.

The kernel is built by ``make setup`` (``attnkit.backends.blocked.rowspan_builds.main()``);
these tests need it built: a machine without gcc or AVX2 fails them rather than skipping (the
blocked backend itself still runs there, on torch's kernel, and says so in ``explain``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import cpu, masks
from attnkit.backends import blocked
from attnkit.backends.blocked import measured, rowspan, rowspan_builds
from attnkit.backends.blocked.tiles import merge
from attnkit.cpu import hardware_flags
from attnkit.masks import alibi, alibi_slopes, row_spans, split_alibi
from oracle import reference_attention, within_naive
from span_builds import FP32_ISAS, expected_isa, fp32_kernel, has_avx512, running
from strategies import span_specs, specs

NINF = -math.inf


def _spans(lo: torch.Tensor, hi: torch.Tensor, *mods: Any) -> rowspan.SpanPlan:
    """The kernel's plan of the runs ``lo..hi``: with ``mods`` ``(slopes, d0, keys)``, else no
    score modifiers (no ALiBi slopes, d0 0, no holes in the keys)."""
    slopes, d0, keys = mods or (torch.empty(0), 0, torch.empty(0))
    return rowspan.SpanPlan(lo, hi, "runs", None, slopes=slopes, d0=d0, keys=keys)


def _allowed(lo: torch.Tensor, hi: torch.Tensor, S: int) -> torch.Tensor:
    """``(B', 1, L, S)`` bool from runs ``lo..hi``."""
    j = torch.arange(S)[None, None, :]
    return ((j >= lo[:, :, None]) & (j <= hi[:, :, None]))[:, None]


def _with_alibi(
    allowed: torch.Tensor, slopes: torch.Tensor, d0: int, keys: torch.Tensor
) -> torch.Tensor:
    """``allowed`` and the kernel's ``keys`` (0 or -inf per key), as the oracle's mask: with
    ALiBi's bias ``-slope_h |i + d0 - j|`` where allowed (``-inf`` elsewhere), float64
    ``(B', H, L, S)``; bool without slopes."""
    if keys.numel() > 0:
        allowed = allowed & (keys[:, None, None, : allowed.shape[-1]] == 0)
    if slopes.numel() == 0:
        return allowed
    L, S = allowed.shape[-2:]
    i, j = torch.arange(L)[:, None], torch.arange(S)[None, :]
    bias = -slopes.double()[:, None, None] * (i + d0 - j).abs()  # (H, L, S)
    return torch.where(allowed, bias[None], NINF)


def _lse(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """float64 log-sum-exp ``(B, H, L)`` over the allowed keys (``-inf`` where none): ``mask``
    bool (True = allowed) or float (added to the soft-capped scores)."""
    g = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(g, dim=1)
    s = (q.double() @ kk.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s + mask if mask.is_floating_point() else s.masked_fill(~mask, NINF)
    return torch.logsumexp(s, dim=-1)


def _grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
    g: torch.Tensor,
    softcap: float | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The oracle's output and its float64 gradients of ``sum(out * g)``."""
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    out, _ = reference_attention(*leaves, mask=allowed, scale=scale, softcap=softcap)
    (out * g.double()).sum().backward()
    return out.detach(), [t.grad for t in leaves if t.grad is not None]


def _lse_close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal ``-inf`` rows (nothing to attend to) and, elsewhere, within 1e-4."""
    live = want > NINF
    if not torch.equal(got == NINF, ~live):
        return False
    return bool(((got.double() - want).abs() * live).nan_to_num(0.0).max() <= 1e-4)


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> bool:
    return bool((got.double() - want).abs().max() <= tol * max(1.0, float(want.abs().max())))


def test_the_kernel_is_built_here() -> None:
    assert rowspan_builds.available(), rowspan_builds.status()
    names = {
        "avx2": "attnkit's AVX2 row-span kernel",
        "avx512": "attnkit's AVX-512 row-span kernel",
    }
    assert rowspan_builds.status() == names[expected_isa()]


@st.composite
def _monotone_runs(draw: st.DrawFn, rows: int, L: int, S: int) -> tuple[torch.Tensor, ...]:
    """Non-decreasing ``lo``, ``hi`` ``(rows, L)``, reaching past both ends of the keys, with
    empty rows (``lo > hi``) wherever they fall."""
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    lo = torch.randint(-3, S + 3, (rows, L), generator=gen).sort(dim=1).values
    hi = (lo + torch.randint(-4, S + 1, (rows, L), generator=gen)).sort(dim=1).values
    return lo, hi


@st.composite
def _mods(
    draw: st.DrawFn, B: int, H: int, L: int, S: int
) -> tuple[float, torch.Tensor, int, torch.Tensor]:
    """The kernel's score modifiers ``(softcap, slopes, d0, keys)``: no soft-cap (0) or one from
    0.5 (most scores saturate) to 20; no ALiBi or the slopes of ``H`` heads (times 4 too, so the
    bias matters at these lengths); where row 0 stands among the keys; no holes in the keys, or
    0 / -inf per key ``(1 or B, S + 8)`` with a fraction of them holes (all, at times)."""
    cap = draw(st.sampled_from([0.0, 0.0, 0.5, 2.0, 20.0]))
    slopes = torch.empty(0)
    if draw(st.booleans()):
        slopes = (alibi_slopes(H) * draw(st.sampled_from([1.0, 4.0]))).float()
    keys = torch.empty(0)
    if draw(st.booleans()):
        gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
        rows = draw(st.sampled_from([1, B]))
        holes = torch.rand(rows, S, generator=gen) < draw(st.sampled_from([0.2, 0.7, 1.0]))
        keys = torch.full((rows, S + 8), NINF)
        keys[:, :S].masked_fill_(~holes, 0.0)
    return cap, slopes, draw(st.integers(-L, S)), keys


@dataclass(frozen=True)
class _Case:
    """One call of the kernel: q, k, v, dout in one dtype, the runs, the scale, the modifiers."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    mods: tuple[float, torch.Tensor, int, torch.Tensor]

    @property
    def scale(self) -> float:
        return float(self.q.shape[-1]) ** -0.5

    def args(self) -> tuple[Any, ...]:
        """``spans, scale, softcap``: what follows the tensors in the kernel's calls."""
        return (_spans(self.lo, self.hi, *self.mods[1:]), self.scale, self.mods[0])


@st.composite
def _cases(
    draw: st.DrawFn,
    dtype: torch.dtype = torch.float32,
    dks: tuple[int, ...] = (8, 20, 64),
    dvs: tuple[int, ...] = (8, 24, 64),
) -> _Case:
    """A kernel call: any runs (per batch row or shared), GQA groups of 1, 2, 4, head dims from
    ``dks``/``dvs``, and the modifiers of :func:`_mods`."""
    B, Hkv = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    H = Hkv * draw(st.sampled_from([1, 2, 4]))
    L, S = draw(st.integers(1, 150)), draw(st.integers(1, 200))
    Dk, Dv = draw(st.sampled_from(dks)), draw(st.sampled_from(dvs))
    lo, hi = draw(_monotone_runs(B if draw(st.booleans()) else 1, L, S))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    q = torch.randn(B, H, L, Dk, generator=gen).to(dtype)
    k = torch.randn(B, Hkv, S, Dk, generator=gen).to(dtype)
    v = torch.randn(B, Hkv, S, Dv, generator=gen).to(dtype)
    dout = torch.randn(B, H, L, Dv, generator=gen).to(dtype)
    return _Case(q, k, v, dout, lo, hi, draw(_mods(B, H, L, S)))


def _check_oracle(
    case: _Case, out: torch.Tensor, lse: torch.Tensor, grads: Any, tol: float, grad_tol: float
) -> None:
    """out, lse and (dq, dk, dv) of the kernel against the float64 oracle on the same inputs:
    shapes and dtypes, out within ``tol`` and the gradients within ``grad_tol`` (relative to the
    largest value), lse within 1e-4; rows that see nothing: out 0, dq 0, lse -inf; a hole in the
    keys gets exactly no gradient."""
    q, k, v = case.q, case.k, case.v
    B, H, L = q.shape[:3]
    S, Dv = k.shape[2], v.shape[3]
    cap = case.mods[0] or None
    dq, dk, dv = grads
    assert out.dtype == dq.dtype == dk.dtype == dv.dtype == q.dtype
    assert lse.dtype == torch.float32
    assert (out.shape, lse.shape) == ((B, H, L, Dv), (B, H, L))
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    allowed = _with_alibi(_allowed(case.lo, case.hi, S), *case.mods[1:])
    want, want_grads = _grads(q, k, v, allowed, case.scale, case.dout, cap)
    want_lse = _lse(q, k, allowed, case.scale, cap)
    assert _close(out, want, tol)
    assert _lse_close(lse, want_lse)  # rows that see nothing: lse -inf, nothing else
    live = want_lse > NINF
    assert bool((out[~live] == 0).all())
    assert bool((dq[~live] == 0).all())
    for got, ref in zip((dq, dk, dv), want_grads, strict=True):
        assert not bool(got.isnan().any())
        assert _close(got, ref, grad_tol)
    keys = case.mods[3]
    if keys.numel() > 0:  # a hole gets exactly no gradient
        hole = (keys[:, :S] == NINF)[:, None, :, None]  # (B', 1, S, 1)
        assert bool((dk.masked_select(hole) == 0).all())
        assert bool((dv.masked_select(hole) == 0).all())


def _run(kernel: Any, case: _Case) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """out, lse and (dq, dk, dv) of ``kernel`` on ``case``."""
    q, k, v = case.q, case.k, case.v
    out, lse = kernel.span_forward(q, k, v, *case.args())
    return out, lse, kernel.span_backward(q, k, v, out, case.dout, lse, *case.args())


#: head dims of the float32 builds' tests: the compiled-in 64 and 128, odd ones (the AVX2
#: kernels' 8-column and scalar tails, the AVX-512 ones' masked tails and odd reductions), Dk
#: != Dv
FP32_DKS = (8, 20, 33, 64, 72, 128)
FP32_DVS = (8, 24, 64, 80, 128)


@pytest.mark.parametrize("isa", FP32_ISAS)
@settings(max_examples=60, deadline=None)
@given(case=_cases(dks=FP32_DKS, dvs=FP32_DVS))
def test_the_kernel_on_any_runs_equals_the_float64_oracle(isa: str, case: _Case) -> None:
    """float32, each build: out within 1e-5, gradients within 1e-4, of the float64 oracle."""
    _check_oracle(case, *_run(fp32_kernel(isa), case), 1e-5, 1e-4)


#: relative max error of the kernel on bfloat16/float16 inputs against the float64 oracle on the
#: same (rounded) inputs: ``max |got - want| <= RTOL * max(max |want|, 1)``, the rule and values
#: of tests/core/test_low_precision_paths.py (16 roundings of the dtype: the kernel computes in
#: float32 and rounds each result once, so what is left is that one rounding, 2**-9 / 2**-12)
RTOL = {torch.bfloat16: 2**-5, torch.float16: 2**-8}


@pytest.mark.parametrize("isa", FP32_ISAS)
@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from([torch.bfloat16, torch.float16]), data=st.data())
def test_the_kernel_reads_bf16_and_fp16_directly_and_equals_the_float64_oracle(
    isa: str, dtype: torch.dtype, data: Any
) -> None:
    """out, dq, dk, dv in the input dtype within RTOL of the oracle on the rounded inputs; lse
    float32 (computed in float32 from the rounded inputs: 1e-4 as for float32 inputs); rows
    with an empty run: out 0, dq 0, lse -inf. And the same numbers as the kernel on float32
    copies, rounded to the dtype (out, lse, dq exactly: their sums run in a fixed order)."""
    kernel = fp32_kernel(isa)
    case = data.draw(_cases(dtype, FP32_DKS, FP32_DVS))
    out, lse, grads = _run(kernel, case)
    _check_oracle(case, out, lse, grads, RTOL[dtype], RTOL[dtype])
    f32 = [t.float() for t in (case.q, case.k, case.v)]
    out32, lse32 = kernel.span_forward(*f32, *case.args())
    dq32 = kernel.span_backward(*f32, out.float(), case.dout.float(), lse, *case.args())[0]
    assert torch.equal(out, out32.to(dtype))
    assert torch.equal(lse, lse32)
    assert torch.equal(grads[0], dq32.to(dtype))


def _dot_kernel() -> Any:
    """The AVX512-BF16 build, or a skip saying why this machine cannot run it."""
    build, why = rowspan_builds.select(torch.bfloat16, in_dtype=True, dot=True)
    if build is not rowspan_builds.AVX512_BF16:
        pytest.skip(f"this machine cannot run it: {why}")
    return rowspan_builds.kernel(rowspan_builds.AVX512_BF16.isa)


#: the AVX512-BF16 build also rounds P and dS to bfloat16 for their products (relative 2**-9
#: per element, as GPU flash kernels do): its results stay within the same bfloat16 rule
DOT_RTOL = RTOL[torch.bfloat16]


@settings(max_examples=60, deadline=None)
@given(case=_cases(torch.bfloat16, (1, 7, 8, 20, 33, 64, 128), (1, 8, 24, 40, 64, 80)))
def test_the_bf16_dot_product_build_equals_the_float64_oracle(case: _Case) -> None:
    """The AVX512-BF16 build (bf16 dot products for every product, forward and backward) on
    any runs, GQA, odd and unequal head dims, soft-cap, ALiBi and holes: out, dq, dk, dv in
    bfloat16 within the bfloat16 rule of the float64 oracle on the rounded inputs; lse float32
    within 1e-4 (products of bfloat16 pairs are exact in float32); rows that see nothing: out
    0, dq 0, lse -inf; a hole in the keys gets exactly zero dk, dv (its P and dS are 0 in bf16
    too)."""
    _check_oracle(case, *_run(_dot_kernel(), case), DOT_RTOL, DOT_RTOL)


def test_the_bf16_dot_product_build_refuses_what_the_avx2_one_refuses() -> None:
    dot = _dot_kernel()
    q = torch.randn(1, 1, 4, 8)
    lo, hi = torch.zeros(1, 4, dtype=torch.long), torch.arange(4)[None]
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16, all one dtype"):
        dot.span_forward(q.bfloat16(), q, q, _spans(lo, hi), 1.0, 0.0)
    with pytest.raises(RuntimeError, match="non-decreasing along the rows"):
        dot.span_forward(q.bfloat16(), q.bfloat16(), q.bfloat16(), _spans(lo, hi.flip(1)), 1.0, 0.0)


def test_the_native_path_plans_bf16_for_the_dot_product_build_only() -> None:
    """``dot=True`` (the native CPU path): bfloat16 to the AVX512-BF16 build where it runs,
    float16 refused (torch's kernels take it as it is), and float32 to the float32 build that
    runs here (the AVX-512 one where the CPU has it)."""
    spec = masks.causal() & masks.sliding_window(8)
    q = torch.randn(1, 2, 40, 16)
    half = rowspan.plan(spec, q.half(), q.half(), q.half(), in_dtype=True, dot=True)
    assert half.reason == (
        "on the native CPU path attnkit's row-span kernel takes bfloat16 only (q is "
        "torch.float16): torch's kernels run on it as it is"
    )
    f32 = rowspan.plan(spec, q, q, q, in_dtype=True, dot=True)
    assert f32.serves
    assert f32.isa == expected_isa()
    bf = rowspan.plan(spec, q.bfloat16(), q.bfloat16(), q.bfloat16(), in_dtype=True, dot=True)
    build, why = rowspan_builds.select(torch.bfloat16, in_dtype=True, dot=True)
    if build is None:
        assert bf.reason == why
        assert "torch's kernels run on bfloat16 as it is" in why or "is off" in why
    else:
        assert bf.serves
        assert bf.isa == rowspan_builds.AVX512_BF16.isa
        assert bf.dtype == torch.bfloat16


def test_the_kernel_refuses_mixed_dtypes() -> None:
    q = torch.randn(1, 1, 4, 8)
    lo, hi = torch.zeros(1, 4, dtype=torch.long), torch.arange(4)[None]
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16, all one dtype"):
        rowspan_builds.kernel().span_forward(q.bfloat16(), q, q, _spans(lo, hi), 1.0, 0.0)
    out, lse = rowspan_builds.kernel().span_forward(q, q, q, _spans(lo, hi), 1.0, 0.0)
    with pytest.raises(RuntimeError, match="out, dout must be contiguous in q's dtype"):
        rowspan_builds.kernel().span_backward(
            q, q, q, out.bfloat16(), out, lse, _spans(lo, hi), 1.0, 0.0
        )


def test_the_plan_reads_low_precision_only_for_a_caller_that_takes_it_back() -> None:
    """``forward_with_lse`` returns float32 for a plan made by default (ring attention merges
    its blocks in float32), so bfloat16 goes to the tiles there; ``in_dtype=True`` (the
    blocked backend on fp32-upcast) lets the kernel read it and return bfloat16."""
    spec = masks.causal() & masks.sliding_window(8)
    q = torch.randn(1, 2, 40, 16).bfloat16()
    plain = blocked.plan_blocks(q, q, q, spec)
    assert not plain.spans.serves
    assert plain.spans.reason == (
        "attnkit's row-span kernel reads float32, bfloat16/float16 only on the fp32-upcast CPU "
        "path and bfloat16 on the native one (q is torch.bfloat16): torch's fused kernel runs"
    )
    assert blocked.forward_with_lse(q, q, q, mask=spec, scale=0.25, plan=plain)[0].dtype == (
        torch.float32
    )
    direct = blocked.plan_blocks(q, q, q, spec, in_dtype=True)
    assert direct.spans.serves
    assert direct.spans.dtype == torch.bfloat16
    out, lse = blocked.forward_with_lse(q, q, q, mask=spec, scale=0.25, plan=direct)
    assert (out.dtype, lse.dtype) == (torch.bfloat16, torch.float32)
    want, _ = reference_attention(q, q, q, mask=spec.to_dense(40, 40), scale=0.25)
    assert _close(out, want, RTOL[torch.bfloat16])
    wide = q.double()
    assert not blocked.plan_blocks(wide, wide, wide, spec, in_dtype=True).spans.serves


@pytest.mark.parametrize("isa", FP32_ISAS)
@settings(max_examples=60, deadline=None)
@given(
    B=st.integers(1, 2),
    Hkv=st.integers(1, 2),
    group=st.sampled_from([1, 2, 4]),
    L=st.integers(1, 120),
    S=st.integers(1, 140),
    Dv=st.sampled_from([16, 24, 80]),
    data=st.data(),
)
def test_every_interval_spec_runs_in_the_kernel_and_equals_the_oracle(
    isa: str, B: int, Hkv: int, group: int, L: int, S: int, Dv: int, data: Any
) -> None:
    """Every interval spec (causal, windows, documents, prefix-LM, padding, ...), ``&`` a key
    mask with holes or not, ``&`` ALiBi or not, soft-capped or not, grouped-query heads, Dk !=
    Dv, in each float32 build as ``attnkit.attention`` runs it: the kernel serves it, forward and
    backward, and equals the float64 oracle."""
    with running(isa):
        _check_interval_spec(isa, B, Hkv, group, L, S, Dv, data)


def _check_interval_spec(
    isa: str, B: int, Hkv: int, group: int, L: int, S: int, Dv: int, data: Any
) -> None:
    H = Hkv * group
    spec = data.draw(span_specs(B, L, S))
    if data.draw(st.booleans()):  # a key mask with holes (padding in the middle, dropped keys)
        gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
        spec = spec & masks.key_mask(torch.rand(B, S, generator=gen) > 0.3)
    if data.draw(st.booleans()):
        spec = alibi(H) & spec if data.draw(st.booleans()) else spec & alibi(H)
    softcap = data.draw(st.sampled_from([None, None, 1.0, 10.0]))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    q = torch.randn(B, H, L, 16, generator=gen)
    k = torch.randn(B, Hkv, S, 16, generator=gen)
    v = torch.randn(B, Hkv, S, Dv, generator=gen)
    dout = torch.randn(B, H, L, Dv, generator=gen)
    plan = blocked.plan_blocks(q, k, v, spec, softcap=softcap)
    assert plan.spans.serves, (spec, plan.spans.reason)
    assert plan.spans.isa == isa
    out, lse = blocked.forward_with_lse(q, k, v, mask=spec, scale=0.25, plan=plan)
    allowed = spec.to_dense(L, S, dtype=torch.float64)
    want, grads = _grads(q, k, v, allowed, 0.25, dout, softcap)
    want_lse = _lse(q, k, allowed, 0.25, softcap)
    assert _close(out, want, 1e-5)
    assert _lse_close(lse, want_lse)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got = attnkit.attention(*leaves, mask=spec, scale=0.25, softcap=softcap, backend="blocked")
    (got * dout).sum().backward()
    assert torch.equal(got.detach(), out)
    for leaf, ref in zip(leaves, grads, strict=True):
        assert leaf.grad is not None
        assert not bool(leaf.grad.isnan().any())
        assert _close(leaf.grad, ref, 1e-4)


@settings(max_examples=80, deadline=None)
@given(
    B=st.integers(1, 2),
    L=st.integers(1, 24),
    S=st.integers(1, 24),
    data=st.data(),
)
def test_row_spans_are_exact_where_given(B: int, L: int, S: int, data: Any) -> None:
    spec = data.draw(st.one_of(specs(B, L, S), span_specs(B, L, S)))
    spans = row_spans(spec, L, S)
    assume(spans is not None)  # None is always safe (block maps run it); given must be exact
    assert spans is not None
    lo, hi = spans
    assert lo.dtype == hi.dtype == torch.long
    assert lo.shape[1:] == (L,)
    assert bool((lo >= 0).all() and (lo <= S).all() and (hi >= -1).all() and (hi < S).all())
    assert torch.equal(
        _allowed(lo, hi, S).expand(B, 1, L, S), spec.to_dense(L, S).expand(B, 1, L, S)
    )


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 2), L=st.integers(1, 24), S=st.integers(1, 24), data=st.data())
def test_interval_specs_always_have_spans(B: int, L: int, S: int, data: Any) -> None:
    spec = data.draw(span_specs(B, L, S))
    assert row_spans(spec, L, S) is not None, spec


def test_specs_that_are_not_one_run_per_row_have_no_spans() -> None:
    holes = torch.tensor([[True, False, True, True]])
    back = torch.tensor([0, 0, 1, 1, 0, 0])  # document 0 comes back
    assert row_spans(masks.key_mask(holes), 4, 4) is None
    assert row_spans(masks.document(back), 6, 6) is None
    assert row_spans(masks.causal() & alibi(2), 6, 6) is None
    assert row_spans(~masks.causal(), 6, 6) is None
    far = masks.sliding_window(1) | masks.padding(torch.tensor([2]))  # row 5: keys 0-1, 5
    assert row_spans(far, 6, 6) is None
    assert row_spans(masks.as_spec(torch.ones(6, 6, dtype=torch.bool)), 6, 6) is None
    left = masks.key_mask(torch.tensor([[False, False, True, True]]))  # left padding: one run
    assert row_spans(left, 4, 4) is not None


@settings(max_examples=40, deadline=None)
@given(
    L=st.integers(2, 90),
    S=st.integers(2, 90),
    group=st.sampled_from([1, 2, 4]),
    data=st.data(),
)
def test_blocks_at_global_offsets_merge_to_the_whole_attention(
    L: int, S: int, group: int, data: Any
) -> None:
    """Ring attention's use: a slice of queries against two slices of keys, each block at its
    global positions, merged by log-sum-exp, then each block's backward from the merged lse;
    with ALiBi (its distances are global) and a soft-cap too."""
    B = 2
    spec = data.draw(span_specs(B, L, S))
    if data.draw(st.booleans()):
        spec = alibi(2 * group) & spec
    softcap = data.draw(st.sampled_from([None, 2.0]))
    a = data.draw(st.integers(0, L - 1))
    b = data.draw(st.integers(a + 1, L))
    c = data.draw(st.integers(1, S - 1))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    q = torch.randn(B, 2 * group, L, 16, generator=gen)
    k, v = torch.randn(2, B, 2, S, 16, generator=gen)
    dout = torch.randn(B, 2 * group, b - a, 16, generator=gen)
    qs = q[:, :, a:b]
    parts = [(0, k[:, :, :c], v[:, :, :c]), (c, k[:, :, c:], v[:, :, c:])]
    at = [blocked.BlockAt(a, ks, L, S) for ks, _, _ in parts]
    plans = [
        blocked.plan_blocks(qs, kk, vv, spec, w, softcap)
        for (_, kk, vv), w in zip(parts, at, strict=True)
    ]
    assert all(p.spans.serves for p in plans)
    res = [
        blocked.forward_with_lse(qs, kk, vv, mask=spec, scale=0.25, at=w, plan=p)
        for (_, kk, vv), w, p in zip(parts, at, plans, strict=True)
    ]
    out, lse = res[0]
    merge(out, lse, *res[1])  # in place, into the first block's result
    allowed = spec.to_dense(L, S, dtype=torch.float64)[:, :, a:b]
    want, grads = _grads(qs, k, v, allowed, 0.25, dout, softcap)
    assert _close(out, want, 1e-5)
    dq = torch.zeros_like(qs)
    dks, dvs = [], []
    for (_, kk, vv), w, p in zip(parts, at, plans, strict=True):
        g = blocked.backward_from_lse(
            qs, kk, vv, out, dout, lse, mask=spec, scale=0.25, at=w, plan=p
        )
        dq += g[0]
        dks.append(g[1])
        dvs.append(g[2])
    for got, ref in zip((dq, torch.cat(dks, 2), torch.cat(dvs, 2)), grads, strict=True):
        assert _close(got, ref, 1e-4)


def test_rows_that_see_nothing_stay_zero_with_zero_gradients() -> None:
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 70, 32, generator=gen, requires_grad=True)
    k = torch.randn(2, 2, 50, 32, generator=gen, requires_grad=True)
    v = torch.randn(2, 2, 50, 32, generator=gen, requires_grad=True)
    # causal with L > S: the first 20 rows see nothing; sequence 1 has 30 real queries
    spec = masks.causal() & masks.padding(torch.tensor([50, 40]), torch.tensor([70, 30]))
    assert blocked.plan_blocks(q, k, v, spec).spans.serves
    out = attnkit.attention(q, k, v, mask=spec, backend="blocked")
    out.sum().backward()
    assert q.grad is not None
    assert bool((out[:, :, :20] == 0).all())
    assert bool((out[1, :, 30:] == 0).all())
    assert bool((q.grad[:, :, :20] == 0).all())
    assert bool((q.grad[1, :, 30:] == 0).all())
    assert not any(bool(t.isnan().any()) for t in (out, q.grad, k.grad, v.grad))  # type: ignore[arg-type]
    _, lse = blocked.forward_with_lse(q, k, v, mask=spec, scale=0.25)
    assert bool((lse[:, :, :20] == NINF).all())
    assert bool((lse[:, :, 20:][0] > NINF).all())


def test_non_contiguous_inputs_are_read_correctly() -> None:
    x = torch.randn(2, 100, 3, 32)  # (B, L, H, D) in memory, as projections leave it
    q = k = v = x.transpose(1, 2)
    spec = masks.causal() & masks.sliding_window(17)
    out, lse = blocked.forward_with_lse(q, k, v, mask=spec, scale=0.2)
    allowed = spec.to_dense(100, 100)
    want, _ = reference_attention(q, k, v, mask=allowed, scale=0.2)
    assert _close(out, want, 1e-5)
    assert _lse_close(lse, _lse(q, k, allowed, 0.2))


def test_the_kernel_refuses_a_plan_without_int64_runs() -> None:
    """A plan that does not serve (no runs of keys) or runs that are not int64 ``(1 or B, L)``
    are refused by name before the C side reads a pointer, forward and backward."""
    q = torch.randn(1, 1, 4, 8)
    lo = torch.zeros(1, 4, dtype=torch.long)
    kernel = rowspan_builds.kernel()
    out, lse = kernel.span_forward(q, q, q, _spans(lo, lo), 1.0, 0.0)
    bad = [
        (rowspan.NOT_SPANS, "must be int64"),
        (_spans(lo.int(), lo.int()), "must be int64"),
        (_spans(lo, lo[0]), "must be \\(1 or B, L\\), one shape"),
    ]
    for spans, message in bad:
        with pytest.raises(RuntimeError, match=f"row-span kernel: the plan's lo, hi {message}"):
            kernel.span_forward(q, q, q, spans, 1.0, 0.0)
        with pytest.raises(RuntimeError, match=f"row-span kernel: the plan's lo, hi {message}"):
            kernel.span_backward(q, q, q, out, out, lse, spans, 1.0, 0.0)


def test_the_kernel_refuses_runs_out_of_order() -> None:
    q = torch.randn(1, 1, 4, 8)
    lo = torch.tensor([[0, 2, 1, 3]])
    hi = torch.tensor([[0, 2, 2, 3]])
    with pytest.raises(RuntimeError, match="non-decreasing along the rows"):
        rowspan_builds.kernel().span_forward(q, q, q, _spans(lo, hi), 1.0, 0.0)


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
def test_the_causal_window_is_recognised_exactly(
    spec: masks.MaskSpec | None, window: int | None
) -> None:
    assert masks.causal_window(spec) == window


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[object, ...]]:
    seen: list[tuple[object, ...]] = []
    builds = rowspan_builds.kernel

    class Spy:
        def __init__(self, isa: str = "avx2") -> None:
            self.real = builds(isa)

        def span_forward_finite(self, *args: Any) -> tuple[torch.Tensor, torch.Tensor, bool]:
            seen.append((*args[0].shape, args[1].shape[1]))
            return self.real.span_forward_finite(*args)  # type: ignore[no-any-return]

        def span_backward(self, *args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            seen.append(("backward", *args[0].shape))
            return self.real.span_backward(*args)  # type: ignore[no-any-return]

    monkeypatch.setattr(rowspan_builds, "kernel", Spy)
    return seen


def test_training_with_grouped_query_heads_and_a_window_uses_the_kernel(
    calls: list[tuple[object, ...]],
) -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 150, 16, generator=gen)
    k, v = torch.randn(2, 2, 2, 150, 16, generator=gen)
    g = torch.randn(2, 8, 150, 16, generator=gen)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attnkit.attention(*leaves, causal=True, mask=masks.sliding_window(40))
    (out * g).sum().backward()
    assert calls == [(2, 8, 150, 16, 2), ("backward", 2, 8, 150, 16)]  # K/V not repeated
    spec = masks.causal() & masks.sliding_window(40)
    want, grads = _grads(q, k, v, spec.to_dense(150, 150), 16**-0.5, g)
    assert _close(out.detach(), want, 1e-5)
    for leaf, ref in zip(leaves, grads, strict=True):
        assert leaf.grad is not None
        assert _close(leaf.grad, ref, 1e-5)


def test_calls_the_kernel_does_not_serve_go_to_torchs_kernel(
    calls: list[tuple[object, ...]], monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = masks.causal() & masks.sliding_window(8)
    q = torch.randn(1, 4, 64, 16)
    bf = q.bfloat16()
    holes = masks.causal() & ~masks.sliding_window(4)  # row_spans does not read ~
    crossing = masks.padding(torch.tensor([64]), torch.tensor([10])) | (
        masks.causal() & masks.sliding_window(1)
    )  # rows 0-9 see every key, later rows only themselves: the runs move back
    # bfloat16 as it is (the CPU path `torch`; on `fp32-upcast` the kernel reads it directly:
    # tests/core/test_low_precision_paths.py)
    monkeypatch.setenv("ATTNKIT_CPU_PATH", "torch")
    attnkit.attention(bf, bf, bf, mask=spec, backend="blocked")
    attnkit.attention(q, q, q, mask=holes, backend="blocked")
    attnkit.attention(q, q, q, mask=spec & alibi(4) & alibi(4), backend="blocked")  # two biases
    got = attnkit.attention(q, q, q, mask=crossing, backend="blocked")
    assert calls == []
    want, _ = reference_attention(q, q, q, mask=crossing.to_dense(64, 64))
    assert _close(got, want, 1e-5)
    note = attnkit.explain(bf, bf, bf, mask=spec).notes["blocked"]
    assert (
        "row-span kernel reads float32, bfloat16/float16 only on the fp32-upcast CPU path and "
        "bfloat16 on the native one (q is torch.bfloat16)" in note
    )
    note = attnkit.explain(q, q, q, mask=crossing).notes["blocked"]
    assert "its runs of keys do not move forward along the rows" in note


def test_explain_names_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    q = torch.randn(1, 8, 256, 32)
    kv = torch.randn(1, 2, 256, 32)  # grouped-query heads, 4 per kv head
    spec = masks.causal() & masks.sliding_window(64)
    note = attnkit.explain(q, kv, kv, mask=spec).notes["blocked"]
    name = {"avx2": "AVX2", "avx512": "AVX-512"}[expected_isa()]
    assert note == (
        f"causal sliding window 64: forward and backward run attnkit's {name} row-span kernel "
        "(one pass each, no tiles); under torch.compile the same, as one custom op "
        "(attnkit::blocked_attention)"
    )
    docs = masks.document(torch.arange(256) // 100) & masks.causal()
    note = attnkit.explain(q, kv, kv, mask=docs).notes["blocked"]
    assert note.startswith(
        "row spans of document(<ids (1, 256)>) & causal(): forward and backward run attnkit's "
        f"{name} row-span kernel"
    )
    # switched off (as on a machine where it cannot be built): torch's kernel, and why
    monkeypatch.setenv(rowspan_builds.ENV, "0")
    monkeypatch.setattr(rowspan_builds.BASE.lazy, "tried", False)
    monkeypatch.setattr(rowspan_builds.BASE.lazy, "module", None)
    assert not rowspan_builds.available()
    assert rowspan_builds.status() == (
        "torch's fused kernel (attnkit's row-span kernel is off: ATTNKIT_SPAN_KERNEL=0 in the "
        "environment)"
    )
    note = attnkit.explain(q, kv, kv, mask=spec).notes["blocked"]
    assert (
        "causal sliding window 64 (torch's fused kernel (attnkit's row-span kernel is off" in note
    )
    out = attnkit.attention(q, kv, kv, mask=spec)
    want, _ = reference_attention(q, kv, kv, mask=spec.to_dense(256, 256))
    assert _close(out, want, 1e-5)


def test_auto_takes_the_kernel_for_plain_causal_calls_where_it_was_measured_faster() -> None:
    q = torch.randn(1, 8, 1024, 16)
    kv = torch.randn(1, 2, 1024, 16)
    report = attnkit.explain(q, kv, kv, causal=True)
    assert report.chosen == "blocked"
    measured_rule = measured.select(torch.float32, "causal")[1]
    assert report.rule == (
        "causal on CPU (torch.float32), L x S >= 1024 x 1024: attnkit's row-span kernel; "
        + measured_rule
    )
    assert measured_rule.startswith("measured rule 'float32 on avx")
    want, _ = reference_attention(q, kv, kv, causal=True)
    assert _close(attnkit.attention(q, kv, kv, causal=True), want, 1e-5)
    short = q[:, :, :512]
    small = attnkit.explain(short, short, short, causal=True)
    assert small.chosen == "sdpa"  # not measured
    assert "plain causal CPU calls its kernel runs from L x S = 1024 x 1024" in str(small)
    wide = q.double()
    assert attnkit.explain(wide, wide, wide, causal=True).chosen == "sdpa"  # not float32
    if cpu.path_for(q.bfloat16(), "test") == "fp32-upcast":  # the kernel reads bf16 directly
        half = q.bfloat16()
        report = attnkit.explain(half, half, half, causal=True)
        assert report.chosen == "blocked"
        assert "causal on CPU (torch.bfloat16, read directly)" in report.rule


def test_alibi_is_split_from_its_rule_and_the_kernel_runs_both() -> None:
    spec = masks.causal() & alibi(4) & masks.sliding_window(3)
    parts = split_alibi(spec)
    assert parts is not None
    assert torch.equal(parts[0], alibi_slopes(4))
    assert repr(parts[1]) == "causal() & sliding_window(3)"
    assert split_alibi(alibi(2)) is not None
    assert split_alibi(alibi(2))[1] is None  # type: ignore[index]  # every pair: one full run
    for other in (
        masks.causal(),
        alibi(2) & alibi(2),
        (alibi(4) & masks.causal()).select_heads(1, 3),
    ):
        assert split_alibi(other) is None
    q = torch.randn(1, 4, 64, 16)
    note = attnkit.explain(q, q, q, mask=alibi(4) & masks.causal(), backend="blocked")
    assert note.notes["blocked"].startswith(
        f"row spans of alibi(4) & causal(): forward and backward run {rowspan_builds.status()}"
    )
    wrong = blocked.plan_blocks(q, q, q, alibi(2) & masks.causal()).spans
    assert not wrong.serves
    assert wrong.reason == "alibi(2) & causal() has 2 ALiBi slopes for 4 heads"


def test_the_runs_are_computed_once_per_spec_and_sizes_and_again_after_an_edit() -> None:
    """A spec with a cache key is turned into runs once per (sizes, positions); a spec whose
    tensor is edited in place (its version moves) gets its runs again, never stale ones."""
    rowspan.clear_runs()
    ids = torch.tensor([0] * 20 + [1] * 20)
    spec = masks.causal() & masks.document(ids)
    q = torch.randn(1, 2, 40, 16)
    first = rowspan.plan(spec, q, q, q)
    assert rowspan.plan(spec, q, q, q) is first  # the cached plan, refused or not
    assert len(rowspan._RUNS) == 1
    assert first.lo is not None
    assert first.lo[0, 25].item() == 20
    ids[20:] = 0  # one document now: row 25 sees every key up to itself
    again = rowspan.plan(spec, q, q, q)
    assert again is not first
    assert again.lo is not None
    assert again.lo[0, 25].item() == 0
    rowspan.plan(spec, q[:, :, :30], q, q)  # other sizes: runs of their own
    assert len(rowspan._RUNS) == 3


def test_the_bf16_build_leaves_denormals_to_the_threads_as_it_found_them() -> None:
    """The AVX512-BF16 build flushes denormals while its items run (MXCSR's FTZ/DAZ) and
    restores MXCSR after: float32 denormals computed on the same threads afterwards survive."""
    dot = _dot_kernel()
    q = torch.randn(1, 4, 512, 64).bfloat16()
    lo, hi = torch.zeros(1, 512, dtype=torch.long), torch.arange(512)[None]
    out, lse = dot.span_forward(q, q, q, _spans(lo, hi), 0.125, 0.0)
    dot.span_backward(q, q, q, out, out, lse, _spans(lo, hi), 0.125, 0.0)
    tiny = torch.full((1 << 20,), 1e-39)  # a float32 denormal, on every thread torch uses
    assert bool((tiny * 1.0 > 0).all())
    assert bool((tiny + tiny == 2e-39).all())


#: (mask, softcap) of the end-to-end cases below: causal, a window, documents, ALiBi, a
#: soft-cap, holes in the keys, and no mask
_E2E_IDS = torch.arange(203) // 70  # three documents, ragged


def _e2e_specs() -> list[tuple[str, masks.MaskSpec | None, float | None]]:
    holes = torch.rand(1, 203, generator=torch.Generator().manual_seed(5)) > 0.25
    return [
        ("none", None, None),
        ("causal", masks.causal(), None),
        ("window", masks.causal() & masks.sliding_window(50), None),
        ("documents", masks.document(_E2E_IDS) & masks.causal(), None),
        ("alibi", alibi(8) & masks.causal(), None),
        ("softcap", masks.causal(), 5.0),
        ("holes", masks.causal() & masks.key_mask(holes), None),
    ]


@pytest.mark.parametrize("isa", FP32_ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("Dk", "Dv", "Hkv"), [(64, 64, 8), (128, 128, 2), (80, 72, 4)])
def test_each_build_trains_every_kind_of_run_at_model_head_dims(
    isa: str, dtype: torch.dtype, Dk: int, Dv: int, Hkv: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``attnkit.attention`` forward and backward in each float32 build (float32, and bfloat16 /
    float16 read directly on the fp32-upcast path), L = 203 (not a multiple of 6, 16 or 48),
    8 query heads on 8, 4 or 2 kv heads, head dims 64, 128 and 80 / 72 (tails; Dk != Dv): out,
    dq, dk, dv within the tolerance rule of the float64 oracle (the naive run in ``dtype`` sets
    the bound)."""
    L = 203
    if dtype != torch.float32:  # the fp32-upcast path, forced where it is not this CPU's own
        reason = cpu.unavailable("fp32-upcast", dtype)
        if reason is not None:
            pytest.skip(f"the fp32-upcast path cannot run {dtype} here: {reason}")
        monkeypatch.setenv(cpu.ENV, "fp32-upcast")
    gen = torch.Generator().manual_seed(Dk + Dv + Hkv)
    q = torch.randn(1, 8, L, Dk, generator=gen).to(dtype)
    k = torch.randn(1, Hkv, L, Dk, generator=gen).to(dtype)
    v = torch.randn(1, Hkv, L, Dv, generator=gen).to(dtype)
    dout = torch.randn(1, 8, L, Dv, generator=gen).to(dtype)
    with running(isa):
        for what, spec, cap in _e2e_specs():
            plan = blocked.plan_blocks(q, k, v, spec, softcap=cap, in_dtype=dtype != torch.float32)
            assert plan.spans.serves, (what, plan.spans.reason)
            assert plan.spans.isa == isa
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = attnkit.attention(*leaves, mask=spec, softcap=cap, backend="blocked")
            assert out.dtype == dtype
            (out * dout).sum().backward()
            allowed = None if spec is None else spec.to_dense(L, L)
            ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
            want, _ = reference_attention(*ref, mask=allowed, softcap=cap)
            (want * dout.double()).sum().backward()
            low = [t.detach().requires_grad_() for t in (q, k, v)]
            naive, _ = reference_attention(*low, mask=allowed, softcap=cap, dtype=dtype)
            (naive * dout).sum().backward()
            within_naive(out, want, naive, what=(isa, dtype, what, "out"))
            for name, got, r, nv in zip("qkv", leaves, ref, low, strict=True):
                assert got.grad is not None
                assert r.grad is not None
                assert nv.grad is not None
                assert got.grad.dtype == dtype
                within_naive(got.grad, r.grad, nv.grad, grad=True, what=(isa, dtype, what, name))


def test_float32_runs_in_the_avx512_build_where_the_cpu_has_it_and_the_switch_keeps_avx2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Where the CPU has AVX-512 (F, DQ, BW, VL) the plans of float32 calls (and of bfloat16 /
    float16 read directly) name the AVX-512 build, ``kernel(isa)`` is that build, status,
    explain and ``make setup``'s line say so and ``attnkit.attention`` calls it; with
    ``ATTNKIT_ROWSPAN_ISA=avx2`` all of that is the AVX2 build; another value is an error."""
    if not rowspan_builds.available():
        pytest.skip(rowspan_builds.status())
    if not has_avx512():
        missing = [f for f in rowspan_builds.AVX512.needs if f not in hardware_flags()]
        pytest.skip(f"this CPU has no AVX-512 build to choose (no {', '.join(missing)})")
    spec = masks.causal() & masks.sliding_window(8)
    q = torch.randn(1, 4, 64, 16)
    seen: list[str] = []
    real = rowspan_builds.kernel

    def spy(isa: str = "avx2") -> Any:
        seen.append(isa)
        return real(isa)

    monkeypatch.setattr(rowspan_builds, "kernel", spy)
    names = {"avx2": "AVX2", rowspan_builds.AVX512.isa: "AVX-512"}
    for switch, isa in (
        (None, rowspan_builds.AVX512.isa),
        ("auto", rowspan_builds.AVX512.isa),
        ("avx2", "avx2"),
    ):
        if switch is None:
            monkeypatch.delenv(rowspan_builds.ISA_ENV, raising=False)
        else:
            monkeypatch.setenv(rowspan_builds.ISA_ENV, switch)
        blocked.clear_plans()
        seen.clear()
        assert rowspan.plan(spec, q, q, q).isa == isa
        low = rowspan.plan(spec, q.bfloat16(), q.bfloat16(), q.bfloat16(), in_dtype=True)
        assert low.serves
        assert low.isa == isa
        module = real(isa)
        assert module.build.isa == isa
        assert module._lib.attnkit_span_avx512() == (1 if isa == rowspan_builds.AVX512.isa else 0)
        assert rowspan_builds.select(torch.float32)[0].lazy.module is module
        assert rowspan_builds.status() == f"attnkit's {names[isa]} row-span kernel"
        note = attnkit.explain(q, q, q, mask=spec, backend="blocked").notes["blocked"]
        assert f"forward and backward run attnkit's {names[isa]} row-span kernel" in note
        leaf = q.clone().requires_grad_()
        attnkit.attention(leaf, q, q, mask=spec, backend="blocked").sum().backward()
        assert seen == [isa, isa]  # the forward, then the backward
        rowspan_builds.main()
        line = capsys.readouterr().out.splitlines()[0]
        assert line.startswith(f"attnkit row-span kernel: attnkit's {names[isa]} row-span kernel")
    assert rowspan_builds.select(torch.float32)[1] == (
        "the AVX2 build runs float32 (no AVX-512 build: ATTNKIT_ROWSPAN_ISA=avx2 in the "
        "environment)"
    )
    assert (
        real(rowspan_builds.AVX512.isa).build.isa == rowspan_builds.AVX512.isa
    )  # still there to call directly
    monkeypatch.setenv(rowspan_builds.ISA_ENV, "avx-512")
    blocked.clear_plans()
    with pytest.raises(ValueError, match="ATTNKIT_ROWSPAN_ISA='avx-512': expected one of auto"):
        rowspan.plan(spec, q, q, q)


@pytest.mark.parametrize("isa", FP32_ISAS)
def test_the_kernel_reports_nan_and_inf_it_reads_and_only_those(isa: str) -> None:
    """``span_forward_finite``: False for NaN or inf in a query row (one whose span is empty
    too), or in a key or value row some span reaches; True for one that no span reaches (past
    the kernel's panel of the last key a row sees)."""
    kern = fp32_kernel(isa)
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 4, 200, 32, generator=g) for _ in range(3))
    lengths = torch.tensor([200, 100])
    plan = rowspan.plan(masks.padding(lengths), q, k, v)
    assert plan.serves, plan.reason
    assert kern.span_forward_finite(q, k, v, plan, 0.2, 0.0)[2]
    cases = [
        ("q", (0, 2, 50, 3), math.nan, False),
        ("k", (0, 1, 199, 0), math.inf, False),
        ("v", (1, 3, 99, 31), -math.inf, False),
        ("k", (1, 0, 180, 5), math.nan, True),  # past sequence 1's 100 keys: never read
        ("v", (1, 0, 150, 5), math.inf, True),
    ]
    for name, at, value, finite in cases:
        t = {"q": q, "k": k, "v": v}
        bad = t[name].clone()
        bad[at] = value
        t[name] = bad
        out, _, got = kern.span_forward_finite(t["q"], t["k"], t["v"], plan, 0.2, 0.0)
        assert got is finite, (name, at, value)
        if finite:  # what it computed is the answer: no row saw the bad entry
            assert torch.equal(out, kern.span_forward(q, k, v, plan, 0.2, 0.0)[0])
    # a query row whose span is empty is read for the check only: NaN there is reported too
    empty = torch.tensor([200, 0])
    plan0 = rowspan.plan(masks.padding(empty), q, k, v)
    bad_q = q.clone()
    bad_q[1, 0, 7, 0] = math.nan
    assert not kern.span_forward_finite(bad_q, k, v, plan0, 0.2, 0.0)[2]
    assert kern.span_forward_finite(q, k, v, plan0, 0.2, 0.0)[2]


@pytest.mark.parametrize("isa", FP32_ISAS)
def test_a_call_on_the_kernel_sums_nothing_and_follows_the_nonfinite_rule(
    isa: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel checks what it reads, so the dispatcher skips its sums over q, k, v; NaN and
    inf still reach exactly the rows the float64 oracle gives NaN."""
    from attnkit.backends import nonfinite

    sums: list[int] = []
    real = nonfinite._all_finite
    monkeypatch.setattr(nonfinite, "_all_finite", lambda call: sums.append(1) or real(call))
    g = torch.Generator().manual_seed(8)
    q = torch.randn(3, 4, 160, 16, generator=g)
    k, v = (torch.randn(3, 2, 160, 16, generator=g) for _ in range(2))
    spec = masks.padding(torch.tensor([160, 60, 0])) & masks.causal()
    with running(isa):
        assert "row-span kernel" in str(attnkit.explain(q, k, v, mask=spec, backend="blocked"))
        out = attnkit.attention(q, k, v, mask=spec, backend="blocked")
        assert sums == []  # a finite call: no sum over q, k, v
        assert torch.isfinite(out).all()
        k[1, 0, 130, 2] = math.nan  # past sequence 1's 60 keys: seen by no row
        v[0, 1, 40, 0] = math.inf  # seen by sequence 0's heads 2, 3 from row 40 on
        k[0, 0, 150, 1] = -math.inf  # seen by sequence 0's heads 0, 1 from row 150 on
        q[2, 3, 5, 7] = math.nan  # a row of the empty sequence
        out = attnkit.attention(q, k, v, mask=spec, backend="blocked")
    want, _ = reference_attention(q, k, v, mask=spec.to_dense(160, 160))
    nan = torch.isnan(want).any(-1)
    assert torch.equal(torch.isnan(out).any(-1), nan)
    assert int(nan[0, 2:].sum()) == 2 * 120
    assert int(nan[0, :2].sum()) == 2 * 10
    assert not bool(nan[1].any())
    assert int(nan[2].sum()) == 1
    naive, _ = reference_attention(q, k, v, mask=spec.to_dense(160, 160), dtype=torch.float32)
    within_naive(out, want, naive, where=~nan[..., None].expand_as(want), what="finite rows")
