"""The ``blocked`` backend under ``torch.compile``: one custom op, ``attnkit::blocked_attention``.

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
Dk query/key head dim, Dv value head dim.

Dynamo cannot trace the blocked backend itself: its planner reads the mask's values
(``.tolist()``), its tiles are Python loops and the row-span kernel is a C++ call, and a graph break
is an error under ``fullgraph=True``. A compiled call therefore hands the whole computation to
one opaque custom op (``torch.library.custom_op``) with a fake implementation (shapes only) and
a backward op of its own. The compiled graph keeps attnkit's block-sparse kernels: the op plans
the call when it runs, from the real tensors, with the same plan cache as an eager call; a
whole-call kernel (the gather kernel of :func:`~attnkit.masks.selected_keys`) runs the call
there as it does eagerly, and the indices' range is checked there (a trace cannot read it).

An op cannot take a mask spec (a Python object): :func:`~attnkit.masks.fields.flatten` takes
one apart into its tensors, ints, floats and a string of its structure (a constant of the
graph), and :func:`~attnkit.masks.fields.rebuild` makes the same spec again inside the op; each
spec class says what it is made of (:meth:`~attnkit.masks.MaskSpec.compile_fields`).
"""

from __future__ import annotations

from typing import Any

import torch

from attnkit.backends.blocked import kernels, rowspan
from attnkit.backends.blocked.blocks import (
    BlockPlan,
    backward_from_lse,
    converts,
    forward_with_lse,
    plan_on_path,
    sinks_grad,
    with_sinks,
)
from attnkit.backends.blocked.kernels import OP
from attnkit.backends.second_order import Recompute, reference_grads
from attnkit.call import AttentionCall
from attnkit.cpu import path_for, to_float32, upcasts
from attnkit.masks import MaskSpec
from attnkit.masks.fields import flatten, rebuild
from attnkit.masks.selected import check_selected

__all__ = ["OP", "flatten", "rebuild", "run", "unsupported"]

#: the arguments both ops take after their tensors: the flattened spec, and the call's
#: ``[scale, soft-cap]`` (soft-cap 0: none)
_SPEC_ARGS = "Tensor[] tensors, SymInt[] ints, float[] floats, str structure, float[] scale_cap"


def unsupported(call: AttentionCall) -> str | None:
    """Why the op cannot run ``call`` (its spec cannot be taken apart), or ``None``."""
    flat = flatten(call.mask)
    if isinstance(flat, str):
        return (
            "under torch.compile it runs as a custom op, which takes the mask spec as tensors, "
            f"numbers and the names of its classes, but {flat}"
        )
    return None


def _lse_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _whole_call(
    spec: MaskSpec | None,
    softcap: float | None,
    path: str | None,
    q: torch.Tensor,
    k: torch.Tensor,
) -> BlockPlan | None:
    """The plan of a whole-call kernel (:mod:`~attnkit.backends.blocked.kernels`: the gather
    kernel of selected keys) where one runs the call, as an eager call plans it (on
    ``fp32-upcast`` for the float32 copies), else ``None``. Its inputs are checked here, where
    their values can be read (a trace skips the range check of the indices)."""
    L, S = q.shape[2], k.shape[2]
    seen = torch.float32 if upcasts(path) else q.dtype  # what the kernels will see
    whole = kernels.plan(spec, softcap, L, S, seen, q.device)
    if whole is None:
        return None
    assert spec is not None
    check_selected(spec, q.shape[0], q.shape[1], k.shape[1], L, S, OP)
    spans = rowspan.NOT_SPANS.refuse(f"{whole.name} runs the call")
    return BlockPlan(spec, 0, 0, S - L, spans, softcap, None, whole)


def _kernel_inputs(
    spec: MaskSpec | None, softcap: float | None, *ts: torch.Tensor
) -> tuple[tuple[torch.Tensor, ...], BlockPlan]:
    """The op's tensors (q, k, v first) as the kernels take them, and their plan: a whole-call
    kernel's where one runs the call (:func:`_whole_call`), else the row-span kernel's or the
    tiles' (:func:`~attnkit.backends.blocked.blocks.plan_on_path`), as an eager call plans (the
    op runs eagerly, so the CPU path of :mod:`attnkit.cpu` is read here); float32 copies where
    the plan runs on them (:func:`~attnkit.backends.blocked.blocks.converts`), else as given."""
    path = path_for(ts[0], OP)
    upcast = upcasts(path)
    plan = _whole_call(spec, softcap, path, ts[0], ts[1])
    if plan is None:
        plan = plan_on_path(ts[0], ts[1], ts[2], spec, softcap, upcast, path == "native")
    return (to_float32(*ts) if converts(plan, ts[0].dtype, upcast) else ts), plan


@torch.library.custom_op(
    OP,
    mutates_args=(),
    schema=f"(Tensor q, Tensor k, Tensor v, Tensor? sinks, {_SPEC_ARGS}) -> (Tensor, Tensor)",
)
def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor | None,
    tensors: list[torch.Tensor],
    ints: list[int],
    floats: list[float],
    structure: str,
    scale_cap: list[float],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``out (B, H, L, Dv)`` in q's dtype and ``lse (B, H, L)`` (float32; float64 for float64
    q; the sinks joined to it), both contiguous, as the fake implementation promises."""
    spec = rebuild(tensors, ints, floats, structure)
    scale, softcap = scale_cap
    (qc, kc, vc), plan = _kernel_inputs(spec, softcap or None, q, k, v)
    out, lse = with_sinks(*forward_with_lse(qc, kc, vc, mask=spec, scale=scale, plan=plan), sinks)
    return out.to(q.dtype).contiguous(), lse.to(_lse_dtype(q)).contiguous()


@_forward.register_fake
def _forward_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *spec_args: object
) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, L, _ = q.shape
    out = q.new_empty((B, H, L, v.shape[-1]))  # (B, H, L, Dv)
    return out, q.new_empty((B, H, L), dtype=_lse_dtype(q))


@torch.library.custom_op(
    "attnkit::blocked_attention_backward",
    mutates_args=(),
    schema=f"(Tensor[] saved, Tensor dout, {_SPEC_ARGS}) -> (Tensor, Tensor, Tensor)",
)
def _backward(
    saved: list[torch.Tensor],
    dout: torch.Tensor,
    tensors: list[torch.Tensor],
    ints: list[int],
    floats: list[float],
    structure: str,
    scale_cap: list[float],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dq, dk, dv`` in the dtypes of q, k, v, contiguous, from what the forward saved
    (``saved``: q, k, v, out, lse) and ``dout``."""
    q, k, v, out, lse = saved
    spec = rebuild(tensors, ints, floats, structure)
    scale, softcap = scale_cap
    (qc, kc, vc, oc, doc), plan = _kernel_inputs(spec, softcap or None, q, k, v, out, dout)
    dq, dk, dv = backward_from_lse(qc, kc, vc, oc, doc, lse, mask=spec, scale=scale, plan=plan)
    return (
        dq.to(q.dtype).contiguous(),
        dk.to(k.dtype).contiguous(),
        dv.to(v.dtype).contiguous(),
    )


@_backward.register_fake
def _backward_fake(
    saved: list[torch.Tensor], *dout_and_spec: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients have the shapes of q, k, v (the first three of ``saved``)."""
    q, k, v = saved[:3]
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, ...]) -> None:
    q, k, v, sinks, tensors, ints, floats, structure, scale_cap = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, sinks, *tensors)
    ctx.spec_args = (ints, floats, structure, scale_cap)
    ctx.mark_non_differentiable(lse)
    # no gradient for the spec's arguments; torch wants a list of them for a list that holds
    # only tensors (an empty one included)
    ctx.no_grads = tuple(
        [None] * len(x)
        if isinstance(x, list) and all(isinstance(t, torch.Tensor) for t in x)
        else None
        for x in inputs[4:]
    )


def _autograd_backward(ctx: Any, dout: torch.Tensor, _dlse: Any) -> tuple[Any, ...]:
    q, k, v, out, lse, sinks, *tensors = ctx.saved_tensors
    ints, floats, structure, scale_cap = ctx.spec_args
    if torch.is_grad_enabled():  # create_graph=True, where torch runs this eagerly (a graph
        # compiled with backend="eager"): the math backend's gradients, differentiable
        spec = rebuild(tensors, ints, floats, structure)
        dims = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        todo = Recompute(spec, scale_cap[0], scale_cap[1] or None, dims, OP, "blocked")
        needs = (*ctx.needs_input_grad[:4], False)
        grads = reference_grads(todo, (q, k, v, sinks, None), needs, dout)
        return (*grads[:4], *ctx.no_grads)
    dq, dk, dv = torch.ops.attnkit.blocked_attention_backward(
        [q, k, v, out, lse], dout, tensors, ints, floats, structure, scale_cap
    )
    dsinks = sinks_grad(sinks, out, dout, lse) if ctx.needs_input_grad[3] else None
    return (dq, dk, dv, dsinks, *ctx.no_grads)


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def run(call: AttentionCall) -> torch.Tensor:
    """``out (B, H, L, Dv)`` of ``call`` through the op (what a compiled call runs)."""
    flat = flatten(call.mask)
    if isinstance(flat, str):  # check() refused it (unsupported)
        raise TypeError(flat)
    tensors, ints, floats, structure = flat
    scale_cap = [call.scale, 0.0 if call.softcap is None else call.softcap]
    out, _ = torch.ops.attnkit.blocked_attention(
        call.q, call.k, call.v, call.sinks, tensors, ints, floats, structure, scale_cap
    )
    return out  # type: ignore[no-any-return]
