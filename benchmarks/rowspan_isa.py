"""The row-span kernel's AVX2 build against its AVX-512 build and torch's SDPA, float32, timed
interleaved in one run (median of ``--reps``), with the machine's fp32 GEMM rate beside them.

Each call is timed raw: ``rowspan_builds.kernel(isa).span_forward`` (and ``span_backward``) on
a plan of the mask, against ``F.scaled_dot_product_attention`` (``is_causal`` for causal rows, the
dense boolean mask for the window, nothing for dense). B=1.

    PYTHONPATH=src python benchmarks/rowspan_isa.py [--reps 5] [--threads 2] [--rows dense,causal]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from attnkit import masks
from attnkit.backends.blocked import rowspan, rowspan_builds
from attnkit.bench.runner import measure_gemm
from attnkit.cpu import hardware_flags

#: name -> (H, Hkv, L, D, mask kind, window, backward)
ROWS: dict[str, tuple[int, int, int, int, str, int, bool]] = {
    "dense": (16, 16, 4096, 64, "dense", 0, False),
    "causal": (16, 16, 4096, 64, "causal", 0, False),
    "causal-bwd": (16, 16, 4096, 64, "causal", 0, True),
    "window": (8, 8, 16384, 64, "window", 1024, False),
    "gqa": (32, 8, 4096, 128, "causal", 0, False),
}


def _calls(row: str) -> tuple[dict[str, Callable[[], Any]], float]:
    """The timed calls of ``row`` (``avx2``, ``avx512``, ``sdpa``) and its useful FLOPs."""
    H, Hkv, L, D, kind, window, bwd = ROWS[row]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, H, L, D, generator=gen)
    k = torch.randn(1, Hkv, L, D, generator=gen)
    v = torch.randn(1, Hkv, L, D, generator=gen)
    dout = torch.randn(1, H, L, D, generator=gen)
    spec = None
    if kind == "causal":
        spec = masks.causal()
    elif kind == "window":
        spec = masks.causal() & masks.sliding_window(window)
    plan = rowspan.plan(spec, q, k, v)
    assert plan.serves, plan.reason
    assert plan.lo is not None
    assert plan.hi is not None
    pairs = float((plan.hi - plan.lo + 1).clamp(min=0).sum())
    flops = 4.0 * pairs * D * H * (3.5 if bwd else 1.0)
    scale = D**-0.5
    calls: dict[str, Callable[[], Any]] = {}
    for isa in (rowspan_builds.AVX2.isa, rowspan_builds.AVX512.isa):
        kern = rowspan_builds.kernel(isa)

        def run(kern: Any = kern) -> Any:
            out, lse = kern.span_forward(q, k, v, plan, scale, 0.0)
            if bwd:
                kern.span_backward(q, k, v, out, dout, lse, plan, scale, 0.0)
            return out

        calls[isa] = run
    g = H // Hkv
    kr, vr = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    dense_mask = spec.to_dense(L, L) if spec is not None and kind == "window" else None

    def sdpa() -> Any:
        qq, kk, vv = (t.requires_grad_(bwd) for t in (q.detach(), kr.detach(), vr.detach()))
        out = F.scaled_dot_product_attention(
            qq, kk, vv, attn_mask=dense_mask, is_causal=kind == "causal"
        )
        if bwd:
            out.backward(dout)
        return out

    calls["sdpa"] = sdpa
    return calls, flops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default=",".join(ROWS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    running, why = rowspan_builds.select(torch.float32)
    if running is not rowspan_builds.AVX512:
        raise SystemExit(f"no AVX-512 build here: {why}")
    with open("/proc/cpuinfo") as f:
        names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
    model = names[0] if names else platform.processor()
    avx512 = sorted(f for f in hardware_flags() if f.startswith("avx512"))
    print(
        f"CPU: {model}; {', '.join(avx512)}; torch {torch.__version__} capability "
        f"{torch.backends.cpu.get_cpu_capability()}; {args.threads} threads"
    )
    print(f"fp32 GEMM 4096^3 before: {measure_gemm(reps=args.reps):.0f} GFLOP/s")
    print(
        "| row | AVX2 build ms | AVX-512 build ms | SDPA ms | AVX-512 / AVX2 | SDPA / AVX-512 "
        "| AVX-512 GFLOP/s |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in args.rows.split(","):
        calls, flops = _calls(row)
        for fn in calls.values():  # warm-up
            fn()
        times: dict[str, list[float]] = {n: [] for n in calls}
        for rep in range(args.reps):
            order = list(calls) if rep % 2 == 0 else list(reversed(calls))
            for name in order:
                t0 = time.perf_counter()
                calls[name]()
                times[name].append(time.perf_counter() - t0)
        med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
        a2, a5, sd = med["avx2"], med[rowspan_builds.AVX512.isa], med["sdpa"]
        print(
            f"| {row} | {a2:.0f} | {a5:.0f} | {sd:.0f} | {a2 / a5:.2f}x | {sd / a5:.2f}x "
            f"| {flops / a5 / 1e6:.0f} |",
            flush=True,
        )
    print(f"fp32 GEMM 4096^3 after: {measure_gemm(reps=args.reps):.0f} GFLOP/s")


if __name__ == "__main__":
    main()
