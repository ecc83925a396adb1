"""Attention modules: multi-head (self, cross, grouped-query), single-head self, and cross.

Dimension legend: B batch, L query length, S key length, E model width (``embed_dim``),
H query heads, Hkv key/value heads, Dk query/key head dim, Dv value head dim.

Every module projects, splits heads, calls :func:`attnkit.attention`, merges heads and
projects back; they differ only in which inputs they take. They return an
:class:`~attnkit.AttentionOutput` ``(output, weights)`` always, ``weights`` being ``None``
unless ``need_weights=True``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from attnkit.errors import AttentionInputError, shape_str, warn_user
from attnkit.functional import AttentionOutput, run_attention
from attnkit.heads import merge_heads, split_heads
from attnkit.inspect.tracing import active_trace, record_module_end, record_module_start
from attnkit.masks import MaskSpec, key_mask
from attnkit.modules.kv_cache import KVCache
from attnkit.modules.positions import RotaryEmbedding

__all__ = ["CrossAttention", "MultiHeadAttention", "SelfAttention"]


def _positive_int(where: str, name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AttentionInputError(
            where,
            name,
            f"`{name}` must be a positive int, got {value!r}.",
            got=f"{name}={value!r}",
            expected="an int >= 1",
        )
    return value


class _Attention(nn.Module):
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
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        where = f"attnkit.{type(self).__name__}"
        self._where = where
        E = _positive_int(where, "embed_dim", embed_dim)
        H = _positive_int(where, "num_heads", num_heads)
        Hkv = _positive_int(where, "num_kv_heads", H if num_kv_heads is None else num_kv_heads)
        if head_dim is None and E % H != 0:
            divisors = [h for h in range(1, E + 1) if E % h == 0]
            raise AttentionInputError(
                where,
                "embed_dim",
                f"embed_dim={E} is not divisible by num_heads={H}.",
                got=f"embed_dim={E}  num_heads={H}",
                expected="embed_dim % num_heads == 0 (each head gets embed_dim // num_heads)",
                fix=f"choose num_heads from {divisors[-8:]}, or pass head_dim=... explicitly",
            )
        if H % Hkv != 0:
            raise AttentionInputError(
                where,
                "num_kv_heads",
                f"num_kv_heads={Hkv} does not divide num_heads={H}.",
                got=f"num_heads={H}  num_kv_heads={Hkv}",
                expected="num_heads % num_kv_heads == 0 (grouped-query attention)",
                fix="num_kv_heads=1 is multi-query; num_kv_heads=num_heads is plain multi-head",
            )
        if (
            isinstance(dropout, bool)
            or not isinstance(dropout, (int, float))
            or not (0.0 <= dropout < 1.0)
        ):
            raise AttentionInputError(
                where,
                "dropout",
                f"`dropout` must be in [0, 1), got {dropout!r}.",
                got=f"dropout={dropout!r}",
                expected="0 <= dropout < 1 (the probability of dropping an attention weight)",
                fix="dropout=0.0 turns it off",
            )
        Dk = _positive_int(where, "head_dim", E // H if head_dim is None else head_dim)
        Dv = _positive_int(where, "v_head_dim", Dk if v_head_dim is None else v_head_dim)
        self.embed_dim = E
        self.num_heads = H
        self.num_kv_heads = Hkv
        self.head_dim = Dk
        self.v_head_dim = Dv
        self.kdim = _positive_int(where, "kdim", E if kdim is None else kdim)
        self.vdim = _positive_int(where, "vdim", E if vdim is None else vdim)
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

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"v_head_dim={self.v_head_dim}, causal={self.causal}, backend={self.backend!r}"
        )

    def _check_input(self, name: str, x: object, width: int, width_name: str) -> torch.Tensor:
        dims = ("B", "L", "E") if name == "query" else ("B", "S", "E")
        if not self.batch_first:
            dims = (dims[1], dims[0], dims[2])
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            got = shape_str(name, x, dims) if isinstance(x, torch.Tensor) else type(x).__name__
            raise AttentionInputError(
                self._where,
                name,
                f"`{name}` must be 3-D ({', '.join(dims)}).",
                got=got,
                expected=f"{name} ({', '.join(dims)}) with E={width}",
                fix="add a batch dim with x.unsqueeze(0)"
                if isinstance(x, torch.Tensor) and x.dim() == 2
                else "attention on 4-D heads is attnkit.attention(q, k, v)",
            )
        if x.shape[-1] != width:
            raise AttentionInputError(
                self._where,
                name,
                f"`{name}` has width {x.shape[-1]} but the module expects {width_name}={width}.",
                got=shape_str(name, x, dims),
                expected=f"{name}.shape[-1] == {width_name} == {width}",
                fix=f"build the module with {width_name}={x.shape[-1]}"
                if name != "query"
                else f"build the module with embed_dim={x.shape[-1]}",
            )
        return x

    def _attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | MaskSpec | None,
        key_padding_mask: torch.Tensor | None,
        need_weights: bool,
        kv_cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
    ) -> AttentionOutput:
        where = self._where
        self_attention = key is query and value is query
        self._check_input("query", query, self.embed_dim, "embed_dim")
        self._check_input("key", key, self.kdim, "kdim")
        self._check_input("value", value, self.vdim, "vdim")
        if not self.batch_first:  # (L, B, E) -> (B, L, E)
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        B = query.shape[0]
        S = key.shape[1]
        if key.shape[0] != B or value.shape[0] != B or value.shape[1] != S:
            seq_first = self.batch_first and query.shape[1] == key.shape[1]
            raise AttentionInputError(
                where,
                "key" if key.shape[0] != B else "value",
                "query, key and value disagree on batch or key length.",
                got="  ".join(
                    shape_str(n, t, d)
                    for n, t, d in (
                        ("query", query, ("B", "L", "E")),
                        ("key", key, ("B", "S", "E")),
                        ("value", value, ("B", "S", "E")),
                    )
                ),
                expected="the same B in all three, the same S in key and value",
                fix="these look like (seq, batch, embed) tensors: pass batch_first=False "
                "or x.transpose(0, 1)"
                if seq_first
                else "key and value must come from the same sequence",
            )
        if key_padding_mask is not None:
            mask = self._merge_key_padding(query, key_padding_mask, mask, B, S)
        qp = self.q_proj(query)  # (B, L, H*Dk)
        kp = self.k_proj(key)  # (B, S, Hkv*Dk)
        vp = self.v_proj(value)  # (B, S, Hkv*Dv)
        q = split_heads(qp, self.num_heads)  # (B, H, L, Dk)
        k = split_heads(kp, self.num_kv_heads)  # (B, Hkv, S, Dk)
        v = split_heads(vp, self.num_kv_heads)  # (B, Hkv, S, Dv)
        tr = active_trace()
        if tr is not None:
            inputs = [("query", query), ("key", key), ("value", value)]
            record_module_start(
                tr, self, inputs, [("q", qp), ("k", kp), ("v", vp)], [("q", q), ("k", k), ("v", v)]
            )
        causal = self.causal
        if self.rope is not None or positions is not None or kv_cache is not None:
            q, k, v, mask, causal = self._rope_and_cache(
                q, k, v, mask, self_attention, key_padding_mask, kv_cache, positions
            )
        out, weights = run_attention(
            q,
            k,
            v,
            mask,
            causal,
            None,
            self.dropout if self.training else 0.0,
            need_weights,
            self.backend,
        )
        merged = merge_heads(out)  # (B, H, L, Dv) -> (B, L, H*Dv)
        y = self.out_proj(merged)  # (B, L, E)
        if tr is not None:
            record_module_end(tr, self, merged, y, isinstance(self.out_proj, nn.Linear))
        if not self.batch_first:
            y = y.transpose(0, 1)  # (L, B, E)
        return AttentionOutput(y, weights)

    def _rope_and_cache(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | MaskSpec | None,
        self_attention: bool,
        key_padding_mask: torch.Tensor | None,
        kv_cache: KVCache | None,
        positions: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | MaskSpec | None, bool]:
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
        if kv_cache is not None and key_padding_mask is not None:
            raise AttentionInputError(
                where,
                "key_padding_mask",
                "with a kv_cache, padding is the cache's per-sequence lengths.",
                got="kv_cache and key_padding_mask both given",
                expected="key_padding_mask=None",
                fix="write right-padded sequences, then kv_cache.truncate(real lengths)",
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
        k, v = kv_cache.update(start, k, v)  # (B, Hkv, S, Dk), (B, Hkv, S, Dv)
        rule = kv_cache.rule(L, causal=causal)
        if rule is None:  # one new token sees every cached key: causal needs no mask then
            return q, k, v, mask, causal and L > 1
        if mask is None or isinstance(mask, MaskSpec):
            return q, k, v, rule if mask is None else mask & rule, False
        allowed = rule.to_dense(L, k.shape[2], device=q.device)  # (B, 1, L, S)
        if mask.dtype == torch.bool:
            return q, k, v, mask & allowed, False
        return q, k, v, mask.masked_fill(~allowed, float("-inf")), False

    def _merge_key_padding(
        self,
        query: torch.Tensor,
        kpm: torch.Tensor,
        mask: torch.Tensor | MaskSpec | None,
        B: int,
        S: int,
    ) -> torch.Tensor | MaskSpec:
        where = self._where
        if not isinstance(kpm, torch.Tensor) or kpm.dtype != torch.bool:
            raise AttentionInputError(
                where,
                "key_padding_mask",
                "`key_padding_mask` must be a bool tensor (True = a real key, may attend).",
                got=f"key_padding_mask dtype={getattr(kpm, 'dtype', type(kpm).__name__)}",
                expected="bool (B, S)",
                fix="lengths -> arange(S) < lengths[:, None]; torch's masks (True = ignore) "
                "go through attnkit.interop.mask_from_torch",
            )
        if tuple(kpm.shape) != (B, S):
            fix = "build it as (batch, key length)"
            if tuple(kpm.shape) == (S, B):
                fix = "it looks transposed: use key_padding_mask.T"
            if self.batch_first and tuple(kpm.shape) == (query.shape[1], query.shape[0]):
                fix = "the inputs look like (seq, batch, embed): pass batch_first=False"
            raise AttentionInputError(
                where,
                "key_padding_mask",
                "`key_padding_mask` does not match (B, S).",
                got=shape_str("key_padding_mask", kpm, ("B", "S")) + f"  target (B={B}, S={S})",
                expected="key_padding_mask (B, S), True = a real key",
                fix=fix,
            )
        if not torch.compiler.is_compiling() and S > 0 and bool((~kpm.any(dim=1)).any()):
            warn_user(
                "attnkit: key_padding_mask lets some batch rows attend to no key at all (their "
                "output is 0). attnkit's convention is True = a real key that may be attended; "
                "nn.MultiheadAttention's is True = ignore. If this is a torch mask, pass "
                "~key_padding_mask, or convert it with attnkit.interop.mask_from_torch."
            )
        keep = kpm[:, None, None, :]  # (B, 1, 1, S)
        if isinstance(mask, MaskSpec):
            return mask & key_mask(kpm)
        if mask is None:
            return keep
        if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
            return mask & keep
        if isinstance(mask, torch.Tensor) and mask.is_floating_point():
            return mask.masked_fill(~keep, float("-inf"))
        return mask  # anything else is rejected, with its message, by attnkit.attention


class MultiHeadAttention(_Attention):
    """Multi-head attention: self, cross and grouped-query, ``batch_first`` by default.

    Args:
        embed_dim: model width ``E`` of the query and of the output.
        num_heads: query heads ``H``.
        num_kv_heads: key/value heads ``Hkv`` (default ``H``); ``H % Hkv == 0``; 1 is
            multi-query.
        head_dim: query/key head dim ``Dk`` (default ``E // H``, which then must divide).
        v_head_dim: value head dim ``Dv`` (default ``Dk``).
        kdim, vdim: widths of the key and value inputs (default ``E``), for cross-attention.
        bias: biases on all four projections.
        dropout: on the attention weights, in training mode only.
        batch_first: inputs ``(B, L, E)``; ``False`` takes ``nn.MultiheadAttention``'s
            ``(L, B, E)``.
        causal: apply the end-aligned causal rule (see :func:`attnkit.attention`).
        backend: passed to :func:`attnkit.attention`.
        output_projection: ``False`` drops the output projection (the output is then
            ``(B, L, H * Dv)``).
        rope: a :class:`~attnkit.modules.positions.RotaryEmbedding` applied to the queries
            and keys of self-attention (``rope.dim <= Dk``), or ``None``.

    ``forward(query, key=None, value=None, *, mask=None, key_padding_mask=None,
    need_weights=False, kv_cache=None, positions=None)``: ``query (B, L, E)``, ``key (B, S,
    kdim)`` (default: the query), ``value (B, S, vdim)`` (default: the key). ``mask`` follows
    attnkit's convention (bool, True = may attend, or float added; broadcastable to
    ``(B, H, L, S)``); ``key_padding_mask`` is bool ``(B, S)``, True = a real key. Returns
    :class:`~attnkit.AttentionOutput` ``(output (B, L, E), weights (B, H, L, S) or None)``.

    Decoding (self-attention only): with ``kv_cache`` (a :class:`~attnkit.KVCache`), the
    ``L`` new tokens' keys and values are written at ``kv_cache.next_pos()`` and the queries
    attend to all ``S`` cached keys by the end-aligned causal rule (``causal=True``; per
    sequence in a ragged batch); ``mask``, if given, then spans ``(L, S)``. RoPE positions
    default to ``0 .. L-1`` after the cached tokens; ``positions (L,)`` or ``(B, L)``
    overrides them.

    >>> mha = MultiHeadAttention(64, 8, num_kv_heads=2)
    >>> mha(torch.randn(2, 10, 64)).output.shape
    torch.Size([2, 10, 64])
    """

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        *,
        mask: torch.Tensor | MaskSpec | None = None,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = False,
        kv_cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
    ) -> AttentionOutput:
        key = query if key is None else key
        value = key if value is None else value
        return self._attend(
            query, key, value, mask, key_padding_mask, need_weights, kv_cache, positions
        )

    @classmethod
    def from_torch(cls, m: nn.MultiheadAttention, *, backend: str = "auto") -> MultiHeadAttention:
        """An attnkit module with ``m``'s weights (copied exactly) and settings.

        Masks keep attnkit's convention; translate torch's with
        :func:`attnkit.interop.mask_from_torch`.
        """
        from attnkit.interop.torch_mha import from_torch

        return from_torch(cls, m, backend=backend)

    def to_torch(self) -> nn.MultiheadAttention:
        """An ``nn.MultiheadAttention`` with this module's weights (copied exactly)."""
        from attnkit.interop.torch_mha import to_torch

        return to_torch(self)


class SelfAttention(_Attention):
    """Single-head self-attention without output projection, as written by hand in seed 000.

    ``x (B, L, E) -> (B, L, head_dim)``; queries, keys and values are ``Linear(E, head_dim)``
    projections of ``x`` (no bias by default). Returns :class:`~attnkit.AttentionOutput`.

    >>> SelfAttention(256, 64)(torch.randn(32, 50, 256)).output.shape
    torch.Size([32, 50, 64])
    """

    def __init__(
        self,
        embed_dim: int,
        head_dim: int,
        *,
        bias: bool = False,
        dropout: float = 0.0,
        causal: bool = False,
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            embed_dim,
            1,
            head_dim=head_dim,
            bias=bias,
            dropout=dropout,
            causal=causal,
            backend=backend,
            output_projection=False,
            device=device,
            dtype=dtype,
        )

    def forward(
        self,
        x: torch.Tensor,
        *,
        mask: torch.Tensor | MaskSpec | None = None,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = False,
    ) -> AttentionOutput:
        return self._attend(x, x, x, mask, key_padding_mask, need_weights)


class CrossAttention(_Attention):
    """Multi-head cross-attention: queries from ``x``, keys and values from ``context``.

    ``x (B, L, E)``, ``context (B, S, context_dim)`` with any ``S``; output ``(B, L, E)``.
    Same keywords as :class:`MultiHeadAttention` (``context_dim`` sets both ``kdim`` and
    ``vdim``).

    >>> xattn = CrossAttention(16, 4, context_dim=32)
    >>> xattn(torch.randn(2, 6, 16), torch.randn(2, 8, 32)).output.shape
    torch.Size([2, 6, 16])
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        context_dim: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        v_head_dim: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        batch_first: bool = True,
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            embed_dim,
            num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            v_head_dim=v_head_dim,
            kdim=context_dim,
            vdim=context_dim,
            bias=bias,
            dropout=dropout,
            batch_first=batch_first,
            backend=backend,
            device=device,
            dtype=dtype,
        )

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor,
        *,
        mask: torch.Tensor | MaskSpec | None = None,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = False,
    ) -> AttentionOutput:
        return self._attend(x, context, context, mask, key_padding_mask, need_weights)
