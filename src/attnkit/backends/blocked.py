"""The ``blocked`` backend: exact attention that visits only the blocks a mask leaves non-empty.

Dimension legend: B batch, H query heads, Hkv key/value heads, G = H // Hkv, L query length,
S key length, Dk query/key head dim, Dv value head dim; R query rows per tile, W keys per call,
n tiles per call.

How it works (see :mod:`attnkit.backends.blocked_plan` for the plan):

* a mask spec (or a dense mask, or the causal rule) becomes a *plan*: kernel calls, each on
  ``n`` tiles of ``R`` query rows against ``W`` keys, with a bool mask only where blocks are
  partial. Plans are cached per (spec, sizes), so the per-call cost is the kernels alone;
* each call runs torch's fused CPU flash kernel (the one behind
  ``F.scaled_dot_product_attention``, through ``aten._scaled_dot_product_flash_attention_for_cpu``
  which also returns the log-sum-exp), batching the ``n`` tiles of a sliding window through
  ``as_strided`` views (no copies of q, k or v). Where that kernel does not apply (``Dv != Dk``,
  not on CPU), a plain matmul kernel runs the same tiles, in float32 for half types;
* a causal sliding window (``causal() & sliding_window(w)``, float32, CPU, whole sequence)
  runs forward and backward in one pass each of attnkit's own AVX2 kernel instead
  (:mod:`attnkit.backends.band`), about 1.5-2x torch's kernel on the tiles;
* several calls on the same rows merge by the log-sum-exp rule (online softmax);
* the backward recomputes each call from the saved log-sum-exp (the flash-attention backward),
  so training keeps q, k, v, the output and ``lse (B, H, L)``: memory grows with L, not L x S.

Grouped-query heads go to the kernels as they are (``Hkv`` heads, never repeated). A query row
with nothing to attend to gets output 0, log-sum-exp ``-inf`` and gradient 0.

:func:`forward_with_lse` and :func:`backward_from_lse` are public: ring attention merges their
partial results across devices.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from attnkit.backends import Mask
from attnkit.backends import band as band_kernel
from attnkit.backends.blocked_plan import (
    BACKWARD_KEY_BYTES,
    Call,
    Plan,
    allowed,
    make_plan,
    spec_key,
    tile_index,
)
from attnkit.masks import MaskSpec, causal_window
from attnkit.masks import causal as causal_spec

__all__ = ["DESCRIPTION", "backward_from_lse", "check", "forward_with_lse", "note", "rule", "run"]

DESCRIPTION = (
    "block-sparse online softmax: visits only non-empty blocks of a mask spec, "
    "torch's fused kernel per block (attnkit's own for causal windows), own backward "
    "(memory grows with L)"
)

#: auto takes ``blocked`` for a mask spec once L x S reaches this (calibrated with
#: ``attnkit bench``: below it one fused call on the materialised mask is as fast)
MIN_PAIRS = 128 * 128
#: bytes of kernel outputs (gradients of the tiles' keys and values) per batch of tiles
TILE_BYTES = 64 << 20
#: the same for the forward (outputs and lse): launches this small reuse the allocator's memory
#: instead of page-faulting fresh outputs on every call (calibrated with ``attnkit bench``:
#: about 15% faster for a 256-window band than one launch of every tile)
FORWARD_TILE_BYTES = 16 << 20
PLAN_CACHE_SIZE = 32

_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
_PLANS: OrderedDict[Hashable, Plan] = OrderedDict()


# --- plans -------------------------------------------------------------------------------


def _plan_for(
    mask: MaskSpec | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_start: int,
    k_start: int,
    L_total: int | None,
    S_total: int | None,
    backward: bool = False,
) -> Plan:
    B, H, L, Dk = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    off = (S if S_total is None else S_total) - (L if L_total is None else L_total)
    skey = spec_key(mask) if mask is not None else ()
    key = (skey, L, S, q_start, k_start, off, B, H, Hkv, Dk, Dv, q.device, backward)
    if skey is not None and key in _PLANS:
        _PLANS.move_to_end(key)
        return _PLANS[key]
    plan = make_plan(
        mask,
        L=L,
        S=S,
        q_start=q_start,
        k_start=k_start,
        off=off,
        batch=B,
        heads=H,
        pair_flops=(5.0 if backward else 2.0) * B * H * (Dk + Dv),
        key_bytes=BACKWARD_KEY_BYTES * B * Hkv * (Dk + Dv) if backward else 0.0,
        device=q.device,
    )
    if skey is not None:
        _PLANS[key] = plan
        while len(_PLANS) > PLAN_CACHE_SIZE:
            _PLANS.popitem(last=False)
    return plan


# --- kernels -----------------------------------------------------------------------------


def _acc(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype: float64 for float64, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _fused(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether torch's fused CPU flash kernel serves these tiles."""
    return (
        _FLASH is not None
        and _FLASH_BWD is not None
        and q.device.type == "cpu"
        and q.shape[-1] == v.shape[-1]
    )


def _mm_scores(
    q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Scaled, masked scores ``(n, H, R, W)`` in the accumulation dtype, GQA without copies."""
    n, Hq, R, Dk = q.shape
    Hk, W = k.shape[1], k.shape[2]
    acc = _acc(q.dtype)
    qg = q.to(acc).reshape(n, Hk, (Hq // Hk) * R, Dk)  # (n, Hkv, G*R, Dk)
    s = (qg @ k.to(acc).transpose(-1, -2)).view(n, Hq, R, W) * scale
    return s if mask is None else s + mask.to(acc)


def _kernel_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (n, H, R, Dv), lse (n, H, R))`` of tiles ``q (n, H, R, Dk)`` against
    ``k (n, Hkv, W, Dk)``, ``v (n, Hkv, W, Dv)``, float ``mask`` added to the scaled scores."""
    if _fused(q, v):
        assert _FLASH is not None
        out, lse = _FLASH(q, k, v, 0.0, False, attn_mask=mask, scale=scale)
        return out, lse
    n, Hq, R, _ = q.shape
    Hk, W, Dv = k.shape[1], k.shape[2], v.shape[3]
    s = _mm_scores(q, k, mask, scale)  # (n, H, R, W)
    lse = torch.logsumexp(s, dim=-1)  # (n, H, R); -inf for rows that see nothing
    p = torch.exp(s - lse.masked_fill(lse == -math.inf, 0.0)[..., None])
    out = p.view(n, Hk, (Hq // Hk) * R, W) @ v.to(p.dtype)  # (n, Hkv, G*R, Dv)
    return out.view(n, Hq, R, Dv), lse


def _kernel_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flash-attention backward of one batch of tiles, given the *final* ``out`` and ``lse``
    (``+inf`` for rows that see nothing): ``P = exp(s - lse)``, ``dS = P * (dP - D)``."""
    if _fused(q, v):
        assert _FLASH_BWD is not None
        dq, dk, dv = _FLASH_BWD(dout, q, k, v, out, lse, 0.0, False, attn_mask=mask, scale=scale)
        return dq, dk, dv
    n, Hq, R, Dk = q.shape
    Hk, W, Dv = k.shape[1], k.shape[2], v.shape[3]
    GR = (Hq // Hk) * R
    acc = _acc(q.dtype)
    p = torch.exp(_mm_scores(q, k, mask, scale) - lse.to(acc)[..., None])  # (n, H, R, W)
    do = dout.to(acc)
    dp = (do.reshape(n, Hk, GR, Dv) @ v.to(acc).transpose(-1, -2)).view(n, Hq, R, W)
    ds = p * (dp - (do * out.to(acc)).sum(-1, keepdim=True))  # (n, H, R, W)
    ds_g = ds.view(n, Hk, GR, W)
    dq = (ds_g @ k.to(acc)).view(n, Hq, R, Dk) * scale
    dk = ds_g.transpose(-1, -2) @ q.to(acc).reshape(n, Hk, GR, Dk) * scale  # (n, Hkv, W, Dk)
    dv = p.view(n, Hk, GR, W).transpose(-1, -2) @ do.reshape(n, Hk, GR, Dv)  # (n, Hkv, W, Dv)
    return dq, dk, dv


# --- tiles as views --------------------------------------------------------------------


def _tiles(
    t: torch.Tensor, b: int | None, heads: slice, first: int, step: int, size: int, m: int
) -> torch.Tensor:
    """``m`` tiles of ``t (B, Ht, N, ...)`` along N, tile ``i`` at ``first + i*step``:
    ``(Bsel, Hsel, size, ...)`` for one tile, ``(m, Hsel, size, ...)`` (one batch entry, an
    ``as_strided`` view, no copy) for several."""
    x = t[:, heads] if b is None else t[b : b + 1, heads]
    if m == 1:
        return x[:, :, first : first + size]
    st = x.stride()
    return x.as_strided(
        (m, x.shape[1], size, *x.shape[3:]),
        (step * st[2], st[1], st[2], *st[3:]),
        x.storage_offset() + first * st[2],
    )


def _launches(
    c: Call, B: int, per_tile_bytes: int, budget: int | None = None
) -> list[tuple[int | None, int, int]]:
    """(batch entry or None for all, first tile, end tile) of each kernel launch of ``c``,
    each launch's outputs within ``budget`` bytes (default :data:`TILE_BYTES`)."""
    if c.n == 1:
        return [(c.b, 0, 1)]
    budget = TILE_BYTES if budget is None else min(budget, TILE_BYTES)
    chunk = max(1, budget // max(per_tile_bytes, 1))
    entries = [c.b] if c.b is not None else list(range(B))
    return [(b, s, min(c.n, s + chunk)) for b in entries for s in range(0, c.n, chunk)]


def _heads(c: Call, G: int) -> tuple[slice, slice]:
    if c.h is None:
        return slice(None), slice(None)
    return slice(c.h, c.h + 1), slice(c.h // G, c.h // G + 1)


def _mask_for(
    plan: Plan, c: Call, s: int, e: int, dtype: torch.dtype, H: int, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The float mask (added to the scaled scores) of tiles ``s:e`` of ``c``, and its dead
    rows ``(m or 1, 1, R)``."""
    spec = plan.spec
    ok: torch.Tensor | None = None  # bool (m or 1, 1, R, W)
    dead = None if c.dead is None else (c.dead if c.dead.shape[0] == 1 else c.dead[s:e])
    if c.masked and c.lazy:
        ok = allowed(plan, c, s, e, device)[:, None]
        gone = ~ok.any(-1)
        dead = gone if bool(gone.any()) else None
    elif c.masked:
        assert c.mask is not None
        ok = c.mask if c.mask.shape[0] == 1 else c.mask[s:e]
    if spec is not None and spec.has_bias:
        rows, keys = tile_index(c, s, e, device)  # (m, R, 1), (m, 1, W)
        b = torch.full((1, 1, 1, 1), c.b or 0, dtype=torch.long, device=device)
        h = torch.arange(H, device=device) if c.h is None else torch.tensor([c.h], device=device)
        bias = spec.bias(
            b,
            h.view(1, -1, 1, 1),
            (rows + plan.q_start)[:, None],
            (keys + plan.k_start)[:, None],
            plan.off,
        )
        if bias is not None:
            bias = bias.to(dtype)
            if ok is None:
                return bias, dead
            return bias.masked_fill(~ok, -math.inf), dead
    if ok is None:
        return None, dead
    if c.lazy:
        return torch.zeros(ok.shape, dtype=dtype, device=device).masked_fill_(~ok, -math.inf), dead
    assert c.mask is not None
    if dtype not in c._float:
        c._float[dtype] = torch.zeros(c.mask.shape, dtype=dtype, device=device).masked_fill_(
            ~c.mask, -math.inf
        )
    full = c._float[dtype]
    return (full if full.shape[0] == 1 else full[s:e]), dead


# --- forward and backward over a plan -------------------------------------------------


def _merge(ov: torch.Tensor, lv: torch.Tensor, o: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge a partial result ``(o, lse)`` into ``(ov, lv)`` in place (online softmax)."""
    m = torch.maximum(lv, lse)
    m = torch.where(torch.isfinite(m), m, 0.0)  # rows dead in both stay (0, -inf)
    a, c = torch.exp(lv - m), torch.exp(lse - m)
    s = a + c
    ov.mul_(a[..., None]).add_(o * c[..., None]).div_(torch.where(s > 0, s, 1.0)[..., None])
    lv.copy_(m + torch.log(s))


def _forward(
    plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, L, _Dk = q.shape
    Hkv, Dv = k.shape[1], v.shape[3]
    acc = _acc(q.dtype)
    if (
        len(plan.calls) == 1
        and plan.calls[0].R == L
        and plan.calls[0].b is None
        and plan.calls[0].h is None
    ):
        c = plan.calls[0]  # one call covers everything (no mask, or one dense tile): no copies
        mask, dead = _mask_for(plan, c, 0, 1, q.dtype, H, q.device)
        o, lse_c = _kernel_forward(
            q, k[:, :, c.k0 : c.k0 + c.W], v[:, :, c.k0 : c.k0 + c.W], mask, scale
        )
        if dead is not None:
            lse_c = lse_c.masked_fill(dead, -math.inf)
        return o.to(acc), lse_c.to(acc)
    new = torch.empty if plan.covers else torch.zeros  # rows no call writes stay (0, -inf)
    out = new((B, H, L, Dv), dtype=acc, device=q.device)
    lse = torch.full((B, H, L), -math.inf, dtype=acc, device=q.device)
    for c in plan.calls:
        qh, kh = _heads(c, H // Hkv)
        per_tile = c.R * H * (Dv + 1) * 8  # the tiles' outputs and lse (masks are shared)
        if c.lazy or (plan.spec is not None and plan.spec.has_bias):
            per_tile += c.R * c.W * H * 4  # masks built per launch
        for b, s, e in _launches(c, B, per_tile, FORWARD_TILE_BYTES):
            m = e - s
            q0, k0 = c.q0 + s * c.q_step, c.k0 + s * c.k_step
            mask, dead = _mask_for(plan, c, s, e, q.dtype, H, q.device)
            o, lse_c = _kernel_forward(
                _tiles(q, b, qh, q0, c.q_step, c.R, m),
                _tiles(k, b, kh, k0, c.k_step, c.W, m),
                _tiles(v, b, kh, k0, c.k_step, c.W, m),
                mask,
                scale,
            )
            if dead is not None:
                lse_c = lse_c.masked_fill(dead, -math.inf)
            ov = _tiles(out, b, qh, q0, c.q_step, c.R, m)
            lv = _tiles(lse, b, qh, q0, c.q_step, c.R, m)
            if c.first:
                ov.copy_(o)
                lv.copy_(lse_c)
            else:
                _merge(ov, lv, o.to(acc), lse_c.to(acc))
    return out, lse


def _add_keys(
    grad: torch.Tensor, g: torch.Tensor, c: Call, b: int | None, kh: slice, k0: int, m: int
) -> None:
    """Add the key-side gradient ``g`` of ``m`` tiles (``(m or Bsel, Hkv, W, D)``) into
    ``grad (B, Hkv, S, D)``; overlapping key windows (a band) are summed by one ``index_add_``."""
    if m == 1:
        _tiles(grad, b, kh, k0, c.k_step, c.W, 1).add_(g)
        return
    assert b is not None  # several tiles in one launch serve one batch entry
    keys = k0 + torch.arange(m, device=g.device)[:, None] * c.k_step
    keys = (keys + torch.arange(c.W, device=g.device)).reshape(-1)  # (m*W,)
    rows = g.transpose(1, 2).reshape(m * c.W, *g.shape[1:2], g.shape[3])  # (m*W, Hkv, D)
    grad[b, kh].transpose(0, 1).index_add_(0, keys, rows)


def _backward(
    plan: Plan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, H, L, Dk = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    acc = _acc(q.dtype)
    out = out.to(q.dtype)
    dout = dout.to(q.dtype).contiguous()
    lse = lse.to(acc).masked_fill(lse == -math.inf, math.inf)  # rows that see nothing: P = 0
    # (B, N, H, D) in memory, the layout the fused kernel returns its gradients in, so that
    # adding a batch of tile gradients streams through memory
    dq = torch.zeros(B, L, H, Dk, dtype=acc, device=q.device).transpose(1, 2)
    dk = torch.zeros(B, S, Hkv, Dk, dtype=acc, device=q.device).transpose(1, 2)
    dv = torch.zeros(B, S, Hkv, Dv, dtype=acc, device=q.device).transpose(1, 2)
    for c in plan.calls:
        qh, kh = _heads(c, H // Hkv)
        per_tile = (c.R * H * (Dk + Dv) + c.W * Hkv * (Dk + Dv)) * 8  # the tiles' gradients
        for b, s, e in _launches(c, B, per_tile):
            m = e - s
            q0, k0 = c.q0 + s * c.q_step, c.k0 + s * c.k_step
            mask, _ = _mask_for(plan, c, s, e, q.dtype, H, q.device)
            dq_c, dk_c, dv_c = _kernel_backward(
                _tiles(dout, b, qh, q0, c.q_step, c.R, m),
                _tiles(q, b, qh, q0, c.q_step, c.R, m),
                _tiles(k, b, kh, k0, c.k_step, c.W, m),
                _tiles(v, b, kh, k0, c.k_step, c.W, m),
                _tiles(out, b, qh, q0, c.q_step, c.R, m),
                _tiles(lse, b, qh, q0, c.q_step, c.R, m),
                mask,
                scale,
            )
            _tiles(dq, b, qh, q0, c.q_step, c.R, m).add_(dq_c)
            _add_keys(dk, dk_c, c, b, kh, k0, m)
            _add_keys(dv, dv_c, c, b, kh, k0, m)
    return dq, dk, dv


# --- the band: attnkit's own kernel ------------------------------------------------------


def _band(
    mask: MaskSpec | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_start: int,
    k_start: int,
    L_total: int | None,
    S_total: int | None,
) -> int | None:
    """The window, when the band kernel serves this whole-sequence call."""
    w = causal_window(mask)
    if w is None or q_start or k_start:
        return None
    L, S = q.shape[2], k.shape[2]
    if (L_total not in (None, L)) or (S_total not in (None, S)):
        return None
    return w if band_kernel.serves(q, k, v) else None


# --- the public block functions (ring attention builds on these) ------------------------


def forward_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: MaskSpec | None,
    scale: float,
    q_start: int = 0,
    k_start: int = 0,
    L_total: int | None = None,
    S_total: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a slice of queries against a slice of keys, with its log-sum-exp.

    Args:
        q: ``(B, H, Lq, Dk)``, the queries at global positions ``q_start .. q_start + Lq - 1``
            of a sequence of ``L_total`` queries (default ``Lq``).
        k: ``(B, Hkv, Sk, Dk)``, the keys at global positions ``k_start ..`` of ``S_total``
            (default ``Sk``). ``H % Hkv == 0``; K/V are never repeated per query head.
        v: ``(B, Hkv, Sk, Dv)``.
        mask: a spec from :mod:`attnkit.masks` evaluated at the *global* positions with
            ``off = S_total - L_total`` (end-aligned, as everywhere in attnkit), or ``None``.
        scale: multiplies ``q @ k^T``.

    Returns:
        ``out (B, H, Lq, Dv)`` and ``lse (B, H, Lq)``, both float32 (float64 when q is
        float64): the softmax over this block's keys only. A row with no allowed key here
        has ``out`` 0 and ``lse`` ``-inf``. Partial results merge exactly::

            lse = torch.logaddexp(lse1, lse2)
            out = out1 * (lse1 - lse).exp()[..., None] + out2 * (lse2 - lse).exp()[..., None]

    Inputs are not validated (call :func:`attnkit.attention` for that); no autograd graph is
    built.

    >>> q = torch.randn(1, 4, 8, 16); k = v = torch.randn(1, 2, 8, 16)
    >>> out, lse = forward_with_lse(q, k, v, mask=None, scale=0.25)
    >>> out.shape, lse.shape
    (torch.Size([1, 4, 8, 16]), torch.Size([1, 4, 8]))
    """
    with torch.no_grad():
        w = _band(mask, q, k, v, q_start, k_start, L_total, S_total)
        if w is not None:  # causal sliding window, float32 on CPU: attnkit's band kernel
            return band_kernel.forward(q, k, v, w, scale)
        plan = _plan_for(mask, q, k, v, q_start, k_start, L_total, S_total)
        return _forward(plan, q, k, v, scale)


def backward_from_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    *,
    mask: MaskSpec | None,
    scale: float,
    q_start: int = 0,
    k_start: int = 0,
    L_total: int | None = None,
    S_total: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one (query slice, key slice) block, given the *final* output and lse.

    The flash-attention backward: ``P = exp(q @ k^T * scale - lse)`` on allowed pairs,
    ``dP = dout @ v^T``, ``D = rowsum(dout * out)``, ``dS = P * (dP - D)``; then
    ``dq = dS @ k * scale``, ``dk = dS^T @ q * scale``, ``dv = P^T @ dout``. With the globally
    merged ``out (B, H, Lq, Dv)`` and ``lse (B, H, Lq)`` (``-inf`` where a row sees nothing
    anywhere), the gradients of all blocks sum to the gradients of the whole attention.
    Positions, ``mask`` and ``scale`` as in :func:`forward_with_lse`.

    Returns:
        ``dq (B, H, Lq, Dk)``, ``dk (B, Hkv, Sk, Dk)``, ``dv (B, Hkv, Sk, Dv)`` in float32
        (float64 for float64 q); ``dk``/``dv`` are summed over the query heads of each key/value
        head.

    >>> q = torch.randn(1, 4, 8, 16); k = v = torch.randn(1, 2, 8, 16)
    >>> out, lse = forward_with_lse(q, k, v, mask=None, scale=0.25)
    >>> dq, dk, dv = backward_from_lse(q, k, v, out, torch.ones_like(out), lse,
    ...                                mask=None, scale=0.25)
    >>> dk.shape
    torch.Size([1, 2, 8, 16])
    """
    with torch.no_grad():
        w = _band(mask, q, k, v, q_start, k_start, L_total, S_total)
        if w is not None and out.dtype == dout.dtype == lse.dtype == torch.float32:
            return band_kernel.backward(q, k, v, out, dout, lse, w, scale)
        plan = _plan_for(mask, q, k, v, q_start, k_start, L_total, S_total, backward=True)
        return _backward(plan, q, k, v, out, dout, lse, scale)


class _BlockedAttention(torch.autograd.Function):
    """Autograd over :func:`forward_with_lse` / :func:`backward_from_lse`: saves q, k, v, the
    output and ``lse (B, H, L)``, nothing of size L x S."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: MaskSpec | None,
        scale: float,
    ) -> torch.Tensor:
        out, lse = forward_with_lse(q, k, v, mask=mask, scale=scale)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask, ctx.scale = mask, scale
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = backward_from_lse(q, k, v, out, dout, lse, mask=ctx.mask, scale=ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


# --- dense masks as specs ------------------------------------------------------------


class _DenseMask(MaskSpec):
    """A materialised mask seen as a spec, so that its empty blocks are skipped too.

    ``mask`` broadcasts to ``(B, H, L, S)``: bool (True = may attend) or float (added to the
    scores; ``-inf`` blocks). Block bounds come from 2-D prefix sums of the allowed pairs.
    """

    def __init__(self, mask: torch.Tensor) -> None:
        m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))  # (B', H', L', S')
        self.m = m
        self.ok = m if m.dtype == torch.bool else m != -math.inf
        self.has_bias = m.is_floating_point()
        self.batch = m.shape[0] if m.shape[0] > 1 else None
        self.heads = m.shape[1] if m.shape[1] > 1 else None
        self._sums: torch.Tensor | None = None

    def _index(
        self, t: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
    ) -> torch.Tensor:
        sizes = t.shape
        idx = [
            x if n > 1 else torch.zeros_like(x) for x, n in zip((b, h, q, kv), sizes, strict=True)
        ]
        return t[idx[0], idx[1], idx[2], idx[3]]

    def allowed(self, b, h, q, kv, off):  # type: ignore[no-untyped-def]
        return self._index(self.ok, b, h, q, kv)

    def bias(self, b, h, q, kv, off):  # type: ignore[no-untyped-def]
        return self._index(self.m, b, h, q, kv) if self.has_bias else None

    def block_bounds(self, q_lo, q_hi, k_lo, k_hi, off):  # type: ignore[no-untyped-def]
        if self._sums is None:
            ok = self.ok.to(torch.int64)
            self._sums = torch.nn.functional.pad(ok.cumsum(2).cumsum(3), (1, 0, 1, 0))
        c = self._sums  # (B', H', L'+1, S'+1)
        Lm, Sm = self.ok.shape[2], self.ok.shape[3]
        # a broadcast (size-1) dim stands for every position: clamp the bounds into it
        qa, qb = (q_lo.clamp(max=0), q_hi.clamp(max=0)) if Lm == 1 else (q_lo, q_hi)
        ka, kb = (k_lo.clamp(max=0), k_hi.clamp(max=0)) if Sm == 1 else (k_lo, k_hi)
        qa, qb, ka, kb = (x.view(x.shape[-2], x.shape[-1]) for x in (qa, qb, ka, kb))
        n = c[:, :, qb + 1, kb + 1] - c[:, :, qa, kb + 1] - c[:, :, qb + 1, ka] + c[:, :, qa, ka]
        area = (qb - qa + 1) * (kb - ka + 1)
        return n > 0, n == area

    def __repr__(self) -> str:
        kind = "bool" if self.m.dtype == torch.bool else "float"
        return f"dense {kind} mask {tuple(self.m.shape)}"


# --- the backend ---------------------------------------------------------------------------


def _spec(mask: Mask, causal: bool) -> MaskSpec | None:
    if isinstance(mask, MaskSpec):
        return mask
    if isinstance(mask, torch.Tensor):
        return _DenseMask(mask)
    return causal_spec() if causal else None


def run(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: Mask,
    causal: bool,
    scale: float,
    dropout_p: float,
    return_weights: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    spec = _spec(mask, causal)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        out: torch.Tensor = _BlockedAttention.apply(q, k, v, spec, scale)  # type: ignore[no-untyped-call]
        return out, None
    return forward_with_lse(q, k, v, mask=spec, scale=scale)[0].to(q.dtype), None


def check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: Mask,
    causal: bool,
    scale: float,
    dropout_p: float,
    return_weights: bool,
) -> str | None:
    if return_weights:
        return "it never forms the attention weights (return_weights=True)"
    if dropout_p > 0.0:
        return "it has no dropout (dropout_p > 0)"
    if isinstance(mask, torch.Tensor) and mask.requires_grad and torch.is_grad_enabled():
        return "it does not differentiate a float mask"
    return None


def rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: Mask,
    causal: bool,
    scale: float,
    dropout_p: float,
    return_weights: bool,
) -> tuple[bool, str]:
    """auto takes ``blocked`` for a mask spec on a problem of at least :data:`MIN_PAIRS`."""
    if not isinstance(mask, MaskSpec):
        return False, "auto takes it for mask specs only"
    L, S = q.shape[2], k.shape[2]
    if L * S < MIN_PAIRS:
        return False, (
            f"L x S = {L} x {S} is below {MIN_PAIRS} pairs, where one fused call on the "
            "materialised mask costs less"
        )
    return True, (
        f"a mask spec and L x S >= {MIN_PAIRS}: blocked visits only its non-empty blocks "
        "and never builds the L x S mask"
    )


def note(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: Mask,
    causal: bool,
    scale: float,
    dropout_p: float,
    return_weights: bool,
) -> str:
    """The plan in one line, for :func:`attnkit.explain`."""
    if isinstance(mask, torch.Tensor):  # planning reads the whole mask: leave it to the call
        return "a dense mask: its empty blocks are found when it runs (one pass over the mask)"
    spec = _spec(mask, causal)
    w = causal_window(spec)
    band = ""
    if w is not None:
        runs = _band(spec, q, k, v, 0, 0, None, None) is not None
        if runs:
            return (
                f"causal sliding window {w}: forward and backward run {band_kernel.status()} "
                "(one pass each, no tiles)"
            )
        band = f"causal sliding window {w} ({band_kernel.status_for(q, k, v)}): "
    plan = _plan_for(spec, q, k, v, 0, 0, None, None)
    L, S = q.shape[2], k.shape[2]
    done = plan.computed_pairs / plan.maps
    kernel = "torch's fused flash kernel" if _fused(q, v) else "matmul kernel"
    return band + (
        f"{len(plan.calls)} kernel calls ({kernel}), tiles of {plan.rows} rows; "
        f"{plan.empty_fraction:.1%} of {plan.grain}x{plan.grain} blocks empty; "
        f"computes {done / max(L * S, 1):.1%} of the L x S pairs"
    )
