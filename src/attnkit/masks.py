"""Masks in attnkit's convention, True = may attend: dense helpers and mask *specs*.

Dimension legend: B batch, H heads, L query length, S key length; ``b, h, q, kv`` are indices.

A mask spec is a predicate on ``(b, h, q_idx, kv_idx)`` that a backend evaluates block by block,
so it never has to become an ``L x S`` tensor:

>>> spec = causal() & sliding_window(3)
>>> print(spec)
causal() & sliding_window(3), drawn for L = S = 8 (1 = may attend):
1 . . . . . . .
1 1 . . . . . .
1 1 1 . . . . .
. 1 1 1 . . . .
. . 1 1 1 . . .
. . . 1 1 1 . .
. . . . 1 1 1 .
. . . . . 1 1 1

Every spec aligns queries to the *end* of the keys, as ``causal`` does: query ``i`` of ``L``
stands at position ``i + S - L`` among ``S`` keys (what KV-cache decoding needs); predicates get
the raw indices and that offset ``off = S - L``. Specs combine
with ``&``, ``|`` and ``~``. Each has ``to_dense(L, S)`` and ``block_map(L, S, block_q,
block_k)``, which says for every (query block, key block) pair whether it is empty, partial or
full, computed from the block bounds without building ``L x S``.

Block maps are exact for the built-in specs; combinations keep two guarantees that make
skipping safe: a block called *empty* has no allowed pair, and a block called *full* has no
blocked pair (a combination may call a block *partial* that is in fact empty or full; a backend
then evaluates the predicate inside it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "BlockMap",
    "MaskSpec",
    "causal",
    "causal_mask",
    "causal_window",
    "document",
    "key_mask",
    "padding",
    "prefix_lm",
    "sliding_window",
]

EMPTY, PARTIAL, FULL = 0, 1, 2


def causal_mask(L: int, S: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """The end-aligned causal mask, ``(L, S)`` bool, True = may attend.

    Query ``i`` sees keys ``j <= i + S - L``: the last query sees every key, as a new token does
    when it is decoded against a KV cache of ``S - L`` earlier tokens. For ``L == S`` this is the
    usual lower triangle. For ``L = 2, S = 4``::

        1 1 1 0
        1 1 1 1

    and for ``L = 4, S = 2`` the first two queries see nothing (their output is 0)::

        0 0
        0 0
        1 0
        1 1

    >>> causal_mask(2, 4).int()
    tensor([[1, 1, 1, 0],
            [1, 1, 1, 1]], dtype=torch.int32)
    """
    return torch.ones(L, S, dtype=torch.bool, device=device).tril(S - L)


@dataclass(frozen=True)
class BlockMap:
    """Which (query block, key block) pairs a mask leaves empty, partial or full.

    ``state`` is ``(B', H', nq, nk)`` uint8 with ``EMPTY = 0``, ``PARTIAL = 1``, ``FULL = 2``;
    ``B'`` and ``H'`` are 1 when the mask does not depend on the batch or the head.
    """

    state: torch.Tensor
    L: int
    S: int
    block_q: int
    block_k: int

    @property
    def density(self) -> float:
        """Fraction of block pairs that are not empty (the work a block-sparse kernel does)."""
        return (self.state != EMPTY).float().mean().item()

    def counts(self) -> dict[str, int]:
        """How many block pairs are empty, partial and full."""
        return {
            name: int((self.state == code).sum())
            for name, code in (("empty", EMPTY), ("partial", PARTIAL), ("full", FULL))
        }

    def __str__(self) -> str:
        glyph = {EMPTY: ".", PARTIAL: "p", FULL: "#"}
        rows = [" ".join(glyph[int(c)] for c in row) for row in self.state[0, 0]]
        c = self.counts()
        head = (
            f"BlockMap(L={self.L}, S={self.S}, blocks {self.block_q}x{self.block_k}: "
            f"{c['full']} full, {c['partial']} partial, {c['empty']} empty)"
        )
        return "\n".join([head, *rows])


class MaskSpec:
    """A mask as a predicate on ``(b, h, q_idx, kv_idx)``; True = may attend.

    Subclasses implement :meth:`allowed` (the predicate on broadcastable index tensors) and
    :meth:`block_bounds` (per block pair, an over-approximation of "some pair is allowed" and an
    under-approximation of "every pair is allowed"). ``off = S - L`` end-aligns the queries:
    query ``q`` stands at key position ``q + off``.
    """

    #: the batch size the spec's tensors imply (None: it does not depend on the batch)
    batch: int | None = None
    #: True when the spec also adds a bias to the scores (ALiBi); see :meth:`bias`
    has_bias: bool = False
    #: the number of heads a head-dependent spec is built for (None: any)
    heads: int | None = None

    def bias(
        self, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, off: int
    ) -> torch.Tensor | None:
        """A float added to the scaled scores of allowed pairs (None: no bias).

        A spec with a bias (``has_bias``) materialises as a float mask; a block-sparse backend
        adds it on every visited block, full ones included.
        """
        return None

    def allowed(
        self, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, off: int
    ) -> torch.Tensor:
        """The predicate on broadcastable index tensors (raw query and key indices)."""
        raise NotImplementedError

    def block_bounds(
        self,
        q_lo: torch.Tensor,
        q_hi: torch.Tensor,
        k_lo: torch.Tensor,
        k_hi: torch.Tensor,
        off: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(any, all)`` per block pair from inclusive raw index bounds ``(nq, 1)`` and
        ``(1, nk)``; the results broadcast to ``(B', 1, nq, nk)``."""
        raise NotImplementedError

    def tensors(self) -> list[torch.Tensor]:
        """The tensors the spec holds (for device and batch checks)."""
        return []

    def to_dense(
        self,
        L: int,
        S: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """The mask as a bool tensor ``(B', 1, L, S)`` (``B' = 1`` unless batch-dependent).

        A spec with a score bias (``has_bias``) gives a float mask ``(B', H', L, S)`` of
        ``dtype`` instead (``H'`` = ``heads``, or 1): the bias where allowed, ``-inf`` elsewhere.
        """
        dev = torch.device(device) if device is not None else self.device
        B = self.batch or 1
        H = (self.heads or 1) if self.has_bias else 1
        b = torch.arange(B, device=dev).view(B, 1, 1, 1)
        h = torch.arange(H, device=dev).view(1, H, 1, 1)
        q = torch.arange(L, device=dev).view(1, 1, L, 1)
        kv = torch.arange(S, device=dev).view(1, 1, 1, S)
        allowed = self.allowed(b, h, q, kv, S - L).expand(B, H, L, S)
        bias = self.bias(b, h, q, kv, S - L) if self.has_bias else None
        if bias is None:
            return allowed
        return torch.where(allowed, bias.to(dtype), float("-inf")).expand(B, H, L, S)

    def block_map(self, L: int, S: int, block_q: int = 128, block_k: int = 128) -> BlockMap:
        """Empty / partial / full per (query block, key block), without building ``L x S``."""
        dev = self.device
        q_lo = torch.arange(0, L, block_q, device=dev)
        k_lo = torch.arange(0, S, block_k, device=dev)
        q_hi = torch.clamp(q_lo + block_q, max=L) - 1
        k_hi = torch.clamp(k_lo + block_k, max=S) - 1
        any_, all_ = self.block_bounds(
            q_lo[:, None], q_hi[:, None], k_lo[None, :], k_hi[None, :], S - L
        )
        shape = torch.broadcast_shapes(  # type: ignore[no-untyped-call]
            any_.shape, all_.shape, (1, 1, len(q_lo), len(k_lo))
        )
        state = torch.full(shape, PARTIAL, dtype=torch.uint8, device=dev)
        state[~any_.expand(shape)] = EMPTY
        state[all_.expand(shape) & any_.expand(shape)] = FULL
        return BlockMap(state, L, S, block_q, block_k)

    @property
    def device(self) -> torch.device | None:
        ts = self.tensors()
        return ts[0].device if ts else None

    def select_heads(self, start: int, stop: int) -> MaskSpec:
        """The spec seen by query heads ``start .. stop - 1`` only, renumbered from 0.

        For running a group of heads at a time (ring attention passes head groups around the
        ring): head ``h`` of the result is head ``start + h`` of this spec. A spec that does
        not depend on the head is returned as it is.

        >>> from attnkit.modules.positions import alibi
        >>> alibi(8).select_heads(2, 4)
        alibi(8).select_heads(2, 4)
        """
        if self.heads is None and not self.has_bias:
            return self
        limit = self.heads
        if not (0 <= start < stop) or (limit is not None and stop > limit):
            raise ValueError(
                f"select_heads({start}, {stop}): need 0 <= start < stop"
                + (f" <= heads = {limit}" if limit is not None else "")
            )
        return _HeadSlice(self, start, stop)

    def __and__(self, other: MaskSpec) -> MaskSpec:
        return _And(self, _spec(other))

    def __or__(self, other: MaskSpec) -> MaskSpec:
        return _Or(self, _spec(other))

    def __invert__(self) -> MaskSpec:
        return _Not(self)

    def __str__(self) -> str:
        n = 8
        dense = self.to_dense(n, n)[0, 0]
        if dense.is_floating_point():
            dense = dense > float("-inf")
        rows = [" ".join("1" if x else "." for x in row) for row in dense.tolist()]
        return "\n".join([f"{self!r}, drawn for L = S = {n} (1 = may attend):", *rows])


def _spec(x: object) -> MaskSpec:
    if not isinstance(x, MaskSpec):
        raise TypeError(f"mask specs combine with mask specs, not {type(x).__name__}")
    return x


def _check_batch(*specs: MaskSpec) -> int | None:
    sizes = {s.batch for s in specs if s.batch is not None}
    if len(sizes) > 1:
        raise ValueError(f"mask specs for different batch sizes combined: {sorted(sizes)}")
    return sizes.pop() if sizes else None


def _check_heads(*specs: MaskSpec) -> int | None:
    sizes = {s.heads for s in specs if s.heads is not None}
    if len(sizes) > 1:
        raise ValueError(f"mask specs for different head counts combined: {sorted(sizes)}")
    return sizes.pop() if sizes else None


def _int_tensor(name: str, t: object, dims: int) -> torch.Tensor:
    if (
        not isinstance(t, torch.Tensor)
        or t.dim() != dims
        or t.is_floating_point()
        or (t.dtype == torch.bool)
    ):
        raise ValueError(f"{name} must be a {dims}-D integer tensor, got {t!r:.60}")
    return t


def _bool_at(table: torch.Tensor, b: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return table[b, idx.clamp(0, table.shape[-1] - 1)]


class _Causal(MaskSpec):
    def allowed(self, b, h, q, kv, off):  # type: ignore[no-untyped-def]
        return kv <= q + off

    def block_bounds(self, q_lo, q_hi, k_lo, k_hi, off):  # type: ignore[no-untyped-def]
        return (k_lo <= q_hi + off)[None, None], (k_hi <= q_lo + off)[None, None]

    def __repr__(self) -> str:
        return "causal()"


class _Window(MaskSpec):
    def __init__(self, size: int) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"sliding_window(size) needs an int >= 1, got {size!r}")
        self.size = size

    def allowed(self, b, h, q, kv, off):  # type: ignore[no-untyped-def]
        return (q + off - kv).abs() < self.size

    def block_bounds(self, q_lo, q_hi, k_lo, k_hi, off):  # type: ignore[no-untyped-def]
        gap = torch.clamp(torch.maximum(k_lo - (q_hi + off), (q_lo + off) - k_hi), min=0)
        far = torch.maximum((q_hi + off - k_lo).abs(), (k_hi - (q_lo + off)).abs())
        return (gap < self.size)[None, None], (far < self.size)[None, None]

    def __repr__(self) -> str:
        return f"sliding_window({self.size})"


class _Padding(MaskSpec):
    """Keys at or beyond each sequence's length are padding; optionally query rows too."""

    def __init__(self, lengths: torch.Tensor, q_lengths: torch.Tensor | None) -> None:
        self.lengths = _int_tensor("padding(lengths)", lengths, 1)
        self.q_lengths = None
        if q_lengths is not None:
            self.q_lengths = _int_tensor("padding(q_lengths=...)", q_lengths, 1)
            if q_lengths.shape != lengths.shape:
                raise ValueError("padding(lengths, q_lengths=...): both must be (B,)")
        self.batch = lengths.shape[0]

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.lengths, self.q_lengths) if t is not None]

    def allowed(self, b, h, q, kv, off):  # type: ignore[no-untyped-def]
        ok = kv < self.lengths[b]
        if self.q_lengths is not None:
            ok = ok & (q < self.q_lengths[b])
        return ok

    def block_bounds(self, q_lo, q_hi, k_lo, k_hi, off):  # type: ignore[no-untyped-def]
        n = self.lengths.view(-1, 1, 1, 1)
        any_, all_ = k_lo < n, k_hi < n
        if self.q_lengths is not None:
            m = self.q_lengths.view(-1, 1, 1, 1)
            any_, all_ = any_ & (q_lo < m), all_ & (q_hi < m)
        return any_, all_

    def __repr__(self) -> str:
        extra = "" if self.q_lengths is None else f", q_lengths={self.q_lengths.tolist()}"
        return f"padding({self.lengths.tolist()}{extra})"


class _KeyMask(MaskSpec):
    """Keys allowed per sequence, from a bool ``(B, S)`` tensor (True = a real key)."""

    def __init__(self, keep: torch.Tensor) -> None:
        if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool or keep.dim() != 2:
            raise ValueError("key_mask(keep) needs a bool (B, S) tensor, True = a real key")
        self.keep = keep
        self.batch = keep.shape[0]

    def tensors(self) -> list[torch.Tensor]:
        return [self.keep]

    def allowed(self, b, h, q, kv, off):  # type: ignore[no-untyped-def]
        return _bool_at(self.keep, b, kv) & (kv < self.keep.shape[1])

    def block_bounds(self, q_lo, q_hi, k_lo, k_hi, off):  # type: ignore[no-untyped-def]
        S = self.keep.shape[1]
        counts = torch.nn.functional.pad(self.keep.long().cumsum(1), (1, 0))  # (B, S+1)
        B = self.keep.shape[0]
        lo = k_lo.clamp(max=S).expand(B, -1)
        hi = (k_hi + 1).clamp(max=S).expand(B, -1)
        kept = counts.gather(1, hi) - counts.gather(1, lo)  # (B, nk)
        kept = kept.view(B, 1, 1, -1)
        return kept > 0, kept == (k_hi - k_lo + 1).view(1, 1, 1, -1)

    def __repr__(self) -> str:
        return f"key_mask(<bool {tuple(self.keep.shape)}>)"


class _Document(MaskSpec):
    """Packed sequences: a query sees only keys of its own document."""

    def __init__(self, ids: torch.Tensor) -> None:
        ids = _int_tensor("document(ids)", ids, ids.dim() if isinstance(ids, torch.Tensor) else 1)
        if ids.dim() not in (1, 2):
            raise ValueError("document(ids) needs ids of shape (S,) or (B, S)")
        self.ids = ids if ids.dim() == 2 else ids[None]  # (B', S)
        self.batch = ids.shape[0] if ids.dim() == 2 else None

    def tensors(self) -> list[torch.Tensor]:
        return [self.ids]

    def allowed(self, b, h, q, kv, off):  # type: ignore[no-untyped-def]
        bb = b if self.batch is not None else torch.zeros_like(b)
        return _bool_at(self.ids, bb, q + off) == _bool_at(self.ids, bb, kv)

    def block_bounds(self, q_lo, q_hi, k_lo, k_hi, off):  # type: ignore[no-untyped-def]
        S = self.ids.shape[1]
        lo_q, hi_q = self._range(q_lo.view(-1) + off, q_hi.view(-1) + off, S)  # (B', nq)
        lo_k, hi_k = self._range(k_lo.view(-1), k_hi.view(-1), S)  # (B', nk)
        lo_q, hi_q = lo_q[:, None, :, None], hi_q[:, None, :, None]
        lo_k, hi_k = lo_k[:, None, None, :], hi_k[:, None, None, :]
        any_ = (lo_q <= hi_k) & (lo_k <= hi_q)
        all_ = (lo_q == hi_q) & (lo_k == hi_k) & (lo_q == lo_k)
        return any_, all_

    def _range(
        self, lo: torch.Tensor, hi: torch.Tensor, S: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Min and max document id over each inclusive index range ``[lo, hi]``."""
        lo, hi = lo.clamp(0, S - 1), hi.clamp(0, S - 1)
        mins, maxs = [], []
        for a, z in zip(lo.tolist(), hi.tolist(), strict=True):
            seg = self.ids[:, a : z + 1]
            mins.append(seg.amin(dim=1))
            maxs.append(seg.amax(dim=1))
        return torch.stack(mins, dim=1), torch.stack(maxs, dim=1)

    def __repr__(self) -> str:
        return f"document(<ids {tuple(self.ids.shape)}>)"


class _PrefixKeys(MaskSpec):
    """Keys before ``prefix_len`` (per sequence when a tensor) are visible to every query."""

    def __init__(self, prefix_len: int | torch.Tensor) -> None:
        if isinstance(prefix_len, torch.Tensor):
            self.prefix: int | torch.Tensor = _int_tensor("prefix_lm(prefix_len)", prefix_len, 1)
            self.batch = prefix_len.shape[0]
        elif isinstance(prefix_len, bool) or not isinstance(prefix_len, int) or prefix_len < 0:
            raise ValueError(f"prefix_lm(prefix_len) needs an int >= 0, got {prefix_len!r}")
        else:
            self.prefix = prefix_len

    def tensors(self) -> list[torch.Tensor]:
        return [self.prefix] if isinstance(self.prefix, torch.Tensor) else []

    def allowed(self, b, h, q, kv, off):  # type: ignore[no-untyped-def]
        n = self.prefix[b] if isinstance(self.prefix, torch.Tensor) else self.prefix
        return kv < n

    def block_bounds(self, q_lo, q_hi, k_lo, k_hi, off):  # type: ignore[no-untyped-def]
        n = self.prefix.view(-1, 1, 1, 1) if isinstance(self.prefix, torch.Tensor) else self.prefix
        return k_lo < n, k_hi < n

    def __repr__(self) -> str:
        n = self.prefix.tolist() if isinstance(self.prefix, torch.Tensor) else self.prefix
        return f"prefix_keys({n})"


class _HeadSlice(MaskSpec):
    """Heads ``start .. stop - 1`` of a head-dependent spec, renumbered from 0."""

    def __init__(self, a: MaskSpec, start: int, stop: int) -> None:
        self.a, self.start, self.stop = a, start, stop
        self.batch = a.batch
        self.heads = stop - start
        self.has_bias = a.has_bias

    def tensors(self) -> list[torch.Tensor]:
        return self.a.tensors()

    def bias(self, b, h, q, kv, off):  # type: ignore[no-untyped-def]
        return self.a.bias(b, h + self.start, q, kv, off)

    def allowed(self, b, h, q, kv, off):  # type: ignore[no-untyped-def]
        return self.a.allowed(b, h + self.start, q, kv, off)

    def block_bounds(self, q_lo, q_hi, k_lo, k_hi, off):  # type: ignore[no-untyped-def]
        return self.a.block_bounds(q_lo, q_hi, k_lo, k_hi, off)

    def __repr__(self) -> str:
        inner = repr(self.a)
        inner = f"({inner})" if " " in inner else inner
        return f"{inner}.select_heads({self.start}, {self.stop})"


class _And(MaskSpec):
    def __init__(self, a: MaskSpec, b: MaskSpec) -> None:
        self.a, self.b = a, b
        self.batch = _check_batch(a, b)
        self.heads = _check_heads(a, b)
        self.has_bias = a.has_bias or b.has_bias

    def bias(self, b, h, q, kv, off):  # type: ignore[no-untyped-def]
        total: torch.Tensor | None = None
        for spec in (self.a, self.b):
            part = spec.bias(b, h, q, kv, off) if spec.has_bias else None
            if part is not None:
                total = part if total is None else total + part
        return total

    def tensors(self) -> list[torch.Tensor]:
        return self.a.tensors() + self.b.tensors()

    def allowed(self, b, h, q, kv, off):  # type: ignore[no-untyped-def]
        return self.a.allowed(b, h, q, kv, off) & self.b.allowed(b, h, q, kv, off)

    def block_bounds(self, q_lo, q_hi, k_lo, k_hi, off):  # type: ignore[no-untyped-def]
        any_a, all_a = self.a.block_bounds(q_lo, q_hi, k_lo, k_hi, off)
        any_b, all_b = self.b.block_bounds(q_lo, q_hi, k_lo, k_hi, off)
        return any_a & any_b, all_a & all_b

    def __repr__(self) -> str:
        return f"{self.a!r} & {self.b!r}"


class _Or(MaskSpec):
    def __init__(self, a: MaskSpec, b: MaskSpec) -> None:
        if a.has_bias or b.has_bias:
            raise ValueError("a spec with a score bias (ALiBi) combines with & only")
        self.a, self.b = a, b
        self.batch = _check_batch(a, b)
        self.heads = _check_heads(a, b)

    def tensors(self) -> list[torch.Tensor]:
        return self.a.tensors() + self.b.tensors()

    def allowed(self, b, h, q, kv, off):  # type: ignore[no-untyped-def]
        return self.a.allowed(b, h, q, kv, off) | self.b.allowed(b, h, q, kv, off)

    def block_bounds(self, q_lo, q_hi, k_lo, k_hi, off):  # type: ignore[no-untyped-def]
        any_a, all_a = self.a.block_bounds(q_lo, q_hi, k_lo, k_hi, off)
        any_b, all_b = self.b.block_bounds(q_lo, q_hi, k_lo, k_hi, off)
        return any_a | any_b, all_a | all_b

    def __repr__(self) -> str:
        return f"({self.a!r} | {self.b!r})"


class _Not(MaskSpec):
    def __init__(self, a: MaskSpec) -> None:
        if a.has_bias:
            raise ValueError("a spec with a score bias (ALiBi) cannot be inverted")
        self.a = a
        self.batch = a.batch
        self.heads = a.heads

    def tensors(self) -> list[torch.Tensor]:
        return self.a.tensors()

    def allowed(self, b, h, q, kv, off):  # type: ignore[no-untyped-def]
        return ~self.a.allowed(b, h, q, kv, off)

    def block_bounds(self, q_lo, q_hi, k_lo, k_hi, off):  # type: ignore[no-untyped-def]
        any_a, all_a = self.a.block_bounds(q_lo, q_hi, k_lo, k_hi, off)
        return ~all_a, ~any_a

    def __repr__(self) -> str:
        return f"~{self.a!r}"


def causal_window(spec: MaskSpec | None) -> int | None:
    """The window ``w`` when ``spec`` is exactly ``causal() & sliding_window(w)`` (either
    order): each query sees itself and the ``w - 1`` keys before. Else ``None``.

    >>> causal_window(sliding_window(4) & causal()), causal_window(sliding_window(4))
    (4, None)
    """
    if not isinstance(spec, _And):
        return None
    parts = (spec.a, spec.b)
    windows = [p for p in parts if isinstance(p, _Window)]
    if len(windows) != 1 or not any(type(p) is _Causal for p in parts):
        return None
    return windows[0].size


def causal() -> MaskSpec:
    """Query ``i`` sees keys ``j <= i + S - L`` (end-aligned, as ``attention(causal=True)``)."""
    return _Causal()


def sliding_window(size: int) -> MaskSpec:
    """Keys within ``size - 1`` positions of the query, both sides: ``|i + S - L - j| < size``.

    With ``causal()`` it is one-sided: each query sees itself and the ``size - 1`` keys before.
    """
    return _Window(size)


def padding(lengths: torch.Tensor, q_lengths: torch.Tensor | None = None) -> MaskSpec:
    """Sequence ``b`` has ``lengths[b]`` real keys; the rest are padding.

    ``q_lengths`` also marks query rows at or beyond ``q_lengths[b]`` as padding: they see
    nothing, so their output is 0.
    """
    return _Padding(lengths, q_lengths)


def key_mask(keep: torch.Tensor) -> MaskSpec:
    """Keys allowed per sequence from a bool ``(B, S)`` tensor, True = a real key."""
    return _KeyMask(keep)


def document(ids: torch.Tensor) -> MaskSpec:
    """Packed sequences: ``ids`` ``(S,)`` or ``(B, S)`` gives each position's document; a query
    attends only to keys of its own document (combine with ``causal()`` for causal packing)."""
    return _Document(ids)


def prefix_lm(prefix_len: int | torch.Tensor) -> MaskSpec:
    """Prefix-LM: every query sees the first ``prefix_len`` keys, and the rest causally."""
    return _Or(_PrefixKeys(prefix_len), _Causal())
