"""The backend registry: adding a backend is one class in one file, and auto's order is an
explicit priority."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit
from attnkit import AttentionCall, AttentionInputError, attention, explain
from attnkit.backends import (
    AUTO_ORDER,
    Backend,
    Decision,
    get_backend,
    register_backend,
    unregister_backend,
)
from oracle import reference_attention


class Float64Reference(Backend):
    """A toy backend, as the registry's docstring shows: float64 math, no weights."""

    name = "test-float64"
    description = "float64 matmul, softmax, matmul (a test backend)"
    priority = None

    def __init__(self) -> None:
        self.calls: list[AttentionCall] = []
        self.decided: list[AttentionCall] = []

    def decide(self, call: AttentionCall) -> Decision:
        self.decided.append(call)
        if call.return_weights:
            return Decision(self.name, reason="no weights here")
        return Decision(self.name)

    def run(self, call: AttentionCall, plan: None) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.calls.append(call)
        mask = call.dense_mask()
        q, k, v = (t.double() for t in (call.q, call.k, call.v))
        G = call.dims.H // call.dims.Hkv
        k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
        s = q @ k.transpose(-1, -2) * call.scale
        if mask is not None:
            s = s.masked_fill(~mask, -torch.inf) if mask.dtype == torch.bool else s + mask
        w = torch.nan_to_num(s.softmax(-1), nan=0.0)
        return (w @ v).to(call.q.dtype), None


def _qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return (
        torch.randn(2, 4, 5, 8, generator=gen),
        torch.randn(2, 2, 7, 8, generator=gen),
        torch.randn(2, 2, 7, 8, generator=gen),
    )


def test_a_toy_backend_registers_in_one_class() -> None:
    toy = register_backend(Float64Reference())
    try:
        q, k, v = _qkv()
        mask = torch.rand(5, 7) > 0.3
        got = attention(q, k, v, mask=mask, causal=True, backend="test-float64")
        want = reference_attention(q, k, v, mask=mask, causal=True)[0]
        assert torch.allclose(got.double(), want, atol=1e-6)
        assert isinstance(toy, Float64Reference)
        assert len(toy.calls) == 1
        assert toy.decided == toy.calls  # asked once, for the call it ran
        call = toy.calls[0]
        assert (call.dims.L, call.dims.S, call.scale) == (5, 7, 1 / math.sqrt(8))
        assert explain(q, k, v).chosen != "test-float64"  # priority None: only when named
        assert "test-float64: can serve, but auto uses it only when named" in str(explain(q, k, v))
        with pytest.raises(AttentionInputError, match="cannot serve this call: no weights here"):
            attention(q, k, v, backend="test-float64", return_weights=True)
        with pytest.raises(ValueError, match="already registered"):
            register_backend(Float64Reference())
    finally:
        unregister_backend("test-float64")
    assert "test-float64" not in attnkit.available_backends()


def test_auto_order_is_the_priority_not_the_registration_order() -> None:
    assert AUTO_ORDER == ["blocked", "sdpa", "math"]

    class First(Float64Reference):
        name = "test-first"
        priority = 1000

    register_backend(First())
    try:
        assert AUTO_ORDER[0] == "test-first"
        q, k, v = _qkv()
        assert explain(q, k, v).chosen == "test-first"
        assert isinstance(get_backend("test-first"), First)
    finally:
        unregister_backend("test-first")
    assert AUTO_ORDER == ["blocked", "sdpa", "math"]


def test_register_backend_takes_instances_only() -> None:
    with pytest.raises(TypeError, match="takes a Backend instance"):
        register_backend(Float64Reference)  # type: ignore[arg-type]


def test_a_backend_with_the_hooks_decide_replaced_is_refused() -> None:
    """A backend written against check/rule/note/dense_allocation would have its refusals
    ignored (attnkit asks decide alone): register_backend says so instead."""

    class OldStyle(Backend):
        name = "test-old-style"

        def check(self, call: AttentionCall) -> str | None:
            return "never"

        def run(self, call: AttentionCall, plan: None) -> tuple[torch.Tensor, None]:
            raise AssertionError("a backend whose check refuses everything ran")

    with pytest.raises(TypeError, match=r"defines check: attnkit asks a backend one question"):
        register_backend(OldStyle())

    class NoPlan(Backend):
        name = "test-no-plan"

        def run(self, call: AttentionCall) -> tuple[torch.Tensor, None]:  # type: ignore[override]
            raise AssertionError("unreachable")

    with pytest.raises(TypeError, match=r"run takes \(call, plan\)"):
        register_backend(NoPlan())
    assert "test-old-style" not in attnkit.available_backends()
    assert "test-no-plan" not in attnkit.available_backends()


def test_a_toy_rule_memory_and_note_reach_auto_and_explain() -> None:
    """A decision's rule, memory and note: auto reads the rule, the dispatcher holds the memory
    to the limit, explain prints the note; decide is asked once per call."""

    class Ruled(Float64Reference):
        name = "test-ruled"
        priority = 1000

        def decide(self, call: AttentionCall) -> Decision:
            self.decided.append(call)
            fires = call.dims.L > 4
            memory = (call.dims.L * 2**20, "a toy buffer per query")
            note = "a toy note" if call.explaining else None
            rule = (fires, "more than 4 queries" if fires else "4 queries or fewer")
            return Decision(self.name, rule=rule, memory=memory, note=note)

    toy = register_backend(Ruled())
    try:
        q, k, v = _qkv()  # L = 5
        e = explain(q, k, v)
        assert e.chosen == "test-ruled"
        text = str(e)
        assert "auto's rule: more than 4 queries" in text
        assert "test-ruled: a toy note" in text
        e = explain(q[:, :, :4], k, v)
        assert e.chosen == "blocked"  # the next in auto's order (its decode kernel, L = 4)
        assert "test-ruled: can serve, but its auto rule does not fire: 4 queries or fewer" in (
            str(e)
        )
        toy.decided.clear()
        attention(q, k, v)
        assert len(toy.decided) == len(toy.calls) == 1
        previous = attnkit.set_memory_limit(4 * 2**20)  # its 5 MiB are above the limit
        try:
            e = explain(q, k, v)
            assert e.chosen == "blocked"  # the next whose rule fires (its decode kernel, L = 5)
            assert e.verdicts["test-ruled"] == (
                "a toy buffer per query would take 0.00488 GiB (5,242,880 bytes), above "
                "attnkit's memory limit of 0.00391 GiB (4,194,304 bytes)"
            )
            with pytest.raises(attnkit.AttentionMemoryError, match="a toy buffer per query"):
                attention(q, k, v, backend="test-ruled")
        finally:
            attnkit.set_memory_limit(previous)
    finally:
        unregister_backend("test-ruled")
