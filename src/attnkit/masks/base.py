"""The mask spec protocol: what every rule says, block states and the memory guard.

Dimension legend: B batch, H heads, L query length, S key length; ``b, h, q, kv`` are indices;
``nq``, ``nk`` the numbers of query and key blocks.

A mask spec is a predicate on ``(b, h, q_idx, kv_idx)``, True = may attend, evaluated at raw
indices with the end-aligned offset ``off = S - L`` (query ``q`` stands at key position
``q + off``). :class:`SpecBase` holds what every rule answers (its predicate, block bounds, runs
of keys per row, fields for ``torch.compile``, dense form); :class:`~attnkit.masks.MaskSpec`
(``spec.py``) adds the combinators and the drawing. :func:`block_states` is the one function
that turns a spec into per-block states (empty / partial / full):
:meth:`SpecBase.block_map`, the ``blocked`` planner and the ``flex`` block mask all read it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator, Mapping
from dataclasses import dataclass
from typing import NoReturn, TypeVar

import torch

from attnkit.errors import AttentionInputError
from attnkit.masks.digest import Digestible
from attnkit.masks.runs import Spans
from attnkit.memory import exceeds, refuse

__all__ = ["EMPTY", "FULL", "PARTIAL", "BlockMap", "SpecBase", "block_states", "spec_error"]

EMPTY, PARTIAL, FULL = 0, 1, 2

WHERE = "attnkit.masks"

_Spec = TypeVar("_Spec", bound="SpecBase")

#: :meth:`SpecBase.allows_all` per (spec key, L, S): every layer of a model's forward asks it
#: for the same spec and sizes
_ALLOWS_ALL: OrderedDict[Hashable, tuple[SpecBase, bool]] = OrderedDict()
_ALLOWS_ALL_SIZE = 256


def spec_error(
    call: str, argument: str, problem: str, got: str, expected: str, fix: str
) -> NoReturn:
    """Raise the :class:`~attnkit.AttentionInputError` of a spec constructor."""
    raise AttentionInputError(
        f"{WHERE}.{call}", argument, problem, got=got, expected=expected, fix=fix
    )


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


class SpecBase(Digestible):
    """What every mask rule answers; :class:`~attnkit.masks.MaskSpec` (every spec) builds on it
    and adds the combinators. Rules subclass :class:`~attnkit.masks.MaskSpec`, not this."""

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
    #: the rule places query ``i`` at key position ``i + S - L`` (the end-aligned offset
    #: ``off``: causal, windows, ALiBi, documents), so it is one place for every sequence of a
    #: batch. False for rules of keys alone (padding, key masks, prefixes) and those that hold
    #: each sequence's own position (``sequence_causal``); a rule that does not say counts as
    #: True (a ragged KV cache then refuses it rather than place it wrongly)
    reads_query_position: bool = True
    #: bytes per ``(b, h, q, kv)`` pair that evaluating :meth:`allowed` over a whole grid
    #: allocates besides the mask itself, at most (int64 index arithmetic); see :meth:`dense_bytes`
    scratch_bytes: int = 16
    #: the spec holds (or joins with ``&``) :func:`~attnkit.masks.selected_keys`: each query's
    #: own list of keys, which ``|`` and ``~`` refuse
    selects_keys: bool = False

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

    def split_holes(self) -> tuple[SpecBase, torch.Tensor | None]:
        """This spec with every key mask that has holes, among its parts joined by ``&``,
        replaced by its hull, and those key masks joined (``(B', S')`` bool on the CPU), or
        ``(self, None)`` (the default) where there are none; see
        :func:`~attnkit.masks.key_holes`."""
        return self, None

    def walk(self) -> Iterator[SpecBase]:
        """This spec and every spec it is made of, depth first (``a & b``: itself, then
        ``a``'s and ``b``'s)."""
        yield self
        for v in vars(self).values():
            if isinstance(v, SpecBase):
                yield from v.walk()

    def planning_bytes(self) -> int:
        """The bytes planning this spec block by block allocates beyond its rule: the int64
        prefix sums of every dense mask inside it (:class:`~attnkit.masks.dense.DenseMask`),
        0 for a spec of rules. The backends that plan blocks report it as their L x S memory,
        so that ``auto`` passes them over where it is above attnkit's memory limit."""
        return sum(v.planning_bytes() for v in vars(self).values() if isinstance(v, SpecBase))

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
    def from_fields(cls: type[_Spec], fields: Mapping[str, object]) -> _Spec:
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
        """The mask as a bool tensor ``(B', 1, L, S)`` (``B' = 1`` unless batch-dependent;
        ``(B', H', L, S)`` for selected keys per key/value head).

        A spec with a score bias (``has_bias``) gives a float mask ``(B', H', L, S)`` of
        ``dtype`` instead (``H'`` = ``heads``, or 1): the bias where allowed, ``-inf`` elsewhere.
        """
        dev = torch.device(device) if device is not None else self.device
        self.check_dense(L, S, dev or torch.device("cpu"), dtype)
        B = self.batch or 1
        H = (self.heads or 1) if self.has_bias or self.selects_keys else 1
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


def block_states(
    spec: SpecBase,
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
