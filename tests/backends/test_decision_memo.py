"""The dispatcher's kept decisions (:mod:`attnkit.backends.memo`): a call like an earlier one
takes the same decision without asking the backends again, gives the same answers, and is
validated as before; anything a decision reads is in the key, and the cache is emptied when
the registry or the ``blocked`` settings change.

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
D head dim.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

import attnkit
from attnkit import AttentionInputError, AttentionMemoryError, masks
from attnkit.backends import (
    Backend,
    Decision,
    memo,
    owned,
    register_backend,
    unregister_backend,
)
from attnkit.backends.blocked import configure
from oracle import reference_attention, within_naive


@pytest.fixture(autouse=True)
def fresh() -> Iterator[None]:
    memo.clear()
    yield
    memo.clear()


def _decode(
    B: int = 1,
    H: int = 8,
    Hkv: int = 2,
    S: int = 64,
    D: int = 32,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, 1, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    return q, k, torch.randn(B, Hkv, S, D, generator=g).to(dtype)


def _check(
    out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: object
) -> None:
    want = reference_attention(q, k, v, **kw)[0]  # type: ignore[arg-type]
    naive = reference_attention(q, k, v, dtype=q.dtype, **kw)[0]  # type: ignore[arg-type]
    within_naive(out, want, naive)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("H", "Hkv"), [(8, 2), (4, 4)])
def test_a_kept_decision_gives_the_same_answers(dtype: torch.dtype, H: int, Hkv: int) -> None:
    """GQA and MHA decode steps, batch 2: the second call is found in the cache (no backend is
    asked again) and gives the oracle's answer, as the first did."""
    q, k, v = _decode(B=2, H=H, Hkv=Hkv, dtype=dtype)
    first = attnkit.attention(q, k, v, causal=True)
    assert len(memo._CACHE) == 1
    q2, k2, v2 = (t * 0.5 for t in (q, k, v))  # new values, same sizes: the same decision
    second = attnkit.attention(q2, k2, v2, causal=True)
    assert len(memo._CACHE) == 1
    _check(first, q, k, v, causal=True)
    _check(second, q2, k2, v2, causal=True)


def test_a_hit_asks_no_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = _decode()
    attnkit.attention(q, k, v, causal=True)
    asked: list[str] = []
    for name in attnkit.available_backends():
        backend = attnkit.backends.get_backend(name)
        real = backend.decide

        def counted(call: object, real: object = real, name: str = name) -> Decision:
            asked.append(name)
            return real(call)  # type: ignore[operator,no-any-return]

        monkeypatch.setattr(backend, "decide", counted)
    attnkit.attention(q, k, v, causal=True)
    assert asked == []
    attnkit.attention(q, k[:, :, :40], v[:, :, :40], causal=True)  # another S: asked again
    assert asked


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"k_dtype": torch.float64}, "q, k and v have different dtypes"),
        ({"scale": -1.0}, "`scale` must be a positive finite number"),
        ({"mask": torch.ones(3, 3, dtype=torch.bool)}, "does not broadcast to (B, H, L, S)"),
        ({"causal": 1}, "`causal` is of type int"),
        ({"backend": "nope"}, "unknown backend 'nope'"),
    ],
)
def test_a_warm_cache_still_refuses_bad_input(bad: dict[str, object], message: str) -> None:
    q, k, v = _decode()
    attnkit.attention(q, k, v, causal=True)  # the decision is kept
    kwargs: dict[str, object] = {"causal": True}
    if "k_dtype" in bad:
        k = k.to(bad.pop("k_dtype"))  # type: ignore[arg-type]
    kwargs.update(bad)
    with pytest.raises(AttentionInputError) as info:
        attnkit.attention(q, k, v, **kwargs)  # type: ignore[arg-type]
    assert message in str(info.value)


def test_a_named_backend_that_cannot_serve_still_raises_after_a_hit() -> None:
    q, k, v = _decode()
    attnkit.attention(q, k, v, causal=True, backend="sdpa")
    attnkit.attention(q, k, v, causal=True, backend="sdpa")  # kept
    with pytest.raises(AttentionInputError) as info:
        attnkit.attention(q, k, v, causal=True, backend="sdpa", return_weights=True)
    assert "backend 'sdpa' cannot serve this call" in str(info.value)


def test_gradients_are_another_key() -> None:
    """A call without gradients, then the same sizes with them: the decision is asked again and
    the gradients are the oracle's."""
    q, k, v = _decode()
    attnkit.attention(q, k, v, causal=True)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = attnkit.attention(q, k, v, causal=True)
    assert len(memo._CACHE) == 2
    out.square().sum().backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    reference_attention(q64, k64, v64, causal=True)[0].square().sum().backward()
    for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert got is not None
        assert want is not None
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


def test_a_kept_decision_is_held_to_the_memory_limit_again() -> None:
    """The math backend's weights (return_weights) were within the limit; with a lower limit
    the same call is refused, kept decision or not."""
    q, k, v = _decode(S=512)
    attnkit.attention(q, k, v, return_weights=True)
    attnkit.attention(q, k, v, return_weights=True)  # kept
    previous = attnkit.set_memory_limit(1024)
    try:
        with pytest.raises(AttentionMemoryError) as info:
            attnkit.attention(q, k, v, return_weights=True)
    finally:
        attnkit.set_memory_limit(previous)
    assert "memory limit" in str(info.value)


class _First(Backend):
    name = "test-memo-first"
    description = "math, registered first in auto's order (a test backend)"
    priority = 1000

    def run(self, call: attnkit.AttentionCall, plan: object = None) -> tuple[torch.Tensor, None]:
        out = reference_attention(call.q, call.k, call.v, dtype=torch.float64)[0]
        return out.to(call.q.dtype), None


def test_registering_a_backend_empties_the_cache() -> None:
    q, k, v = _decode()
    attnkit.attention(q, k, v)
    assert memo._CACHE
    register_backend(_First())
    try:
        assert not memo._CACHE
        attnkit.attention(q, k, v)
        (decision,) = (entry[0] for entry in memo._CACHE.values())
        assert decision.backend == "test-memo-first"
    finally:
        unregister_backend("test-memo-first")
    assert not memo._CACHE


def test_changing_the_blocked_settings_changes_the_decision() -> None:
    """A window spec at L = S = 64 is below blocked's min_pairs: sdpa; with min_pairs lowered
    the same call goes to blocked."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 64, 16, generator=g) for _ in range(3))
    spec = masks.causal() & masks.sliding_window(8)
    attnkit.attention(q, k, v, mask=spec)
    (before,) = (entry[0].backend for entry in memo._CACHE.values())
    old = configure(min_pairs=1)
    try:
        out = attnkit.attention(q, k, v, mask=spec)
        after = [entry[0].backend for entry in memo._CACHE.values()]
    finally:
        configure(min_pairs=old.min_pairs)
    assert before == "sdpa"
    assert after == ["blocked"]
    dense = spec.to_dense(64, 64)
    _check(out, q, k, v, mask=dense)


def test_a_spec_with_other_values_is_another_key() -> None:
    """padding(lengths) keyed by its values: new lengths, a new decision and the right rows."""
    q, k, v = _decode(B=2, S=64)
    for lengths in ([64, 30], [10, 64]):
        spec = masks.padding(torch.tensor(lengths))
        out = attnkit.attention(q, k, v, mask=spec)
        _check(out, q, k, v, mask=spec.to_dense(1, 64))
    assert len(memo._CACHE) == 2


def test_an_owned_spec_written_in_place_is_decided_again() -> None:
    """An owned spec (hf_mask's) is keyed by identity and its tensors' versions: a write
    through torch bumps the version, so the next call reads the new padding."""
    q, k, v = _decode(B=2, S=16)
    keep = torch.ones(2, 16, dtype=torch.bool)
    spec = owned.own(masks.causal() & masks.key_mask(keep))
    first = attnkit.attention(q, k, v, mask=spec)
    _check(first, q, k, v, mask=spec.to_dense(1, 16))
    keep[0, :8] = False  # through torch: the version moves
    second = attnkit.attention(q, k, v, mask=spec)
    _check(second, q, k, v, mask=spec.to_dense(1, 16))
    assert not torch.equal(first[0], second[0])
    assert len(memo._CACHE) == 2


def test_an_owned_spec_is_materialised_once() -> None:
    """A dense backend asks for the mask of every layer: an owned spec's is made once."""
    spec = owned.own(masks.causal() & masks.key_mask(torch.ones(2, 16, dtype=torch.bool)))
    a = owned.dense(spec, 1, 16, torch.device("cpu"), torch.float32)
    b = owned.dense(spec, 1, 16, torch.device("cpu"), torch.float32)
    assert a is b
    torch.testing.assert_close(a, spec.to_dense(1, 16))
    other = masks.causal() & masks.key_mask(torch.ones(2, 16, dtype=torch.bool))
    assert owned.dense(other, 1, 16, torch.device("cpu"), torch.float32) is not owned.dense(
        other, 1, 16, torch.device("cpu"), torch.float32
    )  # not owned: made anew


def test_nan_after_a_hit_still_reaches_its_rows() -> None:
    """The non-finite rule runs on every call, kept decision or not."""
    q, k, v = _decode(B=2)
    attnkit.attention(q, k, v, causal=True)
    k = k.clone()
    k[1, 0, 5, 3] = math.nan
    out = attnkit.attention(q, k, v, causal=True)
    assert out[1, :4].isnan().all()  # query heads 0-3 read key/value head 0
    assert not out[1, 4:].isnan().any()
    assert not out[0].isnan().any()


def test_explain_is_never_cached() -> None:
    q, k, v = _decode()
    attnkit.explain(q, k, v, causal=True)
    assert not memo._CACHE
