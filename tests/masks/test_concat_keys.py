"""Two masks side by side over the keys: ``attnkit.masks.concat_keys(first, S1, second, S2)``.

The meaning is ``torch.cat`` of the two parts' dense masks along the keys, each part as it is
alone over its own keys (end-aligned to them): every test builds that concatenation from the
parts' own ``to_dense`` and holds the spec to it, on every backend against the float64 oracle,
block by block, row run by row run, and through ``&``, ``|`` and ``~``.

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S1 and S2 the
two parts' key counts, S = S1 + S2.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit.backends.blocked.blocks import BlockAt, backward_from_lse, forward_with_lse
from attnkit.backends.blocked.tiles import merge
from attnkit.masks import (
    EMPTY,
    FULL,
    MaskSpec,
    alibi,
    block_states,
    causal,
    concat_keys,
    document,
    from_function,
    key_mask,
    padding,
    row_spans,
    sliding_window,
    unmasked,
)
from attnkit.masks.concat import ConcatKeys
from oracle import reference_attention, within_naive

Parts = Callable[[int, int, int, int, int], tuple[MaskSpec, MaskSpec]]


def _keep(B: int, S: int, seed: int) -> torch.Tensor:
    """Random real keys per sequence; the last sequence has none (its rows can be empty)."""
    keep = torch.rand(B, S, generator=torch.Generator().manual_seed(seed)) > 0.3
    keep[-1] = False
    return keep


def _function_causal(L: int, S1: int) -> MaskSpec:
    return from_function(lambda b, h, q, kv: kv <= q + (S1 - L))


#: name: (B, H, L, S1, S2) -> (first, second)
PARTS: dict[str, Parts] = {
    "causal | key_mask": lambda B, H, L, S1, S2: (causal(), key_mask(_keep(B, S2, S1))),
    "window | unmasked": lambda B, H, L, S1, S2: (causal() & sliding_window(5), unmasked()),
    "documents | padding": lambda B, H, L, S1, S2: (
        document(torch.arange(S1) // 7) & causal(),
        padding(torch.arange(B) * 5 % (S2 + 1)),
    ),
    "function | key_mask": lambda B, H, L, S1, S2: (
        _function_causal(L, S1),
        key_mask(_keep(B, S2, 3)),
    ),
    "alibi | causal": lambda B, H, L, S1, S2: (alibi(H) & causal(), causal()),
    "nested | key_mask": lambda B, H, L, S1, S2: (
        concat_keys(unmasked(), S1 // 3, causal(), S1 - S1 // 3),
        key_mask(_keep(B, S2, 5)),
    ),
}


def _dense(spec: MaskSpec, B: int, H: int, L: int, S: int) -> torch.Tensor:
    """A part's dense mask as a float ``(B, H, L, S)``: its bias (0 without) where allowed,
    -inf elsewhere."""
    d = spec.to_dense(L, S, dtype=torch.float64)
    if d.dtype == torch.bool:
        d = torch.zeros(d.shape, dtype=torch.float64).masked_fill(~d, float("-inf"))
    return d.expand(B, H, L, S)


def cat_dense(first: MaskSpec, S1: int, second: MaskSpec, S2: int, B: int, H: int, L: int):  # type: ignore[no-untyped-def]
    """The oracle's mask: torch.cat of the two parts' dense masks along the keys."""
    return torch.cat([_dense(first, B, H, L, S1), _dense(second, B, H, L, S2)], dim=-1)


def _qkv(B: int, H: int, Hkv: int, L: int, S: int, D: int = 16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(L * 131 + S * 7 + H)
    return [torch.randn(B, n, m, D, generator=g) for n, m in ((H, L), (Hkv, S), (Hkv, S))]


@pytest.mark.parametrize("backend", ["math", "blocked", "auto"])
@pytest.mark.parametrize("kind", list(PARTS))
@pytest.mark.parametrize(
    ("B", "H", "Hkv", "L", "S1", "S2"),
    [(2, 4, 2, 37, 37, 23), (2, 2, 1, 1, 50, 30), (2, 6, 3, 70, 20, 45), (1, 4, 4, 130, 130, 150)],
)
def test_attention_with_the_spec_is_the_oracle_with_the_concatenated_masks(
    backend: str, kind: str, B: int, H: int, Hkv: int, L: int, S1: int, S2: int
) -> None:
    """Forward and backward, grouped-query heads, a decode step (L = 1), more queries than the
    first part's keys (its first rows see none of them) and a sequence without real keys in
    the second part (rows that see nothing: output and gradient 0)."""
    first, second = PARTS[kind](B, H, L, S1, S2)
    spec = concat_keys(first, S1, second, S2)
    dense = cat_dense(first, S1, second, S2, B, H, L)
    q, k, v = _qkv(B, H, Hkv, L, S1 + S2)
    dout = torch.randn(B, H, L, 16, generator=torch.Generator().manual_seed(2))
    qkv = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attnkit.attention(*qkv, mask=spec, backend=backend)
    got = (out, *torch.autograd.grad(out, qkv, dout))
    q64 = [t.double().requires_grad_() for t in (q, k, v)]
    want = reference_attention(*q64, mask=dense)[0]
    wants = (want, *torch.autograd.grad(want, q64, dout.double()))
    q32 = [t.clone().requires_grad_() for t in (q, k, v)]
    naive = reference_attention(*q32, mask=dense.float(), dtype=torch.float32)[0]
    naives = (naive, *torch.autograd.grad(naive, q32, dout))
    for g, w, n, name in zip(got, wants, naives, "oqkv", strict=True):
        within_naive(g, w, n, grad=name != "o", what=f"{kind} {backend} {name}")
    empty = (dense == float("-inf")).all(-1)  # (B, H, L) rows that see nothing
    if bool(empty.any()):
        assert bool((out[empty] == 0).all())
        assert bool((got[1][empty] == 0).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_other_dtypes_keep_to_the_oracle(dtype: torch.dtype) -> None:
    """Low precision (the CPU path's copies or kernels: each part's plan is made for what its
    kernel reads) and float64, forward and backward on the blocked backend."""
    B, H, Hkv, L, S1, S2 = 2, 4, 2, 70, 70, 40
    first, second = causal() & sliding_window(5), padding(torch.tensor([30, 25]))
    spec = concat_keys(first, S1, second, S2)
    dense = cat_dense(first, S1, second, S2, B, H, L)
    q, k, v = (t.to(dtype) for t in _qkv(B, H, Hkv, L, S1 + S2))
    dout = torch.randn(B, H, L, 16, generator=torch.Generator().manual_seed(3)).to(dtype)
    qkv = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attnkit.attention(*qkv, mask=spec, backend="blocked")
    got = (out, *torch.autograd.grad(out, qkv, dout))
    q64 = [t.double().requires_grad_() for t in (q, k, v)]
    want = reference_attention(*q64, mask=dense)[0]
    wants = (want, *torch.autograd.grad(want, q64, dout.double()))
    qn = [t.clone().requires_grad_() for t in (q, k, v)]
    naive = reference_attention(*qn, mask=dense.to(dtype), dtype=dtype)[0]
    naives = (naive, *torch.autograd.grad(naive, qn, dout))
    for g, w, n, name in zip(got, wants, naives, "oqkv", strict=True):
        within_naive(g, w, n, grad=name != "o", what=f"{dtype} {name}")


def test_to_dense_is_the_concatenation_and_the_parts_are_read_in_their_own_keys() -> None:
    """The first part is end-aligned to its S1 keys, the second to its S2: with L = 2
    queries, causal over 3 keys lets row 0 see 2 of them, over 4 keys 3."""
    spec = concat_keys(causal(), 3, causal(), 4)
    assert spec.to_dense(2, 7)[0, 0].int().tolist() == [
        [1, 1, 0, 1, 1, 1, 0],
        [1, 1, 1, 1, 1, 1, 1],
    ]
    assert spec.length == 7
    assert spec.reads_query_position
    empty_first = concat_keys(causal(), 0, key_mask(torch.tensor([[True, False]])), 2)
    assert empty_first.to_dense(2, 2)[0, 0].tolist() == [[True, False]] * 2
    empty_second = concat_keys(causal(), 3, unmasked(), 0)
    assert torch.equal(empty_second.to_dense(2, 3), causal().to_dense(2, 3))
    biased = alibi(2) & causal()  # a part with a bias, the other part without keys
    only = concat_keys(unmasked(), 0, biased, 4)
    assert torch.equal(only.to_dense(3, 4), biased.to_dense(3, 4))
    assert torch.equal(concat_keys(biased, 4, causal(), 0).to_dense(3, 4), biased.to_dense(3, 4))


@pytest.mark.parametrize("op", ["&", "|", "~"])
def test_it_combines_with_other_specs(op: str) -> None:
    B, L, S1, S2 = 2, 9, 9, 6
    first, second = causal(), key_mask(_keep(B, S2, 1))
    spec = concat_keys(first, S1, second, S2)
    mine = cat_dense(first, S1, second, S2, B, 1, L) > float("-inf")
    window = sliding_window(4)
    other = window.to_dense(L, S1 + S2)
    combined = {"&": spec & window, "|": spec | window, "~": ~spec}[op]
    want = {"&": mine & other, "|": mine | other, "~": ~mine}[op]
    assert torch.equal(combined.to_dense(L, S1 + S2).expand(B, 1, L, S1 + S2), want)


@pytest.mark.parametrize("chunks", [(0, 64), (0, 30, 64), (0, 10, 40, 50, 64)])
def test_blocks_of_keys_at_global_positions_merge_to_the_oracle(chunks: tuple[int, ...]) -> None:
    """The blocked backend's block functions (what ring attention runs per key chunk) on
    chunks of the keys, some straddling S1 (split into the parts), merged by log-sum-exp."""
    B, H, Hkv, L, S1, S2 = 2, 4, 2, 40, 40, 24
    first, second = PARTS["window | unmasked"](B, H, L, S1, S2)
    spec = concat_keys(first, S1, second & key_mask(_keep(B, S2, 7)), S2)
    q, k, v = (t.double() for t in _qkv(B, H, Hkv, L, S1 + S2))
    want = reference_attention(q, k, v, mask=spec.to_dense(L, S1 + S2))[0]
    out = lse = None
    for a, b in itertools.pairwise(chunks):
        at = BlockAt(0, a, L, S1 + S2)
        o, s = forward_with_lse(q, k[:, :, a:b], v[:, :, a:b], mask=spec, scale=0.25, at=at)
        if out is None or lse is None:
            out, lse = o.clone(), s.clone()
        else:
            merge(out, lse, o, s)
    assert out is not None
    assert lse is not None
    torch.testing.assert_close(out, want, atol=1e-12, rtol=0)
    dout = torch.randn_like(out)
    dq = torch.zeros_like(q)
    for a, b in itertools.pairwise(chunks):
        at = BlockAt(0, a, L, S1 + S2)
        ks, vs = k[:, :, a:b], v[:, :, a:b]
        g = backward_from_lse(q, ks, vs, out, dout, lse, mask=spec, scale=0.25, at=at)
        dq += g[0]
    q64 = q.clone().requires_grad_()
    again = reference_attention(q64, k, v, mask=spec.to_dense(L, S1 + S2))[0]
    torch.testing.assert_close(dq, torch.autograd.grad(again, q64, dout)[0], atol=1e-10, rtol=0)


# ---------------------------------------------------------------------------------------------
# block bounds and runs of keys, against the dense mask


def _check_states(
    spec: MaskSpec, dense: torch.Tensor, Lc: int, Sc: int, bq: int, bk: int, at: tuple[int, ...]
) -> torch.Tensor:
    """``spec``'s states over the ``Lc x Sc`` chunk at rows ``q0``, keys ``k0`` (global offset
    ``off``), checked to be conservative against ``dense`` ``(B, L, S)``: a full block has
    every pair allowed, an empty one none; returns the states the dense mask says."""
    q0, k0, off = at
    state = block_states(spec, Lc, Sc, bq, bk, q_start=q0, k_start=k0, off=off)
    B = dense.shape[0]
    nq, nk = state.shape[-2:]
    exact = torch.empty(B, nq, nk, dtype=torch.uint8)
    for i in range(nq):
        for j in range(nk):
            rows = slice(q0 + i * bq, q0 + min((i + 1) * bq, Lc))
            keys = slice(k0 + j * bk, k0 + min((j + 1) * bk, Sc))
            tile = dense[:, rows, keys].reshape(B, -1)
            exact[:, i, j] = torch.where(tile.all(1), FULL, torch.where(tile.any(1), 1, EMPTY))
            got = state.expand(B, -1, -1, -1)[:, 0, i, j]
            assert bool(((got != FULL) | tile.all(1)).all()), (i, j, "called full")
            assert bool(((got != EMPTY) | ~tile.any(1)).all()), (i, j, "called empty")
    return exact


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(["causal | key_mask", "window | unmasked", "documents | padding"]),
    L=st.integers(1, 40),
    S1=st.integers(0, 40),
    S2=st.integers(0, 40),
    bq=st.sampled_from([1, 3, 8, 16]),
    bk=st.sampled_from([1, 4, 7, 16]),
    chunk=st.tuples(st.integers(0, 39), st.integers(0, 79)),
)
def test_block_states_are_conservative_and_exact_for_exact_parts(
    kind: str, L: int, S1: int, S2: int, bq: int, bk: int, chunk: tuple[int, int]
) -> None:
    """Over the whole call and over a chunk of rows and keys (ring attention's view): a block
    that straddles S1 is full only where both its pieces are and empty only where both are."""
    S = S1 + S2
    if S == 0 or (kind == "documents | padding" and S1 == 0):
        return
    B = 3
    first, second = PARTS[kind](B, 1, L, S1, S2)
    spec = concat_keys(first, S1, second, S2)
    dense = (cat_dense(first, S1, second, S2, B, 1, L) > float("-inf"))[:, 0]  # (B, L, S)
    exact = _check_states(spec, dense, L, S, bq, bk, (0, 0, S - L))
    if kind == "causal | key_mask":  # parts with exact bounds: the concatenation is exact
        got = block_states(spec, L, S, bq, bk).expand(B, -1, -1, -1)[:, 0]
        assert torch.equal(got, exact)
    q0, k0 = min(chunk[0], L - 1), min(chunk[1], S - 1)
    _check_states(spec, dense, L - q0, S - k0, bq, bk, (q0, k0, S - L))


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(list(PARTS)),
    L=st.integers(1, 30),
    S1=st.integers(1, 30),
    S2=st.integers(1, 30),
    chunk=st.tuples(st.integers(0, 29), st.integers(0, 59)),
)
def test_row_spans_are_the_dense_rows_where_given(
    kind: str, L: int, S1: int, S2: int, chunk: tuple[int, int]
) -> None:
    B, S = 2, S1 + S2
    first, second = PARTS[kind](B, 1, L, S1, S2)
    spec = concat_keys(first, S1, second, S2)
    dense = (cat_dense(first, S1, second, S2, B, 1, L) > float("-inf"))[:, 0]
    q0, k0 = min(chunk[0], L - 1), min(chunk[1], S - 1)
    spans = row_spans(spec, L - q0, S - k0, q_start=q0, k_start=k0, off=S - L)
    if spans is None:
        return
    lo, hi = spans
    idx = torch.arange(S - k0)
    got = (idx >= lo[..., None]) & (idx <= hi[..., None])  # (B', L - q0, S - k0)
    assert torch.equal(got.expand(B, -1, -1), dense[:, q0:, k0:])


@pytest.mark.parametrize("first", [causal(), causal() & sliding_window(3)])
def test_a_decode_step_that_sees_its_own_keys_and_the_encoders_is_one_run(
    first: MaskSpec,
) -> None:
    spec = concat_keys(first, 5, unmasked(), 4)
    spans = row_spans(spec, 1, 9)
    assert spans is not None
    lo, hi = spans
    assert (lo.tolist(), hi.tolist()) == ([[0 if first.key() == ("causal",) else 2]], [[8]])
    assert row_spans(spec, 5, 9) is None  # prefill: rows end before S1, then the encoder's


# ---------------------------------------------------------------------------------------------
# what identifies it, and what it prints, without L x S


def test_key_and_digest_follow_the_parts_and_the_split() -> None:
    keep = torch.tensor([[True, False, True]])
    a = concat_keys(causal(), 4, key_mask(keep), 3)
    b = concat_keys(causal(), 4, key_mask(keep), 3)
    assert a.key() == b.key()
    assert hash(a.key()) == hash(b.key())
    assert a.digest() == concat_keys(causal(), 4, key_mask(keep.clone()), 3).digest()
    assert a.digest() != concat_keys(causal(), 4, key_mask(~keep), 3).digest()
    split = concat_keys(unmasked(), 3, unmasked(), 4)
    swapped = concat_keys(unmasked(), 4, unmasked(), 3)
    assert split.key() != swapped.key()
    assert split.digest() != swapped.digest()
    assert a.tensors() == [keep]
    before = a.key()
    keep.logical_not_()  # an in-place edit: another key
    assert a.key() != before


def test_str_repr_and_explain_never_build_l_by_s(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = concat_keys(causal() & sliding_window(3), 10**12, key_mask(_keep(1, 5, 0)), 5)
    assert repr(spec) == (
        "concat_keys(causal() & sliding_window(3), 1000000000000, key_mask(<bool (1, 5)>), 5)"
    )
    lines = str(spec).splitlines()
    assert lines[0].endswith(
        "drawn for L = 1000000000000, S = 1000000000000 + 5; its first 8 rows and 8 keys of "
        "each part (1 = may attend):"
    )
    assert lines[4] == ". 1 1 1 . . . . | . . . . ."  # row 3: itself and 2 before; no real key
    assert not spec.allows_all(1, 10**12 + 5)

    def refuse(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("the spec was materialised as an L x S mask")

    monkeypatch.setattr(ConcatKeys, "to_dense", refuse)
    L, S1, S2 = 300, 300, 200
    keep = _keep(2, S2, 4)[:1]  # a sequence with real keys
    small = concat_keys(causal() & sliding_window(16), S1, key_mask(keep), S2)
    q, k, v = _qkv(1, 2, 1, L, S1 + S2)
    text = str(attnkit.explain(q, k, v, mask=small, backend="blocked"))
    assert "concat_keys(causal() & sliding_window(16), 300, key_mask(<bool (1, 200)>), 200)" in (
        text
    )
    assert "keys split at 300 (the two parts of concat_keys)" in text
    assert "row-span kernel" in text  # each part's rows are one run of keys
    out = attnkit.attention(q, k, v, mask=small, backend="blocked")
    assert out.shape == (1, 2, L, 16)


# ---------------------------------------------------------------------------------------------
# bad input


def _message(call: Callable[[], object]) -> str:
    with pytest.raises(attnkit.AttentionInputError) as e:
        call()
    return str(e.value)


@pytest.mark.parametrize(
    ("count", "shown"), [(-1, "S1=-1 (int)"), (2.0, "S1=2.0 (float)"), (True, "S1=True (bool)")]
)
def test_a_key_count_that_is_not_an_int_at_least_0_is_refused(count: object, shown: str) -> None:
    text = _message(lambda: concat_keys(causal(), count, unmasked(), 2))  # type: ignore[arg-type]
    assert "attnkit.masks.concat_keys" in text
    assert "concat_keys(S1) needs the number of keys of the first part, an int >= 0" in text
    assert shown in text
    assert "k.shape[-2]" in text


def test_parts_that_are_not_rules_of_their_own_keys_are_refused() -> None:
    text = _message(lambda: concat_keys(torch.ones(2, 3, dtype=torch.bool), 3, causal(), 2))  # type: ignore[arg-type]
    assert "concat_keys(first) needs a mask spec, not a Tensor" in text
    assert "torch.cat the dense masks" in text
    dense = attnkit.masks.as_spec(torch.ones(2, 3, dtype=torch.bool))
    text = _message(lambda: concat_keys(causal(), 3, dense, 3))
    assert "concat_keys(second) holds a mask tensor" in text
    assert "second=dense bool mask" in text
    chosen = attnkit.masks.selected_keys(torch.zeros(1, 2, 1, dtype=torch.long))
    text = _message(lambda: concat_keys(chosen, 3, causal(), 3))
    assert "holds selected_keys(indices)" in text
    assert "concat_keys(...) & selected_keys(i)" in text


def test_a_part_built_for_another_length_or_batch_is_refused() -> None:
    keep = torch.ones(2, 5, dtype=torch.bool)
    text = _message(lambda: concat_keys(causal(), 3, key_mask(keep), 4))
    assert "the second part key_mask(<bool (2, 5)>) is built for 5 keys, not S2 = 4" in text
    assert "second length 5  S2=4" in text
    text = _message(lambda: concat_keys(padding(torch.tensor([1, 2, 3])), 3, key_mask(keep), 5))
    assert "the two parts are built for different batch sizes: 3 and 2" in text


def test_a_call_with_another_key_length_is_refused() -> None:
    spec = concat_keys(causal(), 4, unmasked(), 3)
    q, k, v = _qkv(1, 2, 2, 4, 8)
    text = _message(lambda: attnkit.attention(q, k, v, mask=spec))
    assert "is built for 7 keys but k has S=8" in text
    assert "k (B=1, Hkv=2, S=8, Dk=16)" in text
    assert "concat_keys(first, S1, second, S2) with S1 + S2 = 8" in text
    assert "give concat_keys the key counts of the two parts of k's keys" in text
    with pytest.raises(attnkit.AttentionInputError, match="built for 7 keys, not S = 8"):
        spec.to_dense(4, 8)
