"""Run ``attnkit bench``: rows of (workload, L, dtype, mode), each peer timed and measured.

Every row's peers are timed together in one fresh process (interleaved, median of ``reps``);
every (row, peer) gets one more fresh process for its peak memory. The machine's fp32 GEMM
throughput is measured first, so each row can say which fraction of it the useful FLOPs reach.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from attnkit.bench.machine import machine
from attnkit.bench.peers import OUTSIDE, PEERS
from attnkit.bench.plan import (
    ACCEPTANCE_ROWS,
    DEFAULT_ROWS,
    GROUPS,
    ISSUE14_ROWS,
    QUICK_PEERS,
    check_options,
    check_rows,
    plan_rows,
    row_peers,
)
from attnkit.bench.workloads import get_workload

__all__ = [
    "ACCEPTANCE_ROWS",
    "DEFAULT_ROWS",
    "GROUPS",
    "ISSUE14_ROWS",
    "QUICK_PEERS",
    "BenchResult",
    "Entry",
    "Row",
    "check_options",
    "check_rows",
    "machine",
    "measure_gemm",
    "plan_rows",
    "row_peers",
    "run",
]

GiB = 1 << 30


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
    #: a call faster than this was repeated within its round (see attnkit.bench.worker)
    min_call_ms: float = 0.0

    def to_json(self) -> dict[str, Any]:
        from attnkit.bench.report import acceptance

        return {
            "machine": self.machine,
            "gemm_gflops": self.gemm_gflops,
            "reps": self.reps,
            "min_call_ms": self.min_call_ms,
            "seconds": self.seconds,
            "rows": [asdict(r) | {"label": r.label} for r in self.rows],
            "acceptance": [asdict(c) for c in acceptance(self)],
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
    min_call_ms: float = 50.0,
) -> BenchResult:
    """Run the benchmark and return what it measured.

    Args:
        rows: ``(workload, L, dtype, mode)`` tuples (see :func:`plan_rows`); default:
            :data:`DEFAULT_ROWS`.
        peers: names from :data:`attnkit.bench.peers.PEERS`, for every row; default: each
            row's own (:func:`row_peers`).
        reps: timed calls per peer (median reported; at least 5 for published numbers).
        memory: measure each case's peak memory in a fresh process.
        cap_gib: a peer whose dense tensors would take more is skipped, with the reason.
        timeout: seconds for one worker process.
        progress: called as ``progress(label, done, total)`` before each step (the CLI draws a
            progress bar from it).
        gemm: the GEMM throughput to use (GFLOP/s) instead of measuring it first.
        gemm_n: size of the GEMM timed in every round of every row, side by side with the
            peers (0: none; the fractions then use the throughput measured first).
        min_call_ms: a peer whose warm call is faster is called several times back to back in
            each round (up to this many ms, at most 16 calls) and the round takes their mean;
            0: one call per round.

    Every row and option is checked first (:func:`check_rows`, :func:`check_options`): a bad
    one raises :class:`~attnkit.AttentionInputError` before anything is measured.

    >>> result = run([("causal", 256, "float32", "fwd")], peers=["sdpa", "attnkit"],
    ...              memory=False, gemm=100.0, gemm_n=0)
    >>> [(e.peer, e.ms is not None) for e in result.rows[0].entries]
    [('sdpa', True), ('attnkit', True)]
    """
    start = time.perf_counter()
    chosen = list(rows) if rows is not None else DEFAULT_ROWS
    check_rows(chosen, "attnkit.bench.run")
    check_options(peers=peers, reps=reps, cap_gib=cap_gib, gemm_n=gemm_n, min_call_ms=min_call_ms)
    cap = cap_gib * GiB
    info = machine()
    plans: list[tuple[Row, list[str]]] = []
    for workload, L, dtype, mode in chosen:
        wl = get_workload(workload)
        backward = mode == "fwd+bwd"
        row = Row(workload, L, dtype, mode, wl.flops(L, backward))
        todo = []
        for name in peers or row_peers(workload, L, dtype):
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
            timed = _worker(
                {
                    **job,
                    "kind": "time",
                    "peers": todo,
                    "gemm_n": gemm_n,
                    "min_call_ms": min_call_ms,
                },
                timeout,
            )
        if timed.get("gemm_gflops"):
            row.gemm_gflops = statistics.median(timed["gemm_gflops"])
        for name in todo:
            got = timed.get("peers", {}).get(name, {"error": timed.get("error", "no result")})
            e = Entry(
                name,
                error=got.get("error"),
                first_call_s=got.get("first_call_s"),
                calls=got.get("calls", 1),
            )
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
    rows_done = [r for r, _ in plans]
    return BenchResult(info, gemm_gflops, rows_done, reps, time.perf_counter() - start, min_call_ms)
