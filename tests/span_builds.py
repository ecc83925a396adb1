"""The row-span kernel's float32 builds for the tests: the AVX2 one (every CPU that runs the
kernel) and the AVX-512 one (CPUs with ``rowspan_builds.AVX512.needs``), called directly
(:func:`fp32_kernel`) or as the build ``attnkit.attention`` runs (:func:`running`: the
``ATTNKIT_ROWSPAN_ISA`` switch); a build this CPU cannot run is a skip that says why."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from attnkit.backends.blocked import blocks, rowspan_builds
from attnkit.cpu import hardware_flags

#: the float32 builds, as plans name them
FP32_ISAS = ["avx2", rowspan_builds.AVX512.isa]


def has_avx512() -> bool:
    """Whether this CPU has the flags of the AVX-512 build."""
    return all(f in hardware_flags() for f in rowspan_builds.AVX512.needs)


def expected_isa() -> str:
    """The float32 build a plan should name here: the AVX-512 one where the CPU has it and
    ``ATTNKIT_ROWSPAN_ISA`` is not ``avx2``, else the AVX2 one."""
    forced = os.environ.get(rowspan_builds.ISA_ENV, "auto") == "avx2"
    return rowspan_builds.AVX512.isa if has_avx512() and not forced else "avx2"


def _skip_unless_runs(isa: str) -> None:
    if not rowspan_builds.available():
        pytest.skip(rowspan_builds.status())
    if isa == rowspan_builds.AVX512.isa and not has_avx512():
        missing = [f for f in rowspan_builds.AVX512.needs if f not in hardware_flags()]
        pytest.skip(f"this CPU cannot run the AVX-512 build (no {', '.join(missing)})")


def fp32_kernel(isa: str) -> Any:
    """The loaded build of ``isa`` (checked to be what it says: its ``attnkit_span_avx512()``),
    or a skip."""
    _skip_unless_runs(isa)
    kernel = rowspan_builds.kernel(isa)
    assert kernel.build.isa == isa
    assert kernel._lib.attnkit_span_avx512() == (1 if isa == rowspan_builds.AVX512.isa else 0)
    return kernel


@contextmanager
def running(isa: str) -> Iterator[None]:
    """``attnkit.attention`` runs the build of ``isa`` inside (``ATTNKIT_ROWSPAN_ISA``: ``avx2``,
    or ``auto`` for the AVX-512 build; the cached plans and decisions forgotten on the way in and
    out), or a skip. A context manager, not a fixture: hypothesis tests use it too."""
    _skip_unless_runs(isa)
    old = os.environ.get(rowspan_builds.ISA_ENV)
    os.environ[rowspan_builds.ISA_ENV] = "avx2" if isa == "avx2" else "auto"
    blocks.clear_plans()
    try:
        running = rowspan_builds.select(torch.float32)[0]
        assert running is not None
        assert running.isa == isa
        yield
    finally:
        if old is None:
            del os.environ[rowspan_builds.ISA_ENV]
        else:
            os.environ[rowspan_builds.ISA_ENV] = old
        blocks.clear_plans()
