"""The decode kernel's entry layer: the C ABI called with ctypes (this attnkit) against the same
kernel bodies behind torch's pybind entry (an older source built with ``load_inline``), timed
interleaved in one process. A decode step is short, so the per-call cost of the entry (checks,
output allocation, argument passing) shows there first.

``--base-source`` is a ``csrc/decode.cpp`` of the pybind era with ``csrc/elements.h`` before it
(e.g. ``git show edcf7ac:src/attnkit/backends/blocked/csrc/elements.h
edcf7ac:src/attnkit/backends/blocked/csrc/decode.cpp > /tmp/decode_pybind.cpp``); both must
give the same bits. Median CPU microseconds (``time.process_time``) of ``--reps`` rounds of
``--calls`` calls each, the order flipped every round. B=1, H=8, Hkv=2, L=1, D=64, float32.

    python benchmarks/kernel_entry.py --base-source /tmp/decode_pybind.cpp [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch.utils.cpp_extension import load_inline

from attnkit.backends.blocked import decode
from attnkit.bench.machine import cpu_line


def load_base(path: str) -> Any:
    """The decode kernel of the pybind era, built from ``path``."""
    with open(path) as f:
        source = f.read()
    return load_inline(  # type: ignore[no-untyped-call]
        name="attnkit_decode_pybind",
        cpp_sources=[source],
        functions=["decode_forward", "decode_low_dtypes"],
        extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        no_implicit_headers=True,
        with_pytorch_error_handling=False,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-source", required=True, help="elements.h + a pybind-era decode.cpp")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--reps", type=int, default=9, help="interleaved rounds (default 9)")
    ap.add_argument("--calls", type=int, default=500, help="calls per round (default 500)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if decode.build() is None:
        raise SystemExit(f"the decode kernel does not run here: {decode.status()}")
    kernels = {"pybind": load_base(args.base_source), "C ABI": decode.kernel()}
    print(cpu_line())  # the CPU and its flags: every figure below depends on them
    print(f"torch {torch.__version__}, {args.threads} threads; median CPU us of {args.reps}")
    print("| S | pybind | C ABI | C ABI / pybind |\n|---|---|---|---|")
    for S in (256, 512, 1024, 4096):
        q = torch.randn(1, 8, 1, 64)
        k, v = torch.randn(1, 2, S, 64), torch.randn(1, 2, S, 64)
        lo, hi = torch.zeros(1, 1, dtype=torch.long), torch.full((1, 1), S - 1)
        # the pybind entry took the runs as lo, hi; the C ABI's takes the plan that holds them
        runs = {"pybind": (lo, hi), "C ABI": (decode.DecodePlan(lo, hi, "no mask", None),)}
        outs = [m.decode_forward(q, k, v, *runs[n], 0.125) for n, m in kernels.items()]
        assert all(torch.equal(a, b) for a, b in zip(outs[0][:2], outs[1][:2], strict=True))
        times: dict[str, list[float]] = {name: [] for name in kernels}
        for rep in range(args.reps):
            order = list(kernels.items())
            for name, m in order if rep % 2 else order[::-1]:
                t0 = time.process_time()
                for _ in range(args.calls):
                    m.decode_forward(q, k, v, *runs[name], 0.125)
                times[name].append((time.process_time() - t0) / args.calls * 1e6)
        a, b = (statistics.median(times[n]) for n in kernels)
        print(f"| {S} | {a:.1f} | {b:.1f} | {b / a:.2f} |")


if __name__ == "__main__":
    main()
