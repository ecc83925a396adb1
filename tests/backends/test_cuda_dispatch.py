"""What ``auto`` picks on CUDA, shown on a machine without a GPU.

The dispatcher and the backends' device rules read one thing, ``AttentionCall.device_type``;
these tests set it to ``"cuda"`` for CPU tensors and read the real choice and the real
``explain`` report. Torch's own answer to "which fused SDPA kernel serves these arguments"
cannot be computed without a GPU (this CPU build of torch answers "none" to everything), so
:func:`attnkit.backends.sdpa.cuda_fused_kernel` is replaced by a stand-in that states torch's
rules on an H100 as torch documents them: flash for fp16/bf16 without a mask tensor (grouped-
query heads included), the memory-efficient kernel for fp16/bf16/fp32 with or without a mask
tensor but without grouped-query heads. Nothing here runs a kernel; ``tests/cuda/`` runs them
on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

import attnkit
from attnkit import masks
from attnkit.backends import AUTO_ORDER, auto_order, choose, sdpa
from attnkit.call import AttentionCall
from calls import make_call
from oracle import reference_attention, within_naive

CUDA_ORDER = "flex > sdpa > blocked > math"


def _h100_rules(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    enable_gqa: bool,
) -> str | None:
    half = q.dtype in (torch.float16, torch.bfloat16)
    if half and mask is None and q.shape[-1] <= 256:
        return "flash"
    if q.dtype in (torch.float16, torch.bfloat16, torch.float32) and not enable_gqa:
        return "efficient"
    return None


@pytest.fixture
def on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls report ``device_type == "cuda"``; torch's fused-kernel rules are an H100's."""
    monkeypatch.setattr(AttentionCall, "device_type", property(lambda self: "cuda"))
    monkeypatch.setattr(sdpa, "cuda_fused_kernel", _h100_rules)


def _qkv(
    L: int = 512,
    S: int | None = None,
    H: int = 4,
    Hkv: int = 4,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    S = L if S is None else S
    q = torch.randn(1, H, L, 64, dtype=dtype)
    k = torch.randn(1, Hkv, S, 64, dtype=dtype)
    return q, k, k.clone()


def _spec_kinds(L: int) -> dict[str, masks.MaskSpec]:
    ids = torch.zeros(1, L, dtype=torch.long)
    ids[:, L // 3 :] = 1
    ids[:, 2 * L // 3 :] = 2
    return {
        "window": masks.causal() & masks.sliding_window(64),
        "documents": masks.causal() & masks.document(ids),
        "padding": masks.padding(torch.tensor([L - 100])),
        "key_mask": masks.key_mask(torch.rand(1, L) > 0.3),
        "prefix_lm": masks.prefix_lm(100),
        "bidirectional window": masks.sliding_window(100),
    }


def test_the_cuda_order_differs_and_cpu_keeps_its_own() -> None:
    assert " > ".join(auto_order("cuda")) == CUDA_ORDER
    assert AUTO_ORDER == ["blocked", "sdpa", "math"] == auto_order("cpu")


@pytest.mark.parametrize("kind", list(_spec_kinds(512)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_every_spec_kind_goes_to_flex_on_cuda(on_cuda: None, kind: str, dtype: torch.dtype) -> None:
    q, k, v = _qkv(dtype=dtype)
    q.requires_grad_(True)  # flex trains on CUDA (its CPU refusal does not apply)
    e = attnkit.explain(q, k, v, mask=_spec_kinds(512)[kind])
    assert e.chosen == "flex", str(e)
    text = str(e)
    assert "auto's rule: a mask spec on CUDA: flex's compiled kernel visits only the non-empty" in (
        text
    )
    assert f"blocked: can serve, but auto prefers flex (order: {CUDA_ORDER})" in text
    assert "torch matmuls on tiles on cuda" not in text  # blocked's description: only if chosen


def test_the_same_spec_on_cpu_still_goes_to_blocked() -> None:
    q, k, v = _qkv(dtype=torch.float32)
    e = attnkit.explain(q, k, v, mask=masks.causal() & masks.sliding_window(64))
    assert e.chosen == "blocked"
    assert "flex: can serve, but auto uses it only when named" in str(e)
    assert "auto's rule: a mask spec and L x S >=" in str(e)


@pytest.fixture
def memory_limit() -> Iterator[Callable[[int], object]]:
    """``attnkit.set_memory_limit`` for one test (the limit restored after it)."""
    previous = attnkit.set_memory_limit(None)
    try:
        yield attnkit.set_memory_limit
    finally:
        attnkit.set_memory_limit(previous)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("L", [64, 512])
def test_grouped_query_on_cuda_never_goes_to_math(
    on_cuda: None, dtype: torch.dtype, causal: bool, L: int
) -> None:
    q, k, v = _qkv(L=L, H=32, Hkv=8, dtype=dtype)
    e = attnkit.explain(q, k, v, causal=causal)
    text = str(e)
    assert e.chosen == "sdpa", text
    if dtype == torch.float32:  # torch's fused kernels take grouped-query heads in fp16/bf16 only
        assert (
            "sdpa: K and V repeated from 8 to 32 heads: torch's fused kernels take grouped-query "
            "heads only as flash and cuDNN do (fp16/bf16); its efficient kernel serves the "
            "repeated call"
        ) in text
    else:
        assert "torch runs its flash kernel for these arguments" in text
        assert "repeated" not in text
    what = "the causal flag" if causal else "no mask"
    assert f"flex: can serve, but its auto rule does not fire: {what}: torch's fused" in text


@pytest.mark.parametrize("causal", [False, True])
def test_grouped_query_float32_whose_repeated_kv_exceed_the_limit_goes_to_flex(
    on_cuda: None, memory_limit: Callable[[int], object], causal: bool
) -> None:
    q, k, v = _qkv(H=32, Hkv=8, dtype=torch.float32)  # K and V repeated: 8 MiB
    memory_limit(4 * 2**20)
    e = attnkit.explain(q, k, v, causal=causal)
    text = str(e)
    assert e.chosen == "flex", text
    assert (
        "auto's rule: torch's fused SDPA kernels cannot serve this call (torch has no fused CUDA "
        "kernel for these grouped-query heads, and K and V repeated to the 32 query heads "
        "(0.00781 GiB (8,388,608 bytes)) would exceed attnkit's memory limit); flex's compiled "
        "kernel is the next fused path on CUDA"
    ) in text


def test_grouped_query_with_a_mask_tensor_on_cuda_repeats_kv_or_takes_blocked(
    on_cuda: None, memory_limit: Callable[[int], object]
) -> None:
    q, k, v = _qkv(H=32, Hkv=8, dtype=torch.float32)
    mask = torch.rand(512, 512) > 0.5
    e = attnkit.explain(q, k, v, mask=mask)
    assert e.chosen == "sdpa", str(e)  # the memory-efficient kernel takes the mask
    assert "K and V repeated from 8 to 32 heads" in str(e)
    memory_limit(7 * 2**20)  # the repeated K and V (8 MiB) do not fit, blocked's 6 MiB do
    e = attnkit.explain(q, k, v, mask=mask)
    assert e.chosen == "blocked", str(e)
    text = str(e)
    assert "torch matmuls on tiles on cuda (no fused kernel)" in text  # its CUDA description
    assert "flex: cannot serve: it takes mask specs" in text
    assert "sdpa: cannot serve: torch has no fused CUDA kernel for these grouped-query" in text


@pytest.mark.parametrize("mask", [None, "tensor"])
def test_the_repeated_kv_run_matches_the_oracle_and_trains(on_cuda: None, mask: str | None) -> None:
    """What sdpa runs for grouped-query float32 on CUDA (K and V repeated, no ``enable_gqa``),
    run here on CPU tensors: the output and the gradients of q, k, v (Hkv heads: the repeat's
    backward sums the groups) against the float64 oracle."""
    g = torch.Generator().manual_seed(7)
    q64 = torch.randn(2, 8, 40, 16, generator=g, dtype=torch.float64)
    k64 = torch.randn(2, 2, 50, 16, generator=g, dtype=torch.float64)
    v64 = torch.randn(2, 2, 50, 16, generator=g, dtype=torch.float64)
    m = torch.rand(40, 50, generator=g) > 0.3 if mask else None
    dout = torch.randn(2, 8, 40, 16, generator=g, dtype=torch.float64)
    q, k, v = (t.float().requires_grad_(True) for t in (q64, k64, v64))
    e = attnkit.explain(q, k, v, mask=m)
    assert e.chosen == "sdpa", str(e)
    assert "K and V repeated from 2 to 8 heads" in str(e)
    out = attnkit.attention(q, k, v, mask=m)
    grads = torch.autograd.grad(out, (q, k, v), dout.float())
    ins = [t.requires_grad_(True) for t in (q64.clone(), k64.clone(), v64.clone())]
    ref = reference_attention(*ins, mask=m)[0]
    ref_grads = torch.autograd.grad(ref, ins, dout)
    naive_ins = [t.float().requires_grad_(True) for t in (q64, k64, v64)]
    naive = reference_attention(*naive_ins, mask=m, dtype=torch.float32)[0]
    naive_grads = torch.autograd.grad(naive, naive_ins, dout.float())
    within_naive(out, ref, naive)
    for part, got, want, nv in zip("qkv", grads, ref_grads, naive_grads, strict=True):
        assert got.shape == want.shape, part
        within_naive(got, want, nv, grad=True, what=part)


def test_a_grouped_query_call_no_kernel_serves_even_repeated_is_refused_by_sdpa(
    on_cuda: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[bool] = []

    def no_kernel(*args: object) -> str | None:
        asked.append(bool(args[-1]))  # enable_gqa
        return None

    monkeypatch.setattr(sdpa, "cuda_fused_kernel", no_kernel)
    q, k, v = _qkv(H=32, Hkv=8, dtype=torch.float32)
    e = attnkit.explain(q, k, v, causal=True)
    assert asked == [True, False]  # as given, then with K and V repeated
    assert e.chosen == "flex", str(e)
    assert (
        "torch reports no fused CUDA kernel for these arguments (grouped-query heads, and none "
        "with K and V repeated to the query heads)"
    ) in str(e)


def test_no_mask_and_causal_stay_on_sdpa_on_cuda(on_cuda: None) -> None:
    q, k, v = _qkv()
    for kwargs in ({}, {"causal": True}):
        e = attnkit.explain(q, k, v, **kwargs)  # type: ignore[arg-type]
        assert e.chosen == "sdpa", str(e)


def test_a_spec_in_one_block_takes_sdpa_not_a_compile(on_cuda: None) -> None:
    q, k, v = _qkv(L=100)
    e = attnkit.explain(q, k, v, mask=masks.sliding_window(16))
    assert e.chosen == "sdpa", str(e)
    assert "fit in one 128 x 128 block: nothing to skip; sdpa on the materialised mask" in str(e)


def test_where_flex_cannot_serve_explain_says_so_and_the_next_fused_path_runs(
    on_cuda: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    q, k, v = _qkv()
    spec = masks.causal() & masks.sliding_window(64)
    # a score modifier flex lacks: the soft-cap goes to blocked (no fused torch kernel has it)
    e = attnkit.explain(q, k, v, mask=spec, softcap=30.0)
    assert e.chosen == "blocked", str(e)
    assert "flex: cannot serve: soft-cap and sinks are not wired into flex's score_mod" in str(e)
    assert "sdpa: cannot serve: torch's fused kernels have no logit soft-cap" in str(e)
    # a score bias (ALiBi) flex lacks: torch's fused kernel on the materialised float mask
    e = attnkit.explain(q, k, v, mask=masks.causal() & masks.alibi(4))
    assert e.chosen == "sdpa", str(e)
    assert "flex: cannot serve: score biases (has_bias) are not wired" in str(e)
    # a torch without flex_attention
    monkeypatch.setattr("attnkit.backends.flex.unavailable", lambda: "torch 2.4 has no flex")
    e = attnkit.explain(q, k, v, mask=spec)
    assert e.chosen == "sdpa", str(e)
    assert "flex: cannot serve: torch 2.4 has no flex" in str(e)


def test_math_is_the_dense_fallback_on_cuda_and_explain_says_why(on_cuda: None) -> None:
    q, k, v = _qkv(H=32, Hkv=8, dtype=torch.float32)
    e = attnkit.explain(
        q, k, v, mask=masks.causal() & masks.sliding_window(64), return_weights=True
    )
    assert e.chosen == "math"
    text = str(e)
    assert "auto's rule: the dense fallback, taken only because no fused backend can serve" in text
    for name in ("flex", "sdpa", "blocked"):
        assert f"{name}: cannot serve:" in text
    e = attnkit.explain(q.double(), k.double(), v.double(), causal=True)  # fp64: no fused kernel
    assert e.chosen == "blocked", str(e)
    assert "flex on CUDA compiles float32, bfloat16 and float16, not torch.float64" in str(e)


def test_flex_refuses_head_dims_its_cuda_kernels_do_not_take(on_cuda: None) -> None:
    q = torch.randn(1, 4, 512, 8)
    e = attnkit.explain(q, q, q, mask=masks.causal() & masks.sliding_window(64))
    assert e.verdicts["flex"] == (
        "flex_attention's CUDA kernels need head dims of at least 16 (Dk=8, Dv=8)"
    )
    assert e.chosen == "sdpa"


def test_choosing_flex_for_a_large_spec_builds_no_mask(on_cuda: None) -> None:
    """auto decides on a spec without asking sdpa, which would materialise it (L x S)."""
    q, k, v = _qkv(L=4096, dtype=torch.float32)
    spec = masks.causal() & masks.sliding_window(64)
    call = make_call(q, k, v, spec, False, None, 0.0, where="test")  # a real call, not explain's
    assert choose(call, "auto", "test").name == "flex"
    assert call.dense_mask_bytes() > 0  # still to build: nothing was materialised
    assert "dense" not in call._dense


def test_flex_reads_sdpas_decision_and_nobody_asks_torch_twice(
    on_cuda: None, monkeypatch: pytest.MonkeyPatch, memory_limit: Callable[[int], object]
) -> None:
    """flex's CUDA rule ("what sdpa cannot serve") reads the registered sdpa's decision for the
    call; the dispatcher and explain reuse it, so torch's rules are asked once per call (for a
    grouped-query call: as given, then with K and V repeated)."""
    asked: list[str] = []

    def counted(*args: object) -> str | None:
        asked.append("cuda_fused_kernel")
        return _h100_rules(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(sdpa, "cuda_fused_kernel", counted)
    memory_limit(4 * 2**20)  # the repeated K and V (8 MiB) do not fit: sdpa refuses
    q, k, v = _qkv(H=32, Hkv=8, dtype=torch.float32)  # grouped float32: no fused SDPA kernel
    call = make_call(q, k, v, None, True, None, 0.0, where="test")
    choice = choose(call, "auto", "test")
    assert choice.name == "flex"
    assert list(choice.decisions) == ["flex"]  # sdpa was asked by flex's rule, for the call
    assert call._decisions["sdpa"].reason is not None
    assert asked == ["cuda_fused_kernel"] * 2
    e = attnkit.explain(q, k, v, causal=True)
    assert e.chosen == "flex"
    assert asked == ["cuda_fused_kernel"] * 4  # one more call, asked once (twice: grouped)
    assert "would exceed attnkit's memory limit" in str(e.verdicts["sdpa"])
