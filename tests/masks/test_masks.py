"""Mask specs: predicates, dense forms, block maps, and attention with a spec."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import masks
from attnkit.backends import get_backend
from attnkit.masks import EMPTY, FULL, PARTIAL
from calls import make_call
from oracle import reference_attention
from strategies import atoms, specs


@settings(max_examples=150)
@given(data=st.data())
def test_block_map_never_overclaims(data: st.DataObject) -> None:
    B = data.draw(st.integers(1, 3))
    L = data.draw(st.integers(1, 40))
    S = data.draw(st.integers(1, 40))
    spec = data.draw(specs(B, L, S))
    bq, bk = data.draw(st.integers(1, 9)), data.draw(st.integers(1, 9))
    dense = spec.to_dense(L, S).expand(B, 1, L, S)
    state = spec.block_map(L, S, bq, bk).state.expand(B, 1, -1, -1)
    for i in range(state.shape[2]):
        for j in range(state.shape[3]):
            block = dense[:, 0, i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]  # (B, bq, bk)
            s = state[:, 0, i, j]
            assert not block[s == EMPTY].any(), f"block ({i}, {j}) called empty: {spec!r}"
            assert block[s == FULL].all(), f"block ({i}, {j}) called full: {spec!r}"


@settings(max_examples=150)
@given(data=st.data())
def test_allows_all_never_overclaims(data: st.DataObject) -> None:
    """A spec that says it allows every pair of an L x S call does, in every batch row (its
    answer is cached per key, so it is asked twice); and the plain rules say it when true."""
    B = data.draw(st.integers(1, 3))
    L = data.draw(st.integers(1, 40))
    S = data.draw(st.integers(1, 40))
    spec = data.draw(st.one_of(specs(B, L, S), atoms(B, L, S)))
    says = spec.allows_all(L, S)
    assert spec.allows_all(L, S) == says
    dense = spec.to_dense(L, S)
    if says:
        assert not dense.is_floating_point()
        assert bool(dense.all()), f"{spec!r} claims every pair of {L} x {S}"
    w = data.draw(st.integers(1, 50))
    window = masks.causal() & masks.sliding_window(w)
    expected = L <= S and bool(window.to_dense(L, S).all())
    assert window.allows_all(L, S) == expected  # exact for the decoding rule


def test_sdpa_runs_without_a_mask_where_the_spec_allows_every_pair(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch.nn.functional as F

    seen: list[object] = []
    real = F.scaled_dot_product_attention

    def spy(*args: object, **kw: object) -> torch.Tensor:
        seen.append(kw.get("attn_mask"))
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    q, k = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 40, 8)  # one decoding step
    spec = masks.causal() & masks.sliding_window(64)
    ref = reference_attention(q, k, k, mask=spec.to_dense(1, 40))[0]
    out = attnkit.attention(q, k, k, mask=spec, backend="sdpa")
    assert seen == [None]  # the window holds every key: no mask made or passed
    torch.testing.assert_close(out, ref.float(), atol=1e-6, rtol=0)
    e = attnkit.explain(q, k, k, mask=spec)
    assert e.chosen == "blocked"  # auto: the decode kernel (one query against a cache)
    assert (
        e.notes["sdpa"] == "the mask allows every pair of this 1 x 40 call: torch runs without one"
    )
    k = torch.randn(1, 2, 70, 8)  # past the window: the mask is made
    out = attnkit.attention(q, k, k, mask=spec, backend="sdpa")
    assert seen[-1] is not None
    torch.testing.assert_close(
        out, reference_attention(q, k, k, mask=spec.to_dense(1, 70))[0].float(), atol=1e-6, rtol=0
    )


@settings(max_examples=100)
@given(data=st.data())
def test_block_maps_of_the_built_in_specs_are_exact(data: st.DataObject) -> None:
    B = data.draw(st.integers(1, 2))
    L = data.draw(st.integers(1, 40))
    S = data.draw(st.integers(1, 40))
    spec = data.draw(atoms(B, L, S))
    bq, bk = data.draw(st.integers(1, 9)), data.draw(st.integers(1, 9))
    dense = spec.to_dense(L, S).expand(B, 1, L, S)
    state = spec.block_map(L, S, bq, bk).state.expand(B, 1, -1, -1)
    for i in range(state.shape[2]):
        for j in range(state.shape[3]):
            block = dense[:, 0, i * bq : (i + 1) * bq, j * bk : (j + 1) * bk].flatten(1)
            want = torch.where(block.all(1), FULL, torch.where(block.any(1), PARTIAL, EMPTY)).to(
                torch.uint8
            )
            assert torch.equal(state[:, 0, i, j], want), (spec, i, j)


@pytest.mark.parametrize(("L", "S"), [(5, 5), (3, 7), (7, 3)])
def test_dense_forms_follow_their_formulas(L: int, S: int) -> None:
    i = torch.arange(L)[:, None] + (S - L)  # end-aligned query positions
    j = torch.arange(S)[None, :]
    assert torch.equal(masks.causal().to_dense(L, S)[0, 0], attnkit.causal_mask(L, S))
    assert torch.equal(masks.sliding_window(2).to_dense(L, S)[0, 0], (i - j).abs() < 2)
    assert torch.equal(masks.prefix_lm(2).to_dense(L, S)[0, 0], (j < 2) | (j <= i))
    lengths = torch.tensor([2, S])
    assert torch.equal(
        masks.padding(lengths).to_dense(L, S)[:, 0], (j < lengths[:, None, None]).expand(2, L, S)
    )
    ids = torch.arange(S) // 3
    assert torch.equal(masks.document(ids).to_dense(L, S)[0, 0], ids[i.clamp(0)] == ids[j])


def test_query_padding_rows_see_nothing() -> None:
    dense = masks.padding(torch.tensor([4]), q_lengths=torch.tensor([2])).to_dense(3, 5)[0, 0]
    assert dense.tolist() == [[True] * 4 + [False], [True] * 4 + [False], [False] * 5]


def test_specs_draw_themselves() -> None:
    text = str(masks.causal() & masks.sliding_window(3))
    lines = text.splitlines()
    assert lines[0] == "causal() & sliding_window(3), drawn for L = S = 8 (1 = may attend):"
    assert lines[1:4] == ["1 . . . . . . .", "1 1 . . . . . .", "1 1 1 . . . . ."]
    assert lines[8] == ". . . . . 1 1 1"
    bm = str(masks.causal().block_map(256, 256, 128, 128))
    assert bm.splitlines() == [
        "BlockMap(L=256, S=256, blocks 128x128: 1 full, 2 partial, 1 empty)",
        "p .",
        "# p",
    ]


def test_block_map_of_a_long_window_is_cheap_and_sparse() -> None:
    spec = masks.causal() & masks.sliding_window(256)
    bm = spec.block_map(65536, 65536, 128, 128)  # never builds 65536 x 65536
    assert bm.state.shape == (1, 1, 512, 512)
    assert bm.counts()["full"] == 511  # the block just below the diagonal
    assert bm.density < 0.006


# flex serves no float64 and compiles a kernel per shape: tests/backends/test_flex.py covers it
@pytest.mark.parametrize("backend", [b for b in attnkit.available_backends() if b != "flex"])
@pytest.mark.parametrize(
    "make",
    [
        lambda: masks.causal() & masks.sliding_window(3),
        lambda: masks.padding(torch.tensor([3, 0])),
        lambda: masks.document(torch.tensor([0, 0, 1, 1, 1, 2, 2])) & masks.causal(),
        lambda: masks.prefix_lm(torch.tensor([2, 5])),
        lambda: ~masks.causal(),
    ],
    ids=["window", "padding", "documents", "prefix", "anti-causal"],
)
def test_attention_with_a_spec_equals_the_dense_mask(backend: str, make) -> None:  # type: ignore[no-untyped-def]
    spec = make()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 7, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, 7, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, 7, 8, generator=g, dtype=torch.float64)
    dense = spec.to_dense(7, 7)
    out = attnkit.attention(q, k, v, mask=spec, backend=backend)
    assert torch.allclose(out, reference_attention(q, k, v, mask=dense)[0], atol=1e-12)


def test_causal_flag_and_spec_combine_and_causal_spec_is_the_fast_path() -> None:
    q = torch.randn(1, 2, 6, 8)
    spec = masks.sliding_window(2)
    a = attnkit.attention(q, q, q, mask=spec, causal=True)
    b = attnkit.attention(q, q, q, mask=masks.causal() & spec)
    assert torch.allclose(a, b, atol=1e-6)
    assert attnkit.explain(q, q, q, mask=masks.causal()).chosen == "sdpa"
    call = make_call(q, q, q, masks.causal(), False, None, 0.0, False, where="test")
    assert call.causal is True  # causal() alone is the bare causal rule: torch's is_causal
    assert (
        get_backend("sdpa")
        .run(call)[0]
        .equal(torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True))
    )


def test_modules_take_specs_with_key_padding() -> None:
    mha = attnkit.MultiHeadAttention(16, 4, causal=True).double()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    kpm = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    got = mha(x, mask=masks.sliding_window(3), attention_mask=kpm).output
    dense = masks.sliding_window(3).to_dense(6, 6) & kpm[:, None, None, :]
    want = mha(x, mask=dense).output
    assert torch.allclose(got, want, atol=1e-12)


def test_spec_for_another_batch_size_is_refused() -> None:
    q = torch.randn(3, 2, 5, 8)
    with pytest.raises(attnkit.AttentionInputError, match="batch of 2 but q has B=3") as info:
        attnkit.attention(q, q, q, mask=masks.padding(torch.tensor([1, 2])))
    assert info.value.argument == "mask"
    assert "lengths / ids / keep tensors with 3 rows" in str(info.value)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: masks.sliding_window(0), "sliding_window"),
        (lambda: masks.padding(torch.tensor([1.5])), "integer tensor"),
        (lambda: masks.key_mask(torch.ones(3)), "bool \\(B, S\\)"),
        (lambda: masks.prefix_lm(-1), "prefix_lm"),
        (lambda: masks.causal() & torch.ones(2), "combine with mask specs"),
        (lambda: torch.ones(2, 2, dtype=torch.bool) & masks.causal(), "got:      Tensor & spec"),
        (lambda: torch.ones(2, 2, dtype=torch.bool) | masks.causal(), "got:      Tensor | spec"),
        (
            lambda: masks.padding(torch.tensor([1, 2])) & masks.padding(torch.tensor([1])),
            "different batch sizes",
        ),
    ],
)
def test_bad_spec_arguments(make, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises((ValueError, TypeError), match=message):
        make()


@pytest.mark.parametrize(
    ("make", "argument", "got"),
    [
        (lambda: masks.padding(torch.tensor([1.5, 2.0])), "lengths",
         "lengths (1-D: 2, ) dtype=torch.float32"),
        (lambda: masks.padding(torch.tensor([3]), q_lengths=torch.tensor([True])), "q_lengths",
         "q_lengths (1-D: 1, ) dtype=torch.bool"),
        (lambda: masks.document(torch.zeros(2, 4, dtype=torch.complex64)), "ids",
         "ids (2-D: 2, 4) dtype=torch.complex64"),
        (lambda: masks.document([0, 0, 1]), "ids", "ids: list"),
        (lambda: masks.prefix_lm(torch.tensor([2.0])), "prefix_len",
         "prefix_len (1-D: 1, ) dtype=torch.float32"),
    ],
)  # fmt: skip
def test_a_spec_argument_that_is_no_integer_tensor_is_shown_as_it_came(
    make: Any, argument: str, got: str
) -> None:
    """The ``got`` of every spec argument that must be an integer tensor: its shape and dtype
    as every attnkit message writes them (:func:`attnkit.errors.tensor_got`), or its type."""
    with pytest.raises(attnkit.AttentionInputError) as info:
        make()
    assert info.value.argument == argument
    assert info.value.got == got
    assert f"`{argument}` must be an integer tensor." in str(info.value)
    assert f"torch.as_tensor({argument}, dtype=torch.long)" in str(info.value)


def test_select_heads_renumbers_the_heads_of_a_head_dependent_spec() -> None:
    from attnkit.modules.positions import alibi

    spec = alibi(6) & masks.causal() & masks.sliding_window(3)
    part = spec.select_heads(2, 5)
    assert part.heads == 3
    assert part.has_bias
    assert repr(part) == "(alibi(6) & causal() & sliding_window(3)).select_heads(2, 5)"
    assert torch.equal(part.to_dense(7, 9), spec.to_dense(7, 9)[:, 2:5])
    # the block map does not depend on the head: the same as the whole spec's
    assert torch.equal(part.block_map(7, 9, 2, 2).state, spec.block_map(7, 9, 2, 2).state)
    # a spec that does not depend on the head is its own slice
    window = masks.causal() & masks.sliding_window(3)
    assert window.select_heads(0, 4) is window
    with pytest.raises(
        attnkit.AttentionInputError,
        match=r"select_heads\(4, 7\) is not a range(?s:.*)expected: 0 <= start < stop <= heads = 6",
    ):
        spec.select_heads(4, 7)
    with pytest.raises(ValueError, match=r"select_heads\(3, 3\)"):
        spec.select_heads(3, 3)


def test_as_spec_merging_causal_into_a_tensor_needs_the_lengths() -> None:
    with pytest.raises(
        attnkit.AttentionInputError, match=r"(?s)needs the call's lengths.*L=4, S=None"
    ):
        masks.as_spec(torch.ones(4, 4, dtype=torch.bool), True, L=4)
    merged = masks.as_spec(torch.ones(2, 4, dtype=torch.bool), True, L=2, S=4)
    assert isinstance(merged, masks.DenseMask)
    assert torch.equal(merged.tensor, masks.causal_mask(2, 4))


@pytest.mark.parametrize("backend", ["auto", *attnkit.available_backends()])
@pytest.mark.parametrize("kind", ["document", "key_mask", "padding"])
def test_a_spec_over_no_keys_gives_zeros_on_every_backend(kind: str, backend: str) -> None:
    """S = 0: every row sees nothing, so the output is 0 (never an IndexError)."""
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 0, 8)
    spec = {
        "document": masks.document(torch.zeros(0, dtype=torch.long)),
        "key_mask": masks.key_mask(torch.zeros(1, 0, dtype=torch.bool)),
        "padding": masks.padding(torch.tensor([0])),
    }[kind]
    if backend == "flex":  # one block: flex refuses to compile a kernel with nothing to skip
        with pytest.raises(attnkit.AttentionInputError, match="flex has nothing to skip"):
            attnkit.attention(q, k, k, mask=spec, backend=backend)
        return
    out = attnkit.attention(q, k, k, mask=spec, backend=backend)
    assert out.shape == (1, 2, 4, 8)
    assert torch.equal(out, torch.zeros_like(out))
    assert spec.to_dense(4, 0).shape == (1, 1, 4, 0)


def _rows_of_dense(spec: masks.MaskSpec) -> list[str]:
    """The drawing's rows as the spec's dense form gives them (the reference)."""
    n = 8 if spec.length is None else spec.length
    dense = spec.to_dense(n, n)[0, 0, :8, :8]
    if dense.is_floating_point():
        dense = dense > float("-inf")
    return [" ".join("1" if x else "." for x in row) for row in dense.tolist()]


@settings(max_examples=60)
@given(data=st.data())
def test_a_spec_draws_the_corner_of_its_dense_form(data: st.DataObject) -> None:
    B = data.draw(st.integers(1, 3))
    S = data.draw(st.sampled_from([8, 3, 12]))  # key_mask and document: L = S = their length
    spec = data.draw(specs(B, S, S))
    assert str(spec).splitlines()[1:] == _rows_of_dense(spec)


def test_specs_with_a_bias_a_tensor_or_heads_draw_as_their_dense_form() -> None:
    keep = torch.tensor([[True, False, True, True, True, True, True, False, True, True]])
    tensor = torch.rand(1, 1, 8, 8) > 0.4
    for spec in (
        masks.alibi(4) & masks.causal(),
        masks.alibi(4).select_heads(1, 3) & masks.sliding_window(2),
        ~masks.causal() | masks.key_mask(keep[:, :8]),
        masks.as_spec(tensor) & masks.causal(),
        masks.as_spec(torch.where(tensor, 0.5, float("-inf"))),
        masks.causal() & masks.key_mask(keep),
        masks.sequence_causal(torch.tensor([6, 9]), 4),
        masks.prefix_lm(torch.tensor([3, 1])),
    ):
        lines = str(spec).splitlines()
        assert lines[0].startswith(f"{spec!r}, drawn for L = S = ")
        assert lines[1:] == _rows_of_dense(spec), spec


def test_a_spec_holding_a_tensor_draws_at_the_tensors_own_sizes() -> None:
    bias = torch.zeros(1, 2, 7, 9)  # 7 queries, 9 keys: not the 8 x 8 of a spec without one
    lines = str(masks.causal() & masks.as_spec(bias)).splitlines()
    assert lines[0].endswith("drawn for L = 7, S = 9, its first 8 x 8 pairs (1 = may attend):")
    assert lines[1:] == [  # end-aligned: query i sees keys 0 .. i + 2
        "1 1 1 . . . . .",
        "1 1 1 1 . . . .",
        "1 1 1 1 1 . . .",
        "1 1 1 1 1 1 . .",
        "1 1 1 1 1 1 1 .",
        "1 1 1 1 1 1 1 1",
        "1 1 1 1 1 1 1 1",
    ]


def test_a_long_key_mask_draws_its_corner_without_the_whole_mask() -> None:
    # the whole mask would be 8 x 65536 x 65536 (34 GB with its index arithmetic): with a
    # 1 MiB memory limit, building it is refused, so the drawing must not build it
    keep = torch.ones(8, 65536, dtype=torch.bool)
    keep[0, 1] = False
    previous = attnkit.set_memory_limit(2**20)
    try:
        drawn = [str(masks.key_mask(keep)), str(masks.causal() & masks.key_mask(keep))]
        with pytest.raises(attnkit.AttentionMemoryError):
            masks.key_mask(keep).to_dense(65536, 65536)
    finally:
        attnkit.set_memory_limit(previous)
    keys, causal_keys = (text.splitlines() for text in drawn)
    assert keys[0] == (
        "key_mask(<bool (8, 65536)>), drawn for L = S = 65536, its first 8 x 8 pairs "
        "(1 = may attend):"
    )
    assert keys[1:] == ["1 . 1 1 1 1 1 1"] * 8
    assert causal_keys[1:4] == ["1 . . . . . . .", "1 . . . . . . .", "1 . 1 . . . . ."]
    assert causal_keys[8] == "1 . 1 1 1 1 1 1"


def test_str_of_a_spec_built_for_its_own_length_draws_it() -> None:
    text = str(masks.document(torch.arange(40) % 3))
    lines = text.splitlines()
    assert lines[0] == (
        "document(<ids (1, 40)>), drawn for L = S = 40, its first 8 x 8 pairs (1 = may attend):"
    )
    assert lines[1:3] == ["1 . . 1 . . 1 .", ". 1 . . 1 . . 1"]
    assert len(lines) == 9
    short = str(masks.document(torch.tensor([0, 0, 1]))).splitlines()
    assert short[1:] == ["1 1 .", "1 1 .", ". . 1"]
