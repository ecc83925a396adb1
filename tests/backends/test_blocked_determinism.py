"""The blocked backend under ``torch.use_deterministic_algorithms(True)``: the forward and the
backward give the same bits on every run (with the same number of threads).

The row-span kernel's backward sums dK, dV over work items that several threads finish in
varying order; the items' sums are added in a fixed order (the order they are handed out in),
so dk/dv no longer depend on which thread finishes first. One kv head and 4 query heads at
L = 1024 make many items per kv head that overlap in keys (the case that gave up to 8 different
dk/dv in 8 runs before). The tile path (specs without one run of keys per row, float64) is
checked too.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import attnkit
from attnkit import masks
from attnkit.backends.blocked import rowspan_builds
from attnkit.masks import MaskSpec
from oracle import reference_attention

L = 1024
RUNS = 6


@pytest.fixture
def deterministic_two_threads() -> Iterator[None]:
    """Deterministic algorithms on and 2 threads, both restored after the test."""
    mode = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    threads = torch.get_num_threads()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)
        torch.set_num_threads(threads)


def _inputs(dtype: torch.dtype, Hkv: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = ((1, 4, L, 64), (1, Hkv, L, 64), (1, Hkv, L, 64), (1, 4, L, 64))
    return [torch.randn(*s, generator=g).to(dtype) for s in shapes]


def _runs(spec: MaskSpec, dtype: torch.dtype, Hkv: int = 1) -> list[list[torch.Tensor]]:
    """out, dq, dk, dv of ``RUNS`` forward and backward passes on the same inputs."""
    q, k, v, dout = _inputs(dtype, Hkv)
    results = []
    for _ in range(RUNS):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attnkit.attention(*leaves, mask=spec, backend="blocked")
        out.backward(dout)
        results.append([out.detach(), *(t.grad for t in leaves)])
    return results


def _distinct(results: list[list[torch.Tensor]]) -> dict[str, int]:
    """How many different bit patterns each of out, dq, dk, dv took over the runs."""
    names = ("out", "dq", "dk", "dv")
    return {
        n: len({r[i].view(-1).view(torch.uint8).numpy().tobytes() for r in results})
        for i, n in enumerate(names)
    }


def _spans() -> dict[str, MaskSpec]:
    ids = torch.arange(L) // 300
    keys = (torch.arange(L) % 7 != 3)[None]
    return {
        "causal": masks.causal(),
        "causal & sliding_window(256)": masks.causal() & masks.sliding_window(256),
        "document & causal": masks.document(ids) & masks.causal(),
        "key_mask with holes & causal": masks.key_mask(keys) & masks.causal(),
        "prefix_lm(100)": masks.prefix_lm(100),
    }


@pytest.mark.usefixtures("deterministic_two_threads")
@pytest.mark.parametrize("name", list(_spans()))
def test_the_row_span_kernel_repeats_its_bits(name: str) -> None:
    spec = _spans()[name]
    q, k, v, _ = _inputs(torch.float32)
    note = attnkit.explain(q, k, v, mask=spec, backend="blocked").notes["blocked"]
    assert "row-span kernel" in note
    assert "torch's fused kernel" not in note
    results = _runs(spec, torch.float32)
    assert _distinct(results) == {"out": 1, "dq": 1, "dk": 1, "dv": 1}
    # and they are the right bits: the float64 oracle
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    want, _ = reference_attention(*leaves, mask=spec.to_dense(L, L))
    want.backward(_inputs(torch.float32)[3].double())
    for got, ref in zip(results[0], (want.detach(), *(t.grad for t in leaves)), strict=True):
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.usefixtures("deterministic_two_threads")
@pytest.mark.parametrize("Hkv", [1, 2])
def test_the_kernel_reading_bfloat16_repeats_its_bits(Hkv: int) -> None:
    """bfloat16 on the fp32-upcast CPU path: the kernel reads it directly, sums dk/dv in
    float32 per stripe of keys and converts each stripe once all its sums are in."""
    spec = masks.causal() & masks.sliding_window(300)
    if not rowspan_builds.available():
        pytest.skip(rowspan_builds.status())
    results = _runs(spec, torch.bfloat16, Hkv)
    assert _distinct(results) == {"out": 1, "dq": 1, "dk": 1, "dv": 1}


@pytest.mark.usefixtures("deterministic_two_threads")
@pytest.mark.parametrize(
    ("spec", "dtype"),
    [
        (
            masks.causal() & (masks.sliding_window(128) | masks.padding(torch.tensor([64]))),
            torch.float32,
        ),
        (
            masks.causal() & (masks.sliding_window(128) | masks.padding(torch.tensor([64]))),
            torch.bfloat16,
        ),
        (masks.causal() & masks.sliding_window(256), torch.float64),
    ],
    ids=["not one run per row", "not one run per row, bfloat16", "float64"],
)
def test_the_tile_path_repeats_its_bits(spec: MaskSpec, dtype: torch.dtype) -> None:
    q, k, v, _ = _inputs(dtype)
    note = attnkit.explain(q, k, v, mask=spec, backend="blocked").notes["blocked"]
    assert "kernel calls" in note  # tiles, not the row-span kernel
    assert _distinct(_runs(spec, dtype)) == {"out": 1, "dq": 1, "dk": 1, "dv": 1}


def test_the_fixture_restores_the_global_state(deterministic_two_threads: None) -> None:
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.get_num_threads() == 2
