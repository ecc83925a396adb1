"""Shape tracing: ``with attnkit.trace() as t: ...`` records every step of each attention call.

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
Dk query/key head dim, Dv value head dim, E model width (Ek, Ev: key and value input widths).

While a trace is active, :func:`attnkit.attention` records its inputs, the scores and weights
(shapes; a fused backend never materialises them, and the trace says so), its output and the
backend that ran; the attention modules add their inputs, projections, split heads, merge and
output projection. ``print(t)`` renders the table, as seed 004 prints it by hand. With no trace
active the hooks are one check of an empty list: nothing is recorded and nothing is computed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["Trace", "TraceStep", "active_trace", "trace"]

_ACTIVE: list[Trace] = []


@dataclass(frozen=True)
class TraceStep:
    """One recorded step: which call, where, what, and the shape with its dim names."""

    call: int  # 1-based number of the attention call or module call this step belongs to
    where: str  # "attention" or the module's name
    step: str  # "input", "q_proj", "split_heads", "scores", "weights", "output", ...
    tensor: str  # "q", "k", "v", "query", ...
    dims: tuple[str, ...]
    shape: tuple[int, ...]
    note: str = ""

    @property
    def named_shape(self) -> str:
        """``(B=2, H=8, L=6, Dk=64)``."""
        return "(" + ", ".join(f"{d}={s}" for d, s in zip(self.dims, self.shape, strict=True)) + ")"


@dataclass
class Trace:
    """The steps recorded while the trace was active, in order. ``print(t)`` shows them."""

    names: dict[int, str] = field(default_factory=dict)  # id(module) -> qualified name
    steps: list[TraceStep] = field(default_factory=list)
    n_calls: int = 0
    current: int | None = None  # the module call in progress, which attention calls join

    def add(
        self,
        call: int,
        where: str,
        step: str,
        tensor: str,
        dims: Sequence[str],
        shape: Sequence[int],
        note: str = "",
    ) -> None:
        self.steps.append(TraceStep(call, where, step, tensor, tuple(dims), tuple(shape), note))

    @property
    def backends(self) -> list[str]:
        """The backend of each attention call, in order."""
        return [s.note.removeprefix("backend=") for s in self.steps if s.step == "output"]

    def render(self, call: int | None = None) -> str:
        """The table of all calls, or of call number ``call`` (1-based)."""
        steps = [s for s in self.steps if call is None or s.call == call]
        if not steps:
            return "(no attention call was traced)"
        rows = [("#", "where", "step", "tensor", "shape (named dims)", "note")]
        rows += [(str(s.call), s.where, s.step, s.tensor, s.named_shape, s.note) for s in steps]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = []
        for i, r in enumerate(rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()


def active_trace() -> Trace | None:
    """The innermost active trace, or None (the hooks' one check)."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextmanager
def trace(model: nn.Module | None = None) -> Iterator[Trace]:
    """Record the shapes of every attention step inside the ``with`` block.

    Args:
        model: optional; its submodules are then named by their qualified names
            (``encoder.layers.0.attn``) instead of their class names.

    >>> import attnkit
    >>> mha = attnkit.MultiHeadAttention(16, 4)
    >>> with attnkit.trace() as t:
    ...     _ = mha(torch.randn(2, 5, 16))
    >>> [s.step for s in t.steps][:4]
    ['input', 'input', 'input', 'q_proj']
    >>> t.backends
    ['sdpa']
    """
    names = {id(m): n or type(m).__name__ for n, m in model.named_modules()} if model else {}
    t = Trace(names=names)
    _ACTIVE.append(t)
    try:
        yield t
    finally:
        _ACTIVE.remove(t)


def record_attention(
    t: Trace,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    backend: str,
    fused: bool,
) -> None:
    """Called by :func:`attnkit.attention` after it ran, when a trace is active."""
    if t.current is None:
        t.n_calls += 1
    call = t.current or t.n_calls
    B, H, L, _ = q.shape
    S = k.shape[2]
    skipped = "fused kernel: never materialised" if fused else ""
    for step, name, dims, shape, note in (
        ("attention", "q", ("B", "H", "L", "Dk"), q.shape, ""),
        ("attention", "k", ("B", "Hkv", "S", "Dk"), k.shape, ""),
        ("attention", "v", ("B", "Hkv", "S", "Dv"), v.shape, ""),
        ("scores", "q @ k^T * scale", ("B", "H", "L", "S"), (B, H, L, S), skipped),
        ("weights", "softmax(scores)", ("B", "H", "L", "S"), (B, H, L, S), skipped),
        ("output", "weights @ v", ("B", "H", "L", "Dv"), out.shape, f"backend={backend}"),
    ):
        t.add(call, "attention", step, name, dims, shape, note)


def record_module_start(
    t: Trace,
    module: nn.Module,
    inputs: Sequence[tuple[str, torch.Tensor]],
    projected: Sequence[tuple[str, torch.Tensor]],
    split: Sequence[tuple[str, torch.Tensor]],
    *,
    seq_first: bool = False,
) -> None:
    """Called by the attention modules before attention: inputs (as the caller passed them:
    ``(L, B, E)`` with ``seq_first``), projections, split heads."""
    t.n_calls += 1
    t.current = t.n_calls
    where = t.names.get(id(module), type(module).__name__)
    input_dims = {"query": ("B", "L", "E"), "key": ("B", "S", "Ek"), "value": ("B", "S", "Ev")}
    if seq_first:  # nn.MultiheadAttention's layout; the module works batch-first inside
        input_dims = {n: (d[1], d[0], d[2]) for n, d in input_dims.items()}
    for name, x in inputs:
        t.add(t.current, where, "input", name, input_dims[name], x.shape)
    proj_dims = {"q": ("B", "L", "H*Dk"), "k": ("B", "S", "Hkv*Dk"), "v": ("B", "S", "Hkv*Dv")}
    for name, x in projected:
        t.add(t.current, where, f"{name}_proj", name, proj_dims[name], x.shape)
    split_dims = {
        "q": ("B", "H", "L", "Dk"),
        "k": ("B", "Hkv", "S", "Dk"),
        "v": ("B", "Hkv", "S", "Dv"),
    }
    for name, x in split:
        t.add(t.current, where, "split_heads", name, split_dims[name], x.shape)


def record_module_end(
    t: Trace,
    module: nn.Module,
    merged: torch.Tensor,
    out: torch.Tensor,
    projected: bool,
    *,
    returned: torch.Tensor | None = None,
) -> None:
    """Called by the attention modules after attention: merge heads, output projection, and
    the output as returned where it differs (``(L, B, E)`` for a ``batch_first=False``
    module)."""
    call = t.current if t.current is not None else t.n_calls
    where = t.names.get(id(module), type(module).__name__)
    t.add(call, where, "merge_heads", "out", ("B", "L", "H*Dv"), merged.shape)
    if projected:
        t.add(call, where, "out_proj", "out", ("B", "L", "E"), out.shape)
    if returned is not None:
        t.add(call, where, "transpose(0, 1)", "out", ("L", "B", "E"), returned.shape)
    t.current = None
