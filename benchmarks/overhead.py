"""What validation and dispatch cost: attnkit.attention(backend="auto") against torch's SDPA.

Both run side by side in one process, interleaved (A, B, A, B, ...) so that the noise of this
shared machine hits both alike; each figure is the median of REPS timed runs after warm-up.
The acceptance bar: auto on (1, 8, 4096, 64) float32 costs at most 1.05x SDPA.

    python benchmarks/overhead.py [--reps 11] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import attnkit
from attnkit import files

CASES = [
    # name, (B, H, L, Dk), causal
    ("dense (1, 8, 4096, 64)", (1, 8, 4096, 64), False),
    ("causal (1, 8, 4096, 64)", (1, 8, 4096, 64), True),
    ("dense (1, 8, 256, 64)", (1, 8, 256, 64), False),
    ("dense (1, 8, 16, 64)", (1, 8, 16, 64), False),
]


def _time(fn: Callable[[], torch.Tensor]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(shape: tuple[int, int, int, int], causal: bool, reps: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=g) for _ in range(3))

    def ours() -> torch.Tensor:
        return attnkit.attention(q, k, v, causal=causal)

    def theirs() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    assert torch.allclose(ours(), theirs(), atol=1e-5)
    inner = max(1, int(0.05 / max(_time(theirs), 1e-6)))  # >= 50 ms per timed sample
    for _ in range(2):
        ours(), theirs()
    a: list[float] = []
    b: list[float] = []
    for _ in range(reps):
        a.append(sum(_time(ours) for _ in range(inner)) / inner)
        b.append(sum(_time(theirs) for _ in range(inner)) / inner)
    ratios = [x / y for x, y in zip(a, b, strict=True)]
    return {
        "attnkit_ms": statistics.median(a) * 1e3,
        "sdpa_ms": statistics.median(b) * 1e3,
        "ratio_of_medians": statistics.median(a) / statistics.median(b),
        "median_of_paired_ratios": statistics.median(ratios),
        "overhead_us": (statistics.median(a) - statistics.median(b)) * 1e6,
        "calls_per_sample": inner,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{platform.processor() or platform.machine()}; median of {args.reps}, interleaved"
    )
    header = (
        f"{'case':26} {'attnkit auto':>13} {'F.sdpa':>10} {'ratio':>7} {'paired':>7} "
        f"{'overhead':>10}"
    )
    print(header)
    print("-" * len(header))
    results = {}
    for name, shape, causal in CASES:
        r = measure(shape, causal, args.reps)
        results[name] = r
        print(
            f"{name:26} {r['attnkit_ms']:10.3f} ms {r['sdpa_ms']:7.3f} ms "
            f"{r['ratio_of_medians']:6.3f}x {r['median_of_paired_ratios']:6.3f}x "
            f"{r['overhead_us']:7.1f} us"
        )
    if args.json:
        text = json.dumps(results, indent=2)  # replaced whole, never via a link
        files.write_text(args.json, text, argument="--json")


if __name__ == "__main__":
    main()
