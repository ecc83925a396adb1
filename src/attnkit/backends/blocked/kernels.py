"""The kernels of the ``blocked`` backend that run a whole call (not block by block), as plans
of one interface: a new kernel is one more implementation of :class:`KernelPlan`, not a branch
in every consumer of :class:`~attnkit.backends.blocked.blocks.BlockPlan`.

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
Dk / Dv head dims.

A plan's kernel is chosen once, when the plan is built, and kept as ``BlockPlan.kernel``
(``None``: the tiles run the call). A :class:`KernelPlan` says how its kernel runs the forward
(``out``, ``lse``) and the backward (``dq``, ``dk``, ``dv``) of the blocks' contract
(:func:`~attnkit.backends.blocked.blocks.forward_with_lse`,
:func:`~attnkit.backends.blocked.blocks.backward_from_lse`), whether it reports NaN/inf itself
(``checks_finite``), what explain prints (``describe``, ``reads_note``, ``under_compile``), and
how a decode step's later calls run it directly (``direct``). The implementations: the
row-span kernel (:class:`~attnkit.backends.blocked.rowspan_kernel.RowSpanKernel`), the decode
kernel (:class:`~attnkit.backends.blocked.decode.DecodePlan`) and the gather kernel of
:func:`attnkit.masks.selected_keys` (:class:`~attnkit.backends.blocked.gather.GatherPlan`).

The kernels that take a call by its spec alone are asked first: :func:`plan` asks each of
:data:`PLANNERS` in turn (today the gather kernel, for any spec that selects keys), and the
first plan wins; then the decode kernel (decode-shaped calls), then the row-span kernel
(:func:`~attnkit.backends.blocked.blocks.plan_blocks`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from attnkit.backends.blocked import gather
from attnkit.masks import MaskSpec

if TYPE_CHECKING:
    from attnkit.call import AttentionCall

__all__ = ["OP", "PLANNERS", "Direct", "KernelPlan", "Planner", "plan"]

#: the custom op a compiled call of the blocked backend runs as
#: (:mod:`~attnkit.backends.blocked.compiled`), as ``torch.ops.attnkit.blocked_attention``
OP = "attnkit::blocked_attention"

#: a decode step's later calls run directly: ``(q, k, v) -> out``, or ``None`` where the kernel
#: saw NaN or inf (:mod:`attnkit.backends.memo`)
Direct = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor | None]


class KernelPlan(Protocol):
    """A kernel's plan for one call (or one block of a call)."""

    @property
    def name(self) -> str:
        """The kernel in explain's words (``"the gather kernel"``)."""
        ...

    @property
    def checks_finite(self) -> bool:
        """The kernel's forward reports NaN/inf itself (it raises
        :class:`~attnkit.backends.nonfinite.NonFinite` while
        :func:`~attnkit.backends.nonfinite.reporting`; the dispatcher then sums nothing
        first)."""
        ...

    @property
    def under_compile(self) -> str:
        """What runs the call under ``torch.compile``, in explain's words."""
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
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``dq``, ``dk``, ``dv``, as ``backward_from_lse``; ``None`` where the kernel does not
        take these tensors (a forward-only kernel, or dtypes it was not planned for): the tiles
        run the backward then."""
        ...

    def describe(self, call: AttentionCall, dtype: torch.dtype) -> str:
        """The plan in one line for explain (the kernel runs on ``dtype``: q's, or float32
        where the call converts)."""
        ...

    def reads_note(self, dtype: torch.dtype, upcast: bool) -> str | None:
        """Where the kernel reads q, k, v of ``dtype`` as they are on the call's CPU path
        (``upcast``: ``fp32-upcast``, where the other kernels take float32 copies), what
        explain says of it after ``"<path> path: "`` (``""``: its :meth:`describe` says it);
        ``None`` where it takes what the path gives every kernel."""
        ...

    def direct(self, call: AttentionCall) -> Direct | None:
        """The kernel bound to the signature of ``call`` (no soft-cap, sinks or weights), for a
        decode step's later calls; ``None`` where it has no such entry."""
        ...

    def needs_float32(self, dtype: torch.dtype) -> bool:
        """Whether it reads ``dtype`` only as float32 copies on every CPU path (the ``native``
        one too): :func:`~attnkit.backends.blocked.blocks.converts` then makes them."""
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
