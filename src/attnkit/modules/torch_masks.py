"""torch's mask convention translated into attnkit's: :func:`mask_from_torch`.

Dimension legend: B batch, H heads, L query length, S key length.

``nn.MultiheadAttention``'s masks say True = *ignore* (``key_padding_mask``, bool
``attn_mask``); attnkit's say True = *may attend*. :func:`mask_from_torch` is the only place
that translates one into the other: the modules' ``key_padding_mask`` and ``attn_mask``
(:mod:`attnkit.modules.masking`) go through it, and :mod:`attnkit.interop` re-exports it as
``attnkit.interop.mask_from_torch``.
"""

from __future__ import annotations

import torch

from attnkit.errors import AttentionInputError, shape_str

__all__ = ["mask_from_torch"]


def mask_from_torch(
    attn_mask: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    *,
    num_heads: int,
) -> torch.Tensor | None:
    """Translate ``nn.MultiheadAttention``'s masks into one attnkit mask.

    Args:
        attn_mask: torch's ``(L, S)`` or ``(B * H, L, S)``; bool True = *ignore*, or float
            (added to the scores).
        key_padding_mask: torch's ``(B, S)``; bool True = *ignore* (padding), or float.
        num_heads: ``H``, to unfold a ``(B * H, L, S)`` mask.

    Returns:
        An attnkit mask broadcastable to ``(B, H, L, S)``: bool True = may attend when both
        inputs are bool, else float (``-inf`` blocks); ``None`` when both are ``None``.

    >>> kpm = torch.tensor([[False, False, True]])  # torch: the third key is padding
    >>> mask_from_torch(key_padding_mask=kpm, num_heads=2).int()
    tensor([[[[1, 1, 0]]]], dtype=torch.int32)
    """
    where = "attnkit.interop.mask_from_torch"
    for name, t, ranks, shapes in (
        ("attn_mask", attn_mask, (2, 3), "(L, S) or (B * num_heads, L, S)"),
        ("key_padding_mask", key_padding_mask, (2,), "(B, S)"),
    ):
        if t is None:
            continue
        bad_dtype = t.dtype != torch.bool and not t.is_floating_point()
        if bad_dtype or t.dim() not in ranks:
            raise AttentionInputError(
                where,
                name,
                f"`{name}` is {t.dim()}-D {t.dtype}; torch's masks are bool (True = ignore) or "
                f"float (added to the scores), `{name}` {shapes}.",
                got=f"{shape_str(name, t, None)} dtype={t.dtype}",
                expected=f"a bool or float {name} {shapes}, as nn.MultiheadAttention",
                fix=f"{name}.bool() if 1 means ignore" if bad_dtype else None,
            )
    parts: list[torch.Tensor] = []
    if attn_mask is not None:
        if attn_mask.dim() == 3:
            BH, L, S = attn_mask.shape
            if BH % num_heads != 0:
                raise AttentionInputError(
                    where,
                    "attn_mask",
                    f"a 3-D attn_mask has {BH} in dim 0, not a multiple of num_heads.",
                    got=shape_str("attn_mask", attn_mask, ("B*H", "L", "S"))
                    + f"  num_heads={num_heads}",
                    expected="attn_mask (L, S) or (B * num_heads, L, S)",
                )
            attn_mask = attn_mask.view(BH // num_heads, num_heads, L, S)
        parts.append(attn_mask)
    if key_padding_mask is not None:
        parts.append(key_padding_mask[:, None, None, :])  # (B, 1, 1, S)
    if not parts:
        return None
    if all(p.dtype == torch.bool for p in parts):
        allowed = ~parts[0]
        for p in parts[1:]:
            allowed = allowed & ~p
        return allowed
    floats = [p for p in parts if p.is_floating_point()]
    dtype = floats[0].dtype
    total: torch.Tensor | None = None
    for p in parts:
        if p.dtype == torch.bool:
            p = torch.zeros(p.shape, dtype=dtype, device=p.device).masked_fill(p, float("-inf"))
        total = p if total is None else total + p
    return total
