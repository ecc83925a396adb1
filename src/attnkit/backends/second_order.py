"""Second derivatives of attention: the math backend's, from every backend, or a clear refusal.

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
Dk query/key head dim, Dv value head dim.

The fused backends have a first derivative of their own and none of its derivative: torch's
fused ``sdpa`` kernels raise when their backward is differentiated, and ``blocked``'s backward
(attnkit's row-span kernel or the tiles, run outside autograd) would give a second derivative
of 0 where the math backend gives another value. So the dispatcher (step 3 of
:mod:`attnkit.backends`, :meth:`~attnkit.backends.Choice.run`) hands the output of every backend
whose own graph does not differentiate twice
(:attr:`~attnkit.backends.Backend.twice_differentiable` false: all built-in backends but ``math``)
to one autograd node, ``_SecondOrder``. Its backward passes the gradient on to the backend's own
backward (the fast first derivative, unchanged) unless autograd records a graph of the backward,
that is unless the caller asked for ``create_graph=True`` (``torch.autograd.grad(...,
create_graph=True)``, ``torch.autograd.functional.hessian``, ``gradgradcheck``, a gradient
penalty). Then it recomputes the gradients of q, k, v, the sinks and a float mask that needs one,
differentiably, through the math backend's formula (:func:`attnkit.backends.math.attend`, in
float32; float64 for float64 inputs) on the same mask and scale: every higher derivative is the
math backend's.

That recompute builds the ``(B, H, L, S)`` scores and weights, as ``math`` does: it is refused
(:class:`~attnkit.AttentionMemoryError`) above attnkit's memory limit; and it refuses dropout
(its mask cannot be drawn again: ``backend="math"`` keeps it in its graph). Ring attention
(:mod:`attnkit.distributed.ring`) recomputes its shard the same way, with K/V gathered.
Inside ``torch.compile`` and under ``torch.func`` transforms the node is not added (their
own rules for custom autograd functions apply; the output is the backend's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from attnkit.backends.math import attend
from attnkit.call import AttentionCall
from attnkit.errors import AttentionInputError
from attnkit.masks import MaskSpec
from attnkit.memory import exceeds, refuse

__all__ = ["Recompute", "check_recompute", "reference_grads", "wrap"]


@dataclass(frozen=True)
class Recompute:
    """What the differentiable recompute needs besides the tensors: the mask as a spec when it
    is no tensor of the call's (a tensor travels with the saved tensors), the scale, the
    soft-cap, and what an error names."""

    spec: MaskSpec | None
    scale: float
    softcap: float | None
    dims: tuple[int, int, int, int]  #: (B, H, L, S)
    where: str
    backend: str


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_recompute(
    B: int, H: int, L: int, S: int, dtype: torch.dtype, device: torch.device, where: str, what: str
) -> None:
    """Refuse (:class:`~attnkit.AttentionMemoryError`) a recompute whose ``(B, H, L, S)``
    scores and weights (about five such tensors, the graph of the backward included) are above
    attnkit's memory limit; ``what`` names the path (``"backend 'blocked'"``)."""
    nbytes = 5 * B * H * L * S * _compute_dtype(dtype).itemsize
    limit = exceeds(nbytes, device)
    if limit is None:
        return
    raise refuse(
        where,
        "create_graph",
        f"a second derivative through {what} (it recomputes the gradients with the math "
        f"backend's (B={B}, H={H}, L={L}, S={S}) scores and weights in "
        f"{_compute_dtype(dtype)}, about 5 such tensors with the graph of the backward)",
        nbytes,
        limit,
        got=f"create_graph=True (a Hessian, gradgradcheck or a gradient penalty) on a {L} x {S} "
        f"call, {dtype} on {device}",
        fix="fewer queries or keys per call for the second derivative, or first derivatives "
        "only (create_graph=False)",
    )


def reference_grads(
    recompute: Recompute,
    inputs: Sequence[torch.Tensor | None],
    needs: Sequence[bool],
    dout: torch.Tensor,
) -> tuple[torch.Tensor | None, ...]:
    """The gradients of ``(q, k, v, sinks, mask)`` (``inputs``; ``None`` where absent) that
    ``needs`` asks for, given ``dout``, as a graph autograd can differentiate again: the math
    backend's formula under ``torch.enable_grad()`` and ``torch.autograd.grad(...,
    create_graph=True)``. Each input is aliased first (``view_as``), so that ``k is v`` still
    gives each its own partial derivative."""
    B, H, L, S = recompute.dims
    q0 = inputs[0]
    assert q0 is not None
    check_recompute(
        B, H, L, S, q0.dtype, q0.device, recompute.where, f"backend {recompute.backend!r}"
    )
    c = _compute_dtype(q0.dtype)
    with torch.enable_grad():
        aliases = [None if t is None else t.view_as(t) for t in inputs]
        q, k, v, sinks, mask = aliases
        assert q is not None
        assert k is not None
        assert v is not None
        if mask is None and recompute.spec is not None:
            mask = recompute.spec.to_dense(L, S, device=q.device, dtype=c)
        if mask is not None and mask.is_floating_point():
            mask = mask.to(c)
        out, _ = attend(
            q.to(c), k.to(c), v.to(c), mask, recompute.scale,
            softcap=recompute.softcap, sinks=sinks,
        )  # fmt: skip
        wanted = [i for i, t in enumerate(aliases) if t is not None and needs[i]]
        targets = [t for i, t in enumerate(aliases) if t is not None and needs[i]]
        got = (
            torch.autograd.grad(out, targets, dout.to(c), create_graph=True, allow_unused=True)
            if targets
            else ()
        )
    grads: list[torch.Tensor | None] = [None] * len(inputs)
    for i, g in zip(wanted, got, strict=True):
        grads[i] = g
    return tuple(grads)


class _SecondOrder(torch.autograd.Function):
    """Identity on the backend's output: its backward hands ``dout`` to the backend's own
    backward, or, when autograd records the backward (``create_graph=True``), returns the
    differentiable gradients of :func:`reference_grads` instead (the backend's backward is
    then never run)."""

    @staticmethod
    def forward(
        ctx: Any,
        recompute: Recompute,
        out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        ctx.recompute = recompute
        ctx.save_for_backward(q, k, v, sinks, mask)
        # a tensor of its own (no view of an input: the caller may write into it), on the
        # output's storage and version counter (writing into it before backward is refused,
        # as it is for the backend's own output)
        return out.detach()

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if not torch.is_grad_enabled():  # first derivatives: the backend's own backward
            return None, dout, None, None, None, None, None
        grads = reference_grads(ctx.recompute, ctx.saved_tensors, ctx.needs_input_grad[2:], dout)
        return None, None, *grads


def _functorch_active() -> bool:
    """A ``torch.func`` transform (grad, vmap, jacrev, ...) is running."""
    level = getattr(torch._C._functorch, "maybe_current_level", None)
    return level is not None and level() is not None


def wrap(call: AttentionCall, backend: str, out: torch.Tensor, where: str) -> torch.Tensor:
    """``out`` of a backend whose graph does not differentiate twice, as the output of one
    ``_SecondOrder`` node (see the module's text); as it is where no gradient is recorded,
    inside ``torch.compile`` or under ``torch.func`` transforms. Raises for dropout, which a
    recompute cannot repeat, only when a second derivative is taken (see
    :func:`_refuse_dropout`)."""
    if not out.requires_grad or not torch.is_grad_enabled():
        return out
    if torch.compiler.is_compiling() or _functorch_active():
        return out
    if call.dropout_p > 0.0:
        return _refuse_dropout(call, backend, out, where)
    mask = call.mask_tensor
    d = call.dims
    recompute = Recompute(
        None if mask is not None else call.mask,
        call.scale,
        call.softcap,
        (d.B, d.H, d.L, d.S),
        where,
        backend,
    )
    result: torch.Tensor = _SecondOrder.apply(  # type: ignore[no-untyped-call]
        recompute, out, call.q, call.k, call.v, call.sinks, mask
    )
    return result


class _NoSecondOrder(torch.autograd.Function):
    """Identity whose backward hands ``dout`` on, and raises when autograd records the
    backward (``create_graph=True``)."""

    @staticmethod
    def forward(ctx: Any, error: AttentionInputError, out: torch.Tensor) -> torch.Tensor:
        ctx.error = error
        return out.detach()

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[None, torch.Tensor]:
        if torch.is_grad_enabled():
            raise ctx.error
        return None, dout


def _refuse_dropout(
    call: AttentionCall, backend: str, out: torch.Tensor, where: str
) -> torch.Tensor:
    error = AttentionInputError(
        where,
        "dropout_p",
        f"backend {backend!r} cannot give a second derivative with dropout: attnkit "
        "recomputes the gradients to differentiate them again, and the dropout mask cannot "
        "be drawn again.",
        got=f"dropout_p={call.dropout_p}, backend {backend!r}, create_graph=True",
        expected="dropout_p=0.0, or a backend whose graph keeps the dropout mask",
        fix="backend='math' (its graph differentiates twice, dropout included), or "
        "dropout_p=0.0 (model.eval()) for the second derivative",
    )
    result: torch.Tensor = _NoSecondOrder.apply(error, out)  # type: ignore[no-untyped-call]
    return result
