"""Loading attnkit's C++ kernels: the wheel's prebuilt build where it serves, else a build
compiled here (:mod:`~attnkit.backends.blocked.jit`), called through their C ABI with ctypes.

Dimension legend: B batch, H query heads, Hkv key/value heads, L query rows, S keys, Dk
query/key head dim, Dv value head dim.

Each kernel file (:mod:`~attnkit.backends.blocked.builds`) exports plain C functions over
pointers, sizes and dtype codes (``csrc/abi.h``) and uses no part of libtorch, so one file
serves every torch version the package allows. The classes here give them the interface the
rest of attnkit calls (:class:`SpanKernel`, :class:`DecodeKernel`: tensors in, tensors out,
``RuntimeError`` for what the kernels refuse): they make the inputs contiguous, allocate the
outputs with torch, pass ``torch.get_num_threads()`` (the kernels run on the OpenMP runtime
torch loaded, ``libgomp.so.1``, as ``at::parallel_for`` does) and release the GIL while the
kernel runs. The callers (the blocked backend's forward and backward) run inside attnkit's
``torch.library`` custom ops, so ``torch.compile`` sees one op and autograd works as before.

Where a kernel comes from (:func:`load`), in this order:

1. the prebuilt file in the package (``attnkit/backends/blocked/_kernels/<name>.so``, listed
   with its source's fingerprint in ``manifest.json``): taken where the CPU has the flags it
   was built for and the sources beside it have the same fingerprint (an edited source, as in
   a development checkout, is compiled instead);
2. a build compiled here from ``csrc/`` (a C++ compiler on ``PATH``; cached per source and
   flags; a CPU without F16C gets a build without it);
3. none: the reason is kept (``status()``, ``attnkit doctor``, ``attnkit.explain``), said once
   as a ``RuntimeWarning`` (neither a prebuilt nor a compiled build: not for a CPU that lacks the
   instruction set, nor for ``ATTNKIT_SPAN_KERNEL=0``), and the blocked backend runs torch's
   kernels or its tiles.

Each build is loaded once, on first use (:class:`Lazy`: the row-span kernel's three builds and
the decode kernel's). ``ATTNKIT_KERNEL_SOURCE`` picks: ``auto`` (the default, as above),
``prebuilt`` (the prebuilt file or nothing: never compile) or ``compile`` (never the prebuilt
file).
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
import time
import warnings
from array import array
from collections.abc import Callable
from ctypes import c_double, c_int32, c_int64, c_void_p
from functools import cache
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch

from attnkit.backends.blocked import builds, jit
from attnkit.cpu import hardware_flags

__all__ = [
    "ENV",
    "DecodeKernel",
    "Lazy",
    "Library",
    "Runs",
    "SpanKernel",
    "Spans",
    "load",
    "prebuilt",
]

#: ``auto`` (prebuilt, else compiled here), ``prebuilt`` (never compile), ``compile``
ENV = "ATTNKIT_KERNEL_SOURCE"
SOURCES = ("auto", "prebuilt", "compile")
#: the C ABI's dtype codes (``attnkit_abi::Code``)
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
#: ``attnkit_low_dtypes()``'s bits
LOW_BITS = ((1, "bfloat16"), (2, "float16"))
PREBUILT = "prebuilt in the package"
COMPILED = "compiled here"


def source() -> str:
    """``ATTNKIT_KERNEL_SOURCE`` (``auto`` where unset); ``ValueError`` naming the choices."""
    raw = os.environ.get(ENV, "auto")
    if raw not in SOURCES:
        raise ValueError(f"{ENV}={raw!r}: expected one of {', '.join(SOURCES)}")
    return raw


def prebuilt_dir() -> Path:
    """The package's folder of prebuilt kernels (it may not exist: an sdist or editable
    install that did not build them)."""
    return Path(__file__).resolve().parent / builds.PREBUILT


@cache
def _manifest(directory: Path) -> dict[str, Any]:
    path = directory / builds.MANIFEST
    if not path.exists():
        return {}
    return dict(json.loads(path.read_text()).get("builds", {}))


def prebuilt(build: builds.Build) -> tuple[Path | None, str]:
    """The prebuilt file of ``build`` and ``""``, or ``None`` and why it does not serve."""
    if source() == "compile":
        return None, f"{ENV}=compile"
    manifest = _manifest(prebuilt_dir())
    if not manifest:
        why = f"no prebuilt kernels in this install ({prebuilt_dir()} has no {builds.MANIFEST})"
        return None, why
    entry = manifest.get(build.name)
    if entry is None:
        return None, f"the package was built without {build.name} (its compiler failed)"
    path = prebuilt_dir() / entry["file"]
    if not path.exists():
        return None, f"the prebuilt kernel {path} is missing"
    if entry.get("fingerprint") != builds.fingerprint(build):
        return None, "the kernel's source differs from the prebuilt build's (edited since)"
    return path, ""


class Library:
    """A loaded kernel file: ``__file__`` its path, ``origin`` where it came from
    (:data:`PREBUILT` or :data:`COMPILED`), ``build`` what it was built as, ``seconds`` how
    long loading (and compiling, where it did) took."""

    #: the C functions this kind of kernel calls, with their argument types
    FUNCTIONS: ClassVar[dict[str, list[Any]]] = {}

    def __init__(self, path: Path, build: builds.Build, origin: str, seconds: float) -> None:
        lib = ctypes.CDLL(str(path))
        lib.attnkit_abi_version.restype = c_int32
        version = lib.attnkit_abi_version()
        if version != builds.ABI:
            raise RuntimeError(f"{path} speaks C ABI {version}, this attnkit {builds.ABI}")
        lib.attnkit_last_error.restype = ctypes.c_char_p
        lib.attnkit_low_dtypes.restype = c_int32
        for name, args in self.FUNCTIONS.items():
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = c_int32
        self._lib = lib
        self.__file__ = str(path)
        self.build, self.origin, self.seconds = build, origin, seconds
        #: why the prebuilt file was not taken ("" where it was)
        self.skipped = ""

    def low_dtypes(self) -> list[str]:
        """The dtypes it reads besides float32 (float16 only where built with F16C)."""
        bits = self._lib.attnkit_low_dtypes()
        return [name for bit, name in LOW_BITS if bits & bit]

    def error(self) -> RuntimeError:
        """The last call's refusal, as ``TORCH_CHECK`` raised it."""
        return RuntimeError(self._lib.attnkit_last_error().decode())

    def describe(self) -> str:
        """Where it came from, in doctor's words (and why not from the package, where it was
        compiled here)."""
        why = f"; not the package's: {self.skipped}" if self.skipped else ""
        return f"{self.build.isa} build {self.origin}, {self.__file__}{why}"


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(message)


class Runs(Protocol):
    """What the kernels read of a plan (:class:`~attnkit.backends.blocked.decode.DecodePlan`,
    :class:`~attnkit.backends.blocked.rowspan.SpanPlan`): ``lo``, ``hi`` the runs of keys of
    each query row, int64 ``(1 or B, L)``, local, inclusive (``None``: the plan does not
    serve, and a kernel refuses it)."""

    @property
    def lo(self) -> torch.Tensor | None: ...

    @property
    def hi(self) -> torch.Tensor | None: ...


class Spans(Runs, Protocol):
    """:class:`Runs` with the row-span kernel's modifiers: ALiBi's ``slopes``, ``d0`` and the
    key mask's ``keys`` (:class:`~attnkit.backends.blocked.rowspan.SpanPlan` says what)."""

    @property
    def slopes(self) -> torch.Tensor: ...

    @property
    def d0(self) -> int: ...

    @property
    def keys(self) -> torch.Tensor: ...


def _checked(
    kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runs: Runs
) -> tuple[torch.Tensor, torch.Tensor]:
    """``runs``' lo and hi, contiguous, after the checks a kernel's C side cannot make on q,
    k, v and them: dims, dtypes, devices (``RuntimeError`` naming ``kernel``). The messages
    are built only on a refusal: the decode kernel runs this on calls of a few microseconds."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise RuntimeError(f"{kernel}: q, k, v must be 4-D (B, H, L, D)")
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise RuntimeError(f"{kernel}: q, k, v must be float32, bfloat16 or float16, all one dtype")
    if not (q.is_cpu and k.is_cpu and v.is_cpu):
        raise RuntimeError(f"{kernel}: q, k, v must be CPU tensors")
    lo, hi = runs.lo, runs.hi
    if lo is None or hi is None or not (lo.dtype == hi.dtype == torch.long):
        raise RuntimeError(f"{kernel}: the plan's lo, hi must be int64 (1 or B, L)")
    if lo.dim() != 2 or hi.shape != lo.shape:
        raise RuntimeError(f"{kernel}: the plan's lo, hi must be (1 or B, L), one shape")
    return lo.contiguous(), hi.contiguous()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


_I64, _F64, _P = c_int64, c_double, c_void_p
# sizes, lo, hi, lo_rows, lo_cols, scale, softcap, slopes, n_slopes, d0, keys, rows, cols
_SPAN_COMMON = [_P, _P, _P, _I64, _I64, _F64, _F64, _P, _I64, _I64, _P, _I64, _I64]


class SpanKernel(Library):
    """The row-span kernel (``csrc/row_span.cpp``): see
    :func:`attnkit.backends.blocked.rowspan_builds.kernel` for ``span_forward`` and
    ``span_backward``."""

    FUNCTIONS: ClassVar[dict[str, list[Any]]] = {
        "attnkit_span_forward": [_P, _P, _P, c_int32, *_SPAN_COMMON, _P, _P, _I64],
        "attnkit_span_backward": [*(_P,) * 6, c_int32, *_SPAN_COMMON, *(_P,) * 5, _I64],
    }

    def _inputs(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: Spans
    ) -> tuple[tuple[torch.Tensor, ...], int, list[Any]]:
        """q, k, v and the plan's lo, hi made contiguous, the dtype code and the arguments from
        ``sizes`` to ``keys_cols`` (but ``scale``, ``softcap``, ``d0``, which the caller puts
        in); checks what the C side cannot see."""
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        lo, hi = _checked("row-span kernel", q, k, v, spans)
        dt, slopes, keys = DTYPES[q.dtype], spans.slopes, spans.keys
        sl = None
        if slopes.numel() > 0:
            _check(
                slopes.dim() == 1 and slopes.device.type == "cpu",
                "row-span kernel: ALiBi slopes must be a CPU tensor (H,), one per query head",
            )
            sl = slopes.to(torch.float64).contiguous()
        kk = None
        if keys.numel() > 0:
            _check(
                keys.dtype == torch.float32 and keys.dim() == 2 and keys.device.type == "cpu",
                "row-span kernel: keys must be contiguous float32 (1 or B, >= S + 8), 0 or -inf",
            )
            kk = keys.contiguous()
        sizes = array("q", (*q.shape, *k.shape, *v.shape))
        args = [sizes, lo.data_ptr(), hi.data_ptr(), lo.shape[0], lo.shape[1]]
        keys_args = [_ptr(kk), 0 if kk is None else kk.shape[0], 0 if kk is None else kk.shape[1]]
        rest = [args, _ptr(sl), 0 if sl is None else sl.numel(), keys_args, sl, kk]
        return (q, k, v, lo, hi), dt, rest

    def span_forward(self, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out (B, H, L, Dv) in q's dtype, lse (B, H, L) float32)``: what the kernel
        computed, NaN or inf read or not (arguments as :meth:`span_forward_finite`'s)."""
        return self.span_forward_finite(*args)[:2]

    def span_forward_finite(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        spans: Spans,
        scale: float,
        softcap: float,
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """``(out, lse, finite)`` of the plan ``spans``: ``finite`` False where a query row, or a
        key or value row some span reaches (rounded out to 16-key panels), held NaN or inf,
        checked where the kernel reads it (:mod:`attnkit.backends.nonfinite` sums nothing)."""
        (q, k, v, *_), dt, (a, sl, nsl, ka, *_keep) = self._inputs(q, k, v, spans)
        B, H, L = q.shape[:3]
        out = torch.empty((B, H, L, v.shape[3]), dtype=q.dtype)
        lse = torch.empty((B, H, L), dtype=torch.float32)
        rc = self._lib.attnkit_span_forward(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), dt, a[0].buffer_info()[0], *a[1:],
            float(scale), float(softcap), sl, nsl, int(spans.d0), *ka,
            out.data_ptr(), lse.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if rc == 1:
            raise self.error()
        return out, lse, rc == 0

    def span_backward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        dout: torch.Tensor,
        lse: torch.Tensor,
        spans: Spans,
        scale: float,
        softcap: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)`` in q's dtype (dk, dv summed in float32 over each kv head's query
        heads) of the plan ``spans``, given the final ``out`` and ``lse``."""
        out, dout, lse = out.contiguous(), dout.contiguous(), lse.contiguous()
        (q, k, v, *_), dt, (a, sl, nsl, ka, *_keep) = self._inputs(q, k, v, spans)
        _check(
            out.dtype == q.dtype and dout.dtype == q.dtype and lse.dtype == torch.float32,
            "row-span kernel: out, dout must be contiguous in q's dtype, lse float32",
        )
        B, H, L = q.shape[:3]
        _check(
            out.shape == (B, H, L, v.shape[3]) and dout.shape == out.shape,
            "row-span kernel: out and dout must be (B, H, L, Dv)",
        )
        _check(lse.shape == (B, H, L), "row-span kernel: lse must be (B, H, L)")
        dq = torch.empty(q.shape, dtype=q.dtype)
        dk = torch.zeros(k.shape, dtype=torch.float32)  # the float32 sums
        dv = torch.zeros(v.shape, dtype=torch.float32)
        low = q.dtype != torch.float32
        dk_low = torch.empty(k.shape, dtype=q.dtype) if low else None
        dv_low = torch.empty(v.shape, dtype=q.dtype) if low else None
        rc = self._lib.attnkit_span_backward(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), dout.data_ptr(),
            lse.data_ptr(), dt, a[0].buffer_info()[0], *a[1:], float(scale), float(softcap),
            sl, nsl, int(spans.d0), *ka, dq.data_ptr(), dk.data_ptr(), dv.data_ptr(),
            _ptr(dk_low), _ptr(dv_low), torch.get_num_threads(),
        )  # fmt: skip
        if rc:
            raise self.error()
        if dk_low is not None and dv_low is not None:
            return dq, dk_low, dv_low
        return dq, dk, dv


class DecodeKernel(Library):
    """The decode kernel (``csrc/decode.cpp``): see
    :func:`attnkit.backends.blocked.decode.kernel` for ``decode_forward``."""

    FUNCTIONS: ClassVar[dict[str, list[Any]]] = {"attnkit_decode_forward": [_P, _F64]}

    def decode_forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runs: Runs, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """``(out (B, H, L, Dv) in q's dtype, lse (B, H, L) float32, finite)``; k and v may be
        strided views with a contiguous last dimension. (Written for a decode step's few
        microseconds: one array of arguments, ``empty_like`` where out has q's shape.)"""
        lo, hi = _checked("decode", q, k, v, runs)
        q = q.contiguous()
        qs, vs = q.shape, v.shape
        B, H, L = qs[0], qs[1], qs[2]
        same = vs[3] == qs[3]
        out = torch.empty_like(q) if same else torch.empty(B, H, L, vs[3], dtype=q.dtype)
        lse = torch.empty(B, H, L, dtype=torch.float32)
        a = _decode_args(q, k, v, lo, hi, out.data_ptr(), lse)
        rc = self._lib.attnkit_decode_forward(a.buffer_info()[0], scale)
        if rc == 1:
            raise self.error()
        return out, lse, rc == 0

    def bind(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runs: Runs, scale: float
    ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor | None]:
        """:meth:`decode_forward` for calls of ``q``, ``k``, ``v``'s signature (shapes, dtype,
        k's and v's strides; q any strides) with these runs and scale, for a caller that has
        checked the signature (a repeated decode call, :mod:`attnkit.backends.memo`): the
        checks and the argument array are made here once, and a call costs three pointers, the
        output's allocation and the C call. It returns ``out``, or ``None`` where the kernel saw
        NaN or inf; its ``lse`` goes to a scratch buffer of this binding that nobody reads. A
        call whose signature differs is not checked and reads out of bounds: bind again."""
        lo, hi = _checked("decode", q, k, v, runs)  # what the C side checks too, once
        qs, ks, vs = q.shape, k.shape, v.shape
        if not (ks[0] == vs[0] == qs[0] and ks[1] == vs[1] and ks[2] == vs[2] and ks[3] == qs[3]):
            raise RuntimeError("decode: shapes of q, k, v do not match")
        if ks[1] == 0 or qs[1] % ks[1] or k.stride(3) != 1 or v.stride(3) != 1:
            raise RuntimeError("decode: shapes of q, k, v do not match, or k, v strided rows")
        if lo.shape[1] != qs[2] or lo.shape[0] not in (1, qs[0]):
            raise RuntimeError("decode: the plan's lo, hi must be int64 (1 or B, L)")
        B, H, L = qs[0], qs[1], qs[2]
        scratch = torch.empty(B, H, L, dtype=torch.float32)
        dtype, same, Dv = q.dtype, vs[3] == qs[3], vs[3]
        template = _decode_args(q, k, v, lo, hi, 0, scratch)  # slots 0-2, 5 and 8 set per call
        forward, threads = self._lib.attnkit_decode_forward, torch.get_num_threads
        empty, empty_like = torch.empty, torch.empty_like
        keep = (lo, hi, scratch)  # alive as long as the binding

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
            q = q.contiguous()
            out = empty_like(q) if same else empty(B, H, L, Dv, dtype=dtype)
            a = array("q", template)
            a[0], a[1], a[2], a[5], a[8] = (
                q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), threads(),
            )  # fmt: skip
            rc = forward(a.buffer_info()[0], scale)
            if rc == 1:
                raise self.error()
            return out if rc == 0 else None

        run.keep = keep  # type: ignore[attr-defined]
        return run


def _decode_args(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
    out: int, lse: torch.Tensor,
) -> array[int]:  # fmt: skip
    """``attnkit_decode_forward``'s argument array: the addresses of q, k, v, lo, hi, out, lse
    (slots 0-6), q's dtype code, the threads (8), the sizes of lo, q, k, v, the strides of k, v."""
    return array(
        "q",
        (q.data_ptr(), k.data_ptr(), v.data_ptr(), lo.data_ptr(), hi.data_ptr(), out,
         lse.data_ptr(), DTYPES[q.dtype], torch.get_num_threads(), *lo.shape, *q.shape,
         *k.shape, *k.stride(), *v.shape, *v.stride()),
    )  # fmt: skip


def _open(
    kind: type[Library], path: Path, build: builds.Build, origin: str, t0: float
) -> tuple[Library | None, str | None]:
    try:
        return kind(path, build, origin, time.perf_counter() - t0), None
    except (OSError, RuntimeError, AttributeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return None, f"{path} could not be loaded ({type(e).__name__}: {first[:200]})"


def load(build: builds.Build, kind: type[Library]) -> tuple[Library | None, str | None]:
    """``build`` loaded as ``kind``: ``(library, None)``, or ``(None, why)`` (in the words
    ``status()`` lines print) where neither the prebuilt file nor a build compiled here
    serves. A CPU without F16C compiles the build without it (float16 is not read then)."""
    t0 = time.perf_counter()
    try:
        how = source()
    except ValueError as e:
        return None, str(e)
    have = hardware_flags()
    missing = [f for f in build.cpu if f not in have]
    why = f"this CPU has no {', '.join(missing)}" if missing else ""
    if not missing:
        path, why = prebuilt(build)
        if path is not None:
            lib, why_not = _open(kind, path, build, PREBUILT, t0)
            if lib is not None:
                return lib, None
            why = why_not or why
    elif missing == ["f16c"]:
        build = build.without_f16c()
    else:
        return None, why
    if how == "prebuilt":
        return _unavailable(build, f"no prebuilt kernel serves ({why}) and {ENV}=prebuilt")
    path, failed, _ = jit.load_or_why(build)
    if path is None:
        return _unavailable(build, f"{failed}; no prebuilt kernel serves ({why})")
    lib, failed = _open(kind, path, build, COMPILED, t0)
    if lib is None:
        return _unavailable(build, failed or "")
    lib.skipped = why
    return lib, None


def _unavailable(build: builds.Build, why: str) -> tuple[None, str]:
    """``(None, why)``, said once as a warning: attnkit runs slower paths from here on."""
    warnings.warn(
        f"attnkit's {build.name} kernel is unavailable: {why}. Calls it would serve run on "
        f"torch's kernels or attnkit's tiles instead (see `attnkit doctor`, docs/install.md)",
        RuntimeWarning,
        stacklevel=4,
    )
    return None, why


class Lazy:
    """A kernel build loaded on first use, once per process (behind a lock): ``refuse()`` says
    why this process does not take it before a load is tried (a switch, a CPU without the
    instruction set; ``None`` where it does), then :func:`load`. ``module`` is the library
    (``None`` until loaded), ``reason`` why not (``None`` before :meth:`get` and where loaded),
    ``tried`` whether :meth:`get` ran (a test that changes the environment sets it back to
    ``False``, and ``module`` to ``None``, to load again)."""

    def __init__(
        self, build: builds.Build, kind: type[Library], refuse: Callable[[], str | None]
    ) -> None:
        self.build, self.kind, self.refuse = build, kind, refuse
        self.lock = threading.Lock()
        self.tried = False
        self.module: Any = None
        self.reason: str | None = None

    def get(self) -> Any:
        """The loaded library (loading it on the first call), or ``None``: see ``reason``."""
        with self.lock:
            if not self.tried:
                self.tried = True
                self.reason = self.refuse()
                if self.reason is None:
                    self.module, self.reason = load(self.build, self.kind)
            return self.module
