"""The KV cache's mask rule: end-aligned causal per sequence of a ragged batch.

Dimension legend: B batch; ``new`` the queries just written to the cache, ``lengths (B,)`` the
tokens each sequence holds after the write.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from attnkit.masks.keys import tensor_key
from attnkit.masks.rules import values_str
from attnkit.masks.runs import LOW, Spans, cpu, full
from attnkit.masks.spec import MaskSpec

__all__ = ["sequence_causal"]


class _SequenceCausal(MaskSpec):
    """The end-aligned causal rule per sequence: the last of the ``new`` queries of sequence
    ``b`` stands at its last cached key, ``lengths[b] - 1``; keys past it are not seen."""

    reads_query_position = False
    scratch_bytes = 0

    def __init__(self, lengths: torch.Tensor, new: int) -> None:
        self.lengths = lengths  # (B,)
        self.new = new
        self.batch = lengths.shape[0]

    def key(self) -> Hashable:
        return ("sequence_causal", tensor_key(self.lengths), self.new)

    def tensors(self) -> list[torch.Tensor]:
        return [self.lengths]

    def allowed(self, b, h, q, kv, off):  # type: ignore[no-untyped-def]
        return kv <= q + (self.lengths[b] - self.new)

    def block_bounds(self, q_lo, q_hi, k_lo, k_hi, off):  # type: ignore[no-untyped-def]
        start = (self.lengths - self.new).view(-1, 1, 1, 1)  # (B, 1, 1, 1): query 0's position
        return k_lo <= q_hi + start, k_hi <= q_lo + start

    def key_runs(self, pos: torch.Tensor, off: int) -> Spans:
        start = cpu(self.lengths - self.new)[:, None]
        return full(pos, LOW).expand(start.shape[0], -1), pos + start

    def __repr__(self) -> str:
        return f"sequence_causal(lengths={values_str(self.lengths)}, new={self.new})"


def sequence_causal(lengths: torch.Tensor, new: int) -> MaskSpec:
    """The rule of ``new`` queries just appended to sequences that now hold ``lengths (B,)``
    tokens: the last query of sequence ``b`` sits at key ``lengths[b] - 1`` and sees every key
    up to it (what :meth:`attnkit.KVCache.rule` returns for a ragged batch).

    >>> print(sequence_causal(torch.tensor([3, 2]), 2).to_dense(2, 3).int()[:, 0])
    tensor([[[1, 1, 0],
             [1, 1, 1]],
    <BLANKLINE>
            [[1, 0, 0],
             [1, 1, 0]]], dtype=torch.int32)
    """
    return _SequenceCausal(lengths, new)
