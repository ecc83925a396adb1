"""The ``blocked`` backend's tile kernels and launches: run a plan forward and backward.

Dimension legend: B batch, H query heads, Hkv key/value heads, G = H // Hkv, L query length,
S key length, Dk query/key head dim, Dv value head dim; R query rows per tile, W keys per call,
n tiles per call (m in one launch).

Each call of a plan (:mod:`attnkit.backends.blocked.plan`) runs torch's fused CPU flash kernel
(``aten._scaled_dot_product_flash_attention_for_cpu``, which also returns the log-sum-exp) on
``n`` tiles at once, seen through ``as_strided`` views of q, k and v (no copies). Where that
kernel does not apply (``Dv != Dk``, not on CPU) a plain matmul kernel runs the same tiles, in
float32 for half types. Several calls on the same rows :func:`merge` by the log-sum-exp rule;
the backward recomputes each call from the saved log-sum-exp (the flash-attention backward).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attnkit.backends.blocked.config import current
from attnkit.backends.blocked.plan import Call, Plan, allowed, tile_index

__all__ = ["acc_dtype", "backward", "forward", "fused", "merge"]

_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


# --- kernels -----------------------------------------------------------------------------


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype: float64 for float64, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def fused(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether torch's fused CPU flash kernel serves these tiles."""
    return (
        current().torch_kernel
        and _FLASH is not None
        and _FLASH_BWD is not None
        and q.device.type == "cpu"
        and q.shape[-1] == v.shape[-1]
    )


def unit_rows(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each tensor with a last dim of stride 1 (a copy only where it has another: a view like
    ``x[..., ::2]`` or ``kt.transpose(-1, -2)``). The tiles are ``as_strided`` views of q, k and
    v, and torch's fused CPU kernel reads a tile's rows as contiguous memory."""
    return tuple(t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous() for t in ts)


def _mm_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scaled, soft-capped, masked scores ``(n, H, R, W)`` in the accumulation dtype (GQA
    without copies), and with a soft-cap ``c`` the derivative of the cap, ``1 - tanh^2``."""
    n, Hq, R, Dk = q.shape
    Hk, W = k.shape[1], k.shape[2]
    acc = acc_dtype(q.dtype)
    qg = q.to(acc).reshape(n, Hk, (Hq // Hk) * R, Dk)  # (n, Hkv, G*R, Dk)
    s = (qg @ k.to(acc).transpose(-1, -2)).view(n, Hq, R, W) * scale
    slope = None
    if softcap is not None:  # Gemma 2: c * tanh(s / c), before the mask
        t = torch.tanh(s / softcap)
        s, slope = t * softcap, 1.0 - t * t
    return (s if mask is None else s + mask.to(acc)), slope


def _kernel_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (n, H, R, Dv), lse (n, H, R))`` of tiles ``q (n, H, R, Dk)`` against
    ``k (n, Hkv, W, Dk)``, ``v (n, Hkv, W, Dv)``, float ``mask`` added to the scaled scores."""
    if softcap is None and fused(q, v):
        assert _FLASH is not None
        out, lse = _FLASH(q, k, v, 0.0, False, attn_mask=mask, scale=scale)
        return out, lse
    n, Hq, R, _ = q.shape
    Hk, W, Dv = k.shape[1], k.shape[2], v.shape[3]
    s, _ = _mm_scores(q, k, mask, scale, softcap)  # (n, H, R, W)
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
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flash-attention backward of one batch of tiles, given the *final* ``out`` and ``lse``
    (``+inf`` for rows that see nothing): ``P = exp(s - lse)``, ``dS = P * (dP - D)`` (times
    the cap's derivative under a soft-cap)."""
    if softcap is None and fused(q, v):
        assert _FLASH_BWD is not None
        dq, dk, dv = _FLASH_BWD(dout, q, k, v, out, lse, 0.0, False, attn_mask=mask, scale=scale)
        return dq, dk, dv
    n, Hq, R, Dk = q.shape
    Hk, W, Dv = k.shape[1], k.shape[2], v.shape[3]
    GR = (Hq // Hk) * R
    acc = acc_dtype(q.dtype)
    s, slope = _mm_scores(q, k, mask, scale, softcap)
    p = torch.exp(s - lse.to(acc)[..., None])  # (n, H, R, W)
    do = dout.to(acc)
    dp = (do.reshape(n, Hk, GR, Dv) @ v.to(acc).transpose(-1, -2)).view(n, Hq, R, W)
    ds = p * (dp - (do * out.to(acc)).sum(-1, keepdim=True))  # (n, H, R, W)
    if slope is not None:
        ds = ds * slope
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
    c: Call, B: int, per_tile_bytes: int, forward: bool
) -> list[tuple[int | None, int, int]]:
    """(batch entry or None for all, first tile, end tile) of each kernel launch of ``c``,
    each launch's outputs within the configured bytes (``tile_bytes``, and for the forward
    ``forward_tile_bytes`` too)."""
    if c.n == 1:
        return [(c.b, 0, 1)]
    cfg = current()
    budget = min(cfg.forward_tile_bytes, cfg.tile_bytes) if forward else cfg.tile_bytes
    chunk = max(1, budget // max(per_tile_bytes, 1))
    entries = [c.b] if c.b is not None else list(range(B))
    return [(b, s, min(c.n, s + chunk)) for b in entries for s in range(0, c.n, chunk)]


@dataclass(frozen=True)
class _Launch:
    """One kernel launch of call ``c``: tiles ``s:e`` of one batch entry (or all)."""

    c: Call
    b: int | None
    s: int
    e: int
    qh: slice
    kh: slice

    @property
    def m(self) -> int:
        return self.e - self.s

    @property
    def k0(self) -> int:
        return self.c.k0 + self.s * self.c.k_step

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """The launch's query-side tiles of ``t`` (q, out, lse, their gradients): views."""
        c = self.c
        return _tiles(t, self.b, self.qh, c.q0 + self.s * c.q_step, c.q_step, c.R, self.m)

    def keys(self, t: torch.Tensor) -> torch.Tensor:
        """The launch's key-side tiles of ``t`` (k, v): views."""
        c = self.c
        return _tiles(t, self.b, self.kh, self.k0, c.k_step, c.W, self.m)


def _each_launch(
    c: Call, B: int, H: int, Hkv: int, per_tile_bytes: int, forward: bool
) -> list[_Launch]:
    qh, kh = _heads(c, H // Hkv)
    return [_Launch(c, b, s, e, qh, kh) for b, s, e in _launches(c, B, per_tile_bytes, forward)]


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


def merge(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, lse_o: torch.Tensor) -> None:
    """Fold a partial result ``(o, lse_o)`` into the running ``(out, lse)``, in place (the
    online-softmax rule; ``o`` is scaled in place too). Rows dead in both stay ``(0, -inf)``.

    ``out (..., R, Dv)`` and ``lse (..., R)`` in the accumulation dtype; ring attention merges
    the blocks of its ring with this same function.
    """
    new = torch.logaddexp(lse, lse_o)  # -inf where both saw nothing
    base = torch.where(new.isinf(), 0.0, new)
    out.mul_(torch.exp(lse - base).unsqueeze(-1)).add_(
        o.mul_(torch.exp(lse_o - base).unsqueeze(-1))
    )
    lse.copy_(new)


def forward(
    plan: Plan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, L, _Dk = q.shape
    Hkv, Dv = k.shape[1], v.shape[3]
    acc = acc_dtype(q.dtype)
    q, k, v = unit_rows(q, k, v)
    if (
        len(plan.calls) == 1
        and plan.calls[0].R == L
        and plan.calls[0].b is None
        and plan.calls[0].h is None
    ):
        c = plan.calls[0]  # one call covers everything (no mask, or one dense tile): no copies
        mask, dead = _mask_for(plan, c, 0, 1, q.dtype, H, q.device)
        o, lse_c = _kernel_forward(
            q, k[:, :, c.k0 : c.k0 + c.W], v[:, :, c.k0 : c.k0 + c.W], mask, scale, softcap
        )
        if dead is not None:
            lse_c = lse_c.masked_fill(dead, -math.inf)
        return o.to(acc), lse_c.to(acc)
    new = torch.empty if plan.covers else torch.zeros  # rows no call writes stay (0, -inf)
    out = new((B, H, L, Dv), dtype=acc, device=q.device)
    lse = torch.full((B, H, L), -math.inf, dtype=acc, device=q.device)
    for c in plan.calls:
        per_tile = c.R * H * (Dv + 1) * 8  # the tiles' outputs and lse (masks are shared)
        if c.lazy or (plan.spec is not None and plan.spec.has_bias):
            per_tile += c.R * c.W * H * 4  # masks built per launch
        for at in _each_launch(c, B, H, Hkv, per_tile, forward=True):
            mask, dead = _mask_for(plan, c, at.s, at.e, q.dtype, H, q.device)
            qt, kt, vt = at.rows(q), at.keys(k), at.keys(v)
            o, lse_c = _kernel_forward(qt, kt, vt, mask, scale, softcap)
            if dead is not None:
                lse_c = lse_c.masked_fill(dead, -math.inf)
            ov, lv = at.rows(out), at.rows(lse)
            if c.first:
                ov.copy_(o)
                lv.copy_(lse_c)
            else:
                merge(ov, lv, o.to(acc), lse_c.to(acc))
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
    rows = rows.to(grad.dtype)  # half-type tile gradients into the float32 accumulator
    grad[b, kh].transpose(0, 1).index_add_(0, keys, rows)


def backward(
    plan: Plan,
    saved: tuple[torch.Tensor, ...],
    dout: torch.Tensor,
    scale: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (accumulation dtype) of ``plan`` from what the forward saved, ``(q, k, v,
    out, lse)`` with the *final* out and lse, and the output gradient ``dout``."""
    q, k, v, out = unit_rows(*saved[:4])
    lse = saved[4]
    B, H, L, Dk = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    acc = acc_dtype(q.dtype)
    out = out.to(q.dtype)
    dout = dout.to(q.dtype).contiguous()
    lse = lse.to(acc).masked_fill(lse == -math.inf, math.inf)  # rows that see nothing: P = 0
    # (B, N, H, D) in memory, the layout the fused kernel returns its gradients in, so that
    # adding a batch of tile gradients streams through memory
    dq = torch.zeros(B, L, H, Dk, dtype=acc, device=q.device).transpose(1, 2)
    dk = torch.zeros(B, S, Hkv, Dk, dtype=acc, device=q.device).transpose(1, 2)
    dv = torch.zeros(B, S, Hkv, Dv, dtype=acc, device=q.device).transpose(1, 2)
    for c in plan.calls:
        per_tile = (c.R * H * (Dk + Dv) + c.W * Hkv * (Dk + Dv)) * 8  # the tiles' gradients
        for at in _each_launch(c, B, H, Hkv, per_tile, forward=False):
            mask, _ = _mask_for(plan, c, at.s, at.e, q.dtype, H, q.device)
            qt, kt, vt = at.rows(q), at.keys(k), at.keys(v)
            ot, lt, dot = at.rows(out), at.rows(lse), at.rows(dout)
            dq_c, dk_c, dv_c = _kernel_backward(dot, qt, kt, vt, ot, lt, mask, scale, softcap)
            at.rows(dq).add_(dq_c)
            _add_keys(dk, dk_c, c, at.b, at.kh, at.k0, at.m)
            _add_keys(dv, dv_c, c, at.b, at.kh, at.k0, at.m)
    return dq, dk, dv
