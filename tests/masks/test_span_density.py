"""The block map of runs of keys (:func:`attnkit.masks.spans.span_density`), what
``attnkit.explain`` says of a function mask on the row-span kernel: equal to the block map
counted on the dense mask (small sizes, test-side only), and the explain line that shows it.

Dimension legend: B batch, H heads, L query length, S key length, D head size.
"""

from __future__ import annotations

import re

import pytest
import torch

import attnkit
from attnkit.masks import causal, document, from_function, key_mask, row_spans, sliding_window
from attnkit.masks.spans import span_density


def _counted(allowed: torch.Tensor, g: int) -> tuple[float, float, float]:
    """(empty, full, pairs) fractions of ``g x g`` blocks, counted on a dense ``(B', L, S)``."""
    Bm, L, S = allowed.shape
    nq, nk = -(-L // g), -(-S // g)
    empty = full = 0
    for b in range(Bm):
        for i in range(nq):
            for j in range(nk):
                block = allowed[b, i * g : (i + 1) * g, j * g : (j + 1) * g]
                empty += int(not bool(block.any()))
                full += int(bool(block.all()))
    blocks = Bm * nq * nk
    return empty / blocks, full / blocks, float(allowed.sum()) / allowed.numel()


KEEP = torch.arange(70)[None] >= torch.tensor([5, 0])[:, None]  # left padding, (2, 70)
SPECS = {
    "window": (causal() & sliding_window(9), 50, 70),
    "window, L == S": (causal() & sliding_window(16), 64, 64),
    "documents": (causal() & document(torch.arange(70) // 23), 70, 70),
    "window, left padding": (causal() & sliding_window(12) & key_mask(KEEP), 60, 70),
    "causal": (causal(), 40, 40),
}


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("g", [8, 16])
def test_span_density_is_the_block_map_of_the_dense_mask(name: str, g: int) -> None:
    spec, L, S = SPECS[name]
    spans = row_spans(spec, L, S)
    assert spans is not None
    got = span_density(*spans, S, g)
    empty, full, pairs = _counted(spec.to_dense(L, S)[:, 0].expand(spans[0].shape[0], L, S), g)
    assert got.grain == g
    assert got.empty == pytest.approx(empty)
    assert got.full == pytest.approx(full)
    assert got.pairs == pytest.approx(pairs)


def test_explain_shows_a_function_masks_block_map_on_the_row_span_kernel() -> None:
    L = S = 1024
    spec = from_function(lambda b, h, q, kv: (kv <= q) & (q - kv < 64))
    q, k, v = (torch.randn(1, 2, L, 16) for _ in range(3))
    text = str(attnkit.explain(q, k, v, mask=spec, backend="blocked"))
    line = next(x for x in text.splitlines() if "row spans of from_function(" in x)
    # window 64 at grain 32: per block row one full block and two partial ones
    found = re.search(
        r"its runs leave ([\d.]+)% of 32x32 blocks empty \(([\d.]+)% partial, ([\d.]+)% full\); "
        r"computes ([\d.]+)% of the L x S pairs",
        line,
    )
    assert found is not None, line
    empty, partial, full, pairs = (float(x) for x in found.groups())
    assert (empty, partial, full) == (90.9, 6.1, 3.0)
    assert pairs == pytest.approx(100 * (64 * L - 64 * 63 / 2) / (L * S), abs=0.05)


def test_explain_of_a_built_in_rule_on_the_row_span_kernel_is_unchanged() -> None:
    q, k, v = (torch.randn(1, 2, 256, 16) for _ in range(3))
    text = str(attnkit.explain(q, k, v, mask=causal() & sliding_window(32), backend="blocked"))
    assert "causal sliding window 32: forward and backward run" in text
    assert "its runs leave" not in text
