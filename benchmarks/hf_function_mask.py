"""A transformers rule attnkit cannot prove, as a mask function, against transformers' dense
mask on sdpa: one attention layer's worth, side by side in one run.

The rule is Gemma 3's sliding layers over an image longer than the window:
``and_masks(or_masks(causal, blockwise_overlay(ids)), sliding_window_overlay(w))``, one image of
``--image`` tokens (300) from position 1000, window ``--window`` (256), batch 1, evaluated as
``create_causal_mask`` evaluates it (``use_vmap=True``). attnkit's side: the mask interface
(``hf_mask``: a lazy mask whose spec is ``from_function`` over that function), its ``first
layer`` (the function evaluated on every pair to find each row's run of keys, once per
forward) and a ``further layer`` (the runs cached: the row-span kernel alone). transformers'
side: ``sdpa_mask`` building the dense ``(1, 1, L, L)`` bool mask (once per forward) and
``scaled_dot_product_attention`` on it (every layer). Medians of ``--reps`` interleaved runs;
forward only, float32.

    python benchmarks/hf_function_mask.py [--L 4096] [--heads 8] [--dim 64] [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
import transformers.masking_utils as mu

import attnkit
import attnkit.interop.hf_attention as hfa
from attnkit.bench.machine import cpu_line
from attnkit.interop import register_hf
from attnkit.interop.hf_lazy_mask import spec_of


def _rule(a: argparse.Namespace) -> Callable[..., torch.Tensor]:
    """A new closure per forward, as Gemma 3 builds it (nothing cached across forwards)."""
    ids = torch.full((1, a.L), -1)
    ids[0, 1000 : 1000 + a.image] = 0
    blocks = mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(ids))
    return mu.and_masks(blocks, mu.sliding_window_overlay(a.window))  # type: ignore[no-any-return]


def _timed(fn: Callable[[], object]) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def one_forward(
    a: argparse.Namespace, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> dict[str, float]:
    """Each side's times for one forward's mask and layers, and attnkit's gap to sdpa."""
    rule = _rule(a)
    L = a.L
    t_mask, lazy = _timed(lambda: hfa.hf_mask(1, L, L, 0, 0, mask_function=rule, use_vmap=True))
    spec = spec_of(lazy)
    t_first, _ = _timed(lambda: attnkit.attention(q, k, v, mask=spec))
    t_layer, out = _timed(lambda: attnkit.attention(q, k, v, mask=spec))
    assert not lazy.made  # type: ignore[attr-defined]
    dense_args = {"batch_size": 1, "q_length": L, "kv_length": L, "mask_function": rule}
    t_dense, dense = _timed(
        lambda: mu.sdpa_mask(**dense_args, allow_is_causal_skip=False, use_vmap=True)
    )
    t_sdpa, want = _timed(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense))
    gap = float((out - want).abs().max())  # type: ignore[operator]
    return {
        "mask": t_mask, "first": t_first, "layer": t_layer, "dense": t_dense, "sdpa": t_sdpa,
        "gap": gap,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--L", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--image", type=int, default=300)
    parser.add_argument("--reps", type=int, default=3)
    a = parser.parse_args()
    register_hf()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, a.heads, a.L, a.dim, generator=g) for _ in range(3))
    one_forward(a, q, k, v)  # warm-up: kernels loaded
    runs = [one_forward(a, q, k, v) for _ in range(a.reps)]
    med = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    spec = spec_of(hfa.hf_mask(1, a.L, a.L, 0, 0, mask_function=_rule(a), use_vmap=True))
    line = [x for x in str(attnkit.explain(q, k, v, mask=spec)).splitlines() if "blocked:" in x]
    print(f"L = S = {a.L}, H = {a.heads}, D = {a.dim}, window {a.window}, image {a.image}, "
          f"{torch.get_num_threads()} threads, medians of {a.reps} (s)")  # fmt: skip
    print(cpu_line())  # the CPU and its flags: every figure below depends on them
    print("| | attnkit (function mask) | transformers (dense mask, sdpa) |")
    print("|---|---|---|")
    print(f"| mask, once per forward | {med['mask']:.3f} | {med['dense']:.3f} |")
    print(f"| first layer | {med['first']:.3f} | {med['sdpa']:.3f} |")
    print(f"| each further layer | {med['layer']:.3f} | {med['sdpa']:.3f} |")
    print(f"max |attnkit - sdpa| = {med['gap']:.1e}")
    print(line[0].strip() if line else "")


if __name__ == "__main__":
    main()
