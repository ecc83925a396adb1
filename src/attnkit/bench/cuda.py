"""``attnkit bench --device cuda``: SDPA, flex_attention and attnkit on one GPU, side by side.

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
D head dim (Dk = Dv).

The workloads of :mod:`attnkit.bench.workloads` (same names, same masks and FLOP count: allowed
pairs only), at issue 16's GPU sizes: B = 1, H = 16, D = 128 (``gqa``: 32 query heads on 8),
the causal window 1024 wide instead of 256. Peers:

* ``sdpa``: ``F.scaled_dot_product_attention`` with ``is_causal`` where the mask is exactly
  causal, else the spec materialised as a dense bool mask (skipped above ``cap_gib``);
* ``flex``: ``flex_attention`` compiled by hand (``torch.compile(dynamic=False)``) with the
  block mask ``create_block_mask`` builds from the same predicate; the first call (the
  compile) is timed apart;
* ``attnkit``: ``attnkit.attention(backend="auto")``; the note says which backend auto took.
  ``attnkit-<backend>`` names one.

Per peer and row: the median of ``reps`` calls timed with CUDA events, the peers interleaved
round by round (after one untimed call each); useful TFLOP/s; its fraction of the GPU's bf16
GEMM throughput, measured in the same run (``n x n`` matmuls); and the peak memory of one call
above what was allocated before it (``torch.cuda.max_memory_allocated``). Forward runs under
``torch.no_grad``; forward + backward back-propagates ones.

Without a GPU (``torch.cuda.is_available()`` False), :func:`require_cuda` stops the command
before any work with one line that says why. The timing and memory code is the same for the
``"cpu"`` device (wall clock, no memory figure), which is how it is tested without a GPU.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from attnkit import files, masks
from attnkit.bench.workloads import BACKWARD_FACTOR, WORKLOADS, Workload, allowed_pairs
from attnkit.errors import AttentionInputError
from attnkit.masks import MaskSpec

__all__ = [
    "CUDA_PEERS",
    "CUDA_ROWS",
    "CudaResult",
    "require_cuda",
    "run_cuda",
    "to_markdown",
    "unavailable",
]

WHERE = "attnkit bench --device cuda"
GiB = 1 << 30
H, D, WINDOW = 16, 128, 1024  #: issue 16's sizes
CUDA_PEERS = ["sdpa", "flex", "attnkit"]
CUDA_WORKLOADS = ["dense", "causal", "window", "document", "padding", "prefix", "gqa"]
#: the rows issue 16's acceptance reads (bf16 unless said)
CUDA_ROWS: list[tuple[str, int, str, str]] = [
    (w, L, "bfloat16", m)
    for w in ("window", "document")
    for L in (16384, 32768)
    for m in ("fwd", "fwd+bwd")
] + [
    ("causal", 16384, "bfloat16", "fwd"),
    ("causal", 16384, "bfloat16", "fwd+bwd"),
    ("dense", 16384, "bfloat16", "fwd"),
    ("gqa", 16384, "bfloat16", "fwd"),
    ("gqa", 16384, "float32", "fwd"),
]

Fn = Callable[[], torch.Tensor]


def unavailable() -> str | None:
    """Why this machine cannot run the CUDA bench, or ``None``."""
    if torch.cuda.is_available():
        return None
    build = torch.version.cuda
    what = f"built for CUDA {build}, but no GPU is visible" if build else "a CPU-only build"
    return f"torch.cuda.is_available() is False (torch {torch.__version__}, {what})"


def require_cuda(where: str = WHERE) -> None:
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


def workload(name: str) -> Workload:
    """The workload ``name`` at the GPU sizes (``gqa`` keeps its 32/8 heads)."""
    wl = WORKLOADS[name]
    return replace(wl, H=wl.H if name == "gqa" else H, D=D)


def spec_on(name: str, L: int, S: int, device: str) -> tuple[MaskSpec | None, bool]:
    """The mask of workload ``name`` with its tensors on ``device``, and whether it is exactly
    causal; as :meth:`Workload.spec` builds it, the window 1024 wide."""
    if name == "window":
        return masks.causal() & masks.sliding_window(WINDOW), False
    if name == "padding":
        return masks.padding(torch.tensor([S, S // 2], device=device)), False
    if name == "document":  # the same random cuts as workloads.py (seeded by L)
        g = torch.Generator().manual_seed(L)
        cuts = torch.randperm(S - 1, generator=g)[:7].add(1).sort().values
        ids = torch.zeros(S, dtype=torch.long)
        for c in cuts.tolist():
            ids[c:] += 1
        return masks.document(ids.to(device)) & masks.causal(), False
    return WORKLOADS[name].spec(L, S)  # no tensors: dense, decode, causal, gqa, prefix


@dataclass
class CudaEntry:
    peer: str
    ms: float | None = None  #: median per call
    tflops: float | None = None  #: useful TFLOP/s (allowed pairs only)
    of_peak: float | None = None  #: tflops over the measured bf16 GEMM TFLOP/s
    peak_mib: float | None = None  #: peak memory of one call above what was allocated
    note: str = ""  #: why skipped, auto's backend, the first call's time


@dataclass
class CudaRow:
    workload: str
    L: int
    dtype: str
    mode: str
    entries: list[CudaEntry] = field(default_factory=list)


@dataclass
class CudaResult:
    device: str
    torch: str
    cuda: str | None
    gemm_tflops: float
    reps: int
    rows: list[CudaRow] = field(default_factory=list)


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
    """The device's bf16 GEMM throughput, TFLOP/s: median of ``reps`` ``n x n`` matmuls."""
    clock = _Clock(device)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device, torch.bfloat16)
    b = torch.randn(n, n, generator=g).to(device, torch.bfloat16)
    a @ b
    times = [clock.time(lambda: a @ b) for _ in range(reps)]
    return 2.0 * n**3 / statistics.median(times) / 1e12


def _inputs(wl: Workload, L: int, dtype: torch.dtype, device: str, grad: bool) -> list[Any]:
    Lq, S = wl.sizes(L)
    g = torch.Generator().manual_seed(1000 + L)

    def rand(*shape: int) -> torch.Tensor:
        t = torch.randn(*shape, generator=g).to(device, dtype)
        return t.requires_grad_(grad)

    return [rand(wl.B, wl.H, Lq, wl.D), rand(wl.B, wl.Hkv, S, wl.D), rand(wl.B, wl.Hkv, S, wl.D)]


def _skip(peer: str, wl: Workload, L: int, spec: MaskSpec | None, causal: bool, cap: float) -> str:
    Lq, S = wl.sizes(L)
    if peer == "sdpa" and spec is not None and not causal:
        need = Lq * S * (spec.batch or 1)
        if need > cap:
            return f"its dense mask needs ~{need / GiB:.0f} GiB (cap {cap / GiB:.0f})"
    if peer == "attnkit-math" and wl.B * wl.H * Lq * S * 4 * 3 > cap:
        return "its (B, H, L, S) weights exceed the cap"
    if peer == "flex":
        from attnkit.backends import flex

        return flex.unavailable() or ""
    return ""


def _setup(
    peer: str, qkv: list[torch.Tensor], spec: MaskSpec | None, causal: bool
) -> tuple[Fn, Callable[[], str]]:
    """The call of ``peer``, and a function giving its note (read after the first call)."""
    import torch.nn.functional as F

    import attnkit

    q, k, v = qkv
    L, S = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if peer == "sdpa":
        flag = causal and L == S
        mask = None if flag or spec is None else spec.to_dense(L, S, device=q.device)

        def sdpa() -> torch.Tensor:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=flag, enable_gqa=gqa
            )

        return sdpa, lambda: "is_causal" if flag else ("dense mask" if mask is not None else "")
    if peer == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        block_mask = None
        if spec is not None:
            off, rule = S - L, spec

            def mask_mod(b: Any, h: Any, qi: Any, kv: Any) -> Any:
                return rule.allowed(b, h, qi, kv, off)

            block_mask = create_block_mask(mask_mod, spec.batch, None, L, S, device=q.device)
        compiled = torch.compile(flex_attention, dynamic=False)

        def flex() -> torch.Tensor:
            out: torch.Tensor = compiled(q, k, v, block_mask=block_mask, enable_gqa=gqa)
            return out

        return flex, lambda: "create_block_mask, compiled by hand"
    backend = "auto" if peer == "attnkit" else peer.removeprefix("attnkit-")
    given = None if causal else spec

    def ak() -> torch.Tensor:
        return attnkit.attention(q, k, v, mask=given, causal=causal, backend=backend)

    def note() -> str:
        if backend != "auto":
            return ""
        chosen = attnkit.explain(*(t.detach() for t in qkv), mask=given, causal=causal).chosen
        return f"auto: {chosen}"

    return ak, note


def _one_step(fn: Fn, qkv: list[torch.Tensor], backward: bool) -> Callable[[], None]:
    """One timed step of a peer: its call (under ``no_grad`` forward only), and the backward of
    ones for ``fwd+bwd``."""

    def step() -> None:
        if not backward:
            with torch.no_grad():
                fn()
            return
        for t in qkv:
            t.grad = None
        out = fn()
        out.backward(torch.ones_like(out))  # type: ignore[no-untyped-call]

    return step


def run_row(
    name: str,
    L: int,
    dtype: str,
    mode: str,
    *,
    peers: Sequence[str],
    reps: int,
    gemm_tflops: float,
    cap_gib: float = 16.0,
    device: str = "cuda",
) -> CudaRow:
    """One row: every peer's median time, TFLOP/s, fraction of the GEMM peak, peak memory."""
    wl = workload(name)
    backward = mode == "fwd+bwd"
    Lq, S = wl.sizes(L)
    spec, causal = spec_on(name, Lq, S, device)
    flops = 4.0 * wl.D * wl.H * allowed_pairs(spec_on(name, Lq, S, "cpu")[0], Lq, S, wl.B)
    flops *= BACKWARD_FACTOR if backward else 1.0
    qkv = _inputs(wl, L, getattr(torch, dtype), device, backward)
    clock = _Clock(device)
    row = CudaRow(name, L, dtype, mode)
    calls: dict[str, Callable[[], None]] = {}
    for peer in peers:
        entry = CudaEntry(peer)
        row.entries.append(entry)
        entry.note = _skip(peer, wl, L, spec, causal, cap_gib * GiB)
        if entry.note:
            continue
        fn, note = _setup(peer, qkv, spec, causal)
        calls[peer] = _one_step(fn, qkv, backward)
        first = clock.time(calls[peer])
        entry.note = ", ".join(n for n in (note(), f"first call {first:.2f} s") if n)
    times: dict[str, list[float]] = {p: [] for p in calls}
    for _ in range(reps):  # interleaved: one call of each peer per round
        for peer, step in calls.items():
            times[peer].append(clock.time(step))
    for entry in row.entries:
        if entry.peer not in calls:
            continue
        seconds = statistics.median(times[entry.peer])
        entry.ms = seconds * 1e3
        entry.tflops = flops / seconds / 1e12
        entry.of_peak = entry.tflops / gemm_tflops if gemm_tflops > 0 else None
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
) -> CudaResult:
    """Run ``rows`` (default :data:`CUDA_ROWS`) on the GPU; refuses without one."""
    if device == "cuda":
        require_cuda()
    rows = list(CUDA_ROWS if rows is None else rows)
    peers = list(CUDA_PEERS if peers is None else peers)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    result = CudaResult(
        name, torch.__version__, torch.version.cuda, measure_gemm(device, gemm_n), reps
    )
    for i, (wl, L, dtype, mode) in enumerate(rows):
        if progress is not None:
            progress(f"{wl} L={L} {dtype} {mode}", i, len(rows))
        result.rows.append(
            run_row(
                wl, L, dtype, mode,
                peers=peers, reps=reps, gemm_tflops=result.gemm_tflops, cap_gib=cap_gib,
                device=device,
            )
        )  # fmt: skip
    return result


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def to_markdown(result: CudaResult) -> str:
    """The table: one line per row and peer; ``vs sdpa`` / ``vs flex`` are time ratios."""
    lines = [
        f"**GPU:** {result.device}; torch {result.torch} (CUDA {result.cuda}); bf16 GEMM "
        f"{result.gemm_tflops:.0f} TFLOP/s; median of {result.reps} interleaved calls "
        "(CUDA events)",
        "",
        "| row | peer | ms | TFLOP/s | of GEMM | peak MiB | vs sdpa | vs flex | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result.rows:
        label = f"{row.workload} L={row.L} {row.dtype} {row.mode}"
        ms = {e.peer: e.ms for e in row.entries}
        for e in row.entries:
            ratios = [
                "-" if e.ms is None or ms.get(p) is None else f"{e.ms / ms[p]:.2f}"  # type: ignore[operator]
                for p in ("sdpa", "flex")
            ]
            lines.append(
                f"| {label} | {e.peer} | {_fmt(e.ms, '.2f')} | {_fmt(e.tflops, '.1f')} | "
                f"{_fmt(e.of_peak, '.0%')} | {_fmt(e.peak_mib, '.0f')} | {ratios[0]} | "
                f"{ratios[1]} | {e.note} |"
            )
    return "\n".join(lines)


def write_json(result: CudaResult, path: Path) -> None:
    """Write the result as JSON with :func:`attnkit.files.write_text` (a temporary file moved
    into place; a link at ``path`` is replaced, never followed)."""
    text = json.dumps(asdict(result), indent=2)
    files.write_text(path, text, where="attnkit.bench.cuda.write_json", argument="path")
