"""NaN or inf in q, k or v: NaN in every row it can reach, on every backend, and nowhere else.

The rule, written out by the float64 oracle (``tests/oracle.py``): a query row that holds a
non-finite number, or may attend (after causal, mask, spec, window, padding) to a key holding
one, gives NaN output and NaN weights; a row that may attend to a value holding one gives NaN
output and its finite weights; every other row, and its gradient, is what it would be without
the bad entries. Before the fix, ``blocked`` gave finite rows for a NaN key (a NaN score taken
for a masked one) and every backend gave NaN to rows that could not see a NaN value.

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
Dk query/key head dim, Dv value head dim.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import AttentionCall, AttentionMaskWarning, KVCache, masks
from attnkit.backends import Backend, nonfinite, register_backend, unregister_backend
from attnkit.masks import MaskSpec
from calls import make_call
from oracle import naive_bound, reference_attention
from strategies import Sizes, qkv, span_specs, specs

SIZES = Sizes(
    batch=(1, 2),
    kv_heads=(1, 2),
    groups=(1, 2, 3),
    lengths=(1, 2, 5, 9, 17),
    head_dims=(4, 8),
    value_dims=(3, 8),
)
#: every backend the library registers, and auto: the rule is part of the contract each runs
#: under (:mod:`attnkit.backends`), so a new backend is held to it here with no test of its own
REGISTERED = attnkit.available_backends()
BACKENDS = ["auto", *REGISTERED]
BAD = (math.nan, math.inf, -math.inf)
MASK_KINDS = ["none", "bool", "float", "spec", "span spec", "causal", "causal+bool"]


@dataclass
class Case:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | MaskSpec | None
    causal: bool
    bad: list[tuple[str, tuple[int, ...], float]]
    extra: dict[str, object] = field(default_factory=dict)

    def oracle_mask(self) -> torch.Tensor | None:
        if isinstance(self.mask, MaskSpec):
            return self.mask.to_dense(self.q.shape[2], self.k.shape[2])
        return self.mask

    def __repr__(self) -> str:
        m = self.mask if isinstance(self.mask, MaskSpec | None) else tuple(self.mask.shape)
        return (
            f"Case(q={tuple(self.q.shape)}, k={tuple(self.k.shape)}, v={tuple(self.v.shape)}, "
            f"{self.q.dtype}, mask={m!r}, causal={self.causal}, bad={self.bad}, "
            f"extra={sorted(self.extra)})"
        )


@st.composite
def cases(draw: st.DrawFn, dtype: torch.dtype = torch.float64) -> Case:
    """Drawn sizes (GQA, L != S, Dv != Dk), mask and 1 to 3 non-finite entries, mostly in k and
    v, sometimes in q; now and then a soft-cap or sinks."""
    q, k, v = draw(qkv(SIZES, dtype))
    B, H, L, _ = q.shape
    S = k.shape[2]
    kind = draw(st.sampled_from(MASK_KINDS))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    shape = draw(st.sampled_from([(L, S), (B, 1, L, S), (1, H, L, S), (B, H, L, S)]))
    mask: torch.Tensor | MaskSpec | None = None
    if kind.endswith("bool"):
        mask = torch.rand(shape, generator=g) > 0.4
    elif kind == "float":
        mask = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
        mask = mask.masked_fill(torch.rand(shape, generator=g) < 0.4, -math.inf)
    elif kind == "spec":
        mask = draw(specs(B, L, S))
    elif kind == "span spec":
        mask = draw(span_specs(B, L, S))
    bad = []
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from("kkvvq"))
        t = {"q": q, "k": k, "v": v}[name]
        at = tuple(draw(st.integers(0, n - 1)) for n in t.shape)
        value = draw(st.sampled_from(BAD))
        t[at] = value
        bad.append((name, at, value))
    extra: dict[str, object] = draw(
        st.sampled_from(
            [{}, {}, {}, {"softcap": 2.5}, {"sinks": torch.linspace(-1, 1, H, dtype=dtype)}]
        )
    )
    return Case(q, k, v, mask, kind.startswith("causal"), bad, extra)


def _attention(case: Case, backend: str, **kw: object) -> torch.Tensor | attnkit.AttentionOutput:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AttentionMaskWarning)  # random masks may look inverted
        return attnkit.attention(
            case.q, case.k, case.v, mask=case.mask, causal=case.causal, backend=backend,
            **case.extra, **kw,
        )  # fmt: skip


def _servable(case: Case, backend: str, **kw: object) -> bool:
    if backend == "auto":
        return True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AttentionMaskWarning)
        verdicts = attnkit.explain(
            case.q, case.k, case.v, mask=case.mask, causal=case.causal, **case.extra, **kw
        ).verdicts
    return verdicts[backend] is None


def _skip_unless_served(
    backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: object
) -> None:
    """Skip a fixed-size test for a backend that serves no call of its kind (flex on CPU: one
    128 x 128 block, or a gradient); :func:`test_every_registered_backend_follows_the_rule`
    finds a call each backend serves."""
    if backend != "auto":
        why = attnkit.explain(q, k, v, **kw).verdicts[backend]  # type: ignore[arg-type]
        if why is not None:
            pytest.skip(f"{backend} cannot serve this call: {why}")


def _oracle(case: Case, **kw: object) -> tuple[torch.Tensor, torch.Tensor]:
    return reference_attention(
        case.q, case.k, case.v, mask=case.oracle_mask(), causal=case.causal,
        **case.extra, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _same_rows(got: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """NaN rows exactly where the oracle has them (the whole row), every other row finite and
    within ``tol`` of the oracle."""
    nan = ref.isnan().any(dim=-1)  # (B, H, L)
    assert torch.equal(ref.isnan().all(dim=-1), nan)  # the oracle itself: whole rows
    assert torch.equal(got.isnan().all(dim=-1), nan), (got.isnan().all(-1), nan)
    assert torch.isfinite(got[~nan]).all()
    assert _err(got[~nan], ref[~nan]) <= tol


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=60)
@given(case=cases(), weights=st.booleans())
def test_nonfinite_entries_reach_exactly_the_rows_that_see_them(
    case: Case, weights: bool, backend: str
) -> None:
    if not _servable(case, backend):
        return  # a backend's refusals are tested with finite inputs
    ref_out, ref_w = _oracle(case)
    if weights and _servable(case, backend, return_weights=True):
        res = _attention(case, backend, return_weights=True)
        assert isinstance(res, attnkit.AttentionOutput)
        assert res.weights is not None
        _same_rows(res.output, ref_out, 1e-10)
        _same_rows(res.weights, ref_w, 1e-10)
    else:
        out = _attention(case, backend)
        assert isinstance(out, torch.Tensor)
        _same_rows(out, ref_out, 1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=40)
@given(case=cases(torch.float32))
def test_float32_kernels_follow_the_rule(case: Case, backend: str) -> None:
    """float32: the row-span kernel and torch's fused CPU kernels (blocked's tiles, sdpa)."""
    if not _servable(case, backend):
        return
    ref_out, _ = _oracle(case)
    naive, _ = _oracle(case, dtype=torch.float32)
    nan = ref_out.isnan().any(dim=-1)
    out = _attention(case, backend)
    assert isinstance(out, torch.Tensor)
    _same_rows(out, ref_out, naive_bound(ref_out, naive, where=~nan))


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=40)
@given(case=cases())
def test_gradients_of_the_rows_that_cannot_see_them_match_the_oracle(
    case: Case, backend: str
) -> None:
    if not _servable(case, backend):
        return
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (case.q, case.k, case.v))
    leaf = Case(q, k, v, case.mask, case.causal, case.bad, case.extra)
    ref = _oracle(leaf)[0]
    nan = ref.isnan().any(dim=-1, keepdim=True)
    g = torch.Generator().manual_seed(len(case.bad))
    grad_out = torch.randn(ref.shape, generator=g, dtype=ref.dtype).masked_fill(nan, 0.0)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out, allow_unused=True)
    out = _attention(leaf, backend)
    assert isinstance(out, torch.Tensor)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    for name, got, want in zip("qkv", grads, ref_grads, strict=True):
        want = torch.zeros_like(got) if want is None else want
        assert torch.isfinite(got).all(), name
        assert _err(got, want) <= 1e-9, name


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_loss_that_reads_a_nan_row_gets_nan_gradients(backend: str) -> None:
    """As in torch's eager math, so that a gradient scaler skips the step."""
    q, k, v = _qkv()
    v[0, 1, 3, 2] = math.nan
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    _skip_unless_served(backend, q, k, v, causal=True)
    out = attnkit.attention(q, k, v, causal=True, backend=backend)
    assert out[0, 2:4, 3:].isnan().all()
    assert torch.isfinite(out[0, 2:4, :3]).all()
    out.sum().backward()
    assert q.grad is not None
    assert k.grad is not None
    assert v.grad is not None
    assert q.grad[0, 2:4, 3:].isnan().all()  # the rows that saw it
    assert torch.isfinite(q.grad[0, 2:4, :3]).all()
    assert torch.isfinite(q.grad[1]).all()
    assert k.grad[0, 1].isnan().any()
    assert torch.isfinite(k.grad[0, 0]).all()


def _qkv(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=g, dtype=dtype)  # (B, H, L, Dk)
    k = torch.randn(2, 2, 6, 8, generator=g, dtype=dtype)  # (B, Hkv, S, Dk)
    v = torch.randn(2, 2, 6, 8, generator=g, dtype=dtype)  # (B, Hkv, S, Dv)
    return q, k, v


@pytest.mark.parametrize("value", BAD, ids=str)
@pytest.mark.parametrize("where", ["key", "value"])
def test_the_weights_of_a_row_that_sees_a_bad_value_stay_finite(where: str, value: float) -> None:
    """The weights come from q and k: a bad value leaves them as they are; a bad key makes them
    NaN (its scores are not numbers), as the output."""
    q, k, v = _qkv()
    (k if where == "key" else v)[1, 0, 2, 1] = value  # key/value head 0: query heads 0 and 1
    res = attnkit.attention(q, k, v, causal=True, return_weights=True)
    assert res.weights is not None
    assert res.output[1, :2, 2:].isnan().all()  # rows 2.. of both query heads see key 2
    assert torch.isfinite(res.output[1, :2, :2]).all()
    assert torch.isfinite(res.output[0]).all()
    assert torch.isfinite(res.output[1, 2:]).all()  # the other key/value head
    if where == "key":
        assert res.weights[1, :2, 2:].isnan().all()
    else:
        ref_w = reference_attention(q, k, v, causal=True)[1]
        assert torch.isfinite(res.weights).all()
        torch.testing.assert_close(res.weights, ref_w.float(), atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("mask", "path"),
    [
        (masks.causal() & masks.sliding_window(3), "row-span kernel"),
        (~masks.sliding_window(2), "fused flash kernel"),
        (torch.tensor([[1, 1, 0, 1, 0, 1]] * 6, dtype=torch.bool).tril(), "a dense mask"),
    ],
    ids=["row spans", "tiles", "dense mask"],
)
def test_both_paths_of_blocked_follow_the_rule(mask: torch.Tensor | MaskSpec, path: str) -> None:
    q, k, v = _qkv()
    assert path in str(attnkit.explain(q, k, v, mask=mask, backend="blocked"))
    k[0, 1, 3, 0] = math.nan  # key/value head 1: query heads 2 and 3
    v[1, 0, 0, 4] = math.inf  # key/value head 0: query heads 0 and 1
    out = attnkit.attention(q, k, v, mask=mask, backend="blocked")
    dense = mask.to_dense(6, 6) if isinstance(mask, MaskSpec) else mask
    ref = reference_attention(q, k, v, mask=dense)[0]
    assert ref[0, 2:].isnan().any()
    assert ref[1, :2].isnan().any()
    _same_rows(out, ref, 1e-5)


def test_auto_on_a_long_causal_call_gives_nan_after_a_nan_key() -> None:
    """``auto`` takes ``blocked`` for causal calls of 1024 queries and more (the issue's case)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 1, 1024, 8, generator=g) for _ in range(3))
    k[0, 0, 700, 3] = math.nan
    assert attnkit.explain(q, k, v, causal=True).chosen == "blocked"
    out = attnkit.attention(q, k, v, causal=True)
    assert out[0, 0, 700:].isnan().all()
    ref = reference_attention(q[..., :700, :], k[..., :700, :], v[..., :700, :], causal=True)[0]
    torch.testing.assert_close(out[..., :700, :], ref.float(), atol=1e-5, rtol=0)


def test_a_shared_key_value_tensor_and_a_nan_query_together() -> None:
    q, k, _ = _qkv()
    k[0, 0, 5, 0] = -math.inf  # k is v: key and value 5 of head 0
    q[1, 3, 0, 0] = math.nan
    spec = masks.padding(torch.tensor([5, 6]))  # sequence 0 does not see key 5
    res = attnkit.attention(q, k, k, mask=spec, return_weights=True)
    assert res.weights is not None
    ref_out, ref_w = reference_attention(q, k, k, mask=spec.to_dense(6, 6))
    assert torch.isfinite(res.output[0]).all()
    _same_rows(res.output, ref_out, 1e-5)
    _same_rows(res.weights, ref_w, 1e-5)


def _contract_cases() -> list[Case]:
    """Calls with NaN and inf in q, k and v that every registered backend serves one of, the
    smallest first: float64 and float32 with a spec, and one past flex's one-block refusal
    (the shapes and spec structure of tests/backends/test_flex.py, whose kernel it reuses)."""
    found = []
    for dtype in (torch.float64, torch.float32):
        g = torch.Generator().manual_seed(5)
        q = torch.randn(2, 4, 6, 8, generator=g, dtype=dtype)
        k = torch.randn(2, 2, 9, 8, generator=g, dtype=dtype)
        v = torch.randn(2, 2, 9, 8, generator=g, dtype=dtype)
        spec = masks.causal() & masks.sliding_window(4)
        bad = [
            ("k", (0, 1, 5, 3), math.nan),
            ("v", (1, 0, 8, 0), math.inf),
            ("q", (1, 3, 2, 1), -math.inf),
        ]
        for name, at, value in bad:
            {"q": q, "k": k, "v": v}[name][at] = value
        found.append(Case(q, k, v, spec, False, bad))
    g = torch.Generator().manual_seed(0)
    B, L, S = 2, 150, 170
    q = torch.randn(B, 4, L, 16, generator=g)
    k = torch.randn(B, 2, S, 16, generator=g)
    v = torch.randn(B, 2, S, 8, generator=g)
    ids = torch.zeros(B, S, dtype=torch.long)
    ids[:, 60:] = 1
    ids[1, 120:] = 2
    keep = torch.rand(B, S, generator=g) > 0.2
    spec = (
        ((masks.causal() & masks.sliding_window(40)) | masks.prefix_lm(torch.tensor([10, 30])))
        & masks.document(ids)
        & masks.key_mask(keep)
        & ~masks.padding(torch.tensor([0, 5]), q_lengths=torch.tensor([0, 3]))
        & masks.padding(torch.tensor([S, 150]), q_lengths=torch.tensor([140, L]))
    )
    bad = [
        ("k", (0, 1, 50, 3), math.nan),
        ("v", (1, 0, 125, 0), math.inf),
        ("q", (1, 3, 20, 2), -math.inf),
    ]
    for name, at, value in bad:
        {"q": q, "k": k, "v": v}[name][at] = value
    found.append(Case(q, k, v, spec, False, bad))
    return found


@pytest.mark.parametrize("backend", REGISTERED)
def test_every_registered_backend_follows_the_rule(backend: str) -> None:
    """The shared check of the contract: output (and weights, where the backend returns them)
    NaN exactly in the rows the oracle has NaN, the other rows as without the bad entries, and
    their gradients too, where the backend takes a gradient."""
    case = next((c for c in _contract_cases() if _servable(c, backend)), None)
    assert case is not None, f"backend {backend!r} serves none of the contract's calls: add one"
    ref_out, ref_w = _oracle(case)
    naive = _oracle(case, dtype=case.q.dtype)[0]
    nan = ref_out.isnan().any(dim=-1)
    assert nan.any()
    assert not nan.all()
    tol = 2 * _err(naive[~nan], ref_out[~nan]) + (1e-10 if case.q.dtype == torch.float64 else 2e-6)
    out = _attention(case, backend)
    assert isinstance(out, torch.Tensor)
    _same_rows(out, ref_out, tol)
    if _servable(case, backend, return_weights=True):
        res = _attention(case, backend, return_weights=True)
        assert isinstance(res, attnkit.AttentionOutput)
        assert res.weights is not None
        _same_rows(res.weights, ref_w, tol)
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (case.q, case.k, case.v))
    leaf = Case(q, k, v, case.mask, case.causal, case.bad, case.extra)
    if not _servable(leaf, backend):
        return  # no gradient on this backend (flex on CPU): refused, as its verdict says
    ref = _oracle(leaf)[0]
    grad_out = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=ref.dtype)
    grad_out = grad_out.masked_fill(nan[..., None], 0.0)
    want = torch.autograd.grad(ref, (q, k, v), grad_out, allow_unused=True)
    got = torch.autograd.grad(_attention(leaf, backend), (q, k, v), grad_out.to(q.dtype))
    for name, g_got, g_want in zip("qkv", got, want, strict=True):
        g_want = torch.zeros_like(g_got) if g_want is None else g_want
        assert torch.isfinite(g_got).all(), name
        assert _err(g_got, g_want) <= 1e3 * tol, name


def test_a_registered_backend_follows_the_rule_with_no_code_of_its_own() -> None:
    """A naive backend (``weights @ v`` over every key, a NaN score taken as it comes) breaks
    the rule on its own; registered, it runs under the dispatcher's contract and follows it."""

    class Naive(Backend):
        name = "test-naive"

        def run(self, call: AttentionCall, plan: None) -> tuple[torch.Tensor, None]:
            G = call.dims.H // call.dims.Hkv
            k, v = call.k.repeat_interleave(G, 1), call.v.repeat_interleave(G, 1)
            s = call.q @ k.transpose(-1, -2) * call.scale
            mask = call.dense_mask()
            if mask is not None:
                s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask
            w = torch.nan_to_num(s.softmax(-1), nan=0.0)
            return w @ v, None

    case = _contract_cases()[0]
    ref_out, _ = _oracle(case)
    call = make_call(case.q, case.k, case.v, case.mask, False, None, 0.0, where="test")
    alone = Naive().run(call, None)[0]  # its own answer: NaN rows where the oracle has none
    assert not torch.equal(alone.isnan().all(dim=-1), ref_out.isnan().all(dim=-1))
    register_backend(Naive())
    try:
        _same_rows(_attention(case, "test-naive"), ref_out, 1e-10)
    finally:
        unregister_backend("test-naive")


def test_a_finite_call_takes_no_per_row_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The common case pays one sum per tensor; the per-row work runs only when it is not
    finite (and a sum that overflows is re-checked exactly, not taken for NaN)."""

    def fail(*args: object) -> None:
        raise AssertionError("the per-row path ran on finite inputs")

    monkeypatch.setattr(nonfinite, "sees_keys", fail)
    q, k, v = _qkv()
    verdicts = attnkit.explain(q, k, v, causal=True).verdicts
    served = [b for b in BACKENDS if b == "auto" or verdicts[b] is None]
    assert {"auto", "math", "sdpa", "blocked"} <= set(served)
    for backend in served:
        assert torch.isfinite(attnkit.attention(q, k, v, causal=True, backend=backend)).all()
    monkeypatch.undo()
    big = torch.full((1, 1, 6, 8), 3e37)  # finite values; their float32 sum is inf
    out = attnkit.attention(q[:1, :1], k[:1, :1], big)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_nan_in_a_kv_cache_reaches_only_the_sequences_that_see_it(backend: str) -> None:
    """A ragged cache: sequence 0 was truncated to 3 tokens, so its slots 3 and 4 hold stale
    entries it no longer sees; a NaN there changes nothing. A NaN in a live entry of sequence 1
    makes sequence 1's new token NaN, and only it."""
    g = torch.Generator().manual_seed(3)
    _skip_unless_served(  # the shapes of the new token's call: 1 query, 6 slots, 4 / 2 heads
        backend, *(torch.randn(2, h, n, 4, generator=g) for h, n in ((4, 1), (2, 6), (2, 6)))
    )
    torch.manual_seed(3)
    mha = attnkit.MultiHeadAttention(16, 4, num_kv_heads=2, causal=True, backend=backend).eval()
    x0, x = torch.randn(2, 5, 16), torch.randn(2, 1, 16)
    outs = []
    for poison in (False, True):
        cache = KVCache(2, 2, max_len=8, head_dim=4)
        with torch.no_grad():
            mha(x0, kv_cache=cache)
            cache.truncate(torch.tensor([3, 5]))
            if poison:
                cache.k[0, 1, 4, 2] = math.nan  # stale: sequence 0 holds 3 tokens
                cache.v[0, 0, 3, 1] = math.inf  # stale, overwritten by the next token
                cache.v[1, 1, 0, 0] = math.nan  # live: sequence 1's first token
            outs.append(mha(x, kv_cache=cache).output)
    clean, poisoned = outs
    torch.testing.assert_close(poisoned[0], clean[0], atol=0, rtol=0)
    assert poisoned[1].isnan().all()  # the output projection mixes the heads


@pytest.mark.parametrize("backend", ["math", "blocked"])
def test_self_attention_module_gradients_away_from_a_nan_token(backend: str) -> None:
    """SelfAttention: a NaN token's key and value reach the later tokens only (causal)."""
    torch.manual_seed(4)
    attn = attnkit.SelfAttention(16, 8, causal=True, backend=backend)
    x = torch.randn(1, 6, 16)
    x[0, 3, 5] = math.nan
    x.requires_grad_(True)
    y = attn(x).output
    assert y[0, 3:].isnan().all()
    assert torch.isfinite(y[0, :3]).all()
    y[0, :3].sum().backward()
    assert x.grad is not None
    assert torch.isfinite(x.grad).all()
    ref = x[:, :3].detach().clone().requires_grad_(True)
    attn(ref).output.sum().backward()
    assert ref.grad is not None
    torch.testing.assert_close(x.grad[:, :3], ref.grad, atol=1e-5, rtol=0)
