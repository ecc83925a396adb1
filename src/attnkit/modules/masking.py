"""A module's mask arguments, checked and merged into the one mask :func:`attnkit.attention` takes.

Dimension legend: B batch, H query heads, L query length, S key length.

The modules take masks in three conventions, each under its own names:

- ``mask``, attnkit's: bool True = may attend, or float added; or a mask spec.
- ``key_padding_mask`` and ``attn_mask``, torch's (``nn.MultiheadAttention``): bool True =
  padding / not allowed, or float added; ``key_padding_mask (B, S)``, ``attn_mask (L, S)``
  or ``(B * H, L, S)``. ``is_causal`` is torch's hint that ``attn_mask`` is causal: it needs
  the ``attn_mask``, which is what is applied.
- ``attention_mask``, Hugging Face's: ``(B, S)`` bool or 0/1 ints, True/1 = a real key.

torch's two are translated by :func:`~attnkit.modules.torch_masks.mask_from_torch` (the only
place that does it; also ``attnkit.interop.mask_from_torch``); :func:`combine` is the only
place two masks are merged (both must allow).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnkit.errors import AttentionInputError, shape_str, warn_user
from attnkit.masks import MaskSpec, key_mask
from attnkit.modules.torch_masks import mask_from_torch
from attnkit.validate import can_read_values, warn_if_inverted_causal

__all__ = ["Mask", "MaskArgs", "check_zero_one", "combine", "key_part", "module_mask"]

Mask = torch.Tensor | MaskSpec


@dataclass(frozen=True)
class MaskArgs:
    """The mask arguments of one module call, as the user gave them."""

    mask: Mask | None = None
    key_padding_mask: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    attn_mask: torch.Tensor | None = None
    is_causal: bool = False

    def key_or_torch(self) -> str | None:
        """The name of the first key or torch mask given, else ``None``."""
        for name in ("key_padding_mask", "attention_mask", "attn_mask"):
            if getattr(self, name) is not None:
                return name
        return "is_causal" if self.is_causal else None


def combine(a: Mask | None, b: Mask | None, L: int, S: int, dtype: torch.dtype) -> Mask | None:
    """``a`` and ``b`` together (a key may be attended only where both allow it).

    Specs stay specs; a bool key mask ``(B, 1, 1, S)`` joins a spec as :func:`key_mask`;
    any other tensor with a spec makes the spec dense. Bool with bool is ``&``; float with
    bool is ``-inf`` where the bool blocks; float with float is the sum (as torch adds them).
    A tensor that is neither bool nor float, or one whose shape does not broadcast with the
    other's, is returned as it is, for :func:`attnkit.attention` to refuse with its message.

    >>> keep = torch.tensor([[True, True, False]])[:, None, None, :]  # (B, 1, 1, S)
    >>> combine(torch.ones(2, 3).tril(1).bool(), keep, 2, 3, torch.float32).int()
    tensor([[[[1, 1, 0],
              [1, 1, 0]]]], dtype=torch.int32)
    """
    if a is None or b is None:
        return b if a is None else a
    if isinstance(a, MaskSpec):
        return a & b if isinstance(b, MaskSpec) else _spec_and_tensor(a, b, L, S, dtype)
    if isinstance(b, MaskSpec):
        return _spec_and_tensor(b, a, L, S, dtype)
    for t in (a, b):
        if t.dtype != torch.bool and not t.is_floating_point():
            return t
    if not _broadcast(a.shape, b.shape):  # the one that does not fit (L, S): attention()
        return a if tuple(a.shape[-2:]) not in _fits(L, S) else b  # refuses it by name
    if a.dtype == torch.bool and b.dtype == torch.bool:
        return a & b
    if a.is_floating_point() and b.is_floating_point():
        return a + b
    bias, allowed = (a, b) if b.dtype == torch.bool else (b, a)
    return bias.masked_fill(~allowed, float("-inf"))


def _broadcast(a: torch.Size, b: torch.Size) -> bool:
    """Whether tensors of shapes ``a`` and ``b`` broadcast together."""
    return all(x == y or 1 in (x, y) for x, y in zip(reversed(a), reversed(b), strict=False))


def _fits(L: int, S: int) -> set[tuple[int, ...]]:
    """The last two dims of a mask that broadcasts over ``(L, S)``."""
    return {(lq, sk) for lq in (L, 1) for sk in (S, 1)} | {(S,), (1,)}


def _spec_and_tensor(
    spec: MaskSpec, t: torch.Tensor, L: int, S: int, dtype: torch.dtype
) -> Mask | None:
    if t.dtype == torch.bool and t.dim() == 4 and t.shape[1:3] == (1, 1):
        # (B or 1, 1, 1, S) -> a spec of (B, S): a mask for every sequence is broadcast to the
        # batch first, as a dense mask would be (the spec and the cache's rules are per B)
        keep = t[:, 0, 0, :]
        if keep.shape[0] == 1 and spec.batch:
            keep = keep.expand(spec.batch, S)
        return spec & key_mask(keep)
    return combine(spec.to_dense(L, S, device=t.device, dtype=dtype), t, L, S, dtype)


def module_mask(
    where: str,
    args: MaskArgs,
    *,
    size: tuple[int, int, int, int],
    dtype: torch.dtype,
    kv_cache: bool = False,
    seq_first: tuple[int, int] | None = None,
) -> Mask | None:
    """Check ``args`` against ``size = (B, H, L, S)`` and merge them into one attnkit mask.

    ``dtype`` is the query's: float masks must have it. With a ``kv_cache`` only ``mask`` is
    taken (``S`` is then the cache's). ``seq_first`` is the shape a key mask has when
    ``(seq, batch, embed)`` inputs were read as batch-first (to say so).
    """
    B, _, L, S = size
    other = args.key_or_torch()
    if kv_cache and other is not None:
        raise AttentionInputError(
            where,
            other,
            f"with a kv_cache, padding is the cache's per-sequence lengths; `{other}` is not "
            "taken.",
            got=f"kv_cache and {other} both given",
            expected=f"{other}=None; mask=, if any, spans (L, S) in attnkit's convention",
            fix="write right-padded sequences, then kv_cache.truncate(real lengths)",
        )
    if not isinstance(args.is_causal, bool):
        raise AttentionInputError(
            where,
            "is_causal",
            "`is_causal` must be a bool.",
            got=f"is_causal={args.is_causal!r}",
            expected="True or False",
        )
    if args.is_causal and args.attn_mask is None:
        raise AttentionInputError(
            where,
            "is_causal",
            "`is_causal=True` is torch's hint that `attn_mask` is causal; it needs the attn_mask "
            "itself (torch refuses it alone too).",
            got="is_causal=True  attn_mask=None",
            expected="is_causal=True together with attn_mask (L, S), or is_causal=False",
            fix="attn_mask=nn.Transformer.generate_square_subsequent_mask(L) (torch's "
            "top-left causal), or build the module with causal=True (attnkit's end-aligned rule)",
        )
    _check_mask_and_devices(where, args)
    keys = key_part(
        where, args.key_padding_mask, args.attention_mask, B, S, dtype, seq_first=seq_first
    )
    attn = None if args.attn_mask is None else _attn_part(where, args.attn_mask, size, dtype)
    # an inverted causal mask, said in the convention of the argument it came in (the call
    # this module makes does not look again)
    if isinstance(args.mask, torch.Tensor) and can_read_values(args.mask):
        warn_if_inverted_causal(args.mask)
    if attn is not None and can_read_values(attn):
        warn_if_inverted_causal(attn, "attn_mask", TORCH_ATTN_MASK)
    return combine(combine(args.mask, attn, L, S, dtype), keys, L, S, dtype)


TORCH_ATTN_MASK = (
    "A module's attn_mask keeps torch's convention, True = may NOT attend (a float attn_mask "
    "is added to the scores): torch's causal attn_mask is ones(L, L).triu(1).bool(), True "
    "above the diagonal (nn.Transformer.generate_square_subsequent_mask(L) as floats). Fix: "
    "pass that, build the module with causal=True, or give attnkit's True = may attend form "
    "as mask=."
)


def key_part(
    where: str,
    key_padding_mask: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    B: int,
    S: int,
    dtype: torch.dtype,
    *,
    seq_first: tuple[int, int] | None = None,
) -> torch.Tensor | None:
    """The key mask, from either form, in attnkit's convention ``(B, 1, 1, S)``.

    Bool True = may attend, or float (a float ``key_padding_mask``, added as torch adds it).
    """
    if key_padding_mask is not None and attention_mask is not None:
        raise AttentionInputError(
            where,
            "attention_mask",
            "`key_padding_mask` and `attention_mask` are two forms of the same key mask; give one.",
            got="key_padding_mask and attention_mask both given",
            expected="key_padding_mask (True = padding, as in torch) or attention_mask "
            "(True/1 = a real key, as in Hugging Face)",
            fix="drop one; key_padding_mask == ~attention_mask.bool()",
        )
    name = "key_padding_mask" if key_padding_mask is not None else "attention_mask"
    t = key_padding_mask if key_padding_mask is not None else attention_mask
    if t is None:
        return None
    _check_key_shape(where, name, t, B, S, seq_first)
    if name == "key_padding_mask":
        _check_torch_dtype(
            where,
            name,
            t,
            dtype,
            dims=("B", "S"),
            true_means="padding",
            expected="bool (B, S), True = padding; or float (B, S)",
            fix="0/1 ints with 1 = a real token are attention_mask=...; "
            "or key_padding_mask=ids == pad_id",
        )
        if t.dtype == torch.bool and S > 0:
            _warn_empty_rows(t.all(dim=1), name)
        return _from_torch(key_padding_mask=t, num_heads=1)  # (B, 1, 1, S)
    if t.dtype != torch.bool:
        if t.is_floating_point() or t.is_complex():
            raise AttentionInputError(
                where,
                name,
                f"`attention_mask` has dtype {t.dtype}; it says which keys are real: bool or "
                "0/1 ints, as in Hugging Face.",
                got=f"{shape_str(name, t, ('B', 'S'))} dtype={t.dtype}",
                expected="bool or int (B, S), True/1 = a real key",
                fix="attention_mask.bool() if 1.0 means a real key; an additive float mask "
                "goes in mask= (attnkit) or attn_mask= (torch)",
            )
        check_zero_one(where, name, t, ("B", "S"), "key")
        t = t != 0
    if S > 0:
        _warn_empty_rows(~t.any(dim=1), name)
    return t[:, None, None, :]  # (B, 1, 1, S), True = may attend


def check_zero_one(
    where: str, name: str, t: torch.Tensor, dims: tuple[str, ...], unit: str
) -> None:
    """An integer ``attention_mask`` (Hugging Face's form) holds only 0 (padding) and 1 (a real
    ``unit``: key, token); token ids passed as the mask are the usual mistake. Not while
    ``torch.compile`` traces (no data-dependent branch)."""
    if t.dtype == torch.bool or not can_read_values(t):
        return
    bad = t[(t != 0) & (t != 1)]
    if bad.numel():
        values = sorted({int(v) for v in bad.tolist()})[:5]
        raise AttentionInputError(
            where,
            name,
            f"`{name}` holds values other than 0 and 1: {values}.",
            got=f"{shape_str(name, t, dims)} dtype={t.dtype}, values {values}",
            expected=f"0 (padding) or 1 (a real {unit}), as in Hugging Face",
            fix=f"{name}=(ids != pad_id); token ids are input_ids, not a mask",
        )


def _attn_part(
    where: str, attn_mask: torch.Tensor, size: tuple[int, int, int, int], dtype: torch.dtype
) -> torch.Tensor:
    """torch's ``attn_mask`` checked against ``(B, H, L, S)`` and translated."""
    B, H, L, S = size
    name = "attn_mask"
    _check_tensor(
        where,
        name,
        attn_mask,
        "bool or float (L, S) or (B * num_heads, L, S), as nn.MultiheadAttention",
    )
    _check_torch_dtype(
        where,
        name,
        attn_mask,
        dtype,
        dims=None,
        true_means="not allowed",
        expected="a bool or float attn_mask",
        fix="attn_mask.bool() if 1 means blocked; mask= takes attnkit's True = may attend",
    )
    shape = tuple(attn_mask.shape)
    if shape not in ((L, S), (B * H, L, S)):
        fix = "build it as (L, S), or (B * num_heads, L, S) with row b * num_heads + h"
        if shape == (S, L):
            fix = "it looks transposed: use attn_mask.T"
        elif shape == (B, L, S):
            fix = "torch wants one mask per head: attn_mask.repeat_interleave(num_heads, dim=0)"
        elif shape == (B, H, L, S):
            fix = "attn_mask.flatten(0, 1), or mask=~attn_mask (attnkit's (B, H, L, S))"
        raise AttentionInputError(
            where,
            name,
            "`attn_mask` has neither of the shapes nn.MultiheadAttention takes.",
            got=shape_str(name, attn_mask, ("L", "S") if attn_mask.dim() == 2 else None)
            + f"  target (B={B}, H={H}, L={L}, S={S})",
            expected=f"attn_mask (L={L}, S={S}) or (B*H={B * H}, L={L}, S={S})",
            fix=fix,
        )
    return _from_torch(attn_mask=attn_mask, num_heads=H)  # (L, S) or (B, H, L, S)


def _from_torch(
    *,
    attn_mask: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    num_heads: int,
) -> torch.Tensor:
    """A torch mask, checked already, in attnkit's convention, by the one translation point."""
    translated = mask_from_torch(attn_mask, key_padding_mask, num_heads=num_heads)
    assert translated is not None  # one of the two was given
    return translated


def _check_mask_and_devices(where: str, args: MaskArgs) -> None:
    """``mask`` is a tensor or a spec, and every mask given is on one device (they are merged
    before :func:`attnkit.attention` checks them against the query)."""
    if args.mask is not None and not isinstance(args.mask, torch.Tensor | MaskSpec):
        raise AttentionInputError(
            where,
            "mask",
            f"`mask` is a {type(args.mask).__name__}, not a tensor or a mask spec.",
            got=f"mask: {type(args.mask).__name__}",
            expected="a bool tensor (True = may attend), a float tensor added to the scores, "
            "or a spec from attnkit.masks",
            fix="torch.as_tensor(mask, dtype=torch.bool)",
        )
    given = [
        (name, t.device)
        for name in ("mask", "key_padding_mask", "attention_mask", "attn_mask")
        if isinstance(t := getattr(args, name), torch.Tensor | MaskSpec)
    ]
    devices = {d for _, d in given if d is not None}
    if len(devices) > 1:
        raise AttentionInputError(
            where,
            given[-1][0],
            "the masks given are on different devices.",
            got="  ".join(f"{name} on {d}" for name, d in given if d is not None),
            expected="every mask on the query's device",
            fix="move them with .to(query.device)",
        )


def _check_tensor(where: str, name: str, t: object, expected: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise AttentionInputError(
            where,
            name,
            f"`{name}` must be a tensor, got {type(t).__name__}.",
            got=type(t).__name__,
            expected=expected,
        )
    return t


def _check_torch_dtype(
    where: str,
    name: str,
    t: torch.Tensor,
    dtype: torch.dtype,
    *,
    dims: tuple[str, ...] | None,
    true_means: str,
    expected: str,
    fix: str,
) -> None:
    """One of torch's masks is bool (True = ``true_means``) or float of the query's dtype."""
    if t.dtype != torch.bool and not t.is_floating_point():
        raise AttentionInputError(
            where,
            name,
            f"`{name}` has dtype {t.dtype}; as in nn.MultiheadAttention it is bool "
            f"(True = {true_means}) or float (added to the scores).",
            got=f"{shape_str(name, t, dims)} dtype={t.dtype}",
            expected=expected,
            fix=fix,
        )
    _check_float_dtype(where, name, t, dtype)


def _check_key_shape(
    where: str, name: str, t: object, B: int, S: int, seq_first: tuple[int, int] | None
) -> None:
    mask = _check_tensor(where, name, t, f"{name} (B, S)")
    shape = tuple(mask.shape)
    if shape == (B, S):
        return
    fix = "build it as (batch, key length)"
    if shape == (S, B):
        fix = f"it looks transposed: use {name}.T"
        if shape == seq_first:  # then L == S, and the inputs may be what is transposed instead
            fix += (
                "; or, if the inputs are (seq, batch, embed), pass batch_first=False "
                "or x.transpose(0, 1)"
            )
    meaning = "True = padding" if name == "key_padding_mask" else "True/1 = a real key"
    raise AttentionInputError(
        where,
        name,
        f"`{name}` does not match (B, S).",
        got=shape_str(name, mask, ("B", "S")) + f"  target (B={B}, S={S})",
        expected=f"{name} (B, S), {meaning}",
        fix=fix,
    )


def _check_float_dtype(where: str, name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    from attnkit.mask_checks import check_mask_values  # +inf / NaN: not mask values

    check_mask_values(t, where, name)
    if t.is_floating_point() and t.dtype != dtype:
        raise AttentionInputError(
            where,
            name,
            f"float `{name}` has dtype {t.dtype} but the query has {dtype}; attnkit never casts.",
            got=f"{name}.dtype={t.dtype}  query.dtype={dtype}",
            expected=f"a float {name} of dtype {dtype}, or a bool one",
            fix=f"{name}.to({dtype})",
        )


def _warn_empty_rows(empty: torch.Tensor, name: str) -> None:
    """Warn when some batch rows have no key at all (``empty`` is bool ``(B,)``)."""
    if torch.compiler.is_compiling() or empty.device.type == "meta" or not bool(empty.any()):
        return
    rows = empty.nonzero().flatten().tolist()[:8]
    if name == "key_padding_mask":
        other = (
            "key_padding_mask is True = padding, as in nn.MultiheadAttention; if True meant a "
            "real key here, pass it as attention_mask=... instead"
        )
    else:
        other = (
            "attention_mask is True/1 = a real key, as in Hugging Face; if True meant padding "
            "here, pass it as key_padding_mask=... instead"
        )
    warn_user(
        f"attnkit: {name} leaves batch rows {rows} with no key to attend to: their attention "
        f"output is 0 (nn.MultiheadAttention gives NaN). {other}."
    )
