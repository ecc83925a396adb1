"""DeepSeek-V3.2's sparse attention (DSA): attnkit's gather kernel for
:func:`attnkit.masks.selected_keys` against torch's SDPA with the scattered dense bool mask
(what transformers builds for ``sdpa``), forward, side by side in one run.

Every query selects its top-k keys by random scores (no locality between queries), causal
(the top-k of the keys it may see, as DSA's indexer chooses them); attnkit runs
``causal() & selected_keys(indices)``; SDPA gets the indices scattered into an ``(B, 1, L, S)``
bool mask. Each figure is the median of ``--reps`` timed runs after a warm-up, interleaved
(A, B, A, B) so that a shared machine's noise hits both alike. ``peak MiB`` is the growth of the
process's peak resident memory over each side's first call (ru_maxrss; attnkit runs first), the
dense mask's own size beside it. The outputs are compared (max abs difference).

``--backward`` adds attnkit's backward time, the C++ backward in slices of query rows per
key/value head (the default) beside the same kernel parallel over batch rows and key/value heads
only, and its gradients against SDPA's at L = S = 1024 (where SDPA's backward through the dense
mask is quick). ``--kv-heads 1`` (or 2) is the case the slices are for: fewer key/value heads
than threads.

    python benchmarks/selected_keys.py [--L 8192] [--k 256] [--heads 16] [--dim 128] [--reps 3]
                                      [--kv-heads 16] [--backward] [--dtype bfloat16]

``--dtype bfloat16`` (or ``float16``): q, k, v in that dtype on both sides (attnkit's C++ kernel
reads them in place, float32 inside; SDPA in the dtype); the decode rows too (``--decode``).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import attnkit
from attnkit import masks
from attnkit.backends.blocked import gather_native
from attnkit.bench.machine import cpu_line


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _indices(B: int, L: int, S: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Each query's top-k keys by random scores among the keys causal lets it see (-1 where
    it sees fewer than k), ``(B, L, k)`` int64; chosen in slices of rows (no L x S)."""
    out = torch.empty(B, L, k, dtype=torch.long)
    rows = torch.arange(L).view(L, 1) + (S - L)
    for r0 in range(0, L, 512):
        r1 = min(L, r0 + 512)
        scores = torch.rand(B, r1 - r0, S, generator=gen)
        scores.masked_fill_(torch.arange(S).view(1, 1, S) > rows[r0:r1].view(1, -1, 1), -1.0)
        top, idx = scores.topk(k, dim=-1)
        out[:, r0:r1] = torch.where(top >= 0, idx, -1)
    return out


def _dense(indices: torch.Tensor, S: int) -> torch.Tensor:
    """The indices scattered into a bool mask ``(B, 1, L, S)``, as eager does."""
    B, L, _k = indices.shape
    m = torch.zeros(B, L, S + 1, dtype=torch.bool)
    m.scatter_(-1, torch.where(indices < 0, S, indices), True)
    return m[..., :S].unsqueeze(1)


def _time(fns: dict[str, Callable[[], torch.Tensor]], reps: int) -> dict[str, float]:
    times: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(reps):
        for n, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[n].append(time.perf_counter() - t0)
    return {n: statistics.median(t) for n, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--L", type=int, default=8192)
    ap.add_argument("--k", type=int, default=256)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    ap.add_argument("--decode", action="store_true", help="decode steps only (see _decode)")
    ap.add_argument("--cache", type=int, default=32768, help="--decode: the cached keys S")
    args = ap.parse_args()
    if args.decode:
        dtype = getattr(torch, args.dtype)
        _decode(args.cache, args.heads, args.kv_heads, args.dim, 2048, max(args.reps, 21), dtype)
        return
    B, L, H, Hkv, D, k = 1, args.L, args.heads, args.kv_heads, args.dim, args.k
    S = L
    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    q = torch.randn(B, H, L, D, generator=gen).to(dtype)
    kk = torch.randn(B, Hkv, S, D, generator=gen).to(dtype)
    v = torch.randn(B, Hkv, S, D, generator=gen).to(dtype)
    ind = _indices(B, L, S, k, gen)
    spec = masks.causal() & masks.selected_keys(ind)
    plan = attnkit.explain(q, kk, v, mask=spec)
    assert "gather kernel" in str(plan), plan

    def ours() -> torch.Tensor:
        return attnkit.attention(q, kk, v, mask=spec)

    def sdpa() -> torch.Tensor:  # transformers' sdpa path: the scattered mask, every call
        mask = _dense(ind, S)
        return F.scaled_dot_product_attention(q, kk, v, attn_mask=mask, enable_gqa=Hkv != H)

    base = _peak_mib()
    a = ours()
    ours_peak = _peak_mib() - base
    base = _peak_mib()
    b = sdpa()
    sdpa_peak = _peak_mib() - base
    err = (a - b).abs().max().item()
    t = _time({"attnkit": ours, "sdpa": sdpa}, args.reps)
    mask_mib = B * L * S / 2**20
    print(f"{cpu_line()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    shape = f"B={B} H={H} Hkv={Hkv} L=S={L} D={D} top-{k}"
    print(f"{shape}, {args.dtype}, forward; max |diff| {err:.1e}")
    print("| path | forward s | vs sdpa | peak MiB (growth) |")
    print("|---|---|---|---|")
    print(
        f"| attnkit gather kernel | {t['attnkit']:.3f} | {t['sdpa'] / t['attnkit']:.2f}x | "
        f"{ours_peak:.0f} |"
    )
    print(
        f"| sdpa + scattered bool mask ({mask_mib:.0f} MiB) | {t['sdpa']:.3f} | 1.00x | "
        f"{sdpa_peak:.0f} |"
    )
    if args.backward:
        _backward(q, kk, v, spec, ind, args.reps)


def _backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: masks.MaskSpec,
    ind: torch.Tensor,
    reps: int,
) -> None:
    """attnkit's backward time at the full size, the C++ backward split into slices of query
    rows per key/value head (the default, ``gather_native.ROW_SLICES = 0``) against the same
    kernel parallel over batch rows and key/value heads only (``ROW_SLICES = 1``, what it was
    before), interleaved; and its gradients against SDPA's (through the scattered mask) on the
    first 1024 queries and keys."""
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    times: dict[int, list[float]] = {1: [], 0: []}
    cpu: dict[int, list[float]] = {1: [], 0: []}
    grads: dict[int, list[torch.Tensor]] = {}
    for rep in range(reps + 1):  # the first round warms up, untimed
        for slices in times:
            gather_native.ROW_SLICES = slices
            out = attnkit.attention(qg, kg, vg, mask=spec)
            t0, c0 = time.perf_counter(), time.process_time()
            torch.autograd.backward(out.sum())
            if rep:
                times[slices].append(time.perf_counter() - t0)
                cpu[slices].append(time.process_time() - c0)
            grads[slices] = [t.grad.clone() for t in (qg, kg, vg)]  # type: ignore[union-attr]
            for t in (qg, kg, vg):
                t.grad = None
    gather_native.ROW_SLICES = 0
    diff = max((a - b).abs().max().item() for a, b in zip(grads[0], grads[1], strict=True))
    one, split = (statistics.median(times[n]) for n in (1, 0))
    busy = {n: statistics.median(c / w for c, w in zip(cpu[n], times[n], strict=True)) for n in cpu}
    print("| backward | s | vs B x Hkv only | CPU s per wall s (threads busy) |")
    print("|---|---|---|---|")
    print(f"| parallel over B x Hkv only | {one:.3f} | 1.00x | {busy[1]:.2f} |")
    print(f"| slices of query rows (default) | {split:.3f} | {one / split:.2f}x | {busy[0]:.2f} |")
    print(f"(the two backwards' gradients differ by {diff:.1e}: the order of the float32 sums)")
    n = 1024
    small = masks.causal() & masks.selected_keys(ind[:, :n].clamp(max=n - 1))
    a = [x[:, :, :n].detach().clone().requires_grad_() for x in (q, k, v)]
    b = [x.detach().clone().requires_grad_() for x in a]
    torch.autograd.backward(attnkit.attention(a[0], a[1], a[2], mask=small).sum())
    dense = small.to_dense(n, n)
    gqa = k.shape[1] != q.shape[1]
    sdpa = F.scaled_dot_product_attention(b[0], b[1], b[2], attn_mask=dense, enable_gqa=gqa)
    torch.autograd.backward(sdpa.sum())
    err = max((x.grad - y.grad).abs().max().item() for x, y in zip(a, b, strict=True))  # type: ignore[operator]
    print(f"(attnkit's gradients vs sdpa's at L=S={n}: {err:.1e})")


def _decode(S: int, H: int, Hkv: int, D: int, k: int, reps: int, dtype: torch.dtype) -> None:
    """Decode steps (L = 1, 4, 16 new queries against S cached keys, DeepSeek-V3.2's top-2048),
    forward, in ``dtype``: attnkit against SDPA with the scattered mask, in milliseconds."""
    gen = torch.Generator().manual_seed(1)
    kk = torch.randn(1, Hkv, S, D, generator=gen).to(dtype)
    v = torch.randn(1, Hkv, S, D, generator=gen).to(dtype)
    name = str(dtype).removeprefix("torch.")
    print(f"{cpu_line()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"decode steps: B=1 H={H} Hkv={Hkv} S={S} D={D} top-{k}, {name}, forward")
    print("| L | attnkit ms | sdpa + scattered mask ms | vs sdpa |")
    print("|---|---|---|---|")
    for L in (1, 4, 16):
        q = torch.randn(1, H, L, D, generator=gen).to(dtype)
        ind = _indices(1, L, S, k, gen)
        spec = masks.causal() & masks.selected_keys(ind)
        assert "gather kernel" in str(attnkit.explain(q, kk, v, mask=spec))

        def ours(q: torch.Tensor = q, spec: masks.MaskSpec = spec) -> torch.Tensor:
            return attnkit.attention(q, kk, v, mask=spec)

        def sdpa(q: torch.Tensor = q, ind: torch.Tensor = ind) -> torch.Tensor:
            mask = _dense(ind, S)
            return F.scaled_dot_product_attention(q, kk, v, attn_mask=mask, enable_gqa=Hkv != H)

        ours(), sdpa()
        t = _time({"attnkit": ours, "sdpa": sdpa}, reps)
        a, b = t["attnkit"] * 1e3, t["sdpa"] * 1e3
        print(f"| {L} | {a:.2f} | {b:.2f} | {b / a:.2f}x |")


if __name__ == "__main__":
    main()
