"""What ``attnkit bench`` shows: a terminal table, JSON, markdown and a plot, with the
acceptance checks (:func:`attnkit.bench.results.acceptance`) of the rows that ran.

Both benches' results (:class:`~attnkit.bench.results.BenchResult`) go through here: the CPU
bench's as GFLOP/s against the fp32 GEMM and the time over the best peer's, the GPU bench's
(``--device cuda``) as TFLOP/s against the bf16 GEMM and the time over SDPA's and flex's.
"""

from __future__ import annotations

import json
from pathlib import Path

from attnkit import files
from attnkit.bench.results import BenchResult, Entry, acceptance

__all__ = [
    "bf16_note",
    "machine_line",
    "print_table",
    "to_markdown",
    "winners",
    "write_json",
    "write_markdown",
    "write_plot",
]

MiB = 1 << 20


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
    """Which of the ``masks`` group's two sets of bfloat16 bars the run was judged on, and
    why."""
    from attnkit.bench.machine import describe_features

    m = result.machine
    flags = describe_features(m.get("cpu_features"))
    cls = m.get("bf16_class", "unknown")
    if cls == "bf16":
        return (
            f"bfloat16 bars for a CPU with AVX512-BF16 or AMX (this one: {flags}): "
            "bf16 causal window >= 1.5x attnkit fp32, bf16 causal >= 1.5x SDPA bf16."
        )
    which = "this one" if cls == "no-bf16" else "its flags were not read"
    return (
        f"bfloat16 bars for a CPU without bf16 instructions ({which}: {flags}): "
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


GPU_HEADER = ["peer", "ms", "TFLOP/s", "of GEMM", "peak MiB", "vs sdpa", "vs flex", "note"]


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _gpu_markdown(result: BenchResult) -> str:
    """The GPU bench's table: one line per row and peer; ``vs sdpa`` / ``vs flex`` are time
    ratios, TFLOP/s count allowed pairs only, ``of GEMM`` is over the bf16 GEMM's."""
    m = result.machine
    lines = [
        f"**GPU:** {m.get('device')}; torch {m.get('torch')} (CUDA {m.get('cuda')}); bf16 GEMM "
        f"{result.gemm_gflops / 1e3:.0f} TFLOP/s; median of {result.reps} interleaved calls "
        "(CUDA events)",
        "",
        "| row | " + " | ".join(GPU_HEADER) + " |",
        "|---|" + "---|" * len(GPU_HEADER),
    ]
    for row in result.rows:
        ms = {e.peer: e.ms for e in row.entries}
        for e in row.entries:
            ratios = [
                "-" if e.ms is None or ms.get(p) is None else f"{e.ms / ms[p]:.2f}"  # type: ignore[operator]
                for p in ("sdpa", "flex")
            ]
            tflops = None if e.gflops is None else e.gflops / 1e3
            lines.append(
                f"| {row.label} | {e.peer} | {_fmt(e.ms, '.2f')} | {_fmt(tflops, '.1f')} | "
                f"{_fmt(e.gemm_fraction, '.0%')} | {_fmt(e.peak_mib, '.0f')} | {ratios[0]} | "
                f"{ratios[1]} | {e.skipped or e.error or e.note} |"
            )
    return "\n".join(lines) + "\n"


def print_table(result: BenchResult) -> None:
    """The results as rich tables, one per row, then the acceptance checks; the GPU bench's
    as its markdown table."""
    if result.device != "cpu":
        print(_gpu_markdown(result), end="")
        return
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
        checks.add_row(c.what, c.shown, c.bar, verdict)
    console.print(checks)
    if any("bfloat16" in c.row for c in ran):
        console.print(bf16_note(result))


def to_markdown(result: BenchResult) -> str:
    """A markdown report: the machine, one table of every row, who wins, the acceptance (the
    GPU bench's: the GPU and one table)."""
    if result.device != "cpu":
        return _gpu_markdown(result)
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
        lines.append(f"| {c.what} | {c.row} | {c.shown} | {c.bar} | {verdict} |")
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
