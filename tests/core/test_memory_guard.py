"""The size guard (issue 15, row 7): nothing that grows as L x S is allocated above attnkit's
memory limit; the error comes first, with the size in GiB and the way out, and ``auto`` takes a
backend that fits where one can serve.

Every test sets a small limit (a few MiB at most) with :func:`attnkit.set_memory_limit`, so
nothing large is ever allocated; a fixture restores the setting.

Dimension legend: B batch, H query heads, L query length, S key length, Dk head dim.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import attnkit
import attnkit.memory
from attnkit import AttentionInputError, AttentionMemoryError, masks
from attnkit.backends.math import MathBackend
from attnkit.masks import MaskSpec
from oracle import reference_attention

MiB = 2**20
SetLimit = Callable[[int | None], None]


@pytest.fixture
def set_limit() -> Iterator[SetLimit]:
    previous = attnkit.set_memory_limit(None)
    attnkit.set_memory_limit(previous)

    def set_(nbytes: int | None) -> None:
        attnkit.set_memory_limit(nbytes)

    yield set_
    attnkit.set_memory_limit(previous)


@pytest.fixture
def no_dense(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a mask spec is materialised or the math backend runs."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("an L x S tensor was about to be allocated")

    monkeypatch.setattr(MaskSpec, "to_dense", refuse)
    monkeypatch.setattr(MathBackend, "run", refuse)


def _parts(exc: AttentionMemoryError) -> tuple[str, str, str, str]:
    lines = str(exc).splitlines()
    assert lines[1].startswith("  got:      ")
    assert lines[2].startswith("  expected: ")
    assert lines[3].startswith("  fix:      ")
    return lines[0], lines[1], lines[2], lines[3]


def test_weights_above_the_limit_raise_before_anything_runs(
    set_limit: SetLimit, no_dense: None
) -> None:
    set_limit(MiB)
    q = torch.randn(1, 4, 1024, 16)  # scores (1, 4, 1024, 1024) float32: 16 MiB each
    with pytest.raises(AttentionMemoryError) as info:
        attnkit.attention(q, q, q, return_weights=True)
    exc = info.value
    assert isinstance(exc, AttentionInputError)
    assert exc.argument == "return_weights"
    assert exc.nbytes == 3 * 4 * 1024 * 1024 * 4
    assert exc.limit == MiB
    problem, got, expected, fix = _parts(exc)
    assert problem.startswith("attnkit.attention: the math backend's scores and weights ")
    assert "(B=1, H=4, L=1024, S=1024) in torch.float32" in problem
    assert "would take 0.0469 GiB (50,331,648 bytes)" in problem
    assert "memory limit of 0.000977 GiB (1,048,576 bytes); nothing was allocated" in problem
    assert "q (B=1, H=4, L=1024, Dk=16)  k (Hkv=4, S=1024)  torch.float32 on cpu" in got
    assert "(set by attnkit.set_memory_limit)" in expected
    assert "return_weights=False (need_weights=False in the modules" in fix
    assert "then the blocked backend runs it without L x S tensors" in fix
    assert "a smaller L" in fix
    with pytest.raises(AttentionMemoryError, match=r"^attnkit\.explain: the math backend"):
        attnkit.explain(q, q, q, return_weights=True)


def test_module_weights_above_the_limit(set_limit: SetLimit) -> None:
    mha = attnkit.MultiHeadAttention(16, 2)
    x = torch.randn(1, 1024, 16)
    set_limit(MiB)
    with pytest.raises(AttentionMemoryError, match="need_weights=False in the modules"):
        mha(x, need_weights=True)
    assert mha(x[:, :64], need_weights=True).weights is not None  # small calls still run


def test_a_spec_above_the_limit_goes_to_blocked(set_limit: SetLimit, no_dense: None) -> None:
    set_limit(MiB)
    q = torch.randn(1, 2, 1024, 8, dtype=torch.float64)
    spec = masks.causal() & masks.sliding_window(8)
    e = attnkit.explain(q, q, q, mask=spec)
    assert e.chosen == "blocked"
    for name in ("sdpa", "math"):
        reason = e.verdicts[name]
        assert reason is not None
        assert "above attnkit's memory limit of 0.000977 GiB" in reason
    assert "materialising the mask spec for torch's fused kernel would take" in str(
        e.verdicts["sdpa"]
    )
    out = attnkit.attention(q, q, q, mask=spec)
    dense = (torch.arange(1024)[:, None] - torch.arange(1024)[None, :]).clamp(min=-1) < 8
    dense &= torch.arange(1024)[:, None] >= torch.arange(1024)[None, :]
    assert torch.allclose(out, reference_attention(q, q, q, mask=dense)[0], atol=1e-10)


def test_auto_takes_a_backend_that_fits_even_where_its_rule_does_not_fire(
    set_limit: SetLimit,
) -> None:
    """causal with L != S: sdpa would materialise the (L, S) causal mask and math the scores;
    blocked's rule (specs only) does not fire, yet it serves the call within the limit."""
    q = torch.randn(1, 2, 1000, 8, dtype=torch.float64)
    k = torch.randn(1, 2, 1024, 8, dtype=torch.float64)
    want = reference_attention(q, k, k, causal=True)[0]
    set_limit(MiB // 2)  # the causal mask alone is 1,024,000 bytes
    e = attnkit.explain(q, k, k, causal=True)
    assert e.chosen == "blocked"
    assert e.rule == (
        "the backends whose rule fires would allocate L x S tensors above attnkit's memory "
        "limit; blocked is the first in auto's order that serves the call within it"
    )
    assert "auto's rule: the backends whose rule fires" in str(e)
    assert torch.allclose(attnkit.attention(q, k, k, causal=True), want, atol=1e-10)


def test_a_named_backend_above_the_limit_raises(set_limit: SetLimit, no_dense: None) -> None:
    set_limit(MiB)
    q = torch.randn(1, 2, 1024, 8)
    with pytest.raises(AttentionMemoryError) as info:
        attnkit.attention(q, q, q, mask=masks.sliding_window(8), backend="sdpa")
    problem, got, _, fix = _parts(info.value)
    assert "materialising the mask spec for torch's fused kernel would take" in problem
    assert "backend 'sdpa'  mask=sliding_window(8)" in got
    assert info.value.argument == "backend"
    assert fix.startswith("  fix:      backend='blocked' runs it without L x S tensors")
    with pytest.raises(AttentionMemoryError, match="the math backend's scores"):
        attnkit.attention(q, q, q, backend="math")


def test_dropout_with_a_spec_has_only_math(set_limit: SetLimit, no_dense: None) -> None:
    set_limit(MiB)
    q = torch.randn(1, 2, 1024, 8)
    with pytest.raises(AttentionMemoryError) as info:
        attnkit.attention(q, q, q, mask=masks.causal() & masks.sliding_window(8), dropout_p=0.1)
    problem, got, _, fix = _parts(info.value)
    assert "(about 3 such tensors at once) and the mask spec materialised" in problem
    assert "backend 'math'  mask=causal() & sliding_window(8)" in got
    assert "dropout_p=0.0: then the blocked backend runs it" in fix


def test_to_dense_refuses_above_the_limit(set_limit: SetLimit) -> None:
    set_limit(MiB)
    spec = masks.causal() & masks.sliding_window(8)
    assert spec.dense_bytes(2048, 2048) == 2048 * 2048 * 19  # bool mask + int64 arithmetic
    with pytest.raises(AttentionMemoryError) as info:
        spec.to_dense(2048, 2048)
    problem, got, _, fix = _parts(info.value)
    assert problem.startswith(
        "attnkit.masks.to_dense: materialising the mask spec causal() & sliding_window(8) as "
        "a (1, 1, 2048, 2048) bool tensor would take 0.0742 GiB"
    )
    assert "L=2048  S=2048  on cpu" in got
    assert "attention(..., backend='blocked')" in fix
    assert spec.to_dense(64, 64).shape == (1, 1, 64, 64)


def test_a_module_merging_a_spec_densely_refuses(set_limit: SetLimit) -> None:
    """A spec with a torch attn_mask is made dense inside the module: guarded there too."""
    mha = attnkit.MultiHeadAttention(8, 2)
    x = torch.randn(1, 1024, 8)
    set_limit(MiB)
    with pytest.raises(AttentionMemoryError, match=r"^attnkit\.masks\.to_dense: materialising"):
        mha(x, mask=masks.sliding_window(4), attn_mask=torch.zeros(1024, 1024))


def test_causal_flag_with_a_key_mask_stays_a_spec(set_limit: SetLimit) -> None:
    """causal=True merges the causal rule into a mask tensor; where the merged (L, S) tensor
    is above the limit, the two stay apart and blocked runs them block by block."""
    q = torch.randn(2, 2, 1024, 8, dtype=torch.float64)
    keep = torch.arange(1024)[None, :] < torch.tensor([[1000], [700]])  # (B, S)
    mask = keep[:, None, None, :]  # (B, 1, 1, S)
    want = reference_attention(q, q, q, mask=mask, causal=True)[0]
    set_limit(MiB)
    e = attnkit.explain(q, q, q, mask=mask, causal=True)
    assert e.chosen == "blocked"
    assert "above attnkit's memory limit" in str(e.verdicts["sdpa"])
    got = attnkit.attention(q, q, q, mask=mask, causal=True)
    assert torch.allclose(got, want, atol=1e-10)
    bias = torch.zeros(1024, 1024, dtype=torch.float64, requires_grad=True)
    with pytest.raises(AttentionMemoryError) as info:
        attnkit.attention(q, q, q, mask=bias, causal=True)
    problem, got_line, _, fix = _parts(info.value)
    assert problem.startswith(
        "attnkit.attention: merging the causal rule into the float mask (1024, 1024) that "
        "needs a gradient"
    )
    assert "(requires_grad)  causal=True  L=1024  S=1024" in got_line
    assert "a mask that needs no gradient" in fix


def test_planning_a_dense_mask_refuses_above_the_limit(set_limit: SetLimit) -> None:
    q = torch.randn(1, 1, 1024, 8)
    mask = torch.rand(1024, 1024) > 0.5
    set_limit(MiB)
    with pytest.raises(AttentionMemoryError) as info:
        attnkit.attention(q, q, q, mask=mask, backend="blocked")
    problem, _, _, fix = _parts(info.value)
    assert problem.startswith(  # the dispatcher knows the planning's size now
        "attnkit.attention: int64 prefix sums of the mask tensor, to plan its blocks would "
        "take 0.0234 GiB (25,165,824 bytes)"
    )
    assert "pass the mask as a spec from attnkit.masks" in fix
    with pytest.raises(AttentionMemoryError) as info:  # planning it directly: the masks' guard
        masks.as_spec(mask).block_map(1024, 1024, 128)
    problem, _, _, fix = _parts(info.value)
    assert problem.startswith(
        "attnkit.masks: planning the dense bool mask (1, 1, 1024, 1024) block by block"
    )
    assert "pass the mask as a spec from attnkit.masks" in fix
    assert "backend='auto'" in fix


def test_meta_tensors_allocate_nothing_and_are_never_refused(set_limit: SetLimit) -> None:
    set_limit(1)
    q = torch.randn(1, 2, 4096, 8, device="meta")
    out, w = attnkit.attention(q, q, q, return_weights=True)
    assert out.device.type == "meta"
    assert w is not None
    assert w.shape == (1, 2, 4096, 4096)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1G"])
def test_set_memory_limit_takes_bytes_or_none(bad: object) -> None:
    with pytest.raises(AttentionInputError, match="must be a positive int of bytes or None"):
        attnkit.set_memory_limit(bad)  # type: ignore[arg-type]


def test_set_memory_limit_returns_the_previous_setting(set_limit: SetLimit) -> None:
    set_limit(None)
    assert attnkit.set_memory_limit(5 * MiB) is None
    assert attnkit.memory.memory_limit(torch.device("cpu")) == 5 * MiB
    assert attnkit.set_memory_limit(None) == 5 * MiB


def test_the_default_is_half_of_memavailable(
    set_limit: SetLimit, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    set_limit(None)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  9000000 kB\nMemAvailable:  1000000 kB\n")
    monkeypatch.setattr(attnkit.memory, "_MEMINFO", meminfo)
    cpu = torch.device("cpu")
    assert attnkit.memory.memory_limit(cpu) == 512_000_000  # 1,000,000 kB / 2
    meminfo.write_text("MemAvailable:  1000 kB\n")  # nearly nothing free: never below 64 MiB
    assert attnkit.memory.memory_limit(cpu) == 64 * MiB
    q = torch.randn(1, 2, 256, 8)
    assert attnkit.attention(q, q, q, return_weights=True).weights is not None  # 1.5 MiB
    with pytest.raises(AttentionMemoryError) as info:
        attnkit.attention(
            torch.randn(1, 2, 4096, 8), *[torch.randn(1, 2, 4096, 8)] * 2, return_weights=True
        )
    assert "half of the memory available now; attnkit.set_memory_limit(nbytes) changes it" in (
        info.value.expected
    )
    meminfo.unlink()  # no /proc/meminfo (not Linux): no limit unless one is set
    assert attnkit.memory.memory_limit(cpu) is None


def test_a_mask_tensor_whose_planning_does_not_fit_is_passed_over_by_auto(
    set_limit: SetLimit,
) -> None:
    """blocked (and flex) plan a mask tensor from int64 prefix sums of its shape: explain
    said blocked could serve, auto took it, and the masks raised. Now that memory is blocked's
    L x S need: auto passes it over for sdpa, which takes the tensor as it is."""
    set_limit(1 << 16)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 256, 16, generator=g)
    m = torch.rand(256, 256, generator=g) > 0.5
    e = attnkit.explain(q, q, q, mask=m)
    assert e.chosen == "sdpa"
    assert "blocked: cannot serve: int64 prefix sums of the mask tensor" in str(e)
    out = attnkit.attention(q, q, q, mask=m)
    torch.testing.assert_close(out, reference_attention(q, q, q, mask=m)[0].float())
    with pytest.raises(AttentionMemoryError) as info:
        attnkit.attention(q, q, q, mask=m, backend="blocked")
    problem, _, _, fix = _parts(info.value)
    assert problem.startswith(
        "attnkit.attention: int64 prefix sums of the mask tensor, to plan its blocks would "
    )
    assert "pass the mask as a spec from attnkit.masks" in fix
    assert "backend='auto'" in fix
