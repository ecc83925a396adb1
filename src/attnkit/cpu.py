"""The CPU's instruction sets and the path bfloat16/float16 attention takes on it.

torch's bfloat16 and float16 matmuls are fast only where the CPU multiplies those types itself
(AVX512-BF16 or AMX for bfloat16, AVX512-FP16 or AMX-FP16 for float16); elsewhere they run far
below float32 (docs/low_precision.md has the measurements). So every CPU call in bfloat16 or
float16 takes one of three paths, chosen once per process and dtype:

``native``
    the CPU has the type's dot-product instructions: the tensors stay in their dtype. bfloat16
    calls whose mask is one run of keys per row (causal, windows, documents, ...) go to
    attnkit's row-span kernel built for AVX512-BF16, which multiplies with the CPU's bf16 dot
    products (``vdpbf16ps``), forward and backward (P and dS rounded to bfloat16 for their
    products, as GPU flash kernels do; sums and softmax in float32); everything else goes to
    torch's kernels, which accumulate and take the softmax in float32.
``fp32-upcast``
    x86 with AVX2 and FMA (AVX-512F included) but no such instructions: q, k and v are
    converted to float32 once, attnkit's float32 code runs, and the output and the gradients are
    converted back to the input dtype; attnkit's row-span kernel (the ``blocked`` backend's,
    for masks of one run of keys per row) reads the bfloat16/float16 tensors directly instead,
    converting as it loads them, and writes its results in the input dtype.
``torch``
    no AVX2, or not x86: everything goes to torch as it is.

Every step keeps float32 accumulation and softmax; the output, ``lse``-derived results and the
gradients come back in the input dtype. The ``math``, ``sdpa`` and ``blocked`` backends follow
the path (``flex`` is compiled by torch and takes its tensors as they are);
:func:`attnkit.explain` and ``attnkit doctor`` name it and the CPU features it was chosen from.

The environment variable ``ATTNKIT_CPU_PATH`` (``native``, ``fp32-upcast``, ``torch``, or
``auto``/unset) forces a path. Forcing one this CPU cannot run (``native`` without the
instructions, ``fp32-upcast`` without AVX2) and any other value make every bfloat16/float16 CPU
call (and :func:`attnkit.explain`) raise :class:`~attnkit.AttentionInputError`, saying why;
float32/float64 and non-CPU calls never read the variable. The features are read at import; the
choice is cached per (value, dtype), so a call costs one environment lookup.

One more thing is done at import, for float32 and float64 on every path: :func:`warm_vml`. A
torch built with MKL hands contiguous float32/float64 ``exp``, ``log``, ``tanh``, ``sin``, ... to
oneMKL's vector math library (VML), each intra-op thread on its chunk of the tensor. oneMKL 2024.2
(what torch 2.13's CPU wheel links; the upstream report finds 2025.0 and later free of it) picks
each VML function's kernel on that function's first call in the process, and when that first
call runs on several threads at once, one thread can run a low-accuracy kernel for its whole
chunk (pytorch/pytorch#188792; the fix proposed there, #188791, is this same warm-up inside
torch): a float64 ``logsumexp`` of the blocked backend's tiles came back with errors of 1e-10 to
1e-9 in the rows of one thread, once, and exact on every later call. One single-threaded call of
each function first makes the choice before any tensor is split across threads.
"""

from __future__ import annotations

import functools
import os
import platform
import threading
from dataclasses import dataclass

import torch

from attnkit.errors import AttentionInputError

__all__ = [
    "ENV",
    "PATHS",
    "VML_FUNCTIONS",
    "VML_WARMED",
    "CpuFeatures",
    "describe",
    "features",
    "hardware_flags",
    "path_for",
    "release_buffers",
    "resolve",
    "to_float32",
    "unavailable",
    "upcasts",
    "warm_vml",
]

#: forces the path of bfloat16/float16 CPU calls
ENV = "ATTNKIT_CPU_PATH"
#: the paths, fastest first (the order ``auto`` tries them in)
PATHS = ("native", "fp32-upcast", "torch")
#: the /proc/cpuinfo flags the choice reads (and ``attnkit doctor`` shows)
FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_bf16",
    "avx512_fp16",
    "amx_bf16",
    "amx_fp16",
)
#: which flags give a dtype its own dot products (any one of them)
_NATIVE = {
    torch.bfloat16: ("avx512_bf16", "amx_bf16"),
    torch.float16: ("avx512_fp16", "amx_fp16"),
}
LOW = tuple(_NATIVE)  #: the dtypes a path applies to
_X86 = ("x86_64", "amd64", "i386", "i686", "x86")

_WHAT = {
    "native": "{dtype} tensors stay as they are: attnkit's AVX512-BF16 row-span kernel (bf16 "
    "dot products) takes bfloat16 where it serves the mask, torch's kernels (float32 "
    "accumulation) the rest",
    "fp32-upcast": "q, k, v are converted to float32 once (or read as they are by attnkit's "
    "row-span kernel), attnkit's float32 code runs, and the output and gradients come back in "
    "{dtype}",
    "torch": "{dtype} tensors go to torch's kernels as they are",
}


@dataclass(frozen=True)
class CpuFeatures:
    """What the path is chosen from: ``machine`` (``platform.machine()``), the :data:`FLAGS`
    the CPU reports (empty off Linux/x86), and torch's ``get_cpu_capability()``."""

    machine: str
    flags: frozenset[str]
    capability: str

    @property
    def x86(self) -> bool:
        return self.machine.lower() in _X86

    def __str__(self) -> str:
        have = [f for f in FLAGS if f in self.flags]
        flags = " ".join(have) if have else "none of " + " ".join(FLAGS)
        return f"{self.machine or 'unknown'}; flags: {flags}; torch capability: {self.capability}"


def _read_flags(machine: str) -> frozenset[str]:
    """Every flag of /proc/cpuinfo's first ``flags`` line (empty off Linux/x86)."""
    if machine.lower() not in _X86:
        return frozenset()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:  # not Linux
        pass
    return frozenset()


#: read at import, so that ``torch.compile`` traces a constant rather than a file read
_FLAGS = _read_flags(platform.machine())
_DETECTED = CpuFeatures(
    platform.machine(), _FLAGS & frozenset(FLAGS), torch.backends.cpu.get_cpu_capability()
)


def features() -> CpuFeatures:
    """This machine's CPU features (read once, at import)."""
    return _DETECTED


def hardware_flags() -> frozenset[str]:
    """Every flag the CPU reports (read once, at import): what compiled code may use. Unlike
    :func:`features`, which tests replace to simulate other CPUs, this is always the machine's
    own, so that a build never uses an instruction the CPU lacks."""
    return _FLAGS


def unavailable(path: str, dtype: torch.dtype, feats: CpuFeatures | None = None) -> str | None:
    """``None`` when ``path`` runs ``dtype`` on this CPU (or ``feats``), else why not."""
    f = features() if feats is None else feats
    if path == "native":
        need = _NATIVE[dtype]
        if not f.flags & set(need):
            name = str(dtype).removeprefix("torch.")
            return f"this CPU has no {' or '.join(need)} (torch's {name} matmuls are slow on it)"
    elif path == "fp32-upcast":
        if not f.x86:
            return f"it is for x86 CPUs, and this one is {f.machine or 'unknown'}"
        if not {"avx2", "fma"} <= f.flags:
            return "this CPU has no AVX2/FMA"
    elif path != "torch":
        raise ValueError(f"unknown path {path!r}")
    return None


def resolve(value: str, dtype: torch.dtype, feats: CpuFeatures) -> tuple[str | None, str]:
    """``(path, why)`` for an ``ATTNKIT_CPU_PATH`` value; ``(None, problem)`` when it is bad.
    Cached (``torch.compile`` traces the uncached rule, a few constant comparisons)."""
    if torch.compiler.is_compiling():
        return _resolve(value, dtype, feats)
    return _resolve_cached(value, dtype, feats)


def _resolve(value: str, dtype: torch.dtype, feats: CpuFeatures) -> tuple[str | None, str]:
    choice = value.strip().lower()
    if choice in ("", "auto"):
        for path in PATHS:
            if unavailable(path, dtype, feats) is None:
                return path, "chosen for this CPU"
    if choice not in PATHS:
        return None, f"{ENV}={value!r} is not a path"
    reason = unavailable(choice, dtype, feats)
    if reason is not None:
        return None, f"{ENV}={value!r} forces a path this CPU cannot run for {dtype}: {reason}"
    return choice, f"forced by {ENV}={value!r}"


_resolve_cached = functools.cache(_resolve)


def path_for(q: torch.Tensor, where: str) -> str | None:
    """The path of a call on ``q``: ``None`` unless q is bfloat16/float16 on the CPU. Raises
    :class:`~attnkit.AttentionInputError` for a bad ``ATTNKIT_CPU_PATH``."""
    if q.dtype not in LOW or not q.is_cpu:
        return None
    value = os.environ.get(ENV, "")
    path, why = resolve(value, q.dtype, features())
    if path is None:
        raise AttentionInputError(
            where,
            ENV,
            f"{why}.",
            got=f"{ENV}={value!r} for {q.dtype} on the CPU ({features()})",
            expected=(
                f"unset, 'auto', or a path this CPU runs for {q.dtype}: "
                + ", ".join(p for p in PATHS if unavailable(p, q.dtype) is None)
            ),
            fix=f"unset {ENV} (auto picks the fastest path this CPU runs)",
        )
    return path


_local = threading.local()
#: the largest conversion buffer kept between calls (bytes)
KEEP_BYTES = 64 << 20


def to_float32(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Contiguous float32 copies of ``ts`` (one device), in this thread's conversion buffer.

    The buffer is kept between calls (grown to the largest call up to :data:`KEEP_BYTES`, freed
    by :func:`release_buffers`; larger calls get fresh tensors, so no more is held): a fresh
    float32 tensor of tens of MB costs more in page faults than the conversion itself (see
    docs/low_precision.md). The copies are valid until this thread's next call: only code that
    is done with them before it returns may use this (the ``blocked`` backend's kernels;
    autograd never saves them). A buffer made under ``torch.inference_mode`` (an
    inference tensor, which cannot be written outside it) is replaced outside it.
    """
    total = sum(t.numel() for t in ts)
    # a long call: its compute dwarfs the page faults; keep nothing. A compiled graph keeps
    # nothing either: the buffer is Python state (and is_inference() cannot be traced)
    if total * 4 > KEEP_BYTES or torch.compiler.is_compiling():
        return tuple(t.to(torch.float32, memory_format=torch.contiguous_format) for t in ts)
    buf: torch.Tensor | None = getattr(_local, "buf", None)
    stale = buf is not None and buf.is_inference() and not torch.is_inference_mode_enabled()
    if buf is None or stale or buf.numel() < total or buf.device != ts[0].device:
        buf = _local.buf = None  # free the old one first
        buf = _local.buf = torch.empty(total, dtype=torch.float32, device=ts[0].device)
    out, at = [], 0
    for t in ts:
        n = t.numel()
        out.append(buf[at : at + n].view(t.shape).copy_(t))
        at += n
    return tuple(out)


def release_buffers() -> None:
    """Free this thread's conversion buffer (:func:`to_float32`)."""
    _local.buf = None


def upcasts(path: str | None) -> bool:
    """Whether a call on ``path`` converts q, k, v to float32 (and its results back)."""
    return path == "fp32-upcast"


def describe(path: str | None, dtype: torch.dtype) -> str:
    """One line for :func:`attnkit.explain`: the path, why, and what it does."""
    if path is None:
        return "no CPU path (not a bfloat16/float16 call on the CPU)"
    name = str(dtype).replace("torch.", "")
    why = resolve(os.environ.get(ENV, ""), dtype, features())[1]
    if why == "chosen for this CPU" and path != "native":  # say what it lacks
        why += f": {unavailable(PATHS[PATHS.index(path) - 1], dtype)}"
    return f"{path} ({why}): " + _WHAT[path].format(dtype=name)


#: torch's elementwise functions that a build with MKL hands to oneMKL's VML for float32 and
#: float64 (``IMPLEMENT_VML_MKL`` in aten/src/ATen/cpu/vml.h, across torch versions): the
#: attention paths call ``exp`` and ``log`` (``logsumexp``) and ``tanh`` (the soft-cap), the
#: models ``sin``, ``cos``, ``sqrt`` and more; each one warmed costs a few microseconds, once
VML_FUNCTIONS = (
    "acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "expm1", "log", "log10",
    "log1p", "log2", "sin", "sqrt", "tan", "tanh", "trunc",
)  # fmt: skip


def warm_vml() -> tuple[tuple[str, torch.dtype], ...]:
    """Call each of :data:`VML_FUNCTIONS` once on a one-element float32 and float64 CPU tensor
    (one thread: torch splits a tensor across threads only from 2048 elements), so that oneMKL
    has chosen each function's kernel before a call splits a tensor across threads (see the
    module docstring: a first call on several threads at once can run a low-accuracy kernel on
    one of them). Run once, at import, where torch has MKL; returns the (function, dtype) pairs
    it called (:data:`VML_WARMED`). Idempotent and cheap (about 1 ms the first time, 0.2 ms
    after)."""
    done: list[tuple[str, torch.dtype]] = []
    for dtype in (torch.float32, torch.float64):
        x = torch.full((1,), 0.5, dtype=dtype, device="cpu")
        for name in VML_FUNCTIONS:
            fn = getattr(torch, name, None)
            if fn is not None:
                fn(x)
                done.append((name, dtype))
    return tuple(done)


_MKL: bool = torch.backends.mkl.is_available()  # type: ignore[no-untyped-call]
#: what :func:`warm_vml` called at import (empty where torch has no MKL)
VML_WARMED = warm_vml() if _MKL else ()
