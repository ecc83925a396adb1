"""Shape tracing: ``with attnkit.trace() as t: ...`` records every step of each attention call.

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
Dk query/key head dim, Dv value head dim, E model width (Ek, Ev: key and value input widths).

While a trace is active, :func:`attnkit.attention` records its inputs, the scores and weights
(shapes; a fused backend never materialises them, and the trace says so), its output and the
backend that ran; the attention modules add their inputs, projections, split heads, merge and
output projection. ``print(t)`` renders the table of every step and its shape.

Whose calls a trace records: those made in the context that entered it, as
:mod:`contextvars` defines contexts. That is the thread that entered the ``with`` block, and
the asyncio tasks it creates inside the block (a task runs in a copy of its creator's
context); never another thread's calls, whether or not that thread traces too. A thread
started inside the block starts in an empty context, as Python threads do, so its calls are
not recorded; run its work in ``contextvars.copy_context().run`` (``asyncio.to_thread`` does)
to record them. Nested traces all record: a call inside both blocks is in both, numbered in
each.

Under ``torch.compile`` (``fullgraph=True`` and inductor included) a call records the same
steps, into the traces of the thread that runs it: while a trace is open in any thread, the
compiled graph holds the recorders as custom ops with an ordered side effect, which run when
the graph runs (dynamo cannot read a context variable); once no trace is open, the graph
without them runs again.

With no trace open in any thread the hooks are one check of a module flag (``torch.compile``
guards on it, so a compiled graph holds no trace code): nothing is recorded or computed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

__all__ = ["Trace", "TraceStep", "active_trace", "trace"]

#: the traces open in this context, outermost first (each thread and task sees its own)
_ACTIVE: ContextVar[tuple[Trace, ...]] = ContextVar("attnkit_traces", default=())
#: the module call in progress in this context, per trace: ``((trace, call number), ...)``
_MODULE_CALLS: ContextVar[tuple[tuple[Trace, int], ...]] = ContextVar(
    "attnkit_trace_module_calls", default=()
)
_OPEN_LOCK = threading.Lock()
_OPEN = 0  # traces open in any context
#: whether any trace is open anywhere: the hooks' one check. A plain module global, so that
#: ``torch.compile`` guards on it (it cannot read a context variable) and a compiled model
#: with no trace open has no trace code in its graph.
ANY_OPEN = False


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


@dataclass(eq=False)
class Trace:
    """The steps recorded while the trace was active, in order. ``print(t)`` shows them."""

    names: dict[int, str] = field(default_factory=dict)  # id(module) -> qualified name
    steps: list[TraceStep] = field(default_factory=list)
    n_calls: int = 0
    # steps may come from several threads: those that run in a copy of the tracing context
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    @property
    def current(self) -> int | None:
        """The module call in progress in the calling context, which attention calls join."""
        return next((n for t, n in _MODULE_CALLS.get() if t is self), None)

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
        with self._lock:
            self.steps.append(TraceStep(call, where, step, tensor, tuple(dims), tuple(shape), note))

    def _new_call(self) -> int:
        with self._lock:
            self.n_calls += 1
            return self.n_calls

    @property
    def backends(self) -> list[str]:
        """The backend of each attention call, in order."""
        return [s.note.removeprefix("backend=") for s in self.steps if s.step == "output"]

    def render(self, call: int | None = None) -> str:
        """The table of all calls, or of call number ``call`` (1-based)."""
        # by call (a stable sort: a call's steps stay in order), as calls from threads that
        # share the trace may interleave
        steps = sorted((s for s in self.steps if call in (None, s.call)), key=lambda s: s.call)
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
    """The innermost trace open in the calling thread (or asyncio task), or None.

    Not for code that ``torch.compile`` traces: it reads a context variable."""
    active = _ACTIVE.get()
    return active[-1] if active else None


def _opened(change: int) -> None:
    global _OPEN, ANY_OPEN
    with _OPEN_LOCK:
        _OPEN += change
        ANY_OPEN = _OPEN > 0


@contextmanager
def trace(model: nn.Module | None = None) -> Iterator[Trace]:
    """Record the shapes of every attention step inside the ``with`` block.

    Only the calls made by this thread (and the asyncio tasks it starts in the block) are
    recorded, and every trace open in this thread records them (see the module docstring).

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
    _ACTIVE.set((*_ACTIVE.get(), t))
    _opened(+1)
    try:
        yield t
    finally:
        _opened(-1)
        _ACTIVE.set(tuple(u for u in _ACTIVE.get() if u is not t))
        _MODULE_CALLS.set(tuple(c for c in _MODULE_CALLS.get() if c[0] is not t))


def _call_number(t: Trace) -> int:
    """The module call in progress in this context, or a new call."""
    current = t.current
    return current if current is not None else t._new_call()


def recording() -> bool:
    """Whether any trace is open, in any thread: the hooks' one check, before they call the
    recorders below (which record into the calling context's traces only).

    ``torch.compile`` guards on the flag, so a compiled model with no trace open has no trace
    code in its graph. With a trace open, a compiled graph calls the recorders as custom ops
    with an ordered side effect (``attnkit::trace_*``): opaque to the compiler, never dropped
    or reordered, run when the graph runs, in the context that runs it (dynamo cannot read a
    context variable, and a recording traced into a graph would be the compiling thread's)."""
    return ANY_OPEN


def record_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    backend: str,
    fused: bool,
) -> None:
    """Called by :func:`attnkit.attention` after it ran: into every trace of this context."""
    if torch.compiler.is_compiling():
        torch.ops.attnkit.trace_attention(q, k, v, out, backend, fused)
    else:
        _attention(q, k, v, out, backend, fused)


def record_module_start(
    module: nn.Module,
    seq_first: bool,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    q_proj: torch.Tensor,
    k_proj: torch.Tensor,
    v_proj: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Called by the attention modules before attention: inputs (as the caller passed them:
    ``(L, B, E)`` with ``seq_first``), projections, split heads; this opens a module call in
    every trace of this context, which the attention call joins."""
    args = (id(module), type(module).__name__, seq_first, query, key, value)
    if torch.compiler.is_compiling():
        torch.ops.attnkit.trace_module_start(*args, q_proj, k_proj, v_proj, q, k, v)
    else:
        _module_start(*args, q_proj, k_proj, v_proj, q, k, v)


def record_module_end(
    module: nn.Module,
    merged: torch.Tensor,
    out: torch.Tensor,
    projected: bool,
    returned: torch.Tensor | None = None,
) -> None:
    """Called by the attention modules after attention: merge heads, output projection, and
    the output as returned where it differs (``(L, B, E)`` for a ``batch_first=False``
    module). This closes the module call."""
    args = (id(module), type(module).__name__, merged, out, projected, returned)
    if torch.compiler.is_compiling():
        torch.ops.attnkit.trace_module_end(*args)
    else:
        _module_end(*args)


def record_module_abort() -> None:
    """Called by the attention modules when their call raised: later calls in this context's
    traces are not that module's."""
    _MODULE_CALLS.set(())


# the recorders' bodies, run eagerly (compiled graphs run them through the ops below)


def _attention(q: Tensor, k: Tensor, v: Tensor, out: Tensor, backend: str, fused: bool) -> None:
    B, H, L, _ = q.shape
    S = k.shape[2]
    skipped = "fused kernel: never materialised" if fused else ""
    for t in _ACTIVE.get():
        call = _call_number(t)
        for step, name, dims, shape, note in (
            ("attention", "q", ("B", "H", "L", "Dk"), q.shape, ""),
            ("attention", "k", ("B", "Hkv", "S", "Dk"), k.shape, ""),
            ("attention", "v", ("B", "Hkv", "S", "Dv"), v.shape, ""),
            ("scores", "q @ k^T * scale", ("B", "H", "L", "S"), (B, H, L, S), skipped),
            ("weights", "softmax(scores)", ("B", "H", "L", "S"), (B, H, L, S), skipped),
            ("output", "weights @ v", ("B", "H", "L", "Dv"), out.shape, f"backend={backend}"),
        ):
            t.add(call, "attention", step, name, dims, shape, note)


def _module_start(
    module_id: int, module_type: str, seq_first: bool, *tensors: torch.Tensor
) -> None:
    """``tensors``: query, key, value, q_proj, k_proj, v_proj, q, k, v, as
    :func:`record_module_start` takes them."""
    query, key, value, q_proj, k_proj, v_proj, q, k, v = tensors
    input_dims = {"query": ("B", "L", "E"), "key": ("B", "S", "Ek"), "value": ("B", "S", "Ev")}
    if seq_first:  # nn.MultiheadAttention's layout; the module works batch-first inside
        input_dims = {n: (d[1], d[0], d[2]) for n, d in input_dims.items()}
    proj_dims = {"q": ("B", "L", "H*Dk"), "k": ("B", "S", "Hkv*Dk"), "v": ("B", "S", "Hkv*Dv")}
    split_dims = {
        "q": ("B", "H", "L", "Dk"),
        "k": ("B", "Hkv", "S", "Dk"),
        "v": ("B", "Hkv", "S", "Dv"),
    }
    opened = []
    for t in _ACTIVE.get():
        call = t._new_call()
        opened.append((t, call))
        where = t.names.get(module_id, module_type)
        for name, x in (("query", query), ("key", key), ("value", value)):
            t.add(call, where, "input", name, input_dims[name], x.shape)
        for name, x in (("q", q_proj), ("k", k_proj), ("v", v_proj)):
            t.add(call, where, f"{name}_proj", name, proj_dims[name], x.shape)
        for name, x in (("q", q), ("k", k), ("v", v)):
            t.add(call, where, "split_heads", name, split_dims[name], x.shape)
    _MODULE_CALLS.set(tuple(opened))


def _module_end(
    module_id: int,
    module_type: str,
    merged: torch.Tensor,
    out: torch.Tensor,
    projected: bool,
    returned: torch.Tensor | None,
) -> None:
    for t in _ACTIVE.get():
        current = t.current
        call = current if current is not None else t.n_calls
        where = t.names.get(module_id, module_type)
        t.add(call, where, "merge_heads", "out", ("B", "L", "H*Dv"), merged.shape)
        if projected:
            t.add(call, where, "out_proj", "out", ("B", "L", "E"), out.shape)
        if returned is not None:
            t.add(call, where, "transpose(0, 1)", "out", ("L", "B", "E"), returned.shape)
    _MODULE_CALLS.set(())


def _nothing(*args: object) -> None:
    """The recorder ops' fake form (shapes only): they return nothing."""


def _ordered(op: str) -> None:
    """Mark a recorder op as having an ordered side effect, so that no compiler pass drops it
    (it returns nothing) or moves it past another (a module's steps come in order)."""
    try:
        from torch._library.effects import EffectType

        torch.library._register_effectful_op(op, EffectType.ORDERED)
    except (ImportError, AttributeError):  # torch before 2.13
        from torch._higher_order_ops.effects import _EffectType, _register_effectful_op

        overload = getattr(torch.ops.attnkit, op.removeprefix("attnkit::")).default
        _register_effectful_op(overload, _EffectType.ORDERED)


_TENSORS = "Tensor query, Tensor key, Tensor value, Tensor q_proj, Tensor k_proj, Tensor v_proj"
for _name, _body, _schema in (
    ("trace_attention", _attention, "Tensor q, Tensor k, Tensor v, Tensor out, str backend, "
     "bool fused"),
    ("trace_module_start", _module_start, "int module_id, str module_type, bool seq_first, "
     f"{_TENSORS}, Tensor q, Tensor k, Tensor v"),
    ("trace_module_end", _module_end, "int module_id, str module_type, Tensor merged, "
     "Tensor out, bool projected, Tensor? returned"),
):  # fmt: skip
    _op = torch.library.custom_op(
        f"attnkit::{_name}", _body, mutates_args=(), schema=f"({_schema}) -> ()"
    )
    _op.register_fake(_nothing)
    _ordered(f"attnkit::{_name}")
