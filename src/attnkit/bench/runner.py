"""Run ``attnkit bench``: rows of (workload, L, dtype, mode), each peer timed and measured.

Every row's peers are timed together in one fresh process (interleaved, median of ``reps``);
every (row, peer) gets one more fresh process for its peak memory. The machine's fp32 GEMM
throughput is measured first, so each row can say which fraction of it the useful FLOPs reach.
What it measured is a :class:`~attnkit.bench.results.BenchResult`.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from attnkit.bench.machine import machine, measure_read_bandwidth
from attnkit.bench.peers import OUTSIDE, PEERS
from attnkit.bench.plan import (
    ACCEPTANCE_ROWS,
    DEFAULT_ROWS,
    GROUPS,
    MASKS_ROWS,
    QUICK_PEERS,
    check_options,
    check_rows,
    plan_rows,
    row_peers,
)
from attnkit.bench.results import BenchResult, Entry, Row
from attnkit.bench.workloads import get_workload

__all__ = [
    "ACCEPTANCE_ROWS",
    "DEFAULT_ROWS",
    "GROUPS",
    "MASKS_ROWS",
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
    info = machine()
    plans = _plan(chosen, peers, cap_gib * GiB)
    total = 1 + sum(1 + (len(todo) if memory else 0) for _, todo in plans)
    step = 0

    def tick(label: str) -> None:
        nonlocal step
        if progress:
            progress(label, step, total)
        step += 1

    tick("fp32 GEMM throughput")
    gemm_gflops = gemm if gemm is not None else measure_gemm()
    if any(get_workload(r.workload).queries for r, _ in plans):  # decode rows: GB/s notes
        info["read_gbps"] = round(measure_read_bandwidth(), 2)
    for row, todo in plans:
        _measure_row(
            row, todo, tick, reps=reps, memory=memory, timeout=timeout,
            gemm_n=gemm_n, min_call_ms=min_call_ms, gemm_gflops=gemm_gflops,
        )  # fmt: skip
        _kv_rates(row, info.get("read_gbps"))
    if progress:
        progress("done", total, total)
    info["load_at_end"] = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    rows_done = [r for r, _ in plans]
    return BenchResult(info, gemm_gflops, rows_done, reps, time.perf_counter() - start, min_call_ms)


def _plan(
    rows: list[tuple[str, int, str, str]], peers: list[str] | None, cap: float
) -> list[tuple[Row, list[str]]]:
    """Each row with the peers it will time; a peer that cannot run it is entered as skipped,
    with the reason."""
    plans: list[tuple[Row, list[str]]] = []
    for workload, L, dtype, mode in rows:
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
    return plans


def _entry(name: str, got: dict[str, Any], flops: float, gemm_gflops: float) -> Entry:
    """A peer's entry from what its worker reported: the median of its times, its useful
    GFLOP/s and their fraction of the GEMM's; or its error."""
    e = Entry(
        name,
        error=got.get("error"),
        first_call_s=got.get("first_call_s"),
        calls=got.get("calls", 1),
    )
    if got.get("times"):
        e.times_ms = [t * 1e3 for t in got["times"]]
        e.ms = statistics.median(e.times_ms)
        e.gflops = flops / (e.ms / 1e3) / 1e9
        e.gemm_fraction = e.gflops / gemm_gflops
    return e


def _against_best_peer(row: Row) -> None:
    """Each entry's time over the fastest peer's that is not attnkit (where one ran)."""
    outside = [e.ms for e in row.entries if e.peer in OUTSIDE and e.ms is not None]
    if outside:
        for e in row.entries:
            if e.ms is not None:
                e.x_best_peer = e.ms / min(outside)


def _kv_rates(row: Row, read_gbps: float | None) -> None:
    """On a decode row, each entry's note says the rate it read K/V at (the bytes of the keys
    its queries may see, :meth:`~attnkit.bench.workloads.Workload.kv_bytes`, over its time)
    and that over the machine's read bandwidth, measured at the start of the run."""
    wl = get_workload(row.workload)
    if not wl.queries:
        return
    nbytes = wl.kv_bytes(row.L, getattr(torch, row.dtype))
    for e in row.entries:
        if e.ms is not None:
            gbps = nbytes / (e.ms / 1e3) / 1e9
            of = f" = {gbps / read_gbps:.2f} of read {read_gbps:.1f}" if read_gbps else ""
            e.note = f"K/V {gbps:.1f} GB/s{of}"


def _measure_row(
    row: Row,
    todo: list[str],
    tick: Callable[[str], None],
    *,
    reps: int,
    memory: bool,
    timeout: float,
    gemm_n: int,
    min_call_ms: float,
    gemm_gflops: float,
) -> None:
    """Time ``todo``'s peers on ``row`` in one worker, then each one's memory in its own; their
    entries join the row's."""
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
    row.kv_copies = int(timed.get("copies", 1))
    for name in todo:
        got = timed.get("peers", {}).get(name, {"error": timed.get("error", "no result")})
        e = _entry(name, got, row.flops, row.gemm_gflops or gemm_gflops)
        if memory:
            tick(f"{row.label}: memory of {name}")
            if e.ms is not None:
                mem = _worker({**job, "kind": "memory", "peers": [name]}, timeout)
                e.peak_mib = mem.get("peak_mib")
        row.entries.append(e)
    _against_best_peer(row)
