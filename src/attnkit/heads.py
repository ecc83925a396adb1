"""Splitting the model width into heads and merging it back.

Dimension legend: B batch, L length, H heads, D head dim, E = H * D model width.

Why ``view`` before ``transpose``: a projection writes each token's ``E`` features
contiguously, head after head. ``view(B, L, H, D)`` only relabels that memory (token, head,
feature), and ``transpose(1, 2)`` then brings the heads forward for a batched matmul. The other
order (``view(B, H, L, D)`` straight away) runs without error but mixes tokens into heads.
On the way back ``transpose(1, 2)`` leaves a tensor that is not contiguous, so it cannot be
``view``-ed: ``.contiguous()`` copies it into token-major order once, then ``view`` merges the
heads. (``split_heads`` uses ``reshape``, which views when it can and copies only an input
whose layout does not allow the view.)
"""

from __future__ import annotations

import torch

from attnkit.errors import AttentionInputError, check_int, rank_error, shape_str

__all__ = ["merge_heads", "split_heads"]


def split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``(B, L, E) -> (B, H, L, E / H)``: view the width as heads, then bring heads forward.

    >>> split_heads(torch.randn(2, 4, 8), num_heads=2).shape
    torch.Size([2, 2, 4, 4])
    """
    where = "attnkit.split_heads"
    check_int(where, "num_heads", num_heads)
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise rank_error(
            where,
            "x",
            x,
            ("B", "L", "E"),
            got=shape_str("x", x, ("B", "H", "L", "D")) if isinstance(x, torch.Tensor) else None,
            fix="a 4-D tensor is probably split already; a 2-D one needs x.unsqueeze(0)",
        )
    B, L, E = x.shape
    if E % num_heads != 0:
        divisors = [h for h in range(1, E + 1) if E % h == 0]
        raise AttentionInputError(
            where,
            "num_heads",
            f"width E={E} is not divisible by num_heads={num_heads}.",
            got=shape_str("x", x, ("B", "L", "E")) + f"  num_heads={num_heads}",
            expected="E % num_heads == 0",
            fix=f"pick num_heads from {divisors[-8:]}, or project to a width H * D first",
        )
    return x.reshape(B, L, num_heads, E // num_heads).transpose(1, 2)  # (B, H, L, D)


def merge_heads(x: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
    """``(B, H, L, D) -> (B, L, H * D)``: heads back next to each other, then one width.

    ``num_heads``, when given, is checked against ``x.shape[1]``; that catches a tensor that was
    transposed back already (``(B, L, H, D)``).

    >>> merge_heads(torch.randn(2, 2, 4, 4)).shape
    torch.Size([2, 4, 8])
    """
    where = "attnkit.merge_heads"
    if num_heads is not None:
        check_int(where, "num_heads", num_heads)
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        raise rank_error(
            where,
            "x",
            x,
            ("B", "H", "L", "D"),
            got=shape_str("x", x, ("B", "L", "E")) if isinstance(x, torch.Tensor) else None,
            fix="a 3-D (B, L, E) tensor is merged already",
        )
    B, H, L, D = x.shape
    if num_heads is not None and num_heads != H:
        fix = "check the order of dims"
        if num_heads == L:
            fix = (
                "x looks like (B, L, H, D): it was transposed back already; merge it with "
                f"x.reshape({B}, {H}, {L * D}) (x.flatten(2)), or pass x.transpose(1, 2)"
            )
        raise AttentionInputError(
            where,
            "x",
            f"`x` has {H} in the heads dim but num_heads={num_heads}.",
            got=shape_str("x", x, ("B", "H", "L", "D")),
            expected=f"x (B, H={num_heads}, L, D)",
            fix=fix,
        )
    return x.transpose(1, 2).contiguous().view(B, L, H * D)  # (B, L, E)
