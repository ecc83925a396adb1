"""The blocked backend against the float64 oracle: every mask spec and their combinations,
outputs and gradients, odd sizes, block grains that do not divide L, GQA, all dtypes, the
log-sum-exp, the block functions ring attention builds on, and memory that grows with L.

The planner's knobs (grain, when runs of blocks split, launch sizes, the mask budget) are
turned down in ``planner`` so that small cases walk every path a long sequence takes: several
segments per tile merged by log-sum-exp, batched strided tiles, chunked launches, masks built
per call. Tolerances: tests/oracle.py's rule (within_naive).
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import AttentionInputError, masks
from attnkit.backends import blocked
from attnkit.backends.blocked import BlockAt, backward_from_lse, forward_with_lse
from attnkit.backends.blocked import config as blocked_config
from attnkit.masks import MaskSpec
from oracle import FLOOR, reference_attention, within_naive
from strategies import Sizes, qkv, specs

# name -> planner settings (see attnkit.backends.blocked.config)
PLANNERS: dict[str, dict[str, object]] = {
    "default": {},
    "fine": {  # 3-row grain, splits everywhere, one tile per launch, masks built per call
        "grain": 3,
        "full_split": 2,
        "empty_split": 1,
        "store_budget": 0,
        "tile_bytes": 1,
    },
    "odd": {"grain": 5, "full_split": 3, "tile_mask_cap": 64},  # taller tiles split by masks
}


def _configure(monkeypatch: pytest.MonkeyPatch, planner: str, kernel: str = "fused") -> None:
    settings = dict(PLANNERS[planner])
    if kernel == "matmul":  # the kernel for Dv != Dk and devices other than the CPU
        settings["torch_kernel"] = False
    config = dataclasses.replace(blocked_config.BlockedConfig(), **settings)  # type: ignore[arg-type]
    monkeypatch.setattr(blocked_config, "CONFIG", config)  # restored after the test


@pytest.fixture(params=["default", "fine"])
def planner(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    _configure(monkeypatch, request.param)
    yield request.param
    blocked.clear_plans()


@pytest.fixture(params=["default-fused", "fine-fused", "odd-matmul", "fine-matmul"])
def config(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A planner and a kernel: torch's fused CPU flash kernel, or the matmul one."""
    planner, kernel = str(request.param).split("-")
    _configure(monkeypatch, planner, kernel)
    yield request.param
    blocked.clear_plans()


# what q, k, v are drawn from (33 is listed twice: drawn twice as often)
SIZES = Sizes(
    batch=(1, 2),
    kv_heads=(1, 2),
    groups=(1, 3),
    lengths=(1, 7, 20, 33, 33, 97),
    head_dims=(1, 8, 16),
    value_dims=(5,),
)


@st.composite
def problems(
    draw: st.DrawFn, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, MaskSpec]:
    q, k, v = draw(qkv(SIZES, dtype))
    return q, k, v, draw(specs(q.shape[0], q.shape[2], k.shape[2]))


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _leaf(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.detach().clone().requires_grad_(True) for t in ts)


# the planner and kernel fixtures set module knobs for the whole test: sharing them across the
# generated inputs is what is wanted
@settings(max_examples=10, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=problems())
def test_outputs_and_gradients_match_oracle_for_every_spec(
    case: tuple[torch.Tensor, torch.Tensor, torch.Tensor, MaskSpec], config: str
) -> None:
    q, k, v, spec = case
    L, S = q.shape[2], k.shape[2]
    dense = spec.to_dense(L, S)
    q, k, v = _leaf(q, k, v)
    out = attnkit.attention(q, k, v, mask=spec, backend="blocked")
    ref = reference_attention(q, k, v, mask=dense)[0]
    assert not out.isnan().any()
    assert _err(out, ref) <= 1e-10, spec
    grad_out = torch.randn_like(ref)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    want = torch.autograd.grad(ref, (q, k, v), grad_out)
    for name, got, exp in zip("qkv", grads, want, strict=True):
        assert not got.isnan().any(), name
        assert _err(got, exp) <= 1e-9, (name, spec)


# The test above failed now and then (5 of 80 runs one hour, none of 200 the next: it depends on
# thread timing), always under default-fused, on a draw with Dv != Dk (the tiles then run the
# matmul kernel, which calls torch's logsumexp and exp), on the first such draw of the process,
# and never when replayed: the row normalisation (lse) of the first thread's rows was off by
# 1e-10 to 1e-9. torch hands float64 exp/log to oneMKL's VML, which chooses a function's kernel on
# its first call; a first call split across threads can run a low-accuracy kernel on one of them
# (pytorch/pytorch#188792). attnkit.cpu.warm_vml makes that choice at import, on one thread. These
# run the same path on fixed inputs, with more than the 2048 scores per call from which torch
# splits an exp across threads.
def _float64_case(Dv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 6, 33, 16, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, 97, 16, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, 97, Dv, generator=g, dtype=torch.float64)
    return q, k, v


FLOAT64_SPECS = {
    "causal": masks.causal(),
    "document": masks.document(torch.stack([torch.arange(97) // 20, torch.arange(97) // 30])),
    "padding": masks.padding(torch.tensor([55, 37])),
}


@pytest.mark.parametrize("spec", FLOAT64_SPECS.values(), ids=FLOAT64_SPECS.keys())
@pytest.mark.parametrize("Dv", [16, 5], ids=["fused-kernel", "matmul-kernel"])
def test_float64_tiles_match_the_oracle_cold_and_warm(
    spec: MaskSpec, Dv: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    _configure(monkeypatch, "default")  # default-fused: Dv != Dk takes the matmul kernel
    blocked.clear_plans()  # cold: no tile plan, no kept decision
    q, k, v = _float64_case(Dv)
    dense = spec.to_dense(33, 97)
    ref_leaves = _leaf(q, k, v)
    ref = reference_attention(*ref_leaves, mask=dense)[0]
    grad_out = torch.randn(ref.shape, generator=torch.Generator().manual_seed(8), dtype=ref.dtype)
    want = torch.autograd.grad(ref, ref_leaves, grad_out)
    for when in ("cold", "warm"):
        leaves = _leaf(q, k, v)
        out = attnkit.attention(*leaves, mask=spec, backend="blocked")
        assert _err(out, ref) <= 1e-10, when
        grads = torch.autograd.grad(out, leaves, grad_out)
        for name, got, exp in zip("qkv", grads, want, strict=True):
            assert _err(got, exp) <= 1e-9, (when, name)
    blocked.clear_plans()


def test_torchs_mkl_functions_are_warmed_at_import() -> None:
    """attnkit.cpu called each VML function once, on one thread, for float32 and float64 (the
    ones the attention paths use among them) before any attention call split a tensor."""
    from attnkit import cpu

    if not torch.backends.mkl.is_available():  # type: ignore[no-untyped-call]
        assert cpu.VML_WARMED == ()
        return
    for dtype in (torch.float32, torch.float64):
        for name in ("exp", "log", "tanh"):
            assert (name, dtype) in cpu.VML_WARMED


def test_the_first_float64_tile_call_of_a_process_matches_the_oracle() -> None:
    """The flaky draws' situation in a fresh process: two threads, a float64 call on the fused
    kernel first (the thread pool is running), then the first matmul-kernel call of the process,
    whose exp is split across both threads. The race cannot be forced (it needs two threads to
    enter oneMKL's first call at once), so this pins the situation, not the race."""
    tests = Path(__file__).resolve().parents[1]
    code = textwrap.dedent(
        """
        import sys, torch
        torch.set_num_threads(2)
        sys.path.insert(0, sys.argv[1])
        import attnkit
        from attnkit import masks
        from oracle import reference_attention
        g = torch.Generator().manual_seed(7)
        q = torch.randn(2, 6, 33, 16, generator=g, dtype=torch.float64)
        k = torch.randn(2, 2, 97, 16, generator=g, dtype=torch.float64)
        spec = masks.padding(torch.tensor([55, 37]))
        attnkit.attention(q, k, k, mask=spec, backend="blocked")  # fused kernel: pool started
        v = torch.randn(2, 2, 97, 5, generator=g, dtype=torch.float64)
        out = attnkit.attention(q, k, v, mask=spec, backend="blocked")  # matmul kernel
        ref = reference_attention(q, k, v, mask=spec.to_dense(33, 97))[0]
        print((out - ref).abs().max().item())
        """
    )
    # (float64 never runs in attnkit's row-span kernel; off, the child neither loads nor builds it)
    env = {**os.environ, "ATTNKIT_SPAN_KERNEL": "0"}
    run = subprocess.run(
        [sys.executable, "-c", code, str(tests)], capture_output=True, text=True, env=env
    )
    assert run.returncode == 0, run.stderr
    assert float(run.stdout.split()[-1]) <= 1e-10


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@settings(max_examples=6)
@given(data=st.data())
def test_low_precision_within_the_tolerance_rule(data: st.DataObject, dtype: torch.dtype) -> None:
    q, k, v, spec = data.draw(problems(dtype))
    dense = spec.to_dense(q.shape[2], k.shape[2])
    ref = reference_attention(q, k, v, mask=dense)[0]
    naive = reference_attention(q, k, v, mask=dense, dtype=dtype)[0]
    q, k, v = _leaf(q, k, v)
    out = attnkit.attention(q, k, v, mask=spec, backend="blocked")
    assert out.dtype == dtype
    within_naive(out, ref, naive)
    grad_out = torch.randn(out.shape, dtype=torch.float64).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    q64, k64, v64 = _leaf(q.double(), k.double(), v.double())
    want = torch.autograd.grad(
        reference_attention(q64, k64, v64, mask=dense)[0], (q64, k64, v64), grad_out.double()
    )
    qn, kn, vn = _leaf(q, k, v)
    naive_out = reference_attention(qn, kn, vn, mask=dense, dtype=dtype)[0]
    naive_grads = torch.autograd.grad(naive_out, (qn, kn, vn), grad_out)
    for name, got, exp, nv in zip("qkv", grads, want, naive_grads, strict=True):
        assert got.dtype == dtype, name
        # gradients: 10x the table's floor, as written before (blocked's backward sums dq, dk
        # and dv tile by tile, in another order than the naive run; cf. the 1e-5 float32
        # gradient floor of tests/core/test_attention_properties.py)
        within_naive(got, exp, nv, grad=True, floor=10 * FLOOR[dtype], what=name)


def test_fully_masked_rows_give_zero_output_lse_and_gradient(planner: str) -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = _leaf(*(torch.randn(2, 4, 40, 8, generator=g, dtype=torch.float64) for _ in "qkv"))
    spec = masks.padding(torch.tensor([40, 0]), q_lengths=torch.tensor([25, 40]))
    out = attnkit.attention(q, k, v, mask=spec, backend="blocked")
    dead = (slice(0, 1), slice(None), slice(25, 40))  # batch 0, rows 25.. see nothing
    assert torch.equal(out[dead], torch.zeros_like(out[dead]))
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # batch 1 has no keys at all
    out.backward(torch.randn_like(out))
    assert q.grad is not None
    assert k.grad is not None
    assert v.grad is not None
    assert torch.equal(q.grad[dead], torch.zeros_like(q.grad[dead]))
    assert torch.equal(k.grad[1], torch.zeros_like(k.grad[1]))
    assert not any(t.isnan().any() for t in (q.grad, k.grad, v.grad))
    _, lse = forward_with_lse(q, k, v, mask=spec, scale=0.3)
    assert bool((lse[dead] == -math.inf).all())
    assert bool((lse[1] == -math.inf).all())
    assert bool(torch.isfinite(lse[0, :, :25]).all())


@pytest.mark.parametrize(
    "spec",
    [
        None,
        masks.causal() & masks.sliding_window(5),
        masks.document(torch.arange(30) // 7) & masks.causal(),
        ~masks.sliding_window(3),
    ],
    ids=["none", "window", "documents", "anti-window"],
)
def test_lse_is_the_log_sum_exp_of_the_allowed_scores(spec: MaskSpec | None, planner: str) -> None:
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 30, 8, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, 30, 8, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, 30, 6, generator=g, dtype=torch.float64)
    out, lse = forward_with_lse(q, k, v, mask=spec, scale=0.4)
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * 0.4  # (1, 4, 30, 30)
    if spec is not None:
        scores = scores.masked_fill(~spec.to_dense(30, 30), -math.inf)
    assert out.dtype == lse.dtype == torch.float64
    assert torch.allclose(lse, torch.logsumexp(scores, -1), atol=1e-12)
    dense = None if spec is None else spec.to_dense(30, 30)
    assert _err(out, reference_attention(q, k, v, mask=dense, scale=0.4)[0]) <= 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_block_functions_return_float32(dtype: torch.dtype) -> None:
    q = torch.randn(1, 2, 9, 8).to(dtype)
    out, lse = forward_with_lse(q, q, q, mask=masks.causal(), scale=0.3)
    assert out.dtype == lse.dtype == torch.float32
    grads = backward_from_lse(q, q, q, out, torch.ones_like(out), lse, mask=None, scale=0.3)
    assert all(t.dtype == torch.float32 for t in grads)


@pytest.mark.parametrize(
    "spec",
    [
        masks.causal() & masks.sliding_window(9),
        masks.document(torch.tensor([0] * 11 + [1] * 20 + [2] * 14)) & masks.causal(),
        masks.prefix_lm(12),
    ],
    ids=["window", "documents", "prefix"],
)
def test_block_functions_with_offsets_merge_to_the_whole(
    spec: MaskSpec | None, planner: str
) -> None:
    """Ring attention's use: slices of q and k at global offsets, merged by log-sum-exp in the
    forward, gradients summed in the backward, equal the full computation (L != S)."""
    g = torch.Generator().manual_seed(3)
    L, S, scale = 37, 45, 0.35
    q = torch.randn(2, 4, L, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, S, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, S, 8, generator=g, dtype=torch.float64)
    dout = torch.randn(2, 4, L, 8, generator=g, dtype=torch.float64)
    full_out, full_lse = forward_with_lse(q, k, v, mask=spec, scale=scale)
    qs, ks = [(0, 16), (16, 37)], [(0, 10), (10, 29), (29, 45)]
    kw = {"mask": spec, "scale": scale}
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for a, b in qs:
        out = torch.zeros(2, 4, b - a, 8, dtype=torch.float64)
        lse = torch.full((2, 4, b - a), -math.inf, dtype=torch.float64)
        for c, d in ks:
            o, s = forward_with_lse(
                q[:, :, a:b], k[:, :, c:d], v[:, :, c:d], at=BlockAt(a, c, L, S), **kw
            )
            new = torch.logaddexp(lse, s)
            w_old = torch.where(new == -math.inf, 0.0, (lse - new).exp())
            w_new = torch.where(new == -math.inf, 0.0, (s - new).exp())
            out, lse = out * w_old[..., None] + o * w_new[..., None], new
        assert _err(out, full_out[:, :, a:b]) <= 1e-12
        assert torch.equal(lse == -math.inf, full_lse[:, :, a:b] == -math.inf)
        assert _err(lse.clamp(min=-1e9), full_lse[:, :, a:b].clamp(min=-1e9)) <= 1e-12
        for c, d in ks:
            gq, gk, gv = backward_from_lse(
                q[:, :, a:b],
                k[:, :, c:d],
                v[:, :, c:d],
                full_out[:, :, a:b],
                dout[:, :, a:b],
                full_lse[:, :, a:b],
                at=BlockAt(a, c, L, S),
                **kw,
            )
            dq[:, :, a:b] += gq
            dk[:, :, c:d] += gk
            dv[:, :, c:d] += gv
    want = backward_from_lse(q, k, v, full_out, dout, full_lse, mask=spec, scale=scale)
    for got, exp in zip((dq, dk, dv), want, strict=True):
        assert _err(got, exp) <= 1e-12
    q, k, v = _leaf(q, k, v)
    dense = None if spec is None else spec.to_dense(L, S)
    ref = reference_attention(q, k, v, mask=dense, scale=scale)[0]
    assert _err(full_out, ref) <= 1e-12
    for got, exp in zip(want, torch.autograd.grad(ref, (q, k, v), dout), strict=True):
        assert _err(got, exp) <= 1e-12


@pytest.mark.parametrize(
    ("shape", "kind"), [("LS", "bool"), ("B1LS", "float"), ("1HLS", "bool"), ("BH1S", "float")]
)
def test_dense_masks_are_served_and_their_empty_blocks_skipped(
    shape: str, kind: str, planner: str
) -> None:
    g = torch.Generator().manual_seed(4)
    B, H, L, S = 2, 4, 33, 41
    q, k, v = _leaf(
        torch.randn(B, H, L, 8, generator=g, dtype=torch.float64),
        torch.randn(B, 2, S, 8, generator=g, dtype=torch.float64),
        torch.randn(B, 2, S, 8, generator=g, dtype=torch.float64),
    )
    dims = {"LS": (L, S), "B1LS": (B, 1, L, S), "1HLS": (1, H, L, S), "BH1S": (B, H, 1, S)}
    allowed = torch.rand(dims[shape], generator=g) > 0.4
    allowed[..., : S // 2] = False  # half the keys empty: whole blocks to skip
    mask: torch.Tensor = allowed
    if kind == "float":
        mask = torch.randn(dims[shape], generator=g, dtype=torch.float64)
        mask = mask.masked_fill(~allowed, -math.inf)
    out = attnkit.attention(q, k, v, mask=mask, backend="blocked")
    ref = reference_attention(q, k, v, mask=mask)[0]
    assert _err(out, ref) <= 1e-10
    grad_out = torch.randn_like(ref)
    for got, exp in zip(
        torch.autograd.grad(out, (q, k, v), grad_out),
        torch.autograd.grad(ref, (q, k, v), grad_out),
        strict=True,
    ):
        assert _err(got, exp) <= 1e-9


class _SlopeBias(MaskSpec):
    """An ALiBi-like spec: causal, and a per-head linear bias on the distance."""

    has_bias = True

    def __init__(self, heads: int) -> None:
        self.heads = heads
        self.slopes = 2.0 ** -torch.arange(1, heads + 1, dtype=torch.float64)

    def allowed(self, b, h, q, kv, off):  # type: ignore[no-untyped-def]
        return kv <= q + off

    def bias(self, b, h, q, kv, off):  # type: ignore[no-untyped-def]
        return -self.slopes[h] * (q + off - kv)

    def block_bounds(self, q_lo, q_hi, k_lo, k_hi, off):  # type: ignore[no-untyped-def]
        return masks.causal().block_bounds(q_lo, q_hi, k_lo, k_hi, off)


def test_a_score_bias_is_added_on_every_visited_block(planner: str) -> None:
    g = torch.Generator().manual_seed(5)
    B, H, L = 2, 4, 50
    q, k, v = _leaf(*(torch.randn(B, H, L, 8, generator=g, dtype=torch.float64) for _ in "qkv"))
    spec = _SlopeBias(H) & masks.sliding_window(20)
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    bias = -_SlopeBias(H).slopes.view(H, 1, 1) * (i - j)  # (H, L, L)
    dense = bias.masked_fill(~((j <= i) & (i - j < 20)), -math.inf)[None]
    out = attnkit.attention(q, k, v, mask=spec, backend="blocked")
    ref = reference_attention(q, k, v, mask=dense)[0]
    assert _err(out, ref) <= 1e-10
    grad_out = torch.randn_like(ref)
    for got, exp in zip(
        torch.autograd.grad(out, (q, k, v), grad_out),
        torch.autograd.grad(ref, (q, k, v), grad_out),
        strict=True,
    ):
        assert _err(got, exp) <= 1e-9


def test_grouped_query_heads_are_never_repeated(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(6)
    q = torch.randn(1, 8, 70, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 70, 16, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 70, 16, generator=g, dtype=torch.float64, requires_grad=True)
    ref = reference_attention(q, k, v, causal=True)[0]

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("K/V were repeated per query head")

    monkeypatch.setattr(torch, "repeat_interleave", forbidden)
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", forbidden)
    monkeypatch.setattr(torch.Tensor, "repeat", forbidden)
    spec = masks.causal() & masks.sliding_window(10)
    out = attnkit.attention(q, k, v, mask=spec | masks.causal(), backend="blocked")
    out.backward(torch.ones_like(out))
    monkeypatch.undo()
    assert _err(out, ref) <= 1e-10
    assert k.grad is not None
    assert k.grad.shape == (1, 2, 70, 16)


def _saved_numels(fn: object) -> list[int]:
    sizes: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()  # type: ignore[operator]
    return sizes


def test_training_saves_nothing_of_size_l_times_s() -> None:
    """The autograd graph keeps q, k, v, the output and lse (B, H, L): memory grows with L."""
    spec = masks.causal() & masks.sliding_window(64)
    saved = {}
    for L in (512, 1024):
        q, k, v = (torch.randn(1, 2, L, 16, requires_grad=True) for _ in "qkv")
        saved[L] = _saved_numels(lambda q=q, k=k, v=v: attnkit.attention(q, k, v, mask=spec))
        assert max(saved[L]) <= 2 * L * 16, saved[L]  # the largest is q, k, v or out
        assert all(n < L * L for n in saved[L])
    assert sum(saved[1024]) == 2 * sum(saved[512])  # linear in L
    assert max(_saved_numels(lambda: attnkit.attention(q, k, v, causal=True, backend="math")))
    assert max(saved[1024]) < 1024 * 1024  # math keeps (B, H, L, S) weights, blocked does not


def test_a_band_is_one_batched_call_with_one_mask_and_small_plans() -> None:
    blocked.clear_plans()
    L, window = 4096, 256
    spec = masks.causal() & masks.sliding_window(window)
    q = torch.randn(1, 2, L, 16)
    plan = blocked.plan_blocks(q, q, q, spec).tiles(q, q, q)
    big = max(plan.calls, key=lambda c: c.n)
    assert big.n * big.R >= L - window - big.R  # all but the first tiles run in one call
    assert big.mask is not None
    assert big.mask.shape[0] == 1
    kept = sum(c.mask.numel() for c in plan.calls if c.mask is not None)
    assert kept <= 2 * (window + plan.rows) * plan.rows * (window // plan.rows + 1)
    assert plan.computed_pairs <= 1.5 * L * window  # a band, not L x S
    assert blocked.plan_blocks(q, q, q, spec).tiles(q, q, q) is plan  # cached
    rebuilt = masks.causal() & masks.sliding_window(window)  # a new object, the same spec
    assert blocked.plan_blocks(q, q, q, rebuilt).tiles(q, q, q) is plan


def test_plans_follow_in_place_changes_of_spec_tensors() -> None:
    blocked.clear_plans()
    lengths = torch.tensor([40])
    spec = masks.padding(lengths)
    q = torch.randn(1, 2, 64, 8, dtype=torch.float64)
    first = attnkit.attention(q, q, q, mask=spec, backend="blocked")
    lengths[0] = 10  # the spec now allows 10 keys: the cached plan must not be reused
    second = attnkit.attention(q, q, q, mask=spec, backend="blocked")
    dense = masks.padding(torch.tensor([10])).to_dense(64, 64)
    assert _err(second, reference_attention(q, q, q, mask=dense)[0]) <= 1e-12
    assert _err(first, second) > 1e-3


@pytest.mark.parametrize("write", ["through .data", "through numpy"])
@pytest.mark.parametrize("kind", ["padding", "key_mask", "document"])
def test_plans_follow_writes_that_bypass_the_version_counter(kind: str, write: str) -> None:
    """A spec tensor written without torch seeing it (``.data``, a NumPy array sharing its
    memory) bumps no version; the cached runs and tile plans must still not be reused."""
    blocked.clear_plans()
    g = torch.Generator().manual_seed(3)
    L = 96
    values = {
        "padding": torch.tensor([80, 50]),
        "key_mask": torch.rand(2, L, generator=g) < 0.6,
        "document": torch.tensor([0] * 40 + [1] * 56),
    }[kind]
    spec = {"padding": masks.padding, "key_mask": masks.key_mask, "document": masks.document}[kind](
        values
    )
    q = torch.randn(2, 2, L, 8, dtype=torch.float64, generator=g)
    attnkit.attention(q, q, q, mask=spec, backend="blocked")  # plans cached for the old values
    new = {
        "padding": torch.tensor([20, 90]),
        "key_mask": torch.rand(2, L, generator=g) < 0.6,
        "document": torch.tensor([0] * 10 + [1] * 86),
    }[kind]
    if write == "through .data":
        values.data.copy_(new)
    else:
        values.numpy()[...] = new.numpy()
    assert torch.equal(values, new)
    out = attnkit.attention(q, q, q, mask=spec, backend="blocked")
    expected = reference_attention(q, q, q, mask=spec.to_dense(L, L))[0]
    assert _err(out, expected) <= 1e-12


def test_a_tensor_key_sees_values_identity_and_version() -> None:
    t = torch.tensor([3, 5])
    key = masks.tensor_key(t)
    assert masks.tensor_key(t) == key
    assert masks.tensor_key(torch.tensor([3, 5])) != key  # another tensor: plans read their own
    t.data[0] = 4
    assert masks.tensor_key(t) != key  # no version bump, other values
    t.data[0] = 3
    assert masks.tensor_key(t) == key  # the values the entry was made with, in the same tensor
    t[0] = 3
    assert masks.tensor_key(t) != key  # an edit through torch: a new version


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"return_weights": True}, "never forms the attention weights"),
        ({"dropout_p": 0.1}, "no dropout"),
        ({"mask": torch.zeros(5, 5, dtype=torch.float64, requires_grad=True)}, "float mask"),
        (  # a trainable float mask inside a spec: its gradient would be dropped silently
            {
                "mask": masks.causal()
                & masks.DenseMask(torch.zeros(5, 5, dtype=torch.float64).requires_grad_())
            },
            "does not differentiate a float mask",
        ),
    ],
)
def test_named_blocked_refuses_what_it_cannot_serve(
    kwargs: dict[str, object], message: str
) -> None:
    q = torch.randn(1, 2, 5, 8, dtype=torch.float64)
    with pytest.raises(AttentionInputError, match=f"backend 'blocked' cannot serve.*{message}"):
        attnkit.attention(q, q, q, backend="blocked", **kwargs)  # type: ignore[call-overload]


def test_a_trainable_bias_inside_a_spec_gets_its_gradient_from_auto() -> None:
    """``causal() & key_mask(keep) & DenseMask(bias)`` with a bias that trains (T5's relative
    position bias through transformers): auto takes a backend that differentiates the bias,
    and every gradient matches the float64 oracle."""
    g = torch.Generator().manual_seed(3)
    B, H, L, D = 2, 3, 1100, 8  # past auto's size rule for specs: blocked would take it
    q, k, v = (torch.randn(B, H, L, D, generator=g, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(1, H, L, L, generator=g, dtype=torch.float64)
    keep = torch.ones(B, L, dtype=torch.bool)
    keep[0, 7:30] = False
    leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    spec = masks.causal() & masks.key_mask(keep) & masks.DenseMask(leaves[3])
    assert attnkit.explain(*leaves[:3], mask=spec).chosen != "blocked"
    out = attnkit.attention(*leaves[:3], mask=spec)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(out, leaves, dout)
    allowed = torch.ones(L, L, dtype=torch.bool).tril() & keep[:, None, None, :]
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    scores = ref_leaves[0] @ ref_leaves[1].transpose(-1, -2) / math.sqrt(D) + ref_leaves[3]
    ref = torch.softmax(scores.masked_fill(~allowed, -math.inf), -1) @ ref_leaves[2]
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout)
    assert (out - ref).abs().max() <= 1e-12
    for name, got, want in zip("qkv", grads, ref_grads, strict=False):
        assert (got - want).abs().max() <= 1e-12, name
    assert grads[3].abs().sum() > 0  # the bias trains
    assert (grads[3] - ref_grads[3]).abs().max() <= 1e-12


def test_auto_takes_blocked_for_specs_and_explain_says_which_rule_fired() -> None:
    q = torch.randn(1, 2, 256, 16)
    # a mask the row-span kernel does not serve (row_spans does not read ``~``): tiles
    spec = masks.causal() & ~masks.sliding_window(4)
    report = attnkit.explain(q, q, q, mask=spec)
    assert report.chosen == "blocked"
    text = str(report)
    assert "auto's rule: a mask spec and L x S >= 16384" in text
    assert "blocked: " in text
    assert "kernel calls" in text
    assert "blocks empty" in text
    assert "sdpa: can serve, but auto prefers blocked" in text
    small = attnkit.explain(q[:, :, :16], q[:, :, :16], q[:, :, :16], mask=spec)
    assert small.chosen == "sdpa"
    assert "blocked: can serve, but its auto rule does not fire: L x S = 16 x 16" in str(small)
    plain = str(attnkit.explain(q, q, q, causal=True))
    assert "auto takes: sdpa" in plain
    assert "blocked: can serve, but its auto rule does not fire" in plain
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # auto's blocked call raises no warning either
        out = attnkit.attention(q, q, q, mask=spec)
    assert _err(out, attnkit.attention(q, q, q, mask=spec, backend="math")) <= 1e-5


def test_explain_says_why_a_big_plain_causal_call_is_not_blocked_s() -> None:
    """A float64 causal call of 1024 x 1024 is big enough for the kernel's rule, but the kernel
    does not read float64: the reason says that, not only the size threshold it meets."""
    q = torch.randn(1, 2, 1024, 16, dtype=torch.float64)
    e = attnkit.explain(q, q, q, causal=True)
    assert e.chosen == "sdpa"
    line = next(x for x in str(e).splitlines() if x.strip().startswith("blocked:"))
    assert "this 1024 x 1024 call is plain causal, but attnkit's row-span kernel reads" in line
    assert "(q is torch.float64)" in line
    small = torch.randn(1, 2, 100, 16)
    line = next(
        x
        for x in str(attnkit.explain(small, small, small, causal=True)).splitlines()
        if x.strip().startswith("blocked:")
    )
    assert line.endswith("; this causal call is 100 x 100")
