"""``attnkit bench --device cuda``: SDPA, flex_attention and attnkit on one GPU, side by side.

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
D head dim (Dk = Dv).

What this module measures goes through the CPU bench's stack: its rows are planned and checked
by :mod:`attnkit.bench.plan` (default :data:`~attnkit.bench.plan.CUDA_ROWS`); its workloads are
those of :mod:`attnkit.bench.workloads` (same names, same masks and FLOP count: allowed pairs
only) at the GPU bench's sizes (:func:`~attnkit.bench.workloads.gpu_workload`: B = 1, H = 16,
D = 128; ``gqa``: 32 query heads on 8; the causal window 1024 wide); its peers' calls are those
of :mod:`attnkit.bench.peers`; what it measured is a
:class:`~attnkit.bench.results.BenchResult` (``device="cuda"``) that :mod:`attnkit.bench.report`
renders and writes. Its own are the clock, the memory figure, the GEMM and which peer skips
what. Peers:

* ``sdpa``: ``F.scaled_dot_product_attention`` with ``is_causal`` where the mask is exactly
  causal, else the spec materialised as a dense bool mask (skipped above ``cap_gib``);
* ``flex``: ``flex_attention`` compiled by hand (``torch.compile(dynamic=False)``) with the
  block mask ``create_block_mask`` builds from the same predicate; the first call (the
  compile) is timed apart;
* ``attnkit``: ``attnkit.attention(backend="auto")``; the note says which backend auto took.
  ``attnkit-<backend>`` names one.

Per peer and row: the median of ``reps`` calls timed with CUDA events, the peers interleaved
round by round (after one untimed call each); useful GFLOP/s (the report shows TFLOP/s); its
fraction of the GPU's bf16 GEMM throughput, measured in the same run (``n x n`` matmuls); and
the peak memory of one call above what was allocated before it
(``torch.cuda.max_memory_allocated``). Forward runs under ``torch.no_grad``; forward + backward
back-propagates ones.

Without a GPU (``torch.cuda.is_available()`` False), :func:`require_cuda` stops the command
before any work with one line that says why. The timing and memory code is the same for the
``"cpu"`` device (wall clock, no memory figure), which is how it is tested without a GPU.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from attnkit.bench.peers import PEERS, step
from attnkit.bench.plan import (
    CUDA_ROWS,
    CUDA_WHERE,
    check_cuda_peers,
    check_cuda_rows,
    check_options,
)
from attnkit.bench.results import BenchResult, Entry, Row
from attnkit.bench.workloads import Inputs, Workload, gpu_workload
from attnkit.errors import AttentionInputError

__all__ = ["measure_gemm", "require_cuda", "run_cuda", "run_row", "unavailable"]

GiB = 1 << 30


def unavailable() -> str | None:
    """Why this machine cannot run the CUDA bench, or ``None``."""
    if torch.cuda.is_available():
        return None
    build = torch.version.cuda
    what = f"built for CUDA {build}, but no GPU is visible" if build else "a CPU-only build"
    return f"torch.cuda.is_available() is False (torch {torch.__version__}, {what})"


def require_cuda(where: str = CUDA_WHERE) -> None:
    """Raise :class:`~attnkit.AttentionInputError` (one line in the CLI) without a GPU."""
    why = unavailable()
    if why is not None:
        raise AttentionInputError(
            where,
            "--device",
            f"--device cuda needs an NVIDIA GPU that torch can see: {why}.",
            got="--device cuda",
            expected="a machine with a CUDA GPU and a CUDA build of torch",
            fix="run it on a GPU machine (docs/cuda.md: make bench-cuda); without a GPU, "
            "leave out --device for the CPU bench",
        )


class _Clock:
    """CUDA events on a GPU, the wall clock on the CPU (how the code is tested without one)."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"

    def time(self, fn: Callable[[], Any]) -> float:
        """Seconds one call of ``fn`` takes on the device."""
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return float(start.elapsed_time(end)) / 1e3

    def peak_bytes(self, fn: Callable[[], Any]) -> float | None:
        """Peak memory of one call above what was allocated before it (``None`` on CPU)."""
        if not self.cuda:
            fn()
            return None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return float(torch.cuda.max_memory_allocated() - base)


def measure_gemm(device: str, n: int = 8192, reps: int = 10) -> float:
    """The device's bf16 GEMM throughput, GFLOP/s: median of ``reps`` ``n x n`` matmuls."""
    clock = _Clock(device)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device, torch.bfloat16)
    b = torch.randn(n, n, generator=g).to(device, torch.bfloat16)
    a @ b
    times = [clock.time(lambda: a @ b) for _ in range(reps)]
    return 2.0 * n**3 / statistics.median(times) / 1e9


def _skip(peer: str, wl: Workload, L: int, inputs: Inputs, cap: float) -> str:
    """Why ``peer`` cannot run the row on the GPU (``""``: it can)."""
    Lq, S = wl.sizes(L)
    spec = inputs.spec
    if peer == "sdpa" and spec is not None and not inputs.causal:
        need = Lq * S * (spec.batch or 1)
        if need > cap:
            return f"its dense mask needs ~{need / GiB:.0f} GiB (cap {cap / GiB:.0f})"
    if peer == "attnkit-math" and wl.B * wl.H * Lq * S * 4 * 3 > cap:
        return "its (B, H, L, S) weights exceed the cap"
    if peer == "flex":
        from attnkit.backends import flex

        return flex.unavailable() or ""
    return ""


def _note(peer: str, inputs: Inputs) -> str:
    """What the note says of ``peer`` (read after its first call): SDPA's mask, flex's block
    mask, the backend ``auto`` took."""
    import attnkit

    q, k, v = (t.detach() for t in (inputs.q, inputs.k, inputs.v))
    if peer == "sdpa":
        if inputs.causal and q.shape[2] == k.shape[2]:
            return "is_causal"
        return "dense mask" if inputs.spec is not None else ""
    if peer == "flex":
        return "create_block_mask, compiled by hand"
    if peer == "attnkit":
        mask = None if inputs.causal else inputs.spec
        return f"auto: {attnkit.explain(q, k, v, mask=mask, causal=inputs.causal).chosen}"
    return ""


def run_row(
    name: str,
    L: int,
    dtype: str,
    mode: str,
    *,
    peers: Sequence[str],
    reps: int,
    gemm_gflops: float,
    cap_gib: float = 16.0,
    device: str = "cuda",
) -> Row:
    """One row: every peer's median time, GFLOP/s, fraction of the GEMM peak, peak memory."""
    wl = gpu_workload(name)
    backward = mode == "fwd+bwd"
    inputs = wl.inputs(L, getattr(torch, dtype), grad=backward, device=device)
    clock = _Clock(device)
    row = Row(name, L, dtype, mode, wl.flops(L, backward))
    calls: dict[str, Callable[[], None]] = {}
    for peer in peers:
        why = _skip(peer, wl, L, inputs, cap_gib * GiB)
        if why:
            row.entries.append(Entry(peer, skipped=why))
            continue
        calls[peer] = functools.partial(step, PEERS[peer].setup(wl, inputs), inputs, backward, [])
        first = clock.time(calls[peer])
        note = ", ".join(n for n in (_note(peer, inputs), f"first call {first:.2f} s") if n)
        row.entries.append(Entry(peer, first_call_s=first, note=note))
    times: dict[str, list[float]] = {p: [] for p in calls}
    for _ in range(reps):  # interleaved: one call of each peer per round
        for peer, call in calls.items():
            times[peer].append(clock.time(call))
    for entry in row.entries:
        if entry.peer not in calls:
            continue
        entry.times_ms = [t * 1e3 for t in times[entry.peer]]
        entry.ms = statistics.median(entry.times_ms)
        entry.gflops = row.flops / (entry.ms / 1e3) / 1e9
        entry.gemm_fraction = entry.gflops / gemm_gflops if gemm_gflops > 0 else None
        peak = clock.peak_bytes(calls[entry.peer])
        entry.peak_mib = None if peak is None else peak / (1 << 20)
    return row


def run_cuda(
    rows: Sequence[tuple[str, int, str, str]] | None = None,
    *,
    peers: Sequence[str] | None = None,
    reps: int = 12,
    cap_gib: float = 16.0,
    gemm_n: int = 8192,
    device: str = "cuda",
    progress: Callable[[str, int, int], None] | None = None,
) -> BenchResult:
    """Run ``rows`` (default :data:`~attnkit.bench.plan.CUDA_ROWS`) on the GPU; refuses without
    one, and refuses rows, peers and options the GPU bench does not run before measuring."""
    if device == "cuda":
        require_cuda()
    chosen = list(CUDA_ROWS if rows is None else rows)
    check_cuda_rows(chosen)
    names = check_cuda_peers(peers)
    check_options(reps=reps, cap_gib=cap_gib, gemm_n=gemm_n, where=CUDA_WHERE)
    start = time.perf_counter()
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    info = {"device": gpu, "torch": torch.__version__, "cuda": torch.version.cuda}
    result = BenchResult(info, measure_gemm(device, gemm_n), [], reps, device="cuda")
    # the flex peer compiles flex_attention once per row (shape, dtype, grad, mask): past
    # Dynamo's default of 8 compiles of one function it would run uncompiled, materialising the
    # L x S scores; the limit is raised for this run, and a row past it fails instead
    with torch._dynamo.config.patch(recompile_limit=256, fail_on_recompile_limit_hit=True):
        for i, (wl, L, dtype, mode) in enumerate(chosen):
            if progress is not None:
                progress(f"{wl} L={L} {dtype} {mode}", i, len(chosen))
            result.rows.append(
                run_row(
                    wl, L, dtype, mode,
                    peers=names, reps=reps, gemm_gflops=result.gemm_gflops, cap_gib=cap_gib,
                    device=device,
                )
            )  # fmt: skip
    result.seconds = time.perf_counter() - start
    return result
