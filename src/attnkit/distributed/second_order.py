"""Second derivatives of ring attention: its shard's gradients as a graph autograd differentiates.

Dimension legend: B batch, H query heads, Hkv key/value heads, Lq / Sk this rank's query / key
tokens, L / S the whole sequence's (``P * Lq``, ``P * Sk``), Dk / Dv head dims, P ranks.

The ring's backward (:mod:`attnkit.distributed.ring`) sends K/V and their gradients around the ring
outside autograd: fast, and of no use to a second derivative. When autograd records the backward
(``create_graph=True``: a Hessian, ``gradgradcheck``, a gradient penalty) the ring recomputes its
shard's gradients here instead, as :mod:`attnkit.backends.second_order` does for one process: this
rank's queries against every rank's keys and values, gathered by an all-gather whose adjoint sums
the gradients of every rank (so each rank's ``dk``/``dv`` collects what every rank's queries give
it, as the ring's own backward does), through the math backend's formula
(:func:`attnkit.backends.math.attend`, float32; float64 for float64) with the mask evaluated at the
global positions and the sinks, if any, joined to this rank's rows. Every rank must take the second
derivative too, in the same order (the gathers are collectives), as every rank runs the ring's
backward. The recompute holds this rank's ``Lq x S`` scores: it is refused above attnkit's memory
limit.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from attnkit.backends.math import attend
from attnkit.backends.second_order import check_recompute
from attnkit.distributed.faults import Pending, Refused, wait_all
from attnkit.distributed.ring_plan import WHERE, RingPlan
from attnkit.masks import MaskSpec

__all__ = ["ring_grads"]


def _wait(plan: RingPlan, pending: list[Pending], what: str) -> None:
    wait_all(
        pending, timeout=plan.timeout, where=WHERE, rank=plan.rank, world=plan.world, what=what
    )


class _Gather(torch.autograd.Function):
    """Every rank's shard ``(..., Sk, D)`` in rank order, ``(..., P * Sk, D)``; the adjoint
    (:class:`_SumShard`) sums every rank's gradient and keeps this rank's rows."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, plan: RingPlan) -> torch.Tensor:
        ctx.plan = plan
        xc = x.contiguous()
        parts = [torch.empty_like(xc) for _ in range(plan.world)]
        try:
            work = dist.all_gather(parts, xc, group=plan.group, async_op=True)
            pending: list[Pending] = [] if work is None else [(work, ())]
        except RuntimeError as e:  # refused at posting: raised (as RingError) by wait_all
            pending = [(Refused(e), ())]
        _wait(plan, pending, "gathering the K/V shards for a second derivative (all_gather)")
        return torch.cat(parts, dim=-2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _SumShard.apply(grad, ctx.plan), None  # type: ignore[no-untyped-call]


class _SumShard(torch.autograd.Function):
    """The sum over ranks of ``(..., P * Sk, D)``, this rank's ``Sk`` rows; the adjoint of
    :class:`_Gather`, whose adjoint it has in turn."""

    @staticmethod
    def forward(ctx: Any, g: torch.Tensor, plan: RingPlan) -> torch.Tensor:
        ctx.plan = plan
        total = g.contiguous().clone()
        try:
            work = dist.all_reduce(total, group=plan.group, async_op=True)
            pending: list[Pending] = [] if work is None else [(work, ())]
        except RuntimeError as e:
            pending = [(Refused(e), ())]
        _wait(plan, pending, "summing the K/V gradients for a second derivative (all_reduce)")
        n = g.shape[-2] // plan.world
        return total.narrow(-2, plan.rank * n, n)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _Gather.apply(grad, ctx.plan), None  # type: ignore[no-untyped-call]


def _mask_at(
    spec: MaskSpec | None, q_pos: torch.Tensor, k_pos: torch.Tensor, off: int, dtype: torch.dtype
) -> torch.Tensor | None:
    """``spec`` at these global query and key positions: bool ``(B', H', Lq, S)`` (True = may
    attend; ``H' = heads`` for a spec that depends on the head, such as selected keys per
    key/value head, else 1), or float ``(B', H', Lq, S)`` (the bias where allowed, ``-inf``
    elsewhere) for a spec with a bias, as :meth:`~attnkit.masks.MaskSpec.to_dense` builds it
    for ``arange``."""
    if spec is None:
        return None
    dev = q_pos.device
    B = spec.batch or 1
    H = spec.heads or 1
    b = torch.arange(B, device=dev).view(B, 1, 1, 1)
    h = torch.arange(H, device=dev).view(1, H, 1, 1)
    q = q_pos.view(1, 1, -1, 1)
    kv = k_pos.view(1, 1, 1, -1)
    allowed = spec.allowed(b, h, q, kv, off)
    bias = spec.bias(b, h, q, kv, off) if spec.has_bias else None
    if bias is None:
        return allowed
    return torch.where(allowed, bias.to(dtype), float("-inf"))


def _alias(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the graph (its own node, so ``k is v`` keeps two partials), or a detached leaf
    that requires grad where ``t`` needs none: every rank then runs the same collectives."""
    return t.view_as(t) if t.requires_grad else t.detach().requires_grad_()


def ring_grads(
    plan: RingPlan,
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None],
    dout: torch.Tensor,
    needs: tuple[bool, ...],
) -> tuple[torch.Tensor | None, ...]:
    """This rank's ``dq, dk, dv, dsinks`` (those ``needs`` asks for; ``None`` for no sinks)
    of the ring attention of ``inputs`` ``(q, k, v, sinks)`` whose output's gradient is
    ``dout``, as a differentiable graph (see the module's text). The sinks join this rank's
    rows only: their gradient is those rows' part, as in the ring's own backward."""
    q, k, v, sinks = inputs
    B, H, Lq, _ = q.shape
    world = plan.world
    S = world * k.shape[2]
    check_recompute(B, H, Lq, S, q.dtype, q.device, WHERE, "ring attention")
    c = torch.float64 if q.dtype == torch.float64 else torch.float32
    k_pos = torch.cat([plan.k_layout.positions(r, q.device) for r in range(world)])
    q_pos = plan.q_layout.positions(plan.rank, q.device)
    off = plan.k_layout.total - plan.q_layout.total
    mask = _mask_at(plan.spec, q_pos, k_pos, off, c)
    with torch.enable_grad():
        leaves = [_alias(t) for t in (q, k, v)] + ([] if sinks is None else [_alias(sinks)])
        K = _Gather.apply(leaves[1], plan)  # type: ignore[no-untyped-call]
        V = _Gather.apply(leaves[2], plan)  # type: ignore[no-untyped-call]
        s = None if sinks is None else leaves[3].to(c)
        out, _ = attend(leaves[0].to(c), K.to(c), V.to(c), mask, plan.scale, sinks=s)
        grads: list[torch.Tensor | None] = list(
            torch.autograd.grad(out, leaves, dout.to(c), create_graph=True)
        )
    if sinks is None:
        grads.append(None)
    return tuple(g if needs[i] else None for i, g in enumerate(grads))  # dq, dk, dv, dsinks
