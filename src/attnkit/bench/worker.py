"""One job of ``attnkit bench``, run in a fresh process: ``python -m attnkit.bench.worker JOB``.

``JOB`` is JSON: ``{"kind": "time" | "memory", "workload", "L", "dtype", "backward", "peers",
"reps", "gemm_n", "min_call_ms"}``; the result is one line of JSON on stdout.

* ``time``: every peer of one row in one process, timed *interleaved* (one call of each peer in
  turn, ``reps`` rounds) so that the noise of a shared machine hits all of them alike; each
  round also times one fp32 GEMM (``gemm_n``), so that the fraction of GEMM throughput a peer
  reaches is measured side by side too. The first call of each peer (flex compiles there) is
  timed apart and not counted. A peer whose warm call takes less than ``min_call_ms`` is called
  ``calls`` times back to back in each round (enough to fill ``min_call_ms``, at most
  :data:`MAX_CALLS`) and the round records their mean: a few-millisecond call is otherwise at
  the mercy of one time slice lost to another job.
  A decode row (memory-bound) turns through copies of K/V, one per call
  (:meth:`~attnkit.bench.workloads.Workload.copies`, sized to the last-level cache), so that no
  call finds its K/V in the cache the previous call filled; ``copies`` in the result.
* ``memory``: one peer in a process of its own: peak resident memory during one call above what
  the inputs take (``VmHWM`` from ``/proc/self/status``). A peer that compiles (flex) runs once
  first; the peak is then reset (``/proc/self/clear_refs``), so the compile is not counted.
  Likewise attnkit's C++ kernel is loaded before the baseline is read, in every memory process
  whichever peer it measures: loading it (once per process) is not a call's memory.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from attnkit.backends.blocked import rowspan_builds
from attnkit.bench.machine import last_level_cache_bytes
from attnkit.bench.peers import PEERS, step
from attnkit.bench.workloads import get_workload

__all__ = ["main", "run_job"]

MiB = 1 << 20
MAX_CALLS = 16  # calls per round of a fast peer, at most
PROBE_S = 1.0  # a peer whose untimed call took longer is not probed again: one call per round


def _status(field: str) -> int | None:
    """A ``/proc/self/status`` field in bytes (``None`` off Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _params(fn: Callable[[], torch.Tensor]) -> list[Any]:
    """The parameters of a module a peer's call closes over (module rows train them too)."""
    found: list[Any] = []
    for cell in getattr(fn, "__closure__", None) or ():
        obj = cell.cell_contents
        if isinstance(obj, torch.nn.Module):
            found += list(obj.parameters())
    return found


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    wl = get_workload(job["workload"])
    dtype = getattr(torch, job["dtype"])
    backward = bool(job["backward"])
    L = int(job["L"])
    if job["kind"] == "memory":
        (name,) = job["peers"]
        rowspan_builds.available()  # the one-time load of the kernel's library (see the docstring)
        before = _status("VmRSS")
        inputs = wl.inputs(L, dtype, grad=backward)
        base = _status("VmRSS")
        fn = PEERS[name].setup(wl, inputs)
        params = _params(fn)
        if name in ("flex", "attnkit-flex"):
            step(fn, inputs, backward, params)  # compile
            _reset_peak()
        step(fn, inputs, backward, params)
        peak = _status("VmHWM")
        if peak is None or base is None or before is None:
            return {"peak_mib": None, "inputs_mib": None}
        return {"peak_mib": (peak - base) / MiB, "inputs_mib": (base - before) / MiB}
    inputs = wl.inputs(L, dtype, grad=backward)
    n_copies = 1 if backward else wl.copies(L, dtype, last_level_cache_bytes())
    sets = [inputs] + [
        replace(inputs, k=inputs.k.clone(), v=inputs.v.clone()) for _ in range(n_copies - 1)
    ]
    fns: dict[str, list[Callable[[], torch.Tensor]]] = {}
    turn = dict.fromkeys(job["peers"], 0)
    result: dict[str, Any] = {}
    min_call = float(job.get("min_call_ms", 0.0)) / 1e3
    calls: dict[str, int] = {}
    for name in job["peers"]:
        try:
            fns[name] = [PEERS[name].setup(wl, s) for s in sets]
            params = _params(fns[name][0])
            t0 = time.perf_counter()
            step(fns[name][0], inputs, backward, params)
            first = time.perf_counter() - t0
            result[name] = {"first_call_s": first, "times": []}
            if first < PROBE_S or name in ("flex", "attnkit-flex"):  # flex compiled: warm up
                t0 = time.perf_counter()
                step(fns[name][0], inputs, backward, params)
                first = time.perf_counter() - t0
            calls[name] = 1 if first >= min_call else min(MAX_CALLS, math.ceil(min_call / first))
            result[name]["calls"] = calls[name]
        except Exception as e:  # a peer that breaks is reported, the others still run
            fns.pop(name, None)
            result[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    g = torch.Generator().manual_seed(0)
    n = int(job.get("gemm_n", 0))
    a, b = (torch.randn(n, n, generator=g) for _ in range(2))
    gemm: list[float] = []
    for _ in range(int(job["reps"])):
        if n:  # the machine's GEMM throughput, in the same rounds as the peers
            t0 = time.perf_counter()
            a @ b
            gemm.append(2.0 * n**3 / (time.perf_counter() - t0) / 1e9)
        for name, fn_list in fns.items():
            params = _params(fn_list[0])
            t0 = time.perf_counter()
            for _ in range(calls[name]):
                c = turn[name] % n_copies
                turn[name] += 1
                step(fn_list[c], sets[c], backward, params)
            result[name]["times"].append((time.perf_counter() - t0) / calls[name])
    return {"peers": result, "gemm_gflops": gemm, "copies": n_copies}


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    out = run_job(json.loads(args[0]))
    sys.stdout.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
