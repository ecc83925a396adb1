"""The mask spec protocol, its combinators, block states and cache keys.

Dimension legend: B batch, H heads, L query length, S key length; ``b, h, q, kv`` are indices;
``nq``, ``nk`` the numbers of query and key blocks.

A :class:`MaskSpec` is a predicate on ``(b, h, q_idx, kv_idx)``, True = may attend, evaluated at
raw indices with the end-aligned offset ``off = S - L`` (query ``q`` stands at key position
``q + off``). :func:`block_states` is the one function that turns a spec into per-block states
(empty / partial / full): :meth:`MaskSpec.block_map`, the ``blocked`` planner and the ``flex``
block mask all read it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import NoReturn

import torch

from attnkit.errors import AttentionInputError
from attnkit.masks.runs import Spans, intersect, union
from attnkit.memory import exceeds, refuse

#: :meth:`MaskSpec.allows_all` per (spec key, L, S): every layer of a model's forward asks it
#: for the same spec and sizes
_ALLOWS_ALL: OrderedDict[Hashable, tuple[MaskSpec, bool]] = OrderedDict()
_ALLOWS_ALL_SIZE = 256

__all__ = ["EMPTY", "FULL", "PARTIAL", "BlockMap", "MaskSpec", "block_states", "tensor_key"]

EMPTY, PARTIAL, FULL = 0, 1, 2

WHERE = "attnkit.masks"


def spec_error(
    call: str, argument: str, problem: str, got: str, expected: str, fix: str
) -> NoReturn:
    """Raise the :class:`~attnkit.AttentionInputError` of a spec constructor."""
    raise AttentionInputError(
        f"{WHERE}.{call}", argument, problem, got=got, expected=expected, fix=fix
    )


def tensor_key(t: torch.Tensor) -> Hashable:
    """A tensor's part of a cache key: its identity and version (an in-place edit through
    torch bumps it) and, on the CPU, its values (dtype, shape and bytes), so that a write that
    bypasses torch's version counter (``t.data.copy_(...)``, a NumPy array sharing the memory)
    is seen too. Spec tensors are small (lengths, ids, one flag per key): the copy costs
    microseconds. On another device, reading the values would wait for the device, so a write
    that bypasses the counter is not seen there: edit a spec's tensor through torch, or build a
    new spec.

    The identity stays in the key because cached plans read the spec's own tensors when they
    run (flex's ``mask_mod``, lazily built tile masks): an entry must only ever be found by the
    tensor it was made from, holding the values it was made with. A cache that keys on it must
    hold the tensor (so that the id is not reused while the entry lives): plans keep
    :meth:`MaskSpec.tensors` alive.

    >>> t = torch.tensor([3, 5])
    >>> before = tensor_key(t)
    >>> t.data[0] = 4  # no version bump
    >>> tensor_key(t) == before
    False
    """
    if t.device.type != "cpu":
        return (str(t.device), id(t), t._version)
    flat = t.detach().contiguous().reshape(-1)
    raw = flat.to(torch.uint8) if flat.dtype == torch.bool else flat.view(torch.uint8)
    return (id(t), t._version, t.dtype, tuple(t.shape), raw.numpy().tobytes())


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

    Subclasses implement :meth:`allowed` (the predicate on broadcastable index tensors),
    :meth:`block_bounds` (per block pair, an over-approximation of "some pair is allowed" and an
    under-approximation of "every pair is allowed") and :meth:`key` (what identifies the spec
    for the plan and kernel caches; ``None`` means "never cache"). ``off = S - L`` end-aligns
    the queries: query ``q`` stands at key position ``q + off``.
    """

    #: the batch size the spec's tensors imply (None: it does not depend on the batch)
    batch: int | None = None
    #: True when the spec also adds a bias to the scores (ALiBi); see :meth:`bias`
    has_bias: bool = False
    #: the number of heads a head-dependent spec is built for (None: any)
    heads: int | None = None
    #: True when the spec wraps a user's mask tensor (:class:`~attnkit.masks.DenseMask`)
    from_tensor: bool = False
    #: the key length a position-indexed spec is built for (``key_mask``, ``document``), or None
    length: int | None = None
    #: bytes per ``(b, h, q, kv)`` pair that evaluating :meth:`allowed` over a whole grid
    #: allocates besides the mask itself, at most (int64 index arithmetic); see :meth:`dense_bytes`
    scratch_bytes: int = 16
    #: attributes that are caches or derived from others, not content: :meth:`digest` skips them
    digest_ignores: tuple[str, ...] = ()

    def digest(self) -> str:
        """A hex digest of the spec's content: its class and every value it holds, tensors by
        their dtype, shape and bytes (on any device). Two specs have the same digest exactly
        when they are the same rule over the same values, in any process; ring attention
        compares them across ranks (see :mod:`attnkit.masks.digest`).

        >>> import torch
        >>> from attnkit.masks import document
        >>> a, b = document(torch.tensor([0, 0, 1])), document(torch.tensor([0, 1, 1]))
        >>> repr(a) == repr(b), a.digest() == b.digest()
        (True, False)
        >>> a.digest() == document(torch.tensor([0, 0, 1])).digest()
        True
        """
        from attnkit.masks.digest import spec_digest

        return spec_digest(self)

    def key(self) -> Hashable | None:
        """What identifies this spec in a cache (``None``: do not cache it)."""
        return None

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

    def key_runs(self, pos: torch.Tensor, off: int) -> Spans | None:
        """The keys each query row may attend as one run ``lo ..= hi``, or ``None`` where the
        rule is not one run per row (the default: a rule that does not say).

        ``pos`` ``(1, L)`` int64 on the CPU holds the rows' global query positions; ``lo`` and
        ``hi`` are global key indices on the CPU, broadcastable to ``(B', L)``, with
        :data:`~attnkit.masks.runs.LOW` and :data:`~attnkit.masks.runs.HIGH` for "no bound".
        Computed once per call for every row together (tensor operations, no loop over rows);
        :func:`~attnkit.masks.row_spans` clamps them into a call's keys.
        """
        return None

    def planning_bytes(self) -> int:
        """The bytes planning this spec block by block allocates beyond its rule: the int64
        prefix sums of every dense mask inside it (:class:`~attnkit.masks.dense.DenseMask`),
        0 for a spec of rules. The backends that plan blocks report it as their L x S memory,
        so that ``auto`` passes them over where it is above attnkit's memory limit."""
        return sum(v.planning_bytes() for v in vars(self).values() if isinstance(v, MaskSpec))

    def allows_all(self, L: int, S: int) -> bool:
        """Whether this spec allows every (query, key) pair of an ``L x S`` call and adds no
        bias, for every batch row and head: then it changes nothing and no mask need be made
        (a causal sliding window while the keys fit in the window, padding that pads nothing).
        Decided from :meth:`block_bounds` over one block, without evaluating any pair; the
        bounds are conservative, so ``False`` may mean "cannot tell cheaply". While
        ``torch.compile`` traces it is always ``False``: the answer reads the spec's values,
        which a graph cannot branch on.

        >>> from attnkit.masks import causal, sliding_window
        >>> w = causal() & sliding_window(256)
        >>> w.allows_all(1, 200), w.allows_all(1, 300), w.allows_all(8, 8)
        (True, False, False)
        """
        if self.has_bias:
            return False
        if L == 0 or S == 0:
            return True
        if torch.compiler.is_compiling():
            # a traced graph cannot branch on the spec's values, and its cache key reads them:
            # "cannot tell" (the caller hands over the mask, which allows every pair anyway)
            return False
        skey = self.key()
        key = None if skey is None else (skey, L, S)
        if key is not None and key in _ALLOWS_ALL:
            _ALLOWS_ALL.move_to_end(key)
            return _ALLOWS_ALL[key][1]
        # one block's bounds, as block_states builds them (its map costs 2.5x more here, and
        # this runs on every decoding step's first layer)
        dev = self.device
        zero = torch.zeros(1, 1, dtype=torch.long, device=dev)
        q_hi = torch.full((1, 1), L - 1, dtype=torch.long, device=dev)
        k_hi = torch.full((1, 1), S - 1, dtype=torch.long, device=dev)
        _, all_ = self.block_bounds(zero, q_hi, zero, k_hi, S - L)
        allowed = bool(torch.as_tensor(all_).all())
        if key is not None:  # held with the spec, so that its tensors' ids are not reused
            _ALLOWS_ALL[key] = (self, allowed)
            while len(_ALLOWS_ALL) > _ALLOWS_ALL_SIZE:
                _ALLOWS_ALL.popitem(last=False)
        return allowed

    def tensors(self) -> list[torch.Tensor]:
        """The tensors the spec holds (for device and batch checks)."""
        return []

    def compile_fields(self) -> dict[str, object]:
        """What the spec is made of, by name, as ``torch.compile``'s custom op takes it apart
        (:mod:`attnkit.masks.fields`): tensors, ints, floats, specs and ``None``/``bool``/``str``
        constants. The default is every attribute; a class that holds anything else overrides
        this and :meth:`from_fields`."""
        return dict(vars(self))

    @classmethod
    def from_fields(cls, fields: Mapping[str, object]) -> MaskSpec:
        """The spec :meth:`compile_fields` took apart, made again without running the
        constructor (whose checks read values, which a traced graph cannot)."""
        spec = cls.__new__(cls)
        spec.__dict__.update(fields)
        return spec

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
        self.check_dense(L, S, dev or torch.device("cpu"), dtype)
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

    def dense_bytes(self, L: int, S: int, dtype: torch.dtype = torch.float32) -> int:
        """The bytes :meth:`to_dense` allocates at most: the mask ``(B', H', L, S)`` (bool, or
        ``dtype`` with a bias) and its predicate's index arithmetic (:attr:`scratch_bytes`).

        >>> from attnkit.masks import causal, sliding_window
        >>> causal().dense_bytes(1000, 1000), (causal() & sliding_window(8)).dense_bytes(10, 10)
        (1000000, 1900)
        """
        B, H = self.batch or 1, self.heads or 1
        item = dtype.itemsize if self.has_bias else 1
        return B * H * L * S * (item + self.scratch_bytes)

    def check_dense(self, L: int, S: int, device: torch.device, dtype: torch.dtype) -> None:
        """Refuse, before allocating, to materialise this spec for another key length than
        its own, or above attnkit's memory limit (:mod:`attnkit.memory`)."""
        if self.length is not None and self.length != S:
            spec_error(
                "to_dense",
                "S",
                f"{self!r} is built for {self.length} keys, not S = {S}.",
                got=f"spec length {self.length}  L={L}  S={S}",
                expected=f"S == {self.length}, the length of the spec's tensor",
                fix="build the spec from a tensor of one entry per key",
            )
        limit = exceeds(nbytes := self.dense_bytes(L, S, dtype), device)
        if limit is not None:
            shape, kind = (
                (self.batch or 1, self.heads or 1, L, S),
                dtype if self.has_bias else "bool",
            )
            raise refuse(
                f"{WHERE}.to_dense",
                "mask",
                f"materialising the mask spec {self!r} as a {shape} {kind} tensor",
                nbytes,
                limit,
                got=f"spec {self!r}  L={L}  S={S}  on {device}",
                fix="give the spec to attention(..., backend='blocked'), which evaluates it "
                "block by block and never builds L x S; or fewer queries per call (a smaller L)",
            )

    def block_map(self, L: int, S: int, block_q: int = 128, block_k: int = 128) -> BlockMap:
        """Empty / partial / full per (query block, key block), without building ``L x S``."""
        dev = self.device or torch.device("cpu")
        state = block_states(self, L, S, block_q, block_k, device=dev)
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

        >>> from attnkit.masks import alibi
        >>> alibi(8).select_heads(2, 4)
        alibi(8).select_heads(2, 4)
        """
        if self.heads is None and not self.has_bias:
            return self
        limit = self.heads
        if not (0 <= start < stop) or (limit is not None and stop > limit):
            spec_error(
                "select_heads",
                "start, stop",
                f"select_heads({start}, {stop}) is not a range of this spec's heads.",
                got=f"start={start}, stop={stop}, spec={self!r}",
                expected="0 <= start < stop" + (f" <= heads = {limit}" if limit else ""),
                fix="pass the head group's first head and one past its last",
            )
        return _HeadSlice(self, start, stop)

    def __and__(self, other: MaskSpec) -> MaskSpec:
        return _And(self, _spec(other, "&"))

    def __or__(self, other: MaskSpec) -> MaskSpec:
        return _Or(self, _spec(other, "|"))

    def __rand__(self, other: object) -> MaskSpec:  # tensor & spec: torch hands it over
        return _And(_spec(other, "&", left=True), self)

    def __ror__(self, other: object) -> MaskSpec:
        return _Or(_spec(other, "|", left=True), self)

    def __invert__(self) -> MaskSpec:
        """``~spec``: the pairs ``spec`` does not allow. Inside a function that
        ``torch.compile`` traces, Dynamo (torch 2.13) cannot trace ``~`` on a Python object
        (``&`` and ``|`` it can): build the inverted spec outside the compiled function, and
        close over it or pass it in."""
        return _Not(self)

    def __str__(self) -> str:
        """The spec's repr and a drawing of its first 8 x 8 pairs, at L = S = 8 or, for a
        spec built from a tensor of one entry per key, at L = S = that length. Only those
        pairs are evaluated (batch row 0, head 0), never the whole ``L x S`` mask; a spec
        holding a user's mask tensor draws the corner of its dense form."""
        n = 8 if self.length is None else self.length
        where = f"L = S = {n}" + ("" if n <= 8 else ", its first 8 x 8 pairs")
        rows = [" ".join("1" if x else "." for x in row) for row in self._corner(n).tolist()]
        return "\n".join([f"{self!r}, drawn for {where} (1 = may attend):", *rows])

    def _corner(self, n: int) -> torch.Tensor:
        """Which of the first (up to) 8 x 8 pairs of an ``n x n`` call batch row 0 and head 0
        may attend, bool ``(min(n, 8), min(n, 8))``."""
        if self.from_tensor:  # the user's tensor is there already: its dense form, as it is
            dense = self.to_dense(n, n)[0, 0, :8, :8]
            return dense > float("-inf") if dense.is_floating_point() else dense
        dev, m = self.device, min(n, 8)
        zero = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=dev)
        idx = torch.arange(m, device=dev)
        allowed = self.allowed(zero, zero, idx.view(1, 1, m, 1), idx.view(1, 1, 1, m), 0)
        return allowed.expand(1, 1, m, m)[0, 0]


def block_states(
    spec: MaskSpec,
    L: int,
    S: int,
    block_q: int,
    block_k: int | None = None,
    *,
    q_start: int = 0,
    k_start: int = 0,
    off: int | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """``(B', H', nq, nk)`` uint8 states (``EMPTY``, ``PARTIAL``, ``FULL``) of ``spec`` over
    ``L`` local rows and ``S`` local keys in ``block_q x block_k`` blocks, evaluated at global
    positions ``q_start + i`` and ``k_start + j`` with offset ``off`` (default ``S - L``)."""
    block_k = block_q if block_k is None else block_k
    off = S - L if off is None else off
    dev = device if device is not None else (spec.device or torch.device("cpu"))
    q_lo = torch.arange(0, L, block_q, device=dev)
    k_lo = torch.arange(0, S, block_k, device=dev)
    q_hi = torch.clamp(q_lo + block_q, max=L) - 1
    k_hi = torch.clamp(k_lo + block_k, max=S) - 1
    any_, all_ = spec.block_bounds(
        (q_lo + q_start)[:, None],
        (q_hi + q_start)[:, None],
        (k_lo + k_start)[None, :],
        (k_hi + k_start)[None, :],
        off,
    )
    # (torch.broadcast_shapes would import sympy on first use: seconds)
    dims = [(1,) * (4 - t.dim()) + tuple(t.shape) for t in (any_, all_)]
    shape = (*(max(a, b) for a, b in zip(*dims, strict=True)),)
    shape = (*shape[:2], len(q_lo), len(k_lo))
    any_, all_ = any_.expand(shape), all_.expand(shape)
    state = torch.where(all_ & any_, FULL, torch.where(any_, PARTIAL, EMPTY))
    return state.to(torch.uint8)


def _spec(x: object, op: str, left: bool = False) -> MaskSpec:
    """``x`` if it is a spec; else the error (``left``: ``x`` stood on the left of ``op``)."""
    if not isinstance(x, MaskSpec):
        name = type(x).__name__
        spec_error(
            op,
            "other",
            f"mask specs combine with mask specs, not with a {name}.",
            got=f"{name} {op} spec" if left else f"spec {op} {name}",
            expected="a spec from attnkit.masks on both sides",
            fix="wrap a mask tensor with attnkit.masks.as_spec(tensor) first",
        )
    return x


def _same(attr: str, what: str, *specs: MaskSpec) -> int | None:
    # compared, not hashed into a set: while torch.compile traces, a size may be symbolic, and
    # hashing it would fix it (a graph per length)
    sizes = [getattr(s, attr) for s in specs if getattr(s, attr) is not None]
    if any(v != sizes[0] for v in sizes[1:]):
        spec_error(
            "&",
            "other",
            f"mask specs for different {what} were combined: {sorted(set(sizes))}.",
            got=" and ".join(repr(s) for s in specs),
            expected=f"specs that agree on their {what}",
            fix=f"build every part from the same batch's tensors ({what} must agree)",
        )
    return sizes[0] if sizes else None


def _combined_key(name: str, *specs: MaskSpec) -> Hashable | None:
    keys = [s.key() for s in specs]
    return None if any(k is None for k in keys) else (name, *keys)


class _Combined(MaskSpec):
    """The shared parts of ``&`` and ``|``."""

    op = ""

    def __init__(self, a: MaskSpec, b: MaskSpec) -> None:
        self.a, self.b = a, b
        self.batch = _same("batch", "batch sizes", a, b)
        self.heads = _same("heads", "head counts", a, b)
        self.length = _same("length", "key lengths", a, b)
        self.from_tensor = a.from_tensor or b.from_tensor
        self.scratch_bytes = a.scratch_bytes + b.scratch_bytes + 2  # the parts' bool masks

    def key(self) -> Hashable | None:
        return _combined_key(self.op, self.a, self.b)

    def tensors(self) -> list[torch.Tensor]:
        return self.a.tensors() + self.b.tensors()


class _And(_Combined):
    op = "&"

    def __init__(self, a: MaskSpec, b: MaskSpec) -> None:
        super().__init__(a, b)
        self.has_bias = a.has_bias or b.has_bias

    def bias(self, b, h, q, kv, off):  # type: ignore[no-untyped-def]
        total: torch.Tensor | None = None
        for spec in (self.a, self.b):
            part = spec.bias(b, h, q, kv, off) if spec.has_bias else None
            if part is not None:
                total = part if total is None else total + part
        return total

    def allowed(self, b, h, q, kv, off):  # type: ignore[no-untyped-def]
        return self.a.allowed(b, h, q, kv, off) & self.b.allowed(b, h, q, kv, off)

    def block_bounds(self, q_lo, q_hi, k_lo, k_hi, off):  # type: ignore[no-untyped-def]
        any_a, all_a = self.a.block_bounds(q_lo, q_hi, k_lo, k_hi, off)
        any_b, all_b = self.b.block_bounds(q_lo, q_hi, k_lo, k_hi, off)
        return any_a & any_b, all_a & all_b

    def key_runs(self, pos: torch.Tensor, off: int) -> Spans | None:
        a = self.a.key_runs(pos, off)
        b = self.b.key_runs(pos, off) if a is not None else None
        return None if a is None or b is None else intersect(a, b)

    def dense_bytes(self, L: int, S: int, dtype: torch.dtype = torch.float32) -> int:
        if not self.from_tensor:
            return super().dense_bytes(L, S, dtype)
        item = dtype.itemsize if self.has_bias else 1
        whole = (self.batch or 1) * (self.heads or 1) * L * S * item
        return self.a.dense_bytes(L, S, dtype) + self.b.dense_bytes(L, S, dtype) + whole

    def to_dense(self, L, S, *, device=None, dtype=torch.float32):  # type: ignore[no-untyped-def]
        if not self.from_tensor:  # one pass of the predicate
            return super().to_dense(L, S, device=device, dtype=dtype)
        # a user's tensor inside: combine the parts' dense forms (no gather over L x S)
        dev = torch.device(device) if device is not None else self.device
        self.check_dense(L, S, dev or torch.device("cpu"), dtype)
        a = self.a.to_dense(L, S, device=device, dtype=dtype)
        b = self.b.to_dense(L, S, device=device, dtype=dtype)
        if not a.is_floating_point() and not b.is_floating_point():
            return a & b
        if not a.is_floating_point():
            a, b = b, a
        if not b.is_floating_point():
            return a.masked_fill(~b, float("-inf"))
        return a + b

    def __repr__(self) -> str:
        return f"{self.a!r} & {self.b!r}"


class _Or(_Combined):
    op = "|"

    def __init__(self, a: MaskSpec, b: MaskSpec) -> None:
        if a.has_bias or b.has_bias:
            spec_error(
                "|",
                "other",
                "a spec with a score bias (ALiBi) combines with & only.",
                got=f"{a!r} | {b!r}",
                expected="specs without a bias on both sides of |",
                fix="combine the bias last: (a | b) & alibi(H)",
            )
        super().__init__(a, b)

    def allowed(self, b, h, q, kv, off):  # type: ignore[no-untyped-def]
        return self.a.allowed(b, h, q, kv, off) | self.b.allowed(b, h, q, kv, off)

    def block_bounds(self, q_lo, q_hi, k_lo, k_hi, off):  # type: ignore[no-untyped-def]
        any_a, all_a = self.a.block_bounds(q_lo, q_hi, k_lo, k_hi, off)
        any_b, all_b = self.b.block_bounds(q_lo, q_hi, k_lo, k_hi, off)
        return any_a | any_b, all_a | all_b

    def key_runs(self, pos: torch.Tensor, off: int) -> Spans | None:
        a = self.a.key_runs(pos, off)
        b = self.b.key_runs(pos, off) if a is not None else None
        return None if a is None or b is None else union(a, b)

    def __repr__(self) -> str:
        return f"({self.a!r} | {self.b!r})"


class _Not(MaskSpec):
    def __init__(self, a: MaskSpec) -> None:
        if a.has_bias:
            spec_error(
                "~",
                "spec",
                "a spec with a score bias (ALiBi) cannot be inverted.",
                got=f"~{a!r}",
                expected="a spec without a bias",
                fix="invert the mask part only, then combine: ~mask & alibi(H)",
            )
        self.a = a
        self.batch, self.heads, self.length = a.batch, a.heads, a.length
        self.from_tensor = a.from_tensor
        self.scratch_bytes = a.scratch_bytes + 1

    def key(self) -> Hashable | None:
        return _combined_key("~", self.a)

    def tensors(self) -> list[torch.Tensor]:
        return self.a.tensors()

    def allowed(self, b, h, q, kv, off):  # type: ignore[no-untyped-def]
        return ~self.a.allowed(b, h, q, kv, off)

    def block_bounds(self, q_lo, q_hi, k_lo, k_hi, off):  # type: ignore[no-untyped-def]
        any_a, all_a = self.a.block_bounds(q_lo, q_hi, k_lo, k_hi, off)
        return ~all_a, ~any_a

    def __repr__(self) -> str:
        return f"~{self.a!r}"


class _HeadSlice(MaskSpec):
    """Heads ``start .. stop - 1`` of a head-dependent spec, renumbered from 0."""

    def __init__(self, a: MaskSpec, start: int, stop: int) -> None:
        self.a, self.start, self.stop = a, start, stop
        self.batch, self.length = a.batch, a.length
        self.heads = stop - start
        self.has_bias = a.has_bias
        self.from_tensor = a.from_tensor
        self.scratch_bytes = a.scratch_bytes

    def key(self) -> Hashable | None:
        inner = self.a.key()
        return None if inner is None else ("heads", inner, self.start, self.stop)

    def tensors(self) -> list[torch.Tensor]:
        return self.a.tensors()

    def bias(self, b, h, q, kv, off):  # type: ignore[no-untyped-def]
        return self.a.bias(b, h + self.start, q, kv, off)

    def allowed(self, b, h, q, kv, off):  # type: ignore[no-untyped-def]
        return self.a.allowed(b, h + self.start, q, kv, off)

    def block_bounds(self, q_lo, q_hi, k_lo, k_hi, off):  # type: ignore[no-untyped-def]
        return self.a.block_bounds(q_lo, q_hi, k_lo, k_hi, off)

    def key_runs(self, pos: torch.Tensor, off: int) -> Spans | None:
        return self.a.key_runs(pos, off)

    def __repr__(self) -> str:
        inner = repr(self.a)
        inner = f"({inner})" if " " in inner else inner
        return f"{inner}.select_heads({self.start}, {self.stop})"
