"""The row-span kernel as a :class:`~attnkit.backends.blocked.kernels.KernelPlan`: what a block
plan holds where :func:`~attnkit.backends.blocked.rowspan.plan` says the kernel serves.

Dimension legend: B batch, H query heads, Hkv key/value heads, L query rows, S keys, Dk / Dv
head dims.

The decision itself (the runs of keys, the dtype it reads, the build that runs it, or why
not) is a :class:`~attnkit.backends.blocked.rowspan.SpanPlan`; :class:`RowSpanKernel` runs it,
forward and backward, with the call's soft-cap, and says so for explain.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from attnkit.backends import nonfinite
from attnkit.backends.blocked import rowspan_builds
from attnkit.backends.blocked.config import current
from attnkit.backends.blocked.kernels import OP, Direct
from attnkit.backends.blocked.rowspan import SpanPlan
from attnkit.masks.spans import evaluates_function, span_density

if TYPE_CHECKING:
    from attnkit.call import AttentionCall

__all__ = ["RowSpanKernel"]


@dataclass(frozen=True)
class RowSpanKernel:
    """The row-span kernel's plan of one block: ``spans`` (a plan that serves) and the
    logit soft-cap (``None``: none)."""

    spans: SpanPlan
    softcap: float | None = None

    #: the kernel in explain's words
    name = "attnkit's row-span kernel"
    #: its forward reports NaN/inf itself (whether every q, k, v element it read was finite)
    checks_finite = True
    #: a compiled call runs the same kernel inside the custom op
    under_compile = f"under torch.compile the same, as one custom op ({OP})"

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``out (B, H, L, Dv)`` in the plan's dtype and ``lse (B, H, L)`` float32; raises
        :class:`~attnkit.backends.nonfinite.NonFinite` where it read NaN/inf while
        :func:`~attnkit.backends.nonfinite.reporting` (the rule's exact path runs then)."""
        sp = self.spans
        with torch.no_grad():
            out, lse, finite = rowspan_builds.kernel(sp.isa).span_forward_finite(
                q, k, v, sp, scale, self.softcap or 0.0
            )
        if not finite and nonfinite.reporting():
            raise nonfinite.NonFinite
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
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``dq``, ``dk``, ``dv`` in the plan's dtype, where q, out and dout are in it and
        ``lse`` is float32; else ``None`` (the tiles run it)."""
        sp = self.spans
        if not (q.dtype == out.dtype == dout.dtype == sp.dtype and lse.dtype == torch.float32):
            return None
        with torch.no_grad():
            return rowspan_builds.kernel(sp.isa).span_backward(  # type: ignore[no-any-return]
                q, k, v, out, dout, lse, sp, scale, self.softcap or 0.0
            )

    def describe(self, call: AttentionCall, dtype: torch.dtype) -> str:
        """The mask, the soft-cap and the build that runs it (and a mask function's block map,
        from its runs)."""
        sp = self.spans
        cap = "" if self.softcap is None else f", soft-capped at {self.softcap:g}"
        which = rowspan_builds.by_isa(sp.isa).in_use
        runs = f"{sp.what}{cap}: forward and backward run {which} (one pass each, no tiles)"
        if sp.lo is not None and sp.hi is not None and evaluates_function(call.mask):
            # a function's block map, from its runs (the built-in rules are named)
            runs += "; " + span_density(sp.lo, sp.hi, call.dims.S, current().grain).describe()
        return runs

    def reads_note(self, dtype: torch.dtype, upcast: bool) -> str | None:
        """On ``fp32-upcast``, where it reads bfloat16/float16 directly: says so."""
        if not upcast or self.spans.dtype != dtype:
            return None
        name = str(dtype).removeprefix("torch.")
        return (
            f"attnkit's row-span kernel reads {name} q, k, v directly (float32 inside, no "
            "float32 copies); "
        )

    def direct(self, call: AttentionCall) -> Direct | None:
        """None: a call of its sizes is long; it always goes the whole way."""
        return None

    def needs_float32(self, dtype: torch.dtype) -> bool:
        """False: it takes what the CPU path gives (:meth:`reads_note`)."""
        return False
