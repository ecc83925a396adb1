"""attnkit's grouped-query decode kernel (``csrc/decode.cpp``): a few queries against a long
key/value cache, at the speed of reading the cache once.

Dimension legend: B batch, H query heads, Hkv key/value heads, g = H // Hkv query heads per
key/value head, L query length, S key length, Dk query/key head dim, Dv value head dim.

A decode step (L <= :data:`MAX_L` queries against a cache of S keys) is bound by
memory: every key and value it may see has to be read, and little else has to be done. The
kernel reads each key/value head's K and V once for its ``g`` query heads and all L rows (no
repeat, no copy; K and V may be strided views of a cache buffer, ``(B, Hkv, N, D)[:, :, :S]``,
with a contiguous last dimension), splits the keys into chunks across
``torch.get_num_threads()`` threads (partial max, sum and output per chunk, merged by the
log-sum-exp rule), and reads only the keys a row may see: the runs of keys of
:func:`attnkit.masks.row_spans` (no mask, end-aligned causal, sliding windows, per-sequence
cache lengths of a ragged batch, contiguous left/right key padding), the same runs the
row-span kernel reads (:mod:`~attnkit.backends.blocked.rowspan`, whose run cache this shares).
float32, and bfloat16/float16 read directly (converted as they are loaded, float32 inside, the
output in the input dtype). Forward only: a call that autograd will differentiate goes to the
row-span kernel or the tiles, which have a backward.

NaN and inf: the kernel reports whether a query, a score of a key some row may see, or an
output was not finite; only then does the dispatcher run its exact non-finite rule
(:mod:`attnkit.backends.nonfinite`), so a finite decode call reads q, k and v once, not twice.

The blocked backend's ``decide`` makes the :class:`DecodePlan` (:func:`plan`) and its rule
takes the kernel wherever the plan serves; :func:`attnkit.explain` says when it runs and why
not. The same switch as the row-span kernel (``ATTNKIT_SPAN_KERNEL=0``) turns it off, and a
machine without AVX2, or without the prebuilt build and a compiler, runs without it
(:func:`status` says why; :mod:`attnkit.backends.blocked.native` loads it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from attnkit.backends import nonfinite
from attnkit.backends.blocked import builds, native, rowspan, rowspan_builds
from attnkit.backends.blocked.kernels import OP, Direct
from attnkit.call import AttentionCall

__all__ = [
    "MAX_L",
    "DecodePlan",
    "available",
    "build",
    "direct",
    "kernel",
    "main",
    "plan",
    "shaped",
    "status",
]

#: the kernel's file (:mod:`~attnkit.backends.blocked.builds`)
NAME = builds.DECODE.name
#: the most query rows per call the kernel serves (a decode step, or a few speculative tokens)
MAX_L = 16

#: the kernel, loaded on first use (the row-span kernel's switch and CPU requirements)
_decode = native.Lazy(builds.DECODE, native.DecodeKernel, rowspan_builds.cpu_reason)


def build() -> Any:
    """Load the kernel (the package's prebuilt build, else one compiled here:
    :func:`attnkit.backends.blocked.native.load`); returns it or ``None`` (the row-span
    kernel's switches and requirements: ``ATTNKIT_SPAN_KERNEL=0``, AVX2)."""
    return _decode.get()


def available() -> bool:
    """Whether the kernel runs here (builds it on the first call)."""
    return build() is not None


def status() -> str:
    """One line: the kernel is in use, or why not (the row-span kernel's switch and
    requirements, :func:`attnkit.backends.blocked.rowspan_builds.cpu_reason`, are this
    kernel's too)."""
    if build() is not None:
        return "attnkit's AVX2 decode kernel"
    return f"attnkit's decode kernel is off: {_decode.reason}"


def kernel() -> Any:
    """The loaded C++ module: ``decode_forward(q, k, v, runs, scale) -> (out, lse, finite)``
    (q ``(B, H, L, Dk)``, k ``(B, Hkv, S, Dk)``, v ``(B, Hkv, S, Dv)`` with a contiguous last
    dimension, all float32 or all one of ``low_dtypes()``; ``runs`` a :class:`DecodePlan`, or
    any object with its ``lo``/``hi``: int64 ``(1 or B, L)`` local inclusive runs; out in q's
    dtype, ``lse (B, H, L)`` float32 natural log, ``finite`` False where a query, a score of a
    key a row may see, or an output was not finite), and ``bind(q, k, v, runs, scale)`` (the
    same for repeated calls of one signature, returning the output or ``None``). Call it only
    where :func:`plan` serves."""
    module = build()
    if module is None:
        raise RuntimeError(f"the decode kernel is not loaded: {status()}")
    return module


@dataclass(frozen=True)
class DecodePlan:
    """Whether the decode kernel runs one call: ``lo``, ``hi`` the runs of keys (int64
    ``(B', L)``, local, inclusive) when the mask has them, ``what`` the mask in explain's words,
    ``reason`` ``None`` when the kernel runs the call, else why not. A plan that serves is the
    call's :class:`~attnkit.backends.blocked.kernels.KernelPlan` (forward only)."""

    lo: torch.Tensor | None
    hi: torch.Tensor | None
    what: str
    reason: str | None

    #: the kernel in explain's words
    name = "the decode kernel"
    #: a compiled call plans blocks inside the custom op, which has no decode plan
    under_compile = (
        f"under torch.compile it runs as one custom op ({OP}) on the row-span kernel or "
        "tiles, not the decode kernel"
    )

    @property
    def serves(self) -> bool:
        return self.reason is None and self.lo is not None

    #: the kernel reports NaN/inf itself (read by :func:`attnkit.backends.nonfinite.serve`)
    @property
    def checks_finite(self) -> bool:
        return self.serves

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``out (B, H, L, Dv)`` in q's dtype and ``lse (B, H, L)`` float32 (the plan must
        serve the call); raises :class:`~attnkit.backends.nonfinite.NonFinite` where it read
        or wrote NaN/inf while :func:`~attnkit.backends.nonfinite.reporting`."""
        out, lse, finite = kernel().decode_forward(q, k, v, self, scale)
        if not finite and nonfinite.reporting():  # NaN/inf read: the rule's exact path
            raise nonfinite.NonFinite
        return out, lse

    def backward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        dout: torch.Tensor,
        lse: torch.Tensor,
        scale: float,
    ) -> None:
        """None: the kernel is forward-only (a plan that serves is never differentiated)."""
        return None

    def describe(self, call: AttentionCall, dtype: torch.dtype) -> str:
        """:func:`describe` of this plan."""
        return describe(call, self)

    def reads_note(self, dtype: torch.dtype, upcast: bool) -> str:
        """It reads q, k, v as they are on every path; :meth:`describe` says so."""
        return ""

    def direct(self, call: AttentionCall) -> Direct:
        """:func:`direct` of this plan."""
        return direct(call, self)

    def needs_float32(self, dtype: torch.dtype) -> bool:
        """False: it reads q, k, v as they are."""
        return False


def shaped(call: AttentionCall) -> bool:
    """A decode-shaped eager CPU call: ``1 <= L <= MAX_L`` queries against a cache, more keys
    than queries (``S > L``; self-attention of a few tokens, ``L == S``, is not decoding), not
    while torch.compile traces (the blocked backend runs as one custom op there). Against what
    ``auto`` would run instead (SDPA through attnkit, with the end-aligned mask and the
    non-finite check an eager CPU call pays) the kernel was faster at every cache length
    measured, from 16 keys up, at 1 to 16 queries (docs/benchmarks.md)."""
    d = call.dims
    if call.device_type != "cpu" or not 1 <= d.L <= MAX_L or d.S <= d.L:
        return False
    return not torch.compiler.is_compiling()


_EVERY: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _every_key(L: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The runs of a call without a mask: every key for every row (kept per sizes)."""
    found = _EVERY.get((L, S))
    if found is None:
        if len(_EVERY) > 256:
            _EVERY.clear()
        found = _EVERY[L, S] = (
            torch.zeros(1, L, dtype=torch.long),
            torch.full((1, L), S - 1, dtype=torch.long),
        )
    return found


def _refusal(call: AttentionCall) -> str | None:
    """Why the kernel cannot run a decode-shaped call, whatever its mask, or ``None``."""
    q, k, v = call.q, call.k, call.v
    if call.needs_grad or (
        call.sinks is not None and call.sinks.requires_grad and torch.is_grad_enabled()
    ):
        return "it is forward-only, and autograd will differentiate this call"
    if call.softcap is not None:
        return "it has no soft-cap"
    if not (q.dtype == k.dtype == v.dtype):
        return f"it reads q, k, v of one dtype (got {q.dtype}, {k.dtype}, {v.dtype})"
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"it reads float32, bfloat16 and float16 (q is {q.dtype})"
    if q.dtype != torch.float32 and call.cpu_path == "torch":
        return f"the CPU path for {q.dtype} is 'torch' (no AVX2 kernels)"
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        return "it reads k and v rows with a contiguous last dimension (stride 1)"
    if q.numel() == 0 or v.shape[-1] == 0:
        return "an empty dimension: nothing for the kernel to do"
    if build() is None:
        return status()
    if q.dtype == torch.float16 and "float16" not in _decode.module.low_dtypes():
        return "it was built without F16C (this CPU has none), so it does not read float16"
    return None


def plan(call: AttentionCall) -> DecodePlan | None:
    """The decode kernel's decision for ``call``: ``None`` where the call is not decode-shaped
    (:func:`shaped`), else a plan that serves it or says why not."""
    if not shaped(call):
        return None
    L, S = call.dims.L, call.dims.S
    spec = call.mask
    if spec is None:
        lo, hi = _every_key(L, S)
        what = "no mask"
    elif spec.from_tensor:
        return DecodePlan(None, None, "a mask tensor", "it reads runs of keys from a mask spec")
    else:
        runs = rowspan._runs(spec, L, S, (0, 0, S - L))  # the row-span kernel's (cached) runs
        if runs.lo is None or runs.hi is None:
            return DecodePlan(None, None, repr(spec), "the mask is not one run of keys per row")
        if runs.slopes.numel() or runs.keys.numel():
            why = "ALiBi's bias" if runs.slopes.numel() else "holes in the key mask"
            return DecodePlan(runs.lo, runs.hi, runs.what, f"it has no {why}")
        lo, hi, what = runs.lo, runs.hi, runs.what
        if runs.reason is not None:
            return DecodePlan(lo, hi, what, runs.reason)
        if lo.shape[0] not in (1, call.dims.B):
            return DecodePlan(lo, hi, what, f"its runs are for {lo.shape[0]} sequences")
    return DecodePlan(lo, hi, what, _refusal(call))


def describe(call: AttentionCall, p: DecodePlan) -> str:
    """What the kernel does for ``call``, in explain's words."""
    d = call.dims
    g = d.H // d.Hkv
    name = str(call.q.dtype).removeprefix("torch.")
    read = "" if call.q.dtype == torch.float32 else f", {name} read directly (float32 inside)"
    return (
        f"{p.what}, L = {d.L} queries against S = {d.S} keys: {status()}, forward only: each "
        f"of the {d.Hkv} key/value heads read once for its {g} query heads, only the keys a "
        f"row may see, split across {torch.get_num_threads()} threads (split-K, log-sum-exp "
        f"merge){read}"
    )


def direct(call: AttentionCall, p: DecodePlan) -> Direct:
    """The kernel's forward for any call with ``call``'s signature, given its q, k and v: the
    output, or ``None`` where the kernel saw NaN or inf (``p`` must serve ``call``)."""
    # the kernel's entry bound to this signature (its checks and arguments made once)
    return kernel().bind(call.q, call.k, call.v, p, call.scale)  # type: ignore[no-any-return]


def main() -> None:
    """Build ahead and say so (``make setup`` runs this)."""
    t0 = time.perf_counter()
    print(f"attnkit decode kernel: {status()} ({time.perf_counter() - t0:.1f} s)")
