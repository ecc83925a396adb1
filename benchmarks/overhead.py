"""What validation and dispatch cost: attnkit.attention(backend="auto") against torch's SDPA.

Both run side by side in one process, interleaved (A, B, A, B, ...) so that the noise of this
shared machine hits both alike; each figure is the median of REPS timed runs after warm-up.
The acceptance bar: auto on (1, 8, 4096, 64) float32 costs at most 1.05x SDPA.

The decode rows are one decode step (one query against 64 cached keys, grouped-query heads):
``attnkit.attention(q, k, v, causal=True)`` against ``F.scaled_dot_product_attention(q, k, v,
enable_gqa=True)`` (bar: at most SDPA + 5 us), and one layer's call through
``attn_implementation="attnkit"`` (:func:`attnkit.interop.hf_attention`) against transformers'
``sdpa_attention_forward``, on the exact arguments a tiny random Llama's layer passes in a
decode step (bar: at most sdpa + 10 us); ``B=2`` has the first row left-padded by 5 (attnkit
gets a mask spec, sdpa transformers' dense mask).

    python benchmarks/overhead.py [--reps 11] [--json out.json] [--decode-only]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from hf_layer_call import HF_CASES, measure_hf

import attnkit
from attnkit import files
from attnkit.bench.machine import cpu_line

CASES = [
    # name, (B, H, L, Dk), causal
    ("dense (1, 8, 4096, 64)", (1, 8, 4096, 64), False),
    ("causal (1, 8, 4096, 64)", (1, 8, 4096, 64), True),
    ("dense (1, 8, 256, 64)", (1, 8, 256, 64), False),
    ("dense (1, 8, 16, 64)", (1, 8, 16, 64), False),
]

#: name, (B, H, Hkv, S, D): one decode step (L = 1), causal, float32
DECODE_CASES = [
    ("decode GQA 32/8 D=128 S=64", (1, 32, 8, 64, 128)),
    ("decode GQA 32/8 D=64 S=64", (1, 32, 8, 64, 64)),
    ("decode GQA 9/3 D=64 S=64", (1, 9, 3, 64, 64)),
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

    return compare(ours, theirs, reps)


def measure_decode(sizes: tuple[int, int, int, int, int], reps: int) -> dict[str, float]:
    """One decode step: attnkit.attention(causal=True) against SDPA with enable_gqa."""
    B, H, Hkv, S, D = sizes
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, 1, D, generator=g)
    k, v = (torch.randn(B, Hkv, S, D, generator=g) for _ in range(2))

    def ours() -> torch.Tensor:
        return attnkit.attention(q, k, v, causal=True)

    def theirs() -> torch.Tensor:  # one query at the end sees every key: no mask
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    return compare(ours, theirs, reps)


def compare(
    ours: Callable[[], torch.Tensor], theirs: Callable[[], torch.Tensor], reps: int
) -> dict[str, float]:
    """Interleaved medians of ``ours`` and ``theirs`` (after checking they agree)."""
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
    parser.add_argument(
        "--decode-only", action="store_true", help="only the decode-step and HF layer rows"
    )
    args = parser.parse_args()
    print(cpu_line())  # the CPU and its flags: every figure below depends on them
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{platform.processor() or platform.machine()}; median of {args.reps}, interleaved"
    )
    header = (
        f"{'case':34} {'attnkit auto':>13} {'F.sdpa':>10} {'ratio':>7} {'paired':>7} "
        f"{'overhead':>10}"
    )
    print(header)
    print("-" * len(header))
    results = {}
    rows: list[tuple[str, Callable[[], dict[str, float]]]] = []
    if not args.decode_only:
        rows += [(n, functools.partial(measure, shape, c, args.reps)) for n, shape, c in CASES]
    rows += [(n, functools.partial(measure_decode, sz, args.reps)) for n, sz in DECODE_CASES]
    if importlib.util.find_spec("transformers") is not None:
        rows += [(n, functools.partial(measure_hf, c, compare, args.reps)) for n, c in HF_CASES]
    else:
        print("(HF layer rows skipped: transformers is not installed; pip install 'attnkit[hf]')")
    for name, run in rows:
        r = run()
        results[name] = r
        print(
            f"{name:34} {r['attnkit_ms']:10.3f} ms {r['sdpa_ms']:7.3f} ms "
            f"{r['ratio_of_medians']:6.3f}x {r['median_of_paired_ratios']:6.3f}x "
            f"{r['overhead_us']:7.1f} us"
        )
    if args.json:
        text = json.dumps(results, indent=2)  # replaced whole, never via a link
        files.write_text(args.json, text, argument="--json")


if __name__ == "__main__":
    main()
