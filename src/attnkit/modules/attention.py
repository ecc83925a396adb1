"""Attention modules: multi-head (self, cross, grouped-query), single-head self, and cross;
and :class:`TorchMultiheadAttention`, a multi-head module called as ``nn.MultiheadAttention``.

Dimension legend: B batch, L query length, S key length, E model width (``embed_dim``),
H query heads, Hkv key/value heads, Dk query/key head dim, Dv value head dim.

Every module projects, splits heads, calls :func:`attnkit.attention`, merges heads and
projects back (:class:`~attnkit.modules.attention_base.AttentionBase`); they differ only in
which inputs they take. They return an :class:`~attnkit.AttentionOutput` ``(output, weights)``
always, ``weights`` being ``None`` unless ``need_weights=True``.

Masks keep the meaning of their names (see :mod:`attnkit.modules.masking`): ``mask`` is
attnkit's (True = may attend), ``key_padding_mask`` and ``attn_mask`` are torch's (True =
ignore), ``attention_mask`` is Hugging Face's (True/1 = a real key). The boundary with
``nn.MultiheadAttention`` (weights both ways, its call) is here too, so that the modules never
import :mod:`attnkit.interop`, which re-exports it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from attnkit.errors import AttentionInputError
from attnkit.functional import AttentionOutput
from attnkit.modules.attention_base import AttentionBase
from attnkit.modules.kv_cache import KVCache
from attnkit.modules.masking import Mask, MaskArgs

__all__ = ["CrossAttention", "MultiHeadAttention", "SelfAttention", "TorchMultiheadAttention"]


class MultiHeadAttention(AttentionBase):
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
        sinks: ``True`` gives the module one learned attention sink per query head (gpt-oss):
            the parameter ``sinks (H,)`` (``state_dict`` key ``sinks``), initialised from
            ``normal(0, 0.02)``; each head's sink joins the softmax denominator of every row
            and adds no value (see :mod:`attnkit.modules.sinks`).

    ``forward(query, key=None, value=None, *, mask=None, key_padding_mask=None,
    attention_mask=None, attn_mask=None, is_causal=False, need_weights=False,
    average_attn_weights=False, kv_cache=None, positions=None, sinks=None)``:
    ``query (B, L, E)``, ``key (B, S, kdim)`` (default: the query), ``value (B, S, vdim)``
    (default: the key); ``sinks``, for a module built without learned sinks, the call's own
    as in :func:`attnkit.attention`: ``(H,)``, or per query row ``(B, H, L)`` / ``(1, H, L)``
    (heads before rows, whatever the layout; with a KV cache ``L`` counts the new tokens).
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
        sinks: torch.Tensor | None = None,
    ) -> AttentionOutput:
        key = query if key is None else key
        value = key if value is None else value
        masks = MaskArgs(mask, key_padding_mask, attention_mask, attn_mask, is_causal)
        return self._attend(
            query,
            key,
            value,
            masks,
            need_weights,
            average_attn_weights,
            kv_cache,
            positions,
            sinks,
        )

    @staticmethod
    def from_torch(m: nn.MultiheadAttention, *, backend: str = "auto") -> TorchMultiheadAttention:
        """A drop-in for ``m``: its weights (copied exactly) and settings, and torch's call.

        The result is a :class:`TorchMultiheadAttention` (a
        ``MultiHeadAttention``): ``forward(query, key, value, key_padding_mask=None,
        need_weights=True, attn_mask=None, average_attn_weights=True, is_causal=False)``
        returns ``(output, weights or None)`` as ``m`` does.
        """
        where = "attnkit.MultiHeadAttention.from_torch"
        if not isinstance(m, nn.MultiheadAttention):
            raise AttentionInputError(
                where,
                "m",
                f"`m` is a {type(m).__name__}, not an nn.MultiheadAttention.",
                got=type(m).__name__,
                expected="torch.nn.MultiheadAttention",
            )
        if m.bias_k is not None or m.add_zero_attn:
            raise AttentionInputError(
                where,
                "m",
                "add_bias_kv / add_zero_attn have no attnkit equivalent.",
                got=f"add_bias_kv={m.bias_k is not None}  add_zero_attn={m.add_zero_attn}",
                expected="an nn.MultiheadAttention built without add_bias_kv and add_zero_attn",
            )
        ref = m.out_proj.weight
        has_bias = m.in_proj_bias is not None
        mod = TorchMultiheadAttention(
            m.embed_dim,
            m.num_heads,
            kdim=m.kdim,
            vdim=m.vdim,
            bias=has_bias,
            dropout=m.dropout,
            batch_first=m.batch_first,
            backend=backend,
            device=ref.device,
            dtype=ref.dtype,
        )
        with torch.no_grad():
            if m._qkv_same_embed_dim:
                wq, wk, wv = torch.chunk(m.in_proj_weight, 3)
            else:
                wq, wk, wv = m.q_proj_weight, m.k_proj_weight, m.v_proj_weight
            for proj, w in ((mod.q_proj, wq), (mod.k_proj, wk), (mod.v_proj, wv)):
                proj.weight.copy_(w)
            if m.in_proj_bias is not None:
                for proj, b in zip(
                    (mod.q_proj, mod.k_proj, mod.v_proj),
                    torch.chunk(m.in_proj_bias, 3),
                    strict=True,
                ):
                    proj.bias.copy_(b)
            out = mod.out_proj
            assert isinstance(out, nn.Linear)  # always built with an output projection here
            out.weight.copy_(m.out_proj.weight)
            if m.out_proj.bias is not None:
                out.bias.copy_(m.out_proj.bias)
        return mod.train(m.training)

    def to_torch(self) -> nn.MultiheadAttention:
        """An ``nn.MultiheadAttention`` with this module's weights (copied exactly)."""
        where = "attnkit.MultiHeadAttention.to_torch"
        E, H = self.embed_dim, self.num_heads
        out = self.out_proj
        problems = []
        if self.num_kv_heads != H:
            problems.append(f"num_kv_heads={self.num_kv_heads} != num_heads={H}")
        if self.head_dim * H != E or self.v_head_dim != self.head_dim:
            problems.append(f"head_dim={self.head_dim}, v_head_dim={self.v_head_dim} with E={E}")
        if not isinstance(out, nn.Linear):
            problems.append("no output projection")
        if self.causal:
            problems.append("causal=True (torch's module has no causal setting)")
        if self.rope is not None:
            problems.append("rope (torch's module has no rotary embedding)")
        if self.sinks is not None:
            problems.append("learned sinks (torch's module has no attention sinks)")
        if problems:
            raise AttentionInputError(
                where,
                "self",
                "this module has no nn.MultiheadAttention equivalent: " + "; ".join(problems) + ".",
                got=repr(self),
                expected="num_kv_heads == num_heads, head_dim == v_head_dim == embed_dim // "
                "num_heads, an output projection, causal=False, no rope, no sinks",
                fix="keep the attnkit module; torch's cannot express these settings",
            )
        assert isinstance(out, nn.Linear)
        ref = out.weight
        m = nn.MultiheadAttention(
            E,
            H,
            dropout=self.dropout,
            bias=self.q_proj.bias is not None,
            kdim=self.kdim,
            vdim=self.vdim,
            batch_first=self.batch_first,
            device=ref.device,
            dtype=ref.dtype,
        )
        with torch.no_grad():
            weights = [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]
            if m._qkv_same_embed_dim:
                m.in_proj_weight.copy_(torch.cat(weights))
            else:
                for target, w in zip(
                    (m.q_proj_weight, m.k_proj_weight, m.v_proj_weight), weights, strict=True
                ):
                    target.copy_(w)
            if m.in_proj_bias is not None:
                m.in_proj_bias.copy_(
                    torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias])
                )
            m.out_proj.weight.copy_(out.weight)
            if m.out_proj.bias is not None:
                m.out_proj.bias.copy_(out.bias)
        return m.train(self.training)


class SelfAttention(AttentionBase):
    """Single-head self-attention without output projection, as written by hand in seed 000.

    ``x (B, L, E) -> (B, L, v_head_dim)``; queries and keys are ``Linear(E, head_dim)``
    projections of ``x``, values ``Linear(E, v_head_dim)`` (default ``head_dim``; seed 003
    uses d_q = d_k = 24 and d_v = 28), no bias by default. The mask keywords, ``sinks=True``
    (one learned sink, ``sinks (1,)``) and the call's ``sinks=`` are those of
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
        sinks: bool = False,
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
            sinks=sinks,
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
        sinks: torch.Tensor | None = None,
    ) -> AttentionOutput:
        masks = MaskArgs(mask, key_padding_mask, attention_mask, attn_mask, is_causal)
        return self._attend(x, x, x, masks, need_weights, average_attn_weights, sinks=sinks)


class CrossAttention(AttentionBase):
    """Multi-head cross-attention: queries from ``x``, keys and values from ``context``.

    ``x (B, L, E)``, ``context (B, S, context_dim)`` with any ``S``; output ``(B, L, E)``.
    Same keywords as :class:`MultiHeadAttention` (``context_dim`` sets both ``kdim`` and
    ``vdim``), ``sinks=True`` and the call's ``sinks=`` included.

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
        sinks: bool = False,
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
            sinks=sinks,
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
        sinks: torch.Tensor | None = None,
    ) -> AttentionOutput:
        masks = MaskArgs(mask, key_padding_mask, attention_mask, attn_mask, is_causal)
        return self._attend(
            x, context, context, masks, need_weights, average_attn_weights, sinks=sinks
        )


class TorchMultiheadAttention(MultiHeadAttention):
    """A :class:`~attnkit.MultiHeadAttention` called as ``nn.MultiheadAttention`` is.

    What ``MultiHeadAttention.from_torch(m)`` returns: ``m``'s weights and settings, and
    ``forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
    average_attn_weights=True, is_causal=False)`` with torch's defaults, meanings and layout:

    - inputs ``(L, B, E)``, or ``(B, L, E)`` if ``m`` was ``batch_first``; unbatched
      ``(L, E)`` too (then ``key_padding_mask (S,)``, ``attn_mask (L, S)`` or ``(H, L, S)``);
    - ``key_padding_mask (B, S)`` and ``attn_mask (L, S)`` / ``(B * H, L, S)``: bool True =
      ignore, or float added; ``is_causal=True`` needs ``attn_mask``, which is applied;
    - returns the tuple ``(output, weights or None)``: output in the input's layout; weights
      ``(B, L, S)`` averaged over heads, or ``(B, H, L, S)`` with
      ``average_attn_weights=False`` (batch first whatever the layout, as torch's).

    The one difference: where a query has no key to attend to (a batch row all padding),
    torch gives NaN (with weights, or on its fast path); attnkit gives attention output 0
    (so the output is ``out_proj``'s bias, as torch's other path gives) and weights 0.
    attnkit's own keywords (``mask``, ``attention_mask``, ``kv_cache``, ``positions``,
    ``sinks``) still work. Construct it with :class:`~attnkit.MultiHeadAttention`'s
    arguments, or with ``MultiHeadAttention.from_torch(m)``.

    >>> m = nn.MultiheadAttention(8, 2)
    >>> out, w = MultiHeadAttention.from_torch(m)(*[torch.randn(5, 3, 8)] * 3)
    >>> out.shape, w.shape
    (torch.Size([5, 3, 8]), torch.Size([3, 5, 5]))
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._where = "attnkit.interop.TorchMultiheadAttention"  # named so in its messages

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
        *,
        mask: Mask | None = None,
        attention_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> AttentionOutput:
        key = query if key is None else key
        value = key if value is None else value
        unbatched = isinstance(query, torch.Tensor) and query.dim() == 2
        if unbatched:  # torch's (L, E): a batch of one
            d = 0 if self.batch_first else 1
            same_key, same_value = key is query, value is key
            query = query.unsqueeze(d)
            key = query if same_key else _batch_of_one(key, 2, d)
            value = key if same_value else _batch_of_one(value, 2, d)
            if key_padding_mask is not None:
                key_padding_mask = _batch_of_one(key_padding_mask, 1, 0)
            if attention_mask is not None:
                attention_mask = _batch_of_one(attention_mask, 1, 0)
        out = super().forward(
            query,
            key,
            value,
            mask=mask,
            key_padding_mask=key_padding_mask,
            attention_mask=attention_mask,
            attn_mask=attn_mask,
            is_causal=is_causal,
            need_weights=need_weights,
            average_attn_weights=average_attn_weights,
            kv_cache=kv_cache,
            positions=positions,
            sinks=sinks,
        )
        if not unbatched:
            return out
        weights = None if out.weights is None else out.weights.squeeze(0)
        return AttentionOutput(out.output.squeeze(0 if self.batch_first else 1), weights)


def _batch_of_one(t: torch.Tensor, unbatched_dims: int, d: int) -> torch.Tensor:
    """``t`` with a batch dim of 1 at ``d`` when it has ``unbatched_dims`` dims, else ``t``."""
    if isinstance(t, torch.Tensor) and t.dim() == unbatched_dims:
        return t.unsqueeze(d)
    return t
