"""attnkit.trace(): every step of attention calls and modules, with named dims."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import attnkit
from attnkit.inspect import tracing as trace_module


def _steps(t: attnkit.Trace) -> list[tuple[str, str, str]]:
    return [(s.step, s.tensor, s.named_shape) for s in t.steps]


def test_self_attention_module_records_every_step_in_order() -> None:
    mha = attnkit.MultiHeadAttention(512, 8)
    with attnkit.trace() as t:
        mha(torch.randn(2, 6, 512))
    assert _steps(t) == [
        ("input", "query", "(B=2, L=6, E=512)"),
        ("input", "key", "(B=2, S=6, Ek=512)"),
        ("input", "value", "(B=2, S=6, Ev=512)"),
        ("q_proj", "q", "(B=2, L=6, H*Dk=512)"),
        ("k_proj", "k", "(B=2, S=6, Hkv*Dk=512)"),
        ("v_proj", "v", "(B=2, S=6, Hkv*Dv=512)"),
        ("split_heads", "q", "(B=2, H=8, L=6, Dk=64)"),
        ("split_heads", "k", "(B=2, Hkv=8, S=6, Dk=64)"),
        ("split_heads", "v", "(B=2, Hkv=8, S=6, Dv=64)"),
        ("attention", "q", "(B=2, H=8, L=6, Dk=64)"),
        ("attention", "k", "(B=2, Hkv=8, S=6, Dk=64)"),
        ("attention", "v", "(B=2, Hkv=8, S=6, Dv=64)"),
        ("scores", "q @ k^T * scale", "(B=2, H=8, L=6, S=6)"),
        ("weights", "softmax(scores)", "(B=2, H=8, L=6, S=6)"),
        ("output", "weights @ v", "(B=2, H=8, L=6, Dv=64)"),
        ("merge_heads", "out", "(B=2, L=6, H*Dv=512)"),
        ("out_proj", "out", "(B=2, L=6, E=512)"),
    ]
    assert {s.call for s in t.steps} == {1}
    assert t.backends == ["sdpa"]
    scores = next(s for s in t.steps if s.step == "scores")
    assert "never materialised" in scores.note


def test_cross_attention_records_both_lengths_and_widths() -> None:
    xattn = attnkit.CrossAttention(16, 2, context_dim=32, head_dim=24, v_head_dim=28)
    with attnkit.trace() as t:
        xattn(torch.randn(1, 6, 16), torch.randn(1, 8, 32))
    shapes = dict(((s.step, s.tensor), s.named_shape) for s in t.steps)
    assert shapes[("input", "key")] == "(B=1, S=8, Ek=32)"
    assert shapes[("scores", "q @ k^T * scale")] == "(B=1, H=2, L=6, S=8)"
    assert shapes[("output", "weights @ v")] == "(B=1, H=2, L=6, Dv=28)"
    assert shapes[("out_proj", "out")] == "(B=1, L=6, E=16)"
    assert t.backends == ["math"]  # Dv != Dk: no fused kernel
    assert "never materialised" not in str(t)


def test_grouped_query_records_kv_heads() -> None:
    mha = attnkit.MultiHeadAttention(64, 8, num_kv_heads=2)
    with attnkit.trace() as t:
        mha(torch.randn(3, 5, 64), need_weights=True)
    shapes = dict(((s.step, s.tensor), s.named_shape) for s in t.steps)
    assert shapes[("k_proj", "k")] == "(B=3, S=5, Hkv*Dk=16)"
    assert shapes[("split_heads", "k")] == "(B=3, Hkv=2, S=5, Dk=8)"
    assert shapes[("split_heads", "q")] == "(B=3, H=8, L=5, Dk=8)"
    assert t.backends == ["math"]  # weights asked for


def test_plain_attention_calls_are_numbered_and_rendered() -> None:
    q = torch.randn(1, 2, 3, 4)
    with attnkit.trace() as t:
        attnkit.attention(q, q, q)
        attnkit.attention(q, q, q, return_weights=True)
    assert [s.call for s in t.steps if s.step == "output"] == [1, 2]
    table = t.render(call=2)
    assert table.splitlines()[0].split() == [
        "#",
        "where",
        "step",
        "tensor",
        "shape",
        "(named",
        "dims)",
        "note",
    ]
    assert "backend=math" in table
    assert "backend=sdpa" not in table
    assert "backend=sdpa" in str(t)


def test_model_names_its_modules() -> None:
    model = nn.Sequential(attnkit.SelfAttention(8, 4))
    with attnkit.trace(model) as t:
        model(torch.randn(1, 3, 8))
    assert {s.where for s in t.steps} == {"0", "attention"}
    assert "out_proj" not in [s.step for s in t.steps]  # SelfAttention has no projection


def test_nothing_is_recorded_outside_a_trace() -> None:
    mha = attnkit.MultiHeadAttention(16, 4)
    with attnkit.trace() as t:
        pass
    mha(torch.randn(1, 2, 16))
    assert t.steps == []
    assert trace_module.active_trace() is None
    assert trace_module._ACTIVE == []


def test_trace_is_closed_when_the_block_raises() -> None:
    try:
        with attnkit.trace():
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert trace_module._ACTIVE == []


def test_a_seq_first_module_records_the_tensors_as_passed_and_returned() -> None:
    """nn.MultiheadAttention's (L, B, E) layout (seed 002): the trace shows the tensors the
    caller passed and got back, and where the module turns them batch-first and back. L == B
    here, so only the names tell the layouts apart."""
    mha = attnkit.MultiHeadAttention(16, 4, batch_first=False)
    with attnkit.trace() as t:
        y = mha(torch.randn(3, 3, 16), torch.randn(7, 3, 16), torch.randn(7, 3, 16)).output
    assert y.shape == (3, 3, 16)
    steps = _steps(t)
    assert steps[:3] == [
        ("input", "query", "(L=3, B=3, E=16)"),
        ("input", "key", "(S=7, B=3, Ek=16)"),
        ("input", "value", "(S=7, B=3, Ev=16)"),
    ]
    assert steps[3] == ("q_proj", "q", "(B=3, L=3, H*Dk=16)")
    assert steps[-2:] == [
        ("out_proj", "out", "(B=3, L=3, E=16)"),
        ("transpose(0, 1)", "out", "(L=3, B=3, E=16)"),
    ]


def test_a_module_call_that_raises_leaves_no_call_open() -> None:
    """A later plain attention() call is numbered as its own call, not as the failed
    module's."""
    mha = attnkit.MultiHeadAttention(16, 4, backend="sdpa")
    x = torch.randn(1, 5, 16)
    with attnkit.trace() as t:
        # raised inside the attention call, after the module's first steps were recorded
        with pytest.raises(attnkit.AttentionInputError, match="backend 'sdpa' cannot serve"):
            mha(x, need_weights=True)
        q = torch.randn(1, 2, 3, 4)
        attnkit.attention(q, q, q)
    assert t.current is None
    plain = [s for s in t.steps if s.where == "attention"]
    assert plain
    assert {s.call for s in plain} == {2}
