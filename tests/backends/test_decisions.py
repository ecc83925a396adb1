"""One decision per backend and call: the dispatcher, the run and ``explain`` ask each backend
once (``decide``), and a call is planned once.

A counter wraps every registered backend's ``decide`` and the planning functions (the row-span
decision :func:`attnkit.backends.blocked.rowspan.plan`, the tile planner
:func:`attnkit.backends.blocked.plan.make_plan`, flex's block-mask building). Before the
decisions, ``blocked`` planned a plain causal call twice per ``attention`` (its auto rule and its
run) and four times per ``explain``, and ``explain`` asked ``blocked`` for its rule three times.

Dimension legend: B batch, H query heads, L query length, S key length, D head dim.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

import attnkit
from attnkit import masks
from attnkit.backends import available_backends, choose, flex, get_backend
from attnkit.backends.blocked import blocks, rowspan
from calls import make_call

WINDOW = masks.causal() & masks.sliding_window(256)


@dataclass
class Counts:
    planning: Counter[str] = field(default_factory=Counter)
    asked: Counter[str] = field(default_factory=Counter)

    def clear(self) -> None:
        self.planning.clear()
        self.asked.clear()
        blocks.clear_plans()  # the tile plans are cached: count a fresh call's planning


@pytest.fixture
def counts(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counts]:
    found = Counts()

    def counting(fn: Callable[..., Any], into: Counter[str], label: str) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            into[label] += 1
            return fn(*args, **kwargs)

        return counted

    for module, name in ((rowspan, "plan"), (blocks, "make_plan"), (flex, "_block_mask")):
        fn = getattr(module, name)
        monkeypatch.setattr(module, name, counting(fn, found.planning, name))
    for name in available_backends():
        backend = get_backend(name)
        monkeypatch.setattr(backend, "decide", counting(backend.decide, found.asked, name))
    found.clear()
    yield found
    blocks.clear_plans()


def _qkv(L: int, S: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    S = L if S is None else S
    q = torch.randn(1, 4, L, 64, generator=g)
    k = torch.randn(1, 4, S, 64, generator=g)
    return q, k, torch.randn(1, 4, S, 64, generator=g)


def _everyone_once() -> dict[str, int]:
    return dict.fromkeys(available_backends(), 1)


def test_the_window_walk_plans_once_and_asks_blocked_alone(counts: Counts) -> None:
    """The issue's walk: auto takes blocked at B=1, H=4, L=S=2048, D=64 and stops there."""
    q, k, v = _qkv(2048)
    out = attnkit.attention(q, k, v, mask=WINDOW)
    assert counts.planning == {"plan": 1}  # the row-span kernel runs it: no tiles
    assert counts.asked == {"blocked": 1}  # the first in auto's order wins: no one else asked
    counts.clear()
    assert attnkit.explain(q, k, v, mask=WINDOW).chosen == "blocked"
    assert counts.planning == {"plan": 1}
    assert counts.asked == _everyone_once()
    counts.clear()
    ref = attnkit.attention(q, k, v, mask=WINDOW, backend="math")
    assert counts.planning == {}
    assert counts.asked == {"math": 1}
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_a_small_window_call_asks_blocked_then_sdpa_and_plans_nothing(counts: Counts) -> None:
    q, k, v = _qkv(64)
    attnkit.attention(q, k, v, mask=WINDOW)
    assert counts.planning == {}  # blocked's rule does not fire: no plan made for it
    assert counts.asked == {"blocked": 1, "sdpa": 1}
    counts.clear()
    assert attnkit.explain(q, k, v, mask=WINDOW).chosen == "sdpa"
    assert counts.planning == {"plan": 1}  # blocked's note shows its plan
    assert counts.asked == _everyone_once()
    counts.clear()
    attnkit.attention(q, k, v, mask=WINDOW, backend="blocked")  # named: it plans when it runs
    assert counts.planning == {"plan": 1}
    assert counts.asked == {"blocked": 1}


def test_a_plain_causal_call_is_planned_once_for_rule_and_run(counts: Counts) -> None:
    """auto's rule asks whether the row-span kernel runs it: the run takes that plan."""
    q, k, v = _qkv(2048)
    attnkit.attention(q, k, v, causal=True)
    assert counts.planning == {"plan": 1}
    assert counts.asked == {"blocked": 1}
    counts.clear()
    assert attnkit.explain(q, k, v, causal=True).chosen == "blocked"
    assert counts.planning == {"plan": 1}
    assert counts.asked == _everyone_once()


def test_training_plans_once_for_forward_and_backward(counts: Counts) -> None:
    q, k, v = (t.requires_grad_(True) for t in _qkv(2048))
    attnkit.attention(q, k, v, mask=WINDOW).sum().backward()
    assert counts.planning == {"plan": 1}
    assert counts.asked == {"blocked": 1}


def test_the_tiles_walk_plans_its_spans_and_tiles_once(counts: Counts) -> None:
    q, k, v = _qkv(2048)
    spec = ~masks.sliding_window(64)  # not one run of keys per row: tiles
    attnkit.attention(q, k, v, mask=spec)
    assert counts.planning == {"plan": 1, "make_plan": 1}
    assert counts.asked == {"blocked": 1}
    counts.clear()
    attnkit.explain(q, k, v, mask=spec)
    assert counts.planning == {"plan": 1, "make_plan": 1}
    assert counts.asked == _everyone_once()


def test_auto_past_the_memory_limit_asks_each_backend_once(counts: Counts) -> None:
    """causal with L != S under a small limit: blocked's rule does not fire, sdpa and math are
    above the limit, so auto goes back to blocked: its decision, not a second one."""
    q, k, v = _qkv(1000, 1024)
    previous = attnkit.set_memory_limit(2**19)
    try:
        e = attnkit.explain(q, k, v, causal=True)
        assert e.chosen == "blocked"
        assert "the backends whose rule fires would allocate" in e.rule
        assert counts.asked == _everyone_once()
        counts.clear()
        attnkit.attention(q, k, v, causal=True)
        assert counts.asked == {"blocked": 1, "sdpa": 1, "math": 1}
        assert counts.planning == {"plan": 1}
    finally:
        attnkit.set_memory_limit(previous)


def test_the_choice_holds_the_decisions_explain_prints(counts: Counts) -> None:
    q, k, v = _qkv(2048)
    call = make_call(q, k, v, WINDOW, False, None, 0.0, where="test")
    choice = choose(call, "auto", "test")
    assert choice.name == "blocked"
    assert list(choice.decisions) == ["blocked"]
    assert choice.decision.plan is not None  # the plan the run is handed
    assert choice.decision.plan.spans.serves
    assert choice.why.startswith("a mask spec and L x S >=")
    again = choose(call, "auto", "test", every=True)  # the same call: decisions kept with it
    assert again.decisions["blocked"] is choice.decision
    assert list(again.decisions) == [
        "blocked",
        *[n for n in available_backends() if n != "blocked"],
    ]
    assert counts.asked == _everyone_once()
    assert counts.planning == {"plan": 1}
