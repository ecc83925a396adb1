"""attnkit's kernel builds: which C++ source, with which flags, for which CPUs; read by
``setup.py`` (the wheel's prebuilt kernels), by :mod:`~attnkit.backends.blocked.jit` (compiling
here, the fallback) and by :mod:`~attnkit.backends.blocked.native` (loading).

It imports neither torch nor attnkit (``setup.py`` loads this file by its path, in a build
environment that has neither), so it is the one place that names the builds and their flags.

A build's source is ``csrc/elements.h``, ``csrc/abi.h`` and its ``.cpp`` in that order
(:func:`source_text`); the kernels' entry points are a plain C ABI (``abi.h``: pointers, sizes,
dtype codes; no libtorch symbol, no torch header), so one compiled build serves every torch
version. Its :func:`fingerprint` (the source, the flags and :data:`ABI`) names it: the wheel's
manifest records the fingerprint of each prebuilt file, and the loader takes a prebuilt file
only where the fingerprint of the sources beside it is the same (an edited source is compiled
here instead).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path

#: the version of the C ABI the Python side speaks (``attnkit_abi_version()`` of every build)
ABI = 2
#: the kernels' sources, beside this file
CSRC = Path(__file__).resolve().parent / "csrc"
#: the headers every source starts with, in this order
HEADERS = ("elements.h", "abi.h")
#: the prebuilt kernels' folder inside the package, and the manifest of its files
PREBUILT = "_kernels"
MANIFEST = "manifest.json"
#: flags of every build: optimised, position-independent, OpenMP (torch's runtime, libgomp.so.1,
#: found at load time by its soname), no debug information (reproducible, no build paths)
#: and the C ABI's version (:data:`ABI`, its one definition: ``abi.h`` reads it)
COMMON = ("-O3", "-std=c++17", "-fPIC", "-fopenmp", "-g0", f"-DATTNKIT_ABI={ABI}")
LINK = ("-shared", "-fopenmp")
#: the compiler, where ``CXX`` names none
COMPILERS = ("c++", "g++", "clang++")
_AVX2 = ("-mavx2", "-mfma")
_AVX2_CPU = ("avx2", "fma")


@dataclass(frozen=True)
class Build:
    """One compiled kernel file: ``name`` (the file is ``<name>.so``), its ``csrc`` source,
    the instruction set it was built for (``isa``, as explain and doctor say it), its
    compiler ``flags`` and the ``/proc/cpuinfo`` flags a CPU needs to run it."""

    name: str
    csrc: str
    isa: str
    flags: tuple[str, ...]
    cpu: tuple[str, ...]

    def without_f16c(self) -> Build:
        """The same build without F16C (float16 not read): what a CPU without it compiles."""
        return replace(
            self,
            name=self.name + "_nof16c",
            flags=tuple(f for f in self.flags if f != "-mf16c"),
            cpu=tuple(f for f in self.cpu if f != "f16c"),
        )


ROW_SPAN = Build(
    "attnkit_row_span_avx2", "row_span.cpp", "avx2", (*_AVX2, "-mf16c"), (*_AVX2_CPU, "f16c")
)
_AVX512 = ("-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl")
_AVX512_CPU = ("avx512f", "avx512dq", "avx512bw", "avx512vl")
#: the float32 code in zmm registers (-DRS_AVX512): where the CPU has AVX-512 (F, DQ, BW, VL)
ROW_SPAN_AVX512 = Build(
    "attnkit_row_span_avx512",
    "row_span.cpp",
    "avx512",
    (*_AVX2, "-mf16c", *_AVX512, "-DRS_AVX512"),
    (*_AVX2_CPU, "f16c", *_AVX512_CPU),
)
#: bfloat16 dot products (-DRS_BF16DOT); its float32 code is the AVX-512 build's (-DRS_AVX512)
ROW_SPAN_DOT = Build(
    "attnkit_row_span_avx512bf16",
    "row_span.cpp",
    "avx512-bf16",
    (*_AVX2, "-mf16c", *_AVX512, "-mavx512bf16", "-DRS_AVX512", "-DRS_BF16DOT"),
    (*_AVX2_CPU, "f16c", *_AVX512_CPU, "avx512_bf16"),
)
DECODE = Build(
    "attnkit_decode_avx2", "decode.cpp", "avx2", (*_AVX2, "-mf16c"), (*_AVX2_CPU, "f16c")
)
#: the gather kernel (``masks.selected_keys``: each query's own k keys, read in place; float32,
#: and bfloat16/float16 read as they are: float16 with F16C only)
GATHER = Build(
    "attnkit_gather_avx2", "gather.cpp", "avx2", (*_AVX2, "-mf16c"), (*_AVX2_CPU, "f16c")
)
#: every build the wheel carries
ALL = (ROW_SPAN, ROW_SPAN_AVX512, ROW_SPAN_DOT, DECODE, GATHER)


#: a line of a source that names one of its parts in ``root`` (``#include "row_span_driver.h"``)
_PART = re.compile(r'^#include "([A-Za-z0-9_]+\.h)"$', re.MULTILINE)


def _inlined(name: str, root: Path) -> str:
    """The text of ``root/name`` with each ``#include "part.h"`` line of a part in ``root``
    replaced by that part's text (a source split into files, one instruction set's
    micro-kernels each, still compiles as one translation unit: the build writes one file)."""
    text = (root / name).read_text()

    def part(m: re.Match[str]) -> str:
        return (
            (root / m.group(1)).read_text().rstrip("\n") if (root / m.group(1)).is_file() else m[0]
        )

    return _PART.sub(part, text)


def parts(csrc: str, root: Path = CSRC) -> tuple[str, ...]:
    """The files of ``root`` whose text a build of ``csrc`` compiles, in order: :data:`HEADERS`,
    the source and the parts it includes."""
    found = _PART.findall((root / csrc).read_text())
    return (*HEADERS, csrc, *(f for f in found if (root / f).is_file()))


def source_text(csrc: str, root: Path = CSRC) -> str:
    """The text a build of ``csrc`` compiles: :data:`HEADERS`, then the source with its parts
    in place of their ``#include`` lines."""
    return "\n".join([*((root / f).read_text() for f in HEADERS), _inlined(csrc, root)])


def fingerprint(build: Build, root: Path = CSRC) -> str:
    """A hash of everything a build's result depends on in this project: its source text,
    its flags and :data:`ABI`."""
    h = hashlib.sha256()
    for part in (source_text(build.csrc, root), *COMMON, *build.flags, "|", *LINK, str(ABI)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:20]


def compiler() -> str:
    """The C++ compiler's path: ``CXX``, else the first of :data:`COMPILERS` on ``PATH``;
    ``FileNotFoundError`` naming what was looked for where there is none."""
    env = os.environ.get("CXX")
    if env:
        found = shutil.which(env.split()[0])
        if found is None:
            raise FileNotFoundError(f"CXX={env!r} is not on PATH")
        return found
    for name in COMPILERS:
        found = shutil.which(name)
        if found is not None:
            return found
    raise FileNotFoundError(f"no C++ compiler on PATH ({', '.join(COMPILERS)}; or set CXX)")


def command(build: Build, source: Path, out: Path) -> list[str]:
    """The compile-and-link command of ``build`` from ``source`` into ``out``."""
    return [compiler(), *COMMON, *build.flags, str(source), "-o", str(out), *LINK]


def compile_to(build: Build, directory: Path) -> Path:
    """Compile ``build`` into ``directory/<name>.so`` (its source written beside it, so the
    result does not change when the source does later); returns the file. Raises
    ``FileNotFoundError`` without a compiler, ``RuntimeError`` with the compiler's first error
    lines where it fails."""
    directory.mkdir(parents=True, exist_ok=True)
    source = directory / f"{build.name}.cpp"
    source.write_text(source_text(build.csrc))
    out = directory / f"{build.name}.so"
    tmp = directory / f"{build.name}.so.tmp{os.getpid()}"
    cmd = command(build, Path(source.name), Path(tmp.name))
    run = subprocess.run(cmd, cwd=directory, capture_output=True, text=True, check=False)
    if run.returncode != 0:
        tmp.unlink(missing_ok=True)
        errors = [line for line in run.stderr.splitlines() if "error" in line] or [
            run.stderr.strip() or f"exit status {run.returncode}"
        ]
        raise RuntimeError(f"{Path(cmd[0]).name} failed: {'; '.join(errors[:3])[:400]}")
    os.replace(tmp, out)  # whole or not at all, for a process that loads it meanwhile
    return out
