"""Runs of keys per query row: the pieces the rules' :meth:`~attnkit.masks.MaskSpec.key_runs`
are made of.

Dimension legend: B batch (``B'`` = 1 when a rule does not depend on it), L query rows, S keys.

A run is ``(lo, hi)``, inclusive global key indices broadcastable to ``(B', L)``; ``LOW`` and
``HIGH`` stand for "no bound" on the left and the right. :func:`attnkit.masks.row_spans` turns a
spec's runs into the local, clamped spans the row-span kernel reads.
"""

from __future__ import annotations

import torch

__all__ = [
    "HIGH",
    "LOW",
    "Spans",
    "and_keys",
    "document_runs",
    "intersect",
    "key_run",
    "union",
]

#: "no bound" on the left and the right, far outside any key index
LOW, HIGH = -(2**40), 2**40

Spans = tuple[torch.Tensor, torch.Tensor]


def full(pos: torch.Tensor, value: int) -> torch.Tensor:
    """``value`` at every position of ``pos``."""
    return torch.full_like(pos, value)


def cpu(t: torch.Tensor) -> torch.Tensor:
    """A rule's tensor as int64 on the CPU, where runs are computed."""
    return t.detach().to("cpu", torch.long)


def intersect(a: Spans, b: Spans) -> Spans:
    """The keys in both runs of every row: the larger ``lo``, the smaller ``hi``."""
    return torch.maximum(a[0], b[0]), torch.minimum(a[1], b[1])


def union(a: Spans, b: Spans) -> Spans | None:
    """Two runs per row as one, where in every row they touch (or one of them is empty)."""
    (lo_a, hi_a), (lo_b, hi_b) = a, b
    empty_a, empty_b = lo_a > hi_a, lo_b > hi_b
    touch = (lo_a <= hi_b + 1) & (lo_b <= hi_a + 1)
    if not bool((empty_a | empty_b | touch).all()):
        return None
    lo = torch.where(empty_a, lo_b, torch.where(empty_b, lo_a, torch.minimum(lo_a, lo_b)))
    hi = torch.where(empty_a, hi_b, torch.where(empty_b, hi_a, torch.maximum(hi_a, hi_b)))
    return lo, hi


def and_keys(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two ``(B', S')`` key masks joined by ``&``; keys past a mask's length are not allowed
    by it."""
    S = min(a.shape[1], b.shape[1])
    return a[:, :S] & b[:, :S]


def key_run(keep: torch.Tensor, pos: torch.Tensor) -> Spans | None:
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


def document_runs(ids: torch.Tensor, at: torch.Tensor) -> Spans | None:
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
