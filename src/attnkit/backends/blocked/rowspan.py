"""attnkit's row-span kernel: the ``blocked`` backend's own CPU kernel for every mask that
allows one run of keys per query row.

Dimension legend: B batch, H query heads, Hkv key/value heads (``H = g * Hkv``), L query rows,
S keys, Dk query/key head dim, Dv value head dim; ``lo, hi`` ``(B', L)`` the inclusive run of
local keys row ``i`` attends (``B'`` = 1 or B), non-decreasing along the rows.

:func:`attnkit.masks.row_spans` turns a spec into runs where it is one (causal, sliding windows,
documents, prefix-LM, contiguous key padding, and their intersections, at any global offsets; ALiBi
``&`` any of them: :func:`attnkit.masks.split_alibi` gives its slopes, which the kernel adds as it
computes the scores, as it applies a logit soft-cap ``c tanh(s / c)``, derivative included); a call
with no mask is one run of every key per row. :func:`plan` makes the one decision per call
(:class:`SpanPlan`) that the forward, the backward and :func:`attnkit.explain` read. torch's fused
CPU flash kernel would serve such masks only as many tiles, where its small GEMMs and per-tile
softmax reach about half of the machine's GEMM throughput. The kernel in ``csrc/row_span.cpp`` does
them in one pass: per (batch, kv head) and chunk of query rows it packs ``K^T`` once into 16-key
panels that move forward with the spans, shared by the ``g`` query heads of the group (grouped-query
heads are never repeated), computes ``Q K^T`` and ``P V`` with register-blocked FMA micro-kernels
over the tiles the spans touch only, and an exact float32 softmax per row (``exp2`` polynomial,
relative error about 2.4e-7). The backward (``span_backward``) recomputes the scores
from the saved log-sum-exp over the same panels, writes dQ per row and sums dK, dV over the group's
heads (each work item's sums are added to the result one stripe of keys at a time in the order the
items are handed out, whatever order the threads finish them in: forward and backward give the same
bits on every run with the same number of threads, as ``torch.use_deterministic_algorithms`` asks).
A row whose run is empty gets output 0, log-sum-exp ``-inf`` and gradient 0.

It reads float32, and bfloat16 or float16 (float16 where the CPU has F16C) directly: q, k, v
(and out, dout in the backward) are converted to float32 as the kernel packs its panels and loads
its rows (bfloat16 to float32 is a 16-bit shift), everything inside stays float32, ``lse`` is
float32, and out, dq, dk, dv come back in the input dtype, rounded to nearest even as torch
rounds (the same numbers as the kernel on float32 copies, converted back). :func:`plan` takes
bfloat16/float16 only for a caller that wants results in that dtype (``in_dtype=True``: the
blocked backend on the ``fp32-upcast`` CPU path, :mod:`attnkit.cpu`), since
:func:`~attnkit.backends.blocked.forward_with_lse` otherwise returns float32.

Builds (:mod:`~attnkit.backends.blocked.builds`): the AVX2 one (AVX2 + FMA: every CPU the kernel
runs on; where it does not load, the kernel is off), the AVX-512 one (``-DRS_AVX512``: the same
kernel with its float32 micro-kernels, softmax and backward rows in 512-bit registers), which runs
float32 (and bfloat16/float16 read as float32) in its place where ``/proc/cpuinfo`` has
:data:`AVX512_FLAGS` (:func:`running`; ``ATTNKIT_ROWSPAN_ISA=avx2`` keeps the AVX2 one, to measure
or test one against the other), and the AVX512-BF16 one (:func:`build_dot`) for bfloat16 on the
``native`` CPU path. A plan's ``isa`` names the build that runs it; :func:`status`, explain and
``attnkit doctor`` say which.

The wheel carries it prebuilt (every build, behind a plain C ABI that serves every torch version:
:mod:`attnkit.backends.blocked.native`); an install from source compiles it once (``pip install``
/ ``make setup``), and where no prebuilt build serves it is compiled on first use (a C++
compiler, about 15 s; :mod:`attnkit.backends.blocked.jit`: one cached build per source, flags
and Python environment under ``~/.cache/attnkit/kernels``, behind a lock that dies with its
holder). Where it cannot be loaded, built or run (no AVX2, no prebuilt build and no compiler,
``ATTNKIT_SPAN_KERNEL=0``), :func:`status` says why and the blocked backend keeps to torch's
kernel: ``attnkit.explain`` shows which one runs.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from attnkit.backends.blocked import builds, native
from attnkit.cpu import hardware_flags
from attnkit.masks import (
    MaskSpec,
    causal_window,
    key_holes,
    local_keys,
    row_spans,
    split_alibi,
    unmasked,
)

__all__ = [
    "AVX512",
    "AVX512_FLAGS",
    "DOT",
    "ISA_ENV",
    "SpanPlan",
    "available",
    "avx512_status",
    "build",
    "build_avx512",
    "build_dot",
    "dot_status",
    "isa_choice",
    "kernel",
    "main",
    "plan",
    "running",
    "status",
]

#: set to "0" to keep the blocked backend on torch's kernel for row spans
ENV = "ATTNKIT_SPAN_KERNEL"
#: ``auto`` takes the kernel for plain causal calls (no other mask) from this many ``L x S``
#: pairs: measured 1.2-1.6x faster than SDPA's ``is_causal`` forward at L = 1k-8k, 1.1-1.3x
#: forward + backward at 4k (float32, 2 AVX2 cores; ``benchmarks/kernel_spans.py``); smaller
#: calls were not measured, so they keep to SDPA
CAUSAL_MIN_PAIRS = 1024 * 1024
#: ``auto`` takes the kernel for unmasked calls (no mask, not causal) from this many query rows
#: and ``L x S`` pairs in a forward (no gradient) and from ``DENSE_TRAIN_MIN_PAIRS`` pairs in
#: training: where it measured faster than SDPA (docs/benchmarks.md, "Dense prefill"); smaller
#: calls keep to SDPA
DENSE_MIN_ROWS = 1024
DENSE_MIN_PAIRS = 1024 * 1024
DENSE_TRAIN_MIN_PAIRS = 1024 * 1024
#: the kernel's files (:mod:`~attnkit.backends.blocked.builds`: its AVX2 build)
NAME = builds.ROW_SPAN.name

#: a plan's ``slopes`` where the spec has no ALiBi (and its ``keys`` where they have no holes)
NO_SLOPES = torch.empty(0)

#: the instruction set of the kernel's AVX-512 build (float32 code in zmm registers), which
#: runs float32 (and bfloat16/float16 read directly) in place of the AVX2 build where the CPU
#: has :data:`AVX512_FLAGS`
AVX512 = builds.ROW_SPAN_AVX512.isa
#: the /proc/cpuinfo flags the AVX-512 build needs
AVX512_FLAGS = ("avx512f", "avx512dq", "avx512bw", "avx512vl")
#: ``auto`` (the default: the AVX-512 build where the CPU has it, else the AVX2 one) or
#: ``avx2`` (the AVX2 build everywhere: for measuring and testing one against the other)
ISA_ENV = "ATTNKIT_ROWSPAN_ISA"
ISAS = ("auto", "avx2")

#: the instruction set of the kernel's bfloat16 build, for bfloat16 on the ``native`` CPU path
DOT = "avx512-bf16"
#: the /proc/cpuinfo flags that build needs (dot products, and AVX-512's masked loads/stores)
DOT_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")


def _cpu_reason() -> str | None:
    if os.environ.get(ENV, "1") == "0":
        return f"{ENV}=0 in the environment"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"this CPU has no AVX2 (torch reports {capability!r})"
    return None


def _has_f16c() -> bool:
    """Whether the CPU has F16C (float16 <-> float32 conversions): the kernel is built with
    ``-mf16c`` and reads float16 only then (not on Linux: without it; bfloat16 needs nothing
    more than AVX2)."""
    return "f16c" in hardware_flags()


def _no_avx512_flags() -> str | None:
    missing = [f for f in AVX512_FLAGS if f not in hardware_flags()]
    return f"this CPU has no {', '.join(missing)}" if missing else None


def isa_choice() -> str:
    """``ATTNKIT_ROWSPAN_ISA`` (``auto`` where unset); ``ValueError`` naming the choices."""
    raw = os.environ.get(ISA_ENV, "auto")
    if raw not in ISAS:
        raise ValueError(f"{ISA_ENV}={raw!r}: expected one of {', '.join(ISAS)}")
    return raw


def _no_dot_flags() -> str | None:
    missing = [f for f in DOT_FLAGS if f not in hardware_flags()]
    return f"this CPU has no {', '.join(missing)}" if missing else None


#: the AVX2 build, the AVX-512 one and the AVX512-BF16 one, each loaded on first use
_span = native.Lazy(builds.ROW_SPAN, native.SpanKernel, _cpu_reason)
_wide = native.Lazy(builds.ROW_SPAN_AVX512, native.SpanKernel, _no_avx512_flags)
_dot = native.Lazy(builds.ROW_SPAN_DOT, native.SpanKernel, _no_dot_flags)


def build() -> Any:
    """Load the kernel's AVX2 build (the package's prebuilt build, else one compiled here:
    :func:`attnkit.backends.blocked.native.load`); returns it or ``None``. Every CPU that runs
    the kernel runs this build: where it does not load, the kernel is off."""
    return _span.get()


def _no_avx512() -> str | None:
    """Why float32 does not run in the AVX-512 build here (``None``: it does); the switch is
    read on every call, the build loaded once."""
    if build() is None:
        return status()
    if isa_choice() == "avx2":
        return f"{ISA_ENV}=avx2 in the environment"
    if _wide.get() is None:
        return _wide.reason
    return None


def build_avx512() -> Any:
    """The kernel's AVX-512 build (loaded on first use), where it runs float32 here: the CPU
    has :data:`AVX512_FLAGS`, ``ATTNKIT_ROWSPAN_ISA`` is not ``avx2`` and a build serves;
    else ``None`` (:func:`avx512_status` says why)."""
    return _wide.module if _no_avx512() is None else None


def running() -> Any:
    """The build that runs float32 (and bfloat16/float16 read directly on the fp32-upcast
    path): the AVX-512 one where it serves (:func:`build_avx512`), else the AVX2 one; ``None``
    where the kernel is off."""
    return build_avx512() or build()


def _isa() -> str:
    """The instruction set of :func:`running`'s build (a plan's ``isa``)."""
    return AVX512 if build_avx512() is not None else "avx2"


def avx512_status() -> str:
    """One line: whether the AVX-512 build runs float32 here, or why not."""
    why = _no_avx512()
    if why is None:
        return "the AVX-512 build runs float32 (and bfloat16/float16 read as float32)"
    return f"the AVX2 build runs float32 (no AVX-512 build: {why})"


def build_dot() -> Any:
    """Load the kernel's AVX512-BF16 build, which multiplies bfloat16 q, k, v, dout (and P,
    dS) with the CPU's bf16 dot products (``vdpbf16ps``), forward and backward; ``None`` where
    the CPU lacks :data:`DOT_FLAGS` or no build serves (:func:`dot_status` says why). Its
    float32 and float16 code is the AVX-512 build's (``-DRS_AVX512``), but a plan sends only
    bfloat16 on the native path to it: everything else runs in :func:`running`'s build."""
    if build() is None:  # the same switches and requirements as the AVX2 build first
        return None
    return _dot.get()


def available() -> bool:
    """Whether the kernel runs here (builds it on the first call)."""
    return build() is not None


def status() -> str:
    """One line: the kernel is in use (naming the build that runs float32), or why not."""
    if build() is None:
        return f"torch's fused kernel (attnkit's row-span kernel is off: {_span.reason})"
    if build_avx512() is not None:
        return "attnkit's AVX-512 row-span kernel"
    return "attnkit's AVX2 row-span kernel"


def dot_status() -> str:
    """One line: the AVX512-BF16 build is in use for bfloat16 on the ``native`` path, or why
    not."""
    if build_dot() is not None:
        return "attnkit's AVX512-BF16 row-span kernel (bf16 dot products)"
    why = _dot.reason if build() is not None else status()
    return f"no AVX512-BF16 row-span kernel ({why})"


@dataclass(frozen=True)
class SpanPlan:
    """Whether the row-span kernel serves one call: decided once, read by the forward, the
    backward and :func:`attnkit.explain`.

    ``lo``, ``hi`` are the runs of keys (int64 ``(B', L)``, local, inclusive; see
    :func:`attnkit.masks.row_spans`) when the mask is one run per row, else ``None``; ``what``
    names the mask for explain; ``reason`` is ``None`` when the kernel runs the call, else why
    not (in explain's words); ``dtype`` is the dtype the kernel reads q, k, v in (float32, or
    bfloat16/float16 read directly, for a plan made with ``in_dtype=True``), and returns out,
    dq, dk, dv in. ``slopes`` are ALiBi's ``(H,)`` (float32, CPU) where the spec has it (else
    an empty tensor), added as ``-slope_h * |i + d0 - j|`` for local query row ``i`` and local
    key ``j``; ``keys`` the holes a key mask leaves inside the runs (float32 ``(B', S + 8)``, 0
    or ``-inf``; empty where there are none; :func:`attnkit.masks.key_holes`); ``isa`` the
    build that runs it: ``"avx2"``, :data:`AVX512` (float32 code in zmm registers, where the
    CPU has AVX-512: :func:`running`), or :data:`DOT` (bfloat16 with the CPU's dot
    products).
    """

    lo: torch.Tensor | None
    hi: torch.Tensor | None
    what: str
    reason: str | None
    dtype: torch.dtype = torch.float32
    slopes: torch.Tensor = field(default_factory=lambda: NO_SLOPES)
    d0: int = 0
    keys: torch.Tensor = field(default_factory=lambda: NO_SLOPES)
    isa: str = "avx2"

    @property
    def serves(self) -> bool:
        return self.lo is not None and self.reason is None

    def refuse(self, reason: str) -> SpanPlan:
        """The same spans, not run by the kernel, because of ``reason``."""
        return dataclasses.replace(self, reason=reason)


NOT_SPANS = SpanPlan(None, None, "", "not one run of keys per query row")


def describe(spec: MaskSpec | None) -> str:
    """The mask in explain's words."""
    if spec is None:
        return "no mask (every key of every row)"
    w = causal_window(spec)
    return f"causal sliding window {w}" if w is not None else f"row spans of {spec!r}"


#: the runs of recent (spec, sizes, positions, float32 build), keyed by the spec's cache key
#: (each entry holds its spec, so that the tensors its key names stay alive): computing them
#: took ~0.3 ms at L = 4096, a few percent of a window call in the kernel
_RUNS: OrderedDict[Hashable, tuple[MaskSpec | None, SpanPlan]] = OrderedDict()
RUNS_CACHE = 64


def clear_runs() -> None:
    """Forget the cached runs."""
    _RUNS.clear()


def _runs(spec: MaskSpec | None, L: int, S: int, q_start: int, k_start: int, off: int) -> SpanPlan:
    """The part of :func:`plan` that reads the mask only (runs, ALiBi's slopes, the holes), the
    same for any q, k, v of these sizes, its ``isa`` the build float32 runs in here (:func:`_isa`):
    cached where the spec has a key (``None``, no mask: every key of every row, one run
    ``0 ..= S - 1``)."""
    isa = _isa()
    skey = ("no mask",) if spec is None else spec.key()
    key: Hashable = (skey, L, S, q_start, k_start, off, isa)
    if skey is not None and key in _RUNS:
        _RUNS.move_to_end(key)
        return _RUNS[key][1]
    p = _make_runs(spec, L, S, q_start, k_start, off)
    if p.lo is not None:
        p = dataclasses.replace(p, isa=isa)
    if skey is not None:
        _RUNS[key] = (spec, p)
        while len(_RUNS) > RUNS_CACHE:
            _RUNS.popitem(last=False)
    return p


#: the cache key of :func:`attnkit.masks.unmasked`, the spec that says "no mask": every key
_UNMASKED = unmasked().key()


def _make_runs(
    spec: MaskSpec | None, L: int, S: int, q_start: int, k_start: int, off: int
) -> SpanPlan:
    rule: MaskSpec | None = spec
    slopes = NO_SLOPES
    if spec is not None and spec.has_bias:  # ALiBi: its slopes, and the runs of its rule
        parts = split_alibi(spec)
        if parts is None:
            return NOT_SPANS
        slopes, rule = parts[0].to("cpu", torch.float32), parts[1]
    if rule is not None and rule.key() == _UNMASKED:  # masks.unmasked(): no mask, said so
        rule = None
    spans: tuple[torch.Tensor, torch.Tensor] | None
    holes = None  # a key mask with holes: the runs of its hull, the holes masked per key
    if rule is None:  # every key
        spans = (torch.zeros(1, L, dtype=torch.long), torch.full((1, L), S - 1, dtype=torch.long))
    else:
        rule, holes = key_holes(rule)
        spans = row_spans(rule, L, S, q_start=q_start, k_start=k_start, off=off)
    if spans is None:
        return NOT_SPANS
    lo, hi = spans
    keys, what = NO_SLOPES, describe(spec)
    if holes is not None:  # 0 where a key may be attended, -inf at holes and past S
        keys = torch.full((holes.shape[0], S + 8), float("-inf"))
        keys[:, :S].masked_fill_(local_keys(holes, k_start, S), 0.0)
        what += " (holes in the keys masked per key)"
    p = SpanPlan(lo, hi, what, None, slopes=slopes, d0=q_start + off - k_start, keys=keys)
    if bool((lo[:, 1:] < lo[:, :-1]).any() or (hi[:, 1:] < hi[:, :-1]).any()):
        return p.refuse("its runs of keys do not move forward along the rows")
    return p


def plan(
    spec: MaskSpec | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_start: int = 0,
    k_start: int = 0,
    off: int | None = None,
    in_dtype: bool = False,
    dot: bool = False,
) -> SpanPlan:
    """The kernel decision for the block of ``q`` against ``k``/``v`` (global positions and
    offset as in :func:`attnkit.masks.row_spans`); ``spec=None`` (no mask) is one run of every
    key per row, at any offsets.

    The dtype rule: float32 always; bfloat16 and float16 (float16 only where the kernel was
    built with F16C) with ``in_dtype=True``, for a caller that takes out, dq, dk, dv in that
    dtype (the kernel reads them directly and computes in float32); anything else is refused,
    and the caller's other path (torch's fused kernel, on float32 copies on ``fp32-upcast``)
    runs. ``dot=True`` (with ``in_dtype=True``: the ``native`` CPU path, where the CPU has
    bfloat16 dot products) takes bfloat16 only, and only where the AVX512-BF16 build runs
    (:func:`build_dot`): it multiplies in bfloat16, forward and backward (P and dS too, rounded
    to nearest even, as GPU flash kernels do) and sums in float32; elsewhere torch's kernels
    take the tensors as they are."""
    if spec is not None and spec.from_tensor:
        return NOT_SPANS
    L, S = q.shape[2], k.shape[2]
    off = S - L if off is None else off
    p = _runs(spec, L, S, q_start, k_start, off)
    if p.lo is None or p.reason is not None:
        return p
    if p.slopes.numel() not in (0, q.shape[1]):
        n = p.slopes.numel()
        return p.refuse(f"{spec!r} has {n} ALiBi slopes for {q.shape[1]} heads")
    if q.device.type != "cpu":
        return p.refuse(f"attnkit's row-span kernel is CPU-only (q is on {q.device.type})")
    low = in_dtype and q.dtype in (torch.bfloat16, torch.float16)
    if not (q.dtype == k.dtype == v.dtype and (q.dtype == torch.float32 or low)):
        return p.refuse(
            f"attnkit's row-span kernel reads float32, bfloat16/float16 only on the fp32-upcast "
            f"CPU path and bfloat16 on the native one (q is {q.dtype}): torch's fused kernel runs"
        )
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0:
        return p.refuse("an empty dimension: nothing for the kernel to do")
    if build() is None:
        return p.refuse(status())
    if low and dot:
        if q.dtype != torch.bfloat16:
            return p.refuse(
                f"on the native CPU path attnkit's row-span kernel takes bfloat16 only (q is "
                f"{q.dtype}): torch's kernels run on it as it is"
            )
        if build_dot() is None:
            return p.refuse(f"{dot_status()}: torch's kernels run on bfloat16 as it is")
        return dataclasses.replace(p, dtype=q.dtype, isa=DOT)
    if low:
        p = dataclasses.replace(p, dtype=q.dtype)
        name = str(q.dtype).removeprefix("torch.")
        if name not in _lazy(p.isa).module.low_dtypes():
            return p.refuse(
                f"attnkit's row-span kernel was built without F16C (this CPU has none), so it "
                f"does not read {name}"
            )
    return p


def _lazy(isa: str) -> native.Lazy:
    """The build of ``isa`` (a plan's)."""
    return {AVX512: _wide, DOT: _dot}.get(isa, _span)


def kernel(isa: str = "avx2") -> Any:
    """The loaded C++ module: ``span_forward(q, k, v, spans, scale, softcap) -> (out, lse)``
    (``span_forward_finite``: the same and whether every q, k, v element it read was finite)
    and ``span_backward(q, k, v, out, dout, lse, spans, scale, softcap) -> (dq, dk, dv)``;
    ``spans`` a :class:`SpanPlan` (or any object with its ``lo``, ``hi``, ``slopes``, ``d0``,
    ``keys``: :class:`attnkit.backends.blocked.native.Spans`); ``softcap`` > 0 caps the scaled
    scores (``c tanh(s / c)``, 0: none), a non-empty ``slopes`` ``(H,)`` adds ALiBi's
    ``-slope_h |i + d0 - j|`` and a non-empty ``keys`` ``(1 or B, >= S + 8)`` each key's 0 or
    ``-inf``: q ``(B, H, L, Dk)``, k ``(B, Hkv, S, Dk)``, v ``(B, Hkv, S, Dv)``, out
    ``(B, H, L, Dv)``, lse ``(B, H, L)`` (natural log, float32), ``lo``/``hi`` int64
    ``(1 or B, L)``; q, k, v, out,
    dout, dq, dk, dv all float32, or all the dtype of q among ``low_dtypes()``
    (``["bfloat16", "float16"]``, without float16 where built without F16C). Call it only where
    :func:`plan` says the kernel serves; the C++ checks what its memory safety needs (shapes,
    dtypes, spans in order). ``isa``: a plan's (``"avx2"``: the AVX2 build; :data:`AVX512`: the
    AVX-512 build, loaded here where the CPU has it, whatever ``ATTNKIT_ROWSPAN_ISA`` says;
    :data:`DOT`: the AVX512-BF16 build)."""
    if isa == AVX512:
        if build() is None or _wide.get() is None:
            why = _wide.reason if build() is not None else status()
            raise RuntimeError(f"the row-span kernel's AVX-512 build is not loaded: {why}")
        return _wide.module
    if isa == DOT:
        if _dot.module is None:
            raise RuntimeError(f"the row-span kernel's bf16 build is not loaded: {dot_status()}")
        return _dot.module
    if build() is None:
        raise RuntimeError(f"the row-span kernel is not loaded: {status()}")
    return _span.module


def main() -> None:
    """Build ahead and say so (``make setup`` runs this)."""
    t0 = time.perf_counter()
    line = f"{status()}; {avx512_status()}" if build() is not None else status()
    print(f"attnkit row-span kernel: {line} ({time.perf_counter() - t0:.1f} s)")
    t0 = time.perf_counter()
    line = dot_status()
    print(f"attnkit row-span kernel for bfloat16: {line} ({time.perf_counter() - t0:.1f} s)")
