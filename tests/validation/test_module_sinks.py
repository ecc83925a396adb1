"""Attention sinks the modules refuse: a constructor ``sinks`` that is not a flag, per-call sinks
of another shape, dtype or device, per-call sinks on a module with learned ones, sinks with a
KV cache that would be refused after the cache was written, and ``to_torch`` of a module with
sinks. Each error is read: the module's name, the argument, the shapes with their dimension
names, what was expected and the fix.

Dimension legend: B batch, L query length, E model width, H query heads.
"""

from __future__ import annotations

import pytest
import torch

from attnkit import AttentionInputError, KVCache, MultiHeadAttention
from attnkit.modules import CrossAttention, SelfAttention

B, L, E, H = 2, 5, 16, 4
WHERE = "attnkit.MultiHeadAttention"
EXPECTED = "sinks (H=4,) or (B=2, H=4, L=5) or (1, H=4, L=5), of dtype torch.float32 on cpu"


def _raised(m: torch.nn.Module, *args: object, **kwargs: object) -> AttentionInputError:
    with pytest.raises(AttentionInputError) as info:
        m(*args, **kwargs)
    return info.value


@pytest.mark.parametrize(
    ("shape", "got", "fix"),
    [
        ((H + 1,), "sinks (H=5)  q (B=2, H=4, L=5)", "nn.Parameter(torch.zeros(H))"),
        ((B, L, H), "sinks (B=2, H=5, L=4)  q (B=2, H=4, L=5)", "sinks.transpose(1, 2)"),
        ((B, H, L, 1), "sinks (4-D: 2, 4, 5, 1)  q (B=2, H=4, L=5)", "sinks.squeeze(-1)"),
        ((B, H, L + 1), "sinks (B=2, H=4, L=6)  q (B=2, H=4, L=5)", "(H=4,) for one sink"),
    ],
)
def test_per_call_sinks_of_another_shape_are_refused_in_the_modules_name(
    shape: tuple[int, ...], got: str, fix: str
) -> None:
    err = _raised(MultiHeadAttention(E, H), torch.randn(B, L, E), sinks=torch.zeros(shape))
    assert err.where == WHERE
    assert err.argument == "sinks"
    assert err.got == got
    assert err.expected == EXPECTED
    assert err.fix is not None
    assert fix in err.fix
    assert f"`sinks` has shape {shape}" in err.problem


def test_per_call_sinks_of_another_dtype_or_device_are_never_cast() -> None:
    m = MultiHeadAttention(E, H)
    x = torch.randn(B, L, E)
    err = _raised(m, x, sinks=torch.zeros(H, dtype=torch.float64))
    assert err.argument == "sinks"
    assert err.got == "sinks torch.float64 on cpu, q torch.float32 on cpu"
    assert "attnkit never casts" in err.problem
    assert err.fix == "sinks.to(dtype=torch.float32, device='cpu')"
    err = _raised(m, x, sinks=torch.zeros(H, device="meta"))
    assert err.got == "sinks torch.float32 on meta, q torch.float32 on cpu"
    err = _raised(m, x, sinks=torch.zeros(H, dtype=torch.int64))
    assert err.argument == "sinks"
    assert "torch.int64" in err.got
    err = _raised(m, x, sinks=[0.0] * H)
    assert err.problem == "`sinks` is not a tensor."
    assert err.got == "sinks: list"


def test_sinks_of_both_kinds_are_refused() -> None:
    m = MultiHeadAttention(E, H, sinks=True)
    err = _raised(m, torch.randn(B, L, E), sinks=torch.zeros(H))
    assert err.where == WHERE
    assert err.argument == "sinks"
    assert "this module has learned sinks (built with sinks=True)" in err.problem
    assert err.got == "module.sinks (H=4,) and sinks= (4,)"
    assert err.expected == "sinks=None for a module with learned sinks"
    assert err.fix is not None
    assert "build the module with sinks=False" in err.fix


@pytest.mark.parametrize(
    ("make", "where"),
    [
        (lambda flag: MultiHeadAttention(E, H, sinks=flag), WHERE),
        (lambda flag: SelfAttention(E, 8, sinks=flag), "attnkit.SelfAttention"),
        (lambda flag: CrossAttention(E, H, sinks=flag), "attnkit.CrossAttention"),
    ],
)
def test_the_constructors_sinks_is_a_flag(make: object, where: str) -> None:
    with pytest.raises(AttentionInputError) as info:
        make(torch.zeros(H))  # type: ignore[operator]
    err = info.value
    assert err.where == where
    assert err.argument == "sinks"
    assert err.got == "sinks=tensor (4,)"
    assert err.expected == "sinks=True or sinks=False"
    assert err.fix is not None
    assert "module(x, sinks=...)" in err.fix


def test_bad_sinks_with_a_cache_leave_the_cache_unwritten() -> None:
    m = MultiHeadAttention(E, H, causal=True)
    cache = KVCache(B, H, 8, E // H)
    err = _raised(m, torch.randn(B, 3, E), kv_cache=cache, sinks=torch.zeros(B, H, 8))
    assert err.got == "sinks (B=2, H=4, L=8)  q (B=2, H=4, L=3)"
    assert cache.next_pos() == 0  # refused before the new keys were written


def test_a_module_with_sinks_has_no_torch_equivalent() -> None:
    with pytest.raises(AttentionInputError) as info:
        MultiHeadAttention(E, H, sinks=True).to_torch()
    assert "learned sinks (torch's module has no attention sinks)" in info.value.problem
    assert info.value.expected is not None
    assert "no sinks" in info.value.expected
