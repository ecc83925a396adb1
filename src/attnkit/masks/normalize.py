"""The one place where the ``causal`` flag and a mask combine: :func:`as_spec`.

Dimension legend: B batch, H heads, L query length, S key length.
"""

from __future__ import annotations

import torch

from attnkit.masks.base import spec_error
from attnkit.masks.dense import DenseMask
from attnkit.masks.rules import causal, causal_mask, is_causal
from attnkit.masks.spec import MaskSpec
from attnkit.memory import exceeds, refuse

__all__ = ["as_spec"]


def as_spec(
    mask: torch.Tensor | MaskSpec | None,
    causal_flag: bool = False,
    *,
    L: int | None = None,
    S: int | None = None,
    where: str = "attnkit.masks.as_spec",
) -> MaskSpec | None:
    """A call's whole mask rule as one spec (``None``: every pair allowed).

    - a spec stays a spec; with ``causal_flag`` it becomes ``spec & causal()``;
    - a tensor becomes a :class:`~attnkit.masks.DenseMask` (dense backends get it back
      unchanged); with ``causal_flag`` the end-aligned causal rule is merged into it first
      (bool: ``mask & causal_mask(L, S)``; float: ``-inf`` where causal forbids), so a dense
      backend still sees one tensor. Where that merged tensor would exceed attnkit's memory
      limit (:mod:`attnkit.memory`), it stays ``DenseMask(mask) & causal()`` (the blocked
      backend runs it block by block), or, for a float mask that needs a gradient,
      :class:`~attnkit.AttentionMemoryError` is raised (``where`` names the caller);
    - the flag alone is ``causal()``, except for one query against ``S >= 1`` keys (a decode
      step): that query stands at the last key and sees every key, so no rule is needed.

    ``L`` and ``S`` are needed to merge the causal rule into a tensor and for the decode-step
    rule. Inputs are not validated here (:func:`attnkit.attention` validates first).

    >>> as_spec(None, True, L=4, S=4), as_spec(None, True, L=1, S=9)
    (causal(), None)
    >>> from attnkit.masks import sliding_window
    >>> as_spec(sliding_window(8), True)
    sliding_window(8) & causal()
    >>> as_spec(torch.ones(4, 4, dtype=torch.bool), True, L=4, S=4).tensor.int()
    tensor([[1, 0, 0, 0],
            [1, 1, 0, 0],
            [1, 1, 1, 0],
            [1, 1, 1, 1]], dtype=torch.int32)
    """
    if isinstance(mask, MaskSpec):
        if not causal_flag or is_causal(mask):
            return mask
        return mask & causal()
    if isinstance(mask, torch.Tensor):
        if causal_flag:
            if L is None or S is None:
                spec_error(
                    "as_spec",
                    "L, S",
                    "merging the causal rule into a mask tensor needs the call's lengths.",
                    got=f"mask {tuple(mask.shape)}, causal_flag=True, L={L}, S={S}",
                    expected="L and S (query and key lengths) given",
                    fix="as_spec(mask, True, L=q.shape[2], S=k.shape[2])",
                )
            lazy = _too_big_to_merge(mask, L, S, where)
            if lazy:
                return DenseMask(mask) & causal()
            allowed = causal_mask(L, S, device=mask.device)  # (L, S)
            if mask.dtype == torch.bool:
                mask = mask & allowed
            else:
                mask = mask.masked_fill(~allowed, float("-inf"))
        return DenseMask(mask)
    if not causal_flag or (L == 1 and S is not None and S >= 1):
        return None
    return causal()


def _too_big_to_merge(mask: torch.Tensor, L: int, S: int, where: str) -> bool:
    """Whether ``mask`` merged with the causal rule would exceed attnkit's memory limit: the
    causal mask ``(L, S)`` (two passes) and its inverse, and the merged mask of the broadcast
    shape ``(..., L, S)``. A float mask that needs a gradient must merge: it raises then."""
    lead = 1
    for n in mask.shape[:-2]:
        lead *= n
    nbytes = 3 * L * S + lead * L * S * mask.element_size()
    limit = exceeds(nbytes, mask.device)
    if limit is None:
        return False
    if not (mask.requires_grad and torch.is_grad_enabled()):
        return True
    raise refuse(
        where,
        "mask",
        f"merging the causal rule into the float mask {tuple(mask.shape)} that needs a "
        f"gradient, as a (..., {L}, {S}) tensor,",
        nbytes,
        limit,
        got=f"mask {tuple(mask.shape)} {mask.dtype} (requires_grad)  causal=True  L={L}  S={S}",
        fix="fewer queries per call (a smaller L); or a mask that needs no gradient, which "
        "the blocked backend runs block by block (best as a spec from attnkit.masks)",
    )
