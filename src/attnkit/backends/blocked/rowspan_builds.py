"""The row-span kernel's builds: one ordered table (:data:`TABLE`) and one :func:`select`, the
single answer to "which build runs a call in this dtype on this CPU path, and why", read by the
plan (:func:`attnkit.backends.blocked.rowspan.plan`), the kernel calls (:func:`kernel`), the
status lines (:func:`status`, ``make setup``'s :func:`main`), explain and ``attnkit doctor``.

Each :class:`SpanBuild` row names its compiled file (a
:class:`~attnkit.backends.blocked.builds.Build`, which the wheel carries prebuilt:
``builds.ALL``), the ``/proc/cpuinfo`` flags it needs (its build's, F16C aside: a CPU without it
compiles the build without it, and float16 is not read then), the dtypes it serves on each
:data:`Route` and its loader (loaded on first use, once per process). The table is ordered most
capable first; its last row, :data:`BASE` (the AVX2 build), is the one every CPU that runs the
kernel runs: where it does not load, the kernel is off, whatever the other rows say. A new build
(AMX) is a new row, before the rows it should win over, its ``builds.Build`` (in ``builds.ALL``)
and its C++.

Routes (how the kernel reads a dtype; :mod:`attnkit.cpu` names the CPU paths):

* ``float32``: float32 on any path;
* ``fp32-upcast``: bfloat16/float16 read directly and computed in float32, for a caller that
  takes results back in that dtype (``in_dtype``: the blocked backend on the ``fp32-upcast``
  path);
* ``native``: bfloat16 multiplied in bfloat16 (``dot``: the ``native`` path).

Switches: ``ATTNKIT_SPAN_KERNEL=0`` turns the kernel off (every row); ``ATTNKIT_ROWSPAN_ISA=avx2``
keeps :data:`BASE` for every route it serves (to measure or test one build against another).

Which calls ``auto`` gives to the kernel rather than torch's SDPA is not decided here: the sizes
are :mod:`~attnkit.backends.blocked.rowspan`'s (``CAUSAL_MIN_PAIRS``, ``DENSE_*``) and the rule
measured per dtype and CPU class is :func:`attnkit.backends.blocked.measured.select`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from attnkit.backends.blocked import builds, native
from attnkit.cpu import hardware_flags

__all__ = [
    "AVX2",
    "AVX512",
    "AVX512_BF16",
    "BASE",
    "ENV",
    "ISA_ENV",
    "TABLE",
    "Route",
    "SpanBuild",
    "available",
    "by_isa",
    "cpu_reason",
    "isa_choice",
    "kernel",
    "main",
    "route_of",
    "select",
    "status",
    "unread",
]

#: set to "0" to keep the blocked backend on torch's kernel for row spans (every build)
ENV = "ATTNKIT_SPAN_KERNEL"
#: ``auto`` (the default: the table's choice) or ``avx2`` (:data:`BASE` for every route it
#: serves: for measuring and testing one build against another)
ISA_ENV = "ATTNKIT_ROWSPAN_ISA"
ISAS = ("auto", "avx2")

Route = Literal["float32", "fp32-upcast", "native"]
#: the words a status line adds after a dtype's name, per route
_ROUTE_WORDS: dict[str, str] = {
    "float32": "",
    "fp32-upcast": " read as float32 (fp32-upcast path)",
    "native": " as it is (native path)",
}
_LOW = (torch.bfloat16, torch.float16)


def cpu_reason() -> str | None:
    """Why this process runs none of attnkit's C++ kernels (the switch, a CPU without AVX2), or
    ``None``; the decode and gather kernels share it."""
    if os.environ.get(ENV, "1") == "0":
        return f"{ENV}=0 in the environment"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"this CPU has no AVX2 (torch reports {capability!r})"
    return None


def isa_choice() -> str:
    """``ATTNKIT_ROWSPAN_ISA`` (``auto`` where unset); ``ValueError`` naming the choices."""
    raw = os.environ.get(ISA_ENV, "auto")
    if raw not in ISAS:
        raise ValueError(f"{ISA_ENV}={raw!r}: expected one of {', '.join(ISAS)}")
    return raw


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class SpanBuild:
    """One row of :data:`TABLE`: the compiled ``build``, its ``label`` in explain's and doctor's
    words (``detail`` follows it in :attr:`in_use`), the ``(route, dtype)`` pairs it serves, and
    ``lazy``, its loader (refused before a load where :meth:`refuse` says why)."""

    build: builds.Build
    label: str
    serves: frozenset[tuple[Route, torch.dtype]]
    detail: str = ""
    lazy: native.Lazy = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "lazy", native.Lazy(self.build, native.SpanKernel, self.refuse))

    @property
    def isa(self) -> str:
        """The instruction set, as a plan's ``isa`` names it."""
        return self.build.isa

    @property
    def needs(self) -> tuple[str, ...]:
        """The ``/proc/cpuinfo`` flags it needs: its build's, without F16C (optional)."""
        return tuple(f for f in self.build.cpu if f != "f16c")

    @property
    def in_use(self) -> str:
        """The status line where it runs."""
        return f"attnkit's {self.label} row-span kernel{self.detail}"

    def refuse(self, flags: frozenset[str] | None = None) -> str | None:
        """Why a CPU with ``flags`` (this one's: :func:`attnkit.cpu.hardware_flags`, never a
        simulated one, so that no build runs an instruction the CPU lacks) does not load it
        (:func:`cpu_reason`, else the flags it lacks), or ``None``."""
        have = hardware_flags() if flags is None else flags
        missing = [f for f in self.needs if f not in have]
        return cpu_reason() or (f"this CPU has no {', '.join(missing)}" if missing else None)


_FP32: frozenset[tuple[Route, torch.dtype]] = frozenset(
    {("float32", torch.float32), ("fp32-upcast", torch.bfloat16), ("fp32-upcast", torch.float16)}
)
#: bfloat16 with the CPU's bf16 dot products (``vdpbf16ps``): q, k, v, dout, P and dS multiplied
#: in bfloat16 (P, dS rounded to nearest even), summed in float32, forward and backward; its
#: float32 and float16 code is the AVX-512 build's, but it serves bfloat16 on ``native`` only
AVX512_BF16 = SpanBuild(
    builds.ROW_SPAN_DOT,
    "AVX512-BF16",
    frozenset({("native", torch.bfloat16)}),
    " (bf16 dot products)",
)
#: the float32 micro-kernels, softmax and backward rows in 512-bit registers
AVX512 = SpanBuild(builds.ROW_SPAN_AVX512, "AVX-512", _FP32)
#: AVX2 + FMA: every CPU the kernel runs on
AVX2 = SpanBuild(builds.ROW_SPAN, "AVX2", _FP32)
#: every build, most capable first: :func:`select` takes the first that serves and loads
TABLE: tuple[SpanBuild, ...] = (AVX512_BF16, AVX512, AVX2)
#: the build every CPU that runs the kernel runs: where it does not load, the kernel is off
BASE = TABLE[-1]
_BY_ISA = {e.isa: e for e in TABLE}


def by_isa(isa: str) -> SpanBuild:
    """The row whose build is of ``isa`` (a plan's); ``ValueError`` naming the choices."""
    if isa not in _BY_ISA:
        raise ValueError(f"no row-span build of {isa!r}: expected one of {', '.join(_BY_ISA)}")
    return _BY_ISA[isa]


def route_of(dtype: torch.dtype, *, in_dtype: bool = False, dot: bool = False) -> Route | None:
    """How the kernel would read ``dtype`` (module docstring): float32 always; bfloat16/float16
    only for a caller that takes results in that dtype (``in_dtype``), multiplied as they are
    with ``dot`` (the native path); ``None`` for anything else."""
    if dtype == torch.float32:
        return "float32"
    if in_dtype and dtype in _LOW:
        return "native" if dot else "fp32-upcast"
    return None


def _dtypes(route: Route) -> str:
    """The dtypes some row serves on ``route``, as ``bfloat16/float16``."""
    return "/".join(_name(d) for d in _LOW if any((route, d) in e.serves for e in TABLE))


def unread(dtype: torch.dtype) -> str:
    """The refusal of a dtype no route reads (or of q, k, v in different dtypes)."""
    return (
        f"attnkit's row-span kernel reads float32, {_dtypes('fp32-upcast')} only on the "
        f"fp32-upcast CPU path and {_dtypes('native')} on the native one (q is {dtype}): "
        "torch's fused kernel runs"
    )


def _off(why: str | None) -> str:
    return f"torch's fused kernel (attnkit's row-span kernel is off: {why})"


def _why_not(
    e: SpanBuild, route: Route, dtype: torch.dtype, flags: frozenset[str] | None
) -> str | None:
    """Why row ``e`` does not run ``dtype`` on ``route`` here (or on a CPU with ``flags``,
    loading nothing), or ``None``: the switch first, then the CPU and the load."""
    if e is not BASE and (route, dtype) in BASE.serves and isa_choice() == "avx2":
        return f"{ISA_ENV}=avx2 in the environment"
    if flags is not None:
        return e.refuse(flags)
    return None if e.lazy.get() is not None else e.lazy.reason


def select(
    dtype: torch.dtype,
    *,
    in_dtype: bool = False,
    dot: bool = False,
    flags: frozenset[str] | None = None,
) -> tuple[SpanBuild | None, str]:
    """The row that runs ``dtype`` (read as :func:`route_of` says) and why it runs, or ``None``
    and why none does, in the words explain, doctor and the plan print. The first row of
    :data:`TABLE` that serves the route and loads wins (loading it on first use); the rows it
    passed over are named with why (``the AVX2 build runs float32 (no AVX-512 build: ...)``).
    None runs where no route reads ``dtype``, where :data:`BASE` does not load (the kernel is
    off), where no row serves ``dtype`` on the route, where none of the rows that serve it loads
    (``torch's kernels run on ... as it is``), or where the build does not read a low dtype
    (built without F16C).

    ``flags``: a simulated CPU's ``/proc/cpuinfo`` flags (tests); nothing is loaded then, and a
    row counts as loaded where the CPU has its flags."""
    route, name = route_of(dtype, in_dtype=in_dtype, dot=dot), _name(dtype)
    if route is None:
        return None, unread(dtype)
    base = _why_not(BASE, route, dtype, flags)
    if base is not None:
        return None, _off(base)
    rows = [e for e in TABLE if (route, dtype) in e.serves]
    if not rows:
        return None, (
            f"on the {route} CPU path attnkit's row-span kernel takes {_dtypes(route)} only "
            f"(q is {dtype}): torch's kernels run on it as it is"
        )
    passed: list[tuple[SpanBuild, str]] = []
    for e in rows:
        why = _why_not(e, route, dtype, flags)
        if why is None:
            break
        passed.append((e, why))
    else:
        lacking = "; ".join(f"no {e.label} row-span kernel ({why})" for e, why in passed)
        return None, f"{lacking}: torch's kernels run on {name} as it is"
    if flags is None and route != "float32" and name not in e.lazy.module.low_dtypes():
        return None, (
            f"attnkit's row-span kernel was built without F16C (this CPU has none), so it does "
            f"not read {name}"
        )
    others = "; ".join(f"no {p.label} build: {why}" for p, why in passed)
    return e, f"the {e.label} build runs {name}{_ROUTE_WORDS[route]}" + (
        f" ({others})" if others else ""
    )


def status(dtype: torch.dtype = torch.float32, *, in_dtype: bool = False, dot: bool = False) -> str:
    """One line: the build that runs ``dtype`` on the route (:func:`select`), or why none does;
    with the defaults, float32: the kernel is in use (naming the build), or why it is off."""
    entry, why = select(dtype, in_dtype=in_dtype, dot=dot)
    return why if entry is None else entry.in_use


def available() -> bool:
    """Whether the kernel runs here: :data:`BASE` loads (loading it on the first call)."""
    return BASE.lazy.get() is not None


def kernel(isa: str = BASE.isa) -> Any:
    """The loaded C++ module of the build of ``isa`` (a plan's; loaded here where the CPU has
    it, whatever ``ATTNKIT_ROWSPAN_ISA`` says): ``span_forward(q, k, v, spans, scale,
    softcap) -> (out, lse)`` (``span_forward_finite``: the same and whether every q, k, v
    element it read was finite) and ``span_backward(q, k, v, out, dout, lse, spans, scale,
    softcap) -> (dq, dk, dv)``; ``spans`` a :class:`~attnkit.backends.blocked.rowspan.SpanPlan`
    (or any object with its ``lo``, ``hi``, ``slopes``, ``d0``, ``keys``:
    :class:`attnkit.backends.blocked.native.Spans`); ``softcap`` > 0 caps the scaled scores
    (``c tanh(s / c)``, 0: none), a non-empty ``slopes`` ``(H,)`` adds ALiBi's
    ``-slope_h |i + d0 - j|`` and a non-empty ``keys`` ``(1 or B, >= S + 8)`` each key's 0 or
    ``-inf``: q ``(B, H, L, Dk)``, k ``(B, Hkv, S, Dk)``, v ``(B, Hkv, S, Dv)``, out
    ``(B, H, L, Dv)``, lse ``(B, H, L)`` (natural log, float32), ``lo``/``hi`` int64
    ``(1 or B, L)``; q, k, v, out, dout, dq, dk, dv all float32, or all the dtype of q among
    ``low_dtypes()`` (``["bfloat16", "float16"]``, without float16 where built without F16C).
    Call it only where the plan says the kernel serves; the C++ checks what its memory safety
    needs (shapes, dtypes, spans in order). ``RuntimeError`` where the build is not loaded."""
    entry = by_isa(isa)
    module = entry.lazy.module
    if module is not None and BASE.lazy.module is not None:
        return module
    if BASE.lazy.get() is None:
        raise RuntimeError(f"the row-span kernel is not loaded: {status()}")
    if entry.lazy.get() is None:
        why = entry.lazy.reason
        raise RuntimeError(f"the row-span kernel's {entry.label} build is not loaded: {why}")
    return entry.lazy.module


def native_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes some row serves on the ``native`` route (doctor has a line for each)."""
    return tuple(d for d in _LOW if any(("native", d) in e.serves for e in TABLE))


def main() -> None:
    """Build ahead and say so (``make setup`` runs this): the float32 line, then one per dtype
    the ``native`` route serves."""
    t0 = time.perf_counter()
    entry, why = select(torch.float32)
    line = why if entry is None else f"{entry.in_use}; {why}"
    print(f"attnkit row-span kernel: {line} ({time.perf_counter() - t0:.1f} s)")
    for dtype in native_dtypes():
        t0 = time.perf_counter()
        line = status(dtype, in_dtype=True, dot=True)
        took = time.perf_counter() - t0
        print(f"attnkit row-span kernel for {_name(dtype)}: {line} ({took:.1f} s)")
