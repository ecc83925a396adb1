"""One long sequence across processes with ring attention: memory, time and bytes per rank.

    torchrun --nproc-per-node 4 examples/ring_long_sequence.py                  # L = 8192
    torchrun --nproc-per-node 4 examples/ring_long_sequence.py --seq 65536
    torchrun --nproc-per-node 4 examples/ring_long_sequence.py --seq 32768 --compare
    python examples/ring_long_sequence.py --single --seq 32768                  # one process

Each rank holds ``L / P`` tokens (the zigzag split for causal attention, or ``--layout
contiguous`` to see the imbalance it removes) and runs forward and backward of either the bare
op (``--what op``: :func:`attnkit.distributed.ring_attention`) or a pre-norm transformer layer
made sequence-parallel with :func:`attnkit.distributed.parallelize` (``--what layer``). Every rank
reports the peak of tensor memory alive from its inputs' creation to the end of the backward,
the wall time, the compute time (CPU time of the process inside the ring steps, so that ranks
sharing cores compare by the work they did), the time spent waiting for a neighbour and the
bytes it sent per ring step; rank 0 prints the table. ``--compare`` then runs the same work on
the whole sequence in one fresh process (if it fits in memory) and prints the ratios. On GPUs
the same code runs with ``--backend nccl`` (one GPU per rank; not run here, as this machine has
none).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import attnkit
import attnkit.distributed as akd
from attnkit.modules.transformer import TransformerConfig, TransformerLayer

MiB = 2**20


@contextmanager
def _tensor_memory(device: torch.device) -> Iterator[dict[str, int]]:
    """Peak bytes of the tensors allocated inside the block and alive at once: on a GPU
    ``torch.cuda.max_memory_allocated``, on CPU the same from torch.profiler's allocation events
    (the resident set would also count the allocator's cache and code pages)."""
    found = {"peak": 0}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield found
        torch.cuda.synchronize(device)
        found["peak"] = torch.cuda.max_memory_allocated(device) - base
        return
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        yield found
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        events = json.loads(Path(tmp, "trace.json").read_text())["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    found["peak"] = max(totals, default=0)


def _inputs(args: argparse.Namespace, n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    dt = getattr(torch, args.dtype)
    B, H, Hkv, D = args.batch, args.heads, args.kv_heads or args.heads, args.head_dim
    shapes: list[tuple[int, ...]]
    if args.what == "layer":
        shapes = [(B, n, H * D), (B, n, H * D)]  # x, dy
    else:
        shapes = [(B, H, n, D), (B, Hkv, n, D), (B, Hkv, n, D), (B, H, n, D)]  # q, k, v, dout
    return [torch.randn(s, generator=gen, dtype=dt).to(_device(args)) for s in shapes]


def _device(args: argparse.Namespace) -> torch.device:
    if args.backend == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def run(args: argparse.Namespace, world: int, rank: int) -> dict[str, Any]:
    """Forward and backward on this rank's ``L / world`` tokens (``world = 1``: one process).

    A small warm-up pass first, so that the peak counts tensors, not the code pages and
    thread stacks that torch and gloo bring in on first use.
    """
    causal = not args.no_causal
    zigzag = causal and args.layout == "zigzag"
    mask = attnkit.masks.causal() if causal and not zigzag else None
    ring = world > 1 or args.single_ring
    layer = None
    if args.what == "layer":
        cfg = TransformerConfig(
            dim=args.heads * args.head_dim,
            num_heads=args.heads,
            causal=zigzag,
            norm_first=True,
            backend=args.attention,
        )
        layer = TransformerLayer(cfg).to(_device(args), getattr(torch, args.dtype))
        if ring:
            akd.parallelize(layer, timeout=args.timeout)

    def forward(leaves: list[torch.Tensor]) -> torch.Tensor:
        if layer is not None:
            return layer(leaves[0], mask=mask).hidden
        if ring:
            return akd.ring_attention(*leaves, causal=zigzag, mask=mask, timeout=args.timeout)
        return attnkit.attention(*leaves, causal=causal, backend=args.attention)

    def fwd_bwd() -> tuple[float, float, float]:
        tensors = _inputs(args, args.seq // world, seed=rank)
        leaves = [t.requires_grad_() for t in tensors[:-1]]
        t0, c0 = time.perf_counter(), time.process_time()
        out = forward(leaves)
        t1 = time.perf_counter()
        out.backward(tensors[-1])
        return t1 - t0, time.perf_counter() - t1, time.process_time() - c0

    warm = [t.requires_grad_() for t in _inputs(args, 2 * world * 64 // world, seed=rank)]
    forward(warm[:-1]).backward(warm[-1])  # first-use costs out of the way
    del warm
    with akd.profile() as prof:  # pass 1: times and bytes
        fwd_s, bwd_s, cpu_s = fwd_bwd()
    peak = 0
    if not args.no_memory:  # pass 2: memory (the profiler slows it down; not timed)
        with _tensor_memory(_device(args)) as memory:
            fwd_bwd()
        peak = memory["peak"]
    fwd = [s for s in prof.steps if s.phase == "forward"]
    bwd = [s for s in prof.steps if s.phase == "backward"]
    if layer is not None:
        attention = "layer, ring" if ring else f"layer, attnkit.attention ({args.attention})"
    else:
        attention = "ring" if ring else _chosen(args, causal)
    return {
        "rank": rank,
        "attention": attention,
        "peak_mib": peak / MiB,
        "forward_s": fwd_s,
        "backward_s": bwd_s,
        "cpu_s": cpu_s,
        "compute_cpu_s": prof.total("compute_s") if ring else cpu_s,
        "wait_s": prof.total("wait_s"),
        "fwd_mib_per_step": max((s.bytes_sent for s in fwd), default=0) / MiB,
        "bwd_mib_per_step": max((s.bytes_sent for s in bwd), default=0) / MiB,
        "pairs": prof.total("pairs"),
        "steps": len(fwd),
    }


def _chosen(args: argparse.Namespace, causal: bool) -> str:
    """The backend attnkit.attention picks for these sizes (asked on a short sequence)."""
    q, k, v, _ = _inputs(args, 128, seed=0)
    return attnkit.explain(q, k, v, causal=causal, backend=args.attention).chosen


def _baseline(args: argparse.Namespace) -> dict[str, Any] | None:
    """The whole sequence in one fresh process, if it fits (about 12 full-size tensors)."""
    elem = torch.finfo(getattr(torch, args.dtype)).bits // 8
    need = 12 * args.batch * args.seq * args.heads * args.head_dim * elem
    avail = _meminfo("MemAvailable")
    if need > 0.8 * avail:
        print(f"one process would need ~{need / MiB:.0f} MiB; {avail / MiB:.0f} MiB free: skipped")
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "single.json")
        argv = [a for a in sys.argv[1:] if a != "--compare"]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD", "LOCAL"))}
        subprocess.run(
            [sys.executable, __file__, *argv, "--single", "--json", str(out)], check=True, env=env
        )
        result: dict[str, Any] = json.loads(out.read_text())
        return result


def _meminfo(key: str) -> int:
    match = re.search(rf"{key}:\s+(\d+) kB", Path("/proc/meminfo").read_text())
    return int(match.group(1)) * 1024 if match else 0


def _table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'rank':>4} {'peak MiB':>9} {'fwd s':>7} {'bwd s':>7} {'cpu s':>7} "
        f"{'wait s':>7} {'MiB/step fwd':>13} {'bwd':>7} {'pairs':>6}"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['rank']:>4} {r['peak_mib']:>9.1f} "
            f"{r['forward_s']:>7.2f} {r['backward_s']:>7.2f} {r['compute_cpu_s']:>7.2f} "
            f"{r['wait_s']:>7.2f} {r['fwd_mib_per_step']:>13.2f} {r['bwd_mib_per_step']:>7.2f} "
            f"{r['pairs']:>6.0f}"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seq", type=int, default=8192, help="L, the whole sequence's tokens")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None, help="grouped-query K/V heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    p.add_argument("--what", default="op", choices=["op", "layer"])
    p.add_argument("--no-causal", action="store_true", help="dense attention")
    p.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous"])
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--attention", default="auto", help="attnkit backend of the one-process run")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a rank gives up")
    p.add_argument("--single", action="store_true", help="run on the whole sequence, one process")
    p.add_argument("--single-ring", action="store_true", help="with --single: the ring code, P=1")
    p.add_argument("--compare", action="store_true", help="then run --single and print ratios")
    p.add_argument("--no-memory", action="store_true", help="skip the memory pass")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.single:
        with tempfile.TemporaryDirectory() as tmp:
            if args.single_ring:
                dist.init_process_group(
                    "gloo", init_method=f"file://{tmp}/rdzv", rank=0, world_size=1
                )
            res = run(args, 1, 0)
        print(f"one process, L={args.seq}, attention: {res['attention']}\n{_table([res])}")
        if args.json:
            args.json.write_text(json.dumps(res))
        return
    if args.backend == "nccl":
        torch.cuda.set_device(_device(args))
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    res = run(args, world, rank)
    rows: list[Any] = [None] * world
    dist.all_gather_object(rows, res)
    dist.destroy_process_group()
    if rank != 0:
        return
    layout = args.layout if not args.no_causal else "contiguous, dense"
    print(
        f"ring attention ({args.what}), L={args.seq}, P={world}, B={args.batch}, "
        f"H={args.heads}, Hkv={args.kv_heads or args.heads}, D={args.head_dim}, {args.dtype}, "
        f"{'causal' if not args.no_causal else 'dense'} ({layout})\n{_table(rows)}"
    )
    cpu = [r["compute_cpu_s"] for r in rows]
    summary: dict[str, Any] = {"ranks": rows, "compute_max_over_min": max(cpu) / min(cpu)}
    print(f"compute time max/min over ranks: {summary['compute_max_over_min']:.3f}")
    if args.compare:
        single = _baseline(args)
        if single is not None:
            summary["single"] = single
            summary["peak_ratio"] = max(r["peak_mib"] for r in rows) / single["peak_mib"]
            print(
                f"per-rank peak / one process: {summary['peak_ratio']:.3f}   "
                f"(one process: {single['peak_mib']:.0f} MiB, "
                f"{single['forward_s'] + single['backward_s']:.1f} s)"
            )
    if args.json:
        args.json.write_text(json.dumps(summary))


if __name__ == "__main__":
    main()
