"""Ring attention: each rank holds a shard of the sequence; K/V blocks travel around the ring.

Dimension legend: B batch, H query heads, Hkv key/value heads, Lq / Sk this rank's query / key
tokens, L / S the whole sequence's (``P * Lq``, ``P * Sk``), Dk / Dv head dims, P ranks, r this
rank, s the step; ``u`` below is the size of one shard of K (or V).

Forward, on rank ``r``: at step ``s`` it holds the K/V shard of rank ``src = (r - s) % P``. It
posts the send of that shard to ``r + 1`` and the receive of the next one from ``r - 1``, then
computes its queries against the shard it holds while they travel (two receive buffers, used in
turn). Each (query chunk, key chunk) pair gives an output and its log-sum-exp; they are merged
in float32 (float64 for float64 inputs)::

    lse = logaddexp(lse_a, lse_b)
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

which is exact: the result is softmax over all keys. Attention sinks join each row's merged result
once, after the last step (:mod:`attnkit.distributed.ring_sinks`). A pair that the mask leaves empty
is not computed (with zigzag causal sharding every rank does the same work). The pairs run through
the blocked backend's block functions (:func:`attnkit.backends.blocked.forward_with_lse` and
:func:`~attnkit.backends.blocked.backward_from_lse`), given the chunks' global positions, so a mask
spec sees global indices and the empty blocks inside a pair are skipped too.

Heads are independent, so the ring runs once per group of heads (a *pass*, ``kv_heads_per_pass``
key/value heads with their query heads): every buffer below holds one group's heads only, which
is what keeps a rank's memory near ``1/P`` of one process for long sequences.

Backward: K/V go around the ring again, and with each K/V shard travels the float32 gradient
accumulator of that shard: each rank adds its queries' contribution and passes it on, so after
``P`` hops it comes back to the rank that owns the shard. Bytes sent per step of a pass, for
``g`` passes: ``2u/g`` forward, ``2u/g`` (K/V) + ``2u/g`` in float32 (dK/dV) backward.
The blocks' backward is given the final ``out`` and ``lse`` (the sinks included), so it is the
backward with the sinks; the sinks' own gradient is this rank's rows' part (per head, like every
replicated parameter's: summed over the ranks, it is the whole sequence's).
Where autograd records the backward (``create_graph=True``: a Hessian, a gradient penalty), the
gradients are recomputed differentiably instead (:mod:`attnkit.distributed.second_order`).
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx

from attnkit.backends.blocked import backward_from_lse, forward_with_lse, merge
from attnkit.backends.blocked.blocks import sinks_grad, with_sinks
from attnkit.backends.blocked.tiles import acc_dtype
from attnkit.cpu import path_for
from attnkit.distributed.faults import (
    TAG_DKV,
    TAG_KV,
    Peers,
    Pending,
    agree,
    as_timedelta,
    float_bits,
    mask_digest,
)
from attnkit.distributed.ring_plan import WHERE, RingPlan
from attnkit.distributed.ring_sinks import check_ring_sinks, sinks_digest
from attnkit.distributed.second_order import ring_grads
from attnkit.distributed.sharding import Chunk, Layout, group_rank_and_size
from attnkit.errors import AttentionInputError
from attnkit.mask_checks import check_mask
from attnkit.masks import MaskSpec, as_spec
from attnkit.validate import check_qkv, check_scalars

__all__ = ["ring_attention"]


def _like(kv: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(kv[0]), torch.empty_like(kv[1])


def _rows(t: torch.Tensor, c: Chunk) -> torch.Tensor:
    """The rows (dim -2) of a shard that hold chunk ``c``: a view."""
    return t.narrow(-2, c.local, c.length)


def _forward(
    plan: RingPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """All passes: out ``(B, H, Lq, Dv)`` and lse ``(B, H, Lq)`` in the accumulation dtype."""
    B, H, Lq, _ = q.shape
    acc = acc_dtype(q.dtype)
    out = torch.zeros(B, H, Lq, v.shape[-1], dtype=acc, device=q.device)  # (B, H, Lq, Dv)
    lse = torch.full((B, H, Lq), float("-inf"), dtype=acc, device=q.device)  # (B, H, Lq)
    for part in range(len(plan.kv_groups)):
        sub, qh, kh = plan.for_pass(part)
        _forward_pass(sub, q[:, qh], k[:, kh], v[:, kh], out[:, qh], lse[:, qh])
    return out, lse


def _forward_pass(
    plan: RingPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """One trip of one head group's K/V around the ring, merged into ``out`` and ``lse``."""
    cur = (k.contiguous(), v.contiguous())  # (B, Hkv', Sk, D): the K/V shard held this step
    spare: tuple[torch.Tensor, torch.Tensor] | None = None
    for s in range(plan.world):
        src = (plan.rank - s) % plan.world
        clock = (time.process_time(), time.perf_counter())
        works: list[Pending] = []
        nxt = cur
        sent: tuple[torch.Tensor, ...] = ()
        if s < plan.world - 1:  # pass the shard on while computing with it
            nxt = spare if spare is not None else _like(cur)
            works, sent = plan.post(cur, nxt, TAG_KV), cur
        todo, skipped = plan.pairs(src)
        for qc, kc in todo:
            o, lse_o = forward_with_lse(
                _rows(q, qc),
                _rows(cur[0], kc),
                _rows(cur[1], kc),
                **plan.at(qc, kc, q),
            )
            merge(_rows(out, qc), lse.narrow(-1, qc.local, qc.length), o, lse_o)
        wait_s = plan.wait(
            works,
            f"receiving the K/V shard of rank {(src - 1) % plan.world} (forward step "
            f"{s + 1} of {plan.world})",
        )
        plan.record("forward", s, clock, wait_s, sent, len(todo), skipped)
        spare = cur if s > 0 else None  # step 0's shard is the caller's k/v: never overwritten
        cur = nxt


def _backward(
    plan: RingPlan, saved: tuple[torch.Tensor, ...], dout: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All passes, from what the forward saved ``(q, k, v, out, lse)``: dq, dk, dv in the
    accumulation dtype."""
    q, k, v, out, lse = saved
    acc = acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)  # (B, H, Lq, Dk)
    if len(plan.kv_groups) == 1:
        dk, dv = _backward_pass(plan, saved, dout, dq)
        return dq, dk, dv
    dk = torch.empty(k.shape, dtype=acc, device=k.device)  # (B, Hkv, Sk, Dk)
    dv = torch.empty(v.shape, dtype=acc, device=v.device)  # (B, Hkv, Sk, Dv)
    for part in range(len(plan.kv_groups)):
        sub, qh, kh = plan.for_pass(part)
        group = (q[:, qh], k[:, kh], v[:, kh], out[:, qh], lse[:, qh])
        dk_g, dv_g = _backward_pass(sub, group, dout[:, qh], dq[:, qh])
        dk[:, kh].copy_(dk_g)
        dv[:, kh].copy_(dv_g)
        del dk_g, dv_g
    return dq, dk, dv


def _backward_pass(
    plan: RingPlan, saved: tuple[torch.Tensor, ...], dout: torch.Tensor, dq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One trip of one head group's K/V (and their gradients) around the ring; adds into
    ``dq`` and returns this rank's dk, dv of the group."""
    q, k, v, _, _ = saved
    acc = acc_dtype(q.dtype)
    world = plan.world
    cur = (k.contiguous(), v.contiguous())
    spare: tuple[torch.Tensor, torch.Tensor] | None = None
    sending: list[Pending] = []  # the dK/dV sent at the end of the last step, in flight

    def accumulator() -> tuple[torch.Tensor, torch.Tensor]:
        return (
            torch.empty(k.shape, dtype=acc, device=k.device),
            torch.empty(v.shape, dtype=acc, device=v.device),
        )

    dkv = accumulator()
    for s in range(world):
        src = (plan.rank - s) % world
        clock = (time.process_time(), time.perf_counter())
        # dK/dV of shard `src` so far, from the ranks before this one, arriving from rank r - 1
        # (posted before the K/V exchange: NCCL pairs p2p messages in issue order)
        if s == 0:
            dkv[0].zero_()
            dkv[1].zero_()
            incoming = []
        else:
            dkv = accumulator()
            incoming = plan.post((), dkv, TAG_DKV)
        works: list[Pending] = []
        nxt = cur
        sent_kv: tuple[torch.Tensor, ...] = ()
        if s < world - 1:
            nxt = spare if spare is not None else _like(cur)
            works, sent_kv = plan.post(cur, nxt, TAG_KV), cur
        # the last step's dK/dV has left once rank r + 1 has started this step: free it now,
        # before the compute needs memory (its receive is posted before any wait: no cycle)
        wait_s = plan.wait(sending, f"sending dK/dV (backward step {s} of {world})")
        sending = []
        todo, skipped = plan.pairs(src)
        why = f"receiving the dK/dV of rank {src}'s shard (backward step {s + 1} of {world})"
        wait_s = _backward_pairs(plan, saved, dout, dq, cur, dkv, todo, incoming, why, wait_s)
        # on to r + 1; the last hop reaches the owner (in a group of one, it is home already)
        if world > 1:
            sending = plan.post(dkv, (), TAG_DKV)
        wait_s += plan.wait(
            works,
            f"receiving the K/V shard of rank {(src - 1) % world} (backward step {s + 1} of "
            f"{world})",
        )
        sent = (*sent_kv, *dkv) if world > 1 else ()
        plan.record("backward", s, clock, wait_s, sent, len(todo), skipped)
        spare = cur if s > 0 else None
        cur = nxt
    if world == 1:
        return dkv[0], dkv[1]
    del cur, nxt, spare  # the K/V buffers are done with; `dkv` stays alive until sent
    mine = accumulator()  # this rank's own dK/dV, after visiting every rank
    final = plan.post((), mine, TAG_DKV)
    plan.wait(final, f"receiving the finished dK/dV of this rank's shard from rank {plan.prev}")
    plan.wait(sending, f"sending dK/dV (backward step {world} of {world})")
    del dkv
    return mine[0], mine[1]


def _backward_pairs(
    plan: RingPlan,
    saved: tuple[torch.Tensor, ...],
    dout: torch.Tensor,
    dq: torch.Tensor,
    cur: tuple[torch.Tensor, torch.Tensor],
    dkv: tuple[torch.Tensor, torch.Tensor],
    todo: list[tuple[Chunk, Chunk]],
    incoming: list[Pending],
    why: str,
    wait_s: float,
) -> float:
    """One backward step's (query chunk, key chunk) pairs against the K/V shard ``cur``: adds
    into ``dq`` and, once the ``incoming`` accumulator has arrived (waited on, as ``why``,
    before the first add or at the end), into ``dkv``; returns ``wait_s`` plus the seconds
    waited."""
    q, _, _, out, lse = saved
    for qc, kc in todo:
        dq_c, dk_c, dv_c = backward_from_lse(
            _rows(q, qc),
            _rows(cur[0], kc),
            _rows(cur[1], kc),
            _rows(out, qc),
            _rows(dout, qc),
            lse.narrow(-1, qc.local, qc.length),
            **plan.at(qc, kc, q),
        )
        _rows(dq, qc).add_(dq_c)
        if incoming:  # the accumulator must have arrived before adding to it
            wait_s += plan.wait(incoming, why)
            incoming = []
        _rows(dkv[0], kc).add_(dk_c)
        _rows(dkv[1], kc).add_(dv_c)
    return wait_s + plan.wait(incoming, why)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None,
        plan: RingPlan,
    ) -> torch.Tensor:
        out, lse = with_sinks(*_forward(plan, q, k, v), sinks)  # the sinks join once, here
        ctx.plan = plan  # type: ignore[attr-defined]
        ctx.save_for_backward(q, k, v, out, lse, sinks)  # type: ignore[arg-type]  # None is kept
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: FunctionCtx, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, sinks = ctx.saved_tensors  # type: ignore[attr-defined]
        needs = ctx.needs_input_grad  # type: ignore[attr-defined]
        if torch.is_grad_enabled():  # create_graph=True: gradients autograd can differentiate
            return (*ring_grads(ctx.plan, (q, k, v, sinks), dout, needs), None)  # type: ignore[attr-defined]
        dq, dk, dv = _backward(ctx.plan, (q, k, v, out, lse), dout)  # type: ignore[attr-defined]
        dsinks = sinks_grad(sinks, out, dout, lse) if sinks is not None and needs[3] else None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, None


#: bytes of one pass's K and V shards (per rank) that the default ``kv_heads_per_pass`` aims at
PASS_BYTES = 4 << 20


def _kv_heads_per_pass(requested: int | None, k: torch.Tensor, v: torch.Tensor) -> int:
    Hkv = k.shape[1]
    if requested is not None:
        bad = isinstance(requested, bool) or not isinstance(requested, int)
        if bad or not 1 <= requested <= Hkv:
            raise AttentionInputError(
                WHERE,
                "kv_heads_per_pass",
                f"it must be a number of key/value heads from 1 to the {Hkv} there are.",
                got=f"kv_heads_per_pass={requested!r}  k (B, Hkv={Hkv}, Sk, Dk)",
                expected=f"an int in 1..{Hkv} (or None for the default)",
                fix="pass kv_heads_per_pass=1 for the least memory, None to let attnkit choose",
            )
        return requested
    per_head = (k[:, :1].numel() * k.element_size()) + (v[:, :1].numel() * v.element_size())
    return max(1, min(Hkv, -(-PASS_BYTES // max(per_head, 1))))


def _make_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: MaskSpec | None,
    causal: bool,
    scale: float | None,
    group: dist.ProcessGroup | None,
    timeout: float | timedelta | None,
    kv_heads_per_pass: int | None,
    sinks: torch.Tensor | None,
) -> RingPlan:
    """Check :func:`ring_attention`'s arguments, agree on them with the other ranks (the same
    shapes, dtype and settings everywhere) and return the plan of the ring."""
    if isinstance(mask, torch.Tensor):
        raise AttentionInputError(
            WHERE,
            "mask",
            "ring attention takes mask specs, not dense tensors (an L x S mask is what "
            "sharding avoids).",
            got=f"mask: tensor {tuple(mask.shape)} {mask.dtype}",
            expected="None or a spec from attnkit.masks over the whole sequence",
            fix="attnkit.masks.padding(lengths), key_mask(keep), document(ids), "
            "sliding_window(n), combined with & and |",
        )
    rank, world = group_rank_and_size(group, WHERE)
    dims = check_qkv(q, k, v, where=WHERE)
    check_mask(mask, q, dims, where=WHERE, key_shards=world)  # a spec over every shard's keys
    check_scalars(dims, where=WHERE, causal=causal, scale=scale)
    check_ring_sinks(sinks, q, dims, world, WHERE)
    path_for(q, WHERE)  # a bad ATTNKIT_CPU_PATH is refused here as in attention()
    td = as_timedelta(timeout, WHERE)
    if causal and (dims.L % 2 or dims.S % 2):
        raise AttentionInputError(
            WHERE,
            "q" if dims.L % 2 else "k",
            "causal ring attention takes the zigzag layout (two equal chunks per rank), but "
            "this shard has an odd length.",
            got=f"q (Lq={dims.L})  k (Sk={dims.S})",
            expected="even shard lengths, as attnkit.distributed.shard(x, causal=True) makes",
            fix="shard with shard(x, causal=True), padding the sequence to a multiple of "
            "2 * world size",
        )
    scale_f = float(scale) if scale is not None else dims.Dk**-0.5
    per_pass = _kv_heads_per_pass(kv_heads_per_pass, k, v)
    settings = {
        "causal": int(causal),
        "scale": float_bits(scale_f),
        "mask": mask_digest(mask),  # its content: rule and tensor bytes, not its repr
        "kv_heads_per_pass": per_pass,
        "sinks": sinks_digest(sinks),  # per head: their values; per token: that there are some
    }
    shapes = [("q", tuple(q.shape)), ("k", tuple(k.shape)), ("v", tuple(v.shape))]
    agree(
        Peers(group, rank, world, td, WHERE),
        shapes,
        extra=settings,
        dtype=q.dtype,
        device=q.device,
        local={"mask": repr(mask)} if mask is not None else None,
    )
    spec = as_spec(mask, causal)  # the one place the causal flag and a mask combine
    plan = RingPlan(
        group,
        rank,
        world,
        td,
        Layout(world, dims.L, causal),
        Layout(world, dims.S, causal),
        spec,
        scale_f,
        tuple((h, min(h + per_pass, dims.Hkv)) for h in range(0, dims.Hkv, per_pass)),
        dims.H // dims.Hkv,
    )
    return plan


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: MaskSpec | None = None,
    causal: bool = False,
    scale: float | None = None,
    group: dist.ProcessGroup | None = None,
    timeout: float | timedelta | None = None,
    kv_heads_per_pass: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention over a sequence split across the ranks of ``group``; forward and backward.

    Each rank passes its shard (dim -2) as :func:`~attnkit.distributed.shard` makes it, with the
    same ``causal``, and gets its shard of the output; the result equals
    :func:`attnkit.attention` on the whole sequence, shard by shard.

    Args:
        q: this rank's queries ``(B, H, Lq, Dk)``; the whole sequence has ``L = P * Lq``.
        k: this rank's keys ``(B, Hkv, Sk, Dk)``, ``S = P * Sk``; ``H % Hkv == 0``: query head
            ``h`` uses key/value head ``h // (H // Hkv)`` (K/V are not repeated).
        v: this rank's values ``(B, Hkv, Sk, Dv)``.
        mask: ``None`` or a spec from :mod:`attnkit.masks` over the *whole* sequence (global
            positions: ``padding(lengths)`` takes the full lengths, ``document(ids)`` the ids of
            all ``S`` tokens, ``selected_keys(indices)`` one row per query of the whole
            sequence and global key positions: each pair of chunks runs the gather kernel on
            its rows and keys), the same on every rank. Dense tensor masks are refused (they
            would be ``L x S``).
        causal: the end-aligned causal rule (query ``i`` sees keys ``j <= i + S - L``), and the
            zigzag layout of ``shard(x, causal=True)``, which gives every rank the same work.
            For ``L = S = 4`` over 2 ranks (chunks of 1 token; rank 0 holds 0 and 3, rank 1
            holds 1 and 2)::

                1 . . .     rank 0, query 0
                1 1 . .     rank 1, query 1
                1 1 1 .     rank 1, query 2
                1 1 1 1     rank 0, query 3

        scale: multiplies ``q @ k^T``; default ``1 / sqrt(Dk)``.
        group: the process group (default: the world).
        timeout: seconds (or a timedelta) a rank waits for another before raising
            :class:`~attnkit.distributed.RingError`; default
            :data:`~attnkit.distributed.faults.DEFAULT_TIMEOUT`.
        kv_heads_per_pass: how many key/value heads (with their query heads) go around the
            ring at once. Heads are independent, so the ring runs once per group of heads and
            its buffers (the K/V in flight, the dK/dV travelling with them) shrink with the
            group. Default: the fewest heads whose K and V shards reach
            :data:`PASS_BYTES` (one head at a time for long sequences, all heads at once for
            short ones, where a message's latency would dominate).
        sinks: attention sinks, as in :func:`attnkit.attention`: ``(H,)``, the same on every
            rank (gpt-oss), or this rank's query rows' ``(B, H, Lq)`` / ``(1, H, Lq)``. They
            join each row's softmax once, after the merge over every key shard. The gradient
            of ``(H,)`` sinks is this rank's rows' part, as for every replicated parameter:
            summed over the ranks (``dist.all_reduce``) it is the whole sequence's.

    Returns:
        This rank's output shard ``(B, H, Lq, Dv)`` in q's dtype. Rows with nothing to attend
        to are 0, with gradient 0.

    Every rank must call it (and run its backward) with equal shard shapes and the same dtype,
    ``causal``, ``scale``, ``kv_heads_per_pass``, sinks (per head: their values) and mask: the
    mask's content, rule and tensor bytes (:meth:`~attnkit.masks.MaskSpec.digest`), not only its
    repr. Before any K/V moves the ranks compare them; any difference raises
    :class:`~attnkit.AttentionInputError` on every rank, naming what differs, which ranks hold which
    value, and the fix.

    >>> # on each of 4 ranks (torchrun --nproc-per-node 4):
    >>> # q, k, v = (shard(t, causal=True) for t in (q_full, k_full, v_full))
    >>> # out = ring_attention(q, k, v, causal=True)     # == shard(attention(..., causal=True))
    """
    plan = _make_plan(q, k, v, mask, causal, scale, group, timeout, kv_heads_per_pass, sinks)
    out: torch.Tensor = _RingAttention.apply(q, k, v, sinks, plan)  # type: ignore[no-untyped-call]
    return out
