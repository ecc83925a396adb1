"""Window models of types no list names, in Hugging Face transformers: ``attn_implementation=
"attnkit"`` against ``"sdpa"``, same weights, forward at L=8192, one run.

    python benchmarks/hf_lazy_speed.py [--reps 3] [--length 8192] [--quick] [--json out.json]

Three tiny random models, nothing downloaded, all with hidden 128, 4 query and 2 key/value
heads of 32, intermediate 256, vocabulary 256, float32, window 256 (tiny, so that attention is
most of the time: with ``benchmarks/hf_speed.py``'s MLP of 1792 the model without attention
already bounds the forward at 3.9x, whatever the attention):

* **Qwen3-like**: ``Qwen3Config``, 2 layers, every layer windowed (``use_sliding_window``);
* **Gemma-3-like**: ``Gemma3TextConfig``, 6 layers, 5 window layers to 1 full;
* **Mistral-like**: ``MistralConfig``, 2 layers (the reference: it had a spec before).

Each is timed interleaved (one call of each implementation in turn, the order flipped every
round, median of ``--reps`` rounds after one untimed call of each), ``model(input_ids)`` under
``torch.no_grad()``, B=1. The untimed calls check the logits agree and that every attention
layer of attnkit's model got a spec (no L x S mask tensor). Targets (issue 35): Qwen3-like
>= 5x, Gemma-3-like >= 2.5x. The CPU's flags and thread count are printed with the table.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

import attnkit.interop
import attnkit.interop.hf_attention as hfa
from attnkit.bench.machine import cpu_line
from attnkit.masks import MaskSpec

WINDOW = 256
COMMON = {
    "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "max_position_embeddings": 32768,
}  # fmt: skip
TARGETS = {"Qwen3-like": 5.0, "Gemma-3-like": 2.5}


def configs() -> dict[str, Callable[[], Any]]:
    """The three models' configs (built when called)."""
    return {
        "Qwen3-like": lambda: transformers.Qwen3Config(
            **COMMON, num_hidden_layers=2, use_sliding_window=True, sliding_window=WINDOW,
            max_window_layers=0,
        ),
        "Gemma-3-like": lambda: transformers.Gemma3TextConfig(
            **COMMON, num_hidden_layers=6, sliding_window=WINDOW,
            layer_types=["sliding_attention"] * 5 + ["full_attention"],
        ),
        "Mistral-like": lambda: transformers.MistralConfig(
            **COMMON, num_hidden_layers=2, sliding_window=WINDOW
        ),
    }  # fmt: skip


def build(config: Any) -> dict[str, Any]:
    """sdpa's and attnkit's models, with the same random weights, in eval mode."""
    models = {}
    for impl in ("sdpa", "attnkit"):
        torch.manual_seed(0)
        auto = transformers.AutoModelForCausalLM
        models[impl] = auto.from_config(copy.deepcopy(config), attn_implementation=impl).eval()
    models["attnkit"].load_state_dict(models["sdpa"].state_dict())
    return models


def masks_seen(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, list[str]]:
    """One untimed forward of attnkit's model: its logits and what each layer's mask was."""
    seen: list[str] = []
    real, real_direct = hfa.attention, hfa.memo.run_direct

    def recording(*args: Any, **kwargs: Any) -> Any:
        mask = kwargs["mask"]
        seen.append("spec" if isinstance(mask, MaskSpec) or mask is None else "L x S tensor")
        return real(*args, **kwargs)

    def recording_direct(q: Any, k: Any, v: Any, mask: Any, *rest: Any) -> Any:
        out, key = real_direct(q, k, v, mask, *rest)
        if out is not None:
            seen.append("spec")
        return out, key

    hfa.attention, hfa.memo.run_direct = recording, recording_direct  # type: ignore[assignment]
    try:
        with torch.no_grad():
            logits = model(ids).logits
    finally:
        hfa.attention, hfa.memo.run_direct = real, real_direct  # type: ignore[assignment]
    return logits, seen


def timed(model: Any, ids: torch.Tensor) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        model(ids)
    return time.perf_counter() - start


def measure(name: str, length: int, reps: int) -> dict[str, Any]:
    models = build(configs()[name]())
    ids = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(0))
    got, seen = masks_seen(models["attnkit"], ids)
    with torch.no_grad():
        want = models["sdpa"](ids).logits
    err = float((got - want).abs().max())
    times: dict[str, list[float]] = {"sdpa": [], "attnkit": []}
    order = ["sdpa", "attnkit"]
    for _ in range(reps):
        for impl in order:
            times[impl].append(timed(models[impl], ids))
        order.reverse()
    sdpa, ours = (statistics.median(times[i]) for i in ("sdpa", "attnkit"))
    return {
        "model": name, "length": length, "sdpa_s": sdpa, "attnkit_s": ours,
        "speedup": sdpa / ours, "target": TARGETS.get(name), "max_logit_diff": err,
        "layers": len(seen), "spec_layers": seen.count("spec"),
    }  # fmt: skip


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | L | sdpa (s) | attnkit (s) | sdpa / attnkit | target | layers with a spec "
        "| max logit diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        target = f">= {r['target']}x" if r["target"] else "(reference)"
        verdict = "" if not r["target"] else (" ok" if r["speedup"] >= r["target"] else " MISS")
        lines.append(
            f"| {r['model']} | {r['length']} | {r['sdpa_s']:.3f} | {r['attnkit_s']:.3f} | "
            f"{r['speedup']:.2f}x | {target}{verdict} | {r['spec_layers']}/{r['layers']} | "
            f"{r['max_logit_diff']:.1e} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--quick", action="store_true", help="L=1024, 1 round: a smoke test")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    length, reps = (1024, 1) if args.quick else (args.length, args.reps)
    attnkit.interop.register_hf()
    rows = [measure(name, length, reps) for name in configs()]
    print(table(rows))
    print(f"\n{cpu_line()}; torch threads: {torch.get_num_threads()}; "
          f"torch {torch.__version__}, transformers {transformers.__version__}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
