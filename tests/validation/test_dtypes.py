"""The dtypes attnkit computes in, and the refusal of every other (issue 22, item 14).

float16, bfloat16, float32 and float64 are computed (each backend serves them or says why it
does not); float8 of every kind, complex, integers and bool are refused with
:class:`~attnkit.AttentionInputError` naming the argument, its dtype and the dtypes attnkit
computes in, whichever backend is named, before any backend sees the tensors (they used to
reach the backends and fail there with torch's ``NotImplementedError``).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import attnkit
from attnkit import AttentionInputError, KVCache, MultiHeadAttention, SelfAttention
from attnkit.modules.positions import RotaryEmbedding
from oracle import reference_attention

NAMES = "float16, bfloat16, float32 or float64"
BACKENDS = ["auto", "math", "sdpa", "blocked", "flex"]
_CANDIDATES = (
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "complex64",
    "complex128",
    "int64",
    "int32",
    "int8",
    "uint8",
    "uint16",
    "bool",
)
UNSUPPORTED = [getattr(torch, n) for n in _CANDIDATES if hasattr(torch, n)]
FLOAT8 = [d for d in UNSUPPORTED if d.is_floating_point]
B, H, L, D = 1, 2, 4, 8


def _as(dtype: torch.dtype, *shape: int) -> torch.Tensor:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    return (x > 0) if dtype == torch.bool else x.abs().to(dtype)  # e8m0 has no sign


def _assert_names_dtype(err: AttentionInputError, argument: str, dtype: torch.dtype) -> None:
    assert err.argument == argument
    message = str(err)
    assert f"`{argument}` has dtype {dtype}" in message
    assert NAMES in message
    if dtype.is_complex:
        assert "real floating-point" in err.problem
    elif dtype.is_floating_point:
        assert "which attnkit does not compute in" in err.problem
    else:
        assert "needs floating-point inputs" in err.problem


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", UNSUPPORTED, ids=str)
def test_attention_refuses_the_dtype_with_every_backend(dtype: torch.dtype, backend: str) -> None:
    q = _as(dtype, B, H, L, D)
    with pytest.raises(AttentionInputError) as err:
        attnkit.attention(q, q, q, causal=True, backend=backend)
    _assert_names_dtype(err.value, "q", dtype)
    assert "q.dtype = " in err.value.got


@pytest.mark.parametrize("argument", ["k", "v"])
@pytest.mark.parametrize("dtype", FLOAT8, ids=str)
def test_one_unsupported_tensor_among_float32_ones_is_named(
    dtype: torch.dtype, argument: str
) -> None:
    t = {n: torch.randn(B, H, L, D) for n in "qkv"}
    t[argument] = _as(dtype, B, H, L, D)
    with pytest.raises(AttentionInputError) as err:
        attnkit.attention(t["q"], t["k"], t["v"], backend="blocked")
    _assert_names_dtype(err.value, argument, dtype)


@pytest.mark.parametrize("dtype", [*FLOAT8, torch.complex64], ids=str)
def test_a_float_mask_of_an_unsupported_dtype_is_named(dtype: torch.dtype) -> None:
    q = torch.randn(B, H, L, D)
    mask = _as(dtype, L, L)
    for backend in BACKENDS:
        with pytest.raises(AttentionInputError) as err:
            attnkit.attention(q, q, q, mask=mask, backend=backend)
        _assert_names_dtype(err.value, "mask", dtype)
        assert "a bool mask (True = may attend)" in err.value.expected
        assert "ambiguous" not in str(err.value)  # not taken for an integer mask


@pytest.mark.parametrize("dtype", [*FLOAT8, torch.complex64, torch.int64], ids=str)
def test_sinks_of_an_unsupported_dtype_are_named(dtype: torch.dtype) -> None:
    q = torch.randn(B, H, L, D)
    with pytest.raises(AttentionInputError) as err:
        attnkit.attention(q, q, q, sinks=_as(dtype, H), backend="blocked")
    _assert_names_dtype(err.value, "sinks", dtype)


def test_explain_refuses_as_attention_does() -> None:
    q = _as(torch.float8_e4m3fn, B, H, L, D)
    with pytest.raises(AttentionInputError) as err:
        attnkit.explain(q, q, q)
    _assert_names_dtype(err.value, "q", torch.float8_e4m3fn)


#: what each backend computes on the CPU, against the float64 oracle (flex compiles for
#: minutes on a CPU: its dtypes are its check's, below)
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("backend", ["auto", "math", "sdpa", "blocked"])
@pytest.mark.parametrize("dtype", list(TOL), ids=str)
def test_every_supported_dtype_is_computed(dtype: torch.dtype, backend: str) -> None:
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, L, D, generator=gen, dtype=torch.float64) for _ in range(3))
    got = attnkit.attention(*(t.to(dtype) for t in (q, k, v)), causal=True, backend=backend)
    assert got.dtype == dtype
    want = reference_attention(q, k, v, causal=True)[0]
    assert (got.double() - want).abs().max() <= TOL[dtype]


def test_flex_refuses_float64_on_cpu_with_its_reason() -> None:
    q = torch.randn(B, H, 256, D, dtype=torch.float64)
    with pytest.raises(AttentionInputError, match="flex on CPU compiles float32, bfloat16"):
        attnkit.attention(q, q, q, causal=True, backend="flex")
    assert attnkit.explain(q, q, q, causal=True).chosen != "flex"


MODULES = {
    "SelfAttention": lambda **kw: SelfAttention(8, 4, **kw),
    "MultiHeadAttention": lambda **kw: MultiHeadAttention(8, 2, **kw),
}


@pytest.mark.parametrize("module", list(MODULES))
@pytest.mark.parametrize("dtype", [*FLOAT8, torch.complex64], ids=str)
def test_modules_refuse_the_dtype(module: str, dtype: torch.dtype) -> None:
    build = MODULES[module]
    where = f"attnkit.{module}"
    with pytest.raises(AttentionInputError) as err:  # built in it
        build(dtype=dtype)
    assert err.value.where == where
    assert err.value.argument == "dtype"
    assert str(dtype) in err.value.problem
    assert NAMES in err.value.expected
    x = _as(dtype, 2, 3, 8)
    with pytest.raises(AttentionInputError) as err:  # an input of it, float32 parameters
        build()(x)
    _assert_names_dtype(err.value, "query", dtype)
    with warnings.catch_warnings():  # torch: "Complex modules are a new feature..."
        warnings.simplefilter("ignore", UserWarning)
        converted = build().to(dtype)  # parameters converted to it afterwards
    with pytest.raises(AttentionInputError) as err:
        converted(x)
    _assert_names_dtype(err.value, "query", dtype)
    with pytest.raises(AttentionInputError) as err:
        converted(torch.randn(2, 3, 8))
    assert err.value.argument == "dtype"
    assert f"the module's parameters are {dtype}" in err.value.problem
    assert "module.to(torch.bfloat16)" in (err.value.fix or "")


@pytest.mark.parametrize("dtype", [*FLOAT8, torch.complex64], ids=str)
def test_cache_and_rope_refuse_the_dtype(dtype: torch.dtype) -> None:
    with pytest.raises(AttentionInputError) as err:
        KVCache(1, 2, 8, 4, dtype=dtype)
    assert err.value.argument == "dtype"
    assert NAMES in err.value.expected
    with pytest.raises(AttentionInputError) as err:
        RotaryEmbedding(8)(_as(dtype, 1, 2, 3, 8))
    _assert_names_dtype(err.value, "x", dtype)
