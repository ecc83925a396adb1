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

Builds: :mod:`~attnkit.backends.blocked.rowspan_builds` holds their one table (the AVX2 one,
which every CPU that runs the kernel runs, the AVX-512 one for float32 and bfloat16/float16 read
as float32, the AVX512-BF16 one for bfloat16 on the ``native`` CPU path) and its ``select()``,
which :func:`plan` asks; a plan's ``isa`` names the build that runs it, and
``rowspan_builds.status()``, explain and ``attnkit doctor`` say which.

The wheel carries it prebuilt (every build, behind a plain C ABI that serves every torch version:
:mod:`attnkit.backends.blocked.native`); an install from source compiles it once (``pip install``
/ ``make setup``), and where no prebuilt build serves it is compiled on first use (a C++
compiler, about 15 s; :mod:`attnkit.backends.blocked.jit`: one cached build per source, flags
and Python environment under ``~/.cache/attnkit/kernels``, behind a lock that dies with its
holder). Where it cannot be loaded, built or run (no AVX2, no prebuilt build and no compiler,
``ATTNKIT_SPAN_KERNEL=0``), ``rowspan_builds.status()`` says why and the blocked backend keeps
to torch's kernel: ``attnkit.explain`` shows which one runs.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from attnkit.backends.blocked import rowspan_builds
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
    "CAUSAL_MIN_PAIRS",
    "DENSE_MIN_PAIRS",
    "DENSE_MIN_ROWS",
    "DENSE_TRAIN_MIN_PAIRS",
    "NOT_SPANS",
    "SpanPlan",
    "clear_runs",
    "describe",
    "plan",
]

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
#: a plan's ``slopes`` where the spec has no ALiBi (and its ``keys`` where they have no holes)
NO_SLOPES = torch.empty(0)


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
    build that runs it (a row of :data:`~attnkit.backends.blocked.rowspan_builds.TABLE`:
    ``"avx2"``, ``"avx512"``, ``"avx512-bf16"``).
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


#: a build's ``isa`` and the dtype it reads (a plan's ``isa``, ``dtype``)
Runner = tuple[str, torch.dtype]
#: the runs of recent (spec, sizes, positions), keyed by the spec's cache key, and the plans of
#: them made for each build and dtype (each entry holds its spec, so that the tensors its key
#: names stay alive): computing them took ~0.3 ms at L = 4096, a few percent of a window call in
#: the kernel
_RUNS: OrderedDict[Hashable, tuple[MaskSpec | None, SpanPlan, dict[Runner, SpanPlan]]] = (
    OrderedDict()
)
RUNS_CACHE = 64


def clear_runs() -> None:
    """Forget the cached runs."""
    _RUNS.clear()


def _runs(
    spec: MaskSpec | None, L: int, S: int, at: tuple[int, int, int], by: Runner | None = None
) -> SpanPlan:
    """The part of :func:`plan` that reads the mask only (runs, ALiBi's slopes, the holes), the
    same for any q, k, v of these sizes, at ``at`` (``q_start, k_start, off``); with ``by``, as
    the plan of that build and dtype. Cached where the spec has a key (``None``, no mask: every
    key of every row, one run ``0 ..= S - 1``), so that a call planned again gets the same
    plan, and the decode kernel the same runs."""
    skey = ("no mask",) if spec is None else spec.key()
    key: Hashable = (skey, L, S, at)
    if skey is not None and key in _RUNS:
        _RUNS.move_to_end(key)
        _, p, made = _RUNS[key]
    else:
        p, made = _make_runs(spec, L, S, *at), {}
        if skey is not None:
            _RUNS[key] = (spec, p, made)
            while len(_RUNS) > RUNS_CACHE:
                _RUNS.popitem(last=False)
    if by is None or p.lo is None or (p.isa, p.dtype) == by:
        return p
    if by not in made:
        made[by] = dataclasses.replace(p, isa=by[0], dtype=by[1])
    return made[by]


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

    The dtype rule and the build are :func:`~attnkit.backends.blocked.rowspan_builds.select`'s:
    float32 always; bfloat16 and float16 (float16 only where the kernel was built with F16C)
    with ``in_dtype=True``, for a caller that takes out, dq, dk, dv in that dtype (the kernel
    reads them directly and computes in float32); anything else is refused, and the caller's
    other path (torch's fused kernel, on float32 copies on ``fp32-upcast``) runs. ``dot=True``
    (with ``in_dtype=True``: the ``native`` CPU path) takes bfloat16 only, and only where a
    build that multiplies it in bfloat16 runs (the AVX512-BF16 one: forward and backward, P
    and dS too, rounded to nearest even, as GPU flash kernels do, summed in float32); elsewhere
    torch's kernels take the tensors as they are."""
    if spec is not None and spec.from_tensor:
        return NOT_SPANS
    L, S = q.shape[2], k.shape[2]
    off = S - L if off is None else off
    build, why = rowspan_builds.select(q.dtype, in_dtype=in_dtype, dot=dot)
    by = None if build is None else (build.isa, q.dtype)
    p = _runs(spec, L, S, (q_start, k_start, off), by)
    if p.lo is None or p.reason is not None:
        return p
    if p.slopes.numel() not in (0, q.shape[1]):
        n = p.slopes.numel()
        return p.refuse(f"{spec!r} has {n} ALiBi slopes for {q.shape[1]} heads")
    if q.device.type != "cpu":
        return p.refuse(f"attnkit's row-span kernel is CPU-only (q is on {q.device.type})")
    read = rowspan_builds.route_of(q.dtype, in_dtype=in_dtype, dot=dot)
    if read is None or not q.dtype == k.dtype == v.dtype:
        return p.refuse(rowspan_builds.unread(q.dtype))
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0:
        return p.refuse("an empty dimension: nothing for the kernel to do")
    return p if build is not None else p.refuse(why)
