"""The gather kernel's C++ forward (``csrc/gather.cpp``), loaded as attnkit's other kernels
are (:mod:`~attnkit.backends.blocked.native`): float32, the selected K and V rows read in place,
one task per (batch row, key/value head, query row) forward and per (batch row, key/value
head, slice of query rows) backward, on torch's threads.

The wheel carries it prebuilt, and an install from source compiles it once, as the other builds;
where no prebuilt build serves it is compiled here on first use (the system's C++ compiler,
:mod:`~attnkit.backends.blocked.jit`); without one, or with ``ATTNKIT_SPAN_KERNEL=0``,
:mod:`~attnkit.backends.blocked.gather` runs its torch operations.
"""

from __future__ import annotations

import ctypes
from array import array
from typing import Any, ClassVar

import torch

from attnkit.backends.blocked import builds, native, rowspan_builds

__all__ = ["GATHER", "ROW_SLICES", "GatherKernel", "backward", "forward", "kernel"]

#: the build (AVX2 and FMA; one of the wheel's prebuilt builds, :data:`builds.ALL`)
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


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    idx: torch.Tensor,
    ok: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
    """``out (B, H, L, Dv)`` and ``lse (B, H, L)`` float32 and ``finite`` (False where a query,
    a score of an allowed pair or an output was not finite), or ``None`` where the kernel does
    not run (not loaded, not float32, rows not contiguous). ``idx`` int64 ``(B, 1 | Hkv, L,
    k)`` contiguous with no ``-1`` (clamped), ``ok`` bool ``(B, 1 | H, L, k)`` contiguous."""
    lib = kernel()
    if lib is None or any(t.dtype != torch.float32 for t in (q, k, v)):
        return None
    q, k, v = (t if t.stride(3) == 1 else t.contiguous() for t in (q, k, v))  # rows in place
    B, H, L, _ = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    out = torch.empty(B, H, L, Dv, dtype=torch.float32)
    lse = torch.empty(B, H, L, dtype=torch.float32)
    args = array(
        "q",
        (q.data_ptr(), k.data_ptr(), v.data_ptr(), idx.data_ptr(), ok.data_ptr(),
         out.data_ptr(), lse.data_ptr(), torch.get_num_threads(), *q.shape, Hkv, S, Dv,
         *q.stride(), *k.stride(), *v.stride(), idx.shape[1], ok.shape[1], idx.shape[3]),
    )  # fmt: skip
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
    ok: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``dq``, ``dk``, ``dv`` float32, or ``None`` where the kernel does not run (as
    :func:`forward`; ``out``, ``dout``, ``lse`` float32). Parallel over (batch row,
    key/value head, slice of query rows): each slice adds into dK/dV rows of its own (the
    first into ``dk``/``dv``, the others into scratch summed in after), so that a call with
    fewer key/value heads than threads still uses every thread (:data:`ROW_SLICES`)."""
    lib = kernel()
    out, dout, lse = out.contiguous(), dout.contiguous(), lse.contiguous()  # (sum(): expanded)
    if lib is None or any(t.dtype != torch.float32 for t in (q, k, v, out, dout, lse)):
        return None
    q, k, v = (t if t.stride(3) == 1 else t.contiguous() for t in (q, k, v))
    B, H, L, Dk = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    dq = torch.zeros(B, H, L, Dk, dtype=torch.float32)
    dk = torch.zeros(B, Hkv, S, Dk, dtype=torch.float32)
    dv = torch.zeros(B, Hkv, S, Dv, dtype=torch.float32)
    args = array(
        "q",
        (q.data_ptr(), k.data_ptr(), v.data_ptr(), idx.data_ptr(), ok.data_ptr(),
         out.data_ptr(), dout.data_ptr(), lse.data_ptr(), dq.data_ptr(), dk.data_ptr(),
         dv.data_ptr(), torch.get_num_threads(), *q.shape, Hkv, S, Dv, *q.stride(),
         *k.stride(), *v.stride(), idx.shape[1], ok.shape[1], idx.shape[3], ROW_SLICES),
    )  # fmt: skip
    rc = lib._lib.attnkit_gather_backward(args.buffer_info()[0], float(scale))
    if rc != 0:
        raise lib.error()
    return dq, dk, dv
