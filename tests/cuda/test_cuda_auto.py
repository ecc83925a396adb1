"""The CUDA tier: what ``auto`` takes on a real GPU, and flex's compile cache there.

Marked ``cuda``; skipped with the reason where ``torch.cuda.is_available()`` is False. The same
choices are shown without a GPU in tests/backends/test_cuda_dispatch.py (with torch's fused-
kernel rules stood in for); here torch answers for itself.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import attnkit
from attnkit import masks
from attnkit.backends import flex
from oracle import reference_attention, within_naive

pytestmark = pytest.mark.cuda


def _qkv(
    L: int, H: int = 16, Hkv: int = 16, dtype: torch.dtype = torch.bfloat16, D: int = 128
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, H, L, D, generator=g).to("cuda", dtype)
    k = torch.randn(1, Hkv, L, D, generator=g).to("cuda", dtype)
    v = torch.randn(1, Hkv, L, D, generator=g).to("cuda", dtype)
    return q, k, v


def _specs(L: int) -> dict[str, masks.MaskSpec]:
    ids = (torch.arange(L, device="cuda") * 8 // L).view(1, L)  # 8 documents
    return {
        "causal-window": masks.causal() & masks.sliding_window(1024),
        "documents": masks.causal() & masks.document(ids),
        "padding": masks.padding(torch.tensor([L - 300], device="cuda")),
        "prefix_lm": masks.prefix_lm(256),
    }


@pytest.mark.parametrize("name", ["causal-window", "documents", "padding", "prefix_lm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_auto_takes_flex_for_mask_specs_on_cuda(dtype: torch.dtype, name: str) -> None:
    q, k, v = _qkv(2048, H=4, Hkv=4, dtype=dtype, D=64)
    q.requires_grad_(True)
    e = attnkit.explain(q, k, v, mask=_specs(2048)[name])
    assert e.chosen == "flex", str(e)
    assert "a mask spec on CUDA" in e.rule


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_grouped_query_32_8_never_goes_to_math_on_cuda(dtype: torch.dtype, causal: bool) -> None:
    q, k, v = _qkv(512, H=32, Hkv=8, dtype=dtype)
    for grad in (False, True):
        q.requires_grad_(grad)
        e = attnkit.explain(q, k, v, causal=causal)
        assert e.chosen in ("sdpa", "flex"), str(e)
    out = attnkit.attention(q, k, v, causal=causal)  # and it runs, and is right
    inputs = [t.detach().cpu() for t in (q, k, v)]
    ref = reference_attention(*inputs, causal=causal)[0]
    naive = reference_attention(*inputs, causal=causal, dtype=dtype)[0]
    within_naive(out, ref, naive)


def test_no_mask_and_causal_stay_on_sdpa_on_cuda() -> None:
    q, k, v = _qkv(2048)
    for kwargs in ({}, {"causal": True}):
        e = attnkit.explain(q, k, v, **kwargs)  # type: ignore[arg-type]
        assert e.chosen == "sdpa", str(e)


def test_blocked_is_described_as_what_it_is_on_cuda() -> None:
    q, k, v = _qkv(512, H=4, Hkv=4, D=64)
    e = attnkit.explain(q, k, v, mask=masks.causal() & masks.sliding_window(64), softcap=30.0)
    assert e.chosen == "blocked", str(e)
    assert "torch matmuls on tiles on cuda (no fused kernel)" in str(e)
    assert "torch's fused kernel per block" not in str(e)


def test_flex_compiles_once_per_spec_structure_and_caches_the_block_mask() -> None:
    L = 1024
    q, k, v = _qkv(L, H=4, Hkv=4, D=64)

    def docs(cut: int) -> masks.MaskSpec:
        ids = (torch.arange(L, device="cuda") >= cut).long().view(1, L)
        return masks.causal() & masks.document(ids)

    first = docs(300)
    out = attnkit.attention(q, k, v, mask=first)  # auto: flex, compiled here
    graphs = counters["stats"]["unique_graphs"]
    entry = flex._CACHE[flex._key(first, q, k, v)]
    assert entry.calls == 1
    assert entry.seconds is not None
    again = attnkit.attention(q, k, v, mask=first)  # the cached block mask and kernel
    assert torch.equal(again, out)
    assert entry.calls == 2
    assert flex._CACHE[flex._key(first, q, k, v)] is entry
    report = str(attnkit.explain(q, k, v, mask=first))
    assert "compiled and cached for this shape and mask" in report
    other = docs(700)  # the same structure, other values: a new block mask, no new compile
    out2 = attnkit.attention(q, k, v, mask=other)
    assert counters["stats"]["unique_graphs"] == graphs
    second = flex._CACHE[flex._key(other, q, k, v)]
    assert second is not entry
    assert not torch.equal(second.block_mask.kv_num_blocks, entry.block_mask.kv_num_blocks)
    inputs = [t.cpu() for t in (q, k, v)]
    dense = other.to_dense(L, L).cpu()
    ref = reference_attention(*inputs, mask=dense)[0]
    naive = reference_attention(*inputs, mask=dense, dtype=torch.bfloat16)[0]
    within_naive(out2, ref, naive)
