"""The gather kernel's torch operations (:mod:`~attnkit.backends.blocked.gather`): the forward
and backward of attention over each query's selected keys where the C++ kernel does not run
(float64, other devices, a block of ring attention in bfloat16/float16, no build), in chunks of
query rows.

Dimension legend: B batch, H query heads, Hkv key/value heads, g = H // Hkv, L query length,
S key length, k keys selected per query, c query rows per chunk, Dk / Dv head dims.

Each chunk gathers its rows' selected K and V rows (``(B, Hkv, c, k, D)``, bounded by
:data:`CHUNK_BYTES`; K and V are read in place, as they are laid out, and never copied whole or
repeated per query head), scores them against the chunk's ``g`` query heads per key/value head
(one small matmul per row), applies the other rules of the spec to the gathered (query, key)
pairs only, and keeps the softmax in float32 (float64 for float64 q); the plan's ``keep`` drops
``-1`` entries and repeated keys. The backward recomputes each chunk's scores from the saved
log-sum-exp and adds the chunk's dK and dV rows into ``dk``/``dv`` with ``index_add_``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from attnkit.masks import MaskSpec
from attnkit.masks.selected import SelectedKeys

__all__ = ["CHUNK_BYTES", "backward", "forward"]

#: the most bytes one chunk's gathered K and V rows take (the kernel's working set)
CHUNK_BYTES = 32 << 20


class GatherPlan(Protocol):
    """What these operations read of :class:`attnkit.backends.blocked.gather.GatherPlan` (a
    protocol, so that this module, which ``gather`` imports, does not import it back)."""

    @property
    def selected(self) -> SelectedKeys: ...
    @property
    def rest(self) -> MaskSpec | None: ...
    @property
    def off(self) -> int: ...
    @property
    def q_start(self) -> int: ...
    @property
    def k_start(self) -> int: ...
    @property
    def keep(self) -> torch.Tensor: ...


def _chunk_rows(p: GatherPlan, k: torch.Tensor, v: torch.Tensor, L: int) -> int:
    B, Hkv = k.shape[0], k.shape[1]
    per_row = B * Hkv * max(p.selected.topk, 1) * (k.shape[3] + v.shape[3]) * k.element_size()
    return max(1, min(L, CHUNK_BYTES // max(per_row, 1)))


@dataclass
class _Chunk:
    """One chunk of query rows: its gathered K/V rows, its allowed pairs and its flat indices."""

    ks: torch.Tensor  # (B, Hkv, c, k, Dk)
    vs: torch.Tensor  # (B, Hkv, c, k, Dv)
    ok: torch.Tensor  # (B, Hkv, c, g | 1, k) bool
    bias: torch.Tensor | None  # (B, Hkv, c, g, k) or None
    flat: torch.Tensor  # (B, Hkv, c, k) int64: row of (B * Hkv * S) in k / v


def _rows(
    t: torch.Tensor, bi: torch.Tensor, hi: torch.Tensor, safe: torch.Tensor, flat: torch.Tensor
) -> torch.Tensor:
    """The rows ``t[b, h, safe[b, h, r, i]]`` ``(B, Hkv, c, k, D)``, read in place: one
    ``index_select`` of whole rows where ``t`` is contiguous, else advanced indexing (strided
    caches)."""
    if t.is_contiguous():
        D = t.shape[3]
        return t.view(-1, D).index_select(0, flat.reshape(-1)).view(*flat.shape, D)
    return t[bi, hi, safe]


def _gather(p: GatherPlan, k: torch.Tensor, v: torch.Tensor, r0: int, r1: int, H: int) -> _Chunk:
    B, Hkv, S = k.shape[0], k.shape[1], k.shape[2]
    g = H // Hkv
    ind = p.selected.ind[:, :, r0:r1].long()  # (B, Hkv' , c, k)
    keep = p.keep[:, :, r0:r1]
    safe = ind.clamp(min=0).expand(B, Hkv, -1, -1)
    bi = torch.arange(B, device=k.device).view(B, 1, 1, 1)
    hi = torch.arange(Hkv, device=k.device).view(1, Hkv, 1, 1)
    flat = (bi * Hkv + hi) * S + safe
    ks, vs = _rows(k, bi, hi, safe, flat), _rows(v, bi, hi, safe, flat)
    ok = keep.unsqueeze(3)  # (B, Hkv', c, 1, k)
    bias = None
    if p.rest is not None:
        c = r1 - r0
        kv = ind.repeat_interleave(g, dim=1) if ind.shape[1] > 1 else ind  # (B, H|1, c, k)
        b = torch.arange(B, device=k.device).view(B, 1, 1, 1)
        h = torch.arange(H, device=k.device).view(1, H, 1, 1)
        q = torch.arange(r0, r1, device=k.device).view(1, 1, c, 1) + p.q_start
        kv = kv.clamp(min=0) + p.k_start  # global positions
        rest = p.rest.allowed(b, h, q, kv, p.off).expand(B, H, c, kv.shape[-1])
        ok = ok & rest.reshape(B, Hkv, g, c, -1).transpose(2, 3)
        if p.rest.has_bias:
            extra = p.rest.bias(b, h, q, kv, p.off)
            if extra is not None:
                full = extra.expand(B, H, c, kv.shape[-1]).reshape(B, Hkv, g, c, -1)
                bias = full.transpose(2, 3)
    return _Chunk(ks, vs, ok, bias, flat)


def _scores(ch: _Chunk, qc: torch.Tensor, scale: float) -> torch.Tensor:
    """Masked, scaled scores ``(B, Hkv, c, g, k)`` (``-inf`` where not allowed)."""
    s = torch.matmul(qc, ch.ks.transpose(-1, -2)) * scale
    if ch.bias is not None:
        s = s + ch.bias.to(s.dtype)
    return s.masked_fill(~ch.ok, float("-inf"))


def _lse_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def forward(
    p: GatherPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``out (B, H, L, Dv)`` and ``lse (B, H, L)`` over each row's selected keys, in the
    accumulation dtype (float32; float64 for float64 q)."""
    B, H, L, _ = q.shape
    Hkv, Dv = k.shape[1], v.shape[3]
    g = H // Hkv
    acc = _lse_dtype(q)
    out = q.new_zeros(B, Hkv, L, g, Dv, dtype=acc)
    lse = q.new_full((B, Hkv, L, g), float("-inf"), dtype=acc)
    qg = q.view(B, Hkv, g, L, -1).transpose(2, 3)  # (B, Hkv, L, g, Dk), a view
    step = _chunk_rows(p, k, v, L)
    with torch.no_grad():
        for r0 in range(0, L if p.selected.topk else 0, step):  # k = 0: no key
            r1 = min(L, r0 + step)
            ch = _gather(p, k, v, r0, r1, H)
            s = _scores(ch, qg[:, :, r0:r1], scale).to(acc)
            m = s.amax(-1, keepdim=True)
            m = torch.where(torch.isfinite(m), m, 0.0)
            e = torch.exp(s - m)
            den = e.sum(-1, keepdim=True)
            o = torch.matmul(e.to(v.dtype), ch.vs).to(acc)
            out[:, :, r0:r1] = torch.where(den > 0, o / den.clamp(min=1e-30), 0.0)
            lse[:, :, r0:r1] = (m + den.log()).squeeze(-1)
    return out.transpose(2, 3).flatten(1, 2), lse.transpose(2, 3).flatten(1, 2)


def backward(
    p: GatherPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dq``, ``dk``, ``dv`` from the saved ``out`` and ``lse``, in the accumulation dtype
    (``dk``/``dv`` summed over the query heads of each key/value head and over every query that
    selected a key)."""
    B, H, L, Dk = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    g = H // Hkv
    acc = _lse_dtype(q)
    dq = q.new_zeros(B, Hkv, L, g, Dk, dtype=acc)
    dk = k.new_zeros(B * Hkv * S, Dk, dtype=acc)
    dv = v.new_zeros(B * Hkv * S, Dv, dtype=acc)

    def grouped(t: torch.Tensor) -> torch.Tensor:  # (B, H, L, X) -> (B, Hkv, L, g, X)
        return t.view(B, Hkv, g, L, t.shape[3]).transpose(2, 3)

    qg, og, dog = grouped(q), grouped(out), grouped(dout)
    lg = lse.view(B, Hkv, g, L).transpose(2, 3).unsqueeze(-1)  # (B, Hkv, L, g, 1)
    step = _chunk_rows(p, k, v, L)
    with torch.no_grad():
        for r0 in range(0, L if p.selected.topk else 0, step):  # k = 0: no key
            r1 = min(L, r0 + step)
            ch = _gather(p, k, v, r0, r1, H)
            qc, doc = qg[:, :, r0:r1].to(acc), dog[:, :, r0:r1].to(acc)
            s = _scores(ch, qg[:, :, r0:r1], scale).to(acc)
            lc = lg[:, :, r0:r1].to(acc)
            pr = torch.exp(s - torch.where(torch.isfinite(lc), lc, 0.0))  # 0 where masked
            dp = torch.matmul(doc, ch.vs.to(acc).transpose(-1, -2))
            d = (doc * og[:, :, r0:r1].to(acc)).sum(-1, keepdim=True)
            ds = pr * (dp - d)
            dq[:, :, r0:r1] = torch.matmul(ds, ch.ks.to(acc)) * scale
            dks = torch.matmul(ds.transpose(-1, -2), qc) * scale  # (B, Hkv, c, k, Dk)
            dvs = torch.matmul(pr.transpose(-1, -2), doc)  # (B, Hkv, c, k, Dv)
            flat = ch.flat.reshape(-1)
            dk.index_add_(0, flat, dks.reshape(-1, Dk))
            dv.index_add_(0, flat, dvs.reshape(-1, Dv))
    dqo = dq.transpose(2, 3).flatten(1, 2)
    return dqo, dk.view(B, Hkv, S, Dk), dv.view(B, Hkv, S, Dv)
