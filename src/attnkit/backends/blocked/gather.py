"""The gather kernel of the ``blocked`` backend: attention over each query's own selected keys
(:func:`attnkit.masks.selected_keys`, DeepSeek-V3.2's sparse attention), O(L·k·D) work and
memory, never ``L x S``.

Dimension legend: B batch, H query heads, Hkv key/value heads, g = H // Hkv, L query length,
S key length, k keys selected per query, Dk / Dv head dims.

Two paths, one plan (:class:`GatherPlan`, a :class:`~attnkit.backends.blocked.kernels.
KernelPlan`). Where q, k, v are float32 on the CPU, or bfloat16/float16 of a whole call, and
the C++ build loads (:mod:`~attnkit.backends.blocked.gather_native`, ``csrc/gather.cpp``), the
forward and the backward run there: the selected K and V rows read in place (bfloat16 and
float16 widened to float32 as they are loaded, results in their dtype: :attr:`GatherPlan.reads`;
a build without F16C takes float32 copies of float16), one task per (batch row, key/value head,
query row) forward and per (batch row, key/value head, slice of query rows) backward (each
slice adds into float32 dK/dV rows of its own, summed after); the forward reports NaN/inf
itself. For the other dtypes and devices and where the build does not load, the same in torch
operations, in chunks of query rows (:mod:`~attnkit.backends.blocked.gather_torch`). The other
rules of the spec are applied to the selected (query, key) pairs only (their predicate,
evaluated at ``(b, h, q, indices)``), and the softmax is kept in float32 (float64 for float64
q). A key listed twice in a row counts once (eager's scatter into a bool mask): the torch
operations drop duplicates and ``-1`` entries once per plan, from the indices alone
(:attr:`GatherPlan.keep`: a sort of each row); the C++ kernel drops them as it reads each row (a
bit per key, set and cleared per row; no sort). A row left with no key gives output 0,
log-sum-exp ``-inf`` and gradient 0. Soft-capped calls are not served here (the tiles run
them).

:func:`block_plan` plans one block of a longer sequence (ring attention's pairs of chunks): the
block's rows of the indices, its keys' entries counted from its first key (the others ``-1``),
the other rules at global positions (``q_start``, ``k_start``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from attnkit.backends import nonfinite
from attnkit.backends.blocked import gather_torch
from attnkit.masks import MaskSpec
from attnkit.masks.selected import SelectedKeys, find_selected
from attnkit.masks.spec import _And, _HeadSlice

if TYPE_CHECKING:
    from attnkit.call import AttentionCall

__all__ = ["GatherPlan", "backward", "block_plan", "describe", "forward", "plan"]

#: the dtypes the C++ kernel serves: float32, and bfloat16 and float16 read in place on every
#: CPU path where a whole call runs (:attr:`GatherPlan.reads`; results in their dtype), else
#: on float32 copies of q, k, v (:meth:`GatherPlan.needs_float32`: the blocked backend makes
#: them, O((L + S) D) bytes, never the gathered ``(L, k, D)``)
NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LOW = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class GatherPlan:
    """The gather kernel's plan of one call (a :class:`~attnkit.backends.blocked.kernels.
    KernelPlan`): the selected keys and the spec's other rules (``None``: none)."""

    selected: SelectedKeys
    rest: MaskSpec | None
    off: int
    #: the C++ kernel runs the call (a dtype of :data:`NATIVE_DTYPES` on the CPU, loaded, no
    #: score bias)
    native: bool = False
    #: the global positions of the first query and the first key where the call is one block
    #: of a longer sequence (:func:`block_plan`; the indices are then local to the block)
    q_start: int = 0
    k_start: int = 0
    #: the dtypes the C++ kernel reads q, k, v in, in place (where ``native``): float32, and
    #: for a whole call bfloat16 and float16 (float16 where the build has F16C), its results in
    #: their dtype; a block of a longer sequence (:func:`block_plan`, whose caller merges the
    #: blocks in float32) float32 only
    reads: tuple[torch.dtype, ...] = ()

    #: the kernel in explain's words
    name = "the gather kernel"

    @functools.cached_property
    def keep(self) -> torch.Tensor:
        """``(B, Hkv', L, k)`` bool: the index entries that name a key once (the torch
        operations read it; the C++ kernel drops ``-1`` and repeated entries itself, so a native
        call never sorts the indices)."""
        return _first(self.selected.ind)

    @property
    def checks_finite(self) -> bool:
        """The C++ forward reports NaN/inf itself (a query, a score of an allowed pair, an
        output); the torch operations do not (the dispatcher's rule sums first)."""
        return self.native

    #: what runs a compiled call (the custom op plans it again when it runs: this kernel)
    under_compile = (
        "under torch.compile the same kernel, forward and backward, inside one custom op "
        "(attnkit::blocked_attention)"
    )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`forward` of this plan."""
        return forward(self, q, k, v, scale)

    def backward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        dout: torch.Tensor,
        lse: torch.Tensor,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:func:`backward` of this plan."""
        return backward(self, q, k, v, out, dout, lse, scale)

    def describe(self, call: AttentionCall, dtype: torch.dtype) -> str:
        """:func:`describe` of this plan."""
        return describe(self, call.dims.L, call.dims.S, dtype)

    def reads_note(self, dtype: torch.dtype, upcast: bool) -> str | None:
        """``""`` where the C++ kernel reads a low-precision q, k, v in place on
        ``fp32-upcast`` (:meth:`describe` says so); where it takes float32 copies on a path
        that gives the other kernels them as they are (``native``), says so; else ``None``."""
        if self.native and dtype in _LOW and dtype in self.reads:
            return "" if upcast else None  # (native: as that path gives every kernel)
        if upcast or not self.needs_float32(dtype):
            return None
        name = str(dtype).removeprefix("torch.")
        return f"the gather kernel's C++ runs on float32 copies of the {name} q, k, v; "

    def needs_float32(self, dtype: torch.dtype) -> bool:
        """Where the C++ kernel runs it and does not read bfloat16/float16 ``dtype`` in place
        (:attr:`reads`): it runs on float32 copies."""
        return self.native and dtype in _LOW and dtype not in self.reads

    def direct(self, call: AttentionCall) -> None:
        """None: it has no entry bound to a signature (every call goes the whole way)."""
        return None


def _without(spec: MaskSpec) -> MaskSpec | bool | None:
    """``spec`` with its selected keys taken out of its ``&``s (``None``: nothing left), or
    ``False`` where they sit elsewhere (under a head slice)."""
    if isinstance(spec, SelectedKeys):
        return None
    if not spec.selects_keys:
        return spec
    if isinstance(spec, _And):
        a, b = _without(spec.a), _without(spec.b)
        if a is False or b is False:
            return False
        if a is None or b is None:
            return b if a is None else a
        assert isinstance(a, MaskSpec)
        assert isinstance(b, MaskSpec)
        return a & b
    assert isinstance(spec, _HeadSlice) or spec.selects_keys
    return False


def _first(ind: torch.Tensor) -> torch.Tensor:
    """``(ind >= 0)`` and the first of equal entries in each row (the order the entries come
    in does not matter: one of each key is kept)."""
    if ind.shape[-1] == 0:
        return ind >= 0
    srt, order = ind.sort(-1)
    first = torch.ones_like(srt, dtype=torch.bool)
    first[..., 1:] = srt[..., 1:] != srt[..., :-1]
    keep = torch.empty_like(first).scatter_(-1, order, first)
    return keep & (ind >= 0)


def plan(
    spec: MaskSpec | None,
    softcap: float | None,
    L: int,
    S: int,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
) -> GatherPlan | None:
    """The gather kernel's plan where ``spec`` holds :func:`~attnkit.masks.selected_keys`
    joined by ``&`` and there is no soft-cap, else ``None``; ``dtype`` and ``device``: what the
    kernels will see (the C++ kernel runs :data:`NATIVE_DTYPES` on the CPU, the low-precision
    ones in place where the build reads them: :attr:`GatherPlan.reads`)."""
    parts = _parts(spec, softcap)
    if parts is None:
        return None
    sel, rest = parts
    native = _runs_native(sel, rest, dtype, device)
    reads = _reads() if native else ()
    return GatherPlan(sel, rest, S - L, native, reads=reads)


def _parts(
    spec: MaskSpec | None, softcap: float | None
) -> tuple[SelectedKeys, MaskSpec | None] | None:
    """The selected keys of ``spec`` and its other rules, where the gather kernel runs it."""
    sel = find_selected(spec)
    if sel is None or spec is None or softcap is not None or sel.indices.device.type == "meta":
        return None
    rest = _without(spec)
    if rest is False:
        return None
    assert rest is None or isinstance(rest, MaskSpec)
    return sel, rest


def _runs_native(
    sel: SelectedKeys,
    rest: MaskSpec | None,
    dtype: torch.dtype | None,
    device: torch.device | None,
) -> bool:
    """Whether the C++ kernel runs the plan: float32, bfloat16 or float16 (:data:`NATIVE_DTYPES`)
    on the CPU, a key per row, no score bias, and the build loads."""
    native = dtype in NATIVE_DTYPES and (device is None or device.type == "cpu")
    native = native and sel.topk > 0 and not (rest is not None and rest.has_bias)
    if native:
        from attnkit.backends.blocked import gather_native

        native = gather_native.kernel() is not None
    return native


def _reads() -> tuple[torch.dtype, ...]:
    """What the loaded C++ kernel reads in place (:func:`~attnkit.backends.blocked.
    gather_native.reads`)."""
    from attnkit.backends.blocked import gather_native

    return gather_native.reads()


def block_plan(
    spec: MaskSpec | None,
    softcap: float | None,
    rows: tuple[int, int],
    keys: tuple[int, int],
    off: int,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
) -> GatherPlan | None:
    """The gather kernel's plan of one block of a longer sequence (ring attention's (query
    chunk, key chunk) pairs): the queries at global positions ``rows = (start, length)``
    against the keys at ``keys = (start, length)``, with ``off = S_total - L_total``. The
    block's indices are the spec's rows of its queries with every key outside the block's
    made ``-1`` and the others counted from the block's first key; the spec's other rules
    see global positions. ``None`` where :func:`plan` would be.

    >>> from attnkit.masks import selected_keys
    >>> idx = torch.tensor([[[0, 5], [2, 6], [7, -1]]])  # B=1, L=3, k=2
    >>> p = block_plan(selected_keys(idx), None, rows=(1, 2), keys=(4, 4), off=5)
    >>> p.selected.ind[0, 0].tolist()  # rows 1 and 2; keys 4..7 counted from 4
    [[-1, 2], [3, -1]]
    """
    parts = _parts(spec, softcap)
    if parts is None:
        return None
    sel, rest = parts
    (q0, n), (k0, m) = rows, keys
    ind = sel.ind[:, :, q0 : q0 + n]  # (B, Hkv', n, k): this block's queries
    inside = (ind >= k0) & (ind < k0 + m)
    local = SelectedKeys(torch.where(inside, ind - k0, -1), sel.heads)
    native = _runs_native(local, rest, dtype, device)
    reads = (torch.float32,) if native else ()  # the caller merges blocks in float32
    return GatherPlan(local, rest, off, native, q0, k0, reads)


def describe(p: GatherPlan, L: int, S: int, dtype: torch.dtype) -> str:
    """The plan in explain's words."""
    k = p.selected.topk
    rest = "" if p.rest is None else f", {p.rest!r} applied to the selected pairs"
    name = str(dtype).removeprefix("torch.")
    on = "float32" if dtype == torch.float32 else f"{name} q, k, v read in place, float32 inside"
    how = (
        f"forward and backward in C++ ({on}; the backward parallel over batch rows, "
        "key/value heads and slices of query rows, each slice adding into dK/dV rows of its own)"
        if p.native and dtype in p.reads
        else "forward and backward in chunks of query rows in torch operations"
    )
    return (
        f"selected keys: attnkit's gather kernel reads the {k} selected keys of each of the "
        f"{L} queries (of S = {S}; {k * L} pairs, never L x S){rest}; {how}"
    )


def _rest_entries(p: GatherPlan, H: int) -> torch.Tensor | None:
    """Bool ``(B, 1 | H, L, k)`` contiguous: the index entries the spec's other rules allow (at
    the entry's key; ``-1`` entries read as key 0, which the C++ kernel skips anyway), per query
    head where the indices or the rules depend on it; ``None`` where there are no other rules."""
    if p.rest is None:
        return None
    ind = p.selected.ind
    B, Hi, L, _ = ind.shape
    Hm = H if Hi > 1 or p.rest.heads is not None else 1
    if Hi > 1:
        ind = ind.repeat_interleave(H // Hi, 1)
    b = torch.arange(B, device=ind.device).view(B, 1, 1, 1)
    h = torch.arange(Hm, device=ind.device).view(1, Hm, 1, 1)
    q = torch.arange(L, device=ind.device).view(1, 1, L, 1) + p.q_start
    rest = p.rest.allowed(b, h, q, ind.long().clamp(min=0) + p.k_start, p.off)
    return rest.expand(B, Hm, L, -1).contiguous()


def _native_inputs(
    p: GatherPlan, q: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The C++ kernel's ``idx`` (the indices as int64, ``-1`` kept) and ``ok``
    (:func:`_rest_entries`; :mod:`~attnkit.backends.blocked.gather_native`) where the plan runs
    it (``native``: on the CPU, no score bias) on q of a dtype it reads
    (:attr:`GatherPlan.reads`; the backend converts a call of another low-precision dtype
    first: :meth:`GatherPlan.needs_float32`)."""
    if not p.native or q.device.type != "cpu" or q.dtype not in p.reads:
        return None
    return p.selected.ind.long().contiguous(), _rest_entries(p, q.shape[1])


def _native(
    p: GatherPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
    """The C++ forward (``out``, ``lse``, ``finite``) where it runs the call
    (:func:`_native_inputs`), else ``None``."""
    from attnkit.backends.blocked import gather_native

    inputs = _native_inputs(p, q)
    return None if inputs is None else gather_native.forward(q, k, v, *inputs, scale)


def forward(
    p: GatherPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``out (B, H, L, Dv)`` and ``lse (B, H, L)`` over each row's selected keys."""
    done = _native(p, q, k, v, scale)
    if done is not None:
        out, lse, finite = done
        if not finite and nonfinite.reporting():  # NaN/inf read: the rule's exact path
            raise nonfinite.NonFinite
        return out, lse
    return gather_torch.forward(p, q, k, v, scale)


def backward(
    p: GatherPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dq``, ``dk``, ``dv`` from the saved ``out`` and ``lse`` (``dk``/``dv`` summed over
    the query heads of each key/value head and over every query that selected a key)."""
    inputs = _native_inputs(p, q)
    if inputs is not None:
        from attnkit.backends.blocked import gather_native

        done = gather_native.backward(q, k, v, out, dout, lse, *inputs, scale)
        if done is not None:
            return done
    return gather_torch.backward(p, q, k, v, out, dout, lse, scale)
