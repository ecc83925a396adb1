"""The row-span kernel's table of builds and its one ``select()``
(:mod:`attnkit.backends.blocked.rowspan_builds`): each row's flags against simulated CPUs, the
reasons that name what is missing, the switches, and the plan, ``kernel()``, the status lines and
doctor reading the same answer.

A simulated CPU here is a set of ``/proc/cpuinfo`` flags passed to ``select(flags=...)`` (which
loads nothing then), not a replaced :func:`attnkit.cpu.features`: that one holds only the flags
that choose a CPU path (no ``avx512dq``, no ``f16c``), and builds are chosen from every flag
their compiler flags need.
"""

from __future__ import annotations

import pytest
import torch

from attnkit import masks
from attnkit.backends.blocked import builds, rowspan, rowspan_builds
from attnkit.backends.blocked.rowspan_builds import (
    AVX2,
    AVX512,
    AVX512_BF16,
    BASE,
    TABLE,
    SpanBuild,
    select,
)

AVX2_CPU = frozenset({"avx2", "fma", "f16c"})
AVX512_CPU = AVX2_CPU | {"avx512f", "avx512dq", "avx512bw", "avx512vl"}
BF16_CPU = AVX512_CPU | {"avx512_bf16"}
BF16 = torch.bfloat16
#: (dtype, in_dtype, dot): float32, bf16/fp16 read as float32 (fp32-upcast), bf16/fp16 native
CALLS = [
    (torch.float32, False, False),
    (BF16, True, False),
    (torch.float16, True, False),
    (BF16, True, True),
    (torch.float16, True, True),
]


@pytest.fixture(autouse=True)
def _switches(monkeypatch: pytest.MonkeyPatch) -> None:
    """The switches unset, and a CPU that runs attnkit's kernels (torch reports AVX2 or more)."""
    monkeypatch.delenv(rowspan_builds.ENV, raising=False)
    monkeypatch.delenv(rowspan_builds.ISA_ENV, raising=False)
    if rowspan_builds.cpu_reason() is not None:
        pytest.skip(str(rowspan_builds.cpu_reason()))


def test_the_table_is_the_wheels_row_span_builds_base_last() -> None:
    """Every row's build is one the wheel carries (``builds.ALL``, read by setup.py) and every
    row-span build there is a row; one row per instruction set; the last row (the base) serves
    float32 and bfloat16/float16 read as float32, and every row needs at least the base's flags."""
    row_span = [b for b in builds.ALL if b.csrc == "row_span.cpp"]
    assert sorted(e.build.name for e in TABLE) == sorted(b.name for b in row_span)
    assert len({e.isa for e in TABLE}) == len(TABLE)
    assert TABLE[-1] is BASE is AVX2
    assert {("float32", torch.float32), ("fp32-upcast", BF16), ("fp32-upcast", torch.float16)} <= (
        BASE.serves
    )
    for e in TABLE:
        assert set(BASE.needs) <= set(e.needs), e.label
        assert "f16c" not in e.needs  # optional: built without it where the CPU lacks it
        assert rowspan_builds.by_isa(e.isa) is e
    with pytest.raises(ValueError, match="no row-span build of 'amx': expected one of"):
        rowspan_builds.by_isa("amx")


@pytest.mark.parametrize("entry", TABLE, ids=lambda e: e.isa)
def test_each_row_runs_on_a_cpu_with_its_flags_and_names_each_one_missing(
    entry: SpanBuild,
) -> None:
    have = frozenset(entry.needs)
    assert entry.refuse(have) is None
    for flag in entry.needs:
        assert entry.refuse(have - {flag}) == f"this CPU has no {flag}"
    assert entry.refuse(frozenset()) == f"this CPU has no {', '.join(entry.needs)}"


def _names(cpu: frozenset[str]) -> list[tuple[str | None, str]]:
    return [
        ((e.isa if e else None), why)
        for dtype, in_dtype, dot in CALLS
        for e, why in [select(dtype, in_dtype=in_dtype, dot=dot, flags=cpu)]
    ]


def test_select_on_an_avx2_cpu() -> None:
    no512 = "this CPU has no avx512f, avx512dq, avx512bw, avx512vl"
    assert _names(AVX2_CPU) == [
        ("avx2", f"the AVX2 build runs float32 (no AVX-512 build: {no512})"),
        (
            "avx2",
            "the AVX2 build runs bfloat16 read as float32 (fp32-upcast path) (no AVX-512 build: "
            f"{no512})",
        ),
        (
            "avx2",
            "the AVX2 build runs float16 read as float32 (fp32-upcast path) (no AVX-512 build: "
            f"{no512})",
        ),
        (
            None,
            f"no AVX512-BF16 row-span kernel ({no512}, avx512_bf16): torch's kernels run on "
            "bfloat16 as it is",
        ),
        (
            None,
            "on the native CPU path attnkit's row-span kernel takes bfloat16 only (q is "
            "torch.float16): torch's kernels run on it as it is",
        ),
    ]


def test_select_on_avx512_cpus_with_and_without_bf16() -> None:
    got = _names(AVX512_CPU)
    assert got[:3] == [
        ("avx512", "the AVX-512 build runs float32"),
        ("avx512", "the AVX-512 build runs bfloat16 read as float32 (fp32-upcast path)"),
        ("avx512", "the AVX-512 build runs float16 read as float32 (fp32-upcast path)"),
    ]
    assert got[3] == (
        None,
        "no AVX512-BF16 row-span kernel (this CPU has no avx512_bf16): torch's kernels run on "
        "bfloat16 as it is",
    )
    got = _names(BF16_CPU)
    assert got[:3] == _names(AVX512_CPU)[:3]
    assert got[3] == ("avx512-bf16", "the AVX512-BF16 build runs bfloat16 as it is (native path)")
    assert got[4][0] is None


def test_a_dtype_no_route_reads_is_refused_by_name() -> None:
    for dtype, in_dtype in ((torch.float64, True), (BF16, False), (torch.float16, False)):
        build, why = select(dtype, in_dtype=in_dtype, flags=BF16_CPU)
        assert build is None
        assert why == (
            "attnkit's row-span kernel reads float32, bfloat16/float16 only on the fp32-upcast "
            f"CPU path and bfloat16 on the native one (q is {dtype}): torch's fused kernel runs"
        )


def test_the_isa_switch_keeps_the_base_where_it_serves_and_is_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``ATTNKIT_ROWSPAN_ISA=avx2``: float32 and fp32-upcast in the AVX2 build, saying why;
    bfloat16 on the native path (which the AVX2 build does not serve) is not affected; another
    value is an error naming the choices."""
    monkeypatch.setenv(rowspan_builds.ISA_ENV, "avx2")
    got = _names(BF16_CPU)
    switch = "no AVX-512 build: ATTNKIT_ROWSPAN_ISA=avx2 in the environment"
    assert got[0] == ("avx2", f"the AVX2 build runs float32 ({switch})")
    assert got[1] == (
        "avx2",
        f"the AVX2 build runs bfloat16 read as float32 (fp32-upcast path) ({switch})",
    )
    assert got[3][0] == "avx512-bf16"
    monkeypatch.setenv(rowspan_builds.ISA_ENV, "avx-512")
    with pytest.raises(ValueError, match="ATTNKIT_ROWSPAN_ISA='avx-512': expected one of auto"):
        select(torch.float32, flags=BF16_CPU)


def test_the_kernel_switch_turns_every_row_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(rowspan_builds.ENV, "0")
    off = (
        "torch's fused kernel (attnkit's row-span kernel is off: ATTNKIT_SPAN_KERNEL=0 in the "
        "environment)"
    )
    for dtype, in_dtype, dot in CALLS[:4]:
        assert select(dtype, in_dtype=in_dtype, dot=dot, flags=BF16_CPU) == (None, off)
    for e in TABLE:  # and each row's loader refuses before it loads
        assert e.refuse(BF16_CPU) == "ATTNKIT_SPAN_KERNEL=0 in the environment"


def test_a_new_row_is_one_entry_in_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """A build added in front (an AMX one, say) wins where the CPU has its flags, and where it
    does not the next row runs and the reason names the new row and what the CPU lacks; no
    consumer changes."""
    amx = SpanBuild(
        builds.Build(
            "test_amx", "row_span.cpp", "amx-bf16", (), (*BF16_CPU, "amx_bf16", "amx_tile")
        ),
        "AMX-BF16",
        frozenset({("native", BF16)}),
    )
    monkeypatch.setattr(rowspan_builds, "TABLE", (amx, *TABLE))
    assert select(BF16, in_dtype=True, dot=True, flags=BF16_CPU | {"amx_bf16", "amx_tile"}) == (
        amx,
        "the AMX-BF16 build runs bfloat16 as it is (native path)",
    )
    assert select(BF16, in_dtype=True, dot=True, flags=BF16_CPU | {"amx_tile"}) == (
        AVX512_BF16,
        "the AVX512-BF16 build runs bfloat16 as it is (native path) (no AMX-BF16 build: this CPU "
        "has no amx_bf16)",
    )
    build, why = select(BF16, in_dtype=True, dot=True, flags=AVX512_CPU)
    assert build is None
    assert why == (
        "no AMX-BF16 row-span kernel (this CPU has no avx512_bf16, amx_bf16, amx_tile); no "
        "AVX512-BF16 row-span kernel (this CPU has no avx512_bf16): torch's kernels run on "
        "bfloat16 as it is"
    )


@pytest.mark.parametrize(("dtype", "in_dtype", "dot"), CALLS)
def test_the_plan_kernel_and_status_read_select_on_this_cpu(
    dtype: torch.dtype, in_dtype: bool, dot: bool
) -> None:
    """On this machine: the plan names the build select chose (or refuses with select's words),
    ``kernel()`` of that isa is that build, and the status line is its name or the same why."""
    build, why = select(dtype, in_dtype=in_dtype, dot=dot)
    q = torch.randn(1, 2, 24, 8).to(dtype)
    p = rowspan.plan(masks.causal(), q, q, q, in_dtype=in_dtype, dot=dot)
    line = rowspan_builds.status(dtype, in_dtype=in_dtype, dot=dot)
    if build is None:
        assert p.reason == why == line
        return
    assert p.serves
    assert (p.isa, p.dtype) == (build.isa, dtype)
    assert rowspan_builds.kernel(p.isa).build == build.build
    assert line == build.in_use
    assert rowspan.plan(masks.causal(), q, q, q, in_dtype=in_dtype, dot=dot) is p  # cached


def test_doctor_has_a_line_per_route_the_table_serves() -> None:
    from attnkit.cli.doctor import _span_kernel

    rows = dict(_span_kernel())
    assert set(rows) == {"span kernel", "bf16 kernel", "decode kernel"}
    build, why = select(BF16, in_dtype=True, dot=True)
    assert rows["bf16 kernel"].startswith(why if build is None else build.in_use)
    assert why in rows["bf16 kernel"]
    build, why = select(torch.float32)
    assert rows["span kernel"].startswith(why if build is None else build.in_use)
    assert rows["span kernel"].endswith(why)


def test_kernel_of_a_row_this_cpu_cannot_load_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    if not rowspan_builds.available():
        pytest.skip(rowspan_builds.status())
    monkeypatch.setattr(AVX512.lazy, "tried", True)
    monkeypatch.setattr(AVX512.lazy, "module", None)
    monkeypatch.setattr(AVX512.lazy, "reason", "this CPU has no avx512f")
    with pytest.raises(RuntimeError, match="AVX-512 build is not loaded: this CPU has no avx512f"):
        rowspan_builds.kernel(AVX512.isa)
    build, why = select(torch.float32)
    assert build is AVX2
    assert why == "the AVX2 build runs float32 (no AVX-512 build: this CPU has no avx512f)"
