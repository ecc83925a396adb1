"""What every attention module shares: its projections, its sizes checked, and the forward
pass (project, split heads, :func:`attnkit.attention`, merge heads, project back).

Dimension legend: B batch, L query length, S key length, E model width (``embed_dim``),
H query heads, Hkv key/value heads, Dk query/key head dim, Dv value head dim.

The modules themselves (:mod:`attnkit.modules.attention`) differ only in which inputs they take.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from attnkit.errors import AttentionInputError, check_dtype_arg, check_int
from attnkit.functional import AttentionOutput, run_call
from attnkit.heads import merge_heads, split_heads
from attnkit.inspect.tracing import (
    record_module_abort,
    record_module_end,
    record_module_start,
    recording,
)
from attnkit.masks import MaskSpec
from attnkit.modules.checks import attention_call, check_batch, check_head_sizes, check_input
from attnkit.modules.kv_cache import KVCache
from attnkit.modules.masking import Mask, MaskArgs, combine, module_mask
from attnkit.modules.positions import RotaryEmbedding
from attnkit.modules.sinks import learned_sinks, module_sinks

__all__ = ["AttentionBase"]


class AttentionBase(nn.Module):
    """Projections and the forward pass shared by every attention module."""

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        v_head_dim: int | None = None,
        kdim: int | None = None,
        vdim: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        batch_first: bool = True,
        causal: bool = False,
        backend: str = "auto",
        output_projection: bool = True,
        rope: RotaryEmbedding | None = None,
        sinks: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        where = f"attnkit.{type(self).__name__}"
        self._where = where
        check_dtype_arg(where, dtype)
        sizes = (embed_dim, num_heads, num_kv_heads, head_dim, v_head_dim)
        E, H, Hkv, Dk, Dv = check_head_sizes(where, *sizes, dropout=dropout)
        self.embed_dim = E
        self.num_heads = H
        self.num_kv_heads = Hkv
        self.head_dim = Dk
        self.v_head_dim = Dv
        self.kdim = check_int(where, "kdim", E if kdim is None else kdim)
        self.vdim = check_int(where, "vdim", E if vdim is None else vdim)
        self.dropout = float(dropout)
        self.batch_first = batch_first
        self.causal = causal
        self.backend = backend
        if rope is not None and (not isinstance(rope, RotaryEmbedding) or rope.dim > Dk):
            raise AttentionInputError(
                where,
                "rope",
                "`rope` must be a RotaryEmbedding that rotates at most the head dim.",
                got=f"rope={rope!r}  head_dim={Dk}",
                expected=f"RotaryEmbedding(dim <= {Dk})",
                fix=f"RotaryEmbedding({Dk - Dk % 2})",
            )
        self.rope = rope
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(E, H * Dk, bias=bias, **factory)
        self.k_proj = nn.Linear(self.kdim, Hkv * Dk, bias=bias, **factory)
        self.v_proj = nn.Linear(self.vdim, Hkv * Dv, bias=bias, **factory)
        self.out_proj: nn.Module = (
            nn.Linear(H * Dv, E, bias=bias, **factory) if output_projection else nn.Identity()
        )
        self.sinks: nn.Parameter | None = learned_sinks(where, sinks, H, factory)  # (H,)

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"v_head_dim={self.v_head_dim}, causal={self.causal}, backend={self.backend!r}"
            + (", sinks=True" if self.sinks is not None else "")
        )

    def _batch_first_inputs(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The three inputs checked (rank, width, dtype), then ``(B, L|S, E)`` whatever the
        layout."""
        w = self.q_proj.weight
        for name, x, width, width_name in (
            ("query", query, self.embed_dim, "embed_dim"),
            ("key", key, self.kdim, "kdim"),
            ("value", value, self.vdim, "vdim"),
        ):
            check_input(
                self._where, name, x, width, width_name, self.batch_first, w.dtype, w.device
            )
        if not self.batch_first:  # (L, B, E) -> (B, L, E)
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        return query, key, value

    def _attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        masks: MaskArgs,
        need_weights: bool,
        average_attn_weights: bool,
        kv_cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> AttentionOutput:
        where = self._where
        self_attention = key is query and value is query
        given = (query, key, value)  # as passed, for a trace
        query, key, value = self._batch_first_inputs(query, key, value)
        check_batch(where, *given, self.batch_first)
        B, L, S = query.shape[0], query.shape[1], key.shape[1]
        mask = module_mask(
            where,
            masks,
            size=(B, self.num_heads, L, S),
            dtype=query.dtype,
            kv_cache=kv_cache is not None,
            seq_first=(L, B) if self.batch_first else None,
        )
        qp = self.q_proj(query)  # (B, L, H*Dk)
        kp = self.k_proj(key)  # (B, S, Hkv*Dk)
        vp = self.v_proj(value)  # (B, S, Hkv*Dv)
        q = split_heads(qp, self.num_heads)  # (B, H, L, Dk)
        k = split_heads(kp, self.num_kv_heads)  # (B, Hkv, S, Dk)
        v = split_heads(vp, self.num_kv_heads)  # (B, Hkv, S, Dv)
        sinks = module_sinks(where, self.sinks, sinks, q)  # (H,) or (B|1, H, L); before the cache
        if recording():  # attnkit.trace() is open: this thread's traces get the steps
            record_module_start(self, not self.batch_first, *given, qp, kp, vp, q, k, v)
        try:
            causal = self.causal
            if self.rope is not None or positions is not None or kv_cache is not None:
                q, k, v, mask, causal = self._rope_and_cache(
                    q, k, v, mask, self_attention, kv_cache, positions
                )
            dropout = self.dropout if self.training else 0.0
            call = attention_call(
                q,
                k,
                v,
                mask=mask,
                causal=causal,
                dropout_p=dropout,
                need_weights=need_weights,
                sinks=sinks,
            )
            out, weights = run_call(call, self.backend)
        except BaseException:
            if recording():  # later calls in the trace are not this module's
                record_module_abort()
            raise
        merged = merge_heads(out)  # (B, H, L, Dv) -> (B, L, H*Dv)
        y = self.out_proj(merged)  # (B, L, E)
        projected = y
        if not self.batch_first:
            y = y.transpose(0, 1)  # (L, B, E)
        if recording():
            record_module_end(
                self,
                merged,
                projected,
                isinstance(self.out_proj, nn.Linear),
                None if self.batch_first else y,
            )
        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)  # (B, H, L, S) -> (B, L, S), as torch averages
        return AttentionOutput(y, weights)

    def _rope_and_cache(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: Mask | None,
        self_attention: bool,
        kv_cache: KVCache | None,
        positions: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Mask | None, bool]:
        """RoPE on the new q and k at their positions, then the new k and v into the cache.

        With a cache, the new tokens start at ``kv_cache.next_pos()`` and attend to every
        cached key by the end-aligned causal rule (per sequence in a ragged batch).
        """
        where = self._where
        if (kv_cache is not None or self.rope is not None) and not self_attention:
            raise AttentionInputError(
                where,
                "key",
                "RoPE and the KV cache serve self-attention; a separate key was given.",
                got="key is not query",
                expected="key=None and value=None (self-attention)",
            )
        if positions is not None and self.rope is None:
            raise AttentionInputError(
                where,
                "positions",
                "`positions` is given but this module has no rotary embedding to use it.",
                got="positions given, rope=None",
                expected="positions=None, or a module built with rope=RotaryEmbedding(...)",
            )
        L = q.shape[2]
        start = kv_cache.next_pos() if kv_cache is not None else 0
        if self.rope is not None:
            if positions is None:
                steps = torch.arange(L, device=q.device)  # (L,)
                positions = (
                    start[:, None] + steps if isinstance(start, torch.Tensor) else steps + start
                )
            q, k = self.rope(q, positions), self.rope(k, positions)  # (B, H|Hkv, L, Dk)
        causal = self.causal
        if kv_cache is None:
            return q, k, v, mask, causal
        if kv_cache.static and mask is not None:
            raise kv_cache.mask_error(where, mask)
        if kv_cache.ragged and isinstance(mask, MaskSpec) and mask.reads_query_position:
            raise kv_cache.ragged_mask_error(where, mask)  # (before the cache is written)
        k, v = kv_cache.update(start, k, v)  # (B, Hkv, S, Dk), (B, Hkv, S, Dv)
        rule = kv_cache.rule(L, causal=causal)
        if rule is None:  # one new token sees every cached key: causal needs no mask then
            return q, k, v, mask, causal and L > 1
        return q, k, v, combine(mask, rule, L, k.shape[2], q.dtype), False
