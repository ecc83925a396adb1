"""Unmasked calls (no mask, not causal) in attnkit's row-span kernel: one run of every key per
query row, against the float64 oracle (forward and backward, grouped-query heads, odd head
dims, batches, bfloat16/float16 read directly on the ``fp32-upcast`` CPU path), and ``auto``'s
rule for them, read from ``explain`` (never from timings).

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
Dk query/key head dim, Dv value head dim.
"""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import cpu, masks
from attnkit.backends import blocked
from attnkit.backends.blocked import measured, rowspan, rowspan_builds
from attnkit.backends.blocked.blocks import BlockAt
from oracle import reference_attention, within_naive
from span_builds import FP32_ISAS, running

#: (B, H, Hkv, L, S, Dk, Dv): MHA, grouped-query heads, odd and unequal head dims, L != S
SHAPES = [
    (1, 4, 4, 96, 96, 64, 64),
    (2, 6, 2, 70, 130, 33, 20),
    (3, 8, 1, 17, 300, 7, 9),
    (1, 2, 2, 1, 45, 128, 128),
]


def _qkv(
    shape: tuple[int, ...], dtype: torch.dtype = torch.float32, grad: bool = True
) -> tuple[torch.Tensor, ...]:
    B, H, Hkv, L, S, Dk, Dv = shape
    g = torch.Generator().manual_seed(sum(shape))
    q = torch.randn(B, H, L, Dk, generator=g).to(dtype)
    k = torch.randn(B, Hkv, S, Dk, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S, Dv, generator=g).to(dtype)
    dout = torch.randn(B, H, L, Dv, generator=g).to(dtype)
    return (*(t.requires_grad_(grad) for t in (q, k, v)), dout)


def _check(shape: tuple[int, ...], dtype: torch.dtype, mask: masks.MaskSpec | None) -> None:
    """Forward and backward through ``blocked`` against the float64 oracle (the tolerance rule:
    the naive run in ``dtype`` sets the bound)."""
    q, k, v, dout = _qkv(shape, dtype)
    out = attnkit.attention(q, k, v, mask=mask, backend="blocked")
    assert out.dtype == dtype
    out.backward(dout)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want, _ = reference_attention(*leaves)
    (want * dout.double()).sum().backward()
    low = [t.detach().requires_grad_() for t in (q, k, v)]
    naive, _ = reference_attention(*low, dtype=dtype)
    (naive * dout).sum().backward()
    within_naive(out, want, naive, what=(shape, dtype, "out"))
    for name, got, ref, nv in zip("qkv", (q, k, v), leaves, low, strict=True):
        assert got.grad is not None
        assert ref.grad is not None
        assert nv.grad is not None
        assert got.grad.dtype == dtype
        within_naive(got.grad, ref.grad, nv.grad, grad=True, what=(shape, dtype, f"d{name}"))


@pytest.mark.parametrize("isa", FP32_ISAS)
@pytest.mark.parametrize("shape", SHAPES)
def test_an_unmasked_call_runs_in_the_kernel_and_equals_the_float64_oracle(
    shape: tuple[int, ...], isa: str
) -> None:
    with running(isa):
        _check_unmasked(shape, isa)


def _check_unmasked(shape: tuple[int, ...], isa: str) -> None:
    q, k, v, _ = _qkv(shape, grad=False)
    plan = blocked.plan_blocks(q, k, v, None)
    assert plan.spans.serves, plan.spans.reason
    assert plan.spans.isa == isa
    S, L = shape[4], shape[3]
    assert plan.spans.lo is not None
    assert plan.spans.hi is not None
    assert torch.equal(plan.spans.lo, torch.zeros(1, L, dtype=torch.long))
    assert torch.equal(plan.spans.hi, torch.full((1, L), S - 1, dtype=torch.long))
    said = blocked.plan_blocks(q, k, v, masks.unmasked())  # the spec that says "no mask"
    assert said.spans.serves, said.spans.reason
    assert torch.equal(said.spans.hi, plan.spans.hi)
    _check(shape, torch.float32, None)
    _check(shape, torch.float32, masks.unmasked())


@pytest.mark.parametrize("isa", FP32_ISAS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES[:3])
def test_low_precision_unmasked_calls_are_read_directly_on_fp32_upcast(
    shape: tuple[int, ...], dtype: torch.dtype, isa: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    reason = cpu.unavailable("fp32-upcast", dtype)
    if reason is not None:
        pytest.skip(f"the fp32-upcast path cannot run {dtype} here: {reason}")
    monkeypatch.setenv(cpu.ENV, "fp32-upcast")  # forced where it is not this CPU's own path
    with running(isa):
        _check_low_unmasked(shape, dtype)


def _check_low_unmasked(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    q, k, v, _ = _qkv(shape, dtype, grad=False)
    assert cpu.path_for(q, "test") == "fp32-upcast"
    if str(dtype).removeprefix("torch.") not in rowspan_builds.kernel().low_dtypes():
        pytest.skip(f"the kernel was built without F16C here, so it does not read {dtype}")
    note = attnkit.explain(q, k, v, backend="blocked").notes["blocked"]
    name = str(dtype).removeprefix("torch.")
    assert f"attnkit's row-span kernel reads {name} q, k, v directly" in note
    assert (
        f"no mask (every key of every row): forward and backward run {rowspan_builds.status()}"
        in note
    )
    _check(shape, dtype, None)


def test_blocks_of_an_unmasked_call_at_offsets_merge_to_the_whole() -> None:
    """Ring attention's blocks: with no mask each (query slice, key slice) is one full run,
    served by the kernel at any global offsets, and the blocks merge to the whole attention."""
    q, k, v, _ = _qkv((2, 4, 2, 40, 72, 16, 16), grad=False)
    parts = []
    for k0 in (0, 24, 48):
        at = BlockAt(q_start=8, k_start=k0, L_total=48, S_total=72)
        ks, vs = k[:, :, k0 : k0 + 24], v[:, :, k0 : k0 + 24]
        plan = blocked.plan_blocks(q, ks, vs, None, at)
        assert plan.spans.serves
        got = blocked.forward_with_lse(q, ks, vs, mask=None, scale=0.25, at=at, plan=plan)
        parts.append(got)
    out, lse = parts[0]
    for o, s in parts[1:]:
        blocked.merge(out, lse, o, s)  # in place
    want, _ = reference_attention(q, k, v)
    naive, _ = reference_attention(q, k, v, dtype=torch.float32)
    within_naive(out, want, naive, what="merged blocks")


def _big(L: int, S: int, grad: bool = False) -> tuple[torch.Tensor, ...]:
    """Tensors of a call's sizes whose values nothing here reads (explain runs nothing):
    expanded views of one row each, so that a long call allocates nothing."""
    q = torch.zeros(1, 1, 1, 8).requires_grad_(grad).expand(1, 1, L, 8)
    kv = torch.zeros(1, 1, 1, 8).requires_grad_(grad).expand(1, 1, S, 8)
    return q, kv, kv


def test_auto_takes_the_kernel_for_unmasked_calls_from_the_measured_sizes() -> None:
    rows, pairs = rowspan.DENSE_MIN_ROWS, rowspan.DENSE_MIN_PAIRS
    S = -(-pairs // rows)  # the fewest keys that reach the pairs with the fewest rows
    report = attnkit.explain(*_big(rows, S))
    assert report.chosen == "blocked"
    assert report.rule == (
        f"unmasked on CPU (torch.float32), forward, L >= {rows} and L x S >= {pairs}: "
        "attnkit's row-span kernel (every key of each row); "
        + measured.select(torch.float32, "dense")[1]
    )
    assert (
        f"no mask (every key of every row): forward and backward run {rowspan_builds.status()}"
        in (report.notes["blocked"])
    )
    for L, keys in ((rows - 1, 4 * S), (rows, S - 1)):  # too few rows, too few pairs
        small = attnkit.explain(*_big(L, keys))
        assert small.chosen == "sdpa", (L, keys)
        line = next(x for x in str(small).splitlines() if x.strip().startswith("blocked:"))
        assert line.endswith(f"; this unmasked call is {L} x {keys}"), line
    train = rowspan.DENSE_TRAIN_MIN_PAIRS
    St = -(-train // rows)
    report = attnkit.explain(*_big(rows, St, grad=True))
    assert report.chosen == "blocked"
    assert f"unmasked on CPU (torch.float32), training, L >= {rows} and L x S >= {train}" in (
        report.rule
    )
    short = attnkit.explain(*_big(rows, St - 1, grad=True))
    assert short.chosen == "sdpa"
    assert f"; this unmasked call is {rows} x {St - 1} in training" in str(short)


def test_auto_keeps_sdpa_for_unmasked_calls_the_kernel_does_not_read() -> None:
    rows, S = rowspan.DENSE_MIN_ROWS, -(-rowspan.DENSE_MIN_PAIRS // rowspan.DENSE_MIN_ROWS)
    q, k, v = (t.double() for t in _big(rows, S))
    report = attnkit.explain(q, k, v)
    assert report.chosen == "sdpa"
    line = next(x for x in str(report).splitlines() if x.strip().startswith("blocked:"))
    assert f"this {rows} x {S} call is unmasked, but attnkit's row-span kernel reads" in line
    q, k, v = _big(rows, S)
    capped = attnkit.explain(q, k, v, softcap=30.0)  # a soft-cap: blocked's spec rule, kernel
    assert capped.chosen == "blocked"
    assert (
        f"soft-capped at 30: forward and backward run {rowspan_builds.status()}"
        in (capped.notes["blocked"])
    )
