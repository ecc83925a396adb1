"""DeepSeek-V3.2's sparse attention (DSA) as a mask spec: each query's own top-k keys.

Dimension legend: B batch, H query heads, Hkv key/value heads, g = H // Hkv, L query length,
S key length, k keys selected per query; ``b, h, q, kv`` are indices.

``selected_keys(indices)`` allows query ``q`` of batch row ``b`` (and query head ``h``) to attend
to exactly the keys listed in ``indices[b, q]`` (``(B, L, k)``, every head) or
``indices[b, h // g, q]`` (``(B, Hkv, L, k)``, per key/value head); ``-1`` lists no key. Its
meaning is eager's: the indices scattered into an ``L x S`` bool mask, so a key listed twice
counts once, and ANDed with every other rule of the spec (``causal() & selected_keys(i)``).
Queries are the call's own rows (the spec holds one row of indices per query: ``L`` must be the
call's query length; in ring attention the whole sequence's); keys are absolute indices
``0 .. S - 1``.

The spec never builds ``L x S`` for its key, repr or explain line: its cache key is the index
tensor's identity, version, dtype and shape (an index tensor is new at every decode step; its
bytes are not copied, unlike :func:`~attnkit.masks.tensor_key`'s for small CPU tensors), so an
edit that bypasses torch's version counter (``t.data.copy_(...)``, a NumPy view) is not seen:
edit the indices through torch, or build a new spec. transformers' DSA indexer returns int32
``(B, L, k)``, which is taken as it is. The ``blocked`` backend runs it with a gather kernel
(:mod:`attnkit.backends.blocked.gather`) that reads only the k selected keys of each query;
``math`` and ``sdpa`` materialise the scattered mask (``to_dense``), as for every spec.
``|`` and ``~`` with it are refused (a union with selected keys is no longer k keys per query).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from attnkit.errors import AttentionInputError, is_int_tensor, tensor_got
from attnkit.masks.base import SpecBase, spec_error
from attnkit.masks.spec import MaskSpec, _And

__all__ = ["SelectedKeys", "check_selected", "find_selected", "select_heads", "selected_keys"]

_DIMS3 = ("B", "L", "k")
_DIMS4 = ("B", "Hkv", "L", "k")


def _broadcast(*ts: torch.Tensor) -> tuple[int, ...]:
    """The broadcast shape of 4-D index tensors (torch.broadcast_shapes would import sympy on
    first use: seconds)."""
    n = max(t.dim() for t in ts)
    shapes = [(1,) * (n - t.dim()) + tuple(t.shape) for t in ts]
    return tuple(max(sizes) if min(sizes) > 0 else 0 for sizes in zip(*shapes, strict=True))


class SelectedKeys(MaskSpec):
    """The spec of :func:`selected_keys`."""

    reads_query_position = False
    selects_keys = True
    scratch_bytes = 2  # the scattered row table is bool, one per (row, key)
    digest_ignores = ("ind",)  # a view of ``indices``

    def __init__(self, indices: torch.Tensor, heads: int | None) -> None:
        self.indices = indices
        self.ind = indices if indices.dim() == 4 else indices.unsqueeze(1)  # (B, Hkv', L, k)
        self.kv_heads = self.ind.shape[1]
        self.batch = self.ind.shape[0]
        self.heads = None
        if self.kv_heads > 1:
            self.heads = self.kv_heads if heads is None else heads
        self.rows = self.ind.shape[2]
        self.topk = self.ind.shape[3]

    @property
    def group(self) -> int:
        """Query heads per key/value head of the indices (1 for ``(B, L, k)`` indices)."""
        return 1 if self.heads is None else max(self.heads // self.kv_heads, 1)

    def select_heads(self, start: int, stop: int) -> MaskSpec:
        """Query heads ``start .. stop - 1``: where they are whole groups of a key/value head,
        the selected keys of those key/value heads (the indices sliced: the gather kernel runs
        it), else a slice of the spec (see :meth:`MaskSpec.select_heads`)."""
        g = self.group
        if self.heads is None or start % g or stop % g or not 0 <= start < stop <= self.heads:
            return super().select_heads(start, stop)
        return SelectedKeys(self.ind[:, start // g : stop // g], stop - start)

    def key(self) -> Hashable:
        t = self.indices
        return ("selected", str(t.device), id(t), t._version, t.dtype, tuple(t.shape), self.heads)

    def tensors(self) -> list[torch.Tensor]:
        return [self.indices]

    def _rows(self, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """``indices`` of the rows ``(b, h, q)`` (broadcast), int64 ``(..., k)``."""
        bb = b if self.ind.shape[0] > 1 else torch.zeros_like(b)
        hh = h // self.group if self.kv_heads > 1 else torch.zeros_like(h)
        qq = q.clamp(0, max(self.rows - 1, 0))
        return self.ind[bb, hh, qq].long()

    def allowed(self, b, h, q, kv, off):  # type: ignore[no-untyped-def]
        shape = _broadcast(b, h, q, kv)
        lead = _broadcast(b, h, q)
        if self.topk == 0 or 0 in shape:
            return torch.zeros(shape, dtype=torch.bool, device=kv.device)
        if lead[-1] == 1 and torch.compiler.is_compiling():  # no size read from a value
            return self._searched(b, h, q, kv, shape)
        n = int(kv.max()) + 1 if kv.numel() else 0
        if lead[-1] != 1 or shape[-1] * self.topk < n:
            # pairs, or a few keys far apart (the non-finite rule's bad columns): compare each
            # key asked with the row's k keys, (..., n, k), no table up to the largest key
            rows = self._rows(b, h, q)
            return (rows == kv.unsqueeze(-1)).any(-1).expand(shape)
        # one row of keys per (b, h, q): scatter the row's keys into a table of the keys asked
        rows = self._rows(b[..., 0], h[..., 0], q[..., 0])  # (*lead[:-1], k)
        table = torch.zeros((*rows.shape[:-1], n + 1), dtype=torch.bool, device=kv.device)
        table.scatter_(-1, torch.where((rows < 0) | (rows >= n), n, rows), True)
        table[..., n] = False
        idx = torch.where(kv < 0, n, kv).expand(shape)
        return table.expand((*shape[:-1], n + 1)).gather(-1, idx)

    def _searched(
        self,
        b: torch.Tensor,
        h: torch.Tensor,
        q: torch.Tensor,
        kv: torch.Tensor,
        shape: tuple[int, ...],
    ) -> torch.Tensor:
        """:meth:`allowed` for one row of keys per ``(b, h, q)`` while torch.compile traces: a
        binary search of each row's sorted keys (the table of the eager path is sized by the
        largest key asked, a value a trace cannot read without a graph break)."""
        rows = self._rows(b[..., 0], h[..., 0], q[..., 0]).sort(-1).values  # (..., k)
        keys = kv.expand(shape).contiguous()  # (..., n)
        rows = rows.expand((*shape[:-1], self.topk)).contiguous()
        at = torch.searchsorted(rows, keys).clamp(max=self.topk - 1)
        return (rows.gather(-1, at) == keys) & (keys >= 0)

    def block_bounds(self, q_lo, q_hi, k_lo, k_hi, off):  # type: ignore[no-untyped-def]
        # conservative: any block may hold a selected key, none is known full (the gather
        # kernel never plans blocks; a backend that does evaluates the predicate inside them,
        # per batch row and head: the states are (B, H', nq, nk), as the rule depends on both)
        any_ = (k_lo <= k_hi) & (q_lo <= q_hi) & (self.topk > 0)
        shape = (self.ind.shape[0], self.heads or 1, *any_.shape)
        return any_.expand(shape), (any_ & False).expand(shape)

    def __repr__(self) -> str:
        t = self.indices
        names = _DIMS3 if t.dim() == 3 else _DIMS4
        sizes = ", ".join(f"{d}={s}" for d, s in zip(names, t.shape, strict=True))
        heads = "" if self.heads is None or self.heads == self.kv_heads else f", heads={self.heads}"
        return f"selected_keys(<({sizes}) {str(t.dtype).removeprefix('torch.')}>{heads})"

    def __str__(self) -> str:
        """The repr and, for batch row 0 and head 0, the keys of the first 8 queries (read
        from the indices: ``L x S`` is never built)."""
        lines = [f"{self!r}: the keys of each query (batch row 0, head 0; -1 = none)"]
        if self.indices.device.type != "meta":
            for i, row in enumerate(self.ind[0, 0, :8].tolist()):
                keys = sorted({x for x in row if x >= 0})
                shown = " ".join(str(x) for x in keys[:16]) + (" ..." if len(keys) > 16 else "")
                lines.append(f"  query {i}: {len(keys)} keys: {shown}")
            if self.rows > 8:
                lines.append(f"  ... {self.rows - 8} more queries")
        return "\n".join(lines)

    def check_call(
        self, L: int, S: int, H: int, Hkv: int, B: int, where: str, shards: int = 1
    ) -> None:
        """Refuse, with :class:`~attnkit.AttentionInputError`, indices that do not fit a call
        of these sizes: another batch size, query length or key/value head count, another
        number of query heads than ``heads``, or an index ``>= S`` or ``< -1``. ``shards``:
        the call is one of that many shards of the sequence (ring attention; ``L`` and ``S``
        are the whole sequence's)."""
        t = self.indices
        names = _DIMS3 if t.dim() == 3 else _DIMS4

        def fail(problem: str, expected: str, fix: str) -> None:
            # the sizes are formatted only here: formatting a symbolic size while
            # torch.compile traces fixes it, and the graph would be compiled again per size
            sizes = f"q (B={B}, H={H}, L={L})  k (Hkv={Hkv}, S={S})"
            got = f"{tensor_got('indices', t, names)}  {sizes}"
            raise AttentionInputError(where, "mask", problem, got=got, expected=expected, fix=fix)

        if self.batch != B:
            fail(
                f"selected_keys' indices are for a batch of {self.batch} but q has B={B}.",
                f"indices with B={B}",
                "pass the indices of this batch",
            )
        if self.rows != L and shards > 1:
            fail(
                f"selected_keys' indices list keys for {self.rows} queries but the sequence has "
                f"L={L} ({shards} shards of {L // shards} queries).",
                f"indices with L={L}: one row per query of the whole sequence, in its order",
                "pass the same indices of the whole sequence on every rank, not this shard's "
                "rows (ring attention picks each chunk's rows)",
            )
        if self.rows != L:
            fail(
                f"selected_keys' indices list keys for {self.rows} queries but q has L={L}.",
                f"indices with L={L} (one row of keys per query of this call)",
                "pass the indices of this call's queries (a decode step: its last L rows)",
            )
        if self.kv_heads > 1 and self.kv_heads != Hkv:
            fail(
                f"selected_keys' indices are per key/value head for {self.kv_heads} heads "
                f"but k has Hkv={Hkv}.",
                f"(B, Hkv={Hkv}, L, k) indices, or (B, L, k) for every head",
                "pass the indices per key/value head of this layer",
            )
        if self.kv_heads > 1 and self.heads != H:
            fail(
                f"selected_keys is built for {self.heads} query heads but q has H={H}.",
                f"selected_keys(indices, heads={H})",
                f"pass heads={H}: the query heads that share each key/value head's indices",
            )
        if torch.compiler.is_compiling() or t.device.type == "meta" or t.numel() == 0:
            return
        lo, hi = int(t.min()), int(t.max())
        if hi >= S or lo < -1:
            bad = hi if hi >= S else lo
            fail(
                f"selected_keys' indices hold {bad}, outside the {S} keys of k.",
                f"-1 <= indices < S={S} (-1: no key)",
                "indices count keys from 0 (with a KV cache, over every cached key); "
                "use -1 for an empty slot",
            )


def selected_keys(indices: torch.Tensor, *, heads: int | None = None) -> MaskSpec:
    """The keys each query may attend to: DeepSeek-V3.2's top-k (DSA) indices as a spec.

    Args:
        indices: integer ``(B, L, k)`` (the same keys for every head) or ``(B, Hkv, L, k)``
            (per key/value head); entry ``[b, (hkv,) q, i]`` is a key index ``0 .. S - 1`` or
            ``-1`` (no key). Duplicates count once (eager's scatter).
        heads: for ``(B, Hkv, L, k)`` indices, the number of query heads ``H`` of the call
            (query head ``h`` reads the indices of key/value head ``h // (H // Hkv)``); default
            ``Hkv``. Ignored for ``(B, L, k)`` indices.

    Combine it with other rules with ``&`` (``causal() & selected_keys(idx)``).

    >>> from attnkit.masks import causal
    >>> idx = torch.tensor([[[0, -1], [0, 1], [2, 2]]])  # B=1, L=3, k=2
    >>> spec = causal() & selected_keys(idx)
    >>> spec.to_dense(3, 3)[0, 0].int()
    tensor([[1, 0, 0],
            [1, 1, 0],
            [0, 0, 1]], dtype=torch.int32)
    """
    if not is_int_tensor(indices):
        spec_error(
            "selected_keys",
            "indices",
            "`indices` must be an integer tensor of key positions.",
            got=tensor_got("indices", indices, None),
            expected="an integer tensor (B, L, k) or (B, Hkv, L, k); -1 = no key",
            fix="indices.long() (the top-k's indices, not its scores)",
        )
    if indices.dim() not in (3, 4):
        spec_error(
            "selected_keys",
            "indices",
            f"`indices` is {indices.dim()}-D.",
            got=tensor_got("indices", indices, None),
            expected="indices (B, L, k) or (B, Hkv, L, k)",
            fix="indices.unsqueeze(0) for one sequence; a key/value head dim after the batch",
        )
    if heads is not None and (
        isinstance(heads, bool)
        or not isinstance(heads, int)
        or heads < 1
        or heads % max(indices.shape[1] if indices.dim() == 4 else 1, 1)
    ):
        spec_error(
            "selected_keys",
            "heads",
            f"heads={heads!r} is not a multiple of the indices' {indices.shape[1]} key/value "
            "heads.",
            got=f"heads={heads!r}  {tensor_got('indices', indices, _DIMS4)}",
            expected="an int H with H % Hkv == 0",
            fix="pass the call's number of query heads, q.shape[1]",
        )
    return SelectedKeys(indices, heads)


def select_heads(spec: MaskSpec, start: int, stop: int) -> MaskSpec:
    """``spec.select_heads(start, stop)`` with the ``&`` of a spec that selects keys taken
    apart, so that its :class:`SelectedKeys` slices its own indices
    (:meth:`SelectedKeys.select_heads`) and the gather kernel still sees selected keys joined
    by ``&`` (ring attention's passes of a group of heads).

    >>> from attnkit.masks import causal
    >>> idx = torch.tensor([[[[0]], [[1]]]])  # B=1, Hkv=2, L=1, k=1
    >>> select_heads(causal() & selected_keys(idx, heads=4), 2, 4)  # key/value head 1
    causal() & selected_keys(<(B=1, Hkv=1, L=1, k=1) int64>)
    """
    if isinstance(spec, _And) and spec.selects_keys:
        return select_heads(spec.a, start, stop) & select_heads(spec.b, start, stop)
    return spec.select_heads(start, stop)


def find_selected(spec: SpecBase | None) -> SelectedKeys | None:
    """The :class:`SelectedKeys` inside ``spec`` (``&`` of rules), or ``None``."""
    if spec is None or not spec.selects_keys:
        return None
    return next((p for p in spec.walk() if isinstance(p, SelectedKeys)), None)


def check_selected(
    spec: SpecBase, B: int, H: int, Hkv: int, L: int, S: int, where: str, shards: int = 1
) -> None:
    """:meth:`SelectedKeys.check_call` of every selected-keys part of ``spec`` for a call of
    these sizes (``L``, ``S``: every query and key of the sequence, over ``shards`` shards)."""
    if not spec.selects_keys:
        return
    for p in spec.walk():
        if isinstance(p, SelectedKeys):
            p.check_call(L, S, H, Hkv, B, where, shards)
