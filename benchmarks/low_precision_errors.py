"""bfloat16 and float16 error against float64: attnkit's math, sdpa and blocked backends, and
torch's SDPA, on the cases where low precision goes wrong.

Every figure is ``max |got - want|`` over all entries, where ``want`` is float64 attention
computed from the *same* bfloat16/float16 inputs (so the inputs' own rounding is no error), of
the output, the weights (``return_weights=True``: only ``math`` returns them) and the gradients
dq, dk, dv of a random cotangent. The baseline is torch's SDPA on the same tensors:
``F.scaled_dot_product_attention`` (its CPU flash kernel) for the output and the gradients, and
``torch.ops.aten._scaled_dot_product_attention_math`` (torch's math SDPA, the only one that
returns weights) for the weights. Each backend's cell is its error and, in brackets, its error
over the baseline's (``x`` <= 2 is the bound of issue 34), left out where the baseline is exact
but for float32's rounding (:func:`noise`: one-hot rows, values averaged exactly); ``NaN``
where a result holds one.

Cases (B=1, H=4 query heads over Hkv=2 key/value heads, L=S=128, D=64; :data:`CASES`):

* ``causal``: ``randn`` q, k, v, ``causal=True``;
* ``large logits``: q and k scaled by 4 (logits of standard deviation 16, |qk| * scale up to
  about 50);
* ``big scale``: ``scale=1e4`` (float16's largest value is 65504: q @ k^T * scale overflows it);
* ``K/V expanded over S``: one key and one value per head, ``expand``-ed to S (stride 0),
  causal (query i weighs its i + 1 keys 1 / (i + 1) each; dq and dk are 0 but for rounding);
* ``K/V strided``: K and V as views of a (B, 2S, Hkv, D) cache, the layout of transformers'
  caches (``cache[:, :S].transpose(1, 2)``), with q and k scaled by 2.

The CPU flags that decide which kernels run (avx2, fma, avx512f, avx512_bf16, avx512_fp16, amx_*)
are read from /proc/cpuinfo and printed with the table, as is the CPU path
(:mod:`attnkit.cpu`) each dtype took.

    python benchmarks/low_precision_errors.py [--paths auto,torch] [--threads 2]

``--paths``: the ``ATTNKIT_CPU_PATH`` values to measure under (``auto``: this CPU's choice);
a path this CPU cannot run is reported and skipped. tests/backends/test_low_precision_math.py
asserts the bound on these cases (:func:`make_case`, :func:`oracle`, :func:`attnkit_run`,
:func:`sdpa_run`).
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import attnkit
from attnkit import cpu
from attnkit.bench.machine import cpu_line

B, H, Hkv, L, S, D = 1, 4, 2, 128, 128, 64
BACKENDS = ("math", "sdpa", "blocked")
DTYPES = (torch.bfloat16, torch.float16)
QUANTITIES = ("out", "weights", "dq", "dk", "dv")
Views = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]


@dataclass(frozen=True)
class Case:
    """One call: the leaves (low dtype), the views the call takes of them, and the rest."""

    leaves: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    views: Views
    dout: torch.Tensor  # (B, H, L, D), the cotangent of the output
    causal: bool = False
    scale: float | None = None

    def tensors(self, dtype: torch.dtype, grad: bool) -> tuple[torch.Tensor, ...]:
        """q, k, v as the call takes them, from the leaves converted to ``dtype``; with
        ``grad`` the leaves require it (the views then carry their gradients)."""
        leaves = [t.detach().to(dtype).requires_grad_(grad) for t in self.leaves]
        return self.views(*leaves)


def _plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return q, k, v


def _over_s(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return q, k.expand(B, Hkv, S, D), v.expand(B, Hkv, S, D)


def _cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return q, k[:, :S].transpose(1, 2), v[:, :S].transpose(1, 2)


def make_case(name: str, dtype: torch.dtype, seed: int = 0) -> Case:
    """The case ``name`` (a key of :data:`CASES`) with inputs rounded to ``dtype``."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int, times: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * times).to(dtype)

    dout = randn(B, H, L, D)
    q_times, k_times, causal, scale = CASES[name]
    if name == "K/V expanded over S":
        kv: tuple[int, ...] = (B, Hkv, 1, D)
        views: Views = _over_s
    elif name == "K/V strided":
        kv, views = (B, 2 * S, Hkv, D), _cache
    else:
        kv, views = (B, Hkv, S, D), _plain
    q = randn(B, H, L, D, times=q_times)
    leaves = (q, randn(*kv, times=k_times), randn(*kv))
    return Case(leaves, views, dout, causal, scale)


#: name: (q times, k times, causal, scale; None: 1/sqrt(D))
CASES: dict[str, tuple[float, float, bool, float | None]] = {
    "causal": (1.0, 1.0, True, None),
    "large logits": (4.0, 4.0, False, None),
    "big scale": (1.0, 1.0, False, 1e4),
    "K/V expanded over S": (4.0, 4.0, True, None),
    "K/V strided": (2.0, 2.0, True, None),
}


@dataclass(frozen=True)
class Result:
    """What a run gave: the output, the weights (or ``None``) and dq, dk, dv."""

    out: torch.Tensor
    weights: torch.Tensor | None
    grads: tuple[torch.Tensor, ...]

    def get(self, quantity: str) -> torch.Tensor | None:
        if quantity in ("dq", "dk", "dv"):
            return self.grads["qkv".index(quantity[1])]
        return self.out if quantity == "out" else self.weights


def scale_of(case: Case) -> float:
    return 1.0 / math.sqrt(D) if case.scale is None else case.scale


def oracle(case: Case) -> Result:
    """float64 attention from the case's low-precision inputs, written out: K/V repeated for
    the grouped heads, the end-aligned causal rule, softmax, and autograd's gradients."""
    q, k, v = (t.double().detach().requires_grad_(True) for t in case.tensors(torch.float64, False))
    kr, vr = (t.repeat_interleave(H // Hkv, dim=1) for t in (k, v))
    scores = q @ kr.transpose(-2, -1) * scale_of(case)  # (B, H, L, S)
    if case.causal:
        allowed = torch.ones(L, S, dtype=torch.bool).tril(S - L)
        scores = scores.masked_fill(~allowed, -math.inf)
    weights = scores.softmax(dim=-1)
    out = weights @ vr
    grads = torch.autograd.grad(out, (q, k, v), case.dout.double())
    return Result(out.detach(), weights.detach(), grads)


def _grads(
    out: torch.Tensor, qkv: tuple[torch.Tensor, ...], dout: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(out, qkv, dout)


def attnkit_run(case: Case, backend: str) -> Result:
    """``attnkit.attention`` on the case with ``backend``; ``math`` returns the weights."""
    dtype = case.dout.dtype
    q, k, v = case.tensors(dtype, True)
    weights = None
    if backend == "math":
        out, weights = attnkit.attention(
            q, k, v, causal=case.causal, scale=case.scale, backend=backend, return_weights=True
        )
    else:
        out = attnkit.attention(q, k, v, causal=case.causal, scale=case.scale, backend=backend)
    grads = _grads(out, (q, k, v), case.dout)
    return Result(out.detach(), None if weights is None else weights.detach(), grads)


def sdpa_run(case: Case) -> Result:
    """torch's SDPA on the case: the fused kernel for the output and gradients, torch's math
    SDPA for the weights."""
    q, k, v = case.tensors(case.dout.dtype, True)
    out = F.scaled_dot_product_attention(
        q, k, v, is_causal=case.causal, scale=case.scale, enable_gqa=True
    )
    grads = _grads(out, (q, k, v), case.dout)
    with torch.no_grad():
        math_sdpa = torch.ops.aten._scaled_dot_product_attention_math
        weights = math_sdpa(q, k, v, scale=case.scale, is_causal=case.causal, enable_gqa=True)[1]
    return Result(out.detach(), weights, grads)


def max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max |got - want|`` in float64; NaN where ``got`` holds a NaN or an inf."""
    diff = (got.double() - want).abs()
    return math.nan if not diff.isfinite().all() else diff.max().item()


def noise(want: torch.Tensor) -> float:
    """float32's unit in the last place at the largest value of ``want``: an error below it is
    exact but for float32's (or float64's) own rounding, and a ratio to it measures noise."""
    return torch.finfo(torch.float32).eps * want.abs().max().item()


@contextmanager
def cpu_path(path: str) -> Iterator[None]:
    """``ATTNKIT_CPU_PATH=path`` inside (unset for ``auto``), as it was after."""
    old = os.environ.pop(cpu.ENV, None)
    if path != "auto":
        os.environ[cpu.ENV] = path
    try:
        yield
    finally:
        os.environ.pop(cpu.ENV, None)
        if old is not None:
            os.environ[cpu.ENV] = old


def _cell(err: float, base: float, tiny: float) -> str:
    """``err``, and its ratio to SDPA's ``base`` where that is at least ``tiny``
    (:func:`noise`)."""
    if math.isnan(err):
        return "NaN"
    if math.isnan(base) or base < tiny:
        return f"{err:.2g}"
    return f"{err:.2g} ({err / base:.2f}x)"


def measure(case_name: str, dtype: torch.dtype) -> Iterator[list[str]]:
    """The table's rows of one case and dtype: one per quantity, SDPA then each backend."""
    case = make_case(case_name, dtype)
    want = oracle(case)
    base = sdpa_run(case)
    runs = {b: attnkit_run(case, b) for b in BACKENDS}
    for quantity in QUANTITIES:
        ref, sdpa = want.get(quantity), base.get(quantity)
        assert ref is not None
        assert sdpa is not None
        base_err, tiny = max_error(sdpa, ref), noise(ref)
        cells = []
        for b in BACKENDS:
            got = runs[b].get(quantity)
            cells.append("-" if got is None else _cell(max_error(got, ref), base_err, tiny))
        yield [case_name, quantity, _cell(base_err, math.nan, tiny), *cells]


def table(paths: list[str]) -> Iterator[str]:
    """The markdown lines: for each path and dtype, a heading and the rows of every case."""
    header = ["case", "quantity", "torch SDPA", *(f"attnkit {b}" for b in BACKENDS)]
    for path in paths:
        for dtype in DTYPES:
            why = None if path == "auto" else cpu.unavailable(path, dtype)
            name = str(dtype).removeprefix("torch.")
            if why is not None:
                yield f"\n{name}, path {path}: skipped ({why})"
                continue
            with cpu_path(path):
                took = cpu.path_for(torch.zeros(1, dtype=dtype), "low_precision_errors")
                yield f"\n{name}, ATTNKIT_CPU_PATH={path} (the path taken: {took})\n"
                yield "| " + " | ".join(header) + " |"
                yield "|" + "---|" * len(header)
                for case_name in CASES:
                    for row in measure(case_name, dtype):
                        yield "| " + " | ".join(row) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--paths", default="auto", help="ATTNKIT_CPU_PATH values, comma-separated")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_line())  # the CPU and its flags: every figure below depends on them
    print(
        f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, "
        f"{args.threads} threads; B={B} H={H} Hkv={Hkv} L={L} S={S} D={D}"
    )
    for line in table(args.paths.split(",")):
        print(line)


if __name__ == "__main__":
    main()
