"""transformers' mask rules read as attnkit specs: :func:`rule_spec`.

Dimension legend: B batch, L query length, S key length.

transformers describes a mask as a *mask function* ``fn(b, h, q_idx, kv_idx) -> bool`` built
from the factories of ``transformers.masking_utils``: ``causal_mask_function``,
``bidirectional_mask_function``, ``sliding_window_overlay(w)``,
``sliding_window_bidirectional_overlay(w)``, ``chunked_overlay(c, left_padding)``,
``padding_mask_function(table)``, ``blockwise_overlay(ids)`` (image tokens),
``packed_sequence_mask_function(ids)`` and ``remap_positions_for_packed_sequence(fn,
position_ids)``, combined by ``and_masks`` / ``or_masks``. Each factory returns a closure; a
rule is recognised by the closure's code object (the same for every closure a factory makes)
and its parameters are read from the closure's cells, never from the model's type. Any part
that is not recognised, or whose parameters are not what the reading assumes (a window that is
not a positive ``int``, a table of the wrong dtype or shape), makes the whole rule unreadable:
:func:`rule_spec` returns ``None`` and the caller runs transformers' own function as a mask
function (:mod:`attnkit.interop.hf_function`).

Queries stand at absolute positions ``q_offset + i`` and keys at ``kv_offset + j``; attnkit's
specs put query ``i`` at key position ``i + S - L``, so a rule that reads the query's position
(causal included) needs ``q_offset + L == kv_offset + S``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, TypeGuard

import torch
import torch.nn.functional as F

from attnkit.masks import MaskSpec, causal, document, key_mask, sliding_window, unmasked

__all__ = ["UNMASKED", "Reading", "padding_keys", "rule_spec"]

#: transformers' bidirectional rule without padding: run as ``mask=None, causal=False``
UNMASKED: MaskSpec = unmasked()


@dataclass(frozen=True)
class Reading:
    """The sizes of one call of the mask interface."""

    B: int
    L: int
    S: int
    q_offset: object
    kv_offset: int

    @property
    def aligned(self) -> bool:
        """Whether the last query stands at the last key (attnkit's specs' convention)."""
        q = self.q_offset
        return type(q) is int and q + self.L == self.kv_offset + self.S

    def columns(self, table: object, fill: int | bool) -> torch.Tensor | None:
        """The ``(B, S)`` columns of a per-position table ``(B, >= kv_offset + S)`` that the
        keys of this call see (padded with ``fill`` past its end, as transformers pads it)."""
        if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.shape[0] != self.B:
            return None
        short = self.kv_offset + self.S - table.shape[1]
        if short > 0:
            table = F.pad(table, (0, short), value=fill)
        return table[:, self.kv_offset : self.kv_offset + self.S]


# A term of a conjunction: "causal", ("after", w) (kv > q - w), ("near", w) (|q - kv| <= w),
# ("remap", position_ids), ("packed", ids), ("block", ids) (image-token groups),
# ("union", [terms, terms, ...]) (or_masks), or a finished spec (MaskSpec).
_Term = object


def _closure(fn: Callable[..., Any]) -> dict[str, Any]:
    cells = fn.__closure__ or ()
    return {n: c.cell_contents for n, c in zip(fn.__code__.co_freevars, cells, strict=True)}


@functools.cache
def _templates(mu: ModuleType) -> dict[Any, str]:
    """The code objects of the closures that masking_utils' rule factories return."""
    table = torch.ones(1, 1, dtype=torch.bool)
    made = {
        "and": mu.and_masks(mu.causal_mask_function),
        "or": mu.or_masks(mu.causal_mask_function),
        "after": mu.sliding_window_overlay(1),
        "near": mu.sliding_window_bidirectional_overlay(1),
        "keys": mu.padding_mask_function(table),
        "chunk": mu.chunked_overlay(1, torch.zeros(1, dtype=torch.long)),
        "block": mu.blockwise_overlay(torch.zeros(1, 1, dtype=torch.long)),
        "packed": mu.packed_sequence_mask_function(torch.zeros(1, 1, dtype=torch.long)),
        "remap": mu.remap_positions_for_packed_sequence(
            mu.causal_mask_function, torch.zeros(1, 1, dtype=torch.long)
        ),
    }
    return {fn.__code__: kind for kind, fn in made.items()}


def _window(cell: dict[str, Any]) -> int | None:
    w = cell.get("sliding_window")
    return w if type(w) is int and w >= 1 else None


def _int_table(t: object) -> TypeGuard[torch.Tensor]:
    return isinstance(t, torch.Tensor) and not t.is_floating_point() and t.dtype != torch.bool


def _terms(mu: ModuleType, fn: object, at: Reading, shifted: bool) -> list[_Term] | None:
    """``fn`` as a conjunction of terms, or ``None`` where a part is not recognised.
    ``shifted``: inside a packed sequence's remapped positions, where only rules of the
    distance ``q - kv`` keep their meaning."""
    if fn is mu.causal_mask_function:
        return ["causal"]
    if fn is mu.bidirectional_mask_function:
        return []
    code = getattr(fn, "__code__", None)
    kind = _templates(mu).get(code) if callable(fn) and code is not None else None
    if kind is None:
        return None
    cell = _closure(fn)  # type: ignore[arg-type]
    if kind == "and":
        terms: list[_Term] = []
        for part in cell["mask_functions"]:
            more = _terms(mu, part, at, shifted)
            if more is None:
                return None
            terms += more
        return terms
    if kind == "or":
        return _union(mu, cell["mask_functions"], at, shifted)
    if kind in ("after", "near"):
        w = _window(cell)
        return None if w is None else [(kind, w)]
    if kind == "remap" and not shifted and _int_table(cell["position_ids"]):
        inner = _terms(mu, cell["mask_function"], at, True)
        return None if inner is None else [*inner, ("remap", cell["position_ids"])]
    if shifted:
        return None  # a table read at remapped positions
    return _table_terms(kind, cell, at)


def _union(mu: ModuleType, parts: Any, at: Reading, shifted: bool) -> list[_Term] | None:
    """``or_masks(*parts)`` as terms: ``("union", [terms of each part])`` (or the one part's
    terms); :func:`_conjunction` states it as ``a | b | ...``."""
    readings = [_terms(mu, part, at, shifted) for part in parts]
    if not readings or any(r is None for r in readings):
        return None
    if len(readings) == 1:
        return readings[0]
    return [("union", readings)]


def _either(readings: list[list[_Term]], at: Reading) -> MaskSpec | None:
    """``a | b | ...`` of the parts' conjunctions."""
    specs = [_conjunction(r, at) for r in readings]
    if any(s is None for s in specs):
        return None
    if any(s is UNMASKED for s in specs):
        return UNMASKED
    spec = specs[0]
    for other in specs[1:]:
        spec = spec | other  # type: ignore[operator]
    return spec


def _table_terms(kind: str, cell: dict[str, Any], at: Reading) -> list[_Term] | None:
    """The rules read from per-position tables (B, >= kv_offset + S)."""
    if kind == "keys":  # padding_mask[b, kv]: no query position involved
        table = cell.get("padding_mask")
        if not isinstance(table, torch.Tensor) or table.dtype != torch.bool:
            return None
        cols = at.columns(table, False)
        return None if cols is None else [_keys(cols)]
    if not at.aligned:
        return None
    if kind == "chunk":  # (kv - pad[b]) // c == (q - pad[b]) // c: documents of c positions
        c, pad = cell.get("chunk_size"), cell.get("left_padding")
        if type(c) is not int or c < 1 or not _int_table(pad) or pad.shape != (at.B,):
            return None
        pos = torch.arange(at.kv_offset, at.kv_offset + at.S, device=pad.device)
        return [document(torch.div(pos[None] - pad[:, None], c, rounding_mode="floor"))]
    if kind == "block":  # same group, group >= 0
        ids = cell.get("block_sequence_ids")
        cols = at.columns(ids, -1) if _int_table(ids) else None
        if cols is None:
            return None
        return [("block", cols.long().clone())]
    if kind == "packed":
        ids = cell.get("packed_sequence_mask")
        cols = at.columns(ids, -1) if _int_table(ids) else None
        if cols is None or at.kv_offset != 0 or cols.shape != (at.B, at.L):
            return None
        return [("packed", cols.long().clone())]
    return None


def _keys(cols: torch.Tensor) -> MaskSpec:
    """``key_mask`` of the columns, or no rule where every key is allowed."""
    if bool(cols.all()):
        return UNMASKED
    return key_mask(cols.clone())  # a copy of its own: no one else writes it


def _consecutive(ids: torch.Tensor, positions: torch.Tensor) -> bool:
    """Whether positions go up by one inside every document of ``ids`` (then a rule of the
    distance between remapped positions is the same rule on the raw indices)."""
    if positions.shape != ids.shape:
        return False
    same = ids[:, 1:] == ids[:, :-1]
    step = (positions[:, 1:] - positions[:, :-1]).to(ids.device) == 1
    return bool((step | ~same).all())


def _spans_within(ids: torch.Tensor, w: int) -> bool:
    """Whether every group ``>= 0`` of each row of ``ids`` lies within ``w`` positions (then
    inside a group ``|q - kv| < w``, and the one-sided window ``kv > q - w`` allows it all)."""
    for row in ids:
        for group in torch.unique(row[row >= 0]).tolist():
            where = (row == group).nonzero()
            if int(where.max() - where.min()) + 1 > w:
                return False
    return True


def _distribute(terms: list[_Term]) -> list[_Term]:
    """``(a | b) & after(w)`` as ``(a & after(w)) | (b & after(w))`` where the conjunction
    has no causal term of its own (Gemma 3's window layers over image blocks)."""
    afters = [t for t in terms if isinstance(t, tuple) and t[0] == "after"]
    unions = [t for t in terms if isinstance(t, tuple) and t[0] == "union"]
    if "causal" in terms or not afters or len(unions) != 1:
        return terms
    rest = [t for t in terms if t not in afters and t is not unions[0]]
    readings = [[*r, *afters] for r in unions[0][1]]
    return [*rest, ("union", readings)]


def _conjunction(terms: list[_Term], at: Reading) -> MaskSpec | None:
    """The terms as one spec, or ``None`` where attnkit cannot state them."""
    terms = _distribute(terms)
    is_causal = "causal" in terms
    if is_causal and not at.aligned:  # causal() puts the last query at the last key
        return None
    parts: list[MaskSpec] = [causal()] if is_causal else []
    packed = [t[1] for t in terms if isinstance(t, tuple) and t[0] == "packed"]
    blocks = [t[1] for t in terms if isinstance(t, tuple) and t[0] == "block"]
    for term in terms:
        if isinstance(term, MaskSpec):
            if term is not UNMASKED:
                parts.append(term)
            continue
        if term == "causal" or not isinstance(term, tuple):
            if term == "causal":
                continue
            return None
        kind, value = term
        if kind in ("after", "near", "remap") and not at.aligned:
            return None
        if kind == "after":  # kv > q - w: with kv <= q the w positions up to q; inside
            # groups no longer than w (and only there: blocks), every key of the group
            if is_causal:
                parts.append(sliding_window(value))
            elif not blocks or not all(_spans_within(b, value) for b in blocks):
                return None
        elif kind == "near":  # |q - kv| <= w: attnkit's window counts w + 1
            parts.append(sliding_window(value + 1))
        elif kind == "remap":
            if not any(_consecutive(p, value) for p in packed):
                return None
        elif kind == "union":
            either = _either(value, at)
            if either is None:
                return None
            if either is not UNMASKED:
                parts.append(either)
        elif kind not in ("packed", "block"):
            return None
    parts += [document(p) for p in packed]
    parts += [document(b) & _keys(b >= 0) for b in blocks]  # same group, group >= 0
    if not parts:
        return UNMASKED
    spec = parts[0]
    for part in parts[1:]:
        spec = spec & part
    return spec


def rule_spec(
    mu: ModuleType, fn: object, padding: torch.Tensor | None, at: Reading
) -> MaskSpec | None:
    """transformers' rule ``fn`` and 2-D padding mask ``padding`` (``(B, >= kv_offset + S)``,
    True = a real token) as one attnkit spec, or ``None`` where that cannot be proven."""
    terms = _terms(mu, fn, at, False)
    if terms is None:
        return None
    if padding is not None:
        keys = padding_keys(padding, at)
        if keys is None:
            return None
        terms.append(keys)
    return _conjunction(terms, at)


def padding_keys(padding: torch.Tensor, at: Reading) -> MaskSpec | None:
    """The 2-D padding mask ``(B, >= kv_offset + S)`` (True = a real token) as the keys this call
    sees, ``key_mask(keep)`` (:data:`UNMASKED` where every key is real), as transformers'
    ``padding_mask_function`` reads it (False past its end); ``None`` where it is not such a
    bool table."""
    if padding.dtype != torch.bool:
        return None
    cols = at.columns(padding, False)
    return None if cols is None else _keys(cols)
