"""The blocked backend's decode kernel (``attnkit.backends.blocked.decode``): a few queries
against a long key/value cache, against the float64 oracle.

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
D head dim.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import masks
from attnkit.backends import nonfinite
from attnkit.backends.blocked import decode
from oracle import reference_attention, within_naive

pytestmark = pytest.mark.skipif(not decode.available(), reason=decode.status())

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _cache(
    B: int, Hkv: int, S: int, D: int, dtype: torch.dtype, layout: str, gen: torch.Generator
) -> torch.Tensor:
    """``(B, Hkv, S, D)`` keys or values: contiguous, a view of a longer cache buffer, or the
    transpose of a ``(B, S, Hkv, D)`` tensor (transformers' projection layout)."""
    if layout == "buffer":
        return torch.randn(B, Hkv, S + 37, D, generator=gen).to(dtype)[:, :, :S]
    if layout == "transposed":
        return torch.randn(B, S, Hkv, D, generator=gen).to(dtype).transpose(1, 2)
    return torch.randn(B, Hkv, S, D, generator=gen).to(dtype)


def _inputs(
    B: int,
    H: int,
    Hkv: int,
    L: int,
    S: int,
    D: int,
    dtype: torch.dtype,
    layout: str = "buffer",
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, D, generator=gen).to(dtype)
    k = _cache(B, Hkv, S, D, dtype, layout, gen)
    v = _cache(B, Hkv, S, D, dtype, layout, gen)
    return q, k, v


def _runs_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> bool:
    return "decode kernel, forward only" in attnkit.explain(q, k, v, **kw).notes["blocked"]


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: masks.MaskSpec | None = None,
    causal: bool = False,
    sinks: torch.Tensor | None = None,
    backend: str = "blocked",
) -> torch.Tensor:
    """Run through attnkit (the decode kernel must run it) and hold it to the oracle."""
    kw: dict[str, Any] = {"mask": mask, "causal": causal, "sinks": sinks}
    assert _runs_decode(q, k, v, **kw), attnkit.explain(q, k, v, **kw).notes["blocked"]
    out = attnkit.attention(q, k, v, backend=backend, **kw)
    assert out.dtype == q.dtype
    assert out.shape == (*q.shape[:3], v.shape[-1])
    L, S = q.shape[2], k.shape[2]
    dense = None if mask is None else mask.to_dense(L, S)
    want, _ = reference_attention(q, k, v, mask=dense, causal=causal, sinks=sinks)
    naive, _ = reference_attention(q, k, v, mask=dense, causal=causal, sinks=sinks, dtype=q.dtype)
    within_naive(out, want, naive, what=f"{tuple(q.shape)} x {tuple(k.shape)} {q.dtype}")
    return out


def test_the_decode_kernel_is_built_here() -> None:
    assert decode.available(), decode.status()
    assert decode.status() == "attnkit's AVX2 decode kernel"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("B", "H", "Hkv", "D"), [(1, 32, 8, 128), (2, 4, 4, 64), (3, 4, 1, 80), (2, 6, 2, 13)]
)
@pytest.mark.parametrize("L", [1, 16])
def test_no_mask_and_causal_equal_the_oracle(
    dtype: torch.dtype, B: int, H: int, Hkv: int, D: int, L: int
) -> None:
    for S, layout in [
        (L + 1, "transposed"),
        (L + 7, "buffer"),
        (256, "transposed"),
        (589, "buffer"),
    ]:
        q, k, v = _inputs(B, H, Hkv, L, S, D, dtype, layout, seed=S + L)
        _check(q, k, v)
        _check(q, k, v, causal=True)
        _check(q, k, v, mask=masks.causal())


@pytest.mark.parametrize(("Hkv", "S"), [(2, 300), (4, 2100)])
@pytest.mark.parametrize("L", [1, 2])
def test_float32_values_read_in_place_or_copied_equal_the_oracle(Hkv: int, S: int, L: int) -> None:
    """float32 V rows are read in place where a call reads at most 4 MiB of K/V (a short cache:
    2 x 2 x 300 x 128 x 4 bytes) and copied per block above it (4 x 2100 keys: 8.2 MiB) for
    more than four rows per key/value head (L=2: eight); four rows (L=1) over these contiguous
    rows run in the streaming order (in place, shorter blocks above 4 MiB)."""
    q, k, v = _inputs(1, 4 * Hkv, Hkv, L, S, 128, torch.float32, "buffer", seed=S)
    _check(q, k, v)
    _check(q, k, v, mask=masks.causal() & masks.sliding_window(S - 3))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("Hkv", "S", "D"), [(2, 300, 128), (4, 4200, 128), (2, 7001, 80)])
@pytest.mark.parametrize(("g", "L"), [(4, 1), (1, 3)])
def test_the_streaming_order_equals_the_oracle(
    dtype: torch.dtype, Hkv: int, S: int, D: int, g: int, L: int
) -> None:
    """At most four rows per key/value head over contiguous K/V rows (a cache buffer's view)
    run in the streaming order (each block's pass prefetching the other stream's rows): with
    the long blocks of a short cache (2 x 300 keys) and the short blocks of one read from
    memory (over 4 MiB of K/V in every dtype: 4 x 4200 x 128, 2 x 7001 x 80, whose rows are
    not whole cache lines), key counts no block size divides, and windows whose rows start
    inside a block and skip the blocks before it."""
    q, k, v = _inputs(1, g * Hkv, Hkv, L, S, D, dtype, "buffer", seed=S + L)
    _check(q, k, v)
    _check(q, k, v, mask=masks.causal())
    _check(q, k, v, mask=masks.causal() & masks.sliding_window(S // 3 + 5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [1, 5, 64, 1000, 5000])
def test_sliding_windows_read_only_the_window_and_equal_the_oracle(
    dtype: torch.dtype, window: int
) -> None:
    q, k, v = _inputs(2, 8, 2, 3, 3000, 64, dtype)
    spec = masks.causal() & masks.sliding_window(window)
    # a value outside every row's window is never read: inf there leaves every row finite
    if window < 2000:
        v[:, :, :100] = float("inf")
    out = _check(q, k, v, mask=spec)
    assert bool(torch.isfinite(out).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L", [1, 5])
def test_ragged_batches_equal_the_oracle(dtype: torch.dtype, L: int) -> None:
    B, S = 4, 1500
    q, k, v = _inputs(B, 8, 2, L, S, 64, dtype, "buffer", seed=L)
    lengths = torch.tensor([1500, 0, 700, 3])  # an empty sequence: its rows give 0
    out = _check(q, k, v, mask=masks.padding(lengths))
    assert bool((out[1] == 0).all())
    _check(q, k, v, mask=masks.sequence_causal(torch.tensor([1500, L, 700, L + 2]), L))
    _check(q, k, v, mask=masks.padding(lengths) & masks.causal())
    # transformers' left padding: sequence b's real keys are its last lengths[b]
    keep = torch.arange(S)[None] >= (S - torch.tensor([1500, 20, 700, 3]))[:, None]
    _check(q, k, v, mask=masks.key_mask(keep) & masks.causal())
    _check(q, k, v, mask=masks.key_mask(keep) & masks.causal() & masks.sliding_window(256))


def test_sinks_join_the_softmax() -> None:
    q, k, v = _inputs(2, 8, 2, 2, 500, 64, torch.float32)
    sinks = torch.randn(8)
    _check(q, k, v, causal=True, sinks=sinks)


@st.composite
def _cases(draw: st.DrawFn) -> dict[str, Any]:
    Hkv = draw(st.integers(1, 3))
    L = draw(st.integers(1, 16))
    return {
        "B": draw(st.integers(1, 4)),
        "Hkv": Hkv,
        "H": Hkv * draw(st.sampled_from([1, 2, 4, 8])),
        "L": L,
        "S": draw(st.integers(L + 1, 1200)),
        "D": draw(st.sampled_from([8, 13, 64, 80, 128])),
        "dtype": draw(st.sampled_from(DTYPES)),
        "layout": draw(st.sampled_from(["contiguous", "buffer", "transposed"])),
        "mask": draw(st.sampled_from(["none", "causal", "window", "padding", "left"])),
        "seed": draw(st.integers(0, 1000)),
    }


@settings(max_examples=30, deadline=None)
@given(_cases())
def test_any_decode_call_equals_the_oracle(case: dict[str, Any]) -> None:
    B, L, S = case["B"], case["L"], case["S"]
    q, k, v = _inputs(
        B, case["H"], case["Hkv"], L, S, case["D"], case["dtype"], case["layout"], case["seed"]
    )
    gen = torch.Generator().manual_seed(case["seed"])
    lengths = torch.randint(0, S + 1, (B,), generator=gen)
    kind = case["mask"]
    spec = {
        "none": None,
        "causal": masks.causal(),
        "window": masks.causal() & masks.sliding_window(int(lengths[0]) + 1),
        "padding": masks.padding(lengths),
        "left": masks.key_mask(torch.arange(S)[None] >= (S - lengths)[:, None]) & masks.causal(),
    }[kind]
    _check(q, k, v, mask=spec)


def test_the_kernel_refuses_a_plan_without_int64_runs() -> None:
    """A plan that does not serve (no runs of keys) or runs that are not int64 ``(1 or B, L)``
    are refused by name before the C side reads a pointer, by the call and by ``bind``."""
    q, k, v = _inputs(1, 4, 2, 1, 64, 16, torch.float32, "buffer")
    lo = torch.zeros(1, 1, dtype=torch.long)
    bad = [
        (decode.DecodePlan(None, None, "a mask tensor", "no runs"), "must be int64"),
        (decode.DecodePlan(lo.int(), lo.int(), "runs", None), "must be int64"),
        (decode.DecodePlan(lo, lo[0], "runs", None), "must be \\(1 or B, L\\), one shape"),
    ]
    for runs, message in bad:
        for entry in (decode.kernel().decode_forward, decode.kernel().bind):
            with pytest.raises(RuntimeError, match=f"decode: the plan's lo, hi {message}"):
                entry(q, k, v, runs, 0.25)


def test_the_kernel_on_any_runs_equals_the_oracle() -> None:
    """The C++ kernel on its own, with runs no spec makes (any run per row, empty ones)."""
    gen = torch.Generator().manual_seed(3)
    for B, H, Hkv, L, S, D in [(3, 4, 2, 6, 900, 40), (1, 3, 1, 16, 257, 24)]:
        q, k, v = _inputs(B, H, Hkv, L, S, D, torch.float32, "buffer")
        lo = torch.randint(0, S, (B, L), generator=gen)
        hi = (lo + torch.randint(-3, S, (B, L), generator=gen)).clamp(max=S - 1)
        runs = decode.DecodePlan(lo, hi, "runs", None)
        out, lse, finite = decode.kernel().decode_forward(q, k, v, runs, 0.3)
        j = torch.arange(S)
        allowed = (j >= lo[:, None, :, None]) & (j <= hi[:, None, :, None])
        want, _ = reference_attention(q, k, v, mask=allowed, scale=0.3)
        naive, _ = reference_attention(q, k, v, mask=allowed, scale=0.3, dtype=torch.float32)
        within_naive(out, want, naive, what="runs")
        empty = (lo > hi)[:, None].expand(B, H, L)
        assert finite
        assert bool(torch.isneginf(lse[empty]).all())
        assert bool((out[empty] == 0).all())


def test_explain_says_when_the_decode_kernel_runs_and_why_not() -> None:
    q, k, v = _inputs(2, 8, 2, 1, 512, 64, torch.float32)
    e = attnkit.explain(q, k, v, mask=masks.padding(torch.tensor([512, 100])))
    assert e.chosen == "blocked"
    assert e.notes["blocked"].startswith(
        "row spans of padding([512, 100]), L = 1 queries against S = 512 keys: attnkit's AVX2 "
        "decode kernel, forward only: each of the 2 key/value heads read once for its 4 query "
        "heads, only the keys a row may see"
    )
    assert "a decode-shaped CPU call (L = 1 <= 16 queries, S = 512 keys): " in e.rule
    qg = q.clone().requires_grad_()
    note = attnkit.explain(qg, k, v, causal=True).notes["blocked"]
    assert note.startswith(
        "the decode kernel does not run it (it is forward-only, and autograd will "
        "differentiate this call); "
    )
    with torch.no_grad():  # no autograd: the kernel runs again
        assert _runs_decode(qg, k, v, causal=True)
    dense = torch.ones(2, 1, 1, 512, dtype=torch.bool)
    note = attnkit.explain(q, k, v, mask=dense).notes["blocked"]
    assert "it reads runs of keys from a mask spec" in note
    holes = masks.key_mask(torch.arange(512)[None].expand(2, -1) % 3 != 0)
    note = attnkit.explain(q, k, v, mask=holes).notes["blocked"]
    assert note.startswith("the decode kernel does not run it (it has no holes in the key mask)")
    short = attnkit.explain(q, k[:, :, :3], v[:, :, :3])
    assert short.chosen == "blocked"  # a cache of any length: the decode kernel
    assert "attnkit's AVX2 decode kernel" in short.notes["blocked"]
    long = torch.randn(2, 8, decode.MAX_L + 1, 64)
    assert "decode kernel" not in attnkit.explain(long, k, v).notes["blocked"]


def test_auto_never_builds_a_dense_mask_for_a_ragged_spec(monkeypatch: Any) -> None:
    def no_dense(self: Any) -> None:
        raise AssertionError("a dense L x S mask was built")

    monkeypatch.setattr(attnkit.AttentionCall, "dense_mask", no_dense)
    q, k, v = _inputs(8, 32, 8, 1, 2048, 128, torch.float32)
    lengths = torch.tensor([2048, 100, 1500, 7, 900, 2000, 1, 640])
    spec = masks.sequence_causal(lengths, 1)
    assert attnkit.explain(q, k, v, mask=spec).chosen == "blocked"
    _check(q, k, v, mask=spec, backend="auto")
    qg = q[:2, :, :, :].clone().requires_grad_()  # autograd: the row-span kernel, no dense mask
    spec2 = masks.sequence_causal(lengths[:2], 1)
    e = attnkit.explain(qg, k[:2], v[:2], mask=spec2)
    assert e.chosen == "blocked"
    assert "the row-span kernel reads only each row's own keys" in e.rule
    attnkit.attention(qg, k[:2], v[:2], mask=spec2).sum().backward()
    assert qg.grad is not None
    assert bool(torch.isfinite(qg.grad).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_inf_follow_the_rule_without_a_separate_pass(
    dtype: torch.dtype, monkeypatch: Any
) -> None:
    calls = []
    real = nonfinite._all_finite
    monkeypatch.setattr(nonfinite, "_all_finite", lambda call: calls.append(1) or real(call))
    q, k, v = _inputs(3, 8, 2, 2, 600, 64, dtype)
    spec = masks.padding(torch.tensor([600, 300, 0]))
    _check(q, k, v, mask=spec)
    assert calls == []  # a finite decode call pays no sum over q, k, v
    k[1, 0, 400, 5] = float("nan")  # seen by no row (sequence 1 has 300 keys)
    v[0, 1, 17, 0] = float("inf")  # seen by sequence 0's heads 4..7
    k[0, 0, 599, 1] = float("-inf")  # seen by sequence 0's heads 0..3
    q[2, 3, 1, 7] = float("nan")  # a row of an empty sequence
    out = attnkit.attention(q, k, v, mask=spec)
    want, _ = reference_attention(q, k, v, mask=spec.to_dense(2, 600))
    nan = torch.isnan(want).any(-1)
    assert torch.equal(torch.isnan(out).any(-1), nan)
    assert bool(nan[0].all())
    assert not bool(nan[1].any())
    assert int(nan[2].sum()) == 1
    naive, _ = reference_attention(q, k, v, mask=spec.to_dense(2, 600), dtype=dtype)
    within_naive(out, want, naive, where=~nan[..., None].expand_as(want), what="finite rows")


def test_the_switch_turns_the_decode_kernel_off(monkeypatch: Any) -> None:
    monkeypatch.setenv("ATTNKIT_SPAN_KERNEL", "0")
    monkeypatch.setattr(decode._decode, "tried", False)
    monkeypatch.setattr(decode._decode, "module", None)
    assert not decode.available()
    assert decode.status() == (
        "attnkit's decode kernel is off: ATTNKIT_SPAN_KERNEL=0 in the environment"
    )
    q, k, v = _inputs(2, 8, 2, 1, 512, 64, torch.float32)
    note = attnkit.explain(q, k, v, causal=True).notes["blocked"]
    assert note.startswith(
        "the decode kernel does not run it (attnkit's decode kernel is off: "
        "ATTNKIT_SPAN_KERNEL=0 in the environment)"
    )
    out = attnkit.attention(q, k, v, causal=True, backend="blocked")
    want, _ = reference_attention(q, k, v, causal=True)
    naive, _ = reference_attention(q, k, v, causal=True, dtype=torch.float32)
    within_naive(out, want, naive, what="switched off")


def test_a_small_call_with_autograd_is_not_given_the_large_unmasked_rule() -> None:
    """L = 6 queries against 8 keys with autograd: the decode kernel does not run it, and the
    row-span kernel's rule for large unmasked calls (L >= 1024) does not fire either."""
    q, k, v = (torch.randn(1, 2, n, 24, requires_grad=True) for n in (6, 8, 8))
    e = attnkit.explain(q, k, v)
    assert e.chosen == "sdpa"
    assert "can serve, but its auto rule does not fire" in str(e)
    assert "this unmasked call is 6 x 8 in training" in e.rules["blocked"][1]
