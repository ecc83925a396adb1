"""Attention modules: multi-head (self, cross, grouped-query), single-head self, and cross.

Dimension legend: B batch, L query length, S key length, E model width (``embed_dim``),
H query heads, Hkv key/value heads, Dk query/key head dim, Dv value head dim.

Every module projects, splits heads, calls :func:`attnkit.attention`, merges heads and
projects back; they differ only in which inputs they take. They return an
:class:`~attnkit.AttentionOutput` ``(output, weights)`` always, ``weights`` being ``None``
unless ``need_weights=True``.

Masks keep the meaning of their names (see :mod:`attnkit.modules.masking`): ``mask`` is
attnkit's (True = may attend), ``key_padding_mask`` and ``attn_mask`` are torch's (True =
ignore), ``attention_mask`` is Hugging Face's (True/1 = a real key).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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
from attnkit.modules.checks import attention_call, check_batch, check_input
from attnkit.modules.kv_cache import KVCache
from attnkit.modules.masking import Mask, MaskArgs, combine, module_mask
from attnkit.modules.positions import RotaryEmbedding

if TYPE_CHECKING:
    from attnkit.interop.torch_mha import TorchMultiheadAttention

__all__ = ["CrossAttention", "MultiHeadAttention", "SelfAttention"]


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
        check_dtype_arg(where, dtype)
        E = check_int(where, "embed_dim", embed_dim)
        H = check_int(where, "num_heads", num_heads)
        Hkv = check_int(where, "num_kv_heads", H if num_kv_heads is None else num_kv_heads)
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
        Dk = check_int(where, "head_dim", E // H if head_dim is None else head_dim)
        Dv = check_int(where, "v_head_dim", Dk if v_head_dim is None else v_head_dim)
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

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"v_head_dim={self.v_head_dim}, causal={self.causal}, backend={self.backend!r}"
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
                q, k, v, mask=mask, causal=causal, dropout_p=dropout, need_weights=need_weights
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
        k, v = kv_cache.update(start, k, v)  # (B, Hkv, S, Dk), (B, Hkv, S, Dv)
        rule = kv_cache.rule(L, causal=causal)
        if rule is None:  # one new token sees every cached key: causal needs no mask then
            return q, k, v, mask, causal and L > 1
        return q, k, v, combine(mask, rule, L, k.shape[2], q.dtype), False


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
    attention_mask=None, attn_mask=None, is_causal=False, need_weights=False,
    average_attn_weights=False, kv_cache=None, positions=None)``: ``query (B, L, E)``,
    ``key (B, S, kdim)`` (default: the query), ``value (B, S, vdim)`` (default: the key).
    Every mask given must allow a key for it to be attended:

    - ``mask``: attnkit's convention (bool True = may attend, or float added;
      broadcastable to ``(B, H, L, S)``), or a mask spec.
    - ``key_padding_mask``: as in ``nn.MultiheadAttention``, bool ``(B, S)``, **True =
      padding** (ignored), or float ``(B, S)`` added to the scores.
    - ``attention_mask``: its positive twin, as in Hugging Face: ``(B, S)`` bool or 0/1
      ints, **True/1 = a real key**. Not together with ``key_padding_mask``.
    - ``attn_mask``: as in ``nn.MultiheadAttention``, ``(L, S)`` or ``(B * H, L, S)``, bool
      **True = not allowed**, or float added; ``is_causal=True`` is torch's hint that it is
      causal (it needs the ``attn_mask``, which is what is applied).

    A batch row whose keys are all padding gets attention output 0 (``nn.MultiheadAttention``
    gives NaN), so its output is ``out_proj(0)``, the output bias; the other rows are
    unaffected. Returns :class:`~attnkit.AttentionOutput` ``(output (B, L, E), weights or
    None)``: weights ``(B, H, L, S)`` with ``need_weights=True``, averaged over heads to
    ``(B, L, S)`` with ``average_attn_weights=True`` as well. (A module made by
    :meth:`from_torch` takes and returns exactly what ``nn.MultiheadAttention`` does.)

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
        mask: Mask | None = None,
        key_padding_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        average_attn_weights: bool = False,
        kv_cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
    ) -> AttentionOutput:
        key = query if key is None else key
        value = key if value is None else value
        masks = MaskArgs(mask, key_padding_mask, attention_mask, attn_mask, is_causal)
        return self._attend(
            query, key, value, masks, need_weights, average_attn_weights, kv_cache, positions
        )

    @staticmethod
    def from_torch(m: nn.MultiheadAttention, *, backend: str = "auto") -> TorchMultiheadAttention:
        """A drop-in for ``m``: its weights (copied exactly) and settings, and torch's call.

        The result is a :class:`~attnkit.interop.TorchMultiheadAttention` (a
        ``MultiHeadAttention``): ``forward(query, key, value, key_padding_mask=None,
        need_weights=True, attn_mask=None, average_attn_weights=True, is_causal=False)``
        returns ``(output, weights or None)`` as ``m`` does.
        """
        from attnkit.interop.torch_mha import from_torch

        return from_torch(m, backend=backend)

    def to_torch(self) -> nn.MultiheadAttention:
        """An ``nn.MultiheadAttention`` with this module's weights (copied exactly)."""
        from attnkit.interop.torch_mha import to_torch

        return to_torch(self)


class SelfAttention(_Attention):
    """Single-head self-attention without output projection, as written by hand in seed 000.

    ``x (B, L, E) -> (B, L, v_head_dim)``; queries and keys are ``Linear(E, head_dim)``
    projections of ``x``, values ``Linear(E, v_head_dim)`` (default ``head_dim``; seed 003
    uses d_q = d_k = 24 and d_v = 28), no bias by default. The mask keywords are those of
    :class:`MultiHeadAttention`. Returns :class:`~attnkit.AttentionOutput`.

    >>> SelfAttention(256, 64)(torch.randn(32, 50, 256)).output.shape
    torch.Size([32, 50, 64])
    >>> SelfAttention(16, 24, v_head_dim=28)(torch.randn(1, 6, 16)).output.shape
    torch.Size([1, 6, 28])
    """

    def __init__(
        self,
        embed_dim: int,
        head_dim: int,
        *,
        v_head_dim: int | None = None,
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
            v_head_dim=v_head_dim,
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
        mask: Mask | None = None,
        key_padding_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        average_attn_weights: bool = False,
    ) -> AttentionOutput:
        masks = MaskArgs(mask, key_padding_mask, attention_mask, attn_mask, is_causal)
        return self._attend(x, x, x, masks, need_weights, average_attn_weights)


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
        mask: Mask | None = None,
        key_padding_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        average_attn_weights: bool = False,
    ) -> AttentionOutput:
        masks = MaskArgs(mask, key_padding_mask, attention_mask, attn_mask, is_causal)
        return self._attend(x, context, context, masks, need_weights, average_attn_weights)
