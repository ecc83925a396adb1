"""One (query slice, key slice) block of attention with its log-sum-exp: the ``blocked``
backend's forward and backward, public because ring attention merges them across devices.

Dimension legend: B batch, H query heads, Hkv key/value heads, Lq query rows of the block, Sk
keys of the block, Dk query/key head dim, Dv value head dim.

:func:`plan_blocks` decides, once per call, how a block runs: attnkit's row-span kernel
(:mod:`~attnkit.backends.blocked.rowspan`) when the mask allows one run of keys per query row
(:func:`attnkit.masks.row_spans`: causal, windows, documents, prefix-LM, contiguous padding, at
the block's global positions) and the kernel takes the tensors, else tiles of torch's fused
kernel over the non-empty blocks of the mask (:mod:`~attnkit.backends.blocked.plan`, cached per
spec key, sizes and config). A mask of two parts side by side over the keys
(:func:`~attnkit.masks.concat_keys`) whose rows are not one run of keys (a decoder's own keys
up to the row, then the encoder's) runs as two blocks, one per part, each with its own
decision, merged with the log-sum-exp rule (:class:`SplitKeys`), where that gives a part the
row-span kernel. :func:`forward_with_lse`, :func:`backward_from_lse` and ``explain`` read
that decision.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

import attnkit.backends.blocked.rowspan as rowspan
import attnkit.backends.blocked.tiles as tiles
from attnkit.backends.blocked.config import current
from attnkit.backends.blocked.decode import DecodePlan
from attnkit.backends.blocked.kernels import OP, Direct, KernelPlan
from attnkit.backends.blocked.plan import Plan, make_plan
from attnkit.backends.blocked.rowspan import SpanPlan
from attnkit.backends.blocked.rowspan_kernel import RowSpanKernel
from attnkit.call import sink_rows
from attnkit.masks import MaskSpec
from attnkit.masks.concat import ConcatKeys

if TYPE_CHECKING:
    from attnkit.call import AttentionCall

__all__ = [
    "WHOLE",
    "BlockAt",
    "BlockPlan",
    "SplitKeys",
    "backward_from_lse",
    "clear_plans",
    "converts",
    "forward_with_lse",
    "plan_blocks",
    "plan_on_path",
    "stand_in",
]

_PLANS: OrderedDict[Hashable, Plan] = OrderedDict()


def clear_plans() -> None:
    """Forget every cached tile plan (and the row-span kernel's cached runs, and the decisions
    the dispatcher kept, which hold plans: :mod:`attnkit.backends.memo`)."""
    from attnkit.backends import memo

    _PLANS.clear()
    rowspan.clear_runs()
    memo.clear()


@dataclass(frozen=True)
class BlockPlan:
    """How one block runs: the kernel chosen when the plan was built (``kernel``: the row-span,
    decode or gather kernel, :mod:`~attnkit.backends.blocked.kernels`), else tiles
    (:meth:`tiles`). ``spans`` is the row-span kernel's decision (its runs of keys, or why it
    does not run the call), and for a decode-shaped call of the blocked backend ``decode`` the
    decode kernel's (:mod:`~attnkit.backends.blocked.decode`): what auto's rule and explain
    read of the kernels that were asked."""

    mask: MaskSpec | None
    q_start: int
    k_start: int
    off: int  #: ``S_total - L_total``: the end-aligned offset of the whole sequence
    spans: SpanPlan
    softcap: float | None = None  #: logit soft-cap ``c``: scores become ``c tanh(s / c)``
    decode: DecodePlan | None = None  #: the decode kernel's decision (decode-shaped calls)
    #: the kernel that runs the forward and the backward (``None``: the tiles)
    kernel: KernelPlan | None = None

    @property
    def checks_finite(self) -> bool:
        """The plan's kernel reports NaN/inf itself (:func:`forward_with_lse` raises
        :class:`~attnkit.backends.nonfinite.NonFinite` while
        :func:`~attnkit.backends.nonfinite.reporting`); read by
        :func:`attnkit.backends.nonfinite.serve`, which then sums nothing first."""
        return self.kernel is not None and self.kernel.checks_finite

    def tiles(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, backward: bool = False
    ) -> Plan:
        """The tile plan for these tensors (cached when the spec has a key)."""
        cfg = current()
        B, H, L, Dk = q.shape
        Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[3]
        skey = self.mask.key() if self.mask is not None else ()
        key: Hashable = (cfg, skey, L, S, self.q_start, self.k_start, self.off)
        key = (key, B, H, Hkv, Dk, Dv, q.device, backward)
        if skey is not None and key in _PLANS:
            _PLANS.move_to_end(key)
            return _PLANS[key]
        plan = make_plan(
            self.mask,
            L=L,
            S=S,
            q_start=self.q_start,
            k_start=self.k_start,
            off=self.off,
            batch=B,
            heads=H,
            pair_flops=(5.0 if backward else 2.0) * B * H * (Dk + Dv),
            key_bytes=cfg.backward_key_bytes * B * Hkv * (Dk + Dv) if backward else 0.0,
            device=q.device,
            cfg=cfg,
        )
        if skey is not None:
            _PLANS[key] = plan
            while len(_PLANS) > cfg.plan_cache_size:
                _PLANS.popitem(last=False)
        return plan


@dataclass(frozen=True)
class BlockAt:
    """Where a block sits in the whole attention: its first query and first key are at global
    positions ``q_start`` and ``k_start`` of ``L_total`` queries and ``S_total`` keys
    (``None``: the block's own length). The default, :data:`WHOLE`, is a block that is the whole
    attention."""

    q_start: int = 0
    k_start: int = 0
    L_total: int | None = None
    S_total: int | None = None


#: the block that is the whole attention
WHOLE = BlockAt()


def plan_blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: MaskSpec | None,
    at: BlockAt = WHOLE,
    softcap: float | None = None,
    in_dtype: bool = False,
    dot: bool = False,
) -> BlockPlan:
    """Decide how the block of ``q`` against ``k``/``v`` at ``at`` runs (see the module
    docstring).

    ``in_dtype=True`` lets the row-span kernel read bfloat16/float16 tensors directly, and the
    forward and backward then return out, dq, dk, dv in that dtype (see
    :func:`~attnkit.backends.blocked.rowspan.plan`); by default such tensors go to the tiles.
    ``dot=True`` (the ``native`` CPU path) lets it take bfloat16 only where its AVX512-BF16
    build multiplies it with the CPU's bf16 dot products."""
    L, S = q.shape[2], k.shape[2]
    q_start, k_start = at.q_start, at.k_start
    off = (S if at.S_total is None else at.S_total) - (L if at.L_total is None else at.L_total)
    decision = rowspan.plan(
        mask, q, k, v, q_start=q_start, k_start=k_start, off=off, in_dtype=in_dtype, dot=dot
    )
    kernel: KernelPlan | None = RowSpanKernel(decision, softcap) if decision.serves else None
    if kernel is None:
        whole = BlockAt(q_start, k_start, L if at.L_total is None else at.L_total,
                        S if at.S_total is None else at.S_total)  # fmt: skip
        kernel = _split_keys(q, k, v, mask, whole, softcap, (in_dtype, dot))
    return BlockPlan(mask, q_start, k_start, off, decision, softcap, kernel=kernel)


def _split_keys(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: MaskSpec | None,
    at: BlockAt,
    softcap: float | None,
    reads: tuple[bool, bool],
) -> SplitKeys | None:
    """Two blocks for a block whose keys straddle the two parts of a
    :func:`~attnkit.masks.concat_keys` mask: each part's keys as an attention of their own,
    under that part's rule, over that part's keys (``S1`` or ``S2`` of them, where this
    block's lie), where a part gets a kernel (the row-span kernel: its rows are one run of
    keys); ``None`` otherwise (the tiles run the whole block). A block inside one part needs
    no split: the whole mask's runs there are that part's."""
    if not isinstance(mask, ConcatKeys):
        return None
    S, S1 = k.shape[2], int(mask.S1)
    cut = min(max(S1 - at.k_start, 0), S)
    if cut in (0, S):
        return None
    first = plan_blocks(
        q, k[:, :, :cut], v[:, :, :cut], mask.first,
        replace(at, S_total=S1), softcap, *reads,
    )  # fmt: skip
    second = plan_blocks(
        q, k[:, :, cut:], v[:, :, cut:], mask.second,
        replace(at, k_start=at.k_start + cut - S1, S_total=int(mask.S2)), softcap, *reads,
    )  # fmt: skip
    if first.kernel is None and second.kernel is None:
        return None
    return SplitKeys(cut, (first, second))


@dataclass(frozen=True)
class SplitKeys:
    """A block of a :func:`~attnkit.masks.concat_keys` mask as two blocks: keys ``[0, cut)``
    (the first part's) and ``[cut, S)`` (the second's), each with its own plan (``parts``: the
    part's rule over the part's keys),
    merged with the log-sum-exp rule; the backward sums the parts' ``dq`` and joins their
    ``dk``/``dv`` (each part's backward from the merged ``out`` and ``lse``, as
    :func:`backward_from_lse` says). A :class:`~attnkit.backends.blocked.kernels.KernelPlan`."""

    cut: int
    parts: tuple[BlockPlan, ...]

    #: the kernel in explain's words
    name = "a split of the concatenated keys"
    #: a compiled call runs the same inside the custom op
    under_compile = f"under torch.compile the same, as one custom op ({OP})"

    @property
    def checks_finite(self) -> bool:
        """Every part's kernel reports NaN/inf itself."""
        return all(p.checks_finite for p in self.parts)

    def _keys(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return t[:, :, : self.cut], t[:, :, self.cut :]

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``out (B, H, L, Dv)`` and ``lse (B, H, L)`` in ``lse``'s dtype (float32; float64
        for float64 q): the parts' results merged."""
        (k1, k2), (v1, v2) = self._keys(k), self._keys(v)
        out, lse = forward_with_lse(q, k1, v1, mask=None, scale=scale, plan=self.parts[0])
        o2, lse2 = forward_with_lse(q, k2, v2, mask=None, scale=scale, plan=self.parts[1])
        out = out.to(lse.dtype, copy=True)  # merged in place, in the accumulation dtype
        tiles.merge(out, lse, o2.to(lse.dtype, copy=True), lse2.to(lse.dtype))
        return out, lse

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
        """``dq``, ``dk``, ``dv`` in the wider of the parts' dtypes of them."""
        (k1, k2), (v1, v2) = self._keys(k), self._keys(v)
        first, second = self.parts
        dq, dk1, dv1 = backward_from_lse(
            q, k1, v1, out, dout, lse, mask=None, scale=scale, plan=first
        )
        dq2, dk2, dv2 = backward_from_lse(
            q, k2, v2, out, dout, lse, mask=None, scale=scale, plan=second
        )
        wide = torch.promote_types(dq.dtype, dq2.dtype)  # a part's kernel may give bf16
        dk = torch.cat([dk1.to(wide), dk2.to(wide)], dim=2)
        dv = torch.cat([dv1.to(wide), dv2.to(wide)], dim=2)
        return dq.to(wide) + dq2.to(wide), dk, dv

    def describe(self, call: AttentionCall, dtype: torch.dtype) -> str:
        """Where the keys are split, and what runs each part."""
        names = [p.kernel.name if p.kernel is not None else "tiles" for p in self.parts]
        return (
            f"keys split at {self.cut} (the two parts of concat_keys): "
            f"keys before it on {names[0]}, the rest on {names[1]}, merged by log-sum-exp"
        )

    def reads_note(self, dtype: torch.dtype, upcast: bool) -> str | None:
        """``None``: it takes what the path gives every kernel."""
        return None

    def direct(self, call: AttentionCall) -> Direct | None:
        """None: every call goes the whole way."""
        return None

    def needs_float32(self, dtype: torch.dtype) -> bool:
        """Where a part's kernel reads ``dtype`` only as float32 copies."""
        return any(p.kernel is not None and p.kernel.needs_float32(dtype) for p in self.parts)


def stand_in(t: torch.Tensor) -> torch.Tensor:
    """A float32 tensor of ``t``'s shape and device that allocates one element: what planning
    reads (shape, dtype, device) for a tensor that ``fp32-upcast`` converts when it runs."""
    return torch.zeros((), dtype=torch.float32, device=t.device).expand(t.shape)


def plan_on_path(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: MaskSpec | None,
    softcap: float | None,
    upcast: bool,
    native: bool,
) -> BlockPlan:
    """The row-span kernel's or the tiles' plan of a whole call on its CPU path
    (:mod:`attnkit.cpu`), for the blocked backend and its compiled op alike. On ``fp32-upcast``
    (``upcast``): the row-span kernel on the input-dtype tensors where it serves them, else the
    plan for the float32 copies that the call then converts to (:func:`converts`; the same
    plan where the mask has no runs of keys: tiles are planned from shapes only). On ``native``:
    the kernel's AVX512-BF16 build on bfloat16 where it serves, else torch's kernels on the
    tensors as they are (the plan says why not). Elsewhere the plan of the tensors as they
    are."""
    if upcast or native:
        direct = plan_blocks(q, k, v, mask, softcap=softcap, in_dtype=True, dot=native)
        # tiles alone (no kernel, no runs of keys) are planned from shapes: the same for the
        # copies; a kernel that does not read the dtype (a split's parts) is planned for them
        if native or direct.spans.serves or (direct.kernel is None and direct.spans.lo is None):
            return direct
        q, k, v = stand_in(q), stand_in(k), stand_in(v)
    return plan_blocks(q, k, v, mask, softcap=softcap)


def converts(plan: BlockPlan, dtype: torch.dtype, upcast: bool) -> bool:
    """Whether a call of ``dtype`` runs ``plan`` on float32 copies: on ``fp32-upcast``
    (``upcast``), unless the plan's kernel reads q, k, v as they are
    (:meth:`~attnkit.backends.blocked.kernels.KernelPlan.reads_note`); on any path where the
    plan's kernel reads ``dtype`` only as float32
    (:meth:`~attnkit.backends.blocked.kernels.KernelPlan.needs_float32`)."""
    if plan.kernel is not None and plan.kernel.needs_float32(dtype):
        return True
    return upcast and (plan.kernel is None or plan.kernel.reads_note(dtype, upcast) is None)


def forward_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: MaskSpec | None,
    scale: float,
    at: BlockAt = WHOLE,
    plan: BlockPlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a slice of queries against a slice of keys, with its log-sum-exp.

    Args:
        q: ``(B, H, Lq, Dk)``, the queries at global positions ``at.q_start ..
            at.q_start + Lq - 1`` of a sequence of ``at.L_total`` queries (default ``Lq``).
        k: ``(B, Hkv, Sk, Dk)``, the keys at global positions ``at.k_start ..`` of
            ``at.S_total`` (default ``Sk``). ``H % Hkv == 0``; K/V are never repeated per query
            head.
        v: ``(B, Hkv, Sk, Dv)``.
        mask: a spec from :mod:`attnkit.masks` evaluated at the *global* positions with
            ``off = S_total - L_total`` (end-aligned, as everywhere in attnkit), or ``None``.
        at: where the block sits (:class:`BlockAt`; default: the block is the whole attention).
        scale: multiplies ``q @ k^T``.
        plan: the decision of :func:`plan_blocks` for these arguments, when already made
            (a soft-cap is part of the plan: ``plan_blocks(..., softcap=c)``).

    Returns:
        ``out (B, H, Lq, Dv)`` and ``lse (B, H, Lq)``, both float32 (float64 when q is
        float64; ``out`` in q's dtype where a plan made with ``in_dtype=True`` runs the
        row-span kernel on bfloat16/float16): the softmax over this block's keys only. A row
        with no allowed key here has ``out`` 0 and ``lse`` ``-inf``. Partial results merge
        exactly (:func:`attnkit.backends.blocked.tiles.merge`)::

            lse = torch.logaddexp(lse1, lse2)
            out = out1 * (lse1 - lse).exp()[..., None] + out2 * (lse2 - lse).exp()[..., None]

    Inputs are not validated (call :func:`attnkit.attention` for that); no autograd graph is
    built.

    >>> q = torch.randn(1, 4, 8, 16); k = v = torch.randn(1, 2, 8, 16)
    >>> out, lse = forward_with_lse(q, k, v, mask=None, scale=0.25)
    >>> out.shape, lse.shape
    (torch.Size([1, 4, 8, 16]), torch.Size([1, 4, 8]))
    """
    p = plan or plan_blocks(q, k, v, mask, at)
    if p.kernel is not None:
        return p.kernel.forward(q, k, v, float(scale))
    with torch.no_grad():
        return tiles.forward(p.tiles(q, k, v), q, k, v, scale, p.softcap)


def backward_from_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    *,
    mask: MaskSpec | None,
    scale: float,
    at: BlockAt = WHOLE,
    plan: BlockPlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one (query slice, key slice) block, given the *final* output and lse.

    The flash-attention backward: ``P = exp(q @ k^T * scale - lse)`` on allowed pairs,
    ``dP = dout @ v^T``, ``D = rowsum(dout * out)``, ``dS = P * (dP - D)``; then
    ``dq = dS @ k * scale``, ``dk = dS^T @ q * scale``, ``dv = P^T @ dout``. With the globally
    merged ``out (B, H, Lq, Dv)`` and ``lse (B, H, Lq)`` (``-inf`` where a row sees nothing
    anywhere), the gradients of all blocks sum to the gradients of the whole attention.
    ``mask``, ``scale``, ``at`` and ``plan`` as in :func:`forward_with_lse`.

    Returns:
        ``dq (B, H, Lq, Dk)``, ``dk (B, Hkv, Sk, Dk)``, ``dv (B, Hkv, Sk, Dv)`` in float32
        (float64 for float64 q; q's dtype where a plan made with ``in_dtype=True`` runs the
        row-span kernel on bfloat16/float16 q, k, v, out, dout); ``dk``/``dv`` are summed over
        the query heads of each key/value head.

    >>> q = torch.randn(1, 4, 8, 16); k = v = torch.randn(1, 2, 8, 16)
    >>> out, lse = forward_with_lse(q, k, v, mask=None, scale=0.25)
    >>> dq, dk, dv = backward_from_lse(q, k, v, out, torch.ones_like(out), lse,
    ...                                mask=None, scale=0.25)
    >>> dk.shape
    torch.Size([1, 2, 8, 16])
    """
    p = plan or plan_blocks(q, k, v, mask, at)
    if p.kernel is not None:
        done = p.kernel.backward(q, k, v, out, dout, lse, float(scale))
        if done is not None:
            return done
    with torch.no_grad():
        tile_plan = p.tiles(q, k, v, backward=True)
        return tiles.backward(tile_plan, (q, k, v, out, lse), dout, scale, p.softcap)


def with_sinks(
    out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Join the sinks to their rows' softmax denominators (``sinks (H,)``: one logit per head
    for every row; ``(B, H, L)`` or ``(1, H, L)``: one per row and head): ``lse`` becomes
    ``logaddexp(lse, sink)`` and ``out`` shrinks by ``exp(lse - new)`` (a sink adds no value; a
    row that saw no key stays 0). The blocks' backward from the new ``lse`` is then the
    backward with the sinks; their own gradient is :func:`sinks_grad`."""
    if sinks is None:
        return out, lse
    new = torch.logaddexp(lse, sink_rows(sinks).to(lse.dtype))  # (B, H, L)
    return out * torch.exp(lse - new).unsqueeze(-1), new


def sinks_grad(
    sinks: torch.Tensor, out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor
) -> torch.Tensor:
    """The sinks' gradient, of their shape: ``-P_sink * D`` per row, ``P_sink = exp(sink -
    lse)``, ``D = rowsum(dout * out)`` (``out``, ``lse`` as :func:`with_sinks` returned them),
    summed over the rows a sink serves (all rows of its head for ``(H,)``, the batch for
    ``(1, H, L)``)."""
    D = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)  # (B, H, L)
    rows = sink_rows(sinks)
    p_sink = torch.exp(rows.to(lse.dtype) - lse)  # (B, H, L)
    return (-(p_sink * D)).sum_to_size(rows.shape).reshape(sinks.shape).to(sinks.dtype)
