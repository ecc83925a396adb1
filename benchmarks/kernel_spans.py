"""attnkit's row-span kernel on every mask kind, as fractions of this machine's fp32 GEMM.

Each row runs attnkit's ``blocked`` backend (which hands the call to the row-span kernel; the
script checks that it does) and, where torch has a fused kernel for the same call, its SDPA:
``is_causal`` for causal rows, no mask for the unmasked (dense prefill) rows, whose ``auto``
column says which backend ``attnkit.attention`` picks for that call.
Peers and an ``n x n`` fp32 GEMM are timed interleaved (GEMM, A, B, GEMM, A, B, ...) so that the
noise of a shared machine hits all alike; each figure is the median of ``--reps`` timed runs
after one warm-up. ``of GEMM`` is useful FLOPs (allowed pairs only: ``4 D H`` per pair forward,
3.5x that forward + backward, as ``attnkit bench`` counts) over the median GEMM throughput.

    python benchmarks/kernel_spans.py [--reps 5] [--rows causal,documents,...] [--threads N]
                                      [--json out.json]
    python benchmarks/kernel_spans.py --rows unmasked   # the dense prefill sweep

On a machine shared with other jobs, torch's GEMM and SDPA split their work statically over
the threads and lose more to a busy core than the kernel, which hands out work items
dynamically: compare with ``--threads 1`` there.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import attnkit
from attnkit import files, masks
from attnkit.bench.machine import cpu_line

BACKWARD_FACTOR = 3.5


@dataclass(frozen=True)
class Case:
    name: str
    B: int
    H: int
    Hkv: int
    L: int
    spec: masks.MaskSpec | None  #: ``None``: no mask (SDPA without a mask is the peer)
    backward: bool = False
    sdpa_causal: bool = False  #: SDPA's is_causal computes the same call
    D: int = 64
    dtype: torch.dtype = torch.float32


def _documents(L: int, uneven: bool) -> masks.MaskSpec:
    ids = torch.zeros(L, dtype=torch.long)
    if uneven:  # 8 documents of random lengths, as attnkit bench's "document" row
        g = torch.Generator().manual_seed(L)
        cuts = torch.randperm(L - 1, generator=g)[:7].add(1).sort().values.tolist()
    else:
        cuts = [L * i // 8 for i in range(1, 8)]
    for c in cuts:
        ids[c:] += 1
    return masks.document(ids) & masks.causal()


def unmasked_cases() -> list[Case]:
    """The dense prefill sweep: no mask, forward and forward + backward."""
    rows = []
    for L in (512, 1024, 2048, 4096, 8192):
        for H, D in ((8, 64), (16, 64), (8, 128)):
            if L == 8192 and (H, D) != (16, 64):
                continue
            rows.append(Case(f"unmasked H={H} D={D} {L}", 1, H, H, L, None, D=D))
    for L, H, D in ((1024, 8, 64), (2048, 8, 64), (4096, 16, 64), (2048, 8, 128)):
        rows.append(Case(f"unmasked H={H} D={D} {L} fwd+bwd", 1, H, H, L, None, True, D=D))
    for L in (1024, 4096):
        name = f"unmasked H=16 D=64 {L} bf16"
        rows.append(Case(name, 1, 16, 16, L, None, D=64, dtype=torch.bfloat16))
    return rows


def cases() -> list[Case]:
    window = masks.causal() & masks.sliding_window(256)
    sweep = [
        Case(f"causal {L // 1024}k", 1, 8, 8, L, masks.causal(), sdpa_causal=True)
        for L in (1024, 2048, 8192)
    ]
    return [
        *sweep,
        Case("causal 4k", 1, 8, 8, 4096, masks.causal(), sdpa_causal=True),
        Case("causal 4k fwd+bwd", 1, 8, 8, 4096, masks.causal(), True, sdpa_causal=True),
        Case("documents 16k equal", 1, 8, 8, 16384, _documents(16384, False)),
        Case("documents 16k uneven", 1, 8, 8, 16384, _documents(16384, True)),
        Case("prefix-LM 4k (prefix 1k)", 1, 8, 8, 4096, masks.prefix_lm(1024)),
        Case(
            "padding 8k (B=2, [8k, 4k])", 2, 8, 8, 8192, masks.padding(torch.tensor([8192, 4096]))
        ),
        Case("GQA 32/8 window 256, 16k", 1, 32, 8, 16384, window),
        Case("GQA 32/8 window 256, 16k fwd+bwd", 1, 32, 8, 16384, window, True),
        *unmasked_cases(),
    ]


def allowed_pairs(spec: masks.MaskSpec | None, L: int, B: int) -> int:
    if spec is None:
        return B * L * L
    spans = masks.row_spans(spec, L, L)
    assert spans is not None
    lo, hi = spans
    return int((hi - lo + 1).clamp(min=0).sum()) * (B if lo.shape[0] == 1 else 1)


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_case(case: Case, reps: int, gemm_n: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    grad = case.backward

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(case.dtype).requires_grad_(grad)

    q = rand(case.B, case.H, case.L, case.D)
    k, v = rand(case.B, case.Hkv, case.L, case.D), rand(case.B, case.Hkv, case.L, case.D)
    dout = torch.randn(case.B, case.H, case.L, case.D, generator=g).to(case.dtype)
    note = attnkit.explain(q, k, v, mask=case.spec, backend="blocked").notes["blocked"]
    assert "row-span kernel" in note, f"{case.name}: {note}"
    assert "(one pass each" in note, f"{case.name}: {note}"
    a, b = torch.randn(gemm_n, gemm_n, generator=g), torch.randn(gemm_n, gemm_n, generator=g)

    def step(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def go() -> None:
            if grad:
                fn().backward(dout)
            else:
                with torch.no_grad():
                    fn()

        return go

    peers: dict[str, Callable[[], None]] = {
        "kernel": step(lambda: attnkit.attention(q, k, v, mask=case.spec, backend="blocked"))
    }
    if case.sdpa_causal:
        peers["sdpa"] = step(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    if case.spec is None:
        peers["sdpa"] = step(lambda: F.scaled_dot_product_attention(q, k, v))
    times: dict[str, list[float]] = {name: [] for name in [*peers, "gemm"]}
    for fn in peers.values():
        fn()  # warm-up (and the kernel's build)
    for _ in range(reps):
        times["gemm"].append(_timed(lambda: a @ b))
        for name, fn in peers.items():
            times[name].append(_timed(fn))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    gemm = 2.0 * gemm_n**3 / med["gemm"]
    flops = 4.0 * case.D * case.H * allowed_pairs(case.spec, case.L, case.B)
    flops *= BACKWARD_FACTOR if grad else 1.0
    row: dict[str, object] = {
        "row": case.name,
        "kernel_ms": round(med["kernel"] * 1e3, 1),
        "gemm_gflops": round(gemm / 1e9, 1),
        "kernel_gflops": round(flops / med["kernel"] / 1e9, 1),
        "kernel_of_gemm": round(flops / med["kernel"] / gemm, 3),
    }
    if "sdpa" in med:
        row["sdpa_ms"] = round(med["sdpa"] * 1e3, 1)
        row["sdpa_over_kernel"] = round(med["sdpa"] / med["kernel"], 3)
    if case.spec is None:
        row["auto"] = attnkit.explain(q, k, v).chosen
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--gemm", type=int, default=4096, help="n of the n x n GEMM")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as set)")
    parser.add_argument("--rows", default="", help="comma-separated substrings of row names")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    wanted = [w for w in args.rows.split(",") if w]
    chosen = [c for c in cases() if not wanted or any(w in c.name for w in wanted)]
    print(cpu_line())  # the CPU and its flags: every figure below depends on them
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{platform.processor() or platform.machine()}; median of {args.reps} interleaved reps"
    )
    results = []
    for case in chosen:
        row = run_case(case, args.reps, args.gemm)
        results.append(row)
        print("  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    if args.json:
        text = json.dumps(results, indent=1)  # replaced whole, never via a link
        files.write_text(args.json, text, argument="--json")


if __name__ == "__main__":
    main()
