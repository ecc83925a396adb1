"""Whole-call kernels of the ``blocked`` backend as plans of one interface: a kernel that runs
a call by itself (not block by block) is one more entry of :data:`PLANNERS`, not a branch in
every consumer of :class:`~attnkit.backends.blocked.blocks.BlockPlan`.

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
Dk / Dv head dims.

A :class:`KernelPlan` says how its kernel runs the forward (``out``, ``lse``) and the backward
(``dq``, ``dk``, ``dv``) of the blocks' contract (:func:`~attnkit.backends.blocked.blocks.
forward_with_lse`, :func:`~attnkit.backends.blocked.blocks.backward_from_lse`), whether it
reports NaN/inf itself (``checks_finite``), and what explain prints (``describe``,
``under_compile``). :func:`plan` asks each planner in turn; the first plan wins. Today: the
gather kernel of :func:`attnkit.masks.selected_keys` (:mod:`~attnkit.backends.blocked.gather`).
The row-span and decode kernels predate this interface and are still their own fields of
``BlockPlan`` (``spans``, ``decode``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from attnkit.backends.blocked import gather
from attnkit.masks import MaskSpec

__all__ = ["PLANNERS", "KernelPlan", "Planner", "plan"]


class KernelPlan(Protocol):
    """A whole-call kernel's plan for one call."""

    @property
    def name(self) -> str:
        """The kernel in explain's words (``"the gather kernel"``)."""
        ...

    @property
    def checks_finite(self) -> bool:
        """The kernel reports NaN/inf itself (the dispatcher then sums nothing first)."""
        ...

    @property
    def under_compile(self) -> str:
        """What runs the call under ``torch.compile`` instead, in explain's words."""
        ...

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``out (B, H, L, Dv)`` and ``lse (B, H, L)``, as ``forward_with_lse``."""
        ...

    def backward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        dout: torch.Tensor,
        lse: torch.Tensor,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``dq``, ``dk``, ``dv``, as ``backward_from_lse``."""
        ...

    def describe(self, L: int, S: int, dtype: torch.dtype) -> str:
        """The plan in one line for explain (the kernels run on ``dtype``)."""
        ...


#: a planner: ``(spec, soft-cap, L, S, dtype, device)`` (the dtype and device the kernels
#: will see) to its kernel's plan, or ``None`` where it does not run the call
Planner = Callable[
    [MaskSpec | None, float | None, int, int, torch.dtype, torch.device], KernelPlan | None
]

#: the whole-call kernels, asked in this order
PLANNERS: tuple[Planner, ...] = (gather.plan,)


def plan(
    spec: MaskSpec | None,
    softcap: float | None,
    L: int,
    S: int,
    dtype: torch.dtype,
    device: torch.device,
) -> KernelPlan | None:
    """The first whole-call kernel's plan for the call, or ``None``."""
    for make in PLANNERS:
        found = make(spec, softcap, L, S, dtype, device)
        if found is not None:
            return found
    return None
