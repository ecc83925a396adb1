"""Failing loudly instead of hanging: bounded waits and a shape agreement across ranks.

Every wait on a point-to-point or collective request goes through :func:`wait_all`, which waits
at most ``timeout`` and then raises :class:`RingError` naming this rank, the rank it was waiting
for, what it was doing and the limit. Before any K/V moves, :func:`agree` passes each rank's
shapes, dtype and settings (the mask by its content digest, :meth:`MaskSpec.digest`; sinks per
head by their values) around the ring (tiny messages, only to the ring neighbours the attention
uses anyway), so that ranks that disagree raise the same :class:`~attnkit.AttentionInputError`
on every rank, and a rank that never arrives is named by the rank after it.
"""

from __future__ import annotations

import re
import struct
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from attnkit.distributed.ring_sinks import show_sinks
from attnkit.errors import AttentionInputError
from attnkit.masks import MaskSpec

__all__ = [
    "DEFAULT_TIMEOUT",
    "Peers",
    "Pending",
    "Refused",
    "RingError",
    "agree",
    "as_timedelta",
    "exchange",
    "float_bits",
    "mask_digest",
    "wait_all",
]

#: how long a rank waits on another before it raises (override with ``timeout=``)
DEFAULT_TIMEOUT = timedelta(minutes=10)

TAG_SHAPES, TAG_KV, TAG_DKV = 7100, 7101, 7102  # gloo matches messages by tag; NCCL by order


class RingError(RuntimeError):
    """A rank of the group died, hung or never joined; raised instead of waiting forever.

    Attributes: ``rank`` (this rank), ``peers`` (the ranks waited for; empty in a collective,
    where any rank may be the one missing), ``timeout`` and ``elapsed`` (seconds).
    """

    def __init__(
        self, message: str, *, rank: int, peers: tuple[int, ...], timeout: float, elapsed: float
    ) -> None:
        super().__init__(message)
        self.rank, self.peers, self.timeout, self.elapsed = rank, peers, timeout, elapsed


class Waitable(Protocol):
    """What :func:`wait_all` waits on: a ``torch.distributed`` request, or :class:`Refused`."""

    def wait(self, timeout: timedelta = ...) -> bool: ...


#: a request in flight and the group ranks it depends on (empty: the whole group)
Pending = tuple[Waitable, tuple[int, ...]]


class Refused:
    """A request ``torch.distributed`` refused to post: gloo may raise at once (a dead peer's
    closed connection, under some torch versions) instead of from ``wait``. Waiting on it
    raises that error, so :func:`wait_all` turns it into a :class:`RingError` like every
    other failure, whatever the backend's message says."""

    def __init__(self, exc: RuntimeError) -> None:
        self.exc = exc

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        raise self.exc


def as_timedelta(timeout: float | timedelta | None, where: str) -> timedelta:
    """``timeout=`` as a timedelta: seconds, a timedelta, or ``None`` for the default."""
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise AttentionInputError(
            where,
            "timeout",
            f"`timeout` must be a positive number of seconds or a timedelta, got {timeout!r}.",
            got=f"timeout={timeout!r}",
            expected="seconds > 0 (float) or a datetime.timedelta",
            fix=f"leave it out for the default, {DEFAULT_TIMEOUT.total_seconds():g} s",
        )
    return timedelta(seconds=seconds)


def global_rank(group: dist.ProcessGroup | None, rank: int) -> int:
    """The global rank of ``rank`` (a rank within ``group``), as the p2p ops take it."""
    return rank if group is None else dist.get_global_rank(group, rank)


def exchange(
    sends: Sequence[torch.Tensor],
    recvs: Sequence[torch.Tensor],
    *,
    group: dist.ProcessGroup | None,
    rank: int,
    world: int,
    tag: int,
) -> list[Pending]:
    """Send to rank ``rank + 1`` and receive from ``rank - 1`` (in the group), without waiting.

    One batch, so that NCCL launches the sends and receives of the ring together (separate
    launches would deadlock); gloo matches the messages by ``tag``.
    """
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    ops = [dist.P2POp(dist.isend, t, global_rank(group, nxt), group, tag) for t in sends]
    ops += [dist.P2POp(dist.irecv, t, global_rank(group, prev), group, tag) for t in recvs]
    if not ops:
        return []
    peers = [nxt] * len(sends) + [prev] * len(recvs)
    try:
        works = dist.batch_isend_irecv(ops)
    except RuntimeError as e:  # refused at posting: raised (as RingError) by wait_all
        return [(Refused(e), tuple(sorted(set(peers))))]
    if len(works) == len(ops):  # one request per op (gloo)
        return [(w, (p,)) for w, p in zip(works, peers, strict=True)]
    return [(w, tuple(sorted(set(peers)))) for w in works]  # coalesced (NCCL)


def _cause(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)  # gloo prefixes its source file and line
    return text.split(". This is typically")[0]


def wait_all(
    pending: Sequence[Pending],
    *,
    timeout: timedelta,
    where: str,
    rank: int,
    world: int,
    what: str,
) -> None:
    """Wait for every request, in all at most ``timeout``; raise :class:`RingError` otherwise.

    ``what`` says what was being waited for, for the message.
    """
    start = time.monotonic()
    limit = timeout.total_seconds()
    for work, peers in pending:
        left = max(limit - (time.monotonic() - start), 1e-3)
        try:
            done = work.wait(timeout=timedelta(seconds=left))
        except RuntimeError as e:  # any backend error, whatever its text (DistError included)
            raise _fault(e, where, rank, world, peers, what, limit, start) from e
        if done is False:
            raise _fault(None, where, rank, world, peers, what, limit, start)


def _fault(
    exc: BaseException | None,
    where: str,
    rank: int,
    world: int,
    peers: tuple[int, ...],
    what: str,
    limit: float,
    start: float,
) -> RingError:
    elapsed = time.monotonic() - start
    cause = "timed out" if exc is None else _cause(exc)
    timed_out = exc is None or "timed out" in cause.lower() or elapsed >= 0.95 * limit
    who = " or ".join(f"rank {p}" for p in peers) if peers else "the group"
    if timed_out:
        head = f"rank {rank} of {world} waited {elapsed:.1f} s for {who} (timeout {limit:g} s)"
    else:
        head = f"rank {rank} of {world} lost {who} after {elapsed:.1f} s"
    if peers:
        why = (
            f"{who} has exited, hung, or never made this call (or a rank before it in the "
            f"ring failed first, and {who} is waiting on it)"
        )
    else:
        why = (
            "some rank of the group has exited, hung, or never made this call; the first "
            "failing rank's log says which"
        )
    message = (
        f"{where}: {head} while {what}.\n"
        f"  why:   {why}.\n"
        f"  cause: {cause}\n"
        f"  fix:   every rank of the group must make the same attnkit.distributed calls; find "
        f"the first rank that failed; pass a larger timeout= if a step legitimately takes longer"
    )
    return RingError(message, rank=rank, peers=peers, timeout=limit, elapsed=elapsed)


_MAX_SHAPES, _MAX_DIMS, _MAX_EXTRA = 3, 8, 6


def _encode(
    where: str,
    dtype: torch.dtype,
    shapes: Sequence[tuple[str, tuple[int, ...]]],
    extra: dict[str, int],
) -> list[int]:
    vec = [zlib.crc32(where.encode()), zlib.crc32(str(dtype).encode())]
    for i in range(_MAX_SHAPES):
        shape = shapes[i][1] if i < len(shapes) else ()
        dims = list(shape[:_MAX_DIMS]) + [-1] * (_MAX_DIMS - min(len(shape), _MAX_DIMS))
        vec += [len(shape), *dims]
    values = list(extra.values())
    return vec + values + [0] * (_MAX_EXTRA - len(values))


def _parts(
    vec: list[int],
    names: Sequence[str],
    extra_keys: Sequence[str],
    wheres: dict[int, str],
    dtypes: dict[int, str],
) -> list[tuple[str, str]]:
    """One rank's row as ``(label, text)`` pairs: the call, the dtype, each shape, each value."""
    parts = [("call", wheres.get(vec[0], "another attnkit.distributed call"))]
    parts.append(("dtype", dtypes.get(vec[1], "another dtype")))
    for i, name in enumerate(names):
        base = 2 + i * (1 + _MAX_DIMS)
        ndim = vec[base]
        parts.append((name, f"{name} {tuple(vec[base + 1 : base + 1 + min(ndim, _MAX_DIMS)])}"))
    tail = 2 + _MAX_SHAPES * (1 + _MAX_DIMS)
    parts += [(k, _show(k, vec[tail + i])) for i, k in enumerate(extra_keys)]
    return parts


def float_bits(x: float) -> int:
    """A float as an int64 with the same bits (to send it in an int64 tensor, exactly)."""
    bits: int = struct.unpack("<q", struct.pack("<d", x))[0]
    return bits


def _show(key: str, value: int) -> str:
    if key == "scale":
        return f"scale={struct.unpack('<d', struct.pack('<q', value))[0]!r}"
    if key == "causal":
        return f"causal={bool(value)}"
    if key == "mask":
        if value == 0:
            return "mask=None"
        # the first 16 hex digits of the spec's MaskSpec.digest()
        return f"mask=#{value & (2**64 - 1):016x}"
    if key == "sinks":
        return show_sinks(value)
    return f"{key}={value}"


def mask_digest(mask: MaskSpec | None) -> int:
    """The first 8 bytes of ``mask.digest()`` (its content: rule and tensor bytes) as an
    int64, for :func:`agree`; 0 for no mask."""
    if mask is None:
        return 0
    return int.from_bytes(bytes.fromhex(mask.digest())[:8], "big", signed=True) or 1


#: per value that may differ: what every rank must pass, and the fix (shapes: _SHAPE_ADVICE)
_ADVICE = {
    "call": (
        "the same attnkit.distributed call on every rank, in the same order",
        "make the same attnkit.distributed calls, in the same order, on every rank",
    ),
    "dtype": (
        "the same dtype on every rank",
        "cast q, k and v to one dtype on every rank (the same autocast or .to(dtype) on each)",
    ),
    "mask": (
        "the same mask on every rank: a spec over the whole sequence, built from the same "
        "full-sequence tensors (document ids, key_mask or key_padding_mask, lengths)",
        "build the mask from the whole sequence's tensors on every rank, not from this rank's "
        "part (shard the data, never the mask), or send rank 0's tensors to the others first "
        "(dist.broadcast(ids, src=0)); spec.digest() on each rank shows what it holds",
    ),
    "causal": (
        "the same causal= on every rank",
        "pass the same causal= on every rank (it also picks shard()'s layout)",
    ),
    "scale": (
        "the same scale= on every rank",
        "pass the same scale= on every rank, or leave it out everywhere (1 / sqrt(Dk))",
    ),
    "sinks": (
        "sinks on every rank or on none: per head, (H,), the same values everywhere; per "
        "token, each rank its own query rows' (B, H, Lq)",
        "pass the same sinks parameter on every rank (replicated, as the model's other "
        "parameters are), or per-token sinks sharded as q on every rank",
    ),
    "kv_heads_per_pass": (
        "the same kv_heads_per_pass= on every rank",
        "pass the same kv_heads_per_pass= on every rank, or leave it out everywhere",
    ),
}
_SHAPE_ADVICE = (
    "the same call, shapes, dtype and flags on every rank: every rank must hold an equal part "
    "of the sequence",
    "shard every tensor with attnkit.distributed.shard(x, causal=...) on every rank; pad the "
    "sequence to a multiple of the world size (twice it when causal) and mask the padding "
    "with attnkit.masks.padding(lengths)",
)


def _ranks(ranks: Sequence[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]} has"
    return f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]} have"


@dataclass(frozen=True)
class Peers:
    """The ranks of one collective call: the ``group`` (``None``: the default one), this
    process's ``rank`` in it, its ``world`` size, how long to wait for the others
    (``timeout``) and the public function that waits (``where``, for messages)."""

    group: dist.ProcessGroup | None
    rank: int
    world: int
    timeout: timedelta
    where: str


def agree(
    peers: Peers,
    shapes: Sequence[tuple[str, tuple[int, ...]]],
    *,
    extra: dict[str, int],
    dtype: torch.dtype,
    device: torch.device,
    local: dict[str, str] | None = None,
) -> None:
    """Check that every rank makes this call with the same shapes, dtype and ``extra`` values
    (ints: a float by :func:`float_bits`, a mask by :func:`mask_digest`, its content).

    The description goes around the ring in ``world - 1`` hops of a few hundred bytes. A
    mismatch raises the same :class:`~attnkit.AttentionInputError` on every rank: it names the
    first value that differs, which ranks hold which, each rank's whole description, and the
    fix; ``local`` adds this rank's own view of some values (a mask's repr). A rank that does
    not arrive within ``timeout`` makes the next one raise :class:`RingError` naming it.
    """
    rank, world, where = peers.rank, peers.world, peers.where
    if len(shapes) > _MAX_SHAPES or len(extra) > _MAX_EXTRA:
        raise ValueError("agree() describes at most 3 shapes and 6 extra values")
    mine = _encode(where, dtype, shapes, extra)
    table: list[list[int]] = [mine] * world
    cur = torch.tensor(mine, dtype=torch.int64, device=device)
    for hop in range(world - 1):
        nxt = torch.empty_like(cur)
        pending = exchange([cur], [nxt], group=peers.group, rank=rank, world=world, tag=TAG_SHAPES)
        wait_all(
            pending,
            timeout=peers.timeout,
            where=where,
            rank=rank,
            world=world,
            what=f"checking that all {world} ranks agree on the shapes (hop {hop + 1} of "
            f"{world - 1})",
        )
        table[(rank - 1 - hop) % world] = nxt.tolist()
        cur = nxt
    if all(row == mine for row in table):
        return
    names = [name for name, _ in shapes]
    keys = list(extra)
    wheres = {zlib.crc32(w.encode()): w for w in _KNOWN_CALLS}
    dtypes = {zlib.crc32(str(d).encode()): str(d) for d in _DTYPES}
    parts = [_parts(row, names, keys, wheres, dtypes) for row in table]
    rows = "\n".join(
        f"            rank {r}: {' '.join(text for _, text in row)}"
        + ("  <- this rank" if r == rank else "")
        for r, row in enumerate(parts)
    )
    first = next(row for row in table if row != table[0])
    culprit = _first_difference(table[0], first, names, keys)
    held: dict[str, list[int]] = {}  # what each rank passed of the culprit -> those ranks
    for r, row in enumerate(parts):
        held.setdefault(next(text for label, text in row if label == culprit), []).append(r)
    sides = "; ".join(f"{_ranks(rs)} {text}" for text, rs in held.items())
    expected, fix = _ADVICE.get(culprit, _SHAPE_ADVICE)
    mine_note = "".join(f"\n            this rank's {k}: {v}" for k, v in (local or {}).items())
    raise AttentionInputError(
        where,
        culprit,
        f"the {world} ranks disagree on {culprit!r}: {sides}.",
        got="one line per rank:\n" + rows + mine_note,
        expected=expected,
        fix=fix,
    )


def _first_difference(a: list[int], b: list[int], names: Sequence[str], keys: Sequence[str]) -> str:
    labels = ["call", "dtype"]
    for i in range(_MAX_SHAPES):
        name = names[i] if i < len(names) else "?"
        labels += [name] * (1 + _MAX_DIMS)
    labels += list(keys) + ["?"] * (_MAX_EXTRA - len(keys))
    return next(label for x, y, label in zip(a, b, labels, strict=True) if x != y)


_KNOWN_CALLS = ("attnkit.distributed.ring_attention", "attnkit.distributed.unshard")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
