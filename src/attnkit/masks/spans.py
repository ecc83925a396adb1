"""Row spans: a spec as one run of keys per query row, where it is one.

Dimension legend: B batch (``B'`` = 1 when the spec does not depend on it), L query rows, S keys.

Most masks people use allow, for each query row, one contiguous run of keys: causal (keys up to
the row's end-aligned position), sliding windows, documents (packed sequences: the keys of the
row's own document), prefix-LM (the prompt, or up to the row, whichever reaches further), key
padding whose real keys are one run per sequence (left or right padding), and the KV cache's
per-sequence causal rule. :func:`row_spans` gives those runs as ``lo, hi`` (inclusive key
indices), exactly, for any ``&`` of such specs (the intersection: the larger ``lo``, the smaller
``hi``) and for a ``|`` whose runs touch in every row (their union). Anything else, a score bias
(ALiBi; :func:`~attnkit.masks.split_alibi` separates it from its rule), a key mask with holes
(:func:`key_holes` splits it into its hull, which has runs, and the holes),
documents whose ids come back after another document, ``~``, a mask tensor, gives ``None``: it
is not an interval mask, and a backend keeps to block maps.

attnkit's row-span kernel (:mod:`attnkit.backends.blocked.rowspan`) runs the spans.

>>> from attnkit.masks import causal, sliding_window
>>> lo, hi = row_spans(causal() & sliding_window(3), 5, 5)
>>> lo.tolist(), hi.tolist()
([[0, 0, 0, 1, 2]], [[0, 1, 2, 3, 4]])
"""

from __future__ import annotations

import torch

from attnkit.masks.rules import (
    _Causal,
    _Document,
    _KeyMask,
    _Padding,
    _PrefixKeys,
    _Window,
)
from attnkit.masks.sequence import _SequenceCausal
from attnkit.masks.spec import MaskSpec, _And, _HeadSlice, _Or

__all__ = ["key_holes", "local_keys", "row_spans"]

#: "no bound" on the left and the right, far outside any key index
LOW, HIGH = -(2**40), 2**40

Spans = tuple[torch.Tensor, torch.Tensor]


def row_spans(
    spec: MaskSpec,
    L: int,
    S: int,
    *,
    q_start: int = 0,
    k_start: int = 0,
    off: int | None = None,
) -> Spans | None:
    """The keys each query row may attend, as one run ``lo[b, i] ..= hi[b, i]``, or ``None``
    when ``spec`` is not one run per row (see the module docstring).

    ``L`` local query rows stand at global positions ``q_start + i``, ``S`` local keys at
    ``k_start + j``, with the end-aligned offset ``off`` (default ``S - L``), as in
    :func:`~attnkit.masks.block_states`. Returns int64 CPU tensors ``(B', L)`` of *local* key
    indices clamped to ``0 <= lo <= S`` and ``-1 <= hi <= S - 1``; a row with ``lo > hi`` sees
    nothing. ``lo`` and ``hi`` are not checked for order along the rows (the kernel's plan is).
    """
    off = S - L if off is None else off
    if spec.has_bias:
        return None
    pos = torch.arange(q_start, q_start + L, dtype=torch.long)[None]  # (1, L)
    spans = _spans(spec, pos, off)
    if spans is None:
        return None
    lo, hi = spans
    shape = (max(lo.shape[0], hi.shape[0]), L)
    lo, hi = lo.expand(shape), hi.expand(shape)
    lo = (lo - k_start).clamp(0, S)
    hi = (hi - k_start).clamp(-1, S - 1)
    return lo.contiguous(), hi.contiguous()


def key_holes(spec: MaskSpec) -> tuple[MaskSpec, torch.Tensor | None]:
    """``spec`` with every key mask that has holes, among the parts joined by ``&``, replaced by
    its hull (its real keys from the first to the last), and those key masks joined, ``(B', S')``
    bool (``None`` where there are none): the spec is its hull's rule ``&`` the keys.

    >>> from attnkit.masks import causal, key_mask
    >>> keep = torch.tensor([[True, False, True, True, False]])
    >>> rule, keys = key_holes(causal() & key_mask(keep))
    >>> rule.b.keep.tolist(), torch.equal(keys, keep)
    ([[True, True, True, True, False]], True)
    """
    if type(spec) is _KeyMask and spec.keep.shape[1] > 0:
        keep = spec.keep.detach().to("cpu")
        idx = torch.arange(keep.shape[1])
        first = torch.where(keep, idx, keep.shape[1]).amin(dim=1, keepdim=True)
        last = torch.where(keep, idx, -1).amax(dim=1, keepdim=True)
        hull = (idx >= first) & (idx <= last)
        return (spec, None) if torch.equal(hull, keep) else (_KeyMask(hull), keep)
    if type(spec) is _And:
        a, keys_a = key_holes(spec.a)
        b, keys_b = key_holes(spec.b)
        if keys_a is None and keys_b is None:
            return spec, None
        keys = keys_a if keys_b is None else keys_b if keys_a is None else _and_keys(keys_a, keys_b)
        return a & b, keys
    return spec, None


def _and_keys(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    S = min(a.shape[1], b.shape[1])  # keys past a mask's length are not allowed by it
    return a[:, :S] & b[:, :S]


def local_keys(keys: torch.Tensor, k_start: int, S: int) -> torch.Tensor:
    """The keys ``k_start .. k_start + S - 1`` of :func:`key_holes`'s ``(B', S')`` mask (keys past
    its end are not allowed), ``(B', S)`` bool."""
    local = torch.zeros(keys.shape[0], S, dtype=torch.bool)
    there = keys[:, k_start : k_start + S]
    local[:, : there.shape[1]] = there
    return local


def _full(pos: torch.Tensor, value: int) -> torch.Tensor:
    return torch.full_like(pos, value)


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", torch.long)


def _spans(spec: MaskSpec, pos: torch.Tensor, off: int) -> Spans | None:
    """Global ``(lo, hi)`` (broadcastable to ``(B', L)``) for global query positions ``pos``."""
    kind = type(spec)
    if kind is _Causal:
        return _full(pos, LOW), pos + off
    if kind is _Window:
        size = spec.size  # type: ignore[attr-defined]
        return pos + off - size + 1, pos + off + size - 1
    if kind is _PrefixKeys:
        n = spec.prefix  # type: ignore[attr-defined]
        hi = _cpu(n)[:, None] - 1 if isinstance(n, torch.Tensor) else _full(pos, n - 1)
        return _full(pos, LOW), hi.expand(-1, pos.shape[1])
    if kind is _Padding:
        lengths = _cpu(spec.lengths)[:, None]  # type: ignore[attr-defined]
        lo = _full(pos, LOW).expand(lengths.shape[0], -1)
        q_lengths = spec.q_lengths  # type: ignore[attr-defined]
        if q_lengths is not None:  # padded query rows see nothing
            lo = torch.where(pos < _cpu(q_lengths)[:, None], LOW, HIGH)
        return lo, (lengths - 1).expand(-1, pos.shape[1])
    if kind is _SequenceCausal:
        start = _cpu(spec.lengths - spec.new)[:, None]  # type: ignore[attr-defined]
        return _full(pos, LOW).expand(start.shape[0], -1), pos + start
    if kind is _KeyMask:
        return _key_run(spec.keep, pos)  # type: ignore[attr-defined]
    if kind is _Document:
        return _document_runs(spec.ids, pos + off)  # type: ignore[attr-defined]
    if kind is _HeadSlice:
        return _spans(spec.a, pos, off)  # type: ignore[attr-defined]
    if kind is _And or kind is _Or:
        a = _spans(spec.a, pos, off)  # type: ignore[attr-defined]
        b = _spans(spec.b, pos, off) if a is not None else None  # type: ignore[attr-defined]
        if a is None or b is None:
            return None
        return _intersect(a, b) if kind is _And else _union(a, b)
    return None  # ~spec, a mask tensor, a spec attnkit does not know


def _intersect(a: Spans, b: Spans) -> Spans:
    return torch.maximum(a[0], b[0]), torch.minimum(a[1], b[1])


def _union(a: Spans, b: Spans) -> Spans | None:
    """Two runs per row as one, where in every row they touch (or one of them is empty)."""
    (lo_a, hi_a), (lo_b, hi_b) = a, b
    empty_a, empty_b = lo_a > hi_a, lo_b > hi_b
    touch = (lo_a <= hi_b + 1) & (lo_b <= hi_a + 1)
    if not bool((empty_a | empty_b | touch).all()):
        return None
    lo = torch.where(empty_a, lo_b, torch.where(empty_b, lo_a, torch.minimum(lo_a, lo_b)))
    hi = torch.where(empty_a, hi_b, torch.where(empty_b, hi_a, torch.maximum(hi_a, hi_b)))
    return lo, hi


def _key_run(keep: torch.Tensor, pos: torch.Tensor) -> Spans | None:
    """The real keys of each sequence when they are one run (checked on the tensor's values)."""
    keep = keep.detach().to("cpu")
    B, S = keep.shape
    idx = torch.arange(S)
    first = torch.where(keep, idx, S).amin(dim=1) if S else torch.zeros(B, dtype=torch.long)
    last = torch.where(keep, idx, -1).amax(dim=1) if S else torch.full((B,), -1)
    count = keep.sum(dim=1)
    if not bool(((count == 0) | (count == last - first + 1)).all()):
        return None  # a hole between real keys
    lo = torch.where(count > 0, first, HIGH)[:, None]
    hi = torch.where(count > 0, last, LOW)[:, None]
    return lo.expand(-1, pos.shape[1]), hi.expand(-1, pos.shape[1])


def _document_runs(ids: torch.Tensor, at: torch.Tensor) -> Spans | None:
    """The run of the document at key position ``at`` (clamped into the ids, as the rule
    reads them), when every document is one run of positions."""
    ids = ids.detach().to("cpu")
    Bd, S = ids.shape
    if S == 0:
        return None
    change = ids[:, 1:] != ids[:, :-1]  # (B', S - 1)
    runs = change.sum(dim=1)
    ordered = ids.sort(dim=1).values
    distinct = (ordered[:, 1:] != ordered[:, :-1]).sum(dim=1)
    if not bool((runs == distinct).all()):
        return None  # a document comes back after another one
    idx = torch.arange(S).expand(Bd, S)
    starts = torch.cat([torch.ones(Bd, 1, dtype=torch.bool), change], dim=1)
    ends = torch.cat([change, torch.ones(Bd, 1, dtype=torch.bool)], dim=1)
    run_lo = torch.where(starts, idx, 0).cummax(dim=1).values
    run_hi = torch.where(ends, idx, S).flip(1).cummin(dim=1).values.flip(1)
    run_lo = torch.where(run_lo == 0, LOW, run_lo)  # the first run: nothing before it
    run_hi = torch.where(run_hi == S - 1, HIGH, run_hi)  # the last: keys past S read as it
    p = at.clamp(0, S - 1).expand(Bd, -1)
    return run_lo.gather(1, p), run_hi.gather(1, p)
