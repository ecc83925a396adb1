"""Decode speed: tokens/s generating with the KV cache versus recomputing the prefix each step.

    python examples/decode_speed.py [--new-tokens 256] [--prompt 16] [--batch 1] [--repeats 3]

The model is the default small ``attnkit.models.GPT`` (``GPTConfig()``: GPT-2's vocabulary,
width 512, 8 layers, 8 heads, 51M parameters) with random weights, in eval mode. The no-cache
way runs the whole sequence at every step but, like the cached way, the LM head on the last
position only. Both ways generate the same
tokens greedily (checked); runs alternate between the two and the median of ``--repeats`` runs
is reported. ``--json PATH`` also writes the numbers. ``--compile BACKEND`` (``inductor``,
``aot_eager``, ...) adds a third way: the cached decode step compiled with ``torch.compile``
on a static-shape cache (``generate(compile=BACKEND)``; its first call, which compiles, is the
warm-up and is not timed).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from attnkit.models import GPT, GPTConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=16, help="prompt length in tokens")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--compile", default=None, metavar="BACKEND", help="also time generate(compile=BACKEND)"
    )
    args = parser.parse_args()
    for flag in ("new_tokens", "prompt", "batch", "repeats", "threads"):
        value = getattr(args, flag)
        if value is not None and value < 1:  # counts: 0 would divide by zero or time nothing
            parser.error(f"--{flag.replace('_', '-')} {value}: it must be at least 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    config = GPTConfig()
    model = GPT(config).eval()
    prompt = torch.randint(0, config.vocab_size, (args.batch, args.prompt))
    N = args.new_tokens
    ways: dict[str, dict[str, Any]] = {
        "KV cache": {},
        "no cache (recompute prefix)": {"use_cache": False},
    }
    if args.compile is not None:
        ways[f"KV cache, compiled ({args.compile})"] = {"compile": args.compile}
    for kwargs in ways.values():  # warm-up (and the compile) of every way, at the timed sizes
        model.generate(prompt, N if "compile" in kwargs else 4, **kwargs)

    seconds: dict[str, list[float]] = {label: [] for label in ways}
    outputs: dict[str, torch.Tensor] = {}
    for _ in range(args.repeats):
        for label, kwargs in ways.items():
            start = time.perf_counter()
            outputs[label] = model.generate(prompt, N, **kwargs)
            seconds[label].append(time.perf_counter() - start)
    first = outputs["KV cache"]
    same = all(torch.equal(first, out) for out in outputs.values())

    rows = []
    for label in ways:
        t = statistics.median(seconds[label])
        rows.append({"mode": label, "seconds": t, "tokens_per_s": args.batch * N / t})
    ratio = rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"]

    params = sum(p.numel() for p in model.parameters())
    print(
        f"attnkit decode speed: GPTConfig() ({params / 1e6:.1f}M params, dim={config.dim}, "
        f"layers={config.num_layers}, heads={config.num_heads}, vocab={config.vocab_size})"
    )
    print(
        f"batch {args.batch}, prompt {args.prompt} tokens, {N} new tokens, greedy; median of "
        f"{args.repeats}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{platform.machine()}"
    )
    print()
    print(f"| {'mode':<34} | {'seconds':>8} | {'tokens/s':>9} |")
    print(f"|{'-' * 36}|{'-' * 10}|{'-' * 11}|")
    for r in rows:
        print(f"| {r['mode']:<34} | {r['seconds']:>8.3f} | {r['tokens_per_s']:>9.1f} |")
    print()
    print(f"cache speed-up: {ratio:.1f}x; same tokens in every way: {same}")
    if args.compile is not None:
        compiled = rows[2]["tokens_per_s"] / rows[0]["tokens_per_s"]
        print(f"compiled static cache / eager cache: {compiled:.2f}x")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "config": config.__dict__,
                    "batch": args.batch,
                    "prompt": args.prompt,
                    "new_tokens": N,
                    "repeats": args.repeats,
                    "rows": rows,
                    "speedup": ratio,
                    "same_tokens": same,
                },
                indent=2,
            )
        )
    if not same:
        raise SystemExit("the cache (or compiling) changed the generated tokens")


if __name__ == "__main__":
    main()
