"""The ``blocked`` backend: exact attention that visits only the blocks a mask leaves non-empty.

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
Dk query/key head dim, Dv value head dim.

The package, in the order a call goes through it:

* ``__init__`` (here): the backend (its one decision per call, and ``run``) and the autograd
  function, which takes the decision's plan and hands it to the forward and the backward;
* ``compiled``: inside ``torch.compile``, ``run`` hands the call to one custom op,
  ``attnkit::blocked_attention`` (forward and backward ops over the same functions below),
  which Dynamo keeps opaque; the spec goes in as tensors, numbers and a string;
* ``blocks``: :func:`plan_blocks` (row-span kernel or tiles) and the public block functions
  :func:`forward_with_lse` / :func:`backward_from_lse`, which ring attention builds on;
* ``kernels``: the one interface of the kernels a plan holds (``BlockPlan.kernel``: the
  row-span kernel, ``rowspan_kernel``; the decode kernel; the gather kernel of selected keys):
  forward, backward, what explain says, whether they report NaN/inf themselves; the forward,
  the backward, ``run``, ``direct`` and explain call it without asking which kernel it is;
* ``plan``: the tile planner, reading the spec's block map (:func:`attnkit.masks.block_states`);
  its knobs are one frozen :class:`~attnkit.backends.blocked.config.BlockedConfig`
  (``config``), part of every plan's cache key;
* ``tiles``: the tile kernels (torch's fused CPU flash kernel, or matmul), their launches over
  ``as_strided`` views, and :func:`~attnkit.backends.blocked.tiles.merge` (the log-sum-exp
  rule, shared with ring attention);
* ``rowspan`` and ``csrc/row_span.cpp``: attnkit's own AVX2 kernel for masks that allow one
  run of keys per query row (causal, windows, documents, prefix-LM, contiguous padding; runs
  from :func:`attnkit.masks.row_spans`), grouped-query heads sharing packed K panels, forward
  and backward in one pass each; ``rowspan_builds``: its builds (AVX2, AVX-512, AVX512-BF16)
  in one table, and the one ``select()`` of the build that runs a call.
* ``decode`` and ``csrc/decode.cpp``: the forward of decode-shaped calls (a few queries
  against a long key/value cache, no autograd): each key/value head read once for its query
  heads, split-K across threads, only the keys of each row's run (the same runs), at the
  speed of memory; it reports NaN/inf itself, so the non-finite rule costs no extra pass.

bfloat16/float16 on the CPU follow the path of :mod:`attnkit.cpu`: on ``fp32-upcast`` (AVX2 or
AVX-512 without bf16/fp16 instructions) a call the row-span kernel serves hands it the
bfloat16/float16 tensors as they are (it converts as it packs its panels and loads its rows,
computes in float32 and writes out, dq, dk, dv in the input dtype: no float32 copies); every
other call converts q, k, v to float32 here, at the entry (the tiles see float32), and the
output and the gradients are converted back. Training saves the input-dtype tensors either way
(the converting backward converts them again). On ``native`` and ``torch`` the tensors go to
the tiles as they are (torch's fused kernel accumulates in float32).

Training keeps q, k, v, the output and ``lse (B, H, L)``: memory grows with L, not L x S.
Grouped-query heads go to the kernels as they are (``Hkv`` heads, never repeated). A query row
with nothing to attend to gets output 0, log-sum-exp ``-inf`` and gradient 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from attnkit.backends.base import Backend, Decision, mask_planning
from attnkit.backends.blocked import compiled, decode, kernels, measured, rowspan
from attnkit.backends.blocked.blocks import (
    WHOLE,
    BlockAt,
    BlockPlan,
    backward_from_lse,
    clear_plans,
    converts,
    forward_with_lse,
    plan_blocks,
    plan_on_path,
    sinks_grad,
    stand_in,
    with_sinks,
)
from attnkit.backends.blocked.config import BlockedConfig, configure, current
from attnkit.backends.blocked.tiles import fused, merge
from attnkit.call import AttentionCall
from attnkit.cpu import to_float32

__all__ = [
    "WHOLE",
    "BlockAt",
    "BlockPlan",
    "BlockedBackend",
    "BlockedConfig",
    "backward_from_lse",
    "clear_plans",
    "configure",
    "forward_with_lse",
    "merge",
    "plan_blocks",
]


def _float32(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, upcast: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as the kernels take them: float32 copies where ``upcast`` (see :func:`_converts`),
    else themselves."""
    if not upcast:
        return q, k, v
    qc, kc, vc = to_float32(q, k, v)  # a reused buffer: the kernels are done with it on return
    return qc, kc, vc


def _plan(call: AttentionCall) -> BlockPlan:
    """The call's plan, its kernel chosen here once (:mod:`~attnkit.backends.blocked.kernels`):
    the gather kernel where the spec selects keys; for a decode-shaped call
    (:func:`attnkit.backends.blocked.decode.shaped`) the decode kernel where it serves (on q,
    k, v as they are), else its reason stays in the plan for explain; then the row-span kernel
    or the tiles on the call's CPU path (:func:`~attnkit.backends.blocked.blocks.plan_on_path`)."""
    L, S = call.dims.L, call.dims.S
    seen = torch.float32 if call.upcast else call.q.dtype  # what the kernels will see
    whole = kernels.plan(call.mask, call.softcap, L, S, seen, call.q.device)
    if whole is not None:  # a whole-call kernel (selected keys), decode-shaped or not
        spans = rowspan.NOT_SPANS.refuse(f"{whole.name} runs the call")
        return BlockPlan(call.mask, 0, 0, S - L, spans, call.softcap, None, whole)
    d = decode.plan(call)
    if d is not None and d.serves:
        spans = rowspan.NOT_SPANS.refuse(f"{d.name} runs the call")
        return BlockPlan(call.mask, 0, 0, S - L, spans, call.softcap, d, d)
    native = call.cpu_path == "native"
    p = plan_on_path(call.q, call.k, call.v, call.mask, call.softcap, call.upcast, native)
    return p if d is None else dataclasses.replace(p, decode=d)


def _reads_note(call: AttentionCall, plan: BlockPlan | None) -> str | None:
    """What explain says where the plan's kernel reads q, k, v as they are on the call's CPU
    path (:meth:`~attnkit.backends.blocked.kernels.KernelPlan.reads_note`), else ``None``."""
    if plan is None or plan.kernel is None:
        return None
    return plan.kernel.reads_note(call.q.dtype, call.upcast)


def _converts(call: AttentionCall, plan: BlockPlan) -> bool:
    """Whether the call runs on float32 copies: on ``fp32-upcast``, unless the plan's kernel
    reads q, k, v as they are (the decode kernel; the row-span kernel where it reads the input
    dtype directly): :func:`~attnkit.backends.blocked.blocks.converts`."""
    return converts(plan, call.q.dtype, call.upcast)


class _BlockedAttention(torch.autograd.Function):
    """Autograd over :func:`forward_with_lse` / :func:`backward_from_lse` with one plan: saves
    q, k, v, the output and ``lse (B, H, L)``, nothing of size L x S. With sinks, the saved
    ``lse`` includes them, so the blocks' backward is unchanged; the sinks' own gradient is
    ``-P_sink * D`` with ``D = rowsum(dout * out)``, summed over the rows each sink serves
    (:func:`~attnkit.backends.blocked.blocks.sinks_grad`). With ``upcast`` the
    kernels run on float32 copies (made here, and again in the backward from the saved
    input-dtype tensors); without it they take the tensors as they are (on ``fp32-upcast``
    that is the row-span kernel reading bfloat16/float16)."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None,
        plan: BlockPlan,
        scale: float,
        upcast: bool,
    ) -> torch.Tensor:
        qc, kc, vc = _float32(q, k, v, upcast)
        out, lse = forward_with_lse(qc, kc, vc, mask=plan.mask, scale=scale, plan=plan)
        del qc, kc, vc
        out, lse = with_sinks(out, lse, sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.plan, ctx.scale, ctx.upcast = plan, scale, upcast
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, sinks = ctx.saved_tensors
        plan: BlockPlan = ctx.plan
        qc, kc, vc, oc, doc = to_float32(q, k, v, out, dout) if ctx.upcast else (q, k, v, out, dout)
        dq, dk, dv = backward_from_lse(
            qc, kc, vc, oc, doc, lse, mask=plan.mask, scale=ctx.scale, plan=plan
        )
        del qc, kc, vc, oc, doc
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            dsinks = sinks_grad(sinks, out, dout, lse)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, None, None, None


def _refusal(call: AttentionCall, compiling: bool) -> str | None:
    """Why blocked cannot serve the call, or ``None``."""
    if call.return_weights:
        return "it never forms the attention weights (return_weights=True)"
    if call.dropout_p > 0.0:
        return "it has no dropout (dropout_p > 0)"
    if call.mask_needs_grad:
        return "it does not differentiate a float mask"
    if call.q.device.type == "meta":
        return "it plans from the mask's values, and meta tensors have none"
    if compiling:
        return compiled.unsupported(call)
    return None


def _dense_size(call: AttentionCall) -> bool:
    """An unmasked call (no mask, not causal) as large as auto's rule wants for the row-span
    kernel: :data:`~attnkit.backends.blocked.rowspan.DENSE_MIN_ROWS` query rows and
    :data:`~attnkit.backends.blocked.rowspan.DENSE_MIN_PAIRS` pairs, and, in training,
    :data:`~attnkit.backends.blocked.rowspan.DENSE_TRAIN_MIN_PAIRS` (where it measured faster
    than SDPA, forward and forward + backward)."""
    L, S = call.dims.L, call.dims.S
    least = rowspan.DENSE_TRAIN_MIN_PAIRS if call.needs_grad else rowspan.DENSE_MIN_PAIRS
    return L >= rowspan.DENSE_MIN_ROWS and least <= L * S


def _no_mask(call: AttentionCall) -> bool:
    """No mask, or a spec that allows every pair of this non-causal call (``unmasked()``,
    padding that pads nothing: :meth:`~attnkit.masks.MaskSpec.allows_all`, never while
    ``torch.compile`` traces): auto's rule takes it as the unmasked call it is, not as a mask
    spec to skip blocks of."""
    spec = call.mask
    if spec is None:
        return True
    return not spec.from_tensor and not call.causal and spec.allows_all(call.dims.L, call.dims.S)


def _kernel_sized(call: AttentionCall, compiling: bool) -> bool:
    """A plain causal or an unmasked CPU call large enough for auto's rule to ask whether the
    row-span kernel runs it (not while torch.compile traces, where SDPA keeps them)."""
    if compiling or call.softcap is not None or call.sinks is not None:
        return False
    if _no_mask(call):
        return _dense_size(call)
    return call.dims.L * call.dims.S >= rowspan.CAUSAL_MIN_PAIRS and call.causal


def _kernel_rule(call: AttentionCall, plan: BlockPlan) -> str:
    """auto's words for a plain causal or unmasked call the row-span kernel runs (the sizes;
    the measured rule that it is faster than SDPA on this CPU follows them)."""
    on = str(call.q.dtype)
    if call.upcast:
        on = f"float32 copies of {on}" if _converts(call, plan) else f"{on}, read directly"
    if call.causal:
        return f"causal on CPU ({on}), L x S >= 1024 x 1024: attnkit's row-span kernel"
    least = rowspan.DENSE_TRAIN_MIN_PAIRS if call.needs_grad else rowspan.DENSE_MIN_PAIRS
    when = "training" if call.needs_grad else "forward"
    return (
        f"unmasked on CPU ({on}), {when}, L >= {rowspan.DENSE_MIN_ROWS} and L x S >= {least}: "
        "attnkit's row-span kernel (every key of each row)"
    )


def _decode_rule(call: AttentionCall) -> tuple[bool, str]:
    """auto's rule for a decode-shaped CPU call the decode kernel serves: the measured rule of
    the call's dtype on this CPU (:mod:`~attnkit.backends.blocked.measured`) where SDPA would
    run it without a mask tensor (no mask, or plain causal); with any other mask spec SDPA
    would need it materialised, and the kernel reads only the keys each row may see."""
    L, S = call.dims.L, call.dims.S
    what = (
        f"a decode-shaped CPU call (L = {L} <= {decode.MAX_L} queries, S = {S} keys): "
        "attnkit's decode kernel reads each key/value head once for its query heads and only "
        "the keys each row may see"
    )
    if not (_no_mask(call) or call.causal):
        return True, f"{what} (no dense mask, which SDPA would need for this mask spec)"
    takes, why = measured.select(call.q.dtype, "decode")
    if not takes:
        return False, f"torch's SDPA is faster for this decode-shaped call, by {why}"
    return True, f"{what}; {why}"


def _rule(call: AttentionCall, kernel_plan: BlockPlan | None) -> tuple[bool, str]:
    """auto takes ``blocked`` for a mask spec on a problem of at least ``min_pairs``, and for
    plain causal and unmasked calls that attnkit's row-span kernel runs (``kernel_plan``: the
    plan of a :func:`_kernel_sized` call, else ``None``), from
    :data:`~attnkit.backends.blocked.rowspan.CAUSAL_MIN_PAIRS` pairs for causal (where it was
    measured faster than SDPA's ``is_causal``) and the sizes of :func:`_dense_size` unmasked;
    on CUDA, for whatever ``flex`` and ``sdpa`` (before it there) could not serve."""
    if call.device_type == "cuda":
        return True, (
            "flex and torch's fused SDPA kernels cannot serve this call (see below): "
            "blocked is the next path that never builds the L x S scores"
        )
    spec = call.mask
    extras = call.softcap is not None or call.sinks is not None
    L, S = call.dims.L, call.dims.S
    compiling = torch.compiler.is_compiling()
    if spec is not None and spec.selects_keys:
        return True, (
            "selected keys (selected_keys): blocked's gather kernel reads only each query's "
            "selected keys, where SDPA would need the scattered L x S mask"
        )
    plan = kernel_plan  # the decode and row-span kernels' decisions: auto's rule reads them
    if plan is not None and plan.decode is not None:
        if plan.decode.serves:
            return _decode_rule(call)
        if spec is not None and not spec.from_tensor and not call.causal and plan.spans.serves:
            return True, (
                f"a mask spec on a decode-shaped CPU call (L = {L}, S = {S}; the decode kernel "
                f"does not run it: {plan.decode.reason}): the row-span kernel reads only each "
                "row's own keys, where SDPA would need a dense L x S mask"
            )
    sized = plan is not None and _kernel_sized(call, compiling)  # (not a small decode plan)
    if sized and plan is not None and plan.spans.serves:
        takes, why = measured.select(call.q.dtype, "causal" if call.causal else "dense")
        if not takes:
            return False, f"torch's SDPA is faster here, by {why}"
        return True, f"{_kernel_rule(call, plan)}; {why}"
    unmasked = _no_mask(call)
    if not extras and (unmasked or call.causal or (spec is not None and spec.from_tensor)):
        why, kind = "", "plain causal" if call.causal else "unmasked"
        if unmasked and spec is not None:
            kind = f"unmasked ({spec!r} allows every pair)"
        if sized and plan is not None:  # big enough, but the kernel does not run it
            why = f"; this {L} x {S} call is {kind}, but {plan.spans.reason}"
        elif (call.causal or unmasked) and not compiling:  # too small
            train = " in training" if spec is None and call.needs_grad else ""
            why = f"; this {kind.removeprefix('plain ')} call is {L} x {S}{train}"
        return False, (
            "auto takes it for mask specs, soft-caps and sinks, for plain causal "
            "CPU calls its kernel runs from L x S = 1024 x 1024, and for unmasked ones from "
            f"L >= {rowspan.DENSE_MIN_ROWS} and L x S >= {rowspan.DENSE_MIN_PAIRS} "
            f"({rowspan.DENSE_TRAIN_MIN_PAIRS} in training), where it is faster" + why
        )
    pairs = current().min_pairs
    if pairs > L * S:
        # the sizes in words, but not while torch.compile traces: formatting a symbolic size
        # fixes it, and the graph would be compiled again for every new length
        sizes = "L x S" if compiling else f"L x S = {L} x {S}"
        return False, (
            f"{sizes} is below {pairs} pairs, where one fused call on the "
            "materialised mask costs less"
        )
    what = "a mask spec" if not extras else "a soft-cap or sinks (no fused torch kernel)"
    return True, (
        f"{what} and L x S >= {pairs}: blocked visits only the non-empty blocks "
        "and never builds the L x S scores"
    )


class BlockedBackend(Backend):
    name = "blocked"
    description = (
        "block-sparse online softmax: visits only non-empty blocks of a mask spec, "
        "torch's fused kernel per block (attnkit's own for one run of keys per row), own "
        "backward (memory grows with L)"
    )
    priority = 30
    priorities = {"cuda": 15}  # noqa: RUF012 (on CUDA: after flex and sdpa, before math)
    fused = True

    def decide(self, call: AttentionCall) -> Decision:
        """Whether blocked serves the call, auto's rule (:func:`_rule`), the L x S memory of
        planning a mask tensor, and the plan (:func:`_plan`): made here where the rule needs it
        (a large plain causal or unmasked call: does the row-span kernel run it?), where the
        rule fires
        (auto will run it), and for explain's note; else when it runs, so that a decision
        auto passes over plans nothing. Inside ``torch.compile`` the custom op plans."""
        compiling = torch.compiler.is_compiling()
        reason = _refusal(call, compiling)
        if reason is not None:
            return Decision(self.name, reason)
        early = _kernel_sized(call, compiling) or decode.shaped(call)  # the rule reads its plan
        plan = _plan(call) if early else None
        rule = _rule(call, plan)
        spec = call.mask
        dense = spec is not None and spec.from_tensor  # planning reads the whole mask
        if plan is None and not compiling and (rule[0] or (call.explaining and not dense)):
            plan = _plan(call)
        note = self._note(call, plan) if call.explaining else None
        device = call.device_type
        described = None
        if device != "cpu":
            described = (
                "block-sparse online softmax: visits only non-empty blocks of a mask spec, "
                f"torch matmuls on tiles on {device} (no fused kernel), own backward (memory "
                "grows with L)"
            )
        return Decision(self.name, None, rule, mask_planning(call), plan, note, described)

    def run(
        self, call: AttentionCall, plan: BlockPlan | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if torch.compiler.is_compiling():  # one opaque op in the graph; it plans when it runs
            return compiled.run(call), None
        q, k, v, sinks = call.q, call.k, call.v, call.sinks
        plan = _plan(call) if plan is None else plan  # a decision that needed no plan
        upcast = _converts(call, plan)
        # grad mode first: under no_grad (a decode step) q, k, v are not asked for requires_grad
        sink_grad = sinks is not None and sinks.requires_grad
        if torch.is_grad_enabled() and (sink_grad or call.needs_grad):
            out: torch.Tensor = _BlockedAttention.apply(q, k, v, sinks, plan, call.scale, upcast)  # type: ignore[no-untyped-call]
            return out, None
        qc, kc, vc = _float32(q, k, v, upcast)
        out, lse = forward_with_lse(qc, kc, vc, mask=call.mask, scale=call.scale, plan=plan)
        return with_sinks(out, lse, sinks)[0].to(q.dtype), None

    def direct(
        self, call: AttentionCall, plan: BlockPlan | None = None
    ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor | None] | None:
        """The plan's kernel bound to the call's signature, where it has such an entry (the
        decode kernel): a decode step's later calls (every layer, every step with these sizes)
        run it directly (:mod:`attnkit.backends.memo`); the bound run returns ``None`` where
        the kernel saw NaN or inf."""
        if plan is None or plan.kernel is None:
            return None
        if call.sinks is not None or call.softcap is not None or call.return_weights:
            return None
        return plan.kernel.direct(call)

    def _note(self, call: AttentionCall, plan: BlockPlan | None) -> str:
        """The plan in one line, and what changes under ``torch.compile``, for
        :func:`attnkit.explain`."""
        reason = compiled.unsupported(call)
        if reason is not None:
            return f"{self._plan_note(call, plan)}; {reason}, so it cannot serve a compiled call"
        under_compile = f"under torch.compile the same, as one custom op ({compiled.OP})"
        if plan is not None and plan.kernel is not None:
            under_compile = plan.kernel.under_compile
        return f"{self._plan_note(call, plan)}; {under_compile}"

    def _plan_note(self, call: AttentionCall, plan: BlockPlan | None) -> str:
        prefix = ""
        if call.cpu_path is not None:
            how = "float32 copies of q, k, v" if call.upcast else f"q, k, v in {call.q.dtype}"
            prefix = f"{call.cpu_path} path: the kernels run on {how}; "
            note = _reads_note(call, plan)
            if note is not None:
                prefix = f"{call.cpu_path} path: {note}"
        if plan is not None and plan.decode is not None and not plan.decode.serves:
            prefix += f"the decode kernel does not run it ({plan.decode.reason}); "
        if plan is None or (call.mask is not None and call.mask.from_tensor):
            return prefix + (
                "a dense mask: its empty blocks are found when it runs (one pass over the mask)"
            )
        return prefix + self._kernels(call, plan)

    def _kernels(self, call: AttentionCall, plan: BlockPlan) -> str:
        q, k, v = call.q, call.k, call.v
        if _converts(call, plan):
            q, k, v = stand_in(q), stand_in(k), stand_in(v)
        if plan.kernel is not None:
            return plan.kernel.describe(call, q.dtype)
        sp = plan.spans
        prefix = "" if sp.lo is None else f"{sp.what} ({sp.reason}): "
        tiles = plan.tiles(q, k, v)
        L, S = call.dims.L, call.dims.S
        done = tiles.computed_pairs / tiles.maps
        full = 1.0 - tiles.empty_fraction - tiles.partial_fraction
        kernel = "matmul kernel"
        if fused(q, v):
            kernel = (
                "torch's fused flash kernel" if call.softcap is None else kernel + " (soft-cap)"
            )
        return prefix + (
            f"{len(tiles.calls)} kernel calls ({kernel}), tiles of {tiles.rows} rows; "
            f"{tiles.empty_fraction:.1%} of {tiles.grain}x{tiles.grain} blocks empty "
            f"({tiles.partial_fraction:.1%} partial, {full:.1%} full); "
            f"computes {done / max(L * S, 1):.1%} of the L x S pairs"
        )
