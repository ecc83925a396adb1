"""attnkit's own CPU kernel for causal sliding-window attention (the ``blocked`` backend's band).

Dimension legend: B batch, H heads, L = S tokens, D head dim; ``w`` the window: query ``i``
attends to keys ``j`` with ``i - w < j <= i`` (``causal() & sliding_window(w)``).

torch's fused CPU flash kernel serves a band only as many short tiles (32 query rows against
``w + 32`` keys), where its small GEMMs and per-tile softmax reach about half of the machine's
GEMM throughput. The kernel in ``csrc/band_window.cpp`` does the band in one pass: per head
and chunk of query rows it packs ``K^T`` once into 16-key panels that slide with the window,
computes ``Q K^T`` and ``P V`` with register-blocked AVX2/FMA micro-kernels over the tiles
the band touches only, and an exact float32 softmax per row (``exp2`` polynomial, relative error
about 2.4e-7). The backward (``band_backward``) recomputes the scores from the saved
log-sum-exp over the same panels and accumulates dQ, dK, dV in one pass. See ``attnkit bench``
for what they gain.

It is compiled on first use with :func:`torch.utils.cpp_extension.load_inline` (gcc, about
30 s, cached under ``~/.cache/torch_extensions``; ``make setup`` builds it ahead). Where it
cannot be built or run (no AVX2, no compiler, ``ATTNKIT_BAND_KERNEL=0``), :func:`status` says
why and the blocked backend keeps to torch's kernel: ``attnkit.explain`` shows which one runs.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch

__all__ = ["BandPlan", "available", "build", "kernel", "main", "plan", "status"]

#: set to "0" to keep the blocked backend on torch's kernel for bands
ENV = "ATTNKIT_BAND_KERNEL"
#: bumped with every change to the C++ source's interface
NAME = "attnkit_band_window_v2"

_lock = threading.Lock()
_module: Any = None
_reason: str | None = None  # why the kernel is unavailable (None: not tried yet, or loaded)
_tried = False
build_seconds: float | None = None


def _cpu_reason() -> str | None:
    if os.environ.get(ENV, "1") == "0":
        return f"{ENV}=0 in the environment"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"this CPU has no AVX2 (torch reports {capability!r})"
    return None


def build() -> Any:
    """Compile (or load the cached build of) the kernel; returns the module or ``None``."""
    global _module, _reason, _tried, build_seconds
    with _lock:
        if _tried:
            return _module
        _tried = True
        _reason = _cpu_reason()
        if _reason is not None:
            return None
        try:
            from torch.utils.cpp_extension import load_inline

            source = resources.files("attnkit.backends.blocked").joinpath("csrc/band_window.cpp")
            t0 = time.perf_counter()
            _module = load_inline(  # type: ignore[no-untyped-call]
                name=NAME,
                cpp_sources=[source.read_text()],
                functions=["band_forward", "band_backward"],
                extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                no_implicit_headers=True,
                with_pytorch_error_handling=False,
                verbose=False,
            )
            build_seconds = time.perf_counter() - t0
        except Exception as e:  # no compiler, no ninja, a failed build: say so, run without
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            _reason = f"it could not be built ({type(e).__name__}: {first[:200]})"
            _module = None
        return _module


def available() -> bool:
    """Whether the kernel runs here (builds it on the first call)."""
    return build() is not None


def status() -> str:
    """One line: the kernel is in use, or why not."""
    if build() is not None:
        return "attnkit's AVX2 band kernel"
    return f"torch's fused kernel (attnkit's band kernel is off: {_reason})"


@dataclass(frozen=True)
class BandPlan:
    """Whether the band kernel serves one call: decided once, read by the forward, the backward
    and :func:`attnkit.explain`.

    ``window`` is the causal window when the mask is exactly ``causal() & sliding_window(w)``
    over the whole sequence (else ``None``: not a band); ``reason`` is ``None`` when the kernel
    runs the band, else why not (in explain's words).
    """

    window: int | None
    reason: str | None

    @property
    def serves(self) -> bool:
        return self.window is not None and self.reason is None


NOT_A_BAND = BandPlan(None, "not a causal sliding window over the whole sequence")


def plan(window: int | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> BandPlan:
    """The band decision for a whole-sequence call whose mask is a causal window ``window``."""
    if window is None:
        return NOT_A_BAND
    if q.device.type != "cpu":
        return BandPlan(window, f"attnkit's band kernel is CPU-only (q is on {q.device.type})")
    if not q.dtype == k.dtype == v.dtype == torch.float32:
        return BandPlan(
            window,
            f"attnkit's band kernel is float32-only (q is {q.dtype}): torch's fused kernel runs",
        )
    if not q.shape == k.shape == v.shape:
        return BandPlan(
            window, "attnkit's band kernel needs q, k, v of one shape (L = S, H = Hkv, Dk = Dv)"
        )
    return BandPlan(window, None if build() is not None else status())


def kernel() -> Any:
    """The loaded C++ module: ``band_forward(q, k, v, window, scale) -> (out, lse)`` and
    ``band_backward(q, k, v, out, dout, lse, window, scale) -> (dq, dk, dv)``, all float32
    ``(B, H, L, D)`` (lse ``(B, H, L)``, natural log). Call it only where :func:`plan` says the
    kernel serves; the C++ checks its own preconditions (shapes, dtype, contiguity)."""
    if _module is None:
        raise RuntimeError(f"the band kernel is not loaded: {status()}")
    return _module


def main() -> None:
    """Build ahead and say so (``make setup`` runs this)."""
    t0 = time.perf_counter()
    print(f"attnkit band kernel: {status()} ({time.perf_counter() - t0:.1f} s)")
