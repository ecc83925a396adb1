"""The wheel's smoke test (``make wheel-check``; docs/install.md): run by the Python of a fresh
virtualenv into which the wheel was installed, with no C/C++ compiler on ``PATH`` and empty
kernel caches, from outside the source tree. It checks that attnkit's prebuilt kernels load
(nothing is compiled) and run:

* a causal sliding-window call, forward and backward, on the row-span kernel (explain says so,
  and the kernel's own functions ran), matching a float64 reference;
* a bfloat16 call on the row-span kernel (read directly, float32 inside);
* a decode step (1 query against 1024 cached keys) on the decode kernel;

and that the first call came within 5 s of the interpreter's start (CPU time of the process,
threads included: a wall clock on a shared CI machine measures its neighbours; both are
printed). Exits non-zero naming what
failed; prints one line per check.
"""

from __future__ import annotations

import os
import shutil
import sys
import time

T0 = time.perf_counter()

import torch  # noqa: E402

import attnkit  # noqa: E402
from attnkit.backends.blocked import decode, gather_native, native, rowspan_builds  # noqa: E402

COMPILERS = ("cc", "c++", "gcc", "g++", "clang", "clang++")
CALLS: list[str] = []


def count(cls: type, name: str) -> None:
    """Record each call of ``cls.name`` (the kernels' own entry points) in CALLS."""
    real = getattr(cls, name)

    def wrapped(self: object, *args: object) -> object:
        CALLS.append(f"{name} {args[0].dtype}")  # type: ignore[attr-defined]
        return real(self, *args)

    setattr(cls, name, wrapped)


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: int, causal: bool = True
) -> torch.Tensor:
    """A sliding window of ``|i - j| < w`` (end-aligned ``i``; causal: also ``j <= i``) in
    float64, grouped-query heads by repeat."""
    q, k, v = (t.double() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    L, S = q.shape[2], k.shape[2]
    i = torch.arange(L)[:, None] + (S - L)
    j = torch.arange(S)[None]
    allowed = ((j <= i) | (not causal)) & ((i - j).abs() < w)
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ v


def check(ok: bool, what: str) -> None:
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        sys.exit(f"wheel smoke test failed: {what}")


def main() -> None:
    found = [c for c in COMPILERS if shutil.which(c)]
    check(not found, f"no C/C++ compiler on PATH (found: {found or 'none'})")
    check(os.environ.get("CXX") is None, "CXX is unset")
    here = os.path.dirname(attnkit.__file__)
    check("site-packages" in here, f"attnkit is the installed wheel ({here})")
    check(
        torch.__version__.startswith(os.environ.get("EXPECT_TORCH", "")),
        f"torch {torch.__version__}",
    )
    count(native.SpanKernel, "span_forward_finite")
    count(native.SpanKernel, "span_backward")
    count(native.DecodeKernel, "decode_forward")

    torch.manual_seed(0)
    B, H, Hkv, L, D, W = 2, 8, 2, 1024, 64, 256
    q = torch.randn(B, H, L, D, requires_grad=True)
    k = torch.randn(B, Hkv, L, D, requires_grad=True)
    v = torch.randn(B, Hkv, L, D, requires_grad=True)
    mask = attnkit.masks.causal() & attnkit.masks.sliding_window(W)
    out = attnkit.attention(q, k, v, mask=mask)
    first, cpu = time.perf_counter() - T0, time.process_time()
    out.backward(torch.ones_like(out))
    running = rowspan_builds.select(torch.float32)[0]  # the build float32 runs in
    for kernel in (rowspan_builds.BASE.lazy.get(), running and running.lazy.module):  # AVX2 too
        check(
            kernel is not None and kernel.origin == native.PREBUILT,
            f"row-span kernel: {rowspan_builds.status()}; {kernel and kernel.describe()}",
        )
    check(
        cpu < 5.0, f"first call {cpu:.2f} s of CPU ({first:.2f} s wall) from a cold start (< 5 s)"
    )
    text = str(attnkit.explain(q, k, v, mask=mask))
    line = rowspan_builds.status()
    check(line in text, f"explain names the row-span kernel ({line})")
    check(
        CALLS[:2] == ["span_forward_finite torch.float32", "span_backward torch.float32"],
        f"the kernel ran forward and backward ({CALLS})",
    )
    ref = reference(q, k, v, W)
    err = (out.double() - ref).abs().max().item()
    check(err < 1e-4, f"forward matches the float64 reference (max error {err:.1e})")
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    reference(qd, kd, vd, W).sum().backward()
    for name, a, b in (("dq", q.grad, qd.grad), ("dk", k.grad, kd.grad), ("dv", v.grad, vd.grad)):
        assert a is not None
        assert b is not None
        e = (a.double() - b).abs().max().item() / max(1.0, b.abs().max().item())
        check(e < 1e-4, f"{name} matches the float64 reference (relative error {e:.1e})")

    CALLS.clear()  # the example: a two-sided window, no gradient
    two = attnkit.attention(
        q.detach(), k.detach(), v.detach(), mask=attnkit.masks.sliding_window(W)
    )
    e = (two.double() - reference(q, k, v, W, causal=False)).abs().max().item()
    check(
        CALLS == ["span_forward_finite torch.float32"],
        f"a two-sided window on the kernel ({CALLS})",
    )
    check(e < 1e-4, f"the two-sided window matches the float64 reference ({e:.1e})")

    CALLS.clear()
    qb, kb, vb = (t.detach().bfloat16() for t in (q, k, v))
    ob = attnkit.attention(qb, kb, vb, mask=mask)
    check(
        "span_forward_finite torch.bfloat16" in CALLS,
        f"bfloat16 ran on the row-span kernel ({CALLS})",
    )
    e = (ob.double() - reference(qb, kb, vb, W)).abs().max().item()
    check(ob.dtype == torch.bfloat16 and e < 2e-2, f"bfloat16 matches the reference ({e:.1e})")

    CALLS.clear()
    qs, ks, vs = torch.randn(1, 8, 1, 64), torch.randn(1, 2, 1024, 64), torch.randn(1, 2, 1024, 64)
    od = attnkit.attention(qs, ks, vs, mask=attnkit.masks.causal())
    check(CALLS == ["decode_forward torch.float32"], f"decode: {decode.status()} ({CALLS})")
    dec = decode.build()
    check(
        dec is not None and dec.origin == native.PREBUILT, f"decode kernel {dec and dec.describe()}"
    )
    e = (od.double() - reference(qs, ks, vs, 10**9)).abs().max().item()
    check(e < 1e-4, f"decode matches the float64 reference ({e:.1e})")
    # the gather kernel (masks.selected_keys: each query's own k keys), prebuilt too
    idx = torch.randint(0, 1024, (1, 1, 16), generator=torch.Generator().manual_seed(0))
    og = attnkit.attention(qs, ks, vs, mask=attnkit.masks.selected_keys(idx))
    gat = gather_native.kernel()
    check(
        gat is not None and gat.origin == native.PREBUILT, f"gather kernel {gat and gat.describe()}"
    )
    chosen = torch.zeros(1, 1, 1, 1024, dtype=torch.bool).scatter_(-1, idx[:, None], True)
    kr, vr = (t.double().repeat_interleave(4, 1) for t in (ks, vs))  # (B, H, S, D)
    s = (qs.double() @ kr.transpose(-1, -2)) * 64**-0.5
    want = torch.softmax(s.masked_fill(~chosen, float("-inf")), -1) @ vr
    e = (og.double() - want).abs().max().item()
    check(e < 1e-4, f"gather matches the float64 reference ({e:.1e})")
    cache = os.environ.get("ATTNKIT_KERNEL_CACHE")
    check(
        cache is None or not os.path.exists(cache) or not os.listdir(cache),
        "nothing was compiled (the kernel cache is empty)",
    )
    print(f"wheel smoke test passed: torch {torch.__version__}, {time.perf_counter() - T0:.1f} s")


if __name__ == "__main__":
    main()
