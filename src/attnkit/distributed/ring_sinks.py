"""Attention sinks in ring attention: which sinks a rank may pass, and what the ranks compare.

Dimension legend: B batch, H query heads, Lq this rank's query tokens, L = P * Lq the whole
sequence's, P ranks.

A sink joins the softmax denominator of its rows once. In the ring, every rank's rows are
merged over all key shards first (by their log-sum-exp); the sinks then join that merged
result, once, on the rank that holds the rows (:func:`attnkit.backends.blocked.with_sinks`),
never once per ring step. Per head, ``(H,)``, every rank holds the same sinks (a replicated
parameter): the ranks compare their values before any K/V moves. Per token, each rank holds its
own query rows' sinks, ``(B, H, Lq)`` or ``(1, H, Lq)``, in the order of its shard of q.
"""

from __future__ import annotations

import hashlib

import torch

from attnkit.call import Dims
from attnkit.errors import AttentionInputError
from attnkit.validate import check_sinks

__all__ = ["check_ring_sinks", "show_sinks", "sinks_digest"]

#: :func:`sinks_digest` of no sinks, and of per-token sinks (each rank holds its own rows')
NO_SINKS, PER_TOKEN = 0, 1


def check_ring_sinks(sinks: object, q: torch.Tensor, dims: Dims, world: int, where: str) -> None:
    """Check the sinks of a rank holding queries ``q (B, H, Lq, Dk)`` (``dims`` of its shard):
    :func:`attnkit.validate.check_sinks`, after the one mistake of the ring, per-token sinks
    of the whole sequence rather than of this rank's rows."""
    full = (dims.H, dims.L * world)
    if (
        world > 1
        and isinstance(sinks, torch.Tensor)
        and sinks.dim() == 3
        and tuple(sinks.shape[1:]) == full
        and sinks.shape[0] in (1, dims.B)
    ):
        raise AttentionInputError(
            where,
            "sinks",
            "these per-token sinks cover the whole sequence; a rank passes its own query "
            "rows' sinks, as it passes its shard of q.",
            got=f"sinks (B={sinks.shape[0]}, H={dims.H}, L={dims.L * world})  q (B={dims.B}, "
            f"H={dims.H}, Lq={dims.L}) on each of {world} ranks",
            expected=f"sinks (B={dims.B}, H={dims.H}, Lq={dims.L}) or (1, H={dims.H}, "
            f"Lq={dims.L}): this rank's rows",
            fix="shard them as q: shard(sinks.unsqueeze(-1), causal=...).squeeze(-1)",
        )
    check_sinks(sinks, q, dims, where=where)


def sinks_digest(sinks: torch.Tensor | None) -> int:
    """What the ranks compare of their (checked) sinks, as an int64 for
    :func:`~attnkit.distributed.faults.agree`: :data:`NO_SINKS`, :data:`PER_TOKEN` (each
    rank's own rows: only their presence must agree), or for sinks per head the first 8 bytes
    of a digest of their values (every rank must hold the same)."""
    if sinks is None:
        return NO_SINKS
    if sinks.dim() != 1:
        return PER_TOKEN
    values = sinks.detach().to("cpu", torch.float64).numpy().tobytes()  # exact for every dtype
    digest = int.from_bytes(hashlib.blake2b(values, digest_size=8).digest(), "big", signed=True)
    return digest if digest not in (NO_SINKS, PER_TOKEN) else 2


def show_sinks(value: int) -> str:
    """A :func:`sinks_digest` in a message: ``sinks=None``, ``sinks=per-token``, or the
    digest of per-head sinks' values as 16 hex digits."""
    if value == NO_SINKS:
        return "sinks=None"
    if value == PER_TOKEN:
        return "sinks=per-token"
    return f"sinks=#{value & (2**64 - 1):016x}"
