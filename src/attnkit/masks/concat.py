"""Two masks side by side over the keys: :func:`concat_keys`.

Dimension legend: B batch, H heads, L query length, S key length, ``S1`` and ``S2`` the key
counts of the two parts (``S = S1 + S2``); ``b, h, q, kv`` are indices and ``off = S - L``.

A decoder that attends to its own keys and an encoder's in one call (T5Gemma 2's merged
attention) concatenates the two masks along the keys: keys ``0 .. S1 - 1`` follow the first
rule, keys ``S1 .. S1 + S2 - 1`` the second. Each part is a spec as it would be alone, over its
own keys and end-aligned to them: the first part is evaluated with ``off1 = off - S2`` (its
``S1`` keys against the call's ``L`` queries), the second at key ``kv - S1`` with
``off2 = off - S1``. So ``concat_keys(causal(), S1, key_mask(keep), S2)`` is
``torch.cat([causal mask (L, S1), keep (1, S2)], dim=-1)`` without the ``L x S`` tensor::

    concat_keys(causal(), 3, unmasked(), 2), for L = 3:
    1 . . | 1 1
    1 1 . | 1 1
    1 1 1 | 1 1

Block bounds combine the parts' bounds over the part of each key block that lies in each part
(a block that straddles ``S1`` is full only where both of its pieces are, and empty only where
both are); a part with no keys in a block does not count. Rows are one run of keys only where
the two parts' runs touch in every row (a decode step that sees all its own keys and all the
encoder's); otherwise :meth:`ConcatKeys.key_runs` says ``None``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator
from typing import cast

import torch

from attnkit.masks.base import spec_error
from attnkit.masks.function import key_extent, searched_keys
from attnkit.masks.runs import HIGH, LOW, Spans, full, union
from attnkit.masks.spec import MaskSpec

__all__ = ["ConcatKeys", "concat_keys"]

_CALL = "concat_keys"


def _count(argument: str, n: object, part: str) -> int:
    """A part's key count: an int >= 0 (or a symbolic size while ``torch.compile`` traces,
    which stands for an int: it is one when the op runs)."""
    if isinstance(n, torch.SymInt):
        return cast(int, n)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        spec_error(
            _CALL,
            argument,
            f"concat_keys({argument}) needs the number of keys of the {part} part, an int >= 0, "
            f"got {n!r}.",
            got=f"{argument}={n!r} ({type(n).__name__})",
            expected=f"{argument} >= 0: how many keys the {part} part's mask covers",
            fix="pass the part's key length as an int, e.g. k.shape[-2] of its keys",
        )
    return n


def _part(argument: str, spec: object, n: int, count: str) -> MaskSpec:
    """A part: a spec of rules (no mask tensor, no selected keys), built for ``n`` keys."""
    if not isinstance(spec, MaskSpec):
        name = type(spec).__name__
        spec_error(
            _CALL,
            argument,
            f"concat_keys({argument}) needs a mask spec, not a {name}.",
            got=f"{argument}: {name}",
            expected="a spec from attnkit.masks (causal(), key_mask(keep), unmasked(), ...)",
            fix="a mask tensor: torch.cat the dense masks instead; None: unmasked()",
        )
    if spec.from_tensor or spec.selects_keys:
        what = "a mask tensor" if spec.from_tensor else "selected_keys(indices)"
        spec_error(
            _CALL,
            argument,
            f"concat_keys({argument}) holds {what}, which lists positions of the whole call's "
            "keys, not of one part's.",
            got=f"{argument}={spec!r}",
            expected="a part made of rules (causal, windows, key masks, documents, functions)",
            fix="combine it with the concatenated spec: concat_keys(...) & selected_keys(i), "
            "or torch.cat the dense masks",
        )
    if spec.length is not None and type(n) is int and spec.length != n:
        spec_error(
            _CALL,
            argument,
            f"the {argument} part {spec!r} is built for {spec.length} keys, not {count} = {n}.",
            got=f"{argument} length {spec.length}  {count}={n}",
            expected=f"{count} == {spec.length}, the length of the part's tensor",
            fix=f"pass the part's own key count as {count}, or build the part from a tensor "
            f"with {n} entries",
        )
    return spec


def _agree(attr: str, what: str, a: MaskSpec, b: MaskSpec) -> int | None:
    x: int | None = getattr(a, attr)
    y: int | None = getattr(b, attr)
    if x is not None and y is not None and x != y:
        spec_error(
            _CALL,
            "second",
            f"the two parts are built for different {what}: {x} and {y}.",
            got=f"first={a!r} ({attr} {x})  second={b!r} ({attr} {y})",
            expected=f"parts that agree on their {what}",
            fix=f"build both parts from the same batch's tensors ({what} must agree)",
        )
    return x if x is not None else y


class ConcatKeys(MaskSpec):
    """The spec of :func:`concat_keys`: keys ``[0, S1)`` follow ``first``, keys
    ``[S1, S1 + S2)`` follow ``second``."""

    def __init__(self, first: MaskSpec, S1: int, second: MaskSpec, S2: int) -> None:
        self.first, self.S1, self.second, self.S2 = first, S1, second, S2
        self.batch = _agree("batch", "batch sizes", first, second)
        self.heads = _agree("heads", "head counts", first, second)
        self.length = S1 + S2
        self.has_bias = first.has_bias or second.has_bias
        self.reads_query_position = first.reads_query_position or second.reads_query_position
        # the parts' own scratch, two clamped int64 key indices and the parts' bool masks
        self.scratch_bytes = first.scratch_bytes + second.scratch_bytes + 18

    def key(self) -> Hashable | None:
        a, b = self.first.key(), self.second.key()
        return None if a is None or b is None else ("concat_keys", a, self.S1, b, self.S2)

    def tensors(self) -> list[torch.Tensor]:
        return self.first.tensors() + self.second.tensors()

    def _indices(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Whether each key is the first part's, and its index inside each part (clamped into
        the part, so that a part's tables are never read out of range)."""
        S1, S2 = self.S1, self.S2
        return kv < S1, kv.clamp(max=S1 - 1), (kv - S1).clamp(0, S2 - 1)

    def allowed(
        self, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, off: int
    ) -> torch.Tensor:
        S1, S2 = self.S1, self.S2
        if S2 == 0:
            return self.first.allowed(b, h, q, kv, off)
        if S1 == 0:
            return self.second.allowed(b, h, q, kv, off)
        in_first, kv1, kv2 = self._indices(kv)
        a = self.first.allowed(b, h, q, kv1, off - S2)
        c = self.second.allowed(b, h, q, kv2, off - S1)
        return torch.where(in_first, a, c)

    def bias(
        self, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, off: int
    ) -> torch.Tensor | None:
        if not self.has_bias:
            return None
        if self.S2 == 0 or self.S1 == 0:  # one part only: its bias, or none
            part = self.first if self.S2 == 0 else self.second
            return part.bias(b, h, q, kv, off) if part.has_bias else None
        in_first, kv1, kv2 = self._indices(kv)
        a = self.first.bias(b, h, q, kv1, off - self.S2) if self.first.has_bias else None
        c = self.second.bias(b, h, q, kv2, off - self.S1) if self.second.has_bias else None
        # a part without a bias adds 0 to its allowed pairs
        return torch.where(in_first, 0.0 if a is None else a, 0.0 if c is None else c)

    def block_bounds(
        self,
        q_lo: torch.Tensor,
        q_hi: torch.Tensor,
        k_lo: torch.Tensor,
        k_hi: torch.Tensor,
        off: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        S1, S2 = self.S1, self.S2
        # per part: which key blocks hold some of its keys, and its bounds over that piece of
        # the block (a block without its keys gets a valid stand-in range, then does not count)
        pieces = []
        if S1 > 0:
            has = k_lo < S1
            lo, hi = k_lo.clamp(max=S1 - 1), k_hi.clamp(max=S1 - 1)
            pieces.append((has, *self.first.block_bounds(q_lo, q_hi, lo, hi, off - S2)))
        if S2 > 0:
            has = k_hi >= S1
            lo, hi = ((k - S1).clamp(0, S2 - 1) for k in (k_lo, k_hi))
            pieces.append((has, *self.second.block_bounds(q_lo, q_hi, lo, hi, off - S1)))
        none = ((q_lo > q_hi) & (k_lo > k_hi))[None, None]  # False, (1, 1, nq, nk)
        any_, all_ = none, ~none
        for has, any_part, all_part in pieces:
            any_ = any_ | (has & any_part)
            all_ = all_ & (~has | all_part)
        return any_, all_

    def key_runs(self, pos: torch.Tensor, off: int) -> Spans | None:
        S1, S2 = self.S1, self.S2
        a = self._part_runs(self.first, pos, off - S2, 0, S1)
        c = self._part_runs(self.second, pos, off - S1, S1, S2) if a is not None else None
        return None if a is None or c is None else union(a, c)

    def _part_runs(
        self, part: MaskSpec, pos: torch.Tensor, off: int, start: int, n: int
    ) -> Spans | None:
        """A part's runs as global key indices of the whole call, clamped into its keys
        ``start .. start + n - 1`` (a row of a part with no keys sees nothing there)."""
        nothing = full(pos, HIGH), full(pos, LOW)
        if n == 0:
            return nothing
        with self._extent(start, n) as searched:
            if searched == 0:  # the keys searched hold none of this part's
                return nothing
            # unmasked() gives no runs of its own (a whole call of it is no mask at all);
            # as a part it is every one of its keys
            every = part.key() == ("unmasked",)
            runs = (full(pos, LOW), full(pos, HIGH)) if every else part.key_runs(pos, off)
        if runs is None:
            return None
        lo, hi = runs
        return lo.clamp(min=0) + start, hi.clamp(max=n - 1) + start

    @contextlib.contextmanager
    def _extent(self, start: int, n: int) -> Iterator[int | None]:
        """Within it, a function part searches the keys of the searched extent
        (:func:`~attnkit.masks.function.key_extent`) that are its own, in its own indices;
        yields how many there are (``None``: no extent is set, the part is not searched)."""
        outer = searched_keys()
        if outer is None:
            yield None
            return
        k0, count = outer
        first, last = max(k0, start), min(k0 + count, start + n)
        with key_extent(first - start, max(last - first, 0)):
            yield max(last - first, 0)

    def __repr__(self) -> str:
        return f"concat_keys({self.first!r}, {self.S1}, {self.second!r}, {self.S2})"

    def __str__(self) -> str:
        """The repr and a drawing for ``L = S1`` queries (the decoder's own keys, as at its
        prefill; 8 rows where ``S1`` is 0): up to 8 rows, and up to 8 keys of each part, the
        parts split by ``|``. Only those pairs are evaluated (batch row 0, head 0)."""
        S1, S2 = int(self.S1), int(self.S2)
        L = S1 if S1 > 0 else 8
        dev = self.device
        zero = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=dev)
        q = torch.arange(min(L, 8), device=dev).view(1, 1, -1, 1)
        keys = [*range(min(S1, 8)), *range(S1, S1 + min(S2, 8))]
        kv = torch.tensor(keys, dtype=torch.long, device=dev).view(1, 1, 1, -1)
        ok = self.allowed(zero, zero, q, kv, S1 + S2 - L).expand(1, 1, q.shape[2], len(keys))
        rows = []
        for row in ok[0, 0].tolist():
            cells = ["1" if x else "." for x in row]
            rows.append(" ".join([*cells[: min(S1, 8)], "|", *cells[min(S1, 8) :]]))
        shown = "" if max(L, S1, S2) <= 8 else "; its first 8 rows and 8 keys of each part"
        head = f"{self!r}, drawn for L = {L}, S = {S1} + {S2}{shown} (1 = may attend):"
        return "\n".join([head, *rows])


def concat_keys(first: MaskSpec, S1: int, second: MaskSpec, S2: int) -> MaskSpec:
    """Two masks side by side over the keys: keys ``0 .. S1 - 1`` follow ``first``, keys
    ``S1 .. S1 + S2 - 1`` follow ``second`` (``second`` sees them as its keys ``0 .. S2 - 1``).

    What ``torch.cat([mask1, mask2], dim=-1)`` of the two parts' dense masks ``(B, 1, L, S1)``
    and ``(B, 1, L, S2)`` gives, without an ``L x (S1 + S2)`` tensor: each part is evaluated
    as it would be alone, end-aligned to its own keys (query ``i`` of ``L`` stands at key
    ``i + S1 - L`` of the first part and ``i + S2 - L`` of the second). The spec is built for
    ``S = S1 + S2`` keys (its ``length``): a call with another ``S`` is refused. Parts hold
    rules (causal, windows, key masks, documents, ALiBi, functions, other concatenations), not
    mask tensors or selected keys (their positions are the whole call's: combine them with
    ``&`` outside).

    >>> import torch
    >>> from attnkit.masks import causal, key_mask
    >>> spec = concat_keys(causal(), 3, key_mask(torch.tensor([[True, False]])), 2)
    >>> print(spec)  # doctest: +NORMALIZE_WHITESPACE
    concat_keys(causal(), 3, key_mask(<bool (1, 2)>), 2), drawn for L = 3, S = 3 + 2
    (1 = may attend):
    1 . . | 1 .
    1 1 . | 1 .
    1 1 1 | 1 .

    Raises:
        AttentionInputError: a count that is not an int >= 0, a part that is not a spec or
            holds a mask tensor or selected keys, a part built for another number of keys
            (its ``length``), or parts built for different batch sizes or head counts.
    """
    n1 = _count("S1", S1, "first")
    n2 = _count("S2", S2, "second")
    return ConcatKeys(_part("first", first, n1, "S1"), n1, _part("second", second, n2, "S2"), n2)
