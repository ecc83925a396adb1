"""Input checks for :func:`attnkit.attention`, :func:`attnkit.explain`, the modules and ring
attention: small pieces, each caller running the ones it needs before
:meth:`AttentionCall.build <attnkit.call.AttentionCall.build>`.

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
Dk query/key head dim, Dv value head dim, E model width.

The pieces, in the order :func:`attnkit.attention` runs them:

- :func:`check_qkv`: q, k and v (tensors, dtypes, ranks, devices, sizes), returning the
  :class:`~attnkit.call.Dims`;
- :func:`attnkit.mask_checks.check_mask`: a mask tensor or spec against those sizes (and a
  float mask's values), then :func:`warn_if_inverted_causal` for a mask given in attnkit's
  convention;
- :func:`check_scalars`: ``causal``, ``scale``, ``dropout_p``, ``return_weights``, ``softcap``;
- :func:`check_sinks`: attention sinks ``(H,)``, ``(B, H, L)`` or ``(1, H, L)``.

Every check raises :class:`~attnkit.errors.AttentionInputError` with the argument's name, the
shapes it got (with dim names), what was expected and the likely fix. Checks that look at tensor
*values* (``+inf`` or NaN in a float mask, the inverted-causal-mask warning) are skipped while
``torch.compile`` traces, so that a compiled model has no data-dependent branches, and on the
``meta`` device (no values); shape and dtype checks always run.
"""

from __future__ import annotations

import math
import numbers

import torch

from attnkit import errors
from attnkit.call import Dims
from attnkit.errors import (
    DTYPE_NAMES,
    AttentionInputError,
    dtype_error,
    rank_error,
    shape_str,
    warn_user,
)
from attnkit.masks import MaskSpec
from attnkit.memory import too_big_error  # re-exported: attnkit.backends imports it from here

__all__ = [
    "WHERE",
    "can_read_values",
    "check_qkv",
    "check_scalars",
    "check_sinks",
    "is_real",
    "too_big_error",
    "warn_if_inverted_causal",
]

Q_DIMS = ("B", "H", "L", "Dk")
K_DIMS = ("B", "Hkv", "S", "Dk")
V_DIMS = ("B", "Hkv", "S", "Dv")

#: the ``where`` of :func:`attnkit.attention`'s errors (the modules' calls name it too)
WHERE = "attnkit.attention"


def _qkv_str(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    return "  ".join(
        (shape_str("q", q, Q_DIMS), shape_str("k", k, K_DIMS), shape_str("v", v, V_DIMS))
    )


def _check_tensor(name: str, t: object, where: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise AttentionInputError(
            where,
            name,
            f"`{name}` is a {type(t).__name__}, not a tensor.",
            got=f"{name}: {type(t).__name__}",
            expected="a torch.Tensor",
            fix=f"convert it first, e.g. torch.as_tensor({name}, dtype=torch.float32)",
        )
    if t.dtype in errors.DTYPES:  # the usual case: no message is built
        return
    error = dtype_error(
        where,
        name,
        t.dtype,
        f"{name}.dtype = {t.dtype}",
        fix_int=f"{name}.float() (integer token ids need an nn.Embedding before attention)",
    )
    if error is not None:
        raise error


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, where: str) -> Dims:
    """Check queries ``(B, H, L, Dk)``, keys ``(B, Hkv, S, Dk)`` and values ``(B, Hkv, S, Dv)``
    (tensors of a dtype attnkit computes in, one dtype, one device, sizes that agree) and
    return their sizes. Raises :class:`AttentionInputError` naming the argument."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, where)
    for name, t, names in (("q", q, Q_DIMS), ("k", k, K_DIMS), ("v", v, V_DIMS)):
        if t.dim() != 4:
            fix = (
                "a (B, L, E) tensor needs attnkit.split_heads(x, num_heads) first; "
                "for one head use x.unsqueeze(1)"
                if t.dim() == 3
                else "reshape it to 4-D with a heads dimension"
            )
            raise rank_error(where, name, t, names, got=_qkv_str(q, k, v), fix=fix)
    if not (q.dtype == k.dtype == v.dtype):
        raise AttentionInputError(
            where,
            "k" if k.dtype != q.dtype else "v",
            "q, k and v have different dtypes; attnkit never casts silently.",
            got=f"q.dtype={q.dtype}  k.dtype={k.dtype}  v.dtype={v.dtype}",
            expected="one dtype for q, k and v",
            fix=f"cast them yourself, e.g. k.to({q.dtype}), v.to({q.dtype})",
        )
    if not (q.device == k.device == v.device):
        raise AttentionInputError(
            where,
            "k" if k.device != q.device else "v",
            "q, k and v are on different devices.",
            got=f"q.device={q.device}  k.device={k.device}  v.device={v.device}",
            expected="q, k and v on one device",
            fix=f"move them: k.to({str(q.device)!r}), v.to({str(q.device)!r})",
        )
    return _qkv_dims(q, k, v, where)


def _qkv_dims(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, where: str) -> Dims:
    """The sizes of 4-D q, k, v, checked to agree with each other."""
    B, H, L, Dk = q.shape
    Bk, Hkv, S, Dkk = k.shape
    Bv, Hv, Sv, Dv = v.shape
    if not (B == Bk == Bv):
        raise AttentionInputError(
            where,
            "k" if Bk != B else "v",
            f"batch sizes differ: q has B={B}, k has B={Bk}, v has B={Bv}.",
            got=_qkv_str(q, k, v),
            expected="the same B in q, k and v",
            fix="check that the batch dimension is first in all three "
            "(a (seq, batch, ...) tensor needs .transpose(0, 1))",
        )
    if Dkk != Dk:
        fix = "project queries and keys to the same head dim"
        if k.shape[-2] == Dk and Dkk == v.shape[2]:
            fix = "k looks transposed (B, Hkv, Dk, S): pass k itself, attention transposes it"
        raise AttentionInputError(
            where,
            "k",
            f"query/key head dims differ: q has Dk={Dk}, k has Dk={Dkk}.",
            got=_qkv_str(q, k, v),
            expected="q.shape[-1] == k.shape[-1] (the dot product needs equal lengths)",
            fix=fix,
        )
    if Hv != Hkv:
        raise AttentionInputError(
            where,
            "v",
            f"k and v have different head counts: k has Hkv={Hkv}, v has Hkv={Hv}.",
            got=_qkv_str(q, k, v),
            expected="k.shape[1] == v.shape[1]",
            fix="project keys and values to the same number of heads",
        )
    if Hkv == 0 or H % Hkv != 0:
        raise AttentionInputError(
            where,
            "k",
            f"`k` has {Hkv} heads, which does not divide the {H} heads of `q`.",
            got=_qkv_str(q, k, v),
            expected="H % Hkv == 0 (each key/value head serves H/Hkv query heads)",
            fix="give k and v a number of heads that divides H (Hkv=1 is multi-query); "
            "if heads and length are swapped, use .transpose(1, 2)",
        )
    if Sv != S:
        raise AttentionInputError(
            where,
            "v",
            f"k and v have different lengths: k has S={S}, v has S={Sv}.",
            got=_qkv_str(q, k, v),
            expected="k.shape[2] == v.shape[2] (one value per key)",
            fix="keys and values must come from the same sequence",
        )
    if Dk == 0:
        raise AttentionInputError(
            where,
            "q",
            "the head dim Dk is 0.",
            got=_qkv_str(q, k, v),
            expected="Dk >= 1",
        )
    return Dims(B, H, Hkv, L, S, Dk, Dv)


def check_scalars(
    dims: Dims,
    *,
    where: str,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    softcap: float | None = None,
) -> None:
    """Check the call's flags and numbers: ``causal`` and ``return_weights`` are bools,
    ``scale`` a positive finite number (not a tensor) or ``None``, ``0 <= dropout_p < 1``,
    ``softcap`` a positive finite number or ``None``. ``dims`` (from :func:`check_qkv`) names
    the default scale in the message. Raises :class:`AttentionInputError`."""
    if not isinstance(causal, bool):
        raise AttentionInputError(
            where,
            "causal",
            f"`causal` is of type {type(causal).__name__}; it is a flag.",
            got=f"causal={causal!r}",
            expected="True or False",
            fix="pass a boolean mask as mask=..., and causal=True only for the causal rule",
        )
    if scale is not None:
        _check_scale(scale, dims.Dk, where)
    if not is_real(dropout_p) or not 0.0 <= dropout_p < 1.0:
        raise AttentionInputError(
            where,
            "dropout_p",
            f"`dropout_p` must be in [0, 1), got {dropout_p!r}.",
            got=f"dropout_p={dropout_p!r}",
            expected="0 <= dropout_p < 1 (a probability of dropping a weight)",
            fix="pass dropout_p=0.0 to turn dropout off",
        )
    if not isinstance(return_weights, bool):
        raise AttentionInputError(
            where,
            "return_weights",
            f"`return_weights` is of type {type(return_weights).__name__}; it is a flag.",
            got=f"return_weights={return_weights!r}",
            expected="True or False",
        )
    if softcap is not None:
        _check_softcap(softcap, where)


def _check_scale(scale: float | None, Dk: int, where: str) -> None:
    if isinstance(scale, torch.Tensor):
        raise AttentionInputError(
            where,
            "scale",
            "`scale` must be a number, not a tensor: attnkit's backends take a constant, so a "
            "learned or computed scale would lose its gradient.",
            got=f"scale: tensor {tuple(scale.shape)} {scale.dtype}"
            + (" requires_grad" if scale.requires_grad else ""),
            expected="a Python or NumPy number > 0 (default 1/sqrt(Dk))",
            fix="scale=float(t) for a constant; for a learned temperature, multiply q by it "
            "and pass scale=1.0",
        )
    if scale is not None and (not is_real(scale) or not math.isfinite(scale) or scale <= 0):
        kind = "" if is_real(scale) else f" (a {type(scale).__name__})"
        raise AttentionInputError(
            where,
            "scale",
            f"`scale` must be a positive finite number, got {scale!r}{kind}.",
            got=f"scale={scale!r}",
            expected="scale > 0 (default 1/sqrt(Dk))",
            fix=f"leave it out for 1/sqrt({Dk}) = {1 / math.sqrt(Dk):.4g}",
        )


def _check_softcap(softcap: object, where: str) -> None:
    if (
        isinstance(softcap, bool)
        or not isinstance(softcap, (int, float))
        or not math.isfinite(softcap)
        or softcap <= 0
    ):
        raise AttentionInputError(
            where,
            "softcap",
            f"`softcap` must be a positive finite number, got {softcap!r}.",
            got=f"softcap={softcap!r}",
            expected="softcap > 0 (scores become softcap * tanh(scores / softcap)), or None",
            fix="Gemma 2 uses its config's attn_logit_softcapping (50.0); None turns it off",
        )


def check_sinks(sinks: object, q: torch.Tensor, dims: Dims, *, where: str) -> None:
    """Check attention sinks: ``None``, or a tensor of q's dtype on q's device holding one
    logit per query head, ``(H,)`` (the same for every row), or one per query row and head,
    ``(B, H, L)``, or ``(1, H, L)`` for every sequence of the batch (``dims`` from
    :func:`check_qkv`). Raises :class:`AttentionInputError`."""
    if sinks is None:
        return
    want = (
        f"sinks (H={dims.H},) or (B={dims.B}, H={dims.H}, L={dims.L}) or (1, H={dims.H}, "
        f"L={dims.L}), of dtype {q.dtype} on {q.device}"
    )
    if not isinstance(sinks, torch.Tensor):
        problem, got, fix = "`sinks` is not a tensor.", f"sinks: {type(sinks).__name__}", None
    elif (shape_fix := _sinks_shape_fix(tuple(sinks.shape), dims)) is not None:
        problem, fix = shape_fix
        named = {1: ("H",), 3: ("B", "H", "L")}.get(sinks.dim())
        got = f"{shape_str('sinks', sinks, named)}  q (B={dims.B}, H={dims.H}, L={dims.L})"
    elif sinks.dtype != q.dtype or sinks.device != q.device:
        got = f"sinks {sinks.dtype} on {sinks.device}, q {q.dtype} on {q.device}"
        computes = f"{want} (attnkit computes in {DTYPE_NAMES})"
        error = dtype_error(where, "sinks", sinks.dtype, got, expected=computes)
        if error is not None:  # float8, complex, integers: not a dtype attnkit computes in
            raise error
        problem = "`sinks` has another dtype or device than q; attnkit never casts."
        fix = f"sinks.to(dtype={q.dtype}, device={str(q.device)!r})"
    else:
        return
    raise AttentionInputError(where, "sinks", problem, got=got, expected=want, fix=fix)


def _sinks_shape_fix(shape: tuple[int, ...], dims: Dims) -> tuple[str, str] | None:
    """What is wrong with sinks of ``shape`` and the likely fix, or ``None`` where the shape is
    one :func:`check_sinks` takes."""
    B, H, L = dims.B, dims.H, dims.L
    if shape == (H,) or shape in ((B, H, L), (1, H, L)):
        return None
    if len(shape) == 1:
        problem = f"`sinks` has shape {shape}; it holds one logit per query head."
        return problem, "one learned logit per query head, e.g. nn.Parameter(torch.zeros(H))"
    problem = f"`sinks` has shape {shape}; per-token sinks hold one logit per query row and head."
    if shape in ((B, H, L, 1), (1, H, L, 1)):
        return problem, "sinks.squeeze(-1) (transformers passes Inkling 2's sinks as (B, H, L, 1))"
    if shape in ((B, L, H), (1, L, H)):
        return problem, "sinks.transpose(1, 2) (heads before query rows, as in q)"
    fix = f"(H={H},) for one sink per head, or (B={B}, H={H}, L={L}) for one per query row"
    return problem, fix


def is_real(x: object) -> bool:
    """A real number: Python's or NumPy's (``numbers.Real``), not a bool."""
    if type(x) is float or type(x) is int:  # the usual case, before the slower ABC check
        return True
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def can_read_values(t: torch.Tensor) -> bool:
    """Value checks run outside ``torch.compile``'s tracing, on tensors that hold values."""
    return not torch.compiler.is_compiling() and t.device.type != "meta"


#: a float mask value at or below this blocks (seed 001 writes -1e9; fp16 code -1e4), for the
#: inverted-mask check only: the backends add float masks as they are
BLOCKING = -1e4
_ATTNKIT_CONVENTION = (
    "attnkit's convention is True = may attend (as in F.scaled_dot_product_attention). Fix: "
    "pass causal=True instead of a mask, or invert it with ~mask (a mask built as "
    "ones(L, L).triu(1).bool() marks the positions to *block*)."
)


def warn_if_inverted_causal(
    allowed_mask: torch.Tensor | MaskSpec | None,
    argument: str = "mask",
    convention: str = _ATTNKIT_CONVENTION,
) -> None:
    """Warn on a square mask that forbids every diagonal entry but allows some future key.

    That is the mask of seed 001 (``ones(L, L).triu(1).bool()``, or its float form with
    ``-inf`` / ``-1e9``) read with attnkit's True = may attend convention: each token sees only
    the tokens after it, and the last token sees nothing. ``allowed_mask`` is in attnkit's
    convention (bool True = may attend, or float added); ``argument`` and ``convention`` say
    what the caller passed (a module's ``attn_mask`` keeps torch's meaning). It is checked only
    when the whole diagonal is blocked, so the usual masks cost one pass over the diagonal.
    A spec, ``None``, a tensor whose values cannot be read (:func:`can_read_values`), or one
    that is neither bool nor floating (not a mask: the caller's checks say so) gets no warning.
    """
    mask = allowed_mask
    if not isinstance(mask, torch.Tensor):
        return
    if mask.dtype != torch.bool and not mask.is_floating_point():
        return
    if not (mask.dim() >= 2 and mask.shape[-2] == mask.shape[-1] > 1) or not can_read_values(mask):
        return
    allowed = mask if mask.dtype == torch.bool else mask > BLOCKING
    if bool(allowed.diagonal(dim1=-2, dim2=-1).any()):
        return
    if bool(allowed.triu(1).any()):
        warn_user(
            f"attnkit: this {argument} blocks every token from itself and lets it see only "
            f"later tokens: it looks like an inverted causal mask. {convention}"
        )
