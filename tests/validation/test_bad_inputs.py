"""Random bad inputs thrown at ``attention``, ``explain`` and the modules (issue 15).

Every call starts valid and gets one to three faults: wrong ranks and sizes, integer, bool and
complex dtypes, mixed dtypes, a tensor on another device (``meta``: this machine may have only
a CPU), things that are not tensors, masks of every kind with bad shapes, dtypes and values
(``+inf``, NaN), mask specs with a wrong batch, length, head count or device, bad flags, scales,
dropout probabilities and backend names. Each must end in :class:`attnkit.AttentionInputError`;
where the faults happen to cancel into a valid call, the result must be right (the float64
oracle for ``attention``; finite and of the right shape for the modules), with no warning but
attnkit's documented :class:`~attnkit.AttentionMaskWarning`. Never a raw torch error, a NaN or a
hang (the sizes are tiny; hypothesis reports any other exception with its draw).

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
Dk query/key head dim, Dv value head dim, E model width.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import AttentionInputError, AttentionMaskWarning, masks
from attnkit.masks import MaskSpec
from oracle import naive_bound, reference_attention, within_naive

BAD_DTYPES = [torch.int64, torch.int32, torch.uint8, torch.bool, torch.complex64]
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
NOT_TENSORS: list[object] = [None, 3, 2.5, "q", [[1.0, 2.0]], (1, 2)]


def _outcome(thunk: Callable[[], Any]) -> Any:
    """The result of ``thunk``, or ``None`` when it raised attnkit's error. Any other exception
    propagates (a failure); every warning must be attnkit's documented mask warning."""
    error: AttentionInputError | None = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = thunk()
        except AttentionInputError as exc:
            error = exc
    if error is not None:
        text = str(error)
        assert text.startswith("attnkit"), text
        assert "\n  got:      " in text, text
        assert "\n  expected: " in text, text
        event(f"refused: {error.argument}")
        return None
    for w in caught:
        assert issubclass(w.category, AttentionMaskWarning), (w.category, str(w.message))
    event("accepted")
    return result


def _tensor_with(t: torch.Tensor, draw: st.DrawFn) -> torch.Tensor:
    """``t`` with one thing wrong: its rank, a size, its dtype or its device."""
    kind = draw(st.sampled_from(["rank", "size", "dtype", "device"]))
    if kind == "rank":
        drop = draw(st.booleans()) and t.dim() > 0 and t.shape[0] > 0
        return t[0] if drop else t.unsqueeze(0)
    if kind == "size":
        d = draw(st.integers(0, t.dim() - 1))
        shape = list(t.shape)
        shape[d] = draw(st.integers(0, 9).filter(lambda n: n != shape[d]))
        g = torch.Generator().manual_seed(d)
        return torch.randn(shape, generator=g, dtype=torch.float64).to(t.dtype)
    if kind == "dtype":
        return (t.real if t.is_complex() else t).to(draw(st.sampled_from(BAD_DTYPES + FLOATS)))
    return t.to("meta")


@dataclass
class Call:
    """One call of ``attention`` / ``explain``: q, k, v and keywords; the mask spec, if any, is
    built inside the call (a spec constructor's own error counts)."""

    q: Any
    k: Any
    v: Any
    kw: dict[str, Any] = field(default_factory=dict)
    spec: Callable[[], MaskSpec] | None = None
    faults: list[str] = field(default_factory=list)

    def kwargs(self) -> dict[str, Any]:
        return self.kw if self.spec is None else {**self.kw, "mask": self.spec()}

    def __repr__(self) -> str:
        def desc(x: object) -> str:
            if isinstance(x, torch.Tensor):
                return f"<{x.dtype} {tuple(x.shape)} {x.device.type}>"
            return repr(x)

        kw = {n: desc(x) for n, x in self.kw.items()}
        qkv = f"q={desc(self.q)}, k={desc(self.k)}, v={desc(self.v)}"
        return f"Call(faults={self.faults}, {qkv}, kw={kw})"


def _bad_mask(draw: st.DrawFn, B: int, H: int, L: int, S: int, dtype: torch.dtype) -> Any:
    kind = draw(
        st.sampled_from(["shape", "dtype", "float-dtype", "values", "object", "device", "rank"])
    )
    if kind == "shape":
        shape = draw(st.lists(st.integers(0, 7), min_size=1, max_size=4))
        return torch.rand(shape) > 0.3
    if kind == "rank":
        return torch.ones((1,) * draw(st.sampled_from([0, 5, 6])), dtype=torch.bool)
    if kind == "dtype":
        return torch.ones(L, S, dtype=draw(st.sampled_from([*BAD_DTYPES[:-2], torch.complex64])))
    if kind == "float-dtype":
        return torch.zeros(L, S, dtype=draw(st.sampled_from(FLOATS)))
    if kind == "values":
        m = torch.zeros(B, 1, L, S, dtype=dtype)
        bad = draw(st.sampled_from([math.inf, math.nan]))
        m[
            draw(st.integers(0, B - 1)), 0, draw(st.integers(0, L - 1)), draw(st.integers(0, S - 1))
        ] = bad
        return m
    if kind == "object":
        return draw(st.sampled_from([[[True, False]], "causal", 1, 0.5, object()]))
    return torch.ones(L, S, dtype=torch.bool, device="meta")


def _bad_spec(draw: st.DrawFn, B: int, H: int, L: int, S: int) -> Callable[[], MaskSpec]:
    kind = draw(st.sampled_from(["length", "batch", "heads", "device", "negative", "dtype"]))
    off = draw(st.sampled_from([-2, -1, 1, 3]))
    if kind == "length":
        n = max(S + off, 0)
        if draw(st.booleans()):
            return lambda: masks.document(torch.zeros(B, n, dtype=torch.long))
        return lambda: masks.key_mask(torch.ones(B, n, dtype=torch.bool)) & masks.causal()
    if kind == "batch":
        n = max(B + off, 0)
        return lambda: masks.padding(torch.full((n,), S)) & masks.sliding_window(2)
    if kind == "heads":
        return lambda: masks.alibi(max(H + off, 1)) & masks.causal()
    if kind == "device":
        return lambda: masks.padding(torch.full((B,), S, device="meta"))
    if kind == "negative":
        return lambda: masks.padding(torch.full((B,), -1))
    return lambda: masks.document(torch.zeros(S))  # float ids


@st.composite
def bad_calls(draw: st.DrawFn) -> Call:
    B, Hkv, G = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    L, S, Dk, Dv = (draw(st.integers(1, 6)) for _ in range(4))
    H = Hkv * G
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    call = Call(r(B, H, L, Dk), r(B, Hkv, S, Dk), r(B, Hkv, S, Dv))
    faults = draw(
        st.lists(
            st.sampled_from(
                [
                    "tensor",
                    "not-a-tensor",
                    "all-dtype",
                    "mask",
                    "spec",
                    "causal",
                    "scale",
                    "dropout",
                    "weights",
                    "backend",
                ]
            ),
            min_size=1,
            max_size=3,
            unique=True,
        )
    )
    call.faults = faults
    for fault in faults:
        name = draw(st.sampled_from("qkv"))
        if fault == "tensor":
            t = getattr(call, name)
            setattr(call, name, _tensor_with(t, draw) if isinstance(t, torch.Tensor) else t)
        elif fault == "not-a-tensor":
            setattr(call, name, draw(st.sampled_from(NOT_TENSORS)))
        elif fault == "all-dtype":
            bad = draw(st.sampled_from(BAD_DTYPES))
            call.q, call.k, call.v = (
                t.to(bad) if isinstance(t, torch.Tensor) else t for t in (call.q, call.k, call.v)
            )
        elif fault == "mask":
            call.kw["mask"] = _bad_mask(draw, B, H, L, S, dtype)
        elif fault == "spec":
            call.spec = _bad_spec(draw, B, H, L, S)
        elif fault == "causal":
            call.kw["causal"] = draw(st.sampled_from([1, 0, "True", None, torch.tensor(True)]))
        elif fault == "scale":
            call.kw["scale"] = draw(
                st.sampled_from([0, -1.0, math.nan, math.inf, -math.inf, True, "0.5", 1j])
            )
        elif fault == "dropout":
            call.kw["dropout_p"] = draw(
                st.sampled_from([-0.1, 1.0, 1.5, math.nan, math.inf, True, "0.1", None])
            )
        elif fault == "weights":
            call.kw["return_weights"] = draw(st.sampled_from([1, "yes", None, 0]))
        else:
            call.kw["backend"] = draw(st.sampled_from(["nope", "AUTO", None, 3, ""]))
    return call


def _check_valid_result(call: Call, out: torch.Tensor | attnkit.AttentionOutput) -> None:
    """A call that was accepted: the oracle's output (weights too), no NaN."""
    q, k, v = call.q, call.k, call.v
    kw = call.kwargs()
    weights = None
    if isinstance(out, attnkit.AttentionOutput):
        out, weights = out
    assert out.shape == (*q.shape[:-1], v.shape[-1])
    if out.device.type == "meta":
        return
    assert not out.isnan().any()
    if kw.get("dropout_p", 0.0) > 0.0:
        return
    L, S = q.shape[2], k.shape[2]
    mask = kw.get("mask")
    if isinstance(mask, MaskSpec):
        mask = mask.to_dense(L, S, dtype=torch.float64)
    ref, ref_w = reference_attention(
        q, k, v, mask=mask, causal=kw.get("causal", False), scale=kw.get("scale")
    )
    naive, _ = reference_attention(
        q, k, v, mask=mask, causal=kw.get("causal", False), scale=kw.get("scale"), dtype=q.dtype
    )
    within_naive(out, ref, naive)
    if weights is not None:
        assert _err(weights, ref_w) <= 2 * naive_bound(ref, naive)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


@settings(max_examples=400)
@given(call=bad_calls())
def test_attention_bad_inputs_end_in_attnkit_error(call: Call) -> None:
    out = _outcome(lambda: attnkit.attention(call.q, call.k, call.v, **call.kwargs()))
    if out is not None:
        _check_valid_result(call, out)


@settings(max_examples=200)
@given(call=bad_calls())
def test_explain_bad_inputs_end_in_attnkit_error(call: Call) -> None:
    got = _outcome(lambda: attnkit.explain(call.q, call.k, call.v, **call.kwargs()))
    if got is not None:  # a valid call: explain names a backend that serves it, and it runs
        assert got.verdicts[got.chosen] is None
        assert str(got).startswith("attnkit.explain: ")
        out = _outcome(lambda: attnkit.attention(call.q, call.k, call.v, **call.kwargs()))
        assert out is not None


# ------------------------------------------------------------------------------------ modules


@dataclass
class ModuleCall:
    module: torch.nn.Module
    args: list[Any]
    kw: dict[str, Any]
    faults: list[str]

    def __repr__(self) -> str:
        def desc(x: object) -> str:
            if isinstance(x, torch.Tensor):
                return f"<{x.dtype} {tuple(x.shape)} {x.device.type}>"
            return repr(x)

        return (
            f"ModuleCall({type(self.module).__name__}, faults={self.faults}, "
            f"args={[desc(a) for a in self.args]}, kw={ {n: desc(x) for n, x in self.kw.items()} })"
        )


def _key_mask_fault(draw: st.DrawFn, B: int, S: int, dtype: torch.dtype) -> dict[str, Any]:
    name = draw(st.sampled_from(["key_padding_mask", "attention_mask"]))
    kind = draw(st.sampled_from(["shape", "dtype", "values", "both", "object", "device"]))
    if kind == "shape":
        shape = draw(st.lists(st.integers(0, 7), min_size=1, max_size=3))
        return {name: torch.rand(shape) > 0.5}
    if kind == "dtype":
        bad = draw(st.sampled_from([torch.int64, torch.complex64, *FLOATS]))
        return {name: torch.zeros(B, S, dtype=bad)}
    if kind == "values":
        if name == "attention_mask":
            return {name: torch.full((B, S), draw(st.sampled_from([2, -1])))}
        t = torch.zeros(B, S, dtype=dtype)
        t[draw(st.integers(0, B - 1)), draw(st.integers(0, S - 1))] = draw(
            st.sampled_from([math.inf, math.nan])
        )
        return {name: t}
    if kind == "both":
        return {
            "key_padding_mask": torch.zeros(B, S, dtype=torch.bool),
            "attention_mask": torch.ones(B, S, dtype=torch.bool),
        }
    if kind == "object":
        return {name: draw(st.sampled_from([[[True]], "pad", 1]))}
    return {name: torch.zeros(B, S, dtype=torch.bool, device="meta")}


def _attn_mask_fault(
    draw: st.DrawFn, B: int, H: int, L: int, S: int, dtype: torch.dtype
) -> dict[str, Any]:
    kind = draw(st.sampled_from(["shape", "dtype", "values", "is_causal", "object"]))
    if kind == "shape":
        shape = draw(st.lists(st.integers(0, 7), min_size=1, max_size=4))
        return {"attn_mask": torch.rand(shape) > 0.5}
    if kind == "dtype":
        bad = draw(st.sampled_from([torch.int64, torch.complex64, *FLOATS]))
        return {"attn_mask": torch.zeros(L, S, dtype=bad)}
    if kind == "values":
        t = torch.zeros(L, S, dtype=dtype)
        t[draw(st.integers(0, L - 1)), draw(st.integers(0, S - 1))] = draw(
            st.sampled_from([math.inf, math.nan])
        )
        return {"attn_mask": t}
    if kind == "is_causal":
        return {"is_causal": draw(st.sampled_from([True, 1, "yes"]))}
    return {"attn_mask": draw(st.sampled_from([[[True]], "causal", 2]))}


@st.composite
def bad_module_calls(draw: st.DrawFn) -> ModuleCall:
    B, H, L, S = (draw(st.integers(1, 3)) for _ in range(4))
    E, C = 4 * H, draw(st.integers(1, 6))
    batch_first = draw(st.booleans())
    cross = draw(st.booleans())
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    torch.manual_seed(draw(st.integers(0, 2**16)))
    if cross:
        module: torch.nn.Module = attnkit.CrossAttention(
            E, H, context_dim=C, batch_first=batch_first, dtype=dtype
        )
    else:
        module = attnkit.MultiHeadAttention(
            E, H, kdim=C, vdim=C, batch_first=batch_first, dtype=dtype
        )

    def layout(b: int, n: int, e: int) -> torch.Tensor:
        return torch.randn((b, n, e) if batch_first else (n, b, e), dtype=dtype)

    args: list[Any] = [layout(B, L, E), layout(B, S, C)]
    if not cross:
        args.append(layout(B, S, C))
    kw: dict[str, Any] = {}
    faults = draw(
        st.lists(
            st.sampled_from(
                ["input", "not-a-tensor", "key-mask", "attn-mask", "mask", "flags", "batch"]
            ),
            min_size=1,
            max_size=3,
            unique=True,
        )
    )
    for fault in faults:
        i = draw(st.integers(0, len(args) - 1))
        if not isinstance(args[i], torch.Tensor):
            continue
        if fault == "input":
            args[i] = _tensor_with(args[i], draw)
        elif fault == "not-a-tensor":
            args[i] = draw(st.sampled_from(NOT_TENSORS))
        elif fault == "key-mask":
            kw.update(_key_mask_fault(draw, B, S, dtype))
        elif fault == "attn-mask":
            kw.update(_attn_mask_fault(draw, B, H, L, S, dtype))
        elif fault == "mask":
            kw["mask"] = _bad_mask(draw, B, H, L, S, dtype)
        elif fault == "flags":
            name = draw(st.sampled_from(["need_weights", "average_attn_weights"]))
            kw[name] = draw(st.sampled_from([1, "yes", None]))
        elif args[i].dim() == 3:
            args[i] = args[i][:-1] if batch_first else args[i][:, :-1]  # one batch row short
    return ModuleCall(module, args, kw, faults)


@settings(max_examples=300)
@given(call=bad_module_calls())
def test_module_bad_inputs_end_in_attnkit_error(call: ModuleCall) -> None:
    out = _outcome(lambda: call.module(*call.args, **call.kw))
    if out is not None:
        y = out.output
        assert y.shape == (*call.args[0].shape[:-1], call.module.embed_dim)
        assert not y.isnan().any()
        if out.weights is not None:
            assert not out.weights.isnan().any()


@pytest.mark.parametrize("dtype", [torch.complex64, torch.int64, torch.uint8])
def test_a_square_mask_of_no_mask_dtype_on_a_module_is_refused_not_crashed(
    dtype: torch.dtype,
) -> None:
    """The inverted-causal warning reads a square mask's diagonal before the module's checks
    run: a complex or integer mask must reach those checks (found by hypothesis: a complex
    2 x 2 mask crashed in ``mask > -inf``)."""
    m = attnkit.MultiHeadAttention(4, 1, kdim=1, vdim=1)
    x, k, v = torch.randn(2, 2, 4), torch.randn(2, 2, 1), torch.randn(2, 2, 1)
    with pytest.raises(AttentionInputError) as info:
        m(x, k, v, mask=torch.ones(2, 2, dtype=dtype))
    text = str(info.value)
    assert "`mask` has dtype" in text
    assert str(dtype) in text


@pytest.mark.parametrize("shape", [(0,), (3,), (2, 3)])
def test_a_module_mask_that_does_not_fit_the_keys_is_refused_not_crashed(
    shape: tuple[int, ...],
) -> None:
    """A ``mask`` of the wrong shape next to a key-padding mask: the module merges the two
    before attention() checks them, and that merge must not crash in ``&`` (found by
    hypothesis: an empty bool mask with ``attention_mask`` raised torch's RuntimeError)."""
    m = attnkit.MultiHeadAttention(4, 1, kdim=1, vdim=1, batch_first=False)
    q, k, v = torch.randn(1, 1, 4), torch.randn(2, 1, 1), torch.randn(2, 1, 1)
    with pytest.raises(AttentionInputError) as info:
        m(q, k, v, attention_mask=torch.tensor([[1, 0]]), mask=torch.ones(shape, dtype=torch.bool))
    text = str(info.value)
    assert "`mask` does not broadcast to (B, H, L, S)" in text
    assert "target (B=1, H=1, L=1, S=2)" in text
