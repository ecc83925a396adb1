"""Input validation of attnkit.attention: every bad input raises AttentionInputError with a message
that helps (the modules' cases: tests/validation/test_module_validation.py).

Each case is a ``validation_cases.Case`` whose message ``check_error`` reads part by part: the
argument it names, the shapes it got with their dim names, the expected part and the fix.

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
Dk query/key head dim, Dv value head dim.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

import attnkit
from attnkit import AttentionInputError, AttentionMaskWarning, attention, explain
from validation_cases import B, Case, Dk, H, L, Q, S, check_error, param, qkv, r

# ------------------------------------------------------------------ attention(): q, k, v shapes

QKV_CASES = [
    param(
        "q-3d",
        Case(
            lambda: attention(r(B, L, Dk), *qkv()[1:]),
            "q",
            ("`q` is 3-D", "4-D"),
            (f"q (3-D: {B}, {L}, {Dk})", f"k (B={B}, Hkv={H}, S={L}, Dk={Dk})"),
            "q (B, H, L, Dk)",
            "attnkit.split_heads(x, num_heads)",
        ),
    ),
    param(
        "k-3d",
        Case(
            lambda: attention(r(B, H, L, Dk), r(B, L, Dk), r(B, H, L, Dk)),
            "k",
            ("`k` is 3-D",),
            (Q, f"k (3-D: {B}, {L}, {Dk})", f"v (B={B}, Hkv={H}, S={L}, Dv={Dk})"),
            "k (B, Hkv, S, Dk)",
            "split_heads",
        ),
    ),
    param(
        "q-5d",
        Case(
            lambda: attention(r(1, B, H, L, Dk), *qkv()[1:]),
            "q",
            ("`q` is 5-D",),
            (f"q (5-D: 1, {B}, {H}, {L}, {Dk})",),
            "q (B, H, L, Dk)",
            "reshape it to 4-D",
        ),
    ),
    param(
        "batch-mismatch-k",
        Case(
            lambda: attention(r(B, H, L, Dk), r(3, H, L, Dk), r(3, H, L, Dk)),
            "k",
            (f"q has B={B}, k has B=3",),
            (Q, f"k (B=3, Hkv={H}, S={L}, Dk={Dk})"),
            "the same B in q, k and v",
            ".transpose(0, 1)",
        ),
    ),
    param(
        "batch-mismatch-v",
        Case(
            lambda: attention(r(B, H, L, Dk), r(B, H, L, Dk), r(3, H, L, Dk)),
            "v",
            (f"k has B={B}, v has B=3",),
            (f"v (B=3, Hkv={H}, S={L}, Dv={Dk})",),
            "the same B in q, k and v",
            "batch dimension is first",
        ),
    ),
    param(
        "dk-mismatch",
        Case(
            lambda: attention(r(B, H, L, Dk), r(B, H, L, 8), r(B, H, L, Dk)),
            "k",
            (f"q has Dk={Dk}, k has Dk=8",),
            (Q, f"k (B={B}, Hkv={H}, S={L}, Dk=8)"),
            "q.shape[-1] == k.shape[-1]",
            "same head dim",
        ),
    ),
    param(
        "k-transposed-self",
        Case(
            lambda: attention(r(B, H, L, Dk), r(B, H, Dk, L), r(B, H, L, Dk)),
            "k",
            (f"q has Dk={Dk}, k has Dk={L}",),
            (Q, f"k (B={B}, Hkv={H}, S={Dk}, Dk={L})"),
            "q.shape[-1] == k.shape[-1]",
            "k looks transposed (B, Hkv, Dk, S)",
        ),
    ),
    param(
        "k-transposed-cross",
        Case(
            # L=5 queries, S=7 keys: k.transpose(-2, -1) is (B, H, Dk, S), v is (B, H, S, Dk).
            lambda: attention(r(B, H, L, Dk), r(B, H, Dk, S), r(B, H, S, Dk)),
            "k",
            (f"q has Dk={Dk}, k has Dk={S}",),
            (Q, f"k (B={B}, Hkv={H}, S={Dk}, Dk={S})", f"v (B={B}, Hkv={H}, S={S}, Dv={Dk})"),
            "q.shape[-1] == k.shape[-1]",
            "k looks transposed",
        ),
    ),
    param(
        "heads-not-dividing",
        Case(
            lambda: attention(*qkv(Hkv=4)),
            "k",
            ("`k` has 4 heads, which does not divide the 6 heads of `q`",),
            (Q, f"k (B={B}, Hkv=4, S={L}, Dk={Dk})", f"v (B={B}, Hkv=4, S={L}, Dv={Dk})"),
            "H % Hkv == 0",
            "Hkv=1 is multi-query",
        ),
    ),
    param(
        "zero-kv-heads",
        Case(
            lambda: attention(*qkv(Hkv=0)),
            "k",
            ("`k` has 0 heads",),
            (f"k (B={B}, Hkv=0, S={L}, Dk={Dk})",),
            "H % Hkv == 0",
            "divides H",
        ),
    ),
    param(
        "kv-length-mismatch",
        Case(
            lambda: attention(r(B, H, L, Dk), r(B, H, S, Dk), r(B, H, S + 1, Dk)),
            "v",
            (f"k has S={S}, v has S={S + 1}",),
            (f"k (B={B}, Hkv={H}, S={S}, Dk={Dk})", f"v (B={B}, Hkv={H}, S={S + 1}, Dv={Dk})"),
            "k.shape[2] == v.shape[2]",
            "same sequence",
        ),
    ),
    param(
        "kv-heads-mismatch",
        Case(
            lambda: attention(r(B, H, L, Dk), r(B, 2, L, Dk), r(B, 3, L, Dk)),
            "v",
            ("k has Hkv=2, v has Hkv=3",),
            (f"k (B={B}, Hkv=2, S={L}, Dk={Dk})", f"v (B={B}, Hkv=3, S={L}, Dv={Dk})"),
            "k.shape[1] == v.shape[1]",
            "same number of heads",
        ),
    ),
    param(
        "zero-head-dim",
        Case(
            lambda: attention(r(B, H, L, 0), r(B, H, L, 0), r(B, H, L, 4)),
            "q",
            ("head dim Dk is 0",),
            (f"q (B={B}, H={H}, L={L}, Dk=0)",),
            "Dk >= 1",
            None,
        ),
    ),
    # ---------------------------------------------------------------- types, dtypes, devices
    param(
        "q-not-tensor",
        Case(
            lambda: attention([[1.0, 2.0]], *qkv()[1:]),  # type: ignore[arg-type]
            "q",
            ("`q` is a list, not a tensor",),
            ("q: list",),
            "a torch.Tensor",
            "torch.as_tensor(q, dtype=torch.float32)",
        ),
    ),
    param(
        "v-not-tensor",
        Case(
            lambda: attention(*qkv()[:2], 3.0),  # type: ignore[arg-type]
            "v",
            ("`v` is a float, not a tensor",),
            ("v: float",),
            "a torch.Tensor",
            "torch.as_tensor(v",
        ),
    ),
    param(
        "q-integer",
        Case(
            lambda: attention(torch.ones(B, H, L, Dk, dtype=torch.long), *qkv()[1:]),
            "q",
            ("`q` has dtype torch.int64", "floating-point"),
            ("q.dtype = torch.int64",),
            "float16, bfloat16, float32 or float64",
            "q.float() (integer token ids need an nn.Embedding",
        ),
    ),
    param(
        "k-bool",
        Case(
            lambda: attention(
                r(B, H, L, Dk), torch.ones(B, H, L, Dk, dtype=torch.bool), r(B, H, L, Dk)
            ),
            "k",
            ("`k` has dtype torch.bool",),
            ("k.dtype = torch.bool",),
            "float32",
            "k.float()",
        ),
    ),
    param(
        "dtype-mismatch-k",
        Case(
            lambda: attention(r(B, H, L, Dk), r(B, H, L, Dk, dtype=torch.float64), r(B, H, L, Dk)),
            "k",
            ("different dtypes", "never casts silently"),
            ("q.dtype=torch.float32", "k.dtype=torch.float64", "v.dtype=torch.float32"),
            "one dtype for q, k and v",
            "k.to(torch.float32)",
        ),
    ),
    param(
        "dtype-mismatch-v",
        Case(
            lambda: attention(r(B, H, L, Dk), r(B, H, L, Dk), r(B, H, L, Dk, dtype=torch.bfloat16)),
            "v",
            ("different dtypes",),
            ("v.dtype=torch.bfloat16",),
            "one dtype",
            "v.to(torch.float32)",
        ),
    ),
    param(
        # 'meta' tensors have a device but no data: attnkit must reject them before any compute.
        "device-mismatch",
        Case(
            lambda: attention(
                r(B, H, L, Dk), r(B, H, L, Dk, device="meta"), r(B, H, L, Dk, device="meta")
            ),
            "k",
            ("different devices",),
            ("q.device=cpu", "k.device=meta", "v.device=meta"),
            "q, k and v on one device",
            "k.to('cpu')",
        ),
    ),
    # ------------------------------------------------------------------------------- masks
    param(
        "mask-not-broadcastable",
        Case(
            lambda: attention(*qkv(S=S), mask=torch.ones(L, S - 1, dtype=torch.bool)),
            "mask",
            ("`mask` does not broadcast to (B, H, L, S)",),
            (f"mask (L={L}, S={S - 1})", f"target (B={B}, H={H}, L={L}, S={S})"),
            "each mask dim equal to the target's or 1",
            "(L, S), (B, 1, L, S) or (B, H, L, S)",
        ),
    ),
    param(  # a user's tensor inside a spec is checked as it is on its own
        "mask-tensor-inside-a-spec-not-broadcastable",
        Case(
            lambda: attention(
                *qkv(S=S),
                mask=attnkit.masks.causal() & attnkit.masks.DenseMask(torch.zeros(L, S - 1)),
            ),
            "mask",
            ("`mask` does not broadcast to (B, H, L, S)",),
            (f"mask (L={L}, S={S - 1})", f"target (B={B}, H={H}, L={L}, S={S})"),
            "each mask dim equal to the target's or 1",
            "(L, S), (B, 1, L, S) or (B, H, L, S)",
        ),
    ),
    param(
        "mask-tensor-inside-a-spec-wrong-dtype",
        Case(
            lambda: attention(
                *qkv(S=S),
                mask=attnkit.masks.causal()
                & attnkit.masks.DenseMask(torch.zeros(L, S, dtype=torch.float64)),
            ),
            "mask",
            ("float `mask` has dtype torch.float64 but q has torch.float32",),
            (f"mask (L={L}, S={S}) dtype=torch.float64",),
            "a float mask of dtype torch.float32, or a bool mask",
            "mask.to(torch.float32)",
        ),
    ),
    param(
        "mask-key-padding-shape",
        Case(
            lambda: attention(*qkv(S=S), mask=torch.ones(B, S, dtype=torch.bool)),
            "mask",
            ("does not broadcast",),
            (f"mask (L={B}, S={S})", f"target (B={B}, H={H}, L={L}, S={S})"),
            "equal to the target's or 1",
            "a (B, S) key-padding mask needs mask[:, None, None, :]",
        ),
    ),
    param(
        "mask-transposed",
        Case(
            lambda: attention(*qkv(S=S), mask=torch.ones(S, L, dtype=torch.bool)),
            "mask",
            ("does not broadcast",),
            (f"mask (L={S}, S={L})", f"target (B={B}, H={H}, L={L}, S={S})"),
            "equal to the target's or 1",
            "looks transposed (S, L): use mask.transpose(-2, -1)",
        ),
    ),
    param(
        "mask-5d",
        Case(
            lambda: attention(*qkv(S=S), mask=torch.ones(1, 1, 1, L, S, dtype=torch.bool)),
            "mask",
            ("does not broadcast",),
            (f"mask (5-D: 1, 1, 1, {L}, {S})",),
            "at most 4 dims",
            "size-1 dims broadcast",
        ),
    ),
    param(
        "mask-heads-mismatch-square",
        # L == S: a transposed (S, L) mask would broadcast, so the transposed hint cannot apply
        Case(
            lambda: attention(*qkv(), mask=torch.ones(3, L, L, dtype=torch.bool)),
            "mask",
            ("does not broadcast",),
            (f"mask (H=3, L={L}, S={L})", f"target (B={B}, H={H}, L={L}, S={L})"),
            "equal to the target's or 1",
            "size-1 dims broadcast",
        ),
    ),
    param(
        "mask-integer",
        Case(
            lambda: attention(*qkv(), mask=torch.ones(L, L, dtype=torch.long)),
            "mask",
            ("`mask` has dtype torch.int64", "ambiguous"),
            (f"mask (L={L}, S={L}) dtype=torch.int64",),
            "a bool mask (True = may attend)",
            "mask.bool() if 1 means 'may attend', mask == 0 if 1 means 'blocked'",
        ),
    ),
    param(
        "mask-float-other-dtype",
        Case(
            lambda: attention(*qkv(), mask=torch.zeros(B, 1, L, L, dtype=torch.float64)),
            "mask",
            ("float `mask` has dtype torch.float64 but q has torch.float32",),
            (f"mask (B={B}, H=1, L={L}, S={L}) dtype=torch.float64",),
            "a float mask of dtype torch.float32, or a bool mask",
            "mask.to(torch.float32)",
        ),
    ),
    param(
        "mask-not-tensor",
        Case(
            lambda: attention(*qkv(), mask=[[True] * L] * L),  # type: ignore[arg-type]
            "mask",
            ("`mask` is a list, not a tensor",),
            ("mask: list",),
            "a bool tensor (True = may attend)",
            "torch.as_tensor(mask, dtype=torch.bool)",
        ),
    ),
    param(
        "mask-other-device",
        Case(
            lambda: attention(*qkv(), mask=torch.ones(L, L, dtype=torch.bool, device="meta")),
            "mask",
            ("`mask` is on meta but q is on cpu",),
            ("mask.device=meta", "q.device=cpu"),
            "the mask on q's device",
            "mask.to('cpu')",
        ),
    ),
    # ------------------------------------------------------------------- named backends
    param(
        "sdpa-with-weights",
        Case(
            lambda: attention(*qkv(), backend="sdpa", return_weights=True),
            "backend",
            ("backend 'sdpa' cannot serve this call", "return_weights=True"),
            ("backend='sdpa'",),
            "never falls back silently",
            "backend='auto'",
        ),
    ),
    param(
        "sdpa-dv-differs",
        Case(
            lambda: attention(*qkv(Dv=8), backend="sdpa"),
            "backend",
            ("backend 'sdpa' cannot serve this call", f"Dv=8 differs from Dk={Dk}"),
            ("backend='sdpa'",),
            "never falls back silently",
            "attnkit.explain(...)",
        ),
    ),
]


@pytest.mark.parametrize("case", QKV_CASES)
def test_bad_input_message(case: Case) -> None:
    with pytest.raises(AttentionInputError) as info:
        case.call()
    check_error(info.value, case)


# ---------------------------------------------------------------- attention(): scalar arguments

SCALAR_FIX = {
    "scale": f"leave it out for 1/sqrt({Dk}) = 0.25",
    "dropout_p": "pass dropout_p=0.0 to turn dropout off",
    "causal": "pass a boolean mask as mask=..., and causal=True only for the causal rule",
    "backend": "backend='auto' picks the fastest backend",
}
SCALAR_EXPECTED = {
    "scale": "scale > 0 (default 1/sqrt(Dk))",
    "dropout_p": "0 <= dropout_p < 1",
    "causal": "True or False",
    "backend": "'auto' or one of [",
}
SCALAR_PROBLEM = {
    "scale": "`scale` must be a positive finite number, got {!r}",
    "dropout_p": "`dropout_p` must be in [0, 1), got {!r}",
    "causal": "`causal` is of type {}",
    "backend": "unknown backend {!r}",
}


@pytest.mark.parametrize(
    ("argument", "value"),
    [
        pytest.param("scale", 0.0, id="scale-zero"),
        pytest.param("scale", -0.25, id="scale-negative"),
        pytest.param("scale", math.nan, id="scale-nan"),
        pytest.param("scale", math.inf, id="scale-inf"),
        pytest.param("scale", True, id="scale-bool"),
        pytest.param("scale", "0.25", id="scale-str"),
        pytest.param("dropout_p", -0.1, id="dropout-negative"),
        pytest.param("dropout_p", 1.0, id="dropout-one"),
        pytest.param("dropout_p", 1.5, id="dropout-above-one"),
        pytest.param("dropout_p", math.nan, id="dropout-nan"),
        pytest.param("dropout_p", True, id="dropout-bool"),
        pytest.param("dropout_p", None, id="dropout-none"),
        pytest.param("causal", 1, id="causal-int"),
        pytest.param("causal", "yes", id="causal-str"),
        pytest.param("causal", None, id="causal-none"),
        pytest.param("causal", torch.tensor(True), id="causal-tensor"),
        pytest.param("backend", "flash", id="backend-unknown"),
        pytest.param("backend", "SDPA", id="backend-wrong-case"),
        pytest.param("backend", None, id="backend-none"),
    ],
)
def test_bad_scalar_argument(argument: str, value: object) -> None:
    with pytest.raises(AttentionInputError) as info:
        attention(*qkv(), **{argument: value})
    problem = SCALAR_PROBLEM[argument].format(
        type(value).__name__ if argument == "causal" else value
    )
    got = f"{argument}={value!r}"
    check_error(
        info.value,
        Case(
            lambda: None,
            argument,
            (problem,),
            (got,),
            SCALAR_EXPECTED[argument],
            SCALAR_FIX[argument],
        ),
    )
    if argument == "backend":
        assert str(attnkit.available_backends()) in info.value.expected


def test_valid_scalars_are_accepted() -> None:
    q, k, v = qkv()
    for kwargs in (
        {"scale": 1},
        {"scale": 0.1},
        {"scale": np.float32(0.25)},  # NumPy numbers are numbers
        {"dropout_p": np.float64(0.1)},
        {"dropout_p": 0},
        {"dropout_p": 0.5},
        {"causal": True},
        {"backend": "math"},
        {"backend": "sdpa"},
    ):
        assert attention(q, k, v, **kwargs).shape == (B, H, L, Dk)


@pytest.mark.parametrize("grad", [False, True])
def test_a_tensor_scale_is_refused_with_why(grad: bool) -> None:
    """Taking float(t) would drop a learned scale's gradient: refused, saying what to do."""
    scale = torch.tensor(0.25, requires_grad=grad)
    with pytest.raises(AttentionInputError) as info:
        attention(*qkv(), scale=scale)
    e = info.value
    assert e.argument == "scale"
    assert "`scale` must be a number, not a tensor" in e.problem
    assert e.got == "scale: tensor () torch.float32" + (" requires_grad" if grad else "")
    assert "multiply q by it and pass scale=1.0" in str(e)


def test_return_weights_not_a_bool() -> None:
    with pytest.raises(AttentionInputError) as info:
        attention(*qkv(), return_weights="no")  # type: ignore[call-overload]
    assert info.value.argument == "return_weights"


def test_named_backend_never_falls_back() -> None:
    """sdpa refuses the call; auto serves the same call with math; explain says why."""
    q, k, v = qkv(Dv=8)
    with pytest.raises(AttentionInputError, match="cannot serve"):
        attention(q, k, v, backend="sdpa")
    assert attention(q, k, v).shape == (B, H, L, 8)
    report = explain(q, k, v)
    assert report.chosen == "math"
    assert report.verdicts["sdpa"] is not None
    assert "Dv=8" in report.verdicts["sdpa"]


def test_explain_validates_like_attention() -> None:
    q, k, v = qkv(Hkv=4)
    with pytest.raises(AttentionInputError) as info:
        explain(q, k, v)
    assert info.value.argument == "k"
    assert str(info.value).startswith("attnkit.explain: `k` has 4 heads")
    with pytest.raises(AttentionInputError, match="backend 'sdpa' cannot serve"):
        explain(*qkv(), backend="sdpa", return_weights=True)


def test_error_type() -> None:
    assert issubclass(AttentionInputError, ValueError)
    assert attnkit.AttentionInputError is AttentionInputError
    with pytest.raises(ValueError, match="does not divide"):
        attention(*qkv(Hkv=4))
    exc = AttentionInputError("f", "x", "bad.", got="x (B=1)", expected="good")
    assert (exc.argument, exc.got, exc.expected, exc.fix) == ("x", "x (B=1)", "good", None)
    assert str(exc) == "f: bad.\n  got:      x (B=1)\n  expected: good"


# ------------------------------------------------------------------------------ warnings

INVERTED_FIX = ("causal=True", "~mask", "True = may attend")


def test_inverted_causal_mask_warns() -> None:
    """Seed 001 builds the mask of positions to *block*; in attnkit's convention it is inverted."""
    inverted = torch.ones(L, L).triu(1).bool()
    with pytest.warns(AttentionMaskWarning, match="inverted causal mask") as record:
        out = attention(*qkv(), mask=inverted)
    assert out.shape == (B, H, L, Dk)  # it warns; it does not refuse a valid mask
    message = str(record[0].message)
    for part in INVERTED_FIX:
        assert part in message


@pytest.mark.parametrize("blocked", [float("-inf"), -1e9, -1e4], ids=["-inf", "-1e9", "-1e4"])
def test_inverted_causal_float_mask_warns(blocked: float) -> None:
    """Seed 001's float form writes -1e9 where it blocks: as blocking as -inf."""
    inverted = torch.zeros(L, L).masked_fill(~torch.ones(L, L).triu(1).bool(), blocked)
    with pytest.warns(AttentionMaskWarning, match=r"causal=True .* ~mask"):
        attention(*qkv(), mask=inverted)


@pytest.mark.parametrize(
    "mask",
    [
        pytest.param(torch.ones(L, L).tril().bool(), id="tril"),
        pytest.param(attnkit.causal_mask(L, L), id="causal_mask"),
        pytest.param(~torch.ones(L, L).triu(1).bool(), id="inverted-back"),
        pytest.param(torch.ones(L, L, dtype=torch.bool), id="all-true"),
        pytest.param(torch.eye(L, dtype=torch.bool), id="diagonal"),
        pytest.param(
            torch.zeros(L, L).masked_fill(~torch.ones(L, L).tril().bool(), -math.inf),
            id="float-tril",
        ),
        pytest.param(
            torch.zeros(L, L).masked_fill(~torch.ones(L, L).tril().bool(), -1e9),
            id="float-tril-1e9",
        ),
        pytest.param(-torch.ones(L, L).triu(1) * 5.0, id="mild-bias-not-blocking"),
    ],
)
def test_correct_masks_do_not_warn(mask: torch.Tensor) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", AttentionMaskWarning)
        attention(*qkv(), mask=mask)
        attention(*qkv(), causal=True)


def test_mask_warning_points_at_caller() -> None:
    with pytest.warns(AttentionMaskWarning) as record:
        attention(*qkv(), mask=torch.ones(L, L).triu(1).bool())
    assert record[0].filename == __file__
