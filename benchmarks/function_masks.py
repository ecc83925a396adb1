"""A mask written as a function (:func:`attnkit.masks.from_function`) against the same rule as
a built-in spec, forward + backward on the blocked backend, side by side in one run.

The rule is a causal sliding window (``--window``, 256): the built-in spec is
``causal() & sliding_window(256)``, the function ``(kv <= q) & (q - kv < 256)``. Each figure is
the median of ``--reps`` timed forward + backward runs after a warm-up, interleaved (A, B, A, B)
so that a shared machine's noise hits both alike; the ratio is function / built-in. ``warm`` is a
call as the second layer of a model makes it (runs of keys, block states and plans cached);
``first call`` one with every cache emptied first (kernels already loaded): the function's runs
of keys found from its values, L x S evaluations of it, a group of rows at a time. ``peak MiB``
is the growth of the peak resident memory (``VmHWM``) over each side's first call in a fresh
process with glibc's mmap threshold fixed (q, k, v allocated before; out and the gradients,
4 x L x H x D floats, count): it
follows L, not L x S (an L x S bool mask is ``L * L`` bytes).

    python benchmarks/function_masks.py [--L 16384] [--heads 8] [--dim 64] [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

import attnkit
from attnkit.backends.blocked.blocks import clear_plans
from attnkit.bench.machine import cpu_line
from attnkit.masks import causal, from_function, sliding_window
from attnkit.masks import function as fmod


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _peak_growth_mib(fn: Callable[[], object]) -> float:
    """Growth of the peak resident set over one call of ``fn`` (the peak is reset first)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return float("nan")
    before = _status_kib("VmRSS")
    fn()
    return (_status_kib("VmHWM") - before) / 1024


def _peak_in_fresh_process(side: str, a: argparse.Namespace) -> float:
    """The growth of the peak resident set over ``side``'s first forward + backward in a
    fresh process (its inputs allocated before the peak is reset)."""
    args = [sys.executable, __file__, "--L", str(a.L), "--heads", str(a.heads)]
    args += ["--dim", str(a.dim), "--window", str(a.window), "--peak-of", side]
    # glibc's adaptive mmap threshold keeps freed chunks of the function's evaluation in the
    # heap (peaks from 170 to 800 MiB from run to run here): a fixed threshold measures what
    # attnkit keeps alive
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    out = subprocess.run(args, capture_output=True, text=True, check=True, env=env).stdout
    return float(out.split()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--L", type=int, default=16384)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--peak-of", choices=["function", "built-in spec"], help=argparse.SUPPRESS)
    a = p.parse_args()
    L, H, D, w = a.L, a.heads, a.dim, a.window
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, H, L, D, generator=g, requires_grad=True)
    k = torch.randn(1, H, L, D, generator=g, requires_grad=True)
    v = torch.randn(1, H, L, D, generator=g, requires_grad=True)
    dout = torch.randn(1, H, L, D, generator=g)
    builtin = causal() & sliding_window(w)

    def window(
        b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, kv: torch.Tensor
    ) -> torch.Tensor:
        return (kv <= qi) & (qi - kv < w)

    def step(mask: attnkit.masks.MaskSpec) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            out = attnkit.attention(q, k, v, mask=mask, backend="blocked")
            out.backward(dout)
            q.grad = k.grad = v.grad = None
            return out.detach()

        return run

    sides = {"built-in spec": step(builtin), "function": step(from_function(window))}
    if a.peak_of:  # in a fresh process: one side's first call, nothing allocated before it
        print(_peak_growth_mib(sides[a.peak_of]))
        return
    for f in sides.values():  # kernels loaded, threads started
        f()
    cold: dict[str, float] = {}
    for n, f in sides.items():  # every cache empty: the spec's runs and blocks found again
        clear_plans()
        fmod.clear_cache()
        t0 = time.perf_counter()
        f()
        cold[n] = time.perf_counter() - t0
    peaks = {n: _peak_in_fresh_process(n, a) for n in sides}
    diff = float((sides["function"]() - sides["built-in spec"]()).abs().max())
    times: dict[str, list[float]] = {n: [] for n in sides}
    for _ in range(a.reps):
        for n, f in sides.items():
            t0 = time.perf_counter()
            f()
            times[n].append(time.perf_counter() - t0)
    med = {n: statistics.median(t) for n, t in times.items()}
    ratio = med["function"] / med["built-in spec"]
    print(f"L = S = {L}, H = {H}, D = {D}, float32, causal window {w}, forward + backward,")
    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}; {cpu_line()}")
    print(f"median of {a.reps} interleaved reps; max |out difference| = {diff:.2e}\n")
    print("| mask | forward + backward, warm (s) | first call, caches empty (s) | peak MiB |")
    print("|---|---|---|---|")
    for n in sides:
        print(f"| {n} | {med[n]:.3f} | {cold[n]:.3f} | {peaks[n]:.0f} |")
    cold_ratio = cold["function"] / cold["built-in spec"]
    print(
        f"\nfunction / built-in: {ratio:.2f}x warm (target <= 1.3x), {cold_ratio:.2f}x first call"
    )
    print(f"an L x S bool mask would be {L * L / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
