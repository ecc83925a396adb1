"""What a run of ``attnkit bench`` measured (:class:`BenchResult`: rows of :class:`Entry`), and
the acceptance criteria it is judged on (:func:`acceptance`).

One set of types for both benches: the runner (:mod:`attnkit.bench.runner`, the CPU) and the
GPU bench (:mod:`attnkit.bench.cuda`) fill them, :mod:`attnkit.bench.report` renders them.
Where each criterion comes from is in docs/benchmarks.md.
"""

from __future__ import annotations

import operator
import re
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["BenchResult", "Check", "Criterion", "Entry", "Row", "acceptance", "criteria"]


@dataclass
class Entry:
    """One peer on one row: median time, useful GFLOP/s, memory, or why it did not run."""

    peer: str
    ms: float | None = None
    times_ms: list[float] = field(default_factory=list)
    gflops: float | None = None
    gemm_fraction: float | None = None
    peak_mib: float | None = None
    first_call_s: float | None = None
    #: calls per round, back to back, whose mean is the round's time (> 1: a fast call)
    calls: int = 1
    x_best_peer: float | None = None  #: time over the best non-attnkit peer's (< 1: faster)
    skipped: str | None = None
    error: str | None = None
    #: what the peer did on the row, in words, where the bench says it (the GPU bench: SDPA's
    #: mask, the backend ``auto`` took, the first call's time)
    note: str = ""


@dataclass
class Row:
    """One row, ``(workload, L, dtype, mode)``: its useful FLOPs and each peer's entry."""

    workload: str
    L: int
    dtype: str
    mode: str
    flops: float
    entries: list[Entry] = field(default_factory=list)
    #: fp32 GEMM GFLOP/s timed in the same rounds as this row's peers (the fractions use it)
    gemm_gflops: float | None = None
    #: copies of K/V the timed calls turned through (> 1: a decode row, read from memory)
    kv_copies: int = 1

    @property
    def label(self) -> str:
        return f"{self.workload} L={self.L} {self.dtype} {self.mode}"

    def entry(self, peer: str) -> Entry | None:
        return next((e for e in self.entries if e.peer == peer and e.ms is not None), None)


@dataclass
class BenchResult:
    """What a run measured; :mod:`attnkit.bench.report` renders it.

    ``device`` names the bench: ``"cpu"`` (:func:`attnkit.bench.run`, judged by
    :func:`acceptance`) or ``"cuda"`` (:func:`attnkit.bench.cuda.run_cuda`: ``machine`` holds
    the GPU's name and the torch and CUDA versions, ``gemm_gflops`` the bf16 GEMM's
    throughput; also when its code runs on the CPU in the tests).
    """

    machine: dict[str, Any]
    gemm_gflops: float
    rows: list[Row]
    reps: int
    seconds: float = 0.0
    #: a call faster than this was repeated within its round (see attnkit.bench.worker)
    min_call_ms: float = 0.0
    device: str = "cpu"

    def to_json(self) -> dict[str, Any]:
        """The record :func:`attnkit.bench.write_json` writes: every field and the acceptance
        checks; the GPU bench's in its own layout (TFLOP/s, ``of_peak``, ``note``)."""
        if self.device != "cpu":
            return _gpu_json(self)
        return {
            "machine": self.machine,
            "gemm_gflops": self.gemm_gflops,
            "reps": self.reps,
            "min_call_ms": self.min_call_ms,
            "seconds": self.seconds,
            "rows": [asdict(r) | {"label": r.label} for r in self.rows],
            "acceptance": [asdict(c) for c in acceptance(self)],
        }


def _gpu_json(result: BenchResult) -> dict[str, Any]:
    """The GPU bench's record: its device, torch and CUDA, the bf16 GEMM in TFLOP/s, and per
    entry ms, TFLOP/s, its fraction of that GEMM, peak MiB and the note (or why it skipped)."""
    m = result.machine

    def entry(e: Entry) -> dict[str, Any]:
        tflops = None if e.gflops is None else e.gflops / 1e3
        return {"peer": e.peer, "ms": e.ms, "tflops": tflops, "of_peak": e.gemm_fraction,
                "peak_mib": e.peak_mib, "note": e.skipped or e.error or e.note}  # fmt: skip

    rows = [
        {"workload": r.workload, "L": r.L, "dtype": r.dtype, "mode": r.mode,
         "entries": [entry(e) for e in r.entries]}
        for r in result.rows
    ]  # fmt: skip
    return {"device": m.get("device"), "torch": m.get("torch"), "cuda": m.get("cuda"),
            "gemm_tflops": result.gemm_gflops / 1e3, "reps": result.reps, "rows": rows}  # fmt: skip


@dataclass
class Check:
    """One acceptance criterion: the measured value against its bar (``None``: not run)."""

    what: str
    row: str
    value: float | None
    bar: str
    passed: bool | None

    @property
    def shown(self) -> str:
        """The value as the report prints it: three significant digits, more where three
        would print the bar's own number (0.4996 against ``>= 0.5`` reads ``0.4996``, not a
        ``0.5`` beside FAIL); ``-`` where not run.

        >>> Check("x", "r", 0.4996, ">= 0.5", False).shown
        '0.4996'
        >>> Check("x", "r", 0.766, ">= 0.65", True).shown
        '0.766'
        """
        if self.value is None:
            return "-"
        found = re.findall(r"[-+]?\d*\.?\d+(?:[eE][-+]?\d+)?", self.bar)
        bar = float(found[-1]) if found else None
        text = f"{self.value:.3g}"
        for digits in range(4, 8):
            if bar is None or float(text) != bar or self.value == bar:
                break
            text = f"{self.value:.{digits}g}"
        return text


def _find(result: BenchResult, workload: str, L: int, dtype: str, mode: str) -> Row | None:
    return next(
        (
            r
            for r in result.rows
            if (r.workload, r.L, r.dtype, r.mode) == (workload, L, dtype, mode)
        ),
        None,
    )


def _measure(row: Row | None, measure: str) -> float | None:
    """``"a/b"``: peer a's time over peer b's; ``"gemm"``: auto's useful GFLOP/s over the GEMM's;
    ``"peak GiB"``: auto's peak memory above the inputs. ``None`` where the row lacks it."""
    if row is None:
        return None
    if "/" in measure:
        num, den = measure.split("/")
        a, b = row.entry(num), row.entry(den)
        if a is None or b is None or a.ms is None or b.ms is None:
            return None
        return a.ms / b.ms
    auto = row.entry("attnkit")
    if measure == "gemm":
        return auto.gemm_fraction if auto is not None else None
    if measure == "peak GiB":
        return auto.peak_mib / 1024 if auto is not None and auto.peak_mib is not None else None
    raise KeyError(f"unknown acceptance measure {measure!r}")


_COMPARE = {"<=": operator.le, ">=": operator.ge}


def _passes(value: float, bar: str) -> bool:
    """``"<= x"`` / ``">= x"`` compare the value; ``"fits in RAM"`` asks only that it was
    measured."""
    if bar == "fits in RAM":
        return True
    op, limit = bar.split(" ")
    return bool(_COMPARE[op](value, float(limit)))


Criterion = tuple[tuple[str, int, str, str], str, str, str]  # row, what, measure, bar


def _table(text: str) -> list[Criterion]:
    """One criterion a line: ``workload L dtype mode | what | measure | bar`` (a line ending
    in a backslash goes on in the next)."""
    out = []
    for line in text.strip().splitlines():
        row, what, measure, bar = (" ".join(part.split()) for part in line.split("|"))
        workload, L, dtype, mode = row.split()
        out.append(((workload, int(L), dtype, mode), what, measure, bar))
    return out


#: The ``acceptance`` group's criteria: the row, what is judged, the measure (see
#: :func:`_measure`) and the bar (see :func:`_passes`).
_ACCEPTANCE = _table("""
dense 4096 float32 fwd | dense L=4096: auto time / SDPA time | attnkit/sdpa | <= 1.05
causal 4096 float32 fwd | causal L=4096: auto time / SDPA time | attnkit/sdpa | <= 1.05
window 16384 float32 fwd | window 256, L=16384 fwd: SDPA (dense mask) / auto | sdpa/attnkit | >= 10
window 16384 float32 fwd | window 256, L=16384 fwd: flex (warm) / auto | flex/attnkit | >= 1.5
window 16384 float32 fwd | window 256, L=16384 fwd: auto useful GFLOP/s / GEMM | gemm | >= 0.5
window 16384 float32 fwd+bwd | window 256, L=16384 fwd+bwd: SDPA (dense mask) / auto \
    | sdpa/attnkit | >= 10
window 16384 float32 fwd+bwd | window 256, L=16384 fwd+bwd: auto peak memory above inputs (GiB) \
    | peak GiB | <= 1.5
document 16384 float32 fwd | 8 documents, L=16384 fwd: SDPA (dense mask) / auto | sdpa/attnkit \
    | >= 4
padding 8192 float32 fwd | 25% key padding, L=8192 fwd: SDPA (dense mask) / auto | sdpa/attnkit \
    | >= 1.2
window 65536 float32 fwd+bwd | window 256, L=65536 fwd+bwd runs: auto peak memory above inputs \
    (GiB) | peak GiB | fits in RAM
""")

#: The ``masks`` group's criteria that do not depend on the CPU: every mask kind at a fraction
#: of the GEMM (one kernel for every mask), and causal against SDPA's ``is_causal``.
_MASKS = _table("""
causal 4096 float32 fwd | masks: causal L=4096 fp32: SDPA is_causal / auto | sdpa/attnkit \
    | >= 1.15
document 16384 float32 fwd | masks: 8 documents (uneven), L=16384 fwd: auto of GEMM | gemm \
    | >= 0.65
document-equal 16384 float32 fwd | masks: 8 documents (equal), L=16384 fwd: auto of GEMM \
    | gemm | >= 0.65
prefix 4096 float32 fwd | masks: prefix-LM, L=4096 fwd: auto of GEMM | gemm | >= 0.65
padding 8192 float32 fwd | masks: 25% key padding, L=8192 fwd: auto of GEMM | gemm | >= 0.65
gqa-window 16384 float32 fwd | masks: grouped-query 32/8 window 256, L=16384 fwd: auto of \
    GEMM | gemm | >= 0.65
gqa-window 16384 float32 fwd+bwd | masks: grouped-query 32/8 window 256, L=16384 fwd+bwd: \
    auto of GEMM | gemm | >= 0.65
""")

_BF16_WINDOW = [("window", 4096, "bfloat16", "fwd"), ("window", 4096, "bfloat16", "fwd+bwd")]
_BF16_CAUSAL = ("causal", 4096, "bfloat16", "fwd")
_NAMES = {"window": "window 256", "causal": "causal"}


def _bf16_criteria(cpu: str) -> list[Criterion]:
    """The ``masks`` group's bfloat16 bars for the CPU class the run measured (see
    :func:`attnkit.bench.machine.bf16_class`): with bf16 dot products (AVX512-BF16 or AMX)
    bfloat16 must beat float32 by 1.5x; without them (AVX2, AVX-512 without BF16; also where
    the flags are unknown) every bfloat16 row must reach 0.9x attnkit's own float32 speed on
    the same call, and causal 1.15x SDPA in bfloat16."""
    fp32 = "attnkit-fp32/attnkit"
    if cpu == "bf16":
        tag = "bf16 bars (CPU with bf16 instructions)"
        return [
            (row, f"{tag}: window 256 bf16, L=4096 {row[3]}: attnkit fp32 / bf16", fp32, ">= 1.5")
            for row in _BF16_WINDOW
        ] + [
            (
                _BF16_CAUSAL,
                f"{tag}: causal bf16, L=4096: SDPA bf16 / auto",
                "sdpa/attnkit",
                ">= 1.5",
            )
        ]
    tag = "bf16 bars (CPU without bf16 instructions)"
    return [
        (row, f"{tag}: {_NAMES[row[0]]} bf16, L=4096 {row[3]}: attnkit fp32 / bf16", fp32, ">= 0.9")
        for row in (*_BF16_WINDOW, _BF16_CAUSAL)
    ] + [(_BF16_CAUSAL, f"{tag}: causal bf16, L=4096: SDPA bf16 / auto", "sdpa/attnkit", ">= 1.15")]


def criteria(cpu: str = "unknown") -> list[Criterion]:
    """Every acceptance criterion a run is judged on, for a CPU of class ``cpu``."""
    return _ACCEPTANCE + _MASKS + _bf16_criteria(cpu)


def acceptance(result: BenchResult) -> list[Check]:
    """Every criterion's row, each with its measured value (where the run has it); the
    bfloat16 bars are those of the CPU class in the run's machine record."""
    checks = []
    for (workload, L, dtype, mode), what, measure, bar in criteria(
        result.machine.get("bf16_class", "unknown")
    ):
        row = _find(result, workload, L, dtype, mode)
        label = row.label if row is not None else "(row not run)"
        value = _measure(row, measure)
        passed = None if value is None else _passes(value, bar)
        checks.append(Check(what, label, value, bar, passed))
    return checks
