"""Mask specs and their combinators: ``&``, ``|``, ``~`` and head slices, and the drawing.

Dimension legend: B batch, H heads, L query length, S key length; ``b, h, q, kv`` are indices.

:class:`MaskSpec` is what every rule is: the protocol of :class:`~attnkit.masks.base.SpecBase`
(predicate, block bounds, runs of keys, fields, dense form) and the ways to combine specs.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from attnkit.masks.base import SpecBase, spec_error
from attnkit.masks.runs import Spans, and_keys, intersect, union

__all__ = ["MaskSpec"]


class MaskSpec(SpecBase):
    """A mask as a predicate on ``(b, h, q_idx, kv_idx)``; True = may attend.

    Subclasses implement :meth:`allowed` (the predicate on broadcastable index tensors),
    :meth:`block_bounds` (per block pair, an over-approximation of "some pair is allowed" and an
    under-approximation of "every pair is allowed") and :meth:`key` (what identifies the spec
    for the plan and kernel caches; ``None`` means "never cache"); where the rule allows one run
    of keys per query row, :meth:`key_runs`. ``off = S - L`` end-aligns the queries: query ``q``
    stands at key position ``q + off``. Specs combine with ``&``, ``|`` and ``~``.
    """

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
        spec built from a tensor of one entry per key, at L = S = that length, or, for a spec
        holding a user's mask tensor, at that tensor's own L and S. Only those pairs are
        evaluated (batch row 0, head 0), never the whole ``L x S`` mask; a spec holding a
        user's mask tensor draws the corner of its dense form."""
        n = 8 if self.length is None else self.length
        if self.selects_keys:  # drawn for the queries the indices list keys for
            n = min(n, _query_rows(self))
        nq, nk = _tensor_sizes(self, n) if self.from_tensor else (n, n)
        sizes = f"L = S = {nq}" if nq == nk else f"L = {nq}, S = {nk}"
        where = sizes + ("" if max(nq, nk) <= 8 else ", its first 8 x 8 pairs")
        corner = self._corner(nq, nk)
        rows = [" ".join("1" if x else "." for x in row) for row in corner.tolist()]
        return "\n".join([f"{self!r}, drawn for {where} (1 = may attend):", *rows])

    def _corner(self, nq: int, nk: int) -> torch.Tensor:
        """Which of the first (up to) 8 x 8 pairs of an ``nq x nk`` call batch row 0 and head 0
        may attend, bool ``(min(nq, 8), min(nk, 8))``."""
        if self.from_tensor:  # the user's tensor is there already: its dense form, as it is
            dense = self.to_dense(nq, nk)[0, 0, :8, :8]
            return dense > float("-inf") if dense.is_floating_point() else dense
        dev, mq, mk = self.device, min(nq, 8), min(nk, 8)
        zero = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=dev)
        q, kv = torch.arange(mq, device=dev), torch.arange(mk, device=dev)
        allowed = self.allowed(zero, zero, q.view(1, 1, mq, 1), kv.view(1, 1, 1, mk), 0)
        return allowed.expand(1, 1, mq, mk)[0, 0]


def _tensor_sizes(spec: SpecBase, n: int) -> tuple[int, int]:
    """The query and key lengths of the first mask tensor inside ``spec`` (a ``DenseMask``'s
    ``(B', H', L', S')``), ``n`` where it broadcasts over one (a size of 1)."""
    for part in spec.walk():
        m = getattr(part, "m", None)
        if isinstance(m, torch.Tensor) and m.dim() == 4:
            return (m.shape[2] if m.shape[2] > 1 else n), (m.shape[3] if m.shape[3] > 1 else n)
    return n, n


def _query_rows(spec: SpecBase) -> int:
    """The query rows of the selected keys inside ``spec`` (``rows``), 8 if none."""
    rows = getattr(spec, "rows", None)
    if isinstance(rows, int):
        return rows
    parts = [v for v in vars(spec).values() if isinstance(v, SpecBase) and v.selects_keys]
    return _query_rows(parts[0]) if parts else 8


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
        self.reads_query_position = a.reads_query_position or b.reads_query_position
        self.scratch_bytes = a.scratch_bytes + b.scratch_bytes + 2  # the parts' bool masks
        self.selects_keys = a.selects_keys or b.selects_keys

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

    def split_holes(self) -> tuple[SpecBase, torch.Tensor | None]:
        a, keys_a = self.a.split_holes()
        b, keys_b = self.b.split_holes()
        if keys_a is None or keys_b is None:
            keys = keys_a if keys_b is None else keys_b
        else:
            keys = and_keys(keys_a, keys_b)
        if keys is None:
            return self, None
        return _And(_spec(a, "&"), _spec(b, "&")), keys

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
        if a.selects_keys or b.selects_keys:
            spec_error(
                "|",
                "other",
                "selected_keys(indices) combines with & only: it lists each query's own keys.",
                got=f"{a!r} | {b!r}",
                expected="selected_keys(...) & other rules",
                fix="add the keys to the indices instead (or use a dense mask tensor)",
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
        if a.selects_keys:
            spec_error(
                "~",
                "spec",
                "selected_keys(indices) cannot be inverted: it lists each query's own keys.",
                got=f"~{a!r}",
                expected="selected_keys(...) & other rules",
                fix="list the keys the queries may attend to in the indices",
            )
        self.a = a
        self.batch, self.heads, self.length = a.batch, a.heads, a.length
        self.from_tensor = a.from_tensor
        self.reads_query_position = a.reads_query_position
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
        self.selects_keys = a.selects_keys
        self.has_bias = a.has_bias
        self.from_tensor = a.from_tensor
        self.reads_query_position = a.reads_query_position
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
