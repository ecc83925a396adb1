"""Input checks for :func:`attnkit.attention` and the modules, in one place.

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
Dk query/key head dim, Dv value head dim, E model width.

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

from attnkit.call import AttentionCall, Dims
from attnkit.cpu import path_for
from attnkit.errors import (
    DTYPE_NAMES,
    AttentionInputError,
    dtype_error,
    rank_error,
    shape_str,
    warn_user,
)
from attnkit.masks import MaskSpec, as_spec
from attnkit.memory import AttentionMemoryError, refuse

__all__ = [
    "can_read_values",
    "check_mask_values",
    "is_real",
    "make_call",
    "mask_dims_str",
    "too_big_error",
    "warn_if_inverted_causal",
]

Q_DIMS = ("B", "H", "L", "Dk")
K_DIMS = ("B", "Hkv", "S", "Dk")
V_DIMS = ("B", "Hkv", "S", "Dv")
MASK_DIMS = ("B", "H", "L", "S")

WHERE = "attnkit.attention"


def _qkv_str(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    return "  ".join(
        (shape_str("q", q, Q_DIMS), shape_str("k", k, K_DIMS), shape_str("v", v, V_DIMS))
    )


def mask_dims_str(mask: torch.Tensor) -> str:
    """``mask (L=5, S=5)``: a mask's shape named from the right, as broadcasting aligns it."""
    names = MASK_DIMS[len(MASK_DIMS) - mask.dim() :] if mask.dim() <= 4 else None
    return shape_str("mask", mask, names)


def _check_tensor(name: str, t: object, where: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise AttentionInputError(
            where,
            name,
            f"`{name}` is a {type(t).__name__}, not a tensor.",
            got=f"{name}: {type(t).__name__}",
            expected="a torch.Tensor",
            fix=f"convert it first, e.g. torch.as_tensor({name}, dtype=torch.float32)",
        )
    error = dtype_error(
        where,
        name,
        t.dtype,
        f"{name}.dtype = {t.dtype}",
        fix_int=f"{name}.float() (integer token ids need an nn.Embedding before attention)",
    )
    if error is not None:
        raise error
    return t


def make_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | MaskSpec | None,
    causal: bool,
    scale: float | None,
    dropout_p: float,
    return_weights: bool = False,
    *,
    where: str = WHERE,
    explaining: bool = False,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    key_shards: int = 1,
    inverted_check: bool = True,
) -> AttentionCall:
    """Check one attention call and build it: the one door into the backends.

    Folds the ``causal`` flag and the mask into one spec (:func:`attnkit.masks.as_spec`) and
    fixes the scale. ``explaining=True`` marks a call of :func:`attnkit.explain` (nothing runs).
    ``key_shards``: ``k`` is one of that many equal shards of the keys, and a mask spec spans
    all of them (ring attention validates its shard). ``inverted_check=False``: the caller
    (a module) has looked for an inverted causal mask itself, in the convention of the argument
    it was given as (:func:`warn_if_inverted_causal`). Raises :class:`AttentionInputError` for
    bad input.
    """
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
    dims = Dims(B, H, Hkv, L, S, Dk, Dv)
    if mask is not None:
        _validate_mask(mask, q, dims, where, key_shards, inverted_check)
    if not isinstance(causal, bool):
        raise AttentionInputError(
            where,
            "causal",
            f"`causal` is of type {type(causal).__name__}; it is a flag.",
            got=f"causal={causal!r}",
            expected="True or False",
            fix="pass a boolean mask as mask=..., and causal=True only for the causal rule",
        )
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
    _validate_softcap(softcap, where)
    if sinks is not None:
        _validate_sinks(sinks, q, dims, where)
    return AttentionCall(
        q,
        k,
        v,
        as_spec(mask, causal, L=dims.L, S=dims.S, where=where),
        float(scale) if scale is not None else 1.0 / math.sqrt(dims.Dk),
        float(dropout_p),
        return_weights,
        dims,
        float(softcap) if softcap is not None else None,
        sinks,
        explaining,
        path_for(q, where),
    )


def _validate_softcap(softcap: object, where: str) -> None:
    if softcap is None:
        return
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


def _validate_sinks(sinks: object, q: torch.Tensor, dims: Dims, where: str) -> None:
    want = f"sinks (H={dims.H},) of dtype {q.dtype} on {q.device}"
    if not isinstance(sinks, torch.Tensor):
        problem, got, fix = "`sinks` is not a tensor.", f"sinks: {type(sinks).__name__}", None
    elif tuple(sinks.shape) != (dims.H,):
        problem = f"`sinks` has shape {tuple(sinks.shape)}; it holds one logit per query head."
        got = f"{shape_str('sinks', sinks, None)}  q (B={dims.B}, H={dims.H}, L={dims.L})"
        fix = "one learned logit per query head, e.g. nn.Parameter(torch.zeros(H))"
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


def _validate_spec(
    mask: MaskSpec, q: torch.Tensor, dims: Dims, where: str, key_shards: int = 1
) -> None:
    if mask.batch is not None and mask.batch != dims.B:
        raise AttentionInputError(
            where,
            "mask",
            f"the mask spec is built for a batch of {mask.batch} but q has B={dims.B}.",
            got=f"mask={mask!r}  q (B={dims.B}, H={dims.H}, L={dims.L}, Dk={dims.Dk})",
            expected=f"lengths / ids / keep tensors with {dims.B} rows",
            fix="build the spec from this batch's lengths or document ids",
        )
    if mask.heads is not None and mask.heads != dims.H:
        raise AttentionInputError(
            where,
            "mask",
            f"the mask spec is built for {mask.heads} heads but q has H={dims.H}.",
            got=f"mask={mask!r}  q (B={dims.B}, H={dims.H}, L={dims.L}, Dk={dims.Dk})",
            expected=f"a spec for {dims.H} heads",
            fix="build it with the model's number of query heads",
        )
    S = dims.S * key_shards  # the whole sequence's keys
    if mask.length is not None and mask.length != S:
        fix = "build it from a tensor with one entry per key, S of them"
        if mask.length == dims.L * key_shards:
            fix = f"its tensor has one entry per query (L={dims.L}); it needs one per key"
        shards = "" if key_shards == 1 else f" ({key_shards} shards of {dims.S} keys)"
        raise AttentionInputError(
            where,
            "mask",
            f"the mask spec {mask!r} is built for {mask.length} keys but k has S={S}{shards}.",
            got=f"mask={mask!r} (length {mask.length})  k (B={dims.B}, Hkv={dims.Hkv}, "
            f"S={dims.S}, Dk={dims.Dk})",
            expected=f"document ids / key_mask keep with one entry per key: {S}",
            fix=fix + " (with a KV cache, S counts the cached keys too)",
        )
    device = mask.device
    if device is not None and device != q.device:
        raise AttentionInputError(
            where,
            "mask",
            f"the mask spec's tensors are on {device} but q is on {q.device}.",
            got=f"mask={mask!r}",
            expected="the spec's tensors on q's device",
            fix=f"build it from tensors on {str(q.device)!r}",
        )


def _validate_mask(
    mask: object,
    q: torch.Tensor,
    dims: Dims,
    where: str,
    key_shards: int = 1,
    inverted_check: bool = True,
) -> None:
    if isinstance(mask, MaskSpec):
        _validate_spec(mask, q, dims, where, key_shards)
        return
    if not isinstance(mask, torch.Tensor):
        raise AttentionInputError(
            where,
            "mask",
            f"`mask` is a {type(mask).__name__}, not a tensor.",
            got=f"mask: {type(mask).__name__}",
            expected="a bool tensor (True = may attend), a float tensor added to the scores, "
            "or a spec from attnkit.masks",
            fix="torch.as_tensor(mask, dtype=torch.bool)",
        )
    if mask.is_floating_point() or mask.is_complex():  # float8, complex: not computed in
        error = dtype_error(
            where,
            "mask",
            mask.dtype,
            f"{mask_dims_str(mask)} dtype={mask.dtype}",
            expected=f"a bool mask (True = may attend) or a float mask of q's dtype {q.dtype} "
            f"(attnkit computes in {DTYPE_NAMES})",
        )
        if error is not None:
            raise error
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise AttentionInputError(
            where,
            "mask",
            f"`mask` has dtype {mask.dtype}; integer masks are ambiguous (is 1 keep or drop?).",
            got=f"{mask_dims_str(mask)} dtype={mask.dtype}",
            expected="a bool mask (True = may attend) or a float mask of q's dtype (-inf blocks)",
            fix="mask.bool() if 1 means 'may attend', mask == 0 if 1 means 'blocked'",
        )
    if mask.is_floating_point() and mask.dtype != q.dtype:
        raise AttentionInputError(
            where,
            "mask",
            f"float `mask` has dtype {mask.dtype} but q has {q.dtype}; attnkit never casts.",
            got=f"{mask_dims_str(mask)} dtype={mask.dtype}",
            expected=f"a float mask of dtype {q.dtype}, or a bool mask",
            fix=f"mask.to({q.dtype})",
        )
    if mask.device != q.device:
        raise AttentionInputError(
            where,
            "mask",
            f"`mask` is on {mask.device} but q is on {q.device}.",
            got=f"mask.device={mask.device}  q.device={q.device}",
            expected="the mask on q's device",
            fix=f"mask.to({str(q.device)!r})",
        )
    target = (dims.B, dims.H, dims.L, dims.S)
    ok = mask.dim() <= 4 and all(
        m in (1, t) for m, t in zip(mask.shape[::-1], target[::-1], strict=False)
    )
    if not ok:
        fix = "build it as (L, S), (B, 1, L, S) or (B, H, L, S); size-1 dims broadcast"
        if mask.dim() == 2 and tuple(mask.shape) == (dims.B, dims.S):
            fix = "a (B, S) key-padding mask needs mask[:, None, None, :]"
        elif dims.L != dims.S and mask.dim() >= 2 and tuple(mask.shape[-2:]) == (dims.S, dims.L):
            fix = "the mask looks transposed (S, L): use mask.transpose(-2, -1)"
        raise AttentionInputError(
            where,
            "mask",
            "`mask` does not broadcast to (B, H, L, S).",
            got=f"{mask_dims_str(mask)}  target (B={dims.B}, H={dims.H}, L={dims.L}, S={dims.S})",
            expected="each mask dim equal to the target's or 1, at most 4 dims",
            fix=fix,
        )
    if not can_read_values(mask):
        return
    check_mask_values(mask, where)
    if inverted_check:
        warn_if_inverted_causal(mask)


def is_real(x: object) -> bool:
    """A real number: Python's or NumPy's (``numbers.Real``), not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def can_read_values(t: torch.Tensor) -> bool:
    """Value checks run outside ``torch.compile``'s tracing, on tensors that hold values."""
    return not torch.compiler.is_compiling() and t.device.type != "meta"


def check_mask_values(mask: torch.Tensor, where: str, name: str = "mask") -> None:
    """A float mask is added to the scores: ``+inf`` or NaN there make the whole row NaN, so
    they are refused (``name`` is the argument). A value check: skipped while
    ``torch.compile`` traces and on the ``meta`` device."""
    if not mask.is_floating_point() or not can_read_values(mask):
        return
    bad = ~(mask < math.inf)  # +inf and NaN (NaN compares False)
    if not bool(bad.any()):
        return
    n_inf = int((mask == math.inf).sum())
    n_nan = int(mask.isnan().sum())
    found = " and ".join(f"{n} {kind}" for n, kind in ((n_inf, "+inf"), (n_nan, "NaN")) if n)
    raise AttentionInputError(
        where,
        name,
        f"the float `{name}` holds {found}: those are not mask values (added to the scores, "
        "they make the whole query row NaN).",
        got=f"{mask_dims_str(mask) if name == 'mask' else shape_str(name, mask, None)} "
        f"dtype={mask.dtype}: {found}",
        expected="0 where a key is allowed, -inf where it is blocked (finite values add a bias)",
        fix=f"{name}.masked_fill({name} == float('inf'), float('-inf')) if +inf meant blocked; "
        f"{name}.nan_to_num(nan=0.0) if NaN meant allowed; or a bool mask",
    )


#: a float mask value at or below this blocks (seed 001 writes -1e9; fp16 code -1e4), for the
#: inverted-mask check only: the backends add float masks as they are
BLOCKING = -1e4
_ATTNKIT_CONVENTION = (
    "attnkit's convention is True = may attend (as in F.scaled_dot_product_attention). Fix: "
    "pass causal=True instead of a mask, or invert it with ~mask (a mask built as "
    "ones(L, L).triu(1).bool() marks the positions to *block*)."
)


def warn_if_inverted_causal(
    allowed_mask: torch.Tensor, argument: str = "mask", convention: str = _ATTNKIT_CONVENTION
) -> None:
    """Warn on a square mask that forbids every diagonal entry but allows some future key.

    That is the mask of seed 001 (``ones(L, L).triu(1).bool()``, or its float form with
    ``-inf`` / ``-1e9``) read with attnkit's True = may attend convention: each token sees only
    the tokens after it, and the last token sees nothing. ``allowed_mask`` is in attnkit's
    convention (bool True = may attend, or float added); ``argument`` and ``convention`` say
    what the caller passed (a module's ``attn_mask`` keeps torch's meaning). It is checked only
    when the whole diagonal is blocked, so the usual masks cost one pass over the diagonal.
    """
    mask = allowed_mask
    if not (mask.dim() >= 2 and mask.shape[-2] == mask.shape[-1] > 1):
        return
    allowed = mask if mask.dtype == torch.bool else mask > BLOCKING
    if bool(allowed.diagonal(dim1=-2, dim2=-1).any()):
        return
    if bool(allowed.triu(1).any()):
        warn_user(
            f"attnkit: this {argument} blocks every token from itself and lets it see only "
            f"later tokens: it looks like an inverted causal mask. {convention}"
        )


def too_big_error(
    where: str, call: AttentionCall, backend: str, nbytes: int, what: str, limit: int
) -> AttentionMemoryError:
    """The error of a call whose backend would allocate ``nbytes`` of L x S memory above
    ``limit``, with the ways to a backend that never does (``blocked``)."""
    ways = []
    if call.return_weights:
        ways.append(
            "no weights: return_weights=False (need_weights=False in the modules; only math "
            "forms the (B, H, L, S) weights)"
        )
    if call.dropout_p > 0.0:
        ways.append("dropout_p=0.0")
    if call.mask_needs_grad:
        ways.append("a float mask that needs no gradient")
    if backend in ("blocked", "flex"):  # its L x S memory is the planning of a mask tensor
        fix = (
            "pass the mask as a spec from attnkit.masks (key_mask(keep), padding(lengths), "
            "causal(), document(ids), ...), planned from its rule with no L x S memory; or "
            "backend='auto', which takes a backend that uses the tensor as it is"
        )
    else:
        if ways:
            fix = f"{'; '.join(ways)}: then the blocked backend runs it"
        else:
            fix = "backend='blocked' runs it"
        fix += (
            " without L x S tensors (a mask spec from attnkit.masks, block by block); or fewer "
            "queries per call (a smaller L)"
        )
    d = call.dims
    spec = call.mask
    mask = "" if spec is None or spec.from_tensor else f"  mask={spec!r}"
    return refuse(
        where,
        "return_weights" if call.return_weights and backend == "math" else "backend",
        what,
        nbytes,
        limit,
        got=f"q (B={d.B}, H={d.H}, L={d.L}, Dk={d.Dk})  k (Hkv={d.Hkv}, S={d.S})  "
        f"{call.q.dtype} on {call.q.device}; backend {backend!r}{mask}",
        fix=fix,
    )
