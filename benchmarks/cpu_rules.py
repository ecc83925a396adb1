"""Measure auto's CPU rule for one dtype on this CPU: attnkit's kernels against torch's SDPA.

``auto`` gives plain causal, unmasked (dense) and decode calls to attnkit's kernels or to torch's
SDPA by a rule measured per dtype and instruction set class
(``attnkit.backends.blocked.measured``). This program measures one: for each kind of call it
times attnkit's kernel (``backend="blocked"``) against ``F.scaled_dot_product_attention`` called
as a user would, on the same tensors, interleaved (A, B, A, B, ...), median of ``--reps``
repetitions after a warm-up; the ratio is SDPA's median time over attnkit's (> 1: attnkit
faster). A kind goes to attnkit when every row of that kind is at least 1.0x. It prints the CPU's
flags and class, the table, the verdict, and the rule auto applies here now, so the rule in the
table can be checked against what was measured.

    python benchmarks/cpu_rules.py [--dtype bfloat16] [--reps 5] [--kinds causal,dense,decode]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import attnkit
from attnkit import cpu
from attnkit.backends.blocked import measured


@dataclass(frozen=True)
class Row:
    """One call: ``kind``, heads ``H``/``Hkv``, ``L`` queries over ``S`` keys of dim ``D``,
    forward only or forward + backward (``train``)."""

    kind: measured.Kind
    H: int
    Hkv: int
    L: int
    S: int
    D: int
    train: bool = False

    def __str__(self) -> str:
        heads = f"H={self.H}" if self.Hkv == self.H else f"GQA {self.H}/{self.Hkv}"
        what = "fwd+bwd" if self.train else "fwd"
        return f"{self.kind} {heads} D={self.D} L={self.L} S={self.S} {what}"


ROWS = (
    Row("dense", 16, 16, 1024, 1024, 64),
    Row("dense", 16, 16, 4096, 4096, 64),
    Row("causal", 16, 16, 1024, 1024, 64),
    Row("causal", 32, 8, 4096, 4096, 128),
    Row("causal", 16, 16, 2048, 2048, 64, train=True),
    Row("decode", 32, 8, 1, 4096, 128),
    Row("decode", 32, 8, 4, 4096, 128),
)


def _variants(row: Row, dtype: torch.dtype) -> tuple[Callable[[], None], Callable[[], None]]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, row.H, row.L, row.D, generator=g).to(dtype)
    k = torch.randn(1, row.Hkv, row.S, row.D, generator=g).to(dtype)
    v = torch.randn(1, row.Hkv, row.S, row.D, generator=g).to(dtype)
    dout = torch.randn(1, row.H, row.L, row.D, generator=g).to(dtype)
    for t in (q, k, v):
        t.requires_grad_(row.train)
    causal = row.kind == "causal"

    def run(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def call() -> None:
            if row.train:
                fn().backward(dout)
            else:
                with torch.no_grad():
                    fn()

        return call

    def ours() -> torch.Tensor:
        return attnkit.attention(q, k, v, causal=causal, backend="blocked")

    def sdpa() -> torch.Tensor:
        gqa = row.Hkv != row.H
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

    return run(ours), run(sdpa)


def measure(row: Row, dtype: torch.dtype, reps: int) -> tuple[float, float, float]:
    """attnkit's and SDPA's median ms, and the median of the per-repetition ratios."""
    ours, sdpa = _variants(row, dtype)
    ours()
    sdpa()
    a: list[float] = []
    b: list[float] = []
    for _ in range(reps):
        for fn, into in ((ours, a), (sdpa, b)):
            t0 = time.perf_counter()
            fn()
            into.append(time.perf_counter() - t0)
    ratio = statistics.median(y / x for x, y in zip(a, b, strict=True))
    return statistics.median(a) * 1e3, statistics.median(b) * 1e3, ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--kinds", default=",".join(measured.KINDS))
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    kinds = args.kinds.split(",")
    print(f"CPU: {cpu.features()}")
    print(f"class for {args.dtype}: {measured.isa_class(dtype)}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.reps}\n")
    print("| row | attnkit ms | SDPA ms | attnkit vs SDPA |")
    print("|---|---|---|---|")
    worst: dict[str, float] = {}
    for row in ROWS:
        if row.kind not in kinds:
            continue
        ours, sdpa, ratio = measure(row, dtype, args.reps)
        worst[row.kind] = min(worst.get(row.kind, ratio), ratio)
        print(f"| {row} | {ours:.2f} | {sdpa:.2f} | {ratio:.2f}x |", flush=True)
    print()
    for kind, ratio in worst.items():
        verdict = "attnkit" if ratio >= 1.0 else "SDPA"
        takes, why = measured.select(dtype, kind)  # type: ignore[arg-type]
        now = "attnkit" if takes else "SDPA"
        print(f"{kind}: slowest row {ratio:.2f}x -> {verdict}; auto's rule here: {now} ({why})")


if __name__ == "__main__":
    main()
