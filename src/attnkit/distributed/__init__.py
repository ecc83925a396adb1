"""Sequence-parallel (ring) attention over ``torch.distributed``: one sequence, many processes.

When one sequence no longer fits one machine, split it along its length over ``P`` processes
(gloo on CPU, NCCL on GPU; the code is the same): every rank holds ``N / P`` tokens, and
attention passes the K/V shards around the ring of ranks, merging partial results exactly.

- :func:`shard` / :func:`unshard`: this rank's part of a full sequence and back; with
  ``causal=True`` the zigzag split that gives every rank the same causal work.
- :func:`ring_attention`: exact attention (forward and backward) on the shards, with mask
  specs over the whole sequence, grouped-query heads, and bounded waits.
- :class:`SequenceParallel` / :func:`parallelize`: a MultiHeadAttention (or every one in a
  model) on shards, with the same parameters.
- :func:`profile`: per-step compute time, waiting time and bytes sent on this rank.
- :class:`RingError`: a rank died, hung or never joined (raised after ``timeout``, never a hang).

>>> import attnkit.distributed as akd
>>> akd.Layout(world=2, n=4, zigzag=True).positions(1)
tensor([2, 3, 4, 5])
"""

from attnkit.distributed.faults import DEFAULT_TIMEOUT, RingError
from attnkit.distributed.module import SequenceParallel, parallelize
from attnkit.distributed.profile import RingProfile, RingStep, profile
from attnkit.distributed.ring import ring_attention
from attnkit.distributed.sharding import Chunk, Layout, shard, shard_positions, unshard

__all__ = [
    "DEFAULT_TIMEOUT",
    "Chunk",
    "Layout",
    "RingError",
    "RingProfile",
    "RingStep",
    "SequenceParallel",
    "parallelize",
    "profile",
    "ring_attention",
    "shard",
    "shard_positions",
    "unshard",
]
