"""selected_keys (DeepSeek-V3.2's sparse attention): the spec, its dense form against eager's
scatter, the gather kernel's forward and backward against the float64 oracle, and bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import masks
from attnkit.backends.blocked import gather, gather_native
from attnkit.masks.selected import select_heads
from oracle import reference_attention
from selected_cases import indices as _indices
from selected_cases import scatter as _scatter


def _check(q, k, v, spec, dense, *, backend="blocked", tol=2e-5):  # type: ignore[no-untyped-def]
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = attnkit.attention(q, k, v, mask=spec, backend=backend)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    want, _ = reference_attention(qd, kd, vd, mask=dense)
    want_g = torch.autograd.grad(want, (qd, kd, vd), g.double())
    assert (out.double() - want).abs().max() < tol
    for a, b in zip(got, want_g, strict=True):
        assert torch.isfinite(a).all()
        assert (a.double() - b).abs().max() < tol


CASES = [  # B, H, Hkv, per-kv-head indices, L, S, k, other rules
    (2, 4, 2, False, 9, 23, 5, "causal"),
    (2, 4, 2, True, 9, 23, 5, "causal"),
    (1, 6, 3, True, 7, 30, 8, "padding"),
    (2, 2, 2, False, 12, 12, 4, "window"),
    (1, 8, 1, False, 5, 40, 40, "none"),
    (2, 8, 2, True, 1, 300, 32, "causal"),  # a decode step
    (1, 4, 4, True, 16, 300, 64, "padding"),  # a few speculative tokens
    (1, 2, 1, False, 6, 40, 150, "causal"),  # k > S: keys repeated across blocks of entries
]


@pytest.mark.parametrize(("B", "H", "Hkv", "per_head", "L", "S", "k", "rule"), CASES)
def test_gather_matches_oracle(B, H, Hkv, per_head, L, S, k, rule):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(L * S + k)
    q = torch.randn(B, H, L, 16, generator=gen)
    kk = torch.randn(B, Hkv, S, 16, generator=gen)
    v = torch.randn(B, Hkv, S, 12, generator=gen)
    ind = _indices(B, Hkv if per_head else None, L, S, k, seed=k)
    spec = masks.selected_keys(ind, heads=H)
    extra = {
        "causal": masks.causal(),
        "padding": masks.padding(torch.tensor([S - 3] + [S] * (B - 1))),
        "window": masks.causal() & masks.sliding_window(5),
        "none": None,
    }[rule]
    full = spec if extra is None else extra & spec
    dense = _scatter(ind, S, H) & (torch.ones(1, 1, L, S, dtype=torch.bool))
    if extra is not None:
        dense = dense & extra.to_dense(L, S)
    assert torch.equal(full.to_dense(L, S).expand_as(dense), dense)  # eager's meaning
    assert "gather kernel" in str(attnkit.explain(q, kk, v, mask=full))
    _check(q, kk, v, full, dense)


@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[5]])
def test_torch_ops_path_matches_oracle(case, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The gather kernel's torch operations (where the C++ forward does not run)."""
    monkeypatch.setattr(gather_native, "kernel", lambda: None)
    test_gather_matches_oracle(*case)


def test_native_forward_runs_float32() -> None:
    if gather_native.kernel() is None:
        pytest.skip(f"the C++ gather kernel is not built here: {gather_native._gather.reason}")
    ind = _indices(1, None, 4, 9, 3, seed=0)
    p = gather.plan(masks.selected_keys(ind), None, 4, 9, torch.float32)
    assert p is not None
    assert p.checks_finite
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 9, 8)
    assert gather._native(p, q, k, k, 0.3) is not None
    assert gather._native(p, q.double(), k.double(), k.double(), 0.3) is None
    out, lse, finite = gather._native(p, q, k, k, 0.3)  # type: ignore[misc]
    assert finite
    inputs = gather._native_inputs(p, q)
    assert inputs is not None
    dout = torch.ones(()).expand_as(out)  # what out.sum().backward() hands over
    assert gather_native.backward(q, k, k, out, dout, lse, *inputs, 0.3) is not None


def test_strided_cache_views() -> None:
    """K/V as views of a longer cache buffer (the rows read in place, strides as given)."""
    q = torch.randn(1, 4, 3, 8)
    cache_k, cache_v = torch.randn(1, 2, 50, 8), torch.randn(1, 2, 50, 6)
    k, v = cache_k[:, :, :20], cache_v[:, :, :20]
    ind = _indices(1, 2, 3, 20, 7, seed=5)
    spec = masks.selected_keys(ind, heads=4) & masks.causal()
    _check(q, k, v, spec, _scatter(ind, 20, 4) & masks.causal().to_dense(3, 20))


@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_dense_backends_take_the_scattered_mask(backend: str) -> None:
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8)
    ind = _indices(2, 2, 6, 10, 3, seed=1)
    spec = masks.causal() & masks.selected_keys(ind, heads=4)
    dense = _scatter(ind, 10, 4) & masks.causal().to_dense(6, 10)
    _check(q, k, v, spec, dense, backend=backend)


@settings(max_examples=25, deadline=None)
@given(
    L=st.integers(1, 12),
    S=st.integers(1, 24),
    k=st.integers(0, 6),
    g=st.sampled_from([1, 2]),
    per_head=st.booleans(),
    seed=st.integers(0, 10_000),
    int32=st.booleans(),
)
def test_sweep(L: int, S: int, k: int, g: int, per_head: bool, seed: int, int32: bool) -> None:
    """Random sizes; int32 indices too (what transformers' DSA indexer returns)."""
    B, Hkv = 2, 2
    H = Hkv * g
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, 8, generator=gen)
    kk, v = torch.randn(B, Hkv, S, 8, generator=gen), torch.randn(B, Hkv, S, 8, generator=gen)
    ind = _indices(B, Hkv if per_head else None, L, S, k, seed)
    ind = ind.int() if int32 else ind
    spec = masks.selected_keys(ind, heads=H) & masks.causal()
    dense = _scatter(ind, S, H) & masks.causal().to_dense(L, S)
    _check(q, kk, v, spec, dense)


def test_empty_rows_give_zero_and_no_nan() -> None:
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    ind = torch.full((1, 4, 3), -1)
    ind[0, 1] = torch.tensor([5, 5, -1])  # causal blocks key 5 for query 1 (off = 2): empty
    ind[0, 3] = torch.tensor([0, 5, 5])
    spec = masks.causal() & masks.selected_keys(ind)
    q.requires_grad_()
    out = attnkit.attention(q, k, v, mask=spec, backend="blocked")
    assert torch.equal(out[0, :, :3], torch.zeros(2, 3, 8))
    (dq,) = torch.autograd.grad(out.sum(), q)
    assert torch.isfinite(dq).all()
    assert torch.equal(dq[0, :, :3], torch.zeros(2, 3, 8))


def test_duplicates_count_once() -> None:
    q, k, v = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)
    twice = masks.selected_keys(torch.tensor([[[1, 1, 1, 2]]]))
    once = masks.selected_keys(torch.tensor([[[1, 2, -1, -1]]]))
    a = attnkit.attention(q, k, v, mask=twice, backend="blocked")
    b = attnkit.attention(q, k, v, mask=once, backend="blocked")
    torch.testing.assert_close(a, b)


def test_key_str_and_explain_never_build_l_by_s() -> None:
    ind = torch.randint(0, 100_000, (1, 3, 4))
    spec = masks.selected_keys(ind)
    key = spec.key()
    assert key == spec.key()
    assert hash(key) is not None
    assert not any(isinstance(x, bytes) for x in key)  # the index bytes are not copied
    ind.add_(0)  # an in-place edit changes the key (version)
    assert spec.key() != key
    assert "selected_keys(<(B=1, L=3, k=4) int64>)" in repr(spec)
    assert "query 0: 4 keys" in str(spec) or "query 0:" in str(spec)
    assert str(masks.causal() & masks.selected_keys(torch.tensor([[[0], [1]]]))).endswith(
        "1 .\n. 1"
    )
    assert not spec.allows_all(3, 100_000)


def test_or_and_not_are_refused() -> None:
    spec = masks.selected_keys(torch.zeros(1, 2, 1, dtype=torch.long))
    with pytest.raises(attnkit.AttentionInputError, match="combines with & only"):
        _ = masks.causal() | spec
    with pytest.raises(attnkit.AttentionInputError, match="combines with & only"):
        _ = spec | masks.causal()
    with pytest.raises(attnkit.AttentionInputError, match="cannot be inverted"):
        _ = ~(spec & masks.causal())


def test_softcap_runs_on_the_tiles_and_matches_oracle() -> None:
    spec = masks.selected_keys(torch.zeros(1, 2, 1, dtype=torch.long))
    assert gather.plan(spec, 30.0, 2, 4) is None
    assert gather.plan(spec, None, 2, 4) is not None
    ind = _indices(2, 2, 30, 40, 6, seed=3)
    full = masks.selected_keys(ind, heads=4) & masks.causal()
    q, k = torch.randn(2, 4, 30, 8, requires_grad=True), torch.randn(2, 2, 40, 8)
    out = attnkit.attention(q, k, k, mask=full, backend="blocked", softcap=5.0)
    want, _ = reference_attention(q.double(), k, k, mask=full.to_dense(30, 40), softcap=5.0)
    assert (out.double() - want).abs().max() < 2e-5


def _q_k(B: int = 1, H: int = 4, Hkv: int = 2, L: int = 3, S: int = 5):  # type: ignore[no-untyped-def]
    return torch.randn(B, H, L, 8), torch.randn(B, Hkv, S, 8), torch.randn(B, Hkv, S, 8)


BAD = [
    (torch.zeros(1, 3, 2), "must be an integer tensor", "dtype=torch.float32"),
    (torch.zeros(3, 2, dtype=torch.long), "is 2-D", "indices (2-D: 3, 2)"),
]


@pytest.mark.parametrize(("indices", "problem", "got"), BAD)
def test_constructor_refuses(indices: torch.Tensor, problem: str, got: str) -> None:
    with pytest.raises(attnkit.AttentionInputError) as e:
        masks.selected_keys(indices)
    msg = str(e.value)
    assert problem in msg
    assert got in msg
    assert "expected:" in msg
    assert "fix:" in msg
    assert "argument" in msg or "indices" in msg


def test_heads_refused_when_not_a_multiple() -> None:
    with pytest.raises(attnkit.AttentionInputError, match="not a multiple") as e:
        masks.selected_keys(torch.zeros(1, 2, 3, 2, dtype=torch.long), heads=3)
    assert "q.shape[1]" in str(e.value)


CALL_BAD = [  # indices, heads, what the message says, the expected part
    (torch.zeros(2, 3, 2, dtype=torch.long), None, "for a batch of 2 but q has B=1", "B=1"),
    (torch.zeros(1, 4, 2, dtype=torch.long), None, "for 4 queries but q has L=3", "L=3"),
    (torch.zeros(1, 3, 3, 2, dtype=torch.long), 6, "for 3 heads but k has Hkv=2", "Hkv=2"),
    (torch.zeros(1, 2, 3, 2, dtype=torch.long), None, "built for 2 query heads", "heads=4"),
    (torch.tensor([[[0, 5], [0, 1], [1, 2]]]), None, "hold 5, outside the 5 keys", "S=5"),
    (torch.tensor([[[0, -2], [0, 1], [1, 2]]]), None, "hold -2, outside", "-1 <= indices"),
]


@pytest.mark.parametrize(("indices", "heads", "problem", "expected"), CALL_BAD)
def test_call_refuses(
    indices: torch.Tensor, heads: int | None, problem: str, expected: str
) -> None:
    q, k, v = _q_k()
    spec = masks.causal() & masks.selected_keys(indices, heads=heads)
    for backend in ("blocked", "math"):
        with pytest.raises(attnkit.AttentionInputError) as e:
            attnkit.attention(q, k, v, mask=spec, backend=backend)
        msg = str(e.value)
        assert problem in msg, msg
        assert expected in msg
        assert "got:" in msg
        assert "indices (" in msg
        assert "fix:" in msg


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["float32", "bfloat16", "float16"]
)
@pytest.mark.parametrize("where", ["selected key", "unselected key", "value", "query"])
def test_nan_and_inf_follow_the_rule(where: str, dtype: torch.dtype) -> None:
    """A NaN/inf key or value reaches only the rows that select it (and may attend to it); a
    bad query row is NaN: the C++ forward reports what it reads (in the input dtype: bfloat16
    and float16 are read in place), the dispatcher's exact rule runs, as ``math`` gives it."""
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, n, 8, generator=gen).to(dtype) for n in (4, 10, 10))
    ind = torch.tensor([[[9, 0, 1], [2, 3, -1], [3, 3, 4], [5, 6, 9]]])
    spec = masks.causal() & masks.selected_keys(ind)
    if where == "selected key":
        k[0, 1, 3] = float("nan")
    elif where == "unselected key":
        k[0, 0, 8] = float("inf")
    elif where == "value":
        v[0, 0, 9] = float("nan")
    else:
        q[0, 1, 2] = float("inf")
    got = attnkit.attention(q, k, v, mask=spec, backend="blocked")
    want = attnkit.attention(q, k, v, mask=spec, backend="math")
    assert got.dtype == dtype
    assert torch.equal(got.isnan(), want.isnan())
    assert bool(got.isnan().any()) == (where != "unselected key")
    torch.testing.assert_close(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_block_plans_of_a_split_sequence_merge_to_the_oracle(dtype: torch.dtype) -> None:
    """What ring attention runs: the gather kernel on each (query chunk, key chunk) block
    (:func:`gather.block_plan`: the chunk's rows, its keys' entries, the other rules at global
    positions); merged outputs and summed gradients equal the whole call's oracle."""
    from attnkit.backends.blocked import BlockAt, backward_from_lse, forward_with_lse, merge
    from attnkit.backends.blocked.blocks import BlockPlan
    from attnkit.backends.blocked.rowspan import NOT_SPANS

    L, S, H, Hkv = 12, 20, 4, 2
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, n, 8, generator=gen, dtype=dtype)
               for h, n in ((H, L), (Hkv, S), (Hkv, S)))  # fmt: skip
    dout = torch.randn(2, H, L, 8, generator=gen, dtype=dtype)
    ind = _indices(2, Hkv, L, S, 6, seed=4)
    spec = masks.causal() & masks.selected_keys(ind, heads=H)
    rows, keys = [(0, 5), (5, 7)], [(0, 8), (8, 3), (11, 9)]

    def plan(r: tuple[int, int], c: tuple[int, int]) -> dict[str, object]:
        p = gather.block_plan(spec, None, r, c, S - L, dtype, q.device)
        assert p is not None
        assert p.native == (dtype == torch.float32 and gather_native.kernel() is not None)
        whole = BlockPlan(spec, r[0], c[0], S - L, NOT_SPANS, None, None, p)
        return {"mask": spec, "scale": 0.3, "at": BlockAt(r[0], c[0], L, S), "plan": whole}

    def block(t: torch.Tensor, span: tuple[int, int]) -> torch.Tensor:
        return t.narrow(2, *span)

    out = torch.zeros(2, H, L, 8, dtype=dtype)
    lse = torch.full((2, H, L), float("-inf"), dtype=dtype)
    for r in rows:
        for c in keys:
            o, lo = forward_with_lse(block(q, r), block(k, c), block(v, c), **plan(r, c))
            merge(block(out, r), lse.narrow(2, *r), o.to(dtype), lo.to(dtype))
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for r in rows:
        for c in keys:
            saved = (block(out, r), block(dout, r), lse.narrow(2, *r))
            parts = backward_from_lse(block(q, r), block(k, c), block(v, c), *saved, **plan(r, c))
            for g, part, span in zip(grads, parts, (r, c, c), strict=True):
                block(g, span).add_(part.to(dtype))
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    dense = _scatter(ind, S, H) & masks.causal().to_dense(L, S)
    want, _ = reference_attention(qd, kd, vd, mask=dense, scale=0.3)
    want_g = torch.autograd.grad(want, (qd, kd, vd), dout.double())
    tol = 2e-5 if dtype == torch.float32 else 1e-12
    assert (out.double() - want).abs().max() < tol
    for a, b in zip(grads, want_g, strict=True):
        assert (a.double() - b).abs().max() < tol


def test_select_heads_slices_the_indices_of_whole_groups() -> None:
    """A group of query heads that is whole key/value heads gets those heads' indices (the
    gather kernel runs it); another range is a head slice of the spec; eager's meaning kept."""
    ind = _indices(1, 3, 5, 9, 4, seed=6)
    spec = masks.causal() & masks.selected_keys(ind, heads=6)
    part = select_heads(spec, 2, 6)
    assert gather.plan(part, None, 5, 9) is not None
    assert torch.equal(part.to_dense(5, 9), spec.to_dense(5, 9)[:, 2:6])
    odd = select_heads(spec, 1, 3)
    assert gather.plan(odd, None, 5, 9) is None  # the tiles run a slice of a group
    assert torch.equal(odd.to_dense(5, 9), spec.to_dense(5, 9)[:, 1:3])


@pytest.mark.parametrize("slices", [0, 1, 3, 40])
def test_native_backward_in_slices_of_rows_matches_oracle(
    slices: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The C++ backward split into slices of query rows per key/value head (each adding into
    dK/dV rows of its own, summed after): one key/value head, keys selected by many rows (the
    adds of different slices land on the same dK/dV rows); more slices than rows included."""
    if gather_native.kernel() is None:
        pytest.skip(f"the C++ gather kernel is not built here: {gather_native._gather.reason}")
    monkeypatch.setattr(gather_native, "ROW_SLICES", slices)
    gen = torch.Generator().manual_seed(slices)
    q, k, v = (torch.randn(1, h, n, 8, generator=gen) for h, n in ((3, 37), (1, 6), (1, 6)))
    ind = torch.randint(-1, 6, (1, 37, 5), generator=gen)
    spec = masks.causal() & masks.selected_keys(ind)
    _check(q, k, v, spec, _scatter(ind, 6, 3) & masks.causal().to_dense(37, 6))


def test_a_shard_of_ring_attention_wants_the_whole_sequences_indices() -> None:
    """Ring attention checks the indices against the whole sequence (its shards' queries and
    keys): one shard's rows are refused with a message that says so."""
    from attnkit.call import Dims
    from attnkit.mask_checks import check_mask

    q = torch.randn(1, 2, 4, 8)  # a shard of 4 of the 8 queries, over 2 ranks
    dims = Dims(B=1, H=2, Hkv=2, L=4, S=4, Dk=8, Dv=8)
    whole = masks.selected_keys(torch.randint(-1, 8, (1, 8, 3)))
    check_mask(whole, q, dims, where="ring", key_shards=2)  # the whole sequence's: accepted
    with pytest.raises(attnkit.AttentionInputError) as e:
        check_mask(masks.selected_keys(torch.zeros(1, 4, 3, dtype=torch.long)), q, dims,
                   where="ring", key_shards=2)  # fmt: skip
    assert e.value.argument == "mask"
    msg = str(e.value)
    assert "for 4 queries but the sequence has L=8 (2 shards of 4 queries)" in msg
    assert "indices (B=1, L=4, k=3)" in msg
    assert "one row per query of the whole sequence" in msg
    assert "not this shard's rows" in msg
