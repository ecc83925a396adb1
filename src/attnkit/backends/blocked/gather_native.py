"""The gather kernel's C++ forward and backward (``csrc/gather.cpp``, ``csrc/gather_rows.h``),
loaded as attnkit's other kernels are (:mod:`~attnkit.backends.blocked.native`): float32, and
bfloat16/float16 read in place (widened to float32 in registers; float16 where the build has
F16C, :func:`reads`), the selected K and V rows read where they lie, one task per (batch row,
key/value head, query row) forward and per (batch row, key/value head, slice of query rows)
backward, on torch's threads; results in the input dtype, sums in float32.

The wheel carries it prebuilt, and an install from source compiles it once, as the other builds;
where no prebuilt build serves it is compiled here on first use (the system's C++ compiler,
:mod:`~attnkit.backends.blocked.jit`; a CPU without F16C compiles it without, and reads float16
as float32 copies); without one, or with ``ATTNKIT_SPAN_KERNEL=0``,
:mod:`~attnkit.backends.blocked.gather` runs its torch operations.
"""

from __future__ import annotations

import ctypes
from array import array
from typing import Any, ClassVar

import torch

from attnkit.backends.blocked import builds, native, rowspan_builds

__all__ = ["GATHER", "ROW_SLICES", "GatherKernel", "backward", "forward", "kernel", "reads"]

#: the build (AVX2, FMA and F16C; one of the wheel's prebuilt builds, :data:`builds.ALL`)
GATHER = builds.GATHER


class GatherKernel(native.Library):
    """``attnkit_gather_forward(args, scale)``: see ``csrc/gather.cpp``."""

    FUNCTIONS: ClassVar[dict[str, list[Any]]] = {
        "attnkit_gather_forward": [ctypes.c_void_p, ctypes.c_double],
        "attnkit_gather_backward": [ctypes.c_void_p, ctypes.c_double],
    }


#: slices of query rows per (batch row, key/value head) in the backward: 0 lets the kernel
#: choose (one per thread beyond the heads, at least 16 rows each, scratch of at most 256 MiB);
#: 1 is the backward parallel over batch rows and key/value heads only (benchmarks compare)
ROW_SLICES = 0

_gather = native.Lazy(GATHER, GatherKernel, rowspan_builds.cpu_reason)


def kernel() -> Any:
    """The loaded kernel, or ``None`` (``_gather.reason`` says why)."""
    return _gather.get()


def reads() -> tuple[torch.dtype, ...]:
    """The dtypes the loaded kernel reads in place: float32, bfloat16, and float16 where it was
    built with F16C; ``()`` where it is not loaded."""
    lib = kernel()
    if lib is None:
        return ()
    low = lib.low_dtypes()
    named = (d for d in (torch.bfloat16, torch.float16) if str(d).removeprefix("torch.") in low)
    return (torch.float32, *named)


def _ok(ok: torch.Tensor | None) -> tuple[int, int]:
    """``ok``'s address and heads as the C side takes them (``0, 0``: every entry allowed)."""
    return (0, 0) if ok is None else (ok.data_ptr(), ok.shape[1])


def _rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """q, k, v with a contiguous last dim (the rows are read in place), or ``None`` where the
    kernel does not read them (not loaded, not one dtype it reads)."""
    if q.dtype not in reads() or k.dtype != q.dtype or v.dtype != q.dtype:
        return None
    return tuple(t if t.stride(3) == 1 else t.contiguous() for t in (q, k, v))


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    idx: torch.Tensor,
    ok: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
    """``out (B, H, L, Dv)`` in q's dtype, ``lse (B, H, L)`` float32 and ``finite`` (False
    where a query, a score of an allowed pair or an output was not finite), or ``None`` where
    the kernel does not run (not loaded, q, k, v not all one dtype of :func:`reads`). ``idx``
    int64 ``(B, 1 | Hkv, L, k)`` contiguous, in ``-1 .. S - 1`` (checked by the caller: ``-1``
    names no key, and a key named twice in a row counts once), ``ok`` bool ``(B, 1 | H, L, k)``
    contiguous: which entries the spec's other rules allow (``None``: every entry)."""
    rows = _rows(q, k, v)
    if rows is None:
        return None
    q, k, v = rows
    B, H, L, _ = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    out = torch.empty(B, H, L, Dv, dtype=q.dtype)
    lse = torch.empty(B, H, L, dtype=torch.float32)
    args = array(
        "q",
        (q.data_ptr(), k.data_ptr(), v.data_ptr(), idx.data_ptr(), _ok(ok)[0],
         out.data_ptr(), lse.data_ptr(), torch.get_num_threads(), *q.shape, Hkv, S, Dv,
         *q.stride(), *k.stride(), *v.stride(), idx.shape[1], _ok(ok)[1], idx.shape[3],
         native.DTYPES[q.dtype]),
    )  # fmt: skip
    lib = kernel()
    rc = lib._lib.attnkit_gather_forward(args.buffer_info()[0], float(scale))
    if rc == 1:
        raise lib.error()
    return out, lse, rc == 0


def backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    idx: torch.Tensor,
    ok: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``dq``, ``dk``, ``dv`` in q's dtype, or ``None`` where the kernel does not run (as
    :func:`forward`; ``out``, ``dout`` in q's dtype, ``lse`` float32). Parallel over (batch row,
    key/value head, slice of query rows): each slice adds into float32 dK/dV rows of its own
    (scratch of O(S·D) per slice, summed after and written in the dtype), so that a call with
    fewer key/value heads than threads still uses every thread (:data:`ROW_SLICES`)."""
    rows = _rows(q, k, v)
    if rows is None or not (out.dtype == dout.dtype == q.dtype and lse.dtype == torch.float32):
        return None
    q, k, v = rows
    out, dout, lse = out.contiguous(), dout.contiguous(), lse.contiguous()  # (sum(): expanded)
    B, H, L, Dk = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    dq = torch.empty(B, H, L, Dk, dtype=q.dtype)
    dk = torch.empty(B, Hkv, S, Dk, dtype=q.dtype)
    dv = torch.empty(B, Hkv, S, Dv, dtype=q.dtype)
    args = array(
        "q",
        (q.data_ptr(), k.data_ptr(), v.data_ptr(), idx.data_ptr(), _ok(ok)[0],
         out.data_ptr(), dout.data_ptr(), lse.data_ptr(), dq.data_ptr(), dk.data_ptr(),
         dv.data_ptr(), torch.get_num_threads(), *q.shape, Hkv, S, Dv, *q.stride(),
         *k.stride(), *v.stride(), idx.shape[1], _ok(ok)[1], idx.shape[3], ROW_SLICES,
         native.DTYPES[q.dtype]),
    )  # fmt: skip
    lib = kernel()
    rc = lib._lib.attnkit_gather_backward(args.buffer_info()[0], float(scale))
    if rc != 0:
        raise lib.error()
    return dq, dk, dv
