"""What ``attnkit bench`` shows: a terminal table, JSON, markdown and a plot, and the issue's
acceptance checks computed from the rows that ran."""

from __future__ import annotations

import json
import operator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from attnkit import files

if TYPE_CHECKING:
    from attnkit.bench.runner import BenchResult, Entry, Row

__all__ = [
    "Check",
    "acceptance",
    "bf16_note",
    "criteria",
    "machine_line",
    "print_table",
    "to_markdown",
    "winners",
    "write_json",
    "write_markdown",
    "write_plot",
]

MiB = 1 << 20


@dataclass
class Check:
    """One acceptance criterion: the measured value against its bar (``None``: not run)."""

    what: str
    row: str
    value: float | None
    bar: str
    passed: bool | None


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


#: The suite's own acceptance criteria (its first issue's): the row, what is judged, the
#: measure (see :func:`_measure`) and the bar (see :func:`_passes`).
_CRITERIA = _table("""
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

#: Issue 14's criteria (one kernel for every mask) that do not depend on the CPU.
_ISSUE14 = _table("""
causal 4096 float32 fwd | issue 14: causal L=4096 fp32: SDPA is_causal / auto | sdpa/attnkit \
    | >= 1.15
document 16384 float32 fwd | issue 14: 8 documents (uneven), L=16384 fwd: auto of GEMM | gemm \
    | >= 0.65
document-equal 16384 float32 fwd | issue 14: 8 documents (equal), L=16384 fwd: auto of GEMM \
    | gemm | >= 0.65
prefix 4096 float32 fwd | issue 14: prefix-LM, L=4096 fwd: auto of GEMM | gemm | >= 0.65
padding 8192 float32 fwd | issue 14: 25% key padding, L=8192 fwd: auto of GEMM | gemm | >= 0.65
gqa-window 16384 float32 fwd | issue 14: grouped-query 32/8 window 256, L=16384 fwd: auto of \
    GEMM | gemm | >= 0.65
gqa-window 16384 float32 fwd+bwd | issue 14: grouped-query 32/8 window 256, L=16384 fwd+bwd: \
    auto of GEMM | gemm | >= 0.65
""")

_BF16_WINDOW = [("window", 4096, "bfloat16", "fwd"), ("window", 4096, "bfloat16", "fwd+bwd")]
_BF16_CAUSAL = ("causal", 4096, "bfloat16", "fwd")
_NAMES = {"window": "window 256", "causal": "causal"}


def _bf16_criteria(cpu: str) -> list[Criterion]:
    """Issue 14's bfloat16 bars for the CPU class the run measured (see
    :func:`attnkit.bench.machine.bf16_class`): with bf16 dot products (AVX512-BF16 or AMX)
    bfloat16 must beat float32 by 1.5x; without them (AVX2, AVX-512 without BF16; also where
    the flags are unknown) every bfloat16 row must reach 0.9x attnkit's own float32 speed on
    the same call, and causal 1.15x SDPA in bfloat16."""
    fp32 = "attnkit-fp32/attnkit"
    if cpu == "bf16":
        tag = "issue 14 (CPU with bf16 instructions)"
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
    tag = "issue 14 (CPU without bf16 instructions)"
    return [
        (row, f"{tag}: {_NAMES[row[0]]} bf16, L=4096 {row[3]}: attnkit fp32 / bf16", fp32, ">= 0.9")
        for row in (*_BF16_WINDOW, _BF16_CAUSAL)
    ] + [(_BF16_CAUSAL, f"{tag}: causal bf16, L=4096: SDPA bf16 / auto", "sdpa/attnkit", ">= 1.15")]


def criteria(cpu: str = "unknown") -> list[Criterion]:
    """Every acceptance criterion a run is judged on, for a CPU of class ``cpu``."""
    return _CRITERIA + _ISSUE14 + _bf16_criteria(cpu)


def acceptance(result: BenchResult) -> list[Check]:
    """The issues' acceptance rows, each with its measured value (where the run has it); the
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


def winners(result: BenchResult) -> list[tuple[str, str, str]]:
    """Per row: the fastest of all, and the fastest peer that is not attnkit."""
    from attnkit.bench.peers import OUTSIDE

    out = []
    for row in result.rows:
        ran = [e for e in row.entries if e.ms is not None]
        if not ran:
            continue
        best = min(ran, key=lambda e: e.ms or 0.0)
        outside = [e for e in ran if e.peer in OUTSIDE]
        peer = min(outside, key=lambda e: e.ms or 0.0).peer if outside else "-"
        out.append((row.label, best.peer, peer))
    return out


def bf16_note(result: BenchResult) -> str:
    """Which of issue 14's two sets of bfloat16 bars the run was judged on, and why."""
    from attnkit.bench.machine import describe_features

    m = result.machine
    flags = describe_features(m.get("cpu_features"))
    cls = m.get("bf16_class", "unknown")
    if cls == "bf16":
        return (
            f"bfloat16 bars: issue 14's for a CPU with AVX512-BF16 or AMX (this one: {flags}): "
            "bf16 causal window >= 1.5x attnkit fp32, bf16 causal >= 1.5x SDPA bf16."
        )
    which = "this one" if cls == "no-bf16" else "its flags were not read"
    return (
        f"bfloat16 bars: issue 14's for a CPU without bf16 instructions ({which}: {flags}): "
        "every bf16 row >= 0.9x attnkit fp32 on the same call, bf16 causal >= 1.15x SDPA bf16."
    )


def machine_line(result: BenchResult) -> str:
    from attnkit.bench.machine import describe_features

    m = result.machine
    flags = describe_features(m["cpu_features"]) if "cpu_features" in m else "CPU flags unknown"
    return (
        f"{m.get('cpu')}, {m.get('cores')} cores ({m.get('capability')}; {flags}), "
        f"{m.get('memory_gib')} GiB; torch {m.get('torch')} with {m.get('threads')} threads; "
        f"fp32 GEMM {result.gemm_gflops:.1f} GFLOP/s; load {m.get('load_at_start')} -> "
        f"{m.get('load_at_end')}; {m.get('date')}; median of {result.reps} interleaved calls"
        + (
            f" (a call under {result.min_call_ms:g} ms: the mean of as many back-to-back calls "
            "as fill that, per round)"
            if result.min_call_ms
            else ""
        )
    )


def _cells(e: Entry) -> list[str]:
    if e.ms is None:
        why = e.skipped or e.error or "-"
        return [e.peer, "-", "-", "-", "-", "-", why]
    first = f"first call {e.first_call_s:.1f} s" if e.first_call_s and e.first_call_s > 2 else ""
    return [
        e.peer,
        f"{e.ms:,.1f}",
        f"{e.gflops:.1f}" if e.gflops is not None else "-",
        f"{100 * e.gemm_fraction:.0f}%" if e.gemm_fraction is not None else "-",
        f"{e.peak_mib:,.0f}" if e.peak_mib is not None else "-",
        f"{e.x_best_peer:.3g}x" if e.x_best_peer is not None else "-",
        first,
    ]


HEADER = ["peer", "ms", "GFLOP/s", "of GEMM", "peak MiB", "vs best peer", "note"]


def print_table(result: BenchResult) -> None:
    """The results as rich tables, one per row, then the acceptance checks."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"[bold]attnkit bench[/bold]: {machine_line(result)}")
    for row in result.rows:
        table = Table(
            title=f"{row.label}  ({row.flops / 1e9:.2f} useful GFLOP)", title_justify="left"
        )
        for h in HEADER:
            justify = "left" if h in ("peer", "note") else "right"
            table.add_column(h, justify=justify, no_wrap=h == "peer")  # type: ignore[arg-type]
        for e in row.entries:
            table.add_row(*_cells(e))
        console.print(table)
    ran = [c for c in acceptance(result) if c.passed is not None]
    if not ran:
        return
    checks = Table(
        title="acceptance (the rows of this run that the issues name)", title_justify="left"
    )
    for h in ("criterion", "measured", "bar", "verdict"):
        checks.add_column(h)
    for c in ran:
        verdict = "not run" if c.passed is None else ("PASS" if c.passed else "FAIL")
        value = "-" if c.value is None else f"{c.value:.3g}"
        checks.add_row(c.what, value, c.bar, verdict)
    console.print(checks)
    if any("bfloat16" in c.row for c in ran):
        console.print(bf16_note(result))


def to_markdown(result: BenchResult) -> str:
    """A markdown report: the machine, one table of every row, who wins, the acceptance."""
    lines = [
        "**Machine:** " + machine_line(result),
        "",
        "Times are medians; `vs best peer` is the time over the fastest non-attnkit peer's "
        "(below 1: faster). GFLOP/s count allowed pairs only; `of GEMM` is that over the "
        "machine's fp32 GEMM; `peak MiB` is the peak resident memory of one call above the "
        "inputs, each case in a fresh process.",
        "",
        "| row | " + " | ".join(HEADER) + " |",
        "|---|" + "---|" * len(HEADER),
    ]
    for row in result.rows:
        for e in row.entries:
            lines.append(f"| {row.label} | " + " | ".join(_cells(e)) + " |")
    lines += ["", "### Who wins where", "", "| row | fastest | fastest outside attnkit |"]
    lines.append("|---|---|---|")
    lines += [f"| {a} | {b} | {c} |" for a, b, c in winners(result)]
    gemms = [(r.label, r.gemm_gflops) for r in result.rows if r.gemm_gflops]
    if gemms:
        lines += [
            "",
            "fp32 GEMM GFLOP/s timed in the same rounds as each row's peers (the `of "
            "GEMM` column divides by it):",
            "",
            "| row | GEMM GFLOP/s |",
            "|---|---|",
        ]
        lines += [f"| {label} | {g:.1f} |" for label, g in gemms]
    ran = [c for c in acceptance(result) if c.passed is not None]
    if not ran:
        return "\n".join(lines) + "\n"
    lines += ["", "### Acceptance", ""]
    if any("bfloat16" in c.row for c in ran):
        lines += [bf16_note(result), ""]
    lines += ["| criterion | row | measured | bar | verdict |"]
    lines.append("|---|---|---|---|---|")
    for c in ran:
        verdict = "not run" if c.passed is None else ("PASS" if c.passed else "**FAIL**")
        value = "-" if c.value is None else f"{c.value:.3g}"
        lines.append(f"| {c.what} | {c.row} | {value} | {c.bar} | {verdict} |")
    return "\n".join(lines) + "\n"


def write_json(result: BenchResult, path: Path) -> None:
    """Write the result as JSON (with :func:`attnkit.files.write_text`, as every writer here:
    a temporary file moved into place; a link at ``path`` is replaced, never followed)."""
    text = json.dumps(result.to_json(), indent=2) + "\n"
    files.write_text(path, text, where="attnkit.bench.write_json", argument="path")


START, END = "<!-- attnkit bench: start -->", "<!-- attnkit bench: end -->"


def write_markdown(result: BenchResult, path: Path) -> None:
    """Write the markdown report; into an existing file that has the markers
    ``<!-- attnkit bench: start -->`` / ``end -->``, only between them (the prose around stays).
    The existing file is read only when it is a regular file, never through a link."""
    report = to_markdown(result)
    text = files.read_own_text(path)
    if START in text and END in text:
        head, rest = text.split(START, 1)
        report = head + START + "\n" + report + END + rest.split(END, 1)[1]
    files.write_text(path, report, where="attnkit.bench.write_markdown", argument="path")


def write_plot(result: BenchResult, path: Path) -> None:
    """Time against the best non-attnkit peer, per row and peer (log scale), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result.rows if any(e.x_best_peer for e in r.entries)]
    peers = sorted({e.peer for r in rows for e in r.entries if e.x_best_peer})
    fig, ax = plt.subplots(figsize=(11, 1.8 + 0.22 * len(rows) * max(1, len(peers))))
    height = 0.8 / max(1, len(peers))
    for j, peer in enumerate(peers):
        ys, xs = [], []
        for i, row in enumerate(rows):
            e = row.entry(peer)
            if e is not None and e.x_best_peer is not None:
                ys.append(i + j * height)
                xs.append(e.x_best_peer)
        ax.barh(ys, xs, height=height, label=peer)
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(rows))], [r.label for r in rows])
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("time / best non-attnkit peer's (log; left of 1 is faster)")
    ax.set_title("attnkit bench: " + machine_line(result)[:110], fontsize=8)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    try:
        with files.replacing(path, where="attnkit.bench.write_plot", argument="path") as tmp:
            fig.savefig(tmp, dpi=110, format=path.suffix.lstrip(".").lower() or "png")
    finally:
        plt.close(fig)
