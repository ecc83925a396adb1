"""Dense masks in attnkit's convention: True = may attend.

Dimension legend: L query length, S key length.
"""

from __future__ import annotations

import torch

__all__ = ["causal_mask"]


def causal_mask(L: int, S: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """The end-aligned causal mask, ``(L, S)`` bool, True = may attend.

    Query ``i`` sees keys ``j <= i + S - L``: the last query sees every key, as a new token does
    when it is decoded against a KV cache of ``S - L`` earlier tokens. For ``L == S`` this is the
    usual lower triangle. For ``L = 2, S = 4``::

        1 1 1 0
        1 1 1 1

    and for ``L = 4, S = 2`` the first two queries see nothing (their output is 0)::

        0 0
        0 0
        1 0
        1 1

    >>> causal_mask(2, 4).int()
    tensor([[1, 1, 1, 0],
            [1, 1, 1, 1]], dtype=torch.int32)
    """
    return torch.ones(L, S, dtype=torch.bool, device=device).tril(S - L)
