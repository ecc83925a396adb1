"""split_heads / merge_heads: the seed 004 formulas, exact round trips, and their errors.

Dimension legend: B batch, L length, H heads, D head dim, E = H * D model width.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnkit import AttentionInputError, merge_heads, split_heads

SHAPES = [
    pytest.param(2, 5, 4, 3, id="B2-L5-H4-D3"),
    pytest.param(1, 1, 1, 1, id="all-ones"),
    pytest.param(3, 7, 1, 8, id="one-head"),
    pytest.param(2, 1, 6, 2, id="one-token"),
    pytest.param(4, 6, 8, 1, id="head-dim-1"),
]


def seed_split(x: torch.Tensor, H: int) -> torch.Tensor:
    """Seed 004: view the width as (H, D), then bring the heads forward."""
    B, L, E = x.shape
    return x.view(B, L, H, E // H).transpose(1, 2)


def seed_merge(x: torch.Tensor) -> torch.Tensor:
    """Seed 004: heads back next to each other, contiguous, one width."""
    B, H, L, D = x.shape
    return x.transpose(1, 2).contiguous().view(B, L, H * D)


def non_contiguous(B: int, L: int, E: int) -> torch.Tensor:
    """A (B, L, E) tensor that is a transpose of a (B, E, L) one."""
    return torch.randn(B, E, L).transpose(1, 2)


@pytest.mark.parametrize(("B", "L", "H", "D"), SHAPES)
def test_split_matches_seed_formula(B: int, L: int, H: int, D: int) -> None:
    x = torch.randn(B, L, H * D)
    out = split_heads(x, H)
    expected = seed_split(x, H)
    assert out.shape == (B, H, L, D)
    assert torch.equal(out, expected)
    assert out.stride() == expected.stride()  # a view, like the seed's, no copy
    assert out.data_ptr() == x.data_ptr()


def test_split_keeps_each_tokens_features_together() -> None:
    """Head h of token l is x[:, l, h*D:(h+1)*D]; view(B, H, L, D) would mix tokens into heads."""
    B, L, H, D = 2, 3, 4, 2
    x = torch.arange(B * L * H * D, dtype=torch.float32).view(B, L, H * D)
    out = split_heads(x, H)
    for h in range(H):
        for pos in range(L):
            assert torch.equal(out[:, h, pos], x[:, pos, h * D : (h + 1) * D])
    assert not torch.equal(out, x.view(B, H, L, D))  # the wrong order the seed warns about


@pytest.mark.parametrize(("B", "L", "H", "D"), SHAPES)
def test_merge_matches_seed_formula(B: int, L: int, H: int, D: int) -> None:
    x = torch.randn(B, H, L, D)
    out = merge_heads(x)
    assert out.shape == (B, L, H * D)
    assert torch.equal(out, seed_merge(x))
    assert out.is_contiguous()


@pytest.mark.parametrize(("B", "L", "H", "D"), SHAPES)
def test_round_trip_exact(B: int, L: int, H: int, D: int) -> None:
    x = torch.randn(B, L, H * D)
    back = merge_heads(split_heads(x, H), num_heads=H)
    assert torch.equal(back, x)
    assert back.is_contiguous()
    y = torch.randn(B, H, L, D)
    assert torch.equal(split_heads(merge_heads(y), H), y)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: non_contiguous(2, 5, 12), id="transposed"),
        pytest.param(lambda: torch.randn(2, 5, 24)[:, :, ::2], id="strided-width"),
        pytest.param(lambda: torch.randn(4, 5, 12)[::2], id="strided-batch"),
        pytest.param(lambda: torch.randn(5, 2, 12).permute(1, 0, 2), id="seq-first-permuted"),
    ],
)
def test_round_trip_non_contiguous(make: Any) -> None:
    x = make()
    assert not x.is_contiguous()
    for H in (1, 2, 3, 4, 6, 12):
        out = split_heads(x, H)
        assert torch.equal(out, seed_split(x.contiguous(), H))
        assert torch.equal(merge_heads(out, num_heads=H), x)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: split_heads(non_contiguous(2, 5, 12), 3), id="split-of-transposed"),
        pytest.param(lambda: torch.randn(2, 3, 4, 5).transpose(2, 3), id="transposed-L-D"),
        pytest.param(lambda: torch.randn(2, 1, 4, 5).transpose(2, 3), id="one-head-transposed"),
        pytest.param(lambda: torch.randn(4, 8, 6, 1), id="contiguous-head-dim-1"),
    ],
)
def test_merge_output_is_contiguous(make: Any) -> None:
    x = make()
    out = merge_heads(x)
    assert torch.equal(out, seed_merge(x))  # the values are right either way
    assert out.is_contiguous()


def test_merge_output_contiguous_after_attention_layout() -> None:
    """The usual path: attention's (B, H, L, Dv) output, then merge for the output projection."""
    x = torch.randn(2, 5, 12)
    heads = split_heads(x, 4) * 2.0  # a fresh (B, H, L, D) tensor, as attention returns
    out = merge_heads(heads)
    assert out.is_contiguous()
    assert out.view(2, 5, 12).shape == (2, 5, 12)  # view() works: no .contiguous() needed


@given(
    B=st.integers(1, 8),
    L=st.integers(1, 8),
    H=st.integers(1, 8),
    D=st.integers(1, 8),
    transposed=st.booleans(),
)
def test_round_trip_property(B: int, L: int, H: int, D: int, transposed: bool) -> None:
    E = H * D
    x = non_contiguous(B, L, E) if transposed else torch.randn(B, L, E)
    heads = split_heads(x, H)
    assert heads.shape == (B, H, L, D)
    assert torch.equal(heads, seed_split(x.contiguous(), H))
    back = merge_heads(heads, num_heads=H)
    assert torch.equal(back, x)
    if not transposed:
        assert back.is_contiguous()


# ---------------------------------------------------------------------------------- errors


def check(
    exc: AttentionInputError,
    where: str,
    argument: str,
    problem: str,
    got: str,
    expected: str,
    fix: str | None,
) -> None:
    assert isinstance(exc, ValueError)
    assert exc.argument == argument
    lines = str(exc).splitlines()
    assert lines[0] == f"{where}: {exc.problem}"
    assert lines[1] == f"  got:      {exc.got}"
    assert lines[2] == f"  expected: {exc.expected}"
    assert problem in exc.problem, str(exc)
    assert got in exc.got, str(exc)
    assert expected in exc.expected, str(exc)
    if fix is None:
        assert exc.fix is None
        assert len(lines) == 3
    else:
        assert exc.fix is not None, str(exc)
        assert fix in exc.fix, str(exc)
        assert lines[3] == f"  fix:      {exc.fix}"


@pytest.mark.parametrize(
    ("E", "H", "divisors"),
    [
        pytest.param(10, 3, "[1, 2, 5, 10]", id="E10-H3"),
        pytest.param(12, 5, "[1, 2, 3, 4, 6, 12]", id="E12-H5"),
        pytest.param(7, 2, "[1, 7]", id="prime-width"),
        pytest.param(8, 16, "[1, 2, 4, 8]", id="more-heads-than-width"),
    ],
)
def test_split_width_not_divisible(E: int, H: int, divisors: str) -> None:
    with pytest.raises(AttentionInputError) as info:
        split_heads(torch.randn(2, 4, E), H)
    check(
        info.value,
        "attnkit.split_heads",
        "num_heads",
        f"width E={E} is not divisible by num_heads={H}",
        f"x (B=2, L=4, E={E})  num_heads={H}",
        "E % num_heads == 0",
        f"pick num_heads from {divisors}",
    )


@pytest.mark.parametrize(
    "num_heads",
    [
        pytest.param(0, id="zero"),
        pytest.param(-2, id="negative"),
        pytest.param(2.0, id="float"),
        pytest.param(True, id="bool"),
        pytest.param("2", id="str"),
        pytest.param(None, id="none"),
    ],
)
def test_split_num_heads_not_positive_int(num_heads: Any) -> None:
    with pytest.raises(AttentionInputError) as info:
        split_heads(torch.randn(2, 4, 8), num_heads)
    check(
        info.value,
        "attnkit.split_heads",
        "num_heads",
        f"`num_heads` must be a positive int, got {num_heads!r}",
        f"num_heads={num_heads!r}",
        "an int >= 1",
        None,
    )


@pytest.mark.parametrize(
    ("shape", "got"),
    [
        pytest.param((2, 4, 5, 3), "x (B=2, H=4, L=5, D=3)", id="4d-split-already"),
        pytest.param((5, 12), "x (2-D: 5, 12)", id="2d"),
        pytest.param((12,), "x (1-D: 12, )", id="1d"),
    ],
)
def test_split_wrong_rank(shape: tuple[int, ...], got: str) -> None:
    with pytest.raises(AttentionInputError) as info:
        split_heads(torch.randn(*shape), 2)
    fix = "probably split already" if len(shape) == 4 else "x.unsqueeze(0)"
    check(
        info.value,
        "attnkit.split_heads",
        "x",
        "it must be 3-D (B, L, E)",
        got,
        "x (B, L, E)",
        fix,
    )


def test_split_not_a_tensor_names_the_type() -> None:
    with pytest.raises(AttentionInputError) as info:
        split_heads([[1.0, 2.0]], 2)  # type: ignore[arg-type]
    assert info.value.argument == "x"
    assert "list" in info.value.got


@pytest.mark.parametrize(
    ("shape", "got"),
    [
        pytest.param((2, 5, 12), "x (B=2, L=5, E=12)", id="3d-merged-already"),
        pytest.param((1, 2, 4, 5, 3), "x (5-D: 1, 2, 4, 5, 3)", id="5d"),
    ],
)
def test_merge_wrong_rank(shape: tuple[int, ...], got: str) -> None:
    with pytest.raises(AttentionInputError) as info:
        merge_heads(torch.randn(*shape))
    check(
        info.value,
        "attnkit.merge_heads",
        "x",
        "it must be 4-D (B, H, L, D)",
        got,
        "x (B, H, L, D)",
        "merged already",
    )


def test_merge_given_tensor_transposed_back_already() -> None:
    """(B, L, H, D) with num_heads=H: the transpose back was done by hand already."""
    B, L, H, D = 2, 5, 3, 4
    x = split_heads(torch.randn(B, L, H * D), H).transpose(1, 2)  # (B, L, H, D)
    with pytest.raises(AttentionInputError) as info:
        merge_heads(x, num_heads=H)
    check(
        info.value,
        "attnkit.merge_heads",
        "x",
        f"`x` has {L} in the heads dim but num_heads={H}",
        f"x (B={B}, H={L}, L={H}, D={D})",
        f"x (B, H={H}, L, D)",
        "x looks like (B, L, H, D): it was transposed back already",
    )
    # both fixes it names work: the merged (B, L, H * D) of the heads
    want = x.flatten(2)
    assert torch.equal(merge_heads(x.transpose(1, 2), num_heads=H), want)
    assert f"x.reshape({B}, {L}, {H * D})" in str(info.value)
    assert torch.equal(x.reshape(B, L, H * D), want)


def test_merge_num_heads_mismatch_generic() -> None:
    with pytest.raises(AttentionInputError) as info:
        merge_heads(torch.randn(2, 4, 5, 3), num_heads=2)
    check(
        info.value,
        "attnkit.merge_heads",
        "x",
        "`x` has 4 in the heads dim but num_heads=2",
        "x (B=2, H=4, L=5, D=3)",
        "x (B, H=2, L, D)",
        "check the order of dims",
    )


@pytest.mark.parametrize(
    "num_heads",
    [pytest.param(2.0, id="float-equal-to-H"), pytest.param(0, id="zero")],
)
def test_merge_num_heads_not_positive_int(num_heads: Any) -> None:
    with pytest.raises(AttentionInputError) as info:
        merge_heads(torch.randn(2, 2, 5, 3), num_heads=num_heads)
    assert info.value.argument == "num_heads"
