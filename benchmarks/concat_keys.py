"""T5Gemma 2's merged decoder attention (its own keys and the encoder's in one call) with the
masks concatenated over the keys: attnkit on the ``concat_keys`` spec against the dense
``L x (S1 + S2)`` mask, side by side in one run.

One decoder layer's worth, as transformers calls it with ``attn_implementation="attnkit"``:
attnkit's mask interface (``hf_mask``) makes the decoder's mask over its ``S1 = L`` keys
(causal with a window of ``--window`` for a sliding layer, plain causal for a full one) and the
cross-attention mask over the encoder's ``--encoder`` keys (bidirectional, the last quarter of
them padding), and the model's ``torch.cat`` joins them along the keys. Sides:

- ``attnkit, concat_keys spec``: the lazy masks' ``torch.cat`` is a lazy mask of
  ``concat_keys(...)`` (this change); attention runs on the spec (``backend="auto"``);
- ``attnkit, dense mask (before)``: what attnkit got before: the dense concatenation,
  ``(1, 1, L, S1 + S2)`` bool, made from the lazy masks, and attention on it;
- ``sdpa, dense mask``: transformers' ``sdpa`` path: the dense concatenation and
  ``F.scaled_dot_product_attention`` on it (``enable_gqa=True``).

``mask`` is making the mask (once per forward), ``first layer`` the first layer's call on a
new mask (attnkit plans its blocks there), ``further layer`` a later layer's call on the same
mask (plans reused); medians of ``--reps`` interleaved runs (A, B, C, A, B, C ...), forward
only, float32.

    python benchmarks/concat_keys.py [--L 8192] [--encoder 2048] [--window 512] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
import transformers.masking_utils as mu

import attnkit
import attnkit.interop.hf_attention as hfa
from attnkit import files
from attnkit.bench.machine import cpu_line
from attnkit.interop import register_hf
from attnkit.interop.hf_lazy_mask import spec_of

Side = Callable[[], tuple[float, float, float, torch.Tensor]]


def _masks(a: argparse.Namespace, window: int | None) -> torch.Tensor:
    """The decoder's mask and the cross-attention mask from attnkit's mask interface, joined
    by ``torch.cat`` as T5Gemma 2's decoder joins them."""
    L, S2 = a.L, a.encoder
    rule = mu.causal_mask_function
    if window is not None:
        rule = mu.sliding_window_causal_mask_function(window)
    real = torch.ones(1, L, dtype=torch.bool)
    mine = hfa.hf_mask(1, L, L, 0, 0, rule, real)
    enc = torch.arange(S2)[None] < S2 - S2 // 4  # the last quarter padding
    cross = hfa.hf_mask(1, L, S2, 0, 0, mu.bidirectional_mask_function, enc)
    return torch.cat([mine, cross], dim=-1)


def _sides(a: argparse.Namespace, window: int | None, qkv: list[torch.Tensor]) -> dict[str, Side]:
    q, k, v = qkv

    def timed(make: Callable[[], object], run: Callable[[object], torch.Tensor]) -> Side:
        def side() -> tuple[float, float, float, torch.Tensor]:
            t0 = time.perf_counter()
            mask = make()
            t1 = time.perf_counter()
            run(mask)
            t2 = time.perf_counter()
            out = run(mask)
            return t1 - t0, t2 - t1, time.perf_counter() - t2, out

        return side

    def attend(mask: object) -> torch.Tensor:
        return attnkit.attention(q, k, v, mask=mask)  # type: ignore[arg-type]

    def sdpa(mask: object) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # type: ignore[arg-type]

    return {
        "attnkit, concat_keys spec": timed(lambda: spec_of(_masks(a, window)), attend),
        "attnkit, dense mask (before)": timed(lambda: _masks(a, window).dense(), attend),
        "sdpa, dense mask": timed(lambda: _masks(a, window).dense(), sdpa),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--L", type=int, default=8192)
    p.add_argument("--encoder", type=int, default=2048)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", help="write the medians here")
    a = p.parse_args()
    register_hf()
    g = torch.Generator().manual_seed(0)
    S = a.L + a.encoder
    q = torch.randn(1, a.heads, a.L, a.dim, generator=g)
    k, v = (torch.randn(1, a.kv_heads, S, a.dim, generator=g) for _ in range(2))
    print(f"L = S1 = {a.L}, S2 = {a.encoder} (a quarter padding), H = {a.heads}, "
          f"Hkv = {a.kv_heads}, D = {a.dim}, float32, forward")  # fmt: skip
    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}; {cpu_line()}")
    print(f"medians of {a.reps} interleaved reps (s); the dense mask is "
          f"{a.L * S / 2**20:.0f} MiB of bools\n")  # fmt: skip
    print("| layer | side | mask | first layer | further layer | further: sdpa / side | "
          "max abs diff vs sdpa |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    results: dict[str, dict[str, list[float]]] = {}
    for layer, window in (("sliding", a.window), ("full", None)):
        sides = _sides(a, window, [q, k, v])
        outs = {n: f()[3] for n, f in sides.items()}  # warm-up: kernels, threads
        times: dict[str, list[tuple[float, float, float]]] = {n: [] for n in sides}
        for _ in range(a.reps):
            for n, f in sides.items():
                times[n].append(f()[:3])
        ref = statistics.median(t[2] for t in times["sdpa, dense mask"])
        results[layer] = {}
        for n in sides:
            med = [statistics.median(t[i] for t in times[n]) for i in range(3)]
            diff = float((outs[n] - outs["sdpa, dense mask"]).abs().max())
            results[layer][n] = med
            print(f"| {layer} ({window or 'no'} window) | {n} | {med[0]:.3f} | {med[1]:.3f} | "
                  f"{med[2]:.3f} | {ref / med[2]:.2f}x | {diff:.1e} |")  # fmt: skip
    if a.json:  # through attnkit.files: a link planted at the path is replaced, not followed
        text = json.dumps({"args": vars(a), "medians_mask_first_further_s": results}, indent=1)
        files.write_text(a.json, text + "\n", argument="--json")


if __name__ == "__main__":
    main()
