"""Mask functions as specs: ``attnkit.masks.from_function(fn)``.

A function written to mean a built-in rule gives the built-in rule's block map, output and
gradients on the blocked backend, and both match the float64 oracle; blocks are classified from
the function's values, cached, and evaluated only inside partial blocks.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit.backends.blocked.blocks import clear_plans
from attnkit.masks import (
    EMPTY,
    FULL,
    PARTIAL,
    as_spec,
    causal,
    document,
    from_function,
    row_spans,
    sliding_window,
)
from attnkit.masks import function as fmod
from attnkit.masks.function_runs import RUN_CHUNK_PAIRS, row_runs
from oracle import reference_attention, within_naive

Fn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _causal_fn(L: int, S: int) -> Fn:
    return lambda b, h, q, kv: kv <= q + (S - L)


def _window_fn(L: int, S: int, w: int) -> Fn:
    return lambda b, h, q, kv: (kv <= q + (S - L)) & (q + (S - L) - kv < w)


def _document_fn(ids: torch.Tensor, L: int, S: int) -> Fn:
    pos = lambda q: q + (S - L)  # noqa: E731 (end-aligned query position)
    return lambda b, h, q, kv: (ids[pos(q).clamp(0, S - 1)] == ids[kv]) & (kv <= pos(q))


def _pairs(L: int, S: int, kind: str) -> tuple[Fn, attnkit.masks.MaskSpec]:
    """A function and the built-in spec it is written to equal."""
    if kind == "causal":
        return _causal_fn(L, S), causal()
    if kind == "window":
        return _window_fn(L, S, 7), causal() & sliding_window(7)
    if kind == "document":
        ids = torch.arange(S) // 11
        return _document_fn(ids, L, S), document(ids) & causal()
    fn = _holes_fn(L, S)  # not one run per row: tiles, the function evaluated in partial blocks
    return fn, as_spec(from_function(fn).to_dense(L, S))


def _holes_fn(L: int, S: int) -> Fn:
    return lambda b, h, q, kv: (kv <= q + (S - L)) & ((q + (S - L) - kv) % 5 != 2)


def _qkv(B: int, H: int, Hkv: int, L: int, S: int, D: int = 16) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(L * 131 + S * 7 + H)
    q = torch.randn(B, H, L, D, generator=g, requires_grad=True)
    k = torch.randn(B, Hkv, S, D, generator=g, requires_grad=True)
    v = torch.randn(B, Hkv, S, D, generator=g, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize("kind", ["causal", "window", "document", "holes"])
@pytest.mark.parametrize(
    ("B", "H", "Hkv", "L", "S"),
    [(1, 2, 2, 64, 64), (2, 4, 2, 70, 150), (1, 6, 3, 130, 45), (2, 4, 1, 97, 97)],
)
def test_a_function_equals_the_built_in_spec_and_the_oracle(
    kind: str, B: int, H: int, Hkv: int, L: int, S: int
) -> None:
    fn, builtin = _pairs(L, S, kind)
    spec = from_function(fn)
    assert torch.equal(spec.to_dense(L, S), builtin.to_dense(L, S))
    q, k, v = _qkv(B, H, Hkv, L, S)
    dout = torch.randn(B, H, L, 16, generator=torch.Generator().manual_seed(1))
    results = []
    for s in (spec, builtin):
        out = attnkit.attention(q, k, v, mask=s, backend="blocked")
        results.append((out, *torch.autograd.grad(out, (q, k, v), dout)))
    dense = builtin.to_dense(L, S)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = reference_attention(q64, k64, v64, mask=dense)[0]
    wants = (want, *torch.autograd.grad(want, (q64, k64, v64), dout.double()))
    qn, kn, vn = (t.detach().clone().requires_grad_() for t in (q, k, v))
    naive = reference_attention(qn, kn, vn, mask=dense, dtype=torch.float32)[0]
    naives = (naive, *torch.autograd.grad(naive, (qn, kn, vn), dout))
    for got_fn, got_spec, w, n, name in zip(*results, wants, naives, "oqkv", strict=True):
        torch.testing.assert_close(got_fn, got_spec, atol=2e-6, rtol=1e-5)
        within_naive(got_fn, w, n, grad=name != "o", what=f"{kind} {name}")


def _dense_states(spec: attnkit.masks.MaskSpec, L: int, S: int, bq: int, bk: int) -> torch.Tensor:
    d = spec.to_dense(L, S)[0, 0]
    nq, nk = -(-L // bq), -(-S // bk)
    out = torch.empty(nq, nk, dtype=torch.uint8)
    for i in range(nq):
        for j in range(nk):
            t = d[i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
            out[i, j] = FULL if bool(t.all()) else (PARTIAL if bool(t.any()) else EMPTY)
    return out


@settings(max_examples=25, deadline=None)
@given(
    L=st.integers(1, 90),
    S=st.integers(1, 90),
    bq=st.sampled_from([4, 8, 16, 32]),
    bk=st.sampled_from([4, 8, 16]),
    a=st.integers(1, 9),
    c=st.integers(0, 40),
)
def test_the_block_map_classifies_blocks_as_the_dense_mask_does(
    L: int, S: int, bq: int, bk: int, a: int, c: int
) -> None:
    def fn(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return ((q * a + kv) % 7 != 0) & (kv < q + c) | (kv > q + 3 * c)

    spec = from_function(fn)
    got = spec.block_map(L, S, bq, bk).state[0, 0]
    assert torch.equal(got, _dense_states(spec, L, S, bq, bk))


@settings(max_examples=25, deadline=None)
@given(
    L=st.integers(1, 60),
    S=st.integers(1, 60),
    starts=st.tuples(st.integers(0, 30), st.integers(0, 30)),
    a=st.integers(0, 8),
    c=st.integers(-20, 20),
    d=st.integers(-20, 20),
    hole=st.booleans(),
)
def test_runs_of_keys_are_the_dense_masks_runs(
    L: int, S: int, starts: tuple[int, int], a: int, c: int, d: int, hole: bool
) -> None:
    def fn(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        ok = (kv >= q * a // 4 + c) & (kv <= q + d)
        return ok & (kv != q + 2) if hole else ok

    q0, k0 = starts
    spec = from_function(fn)
    rows = torch.arange(q0, q0 + L).view(1, 1, L, 1)
    keys = torch.arange(k0, k0 + S).view(1, 1, 1, S)
    dense = fn(rows, rows, rows, keys)[0, 0]  # (L, S) at global positions
    spans = row_spans(spec, L, S, q_start=q0, k_start=k0)
    idx = torch.arange(S)
    one_run = all(
        not bool(r.any()) or bool(r[idx[r].min() : idx[r].max() + 1].all()) for r in dense
    )
    assert (spans is not None) == one_run
    if spans is not None:
        lo, hi = spans
        got = (idx[None] >= lo[0][:, None]) & (idx[None] <= hi[0][:, None])
        assert torch.equal(got, dense)


def _dense_runs(ok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each row's first and last True of ``(B, n, S)`` bools, read key by key."""
    S = ok.shape[-1]
    firsts, lasts = [], []
    for row in ok.reshape(-1, S).tolist():
        at = [j for j, x in enumerate(row) if x]
        if at and at[-1] - at[0] + 1 != len(at):
            return None
        firsts.append(at[0] if at else S)
        lasts.append(at[-1] if at else -1)
    shape = ok.shape[:-1]
    return torch.tensor(firsts).view(shape), torch.tensor(lasts).view(shape)


@settings(max_examples=300, deadline=None)
@given(
    B=st.integers(1, 3),
    n=st.integers(1, 5),
    S=st.integers(1, 40),
    data=st.data(),
)
def test_row_runs_read_eight_keys_a_word_as_the_keys_say(
    B: int, n: int, S: int, data: st.DataObject
) -> None:
    """Runs and holes anywhere: inside one word, across words, at the ends, in a padded last
    word (S not a multiple of 8), a row that sees nothing, a non-contiguous tensor."""
    ok = torch.zeros(B, n, S, dtype=torch.bool)
    for r in range(B * n):
        lo = data.draw(st.integers(0, S))
        hi = data.draw(st.integers(lo - 1, S - 1))
        ok.view(-1, S)[r, lo : hi + 1] = True
        if data.draw(st.booleans()):  # a hole (or an extra key) anywhere
            ok.view(-1, S)[r, data.draw(st.integers(0, S - 1))] ^= True
    if data.draw(st.booleans()):
        ok = ok.transpose(0, 1).contiguous().transpose(0, 1)
    want, got = _dense_runs(ok), row_runs(ok)
    assert (want is None) == (got is None)
    if want is not None and got is not None:
        assert torch.equal(want[0], got[0])
        assert torch.equal(want[1], got[1])


def test_runs_of_a_function_of_the_batch_and_with_holes() -> None:
    """A declared batch gives each batch row its runs; a hole in one batch row's run (and
    only there) makes the answer None."""
    L, S = 37, 53

    def shifted(
        b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
    ) -> torch.Tensor:
        return (kv <= q + 3 * b) & (kv > q - 5)

    def holed(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return shifted(b, h, q, kv) & ((b == 0) | (kv != q))

    spans = row_spans(from_function(shifted, batch=3), L, S)
    assert spans is not None
    i = torch.arange(L)
    for b in range(3):
        assert torch.equal(spans[0][b], (i - 4).clamp(0, S))
        assert torch.equal(spans[1][b], (i + 3 * b).clamp(-1, S - 1))
    assert row_spans(from_function(holed, batch=3), L, S) is None
    only_first = from_function(lambda b, h, q, kv: holed(b, h, q, kv) & (b == 0), batch=3)
    lo, hi = row_spans(only_first, L, S) or (None, None)  # rows of b = 1, 2 see nothing
    assert lo is not None
    assert hi is not None
    assert torch.equal(lo[0], (i - 4).clamp(0, S))
    assert torch.equal(hi[0], i.clamp(-1, S - 1))
    assert bool((lo[1:] == S).all())
    assert bool((hi[1:] == -1).all())


def test_combinations_with_built_in_specs_match_the_oracle() -> None:
    L = S = 96
    f = from_function(lambda b, h, q, kv: (q // 16) == (kv // 16))  # bidirectional 16-blocks
    q, k, v = _qkv(1, 2, 2, L, S)
    for spec in (f & causal(), f | (causal() & sliding_window(5)), causal() & f & f):
        dense = spec.to_dense(L, S)
        a = causal().to_dense(L, S)
        blocks = (torch.arange(L)[:, None] // 16) == (torch.arange(S)[None] // 16)
        assert dense.shape == (1, 1, L, S)
        assert bool((dense[0, 0] <= (blocks | a[0, 0])).all())
        out = attnkit.attention(q, k, v, mask=spec, backend="blocked")
        want = reference_attention(q.double(), k.double(), v.double(), mask=dense)[0]
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=0)
    assert torch.equal((f & causal()).to_dense(L, S)[0, 0], blocks & a[0, 0])


def test_functions_of_the_batch_and_the_head_need_them_declared() -> None:
    B, H, L = 2, 4, 40
    ids = torch.stack([torch.arange(L) // 10, torch.arange(L) // 4])  # (B, S)
    per_batch = from_function(lambda b, h, q, kv: ids[b, q] == ids[b, kv], batch=B)
    per_head = from_function(lambda b, h, q, kv: (q - kv).abs() <= h, heads=H)
    q, k, v = _qkv(B, H, H, L, L)
    for spec in (per_batch, per_head, per_batch & per_head & causal()):
        dense = spec.to_dense(L, L) if not spec.heads else _dense_bh(spec, B, H, L)
        out = attnkit.attention(q, k, v, mask=spec, backend="blocked")
        want = reference_attention(q.double(), k.double(), v.double(), mask=dense)[0]
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=0)
    with pytest.raises(attnkit.AttentionInputError, match="depends on `b` but no `batch`"):
        from_function(lambda b, h, q, kv: ids[b, q] == ids[b, kv])
    with pytest.raises(attnkit.AttentionInputError, match="depends on `h` but no `heads`"):
        from_function(lambda b, h, q, kv: (q - kv).abs() <= h)


def _dense_bh(spec: attnkit.masks.MaskSpec, B: int, H: int, L: int) -> torch.Tensor:
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    i = torch.arange(L)
    return spec.allowed(b, h, i.view(1, 1, L, 1), i.view(1, 1, 1, L), 0).expand(B, H, L, L)


def test_the_block_map_is_cached_per_function_and_captured_tensors() -> None:
    calls = Counter()
    lengths = torch.tensor([300])

    def fn(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        calls.n += 1
        return (kv <= q) & (kv < lengths[0]) & (kv % 3 != 1)  # holes: tiles, block states

    clear_plans()
    fmod.clear_cache()
    spec = from_function(fn)
    L = 512
    q, k, v = _qkv(1, 2, 2, L, L)
    attnkit.attention(q, k, v, mask=spec, backend="blocked").sum().backward()
    first = calls.n
    assert first > 0
    attnkit.attention(q, k, v, mask=spec, backend="blocked").sum().backward()
    assert calls.n == first  # plans and block states cached: fn not called again
    # a new spec of the same function and tensors (each layer building its own), with the
    # plans forgotten: the block states come from the cache
    clear_plans()
    hits = fmod.cache_info()["hits"]
    attnkit.attention(q, k, v, mask=from_function(fn), backend="blocked")
    assert fmod.cache_info()["hits"] > hits
    # an in-place edit of a captured tensor is another mask: classified again, same spec
    misses = fmod.cache_info()["misses"]
    lengths.fill_(100)
    out = attnkit.attention(q, k, v, mask=spec, backend="blocked")
    assert fmod.cache_info()["misses"] > misses
    keys = torch.arange(L)
    m = torch.ones(L, L, dtype=torch.bool).tril() & (keys < 100) & (keys % 3 != 1)
    want = reference_attention(q.double(), k.double(), v.double(), mask=m)[0]
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=0)


class Counter:
    """Calls of a mask function (captured by identity: its count is no part of the key)."""

    n = 0


def test_no_call_of_the_function_spans_l_by_s() -> None:
    seen: list[int] = []

    def fn(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        seen.append(torch.broadcast_tensors(b, h, q, kv)[0].numel())
        return (kv <= q) & (q - kv < 64)

    L = 4096
    clear_plans()
    fmod.clear_cache()
    spec = from_function(fn)
    q, k, v = _qkv(1, 1, 1, L, L, D=8)
    out = attnkit.attention(q, k, v, mask=spec, backend="blocked")
    assert out.shape == (1, 1, L, 8)
    assert max(seen) <= max(fmod.CHUNK_PAIRS, RUN_CHUNK_PAIRS) < L * L
    assert not spec.allows_all(L, L)  # one L x S block: not evaluated (would be L x S work)


def test_explain_shows_the_density_of_the_block_map() -> None:
    L = 256
    q, k, v = _qkv(1, 2, 2, L, L)
    spec = from_function(_holes_fn(L, L))
    text = str(attnkit.explain(q, k, v, mask=spec, backend="blocked"))
    assert "from_function(" in text
    assert "blocks empty (" in text
    assert "% partial, " in text
    assert "% full)" in text


def test_one_run_of_keys_per_row_runs_on_the_row_span_kernel() -> None:
    L, S = 300, 340
    q, k, v = _qkv(1, 4, 2, L, S)
    window = from_function(_window_fn(L, S, 50))
    text = str(attnkit.explain(q, k, v, mask=window, backend="blocked"))
    assert "row spans of from_function(" in text
    assert "no tiles" in text
    for spec in (window & document(torch.arange(S) // 40), window | causal()):
        text = str(attnkit.explain(q, k, v, mask=spec, backend="blocked"))
        assert "row spans of " in text
        out = attnkit.attention(q, k, v, mask=spec, backend="blocked")
        want = reference_attention(q.double(), k.double(), v.double(), mask=spec.to_dense(L, S))
        torch.testing.assert_close(out.double(), want[0], atol=1e-5, rtol=0)
    holes = from_function(_holes_fn(L, S))
    assert "row spans" not in str(attnkit.explain(q, k, v, mask=holes, backend="blocked"))


def test_str_repr_key_and_digest_never_materialise() -> None:
    def window(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (kv <= q) & (q - kv < 3)

    spec = from_function(window)
    assert (
        repr(spec)
        == "from_function(test_str_repr_key_and_digest_never_materialise.<locals>.window)"
    )
    assert str(spec).splitlines()[4] == ". 1 1 1 . . . ."  # row 3: keys 1 to 3
    assert spec.key() == from_function(window).key()
    assert spec.digest() == from_function(window).digest()
    assert repr(from_function(window, heads=4)).endswith(", heads=4)")
    assert hash(spec.key()) == hash(from_function(window).key())


def test_under_torch_compile_the_blocked_op_runs_it() -> None:
    L = 80
    spec = from_function(_window_fn(L, L, 9))
    q, k, v = _qkv(1, 2, 1, L, L)
    graphs: list[str] = []

    def backend(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]):  # type: ignore[no-untyped-def]
        graphs.append(gm.code)
        return gm.forward

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attnkit.attention(q, k, v, mask=spec, backend="blocked")

    out = torch.compile(f, fullgraph=True, backend=backend)(q, k, v)
    assert any("blocked_attention" in g for g in graphs)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    eager = attnkit.attention(q, k, v, mask=causal() & sliding_window(9), backend="blocked")
    want = torch.autograd.grad(eager.sum(), (q, k, v))
    torch.testing.assert_close(out, eager, atol=1e-6, rtol=1e-5)
    for a, b in zip(grads, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_built_inside_a_compiled_function_it_says_build_it_outside() -> None:
    q, k, v = _qkv(1, 2, 2, 40, 40)

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        spec = from_function(lambda b, h, qi, kv: kv <= qi)
        return attnkit.attention(q, k, v, mask=spec)

    with pytest.raises(Exception, match=r"cannot be built inside a function torch\.compile traces"):
        torch.compile(f, fullgraph=True, backend="eager")(q, k, v)


@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_dense_backends_take_its_dense_form(backend: str) -> None:
    L, S = 33, 50
    q, k, v = _qkv(2, 4, 2, L, S)
    fn, builtin = _pairs(L, S, "window")
    got = attnkit.attention(q, k, v, mask=from_function(fn), backend=backend)
    want = attnkit.attention(q, k, v, mask=builtin, backend=backend)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def _two(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    return torch.ones(3, 5, dtype=torch.bool)  # not the shape it was called with


def _raises(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    raise KeyError("no such table")


@pytest.mark.parametrize(
    ("fn", "argument", "message"),
    [
        (42, "fn", "`fn` must be a callable fn(b, h, q_idx, kv_idx)"),
        (lambda b, h, q, kv: (kv <= q).int(), "fn", "`fn` must return a bool tensor"),
        (lambda b, h, q, kv: True, "fn", "returned bool"),
        (_two, "fn", "the result of `fn` does not broadcast to the (b, h, q, kv) shape"),
        (_raises, "fn", "the mask function `fn` raised KeyError: 'no such table'"),
    ],
)
def test_bad_functions_are_refused(fn: object, argument: str, message: str) -> None:
    with pytest.raises(attnkit.AttentionInputError) as info:
        from_function(fn)  # type: ignore[arg-type]
    text = str(info.value)
    assert f"`{argument}`" in text
    assert message in text
    for part in ("got:", "expected:", "fix:"):
        assert part in text


def test_a_function_that_fails_on_some_block_is_refused_when_it_runs() -> None:
    table = torch.zeros(50, dtype=torch.bool)
    spec = from_function(lambda b, h, q, kv: table[kv] | (kv <= q))  # 50 keys only
    q, k, v = _qkv(1, 1, 1, 64, 64)
    with pytest.raises(
        attnkit.AttentionInputError, match="the mask function `fn` raised IndexError"
    ):
        attnkit.attention(q, k, v, mask=spec, backend="blocked")


def test_bad_batch_and_heads_are_refused() -> None:
    with pytest.raises(attnkit.AttentionInputError, match="`batch` must be a positive int"):
        from_function(lambda b, h, q, kv: kv <= q, batch=0)
    with pytest.raises(attnkit.AttentionInputError, match="`heads` must be a positive int"):
        from_function(lambda b, h, q, kv: kv <= q, heads=True)  # type: ignore[arg-type]
