"""Hypothesis strategies shared by the property tests: mask specs, and q, k, v of drawn sizes.

Imported as ``strategies`` (``tests/`` is on ``sys.path``, see conftest), like ``oracle``.

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
Dk query/key head dim, Dv value head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from attnkit import masks
from attnkit.masks import MaskSpec

__all__ = ["LAYOUTS", "Sizes", "atoms", "laid_out", "layout", "qkv", "span_specs", "specs"]


def _lengths(draw: st.DrawFn, B: int, n: int) -> torch.Tensor:
    """``(B,)`` lengths in ``[0, n]``; 0 is an empty sequence."""
    return torch.tensor(draw(st.lists(st.integers(0, n), min_size=B, max_size=B)))


@st.composite
def atoms(draw: st.DrawFn, B: int, L: int, S: int) -> MaskSpec:
    """One built-in spec for B sequences of L queries and S keys.

    ``causal``; ``sliding_window`` (1 to S + 2, wider than the keys included); ``padding`` of the
    keys, and of the queries half the time (query lengths up to ``max(L, S)``: past L every row
    is real); ``key_mask`` of random bits; ``document`` with up to 5 documents, one id row shared
    by the batch or one per sequence; ``prefix_lm`` with one prefix length or one per sequence.
    """
    kind = draw(st.sampled_from(["causal", "window", "padding", "keys", "document", "prefix"]))
    if kind == "causal":
        return masks.causal()
    if kind == "window":
        return masks.sliding_window(draw(st.integers(1, S + 2)))
    if kind == "padding":
        q_lengths = _lengths(draw, B, max(L, S)) if draw(st.booleans()) else None
        return masks.padding(_lengths(draw, B, S), q_lengths)
    if kind == "keys":
        bits = draw(st.lists(st.booleans(), min_size=B * S, max_size=B * S))
        return masks.key_mask(torch.tensor(bits).view(B, S))
    if kind == "document":
        cuts = sorted(draw(st.lists(st.integers(0, S), max_size=4)))
        ids = torch.zeros(S, dtype=torch.long)
        for c in cuts:
            ids[c:] += 1
        return masks.document(ids.expand(B, S).clone() if draw(st.booleans()) else ids)
    if draw(st.booleans()):
        return masks.prefix_lm(_lengths(draw, B, S))
    return masks.prefix_lm(draw(st.integers(0, S)))


@st.composite
def specs(draw: st.DrawFn, B: int, L: int, S: int, depth: int = 2) -> MaskSpec:
    """An :func:`atoms` spec, or up to ``depth`` levels of ``&``, ``|`` and ``~`` over them."""
    if depth == 0 or draw(st.booleans()):
        return draw(atoms(B, L, S))
    op = draw(st.sampled_from(["and", "or", "not"]))
    a = draw(specs(B, L, S, depth - 1))
    if op == "not":
        return ~a
    b = draw(specs(B, L, S, depth - 1))
    return a & b if op == "and" else a | b


@st.composite
def span_atoms(draw: st.DrawFn, B: int, L: int, S: int) -> MaskSpec:
    """One spec that allows one run of keys per query row (what the row-span kernel runs):
    causal; a sliding window, causal or two-sided; documents of uneven lengths, causal or not,
    one id row shared by the batch or one per sequence; prefix-LM; key padding on the right
    (``padding``, of the queries too half the time) or the left (``key_mask`` of one run of
    real keys per sequence); the KV cache's per-sequence causal rule."""
    kind = draw(
        st.sampled_from(["causal", "window", "document", "prefix", "padding", "left", "cache"])
    )
    if kind == "causal":
        return masks.causal()
    if kind == "window":
        w = masks.sliding_window(draw(st.integers(1, S + 2)))
        return masks.causal() & w if draw(st.booleans()) else w
    if kind == "document":
        cuts = sorted(draw(st.lists(st.integers(0, S), max_size=4)))
        ids = torch.zeros(S, dtype=torch.long)
        for c in cuts:
            ids[c:] += 1
        doc = masks.document(ids.expand(B, S).clone() if draw(st.booleans()) else ids)
        return doc & masks.causal() if draw(st.booleans()) else doc
    if kind == "prefix":
        if draw(st.booleans()):
            return masks.prefix_lm(_lengths(draw, B, S))
        return masks.prefix_lm(draw(st.integers(0, S)))
    if kind == "padding":
        q_lengths = _lengths(draw, B, max(L, S)) if draw(st.booleans()) else None
        return masks.padding(_lengths(draw, B, S), q_lengths)
    if kind == "left":
        starts, ends = _lengths(draw, B, S), _lengths(draw, B, S)
        j = torch.arange(S)[None]
        keep = (j >= starts[:, None]) & (j < ends[:, None])  # empty where start >= end
        return masks.key_mask(keep)
    if S < L:
        return masks.causal()
    lengths = torch.tensor(draw(st.lists(st.integers(L, S), min_size=B, max_size=B)))
    return masks.sequence_causal(lengths, L)


@st.composite
def span_specs(draw: st.DrawFn, B: int, L: int, S: int) -> MaskSpec:
    """A :func:`span_atoms` spec, or the ``&`` of two or three of them."""
    spec = draw(span_atoms(B, L, S))
    for _ in range(draw(st.integers(0, 2))):
        spec = spec & draw(span_atoms(B, L, S))
    return spec


@dataclass(frozen=True)
class Sizes:
    """The sizes :func:`qkv` draws from; a size listed twice is drawn twice as often."""

    batch: tuple[int, ...]  # B
    kv_heads: tuple[int, ...]  # Hkv
    groups: tuple[int, ...]  # H = Hkv * group (1: multi-head, Hkv = 1: multi-query)
    lengths: tuple[int, ...]  # L and S, drawn apart
    head_dims: tuple[int, ...]  # Dk
    value_dims: tuple[int, ...]  # Dv when it differs from Dk (Dv = Dk about half the time)


@st.composite
def qkv(
    draw: st.DrawFn, sizes: Sizes, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (B, H, L, Dk), k (B, Hkv, S, Dk), v (B, Hkv, S, Dv): float64 normals cast to ``dtype``,
    so that every dtype sees the same values, each in a drawn memory layout (:func:`layout`)."""
    B = draw(st.sampled_from(sizes.batch))
    Hkv = draw(st.sampled_from(sizes.kv_heads))
    H = Hkv * draw(st.sampled_from(sizes.groups))
    L = draw(st.sampled_from(sizes.lengths))
    S = draw(st.sampled_from(sizes.lengths))
    Dk = draw(st.sampled_from(sizes.head_dims))
    Dv = draw(st.one_of(st.just(Dk), st.sampled_from(sizes.value_dims)))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    q = torch.randn(B, H, L, Dk, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(B, Hkv, S, Dk, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(B, Hkv, S, Dv, generator=g, dtype=torch.float64).to(dtype)
    return draw(layout(q)), draw(layout(k)), draw(layout(v))


#: memory layouts of the same values (``laid_out``); contiguous is drawn twice as often
LAYOUTS = ("contiguous", "contiguous", "heads-second", "strided", "transposed")


def laid_out(t: torch.Tensor, kind: str) -> torch.Tensor:
    """``t`` (B, H, N, D) with the same values in another memory layout:

    * ``heads-second``: (B, N, H, D) in memory, as projections produce it (nn.MultiheadAttention,
      Hugging Face models) before ``.transpose(1, 2)``;
    * ``strided``: every other element of a row twice as wide, ``x[..., ::2]`` (last-dim stride 2);
    * ``transposed``: (B, H, D, N) in memory, ``kt.transpose(-1, -2)`` of a K^T cache.
    """
    if kind == "heads-second":
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    if kind == "strided":
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        wide[..., ::2] = t
        return wide[..., ::2]
    if kind == "transposed":
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    return t


@st.composite
def layout(draw: st.DrawFn, t: torch.Tensor) -> torch.Tensor:
    """``t`` in a drawn memory layout (:data:`LAYOUTS`): every backend must read strides."""
    return laid_out(t, draw(st.sampled_from(LAYOUTS)))
