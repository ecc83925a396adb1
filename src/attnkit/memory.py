"""The size guard: nothing that grows as L x S is allocated above attnkit's memory limit.

Dimension legend: B batch, H query heads, L query length, S key length.

Before attnkit allocates a tensor whose size grows as ``L x S`` — the ``math`` backend's scores
and weights ``(B, H, L, S)``, a mask spec materialised as a tensor
(:meth:`~attnkit.masks.MaskSpec.to_dense`, which dense backends ask for), the prefix sums a
dense mask is planned with — it computes the bytes and, above the limit, raises
:class:`AttentionMemoryError` with the size in GiB and the way out, before allocating anything.
``backend="auto"`` passes over a backend that would need more than the limit when another one
can serve the call (a spec then goes to ``blocked``, whose memory grows with L).

The limit, per call:

- by default half of the memory available at that moment: ``MemAvailable`` of
  ``/proc/meminfo`` for CPU tensors (Linux), ``torch.cuda.mem_get_info`` for CUDA tensors; never
  below 64 MiB (smaller allocations are never refused, and cost no reading); no limit where
  neither is known (another OS or device) unless one is set;
- :func:`set_memory_limit` fixes it, in bytes, for every device (``None``: the default again).

Tensors on the ``meta`` device allocate nothing and are never refused. The guard does not run
while ``torch.compile`` traces (it reads the free memory, which a compiled graph cannot).

>>> import attnkit, torch
>>> previous = attnkit.set_memory_limit(2**20)        # 1 MiB
>>> q = torch.randn(1, 4, 1024, 16)
>>> attnkit.attention(q, q, q, return_weights=True)   # doctest: +ELLIPSIS
Traceback (most recent call last):
    ...
attnkit.memory.AttentionMemoryError: attnkit.attention: the math backend's scores and weights ...
>>> attnkit.set_memory_limit(previous)
1048576
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from attnkit.errors import AttentionInputError


class _Call(Protocol):
    """What :func:`too_big_error` reads of an :class:`~attnkit.AttentionCall` (typed by its
    attributes, so that this module, which the masks import, imports no call)."""

    @property
    def q(self) -> torch.Tensor: ...
    @property
    def dims(self) -> Any: ...
    @property
    def mask(self) -> Any: ...
    @property
    def dropout_p(self) -> float: ...
    @property
    def mask_needs_grad(self) -> bool: ...
    @property
    def return_weights(self) -> bool: ...


__all__ = [
    "AttentionMemoryError",
    "exceeds",
    "format_bytes",
    "memory_limit",
    "refuse",
    "set_memory_limit",
    "too_big_error",
]

FLOOR = 64 * 2**20  #: the default limit is never below this many bytes
_MEMINFO = Path("/proc/meminfo")
_fixed: list[int | None] = [None]  # the limit set by set_memory_limit (None: the default)


class AttentionMemoryError(AttentionInputError):
    """An allocation that grows as ``L x S`` would exceed attnkit's memory limit.

    Raised before anything is allocated; an :class:`~attnkit.AttentionInputError` (a
    ``ValueError``) with the same parts, plus ``nbytes`` (what was needed) and ``limit``.
    """

    def __init__(self, *args: Any, nbytes: int = 0, limit: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # the parts of AttentionInputError
        self.nbytes = nbytes
        self.limit = limit


def set_memory_limit(nbytes: int | None) -> int | None:
    """Fix attnkit's memory limit at ``nbytes`` for every device; ``None`` restores the
    default (half of the memory available at each call). Returns the previous setting.

    >>> previous = set_memory_limit(8 * 2**30)   # 8 GiB
    >>> memory_limit(torch.device("cpu"))
    8589934592
    >>> set_memory_limit(previous)
    8589934592
    """
    if nbytes is not None and (
        isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1
    ):
        raise AttentionInputError(
            "attnkit.set_memory_limit",
            "nbytes",
            f"the memory limit must be a positive int of bytes or None, got {nbytes!r}.",
            got=f"nbytes={nbytes!r}",
            expected="an int >= 1 (bytes), or None for the default (half of the free memory)",
            fix="e.g. set_memory_limit(16 * 2**30) for 16 GiB",
        )
    previous = _fixed[0]
    _fixed[0] = nbytes
    return previous


def _available(device: torch.device) -> int | None:
    """Bytes available now on ``device``, or ``None`` where attnkit cannot tell."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    try:
        text = _MEMINFO.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024  # the file counts kB
    return None


def memory_limit(device: torch.device) -> int | None:
    """The limit, in bytes, for an allocation on ``device`` now (``None``: no limit)."""
    if device.type == "meta":
        return None
    if _fixed[0] is not None:
        return _fixed[0]
    free = _available(device)
    return None if free is None else max(free // 2, FLOOR)


def exceeds(nbytes: int, device: torch.device) -> int | None:
    """The limit when allocating ``nbytes`` on ``device`` would exceed it, else ``None``."""
    if torch.compiler.is_compiling() or device.type == "meta":
        return None
    if _fixed[0] is None and nbytes <= FLOOR:  # never refused: no need to read the free memory
        return None
    limit = memory_limit(device)
    return limit if limit is not None and nbytes > limit else None


def format_bytes(nbytes: int) -> str:
    """``12.5 GiB (13,421,772,800 bytes)``: GiB for reading, the bytes for small sizes."""
    return f"{nbytes / 2**30:.3g} GiB ({nbytes:,} bytes)"


def refuse(
    where: str,
    argument: str,
    what: str,
    nbytes: int,
    limit: int,
    *,
    got: str,
    fix: str,
) -> AttentionMemoryError:
    """The error for ``what`` needing ``nbytes`` above ``limit`` (raise it)."""
    source = (
        "set by attnkit.set_memory_limit"
        if _fixed[0] is not None
        else "half of the memory available now; attnkit.set_memory_limit(nbytes) changes it"
    )
    return AttentionMemoryError(
        where,
        argument,
        f"{what} would take {format_bytes(nbytes)}, above attnkit's memory limit of "
        f"{format_bytes(limit)}; nothing was allocated.",
        got=got,
        expected=f"at most {format_bytes(limit)} ({source})",
        fix=fix,
        nbytes=nbytes,
        limit=limit,
    )


def too_big_error(
    where: str, call: _Call, backend: str, nbytes: int, what: str, limit: int
) -> AttentionMemoryError:
    """The error of a call whose backend would allocate ``nbytes`` of L x S memory above
    ``limit``, with the ways to a backend that never does (``blocked``)."""
    ways = []
    if call.return_weights:
        ways.append(
            "no weights: return_weights=False (need_weights=False in the modules; only math "
            "forms the (B, H, L, S) weights)"
        )
    if call.dropout_p > 0.0:
        ways.append("dropout_p=0.0")
    if call.mask_needs_grad:
        ways.append("a float mask that needs no gradient")
    if backend in ("blocked", "flex"):  # its L x S memory is the planning of a mask tensor
        fix = (
            "pass the mask as a spec from attnkit.masks (key_mask(keep), padding(lengths), "
            "causal(), document(ids), ...), planned from its rule with no L x S memory; or "
            "backend='auto', which takes a backend that uses the tensor as it is"
        )
    else:
        if ways:
            fix = f"{'; '.join(ways)}: then the blocked backend runs it"
        else:
            fix = "backend='blocked' runs it"
        fix += (
            " without L x S tensors (a mask spec from attnkit.masks, block by block); or fewer "
            "queries per call (a smaller L)"
        )
    d = call.dims
    spec = call.mask
    mask = "" if spec is None or spec.from_tensor else f"  mask={spec!r}"
    return refuse(
        where,
        "return_weights" if call.return_weights and backend == "math" else "backend",
        what,
        nbytes,
        limit,
        got=f"q (B={d.B}, H={d.H}, L={d.L}, Dk={d.Dk})  k (Hkv={d.Hkv}, S={d.S})  "
        f"{call.q.dtype} on {call.q.device}; backend {backend!r}{mask}",
        fix=fix,
    )
