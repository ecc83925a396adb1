"""Mask checks: a mask tensor or spec against the sizes of a call, and a float mask's values.

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
Dk query/key head dim.

:func:`check_mask` is the piece :func:`attnkit.attention`, :func:`attnkit.explain`, the modules
and ring attention run after :func:`attnkit.validate.check_qkv`. The check of a float mask's
*values* (``+inf`` or NaN) is skipped while ``torch.compile`` traces and on the ``meta`` device
(:func:`attnkit.validate.can_read_values`); shape, dtype and device checks always run.
"""

from __future__ import annotations

import math

import torch

from attnkit.call import Dims
from attnkit.errors import DTYPE_NAMES, AttentionInputError, dtype_error, shape_str
from attnkit.masks import DenseMask, MaskSpec
from attnkit.masks.concat import ConcatKeys
from attnkit.masks.selected import check_selected
from attnkit.validate import can_read_values

__all__ = ["check_mask", "check_mask_values", "mask_dims_str"]

MASK_DIMS = ("B", "H", "L", "S")


def mask_dims_str(mask: torch.Tensor) -> str:
    """``mask (L=5, S=5)``: a mask's shape named from the right, as broadcasting aligns it."""
    names = MASK_DIMS[len(MASK_DIMS) - mask.dim() :] if mask.dim() <= 4 else None
    return shape_str("mask", mask, names)


def _built_for_error(mask: MaskSpec, dims: Dims, dim: str, where: str) -> AttentionInputError:
    """A spec built for another batch size (``dim="B"``) or number of heads (``"H"``) than q's."""
    if dim == "B":
        problem = f"the mask spec is built for a batch of {mask.batch} but q has B={dims.B}."
        expected = f"lengths / ids / keep tensors with {dims.B} rows"
        fix = "build the spec from this batch's lengths or document ids"
    else:
        problem = f"the mask spec is built for {mask.heads} heads but q has H={dims.H}."
        expected, fix = (
            f"a spec for {dims.H} heads",
            "build it with the model's number of query heads",
        )
    got = f"mask={mask!r}  q (B={dims.B}, H={dims.H}, L={dims.L}, Dk={dims.Dk})"
    return AttentionInputError(where, "mask", problem, got=got, expected=expected, fix=fix)


def _check_spec(mask: MaskSpec, q: torch.Tensor, dims: Dims, where: str, key_shards: int) -> None:
    if mask.selects_keys:  # its own words: indices against B, L, Hkv, H and S (ring
        # attention shards queries as it shards keys: the indices list the whole sequence's)
        L, S = dims.L * key_shards, dims.S * key_shards
        check_selected(mask, dims.B, dims.H, dims.Hkv, L, S, where, key_shards)
    if mask.batch is not None and mask.batch != dims.B:
        raise _built_for_error(mask, dims, "B", where)
    if mask.heads is not None and mask.heads != dims.H:
        raise _built_for_error(mask, dims, "H", where)
    S = dims.S * key_shards  # the whole sequence's keys
    if mask.length is not None and mask.length != S:
        fix = "build it from a tensor with one entry per key, S of them"
        expected = f"document ids / key_mask keep with one entry per key: {S}"
        if mask.length == dims.L * key_shards:
            fix = f"its tensor has one entry per query (L={dims.L}); it needs one per key"
        if any(isinstance(part, ConcatKeys) for part in mask.walk()):
            expected = f"concat_keys(first, S1, second, S2) with S1 + S2 = {S}"
            fix = "give concat_keys the key counts of the two parts of k's keys"
        shards = "" if key_shards == 1 else f" ({key_shards} shards of {dims.S} keys)"
        raise AttentionInputError(
            where,
            "mask",
            f"the mask spec {mask!r} is built for {mask.length} keys but k has S={S}{shards}.",
            got=f"mask={mask!r} (length {mask.length})  k (B={dims.B}, Hkv={dims.Hkv}, "
            f"S={dims.S}, Dk={dims.Dk})",
            expected=expected,
            fix=fix + " (with a KV cache, S counts the cached keys too)",
        )
    if mask.from_tensor:  # a user's tensor as a spec, or inside one
        for part in mask.walk():  # each DenseMask's tensor, checked as it would be alone
            if isinstance(part, DenseMask):
                _check_dtype_and_device(part.tensor, q, where)
                if key_shards == 1:
                    _check_broadcast(part.tensor, dims, where)
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


def check_mask(
    mask: object, q: torch.Tensor, dims: Dims, *, where: str, key_shards: int = 1
) -> None:
    """Check a mask: ``None``, a spec from :mod:`attnkit.masks` built for these sizes and q's
    device, or a tensor broadcastable to ``(B, H, L, S)``, bool or of q's dtype, on q's device,
    with no ``+inf`` or NaN (:func:`check_mask_values`). ``dims`` from
    :func:`attnkit.validate.check_qkv`; ``key_shards``: ``k`` is one of that many equal shards
    of the keys, and a spec spans all of them (ring attention checks its shard). The
    inverted-causal-mask warning is not given here: :func:`attnkit.validate.warn_if_inverted_causal`
    is for a mask in attnkit's convention. Raises :class:`~attnkit.errors.AttentionInputError`."""
    if mask is None:
        return
    if isinstance(mask, MaskSpec):
        _check_spec(mask, q, dims, where, key_shards)
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
    _check_dtype_and_device(mask, q, where)
    _check_broadcast(mask, dims, where)
    check_mask_values(mask, where)


def _check_dtype_and_device(mask: torch.Tensor, q: torch.Tensor, where: str) -> None:
    """A mask tensor is bool, or float of q's dtype, on q's device."""
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


def _broadcasts(shape: torch.Size, target: tuple[int, int, int, int]) -> bool:
    """``shape`` broadcasts to ``target``: at most 4 dims, each equal to the target's (aligned
    from the right) or 1."""
    n = len(shape)
    if n > 4:
        return False
    for m, t in zip(shape, target[4 - n :], strict=True):  # noqa: SIM110 (a loop: all() is slower)
        if m != 1 and m != t:
            return False
    return True


def _check_broadcast(mask: torch.Tensor, dims: Dims, where: str) -> None:
    """A mask tensor broadcasts to ``(B, H, L, S)``, with the likely fix when it does not."""
    if not _broadcasts(mask.shape, (dims.B, dims.H, dims.L, dims.S)):
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
