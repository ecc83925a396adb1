"""attnkit's decode kernel against torch's SDPA on decode steps, with the K/V read rate.

Each row times ``attnkit.attention`` (auto; the script checks that the decode kernel runs it)
and its SDPA peer, interleaved (A, B, A, B, ...) so that the noise of a shared machine hits both
alike; each figure is the median of ``--reps`` timed runs (each the mean of ``--inner`` calls)
after a warm-up. ``K/V GB/s`` is the bytes of the keys and values the call may see (what the
kernel reads) over its time; ``read GB/s`` on the first line is this machine's read bandwidth
as ``torch.sum`` of a 512 MiB float32 tensor sees it (same threads), for scale.

Rows: ``step`` (B=1, GQA 32/8 heads, D=128, S=4096, L=1, against SDPA with ``enable_gqa``),
``ragged`` (8 sequences of lengths up to 2048, as a ``sequence_causal`` spec, against SDPA with
the dense ``(B, 1, 1, S)`` mask it needs), ``window`` (a causal 4096 window over a 16384 cache,
against SDPA on the window sliced by hand), and ``min_s`` (small caches, where the rule of
:func:`attnkit.backends.blocked.decode.shaped` comes from: the kernel against what ``auto``
would run instead, SDPA through attnkit with the end-aligned mask and the non-finite check of
an eager CPU call).

    python benchmarks/decode_kernel.py [--reps 15] [--inner 5] [--threads N] [--rows step,...]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import attnkit
from attnkit import masks
from attnkit.bench.machine import cpu_line

Fn = Callable[[], object]


def _time(fns: dict[str, Fn], reps: int, inner: int) -> dict[str, float]:
    for f in fns.values():
        f()
    times: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(reps):
        for n, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                f()
            times[n].append((time.perf_counter() - t0) / inner)
    return {n: statistics.median(t) for n, t in times.items()}


def _check_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: object) -> None:
    note = attnkit.explain(q, k, v, **kw).notes["blocked"]
    if "decode kernel, forward only" not in note:
        raise SystemExit(f"the decode kernel does not run this row: {note}")


def _row(name: str, med: dict[str, float], kv_bytes: float) -> None:
    a, b = med["attnkit"], med["sdpa"]
    print(
        f"{name:<34} attnkit {a * 1e3:8.3f} ms  sdpa {b * 1e3:8.3f} ms  "
        f"{b / a:5.2f}x SDPA  K/V {kv_bytes / a / 1e9:5.1f} GB/s (sdpa {kv_bytes / b / 1e9:4.1f})"
    )


def _qkv(B: int, S: int, L: int = 1, H: int = 32, Hkv: int = 8, D: int = 128) -> tuple:
    return torch.randn(B, H, L, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)


def step(reps: int, inner: int) -> None:
    q, k, v = _qkv(1, 4096)
    _check_decode(q, k, v)
    med = _time(
        {
            "attnkit": lambda: attnkit.attention(q, k, v),
            "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        },
        reps,
        inner,
    )
    _row("step B=1 32/8 D=128 S=4096 L=1", med, 2 * k.numel() * 4)


def ragged(reps: int, inner: int) -> None:
    lengths = torch.tensor([2048, 1536, 1024, 1800, 512, 256, 1200, 64])
    B, S = 8, 2048
    q, k, v = _qkv(B, S)
    spec = masks.sequence_causal(lengths, 1)
    _check_decode(q, k, v, mask=spec)
    dense = (torch.arange(S)[None] < lengths[:, None]).view(B, 1, 1, S)
    med = _time(
        {
            "attnkit": lambda: attnkit.attention(q, k, v, mask=spec),
            "sdpa": lambda: F.scaled_dot_product_attention(
                q, k, v, attn_mask=dense, enable_gqa=True
            ),
        },
        reps,
        inner,
    )
    _row("ragged 8 seqs <= 2048 (dense mask)", med, 2 * 8 * 128 * 4 * float(lengths.sum()))


def window(reps: int, inner: int) -> None:
    S, w = 16384, 4096
    q, k, v = _qkv(1, S)
    spec = masks.causal() & masks.sliding_window(w)
    _check_decode(q, k, v, mask=spec)
    ks, vs = k[:, :, -w:], v[:, :, -w:]
    med = _time(
        {
            "attnkit": lambda: attnkit.attention(q, k, v, mask=spec),
            "sdpa": lambda: F.scaled_dot_product_attention(q, ks, vs, enable_gqa=True),
        },
        reps,
        inner,
    )
    _row("window 4096 of 16384 (sliced)", med, 2 * ks.numel() * 4)


def _min_s_row(L: int, S: int, reps: int, inner: int) -> None:
    q, k, v = _qkv(1, S, L)
    med = _time(
        {
            "attnkit": lambda: attnkit.attention(q, k, v, causal=True, backend="blocked"),
            "sdpa": lambda: attnkit.attention(q, k, v, causal=True, backend="sdpa"),
        },
        reps,
        inner * 4,
    )
    _row(f"min_s L={L} S={S} causal", med, 2 * k.numel() * 4)


def min_s(reps: int, inner: int) -> None:
    for L in (1, 2, 4, 8, 16):
        for S in (16, 64, 256, 1024):
            if S >= L:
                _min_s_row(L, S, reps, inner)


ROWS = {"step": step, "ragged": ragged, "window": window, "min_s": min_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--inner", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rows", default=",".join(ROWS))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    big = torch.randn(128 * 1024 * 1024)
    big.sum()
    t = _time({"sum": big.sum}, 5, 2)["sum"]
    print(cpu_line())  # the CPU and its flags: every figure below depends on them
    print(
        f"threads {torch.get_num_threads()}, read GB/s (torch.sum of 512 MiB) "
        f"{big.numel() * 4 / t / 1e9:.1f}"
    )
    del big
    for name in args.rows.split(","):
        ROWS[name](args.reps, args.inner)


if __name__ == "__main__":
    main()
