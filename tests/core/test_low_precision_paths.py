"""bfloat16 and float16 on every CPU path of :mod:`attnkit.cpu`: ``native``,
``fp32-upcast``, ``torch``, forced by ``ATTNKIT_CPU_PATH``.

Against the float64 oracle on the inputs rounded to the low dtype, with a relative tolerance:
``max |got - want| <= RTOL * max(max |want|, 1)`` for the output and for each of dq, dk, dv.
bfloat16 keeps 8 bits of mantissa (one rounding: 2**-9 relative) and float16 11 (2**-12);
torch's kernels round P and dS to the input dtype before their matmuls, which costs a few such
roundings summed over keys, so RTOL is 16 roundings: 2**-5 = 0.031 (bfloat16) and
2**-8 = 0.0039 (float16). Rows with nothing to attend to must be exactly 0 with gradient 0.

A path this CPU cannot run is skipped with the reason (the issue allows exactly that). The
``native`` path's *code* (input-dtype tensors through the backends, torch's kernels) runs on any
CPU, only slowly without the instructions, so ``native-simulated`` runs it here by reporting the
instructions in :func:`attnkit.cpu.features`: it checks the numbers and that nothing crashes
(bf16 backward with a sliding window used to), not the speed.

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
Dk query/key head dim, Dv value head dim.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import cpu, masks
from attnkit.backends.blocked import rowspan, rowspan_builds
from attnkit.masks import MaskSpec
from cpu_paths import PATHS, use_path
from oracle import reference_attention
from strategies import Sizes, qkv, specs

RTOL = {torch.bfloat16: 2**-5, torch.float16: 2**-8}
LOW = [torch.bfloat16, torch.float16]


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = max(want.abs().max().item(), 1.0) if want.numel() else 1.0
    return (got.double() - want).abs().max().item() / scale if want.numel() else 0.0


def _oracle(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dense: torch.Tensor | None,
    dout: torch.Tensor,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    q64, k64, v64 = (t.double().requires_grad_(True) for t in (q, k, v))
    out = reference_attention(q64, k64, v64, mask=dense)[0]
    grads = torch.autograd.grad(out, (q64, k64, v64), dout.double())
    return out.detach(), grads


def check_against_oracle(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: MaskSpec | None, backend: str
) -> None:
    """Output and dq, dk, dv of ``backend`` within RTOL of the oracle; dead rows exactly 0."""
    dtype = q.dtype
    B, H, L, _ = q.shape
    S, Dv = k.shape[2], v.shape[3]
    dout = torch.randn(B, H, L, Dv, generator=torch.Generator().manual_seed(1)).to(dtype)
    dense = None if spec is None else spec.to_dense(L, S)
    want, want_grads = _oracle(q, k, v, dense, dout)
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = attnkit.attention(qg, kg, vg, mask=spec, backend=backend)
    grads = torch.autograd.grad(out, (qg, kg, vg), dout)
    assert out.dtype == dtype
    assert _rel_err(out, want) <= RTOL[dtype], _rel_err(out, want)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want_grads, strict=True):
        assert got.dtype == dtype, name
        assert _rel_err(got, ref) <= RTOL[dtype], (name, _rel_err(got, ref))
    if dense is not None:  # rows that see nothing: output 0 and dq 0, exactly
        if dense.dtype != torch.bool:
            dense = dense > float("-inf")
        dead = ~dense.expand(B, H, L, S).any(-1)  # (B, H, L)
        assert torch.equal(out[dead], torch.zeros_like(out[dead]))
        assert torch.equal(grads[0][dead], torch.zeros_like(grads[0][dead]))


SIZES = Sizes(
    batch=(1, 2),
    kv_heads=(1, 2),
    groups=(1, 2),
    lengths=(1, 5, 33, 64),
    head_dims=(8, 16),
    value_dims=(8, 12),
)


@st.composite
def cases(draw: st.DrawFn, dtype: torch.dtype) -> tuple[Any, ...]:
    q, k, v = draw(qkv(SIZES, dtype))
    B, L, S = q.shape[0], q.shape[2], k.shape[2]
    spec = draw(st.one_of(st.none(), specs(B, L, S)))
    backend = draw(st.sampled_from(["auto", "blocked", "sdpa", "math"]))
    if backend == "sdpa" and (
        q.shape[-1] != v.shape[-1] or any(t.stride(-1) != 1 for t in (q, k, v))
    ):
        backend = "blocked"  # sdpa refuses Dv != Dk and strided rows (tested with its rules)
    return q, k, v, spec, backend


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_every_path_matches_the_oracle(
    dtype: torch.dtype, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_path(monkeypatch, path, dtype)

    @settings(max_examples=25)
    @given(cases(dtype))
    def sweep(case: tuple[Any, ...]) -> None:
        check_against_oracle(*case)

    sweep()


def _spec_kinds(B: int, H: int, L: int) -> dict[str, MaskSpec]:
    ids = torch.tensor([0] * 70 + [1] * 90 + [2] * (L - 160))
    return {
        "causal": masks.causal(),
        "causal-window": masks.causal() & masks.sliding_window(48),
        "window": masks.sliding_window(40),
        "documents": masks.document(ids) & masks.causal(),
        "prefix-lm": masks.prefix_lm(torch.tensor([30, 110])),
        "padding": masks.padding(torch.tensor([L, 77]), q_lengths=torch.tensor([L, 120])),
        "alibi": masks.alibi(H) & masks.causal(),
    }


KINDS = list(_spec_kinds(2, 4, 200))
#: a mask the row-span kernel does not serve (a ``~``, which row_spans does not read), so
#: fp32-upcast converts
CONVERTS = masks.causal() & ~masks.sliding_window(4)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_backward_on_every_spec_kind(
    dtype: torch.dtype, path: str, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The blocked backend, forward and backward, on every spec kind, at sizes where it runs
    several tiles per launch (overlapping key windows: the ``index_add_`` that crashed)."""
    use_path(monkeypatch, path, dtype)
    B, H, Hkv, L, D = 2, 4, 2, 200, 16
    g = torch.Generator().manual_seed(14)
    q = torch.randn(B, H, L, D, generator=g).to(dtype)
    k, v = (torch.randn(B, Hkv, L, D, generator=g).to(dtype) for _ in range(2))
    check_against_oracle(q, k, v, _spec_kinds(B, H, L)[kind], "blocked")


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """What reaches the row-span kernel: (direction, dtype of q)."""
    if not rowspan_builds.available():
        pytest.skip(f"the row-span kernel does not run here: {rowspan_builds.status()}")
    seen: list[tuple[Any, ...]] = []
    builds = rowspan_builds.kernel

    class Spy:
        def __init__(self, isa: str = "avx2") -> None:
            self.real = builds(isa)

        def span_forward_finite(self, *args: Any) -> Any:
            seen.append(("forward", args[0].dtype))
            return self.real.span_forward_finite(*args)

        def span_backward(self, *args: Any) -> Any:
            seen.append(("backward", args[0].dtype, args[3].dtype, args[4].dtype))
            return self.real.span_backward(*args)

    monkeypatch.setattr(rowspan_builds, "kernel", Spy)
    return seen


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.dtype, ...]]:
    """The dtypes of each call of ``to_float32`` (the blocked backend's and its op's)."""
    from attnkit.backends import blocked
    from attnkit.backends.blocked import compiled

    seen: list[tuple[torch.dtype, ...]] = []
    real = cpu.to_float32

    def spy(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        seen.append(tuple(t.dtype for t in ts))
        return real(*ts)

    monkeypatch.setattr(blocked, "to_float32", spy)
    monkeypatch.setattr(compiled, "to_float32", spy)
    return seen


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_fp32_upcast_hands_a_low_precision_window_to_the_row_span_kernel_as_it_is(
    dtype: torch.dtype,
    kernel_calls: list[tuple[Any, ...]],
    conversions: list[tuple[torch.dtype, ...]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The kernel reads bfloat16/float16 itself: it receives the input-dtype q (and out, dout
    in the backward), and nothing is converted to float32 on the way."""
    use_path(monkeypatch, "fp32-upcast", dtype)
    spec = masks.causal() & masks.sliding_window(32)
    q, k, v = (torch.randn(1, 2, 256, 32).to(dtype).requires_grad_(True) for _ in range(3))
    out = attnkit.attention(q, k, v, mask=spec)
    out.backward(torch.ones_like(out))
    assert kernel_calls == [("forward", dtype), ("backward", dtype, dtype, dtype)]
    assert conversions == []
    assert out.dtype == q.grad.dtype == k.grad.dtype == v.grad.dtype == dtype  # type: ignore[union-attr]
    with torch.no_grad():
        attnkit.attention(q, k, v, mask=spec)
    assert kernel_calls[-1] == ("forward", dtype)
    assert conversions == []
    name = str(dtype).removeprefix("torch.")
    note = attnkit.explain(q, k, v, mask=spec).notes["blocked"]
    assert note.startswith(
        f"fp32-upcast path: attnkit's row-span kernel reads {name} q, k, v directly (float32 "
        "inside, no float32 copies); causal sliding window 32: forward and backward run "
        f"{rowspan_builds.status()}"
    )


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_fp32_upcast_sinks_with_the_kernel_reading_low_precision(
    dtype: torch.dtype,
    kernel_calls: list[tuple[Any, ...]],
    conversions: list[tuple[torch.dtype, ...]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sinks join the kernel's float32 lse outside it (the output is rescaled from the kernel's
    input-dtype output, a second rounding): out, dq, dk, dv and dsinks within RTOL."""
    use_path(monkeypatch, "fp32-upcast", dtype)
    g = torch.Generator().manual_seed(21)
    B, H, Hkv, L, D = 1, 4, 2, 120, 16
    q = torch.randn(B, H, L, D, generator=g).to(dtype)
    k, v = (torch.randn(B, Hkv, L, D, generator=g).to(dtype) for _ in range(2))
    sinks = (torch.randn(H, generator=g) * 2).to(dtype)
    dout = torch.randn(B, H, L, D, generator=g).to(dtype)
    spec = masks.causal() & masks.sliding_window(24)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, sinks)]
    out = attnkit.attention(*leaves[:3], mask=spec, sinks=leaves[3], backend="blocked")
    grads = torch.autograd.grad(out, leaves, dout)
    assert kernel_calls == [("forward", dtype), ("backward", dtype, dtype, dtype)]
    assert conversions == []
    refs = [t.double().requires_grad_(True) for t in (q, k, v, sinks)]
    dense = spec.to_dense(L, L)
    want = reference_attention(*refs[:3], mask=dense, sinks=refs[3])[0]
    want_grads = torch.autograd.grad(want, refs, dout.double())
    assert out.dtype == dtype
    assert _rel_err(out, want.detach()) <= RTOL[dtype]
    for name, got, ref in zip(("dq", "dk", "dv", "dsinks"), grads, want_grads, strict=True):
        assert got.dtype == dtype, name
        assert _rel_err(got, ref) <= RTOL[dtype], (name, _rel_err(got, ref))


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_fp32_upcast_calls_the_kernel_does_not_serve_still_convert(
    dtype: torch.dtype,
    kernel_calls: list[tuple[Any, ...]],
    conversions: list[tuple[torch.dtype, ...]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A mask the row-span kernel does not serve (``CONVERTS``) goes to the tiles on float32
    copies, as before; so does float16 where the kernel was built without F16C, which then
    runs the kernel on the float32 copies."""
    use_path(monkeypatch, "fp32-upcast", dtype)
    q, k, v = (torch.randn(1, 2, 96, 16).to(dtype).requires_grad_(True) for _ in range(3))
    spec = CONVERTS
    out = attnkit.attention(q, k, v, mask=spec, backend="blocked")
    out.backward(torch.ones_like(out))
    assert kernel_calls == []
    assert conversions == [(dtype,) * 3, (dtype,) * 5]
    note = attnkit.explain(q, k, v, mask=spec).notes["blocked"]
    assert note.startswith("fp32-upcast path: the kernels run on float32 copies of q, k, v; ")

    build = rowspan_builds.select(torch.float32)[0]  # the build that runs float32 here
    assert build is not None
    lazy = build.lazy
    real = lazy.module

    class NoF16C:  # the module as built without -mf16c
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def low_dtypes(self) -> list[str]:
            return ["bfloat16"]

    monkeypatch.setattr(lazy, "module", NoF16C())
    conversions.clear()
    for leaf in (q, k, v):
        leaf.grad = None
    window = masks.causal() & masks.sliding_window(16)
    out = attnkit.attention(q, k, v, mask=window, backend="blocked")
    out.backward(torch.ones_like(out))
    f32 = torch.float32
    if dtype == torch.float16:
        assert kernel_calls == [("forward", f32), ("backward", f32, f32, f32)]
        assert conversions == [(dtype,) * 3, (dtype,) * 5]
        note = attnkit.explain(q, k, v, mask=window).notes["blocked"]
        assert note.startswith("fp32-upcast path: the kernels run on float32 copies of q, k, v; ")
        assert rowspan_builds.status() in note
        plan = rowspan.plan(window, q, k, v, in_dtype=True)
        assert plan.reason == (
            "attnkit's row-span kernel was built without F16C (this CPU has none), so it does "
            "not read float16"
        )
    else:
        assert kernel_calls == [("forward", dtype), ("backward", dtype, dtype, dtype)]
        assert conversions == []
    dense = window.to_dense(96, 96)
    want, want_grads = _oracle(q.detach(), k.detach(), v.detach(), dense, torch.ones_like(out))
    assert _rel_err(out, want) <= RTOL[dtype]
    for leaf, ref in zip((q, k, v), want_grads, strict=True):
        assert leaf.grad is not None
        assert _rel_err(leaf.grad, ref) <= RTOL[dtype]


@pytest.mark.parametrize("path", ["torch", "native-simulated"])
def test_other_paths_keep_the_input_dtype(
    path: str, kernel_calls: list[tuple[Any, ...]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On ``torch`` and ``native`` nothing is converted: on ``torch`` the row-span kernel stays
    out; on ``native`` it takes bfloat16 as it is only where its AVX512-BF16 build (bf16 dot
    products) runs; sdpa's kernel sees bfloat16 (math converts on every path, as torch's math
    SDPA does: tests/backends/test_low_precision_math.py)."""
    use_path(monkeypatch, path, torch.bfloat16)
    spec = masks.causal() & masks.sliding_window(32)
    q = torch.randn(1, 2, 256, 32, dtype=torch.bfloat16)
    attnkit.attention(q, q, q, mask=spec)
    dot = path != "torch" and rowspan_builds.AVX512_BF16.lazy.get() is not None
    assert kernel_calls == ([("forward", torch.bfloat16)] if dot else [])
    seen: list[torch.dtype] = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(q.dtype)
        return real(q, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    attnkit.attention(q, q, q, causal=True, backend="sdpa")
    assert seen == [torch.bfloat16]
    note = attnkit.explain(q, q, q, mask=spec).notes["blocked"]
    name = "torch" if path == "torch" else "native"
    assert note.startswith(f"{name} path: the kernels run on q, k, v in torch.bfloat16; ")


def test_fp32_upcast_sdpa_and_math_compute_in_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    use_path(monkeypatch, "fp32-upcast", torch.bfloat16)
    seen: list[torch.dtype] = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(q.dtype)
        return real(q, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    q = torch.randn(1, 2, 64, 16, dtype=torch.bfloat16)
    out = attnkit.attention(q, q, q, causal=True)  # auto: sdpa
    assert seen == [torch.float32]
    assert out.dtype == torch.bfloat16
    out, w = attnkit.attention(q, q, q, causal=True, return_weights=True)  # math
    assert out.dtype == w.dtype == torch.bfloat16  # type: ignore[union-attr]
    e = attnkit.explain(q, q, q, causal=True)
    assert e.cpu_path == "fp32-upcast"
    assert e.notes["sdpa"] == (
        "runs torch's float32 fused kernel on float32 copies of q, k, v (fp32-upcast)"
    )
    assert e.notes["math"] == "computes in float32 on float32 copies of q, k, v (fp32-upcast)"


def test_explain_names_the_path_and_the_cpu_features(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cpu.ENV, raising=False)
    q = torch.randn(1, 2, 16, 8, dtype=torch.bfloat16)
    text = str(attnkit.explain(q, q, q))
    f = cpu.features()
    assert f"  CPU: {f}" in text
    assert f"torch capability: {torch.backends.cpu.get_cpu_capability()}" in text
    want = next(p for p in cpu.PATHS if cpu.unavailable(p, torch.bfloat16) is None)
    assert f"  CPU path: {want} (chosen for this CPU" in text
    monkeypatch.setenv(cpu.ENV, "torch")
    text = str(attnkit.explain(q, q, q))
    assert "  CPU path: torch (forced by ATTNKIT_CPU_PATH='torch'): bfloat16 tensors go to " in text
    f32 = attnkit.explain(q.float(), q.float(), q.float())
    assert f32.cpu_path is None
    assert "CPU path" not in str(f32)


@pytest.mark.parametrize(
    ("machine", "flags", "bf16", "fp16"),
    [
        ("x86_64", {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"}, "native", "fp32-upcast"),
        ("x86_64", {"avx2", "fma", "avx512f"}, "fp32-upcast", "fp32-upcast"),
        ("x86_64", {"avx2", "fma"}, "fp32-upcast", "fp32-upcast"),
        ("x86_64", set(), "torch", "torch"),
        ("aarch64", set(), "torch", "torch"),
    ],
)
def test_auto_picks_the_fastest_path_the_cpu_runs(
    machine: str, flags: set[str], bf16: str, fp16: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(cpu.ENV, raising=False)
    fake = cpu.CpuFeatures(machine, frozenset(flags), "AVX2")
    monkeypatch.setattr(cpu, "features", lambda: fake)
    q = torch.randn(1, 1, 4, 8)
    assert cpu.path_for(q.bfloat16(), "t") == bf16
    assert cpu.path_for(q.half(), "t") == fp16
    assert cpu.path_for(q, "t") is None  # float32 never takes a path
    assert attnkit.explain(q.bfloat16(), q.bfloat16(), q.bfloat16()).cpu_path == bf16


def test_a_bad_path_value_is_an_input_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu.ENV, "fp32")
    q = torch.randn(1, 2, 8, 8, dtype=torch.bfloat16)
    with pytest.raises(attnkit.AttentionInputError) as info:
        attnkit.attention(q, q, q)
    msg = str(info.value)
    assert info.value.argument == "ATTNKIT_CPU_PATH"
    assert msg.startswith("attnkit.attention: ATTNKIT_CPU_PATH='fp32' is not a path.\n")
    assert "  got:      ATTNKIT_CPU_PATH='fp32' for torch.bfloat16 on the CPU (" in msg
    assert "  expected: unset, 'auto', or a path this CPU runs for torch.bfloat16: " in msg
    assert "  fix:      unset ATTNKIT_CPU_PATH (auto picks the fastest path this CPU runs)" in msg
    with pytest.raises(attnkit.AttentionInputError, match="is not a path"):
        attnkit.explain(q, q, q)
    attnkit.attention(q.float(), q.float(), q.float())  # float32 never reads it


def test_forcing_a_path_the_cpu_cannot_run_is_an_input_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = cpu.CpuFeatures("x86_64", frozenset({"avx2", "fma"}), "AVX2")
    monkeypatch.setattr(cpu, "features", lambda: fake)
    monkeypatch.setenv(cpu.ENV, "native")
    q = torch.randn(1, 2, 8, 8, dtype=torch.bfloat16)
    with pytest.raises(attnkit.AttentionInputError) as info:
        attnkit.attention(q, q, q)
    msg = str(info.value)
    assert msg.startswith(
        "attnkit.attention: ATTNKIT_CPU_PATH='native' forces a path this CPU cannot run for "
        "torch.bfloat16: this CPU has no avx512_bf16 or amx_bf16 (torch's bfloat16 matmuls are "
        "slow on it).\n"
    )
    assert "(x86_64; flags: avx2 fma; torch capability: AVX2)" in msg
    assert "a path this CPU runs for torch.bfloat16: fp32-upcast, torch\n" in msg
    fake = cpu.CpuFeatures("aarch64", frozenset(), "DEFAULT")
    monkeypatch.setattr(cpu, "features", lambda: fake)
    monkeypatch.setenv(cpu.ENV, "fp32-upcast")
    with pytest.raises(
        attnkit.AttentionInputError, match="it is for x86 CPUs, and this one is aarch64"
    ):
        attnkit.attention(q, q, q)


def test_compiled_blocked_follows_the_path(
    kernel_calls: list[tuple[Any, ...]],
    conversions: list[tuple[torch.dtype, ...]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Inside torch.compile the blocked op does what the eager call does (the row-span kernel
    reads bfloat16 directly; a mask it does not serve converts): same numbers."""
    use_path(monkeypatch, "fp32-upcast", torch.bfloat16)
    spec = masks.causal() & masks.sliding_window(16)
    q, k, v = (torch.randn(1, 2, 96, 16, dtype=torch.bfloat16) for _ in range(3))
    for m in (spec, CONVERTS):
        eager = attnkit.attention(q, k, v, mask=m, backend="blocked")
        kernel_calls.clear()
        conversions.clear()
        compiled = torch.compile(
            lambda q, k, v, m=m: attnkit.attention(q, k, v, mask=m, backend="blocked"),
            fullgraph=True,
        )
        assert torch.equal(compiled(q, k, v), eager)
        if m is spec:
            assert (kernel_calls, conversions) == ([("forward", torch.bfloat16)], [])
        else:
            assert (kernel_calls, conversions) == ([], [(torch.bfloat16,) * 3])


def test_the_reused_conversion_buffer_never_leaks_between_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """fp32-upcast converts into one buffer per thread (for calls the row-span kernel does not
    read directly: ``CONVERTS`` here): a second call between a forward and its backward
    overwrites it, and neither the first output nor its gradients change."""
    use_path(monkeypatch, "fp32-upcast", torch.bfloat16)
    spec = CONVERTS & masks.sliding_window(24)
    g = torch.Generator().manual_seed(3)
    a = [torch.randn(1, 2, 128, 16, generator=g).bfloat16().requires_grad_(True) for _ in range(3)]
    b = [torch.randn(1, 2, 160, 16, generator=g).bfloat16() for _ in range(3)]
    dout = torch.randn(1, 2, 128, 16, generator=g).bfloat16()
    alone = attnkit.attention(*a, mask=spec)
    want = torch.autograd.grad(alone, a, dout)
    out = attnkit.attention(*a, mask=spec)
    kept = out.detach().clone()
    attnkit.attention(*b, mask=spec)  # overwrites (and grows) the buffer
    attnkit.attention(*b, mask=CONVERTS & masks.document(torch.tensor([0] * 80 + [1] * 80)))
    assert torch.equal(out, kept)
    got = torch.autograd.grad(out, a, dout)
    for x, y in zip(got, want, strict=True):
        assert torch.equal(x, y)
    cpu.release_buffers()
    assert getattr(cpu._local, "buf", None) is None


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("path", PATHS)
def test_a_float_mask_tensor_on_every_path(
    path: str, grad: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user's bfloat16 float mask (``-inf`` blocks, a bias elsewhere) on every backend that
    takes one: sdpa gets it in the dtype of the q it runs on."""
    use_path(monkeypatch, path, torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 2, 40, 16, generator=g).bfloat16() for _ in range(3))
    bias = torch.randn(2, 1, 40, 40, generator=g)
    bias = bias.masked_fill(torch.rand(2, 1, 40, 40, generator=g) < 0.3, float("-inf"))
    bias[1, :, 7] = float("-inf")  # a row that sees nothing
    bias = bias.bfloat16()
    dout = torch.randn(2, 2, 40, 16, generator=g).bfloat16()
    want, want_grads = _oracle(q, k, v, bias, dout)
    for backend in ("sdpa", "math", "blocked"):
        qg, kg, vg = (t.clone().requires_grad_(grad) for t in (q, k, v))
        out = attnkit.attention(qg, kg, vg, mask=bias, backend=backend)
        assert out.dtype == torch.bfloat16
        assert _rel_err(out, want) <= RTOL[torch.bfloat16], backend
        assert torch.equal(out[1, :, 7], torch.zeros_like(out[1, :, 7])), backend
        if grad:
            grads = torch.autograd.grad(out, (qg, kg, vg), dout)
            for got, ref in zip(grads, want_grads, strict=True):
                assert _rel_err(got, ref) <= RTOL[torch.bfloat16], backend


def test_the_conversion_buffer_survives_inference_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """A buffer made under torch.inference_mode is an inference tensor, which cannot be written
    outside it: the next call outside makes a new one (and training works)."""
    use_path(monkeypatch, "fp32-upcast", torch.bfloat16)
    cpu.release_buffers()
    spec = CONVERTS & masks.sliding_window(8)
    q = torch.randn(1, 2, 64, 16).bfloat16()
    with torch.inference_mode():
        inside = attnkit.attention(q, q, q, mask=spec, backend="blocked")
    assert cpu._local.buf.is_inference()
    qg = q.clone().requires_grad_(True)
    out = attnkit.attention(qg, qg, qg, mask=spec, backend="blocked")
    out.sum().backward()
    assert torch.equal(out.detach(), inside)
    assert not cpu._local.buf.is_inference()


def test_a_long_call_keeps_no_conversion_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Copies above cpu.KEEP_BYTES are fresh tensors: nothing of a long call stays allocated,
    and the results are the same as through the kept buffer."""
    use_path(monkeypatch, "fp32-upcast", torch.bfloat16)
    cpu.release_buffers()
    spec = CONVERTS & masks.sliding_window(8)
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 2, 64, 16, generator=g).bfloat16() for _ in range(3))
    kept = attnkit.attention(q, k, v, mask=spec, backend="blocked")
    assert cpu._local.buf is not None  # a short call fills the buffer
    cpu.release_buffers()
    monkeypatch.setattr(cpu, "KEEP_BYTES", 16)  # every call is "long" now
    fresh = attnkit.attention(q, k, v, mask=spec, backend="blocked")
    assert getattr(cpu._local, "buf", None) is None
    assert torch.equal(fresh, kept)
