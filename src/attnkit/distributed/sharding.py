"""How a sequence is split over the ranks of a group: contiguous, or zigzag for causal attention.

Dimension legend: N the full sequence length (dim -2 of the tensors), P ranks, r this rank,
n = N / P tokens per rank, c a chunk.

Contiguous (``causal=False``): rank ``r`` holds tokens ``[r*n, (r+1)*n)``.

Zigzag (``causal=True``): the sequence is cut into ``2P`` chunks of ``c = N / (2P)`` tokens and
rank ``r`` holds chunks ``r`` and ``2P-1-r``, in that order. Under the causal rule a late chunk
sees many keys and an early one few; pairing them gives every rank the same work. For P = 4
(chunks 0..7)::

    rank 0: chunks 0 7      rank 1: chunks 1 6      rank 2: chunks 2 5      rank 3: chunks 3 4
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from attnkit.distributed.faults import Peers, Pending, Refused, agree, as_timedelta, wait_all
from attnkit.errors import AttentionInputError

__all__ = ["Chunk", "Layout", "shard", "shard_positions", "unshard"]

ProcessGroup = dist.ProcessGroup


def group_rank_and_size(group: ProcessGroup | None, where: str) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size; a clear error when not set up."""
    if not dist.is_available() or not dist.is_initialized():
        raise AttentionInputError(
            where,
            "group",
            "torch.distributed is not initialised in this process.",
            got="dist.is_initialized() = False",
            expected="a process group (torchrun, or dist.init_process_group(...) in each process)",
            fix='dist.init_process_group("gloo", timeout=timedelta(seconds=60)) on CPU, '
            '"nccl" on GPUs; torchrun sets the rank and world size',
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise AttentionInputError(
            where,
            "group",
            "this process is not a member of the process group it was given.",
            got=f"dist.get_rank(group) = {rank}",
            expected="a group that contains this process",
            fix="pass a group from dist.new_group(ranks) on every rank, and call only on members",
        )
    return rank, dist.get_world_size(group)


@dataclass(frozen=True)
class Chunk:
    """A run of consecutive tokens of the full sequence held by one rank."""

    start: int  # position of its first token in the full sequence
    local: int  # position of its first token in the rank's shard
    length: int


@dataclass(frozen=True)
class Layout:
    """Which tokens of an ``N = world * n`` token sequence each rank holds (``n`` per rank).

    >>> Layout(world=4, n=4, zigzag=True).chunks(1)
    (Chunk(start=2, local=0, length=2), Chunk(start=12, local=2, length=2))
    """

    world: int
    n: int  # tokens per rank
    zigzag: bool

    @property
    def total(self) -> int:
        return self.world * self.n

    def chunks(self, rank: int) -> tuple[Chunk, ...]:
        if not self.zigzag:
            return (Chunk(rank * self.n, 0, self.n),)
        c = self.n // 2
        return (Chunk(rank * c, 0, c), Chunk((2 * self.world - 1 - rank) * c, c, c))

    def positions(self, rank: int, device: torch.device | None = None) -> torch.Tensor:
        """Global positions of the ``n`` tokens of ``rank``'s shard, in shard order."""
        return torch.cat(
            [torch.arange(c.start, c.start + c.length, device=device) for c in self.chunks(rank)]
        )


def _layout(N: int, world: int, causal: bool, name: str, where: str) -> Layout:
    parts = 2 * world if causal else world
    if N % parts != 0:
        rounded = -(-N // parts) * parts
        raise AttentionInputError(
            where,
            name,
            f"a sequence of {N} tokens does not split into {parts} equal "
            f"{'chunks (2 per rank, zigzag)' if causal else 'shards'} over {world} ranks.",
            got=f"{name}.shape[-2] = {N}, world size {world}, causal={causal}",
            expected=f"a length divisible by {parts}" + (" (2 * world size)" if causal else ""),
            fix=f"pad the sequence to {rounded} tokens and mask the padding with "
            f"attnkit.masks.padding(lengths)",
        )
    return Layout(world, N // world, causal)


def shard(
    x: torch.Tensor, *, causal: bool = False, group: ProcessGroup | None = None
) -> torch.Tensor:
    """This rank's part of the full sequence ``x (..., N, D)`` along dim -2: ``(..., N/P, D)``.

    ``causal=False``: rank ``r`` gets tokens ``[r*N/P, (r+1)*N/P)``. ``causal=True``: the
    zigzag split (see :mod:`attnkit.distributed.sharding`), which balances causal attention;
    pass the same ``causal`` to :func:`~attnkit.distributed.ring_attention` and
    :func:`unshard`. Differentiable (the gradient lands in this rank's rows of ``x``).

    >>> # on rank 1 of 2:  shard(torch.arange(8.0)[:, None], causal=True).flatten()
    >>> # tensor([2., 3., 4., 5.])   (chunks 1 and 2 of 0 1 | 2 3 | 4 5 | 6 7)
    """
    where = "attnkit.distributed.shard"
    rank, world = group_rank_and_size(group, where)
    layout = _layout(_seq_len(x, "x", where), world, causal, "x", where)
    parts = [x.narrow(-2, c.start, c.length) for c in layout.chunks(rank)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)


def shard_positions(
    length: int, *, causal: bool = False, group: ProcessGroup | None = None
) -> torch.Tensor:
    """The global positions (``(N/P,)`` int64) of the tokens :func:`shard` gives this rank.

    For position embeddings (learned, RoPE, ALiBi) of a sharded sequence of ``length`` tokens.
    """
    where = "attnkit.distributed.shard_positions"
    rank, world = group_rank_and_size(group, where)
    return _layout(length, world, causal, "length", where).positions(rank)


class _Unshard(torch.autograd.Function):
    """All-gather along dim -2; backward keeps this rank's rows of the gradient."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        layout: Layout,
        rank: int,
        group: ProcessGroup | None,
        timeout: timedelta,
    ) -> torch.Tensor:
        ctx.layout, ctx.rank = layout, rank  # type: ignore[attr-defined]
        xc = x.contiguous()
        parts = [torch.empty_like(xc) for _ in range(layout.world)]
        pending: list[Pending] = []
        try:
            work = dist.all_gather(parts, xc, group=group, async_op=True)
            pending = [] if work is None else [(work, ())]
        except RuntimeError as e:  # refused at posting: raised (as RingError) by wait_all
            pending = [(Refused(e), ())]
        wait_all(
            pending,
            timeout=timeout,
            where="attnkit.distributed.unshard",
            rank=rank,
            world=layout.world,
            what="gathering the shards (all_gather)",
        )
        out = torch.empty(
            (*x.shape[:-2], layout.total, x.shape[-1]), dtype=x.dtype, device=x.device
        )
        for r, part in enumerate(parts):
            for c in layout.chunks(r):
                out.narrow(-2, c.start, c.length).copy_(part.narrow(-2, c.local, c.length))
        return out

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        layout: Layout = ctx.layout  # type: ignore[attr-defined]
        parts = [grad.narrow(-2, c.start, c.length) for c in layout.chunks(ctx.rank)]  # type: ignore[attr-defined]
        return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)), None, None, None, None


def unshard(
    x: torch.Tensor,
    *,
    causal: bool = False,
    group: ProcessGroup | None = None,
    timeout: float | timedelta | None = None,
) -> torch.Tensor:
    """Gather the shards ``(..., N/P, D)`` of every rank back into ``(..., N, D)``, in order.

    The inverse of :func:`shard` with the same ``causal``; every rank gets the full tensor.
    Differentiable: the gradient of this rank's shard is its rows of the full gradient (each
    rank is taken to compute the same loss on the gathered tensor). Every rank must call it;
    one that does not makes the others fail after ``timeout`` (default
    :data:`~attnkit.distributed.faults.DEFAULT_TIMEOUT`).
    """
    where = "attnkit.distributed.unshard"
    rank, world = group_rank_and_size(group, where)
    n = _seq_len(x, "x", where)
    td = as_timedelta(timeout, where)
    peers = Peers(group, rank, world, td, where)
    agree(
        peers,
        [("x", tuple(x.shape))],
        extra={"causal": int(causal)},
        dtype=x.dtype,
        device=x.device,
    )
    if causal and n % 2 != 0:
        raise AttentionInputError(
            where,
            "x",
            f"a zigzag shard holds two equal chunks, but this one has {n} tokens (odd).",
            got=f"x.shape[-2] = {n}, causal=True",
            expected="an even number of tokens per rank",
            fix="shard with attnkit.distributed.shard(x, causal=True), or pass causal=False",
        )
    layout = Layout(world, n, causal)
    out: torch.Tensor = _Unshard.apply(x, layout, rank, group, td)  # type: ignore[no-untyped-call]
    return out


def _seq_len(x: object, name: str, where: str) -> int:
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        got = (
            f"{name}.shape = {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        )
        raise AttentionInputError(
            where,
            name,
            f"`{name}` must be a tensor with the sequence on dim -2.",
            got=got,
            expected=f"{name} (..., N, D), e.g. (B, L, E) or (B, H, L, D)",
            fix="a (seq, batch, embed) tensor needs .transpose(0, 1) first",
        )
    return x.shape[-2]
