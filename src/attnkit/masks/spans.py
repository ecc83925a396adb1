"""Row spans: a spec as one run of keys per query row, where it is one.

Dimension legend: B batch (``B'`` = 1 when the spec does not depend on it), L query rows, S keys.

Most masks people use allow, for each query row, one contiguous run of keys: causal (keys up to
the row's end-aligned position), sliding windows, documents (packed sequences: the keys of the
row's own document), prefix-LM (the prompt, or up to the row, whichever reaches further), key
padding whose real keys are one run per sequence (left or right padding), and the KV cache's
per-sequence causal rule. Each rule says its runs (:meth:`MaskSpec.key_runs`, built from
:mod:`attnkit.masks.runs`); :func:`row_spans` gives those runs as ``lo, hi`` (inclusive key
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

from typing import NamedTuple, cast

import torch

from attnkit.masks.function import FunctionMask, key_extent
from attnkit.masks.runs import Spans
from attnkit.masks.spec import MaskSpec

__all__ = [
    "SpanDensity",
    "evaluates_function",
    "key_holes",
    "local_keys",
    "row_spans",
    "span_density",
]


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
    with key_extent(k_start, S):  # the keys a function mask searches
        spans = spec.key_runs(pos, off)
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
    bool (``None`` where there are none): the spec is its hull's rule ``&`` the keys. Each rule
    says how it splits (:meth:`MaskSpec.split_holes`).

    >>> from attnkit.masks import causal, key_mask
    >>> keep = torch.tensor([[True, False, True, True, False]])
    >>> rule, keys = key_holes(causal() & key_mask(keep))
    >>> rule.b.keep.tolist(), torch.equal(keys, keep)
    ([[True, True, True, True, False]], True)
    """
    rule, keys = spec.split_holes()
    return cast(MaskSpec, rule), keys  # every spec is a MaskSpec


def local_keys(keys: torch.Tensor, k_start: int, S: int) -> torch.Tensor:
    """The keys ``k_start .. k_start + S - 1`` of :func:`key_holes`'s ``(B', S')`` mask (keys past
    its end are not allowed), ``(B', S)`` bool."""
    local = torch.zeros(keys.shape[0], S, dtype=torch.bool)
    there = keys[:, k_start : k_start + S]
    local[:, : there.shape[1]] = there
    return local


class SpanDensity(NamedTuple):
    """What runs of keys leave of a block map of ``grain x grain`` blocks, and of the pairs."""

    grain: int
    empty: float  # fraction of the blocks that no run touches
    full: float  # fraction of the blocks that every row of the block row covers
    pairs: float  # fraction of the B' x L x S pairs inside the runs

    def describe(self) -> str:
        """In explain's words."""
        g, partial = self.grain, 1.0 - self.empty - self.full
        return (
            f"its runs leave {self.empty:.1%} of {g}x{g} blocks empty ({partial:.1%} partial, "
            f"{self.full:.1%} full); computes {self.pairs:.1%} of the L x S pairs"
        )


def span_density(lo: torch.Tensor, hi: torch.Tensor, S: int, grain: int) -> SpanDensity:
    """The block map of runs ``lo, hi`` (``(B', L)`` local, inclusive, as :func:`row_spans`
    gives them; ``lo`` not decreasing along the rows, as the row-span kernel takes them) at
    ``grain``, from the runs alone: ``O(B' L)`` work, never the ``L x S`` mask."""
    Bm, L = lo.shape
    nq, nk = -(-L // grain), -(-S // grain)
    pad = nq * grain - L  # rows past L: empty runs
    lo = torch.nn.functional.pad(lo, (0, pad), value=S).view(Bm, nq, grain)
    hi = torch.nn.functional.pad(hi, (0, pad), value=-1).view(Bm, nq, grain)
    seen = lo <= hi
    first = torch.div(lo, grain, rounding_mode="floor")
    last = torch.where(seen, torch.div(hi, grain, rounding_mode="floor"), -1)
    before = torch.nn.functional.pad(last.cummax(-1).values[..., :-1], (1, 0), value=-1)
    touched = (last - torch.maximum(first, before + 1) + 1).clamp(min=0).sum((-1, -2))
    rows = torch.full((nq,), grain).index_fill_(0, torch.tensor([nq - 1]), L - (nq - 1) * grain)
    real = torch.arange(grain) < rows[:, None]  # (nq, grain): the rows that exist
    top = torch.where(real, lo, 0).amax(-1)  # (B', nq): every row covers top ..= bottom
    bottom = torch.where(real, hi, S - 1).amin(-1)
    start = torch.div(top + grain - 1, grain, rounding_mode="floor")  # first block inside
    end = torch.where(bottom >= S - 1, nk, torch.div(bottom + 1, grain, rounding_mode="floor"))
    full = (end - start).clamp(min=0).sum(-1)
    blocks = Bm * nq * nk
    pairs = (hi - lo + 1).clamp(min=0).sum()
    return SpanDensity(
        grain,
        1.0 - float(touched.sum()) / blocks,
        float(full.sum()) / blocks,
        float(pairs) / max(Bm * L * S, 1),
    )


def evaluates_function(spec: MaskSpec | None) -> bool:
    """Whether ``spec`` (or a part of its ``&`` / ``|`` / ``~``) is a :func:`from_function`
    mask, whose runs come from evaluating the function."""
    if isinstance(spec, FunctionMask):
        return True
    return any(
        isinstance(part, MaskSpec) and evaluates_function(part)
        for part in (getattr(spec, "a", None), getattr(spec, "b", None))
    )
