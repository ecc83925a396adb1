"""attnkit.trace(): every step of attention calls and modules, with named dims."""

from __future__ import annotations

import asyncio
import contextvars
import threading

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
    assert t.backends == ["math"]  # Dv != Dk: no fused kernel; the decode kernel: no autograd
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
    assert trace_module._ACTIVE.get() == ()


def test_trace_is_closed_when_the_block_raises() -> None:
    try:
        with attnkit.trace():
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert trace_module._ACTIVE.get() == ()


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


# Whose calls a trace records (attnkit issue 22, item 11): the calling thread's and its
# asyncio tasks', never another thread's.


def _attend(n: int) -> None:
    q = torch.randn(1, 2, 3, 4)
    for _ in range(n):
        attnkit.attention(q, q, q)


def test_a_trace_records_only_its_own_threads_calls_while_8_threads_attend() -> None:
    """The main thread traces 3 calls while 8 threads attend (those in even threads inside
    traces of their own, opened at the same time): every trace holds exactly its own
    thread's calls, and a module call's attention step joins its own module call."""
    n_threads = 8
    opened = threading.Barrier(n_threads + 1)  # every thread's trace (if any) is open
    done = threading.Barrier(n_threads + 1)  # every thread made all its calls
    traces: dict[int, attnkit.Trace] = {}
    errors: list[BaseException] = []
    mha = attnkit.MultiHeadAttention(8, 2)

    def work(i: int) -> None:
        try:
            if i % 2 == 0:
                with attnkit.trace() as t:
                    traces[i] = t
                    opened.wait()
                    _attend(i + 1)
                    mha(torch.randn(1, 3, 8))
                    done.wait()
            else:
                opened.wait()
                _attend(5)
                mha(torch.randn(1, 3, 8))
                done.wait()
        except BaseException as e:  # reported by the main thread
            errors.append(e)
            opened.abort()
            done.abort()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    with attnkit.trace() as main:
        for th in threads:
            th.start()
        opened.wait()
        _attend(3)
        done.wait()
    for th in threads:
        th.join()
    assert errors == []
    assert main.backends == ["sdpa"] * 3
    assert len(main.steps) == 3 * 6
    assert [s.call for s in main.steps if s.step == "output"] == [1, 2, 3]
    for i, t in traces.items():
        plain, module = i + 1, i + 2  # the thread's plain calls, then its module call
        assert t.backends == ["sdpa"] * module
        assert len(t.steps) == plain * 6 + 17
        assert [s.call for s in t.steps] == [c for c in range(1, plain + 1) for _ in range(6)] + [
            module
        ] * 17


def test_a_thread_started_inside_a_trace_is_not_recorded_unless_it_runs_in_its_context() -> None:
    """Python threads start in an empty context: their calls are not the trace's. Work run in
    a copy of the tracing context (contextvars.copy_context().run, as asyncio.to_thread
    does) is recorded."""
    with attnkit.trace() as t:
        _attend(1)
        plain = threading.Thread(target=_attend, args=(4,))
        plain.start()
        plain.join()
        assert t.backends == ["sdpa"]
        ctx = contextvars.copy_context()
        copied = threading.Thread(target=ctx.run, args=(_attend, 2))
        copied.start()
        copied.join()
    assert [s.call for s in t.steps if s.step == "output"] == [1, 2, 3]


def test_nested_traces_each_record_every_call_inside_their_block() -> None:
    """A call inside both blocks is in both, numbered in each; the inner trace holds only the
    calls inside its block, the outer every call inside its own."""
    mha = attnkit.MultiHeadAttention(8, 2)
    with attnkit.trace() as outer:
        _attend(1)
        with attnkit.trace() as inner:
            mha(torch.randn(1, 3, 8))
            _attend(1)
        _attend(1)
    assert outer.backends == ["sdpa"] * 4
    assert inner.backends == ["sdpa"] * 2
    assert [s.call for s in inner.steps] == [1] * 17 + [2] * 6
    assert [s.call for s in outer.steps] == [1] * 6 + [2] * 17 + [3] * 6 + [4] * 6
    assert [s.step for s in outer.steps[6:29]] == [s.step for s in inner.steps]
    assert trace_module._ACTIVE.get() == ()


def test_asyncio_tasks_record_into_the_trace_of_the_task_that_opened_it() -> None:
    """Two tasks trace at once, their calls interleaved by awaits: each trace holds its own
    task's calls; a task created inside a trace records into it."""

    async def traced(n: int) -> attnkit.Trace:
        with attnkit.trace() as t:
            for _ in range(n):
                _attend(1)
                await asyncio.sleep(0)
        return t

    async def main() -> tuple[attnkit.Trace, attnkit.Trace, attnkit.Trace]:
        with attnkit.trace() as outer:
            a, b = await asyncio.gather(traced(2), traced(5))
            await asyncio.create_task(asyncio.sleep(0))
            await asyncio.get_running_loop().create_task(_async_attend())
        return outer, a, b

    outer, a, b = asyncio.run(main())
    assert len(a.backends) == 2
    assert len(b.backends) == 5
    assert len(outer.backends) == 2 + 5 + 1


async def _async_attend() -> None:
    _attend(1)


def test_a_compiled_call_records_into_the_trace_of_the_thread_that_runs_it() -> None:
    """Under torch.compile(fullgraph=True), forward and backward: while a trace is open the
    graph holds the recorders as ordered side-effect ops, which record at run time into the
    traces of the thread that runs the graph (the same steps as eager mode; another thread's
    calls stay out); once no trace is open the graph without them runs again."""
    model = _Chain(
        nn.Sequential(
            attnkit.MultiHeadAttention(8, 2, causal=True), attnkit.MultiHeadAttention(8, 2)
        )
    )
    x = torch.randn(1, 3, 8, requires_grad=True)
    with attnkit.trace(model) as eager:
        model(x)
    ran: list[bool] = []  # per graph run: whether the graph holds the recorders

    def backend(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> object:
        records = "trace_attention" in gm.code

        def run(*args: torch.Tensor) -> object:
            ran.append(records)
            return gm(*args)

        return run

    compiled = torch.compile(model, fullgraph=True, backend=backend)
    compiled(x)  # no trace open: compiled without the recorders
    with attnkit.trace(model) as t:
        compiled(x).sum().backward()
        other = threading.Thread(target=compiled, args=(x,))
        other.start()
        other.join()
    compiled(x)
    assert _steps(t) == _steps(eager)
    assert [s.where for s in t.steps] == [s.where for s in eager.steps]
    assert {s.where for s in t.steps} == {"layers.0", "layers.1", "attention"}
    assert t.backends == ["sdpa", "sdpa"]
    assert ran == [False, True, True, False]


class _Chain(nn.Module):
    def __init__(self, layers: nn.Sequential) -> None:
        super().__init__()
        self.layers = layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x).output
        return x
