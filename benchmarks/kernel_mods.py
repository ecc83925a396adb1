"""The row-span kernel's score modifiers (logit soft-cap, ALiBi, holes in a key mask), timed
interleaved.

The modifier rows run in the kernel and on torch's tiles (their path without the kernel); with
``--base-source`` (a ``csrc/row_span.cpp`` without the modifiers, built as the module
``attnkit_row_span_v2``), the plain rows also run on that kernel and on this one (they must not
get slower). Median of ``--reps`` rounds, one call of each in turn, the order flipped every
round, after one untimed call of each. B=1, D=64, float32.

    python benchmarks/kernel_mods.py [--reps 5] [--base-source OLD/row_span.cpp]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch.utils.cpp_extension import load_inline

from attnkit import masks
from attnkit.backends import blocked
from attnkit.backends.blocked import rowspan, rowspan_builds
from attnkit.bench.machine import cpu_line

SCALE = 0.125
WINDOW = masks.causal() & masks.sliding_window(256)
HOLES = torch.rand(1, 4096, generator=torch.Generator().manual_seed(0)) > 0.1


def load_base(path: str) -> Any:
    """The kernel module built from an older source (the v2 interface: no modifiers)."""
    with open(path) as f:
        source = f.read()
    return load_inline(  # type: ignore[no-untyped-call]
        name="attnkit_row_span_v2",
        cpp_sources=[source],
        functions=["span_forward", "span_backward", "span_low_dtypes"],
        extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        no_implicit_headers=True,
        with_pytorch_error_handling=False,
    )


def row(name: str, calls: dict[str, Callable[[], object]], reps: int) -> None:
    """Print the median ms of each call and the first over the second."""
    for call in calls.values():
        call()
    times: dict[str, list[float]] = {k: [] for k in calls}
    names = list(calls)
    for r in range(reps):
        for k in names if r % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            calls[k]()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    a, b = names
    print(f"| {name} | {a} {med[a]:,.1f} | {b} {med[b]:,.1f} | {med[a] / med[b]:.3f} |", flush=True)


def plain_rows(base: Any, new: Any, reps: int) -> None:
    """The rows without modifiers, before and after (the same calls on both modules)."""
    rows = [
        ("causal 4k fwd", 8, 4096, masks.causal(), False),
        ("causal window 256, 16k fwd", 8, 16384, WINDOW, False),
        ("causal window 256, 16k bwd", 8, 16384, WINDOW, True),
        ("GQA 32/8, causal window 256, 8k bwd", 32, 8192, WINDOW, True),
    ]
    for name, H, L, spec, backward in rows:
        Hkv = 8
        q, k, v = torch.randn(1, H, L, 64), torch.randn(1, Hkv, L, 64), torch.randn(1, Hkv, L, 64)
        spans = masks.row_spans(spec, L, L)
        assert spans is not None
        lo, hi = spans
        plan = rowspan.SpanPlan(lo, hi, name, None)  # no soft-cap, ALiBi or holes
        out, lse = new.span_forward(q, k, v, plan, SCALE, 0.0)
        dout = torch.randn_like(out)
        if backward:
            before = partial(base.span_backward, q, k, v, out, dout, lse, lo, hi, SCALE)
            after = partial(new.span_backward, q, k, v, out, dout, lse, plan, SCALE, 0.0)
        else:
            before = partial(base.span_forward, q, k, v, lo, hi, SCALE)
            after = partial(new.span_forward, q, k, v, plan, SCALE, 0.0)
        row(name, {"before": before, "after": after}, reps)


def modifier_rows(reps: int) -> None:
    """Soft-capped and ALiBi rows: torch's tiles (their path without the kernel) against the
    kernel."""
    rows = [
        ("soft-cap 30, causal window 256, 16k", 16384, WINDOW, 30.0),
        ("ALiBi & causal, 4k", 4096, masks.alibi(8) & masks.causal(), None),
        ("ALiBi & causal window 256, 16k", 16384, masks.alibi(8) & WINDOW, None),
        ("causal 4k, key mask with 10% holes", 4096, masks.causal() & masks.key_mask(HOLES), None),
    ]
    for name, L, spec, cap in rows:
        q, k, v = (torch.randn(1, 8, L, 64) for _ in range(3))
        kernel = blocked.plan_blocks(q, k, v, spec, softcap=cap)
        assert kernel.spans.serves, kernel.spans.reason
        tiles = dataclasses.replace(
            kernel, spans=kernel.spans.refuse("timing the tiles"), kernel=None
        )
        fwd = partial(blocked.forward_with_lse, q, k, v, mask=spec, scale=SCALE)
        row(
            f"{name} fwd",
            {"tiles": partial(fwd, plan=tiles), "kernel": partial(fwd, plan=kernel)},
            reps,
        )
        out, lse = fwd(plan=kernel)
        dout = torch.randn_like(out)
        bwd = partial(blocked.backward_from_lse, q, k, v, out, dout, lse, mask=spec, scale=SCALE)
        row(
            f"{name} bwd",
            {"tiles": partial(bwd, plan=tiles), "kernel": partial(bwd, plan=kernel)},
            reps,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--base-source", help="a csrc/row_span.cpp without the modifiers")
    args = ap.parse_args()
    if not rowspan_builds.available():
        raise SystemExit(f"the row-span kernel does not run here: {rowspan_builds.status()}")
    torch.manual_seed(0)
    print(cpu_line())  # the CPU and its flags: every figure below depends on them
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median ms of {args.reps}")
    print("| row | first | second | first / second |\n|---|---|---|---|")
    if args.base_source:
        plain_rows(load_base(args.base_source), rowspan_builds.kernel(), args.reps)
    modifier_rows(args.reps)


if __name__ == "__main__":
    main()
