"""Run ``attnkit bench``: rows of (workload, L, dtype, mode), each peer timed and measured.

Every row's peers are timed together in one fresh process (interleaved, median of ``reps``);
every (row, peer) gets one more fresh process for its peak memory. The machine's fp32 GEMM
throughput is measured first, so each row can say which fraction of it the useful FLOPs reach.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from attnkit.bench.peers import OUTSIDE, PEERS
from attnkit.bench.workloads import WORKLOADS, get_workload
from attnkit.errors import AttentionInputError

__all__ = [
    "ACCEPTANCE_ROWS",
    "BenchResult",
    "Entry",
    "Row",
    "check_options",
    "check_rows",
    "machine",
    "measure_gemm",
    "plan_rows",
    "run",
]

GiB = 1 << 30

#: the rows of the default run: the issue's acceptance rows and a few more
ACCEPTANCE_ROWS: list[tuple[str, int, str, str]] = [
    ("dense", 4096, "float32", "fwd"),
    ("causal", 4096, "float32", "fwd"),
    ("window", 16384, "float32", "fwd"),
    ("window", 16384, "float32", "fwd+bwd"),
    ("document", 16384, "float32", "fwd"),
    ("padding", 8192, "float32", "fwd"),
    ("prefix", 4096, "float32", "fwd"),
    ("gqa", 4096, "float32", "fwd"),
    ("decode", 65536, "float32", "fwd"),
    ("window", 4096, "bfloat16", "fwd"),
    ("window", 65536, "float32", "fwd+bwd"),
]
DEFAULT_PEERS = ["naive", "sdpa", "flex", "attnkit", "attnkit-blocked"]
#: the seed-style code takes minutes a call on big rows: with the default peers it runs only
#: where B x H x L x S is at most this (8 heads at L = 4096), in float32
NAIVE_MAX = 8 * 4096 * 4096
FULL_LENGTHS = [1024, 4096, 16384, 65536]
QUICK_ROWS: list[tuple[str, int, str, str]] = [
    ("dense", 512, "float32", "fwd"),
    ("window", 2048, "float32", "fwd"),
    ("window", 2048, "float32", "fwd+bwd"),
]
QUICK_PEERS = ["naive", "sdpa", "attnkit", "attnkit-blocked"]
DTYPES = ["float32", "bfloat16"]
MODES = ["fwd", "fwd+bwd"]
#: the longest length a row may ask for: 4x the longest --full length (the inputs alone grow
#: with L, and planning a row builds its block map)
MAX_LENGTH = 4 * FULL_LENGTHS[-1]
#: the largest n of the n x n GEMM timed beside the peers (its three matrices take 3 GiB)
MAX_GEMM = 16384


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
    x_best_peer: float | None = None  #: time over the best non-attnkit peer's (< 1: faster)
    skipped: str | None = None
    error: str | None = None


@dataclass
class Row:
    workload: str
    L: int
    dtype: str
    mode: str
    flops: float
    entries: list[Entry] = field(default_factory=list)
    #: fp32 GEMM GFLOP/s timed in the same rounds as this row's peers (the fractions use it)
    gemm_gflops: float | None = None

    @property
    def label(self) -> str:
        return f"{self.workload} L={self.L} {self.dtype} {self.mode}"

    def entry(self, peer: str) -> Entry | None:
        return next((e for e in self.entries if e.peer == peer and e.ms is not None), None)


@dataclass
class BenchResult:
    """What a run measured; :mod:`attnkit.bench.report` renders it."""

    machine: dict[str, Any]
    gemm_gflops: float
    rows: list[Row]
    reps: int
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        from attnkit.bench.report import acceptance

        return {
            "machine": self.machine,
            "gemm_gflops": self.gemm_gflops,
            "reps": self.reps,
            "seconds": self.seconds,
            "rows": [asdict(r) | {"label": r.label} for r in self.rows],
            "acceptance": [asdict(c) for c in acceptance(self)],
        }


def machine() -> dict[str, Any]:
    """The machine line: CPU, cores, memory, torch and its threads, load."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024 / GiB
    except (OSError, ValueError, IndexError):
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem, 1) if mem else None,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "python": platform.python_version(),
        "load_at_start": round(load, 2) if load is not None else None,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def measure_gemm(n: int = 4096, reps: int = 5) -> float:
    """The machine's fp32 GEMM throughput, GFLOP/s: median of ``reps`` ``n x n`` matmuls."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    a @ b
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2.0 * n**3 / statistics.median(times) / 1e9


def _option_error(
    where: str, flag: str, problem: str, got: str, expected: str, fix: str
) -> AttentionInputError:
    return AttentionInputError(
        where, flag, f"{flag} {problem}", got=got, expected=expected, fix=fix
    )


def _check_names(where: str, flag: str, given: Iterable[str], allowed: list[str]) -> None:
    for name in given:
        if name not in allowed:
            listed = ", ".join(allowed)
            raise _option_error(
                where,
                flag,
                f"{name!r} is not one of {listed}.",
                f"{flag} {name}",
                f"one of {listed}",
                f"pick from {listed} (repeat {flag.split('/')[0]} for several)",
            )


def _check_lengths(where: str, lengths: Iterable[int]) -> None:
    for L in lengths:
        if isinstance(L, bool) or not isinstance(L, int) or not 1 <= L <= MAX_LENGTH:
            raise _option_error(
                where,
                "-L/--length",
                f"{L!r} is not a length attnkit bench runs: it takes 1 to {MAX_LENGTH}.",
                f"-L {L}",
                f"an int from 1 to {MAX_LENGTH}",
                f"pass lengths such as {', '.join(f'-L {n}' for n in FULL_LENGTHS)}",
            )


def check_rows(rows: Iterable[tuple[str, int, str, str]], where: str = "attnkit.bench") -> None:
    """Refuse a row whose workload, length, dtype or mode :func:`run` does not know."""
    for workload, L, dtype, mode in rows:
        _check_names(where, "-w/--workload", [workload], list(WORKLOADS))
        _check_lengths(where, [L])
        _check_names(where, "--dtype", [dtype], DTYPES)
        _check_names(where, "--mode", [mode], MODES)


def check_options(
    *,
    peers: list[str] | None = None,
    reps: int = 5,
    cap_gib: float = 12.0,
    gemm_n: int = 4096,
    where: str = "attnkit.bench.run",
) -> None:
    """Refuse the options of :func:`run` that it cannot use (before it measures anything).

    >>> check_options(gemm_n=-1)
    Traceback (most recent call last):
    attnkit.errors.AttentionInputError: attnkit.bench.run: --gemm-size -1 is not a GEMM size:...
    """
    _check_names(where, "-p/--peer", peers or [], list(PEERS))
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise _option_error(
            where,
            "--reps",
            f"must be a positive int, got {reps!r}.",
            f"--reps {reps}",
            "an int >= 1 (5 or more for published numbers)",
            "pass --reps 5",
        )
    if not (isinstance(cap_gib, (int, float)) and math.isfinite(cap_gib) and cap_gib > 0):
        raise _option_error(
            where,
            "--cap-gib",
            f"must be a positive number of GiB, got {cap_gib!r}.",
            f"--cap-gib {cap_gib}",
            "a finite number > 0",
            "pass --cap-gib 12 (the default)",
        )
    if isinstance(gemm_n, bool) or not isinstance(gemm_n, int) or not 0 <= gemm_n <= MAX_GEMM:
        raise _option_error(
            where,
            "--gemm-size",
            f"{gemm_n!r} is not a GEMM size: 0 (none) or an n from 1 to {MAX_GEMM}.",
            f"--gemm-size {gemm_n}",
            f"an int from 0 to {MAX_GEMM}",
            "pass --gemm-size 4096 (the default), or 0 for none",
        )


def plan_rows(
    rows: Iterable[tuple[str, int, str, str]] | None = None,
    *,
    workloads: list[str] | None = None,
    lengths: list[int] | None = None,
    dtypes: list[str] | None = None,
    modes: list[str] | None = None,
    full: bool = False,
    quick: bool = False,
) -> list[tuple[str, int, str, str]]:
    """The rows to run: given ones, the acceptance rows (default), the quick smoke rows, or the
    product of the selections (``full``: every workload, length, dtype and mode).

    ``dtypes`` and ``modes`` filter any of these; ``quick`` is its own choice of rows, so it
    is refused together with ``workloads``, ``lengths`` or ``full``. Unknown names, lengths
    outside ``1..MAX_LENGTH`` and a selection that leaves no rows are refused too
    (:class:`~attnkit.AttentionInputError`).

    >>> plan_rows(quick=True, modes=["fwd+bwd"])
    [('window', 2048, 'float32', 'fwd+bwd')]
    """
    where = "attnkit.bench.plan_rows"
    if rows is not None:
        chosen = list(rows)
        check_rows(chosen, where)
        return chosen
    _check_names(where, "-w/--workload", workloads or [], list(WORKLOADS))
    _check_lengths(where, lengths or [])
    _check_names(where, "--dtype", dtypes or [], DTYPES)
    _check_names(where, "--mode", modes or [], MODES)
    if quick and (full or workloads or lengths):
        other = "--full" if full else "-w/--workload" if workloads else "-L/--length"
        raise _option_error(
            where,
            "--quick",
            f"picks its own rows (dense L=512, window L=2048), so it cannot go with {other}.",
            f"--quick with {other}",
            "--quick alone (--dtype, --mode and -p still apply), or rows chosen without it",
            f"leave out --quick, or leave out {other}",
        )
    if full or workloads or lengths:
        base = list(
            itertools.product(
                workloads or list(WORKLOADS),
                lengths or FULL_LENGTHS,
                dtypes or DTYPES,
                modes or MODES,
            )
        )
    else:
        base = QUICK_ROWS if quick else ACCEPTANCE_ROWS
    chosen = [
        r
        for r in base
        if (not workloads or r[0] in workloads)
        and (not lengths or r[1] in lengths)
        and (not dtypes or r[2] in dtypes)
        and (not modes or r[3] in modes)
    ]
    if not chosen:
        kinds = sorted({f"{r[2]} {r[3]}" for r in base})
        raise _option_error(
            where,
            "--dtype/--mode",
            f"leave no rows to run: the {'quick' if quick else 'default'} rows are "
            f"{', '.join(kinds)}.",
            f"--dtype {dtypes or DTYPES} --mode {modes or MODES}",
            "a selection that keeps at least one row",
            "pick rows with -w and -L to run other dtypes and modes",
        )
    return chosen


def _worker(job: dict[str, Any], timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "attnkit.bench.worker", json.dumps(job)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"error": f"worker failed (exit {done.returncode}): {tail[:200]}"}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def run(
    rows: Iterable[tuple[str, int, str, str]] | None = None,
    *,
    peers: list[str] | None = None,
    reps: int = 5,
    memory: bool = True,
    cap_gib: float = 12.0,
    timeout: float = 1800.0,
    progress: Callable[[str, int, int], None] | None = None,
    gemm: float | None = None,
    gemm_n: int = 4096,
) -> BenchResult:
    """Run the benchmark and return what it measured.

    Args:
        rows: ``(workload, L, dtype, mode)`` tuples (see :func:`plan_rows`); default: the
            acceptance rows.
        peers: names from :data:`attnkit.bench.peers.PEERS`; default: sdpa, flex, attnkit
            (auto), attnkit-blocked, and naive on float32 rows up to 8 heads at L = 4096
            (module rows always take torch-mha and attnkit-mha).
        reps: timed calls per peer (median reported; at least 5 for published numbers).
        memory: measure each case's peak memory in a fresh process.
        cap_gib: a peer whose dense tensors would take more is skipped, with the reason.
        timeout: seconds for one worker process.
        progress: called as ``progress(label, done, total)`` before each step (the CLI draws a
            progress bar from it).
        gemm: the GEMM throughput to use (GFLOP/s) instead of measuring it first.
        gemm_n: size of the GEMM timed in every round of every row, side by side with the
            peers (0: none; the fractions then use the throughput measured first).

    Every row and option is checked first (:func:`check_rows`, :func:`check_options`): a bad
    one raises :class:`~attnkit.AttentionInputError` before anything is measured.

    >>> result = run([("causal", 256, "float32", "fwd")], peers=["sdpa", "attnkit"],
    ...              memory=False, gemm=100.0, gemm_n=0)
    >>> [(e.peer, e.ms is not None) for e in result.rows[0].entries]
    [('sdpa', True), ('attnkit', True)]
    """
    start = time.perf_counter()
    chosen = list(rows) if rows is not None else ACCEPTANCE_ROWS
    check_rows(chosen, "attnkit.bench.run")
    check_options(peers=peers, reps=reps, cap_gib=cap_gib, gemm_n=gemm_n)
    names = peers or DEFAULT_PEERS
    cap = cap_gib * GiB
    info = machine()
    plans: list[tuple[Row, list[str]]] = []
    for workload, L, dtype, mode in chosen:
        wl = get_workload(workload)
        backward = mode == "fwd+bwd"
        row = Row(workload, L, dtype, mode, wl.flops(L, backward))
        todo = []
        row_peers = ["torch-mha", "attnkit-mha"] if wl.module else names
        Lq, S = wl.sizes(L)
        if peers is None and (wl.B * wl.H * Lq * S > NAIVE_MAX or dtype != "float32"):
            row_peers = [p for p in row_peers if p != "naive"]
        for name in row_peers:
            why = PEERS[name].skip(wl, L, getattr(torch, dtype), backward, cap)
            if why is None:
                todo.append(name)
            else:
                row.entries.append(Entry(name, skipped=why))
        plans.append((row, todo))
    total = 1 + sum(1 + (len(todo) if memory else 0) for _, todo in plans)
    step = 0

    def tick(label: str) -> None:
        nonlocal step
        if progress:
            progress(label, step, total)
        step += 1

    tick("fp32 GEMM throughput")
    gemm_gflops = gemm if gemm is not None else measure_gemm()
    for row, todo in plans:
        job = {
            "workload": row.workload,
            "L": row.L,
            "dtype": row.dtype,
            "backward": row.mode == "fwd+bwd",
            "reps": reps,
        }
        tick(f"{row.label}: timing {len(todo)} peers")
        timed: dict[str, Any] = {}
        if todo:
            timed = _worker({**job, "kind": "time", "peers": todo, "gemm_n": gemm_n}, timeout)
        if timed.get("gemm_gflops"):
            row.gemm_gflops = statistics.median(timed["gemm_gflops"])
        for name in todo:
            got = timed.get("peers", {}).get(name, {"error": timed.get("error", "no result")})
            e = Entry(name, error=got.get("error"), first_call_s=got.get("first_call_s"))
            if got.get("times"):
                e.times_ms = [t * 1e3 for t in got["times"]]
                e.ms = statistics.median(e.times_ms)
                e.gflops = row.flops / (e.ms / 1e3) / 1e9
                e.gemm_fraction = e.gflops / (row.gemm_gflops or gemm_gflops)
            if memory:
                tick(f"{row.label}: memory of {name}")
                if e.ms is not None:
                    mem = _worker({**job, "kind": "memory", "peers": [name]}, timeout)
                    e.peak_mib = mem.get("peak_mib")
            row.entries.append(e)
        outside = [e.ms for e in row.entries if e.peer in OUTSIDE and e.ms is not None]
        if outside:
            for e in row.entries:
                if e.ms is not None:
                    e.x_best_peer = e.ms / min(outside)
    if progress:
        progress("done", total, total)
    info["load_at_end"] = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    return BenchResult(info, gemm_gflops, [r for r, _ in plans], reps, time.perf_counter() - start)
