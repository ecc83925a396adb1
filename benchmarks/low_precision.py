"""bfloat16 against float32 on the CPU: what the path of :mod:`attnkit.cpu` gains.

For each row, every variant runs on the same values, interleaved (A, B, C, A, B, C, ...) so that
the noise of a shared machine hits them alike; each figure is the median of ``--reps`` timed
runs after one warm-up, and each ratio the median of the per-repetition ratios to the row's
baseline (``x`` > 1: faster than the baseline). Variants:

* ``attnkit fp32``: ``attnkit.attention`` on float32 copies (the baseline of the bf16 rows);
* ``attnkit bf16``: ``attnkit.attention`` on the bfloat16 tensors, on the path this CPU
  takes (``auto``, or what ``ATTNKIT_CPU_PATH`` forces);
* ``attnkit bf16 [torch path]``: the same with ``ATTNKIT_CPU_PATH=torch`` (the tensors go to
  torch's kernels as they are, no CPU path of attnkit's own), with ``--torch-path``;
* ``SDPA bf16``: ``F.scaled_dot_product_attention(..., is_causal=True)`` on bfloat16.

``fwd`` times the forward without autograd; ``fwd+bwd`` the forward and ``out.backward(dout)``.

    python benchmarks/low_precision.py [--reps 5] [--torch-path] [--rows window,documents,causal]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import attnkit
from attnkit import cpu, masks
from attnkit.masks import MaskSpec

B, H, D = 1, 8, 64


def _documents(L: int) -> MaskSpec:
    """Causal documents of uneven lengths (a tenth, a half, the rest, ... of L)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.zeros(L, dtype=torch.long)
    cuts = torch.randint(1, L, (7,), generator=g).sort().values
    for c in cuts.tolist():
        ids[c:] += 1
    return masks.document(ids) & masks.causal()


ROWS: dict[str, tuple[str, int, MaskSpec | None]] = {
    # name: (label, L, mask; None = causal=True without a spec)
    "window": ("causal window 256, L=16384", 16384, masks.causal() & masks.sliding_window(256)),
    "documents": ("causal documents (8, uneven), L=8192", 8192, _documents(8192)),
    "causal": ("causal, L=4096", 4096, None),
}


def _variants(
    L: int, spec: MaskSpec | None, backward: bool, torch_path: bool
) -> dict[str, Callable[[], None]]:
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(B, H, L, D, generator=g) for _ in range(3)]
    dout = torch.randn(B, H, L, D, generator=g)

    def make(
        dtype: torch.dtype, fn: Callable[..., torch.Tensor], env: str | None
    ) -> Callable[[], None]:
        q, k, v = (t.to(dtype).requires_grad_(backward) for t in base)
        do = dout.to(dtype)

        def run() -> None:
            old = os.environ.get(cpu.ENV)
            if env is not None:
                os.environ[cpu.ENV] = env
            try:
                if backward:
                    fn(q, k, v).backward(do)
                else:
                    with torch.no_grad():
                        fn(q, k, v)
            finally:
                if env is not None:
                    if old is None:
                        del os.environ[cpu.ENV]
                    else:
                        os.environ[cpu.ENV] = old

        return run

    def ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attnkit.attention(q, k, v, mask=spec, causal=spec is None)

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    out = {
        "attnkit fp32": make(torch.float32, ours, None),
        "attnkit bf16": make(torch.bfloat16, ours, None),
    }
    if torch_path:
        out["attnkit bf16 [torch path]"] = make(torch.bfloat16, ours, "torch")
    if spec is None:
        out["SDPA bf16"] = make(torch.bfloat16, sdpa, None)
    return out


def _time(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(variants: dict[str, Callable[[], None]], reps: int) -> dict[str, list[float]]:
    for fn in variants.values():  # warm-up (plans, kernel build, first-touch)
        fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(reps):
        for name, fn in variants.items():
            times[name].append(_time(fn))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--torch-path", action="store_true")
    args = parser.parse_args()

    f = cpu.features()
    q = torch.zeros(1, 1, 1, 8, dtype=torch.bfloat16)
    print(f"CPU: {f}")  # the features name the architecture and its flags
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"bf16 path: {cpu.describe(cpu.path_for(q, 'benchmark'), torch.bfloat16)}")
    print(f"B={B}, H={H}, D={D}; median of {args.reps}, interleaved\n")
    header = (
        f"{'row':<40} {'pass':<8} {'variant':<27} {'median ms':>10} {'vs fp32':>8} "
        f"{'vs SDPA bf16':>13}"
    )
    print(header)
    print("-" * len(header))
    for key in args.rows.split(","):
        label, L, spec = ROWS[key]
        for backward in (False, True):
            times = measure(_variants(L, spec, backward, args.torch_path), args.reps)
            for name, ts in times.items():
                ratios = []
                for base in ("attnkit fp32", "SDPA bf16"):
                    if base in times and base != name:
                        r = statistics.median(b / t for b, t in zip(times[base], ts, strict=True))
                        ratios.append(f"{r:.2f}x")
                    else:
                        ratios.append("")
                print(
                    f"{label:<40} {'fwd+bwd' if backward else 'fwd':<8} {name:<27} "
                    f"{statistics.median(ts) * 1e3:>10.1f} {ratios[0]:>8} {ratios[1]:>13}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
