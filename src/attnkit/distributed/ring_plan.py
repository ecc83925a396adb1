"""The plan of one ring attention call: who holds which chunks, which (query chunk, key chunk)
pairs have something visible, the head groups run as passes, and the ring's exchanges.

Dimension legend: P ranks, r this rank; chunks are the sequence pieces of
:mod:`attnkit.distributed.sharding` at their global positions.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from attnkit.backends.blocked import gather
from attnkit.backends.blocked.blocks import BlockAt, BlockPlan
from attnkit.backends.blocked.rowspan import NOT_SPANS
from attnkit.distributed.faults import Pending, exchange, wait_all
from attnkit.distributed.profile import RingStep, active_profile
from attnkit.distributed.sharding import Chunk, Layout
from attnkit.masks import MaskSpec
from attnkit.masks.selected import select_heads

__all__ = ["WHERE", "RingPlan"]

WHERE = "attnkit.distributed.ring_attention"


@dataclass(frozen=True)
class RingPlan:
    """Everything one ring pass needs besides the tensors: the group, the layouts, the spec,
    the head groups of the passes; and the ring's moves (post, wait, record)."""

    group: dist.ProcessGroup | None
    rank: int
    world: int
    timeout: timedelta
    q_layout: Layout
    k_layout: Layout
    spec: MaskSpec | None
    scale: float
    #: the key/value heads of each ring pass, ``[start, stop)``; query heads follow their group
    kv_groups: tuple[tuple[int, int], ...] = ((0, 1),)
    #: query heads per key/value head
    group_size: int = 1
    #: which pass this plan runs (see :meth:`for_pass`)
    part: int = 0

    @property
    def prev(self) -> int:
        return (self.rank - 1) % self.world

    def for_pass(self, part: int) -> tuple[RingPlan, slice, slice]:
        """The plan of pass ``part`` (its spec seeing only its heads), and its query and
        key/value head slices."""
        k0, k1 = self.kv_groups[part]
        g = self.group_size
        spec = self.spec
        if spec is not None and len(self.kv_groups) > 1:
            spec = select_heads(spec, k0 * g, k1 * g)
        return replace(self, spec=spec, part=part), slice(k0 * g, k1 * g), slice(k0, k1)

    def pairs(self, src: int) -> tuple[list[tuple[Chunk, Chunk]], int]:
        """The (query chunk, key chunk) pairs with something visible, and how many were not."""
        off = self.k_layout.total - self.q_layout.total
        todo, skipped = [], 0
        for qc in self.q_layout.chunks(self.rank):
            for kc in self.k_layout.chunks(src):
                if self.spec is not None:
                    lo, hi = (torch.tensor([[x]]) for x in (qc.start, qc.start + qc.length - 1))
                    klo, khi = (torch.tensor([[x]]) for x in (kc.start, kc.start + kc.length - 1))
                    if self.spec.device is not None:
                        lo, hi, klo, khi = (t.to(self.spec.device) for t in (lo, hi, klo, khi))
                    any_, _ = self.spec.block_bounds(lo, hi, klo, khi, off)
                    if not bool(any_.any()):
                        skipped += 1
                        continue
                todo.append((qc, kc))
        return todo, skipped

    def at(self, qc: Chunk, kc: Chunk, q: torch.Tensor) -> dict[str, Any]:
        """The block functions' keywords for the pair (query chunk, key chunk) of queries
        ``q``: the spec, the scale and where the pair sits
        (:class:`~attnkit.backends.blocked.BlockAt`); for selected keys also the plan of the
        gather kernel on the pair (the chunk's rows of the indices, its keys' entries)."""
        at = BlockAt(qc.start, kc.start, self.q_layout.total, self.k_layout.total)
        found: dict[str, Any] = {"mask": self.spec, "scale": self.scale, "at": at}
        off = self.k_layout.total - self.q_layout.total
        rows, keys = (qc.start, qc.length), (kc.start, kc.length)
        kernel = gather.block_plan(self.spec, None, rows, keys, off, q.dtype, q.device)
        if kernel is not None:
            spans = NOT_SPANS.refuse(f"{kernel.name} runs the pair")
            plan = BlockPlan(self.spec, qc.start, kc.start, off, spans, None, None, kernel)
            found["plan"] = plan
        return found

    def post(
        self, sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor], tag: int
    ) -> list[Pending]:
        """Send to the next rank and receive from the previous one, without waiting."""
        return exchange(sends, recvs, group=self.group, rank=self.rank, world=self.world, tag=tag)

    def wait(self, pending: list[Pending], what: str) -> float:
        """Wait (bounded) for ``pending``; return the seconds waited."""
        t0 = time.perf_counter()
        wait_all(
            pending,
            timeout=self.timeout,
            where=WHERE,
            rank=self.rank,
            world=self.world,
            what=what,
        )
        return time.perf_counter() - t0

    def record(
        self,
        phase: str,
        step: int,
        clock: tuple[float, float],
        wait_s: float,
        sent: Sequence[torch.Tensor],
        pairs: int,
        skipped: int,
    ) -> None:
        prof = active_profile()
        if prof is None:
            return
        cpu0, wall0 = clock
        wall = time.perf_counter() - wall0 - wait_s
        prof.steps.append(
            RingStep(
                phase,
                self.part,
                step,
                (self.rank - step) % self.world,
                time.process_time() - cpu0,
                wall,
                wait_s,
                sum(t.numel() * t.element_size() for t in sent),
                pairs,
                skipped,
            )
        )
