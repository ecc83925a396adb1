"""Sequence parallelism for a model: :class:`SequenceParallel` wraps a MultiHeadAttention.

Dimension legend: B batch, n this rank's tokens, N = P * n the whole sequence, E model width,
H query heads, Hkv key/value heads, Dk / Dv head dims, P ranks.

Everything in a transformer except attention works token by token (projections, MLP,
LayerNorm, residuals), so it runs unchanged on a shard of the sequence. Only attention needs
the other ranks' tokens: the wrapper runs the module's own projections on the shard and
:func:`~attnkit.distributed.ring_attention` in between. It shares the module's projection
layers (same parameters, same ``state_dict`` keys), so :func:`parallelize` can swap it in
for every :class:`~attnkit.MultiHeadAttention` of a model and leave the rest alone.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from attnkit.distributed.ring import ring_attention
from attnkit.distributed.sharding import group_rank_and_size, shard_positions
from attnkit.errors import AttentionInputError, shape_str
from attnkit.functional import AttentionOutput
from attnkit.heads import merge_heads, split_heads
from attnkit.masks import MaskSpec, key_mask
from attnkit.modules.attention import MultiHeadAttention
from attnkit.modules.kv_cache import KVCache
from attnkit.modules.masking import key_part
from attnkit.modules.sinks import module_sinks

__all__ = ["SequenceParallel", "parallelize"]

WHERE = "attnkit.distributed.SequenceParallel"


class SequenceParallel(nn.Module):
    """``module`` (a :class:`~attnkit.MultiHeadAttention`) run on a sequence sharded over ``group``.

    Same ``forward`` as the module, on this rank's shard: ``query (B, n, E)`` (``(n, B, E)``
    with ``batch_first=False``) as :func:`~attnkit.distributed.shard` makes it, with
    ``causal=module.causal`` (the zigzag layout for a causal module). ``key``/``value`` default
    to the query and, when given, are shards of the same kind.

    - ``mask``: ``None`` or a spec from :mod:`attnkit.masks` over the whole sequence.
    - ``key_padding_mask``: bool ``(B, N)`` over the whole sequence, True = padding (as in
      torch); or its positive twin ``attention_mask``, bool or 0/1 ints ``(B, N)``, True/1 =
      a real key.
    - ``positions``: for a module with a rotary embedding, the global positions of the shard's
      tokens; default :func:`~attnkit.distributed.shard_positions`.
    - ``sinks``: for a module without learned sinks, the call's: ``(H,)``, the same on every
      rank, or this rank's query rows' ``(B, H, n)`` / ``(1, H, n)`` (see
      :func:`~attnkit.distributed.ring_attention`).

    Returns :class:`~attnkit.AttentionOutput` ``(output (B, n, E), None)``: the weights are
    never materialised. Attention dropout in training mode and a KV cache are refused (the
    one would not be exact, the other decodes on one process).

    The wrapper shares the module's projections, rotary embedding and learned sinks, so its
    ``state_dict`` has the module's keys and training updates the module too. Like the
    projections' gradients, the learned sinks' gradient on a rank is its tokens' part.

    >>> # on every rank: sp = SequenceParallel(mha); y = sp(shard(x, causal=mha.causal)).output
    """

    def __init__(
        self,
        module: MultiHeadAttention,
        group: dist.ProcessGroup | None = None,
        *,
        timeout: float | timedelta | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, MultiHeadAttention):
            raise AttentionInputError(
                WHERE,
                "module",
                f"SequenceParallel wraps an attnkit.MultiHeadAttention, not a "
                f"{type(module).__name__}.",
                got=f"module: {type(module).__name__}",
                expected="an attnkit.MultiHeadAttention",
                fix="nn.MultiheadAttention converts with attnkit.MultiHeadAttention.from_torch(m)",
            )
        self.q_proj, self.k_proj, self.v_proj = module.q_proj, module.k_proj, module.v_proj
        self.out_proj = module.out_proj
        self.rope = module.rope
        self.sinks = module.sinks  # (H,) or None, the module's parameter (state_dict key "sinks")
        self.embed_dim, self.kdim, self.vdim = module.embed_dim, module.kdim, module.vdim
        self.num_heads, self.num_kv_heads = module.num_heads, module.num_kv_heads
        self.causal, self.batch_first = module.causal, module.batch_first
        self.dropout = module.dropout
        self._batch_first_inputs = module._batch_first_inputs  # the module's checks, messages
        self.group = group
        self.timeout = timeout

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, causal={self.causal}"
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        *,
        mask: MaskSpec | None = None,
        key_padding_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        need_weights: bool = False,
        kv_cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> AttentionOutput:
        if kv_cache is not None:
            raise AttentionInputError(
                WHERE,
                "kv_cache",
                "a KV cache decodes token by token on one process; it is not sharded.",
                got="kv_cache given",
                expected="kv_cache=None",
                fix="decode on one process with the unwrapped module (the same parameters)",
            )
        if need_weights:
            raise AttentionInputError(
                WHERE,
                "need_weights",
                "ring attention never materialises the attention weights.",
                got="need_weights=True",
                expected="need_weights=False",
                fix="look at the weights of a shorter sequence on one process "
                "(attnkit.MultiHeadAttention with need_weights=True)",
            )
        if self.training and self.dropout > 0:
            raise AttentionInputError(
                WHERE,
                "dropout",
                "attention dropout is not supported in sequence-parallel mode.",
                got=f"dropout={self.dropout} in training mode",
                expected="dropout=0.0, or eval mode",
                fix="build the module with dropout=0.0 (residual dropout elsewhere is fine)",
            )
        key = query if key is None else key
        value = key if value is None else value
        query, key, value = self._batch_first_inputs(query, key, value)  # (B, n, E)
        if key_padding_mask is not None or attention_mask is not None:
            mask = self._with_padding(key_padding_mask, attention_mask, mask, key)
        q = split_heads(self.q_proj(query), self.num_heads)  # (B, H, n, Dk)
        k = split_heads(self.k_proj(key), self.num_kv_heads)  # (B, Hkv, n, Dk)
        v = split_heads(self.v_proj(value), self.num_kv_heads)  # (B, Hkv, n, Dv)
        sinks = module_sinks(WHERE, self.sinks, sinks, q)  # (H,) or (B|1, H, n)
        if self.rope is not None:  # rotate at the tokens' places in the whole sequence
            if positions is None:
                positions = shard_positions(
                    query.shape[1] * self._world(), causal=self.causal, group=self.group
                ).to(q.device)  # (n,)
            q, k = self.rope(q, positions), self.rope(k, positions)
        elif positions is not None:
            raise AttentionInputError(
                WHERE,
                "positions",
                "`positions` is given but this module has no rotary embedding to use it.",
                got="positions given, rope=None",
                expected="positions=None, or a module built with rope=RotaryEmbedding(...)",
            )
        out = ring_attention(
            q,
            k,
            v,
            mask=mask,
            causal=self.causal,
            group=self.group,
            timeout=self.timeout,
            sinks=sinks,
        )  # (B, H, n, Dv)
        y = self.out_proj(merge_heads(out))  # (B, n, E)
        return AttentionOutput(y.transpose(0, 1) if not self.batch_first else y, None)

    def _world(self) -> int:
        return group_rank_and_size(self.group, WHERE)[1]

    def _with_padding(
        self,
        kpm: torch.Tensor | None,
        real: torch.Tensor | None,
        mask: MaskSpec | None,
        key: torch.Tensor,
    ) -> MaskSpec:
        """``mask`` and the key mask (either form) over the whole sequence, as one spec."""
        B, N = key.shape[0], key.shape[1] * self._world()
        name, t = ("key_padding_mask", kpm) if kpm is not None else ("attention_mask", real)
        if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.shape != (B, N):
            got = (
                shape_str(name, t, ("B", "N")) + f" {t.dtype}"
                if isinstance(t, torch.Tensor)
                else type(t).__name__
            )
            meaning = "bool, True = padding" if kpm is not None else "True/1 = a real key"
            fix = "pass the same full mask on every rank (not a shard of it)"
            if isinstance(t, torch.Tensor) and tuple(t.shape) == (N, B):
                fix = f"it looks transposed: use {name}.T"
            raise AttentionInputError(
                WHERE,
                name,
                f"`{name}` covers the whole sequence: (B, N), N = world size * shard length; "
                "ring attention takes no float mask.",
                got=f"{got}  target (B={B}, N={N})",
                expected=f"{name} (B, N) over all ranks' tokens, {meaning}",
                fix=fix,
            )
        keys = key_part(WHERE, kpm, real, B, N, key.dtype)  # (B, 1, 1, N) bool, True = real
        assert keys is not None  # one of the two was given
        keep = key_mask(keys[:, 0, 0, :])
        return keep if mask is None else mask & keep


def parallelize(
    model: nn.Module,
    group: dist.ProcessGroup | None = None,
    *,
    timeout: float | timedelta | None = None,
) -> nn.Module:
    """Swap every :class:`~attnkit.MultiHeadAttention` in ``model`` for a
    :class:`SequenceParallel` wrapper of it, in place; return the model.

    The model then runs on this rank's shard of the sequence (``shard(x, causal=...)``) with
    the same parameters and ``state_dict`` keys. Position embeddings must use the shard's
    global positions (:func:`~attnkit.distributed.shard_positions`).
    """
    if isinstance(model, MultiHeadAttention):
        return SequenceParallel(model, group, timeout=timeout)
    for name, child in list(model.named_children()):
        if isinstance(child, MultiHeadAttention):
            setattr(model, name, SequenceParallel(child, group, timeout=timeout))
        else:
            parallelize(child, group, timeout=timeout)
    return model
