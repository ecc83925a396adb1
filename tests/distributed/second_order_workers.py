"""Workers for tests/distributed/test_ring_second_order.py (a script, run in a subprocess).

``python second_order_workers.py OUTDIR WORLD`` forks WORLD gloo ranks (file rendezvous,
loopback); each computes, for every case, second derivatives through ring attention on its shard
and the same quantities on one process (the math backend, float64, the whole sequence), and
writes ``OUTDIR/rank{r}.json`` with the largest differences. The ranks are killed after 90 s.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import attnkit
import attnkit.distributed as akd
from attnkit import masks

#: name -> (causal, mask spec over the whole sequence (L, S) or None, H, Hkv)
CASES: dict[str, tuple[bool, Callable[[int, int], masks.MaskSpec | None], int, int]] = {
    "causal_gqa": (True, lambda L, S: None, 2, 1),
    "window_padding": (
        False,
        lambda L, S: masks.sliding_window(3) & masks.padding(torch.tensor([S - 1])),
        2,
        2,
    ),
    # per key/value head top-k keys (global positions): the recomputed mask differs by head
    "selected_per_head": (True, lambda L, S: _selected(L, S), 4, 2),
}


def _selected(L: int, S: int) -> masks.MaskSpec:
    ind = torch.randint(-1, S, (1, 2, L, 2), generator=torch.Generator().manual_seed(L))
    ind[:, 1, :, 0] = torch.arange(L)  # head 1's rows see their own key at least
    return masks.selected_keys(ind, heads=4)


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def run_case(name: str, world: int) -> dict[str, Any]:
    causal, make_mask, H, Hkv = CASES[name]
    gen = torch.Generator().manual_seed(len(name))
    n = 2  # tokens per rank (zigzag: two chunks of one)
    L = S = n * world
    f64 = torch.float64
    Q = torch.randn(1, H, L, 2, generator=gen, dtype=f64)
    K = torch.randn(1, Hkv, S, 2, generator=gen, dtype=f64)
    V = torch.randn(1, Hkv, S, 3, generator=gen, dtype=f64)
    G = torch.randn(1, H, L, 3, generator=gen, dtype=f64)
    spec = make_mask(L, S)

    def sh(t: torch.Tensor) -> torch.Tensor:
        return akd.shard(t, causal=causal)

    def one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attnkit.attention(q, k, v, mask=spec, causal=causal, backend="math")

    def ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return akd.ring_attention(q, k, v, mask=spec, causal=causal)

    # a gradient penalty: the gradients (create_graph=True), then the gradient of their size
    full = [t.clone().requires_grad_() for t in (Q, K, V)]
    grads = torch.autograd.grad((one(*full) * G).sum(), full, create_graph=True)
    second = torch.autograd.grad(sum((g**2).sum() for g in grads), full)
    parts = [sh(t).requires_grad_() for t in (Q, K, V)]
    r_grads = torch.autograd.grad((ring(*parts) * sh(G)).sum(), parts, create_graph=True)
    r_second = torch.autograd.grad(sum((g**2).sum() for g in r_grads), parts)
    # the Hessian of this rank's loss in its own queries: the whole Hessian's block of its rows
    pos = akd.shard_positions(L, causal=causal)
    W = torch.randn(1, H, L, 3, generator=gen, dtype=f64)
    h_one = torch.autograd.functional.hessian(lambda x: (one(x, K, V) ** 2 * W).sum(), Q)
    want = h_one[:, :, pos][..., pos, :]
    k_r, v_r, w_r = sh(K), sh(V), sh(W)
    got = torch.autograd.functional.hessian(lambda x: (ring(x, k_r, v_r) ** 2 * w_r).sum(), sh(Q))
    return {
        "first": max(_diff(a, sh(b)) for a, b in zip(r_grads, grads, strict=True)),
        "second": max(_diff(a, sh(b)) for a, b in zip(r_second, second, strict=True)),
        "second_size": max(b.abs().max().item() for b in second),
        "hessian": _diff(got, want),
        "hessian_size": want.abs().max().item(),
    }


def worker(rank: int, world: int, outdir: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"file://{outdir}/rendezvous",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=30),
    )
    res: dict[str, Any] = {}
    for name in CASES:
        t0 = time.perf_counter()
        try:
            res[name] = run_case(name, world)
        except Exception:
            res[name] = {"exception": traceback.format_exc()}
        res[name]["seconds"] = time.perf_counter() - t0
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(res))
    os._exit(0)


if __name__ == "__main__":
    out, size = Path(sys.argv[1]), int(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=worker, args=(r, size, str(out))) for r in range(size)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=max(0.1, 90.0 - (time.monotonic() - t0)))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
