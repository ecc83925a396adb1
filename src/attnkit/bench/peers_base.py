"""The peers' common ground: :class:`Peer` (what a contender of ``attnkit bench`` answers) and
:class:`Case` (the case it may skip), apart from :mod:`attnkit.bench.peers` so that a peer of
its own module (:mod:`attnkit.bench.ort`) can build on them.

Dimension legend: L query length, S key length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from attnkit.bench.workloads import Inputs, Workload

__all__ = ["Case", "Fn", "GiB", "Peer"]

GiB = 1 << 30

Fn = Callable[[], torch.Tensor]


@dataclass(frozen=True)
class Case:
    """One case a peer may skip: a workload at length ``L`` in ``dtype``, forward or forward +
    backward, under a memory cap of ``cap`` bytes for the dense tensors a peer would make."""

    wl: Workload
    L: int
    dtype: torch.dtype
    backward: bool
    cap: float

    @property
    def sizes(self) -> tuple[int, int]:
        """``(Lq, S)`` of the workload at ``L``."""
        return self.wl.sizes(self.L)


class Peer:
    """A way to compute a workload: ``skip`` says why not, ``setup`` returns the call.

    A peer runs either the attention rows (``q, k, v``) or, with ``module = True``, the module
    rows (``x``); ``skip_case`` adds its own reasons (memory, dtype, backward) for its rows."""

    module = False

    def __init__(self, name: str, description: str) -> None:
        self.name = name
        self.description = description

    def skip(
        self, wl: Workload, L: int, dtype: torch.dtype, backward: bool, cap: float
    ) -> str | None:
        if wl.module != self.module:
            return "module rows compare modules" if wl.module else "module rows only"
        return self.skip_case(Case(wl, L, dtype, backward, cap))

    def skip_case(self, case: Case) -> str | None:
        return None

    def setup(self, wl: Workload, inputs: Inputs) -> Fn:
        raise NotImplementedError
