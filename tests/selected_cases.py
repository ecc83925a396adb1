"""Helpers of the selected_keys tests (tests/masks/test_selected_keys*.py): random top-k indices
and eager's meaning of them, the indices scattered into a dense bool mask."""

from __future__ import annotations

import torch


def scatter(indices: torch.Tensor, S: int, H: int) -> torch.Tensor:
    """Eager's meaning: the indices scattered into a bool mask (B, H | 1, L, S)."""
    ind = indices if indices.dim() == 4 else indices.unsqueeze(1)
    m = torch.zeros(*ind.shape[:3], S + 1, dtype=torch.bool)
    m.scatter_(-1, torch.where(ind < 0, S, ind), True)
    m = m[..., :S]
    return m.repeat_interleave(H // ind.shape[1], dim=1) if ind.shape[1] > 1 else m


def indices(B: int, Hi: int | None, L: int, S: int, k: int, seed: int) -> torch.Tensor:
    """Random indices in ``-1 .. S - 1`` (``(B, L, k)``, or ``(B, Hi, L, k)`` per key/value
    head), with a duplicate in the first row where ``k >= 2``."""
    gen = torch.Generator().manual_seed(seed)
    shape = (B, L, k) if Hi is None else (B, Hi, L, k)
    ind = torch.randint(-1, S, shape, generator=gen)
    if k >= 2:  # a duplicate in some row
        ind[..., 0, 1] = ind[..., 0, 0].clamp(min=0)
    return ind
