"""Calls run directly (:mod:`attnkit.backends.memo`, "Calls run directly"): a decode call like
an earlier one runs the kernel its decision took and nothing else, gives the oracle's answer,
still takes the whole path where the values hold NaN or inf, and never lets bad input through.

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
D head dim.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
import attnkit.functional as functional
from attnkit import AttentionInputError, cpu, masks
from attnkit.backends import memo, owned
from attnkit.backends.blocked import configure, decode
from oracle import reference_attention, within_naive

pytestmark = pytest.mark.skipif(
    decode.build() is None, reason=f"the decode kernel is not available: {decode.status()}"
)


@pytest.fixture(autouse=True)
def fresh() -> Iterator[None]:
    memo.clear()
    yield
    memo.clear()


def _qkv(
    B: int = 2, H: int = 8, Hkv: int = 2, L: int = 1, S: int = 48, D: int = 32, seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    return q, k, torch.randn(B, Hkv, S, D, generator=g).to(dtype)


def _check(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> None:
    want = reference_attention(q, k, v, **kw)[0]
    naive = reference_attention(q, k, v, dtype=q.dtype, **kw)[0]
    within_naive(out, want, naive)


def _no_whole_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the checks and the dispatcher raise: only a direct run can answer."""

    def whole_path(*args: object, **kwargs: object) -> None:
        raise AssertionError("the call took the whole path")

    monkeypatch.setattr(functional, "check_qkv", whole_path)
    monkeypatch.setattr(functional, "choose", whole_path)


MASKS: dict[str, Any] = {
    "causal": lambda B, S: {"causal": True},
    "none": lambda B, S: {},
    "window": lambda B, S: {"mask": masks.causal() & masks.sliding_window(7)},
    "padding": lambda B, S: {"mask": masks.padding(torch.tensor([S, S // 3][:B]))},
    "owned": lambda B, S: {
        "mask": owned.own(masks.causal() & masks.key_mask(torch.arange(S).expand(B, S) >= 2))
    },
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("H", "Hkv", "L"), [(8, 2, 1), (4, 4, 1), (6, 3, 5), (2, 1, 16)])
@pytest.mark.parametrize("mask", list(MASKS))
def test_a_repeated_call_runs_directly_and_matches_the_oracle(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, H: int, Hkv: int, L: int, mask: str
) -> None:
    """GQA and MHA, batch 2, one to sixteen query rows, every mask the decode kernel reads:
    the first call takes the whole path and keeps the kernel; the second (new values, same
    sizes) runs it without any check or decision and gives the oracle's answer. The blocked
    backend is named: on a CPU class whose measured rule gives decode calls in this dtype to
    SDPA (float16 with AVX512-FP16), auto's SDPA needs a mask tensor for an end-aligned causal
    call with L > 1, and a call that builds one is never run directly."""
    kw = {**MASKS[mask](2, 48), "backend": "blocked"}
    q, k, v = _qkv(H=H, Hkv=Hkv, L=L, dtype=dtype)
    first = attnkit.attention(q, k, v, **kw)
    assert len(memo.DIRECT) == 1
    dense = {"mask": kw["mask"].to_dense(L, 48)} if "mask" in kw else {"causal": "causal" in kw}
    _check(first, q, k, v, **dense)
    _no_whole_path(monkeypatch)
    q2, k2, v2 = _qkv(H=H, Hkv=Hkv, L=L, dtype=dtype, seed=1)
    second = attnkit.attention(q2, k2, v2, **kw)
    _check(second, q2, k2, v2, **dense)
    assert second.dtype == dtype
    assert second.shape == (2, H, L, 32)


@settings(max_examples=25, deadline=None)
@given(
    B=st.integers(1, 3),
    Hkv=st.sampled_from([1, 2, 3]),
    g=st.sampled_from([1, 2, 4]),
    L=st.integers(1, 16),
    S=st.integers(1, 300),
    D=st.sampled_from([8, 13, 64]),
    window=st.sampled_from([None, 1, 5, 64]),
)
def test_direct_runs_sweep_shapes_and_windows(
    B: int, Hkv: int, g: int, L: int, S: int, D: int, window: int | None
) -> None:
    """Any decode shape, twice with other values: both answers are the oracle's."""
    S = max(S, L)
    kw: dict[str, Any] = {"causal": True}
    if window is not None:
        kw = {"mask": masks.causal() & masks.sliding_window(window)}
    for seed in (0, 1):
        q, k, v = _qkv(B, Hkv * g, Hkv, L, S, D, seed=seed)
        out = attnkit.attention(q, k, v, **kw)
        dense = {"mask": kw["mask"].to_dense(L, S)} if "mask" in kw else kw
        _check(out, q, k, v, **dense)


def test_nan_on_a_direct_run_takes_the_whole_path() -> None:
    """NaN in a key some row sees: exactly those rows are NaN; NaN in a value outside every
    row's window: no row is NaN (the exact rule of attnkit.backends.nonfinite)."""
    spec = masks.causal() & masks.sliding_window(8)
    q, k, v = _qkv()
    attnkit.attention(q, k, v, mask=spec)
    attnkit.attention(q, k, v, mask=spec)  # direct
    k_bad = k.clone()
    k_bad[1, 0, 45, 3] = math.nan  # within the window of the last row
    out = attnkit.attention(q, k_bad, v, mask=spec)
    assert out[1, :4].isnan().all()  # query heads 0-3 read key/value head 0
    assert not out[1, 4:].isnan().any()
    assert not out[0].isnan().any()
    v_bad = v.clone()
    v_bad[:, :, 3] = math.inf  # outside every row's window
    out = attnkit.attention(q, k, v_bad, mask=spec)
    assert not out.isnan().any()
    _check(out, q, k, v, mask=spec.to_dense(1, 48))


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"causal": 1}, "`causal` is of type int"),
        ({"scale": -1.0}, "`scale` must be a positive finite number"),
        ({"q": np.zeros((2, 8, 1, 32), dtype=np.float32)}, "`q` is a ndarray, not a tensor"),
        ({"k": [[0.0]]}, "`k` is a list, not a tensor"),
        ({"mask": 3}, "mask"),
        ({"dropout_p": True}, "dropout_p"),
        ({"v": torch.zeros(2, 2, 47, 32)}, "k and v have different lengths"),
        ({"backend": "nope"}, "unknown backend 'nope'"),
    ],
)
def test_bad_input_after_a_direct_run_is_still_refused(
    bad: dict[str, object], message: str
) -> None:
    q, k, v = _qkv()
    attnkit.attention(q, k, v, causal=True)
    attnkit.attention(q, k, v, causal=True)  # direct
    args: dict[str, Any] = {"q": q, "k": k, "v": v, "causal": True, **bad}
    with pytest.raises(AttentionInputError) as info:
        attnkit.attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)
    assert message in str(info.value)


def test_gradients_weights_and_dropout_take_the_whole_path() -> None:
    """The same sizes with autograd, weights or dropout are not run directly: the gradients
    and the weights are the oracle's."""
    q, k, v = _qkv()
    attnkit.attention(q, k, v, causal=True)
    assert len(memo.DIRECT) == 1
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    attnkit.attention(qg, kg, vg, causal=True).square().sum().backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    reference_attention(q64, k64, v64, causal=True)[0].square().sum().backward()
    for got, want in ((qg.grad, q64.grad), (kg.grad, k64.grad), (vg.grad, v64.grad)):
        assert got is not None
        assert want is not None
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    out, weights = attnkit.attention(q, k, v, causal=True, return_weights=True)
    torch.testing.assert_close(
        weights.double(), reference_attention(q, k, v, causal=True)[1], atol=1e-6, rtol=1e-5
    )
    torch.manual_seed(0)
    dropped = attnkit.attention(q, k, v, causal=True, dropout_p=0.5)
    assert not torch.allclose(dropped, out)  # dropout ran (a direct run has none)
    assert len(memo.DIRECT) == 1


def test_a_trace_records_a_call_that_would_run_directly() -> None:
    q, k, v = _qkv()
    attnkit.attention(q, k, v, causal=True)
    attnkit.attention(q, k, v, causal=True)  # direct
    with attnkit.trace() as tr:
        attnkit.attention(q, k, v, causal=True)
    assert tr.n_calls == 1
    assert tr.backends == ["blocked"]


def test_settings_registry_and_spec_writes_forget_direct_runs() -> None:
    q, k, v = _qkv()
    attnkit.attention(q, k, v, causal=True)
    assert memo.DIRECT
    old = configure(min_pairs=7)
    try:
        attnkit.attention(q, k, v, causal=True)  # new settings: everything kept is forgotten
        assert len(memo.DIRECT) == 1
        memo.DIRECT.clear()
    finally:
        configure(min_pairs=old.min_pairs)
    keep = torch.ones(2, 48, dtype=torch.bool)
    spec = owned.own(masks.causal() & masks.key_mask(keep))
    first = attnkit.attention(q, k, v, mask=spec)
    keep[0, :40] = False  # through torch: the version moves, a new signature
    second = attnkit.attention(q, k, v, mask=spec)
    _check(second, q, k, v, mask=spec.to_dense(1, 48))
    assert not torch.equal(first[0], second[0])
    assert len(memo.DIRECT) == 2


def test_explain_names_the_kernel_a_direct_run_calls() -> None:
    q, k, v = _qkv(S=5)
    e = attnkit.explain(q, k, v, causal=True)
    assert e.chosen == "blocked"
    assert "attnkit's AVX2 decode kernel" in e.notes["blocked"]
    assert not memo.DIRECT  # explain keeps nothing


# --- SDPA's direct runs: calls torch gets as they are (no mask tensor, K/V not repeated) ----

SDPA_CALLS: dict[str, Any] = {
    "none": lambda: {},
    "causal": lambda: {"causal": True},  # L == S: torch's is_causal
    "unmasked spec": lambda: {"mask": masks.unmasked()},
    "padding that pads nothing": lambda: {"mask": masks.padding(torch.tensor([24, 24]))},
}


def _sdpa_qkv(
    H: int, Hkv: int, L: int = 24, seed: int = 0, dtype: torch.dtype = torch.float32,
    views: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """An encoder layer's q, k, v: ``(2, H, L, 32)``; with ``views`` transposed views of
    ``(B, L, heads, D)`` projections, as transformers' layers hand them over."""
    if not views:
        return _qkv(B=2, H=H, Hkv=Hkv, L=L, S=L, D=32, seed=seed, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, L, H, 32, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(2, L, Hkv, 32, generator=g).to(dtype).transpose(1, 2)
    return q, k, torch.randn(2, L, Hkv, 32, generator=g).to(dtype).transpose(1, 2)


@pytest.mark.parametrize("views", [False, True])
@pytest.mark.parametrize(("H", "Hkv"), [(4, 4), (6, 2)])
@pytest.mark.parametrize("call", list(SDPA_CALLS))
def test_a_repeated_sdpa_call_runs_directly_and_matches_the_oracle(
    monkeypatch: pytest.MonkeyPatch, call: str, H: int, Hkv: int, views: bool
) -> None:
    """An encoder's or a short prefill's call (24 x 24: auto takes SDPA): the first call takes
    the whole path and keeps torch's call; the second (new values) runs it without any check
    or decision and gives the oracle's answer."""
    kw = SDPA_CALLS[call]()
    q, k, v = _sdpa_qkv(H, Hkv, views=views)
    assert attnkit.explain(q, k, v, **kw).chosen == "sdpa"
    first = attnkit.attention(q, k, v, **kw)
    assert len(memo.DIRECT) == 1
    dense = {"mask": kw["mask"].to_dense(24, 24)} if "mask" in kw else kw
    _check(first, q, k, v, **dense)
    _no_whole_path(monkeypatch)
    q2, k2, v2 = _sdpa_qkv(H, Hkv, seed=1, views=views)
    second = attnkit.attention(q2, k2, v2, **kw)
    _check(second, q2, k2, v2, **dense)
    assert second.shape == (2, H, 24, 32)


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({"mask": masks.causal() & masks.sliding_window(4)}, "a mask tensor made for torch"),
        ({"mask": masks.padding(torch.tensor([24, 10]))}, "a mask tensor made for torch"),
        ({"causal": True, "dtype": torch.bfloat16}, "float32 copies"),
    ],
)
def test_sdpa_calls_that_need_more_than_torch_take_the_whole_path(
    kw: dict[str, Any], why: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A materialised mask, or float32 copies on the fp32-upcast path (forced where it is not
    this CPU's own): no direct run is kept (each call makes them); the answers are the
    oracle's."""
    kw = dict(kw)
    dtype = kw.pop("dtype", torch.float32)
    if dtype != torch.float32:
        reason = cpu.unavailable("fp32-upcast", dtype)
        if reason is not None:
            pytest.skip(f"the fp32-upcast path cannot run {dtype} here: {reason}")
        monkeypatch.setenv(cpu.ENV, "fp32-upcast")
    q, k, v = _sdpa_qkv(4, 2, dtype=dtype)
    e = attnkit.explain(q, k, v, **kw)
    assert e.chosen == "sdpa"
    assert dtype == torch.float32 or "fp32-upcast" in str(e)
    for _ in range(2):
        out = attnkit.attention(q, k, v, **kw)
        assert not memo.DIRECT, why
    dense = {"mask": kw["mask"].to_dense(24, 24)} if "mask" in kw else kw
    _check(out, q, k, v, **dense)


def test_nan_on_a_direct_sdpa_run_takes_the_whole_path() -> None:
    """After torch's call is kept: NaN in one query row gives NaN in that row only; inf in a
    value every row of its heads sees gives NaN in those heads' rows only (the exact rule)."""
    q, k, v = _sdpa_qkv(6, 2)
    attnkit.attention(q, k, v)
    assert len(memo.DIRECT) == 1
    q_bad = q.clone()
    q_bad[1, 2, 5, 0] = math.nan
    out = attnkit.attention(q_bad, k, v)
    assert out[1, 2, 5].isnan().all()
    rows = out.isnan().any(dim=-1)
    assert int(rows.sum()) == 1
    v_bad = v.clone()
    v_bad[0, 1, 7, 3] = math.inf  # key/value head 1 serves query heads 3-5
    out = attnkit.attention(q, k, v_bad)
    assert out[0, 3:].isnan().all()
    assert not out[0, :3].isnan().any()
    assert not out[1].isnan().any()


def test_an_unmasked_spec_is_an_unmasked_call_to_autos_rule() -> None:
    """A spec that allows every pair of a non-causal call is what it is, no mask: auto gives it
    to SDPA where it gives a call without a mask to SDPA (here 128 x 128, under the row-span
    kernel's unmasked sizes), not to blocked as a mask spec to skip blocks of."""
    q, k, v = _sdpa_qkv(4, 4, L=128)
    for kw in ({"mask": masks.unmasked()}, {"mask": masks.padding(torch.tensor([128, 128]))}):
        e = attnkit.explain(q, k, v, **kw)
        assert e.chosen == attnkit.explain(q, k, v).chosen == "sdpa"
        fires, words = e.rules["blocked"]
        assert not fires
        assert "allows every pair) call is 128 x 128" in words
    narrower = attnkit.explain(q, k, v, mask=masks.padding(torch.tensor([128, 100])))
    assert narrower.chosen == "blocked"  # a real mask spec of 128 x 128 pairs


# ---------------------------------------------------------------------------------------------
# through transformers' attention interface (attnkit.interop.hf_attention)


class _Layer(torch.nn.Module):
    """What hf_attention reads of a layer: ``is_causal`` and a config without the flag."""

    is_causal = True
    config = None


def test_a_repeated_hf_call_runs_directly_and_matches_the_whole_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The second call of one signature through hf_attention runs the kept kernel without
    attnkit.attention (a decode step's layers after the first): the same output as the whole
    path; the output is (B, L, H, D), the weights None."""
    hfa = pytest.importorskip("attnkit.interop.hf_attention")
    layer, spec = _Layer(), masks.causal() & masks.sliding_window(9)
    q, k, v = _qkv(L=3)
    kw = {"dropout": 0.0, "scaling": 0.3, "position_ids": torch.arange(3)[None], "use_cache": True}
    first, w = hfa.hf_attention(layer, q, k, v, spec, **kw)
    assert w is None
    want = attnkit.attention(q, k, v, mask=spec, scale=0.3).transpose(1, 2)
    torch.testing.assert_close(first, want, rtol=0, atol=0)
    monkeypatch.setattr(hfa, "attention", None)  # calling it would raise TypeError
    q2, k2, v2 = _qkv(L=3, seed=1)
    got, w = hfa.hf_attention(layer, q2, k2, v2, spec, **kw)
    assert w is None
    assert got.shape == (2, 3, 8, 32)
    assert got.is_contiguous()
    _check(got.transpose(1, 2), q2, k2, v2, mask=spec.to_dense(3, 48), scale=0.3)
    # the unmasked spec transformers' mask function gives runs as an unmasked call
    monkeypatch.setattr(hfa, "attention", functional.attention)
    hfa.hf_attention(layer, q, k, v, hfa.UNMASKED, scaling=0.3)
    monkeypatch.setattr(hfa, "attention", None)
    got, _ = hfa.hf_attention(layer, q2, k2, v2, hfa.UNMASKED, scaling=0.3)
    _check(got.transpose(1, 2), q2, k2, v2, scale=0.3)


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({"dropout": 0.5}, "dropout"),
        ({"softcap": 30.0}, "soft-cap"),
        ({"output_attentions": True}, "weights"),
        ({"s_aux": torch.zeros(8)}, "sinks"),
    ],
)
def test_hf_calls_that_change_the_result_take_the_whole_path(kw: dict[str, Any], why: str) -> None:
    """A call like a kept one but with dropout, a soft-cap, weights asked for or sinks is
    not run directly: attnkit.attention gets it (and computes what it asks)."""
    hfa = pytest.importorskip("attnkit.interop.hf_attention")
    layer, spec = _Layer(), masks.causal()
    q, k, v = _qkv()
    hfa.hf_attention(layer, q, k, v, spec, scaling=0.3)
    seen: list[object] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(why)
        return functional.attention(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hfa, "attention", recording)
        out, weights = hfa.hf_attention(layer, q, k, v, spec, scaling=0.3, **kw)
    assert seen == [why]
    assert out.shape == (2, 1, 8, 32)
    assert (weights is not None) is (why == "weights")


def test_a_refused_hf_keyword_is_refused_after_a_direct_run() -> None:
    hfa = pytest.importorskip("attnkit.interop.hf_attention")
    layer, spec = _Layer(), masks.causal()
    q, k, v = _qkv()
    hfa.hf_attention(layer, q, k, v, spec, scaling=0.3)
    hfa.hf_attention(layer, q, k, v, spec, scaling=0.3)  # direct
    for name, value in (("block_indices", torch.zeros(1, dtype=torch.long)), ("a_new_keyword", 1)):
        with pytest.raises(AttentionInputError) as info:
            hfa.hf_attention(layer, q, k, v, spec, scaling=0.3, **{name: value})
        assert f"{name}=" in str(info.value)


def test_nan_on_a_direct_hf_run_takes_the_whole_path() -> None:
    hfa = pytest.importorskip("attnkit.interop.hf_attention")
    layer, spec = _Layer(), masks.causal() & masks.sliding_window(8)
    q, k, v = _qkv()
    hfa.hf_attention(layer, q, k, v, spec, scaling=0.3)
    k_bad = k.clone()
    k_bad[1, 0, 45, 3] = math.nan  # within the window of the last row
    out, _ = hfa.hf_attention(layer, q, k_bad, v, spec, scaling=0.3)  # (B, L, H, D)
    assert out[1, :, :4].isnan().all()  # query heads 0-3 read key/value head 0
    assert not out[1, :, 4:].isnan().any()
    assert not out[0].isnan().any()
