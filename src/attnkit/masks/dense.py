"""A mask tensor seen as a spec, so that block-sparse backends skip its empty blocks too.

Dimension legend: B batch, H heads, L query length, S key length; ``B'``, ``H'``, ``L'``, ``S'``
the mask's own sizes (1 where it broadcasts).
"""

from __future__ import annotations

import math
from collections.abc import Hashable

import torch

from attnkit.masks.spec import MaskSpec
from attnkit.memory import exceeds, refuse

__all__ = ["DenseMask"]


class DenseMask(MaskSpec):
    """A materialised mask (what :func:`attnkit.masks.as_spec` makes of a tensor).

    ``mask`` broadcasts to ``(B, H, L, S)``: bool (True = may attend) or float (added to the
    scores; ``-inf`` blocks). Block bounds come from 2-D prefix sums of the allowed pairs, built
    on first use. Its :meth:`key` is ``None``: a plan of a dense mask reads the whole mask, so
    it is made per call instead of keeping user tensors alive in a cache.
    """

    reads_query_position = False
    from_tensor = True
    scratch_bytes = 32  # allowed() gathers with four broadcast int64 index tensors
    digest_ignores = ("m", "ok", "_sums")  # views of the tensor, what it allows, a cache

    def __init__(self, mask: torch.Tensor) -> None:
        # as the user gave it, dense backends take it unchanged; a 0-D or 1-D mask (it
        # broadcasts) is viewed as (1, S) or (1, 1), as torch's fused kernels need 2 dims
        lead = (1,) * (2 - mask.dim())
        self.tensor = mask if mask.dim() >= 2 else mask.reshape(lead + tuple(mask.shape))
        m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))  # (B', H', L', S')
        self.m = m
        self.ok = m if m.dtype == torch.bool else m != -math.inf
        self.has_bias = m.is_floating_point()
        self.batch = m.shape[0] if m.shape[0] > 1 else None
        self.heads = m.shape[1] if m.shape[1] > 1 else None
        self._sums: torch.Tensor | None = None

    def key(self) -> Hashable | None:
        return None

    def tensors(self) -> list[torch.Tensor]:
        return [self.tensor]

    def dense_bytes(self, L: int, S: int, dtype: torch.dtype = torch.float32) -> int:
        return 0  # to_dense returns the tensor itself

    def to_dense(self, L, S, *, device=None, dtype=torch.float32):  # type: ignore[no-untyped-def]
        return self.m

    def _index(
        self, t: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
    ) -> torch.Tensor:
        sizes = t.shape
        idx = [
            x if n > 1 else torch.zeros_like(x) for x, n in zip((b, h, q, kv), sizes, strict=True)
        ]
        return t[idx[0], idx[1], idx[2], idx[3]]

    def allowed(self, b, h, q, kv, off):  # type: ignore[no-untyped-def]
        return self._index(self.ok, b, h, q, kv)

    def bias(self, b, h, q, kv, off):  # type: ignore[no-untyped-def]
        return self._index(self.m, b, h, q, kv) if self.has_bias else None

    def block_bounds(self, q_lo, q_hi, k_lo, k_hi, off):  # type: ignore[no-untyped-def]
        if self._sums is None:
            self._check_sums()
            ok = self.ok.to(torch.int64)
            self._sums = torch.nn.functional.pad(ok.cumsum(2).cumsum(3), (1, 0, 1, 0))
        c = self._sums  # (B', H', L'+1, S'+1)
        Lm, Sm = self.ok.shape[2], self.ok.shape[3]
        # a broadcast (size-1) dim stands for every position: clamp the bounds into it
        qa, qb = (q_lo.clamp(max=0), q_hi.clamp(max=0)) if Lm == 1 else (q_lo, q_hi)
        ka, kb = (k_lo.clamp(max=0), k_hi.clamp(max=0)) if Sm == 1 else (k_lo, k_hi)
        qa, qb, ka, kb = (x.view(x.shape[-2], x.shape[-1]) for x in (qa, qb, ka, kb))
        n = c[:, :, qb + 1, kb + 1] - c[:, :, qa, kb + 1] - c[:, :, qb + 1, ka] + c[:, :, qa, ka]
        area = (qb - qa + 1) * (kb - ka + 1)
        return n > 0, n == area

    def planning_bytes(self) -> int:
        """The prefix sums: three int64 copies of the mask's shape."""
        return 3 * 8 * self.ok.numel()

    def _check_sums(self) -> None:
        """The prefix sums take three int64 copies of the mask's shape: refuse them above
        attnkit's memory limit (:mod:`attnkit.memory`)."""
        nbytes = self.planning_bytes()
        limit = exceeds(nbytes, self.ok.device)
        if limit is not None:
            raise refuse(
                "attnkit.masks",
                "mask",
                f"planning the {self!r} block by block (int64 prefix sums of its shape)",
                nbytes,
                limit,
                got=f"{self!r} on {self.ok.device}",
                fix="pass the mask as a spec from attnkit.masks (key_mask(keep), "
                "padding(lengths), causal(), document(ids), ...), which is planned from its "
                "rule; or backend='auto', which takes a backend that uses the tensor as it is "
                "(attnkit.explain(...) says which)",
            )

    def __repr__(self) -> str:
        kind = "bool" if self.m.dtype == torch.bool else "float"
        return f"dense {kind} mask {tuple(self.m.shape)}"
